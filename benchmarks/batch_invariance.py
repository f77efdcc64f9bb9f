"""Batched against solo greedy output on a real model: does batching change an agent's tokens?

Each of --prompts chat prompts is answered greedily twice by the engine: alone
(max_batch=1), and batched with --batch - 1 other prompts of other lengths
(left-padded into one batch, prefills interleaved with decode steps). Reports,
per prompt, whether the tokens are identical and where they first differ.

    python -m benchmarks.batch_invariance                 # SmolLM2-135M-Instruct, Q4 KV cache
    python -m benchmarks.batch_invariance --kv-scheme k8v8-g64 --batch 8
"""

from __future__ import annotations

import time

from benchmarks import batching
from benchmarks.common import bench_parser, environment, write_results
from benchmarks.quality import PROMPTS

COLUMNS = ["prompt", "prompt tokens", "solo tokens", "identical", "first difference"]


def serve(engine, turns):
    """Results of `turns` submitted together and served to completion, in submission order."""
    by_id = {r.turn_id: r for r in batching.serve(engine, turns)[1]}
    return [by_id[t.turn_id] for t in turns]


def main(argv=None) -> int:
    ap = bench_parser(__doc__)
    ap.set_defaults(model=None)
    ap.add_argument("--prompts", type=int, default=len(PROMPTS), help="chat prompts (default: %(default)s)")
    ap.add_argument("--batch", type=int, default=4, help="agents per batch (default: %(default)s)")
    ap.add_argument("--new", type=int, default=12, help="greedy tokens per answer (default: %(default)s)")
    ap.add_argument("--kv-scheme", default=None, help="KV scheme name (default: the model's, runtime.kvscheme)")
    args = ap.parse_args(argv)
    if args.model in ("tiny", "llama-8b-shape"):
        args.model = None
    from runtime.engine import Engine, Turn
    from runtime.kvscheme import parse
    from runtime.model import load_model

    env = environment()
    model, tokenizer, spec = load_model(args.model, parse(args.kv_scheme) if args.kv_scheme else None)
    env["model"] = spec.model_id
    print(env, flush=True)
    system = "You are a helpful assistant. Answer briefly."
    texts = PROMPTS[: args.prompts]
    prompts = [tokenizer.apply_chat_template([{"role": "system", "content": system}, {"role": "user", "content": p}],
                                             add_generation_prompt=True) for p in texts]

    def turns(indices, tag):
        return [Turn(f"{tag}{i}", f"a{i}", None, prompts[i], max_tokens=args.new) for i in indices]

    t0 = time.perf_counter()
    solo = [serve(Engine(model, tokenizer, spec, max_batch=1), turns([i], "solo"))[0] for i in range(len(prompts))]
    solo_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    batched = []
    for start in range(0, len(prompts), args.batch):
        group = range(start, min(start + args.batch, len(prompts)))
        batched += serve(Engine(model, tokenizer, spec, max_batch=args.batch), turns(group, "batch"))
    batched_s = time.perf_counter() - t0
    rows = []
    for text, prompt, s, b in zip(texts, prompts, solo, batched):
        diff = next((i for i, (x, y) in enumerate(zip(s.tokens, b.tokens)) if x != y), None)
        if diff is None and len(s.tokens) != len(b.tokens):
            diff = min(len(s.tokens), len(b.tokens))
        rows.append({"prompt": text, "prompt tokens": len(prompt), "solo tokens": len(s.tokens),
                     "identical": s.tokens == b.tokens, "first difference": "" if diff is None else diff,
                     "solo": s.text, "batched": b.text})
    same = sum(r["identical"] for r in rows)
    notes = (f"{same}/{len(rows)} answers identical, batched {args.batch} at a time against solo; "
             f"KV cache {spec.kv_scheme.name}, {args.new} new tokens, greedy. "
             f"Solo {solo_s:.0f} s, batched {batched_s:.0f} s. Model: {spec.model_id}.")
    print(notes)
    name = args.name or f"batch_invariance-{spec.kv_scheme.name}"
    write_results(name, env, rows, COLUMNS, args.out, notes)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
