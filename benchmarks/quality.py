"""KV-cache quality on a real model: perplexity and greedy agreement per cache kind.

Perplexity: real English text that ships with the OS (the GPL-3 licence text by
default), tokenized without special tokens, its first --tokens tokens fed with
teacher forcing in 256-token chunks through the cache, so every chunk attends to
the earlier chunks as the cache stores them. Greedy agreement: --prompts chat
prompts answered greedily (--new tokens) with each cache, against the answer
with the unquantized cache: how many answers are identical, and the mean share
of tokens before the first difference.

Caches: the unquantized KV cache (the model's dtype: float32 on CPU), and 8- and
4-bit caches at groups 64 and 32: mlx-lm's QuantizedKVCache, which packs each
token's keys and values along head_dim with `mx.quantize` as kvactors' Q4 cache
does (kvactors' own cache gives the same tokens on this model).

    python -m benchmarks quality                      # the embedded default, SmolLM2-135M-Instruct
    python -m benchmarks.quality --model some.gguf --tokens 4096
"""

from __future__ import annotations

import math
import time
from pathlib import Path

import mlx.core as mx

from benchmarks.common import bench_parser, environment, write_results

TEXT = Path("/usr/share/common-licenses/GPL-3")
CACHES = [("unquantized", None, None), ("Q8 g64", 8, 64), ("Q8 g32", 8, 32), ("Q4 g64", 4, 64), ("Q4 g32", 4, 32)]
COLUMNS = ["kv cache", "bytes x fp16", "perplexity", "x unquantized", "identical answers", "shared prefix"]
PROMPTS = [
    "What is the capital of France?", "Name three primary colors.", "How many days are in a week?",
    "What do bees make?", "Give me a synonym for happy.", "What is 12 plus 7?", "Why is the sky blue?",
    "Write a haiku about rain.", "What is the boiling point of water in Celsius?", "Who wrote Romeo and Juliet?",
    "Suggest a name for a pet goldfish.", "What is photosynthesis?", "List two uses of a paperclip.",
    "Translate 'thank you' into Spanish.", "What planet is known as the red planet?",
    "How do I make a cup of tea?", "What is the opposite of cold?", "Describe a cat in one sentence.",
    "What is the largest ocean on Earth?", "Give one tip for better sleep.",
]


def make_cache(model, bits, group):
    """A fresh per-layer cache: mlx-lm's KVCache (bits None) or QuantizedKVCache(group, bits)."""
    from mlx_lm.models.cache import QuantizedKVCache, make_prompt_cache

    if bits is None:
        return make_prompt_cache(model)
    return [QuantizedKVCache(group_size=group, bits=bits) for _ in model.layers]


def perplexity(model, ids: list[int], bits, group, chunk: int = 256) -> float:
    """exp(mean next-token NLL) of `ids`, fed `chunk` tokens at a time through one cache."""
    cache = make_cache(model, bits, group)
    total, count = 0.0, 0
    for start in range(0, len(ids) - 1, chunk):
        x = ids[start:start + chunk]
        y = ids[start + 1:start + chunk + 1]
        logits = model(mx.array([x]), cache=cache)[0, : len(y)].astype(mx.float32)
        logprobs = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
        nll = -mx.take_along_axis(logprobs, mx.array(y)[:, None], axis=-1).sum()
        total += nll.item()
        count += len(y)
    return math.exp(total / count)


def greedy(model, prompt: list[int], bits, group, new: int, eos: set[int]) -> list[int]:
    """`new` greedy tokens after `prompt` (fewer if an eos comes), through one cache."""
    cache = make_cache(model, bits, group)
    logits = model(mx.array([prompt]), cache=cache)
    out = []
    for _ in range(new):
        token = logits[0, -1].argmax().item()
        out.append(token)
        if token in eos:
            break
        logits = model(mx.array([[token]]), cache=cache)
    return out


def shared_prefix(a: list[int], b: list[int]) -> float:
    """Share of `a` (the reference) before the first token where `b` differs."""
    n = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
    return n / max(len(a), 1)


def main(argv=None) -> int:
    ap = bench_parser(__doc__)
    ap.set_defaults(model=None)
    ap.add_argument("--text", type=Path, default=TEXT, help="English text for perplexity (default: %(default)s)")
    ap.add_argument("--tokens", type=int, default=4096, help="tokens of --text to score (default: %(default)s)")
    ap.add_argument("--prompts", type=int, default=len(PROMPTS), help="chat prompts for greedy agreement")
    ap.add_argument("--new", type=int, default=12, help="greedy tokens per prompt (default: %(default)s)")
    ap.add_argument("--parts", default="ppl,agreement", help="ppl, agreement or both (default: %(default)s)")
    args = ap.parse_args(argv)
    if args.model in ("tiny", "llama-8b-shape"):  # the driver's random-weight presets: quality needs real weights
        args.model = None
    from runtime.model import load_model

    env = environment()
    model, tokenizer, spec = load_model(args.model)
    env["model"] = spec.model_id
    print(env, flush=True)
    parts = set(args.parts.split(","))
    ids = tokenizer.encode(args.text.read_text(), add_special_tokens=False)[: args.tokens]
    system = "You are a helpful assistant. Answer briefly."
    prompts = [tokenizer.apply_chat_template([{"role": "system", "content": system}, {"role": "user", "content": p}],
                                             add_generation_prompt=True) for p in PROMPTS[: args.prompts]]
    eos = set(tokenizer.eos_token_ids)
    rows, reference = [], None
    for label, bits, group in CACHES:
        t0 = time.perf_counter()
        row = {"kv cache": label, "bytes x fp16": 1.0 if bits is None else (bits / 8 + 4 / group) / 2}
        if "ppl" in parts:
            row["perplexity"] = perplexity(model, ids, bits, group)
            row["x unquantized"] = row["perplexity"] / rows[0]["perplexity"] if rows else 1.0
        if "agreement" in parts:
            answers = [greedy(model, p, bits, group, args.new, eos) for p in prompts]
            if reference is None:
                reference = answers
                row["sample"] = tokenizer.decode(answers[0])
            row["identical answers"] = f"{sum(a == r for a, r in zip(answers, reference))}/{len(answers)}"
            row["shared prefix"] = sum(shared_prefix(r, a) for r, a in zip(reference, answers)) / len(answers)
            row["answers"] = [tokenizer.decode(a) for a in answers]
        row["seconds"] = time.perf_counter() - t0
        rows.append(row)
        print({k: v for k, v in row.items() if k != "answers"}, flush=True)
    notes = (f"Perplexity: the first {len(ids)} tokens of {args.text} with teacher forcing in 256-token chunks "
             f"through each cache. Greedy agreement: {len(prompts)} chat prompts, {args.new} new tokens, against "
             f"the unquantized cache. Model: {spec.model_id}.")
    name = args.name or ("quality-smollm2-135m" if args.model is None else f"quality-{Path(str(args.model)).stem}")
    write_results(name, env, rows, [c for c in COLUMNS if any(c in r for r in rows)], args.out, notes)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
