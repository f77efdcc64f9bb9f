"""How long reloading an agent's cache holds the GIL, against the length of the conversation.

After a restart (or when an agent's cache left memory) the agent's thread reads its cache
file and builds the device arrays from it (`store.host_to_cache`) while the engine's thread
decodes the other agents: any stretch in which the loading thread holds the GIL is a decode
step that waits. This benchmark writes a cache of each --contexts tokens (the 8B shape's
layout) to a real file, maps it as a load does (`cacheformat.decode_file` on `files.map_file`),
and builds the arrays two ways, alternating, while a second thread sleeps 0.2 ms at a time and
records how much longer each sleep took (its waits for the GIL):
  runtime: `host_to_cache` as the runtime does it (on CUDA one copy-engine transfer without the GIL);
  mx.array: one `mx.array` per tensor (MLX's own conversion; the runtime's way before).
Per context and way: milliseconds a load, the first device read of the loaded arrays (a sum of
every tensor: on CUDA, arrays in managed memory migrate to the GPU then), and the longest and
99th-percentile wait.

    python -m benchmarks.load_gil                                    # any machine
    python -m benchmarks.load_gil --contexts 4096,16384 --loads 6
"""

from __future__ import annotations

import statistics
import tempfile
import time
from pathlib import Path

import mlx.core as mx

from benchmarks.common import bench_parser, environment, ranked, write_results
from benchmarks.write_gil import TICK, GilWaits, conversation, new_rows
from runtime.cacheformat import decode_file, encode_file
from runtime.files import map_file, write_atomic
from runtime.hostcache import cache_to_host, host_to_cache, layer_names

COLUMNS = ["context", "way", "load_ms", "first_read_ms", "longest_wait_ms", "p99_wait_ms"]


def mlx_arrays(host) -> list:
    """The tensors of `host` as `mx.array`s, one conversion each, evaluated (the way before `host_to_cache`'s)."""
    out = []
    for i in range(host.n_layers):
        for name in layer_names(i):
            a = mx.array(host.tensors[name])
            out.append(a.view(mx.bfloat16) if host.dtype == "bfloat16" and not name.endswith(".packed") else a)
    mx.eval(out)
    return out


def runtime_arrays(host) -> list:
    """The tensors of `host` as `host_to_cache` builds them, evaluated."""
    return [x for c in host_to_cache(host) for x in (*c.keys, *c.values)]


WAYS = {"runtime": runtime_arrays, "mx.array": mlx_arrays}


def load_once(host, way: str) -> tuple[float, float, list]:
    """(load seconds, first-read seconds, GIL waits) of one load of `host` the way `way`."""
    with GilWaits() as gil:
        t0 = time.perf_counter()
        arrays = WAYS[way](host)
        t1 = time.perf_counter()
    mx.eval([x.astype(mx.float32).sum() for x in arrays])
    return t1 - t0, time.perf_counter() - t1, gil.waits


def measure(context: int, loads: int, folder: Path) -> list[dict]:
    """Rows of the table for a cache of `context` tokens: each way loaded `loads` times, alternating."""
    rows = new_rows(context)
    path = folder / f"cache-{context}.safetensors"
    parts, _ = encode_file(cache_to_host(rows), conversation(context, 1), "0" * 16)
    write_atomic(path, parts)
    del rows
    host = decode_file(map_file(path))[0]
    for way in WAYS:  # warm: kernels, staging buffers
        load_once(host, way)
    got = {way: [] for way in WAYS}
    for _ in range(loads):
        for way in WAYS:
            got[way].append(load_once(host, way))
    out = []
    for way, runs in got.items():
        waits = sorted(w for _, _, ws in runs for w in ws)
        out.append(dict(context=context, way=way, load_ms=round(statistics.median(r[0] for r in runs) * 1e3, 2),
                        first_read_ms=round(statistics.median(r[1] for r in runs) * 1e3, 2),
                        longest_wait_ms=round(waits[-1] * 1e3, 2) if waits else None,
                        p99_wait_ms=round(ranked(waits, 0.99) * 1e3, 2) if waits else None))
        print(out[-1], flush=True)
    return out


def main(argv=None):
    p = bench_parser(__doc__)
    p.add_argument("--contexts", default="1024,4096,16384", help="conversation lengths in tokens")
    p.add_argument("--loads", type=int, default=6, help="loads timed per context and way")
    args = p.parse_args(argv)
    env = environment()
    print(env)
    with tempfile.TemporaryDirectory() as tmp:
        out = [row for c in args.contexts.split(",") for row in measure(int(c), args.loads, Path(tmp))]
    notes = (f"a cache of each context (32 layers, 8 kv heads, head dim 128, 4-bit keys and values, bf16 scales) "
             f"written to a file, mapped, and loaded {args.loads} times each way, alternating; medians; waits: a "
             f"second thread's sleeps of {TICK * 1e3} ms, less the sleep, during the loads. --model is not used.")
    write_results(args.name or "load_gil", env, out, COLUMNS, args.out, notes)


if __name__ == "__main__":
    main()
