"""Where `runtime.qgemv`'s launches (or `runtime.qgemm`'s, `--kernel qgemm`) spend their device time, by Nsight Compute.

For each decode matrix of the 8B shape (q/k/v as one launch, o, gate/up/SiLU as one, down) and
each row count, one launch is profiled: its duration, registers, occupancy (the limit and what
was achieved), DRAM throughput and the warps' stall reasons per issued instruction. `--run`
executes the launches (Nsight Compute's target); without it, the script runs Nsight Compute on
them and writes a table:

    python -m benchmarks.qgemv_ncu --rows 1,8,16 --out benchmarks/results/h100/some-folder
"""

from __future__ import annotations

import argparse
import shutil
import subprocess
import sys
from pathlib import Path

import mlx.core as mx

from benchmarks.common import RESULTS, environment, ncu_records, write_results
from benchmarks.qgemv_tune import LAUNCHES, _call, load_module
from runtime import qgemm, qgemv

STALLS = ["long_scoreboard", "barrier", "short_scoreboard", "wait", "math_pipe_throttle", "lg_throttle",
          "mio_throttle", "not_selected", "selected", "dispatch_stall", "no_instruction", "membar", "drain"]
METRICS = {
    "gpu__time_duration.sum": "us",
    "launch__registers_per_thread": "regs",
    "launch__grid_size": "grid",
    "launch__block_size": "block",
    "launch__occupancy_limit_registers": "blocks_by_regs",
    "launch__occupancy_limit_shared_mem": "blocks_by_smem",
    "sm__warps_active.avg.pct_of_peak_sustained_active": "occupancy_pct",
    "dram__throughput.avg.pct_of_peak_sustained_elapsed": "dram_pct",
    "dram__bytes_read.sum": "dram_mb",
    **{f"smsp__average_warps_issue_stalled_{s}_per_issue_active.ratio": s for s in STALLS},
}
COLUMNS = ["launch", "rows", "us", "regs", "grid", "block", "blocks_by_regs", "blocks_by_smem", "occupancy_pct",
           "dram_pct", "dram_gb_s", "stalls"]


def run(rows: list[int], module=qgemv, dtype=mx.bfloat16, kernel: str = "qgemv") -> None:
    """One launch of every decode matrix at every row count, in the order `main` reads them (`kernel` "qgemm":
    a chunk's product launches, gate/up as two parts, through `qgemm.qgemm_parts`)."""
    for name, shapes in LAUNCHES.items():
        parts = []
        for i, (n, k) in enumerate(shapes):
            w = mx.random.normal((n, k), key=mx.random.key(i)).astype(dtype) * 0.02
            parts.append(tuple(mx.quantize(w, group_size=64, bits=4)))
        mx.eval(parts)
        for m in rows:
            x = mx.random.normal((m, 1, shapes[0][1]), key=mx.random.key(m)).astype(dtype)
            mx.eval(qgemm.qgemm_parts(x, parts, 64) if kernel == "qgemm" else _call(name, x, parts, module))
            mx.synchronize()


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", default="1,8,16", help="row counts (default: %(default)s)")
    ap.add_argument("--run", action="store_true", help="only run the launches (as Nsight Compute's target)")
    ap.add_argument("--module", default="", help="another version of runtime/qgemv.py to profile instead")
    ap.add_argument("--kernel", default="qgemv", choices=["qgemv", "qgemm"], help="whose launches to profile")
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16"], help="x's and the scales' type")
    ap.add_argument("--ncu", default=shutil.which("ncu") or "/usr/local/cuda/bin/ncu")
    ap.add_argument("--out", type=Path, default=RESULTS)
    ap.add_argument("--name", default="qgemv_ncu")
    args = ap.parse_args(argv)
    rows = [int(r) for r in args.rows.split(",")]
    if args.run:
        run(rows, load_module(args.module, "ncu") if args.module else qgemv, getattr(mx, args.dtype), args.kernel)
        return 0
    pattern = "regex:kvactors_qgemm4_tc" if args.kernel == "qgemm" else "regex:kvactors_.*qgemv"
    out = subprocess.run(
        [args.ncu, "--clock-control", "none", "-k", pattern, "--metrics", ",".join(METRICS), "--csv",
         sys.executable, "-m", "benchmarks.qgemv_ncu", "--run", "--rows", args.rows, "--dtype", args.dtype,
         "--kernel", args.kernel]
        + (["--module", args.module] if args.module else []),
        capture_output=True, text=True)
    if out.returncode:
        raise SystemExit(f"ncu failed:\n{out.stdout[-4000:]}\n{out.stderr[-4000:]}")
    launches = {}
    for rec, value in ncu_records(out.stdout):  # times in us, sizes in MB
        launches.setdefault(int(rec["ID"]), {})[METRICS[rec["Metric Name"]]] = value
    names = [(name, m) for name in LAUNCHES for m in rows]
    table = []
    for (name, m), (_, got) in zip(names, sorted(launches.items())):
        stalls = sorted(((got.get(s, 0.0), s) for s in STALLS), reverse=True)[:4]
        table.append(dict(launch=name, rows=m, **{c: round(got.get(c, float("nan")), 2) for c in COLUMNS[2:10]
                                                  if c != "dram_gb_s"},
                          dram_gb_s=round(got["dram_mb"] / got["us"] * 1e3),
                          stalls=", ".join(f"{s} {v:.1f}" for v, s in stalls)))
        print(table[-1], flush=True)
    write_results(args.name, environment(), table, COLUMNS, args.out,
                  notes=f"Nsight Compute, clocks not locked, one launch each ({args.dtype} x, 4-bit g64 weights, weights "
                        f"not in L2 on the first launch of each shape); stalls: warps stalled per issued "
                        "instruction, the four largest reasons.")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
