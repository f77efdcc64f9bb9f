"""Host copies of Q4 caches: what the store writes and loads, apart from any file.

A `HostCache` holds a per-layer `QuantizedKVCache` list as numpy arrays (safe to
hand to any thread); a `DeviceCache` wraps an evaluated one without copying, until
the writer copies just the rows a file needs; `CacheMeta` says which tokens and text
the cache holds. Tensors, per layer i: `layers.<i>.{keys,values}.{packed,scales,biases}`
of shape (1, kv_heads, tokens, ...): packed words uint32, scales and biases in the
activation dtype (float32, float16, or bfloat16 held as its raw uint16 bits, so they
round-trip exactly). `token_ends[i]` is the character offset in `text` where token i's
text ends, or -1 when token i ends inside a character (its bytes are completed by a
later token): prefix matching only cuts where it is >= 0. `spans` are the [start, end)
ranges of message text in `text` (`runtime.chat.Rendered.spans`, the reply's own
included), tokenized as text while the rest is the chat template's: the same characters
as another rendering's are the same tokens only where both have the same spans.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field, replace

import numpy as np

from runtime.kvscheme import KVScheme

_PARTS = ("packed", "scales", "biases")
PIECE_BYTES = 8 << 20  # a cache leaves the device in copies of about this many bytes (`_to_numpy`)
# activation dtype -> numpy dtype that holds its scales and biases (bfloat16 as raw bits)
SCALE_DTYPES = {"float32": np.float32, "float16": np.float16, "bfloat16": np.uint16}


@dataclass(frozen=True)
class HostCache:
    """A Q4 cache copied to host memory: plain numpy arrays, safe to hand to any thread.

    `tensors` maps `layers.<i>.<keys|values>.<packed|scales|biases>` to arrays of
    shape (1, kv_heads, length(i), ...): a bounded sliding layer keeps only the last
    `length(i)` of the `n_tokens` positions, every other layer all of them. Scales and biases in bfloat16 are held as their
    raw uint16 bits; `dtype` names the real activation dtype. Empty when n_tokens == 0.
    The rows are stored under `scheme`: keys of `bits`, values of `value_bits` (None:
    `bits`), groups of `group_size`, `rotation`.
    """

    tensors: dict
    dtype: str
    bits: int
    group_size: int
    n_layers: int
    n_tokens: int
    lengths: tuple = ()  # tokens stored per layer when some hold fewer (bounded sliding layers)
    value_bits: int | None = None
    rotation: str = "none"

    @property
    def scheme(self) -> KVScheme:
        """The `KVScheme` the rows are stored under."""
        return KVScheme(self.bits, self.bits if self.value_bits is None else self.value_bits, self.group_size,
                        self.rotation)

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
            for name in layer_names(i):
                tensors[name] = self.tensors[name][..., stored - n:, :]
        return replace(self, tensors=tensors, lengths=tuple(rows))


@dataclass(frozen=True)
class CacheMeta:
    """What the cached tokens are: `token_ids`, the `text` they spell, where each ends.

    `seq` is the agent's turn sequence number the cache reflects (the journal record
    with the same seq is the last one included); `token_ends` and `spans` as in the module
    doc. `spans` is None where they are not known (a cache written before they were
    recorded, or a rendering whose message texts could not be told apart from the template's).
    """

    seq: int
    token_ids: list
    token_ends: list
    text: str
    turn_id: str | None = None
    created: float = field(default=0.0, compare=False)
    fingerprint: str = field(default="", compare=False)  # set when loaded
    spans: tuple | None = None


def tensor_name(layer: int, kind: str, part: str) -> str:
    """The name of one tensor: `layers.<layer>.<keys|values>.<packed|scales|biases>`."""
    return f"layers.{layer}.{kind}.{part}"


def layer_names(layer: int) -> list[str]:
    """The six tensor names of `layer`: keys and values, each packed, scales and biases."""
    return [tensor_name(layer, kind, part) for kind in ("keys", "values") for part in _PARTS]


def cache_to_host(cache, start: int = 0) -> HostCache:
    """Copy a per-layer list of evaluated `QuantizedKVCache` to a `HostCache`.

    Copies the positions from `start` on (0: all): per layer the last
    min(n_tokens - start, stored) rows, so the result is the delta `next_segment`
    writes. Reads only evaluated arrays (the slices, views and copies it builds are
    evaluated on the calling thread), so any thread may call it. Tokens beyond `offset`
    are dropped. Raises ValueError for layers that disagree in scheme, length or
    dtype, or a `start` outside [0, n_tokens).
    """
    from runtime.q4cache import held_row

    n_tokens, scheme, stored = _layers(cache)
    if start and not 0 < start < n_tokens:
        raise ValueError(f"cannot copy from position {start} of {n_tokens} cached tokens")
    dtype, lengths = "float32", []
    table = _name_table(len(cache))[0]
    held = held_row(cache) if n_tokens else None
    if held is not None:  # every layer a view of one row's six arrays, holding the same tokens
        row, tokens = held
        lengths = [min(n_tokens - start, tokens)] * len(cache)
        dtype = str(row.arrays[1].dtype).removeprefix("mlx.core.")
        tensors = _held_to_numpy(row, tokens, lengths[0], table)
    else:
        arrays = {}
        for i, layer in enumerate(cache if n_tokens else ()):
            rows = min(n_tokens - start, stored[i])
            lengths.append(rows)
            dtype = str(layer.keys[1].dtype).removeprefix("mlx.core.")
            for name, x in zip(table[i], (*layer.keys, *layer.values)):
                if (stored[i] - rows, stored[i]) != (0, x.shape[-2]):
                    x = x[..., stored[i] - rows: stored[i], :]  # a view: `_to_numpy` copies it when it flattens it
                arrays[name] = x
        tensors = _to_numpy(arrays)
    lengths = () if all(n == n_tokens for n in lengths) else tuple(lengths)
    host = HostCache(tensors, dtype, scheme.key_bits, scheme.group_size, len(cache), n_tokens, lengths,
                     scheme.value_bits, scheme.rotation)
    _check_host(host)
    return host


def _held_to_numpy(row, tokens: int, rows: int, table) -> dict:
    """Each layer's six tensors (names `table`) of a cache every layer of which is a view of `HeldRow` `row`,
    holding `tokens` columns: the last `rows` of them, as numpy views of copies of the row's six arrays.

    The arrays leave the device a range of layers at a time (each range's six slices about PIECE_BYTES, as
    `_to_numpy` moves them): a copy of the 8B shape's 32 layers builds, evaluates and flattens six slices a
    piece rather than one per tensor (192), host work the writer does beside the engine's next turn. Called
    after `q4cache.held_row`, which made the row's views (see `q4cache.HeldRow`).
    """
    layer_bytes = sum(x.nbytes // (x.shape[0] * max(x.shape[2], 1)) for x in row.arrays) * rows
    per = max(1, PIECE_BYTES // max(layer_bytes, 1))  # layers a piece
    columns = slice(tokens - rows, tokens)
    flat = _to_numpy({(j, a): x[a: a + per, :, columns] for a in range(0, len(table), per)
                      for j, x in enumerate(row.arrays)})
    return {name: flat[j, i - i % per][i % per: i % per + 1]
            for i, names in enumerate(table) for j, name in enumerate(names)}


def _to_numpy(arrays: dict) -> dict:
    """Evaluated copies of MLX `arrays` as numpy arrays, moved off the device in pieces of about PIECE_BYTES.

    Each piece is gathered into one buffer on a stream of the copying thread's own
    (`q4cache.side_stream`), so it does not wait behind the engine's queued steps, and moved
    to the host without the GIL (`_piece_to_host`: on CUDA by the copy engine, else by
    an operation on MLX's CPU stream inside the evaluation); numpy then views the
    result. Asked for the buffer of a device array, MLX-CUDA would make that transfer
    inside numpy's request with the GIL held, stopping every other Python thread (the
    engine's included) for as long; its CPU stream reads a device buffer by moving it
    into fresh managed memory, at 0.55-0.7x the copy engine's rate on an H100
    (`benchmarks/copy_interference.py`).

    The pieces are evaluated one at a time. Evaluated together, the copy of a whole
    cache held back the engine's work until it ended: on an H100 a hot turn asked right
    after a 16K-token cold turn took 0.29 s (its cache of 740 MB being copied) against
    0.03 s one piece at a time, which costs the copy about half its rate
    (`benchmarks/copy_interference.py`). Few pieces: each has its own fixed cost, so a
    32-layer cache copied tensor by tensor (192 of each) took tens of milliseconds
    longer per write on an H100. Pieces also bound the extra device memory a copy takes.
    """
    import mlx.core as mx

    from runtime.q4cache import side_stream

    groups, size = [[]], 0
    for name, x in arrays.items():
        if groups[-1] and size + x.nbytes > PIECE_BYTES:
            groups.append([])
            size = 0
        groups[-1].append(name)
        size += x.nbytes
    stream = side_stream()
    out = {}
    for group in groups:
        if not group:
            continue
        gathered = mx.concatenate([arrays[n].reshape(-1).view(mx.uint8) for n in group], stream=stream)
        data = _piece_to_host(gathered, stream)
        at = 0
        for name in group:
            x = arrays[name]
            out[name] = data[at: at + x.nbytes].view(_numpy_dtype(x.dtype)).reshape(x.shape)
            at += x.nbytes
    return out


_NUMPY_DTYPES = {}  # MLX dtype -> the numpy dtype its bytes are viewed as


def _numpy_dtype(dtype) -> np.dtype:
    """The numpy dtype that views an MLX array's bytes of `dtype`: a scale dtype as SCALE_DTYPES stores it
    (bfloat16 as uint16: numpy has none), any other by its name."""
    found = _NUMPY_DTYPES.get(dtype)
    if found is None:
        name = str(dtype).removeprefix("mlx.core.")
        found = _NUMPY_DTYPES[dtype] = np.dtype(SCALE_DTYPES.get(name, name))
    return found


def _piece_to_host(gathered, stream) -> np.ndarray:
    """The bytes of 1-D uint8 array `gathered` (built on `stream`) on the host, moved without the GIL:
    on CUDA by the copy engine, elsewhere by an operation on MLX's CPU stream."""
    import mlx.core as mx

    from runtime import cudacopy

    if stream.device == mx.gpu and cudacopy.available():
        return cudacopy.to_host(gathered, stream)
    blob = mx.add(gathered, mx.array(0, mx.uint8), stream=mx.cpu)
    mx.eval(blob)
    return np.asarray(blob)


def _layers(cache) -> tuple[int, KVScheme, list[int]]:
    """(n_tokens, scheme, rows stored per layer) of a per-layer `QuantizedKVCache` list.

    Raises ValueError when layers disagree in scheme or length.
    """
    from runtime.q4cache import scheme_of, stored_tokens

    first = cache[0]
    scheme = scheme_of(first)
    n_tokens = 0 if first.keys is None else first.offset
    stored = []
    for i, layer in enumerate(cache):
        if scheme_of(layer) != scheme:
            raise ValueError(f"layer {i} is stored as {scheme_of(layer).name}, layer 0 as {scheme.name}")
        tokens = 0 if layer.keys is None else layer.offset
        if tokens != n_tokens:
            raise ValueError(f"layer {i} holds {tokens} tokens, layer 0 holds {n_tokens}")
        stored.append(stored_tokens(layer) if n_tokens else 0)
    return n_tokens, scheme, stored


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

    Raises ValueError when its layers disagree in scheme or length.
    """
    n_tokens, _, stored = _layers(cache)
    nbytes = sum(x.nbytes * n // max(x.shape[-2], 1) for layer, n in zip(cache, stored) if n
                 for x in (*layer.keys, *layer.values))
    lengths = () if all(n == n_tokens for n in stored) else tuple(stored)
    return DeviceCache(tuple(cache), n_tokens, lengths, nbytes)


def host_to_cache(host: HostCache) -> list:
    """Build a per-layer list of `QuantizedKVCache` from `host`, evaluated on this thread.

    Arrays are exactly `n_tokens` long and `offset == n_tokens`; with no tokens each
    layer is an empty cache (`keys is None`). On CUDA the bytes cross by the copy engine into
    device memory without the GIL (`_to_device`); elsewhere through `mx.array`.
    """
    import mlx.core as mx

    from runtime.q4cache import layer_cache

    caches = [layer_cache(host.scheme) for _ in range(host.n_layers)]
    if host.n_tokens == 0:
        return caches
    names = [tensor_name(i, kind, part) for i in range(host.n_layers) for kind in ("keys", "values") for part in _PARTS]
    arrays = iter(_to_device(host, names))
    for c in caches:
        for kind in ("keys", "values"):
            setattr(c, kind, tuple(next(arrays) for _ in _PARTS))
        c.offset = host.n_tokens
    mx.eval([(c.keys, c.values) for c in caches])
    return caches


def _to_device(host: HostCache, names: list) -> list:
    """MLX arrays of `host.tensors[name]` for `names` (scales and biases in `host.dtype`), not yet evaluated.

    On CUDA the copy engine fills device buffers (`cudacopy.to_device`, allocated on this
    thread's side stream, `q4cache.side_stream`; one per `cudacopy.MAX_BYTES`), and each array is a view of one:
    `mx.array` from numpy would copy into fresh managed memory a tensor at a time with the
    GIL held (an agent reloading a 16K-token cache held it for tens of milliseconds,
    stopping the engine's thread) and the GPU's first read would then migrate the pages.
    """
    import mlx.core as mx

    from runtime import cudacopy
    from runtime.q4cache import side_stream

    def dtype(name, a):
        return mx.bfloat16 if host.dtype == "bfloat16" and not name.endswith(".packed") else getattr(mx, a.dtype.name)

    tensors = [host.tensors[n] for n in names]
    stream = side_stream()
    if stream.device == mx.gpu and cudacopy.available():
        out = [None] * len(tensors)
        for group in cudacopy.groups([a.nbytes for a in tensors]):
            blob, offsets = cudacopy.to_device([tensors[i] for i in group], stream)
            with mx.stream(stream):  # views, no copies: their evaluation waits for nothing the engine queued
                for i, o in zip(group, offsets):
                    a = tensors[i]
                    out[i] = blob[o: o + a.nbytes].view(dtype(names[i], a)).reshape(a.shape)
        return out
    out = [mx.array(a) for a in tensors]
    return [x if x.dtype == dtype(n, a) else x.view(dtype(n, a)) for n, a, x in zip(names, tensors, out)]


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
    spans = cut_spans(meta.spans, end)
    return trimmed, replace(meta, token_ids=ids, token_ends=ends, text=meta.text[:end], spans=spans)


def cut_spans(spans, end: int) -> tuple | None:
    """`spans` (None: unknown) of a text cut at offset `end`: those that start before it, ending by it."""
    return None if spans is None else tuple((a, min(b, end)) for a, b in spans if a < end)


def trim_cache(cache, keep: int) -> list:
    """A new per-layer list of `QuantizedKVCache` holding the first `keep` positions of `cache`.

    The slices are evaluated before returning, on the calling thread; `cache` is unchanged.
    """
    import mlx.core as mx

    from runtime.q4cache import layer_cache, scheme_of, stored_tokens

    out = []
    for layer in cache:
        c = layer_cache(scheme_of(layer))
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
    """Raise ValueError unless `host` is internally consistent (shapes, dtypes, names).

    Every cache write checks its host cache (`cacheformat.encode_file`), on a thread that
    shares the GIL with the engine's: the names come from a table made once per layer count.
    """
    if host.dtype not in SCALE_DTYPES:
        raise ValueError(f"unsupported scales dtype {host.dtype!r}")
    try:
        scheme = host.scheme
    except ValueError as e:
        raise ValueError(f"unsupported quantization: {e}") from e
    table, names = _name_table(host.n_layers if host.n_tokens else 0)
    if host.tensors.keys() != names:
        raise ValueError(f"tensors {sorted(set(host.tensors) ^ names)[:4]} missing or unexpected")
    if host.lengths and (len(host.lengths) != host.n_layers
                         or not all(0 < n <= host.n_tokens for n in host.lengths)):
        raise ValueError(f"stored lengths {list(host.lengths)[:4]} do not fit {host.n_layers} layers of {host.n_tokens} tokens")
    scale_np = np.dtype(SCALE_DTYPES[host.dtype])
    for i, layer in enumerate(table):
        n = host.length(i)
        for kind, bits, tensor_names in (("keys", scheme.key_bits, layer[:3]), ("values", scheme.value_bits, layer[3:])):
            p, s, b = (host.tensors[name] for name in tensor_names)
            for name, a, want in zip(tensor_names, (p, s, b), (_UINT32, scale_np, scale_np)):
                if a.dtype != want or a.ndim != 4 or a.shape[0] != 1 or a.shape[2] != n:
                    raise ValueError(f"{name}: {a.dtype}{a.shape}, expected {want} (1, H, {n}, D)")
            dim = p.shape[-1] * 32 // bits
            if s.shape != b.shape or s.shape[:3] != p.shape[:3] or s.shape[-1] * host.group_size != dim:
                raise ValueError(f"layer {i} {kind}: packed {p.shape}, scales {s.shape}, biases {b.shape} disagree")


_UINT32 = np.dtype(np.uint32)


@functools.lru_cache(maxsize=8)
def _name_table(n_layers: int) -> tuple[tuple[tuple[str, ...], ...], frozenset]:
    """(each layer's six tensor names, all of them as a set) for `n_layers` layers."""
    table = tuple(tuple(layer_names(i)) for i in range(n_layers))
    return table, frozenset(name for layer in table for name in layer)


def _check_meta(meta: CacheMeta, n_tokens: int) -> None:
    """Raise ValueError unless `meta` has `n_tokens` ids and ends, its ends (those >= 0) in order and within its text,
    and its spans (if known) non-empty, in order and within its text.

    In numpy: every cache write checks the whole conversation's ends, and a Python loop
    over them held the GIL (which the engine's thread waits for) a millisecond per 3K tokens.
    """
    ids, ends = meta.token_ids, meta.token_ends
    if len(ids) != n_tokens or len(ends) != n_tokens:
        raise ValueError(f"{len(ids)} token ids and {len(ends)} token ends for {n_tokens} cached tokens")
    valid = np.fromiter(ends, dtype=np.int64, count=len(ends))
    valid = valid[valid >= 0]
    if valid.size and (valid[-1] > len(meta.text) or (valid[1:] < valid[:-1]).any()):  # in order: the last is the most
        bad = np.flatnonzero((np.diff(valid, prepend=0) < 0) | (valid > len(meta.text)))
        raise ValueError(f"token end {int(valid[bad[0]])} out of order or past the text ({len(meta.text)} chars)")
    if meta.spans is not None:
        _check_spans(meta.spans, len(meta.text))


def _check_spans(spans, length: int) -> None:
    """Raise ValueError unless `spans` are non-empty [start, end) pairs of ints, in order, not overlapping, within
    `length`."""
    at = 0
    for span in spans:
        if len(span) != 2 or not all(type(x) is int for x in span) or not at <= span[0] < span[1] <= length:
            raise ValueError(f"message span {span!r} is empty, out of order or past the text ({length} chars)")
        at = span[1]
