"""Child process of the SIGKILL test (tests/test_reliability.py): agents working until killed.

`python tests/chaos_child.py CACHE_DIR SEED [STEPS]` opens a Runtime over CACHE_DIR on
the embedded tiny model (default supervision: a crash loop would escalate), spawns
alice, bob and carol, prints each one's history as it resumed it, prints `ready`, then
loops over random asks, send_to's and broadcasts (several in flight at once; one
message in four is long, so journal frames often need a new page of disk). It prints
one line per outcome, flushed before the next step, and never exits by itself unless
STEPS is given (then its first step is a broadcast, and after STEPS steps it shuts
down and prints `done`):

    history <agent> <records>             at start: [seq, turn_id, role, sender, text] of each record
    ack <agent> <turn_id> <text>          a turn of <agent> was acknowledged
    fail <agent> <turn_id> <error> <msg>  a turn of <agent> failed with error type <error>
    note <agent> <sender> <reply text>    a send_to future resolved: <agent> must hold the reply
    dead <agent> <sender> <reply text>    a send_to future resolved, but the copy was dead-lettered
    resetting <agent>                     the conversation grew past the model: it is started over...
    reset <agent>                         ...and that is durable
    unprompted <agent>                    at start: spawn refused its prompt (SystemPromptChanged), so it
                                          resumes without one; a prompt whose record damage destroyed is
                                          accepted by its checksum and recorded again (see README)

Texts are JSON-quoted. With KVACTORS_CHAOS_ENOSPC=1 in its environment, the disk is
full (injected at `journal._pwrite`: part of a frame reaches the disk, then ENOSPC)
from the start until a random moment: the harness's stand-in for a small full tmpfs
where the system allows no private mount.
"""

import errno
import json
import os
import random
import sys
import threading
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

AGENTS = ("alice", "bob", "carol")


def out(*fields) -> None:
    """Print one protocol line in one write, flushed at once (the parent may kill this process any time).

    One write: with PYTHONUNBUFFERED (tox sets it) `print` writes each field apart, and
    a kill between two of those writes would leave half a line.
    """
    sys.stdout.write(" ".join(str(f) for f in fields) + "\n")
    sys.stdout.flush()


def inject_disk_full(rng: random.Random) -> None:
    """Make journal appends fail with ENOSPC (after writing part of the frame) for a random while."""
    from runtime import journal

    real, full = journal._pwrite, threading.Event()
    full.set()

    def pwrite(fd, data, offset):
        if full.is_set():
            real(fd, bytes(data[: len(data) // 2]), offset)
            raise OSError(errno.ENOSPC, "No space left on device")
        return real(fd, data, offset)

    journal._pwrite = pwrite
    threading.Timer(rng.uniform(0.2, 2.0), full.clear).start()


def message(rng: random.Random, seed: int, step: int, kind: str) -> str:
    """A message unique to this step; one in four is long (about 700 bytes)."""
    text = f"s{seed}-{step} {kind}"
    if rng.random() < 0.25:
        text += " " + " ".join(rng.choice(("plan", "review", "ship", "wait", "ask")) for _ in range(120))
    return text


def outcome(rt, refs, name: str, future, text: str, sender: str | None = None) -> None:
    """Wait for `future` (a turn of `name`); print what happened to it and, for a send_to, to its copy."""
    from runtime import KvactorsError, TurnTooLong

    try:
        r = future.get(timeout=60)
    except KvactorsError as e:
        out("fail", name, future.turn_id, type(e).__name__, json.dumps(str(e)[:300]))
        if isinstance(e, TurnTooLong):
            reset(refs, name)
        return
    out("ack", name, r.turn_id, json.dumps(text))
    if sender is not None:
        dead = any(d.recipient == sender and _note_text(d.message) == (name, r.text) for d in rt.dead_letters)
        out("dead" if dead else "note", sender, name, json.dumps(r.text))


def _note_text(message):
    import msgpack

    payload = getattr(message, "payload", None)
    if not isinstance(payload, bytes):
        return None
    msg = msgpack.unpackb(payload)
    return msg.get("sender"), msg.get("text")


def reset(refs, name: str) -> None:
    """Start `name`'s conversation over (it grew past the model), saying so before and after."""
    from runtime import KvactorsError

    out("resetting", name)
    try:
        refs[name].reset([]).get(timeout=60)
        out("reset", name)
    except KvactorsError as e:
        out("fail", name, "-", type(e).__name__, json.dumps(str(e)[:300]))


def spawn(rt, name: str):
    """Spawn `name` with its prompt; resume it without one if spawn refuses that prompt."""
    from runtime import SystemPromptChanged

    try:
        return rt.spawn(name, system=f"You are {name}.")
    except SystemPromptChanged:
        out("unprompted", name)
        return rt.spawn(name)


def sent(name: str, send):
    """The future `send()` returns, or None (after printing the failure) if it raised."""
    from runtime import KvactorsError

    try:
        return send()
    except KvactorsError as e:
        out("fail", name, "-", type(e).__name__, json.dumps(str(e)[:300]))
        return None


def step(rt, refs, rng: random.Random, seed: int, n: int, kind: str) -> None:
    """Step `n`: an ask, a send_to or a broadcast (`kind`) with random agents; print every outcome."""
    a, b = rng.sample(AGENTS, 2)
    text = message(rng, seed, n, kind)
    if kind == "ask":
        futures = [(a, sent(a, lambda: refs[a].send(text, max_tokens=3)), None)]
    elif kind == "send_to":
        futures = [(b, sent(b, lambda: refs[a].send_to(refs[b], text, max_tokens=3)), a)]
    else:  # several turns in flight at once
        futures = [(name, sent(name, lambda ref=ref: ref.send(text, max_tokens=3)), None) for name, ref in refs.items()]
    for name, future, sender in futures:
        if future is not None:
            outcome(rt, refs, name, future, text, sender)


def main(cache_dir: str, seed: int, steps: int | None) -> None:
    """Run the agents over `cache_dir` until killed, or for `steps` steps then shut down."""
    from runtime import JournalError, Runtime

    rng = random.Random(seed)
    if os.environ.get("KVACTORS_CHAOS_ENOSPC") == "1":
        inject_disk_full(rng)
    rt = Runtime(model=None, cache_dir=cache_dir)
    refs = {name: spawn(rt, name) for name in AGENTS}
    for name, ref in refs.items():
        try:
            records = ref.history()
        except JournalError as e:  # its journal was made unreadable (a permission attack): the parent checks it
            out("unreadable", name, json.dumps(str(e)[:300]))
            records = []
        history = [[r["seq"], r["turn_id"], r["role"], r.get("sender"), r["text"]] for r in records]
        out("history", name, json.dumps(history))
    out("ready")
    n = 0
    while steps is None or n < steps:
        n += 1
        kind = "broadcast" if steps and n == 1 else rng.choice(("ask", "send_to", "broadcast"))
        step(rt, refs, rng, seed, n, kind)
    rt.shutdown()
    out("done")


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]), int(sys.argv[3]) if len(sys.argv) > 3 else None)
