"""Prefill's matrix products: MLX's 4-bit quantized matmul, `runtime.qgemm`, and dequantize + 16-bit GEMM.

For the weight shapes of the 8B model (q/o 4096x4096, k/v 1024x4096, gate/up
14336x4096, down 4096x14336; 4-bit, group 64, bf16) and a range of rows M (the
tokens of a prefill chunk), the device time per call of `mx.quantized_matmul`,
of `qgemm` (both launches) and of `mx.dequantize` followed by `x @ w.T`
(`common.device_us`: CUPTI where installed). Each call reads one of several
copies of the weight, enough to pass the GPU's L2 (`L2_BYTES`), so the
weights come from memory as they do in a model's forward pass; a kernel timed
on one copy reads it from L2 and looks faster than it runs in place.

    python -m benchmarks.prefill_gemm --out DIR      # GPU
"""
from __future__ import annotations

import sys

import mlx.core as mx

from benchmarks.common import bench_parser, device_us, environment, write_results
from runtime import qgemm

SHAPES = {"q/o": (4096, 4096), "k/v": (1024, 4096), "gate/up": (14336, 4096), "down": (4096, 14336)}
PER_LAYER = {"q/o": 2, "k/v": 2, "gate/up": 2, "down": 1}
COLUMNS = ["rows", "weight", "qmm_us", "qgemm_us", "dequant_gemm_us", "qmm_x_qgemm", "qmm_x_dequant"]
L2_BYTES = 50 << 20  # an H100's L2: the copies of a weight together hold at least twice this
ROUTES = {
    "qmm_us": lambda x, p: mx.quantized_matmul(x, *p, transpose=True, group_size=64, bits=4),
    "qgemm_us": lambda x, p: qgemm.qgemm(x, *p, 64),
    "dequant_gemm_us": lambda x, p: x @ mx.dequantize(*p, group_size=64, bits=4).T,
}


def measure(rows: int, n: int, k: int, dtype=mx.bfloat16) -> dict:
    """Device microseconds per call of each route (`ROUTES`) for x (rows, k) times a 4-bit (n, k) weight,
    cycling through copies of the weight that together pass L2 twice."""
    copies = max(2, -(-2 * L2_BYTES // (n * k // 2)))
    packed = []
    for i in range(copies):
        w = mx.random.normal((n, k), key=mx.random.key(i)).astype(dtype) * 0.02
        packed.append(mx.quantize(w, group_size=64, bits=4))
        mx.eval(packed[-1])
    x = mx.random.normal((rows, k)).astype(dtype)
    mx.eval(x)
    return {name: device_us([lambda p=p: route(x, p) for p in packed], reps=4 * copies) for name, route in ROUTES.items()}


def main(argv=None) -> int:
    ap = bench_parser(__doc__)
    ap.add_argument("--rows", default="64,128,192,256,1024")
    args = ap.parse_args(argv)
    env = environment()
    print(env, flush=True)
    results = []
    for m in (int(r) for r in args.rows.split(",")):
        layer = dict.fromkeys(ROUTES, 0.0)
        for name, (n, k) in SHAPES.items():
            times = measure(m, n, k)
            for route, us in times.items():
                layer[route] += PER_LAYER[name] * us
            results.append(_row(m, f"{name} {n}x{k}", times))
            print(results[-1], flush=True)
        results.append(_row(m, "one layer", layer))
    write_results(args.name or "prefill_gemm", env, results, COLUMNS, args.out,
                  notes="4-bit weights, group 64, bf16; device microseconds per call, weights read from memory "
                        "(copies past L2); qmm_x_*: MLX's quantized matmul time over the other route's. "
                        "'one layer' sums a llama layer's 7 products.")
    return 0


def _row(rows: int, weight: str, times: dict) -> dict:
    return dict(rows=rows, weight=weight, **times, qmm_x_qgemm=times["qmm_us"] / times["qgemm_us"],
                qmm_x_dequant=times["qmm_us"] / times["dequant_gemm_us"])


if __name__ == "__main__":
    sys.exit(main())
