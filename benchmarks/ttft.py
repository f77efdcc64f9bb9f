"""Time to first token: cold, hot and warm, at several context lengths, through the Runtime.

For each context length L an agent gets a system prompt of about L tokens:
- cold: its first turn prefills everything;
- hot: the next turn finds its cache in memory and prefills only the new message; it is
  asked as soon as the cold turn answers, while the persistence actor is still copying
  that turn's cache off the device (its queue and prefill seconds are reported beside it);
- settled: a third, hot turn asked after `Runtime.flush` (every write done), so the
  difference from hot is what the previous turn's write costs the next one;
- warm: the Runtime is shut down and a new one opened over the same cache_dir
  (what a process restart does); the first turn reloads the cache from disk
  (the reload is part of its TTFT) and prefills only the new message.
Each is the median over --agents agents (their texts differ), measured after a first agent of
the same length took the same turns in the same Runtime (first use compiles kernels and records
graphs); the hot and settled TTFTs of every agent are listed beside the medians. The page cache is
dropped before each warm turn. The reload is also timed alone and compared with the raw read bandwidth of the
same disk, measured on the cache file in the same run (page cache dropped first
when this process may, see `drop_caches`).

    python -m benchmarks.ttft                                        # CPU, tiny model
    python -m benchmarks.ttft --model llama-8b-shape --contexts 1024,4096,16384,32768   # GPU
"""

from __future__ import annotations

import os
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

from benchmarks.common import bench_parser, bench_model_folder, environment, plot_lines, write_results
from runtime import Runtime, store
from runtime.tiny import tokenizer_corpus

HOT_BUDGET = 16 << 30  # keep every cache of this benchmark hot between turns
ROOM = 320  # positions past the context that the four turns take at most (messages, template, max_tokens)
COLUMNS = ["context", "agents", "cold_ttft_s", "hot_ttft_s", "hot_queue_s", "hot_prefill_s", "settled_ttft_s", "warm_ttft_s",
           "hot_x_cold", "warm_x_cold",
           "cache_mb", "reload_s", "disk_read_gb_s", "reload_x_disk", "page_cache", "hot_each_s", "settled_each_s"]


def long_text(tokenizer, n_tokens: int, seed: int = 0) -> str:
    """Deterministic prose of about `n_tokens` tokens for `tokenizer`."""
    lines = tokenizer_corpus()
    rng = random.Random(seed)
    out, count = [], 0
    while count < n_tokens:
        line = rng.choice(lines)
        out.append(line)
        count += len(tokenizer.encode(line + "\n", add_special_tokens=False))
    return "\n".join(out)


def drop_caches() -> bool:
    """Drop the OS page cache (Linux, root); return whether it worked."""
    try:
        os.sync()
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("3\n")
        return True
    except OSError:
        return False


def disk_read_bandwidth(path: Path) -> tuple[float, bool]:
    """(bytes/s of a plain read of `path`, whether the page cache was dropped first)."""
    dropped = drop_caches()
    t0 = time.perf_counter()
    n = len(store.read_file(path))
    return n / (time.perf_counter() - t0), dropped


def reload_time(cache_dir, spec, agent) -> float:
    """Seconds to load and validate `agent`'s cache and build it in device memory."""
    drop_caches()
    t0 = time.perf_counter()
    host, _ = store.load_cache(cache_dir, spec, agent)
    store.host_to_cache(host)
    return time.perf_counter() - t0


def bench_context(model_path, context, cache_dir, max_tokens, agents: int = 1):
    """One row (None where `context` and the turns do not fit the model's positions): the median TTFTs of
    `agents` agents of `context` tokens, measured after another agent of that length (a different text) took
    the same turns in the same Runtime. MLX-CUDA compiles kernels once a process and the engine's model
    records its compiled graphs once a shape (`prepare.CompiledBlock`), both on first use: a Runtime serves
    one agent's turn in the steady state only after such a turn."""
    names = [f"first{context}"] + [f"ctx{context}" + (f"-{i}" if i else "") for i in range(agents)]
    seeds = [context + 1, context] + [context + 1 + k for k in range(1, agents)]  # one text each
    turns = {}  # name -> (cold, hot, settled, warm) results
    with Runtime(model=model_path, cache_dir=cache_dir, hot_budget=HOT_BUDGET, warmup=False) as rt:
        if rt.max_context is not None and context + ROOM > rt.max_context:
            print(f"context {context}: skipped, the model has {rt.max_context} positions", flush=True)
            return None
        for name, seed in zip(names, seeds):
            agent = rt.spawn(name, system=long_text(rt.tokenizer, context, seed=seed))
            cold = agent.ask("Summarize the notes above in one line.", max_tokens=max_tokens, timeout=600)
            hot = agent.ask("And what comes next?", max_tokens=max_tokens, timeout=600)
            rt.flush()
            settled = agent.ask("And after that?", max_tokens=max_tokens, timeout=600)
            assert (cold.cache, hot.cache, settled.cache) == ("cold", "hot", "hot"), (cold.cache, hot.cache, settled.cache)
            turns[name] = [cold, hot, settled]
        spec = rt.spec
    with Runtime(model=model_path, cache_dir=cache_dir, hot_budget=HOT_BUDGET, warmup=False) as rt:
        for name in names:
            drop_caches()  # the cache file was just written: read it from the disk, not the page cache
            warm = rt.spawn(name).ask("One more thing?", max_tokens=max_tokens, timeout=600)
            assert warm.cache == "warm", warm.cache
            turns[name].append(warm)
    measured = [turns[n] for n in names[1:]]
    path = store.agent_dir(cache_dir, spec.fingerprint, names[1]) / store.CACHE_FILE
    bandwidth, dropped = disk_read_bandwidth(path)
    reload_s = reload_time(cache_dir, spec, names[1])
    size = path.stat().st_size

    def median(turn: int, field: str = "ttft_s") -> float:
        return statistics.median(getattr(t[turn].timings, field) for t in measured)

    cold, hot, warm = median(0), median(1), median(3)
    row = dict(
        context=context, agents=agents, cold_ttft_s=cold, hot_ttft_s=hot, hot_queue_s=median(1, "queue_s"),
        hot_prefill_s=median(1, "prefill_s"), settled_ttft_s=median(2), warm_ttft_s=warm,
        hot_x_cold=hot / cold, warm_x_cold=warm / cold,
        cache_mb=size / 1e6, reload_s=reload_s, disk_read_gb_s=bandwidth / 1e9,
        reload_x_disk=(size / reload_s) / bandwidth, page_cache="dropped" if dropped else "warm (could not drop)",
        hot_each_s=" ".join(f"{t[1].timings.ttft_s:.4f}" for t in measured),
        settled_each_s=" ".join(f"{t[2].timings.ttft_s:.4f}" for t in measured),
    )
    print(row, flush=True)
    return row


def main(argv=None) -> int:
    ap = bench_parser(__doc__)
    ap.add_argument("--contexts", default="1024,4096,16384")
    ap.add_argument("--max-tokens", type=int, default=8)
    ap.add_argument("--agents", type=int, default=3,
                    help="agents measured a context; each figure is their median (default: %(default)s)")
    args = ap.parse_args(argv)
    if args.agents < 1:
        ap.error(f"--agents must be at least 1; got {args.agents}")
    env = environment()
    print(env, flush=True)
    with tempfile.TemporaryDirectory() as tmp:
        model_path = bench_model_folder(args.model, Path(tmp))
        rows, skipped = [], []
        for c in [int(c) for c in args.contexts.split(",")]:
            row = bench_context(model_path, c, Path(tmp) / f"agents{c}", args.max_tokens, args.agents)
            if row is None:
                skipped.append(c)
            else:
                rows.append(row)
    name = args.name or f"ttft-{args.model}"
    plot_lines(args.out / f"{name}.png", {s: [r[f"{s}_ttft_s"] for r in rows] for s in ("cold", "warm", "hot")},
               "context (tokens)", "TTFT (s)", f"TTFT cold / warm / hot, {args.model}", x=[r["context"] for r in rows])
    write_results(name, env, rows, COLUMNS, args.out,
                  notes=f"model {args.model}; warm = a new Runtime over the same cache_dir (reload included in TTFT); "
                        "targets (GPU, 8B shape): hot <= 0.05x cold at 4K, warm <= 0.1x cold at 16K (page cache dropped)."
                        + (f" Skipped (longer than the model's positions): {skipped}." if skipped else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main())
