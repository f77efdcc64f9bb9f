"""Rotate and quantize new keys and values in one kernel, on CUDA.

`pack_kv(keys, values, scheme)` gives what `mx.quantize(kvscheme.rotate(x, scheme))`
gives for keys and for values, (words, scales, biases) each, from one launch
instead of up to eight primitives (two rotations, each a matmul between a
flatten and an unflatten, and two quantizations). A decode step runs this once
per layer, and MLX-CUDA spends host time on every primitive it launches: the
step's host time, not the device, bounds batched decode.

One warp packs one token's head vector (D of 64 or 128). A lane holds D/32
consecutive elements; the Hadamard transform runs in registers, then across lanes
by shuffles, and its 1/sqrt(D) is H's entry rounded to the input dtype, as in
`kvscheme.hadamard`. The rotated element is rounded to the input dtype before
quantizing, as a 16-bit matmul's output is. Quantization follows MLX's affine rule
(the same scale, bias and rounding), so an unrotated input packs bit for bit as
`mx.quantize` packs it on CUDA; a rotated one differs from the matmul path only
where the two sums round differently.
"""

from __future__ import annotations

import functools

import mlx.core as mx

from runtime import q4sdpa
from runtime.kvscheme import KVScheme
from runtime.qgemv import compiled_launch, cuda_kernel

BITS = (4, 6, 8)  # element widths the kernel packs
HEAD_DIMS = (64, 128)

_SOURCE = r"""
    // Warp w < R packs key vector w, w >= R value vector w - R (R = B * H * N vectors each).
    constexpr int E = D / 32;  // elements per lane: dims E * lane .. E * lane + E - 1
    const int lane = threadIdx.x & 31;
    const int w = (blockIdx.x * blockDim.x + threadIdx.x) >> 5;
    const int R = keys_shape[0] * keys_shape[1] * keys_shape[2];
    if (w >= 2 * R) return;
    const bool is_key = w < R;
    const int v = is_key ? w : w - R;
    const int bits = is_key ? KB : VB;
    // where to read and write (the hook below): src, the lane's first element (the next ones `step` apart);
    // wdst, sdst, bdst: where vector v's words, scales and biases go
    LOCATE
    float x[E];
    #pragma unroll
    for (int e = 0; e < E; ++e) x[e] = static_cast<float>(src[e * step]);
    ROPE_HOOK
    if constexpr (ROT) {  // x H along D, H = Sylvester-Hadamard / sqrt(D) with entries in T
        warp_hadamard(x, lane);
        const float h = static_cast<float>(static_cast<T>(1.0f / sqrtf(static_cast<float>(D))));
        #pragma unroll
        for (int e = 0; e < E; ++e) x[e] = static_cast<float>(static_cast<T>(x[e] * h));
    }
    // MLX's affine rule per group of G dims (G / E lanes)
    const float n_bins = static_cast<float>((1 << bits) - 1);
    float w_min = 3.402823466e38f, w_max = 0.0f;
    #pragma unroll
    for (int e = 0; e < E; ++e) {
        w_min = fminf(w_min, x[e]);
        w_max = fmaxf(w_max, x[e]);
    }
    #pragma unroll
    for (int off = 1; off < G / E; off <<= 1) {
        w_min = fminf(w_min, __shfl_xor_sync(0xffffffffu, w_min, off));
        w_max = fmaxf(w_max, __shfl_xor_sync(0xffffffffu, w_max, off));
    }
    float scale = fmaxf((w_max - w_min) / n_bins, 1e-7f);
    const bool side = fabsf(w_min) > fabsf(w_max);
    scale = side ? scale : -scale;
    const float edge = side ? w_min : w_max;
    const float q0 = roundf(edge / scale);
    const bool at_zero = q0 == 0.0f;
    scale = at_zero ? scale : edge / q0;
    const float bias = at_zero ? 0.0f : edge;
    if ((E * lane) % G == 0) {
        sdst[(E * lane) / G] = static_cast<T>(scale);
        bdst[(E * lane) / G] = static_cast<T>(bias);
    }
    // the lane's E values as a little-endian bit stream of E * bits bits
    unsigned int packed = 0;
    #pragma unroll
    for (int e = 0; e < E; ++e) {
        const unsigned int q = static_cast<unsigned char>(fminf(roundf((x[e] - bias) / scale), n_bins));
        packed |= q << (bits * e);
    }
    int nbits = E * bits;
    if (nbits % 8) {  // 6-bit pairs of elements: two lanes make whole bytes; the even lane writes them
        const unsigned int other = __shfl_down_sync(0xffffffffu, packed, 1);
        if (lane & 1) return;
        packed |= other << nbits;
        nbits *= 2;
    }
    unsigned char* dst = reinterpret_cast<unsigned char*>(wdst) + (size_t)(E * lane) * bits / 8;
    for (int i = 0; i < nbits / 8; ++i) dst[i] = static_cast<unsigned char>(packed >> (8 * i));
"""
# keys rotated by RoPE at their rows' positions first (ROPE): dim i with dim i + D/2 (lane ^ 16 holds it) by
# pos[b] + n times inv_freq[i], as mx.fast.rope does (non-traditional), rounded to T as its output is
_ROPE = """
    if constexpr (ROPE) {
        if (is_key) {  // warp-uniform: a warp packs one vector
            const float p = static_cast<float>(pos[b] + n);
            #pragma unroll
            for (int e = 0; e < E; ++e) {
                const float other = __shfl_xor_sync(0xffffffffu, x[e], 16);
                const float theta = p * inv_freq[(E * lane + e) % (D / 2)];
                const float c = cos(theta), s = sin(theta);
                x[e] = static_cast<float>(static_cast<T>(lane < 16 ? x[e] * c - other * s : other * s + x[e] * c));
            }
        }
    }
"""
# fresh (B, H, N, ...) outputs, row-major inputs
_LOCATE_NEW = """
    constexpr int step = 1;
    const T* src = (is_key ? keys : values) + (size_t)v * D + E * lane;
    unsigned int* wdst = (is_key ? kw : vw) + (size_t)v * (D * bits / 32);
    T* sdst = (is_key ? ks : vs) + (size_t)v * (D / G);
    T* bdst = (is_key ? kb : vb) + (size_t)v * (D / G);
"""
# into columns [meta[0] - N, meta[0]) of the cache's (B, H, W, ...) buffers, in place; any strides
_LOCATE_INTO = """
    // `written`: zeros, the attention kernel's block counters (`q4sdpa.counters_for`), max(R, 4) of them
    if (blockIdx.x * blockDim.x + threadIdx.x < max(R, 4)) written[blockIdx.x * blockDim.x + threadIdx.x] = 0u;
    const int H = keys_shape[1], N = keys_shape[2];
    const int b = v / (H * N), h = (v / N) % H, n = v % N;
    const long long col = meta[0] - N + n;
    const long long step = is_key ? keys_strides[3] : values_strides[3];
    const T* src = is_key ? keys + b * keys_strides[0] + h * keys_strides[1] + n * keys_strides[2]
                          : values + b * values_strides[0] + h * values_strides[1] + n * values_strides[2];
    src += E * lane * step;
    unsigned int* wdst = const_cast<unsigned int*>(is_key
        ? kw + b * kw_strides[0] + h * kw_strides[1] + col * kw_strides[2]
        : vw + b * vw_strides[0] + h * vw_strides[1] + col * vw_strides[2]);
    T* sdst = const_cast<T*>(is_key ? ks + b * ks_strides[0] + h * ks_strides[1] + col * ks_strides[2]
                                    : vs + b * vs_strides[0] + h * vs_strides[1] + col * vs_strides[2]);
    T* bdst = const_cast<T*>(is_key ? kb + b * kb_strides[0] + h * kb_strides[1] + col * kb_strides[2]
                                    : vb + b * vb_strides[0] + h * vb_strides[1] + col * vb_strides[2]);
"""

_kernels = {}  # in place or not -> the kernel
_launches = {}  # pack_kv's (shape, dtype, scheme) -> the launch arguments: made once, looked up per call
_runs = {}  # pack_kv_into's (shapes, dtypes, scheme, buffer shapes, rope) -> its call as a compiled function of its
# inputs (`compiled_launch`), its launch arguments checked and made once: looked up per call (a decode step makes 32)


def serves(scheme: KVScheme, keys, values) -> bool:
    """Whether `pack_kv` packs these keys and values (arrays of shape (B, H, N, D)) under `scheme`:
    one shape and dtype for both, float16 or bfloat16, D in HEAD_DIMS, bits in BITS."""
    D = keys.shape[-1]
    return (keys.ndim == 4 and keys.shape == values.shape and keys.dtype == values.dtype and keys.dtype in (mx.float16, mx.bfloat16)
            and D in HEAD_DIMS and D % scheme.group_size == 0 and scheme.key_bits in BITS
            and scheme.value_bits in BITS)


def pack_kv(keys, values, scheme: KVScheme):
    """`mx.quantize(kvscheme.rotate(x, scheme))` of `keys` and of `values`, in one launch on CUDA.

    keys and values: (B, H, N, D) with `serves(scheme, keys, values)`. Returns
    ((words, scales, biases) of the keys, the same of the values), laid out as
    `mx.quantize` lays them out. Raises ValueError for what it does not serve.
    """
    key = (keys.shape, values.shape, keys.dtype, values.dtype, scheme)
    args = _launches.get(key)
    if args is None:
        args = _launches[key] = _launch(keys, values, scheme)
    out = _kernel(False)(inputs=[keys, values], **args)
    return tuple(out[:3]), tuple(out[3:])


def pack_kv_into(keys, values, scheme: KVScheme, key_buffers, value_buffers, end: int, rope=None):
    """Pack `keys` and `values` as `pack_kv` does, into columns [end - N, end) of a cache's buffers, in place.

    `rope`: (positions, inv_freq) to rotate the keys by RoPE first, as `mx.fast.rope`
    (non-traditional, over the whole head) would at row b's position positions[b] (int32,
    (B,); token n of a row at positions[b] + n) with inverse frequencies inv_freq (float32,
    (D/2,)); each rotated element is rounded to the keys' dtype, as that op's output is.

    keys and values: (B, H, N, D) with `serves(scheme, keys, values)`; key_buffers and
    value_buffers: (words, scales, biases) of shape (B, H, W, ...), as `pack_kv` lays
    out a token, with W >= end >= N; any strides, the last one 1. The buffers are
    written where they are: MLX sees them only as inputs, so nothing else may hold
    them (a batch cache owns its buffers), and whatever reads the new columns in the
    same evaluation must take the returned array as an input too: MLX-CUDA orders the
    kernels of one evaluation by the arrays they share. Returns that array: max(B * H * N, 4)
    uint32 zeros, which `q4sdpa.q4_decode_sdpa` counts its blocks in when it reads these
    columns with at most `q4sdpa.HEADS` query heads a kv head. One launch and no slice updates: a decode step saves six primitives a layer.
    Raises ValueError for what it does not serve.
    """
    key = (keys.shape, values.shape, keys.dtype, values.dtype, scheme,
           tuple((x.shape, x.dtype) for x in (*key_buffers, *value_buffers)), rope is not None)
    W, N = key_buffers[0].shape[2], keys.shape[2]
    check_rope(rope, keys.shape[0], keys.shape[3])
    if not N <= end <= W:
        raise ValueError(f"pack_kv_into writes columns [end - {N}, end) of buffers {W} wide; got end {end}")
    run = _runs.get(key)
    if run is None:  # ValueError for buffers the kernel does not write, before any kernel is made
        args = _launch_into(keys, values, scheme, key_buffers, value_buffers, rope)
        run = _runs[key] = compiled_launch(_kernel(True), args, 0)
    positions, inv_freq = rope if rope is not None else no_rope()
    return run(keys, values, *key_buffers, *value_buffers, q4sdpa.meta(end, 0, 1), positions, inv_freq)


@functools.lru_cache(maxsize=1)
def no_rope():
    """(positions, inv_freq) that the kernels take when they rotate nothing: one compiled kernel per setting,
    one list of inputs. Made from lists, so any thread may evaluate them."""
    return mx.array([0], dtype=mx.int32), mx.array([0.0], dtype=mx.float32)


def check_rope(rope, rows: int, head_dim: int) -> None:
    """Raise ValueError unless `rope` is None or (positions int32 (rows,), inv_freq float32 (head_dim/2,))."""
    if rope is None:
        return
    positions, inv_freq = rope  # the shapes only: a decode step asks 64 times
    if (positions.dtype != mx.int32 or tuple(positions.shape) != (rows,) or inv_freq.dtype != mx.float32
            or tuple(inv_freq.shape) != (head_dim // 2,)):
        raise ValueError(f"rope is (positions int32 ({rows},), inv_freq float32 ({head_dim // 2},)); got "
                         f"{positions.dtype} {tuple(positions.shape)}, {inv_freq.dtype} {tuple(inv_freq.shape)}")


def _kernel(into: bool):
    if into not in _kernels:
        if into:
            inputs = ["keys", "values", "kw", "ks", "kb", "vw", "vs", "vb", "meta", "pos", "inv_freq"]
            outputs = ["written"]
        else:
            inputs, outputs = ["keys", "values"], ["kw", "ks", "kb", "vw", "vs", "vb"]
        source = (_SOURCE.replace("LOCATE", _LOCATE_INTO if into else _LOCATE_NEW)
                  .replace("ROPE_HOOK", _ROPE if into else ""))
        _kernels[into] = cuda_kernel(f"kvactors_pack_kv{'_into' if into else ''}", inputs, outputs, source,
                                     header=q4sdpa.WARP_HADAMARD, ensure_row_contiguous=not into)
    return _kernels[into]


def _launch_into(keys, values, scheme: KVScheme, key_buffers, value_buffers, rope) -> dict:
    """`pack_kv_into`'s launch arguments; ValueError for buffers that do not fit."""
    args = _launch(keys, values, scheme)
    B, H, N, D = keys.shape
    t = keys.dtype
    for buffers, bits, what in ((key_buffers, scheme.key_bits, "key"), (value_buffers, scheme.value_bits, "value")):
        want = [((B, H), D * bits // 32, mx.uint32), ((B, H), D // scheme.group_size, t),
                ((B, H), D // scheme.group_size, t)]
        W = key_buffers[0].shape[2]
        if len(buffers) != 3 or any(x.ndim != 4 or tuple(x.shape[:2]) != bh or x.shape[2] != W or x.shape[3] != last
                                    or x.dtype != dt for x, (bh, last, dt) in zip(buffers, want)):
            raise ValueError(f"pack_kv_into needs {what} buffers (words, scales, biases) of shape ({B}, {H}, W, ...) "
                             f"as pack_kv lays out a token, scales in {t}; got "
                             f"{[(tuple(x.shape), x.dtype) for x in buffers]}")
    return dict(template=args["template"] + [("ROPE", rope is not None)], grid=args["grid"],
                threadgroup=args["threadgroup"], output_shapes=[(max(B * H * N, 4),)], output_dtypes=[mx.uint32])


def _launch(keys, values, scheme: KVScheme) -> dict:
    """`pack_kv`'s launch arguments for these keys, values and scheme; ValueError for what it does not serve."""
    if not serves(scheme, keys, values):
        raise ValueError(f"pack_kv packs float16 or bfloat16 keys and values of one shape, head dim in {HEAD_DIMS}, "
                         f"{BITS} bits; got keys {keys.shape} {keys.dtype}, values {values.shape} {values.dtype}, "
                         f"scheme {scheme.name}")
    B, H, N, D = keys.shape
    g, kb, vb = scheme.group_size, scheme.key_bits, scheme.value_bits
    shape = (B, H, N)
    warps = 2 * B * H * N
    return dict(
        template=[("T", keys.dtype), ("D", D), ("G", g), ("KB", kb), ("VB", vb), ("ROT", scheme.rotated)],
        grid=(-(-warps // 4) * 128, 1, 1),
        threadgroup=(128, 1, 1),
        output_shapes=[(*shape, D * kb // 32), (*shape, D // g), (*shape, D // g),
                       (*shape, D * vb // 32), (*shape, D // g), (*shape, D // g)],
        output_dtypes=[mx.uint32, keys.dtype, keys.dtype, mx.uint32, keys.dtype, keys.dtype],
    )
