"""A fast sweep of KV schemes by perplexity: a numpy float32 forward of a llama model, KV fake-quantized.

`benchmarks.quality` measures kvactors' own cache through MLX, whose CPU backend
runs SmolLM2-135M at about 3 tokens/s on the 2-core machine: minutes per scheme
for a thousand tokens. This sweep runs the same weights through numpy (its BLAS is
several times faster there) and fake-quantizes each new token's keys and values as
a scheme stores them: rotated, `mx.quantize`d per token along head_dim, dequantized,
rotated back (exact in arithmetic to rotating the queries instead, as kvactors
does). A per-channel key scale (--key-scale A: keys divided by their channel's RMS
to the power A, calibrated on another text, then multiplied back) can be added to
any scheme. It is how the default scheme was chosen; `benchmarks.quality` checks the
choice through the real cache.

Llama-architecture mlx-lm folders with float weights only (the embedded default's
converted folder on the CPU is one).

    python -m benchmarks.kv_sweep --tokens 1024 --schemes k4v4-g64,k6v4-g64-hadamard
"""

from __future__ import annotations

import json
import math
import time
from pathlib import Path

import mlx.core as mx
import numpy as np

from benchmarks.common import bench_parser, environment, write_results

TEXT = Path("/usr/share/common-licenses/GPL-3")
CALIBRATION = Path("/usr/share/common-licenses/Apache-2.0")
SCHEMES = ("k4v4-g64,k4v4-g32,k4v4-g64-hadamard,k4v4-g32-hadamard,k5v4-g64-hadamard,k5v4-g32-hadamard,"
           "k5v5-g64-hadamard,k6v4-g64,k6v4-g64-hadamard,k8v4-g64")
COLUMNS = ["kv scheme", "key scale", "bytes x fp16", "perplexity", "x unquantized"]


class Llama:
    """A llama forward in numpy float32 (RMSNorm, RoPE, GQA, SwiGLU, tied or untied head), chunk by chunk."""

    def __init__(self, folder: Path):
        from safetensors.numpy import load_file

        c = json.loads((folder / "config.json").read_text())
        self.w = {}
        for f in sorted(folder.glob("*.safetensors")):
            self.w.update({k: v.astype(np.float32) for k, v in load_file(f).items()})
        self.layers, self.heads, self.kv_heads = c["num_hidden_layers"], c["num_attention_heads"], c["num_key_value_heads"]
        self.dim = c.get("head_dim") or c["hidden_size"] // self.heads
        self.eps = c["rms_norm_eps"]
        self.inv_freq = c.get("rope_theta", 10000.0) ** (-np.arange(0, self.dim, 2) / self.dim)
        self.head = self.w.get("lm_head.weight", self.w["model.embed_tokens.weight"])

    def _norm(self, x, name):
        return x / np.sqrt((x * x).mean(-1, keepdims=True) + self.eps) * self.w[name]

    def _rope(self, x, positions):
        angles = positions[:, None] * self.inv_freq[None]
        cos, sin = np.cos(angles), np.sin(angles)
        a, b = x[..., : self.dim // 2], x[..., self.dim // 2:]
        return np.concatenate([a * cos - b * sin, a * sin + b * cos], -1).astype(np.float32)

    def hidden(self, ids, cache: list, start: int, store) -> np.ndarray:
        """Final hidden states of `ids` at positions from `start`; `store(layer, k, v)` gives what the cache keeps."""
        x, n = self.w["model.embed_tokens.weight"][ids], len(ids)
        positions = np.arange(start, start + n, dtype=np.float64)
        for i in range(self.layers):
            p = f"model.layers.{i}."
            h = self._norm(x, p + "input_layernorm.weight")

            def project(name, heads):
                return (h @ self.w[p + f"self_attn.{name}_proj.weight"].T).reshape(n, heads, self.dim).transpose(1, 0, 2)

            q = self._rope(project("q", self.heads), positions)
            k, v = store(i, self._rope(project("k", self.kv_heads), positions), project("v", self.kv_heads))
            cache[i] = (k, v) if cache[i] is None else tuple(np.concatenate([a, b], 1) for a, b in zip(cache[i], (k, v)))
            keys, values = cache[i]
            total = keys.shape[1]
            scores = (q.reshape(self.kv_heads, -1, self.dim) @ keys.transpose(0, 2, 1)) / math.sqrt(self.dim)
            scores = scores.reshape(self.kv_heads, -1, n, total)
            scores = np.where(np.arange(total)[None] <= np.arange(total - n, total)[:, None], scores, -np.inf)
            probs = np.exp(scores - scores.max(-1, keepdims=True))
            probs /= probs.sum(-1, keepdims=True)
            out = (probs.reshape(self.kv_heads, -1, total) @ values).reshape(self.heads, n, self.dim)
            x = x + out.transpose(1, 0, 2).reshape(n, -1) @ self.w[p + "self_attn.o_proj.weight"].T
            h = self._norm(x, p + "post_attention_layernorm.weight")
            gate = h @ self.w[p + "mlp.gate_proj.weight"].T
            x = x + ((gate / (1 + np.exp(-gate))) * (h @ self.w[p + "mlp.up_proj.weight"].T)) @ self.w[p + "mlp.down_proj.weight"].T
        return self._norm(x, "model.norm.weight")

    def perplexity(self, ids: list[int], store, chunk: int = 256) -> float:
        """exp(mean next-token NLL) of `ids`, teacher-forced `chunk` tokens at a time through the cache."""
        cache, total, count = [None] * self.layers, 0.0, 0
        for start in range(0, len(ids) - 1, chunk):
            x, y = ids[start: start + chunk], np.array(ids[start + 1: start + chunk + 1])
            logits = self.hidden(np.array(x), cache, start, store)[: len(y)] @ self.head.T
            top = logits.max(-1)
            lse = top + np.log(np.exp(logits - top[:, None]).sum(-1))
            total += float((lse - logits[np.arange(len(y)), y]).sum())
            count += len(y)
        return math.exp(total / count)


def fake_quantizer(scheme, key_scale=None):
    """`store(layer, k, v)`: keys and values as `scheme` keeps them, back in the model's basis."""
    from runtime.kvscheme import hadamard

    def quantized(x, bits, scale=None):
        if scale is not None:
            x = x / scale[:, None, :]
        h = np.array(hadamard(x.shape[-1], mx.float32)) if scheme.rotated else None
        y = mx.array(x @ h if h is not None else x)
        y = np.array(mx.dequantize(*mx.quantize(y, group_size=scheme.group_size, bits=bits),
                                   group_size=scheme.group_size, bits=bits))
        y = y @ h if h is not None else y  # H is its own inverse
        return y * scale[:, None, :] if scale is not None else y

    def store(layer, k, v):
        return (quantized(k, scheme.key_bits, None if key_scale is None else key_scale[layer]),
                quantized(v, scheme.value_bits))

    return store


def key_rms(model: Llama, ids: list[int]) -> np.ndarray:
    """Per layer, kv head and channel: the RMS of the (rotary-embedded) keys of `ids`."""
    seen = [[] for _ in range(model.layers)]

    def store(layer, k, v):
        seen[layer].append(k)
        return k, v

    model.hidden(np.array(ids), [None] * model.layers, 0, store)
    return np.stack([np.sqrt((np.concatenate(s, 1) ** 2).mean(1)) for s in seen])


def main(argv=None) -> int:
    ap = bench_parser(__doc__)
    ap.set_defaults(model=None)
    ap.add_argument("--text", type=Path, default=TEXT, help="English text for perplexity (default: %(default)s)")
    ap.add_argument("--tokens", type=int, default=1024, help="tokens of --text to score (default: %(default)s)")
    ap.add_argument("--schemes", default=SCHEMES, help="kvactors scheme names (default: %(default)s)")
    ap.add_argument("--key-scale", default="", help="comma-separated exponents A: each scheme again with keys / rms^A")
    args = ap.parse_args(argv)
    if args.model in ("tiny", "llama-8b-shape"):  # random-weight presets: the sweep needs real weights
        args.model = None
    import mlx_lm

    from runtime.kvscheme import parse
    from runtime.model import resolve_model_path

    folder = resolve_model_path(args.model)
    tokenizer = mlx_lm.tokenizer_utils.load(folder)
    model = Llama(folder)
    ids = tokenizer.encode(args.text.read_text(), add_special_tokens=False)[: args.tokens]
    env = environment()
    env["model"] = str(folder)
    print(env, flush=True)
    rows = [{"kv scheme": "unquantized", "key scale": "", "bytes x fp16": 1.0,
             "perplexity": model.perplexity(ids, lambda layer, k, v: (k, v))}]
    rows[0]["x unquantized"] = "1.0000"
    print(rows[0], flush=True)
    exponents = [float(a) for a in filter(None, args.key_scale.split(","))]
    rms = key_rms(model, tokenizer.encode(CALIBRATION.read_text(), add_special_tokens=False)[:512]) if exponents else None
    for name in args.schemes.split(","):
        scheme = parse(name)
        for a in [None, *exponents]:
            t0 = time.perf_counter()
            scale = None
            if a is not None:
                scale = rms ** a
                scale = (scale / np.exp(np.log(scale).mean(-1, keepdims=True))).astype(np.float32)
            ppl = model.perplexity(ids, fake_quantizer(scheme, scale))
            row = {"kv scheme": scheme.name, "key scale": "" if a is None else f"rms^{a:g}",
                   "bytes x fp16": scheme.fp16_ratio(model.dim, model.dim), "perplexity": ppl,
                   "x unquantized": f"{ppl / rows[0]['perplexity']:.4f}", "seconds": time.perf_counter() - t0}
            rows.append(row)
            print(row, flush=True)
    notes = (f"Perplexity: the first {len(ids)} tokens of {args.text}, teacher-forced in 256-token chunks; a numpy "
             f"float32 forward with each token's keys and values fake-quantized as the scheme stores them. Key scales "
             f"calibrated on the first 512 tokens of {CALIBRATION}. Bytes x fp16 count 16-bit scales and biases. "
             f"Model: {folder}.")
    write_results(args.name or "kv_sweep-smollm2-135m", env, rows, COLUMNS, args.out, notes)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
