#!/bin/bash
# Same-machine A/B of the multi-agent workload's variant (c): runs of this tree and of an older one, alternating.
#
#   git archive <commit> runtime benchmarks actors | (mkdir -p OLD && tar x -C OLD)
#   benchmarks/workload_ab.sh OLD OUT [runs] [workload options...]
#
# Run from the repository root with PYTHONPATH holding MLX (and nothing of this repo);
# writes OUT/workload-{new,old}-N.{md,json}. Default options: the GPU workload, (c) alone.
# Host speed differs by up to 40% between machines of one kind, so compare only runs of one call.
set -euo pipefail
old=$(cd "$1" && pwd); out=$(mkdir -p "$2" && cd "$2" && pwd); runs=${3:-2}; shift $(( $# < 3 ? $# : 3 ))
opts=("$@")
[ ${#opts[@]} -eq 0 ] && opts=(--model llama-8b-shape --system-tokens 2000 --turn-tokens 200 --new 64 --variants c)
base=$PYTHONPATH
for i in $(seq "$runs"); do
  PYTHONPATH=$base:$PWD python3 -m benchmarks.workload "${opts[@]}" --out "$out" --name "workload-new-$i"
  (cd "$old" && PYTHONPATH=$base:$old python3 -m benchmarks.workload "${opts[@]}" --out "$out" --name "workload-old-$i")
done
