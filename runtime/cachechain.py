"""An agent's cache on disk: a full cache file and the chain of delta files after it.

A turn that continued the cache on disk writes only a delta file: the same format
(`runtime.cacheformat`) holding just the rows from position `start` on, whose `meta`
adds `delta` = {parent: the checksum of the file before it, start, lengths: tokens
stored per layer after it}. Loading applies the chain (cut at `start`, append) while
each delta links to the file before it. A full file is written instead when the chain
is MAX_DELTAS long or its deltas would outgrow the full file; the deltas are then
removed (a crash in between leaves stale deltas that link to nothing, which loading
ignores). See `next_segment`.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np

from runtime.cacheformat import (MAX_HEADER, CacheError, CacheMissing, CorruptCache, UnreadableCache, check_spec,
                                 decode_file, encode_file, model_tag, parts_size)
from runtime.files import (CACHE_FILE, DELTA_FILE, agent_dir, fsync_dir, make_dirs, map_file, open_file, refuse_links,
                           removed_if_failed, write_atomic)
from runtime.hostcache import CacheMeta, DeviceCache, HostCache, layer_names

MAX_DELTAS = 32


def save_cache(cache_dir, spec, agent: str, host: HostCache, meta: CacheMeta) -> Path:
    """Atomically write `agent`'s full cache (`host` + `meta`) for model `spec` (tagged `model_tag(spec)`); return its path.

    Any delta files of an older chain are removed. Where the write fails, the folders it made are removed again.
    """
    folder = agent_dir(cache_dir, spec.fingerprint, agent)
    parts = encode_file(host, meta, model_tag(spec))[0]
    path = folder / CACHE_FILE
    with removed_if_failed(make_dirs(folder)):  # a cache that cannot be written leaves no empty agent folder
        write_atomic(path, parts)
    remove_deltas(folder)
    return path


def load_cache(cache_dir, spec, agent: str) -> tuple[HostCache, CacheMeta]:
    """Read and validate `agent`'s cache for model `spec`; return (HostCache, CacheMeta).

    The cache is the full file followed by its chain of delta files. A delta that is
    damaged, or does not link to the file before it (left behind by a crash), ends the
    chain: the result is then the last state before it, which is still one the agent
    had. Raises CacheMissing when there is no cache, or another CacheError subclass
    (see `decode_cache`) when the full file cannot be used: the caller re-prefills from
    the journal.
    """
    return load_chain(agent_dir(cache_dir, spec.fingerprint, agent), spec)


def load_chain(folder: Path, spec=None) -> tuple[HostCache, CacheMeta]:
    """`load_cache` for the agent folder `folder`; without `spec` nothing is checked against a model."""
    return load_segment(folder, spec)[:2]


def load_segment(folder: Path, spec=None) -> tuple[HostCache, CacheMeta, "Segment"]:
    """`load_chain`, plus the `Segment` of the newest file it applied.

    A writer that starts from it (`next_segment(..., last=segment)`) continues the
    chain on disk with a delta, as if it had written that file itself.
    """
    path = folder / CACHE_FILE
    try:
        refuse_links(folder)
        data = map_file(path)
    except FileNotFoundError:
        raise CacheMissing(f"no cache for agent {folder.name!r} under {folder}: cold start") from None
    except OSError as e:
        raise UnreadableCache(f"cannot read {path}: {e}; the agent re-prefills from its journal") from e
    try:
        host, meta, checksum, _ = decode_file(data)
        chain, deltas, delta_bytes = _Chain(host), 0, 0
        for k in range(1, MAX_DELTAS + 1):
            try:
                delta_data = map_file(folder / DELTA_FILE.format(k))
                delta, delta_meta, delta_sum, link = decode_file(delta_data)
                if not link or link.get("parent") != checksum:
                    break
                chain.apply(delta, link)
            except (OSError, CacheError):
                break
            meta, checksum, deltas, delta_bytes = delta_meta, delta_sum, k, delta_bytes + len(delta_data)
        host = chain.host()
        if spec is not None:
            check_spec(host, meta.fingerprint, spec)
    except CacheError as e:
        raise type(e)(f"{path}: {e}") from e
    lengths = tuple(host.length(i) for i in range(host.n_layers))
    segment = Segment(meta.seq, checksum, lengths, tuple(meta.token_ids), deltas, len(data), delta_bytes)
    return host, meta, segment


def cache_seq(folder: Path) -> int | None:
    """The seq of the cache in `folder` (following its delta chain by headers only), or None.

    Headers only: a delta whose data is damaged still counts here, while `load_cache`
    stops before it, so this may name a newer seq than the cache that loads.
    """
    seq, checksum = _header_link(folder / CACHE_FILE)
    for k in range(1, MAX_DELTAS + 1):
        delta_seq, delta_sum, parent = _header_link(folder / DELTA_FILE.format(k), with_parent=True)
        if delta_seq is None or parent != checksum:
            break
        seq, checksum = delta_seq, delta_sum
    return seq


def _header_link(path: Path, with_parent: bool = False):
    """(seq, checksum[, parent checksum]) from the header of the cache file at `path`; Nones if unreadable."""
    try:
        with open(open_file(path, os.O_RDONLY), "rb") as f:
            n = int.from_bytes(f.read(8), "little")
            if not 0 < n <= MAX_HEADER:
                raise ValueError(f"header size {n}")
            info = json.loads(f.read(n))["__metadata__"]
        m = json.loads(info["meta"])
        out = (int(m["seq"]), str(info["checksum"]), (m.get("delta") or {}).get("parent"))
    except (OSError, ValueError, KeyError, TypeError):
        out = (None, None, None)
    return out if with_parent else out[:2]


@dataclass(frozen=True)
class Segment:
    """The newest file of an agent's cache chain, as the next write must know it.

    `lengths`: tokens stored per layer; `token_ids`: the tokens cached (all positions);
    `deltas`: delta files after the full file; `base_bytes`/`delta_bytes`: sizes of the full file and
    of the deltas together.
    """

    seq: int
    checksum: str
    lengths: tuple
    token_ids: tuple
    deltas: int
    base_bytes: int
    delta_bytes: int


def next_segment(cache: HostCache | DeviceCache, meta: CacheMeta, fingerprint: str, last: Segment | None,
                 reuse: tuple[int, int] | None) -> tuple[str, bytes, Segment]:
    """What to write for the cache `cache`/`meta`: (file name, file bytes, the Segment it becomes).

    `reuse` = (seq, kept) says that the first `kept` tokens of `cache` are, bit for bit,
    those of the cache of turn `seq`. When that cache is `last` (the newest file on
    disk), fewer than MAX_DELTAS deltas follow its full file, and the deltas together
    stay smaller than it, the answer is the next delta file: only the rows after
    `kept` (the first `kept` token ids must also match `last`'s), and only those rows
    are copied from a `DeviceCache`. Else it is a full cache file (CACHE_FILE), which
    makes any delta files stale: remove them once it is durable (`remove_deltas`).
    """
    lengths = tuple(cache.length(i) for i in range(cache.n_layers))
    ids = tuple(meta.token_ids)
    if last is not None and reuse is not None and reuse[0] == last.seq and last.deltas < MAX_DELTAS \
            and ids[: reuse[1]] == last.token_ids[: reuse[1]] and _delta_fits(cache, reuse[1], last):
        delta = cache.rows(reuse[1])
        if last.delta_bytes + delta.nbytes < last.base_bytes:
            link = {"parent": last.checksum, "start": reuse[1], "lengths": list(lengths)}
            parts, checksum = encode_file(delta, meta, fingerprint, link)
            k = last.deltas + 1
            seg = Segment(meta.seq, checksum, lengths, ids, k, last.base_bytes, last.delta_bytes + parts_size(parts))
            return DELTA_FILE.format(k), parts, seg
    parts, checksum = encode_file(cache.rows(0), meta, fingerprint)
    return CACHE_FILE, parts, Segment(meta.seq, checksum, lengths, ids, 0, parts_size(parts), 0)


def _delta_fits(cache: HostCache | DeviceCache, start: int, last: Segment) -> bool:
    """Whether the rows of `cache` from position `start` on, applied after `last`, rebuild it.

    Per layer a delta carries min(new tokens, stored length) rows; when that is fewer
    than the layer stores, the rest must still be in `last` before `start`.
    """
    n, last_n = cache.n_tokens, len(last.token_ids)
    if not 0 <= start < n or start > last_n or len(last.lengths) != cache.n_layers:
        return False
    for i in range(cache.n_layers):
        stored = cache.length(i)
        new = min(n - start, stored)
        kept = last.lengths[i] - (last_n - start)  # rows of `last` before `start`
        if new < stored and kept < stored - new:
            return False
    return True


class _Chain:
    """A cache being rebuilt from its full file and deltas: per tensor, views of row ranges.

    Applying a delta only cuts and appends views; `host` concatenates once at the
    end, so loading costs one copy however long the chain is.
    """

    def __init__(self, host: HostCache):
        self.first = host
        self.n = host.n_tokens
        self.lengths = [host.length(i) for i in range(host.n_layers)]
        self.pieces = {name: [a] for name, a in host.tensors.items()}

    def apply(self, delta: HostCache, link: dict) -> None:
        """Cut at `link["start"]` and append `delta`'s rows; raises CorruptCache (changing nothing) if they do not fit."""
        base, start, lengths, n = self.first, link.get("start"), link.get("lengths"), delta.n_tokens
        same = (delta.dtype, delta.scheme, delta.n_layers) == (base.dtype, base.scheme, base.n_layers)
        if not same or type(start) is not int or not 0 <= start <= self.n or start >= n or not isinstance(lengths, list) \
                or len(lengths) != base.n_layers or not all(type(x) is int for x in lengths) or set(delta.tensors) != set(self.pieces):
            raise CorruptCache(f"delta (start {start!r}) does not fit the cache before it ({self.n} tokens)")
        pieces = {}
        for i in range(base.n_layers):
            new, stored = delta.length(i), lengths[i]
            old = stored - new  # rows still needed from before `start`
            kept = self.lengths[i] - (self.n - start)
            if new > stored or (old > 0 and (new != n - start or kept < old)):
                raise CorruptCache(f"delta layer {i}: {new} new rows cannot make {stored} after position {start}")
            for name in layer_names(i):
                d, first = delta.tensors[name], self.pieces[name][0]
                if d.shape[:2] + d.shape[3:] != first.shape[:2] + first.shape[3:]:
                    raise CorruptCache(f"delta {name} has shape {d.shape}, the cache {first.shape}")
                pieces[name] = (_rows(self.pieces[name], kept - old, kept) if old > 0 else []) + [d]
        self.pieces, self.n, self.lengths = pieces, n, list(lengths)

    def host(self) -> HostCache:
        """The rebuilt cache (one concatenation per tensor)."""
        tensors = {name: parts[0] if len(parts) == 1 else np.concatenate(parts, axis=2) for name, parts in self.pieces.items()}
        lengths = () if all(x == self.n for x in self.lengths) else tuple(self.lengths)
        return replace(self.first, tensors=tensors, n_tokens=self.n, lengths=lengths)


def _rows(pieces: list, lo: int, hi: int) -> list:
    """Views of rows [lo, hi) (axis 2) of the concatenation of `pieces`."""
    out, at = [], 0
    for a in pieces:
        size = a.shape[2]
        if at < hi and at + size > lo:
            out.append(a[..., max(lo - at, 0) : min(hi - at, size), :])
        at += size
    return out


def remove_deltas(folder: Path) -> None:
    """Delete the delta files in `folder` (stale once a full cache file replaced their chain)."""
    stale = list(Path(folder).glob(DELTA_FILE.format("*")))
    for p in stale:
        p.unlink(missing_ok=True)
    if stale:
        fsync_dir(folder)
