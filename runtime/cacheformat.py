"""The cache file format: encoding, decoding, validation, and the errors of a cache that cannot be used.

`cache.safetensors` is a safetensors file (readable by the `safetensors` package): the
tensors of a `runtime.hostcache.HostCache`, moved as raw bits, back to back in name
order. The header's `__metadata__` holds `format` ("kvactors-q4-cache"),
`format_version` ("1"), `meta` (JSON: fingerprint (the `model_tag`), kv_bits (the keys'), kv_value_bits,
kv_group_size, kv_rotation (the `KVScheme`; a file without the last two is an unrotated
one of kv_bits for keys and values), dtype, n_layers, n_tokens, lengths, seq, turn_id,
text, spans (absent where not known), token_ids, token_ends, created, and in a delta file `delta`: see
`runtime.cachechain`) and `checksum` ("crc32:<hex>" over the meta string, then every
tensor's name, dtype, shape and crc32 of its bytes, in name order).

Decoding validates everything and raises one `CacheError` subclass per problem; the
caller falls back to re-prefilling from the journal.
"""

from __future__ import annotations

import json
import os
import threading
import time
import zlib
from array import array
from concurrent.futures import ThreadPoolExecutor

import numpy as np

from runtime.errors import KvactorsError
from runtime.hostcache import CacheMeta, HostCache, check_cache, tensor_name
from runtime.kvscheme import plain

FORMAT = "kvactors-q4-cache"
FORMAT_VERSION = 1
MAX_HEADER = 100 << 20  # the safetensors package's own limit
_PARALLEL_CRC_BYTES = 16 << 20

# safetensors header dtype -> numpy dtype that holds the bytes
_DTYPES = {"U32": np.uint32, "F32": np.float32, "F16": np.float16, "BF16": np.uint16}
_SCALE_HEADER = {"float32": "F32", "float16": "F16", "bfloat16": "BF16"}


class CacheError(KvactorsError, OSError):
    """A stored cache cannot be used; re-prefill the agent from its journal. An OSError: a file's problem."""


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
    """The cache was quantized under another KV scheme (bits, group size, rotation) than the runtime uses."""


class ShapeMismatch(CacheError):
    """The tensors' shapes or dtype contradict the model's cache spec."""


class UnreadableCache(CacheError):
    """The cache file exists but cannot be read (permissions, a symlink, an I/O error)."""


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


def encode_cache(host: HostCache, meta: CacheMeta, fingerprint: str) -> bytes:
    """Serialize `host` and `meta` of the model `fingerprint` to the bytes of a cache file.

    Raises ValueError when `host` or `meta` is inconsistent (lengths, shapes, dtypes).
    """
    return b"".join(encode_file(host, meta, fingerprint)[0])


def encode_file(host: HostCache, meta: CacheMeta, fingerprint: str, delta: dict | None = None) -> tuple[list, str]:
    """(file parts, checksum) of `host` + `meta`; `delta` (a delta file's link) goes into the meta.

    The parts are the file's bytes in order: the safetensors length and header, then
    one flat uint8 view per tensor (no copy of the tensors, which a writer hands to the
    OS as they are: one file's bytes built in memory first had held the GIL for the
    whole copy, 100 ms for a 186 MB cache, stopping the engine's thread). Write them
    with `files.write_atomic`; `b"".join(parts)` is the file. Raises ValueError as
    `encode_cache` does.
    """
    check_cache(host, meta)
    head = _json({
        "fingerprint": fingerprint,
        "kv_bits": host.scheme.key_bits,
        "kv_value_bits": host.scheme.value_bits,
        "kv_group_size": host.group_size,
        "kv_rotation": host.rotation,
        "dtype": host.dtype,
        "n_layers": host.n_layers,
        "n_tokens": host.n_tokens,
        "lengths": list(host.lengths),
        "seq": int(meta.seq),
        "turn_id": meta.turn_id,
        "text": meta.text,
        **({"spans": [list(s) for s in meta.spans]} if meta.spans is not None else {}),
    })
    tail = _json({"created": meta.created or time.time(), **({"delta": delta} if delta is not None else {})})
    # json.dumps of the whole dict, its two long lists of ints encoded apart (`_ints_json`)
    pieces = (f'{head[:-1]},"token_ids":', _ints_json(meta.token_ids), ',"token_ends":',
              _ints_json(meta.token_ends), f',{tail[1:]}')
    meta_json = "".join(pieces)
    tensors = {k: np.ascontiguousarray(v) for k, v in host.tensors.items()}
    dtypes = {k: _header_dtype(k, host) for k in tensors}
    checksum = _checksum(meta_json, tensors, dtypes)
    # the header holds the meta as a JSON string: escaped piece by piece, the lists of ints as they are (digits,
    # commas, brackets and minus signs escape to themselves), instead of scanning the whole text again
    meta_string = '"' + "".join(p if i % 2 else _json(p)[1:-1] for i, p in enumerate(pieces)) + '"'
    info = (f'{{"format":{_json(FORMAT)},"format_version":{_json(str(FORMAT_VERSION))},"meta":{meta_string},'
            f'"checksum":{_json(checksum)}}}')
    return _safetensors_parts(tensors, dtypes, info), checksum


def _json(value) -> str:
    return json.dumps(value, separators=(",", ":"))


_RECENT_LISTS = 16  # lists of ints whose JSON `_ints_json` may extend: two per agent, for the last 8 that wrote
_recent: list[tuple[array, str]] = []  # (values, their JSON), the newest first
_recent_lock = threading.Lock()


def _ints_json(values) -> str:
    """`values` (ints of any kind) as `json.dumps` writes a list of ints (no spaces), extending the text of
    a recent list that is a prefix of it.

    Every cache file carries the whole conversation's token ids and ends, and each turn adds a
    few hundred to thousands of them: encoding all of them at every write held the GIL (which
    the engine's thread waits for) for milliseconds, 3.9 ms a list at 32K tokens on CI's CPU
    (`benchmarks/write_gil.py`). The text is the same either way. The lists are kept as 8-byte
    ints, at most _RECENT_LISTS of them. Raises OverflowError for a value outside int64.
    """
    values = array("q", values)
    with _recent_lock:
        longest_first = sorted(_recent, key=lambda kt: -len(kt[0]))
    known, text = next(((k, t) for k, t in longest_first if _starts_with(values, k)), ((), "[]"))
    rest = values[len(known):]
    if rest:
        more = _json(rest.tolist())
        text = more if not known else f"{text[:-1]},{more[1:]}"
    with _recent_lock:
        others = [(k, t) for k, t in _recent if len(k) != len(values) or k != values]
        _recent[:] = [(values, text)] + others[: _RECENT_LISTS - 1]
    return text


def _starts_with(values: array, known: array) -> bool:
    """Whether `known` is a prefix of `values` (its ends compared first: most that are not differ there)."""
    n = len(known)
    return n <= len(values) and (n == 0 or (values[n - 1] == known[-1] and values[0] == known[0])) \
        and values[:n] == known


def parts_size(parts: list) -> int:
    """Bytes of a file given as `encode_file`'s parts."""
    return sum(memoryview(p).nbytes for p in parts)


def _safetensors_parts(tensors: dict, dtypes: dict, info_json: str) -> list:
    """A safetensors file as parts: header length (8 bytes, little-endian) and JSON header
    (`info_json`, a JSON object's text, as `__metadata__`, padded with spaces to a multiple of 8),
    then each tensor's bytes in name order."""
    names, header, at = sorted(tensors), {}, 0
    for name in names:
        a = tensors[name]
        header[name] = {"dtype": dtypes[name], "shape": list(a.shape), "data_offsets": [at, at + a.nbytes]}
        at += a.nbytes
    rest = _json(header)[1:]  # "}" alone when there are no tensors
    text = f'{{"__metadata__":{info_json}{"," if header else ""}{rest}'.encode()
    text += b" " * (-len(text) % 8)
    return [len(text).to_bytes(8, "little") + text] + [tensors[n].reshape(-1).view(np.uint8) for n in names]


def decode_cache(data, spec=None) -> tuple[HostCache, CacheMeta]:
    """Parse and validate the bytes of a cache file; return (HostCache, CacheMeta).

    The arrays are numpy views into `data`. With `spec` (a ModelCacheSpec or anything
    with its attributes) the file is also checked against the model: fingerprint, bits
    and group, layers, heads, head dims and (if the spec has one) dtype. Raises
    TruncatedCache, CorruptCache, UnsupportedVersion, ChecksumMismatch, ForeignModel,
    QuantizationMismatch or ShapeMismatch.
    """
    return decode_file(data, spec)[:2]


def decode_file(data, spec=None) -> tuple[HostCache, CacheMeta, str, dict | None]:
    """`decode_cache`, plus the file's checksum and its delta link (None: a full cache file); raises as it does."""
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
            tuple(int(n) for n in m.get("lengths", ())), int(m.get("kv_value_bits", m["kv_bits"])),
            str(m.get("kv_rotation", "none")),
        )
        meta = CacheMeta(
            int(m["seq"]), list(m["token_ids"]), list(m["token_ends"]), str(m["text"]),
            m["turn_id"], float(m["created"]), str(m["fingerprint"]),
            None if m.get("spans") is None else tuple(tuple(s) for s in m["spans"]),
        )
        checksum = info["checksum"]
        delta = m.get("delta")
    except (KeyError, TypeError, ValueError) as e:
        raise CorruptCache(f"cache header is damaged ({type(e).__name__}: {e})") from e
    if _checksum(info["meta"], tensors, dtypes) != checksum:
        raise ChecksumMismatch("cache contents do not match their checksum: the file is damaged")
    try:
        check_cache(host, meta)
    except ValueError as e:
        raise CorruptCache(f"cache file is inconsistent: {e}") from e
    if spec is not None:
        check_spec(host, meta.fingerprint, spec)
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
            size = int(np.prod(t["shape"], dtype=np.int64)) * np.dtype(_DTYPES[t["dtype"]]).itemsize
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
    np_dtype = _DTYPES[t["dtype"]]
    return np.frombuffer(body[start:stop], dtype=np_dtype).reshape(t["shape"])


def model_tag(spec) -> str:
    """What a cache written for `spec` names as its model: `<fingerprint>.<weights>`, or the fingerprint alone
    where the spec knows no weights' digest (`ModelCacheSpec.weights`), so that a model whose weights differ
    only where `model.fingerprint` does not sample them is not served another's caches."""
    weights = getattr(spec, "weights", "")
    return f"{spec.fingerprint}.{weights}" if weights else spec.fingerprint


def tag_fingerprint(tag: str) -> str:
    """The fingerprint in a `model_tag` (fingerprints never hold a dot)."""
    return tag.partition(".")[0]


def check_spec(host: HostCache, fingerprint: str, spec) -> None:
    """Raise ForeignModel, QuantizationMismatch or ShapeMismatch unless `host` (made by the model `fingerprint`
    names: a `model_tag`) fits `spec`."""
    tag = model_tag(spec)
    if fingerprint != tag:
        same = tag_fingerprint(fingerprint) == tag_fingerprint(tag)
        raise ForeignModel(
            f"cache was made by model {fingerprint}, the runtime runs {tag}"
            + (" (the same fingerprint: other weight bytes, or a cache written before whole weights were checked)"
               if same else "") + "; it cannot be reused, the agent re-prefills from its journal"
        )
    scheme = getattr(spec, "kv_scheme", None) or plain(spec.kv_bits, spec.kv_group_size)  # plain for bare specs
    if host.scheme != scheme:
        raise QuantizationMismatch(
            f"cache is stored as {host.scheme.name}, the runtime uses {scheme.name}; "
            "the agent re-prefills from its journal"
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
        for kind, dim, bits in (("keys", spec.k_head_dim, host.scheme.key_bits),
                                ("values", spec.v_head_dim, host.scheme.value_bits)):
            want = (1, spec.n_kv_heads, n, dim * bits // 32)
            got = host.tensors[tensor_name(i, kind, "packed")].shape
            if tuple(got) != want:
                problems.append(f"layer {i} {kind} packed {tuple(got)}, expected {want}")
    if problems:
        raise ShapeMismatch(
            "cache does not fit the model: " + "; ".join(problems[:3]) + "; the agent re-prefills from its journal"
        )
