"""How long a cache write holds the GIL, against the length of the conversation.

A decode step on a GPU is host-bound, and the engine's thread gives up the GIL inside
`mx.async_eval`: Python that another thread runs then delays the step by up to the switch
interval (5 ms), and one C call that holds the GIL (a `json.dumps`) for as long as it takes
(`benchmarks/results/h100/dma-copy-2026-11-27/`). After every turn the persistence actor
copies the turn's new rows of the agent's cache to the host and writes them as a delta file
with the conversation's metadata (its token ids, token ends and text, all of them). This
benchmark does that work for a conversation that grows by --new rows a write from --contexts
tokens on (the 8B shape's cache layout; the rows copied out of a cache that holds the turn
before them too, as an agent's cache does), while a second thread sleeps 0.2 ms at a time and records how much longer each
sleep took: its waits for the GIL. Per context: milliseconds a write and by part (the copy,
the checks, the encoding), and the longest and the 99th-percentile wait. `--layout` picks the
cache's: arrays a layer (`per-layer`, as a turn's cache is on the CPU route) or every layer a
view of one row's six arrays (`held-row`, `q4cache.HeldRow`: a turn's cache on CUDA's kernel
route, which `cache_to_host` copies through the six arrays). Compare layouts in separate
processes: in one, the layout measured second runs slower by the allocations its sizes miss in
MLX's buffer cache (on a CPU, 14-15 against 7-8 ms a copy, whichever is second).

    python -m benchmarks.write_gil                                   # any machine
    python -m benchmarks.write_gil --contexts 4096,32768 --new 264 --layout held-row
"""

from __future__ import annotations

import statistics
import threading
import time

import mlx.core as mx
from mlx_lm.models.cache import QuantizedKVCache

from benchmarks.common import bench_parser, environment, ranked, write_results
from runtime.cacheformat import encode_file
from runtime.hostcache import CacheMeta, HostCache, cache_to_host, check_cache

COLUMNS = ["context", "layout", "new", "write_ms", "copy_ms", "check_ms", "encode_ms", "longest_wait_ms", "p99_wait_ms"]
TICK = 0.0002  # the waiting thread's sleep


class GilWaits:
    """While entered, a second thread sleeps TICK at a time and `waits` collects how much longer each sleep
    took, in seconds: its waits for the GIL."""

    def __init__(self):
        self.waits, self._stop = [], threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self):
        while not self._stop.is_set():
            t = time.perf_counter()
            time.sleep(TICK)
            self.waits.append(time.perf_counter() - t - TICK)

    def __enter__(self) -> "GilWaits":
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()


def new_rows(n: int, layers: int = 32, heads: int = 8, dim: int = 128, bits: int = 4, group: int = 64) -> list:
    """A per-layer cache of `n` tokens in the 8B shape's layout (bf16 scales), evaluated: a turn's new rows."""
    out, key = [], mx.random.key(0)
    for _ in range(layers):
        c = QuantizedKVCache(group_size=group, bits=bits)
        key, k1, k2 = mx.random.split(key, 3)
        c.keys = mx.quantize(mx.random.normal((1, heads, n, dim), key=k1).astype(mx.bfloat16), group, bits)
        c.values = mx.quantize(mx.random.normal((1, heads, n, dim), key=k2).astype(mx.bfloat16), group, bits)
        c.offset = n
        mx.eval(c.keys, c.values)
        out.append(c)
    return out


def held(rows) -> list:
    """`rows` (from `new_rows`) as a turn's cache is on CUDA's kernel route: every layer a view of one `HeldRow`
    of six arrays (layers, heads, tokens, ...)."""
    from runtime.kvscheme import KVScheme
    from runtime.q4cache import HeldRow, layer_cache

    arrays = [mx.concatenate([(*c.keys, *c.values)[j] for c in rows]) for j in range(6)]
    mx.eval(arrays)
    row, out = HeldRow(arrays), []
    for n, c in enumerate(rows):
        layer = layer_cache(KVScheme(c.bits, c.bits, c.group_size, "none"))
        layer.hold(row, n)
        layer.offset = c.offset
        out.append(layer)
    return out


def write(rows, context: int, meta: CacheMeta) -> tuple[float, float, float]:
    """(copy, check, encode) seconds of one delta write at the end of a `context`-token conversation: the second
    half of `rows` (a cache holding the turn before it too), copied as a turn's delta is (`cache_to_host` from
    a start, as `DeviceCache.rows` asks)."""
    new = rows[0].offset // 2
    t0 = time.perf_counter()
    host = cache_to_host(rows, rows[0].offset - new)
    t1 = time.perf_counter()
    delta = HostCache(host.tensors, host.dtype, host.bits, host.group_size, host.n_layers, context,
                      (new,) * host.n_layers, host.value_bits, host.rotation)
    check_cache(delta, meta)  # the persistence actor's, when the write is asked for
    t2 = time.perf_counter()
    encode_file(delta, meta, "0" * 16, {"parent": "crc32:00000000", "start": context - host.n_tokens,
                                        "lengths": [context] * host.n_layers})
    return t1 - t0, t2 - t1, time.perf_counter() - t2


def conversation(tokens: int, seq: int) -> CacheMeta:
    """The metadata of a conversation of `tokens` tokens (one character each), as turn `seq` writes it."""
    return CacheMeta(seq=seq, token_ids=[7 * i % 50000 for i in range(tokens)],
                     token_ends=list(range(1, tokens + 1)), text="x" * tokens, turn_id=f"t{seq}")


def measure(rows, context: int, writes: int, layout: str) -> dict:
    """One row of the table: `writes` writes of a conversation that grows by a turn's rows from `context`
    tokens on, timed, with a second thread's GIL waits; `layout` names the cache's."""
    new = rows[0].offset // 2
    metas = [conversation(context + i * new, i + 1) for i in range(writes + 1)]
    write(rows, context, metas[0])  # warm
    with GilWaits() as gil:
        parts = [write(rows, len(meta.token_ids), meta) for meta in metas[1:]]
    ms = [statistics.median(p[k] for p in parts) * 1e3 for k in range(3)]
    waits = sorted(gil.waits)
    return dict(context=context, layout=layout, new=new, write_ms=round(sum(ms), 2), copy_ms=round(ms[0], 2),
                check_ms=round(ms[1], 2), encode_ms=round(ms[2], 2), longest_wait_ms=round(waits[-1] * 1e3, 2),
                p99_wait_ms=round(ranked(waits, 0.99) * 1e3, 2))


def main(argv=None):
    p = bench_parser(__doc__)
    p.add_argument("--contexts", default="1024,4096,16384,32768", help="conversation lengths in tokens")
    p.add_argument("--new", type=int, default=264, help="rows a turn adds (the delta)")
    p.add_argument("--writes", type=int, default=10, help="writes timed per context")
    p.add_argument("--layout", choices=("per-layer", "held-row"), default="per-layer",
                   help="the cache's layout (default: %(default)s; see above)")
    args = p.parse_args(argv)
    env = environment()
    print(env)
    rows = new_rows(2 * args.new)  # the turn before and this one: a delta copies the second half
    cache = held(rows) if args.layout == "held-row" else rows
    out = [measure(cache, int(c), args.writes, args.layout) for c in args.contexts.split(",")]
    notes = (f"a delta of {args.new} rows (32 layers, 8 kv heads, head dim 128, 4-bit keys and values, bf16 scales) "
             f"written after each of {args.writes} turns of a conversation from each context on; medians; waits: a second thread's "
             f"sleeps of {TICK * 1e3} ms, less the sleep. --model is not used.")
    write_results(args.name or "write_gil", env, out, COLUMNS, args.out, notes)


if __name__ == "__main__":
    main()
