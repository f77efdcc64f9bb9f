"""The CUDA kernels (runtime.qgemv, runtime.qgemm, runtime.q4sdpa, runtime.q4pack, runtime.cudacopy) against
float32 or MLX references, and their batch invariance: a row's result is bitwise the same whatever else is
in the batch.

Skipped off CUDA (the kernels exist only there). On the GPU:
    python -m pytest tests/test_cuda_kernels.py
"""

import math
import types

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest

from runtime import cudacopy, q4pack, q4sdpa, qgemm, qgemv
from runtime.kvscheme import KVScheme, rotate

pytestmark = pytest.mark.skipif(not qgemv.available(), reason="CUDA-only kernels")


def weights(n, k, group, seed=0):
    w = mx.random.normal((n, k), key=mx.random.key(seed)).astype(mx.bfloat16)
    packed = mx.quantize(w, group_size=group, bits=4)
    mx.eval(packed)
    return packed


def reference_gemv(x, packed, group):
    w = mx.dequantize(*packed, group_size=group, bits=4).astype(mx.float32)
    return x.astype(mx.float32) @ w.T


@pytest.mark.parametrize("dtype", [mx.bfloat16, mx.float16])
@pytest.mark.parametrize("group", [32, 64, 128])
@pytest.mark.parametrize("n,k", [(4096, 4096), (1000, 640), (96, 1536), (14336, 4096), (4096, 14336), (49152, 576)])
def test_qgemv_matches_float32_and_each_row_is_batch_invariant(n, k, group, dtype):
    if k % group:
        pytest.skip("the group must divide K")
    packed = tuple(a.astype(dtype) if a.dtype != mx.uint32 else a for a in weights(n, k, group))
    x = mx.random.normal((qgemv.MAX_ROWS, k), key=mx.random.key(1)).astype(dtype)
    full = qgemv.qgemv(x, *packed, group)
    ref = reference_gemv(x, packed, group)
    err = (mx.abs(full.astype(mx.float32) - ref).max() / mx.abs(ref).max()).item()
    assert err < 1e-2
    for rows in range(1, qgemv.MAX_ROWS + 1):
        part = qgemv.qgemv(x[:rows], *packed, group)
        assert mx.array_equal(part, full[:rows]).item(), f"rows 0..{rows} changed with the batch"
    as_3d = qgemv.qgemv(x[:8, None, :], *packed, group)  # a decode step's (B, 1, K): no reshape needed
    assert as_3d.shape == (8, 1, n) and mx.array_equal(as_3d[:, 0], full[:8]).item()



def test_qgemv_of_no_rows_is_empty_and_reads_nothing():
    """Rows past the batch read its last row (no branch); with no rows there is none, so the kernel stops first."""
    packed = weights(1000, 640, 32)
    x = mx.zeros((0, 1, 640), mx.bfloat16)
    assert qgemv.qgemv(x, *packed, 32).shape == (0, 1, 1000)
    assert [y.shape for y in qgemv.qgemv_parts(x, [packed, packed], 32)] == [(0, 1, 1000)] * 2
    assert qgemv.qgemv_swiglu(x, packed, packed, 32).shape == (0, 1, 1000)
    mx.synchronize()


@pytest.mark.parametrize("dtype", [mx.bfloat16, mx.float16])
@pytest.mark.parametrize("n,k,group", [(4096, 4096, 64), (1000, 640, 32), (14336, 4096, 128), (4096, 14336, 64),
                                       (100, 192, 64), (1024, 4096, 64)])
def test_qgemm_matches_float32_and_each_row_is_the_same_in_any_chunk(n, k, group, dtype):
    packed = tuple(a.astype(dtype) if a.dtype != mx.uint32 else a for a in weights(n, k, group))
    x = mx.random.normal((200, k), key=mx.random.key(2)).astype(dtype)
    full = qgemm.qgemm(x, *packed, group)
    assert full.shape == (200, n) and full.dtype == dtype
    assert relative_error(full, reference_gemv(x, packed, group)) < 1e-2
    for rows in (17, 40, 64, 65, 130):  # fewer tiles of 8, a partial second or third slice of 64 rows
        assert mx.array_equal(qgemm.qgemm(x[:rows], *packed, group), full[:rows]).item(), rows
    # a row's place in the chunk does not matter either; leading dimensions are kept
    assert mx.array_equal(qgemm.qgemm(x[70:134], *packed, group), full[70:134]).item()
    as_3d = qgemm.qgemm(x[:128].reshape(2, 64, k), *packed, group)
    assert as_3d.shape == (2, 64, n) and mx.array_equal(as_3d.reshape(128, n), full[:128]).item()


@pytest.mark.parametrize("dtype", [mx.bfloat16, mx.float16])
@pytest.mark.parametrize("ns,k,group", [((4096, 1024, 1024), 4096, 64), ((1000, 96, 40), 640, 32), ((14336, 14336), 4096, 128)])
def test_qgemm_parts_match_float32_in_one_launch_and_each_row_is_the_same_in_any_chunk(ns, k, group, dtype):
    packed = [tuple(a.astype(dtype) if a.dtype != mx.uint32 else a for a in weights(n, k, group, seed=i))
              for i, n in enumerate(ns)]
    x = mx.random.normal((150, k), key=mx.random.key(5)).astype(dtype)
    full = qgemm.qgemm_parts(x, packed, group)
    assert [y.shape for y in full] == [(150, n) for n in ns]
    for y, p in zip(full, packed):
        assert relative_error(y, reference_gemv(x, p, group)) < 1e-2
    for rows in (17, 64, 100):
        assert all(mx.array_equal(a, b[:rows]).item() for a, b in zip(qgemm.qgemm_parts(x[:rows], packed, group), full))
    with pytest.raises(ValueError, match="1 to 3 weights"):
        qgemm.qgemm_parts(x, packed * 2, group)


@pytest.mark.parametrize("dtype", [mx.bfloat16, mx.float16])
@pytest.mark.parametrize("n,k,group", [(14336, 4096, 64), (1000, 640, 32), (1536, 576, 64), (100, 512, 128)])
def test_qgemm_swiglu_is_bitwise_llama_swiglu_of_the_parts_and_each_row_the_same_in_any_chunk(n, k, group, dtype):
    """silu(gate) up in the launch that writes it, K split (a sum launch writes it: all but the first case) or not,
    bitwise as mlx-lm's `swiglu` of `qgemm_parts`' gate and up; N not a multiple of a block's 64 columns too."""
    from mlx_lm.models.llama import swiglu

    assert (qgemm.splits(2 * n, k) == 1) == (n == 14336)
    gate, up = [tuple(a.astype(dtype) if a.dtype != mx.uint32 else a for a in weights(n, k, group, seed=20 + i))
                for i in range(2)]
    x = mx.random.normal((2, 75, k), key=mx.random.key(21)).astype(dtype)
    got = qgemm.qgemm_swiglu(x, gate, up, group)
    assert got.shape == (2, 75, n) and got.dtype == dtype
    assert mx.array_equal(got, swiglu(*qgemm.qgemm_parts(x, [gate, up], group))).item()
    flat = x.reshape(150, k)
    for rows in (17, 64, 100):
        assert mx.array_equal(qgemm.qgemm_swiglu(flat[:rows], gate, up, group), got.reshape(150, n)[:rows]).item()
    with pytest.raises(ValueError, match="one shape"):
        qgemm.qgemm_swiglu(x, gate, tuple(a[:-4] for a in up), group)


@pytest.mark.parametrize("dtype", [mx.bfloat16, mx.float16])
@pytest.mark.parametrize("n", [4096, 28672])  # K split in 8 slices (a sum launch), and not split (the product's)
def test_qgemm_adds_a_residual_bitwise_as_a_separate_add(n, dtype):
    """`add` (a residual) is added where the result is written, bitwise as MLX adds it after the product."""
    k = 4096
    assert (qgemm.splits(n, k) == 1) == (n == 28672)
    packed = tuple(a.astype(dtype) if a.dtype != mx.uint32 else a for a in weights(n, k, 64, seed=7))
    x = mx.random.normal((2, 40, k), key=mx.random.key(8)).astype(dtype)
    residual = mx.random.normal((2, 40, n), key=mx.random.key(9)).astype(dtype)
    got = qgemm.qgemm(x, *packed, 64, add=residual)
    assert got.shape == (2, 40, n) and got.dtype == dtype
    assert mx.array_equal(got, residual + qgemm.qgemm(x, *packed, 64)).item()


@pytest.mark.parametrize("dtype", [mx.bfloat16, mx.float16])
@pytest.mark.parametrize("ns,head_dim", [((4096, 1024, 1024), 128), ((2048, 512, 512), 64), ((14336, 14336), 128)])
def test_qgemm_parts_write_the_heads_layout_attention_takes(ns, head_dim, dtype):
    """With head_dim, each result is (B, N / head_dim, L, head_dim), bitwise the plain result's heads transposed,
    whether K is split (a sum launch writes it) or not (the product launch does: the last case)."""
    k = 4096
    packed = [tuple(a.astype(dtype) if a.dtype != mx.uint32 else a for a in weights(n, k, 64, seed=10 + i))
              for i, n in enumerate(ns)]
    x = mx.random.normal((3, 24, k), key=mx.random.key(11)).astype(dtype)
    plain = qgemm.qgemm_parts(x, packed, 64)
    heads = qgemm.qgemm_parts(x, packed, 64, head_dim=head_dim)
    for y, h, n in zip(plain, heads, ns):
        assert h.shape == (3, n // head_dim, 24, head_dim) and h.dtype == dtype
        assert mx.array_equal(h, y.reshape(3, 24, n // head_dim, head_dim).transpose(0, 2, 1, 3)).item()


def test_qgemm_refuses_a_residual_or_heads_layout_it_cannot_write():
    packed = weights(256, 128, 64)
    x = mx.zeros((2, 20, 128), mx.bfloat16)
    with pytest.raises(ValueError, match="one weight"):
        qgemm.qgemm_parts(x, [packed, packed], 64, add=mx.zeros((2, 20, 256), mx.bfloat16))
    with pytest.raises(ValueError, match="shape"):
        qgemm.qgemm(x, *packed, 64, add=mx.zeros((2, 20, 128), mx.bfloat16))
    with pytest.raises(ValueError, match="dtype"):
        qgemm.qgemm(x, *packed, 64, add=mx.zeros((2, 20, 256), mx.float16))
    with pytest.raises(ValueError, match="head_dim"):
        qgemm.qgemm_parts(x.reshape(40, 128), [packed], 64, head_dim=64)  # no (B, L) to lay the heads in
    with pytest.raises(ValueError, match="head_dim"):
        qgemm.qgemm_parts(x, [packed], 64, head_dim=96)  # 256 outputs are no whole heads of 96


def test_qgemm_refuses_what_it_cannot_read():
    packed = weights(96, 128, 64)
    with pytest.raises(ValueError, match="multiple of 64"):
        qgemm.qgemm(mx.zeros((20, 128), mx.float32), *packed, 64)  # float32 input
    odd = weights(98, 128, 64)
    assert not qgemm.supports(mx.zeros((20, 128), mx.bfloat16), odd[0], odd[1], 64)  # N not a multiple of 4
    assert not qgemm.supports(mx.zeros((20, 96), mx.bfloat16), *packed[:2], 32)  # K not the weight's
    assert qgemm.supports(mx.zeros((20, 128), mx.bfloat16), *packed[:2], 64)


def relative_error(a, ref):
    return (mx.abs(a.astype(mx.float32) - ref).max() / mx.abs(ref).max()).item()


@pytest.mark.parametrize("dtype", [mx.bfloat16, mx.float16])
@pytest.mark.parametrize("ns,k,group", [((4096, 1024, 1024), 4096, 64), ((1000, 96, 40), 640, 32), ((14336, 14336), 4096, 128),
                                        ((128, 64, 64), 128, 32)])
def test_qgemv_parts_match_float32_in_one_launch_and_each_row_is_batch_invariant(ns, k, group, dtype):
    parts = [tuple(a.astype(dtype) if a.dtype != mx.uint32 else a for a in weights(n, k, group, seed=i))
             for i, n in enumerate(ns)]
    x = mx.random.normal((qgemv.MAX_ROWS, k), key=mx.random.key(1)).astype(dtype)
    full = qgemv.qgemv_parts(x, parts, group)
    for out, packed in zip(full, parts):
        assert relative_error(out, reference_gemv(x, packed, group)) < 1e-2
    for rows in range(1, qgemv.MAX_ROWS + 1):
        some = qgemv.qgemv_parts(x[:rows], parts, group)
        assert all(mx.array_equal(a, b[:rows]).item() for a, b in zip(some, full)), f"rows 0..{rows} changed"
    # a decode step's (B, 1, H * 64) written as mlx-lm's (B, H, 1, 64): its reshape and transpose, for free
    heads = qgemv.qgemv_parts(x[:5, None, :], parts, group, [(5, n // 8, 1, 8) for n in ns])
    for a, b in zip(heads, full):
        assert mx.array_equal(a, b[:5].reshape(5, 1, -1, 8).transpose(0, 2, 1, 3)).item()


@pytest.mark.parametrize("dtype", [mx.bfloat16, mx.float16])
@pytest.mark.parametrize("n,k,group", [(14336, 4096, 64), (1000, 640, 32), (256, 128, 32)])
def test_qgemv_swiglu_is_mlxs_silu_product_of_the_two_products(n, k, group, dtype, monkeypatch):
    """One launch for a gated MLP's gate, up and SiLU product: each row bitwise MLX's `nn.silu(gate) * up` of
    the two products as `qgemv_parts` sums them with 8-byte loads, the same in any batch, and within bf16 of
    float32."""
    gate, up = [tuple(a.astype(dtype) if a.dtype != mx.uint32 else a for a in weights(n, k, group, seed=i))
                for i in (3, 4)]
    x = mx.random.normal((qgemv.MAX_ROWS, k), key=mx.random.key(2)).astype(dtype)
    fused = qgemv.qgemv_swiglu(x, gate, up, group)
    monkeypatch.setattr(qgemv, "K_PER_LANE", 16)  # qgemv_parts with the swiglu's loads (so its summation order)
    monkeypatch.setattr(qgemv, "_launch", {})
    g, u = qgemv.qgemv_parts(x, [gate, up], group)
    composed = nn.silu(g) * u
    differ = (fused != composed).sum().item()
    assert differ == 0, f"{differ} of {fused.size} elements differ from MLX's silu product, " \
                        f"by up to {mx.abs(fused.astype(mx.float32) - composed.astype(mx.float32)).max().item()}"
    ref_g, ref_u = reference_gemv(x, gate, group), reference_gemv(x, up, group)
    assert relative_error(fused, ref_g * mx.sigmoid(ref_g) * ref_u) < 2e-2
    for rows in (1, 2, 5, 8, 9, 16):
        assert mx.array_equal(qgemv.qgemv_swiglu(x[:rows], gate, up, group), fused[:rows]).item()
    with pytest.raises(ValueError, match="of one shape"):
        qgemv.qgemv_swiglu(x, gate, weights(n + 32, k, group), group)

def cast(packed, dtype):
    return tuple(a.astype(dtype) if a.dtype != mx.uint32 else a for a in packed)


@pytest.mark.parametrize("dtype", [mx.bfloat16, mx.float16])
@pytest.mark.parametrize("n,k,group", [(4096, 4096, 64), (4096, 14336, 64), (1000, 640, 32)])
def test_qgemv_adds_a_residual_in_its_launch_bitwise_as_a_separate_add(n, k, group, dtype):
    packed = cast(weights(n, k, group), dtype)
    x = mx.random.normal((qgemv.MAX_ROWS, 1, k), key=mx.random.key(1)).astype(dtype)
    r = (mx.random.normal((qgemv.MAX_ROWS, 1, n), key=mx.random.key(2)) * 4).astype(dtype)
    fused = qgemv.qgemv(x, *packed, group, add=r)
    assert mx.array_equal(fused, r + qgemv.qgemv(x, *packed, group)).item()
    for rows in (1, 3, 8, 9):
        assert mx.array_equal(qgemv.qgemv(x[:rows], *packed, group, add=r[:rows]), fused[:rows]).item()
    with pytest.raises(ValueError, match="shape"):
        qgemv.qgemv(x, *packed, group, add=r[:, :, :-1])


def packed_cache(b, hkv, w, d, seed, key_bits=4):
    k = mx.random.normal((b, hkv, w, d), key=mx.random.key(seed)).astype(mx.bfloat16)
    v = mx.random.normal((b, hkv, w, d), key=mx.random.key(seed + 1)).astype(mx.bfloat16)
    kq, vq = tuple(mx.quantize(k, 64, key_bits)), tuple(mx.quantize(v, 64, 4))
    mx.eval(kq, vq)
    return kq, vq


def reference_attention(q, kq, vq, start, end, scale, window=0):
    """float32 attention of row b over columns [start[b], end) of the dequantized cache, causal for
    L queries (query l at column end - L + l sees the columns up to it; the last `window` of them if
    `window` > 0)."""
    d = q.shape[-1]
    k = mx.dequantize(*kq, group_size=64, bits=kq[0].shape[-1] * 32 // d).astype(mx.float32)
    v = mx.dequantize(*vq, group_size=64, bits=4).astype(mx.float32)
    rep = q.shape[1] // k.shape[1]
    k, v = mx.repeat(k, rep, axis=1), mx.repeat(v, rep, axis=1)
    s = (q.astype(mx.float32) * scale) @ k.swapaxes(-1, -2)
    cols = mx.arange(k.shape[2])[None, None]  # (1, 1, W)
    pos = (end - q.shape[2] + mx.arange(q.shape[2]))[None, :, None]  # (1, L, 1)
    valid = (cols >= start[:, None, None]) & (cols <= pos)
    if window:
        valid = valid & (cols > pos - window)
    s = mx.where(valid[:, None], s, -math.inf)
    return mx.softmax(s, axis=-1) @ v


def poison(packed, start, end):
    """The same cache with every column outside [start[b], end) set to huge scales (NaN-free garbage)."""
    cols = mx.arange(packed[0].shape[2])
    outside = (cols[None] < start[:, None]) | (cols[None] >= end)
    outside = outside[:, None, :, None]
    words, scales, biases = packed
    return (mx.where(outside, mx.array(0xFFFFFFFF, dtype=mx.uint32), words),
            mx.where(outside, mx.array(3e4, dtype=scales.dtype), scales),
            mx.where(outside, mx.array(-3e4, dtype=biases.dtype), biases))


@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("hq,hkv", [(8, 8), (8, 2), (32, 4), (9, 3), (12, 2), (32, 1)])  # GQA 1, 4, 8, 3, 6, 32
@pytest.mark.parametrize("end", [1, 255, 257, 1500])
@pytest.mark.parametrize("key_bits", [4, 6])
def test_q4_decode_attention_matches_float32_and_ignores_other_columns(d, hq, hkv, end, key_bits):
    b, width = 4, end + 40
    kq, vq = packed_cache(b, hkv, width, d, seed=end, key_bits=key_bits)
    start = mx.array([0, end // 3, end - 1, end // 2], dtype=mx.int32)  # ragged rows (left padding)
    q = mx.random.normal((b, hq, 1, d), key=mx.random.key(7)).astype(mx.bfloat16)
    scale = d ** -0.5
    out = q4sdpa.q4_decode_sdpa(q, kq, vq, start, end, scale, 64)
    ref = reference_attention(q, kq, vq, start, end, scale)
    assert (mx.abs(out.astype(mx.float32) - ref).max()).item() < 2e-2
    poisoned = q4sdpa.q4_decode_sdpa(q, poison(kq, start, end), poison(vq, start, end), start, end, scale, 64)
    assert mx.array_equal(poisoned, out).item()  # padding and spare columns are never read


def test_q4_decode_attention_takes_each_calls_scale():
    """The scale is compiled into the kernel: calls with other scales (one compile each) each match float32."""
    b, hq, hkv, d, end = 2, 32, 8, 128, 700
    kq, vq = packed_cache(b, hkv, end, d, seed=3, key_bits=6)
    start = mx.array([0, 100], dtype=mx.int32)
    q = mx.random.normal((b, hq, 1, d), key=mx.random.key(4)).astype(mx.bfloat16)
    outs = []
    for scale in (0.02, 0.3, 0.02):
        outs.append(q4sdpa.q4_decode_sdpa(q, kq, vq, start, end, scale, 64))
        ref = reference_attention(q, kq, vq, start, end, scale)
        assert (mx.abs(outs[-1].astype(mx.float32) - ref).max()).item() < 2e-2
    assert not mx.array_equal(outs[0], outs[1]).item() and mx.array_equal(outs[0], outs[2]).item()


@pytest.mark.parametrize("window", [1, 100, 256, 700])
def test_q4_decode_attention_with_a_window_reads_only_each_rows_last_columns(window):
    b, hq, hkv, d, end = 4, 32, 8, 128, 1500
    kq, vq = packed_cache(b, hkv, end + 8, d, seed=window)
    start = mx.array([0, 900, end - 1, 1300], dtype=mx.int32)  # some rows shorter than the window
    q = mx.random.normal((b, hq, 1, d), key=mx.random.key(9)).astype(mx.bfloat16)
    out = q4sdpa.q4_decode_sdpa(q, kq, vq, start, end, d ** -0.5, 64, window=window)
    ref = reference_attention(q, kq, vq, start, end, d ** -0.5, window)
    assert (mx.abs(out.astype(mx.float32) - ref).max()).item() < 2e-2
    first = mx.maximum(start, end - window)
    poisoned = q4sdpa.q4_decode_sdpa(q, poison(kq, first, end), poison(vq, first, end), start, end, d ** -0.5, 64,
                                     window=window)
    assert mx.array_equal(poisoned, out).item()


@pytest.mark.parametrize("profile", ["step just under the rescale", "sawtooth", "late spike", "falling"])
@pytest.mark.parametrize("n", [1, 5])  # a decode step, a short prefill
def test_q4_attention_follows_scores_that_rise_far_past_a_chunks_first_tiles(profile, n):
    """The kernel keeps a reference max that moves only when a tile's max passes it by more than 8 (base 2): scores
    that rise by just under that (exponentials up to 2^7.9), by 16 over every 160 columns (a move every few
    tiles), by 40 at one late column, or that fall, all match float32. (Scores are kept where 16-bit keys hold
    them to well under a hundredth: a ramp to 300 loses that in the keys themselves.)"""
    b, hq, hkv, d, end = 2, 32, 8, 128, 1500
    cols = mx.arange(end + 8).astype(mx.float32)
    base2 = {"step just under the rescale": mx.where(cols >= 64, 7.9, 0.0), "sawtooth": 0.1 * (cols % 160),
             "late spike": mx.where(cols == 1000, 40.0, 0.0), "falling": -0.05 * cols}[profile]
    u = mx.random.normal((d,), key=mx.random.key(5))
    u = u / mx.linalg.norm(u)
    scale = d ** -0.5
    noise = mx.random.normal((b, hkv, end + 8, d), key=mx.random.key(6)) * 0.5
    k = (noise + (base2 / (scale * math.log2(math.e)))[None, None, :, None] * u).astype(mx.bfloat16)
    v = mx.random.normal((b, hkv, end + 8, d), key=mx.random.key(7)).astype(mx.bfloat16)
    kq, vq = tuple(mx.quantize(k, 64, 6)), tuple(mx.quantize(v, 64, 4))
    q = mx.broadcast_to(u, (b, hq, n, d)).astype(mx.bfloat16)
    start = mx.array([0, 300], dtype=mx.int32)
    out = q4sdpa.q4_decode_sdpa(q, kq, vq, start, end, scale, 64)
    ref = reference_attention(q, kq, vq, start, end, scale)
    assert (mx.abs(out.astype(mx.float32) - ref).max()).item() < 2e-2


@pytest.mark.parametrize("key_bits", [4, 6])
def test_q4_decode_attention_of_a_row_is_the_same_in_any_batch(key_bits):
    hq, hkv, d, end = 32, 8, 128, 3000
    kq, vq = packed_cache(8, hkv, end, d, seed=3, key_bits=key_bits)
    q = mx.random.normal((8, hq, 1, d), key=mx.random.key(4)).astype(mx.bfloat16)
    starts = mx.array([0, 100, 2999, 512, 7, 1024, 300, 2000], dtype=mx.int32)
    full = q4sdpa.q4_decode_sdpa(q, kq, vq, starts, end, d ** -0.5, 64)
    for b in (1, 2, 5):
        part = q4sdpa.q4_decode_sdpa(q[:b], tuple(x[:b] for x in kq), tuple(x[:b] for x in vq), starts[:b], end,
                                     d ** -0.5, 64)
        assert mx.array_equal(part, full[:b]).item()
    # the same row shifted right by left padding gives the same output bitwise
    shift = 256 + 13
    kq2 = tuple(mx.concatenate([mx.zeros((1, hkv, shift, x.shape[-1]), x.dtype), x[:1]], axis=2) for x in kq)
    vq2 = tuple(mx.concatenate([mx.zeros((1, hkv, shift, x.shape[-1]), x.dtype), x[:1]], axis=2) for x in vq)
    shifted = q4sdpa.q4_decode_sdpa(q[:1], kq2, vq2, mx.array([shift], dtype=mx.int32), end + shift, d ** -0.5, 64)
    assert mx.array_equal(shifted, full[:1]).item()


@pytest.mark.parametrize("n", [1, 40])  # a decode step, a prefill chunk
def test_q4_attention_leaves_its_counters_zero_so_calls_one_after_another_may_share_them(n):
    """The last block of each tile combines the chunks and sets its counter back: the array is zeros again after a
    call, and chained calls (each taking the one before's output) that share it match calls that each had their
    own zeros, bitwise."""
    b, hq, hkv, d, end = 3, 32, 8, 128, 2500  # several chunks a row
    kq, vq = packed_cache(b, hkv, end, d, seed=31, key_bits=6)
    start = mx.array([0, 1234, 2000], dtype=mx.int32)
    counters = q4sdpa.block_counters(q4sdpa.counters_for(b, hq, hkv, n))
    q = mx.random.normal((b, hq, n, d), key=mx.random.key(32)).astype(mx.bfloat16)
    own, shared = q, q
    for _ in range(4):
        own = q4sdpa.q4_decode_sdpa(own, kq, vq, start, end, d ** -0.5, 64, rotated=True)
        shared = q4sdpa.q4_decode_sdpa(shared, (*kq, counters), vq, start, end, d ** -0.5, 64, rotated=True)
    mx.eval(own, shared)
    assert mx.array_equal(own, shared).item()
    assert not mx.any(counters).item()
    ref = reference_attention(q, kq, vq, start, end, d ** -0.5)
    first = q4sdpa.q4_decode_sdpa(q, (*kq, counters), vq, start, end, d ** -0.5, 64)
    assert (mx.abs(first.astype(mx.float32) - ref).max()).item() < 2e-2


def test_q4_decode_attention_of_a_row_without_columns_is_zeros():
    """A row whose range is empty (start = end) has no block to combine it: its output is still written (zeros,
    over poison), and the other rows are as without it."""
    b, hq, hkv, d, end = 3, 32, 8, 128, 900
    kq, vq = packed_cache(b, hkv, end + 16, d, seed=33)
    start = mx.array([0, end, 300], dtype=mx.int32)
    q = mx.random.normal((b, hq, 1, d), key=mx.random.key(34)).astype(mx.bfloat16)
    for rotated in (False, True):
        out = q4sdpa.q4_decode_sdpa(q, kq, vq, start, end, d ** -0.5, 64, rotated=rotated)
        assert not mx.any(out[1]).item() and mx.all(mx.isfinite(out)).item()
        pair = q4sdpa.q4_decode_sdpa(q[::2], tuple(x[::2] for x in kq), tuple(x[::2] for x in vq), start[::2], end,
                                     d ** -0.5, 64, rotated=rotated)
        assert mx.array_equal(out[::2], pair).item()


@pytest.mark.parametrize("hq,hkv", [(32, 8), (32, 1), (64, 2)])  # 4, 32 and 32 query heads a kv head
def test_pack_kv_into_gives_the_attention_zeros_to_count_in_or_attention_makes_its_own(hq, hkv):
    """pack_kv_into's result is zeros, one per (row, kv head, new column): as many counters as the attention over
    those columns needs with up to HEADS query heads a kv head; with more, the attention makes its own, still
    after the write."""
    from runtime.kvscheme import parse

    scheme, d, b, end = parse("k6v4-g64-hadamard"), 128, 2, 700
    kb, vb = cache_buffers(b, hkv, 1024, d, scheme, mx.bfloat16, seed=40)
    k = mx.random.normal((b, hkv, 1, d), key=mx.random.key(41)).astype(mx.bfloat16)
    v = mx.random.normal((b, hkv, 1, d), key=mx.random.key(42)).astype(mx.bfloat16)
    q = mx.random.normal((b, hq, 1, d), key=mx.random.key(43)).astype(mx.bfloat16)
    start = mx.array([0, 650], dtype=mx.int32)
    written = q4pack.pack_kv_into(k, v, scheme, kb, vb, end)
    out = q4sdpa.q4_decode_sdpa(q, (*kb, written), vb, start, end, d ** -0.5, 64, rotated=True)
    mx.eval(out)
    assert written.shape == (max(4, b * hkv),) and not mx.any(written).item()
    again = q4sdpa.q4_decode_sdpa(q, kb, vb, start, end, d ** -0.5, 64, rotated=True)  # after the write
    assert mx.array_equal(out, again).item()  # the attention read the new column (poison before the write)


@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("hq,hkv", [(32, 8), (9, 3), (32, 1)])  # GQA 4, 3, 32
@pytest.mark.parametrize("n", [2, 64, 200, 512])
@pytest.mark.parametrize("key_bits", [4, 6])
def test_q4_prefill_attention_is_causal_matches_float32_and_ignores_other_columns(d, hq, hkv, n, key_bits):
    # a short prefill chunk: n queries a row, the last n of its columns, each attending up to its own
    b, end = 3, n + 1500
    kq, vq = packed_cache(b, hkv, end + 40, d, seed=n, key_bits=key_bits)
    start = mx.array([0, 700, end - n], dtype=mx.int32)  # ragged rows; the last holds only the chunk
    q = mx.random.normal((b, hq, n, d), key=mx.random.key(n + 3)).astype(mx.bfloat16)
    out = q4sdpa.q4_decode_sdpa(q, kq, vq, start, end, d ** -0.5, 64)
    assert out.shape == q.shape
    ref = reference_attention(q, kq, vq, start, end, d ** -0.5)
    assert (mx.abs(out.astype(mx.float32) - ref).max()).item() < 2e-2
    poisoned = q4sdpa.q4_decode_sdpa(q, poison(kq, start, end), poison(vq, start, end), start, end, d ** -0.5, 64)
    assert mx.array_equal(poisoned, out).item()
    part = q4sdpa.q4_decode_sdpa(q[1:2], tuple(x[1:2] for x in kq), tuple(x[1:2] for x in vq), start[1:2], end,
                                 d ** -0.5, 64)
    assert mx.array_equal(part, out[1:2]).item()  # a row's result does not depend on the batch


@pytest.mark.parametrize("window", [1, 100, 256, 700])
@pytest.mark.parametrize("n", [7, 128])
def test_q4_prefill_attention_with_a_window_gives_each_query_its_own_last_columns(window, n):
    b, hq, hkv, d, end = 3, 32, 8, 128, 1500
    kq, vq = packed_cache(b, hkv, end + 8, d, seed=window + n)
    start = mx.array([0, 900, end - n], dtype=mx.int32)
    q = mx.random.normal((b, hq, n, d), key=mx.random.key(5)).astype(mx.bfloat16)
    out = q4sdpa.q4_decode_sdpa(q, kq, vq, start, end, d ** -0.5, 64, window=window)
    ref = reference_attention(q, kq, vq, start, end, d ** -0.5, window)
    assert (mx.abs(out.astype(mx.float32) - ref).max()).item() < 2e-2
    first = mx.maximum(start, end - n + 1 - window)  # the first query's window: nothing before it is read
    poisoned = q4sdpa.q4_decode_sdpa(q, poison(kq, first, end), poison(vq, first, end), start, end, d ** -0.5, 64,
                                     window=window)
    assert mx.array_equal(poisoned, out).item()


@pytest.mark.parametrize("hq,hkv,d", [(32, 8, 128), (9, 3, 64), (32, 1, 128)])  # GQA 4, 3, 32
@pytest.mark.parametrize("n", [1, 5, 64, 300])
def test_q4_attention_writes_its_output_flat_bitwise_as_the_heads_transposed(hq, hkv, d, n):
    """`flat`: (B, L, Hq * D), bitwise the plain output's heads transposed, every element written (ragged rows, a
    row without columns: zeros), rotated or not."""
    b, end = 3, n + 900
    kq, vq = packed_cache(b, hkv, end + 16, d, seed=n + hq)
    start = mx.array([0, 400, end], dtype=mx.int32)  # the last row holds no columns: its output is zeros
    q = mx.random.normal((b, hq, n, d), key=mx.random.key(n + 1)).astype(mx.bfloat16)
    for rotated in (False, True):
        plain = q4sdpa.q4_decode_sdpa(q, kq, vq, start, end, d ** -0.5, 64, rotated=rotated)
        flat = q4sdpa.q4_decode_sdpa(q, kq, vq, start, end, d ** -0.5, 64, rotated=rotated, flat=True)
        assert flat.shape == (b, n, hq * d) and flat.dtype == q.dtype
        assert mx.array_equal(flat, plain.transpose(0, 2, 1, 3).reshape(b, n, -1)).item()
        assert not mx.any(flat[2]).item() and mx.any(flat[:2]).item()


def test_q4_prefill_attention_refuses_too_many_queries_and_rope():
    kq, vq = packed_cache(1, 2, 600, 64, seed=1)
    start = mx.array([0], dtype=mx.int32)
    with pytest.raises(ValueError, match="queries a row"):
        q4sdpa.q4_decode_sdpa(mx.zeros((1, 4, q4sdpa.MAX_QUERIES + 1, 64), mx.bfloat16), kq, vq, start, 600, 0.1, 64)
    rope = (mx.array([5], dtype=mx.int32), mx.ones((32,), mx.float32))
    with pytest.raises(ValueError, match="RoPE"):
        q4sdpa.q4_decode_sdpa(mx.zeros((1, 4, 2, 64), mx.bfloat16), kq, vq, start, 600, 0.1, 64, rope=rope)


@pytest.mark.parametrize("n", [1, 3])  # a decode step, a short prefill
@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("dtype", [mx.bfloat16, mx.float16])
def test_rotated_q4_decode_attention_rotates_queries_in_and_the_output_back(d, dtype, n):
    # keys and values stored rotated: the kernel's output equals rotate(attention(rotate(q))), in float32
    b, hq, hkv, end = 3, 16, 4, 700
    kq, vq = packed_cache(b, hkv, end + 8, d, seed=11)
    start = mx.array([0, 250, end - n], dtype=mx.int32)
    q = mx.random.normal((b, hq, n, d), key=mx.random.key(12)).astype(dtype)
    scheme = KVScheme(4, 4, 64, "hadamard")
    out = q4sdpa.q4_decode_sdpa(q, kq, vq, start, end, d ** -0.5, 64, rotated=True)
    h = rotate(mx.eye(d, dtype=dtype), scheme).astype(mx.float32)  # H with the entries `rotate` uses
    ref = reference_attention(q.astype(mx.float32) @ h, kq, vq, start, end, d ** -0.5) @ h
    assert out.dtype == dtype
    assert (mx.abs(out.astype(mx.float32) - ref).max()).item() < 2e-2
    plain = q4sdpa.q4_decode_sdpa(q, kq, vq, start, end, d ** -0.5, 64)
    assert not mx.array_equal(plain, out).item()
    part = q4sdpa.q4_decode_sdpa(q[1:2], tuple(x[1:2] for x in kq), tuple(x[1:2] for x in vq), start[1:2], end,
                                 d ** -0.5, 64, rotated=True)
    assert mx.array_equal(part, out[1:2]).item()


@pytest.mark.parametrize("name", ["k4v4-g64", "k6v4-g64", "k8v8-g32", "k6v4-g128", "k4v4-g32"])
@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("dtype", [mx.bfloat16, mx.float16])
def test_pack_kv_packs_unrotated_keys_and_values_bit_for_bit_as_mx_quantize(name, d, dtype):
    from runtime.kvscheme import parse

    scheme = parse(name)
    if d % scheme.group_size:
        pytest.skip("group larger than the head")
    k = (mx.random.normal((3, 4, 5, d), key=mx.random.key(1)) * 3).astype(dtype)
    v = mx.random.normal((3, 4, 5, d), key=mx.random.key(2)).astype(dtype)
    k = mx.concatenate([k[..., :1, :] * 0, mx.abs(k[..., 1:2, :]), k[..., 2:, :]], axis=2)  # all-zero and all-positive tokens
    pk, pv = q4pack.pack_kv(k, v, scheme)
    for got, x, bits in ((pk, k, scheme.key_bits), (pv, v, scheme.value_bits)):
        want = mx.quantize(x, group_size=scheme.group_size, bits=bits)
        for a, w in zip(got, want):
            assert a.shape == w.shape and a.dtype == w.dtype
            assert mx.array_equal(a, w).item()


@pytest.mark.parametrize("name", ["k6v4-g64-hadamard", "k4v4-g32-hadamard", "k8v8-g64-hadamard"])
@pytest.mark.parametrize("d", [64, 128])
def test_pack_kv_rotates_like_the_matmul_before_quantizing(name, d):
    from runtime.kvscheme import parse

    scheme = parse(name)
    k = mx.random.normal((2, 8, 33, d), key=mx.random.key(3)).astype(mx.bfloat16)
    v = mx.random.normal((2, 8, 33, d), key=mx.random.key(4)).astype(mx.bfloat16)
    pk, pv = q4pack.pack_kv(k, v, scheme)
    for got, x, bits in ((pk, k, scheme.key_bits), (pv, v, scheme.value_bits)):
        want = mx.quantize(rotate(x, scheme), group_size=scheme.group_size, bits=bits)
        a = mx.dequantize(*got, group_size=scheme.group_size, bits=bits).astype(mx.float32)
        w = mx.dequantize(*want, group_size=scheme.group_size, bits=bits).astype(mx.float32)
        step = mx.abs(want[1]).max().item()  # one quantization step at most, where the two sums round apart
        assert (mx.abs(a - w).max()).item() <= step * 1.01
        same = mx.mean((got[0] == want[0]).astype(mx.float32)).item()
        assert same > 0.97, f"only {same:.1%} of the packed words agree with the matmul path"
        def error(deq):  # rotated back (H is its own inverse): the error against the input
            return (mx.abs(rotate(deq.astype(mx.bfloat16), scheme).astype(mx.float32) - x).max()).item()

        assert error(a) <= error(w) * 1.1 + 1e-3  # as faithful as the matmul path


def cache_buffers(b, h, w, d, scheme, dtype, seed):
    """Random (poisoned) cache buffers (words, scales, biases) for keys and for values."""
    def part(bits, s):
        return (mx.random.randint(0, 2**31, (b, h, w, d * bits // 32), key=mx.random.key(s)).astype(mx.uint32),
                mx.random.normal((b, h, w, d // scheme.group_size), key=mx.random.key(s + 1)).astype(dtype),
                mx.random.normal((b, h, w, d // scheme.group_size), key=mx.random.key(s + 2)).astype(dtype))
    out = part(scheme.key_bits, seed), part(scheme.value_bits, seed + 3)
    mx.eval(out)
    return out


@pytest.mark.parametrize("name", ["k6v4-g64-hadamard", "k4v4-g32", "k8v8-g64"])
@pytest.mark.parametrize("n", [1, 3])
def test_pack_kv_into_writes_pack_kvs_bits_into_its_columns_and_nothing_else(name, n):
    from runtime.kvscheme import parse

    scheme, d = parse(name), 128
    k = mx.random.normal((3, 8, n, d), key=mx.random.key(1)).astype(mx.bfloat16)
    v = mx.random.normal((3, 8, n, d), key=mx.random.key(2)).astype(mx.bfloat16)
    kb, vb = cache_buffers(3, 8, 512, d, scheme, mx.bfloat16, seed=10)
    before = [mx.array(x * 1) for x in (*kb, *vb)]
    mx.eval(before)
    end = 300
    written = q4pack.pack_kv_into(k, v, scheme, kb, vb, end)
    mx.eval(written)
    pk, pv = q4pack.pack_kv(k, v, scheme)
    for got, old, new in zip((*kb, *vb), before, (*pk, *pv)):
        assert mx.array_equal(got[:, :, end - n : end], new).item()
        assert mx.array_equal(got[:, :, : end - n], old[:, :, : end - n]).item()
        assert mx.array_equal(got[:, :, end:], old[:, :, end:]).item()
    with pytest.raises(ValueError, match="columns"):
        q4pack.pack_kv_into(k, v, scheme, kb, vb, 513)


def llama3_rope(d):
    from mlx_lm.models.rope_utils import initialize_rope

    from runtime.prepare import rope_frequencies

    rope = initialize_rope(d, 500000.0, False, {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                                "high_freq_factor": 4.0, "original_max_position_embeddings": 8192},
                           131072)
    return rope, rope_frequencies(rope, d)


@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("dtype", [mx.bfloat16, mx.float16])
def test_pack_kv_into_rotates_keys_by_rope_at_each_rows_position_as_mx_fast_rope(d, dtype):
    """Keys handed over unrotated: the written columns hold what `mx.fast.rope` at the rows' positions and then
    the packing give (values untouched by RoPE), within a rounding of the rotated keys, and nothing else moves."""
    from runtime.kvscheme import parse

    scheme = parse("k6v4-g64-hadamard")
    rope, inv_freq = llama3_rope(d)
    positions = mx.array([0, 3000, 70000], dtype=mx.int32)
    k = mx.random.normal((3, 8, 1, d), key=mx.random.key(1)).astype(dtype)
    v = mx.random.normal((3, 8, 1, d), key=mx.random.key(2)).astype(dtype)
    kb, vb = cache_buffers(3, 8, 512, d, scheme, dtype, seed=30)
    before = [mx.array(x * 1) for x in (*kb, *vb)]
    mx.eval(before)
    written = q4pack.pack_kv_into(k, v, scheme, kb, vb, 300, rope=(positions, inv_freq))
    mx.eval(written)
    roped = mx.concatenate([rope(k[i : i + 1], offset=positions[i].item()) for i in range(3)])
    pk, pv = q4pack.pack_kv(roped, v, scheme)
    for got, want in zip(vb, pv):
        assert mx.array_equal(got[:, :, 299:300], want).item()
    got = mx.dequantize(*(x[:, :, 299:300] for x in kb), group_size=64, bits=scheme.key_bits).astype(mx.float32)
    want = mx.dequantize(*pk, group_size=64, bits=scheme.key_bits).astype(mx.float32)
    # the two rotations may round a key differently (a 16-bit ulp at a large angle); after the Hadamard
    # rotation that can move a group's elements a quantization level or two (6 bits: about 2% of the range;
    # measured on an H100: 2.3% at most)
    assert relative_error(got, want) < 5e-2
    for now, old in zip((*kb, *vb), before):
        assert mx.array_equal(now[:, :, :299], old[:, :, :299]).item()
        assert mx.array_equal(now[:, :, 300:], old[:, :, 300:]).item()


@pytest.mark.parametrize("d", [64, 128])
def test_q4_decode_attention_rotates_queries_by_rope_as_mx_fast_rope(d):
    """Queries handed over unrotated: the output is the kernel's on `mx.fast.rope`d queries within bf16, and a
    row's output is bitwise the same in any batch."""
    b, hq, hkv, end = 3, 32, 8, 900
    rope, inv_freq = llama3_rope(d)
    kq, vq = packed_cache(b, hkv, end + 8, d, seed=21, key_bits=6)
    start = mx.array([0, 300, end - 1], dtype=mx.int32)
    positions = mx.array([end - 1, 40000, 5], dtype=mx.int32)
    q = mx.random.normal((b, hq, 1, d), key=mx.random.key(22)).astype(mx.bfloat16)
    out = q4sdpa.q4_decode_sdpa(q, kq, vq, start, end, d ** -0.5, 64, rotated=True, rope=(positions, inv_freq))
    roped = mx.concatenate([rope(q[i : i + 1], offset=positions[i].item()) for i in range(b)])
    want = q4sdpa.q4_decode_sdpa(roped, kq, vq, start, end, d ** -0.5, 64, rotated=True)
    assert relative_error(out, want.astype(mx.float32)) < 1e-2
    part = q4sdpa.q4_decode_sdpa(q[1:2], tuple(x[1:2] for x in kq), tuple(x[1:2] for x in vq), start[1:2], end,
                                 d ** -0.5, 64, rotated=True, rope=(positions[1:2], inv_freq))
    assert mx.array_equal(part, out[1:2]).item()
    with pytest.raises(ValueError, match="rope is"):
        q4sdpa.q4_decode_sdpa(q[:1], tuple(x[:1] for x in kq), tuple(x[:1] for x in vq), start[:1], end,
                              d ** -0.5, 64, rope=(positions, inv_freq))


def test_pack_kv_into_writes_through_a_view_of_rows_and_attention_reads_it_in_the_same_evaluation():
    from runtime.kvscheme import parse

    scheme, d = parse("k6v4-g64-hadamard"), 128
    kb, vb = cache_buffers(4, 8, 256, d, scheme, mx.bfloat16, seed=20)
    rows_kb, rows_vb = tuple(x[1:3] for x in kb), tuple(x[1:3] for x in vb)  # rows 1 and 2: views, as filter makes
    k = mx.random.normal((2, 8, 1, d), key=mx.random.key(3)).astype(mx.bfloat16)
    v = mx.random.normal((2, 8, 1, d), key=mx.random.key(4)).astype(mx.bfloat16)
    q = mx.random.normal((2, 32, 1, d), key=mx.random.key(5)).astype(mx.bfloat16)
    start = mx.array([0, 7], dtype=mx.int32)
    written = q4pack.pack_kv_into(k, v, scheme, rows_kb, rows_vb, 100)
    out = q4sdpa.q4_decode_sdpa(q, (*rows_kb, written), rows_vb, start, 100, d ** -0.5, 64, rotated=True)
    mx.eval(out)  # one evaluation: the attention must run after the write
    pk, pv = q4pack.pack_kv(k, v, scheme)
    for got, new in zip((*kb, *vb), (*pk, *pv)):
        assert mx.array_equal(got[1:3, :, 99:100], new).item()
    fresh_k = tuple(mx.concatenate([x[1:3, :, :99], p, x[1:3, :, 100:]], axis=2) for x, p in zip(kb, pk))
    fresh_v = tuple(mx.concatenate([x[1:3, :, :99], p, x[1:3, :, 100:]], axis=2) for x, p in zip(vb, pv))
    want = q4sdpa.q4_decode_sdpa(q, fresh_k, fresh_v, start, 100, d ** -0.5, 64, rotated=True)
    assert mx.array_equal(out, want).item()


@pytest.mark.parametrize("name,dtype", [("k6v4-g64-hadamard", mx.bfloat16), ("k8v8-g32", mx.float16),
                                        ("k4v4-g128", mx.float32)])
@pytest.mark.parametrize("plan,width", [
    ([(0, 0, 0, 300, 0)], 512), ([(0, 2, 17, 300, 0)], 283), ([(0, 1, 0, 0, 0)], 256), ([(0, 1, 5, 6, 0)], 1),
    ([(0, 2, 0, 512, 0)], 768),  # one row: an extraction, a merge
    ([(0, 2, 0, 300, 12), (1, 0, 0, 200, 112), (0, 0, 0, 0, 0), (1, 1, 50, 60, 302)], 512),  # a join, an empty row
    ([(0, 2, 256, 512, 0), (0, 0, 256, 512, 0)], 256),  # a filter that drops shared padding
    ([(1, 1, 0, 200, 0), (1, 0, 0, 200, 0)], 1024),  # a growth
])
def test_gather_columns_places_rows_columns_among_zeros_bit_for_bit(name, dtype, plan, width):
    from runtime import q4columns
    from runtime.kvscheme import parse

    scheme = parse(name)
    sources = [cache_buffers(3, 8, 512, 128, scheme, dtype, seed=20), cache_buffers(2, 8, 200, 128, scheme, dtype, seed=40)]
    assert_gathered(q4columns.gather(sources, plan, width), sources, plan, width)


def agent(scheme, tokens, seed):
    """A k6v4-g64-hadamard agent's layer cache of `tokens` random (poisoned) columns."""
    from runtime.q4cache import AgentKVCache

    a = AgentKVCache(64, 6, 4, "hadamard")
    kb, vb = cache_buffers(1, 8, tokens, 128, scheme, mx.bfloat16, seed=seed)
    a.keys, a.values, a.offset = kb, vb, tokens
    return a


def assert_gathered(got, sources, plan, width):
    """`got` (gather's keys, values) holds the plan's columns among zeros, bit for bit (MLX's slices as reference)."""
    got_k, got_v = got
    for j, got in enumerate((*got_k, *got_v)):
        rows = []
        for src, row, start, stop, at in plan:
            x = [*sources[src][0], *sources[src][1]][j]
            zeros = mx.zeros((1, x.shape[1], width, x.shape[3]), x.dtype)
            rows.append(mx.concatenate([zeros[:, :, :at], x[row : row + 1, :, start:stop],
                                        zeros[:, :, at + stop - start:]], axis=2))
        want = mx.concatenate(rows, axis=0)
        assert got.dtype == want.dtype and got.shape == want.shape
        assert mx.array_equal(got, want).item()  # every element written: a fresh buffer holds whatever it held


@pytest.mark.parametrize("count", [3, 32])
def test_gather_reads_a_row_of_each_of_many_sources_as_an_extraction_from_every_layer_does(count):
    """One source a layer, each of its own width, one output row each, and a plan that reads them out of order."""
    from runtime import q4columns
    from runtime.kvscheme import parse

    scheme = parse("k6v4-g64-hadamard")
    sources = [cache_buffers(3, 8, 260 + 16 * s, 128, scheme, mx.bfloat16, seed=200 + 7 * s) for s in range(count)]
    plan = [((s * 5) % count, 1, 3 + s % 4, 250, 0) for s in range(count)] + [(count - 1, 2, 0, 0, 0)]
    assert_gathered(q4columns.gather(sources, plan, 247), sources, plan, 247)


def test_rows_taken_from_every_layer_at_once_match_mlx_ops_and_merge_back(monkeypatch):
    """`queue_rows` on the "q4kernel" route takes a row from all the layers in one gather (its buffers views of one
    buffer a tensor, made when first read): the same arrays and offsets as the "dequant" route's slices, and
    merged back into a batch, the same buffers as well."""
    from runtime import attention, q4cache, q4columns
    from runtime.kvscheme import parse
    from runtime.q4cache import BatchQuantizedKVCache

    attention.install()
    scheme = parse("k6v4-g64-hadamard")
    launches = []
    real = q4columns.gather
    monkeypatch.setattr(q4columns, "gather", lambda sources, *a, **k: launches.append(len(sources)) or
                        real(sources, *a, **k))

    def run(route):
        batch = [BatchQuantizedKVCache.merge([agent(scheme, 300, 10 * n), agent(scheme, 120, 10 * n + 5)], scheme,
                                             route, room=9) for n in range(4)]
        taken = q4cache.queue_rows(batch, [1, 0], drop=2)
        # held (`HeldRow`): the hand-over made no layer's views
        assert all((c._held is not None) == (route == "q4kernel") for caches in taken for c in caches)
        for caches in taken:
            mx.eval([(c.keys, c.values) for c in caches])
        again = [BatchQuantizedKVCache.merge([taken[0][n], taken[1][n]], scheme, route, room=3) for n in range(4)]
        return [[(c.keys, c.values, c.offset) for c in caches] for caches in taken], \
            [(c.keys, c.values, c._pads) for c in again]

    (kernel_rows, kernel_again), (ops_rows, ops_again) = run("q4kernel"), run("dequant")
    assert launches.count(4) == 2  # one launch a row for the four layers
    for (kk, kv, ko), (dk, dv, do) in zip(sum(kernel_rows, []), sum(ops_rows, []), strict=True):
        assert ko == do
        assert all(x.shape == y.shape and mx.array_equal(x, y).item() for x, y in zip((*kk, *kv), (*dk, *dv)))
    for (kk, kv, kp), (dk, dv, dp) in zip(kernel_again, ops_again, strict=True):
        assert kp == dp
        assert all(x.shape == y.shape and mx.array_equal(x, y).item() for x, y in zip((*kk, *kv), (*dk, *dv)))


def test_a_handed_out_cache_leaves_the_device_through_its_six_arrays_byte_for_byte(monkeypatch):
    """The writer's copy of an agent's cache as a turn handed it out on the "q4kernel" route (`queue_rows`: a
    `HeldRow`) slices the row's six arrays, six a piece (`hostcache.cache_to_host`): byte for byte the copy a
    layer at a time of the same arrays, whole and from a position on, in one piece and in several."""
    from runtime import attention, hostcache, q4cache
    from runtime.kvscheme import parse
    from runtime.q4cache import AgentKVCache, BatchQuantizedKVCache

    attention.install()
    scheme, layers = parse("k6v4-g64-hadamard"), 4
    source = [BatchQuantizedKVCache.merge([agent(scheme, 300, 10 * n), agent(scheme, 120, 10 * n + 5)], scheme,
                                          "q4kernel", room=9) for n in range(layers)]
    handed = q4cache.queue_rows(source, [1], drop=2)[0]
    mx.eval(q4cache.row_arrays(handed))
    assert q4cache.held_row(handed) is not None
    apart = []  # the same arrays, a layer's own: copied a layer at a time
    for c in handed:
        a = AgentKVCache(64, 6, 4, "hadamard")
        a.keys, a.values = tuple(mx.array(x * 1) for x in c.keys), tuple(mx.array(x * 1) for x in c.values)
        a.offset = c.offset
        apart.append(a)
    mx.eval([(a.keys, a.values) for a in apart])
    seen, to_numpy = [], hostcache._to_numpy
    monkeypatch.setattr(hostcache, "_to_numpy", lambda arrays: seen.append(len(arrays)) or to_numpy(arrays))
    for piece in (8 << 20, 30_000):
        monkeypatch.setattr(hostcache, "PIECE_BYTES", piece)
        for start in (0, 100):
            seen.clear()
            got, want = hostcache.cache_to_host(handed, start), hostcache.cache_to_host(apart, start)
            assert seen[1] == 6 * layers and seen[0] % 6 == 0 and seen[0] <= seen[1]
            assert (got.dtype, got.n_tokens, got.lengths) == (want.dtype, want.n_tokens, want.lengths)
            for name, x in want.tensors.items():
                assert got.tensors[name].shape == x.shape and got.tensors[name].tobytes() == x.tobytes(), name


def test_a_handed_out_cache_merges_back_in_one_launch_and_takes_writes_as_a_batch_of_its_own(monkeypatch):
    """A hot turn's merge: an agent's cache as a turn handed it out (`queue_rows`: one buffer a tensor for every
    layer) is copied from every layer in one gather launch into views of one buffer a tensor, bit for bit what a
    merge a layer gives; a chunk written in place into either batch leaves the same buffers and attention, and the
    agent's arrays as they were. A cache changed since (a layer's arrays replaced) merges a layer at a time."""
    from runtime import attention, q4cache, q4columns
    from runtime.kvscheme import parse
    from runtime.q4cache import BatchQuantizedKVCache

    attention.install()
    scheme, layers, d = parse("k6v4-g64-hadamard"), 4, 128
    spec = types.SimpleNamespace(kv_scheme=scheme, n_layers=layers, windows=(None,) * layers, has_sinks=False)
    launches = []
    real = q4columns.gather
    monkeypatch.setattr(q4columns, "gather", lambda sources, plan, *a, **k: launches.append(len(plan)) or
                        real(sources, plan, *a, **k))
    source = [BatchQuantizedKVCache.merge([agent(scheme, 300, 10 * n), agent(scheme, 120, 10 * n + 5)], scheme,
                                          "q4kernel", room=9) for n in range(layers)]
    handed = q4cache.queue_rows(source, [0], drop=2)[0]
    mx.eval(q4cache.row_arrays(handed))
    before = [mx.array(x * 1) for c in handed for x in (*c.keys, *c.values)]
    mx.eval(before)

    def chunk(batch):
        out = []
        for n, layer in enumerate(batch):
            k, v, q = (mx.random.normal((1, h, 64, d), key=mx.random.key(90 + 3 * n + i)).astype(mx.bfloat16)
                       for i, h in enumerate((8, 8, 32)))
            mask = layer.make_mask(64)
            keys, values = layer.update_and_fetch(k, v)
            out.append(attention.sdpa(q, keys, values, d ** -0.5, mask, 64, scheme))
        mx.eval(out, [layer.state for layer in batch])
        return out, [x for layer in batch for x in (*layer.keys, *layer.values)]

    launches.clear()
    fused = q4cache.merge_caches(spec, [handed], "q4kernel", room=72)
    assert launches == [layers]  # one launch for every layer
    apart = [BatchQuantizedKVCache.merge([c], scheme, "q4kernel", room=72) for c in handed]
    assert launches == [layers, 1, 1, 1, 1]
    for a, b in zip(fused, apart, strict=True):
        assert (a._pads, a.offset.tolist(), a.size()) == (b._pads, b.offset.tolist(), b.size())
        assert all(x.shape == y.shape and mx.array_equal(x, y).item()
                   for x, y in zip((*a.keys, *a.values), (*b.keys, *b.values)))
    (out_a, bufs_a), (out_b, bufs_b) = chunk(fused), chunk(apart)
    assert all(mx.array_equal(x, y).item() for x, y in zip(out_a, out_b))
    assert all(mx.array_equal(x, y).item() for x, y in zip(bufs_a, bufs_b))
    after = [x for c in handed for x in (*c.keys, *c.values)]
    assert all(mx.array_equal(x, y).item() for x, y in zip(after, before))
    handed[2].keys = tuple(x * 1 for x in handed[2].keys)  # changed since it was handed out
    launches.clear()
    q4cache.merge_caches(spec, [handed], "q4kernel", room=72)
    assert launches == [1] * layers


def test_batch_surgery_on_the_kernel_route_matches_mlx_ops_bit_for_bit():
    """Merges, extractions and growth on the "q4kernel" route (one `q4columns.gather` launch a layer), and the
    joins and filters (rows apart, dropping shared padding) between them, leave the same buffers, padding and
    positions as on the "dequant" route (MLX's own ops)."""
    from runtime import attention
    from runtime.kvscheme import parse
    from runtime.q4cache import BatchQuantizedKVCache

    attention.install()
    scheme = parse("k6v4-g64-hadamard")

    def run(route):
        states = []

        def seen(c):
            states.append((c.keys, c.values, c._pads, c.offset.tolist(), c.size()))

        one = BatchQuantizedKVCache.merge([agent(scheme, 700, 1)], scheme, route, room=40)  # a hot turn's merge
        seen(one)
        batch = BatchQuantizedKVCache.merge([agent(scheme, 300, 2), agent(scheme, 20, 3)], scheme, route, room=5)
        batch.extend(one, room=64)  # a join: every row shifted to end at the longest
        seen(batch)
        batch.extend(BatchQuantizedKVCache.merge([None], scheme, route), room=1)  # a row with no history
        seen(batch)
        batch.filter([3, 0, 2])  # rows apart, in another order
        seen(batch)
        for i in (2, 0, 1):  # less 3 columns; row 0 has none: an empty cache
            c = batch._extract(i, 3, *batch.row_place(i))
            states.append((c.keys, c.values, [], [c.offset], 0))
        batch.filter([0, 1])  # the empty row and the 300-token one share 400 columns of padding: 256 dropped
        assert batch.size() == 700 - 256
        seen(batch)
        assert batch.reserve(batch.keys[0].shape[2] - batch.size() + 300)  # a growth
        seen(batch)
        taken = batch._extract(1, 0, *batch.row_place(1))  # an extraction
        states.append((taken.keys, taken.values, [], [taken.offset], 0))
        return states

    for (kk, kv, kp, ko, ks), (dk, dv, dp, do, ds) in zip(run("q4kernel"), run("dequant"), strict=True):
        assert (kp, ko, ks) == (dp, do, ds)
        if kk is None or dk is None:  # an empty row's cache, on both routes
            assert kk is None and dk is None and kv is None and dv is None
            continue
        for x, y in zip((*kk, *kv), (*dk, *dv)):
            assert x.shape == y.shape and x.dtype == y.dtype
            assert mx.array_equal(x, y).item()


@pytest.mark.parametrize("n", [1, 5, 64])  # a decode step, short chunks (the kernel reads them too)
def test_batch_cache_writes_in_place_as_it_does_through_slice_updates_and_leaves_agents_arrays_alone(n):
    from runtime import attention
    from runtime.q4cache import AgentKVCache, BatchQuantizedKVCache, _placed
    from runtime.kvscheme import parse

    attention.install()
    scheme, d = parse("k6v4-g64-hadamard"), 128
    agent = AgentKVCache(64, 6, 4, "hadamard")  # an agent cache with spare columns past its tokens
    kb, vb = cache_buffers(1, 8, 512, d, scheme, mx.bfloat16, seed=30)
    agent.keys, agent.values, agent.offset = kb, vb, 256
    original = [mx.array(x * 1) for x in (*kb, *vb)]
    mx.eval(original)
    outs = []
    for in_place in (True, False):
        cache = BatchQuantizedKVCache.merge([agent], scheme, "q4kernel")
        width = cache.keys[0].shape[2]
        placed = (*_placed(agent.keys, 256, 256, width), *_placed(agent.values, 256, 256, width))  # MLX's own ops
        assert all(mx.array_equal(a[:, :, :256], b[:, :, :256]).item()  # past 256: unused either way
                   for a, b in zip((*cache.keys, *cache.values), placed))
        if not in_place:
            cache._packs_in_place = lambda keys, values: False
        got = []
        for step in range(3):
            k = mx.random.normal((1, 8, n, d), key=mx.random.key(40 + step)).astype(mx.bfloat16)
            v = mx.random.normal((1, 8, n, d), key=mx.random.key(50 + step)).astype(mx.bfloat16)
            q = mx.random.normal((1, 32, n, d), key=mx.random.key(60 + step)).astype(mx.bfloat16)
            mask = cache.make_mask(n)
            keys, values = cache.update_and_fetch(k, v)
            assert len(keys) == (4 if in_place else 3)  # the write's result rides along when it was in place
            got.append(attention.sdpa(q, keys, values, d ** -0.5, mask, 64, scheme))
            mx.eval(got[-1])  # a step at a time, as a decoder's steps follow one another
        row = cache.extract(0)
        outs.append((got, cache.keys_and_values(), row))
    (got_a, (ka, va), row_a), (got_b, (kb2, vb2), row_b) = outs
    assert all(mx.array_equal(a, b).item() for a, b in zip(got_a, got_b))
    assert all(mx.array_equal(a, b).item() for a, b in zip((*ka, *va), (*kb2, *vb2)))
    assert all(mx.array_equal(a, b).item() for a, b in zip((*agent.keys, *agent.values), original))
    assert row_a.offset == 256 + 3 * n and row_a.keys[0].shape[2] == 256 + 3 * n
    assert all(mx.array_equal(a, b).item() for a, b in zip((*row_a.keys, *row_a.values), (*ka, *va)))


def test_two_chunks_written_in_place_before_either_is_evaluated_keep_both():
    """The first chunk's in-place write feeds only its own attention; building a second chunk must still run
    it first (else the second attends on columns never written)."""
    from runtime import attention
    from runtime.q4cache import AgentKVCache, BatchQuantizedKVCache
    from runtime.kvscheme import parse

    attention.install()
    scheme, d = parse("k6v4-g64-hadamard"), 128
    agent = AgentKVCache(64, 6, 4, "hadamard")
    agent.keys, agent.values = cache_buffers(1, 8, 256, d, scheme, mx.bfloat16, seed=70)
    agent.offset = 256
    chunks = [tuple(mx.random.normal((1, h, 7, d), key=mx.random.key(80 + 3 * i + j)).astype(mx.bfloat16)
                    for j, h in enumerate((8, 8, 32))) for i in range(2)]
    outs = []
    for together in (False, True):
        cache = BatchQuantizedKVCache.merge([agent], scheme, "q4kernel")
        got = []
        for k, v, q in chunks:
            mask = cache.make_mask(7)
            keys, values = cache.update_and_fetch(k, v)
            assert len(keys) == 4  # written in place
            got.append(attention.sdpa(q, keys, values, d ** -0.5, mask, 64, scheme))
            if not together:
                mx.eval(got[-1])
        mx.eval(got[-1])  # the second chunk's output alone: the first's is not asked for
        outs.append((got[-1], cache.keys_and_values()))
    (a, (ka, va)), (b, (kb, vb)) = outs
    assert mx.array_equal(a, b).item()
    assert all(mx.array_equal(x, y).item() for x, y in zip((*ka, *va), (*kb, *vb)))


def test_q4_decode_attention_at_64k_context():
    hq, hkv, d, end = 32, 8, 128, 65536
    kq, vq = packed_cache(1, hkv, end, d, seed=5)
    q = mx.random.normal((1, hq, 1, d), key=mx.random.key(6)).astype(mx.bfloat16)
    start = mx.array([0], dtype=mx.int32)
    out = q4sdpa.q4_decode_sdpa(q, kq, vq, start, end, d ** -0.5, 64)
    ref = reference_attention(q, kq, vq, start, end, d ** -0.5)
    assert (mx.abs(out.astype(mx.float32) - ref).max()).item() < 2e-2


def prepared_tiny(tiny_model_path, dtype):
    import mlx.nn as nn
    import mlx_lm

    from runtime.prepare import prepare_model

    model, _ = mlx_lm.load(str(tiny_model_path("llama")))  # its own copy: it gets changed
    model.set_dtype(dtype)
    nn.quantize(model, group_size=64, bits=4)
    prepare_model(model)
    return model


def test_float32_inputs_take_mlxs_own_kernel(tiny_model_path):
    model = prepared_tiny(tiny_model_path, mx.float32)
    q = model.layers[0].self_attn.q_proj
    x = mx.random.normal((2, 1, 128), key=mx.random.key(4))
    ref = mx.quantized_matmul(x, q["weight"], q["scales"], q["biases"], transpose=True, group_size=64, bits=4)
    assert mx.allclose(q(x), ref, atol=1e-4, rtol=1e-4).item()


@pytest.mark.parametrize("n", [0, 1, 15, 16, 17, 4099, cudacopy.STAGING_BYTES, 2 * cudacopy.STAGING_BYTES + 5])
@pytest.mark.parametrize("offset", [0, 3])
def test_to_host_gives_a_device_arrays_bytes_through_the_copy_engine(n, offset):
    """Sizes around the 16-byte lanes and the staging buffer; a view at an odd offset takes the byte-wise path."""
    assert cudacopy.available()  # on CUDA this path is the one cache copies take
    whole = mx.random.randint(0, 256, (n + offset,), key=mx.random.key(n)).astype(mx.uint8)
    x = whole[offset:]
    got = cudacopy.to_host(x, mx.new_stream(mx.gpu))
    assert got.dtype == np.uint8 and got.shape == (n,)
    assert np.array_equal(got, np.array(whole)[offset:])


def test_the_memory_pool_keeps_spare_memory_that_mlx_allocations_then_use():
    """`reserve_pool`: the default pool MLX allocates from holds the spare beyond what is in use, through
    synchronizations and whatever MLX already holds, and a buffer of a size MLX's cache has not seen comes out of it
    (the pool reserves no more)."""
    held = mx.zeros((77_000_123,), mx.uint8)  # memory in use before: the spare is counted beyond it
    mx.eval(held)
    assert cudacopy.reserve_pool(1 << 30)
    mx.synchronize()
    reserved, used = cudacopy.pool_bytes()
    assert reserved - used >= 1 << 30
    x = mx.zeros((123_457_000,), mx.uint8)  # a size new to MLX's buffer cache
    mx.eval(x)
    mx.synchronize()
    after, used_after = cudacopy.pool_bytes()
    assert after == reserved and used_after >= used + x.nbytes
    assert cudacopy.reserve_pool(1 << 30)  # tops the spare up again
    mx.synchronize()
    reserved, used = cudacopy.pool_bytes()
    assert reserved - used >= 1 << 30


def test_to_host_refuses_what_is_not_a_byte_vector():
    with pytest.raises(ValueError, match="1-D uint8"):
        cudacopy.to_host(mx.zeros((4, 4), mx.uint8))


def test_to_device_puts_every_arrays_bytes_in_one_aligned_device_buffer():
    """Arrays that cross the staging buffer's edges, one larger than it, an empty one and a non-contiguous view:
    each array's bytes land at its offset, every offset a multiple of ALIGN."""
    rng = np.random.default_rng(0)
    big = cudacopy.STAGING_BYTES
    arrays = [rng.integers(0, 2**32, (1, 8, 5, 24), dtype=np.uint32), np.zeros((0, 3), np.float16),
              rng.integers(0, 256, big - 100, dtype=np.uint8), rng.standard_normal((3, 7)).astype(np.float32),
              rng.integers(0, 2**16, (2, big // 2 + 9), dtype=np.uint16),
              rng.integers(0, 2**32, (1, 8, 40, 24), dtype=np.uint32)[:, :, 10:30]]
    blob, offsets = cudacopy.to_device(arrays, mx.new_stream(mx.gpu))
    assert blob.dtype == mx.uint8 and all(o % cudacopy.ALIGN == 0 for o in offsets)
    assert offsets == sorted(offsets) and blob.size >= offsets[-1] + arrays[-1].nbytes
    host = np.array(blob)
    for a, o in zip(arrays, offsets):
        want = np.ascontiguousarray(a).reshape(-1).view(np.uint8)
        assert np.array_equal(host[o: o + a.nbytes], want)


def test_a_cache_loaded_on_cuda_is_bit_for_bit_the_one_written(monkeypatch):
    """`host_to_cache` on CUDA (views of copy-engine buffers, cut in two here by a lower buffer limit) gives back
    the cache `cache_to_host` copied, bfloat16 scales included, and its arrays take part in device work."""
    from mlx_lm.models.cache import QuantizedKVCache

    from runtime import hostcache

    layers = []
    for i in range(3):
        c = QuantizedKVCache(group_size=64, bits=4)
        k1, k2 = mx.random.split(mx.random.key(i))
        c.keys = mx.quantize(mx.random.normal((1, 8, 300, 128), key=k1).astype(mx.bfloat16), 64, 4)
        c.values = mx.quantize(mx.random.normal((1, 8, 300, 128), key=k2).astype(mx.bfloat16), 64, 4)
        c.offset = 300
        layers.append(c)
    mx.eval([(c.keys, c.values) for c in layers])
    host = hostcache.cache_to_host(layers)
    buffers, to_device = [], cudacopy.to_device
    monkeypatch.setattr(cudacopy, "to_device", lambda *a: buffers.append(to_device(*a)) or buffers[-1])
    monkeypatch.setattr(cudacopy, "MAX_BYTES", host.nbytes // 2 + cudacopy.ALIGN * 18)
    loaded = hostcache.host_to_cache(host)
    assert len(buffers) == 2  # the copy engine's path, in two buffers
    for got, want in zip(loaded, layers):
        assert got.offset == 300
        for g, w in zip((*got.keys, *got.values), (*want.keys, *want.values)):
            assert g.dtype == w.dtype and g.shape == w.shape
            assert mx.array_equal(g, w).item()
        for part in ("keys", "values"):
            assert mx.array_equal(mx.dequantize(*getattr(got, part), 64, 4),
                                  mx.dequantize(*getattr(want, part), 64, 4)).item()
