"""What recording the compiled decode graphs ahead costs (`Engine.record_graphs`, `prepare.record_decode`),
and what a decode step at a batch size met for the first time costs with and without it.

    python -m benchmarks.record_cost --model llama-8b-shape

Three freshly loaded models in turn: the first pays the kernels' first use in this process (MLX-CUDA
compiles them per shape, once per process); on the second, the first and second decode steps at batch
sizes 3, 5 and 8 (each first step records its graphs); on the third, the seconds `record_decode` takes
for batch sizes 2 to --max-batch, then the same steps.

Then whether graphs recorded ahead cost the steps that use them: `--steps` decode steps at 5 rows
(host time to build and queue each, median) on models whose graphs were recorded at their first step,
recorded ahead for 1 to --max-batch rows, or ahead for 1 to 5 rows, each twice, in turn.
"""

from __future__ import annotations

import statistics
import tempfile
import time
from pathlib import Path

import mlx.core as mx
import mlx_lm

from benchmarks.common import bench_model_folder, bench_parser, environment
from runtime import attention
from runtime.model import ModelCacheSpec
from runtime.prepare import prepare_model, record_decode
from runtime.q4cache import extract_cache, merge_caches


def loaded(path: Path):
    """A freshly loaded, prepared model of the folder `path` (no graph recorded yet), and its cache spec."""
    model, _ = mlx_lm.load(str(path))
    prepare_model(model)
    return model, ModelCacheSpec.from_model(model, path)


def prefilled(model, spec, context: int):
    """One agent's cache after a prompt of `context` tokens, to batch copies of."""
    row = merge_caches(spec, [None])
    mx.eval(model(mx.arange(context)[None] % 1000 + 3, cache=row))
    return extract_cache(row, 0)


def first_steps(model, spec, context: int, sizes) -> dict:
    """Seconds of a first and a second decode step (build and wait) at each batch size of `sizes`, in order."""
    row = prefilled(model, spec, context)
    out = {}
    for rows in sizes:
        batch = merge_caches(spec, [row] * rows)
        times = []
        for _ in range(2):
            t0 = time.perf_counter()
            mx.eval(model(mx.arange(rows)[:, None] + 3, cache=batch))
            times.append(round(time.perf_counter() - t0, 4))
        out[rows] = times
    return out


def steady(model, spec, context: int, rows: int, steps: int) -> float:
    """Median ms to build and queue a decode step of `rows` rows (the step's evaluation waited for after)."""
    batch = merge_caches(spec, [prefilled(model, spec, context)] * rows)
    tokens = mx.arange(rows)[:, None] + 3
    times = []
    for _ in range(steps + 1):
        t0 = time.perf_counter()
        out = model(tokens, cache=batch)
        mx.async_eval(out)
        times.append(time.perf_counter() - t0)
        mx.eval(out)
    return statistics.median(times[1:]) * 1e3


def main(argv=None) -> int:
    ap = bench_parser(__doc__)
    ap.add_argument("--max-batch", type=int, default=16)
    ap.add_argument("--context", type=int, default=1024)
    ap.add_argument("--steps", type=int, default=300)
    args = ap.parse_args(argv)
    print(environment(), flush=True)
    attention.install()
    with tempfile.TemporaryDirectory() as tmp:
        path = bench_model_folder(args.model, Path(tmp))
        for label in ("kernels' first use", "not recorded", "recorded"):
            model, spec = loaded(path)
            first_steps(model, spec, args.context, [1])
            sizes = range(2, args.max_batch + 1)
            if label == "recorded":
                t0 = time.perf_counter()
                n = record_decode(model, sizes)
                print(f"record_decode: {n} blocks x sizes (two graphs each) for batch sizes 2..{args.max_batch} in "
                      f"{time.perf_counter() - t0:.3f} s", flush=True)
            steps = first_steps(model, spec, args.context, [3, 5, 8])
            print(f"{label}: first and second decode step (s) at batch sizes 3, 5, 8: {steps}", flush=True)
            del model
        for trial in range(2):
            for label, sizes in (("at first use", ()), (f"ahead, 1..{args.max_batch}", range(1, args.max_batch + 1)),
                                 ("ahead, 1..5", range(1, 6))):
                model, spec = loaded(path)
                record_decode(model, sizes)
                ms = steady(model, spec, args.context, 5, args.steps)
                print(f"steady, graphs recorded {label}: {ms:.3f} ms a step (host), 5 rows", flush=True)
                del model
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
