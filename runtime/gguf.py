"""Importing GGUF files (llama.cpp's format) as mlx-lm model folders.

`import_gguf(file, out)` writes a folder that the real `mlx_lm.load` reads:
config.json, model.safetensors, tokenizer.json, tokenizer_config.json and
chat_template.jinja. `gguf_model_path(file)` does it once per file into the
model cache (`$KVACTORS_HOME/models/gguf-<sha256 of the file>-<weights>-c<CONVERSION>`) and
reuses the folder afterwards; `load_model` calls it for any `.gguf` path.

Weights. Q4_0, Q4_1 and Q8_0 tensors are MLX affine triplets (4 or 8 bits,
group 32, along the input dimension) exactly, so `mx.load` reads them without
loss (but for a Q4_0 or Q8_0 block past float16's range, whose bias MLX makes
inf). Other quantization types, and those blocks' tensors, are dequantized with
the `gguf` package, never through the float16 `mx.load` makes of some of them
(and requantized by MLX where the folder keeps quantized weights); types neither
can read are refused with `UnsupportedGGUF` naming the type. The folder stores
either `"float32"` weights (every tensor exactly dequantized: fastest on MLX's
CPU build, where quantized matmuls with 16-bit activations are very slow) or
`"quantized"` ones (the file's own 4/8-bit triplets, other quantized types
requantized from their float32 values, float16 elsewhere but for a tensor past
float16's range, which keeps its own type, or float32 scales and biases where
requantized: four to eight times smaller, for GPUs). `default_weights()` picks
by device. BF16 tensors are read from their own bits, never through `mx.load`,
which makes float16 of them: exact in a float32 folder. config.json's
torch_dtype names the type the float weights are stored in (float32 where a
quantized folder keeps some past float16's range: `_torch_dtype`).

llama.cpp's converter permutes the rows of llama's `attn_q` and `attn_k` (its
rope layout); the import undoes that by whole rows of weights, scales and biases.
Architectures: llama and qwen2. Tokenizers: byte-level BPE (`gpt2`) with the
pre-tokenizers of SmolLM (digits split one by one), GPT-2, Qwen2 and Llama-3.

What the import trusts: nothing. MLX's own GGUF parser believes the header's counts,
lengths and types (a damaged one crashes the process), so the gguf package's reader
parses and checks the file first (`_open`); the metadata read must be of the kind
`_METADATA` says; the tensors must be exactly the weights, by name and shape, of the
mlx-lm model the metadata describes; the tokenizer may not have more tokens than the
token embedding has rows (fewer is a padded embedding, and converts); its start, end
and unknown token ids must be tokens of the model's vocabulary (a padding id outside
it is left out, with a warning). Anything else raises GGUFError (or
UnsupportedGGUF) before anything is written.

Which error. GGUFError is a file that is not GGUF, is damaged or contradicts
itself; UnsupportedGGUF (a GGUFError) is a well-formed file of a kind this import
does not convert. A number in a field the format enumerates that this reader does
not know is read as a format it does not know, not as damage: a GGUF version
other than 2 and 3, and a tensor type id the gguf package does not define (one
past the last it knows, which a newer llama.cpp or a fork of it writes, or one
llama.cpp has removed) raise UnsupportedGGUF naming it. So do the types the
package defines but neither it nor MLX turns into floats (Q8_1, Q8_K, ...), the
integer types (I8 to I64), which hold no weights, and 64-bit float tensors (F64),
which no folder this import writes holds exactly.
"""

from __future__ import annotations

import functools
import hashlib
import json
import logging
import math
import re
import stat
import sys
import time
from pathlib import Path

from runtime.errors import shown
from runtime.model import (COMPLETE_MARKER, ModelLoadError, build_once, in_vocabulary, kvactors_home, new_model_folder,
                           refuse_existing)

log = logging.getLogger(__name__)

__all__ = [
    "GGUFError",
    "UnsupportedGGUF",
    "WEIGHTS",
    "default_weights",
    "file_digest",
    "gguf_model_path",
    "import_gguf",
]

WEIGHTS = ("float32", "quantized")
ARCHS = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM"}
GROUP = 32  # GGUF's block size for Q4_0 / Q4_1 / Q8_0
CONVERSION = 2  # in the model cache's folder names: raised when a conversion's output changes, so that folders an
# earlier rule converted are converted again, not reused (2: nothing through float16 that it rounds or overflows)

# Names of llama.cpp tensors (before ".weight" / ".bias") as mlx-lm names them.
_GLOBAL_NAMES = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}
_LAYER_NAMES = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}

# Pre-tokenizer regexes (the split before byte-level BPE), by `tokenizer.ggml.pre`.
_QWEN2_REGEX = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_LLAMA3_REGEX = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)
PRE_TOKENIZERS = ("smollm", "gpt-2", "default", "qwen2", "llama-bpe")

_CONTROL, _USER_DEFINED = 3, 4  # llama.cpp token types
_FLOAT_TYPES = ("F32", "F16", "BF16")
_INTEGER_TYPES = ("I8", "I16", "I32", "I64")  # GGUF's integer tensors: no weights; MLX reads them as integers
_VERSIONS = (2, 3)  # GGUF versions whose layout this import reads (1 had 32-bit counts)
_MAX_DIMS = 4  # GGML_MAX_DIMS

# The metadata this import reads, and the kind each must be where present ("{arch}": the file's architecture).
_METADATA = {
    "general.architecture": "text",
    **{f"{{arch}}.{key}": "count" for key in (
        "embedding_length", "feed_forward_length", "block_count", "attention.head_count", "attention.head_count_kv",
        "attention.key_length", "rope.dimension_count", "vocab_size", "context_length")},
    **{f"{{arch}}.{key}": "number" for key in ("attention.layer_norm_rms_epsilon", "rope.freq_base",
                                                "rope.scaling.factor")},
    "{arch}.rope.scaling.type": "text",
    "tokenizer.ggml.model": "text",
    "tokenizer.ggml.pre": "text",
    "tokenizer.ggml.tokens": "texts",
    "tokenizer.ggml.token_type": "integers",
    "tokenizer.ggml.merges": "texts",
    **{f"tokenizer.ggml.{key}_token_id": "index" for key in ("bos", "eos", "eot", "eom", "padding", "unknown")},
    "tokenizer.ggml.add_bos_token": "flag",
    "tokenizer.chat_template": "text",
}


def _integer(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


_KINDS = {  # kind: (as a message says it, its test)
    "text": ("text", lambda v: isinstance(v, str)),
    "count": ("an integer > 0", lambda v: _integer(v) and v > 0),
    "index": ("an integer >= 0", lambda v: _integer(v) and v >= 0),
    "number": ("a finite number", lambda v: (_integer(v) or isinstance(v, float)) and math.isfinite(v)),
    "flag": ("true or false", lambda v: isinstance(v, bool)),
    "texts": ("a list of texts", lambda v: isinstance(v, list) and all(isinstance(x, str) for x in v)),
    "integers": ("a list of integers", lambda v: isinstance(v, list) and all(_integer(x) for x in v)),
}


class GGUFError(ModelLoadError):
    """A GGUF file could not be read or converted: it is not GGUF, is damaged or contradicts itself, or the
    converted folder cannot be written."""


class UnsupportedGGUF(GGUFError):
    """A well-formed GGUF file of a kind the import does not convert: its GGUF version, architecture, tensors,
    tensor types (one the gguf package does not define included) or tokenizer."""


def default_weights() -> str:
    """The weights a converted folder stores on this machine: "float32" on CPU, "quantized" on a GPU."""
    import mlx.core as mx

    return "quantized" if mx.default_device() == mx.gpu else "float32"


def file_digest(path: str | Path) -> str:
    """The SHA-256 hex digest of the file at `path` (read in 8 MiB chunks)."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 23):
            h.update(chunk)
    return h.hexdigest()


def gguf_model_path(path: str | Path, weights: str | None = None, progress=None) -> Path:
    """The mlx-lm folder converted from the GGUF file at `path`, converting it on first use (`progress`, if given,
    called as `progress(done, total)` after each of its tensors is converted).

    The folder is `$KVACTORS_HOME/models/gguf-<first 16 hex of the file's SHA-256>-<weights>-c<CONVERSION>`
    (`weights`: "float32" or "quantized"; None: `default_weights()`), so a changed
    file gets a new folder and an unchanged one is converted once, and again when the
    conversion's rules change (`CONVERSION`; the older folder is left as it was, and a
    warning at the new conversion names it, to delete). Concurrent
    first use is safe (the loser of the rename uses the winner's folder). Raises
    GGUFError / UnsupportedGGUF as `import_gguf` does.
    """
    path = Path(path).expanduser()
    _check_file(path)
    weights = _check_weights(weights)
    try:
        digest = file_digest(path)
    except OSError as e:
        raise _cannot_read(path, e) from e
    out = kvactors_home() / "models" / f"gguf-{digest[:16]}-{weights}-c{CONVERSION}"
    fresh = not out.exists()
    try:
        built = build_once(out, functools.partial(_convert, path, weights, progress=progress))  # one at a time
    except OSError as e:
        raise _cannot_write(out, e) from e
    if fresh:
        _say_superseded(out)
    return built


def stderr_progress(name: str, every_s: float = 2.0):
    """A `progress(done, total)` for the conversion of GGUF file `name` that says on standard error how far it is
    ("kvactors: converting NAME: done/total tensors"): at its first tensor, then at most every `every_s` seconds,
    and at its last; nowhere where standard error is closed (print would write to standard output), and a line it
    cannot write (a broken pipe, a full disk) is left unsaid rather than fail the conversion."""
    said = [-math.inf]

    def progress(done: int, total: int) -> None:
        now = time.monotonic()
        if sys.stderr is None or not (done == total or now - said[0] >= every_s):
            return
        said[0] = now
        try:
            print(f"kvactors: converting {name}: {done}/{total} tensors", file=sys.stderr, flush=True)
        except (OSError, ValueError):  # a broken pipe, a full or closed stream: the conversion goes on unsaid
            pass

    return progress


def _say_superseded(out: Path) -> None:
    """Warn, once a model cache folder `out` (`...-c<CONVERSION>`) was converted, of the folders of the same file and
    weights an earlier conversion rule made beside it: no longer used, left for the user to delete (another
    process of an older version may still read one)."""
    stem = out.name.removesuffix(f"-c{CONVERSION}")
    for old in [out.with_name(stem)] + [out.with_name(f"{stem}-c{k}") for k in range(2, CONVERSION)]:
        if old.is_dir():
            log.warning("%s was converted by an earlier version's rules and is no longer used; %s replaces it. "
                        "Delete it to free its space (rm -r %s) once no older kvactors runs on it", old, out.name, old)


def import_gguf(path: str | Path, out: str | Path, weights: str | None = None, progress=None) -> Path:
    """Convert the GGUF file at `path` into a new mlx-lm model folder `out`; return `out`. `progress`, if given, is
    called as `progress(done, total)` after each of the file's tensors is converted.

    `weights` is "float32" (exactly dequantized) or "quantized" (the file's 4/8-bit
    triplets kept as they are, other quantized tensors requantized from their
    float32 values, other tensors float16 but for one past float16's range, which
    keeps its own type, exactly); None
    picks `default_weights()`. The folder is built in a temporary sibling and
    renamed into place, under the lock of `model.build_once` (reuse=False), so
    `out` either does not exist or is complete, even after a SIGKILL, and the
    next import into `out` removes what a killed one left; of two imports into
    one `out` at once, one converts and the other, once it has waited for it,
    refuses the folder without reading the file.
    Raises FileExistsError if `out` exists (never touched, whatever it holds),
    UnsupportedGGUF for an
    architecture, tensor, quantization type or tokenizer this import cannot map,
    and GGUFError for a file that is not GGUF, is damaged, contradicts itself (a
    tokenizer with more tokens than the embedding has rows; a start, end or unknown
    token id outside its vocabulary, named by its metadata key) or cannot be read,
    and for an `out` that cannot be written. A padding token id outside the
    vocabulary is left out of the folder, with a warning.
    """
    path, out = Path(path).expanduser(), Path(out).expanduser()
    weights = _check_weights(weights)
    refuse_existing(out)  # before reading the file; `build_once` checks again, under the lock
    _check_head(path)  # a file that is missing, unreadable or no GGUF is said at once, not after a wait for the lock
    try:  # read and converted under the lock: an import waiting for another into `out` never converts for nothing
        return build_once(out, functools.partial(_convert, path, weights, progress=progress), reuse=False)
    except FileExistsError:
        raise
    except OSError as e:  # the lock beside `out`
        raise _cannot_write(out, e) from e


def _convert(path: Path, weights: str, out: Path, progress=None) -> None:
    """Read, check and convert the GGUF file at `path` (as `import_gguf`, `progress` too) into the model folder
    `out`, written through `new_model_folder`."""
    meta, tensors = _read(path)
    _check_metadata(meta, path)
    arch = meta.get("general.architecture")
    if arch not in ARCHS:
        raise UnsupportedGGUF(f"{path}: architecture {arch!r} is not supported; supported: {', '.join(ARCHS)}")
    config = _config(meta, arch, path)
    config["tie_word_embeddings"] = "output.weight" not in tensors
    tokenizer_json, tokenizer_config, template = _tokenizer(meta, path)
    _check_tensors(tensors, config, path)
    _check_token_ids(meta, config, path)
    mlx_weights, quantization = _mlx_weights(tensors, config, arch, weights, progress)
    if quantization:
        config["quantization"] = quantization
    config["torch_dtype"] = _torch_dtype(mlx_weights)

    import mlx.core as mx

    try:
        with new_model_folder(out) as tmp:
            (tmp / "config.json").write_text(json.dumps(config, indent=2))
            mx.save_safetensors(str(tmp / "model.safetensors"), mlx_weights, {"format": "mlx"})
            (tmp / "tokenizer.json").write_text(tokenizer_json)
            (tmp / "tokenizer_config.json").write_text(json.dumps(tokenizer_config, indent=2))
            if template:
                (tmp / "chat_template.jinja").write_text(template)
            marker = {"source": str(path), "name": meta.get("general.name"), "weights": weights}
            (tmp / COMPLETE_MARKER).write_text(json.dumps(marker))
    except OSError as e:
        if isinstance(e, FileExistsError) and out.exists():
            raise  # another process made `out` meanwhile
        raise _cannot_write(out, e) from e
    except RuntimeError as e:  # MLX reports a failed write (a full disk) as a RuntimeError
        raise _cannot_write(out, e) from e


def _check_file(path: Path) -> None:
    """Raise GGUFError unless `path` is a regular file (a pipe would block its reader forever)."""
    try:
        mode = path.stat().st_mode
    except (FileNotFoundError, NotADirectoryError):
        raise GGUFError(f"{path}: no such GGUF file") from None
    except OSError as e:
        raise _cannot_read(path, e) from e
    if stat.S_ISDIR(mode):
        raise GGUFError(f"{path} is a folder, not a GGUF file: give the .gguf file itself")
    if not stat.S_ISREG(mode):
        raise GGUFError(f"{path} is not a regular file (a pipe or a device?): save the GGUF file to disk and give that")


def _cannot_read(path: Path, e: OSError) -> GGUFError:
    return GGUFError(f"cannot read {path}: {e.strerror or e}; check that it is a file you may read")


def _cannot_write(out: Path, e: Exception) -> GGUFError:
    reason = (e.strerror or str(e)) if isinstance(e, OSError) else str(e)
    return GGUFError(f"cannot write the converted model {out}: {reason}; free some space there or convert into a "
                     "folder you may write (import-gguf's OUT, or $KVACTORS_HOME for the model cache)")


def _check_metadata(meta: dict, path: Path) -> None:
    """Raise GGUFError for metadata this import reads (`_METADATA`) of the wrong kind, or no vocabulary."""
    arch = meta.get("general.architecture")
    for key, kind in _METADATA.items():
        key = key.format(arch=arch)
        what, test = _KINDS[kind]
        if key in meta and not test(value := meta[key]):
            seen = f"a list of {len(value)} items" if isinstance(value, list) else shown(value)[:80]
            raise GGUFError(f"{path}: metadata {key} is {seen}, not {what}: the file is damaged or was not made by "
                            "llama.cpp's converter; get the file again or convert the model again")
    if "tokenizer.ggml.tokens" not in meta:
        raise GGUFError(f"{path}: the file has no vocabulary (metadata tokenizer.ggml.tokens); convert the model "
                        "again with llama.cpp's converter, which writes it")


def _check_tensors(tensors: dict, config: dict, path: Path) -> None:
    """Raise GGUFError unless `tensors` are exactly the weights, by name and shape, of the mlx-lm model `config`
    describes: any other set would make a folder that mlx-lm refuses on every load."""
    import importlib

    from mlx.utils import tree_flatten

    module = importlib.import_module(f"mlx_lm.models.{config['model_type']}")
    damaged = "the file is damaged or its metadata wrong; get the file again or convert the model again"
    # the layers are counted before a model of that many is built: a damaged count (say 10**8) hung the build
    blocks = config["num_hidden_layers"]
    present = {int(p[1]) for p in (n.split(".") for n in tensors) if p[0] == "blk" and p[1].isdigit()}
    if lacking := blocks - sum(1 for i in present if i < blocks):
        first = next(i for i in range(blocks) if i not in present)
        raise GGUFError(f"{path}: tensors missing for the model its metadata describes ({blocks} layers): those of "
                        f"{lacking} layers, the first blk.{first}.*; {damaged}")
    try:
        model = module.Model(module.ModelArgs.from_dict(config))
    except Exception as e:  # noqa: BLE001 - sizes the model's code refuses
        raise GGUFError(f"{path}: its metadata describes no model mlx-lm can build ({type(e).__name__}: {e}); "
                        f"{damaged}") from e
    expected = {name: tuple(a.shape) for name, a in tree_flatten(model.parameters())}
    found = set()
    for gguf_name, (kind, value, bits, _) in tensors.items():
        name = _mlx_name(gguf_name)
        found.add(name)
        if kind == "quant":
            shape = (*value[0].shape[:-1], value[0].shape[-1] * 32 // bits)
        else:
            shape = tuple(value.shape)
        if name not in expected:
            raise GGUFError(f"{path}: tensor {gguf_name} is not a weight of the model its metadata describes "
                            f"({config['num_hidden_layers']} layers); {damaged}")
        if shape != expected[name]:
            raise GGUFError(f"{path}: tensor {gguf_name} has shape {shape}, where the model its metadata describes "
                            f"needs {expected[name]}; {damaged}")
    if missing := sorted(expected.keys() - found):
        more = f" and {len(missing) - 3} more" if len(missing) > 3 else ""
        raise GGUFError(f"{path}: tensors missing for the model its metadata describes: "
                        f"{', '.join(_gguf_name(n) for n in missing[:3])}{more}; {damaged}")


def _check_token_ids(meta: dict, config: dict, path: Path) -> None:
    """Raise GGUFError where the file's tokenizer and model disagree on the vocabulary, or where one of its special
    token ids is not a token of that vocabulary; drop an out-of-range padding id from `config`, with a warning.

    The vocabulary. The tokenizer built from tokenizer.ggml.tokens gives ids 0 to tokens - 1; the model embeds
    and scores ids 0 to rows - 1, rows being config's vocab_size ({arch}.vocab_size, else the token count), which
    `_check_tensors` has matched to token_embd (and output). More tokens than rows is refused, naming both counts:
    the tokenizer would give ids the model has no row for. Fewer is allowed: released models pad their embedding
    (to a multiple of 64 or 128) past their tokenizer, as mlx-lm and llama.cpp's older loaders take them (its
    converter pads the token list instead, so its files have the two equal); the model never produces those ids
    and the tokenizer decodes none. The ids the tokenizer names are therefore the vocabulary.

    The token kinds (tokenizer.ggml.token_type), where given, are one per token; another count is refused.

    The special ids (`in_vocabulary`, the rule `check_token_ids` applies at load). An end token (eos, eot, eom)
    outside the vocabulary would make a folder that `load_model` refuses, a start token (bos) would be left out
    of every prompt and an unknown token (unk) out of the tokenizer: each is refused, naming its metadata key, the
    id and the vocabulary's size. A padding id outside it is dropped instead: nothing feeds or waits on a pad id,
    released models carry out-of-range ones (one past the embedding, or -1 in config.json), and llama.cpp itself
    ignores any out-of-range special id with a warning ("bad special token") and loads the model; refusing would
    turn away a model that runs. `_tokenizer` names only in-vocabulary tokens, so the tokenizer's config has no
    pad_token then either."""
    tokens, rows = len(meta["tokenizer.ggml.tokens"]), config["vocab_size"]
    types = meta.get("tokenizer.ggml.token_type")
    if types is not None and len(types) != tokens:
        raise GGUFError(f"{path}: metadata tokenizer.ggml.token_type has {len(types)} entries for {tokens} tokens "
                        "(tokenizer.ggml.tokens): each token's kind (control, user-defined...) would be lost or "
                        "misplaced; get the file again or convert the model again with llama.cpp's converter")
    if tokens > rows:
        raise GGUFError(f"{path}: its tokenizer has {tokens} tokens (metadata tokenizer.ggml.tokens) but the model's "
                        f"token embedding (token_embd.weight) only {rows} rows, so ids {rows} to {tokens - 1} would "
                        "be fed to the model with no embedding: the file is damaged or its vocabulary or weights "
                        "were edited; get the file again or convert the model again with llama.cpp's converter, "
                        "which writes a token for every embedding row")
    keys = (("bos", "start"), ("eos", "end"), ("eot", "end-of-turn"), ("eom", "end-of-message"),
            ("unknown", "unknown"), ("padding", "padding"))
    for key, what in keys:
        name = f"tokenizer.ggml.{key}_token_id"
        if name not in meta or in_vocabulary(meta[name], tokens):
            continue
        said = (f"metadata {name} is {meta[name]}, which is not a token of this model: its vocabulary has {tokens} "
                f"token ids (0 to {tokens - 1})")
        if key == "padding":
            log.warning("%s: %s; converting it without a padding token (nothing feeds or waits on one)", path, said)
            config.pop("pad_token_id", None)
            continue
        raise GGUFError(f"{path}: {said}; set the key to the id of the model's {what} token (the gguf package's "
                        f"`gguf-set-metadata FILE {name} ID` edits the file in place), or convert the model again "
                        "with llama.cpp's converter")


def _check_weights(weights: str | None) -> str:
    weights = weights or default_weights()
    if weights not in WEIGHTS:
        raise ValueError(f"weights must be one of {', '.join(WEIGHTS)}, not {weights!r}")
    return weights


def _config(meta: dict, arch: str, path: Path) -> dict:
    """An mlx-lm config.json dict from the GGUF metadata of an `arch` model (checked by `_check_metadata`)."""

    def get(key, default=None):
        value = meta.get(f"{arch}.{key}", default)
        if value is None:
            raise GGUFError(f"{path}: its metadata lacks {arch}.{key}; convert the model again with llama.cpp's "
                            "converter, which writes it")
        return value

    hidden, heads = int(get("embedding_length")), int(get("attention.head_count"))
    head_dim = int(meta.get(f"{arch}.attention.key_length", hidden // heads))
    if int(meta.get(f"{arch}.rope.dimension_count", head_dim)) != head_dim:
        raise UnsupportedGGUF(f"partial rotary embeddings ({arch}.rope.dimension_count) are not supported")
    tokens = meta.get("tokenizer.ggml.tokens") or []
    config = {
        "model_type": arch,
        "architectures": [ARCHS[arch]],
        "hidden_size": hidden,
        "intermediate_size": int(get("feed_forward_length")),
        "num_hidden_layers": int(get("block_count")),
        "num_attention_heads": heads,
        "num_key_value_heads": int(get("attention.head_count_kv", heads)),
        "head_dim": head_dim,
        "rms_norm_eps": _f32(get("attention.layer_norm_rms_epsilon")),
        "rope_theta": _f32(get("rope.freq_base", 10000.0)),
        "vocab_size": int(meta.get(f"{arch}.vocab_size", len(tokens))),
        "max_position_embeddings": int(get("context_length", 4096)),
    }
    scaling = meta.get(f"{arch}.rope.scaling.type", "none")
    if scaling == "linear":
        config["rope_scaling"] = {"type": "linear", "factor": float(get("rope.scaling.factor"))}
    elif scaling != "none":
        raise UnsupportedGGUF(f"rope scaling {scaling!r} is not supported (only linear)")
    for key in ("bos", "padding"):
        if (i := meta.get(f"tokenizer.ggml.{key}_token_id")) is not None:
            config[("pad" if key == "padding" else key) + "_token_id"] = int(i)
    ends = [int(i) for key in ("eos", "eot", "eom") if (i := meta.get(f"tokenizer.ggml.{key}_token_id")) is not None]
    if ends:  # generation stops on any of them
        config["eos_token_id"] = ends[0] if len(set(ends)) == 1 else sorted(set(ends), key=ends.index)
    return config


def _f32(x) -> float:
    """A float32 metadata value as the shortest decimal that rounds to it (1e-05, not 9.9999997e-06)."""
    import numpy as np

    return float(str(np.float32(x)))


def _read(path: Path) -> tuple[dict, dict]:
    """(metadata as plain Python values, tensors) of the GGUF file at `path`, once `_open` has checked it.

    tensors: name -> (kind, value, bits, type), in the order conversions have always
    written them (`_earlier_order`). Kind "quant": an
    MLX (weight, scales, biases) triplet of `bits` bits, as `mx.load` returns Q4_0 /
    Q4_1 / Q8_0 exactly; kind "float": one float array, F32 or F16 as `mx.load`
    returns it. What `mx.load` does not read exactly (`_exactly_loaded`) is left to
    the gguf package to dequantize to float32 when it is converted (kind "dequant", a
    `_Dequantized`, with its type): every tensor where `mx.load` cannot read the file (a quantization type MLX
    lacks) or must not be given it (a 64-bit float value in its metadata, which
    crashes MLX's parser). BF16 tensors are read by neither: `mx.load` turns them
    into float16, losing range and precision, so their bits are taken as they are
    (`_bfloat16`; kind "float").
    """
    import mlx.core as mx

    reader = _open(path)
    meta = {}
    for key, field in reader.fields.items():
        try:
            meta[key] = field.contents()
        except Exception:  # noqa: BLE001 - a field we cannot decode (text that is not UTF-8) counts as absent
            continue
    from gguf import GGUFValueType

    if any(GGUFValueType.FLOAT64 in field.types for field in reader.fields.values()):
        loaded = {}  # valid GGUF, but MLX's parser crashes the process (SIGSEGV) on a 64-bit float value
    else:
        try:
            loaded = mx.load(str(path))
        except Exception:  # noqa: BLE001 - MLX refuses whole files with a type it lacks
            loaded = {}
    types = {t.name: t.tensor_type.name for t in reader.tensors}
    tensors = _exactly_loaded(loaded, types)
    for t in reader.tensors:
        if t.name in tensors:
            continue
        if t.tensor_type.name == "BF16":
            tensors[t.name] = ("float", _bfloat16(t), None, "BF16")
            continue
        tensors[t.name] = ("dequant", _Dequantized(t, path), None, t.tensor_type.name)
    return meta, {name: tensors[name] for name in _earlier_order(loaded, types)}


def _earlier_order(loaded: dict, types: dict) -> list:
    """The names of a file's tensors (`types`, in the file's order) in the order conversions before `CONVERSION` 2 put
    them in the folder: mx.load's (`loaded`) where it read them all, else BF16 tensors first, then the file's order.
    The order lays out model.safetensors, whose sampled bytes name the model's agents (`model.fingerprint`): a file
    converted again into the same values must get the same bytes, or the agents stored for it are not found."""
    if loaded and set(types) <= set(loaded):
        return [name for name in loaded if name in types]
    return sorted(types, key=lambda name: types[name] != "BF16")  # stable: the file's order within each


def _exactly_loaded(loaded: dict, types: dict) -> dict:
    """The tensors of `loaded` (what `mx.load` read of a file whose tensors are of `types`, by name) that it read
    exactly, as `_read` gives them: the F32 and F16 tensors (kind "float") and the Q4_0, Q4_1 and Q8_0 triplets
    (kind "quant") whose scales and biases are finite.

    Not the rest: MLX makes float16 of the other types it reads (Q4_K, Q6_K...), which rounds them and makes inf
    of a value past float16's range (+-65504), and of BF16; and it computes the biases of Q4_0 and Q8_0 blocks (-8
    and -128 times their scale) in float16, inf for a block past that range.
    """
    import mlx.core as mx

    tensors = {}
    for name, w in loaded.items():
        stem = name.removesuffix(".weight")
        if name.endswith((".scales", ".biases")) and stem.rpartition(".")[0] + ".weight" in loaded:
            continue
        if f"{stem}.scales" in loaded:
            scales, biases = loaded[f"{stem}.scales"], loaded[f"{stem}.biases"]
            if mx.all(mx.isfinite(scales)).item() and mx.all(mx.isfinite(biases)).item():
                bits = 32 * w.shape[-1] // (scales.shape[-1] * GROUP)
                tensors[name] = ("quant", (w, scales, biases), bits, f"{bits}-bit")
        elif types.get(name) in ("F32", "F16"):
            tensors[name] = ("float", w, None, types[name])
    return tensors


def _open(path: Path):
    """The gguf package's reader of the GGUF file at `path`, its structure checked: GGUF version 2 or 3,
    little-endian, every tensor of a type the package knows, of 1 to 4 dimensions none 0, its data aligned and
    within the file, no tensor name twice. Only such a file may reach `mx.load`, whose parser trusts all that.
    A tensor type the package does not define, an integer type or F64 raises UnsupportedGGUF; the rest GGUFError."""
    _check_head(path)
    try:  # the reader fails on a damaged or truncated file with whatever its parsing meets (IndexError, ...)
        reader = _reader(path)
    except GGUFError:  # no gguf package, or a tensor type it does not define
        raise
    except Exception as e:  # noqa: BLE001
        raise _unreadable(path, f"{type(e).__name__}: {e}") from e
    for t in reader.tensors:
        if len(t.shape) > _MAX_DIMS or not all(t.shape):
            raise _unreadable(path, f"tensor {t.name} has shape {[int(d) for d in t.shape]} (1 to {_MAX_DIMS} "
                                    "dimensions, none of them 0)")
        if (t.data_offset - reader.data_offset) % reader.alignment:
            raise _unreadable(path, f"the data of tensor {t.name} is not aligned to {reader.alignment} bytes")
        if t.tensor_type.name in _INTEGER_TYPES:
            raise UnsupportedGGUF(f"{path}: tensor {t.name} is of integer type {t.tensor_type.name}, which holds no "
                                  "weights and is not supported; convert the model again with a float or quantized "
                                  "type (such as Q4_0, Q8_0, Q4_K or F16)")
        if t.tensor_type.name == "F64":
            raise UnsupportedGGUF(f"{path}: tensor {t.name} is a 64-bit float tensor (F64), which is not supported: "
                                  "a converted folder holds 32-bit floats at most, so it would not convert "
                                  "exactly; convert the model again with 32-bit, 16-bit or quantized weights "
                                  "(llama.cpp's converter's --outtype f32, f16, bf16 or q8_0)")
    return reader


def _check_head(path: Path) -> None:
    """Raise GGUFError unless `path` is a regular file this process may read that starts as GGUF does (its
    magic), UnsupportedGGUF for a GGUF version other than 2 and 3 or a big-endian file: its first 8 bytes, read at
    once, before any wait for a folder's lock."""
    _check_file(path)
    try:
        with open(path, "rb") as f:
            head = f.read(8)
    except OSError as e:
        raise _cannot_read(path, e) from e
    if head[:4] != b"GGUF":
        raise _unreadable(path, f"it starts with {head[:4]!r}, not b'GGUF': it is not a GGUF file")
    if len(head) < 8:
        raise _unreadable(path, "it ends within its header")
    version = int.from_bytes(head[4:], "little")
    if version not in _VERSIONS:
        if int.from_bytes(head[4:], "big") in _VERSIONS:
            raise UnsupportedGGUF(f"{path} is a big-endian GGUF file, which is not supported: convert the model "
                                  "again without --bigendian")
        raise UnsupportedGGUF(f"{path}: GGUF version {version} is not supported (only 2 and 3); convert the model "
                              "again with a current llama.cpp")


def _reader(path: Path):
    """The gguf package's GGUFReader of `path`, but raising UnsupportedGGUF for a tensor type id the package does
    not define, where GGUFReader fails with a bare ValueError (the type enum's own) that reads as damage."""
    try:
        from gguf import GGMLQuantizationType, GGUFReader
    except ImportError as e:  # a declared dependency; only a broken install gets here
        raise GGUFError("reading GGUF files needs the gguf package: pip install gguf") from e
    try:
        return GGUFReader(str(path))
    except ValueError as e:
        unknown = re.fullmatch(r"(?:np\.\w+\()?(\d+)\)? is not a valid GGMLQuantizationType", str(e))  # numpy 1 or 2
        if unknown is None:
            raise
        last = max(t.value for t in GGMLQuantizationType)
        raise UnsupportedGGUF(
            f"{path}: a tensor has GGML type id {unknown[1]}, which is not supported: the installed gguf package "
            f"does not define it (its last is {last}), so the file was written by a llama.cpp version or fork with "
            "tensor types this reader does not know; convert the model again with a common type (such as Q4_0, "
            "Q8_0, Q4_K or F16), or upgrade the gguf package") from e


def _unreadable(path: Path, why: str) -> GGUFError:
    """The error for a file that is not GGUF or is damaged, saying `why`."""
    why = " ".join(why.split())
    return GGUFError(f"{path} is not a readable GGUF file (damaged or cut short?): {why}; get the file again "
                     "or convert the model again")


class _Dequantized:
    """A GGUF tensor that the gguf package dequantizes to float32 when `_mlx_weights` converts it, not before: it
    converts one at a time, so a quantized folder's conversion never holds all of a file's float32 values at once (a
    K-quant 8B model's are 32 GB). `shape` is the MLX array's."""

    def __init__(self, tensor, path: Path):
        """UnsupportedGGUF at once where the gguf package cannot dequantize the tensor's type (tried on one block of
        zeros, not the file's data), not after the tensors before it were converted."""
        import numpy as np
        from gguf import GGML_QUANT_SIZES, quants

        self.tensor, self.path = tensor, path
        self.shape = tuple(int(d) for d in reversed(tensor.shape))
        try:
            quants.dequantize(np.zeros((1, GGML_QUANT_SIZES[tensor.tensor_type][1]), np.uint8), tensor.tensor_type)
        except NotImplementedError as e:
            raise UnsupportedGGUF(
                f"tensor {tensor.name} uses quantization type {tensor.tensor_type.name}, which neither MLX nor the "
                f"gguf package can read; convert the model with another type (e.g. Q4_0, Q4_1, Q8_0, Q4_K, F16)"
            ) from e

    def load(self):
        """The float32 MLX array; GGUFError where the file was cut short within the tensor's data, or since it was
        opened: the tensor's bytes are read from the file now, not through the reader's memory map, where a page
        past a file's new end kills the process (SIGBUS) when touched."""
        import mlx.core as mx
        import numpy as np
        from gguf import quants

        t = self.tensor
        try:
            with open(self.path, "rb") as f:
                f.seek(t.data_offset)
                raw = f.read(t.n_bytes)
        except OSError as e:
            raise _cannot_read(self.path, e) from e
        if len(raw) != t.n_bytes:
            raise _unreadable(self.path, f"tensor {t.name}: the file ends within its data (changed while converted?)")
        try:  # as the reader lays it out: its dtype and shape, not its (mapped) data
            data = quants.dequantize(np.frombuffer(raw, t.data.dtype).reshape(t.data.shape), t.tensor_type)
            return mx.array(np.ascontiguousarray(data, dtype=np.float32).reshape(self.shape))
        except (ValueError, IndexError) as e:  # bytes its type's blocks do not fit (all were read): the file is damaged
            raise _unreadable(self.path, f"tensor {t.name}: {e}") from e


def _bfloat16(tensor):
    """A BF16 GGUF tensor as an MLX bfloat16 array of its very bits."""
    import mlx.core as mx
    import numpy as np

    shape = tuple(int(d) for d in reversed(tensor.shape))
    return mx.array(np.ascontiguousarray(tensor.data).view(np.uint16).reshape(shape)).view(mx.bfloat16)


def _mlx_name(gguf_name: str) -> str:
    stem, _, suffix = gguf_name.rpartition(".")
    if stem in _GLOBAL_NAMES:
        return f"{_GLOBAL_NAMES[stem]}.{suffix}"
    parts = stem.split(".")
    if len(parts) == 3 and parts[0] == "blk" and parts[2] in _LAYER_NAMES:
        return f"model.layers.{parts[1]}.{_LAYER_NAMES[parts[2]]}.{suffix}"
    raise UnsupportedGGUF(f"GGUF tensor {gguf_name!r} has no mlx-lm counterpart: it is not supported by this import "
                          f"(supported: the tensors of plain {', '.join(ARCHS)} models)")


def _gguf_name(mlx_name: str) -> str:
    """The llama.cpp name of an mlx-lm tensor name (`_mlx_name` reversed)."""
    stem, _, suffix = mlx_name.rpartition(".")
    for gguf_stem, name in _GLOBAL_NAMES.items():
        if stem == name:
            return f"{gguf_stem}.{suffix}"
    _, _, layer, rest = stem.split(".", 3)
    return f"blk.{layer}.{next(g for g, n in _LAYER_NAMES.items() if n == rest)}.{suffix}"


def _unpermute(a, n_heads: int):
    """Undo llama.cpp's rope permutation of the rows of `a` (rows = n_heads * head_dim)."""
    half = a.shape[0] // n_heads // 2
    return a.reshape(n_heads, half, 2, *a.shape[1:]).swapaxes(1, 2).reshape(a.shape)


def _mlx_weights(tensors: dict, config: dict, arch: str, weights: str, progress=None):
    """(mlx-lm weights dict, quantization config or None) for the chosen `weights` kind: a tensor at a time, each
    evaluated before the next is read (in a quantized folder a requantized one's float32 values are then freed),
    `progress(done, total)` after each."""
    import mlx.core as mx

    heads = {"attn_q": config["num_attention_heads"], "attn_k": config["num_key_value_heads"]}
    out, layer_bits = {}, {}
    for done, (name, entry) in enumerate(tensors.items(), 1):
        made = _mlx_weight(name, *entry, heads, arch, weights, layer_bits)
        mx.eval(list(made.values()))
        out.update(made)
        if progress is not None:
            progress(done, len(tensors))
    if not layer_bits:
        return out, None
    common = max(set(layer_bits.values()), key=list(layer_bits.values()).count)
    quantization = {"group_size": GROUP, "bits": common, "mode": "affine"}
    for prefix, bits in sorted(layer_bits.items()):
        if bits != common:
            quantization[prefix] = {"group_size": GROUP, "bits": bits, "mode": "affine"}
    return out, quantization


def _mlx_weight(name: str, kind: str, value, bits, qtype: str, heads: dict, arch: str, weights: str,
                layer_bits: dict) -> dict:
    """{mlx-lm name: array} of GGUF tensor `name` (`_read`'s entry: kind, value, bits, type) in a folder of
    `weights`, not yet evaluated; a quantized one's bits recorded in `layer_bits` under its module's name."""
    import mlx.core as mx

    target = _mlx_name(name)
    role = name.split(".")[-2] if name.startswith("blk.") else None
    fix = (lambda a: _unpermute(a, heads[role])) if arch == "llama" and role in heads else (lambda a: a)
    prefix = target.rpartition(".")[0]
    if kind == "quant" and weights == "quantized":
        layer_bits[prefix] = bits
        return dict(zip((target, f"{prefix}.scales", f"{prefix}.biases"), (fix(a) for a in value)))
    if kind == "quant":
        w, scales, biases = value
        a = mx.dequantize(w, scales.astype(mx.float32), biases.astype(mx.float32), group_size=GROUP, bits=bits)
    else:
        a = value.load() if kind == "dequant" else value
    a = fix(a)
    if (weights == "quantized" and kind == "dequant" and qtype not in _FLOAT_TYPES and a.ndim == 2
            and a.shape[-1] % GROUP == 0):
        layer_bits[prefix] = 4 if qtype.startswith(("Q2", "Q3", "Q4", "IQ", "TQ", "MXFP4", "NVFP4")) else 8
        return dict(zip((target, f"{prefix}.scales", f"{prefix}.biases"),
                        _requantize(a, layer_bits[prefix], name, qtype)))
    return {target: a.astype(_float_type(a, weights, name, qtype))}


def _requantize(a, bits: int, name: str, qtype: str):
    """(weight, scales, biases): the float32 tensor `a` (GGUF tensor `name` of type `qtype`, dequantized) in MLX's
    affine format of `bits` bits, group `GROUP`.

    Quantized from its float32 values, never a float16 copy of them, which made inf of a value past float16's range
    (+-65504) and so inf or nan of its group's scales and biases. The scales and biases are float16, the quantized
    folder's float type (`mx.quantize` gives them its input's type, float32 here), but a tensor whose scales or
    biases float16 cannot hold keeps them float32, with a warning, as `_float_type` keeps a float tensor past
    float16's range.
    """
    import mlx.core as mx

    w, scales, biases = mx.quantize(a.astype(mx.float32), group_size=GROUP, bits=bits)
    if not _past_float16(scales) and not _past_float16(biases):
        return w, scales.astype(mx.float16), biases.astype(mx.float16)
    _warn_kept(name, qtype, "its scales and biases as float32")
    return w, scales, biases


def _past_float16(a) -> bool:
    """Whether `a` holds a finite value that float16 makes inf of (one past +-65504)."""
    import mlx.core as mx

    return mx.any(mx.isinf(a.astype(mx.float16)) & ~mx.isinf(a)).item()


def _warn_kept(name: str, qtype: str, kept: str) -> None:
    """Warn that GGUF tensor `name` (of type `qtype`), past float16's range, is `kept` in a wider type in a quantized
    folder (`_float_type`, `_requantize`)."""
    log.warning("GGUF tensor %s (%s) holds values past float16's range (+-65504): the quantized folder keeps %s, "
                "which MLX computes the model in float32 beside float16 (slower); convert with weights='float32' "
                "(--weights float32) for a folder of one type", name, qtype, kept)


def _float_type(a, weights: str, name: str, qtype: str):
    """The MLX type a folder of `weights` stores the float tensor `a` (GGUF tensor `name`, of type `qtype`) in.

    float32 in a float32 folder, which holds every one exactly. float16 in a quantized one (BF16's too: a model of
    one float type, as float16 beside bfloat16 makes MLX compute in float32), which rounds what is below its
    precision, but never makes inf of a finite value: a tensor past float16's range (+-65504) keeps its own type
    there, exactly, with a warning (the model then computes in float32).
    """
    import mlx.core as mx

    if weights == "float32":
        return mx.float32
    if not _past_float16(a):
        return mx.float16
    _warn_kept(name, qtype, f"it as {str(a.dtype).removeprefix('mlx.core.')}")
    return a.dtype


def _torch_dtype(weights: dict) -> str:
    """config.json's torch_dtype for a folder of `weights` (name -> MLX array): the one float type its float arrays
    (scales and biases included) are stored in, or "float32" where they are of several (float16 beside a tensor
    kept as bfloat16 or float32 past float16's range), which holds each of them exactly and which MLX computes such
    a model in. mlx-lm's convert casts a model's float weights to it by default; `mlx_lm.load` does not read it."""
    import mlx.core as mx

    types = {a.dtype for a in weights.values() if mx.issubdtype(a.dtype, mx.floating)}
    return str(types.pop()).removeprefix("mlx.core.") if len(types) == 1 else "float32"


def _tokenizer(meta: dict, path: Path):
    """(tokenizer.json text, tokenizer_config dict, chat template or None) from GGUF metadata."""
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers, processors

    kind = meta.get("tokenizer.ggml.model")
    if kind != "gpt2":
        raise UnsupportedGGUF(f"{path}: tokenizer model {kind!r} is not supported (only byte-level BPE, 'gpt2')")
    pre = meta.get("tokenizer.ggml.pre", "default")
    if pre not in PRE_TOKENIZERS:
        raise UnsupportedGGUF(f"{path}: pre-tokenizer {pre!r} is not supported; supported: {', '.join(PRE_TOKENIZERS)}")
    tokens = list(meta["tokenizer.ggml.tokens"])
    types = list(meta.get("tokenizer.ggml.token_type") or [1] * len(tokens))
    merges = [tuple(m.split(" ", 1)) for m in meta.get("tokenizer.ggml.merges") or []]
    try:  # merges of tokens the vocabulary lacks, a merge that is not two tokens
        tok = Tokenizer(models.BPE(vocab={t: i for i, t in enumerate(tokens)}, merges=merges, fuse_unk=False))
    except Exception as e:  # noqa: BLE001 - tokenizers raises plain Exception and TypeError here
        raise GGUFError(f"{path}: its tokenizer (tokenizer.ggml.tokens and merges) cannot be built: "
                        f"{' '.join(str(e).split())}; get the file again or convert the model again") from e
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=pre in ("smollm", "gpt-2", "default"))
    if pre == "smollm":
        tok.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), byte_level])
    elif pre in ("qwen2", "llama-bpe"):
        regex = _QWEN2_REGEX if pre == "qwen2" else _LLAMA3_REGEX
        split = pre_tokenizers.Split(Regex(regex), behavior="isolated", invert=False)
        tok.pre_tokenizer = pre_tokenizers.Sequence([split, byte_level])
    else:
        tok.pre_tokenizer = byte_level
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False)
                            for t, ty in zip(tokens, types) if ty == _CONTROL])
    tok.add_tokens([AddedToken(t, special=False, normalized=False)
                    for t, ty in zip(tokens, types) if ty == _USER_DEFINED])

    def token(key):
        i = meta.get(f"tokenizer.ggml.{key}_token_id")
        return tokens[i] if in_vocabulary(i, len(tokens)) else None

    add_bos = bool(meta.get("tokenizer.ggml.add_bos_token", False)) and token("bos") is not None
    if add_bos:
        bos_id = tokens.index(token("bos"))
        tok.post_processor = processors.TemplateProcessing(
            single=f"{token('bos')} $A", pair=f"{token('bos')} $A $B", special_tokens=[(token("bos"), bos_id)])
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "clean_up_tokenization_spaces": False,  # so decode(encode(x)) == x
        "add_bos_token": add_bos,
        "add_prefix_space": False,
        "model_max_length": int(meta.get(f"{meta.get('general.architecture')}.context_length", 4096)),
    }
    for key, name in (("bos", "bos_token"), ("eos", "eos_token"), ("unknown", "unk_token"), ("padding", "pad_token")):
        if token(key) is not None:
            config[name] = token(key)
    return tok.to_str(), config, meta.get("tokenizer.chat_template")
