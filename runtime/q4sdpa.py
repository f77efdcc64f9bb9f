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

import math

import mlx.core as mx

CHUNK = 1024  # keys per block
WARPS = 4  # warps per block
UNROLL = 4  # keys each lane group loads before it uses the first
MAX_HEADS = 4  # query heads per block (registers: 2 x EPL floats a head per lane)
EPL = 16  # elements of a key each lane holds: D / EPL lanes share a key

# A 4-bit value n as the float 2048 + n, made by placing n in the mantissa of 2048 (one
# shift and one logic op; int-to-float conversion runs at a quarter of the FMA rate).
# The kernel subtracts 2048 once per group of elements, through the bias.
_HEADER = r"""
__device__ __forceinline__ float fast_exp2(float x) {  // 2^x in one instruction; 2^-inf = 0
    float y;
    asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
    return y;
}

__device__ __forceinline__ float nibble(unsigned int w, int e) {
    const unsigned int x = e < 3 ? (w << (12 - 4 * e)) : (w >> (4 * e - 12));
    return __uint_as_float(0x45000000u | (x & 0xF000u));
}
"""

_PARTIAL = r"""
    // One block: row b, kv head h, query heads [r0, r0 + RB) of that kv head, keys [lo, hi).
    // A key is read by LPK lanes, each holding EPL of its D elements (EPL / 8 words of keys
    // and as many of values); a warp reads KPW consecutive keys per step, and each lane
    // loads U steps' keys before it uses the first.
    constexpr int NW = EPL / 8;
    constexpr int LPK = D / EPL;
    constexpr int KPW = 32 / LPK;
    constexpr int STRIDE = WARPS * KPW;  // keys between one lane group's consecutive keys
    constexpr int HB = REP / RB;
    constexpr int WPR = D / 8, GPR = D / G;
    const int lane = threadIdx.x & 31;
    const int warp = threadIdx.x >> 5;
    const int sub = lane % LPK;                 // which EPL elements of the key
    const int slot = lane / LPK;                // which key of the warp's step
    const int c = blockIdx.x, b = blockIdx.z;
    const int Hkv = kw_shape[1];
    const int W = kw_shape[2];
    const int h = blockIdx.y / HB, r0 = (blockIdx.y % HB) * RB;
    const int Hq = Hkv * REP;
    const int nc = gridDim.x;
    const int end = meta[0];
    const int window = meta[1];
    const int first = window > 0 ? max(start[b], end - window) : start[b];
    const int lo = first + c * CHUNK;
    const int hi = min(end, lo + CHUNK);
    const float scale = meta_f[0];
    const int grp = (sub * EPL) / G;

    // Scores are in base 2 (log2(e) is in `scale`). With F_e = 2048 + n_e, a key's
    // q.k = s * sum(q_e * F_e) + (bias - 2048 s) * sum(q_e), and p * v_e = (p s) F_e
    // + p (bias - 2048 s), whose second term is summed apart (vb_acc).
    float qf[RB][EPL], qsum[RB];
    #pragma unroll
    for (int r = 0; r < RB; ++r) {
        const auto* qr = q + ((size_t)(b * Hq + h * REP + r0 + r)) * D + sub * EPL;
        qsum[r] = 0.0f;
        #pragma unroll
        for (int e = 0; e < EPL; ++e) {
            qf[r][e] = static_cast<float>(qr[e]) * scale;
            qsum[r] += qf[r][e];
        }
    }
    float m[RB], l[RB], acc[RB][EPL], vb_acc[RB];
    #pragma unroll
    for (int r = 0; r < RB; ++r) {
        m[r] = -INFINITY;
        l[r] = 0.0f;
        vb_acc[r] = 0.0f;
        #pragma unroll
        for (int e = 0; e < EPL; ++e) acc[r][e] = 0.0f;
    }
    const size_t row_base = ((size_t)(b * Hkv + h)) * W;
    // the loop runs while any key of the warp's step is valid, so shuffles see the whole warp
    for (int base = lo + warp * KPW; base < hi; base += U * STRIDE) {
        const int j0 = base + slot;
        unsigned int kwd[U][NW], vwd[U][NW];
        float ksc[U], kbi[U], vsc[U], vbi[U];
        #pragma unroll
        for (int u = 0; u < U; ++u) {
            const int j = min(j0 + u * STRIDE, hi - 1);  // a key past hi is read but not used
            const size_t kr = row_base + j;
            if constexpr (NW == 2) {
                const uint2 kk = *reinterpret_cast<const uint2*>(kw + kr * WPR + sub * 2);
                const uint2 vv = *reinterpret_cast<const uint2*>(vw + kr * WPR + sub * 2);
                kwd[u][0] = kk.x; kwd[u][1] = kk.y;
                vwd[u][0] = vv.x; vwd[u][1] = vv.y;
            } else {
                kwd[u][0] = kw[kr * WPR + sub];
                vwd[u][0] = vw[kr * WPR + sub];
            }
            ksc[u] = static_cast<float>(ks[kr * GPR + grp]);
            kbi[u] = static_cast<float>(kb[kr * GPR + grp]);
            vsc[u] = static_cast<float>(vs[kr * GPR + grp]);
            vbi[u] = static_cast<float>(vb[kr * GPR + grp]);
        }
        float s[U][RB];
        #pragma unroll
        for (int u = 0; u < U; ++u) {
            float kn[EPL];
            #pragma unroll
            for (int e = 0; e < EPL; ++e) kn[e] = nibble(kwd[u][e / 8], e % 8);
            const float kb2 = fmaf(-2048.0f, ksc[u], kbi[u]);
            #pragma unroll
            for (int r = 0; r < RB; ++r) {
                float d = 0.0f;
                #pragma unroll
                for (int e = 0; e < EPL; ++e) d = fmaf(qf[r][e], kn[e], d);
                d = fmaf(ksc[u], d, kb2 * qsum[r]);
                #pragma unroll
                for (int off = LPK / 2; off > 0; off >>= 1) d += __shfl_xor_sync(0xffffffffu, d, off);
                s[u][r] = (j0 + u * STRIDE < hi) ? d : -INFINITY;
            }
        }
        float mn[RB];
        #pragma unroll
        for (int r = 0; r < RB; ++r) {
            float top = m[r];
            #pragma unroll
            for (int u = 0; u < U; ++u) top = fmaxf(top, s[u][r]);
            mn[r] = top == -INFINITY ? 0.0f : top;  // no valid key yet: every p below is 2^-inf = 0
            const float corr = fast_exp2(m[r] - mn[r]);
            l[r] *= corr;
            vb_acc[r] *= corr;
            #pragma unroll
            for (int e = 0; e < EPL; ++e) acc[r][e] *= corr;
            m[r] = top;
        }
        #pragma unroll
        for (int u = 0; u < U; ++u) {
            float vn[EPL];
            #pragma unroll
            for (int e = 0; e < EPL; ++e) vn[e] = nibble(vwd[u][e / 8], e % 8);
            const float vb2 = fmaf(-2048.0f, vsc[u], vbi[u]);
            #pragma unroll
            for (int r = 0; r < RB; ++r) {
                const float p = fast_exp2(s[u][r] - mn[r]);
                l[r] += p;
                vb_acc[r] = fmaf(p, vb2, vb_acc[r]);
                const float ps = p * vsc[u];
                #pragma unroll
                for (int e = 0; e < EPL; ++e) acc[r][e] = fmaf(ps, vn[e], acc[r][e]);
            }
        }
    }
    #pragma unroll
    for (int r = 0; r < RB; ++r) {
        #pragma unroll
        for (int e = 0; e < EPL; ++e) acc[r][e] += vb_acc[r];
    }
    // lane groups of a warp -> the first group, in a fixed order
    #pragma unroll
    for (int off = LPK; off < 32; off <<= 1) {
        #pragma unroll
        for (int r = 0; r < RB; ++r) {
            const float mo = __shfl_down_sync(0xffffffffu, m[r], off);
            const float lo_ = __shfl_down_sync(0xffffffffu, l[r], off);
            const float mn = fmaxf(m[r], mo);
            const float fa = m[r] == -INFINITY ? 0.0f : exp2f(m[r] - mn);
            const float fb = mo == -INFINITY ? 0.0f : exp2f(mo - mn);
            l[r] = fmaf(l[r], fa, lo_ * fb);
            #pragma unroll
            for (int e = 0; e < EPL; ++e) {
                const float ao = __shfl_down_sync(0xffffffffu, acc[r][e], off);
                acc[r][e] = fmaf(acc[r][e], fa, ao * fb);
            }
            m[r] = mn;
        }
    }
    __shared__ float s_m[WARPS][RB];
    __shared__ float s_l[WARPS][RB];
    __shared__ float s_acc[WARPS][RB][D];
    if (lane < LPK) {
        #pragma unroll
        for (int r = 0; r < RB; ++r) {
            if (lane == 0) {
                s_m[warp][r] = m[r];
                s_l[warp][r] = l[r];
            }
            #pragma unroll
            for (int e = 0; e < EPL; ++e) s_acc[warp][r][sub * EPL + e] = acc[r][e];
        }
    }
    __syncthreads();
    for (int t = threadIdx.x; t < RB * D; t += blockDim.x) {
        const int r = t / D, d = t % D;
        float M = -INFINITY;
        #pragma unroll
        for (int w = 0; w < WARPS; ++w) M = fmaxf(M, s_m[w][r]);
        float L = 0.0f, A = 0.0f;
        #pragma unroll
        for (int w = 0; w < WARPS; ++w) {
            const float f = s_m[w][r] == -INFINITY ? 0.0f : exp2f(s_m[w][r] - M);
            L = fmaf(s_l[w][r], f, L);
            A = fmaf(s_acc[w][r][d], f, A);
        }
        const size_t o = ((size_t)(b * Hq + h * REP + r0 + r)) * nc + c;
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
    const int end = meta[0], window = meta[1];
    const int first = window > 0 ? max(start[b], end - window) : start[b];
    const int mine = min(nc, (end - first + CHUNK - 1) / CHUNK);
    const size_t base = ((size_t)(b * Hq + hq)) * nc;
    float M = -INFINITY;
    for (int c = 0; c < mine; ++c) M = fmaxf(M, pm[base + c]);
    float L = 0.0f, A = 0.0f;
    for (int c = 0; c < mine; ++c) {
        const float f = pm[base + c] == -INFINITY ? 0.0f : exp2f(pm[base + c] - M);
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
                                             header=_HEADER, ensure_row_contiguous=True)
    return _kernels[name]


def heads_per_block(rep: int) -> int:
    """Query heads one block serves: the largest divisor of `rep` (query heads per kv head) up to MAX_HEADS."""
    return max(r for r in range(1, min(rep, MAX_HEADS) + 1) if rep % r == 0)


def meta(end: int, window: int = 0):
    """The kernels' int32 parameters [end, window] as a device array (see `q4_decode_sdpa`)."""
    return mx.array([end, window], dtype=mx.int32)


def q4_decode_sdpa(queries, keys, values, start, end: int, scale: float, group_size: int, meta_array=None,
                   window: int = 0):
    """Attention of one query per row over packed 4-bit keys/values, row b over columns [start[b], end).

    queries (B, Hq, 1, D) with D 64 or 128; keys/values (words, scales, biases) of shape
    (B, Hkv, W, ...) with W >= end and Hq a multiple of Hkv; start: int32 (B,). With
    `window` > 0 a row attends only to its last `window` columns (a sliding-window layer).
    `meta_array`: `meta(end, window)`, made here if not given (pass it to share one per step).
    Returns (B, Hq, 1, D) in the queries' dtype. A row's output depends on its own columns
    only: bitwise the same in any batch and under any left padding.
    """
    B, Hq, _, D = queries.shape
    Hkv = keys[0].shape[1]
    rep = Hq // Hkv
    rb = heads_per_block(rep)
    n_chunks = max(1, -(-end // CHUNK))  # enough for a row with no padding
    if meta_array is None:
        meta_array = meta(end, window)
    meta_f = _scales.get(scale)
    if meta_f is None:
        meta_f = _scales[scale] = mx.array([scale * math.log2(math.e)], dtype=mx.float32)  # scores in base 2
    partial = _get("kvactors_q4_decode_partial",
                   ["q", "kw", "ks", "kb", "vw", "vs", "vb", "start", "meta", "meta_f"], ["pm", "pl", "pacc"], _PARTIAL)
    pm, pl, pacc = partial(
        inputs=[queries, *keys, *values, start, meta_array, meta_f],
        template=[("D", D), ("G", group_size), ("REP", rep), ("RB", rb), ("CHUNK", CHUNK), ("WARPS", WARPS),
                  ("U", UNROLL), ("EPL", EPL)],
        grid=(n_chunks * WARPS * 32, Hkv * (rep // rb), B),
        threadgroup=(WARPS * 32, 1, 1),
        output_shapes=[(B, Hq, n_chunks), (B, Hq, n_chunks), (B, Hq, n_chunks, D)],
        output_dtypes=[mx.float32, mx.float32, mx.float32],
    )
    reduce = _get("kvactors_q4_decode_reduce", ["pm", "pl", "pacc", "start", "meta"], ["out"], _REDUCE)
    return reduce(
        inputs=[pm, pl, pacc, start, meta_array],
        template=[("T", queries.dtype), ("D", D), ("CHUNK", CHUNK)],
        grid=(D, Hq, B),
        threadgroup=(D, 1, 1),
        output_shapes=[(B, Hq, 1, D)],
        output_dtypes=[queries.dtype],
    )[0]
