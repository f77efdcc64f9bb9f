"""Tune `runtime.qgemv`: microseconds per call for each (TN, SPLIT) launch setting at each row
count, on the 8B shape's matrices, against MLX's own quantized matmul.

Each setting must keep a row's result independent of the other rows: the benchmark checks
that row 0 of every call equals the call on row 0 alone, and says so. The fastest setting
per shape is what `qgemv.setting` should pick. Below about 20 us a call, the figure is the
host's cost of launching custom kernels, not the device's: on an H100 every setting of
the 4096x4096 matrix measured 18-30 us, where its weights alone take about 3 us to read.

    python -m benchmarks.qgemv_tune            # CUDA only
"""

from __future__ import annotations

import mlx.core as mx

from benchmarks.common import bench_parser, environment, kernel_us, write_results
from runtime import qgemv

COLUMNS = ["shape", "rows", "tn", "split", "us", "mlx_us", "weight_gb_s", "note"]
SHAPES = [(4096, 4096), (1024, 4096), (14336, 4096), (4096, 14336)]


def main(argv=None) -> int:
    ap = bench_parser(__doc__)
    ap.add_argument("--rows", default="1,5,8,16", help="row counts (default: %(default)s)")
    ap.add_argument("--tn", default="1,2,4", help="16-column tiles per warp to try (default: %(default)s)")
    ap.add_argument("--split", default="2,4,8,16", help="warps along K to try (default: %(default)s)")
    args = ap.parse_args(argv)
    env = environment()
    print(env, flush=True)
    if not qgemv.available():
        raise SystemExit("this benchmark needs a CUDA GPU")
    rows_out, default = [], qgemv.setting
    for n, k in SHAPES:
        w = mx.random.normal((n, k), key=mx.random.key(n + k)).astype(mx.bfloat16)
        packed = mx.quantize(w, group_size=64, bits=4)
        mx.eval(packed)
        gb = sum(a.nbytes for a in packed) / 1e9
        for m in [int(v) for v in args.rows.split(",")]:
            x = mx.random.normal((m, k), key=mx.random.key(m)).astype(mx.bfloat16)
            mx.eval(x)
            mlx_us = kernel_us(lambda: mx.quantized_matmul(x, *packed, transpose=True, group_size=64, bits=4), 60)
            chosen = default(n, k)
            for tn in [int(v) for v in args.tn.split(",")]:
                for split in [int(v) for v in args.split.split(",")]:
                    if split > k // 64:
                        continue
                    qgemv.setting = lambda n_, k_, s=(tn, split): s
                    qgemv._launch.clear()
                    try:
                        out, alone = qgemv.qgemv(x, *packed, 64), qgemv.qgemv(x[:1], *packed, 64)
                        same = mx.array_equal(out[:1], alone).item()
                        us = kernel_us(lambda: qgemv.qgemv(x, *packed, 64), 60)
                    except RuntimeError as e:  # e.g. more registers than a block may have: no launch
                        same, us = None, float("nan")
                        print(f"{n}x{k} rows {m} tn {tn} split {split}: {e}", flush=True)
                    finally:
                        qgemv.setting = default
                        qgemv._launch.clear()
                    note = {True: "", False: "ROW 0 DIFFERS FROM ITS CALL ALONE", None: "does not launch"}[same]
                    note += " chosen" if (tn, split) == chosen else ""
                    row = dict(shape=f"{n}x{k}", rows=m, tn=tn, split=split, us=round(us, 1), mlx_us=round(mlx_us, 1),
                               weight_gb_s=round(gb / us * 1e6), note=note.strip())
                    rows_out.append(row)
                    print(row, flush=True)
    write_results(args.name or "qgemv_tune", env, rows_out, COLUMNS, args.out,
                  notes="us: 60 independent calls evaluated together, per call (device throughput while the host keeps "
                        "up); weight_gb_s: the packed weight's bytes (words, scales, biases) per us; 4-bit g64 weights, "
                        "bf16 x; 'chosen': what qgemv.setting picks for the shape.")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
