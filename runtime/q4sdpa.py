"""Decode attention that reads the packed 4-bit cache directly, on CUDA.

`q4_decode_sdpa(queries, keys, values, start, end, scale, group_size)` attends
one query per row (decode) over packed (words, scales, biases) keys and values
of shape (B, Hkv, W, ...), row b using only columns [start[b], end). Keys are
dequantized in registers; nothing 16-bit is stored.

Two kernels (flash-decoding): the first gives every (row, kv head, chunk of
CHUNK keys) a block that computes, for the kv head's Hq/Hkv query heads, the
chunk's running max, sum of exponentials and weighted sum of values (online
softmax in float32); the second combines a row's chunks in order. Chunks are
counted from each row's own first column, keys within a chunk are visited in a
fixed order, and the combination order is fixed, so a row's output is bitwise
the same whatever the other rows are and however much left padding it has.
"""

from __future__ import annotations

import mlx.core as mx

CHUNK = 256  # keys per block
WARPS = 4

_PARTIAL = r"""
    constexpr int E = D / 32;
    const int lane = threadIdx.x & 31;
    const int warp = threadIdx.x >> 5;
    const int c = blockIdx.x, h = blockIdx.y, b = blockIdx.z;
    const int nc = gridDim.x;
    const int Hkv = kw_shape[1];
    const int W = kw_shape[2];
    const int Hq = Hkv * REP;
    const int end = meta[0];
    const int lo = start[b] + c * CHUNK;
    const int hi = min(end, lo + CHUNK);
    const float scale = meta_f[0];
    const int wpr = D / 8, gpr = D / G;
    const int word_i = (lane * E) / 8, shift = ((lane * E) % 8) * 4, grp = (lane * E) / G;

    float qf[REP][E];
    #pragma unroll
    for (int r = 0; r < REP; ++r) {
        #pragma unroll
        for (int e = 0; e < E; ++e) {
            qf[r][e] = static_cast<float>(q[((size_t)(b * Hq + h * REP + r)) * D + lane * E + e]) * scale;
        }
    }
    float m[REP], l[REP], acc[REP][E];
    #pragma unroll
    for (int r = 0; r < REP; ++r) {
        m[r] = -INFINITY;
        l[r] = 0.0f;
        #pragma unroll
        for (int e = 0; e < E; ++e) acc[r][e] = 0.0f;
    }
    const size_t row_base = ((size_t)(b * Hkv + h)) * W;
    for (int j = lo + warp; j < hi; j += WARPS) {
        const size_t kr = row_base + j;
        const uint32_t kwd = kw[kr * wpr + word_i];
        const float ksc = static_cast<float>(ks[kr * gpr + grp]);
        const float kbi = static_cast<float>(kb[kr * gpr + grp]);
        const uint32_t vwd = vw[kr * wpr + word_i];
        const float vsc = static_cast<float>(vs[kr * gpr + grp]);
        const float vbi = static_cast<float>(vb[kr * gpr + grp]);
        float kf[E], vf[E];
        #pragma unroll
        for (int e = 0; e < E; ++e) {
            kf[e] = fmaf(static_cast<float>((kwd >> (shift + 4 * e)) & 15u), ksc, kbi);
            vf[e] = fmaf(static_cast<float>((vwd >> (shift + 4 * e)) & 15u), vsc, vbi);
        }
        #pragma unroll
        for (int r = 0; r < REP; ++r) {
            float d = 0.0f;
            #pragma unroll
            for (int e = 0; e < E; ++e) d = fmaf(qf[r][e], kf[e], d);
            #pragma unroll
            for (int off = 16; off > 0; off >>= 1) d += __shfl_xor_sync(0xffffffffu, d, off);
            const float mn = fmaxf(m[r], d);
            const float corr = expf(m[r] - mn);
            const float p = expf(d - mn);
            l[r] = fmaf(l[r], corr, p);
            #pragma unroll
            for (int e = 0; e < E; ++e) acc[r][e] = fmaf(p, vf[e], acc[r][e] * corr);
            m[r] = mn;
        }
    }
    __shared__ float s_m[WARPS][REP];
    __shared__ float s_l[WARPS][REP];
    __shared__ float s_acc[WARPS][REP][D];
    #pragma unroll
    for (int r = 0; r < REP; ++r) {
        if (lane == 0) {
            s_m[warp][r] = m[r];
            s_l[warp][r] = l[r];
        }
        #pragma unroll
        for (int e = 0; e < E; ++e) s_acc[warp][r][lane * E + e] = acc[r][e];
    }
    __syncthreads();
    for (int t = threadIdx.x; t < REP * D; t += blockDim.x) {
        const int r = t / D, d = t % D;
        float M = -INFINITY;
        #pragma unroll
        for (int w = 0; w < WARPS; ++w) M = fmaxf(M, s_m[w][r]);
        float L = 0.0f, A = 0.0f;
        #pragma unroll
        for (int w = 0; w < WARPS; ++w) {
            const float f = s_m[w][r] == -INFINITY ? 0.0f : expf(s_m[w][r] - M);
            L = fmaf(s_l[w][r], f, L);
            A = fmaf(s_acc[w][r][d], f, A);
        }
        const size_t o = ((size_t)(b * Hq + h * REP + r)) * nc + c;
        pacc[o * D + d] = A;
        if (d == 0) {
            pm[o] = M;
            pl[o] = L;
        }
    }
"""

_REDUCE = r"""
    const int d = threadIdx.x, hq = blockIdx.y, b = blockIdx.z;
    const int Hq = pm_shape[1], nc = pm_shape[2];
    const int mine = min(nc, (meta[0] - start[b] + CHUNK - 1) / CHUNK);
    const size_t base = ((size_t)(b * Hq + hq)) * nc;
    float M = -INFINITY;
    for (int c = 0; c < mine; ++c) M = fmaxf(M, pm[base + c]);
    float L = 0.0f, A = 0.0f;
    for (int c = 0; c < mine; ++c) {
        const float f = pm[base + c] == -INFINITY ? 0.0f : expf(pm[base + c] - M);
        L = fmaf(pl[base + c], f, L);
        A = fmaf(pacc[(base + c) * D + d], f, A);
    }
    out[((size_t)(b * Hq + hq)) * D + d] = static_cast<T>(L > 0.0f ? A / L : 0.0f);
"""

_kernels = {}
_scales = {}  # attention scale -> the same as a device array, made once


def _get(name, inputs, outputs, source):
    if name not in _kernels:
        _kernels[name] = mx.fast.cuda_kernel(name=name, input_names=inputs, output_names=outputs, source=source,
                                             ensure_row_contiguous=True)
    return _kernels[name]


def q4_decode_sdpa(queries, keys, values, start, end: int, scale: float, group_size: int, end_array=None):
    """Attention of one query per row over packed 4-bit keys/values, row b over columns [start[b], end).

    queries (B, Hq, 1, D); keys/values (words, scales, biases) of shape (B, Hkv, W, ...)
    with W >= end; start: int32 (B,); `end_array`: `end` as an int32 array of shape
    (1,) (made here if not given). Returns (B, Hq, 1, D) in the queries' dtype.
    """
    B, Hq, _, D = queries.shape
    Hkv = keys[0].shape[1]
    rep = Hq // Hkv
    n_chunks = max(1, -(-end // CHUNK))  # enough for a row with no padding
    meta = mx.array([end], dtype=mx.int32) if end_array is None else end_array
    meta_f = _scales.get(scale)
    if meta_f is None:
        meta_f = _scales[scale] = mx.array([scale], dtype=mx.float32)
    partial = _get("kvactors_q4_decode_partial",
                   ["q", "kw", "ks", "kb", "vw", "vs", "vb", "start", "meta", "meta_f"], ["pm", "pl", "pacc"], _PARTIAL)
    pm, pl, pacc = partial(
        inputs=[queries, *keys, *values, start, meta, meta_f],
        template=[("D", D), ("G", group_size), ("REP", rep), ("CHUNK", CHUNK), ("WARPS", WARPS)],
        grid=(n_chunks * WARPS * 32, Hkv, B),
        threadgroup=(WARPS * 32, 1, 1),
        output_shapes=[(B, Hq, n_chunks), (B, Hq, n_chunks), (B, Hq, n_chunks, D)],
        output_dtypes=[mx.float32, mx.float32, mx.float32],
    )
    reduce = _get("kvactors_q4_decode_reduce", ["pm", "pl", "pacc", "start", "meta"], ["out"], _REDUCE)
    return reduce(
        inputs=[pm, pl, pacc, start, meta],
        template=[("T", queries.dtype), ("D", D), ("CHUNK", CHUNK)],
        grid=(D, Hq, B),
        threadgroup=(D, 1, 1),
        output_shapes=[(B, Hq, 1, D)],
        output_dtypes=[queries.dtype],
    )[0]
