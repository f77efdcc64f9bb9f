"""Child process of the SIGKILL test (tests/test_reliability.py): agents working until killed.

`python tests/chaos_child.py CACHE_DIR SEED` opens a Runtime over CACHE_DIR on the
embedded tiny model, spawns alice, bob and carol, prints `ready`, then loops over
random asks, send_to's and broadcasts (several in flight at once) and prints one
line per acknowledgement, flushed before the next step:

    ack <agent> <turn_id> <text>          a turn of <agent> was acknowledged
    note <agent> <sender> <reply text>    a send_to future resolved: <agent> must hold the reply

Texts are JSON-quoted. It never exits by itself.
"""

import json
import random
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

AGENTS = ("alice", "bob", "carol")


def main(cache_dir: str, seed: int) -> None:
    from runtime import Runtime

    rng = random.Random(seed)
    rt = Runtime(model=None, cache_dir=cache_dir, max_restarts=1000)
    refs = {name: rt.spawn(name, system=f"You are {name}.") for name in AGENTS}
    for ref in refs.values():
        ref.history()  # loaded
    print("ready", flush=True)
    step = 0
    while True:
        step += 1
        kind = rng.choice(("ask", "send_to", "broadcast"))
        a, b = rng.sample(AGENTS, 2)
        text = f"s{seed}-{step} {kind}"
        if kind == "ask":
            r = refs[a].ask(text, max_tokens=3)
            print(f"ack {a} {r.turn_id} {json.dumps(text)}", flush=True)
        elif kind == "send_to":
            r = refs[a].send_to(refs[b], text, max_tokens=3).get(timeout=60)
            print(f"ack {b} {r.turn_id} {json.dumps(text)}", flush=True)
            print(f"note {a} {b} {json.dumps(r.text)}", flush=True)
        else:
            futures = rt.broadcast(list(refs.values()), text, max_tokens=3)
            for name, f in zip(refs, futures):
                r = f.get(timeout=60)
                print(f"ack {name} {r.turn_id} {json.dumps(text)}", flush=True)


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]))
