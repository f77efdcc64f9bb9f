"""Quickstart: two persistent agents, a few turns, and the cache state of each turn.

Every agent is an actor with its own 4-bit KV cache. Its first turn prefills the
whole context ("cold"); later turns find the cache in memory ("hot") and prefill
only the new message, so their time to first token (TTFT) stays small.

Run it on the embedded SmolLM2-135M-Instruct, on the random-weight tiny model
(`--model tiny`: fast, the text is nonsense, every mechanism runs), or on another model:

    python examples/quickstart.py
    python examples/quickstart.py --model mlx-community/Llama-3.2-1B-Instruct-4bit
"""


from common import cache_dir_of, example_parser
from runtime import Runtime
from runtime.tiny import is_tiny_model


def show(who, r):
    print(f"{who:>12}  cache={r.cache:<4}  ttft={r.timings.ttft_s * 1000:7.1f} ms  "
          f"prefill={r.timings.prefill_tokens:4d} tok  {r.text.strip()[:60]!r}")


def main():
    parser = example_parser(__doc__, 64)
    args = parser.parse_args()
    cache_dir = cache_dir_of(args, "quickstart")

    with Runtime(model=args.model, cache_dir=cache_dir) as rt:
        alice = rt.spawn("alice", system="You are Alice, a careful planner. Answer in two sentences.")
        bob = rt.spawn("bob", system="You are Bob, a skeptical reviewer. Answer in two sentences.")
        opts = dict(max_tokens=args.max_tokens, timeout=120)

        # A plain turn: the caller asks, the agent answers.
        plan = alice.ask("Draft a plan for a bake sale.", **opts)
        show("alice", plan)
        show("bob", bob.ask("What makes a bake sale fail?", **opts))

        # Agent to agent: bob answers alice; his reply also lands in alice's history.
        review = alice.send_to(bob, plan.text or "...", **opts).get(timeout=120)
        show("bob <- alice", review)
        show("alice", alice.ask("Revise your plan after Bob's review.", **opts))

        print(f"\nalice's history: {len(alice.history())} records "
              "(system, user, assistant, bob's review, ...), kept on disk in", cache_dir)
    if is_tiny_model(rt.spec.model_id):
        print("(tiny model: random weights, so the text is nonsense)")


if __name__ == "__main__":
    main()
