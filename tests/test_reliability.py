"""Faults a Runtime must survive: a full disk, a damaged, deleted or unreadable journal,
bad options, retries, use after shutdown, SIGKILL. The invariant after each: every
acknowledged turn is in the history once, in order, and the other agents go on being
served.

The full disk is injected at the one call that writes journal bytes (`journal._pwrite`:
part of the frame reaches the disk, then ENOSPC); `disk_full_child.py` fills a real
tmpfs instead, where the system allows one. `chaos.py` is the SIGKILL harness: it kills
`chaos_child.py` again and again (KVACTORS_KILLS times; 20 by default), mixing in a
full disk, damaged journals and denied files. Random options, valid and invalid, are
`test_api_properties.py`'s.
"""

from __future__ import annotations

import errno
import json
import logging
import os
import subprocess
import sys
import threading
from pathlib import Path

import chaos
import pytest

from actors.supervisor import Backoff
from runtime import (AgentCrashed, JournalError, Runtime, RuntimeClosed, SystemPromptChanged, TurnNotSaved, TurnTimeout,
                     TurnTooLarge, journal, prefix, store)
from runtime.api.facade import AgentRef
from runtime.api.testing import inject_crash

FAST = Backoff(min=0.001, max=0.02, reset=10.0)
TESTS = Path(__file__).resolve().parent


def folder_of(rt, name):
    return store.agent_dir(rt.cache_dir, rt.spec.fingerprint, name)


def on_disk(rt, name) -> list[dict]:
    """`name`'s journal records as on disk now."""
    return store.read_journal(rt.cache_dir, rt.spec, name)


def turns(records) -> list[tuple]:
    """(turn id, role, text) of the records of turns, in journal order."""
    return [(r["turn_id"], r["role"], r["text"]) for r in records if r["turn_id"] is not None]


def replies(acked) -> list[tuple]:
    """The records an acknowledged list of (text, Reply) must have left, in order."""
    return [x for text, r in acked for x in ((r.turn_id, "user", text), (r.turn_id, "assistant", r.text))]


def test_disk_full_fails_only_that_turn_and_the_runtime_keeps_serving(tmp_path, monkeypatch):
    real, failures = journal._pwrite, []

    def disk_full_once(fd, data, offset):
        if not failures:
            failures.append(offset)
            real(fd, bytes(data[:12]), offset)  # a torn frame on disk, then ENOSPC
            raise OSError(errno.ENOSPC, "No space left on device")
        return real(fd, data, offset)

    with Runtime(model=None, cache_dir=tmp_path, max_restarts=1, backoff=FAST) as rt:
        alice, bob = rt.spawn("alice", system="You are Alice."), rt.spawn("bob", system="You are Bob.")
        acked = {"alice": [("One.", alice.ask("One.", max_tokens=4))], "bob": []}
        me = rt._env.refs["alice"]
        monkeypatch.setattr(journal, "_pwrite", disk_full_once)
        with pytest.raises(TurnNotSaved) as lost:
            alice.ask("Lost.", max_tokens=4)
        assert lost.value.turn_id and "No space left" in str(lost.value)
        assert failures and turns(alice.history()) == replies(acked["alice"])  # back at its durable state
        assert store.high_seq(folder_of(rt, "alice")) == on_disk(rt, "alice")[-1]["seq"]  # no cut to claim later
        for name, ref in (("bob", bob), ("alice", alice), ("bob", bob), ("alice", alice)):
            text = f"After {len(acked[name])}."
            acked[name].append((text, ref.ask(text, max_tokens=4)))
        assert rt._env.refs["alice"] is me and rt._escalation is None  # no crash, no restart
        assert turns(on_disk(rt, "alice")) == replies(acked["alice"])
    with Runtime(model=None, cache_dir=tmp_path) as rt:
        for name in ("alice", "bob"):
            assert turns(rt.spawn(name).history()) == replies(acked[name])
        assert not list(tmp_path.rglob("journal.torn-*"))


def damage_record(path, index):
    """Flip a byte inside the payload of the journal's record number `index`."""
    data = bytearray(path.read_bytes())
    start, stop = store.scan_journal(bytes(data)).frames[index]
    data[(start + stop) // 2] ^= 0x5A
    path.write_bytes(bytes(data))


def test_mid_file_journal_damage_keeps_every_record_that_checks_and_writes_go_on(tmp_path, caplog):
    with Runtime(model=None, cache_dir=tmp_path) as rt:
        alice = rt.spawn("alice", system="You are Alice.")
        acked = [(t, alice.ask(t, max_tokens=4)) for t in ("One.", "Two.", "Three.")]
        journal = folder_of(rt, "alice") / store.JOURNAL_FILE
        before = on_disk(rt, "alice")
    damage_record(journal, 3)  # the user record of "Two." (0 is the system prompt)
    caplog.set_level(logging.ERROR)
    with Runtime(model=None, cache_dir=tmp_path) as rt:
        alice = rt.spawn("alice")
        assert alice.history() == before[:3] + before[4:]  # everything after the damage is still there
        assert "damaged in the middle" in caplog.text and "after seq 3 and before seq 5" in caplog.text
        more = alice.ask("Four.", max_tokens=4)
        seqs = [r["seq"] for r in on_disk(rt, "alice")]
        assert seqs == sorted(set(seqs)) and seqs[-1] > before[-1]["seq"]  # no seq used twice
        rt.flush()
        assert store.cache_seq(folder_of(rt, "alice")) == seqs[-1]  # the newer turn's cache was written
    assert list(journal.parent.glob("journal.damaged-*"))
    with Runtime(model=None, cache_dir=tmp_path) as rt:
        history = rt.spawn("alice").history()
    want = replies(acked + [("Four.", more)])
    assert turns(history) == [t for t in want if t != (acked[1][1].turn_id, "user", "Two.")]


def test_a_system_prompt_whose_record_was_destroyed_is_restored_by_spawn_or_known_to_be_lost(tmp_path, caplog):
    prompt = "You are Alice, " + "a careful planner. " * 40
    with Runtime(model=None, cache_dir=tmp_path) as rt:
        alice = rt.spawn("alice", system=prompt)
        acked = [(t, alice.ask(t, max_tokens=4)) for t in ("One.", "Two.")]
        journal = folder_of(rt, "alice") / store.JOURNAL_FILE
    damage_record(journal, 0)  # the system record: the only one that held the prompt
    caplog.set_level(logging.WARNING)
    with Runtime(model=None, cache_dir=tmp_path) as rt:
        with pytest.raises(SystemPromptChanged, match="lost to journal damage") as changed:
            rt.spawn("alice", system="You are Bob.")
        assert changed.value.stored is None  # unknown, not ''
        alice = rt.spawn("alice")  # no prompt given: it goes on without one, and says so
        assert turns(alice.history()) == replies(acked) and "prompt is unknown" in caplog.text
        alice.stop()
        alice = rt.spawn("alice", system=prompt)  # the same prompt: its checksum matches, it is recorded again
        more = alice.ask("Three.", max_tokens=4)
        assert store.conversation_prompt(alice.history()) == prompt
    with Runtime(model=None, cache_dir=tmp_path) as rt:
        alice = rt.spawn("alice", system=prompt)
        assert turns(alice.history()) == replies(acked + [("Three.", more)])
        alice.reset([{"role": "user", "text": "Fresh start.", "sender": None}], system="You are Carol.").get(timeout=60)
    records = store.scan_journal(journal.read_bytes()).records
    damage_record(journal, [r["text"] for r in records].index("You are Carol."))  # the reset's system record
    with Runtime(model=None, cache_dir=tmp_path) as rt:
        alice = rt.spawn("alice", system="You are Carol.")
        assert [r["text"] for r in alice.history()] == ["Fresh start.", "You are Carol."]  # not the old conversation


def test_a_sigkill_after_the_ack_before_the_cache_lands_loses_no_turn_and_re_prefills_only_that_turn(tmp_path):
    """A turn is acknowledged once its journal records are durable, before its cache file is
    written. Killed right then, the process loses nothing: the restarted agent has the turn in its
    history, loads the older cache, and prefills only what that cache lacks, the lost turn's reply as it was
    generated: its next reply is the one it would have given had nothing been killed (it had fed that reply's
    text tokenized again, and answered otherwise)."""
    lag = tmp_path / "lag"
    child = subprocess.Popen([sys.executable, str(TESTS / "cache_lag_child.py"), str(lag)], stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, text=True, env=os.environ.copy())
    try:
        lines = [child.stdout.readline() for _ in range(3)]
    finally:
        child.kill()
        _, err = child.communicate()
    assert lines[2] == "held\n", err  # the second turn was acknowledged while its cache write hung
    acked = [json.loads(line) for line in lines[:2]]
    from cache_lag_child import MAX_TOKENS, SYSTEM, TEXTS

    with Runtime(model=None, cache_dir=tmp_path / "whole") as rt:  # the same turns, nothing killed
        alice = rt.spawn("alice", system=SYSTEM)
        assert [alice.ask(text, max_tokens=MAX_TOKENS).text for text in TEXTS] == [a["text"] for a in acked]
        want = alice.ask("And the pies?", max_tokens=4)
    with Runtime(model=None, cache_dir=lag) as rt:
        host, meta = store.load_cache(lag, rt.spec, "alice")
        assert meta.turn_id == acked[0]["turn_id"]  # on disk: the first turn's cache, not the second's
        alice = rt.spawn("alice", system=SYSTEM)
        history = alice.history()
        assert turns(history) == [x for a, text in zip(acked, TEXTS) for x in ((a["turn_id"], "user", text),
                                                                              (a["turn_id"], "assistant", a["text"]))]
        r = alice.ask("And the pies?", max_tokens=4)
        prompt = rt._env.render(SYSTEM, alice.history()[1:-1])  # this turn's prompt
        keep = prefix.match_prefix(meta.text, meta.token_ids, meta.token_ends, prompt).keep
        assert r.cache == "warm" and r.reused_tokens == keep > 0  # the first turn's cache served its tokens
        assert r.reused_tokens + r.timings.prefill_tokens == want.reused_tokens + want.timings.prefill_tokens
        assert r.tokens == want.tokens
        rt.flush()
        assert store.load_cache(lag, rt.spec, "alice")[1].turn_id == r.turn_id


def test_a_cache_that_lags_its_journal_answers_as_if_nothing_had_failed(tmp_path, monkeypatch):
    """Cache files that never landed (here: every write after the first turn fails, as on a full disk): after a
    restart each agent loads its first turn's cache and feeds the later turns' replies as they were generated,
    so its next reply is the uninterrupted run's. Fed as their text tokenized again, most replies differed."""
    names, texts = [f"a{i}" for i in range(8)], ["Plan a bake sale.", "Go on.", "Who bakes?", "And then?"]

    def system(name):
        return f"You are {name}, a careful planner who writes short plans."

    with Runtime(model=None, cache_dir=tmp_path / "whole") as rt:
        refs = {n: rt.spawn(n, system=system(n)) for n in names}
        want = {n: [refs[n].ask(t, max_tokens=12) for t in texts] for n in names}
    real = store.write_atomic
    with Runtime(model=None, cache_dir=tmp_path / "lag") as rt:
        refs = {n: rt.spawn(n, system=system(n)) for n in names}
        for n in names:
            refs[n].ask(texts[0], max_tokens=12)
        rt.flush()

        def full_disk(path, data):
            if path.name.startswith("cache."):
                raise OSError(28, "No space left on device")
            return real(path, data)

        monkeypatch.setattr(store, "write_atomic", full_disk)
        for n in names:
            assert [refs[n].ask(t, max_tokens=12).tokens for t in texts[1:-1]] == [r.tokens for r in want[n][1:-1]]
    monkeypatch.setattr(store, "write_atomic", real)
    with Runtime(model=None, cache_dir=tmp_path / "lag") as rt:
        got = {n: rt.spawn(n, system=system(n)).ask(texts[-1], max_tokens=12) for n in names}
    assert all(r.cache == "warm" for r in got.values())
    assert {n: r.tokens for n, r in got.items()} == {n: want[n][-1].tokens for n in names}


def test_a_turn_torn_between_its_two_records_is_dropped_whole_and_its_retry_counts_once(tmp_path):
    """A turn's user and assistant records are one append. Torn inside the assistant's frame (a crash before the
    fsync: the turn was never acknowledged), the reader kept the user record: the history held half a turn, and
    the documented retry with the same turn id added the message a second time and answered otherwise. Cut
    exactly between the two frames (no torn bytes after the user record) it was kept too."""
    system, texts = "You are Alice.", ["Plan a bake sale.", "Who bakes?"]
    with Runtime(model=None, cache_dir=tmp_path / "whole") as rt:
        alice = rt.spawn("alice", system=system)
        alice.ask(texts[0], max_tokens=8)
        want = alice.ask(texts[1], max_tokens=8, turn_id="turn-2")
    with Runtime(model=None, cache_dir=tmp_path / "torn") as rt:
        alice = rt.spawn("alice", system=system)
        alice.ask(texts[0], max_tokens=8)
        alice.ask(texts[1], max_tokens=8, turn_id="turn-2")
        path = folder_of(rt, "alice") / store.JOURNAL_FILE
    data = path.read_bytes()
    start, stop = store.scan_journal(data).frames[-1]  # the assistant record of turn-2
    before = store.scan_journal(data).records[-3]["seq"]  # the last seq of the append before turn-2's
    for cut in ((start + stop) // 2, start):  # inside the assistant's frame, and exactly before it (no torn bytes)
        path.write_bytes(data[:cut])
        store.record_high_seq(path.parent, before)  # a crash inside the append: its mark was never written
        for f in path.parent.glob("cache*"):
            f.unlink()  # its cache never landed either
        scan = store.scan_journal(path.read_bytes(), before)
        assert scan.records[-1]["role"] == "assistant" and scan.torn > (cut - start)  # the user frame with it
        with Runtime(model=None, cache_dir=tmp_path / "torn") as rt:
            alice = rt.spawn("alice", system=system)
            assert [r["role"] for r in alice.history()] == ["system", "user", "assistant"]
            assert alice.result("turn-2") is None
            again = alice.ask(texts[1], max_tokens=8, turn_id="turn-2")
            assert [r["text"] for r in alice.history() if r["role"] == "user"] == texts
            assert again.tokens == want.tokens


def test_a_turn_a_kill_left_past_the_mark_is_covered_by_it_from_the_restart_on(tmp_path, caplog):
    """A SIGKILL between a turn's append and its high-water mark leaves the whole turn in the journal, past the mark.
    The restarted agent takes it as history and answers the turn's retry from it, which acknowledges it; but the mark
    stayed below it until the next append, so a tail cut before then (the loss the mark is there to tell) dropped the
    turn's user record as what was left of an unacknowledged append, and nothing was reported lost. The restart
    raises the mark over the records it keeps."""
    texts = ["Plan a bake sale.", "Who bakes?"]
    with Runtime(model=None, cache_dir=tmp_path) as rt:
        alice = rt.spawn("alice", system="You are Alice.")
        alice.ask(texts[0], max_tokens=6)
        before = alice.history()[-1]["seq"]
        want = alice.ask(texts[1], max_tokens=6, turn_id="turn-2")
        path = folder_of(rt, "alice") / store.JOURNAL_FILE
    store.record_high_seq(path.parent, before)  # killed between the append and its mark
    for f in path.parent.glob("cache*"):
        f.unlink()  # the cache is written after the ack: it never landed either
    with Runtime(model=None, cache_dir=tmp_path) as rt:
        assert rt.spawn("alice").result("turn-2").text == want.text  # the retry is answered from the journal
    data = path.read_bytes()
    path.write_bytes(data[: store.scan_journal(data).frames[-1][0]])  # the tail cut right before the reply's frame
    caplog.set_level(logging.ERROR)
    with Runtime(model=None, cache_dir=tmp_path) as rt:
        alice = rt.spawn("alice")
        assert [r["text"] for r in alice.history() if r["role"] == "user"] == texts
        assert "tail was cut off" in caplog.text and f"up to seq {before + 2}" in caplog.text


def test_an_acknowledged_turn_whose_reply_is_damaged_last_in_the_journal_keeps_its_message_and_the_loss_is_said(
        tmp_path, caplog):
    """Damage in place to the last frame of the journal (its bytes all there, its CRC wrong) reads as a torn tail.
    When it is an acknowledged turn's reply (the high-water mark covers it), the turn's intact user record is no
    remains of a torn append: it stays, and the lost reply is reported, not dropped unsaid with its message."""
    texts = ["Plan a bake sale.", "Who bakes?"]
    with Runtime(model=None, cache_dir=tmp_path) as rt:
        alice = rt.spawn("alice", system="You are Alice.")
        for t in texts:
            alice.ask(t, max_tokens=6)
        path = folder_of(rt, "alice") / store.JOURNAL_FILE
    data = bytearray(path.read_bytes())
    last = store.scan_journal(bytes(data)).records[-1]["seq"]
    data[-3] ^= 0xFF  # inside the reply's text: same length, wrong CRC
    path.write_bytes(bytes(data))
    for f in path.parent.glob("cache*"):
        f.unlink()  # the mark alone tells what was written
    caplog.set_level(logging.WARNING)
    with Runtime(model=None, cache_dir=tmp_path) as rt:
        alice = rt.spawn("alice")
        assert [r["text"] for r in alice.history() if r["role"] == "user"] == texts
        assert "tail was cut off" in caplog.text and f"up to seq {last}" in caplog.text
        assert "damage to acknowledged records" in caplog.text and "an append cut short" not in caplog.text
    assert len(list(path.parent.glob("journal.torn-*"))) == 1  # the damaged frame, kept aside


def test_a_journal_cut_between_records_is_noticed_and_its_seqs_are_never_used_again(tmp_path, caplog):
    with Runtime(model=None, cache_dir=tmp_path) as rt:
        alice = rt.spawn("alice", system="You are Alice.")
        alice.ask("One.", max_tokens=4)
        alice.note("A note after the last cache.", sender="bob")
        alice.note("Another.", sender="bob")
        assert alice.result("sync") is None  # answered once both notes are durable
        journal = folder_of(rt, "alice") / store.JOURNAL_FILE
    data = journal.read_bytes()
    scan = store.scan_journal(data)
    cut = scan.records[-2]["seq"]
    assert store.cache_seq(journal.parent) < cut  # only the journal knew those seqs
    journal.write_bytes(data[: scan.frames[-2][0]])  # exactly between frames: it reads as a shorter, sound journal
    caplog.set_level(logging.ERROR)
    with Runtime(model=None, cache_dir=tmp_path) as rt:
        alice = rt.spawn("alice")
        alice.ask("Two.", max_tokens=4)
        assert "tail was cut off" in caplog.text and f"up to seq {cut + 1}" in caplog.text
        seqs = [r["seq"] for r in on_disk(rt, "alice")]
        assert seqs == sorted(set(seqs)) and seqs[-2] > cut + 1  # no acknowledged seq used twice


def test_a_deleted_journal_warns_and_its_orphan_cache_does_not_block_writes(tmp_path, caplog):
    with Runtime(model=None, cache_dir=tmp_path) as rt:
        alice = rt.spawn("alice", system="You are Alice.")
        for t in ("One.", "Two.", "Three."):
            alice.ask(t, max_tokens=4)
        folder = folder_of(rt, "alice")
        rt.flush()
        old_seq = store.cache_seq(folder)
    (folder / store.JOURNAL_FILE).unlink()
    with Runtime(model=None, cache_dir=tmp_path) as rt:
        alice = rt.spawn("alice", system="You are Alice.")
        r = alice.ask("Again.", max_tokens=4)
        assert "journal is missing" in caplog.text
        seqs = [x["seq"] for x in on_disk(rt, "alice")]
        rt.flush()
        assert seqs[0] > old_seq and store.cache_seq(folder) == seqs[-1]
    with Runtime(model=None, cache_dir=tmp_path) as rt:
        alice = rt.spawn("alice")
        assert turns(alice.history()) == replies([("Again.", r)])
        assert alice.ask("More.", max_tokens=4).cache == "warm"


def test_an_unreadable_journal_stops_only_its_agent(tmp_path):
    with Runtime(model=None, cache_dir=tmp_path) as rt:
        fingerprint = rt.spec.fingerprint
    model = tmp_path / fingerprint
    (model / "alice").mkdir(mode=0o700, parents=True)
    (model / "alice" / store.JOURNAL_FILE).write_bytes(b"kvactors-journal-9\nfrom the future")
    (model / "carol").mkdir(mode=0o700)
    (model / "carol" / store.JOURNAL_FILE).mkdir()  # unreadable as a file (EISDIR; EACCES takes the same path)
    (tmp_path / "outside").mkdir()
    (model / "dave").symlink_to(tmp_path / "outside")  # a planted link out of the store
    with Runtime(model=None, cache_dir=tmp_path, max_restarts=1, restart_period=60, backoff=FAST) as rt:
        bad = {name: rt.spawn(name, system="You are bad.") for name in ("alice", "carol", "dave")}
        bob = rt.spawn("bob", system="You are Bob.")
        persistence, actors = rt._env.persistence(), {n: rt._env.refs[n] for n in bad}
        for _ in range(3):  # well past max_restarts, had these been crashes
            for name, ref in bad.items():
                with pytest.raises(JournalError, match=name):
                    ref.ask("Hello?", max_tokens=4)
                with pytest.raises(JournalError, match=name):  # not an empty conversation
                    ref.history()
            assert bob.ask("Still fine?", max_tokens=4).agent == "bob"
        assert rt._escalation is None and rt._env.persistence() is persistence
        assert {n: rt._env.refs[n] for n in bad} == actors  # nothing restarted
        assert list((tmp_path / "outside").iterdir()) == []
        (model / "alice" / store.JOURNAL_FILE).rename(model / "alice" / "journal.moved-aside")
        assert [r["role"] for r in bad["alice"].history()] == ["system"]  # fixed files: a new conversation
        assert bad["alice"].ask("And now?", max_tokens=4).agent == "alice"  # back at work


def test_send_to_resolves_once_the_senders_copy_is_durable(tmp_path):
    with Runtime(model=None, cache_dir=tmp_path) as rt:
        alice, bob = rt.spawn("alice", system="You are Alice."), rt.spawn("bob", system="You are Bob.")
        own = alice.send("Think at length.", max_tokens=150)  # alice is busy while bob answers
        r = alice.send_to(bob, "Short answer.", max_tokens=2).get(timeout=120)
        notes = [x for x in on_disk(rt, "alice") if x["sender"] == "bob"]
        assert [(x["role"], x["text"]) for x in notes] == [("user", r.text)]  # on disk when the future resolved
        assert own.get(timeout=120).agent == "alice"
        assert [x["role"] for x in on_disk(rt, "alice")] == ["system", "user", "assistant", "user"]


def test_turn_timeouts_leave_no_threads_behind(tmp_path):
    with Runtime(model=None, cache_dir=tmp_path) as rt:
        alice = rt.spawn("alice", system="You are Alice.")
        for i in range(12):
            alice.ask(f"Turn {i}.", max_tokens=1, timeout=60)
        assert not [t for t in threading.enumerate() if isinstance(t, threading.Timer)]
        assert rt._env.deadlines.pending() == 0


@pytest.mark.parametrize("options", [dict(strategy="nope"), dict(max_restarts=-1), dict(kv_bits=3),
                                     dict(durability="eventually"), dict(backoff=0.1)])
def test_a_bad_option_is_refused_before_anything_is_acquired(tmp_path, options):
    threads = set(threading.enumerate())
    with pytest.raises((ValueError, TypeError)):
        Runtime(model=None, cache_dir=tmp_path, **options)
    assert set(threading.enumerate()) <= threads
    with Runtime(model=None, cache_dir=tmp_path) as rt:  # the cache_dir is free
        assert rt.spawn("alice").ask("Hi.", max_tokens=2).agent == "alice"


def test_a_failure_late_in_init_releases_everything(tmp_path, monkeypatch):
    from runtime.api import facade

    def broken(*args, **kwargs):
        raise RuntimeError("the batcher cannot start")

    threads = set(threading.enumerate())
    monkeypatch.setattr(facade.BatcherActor, "start", broken)
    with pytest.raises(RuntimeError, match="cannot start"):
        Runtime(model=None, cache_dir=tmp_path)
    monkeypatch.undo()
    assert {t for t in threading.enumerate() if t.is_alive()} <= threads
    with Runtime(model=None, cache_dir=tmp_path) as rt:
        assert rt.spawn("alice").ask("Hi.", max_tokens=2).agent == "alice"


def test_use_after_shutdown_fails_at_once_with_runtime_closed(tmp_path):
    rt = Runtime(model=None, cache_dir=tmp_path)
    alice, bob = rt.spawn("alice"), rt.spawn("bob")
    rt.shutdown()
    with pytest.raises(RuntimeClosed):
        alice.ask("Anyone?", max_tokens=2)
    with pytest.raises(RuntimeClosed):
        rt.spawn("carol")
    for call in (alice.history, alice.stop, lambda: inject_crash(alice), lambda: alice.send_to(bob, "x")):
        with pytest.raises(RuntimeClosed):
            call()


def _unshare_works() -> bool:
    try:
        return subprocess.run(["unshare", "-rm", "true"], capture_output=True, timeout=30).returncode == 0
    except (OSError, subprocess.SubprocessError):
        return False


@pytest.mark.skipif(not sys.platform.startswith("linux") or not _unshare_works(),
                    reason="needs a private mount namespace (unshare -rm) for a small tmpfs")
def test_a_real_full_disk_loses_no_acknowledged_turn(tmp_path):
    mount = tmp_path / "mnt"
    mount.mkdir()
    proc = subprocess.run(["unshare", "-rm", sys.executable, str(TESTS / "disk_full_child.py"), str(mount)],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out["not_saved"] > 0  # the disk really was full for some appends
    for name, acked in out["acked"].items():
        want = [x for turn_id, text, reply in acked for x in ((turn_id, "user", text), (turn_id, "assistant", reply))]
        assert turns(out["journals"][name]) == want  # every acknowledged turn once, in order, nothing else
        assert turns(out["histories"][name]) == want
        assert len(acked) > 2  # turns were acknowledged during and after the full disk


# -- a caller's mistake is refused at the edge, never a crash ----------------------------------

BAD_OPTIONS = [
    (dict(max_tokens=10**9), ValueError), (dict(max_tokens=0), ValueError), (dict(max_tokens=-1), ValueError),
    (dict(max_tokens="3"), TypeError), (dict(max_tokens=2.0), TypeError), (dict(max_tokens=True), TypeError),
    (dict(temperature=float("nan")), ValueError), (dict(temperature=-1), ValueError),
    (dict(top_p=-0.1), ValueError), (dict(top_p=1.5), ValueError), (dict(seed=-1, temperature=0.7), ValueError),
    (dict(stop=[None]), TypeError), (dict(stop=("",)), ValueError), (dict(stop=3), TypeError),
    (dict(timeout=0), ValueError), (dict(timeout=float("nan")), ValueError), (dict(timeout=-5), ValueError),
    (dict(text=b"bytes"), TypeError), (dict(text=""), ValueError), (dict(sender="../x"), ValueError),
]


@pytest.fixture(scope="module")
def edge_rt(tmp_path_factory):
    with Runtime(model=None, cache_dir=tmp_path_factory.mktemp("edge"), max_restarts=1, restart_period=60,
                 backoff=FAST) as rt:
        yield rt


@pytest.mark.parametrize("options, error", BAD_OPTIONS)
def test_bad_turn_options_are_refused_in_the_callers_thread(edge_rt, monkeypatch, options, error):
    ref = edge_rt.spawn(f"edge-{BAD_OPTIONS.index((options, error))}", system="You are careful.")
    ref.history()  # started
    actor, delivered = edge_rt._env.refs[ref.name], []
    monkeypatch.setattr(edge_rt, "_deliver", lambda *a: delivered.append(a))
    options = {"text": "Hello.", "max_tokens": 2, **options}
    with pytest.raises(error):
        ref.send(options.pop("text"), **options)
    assert delivered == [] and edge_rt._env.refs[ref.name] is actor and edge_rt._escalation is None


def test_stop_as_one_string_is_one_stop_string(edge_rt):
    ref = edge_rt.spawn("edge-stop", system="You are careful.")
    delivered = []
    real = edge_rt._deliver
    edge_rt._deliver = lambda name, message, future: delivered.append(message) or real(name, message, future)
    try:
        ref.ask("Hello.", max_tokens=2, stop="END")
    finally:
        del edge_rt._deliver
    import msgpack

    assert msgpack.unpackb(delivered[0].payload)["stop"] == ["END"]


def test_a_turn_too_large_for_the_memory_budget_fails_alone_without_a_crash(tmp_path):
    with Runtime(model=None, cache_dir=tmp_path, memory_budget=1, max_restarts=1, restart_period=60,
                 backoff=FAST) as rt:
        ref = rt.spawn("big", system="You are careful.")
        history, actor = ref.history(), rt._env.refs["big"]
        for _ in range(3):  # past max_restarts, had these been crashes
            with pytest.raises(TurnTooLarge, match="memory_budget") as e:
                ref.ask("Hello.", max_tokens=2)
            assert e.value.turn_id
        assert rt._env.refs["big"] is actor and rt._escalation is None  # no crash, no restart
        assert ref.history() == history  # nothing recorded

def test_waiting_too_little_on_a_reply_is_a_turn_timeout_not_a_pykka_error(edge_rt):
    ref = edge_rt.spawn("edge-wait", system="You are careful.")
    future = ref.send("Think at length.", max_tokens=40)
    with pytest.raises(TurnTimeout, match="may still finish"):
        future.get(timeout=0)
    assert future.get(timeout=120).agent == "edge-wait"  # the wait ended, not the turn


def test_an_agent_spawned_on_a_full_disk_fails_its_turns_without_crash_looping(tmp_path, monkeypatch):
    real = journal._pwrite

    def disk_full(fd, data, offset):
        raise OSError(errno.ENOSPC, "No space left on device")

    with Runtime(model=None, cache_dir=tmp_path, max_restarts=1, restart_period=60, backoff=FAST) as rt:
        monkeypatch.setattr(journal, "_pwrite", disk_full)
        newbie = rt.spawn("newbie", system="You are new.")
        for _ in range(3):
            with pytest.raises(TurnNotSaved, match="system prompt"):
                newbie.ask("Hello?", max_tokens=2)
        monkeypatch.setattr(journal, "_pwrite", real)
        r = newbie.ask("And now?", max_tokens=2)
        assert rt._escalation is None
        assert [(x["role"], x["text"]) for x in on_disk(rt, "newbie")] == [
            ("system", "You are new."), ("user", "And now?"), ("assistant", r.text)]


# -- turn ids: every error names its turn, and a retry with the same id never runs it twice ------


def test_a_retry_with_a_committed_turn_id_returns_that_reply_without_running_again(tmp_path):
    with Runtime(model=None, cache_dir=tmp_path) as rt:
        alice = rt.spawn("alice", system="You are Alice.")
        first = alice.ask("One.", max_tokens=4, turn_id="order-1")
        again = alice.ask("One.", max_tokens=4, turn_id="order-1")
        assert first.turn_id == again.turn_id == "order-1" and first.cache == "cold"
        assert (again.cache, again.text, again.tokens, again.finish_reason) == ("committed", first.text, first.tokens,
                                                                               first.finish_reason)
        slow = alice.send("Two.", max_tokens=30)
        with pytest.raises(TurnTimeout) as waited:  # the caller stopped waiting; the turn goes on
            slow.get(timeout=0)
        assert waited.value.turn_id == slow.turn_id
        retry = alice.ask("Two.", max_tokens=30, turn_id=waited.value.turn_id)  # queued behind the first
        assert retry.cache == "committed" and retry.text == slow.get(timeout=60).text
    with Runtime(model=None, cache_dir=tmp_path) as rt:  # the key outlives the process
        alice = rt.spawn("alice")
        assert alice.ask("One.", max_tokens=4, turn_id="order-1").cache == "committed"
        assert turns(alice.history()) == replies([("One.", first), ("Two.", retry)])
    with pytest.raises(ValueError):
        AgentRef(rt, "alice").send("x", turn_id="../bad")



def test_a_caller_whose_wait_ended_learns_whether_the_turn_committed(tmp_path, monkeypatch):
    with Runtime(model=None, cache_dir=tmp_path) as rt:
        alice = rt.spawn("alice", system="You are Alice.")
        slow = alice.send("Think at length.", max_tokens=40)
        with pytest.raises(TurnTimeout) as waited:  # the wait ended, the turn goes on
            slow.get(timeout=0)
        found = alice.result(waited.value.turn_id)  # answered once that turn is done
        assert (found.turn_id, found.cache) == (slow.turn_id, "committed")
        assert (found.text, found.tokens) == (slow.get(timeout=60).text, slow.get(timeout=60).tokens)
        inject_crash(alice)  # the next turn runs, then the agent crashes before recording it
        with pytest.raises(AgentCrashed) as crashed:
            alice.ask("Crash after this.", max_tokens=2)
        assert alice.result(crashed.value.turn_id) is None
        monkeypatch.setattr(journal, "_pwrite", lambda fd, data, offset: (_ for _ in ()).throw(
            OSError(errno.ENOSPC, "No space left on device")))
        with pytest.raises(TurnNotSaved) as unsaved:
            alice.ask("Not saved.", max_tokens=2)
        monkeypatch.undo()
        assert alice.result(unsaved.value.turn_id) is None and alice.result("never-sent") is None
        with pytest.raises(TurnTimeout) as watchdog:  # the watchdog answers the caller; the turn commits or is dropped
            alice.ask("Too slow.", max_tokens=40, timeout=0.001)
        committed = watchdog.value.turn_id in {r["turn_id"] for r in alice.history()}
        assert (alice.result(watchdog.value.turn_id) is not None) == committed
        with pytest.raises(ValueError):
            alice.result("../x")
    with Runtime(model=None, cache_dir=tmp_path) as rt:  # the answer outlives the process
        assert rt.spawn("alice").result(slow.turn_id).text == found.text

def test_result_and_retries_find_turns_of_earlier_conversations(tmp_path):
    with Runtime(model=None, cache_dir=tmp_path) as rt:
        alice = rt.spawn("alice", system="You are Alice.")
        first = alice.ask("One.", max_tokens=4, turn_id="before-reset")
        alice.reset([{"role": "user", "text": "Start over.", "sender": None}]).get(timeout=60)
        assert "before-reset" not in {r["turn_id"] for r in alice.history()}
        assert alice.result("before-reset").text == first.text
        again = alice.ask("One.", max_tokens=4, turn_id="before-reset")  # a retry: nothing runs twice
        assert (again.cache, again.text) == ("committed", first.text)
    with Runtime(model=None, cache_dir=tmp_path) as rt:  # reloaded from the journal
        alice = rt.spawn("alice")
        assert alice.result("before-reset").tokens == first.tokens and alice.result("never") is None
    assert [r["turn_id"] for r in on_disk(rt, "alice")].count("before-reset") == 2  # its user and assistant records


def test_impatient_callers_never_crash_their_agent_or_escalate(tmp_path):
    """Many asks with a tiny timeout on one agent: each caller gets TurnTimeout, nothing restarts.

    Every turn that `result` reports committed is in the history exactly once, and no
    turn it reports missing is there.
    """
    with Runtime(model=None, cache_dir=tmp_path, max_restarts=1, restart_period=60, backoff=FAST) as rt:
        alice, bob = rt.spawn("alice", system="You are Alice."), rt.spawn("bob", system="You are Bob.")
        actor, timed_out, lock = rt._env.refs["alice"], [], threading.Lock()

        def impatient(i):
            for j in range(3):
                try:
                    alice.ask(f"Hurry {i}.{j}.", max_tokens=12, timeout=0.001)
                except TurnTimeout as e:
                    with lock:
                        timed_out.append(e.turn_id)

        threads = [threading.Thread(target=impatient, args=(i,)) for i in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(120)
        assert len(timed_out) >= 10, timed_out  # well past max_restarts, had these been crashes
        assert rt._escalation is None and rt._env.refs["alice"] is actor  # no crash, no restart
        assert alice.ask("Still there?", max_tokens=2).agent == "alice" and bob.ask("And you?", max_tokens=2)
        held = [r["turn_id"] for r in alice.history() if r["role"] == "assistant"]
        for turn_id in timed_out:
            assert held.count(turn_id) == (1 if alice.result(turn_id) is not None else 0), turn_id


def test_errors_carry_the_turn_id_of_turns_that_never_started(tmp_path):
    from actors.batcher import Submit
    from runtime.engine import Turn

    with Runtime(model=None, cache_dir=tmp_path) as rt:
        alice = rt.spawn("alice", system="You are Alice.")
        entered, release = threading.Event(), threading.Event()
        gate = rt.tokenizer.encode("gate", add_special_tokens=False)
        rt._env.batcher().tell(Submit(Turn("gate", "gate", None, gate, max_tokens=1),
                                     lambda outcome: entered.set() or release.wait(30)))
        assert entered.wait(30)
        futures = [alice.send(f"Queued {i}.", max_tokens=2) for i in range(3)]
        alice.stop()
        release.set()
        for f in futures:
            with pytest.raises(AgentCrashed) as crash:
                f.get(timeout=30)
            assert crash.value.turn_id == f.turn_id


# -- SIGKILL: a process running agents is killed at random moments, with faults mixed in -------


def test_sigkill_with_full_disks_damaged_journals_and_denied_files_loses_no_acknowledged_turn(tmp_path):
    """KVACTORS_KILLS (default 20) rounds, each ending in a SIGKILL; see tests/chaos.py for the attacks and checks.

    `python tests/chaos.py --kills 200` is the long run, with its table.
    """
    kills = int(os.environ.get("KVACTORS_KILLS", "20"))
    report = chaos.run(tmp_path, kills, seed=0)
    print(report.table())
    assert report.kills == kills and report.lost == 0
    ran = {name: t.rounds for name, t in report.tallies.items()}
    assert all(ran[name] > 0 for name in ("kill", "disk-full", "damage")), ran
    assert ran["permission"] > 0 or any("permission: not run" in n for n in report.notes), ran
    assert report.tallies["damage"].destroyed > 0 and sum(t.acks for t in report.tallies.values()) > kills


def test_an_agent_whose_journal_is_unreadable_at_start_is_reported_and_the_others_go_on(tmp_path, monkeypatch):
    """Permission rounds that always deny the attacked agent's journal itself (the random run meets them only
    sometimes): the child starts anyway, says which agent it cannot read, serves the others, and loses nothing."""
    monkeypatch.setattr(chaos, "DENIALS", (("journal", 0o000),))
    monkeypatch.setattr(chaos, "schedule", lambda kills, rng: ["kill"] + ["permission"] * (kills - 1))
    starts = []
    play = chaos.Child.wait_for

    def watched(self, predicate, timeout):
        done = play(self, predicate, timeout)
        starts.append([line for _, line in self.lines if line.startswith("unreadable ")])
        return done

    monkeypatch.setattr(chaos.Child, "wait_for", watched)
    report = chaos.run(tmp_path, 3, seed=1)
    assert report.kills == 3 and report.lost == 0
    if report.tallies["permission"].rounds:  # else the child here reads any file (see the notes)
        assert any(starts), "no round met an unreadable journal"
    else:
        assert any("permission: not run" in n for n in report.notes)


def test_a_reset_cut_short_on_disk_is_dropped_whole(tmp_path):
    """A reset is one append (its system record, then the new conversation's records), acknowledged once all are
    on disk. Cut short by a crash (inside a frame, or between two), the reader kept what had landed: after the
    restart the agent held part of the new conversation, which was never acknowledged. The reset is dropped
    whole and the conversation before it stands."""
    system = "You are Alice."
    new = [{"role": "user", "text": f"line {i}", "sender": None} for i in range(3)]
    with Runtime(model=None, cache_dir=tmp_path) as rt:
        alice = rt.spawn("alice", system=system)
        alice.ask("Plan a bake sale.", max_tokens=6)
        before = alice.history()
        alice.reset(new, system="You are Alice, renamed.").get()
        path = folder_of(rt, "alice") / store.JOURNAL_FILE
    data = path.read_bytes()
    frames = store.scan_journal(data).frames
    first = len(before)  # the reset's system record, then its three records
    cuts = [frames[first][1], frames[first + 1][1], (frames[-1][0] + frames[-1][1]) // 2, frames[-1][0]]
    for cut in cuts:
        path.write_bytes(data[:cut])
        store.record_high_seq(path.parent, before[-1]["seq"])  # a crash inside the append: its mark was never written
        for f in path.parent.glob("cache*"):
            f.unlink()
        with Runtime(model=None, cache_dir=tmp_path) as rt:
            alice = rt.spawn("alice")
            assert [(r["role"], r["text"]) for r in alice.history()] == [(r["role"], r["text"]) for r in before], cut
    path.write_bytes(data)
    store.record_high_seq(path.parent, store.scan_journal(data).records[-1]["seq"])
    with Runtime(model=None, cache_dir=tmp_path) as rt:  # whole, it stands
        assert [r["text"] for r in rt.spawn("alice").history()] == ["You are Alice, renamed."] + [r["text"] for r in new]
