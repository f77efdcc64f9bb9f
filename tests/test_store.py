"""runtime.store: bit-exact round trips, every corruption kind with its error and fallback,
journal torn tails, agent ids, permissions, retention, inspect, the hot tier."""

import ast
import contextlib
import dataclasses
import errno
import json
import os
import random
import resource
import shutil
import signal
import stat
import subprocess
import sys
import threading
import types
import zlib
from pathlib import Path

import mlx.core as mx
import msgpack
import numpy as np
import pytest
from safetensors import TensorSpec, serialize

from runtime import cachechain, cacheformat, hostcache, journal, store
from runtime.store import CacheMeta

ROOT = Path(__file__).resolve().parent.parent

SPEC = types.SimpleNamespace(
    fingerprint="fp-test", n_layers=2, n_kv_heads=2, k_head_dim=64, v_head_dim=64, kv_bits=4, kv_group_size=64
)


def spec(**changes):
    return types.SimpleNamespace(**{**vars(SPEC), **changes})


def q4_cache(T, dtype=mx.float32, layers=2, heads=2, dim=64, bits=4, group=64, seed=0):
    """Per-layer QuantizedKVCache list per the batcher's contract: exactly T long, evaluated."""
    from mlx_lm.models.cache import QuantizedKVCache

    key = mx.random.key(seed)
    out = []
    for _ in range(layers):
        c = QuantizedKVCache(group_size=group, bits=bits)
        if T:
            key, k1, k2 = mx.random.split(key, 3)
            c.keys = mx.quantize(mx.random.normal((1, heads, T, dim), key=k1).astype(dtype), group, bits)
            c.values = mx.quantize(mx.random.normal((1, heads, T, dim), key=k2).astype(dtype), group, bits)
            c.offset = T
            mx.eval(c.keys, c.values)
        out.append(c)
    return out


def meta_for(T, seq=1):
    return CacheMeta(seq=seq, token_ids=list(range(5, 5 + T)), token_ends=list(range(1, T + 1)), text="x" * T, turn_id=f"t{seq}")


def raw(x):
    return np.array(x.view(mx.uint16) if x.dtype == mx.bfloat16 else x)


def assert_same_cache(a, b):
    for la, lb in zip(a, b):
        assert la.offset == lb.offset and (la.bits, la.group_size) == (lb.bits, lb.group_size)
        if la.keys is None:
            assert lb.keys is None
            continue
        for x, y in zip((*la.keys, *la.values), (*lb.keys, *lb.values)):
            assert x.dtype == y.dtype and x.shape == y.shape
            assert raw(x).tobytes() == raw(y).tobytes()


def saved(tmp_path, T=40, agent="a", seq=1, **kw):
    """Save a cache and two journal records for `agent`; return (path, records)."""
    records = [store.journal_record(seq - 1, "user", "hi"), store.journal_record(seq, "assistant", "x" * T)]
    store.append_journal(tmp_path, SPEC, agent, records)
    path = store.save_cache(tmp_path, SPEC, agent, store.cache_to_host(q4_cache(T, **kw)), meta_for(T, seq))
    return path, store.read_journal(tmp_path, SPEC, agent)


# ---------------------------------------------------------------- round trips


@pytest.mark.parametrize("dtype", [mx.float32, mx.bfloat16, mx.float16])
@pytest.mark.parametrize("T", [0, 1, 63, 64, 257])
def test_save_load_is_bit_exact(tmp_path, dtype, T):
    cache = q4_cache(T, dtype=dtype, seed=T)
    got = {}
    t = threading.Thread(target=lambda: got.update(host=store.cache_to_host(cache)))  # another thread, as an agent would
    t.start()
    t.join()
    store.save_cache(tmp_path, SPEC, "agent-1", got["host"], meta_for(T))
    host, meta = store.load_cache(tmp_path, SPEC, "agent-1")
    assert meta == meta_for(T) and meta.fingerprint == SPEC.fingerprint
    assert host.n_tokens == T and host.dtype == (str(dtype).split(".")[-1] if T else "float32")
    assert_same_cache(cache, store.host_to_cache(host))


@pytest.mark.parametrize("dtype", [mx.float32, mx.bfloat16, mx.float16])
def test_cache_files_are_safetensors_the_package_reads(tmp_path, dtype):
    """The file is written without the safetensors package; its own reader gets the header and every tensor's
    dtype, shape and bits (numpy has no bfloat16: those bits are checked through MLX, which reads the same file)."""
    from safetensors import safe_open

    path, _ = saved(tmp_path, T=70, dtype=dtype)
    host, _ = store.load_cache(tmp_path, SPEC, "a")
    header = {mx.float32: "F32", mx.float16: "F16", mx.bfloat16: "BF16"}[dtype]
    with safe_open(path, "numpy") as f:
        assert set(f.keys()) == set(host.tensors)
        for name, a in host.tensors.items():
            part = f.get_slice(name)
            assert part.get_shape() == list(a.shape)
            assert part.get_dtype() == ("U32" if name.endswith("packed") else header)
            if part.get_dtype() != "BF16":
                assert f.get_tensor(name).tobytes() == a.tobytes()
        info = f.metadata()
    assert info["format"] == cacheformat.FORMAT and json.loads(info["meta"])["n_tokens"] == 70
    loaded = mx.load(str(path))
    assert all(raw(loaded[name]).tobytes() == a.tobytes() for name, a in host.tensors.items())


def test_encoding_a_cache_copies_no_tensor(tmp_path):
    """A writer hands the host arrays to the OS as they are: one file's bytes built in memory would hold the GIL."""
    host = store.cache_to_host(q4_cache(90))
    parts, _ = cacheformat.encode_file(host, meta_for(90), SPEC.fingerprint)
    assert len(parts) == 1 + len(host.tensors)
    assert all(any(np.shares_memory(p, a) for a in host.tensors.values()) for p in parts[1:])
    assert cacheformat.parts_size(parts) == len(b"".join(parts))


@pytest.mark.parametrize("piece,pieces", [(1, 12), (900, 8), (1 << 30, 1)])
def test_a_cache_leaves_the_device_in_pieces_bit_exactly(tmp_path, monkeypatch, piece, pieces):
    """Whatever the transfer size (one tensor each; a layer's keys, then its scales and biases together; all
    at once), the host copy is the same."""
    from runtime import hostcache

    cache = q4_cache(100, dtype=mx.bfloat16, seed=3)
    transfers, to_host = [], hostcache._piece_to_host
    monkeypatch.setattr(hostcache, "PIECE_BYTES", piece)
    monkeypatch.setattr(hostcache, "_piece_to_host", lambda a, stream: transfers.append(a.nbytes) or to_host(a, stream))
    host = store.cache_to_host(cache)
    assert len(transfers) == pieces  # 2 layers of 6 tensors: packed 6400 bytes, scales and biases 400 each
    live = np.asarray(cache[0].keys[0])  # a copy, not a view of the cache: later updates must not reach it
    assert not any(np.shares_memory(t, live) for t in host.tensors.values())
    store.save_cache(tmp_path, SPEC, "agent-1", host, meta_for(100))
    assert_same_cache(cache, store.host_to_cache(store.load_cache(tmp_path, SPEC, "agent-1")[0]))


def test_caches_copied_from_several_threads_each_use_their_own_stream(monkeypatch):
    """The pieces are gathered on a stream of the copying thread's own (MLX streams belong to the thread that made
    them: another thread's stream raises there); copies from a pool of threads, each at once and again, are the
    same as one from this thread, and each piece is evaluated on its own, after the one before is on the host."""
    import threading
    from concurrent.futures import ThreadPoolExecutor

    from runtime import hostcache, q4cache

    cache = q4_cache(100, dtype=mx.bfloat16, seed=5)
    monkeypatch.setattr(hostcache, "PIECE_BYTES", 900)  # 8 pieces
    evaluated, to_host, evaluate = [], hostcache._piece_to_host, mx.eval

    def moved(a, stream):
        data = to_host(a, stream)
        evaluated.append("host")
        return data

    monkeypatch.setattr(hostcache, "_piece_to_host", moved)
    monkeypatch.setattr(mx, "eval", lambda *a: evaluated.append("eval") or evaluate(*a))
    here = store.cache_to_host(cache)
    assert evaluated == ["eval", "host"] * 8
    with ThreadPoolExecutor(3) as pool:
        copies = list(pool.map(lambda _: store.cache_to_host(cache), range(9)))
        together = threading.Barrier(3)  # three threads at once: three streams

        def stream(_):
            together.wait()
            return str(q4cache.side_stream())

        streams = set(pool.map(stream, range(3)))
    assert len(streams) == 3 and str(q4cache.side_stream()) not in streams
    for host in copies:
        assert host.tensors.keys() == here.tensors.keys()
        assert all(np.array_equal(host.tensors[k], here.tensors[k]) for k in here.tensors)


def test_special_scale_values_survive_in_bfloat16(tmp_path):
    cache = q4_cache(3, dtype=mx.bfloat16)
    special = mx.array([float("nan"), -0.0, float("inf"), 1e-40], dtype=mx.bfloat16)  # 1e-40: subnormal
    scales = mx.broadcast_to(special.reshape(1, 1, 1, 4)[..., :1], cache[0].keys[1].shape)
    cache[0].keys = (cache[0].keys[0], mx.contiguous(scales.astype(mx.bfloat16)), cache[0].keys[2])
    mx.eval(cache[0].keys)
    store.save_cache(tmp_path, SPEC, "a", store.cache_to_host(cache), meta_for(3))
    assert_same_cache(cache, store.host_to_cache(store.load_cache(tmp_path, SPEC, "a")[0]))


def test_spare_buffer_beyond_offset_is_not_stored(tmp_path):
    from mlx_lm.models.cache import QuantizedKVCache

    c = QuantizedKVCache(group_size=64, bits=4)
    c.update_and_fetch(mx.random.normal((1, 2, 10, 64)), mx.random.normal((1, 2, 10, 64)))  # 256-step buffer
    host = store.cache_to_host([c, c])
    assert host.n_tokens == 10 and all(a.shape[2] == 10 for a in host.tensors.values())


def test_trim_host_and_trim_cache_keep_the_first_tokens(tmp_path):
    cache = q4_cache(20)
    host, meta = store.cache_to_host(cache), meta_for(20)
    h, m = store.trim_host(host, meta, 7)
    assert h.n_tokens == 7 and m.token_ids == meta.token_ids[:7] and m.text == meta.text[:7]
    assert_same_cache(store.host_to_cache(h), store.trim_cache(cache, 7))
    assert store.trim_host(host, meta, 0)[0].tensors == {}
    with pytest.raises(ValueError):
        store.trim_host(host, meta, 21)


def test_inconsistent_cache_or_metadata_is_refused_on_save(tmp_path):
    host = store.cache_to_host(q4_cache(5))
    with pytest.raises(ValueError, match="token ids"):
        store.save_cache(tmp_path, SPEC, "a", host, meta_for(4))
    with pytest.raises(ValueError, match="out of order"):
        store.save_cache(tmp_path, SPEC, "a", host, CacheMeta(1, [1] * 5, [1, 2, 9, 3, 4], "xxxx"))
    assert not (tmp_path / SPEC.fingerprint / "a" / store.CACHE_FILE).exists()


@pytest.mark.parametrize("ends,text,bad", [
    ([1, 2, 3, 4, 4], "xxxx", None), ([-1, 0, -1, 4, -1], "xxxx", None), ([], "", None),  # ends may repeat; -1 skipped
    ([1, 3, 2, 4, 4], "xxxxxxxx", 2),  # out of order within the text
    ([1, 2, 3, 4, 9], "xxxx", 9),  # in order, the last past the text
    ([5, -1, 2, -1, 3], "xxxxxx", 2),  # out of order across skipped ends
])
def test_the_metas_token_ends_are_checked_in_order_and_within_the_text(ends, text, bad):
    from runtime.hostcache import _check_meta

    meta = CacheMeta(1, [0] * len(ends), ends, text)
    if bad is None:
        _check_meta(meta, len(ends))
    else:
        with pytest.raises(ValueError, match=f"token end {bad} out of order or past the text"):
            _check_meta(meta, len(ends))


def test_the_message_spans_round_trip_through_the_file_are_cut_with_the_text_and_checked(tmp_path):
    """A cache's message spans come back from its file as they went in (a file without them loads with None:
    not known), a cut of the cache cuts them with its text, and spans out of order or past the text are refused."""
    from dataclasses import replace

    host, meta = store.cache_to_host(q4_cache(8)), replace(meta_for(8), spans=((1, 3), (5, 8)))
    store.save_cache(tmp_path, SPEC, "a", host, meta)
    assert store.load_cache(tmp_path, SPEC, "a")[1].spans == ((1, 3), (5, 8))
    store.save_cache(tmp_path, SPEC, "b", host, meta_for(8))
    assert store.load_cache(tmp_path, SPEC, "b")[1].spans is None
    assert store.trim_host(host, meta, 6)[1].spans == ((1, 3), (5, 6))
    assert store.trim_host(host, meta, 4)[1].spans == ((1, 3),)
    for bad in (((3, 1),), ((1, 3), (2, 4)), ((5, 9),), ((1, 1),)):
        with pytest.raises(ValueError, match="message span"):
            store.save_cache(tmp_path, SPEC, "c", host, replace(meta, spans=bad))


def test_a_host_cache_with_a_missing_renamed_mistyped_or_short_tensor_is_refused():
    """`_check_host` (every write runs it) names what is wrong: a tensor missing or unexpected, a dtype, a length."""
    host = store.cache_to_host(q4_cache(6, dtype=mx.bfloat16))
    hostcache._check_host(host)
    name = sorted(host.tensors)[0]
    cases = [
        ({k: v for k, v in host.tensors.items() if k != name}, "missing or unexpected"),
        ({**{k: v for k, v in host.tensors.items() if k != name}, name + "x": host.tensors[name]}, "missing or unexpected"),
        ({**host.tensors, name: host.tensors[name].astype(np.float32)}, f"{name}: float32"),
        ({**host.tensors, name: host.tensors[name][:, :, :5]}, r"\(1, H, 6, D\)"),
    ]
    for tensors, match in cases:
        with pytest.raises(ValueError, match=match):
            hostcache._check_host(dataclasses.replace(host, tensors=tensors))


# ---------------------------------------------------------------- corruption


def assert_fallback(tmp_path, records, error):
    """load_agent reports `error` and keeps the full history; a re-prefilled cache then loads."""
    loaded = store.load_agent(tmp_path, SPEC, "a")
    assert loaded.host is None and type(loaded.error) is error, loaded.error
    assert loaded.records == records
    assert str(loaded.error)  # a message that says what happened
    # the fallback: re-prefill from the journal, save, and the next load is warm again
    T = len(loaded.records[-1]["text"])
    store.save_cache(tmp_path, SPEC, "a", store.cache_to_host(q4_cache(T)), meta_for(T, seq=records[-1]["seq"]))
    assert store.load_agent(tmp_path, SPEC, "a").host.n_tokens == T


def test_truncation_at_random_offsets(tmp_path):
    path, records = saved(tmp_path, T=70)
    data = path.read_bytes()
    rng = random.Random(5)
    for cut in [0, 4, 9] + rng.sample(range(10, len(data)), 7):
        path.write_bytes(data[:cut])
        with pytest.raises(store.TruncatedCache, match="cut short"):
            store.load_cache(tmp_path, SPEC, "a")
    assert_fallback(tmp_path, records, store.TruncatedCache)


def test_flipped_bytes_in_header_and_body(tmp_path):
    path, records = saved(tmp_path, T=70)
    data = path.read_bytes()
    n = int.from_bytes(data[:8], "little")
    header_positions = list(range(8, 8 + n, max(1, n // 60)))
    header_positions += [data.index(b"fp-test"), data.index(b"token_ids") + 12, data.index(b"crc32:") + 8]
    for pos in header_positions:
        path.write_bytes(data[:pos] + bytes([data[pos] ^ 0xFF]) + data[pos + 1 :])
        with pytest.raises((store.CorruptCache, store.ChecksumMismatch)):
            store.load_cache(tmp_path, SPEC, "a")
    for pos in random.Random(1).sample(range(8 + n, len(data)), 20):
        path.write_bytes(data[:pos] + bytes([data[pos] ^ 0x01]) + data[pos + 1 :])
        with pytest.raises(store.ChecksumMismatch):
            store.load_cache(tmp_path, SPEC, "a")
    assert_fallback(tmp_path, records, store.ChecksumMismatch)


def test_another_models_cache(tmp_path):
    _, records = saved(tmp_path)
    other = spec(fingerprint="fp-other")
    store.save_cache(tmp_path, other, "x", store.cache_to_host(q4_cache(40)), meta_for(40))
    foreign = tmp_path / "fp-other" / "x" / store.CACHE_FILE
    os.replace(foreign, tmp_path / SPEC.fingerprint / "a" / store.CACHE_FILE)
    with pytest.raises(store.ForeignModel, match="fp-other"):
        store.load_cache(tmp_path, SPEC, "a")
    assert_fallback(tmp_path, records, store.ForeignModel)


def test_a_cache_of_the_same_fingerprint_and_other_weights_or_none_named_is_another_models(tmp_path):
    """Caches name the model by `model_tag` (fingerprint and weights' digest): one written under other weights
    of the same fingerprint, or before digests were written, is ForeignModel, saying why; the history stays."""
    weighed = spec(weights="w" * 32)
    records = [store.journal_record(0, "user", "x" * 40)]
    store.append_journal(tmp_path, weighed, "a", records)
    for writer in (spec(weights="v" * 32), SPEC):
        store.save_cache(tmp_path, writer, "a", store.cache_to_host(q4_cache(40)), meta_for(40))
        with pytest.raises(store.ForeignModel, match="the same fingerprint: other weight bytes"):
            store.load_cache(tmp_path, weighed, "a")
        loaded = store.load_agent(tmp_path, weighed, "a")
        assert loaded.host is None and type(loaded.error) is store.ForeignModel and loaded.records == records
    store.save_cache(tmp_path, weighed, "a", store.cache_to_host(q4_cache(40)), meta_for(40))
    assert store.load_agent(tmp_path, weighed, "a").host.n_tokens == 40


@pytest.mark.parametrize("bits, group", [(8, 64), (4, 32)])
def test_other_bits_or_group(tmp_path, bits, group):
    _, records = saved(tmp_path, bits=bits, group=group)
    with pytest.raises(store.QuantizationMismatch, match=f"stored as k{bits}v{bits}-g{group}, the runtime uses k4v4-g64"):
        store.load_cache(tmp_path, SPEC, "a")
    assert_fallback(tmp_path, records, store.QuantizationMismatch)


@pytest.mark.parametrize("change", [{"n_layers": 3}, {"n_kv_heads": 4}, {"k_head_dim": 128}, {"dtype": "bfloat16"}])
def test_shapes_that_contradict_the_spec(tmp_path, change):
    path, _ = saved(tmp_path)
    with pytest.raises(store.ShapeMismatch, match="does not fit"):
        store.decode_cache(path.read_bytes(), spec(**change))


def test_wrong_shape_on_disk_falls_back(tmp_path):
    _, records = saved(tmp_path, heads=4)
    assert_fallback(tmp_path, records, store.ShapeMismatch)


def rewrite_header(path, **changes):
    """Rewrite a cache file with changed `__metadata__` entries (a valid safetensors file)."""
    data = path.read_bytes()
    n = int.from_bytes(data[:8], "little")
    header = json.loads(data[8 : 8 + n])
    info = {**header.pop("__metadata__"), **changes}
    arrays = {k: np.frombuffer(data[8 + n + v["data_offsets"][0] : 8 + n + v["data_offsets"][1]], np.uint8) for k, v in header.items()}
    dt = {"U32": "uint32", "F32": "float32", "BF16": "bfloat16", "F16": "float16"}
    specs = {k: TensorSpec(dtype=dt[v["dtype"]], shape=v["shape"], data_ptr=arrays[k].ctypes.data, data_len=arrays[k].nbytes) for k, v in header.items()}
    path.write_bytes(serialize(specs, info))


def test_unknown_format_version(tmp_path):
    path, records = saved(tmp_path)
    rewrite_header(path, format_version="2")
    with pytest.raises(store.UnsupportedVersion, match="version '2'"):
        store.load_cache(tmp_path, SPEC, "a")
    assert_fallback(tmp_path, records, store.UnsupportedVersion)


def test_valid_safetensors_that_is_not_ours(tmp_path):
    path, records = saved(tmp_path)
    rewrite_header(path, format="something-else")
    assert_fallback(tmp_path, records, store.CorruptCache)


@pytest.mark.parametrize("garbage", [b"\x00" * 64, os.urandom(5000), b'{"json": "not safetensors"}' * 3, b"\x10\x00\x00\x00\x00\x00\x00\x00[1,2,3]         "])
def test_garbage(tmp_path, garbage):
    path, records = saved(tmp_path)
    path.write_bytes(garbage)
    with pytest.raises(store.CacheError) as e:
        store.load_cache(tmp_path, SPEC, "a")
    assert type(e.value) in (store.CorruptCache, store.TruncatedCache)
    assert_fallback(tmp_path, records, type(e.value))


def test_missing_cache_is_a_cold_start(tmp_path):
    loaded = store.load_agent(tmp_path, SPEC, "nobody")
    assert loaded.records == [] and isinstance(loaded.error, store.CacheMissing)


# ---------------------------------------------------------------- journal


def test_journal_round_trip_and_idempotent_append(tmp_path):
    recs = [store.journal_record(i, ("user", "assistant")[i % 2], f"msg {i} é🙂", turn_id=f"t{i // 2}",
                                 sender="bob" if i % 2 == 0 else None) for i in range(6)]  # three turns
    assert store.append_journal(tmp_path, SPEC, "a", recs[:4]) == recs[:4]
    assert store.append_journal(tmp_path, SPEC, "a", recs[1:]) == recs[4:]  # seqs 1, 2, 3 already there
    assert store.read_journal(tmp_path, SPEC, "a") == recs


def test_torn_journal_tail_is_dropped_then_repaired(tmp_path):
    recs = [store.journal_record(i, "user", "x" * i) for i in range(4)]
    store.append_journal(tmp_path, SPEC, "a", recs)
    path = tmp_path / SPEC.fingerprint / "a" / store.JOURNAL_FILE
    data = path.read_bytes()
    last = len(store.encode_records(recs[-1:]))
    for cut in range(len(data) - last, len(data)):  # every cut inside the last frame
        path.write_bytes(data[:cut])
        assert store.read_journal(tmp_path, SPEC, "a") == recs[:3]
    # flip the last byte: writing a 0 changed nothing in the runs where it was 0 already (records carry the time)
    damaged = data[:-1] + bytes([data[-1] ^ 0xFF])
    path.write_bytes(damaged)  # crc catches it
    assert store.read_journal(tmp_path, SPEC, "a") == recs[:3]
    store.append_journal(tmp_path, SPEC, "a", [store.journal_record(3, "user", "again")])
    assert [r["text"] for r in store.read_journal(tmp_path, SPEC, "a")] == ["", "x", "xx", "again"]
    torn = list(path.parent.glob("journal.torn-*"))
    assert len(torn) == 1 and torn[0].read_bytes() == damaged[-last:]


def test_journal_of_another_format_is_not_touched(tmp_path):
    folder = tmp_path / SPEC.fingerprint / "a"
    folder.mkdir(parents=True)
    (folder / store.JOURNAL_FILE).write_bytes(b"kvactors-journal-9\nfuture")
    with pytest.raises(store.JournalError):
        store.read_journal(tmp_path, SPEC, "a")
    with pytest.raises(store.JournalError):
        store.append_journal(tmp_path, SPEC, "a", [store.journal_record(0, "user", "x")])
    assert (folder / store.JOURNAL_FILE).read_bytes() == b"kvactors-journal-9\nfuture"


def journal_of(tmp_path, n, agent="a"):
    """Append records 0..n-1 (texts of several lengths; turns of a user and an assistant record, as an agent writes
    them) for `agent`; return (journal path, records, frame spans)."""
    recs = [store.journal_record(i, ("user", "assistant")[i % 2], f"message {i} " + "y" * (7 * i % 40),
                                 turn_id=f"t{i // 2}") for i in range(n)]
    store.append_journal(tmp_path, SPEC, agent, recs)
    path = tmp_path / SPEC.fingerprint / agent / store.JOURNAL_FILE
    return path, recs, store.scan_journal(path.read_bytes()).frames


@pytest.mark.parametrize("damage", ["flip", "length", "zeros", "garbage"])
def test_mid_file_damage_keeps_every_record_that_checks(tmp_path, damage):
    path, recs, frames = journal_of(tmp_path, 12)
    data = bytearray(path.read_bytes())
    hit = {"flip": [4], "length": [4], "zeros": [4, 5], "garbage": [4, 5, 6]}[damage]
    start, stop = frames[hit[0]][0], frames[hit[-1]][1]
    if damage == "flip":
        data[start + 12] ^= 0x40
    elif damage == "length":
        data[start : start + 4] = (1 << 30).to_bytes(4, "little")  # a frame that claims to run past the end
    elif damage == "zeros":
        data[start:stop] = bytes(stop - start)
    else:
        data[start:stop] = random.Random(0).randbytes(stop - start + 9)  # the span even changes length
    path.write_bytes(bytes(data))
    kept = [r for i, r in enumerate(recs) if i not in hit]
    assert store.read_journal(tmp_path, SPEC, "a") == kept  # records after the damage are not dropped
    scan = store.scan_journal(path.read_bytes())
    assert len(scan.damaged) == 1 and scan.torn == 0
    assert scan.losses() == [f"bytes {scan.damaged[0][0]}..{scan.damaged[0][1]} ({scan.damaged[0][1] - scan.damaged[0][0]} B) "
                             f"unreadable: records after seq {hit[0] - 1} and before seq {hit[-1] + 1} lost"]
    damaged = bytes(data)
    after = store.journal_record(12, "user", "after")
    assert store.append_journal(tmp_path, SPEC, "a", [after]) == [after]
    assert store.read_journal(tmp_path, SPEC, "a") == kept + [after]
    again = store.scan_journal(path.read_bytes())
    assert not again.damaged and not again.torn  # rewritten from the good frames
    [kept_aside] = path.parent.glob("journal.damaged-*")
    assert kept_aside.read_bytes() == damaged  # nothing is thrown away


def test_random_damage_never_loses_an_intact_frame(tmp_path):
    path, recs, frames = journal_of(tmp_path, 30)
    good = path.read_bytes()
    rng = random.Random(1)
    for _ in range(40):
        data = bytearray(good)
        a = rng.randrange(len(store.JOURNAL_MAGIC), len(data) - 1)
        b = min(len(data), a + rng.randrange(1, 300))
        data[a:b] = rng.randbytes(b - a)
        scan = store.scan_journal(bytes(data))
        records = scan.records
        intact = [r for r, (s, e) in zip(recs, frames) if e <= a or s >= b]
        if scan.torn and intact and intact[-1]["role"] == "user" and frames[recs.index(intact[-1])][1] <= a:
            intact = intact[:-1]  # the user record of a turn torn after it goes with the tail: no half turns
        assert all(r in records for r in intact)  # resynchronisation found every other untouched frame
        assert [r["seq"] for r in records] == sorted({r["seq"] for r in records})


@pytest.mark.parametrize("stray", ["a high seq spliced in", "a repeated seq", "a field of the wrong type"])
def test_records_that_check_but_break_the_order_or_types_are_the_fewest_dropped(tmp_path, stray):
    """Every frame checks, but one record's seq breaks the rising order (all the later, acknowledged records
    were dropped as a torn tail) or a field the runtime reads has the wrong type (its agent crashed at every
    start and escalated): that one record is dropped as damage, every other kept."""
    path, recs, frames = journal_of(tmp_path, 10)
    odd = {"a high seq spliced in": dict(recs[2], seq=1000), "a repeated seq": dict(recs[6], text="again"),
           "a field of the wrong type": dict(recs[4], conv="x")}[stray]
    good = path.read_bytes()
    at = frames[4][0]
    payload = msgpack.packb(odd, use_bin_type=True)  # framed by hand: encode_records refuses a wrong type
    frame = len(payload).to_bytes(4, "little") + zlib.crc32(payload).to_bytes(4, "little") + payload
    replaced = frames[4][1] if stray == "a field of the wrong type" else at  # it takes record 4's place
    path.write_bytes(good[:at] + frame + good[replaced:])
    if stray == "a field of the wrong type":
        recs = recs[:4] + recs[5:]
    scan = store.scan_journal(path.read_bytes())
    assert scan.records == recs and scan.torn == 0
    assert scan.damaged == [(at, at + len(frame))]
    after = store.journal_record(10, "user", "after")
    assert store.append_journal(tmp_path, SPEC, "a", [after]) == [after]
    assert store.read_journal(tmp_path, SPEC, "a") == recs + [after]


class _CountingZlib:
    """Stands in for `journal`'s zlib module and counts the bytes it checksums."""

    def __init__(self):
        self.bytes = 0

    def crc32(self, data, value=0):
        self.bytes += len(data)
        return zlib.crc32(data, value)


@pytest.mark.parametrize("where", ["appended", "in the middle"])
def test_garbage_in_a_journal_is_scanned_in_time_linear_in_its_bytes(tmp_path, monkeypatch, where):
    """4 MiB of random bytes: the scan checksums about the file once (trying every byte with its random length
    field checksummed ~60 times the file: the scan ran on the one persistence actor and held up every agent)."""
    path, recs, frames = journal_of(tmp_path, 12)
    good = path.read_bytes()
    garbage = random.Random(2).randbytes(4 << 20)
    data = good + garbage if where == "appended" else good[: frames[6][0]] + garbage + good[frames[6][0]:]
    counting = _CountingZlib()
    monkeypatch.setattr(journal, "zlib", counting)
    scan = store.scan_journal(data)
    assert counting.bytes <= 2 * len(data)
    assert scan.records == recs
    if where == "appended":
        assert scan.torn == len(garbage) and not scan.damaged
    else:
        assert scan.damaged == [(frames[6][0], frames[6][0] + len(garbage))] and scan.torn == 0


def test_a_record_whose_seq_is_not_its_first_key_is_found_again_past_damage(tmp_path):
    """Frames are found again by their payload's first key, "seq": `encode_records` puts it first whatever the
    order of the record's keys; a record whose text is "seq" does not confuse the search."""
    recs = [store.journal_record(i, "user", "seq") for i in range(4)]
    recs[2] = {"text": "reordered", "role": "user", "time": 1.0, "seq": 2}
    data = bytearray(store.JOURNAL_MAGIC + store.encode_records(recs))
    frames = store.scan_journal(bytes(data)).frames
    data[frames[1][0] + 10] ^= 0x10
    scan = store.scan_journal(bytes(data))
    assert scan.records == [recs[0], recs[2], recs[3]] and scan.damaged == [frames[1]]


@pytest.mark.parametrize("damage", ["every byte flipped in turn", "zeros", "cut"])
def test_a_damaged_header_keeps_every_record_and_is_rewritten(tmp_path, damage):
    """The first bytes of a journal damaged (one byte flipped, the first disk block zeroed, bytes lost): the
    records that check are kept and the header rewritten, the damaged file kept aside; only the records
    whose own bytes were hit are lost and reported."""
    path, recs, frames = journal_of(tmp_path, 12)
    good = path.read_bytes()
    n = len(store.JOURNAL_MAGIC)
    if damage == "every byte flipped in turn":
        for i in range(n):
            data = bytearray(good)
            data[i] ^= 0x40 if i == n - 2 else 0x01  # '1' -> 'q', not a digit: another version number
            scan = store.scan_journal(bytes(data))
            assert scan.header_damaged and scan.records == recs and not scan.damaged and not scan.torn
            assert scan.losses() == [f"the header (first {n} B) was unreadable and is rewritten"]
        lost = []
    elif damage == "zeros":
        data = bytearray(good)
        data[:frames[2][1] - 3] = bytes(frames[2][1] - 3)  # the header and the first three records
        lost = [0, 1, 2]
    else:
        data = bytearray(good[5:])
        lost = []
    path.write_bytes(bytes(data))
    kept = [r for i, r in enumerate(recs) if i not in lost]
    assert store.read_journal(tmp_path, SPEC, "a") == kept
    after = store.journal_record(12, "user", "after")
    assert store.append_journal(tmp_path, SPEC, "a", [after]) == [after]
    again = store.scan_journal(path.read_bytes())
    assert again.records == kept + [after] and not again.header_damaged and not again.damaged
    [kept_aside] = path.parent.glob("journal.damaged-*")
    assert kept_aside.read_bytes() == bytes(data)


@pytest.mark.parametrize("data", [b"kvactors-journal-2\n", b"not a journal at all, " * 40, b"\x00" * 4096])
def test_a_file_with_no_record_or_of_a_newer_version_is_not_a_damaged_header(tmp_path, data):
    """Bytes that do not start with the magic and hold no record that checks, or a newer version's magic
    (records or not), are not repaired: JournalError, the file untouched."""
    path, recs, _ = journal_of(tmp_path, 3)
    body = path.read_bytes()[len(store.JOURNAL_MAGIC):] if data.startswith(b"kvactors") else b""
    path.write_bytes(data + body)
    with pytest.raises(store.JournalError, match="newer journal version" if body else "not a kvactors journal"):
        store.append_journal(tmp_path, SPEC, "a", [store.journal_record(3, "user", "x")])
    assert path.read_bytes() == data + body and not list(path.parent.glob("journal.*-*"))


def test_a_failed_append_leaves_the_journal_as_it_was(tmp_path, monkeypatch):
    path, recs, _ = journal_of(tmp_path, 4)
    before = path.read_bytes()
    real = journal._pwrite

    def disk_full(fd, data, offset):  # the kernel wrote part of the frame, then the disk was full
        if len(data) > 8:
            real(fd, bytes(data[: len(data) // 2]), offset)
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(journal, "_pwrite", disk_full)
    with pytest.raises(OSError) as full:
        store.append_journal(tmp_path, SPEC, "a", [store.journal_record(4, "user", "z" * 500)])
    assert full.value.errno == errno.ENOSPC
    assert path.read_bytes() == before  # cut back to the last good frame
    monkeypatch.setattr(journal, "_pwrite", real)
    later = store.journal_record(4, "user", "later")
    assert store.append_journal(tmp_path, SPEC, "a", [later]) == [later]
    assert store.read_journal(tmp_path, SPEC, "a") == recs + [later]
    assert not list(path.parent.glob("journal.torn-*"))


def test_symlinks_inside_the_store_are_never_followed(tmp_path):
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / store.JOURNAL_FILE).write_bytes(store.JOURNAL_MAGIC)
    root = tmp_path / "cache"
    (root / SPEC.fingerprint).mkdir(parents=True)
    (root / SPEC.fingerprint / "planted").symlink_to(outside)  # an agent folder that points out
    with pytest.raises(store.UnsafePath):
        store.append_journal(root, SPEC, "planted", [store.journal_record(0, "user", "x")])
    with pytest.raises(store.UnsafePath):
        store.read_journal(root, SPEC, "planted")
    assert isinstance(store.load_agent(root / "none", SPEC, "x").error, store.CacheMissing)
    with pytest.raises(store.UnsafePath):
        store.load_agent(root, SPEC, "planted")
    _, recs = saved(root, agent="b")
    folder = root / SPEC.fingerprint / "b"
    for name in (store.JOURNAL_FILE, store.CACHE_FILE):  # files planted as links
        target = outside / name
        target.write_bytes((folder / name).read_bytes())
        (folder / name).unlink()
        (folder / name).symlink_to(target)
    with pytest.raises(store.JournalError):
        store.append_journal(root, SPEC, "b", [store.journal_record(9, "user", "x")])
    with pytest.raises(store.UnreadableCache):
        store.load_cache(root, SPEC, "b")
    assert store.scan_journal((outside / store.JOURNAL_FILE).read_bytes()).records == recs  # untouched
    assert store.agent_folders(root) == [folder]  # housekeeping never enters the planted folder
    store.prune(root, 0, journals=True, now=float("inf"))
    with pytest.raises(store.UnsafePath):
        store.delete(root, SPEC, "planted")
    assert sorted(p.name for p in outside.iterdir()) == [store.CACHE_FILE, store.JOURNAL_FILE]


def test_deleting_files_in_cache_dir_does_not_release_its_lock(tmp_path):
    fd = store.lock_cache_dir(tmp_path)
    try:
        for p in tmp_path.iterdir():
            p.unlink()  # e.g. a cleanup that removes a lock file
        with pytest.raises(store.CacheDirInUse):
            store.lock_cache_dir(tmp_path)
    finally:
        os.close(fd)
    os.close(store.lock_cache_dir(tmp_path))


def test_bad_records_are_refused():
    with pytest.raises(ValueError):
        store.encode_records([{"seq": "1", "role": "user", "text": "x"}])
    with pytest.raises(ValueError):
        store.journal_record(1, "user", b"bytes")


# ---------------------------------------------------------------- ids, permissions, files


BAD_IDS = ["", ".", "..", "../x", "a/../../b", "/etc", "a/b", "a\\b", "-a", ".hidden", "_a", "a b", "a\n", "a\x00b", "é", "a" * 129, None, 3, "model.json",
           "MODEL.json", "Model.Json"]  # a case-insensitive file system takes these for the store's model.json


@pytest.mark.parametrize("agent", BAD_IDS)
def test_malformed_agent_ids_are_rejected(tmp_path, agent):
    with pytest.raises(store.InvalidAgentId):
        store.agent_dir(tmp_path, SPEC.fingerprint, agent)
    with pytest.raises(store.InvalidAgentId):
        store.append_journal(tmp_path, SPEC, agent, [])
    with pytest.raises(store.InvalidAgentId):
        store.load_agent(tmp_path, SPEC, agent)
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("agent", ["a", "Z", "0", "alice.v2_x-1", "a" * 128, "a..b"])
def test_valid_agent_ids_stay_inside_their_folder(tmp_path, agent):
    folder = store.agent_dir(tmp_path, SPEC.fingerprint, agent)
    assert folder.parent == tmp_path / SPEC.fingerprint and folder.name == agent


def test_fingerprint_cannot_escape(tmp_path):
    with pytest.raises(ValueError):
        store.agent_dir(tmp_path, "../x", "a")


def test_permissions_files_0600_folders_0700(tmp_path):
    old = os.umask(0)  # a permissive umask must not leak through
    try:
        root = tmp_path / "cache"
        saved(root)
    finally:
        os.umask(old)
    folders = [root, root / SPEC.fingerprint, root / SPEC.fingerprint / "a"]
    assert [stat.S_IMODE(d.stat().st_mode) for d in folders] == [0o700] * 3
    files = list(folders[-1].iterdir())
    assert sorted(f.name for f in files) == [store.CACHE_FILE, store.JOURNAL_FILE, store.HIGH_FILE]  # no temp left
    assert all(stat.S_IMODE(f.stat().st_mode) == 0o600 for f in files)


def test_failed_atomic_write_leaves_old_file_and_no_temp(tmp_path, monkeypatch):
    path = tmp_path / "f"
    store.write_atomic(path, b"old")

    def boom(fd):
        raise OSError("disk full")

    monkeypatch.setattr(store.os, "fsync", boom)
    with pytest.raises(OSError, match="disk full"):
        store.write_atomic(path, b"new")
    assert path.read_bytes() == b"old" and os.listdir(tmp_path) == ["f"]


def test_prune_reads_the_files_own_times_and_says_what_it_deleted_when_the_folder_stays(tmp_path):
    """A symlinked cache pointing at a fresh file made an idle agent look active (its target's time was read);
    damaged journal copies kept a pruned folder, and a folder that stayed (something not kvactors' in it) was
    still reported as deleted."""
    saved(tmp_path, agent="old")
    folder = tmp_path / SPEC.fingerprint / "old"
    (folder / "journal.damaged-1").write_bytes(b"kept damaged history")
    past = os.path.getmtime(folder / store.CACHE_FILE) - 3600
    (tmp_path / "fresh").write_bytes(b"x")
    (folder / store.CACHE_FILE).unlink()
    (folder / store.CACHE_FILE).symlink_to(tmp_path / "fresh")
    for f in folder.iterdir():
        os.utime(f, (past, past), follow_symlinks=False)
    assert store.prune(tmp_path, 600, journals=True) == [folder]
    assert not folder.exists() and (tmp_path / "fresh").exists()  # the link went, its target did not
    saved(tmp_path, agent="old")
    (folder / "someone-else's").mkdir()
    for f in folder.iterdir():
        os.utime(f, (past, past), follow_symlinks=False)
    gone = store.prune(tmp_path, 600, journals=True)
    assert folder.exists() and gone and all(p.parent == folder for p in gone)
    assert sorted(p.name for p in folder.iterdir()) == ["someone-else's"]


def test_prune_logs_each_agent_it_could_not_prune_with_the_reason_and_goes_on(tmp_path):
    """An agent folder prune cannot delete in (a read-only folder) or search is left as it is and logged as a
    warning that names it, the file and why; the other agents are still pruned. (It was skipped without a word:
    nothing said that agent's cache stayed; a folder that cannot be searched was even taken for an empty one.) Run
    in a process of its own, where root obeys the folders' permissions."""
    for agent in ("hidden", "locked", "open"):
        saved(tmp_path, agent=agent)
    folder = tmp_path / SPEC.fingerprint
    script = ("import logging, sys; from runtime import store; logging.basicConfig(format='%(levelname)s %(message)s')"
              "; print(*store.prune(sys.argv[1], 0, now=float('inf')), sep='\\n')")
    cmd = [sys.executable, "-c", script, str(tmp_path)]
    if os.geteuid() == 0:  # root searches and deletes in any folder: drop the capabilities that let it
        setpriv = shutil.which("setpriv")
        if setpriv is None:
            pytest.skip("root deletes in a read-only folder and setpriv is not here to drop that")
        cmd = [setpriv, "--bounding-set=-dac_override,-dac_read_search", *cmd]
    (folder / "hidden").chmod(0)
    (folder / "locked").chmod(0o555)
    try:
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=120, cwd=ROOT)
    finally:
        (folder / "hidden").chmod(0o755)
        (folder / "locked").chmod(0o755)
    assert out.returncode == 0, out.stderr
    assert out.stdout.splitlines() == [str(folder / "open" / store.CACHE_FILE)], out.stdout
    assert (folder / "hidden" / store.CACHE_FILE).exists() and (folder / "locked" / store.CACHE_FILE).exists()
    warnings = [line for line in out.stderr.splitlines() if line.startswith("WARNING")]
    assert len(warnings) == 2, out.stderr
    for warning, agent in zip(warnings, ("hidden", "locked")):
        assert f"{folder / agent}/{store.CACHE_FILE}" in warning and "Permission denied" in warning, warning


def test_delete_and_retention(tmp_path):
    saved(tmp_path, agent="old")
    saved(tmp_path, agent="new")
    assert store.delete(tmp_path, SPEC, "new") and not store.delete(tmp_path, SPEC, "new")
    saved(tmp_path, agent="new")
    folder = tmp_path / SPEC.fingerprint
    past = os.path.getmtime(folder / "new" / store.CACHE_FILE) - 3600
    for f in (folder / "old").iterdir():
        os.utime(f, (past, past))
    (folder / "old" / ".cache.safetensors.1.ab.tmp").write_bytes(b"crash leftover")
    assert store.prune(tmp_path, 600) == [folder / "old" / store.CACHE_FILE]
    assert sorted(p.name for p in (folder / "old").iterdir()) == [store.JOURNAL_FILE, store.HIGH_FILE]  # history kept
    assert (folder / "new" / store.CACHE_FILE).exists()
    assert store.prune(tmp_path, 600, journals=True) == [folder / "old"]
    assert not (folder / "old").exists()
    model = tmp_path / "models" / "tiny-llama-v1"  # not an agent folder: never touched
    model.mkdir(parents=True)
    (model / "config.json").write_text("{}")
    os.utime(model / "config.json", (past, past))
    assert store.prune(tmp_path, 600, journals=True) == [] and (model / "config.json").exists()
    assert "tiny-llama" not in store.inspect_table(tmp_path)


def test_inspect_table(tmp_path):
    saved(tmp_path, agent="alice", T=12, seq=3)
    path, _ = saved(tmp_path, agent="bob", T=5)
    path.write_bytes(path.read_bytes()[:-3])
    store.append_journal(tmp_path, SPEC, "carol", [store.journal_record(0, "user", "hi")])
    (tmp_path / SPEC.fingerprint / "carol" / store.JOURNAL_FILE).open("ab").write(b"\x05\x00")
    table = store.inspect_table(tmp_path)
    print(table)
    lines = {line.split()[0]: line for line in table.splitlines()[3:]}
    assert table.startswith(f"model {SPEC.fingerprint} (3 agents)")
    assert " 12 " in lines["alice"] and lines["alice"].endswith("ok") and "#3 assistant" in lines["alice"]
    assert "bad cache: TruncatedCache" in lines["bob"]
    assert "the journal's last 2 B did not read (a torn tail: an append cut short)" in lines["carol"]
    assert "no cache" in lines["carol"]
    assert "no such folder" in store.inspect_table(tmp_path / "nope")


def test_inspect_tells_damage_to_acknowledged_records_from_a_torn_append(tmp_path):
    """A journal tail that did not read was always "a torn journal tail" in `kvactors inspect`, where the persistence
    actor's log tells an append cut short from damage to records the high-water mark says were acknowledged: both
    now say it in one wording (`journal.unread_tail`), the loss noted beside it."""
    records = [store.journal_record(0, "user", "hi"), store.journal_record(1, "assistant", "hello there")]
    for agent in ("erin", "fay"):
        store.append_journal(tmp_path, SPEC, agent, records)
        folder = tmp_path / SPEC.fingerprint / agent
        journal = folder / store.JOURNAL_FILE
        journal.write_bytes(journal.read_bytes()[:-3])  # the reply's frame cut (the append set the mark to 1)
    store.record_high_seq(tmp_path / SPEC.fingerprint / "erin", 0)  # erin's reply was never acknowledged
    lines = {line.split()[0]: line for line in store.inspect_table(tmp_path).splitlines()[3:]}
    assert "did not read (a torn tail: an append cut short)" in lines["erin"] and "lost" not in lines["erin"]
    assert "did not read (damage to acknowledged records)" in lines["fay"]
    assert "records up to seq 1 were written" in lines["fay"] and "those records are lost" in lines["fay"]


def test_inspect_names_the_model_recorded_beside_its_fingerprint(tmp_path):
    saved(tmp_path, agent="alice")
    model_dir = tmp_path / SPEC.fingerprint
    assert store.recorded_model(model_dir) is None
    assert store.inspect_table(tmp_path).startswith(f"model {SPEC.fingerprint} (1 agent)")  # older folders
    assert store.record_model(model_dir, "org/Some-Model") is True
    assert store.record_model(model_dir, "another") is False  # the first record stays
    assert json.loads((model_dir / store.MODEL_FILE).read_text()) == {"model_id": "org/Some-Model"}
    assert oct((model_dir / store.MODEL_FILE).stat().st_mode & 0o777) == "0o600"
    assert store.inspect_table(tmp_path).startswith(f"model org/Some-Model ({SPEC.fingerprint}) (1 agent)")
    assert [f.name for f in store.agent_folders(tmp_path)] == ["alice"]  # the file is no agent
    (model_dir / store.MODEL_FILE).write_text("not json")
    assert store.recorded_model(model_dir) is None
    assert store.inspect_table(tmp_path).startswith(f"model {SPEC.fingerprint} (1 agent)")


def test_stored_agent_summarizes_the_current_conversation(tmp_path):
    records = [store.journal_record(1, "system", "old"), store.journal_record(2, "user", "a"),
               store.journal_record(3, "assistant", "b"), store.journal_record(4, "system", "new"),
               store.journal_record(5, "user", "c"), store.journal_record(6, "assistant", "d"),
               store.journal_record(7, "user", "e")]
    store.append_journal(tmp_path, SPEC, "ann", records)
    folder = store.agent_dir(tmp_path, SPEC.fingerprint, "ann")
    assert store.stored_agent(folder) == store.StoredAgent("ann", 1, "new", 4, False)
    path, _ = saved(tmp_path, agent="bo")
    assert store.stored_agent(path.parent) == store.StoredAgent("bo", 1, "", 2, True)  # no system record: no prompt
    (folder / store.JOURNAL_FILE).unlink()
    (folder / store.JOURNAL_FILE).mkdir()  # a journal that cannot be read: never raises, turns unknown
    assert store.stored_agent(folder) == store.StoredAgent("ann", None, None, 0, False)


def test_records_name_their_conversation_so_a_lost_system_record_leaves_the_prompt_unknown_not_empty():
    check = store.prompt_check("new")
    records = [store.journal_record(1, "system", "old", conv=1), store.journal_record(2, "user", "a", conv=1),
               store.journal_record(4, "user", "c", conv=3, check=check),  # seq 3, the reset's "new", is gone
               store.journal_record(5, "assistant", "d", conv=3, check=check)]
    history = store.current_conversation(records)
    assert [r["seq"] for r in history] == [4, 5]  # the old conversation does not leak in
    assert store.conversation_prompt(history) is None and history[-1]["check"] == check
    restored = history + [store.journal_record(6, "system", "new", conv=3, check=check)]
    assert store.conversation_prompt(restored) == "new"  # a system record later in the conversation restores it
    assert store.conversation_prompt(store.current_conversation(records[:2])) == "old"
    assert store.conversation_prompt([store.journal_record(1, "user", "a", conv=1)]) == ""  # it never had one


# ---------------------------------------------------------------- hot tier


def test_hot_caches_lru_under_a_byte_budget():
    caches = {name: q4_cache(64, seed=i) for i, name in enumerate("abcd")}
    size = store.cache_nbytes(caches["a"])
    hot = store.HotCaches(budget_bytes=3 * size)
    assert hot.put("a", caches["a"]) == [] and hot.put("b", caches["b"]) == [] and hot.put("c", caches["c"]) == []
    assert hot.get("a") is caches["a"]  # a is now the most recent
    assert hot.put("d", caches["d"]) == ["b"]
    assert "b" not in hot and len(hot) == 3 and hot.nbytes == 3 * size
    assert hot.put("a", caches["a"]) == []  # replacing does not double count
    hot.discard("c")
    assert "c" not in hot and hot.nbytes == 2 * size
    hot.discard("a")
    assert hot.get("a") is None and hot.nbytes == size
    assert hot.put("huge", q4_cache(1024)) == ["d", "huge"]  # larger than the budget: not kept
    assert hot.nbytes == 0 and len(hot) == 0


def test_hot_caches_release_memory_when_agents_go():
    hot = store.HotCaches(budget_bytes=1 << 40)
    base = mx.get_active_memory()
    for i in range(4):
        hot.put(f"a{i}", q4_cache(2048, seed=i))
    held = mx.get_active_memory() - base
    assert held >= hot.nbytes > 0
    for i in range(4):
        hot.discard(f"a{i}")
    assert mx.get_active_memory() - base < held / 10


def test_parallel_and_serial_checksums_agree(tmp_path, monkeypatch):
    path, _ = saved(tmp_path, T=64)  # small: checksummed serially
    monkeypatch.setattr(cacheformat, "_PARALLEL_CRC_BYTES", 0)  # now in threads
    assert store.load_cache(tmp_path, SPEC, "a")[1].seq == 1
    data = bytearray(path.read_bytes())
    data[-5] ^= 1
    with pytest.raises(store.ChecksumMismatch):
        store.decode_cache(data, SPEC)


# ---------------------------------------------------------------- delta chains


DSPEC = spec(windows=(None, 50))  # layer 1 slides: it may store fewer tokens


def grown(host, keep, new, seed, bounded=None):
    """`host` cut to its first `keep` tokens plus `new` random rows; layer 1 keeps at most `bounded` rows."""
    rng = np.random.default_rng(seed)
    n = keep + new
    tensors, lengths = {}, []
    for i in range(host.n_layers):
        cap = bounded if (bounded and i == 1) else n
        old = host.length(i) - (host.n_tokens - keep) if host.n_tokens else 0
        for kind in ("keys", "values"):
            for part in ("packed", "scales", "biases"):
                name = f"layers.{i}.{kind}.{part}"
                width = 8 if part == "packed" else 1
                rows = rng.integers(0, 2**15, (1, 2, new, width)).astype(np.uint32 if part == "packed" else np.float32)
                prev = host.tensors[name][..., max(0, old - (cap - new)) : old, :] if old > 0 else rows[..., :0, :]
                tensors[name] = np.concatenate([prev, rows], axis=2)[..., -cap:, :]
        lengths.append(min(cap, n))
    lengths = () if all(x == n for x in lengths) else tuple(lengths)
    return store.HostCache(tensors, "float32", 4, 64, host.n_layers, n, lengths)


def write_segment(tmp_path, host, meta, last, reuse):
    name, data, segment = store.next_segment(host, meta, SPEC.fingerprint, last, reuse)
    folder = store.agent_dir(tmp_path, SPEC.fingerprint, "a")
    store.make_dirs(folder)
    store.write_atomic(folder / name, data)
    if name == store.CACHE_FILE:
        store.remove_deltas(folder)
    return name, (folder / name).stat().st_size, segment


def assert_loads_as(tmp_path, host, meta):
    got, got_meta = store.load_cache(tmp_path, DSPEC, "a")
    assert got_meta == meta and got.n_tokens == host.n_tokens
    assert all(got.tensors[k].tobytes() == v.tobytes() for k, v in host.tensors.items())


@pytest.mark.parametrize("bounded", [None, 60])
def test_delta_chain_round_trips_bit_exact_and_stays_small(tmp_path, bounded):
    empty = store.HostCache({}, "float32", 4, 64, 2, 0)
    host = grown(empty, 0, 400, seed=0, bounded=bounded)
    name, size, last = write_segment(tmp_path, host, meta_for(400, seq=1), None, None)
    assert name == store.CACHE_FILE
    names = []
    for seq, (keep_back, new) in enumerate([(0, 30), (5, 20), (0, 1), (12, 40), (0, 25)], start=2):
        keep = host.n_tokens - keep_back  # a prefix trim, then new rows
        host = grown(host, keep, new, seed=seq, bounded=bounded)
        meta = meta_for(host.n_tokens, seq=seq)
        name, delta_size, last = write_segment(tmp_path, host, meta, last, (seq - 1, keep))
        names.append(name)
        assert delta_size < size / 4
        assert_loads_as(tmp_path, host, meta)
    assert names == [store.DELTA_FILE.format(k) for k in range(1, 6)]
    assert store.cache_seq(store.agent_dir(tmp_path, SPEC.fingerprint, "a")) == 6


def test_full_write_when_reuse_does_not_match_the_disk_or_deltas_outgrow_it(tmp_path):
    empty = store.HostCache({}, "float32", 4, 64, 2, 0)
    host = grown(empty, 0, 100, seed=0)
    _, _, last = write_segment(tmp_path, host, meta_for(100, 1), None, None)
    host2 = grown(host, 100, 10, seed=2)
    assert write_segment(tmp_path, host2, meta_for(110, 2), last, (0, 100))[0] == store.CACHE_FILE  # not seq 1's
    _, _, last = write_segment(tmp_path, host2, meta_for(110, 2), None, None)
    name, _, last = write_segment(tmp_path, grown(host2, 110, 60, seed=3), meta_for(170, 3), last, (2, 110))
    assert name == store.DELTA_FILE.format(1)
    host4 = grown(host2, 110, 120, seed=4)  # more new rows than the full file holds: rewrite it
    assert write_segment(tmp_path, host4, meta_for(230, 4), last, (3, 110))[0] == store.CACHE_FILE
    assert not list((tmp_path / SPEC.fingerprint / "a").glob("*.delta.*"))
    assert_loads_as(tmp_path, host4, meta_for(230, 4))


def test_stale_or_damaged_deltas_end_the_chain_at_a_real_state(tmp_path):
    empty = store.HostCache({}, "float32", 4, 64, 2, 0)
    states = [grown(empty, 0, 200, seed=0)]
    _, _, last = write_segment(tmp_path, states[0], meta_for(200, 1), None, None)
    for seq in (2, 3):
        states.append(grown(states[-1], states[-1].n_tokens, 10, seed=seq))
        _, _, last = write_segment(tmp_path, states[-1], meta_for(states[-1].n_tokens, seq), last, (seq - 1, states[-2].n_tokens))
    folder = tmp_path / SPEC.fingerprint / "a"
    second = folder / store.DELTA_FILE.format(2)
    data = bytearray(second.read_bytes())
    data[-3] ^= 0xFF
    second.write_bytes(bytes(data))  # damaged: the chain ends after delta 1
    assert_loads_as(tmp_path, states[1], meta_for(210, 2))
    # a crash after a new full file, before the old deltas went: they link to nothing now
    store.write_atomic(folder / store.CACHE_FILE, store.encode_cache(states[0], meta_for(200, 7), SPEC.fingerprint))
    assert_loads_as(tmp_path, states[0], meta_for(200, 7))
    assert store.cache_seq(folder) == 7


def test_a_chain_at_max_deltas_or_with_other_tokens_gets_a_full_file(tmp_path, monkeypatch):
    monkeypatch.setattr(cachechain, "MAX_DELTAS", 2)
    empty = store.HostCache({}, "float32", 4, 64, 2, 0)
    host = grown(empty, 0, 300, seed=0)
    _, _, last = write_segment(tmp_path, host, meta_for(300, 1), None, None)
    names = []
    for seq in (2, 3, 4):
        keep = host.n_tokens
        host = grown(host, keep, 10, seed=seq)
        name, _, last = write_segment(tmp_path, host, meta_for(host.n_tokens, seq), last, (seq - 1, keep))
        names.append(name)
        assert_loads_as(tmp_path, host, meta_for(host.n_tokens, seq))
    assert names == [store.DELTA_FILE.format(1), store.DELTA_FILE.format(2), store.CACHE_FILE]
    other = store.CacheMeta(5, [9] * 330, list(range(1, 331)), "x" * 330, "t5")  # a claim the token ids contradict
    assert write_segment(tmp_path, grown(host, 320, 10, seed=5), other, last, (4, 320))[0] == store.CACHE_FILE


def test_a_malformed_delta_ends_the_chain(tmp_path):
    empty = store.HostCache({}, "float32", 4, 64, 2, 0)
    first = grown(empty, 0, 200, seed=0)
    _, _, last = write_segment(tmp_path, first, meta_for(200, 1), None, None)
    second = grown(first, 200, 10, seed=2)
    name, parts, _ = store.next_segment(second, meta_for(210, 2), SPEC.fingerprint, last, (1, 200))
    data = b"".join(parts)
    header = cacheformat._parse_safetensors(data)[0]["__metadata__"]
    bad_meta = json.loads(header["meta"])
    bad_meta["delta"]["lengths"] = ["210", 210]  # well-formed file, nonsense link
    tensors = store.decode_cache(data)[0].tensors
    dtypes = {k: "U32" if k.endswith("packed") else "F32" for k in tensors}
    spec_bad = {k: TensorSpec(dtype="uint32" if k.endswith("packed") else "float32", shape=list(v.shape),
                              data_ptr=v.ctypes.data, data_len=v.nbytes) for k, v in tensors.items()}
    meta_json = json.dumps(bad_meta, separators=(",", ":"))
    raw_file = serialize(spec_bad, {**header, "meta": meta_json, "checksum": cacheformat._checksum(meta_json, tensors, dtypes)})
    store.write_atomic(tmp_path / SPEC.fingerprint / "a" / name, raw_file)
    assert_loads_as(tmp_path, first, meta_for(200, 1))


def grow_device(cache, new, seed):
    """`cache` (per-layer QuantizedKVCache list) with `new` more random rows, as a new evaluated list."""
    more = q4_cache(new, dtype=cache[0].keys[1].dtype, seed=seed)
    out = []
    for old, extra in zip(cache, more):
        c = type(old)(group_size=old.group_size, bits=old.bits)
        c.keys = tuple(mx.concatenate([a, b], axis=2) for a, b in zip(old.keys, extra.keys))
        c.values = tuple(mx.concatenate([a, b], axis=2) for a, b in zip(old.values, extra.values))
        c.offset = old.offset + new
        mx.eval(c.keys, c.values)
        out.append(c)
    return out


@pytest.mark.parametrize("dtype", [mx.float32, mx.bfloat16])
def test_a_device_cache_writes_the_same_files_copying_only_the_new_rows(tmp_path, dtype, monkeypatch):
    first = q4_cache(300, dtype=dtype)
    second = grow_device(first, 25, seed=3)
    dev = store.on_device(second)
    host = store.cache_to_host(second)
    assert (dev.n_tokens, dev.n_layers, dev.nbytes) == (host.n_tokens, host.n_layers, host.nbytes)
    for start in (0, 1, 299, 300, 324):
        a, b = dev.rows(start), host.rows(start)
        assert a.lengths == b.lengths and a.n_tokens == b.n_tokens == 325
        assert {k: v.tobytes() for k, v in a.tensors.items()} == {k: v.tobytes() for k, v in b.tensors.items()}
    with pytest.raises(ValueError):
        dev.rows(325)
    _, _, last = write_segment(tmp_path, store.on_device(first), meta_for(300, 1), None, None)
    copied, meta = [], dataclasses.replace(meta_for(325, 2), created=1.0)
    real = store.cache_to_host
    monkeypatch.setattr(hostcache, "cache_to_host", lambda cache, start=0: copied.append(start) or real(cache, start))
    from_device = store.next_segment(dev, meta, SPEC.fingerprint, last, (1, 300))
    monkeypatch.setattr(hostcache, "cache_to_host", real)
    from_host = store.next_segment(host, meta, SPEC.fingerprint, last, (1, 300))
    assert from_device[0] == store.DELTA_FILE.format(1) and copied == [300]  # only the 25 new rows left the device
    assert from_device[2] == from_host[2]  # the checksum covers the meta and every tensor's bytes
    (got, got_meta), (want, want_meta) = (store.decode_cache(b"".join(x[1])) for x in (from_device, from_host))
    assert got_meta == want_meta and got.lengths == want.lengths == (25, 25)
    assert {k: v.tobytes() for k, v in got.tensors.items()} == {k: v.tobytes() for k, v in want.tensors.items()}


# ---------------------------------------------------------------- the store's parts


def test_the_store_parts_import_one_way_and_never_the_actors():
    allowed = {  # part -> the parts it may import
        "files": set(), "hostcache": set(), "hotcache": set(), "journal": {"files"}, "cacheformat": {"hostcache"},
        "cachechain": {"files", "hostcache", "cacheformat"},
        "store": {"files", "hostcache", "hotcache", "journal", "cacheformat", "cachechain"},
    }
    folder = Path(store.__file__).parent
    for part, may in allowed.items():
        imported = set()
        for node in ast.walk(ast.parse((folder / f"{part}.py").read_text())):
            if isinstance(node, ast.ImportFrom) and node.module:
                names = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
            elif isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            else:
                continue
            imported |= {n.split(".")[1] for n in names if n.startswith("runtime.")}
            assert not any(n.split(".")[0] == "actors" for n in names), f"runtime/{part}.py imports the actors"
        parts = imported & set(allowed)
        assert parts <= may, f"runtime/{part}.py imports {sorted(parts - may)}: the store's parts depend one way"


def test_load_agent_counts_a_cache_of_seq_0_without_a_journal(tmp_path):
    store.save_cache(tmp_path, SPEC, "a", store.cache_to_host(q4_cache(8)), meta_for(8, seq=0))
    assert store.load_agent(tmp_path, SPEC, "a").last_seq == 0  # new records must go above the cache's seq


def test_the_json_of_token_lists_is_json_dumps_whatever_was_encoded_before():
    """`cacheformat._ints_json` extends the text of a recent list that is a prefix of the one asked for (a
    conversation's ids grow by a turn a write): for lists that grow, diverge, shrink, repeat, hold numpy ints or
    are empty, interleaved as several agents' writes are, the text is json.dumps's, bit for bit."""
    from runtime import cacheformat

    rng = random.Random(5)
    agents = [[rng.randrange(-1, 50000) for _ in range(rng.randrange(0, 40))] for _ in range(20)]
    for _ in range(400):
        a = rng.randrange(len(agents))
        values, move = agents[a], rng.random()
        if move < 0.6:
            values = values + [rng.randrange(-1, 50000) for _ in range(rng.randrange(0, 30))]  # a turn
        elif move < 0.75 and values:
            values = values[: rng.randrange(len(values))] + [rng.randrange(50000)]  # diverged, then new
        elif move < 0.85:
            values = values[: rng.randrange(len(values) + 1)]  # trimmed
        agents[a] = values
        asked = [np.int32(v) for v in values] if rng.random() < 0.2 else values
        assert cacheformat._ints_json(asked) == json.dumps(values, separators=(",", ":"))
    base = list(range(100))
    cacheformat._ints_json(base)
    middle = base[:50] + [7] + base[51:] + [1, 2]  # base's first and 100th value, not its prefix
    assert cacheformat._ints_json(middle) == json.dumps(middle, separators=(",", ":"))


def test_a_cache_files_header_is_json_dumps_of_it_whatever_its_text_holds():
    """The header's meta string is escaped piece by piece (the lists of ints as they are): for texts and turn ids
    with quotes, backslashes, control characters, non-ASCII and astral characters, and for delta and full files,
    the header is json.dumps of the whole header, bit for bit."""
    from runtime import cacheformat

    rng = random.Random(7)
    host = store.cache_to_host(q4_cache(12, dtype=mx.bfloat16, seed=3))
    alphabet = 'ab "\\\n\t/\x00\x1f\u2028é€😀<>&\''
    for trial in range(30):
        text = "".join(rng.choice(alphabet) for _ in range(rng.randrange(0, 80)))
        ends = sorted(rng.randrange(len(text) + 1) for _ in range(12))
        meta = CacheMeta(seq=trial, token_ids=[rng.randrange(-1, 2**31) for _ in range(12)], token_ends=ends,
                         text=text, turn_id=rng.choice(["t", 'q"\\é', "😀"]), created=2.5)
        delta = {"parent": "crc32:00000000", "start": 4, "lengths": [12] * host.n_layers} if trial % 2 else None
        parts, checksum = cacheformat.encode_file(host, meta, 'f"p', delta)
        n = int.from_bytes(parts[0][:8], "little")
        header = json.loads(parts[0][8 : 8 + n])
        assert parts[0][8 : 8 + n].rstrip(b" ") == json.dumps(header, separators=(",", ":")).encode()
        got = json.loads(header["__metadata__"]["meta"])
        assert (got["text"], got["turn_id"], got["token_ends"], got.get("delta")) == (text, meta.turn_id, ends, delta)
        assert header["__metadata__"]["checksum"] == checksum


def test_a_cache_file_is_the_same_whether_its_token_lists_were_encoded_before_or_not(tmp_path):
    """The same write twice, and after the memo of recent lists is emptied: the same bytes and checksum."""
    from runtime import cacheformat

    host = store.cache_to_host(q4_cache(40, dtype=mx.bfloat16, seed=2))
    meta = dataclasses.replace(meta_for(40), created=1.0)
    first = cacheformat.encode_file(host, meta, "f" * 16)
    again = cacheformat.encode_file(host, meta, "f" * 16)
    cacheformat._recent.clear()
    fresh = cacheformat.encode_file(host, meta, "f" * 16)
    assert first[1] == again[1] == fresh[1]
    assert b"".join(bytes(memoryview(p)) for p in first[0]) == b"".join(bytes(memoryview(p)) for p in fresh[0])


def test_a_caches_tensors_are_cut_into_device_buffers_under_the_size_limit(monkeypatch):
    """`cudacopy.groups`: runs in order, each fitting one buffer with every array at a multiple of ALIGN."""
    from runtime import cudacopy

    monkeypatch.setattr(cudacopy, "MAX_BYTES", 1000)
    sizes = [300, 300, 300, 10, 0, 1000, 1, 700, 250]
    runs = cudacopy.groups(sizes)
    assert [i for run in runs for i in run] == list(range(len(sizes)))
    for run in runs:
        end = 0
        for i in run:
            end = -(-end // cudacopy.ALIGN) * cudacopy.ALIGN + sizes[i]
        assert end <= 1000
    assert runs == [[0, 1], [2, 3, 4], [5], [6, 7], [8]]
    assert cudacopy.groups([]) == []
    with pytest.raises(ValueError, match="larger than"):
        cudacopy.groups([1001])


@pytest.mark.parametrize("align", [16, 256])
def test_to_device_stages_every_arrays_bytes_to_its_offset(monkeypatch, align):
    """`cudacopy.to_device`'s staging loop, with the CUDA calls replaced by a host "device": arrays that cross
    the (here 64-byte) staging buffer's edges, one larger than it, an empty one and a non-contiguous view each
    land at their offsets, with the padding between arrays inside the buffer or past it."""
    import numpy as np

    from runtime import cudacopy

    base, device, sent = 1 << 20, np.zeros(4096, np.uint8), []

    def allocate(**kw):
        (n,), _ = kw["output_shapes"]
        return mx.zeros((n,), mx.uint8), mx.array([base], mx.uint64)

    def to_blob(slot, ptr, n):
        assert 0 < n <= len(slot.view)
        device[ptr - base: ptr - base + n] = slot.view[:n]
        sent.append(n)

    monkeypatch.setattr(cudacopy, "STAGING_BYTES", 64)
    monkeypatch.setattr(cudacopy, "ALIGN", align)
    monkeypatch.setattr(cudacopy, "_allocator", lambda: allocate)
    monkeypatch.setattr(cudacopy, "_take_slot", lambda ptr: types.SimpleNamespace(view=np.zeros(64, np.uint8)))
    monkeypatch.setattr(cudacopy, "_to_blob", to_blob)
    monkeypatch.setattr(cudacopy, "_slots", [])
    rng = np.random.default_rng(1)
    arrays = [rng.integers(0, 2**32, (3, 5), dtype=np.uint32), np.zeros((0, 4), np.float16),
              rng.integers(0, 256, 200, dtype=np.uint8), rng.integers(0, 2**16, (4, 9), dtype=np.uint16)[:, 2:7],
              np.ones(1, np.float16), rng.integers(0, 256, 64, dtype=np.uint8)]
    blob, offsets = cudacopy.to_device(arrays)
    assert all(o % align == 0 for o in offsets) and blob.size == offsets[-1] + arrays[-1].nbytes
    for a, o in zip(arrays, offsets):
        assert np.array_equal(device[o: o + a.nbytes], np.ascontiguousarray(a).reshape(-1).view(np.uint8))
    assert sum(sent) <= blob.size and sum(sent) >= sum(a.nbytes for a in arrays)


def test_reserving_the_memory_pool_does_nothing_off_cuda():
    """`cudacopy.reserve_pool` (every Engine calls it) is a no-op where MLX does not run on CUDA."""
    from runtime import cudacopy

    if cudacopy.available():
        pytest.skip("this machine has CUDA: tests/test_cuda_kernels.py covers it")
    assert cudacopy.reserve_pool() is False and cudacopy.pool_bytes() == (0, 0)


def test_case_twin_lists_a_settled_folder_once_and_sees_every_change_after(tmp_path, monkeypatch):
    """`case_twin` reuses a listing of the model's folder while the folder is unchanged (spawning N stored agents
    costs N stats, not N listings), and finds a twin added or a twin removed after it: a change moves the
    folder's mtime once the listing's mtime was settled; a folder changed within SETTLED_NS is listed again."""
    import time

    folder = tmp_path / "fp"
    folder.mkdir()
    for name in ("alice", "bob", "Carol"):
        (folder / name).mkdir()
    old = time.time_ns() - 2 * store.SETTLED_NS
    os.utime(folder, ns=(old, old))
    listings, real = [], os.scandir
    monkeypatch.setattr(store.os, "scandir", lambda p: listings.append(p) or real(p))

    assert store.case_twin(tmp_path, "fp", "carol") == "Carol"
    assert [store.case_twin(tmp_path, "fp", n) for n in ("alice", "Bob", "dave", "Carol")] == [None, "bob", None, None]
    assert len(listings) == 1  # settled: listed once
    (folder / "Alice").mkdir()  # a change: the folder's mtime moves
    assert store.case_twin(tmp_path, "fp", "alice") == "Alice"
    assert store.case_twin(tmp_path, "fp", "alice") == "Alice"
    assert len(listings) == 3  # changed just now: listed at every call until it settles
    (folder / "Alice").rmdir()
    os.utime(folder, ns=(old + 1, old + 1))
    assert store.case_twin(tmp_path, "fp", "alice") is None
    assert store.case_twin(tmp_path, "nothing-here", "alice") is None


def test_case_twin_keys_its_listings_by_folder_and_lists_again_after_a_while(tmp_path, monkeypatch):
    """Two folders of one path (a relative cache_dir after a chdir) with equal mtimes have listings of their own; a
    file server whose clock is behind this host's can make a fresh mtime look settled, and a change within its
    time stamp's tick keeps the mtime: the listing is made again after LISTING_TTL_S; at most LISTINGS folders are
    remembered."""
    import time

    old = time.time_ns() - 2 * store.SETTLED_NS
    for place, name in (("a", "carol"), ("b", "Carol")):
        (tmp_path / place / "cache" / "fp" / name).mkdir(parents=True)
        os.utime(tmp_path / place / "cache" / "fp", ns=(old, old))
    monkeypatch.chdir(tmp_path / "a")
    assert store.case_twin("cache", "fp", "Carol") == "carol"
    monkeypatch.chdir(tmp_path / "b")
    assert store.case_twin("cache", "fp", "carol") == "Carol"

    folder = tmp_path / "b" / "cache" / "fp"
    (folder / "CAROL").mkdir()  # within the tick of the listed mtime, by a file server's clock
    os.utime(folder, ns=(old, old))
    assert store.case_twin("cache", "fp", "carol") == "Carol"  # the listing as it was
    clock = time.monotonic() + store.LISTING_TTL_S
    monkeypatch.setattr(store.time, "monotonic", lambda: clock)
    assert store.case_twin("cache", "fp", "carol") == "CAROL"  # sorted: "CAROL" < "Carol"

    for i in range(store.LISTINGS + 3):
        (tmp_path / f"m{i}").mkdir()
        os.utime(tmp_path / f"m{i}", ns=(old, old))
        store.case_twin(tmp_path, f"m{i}", "x")
    assert len(store._listings) == store.LISTINGS


def test_an_append_the_journal_ends_inside_goes_unless_the_mark_says_it_was_acknowledged(tmp_path):
    """A turn's user record last in the journal (the cut right after it, or inside its reply's frame) is what is
    left of an append a crash cut short, which was never acknowledged: it goes with the torn tail. Where the
    high-water mark covers the append, it was acknowledged and lost afterwards: what landed stays, and the mark
    reports the rest as lost."""
    path, recs, frames = journal_of(tmp_path, 6)  # three turns, seqs 0-5
    data = path.read_bytes()
    for cut in (frames[-1][0], (frames[-1][0] + frames[-1][1]) // 2):
        assert store.scan_journal(data[:cut]).records == recs[:4]  # nothing acknowledged said: it goes
        assert store.scan_journal(data[:cut], 3).records == recs[:4]  # the mark before the append: it goes
        kept = store.scan_journal(data[:cut], 5)
        assert kept.records == recs[:5] and kept.end == frames[-1][0]  # acknowledged: the user record stays
    assert store.scan_journal(data, 3).records == recs  # a whole append stays, whatever the mark


def test_an_unacknowledged_append_whose_later_frame_landed_goes_whole(tmp_path):
    """An append's pages may reach the disk out of order before its fsync: a crash then leaves its reply's frame
    whole and its user record's damaged. That was kept as mid-file damage, the reply an orphan in the history (and
    the high-water mark raised over it at the next start), though the turn was never acknowledged. Where the mark
    says what was acknowledged, damage past the last acknowledged frame starts the torn tail, what follows included;
    damage to acknowledged records, or in a journal without a mark, stays mid-file damage."""
    path, recs, frames = journal_of(tmp_path, 6)  # three turns, seqs 0-5
    data = bytearray(path.read_bytes())
    start = frames[4][0]
    data[start + 12] ^= 0x40  # the last turn's user record damaged, its reply whole
    scan = store.scan_journal(bytes(data), 3)
    assert scan.records == recs[:4] and not scan.damaged and scan.end == start and scan.torn == len(data) - start
    assert store.scan_journal(bytes(data)).records == recs[:4] + recs[5:]  # no mark: mid-file damage, as before
    assert store.scan_journal(bytes(data), 5).records == recs[:4] + recs[5:]  # acknowledged: the reply stays
    folder = path.parent
    path.write_bytes(bytes(data))
    store.record_high_seq(folder, 3)
    assert [r["seq"] for r in store.read_journal(tmp_path, SPEC, "a")] == [0, 1, 2, 3]
    assert "a torn tail: an append cut short" in store.inspect_table(tmp_path)
    scan, end = store.open_journal(folder)  # the agent's next start: the tail moved aside, nothing reported lost
    assert end == start and not scan.damaged and list(folder.glob("journal.torn-*"))
    assert [r["seq"] for r in store.read_journal(tmp_path, SPEC, "a")] == [0, 1, 2, 3]


def test_damage_past_a_mark_that_fell_behind_stays_mid_file_damage(tmp_path):
    """A mark that could not be written does not stop acknowledgements, so damage past a mark behind the journal,
    with more than one append after it, is damage to acknowledged records, not an unacknowledged append: the
    records after it stay. A damaged header does not hide the damage past the mark from the rule."""
    path, recs, frames = journal_of(tmp_path, 10)  # five turns, seqs 0-9
    data = bytearray(path.read_bytes())
    data[frames[4][0] + 12] ^= 0x40  # seq 4 damaged; turns 5-9 after it
    assert [r["seq"] for r in store.scan_journal(bytes(data), 1).records] == [0, 1, 2, 3, 5, 6, 7, 8, 9]
    data = bytearray(path.read_bytes())
    data[frames[-2][0] + 12] ^= 0x40  # the last turn's user record damaged, its reply whole
    data[0] ^= 0x01  # and the header's magic
    scan = store.scan_journal(bytes(data), 7)
    assert scan.header_damaged and scan.records == recs[:8] and scan.end == frames[-2][0]


def test_damage_with_no_record_after_it_is_the_torn_tail(tmp_path):
    """A frame that checks but breaks the rising seqs at the journal's end, or damage before a trailing user
    record whose append goes with the torn tail, left a damaged span with no record after it: reporting its
    losses raised IndexError where the persistence actor opens the journal. Such bytes are the torn tail."""
    path, recs, frames = journal_of(tmp_path, 6)
    data = path.read_bytes()
    stray = data[frames[2][0]:frames[2][1]]  # seq 2's frame again, after seq 5: a frame out of order
    scan = store.scan_journal(data + stray)
    assert scan.records == recs and scan.end == len(data) and scan.torn == len(stray) and not scan.damaged
    assert scan.losses() == []
    cut = bytearray(data[:frames[5][0]])  # seqs 0-4: the last turn's user record alone
    cut[frames[3][0] + 12] ^= 0x40  # and seq 3 (the turn before's reply) damaged before it
    scan = store.scan_journal(bytes(cut))  # no mark: the turn whose reply did not read goes too, as a torn append
    assert scan.records == recs[:2] and scan.end == frames[2][0] and scan.losses() == []
    scan = store.scan_journal(bytes(cut), 3)  # the mark says that turn was acknowledged: its user record stays
    assert scan.records == recs[:3] and scan.end == frames[3][0] and scan.losses() == []
    first = bytearray(data[:frames[1][0] + 5])  # the first turn's reply cut short, and the header damaged
    first[0] ^= 0x01
    scan = store.scan_journal(bytes(first))
    assert scan.header_damaged and scan.records == [] and scan.end == len(store.JOURNAL_MAGIC)
    assert scan.losses() == [f"the header (first {len(store.JOURNAL_MAGIC)} B) was unreadable and is rewritten"]


def test_randomly_damaged_journals_scan_report_and_repair_consistently(tmp_path):
    """Bit flips, cuts, frames spliced in and frames taken out, one to three at once, with and without a mark:
    scanning never raises but JournalError (a damaged span with no record after it made `losses` raise
    IndexError where the persistence actor opens the journal), the kept seqs rise, every span lies before the
    end, and the repaired journal scans clean with the same records."""
    import random
    import shutil

    rng = random.Random(7)
    path, recs, frames = journal_of(tmp_path, 12)
    base = path.read_bytes()
    for i in range(400):
        data = bytearray(base)
        for _ in range(rng.randint(1, 3)):
            op = rng.randrange(5)
            if op == 4:
                data[rng.randrange(len(store.JOURNAL_MAGIC))] ^= 1 << rng.randrange(8)  # the header
            elif op == 0 and data:
                data[rng.randrange(len(data))] ^= 1 << rng.randrange(8)
            elif op == 1:
                data = data[:rng.randrange(len(data) + 1)]
            elif op == 2:
                a, b = frames[rng.randrange(len(frames))]
                at = rng.randrange(len(data) + 1)
                data[at:at] = base[a:b]
            else:
                a, b = frames[rng.randrange(len(frames))]
                del data[a:b]
        folder = tmp_path / f"agent{i}"
        folder.mkdir()
        (folder / store.JOURNAL_FILE).write_bytes(bytes(data))
        mark = rng.choice([None, rng.randrange(-1, 12)])
        if mark is not None:
            store.record_high_seq(folder, mark)
        try:
            scan = store.scan_folder(folder)
        except store.JournalError:
            continue
        scan.losses()
        seqs = [r["seq"] for r in scan.records]
        assert seqs == sorted(set(seqs))
        assert scan.end <= scan.size and all(a < b <= scan.end for a, b in scan.damaged + scan.frames)
        _, end = store.open_journal(folder)
        repaired = store.scan_folder(folder)
        assert [r["seq"] for r in repaired.records] == seqs and not repaired.needs_repair and repaired.end == end
        shutil.rmtree(folder)



@contextlib.contextmanager
def writes_fail():
    """Every write of a file's bytes in this process fails with EFBIG for the block, as on a full disk."""
    limit = resource.getrlimit(resource.RLIMIT_FSIZE)
    handler = signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    resource.setrlimit(resource.RLIMIT_FSIZE, (0, limit[1]))
    try:
        yield
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, limit)
        signal.signal(signal.SIGXFSZ, handler)


def test_a_first_write_that_fails_leaves_no_empty_folder_behind(tmp_path):
    """A first journal or cache write that failed (a full disk) left the agent's folder, and its model's, made for
    it and empty: a later spawn of the name in another case was refused as the case twin of an agent that was never
    stored. Folders that were there stay."""
    cache = tmp_path / "agents"
    cache.mkdir()
    host, records = store.cache_to_host(q4_cache(3)), [store.journal_record(0, "user", "hi")]
    with writes_fail():
        with pytest.raises(OSError, match="too large"):
            store.append_journal(cache, SPEC, "Bob", records)
        with pytest.raises(OSError, match="too large"):
            store.save_cache(cache, SPEC, "Bob", host, meta_for(3))
        with pytest.raises(OSError, match="too large"):  # cache_dir and its parents made for the write go too
            store.append_journal(tmp_path / "new" / "agents", SPEC, "Bob", records)
    assert sorted(os.listdir(tmp_path)) == ["agents"] and os.listdir(cache) == []
    assert store.case_twin(cache, SPEC.fingerprint, "bob") is None
    store.append_journal(cache, SPEC, "alice", records)
    with writes_fail(), pytest.raises(OSError, match="too large"):
        store.save_cache(cache, SPEC, "Bob", host, meta_for(3))
    assert os.listdir(cache / SPEC.fingerprint) == ["alice"]  # the model's folder was there: it stays
    assert store.read_journal(cache, SPEC, "alice") == records
