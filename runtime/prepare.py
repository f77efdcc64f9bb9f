"""Preparing a loaded model for the engine: quantized linears that batch on CUDA.

`prepare_model(model)` is the one place where the engine's model differs from
the model mlx-lm built. It changes the class of the model's own
`QuantizedLinear` and `QuantizedEmbedding` instances (and no other object, so
a model loaded elsewhere in the process is untouched) to subclasses that:

- feed the quantized matmul a 2-D input. MLX-CUDA runs a (B, 1, K) input as B
  separate matrix-vector products (B passes over the weights); a (B, K) input
  is one problem. On an H100, 8B shape, a whole decode step at batch 8 took
  35 ms with 3-D inputs and 20 ms flattened.
- multiply prefill-sized inputs (DENSE_ROWS rows or more) by the weight
  dequantized for the call, with MLX's 16-bit GEMM: on an H100, 8B shape, one
  layer's seven products at 2048 rows took 7.2 ms through MLX-CUDA's quantized
  matmul and 2.0 ms this way; at 256 rows 1.03 against 0.89 ms (`benchmarks/prefill_gemm.py`), but
  `qgemm` (below) is faster still there: on an H200 a 256-token hot chunk took 26.5 ms through it
  against 26.8 ms this way (six alternating rounds, each one faster), with the host done after 7.6
  ms instead of 25.5 (`benchmarks/results/h200/chunk-fusion-2026-11-29`). The dequantized weight
  lives for one call (117 MB for a 14336x4096 layer), and at most DENSE_IN_FLIGHT
  plus DENSE_LAUNCH such products are queued on the device at once (`_bound_in_flight`).
- send decode-sized inputs (1 to `qgemv.MAX_ROWS` rows) of 4-bit weights through
  `qgemv`, which reads the weights once for all rows and gives each row the same
  result whatever the batch (batch-invariant decoding), and larger inputs below
  DENSE_ROWS (a hot turn's chunk) through `qgemm`, which splits K to fill the GPU
  where MLX-CUDA's quantized matmul gives a 64-row chunk a few dozen blocks. Only
  float16 and bfloat16 inputs of the weights' scale type go there
  (`qgemv.INPUT_DTYPES`); others take MLX's kernel.

Float mixture-of-experts projections (mlx-lm's `SwitchLinear`) get inputs with the
standard strides that MLX-CUDA's expert-sorted `gather_mm` needs to read them right
(`RowStridedSwitchLinear`).

It also gives decoder layers a compiled decode path, so that MLX replays a
recorded graph instead of Python building its ops every step: mlx-lm's llama
blocks whole except the cache update and attention (`compile_blocks`), other
layers their plain gate/up/down MLP (`compile_mlps`). A decode step on CUDA is
bound by such host work: on an H100, 8B shape, 3K context, the MLPs alone took
11-26% off the host time of a step at batch 5 and 8
(`benchmarks/results/h100/compiled_mlp.md`). The results are bitwise the same,
but for the fused GEMV launches of a compiled llama block (`CompiledBlock`).

The math is the model's own: same weights, same quantization. On backends other
than CUDA the preparation is not needed and `prepare_model` leaves the model as
it is unless asked (`force=True`, used by the tests to check the flattening).

`last_logits(model, inputs, cache, position)` runs a prefill chunk and projects
only one position onto the vocabulary: for the architectures whose output head
is known (llama, qwen2, qwen3: the backbone `model.model`, then the tied
embedding or `lm_head`) it skips the head for every other position (a fifth of
a prefill's work on SmolLM2-135M's 49K vocabulary); any other model runs whole.
"""

from __future__ import annotations

import collections
import dataclasses
import threading

import mlx.core as mx
import mlx.nn as nn
import numpy as np
from mlx_lm.models import llama
from mlx_lm.models.base import scaled_dot_product_attention
from mlx_lm.models.switch_layers import SwitchLinear

from runtime import qgemm, qgemv
from runtime.attention import RowRange


DENSE_ROWS = 257  # on CUDA, inputs of this many rows or more multiply the dequantized weight (256 measured: see above)
DENSE_IN_FLIGHT = 14  # dense products queued on the device at most (two layers' worth)
DENSE_LAUNCH = 7  # dense products launched together (a llama layer's seven): each launch has a fixed host cost
CHUNK_LAUNCH = 4  # a short chunk's forward through compiled blocks is launched after every this many of them
# compiled blocks hand decode steps' keys and queries to the CUDA kernels unrotated (RoPE inside): off until
# measured on a GPU (its kernels and tests are in place: tests/test_cuda_kernels.py, tests/test_prepare.py)
FUSE_ROPE = False
_queue = threading.local()  # per thread (MLX evaluates a lazy array only on the thread that built it):
# .launched, a deque of launched products, oldest first; .built, those built since the last launch


def _queued():
    if not hasattr(_queue, "built"):
        _queue.launched, _queue.built = collections.deque(), []
    return _queue.launched, _queue.built


def _quantized_matmul(module, x):
    """`x @ module's dequantized weight.T`: the GEMV kernel for small M on CUDA (any leading
    shape); for M >= DENSE_ROWS on CUDA, a 16-bit GEMM on the weight dequantized for this
    call; for M between, `qgemm` where it serves the weight; else MLX's quantized matmul on
    x flattened to 2-D."""
    shape = x.shape
    if _gemv_serves(module, x):
        return qgemv.qgemv(x, *_packed(module), module.group_size)
    flat = x.reshape(-1, shape[-1])
    if module._kvactors_dense and flat.shape[0] >= DENSE_ROWS:
        w = mx.dequantize(module["weight"], module["scales"], module.get("biases"), group_size=module.group_size,
                          bits=module.bits, mode=module.mode)
        y = flat @ w.astype(x.dtype).T
        _bound_in_flight(y)
    elif _gemm_serves(module, flat):
        y = qgemm.qgemm(flat, *_packed(module), module.group_size)
    else:
        y = mx.quantized_matmul(flat, module["weight"], scales=module["scales"], biases=module.get("biases"),
                                transpose=True, group_size=module.group_size, bits=module.bits, mode=module.mode)
    return y.reshape(*shape[:-1], y.shape[-1])


def _gemv_serves(module, x) -> bool:
    """Whether `module` (a prepared quantized linear) multiplies `x` through `qgemv`."""
    return (getattr(module, "_kvactors_gemv", False) and _decode_sized(x) and x.dtype in qgemv.INPUT_DTYPES
            and x.dtype == module["scales"].dtype)


def _packed(module) -> tuple:
    """A quantized linear's (weight, scales, biases)."""
    return module["weight"], module["scales"], module["biases"]


def _fused(modules, x) -> bool:
    """Whether one `qgemv` launch serves `modules` (linears of one input): each through the GEMV, one group
    size, no bias added after the product."""
    return (all(_gemv_serves(m, x) and "bias" not in m for m in modules)
            and len({m.group_size for m in modules}) == 1)


def _gemm_serves(module, x) -> bool:
    """Whether `module` (a prepared quantized linear) multiplies `x` (not decode-sized: see `_gemv_serves`)
    through `qgemm`: fewer than DENSE_ROWS rows, a weight `qgemm` reads."""
    return (getattr(module, "_kvactors_gemv", False) and x.size < DENSE_ROWS * x.shape[-1]
            and qgemm.supports(x, module["weight"], module["scales"], module.group_size))


def _gemm_fused(modules, x) -> bool:
    """Whether one `qgemm.qgemm_parts` launch serves `modules` (linears of one input): a chunk of more than
    `qgemv.MAX_ROWS` rows, each through `qgemm`, one group size, no bias added after the product."""
    return (not _decode_sized(x) and all(_gemm_serves(m, x) and "bias" not in m for m in modules)
            and len({m.group_size for m in modules}) == 1)


def _decode_sized(x) -> bool:
    """Whether `x` (..., K) has at most `qgemv.MAX_ROWS` rows: a decode step's input."""
    return x.size <= qgemv.MAX_ROWS * x.shape[-1]


def _bound_in_flight(y) -> None:
    """Queue `y`; every DENSE_LAUNCH products, launch them and wait for those more than DENSE_IN_FLIGHT back.

    MLX keeps a product's dequantized weight alive until the device has run it, and
    the host queues a whole prefill chunk long before the device gets there: all 224
    weights of an 8B model (9 GB on an H100, and out of memory under a server's
    load). Waiting for an older product, which the device has usually finished,
    bounds that to a few weights without idling the device. Launching several
    products at once saves the host a launch's fixed cost per product.
    """
    launched, built = _queued()
    built.append(y)
    if len(built) < DENSE_LAUNCH:
        return
    mx.async_eval(built)
    launched.extend(built)
    built.clear()
    while len(launched) > DENSE_IN_FLIGHT:
        mx.eval(launched.popleft())


class FlatQuantizedLinear(nn.QuantizedLinear):
    """A `QuantizedLinear` that multiplies a flattened input (see the module docstring)."""

    def __call__(self, x):
        y = _quantized_matmul(self, x)
        if "bias" in self:
            y = y + self["bias"]
        return y


class FlatQuantizedEmbedding(nn.QuantizedEmbedding):
    """A `QuantizedEmbedding` whose tied output projection (`as_linear`) multiplies a flattened input."""

    def as_linear(self, x):
        return _quantized_matmul(self, x)


_SWAPS = {nn.QuantizedLinear: FlatQuantizedLinear, nn.QuantizedEmbedding: FlatQuantizedEmbedding}


class RowStridedSwitchLinear(SwitchLinear):
    """A mixture-of-experts `SwitchLinear` (16- or 32-bit experts) whose `gather_mm` input has standard strides.

    MLX-CUDA's `gather_mm` for expert-sorted rows (mlx 0.32.4; mlx-lm's `SwitchGLU` sorts
    rows once a call has 64 or more) steps from row to row by the stride of the input's
    singleton axis (..., 1, K). An `expand_dims` view leaves that stride at 1, and an
    elementwise op that reuses such a view's buffer hands it on: mlx-lm's bias add
    (`x + expand_dims(bias[indices], -2)`) does so whenever MLX's buffer cache gave the
    other operand a larger buffer. Then every row of an expert's group after the first
    is read from the wrong place, and a float MoE model's prefill goes wrong, depending
    on what ran earlier in the process. Reshaping through (-1, K) gives the axis the
    stride K, with no copy; the product is the same.
    """

    def __call__(self, x, indices, sorted_indices=False):
        return super().__call__(x.reshape(-1, x.shape[-1]).reshape(x.shape), indices, sorted_indices)


def mend_switch_linears(model) -> int:
    """Make `model`'s own `SwitchLinear` instances `RowStridedSwitchLinear`; return how many. Idempotent.

    Exact on every backend; `prepare_model` does it on CUDA, where MLX needs it.
    """
    changed = 0
    for module in model.modules():
        if type(module) is SwitchLinear:
            module.__class__ = RowStridedSwitchLinear
        if type(module) is RowStridedSwitchLinear:
            changed += 1
    return changed


def prepare_model(model, force: bool = False, gemv: bool | None = None, dense: bool | None = None,
                  compile_decode: bool | None = None) -> int:
    """Prepare `model`'s quantized (and float expert) layers for batched decoding; return how many were changed.

    Does nothing off CUDA unless `force`. `gemv` (default: on CUDA) routes 1..16-row
    inputs of 4-bit layers through `qgemv` and larger ones below DENSE_ROWS through `qgemm`; `dense` (default: on CUDA) multiplies inputs
    of DENSE_ROWS rows or more by the dequantized weight; `compile_decode` (default: on
    CUDA) gives the decoder layers a compiled decode path: llama blocks whole, around
    the cache (`compile_blocks`), other layers their MLP (`compile_mlps`). Idempotent.
    Float mixture-of-experts layers get inputs MLX-CUDA reads right (`mend_switch_linears`).
    Other layer types are left as they are.
    """
    cuda = qgemv.available()
    if not (cuda or force):
        return 0
    gemv = cuda if gemv is None else gemv
    changed = mend_switch_linears(model)
    for module in model.modules():
        flat = _SWAPS.get(type(module))
        if flat is None and type(module) not in _SWAPS.values():
            continue
        if flat is not None:
            module.__class__ = flat
        # a plain attribute, not a dict entry: parameters() and saving never see it
        fits = qgemv.supports_weights(module.bits, module.group_size, module.mode, "biases" in module,
                                      module["weight"].shape[-1] * 32 // module.bits)
        object.__setattr__(module, "_kvactors_gemv", gemv and fits)
        object.__setattr__(module, "_kvactors_dense", cuda if dense is None else dense)
        changed += 1
    if cuda if compile_decode is None else compile_decode:
        compile_blocks(model)
        compile_mlps(model)
    return changed


_MLP_PARTS = ("gate_proj", "up_proj", "down_proj")
_compiled_classes: dict = {}


def _mlp_call(self, x):
    """A prepared MLP: decode-sized inputs through one compiled graph per shape (MLX replays it
    without Python building each op again); larger ones as the model's own class does."""
    if not _decode_sized(x):
        return super(type(self), self).__call__(x)
    fn = self.__dict__.get("_kvactors_compiled")
    if fn is None:
        fn = mx.compile(super(type(self), self).__call__)
        object.__setattr__(self, "_kvactors_compiled", fn)
    return fn(x)


def _layers(model) -> list:
    return getattr(model, "layers", None) or getattr(getattr(model, "model", None), "layers", [])


def compile_mlps(model) -> int:
    """Give each decoder layer's gate/up/down MLP a compiled decode path; return how many.

    Only plain MLP modules (the three quantized projections of a prepared model, no
    other children) are changed, by class, like `prepare_model`'s swaps. The MLPs of
    blocks compiled whole (`compile_blocks`) are left alone: they run inside the block's graph.
    """
    changed = 0
    for layer in _layers(model):
        mlp = getattr(layer, "mlp", None)
        if mlp is None or set(mlp.children()) != set(_MLP_PARTS) or isinstance(layer, CompiledBlock):
            continue
        cls = type(mlp)
        if cls not in _compiled_classes.values():
            sub = _compiled_classes.get(cls)
            if sub is None:
                sub = _compiled_classes[cls] = type(f"Compiled{cls.__name__}", (cls,), {"__call__": _mlp_call})
            mlp.__class__ = sub
        changed += 1
    return changed


class CompiledBlock(llama.TransformerBlock):
    """mlx-lm's llama decoder block, run as two compiled graphs around the cache for decode steps and short chunks.

    For a decode step (one query per row), or a prefill chunk of fewer than DENSE_ROWS
    rows in all (a hot turn's chunk: the dense products launch and wait inside, which a
    recorded graph cannot), against a cache whose `offset` is an array
    (the engine's batch caches), the block runs `_before_cache` (input norm,
    q/k/v projections, RoPE) and `_after_cache` (output projection, residual,
    post-attention norm, MLP, residual) through `mx.compile`, one recorded graph per
    input shape, and between them the cache update and attention as the model's own
    attention does them. Where the cache's CUDA kernels can rotate by the model's RoPE
    (`BatchQuantizedKVCache.fuses_rope`, `rope_frequencies`; FUSE_ROPE), the compiled
    graph stops before RoPE (`_projected`) and the in-place cache write rotates the
    keys, the attention kernel the queries: two launches fewer a layer.
    Everything else (prefill, caches with integer offsets)
    runs the block's own `__call__`. What it saves is Python building those ops every
    step, which bounds a decode step on CUDA. The math and its order are mlx-lm's, so
    the results are bitwise the same, except where the GEMV serves the projections
    (CUDA): there q/k/v are one launch, the output projection and its residual another,
    gate, up and SiLU a third, the down projection and its residual a fourth. That
    saves six primitives a layer (each costs the host 5-15 us; the residuals' adds are
    bitwise as before) and may change a product's last bits, as `qgemv.qgemv_parts`
    says; each row's result stays bitwise the same in any batch. For a short chunk
    (`qgemm`'s rows) q/k/v are one product launch and one sum launch, which writes them
    in the heads' layout attention takes (no copies to make them contiguous), gate and up
    one product launch that also takes SiLU and their product (`qgemm.qgemm_swiglu`; where
    K is split, its sum launch does), attention writes its output as the output projection
    takes it (`RowRange.flat`: no transposing copy), and the output and down projections add
    their residuals in their sum launches (`qgemm.qgemm_parts`, `qgemm.qgemm`'s `add`): seven
    launches a layer for the products and their neighbours where there were fourteen (a
    product and a sum launch for each of the four, two adds, two copies, SiLU and the
    attention output's copy), each result bitwise as before. A short chunk's
    forward is launched (`mx.async_eval`) after every CHUNK_LAUNCH-th block, so the
    device runs the first blocks while the host builds the rest (a decode step is
    pipelined by the engine instead); the results are the same bits.
    """

    def __call__(self, x, mask=None, cache=None):
        if x.shape[0] * x.shape[1] >= DENSE_ROWS or cache is None or not isinstance(cache.offset, mx.array):
            return super().__call__(x, mask, cache)
        graphs = self._graphs()
        attn = self.self_attn
        if (FUSE_ROPE and x.shape[1] == 1 and isinstance(mask, RowRange) and cache.fuses_rope(x.dtype, attn.head_dim)
                and (inv_freq := rope_frequencies(attn.rope, attn.head_dim)) is not None):
            rope = (cache.offset, inv_freq)  # the rows' positions before this token
            queries, keys, values = graphs[2](x)
            keys, values = cache.update_and_fetch(keys, values, rope=rope)
            mask = dataclasses.replace(mask, rope=rope)
        else:
            queries, keys, values = graphs[0](x, cache.offset)
            keys, values = cache.update_and_fetch(keys, values)
            if x.shape[1] > 1 and isinstance(mask, RowRange):  # a chunk on the kernel route: attention writes
                mask = _flat_mask(mask)  # (B, L, heads x head_dim), as the output projection takes it
        out = scaled_dot_product_attention(queries, keys, values, cache=cache, scale=attn.scale, mask=mask)
        out = graphs[1](out, x)
        if x.shape[1] > 1 and self.__dict__.get("_kvactors_index", 0) % CHUNK_LAUNCH == CHUNK_LAUNCH - 1:
            mx.async_eval(out)  # the device starts on these blocks while the host builds the next ones
        return out

    def record(self, rows: int) -> None:
        """Record the graphs a decode step of `rows` rows runs, on this thread, without running them.

        `mx.compile` records a graph at a call with new input shapes (Python runs the
        block's steps once), for the calling thread's stream; a step that meets a batch
        size for the first time in a model's life would otherwise pay that for every
        layer. The inputs here are what a decode step passes: the block's input
        (rows, 1, hidden), the rows' positions (int32), and attention's output
        (rows, heads, 1, head_dim), in the norm's dtype.
        """
        norm = self.input_layernorm.weight
        attn = self.self_attn
        x = mx.zeros((rows, 1, norm.shape[0]), norm.dtype)
        graphs = self._graphs()
        if FUSE_ROPE:  # the step rotates inside the kernels where the cache can (see __call__)
            graphs[2](x)
        graphs[0](x, mx.zeros((rows,), mx.int32))
        graphs[1](mx.zeros((rows, attn.n_heads, 1, attn.head_dim), norm.dtype), x)

    def _graphs(self) -> tuple:
        """The compiled `_before_cache`, `_after_cache` and `_projected`, made once per block."""
        graphs = self.__dict__.get("_kvactors_graphs")
        if graphs is None:
            graphs = (mx.compile(self._before_cache), mx.compile(self._after_cache), mx.compile(self._projected))
            object.__setattr__(self, "_kvactors_graphs", graphs)
        return graphs

    def _before_cache(self, x, offset):
        """Rows' queries, keys and values, rotated by RoPE at `offset`: mlx-lm's steps."""
        queries, keys, values = self._projected(x)
        rope = self.self_attn.rope
        return rope(queries, offset=offset), rope(keys, offset=offset), values

    def _projected(self, x):
        """Rows' queries, keys and values of x (B, L, hidden), before RoPE, as (B, heads, L, head_dim).

        Where the GEMV serves all three projections of one token a row, they run as one launch
        that writes each in mlx-lm's (B, heads, 1, head_dim) layout (`qgemv.qgemv_parts`).
        """
        attn = self.self_attn
        h = self.input_layernorm(x)
        B, L, _ = h.shape
        parts = (attn.q_proj, attn.k_proj, attn.v_proj)
        if L == 1 and _fused(parts, h):  # the launch writes rows in order: the heads' layout only for one token
            heads = (attn.n_heads, attn.n_kv_heads, attn.n_kv_heads)
            shapes = [(B, n, L, m["weight"].shape[0] // n) for n, m in zip(heads, parts)]
            queries, keys, values = qgemv.qgemv_parts(h, [_packed(m) for m in parts], attn.q_proj.group_size, shapes)
        elif _gemm_fused(parts, h) and _whole_heads(attn):  # a short chunk: one product and one sum launch for
            # the three, written in the heads' layout (no copies to make the heads' rows contiguous)
            queries, keys, values = qgemm.qgemm_parts(h, [_packed(m) for m in parts], attn.q_proj.group_size,
                                                      head_dim=attn.head_dim)
        else:
            queries = attn.q_proj(h).reshape(B, L, attn.n_heads, -1).transpose(0, 2, 1, 3)
            keys = attn.k_proj(h).reshape(B, L, attn.n_kv_heads, -1).transpose(0, 2, 1, 3)
            values = attn.v_proj(h).reshape(B, L, attn.n_kv_heads, -1).transpose(0, 2, 1, 3)
        return queries, keys, values

    def _after_cache(self, out, x):
        """The block's output from attention's `out` (B, heads, L, head_dim), or (B, L, heads x head_dim) where the
        attention wrote it so (`RowRange.flat`), and the block's input `x`: mlx-lm's steps.

        Where the GEMV serves them: the output projection adds the residual in its
        launch (`qgemv.qgemv`'s `add`); the MLP's gate and up projections and the SiLU
        product run as one launch (`qgemv.qgemv_swiglu`); the down projection adds the
        second residual in its own.
        """
        B, L, _ = x.shape
        if out.ndim == 3:
            attended = out
        else:  # one query per row: the heads' transpose moves nothing
            attended = out.reshape(B, L, -1) if L == 1 else out.transpose(0, 2, 1, 3).reshape(B, L, -1)
        h = _linear_plus(self.self_attn.o_proj, attended, x)
        h_norm = self.post_attention_layernorm(h)
        mlp = self.mlp
        if type(mlp) is llama.MLP and _fused((mlp.gate_proj, mlp.up_proj), h_norm):
            gated = qgemv.qgemv_swiglu(h_norm, _packed(mlp.gate_proj), _packed(mlp.up_proj), mlp.gate_proj.group_size)
            return _linear_plus(mlp.down_proj, gated, h)
        if type(mlp) is llama.MLP and _gemm_fused((mlp.gate_proj, mlp.up_proj), h_norm):
            gated = qgemm.qgemm_swiglu(h_norm, _packed(mlp.gate_proj), _packed(mlp.up_proj), mlp.gate_proj.group_size)
            return _linear_plus(mlp.down_proj, gated, h)
        return h + mlp(h_norm)


_flat = threading.local()  # .pair: the last (mask, its flat copy) of this thread (`_flat_mask`)


def _flat_mask(mask: RowRange) -> RowRange:
    """`mask` asking attention for its output as (B, L, heads x head_dim) (`RowRange.flat`): one copy a mask, which
    a chunk's blocks share."""
    pair = getattr(_flat, "pair", None)
    if pair is None or pair[0] is not mask:
        pair = _flat.pair = (mask, dataclasses.replace(mask, flat=True))
    return pair[1]


def record_decode(model, batch_sizes) -> int:
    """Record the compiled blocks' decode graphs for each of `batch_sizes` rows now (`CompiledBlock.record`:
    Python traces them, nothing runs on the device), on the calling thread, which must be the one that will
    decode (MLX keeps a thread's graphs for its own stream). Sizes of DENSE_ROWS rows or more are left out:
    their steps take the block's own path, whose dense products launch inside and cannot be recorded.
    Returns how many (block, batch size) pairs were recorded, two graphs each: 0 where no block is compiled
    (`prepare_model` compiles them on CUDA)."""
    blocks = [layer for layer in _layers(model) if isinstance(layer, CompiledBlock)]
    sizes = [rows for rows in batch_sizes if rows < DENSE_ROWS]
    for rows in sizes:
        for block in blocks:
            block.record(rows)
    return len(blocks) * len(sizes)


def rope_frequencies(rope, head_dim: int):
    """The inverse frequencies (float32, (head_dim/2,)) of `rope`, a RoPE module of mlx-lm's, if it rotates as
    the kernels can (`q4pack.pack_kv_into`'s `rope`), else None; found once per module and kept on it.

    The module is asked, through its own call, where it puts a unit vector at positions 1, 2 and 7:
    a non-traditional rotation of the whole head, dim i with dim i + head_dim/2 by the angle position
    x inv_freq[i], with no scaling, is what the kernels compute (`nn.RoPE` and mlx-lm's Llama 3 RoPE
    are; traditional, partial or scaled ones are not, and keep MLX's kernel).
    """
    known = rope.__dict__.get("_kvactors_inv_freq")
    if known is None:
        known = _probed_frequencies(rope, head_dim)
        object.__setattr__(rope, "_kvactors_inv_freq", known)
    return known if isinstance(known, mx.array) else None


def _probed_frequencies(rope, head_dim: int):
    half = head_dim // 2
    unit = mx.concatenate([mx.ones((half,)), mx.zeros((half,))]).reshape(1, 1, 1, head_dim)
    try:
        rows = [np.array(rope(unit, offset=p).astype(mx.float32), dtype=np.float64).reshape(-1) for p in (1, 2, 7)]
    except Exception:
        return False
    theta = np.arctan2(rows[0][half:], rows[0][:half])
    for p, row in zip((1, 2, 7), rows):
        if not (np.allclose(row[:half], np.cos(p * theta), atol=1e-5)
                and np.allclose(row[half:], np.sin(p * theta), atol=1e-5)):
            return False
    return mx.array(theta.astype(np.float32))


def _linear_plus(module, x, residual):
    """`residual + module(x)`: the residual added in the GEMV's launch where it serves the module (`qgemv.qgemv`'s
    `add`), in the short chunk's product's (`qgemm.qgemm`'s `add`) where that serves it; bitwise the same. A
    residual of another dtype than x's (a float32 stream beside 16-bit products) is added as MLX adds it."""
    if residual.dtype == x.dtype and _fused((module,), x):
        return qgemv.qgemv(x, *_packed(module), module.group_size, add=residual)
    if residual.dtype == x.dtype and _gemm_fused((module,), x):
        return qgemm.qgemm(x, *_packed(module), module.group_size, add=residual)
    return residual + module(x)


def _whole_heads(attn) -> bool:
    """Whether llama attention `attn`'s q/k/v projections are its heads of `head_dim` each, which a short chunk's
    product writes in the heads' layout (`qgemm.qgemm_parts`' head_dim)."""
    d = attn.head_dim
    return (d % 4 == 0 and attn.q_proj["weight"].shape[0] == attn.n_heads * d
            and attn.k_proj["weight"].shape[0] == attn.v_proj["weight"].shape[0] == attn.n_kv_heads * d)



def compile_blocks(model) -> int:
    """Make each of `model`'s mlx-lm llama decoder blocks a `CompiledBlock`; return how many are.

    Only blocks of exactly mlx-lm's llama classes (block and attention) change, by
    class, like `prepare_model`'s swaps; other architectures keep their blocks.
    """
    changed = 0
    for i, layer in enumerate(_layers(model)):
        if type(layer) is llama.TransformerBlock and type(layer.self_attn) is llama.Attention:
            layer.__class__ = CompiledBlock
            object.__setattr__(layer, "_kvactors_index", i)  # its place, for CHUNK_LAUNCH
        changed += isinstance(layer, CompiledBlock)
    return changed


_HEAD_KNOWN = {"mlx_lm.models.llama", "mlx_lm.models.qwen2", "mlx_lm.models.qwen3"}


def last_logits(model, inputs, cache, position: int):
    """Feed `inputs` (B, L) through `model` with `cache`; return the logits at `position` only, (B, V).

    The cache is updated with all L positions, exactly as `model(inputs, cache=cache)` does.
    Dense products of an earlier call still waiting in this thread's launch queue
    (`_bound_in_flight`) are dropped from it: whatever uses them holds them itself.
    """
    _queued()[1].clear()
    if type(model).__module__ in _HEAD_KNOWN:
        h = model.model(inputs, cache)[:, position, :]
        if model.args.tie_word_embeddings:
            return model.model.embed_tokens.as_linear(h)
        return model.lm_head(h)
    return model(inputs, cache=cache)[:, position, :]
