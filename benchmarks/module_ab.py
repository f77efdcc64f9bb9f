"""A runtime module against an older copy of it, in one process: decode steps' host and device time.

Two processes of one tree differ by more than most changes to a step (which vCPU the
engine's thread lands on sets the host's speed), so this times both versions in one
process, on one thread, in alternating rounds: for each round and batch size, decode
steps as `benchmarks.anatomy` times them (build, launch and wait of a step synchronized
alone; a step queued as the engine queues them) with the module's functions `--names`
as they are, then replaced by the copy's (`--copy`, e.g. `git show HEAD~1:runtime/q4sdpa.py`).
The table gives every round and each version's median; pin the process to one CPU
(`taskset -c N`) so that both versions run on the same one.

With `--chunk TOKENS` it times hot prefill chunks instead (`benchmarks.hot_chunk`'s pieces: a
chunk of TOKENS tokens after the cache, as `--batches` turns share it, to its end, median of 5
runs after 2, and for one turn the host's share of it: build and queue). `--cuda-calls` (CUDA, the
`cupti-python` package) also writes the CUDA calls the host made in each version's rounds (`calls_table`).

    python -m benchmarks.module_ab --model llama-8b-shape --copy old_q4sdpa.py \\
        --module runtime.q4sdpa --names q4_decode_sdpa --context 3072 --batches 5,8
    python -m benchmarks.module_ab --model llama-8b-shape --copy old_prepare.py \\
        --module runtime.prepare --names _quantized_matmul --chunk 256 --batches 1,2
"""

from __future__ import annotations

import collections
import importlib
import statistics
import time

import mlx.core as mx

from benchmarks.anatomy import pipelined, split, step
from benchmarks.common import bench_parser, environment, load_bench_model, write_results
from benchmarks.cuda_calls import CudaCalls
from benchmarks.hot_chunk import chunk_runner, shared_runner, timed_runs
from benchmarks.profile import prefilled
from benchmarks.q4sdpa_tune import load_copy
from runtime.q4cache import merge_caches, route_for

COLUMNS = ["round", "version", "batch", "build_ms", "launch_ms", "wait_ms", "pipelined_ms"]
CHUNK_COLUMNS = ["round", "version", "batch", "chunk_ms", "host_ms"]


def swapped(module, copy, names, model):
    """The module's current values of `names`, after setting each to the copy's; the model's compiled blocks
    forget the graphs they recorded (`forget_graphs`)."""
    before = {n: getattr(module, n) for n in names}
    for n in names:
        setattr(module, n, getattr(copy, n))
    forget_graphs(model)
    return before


def forget_graphs(model) -> None:
    """Drop the graphs the model's compiled blocks recorded (`prepare.CompiledBlock`), so that the next call
    records them again with the module functions as they are now: a recorded graph replays the kernels the
    functions chose when it was recorded (swapping `runtime.qgemm._run` alone would change nothing)."""
    for _, m in model.named_modules():
        m.__dict__.pop("_kvactors_graphs", None)


def main(argv=None) -> int:
    ap = bench_parser(__doc__)
    ap.add_argument("--copy", required=True, help="file of the older copy of the module")
    ap.add_argument("--module", default="runtime.q4sdpa", help="the module the copy stands in for")
    ap.add_argument("--names", default="q4_decode_sdpa", help="comma-separated functions to take from the copy")
    ap.add_argument("--context", type=int, default=3072, help="tokens in each row's cache (default: %(default)s)")
    ap.add_argument("--batches", default="5,8", help="batch sizes (default: %(default)s)")
    ap.add_argument("--rounds", type=int, default=6, help="rounds of both versions, alternating which goes first")
    ap.add_argument("--chunk", type=int, default=0,
                    help="time hot prefill chunks of this many tokens, shared by each of --batches turns, instead")
    ap.add_argument("--cuda-calls", action="store_true",
                    help="also trace the CUDA calls the host makes (CUPTI, `benchmarks.cuda_calls`) and write each "
                         "version's per round and batch to <name>-cuda-calls.md")
    args = ap.parse_args(argv)
    env = environment()
    print(env, flush=True)
    module, copy = importlib.import_module(args.module), load_copy(args.copy)
    names = args.names.split(",")
    model, _, spec = load_bench_model(args.model)
    route = route_for(spec, None)
    cache = prefilled(model, spec, "dequant", args.context, seed=1)
    batches = [int(x) for x in args.batches.split(",")]
    rows, windows = [], collections.defaultdict(list)  # (version, batch) -> the rounds' (start, end), for --cuda-calls
    trace = CudaCalls().start() if args.cuda_calls else None
    for r in range(args.rounds + 1):  # round 0 compiles both versions' kernels and is left out
        for version in (("new", "old") if r % 2 else ("old", "new")):
            before = swapped(module, copy, names, model) if version == "old" else None
            try:
                for b in batches:
                    t0 = time.perf_counter()
                    times = (chunk_times if args.chunk else step_times)(model, spec, route, cache, b, args.chunk)
                    row = dict(round=r, version=version, batch=b, **times)
                    print(row, flush=True)
                    if r:
                        rows.append(row)
                        windows[version, b].append((t0, time.perf_counter()))
            finally:
                if before:
                    for n, value in before.items():
                        setattr(module, n, value)
                    forget_graphs(model)
    if trace is not None:
        trace.stop()
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / f"{args.name or 'module_ab'}-cuda-calls.md").write_text(calls_table(trace, windows))
    columns = CHUNK_COLUMNS if args.chunk else COLUMNS
    for version in ("old", "new"):
        for b in batches:
            mine = [x for x in rows if x["version"] == version and x["batch"] == b]
            rows.append(dict(round="median", version=version, batch=b,
                             **{k: round(statistics.median(x[k] for x in mine if x[k] is not None), 3)
                                if any(x[k] is not None for x in mine) else None for k in columns[3:]}))
    measured = (f"chunks of {args.chunk} tokens shared by `batch` turns (median of 5 after 2; host_ms for one turn)"
                if args.chunk else "anatomy's split (median of 20 steps after 4, each synchronized) and pipelined "
                                   "(mean of 40 steps after 4)")
    write_results(args.name or "module_ab", env, rows, columns, args.out,
                  notes=f"{args.module}.{args.names} from {args.copy} (old) against the tree's (new); route {route}, "
                        f"KV scheme {spec.kv_scheme.name}, context {args.context}; per round and batch: {measured}")
    return 0


def calls_table(trace, windows, top: int = 12) -> str:
    """A markdown table of the `top` CUDA calls by time for each (version, batch) of `windows` (its rounds' (start,
    end) on `time.perf_counter`'s clock), summed over the rounds and given per round: calls and milliseconds."""
    lines = ["| version | batch | thread | function | calls a round | ms a round |", "|---|---|---|---|---|---|"]
    for (version, batch), spans in sorted(windows.items()):
        total = collections.defaultdict(lambda: [0, 0.0])
        for start, end in spans:
            for key, (n, ms) in trace.totals(start, end).items():
                total[key][0] += n
                total[key][1] += ms
        for (thread, name), (n, ms) in sorted(total.items(), key=lambda kv: -kv[1][1])[:top]:
            lines.append(f"| {version} | {batch} | {thread} | {name} | {n / len(spans):.1f} | {ms / len(spans):.3f} |")
    return "\n".join(lines) + "\n"


def step_times(model, spec, route, cache, rows: int, _chunk: int) -> dict:
    """A decode step of `rows` rows after `cache`: build, launch and device wait (`anatomy.split`), pipelined."""
    batch = merge_caches(spec, [cache] * rows, route)
    for _ in range(2):
        mx.eval(step(model, batch, mx.zeros((rows, 1), dtype=mx.int32)))
    build, launch, wait = split(model, spec, cache, route, rows)
    return dict(build_ms=round(build, 3), launch_ms=round(launch, 3), wait_ms=round(wait, 3),
                pipelined_ms=round(pipelined(model, spec, cache, route, rows), 3))


def chunk_times(model, spec, route, cache, turns: int, tokens: int) -> dict:
    """A hot chunk of `tokens` tokens after `cache`, shared by `turns` turns, to its end; for one turn also the
    host's share (build and queue)."""
    message = mx.random.randint(3, model.args.vocab_size, (tokens,), key=mx.random.key(2))
    if turns == 1:
        return dict(chunk_ms=round(timed_runs(chunk_runner(model, spec, route, cache, message)), 3),
                    host_ms=round(timed_runs(chunk_runner(model, spec, route, cache, message, host_only=True)), 3))
    return dict(chunk_ms=round(timed_runs(shared_runner(model, spec, route, cache, message, turns)), 3), host_ms=None)


if __name__ == "__main__":
    raise SystemExit(main())
