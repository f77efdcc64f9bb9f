"""How long a batch's row surgery holds the engine's thread: a finished row's extraction, a merge, a join, a filter.

When a turn ends, the engine takes its row's cache out of the batch (`q4cache.queue_rows`);
when rows join, it merges their caches (`merge_caches`) and extends the batch
(`extend_cache`); when finished rows are dropped, it filters the batch (`filter_cache`); when
the batch fills its allocation, it grows it (`reserve_cache`). Each builds kernels per layer
and allocates buffers of sizes the process may not have freed before, which MLX's buffer cache
then misses (on CUDA: a `cudaMallocAsync` each). The engine's thread does all of it between
two decode steps, so what it costs lands in one step's time ("end most rows": a step where
more than half the rows end, their caches taken and the batch filtered, as `Engine._accept` does).

For each operation, on --rows rows of about --context tokens, this times the host's share
(building the graph and `mx.async_eval`) and the wait for the device after it, as medians of
--reps repetitions, in two modes: "fresh", MLX's buffer cache emptied before each repetition
(every buffer a new allocation, as when a conversation's cache grows past every size the process
has freed), and "reused", the same sizes again (every buffer from the cache). --profile writes
Python's profile of the fresh extractions.

    python -m benchmarks.row_surgery                                   # CPU, tiny model
    python -m benchmarks.row_surgery --model llama-8b-shape --profile  # GPU
"""

from __future__ import annotations

import cProfile
import statistics
import time
from pathlib import Path

import mlx.core as mx

from benchmarks.common import bench_parser, environment, load_bench_model, profile_text, write_results
from benchmarks.profile import prefilled
from runtime.q4cache import extend_cache, filter_cache, merge_caches, queue_rows, reserve_cache, route_for

COLUMNS = ["op", "mode", "host_ms", "wait_ms", "host_max_ms", "reps"]


def states(batch) -> list:
    """The arrays a per-layer batch (or agent) cache holds."""
    return [c.state for c in batch]


def operations(spec, route, agents, room: int) -> dict:
    """name -> (setup, run): `setup()` makes the inputs untimed, `run(inputs)` builds the operation and returns
    the arrays to evaluate. `agents`: per-agent caches, the batch's rows."""
    def batch(caches, extra=room):
        b = merge_caches(spec, caches, route, room=extra)
        mx.eval(states(b))
        return b

    whole = batch(agents)
    rows = len(agents)
    return {
        "extract 1 row": (lambda: whole, lambda b: taken(queue_rows(b, [0], drop=1))),
        # on the kernel route a row leaves all the layers in one launch; the way before it, for comparison
        "extract 1 row, a layer at a time": (lambda: whole,
                                             lambda b: taken(queue_rows(b, [0], drop=1, together=False))),
        "extract 2 rows": (lambda: whole, lambda b: taken(queue_rows(b, [0, 1], drop=1))),
        "merge 1 row": (lambda: agents[-1], lambda a: states(merge_caches(spec, [a], route, room=room))),
        "join 1 row": (lambda: (batch(agents[:-1]), batch(agents[-1:])),
                       lambda p: (extend_cache(p[0], p[1], room), states(p[0]))[1]),
        "filter 1 row out": (lambda: batch(agents),
                             lambda b: (filter_cache(b, [i for i in range(rows) if i != rows // 2]), states(b))[1]),
        "grow": (lambda: batch(agents, 1), lambda b: (reserve_cache(b, 512), states(b))[1]),  # past its width
        # a step where most rows end, as the engine's `_accept` does it: their caches taken, then the batch filtered
        # once finished rows outnumber the decoding ones
        "end most rows": (lambda: batch(agents), lambda b: end_most(b, rows, True)),
        "end most rows, a layer at a time": (lambda: batch(agents), lambda b: end_most(b, rows, False)),
    }


def end_most(b, rows: int, together: bool) -> list:
    """A step where most of the `rows` rows of batch `b` end: their caches taken (`queue_rows`, `together`), then
    the batch filtered; the arrays to evaluate."""
    caches = taken(queue_rows(b, list(range(rows // 2 + 1)), drop=1, together=together))
    filter_cache(b, list(range(rows // 2 + 1, rows)))
    return [caches, states(b)]


def taken(rows) -> list:
    """The arrays of `queue_rows`'s per-agent caches (the caches themselves are not arrays MLX evaluates)."""
    return [(c.keys, c.values) for caches in rows for c in caches if c.keys is not None]


def measure(setup, run, fresh: bool, reps: int) -> dict:
    """Medians (and the host's max) over `reps` of: the host's ms building `run` and queueing it, the ms waited
    for the device after that. `fresh`: MLX's buffer cache emptied before each repetition."""
    host, wait = [], []
    for _ in range(reps + 1):  # the first builds what the process meets once (kernels, graphs): dropped
        inputs = setup()
        mx.synchronize()
        if fresh:
            mx.clear_cache()
        t0 = time.perf_counter()
        out = run(inputs)
        mx.async_eval(out)
        t1 = time.perf_counter()
        mx.eval(out)
        mx.synchronize()
        host.append((t1 - t0) * 1e3)
        wait.append((time.perf_counter() - t1) * 1e3)
        del out, inputs
    host, wait = host[1:], wait[1:]
    return dict(host_ms=round(statistics.median(host), 3), wait_ms=round(statistics.median(wait), 3),
                host_max_ms=round(max(host), 3), reps=reps)


def profile(setup, run, reps: int, path: Path, top: int = 30) -> None:
    """Python's profile (by own time, then cumulative) of `reps` fresh runs, written to `path`."""
    prof = cProfile.Profile()
    for _ in range(reps):
        inputs = setup()
        mx.synchronize()
        mx.clear_cache()
        prof.enable()
        out = run(inputs)
        mx.async_eval(out)
        prof.disable()
        mx.eval(out)
    path.write_text(profile_text(prof, top, ("tottime", "cumulative")))


def main(argv=None) -> int:
    ap = bench_parser(__doc__)
    ap.add_argument("--context", type=int, default=1024, help="tokens in the longest row (default: %(default)s)")
    ap.add_argument("--rows", type=int, default=5, help="rows in the batch (default: %(default)s)")
    ap.add_argument("--room", type=int, default=320,
                    help="columns merges and joins allocate beyond the rows (default: %(default)s)")
    ap.add_argument("--reps", type=int, default=15, help="repetitions per operation and mode (default: %(default)s)")
    ap.add_argument("--profile", action="store_true",
                    help="also write Python's profile of the fresh single-row extractions (<name>-profile.txt)")
    args = ap.parse_args(argv)
    env = environment()
    print(env, flush=True)
    model, _, spec = load_bench_model(args.model)
    route = route_for(spec, None)
    # rows of different lengths, as a batch's rows are: 64 tokens apart
    agents = [prefilled(model, spec, route, max(1, args.context - 64 * i), seed=i) for i in range(args.rows)]
    ops = operations(spec, route, agents, args.room)
    rows = []
    for name, (setup, run) in ops.items():
        for mode in ("fresh", "reused"):
            rows.append(dict(op=name, mode=mode, **measure(setup, run, mode == "fresh", args.reps)))
            print(rows[-1], flush=True)
    out_name = args.name or f"row_surgery-{args.model}"
    if args.profile:
        Path(args.out).mkdir(parents=True, exist_ok=True)
        profile(*ops["extract 1 row"], args.reps, Path(args.out) / f"{out_name}-profile.txt")
    write_results(out_name, env, rows, COLUMNS, Path(args.out),
                  notes=f"route {route}, KV scheme {spec.kv_scheme.name}, {args.rows} rows of {args.context} tokens "
                        f"and 64 fewer each, room {args.room}; medians of {args.reps} repetitions after one; "
                        "host: building the operation and `mx.async_eval`; wait: `mx.eval` after it. fresh: MLX's "
                        "buffer cache emptied before each repetition; reused: the same sizes again.")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
