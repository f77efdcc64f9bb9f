"""PersistenceActor: makes agents' journals durable, and writes their caches after, off the GPU thread.

Agents hand it a `Write` (agent, seq, cache + metadata, journal records) with
`submit`; it appends the records to the agent's journal, raises the journal's
high-water mark, and acknowledges once both are fsynced: the future returned by
`submit` gets an `Ack`, and `reply_to` (an actor, which must not block on futures)
is told the same `Ack`. An ack means the turn is durable: its records are in the
journal on disk. The cache is written after the ack, by that agent's cache writer
(one per agent, on a small pool of threads of its own): atomically (temp file,
fsync, rename, fsync the folder), and only the new rows, as a delta file, when the
write says which cached tokens it reused and that cache is on disk (see
`store.next_segment`). A crash before the cache lands loses no acknowledged turn:
the agent loads the older cache (or none) and re-prefills only the journal's turns
that it lacks (`runtime.prefix` compares the history with the cached text).
`Ack.cache_seq` is the seq of the cache on disk when the ack was sent, usually
older than the write's; `settle` waits until every acknowledged cache is written.

A cache handed over on the device (`store.on_device`) is copied to the host by its
writer, and only the rows the file needs: the agent's thread copies nothing, and the
copy overlaps the engine's next work.

Writes queue up while the actor is busy and are written in batches, agents in
parallel: the actor's file work runs on an asyncio loop on a thread of its own, and
each file operation is one of `runtime.store`'s functions, run in a worker thread
(`aiofiles.os.wrap`; caches on their own pool, so a long cache write never delays a
journal append). Each agent's writes in a batch are acknowledged as soon as its
journal is durable, whatever the other agents' files are doing. There is no second
write path: `store.append_journal`, `store.save_cache` and `store.load_agent` compose
the same functions. Every journal record is appended, in seq order, but not every
cache is written: a cache waiting for the agent's cache writer is superseded by a
newer one, unless the newer one continues it (then both are written, as small
deltas, up to `CHAINED_WAITING` waiting). A cache whose delta's base never reached
the disk is written whole, and a cache never replaces one with a higher seq on
disk. Journal records whose seq is not above the journal's last are skipped, so a
retried write is harmless. `load` first waits for that agent's cache writer, so the
newest cache loads; `stored`, `stored_all`, `delete` and stopping the actor wait for
them too: stopping flushes everything queued and writes every acknowledged cache.

Errors never stop the actor, which serves every agent. A failed journal append (a
full disk) leaves the journal as it was and fails the acks of that agent's writes in
the batch, and nothing else. A failed cache write is only logged: the journal holds
the turn, so the turn stays acknowledged and the older cache stays on disk. A journal
that cannot be read fails that agent's writes and comes back from `load` as
`Loaded.journal_error`. Damage found when a journal is first opened (a torn tail, a
damaged middle, a missing journal beside a cache, a tail cut below the journal's
high-water mark) is repaired and logged, saying what was lost, once: a loss that
stays on disk until an append passes it is noted as reported
(`store.record_reported_loss`), and the next start does not say it again.
`Loaded.last_seq` then keeps new seqs above every seq on disk. Each append raises
the high-water mark (`store.record_high_seq`) after it lands, before the ack: no
acknowledged seq is ever used again, and a crash between the two never leaves a mark
past the journal. Records such a crash left past the mark are covered by it when the
journal is next opened: from then on they are history (a retry of their turn is
answered from them), and a later loss of them is reported.
"""

from __future__ import annotations

import asyncio
import logging
import os
import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, replace
from typing import Any

import aiofiles.os
import pykka

from actors import pykka_compat
from actors.supervisor import SupervisedActor
from runtime import store
from runtime.store import CACHE_FILE, JOURNAL_FILE

log = logging.getLogger(__name__)
_io = aiofiles.os.wrap  # _io(f)(*args): f(*args) in a worker thread, awaited on the actor's loop
CHAINED_WAITING = 2  # caches of one agent that may wait to be written as deltas; more are superseded


@dataclass(frozen=True)
class Write:
    """A request to persist `agent`'s state at turn `seq`.

    `cache`/`meta`: the cache after that turn, a `store.HostCache` or `store.DeviceCache`
    (both or neither; `meta.seq == seq`).
    `records`: journal records with seq <= `seq` (e.g. the user and assistant turns).
    `reuse`: (seq, kept) when the cache's first `kept` tokens are those of the cache of
    turn `seq`, bit for bit; then only the rows after them may be written (a delta).
    """

    agent: str
    seq: int
    cache: store.HostCache | store.DeviceCache | None = None
    meta: store.CacheMeta | None = None
    records: tuple = ()
    reply_to: Any = None
    future: Any = None
    reuse: tuple | None = None


@dataclass(frozen=True)
class Ack:
    """`agent`'s write `seq` is durable: its journal records are on disk.

    `cache_seq` is the seq of the agent's cache on disk when the ack was sent (None:
    no cache). The write's own cache follows in the background, so it is usually
    older than `seq`; the journal holds the turns between. On failure `error` holds
    the exception and nothing about this write is promised.
    """

    agent: str
    seq: int
    cache_seq: int | None
    error: BaseException | None = None


def submit(ref, agent: str, seq: int, cache=None, meta=None, records=(), reply_to=None, reuse=None) -> pykka.Future:
    """Queue a write on the PersistenceActor `ref`; return a future that gets its `Ack`.

    The future raises the write's error instead, if it failed. Raises InvalidAgentId or
    ValueError at once for a bad request, pykka.ActorDeadError if the actor is stopped.
    """
    store.check_agent_id(agent)
    records = tuple(records)
    if (cache is None) != (meta is None):
        raise ValueError("give the cache and its metadata together")
    if meta is not None:
        if meta.seq != seq:
            raise ValueError(f"cache metadata has seq {meta.seq}, the write seq {seq}")
        store.check_cache(cache, meta)
    for r in records:
        store.check_record(r)
        if r["seq"] > seq:
            raise ValueError(f"journal record seq {r['seq']} is past the write seq {seq}")
    future = pykka.ThreadingFuture()
    ref.tell(Write(agent, seq, cache, meta, records, reply_to, future, reuse))
    return future


class PersistenceActor(SupervisedActor):
    """Writes caches and journals under `cache_dir` for the model described by `spec`.

    `retention_s`: at start, delete caches (not journals) idle longer than this
    (None: keep all; see `store.prune`). A batch is written as soon as the mailbox is
    empty, or when `max_pending` writes or `max_pending_bytes` of caches are queued.
    `cache_writers`: threads writing caches (each agent's one at a time, agents in parallel).
    """

    def __init__(
        self, cache_dir, spec, retention_s: float | None = None, max_pending: int = 64, max_pending_bytes: int = 1 << 30,
        supervisor=None, cache_writers: int = 2,
    ):
        super().__init__(supervisor)
        self.cache_dir, self.spec, self.retention_s = cache_dir, spec, retention_s
        self.max_pending, self.max_pending_bytes = max_pending, max_pending_bytes
        self.cache_writers = cache_writers
        self._pending: dict[str, list[Write]] = {}
        self._pending_count = self._pending_bytes = 0
        # The state below belongs to the I/O loop's thread: only coroutines touch it.
        self._journal_seq: dict[str, int] = {}  # agent -> last seq in its journal
        self._journal_end: dict[str, int] = {}  # agent -> end of its journal's last good frame
        self._cache_seq: dict[str, int | None] = {}  # agent -> seq of its cache on disk
        self._high: dict[str, int] = {}  # agent -> its journal's high-water mark as on disk (-1: none)
        self._segment: dict[str, store.Segment] = {}  # agent -> newest cache file this actor wrote
        self._cache_next: dict[str, list[Write]] = {}  # agent -> acknowledged writes whose caches wait, oldest first
        self._cache_jobs: dict[str, asyncio.Task] = {}  # agent -> its cache writer, while it has work
        self._loop = self._thread = self._cache_pool = None
        self._model_recorded = False

    def on_start(self) -> None:
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="kvactors-persistence-io", daemon=True)
        self._thread.start()
        self._cache_pool = ThreadPoolExecutor(self.cache_writers, thread_name_prefix="kvactors-cache-writer")
        if self.retention_s is not None:
            try:
                self._run(_io(store.prune)(self.cache_dir, self.retention_s))
            except OSError as e:  # retention is housekeeping: never a reason not to persist
                log.warning("retention pruning under %s failed: %s", self.cache_dir, e)

    def on_receive(self, message) -> None:
        if not isinstance(message, Write):
            return
        self._queue(message)
        full = self._pending_count >= self.max_pending or self._pending_bytes >= self.max_pending_bytes
        if full or pykka_compat.inbox_empty(self):
            self._flush()

    def on_stop(self) -> None:
        # Writes told after the stop request are still in the inbox: keep them too.
        for write in self.take_leftover(Write):
            self._queue(write)
        self._close()

    def on_failure(self, exception_type, exception_value, traceback) -> None:
        self._close()  # what was acknowledged still gets its cache written, then the I/O thread ends

    def load(self, agent: str) -> store.Loaded:
        """`agent`'s journal and usable cache (see `store.Loaded`), after flushing queued writes.

        Its acknowledged caches are written first, so the newest one loads. Never
        raises for a bad file (this actor serves every agent): a journal that
        cannot be read comes back as `Loaded.journal_error`, a bad cache as `Loaded.error`.
        """
        self._flush()
        try:
            return self._run(self._load(agent))
        except store.JournalError as e:
            return store.Loaded([], journal_error=e)
        except Exception as e:  # noqa: BLE001 - a symlink in the store, no permission, or files no rule foresaw
            error = store.JournalError(f"cannot read the files of agent {agent!r}: {type(e).__name__}: {e}; fix "
                                       "them or move them aside")
            error.__cause__ = e
            return store.Loaded([], journal_error=error)

    def records(self, agent: str) -> list | None:
        """Every record of `agent`'s journal that checks, oldest first, after flushing queued writes.

        [] when it has none; None when the journal cannot be read (never raises: this
        actor serves every agent).
        """
        self._flush()
        try:
            return self._run(_io(store.read_journal)(self.cache_dir, self.spec, agent))
        except Exception as e:  # noqa: BLE001 - as in `load`: this actor serves every agent
            log.error("agent %s: reading its journal back failed: %s", agent, e)
            return None

    def stored(self, agent: str) -> store.StoredAgent | None:
        """`agent`'s `store.StoredAgent` after flushing queued writes and caches; None when it has no folder.

        Never raises for a bad journal (`turns` is then None); a symlinked folder is
        reported as unreadable too.
        """
        self._flush()
        self._run(self._settle(agent))
        folder = store.agent_dir(self.cache_dir, self.spec.fingerprint, agent)
        if not os.path.lexists(folder):
            return None
        return _summary(folder)

    def stored_all(self) -> list[store.StoredAgent]:
        """Every agent stored for this model (`store.StoredAgent`), sorted by name, after flushing queued writes and caches."""
        self._flush()
        self._run(self._settle())
        return [_summary(f) for f in store.agent_folders(self.cache_dir) if f.parent.name == self.spec.fingerprint]

    def delete(self, agent: str) -> bool:
        """Delete `agent`'s cache and journal (after its queued writes); return whether it existed."""
        self._flush()
        return self._run(self._delete(agent))

    def settle(self) -> None:
        """Return once every queued write is acknowledged and every acknowledged cache is on disk (or failed)."""
        self._flush()
        self._run(self._settle())

    # -- internals

    def _run(self, coro):
        """Run `coro` on the I/O loop's thread; wait for its result here."""
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result()

    def _close(self) -> None:
        """Flush queued writes, write every acknowledged cache, end the I/O thread (idempotent)."""
        if self._loop is None or self._loop.is_closed():
            return
        self._flush()
        self._run(self._settle())
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join()
        self._loop.close()
        self._cache_pool.shutdown()

    def _queue(self, write: Write) -> None:
        self._pending.setdefault(write.agent, []).append(write)
        self._pending_count += 1
        self._pending_bytes += write.cache.nbytes if write.cache is not None else 0

    def _flush(self) -> None:
        """Write the queued journal records; each agent's writes are acknowledged as soon as its journal is durable."""
        if not self._pending:
            return
        pending, self._pending = self._pending, {}
        self._pending_count = self._pending_bytes = 0
        self._run(self._write_all(pending))

    async def _write_all(self, pending: dict) -> None:
        await asyncio.gather(*(self._write_agent(agent, writes) for agent, writes in pending.items()))

    async def _write_agent(self, agent: str, writes: list[Write]) -> None:
        """Append `writes`' records, queue their caches, ack them; errors go to the acks."""
        folder = store.agent_dir(self.cache_dir, self.spec.fingerprint, agent)
        try:
            await self._append(agent, folder, writes)
        except Exception as e:
            for w in writes:
                _ack(w, e)
            return
        for w in sorted((w for w in writes if w.cache is not None), key=lambda w: w.seq):
            self._queue_cache(agent, folder, w)
        for w in writes:
            _ack(w, self._cache_seq[agent])

    async def _append(self, agent: str, folder, writes: list[Write]) -> None:
        """Append the fresh records of `writes` to `agent`'s journal and raise its high-water mark, both fsynced."""
        if agent not in self._journal_seq:
            await self._settle(agent)  # its cache writer must not race the reopening
            await self._open(agent, folder)
        fresh = store.fresh_records([r for w in writes for r in w.records], self._journal_seq[agent])
        if not fresh:
            return
        try:
            end = await _io(store.append_frames)(folder / JOURNAL_FILE, store.encode_records(fresh),
                                                 self._journal_end[agent])
        except BaseException:
            self._forget(agent)  # the next write reopens the journal (and repairs it if the cut-back failed)
            raise
        # the high-water mark goes to disk after the append and before the ack: a crash between them leaves records
        # the mark does not cover (none acknowledged), never a mark past the journal, which would report a loss
        await self._record_high(agent, folder, fresh[-1]["seq"])
        self._journal_seq[agent], self._journal_end[agent], self._high[agent] = fresh[-1]["seq"], end, fresh[-1]["seq"]

    def _queue_cache(self, agent: str, folder, write: Write) -> None:
        """Hand `write`'s cache to `agent`'s cache writer.

        It waits behind the agent's waiting caches when it continues the newest of them
        (each then goes to disk as a small delta), up to CHAINED_WAITING of them;
        otherwise it supersedes them all (and is written whole). An older seq than one
        waiting is dropped.
        """
        waiting = self._cache_next.get(agent, [])
        if waiting and write.seq <= waiting[-1].seq:
            return
        chains = bool(waiting) and write.reuse is not None and write.reuse[0] == waiting[-1].seq
        self._cache_next[agent] = waiting + [write] if chains and len(waiting) < CHAINED_WAITING else [write]
        if agent not in self._cache_jobs:
            self._cache_jobs[agent] = self._loop.create_task(self._cache_writer(agent, folder))

    async def _cache_writer(self, agent: str, folder) -> None:
        """Write `agent`'s waiting caches one at a time, oldest first, until none waits.

        One writer per agent, so each file is written knowing the one before it is
        durable: a delta is only ever chained to a file on disk (`store.next_segment`).
        """
        try:
            while self._cache_next.get(agent):
                write = self._cache_next[agent].pop(0)
                on_disk = self._cache_seq.get(agent)
                if on_disk is None or write.seq > on_disk:
                    await self._write_cache(agent, folder, write)
        except Exception:  # _write_cache logs what it expects; anything else must not stop the others
            log.exception("agent %s: the cache writer failed; its cache on disk stays as it was", agent)
            self._cache_next.pop(agent, None)
        finally:
            del self._cache_jobs[agent]

    async def _settle(self, agent: str | None = None) -> None:
        """Wait until `agent`'s (None: every agent's) queued caches are written or failed."""
        jobs = list(self._cache_jobs.values()) if agent is None else [self._cache_jobs[agent]] if agent in self._cache_jobs else []
        if jobs:
            await asyncio.wait(jobs)

    async def _write_cache(self, agent: str, folder, write: Write) -> None:
        """Write `write`'s cache; a failure (a full disk) is logged, not raised: the journal already holds the turn."""
        last = self._segment.pop(agent, None)  # unknown until this write is durable
        try:
            name, segment = await self._loop.run_in_executor(
                self._cache_pool, _write_segment, folder, write, store.model_tag(self.spec), last)
        except Exception as e:  # a full disk, or copying the cache off the device failed
            log.warning("agent %s: writing the cache of seq %d failed (%s); the turn is durable in the journal "
                        "and the cache on disk stays at seq %s", agent, write.seq, e, self._cache_seq.get(agent))
            return
        self._cache_seq[agent] = write.seq
        self._segment[agent] = segment
        if name == CACHE_FILE:
            try:
                await _io(store.remove_deltas)(folder)
            except OSError as e:  # stale deltas link to nothing: loading ignores them
                log.warning("agent %s: removing stale delta files failed: %s", agent, e)

    async def _record_high(self, agent: str, folder, seq: int) -> None:
        """Set the journal's high-water mark to `seq`; a failure is logged, not raised.

        It runs after the append, which holds the records whatever happens here: a
        failed mark must not make an appended turn look refused. Until a later write
        succeeds, a cut of the journal's tail could then go unnoticed (see README).
        """
        try:
            await _io(store.record_high_seq)(folder, seq)
        except OSError as e:
            log.error("agent %s: recording the journal's high-water mark (seq %d) failed: %s", agent, seq, e)

    async def _open(self, agent: str, folder) -> store.JournalScan | None:
        """First use of `agent` in this actor: folders, leftovers, journal repair, seqs on disk; says what was lost.

        The high-water mark is made, or raised to cover every seq on disk (records a kill left past it included).
        The first also records which model the fingerprint folder belongs to (`store.record_model`).
        """
        scan, end = await _io(store.open_journal)(folder)
        if not self._model_recorded:
            await self._record_model(folder.parent)
        cache_seq, high = await _io(store.cache_seq)(folder), await _io(store.high_seq)(folder)
        last = -1 if scan is None else scan.last_seq
        if scan is not None and scan.rewritten:
            log.error("agent %s: its journal was damaged %s: %s. %d records that check were kept; "
                      "the damaged file is kept as journal.damaged-* in %s", agent,
                      "in the middle" if scan.damaged else "in its header", "; ".join(scan.losses()),
                      len(scan.records), folder)
        mark = max(-1 if cache_seq is None else cache_seq, -1 if high is None else high)  # seqs used, by other files
        if scan is not None and scan.torn:  # acknowledged records in it (the mark past the last kept) are no torn append
            log.warning("agent %s: %s%s", agent, store.unread_tail(scan, mark > last),
                        " (the loss is reported below)" if mark > last else "")
        lost = mark > last and await _io(store.reported_loss)(folder) != (last, mark)  # said once per loss
        if lost:
            log.error("agent %s: %s", agent, store.lost_records(scan is None, cache_seq, last, mark))
        self._journal_seq[agent], self._journal_end[agent], self._cache_seq[agent] = last, end, cache_seq
        self._high[agent] = max(last, mark)
        if high is None or high < self._high[agent]:
            # made now, while nothing waits on it: each append then rewrites it in place, needing no space. Raised
            # over records a kill between an append and its mark left past it: they are the agent's history from now
            # on (a retry of their turn is answered from them), so a later cut of them is a loss to report, not a
            # torn append to drop unsaid (`store.scan_journal`)
            await self._record_high(agent, folder, self._high[agent])
        if lost:
            try:
                await _io(store.record_reported_loss)(folder, last, mark)
            except OSError as e:  # the next start says it again
                log.warning("agent %s: noting that its journal's loss was reported failed: %s", agent, e)
        return scan

    async def _record_model(self, model_dir) -> None:
        """Write `model.json` once per actor; a failure is only logged (it names the folder for people)."""
        try:
            await _io(store.record_model)(model_dir, self.spec.model_id)
            self._model_recorded = True
        except OSError as e:
            log.warning("recording the model id in %s failed: %s", model_dir, e)

    async def _delete(self, agent: str) -> bool:
        self._cache_next.pop(agent, None)  # a deleted agent's cache is not written back
        await self._settle(agent)
        self._forget(agent)
        return await _io(store.delete)(self.cache_dir, self.spec, agent)

    def _forget(self, agent: str) -> None:
        for state in (self._journal_seq, self._journal_end, self._cache_seq, self._segment, self._high):
            state.pop(agent, None)

    async def _load(self, agent: str) -> store.Loaded:
        folder = store.agent_dir(self.cache_dir, self.spec.fingerprint, agent)
        await self._settle(agent)  # the newest acknowledged cache is the one to load
        opened = agent not in self._journal_seq and await _io(os.path.lexists)(folder)
        if opened:
            await self._open(agent, folder)  # repairs damage and says what was lost, once
        loaded = await _io(store.load_agent)(self.cache_dir, self.spec, agent)
        on_disk = self._cache_seq.get(agent)
        if opened and loaded.segment is not None and on_disk is not None and loaded.segment.seq < on_disk:
            log.warning("agent %s: its cache files reach seq %d, but %s is damaged or does not fit: its cache loads "
                        "at seq %d and the turns after it are re-prefilled from the journal", agent, on_disk,
                        store.DELTA_FILE.format(loaded.segment.deltas + 1), loaded.segment.seq)
        if agent not in self._segment and loaded.segment is not None and loaded.segment.seq == on_disk:
            self._segment[agent] = loaded.segment  # the agent's next write continues the chain with a delta
        return replace(loaded, last_seq=max(loaded.last_seq, self._journal_seq.get(agent, -1)))


def _write_segment(folder, write: Write, fingerprint: str, last) -> tuple[str, store.Segment]:
    """Encode `write`'s cache as the file that follows `last` (`store.next_segment`) and write it atomically.

    Runs on a cache-writer thread: copying a `DeviceCache`'s rows to the host and
    encoding happen there too. Returns (file name, the Segment it became).
    """
    name, data, segment = store.next_segment(write.cache, write.meta, fingerprint, last, write.reuse)
    store.write_atomic(folder / name, data)
    return name, segment


def _summary(folder) -> store.StoredAgent:
    try:
        return store.stored_agent(folder)
    except OSError:  # a symlinked folder (UnsafePath): nothing in it is read
        return store.StoredAgent(folder.name, None, None, 0, False)


def _ack(write: Write, result) -> None:
    if isinstance(result, BaseException):
        ack = Ack(write.agent, write.seq, None, result)
        if write.future is not None:
            write.future.set_exception((type(result), result, result.__traceback__))
    else:
        ack = Ack(write.agent, write.seq, result)
        if write.future is not None:
            write.future.set(ack)
    if write.reply_to is not None:
        try:
            write.reply_to.tell(ack)
        except pykka.ActorDeadError:
            log.warning("ack of %s seq %d undeliverable: %s is dead", write.agent, write.seq, write.reply_to)
