"""load_model and ModelCacheSpec: geometry, layer kinds, sinks, sizes, fingerprint."""

import json
import os
import shutil
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from runtime.kvscheme import KVSchemeError, default_scheme, parse
from runtime.model import ModelCacheSpec, ModelLoadError, fingerprint, load_model, model_folder_lock, new_model_folder
from runtime.qgemv import available as on_cuda
from runtime.tiny import tiny_llama_path, make_tiny_model


@pytest.fixture(scope="module")
def specs(tiny_model_path, load_tiny):
    return {
        arch: ModelCacheSpec.from_model(load_tiny(arch)[0], tiny_model_path(arch))
        for arch in ("llama", "qwen2", "gemma3_text", "gpt_oss")
    }


def test_llama_and_qwen2_geometry(specs, tiny_model_path):
    for arch in ("llama", "qwen2"):
        spec = specs[arch]
        config = json.loads((tiny_model_path(arch) / "config.json").read_text())
        assert spec.n_layers == config["num_hidden_layers"]
        assert spec.n_kv_heads == config["num_key_value_heads"]
        assert spec.k_head_dim == spec.v_head_dim == 64
        assert spec.layer_kinds == ("full",) * spec.n_layers
        assert spec.windows == (None,) * spec.n_layers
        assert not spec.has_sinks
        assert spec.dtype == "float32"


def test_gemma3_pattern_of_sliding_and_full_layers(specs, tiny_model_path):
    config = json.loads((tiny_model_path("gemma3_text") / "config.json").read_text())
    pattern, window = config["sliding_window_pattern"], config["sliding_window"]
    spec = specs["gemma3_text"]
    expected = tuple("full" if (i + 1) % pattern == 0 else "sliding" for i in range(spec.n_layers))
    assert spec.layer_kinds == expected and "full" in expected and "sliding" in expected
    assert spec.windows == tuple(None if k == "full" else window for k in expected)
    assert not spec.has_sinks


def test_a_model_that_attends_in_its_own_code_is_refused_at_load(tmp_path, tiny_model_path, load_tiny):
    """gemma2 computes its soft-capped attention inline: handed the packed cache it crashed on every turn (and
    read rotated keys as plain ones on the dequantizing routes); it is refused when loaded, saying why."""
    from mlx_lm.models.cache import make_prompt_cache

    from runtime import Runtime
    from runtime.model import layers_attending_inline

    def inline(arch):
        model = load_tiny(arch)[0]
        return layers_attending_inline(model, make_prompt_cache(model))

    assert inline("gemma2") == [0, 1]
    assert not any(inline(arch) for arch in ("llama", "qwen2", "gemma3_text", "gpt_oss"))
    with pytest.raises(ModelLoadError, match="gemma2 models do not attend through mlx-lm's scaled_dot_product"):
        ModelCacheSpec.from_model(load_tiny("gemma2")[0], tiny_model_path("gemma2"))
    with pytest.raises(ModelLoadError, match="compute attention in their own code"):
        Runtime(model=tiny_model_path("gemma2"), cache_dir=tmp_path)


@pytest.mark.parametrize("route", ["dequant_once", "dequant"] + ([] if on_cuda() else ["quantized"]))
def test_a_model_attending_in_its_own_code_in_some_layers_is_refused_on_every_route(route, tmp_path, tiny_model_path,
                                                                                    monkeypatch):
    """phi3small's block-sparse layers (layer 0 here) compute attention in their own code while its dense layers
    call mlx-lm's scaled_dot_product_attention, so a look at the modules' imports passed it, and the probe forward
    at load failed only on the route that hands attention packed keys. On the dequantizing routes (what CUDA's
    prefill gets) it loaded, then every turn crashed in the batcher. Each layer's attention is now watched:
    it is refused at load on every route, in the Runtime's caller, naming the layer."""
    from runtime import Runtime

    monkeypatch.setenv("KVACTORS_Q4_ROUTE", route)
    with pytest.raises(ModelLoadError, match=r"phi3small models do not attend through mlx-lm's "
                                             r"scaled_dot_product_attention in layer 0 \(of 2\): those layers"):
        Runtime(model=tiny_model_path("phi3small"), cache_dir=tmp_path)


def test_models_keeping_other_state_or_failing_over_the_batch_cache_are_refused_at_load(load_tiny, tiny_model_path,
                                                                                       tmp_path):
    """lfm2's convolution layers keep an ArraysCache, not a KV cache: its spec raised AttributeError. gemma4's last
    layers attend over an earlier layer's keys without a cache of their own (through MLX's fused attention, past
    the Q4 route): it loaded, then failed every turn on CPU. Both are refused at load with ModelLoadError saying
    why, in the Runtime's caller; what the engine serves passes the same checks."""
    from runtime import Runtime
    from runtime.model import load_model

    with pytest.raises(ModelLoadError, match="lfm2 models keep other state than a KV cache .*ArraysCache"):
        ModelCacheSpec.from_model(load_tiny("lfm2")[0], tiny_model_path("lfm2"))
    with pytest.raises(ModelLoadError, match="lfm2 models keep other state"):
        Runtime(model=tiny_model_path("lfm2"), cache_dir=tmp_path / "a")
    with pytest.raises(ModelLoadError, match="gemma4_text models have 6 layers but keep 4 caches"):
        load_model(tiny_model_path("gemma4_text"))
    with pytest.raises(ModelLoadError, match="every layer keeps its own KV cache"):
        Runtime(model=tiny_model_path("gemma4_text"), cache_dir=tmp_path / "b")
    for arch in ("llama", "qwen2", "gemma3_text", "gpt_oss"):  # what the engine serves passes the same checks
        assert load_model(tiny_model_path(arch))[2].n_layers


def test_a_model_whose_forward_fails_here_is_refused_at_load(tmp_path, tiny_model_path, monkeypatch):
    """bitnet's layers run a Metal kernel: on another device its first forward pass raised RuntimeError out of
    the Runtime's constructor, not ModelLoadError (a model's own code failing here, as that kernel does)."""
    from mlx_lm.models import llama

    from runtime import Runtime

    def no_kernel(self, *args, **kwargs):
        raise RuntimeError("[metal_kernel] No Metal back-end.")

    monkeypatch.setattr(llama.Model, "__call__", no_kernel)
    with pytest.raises(ModelLoadError, match=r"llama models fail a forward pass here \(RuntimeError: \[metal_kernel\]"):
        Runtime(model=tiny_model_path("llama"), cache_dir=tmp_path)


def test_a_model_that_takes_one_position_for_the_whole_batch_is_refused_at_load(tmp_path, tiny_model_path):
    """gpt_bigcode computes its learned position ids from the first layer's cache offset as one number: it served
    one agent, then every decode step of two agents in one batch failed (each row has its own offset). The probe
    at load serves two agents of unequal lengths in one batch as the engine does, so it is refused in the
    Runtime's caller with ModelLoadError saying why."""
    from runtime import Runtime

    with pytest.raises(ModelLoadError, match="gpt_bigcode models fail over kvactors' Q4 batch cache .*"
                                             "positions in its own way, which batches of agents cannot feed"):
        Runtime(model=tiny_model_path("gpt_bigcode"), cache_dir=tmp_path)


def test_a_model_whose_code_reads_the_cache_as_arrays_is_served_on_the_dequantizing_route(tmp_path, tiny_model_path):
    """phi casts the values its cache hands back (`values.dtype`): on the CPU's default route, which hands attention
    the packed cache, the probe at load failed and the Runtime refused it, saying kvactors could not serve it, while
    "dequant_once" serves it. With no route asked for it is now served there, its two agents batched giving each
    one's tokens alone (CPU: the tiny model's float32 products round by batch shape on CUDA, whose default route
    serves phi as it is); a route asked for that fails it is refused at load, naming the one that serves it."""
    from runtime import Runtime
    from runtime.q4cache import default_route, route_for

    path = tiny_model_path("phi")
    turns = {"a": ("You plan.", "Plan a bake sale."), "b": ("You count.", "Count the chairs, then the tables.")}
    with Runtime(model=path, cache_dir=tmp_path / "batched", warmup=False) as rt:
        fails = default_route() == "quantized"  # the route that hands phi's attention the packed cache
        assert rt.spec.dense_kv == fails and route_for(rt.spec) == ("dequant_once" if fails else default_route())
        refs = {name: rt.spawn(name, system=system) for name, (system, _) in turns.items()}
        futures = {name: refs[name].send(text, max_tokens=6) for name, (_, text) in turns.items()}
        batched = {name: f.get(timeout=120).tokens for name, f in futures.items()}
    with Runtime(model=path, cache_dir=tmp_path / "solo", warmup=False) as rt:
        alone = {name: rt.spawn(name, system=system).ask(text, max_tokens=6).tokens
                 for name, (system, text) in turns.items()}
    assert all(len(t) == 6 for t in batched.values())
    if not on_cuda():
        assert batched == alone
        with pytest.raises(ModelLoadError, match=r"phi models fail over kvactors' Q4 batch cache on the 'quantized' "
                                                 r"route \(AttributeError: .*route='dequant_once', which serves them"):
            Runtime(model=path, cache_dir=tmp_path / "asked", route="quantized")
    assert not load_model(tiny_model_path("llama"))[2].dense_kv  # a model the default route serves keeps it


@pytest.mark.skipif(on_cuda(), reason="the quantized route is refused on CUDA before the model loads")
def test_a_route_the_models_layout_refuses_says_so_at_load(tmp_path, tiny_model_path):
    """gpt_oss's attention sinks cannot be served on the quantized route. Since the load probe runs on the
    Runtime's route, that refusal surfaced as a ModelLoadError saying kvactors cannot serve gpt_oss models,
    with the route's own error chained behind it; it is the route's error, naming the routes that serve them."""
    from runtime import Runtime
    from runtime.q4cache import Q4CacheError

    with pytest.raises(Q4CacheError, match="cannot serve attention sinks; use 'dequant' or 'dequant_once'") as e:
        Runtime(model=tiny_model_path("gpt_oss"), cache_dir=tmp_path, route="quantized")
    assert e.value.__context__ is None


def test_gpt_oss_sinks_and_alternating_window(specs, tiny_model_path):
    config = json.loads((tiny_model_path("gpt_oss") / "config.json").read_text())
    spec = specs["gpt_oss"]
    assert spec.has_sinks
    assert spec.layer_kinds == tuple("sliding" if t == "sliding_attention" else "full" for t in config["layer_types"])
    assert spec.layer_kinds[0] != spec.layer_kinds[1]  # alternating
    assert {w for w in spec.windows if w} == {config["sliding_window"]}


@pytest.mark.parametrize("scheme", ["k4v4-g64", "k8v8-g32", "k6v4-g64-hadamard", "k5v3-g32-hadamard"])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_bytes_per_token_are_what_the_batch_cache_stores(specs, scheme, dtype):
    import dataclasses

    import mlx.core as mx

    from runtime import attention
    from runtime.kvscheme import parse
    from runtime.q4cache import extract_cache, make_batch_cache

    attention.install()
    s = parse(scheme)
    spec = dataclasses.replace(specs["llama"], dtype=dtype).with_scheme(s)
    batch = make_batch_cache(spec, 1, "dequant")
    tokens = 37
    for layer in batch:
        shape = (1, spec.n_kv_heads, tokens, spec.k_head_dim)
        layer.update_and_fetch(mx.random.normal(shape).astype(getattr(mx, dtype)),
                               mx.random.normal(shape).astype(getattr(mx, dtype)))
    stored = sum(x.nbytes for c in extract_cache(batch, 0) for x in (*c.keys, *c.values))
    assert spec.q4_bytes_per_token() * tokens == stored
    assert spec.fp16_bytes_per_token() == 2 * spec.n_layers * spec.n_kv_heads * (spec.k_head_dim + spec.v_head_dim)


def test_the_default_scheme_is_at_most_035_of_fp16_bytes(specs):
    import dataclasses

    spec = dataclasses.replace(specs["llama"], dtype="bfloat16")
    assert spec.kv_scheme == default_scheme()
    assert spec.q4_bytes_per_token() / spec.fp16_bytes_per_token() == pytest.approx(0.34375)


def test_fingerprint_changes_with_weights_and_nothing_else(tmp_path):
    a = make_tiny_model(tmp_path / "a", "llama", seed=0)
    b = make_tiny_model(tmp_path / "b", "llama", seed=0)
    c = make_tiny_model(tmp_path / "c", "llama", seed=1)
    assert fingerprint(a) == fingerprint(b)  # same content, other folder
    assert fingerprint(a) != fingerprint(c)  # other weights, same sizes
    (a / "README.md").write_text("notes do not matter")
    assert fingerprint(a) == fingerprint(b)
    config = json.loads((b / "config.json").read_text())
    config["rope_theta"] = 1234.0
    (b / "config.json").write_text(json.dumps(config))
    assert fingerprint(a) != fingerprint(b)
    shutil.copy(a / "config.json", b / "config.json")
    tok = json.loads((b / "tokenizer_config.json").read_text())
    tok["chat_template"] += " "
    (b / "tokenizer_config.json").write_text(json.dumps(tok))
    assert fingerprint(a) != fingerprint(b)


def change_between_samples(folder, tensor: str) -> None:
    """Flip the sign of float32 weights of `tensor` in `folder/model.safetensors` where `fingerprint` samples none."""
    import struct

    from runtime import model as model_module

    path = folder / "model.safetensors"
    data = bytearray(path.read_bytes())
    start, stop = json.loads(data[8:8 + struct.unpack("<Q", data[:8])[0]])[tensor]["data_offsets"]
    base = 8 + struct.unpack("<Q", data[:8])[0]
    size, chunks, width = len(data), model_module._SAMPLE_CHUNKS, model_module._SAMPLE_BYTES
    sampled = [(size * i // chunks, size * i // chunks + width) for i in range(chunks)] + [(size - width, size)]
    a = next(w[1] for w in sampled if base + start <= w[1] < base + stop)  # the end of a sample inside the tensor
    b = min([w[0] for w in sampled if w[0] > a] + [base + stop])
    a, b = a + 4 - a % 4, b - b % 4 - 4  # whole float32s strictly between two samples
    assert b - a >= 1024, "no unsampled stretch in that tensor"
    for i in range(a + 3, b, 4):
        data[i] ^= 0x80  # the sign bit of a little-endian float32
    path.write_bytes(bytes(data))


def test_weights_digest_covers_every_byte_the_fingerprint_does_not_sample(tmp_path):
    """`fingerprint` samples the weight files (the store's folder name); `weights_digest`, which tags every cache,
    reads them whole: weights changed only between the samples keep the fingerprint and change the digest."""
    from runtime.model import weights_digest

    a = make_tiny_model(tmp_path / "a", "llama", seed=0)
    b = tmp_path / "b"
    shutil.copytree(a, b)
    assert weights_digest(a) == weights_digest(b)
    change_between_samples(b, "model.layers.0.mlp.down_proj.weight")
    assert fingerprint(a) == fingerprint(b)  # the samples missed it, as the fingerprint's docstring says
    assert weights_digest(a) != weights_digest(b)
    shutil.copy(a / "model.safetensors", b / "model.safetensors")  # rewritten in place: not the remembered digest
    assert weights_digest(a) == weights_digest(b)


def test_a_model_with_weights_changed_between_the_samples_is_not_served_the_other_models_caches(tmp_path):
    """Two model folders of one fingerprint (weights differing only between its samples) share the store's
    folder and so each agent's history; a cache the other model made is refused (ForeignModel) and the turn
    re-prefills the history: its reply is that model's own, token for token."""
    from runtime import Runtime

    a = make_tiny_model(tmp_path / "a", "llama", seed=0)
    b = tmp_path / "b"
    shutil.copytree(a, b)
    for layer in ("0", "1"):
        change_between_samples(b, f"model.layers.{layer}.mlp.down_proj.weight")
    with Runtime(model=a, cache_dir=tmp_path / "store") as rt:
        alice = rt.spawn("alice", system="You are Alice.")
        alice.ask("Plan a bake sale.", max_tokens=6)
        history = alice.history()
    with Runtime(model=b, cache_dir=tmp_path / "store") as rt:
        alice = rt.spawn("alice", system="You are Alice.")
        assert alice.history() == history  # one fingerprint: one folder, the same journal
        warm = alice.ask("Go on.", max_tokens=8)
    with Runtime(model=b, cache_dir=tmp_path / "fresh") as rt:
        alice = rt.spawn("alice", system="You are Alice.")
        alice.reset([{"role": r["role"], "text": r["text"]} for r in history if r["role"] != "system"])
        cold = alice.ask("Go on.", max_tokens=8)
    assert warm.cache == "cold" and warm.tokens == cold.tokens
    from runtime.store import inspect_table

    table = inspect_table(tmp_path / "store")
    assert "alice" in table and "another model" not in table  # caches name the weights beside the fingerprint


def test_load_model_default_and_errors(tmp_path):
    model, tokenizer, spec = load_model(None)
    assert spec.model_id == str(tiny_llama_path())
    assert tokenizer.encode("hello", add_special_tokens=False)
    (tmp_path / "empty").mkdir()
    with pytest.raises(ModelLoadError, match="not a model folder"):
        load_model(tmp_path / "empty")
    with pytest.raises(TypeError, match="model must be a str, a path or None, got int"):
        load_model(5)


@pytest.mark.parametrize("name", ["m" * 5000, "org/" + "m" * 300, "m" * 300 + ".gguf"])
def test_a_model_name_the_file_system_cannot_look_up_is_a_model_load_error(name):
    """A name longer than the file system takes raised a bare OSError ("File name too long") from the check of
    whether it is a local path."""
    with pytest.raises(ModelLoadError, match="cannot find model.*give a"):
        load_model(name)


def test_a_broken_model_folder_is_a_model_load_error_naming_the_folder(tmp_path):
    """Whatever fails inside mlx-lm (a config that is not JSON, missing or cut weights, no tokenizer, an unknown
    architecture), the caller gets ModelLoadError with the folder and the cause."""
    def broken(name, edit):
        folder = tmp_path / name
        shutil.copytree(tiny_llama_path(), folder)
        edit(folder)
        return folder

    config = json.loads((tiny_llama_path() / "config.json").read_text())
    for folder in (broken("json", lambda f: (f / "config.json").write_text("{nope")),
                   broken("noweights", lambda f: [p.unlink() for p in f.glob("*.safetensors")]),
                   broken("cut", lambda f: [p.write_bytes(p.read_bytes()[:1000]) for p in f.glob("*.safetensors")]),
                   broken("notokenizer", lambda f: [p.unlink() for p in f.glob("tokenizer*")]),
                   broken("arch", lambda f: (f / "config.json").write_text(json.dumps({**config, "model_type": "nosuch"})))):
        with pytest.raises(ModelLoadError, match=f"cannot load the model folder {folder}"):
            load_model(folder)


def test_a_folder_naming_an_end_or_start_token_the_model_lacks_is_refused_at_load(tmp_path, tiny_model_path):
    """An eos id outside the model's vocabulary (its embedding's rows, the engine's bound on token ids) can never be
    sampled: a turn waiting on it alone ran to max_tokens; a bos outside it is fed with every prompt, and every
    turn was refused. load_model refuses such a folder, naming the id, the file and the vocabulary size."""
    from runtime.tiny import BOS

    rows = json.loads((tiny_model_path() / "config.json").read_text())["vocab_size"]  # 2048 rows in its embedding

    def folder(name, edit):
        path = tmp_path / name
        shutil.copytree(tiny_model_path(), path)
        edit(path)
        return path

    def edit_json(name, **changes):
        def edit(path):
            data = json.loads((path / name).read_text()) if (path / name).exists() else {}
            (path / name).write_text(json.dumps({**data, **changes}))
        return edit

    def far_token(role):  # the tokenizer names as its `role` token one it numbers `rows`, past the embedding
        def edit(path):
            tok = json.loads((path / "tokenizer.json").read_text())
            tok["added_tokens"].append({"id": rows, "content": "<|far|>", "single_word": False, "lstrip": False,
                                        "rstrip": False, "normalized": False, "special": True})
            (path / "tokenizer.json").write_text(json.dumps(tok))
            edit_json("tokenizer_config.json", **{f"{role}_token": "<|far|>"})(path)
        return edit

    cases = {
        "eos": (edit_json("config.json", eos_token_id=[1, rows + 5]), rf"config\.json names eos_token_id {rows + 5}"),
        "eos at the size": (edit_json("config.json", eos_token_id=rows), rf"config\.json names eos_token_id {rows}"),
        "negative eos": (edit_json("config.json", eos_token_id=-1), r"config\.json names eos_token_id -1"),
        "generation eos": (edit_json("generation_config.json", eos_token_id=[4, 99999]),
                           r"generation_config\.json names eos_token_id 99999"),
        "tokenizer eos": (far_token("eos"), rf"the tokenizer's eos_token '<\|far\|>' is id {rows}"),
        "tokenizer bos": (far_token("bos"), rf"the tokenizer's bos_token '<\|far\|>' is id {rows}"),
    }
    for name, (edit, message) in cases.items():
        path = folder(name.replace(" ", "-"), edit)
        with pytest.raises(ModelLoadError, match=message) as e:
            load_model(path)
        assert str(path) in str(e.value) and f"{rows} token ids (0 to {rows - 1})" in str(e.value), (name, e.value)
    # a pad id is never fed or waited on (released models name one past their embedding, or -1): it loads
    for pad in (rows, -1):
        load_model(folder(f"pad{pad}", edit_json("config.json", pad_token_id=pad)))
    assert load_model(folder("bos-config", edit_json("config.json", bos_token_id=rows)))[1].bos_token == BOS

    def both(path):  # mlx-lm stops on generation_config.json's eos where it names one: config.json's is not read
        edit_json("config.json", eos_token_id=rows + 5)(path)
        edit_json("generation_config.json", eos_token_id=2)(path)

    load_model(folder("eos-overridden", both))

    def zero(path):  # mlx-lm takes generation_config.json's eos only where it is truthy: 0 leaves config.json's
        edit_json("config.json", eos_token_id=rows + 5)(path)
        edit_json("generation_config.json", eos_token_id=0)(path)

    with pytest.raises(ModelLoadError, match=rf"config\.json names eos_token_id {rows + 5}"):
        load_model(folder("eos-zero-generation", zero))


def test_group_size_must_divide_head_dim(load_tiny, tiny_model_path):
    with pytest.raises(KVSchemeError, match="multiple of the KV group size 128"):
        ModelCacheSpec.from_model(load_tiny("llama")[0], tiny_model_path("llama"), parse("k4v4-g128"))


def test_token_rows_reads_the_config_else_the_first_embedding():
    """`model.token_rows`: the config's vocab_size where it says one, else the rows of the only embedding module
    (quantized or not), else None."""
    import types

    import mlx.nn as nn

    from runtime.model import token_rows

    class Outer(nn.Module):
        def __init__(self, embedding):
            super().__init__()
            self.inner = [embedding, nn.Linear(4, 4)]

    assert token_rows(Outer(nn.Embedding(37, 8))) == 37
    assert token_rows(Outer(nn.QuantizedEmbedding(41, 64))) == 41
    assert token_rows(nn.Linear(4, 4)) is None
    with_args = Outer(nn.Embedding(37, 8))
    with_args.args = types.SimpleNamespace(vocab_size=50)
    assert token_rows(with_args) == 50


def test_token_rows_of_a_multimodal_model_are_its_text_vocabulary_not_a_vision_table():
    """muse_spark keeps its vocabulary in text_config; its first embedding module met is the vision tower's
    position table (32 x 32 rows)."""
    from mlx_lm.models import muse_spark

    from runtime.model import token_rows

    tc = dict(hidden_size=8, num_attention_heads=2, num_key_value_heads=1, head_dim=4, num_hidden_layers=1,
              vocab_size=5000, rms_norm_eps=1e-6, post_norm_eps=1e-6, rope_parameters={"rope_theta": 1e4},
              layer_rope_theta=[1e4], layer_types=["full_attention"], sliding_window=8, final_logit_softcapping=30.0,
              output_multiplier=1.0, num_local_experts=2, num_experts_per_tok=1, moe_hidden_size=8,
              moe_intermediate_size=8)
    vc = dict(hidden_size=8, intermediate_size=16, num_hidden_layers=1, num_attention_heads=2)
    m = muse_spark.Model(muse_spark.ModelArgs(model_type="muse_spark", text_config=tc, vision_config=vc))
    assert token_rows(m) == 5000


def test_token_rows_of_gemma3n_are_its_vocabulary_not_the_per_layer_table():
    """gemma3n's per-layer embedding (vocab_size_per_layer_input rows) is not its token table."""
    from mlx_lm.models import gemma3n

    from runtime.model import token_rows

    tc = dict(model_type="gemma3n_text", hidden_size=8, num_hidden_layers=2, intermediate_size=[16, 16],
              num_attention_heads=2, head_dim=4, rms_norm_eps=1e-6, vocab_size=300, num_key_value_heads=1,
              num_kv_shared_layers=0, vocab_size_per_layer_input=256, sliding_window=8, max_position_embeddings=64,
              rope_local_base_freq=1e4, rope_theta=1e6, final_logit_softcapping=30.0,
              layer_types=["sliding_attention", "full_attention"], activation_sparsity_pattern=[0.0, 0.0],
              hidden_size_per_layer_input=4, altup_num_inputs=2, altup_coef_clip=120.0, altup_correct_scale=True,
              altup_active_idx=0, laurel_rank=2)
    m = gemma3n.Model(gemma3n.ModelArgs(model_type="gemma3n", text_config=tc))
    assert token_rows(m) == 300


def test_a_model_folder_is_on_disk_before_it_has_its_name(tmp_path, monkeypatch):
    """Every file and folder of a new model folder is fsynced before the rename that names it, and the parent
    after: after a power loss a folder under its final name never holds empty or partial files."""
    events = []
    fsync = os.fsync

    def record_fsync(fd):
        st = os.fstat(fd)
        events.append(("fsync", (st.st_dev, st.st_ino)))
        fsync(fd)

    def recording(rename):
        def record_rename(src, dst, *args, **kwargs):
            events.append(("rename", Path(dst)))
            rename(src, dst, *args, **kwargs)
        return record_rename

    monkeypatch.setattr(os, "fsync", record_fsync)
    monkeypatch.setattr(os, "rename", recording(os.rename))
    monkeypatch.setattr(os, "replace", recording(os.replace))
    out = tmp_path / "models" / "m"
    with new_model_folder(out) as tmp:
        (tmp / "config.json").write_text("{}")
        (tmp / "sub").mkdir()
        (tmp / "sub" / "weights.bin").write_bytes(b"w" * 4096)

    def node(path):
        st = path.stat()
        return "fsync", (st.st_dev, st.st_ino)

    renamed = events.index(("rename", out))
    for path in (out / "config.json", out / "sub" / "weights.bin", out / "sub", out):
        assert node(path) in events[:renamed], path
    assert node(out.parent) in events[renamed + 1:]


def test_model_folder_lock_removes_its_file_and_still_excludes(tmp_path):
    """The lock file goes with the lock, and the lock stays exclusive while holders come and go: one that
    waited on a file its holder removed takes the lock again rather than share it with a newcomer."""
    out = tmp_path / "models" / "m"
    count, inside, most = threading.Lock(), [0], [0]

    def hold(_):
        for _ in range(25):
            with model_folder_lock(out):
                with count:
                    inside[0] += 1
                    most[0] = max(most[0], inside[0])
                time.sleep(0.0005)
                with count:
                    inside[0] -= 1

    with ThreadPoolExecutor(4) as pool:
        list(pool.map(hold, range(4)))
    assert most[0] == 1
    assert os.listdir(out.parent) == []


def test_a_failed_build_removes_the_folders_made_for_its_lock_and_a_waiter_still_builds(tmp_path):
    """`import-gguf FILE new/place/out` that failed (a full disk, a damaged file) left new/place behind, made for
    the lock's file and empty; a build waiting on the lock meanwhile makes them again, and folders that were
    there stay."""
    out = tmp_path / "new" / "place" / "m"
    with pytest.raises(OSError, match="the build failed"), model_folder_lock(out):
        raise OSError("the build failed")
    assert os.listdir(tmp_path) == []

    waited = threading.Event()

    def wait_and_build():
        waited.set()
        with model_folder_lock(out):
            (out.parent / "built").write_text("")

    with pytest.raises(OSError, match="the build failed"), model_folder_lock(out):
        waiter = threading.Thread(target=wait_and_build)
        waiter.start()
        waited.wait()
        time.sleep(0.2)  # at the lock, most likely: the test passes either way
        raise OSError("the build failed")
    waiter.join()
    assert os.listdir(out.parent) == ["built"]
    (out.parent / "built").unlink()
    with pytest.raises(OSError, match="the build failed"), model_folder_lock(out):
        raise OSError("the build failed")
    assert os.listdir(out.parent) == []  # not made by this build: kept


def test_model_folder_lock_removes_its_own_leftovers_only_whatever_the_name(tmp_path):
    """A user names the folder (import-gguf's OUT, make_tiny_model's path): a name with glob characters in it
    matched another folder's temporary folders, which may be being written, and missed its own."""
    out = tmp_path / "m[1]"
    (tmp_path / ".m[1].tmp-abc").mkdir()  # a killed build of `out`
    (tmp_path / ".m1.tmp-abc").mkdir()  # a build of the folder m1
    with model_folder_lock(out):
        assert sorted(os.listdir(tmp_path)) == [".m1.tmp-abc", ".m[1].lock"]
    assert os.listdir(tmp_path) == [".m1.tmp-abc"]
