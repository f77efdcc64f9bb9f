"""Attention over a `BatchQuantizedKVCache`: one function, routed by what the cache hands out.

mlx-lm's models call `mlx_lm.models.base.quantized_scaled_dot_product_attention`
for any cache that has a `bits` attribute. `install()` puts `sdpa` there; it is
the one change kvactors makes to a library's module, made in one explicit step:
`Engine` calls it when it is built (code that drives a `BatchQuantizedKVCache`
without an engine calls it first; the cache refuses to be built before). For packed keys and values
(the "quantized" route) `sdpa` does the math of mlx-lm's own function without
scaling the caller's queries in place, so other users of mlx-lm's
`QuantizedKVCache` in the process get the same results. A `RowRange` mask (the
"q4kernel" route's decode steps) sends packed keys and values to the CUDA
kernel of `runtime.q4sdpa`. For 16-bit keys and values (the dequantizing
routes, and prefill under "q4kernel") it picks the kernel by query length:

- fewer than 4 queries and no array mask: MLX's fused vector kernel;
- SHORT_QUERY or more: MLX's fused kernel (cuDNN on CUDA);
- otherwise (a hot turn's short prefill, or decode rows of unequal length):
  plain matmul + softmax with a boolean mask. On CUDA the fused kernel builds a
  cuDNN graph for every new (query length, key length): 60 ms each time a hot
  turn brings a new key length on an H100, more than the whole attention costs
  unfused. Plain ops build nothing per shape.
"""

from __future__ import annotations

import contextlib
import functools
from dataclasses import dataclass

import mlx.core as mx
from mlx_lm.models import base as mlx_base

from runtime import q4sdpa
from runtime.kvscheme import KVScheme, plain, rotate

SHORT_QUERY = 512  # queries per call from which the fused kernel's per-shape setup pays off


@dataclass(frozen=True)
class RowRange:
    """A mask given as ranges, for decode steps and short prefill chunks (`q4sdpa.q4_decode_sdpa`): row b
    attends to columns [start[b], end) of whole packed buffers, each query causally up to its own column and
    only the last `window` of them when `window` > 0. `rope`: (positions, inv_freq) when the queries
    are not yet rotated by RoPE and the kernel rotates them (`q4sdpa.q4_decode_sdpa`). `flat`: the
    output comes as (B, L, heads x head_dim), not (B, heads, L, head_dim) (`q4sdpa.q4_decode_sdpa`'s
    `flat`): for a caller that asks, never for a model's own attention code."""

    start: mx.array
    end: int
    window: int
    meta: mx.array  # `q4sdpa.meta(end, window, queries)`, made once per step rather than once per layer
    rope: tuple | None = None
    flat: bool = False


def install() -> None:
    """Make mlx-lm's models call `sdpa` for caches with a `bits` attribute, process-wide (idempotent).

    mlx-lm's own `QuantizedKVCache` users get the same results as before (see the
    module docstring).
    """
    mlx_base.quantized_scaled_dot_product_attention = sdpa


def installed() -> bool:
    """Whether `install` has run in this process."""
    return mlx_base.quantized_scaled_dot_product_attention is sdpa


@contextlib.contextmanager
def watching(caches):
    """Record, while the block runs, which of `caches` (mlx-lm caches without `bits`, one per layer) a layer
    hands to mlx-lm's `scaled_dot_product_attention`; yields the set of their indices, filled as it happens.

    mlx-lm's function routes by hasattr(cache, "bits"), the same question that sends a batch cache's attention
    to `sdpa`: a layer whose cache is asked attends through it, one that never asks computes attention in its
    own code and would read the batch cache's packed keys and masks itself. The caches behave as before (they
    still have no `bits`, so the attention runs as it would); they get their own type back afterwards.
    """
    seen: set[int] = set()
    kept = [(c, type(c)) for c in caches]
    try:
        for i, (c, cls) in enumerate(kept):
            c._kvactors_asked = functools.partial(seen.add, i)
            c.__class__ = _watched(cls)
        yield seen
    finally:
        for c, cls in kept:
            c.__class__ = cls
            c.__dict__.pop("_kvactors_asked", None)


@functools.cache
def _watched(cls: type) -> type:
    """`cls` with a `bits` that records the question (`watching`) and answers as `cls` does."""
    def bits(self):
        self._kvactors_asked()
        return super(watched, self).bits  # AttributeError where `cls` has none

    watched = type(f"Watched{cls.__name__}", (cls,), {"bits": property(bits), "__module__": __name__})
    return watched


def sdpa(queries, keys, values, scale, mask, group_size: int = 64, bits: int | KVScheme = 4):
    """Attention of `queries` (B, Hq, L, D) over keys and values of a batch cache.

    `keys`/`values` are packed (words, scales, biases) tuples or 16-bit arrays
    (B, Hkv, S, D), stored under `bits`: a `KVScheme` (what a `BatchQuantizedKVCache`
    hands mlx-lm as its `bits`) or an int (mlx-lm's own QuantizedKVCache: that many
    bits for keys and values, unrotated). Under a rotating scheme the keys and values
    are rotated, so the queries are rotated before and the output rotated back after,
    whatever the route. `mask` is None, "causal", or a boolean or additive array
    broadcastable to (B, 1, L, S). `queries` is not modified. Returns (B, Hq, L, D), or (B, L, Hq * D)
    for a `RowRange` mask that asks (`flat`).
    """
    scheme = bits if isinstance(bits, KVScheme) else plain(bits, group_size)
    if isinstance(mask, RowRange):  # the kernel rotates queries and output itself: no extra primitives per layer
        return q4sdpa.q4_decode_sdpa(queries, keys, values, mask.start, mask.end, scale, scheme.group_size,
                                     mask.meta, mask.window, rotated=scheme.rotated, rope=mask.rope,
                                     flat=mask.flat)
    out = _routed_sdpa(rotate(queries, scheme), keys, values, scale, mask, scheme)
    return rotate(out, scheme)


def _routed_sdpa(queries, keys, values, scale, mask, scheme: KVScheme):
    """`sdpa` on keys and values in the basis they are stored in (queries already rotated to it)."""
    if isinstance(keys, tuple):
        return quantized_sdpa(queries, keys, values, scale, mask, scheme.group_size, scheme.key_bits,
                              scheme.value_bits)
    L = queries.shape[2]
    if L >= SHORT_QUERY or (L < 4 and not isinstance(mask, mx.array)):
        return mx.fast.scaled_dot_product_attention(queries, keys, values, scale=scale, mask=mask)
    return plain_sdpa(queries, keys, values, scale, mask)


def _causal(L: int, S: int):
    """The boolean mask of L queries that are the last L of S positions."""
    return mx.arange(S - L, S)[:, None] >= mx.arange(S)[None]


def _grouped(queries, n_kv_heads):
    """(B, Hq, L, D) -> (B, Hkv, Hq/Hkv * L, D): each kv head's queries in one matrix."""
    B, n_q_heads, L, D = queries.shape
    return queries.reshape(B, n_kv_heads, (n_q_heads // n_kv_heads) * L, D)


def _masked(scores, mask, L: int):
    """Apply `mask` to scores (B, Hkv, R * L, S); returns (B, Hkv, R, L, S)."""
    B, H, RL, S = scores.shape
    scores = scores.reshape(B, H, RL // L, L, S)
    if isinstance(mask, str):
        mask = _causal(L, S)
    if mask is None:
        return scores
    if mask.ndim == 4:
        mask = mx.expand_dims(mask, 2)  # (B, 1, L, S) -> (B, 1, 1, L, S)
    if mask.dtype == mx.bool_:
        return mx.where(mask, scores, mx.finfo(scores.dtype).min)
    return scores + mask


def plain_sdpa(queries, keys, values, scale, mask):
    """Attention by matmul + softmax (fp32) + matmul over 16-bit keys and values; GQA by grouping."""
    B, n_q_heads, L, D = queries.shape
    q = _grouped(queries * scale, keys.shape[1])
    scores = (q @ keys.swapaxes(-1, -2)).astype(mx.float32)
    probs = mx.softmax(_masked(scores, mask, L), axis=-1).astype(values.dtype)
    out = probs.reshape(B, keys.shape[1], -1, keys.shape[2]) @ values
    return out.reshape(B, n_q_heads, L, -1)


def quantized_sdpa(queries, q_keys, q_values, scale, mask, group_size=64, bits=4, value_bits=None):
    """Attention of `queries` over packed quantized keys and values (mlx-lm's scheme).

    queries: (B, n_q_heads, L, D); q_keys / q_values: (words, scales, biases) of
    shape (B, n_kv_heads, S, ...), keys of `bits` bits, values of `value_bits`
    (default: `bits`). `mask` is None, "causal", or a boolean or additive array
    broadcastable to (B, heads, L, S). `queries` is not modified.
    """
    B, n_q_heads, L, D = queries.shape
    n_kv_heads = q_keys[0].shape[-3]
    n_repeats = n_q_heads // n_kv_heads
    queries = queries * scale
    if n_repeats > 1:
        queries = mx.reshape(queries, (B, n_kv_heads, n_repeats, L, D))
        q_keys = [mx.expand_dims(x, -3) for x in q_keys]
        q_values = [mx.expand_dims(x, -3) for x in q_values]
    scores = mx.quantized_matmul(queries, *q_keys, transpose=True, group_size=group_size, bits=bits)
    if isinstance(mask, str):
        qL, kL = scores.shape[-2:]
        mask = _causal(qL, kL)
    if mask is not None:
        if n_repeats > 1 and mask.ndim > 3:
            mask = mx.expand_dims(mask, -3)
        if mask.dtype == mx.bool_:
            scores = mx.where(mask, scores, mx.finfo(scores.dtype).min)
        else:
            scores = scores + mask
    scores = mx.softmax(scores, axis=-1, precise=True)
    out = mx.quantized_matmul(scores, *q_values, transpose=False, group_size=group_size,
                              bits=bits if value_bits is None else value_bits)
    if n_repeats > 1:
        out = mx.reshape(out, (B, n_q_heads, L, -1))
    return out
