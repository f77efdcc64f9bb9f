"""The store of agents under `cache_dir`: each agent's folder as a whole, and the public names of the parts.

An agent's durable state is its journal (`runtime.journal`, the source of truth for
its history) and its cache (`runtime.cachechain`: a full cache file in the format of
`runtime.cacheformat` plus delta files), in its folder (`runtime.files`: layout,
atomic writes, the lock). This module works on whole folders: `load_agent` reads an
agent back (a bad cache never raises: the agent re-prefills from its journal),
`stored_agent` summarizes one, `delete` removes one, `agent_folders` lists them,
`record_model` names the model of a fingerprint folder, `inspect_table` reports
on a folder for people (`kvactors inspect`). Retention: `prune(cache_dir, max_age_s)`
deletes caches (and, if asked, whole agent folders with their journals) unused for
`max_age_s` seconds; the persistence actor runs it at start with its `retention_s`
setting (default None: keep everything), and `kvactors prune` runs `prune_agents`.

Caches in memory are "hot" (`runtime.hotcache.HotCaches`), those on disk "warm".
Every public name of those modules is importable from here too.
"""

from __future__ import annotations

import collections
import contextlib
import json
import logging
import os
import re
import shutil
import stat
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

from runtime.cachechain import (MAX_DELTAS, Segment, cache_seq, load_cache, load_chain, load_segment, next_segment,
                                remove_deltas, save_cache)
from runtime.cacheformat import (FORMAT, FORMAT_VERSION, MAX_HEADER, CacheError, CacheMissing, ChecksumMismatch,
                                 CorruptCache, ForeignModel, QuantizationMismatch, ShapeMismatch, TruncatedCache,
                                 UnreadableCache, UnsupportedVersion, decode_cache, decode_file, encode_cache,
                                 model_tag, tag_fingerprint)
from runtime.files import (_TMP_SUFFIX, AGENT_ID, CACHE_FILE, DELTA_FILE, FINGERPRINT, HIGH_FILE, JOURNAL_FILE,
                           MODEL_FILE, AgentInUse, CacheDirInUse, InvalidAgentId, NotAFolder, UnsafePath, agent_dir,
                           check_agent_id, fsync_dir, lock_agent, lock_cache_dir, make_dirs, map_file, open_file,
                           open_private, own_file, read_file, refuse_links, remove_temps, temp_path, write_atomic)
from runtime.hostcache import (CacheMeta, DeviceCache, HostCache, cache_to_host, check_cache, host_to_cache, on_device,
                               trim_cache, trim_host)
from runtime.hotcache import HotCaches, cache_nbytes
from runtime.journal import (JOURNAL_MAGIC, JournalError, JournalScan, append_frames, append_journal, check_record,
                             conversation_prompt, current_conversation, encode_records, fresh_records, high_seq,
                             journal_record, lost_records, open_journal, parse_journal, prompt_check, read_journal,
                             read_journal_bytes, record_high_seq, record_reported_loss, repair_journal, reported_loss,
                             scan_folder, scan_journal, unread_tail)

__all__ = [
    # runtime.files
    "AGENT_ID", "CACHE_FILE", "DELTA_FILE", "HIGH_FILE", "JOURNAL_FILE", "MODEL_FILE", "CacheDirInUse",
    "AgentInUse", "InvalidAgentId", "UnsafePath", "agent_dir", "check_agent_id", "fsync_dir", "lock_agent", "lock_cache_dir", "make_dirs", "map_file",
    "open_private", "read_file", "refuse_links", "remove_temps", "temp_path", "write_atomic", "FINGERPRINT",
    "NotAFolder", "open_file", "own_file",
    # runtime.hostcache
    "CacheMeta", "DeviceCache", "HostCache", "cache_to_host", "check_cache", "host_to_cache", "on_device",
    "trim_cache", "trim_host",
    # runtime.cacheformat
    "FORMAT", "FORMAT_VERSION", "MAX_HEADER", "CacheError", "CacheMissing", "ChecksumMismatch", "CorruptCache",
    "ForeignModel", "QuantizationMismatch", "ShapeMismatch", "TruncatedCache", "UnreadableCache", "model_tag",
    "tag_fingerprint",
    "UnsupportedVersion", "decode_cache", "encode_cache",
    # runtime.cachechain
    "MAX_DELTAS", "Segment", "cache_seq", "load_cache", "load_chain", "load_segment", "next_segment", "remove_deltas",
    "save_cache",
    # runtime.journal
    "JOURNAL_MAGIC", "JournalError", "JournalScan", "append_frames", "append_journal", "check_record", "lost_records",
    "conversation_prompt", "current_conversation", "encode_records", "fresh_records", "high_seq", "journal_record",
    "open_journal", "parse_journal", "prompt_check", "read_journal", "read_journal_bytes", "record_high_seq", "record_reported_loss", "repair_journal",
    "reported_loss", "scan_folder", "scan_journal", "unread_tail",
    # runtime.hotcache
    "HotCaches", "cache_nbytes",
    # this module
    "Loaded", "Pruned", "StoredAgent", "agent_folders", "delete", "human_bytes", "inspect_table", "load_agent",
    "prune", "prune_agents", "record_model", "recorded_model", "stored_agent",
]

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class StoredAgent:
    """What an agent folder holds, in brief (see `stored_agent`).

    `turns`: assistant replies in the current conversation (the history), None when the
    journal cannot be read. `system`: the current conversation's system prompt ("" when
    it has none), None when the record that held it was lost (`conversation_prompt`);
    `check`: the `prompt_check` its records carry (None for records older than it).
    `messages`: records in the current conversation (system records included).
    `cache`: whether a cache file is on disk ("warm").
    """

    name: str
    turns: int | None
    system: str | None
    messages: int
    cache: bool
    check: int | None = None


def stored_agent(folder: Path) -> StoredAgent:
    """The `StoredAgent` of agent folder `folder`; reads the journal, only checks the cache file exists.

    Never raises for a bad journal (`turns` is then None: `kvactors inspect` says why);
    raises UnsafePath for a symlinked folder.
    """
    refuse_links(folder)
    cache = stat.S_ISREG(_mode(folder / CACHE_FILE) or 0)  # a regular file: a link is not followed
    try:
        scan = scan_folder(folder)
        records = [] if scan is None else scan.records
    except (JournalError, OSError):  # another format, a newer version, unreadable
        return StoredAgent(folder.name, None, None, 0, cache)
    history = current_conversation(records)
    turns = sum(r["role"] == "assistant" for r in history)
    check = history[-1].get("check") if history else None
    return StoredAgent(folder.name, turns, conversation_prompt(history), len(history), cache, check)


@dataclass(frozen=True)
class Loaded:
    """An agent's durable state: journal `records`, and its cache if usable.

    `host`/`meta` are None when there is no usable cache; `error` then says why
    (a CacheError; CacheMissing on a plain cold start). Re-prefill from `records`.
    `last_seq`: the highest seq the agent's files have used (the journal's last record,
    its high-water mark, or a newer cache, left by a damaged, cut or deleted journal);
    new records must go above it, so no seq is ever used twice. `journal_error`: set
    (and `records` empty) when the journal cannot be read at all; the agent must not run until it is fixed.
    """

    records: list
    host: HostCache | None = None
    meta: CacheMeta | None = None
    error: CacheError | None = None
    last_seq: int = -1
    journal_error: JournalError | None = None
    segment: Segment | None = None  # the newest cache file applied: a writer may continue its chain


def load_agent(cache_dir, spec, agent: str) -> Loaded:
    """Load `agent`'s journal and, if usable, its cache; never raises for a bad cache.

    Raises InvalidAgentId for a bad id, and JournalError/OSError when the journal itself
    cannot be read (history must never be silently replaced by nothing). Repairs
    nothing: the persistence actor opens the journal (`open_journal`) first.
    """
    records = read_journal(cache_dir, spec, agent)
    folder = agent_dir(cache_dir, spec.fingerprint, agent)
    marks = (records[-1]["seq"] if records else None, cache_seq(folder), high_seq(folder))
    last = max([-1, *(m for m in marks if m is not None)])
    try:
        host, meta, segment = load_segment(folder, spec)
    except CacheError as e:
        return Loaded(records, error=e, last_seq=last)
    return Loaded(records, host, meta, last_seq=last, segment=segment)


def delete(cache_dir, spec, agent: str) -> bool:
    """Delete `agent`'s folder (cache and journal) for model `spec`; return whether it existed.

    Raises UnsafePath if the folder is a symlink (nothing outside the store is deleted).
    """
    folder = agent_dir(cache_dir, spec.fingerprint, agent)
    refuse_links(folder)
    if not folder.exists():
        return False
    shutil.rmtree(folder)
    fsync_dir(folder.parent)
    return True


def record_model(model_dir: Path, model_id: str) -> bool:
    """Write `model_dir/model.json` ({"model_id": model_id}) atomically unless it is there; return whether written.

    A fingerprint alone does not say which model made a folder: this file does, for
    `inspect_table`. `model_dir` must exist. Raises UnsafePath if it is a symlink.
    """
    model_dir = Path(model_dir)
    if model_dir.is_symlink():
        raise UnsafePath(f"{model_dir} is a symlink inside the store; kvactors never follows one there: remove it")
    path = model_dir / MODEL_FILE
    if os.path.lexists(path):
        return False
    write_atomic(path, json.dumps({"model_id": str(model_id)}).encode())
    return True


def recorded_model(model_dir: Path) -> str | None:
    """The model id in `model_dir/model.json`, or None when it is absent, unreadable or not a regular file.

    Never follows a link, never blocks (a named pipe in its place is opened non-blocking and refused).
    """
    try:
        fd = open_file(Path(model_dir) / MODEL_FILE, os.O_RDONLY)
    except OSError:
        return None
    try:
        model_id = json.loads(os.read(fd, 1 << 16)).get("model_id")
    except (OSError, ValueError, AttributeError):
        return None
    finally:
        os.close(fd)
    return model_id if isinstance(model_id, str) and model_id else None


def agent_folders(cache_dir) -> list[Path]:
    """Agent folders under `cache_dir` (`<fingerprint>/<agent>` holding a cache or journal), sorted.

    Symlinked model or agent folders are left out, and never listed: nothing follows them.
    """
    found = []
    for model in _subfolders(Path(cache_dir).expanduser()):
        with contextlib.suppress(OSError):  # a model folder that cannot be listed holds none we can see
            found += _agents_in(model)
    return sorted(found)


def _agents_in(model: Path) -> list[Path]:
    """The agent folders in model folder `model` (`agent_folders`' rule); OSError where it cannot be listed."""
    return [model / e.name for e in _entries(model)
            if AGENT_ID.fullmatch(e.name) and e.is_dir(follow_symlinks=False) and _holds_agent(model / e.name)]


def case_twin(cache_dir, fingerprint: str, agent: str) -> str | None:
    """A stored agent of model `fingerprint` whose id differs from `agent` only in case (its folder's name), or
    None. On a case-insensitive file system (macOS's, Windows') the two would open one folder.

    Lists the model's folder once while it does not change (`_ids_by_case`), so spawning N stored agents
    costs N stats and not N listings of N names."""
    ids = _ids_by_case(Path(cache_dir).expanduser() / fingerprint)
    return next((n for n in ids.get(agent.lower(), ()) if n != agent), None)


SETTLED_NS = 3_000_000_000  # a folder's mtime this long before its listing: any later change gives another mtime
LISTING_TTL_S = 10.0  # a listing is made again after this long whatever the mtime says (clocks may disagree)
LISTINGS = 16  # folders whose listing is kept (the models a process uses)
_listings: collections.OrderedDict = collections.OrderedDict()  # (st_dev, st_ino) -> (mtime_ns, made, ids)
_listings_lock = threading.Lock()


def _ids_by_case(folder: Path) -> dict:
    """{lowercased id: the agent ids of `folder`'s entries, by name}, {} where it cannot be listed.

    A listing is reused while the folder (the same one: device and inode) has the mtime it
    was listed at, for LISTING_TTL_S at most, and kept only if that mtime was SETTLED_NS
    old by this host's clock when it was listed: a file system stamps times at a coarse
    tick (2 s on FAT), so a change within the tick of the listed mtime would leave it as it
    was; past it, any entry added or removed moves the mtime. A file server whose clock is
    behind this host's can make a fresh mtime look settled: the TTL bounds how long such a
    listing can miss a change. At most LISTINGS folders are remembered.
    """
    try:
        st = os.stat(folder)
    except OSError:
        return {}
    key, now = (st.st_dev, st.st_ino), time.monotonic()
    with _listings_lock:
        hit = _listings.get(key)
        if hit is not None and hit[0] == st.st_mtime_ns and now - hit[1] < LISTING_TTL_S:
            _listings.move_to_end(key)
            return hit[2]
    listed_at = time.time_ns()
    ids: dict = {}
    try:
        entries = _entries(folder)
    except OSError:
        return {}
    for e in entries:
        if AGENT_ID.fullmatch(e.name):
            ids.setdefault(e.name.lower(), []).append(e.name)
    with _listings_lock:
        _listings.pop(key, None)
        if listed_at - st.st_mtime_ns >= SETTLED_NS:
            _listings[key] = (st.st_mtime_ns, now, ids)
            while len(_listings) > LISTINGS:
                _listings.popitem(last=False)
    return ids


def _subfolders(folder: Path) -> list[Path]:
    """The folders in `folder`, symlinks left out (never followed); [] when it cannot be listed."""
    try:
        return [folder / e.name for e in _entries(folder) if e.is_dir(follow_symlinks=False)]
    except OSError:
        return []


def _holds_agent(folder: Path) -> bool:
    """Whether `folder` holds a cache or journal entry (of any kind: a link is not followed), or may: a folder that
    cannot be searched (no permission) is not taken for an empty one, so its agent is listed, not hidden."""
    for name in (CACHE_FILE, JOURNAL_FILE):
        try:
            os.lstat(folder / name)
            return True
        except FileNotFoundError:
            continue
        except OSError:
            return True
    return False


@dataclass
class Pruned:
    """What `prune_agents` did in one agent folder, or in a model folder it could not list: `paths` deleted (with
    `dry_run`, that would be), `nbytes` their bytes, and `error`, the OSError that left the rest of the folder as it
    was (logged as a warning), else None."""

    folder: Path
    paths: list = field(default_factory=list)
    nbytes: int = 0
    error: OSError | None = None


def prune(cache_dir, max_age_s: float, *, journals: bool = False, now: float | None = None) -> list:
    """Retention: delete caches of every model not written for `max_age_s` seconds.

    With `journals=True` whole agent folders (history and its damaged or torn copies
    included) idle that long go; only kvactors' own files are deleted, and the folder if
    it is then empty. Times are the files' own (a symlink is never followed). Returns the
    deleted paths: the folder, or its files where something else stays in it (a cache's
    delta files included), also those of an agent whose folder failed partway (a file
    that cannot be deleted, a folder that cannot be searched): that agent is left as
    it is then, logged as a warning (its folder, the file and why), and the others are
    still pruned (a model folder that cannot be listed is logged too). Temp files left by
    crashed writers are removed too. `prune_agents` says the same agent by agent.
    """
    return [p for r in prune_agents(cache_dir, max_age_s, journals=journals, now=now) for p in r.paths]


def prune_agents(cache_dir, max_age_s: float, *, journals: bool = False, now: float | None = None,
                 dry_run: bool = False) -> list[Pruned]:
    """`prune`, agent by agent: a `Pruned` per agent folder that lost files or failed (and per model folder that
    cannot be listed), sorted by path. `dry_run=True` deletes nothing, temp files included, and returns what would
    go (a folder's files, never the folder). The caller holds the `cache_dir` lock (`lock_cache_dir`)."""
    now = time.time() if now is None else now
    done = []
    for model in _subfolders(Path(cache_dir).expanduser()):
        try:
            agents = _agents_in(model)
        except OSError as e:
            if FINGERPRINT.fullmatch(model.name):  # named like a model's folder: its agents may be in it
                log.warning("prune cannot list model folder %s: %s; fix that folder's permissions, for the next prune "
                            "to take its agents", model, e)
                done.append(Pruned(model, error=e))
            continue
        for folder in agents:
            pruned = Pruned(folder)
            try:
                _prune_folder(folder, max_age_s, journals, now, dry_run, pruned)
            except OSError as e:  # a read-only folder, files no rule foresaw (a folder in a cache file's place)
                pruned.error = e
                log.warning("prune left the rest of agent folder %s: %s; fix that folder's permissions or move that "
                            "path aside, for the next prune to take the agent", folder, e)
            if pruned.paths or pruned.error:
                done.append(pruned)
    return done


def _prune_folder(folder: Path, max_age_s: float, journals: bool, now: float, dry_run: bool, pruned: Pruned) -> None:
    """`prune_agents` of one agent folder; adds each path to `pruned` as it goes, so what went before an error is
    listed too."""
    if not dry_run:
        remove_temps(folder)
    cache = [folder / CACHE_FILE, *folder.glob(DELTA_FILE.format("*"))]
    ours = [*cache, folder / JOURNAL_FILE, folder / HIGH_FILE,
            *folder.glob("journal.torn-*"), *folder.glob("journal.damaged-*")]
    ours = [p for p in ours if _mode(p) is not None]  # a folder that cannot be searched raises: not taken for empty
    newest = max((os.lstat(p).st_mtime for p in ours), default=0.0)  # a link's own time: never followed
    if now - newest < max_age_s:
        return
    doomed = ours if journals else [p for p in ours if p in cache]
    for p in doomed:
        try:
            size = os.lstat(p).st_size  # a link's own size: never followed
        except FileNotFoundError:
            continue
        if not dry_run:
            p.unlink(missing_ok=True)
        pruned.paths.append(p)
        pruned.nbytes += size
    if dry_run:
        return
    if journals:
        try:
            folder.rmdir()
            pruned.paths = [folder]  # the folder names its files
        except OSError:  # something not kvactors' is left in it (inspect names a stray temp folder)
            pass
    elif doomed:
        fsync_dir(folder)


# ---------------------------------------------------------------- kvactors inspect


def human_bytes(n: int) -> str:
    """`n` bytes for people: "512 B", "17.3 KiB", "1.2 GiB" (kvactors inspect and prune)."""
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return ""


_KINDS = {stat.S_IFDIR: "a folder", stat.S_IFIFO: "a named pipe", stat.S_IFSOCK: "a socket", stat.S_IFCHR: "a device",
          stat.S_IFBLK: "a device"}
_CACHE_WHY = {TruncatedCache: "cut short", CorruptCache: "damaged", ChecksumMismatch: "damaged: its checksum fails",
              UnsupportedVersion: "from a newer kvactors", UnreadableCache: "unreadable"}
_REPREFILL = "the agent re-prefills from its journal"


def _entries(folder: Path) -> list[os.DirEntry]:
    """The entries of `folder`, sorted by name, listed without following a link; raises OSError as `os.scandir`."""
    with os.scandir(folder) as it:
        return sorted(it, key=lambda e: e.name)


def _mode(path: Path) -> int | None:
    """`path`'s st_mode, of the link itself for a symlink; None when nothing is there."""
    try:
        return os.lstat(path).st_mode
    except FileNotFoundError:
        return None


_MODEL_HASH = re.compile(r"[0-9a-f]{32}")  # the name `model.fingerprint` gives a model's folder


def _kind(path: Path, mode: int) -> str:
    """What `path` (of st_mode `mode`) is, for people: "a file", "a folder", "a symlink (to X)", ..."""
    if stat.S_ISREG(mode):
        return "a file"
    if not stat.S_ISLNK(mode):
        return _KINDS.get(stat.S_IFMT(mode), "not a regular file")
    try:
        return f"a symlink (to {os.readlink(path)})"  # the link's text: nothing is followed
    except OSError:
        return "a symlink"


def _journal_health(folder: Path, used: int) -> tuple[list | None, list[str]]:
    """(records, notes) of the journal in `folder`, whose agent's other files used seqs up to `used`: records None
    when it cannot be read; notes say what is wrong and what happens or what to do."""
    path = folder / JOURNAL_FILE
    mode = _mode(path)
    if mode is None:
        return [], ["no journal"]
    if stat.S_ISLNK(mode):
        return None, [f"journal unreadable: {JOURNAL_FILE} is {_kind(path, mode)}, which kvactors never follows, so "
                      "the agent cannot start: put the file itself in its place"]
    try:
        scan = scan_folder(folder)
        scan = scan_journal(b"") if scan is None else scan
    except JournalError as e:  # not a file, no permission, another format or a newer version: it says what to do
        return None, [f"journal unreadable: {e}"]
    notes = []
    if scan.header_damaged:
        notes.append("journal header damaged: repaired at the agent's next start, the damaged file kept as "
                     "journal.damaged-*")
    if scan.damaged:
        notes.append(f"journal damaged ({sum(b - a for a, b in scan.damaged)} B unreadable, records lost): repaired at "
                     "the agent's next start, the damaged file kept as journal.damaged-*")
    if scan.torn:
        notes.append(f"{unread_tail(scan, used > scan.last_seq)} at the agent's next start")
    return scan.records, notes


def _mark_health(folder: Path) -> tuple[int | None, list[str]]:
    """(the journal's high-water mark, None if there is none that reads; notes on `journal.seq` in `folder`)."""
    path = folder / HIGH_FILE
    mode = _mode(path)
    if mode is None:
        return None, []  # a folder older than the mark: written with the agent's next turn
    if stat.S_ISDIR(mode) or stat.S_ISLNK(mode):
        return None, [f"{HIGH_FILE} is {_kind(path, mode)}, not a file: the journal's high-water mark cannot be "
                      "recorded (each turn logs an error); remove it, kvactors writes a new one"]
    if not stat.S_ISREG(mode):
        return None, [f"{HIGH_FILE} is {_kind(path, mode)}, not a file: kvactors replaces it with the agent's "
                      "next turn"]
    if not os.access(path, os.R_OK | os.W_OK):  # a mark that still reads is the one the persistence actor counts
        return high_seq(folder), [f"{HIGH_FILE} cannot be read or written: the journal's high-water mark cannot be "
                                  "recorded (each turn logs an error); fix its permissions"]
    mark = high_seq(folder)
    if mark is None:
        return None, [f"{HIGH_FILE} damaged (no valid high-water mark in it): rewritten with the agent's next turn"]
    return mark, []


def _cache_health(folder: Path) -> tuple[tuple | None, list[str]]:
    """((host, meta, segment) of the cache chain in `folder` as `load_segment` reads it, None when there is none
    usable; notes on the cache file and its deltas: what is wrong, and what happens or what to do)."""
    path = folder / CACHE_FILE
    mode = _mode(path)
    if mode is None:
        return None, ["no cache (cold start)"]
    if stat.S_ISDIR(mode):
        return None, [f"bad cache: {CACHE_FILE} is a folder, not a file: {_REPREFILL} at every start, and no cache "
                      "can be written in its place (each turn logs an error); remove it"]
    if not stat.S_ISREG(mode):
        return None, [f"bad cache: {CACHE_FILE} is {_kind(path, mode)}, not a file, which kvactors never reads: "
                      f"{_REPREFILL}, and its next turn replaces it"]
    try:
        loaded = load_segment(folder)
    except CacheError as e:
        return None, [f"bad cache: {type(e).__name__} ({CACHE_FILE} is {_CACHE_WHY.get(type(e), 'unusable')}): "
                      f"{_REPREFILL}, and its next turn rewrites the file"]
    notes = _delta_health(folder, loaded[2])
    if tag_fingerprint(loaded[1].fingerprint) != folder.parent.name:  # no agent of this folder loads it: no tokens
        return None, notes + [f"cache of another model ({loaded[1].fingerprint}): {_REPREFILL}, and its next turn "
                              "rewrites it"]
    return loaded, notes


def _delta_health(folder: Path, segment: Segment) -> list[str]:
    """A note when the delta file after the last one loading applied (`segment`) is not a file, or is damaged or
    does not fit while it links to that one. A delta that decodes but links elsewhere is stale (a crash left it;
    loading ignores it, the next cache write replaces it): no note."""
    path = folder / DELTA_FILE.format(segment.deltas + 1)
    mode = _mode(path)
    if mode is None or segment.deltas >= MAX_DELTAS:
        return []
    if stat.S_ISDIR(mode):
        return [f"bad cache delta: {path.name} is a folder, not a file: loading stops before it, and the cache writes "
                "that should replace it fail (each logs an error); remove it"]
    if not stat.S_ISREG(mode):
        return [f"bad cache delta: {path.name} is {_kind(path, mode)}, not a file, which kvactors never reads: loading "
                "stops before it; the agent's next cache write replaces it"]
    try:
        link = decode_file(map_file(path))[3]
    except (CacheError, OSError) as e:
        return [f"bad cache delta: {path.name} is damaged ({type(e).__name__}): loading stops before it (turns after "
                "it are re-prefilled from the journal); the agent's next cache write replaces it"]
    if link and link.get("parent") == segment.checksum:
        return [f"bad cache delta: {path.name} does not fit the cache before it: loading stops before it (turns after "
                "it are re-prefilled from the journal); the agent's next cache write replaces it"]
    return []


def _seq_notes(records: list, loaded: tuple | None, cached: int | None, used: int, folder: Path) -> list[str]:
    """Notes comparing the seqs of a readable journal (`records`) with its cache's (`loaded`, and `cached` by the
    headers, `cache_seq`) and with `used`, the seqs its agent's other files used (the cache's headers and the
    high-water mark, as the persistence actor counts them).

    A cache behind the journal only costs a prefill; seqs used past the journal's last record are records the
    journal lost.
    """
    last = records[-1]["seq"] if records else -1
    lag = [] if loaded is None or loaded[1].seq >= last else \
        [f"cache at seq {loaded[1].seq}, journal at {last}: the agent's next turn prefills the turns after it"]
    if used <= last:
        return lag
    return lag + [lost_records(not os.path.lexists(folder / JOURNAL_FILE), cached, last, used)]


def _stray_folders(entries: list[os.DirEntry]) -> list[str]:
    """Notes on folders named like kvactors temp files (`.<file>.<pid>.<hex>.tmp`, see `temp_path`): kvactors makes
    temp files only and `remove_temps` leaves such a folder alone, so it stays until someone removes it."""
    return [f"{e.name}/ is a folder named like a kvactors temp file: kvactors makes temp files only and never "
            "removes this folder; look inside, then remove it"
            for e in entries
            if e.name.startswith(".") and e.name.endswith(_TMP_SUFFIX) and e.is_dir(follow_symlinks=False)]


def _size(entries: list[os.DirEntry]) -> int:
    """Bytes of the regular files among `entries` (links not followed; one removed meanwhile counts 0)."""
    total = 0
    for e in entries:
        try:
            total += e.stat(follow_symlinks=False).st_size if e.is_file(follow_symlinks=False) else 0
        except OSError:
            pass
    return total


def _last_turn(records: list, folder: Path) -> str:
    """"#seq role time" of the journal's last record ("-" if none); the journal's mtime for a record without a time."""
    if not records:
        return "-"
    r, when = records[-1], records[-1].get("time")
    try:
        when = when if isinstance(when, (int, float)) else os.lstat(folder / JOURNAL_FILE).st_mtime
        stamp = time.strftime("%Y-%m-%d %H:%M", time.localtime(when))
    except (OSError, OverflowError, ValueError):
        stamp = "?"
    return f"#{r['seq']} {r['role']} {stamp}"


def _agent_row(folder: Path) -> list[str]:
    """[agent, tokens, bytes, last turn, health] of the agent folder `folder` (not a symlink); reads, never writes.

    Health is "ok", or notes joined by "; ", each saying what is wrong, in which file, and what happens or what to do.
    Raises OSError when the folder cannot be listed.
    """
    entries = _entries(folder)
    mark, mark_notes = _mark_health(folder)
    cached = cache_seq(folder)
    used = max(x for x in (mark, cached, -1) if x is not None)  # seqs the other files used
    records, notes = _journal_health(folder, used)
    loaded, cache_notes = _cache_health(folder)
    notes += mark_notes + cache_notes + _stray_folders(entries)
    if records is not None:  # an unreadable journal's seqs are unknown: nothing to compare
        notes += _seq_notes(records, loaded, cached, used, folder)
    tokens = "-" if loaded is None else str(loaded[0].n_tokens)
    return [folder.name, tokens, human_bytes(_size(entries)), _last_turn(records or [], folder), "; ".join(notes) or "ok"]


def _safe_row(folder: Path) -> list[str]:
    """`_agent_row` of `folder`, or a row saying what is wrong with the folder itself: a symlink (never followed) or
    one that cannot be read. Never raises: one bad agent never hides the others."""
    mode = _mode(folder)
    if mode is not None and stat.S_ISLNK(mode):
        return [folder.name, "-", "-", "-", f"the agent folder is {_kind(folder, mode)}, which kvactors never follows: "
                "it refuses the agent (UnsafePath); remove the link, or move the folder it points to here in its place"]
    if mode is not None and not stat.S_ISDIR(mode):
        return [folder.name, "-", "-", "-", f"{folder.name} is {_kind(folder, mode)}, not an agent folder: the agent "
                "of that name cannot start (its files cannot be made); move it aside"]
    try:
        return _agent_row(folder)
    except Exception as e:  # noqa: BLE001 - files no rule foresaw: said on their row, the other agents still listed
        fix = "; fix its permissions" if isinstance(e, PermissionError) else ""
        return [folder.name, "-", "-", "-", f"cannot inspect the folder: {type(e).__name__}: {e}{fix}"]


def counted(n: int, noun: str) -> str:
    """'1 agent', '3 agents': `n` and `noun`, plural but for one."""
    return f"{n} {noun}{'' if n == 1 else 's'}"


def _table(rows: list[list[str]]) -> str:
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    lines = ["  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in rows]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def check_cache_folder(root: Path) -> Path:
    """`root`, unless it (or the nearest of its parents that exists) is a file or a symbolic link to nothing:
    NotAFolder then."""
    path = next((p for p in (root, *root.parents) if os.path.lexists(p)), None)
    if path is None or path.is_dir():
        return root
    held = "" if path == root else f" (it would hold {root})"
    if not path.exists():
        raise NotAFolder(f"{path} is a symbolic link to {os.readlink(path)!r}, which does not exist{held}: make the "
                         "folder it points to, or give another cache folder")
    raise NotAFolder(f"{path} is a file, not a cache folder{held}: give a folder instead")


def inspect_table(cache_dir) -> str:
    """A text table per model folder of `cache_dir`: agent, tokens, bytes on disk, last turn, health.

    Each table is titled `model <model id> (<fingerprint>)`, or just the fingerprint when
    the folder has no `model.json` (made before kvactors recorded it). Reads every file
    (checksums included); changes nothing and follows no symlink inside `cache_dir`: a
    symlinked model or agent folder is reported as such. A fault is said on its agent's
    row (see `_agent_row`), never raised. Raises NotAFolder (a NotADirectoryError) for a path that is a file.
    """
    root = check_cache_folder(Path(cache_dir).expanduser())
    if not root.is_dir():
        return f"{root}: no such folder (no agents stored yet)"
    out = []
    for e in _entries(root):
        if not FINGERPRINT.fullmatch(e.name):
            continue
        if e.is_symlink():
            out.append(f"model {e.name}: the model folder is {_kind(root / e.name, stat.S_IFLNK)}, which kvactors "
                       "never follows: it refuses every agent in it (UnsafePath); move the folder it points to here "
                       "in its place, or make the cache folder itself the link")
        elif e.is_dir(follow_symlinks=False):
            out += _model_table(root / e.name)
        elif _MODEL_HASH.fullmatch(e.name):  # named like a model's folder (`model.fingerprint`), but not one
            out.append(f"model {e.name}: {_kind(root / e.name, _mode(root / e.name) or 0)} in place of the model "
                       "folder: no agent of that model can start (its files cannot be made); move it aside")
    return "\n\n".join(out) or f"{root}: no agents stored"


def _model_table(model: Path) -> list[str]:
    """[the table of model folder `model`], [] when it holds no agent, or [a line saying it cannot be listed].

    Its agents are its folders holding a cache or journal, and its symlinks named like agents (in a folder that holds
    an agent or `model.json`: a folder kvactors made).
    """
    try:
        entries = _entries(model)
    except OSError as e:
        return [f"model {model.name}: cannot list the folder ({e.strerror or e}); fix its permissions"]
    agents = [model / e.name for e in entries
              if AGENT_ID.fullmatch(e.name) and e.is_dir(follow_symlinks=False) and _holds_agent(model / e.name)]
    if agents or os.path.lexists(model / MODEL_FILE):  # links and files in the place of an agent folder
        agents += [model / e.name for e in entries
                   if AGENT_ID.fullmatch(e.name) and not e.is_dir(follow_symlinks=False) and e.name != MODEL_FILE]
    if not agents:
        return []
    rows = [["agent", "tokens", "on disk", "last turn", "health"]] + [_safe_row(a) for a in sorted(agents)]
    name = recorded_model(model)
    title = f"{name} ({model.name})" if name else model.name
    return [f"model {title} ({counted(len(agents), 'agent')})\n{_table(rows)}"]
