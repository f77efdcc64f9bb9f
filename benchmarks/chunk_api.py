"""Where a hot chunk's host time goes: building the graph, queueing it, and the CUDA calls under the queueing.

A hot turn's prefill chunk (--tokens after an agent's cache of --context tokens, one row,
merged as the engine merges it; the merge is not timed) is timed in three parts, the
median of 5 after 4: building the graph in Python, `mx.async_eval` (MLX-CUDA turns the
graph into CUDA graphs and launches them), and the wait for the device after that. Then
5 more chunks run with CUPTI tracing the CUDA runtime and driver calls the host makes,
and a table gives, per chunk, each call's count and time. CUDA and the `cupti-python`
package only.

    python -m benchmarks.chunk_api --model llama-8b-shape
"""

from __future__ import annotations

import collections
import statistics
import sys

import mlx.core as mx

from benchmarks.common import bench_parser, environment, load_bench_model, write_results
from benchmarks.cuda_calls import CudaCalls
from benchmarks.hot_chunk import chunk_parts
from benchmarks.profile import prefilled
from runtime.q4cache import route_for

COLUMNS = ["what", "per_chunk", "ms", "us_each"]
CHUNKS = 5


def api_calls(run) -> dict:
    """{CUDA runtime or driver function name: (calls, total microseconds)} of what `run()` called, by CUPTI."""
    with CudaCalls() as trace:
        run()
    calls = collections.defaultdict(lambda: [0, 0.0])
    for (_, name), (n, ms) in trace.totals().items():
        calls[name][0] += n
        calls[name][1] += ms * 1e3
    return {name: tuple(v) for name, v in calls.items()}


def main(argv=None) -> int:
    ap = bench_parser(__doc__)
    ap.add_argument("--context", type=int, default=3072, help="tokens in the agent's cache (default: %(default)s)")
    ap.add_argument("--tokens", type=int, default=64, help="tokens in the chunk (default: %(default)s)")
    args = ap.parse_args(argv)
    env = environment()
    model, _, spec = load_bench_model(args.model)
    route = route_for(spec, None)
    agent = prefilled(model, spec, "dequant", args.context, seed=1)
    mx.random.seed(2)
    tokens = mx.random.randint(3, model.args.vocab_size, (args.tokens,))
    for _ in range(4):
        chunk_parts(model, spec, route, agent, tokens)
    parts = [chunk_parts(model, spec, route, agent, tokens) for _ in range(CHUNKS)]
    rows = [dict(what=what, per_chunk=1, ms=round(statistics.median(p[i] for p in parts) * 1e3, 2), us_each="")
            for i, what in enumerate(("build the graph (Python)", "queue it (mx.async_eval)", "wait for the device"))]
    calls = api_calls(lambda: [chunk_parts(model, spec, route, agent, tokens) for _ in range(CHUNKS)])
    for name, (n, us) in sorted(calls.items(), key=lambda kv: -kv[1][1]):
        rows.append(dict(what=name, per_chunk=round(n / CHUNKS, 1), ms=round(us / CHUNKS / 1e3, 3),
                         us_each=round(us / n, 2)))
    notes = (f"model {args.model}, route {route}; one row, {args.tokens} tokens after {args.context}; the three parts: "
             f"median of {CHUNKS} chunks after 4; the CUDA calls: {CHUNKS} more chunks traced by CUPTI (runtime and "
             "driver API), per chunk. cudaEventSynchronize is the host waiting for the device.")
    write_results(args.name or f"chunk_api-{args.model}", env, rows, COLUMNS, args.out, notes)
    return 0


if __name__ == "__main__":
    sys.exit(main())
