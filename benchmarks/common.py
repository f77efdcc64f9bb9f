"""What every benchmark shares: the models it runs, the environment it reports, its output."""

from __future__ import annotations

import json
import platform
import time
from importlib.metadata import version
from pathlib import Path

import mlx.core as mx

RESULTS = Path(__file__).parent / "results"

# Llama-3.1-8B's shape (random weights): what the GPU figures are measured on.
LLAMA_8B = dict(
    model_type="llama",
    hidden_size=4096,
    num_hidden_layers=32,
    intermediate_size=14336,
    num_attention_heads=32,
    num_key_value_heads=8,
    head_dim=128,
    rms_norm_eps=1e-5,
    vocab_size=128256,
    rope_theta=500000.0,
    tie_word_embeddings=False,
)


def environment() -> dict:
    """Device and versions, printed and stored with every figure."""
    info = {
        "device": str(mx.default_device()),
        "device_info": {k: str(v) for k, v in mx.device_info().items()},
        "platform": platform.platform(),
        "python": platform.python_version(),
        "mlx": version("mlx"),
        "mlx_lm": version("mlx-lm"),
        "date": time.strftime("%Y-%m-%d %H:%M:%S"),
    }
    return info


def load_bench_model(name: str, workdir: Path):
    """(model, tokenizer or None, spec) for `name`: "tiny" (CPU, float32) or "llama-8b-shape".

    "llama-8b-shape" builds Llama-3.1-8B's architecture with random weights,
    4-bit weights (group 64) and bf16 activations, in memory: no download.
    """
    from runtime.model import ModelCacheSpec

    if name == "tiny":
        from runtime.model import load_model
        from runtime.testing import make_tiny_model

        path = workdir / "tiny-llama"
        if not (path / "config.json").exists():
            make_tiny_model(path, "llama")
        return load_model(path)
    if name != "llama-8b-shape":
        raise SystemExit(f"unknown model {name!r}: use 'tiny' or 'llama-8b-shape'")
    import mlx.nn as nn
    from mlx_lm.models import llama

    path = workdir / "llama-8b-shape"
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(LLAMA_8B))
    mx.random.seed(0)
    model = llama.Model(llama.ModelArgs.from_dict(LLAMA_8B))
    model.set_dtype(mx.bfloat16)
    nn.quantize(model, group_size=64, bits=4)
    mx.eval(model.parameters())
    return model, None, ModelCacheSpec.from_model(model, path)


def write_results(name: str, env: dict, rows: list[dict], columns: list[str], out_dir: Path, notes: str = "") -> None:
    """Write `rows` as `<name>.json` and `<name>.md` (a markdown table) under `out_dir`; print the table."""
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / f"{name}.json").write_text(json.dumps({"environment": env, "rows": rows}, indent=2))
    lines = [
        f"# {name}",
        "",
        f"device: {env['device']} {env['device_info'].get('device_name', '')}; "
        f"mlx {env['mlx']}, mlx-lm {env['mlx_lm']}, python {env['python']}; {env['date']}",
        "",
        "| " + " | ".join(columns) + " |",
        "|" + "---|" * len(columns),
    ]
    for row in rows:
        lines.append("| " + " | ".join(_fmt(row.get(c, "")) for c in columns) + " |")
    if notes:
        lines += ["", notes]
    text = "\n".join(lines) + "\n"
    (out_dir / f"{name}.md").write_text(text)
    print(text, flush=True)


def _fmt(v):
    if isinstance(v, float):
        return f"{v:.3g}" if abs(v) < 100 else f"{v:.0f}"
    return str(v)


def timed(fn, *args):
    """(seconds, result) of fn(*args), with everything it returns evaluated."""
    mx.synchronize()
    t0 = time.perf_counter()
    out = fn(*args)
    mx.eval(out)
    mx.synchronize()
    return time.perf_counter() - t0, out
