"""Tune `runtime.qgemv` on the device: its time per launch for each launch setting (TN, SPLIT,
UNROLL, KL), on the 8B shape's decode matrices, traced by CUPTI (CUDA and the cupti-python package).

A decode step is bound by the device once its host work is small, and most of the device's
time goes to these launches. For each matrix (q/k/v as one launch, o, gate/up/SiLU as one,
down) and row count, it times every setting asked for and reports the weight bytes read
per second, against the setting `qgemv.setting` and `qgemv.UNROLL` pick today. It also
times the output projection with the residual added in its launch (`add=`) against the
GEMV alone and a separate add.

Each setting must keep a row's result independent of the other rows: the benchmark checks
that row 0 of every launch equals the launch on row 0 alone, and says so. Each figure is
the median device time of 40 launches queued together, rotating over four copies of the
weights so that no launch finds its weight in L2.

    python -m benchmarks.qgemv_tune --rows 1,8 --tn 1,2 --split 4,8,16 --unroll 1,2,4 --kl 16,32

`--modules a.py,b.py` also times other versions of runtime/qgemv.py (copies of the file, each at its own
chosen setting) beside it, row for row, in the same process.
"""

from __future__ import annotations

import importlib.util
import statistics
from pathlib import Path

import mlx.core as mx

from benchmarks.common import bench_parser, environment, traced_kernels, write_results
from runtime import qgemv

COLUMNS = ["kernel", "launch", "rows", "tn", "split", "unroll", "kl", "us", "weight_gb_s", "note"]
K, HIDDEN = 4096, 14336
LAUNCHES = {"qkv": [(K, K), (1024, K), (1024, K)], "o": [(K, K)], "gate_up": [(HIDDEN, K), (HIDDEN, K)],
            "down": [(K, HIDDEN)]}
COPIES, CALLS = 4, 40


def device_us(make) -> float:
    """Median device microseconds of what `make(i)` launches, over CALLS calls queued together."""
    mx.eval(make(0))  # compiled and loaded first

    def run():
        mx.eval([make(i) for i in range(CALLS)])
        mx.synchronize()

    records = traced_kernels(run)
    per = len(records) // CALLS
    return statistics.median(sum(e - s for _, s, e in records[i * per:(i + 1) * per]) / 1e3 for i in range(CALLS))


def _call(name, x, parts, module=qgemv):
    if name == "gate_up":
        return [module.qgemv_swiglu(x, *parts, 64)]
    return module.qgemv_parts(x, parts, 64)


def load_module(path: str, tag: str):
    """Another version of runtime/qgemv.py from file `path`, its kernels renamed with `tag` (MLX keys its
    compiled kernels by name, so two versions in one process must not share names)."""
    source = Path(path).read_text().replace("kvactors_qgemv4", f"kvactors_{tag}_qgemv4")
    spec = importlib.util.spec_from_loader(f"qgemv_{tag}", loader=None)
    module = importlib.util.module_from_spec(spec)
    exec(compile(source, path, "exec"), module.__dict__)
    return module


def main(argv=None) -> int:
    ap = bench_parser(__doc__)
    ap.add_argument("--rows", default="1,8", help="row counts (default: %(default)s)")
    ap.add_argument("--tn", default="1,2", help="16-row tiles per warp (default: %(default)s; gate/up is always 2)")
    ap.add_argument("--split", default="4,8,16", help="warps along K (default: %(default)s)")
    ap.add_argument("--unroll", default="1,2,4", help="K steps a warp's loop unrolls (default: %(default)s)")
    ap.add_argument("--kl", default="16,32", help="elements of K a lane reads per step (default: %(default)s)")
    ap.add_argument("--modules", default="", help="other versions of runtime/qgemv.py to time beside it")
    args = ap.parse_args(argv)
    others = [(path, load_module(path, f"m{i}")) for i, path in enumerate(args.modules.split(",")) if path]
    env = environment()
    print(env, flush=True)
    if not qgemv.available():
        raise SystemExit("this benchmark needs a CUDA GPU")
    ints = lambda s: [int(v) for v in s.split(",")]  # noqa: E731
    rows_out, default_setting, default_unroll = [], qgemv.setting, qgemv.UNROLL

    def add(**row):
        rows_out.append(row)
        print(row, flush=True)

    for name, shapes in LAUNCHES.items():
        copies = []
        for c in range(COPIES):
            parts = []
            for i, (n, k) in enumerate(shapes):
                w = mx.random.normal((n, k), key=mx.random.key(100 * c + i)).astype(mx.bfloat16) * 0.02
                parts.append(tuple(mx.quantize(w, group_size=64, bits=4)))
            copies.append(parts)
        mx.eval(copies)
        gb = sum(a.nbytes for a in (p for parts in copies[:1] for part in parts for p in part)) / 1e9
        k = shapes[0][1]
        tn0, split0, kl0 = default_setting(sum(n for n, _ in shapes), k, 2 if name == "gate_up" else 1)
        chosen = (tn0, split0, default_unroll, kl0)
        for m in ints(args.rows):
            x = mx.random.normal((m, 1, k), key=mx.random.key(m)).astype(mx.bfloat16)
            mx.eval(x)
            for tn in ([2] if name == "gate_up" else ints(args.tn)):
                for split in ints(args.split):
                    for unroll, kl in [(u, v) for u in ints(args.unroll) for v in ints(args.kl)]:
                        if split > k // (4 * kl) or k % (4 * kl):
                            continue
                        qgemv.setting, qgemv.UNROLL = (lambda n_, k_, tiles_=1, s=(tn, split, kl): s), unroll
                        qgemv._launch.clear()
                        try:
                            same = all(mx.array_equal(a[:1], b).item() for a, b in
                                       zip(_call(name, x, copies[0]), _call(name, x[:1], copies[0])))
                            us = device_us(lambda i: _call(name, x, copies[i % COPIES]))
                        except RuntimeError as e:  # more registers or shared memory than a block may have
                            same, us = None, float("nan")
                            print(f"{name} rows {m} tn {tn} split {split} unroll {unroll} kl {kl}: {e}", flush=True)
                        finally:
                            qgemv.setting, qgemv.UNROLL = default_setting, default_unroll
                            qgemv._launch.clear()
                        note = {True: "", False: "ROW 0 DIFFERS FROM ITS LAUNCH ALONE", None: "does not launch"}[same]
                        note += " chosen" if (tn, split, unroll, kl) == chosen else ""
                        add(kernel="runtime.qgemv", launch=name, rows=m, tn=tn, split=split, unroll=unroll, kl=kl, us=round(us, 2),
                            weight_gb_s=round(gb / us * 1e6), note=note.strip())
            for path, module in others:
                mx.eval(_call(name, x, copies[0], module))
                us = device_us(lambda i, mod=module: _call(name, x, copies[i % COPIES], mod))
                same = all(mx.array_equal(a[:1], b).item() for a, b in
                           zip(_call(name, x, copies[0], module), _call(name, x[:1], copies[0], module)))
                add(kernel=path, launch=name, rows=m, tn="", split="", unroll="", kl="", us=round(us, 2),
                    weight_gb_s=round(gb / us * 1e6), note="" if same else "ROW 0 DIFFERS FROM ITS LAUNCH ALONE")
            if name == "o":
                res = mx.random.normal((m, 1, K), key=mx.random.key(7)).astype(mx.bfloat16)
                mx.eval(res)
                fused = device_us(lambda i: qgemv.qgemv(x, *copies[i % COPIES][0], 64, add=res))
                alone = device_us(lambda i: qgemv.qgemv(x, *copies[i % COPIES][0], 64))
                separate = device_us(lambda i: res + x)
                add(kernel="runtime.qgemv", launch="o + residual", rows=m, tn=chosen[0], split=chosen[1], unroll=chosen[2], kl=chosen[3],
                    us=round(fused, 2),
                    weight_gb_s=round(gb / fused * 1e6),
                    note=f"GEMV alone {alone:.2f} us, a separate add {separate:.2f} us")
    write_results(args.name or "qgemv_tune", env, rows_out, COLUMNS, args.out,
                  notes=f"bf16 x, 4-bit g64 weights of Llama-3.1-8B's shapes; us: median device time of {CALLS} launches "
                        f"queued together over {COPIES} weight copies (CUPTI); weight_gb_s: the packed weights' bytes "
                        "(words, scales, biases) per second; 'chosen': what qgemv.setting and qgemv.UNROLL pick.")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
