"""The wait before a turn's ack: its journal only, against its journal and its cache file.

A turn is acknowledged once its journal records are fsynced; its cache file follows in
the background. Before, the ack also waited for the cache file (encode, write, fsync,
rename, folder fsync). This measures both in one run, on one PersistenceActor: for
each turn of one agent it submits a journal record and a random Q4 cache of the given
geometry (default Llama-3.1-8B: 32 layers, 8 KV heads, head dim 128, 4-bit g64, bf16
scales) and times, from the submit, the ack (`ack_s`) and the moment its cache file is
on disk (`cache_s`, via `settle`: the wait the ack had before). Each context length
runs `--turns` turns: the first writes a full file (`first_*`; `first_MiB` its size),
each later one continues the cache before it by `--new` tokens (`later_*`: medians;
they write deltas, and a full file again once the deltas would outgrow it, as an
agent's turns do). `ratio` = cache_s / ack_s.

    python -m benchmarks.ack_wait                       # 512 and 4K tokens, Llama-8B shape
    python -m benchmarks.ack_wait --tokens 1024 --turns 4
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import tempfile
import time
import types
from pathlib import Path

from actors.persistence import PersistenceActor, submit
from benchmarks.common import RESULTS, environment, write_results
from benchmarks.persistence import random_host
from runtime import store

COLUMNS = ["tokens", "first_MiB", "first_ack_s", "first_cache_s", "first_ratio", "later_ack_s", "later_cache_s",
           "later_ratio"]


def grown(host: store.HostCache, tokens: int) -> store.HostCache:
    """`host`'s first `tokens` tokens (numpy views)."""
    return dataclasses.replace(host, tensors={k: v[:, :, :tokens] for k, v in host.tensors.items()}, n_tokens=tokens)


def measure(spec, tokens: int, turns: int, new: int, dtype: str, work: Path) -> dict:
    """One context length: `turns` turns of one agent; the medians of ack and cache times."""
    full = random_host(spec, tokens + (turns - 1) * new, dtype)
    ref = PersistenceActor.start(work, spec)
    times = []  # (ack_s, cache_s) per turn
    try:
        for seq in range(turns):
            n = tokens + seq * new
            meta = store.CacheMeta(seq, list(range(n)), list(range(1, n + 1)), "x" * n, f"turn-{seq}")
            record = {"seq": seq, "role": "assistant", "text": "reply"}
            reuse = None if seq == 0 else (seq - 1, n - new)
            t0 = time.perf_counter()
            submit(ref, "bench", seq, grown(full, n), meta, [record], reuse=reuse).get(timeout=600)
            ack = time.perf_counter() - t0
            ref.proxy().settle().get(timeout=600)
            times.append((ack, time.perf_counter() - t0))
            if seq == 0:
                size = (work / spec.fingerprint / "bench" / store.CACHE_FILE).stat().st_size
    finally:
        ref.stop()
    med = statistics.median
    first, later = times[0], times[1:] or times[:1]
    later_ack, later_cache = med(a for a, _ in later), med(c for _, c in later)
    return {"tokens": tokens, "first_MiB": size / 2**20, "first_ack_s": first[0], "first_cache_s": first[1],
            "first_ratio": first[1] / first[0], "later_ack_s": later_ack, "later_cache_s": later_cache,
            "later_ratio": later_cache / later_ack}


def main(argv=None) -> int:
    """Run the benchmark; write ack_wait.json and ack_wait.md under --out."""
    p = argparse.ArgumentParser(prog="python -m benchmarks.ack_wait", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--tokens", type=int, nargs="+", default=[512, 4096], help="context lengths of the first turn")
    p.add_argument("--turns", type=int, default=5, help="turns per context length")
    p.add_argument("--new", type=int, default=256, help="tokens each later turn adds")
    p.add_argument("--layers", type=int, default=32, help="layers (Llama-3.1-8B: 32)")
    p.add_argument("--kv-heads", type=int, default=8, help="KV heads")
    p.add_argument("--head-dim", type=int, default=128, help="head dim of keys and values")
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"], help="scales dtype")
    p.add_argument("--work-dir", type=Path, default=None, help="where files go; unset: a temp folder in --out")
    p.add_argument("--out", type=Path, default=RESULTS, help="output folder")
    args = p.parse_args(argv)
    spec = types.SimpleNamespace(fingerprint="bench", n_layers=args.layers, n_kv_heads=args.kv_heads,
                                 k_head_dim=args.head_dim, v_head_dim=args.head_dim, kv_bits=4, kv_group_size=64,
                                 model_id="ack-wait-bench")
    env = environment()
    args.out.mkdir(parents=True, exist_ok=True)
    rows = []
    for tokens in args.tokens:
        work = Path(tempfile.mkdtemp(prefix="ack-wait-", dir=args.work_dir or args.out))
        rows.append(measure(spec, tokens, args.turns, args.new, args.dtype, work))
    notes = (f"{args.layers} layers x {args.kv_heads} kv heads x head dim {args.head_dim}, 4-bit g64, {args.dtype} "
             f"scales; {args.turns} turns per length, each later one adding {args.new} tokens. "
             "ack_s: submit to ack (the journal record fsynced); cache_s: submit to the cache file on disk, "
             "which the ack waited for before.")
    write_results("ack_wait", env, rows, COLUMNS, args.out, notes)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
