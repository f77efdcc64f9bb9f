"""Child process of the disk-full test (tests/test_reliability.py): a Runtime on a full tmpfs.

`unshare -rm python tests/disk_full_child.py MOUNT_POINT` mounts a small tmpfs on
MOUNT_POINT (in its own mount namespace, so it needs no privileges where user
namespaces are allowed), runs alice and bob on the embedded tiny model with the
tmpfs as cache_dir, fills the tmpfs up with a filler file, keeps asking (long
messages, so journal frames need new pages: some appends are cut short by ENOSPC),
frees the space, asks again, restarts the Runtime, and prints one JSON line:
{"acked": {agent: [[turn_id, text, reply], ...]}, "not_saved": n, "journals": {agent:
records after the restart}, "histories": {agent: history after the restart}}.
"""

import errno
import json
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

AGENTS = ("alice", "bob")
ROUNDS_FULL, ROUNDS_AFTER = 3, 1


def fill(path: Path) -> None:
    """Write zeros to `path` until the file system is full."""
    with open(path, "wb", buffering=0) as f:
        try:
            while True:
                f.write(bytes(4096))
        except OSError as e:
            if e.errno != errno.ENOSPC:
                raise


def main(mount_point: str) -> None:
    from runtime import Runtime, TurnNotSaved, store

    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=4m,mode=0700", "tmpfs", mount_point], check=True)
    root = Path(mount_point)
    cache_dir = root / "agents"
    acked = {name: [] for name in AGENTS}
    not_saved = 0
    with Runtime(model=None, cache_dir=cache_dir) as rt:
        refs = {name: rt.spawn(name, system=f"You are {name}.") for name in AGENTS}
        for name, ref in refs.items():
            r = ref.ask(f"{name} starts.", max_tokens=3)
            acked[name].append([r.turn_id, f"{name} starts.", r.text])
        fill(root / "filler")
        for rounds, full in ((ROUNDS_FULL, True), (ROUNDS_AFTER, False)):
            if not full:
                (root / "filler").unlink()
            for i in range(rounds):
                for name, ref in refs.items():
                    text = f"{name} round {i}: " + "turns " * 350  # ~2 KB: a frame needs a new page
                    try:
                        r = ref.ask(text, max_tokens=3)
                    except TurnNotSaved:
                        not_saved += 1
                        continue
                    acked[name].append([r.turn_id, text, r.text])
    with Runtime(model=None, cache_dir=cache_dir) as rt:
        histories = {name: rt.spawn(name).history() for name in AGENTS}
        journals = {name: store.read_journal(cache_dir, rt.spec, name) for name in AGENTS}
    print(json.dumps({"acked": acked, "not_saved": not_saved, "journals": journals, "histories": histories}))


if __name__ == "__main__":
    main(sys.argv[1])
