"""Where a hot prefill chunk's time goes: --tokens new tokens after a cache of --context tokens.

A hot turn of the multi-agent workload prefills about 250 tokens (padded to 256)
after 2-4K of context, and on an H100 such a chunk took 60-80 ms (p50), several
times its linear layers' share. Each row is the median of 5 runs after 2, the
device synchronized around each, on a batch of one merged from the agent's Q4
cache as the engine merges it (the merge is not timed):

- chunk: the engine's call (`last_logits`), the model prepared as the engine prepares it;
- chunk, one launch per product: `prepare.DENSE_LAUNCH` 1 (the host launches each
  dense product by itself, as before launches were grouped), and its host share;
- chunk, no wait for older products: `prepare.DENSE_IN_FLIGHT` so large that the
  host never waits for the device while it queues the chunk (more memory);
- one chunk shared by --rows turns: that many agents' messages (of the agent's
  cache each) in one forward pass, right-aligned, as the engine shares a chunk
  among turns that wait together;
- chunk: the engine's call, which launches a short chunk's forward (`mx.async_eval`) after every
  `prepare.CHUNK_LAUNCH`-th compiled decoder block, so the device starts on the first blocks while the
  host builds the rest; "launched once at its end" and "launched every block" set it to more than the
  model's blocks and to 1 (on CPU, where blocks are not compiled, the three are one path);
- chunk (launched ...), beside a cache copy: the same while another thread copies the
  agent's cache to the host over and over (`hostcache.cache_to_host`, as the persistence actor
  copies a finished turn's cache while the next turn runs); the note gives the copy's rate;
- chunk, quantized matmul: prepare's dequantize-then-GEMM path off, so MLX's
  quantized matmul takes the rows (chunks of `prepare.DENSE_ROWS` or more; shorter
  ones take `qgemm` either way);
- host share: building and queueing the chunk (the time to the last launch);
- linears alone: the chunk's products (every linear layer of the model, on
  random inputs of the chunk's rows), as prepared;
- the engine's hot turn: `Engine` serving a turn of the chunk's tokens after the agent's
  cache (made by a cold turn through the same engine, as an agent's is), to its first token
  (its `Timings.ttft_s`: queue, merge, chunk, sampling), with --max-tokens tokens to
  generate, every turn after the same cache, or each after the turn before it (as an agent's
  turns come); its merge alone (`merge_caches` with the room the engine gives such a turn);
  with --host-profile, Python's profile of the engine's first step of 5 such turns (admission,
  merge, chunk, first token: `<name>-engine-profile.txt`);
- with --host-profile: Python's profile of building and queueing 5 chunks
  (`<name>-host-profile.txt`);
- with --device-profile (CUDA, the `cupti-python` package): every kernel of 5
  chunks by name, device time per chunk (`<name>-device-profile.md`), for one
  turn and for --rows turns sharing the chunk.

    python -m benchmarks.hot_chunk --model llama-8b-shape            # GPU
"""

from __future__ import annotations

import contextlib
import statistics
import threading
import time

import mlx.core as mx
import mlx.nn as nn

from benchmarks.anatomy import kernel_table
from benchmarks.common import bench_parser, environment, load_bench_model, profile_text, traced_kernels, write_results
from benchmarks.profile import prefilled
from runtime import hostcache, prepare
from runtime.engine import Engine, Turn
from runtime.prepare import last_logits
from runtime.q4cache import extract_cache, layer_cache, merge_caches, route_for

COLUMNS = ["piece", "context", "tokens", "ms", "note"]


def timed_runs(fn, runs: int = 5, warm: int = 2) -> float:
    """Median milliseconds of `fn()` (which returns its own seconds) over `runs` after `warm`."""
    times = [fn() for _ in range(warm + runs)][warm:]
    return statistics.median(times) * 1e3


def chunk_parts(model, spec, route, agent, tokens, profile=None) -> tuple[float, float, float]:
    """Feed `tokens` after `agent`'s cache once (merged first, untimed); return the seconds the host took to
    build the graph, to queue it (`mx.async_eval`), and then waited for the device. `profile` (a
    cProfile.Profile) is enabled while the host builds and queues the chunk."""
    cache = merge_caches(spec, [agent], route)
    mx.eval([c.state for c in cache])
    mx.synchronize()
    t0 = time.perf_counter()
    if profile:
        profile.enable()
    logits = last_logits(model, tokens[None], cache, tokens.size - 1)
    built = time.perf_counter()
    mx.async_eval(logits, [c.state for c in cache])
    if profile:
        profile.disable()
    queued = time.perf_counter()
    mx.eval(logits, [c.state for c in cache])
    mx.synchronize()
    return built - t0, queued - built, time.perf_counter() - queued


def chunk_runner(model, spec, route, agent, tokens, host_only: bool = False, profile=None):
    """A function that feeds `tokens` after `agent`'s cache once and returns its seconds (or the host's share:
    build and queue); see `chunk_parts`."""
    def run():
        build, queue, wait = chunk_parts(model, spec, route, agent, tokens, profile)
        return build + queue + (0.0 if host_only else wait)
    return run


def message_leads(tokens: int, rows: int) -> list[int]:
    """How many tokens shorter than `tokens` each of `rows` shared messages is: 9 apart, or closer where the
    chunk is too short for that (every message keeps at least one token)."""
    apart = min(9, (tokens - 1) // max(1, rows - 1))
    return [apart * i for i in range(rows)]


def shared_runner(model, spec, route, agent, tokens, rows: int):
    """A function that feeds `rows` agents' messages (`agent`'s cache each, of the lengths `message_leads`
    gives, the longest `tokens`) in one chunk as the engine shares it, and returns its seconds."""
    lead = message_leads(tokens.size, rows)
    inputs = mx.stack([tokens] * rows)  # a row's padding queries may hold any tokens

    def run():
        cache = merge_caches(spec, [agent] * rows, route, lead)
        mx.eval([c.state for c in cache])
        mx.synchronize()
        t0 = time.perf_counter()
        logits = last_logits(model, inputs, cache, tokens.size - 1)
        mx.eval(logits, [c.state for c in cache])
        mx.synchronize()
        return time.perf_counter() - t0
    return run


@contextlib.contextmanager
def launching_every(model, k: int | None):
    """Within the block, a short chunk's forward is launched after every `k` compiled blocks (`prepare.CHUNK_LAUNCH`;
    None: once, at its end), as the engine's model launches it."""
    kept = prepare.CHUNK_LAUNCH
    prepare.CHUNK_LAUNCH = k or len(model.model.layers) + 1
    try:
        yield
    finally:
        prepare.CHUNK_LAUNCH = kept


def launched(k: int | None) -> str:
    """A row label's part for a chunk launched every `k` blocks (`launching_every`; None: once, at its end)."""
    return f", launched every {f'{k} blocks' if k > 1 else 'block'}" if k else ", launched once at its end"


@contextlib.contextmanager
def copying(cache):
    """Within the block, a thread copies `cache` (a per-layer Q4 cache) to the host over and over, as the
    persistence actor copies a finished turn's cache; yields a dict whose "gb_per_s" holds the copies'
    rate once the block exits."""
    stop, done, rate = threading.Event(), [], {}

    def loop():
        while not stop.is_set():
            host = hostcache.cache_to_host(cache)
            done.append(host.nbytes)

    thread = threading.Thread(target=loop, name="copy", daemon=True)
    t0 = time.perf_counter()
    thread.start()
    try:
        yield rate
    finally:
        stop.set()
        thread.join()
        rate["gb_per_s"] = sum(done) / (time.perf_counter() - t0) / 1e9


def served(engine, turn, profile=None):
    """`turn`'s result once `engine` (serving nothing else) has run it to its end; `profile` (a
    cProfile.Profile) is enabled during the first step, which admits the turn, merges its cache, runs its
    chunk and takes its first token."""
    engine.submit(turn)
    first = True
    while True:
        if profile and first:
            profile.enable()
        results = engine.step()
        if profile and first:
            profile.disable()
        first = False
        for result in results:
            if result.turn_id == turn.turn_id:
                if not hasattr(result, "cache"):
                    raise RuntimeError(f"the benchmark's turn failed: {result}")
                return result


def engine_runner(engine, agent, tokens, max_tokens: int, chain: bool = False, profile=None):
    """A function that serves a turn of `tokens` after `agent` (a per-agent cache) through `engine` and returns
    its time to the first token (`Timings.ttft_s`); with `chain`, each turn continues from the cache the turn
    before it returned, as an agent's turns do; see `served` for `profile`."""
    runs, held = iter(range(10**9)), [agent]

    def run():
        turn = Turn(f"hot-{next(runs)}", "bench", held[0], tokens, max_tokens=max_tokens)
        mx.synchronize()
        result = served(engine, turn, profile)
        mx.synchronize()
        if chain:
            held[0] = result.cache
        return result.timings.ttft_s
    return run


def merge_runner(spec, route, agent, room: int):
    """A function that merges `agent` into a batch of one with `room` columns to spare, as the engine does
    for a hot turn, and returns its seconds (device synchronized)."""
    def run():
        mx.synchronize()
        t0 = time.perf_counter()
        cache = merge_caches(spec, [agent], route, room=room)
        mx.eval([c.state for c in cache])
        mx.synchronize()
        return time.perf_counter() - t0
    return run


def linears_runner(model, rows: int):
    """A function that runs every quantized linear of `model` on `rows` random rows and returns its seconds."""
    linears = [m for _, m in model.named_modules() if isinstance(m, (nn.Linear, nn.QuantizedLinear))]
    dtype = linears[0]["scales" if "scales" in linears[0] else "weight"].dtype

    def width(m):
        return m["weight"].shape[-1] * 32 // m.bits if isinstance(m, nn.QuantizedLinear) else m["weight"].shape[-1]

    inputs = {}
    for m in linears:
        if width(m) not in inputs:
            inputs[width(m)] = mx.random.normal((1, rows, width(m))).astype(dtype)
    mx.eval(list(inputs.values()))

    def run():
        mx.synchronize()
        t0 = time.perf_counter()
        outs = [m(inputs[width(m)]) for m in linears]
        mx.eval(outs)
        mx.synchronize()
        return time.perf_counter() - t0
    return run, len(linears)


def main(argv=None) -> int:
    ap = bench_parser(__doc__)
    ap.add_argument("--context", type=int, default=3072, help="tokens in the agent's cache (default: %(default)s)")
    ap.add_argument("--tokens", type=int, default=256, help="tokens in the chunk (default: %(default)s)")
    ap.add_argument("--rows", type=int, default=5, help="turns sharing a chunk (default: %(default)s)")
    ap.add_argument("--max-tokens", type=int, default=8,
                    help="tokens the engine's hot turn may generate (its merge's room; default: %(default)s)")
    ap.add_argument("--host-profile", action="store_true",
                    help="also write Python's profile of building and queueing 5 chunks (<name>-host-profile.txt)")
    ap.add_argument("--device-profile", action="store_true",
                    help="also write a CUPTI trace summary of 5 chunks (<name>-device-profile.md; CUDA, cupti-python)")
    args = ap.parse_args(argv)
    env = environment()
    print(env, flush=True)
    model, tokenizer, spec = load_bench_model(args.model)
    route = route_for(spec, None)
    # handed out as a turn hands a cache out (on the kernel route: every layer's row in one launch, a `HeldRow`),
    # so that each chunk's merge is the engine's (one launch for a hot turn's 32 layers, not a launch a layer)
    agent = extract_cache(merge_caches(spec, [prefilled(model, spec, "dequant", args.context, seed=1)], route), 0)
    mx.random.seed(2)
    tokens = mx.random.randint(3, model.args.vocab_size, (args.tokens,))
    rows = []

    def add(piece, ms, note=""):
        rows.append(dict(piece=piece, context=args.context, tokens=args.tokens, ms=round(ms, 2), note=note))
        print(rows[-1], flush=True)

    add("chunk", timed_runs(chunk_runner(model, spec, route, agent, tokens)),
        f"route {route}, launched every {prepare.CHUNK_LAUNCH} blocks where they are compiled (CUDA)")
    for k in (None, 1):
        with launching_every(model, k):
            add(f"chunk{launched(k)}", timed_runs(chunk_runner(model, spec, route, agent, tokens)))
    for k in (None, prepare.CHUNK_LAUNCH, 1):
        with launching_every(model, k), copying(agent) as rate:
            ms = timed_runs(chunk_runner(model, spec, route, agent, tokens))
        add(f"chunk{launched(k)}, beside a cache copy", ms, f"the copy at {rate['gb_per_s']:.2f} GB/s")
    name = args.name or f"hot_chunk-{args.model}"
    if args.host_profile:
        import cProfile

        prof = cProfile.Profile()
        run = chunk_runner(model, spec, route, agent, tokens, profile=prof)
        for _ in range(5):
            run()
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / f"{name}-host-profile.txt").write_text(
            f"5 chunks of {args.tokens} tokens after {args.context}, built and queued (mx.async_eval: the launch)\n"
            + profile_text(prof, 30))
    if args.device_profile:  # the chunks as the engine runs them, before the variants below change the model
        texts = []
        for turns, run in ((1, chunk_runner(model, spec, route, agent, tokens)),
                          (args.rows, shared_runner(model, spec, route, agent, tokens, args.rows))):
            records = traced_kernels(lambda: [run() for _ in range(5)])
            texts.append(kernel_table(records, 5, f"5 chunks of {args.tokens} tokens for {turns} turn(s) after "
                                                  f"{args.context} (each with its merge), route {route}", "chunk"))
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / f"{name}-device-profile.md").write_text("\n".join(texts))
        print("\n".join(texts), flush=True)
    engine = Engine(model, tokenizer, spec)
    mx.random.seed(3)
    history = mx.random.randint(3, model.args.vocab_size, (args.context,)).tolist()
    own = served(engine, Turn("cold", "bench", None, history, max_tokens=1)).cache
    message = tokens.tolist()
    add("the engine's hot turn, to its first token", timed_runs(engine_runner(engine, own, message, args.max_tokens)),
        f"Timings.ttft_s; max_tokens {args.max_tokens}")
    add("the engine's hot turn, each after the one before", timed_runs(engine_runner(engine, own, message,
                                                                                   args.max_tokens, chain=True)),
        "the agent's cache grows by each turn, as an agent's does")
    room = -(-len(message) // engine.query_bucket) * engine.query_bucket + args.max_tokens  # as `Engine._room`
    add("its merge alone", timed_runs(merge_runner(spec, route, own, room)),
        f"room {room} columns; as a turn handed the cache out (on CUDA: every layer in one launch)")
    apart = [layer_cache(spec.kv_scheme) for _ in own]  # the same arrays, not as a turn handed them out
    for copy, layer in zip(apart, own):
        copy.keys, copy.values, copy.offset = layer.keys, layer.values, layer.offset
    add("its merge alone, a launch a layer", timed_runs(merge_runner(spec, route, apart, room)),
        "the same cache as loaded from disk")
    if args.host_profile:
        import cProfile

        prof = cProfile.Profile()
        run = engine_runner(engine, own, message, args.max_tokens, chain=True, profile=prof)
        for _ in range(5):
            run()
        (args.out / f"{name}-engine-profile.txt").write_text(
            f"the engine's first step of 5 hot turns of {args.tokens} tokens after {args.context} (admission, "
            f"merge, chunk, first token; max_tokens {args.max_tokens})\n" + profile_text(prof, 40))
    add("host share (build + queue)", timed_runs(chunk_runner(model, spec, route, agent, tokens, host_only=True)))
    group = prepare.DENSE_LAUNCH
    prepare.DENSE_LAUNCH = 1
    add("chunk, one launch per product", timed_runs(chunk_runner(model, spec, route, agent, tokens)))
    add("host share, one launch per product", timed_runs(chunk_runner(model, spec, route, agent, tokens, host_only=True)))
    prepare.DENSE_LAUNCH = group
    bound = prepare.DENSE_IN_FLIGHT
    prepare.DENSE_IN_FLIGHT = 10**6
    add("chunk, no wait for older products", timed_runs(chunk_runner(model, spec, route, agent, tokens)))
    prepare.DENSE_IN_FLIGHT = bound
    add(f"one chunk shared by {args.rows} turns", timed_runs(shared_runner(model, spec, route, agent, tokens, args.rows)),
        f"{args.rows} messages of {args.tokens} to {args.tokens - message_leads(args.tokens, args.rows)[-1]} tokens, "
        "right-aligned")
    run, n = linears_runner(model, args.tokens)
    add("linears alone", timed_runs(run), f"{n} products of {args.tokens} rows")
    dense = [m for _, m in model.named_modules() if getattr(m, "_kvactors_dense", False)]
    for m in dense:
        object.__setattr__(m, "_kvactors_dense", False)
    add("chunk, quantized matmul", timed_runs(chunk_runner(model, spec, route, agent, tokens)),
        f"{len(dense)} layers off the dense path")
    add("linears alone, quantized matmul", timed_runs(run))
    write_results(name, env, rows, COLUMNS, args.out,
                  notes=f"KV scheme {spec.kv_scheme.name}; median of 5 runs after 2, device synchronized around each.")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
