"""The SIGKILL harness: a process running agents is killed again and again, with faults mixed in.

Each round starts `chaos_child.py` (a Runtime with three agents at work) over the same
cache folder, lets it work and SIGKILLs it at a random moment. A round mixes in one attack:

- kill: nothing else.
- disk-full: the disk is full when the child starts; it is freed at a random moment of
  the round, or only after the kill. The disk is real where the system allows user
  namespaces: the cache folder is a small tmpfs, mounted in a private mount namespace
  that a sleeping process holds and every child joins (this process reaches it through
  /proc/<holder>/root). Elsewhere the child injects ENOSPC at `journal._pwrite`.
- damage: while the child is down, a random span of one agent's journal is damaged:
  bytes flipped or zeroed, a span cut out, garbage inserted, or the file cut inside one of its
  last five frames.
- permission: while the child is down, one agent's journal, folder or cache file is made
  unreadable or unwritable; it is restored after the round. The children run without
  CAP_DAC_OVERRIDE (`setpriv`), so a root user is denied too; where no child can be
  denied, these rounds are plain kills and the report says so.

After every round the journals on disk, and the histories the round's child resumed,
are checked against what the children printed: every acknowledged turn is there
exactly once and in order; a turn refused with TurnNotSaved, JournalError or
TurnTooLong is not there; every send_to copy whose future resolved (and was not
dead-lettered) is held; no seq ever names two records. The records whose bytes the
damage destroyed are exempt, must be gone, and their loss must be logged; every other
record must be recovered. A destroyed seq above every mark left on disk (the last
record's, the cache's, the journal's high-water mark) may be used again, and must not
be an acknowledged turn's. In fault rounds the Runtime must keep serving: the agents not
attacked are acknowledged turns, and errors are of the specific types (on a full disk
any agent may get them, otherwise only the attacked one); no other error is allowed
in any round. A last child runs without attack and exits cleanly: every agent serves.

`python tests/chaos.py [--kills N] [--seed S]` runs it and prints the table;
tests/test_reliability.py runs it with KVACTORS_KILLS kills (20 by default).
"""

from __future__ import annotations

import argparse
import errno
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from runtime import store  # noqa: E402
from runtime.files import CACHE_FILE, JOURNAL_FILE  # noqa: E402

AGENTS = ("alice", "bob", "carol")
ATTACKS = ("kill", "disk-full", "damage", "permission")
CHILD = Path(__file__).resolve().parent / "chaos_child.py"
REFUSED = {"TurnNotSaved", "JournalError", "TurnTooLong"}  # a turn refused so is not in the journal
ALLOWED = {"kill": {"TurnTooLong"}, "damage": {"TurnTooLong"}, "disk-full": REFUSED, "permission": REFUSED}
FULL_DISK_TURNS = 8  # answers a child must give on a full disk before it is freed or killed
LOSS_LOGGED = ("damaged in the middle", "did not read", "newer than its journal", "tail was cut off")
DENIALS = (("journal", 0o000), ("journal", 0o400), ("folder", 0o500), ("folder", 0o000), ("cache", 0o000))


class ChaosFailure(AssertionError):
    """An invariant broke; the message says which, in which round, and holds the table so far."""


# -- where the agents live ----------------------------------------------------------------


class Disk:
    """The children's cache folder: `path` as the children see it, `view` as this process does.

    A 64 MiB tmpfs in a private mount namespace when `unshare -rm` works (`real` True),
    else a plain folder under `root`. `prefix` is the command prefix that starts a child
    inside (nsenter) and without the capability to override file permissions (setpriv);
    `can_deny` says whether a file made unreadable is unreadable to such a child.
    """

    def __init__(self, root: Path, size_mb: int = 64):
        self.root, self.holder = root, _hold_tmpfs(root / "mnt", size_mb)
        self.real = self.holder is not None
        if self.real:
            self.path = root / "mnt" / "agents"
            self.view = Path(f"/proc/{self.holder.pid}/root{self.path}")
            enter = ["nsenter", "-t", str(self.holder.pid), "-U", "-m", "--preserve-credentials", "--"]
        else:
            self.path = self.view = root / "agents"
            enter = []
        self.view.mkdir(mode=0o700)
        root_inside = self.real or os.geteuid() == 0
        drop = ["setpriv", "--bounding-set", "-dac_override,-dac_read_search", "--"]
        self.prefix = enter + (drop if root_inside and shutil.which("setpriv") else [])
        self.can_deny = self._probe_denial()

    def _probe_denial(self) -> bool:
        probe = self.view / "probe"
        probe.write_bytes(b"x")
        probe.chmod(0)
        seen = Path(str(probe).replace(str(self.view), str(self.path), 1))
        try:
            r = subprocess.run(self.prefix + [sys.executable, "-c", f"open({str(seen)!r}).read()"],
                               capture_output=True, timeout=60)
            return r.returncode != 0 and b"PermissionError" in r.stderr
        finally:
            probe.unlink()

    def fill(self, leave: int) -> None:
        """Fill the tmpfs with a filler file (outside the cache folder), leaving about `leave` bytes."""
        filler = self.view.parent / "filler"
        with open(filler, "ab", buffering=0) as f:
            try:
                while True:
                    f.write(bytes(1 << 16))
            except OSError as e:
                if e.errno != errno.ENOSPC:
                    raise
        os.truncate(filler, max(0, filler.stat().st_size - leave))

    def free(self) -> None:
        """Delete the filler file, if any."""
        if self.real:
            (self.view.parent / "filler").unlink(missing_ok=True)

    def fingerprint_dir(self) -> Path | None:
        """The model folder inside the cache folder (as this process sees it), None before the first child made it."""
        dirs = [p for p in self.view.iterdir() if p.is_dir()]
        return dirs[0] if dirs else None

    def close(self) -> None:
        """Stop the holder: the tmpfs goes with its namespace."""
        if self.holder is not None:
            self.holder.kill()
            self.holder.wait()


def _hold_tmpfs(mount: Path, size_mb: int):
    """A process holding a private mount namespace with a tmpfs on `mount`, or None where none can be made."""
    if not sys.platform.startswith("linux") or not (shutil.which("unshare") and shutil.which("nsenter")):
        return None
    mount.mkdir()
    script = f'mount -t tmpfs -o size={size_mb}m,mode=0700 tmpfs "$0" && echo mounted && exec sleep 86400'
    try:
        holder = subprocess.Popen(["unshare", "-rm", "--propagation", "private", "sh", "-c", script, str(mount)],
                                  stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    except OSError:
        return None
    if holder.stdout.readline().strip() != "mounted":
        holder.kill()
        holder.wait()
        return None
    return holder


# -- one child ------------------------------------------------------------------


class Child:
    """A running chaos_child.py; its output lines are collected as they come, with their time."""

    def __init__(self, disk: Disk, seed: int, log: Path, steps: int | None = None, env: dict | None = None):
        argv = disk.prefix + [sys.executable, str(CHILD), str(disk.path), str(seed)] + ([str(steps)] if steps else [])
        with open(log, "w") as err:
            self.proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=err, text=True,
                                         env={**os.environ, **(env or {})})
        self.log, self.lines, self.eof = log, [], False
        self._changed = threading.Condition()
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self):
        for line in self.proc.stdout:
            if not line.endswith("\n"):
                break  # the kill cut the last line short: it was never said
            with self._changed:
                self.lines.append((time.monotonic(), line.rstrip("\n")))
                self._changed.notify_all()
        with self._changed:
            self.eof = True
            self._changed.notify_all()

    def wait_for(self, predicate, timeout: float) -> bool:
        """Wait until `predicate(lines)` holds (True) or the child's output ended or `timeout` passed (False)."""
        with self._changed:
            self._changed.wait_for(lambda: self.eof or predicate(self.lines), timeout)
            return predicate(self.lines)

    def kill(self) -> None:
        """SIGKILL the child and wait for it and for the end of its output."""
        self.proc.send_signal(signal.SIGKILL)
        self.finish()

    def finish(self, timeout: float = 120) -> None:
        """Wait for the child to exit and for the end of its output."""
        self.proc.wait(timeout)
        self._reader.join(timeout)

    def stderr(self) -> str:
        """What the child wrote to stderr (its log lines)."""
        return self.log.read_text(errors="replace")


def _outcomes(lines, agents=AGENTS, kinds=("ack", "fail"), since: float = 0.0) -> int:
    """How many of `lines` (from `since` on) are of `kinds` and about one of `agents`."""
    parts = [line.split(" ", 2) for t, line in lines if t >= since]
    return sum(1 for p in parts if len(p) > 1 and p[0] in kinds and p[1] in agents)


def _histories(lines) -> dict:
    """agent -> the history records the child printed as it resumed them."""
    out = {}
    for _, line in lines:
        if line.startswith("history "):
            _, name, records = line.split(" ", 2)
            out[name] = json.loads(records)
    return out


# -- what the children said, and the checks of the files against it ---------------------------


@dataclass
class Tally:
    """One attack's row of the table."""

    rounds: int = 0
    acks: int = 0
    checked: int = 0
    refused: int = 0
    destroyed: int = 0
    lost: int = 0


@dataclass
class Ledger:
    """Per agent: the acknowledged turns in order, refused turns, send_to copies to hold, destroyed turns, seqs seen.

    `current`: the acknowledged turns since the agent's last reset, which its resumed
    history must hold (None while a reset was begun and not confirmed).
    """

    acked: dict = field(default_factory=lambda: {a: [] for a in AGENTS})
    refused: dict = field(default_factory=lambda: {a: set() for a in AGENTS})
    notes: dict = field(default_factory=lambda: {a: Counter() for a in AGENTS})
    destroyed: dict = field(default_factory=lambda: {a: set() for a in AGENTS})
    seen: dict = field(default_factory=lambda: {a: {} for a in AGENTS})
    current: dict = field(default_factory=lambda: {a: [] for a in AGENTS})
    exposed: list = field(default_factory=list)  # acknowledged turns whose seqs damage left free for reuse

    def take(self, lines, attack: str, attacked: str | None, tally: Tally) -> list:
        """Record a child's outcome lines; return the problems with the errors it got."""
        problems = []
        for _, line in lines:
            kind, _, rest = line.partition(" ")
            if kind in ("resetting", "reset"):
                self.current[rest] = None if kind == "resetting" else []
            elif kind == "ack":
                name, turn_id, text = rest.split(" ", 2)
                self.acked[name].append((turn_id, json.loads(text)))
                if self.current[name] is not None:
                    self.current[name].append(turn_id)
                tally.acks += 1
            elif kind in ("note", "dead"):
                name, sender, text = rest.split(" ", 2)
                if kind == "note":
                    self.notes[name][(sender, json.loads(text))] += 1
            elif kind == "fail":
                name, turn_id, error, message = rest.split(" ", 3)
                tally.refused += 1
                if error in REFUSED:
                    self.refused[name].add(turn_id)
                if error not in ALLOWED[attack] or (attack == "permission" and name != attacked
                                                    and error != "TurnTooLong"):
                    problems.append(f"{name}: turn {turn_id} failed with {error}: {json.loads(message)}")
        return problems

    def history_problems(self, agent: str, history: list, records) -> list:
        """Whether the history a child resumed holds the turns acknowledged since the last reset, as the journal has them.

        It must be the journal's current conversation up to its last record.
        """
        if not history:
            return [f"{agent}: resumed with an empty history"]
        last, problems = history[-1][0], []
        want = store.current_conversation([r for r in records if r["seq"] <= last])
        want = [[r["seq"], r["turn_id"], r["role"], r.get("sender"), r["text"]] for r in want]
        if history != want:
            problems.append(f"{agent}: resumed history {history[-3:]} is not the journal's {want[-3:]}")
        held = {r[1] for r in history}
        missing = [t for t in self.current[agent] or () if t not in held and t not in self.destroyed[agent]]
        if missing:
            problems.append(f"{agent}: {len(missing)} acknowledged turns are not in the resumed history: {missing[:5]}")
        return problems

    def forget_destroyed(self, agent: str, records, visible: int) -> None:
        """The damage destroyed these records of `agent`: their turns are exempt, their copies no longer owed.

        A destroyed seq above every mark still on disk (`visible`: the last surviving
        record's, the cache's or the journal's high-water mark) has left no trace: it may
        be used again, and it must not be an acknowledged turn's (`exposed`).
        """
        acked = {t for t, _ in self.acked[agent]}
        for r in records:
            if r["seq"] > visible:
                self.seen[agent].pop(r["seq"], None)
                if r["turn_id"] in acked:
                    self.exposed.append(f"{agent}: acknowledged turn {r['turn_id']} (seq {r['seq']}) left no mark on disk")
            if r["turn_id"] is not None:
                self.destroyed[agent].add(r["turn_id"])
            elif r["role"] == "user" and self.notes[agent][(r.get("sender"), r["text"])] > 0:
                self.notes[agent][(r.get("sender"), r["text"])] -= 1

    def check_journal(self, agent: str, records) -> tuple[list, int]:
        """Problems of `agent`'s journal records against the ledger, and how many acknowledged turns are missing."""
        problems = []
        seqs = [r["seq"] for r in records]
        if seqs != sorted(set(seqs)):
            problems.append(f"{agent}: seqs do not rise strictly")
        for r in records:
            key = (r["turn_id"], r["role"], r.get("sender"), r["text"], r["time"])
            if self.seen[agent].setdefault(r["seq"], key) != key:
                problems.append(f"{agent}: seq {r['seq']} names two records: {self.seen[agent][r['seq']]} and {key}")
        by_turn: dict = {}
        for r in records:
            if r["turn_id"] is not None:
                by_turn.setdefault(r["turn_id"], []).append(r)
        for turn_id, rs in by_turn.items():
            roles = [r["role"] for r in rs]
            if roles != ["user", "assistant"] and not (turn_id in self.destroyed[agent] and len(roles) == 1):
                problems.append(f"{agent}: turn {turn_id} is recorded as {roles}")
        order, positions, lost = list(by_turn), [], 0
        for turn_id, text in self.acked[agent]:
            if turn_id in self.destroyed[agent]:
                continue
            if turn_id not in by_turn:
                lost += 1
                problems.append(f"{agent}: acknowledged turn {turn_id} ({text[:40]!r}) is missing")
                continue
            if by_turn[turn_id][0]["text"] != text:
                problems.append(f"{agent}: turn {turn_id} holds another text")
            positions.append(order.index(turn_id))
        if positions != sorted(positions):
            problems.append(f"{agent}: acknowledged turns are out of order")
        problems += [f"{agent}: refused turn {t} is in the journal" for t in self.refused[agent] & set(by_turn)]
        held = Counter((r.get("sender"), r["text"]) for r in records if r["turn_id"] is None and r["role"] == "user")
        problems += [f"{agent}: send_to copy {k} is missing" for k in self.notes[agent] - held]
        return problems, lost


def read_records(folder: Path | None) -> list:
    """The records of the journal in agent folder `folder` that check, read as the runtime reads them (its
    high-water mark says which appends were acknowledged) ([] if there is none)."""
    if folder is None:
        return []
    scan = store.scan_folder(folder)
    return [] if scan is None else scan.records


# -- attacks while the child is down --------------------------------------------------------


def damage(path: Path, rng: random.Random) -> tuple[str, list, bool, int] | None:
    """Damage a random span of the journal at `path`.

    Returns (how, the records destroyed, whether the damage can be seen in the file,
    the highest seq still on disk).
    None when the journal has too few records to damage.
    """
    data = bytearray(path.read_bytes())
    scan = store.scan_journal(bytes(data))
    if len(scan.frames) < 3:
        return None
    how = rng.choice(("flip", "zero", "cut", "insert", "truncate"))
    start = scan.frames[0][0] if rng.random() < 0.15 else rng.randrange(len(store.JOURNAL_MAGIC), len(data))
    if how in ("flip", "zero"):
        stop = min(len(data), start + rng.randint(1, 16 if how == "flip" else 400))
        old = bytes(data)
        for i in range(start, stop):
            data[i] = data[i] ^ rng.randrange(1, 256) if how == "flip" else 0
        hit = [i for i, (a, b) in enumerate(scan.frames) if old[a:b] != bytes(data[a:b])]
    elif how == "cut":
        stop = min(len(data), start + rng.randint(1, 300))
        del data[start:stop]
        hit = [i for i, (a, b) in enumerate(scan.frames) if a < stop and b > start]
    elif how == "insert":
        data[start:start] = bytes(rng.randrange(256) for _ in range(rng.randint(1, 100)))
        hit = [i for i, (a, b) in enumerate(scan.frames) if a < start < b]
    else:
        k = max(0, len(scan.frames) - rng.randint(1, 5))  # the file loses its last few records, one of them in part
        a, b = scan.frames[k]
        del data[rng.randrange(a + 1, b):]
        hit = list(range(k, len(scan.frames)))
    path.write_bytes(bytes(data))
    after = store.scan_journal(bytes(data))
    marks = (store.cache_seq(path.parent), store.high_seq(path.parent))
    visible = max([after.last_seq, *(m for m in marks if m is not None)])
    return how, [scan.records[i] for i in hit], bool(after.damaged or after.torn or visible > after.last_seq), visible


def deny(folder: Path, rng: random.Random):
    """Make one of `folder`'s files or `folder` itself unreadable or unwritable; return (what, undo)."""
    what, mode = rng.choice(DENIALS)
    path = {"journal": folder / JOURNAL_FILE, "folder": folder, "cache": folder / CACHE_FILE}[what]
    if not path.exists():
        what, path = "journal", folder / JOURNAL_FILE
    old = path.stat().st_mode & 0o777
    path.chmod(mode)
    return f"{what} {mode:03o}", lambda: path.chmod(old)


# -- the rounds ------------------------------------------------------------------


@dataclass
class Report:
    """What a chaos run did, attack by attack; `notes` says what could not be run here."""

    tallies: dict = field(default_factory=lambda: {a: Tally() for a in ATTACKS})
    notes: list = field(default_factory=list)
    seconds: float = 0.0

    @property
    def kills(self) -> int:
        """Rounds played, each ending in a SIGKILL."""
        return sum(t.rounds for t in self.tallies.values())

    @property
    def lost(self) -> int:
        """Acknowledged turns found missing, over all rounds."""
        return sum(t.lost for t in self.tallies.values())

    def table(self) -> str:
        """The report as a markdown table, one row per attack and a total, then the notes."""
        rows = ["| attack | rounds (each ends in SIGKILL) | turns acknowledged in them | acknowledged turns checked "
                "after them | turns refused (specific error) | records destroyed by the damage | acknowledged turns lost |",
                "|---|---|---|---|---|---|---|"]
        fields = ("rounds", "acks", "checked", "refused", "destroyed", "lost")
        for name, t in [*self.tallies.items(), ("all", Tally(*(sum(getattr(t, f) for t in self.tallies.values())
                                                               for f in fields)))]:
            rows.append(f"| {name} | " + " | ".join(str(getattr(t, f)) for f in fields) + " |")
        return "\n".join(rows + [f"{self.kills} kills survived in {self.seconds:.0f} s"] + self.notes)


def schedule(kills: int, rng: random.Random) -> list[str]:
    """The attack of each round: the first a plain kill, then about 40% kills and 20% of each fault, shuffled."""
    rest = kills - 1
    each = max(1, rest // 5) if rest >= 3 else 0
    plan = [a for a in ATTACKS[1:] for _ in range(each)]
    plan += ["kill"] * (rest - len(plan))
    rng.shuffle(plan)
    return ["kill"] + plan


class Run:
    """One chaos run over a fresh cache folder under `root`."""

    def __init__(self, root: Path, seed: int):
        self.root, self.rng, self.seed = root, random.Random(seed), seed
        self.disk = Disk(root)
        self.ledger, self.report = Ledger(), Report()
        if not self.disk.real:
            self.report.notes.append("disk-full: injected ENOSPC at journal._pwrite (no private tmpfs here)")
        if not self.disk.can_deny:
            self.report.notes.append("permission: not run (a child here reads files whatever their mode)")

    def folder(self, agent: str) -> Path | None:
        """`agent`'s folder as this process sees it, None before the first child made the model folder."""
        fp = self.disk.fingerprint_dir()
        return None if fp is None else fp / agent

    def play(self, i: int, attack: str) -> None:
        """Round `i`: attack, start a child, let it work, SIGKILL it, undo the attack, check everything."""
        tally, problems, prepared = self.report.tallies, [], self._attack(attack)
        attack, attacked, undo, env, free_during, destroyed = prepared
        child = Child(self.disk, self.seed * 100_000 + i, self.root / f"child-{i}.log", env=env)
        try:
            if not child.wait_for(lambda ls: any(line == "ready" for _, line in ls), 180):
                raise ChaosFailure(f"round {i} ({attack}): the child did not start:\n{child.stderr()[-3000:]}")
            ready = time.monotonic()
            self._work(child, ready, attack, attacked, free_during, problems)
            child.kill()
        finally:
            if child.proc.poll() is None:
                child.kill()
            undo()
            self.disk.free()
        if child.proc.returncode != -signal.SIGKILL:
            problems.append(f"the child exited with {child.proc.returncode}, not by SIGKILL")
        self._check(i, attack, attacked, child, destroyed, tally[attack], problems)

    def _attack(self, attack):
        """Prepare a round's attack: (attack, attacked agent, undo, child env, free the disk during the round,
        destroyed records); a damage or permission attack with nothing to attack yet is a plain kill."""
        agent = self.rng.choice(AGENTS)
        folder, undo, env, free_during, destroyed = self.folder(agent), (lambda: None), {}, None, None
        if attack == "damage":
            done = None if folder is None else damage(folder / JOURNAL_FILE, self.rng)
            if done is None:
                return "kill", None, undo, env, None, None
            how, records, detectable, visible = done
            self.ledger.forget_destroyed(agent, records, visible)
            self.report.tallies["damage"].destroyed += len(records)
            destroyed = (agent, how, records, detectable)
        elif attack == "permission":
            if folder is None or not folder.exists() or not self.disk.can_deny:
                return "kill", None, undo, env, None, None
            _, undo = deny(folder, self.rng)
        elif attack == "disk-full":
            agent = None
            if self.disk.real:
                self.disk.fill(self.rng.choice((0, 0, 4096, 16384, 65536)))
                free_during = self.rng.random() < 0.6  # else the disk stays full until the kill
            else:
                env = {"KVACTORS_CHAOS_ENOSPC": "1"}
        else:
            agent = None
        return attack, agent, undo, env, free_during, destroyed

    def _work(self, child, ready, attack, attacked, free_during, problems) -> None:
        """Let the child work until the kill: a random while, and in fault rounds until it showed it still serves."""
        kill_at = ready + self.rng.uniform(0.05, 1.5)
        if attack == "disk-full":  # enough turns on the full disk that journal appends need new pages
            if not child.wait_for(lambda ls: _outcomes(ls) >= FULL_DISK_TURNS, 60):
                problems.append(f"on a full disk, fewer than {FULL_DISK_TURNS} turns got any answer")
            if free_during:
                self.disk.free()
                freed = time.monotonic()
                if not child.wait_for(lambda ls: _outcomes(ls, kinds=("ack",), since=freed) > 0, 60):
                    problems.append("no turn was acknowledged after the disk was freed")
        elif attack == "permission":
            others = [a for a in AGENTS if a != attacked]
            if not child.wait_for(lambda ls: _outcomes(ls, others, ("ack",)) > 0 and _outcomes(ls, (attacked,)) > 0, 60):
                problems.append(f"with {attacked}'s files denied, the others were not served (or {attacked} never answered)")
        child.wait_for(lambda ls: False, kill_at - time.monotonic())

    def _check(self, i, attack, attacked, child, destroyed, tally: Tally, problems: list) -> None:
        tally.rounds += 1
        histories = _histories(child.lines)
        for agent in AGENTS:  # as resumed, before this round's turns
            records, history = read_records(self.folder(agent)), histories.get(agent)
            broken_ok = attack == "disk-full" or (attack == "permission" and agent == attacked)
            if history is None:
                problems.append(f"{agent}: the child printed no history")
            elif history or not broken_ok:
                problems += self.ledger.history_problems(agent, history, records)
        problems += self.ledger.take(child.lines, attack, attacked, tally)
        problems += self.ledger.exposed
        for agent in AGENTS:
            found, lost = self.ledger.check_journal(agent, read_records(self.folder(agent)))
            problems += found
            tally.lost += lost
            tally.checked += sum(t not in self.ledger.destroyed[agent] for t, _ in self.ledger.acked[agent])
        if destroyed is not None:
            agent, how, records, detectable = destroyed
            gone = {(r["seq"], r["time"]) for r in records}
            problems += [f"{agent}: destroyed record seq {r['seq']} came back" for r in read_records(self.folder(agent))
                         if (r["seq"], r["time"]) in gone]
            if records and detectable and not any(s in child.stderr() for s in LOSS_LOGGED):
                problems.append(f"damage ({how}) destroyed {len(records)} records and no loss was logged")
        if problems:
            self.report.notes.append(f"round {i} ({attack}, {attacked}) FAILED")
            raise ChaosFailure(f"round {i} ({attack}, attacked: {attacked}): " + "\n".join(problems[:20])
                               + f"\n\n{self.report.table()}\n\nchild stderr:\n{child.stderr()[-4000:]}")

    def finale(self) -> None:
        """A last child, with nothing attacked, works a few steps and shuts down: every agent serves."""
        child = Child(self.disk, self.seed * 100_000 + 99_999, self.root / "child-final.log", steps=6)
        child.finish(300)
        tally, problems = Tally(), []
        if child.proc.returncode != 0 or not child.lines or child.lines[-1][1] != "done":
            problems.append(f"the last child did not finish cleanly ({child.proc.returncode})")
        histories = _histories(child.lines)
        for agent in AGENTS:
            problems += self.ledger.history_problems(agent, histories.get(agent, []), read_records(self.folder(agent)))
        problems += self.ledger.take(child.lines, "kill", None, tally)
        for agent in AGENTS:
            problems += self.ledger.check_journal(agent, read_records(self.folder(agent)))[0]
            if not _outcomes(child.lines, (agent,), ("ack",)):
                problems.append(f"{agent} was not served in the last run")
        if problems:
            raise ChaosFailure("last run: " + "\n".join(problems[:20]) + f"\n\n{child.stderr()[-4000:]}")

    def close(self) -> None:
        """Release the disk (the tmpfs holder)."""
        self.disk.close()


def run(root: Path, kills: int, seed: int = 0) -> Report:
    """Play `kills` rounds (each ends in a SIGKILL) and a last clean run in a fresh folder under `root`.

    Returns the report; raises ChaosFailure at the first round whose checks fail.
    """
    t0 = time.monotonic()
    chaos = Run(Path(root), seed)
    try:
        for i, attack in enumerate(schedule(kills, chaos.rng)):
            chaos.play(i, attack)
        chaos.finale()
    finally:
        chaos.close()
        chaos.report.seconds = time.monotonic() - t0
    return chaos.report


def main() -> None:
    """The command line: run the harness in a temp folder and print its table."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--kills", type=int, default=200)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    os.environ.setdefault("KVACTORS_MODEL", "tiny")
    os.environ["HF_HUB_OFFLINE"] = "1"
    with tempfile.TemporaryDirectory(prefix="kvactors-chaos-") as root:
        os.environ.setdefault("KVACTORS_HOME", str(Path(root) / "home"))
        report = run(Path(root), args.kills, args.seed)
    print(report.table())


if __name__ == "__main__":
    main()
