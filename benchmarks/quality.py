"""KV-cache quality on a real model: perplexity and greedy agreement per cache kind.

Perplexity: real English text that ships with the OS (the GPL-3 licence text by
default), tokenized without special tokens, its first --tokens tokens fed with
teacher forcing in 256-token chunks through the cache, so every chunk attends to
the earlier chunks as the cache stores them. Greedy agreement: --prompts chat
prompts answered greedily (--new tokens) with each cache, against the answer
with the unquantized cache: how many answers are identical, and the mean share
of tokens before the first difference.

Caches: the unquantized KV cache (the model's dtype: float32 on CPU); mlx-lm's
QuantizedKVCache at 8 and 4 bits (--mlx, e.g. "8:64,4:64"), the anchor; and
kvactors' own batch cache (`runtime.q4cache`, one row) under each KV scheme of
--schemes (`runtime.kvscheme` names; "default" is the model's default), through
attention route --route. --route-spread repeats the default scheme's perplexity on
every other route that runs here: the routes compute the same attention in a
different order, so their numbers differ slightly. Each row reports bytes per
token against a 16-bit cache (16-bit scales, as on a GPU) and the mean decode
step of the greedy part.

    python -m benchmarks quality                      # the embedded default, SmolLM2-135M-Instruct
    python -m benchmarks.quality --model some.gguf --tokens 4096 --schemes default,k4v4-g64
"""

from __future__ import annotations

import math
import time
from pathlib import Path

import mlx.core as mx

from benchmarks.common import bench_parser, environment, write_results

TEXT = Path("/usr/share/common-licenses/GPL-3")
SCHEMES = "k4v4-g64,k8v8-g64,k6v4-g64,k4v4-g64-hadamard,k5v4-g32-hadamard,default"
COLUMNS = ["kv cache", "route", "bytes x fp16", "perplexity", "x unquantized", "identical answers", "shared prefix",
           "decode ms/token"]
PROMPTS = [
    "What is the capital of France?", "Name three primary colors.", "How many days are in a week?",
    "What do bees make?", "Give me a synonym for happy.", "What is 12 plus 7?", "Why is the sky blue?",
    "Write a haiku about rain.", "What is the boiling point of water in Celsius?", "Who wrote Romeo and Juliet?",
    "Suggest a name for a pet goldfish.", "What is photosynthesis?", "List two uses of a paperclip.",
    "Translate 'thank you' into Spanish.", "What planet is known as the red planet?",
    "How do I make a cup of tea?", "What is the opposite of cold?", "Describe a cat in one sentence.",
    "What is the largest ocean on Earth?", "Give one tip for better sleep.",
]


def cache_kinds(spec, mlx: str, schemes: str, route: str | None, spread: bool) -> list[dict]:
    """The caches to measure: label, route, bytes per token against 16-bit KV, and how to make one.

    `mlx`: "bits:group" pairs for mlx-lm's QuantizedKVCache; `schemes`: kvactors
    scheme names ("default": the model's); with `spread`, the default scheme again
    on every other route that runs here.
    """
    from runtime.kvscheme import default_scheme, parse, plain
    from runtime.q4cache import ROUTES, Q4CacheError, check_route, route_for
    from runtime.qgemv import available as on_cuda

    kinds = [dict(label="unquantized", route="", bytes=1.0, make=lambda model: None)]
    for pair in filter(None, mlx.split(",")):
        bits, group = (int(x) for x in pair.split(":"))
        kinds.append(dict(label=f"mlx-lm QuantizedKVCache {bits}-bit g{group}", route="",
                          bytes=plain(bits, group).fp16_ratio(spec.k_head_dim, spec.v_head_dim), make=_mlx_cache(bits, group)))
    default = default_scheme(spec.has_sinks)
    for name in filter(None, schemes.split(",")):
        scheme = default if name == "default" else parse(name)
        s = spec.with_scheme(scheme)
        label = f"kvactors {scheme.name}" + (" (default)" if scheme == default else "")
        kinds.append(dict(label=label, route=route_for(s, route), bytes=scheme.fp16_ratio(spec.k_head_dim, spec.v_head_dim),
                          make=_kvactors_cache(s, route)))
    if spread:
        s = spec.with_scheme(default)
        for other in ROUTES:
            try:
                if other == route_for(s, route) or check_route(other) != other:
                    continue
            except Q4CacheError:
                continue  # not on this machine
            if other == "quantized" and on_cuda():
                continue  # MLX-CUDA's quantized matmul lacks these shapes (6-bit keys fail in prefill)
            kinds.append(dict(label=f"kvactors {default.name} (default)", route=other,
                              bytes=default.fp16_ratio(spec.k_head_dim, spec.v_head_dim), make=_kvactors_cache(s, other), ppl_only=True))
    return kinds


def _mlx_cache(bits, group):
    def make(model):
        from mlx_lm.models.cache import QuantizedKVCache

        return [QuantizedKVCache(group_size=group, bits=bits) for _ in model.layers]

    return make


def _kvactors_cache(spec, route):
    def make(model):
        from runtime.q4cache import make_batch_cache

        return make_batch_cache(spec, 1, route)

    return make


def make_cache(model, kind: dict):
    """A fresh per-layer cache of `kind` (see `cache_kinds`): mlx-lm's KVCache for the unquantized one."""
    from mlx_lm.models.cache import make_prompt_cache

    return kind["make"](model) or make_prompt_cache(model)


def perplexity(model, ids: list[int], kind: dict, chunk: int = 256) -> float:
    """exp(mean next-token NLL) of `ids`, fed `chunk` tokens at a time through one cache of `kind`."""
    cache = make_cache(model, kind)
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


def greedy(model, prompt: list[int], kind: dict, new: int, eos: set[int], steps: list) -> list[int]:
    """`new` greedy tokens after `prompt` (fewer if an eos comes), through one cache of `kind`.

    Appends the seconds of each decode step to `steps`.
    """
    cache = make_cache(model, kind)
    logits = model(mx.array([prompt]), cache=cache)
    out = []
    for _ in range(new):
        token = logits[0, -1].argmax().item()
        out.append(token)
        if token in eos:
            break
        t0 = time.perf_counter()
        logits = model(mx.array([[token]]), cache=cache)
        mx.eval(logits)
        steps.append(time.perf_counter() - t0)
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
    ap.add_argument("--mlx", default="4:64", help="mlx-lm QuantizedKVCache bits:group pairs (default: %(default)s)")
    ap.add_argument("--schemes", default=SCHEMES, help="kvactors KV schemes (default: %(default)s)")
    ap.add_argument("--route", default=None, help="attention route of kvactors' cache (default: this machine's)")
    ap.add_argument("--route-spread", action="store_true", help="the default scheme's perplexity on every route")
    args = ap.parse_args(argv)
    if args.model in ("tiny", "llama-8b-shape"):  # the driver's random-weight presets: quality needs real weights
        args.model = None
    from runtime import attention
    from runtime.model import load_model

    attention.install()
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
    for kind in cache_kinds(spec, args.mlx, args.schemes, args.route, args.route_spread):
        t0 = time.perf_counter()
        row = {"kv cache": kind["label"], "route": kind["route"], "bytes x fp16": kind["bytes"]}
        if "ppl" in parts:
            row["perplexity"] = perplexity(model, ids, kind)
            row["x unquantized"] = f"{row['perplexity'] / rows[0]['perplexity'] if rows else 1.0:.4f}"
        if "agreement" in parts and not kind.get("ppl_only"):
            steps = []
            answers = [greedy(model, p, kind, args.new, eos, steps) for p in prompts]
            if reference is None:
                reference = answers
            row["identical answers"] = f"{sum(a == r for a, r in zip(answers, reference))}/{len(answers)}"
            row["shared prefix"] = sum(shared_prefix(r, a) for r, a in zip(reference, answers)) / len(answers)
            row["decode ms/token"] = 1000 * sum(steps) / max(len(steps), 1)
            row["sample"] = tokenizer.decode(answers[0])
            row["answers"] = [tokenizer.decode(a) for a in answers]
        row["seconds"] = time.perf_counter() - t0
        rows.append(row)
        print({k: v for k, v in row.items() if k != "answers"}, flush=True)
    notes = {"ppl": f"Perplexity: the first {len(ids)} tokens of {args.text} with teacher forcing in 256-token "
                    f"chunks through each cache.",
             "agreement": f"Greedy agreement: {len(prompts)} chat prompts, {args.new} new tokens, against the "
                          f"unquantized cache; decode ms/token is the mean greedy step."}
    notes = " ".join(notes[p] for p in ("ppl", "agreement") if p in parts)
    notes += f" Bytes x fp16 count 16-bit scales and biases. Model: {spec.model_id}."
    name = args.name or ("quality-smollm2-135m" if args.model is None else f"quality-{Path(str(args.model)).stem}")
    write_results(name, env, rows, [c for c in COLUMNS if any(c in r for r in rows)], args.out, notes)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
