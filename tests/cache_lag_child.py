"""Child process of the SIGKILL-before-the-cache test (tests/test_reliability.py).

`python tests/cache_lag_child.py CACHE_DIR` opens a Runtime over CACHE_DIR on the
embedded tiny model (under $KVACTORS_HOME), spawns alice (`SYSTEM`) and takes turn
`TEXTS[0]`, waiting until its cache is on disk (`Runtime.flush`). From then on every
cache file write hangs at its start, as on a disk too slow to finish before a crash.
It takes turn `TEXTS[1]`, prints one JSON line per acknowledged turn ({"turn_id",
"text", "cache"}), then `held` once that turn's cache write is hanging, and waits to
be killed. On an error (the second turn never acknowledged) it prints the traceback
and exits at once.
"""

import json
import os
import sys
import threading
import traceback
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

SYSTEM = "You are Alice, a planner."
TEXTS = ("Plan a bake sale.", "Who bakes the cakes?")
MAX_TOKENS = 6


def main(cache_dir: str) -> None:
    from runtime import Runtime, store

    rt = Runtime(model=None, cache_dir=cache_dir)
    alice = rt.spawn("alice", system=SYSTEM)
    replies = [alice.ask(TEXTS[0], max_tokens=MAX_TOKENS, timeout=60)]
    rt.flush()
    started, real = threading.Event(), store.write_atomic

    def hang(path, data):
        if path.name.startswith("cache."):
            started.set()
            threading.Event().wait()
        return real(path, data)

    store.write_atomic = hang  # what the persistence actor's cache writer calls
    replies.append(alice.ask(TEXTS[1], max_tokens=MAX_TOKENS, timeout=60))
    for r in replies:
        print(json.dumps({"turn_id": r.turn_id, "text": r.text, "cache": r.cache}), flush=True)
    if started.wait(60):
        print("held", flush=True)
    threading.Event().wait()


if __name__ == "__main__":
    try:
        main(sys.argv[1])
    except BaseException:  # e.g. the second turn timed out: say why and end now, not after the actors
        traceback.print_exc()
        sys.stderr.flush()
        os._exit(1)
