#!/bin/bash
# Same-machine A/B of a decode step's host time: anatomy runs of this tree and of an older one, alternating.
#
#   git archive <commit> runtime benchmarks actors | (mkdir -p OLD && tar x -C OLD)
#   benchmarks/anatomy_ab.sh OLD OUT [runs] [anatomy options...]
#
# Run from the repository root with PYTHONPATH holding MLX (and nothing of this repo);
# writes OUT/anatomy-{new,old}-N.{md,json}. Host speed differs by up to 15% between
# machines of one kind, so compare only runs of one call.
set -euo pipefail
old=$(cd "$1" && pwd); out=$2; runs=${3:-2}; shift $(( $# < 3 ? $# : 3 ))
opts=("$@"); [ ${#opts[@]} -eq 0 ] && opts=(--model llama-8b-shape --context 3072 --batches 5,8)
base=$PYTHONPATH
for i in $(seq "$runs"); do
  PYTHONPATH=$base:$PWD python3 -m benchmarks.anatomy "${opts[@]}" --out "$out" --name "anatomy-new-$i"
  (cd "$old" && PYTHONPATH=$base:$old python3 -m benchmarks.anatomy "${opts[@]}" --out "$out" --name "anatomy-old-$i")
done
