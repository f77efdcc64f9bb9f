"""BatchQuantizedKVCache: exact merge/extract, batched == solo, filter/extend, size, routes.

Tolerance for batched-vs-solo logits: 1e-5 absolute on float32 tiny models. The
batch only adds masked, left-padded columns; the masked scores get zero weight,
so the math is the same and only the order of float reductions could differ.
Greedy tokens must be identical.
"""

import threading

import mlx.core as mx
import pytest
from mlx_lm.models.cache import KVCache, QuantizedKVCache

from runtime import attention
from runtime.kvscheme import KVScheme, plain
from runtime.model import ModelCacheSpec
from runtime.qgemv import available as on_cuda
from runtime.q4cache import (
    ROUTES,
    SLIDING_SLACK,
    STEP,
    BatchQuantizedKVCache,
    HeldRow,
    Q4CacheError,
    can_trim,
    can_trim_held,
    default_route,
    extend_cache,
    extract_cache,
    filter_cache,
    make_batch_cache,
    merge_caches,
    queue_rows,
    reserve_cache,
    route_for,
    row_arrays,
)

ARCHS = ["llama", "qwen2", "gemma3_text", "gpt_oss"]
ATOL = 1e-5


@pytest.fixture(autouse=True, scope="module")
def attention_installed():
    attention.install()  # these tests drive batch caches without an Engine


def test_a_batch_cache_refuses_to_be_built_before_attention_is_installed(monkeypatch):
    from mlx_lm.models import base

    monkeypatch.setattr(base, "quantized_scaled_dot_product_attention", lambda *a, **k: None)  # as mlx-lm ships
    with pytest.raises(Q4CacheError, match="attention.install"):
        BatchQuantizedKVCache([0], route="dequant")
    BatchQuantizedKVCache([0], route="dequant", own_attention=False)  # sinks models attend by themselves


def random_q4(T, heads=2, dim=64, dtype=mx.float32, seed=0):
    """A QuantizedKVCache of T random tokens, exactly T long."""
    c = QuantizedKVCache(group_size=64, bits=4)
    if T == 0:
        return c
    key = mx.random.key(seed)
    k1, k2 = mx.random.split(key)
    c.update_and_fetch(
        mx.random.normal((1, heads, T, dim), key=k1).astype(dtype),
        mx.random.normal((1, heads, T, dim), key=k2).astype(dtype),
    )
    c.keys, c.values = c.keys_and_values()
    mx.eval(c.keys, c.values)
    return c


def assert_same_packed(a, b):
    assert a.offset == b.offset
    if a.offset == 0:
        assert b.empty()
        return
    for x, y in zip(a.keys + a.values, b.keys + b.values):
        assert x.dtype == y.dtype and x.shape == y.shape
        assert mx.array_equal(x, y).item()


def assert_host_copies_match(batch):
    """The positions a batch keeps on the host (`row_place`) are the device arrays' numbers."""
    rows = batch.left_padding.shape[0]
    assert [batch.row_place(i) for i in range(rows)] == list(zip(batch.left_padding.tolist(), batch.offset.tolist()))
    assert batch._padded == any(batch.left_padding.tolist())


@pytest.mark.parametrize("dtype", [mx.float32, mx.float16, mx.bfloat16])
def test_merge_extract_round_trip_is_bit_exact(dtype):
    lengths = [0, 1, 63, 64, 257, 1000]
    rows = [random_q4(T, dtype=dtype, seed=i) for i, T in enumerate(lengths)]
    batch = BatchQuantizedKVCache.merge(rows, route="dequant")
    assert batch.size() == 1000
    assert batch.offset.tolist() == lengths
    for i, row in enumerate(rows):
        assert_same_packed(batch.extract(i), row)


def test_filter_and_extend_keep_rows_bit_exact():
    rows = [random_q4(T, seed=T) for T in (3, 300, 40)]
    batch = BatchQuantizedKVCache.merge(rows, route="dequant")
    assert_host_copies_match(batch)
    batch.filter([2, 0])  # the longest row leaves: shared padding is trimmed in whole blocks
    assert batch.size() == 40 + (300 - 40) % STEP and batch.keys[0].shape[2] % STEP == 0
    assert_host_copies_match(batch)
    assert_same_packed(batch.extract(0), rows[2])
    assert_same_packed(batch.extract(1), rows[0])
    other = BatchQuantizedKVCache.merge([random_q4(500, seed=9), None], route="dequant")
    batch.extend(other)
    assert batch.offset.tolist() == [40, 3, 500, 0]
    assert_host_copies_match(batch)
    assert_same_packed(batch.extract(0), rows[2])
    assert_same_packed(batch.extract(2), random_q4(500, seed=9))
    assert batch.extract(3).empty()


def test_a_batch_op_queues_every_layers_pending_write_in_one_call(monkeypatch):
    """Each `mx.async_eval` gives up the GIL, and winning it back can wait behind another thread's Python:
    filtering, joining, growing and extracting a per-layer batch queue the layers' last in-place writes (CUDA
    decode steps leave one a layer) together, once, and forget them; making room before a decode step that
    has it already does neither."""
    from mlx.utils import tree_flatten

    from runtime import q4cache

    calls = []
    monkeypatch.setattr(q4cache.mx, "async_eval", lambda *a: calls.append(a))

    def layers(n, seed):
        return [BatchQuantizedKVCache.merge([random_q4(T, seed=seed + i) for i, T in enumerate((5, 40))],
                                            route="dequant") for _ in range(n)]

    def pend(batch):
        for layer in batch:
            layer._pending = mx.zeros((1,))
        return [layer._pending for layer in batch]

    batch, other = layers(4, 0), layers(4, 10)
    ops = [(lambda: filter_cache(batch, [1, 0]), False), (lambda: reserve_cache(batch, 3 * STEP), False),
           (lambda: queue_rows(batch, [0]), False), (lambda: extend_cache(batch, other), True)]
    for op, both in ops:
        calls.clear()
        pending = pend(batch) + (pend(other) if both else [])
        op()
        assert [id(x) for x in calls[0][0]] == [id(x) for x in pending]  # all of them, in one call
        queued_later = [id(x) for call in calls[1:] for _, x in tree_flatten(call)]
        assert not set(queued_later) & {id(x) for x in pending}  # none again, layer by layer
        assert all(layer._pending is None for layer in batch + other)
    calls.clear()
    pending = pend(batch)
    assert not reserve_cache(batch, 1) and not calls  # room for the step: nothing queued, nothing forgotten
    assert [id(layer._pending) for layer in batch] == [id(x) for x in pending]


def test_writes_to_a_batch_leave_a_merged_agents_arrays_alone():
    """A lone agent cache whose buffers already have the batch's width (mlx-lm's own caches keep spare
    columns) is merged without a copy; the batch copies it before its first write, so the agent's arrays
    (Python objects both hold) keep their contents."""
    agent = QuantizedKVCache(group_size=64, bits=4)
    key = mx.random.key(3)
    agent.update_and_fetch(mx.random.normal((1, 2, 10, 64), key=key), mx.random.normal((1, 2, 10, 64), key=key))
    assert agent.keys[0].shape[2] == STEP  # 10 tokens, STEP columns: exactly the width a batch allocates
    before = [mx.array(x * 1) for x in (*agent.keys, *agent.values)]
    batch = BatchQuantizedKVCache.merge([agent], plain(4, 64), route="dequant")
    batch.update_and_fetch(mx.ones((1, 2, 3, 64)), mx.ones((1, 2, 3, 64)))
    mx.eval(batch.keys, batch.values)
    assert all(mx.array_equal(a, b).item() for a, b in zip((*agent.keys, *agent.values), before))
    assert batch.offset.tolist() == [13]


def test_a_batchs_layers_share_one_array_of_positions_through_every_change():
    """Each layer's row positions are the same numbers: the layers hold one array, so a decode step
    advances them with one kernel launch, not one per layer (`_shared`)."""
    def layers(lengths, seed):
        return [BatchQuantizedKVCache.merge([random_q4(T, seed=seed + T) for T in lengths], route="dequant")
                for _ in range(3)]

    def shared(batch, what):
        return len({id(getattr(c, what)) for c in batch}) == 1

    batch = layers([5, 40, 300], seed=1)
    assert shared(batch, "offset") and shared(batch, "left_padding")
    for c in batch:
        c.update_and_fetch(mx.ones((3, 2, 1, 64)), mx.ones((3, 2, 1, 64)))
    assert shared(batch, "offset") and batch[0].offset.tolist() == [6, 41, 301]
    for c in batch:
        c.filter([2, 0])
    assert shared(batch, "offset") and shared(batch, "left_padding") and batch[1].offset.tolist() == [301, 6]
    for c, other in zip(batch, layers([7], seed=2)):
        c.extend(other)
    assert shared(batch, "offset") and shared(batch, "left_padding") and batch[2].offset.tolist() == [301, 6, 7]
    for c in batch:
        c.trim(1)
    assert shared(batch, "offset") and batch[0].offset.tolist() == [300, 5, 6]
    assert_host_copies_match(batch[0])
    empty = [BatchQuantizedKVCache([0, 0], route="dequant") for _ in range(2)]  # no keys yet, on either side
    empty[0].extend(empty[1])
    assert_host_copies_match(empty[0])


@pytest.mark.parametrize("route", ["dequant", "dequant_once"] + ([] if on_cuda() else ["quantized"]))
def test_a_merge_with_leads_keeps_the_history_under_a_rows_padding_queries(route):
    """Rows whose new tokens are fewer than the update's: each row's tokens take the update's last columns,
    its history the columns before them, and every row ends at one column, bitwise as each row fed alone."""
    lengths, lead, N = [40, 300, 7, 256], [3, 0, 5, 6], 7
    rows = [random_q4(T, seed=T) for T in lengths]
    k = mx.random.normal((4, 2, N, 64), key=mx.random.key(5))
    v = mx.random.normal((4, 2, N, 64), key=mx.random.key(6))
    batch = BatchQuantizedKVCache.merge(rows, route=route, lead=lead)
    assert batch.offset.tolist() == [T - n for T, n in zip(lengths, lead)]  # RoPE: a padding query's position
    assert_host_copies_match(batch)
    batch.update_and_fetch(k, v)
    assert batch.offset.tolist() == [T + N - n for T, n in zip(lengths, lead)]
    assert_host_copies_match(batch)
    for i, (row, n) in enumerate(zip(rows, lead)):
        alone = BatchQuantizedKVCache.merge([row], route=route)
        alone.update_and_fetch(k[i : i + 1, :, n:], v[i : i + 1, :, n:])
        assert_same_packed(batch.extract(i), alone.extract(0))


@pytest.mark.parametrize("lead", [None, [3, 0, 5]])
def test_a_twin_is_what_merge_makes_of_the_same_rows_for_another_layer_less_its_buffers(lead):
    """`twin` (a hot turn's layers after the first): every attribute as `merge` sets it but the buffers; its lists
    its own; given the same buffers, it updates and hands rows out bitwise as the merged layer does."""
    rows = [random_q4(T, seed=T) for T in (40, 300, 7)]
    merged = BatchQuantizedKVCache.merge(rows, route="dequant", lead=lead, room=9)
    again = BatchQuantizedKVCache.merge(rows, route="dequant", lead=lead, room=9)
    twin = merged.twin()
    assert set(vars(twin)) == set(vars(again)) and twin.keys is None and twin.values is None
    for name, value in vars(again).items():
        if name in ("keys", "values"):
            continue
        mine = getattr(twin, name)
        if isinstance(value, mx.array):
            assert mx.array_equal(mine, value).item(), name
        else:
            assert mine == value, name
    assert twin._pads is not merged._pads and twin._bases is not merged._bases
    assert lead is None or twin._lead is not merged._lead
    twin.keys, twin.values = again.keys, again.values
    k = mx.random.normal((3, 2, 7, 64), key=mx.random.key(5))
    v = mx.random.normal((3, 2, 7, 64), key=mx.random.key(6))
    merged.update_and_fetch(k, v)
    twin.update_and_fetch(k, v)
    assert_host_copies_match(twin)
    for i in range(3):
        assert_same_packed(twin.extract(i), merged.extract(i))


def test_a_lead_is_at_most_a_rows_history_and_its_update_must_cover_it():
    rows = [random_q4(T, seed=T) for T in (10, 4)]
    with pytest.raises(Q4CacheError, match="lead must be 0 to the 4 tokens"):
        BatchQuantizedKVCache.merge(rows, route="dequant", lead=[0, 5])
    batch = BatchQuantizedKVCache.merge(rows, route="dequant", lead=[0, 4])
    with pytest.raises(Q4CacheError, match="before the update"):
        batch.extract(0)
    with pytest.raises(Q4CacheError, match="more than 4 tokens"):
        batch.update_and_fetch(mx.ones((2, 2, 4, 64)), mx.ones((2, 2, 4, 64)))


@pytest.mark.parametrize("arch", ARCHS)
def test_rows_prefilled_together_with_leads_match_solo(models, arch):
    """Several agents' next messages of different lengths in one forward pass, right-aligned: each row's
    last logits and greedy continuation are those of its prefill alone."""
    model, spec = models[arch]
    hist = histories(seed=2)
    caches = [prefill(model, spec, h)[0] for h in hist]
    news = [[7, 8, 9], [11], [12, 13, 14, 15, 16]]
    alone = []
    for cache, new in zip(caches, news):
        b = merge_caches(spec, [cache])
        logits = model(mx.array([new]), cache=b)[0, -1]
        alone.append((logits, greedy(model, b, [mx.argmax(logits).item()], 12)[0]))
    width = max(map(len, news))
    lead = [width - len(n) for n in news]
    batch = merge_caches(spec, caches, lead=lead)
    logits = model(mx.array([n[:1] * k + n for n, k in zip(news, lead)]), cache=batch)[:, -1]
    firsts = mx.argmax(logits, axis=-1).tolist()
    together = greedy(model, batch, firsts, 12)
    for i, (solo_logits, solo_tokens) in enumerate(alone):
        assert mx.allclose(logits[i], solo_logits, atol=ATOL).item()
        assert together[i] == solo_tokens


def test_an_update_refuses_keys_it_cannot_rotate_by_rope():
    """Only a CUDA decode step's in-place write rotates keys by RoPE; elsewhere unrotated keys are refused."""
    batch = BatchQuantizedKVCache.merge([random_q4(10)], route="dequant")
    assert not batch.fuses_rope(mx.float32, 64)
    rope = (mx.array([10], dtype=mx.int32), mx.ones((32,)))
    with pytest.raises(Q4CacheError, match="RoPE"):
        batch.update_and_fetch(mx.ones((1, 2, 1, 64)), mx.ones((1, 2, 1, 64)), rope=rope)
    assert batch.size() == 10  # nothing written


def test_merge_rejects_other_bits():
    c = QuantizedKVCache(group_size=64, bits=8)
    c.update_and_fetch(mx.zeros((1, 1, 2, 64)), mx.zeros((1, 1, 2, 64)))
    with pytest.raises(Q4CacheError, match="k8v8-g64"):
        BatchQuantizedKVCache.merge([c], plain(4, 64), route="dequant")


def test_head_dim_not_divisible_by_group_is_a_clear_error():
    cache = BatchQuantizedKVCache([0], plain(4, 64), route="dequant")
    with pytest.raises(Q4CacheError, match="not divisible by the group size"):
        cache.update_and_fetch(mx.zeros((1, 1, 2, 80)), mx.zeros((1, 1, 2, 80)))


@pytest.mark.parametrize("pads", [[0], [3, 0], [0, 1, 2]])
def test_row_arrays_of_one_or_two_rows_sit_in_16_byte_buffers_through_steps_and_filters(pads):
    """A batch's padding and positions keep their values, and for one or two rows a buffer of ROW_BUFFER int32
    (MLX-CUDA keeps arrays of at most 8 bytes in host-resident managed memory, which kernels read across PCIe)."""
    from runtime.q4cache import ROW_BUFFER

    cache = BatchQuantizedKVCache(pads, route="dequant")
    B = len(pads)
    for step in range(3):
        cache.update_and_fetch(mx.zeros((B, 1, 2, 64)), mx.zeros((B, 1, 2, 64)))
        assert cache.offset.tolist() == [2 * (step + 1) - p for p in pads]
        assert cache.left_padding.tolist() == pads
        assert cache._offsets.shape == (max(B, ROW_BUFFER),)
    cache.filter([B - 1])
    assert cache.offset.tolist() == [6 - pads[-1]] and cache._offsets.shape == (ROW_BUFFER,)
    cache.update_and_fetch(mx.zeros((1, 1, 1, 64)), mx.zeros((1, 1, 1, 64)))
    assert cache.offset.tolist() == [7 - pads[-1]]


@pytest.mark.parametrize("T", [256, 300, 1024])
def test_resident_bytes_at_most_029_of_fp16(T):
    k = mx.random.normal((1, 8, T, 128)).astype(mx.float16)
    fp16 = KVCache()
    fp16.update_and_fetch(k, k)
    q4 = BatchQuantizedKVCache([0], route="dequant")  # a route that keeps no 16-bit copy, on every backend
    q4.update_and_fetch(k, k)
    mx.eval(q4.keys, q4.values, fp16.keys, fp16.values)
    assert q4.nbytes <= 0.29 * fp16.nbytes
    extracted = q4.extract(0)
    assert extracted.nbytes <= 0.29 * 2 * 2 * 8 * T * 128


# -- with real (tiny) models --------------------------------------------------


@pytest.fixture(scope="module")
def models(tiny_model_path, load_tiny):
    out = {}
    for arch in ARCHS:
        model, tokenizer = load_tiny(arch)
        out[arch] = (model, ModelCacheSpec.from_model(model, tiny_model_path(arch)))
    return out


def prefill(model, spec, tokens, route=None):
    """Solo prefill of `tokens`; returns (per-agent cache, logits of the last token)."""
    cache = make_batch_cache(spec, 1, route)
    logits = model(mx.array(tokens)[None], cache=cache)[:, -1]
    mx.eval(logits)
    return extract_cache(cache, 0), logits[0]


def greedy(model, batch, first, steps):
    """Greedy decode `steps` tokens for every row of `batch`, starting from tokens `first`."""
    tokens = mx.array(first)[:, None]
    out = []
    for _ in range(steps):
        logits = model(tokens, cache=batch)[:, -1]
        tokens = mx.argmax(logits, axis=-1)[:, None]
        mx.eval(tokens)
        out.append(tokens[:, 0].tolist())
    return [list(col) for col in zip(*out)]


def histories(seed=0):
    lengths = [5, 90, 33]  # 90 crosses the tiny models' sliding windows
    mx.random.seed(seed)
    return [mx.random.randint(3, 500, (n,)).tolist() for n in lengths]


@pytest.mark.parametrize("arch", ARCHS)
def test_batched_forward_matches_solo(models, arch):
    model, spec = models[arch]
    hist = histories()
    solo = [prefill(model, spec, h[:-1]) for h in hist]
    solo_logits = []
    for h, (cache, _) in zip(hist, solo):
        b = merge_caches(spec, [cache])
        solo_logits.append(model(mx.array([[h[-1]]]), cache=b)[0, -1])
    batch = merge_caches(spec, [c for c, _ in solo])
    logits = model(mx.array([[h[-1]] for h in hist]), cache=batch)[:, -1]
    for i in range(3):
        assert mx.allclose(logits[i], solo_logits[i], atol=ATOL).item()

    firsts = [h[-1] for h in hist]
    batched = greedy(model, merge_caches(spec, [c for c, _ in solo]), firsts, 32)
    for i, (cache, _) in enumerate(solo):
        alone = greedy(model, merge_caches(spec, [cache]), [firsts[i]], 32)[0]
        assert batched[i] == alone


@pytest.mark.parametrize("arch", ["llama", "gemma3_text"])
def test_filter_and_extend_mid_generation_leave_other_rows_unchanged(models, arch):
    model, spec = models[arch]
    hist = histories(seed=1)
    caches = [prefill(model, spec, h[:-1])[0] for h in hist]
    firsts = [h[-1] for h in hist]
    alone = [greedy(model, merge_caches(spec, [c]), [f], 16)[0] for c, f in zip(caches, firsts)]

    batch = merge_caches(spec, caches[:2])
    head = greedy(model, batch, firsts[:2], 8)
    filter_cache(batch, [1])  # row 0 finishes early
    newcomer = merge_caches(spec, [caches[2]])
    extend_cache(batch, newcomer)  # row 2 joins mid-flight
    tail = greedy(model, batch, [head[1][-1], firsts[2]], 8)
    assert head[0] == alone[0][:8]
    assert head[1] + tail[0] == alone[1]
    assert tail[1] == alone[2][:8]


@pytest.mark.parametrize("arch", ARCHS)
def test_default_route_on_this_machine_serves_every_arch(models, arch):
    model, spec = models[arch]
    route = route_for(spec)  # this machine's default, or its fallback for attention sinks
    assert route == default_route() or (spec.has_sinks and route == "dequant_once")
    cache, logits = prefill(model, spec, list(range(3, 40)), route)
    assert cache[0].offset == 37
    assert not mx.isnan(logits).any().item()


CUDA = on_cuda()


@pytest.mark.parametrize("route", [r for r in ROUTES if r != ("quantized" if CUDA else "q4kernel")])
def test_all_routes_agree(models, route):
    model, spec = models["llama"]
    tokens = list(range(3, 60))
    _, reference = prefill(model, spec, tokens, "dequant")
    _, logits = prefill(model, spec, tokens, route)
    assert mx.allclose(logits, reference, atol=1e-4).item()


def test_q4kernel_route_is_refused_off_cuda():
    if CUDA:
        pytest.skip("this machine has CUDA")
    with pytest.raises(Q4CacheError, match="CUDA"):
        BatchQuantizedKVCache([0], route="q4kernel")


def test_quantized_route_is_refused_on_cuda(monkeypatch):
    """MLX-CUDA's quantized matmul cannot serve the quantized route's decode: a clear error, before any turn."""
    import runtime.q4cache as q4cache

    monkeypatch.setattr(q4cache, "on_cuda", lambda: True)  # a CUDA machine, where there is none
    with pytest.raises(Q4CacheError, match="cannot decode on CUDA.*dequant_once"):
        q4cache.check_route("quantized")
    assert [q4cache.check_route(r) for r in ("dequant", "dequant_once", "q4kernel")] == ["dequant", "dequant_once",
                                                                                         "q4kernel"]


def test_route_override(models, monkeypatch):
    monkeypatch.setenv("KVACTORS_Q4_ROUTE", "dequant_once")
    assert default_route() == "dequant_once"
    monkeypatch.setenv("KVACTORS_Q4_ROUTE", "dequant")
    assert make_batch_cache(models["llama"][1])[0].route == "dequant"
    monkeypatch.setenv("KVACTORS_Q4_ROUTE", "fast")
    with pytest.raises(Q4CacheError, match="unknown Q4 attention route"):
        default_route()
    monkeypatch.delenv("KVACTORS_Q4_ROUTE")
    with pytest.raises(Q4CacheError, match="CUDA" if CUDA else "sinks"):
        route_for(models["gpt_oss"][1], "quantized")


def test_quantized_route_leaves_queries_untouched():
    from runtime.attention import quantized_sdpa

    q = mx.ones((1, 2, 1, 64))
    k = tuple(mx.quantize(mx.ones((1, 1, 4, 64)), group_size=64, bits=4))
    quantized_sdpa(q, k, k, scale=0.125, mask=None)
    assert mx.array_equal(q, mx.ones((1, 2, 1, 64))).item()


# -- bounded sliding-window layers -----------------------------------------------


@pytest.mark.parametrize("arch", ["gemma3_text", "gpt_oss"])
def test_sliding_layers_keep_window_plus_slack_and_continue_exactly(models, arch):
    model, spec = models[arch]
    history = list(range(3, 3 + 420))  # beyond window (64) + SLIDING_SLACK (256)
    batch = make_batch_cache(spec, 1)
    model(mx.array(history)[None], cache=batch)
    unbounded = greedy(model, batch, [7], 12)[0]  # continues on the full in-batch cache

    cache, _ = prefill(model, spec, history)
    for layer, c in enumerate(cache):
        window = spec.windows[layer]
        stored = 420 if window is None else window + SLIDING_SLACK
        assert c.offset == 420 and c.keys[0].shape[2] == stored
    assert greedy(model, merge_caches(spec, [cache]), [7], 12)[0] == unbounded


def test_bounded_cache_bytes_and_trim_limits(models):
    model, spec = models["gemma3_text"]
    cache, _ = prefill(model, spec, list(range(3, 3 + 420)))
    full = [c for c, w in zip(cache, spec.windows) if w is None][0]
    sliding = [c for c, w in zip(cache, spec.windows) if w is not None][0]
    assert sliding.nbytes < full.nbytes * 320 / 420 + 1
    first = 420 - (64 + SLIDING_SLACK)  # the oldest position a sliding layer still holds
    assert can_trim(spec, cache, 419) and can_trim(spec, cache, first + 63)
    assert not can_trim(spec, cache, first + 62)
    assert can_trim(models["llama"][1], prefill(*models["llama"], list(range(3, 300)))[0], 1)
    # from the counts alone (a cold turn's replay knows no cache): the same answer at every cut
    for tokens, held in ((420, cache), (200, prefill(model, spec, list(range(3, 203)))[0])):
        for keep in (1, 100, 150, first + 62, first + 63, tokens - 1):
            assert can_trim_held(spec, tokens, keep) == can_trim(spec, held, keep), (tokens, keep)


def test_bounded_cache_survives_the_store_bit_exact(models, tmp_path):
    from runtime import store

    model, spec = models["gemma3_text"]
    cache, _ = prefill(model, spec, list(range(3, 3 + 420)))
    ids = list(range(3, 3 + 420))
    meta = store.CacheMeta(seq=1, token_ids=ids, token_ends=list(range(1, 421)), text="x" * 420)
    store.save_cache(tmp_path, spec, "sw", store.cache_to_host(cache), meta)
    host, loaded_meta = store.load_cache(tmp_path, spec, "sw")
    assert host.lengths and loaded_meta.token_ids == ids
    for a, b in zip(store.host_to_cache(host), cache):
        assert_same_packed(a, b)
    trimmed = store.trim_cache(cache, 400)
    assert trimmed[0].offset == 400 and trimmed[0].keys[0].shape[2] == 300


def test_dequant_once_working_copy_never_spans_whole_steps(models):
    # MLX-CUDA switches decoding to per-shape cuDNN graphs for 256-multiple buffers
    # (seconds each, see _working_copy); the extra column must not change any token.
    model, spec = models["llama"]
    cache, logits = prefill(model, spec, list(range(3, 3 + STEP)), "dequant_once")
    first = [mx.argmax(logits).item()]
    widths = []

    def watched(route):
        batch = merge_caches(spec, [cache], route)
        out = []
        tokens = mx.array(first)[:, None]
        for _ in range(STEP + 4):  # crosses a growth of the allocation
            tokens = mx.argmax(model(tokens, cache=batch)[:, -1], axis=-1)[:, None]
            out.append(tokens.item())
            if route == "dequant_once":
                widths.append(batch[0]._dense[0].shape[2])
        return out

    assert watched("dequant_once") == watched("dequant")
    assert all(w % STEP for w in widths) and len(set(widths)) > 1


def test_kernel_parameters_are_shared_per_step_and_per_thread():
    """`q4sdpa.meta` gives the kernels' [end, window, queries] as one array per step that every layer shares,
    made per thread (a view is evaluated by the thread that made it), right across its blocks of ends."""
    import threading

    from runtime import q4sdpa

    first = q4sdpa.meta(130, 0, 1)
    assert first is q4sdpa.meta(130, 0, 1) and first.tolist() == [130, 0, 1]
    for end in (0, q4sdpa.META_BLOCK - 1, q4sdpa.META_BLOCK, 5 * q4sdpa.META_BLOCK + 7):
        assert q4sdpa.meta(end, 512, 3).tolist() == [end, 512, 3]
    other = {}
    thread = threading.Thread(target=lambda: other.update(m=q4sdpa.meta(130, 0, 1), v=q4sdpa.meta(130, 0, 1).tolist()))
    thread.start()
    thread.join()
    assert other["m"] is not first and other["v"] == [130, 0, 1]


def test_kernel_parameters_of_an_ended_thread_never_reach_a_thread_given_its_id_again():
    """The system gives an ended thread's id to a new thread (as to a batcher restarted on a new thread): a thread
    that made parameters and ended without evaluating them (a forward that raised) leaves nothing the next thread
    with its id gets; that one's arrays are its own, which it evaluates on its stream (another thread's raise)."""
    import threading

    from runtime import q4sdpa

    first, outcomes = {}, []

    def turn():
        made = q4sdpa.meta(4099, 0, 1)
        if threading.get_ident() not in first:
            first[threading.get_ident()] = made  # left unevaluated
            return
        try:
            outcomes.append((made is not first[threading.get_ident()], made.tolist()))
        except RuntimeError as e:
            outcomes.append((False, str(e)))

    for _ in range(200):
        thread = threading.Thread(target=turn)
        thread.start()
        thread.join()
        if outcomes:
            break
    if not outcomes:
        pytest.skip("this system gave no ended thread's id to a new one in 200 threads")
    assert outcomes == [(True, [4099, 0, 1])]


def test_gather_columns_refuses_plans_outside_the_tensors():
    """`q4columns.gather` checks its arguments before it launches anything (so this runs anywhere)."""
    from runtime import q4columns

    def part(words, rows=2, width=64, dtype=mx.bfloat16):
        return (mx.zeros((rows, 4, width, words), mx.uint32), mx.zeros((rows, 4, width, 2), dtype),
                mx.zeros((rows, 4, width, 2), dtype))

    src = (part(16), part(16))
    for span, width in (((0, 2, 0, 1, 0), 1), ((0, 0, 10, 9, 0), 5), ((0, 0, 0, 65, 0), 65), ((0, 0, 0, 10, 0), 9),
                        ((0, -1, 0, 1, 0), 1), ((0, 0, 0, 10, 5), 14), ((0, 0, 0, 1, -1), 1), ((1, 0, 0, 1, 0), 1)):
        with pytest.raises(ValueError, match="gather (needs|has)"):
            q4columns.gather([src], [span], width)
    with pytest.raises(ValueError, match="one B and W a source and one H in all"):
        q4columns.gather([(src[0], (src[1][0][:, :, :10], *src[1][1:]))], [(0, 0, 0, 1, 0)], 1)
    with pytest.raises(ValueError, match="one B and W a source and one H in all"):  # a third source, other heads
        q4columns.gather([src, src, (part(16)[:1] + (mx.zeros((2, 2, 64, 2)),) * 2, part(16))], [(0, 0, 0, 1, 0)], 1)
    with pytest.raises(ValueError, match="must match"):
        q4columns.gather([src, (part(16), part(16, dtype=mx.float16))], [(0, 0, 0, 1, 0)], 1)
    with pytest.raises(ValueError, match="one or more sources"):
        q4columns.gather([], [(0, 0, 0, 1, 0)], 1)
    with pytest.raises(ValueError, match="at least one row"):
        q4columns.gather([src], [], 1)
    wide = (part(16, rows=1, width=300), part(16, rows=1, width=300))  # a second source may be wider and shorter
    with pytest.raises(ValueError, match="row < 1"):
        q4columns.gather([src, wide], [(1, 1, 0, 1, 0)], 1)


def test_reserving_room_ahead_grows_once_and_changes_no_update():
    """`reserve` grows the buffers before an update (so a caller can evaluate the copy on its own); the
    update then writes exactly as it would have after growing the buffers itself."""
    rows = [random_q4(T, seed=T) for T in (250, 30)]
    ahead, inline = (BatchQuantizedKVCache.merge(rows, route="dequant") for _ in range(2))
    assert ahead.keys[0].shape[2] == STEP and not ahead.reserve(STEP - 250)  # room enough: nothing to do
    assert ahead.reserve(10) and ahead.keys[0].shape[2] == 2 * STEP and not ahead.reserve(10)
    k = mx.random.normal((2, 2, 10, 64), key=mx.random.key(7))
    for c in (ahead, inline):
        c.update_and_fetch(k, k)
    assert inline.keys[0].shape[2] == 2 * STEP
    for i in range(2):
        assert_same_packed(ahead.extract(i), inline.extract(i))
    assert_host_copies_match(ahead)


def test_extracting_a_row_reads_each_layers_own_padding():
    """A bounded sliding layer stores fewer columns than a full one, so a row's padding differs between layers:
    `extract_cache` takes each layer's own (it once took layer 0's for all, corrupting the others)."""
    sliding = random_q4(320, seed=2)
    sliding.offset = 420  # the last 320 of 420 positions
    batch = [BatchQuantizedKVCache.merge([random_q4(420, seed=1), random_q4(100, seed=3)], route="dequant"),
             BatchQuantizedKVCache.merge([sliding, random_q4(100, seed=4)], route="dequant", keep=320)]
    assert batch[0].row_place(1) != batch[1].row_place(1)
    for i in range(2):
        for whole, alone in zip(extract_cache(batch, i), (layer.extract(i) for layer in batch)):
            assert_same_packed(whole, alone)
    assert_same_packed(extract_cache(batch, 1)[1], random_q4(100, seed=4))


@pytest.mark.parametrize("drop", [0, 1])
def test_rows_queued_together_are_each_the_row_taken_alone(drop):
    """`queue_rows` (the engine's hand-over of rows that end in one step) gives, per row and in the order
    asked, bit for bit what `extract_cache` gives that row alone, every layer its own padding."""
    sliding = random_q4(320, seed=2)
    sliding.offset = 420
    batch = [BatchQuantizedKVCache.merge([random_q4(420, seed=1), random_q4(100, seed=3), random_q4(250, seed=5)],
                                         route="dequant"),
             BatchQuantizedKVCache.merge([sliding, random_q4(100, seed=4), random_q4(250, seed=6)], route="dequant",
                                         keep=320)]
    together = queue_rows(batch, [2, 0], drop)
    mx.eval([(c.keys, c.values) for caches in together for c in caches])
    for i, caches in zip([2, 0], together):
        for got, alone in zip(caches, extract_cache(batch, i, drop)):
            assert_same_packed(got, alone)
            assert got.offset == alone.offset
    assert together[0][0].offset == 250 - drop and together[1][1].offset == 420 - drop


def held_arrays(layers: int, columns: int) -> list:
    """Random arrays of a `HeldRow` of `layers` layers, 2 heads and `columns` columns: 6-bit keys and 4-bit values
    of head dim 64, group 64 (words, then bf16 scales and biases of each)."""
    return [mx.random.randint(0, 1 << 30, (layers, 2, columns, c)).astype(t)
            for c, t in ((12, mx.uint32), (2, mx.bfloat16), (2, mx.bfloat16),
                         (8, mx.uint32), (2, mx.bfloat16), (2, mx.bfloat16))]


def test_a_held_row_makes_every_layers_views_once_when_first_read_and_not_before(monkeypatch):
    """A row taken out of a batch in one launch (`HeldRow`): its layers hold six arrays of every layer; what
    the engine evaluates (`row_arrays`) is those six, once, and makes no view; the first read of any layer's
    keys or values makes every layer's views at once, evaluated, each the layer's slice of the arrays bit for
    bit, and later reads (from any thread) share them; a layer whose keys are replaced keeps its values."""
    from runtime import q4cache
    from runtime.hotcache import cache_nbytes
    from runtime.q4cache import layer_cache

    layers, scheme = 3, KVScheme(6, 4, 64, "none")
    arrays = held_arrays(layers, 40)
    mx.eval(arrays)
    splits, real = [], mx.split
    monkeypatch.setattr(q4cache.mx, "split", lambda x, *a, **k: splits.append(x.shape) or real(x, *a, **k))
    row = HeldRow(arrays)
    caches = [layer_cache(scheme) for _ in range(layers)]
    for n, c in enumerate(caches):
        c.hold(row, n)
        c.offset = 40
    plain_layer = layer_cache(scheme)
    plain_layer.keys, plain_layer.values = tuple(arrays[:3]), tuple(arrays[3:])

    got = row_arrays([*caches, plain_layer])
    assert got[:6] == list(row.arrays) and len(got) == 7 and got[6][0] is plain_layer.keys
    assert cache_nbytes(caches) == sum(x.nbytes for x in arrays) and caches[0].nbytes * layers == plain_layer.nbytes
    assert not splits and all(c._held is not None for c in caches) and not caches[0].empty()

    seen = []
    threads = [threading.Thread(target=lambda: seen.append(caches[1].values)) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(splits) == 6 and all(x is y for v in seen for x, y in zip(v, seen[0], strict=True))  # one split an array
    for n, c in enumerate(caches):
        for x, y in zip((*c.keys, *c.values), arrays, strict=True):
            assert x.shape == (1, *y.shape[1:]) and mx.array_equal(x, y[n : n + 1]).item()
    assert len(splits) == 6 and all(c._held is None for c in caches)

    other = HeldRow(arrays)
    c = layer_cache(scheme)
    c.hold(other, 2)
    c.keys = tuple(arrays[:3])
    assert c.keys[0] is arrays[0] and mx.array_equal(c.values[0], arrays[3][2:3]).item()


READ_AT_ONCE = """
import sys, threading
import mlx.core as mx
from runtime.q4cache import HeldRow

base = [mx.random.normal((32, 2, 16, 8)) for _ in range(6)]
mx.eval(base)
readers, row, turns = 4, [None], int(sys.argv[1])
together = threading.Barrier(readers + 1)

def read():  # as the engine's merge and the persistence actor's copy read a row handed out
    for _ in range(turns):
        together.wait()
        mx.eval(sum(mx.sum(v) for views in row[0].views() for v in views))
        together.wait()

threads = [threading.Thread(target=read) for _ in range(readers)]
for t in threads:
    t.start()
for i in range(turns):
    row[0] = HeldRow([x + i for x in base])
    mx.eval(row[0].arrays)
    together.wait()
    together.wait()
for t in threads:
    t.join()
print("read", turns)
"""


def test_a_held_rows_views_are_read_by_several_threads_at_once_without_a_crash(tmp_path):
    """Threads that evaluate graphs over one row's views at once, one of them making the views, each turn a new
    row: MLX (0.32) crashes the process (SIGSEGV, within 1,300 turns in each of eight runs on a 2-CPU machine)
    where the views are still queued when a second thread reads them; made evaluated and waited for, never."""
    import subprocess
    import sys

    script = tmp_path / "read_at_once.py"
    script.write_text(READ_AT_ONCE)
    done = subprocess.run([sys.executable, str(script), "2500"], capture_output=True, text=True, timeout=240)
    assert done.returncode == 0 and done.stdout.split() == ["read", "2500"], (done.returncode, done.stderr[-2000:])


def test_held_row_finds_a_row_handed_out_whole_with_its_tokens_and_nothing_else():
    """`held_row` (which lets a merge copy every layer in one launch, and a copy to the host read six arrays)
    gives (the row, the tokens every layer holds) for layers that hold one `HeldRow` in order, unchanged; None
    once a layer holds another array, fewer tokens, another row's layer, or for a single layer."""
    from runtime.q4cache import held_row, layer_cache

    layers, scheme = 3, KVScheme(6, 4, 64, "none")

    def handed_out(columns=40):
        arrays = held_arrays(layers, columns)
        row, caches = HeldRow(arrays), [layer_cache(scheme) for _ in range(layers)]
        for n, c in enumerate(caches):
            c.hold(row, n)
            c.offset = columns
        return row, caches

    row, caches = handed_out()
    assert held_row(caches) == (row, 40)
    assert held_row(caches[:1]) is None and held_row([]) is None
    _, changed = handed_out()
    changed[1].keys = tuple(mx.array(x) for x in changed[1].keys)  # the same bits in new arrays
    assert held_row(changed) is None
    _, shorter = handed_out()
    shorter[2].offset = 39
    assert held_row(shorter) is None
    _, swapped = handed_out()
    swapped[0], swapped[1] = swapped[1], swapped[0]
    assert held_row(swapped) is None


@pytest.mark.parametrize("piece_bytes", [8 << 20, 20_000])  # every layer in one piece; a layer or two a piece
def test_a_held_rows_copy_to_the_host_reads_its_six_arrays_and_gives_every_layers_bytes(piece_bytes, monkeypatch):
    """A cache every layer of which is a view of one `HeldRow` (a turn's cache as handed out) leaves the device
    through slices of the row's six arrays, six a piece, not six a layer; the copy is byte for byte the one
    made a layer at a time, whole or from a position on, with spare columns past the tokens."""
    from runtime import hostcache
    from runtime.q4cache import layer_cache

    layers, scheme, columns, tokens = 5, KVScheme(6, 4, 64, "none"), 48, 40
    arrays = [mx.random.randint(0, 1 << 30, (layers, 2, columns, c)).astype(t)  # head dim 64, one group a row
              for c, t in ((12, mx.uint32), (1, mx.bfloat16), (1, mx.bfloat16),
                           (8, mx.uint32), (1, mx.bfloat16), (1, mx.bfloat16))]
    mx.eval(arrays)
    row, held = HeldRow(arrays), [layer_cache(scheme) for _ in range(layers)]
    plain_layers = [layer_cache(scheme) for _ in range(layers)]
    for n, (c, p) in enumerate(zip(held, plain_layers)):
        c.hold(row, n)
        p.keys, p.values = tuple(mx.array(x[n: n + 1]) for x in arrays[:3]), tuple(mx.array(x[n: n + 1])
                                                                                  for x in arrays[3:])
        c.offset = p.offset = tokens
    monkeypatch.setattr(hostcache, "PIECE_BYTES", piece_bytes)
    seen, to_numpy = [], hostcache._to_numpy
    monkeypatch.setattr(hostcache, "_to_numpy", lambda a: seen.append(len(a)) or to_numpy(a))
    for start in (0, 25):
        seen.clear()
        got, want = hostcache.cache_to_host(held, start), hostcache.cache_to_host(plain_layers, start)
        assert seen == [6 * -(-layers // max(1, piece_bytes // (got.nbytes // layers))), 6 * layers]
        assert (got.dtype, got.n_layers, got.n_tokens, got.lengths) == (want.dtype, want.n_layers, want.n_tokens,
                                                                         want.lengths)
        assert got.tensors.keys() == want.tensors.keys()
        for name, x in want.tensors.items():
            assert got.tensors[name].shape == x.shape and got.tensors[name].tobytes() == x.tobytes(), name
