"""GGUF import: small GGUF files written here the way llama.cpp's converter writes them.

Each file is made from a tiny model folder (random weights): its tensors renamed to
llama.cpp's names, llama's q/k rows permuted as llama.cpp does, quantized by the gguf
package; its tokenizer as GGUF vocabulary, merges and token types. Converting back
must give the exact weights (or their exact dequantization), the same tokens and the
same logits, through the real `mlx_lm.load`.
"""

import json
import subprocess
import sys
from pathlib import Path

import mlx.core as mx
import mlx_lm
import numpy as np
import pytest

gguf = pytest.importorskip("gguf")
from gguf import GGMLQuantizationType as Q  # noqa: E402
from gguf import quants  # noqa: E402

from runtime.gguf import GGUFError, UnsupportedGGUF, gguf_model_path, import_gguf  # noqa: E402
from runtime.model import load_model  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
TEXTS = ["Hello world, 1234 tokens!", "naïve café 日本語 🙂", "  two  spaces\n\nand a tab\t.", "The plan"]

_NAMES = {
    "input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm", "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output",
    "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down",
}


def gguf_name(name):
    """llama.cpp's name for an mlx-lm tensor name."""
    stem, _, suffix = name.rpartition(".")
    if stem == "model.embed_tokens":
        return f"token_embd.{suffix}"
    if stem == "model.norm":
        return f"output_norm.{suffix}"
    if stem == "lm_head":
        return f"output.{suffix}"
    _, _, layer, rest = stem.split(".", 3)
    return f"blk.{layer}.{_NAMES[rest]}.{suffix}"


def permute(w, n_heads):
    """llama.cpp's rope permutation of q/k rows (convert_hf_to_gguf.py, LlamaModel.permute)."""
    return w.reshape(n_heads, 2, w.shape[0] // n_heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def write_gguf(path, folder, qtype=Q.F32, arch=None, raw=None):
    """Write `folder` (a tiny model) as a GGUF file at `path`; return {gguf name: float32 array as stored}.

    2-D weights whose rows are multiples of 32 use `qtype`, everything else F32. `raw`
    maps a gguf name to (bytes, type) written as is. The returned arrays are what the
    file holds, dequantized (llama's q/k still permuted).
    """
    config = json.loads((folder / "config.json").read_text())
    arch = arch or config["model_type"]
    tok = json.loads((folder / "tokenizer.json").read_text())
    w = gguf.GGUFWriter(str(path), arch)
    w.add_block_count(config["num_hidden_layers"])
    w.add_context_length(config["max_position_embeddings"])
    w.add_embedding_length(config["hidden_size"])
    w.add_feed_forward_length(config["intermediate_size"])
    w.add_head_count(config["num_attention_heads"])
    w.add_head_count_kv(config["num_key_value_heads"])
    w.add_key_length(config["head_dim"])
    w.add_value_length(config["head_dim"])
    w.add_rope_dimension_count(config["head_dim"])
    w.add_rope_freq_base(config["rope_theta"])
    w.add_layer_norm_rms_eps(config["rms_norm_eps"])
    w.add_vocab_size(config["vocab_size"])
    vocab = sorted(tok["model"]["vocab"].items(), key=lambda kv: kv[1])
    specials = {t["content"] for t in tok["added_tokens"] if t["special"]}
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("gpt-2")
    w.add_token_list([t for t, _ in vocab])
    w.add_token_types([3 if t in specials else 1 for t, _ in vocab])
    w.add_token_merges([" ".join(m) if isinstance(m, list) else m for m in tok["model"]["merges"]])
    w.add_bos_token_id(config["bos_token_id"])
    w.add_eos_token_id(config["eos_token_id"][0])
    w.add_eot_token_id(config["eos_token_id"][1])
    w.add_pad_token_id(config["pad_token_id"])
    w.add_add_bos_token(True)
    w.add_chat_template(json.loads((folder / "tokenizer_config.json").read_text())["chat_template"])
    stored = {}
    weights = mx.load(str(folder / "model.safetensors"))
    for name, a in sorted(weights.items()):
        gname = gguf_name(name)
        a = np.array(a.astype(mx.float32))
        if arch == "llama" and ".self_attn.q_proj." in name:
            a = permute(a, config["num_attention_heads"])
        if arch == "llama" and ".self_attn.k_proj." in name:
            a = permute(a, config["num_key_value_heads"])
        if raw and gname in raw:
            data, t = raw[gname]
            w.add_tensor(gname, data, raw_dtype=t)
            continue
        t = qtype if a.ndim == 2 and a.shape[1] % 32 == 0 else Q.F32
        data = a if t == Q.F32 else quants.quantize(a, t)
        w.add_tensor(gname, data, raw_dtype=None if t == Q.F32 else t)
        stored[gname] = a if t == Q.F32 else quants.dequantize(data, t).reshape(a.shape)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return stored


def expected_weights(stored, config, arch):
    """{mlx-lm name: float32 array}: what the folder must hold, q/k rows put back."""
    out = {}
    for gname, a in stored.items():
        name = next(n for n in MLX_NAMES[arch] if gguf_name(n) == gname)
        if arch == "llama" and ".q_proj." in name:
            a = unpermute(a, config["num_attention_heads"])
        if arch == "llama" and ".k_proj." in name:
            a = unpermute(a, config["num_key_value_heads"])
        out[name] = a
    return out


def unpermute(a, n):
    return a.reshape(n, a.shape[0] // n // 2, 2, *a.shape[1:]).swapaxes(1, 2).reshape(a.shape)


MLX_NAMES = {}


@pytest.fixture(scope="module")
def tiny(tiny_model_path):
    """{arch: tiny model folder} for llama and qwen2 (qwen2 has q/k/v biases)."""
    folders = {arch: tiny_model_path(arch) for arch in ("llama", "qwen2")}
    for arch, folder in folders.items():
        MLX_NAMES[arch] = list(mx.load(str(folder / "model.safetensors")))
    return folders


def folder_weights(folder):
    """{name: float32 numpy} of a converted folder, quantized layers dequantized."""
    w = mx.load(str(folder / "model.safetensors"))
    config = json.loads((folder / "config.json").read_text())
    q = config.get("quantization") or {}
    out = {}
    for name, a in w.items():
        stem = name.rpartition(".")[0]
        if name.endswith((".scales", ".biases")) and f"{stem}.weight" in w:
            continue
        if name.endswith(".weight") and f"{stem}.scales" in w:
            bits = q.get(stem, q)["bits"]
            a = mx.dequantize(a, w[f"{stem}.scales"].astype(mx.float32), w[f"{stem}.biases"].astype(mx.float32),
                              group_size=32, bits=bits)
        out[name] = np.array(a.astype(mx.float32))
    return out


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_float32_gguf_round_trips_bit_exactly(tmp_path, tiny, arch):
    src = tiny[arch]
    write_gguf(tmp_path / "m.gguf", src)
    out = import_gguf(tmp_path / "m.gguf", tmp_path / "m", "float32")
    original = {k: np.array(v) for k, v in mx.load(str(src / "model.safetensors")).items()}
    converted = folder_weights(out)
    assert set(converted) == set(original)
    for name, a in original.items():
        assert np.array_equal(converted[name], a), name
    m0, t0 = mlx_lm.load(str(src))
    m1, t1 = mlx_lm.load(str(out))
    for text in TEXTS:
        assert t1.encode(text) == t0.encode(text)
        assert t1.encode(text, add_special_tokens=False) == t0.encode(text, add_special_tokens=False)
        assert t1.decode(t1.encode(text, add_special_tokens=False)) == text
    chat = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi <|eot_id|> 42"}]
    assert t1.apply_chat_template(chat, add_generation_prompt=True) == \
        t0.apply_chat_template(chat, add_generation_prompt=True)
    assert set(t1.eos_token_ids) == set(t0.eos_token_ids)
    ids = mx.array([t0.encode(TEXTS[0])])
    assert np.array_equal(np.array(m1(ids)), np.array(m0(ids)))


@pytest.mark.parametrize("qtype", [Q.Q4_0, Q.Q4_1, Q.Q8_0, Q.Q5_0])
@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_quantized_gguf_converts_to_its_exact_dequantization(tmp_path, tiny, arch, qtype):
    """Q4_0/Q4_1/Q8_0 (read by MLX) and Q5_0 (read by the gguf package) both give the exact floats."""
    config = json.loads((tiny[arch] / "config.json").read_text())
    stored = write_gguf(tmp_path / "m.gguf", tiny[arch], qtype)
    expected = expected_weights(stored, config, arch)
    converted = folder_weights(import_gguf(tmp_path / "m.gguf", tmp_path / "f32", "float32"))
    assert set(converted) == set(expected)
    for name, a in expected.items():
        assert np.array_equal(converted[name], a), name
    quantized = import_gguf(tmp_path / "m.gguf", tmp_path / "q", "quantized")
    qconfig = json.loads((quantized / "config.json").read_text())
    assert qconfig["quantization"]["group_size"] == 32
    qweights = folder_weights(quantized)
    for name, a in expected.items():
        if qtype != Q.Q5_0 or a.ndim == 1:  # Q5_0 is requantized by MLX (8 bits): close, not exact
            assert np.allclose(qweights[name], a, atol=1e-3 if a.ndim == 1 else 0, rtol=1e-3 if a.ndim == 1 else 0), name
        else:
            assert np.abs(qweights[name] - a).max() <= np.abs(a).max() / 100, name
    model, tok = mlx_lm.load(str(quantized))  # the real loader takes the per-layer quantization
    assert model(mx.array([tok.encode("hello")])).shape[-1] == config["vocab_size"]


def test_unreadable_quantization_type_is_refused_by_name(tmp_path, tiny):
    data = np.zeros((256, 128 // 32 * 40), dtype=np.uint8)  # Q8_1 blocks: 40 bytes per 32 values
    write_gguf(tmp_path / "m.gguf", tiny["llama"], raw={"blk.0.attn_q.weight": (data, Q.Q8_1)})
    with pytest.raises(UnsupportedGGUF, match="Q8_1"):
        import_gguf(tmp_path / "m.gguf", tmp_path / "m", "float32")
    assert not (tmp_path / "m").exists()


def test_unsupported_architecture_and_non_gguf_files_are_clear_errors(tmp_path, tiny):
    write_gguf(tmp_path / "m.gguf", tiny["llama"], arch="phi3")
    with pytest.raises(UnsupportedGGUF, match="'phi3'.*supported: llama, qwen2"):
        import_gguf(tmp_path / "m.gguf", tmp_path / "m")
    (tmp_path / "junk.gguf").write_bytes(b"not a gguf file at all" * 10)
    with pytest.raises(GGUFError, match="not a readable GGUF"):
        import_gguf(tmp_path / "junk.gguf", tmp_path / "j")
    with pytest.raises(GGUFError, match="no such GGUF file"):
        gguf_model_path(tmp_path / "missing.gguf")


@pytest.mark.parametrize("qtype", [Q.F32, Q.Q4_0, Q.Q8_0])
def test_a_truncated_gguf_file_is_a_clear_error_wherever_it_ends(tmp_path, tiny, qtype):
    write_gguf(tmp_path / "m.gguf", tiny["llama"], qtype)
    data = (tmp_path / "m.gguf").read_bytes()
    for cut in (8, 24, 64, 200, 1000, len(data) // 2, len(data) - 10):
        (tmp_path / "cut.gguf").write_bytes(data[:cut])
        with pytest.raises(GGUFError, match="not a readable GGUF file"):
            import_gguf(tmp_path / "cut.gguf", tmp_path / f"out{cut}", "float32")
        assert not (tmp_path / f"out{cut}").exists()


def test_model_cache_converts_each_file_once_keyed_by_its_hash(tmp_path, tiny):
    write_gguf(tmp_path / "a.gguf", tiny["llama"], Q.Q8_0)
    first = gguf_model_path(tmp_path / "a.gguf", "float32")
    stamp = (first / "model.safetensors").stat().st_mtime_ns
    (tmp_path / "moved.gguf").write_bytes((tmp_path / "a.gguf").read_bytes())
    assert gguf_model_path(tmp_path / "moved.gguf", "float32") == first  # same bytes, same folder
    assert (first / "model.safetensors").stat().st_mtime_ns == stamp  # not converted again
    write_gguf(tmp_path / "b.gguf", tiny["llama"], Q.Q4_0)
    assert gguf_model_path(tmp_path / "b.gguf", "float32") != first
    assert gguf_model_path(tmp_path / "a.gguf", "quantized") != first


def test_runtime_takes_a_gguf_file(tmp_path, tiny):
    from runtime import Runtime

    write_gguf(tmp_path / "m.gguf", tiny["llama"], Q.Q8_0)
    _, _, spec = load_model(tmp_path / "m.gguf")
    assert spec.model_id == str(gguf_model_path(tmp_path / "m.gguf"))
    with Runtime(model=tmp_path / "m.gguf", cache_dir=tmp_path / "agents") as rt:
        agent = rt.spawn("reader")
        assert agent.ask("hello", max_tokens=3).cache == "cold"
        assert agent.ask("again", max_tokens=3).cache == "hot"


def test_import_gguf_command(tmp_path, tiny):
    write_gguf(tmp_path / "m.gguf", tiny["qwen2"], Q.Q4_1)
    run = subprocess.run([sys.executable, "-m", "runtime.api.cli", "import-gguf", tmp_path / "m.gguf", tmp_path / "out",
                          "--weights", "quantized"], capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert run.returncode == 0, run.stderr
    assert run.stdout.strip() == str(tmp_path / "out")
    assert mlx_lm.load(str(tmp_path / "out"))[0].model.layers[0].self_attn.q_proj.bits == 4
    again = subprocess.run([sys.executable, "-m", "runtime.api.cli", "import-gguf", tmp_path / "m.gguf", tmp_path / "out"],
                           capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert again.returncode == 2 and "already exists" in again.stderr and "Traceback" not in again.stderr
