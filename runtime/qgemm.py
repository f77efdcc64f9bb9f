"""A batch-invariant 4-bit matrix product for short prefill chunks on CUDA (hot turns).

`qgemm(x, w, scales, biases, group_size)` computes `x @ dequantize(w).T` for an
input of any number of rows; `runtime.prepare` sends it the chunks between a
decode step (`qgemv`, up to 16 rows) and a long prefill (dequantize + 16-bit GEMM,
`prepare.DENSE_ROWS` rows and more): a hot turn's new message and template.

Why a kernel of our own: MLX-CUDA's quantized matmul (`qmm_sm80`) gives each
block a 64-row x 128-column tile and all of K, so at 64 rows the seven products
of an 8B-shape layer get 8 to 112 blocks for the H100's 132 SMs: in a 64-token
hot chunk they took about 930 us a layer, against 35 us to read the layer's
4-bit weights once (`benchmarks/results/h100/prefill-kernel-2026-11-24`). With
the weights read from memory, one layer's products at 64 rows take 421 us this
way against 1,363 us (`benchmarks.prefill_gemm`, results/h100/qgemm-2026-11-25).

How: tensor cores as in `qgemv` (the weight is the 16-row operand of
`mma.m16n8k16`, dequantized two nibbles at a time straight into fragment
layout; the input rows are its 8 columns). A block of 4 warps owns 128 output
columns (two 16-row tiles of the weight per warp, so each input fragment read
from shared memory feeds two products) and 64 input rows (a launch's second
grid dimension walks the rows 64 at a time), over 1/S of K in steps of 64.
`cp.async` copies each step's input and weights into a ring of three steps in
shared memory, two steps ahead, with no registers on the way; so the weights'
nibbles are taken in their own order (a byte's two nibbles as one pair, as the
input's elements lie) and the input is stored as it is. Scales and biases are
loaded a step ahead and replicated where they are used; each accumulator's
next product comes 8 products after its last. Launch bounds give a thread up to
255 registers (it takes 182-188), two blocks an SM. On an H200 this took a layer's
seven products at 64 rows from 322 to 284 us of device time and at 256 rows from
760 to 676 us against the kernel before it (8 warps of one 16-row tile each,
input staged through registers: shared memory's bandwidth, 85% busy, bound it;
`benchmarks/results/h200/qgemm-ring-2026-11-29`). S
follows from the weight's shape alone (`splits`: as many as fit one wave of
blocks); each block writes its float32 sums to its own slice of a scratch array,
and a second launch adds the S slices in split order and rounds to x's type
(where S is 1, the product launch rounds and writes its sums itself: one launch).
The launch that writes the result can add a residual to it (`add`, bitwise as a
separate add of MLX's), write q/k/v in the heads' layout attention takes
(`head_dim`), or write a gated MLP's silu(gate) up instead of gate and up
(`qgemm_swiglu`: a block takes the same 64 columns of both weights): each a launch
of MLX's fewer, which a short chunk's host time counts. The SiLU costs the product
launch more than its own launch took on the device (an 8B-shape gate/up at 64 rows
on an H200: 84.0 against 78.0 us, SiLU alone 3.2 us: every block ends at once, and
the epilogue's latency is not hidden).

Each output is summed in one fixed order (steps of K in order within a split,
then splits in order) from its own row of x and the weights, whatever the
other rows hold and however many there are: a row's result is bitwise the same
in any chunk (the order differs from `qgemv`'s, so it may differ from a decode
step's in its last bits).

Layout and limits as `qgemv` (MLX's affine 4-bit quantization: `w` (N, K / 8)
uint32, `scales` and `biases` (N, K / group_size) of x's type; K a multiple of
64), and N a multiple of 4 (`supports`).
"""

from __future__ import annotations

import mlx.core as mx

from runtime import qgemv

COLUMNS = 128  # output columns a block owns: 4 warps, two 16-row weight tiles each
ROWS = 64  # input rows a block multiplies: 8 columns of 8 of mma.m16n8k16
THREADS = 128  # threads a block: 4 warps
BLOCKS = 2  # blocks a multiprocessor by launch bounds (at most 255 registers a thread: the kernel takes 182-188)
STEP = 64  # elements of K a block's warps multiply between two barriers
WAVE = 132 * BLOCKS  # blocks resident at once on an H100 (132 SMs): `splits` stays within one wave
MIN_STEPS = 4  # steps of K a block takes at least (its loads overlap only within a split)

_GEMM = r"""
    // x (M, K) T; per weight i: wi (N_i, K / 8) uint32, si, bi (N_i, K / G) T; parti (S, M, N_i) float: split z's
    // sums over its steps of K. Blocks take the weights in order, (column tiles of weight i) x S each.
    const int K = x_shape[x_ndim - 1];
    int M = 1;
    for (int i = 0; i < x_ndim - 1; ++i) {
        M *= x_shape[i];
    }
    PICK
    const int wpr = K / 8, gpr = K / G, steps = K / 64;
    const int tile = blk / S, z = blk % S;
    const int first = z * steps / S, last = (z + 1) * steps / S;  // this split's steps of K
    const int m0 = blockIdx.y * 64;
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int g = lane >> 2, t = lane & 3;
    // this warp's 32 columns: two A tiles of 16 rows, lane rows g and g + 8 of each (SW: 16 columns, tile 0 of
    // the gate's rows, tile 1 of the up's)
    const int n0 = SW ? tile * 64 + warp * 16 : tile * 128 + warp * 32;
    // a ring of STAGES steps, each copied in whole by cp.async: 64 rows of input (64 elements: 8 x 16 bytes and
    // 16 bytes of padding, so that the 8 lanes of a 16-byte access phase hit distinct banks) and the block's 128
    // rows of weights (64 nibbles, 32 bytes)
    __shared__ uint4 xs[STAGES][64][9];
    __shared__ uint4 ws[STAGES][128][2];
    // this thread's 16-byte pieces of a step: input rows xr + 16 u (u = 0..3), column xc; weight rows wr0 + 64 u
    // (u = 0, 1), half wh
    const int xr = threadIdx.x >> 3, xc = threadIdx.x & 7, wr0 = threadIdx.x >> 1, wh = threadIdx.x & 1;
    auto fetch = [&](int step, int buf) {  // queue step's input and weights into buf (zeros past M and N)
        #pragma unroll
        for (int u = 0; u < 4; ++u) {
            const bool ok = m0 + xr + 16 * u < M;
            copy16(&xs[buf][xr + 16 * u][xc], x + (size_t)(ok ? m0 + xr + 16 * u : 0) * K + step * 64 + xc * 8, ok);
        }
        #pragma unroll
        for (int u = 0; u < 2; ++u) {
            const int r = wr0 + 64 * u;  // the ring's row r: warp r / 32's tile (r / 16) % 2, its row r % 16
            const int n = SW ? tile * 64 + (r >> 5) * 16 + (r & 15) : tile * 128 + r;
            const unsigned int* const src = SW && (r & 16) ? wq1 : wq;
            copy16(&ws[buf][r][wh], src + (size_t)(n < N ? n : 0) * wpr + step * 8 + wh * 4, n < N);
        }
    };
    // this lane's scale and bias of rows n0 + 8 i + g (i = 0..3: tile i / 2, its row g + 8 (i % 2)) for a step,
    // 16 bits as loaded (rows past N keep zeros): loaded a step ahead, replicated where they are used
    unsigned int sr[8] = {0, 0, 0, 0, 0, 0, 0, 0};
    auto fetch_scales = [&](int step) {
        const int kg = (step * 64 + t * 16) / G;
        #pragma unroll
        for (int i = 0; i < 4; ++i) {
            const int n = SW ? n0 + 8 * (i & 1) + g : n0 + 8 * i + g;
            const unsigned short* const s_ = SW && i >= 2 ? sp1 : sp;
            const unsigned short* const b_ = SW && i >= 2 ? bp1 : bp;
            if (n < N) {
                sr[2 * i] = s_[(size_t)n * gpr + kg];
                sr[2 * i + 1] = b_[(size_t)n * gpr + kg];
            }
        }
    };
    float acc[2][MT][4];  // MT: tiles of 8 rows a block multiplies (8, or fewer where the call has fewer rows)
    #pragma unroll
    for (int i = 0; i < 2; ++i) {
        #pragma unroll
        for (int mt = 0; mt < MT; ++mt) {
            acc[i][mt][0] = acc[i][mt][1] = acc[i][mt][2] = acc[i][mt][3] = 0.0f;
        }
    }
    #pragma unroll
    for (int i = 0; i < STAGES - 1; ++i) {
        if (first + i < last) fetch(first + i, i);
        copy_commit();
    }
    fetch_scales(first);
    for (int step = first; step < last; ++step) {
        const int buf = (step - first) % STAGES;
        copy_wait<STAGES - 2>();  // this thread's copies of the step have landed
        __syncthreads();          // and every thread's; all are done with the step before, whose buffer is refilled
        if (step + STAGES - 1 < last) fetch(step + STAGES - 1, (step - first + STAGES - 1) % STAGES);
        copy_commit();
        unsigned int sc[8];  // the 16-bit scales and biases in both halves of a word
        #pragma unroll
        for (int i = 0; i < 8; ++i) {
            sc[i] = __byte_perm(sr[i], 0, 0x1010);
        }
        if (step + 1 < last) fetch_scales(step + 1);
        // this lane's 16 elements of K (two words) of rows n0 + 8 i + g, as the scales
        uint2 wr[4];
        #pragma unroll
        for (int i = 0; i < 4; ++i) {
            wr[i] = reinterpret_cast<const uint2*>(ws[buf][warp * 32 + 8 * i + g])[t];
        }
        #pragma unroll
        for (int h = 0; h < 2; ++h) {  // word h of each row: elements 16 t + 8 h .. + 7 of the step
            unsigned int a[2][2][4];  // [tile][product jj: bytes 2 jj and 2 jj + 1 of the word][A fragment]
            #pragma unroll
            for (int i = 0; i < 2; ++i) {
                const unsigned int qa = h ? wr[2 * i].y : wr[2 * i].x, qb = h ? wr[2 * i + 1].y : wr[2 * i + 1].x;
                #pragma unroll
                for (int jj = 0; jj < 2; ++jj) {
                    // byte_perm: byte b of q (its low nibble: element 2 b) and of q >> 4 (element 2 b + 1)
                    const int lo = 0x0400 + 0x101 * (2 * jj), hi = lo + 0x101;
                    a[i][jj][0] = dequant2<true>(__byte_perm(qa, qa >> 4, lo), sc[4 * i], sc[4 * i + 1]);
                    a[i][jj][1] = dequant2<true>(__byte_perm(qb, qb >> 4, lo), sc[4 * i + 2], sc[4 * i + 3]);
                    a[i][jj][2] = dequant2<true>(__byte_perm(qa, qa >> 4, hi), sc[4 * i], sc[4 * i + 1]);
                    a[i][jj][3] = dequant2<true>(__byte_perm(qb, qb >> 4, hi), sc[4 * i + 2], sc[4 * i + 3]);
                }
            }
            // four tiles of 8 rows at a time (rows past M are zeros), the products in an order in which each
            // accumulator's next product comes 8 products after its last (an mma's result takes that long)
            #pragma unroll
            for (int m4 = 0; m4 < MT; m4 += 4) {
                uint4 v[4];  // elements 16 t + 8 h .. + 7 of rows 8 (m4 + q) + g
                #pragma unroll
                for (int q = 0; q < 4; ++q) {
                    if (m4 + q < MT) v[q] = xs[buf][8 * (m4 + q) + g][2 * t + h];
                }
                #pragma unroll
                for (int jj = 0; jj < 2; ++jj) {
                    #pragma unroll
                    for (int q = 0; q < 4; ++q) {
                        #pragma unroll
                        for (int i = 0; i < 2; ++i) {
                            if (m4 + q < MT) {
                                mma16816(acc[i][m4 + q], a[i][jj], jj ? v[q].z : v[q].x, jj ? v[q].w : v[q].y);
                            }
                        }
                    }
                }
            }
        }
    }
    // C fragment: acc[i][mt] = (col na, row 2t), (na, 2t + 1), (nb, 2t), (nb, 2t + 1), na = n0 + 16 i + g,
    // nb = na + 8, rows + m0 + 8 mt. Output (m, n) lies at at(m, n): row-major (M, N), or, where HD > 0, in the
    // heads' layout (B, N / HD, L, HD) of x (B, L, K). With S = 1 the sums are the outputs (rounded to T,
    // RESIDUAL added); else split z's slice of the float32 partial sums, laid out as the outputs.
    const int L = x_ndim >= 2 ? x_shape[x_ndim - 2] : M;
    auto at = [&](int m, int n) -> size_t {
        if constexpr (HD == 0) {
            return (size_t)m * N + n;
        } else {
            return (size_t)(m / L) * L * N + (size_t)(n / HD) * L * HD + (size_t)(m % L) * HD + n % HD;
        }
    };
    auto* pz = pout + (S == 1 ? 0 : (size_t)z * M * N);
    auto put = [&](int m, int n, float v) {
        if constexpr (S == 1) {
            pz[at(m, n)] = static_cast<T>(v) RESIDUAL;
        } else {
            pz[at(m, n)] = v;
        }
    };
    if constexpr (SW) {  // tile 0's sums are the gate's, tile 1's the up's, of the same outputs
        auto* pz1 = pout1 + (S == 1 ? 0 : (size_t)z * M * N);
        const int na = n0 + g, nb = na + 8;
        auto put2 = [&](int m, int n, float gate, float up) {
            if constexpr (S == 1) {
                pz[(size_t)m * N + n] = silu_mul(static_cast<T>(gate), static_cast<T>(up));
            } else {
                pz[(size_t)m * N + n] = gate;
                pz1[(size_t)m * N + n] = up;
            }
        };
        #pragma unroll
        for (int mt = 0; mt < MT; ++mt) {
            const int m = m0 + 8 * mt + 2 * t;
            if (na < N) {
                if (m < M) put2(m, na, acc[0][mt][0], acc[1][mt][0]);
                if (m + 1 < M) put2(m + 1, na, acc[0][mt][1], acc[1][mt][1]);
            }
            if (nb < N) {
                if (m < M) put2(m, nb, acc[0][mt][2], acc[1][mt][2]);
                if (m + 1 < M) put2(m + 1, nb, acc[0][mt][3], acc[1][mt][3]);
            }
        }
        return;
    }
    #pragma unroll
    for (int i = 0; i < 2; ++i) {
        const int na = n0 + 16 * i + g, nb = na + 8;
        #pragma unroll
        for (int mt = 0; mt < MT; ++mt) {
            const int m = m0 + 8 * mt + 2 * t;
            if (na < N) {
                if (m < M) put(m, na, acc[i][mt][0]);
                if (m + 1 < M) put(m + 1, na, acc[i][mt][1]);
            }
            if (nb < N) {
                if (m < M) put(m, nb, acc[i][mt][2]);
                if (m + 1 < M) put(m + 1, nb, acc[i][mt][3]);
            }
        }
    }
"""

_SUM = r"""
    // parti (S, M, N_i) float; yi (M, N_i) T: the S slices added in split order, rounded to T; 4 outputs a thread,
    // the threads taking the weights' outputs in order
    size_t q = (size_t)blockIdx.x * blockDim.x + threadIdx.x;
    PICK
    const size_t i = q * 4;
    if (i >= total) {
        return;
    }
    float4 v = *reinterpret_cast<const float4*>(part + i);
    for (int z = 1; z < S; ++z) {
        const float4 u = *reinterpret_cast<const float4*>(part + z * total + i);
        v.x += u.x;
        v.y += u.y;
        v.z += u.z;
        v.w += u.w;
    }
    y[i] = static_cast<T>(v.x) RESIDUAL0;
    y[i + 1] = static_cast<T>(v.y) RESIDUAL1;
    y[i + 2] = static_cast<T>(v.z) RESIDUAL2;
    y[i + 3] = static_cast<T>(v.w) RESIDUAL3;
"""

# weight i's blocks follow weight i - 1's: (column tiles) x S each
_PICK_GEMM = """int blk = blockIdx.x;
    const unsigned int* wq = w0;
    const unsigned short* sp = reinterpret_cast<const unsigned short*>(s0);
    const unsigned short* bp = reinterpret_cast<const unsigned short*>(b0);
    auto* pout = part0;  // float partial sums, or T outputs where S = 1
    int N = w0_shape[0];"""
_PICK_GEMM_NEXT = """
    if (blk >= (N + 127) / 128 * S) {{  // past weight {j}'s blocks
        blk -= (N + 127) / 128 * S;
        wq = w{i};
        sp = reinterpret_cast<const unsigned short*>(s{i});
        bp = reinterpret_cast<const unsigned short*>(b{i});
        pout = part{i};
        N = w{i}_shape[0];
    }}"""
# the gate (w0) and up (w1) weights of one shape, a block's 64 columns of each (SW)
_PICK_SWIGLU = """int blk = blockIdx.x;
    const unsigned int* wq = w0;
    const unsigned int* wq1 = w1;
    const unsigned short* sp = reinterpret_cast<const unsigned short*>(s0);
    const unsigned short* bp = reinterpret_cast<const unsigned short*>(b0);
    const unsigned short* sp1 = reinterpret_cast<const unsigned short*>(s1);
    const unsigned short* bp1 = reinterpret_cast<const unsigned short*>(b1);
    auto* pout = part0;  // the gate's float partial sums, or the T outputs where S = 1
    auto* pout1 = part1;  // the up's partial sums (where S = 1: not written)
    const int N = w0_shape[0];"""
# names the swiglu form reads, for the weights taken one after another (not read there)
_PICK_ONE_WEIGHT = """
    const unsigned int* wq1 = wq;
    const unsigned short* sp1 = sp;
    const unsigned short* bp1 = bp;
    auto* pout1 = pout;"""
_SUM_SWIGLU = r"""
    // part0, part1 (S, M, N) float: the gate's and the up's slices of sums; y0 (M, N) T: silu(gate) up, each of the
    // two added in split order and rounded to T first (`silu_mul`); 4 outputs a thread
    const size_t i = ((size_t)blockIdx.x * blockDim.x + threadIdx.x) * 4;
    const size_t total = (size_t)part0_shape[1] * part0_shape[2];
    if (i >= total) {
        return;
    }
    float4 a = *reinterpret_cast<const float4*>(part0 + i), b = *reinterpret_cast<const float4*>(part1 + i);
    for (int z = 1; z < S; ++z) {
        const float4 u = *reinterpret_cast<const float4*>(part0 + z * total + i);
        const float4 v = *reinterpret_cast<const float4*>(part1 + z * total + i);
        a.x += u.x;
        a.y += u.y;
        a.z += u.z;
        a.w += u.w;
        b.x += v.x;
        b.y += v.y;
        b.z += v.z;
        b.w += v.w;
    }
    y0[i] = silu_mul(static_cast<T>(a.x), static_cast<T>(b.x));
    y0[i + 1] = silu_mul(static_cast<T>(a.y), static_cast<T>(b.y));
    y0[i + 2] = silu_mul(static_cast<T>(a.z), static_cast<T>(b.z));
    y0[i + 3] = silu_mul(static_cast<T>(a.w), static_cast<T>(b.w));
"""
# weight i's outputs follow weight i - 1's: a thread's 4 outputs are of one weight (N_i is a multiple of 4)
_PICK_SUM = """const float* part = part0;
    T* y = y0;
    size_t total = (size_t)part0_shape[1] * part0_shape[2];"""
_PICK_SUM_NEXT = """
    if (q >= total / 4) {{
        q -= total / 4;
        part = part{i};
        y = y{i};
        total = (size_t)part{i}_shape[1] * part{i}_shape[2];
    }}"""

_ASYNC_COPY = r"""
#define STAGES 3
// 16 bytes from global to shared memory, in the background (zeros where !ok); copy_commit closes a group of
// copies, copy_wait<n> waits until at most n of this thread's groups are in flight
__device__ __forceinline__ void copy16(void* to, const void* from, bool ok) {
    const unsigned int s = static_cast<unsigned int>(__cvta_generic_to_shared(to));
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;" ::"r"(s), "l"(from), "r"(ok ? 16 : 0));
}
__device__ __forceinline__ void copy_commit() {
    asm volatile("cp.async.commit_group;");
}
template <int n>
__device__ __forceinline__ void copy_wait() {
    asm volatile("cp.async.wait_group %0;" ::"n"(n));
}
"""

_kernels = {}  # (BF, weights, add, swiglu) -> (product kernel, sum kernel)

_BOUNDS = qgemv.launch_bounds(THREADS, BLOCKS)


def supports(x, w, scales, group_size: int) -> bool:
    """Whether `qgemm` serves x (..., K) times this 4-bit weight: K a multiple of 64 and of the group
    size, the weight's K, N a multiple of 4, x and scales one 16-bit type (`qgemv.INPUT_DTYPES`)."""
    k = x.shape[-1]
    return (k % 64 == 0 and k % group_size == 0 and w.shape[-1] * 8 == k and w.shape[0] % 4 == 0
            and x.dtype in qgemv.INPUT_DTYPES and scales.dtype == x.dtype)


def splits(n: int, k: int) -> int:
    """S, the slices of K a product of an (n, k) weight is split into: as many as keep the blocks of 64 rows
    within one WAVE (a block more would run in a second wave, alone), each slice at least MIN_STEPS steps
    of K. Depends on the shape alone."""
    tiles = -(-n // COLUMNS)
    return max(1, min(k // STEP // MIN_STEPS, WAVE // tiles))


def qgemm(x, w, scales, biases, group_size: int, add=None):
    """`x @ dequantize(w, scales, biases).T` for x (..., K) of any number of rows, on CUDA; plus `add` (an
    array of the result's shape and dtype, a residual connection), in the same launches, bitwise as
    `add + qgemm(...)`.

    Returns (..., N) in x's dtype. Each row's result is bitwise independent of the
    other rows (see the module docstring). Raises ValueError where `supports` does
    not hold, or for an `add` of another shape or dtype; group_size is 32, 64 or 128
    (`qgemv.supports_weights`).
    """
    return qgemm_parts(x, [(w, scales, biases)], group_size, add=add)[0]


def qgemm_parts(x, weights, group_size: int, add=None, head_dim: int = 0) -> list:
    """`x @ dequantize(w).T` for each (w, scales, biases) in `weights` (1 to 3, one K), in one product launch
    and one sum launch: a layer's q/k/v, or its gate and up. Where `splits` gives one slice of K, the product
    launch writes the results itself: no sum launch.

    As `qgemm` for each weight, but the split of K follows the weights' shapes together
    (`splits` of their summed N), so a part may differ in its last bits from `qgemm` of
    that weight alone; each row's result is still bitwise the same in any chunk.
    `add`: as `qgemm`'s, for one weight. `head_dim` (x of shape (B, L, K)): each result
    as attention takes it, (B, N_i / head_dim, L, head_dim), its heads' rows contiguous:
    the same values as `y.reshape(B, L, -1, head_dim).transpose(0, 2, 1, 3)`, with no copy
    to make them contiguous. Returns a list of (..., N_i) in x's dtype, or those.
    ValueError as `qgemm`'s, for more than 3 weights, for `add` with more than one, for a
    `head_dim` that x's shape, or an N_i, does not allow, or for both.
    """
    if not 1 <= len(weights) <= 3:
        raise ValueError(f"qgemm_parts takes 1 to 3 weights; got {len(weights)}")
    return _run(x, weights, group_size, add, head_dim, False)


def qgemm_swiglu(x, gate, up, group_size: int):
    """`silu(x @ dequantize(gate).T) * (x @ dequantize(up).T)`: a gated MLP's first half, with the silu and the
    product in the launch that writes the result (the product launch where K is not split, else the sum launch).

    `gate` and `up` are (w, scales, biases) of one shape. Bitwise the same as
    `llama.swiglu(*qgemm_parts(x, [gate, up], group_size))`: each sum as that call
    makes it (the same split of K, `splits` of the two weights' N together), rounded
    to x's dtype, then silu and the product as MLX computes `nn.silu(gate) * up`
    (`qgemv`'s `silu_mul`); a block takes the same 64 columns of both weights. Returns
    (..., N) in x's dtype; each row's result is bitwise the same in any chunk.
    ValueError as `qgemm`'s, or for weights of two shapes.
    """
    if gate[0].shape != up[0].shape:
        raise ValueError(f"qgemm_swiglu needs gate and up weights of one shape; got {tuple(gate[0].shape)} and "
                         f"{tuple(up[0].shape)}")
    return _run(x, [gate, up], group_size, None, 0, True)[0]


def _run(x, weights, group_size: int, add, head_dim: int, swiglu: bool) -> list:
    """`qgemm_parts`, or with `swiglu` `qgemm_swiglu` (as a list of one), after their own checks."""
    for w, scales, _ in weights:
        if not supports(x, w, scales, group_size):
            raise ValueError(f"qgemm needs K a multiple of 64 and of the group size, weights of x's K, N a multiple "
                             f"of 4, and 16-bit x and scales of one type; got x {tuple(x.shape)} {x.dtype}, weight "
                             f"{tuple(w.shape)}, group {group_size}, scales {scales.dtype}")
    k, n = x.shape[-1], [w.shape[0] for w, _, _ in weights]
    written = n[:1] if swiglu else n  # the results' N (swiglu: one, of the gate's and up's shape)
    shapes = _result_shapes(x, written, add, head_dim)
    rows = x.size // k
    s = splits(sum(n), k)
    gemm, total = _kernels_for(int(x.dtype == mx.bfloat16), len(weights), add is not None, swiglu)
    # swiglu: a block's 4 warps take 16 columns of the gate and the same 16 of the up weight each
    blocks = (-(-n[0] // (COLUMNS // 2)) if swiglu else sum(-(-ni // COLUMNS) for ni in n)) * s
    extra = [] if add is None else [add]
    template = [("T", x.dtype), ("G", group_size), ("S", s), ("MT", min(ROWS // 8, -(-rows // 8))), ("HD", head_dim)]
    launch = dict(template=template, grid=(blocks * THREADS, -(-rows // ROWS), 1), threadgroup=(THREADS, 1, 1))
    inputs = [x, *(a for part in weights for a in part), *extra]
    if s == 1:  # the product launch writes the results (swiglu: the up's partial sums are not written)
        if swiglu:
            return gemm(inputs=inputs, output_shapes=[shapes[0], (1,)], output_dtypes=[x.dtype, mx.float32],
                        **launch)[:1]
        return gemm(inputs=inputs, output_shapes=shapes, output_dtypes=[x.dtype] * len(n), **launch)
    parts = gemm(inputs=inputs, output_shapes=[(s, rows, ni) for ni in n], output_dtypes=[mx.float32] * len(n),
                 **launch)
    quads = rows * sum(written) // 4
    return total(inputs=parts + extra, output_shapes=shapes, output_dtypes=[x.dtype] * len(shapes),
                 template=[("T", x.dtype), ("S", s)], grid=(-(-quads // 256) * 256, 1, 1), threadgroup=(256, 1, 1))


def _result_shapes(x, n: list, add, head_dim: int) -> list:
    """The shapes `qgemm_parts` returns for x and weights of N `n`, after checking `add` and `head_dim`."""
    plain = [(*x.shape[:-1], ni) for ni in n]
    if add is not None:
        if len(n) != 1 or head_dim:
            raise ValueError("qgemm_parts adds `add` to the result of one weight, in its plain layout")
        if tuple(add.shape) != plain[0] or add.dtype != x.dtype:
            raise ValueError(f"add must have the result's shape {plain[0]} and dtype {x.dtype}; got "
                             f"{tuple(add.shape)} {add.dtype}")
    if not head_dim:
        return plain
    if x.ndim != 3 or head_dim % 4 or any(ni % head_dim for ni in n):
        raise ValueError(f"head_dim needs x of shape (B, L, K) and outputs of whole heads, a multiple of 4 wide; "
                         f"got x {tuple(x.shape)}, outputs {n}, head_dim {head_dim}")
    B, L, _ = x.shape
    return [(B, ni // head_dim, L, head_dim) for ni in n]


def product_kernel(bf: int, parts: int, add: bool = False, swiglu: bool = False) -> tuple[str, str, list, list]:
    """(header, body, input names, output names) of the product kernel for `parts` weights, bf16 (`bf` 1) or f16,
    with a residual `add` input (one weight) or not; `swiglu`: two weights, a gate and an up (`qgemm_swiglu`)."""
    header = f"#define BF {bf}\n#define SW {int(swiglu)}\n" + _BOUNDS + qgemv.DEVICE_HELPERS + _ASYNC_COPY
    pick = (_PICK_SWIGLU if swiglu else
            _PICK_GEMM + "".join(_PICK_GEMM_NEXT.format(i=i, j=i - 1) for i in range(1, parts)) + _PICK_ONE_WEIGHT)
    body = _GEMM.replace("PICK", pick).replace("RESIDUAL", "+ add[(size_t)m * N + n]" if add else "")
    inputs = ["x"] + [f"{a}{i}" for i in range(parts) for a in "wsb"] + (["add"] if add else [])
    return header, body, inputs, [f"part{i}" for i in range(parts)]


def _kernels_for(bf: int, parts: int, add: bool, swiglu: bool = False):
    """(product kernel, sum kernel) for `parts` weights, bf16 (`bf` 1) or f16, adding a residual or not; `swiglu`:
    a gate's and an up's (two weights), the sum launch writing silu(gate) up."""
    key = (bf, parts, add, swiglu)
    if key not in _kernels:
        header, gemm, inputs, outputs = product_kernel(bf, parts, add, swiglu)
        if swiglu:
            name, total, sum_header, sums = "swiglu", _SUM_SWIGLU, f"#define BF {bf}\n" + qgemv.DEVICE_HELPERS, ["y0"]
        else:
            total = _SUM.replace("PICK", _PICK_SUM + "".join(_PICK_SUM_NEXT.format(i=i) for i in range(1, parts)))
            for j in range(4):
                total = total.replace(f"RESIDUAL{j}", f"+ add[i + {j}]" if add else "")
            name, sum_header, sums = f"p{parts}{'add' if add else ''}", "", [f"y{i}" for i in range(parts)]
        _kernels[key] = (
            qgemv.cuda_kernel(f"kvactors_qgemm4_tc{bf}_{name}", inputs, outputs, gemm, header=header),
            qgemv.cuda_kernel(f"kvactors_qgemm4_sum{bf}_{name}", [f"part{i}" for i in range(parts)]
                              + (["add"] if add else []), sums, total, header=sum_header),
        )
    return _kernels[key]
