"""A batch-invariant 4-bit matrix-vector kernel for decode steps on CUDA.

`qgemv(x, w, scales, biases, group_size)` computes `x @ dequantize(w).T` for an
input of 1 to MAX_ROWS rows, reading the packed weights once for all rows. It is
what `runtime.prepare` routes a decode step's quantized linears through on CUDA.

Why a kernel of our own: MLX-CUDA serves M = 1 with a GEMV, 2 <= M < 8 by
re-reading the weights once per row, and larger M with a tiled GEMM whose
reduction order differs from the GEMV's. So a row's logits change with the
number of rows beside it (up to 3e-2 at batch 8 on an 8B model), and greedy
output then depends on which other agents happen to be decoding. Here every
row is reduced in one fixed order whatever the batch: lane `l` of a warp sums
its 16-element slices of K in ascending order with explicit fused
multiply-adds, then the warp adds its lanes with a fixed butterfly. Row m's
result depends on row m's input and the weights alone, so it is bitwise the
same at batch 1 and batch 16.

Layout (MLX's affine quantization): `w` (N, K * bits / 32) uint32, element j of
a word in bits [4j, 4j + 4); `scales`, `biases` (N, K / group_size); the weight
is `q * scale + bias`. Each warp computes `columns(rows)` output columns, so
every load of x serves that many columns.
"""

from __future__ import annotations

import mlx.core as mx

MAX_ROWS = 16  # rows one call serves; larger inputs (prefill) take MLX's GEMM
INPUT_DTYPES = (mx.float16, mx.bfloat16)  # x is read 16 two-byte values at a time
WARPS = 4  # warps per block (see `columns`)


def bucket(rows: int) -> int:
    """The kernel's row capacity for `rows` rows: the next power of two (1 to MAX_ROWS).

    Registers are sized for the capacity, so a small batch does not pay for sixteen
    rows. A row's sum does not depend on it (the loop over rows only stops earlier)."""
    return 1 << max(0, rows - 1).bit_length()


def columns(rows: int) -> int:
    """Output columns per warp for `rows` rows: 4, so each load of x serves 4 columns.

    Measured on an H100 (`python -m benchmarks.qgemv_tune`, 8B shape): with 4 warps per
    block, 4 columns was the fastest or within noise of it at every row count on the
    large matrices. Per-row sums do not depend on it: a column's reduction order is
    the same however many columns a warp holds."""
    return 4


_SOURCE = r"""
    const int K = x_shape[x_ndim - 1];
    int M = 1;
    for (int i = 0; i < x_ndim - 1; ++i) {
        M *= x_shape[i];
    }
    const int N = w_shape[0];
    const int words_per_row = K / 8;
    const int groups_per_row = K / G;
    const int lane = threadIdx.x & 31;
    const int warp = (blockIdx.x * blockDim.x + threadIdx.x) >> 5;
    const int n0 = warp * COLS;
    if (n0 >= N) {
        return;
    }
    float acc[COLS][MAXM];
    #pragma unroll
    for (int c = 0; c < COLS; ++c) {
        #pragma unroll
        for (int m = 0; m < MAXM; ++m) {
            acc[c][m] = 0.0f;
        }
    }
    for (int idx = lane * 16; idx < K; idx += 512) {
        float wf[COLS][16];
        #pragma unroll
        for (int c = 0; c < COLS; ++c) {
            const int n = min(n0 + c, N - 1);
            const uint2 q = *reinterpret_cast<const uint2*>(w + (size_t)n * words_per_row + idx / 8);
            const float s = static_cast<float>(scales[(size_t)n * groups_per_row + idx / G]);
            const float b = static_cast<float>(biases[(size_t)n * groups_per_row + idx / G]);
            #pragma unroll
            for (int i = 0; i < 8; ++i) {
                wf[c][i] = fmaf(static_cast<float>((q.x >> (4 * i)) & 15u), s, b);
                wf[c][8 + i] = fmaf(static_cast<float>((q.y >> (4 * i)) & 15u), s, b);
            }
        }
        #pragma unroll
        for (int m = 0; m < MAXM; ++m) {
            if (m < M) {
                const uint4* xp = reinterpret_cast<const uint4*>(x + (size_t)m * K + idx);
                uint4 raw[2] = {xp[0], xp[1]};
                const auto* xv = reinterpret_cast<const T*>(raw);
                float xf[16];
                #pragma unroll
                for (int i = 0; i < 16; ++i) {
                    xf[i] = static_cast<float>(xv[i]);
                }
                #pragma unroll
                for (int c = 0; c < COLS; ++c) {
                    float a = acc[c][m];
                    #pragma unroll
                    for (int i = 0; i < 16; ++i) {
                        a = fmaf(xf[i], wf[c][i], a);
                    }
                    acc[c][m] = a;
                }
            }
        }
    }
    #pragma unroll
    for (int c = 0; c < COLS; ++c) {
        #pragma unroll
        for (int m = 0; m < MAXM; ++m) {
            float a = acc[c][m];
            #pragma unroll
            for (int offset = 16; offset > 0; offset >>= 1) {
                a += __shfl_xor_sync(0xffffffffu, a, offset);
            }
            acc[c][m] = a;
        }
    }
    if (lane == 0) {
        #pragma unroll
        for (int c = 0; c < COLS; ++c) {
            const int n = n0 + c;
            #pragma unroll
            for (int m = 0; m < MAXM; ++m) {
                if (m < M && n < N) {
                    y[(size_t)m * N + n] = static_cast<T>(acc[c][m]);
                }
            }
        }
    }
"""

_kernel = None
_launch = {}  # (dtype, group_size, n, columns, bucket) -> launch parameters: built once, looked up per call


def available() -> bool:
    """True where the kernel can run: the default device is a CUDA GPU."""
    return mx.default_device() == mx.gpu and mx.cuda.is_available()


def supports_weights(bits: int, group_size: int, mode: str, has_biases: bool) -> bool:
    """Whether `qgemv` serves these weights (any 1..MAX_ROWS rows): 4-bit affine, group 32/64/128."""
    return bits == 4 and mode == "affine" and has_biases and group_size in (32, 64, 128)


def qgemv(x, w, scales, biases, group_size: int):
    """`x @ dequantize(w, scales, biases).T` for x of shape (..., K) with at most MAX_ROWS rows, on CUDA.

    Returns (..., N) in x's dtype: the leading dimensions stay as they are, so a
    decode step's (B, 1, K) needs no reshape. Each row's result is bitwise
    independent of the other rows (see the module docstring). K must be a
    multiple of group_size; x must be float16 or bfloat16 (`INPUT_DTYPES`).
    """
    global _kernel
    if _kernel is None:
        _kernel = mx.fast.cuda_kernel(
            name="kvactors_qgemv4",
            input_names=["x", "w", "scales", "biases"],
            output_names=["y"],
            source=_SOURCE,
            ensure_row_contiguous=True,
        )
    rows = x.size // x.shape[-1]
    n, cols = w.shape[0], columns(rows)
    key = (x.dtype, group_size, n, cols, bucket(rows))
    launch = _launch.get(key)
    if launch is None:
        warps = -(-n // cols)
        threads = -(-warps // WARPS) * WARPS * 32
        template = [("T", x.dtype), ("G", group_size), ("COLS", cols), ("MAXM", bucket(rows))]
        launch = _launch[key] = (template, (threads, 1, 1), (WARPS * 32, 1, 1), [x.dtype])
    template, grid, threadgroup, dtypes = launch
    return _kernel(inputs=[x, w, scales, biases], template=template, grid=grid, threadgroup=threadgroup,
                   output_shapes=[(*x.shape[:-1], n)], output_dtypes=dtypes)[0]
