"""On-disk store of agent KV caches and journals: format, atomic writes, validation, tiers.

Layout, one folder per (model fingerprint, agent id), folders 0700, files 0600::

    cache_dir/<fingerprint>/<agent>/cache.safetensors   Q4 cache of the used tokens + metadata
    cache_dir/<fingerprint>/<agent>/cache.<k>.delta.safetensors   rows added since (k = 1, 2, ...)
    cache_dir/<fingerprint>/<agent>/journal.msgpack     append-only record of every turn
    cache_dir/<fingerprint>/model.json                  {"model_id": ...}: which model made the folder

`cache.safetensors` is written with the `safetensors` package. Tensors, per layer i:
`layers.<i>.{keys,values}.{packed,scales,biases}` of shape (1, kv_heads, tokens, ...):
packed words U32, scales and biases in the activation dtype (F32, F16 or BF16, moved
as raw bits so they round-trip exactly). The header's `__metadata__` holds
`format` ("kvactors-q4-cache"), `format_version` ("1"), `meta` (JSON: fingerprint,
kv_bits, kv_group_size, dtype, n_layers, n_tokens, seq, turn_id, text, token_ids,
token_ends, created) and `checksum` ("crc32:<hex>" over the meta string, then every
tensor's name, dtype, shape and crc32 of its bytes, in name order). `token_ends[i]` is
the character offset in `text` where token i's text ends, or -1 when token i ends
inside a character (its bytes are completed by a later token): prefix matching only
cuts where it is >= 0.

`journal.msgpack` starts with `JOURNAL_MAGIC`, then one frame per record:
little-endian u32 payload length, u32 crc32 of the payload, payload = a msgpack map
(seq, turn_id, role, sender, text, time); seqs rise strictly. Reading resynchronises
on the frames past damaged bytes and keeps every record that checks (`scan_journal`);
an incomplete or damaged last frame is a torn tail (a crash in the middle of an
append). Opening the journal for appends (`open_journal`) moves a torn tail aside to
`journal.torn-<time>`; mid-file damage keeps the whole damaged file as
`journal.damaged-<time>` and rewrites the journal from its good frames. An append
that fails (a full disk) cuts the file back to its last good frame before raising
(`append_frames`). The journal is the source of truth for an agent's history; the
cache only accelerates. No file or folder inside `cache_dir` is followed as a symlink.

A turn that continued the cache on disk writes only a delta file: the same format
holding just the rows from position `start` on, whose `meta` adds `delta` = {parent:
the checksum of the file before it, start, lengths: tokens stored per layer after it}.
Loading applies the chain (cut at `start`, append) while each delta links to the file
before it. A full file is written instead when the chain is MAX_DELTAS long or its
deltas would outgrow the full file; the deltas are then removed (a crash in between
leaves stale deltas that link to nothing, which loading ignores). See `next_segment`.

Every cache write goes to a temp file in the same folder, is fsynced, renamed over
the old file, and the folder is fsynced: after a crash each file is the previous or
the new complete version. One process writes a cache folder at a time.

Loading validates everything and raises one `CacheError` subclass per problem; the
caller falls back to re-prefilling from the journal (`load_agent` does that split).

Tiers: a cache in memory is "hot" (`HotCaches`, an LRU under a byte budget), one on
disk is "warm". Retention: `prune(cache_dir, max_age_s)` deletes caches (and, if
asked, whole agent folders with their journals) unused for `max_age_s` seconds;
the persistence actor runs it at start with its `retention_s` setting (default None:
keep everything). `delete` removes one agent, `inspect_table` summarizes a folder.
"""

from __future__ import annotations

import json
import mmap
import os
import re
import secrets
import shutil
import stat
import struct
import threading
import time
import zlib
from collections import OrderedDict
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field, replace
from pathlib import Path

import msgpack
import numpy as np
from safetensors import TensorSpec, serialize

from runtime.errors import KvactorsError

FORMAT = "kvactors-q4-cache"
FORMAT_VERSION = 1
CACHE_FILE = "cache.safetensors"
DELTA_FILE = "cache.{}.delta.safetensors"  # k = 1, 2, ...: the rows turn after turn added
MAX_DELTAS = 32
JOURNAL_FILE = "journal.msgpack"
MODEL_FILE = "model.json"  # in a fingerprint folder: the model id it was made by (for people: see inspect)
JOURNAL_MAGIC = b"kvactors-journal-1\n"
AGENT_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}")
MAX_HEADER = 100 << 20  # the safetensors package's own limit
_FRAME = struct.Struct("<II")
_TMP_SUFFIX = ".tmp"
_PARALLEL_CRC_BYTES = 16 << 20

# safetensors header dtype -> (numpy dtype that holds the bytes, activation dtype name)
_DTYPES = {
    "U32": (np.uint32, "uint32"),
    "F32": (np.float32, "float32"),
    "F16": (np.float16, "float16"),
    "BF16": (np.uint16, "bfloat16"),
}
_SCALE_HEADER = {"float32": "F32", "float16": "F16", "bfloat16": "BF16"}
_PARTS = ("packed", "scales", "biases")


# ---------------------------------------------------------------- errors


class InvalidAgentId(KvactorsError, ValueError):
    """An agent id that is not `[A-Za-z0-9][A-Za-z0-9._-]{0,127}`."""


class CacheError(KvactorsError):
    """A stored cache cannot be used; re-prefill the agent from its journal."""


class CacheMissing(CacheError):
    """There is no stored cache for this agent (a cold start)."""


class CorruptCache(CacheError):
    """The file is not a readable kvactors cache (garbage, a damaged header)."""


class TruncatedCache(CacheError):
    """The file ends before the data its header announces."""


class UnsupportedVersion(CacheError):
    """The cache was written in a format version this code does not read."""


class ChecksumMismatch(CacheError):
    """The tensors or metadata do not match the checksum written with them."""


class ForeignModel(CacheError):
    """The cache belongs to another model (another fingerprint)."""


class QuantizationMismatch(CacheError):
    """The cache was quantized with other bits or group size than the runtime uses."""


class ShapeMismatch(CacheError):
    """The tensors' shapes or dtype contradict the model's cache spec."""


class UnreadableCache(CacheError):
    """The cache file exists but cannot be read (permissions, a symlink, an I/O error)."""


class JournalError(KvactorsError):
    """A journal that cannot be read at all (another format, no permission); it is left untouched.

    The agent it belongs to cannot work until the file is fixed or moved aside; other
    agents are not affected.
    """


class UnsafePath(KvactorsError, OSError):
    """A symlink inside the store: kvactors never follows one there. Remove the link."""


# ---------------------------------------------------------------- host tensors


@dataclass(frozen=True)
class HostCache:
    """A Q4 cache copied to host memory: plain numpy arrays, safe to hand to any thread.

    `tensors` maps `layers.<i>.<keys|values>.<packed|scales|biases>` to arrays of
    shape (1, kv_heads, length(i), ...): a bounded sliding layer keeps only the last
    `length(i)` of the `n_tokens` positions, every other layer all of them. Scales and biases in bfloat16 are held as their
    raw uint16 bits; `dtype` names the real activation dtype. Empty when n_tokens == 0.
    """

    tensors: dict
    dtype: str
    bits: int
    group_size: int
    n_layers: int
    n_tokens: int
    lengths: tuple = ()  # tokens stored per layer when some hold fewer (bounded sliding layers)

    def length(self, layer: int) -> int:
        """Tokens stored for `layer`: its last `length` positions of `n_tokens`."""
        return self.lengths[layer] if self.lengths else self.n_tokens

    @property
    def nbytes(self) -> int:
        """Bytes of all tensors."""
        return sum(a.nbytes for a in self.tensors.values())

    def rows(self, start: int = 0) -> HostCache:
        """The positions from `start` on (numpy views): per layer its last min(n_tokens - start, length) rows."""
        if not start:
            return self
        if not 0 < start < self.n_tokens:
            raise ValueError(f"cannot take rows from position {start} of {self.n_tokens} cached tokens")
        rows = [min(self.n_tokens - start, self.length(i)) for i in range(self.n_layers)]
        tensors = {}
        for i, n in enumerate(rows):
            stored = self.length(i)
            for name in _layer_names(i):
                tensors[name] = self.tensors[name][..., stored - n:, :]
        return replace(self, tensors=tensors, lengths=tuple(rows))


@dataclass(frozen=True)
class CacheMeta:
    """What the cached tokens are: `token_ids`, the `text` they spell, where each ends.

    `seq` is the agent's turn sequence number the cache reflects (the journal record
    with the same seq is the last one included); `token_ends` as in the module doc.
    """

    seq: int
    token_ids: list
    token_ends: list
    text: str
    turn_id: str | None = None
    created: float = field(default=0.0, compare=False)
    fingerprint: str = field(default="", compare=False)  # set when loaded


def _name(layer: int, kind: str, part: str) -> str:
    return f"layers.{layer}.{kind}.{part}"


def _layer_names(layer: int) -> list[str]:
    """The six tensor names of `layer`: keys and values, each packed, scales and biases."""
    return [_name(layer, kind, part) for kind in ("keys", "values") for part in _PARTS]


def cache_to_host(cache, start: int = 0) -> HostCache:
    """Copy a per-layer list of evaluated `QuantizedKVCache` to a `HostCache`.

    Copies the positions from `start` on (0: all): per layer the last
    min(n_tokens - start, stored) rows, so the result is the delta `next_segment`
    writes. Reads only evaluated arrays (building one `view` per bfloat16 array on the
    calling thread, evaluated there), so any thread may call it. Tokens beyond `offset`
    are dropped. Raises ValueError for layers that disagree in bits, group, length or
    dtype, or a `start` outside [0, n_tokens).
    """
    import mlx.core as mx

    n_tokens, bits, group_size, stored = _layers(cache)
    if start and not 0 < start < n_tokens:
        raise ValueError(f"cannot copy from position {start} of {n_tokens} cached tokens")
    arrays, dtype, lengths = {}, "float32", []
    for i, layer in enumerate(cache if n_tokens else ()):
        rows = min(n_tokens - start, stored[i])
        lengths.append(rows)
        for kind, packed in (("keys", layer.keys), ("values", layer.values)):
            dtype = str(packed[1].dtype).removeprefix("mlx.core.")
            for part, x in zip(_PARTS, packed):
                if (stored[i] - rows, stored[i]) != (0, x.shape[-2]):
                    x = mx.contiguous(x[..., stored[i] - rows: stored[i], :])
                if x.dtype == mx.bfloat16:
                    x = x.view(mx.uint16)
                arrays[_name(i, kind, part)] = x
    tensors = _to_numpy(arrays)
    lengths = () if all(n == n_tokens for n in lengths) else tuple(lengths)
    host = HostCache(tensors, dtype, bits, group_size, len(cache), n_tokens, lengths)
    _check_host(host)
    return host


def _to_numpy(arrays: dict) -> dict:
    """Evaluated copies of MLX `arrays` as numpy arrays, moved off the device in one piece.

    One evaluation and one transfer for all of them: each evaluation on the writer's
    thread waits for the device's queue (a decode step is usually in flight), and each
    transfer has its own fixed cost, so a 32-layer cache copied tensor by tensor
    (192 of each) took tens of milliseconds longer per write on an H100.
    """
    import mlx.core as mx

    if not arrays:
        return {}
    blob = mx.concatenate([x.reshape(-1).view(mx.uint8) for x in arrays.values()])
    mx.eval(blob)
    data = np.array(blob, copy=True)
    out, at = {}, 0
    for name, x in arrays.items():
        dtype = np.dtype(str(x.dtype).removeprefix("mlx.core."))
        out[name] = data[at: at + x.nbytes].view(dtype).reshape(x.shape)
        at += x.nbytes
    return out


def _layers(cache) -> tuple[int, int, int, list[int]]:
    """(n_tokens, bits, group_size, rows stored per layer) of a per-layer `QuantizedKVCache` list.

    Raises ValueError when layers disagree in bits, group or length.
    """
    from runtime.q4cache import stored_tokens

    first = cache[0]
    bits, group_size = first.bits, first.group_size
    n_tokens = 0 if first.keys is None else first.offset
    stored = []
    for i, layer in enumerate(cache):
        if (layer.bits, layer.group_size) != (bits, group_size):
            raise ValueError(f"layer {i} has bits/group {layer.bits}/{layer.group_size}, layer 0 {bits}/{group_size}")
        tokens = 0 if layer.keys is None else layer.offset
        if tokens != n_tokens:
            raise ValueError(f"layer {i} holds {tokens} tokens, layer 0 holds {n_tokens}")
        stored.append(stored_tokens(layer) if n_tokens else 0)
    return n_tokens, bits, group_size, stored


@dataclass(frozen=True)
class DeviceCache:
    """An evaluated per-layer `QuantizedKVCache` list kept on the device until it is written.

    It answers what `next_segment` asks (`n_tokens`, `n_layers`, `length(i)`,
    `nbytes`) without copying, and `rows(start)` copies only the positions from
    `start` on: a turn that continued the cache on disk moves just its new rows to
    the host, on the writer's thread. Make one with `on_device`; the arrays are
    MLX arrays, which never change.
    """

    layers: tuple
    n_tokens: int
    lengths: tuple
    nbytes: int

    @property
    def n_layers(self) -> int:
        """Number of layers."""
        return len(self.layers)

    def length(self, layer: int) -> int:
        """Tokens stored for `layer`: its last `length` positions of `n_tokens`."""
        return self.lengths[layer] if self.lengths else self.n_tokens

    def rows(self, start: int = 0) -> HostCache:
        """The positions from `start` on, copied to a `HostCache` (see `cache_to_host`)."""
        return cache_to_host(self.layers, start)


def on_device(cache) -> DeviceCache:
    """Wrap an evaluated per-layer `QuantizedKVCache` list for the persistence actor (no copy).

    Raises ValueError when its layers disagree in bits, group or length.
    """
    n_tokens, _, _, stored = _layers(cache)
    nbytes = sum(x.nbytes * n // max(x.shape[-2], 1) for layer, n in zip(cache, stored) if n
                 for x in (*layer.keys, *layer.values))
    lengths = () if all(n == n_tokens for n in stored) else tuple(stored)
    return DeviceCache(tuple(cache), n_tokens, lengths, nbytes)


def host_to_cache(host: HostCache) -> list:
    """Build a per-layer list of `QuantizedKVCache` from `host`, evaluated on this thread.

    Arrays are exactly `n_tokens` long and `offset == n_tokens`; with no tokens each
    layer is an empty cache (`keys is None`).
    """
    import mlx.core as mx
    from mlx_lm.models.cache import QuantizedKVCache

    caches = [QuantizedKVCache(group_size=host.group_size, bits=host.bits) for _ in range(host.n_layers)]
    if host.n_tokens == 0:
        return caches
    for i, c in enumerate(caches):
        for kind in ("keys", "values"):
            arrays = []
            for part in _PARTS:
                a = mx.array(host.tensors[_name(i, kind, part)])
                if part != "packed" and host.dtype == "bfloat16":
                    a = a.view(mx.bfloat16)
                arrays.append(a)
            setattr(c, kind, tuple(arrays))
        c.offset = host.n_tokens
    mx.eval([(c.keys, c.values) for c in caches])
    return caches


def trim_host(host: HostCache, meta: CacheMeta, keep: int) -> tuple[HostCache, CacheMeta]:
    """Keep the first `keep` tokens of a loaded cache and its metadata (numpy views, no copy).

    The text is cut at the last recorded token end among the kept tokens; cut where
    `runtime.prefix.match_prefix` says (EXACT re-feeds its last token by id).
    """
    if not 0 <= keep <= host.n_tokens:
        raise ValueError(f"cannot keep {keep} of {host.n_tokens} tokens")
    if keep == host.n_tokens:
        return host, meta
    cut = host.n_tokens - keep  # positions dropped from the end, in every layer
    lengths = tuple(host.length(i) - cut for i in range(host.n_layers))
    if keep and min(lengths) <= 0:
        raise ValueError(f"a bounded sliding layer holds too few tokens to keep {keep}")
    tensors = {} if keep == 0 else {k: v[..., : lengths[int(k.split(".")[1])], :] for k, v in host.tensors.items()}
    end = max([0, *meta.token_ends[:keep]])
    trimmed = replace(host, tensors=tensors, n_tokens=keep, lengths=lengths if host.lengths and keep else ())
    ids, ends = meta.token_ids[:keep], meta.token_ends[:keep]
    return trimmed, replace(meta, token_ids=ids, token_ends=ends, text=meta.text[:end])


def trim_cache(cache, keep: int) -> list:
    """A new per-layer list of `QuantizedKVCache` holding the first `keep` positions of `cache`.

    The slices are evaluated before returning, on the calling thread; `cache` is unchanged.
    """
    import mlx.core as mx
    from mlx_lm.models.cache import QuantizedKVCache

    from runtime.q4cache import stored_tokens

    out = []
    for layer in cache:
        c = QuantizedKVCache(group_size=layer.group_size, bits=layer.bits)
        if keep > 0 and layer.keys is not None:
            positions = min(keep, layer.offset)
            n = stored_tokens(layer) - (layer.offset - positions)  # a bounded sliding layer stores its last positions
            if n <= 0:
                raise ValueError(f"a bounded sliding layer holds too few tokens to keep {keep}; see q4cache.can_trim")
            c.keys = tuple(mx.contiguous(x[..., :n, :]) for x in layer.keys)
            c.values = tuple(mx.contiguous(x[..., :n, :]) for x in layer.values)
            c.offset = positions
        out.append(c)
    mx.eval([(c.keys, c.values) for c in out if c.keys is not None])
    return out


def check_cache(cache: HostCache | DeviceCache, meta: CacheMeta) -> None:
    """Raise ValueError unless `cache` is consistent and `meta` describes its tokens.

    A `DeviceCache` was checked when `on_device` made it; a `HostCache` is checked here.
    """
    if isinstance(cache, HostCache):
        _check_host(cache)
    _check_meta(meta, cache.n_tokens)


def _check_host(host: HostCache) -> None:
    """Raise ValueError unless `host` is internally consistent (shapes, dtypes, names)."""
    if host.dtype not in _SCALE_HEADER:
        raise ValueError(f"unsupported scales dtype {host.dtype!r}")
    if 32 % host.bits:
        raise ValueError(f"unsupported bits {host.bits}")
    names = {name for i in range(host.n_layers) for name in _layer_names(i)}
    if host.n_tokens == 0:
        names = set()
    if set(host.tensors) != names:
        raise ValueError(f"tensors {sorted(set(host.tensors) ^ names)[:4]} missing or unexpected")
    if host.lengths and (len(host.lengths) != host.n_layers
                         or not all(0 < n <= host.n_tokens for n in host.lengths)):
        raise ValueError(f"stored lengths {list(host.lengths)[:4]} do not fit {host.n_layers} layers of {host.n_tokens} tokens")
    scale_np = _DTYPES[_SCALE_HEADER[host.dtype]][0]
    for name, a in host.tensors.items():
        want = np.uint32 if name.endswith("packed") else scale_np
        n = host.length(int(name.split(".")[1]))
        if a.dtype != want or a.ndim != 4 or a.shape[0] != 1 or a.shape[2] != n:
            raise ValueError(f"{name}: {a.dtype}{a.shape}, expected {np.dtype(want)} (1, H, {n}, D)")
    for i in range(host.n_layers if host.n_tokens else 0):
        for kind in ("keys", "values"):
            p, s, b = (host.tensors[_name(i, kind, part)] for part in _PARTS)
            dim = p.shape[-1] * 32 // host.bits
            if s.shape != b.shape or s.shape[:3] != p.shape[:3] or s.shape[-1] * host.group_size != dim:
                raise ValueError(f"layer {i} {kind}: packed {p.shape}, scales {s.shape}, biases {b.shape} disagree")


# ---------------------------------------------------------------- cache file format


def _crcs(arrays: list) -> list[int]:
    return [zlib.crc32(np.ascontiguousarray(a).data) for a in arrays]


def _checksum(meta_json: str, tensors: dict, dtypes: dict) -> str:
    """crc32 over the meta string and each tensor's name, dtype, shape and crc32 (in name order).

    Tensor crcs run in threads (zlib releases the GIL) once there is enough data to pay.
    """
    names = sorted(tensors)
    arrays = [tensors[n] for n in names]
    k = min(8, os.cpu_count() or 1, len(arrays))
    if k > 1 and sum(a.nbytes for a in arrays) >= _PARALLEL_CRC_BYTES:
        crcs = [0] * len(arrays)
        with ThreadPoolExecutor(k) as pool:
            for i, part in enumerate(pool.map(_crcs, [arrays[i::k] for i in range(k)])):
                crcs[i::k] = part
    else:
        crcs = _crcs(arrays)
    crc = zlib.crc32(meta_json.encode())
    for name, a, c in zip(names, arrays, crcs):
        crc = zlib.crc32(f"{name}:{dtypes[name]}:{list(a.shape)}:{c:08x}".encode(), crc)
    return f"crc32:{crc:08x}"


def _header_dtype(name: str, host: HostCache) -> str:
    return "U32" if name.endswith("packed") else _SCALE_HEADER[host.dtype]


def _check_meta(meta: CacheMeta, n_tokens: int) -> None:
    ids, ends = meta.token_ids, meta.token_ends
    if len(ids) != n_tokens or len(ends) != n_tokens:
        raise ValueError(f"{len(ids)} token ids and {len(ends)} token ends for {n_tokens} cached tokens")
    last = 0
    for e in ends:
        if e >= 0:
            if e < last or e > len(meta.text):
                raise ValueError(f"token end {e} out of order or past the text ({len(meta.text)} chars)")
            last = e


def encode_cache(host: HostCache, meta: CacheMeta, fingerprint: str) -> bytes:
    """Serialize `host` and `meta` of the model `fingerprint` to the bytes of a cache file.

    Raises ValueError when `host` or `meta` is inconsistent (lengths, shapes, dtypes).
    """
    return _encode(host, meta, fingerprint)[0]


def _encode(host: HostCache, meta: CacheMeta, fingerprint: str, delta: dict | None = None) -> tuple[bytes, str]:
    """(file bytes, checksum) of `host` + `meta`; `delta` (a delta file's link) goes into the meta."""
    check_cache(host, meta)
    meta_json = json.dumps(
        {
            "fingerprint": fingerprint,
            "kv_bits": host.bits,
            "kv_group_size": host.group_size,
            "dtype": host.dtype,
            "n_layers": host.n_layers,
            "n_tokens": host.n_tokens,
            "lengths": list(host.lengths),
            "seq": int(meta.seq),
            "turn_id": meta.turn_id,
            "text": meta.text,
            "token_ids": [int(t) for t in meta.token_ids],
            "token_ends": [int(e) for e in meta.token_ends],
            "created": meta.created or time.time(),
            **({"delta": delta} if delta is not None else {}),
        },
        separators=(",", ":"),
    )
    tensors = {k: np.ascontiguousarray(v) for k, v in host.tensors.items()}
    dtypes = {k: _header_dtype(k, host) for k in tensors}
    specs = {
        k: TensorSpec(dtype=_DTYPES[dtypes[k]][1], shape=list(a.shape), data_ptr=a.ctypes.data, data_len=a.nbytes)
        for k, a in tensors.items()
    }
    checksum = _checksum(meta_json, tensors, dtypes)
    header = {"format": FORMAT, "format_version": str(FORMAT_VERSION), "meta": meta_json, "checksum": checksum}
    return serialize(specs, header), checksum  # `tensors` keeps the buffers alive until here


def decode_cache(data, spec=None) -> tuple[HostCache, CacheMeta]:
    """Parse and validate the bytes of a cache file; return (HostCache, CacheMeta).

    The arrays are numpy views into `data`. With `spec` (a ModelCacheSpec or anything
    with its attributes) the file is also checked against the model: fingerprint, bits
    and group, layers, heads, head dims and (if the spec has one) dtype. Raises
    TruncatedCache, CorruptCache, UnsupportedVersion, ChecksumMismatch, ForeignModel,
    QuantizationMismatch or ShapeMismatch.
    """
    return _decode(data, spec)[:2]


def _decode(data, spec=None) -> tuple[HostCache, CacheMeta, str, dict | None]:
    """`decode_cache`, plus the file's checksum and its delta link (None: a full cache file)."""
    header, body = _parse_safetensors(data)
    info = header.pop("__metadata__", None)
    if not isinstance(info, dict) or info.get("format") != FORMAT:
        raise CorruptCache("not a kvactors cache file (no kvactors format tag in the header)")
    if info.get("format_version") != str(FORMAT_VERSION):
        raise UnsupportedVersion(
            f"cache format version {info.get('format_version')!r}, this kvactors reads version "
            f"{FORMAT_VERSION}; the agent re-prefills from its journal (upgrade kvactors to reuse it)"
        )
    try:
        m = json.loads(info["meta"])
        tensors = {k: _tensor(body, v) for k, v in header.items()}
        dtypes = {k: v["dtype"] for k, v in header.items()}
        host = HostCache(
            tensors, m["dtype"], int(m["kv_bits"]), int(m["kv_group_size"]), int(m["n_layers"]), int(m["n_tokens"]),
            tuple(int(n) for n in m.get("lengths", ())),
        )
        meta = CacheMeta(
            int(m["seq"]), list(m["token_ids"]), list(m["token_ends"]), str(m["text"]),
            m["turn_id"], float(m["created"]), str(m["fingerprint"]),
        )
        checksum = info["checksum"]
        delta = m.get("delta")
    except (KeyError, TypeError, ValueError) as e:
        raise CorruptCache(f"cache header is damaged ({type(e).__name__}: {e})") from e
    if _checksum(info["meta"], tensors, dtypes) != checksum:
        raise ChecksumMismatch("cache contents do not match their checksum: the file is damaged")
    try:
        _check_host(host)
        _check_meta(meta, host.n_tokens)
    except ValueError as e:
        raise CorruptCache(f"cache file is inconsistent: {e}") from e
    if spec is not None:
        _check_spec(host, meta.fingerprint, spec)
    return host, meta, checksum, delta


def _parse_safetensors(data) -> tuple[dict, memoryview]:
    """Split a safetensors file into its JSON header and its data; strict about sizes."""
    view = memoryview(data)
    if len(view) < 8:
        raise TruncatedCache(f"cache file is {len(view)} bytes: it was cut short")
    n = int.from_bytes(view[:8], "little")
    if n == 0 or n > MAX_HEADER:
        raise CorruptCache(f"header length {n} is not plausible: not a safetensors file")
    if 8 + n > len(view):
        raise TruncatedCache(f"cache file is {len(view)} bytes but its header alone needs {8 + n}: it was cut short")
    try:
        header = json.loads(bytes(view[8 : 8 + n]))
        if not isinstance(header, dict):
            raise ValueError("header is not an object")
        end = 0
        tensors = sorted((t["data_offsets"], name, t) for name, t in header.items() if name != "__metadata__")
        for _, name, t in tensors:
            start, stop = t["data_offsets"]
            size = int(np.prod(t["shape"], dtype=np.int64)) * np.dtype(_DTYPES[t["dtype"]][0]).itemsize
            if start != end or stop - start != size:
                raise ValueError(f"tensor {name} spans bytes {start}..{stop}, expected {end}..{end + size}")
            end = stop
    except (KeyError, TypeError, ValueError, UnicodeDecodeError) as e:
        raise CorruptCache(f"cache header is damaged ({type(e).__name__}: {e})") from e
    if 8 + n + end > len(view):
        raise TruncatedCache(f"cache file is {len(view)} bytes, its header announces {8 + n + end}: it was cut short")
    if 8 + n + end < len(view):
        raise CorruptCache(f"cache file has {len(view) - 8 - n - end} bytes of trailing garbage")
    return header, view[8 + n :]


def _tensor(body: memoryview, t: dict) -> np.ndarray:
    start, stop = t["data_offsets"]
    np_dtype = _DTYPES[t["dtype"]][0]
    return np.frombuffer(body[start:stop], dtype=np_dtype).reshape(t["shape"])


def _check_spec(host: HostCache, fingerprint: str, spec) -> None:
    if fingerprint != spec.fingerprint:
        raise ForeignModel(
            f"cache was made by model {fingerprint}, the runtime runs {spec.fingerprint}; "
            "it cannot be reused, the agent re-prefills from its journal"
        )
    if (host.bits, host.group_size) != (spec.kv_bits, spec.kv_group_size):
        raise QuantizationMismatch(
            f"cache is {host.bits}-bit with group {host.group_size}, the runtime uses {spec.kv_bits}-bit "
            f"with group {spec.kv_group_size}; the agent re-prefills from its journal"
        )
    problems = []
    if host.n_layers != spec.n_layers:
        problems.append(f"{host.n_layers} layers, the model has {spec.n_layers}")
    spec_dtype = getattr(spec, "dtype", None)
    if host.n_tokens and isinstance(spec_dtype, str) and spec_dtype != host.dtype:
        problems.append(f"scales in {host.dtype}, the model computes in {spec_dtype}")
    windows = getattr(spec, "windows", None) or (None,) * spec.n_layers
    for i in range(min(host.n_layers, spec.n_layers) if host.n_tokens else 0):
        window, n = windows[i], host.length(i)
        if n < (host.n_tokens if window is None else min(host.n_tokens, window)):
            problems.append(f"layer {i} holds {n} of {host.n_tokens} tokens, its attention needs more")
        for kind, dim in (("keys", spec.k_head_dim), ("values", spec.v_head_dim)):
            want = (1, spec.n_kv_heads, n, dim * host.bits // 32)
            got = host.tensors[_name(i, kind, "packed")].shape
            if tuple(got) != want:
                problems.append(f"layer {i} {kind} packed {tuple(got)}, expected {want}")
    if problems:
        raise ShapeMismatch(
            "cache does not fit the model: " + "; ".join(problems[:3]) + "; the agent re-prefills from its journal"
        )


# ---------------------------------------------------------------- paths and atomic writes


def check_agent_id(agent: str) -> str:
    """Return `agent` if it is a valid id (`[A-Za-z0-9][A-Za-z0-9._-]{0,127}`), else raise InvalidAgentId."""
    if not isinstance(agent, str) or not AGENT_ID.fullmatch(agent):
        raise InvalidAgentId(
            f"invalid agent id {agent!r}: use 1-128 characters from A-Z a-z 0-9 . _ -, starting with a letter or digit"
        )
    return agent


def agent_dir(cache_dir, fingerprint: str, agent: str) -> Path:
    """The folder of `agent`'s files under model `fingerprint` (validates both; creates nothing)."""
    if not isinstance(fingerprint, str) or not re.fullmatch(r"[A-Za-z0-9_-]{1,128}", fingerprint):
        raise ValueError(f"invalid model fingerprint {fingerprint!r}")
    return Path(cache_dir).expanduser() / fingerprint / check_agent_id(agent)


class CacheDirInUse(KvactorsError, RuntimeError):
    """Another Runtime (in this or another process) is using the cache folder."""


def lock_cache_dir(cache_dir) -> int:
    """Take the exclusive lock of `cache_dir` (created 0700); return the fd that holds it.

    Two writers would interleave journal appends: a second Runtime on the same folder
    raises CacheDirInUse instead. The lock is on the folder itself, not on a file in
    it, so deleting files cannot release it. Release with `os.close(fd)`; a crash
    releases it too.
    """
    import fcntl

    root = Path(cache_dir).expanduser()
    root.mkdir(mode=0o700, parents=True, exist_ok=True)
    fd = os.open(root, os.O_RDONLY | os.O_DIRECTORY)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        raise CacheDirInUse(
            f"{root} is in use by another Runtime; shut that one down or use another cache_dir"
        ) from None
    return fd


def refuse_links(folder: Path) -> None:
    """Raise UnsafePath if the agent folder `folder` or its model folder is a symlink.

    `cache_dir` itself may be a link (the user's choice); nothing inside it may: files
    are opened with O_NOFOLLOW, folders are checked here.
    """
    for d in (folder.parent, folder):
        if d.is_symlink():
            raise UnsafePath(f"{d} is a symlink inside the store; kvactors never follows one there: remove it")


def make_dirs(folder: Path) -> None:
    """Create `folder` and its two parents (model folder, cache_dir) as needed, mode 0700.

    Raises UnsafePath if the model or agent folder is a symlink.
    """
    refuse_links(folder)
    for d in (folder.parent.parent, folder.parent, folder):
        if not d.is_dir():
            try:
                d.mkdir(mode=0o700, parents=True)
            except FileExistsError:
                if not d.is_dir():
                    raise
            os.chmod(d, 0o700)


def temp_path(path: Path) -> Path:
    """A fresh temp file name next to `path` (same folder, so the rename is atomic)."""
    return path.with_name(f".{path.name}.{os.getpid()}.{secrets.token_hex(4)}{_TMP_SUFFIX}")


def open_private(path, flags: int) -> int:
    """`os.open` that creates files with mode exactly 0600 (an `opener` for `open`)."""
    fd = os.open(path, flags, 0o600)
    if flags & os.O_CREAT:
        os.fchmod(fd, 0o600)
    return fd


def fsync_dir(folder) -> None:
    """fsync a folder, making renames and new files in it durable."""
    fd = os.open(folder, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_atomic(path: Path, data) -> None:
    """Replace `path` by `data`: temp file in the same folder, fsync, rename, fsync the folder."""
    tmp = temp_path(path)
    try:
        with open(tmp, "xb", opener=open_private) as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    fsync_dir(path.parent)


def remove_temps(folder: Path) -> None:
    """Delete temp files a crashed writer left in `folder` (one writer per folder)."""
    for p in folder.glob(f".*{_TMP_SUFFIX}"):
        p.unlink(missing_ok=True)


# ---------------------------------------------------------------- journal


def journal_record(
    seq: int, role: str, text: str, *, turn_id: str | None = None, sender: str | None = None, **extra
) -> dict:
    """A journal record (a plain dict, msgpack-ready) for one turn; `time` is now if not given."""
    record = {"seq": int(seq), "turn_id": turn_id, "role": role, "sender": sender, "text": text, "time": time.time()}
    record.update(extra)
    check_record(record)
    return record


def check_record(record: dict) -> None:
    """Raise ValueError unless `record` has an int `seq`, str `role` and str `text`."""
    if not isinstance(record, dict):
        raise ValueError(f"a journal record is a dict, got {type(record).__name__}")
    seq, role, text = record.get("seq"), record.get("role"), record.get("text")
    if not (isinstance(seq, int) and isinstance(role, str) and isinstance(text, str)):
        raise ValueError(f"journal record needs int seq, str role and str text: {record!r:.200}")


def encode_records(records) -> bytes:
    """The journal frames of `records` (each checked by `check_record`), ready to append."""
    out = bytearray()
    for r in records:
        check_record(r)
        payload = msgpack.packb(r, use_bin_type=True)
        out += _FRAME.pack(len(payload), zlib.crc32(payload)) + payload
    return bytes(out)


@dataclass(frozen=True)
class JournalScan:
    """What the bytes of a journal hold.

    `records`: every record whose frame checks, oldest first, seqs strictly rising;
    `frames`: their (start, stop) byte spans; `end`: where the last good frame ends
    (where the next append goes); `damaged`: (start, stop) spans between good frames
    that did not check (mid-file damage: records were lost there); `size`: bytes
    scanned. Bytes from `end` to `size` are a torn tail (an append cut short).
    """

    records: list
    frames: list
    end: int
    damaged: list
    size: int

    @property
    def last_seq(self) -> int:
        """The seq of the last good record, -1 if none."""
        return self.records[-1]["seq"] if self.records else -1

    @property
    def torn(self) -> int:
        """Bytes of the torn tail."""
        return self.size - self.end

    def losses(self) -> list[str]:
        """One line per damaged span: where, how many bytes, between which seqs records were lost."""
        out = []
        for start, stop in self.damaged:
            before = [r["seq"] for r, (_, e) in zip(self.records, self.frames) if e <= start]
            after = [r["seq"] for r, (s, _) in zip(self.records, self.frames) if s >= stop]
            between = f"after seq {before[-1] if before else 'start'} and before seq {after[0]}"
            out.append(f"bytes {start}..{stop} ({stop - start} B) unreadable: records {between} lost")
        return out


def _frame_at(view: memoryview, pos: int, after_seq: int):
    """(record, end) of a frame that checks at `pos` with a seq above `after_seq`, else None."""
    if pos + _FRAME.size > len(view):
        return None
    n, crc = _FRAME.unpack_from(view, pos)
    stop = pos + _FRAME.size + n
    if n == 0 or stop > len(view):
        return None
    payload = view[pos + _FRAME.size : stop]
    if zlib.crc32(payload) != crc:
        return None
    try:
        record = msgpack.unpackb(payload, raw=False)
        check_record(record)
    except (ValueError, TypeError, msgpack.UnpackException):
        return None
    return (record, stop) if record["seq"] > after_seq else None


def _resync(view: memoryview, pos: int, after_seq: int):
    """The first position from `pos` on where a good frame starts (a record is a msgpack map), or None."""
    for p in range(pos, len(view) - _FRAME.size):
        first = view[p + _FRAME.size]
        if (0x80 <= first <= 0x8F or first in (0xDE, 0xDF)) and _frame_at(view, p, after_seq) is not None:
            return p
    return None


def scan_journal(data) -> JournalScan:
    """Decode journal bytes, resynchronising on the length+CRC frames past damaged bytes.

    A damaged frame followed by good ones is mid-file damage: the good ones are kept
    and the span is reported in `damaged`; a damaged or incomplete frame with no good
    one after it is the torn tail. Raises JournalError if `data` does not start with
    JOURNAL_MAGIC (empty, or a prefix of the magic, is a journal whose creation was cut short).
    """
    view = memoryview(data)
    if len(view) < len(JOURNAL_MAGIC):
        if bytes(view) != JOURNAL_MAGIC[: len(view)]:
            raise JournalError("not a kvactors journal (bad magic bytes); it is left untouched: move it aside")
        return JournalScan([], [], 0, [], len(view))  # creation was cut short: nothing was ever recorded
    if bytes(view[: len(JOURNAL_MAGIC)]) != JOURNAL_MAGIC:
        raise JournalError("not a kvactors journal, or a newer journal version; it is left untouched: move it aside")
    records, frames, damaged, pos = [], [], [], len(JOURNAL_MAGIC)
    while pos < len(view):
        found = _frame_at(view, pos, records[-1]["seq"] if records else -1)
        if found is None:
            nxt = _resync(view, pos + 1, records[-1]["seq"] if records else -1)
            if nxt is None:
                break  # a torn tail
            damaged.append((pos, nxt))
            pos = nxt
            continue
        record, stop = found
        records.append(record)
        frames.append((pos, stop))
        pos = stop
    return JournalScan(records, frames, pos, damaged, len(view))


def parse_journal(data) -> tuple[list, int]:
    """Decode journal bytes; return (records, end of the last good frame). See `scan_journal`."""
    scan = scan_journal(data)
    return scan.records, scan.end


def read_journal_bytes(path: Path) -> bytes | None:
    """The bytes of the journal at `path`, None if there is none.

    Never follows a symlink. Raises JournalError (naming the file and what to do) when
    it exists but cannot be read: no permission, a folder, a link.
    """
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
    except FileNotFoundError:
        return None
    except OSError as e:
        raise JournalError(
            f"cannot read the journal {path}: {e.strerror or e}; fix its permissions or move it aside"
        ) from e
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise JournalError(f"the journal {path} is not a regular file; move it aside")
        with open(fd, "rb", closefd=False) as f:
            return f.read()
    except OSError as e:
        raise JournalError(f"cannot read the journal {path}: {e.strerror or e}; fix it or move it aside") from e
    finally:
        os.close(fd)


def read_journal(cache_dir, spec, agent: str) -> list:
    """All records of `agent`'s journal that check, oldest first ([] if none); see `scan_journal`."""
    folder = agent_dir(cache_dir, spec.fingerprint, agent)
    refuse_links(folder)
    data = read_journal_bytes(folder / JOURNAL_FILE)
    return [] if data is None else scan_journal(data).records


def current_conversation(records) -> list:
    """The records of the current conversation: from the last system record on (all if none).

    A system record starts a conversation; a reset writes a new one, so older
    records stay in the journal but are no longer part of the history.
    """
    starts = [i for i, r in enumerate(records) if r["role"] == "system"]
    return list(records[starts[-1]:] if starts else records)


@dataclass(frozen=True)
class StoredAgent:
    """What an agent folder holds, in brief (see `stored_agent`).

    `turns`: assistant replies in the current conversation (the history), None when the
    journal cannot be read. `system`: the current conversation's system prompt, None
    when it has no system record. `messages`: records in the current conversation
    (system record included). `cache`: whether a cache file is on disk ("warm").
    """

    name: str
    turns: int | None
    system: str | None
    messages: int
    cache: bool


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
    system = history[0]["text"] if history and history[0]["role"] == "system" else None
    turns = sum(r["role"] == "assistant" for r in history)
    return StoredAgent(folder.name, turns, system, len(history), cache)


def repair_journal(path: Path, scan: JournalScan) -> None:
    """Make the journal at `path` hold exactly the good frames of `scan`, keeping what it drops.

    Mid-file damage: the whole file is kept as `journal.damaged-<ns>` and the journal
    is rewritten (atomically) from its good frames. A torn tail alone is moved aside to
    `journal.torn-<ns>` and cut off. A journal cut short at creation gets its magic.
    """
    data = read_journal_bytes(path) or b""
    if scan.end < len(JOURNAL_MAGIC):
        if data:
            write_atomic(path.with_name(f"journal.torn-{time.time_ns()}"), data)
        write_atomic(path, JOURNAL_MAGIC)
    elif scan.damaged:
        write_atomic(path.with_name(f"journal.damaged-{time.time_ns()}"), data)
        write_atomic(path, JOURNAL_MAGIC + b"".join(data[a:b] for a, b in scan.frames))
    elif scan.torn:
        write_atomic(path.with_name(f"journal.torn-{time.time_ns()}"), data[scan.end :])
        fd = os.open(path, os.O_WRONLY | os.O_NOFOLLOW)
        try:
            os.ftruncate(fd, scan.end)
            os.fsync(fd)
        finally:
            os.close(fd)


def open_journal(folder: Path) -> tuple[JournalScan | None, int]:
    """Make `folder`'s journal ready for appends; return (its scan as found, the byte to append at).

    The scan is None when there was no journal. Creates the folders and an empty
    journal as needed, removes temp files of crashed writers, and repairs damage
    (`repair_journal`). Raises JournalError for a journal that cannot be read (it is
    left untouched) and UnsafePath for a symlink in the store.
    """
    make_dirs(folder)
    remove_temps(folder)
    path = folder / JOURNAL_FILE
    data = read_journal_bytes(path)
    if data is None:
        write_atomic(path, JOURNAL_MAGIC)
        return None, len(JOURNAL_MAGIC)
    scan = scan_journal(data)
    if scan.damaged or scan.torn or scan.end < len(JOURNAL_MAGIC):
        repair_journal(path, scan)
    return scan, len(JOURNAL_MAGIC) + sum(b - a for a, b in scan.frames)


_pwrite = os.pwrite  # the one call that puts journal bytes on disk (tests inject a full disk here)


def append_frames(path: Path, data: bytes, end: int) -> int:
    """Write the frames `data` at byte `end` of the journal at `path`, fsync; return the new end.

    All or nothing: on any failure (a full disk, an I/O error) the file is cut back to
    `end` and fsynced before the error is raised, so later appends follow the last good
    frame. If even that fails the error is raised as is: reopen the journal
    (`open_journal` repairs the tail) before appending again. Bytes past `end` (left by
    such a failure) are cut first. Never follows a symlink and never creates the file:
    a journal deleted underneath raises FileNotFoundError.
    """
    fd = os.open(path, os.O_WRONLY | os.O_NOFOLLOW)
    try:
        size = os.fstat(fd).st_size
        if size < end:
            raise JournalError(f"the journal {path} shrank underneath kvactors ({size} < {end} bytes): another writer?")
        try:
            if size > end:
                os.ftruncate(fd, end)
            at = 0
            while at < len(data):
                at += _pwrite(fd, data[at:], end + at)
            os.fsync(fd)
        except BaseException:
            os.ftruncate(fd, end)
            os.fsync(fd)
            raise
    finally:
        os.close(fd)
    return end + len(data)


def append_journal(cache_dir, spec, agent: str, records) -> list:
    """Durably append `records` to `agent`'s journal; return the records appended.

    Records whose seq is not above the journal's last seq are skipped (retries are
    idempotent). Creates and repairs the journal as `open_journal` does; a failed
    append leaves the journal as it was (`append_frames`).
    """
    folder = agent_dir(cache_dir, spec.fingerprint, agent)
    scan, end = open_journal(folder)
    last, new = -1 if scan is None else scan.last_seq, []
    for r in sorted(records, key=lambda r: r["seq"]):
        if r["seq"] > last:
            new.append(r)
            last = r["seq"]
    if new:
        append_frames(folder / JOURNAL_FILE, encode_records(new), end)
    return new


# ---------------------------------------------------------------- cache files


def save_cache(cache_dir, spec, agent: str, host: HostCache, meta: CacheMeta) -> Path:
    """Atomically write `agent`'s full cache (`host` + `meta`) for model `spec.fingerprint`; return its path.

    Any delta files of an older chain are removed.
    """
    folder = agent_dir(cache_dir, spec.fingerprint, agent)
    data = encode_cache(host, meta, spec.fingerprint)
    make_dirs(folder)
    path = folder / CACHE_FILE
    write_atomic(path, data)
    remove_deltas(folder)
    return path


def read_file(path: Path) -> bytearray:
    """The whole file at `path` in one buffer (one read, no extra copy)."""
    with open(os.open(path, os.O_RDONLY | os.O_NOFOLLOW), "rb", buffering=0) as f:
        size = os.fstat(f.fileno()).st_size
        buf = bytearray(size)
        view, got = memoryview(buf), 0
        while got < size:
            n = f.readinto(view[got:])
            if not n:
                break
            got += n
    return buf[:got] if got < size else buf


def map_file(path: Path):
    """The bytes of the file at `path`, memory-mapped read-only (no copy out of the page cache).

    The returned tensors of `decode_cache` are views into the mapping; it stays open
    while any of them is alive. Files are replaced by rename, never rewritten in
    place, so a mapping always sees one complete version.
    """
    with open(os.open(path, os.O_RDONLY | os.O_NOFOLLOW), "rb") as f:
        if os.fstat(f.fileno()).st_size == 0:
            return b""
        return memoryview(mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ))


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
    path = folder / CACHE_FILE
    try:
        refuse_links(folder)
        data = map_file(path)
    except FileNotFoundError:
        raise CacheMissing(f"no cache for agent {folder.name!r} under {folder}: cold start") from None
    except OSError as e:
        raise UnreadableCache(f"cannot read {path}: {e}; the agent re-prefills from its journal") from e
    try:
        host, meta, checksum, _ = _decode(data)
        chain = _Chain(host)
        for k in range(1, MAX_DELTAS + 1):
            try:
                delta, delta_meta, delta_sum, link = _decode(map_file(folder / DELTA_FILE.format(k)))
                if not link or link.get("parent") != checksum:
                    break
                chain.apply(delta, link)
            except (OSError, CacheError):
                break
            meta, checksum = delta_meta, delta_sum
        host = chain.host()
        if spec is not None:
            _check_spec(host, meta.fingerprint, spec)
    except CacheError as e:
        raise type(e)(f"{path}: {e}") from e
    return host, meta


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
        with open(os.open(path, os.O_RDONLY | os.O_NOFOLLOW), "rb") as f:
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
            data, checksum = _encode(delta, meta, fingerprint, link)
            k = last.deltas + 1
            seg = Segment(meta.seq, checksum, lengths, ids, k, last.base_bytes, last.delta_bytes + len(data))
            return DELTA_FILE.format(k), data, seg
    data, checksum = _encode(cache.rows(0), meta, fingerprint)
    return CACHE_FILE, data, Segment(meta.seq, checksum, lengths, ids, 0, len(data), 0)


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
        same = (delta.dtype, delta.bits, delta.group_size, delta.n_layers) == (base.dtype, base.bits, base.group_size, base.n_layers)
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
            for name in _layer_names(i):
                d, first = delta.tensors[name], self.pieces[name][0]
                if d.shape[:2] + d.shape[3:] != first.shape[:2] + first.shape[3:]:
                    raise CorruptCache(f"delta {name} has shape {d.shape}, the cache {first.shape}")
                pieces[name] = (_rows(self.pieces[name], kept - old, kept) if old > 0 else []) + [d]
        self.pieces, self.n, self.lengths = pieces, n, list(lengths)

    def host(self) -> HostCache:
        """The rebuilt cache (one concatenation per tensor)."""
        tensors = {name: parts[0] if len(parts) == 1 else np.concatenate(parts, axis=2) for name, parts in self.pieces.items()}
        lengths = () if all(x == self.n for x in self.lengths) else tuple(self.lengths)
        b = self.first
        return HostCache(tensors, b.dtype, b.bits, b.group_size, b.n_layers, self.n, lengths)


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


@dataclass(frozen=True)
class Loaded:
    """An agent's durable state: journal `records`, and its cache if usable.

    `host`/`meta` are None when there is no usable cache; `error` then says why
    (a CacheError; CacheMissing on a plain cold start). Re-prefill from `records`.
    `last_seq`: the highest seq the agent's files have used (the journal's last record,
    or a newer cache left by a damaged or deleted journal); new records must go above
    it, so no seq is ever used twice. `journal_error`: set (and `records` empty) when
    the journal cannot be read at all; the agent must not run until it is fixed.
    """

    records: list
    host: HostCache | None = None
    meta: CacheMeta | None = None
    error: CacheError | None = None
    last_seq: int = -1
    journal_error: JournalError | None = None


def load_agent(cache_dir, spec, agent: str) -> Loaded:
    """Load `agent`'s journal and, if usable, its cache; never raises for a bad cache.

    Raises InvalidAgentId for a bad id, and JournalError/OSError when the journal itself
    cannot be read (history must never be silently replaced by nothing).
    """
    records = read_journal(cache_dir, spec, agent)
    folder = agent_dir(cache_dir, spec.fingerprint, agent)
    last = max(records[-1]["seq"] if records else -1, cache_seq(folder) or -1)
    try:
        host, meta = load_cache(cache_dir, spec, agent)
    except CacheError as e:
        return Loaded(records, error=e, last_seq=last)
    return Loaded(records, host, meta, last_seq=last)


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
        ours = [folder / CACHE_FILE, *deltas, folder / JOURNAL_FILE, *folder.glob("journal.torn-*")]
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


# ---------------------------------------------------------------- inspect


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
            if meta.fingerprint != folder.parent.name:
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


def inspect_table(cache_dir) -> str:
    """A text table per model folder of `cache_dir`: agent, tokens, bytes on disk, last turn, health.

    Each table is titled `model <model id> (<fingerprint>)`, or just the fingerprint when
    the folder has no `model.json` (made before kvactors recorded it). Reads every file
    (checksums included); changes nothing.
    """
    root = Path(cache_dir).expanduser()
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


# ---------------------------------------------------------------- hot tier


def cache_nbytes(cache) -> int:
    """Bytes held by a per-layer list of QuantizedKVCache."""
    return sum(sum(x.nbytes for x in (*c.keys, *c.values)) for c in cache if c.keys is not None)


class HotCaches:
    """In-memory ("hot") caches under a byte budget; the least recently used drop to warm.

    Thread-safe. Holds the only runtime reference to each cache it keeps, so dropping
    one (eviction, `discard`) frees its memory. A dropped cache is "warm": the
    persistence actor already holds or wrote its host copy.
    """

    def __init__(self, budget_bytes: int):
        self.budget_bytes = budget_bytes
        self._caches: OrderedDict = OrderedDict()  # agent -> (cache, nbytes)
        self._lock = threading.Lock()
        self.nbytes = 0

    def put(self, agent: str, cache) -> list[str]:
        """Keep `cache` as `agent`'s hot cache; return the agents evicted to make room.

        A cache larger than the whole budget is not kept (`agent` is then in the result).
        """
        size = cache_nbytes(cache)
        with self._lock:
            self._drop(agent)
            self._caches[agent] = (cache, size)
            self.nbytes += size
            evicted = []
            while self.nbytes > self.budget_bytes and self._caches:
                victim = next(iter(self._caches))
                self._drop(victim)
                evicted.append(victim)
            return evicted

    def get(self, agent: str):
        """`agent`'s hot cache (now the most recently used), or None."""
        with self._lock:
            entry = self._caches.get(agent)
            if entry is None:
                return None
            self._caches.move_to_end(agent)
            return entry[0]

    def discard(self, agent: str) -> None:
        """Forget `agent`'s hot cache, if any (the agent went away)."""
        with self._lock:
            self._drop(agent)

    def __contains__(self, agent) -> bool:
        return agent in self._caches

    def __len__(self) -> int:
        return len(self._caches)

    def _drop(self, agent: str) -> None:
        entry = self._caches.pop(agent, None)
        if entry is not None:
            self.nbytes -= entry[1]
