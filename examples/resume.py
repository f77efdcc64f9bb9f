"""Resume: run this twice; the second process picks the agent up from disk, warm.

An agent's history (its journal) and its 4-bit KV cache are written to
--cache-dir after every turn. A new process that spawns the same name over the
same folder finds both: its first turn reuses the cache from disk ("warm") and
prefills only the new message, not the whole conversation.

    python examples/resume.py          # first run: nothing stored, the first turn is cold
    python examples/resume.py          # second run: the first turn is warm
    python examples/resume.py --fresh  # forget everything and start over

With no --model the embedded SmolLM2-135M-Instruct runs; `--model tiny` runs a
random-weight model (fast, but the text is nonsense). Caches are kept per model, so switching --model starts cold.
"""

import shutil
from pathlib import Path

from common import example_parser
from runtime import Runtime
from runtime.tiny import is_tiny_model
from runtime.store import inspect_table

DEFAULT_CACHE_DIR = "~/.cache/kvactors/resume-example"


def main():
    parser = example_parser(__doc__, 48, cache_dir=DEFAULT_CACHE_DIR)
    parser.add_argument("--fresh", action="store_true", help="delete --cache-dir first, to start over")
    args = parser.parse_args()
    cache_dir = Path(args.cache_dir).expanduser()
    if args.fresh:
        shutil.rmtree(cache_dir, ignore_errors=True)
    if cache_dir.is_dir():  # what `kvactors inspect` shows: the agents stored there
        print(inspect_table(cache_dir), "\n")

    with Runtime(model=args.model, cache_dir=cache_dir) as rt:
        scribe = rt.spawn("scribe", system="You are a scribe. Acknowledge each note in one sentence.")
        turns = [r for r in scribe.history() if r["role"] == "assistant"]
        if turns:
            print(f"found scribe in {cache_dir}: {len(turns)} earlier turns; the last answer was "
                  f"{turns[-1]['text'].strip()[:60]!r}")
        else:
            print(f"nothing stored in {cache_dir} yet: the first turn is cold")

        for i in range(len(turns) + 1, len(turns) + 3):
            r = scribe.ask(f"Note {i}: the run that wrote this note was one process among many.",
                           max_tokens=args.max_tokens, timeout=120)
            print(f"turn {i}: cache={r.cache:<4}  ttft={r.timings.ttft_s * 1000:7.1f} ms  "
                  f"prefill={r.timings.prefill_tokens} tok")
    print("run me again with the same --cache-dir: the next process resumes warm")
    if is_tiny_model(rt.spec.model_id):
        print("(tiny model: random weights, so the text is nonsense)")


if __name__ == "__main__":
    main()
