"""Attention of a short prefill chunk over the packed cache, one layer: the kernel against the route before it.

A hot turn's chunk (64 to 448 queries a row, after a history) used to attend by
dequantizing the whole packed cache of the layer to 16 bits and running plain
attention (matmul, mask, softmax, matmul: `runtime.attention.plain_sdpa`) over the
allocated width; on CUDA it now runs `q4sdpa.q4_decode_sdpa` on the packed cache.
Both under the default scheme (6-bit keys, 4-bit values, group 64, rotated), 8B
shape (32 query heads, 8 kv heads, head dim 128), per layer call:

    python -m benchmarks.prefill_attention --contexts 1024,4096,16384 --queries 64,256,448 --rows 1,5
"""

from __future__ import annotations

import mlx.core as mx

from benchmarks.common import bench_parser, device_us, environment, write_results
from benchmarks.q4sdpa_tune import D, GROUP, HQ, HKV
from runtime import attention, q4sdpa
from runtime.kvscheme import parse
from runtime.q4cache import DENSE_EXTRA, STEP, _working_copy

COLUMNS = ["context", "queries", "rows", "route", "us", "x_before"]
SCHEME = parse("k6v4-g64-hadamard")


def cases(context: int, queries: int, rows: int):
    """(label, call) of the two routes for `rows` rows of `context` tokens, the last `queries` of them new."""
    width = -(-context // STEP) * STEP
    shape = (rows, HKV, width, D)
    k = mx.random.normal(shape, key=mx.random.key(1)).astype(mx.bfloat16)
    v = mx.random.normal(shape, key=mx.random.key(2)).astype(mx.bfloat16)
    kq = tuple(mx.quantize(k, GROUP, SCHEME.key_bits))
    vq = tuple(mx.quantize(v, GROUP, SCHEME.value_bits))
    q = mx.random.normal((rows, HQ, queries, D), key=mx.random.key(3)).astype(mx.bfloat16)
    start = mx.array([(i * 37) % 64 for i in range(rows)], dtype=mx.int32)  # a little left padding
    cols = mx.arange(width + DENSE_EXTRA)
    pos = mx.arange(context - queries, context)[:, None]
    mask = ((cols[None] <= pos)[None, None] & (cols >= start[:, None])[:, None, None, :])
    mx.eval(kq, vq, q, start, mask)
    scale = D ** -0.5

    def before():
        k16, v16 = _working_copy((kq, vq), SCHEME, width + DENSE_EXTRA)
        return attention.sdpa(q, k16, v16, scale, mask, bits=SCHEME)

    def kernel():
        return q4sdpa.q4_decode_sdpa(q, kq, vq, start, context, scale, GROUP, rotated=True)

    return [("dequantize + plain", before), ("q4sdpa", kernel)]


def main(argv=None) -> int:
    ap = bench_parser(__doc__)
    ap.add_argument("--contexts", default="1024,4096,16384", help="tokens per row, the chunk included")
    ap.add_argument("--queries", default="64,256,448", help="queries per row (the chunk's tokens)")
    ap.add_argument("--rows", default="1,5", help="rows sharing the chunk")
    args = ap.parse_args(argv)
    env = environment()
    print(env, flush=True)
    rows = []
    for context in (int(x) for x in args.contexts.split(",")):
        for queries in (int(x) for x in args.queries.split(",")):
            for b in (int(x) for x in args.rows.split(",")):
                base = None
                for label, call in cases(context, queries, b):
                    us = device_us([call], reps=10)
                    base = base or us
                    rows.append(dict(context=context, queries=queries, rows=b, route=label, us=round(us, 1),
                                     x_before=round(us / base, 3)))
                    print(rows[-1], flush=True)
    write_results(args.name or "prefill_attention", env, rows, COLUMNS, args.out,
                  notes=f"one layer's attention, {HQ} query heads, {HKV} kv heads, head dim {D}, scheme {SCHEME.name}; "
                        "microseconds per call: device time by CUPTI where cupti-python is installed, else the wall "
                        "time of 10 calls queued together")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
