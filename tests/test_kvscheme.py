"""KV schemes: the rotation keeps attention exact, merging stays bit-exact, files record the scheme.

Tolerances: float32 throughout; attention through a rotated cache must equal plain
attention over the same stored (dequantized, rotated back) keys and values within
1e-5, since only the order of float operations differs. On CUDA, float32 matmuls run
as TF32 (10-bit mantissas), so there the bound is 2e-3, and the "quantized" route,
which cannot decode on CUDA, is left out.
"""

import json

import mlx.core as mx
import pytest

from runtime import attention, store
from runtime.kvscheme import DEFAULT, KVScheme, KVSchemeError, from_options, hadamard, parse, plain, rotate
from runtime.model import ModelCacheSpec
from runtime.q4cache import BatchQuantizedKVCache, Q4CacheError, scheme_of

CUDA = mx.default_device() == mx.gpu and mx.cuda.is_available()
ATOL = 2e-3 if CUDA else 1e-5
ROUTES = ["dequant", "dequant_once"] if CUDA else ["quantized", "dequant", "dequant_once"]


@pytest.fixture(autouse=True, scope="module")
def attention_installed():
    attention.install()  # these tests drive batch caches without an Engine


def normal(shape, seed):
    return mx.random.normal(shape, key=mx.random.key(seed))


def test_names_round_trip_and_bad_ones_are_refused():
    for name in ("k6v4-g64-hadamard", "k4v4-g64", "k8v8-g32", "k5v3-g128-hadamard"):
        assert parse(name).name == name
    assert DEFAULT == parse("k6v4-g64-hadamard")
    for bad in ("k7v4-g64", "k4v4-g48", "k4v4-g64-fourier", "q4", "", None):
        with pytest.raises(KVSchemeError):
            parse(bad)
    assert plain(8, 32) == KVScheme(8, 8, 32, "none")


def test_runtime_options_pick_one_scheme_or_refuse():
    assert from_options() is None  # the model's default
    assert from_options(kv_bits=8) == plain(8, 64) and from_options(kv_group_size=32) == plain(4, 32)
    assert from_options(kv_scheme="k5v4-g32-hadamard") == KVScheme(5, 4, 32, "hadamard")
    with pytest.raises(KVSchemeError, match="not both"):
        from_options(kv_bits=4, kv_scheme="k4v4-g64")
    with pytest.raises(KVSchemeError):
        from_options(kv_bits=6)  # other widths only by scheme name
    with pytest.raises(TypeError):
        from_options(kv_scheme=4)
    with pytest.raises(TypeError):
        from_options(kv_bits=4.0)


def test_hadamard_is_orthonormal_and_keeps_dot_products():
    with mx.stream(mx.cpu):  # the arithmetic in full float32 (a CUDA float32 matmul is TF32)
        h = hadamard(64, mx.float32)
        assert mx.allclose(h @ h, mx.eye(64), atol=1e-6).item()  # symmetric and its own inverse
        q, k = normal((5, 64), 0), normal((7, 64), 1)
        assert mx.allclose(rotate(q, DEFAULT) @ rotate(k, DEFAULT).T, q @ k.T, atol=1e-4).item()
        assert rotate(q, plain(4, 64)) is q


def stored_attention(cache, queries, scale):
    """Plain attention over what `cache` stores, dequantized and rotated back: the reference."""
    s = cache.scheme
    keys, values = cache.keys_and_values()
    k = rotate(mx.dequantize(*keys, group_size=s.group_size, bits=s.key_bits), s)
    v = rotate(mx.dequantize(*values, group_size=s.group_size, bits=s.value_bits), s)
    return mx.fast.scaled_dot_product_attention(queries, k, v, scale=scale, mask="causal")


@pytest.mark.parametrize("route", ROUTES)
@pytest.mark.parametrize("scheme", ["k6v4-g64-hadamard", "k4v4-g32-hadamard", "k6v4-g64"])
def test_attention_through_a_rotated_cache_is_attention_over_what_it_stores(route, scheme):
    cache = BatchQuantizedKVCache([0], parse(scheme), route)
    scale = 64 ** -0.5
    for step, n in enumerate((37, 1, 1)):  # a prefill, then two decode steps
        keys, values = normal((1, 2, n, 64), 10 + step), normal((1, 2, n, 64), 20 + step)
        queries = normal((1, 4, n, 64), 30 + step)
        mask = cache.make_mask(n)  # before the update, as the model asks for it
        k, v = cache.update_and_fetch(keys, values)
        out = attention.sdpa(queries, k, v, scale, mask, cache.group_size, cache.bits)
        assert mx.allclose(out, stored_attention(cache, queries, scale), atol=ATOL).item()


def test_rotation_shrinks_the_error_of_outlier_channels():
    keys = normal((1, 2, 64, 64), 1) * mx.where(mx.arange(64) == 5, 20.0, 1.0)  # one outlier channel
    errors = {}
    for name in ("k4v4-g64", "k4v4-g64-hadamard"):
        cache = BatchQuantizedKVCache([0], parse(name), "dequant")
        cache.update_and_fetch(keys, keys)
        s = cache.scheme
        stored = rotate(mx.dequantize(*cache.keys_and_values()[0], group_size=64, bits=s.key_bits), s)
        errors[name] = mx.sqrt(mx.mean((stored - keys) ** 2)).item()
    assert errors["k4v4-g64-hadamard"] < 0.5 * errors["k4v4-g64"]


def agent_cache(scheme, T, seed):
    """One agent's layer as the engine hands it out: `T` random tokens through a batch of one, extracted."""
    batch = BatchQuantizedKVCache([0], scheme, "dequant")
    if T:
        batch.update_and_fetch(normal((1, 2, T, 64), seed), normal((1, 2, T, 64), seed + 1))
    return batch.extract(0)


def assert_same_packed(a, b):
    assert a.offset == b.offset and scheme_of(a) == scheme_of(b)
    for x, y in zip(a.keys + a.values, b.keys + b.values):
        assert x.dtype == y.dtype and x.shape == y.shape and mx.array_equal(x, y).item()


@pytest.mark.parametrize("scheme", ["k6v4-g64-hadamard", "k5v3-g32-hadamard"])
def test_merge_extract_filter_extend_stay_bit_exact_under_a_scheme(scheme):
    s = parse(scheme)
    rows = [agent_cache(s, T, seed) for seed, T in enumerate((5, 300, 64, 1))]
    assert rows[0].keys[0].shape[-1] == 64 * s.key_bits // 32 and rows[0].values[0].shape[-1] == 64 * s.value_bits // 32
    batch = BatchQuantizedKVCache.merge(rows, s, "dequant")
    for i, row in enumerate(rows):
        assert_same_packed(batch.extract(i), row)
    batch.filter([3, 1])
    batch.extend(BatchQuantizedKVCache.merge([rows[0]], s, "dequant"))
    for i, row in enumerate([rows[3], rows[1], rows[0]]):
        assert_same_packed(batch.extract(i), row)


def test_a_cache_of_another_scheme_is_never_merged():
    row = agent_cache(parse("k6v4-g64"), 8, 0)
    with pytest.raises(Q4CacheError, match="stored as k6v4-g64 into a k6v4-g64-hadamard batch"):
        BatchQuantizedKVCache.merge([row], DEFAULT, "dequant")
    with pytest.raises(Q4CacheError, match="extend"):
        BatchQuantizedKVCache([0], DEFAULT, "dequant").extend(BatchQuantizedKVCache([0], plain(4, 64), "dequant"))


def test_the_cuda_kernel_takes_4_or_6_bit_keys_and_4_bit_values_only():
    for name, expect in (("k4v4-g64-hadamard", True), ("k6v4-g64-hadamard", True), ("k8v4-g64", False),
                         ("k4v8-g64", False), ("k8v8-g64", False), ("k5v4-g32-hadamard", False)):
        for dtype in (mx.bfloat16, mx.float16, mx.float32):
            cache = BatchQuantizedKVCache([0], parse(name), "dequant")
            cache.update_and_fetch(normal((1, 2, 3, 64), 0).astype(dtype), normal((1, 2, 3, 64), 1).astype(dtype))
            cache.route = "q4kernel"  # the predicate alone; the kernel itself runs on CUDA only
            assert cache._kernel_decode(1) is (expect and dtype != mx.float32)  # it reads 16-bit queries


def spec_for(scheme):
    return ModelCacheSpec(model_id="m", fingerprint="fp-scheme", n_layers=2, n_kv_heads=2, k_head_dim=64,
                          v_head_dim=64, layer_kinds=("full", "full"), windows=(None, None), has_sinks=False,
                          dtype="float32").with_scheme(scheme)


def test_the_file_records_the_scheme_and_another_scheme_is_refused(tmp_path):
    spec = spec_for(DEFAULT)
    layers = [agent_cache(DEFAULT, 9, seed) for seed in (0, 2)]
    host = store.cache_to_host(layers)
    meta = store.CacheMeta(1, list(range(9)), list(range(1, 10)), "abcdefghi")
    path = store.save_cache(tmp_path, spec, "a", host, meta)
    header = json.loads(path.read_bytes()[8:8 + int.from_bytes(path.read_bytes()[:8], "little")])
    recorded = json.loads(header["__metadata__"]["meta"])
    assert (recorded["kv_bits"], recorded["kv_value_bits"], recorded["kv_group_size"], recorded["kv_rotation"]) == \
        (6, 4, 64, "hadamard")
    loaded, _ = store.load_cache(tmp_path, spec, "a")
    assert loaded.scheme == DEFAULT
    for got, want in zip(store.host_to_cache(loaded), layers):
        assert_same_packed(got, want)
    for other in ("k6v4-g64", "k4v4-g64", "k6v4-g32-hadamard"):
        with pytest.raises(store.QuantizationMismatch, match=f"stored as {DEFAULT.name}, the runtime uses {other}"):
            store.load_cache(tmp_path, spec_for(parse(other)), "a")


def test_a_model_with_attention_sinks_refuses_a_rotation():
    spec = spec_for(plain(4, 64))
    with pytest.raises(KVSchemeError, match="sinks"):
        parse("k6v4-g64-hadamard").check_model(64, 64, has_sinks=True)
    with pytest.raises(Q4CacheError, match="sinks"):
        BatchQuantizedKVCache([0], DEFAULT, "dequant", own_attention=False)
    assert spec.kv_scheme == plain(4, 64)


@pytest.mark.parametrize("dims, advice", [((96, 96), "k6v4-g32"), ((64, 64), None), ((128, 64), None),
                                          ((160, 160), "k6v4-g32"), ((80, 80), "no KV group size")])
def test_a_refused_head_dim_is_told_a_scheme_that_serves_it(dims, advice):
    """The advice of a refusal names a scheme that the same check accepts (a head dim that is no power of two
    loses the rotation as well as a group size), or says that none fits."""
    if advice is None:
        DEFAULT.check_model(*dims)
        return
    with pytest.raises(KVSchemeError) as refused:
        DEFAULT.check_model(*dims)
    assert advice in str(refused.value)
    if advice.startswith("k"):
        parse(advice).check_model(*dims)


def test_runtime_re_prefills_an_agent_stored_under_another_scheme(tmp_path):
    from runtime import Runtime

    with Runtime(model=None, cache_dir=tmp_path, kv_bits=4) as rt:
        first = rt.spawn("alice", system="You are Alice.").ask("Hello.", max_tokens=4)
    assert rt.spec.kv_scheme == plain(4, 64)
    with Runtime(model=None, cache_dir=tmp_path) as rt:  # the default scheme: the stored cache does not fit
        again = rt.spawn("alice", system="You are Alice.").ask("Hello again.", max_tokens=4)
        rt.flush()  # the cache file follows the ack
        host, _ = store.load_cache(tmp_path, rt.spec, "alice")
    assert rt.spec.kv_scheme == DEFAULT and host.scheme == DEFAULT
    assert first.cache == "cold" and again.cache == "cold"  # re-prefilled from the journal, nothing lost
    with Runtime(model=None, cache_dir=tmp_path) as rt:
        third = rt.spawn("alice", system="You are Alice.").ask("And again.", max_tokens=4)
    assert third.cache == "warm"
    with pytest.raises(ValueError, match="k7v4"):
        Runtime(model=None, cache_dir=tmp_path / "x", kv_scheme="k7v4-g64")


def test_the_cuda_packer_serves_16_bit_keys_and_values_of_one_shape_only():
    from runtime import q4pack

    def arrays(shape, dtype, vshape=None, vdtype=None):
        return mx.zeros(shape, dtype), mx.zeros(vshape or shape, vdtype or dtype)

    assert q4pack.serves(DEFAULT, *arrays((2, 8, 1, 128), mx.bfloat16))
    assert q4pack.serves(parse("k8v8-g32"), *arrays((2, 8, 5, 64), mx.float16))
    assert not q4pack.serves(DEFAULT, *arrays((2, 8, 1, 128), mx.float32))  # the kernel reads 16-bit inputs
    assert not q4pack.serves(DEFAULT, *arrays((2, 8, 1, 96), mx.bfloat16))  # head dims 64 and 128 only
    assert not q4pack.serves(parse("k5v4-g64"), *arrays((2, 8, 1, 128), mx.bfloat16))  # 4, 6 or 8 bits
    assert not q4pack.serves(parse("k4v4-g128"), *arrays((2, 8, 1, 64), mx.bfloat16))  # a group past the head
    assert not q4pack.serves(DEFAULT, *arrays((2, 8, 1, 128), mx.bfloat16, (2, 8, 1, 64)))
    assert not q4pack.serves(DEFAULT, *arrays((2, 8, 1, 128), mx.bfloat16, None, mx.float16))
    assert not q4pack.serves(DEFAULT, *arrays((8, 1, 128), mx.bfloat16))  # (B, H, N, D): the kernel's layout
