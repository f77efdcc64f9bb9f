#!/usr/bin/env bash
# Decode-step anatomy under MLX-CUDA's graph-batching settings (GPU only).
#
# MLX-CUDA records kernels into CUDA graphs of at most MLX_MAX_OPS_PER_BUFFER nodes
# (100 on an H100), keeps up to MLX_CUDA_GRAPH_CACHE_SIZE instantiated graphs, and can
# launch kernels one by one instead (MLX_USE_CUDA_GRAPHS=0). A decode step of an 8B
# model has about 1,100 primitives, so how they are batched decides much of its host
# time. Each setting runs `benchmarks.anatomy` in a fresh process (MLX reads these once).
#
#     bash benchmarks/graph_settings.sh [OUT_DIR] [CONTEXT] [BATCHES]
set -euo pipefail
out=${1:-benchmarks/results/h100}
context=${2:-3072}
batches=${3:-1,5,8}
run() {
    local name=$1; shift
    env "$@" python3 -m benchmarks.anatomy --model llama-8b-shape --context "$context" --batches "$batches" \
        --out "$out" --name "anatomy-graphs-$name"
}
run default
run graphs-off MLX_USE_CUDA_GRAPHS=0
run ops400 MLX_MAX_OPS_PER_BUFFER=400
run ops40 MLX_MAX_OPS_PER_BUFFER=40
