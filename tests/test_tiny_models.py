"""The tiny local models: build, load through mlx-lm, generate, determinism."""

import json
import os
import sys
from concurrent.futures import ThreadPoolExecutor

import mlx.core as mx
import mlx_lm
import pytest
from mlx_lm.models.cache import KVCache, RotatingKVCache
from mlx_lm.sample_utils import make_sampler

from runtime import tiny
from runtime.model import load_model
from runtime.tiny import (
    ARCHS,
    COMPLETE_MARKER,
    NON_COMPOSITIONAL,
    VOCAB_SIZE,
    tiny_llama_path,
    make_tiny_model,
)

# Pinned: the trained tokenizer merges " plan" + "ner" into " planner" when
# the two are tokenized together, but not when tokenized apart.
A, B = "The plan", "ner"

MESSAGES = [
    {"role": "system", "content": "You are Alice, a careful planner."},
    {"role": "user", "content": "Draft a plan for a bake sale."},
]


def tokenize(tokenizer, s):
    return tokenizer.encode(s, add_special_tokens=False)


def greedy(model, tokenizer, prompt, n=16):
    return mlx_lm.generate(
        model, tokenizer, prompt, max_tokens=n, sampler=make_sampler(temp=0.0)
    )


@pytest.mark.parametrize("arch", ARCHS)
def test_arch_loads_and_generates_deterministically(arch, load_tiny):
    model, tokenizer = load_tiny(arch)
    assert model.model_type == arch
    prompt = tokenizer.apply_chat_template(MESSAGES, add_generation_prompt=True, tokenize=False)
    assert prompt.startswith(tokenizer.bos_token)
    assert prompt.endswith("<|start_header_id|>assistant<|end_header_id|>\n\n")
    ids = tokenize(tokenizer, prompt)  # the template already holds the BOS
    assert ids[0] == tokenizer.bos_token_id and ids.count(ids[0]) == 1
    first = greedy(model, tokenizer, prompt)
    second = greedy(model, tokenizer, prompt)
    assert first == second
    assert first  # generated something
    logits = model(mx.array([ids]))
    assert logits.shape == (1, len(ids), model.args.vocab_size)
    logits = logits[..., :VOCAB_SIZE]  # phi3small's logits mask ids past the tiny vocabulary (-inf)
    assert mx.all(mx.isfinite(logits)).item()
    assert mx.std(logits[0, -1]).item() > 1e-3  # not degenerate


def test_geometry_is_q4_friendly_and_small(tiny_model_path):
    for arch in ARCHS:
        config = json.loads((tiny_model_path(arch) / "config.json").read_text())
        assert config["model_type"] == arch
        hidden = config.get("hidden_size", config.get("n_embd"))  # gpt_bigcode names them after GPT-2
        heads = config.get("num_attention_heads", config.get("n_head"))
        kv_heads = config.get("num_key_value_heads", 1 if config.get("multi_query", True) else heads)
        assert config.get("head_dim", hidden // heads) % 64 == 0
        assert heads > kv_heads  # GQA
        assert config.get("num_hidden_layers", config.get("n_layer")) <= 6 and hidden <= 256
        assert config["eos_token_id"] and config["bos_token_id"] is not None


def test_gemma3_and_gpt_oss_mix_sliding_and_full_layers(load_tiny):
    model, _ = load_tiny("gemma3_text")
    kinds = [type(c) for c in model.make_cache()]
    assert kinds == [RotatingKVCache, RotatingKVCache, KVCache, RotatingKVCache]
    assert model.args.sliding_window == 64

    model, _ = load_tiny("gpt_oss")
    kinds = [type(c) for c in model.make_cache()]
    assert kinds == [RotatingKVCache, KVCache] * 2
    assert model.args.sliding_window == 64
    sinks = model.model.layers[0].self_attn.sinks
    assert mx.abs(sinks).max().item() > 0  # sinks loaded, not default zeros
    assert model.args.num_local_experts == 4


def test_chat_template_roles(load_tiny):
    _, tokenizer = load_tiny("llama")
    text = tokenizer.apply_chat_template(
        MESSAGES + [{"role": "assistant", "content": "Sure."}], tokenize=False
    )
    assert text == (
        "<|begin_of_text|><|start_header_id|>system<|end_header_id|>\n\n"
        "You are Alice, a careful planner.<|eot_id|>"
        "<|start_header_id|>user<|end_header_id|>\n\n"
        "Draft a plan for a bake sale.<|eot_id|>"
        "<|start_header_id|>assistant<|end_header_id|>\n\nSure.<|eot_id|>"
    )
    eot = tokenizer.convert_tokens_to_ids("<|eot_id|>")
    assert eot in tokenizer.eos_token_ids
    assert tokenizer.eos_token == "<|eot_id|>"
    with pytest.raises(Exception, match="Unknown role"):
        tokenizer.apply_chat_template([{"role": "tool", "content": "x"}], tokenize=False)


def test_same_seed_same_bytes_other_seed_differs(tmp_path, tiny_model_path):
    a = make_tiny_model(tmp_path / "a", arch="qwen2", seed=0)
    b = make_tiny_model(tmp_path / "b", arch="qwen2", seed=0)
    c = make_tiny_model(tmp_path / "c", arch="qwen2", seed=1)
    wa, wb, wc = ((p / "model.safetensors").read_bytes() for p in (a, b, c))
    assert wa == wb
    assert wa != wc
    for name in ("config.json", "tokenizer.json", "tokenizer_config.json"):
        assert (a / name).read_bytes() == (c / name).read_bytes()
    # the session fixture's build (separate call) matches too
    assert (tiny_model_path("qwen2") / "model.safetensors").read_bytes() == wa


def test_overrides_update_config(tmp_path):
    p = make_tiny_model(tmp_path / "m", arch="gpt_oss", num_hidden_layers=2, sliding_window=32)
    config = json.loads((p / "config.json").read_text())
    assert config["num_hidden_layers"] == 2
    assert config["layer_types"] == ["sliding_attention", "full_attention"]
    model, _ = mlx_lm.load(str(p))
    assert len(model.layers) == 2 and model.args.sliding_window == 32


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_half_precision_builds_load(tmp_path, dtype):
    p = make_tiny_model(tmp_path / "m", arch="llama", dtype=dtype)
    model, _ = mlx_lm.load(str(p))
    assert model.model.embed_tokens.weight.dtype == getattr(mx, dtype)
    assert json.loads((p / "config.json").read_text())["torch_dtype"] == dtype


def test_unknown_arch_and_existing_path(tmp_path):
    with pytest.raises(ValueError, match="llama, qwen2, gemma3_text, gpt_oss"):
        make_tiny_model(tmp_path / "x", arch="mamba")
    assert not (tmp_path / "x").exists()
    make_tiny_model(tmp_path / "y")
    with pytest.raises(FileExistsError):
        make_tiny_model(tmp_path / "y")
    assert sorted(os.listdir(tmp_path)) == ["y"]  # no temp folders left behind
    assert (tmp_path / "y" / COMPLETE_MARKER).exists()


def test_default_model_built_once_and_reused(kvactors_home):
    path = tiny_llama_path()
    assert path == kvactors_home / "models" / "tiny-llama-v1"
    marker = path / COMPLETE_MARKER
    stamp = (marker.stat().st_mtime_ns, (path / "model.safetensors").stat().st_mtime_ns)
    assert tiny_llama_path() == path
    assert (marker.stat().st_mtime_ns, (path / "model.safetensors").stat().st_mtime_ns) == stamp
    assert json.loads(marker.read_text())["arch"] == "llama"
    assert not [p for p in path.parent.iterdir() if p.name.startswith(".tiny-llama-v1")]


def test_default_model_concurrent_first_use(tmp_path, monkeypatch):
    monkeypatch.setenv("KVACTORS_HOME", str(tmp_path))
    with ThreadPoolExecutor(4) as pool:
        paths = list(pool.map(lambda _: tiny_llama_path(), range(4)))
    assert len(set(paths)) == 1
    assert (paths[0] / COMPLETE_MARKER).exists()
    assert [p.name for p in (tmp_path / "models").iterdir()] == ["tiny-llama-v1"]
    model, _ = mlx_lm.load(str(paths[0]))
    assert model.model_type == "llama"


def test_default_model_rebuilds_an_incomplete_folder(tmp_path, monkeypatch):
    monkeypatch.setenv("KVACTORS_HOME", str(tmp_path))
    half = tmp_path / "models" / "tiny-llama-v1"
    half.mkdir(parents=True)
    (half / "config.json").write_text("{}")  # a half-written leftover
    path = tiny_llama_path()
    assert path == half and (path / COMPLETE_MARKER).exists()
    assert json.loads((path / "config.json").read_text())["model_type"] == "llama"


def test_default_model_build_killed_midway_leaves_nothing_behind(tmp_path, kill_mid_build, monkeypatch):
    """A process SIGKILLed while it builds the tiny llama leaves its temporary folder; the next build removes it."""
    models = tmp_path / "models"
    env = {**os.environ, "KVACTORS_HOME": str(tmp_path)}
    script = "from runtime.tiny import tiny_llama_path; tiny_llama_path()"
    kill_mid_build([sys.executable, "-c", script], models, env)
    monkeypatch.setenv("KVACTORS_HOME", str(tmp_path))
    path = tiny_llama_path()
    assert os.listdir(models) == [path.name]
    assert json.loads((path / COMPLETE_MARKER).read_text())["arch"] == "llama"


def test_make_tiny_model_killed_midway_leaves_no_folder_and_the_next_build_cleans_up(tmp_path, kill_mid_build):
    """`make_tiny_model` into a folder the caller names, SIGKILLed while it writes: no folder under that name, and
    the next build of it removes the killed one's leftovers. They stayed forever: only the default model's
    build took the lock whose holder removes them."""
    dest = tmp_path / "dest"
    script = "import sys\nfrom runtime.tiny import make_tiny_model\nmake_tiny_model(sys.argv[1])"
    kill_mid_build([sys.executable, "-c", script, str(dest / "m")], dest)
    assert "m" not in os.listdir(dest)  # never a half-written folder under the name
    path = make_tiny_model(dest / "m")
    assert os.listdir(dest) == ["m"]  # no temporary folder, no lock file
    assert load_model(path)[0] is not None  # the whole folder, as the project loads it


def test_tokenizer_is_not_compositional(load_tiny):
    assert NON_COMPOSITIONAL == (A, B)
    _, tokenizer = load_tiny("llama")
    assert len(tokenizer.vocab) == tiny.VOCAB_SIZE
    joint = tokenize(tokenizer, A + B)
    apart = tokenize(tokenizer, A) + tokenize(tokenizer, B)
    assert joint != apart
    assert len(joint) < len(apart)  # a merge across the boundary
    assert tokenizer.decode(joint) == tokenizer.decode(apart) == A + B
