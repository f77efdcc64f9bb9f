"""actors.persistence: acks once the journal is durable, caches written after the ack (chained,
superseded, flushed on stop), coalescing, seq ordering, errors, and a real crash harness (a child
process SIGKILLed 50 times)."""

import errno
import os
import random
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pykka
import pytest

from actors import persistence
from actors.persistence import Ack, PersistenceActor, submit
from persistence_crash_child import AGENTS, SPEC, expected
from runtime import journal, store

CHILD = Path(__file__).with_name("persistence_crash_child.py")


class Gated(PersistenceActor):
    """A PersistenceActor that can be held busy, so that writes queue up behind it."""

    def hold(self, gate: threading.Event) -> None:
        gate.wait(10)


@pytest.fixture
def actor(tmp_path):
    refs = []

    def start(cls=Gated, **kw):
        refs.append(cls.start(tmp_path, SPEC, **kw))
        return refs[-1]

    yield start
    for ref in refs:
        ref.stop()


def write(ref, agent, seq, **kw):
    host, meta, record = expected(agent, seq)
    return submit(ref, agent, seq, host, meta, [record], **kw)


def assert_cache_is(tmp_path, agent, seq):
    host, meta = store.load_cache(tmp_path, SPEC, agent)
    want_host, want_meta, _ = expected(agent, seq)
    assert meta == want_meta and host.dtype == want_host.dtype
    assert all(host.tensors[k].tobytes() == v.tobytes() for k, v in want_host.tensors.items())


def journal_seqs(tmp_path, agent):
    return [r["seq"] for r in store.read_journal(tmp_path, SPEC, agent)]


def settled(ref):
    """Wait until every cache `ref` acknowledged is written; return ref."""
    ref.proxy().settle().get(timeout=10)
    return ref


class HeldCaches:
    """Holds every cache file write (full or delta) at its start until `release`; counts those started."""

    def __init__(self, monkeypatch):
        self.gate, self.started, self.names = threading.Event(), threading.Semaphore(0), []
        real = store.write_atomic

        def held(path, data):
            if path.name.startswith("cache."):
                self.names.append(path.name)
                self.started.release()
                assert self.gate.wait(10), "a cache write was held too long"
            return real(path, data)

        monkeypatch.setattr(store, "write_atomic", held)

    def wait_started(self):
        assert self.started.acquire(timeout=10), "no cache write started"

    def release(self):
        self.gate.set()


def test_the_ack_comes_once_the_journal_is_durable_before_the_cache_is_written(tmp_path, actor, monkeypatch):
    held = HeldCaches(monkeypatch)
    ref = actor()
    ack = write(ref, "alpha", 0).get(timeout=10)  # the cache write is held: the ack came without it
    assert ack == Ack("alpha", 0, None)  # no cache on disk yet
    assert store.read_journal(tmp_path, SPEC, "alpha") == [expected("alpha", 0)[2]]
    assert store.high_seq(tmp_path / SPEC.fingerprint / "alpha") == 0
    held.wait_started()
    assert isinstance(store.load_agent(tmp_path, SPEC, "alpha").error, store.CacheMissing)
    held.release()
    settled(ref)
    assert_cache_is(tmp_path, "alpha", 0)
    journal_only = submit(ref, "alpha", 1, records=[{"seq": 1, "role": "user", "text": "hi"}]).get(timeout=10)
    assert journal_only == Ack("alpha", 1, 0) and journal_seqs(tmp_path, "alpha") == [0, 1]


def test_the_high_water_mark_is_raised_only_after_the_append_lands(tmp_path, actor, monkeypatch):
    """The mark went to disk beside the append: a SIGKILL while the append was still on its way left a mark past
    the journal, and the next start reported records lost that were never acknowledged."""
    ref = actor()
    write(ref, "alpha", 0).get(timeout=10)
    folder = tmp_path / SPEC.fingerprint / "alpha"
    gate, appending, real = threading.Event(), threading.Event(), store.append_frames

    def held(*args):
        appending.set()
        assert gate.wait(10), "the append was held too long"
        return real(*args)

    monkeypatch.setattr(store, "append_frames", held)
    pending = write(ref, "alpha", 1)
    assert appending.wait(10)
    time.sleep(0.2)  # what would run beside the append has had its time
    assert store.high_seq(folder) == 0  # a crash now: the mark covers only what the journal holds
    gate.set()
    assert pending.get(timeout=10).seq == 1
    assert store.high_seq(folder) == 1 and journal_seqs(tmp_path, "alpha") == [0, 1]


def test_an_ack_never_waits_for_another_agents_cache(tmp_path, actor, monkeypatch):
    held = HeldCaches(monkeypatch)
    ref = actor()
    write(ref, "alpha", 0).get(timeout=10)
    held.wait_started()  # alpha's cache write is in progress, and stays so
    assert write(ref, "beta", 0).get(timeout=10) == Ack("beta", 0, None)
    assert write(ref, "alpha", 1).get(timeout=10) == Ack("alpha", 1, None)  # nor for its own older cache
    assert journal_seqs(tmp_path, "beta") == [0] and journal_seqs(tmp_path, "alpha") == [0, 1]
    held.release()
    settled(ref)
    assert_cache_is(tmp_path, "alpha", 1)
    assert_cache_is(tmp_path, "beta", 0)


def test_a_delta_is_only_chained_to_a_cache_file_on_disk(tmp_path, actor, monkeypatch):
    """Each turn's cache continues the one before it. While one is being written, the next ones
    wait and go to disk as deltas, each once its base is there; past CHAINED_WAITING waiting, the
    newest supersedes them and is written whole, since its base never reached the disk."""
    assert persistence.CHAINED_WAITING == 2
    held = HeldCaches(monkeypatch)
    ref = actor()

    def turn(seq):
        reuse = None if seq == 0 else (seq - 1, chained_cache(seq - 1)[0].n_tokens)
        submit(ref, "alpha", seq, *chained_cache(seq), [record_of(seq)], reuse=reuse).get(timeout=10)

    turn(0)
    held.wait_started()  # seq 0's full file is held
    turn(1), turn(2)  # both wait, each continuing the one before
    held.release()
    settled(ref)
    assert held.names == [store.CACHE_FILE, store.DELTA_FILE.format(1), store.DELTA_FILE.format(2)]
    held.gate.clear()
    turn(3)
    held.wait_started()  # seq 3's delta is held
    for seq in (4, 5, 6):
        turn(seq)
    held.release()
    settled(ref)
    assert held.names[3:] == [store.DELTA_FILE.format(3), store.CACHE_FILE]  # 4 and 5 superseded: 6 written whole
    host, meta = store.load_cache(tmp_path, SPEC, "alpha")
    want_host, want_meta = chained_cache(6)
    assert meta == want_meta and all(host.tensors[k].tobytes() == v.tobytes() for k, v in want_host.tensors.items())
    assert journal_seqs(tmp_path, "alpha") == list(range(7))


def chained_cache(seq):
    """(HostCache, CacheMeta) of turn `seq`: 1000 + 10 * seq tokens, the first ones those of turn seq - 1."""
    rng = np.random.default_rng(7)
    n = 1000 + 10 * seq
    tensors = {}
    for i in range(SPEC.n_layers):
        for kind in ("keys", "values"):
            tensors[f"layers.{i}.{kind}.packed"] = rng.integers(0, 2**32, (1, 2, 1100, 8), dtype=np.uint32)[:, :, :n]
            for part in ("scales", "biases"):
                tensors[f"layers.{i}.{kind}.{part}"] = rng.standard_normal((1, 2, 1100, 1), dtype=np.float32)[:, :, :n]
    meta = store.CacheMeta(seq, list(range(n)), list(range(1, n + 1)), "x" * n, f"turn-{seq}", created=1.0)
    return store.HostCache(tensors, "float32", 4, 64, SPEC.n_layers, n), meta


def record_of(seq):
    return {"seq": seq, "role": "user", "text": f"message {seq}"}


def test_queued_writes_coalesce_and_the_newest_cache_wins(tmp_path, actor, monkeypatch):
    encoded = []
    real = store.next_segment
    monkeypatch.setattr(store, "next_segment", lambda host, meta, *a: encoded.append(meta.seq) or real(host, meta, *a))
    ref = actor()
    gate = threading.Event()
    ref.proxy().hold(gate)
    futures = [write(ref, "alpha", seq) for seq in range(4)] + [write(ref, "beta", 0)]
    time.sleep(0.05)
    for f in futures:  # nothing is acked while queued
        with pytest.raises(pykka.Timeout):
            f.get(timeout=0)
    gate.set()
    acks = [f.get(timeout=10) for f in futures]
    assert [a.seq for a in acks] == [0, 1, 2, 3, 0] and not any(a.error for a in acks)
    settled(ref)
    assert sorted(encoded) == [0, 3]  # alpha's caches 0..2 were never written
    assert journal_seqs(tmp_path, "alpha") == [0, 1, 2, 3]  # every record was
    assert_cache_is(tmp_path, "alpha", 3)


def test_an_older_seq_never_replaces_a_newer_one(tmp_path, actor):
    ref = actor()
    write(ref, "alpha", 5).get(timeout=10)
    settled(ref)
    assert write(ref, "alpha", 4).get(timeout=10) == Ack("alpha", 4, 5)
    ref.stop()
    restarted = actor()  # a new actor learns the seq on disk
    assert write(restarted, "alpha", 3).get(timeout=10) == Ack("alpha", 3, 5)
    assert_cache_is(tmp_path, "alpha", 5)
    assert journal_seqs(tmp_path, "alpha") == [5]  # replays of older seqs are skipped
    write(restarted, "alpha", 6).get(timeout=10)
    assert settled(restarted).proxy().load("alpha").get(timeout=10).meta.seq == 6


def test_stop_flushes_everything_queued(tmp_path, actor):
    ref = actor()
    gate = threading.Event()
    ref.proxy().hold(gate)
    before = [write(ref, agent, 0) for agent in AGENTS]
    stopping = ref.stop(block=False)
    after = write(ref, "alpha", 1)  # told after the stop request, before the actor stopped
    gate.set()
    assert [f.get(timeout=10).seq for f in before + [after]] == [0, 0, 1]
    stopping.get(timeout=10)  # on_stop has run: every acknowledged cache is written
    assert not ref.is_alive()
    assert_cache_is(tmp_path, "alpha", 1)
    assert_cache_is(tmp_path, "beta", 0)
    with pytest.raises(pykka.ActorDeadError):
        write(ref, "alpha", 2)


def test_acks_reach_an_actor_as_messages(actor):
    class Inbox(pykka.ThreadingActor):
        def __init__(self):
            super().__init__()
            self.acks = []

        def on_receive(self, message):
            self.acks.append(message)

        def received(self):
            return self.acks

    inbox = Inbox.start()
    try:
        ref = actor()
        write(ref, "alpha", 0, reply_to=inbox).get(timeout=10)
        settled(ref)
        write(ref, "beta", 0, reply_to=inbox).get(timeout=10)
        assert inbox.proxy().received().get(timeout=10) == [Ack("alpha", 0, None), Ack("beta", 0, None)]
    finally:
        inbox.stop()


def test_errors_go_to_the_acks_and_the_actor_survives(tmp_path, actor):
    (tmp_path / SPEC.fingerprint).mkdir(mode=0o700)
    (tmp_path / SPEC.fingerprint / "alpha").write_bytes(b"a file where a folder should be")
    ref = actor()
    gate = threading.Event()
    ref.proxy().hold(gate)
    bad, good = write(ref, "alpha", 0), write(ref, "beta", 0)
    gate.set()
    with pytest.raises(OSError):
        bad.get(timeout=10)
    assert good.get(timeout=10) == Ack("beta", 0, None)
    folder = tmp_path / SPEC.fingerprint / "gamma"
    folder.mkdir(mode=0o700)
    (folder / store.JOURNAL_FILE).write_bytes(b"not a journal")
    with pytest.raises(store.JournalError):
        write(ref, "gamma", 0).get(timeout=10)
    assert (folder / store.JOURNAL_FILE).read_bytes() == b"not a journal"
    assert ref.is_alive() and write(ref, "beta", 1).get(timeout=10).seq == 1
    assert settled(ref).proxy().load("beta").get(timeout=10).meta.seq == 1


def test_disk_full_in_a_journal_append_fails_only_that_write(tmp_path, actor, monkeypatch):
    ref = actor()
    write(ref, "alpha", 0).get(timeout=10)
    real, calls = journal._pwrite, []

    def disk_full_once(fd, data, offset):  # part of the frame reaches the disk, then ENOSPC
        calls.append(offset)
        if len(calls) > 1:
            return real(fd, data, offset)
        real(fd, bytes(data[:10]), offset)
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(journal, "_pwrite", disk_full_once)
    with pytest.raises(OSError) as full:
        write(ref, "alpha", 1).get(timeout=10)
    assert full.value.errno == errno.ENOSPC
    assert [write(ref, "alpha", 2).get(timeout=10).seq, write(ref, "beta", 0).get(timeout=10).seq] == [2, 0]
    ref.stop()
    assert_cache_is(tmp_path, "alpha", 2)
    assert journal_seqs(tmp_path, "alpha") == [0, 2]  # the acknowledged writes, nothing torn between them
    restarted = actor()
    assert write(restarted, "alpha", 3).get(timeout=10) == Ack("alpha", 3, 2)
    assert journal_seqs(tmp_path, "alpha") == [0, 2, 3]
    assert not list(tmp_path.rglob("journal.torn-*"))


def test_a_failed_cache_write_still_acks_the_journaled_turn(tmp_path, actor, monkeypatch):
    ref = actor()
    write(ref, "alpha", 0).get(timeout=10)
    settled(ref)
    real = store.write_atomic

    def disk_full(path, data):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(store, "write_atomic", disk_full)  # the cache write; the journal appends in place
    assert write(ref, "alpha", 1).get(timeout=10) == Ack("alpha", 1, 0)  # durable in the journal; old cache kept
    settled(ref)
    assert_cache_is(tmp_path, "alpha", 0)
    monkeypatch.setattr(store, "write_atomic", real)
    assert write(ref, "alpha", 2).get(timeout=10) == Ack("alpha", 2, 0)
    settled(ref)
    assert journal_seqs(tmp_path, "alpha") == [0, 1, 2]
    assert_cache_is(tmp_path, "alpha", 2)


ROOT = hasattr(os, "geteuid") and os.geteuid() == 0


@pytest.mark.parametrize("damage", ["bad magic", "a folder", "a symlinked folder", pytest.param(
    "no permission", marks=pytest.mark.skipif(ROOT, reason="root reads any file; 'a folder' takes the same path"))])
def test_an_unreadable_journal_is_that_agents_error_and_the_actor_serves_the_others(tmp_path, actor, damage):
    folder = tmp_path / SPEC.fingerprint / "gamma"
    folder.parent.mkdir(mode=0o700)
    if damage == "a symlinked folder":
        (tmp_path / "elsewhere").mkdir()
        folder.symlink_to(tmp_path / "elsewhere")
    else:
        folder.mkdir(mode=0o700)
        if damage == "bad magic":
            (folder / store.JOURNAL_FILE).write_bytes(b"not a journal")
        elif damage == "no permission":
            (folder / store.JOURNAL_FILE).write_bytes(store.JOURNAL_MAGIC)
            (folder / store.JOURNAL_FILE).chmod(0)
        else:
            (folder / store.JOURNAL_FILE).mkdir()
    before = sorted(p.name for p in tmp_path.rglob("*"))
    ref = actor()
    for _ in range(3):
        loaded = ref.proxy().load("gamma").get(timeout=10)
        assert isinstance(loaded.journal_error, store.JournalError) and loaded.records == []
        with pytest.raises((store.JournalError, OSError)):
            write(ref, "gamma", 0).get(timeout=10)
    assert ref.is_alive() and write(ref, "beta", 0).get(timeout=10).seq == 0
    assert ref.proxy().load("beta").get(timeout=10).meta == expected("beta", 0)[1]
    assert sorted(p.name for p in tmp_path.rglob("*") if "beta" not in str(p) and p.name != "model.json") == before  # left untouched


@pytest.mark.parametrize("name", [store.JOURNAL_FILE, store.HIGH_FILE, store.CACHE_FILE])
def test_a_named_pipe_in_place_of_an_agents_file_stalls_nobody(tmp_path, actor, name):
    """A FIFO in place of one of gamma's files blocked the one persistence actor (opening a pipe waits for a
    writer) and so every agent: files are opened non-blocking and must be regular; gamma's own calls fail or
    fall back, beta is served."""
    ref = actor()
    for agent in ("beta", "gamma"):
        write(ref, agent, 0).get(timeout=10)
    settled(ref).stop()
    path = tmp_path / SPEC.fingerprint / "gamma" / name
    path.unlink()
    os.mkfifo(path)
    ref = actor()
    loaded = ref.proxy().load("gamma").get(timeout=10)
    if name == store.JOURNAL_FILE:
        assert isinstance(loaded.journal_error, store.JournalError) and "not a regular file" in str(loaded.journal_error)
    elif name == store.CACHE_FILE:
        assert loaded.host is None and isinstance(loaded.error, store.UnreadableCache) and len(loaded.records) == 1
    else:
        assert loaded.records and loaded.journal_error is None
        assert write(ref, "gamma", 1).get(timeout=10).seq == 1  # the mark is written anew, a regular file
        assert store.high_seq(path.parent) == 1 and path.is_file()
    assert write(ref, "beta", 1).get(timeout=10).seq == 1
    assert ref.proxy().load("beta").get(timeout=10).records == [expected("beta", s)[2] for s in (0, 1)]


def test_an_agent_folder_copied_with_hard_links_gets_its_own_journal(tmp_path, actor):
    """`cp -al beta gamma` (or a backup that keeps links) shared one journal between two agents: each one's
    appends cut the other's acknowledged records. A journal or mark with other links is copied when opened."""
    ref = actor()
    write(ref, "beta", 0).get(timeout=10)
    settled(ref).stop()
    folder = tmp_path / SPEC.fingerprint
    (folder / "gamma").mkdir(mode=0o700)
    for f in (folder / "beta").iterdir():
        os.link(f, folder / "gamma" / f.name)
    ref = actor()
    for seq in (1, 2):
        for agent in ("beta", "gamma"):
            assert write(ref, agent, seq).get(timeout=10).seq == seq
    settled(ref).stop()
    for agent in ("beta", "gamma"):
        assert journal_seqs(tmp_path, agent) == [0, 1, 2]
        assert [r["text"] for r in store.read_journal(tmp_path, SPEC, agent)][1:] == \
            [expected(agent, s)[2]["text"] for s in (1, 2)]
        assert (folder / agent / store.JOURNAL_FILE).stat().st_nlink == 1


def test_a_folder_named_like_a_temp_file_is_left_alone_and_the_agent_works(tmp_path, actor):
    """A leftover folder with a temp file's name in an agent folder (not kvactors': it writes temp files only)
    made every call of that agent fail ("Is a directory") and prune raise; it is now left as it is."""
    folder = tmp_path / SPEC.fingerprint / "gamma"
    stray = folder / ".cache.safetensors.1.ab.tmp"
    stray.mkdir(parents=True)
    (stray / "inside").write_bytes(b"someone's")
    (folder / ".journal.msgpack.1.cd.tmp").write_bytes(b"crash leftover")
    ref = actor()
    assert ref.proxy().load("gamma").get(timeout=10).records == []
    assert write(ref, "gamma", 0).get(timeout=10).seq == 0
    assert ref.proxy().load("gamma").get(timeout=10).meta == expected("gamma", 0)[1]
    assert store.prune(tmp_path, 10**9) == []
    assert (stray / "inside").read_bytes() == b"someone's" and not (folder / ".journal.msgpack.1.cd.tmp").exists()


def test_a_cache_newer_than_the_journal_raises_the_seq_floor(tmp_path, actor, caplog):
    ref = actor()
    for seq in range(4):
        write(ref, "alpha", seq).get(timeout=10)
    ref.stop()
    journal = tmp_path / SPEC.fingerprint / "alpha" / store.JOURNAL_FILE
    journal.unlink()
    restarted = actor()
    loaded = restarted.proxy().load("alpha").get(timeout=10)
    assert loaded.records == [] and loaded.last_seq == 3  # new records go above the orphan cache's seq
    assert "journal is missing" in caplog.text
    write(restarted, "alpha", 4).get(timeout=10)
    assert settled(restarted).proxy().load("alpha").get(timeout=10).meta.seq == 4  # not blocked by the old cache
    assert journal_seqs(tmp_path, "alpha") == [4]


@pytest.mark.parametrize("damage", ["cut tail", "deleted journal"])
def test_a_journal_loss_is_said_once_and_its_seqs_stay_used(tmp_path, actor, caplog, damage):
    ref = actor()
    for seq in range(4):
        submit(ref, "alpha", seq, records=[record_of(seq)]).get(timeout=10)
    ref.stop()
    path = tmp_path / SPEC.fingerprint / "alpha" / store.JOURNAL_FILE
    if damage == "cut tail":
        scan = store.scan_journal(path.read_bytes())
        path.write_bytes(path.read_bytes()[: scan.frames[2][0]])  # between frames: a shorter, sound journal
    else:
        path.unlink()
    said = "tail was cut off" if damage == "cut tail" else "journal is missing"
    for start in range(3):  # the same loss, found at three starts
        caplog.clear()
        restarted = actor()
        loaded = restarted.proxy().load("alpha").get(timeout=10)
        assert loaded.last_seq == 3  # new records go above the lost ones, every time
        assert (said in caplog.text) == (start == 0), caplog.text
        restarted.stop()
    restarted = actor()
    submit(restarted, "alpha", 4, records=[record_of(4)]).get(timeout=10)
    assert journal_seqs(tmp_path, "alpha") == ([0, 1] if damage == "cut tail" else []) + [4]


def test_bad_requests_fail_at_submit(actor):
    ref = actor()
    host, meta, record = expected("alpha", 3)
    with pytest.raises(store.InvalidAgentId):
        submit(ref, "../alpha", 3, host, meta, [record])
    with pytest.raises(ValueError, match="seq 3"):
        submit(ref, "alpha", 4, host, meta)
    with pytest.raises(ValueError, match="past the write seq"):
        submit(ref, "alpha", 2, records=[record])
    with pytest.raises(ValueError, match="together"):
        submit(ref, "alpha", 3, host)


def test_the_actor_writes_what_the_store_functions_write(tmp_path, actor):
    """One write path: the actor's journal is byte for byte, its cache file value for value (the safetensors
    header's key order varies), what store.append_journal + store.save_cache write."""
    ref = actor()
    for seq in range(3):
        write(ref, "alpha", seq).get(timeout=10)
        settled(ref)  # each cache on disk before the next: the same files as by hand
    by_hand = tmp_path / "by-hand"
    for seq in range(3):
        host, meta, record = expected("alpha", seq)
        store.append_journal(by_hand, SPEC, "alpha", [record])
        store.save_cache(by_hand, SPEC, "alpha", host, meta)
    ours, theirs = (d / SPEC.fingerprint / "alpha" for d in (tmp_path, by_hand))
    assert (ours / store.JOURNAL_FILE).read_bytes() == (theirs / store.JOURNAL_FILE).read_bytes()
    (host, meta), (want_host, want_meta) = (store.decode_cache((d / store.CACHE_FILE).read_bytes()) for d in (ours, theirs))
    assert meta == want_meta and set(host.tensors) == set(want_host.tensors)
    assert all(host.tensors[k].tobytes() == v.tobytes() for k, v in want_host.tensors.items())
    loaded, by_store = ref.proxy().load("alpha").get(timeout=10), store.load_agent(by_hand, SPEC, "alpha")
    assert (loaded.records, loaded.meta, loaded.last_seq) == (by_store.records, by_store.meta, by_store.last_seq)
    assert all(loaded.host.tensors[k].tobytes() == v.tobytes() for k, v in by_store.host.tensors.items())


def test_load_and_delete_through_the_actor(tmp_path, actor):
    ref = actor()
    proxy = ref.proxy()
    write(ref, "alpha", 0)
    loaded = proxy.load("alpha").get(timeout=10)  # sees the queued write: load flushes first
    assert loaded.meta == expected("alpha", 0)[1] and loaded.records == [expected("alpha", 0)[2]]
    path = tmp_path / SPEC.fingerprint / "alpha" / store.CACHE_FILE
    path.write_bytes(path.read_bytes()[:-1])
    loaded = proxy.load("alpha").get(timeout=10)
    assert loaded.host is None and isinstance(loaded.error, store.TruncatedCache) and len(loaded.records) == 1
    assert proxy.delete("alpha").get(timeout=10) and not proxy.delete("alpha").get(timeout=10)
    assert isinstance(proxy.load("alpha").get(timeout=10).error, store.CacheMissing)
    assert write(ref, "alpha", 0).get(timeout=10) == Ack("alpha", 0, None)  # a fresh start after delete


def test_retention_prunes_idle_caches_at_start(tmp_path, actor):
    ref = actor()
    write(ref, "alpha", 0).get(timeout=10)
    ref.stop()
    assert_cache_is(tmp_path, "alpha", 0)  # written at stop, if not before
    time.sleep(0.05)
    actor(retention_s=0.01).proxy().stored("alpha").get(timeout=10)  # on_start has run
    assert journal_seqs(tmp_path, "alpha") == [0]
    assert isinstance(store.load_agent(tmp_path, SPEC, "alpha").error, store.CacheMissing)


def check_after_kill(cache_dir, acked, previous):
    """Each file is some complete version, and every acknowledged seq is in the journal.

    The cache may be older than the newest acknowledged seq (it is written after the ack):
    the journal holds the turns it lacks.

    Returns how many writes the kill interrupted (temp files left behind)."""
    for agent in AGENTS:
        records = store.read_journal(cache_dir, SPEC, agent)  # a torn tail is dropped
        seqs = [r["seq"] for r in records]
        assert seqs == list(range(len(seqs)))
        assert acked[agent] <= set(seqs), f"{agent}: acked {sorted(acked[agent] - set(seqs))} lost"
        assert records[: len(previous[agent])] == previous[agent]  # append-only
        assert all(r == expected(agent, r["seq"])[2] for r in records[len(previous[agent]) :])
        previous[agent] = records
        path = cache_dir / SPEC.fingerprint / agent / store.CACHE_FILE
        if path.exists():
            _, meta = store.decode_cache(path.read_bytes(), SPEC)  # complete and valid
            assert meta.seq <= seqs[-1]
            assert_cache_is(cache_dir, agent, meta.seq)
    return len(list(cache_dir.glob("*/*/.*.tmp")))


def test_crash_harness_sigkill_50_times(tmp_path):
    rng = random.Random(0)
    acked = {agent: set() for agent in AGENTS}
    previous = {agent: [] for agent in AGENTS}
    interrupted = 0
    for _ in range(50):
        child = subprocess.Popen([sys.executable, str(CHILD), str(tmp_path)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        ready = child.stdout.readline()
        if ready != "ready\n":
            child.kill()
            pytest.fail(f"child did not start: {ready!r} {child.communicate()[1]}")
        first = [child.stdout.readline() for _ in range(4)]  # real work in every run, however loaded the machine
        time.sleep(rng.uniform(0.03, 0.15))
        child.send_signal(signal.SIGKILL)
        # through the buffers readline filled (communicate would skip what they hold), once the child is gone
        out, err = child.stdout.read(), child.stderr.read()
        child.wait()
        assert child.returncode == -signal.SIGKILL, err
        for line in first + out.splitlines(keepends=True):
            if not line.endswith("\n"):
                continue  # the kill cut the line short
            assert line.startswith("ack ") and len(line.split()) == 3, f"child printed {line!r}; stderr:\n{err}"
            _, agent, seq = line.split()
            acked[agent].add(int(seq))
        interrupted += check_after_kill(tmp_path, acked, previous)
    assert min(len(a) for a in acked.values()) > 50  # the child did real work between kills
    torn = len(list(tmp_path.rglob("journal.torn-*")))
    print(f"acked {[len(a) for a in acked.values()]}, {interrupted} cache writes interrupted, {torn} torn journal tails")
