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
setting (default None: keep everything).

Caches in memory are "hot" (`runtime.hotcache.HotCaches`), those on disk "warm".
Every public name of those modules is importable from here too.
"""

from __future__ import annotations

import json
import os
import shutil
import time
from dataclasses import dataclass
from pathlib import Path

from runtime.cachechain import (MAX_DELTAS, Segment, cache_seq, load_cache, load_chain, load_segment, next_segment,
                                remove_deltas, save_cache)
from runtime.cacheformat import (FORMAT, FORMAT_VERSION, MAX_HEADER, CacheError, CacheMissing, ChecksumMismatch,
                                 CorruptCache, ForeignModel, QuantizationMismatch, ShapeMismatch, TruncatedCache,
                                 UnreadableCache, UnsupportedVersion, decode_cache, encode_cache, model_tag,
                                 tag_fingerprint)
from runtime.files import (AGENT_ID, CACHE_FILE, DELTA_FILE, HIGH_FILE, JOURNAL_FILE, MODEL_FILE, CacheDirInUse, NotAFolder,
                           AgentInUse, InvalidAgentId, UnsafePath, agent_dir, check_agent_id, fsync_dir, lock_agent, lock_cache_dir, make_dirs, map_file,
                           open_private, read_file, refuse_links, remove_temps, temp_path, write_atomic)
from runtime.hostcache import (CacheMeta, DeviceCache, HostCache, cache_to_host, check_cache, host_to_cache, on_device,
                               trim_cache, trim_host)
from runtime.hotcache import HotCaches, cache_nbytes
from runtime.journal import (JOURNAL_MAGIC, JournalError, JournalScan, append_frames, append_journal, check_record,
                             conversation_prompt, current_conversation, encode_records, fresh_records, high_seq,
                             journal_record, open_journal, parse_journal, prompt_check, read_journal,
                             read_journal_bytes, record_high_seq, record_reported_loss, repair_journal, reported_loss,
                             scan_journal)

__all__ = [
    # runtime.files
    "AGENT_ID", "CACHE_FILE", "DELTA_FILE", "HIGH_FILE", "JOURNAL_FILE", "MODEL_FILE", "CacheDirInUse",
    "AgentInUse", "InvalidAgentId", "UnsafePath", "agent_dir", "check_agent_id", "fsync_dir", "lock_agent", "lock_cache_dir", "make_dirs", "map_file",
    "open_private", "read_file", "refuse_links", "remove_temps", "temp_path", "write_atomic",
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
    "JOURNAL_MAGIC", "JournalError", "JournalScan", "append_frames", "append_journal", "check_record",
    "conversation_prompt", "current_conversation", "encode_records", "fresh_records", "high_seq", "journal_record",
    "open_journal", "parse_journal", "prompt_check", "read_journal", "read_journal_bytes", "record_high_seq", "record_reported_loss", "repair_journal",
    "reported_loss", "scan_journal",
    # runtime.hotcache
    "HotCaches", "cache_nbytes",
    # this module
    "Loaded", "StoredAgent", "agent_folders", "delete", "inspect_table", "load_agent", "prune", "record_model",
    "recorded_model", "stored_agent",
]


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
    cache = (folder / CACHE_FILE).is_file()
    try:
        data = read_journal_bytes(folder / JOURNAL_FILE)
        records = [] if data is None else scan_journal(data).records
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
    """The model id in `model_dir/model.json`, or None when it is absent, a link or unreadable."""
    try:
        fd = os.open(Path(model_dir) / MODEL_FILE, os.O_RDONLY | os.O_NOFOLLOW)
    except OSError:
        return None
    try:
        with open(fd, "rb", closefd=False) as f:
            model_id = json.loads(f.read(1 << 16)).get("model_id")
    except (OSError, ValueError, AttributeError):
        return None
    finally:
        os.close(fd)
    return model_id if isinstance(model_id, str) and model_id else None


def agent_folders(cache_dir) -> list[Path]:
    """Agent folders under `cache_dir` (`<fingerprint>/<agent>` holding a cache or journal), sorted.

    Symlinked model or agent folders are left out: nothing follows them.
    """
    root = Path(cache_dir).expanduser()
    return sorted(
        d for d in root.glob("*/*")
        if d.is_dir() and not d.is_symlink() and not d.parent.is_symlink() and AGENT_ID.fullmatch(d.name)
        and ((d / CACHE_FILE).exists() or (d / JOURNAL_FILE).exists())
    )


def prune(cache_dir, max_age_s: float, *, journals: bool = False, now: float | None = None) -> list:
    """Retention: delete caches of every model not written for `max_age_s` seconds.

    With `journals=True` whole agent folders (history included) idle that long go;
    only kvactors' own files are deleted, and the folder if it is then empty.
    Returns the deleted paths. Temp files left by crashed writers are removed too.
    """
    now = time.time() if now is None else now
    deleted = []
    for folder in agent_folders(cache_dir):
        remove_temps(folder)
        deltas = list(folder.glob(DELTA_FILE.format("*")))
        ours = [folder / CACHE_FILE, *deltas, folder / JOURNAL_FILE, folder / HIGH_FILE, *folder.glob("journal.torn-*")]
        newest = max((p.stat().st_mtime for p in ours if p.exists()), default=0.0)
        if now - newest < max_age_s:
            continue
        if journals:
            for p in ours:
                p.unlink(missing_ok=True)
            try:
                folder.rmdir()
            except OSError:
                pass
            deleted.append(folder)
        elif (folder / CACHE_FILE).exists() or deltas:
            (folder / CACHE_FILE).unlink(missing_ok=True)
            remove_deltas(folder)
            deleted.append(folder / CACHE_FILE)
    return deleted


# ---------------------------------------------------------------- kvactors inspect


def _human(n: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return ""


def _agent_row(folder: Path) -> list[str]:
    """[agent, tokens, bytes, last turn, health] of one agent folder."""
    health, tokens, cseq = [], "-", None
    size = sum(p.stat().st_size for p in folder.iterdir() if p.is_file())
    records, jpath = [], folder / JOURNAL_FILE
    try:
        data = read_journal_bytes(jpath)
        if data is None:
            health.append("no journal")
        else:
            scan = scan_journal(data)
            records = scan.records
            if scan.damaged:
                health.append(f"journal damaged ({sum(b - a for a, b in scan.damaged)} B unreadable, records lost)")
            if scan.torn:
                health.append(f"torn journal tail ({scan.torn} B dropped)")
    except JournalError as e:
        health.append(f"journal unreadable: {e}")
    if (folder / CACHE_FILE).exists():
        try:
            host, meta = load_chain(folder)
            tokens, cseq = str(host.n_tokens), meta.seq
            if tag_fingerprint(meta.fingerprint) != folder.parent.name:
                health.append(f"cache of another model ({meta.fingerprint})")
        except CacheError as e:
            health.append(f"bad cache: {type(e).__name__}")
    else:
        health.append("no cache (cold start)")
    if records and cseq is not None and cseq < records[-1]["seq"]:
        health.append(f"cache at seq {cseq}, journal at {records[-1]['seq']}")
    elif cseq is not None and cseq > (records[-1]["seq"] if records else -1):
        health.append(f"cache at seq {cseq} is newer than the journal: its turns are not in the history")
    if records:
        r = records[-1]
        when = time.strftime("%Y-%m-%d %H:%M", time.localtime(r.get("time") or jpath.stat().st_mtime))
        last = f"#{r['seq']} {r['role']} {when}"
    else:
        last = "-"
    return [folder.name, tokens, _human(size), last, "; ".join(health) or "ok"]


def _table(rows: list[list[str]]) -> str:
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    lines = ["  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in rows]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def check_cache_folder(root: Path) -> Path:
    """`root`, unless it (or the nearest of its parents that exists) is a file: NotAFolder then."""
    path = next((p for p in (root, *root.parents) if p.exists()), None)
    if path is not None and not path.is_dir():
        raise NotAFolder(f"{path} is a file, not a cache folder" + ("" if path == root else f" (it would hold {root})")
                         + ": give a folder, made if missing")
    return root


def inspect_table(cache_dir) -> str:
    """A text table per model folder of `cache_dir`: agent, tokens, bytes on disk, last turn, health.

    Each table is titled `model <model id> (<fingerprint>)`, or just the fingerprint when
    the folder has no `model.json` (made before kvactors recorded it). Reads every file
    (checksums included); changes nothing. Raises NotAFolder (a NotADirectoryError) for a path that is a file.
    """
    root = check_cache_folder(Path(cache_dir).expanduser())
    if not root.is_dir():
        return f"{root}: no such folder (no agents stored yet)"
    models: dict[str, list[Path]] = {}
    for folder in agent_folders(root):
        models.setdefault(folder.parent.name, []).append(folder)
    out = []
    for model, agents in models.items():
        rows = [["agent", "tokens", "on disk", "last turn", "health"]] + [_agent_row(a) for a in agents]
        name = recorded_model(root / model)
        title = f"{name} ({model})" if name else model
        out.append(f"model {title} ({len(agents)} agents)\n{_table(rows)}")
    return "\n\n".join(out) or f"{root}: no agents stored"
