"""What every benchmark shares: the models it runs, the environment it reports, its output."""

from __future__ import annotations

import argparse
import csv
import faulthandler
import importlib.util
import io
import json
import os
import platform
import pstats
import tempfile
import time
from importlib.metadata import version
from pathlib import Path

import mlx.core as mx

# Default output: a fresh folder per run, so the tables the README quotes (benchmarks/results/)
# change only when a run is pointed there with --out.
RESULTS = Path("benchmark-runs") / time.strftime("%Y%m%d-%H%M%S")

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


def bench_parser(doc: str) -> argparse.ArgumentParser:
    """An argument parser with the options every model benchmark takes: --model, --out, --name. A crash in native
    code (MLX, CUDA) during the benchmark then prints every thread's Python stack (faulthandler)."""
    if not faulthandler.is_enabled():
        faulthandler.enable()
    ap = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="tiny", help="'tiny' (any machine) or 'llama-8b-shape' (GPU)")
    ap.add_argument("--out", type=Path, default=RESULTS, help="output folder for JSON, markdown and plots")
    ap.add_argument("--name", default=None, help="result file name (default: <benchmark>-<model>)")
    return ap


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


def bench_model_folder(name: str, workdir: Path) -> Path:
    """A real model folder for `name` under `workdir` (or $KVACTORS_BENCH_MODELS), built once.

    "tiny": the embedded tiny llama (float32, CPU). "llama-8b-shape": Llama-3.1-8B's
    architecture with random weights, 4-bit weights (group 64), bf16 activations and
    the local 2048-token tokenizer (so its vocabulary is 2048, not 128256). No download.
    Both are built as `runtime.model.build_once` builds the project's own folders: a build
    killed midway leaves nothing the next run takes for a model, and the next run builds again.
    """
    from runtime.model import COMPLETE_MARKER, build_once
    from runtime.tiny import make_tiny_model

    if name not in ("tiny", "llama-8b-shape"):
        raise SystemExit(f"unknown model {name!r}: use 'tiny' or 'llama-8b-shape'")
    path = Path(os.environ.get("KVACTORS_BENCH_MODELS") or workdir) / name  # reuse across scenarios
    if name == "tiny":  # make_tiny_model builds under build_once's lock itself
        return path if (path / COMPLETE_MARKER).exists() else make_tiny_model(path, "llama")
    return build_once(path, _write_8b_shape)


def _write_8b_shape(out: Path) -> None:
    """Write the "llama-8b-shape" folder `out` (see `bench_model_folder`) through `new_model_folder`, marked complete."""
    import mlx.nn as nn
    from mlx.utils import tree_flatten
    from mlx_lm.models import llama

    from runtime.model import COMPLETE_MARKER, new_model_folder
    from runtime.tiny import make_tiny_model

    with tempfile.TemporaryDirectory() as donor, new_model_folder(out) as tmp:
        tiny = make_tiny_model(Path(donor) / "tokenizer-donor", "llama")
        for f in ("tokenizer.json", "tokenizer_config.json"):
            (tmp / f).write_bytes((tiny / f).read_bytes())
        tiny_config = json.loads((tiny / "config.json").read_text())
        config = dict(LLAMA_8B, vocab_size=tiny_config["vocab_size"], eos_token_id=tiny_config.get("eos_token_id"),
                      quantization={"group_size": 64, "bits": 4})
        mx.random.seed(0)
        model = llama.Model(llama.ModelArgs.from_dict(config))
        model.set_dtype(mx.bfloat16)
        nn.quantize(model, group_size=64, bits=4)
        mx.eval(model.parameters())
        mx.save_safetensors(str(tmp / "model.safetensors"), dict(tree_flatten(model.parameters())))
        (tmp / "config.json").write_text(json.dumps(config))
        (tmp / COMPLETE_MARKER).write_text("")


def load_bench_model(name: str):
    """(model, tokenizer, spec) for `name` through `load_model`, its folder built in a temp folder.

    Also installs `runtime.attention` (benchmarks build batch caches without an Engine).

    See `bench_model_folder` ($KVACTORS_BENCH_MODELS keeps the folder for reuse).
    """
    from runtime import attention
    from runtime.model import load_model

    attention.install()  # benchmarks drive batch caches without an Engine too
    with tempfile.TemporaryDirectory() as tmp:
        return load_model(bench_model_folder(name, Path(tmp)))


DEVICE_TIMED = importlib.util.find_spec("cupti") is not None  # device_us traces kernels with CUPTI


def kernel_us(fn, reps: int = 50) -> float:
    """Microseconds per call of `fn`: `reps` independent calls evaluated together, after one
    warm-up call, with no sync per call (the device's throughput, not one call's latency)."""
    mx.eval(fn())
    mx.synchronize()
    t0 = time.perf_counter()
    mx.eval([fn() for _ in range(reps)])
    mx.synchronize()
    return (time.perf_counter() - t0) / reps * 1e6


def device_us(calls, reps: int = 40) -> float:
    """Microseconds per call, cycling through `calls` (one per input copy), after one warm-up round: the
    device's kernel time as CUPTI traces it where the cupti-python package is installed (`DEVICE_TIMED`),
    else the wall time of the calls queued together (which includes the host's launch work)."""
    mx.eval([c() for c in calls])
    mx.synchronize()

    def run():
        mx.eval([calls[i % len(calls)]() for i in range(reps)])
        mx.synchronize()

    if DEVICE_TIMED:
        return sum(e - s for _, s, e in traced_kernels(run)) / reps / 1e3
    t0 = time.perf_counter()
    run()
    return (time.perf_counter() - t0) / reps * 1e6


def traced_kernels(run) -> list[tuple[str, int, int]]:
    """(name, start ns, end ns) of every kernel the device ran for `run()` (which must wait for the device
    itself), in start order, as CUPTI traced them. CUDA and the `cupti-python` package only."""
    from cupti import cupti

    records = []

    def completed(activities):
        records.extend((a.name, a.start, a.end) for a in activities if a.kind == cupti.ActivityKind.CONCURRENT_KERNEL)

    cupti.activity_register_callbacks(lambda: (8 * 1024 * 1024, 0), completed)
    cupti.activity_enable(cupti.ActivityKind.CONCURRENT_KERNEL)
    try:
        run()
        cupti.activity_flush_all(1)
    finally:
        cupti.activity_disable(cupti.ActivityKind.CONCURRENT_KERNEL)
    return sorted(records, key=lambda r: r[1])


# Nsight Compute's units, to microseconds (times) and megabytes (sizes)
_NCU_SCALE = {"ns": 1e-3, "nsecond": 1e-3, "us": 1.0, "usecond": 1.0, "ms": 1e3, "msecond": 1e3,
              "byte": 1e-6, "Kbyte": 1e-3, "Mbyte": 1.0, "Gbyte": 1e3}


def ncu_records(stdout: str) -> list[tuple[dict, float]]:
    """The rows of Nsight Compute's `--csv` table in `stdout` (what it printed before the table skipped), each
    with its metric's value as a float: times in microseconds, sizes in megabytes, other units as printed,
    NaN where the value is empty."""
    return [(rec, float(rec["Metric Value"].replace(",", "") or "nan") * _NCU_SCALE.get(rec["Metric Unit"], 1.0))
            for rec in csv.DictReader(io.StringIO(stdout[stdout.index('"ID"'):]))]


def profile_text(prof, top: int, orders=("tottime",)) -> str:
    """cProfile profile `prof` as text: its `top` functions in each of `orders` (pstats' sort keys)."""
    text = io.StringIO()
    stats = pstats.Stats(prof, stream=text)
    for key in orders:
        stats.sort_stats(key).print_stats(top)
    return text.getvalue()


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


def ranked(values: list, q: float):
    """The value at rank `q` (0..1) of `values`, sorted ascending: the decode-step percentiles' one rule."""
    return values[min(len(values) - 1, int(len(values) * q))]


def timed(fn, *args):
    """(seconds, result) of fn(*args), with everything it returns evaluated."""
    mx.synchronize()
    t0 = time.perf_counter()
    out = fn(*args)
    mx.eval(out)
    mx.synchronize()
    return time.perf_counter() - t0, out


def _pyplot(path: Path):
    """matplotlib's pyplot (headless), or None with a message when it is not installed."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print(f"matplotlib is not installed (pip install 'kvactors[bench]'): no plot {path.name}")
        return None
    path.parent.mkdir(parents=True, exist_ok=True)
    return plt


def _save(plt, fig, path: Path) -> None:
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_lines(path: Path, curves: dict, xlabel: str, ylabel: str, title: str, x=None) -> None:
    """Save a line plot of `curves` (label -> y values, at `x` or 1..n) as a PNG; skipped without matplotlib."""
    plt = _pyplot(path)
    if plt is None:
        return
    fig, ax = plt.subplots(figsize=(7, 4))
    for label, ys in curves.items():
        ax.plot(x or range(1, len(ys) + 1), ys, marker="o", markersize=3, label=label)
    if x:
        ax.set_xscale("log", base=2)
    ax.set(xlabel=xlabel, ylabel=ylabel, title=title)
    ax.set_yscale("log")
    ax.grid(alpha=0.3)
    ax.legend()
    _save(plt, fig, path)


def plot_bars(path: Path, values: dict, ylabel: str, title: str) -> None:
    """Save a bar chart of `values` (label -> number) as a PNG; skipped without matplotlib."""
    plt = _pyplot(path)
    if plt is None:
        return
    fig, ax = plt.subplots(figsize=(max(7, 0.6 * len(values)), 4.5))
    ax.bar(list(values), list(values.values()))
    ax.set(ylabel=ylabel, title=title)
    plt.setp(ax.get_xticklabels(), rotation=35, ha="right", fontsize=8)
    ax.set_yscale("log")
    _save(plt, fig, path)
