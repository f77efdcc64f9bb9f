"""A batch-invariant 4-bit matrix-vector kernel for decode steps on CUDA.

`qgemv(x, w, scales, biases, group_size)` computes `x @ dequantize(w).T` for an
input of 1 to MAX_ROWS rows, reading the packed weights once for all rows. It is
what `runtime.prepare` routes a decode step's quantized linears through on CUDA.
Three variants save launches, each of which costs the host 7-15 us (a decode step
is often bound by the host): `qgemv_parts` multiplies one input by 1 to 3 weights in one
launch (a block takes its rows from one weight; each result goes to its own
output, in any row-major shape), `qgemv_swiglu` computes a gated MLP's
`silu(x @ gate.T) * (x @ up.T)` in one (a block takes the same 16 rows of both
weights and multiplies its two sums), and `qgemv(..., add=)` adds a residual to
its result in the same launch.

Why a kernel of our own: MLX-CUDA serves M = 1 with a GEMV, 2 <= M < 8 by
re-reading the weights once per row, and larger M with a tiled GEMM whose
reduction order differs from the GEMV's. So a row's logits change with the
number of rows beside it (up to 3e-2 at batch 8 on an 8B model), and greedy
output then depends on which other agents happen to be decoding.

How: tensor cores, with the weight as the 16-row operand of `mma.m16n8k16` and
the input rows as its 8 columns (two products for 9 to 16 rows). A lane
dequantizes its 4-bit weights two at a time straight into fragment layout (a
nibble pair under a magic exponent, then one exact subtraction and one fused
multiply-add with the group's scale and bias, in the input's 16-bit type), and
reads its input values in the order those weights land in. A block owns 16 * TN
output columns; its SPLIT warps take interleaved slices of K (4 lanes of KL
elements each: 64 or 128) and add their partial sums in shared memory in warp
order. TN, SPLIT and KL follow from the matrix's shape alone (`setting`). So row m's result is built in the same order
from row m's input and the weights whatever the other rows hold and however many
there are: bitwise the same at batch 1 and batch 16.

Speed (Nsight Compute on an H100, `benchmarks/results/h100/qgemv-*`): the kernels are
compiled for two 512-thread blocks a multiprocessor (64 registers a thread; the 9-16-row
ones took up to 100 and ran one), and rows past the matrix or the batch read the last valid
row instead of zeros behind a branch (their columns are never stored), so a step's loads
issue together; the 9-16-row gated MLP keeps the branches, which it needs to fit.

Layout (MLX's affine quantization): `w` (N, K * bits / 32) uint32, element j of
a word in bits [4j, 4j + 4); `scales`, `biases` (N, K / group_size); the weight
is `q * scale + bias`. K must be a multiple of 64 (`supports_weights`).
"""

from __future__ import annotations

import hashlib
import math

import mlx.core as mx

MAX_ROWS = 16  # rows one call serves; larger inputs (prefill) take MLX's GEMM
INPUT_DTYPES = (mx.float16, mx.bfloat16)  # the tensor cores' 16-bit input types
MAX_SPLIT = 16  # warps per block along K: 512 threads, the most a block of this kernel's registers may have
UNROLL = 2  # steps along K a warp's loop unrolls: how many of its weight loads are in flight at once
K_PER_LANE = 32  # elements of K (of one row) a lane reads per step where K allows: 16 bytes of weights


def setting(n: int, k: int, tiles: int = 1) -> tuple[int, int, int]:
    """(TN, SPLIT, KL) for an (n, k) weight: 16-row tiles per warp, warps per block along K, and
    elements of K a lane reads per step.

    One tile per warp (`tiles` 2: `qgemv_swiglu`'s gate and up) and MAX_SPLIT warps along
    K, at most one per step of K: the most loads in flight. KL 32 (16-byte loads) where K
    is a multiple of 128 and a warp holds one tile, else 16. On an H100 every decode
    matrix of an 8B model ran fastest so (`benchmarks.qgemv_tune`, results/h100/qgemv_tune*.md):
    one tile and 16 warps took 19-35% off two tiles with the grid sized to the resident
    warps; 16-byte loads took 8-18% more off q/k/v, o and down, and cost gate/up 11%.
    Depends on the shape only, never on the rows.
    """
    kl = K_PER_LANE if tiles == 1 and k % (4 * K_PER_LANE) == 0 else 16
    return tiles, max(1, min(MAX_SPLIT, k // (4 * kl))), kl


_BODY = r"""
    // x (M, K) T; per weight i: wi (N_i, K / 8) uint32, si / bi (N_i, K / G) T; see the module docstring.
    const int K = x_shape[x_ndim - 1];
    int M = 1;
    for (int i = 0; i < x_ndim - 1; ++i) {
        M *= x_shape[i];
    }
    if (M == 0) {
        return;  // nothing to write, and no row M - 1 to read in place of the missing ones
    }
    const int wpr = K / 8, gpr = K / G, steps = K / (4 * KL);  // a warp's step: 4 lanes of KL elements of K
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int g = lane >> 2, t = lane & 3;
    // this block's tiles: tile tn reads rows [row0[tn], row0[tn] + 16) of (wt, st, bt)[tn], N rows in all
    const unsigned int* wt[TN];
    const unsigned short* st[TN];
    const unsigned short* bt[TN];
    int row0[TN];
    int N;
    PICK
    constexpr int NJ = KL / 4;  // tensor-core products per step: 16 elements of K each
    float acc[TN][MT][4];
    #pragma unroll
    for (int i = 0; i < TN; ++i) {
        #pragma unroll
        for (int j = 0; j < MT; ++j) {
            acc[i][j][0] = acc[i][j][1] = acc[i][j][2] = acc[i][j][3] = 0.0f;
        }
    }
    #pragma unroll UNROLL
    for (int s = warp; s < steps; s += SPLIT) {
        const int k0 = s * 4 * KL + t * KL;  // this lane's KL elements of K (one quantization group: KL <= G)
        unsigned int xb[MT][NJ][2];  // B fragments of the NJ products: rows g (+ 8), K in the weights' order
        #pragma unroll
        for (int mt = 0; mt < MT; ++mt) {
            // CLAMP: rows past M read row M - 1 (their columns of the products are never stored) instead of
            // zeros behind a branch, so the compiler may issue these loads ahead of the products before them
            const int m = CLAMP ? min(g + 8 * mt, M - 1) : g + 8 * mt;
            uint4 xv[KL / 8];  // 8 elements each
            #pragma unroll
            for (int i = 0; i < KL / 8; ++i) xv[i] = make_uint4(0, 0, 0, 0);
            if (CLAMP || m < M) {
                const uint4* xp = reinterpret_cast<const uint4*>(x + (size_t)m * K + k0);
                #pragma unroll
                for (int i = 0; i < KL / 8; ++i) xv[i] = xp[i];
            }
            #pragma unroll
            for (int j = 0; j < NJ; ++j) {  // product j: elements 8 (j / 2) + {0, 4 | 1, 5} (j even) or {2, 6 | 3, 7}
                const uint4 v = xv[j >> 1];
                const unsigned int p = (j & 1) ? v.y : v.x, q = (j & 1) ? v.w : v.z;
                xb[mt][j][0] = __byte_perm(p, q, 0x5410);  // (x0, x4) of the 8, or (x2, x6)
                xb[mt][j][1] = __byte_perm(p, q, 0x7632);  // (x1, x5), or (x3, x7)
            }
        }
        #pragma unroll
        for (int tn = 0; tn < TN; ++tn) {
            // rows g and g + 8 of the A fragments (CLAMP: rows past N read row N - 1, never stored, unbranched)
            const int na = CLAMP ? min(row0[tn] + g, N - 1) : row0[tn] + g;
            const int nb = CLAMP ? min(row0[tn] + g + 8, N - 1) : row0[tn] + g + 8;
            unsigned int wa[KL / 8], wb[KL / 8];  // 8 4-bit weights each
            #pragma unroll
            for (int i = 0; i < KL / 8; ++i) wa[i] = wb[i] = 0;
            unsigned int sa = 0, ba = 0, sb = 0, bb = 0;
            if (CLAMP || na < N) {
                load_words<KL / 8>(wa, wt[tn] + (size_t)na * wpr + k0 / 8);
                sa = st[tn][(size_t)na * gpr + k0 / G] * 0x10001u;
                ba = bt[tn][(size_t)na * gpr + k0 / G] * 0x10001u;
            }
            if (CLAMP || nb < N) {
                load_words<KL / 8>(wb, wt[tn] + (size_t)nb * wpr + k0 / 8);
                sb = st[tn][(size_t)nb * gpr + k0 / G] * 0x10001u;
                bb = bt[tn][(size_t)nb * gpr + k0 / G] * 0x10001u;
            }
            #pragma unroll
            for (int j = 0; j < NJ; ++j) {
                // product j: word j / 2; its nibbles (2 sub, 2 sub + 4) in slots (2t, 2t + 1) and
                // (2 sub + 1, 2 sub + 5) in slots (2t + 8, 2t + 9), sub = j % 2 (matching xb above)
                const unsigned int qa = wa[j >> 1], qb = wb[j >> 1];
                const int shift = (j & 1) * 8;
                unsigned int a[4];
                a[0] = dequant2(qa >> shift, sa, ba);
                a[1] = dequant2(qb >> shift, sb, bb);
                a[2] = dequant2(qa >> (shift + 4), sa, ba);
                a[3] = dequant2(qb >> (shift + 4), sb, bb);
                #pragma unroll
                for (int mt = 0; mt < MT; ++mt) {
                    mma16816(acc[tn][mt], a, xb[mt][j][0], xb[mt][j][1]);
                }
            }
        }
    }
    // C fragment: acc[tn][mt] = (col na, row 2t), (na, 2t + 1), (nb, 2t), (nb, 2t + 1), rows + 8 mt
    constexpr int R = TN * MT * 4;
    __shared__ float part[SPLIT][R][32];
    #pragma unroll
    for (int i = 0; i < TN; ++i) {
        #pragma unroll
        for (int j = 0; j < MT; ++j) {
            #pragma unroll
            for (int c = 0; c < 4; ++c) {
                part[warp][(i * MT + j) * 4 + c][lane] = acc[i][j][c];
            }
        }
    }
    __syncthreads();
    STORE
"""

# One weight per block (block b of weight i covers rows [16 TN (b - B_i), ...)): outputs y0, y1, ...
_PICK_PART = """
    int blk = blockIdx.x;
    {choose}
    #pragma unroll
    for (int i = 0; i < TN; ++i) {{
        wt[i] = wp;
        st[i] = sp;
        bt[i] = bp;
        row0[i] = blk * 16 * TN + i * 16;
    }}
"""
_CHOOSE = """const unsigned int* wp = w0;
    const unsigned short* sp = reinterpret_cast<const unsigned short*>(s0);
    const unsigned short* bp = reinterpret_cast<const unsigned short*>(b0);
    T* y = y0;
    N = w0_shape[0];"""
_CHOOSE_NEXT = """
    if ((int)blockIdx.x >= B{i}) {{  // B{i}: weight {i}'s first block (after every earlier weight's)
        blk = blockIdx.x - B{i};
        wp = w{i};
        sp = reinterpret_cast<const unsigned short*>(s{i});
        bp = reinterpret_cast<const unsigned short*>(b{i});
        y = y{i};
        N = w{i}_shape[0];
    }}"""
_STORE_PART = """
    for (int idx = threadIdx.x; idx < R * 32; idx += SPLIT * 32) {
        const int r = idx / 32, l = idx % 32;
        float sum = part[0][r][l];
        for (int v = 1; v < SPLIT; ++v) {
            sum += part[v][r][l];  // in warp order: fixed
        }
        const int tn = r / (MT * 4), mt = (r / 4) % MT, c = r % 4;
        const int n = row0[tn] + (l >> 2) + (c >= 2 ? 8 : 0);
        const int m = 8 * mt + 2 * (l & 3) + (c & 1);
        if (m < M && n < N) {
            y[(size_t)m * N + n] = static_cast<T>(sum) RESIDUAL;
        }
    }
"""
# gate (w0) and up (w1) for the same 16 rows in one block (TN 2): y0 = silu(gate) * up
_PICK_SWIGLU = """
    N = w0_shape[0];
    wt[0] = w0;
    wt[1] = w1;
    st[0] = reinterpret_cast<const unsigned short*>(s0);
    st[1] = reinterpret_cast<const unsigned short*>(s1);
    bt[0] = reinterpret_cast<const unsigned short*>(b0);
    bt[1] = reinterpret_cast<const unsigned short*>(b1);
    row0[0] = row0[1] = blockIdx.x * 16;
"""
_STORE_SWIGLU = """
    constexpr int R1 = MT * 4;  // tile 0's entries of part; tile 1's follow
    for (int idx = threadIdx.x; idx < R1 * 32; idx += SPLIT * 32) {
        const int r = idx / 32, l = idx % 32;
        float gate = part[0][r][l], up = part[0][R1 + r][l];
        for (int v = 1; v < SPLIT; ++v) {
            gate += part[v][r][l];  // in warp order: fixed
            up += part[v][R1 + r][l];
        }
        const int mt = r / 4, c = r % 4;
        const int n = row0[0] + (l >> 2) + (c >= 2 ? 8 : 0);
        const int m = 8 * mt + 2 * (l & 3) + (c & 1);
        if (m < M && n < N) {
            y0[(size_t)m * N + n] = silu_mul(static_cast<T>(gate), static_cast<T>(up));
        }
    }
"""

MMA16816 = r"""
// c += a b on the tensor cores (mma.m16n8k16, f32 accumulators), a and b in fragment layout:
// bf16 operands where BF is 1, else f16. Shared with runtime.q4sdpa (f16).
__device__ __forceinline__ void mma16816(float* c, const unsigned int* a, unsigned int b0, unsigned int b1) {
#if BF
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};"
#else
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};"
#endif
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}
"""

# device functions of the 4-bit kernels (also runtime.qgemm's): dequant2, load_words, silu_mul, mma16816
DEVICE_HELPERS = r"""
// (lo, hi) 4-bit values at bits [0, 4) and [16, 20) of x, as a 16-bit pair times s plus b
// (s, b: a 16-bit value in both halves): under a magic exponent the pair is 128 + q (bf16)
// or 1024 + q (f16) exactly, one exact subtraction gives q, one fused multiply-add q s + b.
// ONE_LOP: the mask and the magic exponent in one instruction (lop3 with both in registers, which
// the kernel then keeps) instead of two with immediates: the same bits.
template <bool ONE_LOP = false>
__device__ __forceinline__ unsigned int dequant2(unsigned int x, unsigned int s, unsigned int b) {
    unsigned int y, r;
#if BF
    constexpr unsigned int MAGIC = 0x43004300u;
#else
    constexpr unsigned int MAGIC = 0x64006400u;
#endif
    if constexpr (ONE_LOP) {
        asm("lop3.b32 %0, %1, %2, %3, 0xEA;" : "=r"(y) : "r"(x), "r"(0x000F000Fu), "r"(MAGIC));  // (x & m) | c
    } else {
        y = (x & 0x000F000Fu) | MAGIC;
    }
#if BF
    asm("fma.rn.bf16x2 %0, %1, %2, %3;" : "=r"(y) : "r"(y), "r"(0x3F803F80u), "r"(0xC300C300u));
    asm("fma.rn.bf16x2 %0, %1, %2, %3;" : "=r"(r) : "r"(y), "r"(s), "r"(b));
#else
    asm("sub.f16x2 %0, %1, %2;" : "=r"(y) : "r"(y), "r"(MAGIC));
    asm("fma.rn.f16x2 %0, %1, %2, %3;" : "=r"(r) : "r"(y), "r"(s), "r"(b));
#endif
    return r;
}

// n consecutive words from p (8-byte aligned for n = 2, 16-byte for n = 4) in one load
template <int n>
__device__ __forceinline__ void load_words(unsigned int* w, const unsigned int* p) {
    if constexpr (n == 4) {
        const uint4 v = *reinterpret_cast<const uint4*>(p);
        w[0] = v.x; w[1] = v.y; w[2] = v.z; w[3] = v.w;
    } else {
        const uint2 v = *reinterpret_cast<const uint2*>(p);
        w[0] = v.x; w[1] = v.y;
    }
}

// silu(g) u as MLX computes `nn.silu(gate) * up` in T (sigmoid as MLX-CUDA's): each operation rounded to T
template <typename T>
__device__ __forceinline__ T silu_mul(T g, T u) {
    const float x = static_cast<float>(g);
    const T e = static_cast<T>(expf(fabsf(x)));
    const T y = static_cast<T>(1.0f / static_cast<float>(static_cast<T>(1.0f + static_cast<float>(e))));
    const T sig = x < 0.0f ? y : static_cast<T>(1.0f - static_cast<float>(y));
    const T a = static_cast<T>(x * static_cast<float>(sig));
    return static_cast<T>(static_cast<float>(a) * static_cast<float>(u));
}

""" + MMA16816

_kernels = {}  # (BF, weights, swiglu, extra) -> the kernel
_launch = {}  # every input the checks read, and the weights' shapes -> launch parameters: built once, looked up per call


def available() -> bool:
    """True where the kernel can run: the default device is a CUDA GPU."""
    return mx.default_device() == mx.gpu and mx.cuda.is_available()


def supports_weights(bits: int, group_size: int, mode: str, has_biases: bool, k: int) -> bool:
    """Whether `qgemv` serves these weights (any 1..MAX_ROWS rows): 4-bit affine, group 32/64/128, K a
    multiple of 64."""
    return bits == 4 and mode == "affine" and has_biases and group_size in (32, 64, 128) and k % 64 == 0


def qgemv(x, w, scales, biases, group_size: int, add=None):
    """`x @ dequantize(w, scales, biases).T` for x of shape (..., K) with at most MAX_ROWS rows, on CUDA.

    Returns (..., N) in x's dtype: the leading dimensions stay as they are, so a
    decode step's (B, 1, K) needs no reshape. Each row's result is bitwise
    independent of the other rows (see the module docstring). K must be a
    multiple of 64 and of group_size; x, scales and biases float16 or bfloat16
    (`INPUT_DTYPES`), one type. `add`: an array of the result's shape and dtype added
    to it in the same launch (a residual connection), bitwise as `add + qgemv(...)`.
    """
    if add is None:
        return qgemv_parts(x, [(w, scales, biases)], group_size)[0]
    shape = (*x.shape[:-1], w.shape[0])
    if tuple(add.shape) != shape or add.dtype != x.dtype:
        raise ValueError(f"qgemv adds an array of the result's shape {shape} and dtype {x.dtype}; got "
                         f"{tuple(add.shape)} {add.dtype}")
    kernel, args = _launch_for(x, [(w, scales, biases)], group_size, False, "add")
    return kernel(inputs=[x, w, scales, biases, add], output_shapes=[shape], **args)[0]


def qgemv_parts(x, weights, group_size: int, shapes=None) -> list:
    """`x @ dequantize(w).T` for each (w, scales, biases) in `weights` (1 to 3, one K), in one launch.

    As `qgemv` for each weight, with one difference: the launch setting (so the
    summation order) follows the weights' shapes together, so a part's result may
    differ in its last bits from `qgemv` of that weight alone; it is still
    bitwise the same at any number of rows. `shapes`: the output shapes (default
    (..., N_i)); each must hold the rows times N_i elements, which the kernel writes in
    row-major order: for a decode step's (B, 1, H * D), (B, H, 1, D) is the layout
    of mlx-lm's reshape and transpose of its heads, without either.
    """
    n = tuple(w.shape[0] for w, _, _ in weights)
    if shapes is None:
        shapes = [(*x.shape[:-1], ni) for ni in n]
    elif len(shapes) != len(n) or any(math.prod(s) != x.size // x.shape[-1] * ni for s, ni in zip(shapes, n)):
        raise ValueError(f"qgemv_parts: output shapes {shapes} do not hold {x.size // x.shape[-1]} rows of {n} "
                         "columns, one shape per weight")
    kernel, args = _launch_for(x, weights, group_size, False)
    return kernel(inputs=[x, *(a for part in weights for a in part)], output_shapes=shapes, **args)


def qgemv_swiglu(x, gate, up, group_size: int):
    """`silu(x @ dequantize(gate).T) * (x @ dequantize(up).T)` in one launch: a gated MLP's first half.

    `gate` and `up` are (w, scales, biases) of one shape; x as for `qgemv`. The
    products are summed as `qgemv_parts` of the two would sum them with 8-byte loads
    (KL 16: `setting` with two tiles, whatever K is); silu and the
    product are computed in x's dtype as MLX computes `nn.silu(gate) * up` (each
    operation rounded to it). Returns (..., N); bitwise the same at any number of rows.
    """
    if gate[0].shape != up[0].shape:
        raise ValueError(f"qgemv_swiglu needs gate and up weights of one shape; got {gate[0].shape} and {up[0].shape}")
    kernel, args = _launch_for(x, [gate, up], group_size, True)
    return kernel(inputs=[x, *gate, *up], output_shapes=[(*x.shape[:-1], gate[0].shape[0])], **args)[0]


def _launch_for(x, weights, group_size: int, swiglu: bool, extra: str = ""):
    """(kernel, launch arguments) for x and these weights: made once per key, then looked up.

    `extra`: "add" (an array to add follows the weights) or ""."""
    k = x.shape[-1]
    rows = x.size // k
    if rows > MAX_ROWS:
        raise ValueError(f"qgemv serves 1 to {MAX_ROWS} rows; got {rows} (larger inputs take MLX's matmul)")
    key = (x.dtype, tuple((w.shape, s.dtype) for w, s, _ in weights), group_size, k, 1 if rows <= 8 else 2, swiglu,
           extra)
    launch = _launch.get(key)
    if launch is None:
        launch = _launch[key] = _make_launch(x, weights, group_size, swiglu, key[-3], extra)
    return launch


def _make_launch(x, weights, group_size: int, swiglu: bool, mt: int, extra: str):
    k = x.shape[-1]
    if not 1 <= len(weights) <= 3:
        raise ValueError(f"qgemv_parts takes 1 to 3 weights; got {len(weights)}")
    for w, scales, _ in weights:
        if (k % 64 or k % group_size or x.dtype not in INPUT_DTYPES or scales.dtype != x.dtype
                or w.shape[-1] * 8 != k):
            raise ValueError(f"qgemv needs K a multiple of 64 and of the group size, weights of K {k}, and 16-bit "
                             f"x, scales and biases of one type; got K {k}, group {group_size}, weight "
                             f"{tuple(w.shape)}, x {x.dtype}, scales {scales.dtype}")
    if extra == "add" and len(weights) != 1:
        raise ValueError(f"qgemv adds to the product of one weight; got {len(weights)}")
    n = [w.shape[0] for w, _, _ in weights]
    tn, split, kl = setting(sum(n), k, 2 if swiglu else 1)
    if swiglu:  # tile 0 from the gate, tile 1 from the up weight: 16 rows of each per block
        blocks, starts = -(-n[0] // 16), []
    else:
        per = [-(-ni // (16 * tn)) for ni in n]
        blocks, starts = sum(per), [sum(per[:i]) for i in range(1, len(per))]
    bf = int(x.dtype == mx.bfloat16)
    name = (bf, len(weights), swiglu, extra)
    if name not in _kernels:
        _kernels[name] = _kernel(*name)
    # unbranched loads (CLAMP) took 13-14% off every 1-8-row launch and 9-21% off the 9-16-row ones except
    # the gated MLP's, which they made spill (71.5 against 56.5 us): the same products either way
    clamp = not (swiglu and mt == 2)
    template = [("T", x.dtype), ("G", group_size), ("TN", tn), ("MT", mt), ("SPLIT", split), ("UNROLL", UNROLL),
                ("KL", kl), ("CLAMP", clamp)]
    template += [(f"B{i + 1}", b) for i, b in enumerate(starts)]
    return _kernels[name], dict(template=template, grid=(blocks * split * 32, 1, 1), threadgroup=(split * 32, 1, 1),
                                output_dtypes=[x.dtype] * (1 if swiglu else len(weights)))


def _kernel(bf: int, parts: int, swiglu: bool, extra: str):
    inputs = ["x"] + [f"{a}{i}" for i in range(parts) for a in "wsb"] + (["add"] if extra == "add" else [])
    if swiglu:
        pick, store, outputs = _PICK_SWIGLU, _STORE_SWIGLU, ["y0"]
    else:
        choose = _CHOOSE + "".join(_CHOOSE_NEXT.format(i=i) for i in range(1, parts))
        pick, store, outputs = _PICK_PART.format(choose=choose), _STORE_PART, [f"y{i}" for i in range(parts)]
    source = (_BODY.replace("PICK", pick).replace("STORE", store)
              .replace("RESIDUAL", "+ add[(size_t)m * N + n]" if extra == "add" else ""))
    name = f"kvactors_qgemv4_tc{bf}_{'swiglu' if swiglu else f'p{parts}'}{extra}"
    return cuda_kernel(name, inputs, outputs, source, header=f"#define BF {bf}\n" + _TWO_BLOCKS + DEVICE_HELPERS)


def cuda_kernel(name: str, input_names, output_names, source: str, header: str = "", ensure_row_contiguous=True):
    """`mx.fast.cuda_kernel` under `name` plus eight digits of a hash of `header` and `source`: every kernel of this
    project is made here. MLX-CUDA keeps a compiled kernel on disk (in the temporary folder, or MLX_PTX_CACHE_DIR)
    by its name and template alone and loads it again in later processes without looking at the source, so a
    kernel whose source changed under the same name would run as it was compiled before (after an upgrade)."""
    digest = int(hashlib.sha1(f"{header}\0{source}".encode()).hexdigest(), 16) % 10 ** 8
    return mx.fast.cuda_kernel(name=f"{name}_{digest:08d}", input_names=input_names, output_names=output_names,
                               source=source, header=header, ensure_row_contiguous=ensure_row_contiguous)


def compiled_launch(kernel, args: dict, output: int | None = None):
    """`kernel` (from `cuda_kernel`) called with launch arguments `args` (template, grid, threadgroup, output shapes
    and dtypes), as an `mx.compile`d function of its inputs alone: f(*inputs) returns the kernel's outputs (a list),
    or output `output` alone. Every argument but the inputs must be fixed for the shapes the function is called with.

    A plain call converts every argument anew and has MLX write the kernel's whole source text (header,
    signature, a line per template argument, body) into a new primitive; the compiled function records the call
    once per thread and input shapes and then replays it. For the kernels a decode step calls outside its compiled
    graphs (`q4pack.pack_kv_into`, `q4sdpa.q4_decode_sdpa`: 64 calls a step on the 8B shape)."""
    def launch(*inputs):
        out = kernel(inputs=list(inputs), **args)
        return out if output is None else out[output]

    return mx.compile(launch)


def launch_bounds(threads: int, blocks: int) -> str:
    """A kernel header that gives the kernel after it CUDA's launch bounds: at most `threads` a block and at least
    `blocks` blocks a multiprocessor (so the compiler keeps a thread within 65536 / (threads * blocks) registers).
    MLX writes the kernel's signature after its header as `__global__ void name(...)`, so `__global__` is
    redefined to carry the bounds."""
    return f"""
#undef __global__
#define __global__ __location__(global) __launch_bounds__({threads}, {blocks})
"""


# Two blocks of MAX_SPLIT warps a multiprocessor, so at most 64 registers a thread (the 9-16-row kernels would
# take 82-100, the float16 ones 65, and run one block).
_TWO_BLOCKS = launch_bounds(MAX_SPLIT * 32, 2)
