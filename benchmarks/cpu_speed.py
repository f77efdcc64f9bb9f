"""How fast each CPU of this machine runs the kind of host work a decode step is made of (Linux only).

A decode step on the GPU is bound by its host work: Python that builds the step's graph and MLX's C++ that
records and queues it. On a virtual machine one CPU can run that work slower than another (its physical core
shared with another guest's busy thread, for one), and the thread that builds the steps runs wherever the OS
puts it. This pins the calling thread to each allowed CPU in turn and times two fixed pieces of work there:
"python" (attribute, dict and list operations) and "mlx" (a lazy graph of 400 small MLX operations built and
dropped, never evaluated: the recording side of a step). Rounds visit every CPU once, so that a CPU slow in one
round and fast in the next shows as such. The table gives each CPU's median over the rounds and its ratio to the
fastest CPU's.

    python -m benchmarks.cpu_speed                  # every allowed CPU, 5 rounds
    python -m benchmarks.cpu_speed --rounds 9 --out benchmarks/results/...
"""

from __future__ import annotations

import os
import statistics
import time

import mlx.core as mx

from benchmarks.common import bench_parser, environment, write_results

COLUMNS = ["cpu", "python_ms", "python_x_fastest", "mlx_ms", "mlx_x_fastest", "python_rounds_ms"]


def python_work(n: int = 20000) -> int:
    """Attribute, dict and list work of a fixed size; returns a checksum so that nothing is skipped."""

    class Box:
        __slots__ = ("a", "b")

        def __init__(self, a, b):
            self.a, self.b = a, b

    table, out = {}, []
    for i in range(n):
        box = Box(i, i & 7)
        table[box.b] = table.get(box.b, 0) + box.a
        out.append(box.a ^ box.b)
    return sum(out) + sum(table.values())


def mlx_work(x, ops: int = 400) -> None:
    """A lazy MLX graph of `ops` small operations, built and dropped unevaluated."""
    y = x
    for _ in range(ops // 2):
        y = mx.multiply(y + 1, x)
    del y


def timed_ms(fn, *args) -> float:
    t0 = time.perf_counter()
    fn(*args)
    return (time.perf_counter() - t0) * 1e3


def probe(cpus: list[int], rounds: int) -> dict[int, tuple[list, list]]:
    """{cpu: (python ms per round, mlx ms per round)}, the calling thread pinned to each CPU in turn; its affinity
    is restored after."""
    before = os.sched_getaffinity(0)
    x = mx.zeros((8,))
    mx.eval(x)
    seen = {cpu: ([], []) for cpu in cpus}
    try:
        for _ in range(rounds):
            for cpu in cpus:
                os.sched_setaffinity(0, {cpu})
                python_work(2000)  # settle on the CPU
                seen[cpu][0].append(timed_ms(python_work))
                seen[cpu][1].append(timed_ms(mlx_work, x))
    finally:
        os.sched_setaffinity(0, before)
    return seen


def slow_cpus(rounds: int = 1, factor: float = 1.5) -> dict | None:
    """A quick look at this machine's CPUs for a benchmark's record: {cpu: python ms} of those whose median is over
    `factor` times the fastest's, and how many were probed; None where threads cannot be pinned (not Linux)."""
    if not hasattr(os, "sched_setaffinity"):
        return None
    seen = probe(sorted(os.sched_getaffinity(0)), rounds)
    medians = {cpu: statistics.median(p) for cpu, (p, _) in seen.items()}
    fastest = min(medians.values())
    return dict(probed=len(medians), fastest_ms=round(fastest, 2),
                slow={cpu: round(ms, 2) for cpu, ms in medians.items() if ms > factor * fastest})


def main(argv=None) -> int:
    ap = bench_parser(__doc__)
    ap.add_argument("--rounds", type=int, default=5, help="visits to every CPU (default 5)")
    args = ap.parse_args(argv)
    if not hasattr(os, "sched_setaffinity"):
        raise SystemExit("cpu_speed pins threads to CPUs: Linux only")
    env = environment()
    seen = probe(sorted(os.sched_getaffinity(0)), args.rounds)
    medians = {cpu: (statistics.median(p), statistics.median(m)) for cpu, (p, m) in seen.items()}
    fast_p = min(p for p, _ in medians.values())
    fast_m = min(m for _, m in medians.values())
    rows = [dict(cpu=cpu, python_ms=round(p, 2), python_x_fastest=round(p / fast_p, 2), mlx_ms=round(m, 2),
                 mlx_x_fastest=round(m / fast_m, 2), python_rounds_ms=" ".join(f"{v:.1f}" for v in seen[cpu][0]))
            for cpu, (p, m) in medians.items()]
    for row in rows:
        print(row, flush=True)
    write_results(args.name or "cpu_speed", env, rows, COLUMNS, args.out,
                  notes=f"{args.rounds} rounds, every CPU once a round; medians; x_fastest against the fastest CPU's median.")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
