"""Batched against one-after-another serving, and the engine's own overhead.

For 1, 2, 4 and 8 agents (each a prompt of --prompt tokens, generating --new
tokens): system tokens/s and per-agent TTFT when the engine batches them,
against the same engine serving them one at a time (max_batch=1). Each count
runs both modes --repeats times, alternating (sequential, batched, sequential,
...), and the table gives each mode's median wall time and its range: a
host's speed drifts within a process (on an H200 one count's sequential run was
17% faster per agent than the others'), and alternating puts both modes under
the same drift. For the last count given it says where its last batched run's
time went (prefill chunks, decode steps, the rest). Overhead:
a batched decode step of the engine against the bare model forward (+ argmax
+ eval) of the same batch and cache, for the largest agent count.

    python -m benchmarks.batching                                   # CPU, tiny model
    python -m benchmarks.batching --model llama-8b-shape --prompt 1024 --new 64   # GPU
"""

from __future__ import annotations

import statistics
import sys
import time

import mlx.core as mx

from benchmarks.common import bench_parser, environment, load_bench_model, plot_lines, write_results
from runtime.engine import Engine, Turn
from runtime.q4cache import extract_cache, merge_caches

COLUMNS = ["agents", "mode", "wall_s", "wall_min_s", "wall_max_s", "system_tok_s", "x_sequential", "ttft_mean_s",
           "ttft_max_s"]


def agent_turns(n, prompt, new, vocab, seed=0):
    mx.random.seed(seed)
    return [
        Turn(f"a{i}", f"a{i}", None, mx.random.randint(3, vocab, (prompt,)).tolist(), max_tokens=new)
        for i in range(n)
    ]


def serve(engine, turns):
    """(wall seconds, results) of serving `turns` to completion."""
    t0 = time.perf_counter()
    for t in turns:
        engine.submit(t)
    out = []
    while engine.has_work():
        out += engine.step()
    return time.perf_counter() - t0, out


def where(engine, wall: float) -> str:
    """Where a served run's `wall` seconds went, from `engine.stats`: prefill chunks, decode steps (by what
    changed before them), the rest."""
    chunks = [c[2] for c in engine.stats.prefill_chunks]
    steps = list(engine.stats.decode_steps)
    kinds = {}
    for s in steps:
        kinds.setdefault((s.changes or "none") + ("+end" if s.ended else ""), []).append(s.total_s * 1e3)
    by = {k: [len(v), round(statistics.median(v), 2), round(max(v), 2)] for k, v in sorted(kinds.items())}
    decode = sum(s.total_s for s in steps)
    return (f"{wall:.3f} s: {len(chunks)} prefill chunks {sum(chunks):.3f} s, {len(steps)} decode steps {decode:.3f} s (mean batch "
            f"{statistics.mean(s.rows for s in steps) if steps else 0:.1f}; by change: count, p50 ms, max ms {by}), "
            f"the rest {wall - sum(chunks) - decode:.3f} s")


def overhead(model, tokenizer, spec, turns, steps):
    """(engine decode-step seconds, bare forward seconds) per step at batch len(turns)."""
    engine = Engine(model, tokenizer, spec, max_batch=len(turns))
    for t in turns:
        t.max_tokens = 10 * steps
        engine.submit(t)
    while len(engine.decoding) < len(turns):
        engine.step()
    for _ in range(3):
        engine.step()
    mx.synchronize()
    t0 = time.perf_counter()
    for _ in range(steps):
        engine.step()
    mx.synchronize()
    engine_s = (time.perf_counter() - t0) / steps

    batch = merge_caches(spec, [extract_cache(engine.batch, i) for i in range(len(turns))], engine.route)
    tokens = mx.array([[r.generated[-1]] for r in engine.decoding])
    times = []
    for _ in range(steps + 3):
        t0 = time.perf_counter()
        tokens = mx.argmax(model(tokens, cache=batch)[:, -1], axis=-1)[:, None]
        mx.eval(tokens, [c.state for c in batch])
        times.append(time.perf_counter() - t0)
    return engine_s, statistics.mean(times[3:])


def main(argv=None) -> int:
    ap = bench_parser(__doc__)
    ap.add_argument("--agents", default="1,2,4,8")
    ap.add_argument("--prompt", type=int, default=256, help="prompt tokens per agent")
    ap.add_argument("--new", type=int, default=32, help="tokens generated per agent")
    ap.add_argument("--capacity-gb", type=float, default=16, help="budget for the capacity figure (GiB)")
    ap.add_argument("--repeats", type=int, default=3, help="runs of each mode per count, alternating (median reported)")
    args = ap.parse_args(argv)
    if args.repeats < 1:
        ap.error(f"--repeats must be at least 1, got {args.repeats}")
    env = environment()
    print(env, flush=True)
    model, tokenizer, spec = load_bench_model(args.model)
    tokenizer.eos_token_ids = set()  # random weights: never stop early, every agent makes --new tokens
    vocab = model.args.vocab_size
    counts = [int(n) for n in args.agents.split(",")]
    # warm-up: MLX-CUDA compiles kernels per shape; let every batch size decode at least once (turns of one
    # length end together, so batch 1 gets a run of its own, as the sequential mode decodes)
    serve(Engine(model, tokenizer, spec, max_batch=max(counts)), agent_turns(max(counts), args.prompt, 2 * max(counts), vocab, seed=99))
    serve(Engine(model, tokenizer, spec, max_batch=1), agent_turns(2, args.prompt, args.new, vocab, seed=98))

    rows, spent = [], ""
    for n in counts:
        walls, results = {"sequential": [], "batched": []}, None
        for _ in range(args.repeats):
            for mode, batch in (("sequential", 1), ("batched", max(counts))):
                engine = Engine(model, tokenizer, spec, max_batch=batch)
                wall, out = serve(engine, agent_turns(n, args.prompt, args.new, vocab))
                failed = [r for r in out if isinstance(r, Exception)]
                if failed:
                    raise SystemExit(f"{len(failed)} turns failed, first: {failed[0]}")
                walls[mode].append(wall)
                if mode == "batched":
                    results, spent = out, where(engine, wall)
        ttfts = [r.timings.ttft_s for r in results]
        tokens = n * args.new
        seq_s, bat_s = (statistics.median(walls[m]) for m in ("sequential", "batched"))
        for mode, wall in (("sequential", seq_s), ("batched", bat_s)):
            rows.append(dict(agents=n, mode=mode, wall_s=wall, wall_min_s=min(walls[mode]), wall_max_s=max(walls[mode]),
                             system_tok_s=tokens / wall, x_sequential=seq_s / wall))
        rows[-1].update(ttft_mean_s=statistics.mean(ttfts), ttft_max_s=max(ttfts))
        print(rows[-2:], flush=True)
    engine_s, bare_s = overhead(model, tokenizer, spec, agent_turns(max(counts), args.prompt, 0, vocab), 16)
    notes = (f"model {args.model}; prompt {args.prompt} tokens, {args.new} new tokens per agent; route {Engine(model, tokenizer, spec).route}; "
             f"each mode {args.repeats} times per count, alternating, median wall time (range in wall_min_s, wall_max_s); "
             f"TTFT from the last batched run.\n"
             f"The last batched run at {counts[-1]} agents took {spent}.\n"
             f"Engine overhead at batch {max(counts)}: engine decode step {engine_s * 1e3:.2f} ms, bare forward "
             f"{bare_s * 1e3:.2f} ms: ratio {bare_s / engine_s:.3f} (target >= 0.9).")
    rows.append(dict(agents=max(counts), mode="overhead", wall_s=engine_s, system_tok_s=bare_s, x_sequential=bare_s / engine_s))
    # capacity: agents whose caches stay resident in a fixed budget, at this prompt + new length
    q4_bytes = sum(sum(x.nbytes for x in (*c.keys, *c.values)) for c in results[0].cache)
    fp16_bytes = spec.fp16_bytes_per_token() * results[0].cached_tokens
    budget = args.capacity_gb * 2**30
    notes += (f"\nCapacity in {args.capacity_gb} GiB at {results[0].cached_tokens} tokens per agent: "
              f"Q4 {budget // q4_bytes} agents ({q4_bytes / 2**20:.1f} MiB each, measured) vs fp16 "
              f"{budget // fp16_bytes} agents ({fp16_bytes / 2**20:.1f} MiB each): {fp16_bytes / q4_bytes:.2f}x.")
    name = args.name or f"batching-{args.model}"
    write_results(name, env, rows, COLUMNS, args.out, notes=notes)
    plot_lines(args.out / f"{name}.png", {m: [r["system_tok_s"] for r in rows if r["mode"] == m] for m in ("sequential", "batched")},
               "agents", "system tokens/s", f"batched vs sequential, {args.model}", x=counts)
    return 0


if __name__ == "__main__":
    sys.exit(main())
