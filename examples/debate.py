"""Debate: two agents argue for N rounds with `rt.converse`, and the transcript is printed.

`rt.converse([pro, con], opening, rounds)` runs a round-robin conversation: the
first agent answers the opening, then each agent answers the previous reply,
which is attributed to its author in the listener's history. Each agent's
cache grows with the debate; after its first (cold) turn every turn is hot and
prefills only the opponent's last message.

    python examples/debate.py --rounds 3
    python examples/debate.py --model mlx-community/Llama-3.2-3B-Instruct-4bit \\
        --topic "Remote work is better than office work."

With no --model the embedded SmolLM2-135M-Instruct runs; `--model tiny` runs a
random-weight model (fast, but the text is nonsense).
"""

import textwrap

from common import cache_dir_of, example_parser
from runtime import Runtime
from runtime.tiny import is_tiny_model


def printable(text):
    return "".join(c if c.isprintable() or c == "\n" else " " for c in text).strip()


def main():
    parser = example_parser(__doc__, 96)
    parser.add_argument("--rounds", type=int, default=2,
                        help="rounds of the debate; each agent speaks once per round (default: 2)")
    parser.add_argument("--topic", default="Cities should ban cars from their centers.",
                        help="the motion to debate (default: %(default)r)")
    args = parser.parse_args()
    cache_dir = cache_dir_of(args, "debate")

    rules = "Reply to your opponent's last point in at most three sentences."
    with Runtime(model=args.model, cache_dir=cache_dir) as rt:
        pro = rt.spawn("pro", system=f"You argue FOR the motion: {args.topic} {rules}")
        con = rt.spawn("con", system=f"You argue AGAINST the motion: {args.topic} {rules}")
        opening = f"The motion is: {args.topic} Make your opening argument."
        print(f"Motion: {args.topic}\n")
        replies = rt.converse([pro, con], opening, rounds=args.rounds,
                              max_tokens=args.max_tokens, timeout=120)
        for i, r in enumerate(replies):
            print(f"[round {i // 2 + 1}] {r.agent} ({r.cache}, ttft {r.timings.ttft_s * 1000:.0f} ms, "
                  f"prefilled {r.timings.prefill_tokens} tokens):")
            print(textwrap.indent(textwrap.fill(printable(r.text) or "...", 88), "    "), "\n")
    if is_tiny_model(rt.spec.model_id):
        print("(tiny model: random weights, so the text is nonsense)")


if __name__ == "__main__":
    main()
