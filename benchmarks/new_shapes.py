"""What a prefill chunk pays the first time it meets a cache width, and why.

In the multi-agent workload on an H100 nearly every hot chunk met its (rows,
tokens, width) for the first time (a round's turns grow the caches by 256
columns) and took 2-4x a repeated one. This splits that cost:

- chunk: a hot chunk of --tokens after each of --contexts (new widths, in
  order), then the same chunk again at that width (repeated: nothing new);
- decode: a decode step of --rows rows merged at each of --contexts (a new
  batch width each), then more steps at that width;
- allocation: an elementwise op whose output is a new size (about a
  chunk's attention scores) against the same size again (MLX's buffer cache
  reuses a freed buffer only of about the same size);
- matmul: attention's score product at a new key width against a repeated one,
  with outputs of the same size (a fresh buffer each, from the cache).

Every row is the median over the contexts. Run it under MLX's settings to
compare (each variable is read once per process), e.g. MLX_USE_CUDA_GRAPHS=0,
or with --pool (CUDA): MLX's buffer cache off and CUDA's default memory pool
told to keep freed memory, so that a buffer of any size comes from memory the
process already holds.

    python -m benchmarks.new_shapes --model llama-8b-shape            # GPU
"""

from __future__ import annotations

import os
import statistics
import time

import mlx.core as mx

from benchmarks.anatomy import step
from benchmarks.common import bench_parser, environment, load_bench_model, write_results
from benchmarks.hot_chunk import chunk_runner
from benchmarks.profile import prefilled
from runtime.q4cache import merge_caches, route_for

COLUMNS = ["piece", "first_ms", "repeated_ms", "extra_ms", "note"]


def seconds(fn) -> float:
    mx.synchronize()
    t0 = time.perf_counter()
    mx.eval(fn())
    mx.synchronize()
    return time.perf_counter() - t0


def keep_pool() -> None:
    """MLX's buffer cache off, and the device's default memory pool (which MLX allocates from) keeping the
    memory freed into it instead of returning it at each synchronization (CUDA driver API, through ctypes)."""
    import ctypes

    cuda = ctypes.CDLL("libcuda.so.1")
    pool = ctypes.c_void_p()
    assert cuda.cuDeviceGetDefaultMemPool(ctypes.byref(pool), 0) == 0
    keep = ctypes.c_uint64(2**64 - 1)
    assert cuda.cuMemPoolSetAttribute(pool, 4, ctypes.byref(keep)) == 0  # CU_MEMPOOL_ATTR_RELEASE_THRESHOLD
    mx.set_cache_limit(0)


def main(argv=None) -> int:
    ap = bench_parser(__doc__)
    ap.add_argument("--contexts", default="2304,2560,2816,3072,3328",
                    help="agent cache lengths, each a new width (default: %(default)s)")
    ap.add_argument("--tokens", type=int, default=256, help="tokens in the chunk (default: %(default)s)")
    ap.add_argument("--rows", type=int, default=5, help="rows of the decode batches (default: %(default)s)")
    ap.add_argument("--pool", action="store_true", help="allocate from CUDA's memory pool, not MLX's cache (CUDA)")
    args = ap.parse_args(argv)
    if args.pool:
        mx.zeros(1).item()  # the device set up first
        keep_pool()
    env = environment()
    print(env, flush=True)
    model, _, spec = load_bench_model(args.model)
    route = route_for(spec, None)
    contexts = [int(c) for c in args.contexts.split(",")]
    agents = {c: prefilled(model, spec, "dequant", c, seed=c) for c in contexts}
    tokens = mx.random.randint(3, model.args.vocab_size, (args.tokens,))
    warm = prefilled(model, spec, "dequant", 1024, seed=7)  # the chunk's kernels set up once, at another width
    chunk_runner(model, spec, route, warm, tokens)()
    rows, first, again = [], [], []
    for c in contexts:
        run = chunk_runner(model, spec, route, agents[c], tokens)
        first.append(run())
        again.append(statistics.median(run() for _ in range(3)))

    def add(piece, a, b, note=""):
        a, b = statistics.median(a) * 1e3, statistics.median(b) * 1e3
        rows.append(dict(piece=piece, first_ms=round(a, 2), repeated_ms=round(b, 2), extra_ms=round(a - b, 2),
                         note=note))
        print(rows[-1], flush=True)

    add("chunk", first, again, f"{args.tokens} tokens after {args.contexts}")
    first, again = [], []
    for c in contexts:
        batch = merge_caches(spec, [agents[c]] * args.rows, route)
        feed = mx.zeros((args.rows, 1), dtype=mx.int32)
        mx.eval([layer.state for layer in batch])  # the merge's copies before the first step, not in it
        first.append(seconds(lambda: step(model, batch, feed)))
        again.append(statistics.median(seconds(lambda: step(model, batch, feed)) for _ in range(3)))
    add("decode", first, again, f"{args.rows} rows after {args.contexts}, a batch merged at each")
    heads, group = 32, 4  # the 8B shape: 32 query heads over 8 kv heads
    first, again = [], []
    for c in contexts:
        x = mx.zeros((heads, args.tokens, c + 1), dtype=mx.float32)
        mx.eval(x)
        first.append(seconds(lambda: x + 1))
        again.append(statistics.median(seconds(lambda: x + 1) for _ in range(3)))
    add("allocation", first, again, "x + 1 over (32, tokens, width + 1) float32: a new output size, then the same")
    first, again = [], []
    for c in contexts:
        q = mx.random.normal((8, group * args.tokens, 128)).astype(mx.bfloat16)
        k = mx.random.normal((8, 128, c + 1)).astype(mx.bfloat16)
        mx.eval(q, k)
        first.append(seconds(lambda: q @ k))
        again.append(statistics.median(seconds(lambda: q @ k) for _ in range(3)))
    add("matmul", first, again, "(8, 4 x tokens, 128) @ (8, 128, width + 1) bf16")
    settings = {k: v for k, v in os.environ.items() if k.startswith("MLX_")}
    write_results(args.name or f"new_shapes-{args.model}", env, rows, COLUMNS, args.out,
                  notes=f"medians over {len(contexts)} widths; first: the first call at that width; repeated: the "
                        f"median of 3 more. MLX settings: {settings or 'defaults'}"
                        f"{'; memory pool kept, MLX cache off (--pool)' if args.pool else ''}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
