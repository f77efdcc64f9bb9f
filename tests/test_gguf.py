"""GGUF import: small GGUF files written here the way llama.cpp's converter writes them.

Each file is made from a tiny model folder (random weights): its tensors renamed to
llama.cpp's names, llama's q/k rows permuted as llama.cpp does, quantized by the gguf
package; its tokenizer as GGUF vocabulary, merges and token types. Converting back
must give the exact weights (or their exact dequantization), the same tokens and the
same logits, through the real `mlx_lm.load`.
"""

import contextlib
import json
import logging
import os
import resource
import shutil
import signal
import struct
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
import mlx_lm
import numpy as np
import pytest
from mlx.utils import tree_flatten

gguf = pytest.importorskip("gguf")
from gguf import GGMLQuantizationType as Q  # noqa: E402
from gguf import GGUFValueType as V  # noqa: E402
from gguf import quants  # noqa: E402

from runtime.gguf import GGUFError, UnsupportedGGUF, gguf_model_path, import_gguf  # noqa: E402
from runtime.model import load_model, model_folder_lock  # noqa: E402

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
    """A type neither MLX nor the gguf package reads is refused by name before any tensor is converted (a large
    file's earlier tensors are not converted for nothing), and nothing is written."""
    data = np.zeros((256, 128 // 32 * 40), dtype=np.uint8)  # Q8_1 blocks: 40 bytes per 32 values
    write_gguf(tmp_path / "m.gguf", tiny["llama"], raw={"blk.0.attn_q.weight": (data, Q.Q8_1)})
    converted = []
    with pytest.raises(UnsupportedGGUF, match="blk.0.attn_q.weight uses quantization type Q8_1"):
        import_gguf(tmp_path / "m.gguf", tmp_path / "m", "float32", progress=lambda done, total: converted.append(done))
    assert not (tmp_path / "m").exists() and converted == []


def test_a_tensor_type_id_gguf_does_not_define_is_unsupported_not_damage(tmp_path, small):
    """An id past the last type the gguf package defines (200; llama.cpp and its forks add types) or one llama.cpp
    has removed (33, Q4_0_8_8) is a tensor type this reader does not know, as a GGUF version other than 2 and 3
    is: UnsupportedGGUF naming the id, not GGUFError's "damaged or cut short"."""
    _, type_at, _ = tensor_infos(small["Q8_0"])["blk.0.ffn_down.weight"]
    for type_id in (200, 33):
        data = bytearray(small["Q8_0"].read_bytes())
        struct.pack_into("<I", data, type_at, type_id)
        (tmp_path / "m.gguf").write_bytes(bytes(data))
        with pytest.raises(UnsupportedGGUF, match=rf"a tensor has GGML type id {type_id}, "
                                                  "which is not supported") as e:
            import_gguf(tmp_path / "m.gguf", tmp_path / "m", "float32")
        assert "damaged" not in str(e.value) and "convert the model again" in str(e.value)
        assert not (tmp_path / "m").exists()


@pytest.mark.parametrize("itype", [Q.I8, Q.I16, Q.I32, Q.I64])
def test_an_integer_tensor_is_unsupported_whichever_reader_reads_the_file(tmp_path, small, itype):
    """GGUF's integer types hold no weights: MLX read an I8, I16 or I32 tensor as integers, which the import cast
    to float weights, while the same tensor beside a type MLX lacks (read by the gguf package) was refused."""
    down = np.zeros((128, 256), dtype={Q.I8: np.int8, Q.I16: np.int16, Q.I32: np.int32, Q.I64: np.int64}[itype])
    for qtype in ("Q8_0", "Q5_0"):
        rewrite(small[qtype], tmp_path / "m.gguf", tensors={"blk.0.ffn_down.weight": (down, itype)})
        with pytest.raises(UnsupportedGGUF, match=rf"tensor blk\.0\.ffn_down\.weight is of integer type {itype.name}"):
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


def test_a_folder_an_earlier_conversion_rule_made_is_converted_again(tmp_path, tiny, caplog):
    """A model cache folder converted before the rules changed (it might hold what float16 overflowed) is not reused:
    the file is converted again into a folder of the current rule's name, and the old one is left as it was, with
    one warning (at the conversion, not at each use after) that names it as no longer used, to delete."""
    from runtime import gguf

    write_gguf(tmp_path / "a.gguf", tiny["llama"], Q.Q8_0)
    current = gguf_model_path(tmp_path / "a.gguf", "float32")
    old = current.with_name(current.name.removesuffix(f"-c{gguf.CONVERSION}"))  # as folders were named before
    shutil.copytree(current, old)
    shutil.rmtree(current)
    with caplog.at_level(logging.WARNING, logger="runtime.gguf"):
        assert gguf_model_path(tmp_path / "a.gguf", "float32") == current and current != old
        assert gguf_model_path(tmp_path / "a.gguf", "float32") == current
    assert (current / "model.safetensors").is_file() and (old / "model.safetensors").is_file()
    said = [r.getMessage() for r in caplog.records if "no longer used" in r.getMessage()]
    assert len(said) == 1 and f"rm -r {old}" in said[0]
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="runtime.gguf"):
        gguf_model_path(tmp_path / "a.gguf", "quantized")  # no earlier folder of these weights: nothing said
    assert not [r for r in caplog.records if "no longer used" in r.getMessage()]


@pytest.mark.parametrize("weights", ["float32", "quantized"])
@pytest.mark.parametrize("qtype", [Q.F32, Q.Q4_1, Q.Q8_0])
def test_a_file_mlx_reads_exactly_converts_to_the_bytes_an_earlier_conversion_wrote(tmp_path, tiny, qtype, weights):
    """A model's agents are stored under its fingerprint, which samples the bytes of model.safetensors. A file whose
    tensors MLX reads exactly (F32, Q4_1, Q8_0: no value changed when the conversion's version was raised) is
    converted again into the folder of the new version's name: it must write the very bytes the earlier conversion
    wrote, its tensors laid out in the order mx.load lists them. Laid out in the file's order, the default model
    (a Q4_1 file) got another fingerprint, and no agent stored for it before was found."""
    from runtime.gguf import _mlx_name
    from runtime.model import fingerprint

    write_gguf(tmp_path / "m.gguf", tiny["llama"], qtype)
    out = import_gguf(tmp_path / "m.gguf", tmp_path / "m", weights)
    converted = mx.load(str(out / "model.safetensors"))
    order = []
    for name in mx.load(str(tmp_path / "m.gguf")):  # the earlier conversion's order: mx.load's
        if not name.endswith((".scales", ".biases")):
            stem = _mlx_name(name).rpartition(".")[0]
            order += [_mlx_name(name)] + [f"{stem}.{part}" for part in ("scales", "biases") if f"{stem}.{part}" in converted]
    assert sorted(order) == sorted(converted)
    earlier = tmp_path / "earlier"
    earlier.mkdir()
    for f in out.iterdir():
        if f.name != "model.safetensors":
            shutil.copy(f, earlier / f.name)
    mx.save_safetensors(str(earlier / "model.safetensors"), {k: converted[k] for k in order}, {"format": "mlx"})
    assert (out / "model.safetensors").read_bytes() == (earlier / "model.safetensors").read_bytes()
    assert fingerprint(out) == fingerprint(earlier)


def progress_lines(said, name, tensors) -> bool:
    """Whether `said` are a conversion's progress lines of `tensors` tensors: its first tensor, its last, and between
    them (every 2 s: a slow machine's) counts in order."""
    counts = [int(line.rpartition(": ")[2].split("/")[0]) for line in said]
    return (len(said) >= 2 and all(line == f"kvactors: converting {name}: {n}/{tensors} tensors"
                                   for line, n in zip(said, counts))
            and counts[0] == 1 and counts[-1] == tensors and counts == sorted(set(counts)))


def test_runtime_takes_a_gguf_file(tmp_path, tiny, capfd):
    """A first use converts the file, saying how far on standard error; later uses take the folder, silently."""
    from runtime import Runtime

    write_gguf(tmp_path / "plain.gguf", tiny["llama"], Q.Q8_0)  # as other tests convert it: bytes of its own here
    rewrite(tmp_path / "plain.gguf", tmp_path / "m.gguf", meta={"general.name": ("runtime", V.STRING)})
    _, _, spec = load_model(tmp_path / "m.gguf")
    assert spec.model_id == str(gguf_model_path(tmp_path / "m.gguf"))
    tensors = len(gguf.GGUFReader(str(tmp_path / "m.gguf")).tensors)
    said = [line for line in capfd.readouterr().err.splitlines() if line.startswith("kvactors: converting")]
    assert progress_lines(said, "m.gguf", tensors)
    with Runtime(model=tmp_path / "m.gguf", cache_dir=tmp_path / "agents") as rt:
        agent = rt.spawn("reader")
        assert agent.ask("hello", max_tokens=3).cache == "cold"
        assert agent.ask("again", max_tokens=3).cache == "hot"
    assert "kvactors: converting" not in capfd.readouterr().err


def test_import_gguf_command(tmp_path, tiny):
    write_gguf(tmp_path / "m.gguf", tiny["qwen2"], Q.Q4_1)
    run = subprocess.run([sys.executable, "-m", "runtime.api.cli", "import-gguf", tmp_path / "m.gguf", tmp_path / "out",
                          "--weights", "quantized"], capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert run.returncode == 0, run.stderr
    assert run.stdout.strip() == str(tmp_path / "out")
    assert mlx_lm.load(str(tmp_path / "out"))[0].model.layers[0].self_attn.q_proj.bits == 4
    tensors = len(gguf.GGUFReader(str(tmp_path / "m.gguf")).tensors)
    said = [line for line in run.stderr.splitlines() if line.startswith("kvactors: converting")]
    assert progress_lines(said, "m.gguf", tensors), run.stderr
    again = subprocess.run([sys.executable, "-m", "runtime.api.cli", "import-gguf", tmp_path / "m.gguf", tmp_path / "out"],
                           capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert again.returncode == 2 and "already exists" in again.stderr and "Traceback" not in again.stderr


# ---- what a user can feed the import: damaged, odd and unwritable cases ----

def rewrite(src, dst, meta=None, tensors=None):
    """Copy the GGUF file `src` to `dst` through the gguf package, changing some of it.

    `meta`: key -> None (left out) or (value, GGUFValueType[, item type]); `tensors`: name -> None (left out)
    or (array, raw type or None), names not in `src` added.
    """
    meta, tensors = dict(meta or {}), dict(tensors or {})
    r = gguf.GGUFReader(str(src))
    w = gguf.GGUFWriter(str(dst), r.fields["general.architecture"].contents())
    w.kv_data[0].pop("general.architecture")
    for key, field in r.fields.items():
        if not key.startswith("GGUF.") and key not in meta:
            w.add_key_value(key, field.contents(), field.types[0], field.types[-1] if field.types[0] == V.ARRAY else None)
    for key, value in meta.items():
        if value is not None:
            w.add_key_value(key, *value)
    for t in r.tensors:
        data, qtype = tensors.pop(t.name) if t.name in tensors else (np.array(t.data), t.tensor_type)
        if data is not None:
            w.add_tensor(t.name, data, raw_dtype=None if qtype == Q.F32 else qtype)
    for name, (data, qtype) in tensors.items():
        w.add_tensor(name, data, raw_dtype=qtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def tensor_infos(path):
    """{tensor name: (offsets of its name, its type field and its data-offset field)} in the GGUF file at `path`."""
    r = gguf.GGUFReader(str(path))
    out = {}
    for t in r.tensors:
        at = t.field.offset
        name_len = struct.unpack_from("<Q", r.data, at)[0]
        dims = struct.unpack_from("<I", r.data, at + 8 + name_len)[0]
        type_at = at + 8 + name_len + 4 + 8 * dims
        out[t.name] = (at + 8, type_at, type_at + 4)
    return out


@pytest.fixture(scope="module")
def small(tiny, tmp_path_factory):
    """A Q8_0 llama GGUF file (read by MLX) and a Q5_0 one (read by the gguf package)."""
    folder = tmp_path_factory.mktemp("small")
    for qtype in (Q.Q8_0, Q.Q5_0):
        write_gguf(folder / f"{qtype.name}.gguf", tiny["llama"], qtype)
    return {"Q8_0": folder / "Q8_0.gguf", "Q5_0": folder / "Q5_0.gguf"}


def damaged_headers(src):
    """{case: bytes of `src` with its header or tensor infos damaged}."""
    data = src.read_bytes()
    infos = tensor_infos(src)
    first, (_, type_at, offset_at) = next(iter(infos.items()))
    one, other = next((a, b) for a in infos for b in infos if a < b and len(a) == len(b))

    def edit(at, fmt, value):
        d = bytearray(data)
        struct.pack_into(fmt, d, at, value)
        return bytes(d)

    renamed = bytearray(data)
    renamed[infos[other][0]:infos[other][0] + len(one)] = one.encode()
    return {
        "wrong magic": b"GGML" + data[4:],
        "version 1": edit(4, "<I", 1),
        "version 4": edit(4, "<I", 4),
        "big-endian": edit(4, ">I", 3),
        "tensor count 10**12": edit(8, "<Q", 10**12),
        "metadata count 10**12": edit(16, "<Q", 10**12),
        "key length 2**62": edit(24, "<Q", 2**62),
        "tensor type 99": edit(type_at, "<I", 99),
        "tensor type 4 (removed Q4_2)": edit(type_at, "<I", 4),
        "tensor of width 0": edit(infos[first][0] + len(first) + 4, "<Q", 0),
        "tensor data misaligned": edit(offset_at, "<Q", 3),
        "tensor data past the end": edit(offset_at, "<Q", 2**40),
        "duplicate tensor name": bytes(renamed),
    }


def test_damaged_headers_are_refused_without_crashing(tmp_path, small):
    """MLX's own GGUF parser trusts counts, lengths and types: such files must never reach it."""
    cases = damaged_headers(small["Q8_0"])
    for i, data in enumerate(cases.values()):
        (tmp_path / f"{i}.gguf").write_bytes(data)
    script = (
        "import sys\nfrom runtime.gguf import import_gguf, GGUFError\n"
        "for i in range(int(sys.argv[2])):\n"
        "    try:\n"
        "        import_gguf(f'{sys.argv[1]}/{i}.gguf', f'{sys.argv[1]}/out{i}', 'float32')\n"
        "        print('converted', flush=True)\n"
        "    except GGUFError as e:\n"
        "        print(type(e).__name__, str(e).replace(chr(10), ' '), flush=True)\n"
    )  # one child process for every case: a crash in native code ends it, not the test run
    run = subprocess.run([sys.executable, "-c", script, str(tmp_path), str(len(cases))], capture_output=True,
                         text=True, timeout=120, cwd=ROOT)
    lines = run.stdout.splitlines()
    done = dict(zip(cases, lines))
    assert run.returncode == 0 and len(lines) == len(cases), (done, run.returncode, run.stderr[-2000:])
    expected = {
        "wrong magic": ("GGUFError", "not a GGUF file"),
        "version 1": ("UnsupportedGGUF", "version 1"),
        "version 4": ("UnsupportedGGUF", "version 4"),
        "big-endian": ("UnsupportedGGUF", "big-endian"),
        "tensor type 99": ("UnsupportedGGUF", "type id 99"),
        "tensor type 4 (removed Q4_2)": ("UnsupportedGGUF", "type id 4"),
        "tensor of width 0": ("GGUFError", "token_embd.weight has shape [0, "),
        "tensor data misaligned": ("GGUFError", "token_embd.weight"),
        "duplicate tensor name": ("GGUFError", "duplicate"),
    }
    for case, line in done.items():
        kind, fragment = expected.get(case, ("GGUFError", "not a readable GGUF file"))
        assert line.startswith(kind + " ") and fragment.lower() in line.lower(), (case, line)
        assert "get the file again" in line or "supported" in line, (case, line)
    assert not list(tmp_path.glob("out*")) and not list(tmp_path.glob(".out*"))


def test_a_fifo_or_a_folder_is_refused_at_once(tmp_path, small):
    os.mkfifo(tmp_path / "pipe.gguf")  # opening it for reading would wait for a writer forever
    (tmp_path / "folder.gguf").mkdir()
    script = ("import sys\nfrom runtime.gguf import import_gguf, gguf_model_path, GGUFError\n"
              "for f in (import_gguf, gguf_model_path):\n"
              "    for p in sys.argv[1:]:\n"
              "        try: (f(p, p + '.out', 'float32') if f is import_gguf else f(p, 'float32')); print('converted')\n"
              "        except GGUFError as e: print(type(e).__name__, e)\n")
    run = subprocess.run([sys.executable, "-c", script, str(tmp_path / "pipe.gguf"), str(tmp_path / "folder.gguf")],
                         capture_output=True, text=True, timeout=60, cwd=ROOT,
                         env={**os.environ, "KVACTORS_HOME": str(tmp_path / "home")})
    assert run.returncode == 0, run.stderr[-2000:]
    lines = run.stdout.splitlines()
    assert len(lines) == 4 and all(line.startswith("GGUFError ") for line in lines), lines
    assert "pipe.gguf is not a regular file" in lines[0] and "folder.gguf is a folder" in lines[1], lines
    assert lines[2:] == lines[:2]


BAD_METADATA = {
    "no vocabulary": ({"tokenizer.ggml.tokens": None}, "tokenizer.ggml.tokens"),
    "architecture as a list": ({"general.architecture": (["llama"], V.ARRAY, V.STRING)}, "general.architecture"),
    "width as text": ({"llama.embedding_length": ("abc", V.STRING)}, "llama.embedding_length"),
    "width as a list": ({"llama.embedding_length": ([1, 2], V.ARRAY, V.UINT32)}, "llama.embedding_length"),
    "no heads": ({"llama.attention.head_count": (0, V.UINT32)}, "llama.attention.head_count"),
    "epsilon as text": ({"llama.attention.layer_norm_rms_epsilon": ("x", V.STRING)}, "layer_norm_rms_epsilon"),
    "context as text": ({"llama.context_length": ("x", V.STRING)}, "llama.context_length"),
    "template as a number": ({"tokenizer.chat_template": (5, V.UINT32)}, "tokenizer.chat_template"),
    "vocabulary of numbers": ({"tokenizer.ggml.tokens": ([1, 2, 3], V.ARRAY, V.INT32)}, "tokenizer.ggml.tokens"),
    "merges of numbers": ({"tokenizer.ggml.merges": ([1, 2], V.ARRAY, V.INT32)}, "tokenizer.ggml.merges"),
    "merge without a space": ({"tokenizer.ggml.merges": (["nospace"], V.ARRAY, V.STRING)}, "tokenizer"),
    "bos id as text": ({"tokenizer.ggml.bos_token_id": ("x", V.STRING)}, "tokenizer.ggml.bos_token_id"),
    "add_bos as text": ({"tokenizer.ggml.add_bos_token": ("no", V.STRING)}, "tokenizer.ggml.add_bos_token"),
}


@pytest.mark.parametrize("case", BAD_METADATA)
def test_metadata_of_the_wrong_type_or_missing_is_refused_by_key(tmp_path, small, case):
    meta, key = BAD_METADATA[case]
    rewrite(small["Q8_0"], tmp_path / "m.gguf", meta=meta)
    with pytest.raises(GGUFError, match=key) as e:
        import_gguf(tmp_path / "m.gguf", tmp_path / "m", "float32")
    assert "convert the model again" in str(e.value) or "supported" in str(e.value)
    assert not (tmp_path / "m").exists()


def test_tensors_that_do_not_fit_the_metadata_are_refused_before_anything_is_written(tmp_path, small):
    """Converted, such a file would make a folder that mlx-lm then refuses on every load."""
    down = np.zeros((256, 128), dtype=np.float32)  # ffn_down is (hidden 128, intermediate 256)
    cases = {
        "more layers": ({"llama.block_count": (3, V.UINT32)}, {}, "missing"),
        "fewer layers": ({"llama.block_count": (1, V.UINT32)}, {}, "blk.1."),
        "wider": ({"llama.embedding_length": (96, V.UINT32)}, {}, "where the model its metadata describes needs"),
        "key heads": ({"llama.attention.head_count_kv": (3, V.UINT32)}, {}, "attn_k.weight"),
        "vocabulary": ({"llama.vocab_size": (7, V.UINT32)}, {}, "token_embd.weight"),
        "a tensor missing": ({}, {"blk.0.ffn_down.weight": (None, None)}, "blk.0.ffn_down.weight"),
        "a tensor transposed": ({}, {"blk.0.ffn_down.weight": (down, Q.F32)}, "blk.0.ffn_down.weight"),
        "an unknown tensor": ({}, {"rope_freqs.weight": (np.ones(32, np.float32), Q.F32)}, "rope_freqs.weight"),
    }
    for case, (meta, tensors, fragment) in cases.items():
        for qtype in ("Q8_0", "Q5_0"):
            rewrite(small[qtype], tmp_path / "m.gguf", meta=meta, tensors=tensors)
            with pytest.raises(GGUFError, match=fragment.replace(".", r"\.")) as e:
                import_gguf(tmp_path / "m.gguf", tmp_path / "m", "float32")
            assert not (tmp_path / "m").exists(), case
            assert "convert the model again" in str(e.value) or "supported" in str(e.value), (case, str(e.value))


@contextlib.contextmanager
def as_another_user():
    """Run the block as a user without root's right to read and write anything (root's tests run as nobody)."""
    if os.geteuid() != 0:
        yield
        return
    os.seteuid(65534)
    try:
        yield
    finally:
        os.seteuid(0)


def test_an_unreadable_file_is_a_clear_error(tmp_path, small):
    folder = Path(tempfile.mkdtemp())  # a folder any user may enter (pytest's are root's alone)
    try:
        folder.chmod(0o755)
        shutil.copy(small["Q8_0"], folder / "m.gguf")
        (folder / "m.gguf").chmod(0)
        with as_another_user():
            with pytest.raises(GGUFError, match="cannot read") as e1:
                gguf_model_path(folder / "m.gguf", "float32")
            with pytest.raises(GGUFError, match="cannot read") as e2:
                import_gguf(folder / "m.gguf", folder / "out", "float32")
        assert "m.gguf" in str(e1.value) and "permission" in str(e2.value).lower()
    finally:
        shutil.rmtree(folder)


def test_an_unwritable_or_full_model_folder_is_a_clear_error(tmp_path, small, monkeypatch):
    folder = Path(tempfile.mkdtemp())  # root's: another user may enter and read, not write
    try:
        folder.chmod(0o755)
        shutil.copy(small["Q8_0"], folder / "m.gguf")
        monkeypatch.setenv("KVACTORS_HOME", str(folder / "home"))
        with as_another_user():
            with pytest.raises(GGUFError, match="cannot write") as e:
                gguf_model_path(folder / "m.gguf", "float32")
            with pytest.raises(GGUFError, match="cannot write"):
                import_gguf(folder / "m.gguf", folder / "out", "float32")
        assert "KVACTORS_HOME" in str(e.value)
    finally:
        shutil.rmtree(folder)
    limit = resource.getrlimit(resource.RLIMIT_FSIZE)
    handler = signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    resource.setrlimit(resource.RLIMIT_FSIZE, (100_000, limit[1]))  # a write past 100 kB fails, as on a full disk
    try:
        with pytest.raises(GGUFError, match="cannot write"):
            import_gguf(small["Q8_0"], tmp_path / "full" / "out", "float32")
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, limit)
        signal.signal(signal.SIGXFSZ, handler)
    assert not (tmp_path / "full").exists()  # made for the lock, removed with it


def models_in(home):
    return sorted(os.listdir(home / "models"))


@pytest.fixture(scope="module")
def big(tiny_model_path, tmp_path_factory):
    """A float32 llama GGUF file large enough that a kill lands while its conversion writes."""
    path = tmp_path_factory.mktemp("big") / "big.gguf"
    write_gguf(path, tiny_model_path("llama", hidden_size=512, intermediate_size=1024, num_hidden_layers=4), Q.F32)
    return path


def test_an_import_killed_midway_leaves_nothing_a_later_load_takes(tmp_path, big, kill_mid_build, monkeypatch):
    """The child is SIGKILLed while its folder is half written; the next import converts afresh and cleans up."""
    home = tmp_path / "home"
    env = {**os.environ, "KVACTORS_HOME": str(home)}
    script = "import sys\nfrom runtime.gguf import gguf_model_path\nprint(gguf_model_path(sys.argv[1], 'float32'))"
    kill_mid_build([sys.executable, "-c", script, str(big)], home / "models", env)
    assert not any(n.startswith("gguf-") for n in models_in(home))  # no folder of that name: nothing to trust
    monkeypatch.setenv("KVACTORS_HOME", str(home))
    out = gguf_model_path(big, "float32")
    assert models_in(home) == [out.name]  # the killed import's half-written folder is gone
    assert mlx_lm.load(str(out))[0] is not None


def import_command(file, out):
    return [sys.executable, "-m", "runtime.api.cli", "import-gguf", str(file), str(out), "--weights", "float32"]


def test_import_gguf_command_killed_midway_leaves_no_out_and_the_next_run_cleans_up(tmp_path, big, kill_mid_build):
    """`kvactors import-gguf FILE OUT` SIGKILLed while it writes leaves no OUT; the next run into OUT removes the
    killed one's leftovers and converts. They stayed forever: only conversions into the model cache took the lock
    whose holder removes them."""
    dest = tmp_path / "dest"
    kill_mid_build(import_command(big, dest / "out"), dest)
    assert "out" not in os.listdir(dest)  # never a half-written OUT
    run = subprocess.run(import_command(big, dest / "out"), capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert run.returncode == 0, run.stderr[-2000:]
    assert run.stdout.strip() == str(dest / "out") and os.listdir(dest) == ["out"]  # no temporary folder, no lock
    assert load_model(dest / "out")[0] is not None


def test_two_import_gguf_commands_into_one_out_convert_once(tmp_path, small):
    """Run at once, one converts and the other, having waited for it, refuses the OUT that now exists."""
    children = [subprocess.Popen(import_command(small["Q8_0"], tmp_path / "out"), cwd=ROOT, stdout=subprocess.PIPE,
                                 stderr=subprocess.PIPE, text=True) for _ in range(2)]
    outs = [child.communicate(timeout=300) for child in children]
    assert sorted(child.returncode for child in children) == [0, 2], outs
    refused = outs[[child.returncode for child in children].index(2)][1]
    assert "already exists" in refused and "does not exist yet" in refused and "Traceback" not in refused, refused
    assert sorted(os.listdir(tmp_path)) == ["out"]
    assert load_model(tmp_path / "out")[0] is not None


def waiting_for_a_lock(pid):
    """Whether process `pid` waits for a `flock` (a blocked entry of /proc/locks)."""
    return any(line.split()[1:3] == ["->", "FLOCK"] and line.split()[5] == str(pid)
               for line in Path("/proc/locks").read_text().splitlines())


@pytest.mark.skipif(not Path("/proc/locks").exists(), reason="needs /proc/locks to see a process wait for a lock")
def test_the_second_import_gguf_into_one_out_waits_before_it_reads_the_file(tmp_path, small):
    """Both of two imports into one OUT read and converted the whole file, the second only then waiting for the
    first to refuse the OUT it made: the memory and time of a conversion for nothing. The second now waits
    first; a file it cannot convert (past its first bytes, which are checked at once) shows that it never read it."""
    (tmp_path / "bad.gguf").write_bytes(damaged_headers(small["Q8_0"])["tensor count 10**12"])
    out = tmp_path / "out"
    with model_folder_lock(out):  # the first import, converting
        child = subprocess.Popen(import_command(tmp_path / "bad.gguf", out), cwd=ROOT, stdout=subprocess.PIPE,
                                 stderr=subprocess.PIPE, text=True)
        deadline = time.monotonic() + 60
        while child.poll() is None and not waiting_for_a_lock(child.pid) and time.monotonic() < deadline:
            time.sleep(0.01)
        out.mkdir()  # what the first import made
    _, err = child.communicate(timeout=60)
    assert child.returncode == 2 and err.splitlines() == [
        f"kvactors import-gguf: {out} already exists: give a folder that does not exist yet, or remove it first"], err


def test_import_gguf_command_never_touches_an_existing_out(tmp_path, small):
    """A folder the project did not build (a user's, or an empty one, which a rename would replace) is refused
    in one line that says what to do, and left as it was."""
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "notes.txt").write_text("keep")
    (tmp_path / "empty").mkdir()
    for out in ("mine", "empty"):
        run = subprocess.run(import_command(small["Q8_0"], tmp_path / out), capture_output=True, text=True,
                             timeout=120, cwd=ROOT)
        assert run.returncode == 2 and len(run.stderr.strip().splitlines()) == 1, run.stderr[-2000:]
        assert f"{tmp_path / out} already exists" in run.stderr and "does not exist yet" in run.stderr, run.stderr
    assert sorted(os.listdir(tmp_path)) == ["empty", "mine"]
    assert os.listdir(tmp_path / "mine") == ["notes.txt"] and (tmp_path / "mine" / "notes.txt").read_text() == "keep"
    assert os.listdir(tmp_path / "empty") == []


def test_two_processes_importing_one_file_at_once_share_one_folder(tmp_path, tiny):
    write_gguf(tmp_path / "m.gguf", tiny["llama"], Q.Q8_0)
    env = {**os.environ, "KVACTORS_HOME": str(tmp_path / "home")}
    script = "import sys\nfrom runtime.gguf import gguf_model_path\nprint(gguf_model_path(sys.argv[1], 'float32'))"
    children = [subprocess.Popen([sys.executable, "-c", script, str(tmp_path / "m.gguf")], cwd=ROOT, env=env,
                                 stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for _ in range(3)]
    outs = [child.communicate(timeout=120) for child in children]
    assert all(child.returncode == 0 for child in children), outs
    folders = {out.strip() for out, _ in outs}
    assert len(folders) == 1 and models_in(tmp_path / "home") == [Path(folders.pop()).name]


def test_import_gguf_command_says_what_is_wrong_in_one_line(tmp_path, small):
    (tmp_path / "bad.gguf").write_bytes(damaged_headers(small["Q8_0"])["tensor count 10**12"])
    (tmp_path / "folder.gguf").mkdir()
    for args in (["bad.gguf", "out"], ["folder.gguf", "out"], ["bad.gguf"]):
        run = subprocess.run([sys.executable, "-m", "runtime.api.cli", "import-gguf", *args], capture_output=True,
                             text=True, timeout=120, cwd=tmp_path,
                             env={**os.environ, "KVACTORS_HOME": str(tmp_path / "home")})
        assert run.returncode == 2 and "Traceback" not in run.stderr, (args, run.returncode, run.stderr[-2000:])
        assert len(run.stderr.strip().splitlines()) == 1 and run.stderr.startswith("kvactors import-gguf: "), run.stderr
    assert not (tmp_path / "out").exists()


def test_metadata_of_64_bit_floats_is_read_without_crashing(tmp_path, small):
    """GGUF's FLOAT64 values (a key, or an array, that this import never reads) are valid GGUF; MLX's parser
    crashed the process on them (SIGSEGV) when the file reached `mx.load`."""
    meta = {"general.some_value": (1.5, V.FLOAT64), "general.some_values": ([1.0, 2.0], V.ARRAY, V.FLOAT64)}
    rewrite(small["Q8_0"], tmp_path / "m.gguf", meta=meta)
    code = "import sys; from runtime.gguf import import_gguf; import_gguf(sys.argv[1], sys.argv[2], 'float32')"
    run = subprocess.run([sys.executable, "-c", code, str(tmp_path / "m.gguf"), str(tmp_path / "m")],
                         capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert run.returncode == 0, (run.returncode, run.stderr[-2000:])
    import_gguf(small["Q8_0"], tmp_path / "plain", "float32")
    assert folder_weights(tmp_path / "m").keys() == folder_weights(tmp_path / "plain").keys()
    for name, a in folder_weights(tmp_path / "plain").items():
        assert np.array_equal(a, folder_weights(tmp_path / "m")[name]), name


def test_a_damaged_layer_count_is_refused_at_once(tmp_path, small):
    """The check of the tensors against the model the metadata describes built that model first: with a layer
    count damaged to 10**8 it built layer objects for minutes, its memory growing, instead of refusing the file."""
    rewrite(small["Q8_0"], tmp_path / "m.gguf", meta={"llama.block_count": (10**8, V.UINT32)})
    code = ("import sys\nfrom runtime.gguf import import_gguf, GGUFError\n"
            "try: import_gguf(sys.argv[1], sys.argv[2], 'float32')\nexcept GGUFError as e: print(e)\n")
    run = subprocess.run([sys.executable, "-c", code, str(tmp_path / "m.gguf"), str(tmp_path / "m")],
                         capture_output=True, text=True, timeout=60, cwd=ROOT)
    assert run.returncode == 0, run.stderr[-2000:]
    assert "tensors missing" in run.stdout and "blk.2." in run.stdout, run.stdout
    assert not (tmp_path / "m").exists()


def test_bf16_tensors_convert_bit_exactly_whichever_reader_reads_the_file(tmp_path, small):
    """MLX's GGUF reader turns BF16 into float16: 1e10 became inf, 3e-8 5.96e-8, -2.5e38 -inf. A BF16 tensor keeps
    its bits, in a file MLX reads (Q8_0) and in one the gguf package reads (Q5_0): float32 in a "float32" folder;
    bfloat16 in a "quantized" one, since float16, its other unquantized tensors' type, cannot hold these."""
    down = np.random.default_rng(0).standard_normal((128, 256)).astype(np.float32) / 16
    down[0, :3] = [1e10, 3e-8, -2.5e38]  # past float16's range, or below its precision
    data = quants.quantize(down, Q.BF16)
    bits = data.view(np.uint16)
    exact = quants.dequantize(data, Q.BF16).reshape(down.shape)  # the float32 values of those bits
    with np.errstate(over="ignore"):
        assert not np.array_equal(exact[0, :3].astype(np.float16).astype(np.float32), exact[0, :3])
    for qtype in ("Q8_0", "Q5_0"):
        rewrite(small[qtype], tmp_path / f"{qtype}.gguf", tensors={"blk.0.ffn_down.weight": (data, Q.BF16)})
        for weights, dtype in (("float32", mx.float32), ("quantized", mx.bfloat16)):
            out = import_gguf(tmp_path / f"{qtype}.gguf", tmp_path / f"{qtype}-{weights}", weights)
            a = mx.load(str(out / "model.safetensors"))["model.layers.0.mlp.down_proj.weight"]
            assert a.dtype == dtype, (qtype, weights)
            if dtype == mx.float32:
                assert np.array_equal(np.array(a), exact), (qtype, weights)
            else:
                assert np.array_equal(np.array(a.view(mx.uint16)), bits), (qtype, weights)
        model, tok = mlx_lm.load(str(tmp_path / f"{qtype}-quantized"))
        assert model(mx.array([tok.encode("hello")])).shape[-1] == model.args.vocab_size


def test_a_quantized_folder_keeps_a_float_tensor_past_float16s_range_as_it_is(tmp_path, small, caplog):
    """A quantized folder stores its float tensors as float16 (one float type for the model), and made inf of a
    value float16 cannot hold: a BF16 weight of 1e5, an F32 norm of 1e5. Such a tensor keeps its own type there,
    exactly, and mlx-lm runs the model (in float32); a BF16 tensor within float16's range is float16 as before."""
    rng = np.random.default_rng(0)
    down = rng.standard_normal((128, 256)).astype(np.float32) / 16
    down[0, 0] = 1e5
    up = rng.standard_normal((256, 128)).astype(np.float32) / 16
    norm = np.ones(128, np.float32)
    norm[1] = 1e5
    data = {name: quants.quantize(a, Q.BF16) for name, a in (("down", down), ("up", up))}
    exact = {name: quants.dequantize(d, Q.BF16).reshape(d.shape[0], -1) for name, d in data.items()}
    rewrite(small["Q8_0"], tmp_path / "m.gguf", tensors={"blk.0.ffn_down.weight": (data["down"], Q.BF16),
                                                       "blk.0.ffn_up.weight": (data["up"], Q.BF16),
                                                       "blk.0.attn_norm.weight": (norm, Q.F32)})
    out = import_gguf(tmp_path / "m.gguf", tmp_path / "q", "quantized")
    warned = [r.getMessage() for r in caplog.records if "past float16's range" in r.getMessage()]
    assert sorted(w.split()[2] for w in warned) == ["blk.0.attn_norm.weight", "blk.0.ffn_down.weight"], warned
    model, tok = mlx_lm.load(str(out))
    layer = model.model.layers[0]
    for param, dtype, want in ((layer.mlp.down_proj.weight, mx.bfloat16, exact["down"]),
                               (layer.input_layernorm.weight, mx.float32, norm),
                               (layer.mlp.up_proj.weight, mx.float16, exact["up"])):
        assert param.dtype == dtype and np.array_equal(np.array(param.astype(mx.float32)), want), dtype
    logits = model(mx.array([tok.encode("hello")]))
    assert logits.shape[-1] == model.args.vocab_size and mx.all(mx.isfinite(logits)).item()


def q4_k(a):
    """Q4_K blocks (llama.cpp's block_q4_K, 256 values) of the float32 rows of `a`, which the gguf package reads but
    cannot write: each block d * (q - 8), q of 4 bits, as every sub-block's 6-bit scale is 1 and its min 8 (dmin
    = d)."""
    blocks = a.reshape(-1, 256)
    d = (np.abs(blocks).max(axis=1) / 8).astype(np.float16)
    q = np.clip(np.round(blocks / d.astype(np.float32)[:, None]) + 8, 0, 15).astype(np.uint8).reshape(-1, 4, 2, 32)
    out = np.zeros((len(blocks), 144), np.uint8)
    out[:, 0:2] = out[:, 2:4] = d.view(np.uint8).reshape(-1, 2)  # d, dmin
    out[:, 4:16] = [1, 1, 1, 1, 8, 8, 8, 8, 0x81, 0x81, 0x81, 0x81]  # scales and mins, 6 bits each, packed
    out[:, 16:] = (q[:, :, 0] | (q[:, :, 1] << 4)).reshape(-1, 128)  # 64 values a chunk: low nibbles, then high
    return out.reshape(a.shape[0], -1)


def assert_within_quantization_error(layer, source, bits):
    """`layer` (an mlx-lm QuantizedLinear) holds `source` (float32) in `bits` bits: each value finite and within
    1.5 quantization steps (its group's range / (2**bits - 1)) of the source's (MLX's affine grid puts a level on
    0, so it does not round to the nearest of min-to-max levels: its error passes half a step)."""
    got = np.array(mx.dequantize(layer.weight, layer.scales, layer.biases, group_size=32, bits=bits).astype(mx.float32))
    assert layer.bits == bits and np.isfinite(got).all()
    groups = source.reshape(source.shape[0], -1, 32)
    step = (groups.max(axis=-1) - groups.min(axis=-1)) / (2**bits - 1)
    error = np.abs(got - source).reshape(groups.shape).max(axis=-1)
    assert (error <= 1.5 * step + 1e-3).all(), (error / step).max()


def test_a_requantized_tensor_past_float16s_range_stays_finite_and_close(tmp_path, small, caplog):
    """A quantized folder requantizes the tensors of types MLX cannot read (Q4_K to 4 bits, Q5_0 to 8) from their
    dequantization, which it cast to float16 first: a weight of 1e5 became inf, and its group's scales and biases
    inf or nan, so the model's logits were nan. It is quantized from its float32 values, and its scales and biases
    stay float32 where float16 cannot hold them, with a warning; a tensor within float16's range keeps float16 ones."""
    rng = np.random.default_rng(0)
    down = rng.standard_normal((128, 256)).astype(np.float32) / 16
    down[0, 0] = 1e5
    up = rng.standard_normal((256, 128)).astype(np.float32) / 16
    up[3, 5] = -1e5
    data = {"blk.0.ffn_down.weight": (q4_k(down), Q.Q4_K), "blk.0.ffn_up.weight": (quants.quantize(up, Q.Q5_0), Q.Q5_0)}
    source = {name: quants.dequantize(d, t).reshape(d.shape[0], -1) for name, (d, t) in data.items()}
    assert abs(source["blk.0.ffn_down.weight"][0, 0] - 1e5) < 2e4 and source["blk.0.ffn_up.weight"][3, 5] < -9e4
    rewrite(small["Q5_0"], tmp_path / "m.gguf", tensors=data)  # a file MLX cannot read: each tensor requantized
    with caplog.at_level("WARNING", logger="runtime.gguf"):
        out = import_gguf(tmp_path / "m.gguf", tmp_path / "q", "quantized")
    model, tok = mlx_lm.load(str(out))
    layer = model.model.layers[0]
    for param, name, bits in ((layer.mlp.down_proj, "blk.0.ffn_down.weight", 4),
                              (layer.mlp.up_proj, "blk.0.ffn_up.weight", 8)):
        assert_within_quantization_error(param, source[name], bits)
        assert param.scales.dtype == param.biases.dtype == mx.float32, name
    logits = model(mx.array([tok.encode("hello")]))
    assert logits.shape[-1] == model.args.vocab_size and mx.all(mx.isfinite(logits)).item()
    assert layer.self_attn.q_proj.scales.dtype == mx.float16  # within range: the folder's float type
    warned = [r.getMessage() for r in caplog.records if "past float16's range" in r.getMessage()]
    assert sorted(w.split()[2] for w in warned) == sorted(data), warned


def test_tensors_mlx_reads_through_float16_are_read_by_the_gguf_package(tmp_path, small):
    """MLX's GGUF reader, where it reads a file, makes float16 of some of it: Q4_K tensors (and the other types it
    converts rather than maps) whole, rounded, and inf past float16's range (+-65504); and the biases of Q8_0 and
    Q4_0 blocks, -128 and -8 times their scale, inf for a block past that range. Even a float32 folder held inf
    and rounded values. Such tensors are read by the gguf package: a float32 folder holds their exact
    dequantization, a quantized one requantizes them from it, finite and close, and the logits are finite."""
    rng = np.random.default_rng(0)

    def weight(rows, cols, big):
        a = rng.standard_normal((rows, cols)).astype(np.float32) / 16
        a[1, 2] = big
        return a

    cases = {  # gguf name: (mlx-lm layer path, data, type, bits requantized to)
        "blk.0.ffn_down.weight": ("layers.0.mlp.down_proj", q4_k(weight(128, 256, 1e5)), Q.Q4_K, 4),
        "blk.1.ffn_down.weight": ("layers.1.mlp.down_proj", q4_k(weight(128, 256, 0.5)), Q.Q4_K, 4),  # in range
        "blk.0.ffn_up.weight": ("layers.0.mlp.up_proj", quants.quantize(weight(256, 128, -1e5), Q.Q8_0), Q.Q8_0, 8),
        "blk.0.attn_v.weight": ("layers.0.self_attn.v_proj", quants.quantize(weight(128, 128, 1e5), Q.Q4_0), Q.Q4_0,
                                4),
    }
    source = {name: quants.dequantize(d, t).reshape(d.shape[0], -1) for name, (_, d, t, _) in cases.items()}
    rewrite(small["Q8_0"], tmp_path / "m.gguf", tensors={name: (d, t) for name, (_, d, t, _) in cases.items()})
    exact = folder_weights(import_gguf(tmp_path / "m.gguf", tmp_path / "f32", "float32"))
    for name, (path, *_) in cases.items():
        assert np.array_equal(exact[f"model.{path}.weight"], source[name]), name
    model, tok = mlx_lm.load(str(tmp_path / "f32"))
    assert mx.all(mx.isfinite(model(mx.array([tok.encode("hello")])))).item()
    model, tok = mlx_lm.load(str(import_gguf(tmp_path / "m.gguf", tmp_path / "q", "quantized")))
    layers = dict(tree_flatten(model.model.leaf_modules(), is_leaf=lambda m: isinstance(m, nn.Module)))
    for name, (path, _, _, bits) in cases.items():
        assert_within_quantization_error(layers[path], source[name], bits)
    logits = model(mx.array([tok.encode("hello")]))
    assert logits.shape[-1] == model.args.vocab_size and mx.all(mx.isfinite(logits)).item()


def float_types(folder):
    """The names of the float types of the arrays in `folder`'s model.safetensors."""
    return {str(a.dtype).removeprefix("mlx.core.") for a in mx.load(str(folder / "model.safetensors")).values()
            if mx.issubdtype(a.dtype, mx.floating)}


def test_config_names_the_type_the_float_weights_are_stored_in(tmp_path, small):
    """config.json said torch_dtype float16 for every quantized folder, also for one that keeps a tensor past
    float16's range as bfloat16 (or float32), and mlx-lm's convert casts a model's float weights to that type by
    default, making inf of that tensor. It names the folder's one float type, or float32, which holds each of
    several exactly (and which MLX computes such a model in)."""
    from mlx_lm.convert import convert

    for weights, dtype in (("float32", "float32"), ("quantized", "float16")):
        out = import_gguf(small["Q8_0"], tmp_path / weights, weights)
        assert float_types(out) == {dtype} and json.loads((out / "config.json").read_text())["torch_dtype"] == dtype
    down = np.random.default_rng(0).standard_normal((128, 256)).astype(np.float32) / 16
    down[0, 0] = 1e5
    data = quants.quantize(down, Q.BF16)
    rewrite(small["Q8_0"], tmp_path / "m.gguf", tensors={"blk.0.ffn_down.weight": (data, Q.BF16)})
    out = import_gguf(tmp_path / "m.gguf", tmp_path / "mixed", "quantized")
    assert float_types(out) == {"float16", "bfloat16"}
    assert json.loads((out / "config.json").read_text())["torch_dtype"] == "float32"
    convert(str(out), str(tmp_path / "converted"))  # the float weights cast to torch_dtype
    model, tok = mlx_lm.load(str(tmp_path / "converted"))
    assert model.model.layers[0].mlp.down_proj.weight[0, 0].item() == quants.dequantize(data[:1], Q.BF16)[0, 0]
    assert mx.all(mx.isfinite(model(mx.array([tok.encode("hello")])))).item()


@pytest.mark.parametrize("key", ["eos", "eot", "eom", "bos", "unknown"])
def test_a_special_token_id_outside_the_vocabulary_is_refused_at_import_by_its_metadata_key(tmp_path, small, key):
    """Copied into config.json unchecked, an eos, eot or eom id past the vocabulary made a folder that load_model then
    refused, naming the folder's config.json rather than the file's metadata; a bos or unknown id past it was
    silently dropped from the tokenizer's config."""
    rows = int(gguf.GGUFReader(str(small["Q8_0"])).fields["llama.vocab_size"].contents())
    name = f"tokenizer.ggml.{key}_token_id"
    rewrite(small["Q8_0"], tmp_path / "bad.gguf", meta={name: (rows, V.UINT32)})
    with pytest.raises(GGUFError, match=rf"metadata {name} is {rows}, .*vocabulary has {rows} token ids") as e:
        import_gguf(tmp_path / "bad.gguf", tmp_path / "bad", "float32")
    assert "config.json" not in str(e.value) and "convert the model again" in str(e.value)
    assert not (tmp_path / "bad").exists()
    rewrite(small["Q8_0"], tmp_path / "last.gguf", meta={name: (rows - 1, V.UINT32)})  # the last id is a token
    load_model(import_gguf(tmp_path / "last.gguf", tmp_path / "last", "float32"))


def test_an_out_of_range_padding_id_is_dropped_with_a_warning_not_refused(tmp_path, small, caplog):
    """A padding id past the vocabulary was copied into config.json. Nothing feeds or waits on a pad id, released
    models name such ids, and llama.cpp itself ignores an out-of-range special id with a warning: the import leaves
    it out of the folder, says so, and converts the model."""
    rows = int(gguf.GGUFReader(str(small["Q8_0"])).fields["llama.vocab_size"].contents())
    name = "tokenizer.ggml.padding_token_id"
    rewrite(small["Q8_0"], tmp_path / "pad.gguf", meta={name: (rows, V.UINT32)})
    with caplog.at_level("WARNING", logger="runtime.gguf"):
        out = import_gguf(tmp_path / "pad.gguf", tmp_path / "pad", "float32")
    assert f"{name} is {rows}" in caplog.text and f"{rows} token ids" in caplog.text, caplog.text
    assert "pad_token_id" not in json.loads((out / "config.json").read_text())
    assert "pad_token" not in json.loads((out / "tokenizer_config.json").read_text())
    load_model(out)
    rewrite(small["Q8_0"], tmp_path / "last.gguf", meta={name: (rows - 1, V.UINT32)})  # the last id is a token: kept
    out = import_gguf(tmp_path / "last.gguf", tmp_path / "last", "float32")
    assert json.loads((out / "config.json").read_text())["pad_token_id"] == rows - 1
    assert "pad_token" in json.loads((out / "tokenizer_config.json").read_text())


def test_a_tokenizer_with_more_tokens_than_embedding_rows_is_refused_and_a_shorter_one_converts(tmp_path, small):
    """A token list longer than the embedding converted silently: the tokenizer then gave ids past the embedding's
    rows. An embedding with more rows than tokens (a vocabulary padded to a multiple of 64) is a real model's and
    converts: the model's extra ids are ones it never produces."""
    r = gguf.GGUFReader(str(small["Q8_0"]))
    tokens, types = r.fields["tokenizer.ggml.tokens"].contents(), r.fields["tokenizer.ggml.token_type"].contents()
    rows = int(r.fields["llama.vocab_size"].contents())
    assert len(tokens) == rows
    longer = {"tokenizer.ggml.tokens": (tokens + ["[EXTRA0]", "[EXTRA1]"], V.ARRAY, V.STRING),
              "tokenizer.ggml.token_type": (types + [1, 1], V.ARRAY, V.INT32)}
    for qtype in ("Q8_0", "Q5_0"):
        rewrite(small[qtype], tmp_path / "long.gguf", meta=longer)
        with pytest.raises(GGUFError, match=rf"{rows + 2} tokens .*{rows} rows") as e:
            import_gguf(tmp_path / "long.gguf", tmp_path / "long", "float32")
        assert "convert the model again" in str(e.value) and "tokenizer.ggml.tokens" in str(e.value)
        assert not (tmp_path / "long").exists()
    embd = next(t for t in r.tensors if t.name == "token_embd.weight")
    table = quants.dequantize(embd.data, embd.tensor_type).reshape(rows, -1)
    padded = np.concatenate([table, np.zeros((64, table.shape[1]), np.float32)])
    rewrite(small["Q8_0"], tmp_path / "padded.gguf", meta={"llama.vocab_size": (rows + 64, V.UINT32)},
            tensors={"token_embd.weight": (padded, Q.F32)})
    out = import_gguf(tmp_path / "padded.gguf", tmp_path / "padded", "float32")
    assert json.loads((out / "config.json").read_text())["vocab_size"] == rows + 64
    model, tok, _ = load_model(out)
    assert len(tok._tokenizer) == rows
    assert model(mx.array([tok.encode("hello")])).shape[-1] == rows + 64


def test_a_token_type_list_of_another_length_than_the_tokens_is_refused(tmp_path, small):
    """tokenizer.ggml.token_type says each token's kind (control, user-defined...); a list of another length was
    zipped with the tokens and cut short, so tokens past it silently lost their kind (a control token became a
    plain one the tokenizer would split)."""
    r = gguf.GGUFReader(str(small["Q8_0"]))
    tokens, types = r.fields["tokenizer.ggml.tokens"].contents(), r.fields["tokenizer.ggml.token_type"].contents()
    for wrong in (types[:-3], types + [1]):
        rewrite(small["Q8_0"], tmp_path / "t.gguf", meta={"tokenizer.ggml.token_type": (wrong, V.ARRAY, V.INT32)})
        with pytest.raises(GGUFError, match=rf"{len(wrong)} entries .*{len(tokens)} tokens") as e:
            import_gguf(tmp_path / "t.gguf", tmp_path / "t", "float32")
        assert "convert the model again" in str(e.value)
        assert not (tmp_path / "t").exists()


def test_an_f64_tensor_is_refused_as_a_64_bit_float_tensor(tmp_path, small):
    """F64 was refused as a "quantization type" neither MLX nor the gguf package can read."""
    down = np.zeros((128, 256), dtype=np.float64)
    for qtype in ("Q8_0", "Q5_0"):
        rewrite(small[qtype], tmp_path / "m.gguf", tensors={"blk.0.ffn_down.weight": (down, Q.F64)})
        with pytest.raises(UnsupportedGGUF, match=r"tensor blk\.0\.ffn_down\.weight is a 64-bit float tensor") as e:
            import_gguf(tmp_path / "m.gguf", tmp_path / "m", "float32")
        assert "quantization type" not in str(e.value) and "convert the model again" in str(e.value)
        assert not (tmp_path / "m").exists()


PEAK = """
import sys
import mlx.core as mx
from runtime.gguf import import_gguf

mx.reset_peak_memory()
import_gguf(sys.argv[1], sys.argv[2], "quantized")
print(mx.get_peak_memory())
"""


def test_a_file_the_gguf_package_dequantizes_converts_a_tensor_at_a_time(tmp_path, tiny_model_path):
    """A file of a type MLX cannot read (K-quants, Q5_0...) is dequantized to float32 by the gguf package and
    requantized: a tensor at a time, so that a quantized folder's conversion never holds every float32 value at
    once (an 8B model's are 32 GB). Here the model's float32 values are ~115 MB; MLX's peak memory in the
    conversion stays under half of that (the 8-bit result is about a third)."""
    import subprocess

    folder = tiny_model_path("llama", hidden_size=640, intermediate_size=1536, num_hidden_layers=8)
    stored = write_gguf(tmp_path / "m.gguf", folder, Q.Q5_0)
    total = sum(a.size * 4 for a in stored.values())
    assert total > 100e6
    done = subprocess.run([sys.executable, "-c", PEAK, str(tmp_path / "m.gguf"), str(tmp_path / "q")],
                          capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stderr[-2000:]
    assert int(done.stdout.split()[-1]) < total / 2, (int(done.stdout.split()[-1]) / 1e6, total / 1e6)


CUT_SINCE_READ = """
import sys
from pathlib import Path
from runtime import gguf

path = Path(sys.argv[1])
meta, tensors = gguf._read(path)
later = [value for kind, value, _, _ in tensors.values() if kind == "dequant"]
with open(path, "r+b") as f:
    f.truncate(path.stat().st_size // 2)  # cut short after it was read, before its tensors are converted
try:
    for tensor in later:
        tensor.load()
except gguf.GGUFError as e:
    print("GGUFError:", e)
"""


def test_a_file_cut_short_while_its_tensors_are_converted_is_a_clear_error_not_a_crash(tmp_path, small):
    """A tensor the gguf package dequantizes is read when its turn comes (one at a time: the conversion's peak);
    a file cut short since it was opened (rewritten, a download restarted) is then a GGUFError that says so.
    Read through the reader's memory map instead, a page past the file's new end kills the process (SIGBUS)."""
    path = tmp_path / "Q5_0.gguf"
    shutil.copy(small["Q5_0"], path)
    script = tmp_path / "cut.py"
    script.write_text(CUT_SINCE_READ)
    done = subprocess.run([sys.executable, str(script), str(path)], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, (done.returncode, done.stderr[-2000:])
    assert done.stdout.startswith("GGUFError:") and "the file ends within its data" in done.stdout, done.stdout
