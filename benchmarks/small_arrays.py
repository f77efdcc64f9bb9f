"""Where MLX-CUDA keeps small arrays, and what a kernel pays to read them.

MLX-CUDA's allocator puts arrays of at most 8 bytes in a pool of managed memory advised
as accessed by the GPU, whatever wrote them: the GPU reads those pages where they are,
on the host, across PCIe. Larger arrays made from host data (`mx.array(list)`) are
managed memory that moves to the device at its first use there; arrays made by GPU
operations (over 8 bytes) are device memory. A kernel that reads a per-call parameter
from the small pool waits on PCIe in every block.

CUPTI busy time per call (chained calls, as `q4sdpa_tune` times them) of:

- a one-warp kernel that reads one int32 from arrays made each way, the same array every
  call or a fresh one per call (a fresh managed array costs its first read on the device),
  and one whose int32 output is 4 or 16 bytes long (the next call reads it);
- decode attention (`runtime.q4sdpa`, 8B shape, 6-bit rotated keys) whose rows' padding
  is a GPU-made array of one int32 a row (`mx.zeros`), or a batch cache's row array
  (`q4cache.row_array`: a buffer of at least 16 bytes).

    python -m benchmarks.small_arrays          # CUDA with cupti-python
"""

from __future__ import annotations

import argparse
import itertools
import sys
from pathlib import Path

import mlx.core as mx

from benchmarks.common import RESULTS, environment, write_results
from benchmarks.q4sdpa_tune import D, GROUP, HQ, _packed, chained_us, input_sets, median_timing, rope_inv_freq
from runtime import q4sdpa
from runtime.q4cache import row_array

COLUMNS = ["kernel", "context", "rows", "array", "busy_us", "kernels_us"]


def _reader():
    return mx.fast.cuda_kernel(name="kvactors_small_array_read", input_names=["inp", "x"], output_names=["out"],
                               source="out[0] = inp[0] + x[0];")


def read_cases() -> dict:
    """name -> a function making the array the reading kernel takes at each call."""
    same = {"host-made, 64 bytes": mx.array([1] * 16, dtype=mx.int32),
            "host-made, 4 bytes": mx.array([1], dtype=mx.int32),
            "GPU-made, 4 bytes": mx.zeros((1,), dtype=mx.int32) + 1,
            "row_array, one row": row_array([1])}
    mx.eval(list(same.values()))
    count = itertools.count(7)
    cases = {f"{name}, same array": (lambda x=x: x) for name, x in same.items()}
    cases.update({
        "host-made, 64 bytes, fresh each call": lambda: mx.array([next(count)] * 16, dtype=mx.int32),
        "host-made, 4 bytes, fresh each call": lambda: mx.array([next(count)], dtype=mx.int32),
        "row_array, one row, fresh each call": lambda: row_array([next(count)]),
    })
    return cases


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--cases", default="1024/1,16384/1,32768/1,16384/8",
                    help="decode attention's CONTEXT/ROWS cases, comma-separated (default: %(default)s)")
    ap.add_argument("--repeat", type=int, default=3, help="chains timed per case; each figure is their median")
    ap.add_argument("--out", default=RESULTS, type=Path, help="output folder (default: %(default)s)")
    ap.add_argument("--name", default="small_arrays")
    args = ap.parse_args(argv)
    env = environment()
    rows = []
    kernel = _reader()
    v0 = mx.zeros((4,), dtype=mx.int32) + 0
    mx.eval(v0)
    for name, make in read_cases().items():
        def call(v, make=make):
            return kernel(inputs=[v, make()], grid=(32, 1, 1), threadgroup=(32, 1, 1), output_shapes=[(4,)],
                          output_dtypes=[mx.int32])[0]
        _, busy, parts = median_timing([chained_us(call, [()], v0) for _ in range(args.repeat)])
        rows.append(dict(kernel="read one int32", context="", rows="", array=name, busy_us=busy, kernels_us=parts))
        print(rows[-1], file=sys.stderr, flush=True)
    for n in (1, 4):  # a kernel's output of 4 bytes (the small pool) or 16 (device memory), read by the next call
        def call(v, n=n):
            return kernel(inputs=[v, v], grid=(32, 1, 1), threadgroup=(32, 1, 1), output_shapes=[(n,)],
                          output_dtypes=[mx.int32])[0]
        _, busy, parts = median_timing([chained_us(call, [()], v0) for _ in range(args.repeat)])
        rows.append(dict(kernel="read and write one int32", context="", rows="", array=f"output of {4 * n} bytes",
                         busy_us=busy, kernels_us=parts))
        print(rows[-1], file=sys.stderr, flush=True)
    inv_freq = rope_inv_freq()
    for case in [c for c in args.cases.split(",") if c]:
        context, b = (int(x) for x in case.split("/"))
        kq, vq = _packed(b, context, context + b, 6)
        sets = input_sets(kq, vq)
        q = mx.random.normal((b, HQ, 1, D), key=mx.random.key(1)).astype(mx.bfloat16)
        starts = {"GPU-made, one int32 a row": mx.zeros((b,), dtype=mx.int32),
                  "row_array (as a batch cache holds it)": row_array([0] * b)}
        positions = row_array([context - 1] * b)
        mx.eval(sets, q, inv_freq, positions, list(starts.values()))
        runs = {name: [] for name in starts}
        for _ in range(args.repeat):  # every variant once a round
            for name, start in starts.items():
                runs[name].append(chained_us(
                    lambda x, k, v, start=start: q4sdpa.q4_decode_sdpa(x, k, v, start, context, D ** -0.5, GROUP,
                                                                       rotated=True, rope=(positions, inv_freq)),
                    sets, q))
        for name, timings in runs.items():
            _, busy, parts = median_timing(timings)
            rows.append(dict(kernel="q4sdpa decode", context=context, rows=b, array=name, busy_us=busy,
                             kernels_us=parts))
            print(rows[-1], file=sys.stderr, flush=True)
        del sets
    notes = ("busy_us: the kernels' own durations per call (CUPTI), the median of chains of 40 calls; q4sdpa: 8B "
             "shape (32 query heads, 8 kv heads, head dim 128), 6-bit keys, 4-bit values, rotated, RoPE in the "
             "kernel at positions held as a row array; `array` says how the rows' padding (q4sdpa) or the int read "
             "was made.")
    write_results(args.name, env, rows, COLUMNS, args.out, notes)
    return 0


if __name__ == "__main__":
    sys.exit(main())
