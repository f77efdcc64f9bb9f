"""PersistenceActor: makes agents' caches and journals durable, off the GPU thread.

Agents hand it a `Write` (agent, seq, cache as host tensors + metadata, journal
records) with `submit`; it appends the records to the agent's journal, writes the
cache atomically (only the new rows, as a delta file, when the write says which
cached tokens it reused: see `store.next_segment`), and then acknowledges: the
future returned by `submit` gets an `Ack`, and `reply_to` (an actor, which must not
block on futures) is told the same `Ack`. An ack means durable: files and folder
entries fsynced.

Writes queue up while the actor is busy and are written in batches, agents in
parallel (file I/O through aiofiles on an asyncio loop the actor runs on its own
thread). Within a batch every journal record is appended, in seq order, but only the
newest cache of each agent is written: a newer write queued behind an older one
supersedes it, and a cache never replaces one with a higher seq on disk (its ack then
reports the newer `cache_seq`). Journal records whose seq is not above the journal's
last are skipped, so a retried write is harmless. Stopping the actor flushes
everything queued. Errors never stop the actor: they go to the writes' acks.
"""

from __future__ import annotations

import asyncio
import logging
import os
from dataclasses import dataclass
from typing import Any

import aiofiles
import aiofiles.os
import pykka

from actors.supervisor import SupervisedActor
from runtime import store
from runtime.store import CACHE_FILE, JOURNAL_FILE, JOURNAL_MAGIC

log = logging.getLogger(__name__)
_fsync = aiofiles.os.wrap(os.fsync)
_fsync_dir = aiofiles.os.wrap(store.fsync_dir)


@dataclass(frozen=True)
class Write:
    """A request to persist `agent`'s state at turn `seq`.

    `host`/`meta`: the cache after that turn (both or neither; `meta.seq == seq`).
    `records`: journal records with seq <= `seq` (e.g. the user and assistant turns).
    `reuse`: (seq, kept) when the cache's first `kept` tokens are those of the cache of
    turn `seq`, bit for bit; then only the rows after them may be written (a delta).
    """

    agent: str
    seq: int
    host: store.HostCache | None = None
    meta: store.CacheMeta | None = None
    records: tuple = ()
    reply_to: Any = None
    future: Any = None
    reuse: tuple | None = None


@dataclass(frozen=True)
class Ack:
    """`agent`'s write `seq` is durable; `cache_seq` is the cache seq on disk now (None: no cache).

    On failure `error` holds the exception and nothing about this write is promised.
    """

    agent: str
    seq: int
    cache_seq: int | None
    error: BaseException | None = None


def submit(ref, agent: str, seq: int, host=None, meta=None, records=(), reply_to=None, reuse=None) -> pykka.Future:
    """Queue a write on the PersistenceActor `ref`; return a future that gets its `Ack`.

    The future raises the write's error instead, if it failed. Raises InvalidAgentId or
    ValueError at once for a bad request, pykka.ActorDeadError if the actor is stopped.
    """
    store.check_agent_id(agent)
    records = tuple(records)
    if (host is None) != (meta is None):
        raise ValueError("give the cache's host tensors and metadata together")
    if meta is not None:
        if meta.seq != seq:
            raise ValueError(f"cache metadata has seq {meta.seq}, the write seq {seq}")
        store.check_cache(host, meta)
    for r in records:
        store.check_record(r)
        if r["seq"] > seq:
            raise ValueError(f"journal record seq {r['seq']} is past the write seq {seq}")
    future = pykka.ThreadingFuture()
    ref.tell(Write(agent, seq, host, meta, records, reply_to, future, reuse))
    return future


class PersistenceActor(SupervisedActor):
    """Writes caches and journals under `cache_dir` for the model described by `spec`.

    `retention_s`: at start, delete caches (not journals) idle longer than this
    (None: keep all; see `store.prune`). A batch is written as soon as the mailbox is
    empty, or when `max_pending` writes or `max_pending_bytes` of caches are queued.
    """

    def __init__(
        self, cache_dir, spec, retention_s: float | None = None, max_pending: int = 64, max_pending_bytes: int = 1 << 30,
        supervisor=None,
    ):
        super().__init__(supervisor)
        self.cache_dir, self.spec, self.retention_s = cache_dir, spec, retention_s
        self.max_pending, self.max_pending_bytes = max_pending, max_pending_bytes
        self._pending: dict[str, list[Write]] = {}
        self._pending_count = self._pending_bytes = 0
        self._journal_seq: dict[str, int] = {}  # agent -> last seq in its journal
        self._cache_seq: dict[str, int | None] = {}  # agent -> seq of its cache on disk
        self._segment: dict[str, store.Segment] = {}  # agent -> newest cache file this actor wrote
        self._loop = None

    def on_start(self) -> None:
        self._loop = asyncio.new_event_loop()
        if self.retention_s is not None:
            try:
                self._run(aiofiles.os.wrap(store.prune)(self.cache_dir, self.retention_s))
            except OSError as e:  # retention is housekeeping: never a reason not to persist
                log.warning("retention pruning under %s failed: %s", self.cache_dir, e)

    def on_receive(self, message) -> None:
        if not isinstance(message, Write):
            return
        self._queue(message)
        full = self._pending_count >= self.max_pending or self._pending_bytes >= self.max_pending_bytes
        if full or self.actor_inbox.empty():
            self._flush()

    def on_stop(self) -> None:
        # Writes told after the stop request are still in the inbox: keep them too.
        for write in self.take_leftover(Write):
            self._queue(write)
        self._flush()
        if self._loop is not None:
            self._loop.close()

    def flush(self) -> None:
        """Write everything queued now; returns once it is durable (or failed, see the acks)."""
        self._flush()

    def load(self, agent: str) -> store.Loaded:
        """`agent`'s journal and usable cache (see `store.Loaded`), after flushing queued writes."""
        self._flush()
        return self._run(self._load(agent))

    def delete(self, agent: str) -> bool:
        """Delete `agent`'s cache and journal (after its queued writes); return whether it existed."""
        self._flush()
        self._journal_seq.pop(agent, None)
        self._cache_seq.pop(agent, None)
        self._segment.pop(agent, None)
        return self._run(aiofiles.os.wrap(store.delete)(self.cache_dir, self.spec, agent))

    # -- internals

    def _run(self, coro):
        return self._loop.run_until_complete(coro)

    def _queue(self, write: Write) -> None:
        self._pending.setdefault(write.agent, []).append(write)
        self._pending_count += 1
        self._pending_bytes += write.host.nbytes if write.host is not None else 0

    def _flush(self) -> None:
        if not self._pending:
            return
        pending, self._pending = self._pending, {}
        self._pending_count = self._pending_bytes = 0
        results = self._run(self._write_all(pending))
        for writes, result in zip(pending.values(), results):
            for w in writes:
                _ack(w, result)

    async def _write_all(self, pending: dict) -> list:
        jobs = [self._write_agent(agent, writes) for agent, writes in pending.items()]
        return await asyncio.gather(*jobs, return_exceptions=True)

    async def _write_agent(self, agent: str, writes: list[Write]) -> int | None:
        folder = store.agent_dir(self.cache_dir, self.spec.fingerprint, agent)
        if agent not in self._journal_seq:
            await self._open(agent, folder)
        records = sorted((r for w in writes for r in w.records), key=lambda r: r["seq"])
        fresh, last = [], self._journal_seq[agent]
        for r in records:
            if r["seq"] > last:
                fresh.append(r)
                last = r["seq"]
        if fresh:
            await _append(folder / JOURNAL_FILE, store.encode_records(fresh))
            self._journal_seq[agent] = last
        newest = max((w for w in writes if w.host is not None), key=lambda w: w.seq, default=None)
        on_disk = self._cache_seq[agent]
        if newest is not None and (on_disk is None or newest.seq > on_disk):
            last = self._segment.pop(agent, None)  # unknown until this write is durable
            name, data, segment = store.next_segment(newest.host, newest.meta, self.spec.fingerprint, last, newest.reuse)
            await _write_atomic(folder / name, data)
            if name == CACHE_FILE:
                await aiofiles.os.wrap(store.remove_deltas)(folder)
            self._cache_seq[agent] = newest.seq
            self._segment[agent] = segment
        return self._cache_seq[agent]

    async def _open(self, agent: str, folder) -> None:
        """First write to `agent` in this actor: folders, leftovers, journal state, cache seq."""
        await aiofiles.os.wrap(store.make_dirs)(folder)
        await aiofiles.os.wrap(store.remove_temps)(folder)
        path = folder / JOURNAL_FILE
        if not await aiofiles.os.path.exists(path):
            await _write_atomic(path, JOURNAL_MAGIC)
        async with aiofiles.open(path, "rb") as f:
            data = await f.read()
        records, valid = store.parse_journal(data)
        if valid < len(data):
            await aiofiles.os.wrap(store.repair_journal)(path, valid, len(data))
        self._journal_seq[agent] = records[-1]["seq"] if records else -1
        self._cache_seq[agent] = await aiofiles.os.wrap(store.cache_seq)(folder)

    async def _load(self, agent: str) -> store.Loaded:
        folder = store.agent_dir(self.cache_dir, self.spec.fingerprint, agent)
        records = []
        if await aiofiles.os.path.exists(folder / JOURNAL_FILE):
            async with aiofiles.open(folder / JOURNAL_FILE, "rb") as f:
                records = store.parse_journal(await f.read())[0]
        try:
            host, meta = await aiofiles.os.wrap(store.load_chain)(folder, self.spec)
        except store.CacheError as e:
            return store.Loaded(records, error=e)
        return store.Loaded(records, host, meta)


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


async def _write_atomic(path, data) -> None:
    """Replace `path` by `data`: temp file in the same folder, fsync, rename, fsync the folder."""
    tmp = store.temp_path(path)
    try:
        async with aiofiles.open(tmp, "xb", opener=store.open_private) as f:
            await f.write(data)
            await f.flush()
            await _fsync(f.fileno())
        await aiofiles.os.replace(tmp, path)
    except BaseException:
        await aiofiles.os.wrap(tmp.unlink)(missing_ok=True)
        raise
    await _fsync_dir(path.parent)


async def _append(path, data) -> None:
    """Append `data` to `path` and fsync it."""
    async with aiofiles.open(path, "ab") as f:
        await f.write(data)
        await f.flush()
        await _fsync(f.fileno())
