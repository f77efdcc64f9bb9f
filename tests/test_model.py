"""load_model and ModelCacheSpec: geometry, layer kinds, sinks, sizes, fingerprint."""

import json
import shutil

import pytest

from runtime.model import ModelCacheSpec, ModelLoadError, fingerprint, load_model
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


def test_gpt_oss_sinks_and_alternating_window(specs, tiny_model_path):
    config = json.loads((tiny_model_path("gpt_oss") / "config.json").read_text())
    spec = specs["gpt_oss"]
    assert spec.has_sinks
    assert spec.layer_kinds == tuple("sliding" if t == "sliding_attention" else "full" for t in config["layer_types"])
    assert spec.layer_kinds[0] != spec.layer_kinds[1]  # alternating
    assert {w for w in spec.windows if w} == {config["sliding_window"]}


def test_bytes_per_token_are_what_quantize_stores(specs):
    import dataclasses

    import mlx.core as mx

    spec = specs["llama"]  # float32: scales and biases are float32 too
    elements = spec.n_layers * spec.n_kv_heads * (spec.k_head_dim + spec.v_head_dim)
    assert spec.fp16_bytes_per_token() == 2 * elements
    for dtype, scale_bytes in (("float32", 4), ("bfloat16", 2), ("float16", 2)):
        s = dataclasses.replace(spec, dtype=dtype)
        for bits, group in ((4, 64), (8, 32)):
            x = mx.zeros((1, spec.k_head_dim), getattr(mx, dtype))
            stored = sum(a.nbytes for a in mx.quantize(x, group_size=group, bits=bits)) / spec.k_head_dim
            assert stored == bits / 8 + 2 * scale_bytes / group
            assert s.q4_bytes_per_token(bits=bits, group_size=group) == elements * stored
    assert dataclasses.replace(spec, dtype="bfloat16").q4_bytes_per_token() / spec.fp16_bytes_per_token() == \
        pytest.approx(0.28125)


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


def test_load_model_default_and_errors(tmp_path):
    model, tokenizer, spec = load_model(None)
    assert spec.model_id == str(tiny_llama_path())
    assert tokenizer.encode("hello", add_special_tokens=False)
    (tmp_path / "empty").mkdir()
    with pytest.raises(ModelLoadError, match="not a model folder"):
        load_model(tmp_path / "empty")


def test_group_size_must_divide_head_dim(load_tiny, tiny_model_path):
    with pytest.raises(ValueError, match="multiple of the Q4 group size"):
        ModelCacheSpec.from_model(load_tiny("llama")[0], tiny_model_path("llama"), kv_group_size=48)
