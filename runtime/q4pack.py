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

import mlx.core as mx

from runtime.kvscheme import KVScheme

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
    const T* src = (is_key ? keys : values) + (size_t)v * D + E * lane;
    float x[E];
    #pragma unroll
    for (int e = 0; e < E; ++e) x[e] = static_cast<float>(src[e]);
    if constexpr (ROT) {  // x H along D, H = Sylvester-Hadamard / sqrt(D) with entries in T
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
        const float h = static_cast<float>(static_cast<T>(1.0f / sqrtf(static_cast<float>(D))));
        #pragma unroll
        for (int e = 0; e < E; ++e) x[e] = static_cast<float>(static_cast<T>(x[e] * h));
    }
    // MLX's affine rule per group of G dims (G / E lanes)
    const int bits = is_key ? KB : VB;
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
        const size_t gi = (size_t)v * (D / G) + (E * lane) / G;
        (is_key ? ks : vs)[gi] = static_cast<T>(scale);
        (is_key ? kb : vb)[gi] = static_cast<T>(bias);
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
    unsigned char* dst = reinterpret_cast<unsigned char*>(is_key ? kw : vw)
        + (size_t)v * (D * bits / 8) + (size_t)(E * lane) * bits / 8;
    for (int i = 0; i < nbits / 8; ++i) dst[i] = static_cast<unsigned char>(packed >> (8 * i));
"""

_kernel = None
_launches = {}  # (shape, dtype, scheme) -> the launch arguments: made once, looked up per call (a decode step makes 32)


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
    global _kernel
    key = (keys.shape, values.shape, keys.dtype, values.dtype, scheme)
    args = _launches.get(key)
    if args is None:
        args = _launches[key] = _launch(keys, values, scheme)
    if _kernel is None:
        _kernel = mx.fast.cuda_kernel(name="kvactors_pack_kv", input_names=["keys", "values"],
                                      output_names=["kw", "ks", "kb", "vw", "vs", "vb"], source=_SOURCE,
                                      ensure_row_contiguous=True)
    out = _kernel(inputs=[keys, values], **args)
    return tuple(out[:3]), tuple(out[3:])


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
