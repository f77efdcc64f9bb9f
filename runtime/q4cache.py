"""A quantized (Q4) KV cache that batches: merge, extract, filter, extend.

`BatchQuantizedKVCache` is one layer's cache for a batch of agents. Unmodified
mlx-lm model code drives it (`update_and_fetch`, `make_mask`, a per-row `offset`
array for RoPE). Keys and values are stored as packed quantized tuples
(uint32 words, scales, biases) of shape (B, kv_heads, tokens, ...), left-padded
to a common length. Quantization groups run along head_dim, so every token row
is quantized on its own: merging, slicing and padding packed rows is exact and
nothing is ever dequantized and requantized. How rows are packed is the cache's
`KVScheme` (`runtime.kvscheme`: bits of keys and of values, group size, rotation);
a rotating scheme rotates keys and values here, before they are quantized, and
`runtime.attention.sdpa` rotates queries and outputs to match. Per-agent layers are
`AgentKVCache`s, mlx-lm's `QuantizedKVCache` that also carry the scheme.

Attention (`runtime.attention`) has four routes, chosen per backend by measurement
(`benchmarks/q4_attention.py`) and overridable (`route=` or the environment
variable KVACTORS_Q4_ROUTE):

- "quantized": attention by quantized matmuls on the packed K/V (mlx-lm's
  scheme; our version does not scale the caller's queries in place). No
  attention sinks. Crashes on CUDA decode. The default on Metal and CPU.
- "dequant": the layer's packed K/V are dequantized transiently every call and
  fed to `runtime.attention.sdpa` (MLX's fused kernels, or plain ops for short
  masked queries; models with attention sinks always take the fused kernel).
- "dequant_once": like "dequant", but the dequantized K/V are kept while the
  batch lives and only new tokens are dequantized each step. Numerically the
  same as "dequant"; costs 16-bit memory for the rows while they are active.
  The default for models with attention sinks off CUDA.
- "q4kernel" (CUDA only): decode steps and short prefill chunks attend on the
  packed cache directly (`runtime.q4sdpa`, which rotates queries and output
  itself), each row over its own columns, so no 16-bit copy is kept and a row's
  output does not depend on the batch; longer chunks dequantize transiently. New
  keys and values are rotated and quantized in one launch (`runtime.q4pack`),
  which for those steps and chunks writes them into the buffers in place; a
  single row's merge, a row's extraction and a growth are one launch a layer
  too (`runtime.q4columns`). The default on CUDA.

Sliding-window layers use the same cache: the model passes the window to
`make_mask`, which masks keys older than it, and `extract` keeps only their
last window + SLIDING_SLACK tokens, so their memory is bounded by the window.
Such a layer's `offset` stays the true position (RoPE needs it) while it
stores fewer tokens; the slack lets a cache be trimmed back that many tokens
for prefix reuse (`can_trim`).
"""

from __future__ import annotations

import collections
import os
import threading

import mlx.core as mx
from mlx_lm.models.base import create_causal_mask
from mlx_lm.models.cache import QuantizedKVCache, _BaseCache, create_attention_mask

from runtime import attention, q4columns, q4pack, q4sdpa
from runtime.errors import KvactorsError
from runtime.kvscheme import KVScheme, plain, rotate
from runtime.qgemv import available as on_cuda

ROUTES = ("quantized", "dequant", "dequant_once", "q4kernel")
STEP = 256
SLIDING_SLACK = 256  # tokens a sliding layer keeps beyond its window, for prefix trims
DENSE_EXTRA = 1  # columns the "dequant_once" working copy has beyond the allocation: see _working_copy


class Q4CacheError(KvactorsError, ValueError):
    """A Q4 cache was built or combined with incompatible parameters."""


def default_route() -> str:
    """The attention route for this process's default device.

    KVACTORS_Q4_ROUTE overrides. Otherwise, by measurement (`benchmarks/decode.py`,
    `benchmarks/q4_attention.py`, results in benchmarks/results/): "q4kernel" on
    CUDA, where it decodes from the packed cache faster than MLX's 16-bit kernel
    at batch 5 and more and is batch-invariant; "quantized" on Metal (mlx-lm's
    native path) and on the CPU, where it decoded fastest.
    """
    route = os.environ.get("KVACTORS_Q4_ROUTE")
    if route:
        return check_route(route)
    if on_cuda():
        return "q4kernel"
    return "quantized"


def check_route(route: str) -> str:
    """Return `route` if it is one of ROUTES and runs here ("q4kernel": CUDA only; "quantized": not on CUDA,
    whose quantized matmul cannot serve its decode steps), else raise Q4CacheError."""
    if route not in ROUTES:
        raise Q4CacheError(f"unknown Q4 attention route {route!r}; choose one of {ROUTES}")
    if route == "q4kernel" and not on_cuda():
        raise Q4CacheError("the q4kernel route runs on CUDA GPUs only; use 'quantized' or 'dequant_once' here")
    if route == "quantized" and on_cuda():
        raise Q4CacheError("the quantized route cannot decode on CUDA (MLX-CUDA's quantized matmul does not serve "
                           "its batched attention); use 'q4kernel' (the default there) or 'dequant_once'")
    return route


def _quantize(x, group_size, bits):
    return tuple(mx.quantize(x, group_size=group_size, bits=bits))


def _dequantize(packed, group_size, bits):
    return mx.dequantize(*packed, group_size=group_size, bits=bits)


def _dequantize_kv(packed_kv, scheme: KVScheme):
    """The dequantized (keys, values) of packed (keys, values) under `scheme` (still rotated, if it rotates)."""
    keys, values = packed_kv
    return _dequantize(keys, scheme.group_size, scheme.key_bits), _dequantize(values, scheme.group_size, scheme.value_bits)


def _held_field(name: str) -> property:
    """`AgentKVCache`'s keys or values (stored as `name`): a held row's views made first (`AgentKVCache._take`)."""

    def get(self):
        self._take()
        return getattr(self, name)

    def put(self, value):
        self._take()
        setattr(self, name, value)

    return property(get, put)


class AgentKVCache(QuantizedKVCache):
    """One layer of one agent's cache: mlx-lm's `QuantizedKVCache` plus the scheme its rows are stored under.

    `bits` are the keys' bits; `value_bits` and `rotation` complete the `KVScheme`.
    Only the batch cache quantizes: an agent's layers hold packed rows, and are
    never driven by a model themselves.
    """

    def __init__(self, group_size: int = 64, bits: int = 4, value_bits: int | None = None, rotation: str = "none"):
        self._held = None  # (HeldRow, layer) until this layer's views are first read: see `hold`
        self._origin = None  # (HeldRow, layer) it was handed out as, kept: see `held_row`
        super().__init__(group_size=group_size, bits=bits)
        self.value_bits = bits if value_bits is None else value_bits
        self.rotation = rotation

    @property
    def scheme(self) -> KVScheme:
        """The layer's `KVScheme`."""
        return KVScheme(self.bits, self.value_bits, self.group_size, self.rotation)

    def hold(self, row: HeldRow, layer: int) -> None:
        """Take layer `layer` of `row` as this layer's keys and values, made into views of its arrays only when
        first read (`HeldRow.views`)."""
        self._held = self._origin = (row, layer)

    def _take(self) -> None:
        held = self._held
        if held is not None:
            row, n = held
            views = row.views()
            self._keys, self._values = tuple(x[n] for x in views[:3]), tuple(x[n] for x in views[3:])
            self._held = None  # after the views are in place: a thread that sees None reads them

    keys = _held_field("_keys")
    values = _held_field("_values")

    def empty(self) -> bool:
        """Whether the layer holds no rows (without making a held row's views)."""
        return self._held is None and self._keys is None

    @property
    def nbytes(self) -> int:
        """Bytes of the layer's keys and values (a held row's share without making its views)."""
        if self._held is not None:
            return sum(x.nbytes // x.shape[0] for x in self._held[0].arrays)
        return 0 if self._keys is None else sum(x.nbytes for x in (*self._keys, *self._values))


class HeldRow:
    """One row's cache of every layer in six arrays (keys' then values' words, scales and biases, each of
    shape (layers, heads, columns, ...)), as `queue_rows` takes a row out of a batch in one launch.

    Each layer's tensors are views of these arrays, made the first time any layer's are read, all at
    once, by the thread that reads them: the engine's thread, which hands the row over, evaluates six
    arrays, not a view a tensor of every layer (192 on the 8B shape, each an array MLX's evaluation
    handles on its own). The views are evaluated and waited for on the reading thread's `side_stream`
    before any thread sees them: the engine and the persistence actor read them at once (a hot turn's
    merge, the last turn's write), and MLX (0.32) lets threads share only arrays whose evaluation is over
    (two threads evaluating graphs over one array still queued crash the process). On that stream the
    wait is for the views alone, not for the steps the engine's thread has queued on its own. A graph over
    the six arrays themselves is built only after `views` (as `held_row` makes sure): the first evaluation
    over them lets go of the graph that made them (MLX detaches it), which two threads must not do at once.
    """

    def __init__(self, arrays):
        self.arrays = tuple(arrays)
        self._views = None
        self._lock = threading.Lock()

    def views(self) -> list:
        """Per array, its views of each layer (shape (1, heads, columns, ...)), evaluated."""
        with self._lock:
            if self._views is None:
                stream = side_stream()
                views = [mx.split(x, x.shape[0], axis=0, stream=stream) for x in self.arrays]
                mx.eval(views)
                self._views = views
            return self._views


_side = threading.local()


def side_stream():
    """The calling thread's own stream on the default device beside its default one, made at first use (MLX
    streams are per thread): work evaluated there waits for nothing the thread queued on its default stream,
    such as the engine's decode steps."""
    if getattr(_side, "stream", None) is None:
        _side.stream = mx.new_stream(mx.default_device())
    return _side.stream


def row_arrays(cache) -> list:
    """The arrays to evaluate for per-agent `cache`'s buffers to be ready: a held row's six arrays (once),
    else each layer's keys and values. Makes no views."""
    out, seen = [], set()
    for layer in cache:
        held = getattr(layer, "_held", None)
        if held is not None:
            if id(held[0]) not in seen:
                seen.add(id(held[0]))
                out.extend(held[0].arrays)
        elif layer.keys is not None:
            out.append((layer.keys, layer.values))
    return out


def layer_cache(scheme: KVScheme) -> AgentKVCache:
    """An empty per-agent layer cache for rows stored under `scheme`."""
    return AgentKVCache(scheme.group_size, scheme.key_bits, scheme.value_bits, scheme.rotation)


def scheme_of(layer) -> KVScheme:
    """The `KVScheme` of a per-agent layer: an `AgentKVCache`'s own, a plain mlx-lm `QuantizedKVCache`'s unrotated one."""
    return layer.scheme if isinstance(layer, AgentKVCache) else plain(layer.bits, layer.group_size)


def _map(fn, packed):
    return tuple(fn(x) for x in packed)


def _map2(fn, a, b):
    return tuple(fn(x, y) for x, y in zip(a, b))


def _placed(packed, used: int, end: int, width: int):
    """The first `used` columns of `packed` placed to end at column `end` of `width` zero columns.

    One slice and one pad per tensor; `packed` itself when it is that already. A row
    without left padding (a hot turn's single row) is its columns followed by zeros
    of one array per shape for every layer: a pad fills the whole width before
    copying the columns in, which is most of a merge's device time at long contexts.
    """
    def place(x):
        if used == end and x.shape[2] == width:
            return x
        if used == end:
            shape = (*x.shape[:2], width - end, x.shape[3])
            spare = _shared("zeros", (), (shape, x.dtype), lambda: mx.zeros(shape, x.dtype))
            return mx.concatenate([x[..., :used, :], spare], axis=2)
        return mx.pad(x[..., :used, :], [(0, 0), (0, 0), (end - used, width - end), (0, 0)])

    return _map(place, packed)


def _stacked(parts, used: list, ends: list, template, width: int):
    """One batch of `width` columns from rows' packed tuples (an empty row's is not read): the first
    `used[i]` columns of row i end at column `ends[i]`, every other column is zero.

    Zeros, then each row's columns written over them (a slice update, in place on the
    buffer the previous one made): one fill and a copy a row per tensor. Placing each row
    first and concatenating the rows had taken three copies a row, and launching those
    (2,700 kernels for four agents' 64-token turns sharing a chunk on the 8B shape) took
    longer than the device's work.
    """
    out = []
    for j, x in enumerate(template):
        batch = mx.zeros((len(parts), x.shape[1], width, x.shape[3]), x.dtype)
        for i, (row, n, end) in enumerate(zip(parts, used, ends)):
            if n:
                batch[i : i + 1, :, end - n : end, :] = row[j][..., :n, :]
        out.append(batch)
    return tuple(out)


def _allocation(used: int, room: int = 1) -> int:
    """Columns to allocate for `used` ones and at least `room` more (at least one): a multiple of STEP.

    A merged or extended batch gets room for the next token at once (else its first
    decode step regrows every buffer, a copy of the whole cache), or for every token its
    rows may still take (`merge`'s and `extend`'s `room`), and widths come from a small
    set (multiples of STEP), so a backend that sets up work per shape meets few.
    """
    return _grown(used + max(1, room))


def _grown(needed: int) -> int:
    """Columns a full allocation grows to when `needed` columns must fit: a multiple of STEP."""
    return -(-needed // STEP) * STEP


_memo = threading.local()  # .results: see _shared


def _shared(op: str, inputs: tuple, param, make):
    """`make()`, or the array it gave last time for the same `op`, the same input arrays and `param`.

    Every layer of a batch holds the same row positions and padding, and makes the
    same small arrays from them each step (a decode step advances 32 layers' offsets);
    made once, one array serves every layer, and MLX launches one kernel instead of
    one per layer. Inputs are compared by identity and kept alive while remembered;
    the last few results are remembered, per thread (MLX evaluates an array only on
    the thread that built it).
    """
    results = getattr(_memo, "results", None)
    if results is None:
        results = _memo.results = collections.OrderedDict()
    key = (op, tuple(id(x) for x in inputs), param)
    hit = results.get(key)
    if hit is not None:
        results.move_to_end(key)
        return hit[1]
    out = make()
    results[key] = (inputs, out)
    if len(results) > 8:
        results.popitem(last=False)
    return out


ROW_BUFFER = 4  # int32 elements a row array's buffer holds at least (see `_row_buffer`)


def _row_buffer(values) -> mx.array:
    """An int32 array of `values` (a list of ints) padded with zeros to at least ROW_BUFFER elements, one per
    distinct list among the layers that ask in a row; `_rows` gives its first len(values).

    The kernels read a row's padding and position in every block. MLX-CUDA keeps arrays of at most 8 bytes
    (one or two rows) in a pool of managed memory that stays on the host, which the GPU reads across PCIe:
    on an H100 each such read added ~1 us to a kernel, and one-row decode attention took 1.2-1.6x as long
    (4x in one run).
    A 16-byte buffer is managed memory that moves to the device at its first use there."""
    padded = list(values) + [0] * (ROW_BUFFER - len(values))
    return _shared("rows", (), tuple(padded), lambda: mx.array(padded, dtype=mx.int32))


def row_array(values) -> mx.array:
    """An int32 array of `values` (a list of ints) as a batch cache holds its rows' padding and positions: in a
    buffer of at least ROW_BUFFER elements (`_row_buffer`), one per distinct list among the layers that ask in a row
    on one thread. What a kernel that reads per-row parameters should be timed with."""
    return _rows(_row_buffer(values), len(values))


def _rows(buffer, n: int) -> mx.array:
    """The first `n` elements of a row buffer (`_row_buffer`): the buffer itself, or one view shared by the layers."""
    return buffer if buffer.shape[0] == n else _shared("rows view", (buffer,), n, lambda: _head(buffer, n))


def _head(buffer, n: int) -> mx.array:
    """The first `n` elements of a row buffer: the buffer itself where it holds n, else a view."""
    return buffer if buffer.shape[0] == n else buffer[:n]


def _gathered(caches, plan, width: int):
    """`q4columns.gather` of `plan`'s rows from `caches` (one or two caches with keys): (keys, values) of `width`
    columns; its parameters one array for every layer that asks with the same plan in a row (`_shared`)."""
    plan, sources = tuple(plan), [(c.keys, c.values) for c in caches]
    layout = q4columns.layout(sources)
    return q4columns.gather(sources, plan, width,
                            _shared("gather", (), (plan, width, layout), lambda: q4columns.params(layout, plan, width)))


def _copied(x):
    """A copy of `x` in a buffer of its own (multiplying by one is exact for integers and floats)."""
    return x * mx.array(1, dtype=x.dtype)


def _widened(x, width: int):
    """`x` with zero columns appended up to `width` columns (axis 2)."""
    return mx.concatenate([x, mx.zeros((*x.shape[:2], width - x.shape[2], x.shape[3]), x.dtype)], axis=2)


def _working_copy(packed_kv, scheme: KVScheme, width: int):
    """The dequantized (keys, values) of `packed_kv`, zero-extended to `width` columns.

    The width is the allocation plus DENSE_EXTRA on purpose. MLX-CUDA decodes with
    cuDNN whenever the keys are a slice of a buffer whose length is a multiple
    of 256, and builds a cuDNN graph for every new (batch size, buffer length):
    on an H100 about 0.6 s for a new batch size and 0.1 s for each new length,
    that is a stall every 256 tokens of a serving loop. A buffer one column
    longer sends decoding to the vector kernel, which builds nothing per shape
    and decodes as fast (`benchmarks/profile.py` measures both ways by setting
    DENSE_EXTRA to 0). Other backends ignore the extra column.
    """
    return tuple(_widened(d, width) for d in _dequantize_kv(packed_kv, scheme))


def _zero_rows(template, rows: int, width: int):
    """Zeros shaped like `template`'s packed tuple, with `rows` rows of `width` columns."""
    return _map(lambda x: mx.zeros((rows, x.shape[1], width, x.shape[3]), x.dtype), template)


def stored_tokens(layer) -> int:
    """Tokens a per-agent `QuantizedKVCache` layer holds: its last `stored_tokens` positions.

    `offset` for full layers (any buffer past it is spare); fewer for a sliding layer
    bounded by `extract`.
    """
    return 0 if layer.empty() else min(layer.offset, layer.keys[0].shape[2])


class BatchQuantizedKVCache(_BaseCache):
    """One layer's Q4 KV cache for a left-padded batch of agents.

    Row b holds `offset[b]` tokens in columns [left_padding[b], size()). Build one
    with `merge`, grow it with `update_and_fetch` (what the model calls), take a
    row out with `extract`, drop rows with `filter`, add rows with `extend`.
    """

    def __init__(self, left_padding, scheme: KVScheme = KVScheme(), route: str | None = None,
                 keep: int | None = None, own_attention: bool = True):
        self.keep = keep  # sliding layers: the most tokens `extract` hands out (None: all)
        self.scheme = scheme
        self.route = check_route(route or default_route())
        self.keys = None  # (words, scales, biases), each (B, H, allocated, ...)
        self._owned = True  # whether only this cache holds its buffers (see `_own`)
        self._pending = None  # the result of the last in-place write (`_packs_in_place`)
        self._lead = None  # per row, columns of history past size() that the next update keeps (`merge`)
        self.values = None
        self._first_width = 0  # columns the first allocation takes at least (`merge`'s room, with no history)
        self._idx = 0
        # the host's copies of left_padding and of offset - size(): what extract, filter and extend
        # read, so that none of them waits for the device (a step in flight computes `offset`)
        self._pads = [int(p) for p in left_padding]
        self._bases = [-p for p in self._pads]
        self._rows_from_host()
        self._dense = None  # "dequant_once": dequantized (keys, values), valid in [0, _dense_len)
        self._dense_len = 0
        # attention through runtime.attention (it needs mlx-lm to see `bits`); the
        # fused kernel directly for models with attention sinks, which mlx-lm
        # refuses to send to a cache with `bits`
        self.own_attention = own_attention
        if own_attention and not attention.installed():
            raise Q4CacheError("mlx-lm would not send this cache's attention to runtime.attention: call "
                               "runtime.attention.install() once before building batch caches (Engine does)")
        if not own_attention and self.route == "quantized":
            raise Q4CacheError("the quantized route cannot serve attention sinks; use 'dequant' or 'dequant_once'")
        if not own_attention and scheme.rotated:
            raise Q4CacheError(f"models with attention sinks attend by themselves and cannot rotate their queries: "
                               f"the KV scheme {scheme.name} needs runtime.attention; use an unrotated one")

    # -- what the model drives -------------------------------------------------

    def update_and_fetch(self, keys, values, rope=None):
        """Quantize and append keys/values of shape (B, H, N, D); return what attention reads.

        `rope`: (positions, inv_freq) for keys not yet rotated by RoPE, where `fuses_rope`
        says the in-place write rotates them (at the rows' positions, `offset`); Q4CacheError
        elsewhere.

        Keys and values are rotated first if the scheme rotates (`runtime.attention.sdpa`
        rotates queries and outputs to match). Returns packed tuples under the
        "quantized" route; where attention reads with the kernel (the "q4kernel" route,
        when `make_mask` gave a `RowRange`: decode steps and short prefill chunks), the whole
        packed buffers, the keys' tuple carrying a fourth array when the update was written
        in place (`_packs_in_place`): the write's result, which the kernel takes as an input;
        else 16-bit arrays (the dequantized cache including the new tokens, still rotated).
        """
        B, H, N, Dk = keys.shape
        Dv = values.shape[-1]
        g = self.scheme.group_size
        for name, d in (("key", Dk), ("value", Dv)):
            if d % g:
                raise Q4CacheError(
                    f"{name} head dim {d} is not divisible by the group size {g}; "
                    "use a group size that divides it (32 or 64)"
                )
        prev = self._idx
        if self._lead is not None and N <= max(self._lead):
            raise Q4CacheError(f"this update must feed more than {max(self._lead)} tokens a row (the rows' lead, "
                               f"see merge); got {N}")
        kernel = self._kernel_reads(N)  # as `make_mask` decided, before this update: the attention's route
        decode = kernel and N == 1  # `_kernel_decode`, from the route just found
        if rope is not None and not (decode and self.fuses_rope(keys.dtype, Dk)):
            raise Q4CacheError("this update cannot rotate its keys by RoPE (see fuses_rope): rotate them first")
        self._reserve(B, H, Dk, Dv, keys.dtype, prev + N)
        self._own()  # else a write would change a merged agent's arrays (Python objects both hold)
        if kernel and self._lead is None and self._packs_in_place(keys, values):
            if N > 1:  # an earlier chunk's write feeds only its own chunk: queue it before this one's
                self._settle()  # (a decode step's tokens come from the previous step, which wrote first)
            self._pending = q4pack.pack_kv_into(keys, values, self.scheme, self.keys, self.values, prev + N, rope)
            self._idx += N
            self._advance(N)
            return (*self.keys, self._pending), self.values  # the kernel reads the buffers after the write
        new_k, new_v = self._packed(keys, values)
        self._settle()
        if self._lead is not None:
            new_k, new_v = self._behind_lead(prev, N, new_k, new_v)
        for dst, src in zip(self.keys + self.values, new_k + new_v):
            dst[:, :, prev : prev + N] = src  # (B, H, W, ...): plain slices index faster than an ellipsis
        self._idx += N
        self._advance(N)
        return self._fetch(new_k, new_v, kernel)

    def _behind_lead(self, prev: int, N: int, new_k, new_v):
        """The packed new columns with each row's first `lead` of them taken from the buffers (its history)."""
        history = (mx.arange(N)[None] < row_array(self._lead)[:, None])[:, None, :, None]  # (B, 1, N, 1)
        self._lead = None

        def kept(dst, src):
            return mx.where(history, dst[:, :, prev : prev + N], src)

        return (_map2(kept, self.keys, new_k), _map2(kept, self.values, new_v))

    def _unled(self, what: str) -> None:
        if self._lead is not None:
            raise Q4CacheError(f"cannot {what} a batch before the update its merge's lead is for")

    def _advance(self, n: int) -> None:
        """Add `n` to every row's position, in a buffer as long as before (one buffer and one view of its rows for
        all the layers: `_shared`)."""
        offsets, rows = self._offsets, len(self._pads)

        def advanced():
            buffer = offsets + n
            return buffer, _head(buffer, rows)

        self._offsets, self.offset = _shared("advanced", (offsets,), (n, rows), advanced)

    def _packs_in_place(self, keys, values) -> bool:
        """Whether an update whose attention is the kernel (a decode step, or a short chunk without a merge's
        lead) packs its tokens into the buffers in place (`q4pack.pack_kv_into`): one launch a layer
        instead of a pack and six slice updates.

        The kernel is the update's only reader of the buffers and takes the write's result
        as an input. Other updates (long chunks, which attention reads dequantized with
        MLX's own ops, a lead's update, which keeps some columns, and layouts the kernels
        do not serve) write through slice updates, which MLX orders itself.
        Whatever reads the buffers later first queues the write if it is not yet (`_settle`,
        `settle`, or evaluating `state`), then reads on the same stream, after it.
        """
        return self.keys[1].dtype == keys.dtype and q4pack.serves(self.scheme, keys, values)

    def fuses_rope(self, dtype, head_dim: int) -> bool:
        """Whether a decode step's update (one token a row, keys and values of `dtype` and `head_dim`) may hand
        its keys over unrotated by RoPE (`update_and_fetch`'s `rope`): it writes them in place with the kernel
        that rotates them, and attention's kernel rotates the queries (`attention.RowRange.rope`)."""
        return (self._kernel_decode(1) and self.keys[1].dtype == dtype and head_dim in q4pack.HEAD_DIMS
                and head_dim % self.scheme.group_size == 0 and self.scheme.key_bits in q4pack.BITS
                and self.scheme.value_bits in q4pack.BITS)

    def _settle(self) -> None:
        """Queue the last in-place write for the device, if it is not yet, before anything else reads the buffers.

        MLX-CUDA orders the kernels of one evaluation by the arrays they list, and the
        write lists the buffers as inputs only; a later evaluation runs after it. The
        engine queues every step before it touches the cache again, so the evaluation then
        has nothing to do, but the call still gives up the GIL and must win it back: once
        queued, the write is forgotten, and a batch settles all its layers in one call (`settle`).
        """
        settle((self,))

    def _own(self) -> None:
        """Copy the buffers once if they are arrays from outside (a merged agent's own): before the first write."""
        if not self._owned:
            self.keys, self.values = _map(_copied, self.keys), _map(_copied, self.values)
            self._owned = True

    def _packed(self, keys, values):
        """The new keys and values rotated (if the scheme rotates) and quantized: (words, scales, biases) each.

        The "q4kernel" route does it in one CUDA launch (`runtime.q4pack`) where it can.
        """
        sch = self.scheme
        if self.route == "q4kernel" and q4pack.serves(sch, keys, values):
            return q4pack.pack_kv(keys, values, sch)
        return (_quantize(rotate(keys, sch), sch.group_size, sch.key_bits),
                _quantize(rotate(values, sch), sch.group_size, sch.value_bits))

    def fits(self, n: int) -> bool:
        """Whether `n` more columns fit in the buffers as they are (or there are none yet): `reserve` grows nothing."""
        return self.keys is None or self._idx + n <= self.keys[0].shape[2]

    def reserve(self, n: int) -> bool:
        """Grow the buffers now if `n` more columns would not fit; return whether they grew.

        An update grows them itself when it must, but then the copy joins that update's
        graph; growing ahead lets the caller evaluate the copy on its own (see Engine).
        """
        self._unled("reserve room in")
        if self.fits(n):
            return False
        (words_k, scales, _), words_v = self.keys, self.values[0]
        B, H, _, w = words_k.shape
        self._reserve(B, H, w * 32 // self.scheme.key_bits, words_v.shape[-1] * 32 // self.scheme.value_bits,
                      scales.dtype, self._idx + n)
        return True

    def _reserve(self, B, H, Dk, Dv, dtype, needed):
        width = self._width_for(needed)
        if self.keys is not None and width == self.keys[0].shape[2]:
            return
        self._settle()
        self._owned = True  # new buffers either way
        if self.keys is not None and self.route == "q4kernel":  # one launch a layer (see runtime.q4columns)
            used = self._used()
            self.keys, self.values = _gathered([self], [(0, i, 0, used, 0) for i in range(B)], width)
            return
        grow = width - self._used()
        g = self.scheme.group_size

        def empty(d, bits):
            shape = (B, H, grow)
            return (
                mx.zeros((*shape, d * bits // 32), mx.uint32),
                mx.zeros((*shape, d // g), dtype),
                mx.zeros((*shape, d // g), dtype),
            )

        keys, values = empty(Dk, self.scheme.key_bits), empty(Dv, self.scheme.value_bits)
        if self.keys is None:
            self.keys, self.values = keys, values
        else:
            self.keys = self._grown(self.keys, keys)
            self.values = self._grown(self.values, values)

    def _width_for(self, needed: int) -> int:
        """Columns the buffers have once `needed` columns fit: as allocated, or what `_reserve` makes them."""
        allocated = 0 if self.keys is None else self.keys[0].shape[2]
        if needed <= allocated:
            return allocated
        return max(_grown(needed), self._first_width if self.keys is None else 0)

    def _grown(self, packed, extra):
        return tuple(mx.concatenate([x[..., : self._used(), :], e], axis=2) for x, e in zip(packed, extra))

    def _used(self) -> int:
        """Columns that hold tokens: size(), plus the history of rows with a lead (`merge`)."""
        return self._idx + (max(self._lead) if self._lead is not None else 0)

    def _fetch(self, new_k, new_v, kernel: bool):
        N = new_k[0].shape[2]
        if self.route == "q4kernel":
            if kernel:
                return self.keys, self.values  # whole buffers: make_mask gives each row's columns
            if self._whole_width(N):
                return _working_copy((self.keys, self.values), self.scheme, self.keys[0].shape[2] + DENSE_EXTRA)
        if self.route != "dequant_once":
            k, v = self.keys_and_values()
            if self.route == "quantized":
                return k, v
            return _dequantize_kv((k, v), self.scheme)
        prev = self._idx - N
        width = self.keys[0].shape[2] + DENSE_EXTRA  # see _working_copy
        if self._dense is None or self._dense_len != prev:
            # (re)build the working copy over the whole allocation, padding included
            self._dense = _working_copy((self.keys, self.values), self.scheme, width)
        else:
            if self._dense[0].shape[2] < width:
                self._dense = tuple(_widened(d, width) for d in self._dense)
            for d, n in zip(self._dense, _dequantize_kv((new_k, new_v), self.scheme)):
                d[:, :, prev : self._idx] = n
        self._dense_len = self._idx
        if self._whole_width(N):
            return self._dense  # masked by make_mask's full-width mask
        return tuple(d[..., : self._idx, :] for d in self._dense)

    def _whole_width(self, N: int) -> bool:
        """Whether attention for N queries reads the whole working copy under a mask.

        Plain attention (`runtime.attention`: short prefills, and decode rows of
        unequal length) then sees keys of the allocated width, which changes every
        256 tokens instead of every token, so MLX's matmuls meet few shapes.
        """
        return (
            self.route in ("dequant_once", "q4kernel") and self.own_attention
            and (self._padded or N >= 4) and N < attention.SHORT_QUERY
        )

    def _kernel_decode(self, N: int) -> bool:
        """Whether attention for N queries is a decode step (N = 1) that `q4sdpa` runs on the packed cache."""
        return N == 1 and self._kernel_reads(N)

    def _kernel_reads(self, N: int) -> bool:
        """Whether attention for N queries runs `q4sdpa` on the packed cache (route "q4kernel"): decode steps,
        and prefill chunks of fewer than SHORT_QUERY queries into a cache that holds tokens already (a hot turn;
        longer chunks are faster through MLX's fused kernel on the dequantized cache).

        Layouts the kernel does not read (`q4sdpa.serves`) attend on the working copy.
        """
        if not (self.route == "q4kernel" and self.own_attention and 1 <= N < attention.SHORT_QUERY
                and self.keys is not None
                and self.keys[1].dtype in (mx.float16, mx.bfloat16)):  # the kernel reads 16-bit queries
            return False
        sch = self.scheme
        k_dim = self.keys[0].shape[-1] * 32 // sch.key_bits
        v_dim = self.values[0].shape[-1] * 32 // sch.value_bits
        return k_dim == v_dim and q4sdpa.serves(sch.key_bits, sch.value_bits, k_dim, sch.group_size)

    def keys_and_values(self):
        """The packed (keys, values) of the used columns [0, size())."""
        if self.keys is None:
            return None, None
        self._settle()
        return (
            _map(lambda x: x[..., : self._idx, :], self.keys),
            _map(lambda x: x[..., : self._idx, :], self.values),
        )

    def make_mask(self, N: int, return_array: bool = False, window_size: int | None = None):
        """The attention mask for N new queries: causal, left padding and window.

        Without padding it is what mlx-lm's own caches give (None or "causal"),
        so the fused attention kernels keep their fast unmasked paths; with padding
        it is a boolean array (B, 1, N, size()+N). Where attention reads the whole
        working copy (`_whole_width`), the array spans it.
        """
        if self._kernel_reads(N):
            end, window = self._idx + N, window_size or 0
            return attention.RowRange(self.left_padding, end, window, q4sdpa.meta(end, window, N))
        if self._whole_width(N):
            return self._whole_width_mask(N, window_size)
        if not self._padded:
            return create_attention_mask(N, self._idx, return_array, window_size)
        return create_causal_mask(
            N, offset=self._idx, window_size=window_size, left_padding=self.left_padding
        )

    def _whole_width_mask(self, N: int, window_size: int | None):
        columns = mx.arange(self._width_for(self._idx + N) + DENSE_EXTRA)  # the buffers after this update
        positions = mx.arange(self._idx, self._idx + N)[:, None]
        mask = columns[None] <= positions
        if window_size is not None:
            mask = mask & (columns[None] > positions - window_size)
        return mask[None, None] & (columns >= self.left_padding[:, None])[:, None, None, :]

    @property
    def bits(self):
        """The cache's `KVScheme`, under the name mlx-lm reads. mlx-lm routes attention by
        hasattr(cache, "bits") and passes `cache.bits` on to `runtime.attention.sdpa`, which
        needs the whole scheme (bits of keys and of values, rotation). Visible unless
        `own_attention` is off."""
        if not self.own_attention:
            raise AttributeError("bits")
        return self.scheme

    @property
    def group_size(self):
        """Quantization group size; visible like `bits`."""
        if not self.own_attention:
            raise AttributeError("group_size")
        return self.scheme.group_size

    # -- batch surgery ----------------------------------------------------------

    @classmethod
    def merge(cls, caches, scheme: KVScheme = KVScheme(), route: str | None = None,
              keep: int | None = None, own_attention: bool = True, lead=None, room: int = 1, fill: bool = True):
        """One batch from per-agent `QuantizedKVCache`s (None or empty: no history).

        Rows are left-padded to the longest; packed words are copied, never
        requantized. Every cache must be stored under `scheme` (`scheme_of`), else
        Q4CacheError. A cache may hold fewer tokens than its `offset` (a bounded
        sliding layer): the row's position stays `offset`.

        `lead` (one int per row, default 0) serves a prefill of several rows whose new
        tokens are fewer than the update's N for some: row i's tokens fill the last N -
        lead[i] columns of the update, after lead[i] padding queries. Row i's history
        then ends lead[i] columns after `size()`, so that every row ends at one column
        after the update, and that update (the next call of `update_and_fetch`, with N
        greater than every lead) keeps those columns of history instead of storing the
        padding queries' keys and values. A row's RoPE positions (`offset`) start lead[i]
        before its history's end, so its real tokens get their true positions. A lead
        may not exceed the tokens its row holds (Q4CacheError). Until that update, only
        `make_mask` and `update_and_fetch` may be called.

        `room`: columns to allocate beyond the rows' history (at least one): what the batch
        will take before it changes again, so that no update or step in between grows the
        buffers (a copy of every one, and new shapes).

        `fill` False leaves a one-row batch's buffers on the "q4kernel" route to the caller
        (`merge_caches` fills every layer with one launch): keys and values stay None until then.
        """
        lead = [0] * len(caches) if lead is None else [int(x) for x in lead]
        lengths, positions = [], []
        for c, ahead in zip(caches, lead, strict=True):
            if c is not None and not c.empty() and scheme_of(c) != scheme:
                raise Q4CacheError(
                    f"cannot merge a cache stored as {scheme_of(c).name} into a {scheme.name} batch; "
                    "re-prefill that agent"
                )
            lengths.append(0 if c is None else stored_tokens(c))
            positions.append((0 if c is None or c.empty() else c.offset) - ahead)
            if not 0 <= ahead <= lengths[-1]:
                raise Q4CacheError(f"a row's lead must be 0 to the {lengths[-1]} tokens it holds; got {ahead}")
        base = max((n - ahead for n, ahead in zip(lengths, lead)), default=0)
        cache = cls([base + ahead - n for n, ahead in zip(lengths, lead)], scheme, route, keep, own_attention)
        cache._idx = base
        cache._bases = [p - base for p in positions]
        cache._rows_from_host()
        cache._lead = lead if any(lead) else None
        if base + max(lead, default=0) == 0:
            cache._first_width = _allocation(0, room)  # the first update allocates it
            return cache
        template = next(c for c, n in zip(caches, lengths) if n)

        width = _allocation(base + max(lead), room)

        if len(caches) == 1 and cache.route == "q4kernel":  # one launch a layer (see runtime.q4columns)
            if fill:
                cache.keys, cache.values = _gathered([caches[0]], [(0, 0, 0, lengths[0], 0)], width)
            return cache

        def rows(part):
            if len(caches) == 1:
                return _placed(getattr(caches[0], part), lengths[0], base + lead[0], width)
            return _stacked([None if not n else getattr(c, part) for c, n in zip(caches, lengths)], lengths,
                            [base + ahead for ahead in lead], getattr(template, part), width)

        cache.keys, cache.values = rows("keys"), rows("values")
        theirs = {id(x) for c in caches if c is not None and not c.empty() for x in (*c.keys, *c.values)}
        cache._owned = not any(id(x) in theirs for x in (*cache.keys, *cache.values))  # `_placed` may pass one on
        return cache

    def twin(self) -> "BatchQuantizedKVCache":
        """A batch of the same rows, padding, positions, lead and settings as this one, without buffers: what
        `merge` makes of the same caches for another layer of the same `keep`, before its buffers are filled,
        for a few microseconds where `merge` takes tens (a hot turn merges 32 layers). Its lists are its own;
        its small row arrays are this one's, which every layer shares anyway (`_shared`)."""
        twin = type(self).__new__(type(self))
        twin.__dict__.update(self.__dict__)
        twin._pads, twin._bases = list(self._pads), list(self._bases)
        twin._lead = None if self._lead is None else list(self._lead)
        twin.keys = twin.values = None
        twin._owned, twin._pending, twin._dense, twin._dense_len = True, None, None, 0
        return twin

    def extract(self, i: int, drop: int = 0) -> AgentKVCache:
        """Row `i` as an `AgentKVCache` (an mlx-lm `QuantizedKVCache`) of exactly its used tokens, evaluated.

        The last `drop` columns are left out. A layer built with `keep` hands out
        only its last `keep` tokens; `offset` is the row's position either way.
        """
        out = self._extract(i, drop, *self.row_place(i))
        mx.eval(out.keys, out.values)
        return out

    def row_place(self, i: int) -> tuple[int, int]:
        """Row `i`'s (left padding, offset) as ints, from the host's copies: never waits for the device."""
        return self._pads[i], self._bases[i] + self._idx

    def _extract(self, i: int, drop: int, pad: int, offset: int) -> AgentKVCache:
        """`extract` with the row's padding and offset given, unevaluated."""
        return self._filled(i, *self._extracted(i, drop, pad, offset))

    def _filled(self, i: int, out: AgentKVCache, span) -> AgentKVCache:
        """`out` (from `_extracted`) given row `i`'s columns `span` of this layer's buffers, unevaluated."""
        if span is None:
            return out
        start, stop = span
        if self.route == "q4kernel":  # one launch a layer instead of six copies
            out.keys, out.values = _gathered([self], [(0, i, start, stop, 0)], stop - start)
        else:
            out.keys = _map(lambda x: mx.contiguous(x[i : i + 1, :, start:stop, :]), self.keys)
            out.values = _map(lambda x: mx.contiguous(x[i : i + 1, :, start:stop, :]), self.values)
        return out

    def _extracted(self, i: int, drop: int, pad: int, offset: int):
        """Row `i`'s extraction without its buffers: (an empty `AgentKVCache` at the row's offset less `drop`,
        the columns [start, stop) its buffers take, or None where it has none)."""
        self._unled("take a row out of")
        out = layer_cache(self.scheme)
        self._settle()
        end = self._idx - drop
        if self.keys is None or pad >= end:
            return out, None
        if self.keep is not None:
            pad = max(pad, end - self.keep)
        out.offset = offset - drop
        return out, (pad, end)

    def filter(self, keep) -> None:
        """Keep only rows `keep` (a list of row indices), in that order; trim shared padding.

        Padding that every row shares is dropped in whole STEP blocks (so widths stay
        multiples of STEP); less than a block stays as padding.
        """
        keep = list(keep)
        self._unled("filter")
        self._settle()
        if keep and keep == list(range(keep[0], keep[-1] + 1)):
            idx = slice(keep[0], keep[-1] + 1)  # a run of rows: views, no copy
        else:
            idx = mx.array(keep, dtype=mx.int32)
        if self.keys is not None:
            self.keys = _map(lambda x: x[idx], self.keys)
            self.values = _map(lambda x: x[idx], self.values)
        if self._dense is not None:
            self._dense = tuple(x[idx] for x in self._dense)
        self._pads, self._bases = [self._pads[k] for k in keep], [self._bases[k] for k in keep]
        drop = min(self._pads, default=0) // STEP * STEP  # whole blocks only: a copy of every buffer
        if drop:
            self._drop_front(drop)
        else:
            self._rows_from_host()

    def _drop_front(self, n):
        if self.keys is not None:  # contiguous: the decode kernel reads whole buffers
            self.keys = _map(lambda x: mx.contiguous(x[..., n:, :]), self.keys)
            self.values = _map(lambda x: mx.contiguous(x[..., n:, :]), self.values)
        if self._dense is not None:
            self._dense = tuple(x[..., n:, :] for x in self._dense)
            self._dense_len -= n
        self._idx -= n
        self._pads = [p - n for p in self._pads]
        self._bases = [b + n for b in self._bases]  # offsets stay: size() fell by n
        self._rows_from_host()

    def _rows_from_host(self) -> None:
        """Set `left_padding`, `offset` and `_padded` from the host's copies: where the batch's rows change
        (a filter, a join, dropped columns), the one rule for all three; a step only advances `offset`
        (`_advance`)."""
        n = len(self._pads)
        self.left_padding = row_array(self._pads)
        self._offsets = _row_buffer([b + self._idx for b in self._bases])  # `offset`'s buffer, which steps advance
        self.offset = _rows(self._offsets, n)
        self._padded = any(self._pads)  # a row with padding needs the padded mask

    def extend(self, other: "BatchQuantizedKVCache", room: int = 1) -> None:
        """Append the rows of `other` (same `KVScheme`) after this batch's rows, with at least `room` free
        columns after the longest row (as `merge` takes it)."""
        if other.scheme != self.scheme:
            raise Q4CacheError(f"cannot extend a {self.scheme.name} batch with a {other.scheme.name} one")
        self._unled("extend")
        other._unled("extend")
        self._settle()
        other._settle()
        if other.keys is None and self.keys is None:
            self._pads = self._pads + other._pads
            self._bases = self._bases + [b + other._idx - self._idx for b in other._bases]
            self._rows_from_host()
            return
        longest = max(self._idx, other._idx)
        template = self if self.keys is not None else other
        width = _allocation(longest, room)  # new buffers either way: the width this batch needs, wider or not

        def aligned(c, part):
            src = getattr(c, part)
            if src is None:
                return _zero_rows(getattr(template, part), c.left_padding.shape[0], width)
            return _placed(src, c._idx, longest, width)

        parts = {}
        for part in ("keys", "values"):
            parts[part] = tuple(
                mx.concatenate([a, b], axis=0) for a, b in zip(aligned(self, part), aligned(other, part))
            )
        self._pads = [p + longest - self._idx for p in self._pads] + [p + longest - other._idx for p in other._pads]
        self._bases = [b + self._idx - longest for b in self._bases] + [b + other._idx - longest for b in other._bases]
        self.keys, self.values = parts["keys"], parts["values"]
        self._owned = True  # concatenated: new buffers
        self._idx = longest
        self._dense = None
        self._rows_from_host()

    # -- the rest of mlx-lm's cache protocol ------------------------------------

    def size(self) -> int:
        """Number of used columns (the longest row plus its padding)."""
        return self._idx

    def empty(self) -> bool:
        """True if nothing was ever stored."""
        return self.keys is None

    def is_trimmable(self) -> bool:
        """Always: `trim` drops trailing columns of every row."""
        return True

    def trim(self, n: int) -> int:
        """Drop the last `n` columns of every row; return how many were dropped."""
        self._unled("trim")
        n = min(self._idx, n)
        self._idx -= n
        self._advance(-n)
        self._dense_len = min(self._dense_len, self._idx)
        return n

    @property
    def state(self):
        """(keys, values, offset, left_padding, pending): the arrays to evaluate after a step. `pending` is
        the last in-place write's result (evaluating it runs the write) until `settle` queues and forgets it,
        then an empty tuple: a queued write is ordered before what this thread's stream runs later, and a
        reader on another stream or the host must wait for that stream first."""
        return self.keys, self.values, self.offset, self.left_padding, () if self._pending is None else self._pending

    @property
    def nbytes(self) -> int:
        """Bytes held: the packed buffers (allocated) plus any dequantized working copy."""
        total = 0
        for part in (self.keys, self.values, self._dense):
            if part is not None:
                total += sum(x.nbytes for x in part)
        return total


def route_for(spec, route: str | None = None) -> str:
    """The route to use for the model of `spec`: `route` or the default, checked.

    The "quantized" route cannot serve attention sinks: asking for it on such a
    model raises Q4CacheError; where it is the default, such models get "dequant_once".
    Where "q4kernel" is the default but its kernel cannot serve the model's decode
    (a layout `q4sdpa.serves` refuses, such as 8-bit keys or head dim 96; sinks),
    the model gets "dequant_once" instead of dequantizing the whole cache every step. So does a model whose
    own code reads keys and values as arrays (`spec.dense_kv`, found at load by `model.serving_spec`), whatever
    KVACTORS_Q4_ROUTE says: the default route failed it.
    """
    if route is None and getattr(spec, "dense_kv", False):
        return "dequant_once"
    chosen = check_route(route) if route else default_route()
    scheme = spec.kv_scheme
    if chosen == "q4kernel" and route is None and (
        spec.has_sinks or spec.k_head_dim != spec.v_head_dim
        or not q4sdpa.serves(scheme.key_bits, scheme.value_bits, spec.k_head_dim, scheme.group_size)
    ):
        return "dequant_once"
    if chosen == "quantized" and spec.has_sinks:
        if route is None:
            return "dequant_once"  # the default here, but sinks need the fused kernel
        raise Q4CacheError(
            "the quantized route cannot serve attention sinks; use 'dequant' or 'dequant_once'"
        )
    return chosen


def make_batch_cache(spec, batch_size: int = 1, route: str | None = None):
    """An empty per-layer list of `BatchQuantizedKVCache` for a model described by `spec`.

    Every layer, full or sliding, gets the same cache type (the model passes the
    sliding window to the mask; sliding layers hand out at most window +
    SLIDING_SLACK tokens). The route is checked by `route_for`.
    """
    route = route_for(spec, route)
    return [
        BatchQuantizedKVCache([0] * batch_size, spec.kv_scheme, route, _keep(spec, layer),
                              not spec.has_sinks)
        for layer in range(spec.n_layers)
    ]


def _keep(spec, layer):
    window = spec.windows[layer]
    return None if window is None else window + SLIDING_SLACK


def merge_caches(spec, agent_caches, route: str | None = None, lead=None, room: int = 1):
    """Merge per-agent caches (each a per-layer list of QuantizedKVCache, or None) into a batch.

    `lead` (per row) and `room`: as `BatchQuantizedKVCache.merge` takes them (every layer the same).
    One agent's cache that a turn handed out whole (`held_row`) is copied from every layer in one
    `q4columns.gather` launch (a hot turn's merge), each layer's buffers a view of one buffer a tensor,
    and its layers after the first of each `keep` are that one's twins (`BatchQuantizedKVCache.twin`).
    """
    route = route_for(spec, route)
    row, tokens = (held_row(agent_caches[0]) if route == "q4kernel" and len(agent_caches) == 1 else None) or (None, 0)
    batch, first = [], {}  # a held row's first layer of each `keep`, whose twins the others are (`twin`)
    for layer in range(spec.n_layers):
        keep = _keep(spec, layer)
        if keep in first:
            batch.append(first[keep].twin())
            continue
        batch.append(BatchQuantizedKVCache.merge(
            [None if c is None else c[layer] for c in agent_caches], spec.kv_scheme, route,
            keep, not spec.has_sinks, lead, room, fill=row is None,
        ))
        if row is not None:  # every layer holds the same tokens at the same positions (`held_row`)
            first[keep] = batch[-1]
    if row is not None:
        keys, values = q4columns.gather([(row.arrays[:3], row.arrays[3:])],
                                        [(0, n, 0, tokens, 0) for n in range(len(batch))],
                                        _allocation(tokens, room), checked=True)  # `held_row` checked them
        parts = [mx.split(x, len(batch), axis=0) for x in (*keys, *values)]
        for n, layer in enumerate(batch):
            layer.keys, layer.values = tuple(x[n] for x in parts[:3]), tuple(x[n] for x in parts[3:])
    return batch


def held_row(cache):
    """(The `HeldRow` whose layer n every layer n of per-agent `cache` is, the tokens every layer holds) where the
    cache is as a turn handed it out and unchanged since (its arrays or their views, every layer holding the same
    tokens), so that one launch can copy them all (a merge) and a copy to the host can read six arrays rather than
    six a layer (`hostcache.cache_to_host`); else None."""
    if not cache or len(cache) < 2:
        return None
    origin = getattr(cache[0], "_origin", None)
    row = None if origin is None else origin[0]
    if row is None or any(getattr(layer, "_origin", None) != (row, n) for n, layer in enumerate(cache)):
        return None
    tokens = stored_tokens(cache[0])  # reads the layers' views: made once for the row
    views = row.views()
    for n, layer in enumerate(cache):
        if stored_tokens(layer) != tokens or any(a is not v[n] for a, v in zip((*layer.keys, *layer.values), views)):
            return None
    if not tokens or q4columns.mismatch([(row.arrays[:3], row.arrays[3:])]) is not None:
        return None
    return row, tokens


def extract_cache(batch, i: int, drop: int = 0) -> list:
    """Row `i` of a per-layer batch as a per-layer list of `QuantizedKVCache`, evaluated.

    `drop`: leave out the row's last `drop` columns (tokens fed after the turn ended).
    """
    out = queue_rows(batch, [i], drop)[0]
    mx.eval([(c.keys, c.values) for c in out if c.keys is not None])
    return out


def queue_rows(batch, rows, drop: int = 0, together: bool = True) -> list:
    """Rows `rows` of a per-layer batch, each as `extract_cache` gives it, queued for the device
    together (one `mx.async_eval`) and returned at once, without waiting for the work queued
    before them: evaluate each list (`mx.eval`) on this thread before anything else reads it.
    `together`: on the kernel route, take each row from all the layers in one launch where they allow it
    (`_all_layers`); False takes it a layer at a time (a retry after a failure).
    """
    settle(batch)
    out, at_once = [], together and _one_launch(batch)  # the same for every row of one batch
    for i in rows:
        # each layer's own padding: a bounded sliding layer stores fewer columns than a full one
        parts = [layer._extracted(i, drop, *layer.row_place(i)) for layer in batch]
        spans = {span for _, span in parts}
        if at_once and len(spans) == 1 and None not in spans:
            out.append(_all_layers(batch, i, *spans, [c for c, _ in parts]))
        else:
            out.append([layer._filled(i, c, span) for layer, (c, span) in zip(batch, parts)])
    mx.async_eval([row_arrays(caches) for caches in out])
    return out


def _all_layers(batch, i: int, span, caches) -> list:
    """`caches` (from each layer's `_extracted`) given row `i`'s columns `span` of every layer of `batch` (one
    that `_one_launch` accepts) in one `q4columns.gather` launch, each layer's arrays a view of one buffer a
    tensor (a `HeldRow`): a launch and six allocations where a launch a layer made six allocations each, and
    the allocations, of a size new to MLX's buffer cache at every turn's end, were most of a finishing step's
    hand-over on an H100."""
    start, stop = span
    plan = tuple((n, i, start, stop, 0) for n in range(len(batch)))
    keys, values = q4columns.gather([(layer.keys, layer.values) for layer in batch], plan, stop - start,
                                    checked=True)  # by `_one_launch`
    row = HeldRow((*keys, *values))
    for n, cache in enumerate(caches):
        cache.hold(row, n)
    return caches


def _one_launch(batch) -> bool:
    """Whether `q4columns.gather` can read every layer of `batch` at once: two layers or more, all on the kernel
    route, with one head count, and at each of the six tensors one last dim and dtype."""
    if len(batch) < 2 or any(layer.route != "q4kernel" or layer.keys is None for layer in batch):
        return False
    return q4columns.mismatch([(layer.keys, layer.values) for layer in batch]) is None


def settle(batch) -> None:
    """Queue every layer's last in-place write of per-layer batch `batch` (`BatchQuantizedKVCache._settle`) in one
    `mx.async_eval`: a call a layer gave up the GIL and won it back 32 times on the 8B shape, and each time another
    thread running Python could keep the caller waiting up to the switch interval (5 ms)."""
    layers = [layer for layer in batch if getattr(layer, "_pending", None) is not None]
    if layers:
        mx.async_eval([layer._pending for layer in layers])
        for layer in layers:
            layer._pending = None


def filter_cache(batch, keep) -> None:
    """Keep rows `keep` in every layer of `batch`."""
    settle(batch)
    for layer in batch:
        layer.filter(keep)


def extend_cache(batch, other, room: int = 1) -> None:
    """Append the rows of per-layer batch `other` to every layer of `batch` (`room`: as `extend` takes it)."""
    settle([*batch, *other])
    for mine, theirs in zip(batch, other):
        mine.extend(theirs, room)


def reserve_cache(batch, n: int) -> bool:
    """Make room for `n` more columns in every layer of `batch` now (`BatchQuantizedKVCache.reserve`);
    return whether any layer grew. Called before every decode step: where every layer has the room it
    does nothing, not even queue the layers' pending writes (`settle`, which gives up the GIL)."""
    if all(layer.fits(n) for layer in batch):
        return False
    settle(batch)
    grew = [layer.reserve(n) for layer in batch]
    return any(grew)


def history_tokens(cache) -> int:
    """Tokens every layer of a per-agent cache (or None) still stores: what a merge's `lead` may reach."""
    return min((stored_tokens(c) for c in cache), default=0) if cache else 0


def cache_tokens(cache) -> int:
    """Number of tokens in a per-agent cache (per-layer list of QuantizedKVCache), 0 for None."""
    if not cache or cache[0].empty():
        return 0
    return cache[0].offset


def can_trim(spec, cache, keep: int) -> bool:
    """Whether per-agent `cache` can be cut back to its first `keep` positions exactly.

    Full layers always can; a bounded sliding layer only while it still holds
    every key the next query's window reaches.
    """
    for window, c in zip(spec.windows, cache):
        if window is not None and not c.empty() and not _reaches(window, c.offset - stored_tokens(c), keep):
            return False
    return True


def can_trim_held(spec, tokens: int, keep: int) -> bool:
    """`can_trim` for a per-agent cache of `tokens` positions as a turn hands it out (a sliding layer keeps its
    last window + SLIDING_SLACK), known from the counts alone."""
    return all(window is None or _reaches(window, max(0, tokens - _keep(spec, n)), keep)
               for n, window in enumerate(spec.windows))


def _reaches(window: int, first: int, keep: int) -> bool:
    """Whether a sliding layer whose oldest stored token is at position `first` (0: it holds them all) holds every
    key that the window of the query at position `keep` reaches."""
    return first <= 0 or keep - window + 1 >= first
