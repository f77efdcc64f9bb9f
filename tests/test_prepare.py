"""Model preparation: flattened quantized linears compute exactly what the model did."""

import mlx.core as mx
import mlx.nn as nn
import mlx_lm
import pytest

from runtime import qgemv
from runtime.prepare import FlatQuantizedLinear, last_logits, prepare_model


def bf16_llama(tiny_model_path, group: int):
    """A fresh copy of the tiny llama in bfloat16 with 4-bit weights of `group` (not yet prepared): CUDA's
    kernels take 16-bit inputs only."""
    model, _ = mlx_lm.load(str(tiny_model_path("llama")))  # its own copy: it gets changed
    model.set_dtype(mx.bfloat16)
    nn.quantize(model, group_size=group, bits=4)
    return model


def test_flattened_linears_give_the_same_logits(tiny_model_path):
    model, _ = mlx_lm.load(str(tiny_model_path("llama")))  # its own copy: it gets changed
    nn.quantize(model, group_size=32, bits=4)
    tokens = mx.array([[5, 9, 13], [7, 2, 11]])
    before = model(tokens)
    if not qgemv.available():
        assert prepare_model(model) == 0  # off CUDA nothing changes unless forced
    changed = prepare_model(model, force=True, gemv=False)
    assert changed > 0 and isinstance(model.layers[0].self_attn.q_proj, FlatQuantizedLinear)
    assert prepare_model(model, force=True, gemv=False) == changed  # idempotent
    assert mx.array_equal(model(tokens), before).item()
    assert mx.array_equal(model(tokens[:, :1]), before[:, :1]).item()
    assert "_kvactors_gemv" not in dict(model.layers[0].self_attn.q_proj)  # not a parameter


def test_last_logits_are_the_models_logits_at_one_position(tiny_model_path):
    from mlx_lm.models.cache import make_prompt_cache


    for arch in ("llama", "qwen2", "gemma3_text"):
        model, _ = mlx_lm.load(str(tiny_model_path(arch)))
        tokens = mx.array([[5, 9, 13, 2, 7]])
        want_cache, got_cache = make_prompt_cache(model), make_prompt_cache(model)
        want = model(tokens, cache=want_cache)[:, 3, :]
        got = last_logits(model, tokens, got_cache, 3)
        assert got.shape == want.shape
        tol = 5e-3 if qgemv.available() else 1e-4  # float32 matmuls run as TF32 on CUDA
        assert mx.allclose(got, want, atol=tol, rtol=tol).item(), arch
        for a, b in zip(want_cache, got_cache):  # the cache took every position either way
            assert a.offset == b.offset == 5 and mx.array_equal(a.state[0], b.state[0]).item()


def test_prefill_sized_inputs_multiply_the_dequantized_weight(tiny_model_path, monkeypatch):
    from runtime import prepare

    model, _ = mlx_lm.load(str(tiny_model_path("llama")))
    nn.quantize(model, group_size=32, bits=4)
    tokens = mx.random.randint(3, 500, (1, prepare.DENSE_ROWS), key=mx.random.key(1))
    long_before, short_before = model(tokens), model(tokens[:, :8])
    prepare_model(model, force=True, gemv=False, dense=True)
    calls = []
    dequantize = mx.dequantize
    monkeypatch.setattr(prepare.mx, "dequantize", lambda *a, **k: calls.append(a[0].shape) or dequantize(*a, **k))
    linears = sum(isinstance(m, FlatQuantizedLinear) for m in model.modules())
    long_after = model(tokens)
    # every linear multiplied a dequantized weight, and so did the tied output head;
    # the embedding's lookup dequantizes its rows as always
    assert len(calls) == linears + 2
    # ...the same weights: float32 GEMMs run on TF32 tensor cores on CUDA (10-bit mantissas), hence its tolerance
    tol = 2e-2 if qgemv.available() else 1e-3
    assert mx.allclose(long_after, long_before, atol=tol, rtol=tol).item()
    calls.clear()
    assert mx.array_equal(model(tokens[:, :8]), short_before).item()
    assert len(calls) == 1  # short inputs: the quantized kernel (only the lookup dequantizes)



def test_dense_products_launch_in_groups_and_each_thread_keeps_its_own_queue(tiny_model_path):
    """Prefill-sized products are launched DENSE_LAUNCH at a time, at most DENSE_IN_FLIGHT stay queued, and
    products a thread built but did not launch never reach another thread (MLX evaluates a lazy array only
    on the thread that built it): a second thread's prefill runs and gives the same logits."""
    import threading

    from runtime import prepare

    model, _ = mlx_lm.load(str(tiny_model_path("llama")))
    nn.quantize(model, group_size=32, bits=4)
    prepare_model(model, force=True, gemv=False, dense=True)
    tokens = mx.random.randint(3, 500, (1, prepare.DENSE_ROWS), key=mx.random.key(1))
    for queue in prepare._queued():  # what earlier tests on this thread left
        queue.clear()
    linears = sum(isinstance(m, FlatQuantizedLinear) for m in model.modules())
    products = linears + 1  # and the tied output head
    logits = model(tokens)
    launched, built = prepare._queued()
    assert len(built) == products % prepare.DENSE_LAUNCH
    assert len(launched) == min(prepare.DENSE_IN_FLIGHT, products - len(built))
    other = {}  # (logits stays lazy here: the output head's product waits in this thread's queue)

    def prefill():
        try:
            other["logits"] = model(tokens)
            mx.eval(other["logits"])
            other["queue"] = tuple(len(q) for q in prepare._queued())
        except Exception as e:  # pragma: no cover - the failure this test is for
            other["error"] = e

    thread = threading.Thread(target=prefill)
    thread.start()
    thread.join()
    mx.eval(logits)
    assert "error" not in other, other.get("error")
    assert mx.array_equal(other["logits"], logits).item()
    assert other["queue"] == (len(launched), len(built))
    last_logits(model, tokens, None, 0)  # one position through the head: not a dense product
    assert len(prepare._queued()[1]) == linears % prepare.DENSE_LAUNCH  # this call's; the earlier ones dropped

def test_compiled_mlps_give_bitwise_the_same_decode_and_prefill(tiny_model_path):
    from mlx_lm.models.cache import make_prompt_cache

    from runtime.prepare import compile_mlps

    model = bf16_llama(tiny_model_path, 32)
    prepare_model(model, force=True, gemv=False, compile_decode=False)
    prompt = mx.arange(24).reshape(2, 12) % 17 + 3  # 24 rows: more than a decode step has
    steps = [mx.array([[3], [6]]), mx.array([[1], [12]])]

    def run():
        cache = make_prompt_cache(model)
        return [model(prompt, cache=cache)] + [model(t, cache=cache) for t in steps]

    before = run()
    mlp_class = type(model.layers[0].mlp)
    assert compile_mlps(model) == len(model.layers)
    assert type(model.layers[0].mlp) is not mlp_class and isinstance(model.layers[0].mlp, mlp_class)
    assert compile_mlps(model) == len(model.layers)  # idempotent: no second subclass
    assert type(model.layers[0].mlp).__mro__[1] is mlp_class
    after = run()  # the prompt takes the model's own path; the steps (2 rows) the compiled one
    assert all(mx.array_equal(a, b).item() for a, b in zip(before, after))
    assert "_kvactors_compiled" not in dict(model.layers[0].mlp)  # not a parameter


@pytest.mark.parametrize("route", ["dequant", "dequant_once",
                                   pytest.param("quantized", marks=pytest.mark.skipif(qgemv.available(),
                                                                                      reason="refused on CUDA")),
                                   pytest.param("q4kernel", marks=pytest.mark.skipif(not qgemv.available(),
                                                                                     reason="CUDA only"))])
def test_compiled_blocks_give_bitwise_the_same_decode_steps(tiny_model_path, route, monkeypatch):
    """Ragged rows in an engine batch cache: a llama block compiled around the cache prefills a short chunk
    and decodes bitwise as mlx-lm's
    (on CUDA with the GEMV kernel, the packing kernel and, for "q4kernel", the decode-attention kernel inside).
    On CUDA the fused q/k/v and gate/up launches may change last bits: there the logits are compared within
    bf16's precision, and bitwise with the fusion turned off."""
    from runtime import attention, prepare
    from runtime.model import ModelCacheSpec
    from runtime.prepare import CompiledBlock, compile_blocks
    from runtime.q4cache import extract_cache, merge_caches

    monkeypatch.setattr(prepare, "FUSE_ROPE", True)
    model = bf16_llama(tiny_model_path, 32)
    prepare_model(model, force=True, gemv=qgemv.available(), compile_decode=False)
    spec = ModelCacheSpec.from_model(model, tiny_model_path("llama"))
    attention.install()
    prompts = [mx.arange(11)[None] % 17 + 3, mx.arange(5)[None] % 13 + 2]  # unequal: the batch is left-padded
    chunk = mx.arange(12).reshape(2, 6) % 11 + 4  # a hot chunk of 6 tokens a row
    steps = [mx.array([[3], [6]]), mx.array([[1], [12]]), mx.array([[7], [7]])]

    def run():
        rows = []
        for p in prompts:
            cache = merge_caches(spec, [None], route)
            mx.eval(model(p, cache=cache))
            rows.append(extract_cache(cache, 0))
        batch = merge_caches(spec, rows, route)
        return [model(chunk, cache=batch)] + [model(t, cache=batch) for t in steps]

    before = run()
    assert compile_blocks(model) == len(model.layers) and compile_blocks(model) == len(model.layers)  # idempotent
    assert all(type(layer) is CompiledBlock for layer in model.layers)
    after = run()
    assert "_kvactors_graphs" in model.layers[0].__dict__  # the steps took the compiled path
    # on the kernel route, keys and queries reach the kernels unrotated (RoPE inside them)
    fused_rope = isinstance(model.layers[0].self_attn.rope.__dict__.get("_kvactors_inv_freq"), mx.array)
    assert fused_rope == (route == "q4kernel")
    if qgemv.available():
        for a, b in zip(before, after):
            a, b = a.astype(mx.float32), b.astype(mx.float32)
            assert (mx.abs(a - b).max() / mx.abs(a).max()).item() < 2e-2
        monkeypatch.setattr(prepare, "_fused", lambda modules, x: False)
        monkeypatch.setattr(prepare, "FUSE_ROPE", False)
        for layer in model.layers:
            del layer.__dict__["_kvactors_graphs"]  # record the graphs again, unfused
        after = run()
    assert all(mx.array_equal(a, b).item() for a, b in zip(before, after))
    assert "_kvactors_graphs" not in dict(model.layers[0])  # not a parameter


def test_a_short_chunk_through_compiled_blocks_is_launched_every_chunk_launch_blocks_with_the_same_bits(
        tiny_model_path, monkeypatch):
    """A short chunk's forward through compiled blocks is queued for the device (`mx.async_eval`) after every
    CHUNK_LAUNCH-th block, so that the device starts while the host builds the rest; its logits and cache are
    bitwise those of a forward launched at its end. Decode steps (one token a row) launch nothing inside."""
    from mlx.utils import tree_flatten

    from runtime import attention, prepare
    from runtime.model import ModelCacheSpec
    from runtime.prepare import compile_blocks
    from runtime.q4cache import merge_caches

    model = bf16_llama(tiny_model_path, 32)
    prepare_model(model, force=True, gemv=qgemv.available(), compile_decode=False)
    compile_blocks(model)
    spec = ModelCacheSpec.from_model(model, tiny_model_path("llama"))
    attention.install()
    route = "q4kernel" if qgemv.available() else "quantized"
    chunk = mx.arange(14).reshape(2, 7) % 11 + 4
    launches = []
    launch = mx.async_eval
    monkeypatch.setattr(prepare.mx, "async_eval", lambda *a: launches.append(len(a)) or launch(*a))

    def forward(every, tokens):
        monkeypatch.setattr(prepare, "CHUNK_LAUNCH", every)
        cache = merge_caches(spec, [None, None], route)
        launches.clear()
        out = model(tokens, cache=cache)
        counted = len(launches)
        mx.eval(out, [c.state for c in cache])
        return out, [c.state for c in cache], counted

    n = len(model.layers)
    plain, plain_state, none = forward(n + 1, chunk)
    assert none == 0
    for every in (1, 2):
        out, state, counted = forward(every, chunk)
        assert counted == n // every
        assert mx.array_equal(out, plain).item()
        pairs = zip(tree_flatten(state), tree_flatten(plain_state))
        assert all(mx.array_equal(a, b).item() for (_, a), (_, b) in pairs)
    assert forward(1, chunk[:, :1])[2] == 0  # a decode-sized forward launches nothing inside


def test_the_gemv_launch_follows_the_weight_shape_alone_and_refuses_what_it_cannot_read():
    """`qgemv.setting` (which fixes a row's summation order) sees only (N, K); layers the kernel cannot read
    are routed to MLX's matmul, and a direct call with them says why (checked before any launch)."""
    for n, k in [(96, 1536), (1024, 4096), (4096, 4096), (14336, 4096), (4096, 14336), (128256, 4096), (49152, 576)]:
        tn, split, kl = qgemv.setting(n, k)
        assert kl == (32 if k % 128 == 0 else 16)  # 16-byte loads where K allows them
        assert (tn, split) == (1, min(qgemv.MAX_SPLIT, k // (4 * kl)))
        assert qgemv.setting(n, k, 2) == (2, min(qgemv.MAX_SPLIT, k // 64), 16)  # gate/up: two tiles, 8-byte loads
    assert qgemv.supports_weights(4, 64, "affine", True, 576) and not qgemv.supports_weights(4, 32, "affine", True, 608)
    assert not qgemv.supports_weights(8, 64, "affine", True, 4096) and not qgemv.supports_weights(4, 64, "mxfp4", True, 4096)
    w, s, b = mx.quantize(mx.zeros((64, 96)), group_size=32, bits=4)
    with pytest.raises(ValueError, match="multiple of 64"):
        qgemv.qgemv(mx.zeros((2, 96), dtype=mx.bfloat16), w, s.astype(mx.bfloat16), b.astype(mx.bfloat16), 32)
    w, s, b = mx.quantize(mx.zeros((64, 128)), group_size=64, bits=4)
    with pytest.raises(ValueError, match="of one type"):  # float16 scales under bfloat16 inputs
        qgemv.qgemv(mx.zeros((2, 128), dtype=mx.bfloat16), w, s.astype(mx.float16), b.astype(mx.float16), 64)
    s, b = s.astype(mx.bfloat16), b.astype(mx.bfloat16)
    with pytest.raises(ValueError, match="1 to 16 rows"):
        qgemv.qgemv(mx.zeros((17, 128), dtype=mx.bfloat16), w, s, b, 64)
    with pytest.raises(ValueError, match="output shapes"):  # the kernel would write past a shape this small
        qgemv.qgemv_parts(mx.zeros((2, 128), dtype=mx.bfloat16), [(w, s, b)], 64, [(2, 32)])
    with pytest.raises(ValueError, match="of one shape"):
        qgemv.qgemv_swiglu(mx.zeros((2, 128), dtype=mx.bfloat16), (w, s, b), (w[:32], s[:32], b[:32]), 64)
    x = mx.zeros((2, 128), dtype=mx.bfloat16)
    with pytest.raises(ValueError, match="result's shape"):  # a residual the kernel would read past
        qgemv.qgemv(x, w, s, b, 64, add=mx.zeros((2, 32), dtype=mx.bfloat16))


def test_pack_kv_into_refuses_buffers_and_columns_it_cannot_write():
    """Checked before any launch: the kernel writes in place, so a wrong buffer would be corrupted, not copied."""
    from runtime import q4pack
    from runtime.kvscheme import parse

    scheme = parse("k6v4-g64-hadamard")
    k = v = mx.zeros((2, 8, 1, 128), dtype=mx.bfloat16)

    def buffers(w, bits, dtype=mx.bfloat16, rows=2):
        return (mx.zeros((rows, 8, w, 128 * bits // 32), mx.uint32), mx.zeros((rows, 8, w, 2), dtype),
                mx.zeros((rows, 8, w, 2), dtype))

    with pytest.raises(ValueError, match="columns"):
        q4pack.pack_kv_into(k, v, scheme, buffers(256, 6), buffers(256, 4), 257)
    with pytest.raises(ValueError, match="columns"):
        q4pack.pack_kv_into(k, v, scheme, buffers(256, 6), buffers(256, 4), 0)
    with pytest.raises(ValueError, match="key buffers"):  # 4-bit words where the scheme keeps 6-bit keys
        q4pack.pack_kv_into(k, v, scheme, buffers(256, 4), buffers(256, 4), 10)
    with pytest.raises(ValueError, match="value buffers"):  # another batch size
        q4pack.pack_kv_into(k, v, scheme, buffers(256, 6), buffers(256, 4, rows=3), 10)
    with pytest.raises(ValueError, match="value buffers"):  # scales in another dtype
        q4pack.pack_kv_into(k, v, scheme, buffers(256, 6), buffers(256, 4, mx.float16), 10)


def test_rope_frequencies_are_read_from_the_module_and_only_for_a_rotation_the_kernels_compute():
    """The fused RoPE asks the model's own module where it puts a unit vector: plain and Llama 3 RoPE give their
    inverse frequencies; a traditional (interleaved) or scaling one gives None and keeps MLX's kernel."""
    import math

    import numpy as np
    from mlx_lm.models.rope_utils import SuScaledRoPE, initialize_rope

    from runtime.prepare import rope_frequencies

    plain = nn.RoPE(64, base=10000.0)
    want = np.array([10000.0 ** (-i / 32) for i in range(32)])
    assert np.allclose(np.array(rope_frequencies(plain, 64)), want, rtol=1e-6)
    llama3 = initialize_rope(128, 500000.0, False, {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                                    "high_freq_factor": 4.0,
                                                    "original_max_position_embeddings": 8192}, 131072)
    got = np.array(rope_frequencies(llama3, 128))
    assert np.allclose(got, 1 / np.array(llama3._freqs), rtol=1e-6) and got[-1] < want[-1] * 0.2  # scaled down
    assert rope_frequencies(nn.RoPE(64, traditional=True), 64) is None
    assert rope_frequencies(nn.RoPE(32), 64) is None  # half the head only
    scaled = SuScaledRoPE(64, max_position_embeddings=131072, original_max_position_embeddings=4096)
    assert not math.isclose(scaled._scale, 1.0) and rope_frequencies(scaled, 64) is None
    assert rope_frequencies(plain, 64) is rope_frequencies(plain, 64)  # found once


@pytest.mark.skipif(not qgemv.available(), reason="CUDA only")
@pytest.mark.parametrize("n", [5, 64, 300])
def test_a_hot_chunk_attends_on_the_packed_cache_as_the_dequantized_route_does(tiny_model_path, n, monkeypatch):
    """On the "q4kernel" route a short prefill chunk after a history runs the attention kernel on the packed
    cache (no 16-bit copy): its logits match the "dequant" route's within bf16's precision, rows of unequal
    histories batched (left padding) as each alone."""
    from runtime import attention, q4sdpa
    from runtime.model import ModelCacheSpec
    from runtime.q4cache import extract_cache, merge_caches

    model = bf16_llama(tiny_model_path, 32)
    prepare_model(model, force=True)
    spec = ModelCacheSpec.from_model(model, tiny_model_path("llama"))
    attention.install()
    histories = []
    for length in (700, 130):
        cache = merge_caches(spec, [None], "dequant")
        mx.eval(model(mx.arange(length)[None] % 31 + 3, cache=cache))
        histories.append(extract_cache(cache, 0))
    chunk = mx.arange(2 * n).reshape(2, n) % 23 + 2
    served = []
    kernel = q4sdpa.q4_decode_sdpa
    monkeypatch.setattr(q4sdpa, "q4_decode_sdpa", lambda q, *a, **k: served.append(q.shape[2]) or kernel(q, *a, **k))

    def hot(route, rows):
        return model(chunk[rows], cache=merge_caches(spec, [histories[i] for i in rows], route))

    for rows in ([0], [1], [0, 1]):
        want = hot("dequant", rows).astype(mx.float32)
        assert not served
        got = hot("q4kernel", rows).astype(mx.float32)
        assert served and set(served) == {n}
        served.clear()
        assert (mx.abs(got - want).max() / mx.abs(want).max()).item() < 2e-2
        if len(rows) == 2:
            for i in rows:  # each row of the batch as alone
                alone = hot("q4kernel", [i]).astype(mx.float32)
                assert (mx.abs(got[i] - alone[0]).max() / mx.abs(alone[0]).max()).item() < 2e-2


@pytest.mark.skipif(not qgemv.available(), reason="CUDA only")
def test_a_chunk_between_decode_and_dense_sizes_multiplies_through_qgemm(tiny_model_path, monkeypatch):
    """Inputs of more than qgemv.MAX_ROWS and fewer than DENSE_ROWS rows (a hot turn's chunk) go through
    `qgemm` in every 4-bit linear, with logits as the model's own quantized matmuls give them (bf16)."""
    from runtime import qgemm

    model = bf16_llama(tiny_model_path, 64)
    tokens = mx.random.randint(3, 500, (2, 40), key=mx.random.key(3))
    want = model(tokens).astype(mx.float32)
    prepare_model(model, compile_decode=False)
    served = []
    gemm = qgemm.qgemm
    monkeypatch.setattr(qgemm, "qgemm", lambda x, *a: served.append(x.shape) or gemm(x, *a))
    got = model(tokens).astype(mx.float32)
    linears = sum(isinstance(m, FlatQuantizedLinear) for m in model.modules())
    assert len(served) == linears + 1 and {s[0] for s in served} == {80}  # and the tied output head
    assert (mx.abs(got - want).max() / mx.abs(want).max()).item() < 2e-2
    served.clear()
    model(tokens[:, :8])  # 16 rows: the decode-sized GEMV
    assert not served


@pytest.mark.skipif(not qgemv.available(), reason="CUDA only")
def test_a_compiled_block_runs_a_short_chunks_qkv_and_gate_up_as_one_launch_each(tiny_model_path, monkeypatch):
    """In a compiled llama block, a chunk of qgemm's size takes q/k/v through one `qgemm_parts` launch, written in
    the heads' layout, and gate/up with their SiLU product through another (`qgemm_swiglu`), the output and down
    projections add their residuals in their own launches, and attention writes its output as the output
    projection takes it (`flat`), with logits as the uncompiled blocks' separate products give them (bf16)."""
    from runtime import attention, q4sdpa, qgemm
    from runtime.model import ModelCacheSpec
    from runtime.q4cache import merge_caches

    model = bf16_llama(tiny_model_path, 64)
    prepare_model(model, compile_decode=False)
    spec = ModelCacheSpec.from_model(model, tiny_model_path("llama"))
    attention.install()
    tokens = mx.random.randint(3, 500, (2, 40), key=mx.random.key(6))
    want = model(tokens, cache=merge_caches(spec, [None, None], "q4kernel")).astype(mx.float32)
    prepare_model(model)  # now with the compiled blocks
    calls, added, flat = [], [], []
    parts, single, gated, attend = qgemm.qgemm_parts, qgemm.qgemm, qgemm.qgemm_swiglu, q4sdpa.q4_decode_sdpa
    monkeypatch.setattr(qgemm, "qgemm_parts",
                        lambda x, w, g, **kw: calls.append((len(w), kw.get("head_dim", 0))) or parts(x, w, g, **kw))
    monkeypatch.setattr(qgemm, "qgemm", lambda x, *a, **kw: added.append("add" in kw) or single(x, *a, **kw))
    monkeypatch.setattr(qgemm, "qgemm_swiglu", lambda *a: calls.append("swiglu") or gated(*a))
    monkeypatch.setattr(q4sdpa, "q4_decode_sdpa", lambda *a, **kw: flat.append(kw.get("flat")) or attend(*a, **kw))
    # a chunk into a cache that holds tokens, as a hot turn's: attention on the packed cache (the kernel route)
    cache = merge_caches(spec, [None, None], "q4kernel")
    model(tokens[:, :24], cache=cache)
    calls.clear(), added.clear(), flat.clear()
    got = model(tokens[:, 24:], cache=cache).astype(mx.float32)
    head_dim = model.layers[0].self_attn.head_dim
    assert calls.count((3, head_dim)) == calls.count("swiglu") == len(model.layers)  # (and qgemm's own, one weight)
    assert calls.count((2, 0)) == 0 and flat == [True] * len(model.layers)
    assert added.count(True) == 2 * len(model.layers)  # the output and down projections, with their residuals
    want = want[:, 24:]
    assert (mx.abs(got - want).max() / mx.abs(want).max()).item() < 2e-2


def test_float_expert_layers_are_mended_and_compute_the_same(tiny_model_path):
    from mlx_lm.models.switch_layers import SwitchLinear

    from runtime.prepare import RowStridedSwitchLinear

    model, _ = mlx_lm.load(str(tiny_model_path("gpt_oss")))  # its own copy: it gets changed
    tokens = mx.random.randint(3, 500, (1, 40), key=mx.random.key(2))  # 80 expert rows: the sorted path
    before = model(tokens)
    experts = [m for m in model.modules() if type(m) is SwitchLinear]
    assert prepare_model(model, force=True, gemv=False, compile_decode=False) == len(experts) > 0
    assert all(type(m) is RowStridedSwitchLinear for m in experts)
    assert prepare_model(model, force=True, gemv=False, compile_decode=False) == len(experts)  # idempotent
    if not qgemv.available():  # on CUDA `before` went through MLX's misread (see the test below)
        assert mx.array_equal(model(tokens), before).item()


@pytest.mark.skipif(not qgemv.available(), reason="CUDA only")
def test_a_mended_expert_layer_reads_an_expand_dims_view_right():
    # MLX-CUDA 0.32.4's sorted gather_mm steps between rows by the singleton axis's stride, 1 for this view
    from mlx_lm.models.switch_layers import SwitchLinear

    from runtime.prepare import RowStridedSwitchLinear

    mx.random.seed(3)
    layer = SwitchLinear(64, 96, num_experts=4, bias=True)
    y = mx.random.normal((200, 64))
    idx = mx.sort(mx.random.randint(0, 4, (200,)).astype(mx.uint32))
    layer.__class__ = RowStridedSwitchLinear
    got = layer(mx.expand_dims(y, -2), idx, sorted_indices=True)[:, 0]
    w, b = layer["weight"], layer["bias"]
    want = mx.stack([y[i] @ w[e].T + b[e] for i, e in enumerate(idx.tolist())])
    assert mx.allclose(got, want, atol=1e-4, rtol=1e-4).item()


def test_decode_graphs_recorded_ahead_serve_the_steps_of_those_batch_sizes(tiny_model_path, monkeypatch):
    """`record_decode` traces each compiled block's decode graphs for the given batch sizes without running
    them, with the inputs a decode step passes: a step at a recorded size then runs no Python of the block
    (`mx.compile` found its graph), and one at another size records its own (the spy sees it)."""
    from runtime import attention
    from runtime.model import ModelCacheSpec
    from runtime.prepare import CompiledBlock, compile_blocks, record_decode
    from runtime.q4cache import extract_cache, merge_caches

    calls = []
    for name in ("_before_cache", "_after_cache"):
        original = getattr(CompiledBlock, name)
        monkeypatch.setattr(CompiledBlock, name,
                            lambda self, *a, _f=original, _n=name: calls.append(_n) or _f(self, *a))
    model = bf16_llama(tiny_model_path, 32)
    prepare_model(model, force=True, gemv=qgemv.available(), compile_decode=False)
    compile_blocks(model)
    spec = ModelCacheSpec.from_model(model, tiny_model_path("llama"))
    attention.install()
    layers = len(model.layers)
    assert record_decode(model, [1, 2]) == 2 * layers
    assert len(calls) == 2 * 2 * layers  # each block's two graphs, once per batch size
    assert record_decode(model, [2]) == layers and len(calls) == 4 * layers  # recorded already: no new trace

    def decode(rows):
        prompts = [mx.arange(5 + 2 * i)[None] % 13 + 2 for i in range(rows)]
        caches = []
        for p in prompts:
            cache = merge_caches(spec, [None])
            mx.eval(model(p, cache=cache))
            caches.append(extract_cache(cache, 0))
        batch = merge_caches(spec, caches)
        before = len(calls)
        mx.eval(model(mx.arange(rows)[:, None] + 3, cache=batch))
        return len(calls) - before

    assert decode(2) == 0  # the recorded graphs served the step
    assert decode(3) == 2 * layers  # a size not recorded is traced at its first step


def test_decode_graphs_are_not_recorded_for_batches_the_block_runs_uncompiled(tiny_model_path):
    """A decode step of DENSE_ROWS rows or more runs the block's own path, whose dense products launch inside
    (`mx.async_eval`, refused inside a trace): `record_decode` leaves such sizes out instead of failing the
    batcher's start (a Runtime with max_batch >= 256)."""
    from runtime.prepare import DENSE_ROWS, compile_blocks, record_decode

    model = bf16_llama(tiny_model_path, 32)
    prepare_model(model, force=True, gemv=False, dense=True, compile_decode=False)
    compile_blocks(model)
    assert record_decode(model, [1, DENSE_ROWS - 1, DENSE_ROWS, DENSE_ROWS + 1]) == 2 * len(model.layers)


def test_every_cuda_kernel_is_named_by_its_source(monkeypatch):
    """MLX-CUDA keeps compiled kernels on disk by name and template and loads them again without looking at the
    source: each kernel's name carries a digest of its header and source, so a changed kernel is compiled anew,
    and every kernel of the package is made through that one function."""
    from pathlib import Path

    import runtime

    made = []
    monkeypatch.setattr(mx.fast, "cuda_kernel", lambda **kw: made.append(kw) or kw)
    qgemv.cuda_kernel("k", ["x"], ["y"], "y[0] = x[0];")
    qgemv.cuda_kernel("k", ["x"], ["y"], "y[0] = x[0];")
    qgemv.cuda_kernel("k", ["x"], ["y"], "y[0] = 2 * x[0];")
    qgemv.cuda_kernel("k", ["x"], ["y"], "y[0] = x[0];", header="#define A 1\n", ensure_row_contiguous=False)
    names = [kw["name"] for kw in made]
    assert names[0] == names[1] and len({names[0], names[2], names[3]}) == 3
    assert all(n.startswith("k_") and len(n) == 10 and n[2:].isdigit() for n in names)
    assert made[3]["header"] == "#define A 1\n" and made[3]["ensure_row_contiguous"] is False
    assert made[0]["ensure_row_contiguous"] is True and made[0]["source"] == "y[0] = x[0];"
    package = Path(runtime.__file__).parent
    direct = [p.name for p in package.rglob("*.py") if "mx.fast.cuda_kernel(" in p.read_text() and p.name != "qgemv.py"]
    assert direct == []
