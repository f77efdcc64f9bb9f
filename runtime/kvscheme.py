"""How a KV cache is quantized: bits for keys and for values, group size, rotation.

A `KVScheme` is the whole recipe that turns a token's keys and values into packed
words. Quantization groups always run along head_dim, one token at a time, so rows
stay independent and batch surgery on packed rows stays exact under every scheme.

The rotation ("hadamard") multiplies keys and values by the orthonormal Hadamard
matrix H along head_dim before they are quantized. H spreads a few outlier channels
over the whole head, so a group's range (and its rounding error) shrinks. Attention
stays exact in arithmetic: queries are rotated the same way, (qH)·(kH) = q·k, and the
attention output, a mix of rotated values, is rotated back (H is symmetric and its
own inverse). `runtime.attention.sdpa` applies both outside the kernels, so each
attention route serves every scheme; on CUDA the decode kernel (`runtime.q4sdpa`) and
the packer of new keys and values (`runtime.q4pack`) rotate inside their kernels, by
the same H.

Schemes are named like "k6v4-g64-hadamard" (keys 6-bit, values 4-bit, group 64,
rotated) or "k4v4-g64" (no rotation; what a plain mlx-lm `QuantizedKVCache` of
4 bits and group 64 holds). The name is stored in every cache file, so a cache is
never read under another scheme.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, replace

from runtime.errors import InvalidArgumentType, KvactorsError

BITS = (2, 3, 4, 5, 6, 8)  # what mx.quantize packs
GROUP_SIZES = (32, 64, 128)
ROTATIONS = ("none", "hadamard")
_NAME = re.compile(r"k(\d+)v(\d+)-g(\d+)(?:-(hadamard))?")


class KVSchemeError(KvactorsError, ValueError):
    """A KV scheme is malformed, or cannot serve a model or an attention route."""


@dataclass(frozen=True)
class KVScheme:
    """Bits of keys and of values, elements per quantization group, and the rotation along head_dim."""

    key_bits: int = 4
    value_bits: int = 4
    group_size: int = 64
    rotation: str = "none"

    def __post_init__(self):
        for what, bits in (("key", self.key_bits), ("value", self.value_bits)):
            if type(bits) is not int or bits not in BITS:
                raise KVSchemeError(f"{what} bits must be one of {BITS}, got {bits!r}")
        if type(self.group_size) is not int or self.group_size not in GROUP_SIZES:
            raise KVSchemeError(f"group size must be one of {GROUP_SIZES}, got {self.group_size!r}")
        if self.rotation not in ROTATIONS:
            raise KVSchemeError(f"rotation must be one of {ROTATIONS}, got {self.rotation!r}")

    @property
    def name(self) -> str:
        """The scheme's name, e.g. "k6v4-g64-hadamard"; `parse(name)` gives the scheme back."""
        rotated = "" if self.rotation == "none" else f"-{self.rotation}"
        return f"k{self.key_bits}v{self.value_bits}-g{self.group_size}{rotated}"

    @property
    def rotated(self) -> bool:
        """Whether keys and values are stored rotated (queries and outputs then rotate too)."""
        return self.rotation != "none"

    def bytes_per_head(self, k_head_dim: int, v_head_dim: int, scale_bytes: int) -> float:
        """Bytes one token's keys and values of one kv head take: packed words, scales and biases of `scale_bytes`."""
        per_group = 2 * scale_bytes / self.group_size
        return k_head_dim * (self.key_bits / 8 + per_group) + v_head_dim * (self.value_bits / 8 + per_group)

    def fp16_ratio(self, k_head_dim: int, v_head_dim: int) -> float:
        """Bytes against a 16-bit cache's, with 16-bit scales and biases (as on a GPU)."""
        return self.bytes_per_head(k_head_dim, v_head_dim, 2) / (2 * (k_head_dim + v_head_dim))

    def check_model(self, k_head_dim: int, v_head_dim: int, has_sinks: bool = False) -> None:
        """Raise KVSchemeError unless this scheme can serve a model of these head dims.

        The group size must divide both head dims; the Hadamard rotation needs
        power-of-two head dims, and `runtime.attention` (models with attention sinks
        attend by themselves, so they cannot rotate their queries).
        """
        if self.rotated and has_sinks:
            raise KVSchemeError(f"{self.name}: models with attention sinks cannot rotate their KV cache; "
                                f"use an unrotated scheme such as {default_scheme(True).name}")
        for what, dim in (("key", k_head_dim), ("value", v_head_dim)):
            if dim % self.group_size:
                raise KVSchemeError(f"{what} head dim {dim} is not a multiple of the KV group size {self.group_size}; "
                                    f"{self._fitting(k_head_dim, v_head_dim)}")
            if self.rotated and dim & (dim - 1):
                raise KVSchemeError(f"the {self.rotation} rotation needs power-of-two head dims, the {what}s have "
                                    f"{dim}; {self._fitting(k_head_dim, v_head_dim)}")

    def _fitting(self, k_head_dim: int, v_head_dim: int) -> str:
        """Advice naming this scheme's nearest twin that serves these head dims: the largest group that divides
        both, the rotation kept only where both are powers of two."""
        groups = [g for g in GROUP_SIZES if k_head_dim % g == 0 and v_head_dim % g == 0]
        if not groups:
            return f"no KV group size ({', '.join(map(str, GROUP_SIZES))}) divides head dims {k_head_dim} and {v_head_dim}"
        powers = not (k_head_dim & (k_head_dim - 1) or v_head_dim & (v_head_dim - 1))
        twin = replace(self, group_size=max(groups), rotation=self.rotation if powers else "none")
        return f"pass a scheme that serves them (e.g. Runtime(kv_scheme='{twin.name}'))"


def parse(name: str) -> KVScheme:
    """The `KVScheme` named `name` (see the module doc); raises KVSchemeError for anything else."""
    m = _NAME.fullmatch(name) if isinstance(name, str) else None
    if m is None:
        raise KVSchemeError(f"KV scheme names look like 'k6v4-g64-hadamard' or 'k4v4-g64', got {name!r}")
    try:
        return KVScheme(int(m[1]), int(m[2]), int(m[3]), m[4] or "none")
    except KVSchemeError as e:
        raise KVSchemeError(f"KV scheme {name!r}: {e}") from None


DEFAULT = KVScheme(6, 4, 64, "hadamard")  # measured on SmolLM2-135M-Instruct: benchmarks/results/cpu/quality-*
DEFAULT_UNROTATED = KVScheme(6, 4, 64, "none")


def default_scheme(has_sinks: bool = False) -> KVScheme:
    """The scheme a model gets unless the caller picks one.

    DEFAULT (keys 6-bit, values 4-bit, group 64, Hadamard-rotated: 0.34x fp16 bytes)
    was chosen by measurement on the shipped model (`python -m benchmarks quality`,
    README "KV cache quality"); models with attention sinks cannot rotate and get
    the same bits unrotated.
    """
    return DEFAULT_UNROTATED if has_sinks else DEFAULT


PLAIN_BITS = (4, 8)  # what Runtime(kv_bits=...) takes; other widths by scheme name


def from_options(kv_bits=None, kv_group_size=None, kv_scheme=None) -> KVScheme | None:
    """The scheme `Runtime`'s options ask for; None (nothing given): the model's default.

    `kv_scheme` is a scheme name (`parse`); or `kv_bits` (4 or 8) and `kv_group_size`
    (32, 64 or 128) pick the unrotated scheme of that many bits for keys and values
    (defaults 4 and 64); not both. Raises InvalidArgumentType (a TypeError) for a value of the wrong type and
    KVSchemeError (a ValueError) for a bad one.
    """
    if kv_scheme is not None:
        if kv_bits is not None or kv_group_size is not None:
            raise KVSchemeError("give kv_scheme, or kv_bits / kv_group_size, not both")
        if not isinstance(kv_scheme, str):
            raise InvalidArgumentType(f"kv_scheme must be a name such as {DEFAULT.name!r}, "
                                      f"got {type(kv_scheme).__name__}")
        return parse(kv_scheme)
    if kv_bits is None and kv_group_size is None:
        return None
    for name, value, allowed in (("kv_bits", kv_bits, PLAIN_BITS), ("kv_group_size", kv_group_size, GROUP_SIZES)):
        if value is None:
            continue
        if type(value) is not int:
            raise InvalidArgumentType(f"{name} must be an int, got {type(value).__name__}")
        if value not in allowed:
            raise KVSchemeError(f"{name} must be one of {allowed}, got {value!r}")
    return plain(kv_bits or 4, kv_group_size or 64)


def plain(bits: int, group_size: int) -> KVScheme:
    """The unrotated scheme of `bits` for keys and values: what mlx-lm's QuantizedKVCache(group_size, bits) holds."""
    return KVScheme(bits, bits, group_size, "none")


def hadamard(dim: int, dtype):
    """The orthonormal, symmetric Sylvester-Hadamard matrix of size `dim` (a power of two) as an MLX array."""
    import mlx.core as mx

    h = mx.array([[1.0]])
    while h.shape[0] < dim:
        h = mx.concatenate([mx.concatenate([h, h], axis=1), mx.concatenate([h, -h], axis=1)], axis=0)
    return (h / math.sqrt(dim)).astype(dtype)


_MATRICES: dict = {}


def rotate(x, scheme: KVScheme):
    """`x` (..., D) times the scheme's rotation (itself when there is none).

    The rotation is its own inverse: it rotates keys, values and queries in, and attention outputs back.
    """
    import mlx.core as mx

    if not scheme.rotated:
        return x
    key = (x.shape[-1], x.dtype)
    h = _MATRICES.get(key)
    if h is None:
        h = hadamard(*key)
        mx.eval(h)  # one evaluated matrix for every thread and step
        _MATRICES[key] = h
    return x @ h
