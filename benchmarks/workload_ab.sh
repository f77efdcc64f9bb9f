#!/bin/bash
# Same-machine A/B of the multi-agent workload's variant (c): runs of this tree and of an older one, alternating
# (this tree first in odd pairs, the older one first in even pairs).
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
run_new() { PYTHONPATH=$base:$PWD python3 -m benchmarks.workload "${opts[@]}" --out "$out" --name "workload-new-$1"; }
run_old() { (cd "$old" && PYTHONPATH=$base:$old python3 -m benchmarks.workload "${opts[@]}" --out "$out" --name "workload-old-$1"); }
for i in $(seq "$runs"); do  # the order flips every pair: a call's first and later runs differ by more than changes do
  if [ $((i % 2)) -eq 1 ]; then run_new "$i"; run_old "$i"; else run_old "$i"; run_new "$i"; fi
done
