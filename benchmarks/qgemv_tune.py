"""Tune `runtime.qgemv`: microseconds per call for each (columns per warp, warps per block)
at each row count, on the 8B shape's matrices, against MLX's own quantized matmul.

Every setting must give bitwise the same output (a row's sum does not depend on the
launch shape); the benchmark checks it and says so. The fastest setting per row count
is what `qgemv.columns` and `qgemv.WARPS` should say.

    python -m benchmarks.qgemv_tune            # CUDA only
"""

from __future__ import annotations

import mlx.core as mx

from benchmarks.common import bench_parser, environment, kernel_us, write_results
from runtime import qgemv

COLUMNS = ["shape", "rows", "cols", "warps", "us", "mlx_us", "note"]
SHAPES = [(4096, 4096), (1024, 4096), (14336, 4096), (4096, 14336)]
ROWS = [1, 2, 3, 4, 5, 6, 8, 12, 16]


def main(argv=None) -> int:
    ap = bench_parser(__doc__)
    ap.add_argument("--cols", default="1,2,4,8", help="columns per warp to try (default: %(default)s)")
    ap.add_argument("--warps", default="2,4,8", help="warps per block to try (default: %(default)s)")
    args = ap.parse_args(argv)
    env = environment()
    print(env, flush=True)
    if not qgemv.available():
        raise SystemExit("this benchmark needs a CUDA GPU")
    rows_out = []
    default_columns, default_warps = qgemv.columns, qgemv.WARPS
    for n, k in SHAPES:
        w = mx.random.normal((n, k), key=mx.random.key(n + k)).astype(mx.bfloat16)
        packed = mx.quantize(w, group_size=64, bits=4)
        mx.eval(packed)
        for m in ROWS:
            x = mx.random.normal((m, k), key=mx.random.key(m)).astype(mx.bfloat16)
            mx.eval(x)
            mlx_us = kernel_us(lambda: mx.quantized_matmul(x, *packed, transpose=True, group_size=64, bits=4), 60)
            reference = qgemv.qgemv(x, *packed, 64)
            mx.eval(reference)
            current = kernel_us(lambda: qgemv.qgemv(x, *packed, 64), 60)
            best = None
            for c in [int(v) for v in args.cols.split(",")]:
                for wp in [int(v) for v in args.warps.split(",")]:
                    qgemv.columns, qgemv.WARPS = (lambda rows, c=c: c), wp
                    qgemv._launch.clear()
                    try:
                        out = qgemv.qgemv(x, *packed, 64)
                        same = mx.array_equal(out, reference).item()
                        us = kernel_us(lambda: qgemv.qgemv(x, *packed, 64), 60)
                    finally:
                        qgemv.columns, qgemv.WARPS = default_columns, default_warps
                        qgemv._launch.clear()
                    row = dict(shape=f"{n}x{k}", rows=m, cols=c, warps=wp, us=round(us, 1), mlx_us=round(mlx_us, 1),
                               note="" if same else "OUTPUT DIFFERS")
                    if best is None or us < best["us"]:
                        best = row
            best = {**best, "note": (best["note"] + f" best; current setting {current:.1f} us").strip()}
            rows_out.append(best)
            print(best, flush=True)
    write_results(args.name or "qgemv_tune", env, rows_out, COLUMNS, args.out,
                  notes="us: 60 independent calls evaluated together, per call; the best (cols, warps) per shape and row count; "
                        "4-bit g64 weights, bf16 x.")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
