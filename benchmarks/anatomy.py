"""Anatomy of one decode step: how many primitives it has, and what each costs the host.

A decode step on the GPU is host-bound when building and launching its graph
takes longer than running it. This benchmark says where the host time goes:

- census: the primitives of one engine decode step (model + sampling + cache
  update), counted by type from MLX's graph (`mx.export_to_dot`), at batch 1 and 8;
- split: per step, milliseconds to build the graph in Python, to launch it
  (`mx.async_eval`: MLX walks the graph and encodes every kernel), and to wait for
  the device; median of 20 steps after 4, rows of equal length at --context;
- pipelined: milliseconds per step when steps are queued as the engine queues them
  (the next step is built and launched before the current one's tokens are read):
  max(host, device) if the overlap is perfect;
- host profile (--host-profile): Python's profile of building and launching 20 steps at
  the largest batch, the functions with the most own time, written beside the results;
- device profile (--device-profile, CUDA, needs the `cupti-python` package): every kernel
  of 20 queued steps at the largest batch, traced by CUPTI; per step, the device's span
  (first kernel's start to last kernel's end), its busy time, and each kernel's count and
  time, written beside the results;
- per-op: host microseconds per primitive for chains of one op type (a reshape, an
  elementwise add, a slice, MLX's quantized matmul and, on CUDA, our GEMV kernel, at 8 rows),
  built and launched.

    python -m benchmarks.anatomy --model llama-8b-shape      # GPU
"""

from __future__ import annotations

import collections
import os
import re
import statistics
import tempfile
import time
from pathlib import Path

import mlx.core as mx

from benchmarks.common import bench_parser, environment, load_bench_model, profile_text, traced_kernels, write_results
from benchmarks.profile import prefilled
from runtime import qgemv
from runtime.q4cache import merge_caches, route_for

COLUMNS = ["part", "what", "batch", "value", "unit", "note"]
_LABEL = re.compile(r'label ="([^"]+)", shape=rectangle')


def census(*outputs) -> collections.Counter:
    """Primitives in the (unevaluated) graph of `outputs`, by type."""
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "graph.dot"
        mx.export_to_dot(str(path), *outputs)
        return collections.Counter(_LABEL.findall(path.read_text()))


def step(model, batch, tokens):
    """One engine-style decode step: the sampled tokens and the cache state, lazy."""
    logits = model(tokens, cache=batch)
    return mx.argmax(logits[:, -1, :], axis=-1), [c.state for c in batch]


def split(model, spec, cache, route, b, steps=24):
    """Median (build, launch, wait) milliseconds of decode steps at batch `b`."""
    batch = merge_caches(spec, [cache] * b, route)
    tokens = mx.zeros((b, 1), dtype=mx.int32)
    parts = []
    for i in range(steps):
        mx.synchronize()
        t0 = time.perf_counter()
        picks, state = step(model, batch, tokens)
        t1 = time.perf_counter()
        mx.async_eval(picks, state)
        t2 = time.perf_counter()
        mx.eval(picks)
        mx.synchronize()
        t3 = time.perf_counter()
        tokens = picks[:, None]
        if i >= 4:
            parts.append((t1 - t0, t2 - t1, t3 - t2))
    return [statistics.median(p[k] for p in parts) * 1e3 for k in range(3)]


def pipelined(model, spec, cache, route, b, steps=40):
    """Mean milliseconds per decode step at batch `b`, queued as `Engine._decode_step` queues them."""
    batch = merge_caches(spec, [cache] * b, route)
    current = step(model, batch, mx.zeros((b, 1), dtype=mx.int32))[0]
    mx.async_eval(current, [c.state for c in batch])
    for i in range(steps + 4):
        if i == 4:
            t0 = time.perf_counter()
        nxt, state = step(model, batch, current[:, None])
        mx.async_eval(nxt, state)
        current.tolist()
        current = nxt
    mx.eval(current)
    return (time.perf_counter() - t0) / steps * 1e3


def host_profile(model, spec, cache, route, b, path, steps=20, top=30) -> None:
    """Write to `path` cProfile's functions with the most own time over `steps` decode steps built and launched."""
    import cProfile

    batch = merge_caches(spec, [cache] * b, route)
    tokens = mx.zeros((b, 1), dtype=mx.int32)
    mx.eval(step(model, batch, tokens))
    prof = cProfile.Profile()
    for _ in range(steps):
        prof.enable()
        picks, state = step(model, batch, tokens)
        mx.async_eval(picks, state)
        prof.disable()
        mx.eval(picks)
    Path(path).write_text(f"{steps} decode steps at batch {b}, built and launched (mx.async_eval: the launch)\n"
                          + profile_text(prof, top))


def _kernel_name(raw: str) -> str:
    """A kernel's name without its C++ decoration and template arguments."""
    m = re.search(r"custom_kernel_(kvactors_[a-z0-9_]*?)(?=_(?:[0-9]|bfloat|float|half|_)|[^a-z0-9_]|$)", raw)
    if m:
        return m.group(1)
    if raw.startswith("_ZN"):  # mangled: the innermost name of the nested name
        names, i = [], 3
        while (m := re.match(r"(\d+)", raw[i:])) is not None:
            n, i = int(m.group(1)), i + len(m.group(1))
            names.append(raw[i : i + n])
            i += n
        if names:
            return names[-1]
    return raw[:60]


def device_profile(model, spec, cache, route, b, path, steps=20) -> None:
    """Write to `path` where the device's time goes over `steps` decode steps queued as the engine queues them."""
    batch = merge_caches(spec, [cache] * b, route)
    current = step(model, batch, mx.zeros((b, 1), dtype=mx.int32))[0]
    mx.eval(current, [c.state for c in batch])
    for _ in range(4):
        current = step(model, batch, current[:, None])[0]
        mx.eval(current)

    def run():
        nonlocal current
        for _ in range(steps):
            nxt, state = step(model, batch, current[:, None])
            mx.async_eval(nxt, state)
            current.tolist()
            current = nxt
        mx.eval(current)
        mx.synchronize()

    records = traced_kernels(run)
    text = kernel_table(records, steps, f"{steps} decode steps at batch {b}, queued like the engine", "step")
    Path(path).write_text(text)
    print("\n".join(text.splitlines()[:12]), flush=True)


def kernel_table(records, n: int, title: str, unit: str) -> str:
    """A markdown summary of CUPTI kernel `records` (`common.traced_kernels`) spread over `n` `unit`s:
    device span and busy time per unit, then every kernel by name, the costliest first."""
    span = (records[-1][2] - records[0][1]) / 1e6 if records else 0.0
    busy, end = 0.0, 0
    for _, start, stop in records:  # merged intervals: overlapping kernels count once
        busy += max(0, stop - max(start, end)) / 1e6
        end = max(end, stop)
    by_name = collections.defaultdict(list)
    for name, start, stop in records:
        by_name[_kernel_name(name)].append((stop - start) / 1e3)
    lines = [f"{title}; CUPTI kernel records: {len(records)}",
             f"per {unit}: device span {span / n:.3f} ms, busy {busy / n:.3f} ms "
             f"(idle between kernels {(span - busy) / n:.3f} ms), kernels {len(records) / n:.1f}", "",
             f"| kernel | per {unit} | us per {unit} | us each (median) |", "|---|---|---|---|"]
    for name, times in sorted(by_name.items(), key=lambda kv: -sum(kv[1])):
        lines.append(f"| {name} | {len(times) / n:.1f} | {sum(times) / n:.1f} | {statistics.median(times):.2f} |")
    return "\n".join(lines) + "\n"


def op_cost(make, n=400, reps=5):
    """Host microseconds per op (build, launch) for a chain of `n` ops `make(y) -> y`."""
    x = mx.ones((8, 4096), dtype=mx.bfloat16)
    mx.eval(x)
    best = None
    for _ in range(reps):
        y = x
        t0 = time.perf_counter()
        for _ in range(n):
            y = make(y)
        t1 = time.perf_counter()
        mx.async_eval(y)
        t2 = time.perf_counter()
        mx.eval(y)
        mx.synchronize()
        cost = ((t1 - t0) / n * 1e6, (t2 - t1) / n * 1e6)
        best = cost if best is None or sum(cost) < sum(best) else best
    return best


def op_rows(add):
    w, s, b = mx.quantize(mx.random.normal((4096, 4096)).astype(mx.bfloat16), 64, 4)
    one = mx.array(1.0, dtype=mx.bfloat16)
    mx.eval(w, s, b, one)
    kinds = {
        "reshape (no copy)": lambda y: y.reshape(-1, 4096) if y.ndim == 3 else y.reshape(8, 1, 4096),
        "add (elementwise)": lambda y: y + one,
        "slice (view)": lambda y: y[:, 1:],
        "quantized matmul, 8 rows": lambda y: mx.quantized_matmul(y, w, s, b, transpose=True, group_size=64, bits=4),
    }
    if qgemv.available():  # a custom kernel's call builds its launch from Python arguments every time
        kinds["our GEMV kernel, 8 rows"] = lambda y: qgemv.qgemv(y, w, s, b, 64)
    for name, make in kinds.items():
        build, launch = op_cost(make)
        add(part="per op", what=name, batch=8, value=round(build + launch, 2), unit="us",
            note=f"build {build:.2f} us + launch {launch:.2f} us")


def _cuda_env() -> str:
    """The MLX-CUDA settings in force (graph batching), as a note."""
    keys = ("MLX_USE_CUDA_GRAPHS", "MLX_MAX_OPS_PER_BUFFER", "MLX_MAX_MB_PER_BUFFER", "MLX_CUDA_GRAPH_CACHE_SIZE")
    set_ = [f"{k}={os.environ[k]}" for k in keys if k in os.environ]
    return "MLX settings: " + (", ".join(set_) if set_ else "defaults")


def main(argv=None) -> int:
    ap = bench_parser(__doc__)
    ap.add_argument("--context", type=int, default=1024, help="tokens in each row's cache (default: %(default)s)")
    ap.add_argument("--batches", default="1,8", help="batch sizes (default: %(default)s)")
    ap.add_argument("--host-profile", action="store_true",
                    help="also write Python's profile of 20 steps at the largest batch (<name>-host-profile.txt)")
    ap.add_argument("--device-profile", action="store_true",
                    help="also write a CUPTI trace summary of 20 steps at the largest batch (<name>-device-profile.md; "
                         "CUDA and the cupti-python package only)")
    args = ap.parse_args(argv)
    env = environment()
    print(env, flush=True)
    model, _, spec = load_bench_model(args.model)
    route = route_for(spec, None)
    cache = prefilled(model, spec, "dequant", args.context, seed=1)
    rows = []

    def add(**row):
        rows.append(row)
        print(row, flush=True)

    for b in [int(x) for x in args.batches.split(",")]:
        batch = merge_caches(spec, [cache] * b, route)
        for _ in range(2):  # past the first step's growth of the allocation: the steady state
            mx.eval(step(model, batch, mx.zeros((b, 1), dtype=mx.int32)))
        counts = census(*step(model, batch, mx.zeros((b, 1), dtype=mx.int32)))
        top = ", ".join(f"{k} {v}" for k, v in counts.most_common(12))
        add(part="census", what="primitives per step", batch=b, value=sum(counts.values()), unit="count", note=top)
        build, launch, wait = split(model, spec, cache, route, b)
        add(part="split", what="build graph (Python)", batch=b, value=round(build, 2), unit="ms")
        add(part="split", what="launch (async_eval)", batch=b, value=round(launch, 2), unit="ms")
        add(part="split", what="wait for the device", batch=b, value=round(wait, 2), unit="ms")
        add(part="split", what="per primitive, build + launch", batch=b,
            value=round((build + launch) * 1e3 / sum(counts.values()), 2), unit="us")
        add(part="pipelined", what="step, queued like the engine", batch=b,
            value=round(pipelined(model, spec, cache, route, b), 2), unit="ms")
    op_rows(add)
    name = args.name or f"anatomy-{args.model}"
    largest = max(int(x) for x in args.batches.split(","))
    if args.host_profile:
        Path(args.out).mkdir(parents=True, exist_ok=True)
        host_profile(model, spec, cache, route, largest, Path(args.out) / f"{name}-host-profile.txt")
    if args.device_profile:
        Path(args.out).mkdir(parents=True, exist_ok=True)
        device_profile(model, spec, cache, route, largest, Path(args.out) / f"{name}-device-profile.md")
    write_results(name, env, rows, COLUMNS, args.out,
                  notes=f"route {route}, KV scheme {spec.kv_scheme.name}, context {args.context}; split: median of "
                        f"20 steps after 4, device synchronized around each step; pipelined: mean of 40 steps after "
                        f"4. {_cuda_env()}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
