"""Device time of decode attention, Q4 (`runtime.q4sdpa`) against MLX's fused bf16 SDPA, by Nsight Compute.

Timing many calls from Python measures the host as well when a call is short (a kernel
launch through `mx.fast.cuda_kernel` costs the host microseconds), so this reads
the kernels' own durations. `--run` executes one case three times (the kernels Nsight
Compute should time); without it, the script runs Nsight Compute on every case and
writes a table of device microseconds per call (the mean of three calls):

    python -m benchmarks.q4sdpa_ncu --contexts 16384,32768 --rows 1,8 --settings 2048/2,1024/4

`--key-bits 6 --rotated --rope` times the call as the engine makes it with the default
scheme (k6v4-g64-hadamard): 6-bit keys, the Hadamard rotation and RoPE inside the kernels.
The columns partial_us and reduce_us hold the two kernels a call made before they became one (a run on an
older tree); now the one kernel's time is device_us.
"""

from __future__ import annotations

import argparse
import shutil
import subprocess
import sys

import mlx.core as mx

from benchmarks.common import environment, ncu_records, write_results
from benchmarks.q4sdpa_tune import D, GROUP, HQ, _packed, _settings, rope_inv_freq, use_setting
from runtime import q4sdpa
from runtime.q4cache import row_array

COLUMNS = ["context", "rows", "kernel", "setting", "device_us", "partial_us", "reduce_us", "x_fp16"]
KERNELS = "regex:sdpa|kvactors_q4"  # MLX's fused attention kernels and ours


def run_case(context: int, rows: int, setting: str, key_bits: int = 4, rotated: bool = False,
             rope: bool = False) -> None:
    """Three calls of one case: 'fp16' (MLX's fused kernel over bf16 K/V) or a q4sdpa setting, the latter
    reading `key_bits`-bit keys, rotating (`rotated`) and applying RoPE (`rope`) as the engine asks."""
    kq, vq = _packed(rows, context, 3, key_bits)
    q = mx.random.normal((rows, HQ, 1, D), key=mx.random.key(1)).astype(mx.bfloat16)
    if setting == "fp16":
        k16 = mx.dequantize(*kq, group_size=GROUP, bits=key_bits)
        v16 = mx.dequantize(*vq, group_size=GROUP, bits=4)
        mx.eval(k16, v16)
        call = lambda: mx.fast.scaled_dot_product_attention(q, k16, v16, scale=D ** -0.5)  # noqa: E731
    else:
        use_setting(_settings(setting)[0])
        start, positions = row_array([0] * rows), row_array([context - 1] * rows)  # as a batch cache holds them
        inv_freq = rope_inv_freq()
        call = lambda: q4sdpa.q4_decode_sdpa(q, kq, vq, start, context, D ** -0.5, GROUP,  # noqa: E731
                                             rotated=rotated, rope=(positions, inv_freq) if rope else None)
    for _ in range(3):
        mx.eval(call())
        mx.synchronize()


def device_us(context: int, rows: int, setting: str, ncu: str, flags=()) -> dict:
    """Mean device microseconds per call of one case, from Nsight Compute's kernel durations: the sum
    ('total') and each kernel's ('partial', 'reduce'; for MLX's kernels the sum only)."""
    out = subprocess.run(
        [ncu, "--clock-control", "none", "-k", KERNELS, "--metrics", "gpu__time_duration.sum", "--csv",
         sys.executable, "-m", "benchmarks.q4sdpa_ncu", "--run", "--contexts", str(context), "--rows", str(rows),
         "--settings", setting, *flags],
        capture_output=True, text=True, check=True).stdout
    times = dict(total=0.0, partial=0.0, reduce=0.0)
    for row, us in ncu_records(out):
        times["total"] += us / 3
        for part in ("partial", "reduce"):
            if f"q4_decode_{part}" in row["Kernel Name"]:
                times[part] += us / 3
    return times


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--contexts", default="16384,32768")
    parser.add_argument("--rows", default="1,8")
    parser.add_argument("--settings", default=f"{q4sdpa.CHUNKS}/{q4sdpa.MIN_CHUNK}/{q4sdpa.WARPS}/{q4sdpa.STAGES}",
                        help="q4sdpa settings CHUNKS/MIN_CHUNK/WARPS[/STAGES], comma-separated")
    parser.add_argument("--key-bits", type=int, default=4, choices=q4sdpa.KEY_BITS, help="bits of the keys")
    parser.add_argument("--rotated", action="store_true", help="Hadamard-rotated cache (rotation in the kernels)")
    parser.add_argument("--rope", action="store_true", help="RoPE applied to the queries inside the kernel")
    parser.add_argument("--run", action="store_true", help="run one case (as Nsight Compute's target)")
    parser.add_argument("--ncu", default=shutil.which("ncu") or "ncu")
    parser.add_argument("--out", default=None, help="output folder (default: a fresh benchmark-runs/ folder)")
    args = parser.parse_args(argv)
    contexts = [int(c) for c in args.contexts.split(",")]
    row_counts = [int(r) for r in args.rows.split(",")]
    if args.run:
        run_case(contexts[0], row_counts[0], args.settings, args.key_bits, args.rotated, args.rope)
        return 0
    flags = [f"--key-bits={args.key_bits}"] + ["--rotated"] * args.rotated + ["--rope"] * args.rope
    from pathlib import Path

    from benchmarks.common import RESULTS

    rows = []
    for context in contexts:
        for n in row_counts:
            fp16 = device_us(context, n, "fp16", args.ncu)["total"]
            rows.append(dict(context=context, rows=n, kernel="mlx fused sdpa (bf16 K/V)", setting="-",
                             device_us=fp16, partial_us="-", reduce_us="-", x_fp16=1.0))
            for setting in args.settings.split(","):
                us = device_us(context, n, setting, args.ncu, flags)
                rows.append(dict(context=context, rows=n, kernel="q4sdpa", setting=setting,
                                 device_us=us["total"], partial_us=us["partial"], reduce_us=us["reduce"],
                                 x_fp16=us["total"] / fp16))
            print(f"context {context} rows {n} done", file=sys.stderr, flush=True)
    notes = ("Device time per call from Nsight Compute (gpu__time_duration, clocks not locked), the mean of three "
             f"calls; 8B shape ({HQ} query heads, 8 kv heads, head dim {D}, group {GROUP}), one query per row; "
             f"{args.key_bits}-bit keys, 4-bit values{', rotated' if args.rotated else ''}"
             f"{', RoPE in the kernel' if args.rope else ''}; "
             "setting = blocks per row and kv head / fewest keys per block / warps per block / tiles in flight a warp.")
    write_results("q4sdpa_device", environment(), rows, COLUMNS, Path(args.out) if args.out else RESULTS, notes)
    return 0


if __name__ == "__main__":
    sys.exit(main())
