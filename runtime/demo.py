"""The demo behind `kvactors demo`."""

from __future__ import annotations

import time


def run_demo(model=None, cache_dir=None, max_tokens: int = 24) -> int:
    """Load `model` (None: the embedded tiny model) and greedily answer one chat turn.

    Prints what it does and the timings; returns 0. The embedded model has random
    weights: its text is nonsense, but every mechanism runs on it.
    """
    import mlx_lm
    from mlx_lm.sample_utils import make_sampler

    from runtime.model import load_model

    t0 = time.perf_counter()
    net, tokenizer, spec = load_model(model)
    print(f"model: {spec.model_id} ({spec.n_layers} layers, fingerprint {spec.fingerprint[:12]})"
          f" loaded in {time.perf_counter() - t0:.2f}s")
    if model is None:
        print("embedded default model: random weights, so the text below is nonsense")
    messages = [{"role": "user", "content": "Draft a plan for a bake sale."}]
    prompt = tokenizer.apply_chat_template(messages, add_generation_prompt=True)
    t0 = time.perf_counter()
    text = mlx_lm.generate(net, tokenizer, prompt, max_tokens=max_tokens, sampler=make_sampler(0.0))
    print(f"reply ({time.perf_counter() - t0:.2f}s): {text!r}")
    return 0
