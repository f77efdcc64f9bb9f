"""Copy one row's column range of a packed cache's six tensors in one launch, on CUDA.

`take(keys, values, row, start, stop, width)` gives, for each of the six tensors of
packed keys and values ((words, scales, biases) each, shaped (B, H, W, ...)), columns
[start, stop) of row `row` followed by zero columns up to `width`: a (1, H, width, ...)
array of its own. A hot turn's merge (its row's columns, then room for the new tokens)
and a row's extraction (exactly its columns) are both this. With MLX's own ops each
is a copy or two per tensor (a concatenation, or a contiguous slice): 12 and 6
launches a layer, and a hot turn's chunk was bound by launching its kernels, not by
running them.
"""

from __future__ import annotations

import mlx.core as mx

_SOURCE = r"""
    // Block (x, y): tensor y / H (kw, ks, kb, vw, vs, vb) and head y % H; its threads walk that head's
    // width x C output elements: the first (stop - start) x C from the input's row, the rest zero.
    const int H = kw_shape[1];
    const int t = blockIdx.y / H, h = blockIdx.y % H;
    const int row = params[0], start = params[1], n = params[2] - params[1], width = params[3];
    switch (t) {
    case 0: copy_span(kw, okw, kw_shape[2], kw_shape[3], H, row, h, start, n, width); break;
    case 1: copy_span(ks, oks, ks_shape[2], ks_shape[3], H, row, h, start, n, width); break;
    case 2: copy_span(kb, okb, kb_shape[2], kb_shape[3], H, row, h, start, n, width); break;
    case 3: copy_span(vw, ovw, vw_shape[2], vw_shape[3], H, row, h, start, n, width); break;
    case 4: copy_span(vs, ovs, vs_shape[2], vs_shape[3], H, row, h, start, n, width); break;
    default: copy_span(vb, ovb, vb_shape[2], vb_shape[3], H, row, h, start, n, width); break;
    }
"""

_HEADER = r"""
template <int S> struct Raw;  // an element of S bytes, moved as its bits
template <> struct Raw<4> { using type = unsigned int; };
template <> struct Raw<2> { using type = unsigned short; };
template <> struct Raw<1> { using type = unsigned char; };

// Head h of row `row`: n columns of C elements from column `start` of a (B, H, W, C) row-major input,
// then zeros, into a (1, H, width, C) output.
template <typename E>
__device__ __forceinline__ void copy_span(const E* in, E* out, int W, int C, int H, int row, int h, int start,
                                          int n, int width) {
    using U = typename Raw<sizeof(E)>::type;
    const U* src = reinterpret_cast<const U*>(in) + (((size_t)row * H + h) * W + start) * C;
    U* dst = reinterpret_cast<U*>(out) + (size_t)h * width * C;
    const long long used = (long long)n * C, total = (long long)width * C;
    for (long long j = blockIdx.x * (long long)blockDim.x + threadIdx.x; j < total; j += (long long)gridDim.x * blockDim.x) {
        dst[j] = j < used ? src[j] : U(0);
    }
}
"""

THREADS = 256  # threads a block
BLOCKS = 16  # blocks per (tensor, head) at most; a head of a long row is a few hundred KB
_kernel = []


def _get():
    if not _kernel:
        _kernel.append(mx.fast.cuda_kernel(
            name="kvactors_take_columns", input_names=["kw", "ks", "kb", "vw", "vs", "vb", "params"],
            output_names=["okw", "oks", "okb", "ovw", "ovs", "ovb"], source=_SOURCE,
            header=_HEADER,
            ensure_row_contiguous=True))
    return _kernel[0]


def params(row: int, start: int, stop: int, width: int) -> mx.array:
    """`take`'s int32 parameters as one device array (a caller that asks per layer may make it once)."""
    return mx.array([row, start, stop, width], dtype=mx.int32)


def take(keys, values, row: int, start: int, stop: int, width: int, params_array=None):
    """Columns [start, stop) of row `row` of packed `keys` and `values`, then zeros up to `width` columns.

    keys and values: (words, scales, biases) each, every tensor (B, H, W, ...) with one
    B, H and W; 0 <= row < B, 0 <= start <= stop <= W, width >= stop - start. Returns
    ((words, scales, biases) of the keys, the same of the values), each (1, H, width, ...)
    in its input's dtype, bit for bit the input's columns: what
    `mx.concatenate([x[row:row+1, :, start:stop], zeros], axis=2)` gives per tensor, in
    one launch. `params_array`: `params(row, start, stop, width)`, made here if not given.
    Raises ValueError for arguments out of range. CUDA only.
    """
    tensors = (*keys, *values)
    B, H, W = tensors[0].shape[:3]
    if len(tensors) != 6 or any(x.ndim != 4 or x.shape[:3] != (B, H, W) for x in tensors):
        raise ValueError("take reads (words, scales, biases) of keys and of values, each (B, H, W, ...) with one "
                         f"B, H and W; got shapes {[tuple(x.shape) for x in tensors]}")
    if not (0 <= row < B and 0 <= start <= stop <= W and width >= stop - start):
        raise ValueError(f"take needs 0 <= row < {B}, 0 <= start <= stop <= {W} and width >= stop - start; "
                         f"got row {row}, columns [{start}, {stop}), width {width}")
    if params_array is None:
        params_array = params(row, start, stop, width)
    per_head = width * max(x.shape[3] for x in tensors)
    blocks = max(1, min(BLOCKS, -(-per_head // THREADS)))
    out = _get()(inputs=[*tensors, params_array], grid=(blocks * THREADS, 6 * H, 1), threadgroup=(THREADS, 1, 1),
                 output_shapes=[(1, H, width, x.shape[3]) for x in tensors],
                 output_dtypes=[x.dtype for x in tensors])
    return tuple(out[:3]), tuple(out[3:])
