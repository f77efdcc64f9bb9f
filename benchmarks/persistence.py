"""Saving and loading agent caches: time against size, against the disk's own read speed.

For each context length (default 512, 4K and 16K tokens) it builds a random Q4 cache of
the given geometry (default Llama-3.1-8B: 32 layers, 8 KV heads, head dim 128, 4-bit,
group 64, bf16 scales and biases) as host tensors, then measures, median of --repeats:

- save: `store.save_cache` (encode + temp file + fsync + rename + folder fsync);
- load: `store.load_cache` (read + parse + checksum + validate), with the file's pages
  dropped from the page cache first ("cold") and with them cached ("warm"), and
  `store.host_to_cache` (host tensors to mlx arrays, evaluated);
- raw read: one read of a file of the same size on the same disk, cold and warm;
  `load_frac` = raw read time / load time (1.0 = loading as fast as the disk reads);
- bytes on disk against mlx-lm's `save_prompt_cache` of the same cache in Q4
  (QuantizedKVCache) and in fp16 (KVCache, dequantized).

Cold reads drop the page cache with /proc/sys/vm/drop_caches when that works (root)
and --no-drop-caches is not given, else with posix_fadvise(DONTNEED) on the files
(the output says which).

    python -m benchmarks.persistence                      # 512, 4K, 16K tokens, Llama-8B shape
    python -m benchmarks.persistence --tokens 256 1024 --repeats 1
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import tempfile
import time
import types
from pathlib import Path

import numpy as np

from benchmarks.common import RESULTS, environment, plot_lines, write_results
from runtime import store

COLUMNS = [
    "tokens", "file_MiB", "save_s", "load_cold_s", "raw_cold_s", "load_frac_cold", "load_warm_s",
    "raw_warm_s", "load_frac_warm", "to_mlx_s", "mlxlm_q4_MiB", "mlxlm_fp16_MiB", "ours_vs_fp16",
]


def random_host(spec, tokens: int, dtype: str, seed: int = 0) -> store.HostCache:
    """A random Q4 cache of `tokens` tokens with the geometry of `spec`, as host tensors."""
    rng = np.random.default_rng(seed)
    tensors = {}
    for i in range(spec.n_layers):
        for kind, dim in (("keys", spec.k_head_dim), ("values", spec.v_head_dim)):
            shape = (1, spec.n_kv_heads, tokens)
            words = dim * spec.kv_bits // 32
            tensors[f"layers.{i}.{kind}.packed"] = rng.integers(0, 2**32, (*shape, words), dtype=np.uint32)
            for part in ("scales", "biases"):
                values = rng.uniform(-0.05, 0.05, (*shape, dim // spec.kv_group_size)).astype(np.float32)
                if dtype == "bfloat16":
                    values = (values.view(np.uint32) >> 16).astype(np.uint16)  # raw bfloat16 bits
                elif dtype == "float16":
                    values = values.astype(np.float16)
                tensors[f"layers.{i}.{kind}.{part}"] = values
    return store.HostCache(tensors, dtype, spec.kv_bits, spec.kv_group_size, spec.n_layers, tokens)


def drop_page_cache(paths, allow_global: bool = True) -> str:
    """Evict `paths` from the page cache; return the method that worked.

    /proc/sys/vm/drop_caches (the whole machine; needs root) when allowed and
    possible, else posix_fadvise(DONTNEED) on each file.
    """
    os.sync()
    if allow_global:
        try:
            with open("/proc/sys/vm/drop_caches", "w") as f:
                f.write("3\n")
            return "drop_caches"
        except OSError:
            pass
    for p in paths:
        fd = os.open(p, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)
    return "fadvise"


def clock(fn, *args):
    t0 = time.perf_counter()
    out = fn(*args)
    return time.perf_counter() - t0, out


def mlxlm_bytes(host: store.HostCache, folder: Path) -> tuple[int, int]:
    """Bytes of mlx-lm's save_prompt_cache of `host` in Q4 and dequantized to fp16."""
    import mlx.core as mx
    from mlx_lm.models.cache import KVCache, save_prompt_cache

    q4 = store.host_to_cache(host)
    save_prompt_cache(str(folder / "mlxlm-q4.safetensors"), q4)
    q4_size = (folder / "mlxlm-q4.safetensors").stat().st_size
    fp16 = []
    for c in q4:
        kv = KVCache()
        k = mx.dequantize(*c.keys, group_size=c.group_size, bits=c.bits).astype(mx.float16)
        v = mx.dequantize(*c.values, group_size=c.group_size, bits=c.bits).astype(mx.float16)
        kv.state = (k, v, host.n_tokens)
        mx.eval(k, v)
        fp16.append(kv)
    del q4
    save_prompt_cache(str(folder / "mlxlm-fp16.safetensors"), fp16)
    fp16_size = (folder / "mlxlm-fp16.safetensors").stat().st_size
    for name in ("mlxlm-q4.safetensors", "mlxlm-fp16.safetensors"):
        (folder / name).unlink()
    return q4_size, fp16_size


def measure(spec, tokens: int, dtype: str, repeats: int, work: Path, allow_global: bool = True) -> tuple[dict, str]:
    """One row of figures for `tokens` tokens; also the page-cache drop method used."""
    host = random_host(spec, tokens, dtype)
    meta = store.CacheMeta(1, list(range(tokens)), list(range(1, tokens + 1)), "x" * tokens)
    path = work / spec.fingerprint / "bench" / store.CACHE_FILE
    saves, cold, warm, to_mlx, raw_cold, raw_warm = [], [], [], [], [], []
    method = ""
    for _ in range(repeats):
        t, _ = clock(store.save_cache, work, spec, "bench", host, meta)
        saves.append(t)
        raw = work / "raw.bin"
        if not raw.exists() or raw.stat().st_size != path.stat().st_size:
            with open(raw, "wb") as f:
                f.write(np.random.default_rng(1).integers(0, 256, path.stat().st_size, dtype=np.uint8).tobytes())
                os.fsync(f.fileno())
        method = drop_page_cache([path, raw], allow_global)
        raw_cold.append(clock(store.read_file, raw)[0])
        cold.append(clock(store.load_cache, work, spec, "bench")[0])
        raw_warm.append(clock(store.read_file, raw)[0])
        t, (loaded, _) = clock(store.load_cache, work, spec, "bench")
        warm.append(t)
        to_mlx.append(clock(store.host_to_cache, loaded)[0])
        del loaded
    size = path.stat().st_size
    q4_size, fp16_size = mlxlm_bytes(host, work)
    med = statistics.median
    row = {
        "tokens": tokens,
        "file_MiB": size / 2**20,
        "save_s": med(saves),
        "load_cold_s": med(cold),
        "raw_cold_s": med(raw_cold),
        "load_frac_cold": med(raw_cold) / med(cold),
        "load_warm_s": med(warm),
        "raw_warm_s": med(raw_warm),
        "load_frac_warm": med(raw_warm) / med(warm),
        "to_mlx_s": med(to_mlx),
        "mlxlm_q4_MiB": q4_size / 2**20,
        "mlxlm_fp16_MiB": fp16_size / 2**20,
        "ours_vs_fp16": size / fp16_size,
        "file_bytes": size,
        "raw_cold_GB_s": size / med(raw_cold) / 1e9,
        "raw_warm_GB_s": size / med(raw_warm) / 1e9,
    }
    (work / "raw.bin").unlink(missing_ok=True)
    return row, method


def main(argv=None) -> int:
    """Run the benchmark; write persistence.json and persistence.md under --out."""
    p = argparse.ArgumentParser(
        prog="python -m benchmarks.persistence",
        description=__doc__.split("\n\n")[0],
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    p.add_argument("--tokens", type=int, nargs="+", default=[512, 4096, 16384], help="context lengths")
    p.add_argument("--layers", type=int, default=32, help="layers (Llama-3.1-8B: 32)")
    p.add_argument("--kv-heads", type=int, default=8, help="KV heads")
    p.add_argument("--head-dim", type=int, default=128, help="head dim of keys and values")
    p.add_argument("--bits", type=int, default=4, help="KV bits")
    p.add_argument("--group-size", type=int, default=64, help="quantization group")
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"], help="scales dtype")
    p.add_argument("--repeats", type=int, default=3, help="repeats per size; medians are reported")
    p.add_argument("--work-dir", type=Path, default=None, help="where cache files go; unset: a temp folder in --out")
    p.add_argument(
        "--no-drop-caches", action="store_true", help="evict only the benchmark's files (fadvise), not the page cache"
    )
    p.add_argument("--out", type=Path, default=RESULTS, help="output folder")
    args = p.parse_args(argv)

    spec = types.SimpleNamespace(
        fingerprint="bench", n_layers=args.layers, n_kv_heads=args.kv_heads, k_head_dim=args.head_dim,
        v_head_dim=args.head_dim, kv_bits=args.bits, kv_group_size=args.group_size, dtype=args.dtype,
    )
    env = environment()
    store.host_to_cache(random_host(spec, 1, args.dtype))  # warm up: imports, mlx allocator
    args.out.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix="persistence-", dir=args.work_dir or args.out))
    env["work_dir"] = str(work)
    env["geometry"] = (
        f"{args.layers} layers x {args.kv_heads} kv heads x head dim {args.head_dim}, "
        f"{args.bits}-bit g{args.group_size}, {args.dtype} scales"
    )
    print(env, flush=True)
    rows, methods = [], set()
    try:
        for tokens in args.tokens:
            row, method = measure(spec, tokens, args.dtype, args.repeats, work, not args.no_drop_caches)
            rows.append(row)
            methods.add(method)
            print({k: round(v, 4) if isinstance(v, float) else v for k, v in row.items()}, flush=True)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    env["page_cache_drop"] = ", ".join(sorted(methods))
    notes = (
        f"Geometry: {env['geometry']}. Cold = page cache dropped before each read ({env['page_cache_drop']}); "
        "warm = file pages cached. load_frac = raw read time of an equal-sized file / load time "
        "(read + parse + checksum + validate; to_mlx_s, building the mlx arrays, is extra). "
        "mlxlm_* = bytes of mlx-lm's save_prompt_cache of the same cache in Q4 and dequantized fp16; "
        "ours_vs_fp16 = our file / their fp16 file. Medians of "
        f"{args.repeats} repeats."
    )
    write_results("persistence", env, rows, COLUMNS, args.out, notes)
    curves = {name: [r[key] for r in rows] for name, key in (
        ("save", "save_s"), ("load, page cache dropped", "load_cold_s"), ("raw read, dropped", "raw_cold_s"),
        ("load, page cache warm", "load_warm_s"), ("raw read, warm", "raw_warm_s"))}
    plot_lines(args.out / "persistence.png", curves, "tokens", "seconds", "Q4 cache save and load", x=args.tokens)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
