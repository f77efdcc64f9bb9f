"""Prefill's matrix products: MLX's 4-bit quantized matmul against dequantize + 16-bit GEMM.

For the weight shapes of the 8B model (q/o 4096x4096, k/v 1024x4096, gate/up
14336x4096, down 4096x14336; 4-bit, group 64, bf16) and a range of rows M (the
tokens of a prefill chunk), the time of `mx.quantized_matmul` and of
`mx.dequantize` followed by `x @ w.T`, each as a device throughput
(`common.kernel_us`). A hot turn prefills a few hundred tokens: where the
quantized kernel is slow for such M, dequantizing the layer's weights first pays.

    python -m benchmarks.prefill_gemm --out DIR      # GPU
"""

from __future__ import annotations

import sys

import mlx.core as mx

from benchmarks.common import bench_parser, environment, kernel_us, write_results

SHAPES = {"q/o": (4096, 4096), "k/v": (1024, 4096), "gate/up": (14336, 4096), "down": (4096, 14336)}
PER_LAYER = {"q/o": 2, "k/v": 2, "gate/up": 2, "down": 1}
COLUMNS = ["rows", "weight", "qmm_us", "dequant_gemm_us", "ratio"]


def measure(rows: int, n: int, k: int, dtype=mx.bfloat16) -> tuple[float, float]:
    """(quantized matmul us, dequantize + matmul us) for x (rows, k) times a 4-bit (n, k) weight."""
    w = mx.random.normal((n, k)).astype(dtype) * 0.02
    qw, scales, biases = mx.quantize(w, group_size=64, bits=4)
    x = mx.random.normal((rows, k)).astype(dtype)
    mx.eval(qw, scales, biases, x)
    qmm = kernel_us(lambda: mx.quantized_matmul(x, qw, scales, biases, transpose=True, group_size=64, bits=4), 20)
    deq = kernel_us(lambda: x @ mx.dequantize(qw, scales, biases, group_size=64, bits=4).T, 20)
    return qmm, deq


def main(argv=None) -> int:
    ap = bench_parser(__doc__)
    ap.add_argument("--rows", default="64,256,448,1024,2048")
    args = ap.parse_args(argv)
    env = environment()
    print(env, flush=True)
    results = []
    for m in (int(r) for r in args.rows.split(",")):
        layer = [0.0, 0.0]
        for name, (n, k) in SHAPES.items():
            qmm, deq = measure(m, n, k)
            layer[0] += PER_LAYER[name] * qmm
            layer[1] += PER_LAYER[name] * deq
            results.append(dict(rows=m, weight=f"{name} {n}x{k}", qmm_us=qmm, dequant_gemm_us=deq, ratio=qmm / deq))
            print(results[-1], flush=True)
        results.append(dict(rows=m, weight="one layer", qmm_us=layer[0], dequant_gemm_us=layer[1],
                            ratio=layer[0] / layer[1]))
    write_results(args.name or "prefill_gemm", env, results, COLUMNS, args.out,
                  notes="4-bit weights, group 64, bf16; microseconds per call as device throughput; "
                        "ratio > 1: dequantize + GEMM is faster. 'one layer' sums a llama layer's 7 products.")
    return 0


if __name__ == "__main__":
    sys.exit(main())
