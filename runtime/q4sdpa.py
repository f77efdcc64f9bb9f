"""Attention that reads the packed 4-bit cache directly, on CUDA: decode steps and short prefill chunks.

`q4_decode_sdpa(queries, keys, values, start, end, scale, group_size)` attends
each row's L queries (one when decoding, up to MAX_QUERIES for a short prefill
chunk, causally: query l sits at column end - L + l) over packed (words, scales,
biases) keys (4 or 6 bits) and values (4 bits) of shape (B, Hkv, W, ...), row b
using only columns [start[b], end). Keys and values are dequantized in registers;
nothing 16-bit is stored.

One kernel (flash-decoding in one launch): it gives every (row, kv head, tile of
its queries, chunk of its keys) a block that computes, for the tile's (query, query
head) pairs (16 at most: the rows of one tensor-core product), the chunk's
reference max, sum of exponentials and weighted sum of values (online softmax in
float32; the reference moves only when a tile's max passes it by more than 8 in
base 2, so the sums are rescaled in few tiles and no exponential exceeds 256).
Each warp copies its tiles of 16 keys whole into shared memory by asynchronous
copies, STAGES of them in flight, and reads its fragments from there. The last
of a tile's blocks to finish (they count themselves in an array of zeros) combines
the chunks in order, with no second launch (a decode step's host work grows with
its launches). A row's chunks start at its own first column and their size follows
from its own length (CHUNKS of them, at least MIN_CHUNK keys each), keys within a
chunk are visited in a fixed order, and the combination order is fixed whichever
block combines, so a row's output is bitwise the same whatever the other rows are
and however much left padding it has.

For caches stored Hadamard-rotated (`runtime.kvscheme`), `rotated=True` has the
kernel rotate the queries as it loads them (a warp a query: in registers, then
across its lanes) and the output back as it combines (a lane's dims, then across
lanes): no extra launches for the rotation.
"""

from __future__ import annotations

import functools
import math
import struct
import threading

import mlx.core as mx

from runtime.qgemv import MMA16816, compiled_launch, cuda_kernel

CHUNKS = 32  # blocks that share a row's keys (per kv head), whatever its length, when decoding (at most 32)
PREFILL_CHUNKS = 4  # the same for a prefill chunk, whose query tiles make many blocks already
MAX_QUERIES = 512  # queries per row the kernel takes at most (longer prefill chunks have faster routes)
MIN_CHUNK = 256  # fewest keys a block takes (short rows use fewer blocks)
WARPS = 4  # warps per block
STAGES = 3  # tiles of 16 keys a warp has in flight (asynchronous copies into shared memory)
HEADS = 16  # query heads per block: the rows of one tensor-core product
KEY_BITS = (4, 6)  # key widths the kernel reads (values are 4-bit)

# x H along D (H: Sylvester-Hadamard, unnormalized) for a warp's vector of D = 32 E elements, lane l holding dims
# E l .. E l + E - 1: strides under E in registers, the rest across lanes. The kernels that rotate (`q4pack`'s
# packing, this module's queries and output) all take it.
WARP_HADAMARD = r"""
template <int E>
__device__ __forceinline__ void warp_hadamard(float (&x)[E], int lane) {
    #pragma unroll
    for (int len = 1; len < E; len <<= 1) {
        #pragma unroll
        for (int e = 0; e < E; ++e) {
            if ((e & len) == 0) {
                const float a = x[e], z = x[e + len];
                x[e] = a + z;
                x[e + len] = a - z;
            }
        }
    }
    #pragma unroll
    for (int bit = 1; bit < 32; bit <<= 1) {  // lane ^ bit holds the dims E * bit away
        #pragma unroll
        for (int e = 0; e < E; ++e) {
            const float z = __shfl_xor_sync(0xffffffffu, x[e], bit);
            x[e] = (lane & bit) ? z - x[e] : x[e] + z;
        }
    }
}
"""

_HEADER = WARP_HADAMARD + r"""
// Keys per block for a row of `len` keys: its own length alone decides where its chunks split,
// so a row's result does not depend on the batch; a multiple of 64 (16 keys x 4 warps).
__device__ __forceinline__ int keys_per_chunk(int len, int chunks, int min_chunk) {
    return max(min_chunk, ((len + chunks - 1) / chunks + 63) / 64 * 64);
}

__device__ __forceinline__ float fast_exp2(float x) {  // 2^x in one instruction; 2^-inf = 0
    float y;
    asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
    return y;
}

// A word's two 16-bit floats (the first in its low half) as floats, exactly
__device__ __forceinline__ void unpack2(unsigned int w, float& lo, float& hi, __nv_bfloat16) {
    lo = __uint_as_float(w << 16);
    hi = __uint_as_float(w & 0xFFFF0000u);
}

__device__ __forceinline__ void unpack2(unsigned int w, float& lo, float& hi, __half) {
    lo = __half2float(__ushort_as_half(static_cast<unsigned short>(w & 0xFFFFu)));
    hi = __half2float(__ushort_as_half(static_cast<unsigned short>(w >> 16)));
}

__device__ __forceinline__ unsigned int pack_half2(float lo, float hi) {  // (lo, hi) as f16x2, lo in the low half
    unsigned int r;
    asm("cvt.rn.f16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(hi), "f"(lo));
    return r;
}

// Two quantized values as f16x2 times (s_lo, s_hi) plus (b_lo, b_hi): `mask` picks one value's bits in each
// half of x, within the f16 mantissa's bits 0-9: at bits 0-3 or 0-5 (the f16 then holds 1024 + n), or k places
// higher (1024 + 2^k n, and that half's `scale` is divided by 2^k); the mask and the exponent are set by one logic op.
__device__ __forceinline__ unsigned int dequant2(unsigned int x, unsigned int mask, unsigned int scale,
                                                 unsigned int bias) {
    unsigned int y, r;
    asm("lop3.b32 %0, %1, %2, %3, 0xEA;" : "=r"(y) : "r"(x), "r"(mask), "r"(0x64006400u));  // (x & mask) | exponent
    asm("sub.f16x2 %0, %1, %2;" : "=r"(y) : "r"(y), "r"(0x64006400u));
    asm("fma.rn.f16x2 %0, %1, %2, %3;" : "=r"(r) : "r"(y), "r"(scale), "r"(bias));
    return r;
}

// Asynchronous copies global -> shared (cp.async): N bytes, N in 4, 8, 16, both addresses N-aligned, `dst` an
// address in the shared window (`shared_address`); 16-byte ones bypass L1. A warp's copies are waited for by
// group (commit, then wait until at most `pending` of its latest groups are in flight) and made visible to its
// other lanes by __syncwarp.
__device__ __forceinline__ unsigned int shared_address(const void* p) {
    unsigned int s;
    asm("{ .reg .u64 a; cvta.to.shared.u64 a, %1; cvt.u32.u64 %0, a; }" : "=r"(s) : "l"(p));
    return s;
}

template <int N>
__device__ __forceinline__ void copy_async(unsigned int dst, const void* src) {
    if constexpr (N == 16) {
        asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" :: "r"(dst), "l"(src) : "memory");
    } else {
        asm volatile("cp.async.ca.shared.global [%0], [%1], %2;" :: "r"(dst), "l"(src), "n"(N) : "memory");
    }
}

__device__ __forceinline__ void copies_commit() { asm volatile("cp.async.commit_group;" ::: "memory"); }

template <int pending>
__device__ __forceinline__ void copies_wait() { asm volatile("cp.async.wait_group %0;" :: "n"(pending) : "memory"); }

""" + "#define BF 0\n" + MMA16816  # f16 products

_KERNEL = r"""
    // One block: row b, kv head h, keys [lo, hi), and a tile of 16 (query, head) pairs as the rows
    // of 16x8x16 tensor-core products: QPT of the row's QL queries (query l at column end - QL + l,
    // attending up to it) times query heads r0 .. r0 + RB - 1 of the kv head's REP (RB <= 16); tile
    // row r is query qt QPT + r / RB, head r0 + r % RB, and rows past NR = QPT RB or QL are zero.
    // A warp takes 16 keys at a time. Lane
    // (g, t) = (lane / 4, lane % 4) as in the fragment layout of mma.m16n8k16.
    // Scores S = Q K^T run over k-slices of 16 dims, where in slice ks the k indices 2t + j and
    //   2t + 8 + j are dims (D/4) t + 4 ks + j and (D/4) t + 4 ks + 2 + j: lane t reads D/32
    //   consecutive words of a key, which lie in one quantization group.
    // Output O = P V: in d-tile dt, column n is dim (D/8) n + dt, so lane g reads D/64
    //   consecutive words of each of its keys 2t, 2t+1, 2t+8, 2t+9.
    // Keys have KB bits (4 or 6; 6-bit values are a little-endian bit stream, 4 per 3 bytes),
    // values 4. KW: key words a lane reads per key (its D/4 dims); KWR, VWR: words per row.
    constexpr int KW = D * KB / 128, VW = D / 64, NS = D / 16, NT = D / 8;
    constexpr float RESCALE = 8.0f;  // how far (base 2) a tile's max may pass a row's reference max unrescaled
    constexpr int KWR = D * KB / 32, VWR = D / 8, GPR = D / G;
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int g = lane >> 2, t = lane & 3;
    constexpr int HB = (REP + RB - 1) / RB, QPT = RB >= 16 ? 1 : 16 / RB, NR = QPT * RB;
    const int QL = PREFILL ? meta[2] : 1;  // queries a row
    const int QT = (QL + QPT - 1) / QPT;  // tiles of a kv head's queries
    constexpr int NRV = PREFILL ? NR : RB;  // tile rows that can hold a query
    const int c = blockIdx.x, qt = blockIdx.y % QT, h = blockIdx.y / (QT * HB);
    const int r0 = ((blockIdx.y / QT) % HB) * RB, b = blockIdx.z;
    const int Hkv = kw_shape[1];
    const int W = kw_shape[2];
    const int Hq = Hkv * REP;
    const int nc = gridDim.x;
    const int end = meta[0], window = meta[1];
    const int first = window > 0 ? max(start[b], end - QL + 1 - window) : start[b];
    const int chunk = keys_per_chunk(end - first, CHUNKS, MIN_CHUNK);
    const int ql0 = qt * QPT;  // the tile's first query
    // tile row r: whether it holds a (query head, query) pair, and that pair's row of the outputs (B, Hq, QL, ...)
    auto has_query = [&](int r) { return r0 + r % RB < REP && ql0 + r / RB < QL; };
    auto out_row = [&](int r) { return (size_t)(b * Hq + h * REP + r0 + r % RB) * QL + ql0 + r / RB; };
    // the same pair's row of `out`: (B, Hq, QL, D), or where FLAT (B, QL, Hq, D), a query's heads side by side
    auto out_at = [&](int r) {
        return FLAT ? (size_t)(b * QL + ql0 + r / RB) * Hq + h * REP + r0 + r % RB : out_row(r);
    };
    if (first + c * chunk >= end) {  // a chunk past the row's keys (short rows use fewer): none is read
        if (c == 0) {  // a row without keys: its output is zeros
            for (int r = 0; r < NRV; ++r) {
                if (!has_query(r)) continue;
                for (int d = threadIdx.x; d < D; d += WARPS * 32) out[out_at(r) * D + d] = static_cast<T>(0.0f);
            }
        }
        return;
    }
    // the tile's queries see keys up to its last query's column, and from its first query's window on
    const int ql1 = min(QL, ql0 + QPT) - 1;
    const int lo = window > 0 && QL > 1 ? max(first + c * chunk, end - QL + ql0 + 1 - window) : first + c * chunk;
    const int hi = min(min(end, end - QL + ql1 + 1), first + (c + 1) * chunk);
    const float scale = __int_as_float(SCALE);  // a constant: a read of it would wait on memory
    const size_t row_base = ((size_t)(b * Hkv + h)) * W;
    const int kgrp = ((D / 4) * t) / G, vgrp = ((D / 8) * g) / G;

    // The prologue's other reads from global memory, asked for before anything waits on one (the
    // asynchronous copies below are fences to the compiler): the RoPE angles' inputs and the query words of
    // the warp's tile rows (warp w takes rows w, w + WARPS, ...; its lane, dims (D/32) lane .. (D/32) lane + D/32 - 1)
    static_assert(!ROPE || D / 2 <= WARPS * 32, "a thread per RoPE angle");
    static_assert(16 % WARPS == 0, "a warp's share of the 16 tile rows");
    constexpr int RPW = 16 / WARPS, QWL = D / 64;  // tile rows a warp, query words a lane
    const int pos_b = ROPE ? pos[b] : 0;
    const float freq = ROPE && threadIdx.x < D / 2 ? inv_freq[threadIdx.x] : 0.0f;
    unsigned int qw[RPW][QWL];
    #pragma unroll
    for (int i = 0; i < RPW; ++i) {
        const int row = warp + WARPS * i, ql = ql0 + row / RB, hq = h * REP + r0 + row % RB;
        const bool has = row < NRV && ql < QL && r0 + row % RB < REP;
        const unsigned int* qr = reinterpret_cast<const unsigned int*>(q + ((size_t)(b * Hq + hq) * QL + ql) * D) + QWL * lane;
        if constexpr (QWL == 2) {
            const uint2 w = has ? *reinterpret_cast<const uint2*>(qr) : make_uint2(0u, 0u);
            qw[i][0] = w.x; qw[i][1] = w.y;
        } else {
            qw[i][0] = has ? qr[0] : 0u;
        }
    }

    // Each warp stages its tiles (16 keys: their key and value words and, where a row's groups
    // fill whole 4-byte words, their scales and biases) in shared memory by asynchronous copies,
    // STAGES tiles in flight; its first ones are asked for before the queries are made. A row
    // past hi is staged as row hi - 1 (read, not used). Value rows lie VWR + 4 words apart, so
    // the lanes that read four rows at once meet no bank twice.
    constexpr bool SC = (GPR * 2) % 4 == 0;  // scales and biases staged too (else read in the loop)
    constexpr int KSW = 16 * KWR, VRS = VWR + 4, VSW = 16 * VRS, SSW = SC ? 8 * GPR : 0;
    constexpr int STAGE = KSW + VSW + 4 * SSW;  // words a stage (a multiple of 4)
    constexpr int DP = D + D / 32;  // a row of the warps' sums: dim d at d + d / 32 (the lanes that store meet no bank twice)
    constexpr int SUMS = WARPS * NRV * DP;  // the warps' sums, which use the stages' memory after the loop
    constexpr int BUF = WARPS * STAGES * STAGE > SUMS ? WARPS * STAGES * STAGE : SUMS;
    __shared__ __align__(16) unsigned int s_buf[BUF];
    unsigned int* const stages = s_buf + warp * STAGES * STAGE;
    const int step = WARPS * 16, base0 = lo + warp * 16;
    const int tiles = base0 < hi ? (hi - base0 + step - 1) / step : 0;
    // A tile's key words are 16 consecutive rows of KWR words and its value words 16 of VWR: lane piece j of 16
    // bytes lies at word 4 j of the tile's keys (values: and at 4 j + 4 r in the stage, r its row). A tile within
    // the chunk copies them straight; only one reaching past hi (the chunk's last) clamps its rows. Scales and
    // biases (a row's GPR halves a copy) clamp their row on every tile.
    constexpr int KP = KWR / 4, VP = VWR / 4;  // 16-byte pieces a row
    constexpr int NKC = (16 * KP + 31) / 32, NVC = (16 * VP + 31) / 32;  // a lane's copies of key, value pieces
    const unsigned int stages_s = shared_address(stages);
    // a whole tile's lane pieces j = lane + 32 n: the lane's first piece's source and stage address once, then
    // per tile only the tile's first row and the stage move them (n's offsets are constants)
    const unsigned int* const kq = kw + row_base * KWR + 4 * lane;
    const unsigned int* const vq = vw + row_base * VWR + 4 * lane;
    const unsigned int kdst = stages_s + 16 * lane, vdst = stages_s + 4 * KSW + 16 * lane + 16 * (lane / VP);
    auto stage_tile = [&](int slot, int base) {  // the warp's tile at key `base` into stage `slot`
        const unsigned int st = stages_s + 4 * slot * STAGE;
        if (base + 16 <= hi) {  // the same for the warp's lanes
            const unsigned int* kt = kq + base * KWR;
            const unsigned int* vt = vq + base * VWR;
            #pragma unroll
            for (int n = 0; n < NKC; ++n) {
                if (lane + 32 * n < 16 * KP) copy_async<16>(kdst + 4 * slot * STAGE + 512 * n, kt + 128 * n);
            }
            #pragma unroll
            for (int n = 0; n < NVC; ++n) {
                if (lane + 32 * n < 16 * VP)
                    copy_async<16>(vdst + 4 * slot * STAGE + 512 * n + 16 * (32 * n / VP), vt + 128 * n);
            }
        } else {
            const size_t first_row = row_base + base;
            const unsigned int* kt = kw + first_row * KWR;
            const unsigned int* vt = vw + first_row * VWR;
            #pragma unroll
            for (int n = 0; n < NKC; ++n) {
                const int j = lane + 32 * n, r = j / KP, p = j % KP;
                if (j < 16 * KP) copy_async<16>(st + 16 * j, kt + (min(base + r, hi - 1) - base) * KWR + 4 * p);
            }
            #pragma unroll
            for (int n = 0; n < NVC; ++n) {
                const int j = lane + 32 * n, r = j / VP, p = j % VP;
                if (j < 16 * VP)
                    copy_async<16>(st + 4 * KSW + 16 * j + 16 * r, vt + (min(base + r, hi - 1) - base) * VWR + 4 * p);
            }
        }
        if constexpr (SC) {
            #pragma unroll
            for (int n = 0; n < 2; ++n) {  // 16 rows of each of ks, kb, vs, vb
                const int a = lane / 16 + 2 * n, r = lane % 16;
                const size_t e = (row_base + min(base + r, hi - 1)) * GPR;
                const void* src = a == 0 ? static_cast<const void*>(ks + e) : a == 1 ? static_cast<const void*>(kb + e)
                                : a == 2 ? static_cast<const void*>(vs + e) : static_cast<const void*>(vb + e);
                copy_async<GPR * 2>(st + 4 * (KSW + VSW + a * SSW) + 2 * GPR * r, src);
            }
        }
    };
    #pragma unroll
    for (int i = 0; i < STAGES - 1; ++i) {
        if (i < tiles) stage_tile(i, base0 + i * step);
        copies_commit();
    }

    // A fragments of the queries (rows g and g + 8 of lane (g, t)), made once per block into shared memory by
    // every warp, each from its rows: a row's dims d = (D/32) lane + j go to fragment lane 4 (row % 8) + d / (D/4),
    // k-slice (d % (D/4)) / 4, word (row / 8) + 2 ((d % 4) / 2), half d % 2
    __shared__ __align__(16) uint4 s_qa[NS][32];
    __shared__ float s_rope[ROPE ? D : 1];  // cos, then sin, of the D/2 angles: the block's threads make them
    if constexpr (ROPE) {
        if (threadIdx.x < D / 2) {
            const float theta = static_cast<float>(pos_b) * freq;
            s_rope[threadIdx.x] = cos(theta);
            s_rope[D / 2 + threadIdx.x] = sin(theta);
        }
        __syncthreads();
    }
    #pragma unroll
    for (int i = 0; i < RPW; ++i) {
        const int row = warp + WARPS * i;
        float x[2 * QWL];
        #pragma unroll
        for (int v = 0; v < QWL; ++v) unpack2(qw[i][v], x[2 * v], x[2 * v + 1], T());
        if (row < NRV) {  // the same for the warp's lanes; a row without a query is all zeros
            if constexpr (ROPE) {  // RoPE at the row's position, as mx.fast.rope: dim i with i + D/2 (lane ^ 16)
                #pragma unroll
                for (int j = 0; j < 2 * QWL; ++j) {
                    const float other = __shfl_xor_sync(0xffffffffu, x[j], 16);
                    const int f = ((D / 32) * lane + j) % (D / 2);
                    const float c = s_rope[f], s = s_rope[D / 2 + f];
                    x[j] = static_cast<float>(static_cast<T>(lane < 16 ? x[j] * c - other * s : other * s + x[j] * c));
                }
            }
            #pragma unroll
            for (int j = 0; j < 2 * QWL; ++j) x[j] *= scale;
            if constexpr (ROT) warp_hadamard(x, lane);  // x H along D (H's 1/sqrt(D) is in `scale`)
        }
        unsigned int* const qa = reinterpret_cast<unsigned int*>(s_qa);
        #pragma unroll
        for (int v = 0; v < QWL; ++v) {  // dims d, d + 1 with d = (D/32) lane + 2 v: one word
            const int d = (D / 32) * lane + 2 * v, e = d % (D / 4);
            const int fl = 4 * (row % 8) + d / (D / 4), word = row / 8 + 2 * ((e % 4) / 2);
            qa[((e / 4) * 32 + fl) * 4 + word] = pack_half2(x[2 * v], x[2 * v + 1]);
        }
    }
    __syncthreads();
    float m[2] = {-INFINITY, -INFINITY}, l[2] = {0.0f, 0.0f};  // rows g and g + 8
    // columns of the queries of rows g and g + 8 (PREFILL: each attends up to its own, and its window)
    const int qpos[2] = {end - QL + min(QL - 1, ql0 + g / RB), end - QL + min(QL - 1, ql0 + (g + 8) / RB)};
    float o[NT][4];
    #pragma unroll
    for (int dt = 0; dt < NT; ++dt) {
        #pragma unroll
        for (int i = 0; i < 4; ++i) o[dt][i] = 0.0f;
    }
    int read_slot = 0, write_slot = STAGES - 1;  // tile i's stage, tile i + STAGES - 1's
    for (int i = 0; i < tiles; ++i) {
        const int base = base0 + i * step;
        if (i + STAGES - 1 < tiles) stage_tile(write_slot, base + (STAGES - 1) * step);
        copies_commit();
        copies_wait<STAGES - 1>();  // tile i is in
        __syncwarp();
        const unsigned int* st = stages + read_slot * STAGE;
        read_slot = read_slot + 1 == STAGES ? 0 : read_slot + 1;
        write_slot = write_slot + 1 == STAGES ? 0 : write_slot + 1;
        const auto* sks = reinterpret_cast<decltype(ks)>(st + KSW + VSW);
        const auto* skb = reinterpret_cast<decltype(kb)>(st + KSW + VSW + SSW);
        const auto* svs = reinterpret_cast<decltype(vs)>(st + KSW + VSW + 2 * SSW);
        const auto* svb = reinterpret_cast<decltype(vb)>(st + KSW + VSW + 3 * SSW);
        unsigned int kwd[2][KW], vwd[4][VW], ksc[2], ksc2[2], kbi[2];
        float vs_[4], vb_[4];
        #pragma unroll
        for (int nt = 0; nt < 2; ++nt) {  // K rows base + 8 nt + g
            const int r = 8 * nt + g;
            const unsigned int* kr = st + r * KWR + KW * t;
            if constexpr (KW % 4 == 0) {
                #pragma unroll
                for (int v = 0; v < KW / 4; ++v) {
                    const uint4 w = reinterpret_cast<const uint4*>(kr)[v];
                    kwd[nt][4 * v] = w.x; kwd[nt][4 * v + 1] = w.y; kwd[nt][4 * v + 2] = w.z; kwd[nt][4 * v + 3] = w.w;
                }
            } else if constexpr (KW % 2 == 0) {
                #pragma unroll
                for (int v = 0; v < KW / 2; ++v) {
                    const uint2 w = reinterpret_cast<const uint2*>(kr)[v];
                    kwd[nt][2 * v] = w.x; kwd[nt][2 * v + 1] = w.y;
                }
            } else {
                #pragma unroll
                for (int w = 0; w < KW; ++w) kwd[nt][w] = kr[w];
            }
            const size_t e = SC ? r * GPR + kgrp : (row_base + min(base + r, hi - 1)) * GPR + kgrp;
            const float s = static_cast<float>(SC ? sks[e] : ks[e]), z = static_cast<float>(SC ? skb[e] : kb[e]);
            ksc[nt] = pack_half2(s, KB == 4 ? s * 0.0625f : s * 0.25f);
            ksc2[nt] = pack_half2(s * 0.0625f, s * 0.25f);  // 6-bit keys' second pair
            kbi[nt] = pack_half2(z, z);
        }
        #pragma unroll
        for (int k = 0; k < 4; ++k) {  // V rows base + 2t + {0, 1, 8, 9}
            const int r = 2 * t + (k & 1) + 8 * (k >> 1);
            const unsigned int* vr = st + KSW + r * VRS + VW * g;
            if constexpr (VW == 2) {
                const uint2 w = *reinterpret_cast<const uint2*>(vr);
                vwd[k][0] = w.x; vwd[k][1] = w.y;
            } else {
                vwd[k][0] = vr[0];
            }
            const size_t e = SC ? r * GPR + vgrp : (row_base + min(base + r, hi - 1)) * GPR + vgrp;
            vs_[k] = static_cast<float>(SC ? svs[e] : vs[e]);
            vb_[k] = static_cast<float>(SC ? svb[e] : vb[e]);
        }
        // scores: sc[nt] is the C fragment of keys base + 8 nt + 2t + {0, 1}, rows g and g + 8
        float sc[2][4];
        #pragma unroll
        for (int nt = 0; nt < 2; ++nt) {
            #pragma unroll
            for (int i = 0; i < 4; ++i) sc[nt][i] = 0.0f;
        }
        #pragma unroll
        for (int ks = 0; ks < NS; ++ks) {
            const uint4 a4 = s_qa[ks][lane];
            const unsigned int a[4] = {a4.x, a4.y, a4.z, a4.w};
            #pragma unroll
            for (int nt = 0; nt < 2; ++nt) {
                unsigned int b0, b1;  // dims (4ks, 4ks+1) and (4ks+2, 4ks+3) of the lane's D/4
                if constexpr (KB == 4) {
                    const unsigned int w = kwd[nt][ks / 2];
                    const int byte = (2 * ks) % 4;  // its two nibbles are a pair's two dims
                    b0 = dequant2(__byte_perm(w, 0, byte | (byte << 8)), 0x00F0000Fu, ksc[nt], kbi[nt]);
                    b1 = dequant2(__byte_perm(w, 0, (byte + 1) | ((byte + 1) << 8)), 0x00F0000Fu, ksc[nt], kbi[nt]);
                } else {
                    // the 4 dims' 24 bits are bytes o .. o + 2 of words (w0, w1), at bit sh = 8 o: d0 at bits
                    // sh .. sh + 5, d1 6 bits higher, and so on. Each half takes a dim within its mantissa's bits
                    // 0-9 (1024 + 2^k n, scale / 2^k, exact while a normal f16: s >= 2^-10): d0 from byte o at
                    // bit 0; d1 at bit 2 of the high half of x, whose bits 16-31 are the pair's bits sh + 4 ..
                    // sh + 19 (one shift); d2 at bit 4 of bytes o + 1, o + 2; d3 at bit 2 of bytes o + 2, o + 3
                    const int bit = 24 * ks, wi = bit / 32, sh = bit % 32, o = sh / 8;
                    const unsigned int w0 = kwd[nt][wi], w1 = kwd[nt][wi + 1 < KW ? wi + 1 : wi];
                    const unsigned int x = sh >= 12 ? __funnelshift_r(w0, w1, sh - 12) : w0 << (12 - sh);
                    b0 = dequant2(__byte_perm(w0, x, o | (o << 4) | 0x7600), 0x00FC003Fu, ksc[nt], kbi[nt]);
                    b1 = dequant2(__byte_perm(w0, w1, (o + 1) | ((o + 2) << 4) | ((o + 2) << 8) | ((o + 3) << 12)),
                                  0x00FC03F0u, ksc2[nt], kbi[nt]);
                }
                mma16816(sc[nt], a, b0, b1);
            }
        }
        if (PREFILL || base + 16 > hi) {  // a prefill tile's causal mask, or a tile reaching past hi (the last)
            #pragma unroll
            for (int nt = 0; nt < 2; ++nt) {
                #pragma unroll
                for (int i = 0; i < 4; ++i) {
                    const int col = base + 8 * nt + 2 * t + (i & 1);
                    if (col >= hi) sc[nt][i] = -INFINITY;
                    if constexpr (PREFILL) {
                        const int p = qpos[i >> 1];
                        if (col > p || (window > 0 && col <= p - window)) sc[nt][i] = -INFINITY;
                    }
                }
            }
        }
        // online softmax per row (the 4 lanes of a g hold a row's 16 scores)
        unsigned int pa[4];
        float corr[2];
        #pragma unroll
        for (int r = 0; r < 2; ++r) {
            float top = fmaxf(fmaxf(sc[0][2 * r], sc[0][2 * r + 1]), fmaxf(sc[1][2 * r], sc[1][2 * r + 1]));
            top = fmaxf(top, __shfl_xor_sync(0xffffffffu, top, 1));
            top = fmaxf(top, __shfl_xor_sync(0xffffffffu, top, 2));
            // the reference max moves only where the tile's passes it by more than RESCALE (base 2), so p <= 2^RESCALE
            // (exact enough in f16) and the sums are rescaled in few tiles; m = -inf: any valid key moves it
            const bool rise = top > m[r] + RESCALE;
            corr[r] = rise ? fast_exp2(m[r] - top) : 1.0f;
            m[r] = rise ? top : m[r];
            const float ref = m[r] == -INFINITY ? 0.0f : m[r];  // no valid key yet: every p is 2^-inf = 0
            const float p00 = fast_exp2(sc[0][2 * r] - ref), p01 = fast_exp2(sc[0][2 * r + 1] - ref);
            const float p10 = fast_exp2(sc[1][2 * r] - ref), p11 = fast_exp2(sc[1][2 * r + 1] - ref);
            l[r] = fmaf(l[r], corr[r], (p00 + p01) + (p10 + p11));
            pa[r] = pack_half2(p00, p01);      // A rows g (r = 0) and g + 8 (r = 1), keys 2t, 2t+1
            pa[2 + r] = pack_half2(p10, p11);  // keys 2t + 8, 2t + 9
        }
        // the sums rescaled where a row's reference max moved (corr 1 leaves them as they are)
        if (__any_sync(0xffffffffu, corr[0] != 1.0f || corr[1] != 1.0f)) {
            #pragma unroll
            for (int dt = 0; dt < NT; ++dt) {
                #pragma unroll
                for (int i = 0; i < 4; ++i) o[dt][i] *= corr[i >> 1];
            }
        }
        // O += P V, one d-tile at a time
        unsigned int vsc[2][2], vbi[2];
        #pragma unroll
        for (int pr = 0; pr < 2; ++pr) {  // key pairs (2t, 2t+1) and (2t+8, 2t+9)
            vsc[pr][0] = pack_half2(vs_[2 * pr], vs_[2 * pr + 1]);
            vsc[pr][1] = pack_half2(vs_[2 * pr] * 0.0625f, vs_[2 * pr + 1] * 0.0625f);
            vbi[pr] = pack_half2(vb_[2 * pr], vb_[2 * pr + 1]);
        }
        #pragma unroll
        for (int dt = 0; dt < NT; ++dt) {
            const int w = dt / 8, byte = (dt % 8) / 2, odd = dt & 1;
            const unsigned int mask = odd ? 0x00F000F0u : 0x000F000Fu;
            const unsigned int sel = byte | ((byte + 4) << 8);
            const unsigned int b0 = dequant2(__byte_perm(vwd[0][w], vwd[1][w], sel), mask, vsc[0][odd], vbi[0]);
            const unsigned int b1 = dequant2(__byte_perm(vwd[2][w], vwd[3][w], sel), mask, vsc[1][odd], vbi[1]);
            mma16816(o[dt], pa, b0, b1);
        }
        __syncwarp();  // the stage read: tile i + STAGES may take it
    }
    copies_wait<0>();
    __syncthreads();  // every warp done with its stages: their memory now takes the warps' sums
    #pragma unroll
    for (int r = 0; r < 2; ++r) {
        l[r] += __shfl_xor_sync(0xffffffffu, l[r], 1);
        l[r] += __shfl_xor_sync(0xffffffffu, l[r], 2);
    }
    __shared__ float s_m[WARPS][16];
    __shared__ float s_l[WARPS][16];
    auto s_acc = reinterpret_cast<float (*)[NRV][DP]>(s_buf);
    #pragma unroll
    for (int r = 0; r < 2; ++r) {
        const int row = g + 8 * r;
        if (row < NRV) {
            if (t == 0) {
                s_m[warp][row] = m[r];
                s_l[warp][row] = l[r];
            }
            #pragma unroll
            for (int dt = 0; dt < NT; ++dt) {
                const int d0 = (D / 8) * (2 * t) + dt, d1 = (D / 8) * (2 * t + 1) + dt;
                s_acc[warp][row][d0 + d0 / 32] = o[dt][2 * r];
                s_acc[warp][row][d1 + d1 / 32] = o[dt][2 * r + 1];
            }
        }
    }
    __syncthreads();
    // each tile row's weights for the warps' sums (2^(m_w - M)), its max M and its sum L, made once
    __shared__ __align__(16) float s_f[16][WARPS];
    if (threadIdx.x < NRV) {
        const int r = threadIdx.x;
        float M = -INFINITY;
        #pragma unroll
        for (int w = 0; w < WARPS; ++w) M = fmaxf(M, s_m[w][r]);
        float L = 0.0f;
        #pragma unroll
        for (int w = 0; w < WARPS; ++w) {
            const float f = s_m[w][r] == -INFINITY ? 0.0f : exp2f(s_m[w][r] - M);
            L = fmaf(s_l[w][r], f, L);
            s_f[r][w] = f;
        }
        if (has_query(r)) {
            const size_t o_ = out_row(r) * nc + c;
            pm[o_] = M;
            pl[o_] = L;
        }
    }
    __syncthreads();
    #pragma unroll
    for (int r = 0; r < NRV; ++r) {
        if (!has_query(r)) continue;
        const size_t o_ = out_row(r) * nc + c;
        for (int d = threadIdx.x; d < D; d += WARPS * 32) {
            float A = 0.0f;
            #pragma unroll
            for (int w = 0; w < WARPS; ++w) A = fmaf(s_acc[w][r][d + d / 32], s_f[r][w], A);
            pacc[o_ * D + d] = A;
        }
    }

    // The last of a (row, kv head, query tile)'s `mine` blocks to finish combines their sums, so no
    // second launch: once the block's sums are written, one thread counts the block in `counters`
    // (zeros before the call) with a release (the block's writes before it, through the barrier) and
    // acquire (the other blocks' writes after it); the block that counts last reads them all (from
    // L2), in chunk order whichever block it is, and sets its counter back to zero.
    const int mine = min(nc, (end - first + chunk - 1) / chunk);  // >= 1: this block has keys
    __shared__ bool s_last;
    __syncthreads();
    if (threadIdx.x == 0) {
        unsigned int* const counter = (unsigned int*)(counters) + (size_t)blockIdx.z * gridDim.y + blockIdx.y;
        unsigned int seen;
        asm volatile("atom.acq_rel.gpu.global.add.u32 %0, [%1], 1;" : "=r"(seen) : "l"(counter) : "memory");
        s_last = seen + 1u == static_cast<unsigned int>(mine);
        if (s_last) *counter = 0u;  // every other block has counted: the array may serve a later call
    }
    __syncthreads();
    if (!s_last) return;
    // a warp a tile row; lane t takes chunk t's max and sum and dims DL t .. DL t + DL - 1 of the output,
    // reading CB chunks' sums at once (independent loads: one wait on L2 for each CB chunks)
    static_assert(CHUNKS <= 32, "a lane per chunk");
    constexpr int DL = D / 32, CB = CHUNKS < 8 ? CHUNKS : 8;
    for (int r = warp; r < NRV; r += WARPS) {
        if (!has_query(r)) continue;
        const size_t base = out_row(r) * nc;
        const float mc = lane < mine ? __ldcg(pm + base + lane) : -INFINITY;
        const float lc = lane < mine ? __ldcg(pl + base + lane) : 0.0f;
        float M = mc;
        #pragma unroll
        for (int off = 16; off > 0; off >>= 1) M = fmaxf(M, __shfl_xor_sync(0xffffffffu, M, off));
        const float f = mc != -INFINITY ? exp2f(mc - M) : 0.0f;
        float L = mc != -INFINITY ? lc * f : 0.0f;
        #pragma unroll
        for (int off = 16; off > 0; off >>= 1) L += __shfl_xor_sync(0xffffffffu, L, off);
        float A[DL];
        #pragma unroll
        for (int j = 0; j < DL; ++j) A[j] = 0.0f;
        #pragma unroll
        for (int i0 = 0; i0 < CHUNKS; i0 += CB) {
            if (i0 >= mine) break;  // the same for the warp's lanes
            float a[CB][DL];
            #pragma unroll
            for (int i = 0; i < CB; ++i) {  // chunks past `mine` read the last one again (not used)
                const float* const src = pacc + (base + min(i0 + i, mine - 1)) * D + DL * lane;
                if constexpr (DL == 4) {
                    const float4 v = __ldcg(reinterpret_cast<const float4*>(src));
                    a[i][0] = v.x; a[i][1] = v.y; a[i][2] = v.z; a[i][3] = v.w;
                } else {
                    const float2 v = __ldcg(reinterpret_cast<const float2*>(src));
                    a[i][0] = v.x; a[i][1] = v.y;
                }
            }
            #pragma unroll
            for (int i = 0; i < CB; ++i) {
                const float fi = __shfl_sync(0xffffffffu, f, i0 + i);
                #pragma unroll
                for (int j = 0; j < DL; ++j) A[j] = i0 + i < mine ? fmaf(a[i][j], fi, A[j]) : A[j];
            }
        }
        #pragma unroll
        for (int j = 0; j < DL; ++j) A[j] = L > 0.0f ? A[j] / L : 0.0f;
        if constexpr (ROT) {  // the output back from the rotated basis: A H along D
            warp_hadamard(A, lane);
            #pragma unroll
            for (int j = 0; j < DL; ++j) A[j] *= static_cast<float>(static_cast<T>(1.0f / sqrtf(static_cast<float>(D))));
        }
        const size_t to = out_at(r) * D + DL * lane;
        #pragma unroll
        for (int j = 0; j < DL; ++j) out[to + j] = static_cast<T>(A[j]);
    }
"""

_kernels = {}
_launches = {}  # `_launch`'s (compiled call, counters) per shape: made once, looked up per call (a decode step makes 32)


def counters_for(rows: int, query_heads: int, kv_heads: int, queries: int) -> int:
    """How many uint32 counters (zeros) a call of `q4_decode_sdpa` with these shapes counts its blocks in: one a
    (row, kv head, group of HEADS query heads, tile of queries), the rows times `_tiles_a_row`."""
    return rows * _tiles_a_row(query_heads, kv_heads, queries)


def _tiles_a_row(query_heads: int, kv_heads: int, queries: int) -> int:
    """The kernel's blocks a row and chunk of keys (its grid's y): a (kv head, group of HEADS query heads, tile of
    queries) each."""
    rep = query_heads // kv_heads
    return kv_heads * -(-rep // HEADS) * _query_tiles(queries, rep)


def block_counters(n: int):
    """`n` uint32 zeros (at least 4: MLX-CUDA keeps arrays of 8 bytes or less in host memory) for
    `q4_decode_sdpa`'s `keys`' fourth array. The kernel sets every counter it used back to zero, so calls that run
    one after another (each depending on the one before, or in separate evaluations) may share one such array;
    calls that may run at the same time (independent in one evaluation) may not."""
    return mx.zeros((max(4, n),), dtype=mx.uint32)


def _check_rope(rope, rows, head_dim):
    from runtime.q4pack import check_rope  # imported late: q4pack imports this module

    check_rope(rope, rows, head_dim)


@functools.lru_cache(maxsize=1)
def _no_rope():
    """`q4pack.no_rope()`: the inputs that say "no RoPE" (imported late: q4pack imports this module)."""
    from runtime.q4pack import no_rope

    return no_rope()


def serves(key_bits: int, value_bits: int, head_dim: int, group_size: int) -> bool:
    """Whether `q4_decode_sdpa` reads caches of this layout: keys of KEY_BITS, 4-bit values,
    head dim 64 or 128, and a group size that divides it (32, 64 or 128)."""
    return key_bits in KEY_BITS and value_bits == 4 and head_dim in (64, 128) and head_dim % group_size == 0


META_BLOCK = 64  # ends whose parameters `meta` makes in one array


def meta(end: int, window: int, queries: int):
    """The kernels' int32 parameters [end, window, queries a row] as a device array (see `q4_decode_sdpa`).

    The same array for the same arguments while they are recent, per thread: a decode
    step's 32 layers share one, and so does `q4pack.pack_kv_into` (which reads `end`) with
    the layers without a window. It is a view of a row of an array made for META_BLOCK
    consecutive ends at once (making an array from host data cost an H100's host 200 us a
    step, a row's view 3 us), and a view is evaluated by the thread that made it. Threads are told apart by a
    token of their own, not by their id, which the system gives again once a thread has ended: a batcher
    restarted on a new thread would get its predecessor's views, made on a stream it does not have.
    """
    token = getattr(_threads, "token", None)
    if token is None:
        token = _threads.token = object()
    return _meta_row(end, window, queries, token)


_threads = threading.local()


@functools.lru_cache(maxsize=16)
def _meta_row(end: int, window: int, queries: int, thread: object):
    return _meta_block(end // META_BLOCK, window, queries)[end % META_BLOCK]


@functools.lru_cache(maxsize=4)
def _meta_block(block: int, window: int, queries: int):
    """`meta`'s parameters for ends block * META_BLOCK ... (block + 1) * META_BLOCK - 1, one row each."""
    first = block * META_BLOCK
    return mx.array([[first + i, window, queries] for i in range(META_BLOCK)], dtype=mx.int32)


def q4_decode_sdpa(queries, keys, values, start, end: int, scale: float, group_size: int, meta_array=None,
                   window: int = 0, rotated: bool = False, rope=None, flat: bool = False):
    """Attention of L queries per row over packed keys (4 or 6 bits) and 4-bit values, row b over [start[b], end).

    queries (B, Hq, L, D) in float16 or bfloat16 with D 64 or 128 and 1 <= L <= MAX_QUERIES;
    query l of a row sits at column end - L + l and attends to the columns up to it (causal;
    L = 1 is a decode step, more a short prefill chunk whose keys are already written); keys/values (words,
    scales, biases) of shape (B, Hkv, W, ...) with W >= end, Hq a multiple of Hkv, and group size 32, 64 or 128 (at most D); start: int32 (B,)
    (every block reads it: for one or two rows give it as `q4cache.row_array` makes it, in device memory). With
    `window` > 0 a query attends only to its last `window` columns (a sliding-window layer).
    `meta_array`: `meta(end, window, L)`, made here if not given (pass it to share one per step).
    `rotated`: keys and values are stored Hadamard-rotated along D (`runtime.kvscheme`); the
    kernels then rotate the queries in and the output back out themselves, as
    `kvscheme.rotate` would (H's entries rounded to the queries' dtype).
    Returns (B, Hq, L, D) in the queries' dtype. A row's output depends on its own columns
    and L only: bitwise the same in any batch and under any left padding. Other bit widths raise
    ValueError. `keys` may carry a fourth array of uint32 zeros, which the kernel counts its
    blocks in (`counters_for` of them; made here when not given, or too few): the result of
    `q4pack.pack_kv_into` when it wrote the newest columns in place in this evaluation (the
    kernel takes it as an input, so that MLX runs the write first), or `block_counters`. `rope`: (positions, inv_freq) to rotate the queries by
    RoPE first, at row b's position positions[b], as `q4pack.pack_kv_into` rotates keys (decode only).
    `flat`: return (B, L, Hq * D) instead, each query's heads side by side, as a model's output projection takes
    them: the same values as `out.transpose(0, 2, 1, 3).reshape(B, L, -1)`, with no copy to make them so.
    """
    if len(keys) == 4:
        *keys, counters = keys
    else:
        counters = None
    B, Hq, L, D = queries.shape
    if not 1 <= L <= MAX_QUERIES or (rope is not None and L > 1):
        raise ValueError(f"q4_decode_sdpa takes 1 to {MAX_QUERIES} queries a row (RoPE inside for one only); "
                         f"got {L}{' with rope' if rope is not None else ''}")
    if meta_array is None:
        meta_array = meta(end, window, L)
    key = (B, Hq, L, keys[0].shape[1], D, keys[0].shape[-1], values[0].shape[-1], queries.dtype, group_size, scale,
           bool(rotated), rope is not None, bool(flat))
    launch = _launches.get(key)
    if rope is not None:
        _check_rope(rope, B, D)
    if launch is None:
        launch = _launches[key] = _launch(*key)
    run, needed = launch
    if counters is None:
        counters = block_counters(needed)
    elif counters.size < needed:  # too few for this call (more than HEADS query heads a kv head)
        counters = block_counters(needed) + counters[:1] * 0  # still ordered after the write it stands for
    positions, inv_freq = rope if rope is not None else _no_rope()
    return run(queries, *keys, *values, start, meta_array, counters, positions, inv_freq)


def _chunks(prefill: bool) -> int:
    """Blocks a row's keys are split among (per kv head and tile of queries)."""
    return PREFILL_CHUNKS if prefill else CHUNKS


def _query_tiles(queries: int, rep: int) -> int:
    """Tiles of (query, head) pairs per kv head and head group: HEADS pairs each, of one query's heads when
    `rep` (query heads per kv head) is HEADS or more, else of HEADS // rep queries."""
    return -(-queries // (1 if rep >= HEADS else HEADS // rep))


def _launch(B, Hq, L, Hkv, D, key_words, value_words, dtype, group_size, scale, rotated, rope, flat):
    """(the kernel's call as a function of its inputs, the counters it needs) for one shape of `q4_decode_sdpa`."""
    args = launch_arguments(B, Hq, L, Hkv, D, key_words, value_words, dtype, group_size, scale, rotated, rope, flat)
    return compiled_launch(kernel(), args, 3), counters_for(B, Hq, Hkv, L)


def kernel():
    """The attention kernel (`mx.fast.cuda_kernel`), made once."""
    if "q4_decode" not in _kernels:
        _kernels["q4_decode"] = cuda_kernel("kvactors_q4_decode", *KERNEL_NAMES, _KERNEL, header=_HEADER)
    return _kernels["q4_decode"]


def launch_arguments(B, Hq, L, Hkv, D, key_words, value_words, dtype, group_size, scale, rotated, rope,
                     flat: bool = False) -> dict:
    """The kernel's launch arguments (template, grid, threadgroup, output shapes and dtypes) for one shape of
    `q4_decode_sdpa` (`flat`: its output as (B, L, Hq * D)); ValueError for a cache layout it does not read."""
    rep = Hq // Hkv
    key_bits, value_bits = key_words * 32 // D, value_words * 32 // D
    if not serves(key_bits, value_bits, D, group_size):
        raise ValueError(f"q4_decode_sdpa reads keys of {KEY_BITS} bits, 4-bit values, head dim 64 or 128 and "
                         f"groups of 32-128; got {key_bits}-bit keys, {value_bits}-bit values, head dim {D}, "
                         f"group {group_size}")
    chunks = _chunks(L > 1)
    return dict(
        template=templates(dtype, D, group_size, rep, key_bits, L > 1, rotated, rope, scale, flat),
        grid=(chunks * WARPS * 32, _tiles_a_row(Hq, Hkv, L), B),
        threadgroup=(WARPS * 32, 1, 1),
        output_shapes=[(B, Hq * L, chunks), (B, Hq * L, chunks), (B, Hq * L, chunks, D),
                       (B, L, Hq * D) if flat else (B, Hq, L, D)],
        output_dtypes=[mx.float32, mx.float32, mx.float32, dtype],
    )


# the kernel's inputs and outputs: pm, pl and pacc hold each block's max, sum and weighted sum of values
KERNEL_NAMES = (["q", "kw", "ks", "kb", "vw", "vs", "vb", "start", "meta", "counters", "pos", "inv_freq"],
                ["pm", "pl", "pacc", "out"])


def templates(dtype, D: int, group_size: int, rep: int, key_bits: int, prefill: bool, rotated: bool, rope: bool,
              scale: float = 1.0, flat: bool = False):
    """The kernel's template arguments for queries of `dtype` and head dim `D` over a cache of `group_size` groups
    and `key_bits`-bit keys with `rep` query heads a kv head; `prefill`: more than one query a row; `scale`: the
    scores' scale; `flat`: the output laid out (B, L, Hq, D). At the module's launch settings (CHUNKS, MIN_CHUNK,
    WARPS, STAGES) as they are when called.

    The scale is a constant of the compiled kernel (its float32 bits, SCALE), not an input: a parameter array that
    small would live in MLX-CUDA's pool for arrays of at most 8 bytes, in managed memory the GPU reads across
    PCIe, and each of a call's thousands of blocks waited for it (+17% at 16K x 8 rows on an H100)."""
    return [("T", dtype), ("D", D), ("G", group_size), ("REP", rep), ("RB", min(rep, HEADS)), ("KB", key_bits),
            ("CHUNKS", _chunks(prefill)), ("MIN_CHUNK", MIN_CHUNK), ("WARPS", WARPS), ("STAGES", STAGES),
            ("ROT", rotated), ("ROPE", rope), ("PREFILL", prefill), ("SCALE", _scale_bits(dtype, D, scale, rotated)),
            ("FLAT", flat)]


def _scale_bits(dtype, D: int, scale: float, rotated: bool) -> int:
    """The float32 bits of the factor the kernel multiplies queries by: scores in base 2, and a rotation's
    1/sqrt(D) as H holds it (rounded to the queries' dtype)."""
    h = mx.array(1 / math.sqrt(D), dtype=dtype).item() if rotated else 1.0
    return struct.unpack("<i", struct.pack("<f", scale * math.log2(math.e) * h))[0]
