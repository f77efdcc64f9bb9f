"""A layer's chunk products through two versions of runtime/qgemm.py, alternating in one process.

    python benchmarks/results/h200/qgemm-2026-11-28/qgemm_ab.py OLD_QGEMM.py [rounds]

For 64 and 256 rows, the launches a llama layer makes (q/k/v as one `qgemm_parts`, o, gate/up as one, down), each
queued 200 times (rotating over weight copies past L2) and waited for: microseconds a call by the wall clock, which
counts the host's launches too, and CUPTI's kernel time where cupti-python is installed (an overestimate when queued
kernels overlap). Every output must equal the other version's bit for bit (the order of each sum is the same).
"""
import importlib.util
import sys
import time

import mlx.core as mx

from benchmarks.common import DEVICE_TIMED, traced_kernels
from runtime import qgemm

K, HIDDEN = 4096, 14336
LAUNCHES = {"qkv": [(K, K), (1024, K), (1024, K)], "o": [(K, K)], "gate_up": [(HIDDEN, K), (HIDDEN, K)],
            "down": [(K, HIDDEN)]}
CALLS = 200


def load(path):
    spec = importlib.util.spec_from_file_location("qgemm_other", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def weights(shapes, copies):
    out = []
    for i in range(copies):
        parts = [mx.quantize(mx.random.normal((n, k), key=mx.random.key(7 * i + j)).astype(mx.bfloat16) * 0.02,
                             group_size=64, bits=4) for j, (n, k) in enumerate(shapes)]
        mx.eval(parts)
        out.append(parts)
    return out


def timed(module, x, sets):
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


def main():
    other, rounds = load(sys.argv[1]), int(sys.argv[2]) if len(sys.argv) > 2 else 2
    versions = {"old": other, "new": qgemm}
    totals = {}
    for name, shapes in LAUNCHES.items():
        nbytes = sum(n * k // 2 + 2 * (n * k // 64) * 2 for n, k in shapes)
        sets = weights(shapes, max(2, -(-(120 << 20) // nbytes)))
        for m in (64, 256):
            x = mx.random.normal((m, K if name != "down" else HIDDEN)).astype(mx.bfloat16)
            same = all(mx.array_equal(a, b).item() for a, b in zip(other.qgemm_parts(x, sets[0], 64),
                                                                    qgemm.qgemm_parts(x, sets[0], 64)))
            for r in range(rounds):
                for tag, module in versions.items():
                    wall, device = timed(module, x, sets)
                    totals.setdefault((tag, m, r), [0.0, 0.0])
                    totals[(tag, m, r)][0] += wall
                    totals[(tag, m, r)][1] += device
                    print(f"{name} rows {m} round {r} {tag}: wall {wall:.1f} us, device {device:.1f} us, same bits {same}",
                          flush=True)
    for (tag, m, r), (wall, device) in sorted(totals.items(), key=lambda kv: (kv[0][1], kv[0][2], kv[0][0])):
        print(f"one layer, rows {m}, round {r}, {tag}: wall {wall:.0f} us, device {device:.0f} us")


if __name__ == "__main__":
    main()
