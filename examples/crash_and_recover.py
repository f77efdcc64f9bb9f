"""Crash and recover: an agent crashes mid-turn, its supervisor restarts it, and it resumes warm.

A turn that raises is a crash: the caller gets `AgentCrashed` (with the turn
id), the agent's in-memory state is dropped and its supervisor starts a fresh
actor, which reloads the last durable state from disk. The `AgentRef` keeps
working, and the next turn reuses the cache loaded from disk ("warm"), so it
prefills only the new message instead of the whole context. The example
compares that turn with the first, cold one.

    python examples/crash_and_recover.py
    python examples/crash_and_recover.py --model mlx-community/Llama-3.2-1B-Instruct-4bit

With no --model the embedded SmolLM2-135M-Instruct runs; `--model tiny` runs a
random-weight model (fast, but the text is nonsense).
"""

import logging

from common import cache_dir_of, example_parser
from runtime import AgentCrashed, Runtime
from runtime.tiny import is_tiny_model
from runtime.api.testing import inject_crash

# A long-ish system prompt, so that re-prefilling it would cost something.
SYSTEM = "You are Ada, the on-call engineer of a small web shop. " + " ".join(
    f"Runbook step {i}: check the {part} dashboard, note anything unusual, and page the owner if it stays red."
    for i, part in enumerate(["checkout", "payments", "search", "inventory", "email", "CDN", "database", "queue"]))


def show(label, r):
    t = r.timings
    print(f"{label:<22} cache={r.cache:<4}  ttft={t.ttft_s * 1000:7.1f} ms  prefill={t.prefill_tokens:4d} tok "
          f"in {t.prefill_s * 1000:6.1f} ms")
    return r


def main():
    parser = example_parser(__doc__, 32)
    args = parser.parse_args()
    cache_dir = cache_dir_of(args, "crash")
    # The supervisor logs every crash with its traceback; this example prints its own account.
    logging.getLogger("actors.supervisor").setLevel(logging.CRITICAL)
    opts = dict(max_tokens=args.max_tokens, timeout=120)

    with Runtime(model=args.model, cache_dir=cache_dir) as rt:
        ada = rt.spawn("ada", system=SYSTEM)
        cold = show("1. first turn", ada.ask("The checkout dashboard is red. What first?", **opts))
        show("2. next turn", ada.ask("It is green again. Anything else?", **opts))
        before = len(ada.history())

        inject_crash(ada)  # the next turn raises at its end, before anything is written
        try:
            ada.ask("Summarize the incident.", **opts)
        except AgentCrashed as e:
            print(f"3. crashing turn       AgentCrashed: {e}")
        print(f"   ada restarted by its supervisor; durable history: {before} records before, "
              f"{len(ada.history())} after (the crashed turn left nothing)")

        warm = show("4. after the restart", ada.ask("Summarize the incident.", **opts))
        show("5. and then", ada.ask("Thanks, good night.", **opts))

    ratio = cold.timings.ttft_s / max(warm.timings.ttft_s, 1e-9)
    print(f"\nTTFT after the crash ({warm.cache}): {warm.timings.ttft_s * 1000:.1f} ms vs "
          f"{cold.timings.ttft_s * 1000:.1f} ms for the first, cold turn: {ratio:.1f}x faster")
    if is_tiny_model(rt.spec.model_id):
        print("(tiny model: random weights, so the text is nonsense)")


if __name__ == "__main__":
    main()
