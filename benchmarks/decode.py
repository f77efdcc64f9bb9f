"""Decode steps on CUDA: the 4-bit GEMV kernel, batch invariance, and where a step's time goes.

Four parts, in one run:
- kernel: `qgemv` against MLX's `quantized_matmul` (2-D and 3-D inputs) on the
  8B shape's matrices, 1 to 16 rows: max error against a float32 reference, and
  microseconds per call;
- kernel invariance: row 0 of a 1..16-row call is bitwise equal to the 1-row call;
- model invariance: one row's logits decoded at batch 1, 2, 4, 8, 16 (the other
  rows hold other tokens, of the same length and of unequal lengths), bitwise
  compared with batch 1, with the model as mlx-lm loads it and as the engine
  prepares it;
- step time: a whole decode step at batch 1..16 for the model as loaded, with
  flattened linears only, and prepared (flattened + GEMV), split into building
  the graph (Python) and running it.

    python -m benchmarks.decode --model llama-8b-shape        # a CUDA GPU
"""

from __future__ import annotations

import statistics
import sys
import time

import mlx.core as mx

from benchmarks.common import bench_parser, environment, kernel_us, write_results
from runtime import attention, prepare, qgemv
from benchmarks.profile import prefilled
from runtime.q4cache import merge_caches

COLUMNS = ["part", "variant", "shape", "rows", "value", "unit", "note"]
BATCHES = (1, 2, 4, 5, 8, 16)


def kernel_rows(add):
    """Correctness, invariance and speed of qgemv on the 8B shape's matrices."""
    mx.random.seed(0)
    for n, k in ((4096, 4096), (1024, 4096), (14336, 4096), (4096, 14336)):
        w = (mx.random.normal((n, k)) * 0.02).astype(mx.bfloat16)
        wq, scales, biases = mx.quantize(w, group_size=64, bits=4)
        x = mx.random.normal((16, k)).astype(mx.bfloat16)
        ref = x.astype(mx.float32) @ mx.dequantize(wq, scales, biases, group_size=64, bits=4).astype(mx.float32).T
        solo = qgemv.qgemv(x[:1], wq, scales, biases, 64)
        for m in (1, 2, 4, 5, 8, 16):
            y = qgemv.qgemv(x[:m], wq, scales, biases, 64)
            err = mx.abs(y.astype(mx.float32) - ref[:m]).max().item() / mx.abs(ref[:m]).max().item()
            mlx_err = mx.abs(mx.quantized_matmul(x[:m], wq, scales, biases, group_size=64, bits=4)
                             .astype(mx.float32) - ref[:m]).max().item() / mx.abs(ref[:m]).max().item()
            same = mx.array_equal(y[:1], solo).item()
            add(part="kernel", variant="qgemv", shape=f"{n}x{k}", rows=m, value=err, unit="rel max err",
                note=f"MLX's own: {mlx_err:.2e}; row 0 bitwise equal to 1-row call: {same}")
            xs = x[:m]
            add(part="kernel time", variant="qgemv", shape=f"{n}x{k}", rows=m,
                value=kernel_us(lambda: qgemv.qgemv(xs, wq, scales, biases, 64)), unit="us")
            add(part="kernel time", variant="mlx 2-D", shape=f"{n}x{k}", rows=m,
                value=kernel_us(lambda: mx.quantized_matmul(xs, wq, scales, biases, group_size=64, bits=4)), unit="us")
            x3 = xs[:, None, :]
            add(part="kernel time", variant="mlx 3-D", shape=f"{n}x{k}", rows=m,
                value=kernel_us(lambda: mx.quantized_matmul(x3, wq, scales, biases, group_size=64, bits=4)), unit="us")


def attention_rows(add):
    """q4sdpa against a float32 reference per row, and row 0 bitwise alone vs in a padded batch."""
    from runtime import q4sdpa

    mx.random.seed(3)
    B, Hq, Hkv, D, W = 5, 32, 8, 128, 4096 + 257
    starts = [0, 100, 700, 1500, 3000]
    end = 4096 + 100
    k = (mx.random.normal((B, Hkv, W, D)) * 2).astype(mx.bfloat16)
    v = mx.random.normal((B, Hkv, W, D)).astype(mx.bfloat16)
    q = mx.random.normal((B, Hq, 1, D)).astype(mx.bfloat16)
    kq = tuple(mx.quantize(k, group_size=64, bits=4))
    vq = tuple(mx.quantize(v, group_size=64, bits=4))
    start = mx.array(starts, dtype=mx.int32)
    out = q4sdpa.q4_decode_sdpa(q, kq, vq, start, end, D ** -0.5, 64)
    kd = mx.dequantize(*kq, group_size=64, bits=4).astype(mx.float32)
    vd = mx.dequantize(*vq, group_size=64, bits=4).astype(mx.float32)
    worst = 0.0
    for b, s in enumerate(starts):
        ref = mx.fast.scaled_dot_product_attention(q[b : b + 1].astype(mx.float32), kd[b : b + 1, :, s:end],
                                                   vd[b : b + 1, :, s:end], scale=D ** -0.5)
        worst = max(worst, mx.abs(out[b : b + 1].astype(mx.float32) - ref).max().item())
    # row 3 alone, unpadded: its own columns moved to the front of a buffer of its own
    own = tuple(mx.contiguous(x[3:4, :, starts[3]:, :]) for x in kq), tuple(mx.contiguous(x[3:4, :, starts[3]:, :]) for x in vq)
    alone = q4sdpa.q4_decode_sdpa(q[3:4], own[0], own[1], mx.array([0], dtype=mx.int32), end - starts[3], D ** -0.5, 64)
    same = mx.array_equal(alone, out[3:4]).item()
    add(part="attention kernel", variant="q4sdpa", shape=f"B{B} Hq{Hq} Hkv{Hkv} D{D} end {end}", rows=B, value=worst,
        unit="max abs err vs f32", note=f"padded row bitwise equal to the row alone: {same}")
    for b_rows in (1, 5, 8, 16):
        qs = mx.concatenate([q] * 4)[:b_rows]
        ks_ = tuple(mx.concatenate([x] * 4)[:b_rows] for x in kq)
        vs_ = tuple(mx.concatenate([x] * 4)[:b_rows] for x in vq)
        st = mx.concatenate([start] * 4)[:b_rows]
        add(part="attention time", variant="q4sdpa", shape=f"end {end}", rows=b_rows,
            value=kernel_us(lambda: q4sdpa.q4_decode_sdpa(qs, ks_, vs_, st, end, D ** -0.5, 64), 20), unit="us")
        kd_ = mx.concatenate([kd.astype(mx.bfloat16)] * 4)[:b_rows, :, :end]
        vd_ = mx.concatenate([vd.astype(mx.bfloat16)] * 4)[:b_rows, :, :end]
        add(part="attention time", variant="mlx fused, 16-bit, no mask", shape=f"end {end}", rows=b_rows,
            value=kernel_us(lambda: mx.fast.scaled_dot_product_attention(qs, kd_, vd_, scale=D ** -0.5), 20), unit="us")


def row_logits(model, spec, caches, tokens, route):
    batch = merge_caches(spec, caches, route)
    out = model(mx.array(tokens)[:, None], cache=batch)[:, -1].astype(mx.float32)
    mx.eval(out)
    return out


def invariance_rows(add, model, spec, variant, same, unequal, route):
    """Row 0's logits at batch 1..16 against batch 1, bitwise."""
    variant = f"{variant}, {route}"
    solo = row_logits(model, spec, same[:1], [5], route)
    for label, pool in (("same length", same), ("unequal lengths", unequal)):
        for b in (2, 4, 8, 16):
            caches = [same[0]] + [pool[i % len(pool)] for i in range(1, b)]
            out = row_logits(model, spec, caches, [5] + [7 + i for i in range(1, b)], route)
            diff = mx.abs(out[0] - solo[0]).max().item()
            add(part="model invariance", variant=variant, shape=label, rows=b, value=diff, unit="max |logit diff|",
                note="bitwise equal" if diff == 0 and mx.array_equal(out[0], solo[0]).item() else "differs")


def step_rows(add, model, spec, variant, pool, route, steps=24):
    """Median decode step at each batch size, split into graph building and the rest.

    The rows are taken from `pool` in turn (one cache: equal lengths)."""
    variant = f"{variant}, {route}, {'equal' if len(pool) == 1 else 'unequal'} lengths"
    for b in BATCHES:
        batch = merge_caches(spec, [pool[i % len(pool)] for i in range(b)], route)
        tokens = mx.zeros((b, 1), dtype=mx.int32)
        build, total = [], []
        for i in range(steps):
            mx.synchronize()
            t0 = time.perf_counter()
            logits = model(tokens, cache=batch)
            tokens = mx.argmax(logits[:, -1], axis=-1)[:, None]
            t1 = time.perf_counter()
            mx.eval(tokens, [c.state for c in batch])
            t2 = time.perf_counter()
            if i >= 4:
                build.append(t1 - t0)
                total.append(t2 - t0)
        add(part="decode step", variant=variant, shape=f"ctx {pool[0][0].offset}", rows=b,
            value=statistics.median(total) * 1e3, unit="ms",
            note=f"graph build {statistics.median(build) * 1e3:.2f} ms; p99-ish max {max(total) * 1e3:.1f} ms")


def main(argv=None) -> int:
    ap = bench_parser(__doc__)
    ap.add_argument("--context", type=int, default=1024)
    ap.add_argument("--skip-kernel", action="store_true", help="leave out the kernel parts")
    ap.add_argument("--skip-steps", action="store_true", help="leave out the step times (invariance only)")
    args = ap.parse_args(argv)
    attention.install()  # batch caches without an Engine
    env = environment()
    print(env, flush=True)
    if not qgemv.available():
        raise SystemExit("this benchmark needs a CUDA GPU (the kernel is CUDA-only)")
    rows = []

    def add(**row):
        rows.append(row)
        print(row, flush=True)

    if not args.skip_kernel:
        kernel_rows(add)
    attention_rows(add)
    from benchmarks.common import bench_model_folder
    import tempfile
    from pathlib import Path
    import mlx_lm
    from runtime.model import ModelCacheSpec

    with tempfile.TemporaryDirectory() as tmp:
        path = bench_model_folder(args.model, Path(tmp))
        model, _ = mlx_lm.load(str(path))
        spec = ModelCacheSpec.from_model(model, path)
    base = prefilled(model, spec, "dequant", args.context, seed=1)
    same = [base] + [prefilled(model, spec, "dequant", args.context, seed=10 + i) for i in range(3)]
    unequal = [base] + [prefilled(model, spec, "dequant", args.context + 40 * i, seed=20 + i) for i in range(1, 4)]
    invariance_rows(add, model, spec, "as loaded", same, unequal, "dequant_once")
    if not args.skip_steps:
        step_rows(add, model, spec, "as loaded", [base], "dequant_once")
    prepare.prepare_model(model)
    for route in ("dequant_once", "q4kernel"):
        invariance_rows(add, model, spec, "prepared", same, unequal, route)
        for pool in ([base], unequal) if not args.skip_steps else ():
            step_rows(add, model, spec, "prepared", pool, route)
    name = args.name or f"decode-{args.model}"
    write_results(name, env, rows, COLUMNS, args.out,
                  notes="kernel: the 8B shape's matrices (N x K), 4-bit g64, bf16 x; error relative to the largest "
                        "|output| of a float32 reference. step: median of 20 steps after 4 warm-up steps at each "
                        "batch size, rows of equal length; graph build = Python time to build the step's graph.")
    return 0


if __name__ == "__main__":
    sys.exit(main())
