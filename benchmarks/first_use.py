"""First-use costs the engine's warm-up leaves: steps and chunks that are slow the first time.

Loads the model, builds an `Engine`, runs `Engine.warmup`, then serves rounds of
`--agents` turns with `--prompt`-token prompts (all submitted at once, so the batch
grows to `--agents` rows at a long context), and prints every decode step or
prefill chunk slower than `--slow` ms with its shape (`EngineStats.shapes`), per
round. A one-time cost that shows up in round 1 but not in round 2 is what a
warm-up should pay instead of a user's turn.

    python -m benchmarks.first_use --model llama-8b-shape        # GPU
"""

from __future__ import annotations

import sys
import time

from benchmarks.common import bench_parser, environment, load_bench_model, write_results
from runtime.engine import Engine, Turn

COLUMNS = ["round", "kind", "rows_or_tokens", "width", "ms", "new_shapes"]


def serve_round(engine, agents: int, prompt: int, new: int, tag: str) -> float:
    """Submit `agents` turns of `prompt` tokens at once and step until they end; returns seconds."""
    t0 = time.perf_counter()
    for a in range(agents):
        engine.submit(Turn(f"{tag}-{a}", f"agent{a}", None, [(7 * a + i) % 1000 + 3 for i in range(prompt)],
                           max_tokens=new))
    while engine.has_work():
        for outcome in engine.step():
            if isinstance(outcome, Exception):
                raise outcome
    return time.perf_counter() - t0


def main(argv=None) -> int:
    ap = bench_parser(__doc__)
    ap.add_argument("--agents", type=int, default=5)
    ap.add_argument("--prompt", type=int, default=2300)
    ap.add_argument("--new", type=int, default=16)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--slow", type=float, default=40.0, help="report steps and chunks slower than this (ms)")
    args = ap.parse_args(argv)
    env = environment()
    print(env, flush=True)
    model, tokenizer, spec = load_bench_model(args.model)
    engine = Engine(model, tokenizer, spec)
    print(f"warm-up {engine.warmup():.1f} s", flush=True)
    rows = []
    for r in range(1, args.rounds + 1):
        steps, chunks = len(engine.stats.decode_steps), len(engine.stats.prefill_chunks)
        firsts = len(engine.stats.first_shapes)
        seconds = serve_round(engine, args.agents, args.prompt, args.new, f"r{r}")
        new_shapes = {shape for shape, _ in list(engine.stats.first_shapes)[firsts:]}
        print(f"round {r}: {seconds:.2f} s, new shapes {sorted(new_shapes)}", flush=True)
        for step in list(engine.stats.decode_steps)[steps:]:
            if step.total_s * 1e3 > args.slow:
                rows.append(dict(round=r, kind="decode", rows_or_tokens=step.rows, width="", ms=step.total_s * 1e3,
                                 new_shapes=""))
        for tokens, context, sec, _ in list(engine.stats.prefill_chunks)[chunks:]:
            if sec * 1e3 > args.slow:
                rows.append(dict(round=r, kind="prefill", rows_or_tokens=tokens, width=context, ms=sec * 1e3,
                                 new_shapes=""))
        rows.append(dict(round=r, kind="round total", rows_or_tokens=args.agents, width="", ms=seconds * 1e3,
                         new_shapes=len(new_shapes)))
    write_results(args.name or f"first_use-{args.model}", env, rows, COLUMNS, args.out,
                  notes=f"{args.agents} turns of {args.prompt} tokens per round, {args.new} new tokens each, after "
                        f"Engine.warmup; rows: decode steps and prefill chunks over {args.slow:.0f} ms (prefill: "
                        "tokens and context before), and each round's total with its count of new shapes.")
    return 0


if __name__ == "__main__":
    sys.exit(main())
