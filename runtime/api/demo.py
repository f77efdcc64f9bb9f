"""The demo behind `kvactors demo`: agents going cold → hot → warm, with their TTFT."""

from __future__ import annotations

import tempfile
import time

from runtime.api.facade import Runtime, _at_least, check_room
from runtime.tiny import is_tiny_model

AGENTS = {"alice": "You are Alice, a careful planner. Answer in one short sentence.",
          "bob": "You are Bob, a skeptical reviewer. Answer in one short sentence."}


def run_demo(model=None, cache_dir=None, max_tokens: int = 16, kv_bits: int | None = None,
             kv_scheme: str | None = None) -> int:
    """Run two agents on `model` (None: the embedded default model) through three steps; return 0.

    1. cold: each agent's first turn prefills its whole context (alice asks, bob answers her);
    2. hot: both answer at once, batched, from caches kept in memory;
    3. warm: a new Runtime over the same `cache_dir` (None: a fresh temporary folder),
       as after a process restart: both resume from their caches on disk.
    Prints a prefill progress bar for the first turns, then agent, cache state, time to
    first token (TTFT) and text per turn, then the ratios. The KV cache is quantized under
    the model's default scheme (6-bit keys, 4-bit values, rotated: within 1% of an
    unquantized cache's perplexity on SmolLM2-135M, the default model) unless `kv_bits`
    (4 or 8: the plain scheme of that many bits) or `kv_scheme` (a scheme name) says
    otherwise, as `Runtime` takes them.
    """
    _at_least("max_tokens", max_tokens, 1, int)  # checked before the model loads, not at the first turn
    cache_dir = cache_dir or tempfile.mkdtemp(prefix="kvactors-demo-")
    ttfts: dict[str, list[float]] = {}
    opts = dict(max_tokens=max_tokens, timeout=120)

    def show(r):
        ttfts.setdefault(r.cache, []).append(r.timings.ttft_s)
        text = " ".join("".join(c if c.isprintable() else " " for c in r.text).split())
        print(f"  {r.agent:<6} {r.cache:<4}  ttft {r.timings.ttft_s * 1000:7.1f} ms  "
              f"prefill {r.timings.prefill_tokens:4d} tok  {text[:160]}")
        return r

    def progress(name):
        def bar(done, total):  # called on the batcher's thread after each prefill chunk
            filled = 20 * done // max(total, 1)
            print(f"\r  {name:<6} prefill [{'#' * filled}{'.' * (20 - filled)}] {done}/{total} tok",
                  end="\n" if done >= total else "", flush=True)
        return bar

    def spawn(rt, t0):
        # listed before the spawns, which load each stored cache into memory ("hot") for the agent's first turn
        stored = ", ".join(f"{a.name} ({a.turns} turns, cache {a.cache})" for a in rt.agents()) or "none yet"
        agents = [rt.spawn(name, system=role) for name, role in AGENTS.items()]
        print(f"runtime up in {time.perf_counter() - t0:.2f}s: model {rt.spec.model_id}, "
              f"agents stored {stored}, caches in {cache_dir}")
        return agents

    t0 = time.perf_counter()
    with Runtime(model=model, cache_dir=cache_dir, kv_bits=kv_bits, kv_scheme=kv_scheme) as rt:
        check_room(max_tokens, rt.max_context)  # refused now, not after the first turns
        alice, bob = spawn(rt, t0)
        if is_tiny_model(rt.spec.model_id):
            print("tiny model: random weights, so the text below is nonsense")
        print("1. first turns (alice answers, bob reviews her answer):")
        plan = show(alice.ask("What should we sell at the school bake sale?", on_progress=progress("alice"), **opts))
        show(alice.send_to(bob, plan.text or "...", on_progress=progress("bob"), **opts).get(timeout=120))
        print("2. both at once, batched:")
        for f in rt.broadcast([alice, bob], "What could go wrong on the day?", **opts):
            show(f.get(timeout=120))
    print("3. restart: a new Runtime over the same cache dir")
    t0 = time.perf_counter()
    with Runtime(model=model, cache_dir=cache_dir, kv_bits=kv_bits, kv_scheme=kv_scheme) as rt:
        alice, bob = spawn(rt, t0)
        for f in rt.broadcast([alice, bob], "Sum up our plan in a few words.", **opts):
            show(f.get(timeout=120))

    mean = {state: sum(v) / len(v) for state, v in ttfts.items()}
    parts = [f"{s} {mean[s] * 1000:.0f} ms" for s in ("cold", "hot", "warm") if s in mean]
    if "cold" in mean:
        parts += [f"{s}/cold {mean[s] / mean['cold']:.2f} ({_speed(mean['cold'] / mean[s])})"
                  for s in ("hot", "warm") if s in mean]
    else:
        parts.append(f"no cold turn: alice and bob were already stored in {cache_dir}")
    print("mean TTFT: " + ", ".join(parts))
    return 0


def _speed(ratio: float) -> str:
    """'3.2x faster', or what it was when not faster (short prompts on a busy CPU gain little)."""
    if ratio >= 1.05:
        return f"{ratio:.1f}x faster"
    return "about as fast" if ratio > 0.95 else f"{1 / ratio:.1f}x slower"
