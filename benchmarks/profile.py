"""Where the time of a turn goes, piece by piece, on the engine's own parts.

Each row times one piece with the device synchronized around it:
- merge: building a batch of one from an agent's Q4 cache (copy + working copy);
- hot prefill: feeding a short message after a long cache, the first time at
  that shape and again at the same shape (the difference is per-shape setup);
- decode: one step at batch 1, 2, 4 and 8 with rows of equal length, at batch
  8 with rows of unequal length (left padding: an explicit mask), and, under
  the "dequant_once" route, with the working copy's extra column removed
  (`q4cache.DENSE_EXTRA = 0`), which lets MLX-CUDA decode through cuDNN.

    python -m benchmarks.profile --model llama-8b-shape        # GPU
"""

from __future__ import annotations

import statistics
import sys

import mlx.core as mx

from benchmarks.common import bench_parser, environment, load_bench_model, plot_bars, timed, write_results
from runtime import q4cache
from runtime.q4cache import extract_cache, merge_caches, route_for

COLUMNS = ["piece", "context", "batch", "new_tokens", "first_ms", "typical_ms", "worst_ms"]


def prefilled(model, spec, route, n_tokens, seed):
    """A per-agent Q4 cache of `n_tokens` random tokens."""
    mx.random.seed(seed)
    tokens = mx.random.randint(3, model.args.vocab_size, (n_tokens,))
    cache = merge_caches(spec, [None], route)
    for start in range(0, n_tokens, 2048):
        model(tokens[start : start + 2048][None], cache=cache)
        mx.eval([c.state for c in cache])
    return extract_cache(cache, 0)


def feed(model, spec, route, agent_cache, tokens):
    """Merge `agent_cache` into a batch of one, feed `tokens`, return the next token."""
    batch = merge_caches(spec, [agent_cache], route)
    return mx.argmax(model(mx.array(tokens)[None], cache=batch)[:, -1], axis=-1)


def decode_steps(model, spec, route, caches, steps):
    """Per-step seconds of `steps` greedy decode steps over the merged `caches`."""
    batch = merge_caches(spec, caches, route)
    tokens = mx.zeros((len(caches), 1), dtype=mx.int32)
    times = []
    for _ in range(steps):
        s, tokens = timed(lambda t: mx.argmax(model(t, cache=batch)[:, -1], axis=-1)[:, None], tokens)
        times.append(s)
    return times


def plot_pieces(path, rows, model):
    """A bar chart of each piece's typical milliseconds (the repeated shape, or the median step)."""
    plot_bars(path, {f"{r['piece']} {r['context']} b{r['batch']}" + (f" n{r['new_tokens']}" if r["new_tokens"] > 1 else ""):
                     r["typical_ms"] for r in rows}, "ms", f"where a turn's time goes, {model}")


def main(argv=None) -> int:
    ap = bench_parser(__doc__)
    ap.add_argument("--contexts", default="4096,16384")
    ap.add_argument("--new-tokens", type=int, default=24)
    ap.add_argument("--route", default=None, help="Q4 attention route (default: this backend's)")
    ap.add_argument("--decode-steps", type=int, default=280, help="steps of the long decode runs")
    ap.add_argument("--decode-context", type=int, default=1024, help="tokens in each row before decoding")
    args = ap.parse_args(argv)
    env = environment()
    print(env, flush=True)
    model, tokenizer, spec = load_bench_model(args.model)
    route = route_for(spec, args.route)
    rows = []

    def add(**row):
        rows.append(row)
        print(row, flush=True)

    for context in [int(c) for c in args.contexts.split(",")]:
        cache = prefilled(model, spec, route, context, seed=context)
        first, _ = timed(merge_caches, spec, [cache], route)
        again, _ = timed(merge_caches, spec, [cache], route)
        add(piece="merge", context=context, batch=1, new_tokens=0, first_ms=first * 1e3, typical_ms=again * 1e3)
        for n in (args.new_tokens, args.new_tokens + 1):
            first, _ = timed(feed, model, spec, route, cache, list(range(3, 3 + n)))
            again, _ = timed(feed, model, spec, route, cache, list(range(3, 3 + n)))
            add(piece="hot prefill", context=context, batch=1, new_tokens=n, first_ms=first * 1e3, typical_ms=again * 1e3)

    base = args.decode_context
    short = prefilled(model, spec, route, base, seed=1)
    unequal = [prefilled(model, spec, route, base + 8 * i, seed=2 + i) for i in range(8)]
    long_run = args.decode_steps
    runs = [("decode", [short], long_run), ("decode", [short] * 2, 40), ("decode", [short] * 4, 40),
            ("decode", [short] * 8, long_run), ("decode padded", unequal, 40)]
    if route == "dequant_once":  # what decoding costs without the working copy's extra column
        runs += [("decode via cuDNN", [short], long_run), ("decode via cuDNN", [short] * 8, long_run)]
    for label, caches, steps in runs:
        q4cache.DENSE_EXTRA = 0 if "cuDNN" in label else 1
        times = decode_steps(model, spec, route, caches, steps)
        add(piece=label, context=base, batch=len(caches), new_tokens=1, first_ms=times[0] * 1e3,
            typical_ms=statistics.median(times[1:]) * 1e3, worst_ms=max(times[1:]) * 1e3)
    q4cache.DENSE_EXTRA = 1
    name = args.name or f"profile-{args.model}"
    plot_pieces(args.out / f"{name}.png", rows, args.model)
    write_results(name, env, rows, COLUMNS, args.out,
                  notes=f"model {args.model}; route {route}; ms, device synchronized around each piece. "
                        "merge and hot prefill: first = first call at that shape, typical = the same shape again. "
                        f"decode: first = the run's first step, typical = median of the others, worst = the slowest "
                        f"other (runs of {long_run} steps cross into a new 256-column buffer).")
    return 0


if __name__ == "__main__":
    sys.exit(main())
