"""Prefill and decode speed of the Q4 cache under each attention route, against fp16 KV.

At each context length C: the cache is filled to C - chunk tokens (untimed),
then one prefill chunk is timed (prefill tok/s at that context), then decode
steps at batch size 1 (decode tok/s). Each timed phase runs twice and the
second run counts (MLX-CUDA compiles kernels per shape on first use). Ratios
are against the fp16 KVCache of the same model in the same run. --schemes measures
each KV scheme (`runtime.kvscheme`) on each route: e.g. a scheme with and without
its rotation gives the rotation's cost (a small matmul on queries and outputs per
layer and step, and on new keys and values).

    python -m benchmarks.q4_attention                                  # CPU, tiny model
    python -m benchmarks.q4_attention --model llama-8b-shape --contexts 4096,16384   # GPU
    python -m benchmarks.q4_attention --schemes k6v4-g64,k6v4-g64-hadamard --routes quantized
"""

from __future__ import annotations

import sys

import mlx.core as mx
from mlx_lm.models.cache import KVCache

from benchmarks.common import bench_parser, environment, load_bench_model, plot_lines, timed, write_results
from runtime.q4cache import ROUTES, extract_cache, make_batch_cache, merge_caches

COLUMNS = ["context", "kv", "route", "prefill_tok_s", "prefill_x_fp16", "decode_tok_s", "decode_x_fp16", "cache_bytes",
           "bytes_x_fp16", "peak_gb"]
# cache_bytes: the cache before the timed chunk (context - chunk tokens); Q4 as extracted (used tokens only)


def measure(model, cache, chunk, decode_steps, vocab, row, batch=1):
    """Fill `row` with prefill tok/s of `chunk` on top of `cache` and decode tok/s, `batch` rows alike.

    Each phase runs twice and the second run counts; a phase that raises is
    recorded as failed (the quantized route crashes on CUDA decode).
    """
    rows = mx.broadcast_to(chunk[None], (batch, chunk.size))

    def prefill():
        dt, _ = timed(lambda: model(rows, cache=cache)[:, -1])
        for c in cache:
            c.trim(chunk.size)
        return batch * chunk.size / dt

    def decode():
        def run():
            t = mx.ones((batch, 1), dtype=mx.int32)
            for _ in range(decode_steps):
                t = mx.argmax(model(t, cache=cache)[:, -1], axis=-1)[:, None] % vocab
                mx.eval(t)
            return t

        dt, _ = timed(run)
        for c in cache:
            c.trim(decode_steps)
        return batch * decode_steps / dt

    mx.reset_peak_memory()
    for name, phase in (("prefill_tok_s", prefill), ("decode_tok_s", decode)):
        try:
            phase()
            row[name] = phase()
        except Exception as e:
            row[name] = f"failed: {type(e).__name__}: {str(e)[:70]}"
        if name == "prefill_tok_s":
            model(rows, cache=cache)
    row["peak_gb"] = mx.get_peak_memory() / 1e9


def _tiled(caches, batch):
    """The fp16 KVCaches with their one row repeated `batch` times (layer by layer, to bound memory)."""
    if batch > 1:
        for c in caches:
            c.keys, c.values = mx.concatenate([c.keys] * batch), mx.concatenate([c.values] * batch)
            mx.eval(c.keys, c.values)
    return caches


def bench_context(model, spec, context, chunk_size, decode_steps, routes, vocab, batch=1, dense=True, schemes=None):
    """Rows of dense KV (unless not `dense`) and of each scheme (default: the model's) on each route at `context`."""
    rows = []
    mx.random.seed(context)
    tokens = mx.random.randint(0, vocab, (context,))
    base, chunk = tokens[: context - chunk_size], tokens[context - chunk_size :]

    fp16 = [KVCache() for _ in range(spec.n_layers)]
    _fill(model, fp16, base, chunk_size)
    ref = dict(context=context, kv="dense", route="-", cache_bytes=sum(c.nbytes for c in fp16))
    if dense:
        measure(model, _tiled(fp16, batch), chunk, decode_steps, vocab, ref, batch)
        ref.update(prefill_x_fp16=1.0, decode_x_fp16=1.0, bytes_x_fp16=1.0)
        rows.append(ref)
    del fp16
    mx.clear_cache()  # each cache measured from an empty buffer cache (the dense one's ~50 GB at 32K x 8 rows had
    # left MLX's allocator releasing cached buffers on every allocation of the next: 178 against 590 tokens/s)

    for scheme in schemes or [spec.kv_scheme]:
        s = spec.with_scheme(scheme)
        filler = make_batch_cache(s, 1, "dequant_once")
        _fill(model, filler, base, chunk_size)
        q4 = extract_cache(filler, 0)
        q4_bytes = sum(c.nbytes for c in q4)
        del filler
        for route in routes:
            row = dict(context=context, kv=scheme.name, route=route, cache_bytes=q4_bytes,
                       bytes_x_fp16=q4_bytes / ref["cache_bytes"])
            cache = merge_caches(s, [q4] * batch, route)
            measure(model, cache, chunk, decode_steps, vocab, row, batch)
            del cache
            mx.clear_cache()
            for name in ("prefill", "decode"):
                if dense and isinstance(row[f"{name}_tok_s"], float):
                    row[f"{name}_x_fp16"] = row[f"{name}_tok_s"] / ref[f"{name}_tok_s"]
            rows.append(row)
            print(row, flush=True)
    return rows


def _fill(model, cache, tokens, chunk):
    for i in range(0, tokens.size, chunk):
        model(tokens[i : i + chunk][None], cache=cache)
        mx.eval([c.state for c in cache])


def main(argv=None) -> int:
    ap = bench_parser(__doc__)
    ap.add_argument("--contexts", default="512,2048,8192", help="comma-separated context lengths")
    ap.add_argument("--chunk", type=int, default=512, help="prefill chunk timed at each context (default 512)")
    ap.add_argument("--decode-steps", type=int, default=16)
    ap.add_argument("--routes", default=",".join(ROUTES), help="Q4 routes to measure")
    ap.add_argument("--batch", type=int, default=1, help="rows decoded together (each a copy of the cache)")
    ap.add_argument("--no-dense", action="store_true",
                    help="skip the fp16 KVCache rows (for contexts whose fp16 cache would not fit)")
    ap.add_argument("--schemes", default="", help="KV scheme names to measure (default: the model's)")
    args = ap.parse_args(argv)
    from runtime.kvscheme import parse

    schemes = list(dict.fromkeys(parse(n) for n in args.schemes.split(",") if n))  # one curve each
    env = environment()
    print(env, flush=True)
    model, _, spec = load_bench_model(args.model)
    vocab = model.args.vocab_size
    rows = []
    for context in [int(c) for c in args.contexts.split(",")]:
        chunk = min(args.chunk, context // 2)
        rows += bench_context(model, spec, context, chunk, args.decode_steps, args.routes.split(","), vocab, args.batch,
                              dense=not args.no_dense, schemes=schemes)
    name = args.name or f"q4_attention-{args.model}"
    contexts = sorted({r["context"] for r in rows})
    curves = {}
    for kv, route in dict.fromkeys((r["kv"], r["route"]) for r in rows):
        speeds = [r["decode_tok_s"] for r in rows if (r["kv"], r["route"]) == (kv, route)]
        if all(isinstance(s, float) for s in speeds):
            curves[f"{kv} {route}".replace(" -", "")] = speeds
    plot_lines(args.out / f"{name}.png", curves, "context (tokens)", f"decode tokens/s (batch {args.batch})",
               f"decode speed, fp16 KV vs Q4 routes, {args.model}", x=contexts)
    write_results(name, env, rows, COLUMNS, args.out,
                  notes=f"model {args.model}; prefill = one {args.chunk}-token chunk at the context; batch {args.batch} "
                        f"(rows alike; tok/s count every row); peak_gb = MLX's peak memory while the row was measured "
                        f"(model, cache, activations); "
                        f"'dense' is mlx-lm's KVCache in the model's activation dtype ({spec.dtype}).")
    return 0


if __name__ == "__main__":
    sys.exit(main())
