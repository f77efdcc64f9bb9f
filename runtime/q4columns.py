"""Copy rows' column ranges of packed caches into new buffers, all six tensors in one launch, on CUDA.

`gather(sources, plan, width)` builds, for each of the six tensors of packed keys and
values ((words, scales, biases) each, shaped (B, H, W, ...)), a new (len(plan), H,
width, ...) array whose row r holds columns [start, stop) of one source row, placed from
column `at`, and zeros everywhere else. What a batch cache does to its rows is this:
a row's extraction (its columns alone), a merge of one agent (its columns, then room for
the new tokens), a join (the batch's rows and the new ones, each shifted to end at the
longest row's last column), a filter (the rows kept, less the padding they all share),
and a growth (every row, with more room); and, with one source a layer, a row's
extraction from every layer at once. With MLX's own ops each is a slice, a pad or
a concatenation per tensor (6 to 18 launches a layer, and as many host-side ops), and
the engine's thread, which builds them between two decode steps, was bound by building
and launching them, not by the copies.
"""

from __future__ import annotations

import mlx.core as mx

from runtime.qgemv import cuda_kernel

PARTS = ("kw", "ks", "kb", "vw", "vs", "vb")  # keys' words, scales, biases, then the values'

_SOURCE = r"""
    // Block (x, y, z): tensor y / H (kw, ks, kb, vw, vs, vb), head y % H, output row z; its threads walk that
    // head's bytes: zeros, except the plan's columns of its source row. params: width, H, W of each of NW
    // sources, bytes a column of each tensor, then (source, row, start, stop, at) per output row.
    const int width = params[0], H = params[1];
    const int t = blockIdx.y / H, h = blockIdx.y % H, r = blockIdx.z;
    const int* p = params + 2 + NW + 6 + 5 * r;
    const int s = p[0];
    const int W = params[2 + s], cb = params[2 + NW + t];
    const char* in = nullptr;
    char* out = nullptr;
    switch (t) {  // the output
    case 0: out = reinterpret_cast<char*>(okw); break;
    case 1: out = reinterpret_cast<char*>(oks); break;
    case 2: out = reinterpret_cast<char*>(okb); break;
    case 3: out = reinterpret_cast<char*>(ovw); break;
    case 4: out = reinterpret_cast<char*>(ovs); break;
    default: out = reinterpret_cast<char*>(ovb); break;
    }
    switch (6 * s + t) {  // the input: tensor t of source s
    INPUT_CASES
    }
    const char* src = in + (((size_t)p[1] * H + h) * W + p[2]) * cb;
    char* dst = out + ((size_t)r * H + h) * width * cb;
    const long long lo = (long long)p[4] * cb, hi = lo + (long long)(p[3] - p[2]) * cb, total = (long long)width * cb;
    // every offset is a multiple of a column's bytes: move the widest unit that divides them
    if (cb % 16 == 0) copy_units<uint4>(src, dst, lo, hi, total);
    else if (cb % 8 == 0) copy_units<uint2>(src, dst, lo, hi, total);
    else if (cb % 4 == 0) copy_units<unsigned int>(src, dst, lo, hi, total);
    else if (cb % 2 == 0) copy_units<unsigned short>(src, dst, lo, hi, total);
    else copy_units<unsigned char>(src, dst, lo, hi, total);
"""

_HEADER = r"""
// Bytes [0, total) of dst: src's bytes [0, hi - lo) at [lo, hi), zeros elsewhere; offsets multiples of sizeof(U).
template <typename U>
__device__ __forceinline__ void copy_units(const char* src, char* dst, long long lo, long long hi, long long total) {
    const U* s = reinterpret_cast<const U*>(src);
    U* d = reinterpret_cast<U*>(dst);
    const long long l = lo / (long long)sizeof(U), e = hi / (long long)sizeof(U), n = total / (long long)sizeof(U);
    for (long long j = blockIdx.x * (long long)blockDim.x + threadIdx.x; j < n; j += (long long)gridDim.x * blockDim.x) {
        d[j] = j >= l && j < e ? s[j - l] : U{};
    }
}
"""

THREADS = 256  # threads a block
BLOCKS = 16  # blocks per (tensor, head, row) at most; a head of a long row is a few hundred KB
_kernels = {}  # sources -> the kernel


def _widths(sources: int) -> int:
    """How many source widths `params` lists: one a source, two at least (one source's twice)."""
    return max(2, sources)


def _get(sources: int):
    """The kernel for `sources` sources, compiled on first use (a second or so): six inputs a source, each
    named in a case of its own. One kernel a count, since MLX's host work per launch grows with the inputs
    (about 2 us each on an H100's host): most surgery reads one batch, a join two, a row's extraction from
    every layer at once (`q4cache.queue_rows`) one source a layer."""
    if sources not in _kernels:
        cases = "\n    ".join(f"case {6 * s + t}: in = reinterpret_cast<const char*>(s{s}_{part}); break;"
                               for s in range(sources) for t, part in enumerate(PARTS))
        _kernels[sources] = cuda_kernel(
            f"kvactors_gather_columns{sources}", [f"s{s}_{p}" for s in range(sources) for p in PARTS] + ["params"],
            [f"o{p}" for p in PARTS], f"#define NW {_widths(sources)}\n" + _SOURCE.replace("INPUT_CASES", cases),
            header=_HEADER)
    return _kernels[sources]


def layout(sources) -> tuple:
    """What `gather`'s kernel needs to know of `sources` besides the plan: (H, each source's W (the first's twice
    for one source), each tensor's bytes a column)."""
    a = sources[0]
    widths = [keys[0].shape[2] for keys, _ in sources]
    widths += widths[:1] * (_widths(len(sources)) - len(widths))
    return (a[0][0].shape[1], *widths, *(x.shape[3] * x.itemsize for x in (*a[0], *a[1])))


def params(layout_: tuple, plan, width: int) -> mx.array:
    """`gather`'s int32 parameters as one device array (a caller that asks per layer may make it once): width,
    `layout(sources)`, then the plan's spans."""
    return mx.array([width, *layout_] + [int(v) for span in plan for v in span], dtype=mx.int32)


def mismatch(sources) -> str | None:
    """Why `gather` cannot read `sources` in one launch (what its ValueError says), or None where it can: one or
    more sources of six tensors, each (B, H, W, C) with one B and W a source and one H in all, and at each of the
    six places one C and dtype in all."""
    tensors = [(*keys, *values) for keys, values in sources]
    if not tensors or any(len(t) != 6 for t in tensors):
        return f"gather reads one or more sources of six tensors each; got {[len(t) for t in tensors]}"
    first = None
    for t in tensors:
        shapes = [x.shape for x in t]
        if any(len(s) != 4 or s[:3] != shapes[0][:3] for s in shapes):
            return ("gather reads (words, scales, biases) of keys and of values, each (B, H, W, ...) with one B and W "
                    f"a source and one H in all; got shapes {[tuple(s) for s in shapes]}")
        kinds = [(s[1], s[3], x.dtype) for s, x in zip(shapes, t)] if len(tensors) > 1 else None
        if first is None:
            first = kinds
        elif kinds != first:
            return ("gather's sources must match in each tensor's head count, last dim and dtype; got "
                    f"{first} and {kinds}")
    return None


def gather(sources, plan, width: int, params_array=None, checked: bool = False):
    """Rows of packed caches copied into new buffers of `width` columns, in one launch.

    sources: one or more packed caches, each a (keys, values) pair of (words, scales,
    biases) tuples, every tensor (B_s, H, W_s, C) with one B_s and W_s within a source, one
    H in all, and at each of the six places one C and dtype in all. plan: one
    (source, row, start, stop, at) per output row r: columns [start, stop) of row `row` of
    sources[source] placed at columns [at, at + stop - start) of row r, every other column
    of row r zero (a span with start == stop reads nothing). Returns ((words, scales,
    biases) of the keys, the same of the values), each (len(plan), H, width, C) in its
    input's dtype, bit for bit the input's columns. `params_array`: `params(layout(sources), plan, width)`,
    made here if not given. `checked`: the caller found `mismatch(sources)` None already (a check of every
    tensor in Python, 0.4 ms for a 32-layer batch on an H100's host), so it is not run again. Raises
    ValueError for arguments out of range. CUDA only.
    """
    reason = None if checked else mismatch(sources)
    if reason:
        raise ValueError(reason)
    tensors = [(*keys, *values) for keys, values in sources]
    shapes = [[x.shape for x in t] for t in tensors]
    H = shapes[0][0][1]
    if not plan:
        raise ValueError("gather needs at least one row in its plan")
    for source, row, start, stop, at in plan:
        if not 0 <= source < len(tensors):
            raise ValueError(f"gather has {len(tensors)} source(s); a span asks for source {source}")
        B, _, W = shapes[source][0][:3]
        if not (0 <= row < B and 0 <= start <= stop <= W and 0 <= at and at + stop - start <= width):
            raise ValueError(f"gather needs 0 <= row < {B}, 0 <= start <= stop <= {W} and 0 <= at, "
                             f"at + stop - start <= width {width}; got {(source, row, start, stop, at)}")
    if params_array is None:
        params_array = params(layout(sources), plan, width)
    a = tensors[0]
    per_head = width * max(s[3] * x.itemsize for s, x in zip(shapes[0], a)) // 16  # 16-byte units at most
    blocks = max(1, min(BLOCKS, -(-per_head // THREADS)))
    out = _get(len(tensors))(inputs=[*(x for t in tensors for x in t), params_array],
                             grid=(blocks * THREADS, 6 * H, len(plan)), threadgroup=(THREADS, 1, 1),
                             output_shapes=[(len(plan), H, width, s[3]) for s in shapes[0]],
                             output_dtypes=[x.dtype for x in a])
    return tuple(out[:3]), tuple(out[3:])
