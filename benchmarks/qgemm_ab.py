"""A layer's chunk products through several versions of `runtime/qgemm.py`, alternating in one process (CUDA).

For 64 and 256 rows, the launches an 8B-shape llama layer makes (q/k/v as one `qgemm_parts`, o,
gate/up as one, down) are each queued 200 times, rotating over weight copies past L2, and
waited for: microseconds a call by the wall clock (which counts the host's launches too), and
CUPTI's kernel time where cupti-python is installed (an overestimate where queued kernels
overlap). Every version's outputs are compared with the first version's (bitwise, else the
largest difference relative to the largest output) and with float32 (x times the dequantized
weight), so a faster version that computes something else shows:

    python -m benchmarks.qgemm_ab runtime/qgemm.py OLD_COPY.py [...] --rounds 2
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import mlx.core as mx

from benchmarks.common import DEVICE_TIMED, traced_kernels
from benchmarks.q4sdpa_tune import load_copy

K, HIDDEN = 4096, 14336
LAUNCHES = {"qkv": [(K, K), (1024, K), (1024, K)], "o": [(K, K)], "gate_up": [(HIDDEN, K), (HIDDEN, K)],
            "down": [(K, HIDDEN)]}
CALLS = 200


def weights(shapes, copies: int) -> list:
    """`copies` sets of 4-bit (group 64) bf16 weights of `shapes` ((N, K) each)."""
    out = []
    for i in range(copies):
        parts = [mx.quantize(mx.random.normal((n, k), key=mx.random.key(7 * i + j)).astype(mx.bfloat16) * 0.02,
                             group_size=64, bits=4) for j, (n, k) in enumerate(shapes)]
        mx.eval(parts)
        out.append(parts)
    return out


def timed(module, x, sets) -> tuple[float, float]:
    """(wall us, device us) a call of `module.qgemm_parts` on x, rotating over the weight `sets`."""
    mx.eval(module.qgemm_parts(x, sets[0], 64))
    mx.synchronize()

    def run():
        mx.eval([module.qgemm_parts(x, sets[i % len(sets)], 64) for i in range(CALLS)])
        mx.synchronize()

    t0 = time.perf_counter()
    run()
    wall = (time.perf_counter() - t0) / CALLS * 1e6
    device = sum(e - s for _, s, e in traced_kernels(run)) / CALLS / 1e3 if DEVICE_TIMED else float("nan")
    return wall, device


def difference(got: list, want: list) -> str:
    """'same' where every array of `got` equals `want`'s bitwise, else the largest |difference| over the
    largest |want|."""
    if all(mx.array_equal(a, b).item() for a, b in zip(got, want)):
        return "same"
    worst = max((mx.abs(a.astype(mx.float32) - b.astype(mx.float32)).max() / mx.abs(b.astype(mx.float32)).max())
                .item() for a, b in zip(got, want))
    return f"{worst:.1e}"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("versions", nargs="+", help="files of runtime/qgemm.py's versions (the first: the reference)")
    ap.add_argument("--rounds", type=int, default=2, help="rounds of every version (default: %(default)s)")
    ap.add_argument("--rows", default="64,256", help="rows of the chunk (default: %(default)s)")
    args = ap.parse_args(argv)
    versions = {Path(p).stem if i else f"{Path(p).stem}(ref)": load_copy(p) for i, p in enumerate(args.versions)}
    totals = {}
    for name, shapes in LAUNCHES.items():
        nbytes = sum(n * k // 2 + 2 * (n * k // 64) * 2 for n, k in shapes)
        sets = weights(shapes, max(2, -(-(120 << 20) // nbytes)))
        for m in [int(r) for r in args.rows.split(",")]:
            x = mx.random.normal((m, shapes[0][1])).astype(mx.bfloat16)
            exact = [x.astype(mx.float32) @ mx.dequantize(*p, group_size=64, bits=4).astype(mx.float32).T
                     for p in sets[0]]
            ref = next(iter(versions.values())).qgemm_parts(x, sets[0], 64)
            for tag, module in versions.items():
                got = module.qgemm_parts(x, sets[0], 64)
                print(f"{name} rows {m} {tag}: against the first {difference(got, ref)}, "
                      f"against float32 {difference(got, exact)}", flush=True)
            for r in range(args.rounds):
                for tag, module in (list(versions.items()) if r % 2 == 0 else list(versions.items())[::-1]):
                    wall, device = timed(module, x, sets)
                    total = totals.setdefault((m, r, tag), [0.0, 0.0])
                    total[0] += wall
                    total[1] += device
                    print(f"{name} rows {m} round {r} {tag}: wall {wall:.1f} us, device {device:.1f} us", flush=True)
    for (m, r, tag), (wall, device) in sorted(totals.items()):
        print(f"one layer, rows {m}, round {r}, {tag}: wall {wall:.0f} us, device {device:.0f} us")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
