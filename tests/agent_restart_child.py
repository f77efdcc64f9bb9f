"""Child process of the process-restart test (tests/test_agents.py).

`python tests/agent_restart_child.py CACHE_DIR START END` opens a Runtime over
CACHE_DIR on the embedded tiny model (under $KVACTORS_HOME), spawns alice and bob,
runs steps START..END-1 of `STEPS` (greedy, short) and prints one JSON line: a list
of {"step", "agent", "tokens", "text", "cache"} for every reply, then exits.
`run(cache_dir, start, end)` does the same in-process.
"""

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

SYSTEMS = {"alice": "You are Alice, a planner.", "bob": "You are Bob, a reviewer."}
# (kind, text): "ask" = alice takes a turn; "send_to" = alice's message to bob, whose reply
# lands in alice's history as a note (so alice's next turn extends past her cache).
STEPS = [
    ("ask", "Plan a bake sale."),
    ("send_to", "Bob, review this."),
    ("ask", "Go on."),
    ("ask", "Who bakes?"),
    ("send_to", "Bob, anything else?"),
    ("ask", "Summarize."),
]
MAX_TOKENS = 6


def run(cache_dir, start: int, end: int) -> list[dict]:
    from runtime import Runtime

    out = []
    with Runtime(model=None, cache_dir=cache_dir) as rt:
        alice = rt.spawn("alice", system=SYSTEMS["alice"])
        bob = rt.spawn("bob", system=SYSTEMS["bob"])
        for step in range(start, end):
            kind, text = STEPS[step]
            if kind == "ask":
                r = alice.ask(text, max_tokens=MAX_TOKENS, timeout=60)
            else:
                r = alice.send_to(bob, text, max_tokens=MAX_TOKENS, timeout=60).get(timeout=65)
            out.append({"step": step, "agent": r.agent, "tokens": list(r.tokens), "text": r.text, "cache": r.cache})
    return out


if __name__ == "__main__":
    cache_dir, start, end = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    print(json.dumps(run(cache_dir, start, end)))
