"""Decode steps while another thread copies a cache to the host and writes it, as the cache writer does for each
finished turn.

An engine decodes --rows rows at --context tokens of context. In phase "copy" a second
thread copies a per-agent cache of --copy-tokens tokens to the host in a loop
(`hostcache.cache_to_host`, the cache writer's work before it writes a file); in phase
"write" it also writes each copy to a file as the cache writer does (`cacheformat.encode_file`,
which checksums it, then `files.write_atomic`: a temp file, fsync, rename, fsync of the folder);
in phase "idle" it does nothing. Phases alternate --rounds times, --steps decode steps each. For
each phase: the steps' p50, p99 and max, the mean time a step waited for the device and
spent queueing its graph (`DecodeStep`), and the copies made per second. A step that gets
slower only while the copy or the write runs is their doing, whichever way it interferes (the
device's queue, the allocator, the driver, the GIL, the kernel's page cache and disk).

    python -m benchmarks.copy_interference                                              # CPU, tiny model
    python -m benchmarks.copy_interference --model llama-8b-shape --context 4096 --copy-tokens 2300   # GPU
    python -m benchmarks.copy_interference --model llama-8b-shape --context 2500 --copy-tokens 2600 --delta 264
"""

from __future__ import annotations

import statistics
import tempfile
import threading
import time
from pathlib import Path

import mlx.core as mx

from benchmarks.batching import agent_turns
from benchmarks.common import bench_parser, environment, load_bench_model, ranked, write_results
from runtime.engine import Engine, Turn
from runtime.cacheformat import encode_file
from runtime.files import write_atomic
from runtime.hostcache import CacheMeta, cache_to_host

PHASES = ("idle", "copy", "write")
COLUMNS = ["phase", "steps", "p50_ms", "p99_ms", "max_ms", "wait_ms", "queue_ms", "copies_per_s", "copy_MB"]


def copier(cache, stop: threading.Event, done: list, path: Path | None = None, start: int = 0):
    """Copy `cache` (its positions from `start` on) to the host until `stop` is set, and write each copy to `path`
    unless None (as the cache writer writes a turn's cache); append each round's seconds to `done`."""
    try:
        while not stop.is_set():
            t0 = time.perf_counter()
            host = cache_to_host(cache, start)
            if path is not None:
                n = host.n_tokens
                meta = CacheMeta(seq=1, token_ids=[0] * n, token_ends=[-1] * n, text="")
                write_atomic(path, encode_file(host, meta, "copy-interference")[0])
            done.append(time.perf_counter() - t0)
    except BaseException as e:  # the phase raises it
        done.append(e)


def phase(engine, steps: int, cache=None, path: Path | None = None, start: int = 0) -> tuple[list, list]:
    """(DecodeSteps, copy seconds) of `steps` engine steps, with `cache` (from position `start` on) copied
    meanwhile unless None (and written to `path` unless None)."""
    stop, done = threading.Event(), []
    thread = None if cache is None else threading.Thread(target=copier, args=(cache, stop, done, path, start),
                                                         daemon=True)
    if thread:
        thread.start()
        time.sleep(0.05)  # the copier is under way
    first = len(engine.stats.decode_steps)
    for _ in range(steps):
        engine.step()
    if thread:
        stop.set()
        thread.join()
    for e in done:
        if isinstance(e, BaseException):
            raise RuntimeError("the copying thread failed") from e
    return list(engine.stats.decode_steps)[first:], done


def summary(name: str, steps: list, copies: list, seconds: float, copy_mb: float) -> dict:
    totals = sorted(s.total_s * 1e3 for s in steps)
    return dict(
        phase=name, steps=len(totals), p50_ms=round(statistics.median(totals), 2),
        p99_ms=round(ranked(totals, 0.99), 2), max_ms=round(totals[-1], 2),
        wait_ms=round(statistics.mean(s.wait_s for s in steps) * 1e3, 2),
        queue_ms=round(statistics.mean(s.queue_s for s in steps) * 1e3, 2),
        copies_per_s=round(len(copies) / seconds, 1), copy_MB=round(copy_mb, 1),
    )


def main(argv=None):
    p = bench_parser(__doc__)
    p.add_argument("--rows", type=int, default=5)
    p.add_argument("--context", type=int, default=512)
    p.add_argument("--copy-tokens", type=int, default=512)
    p.add_argument("--steps", type=int, default=100)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--delta", type=int, default=0,
                   help="copy only the cache's last DELTA positions, as a turn's delta file does (0: the whole cache)")
    args = p.parse_args(argv)
    env = environment()
    print(env)
    model, tokenizer, spec = load_bench_model(args.model)
    vocab = model.args.vocab_size
    engine = Engine(model, tokenizer, spec, max_batch=args.rows)
    engine.warmup()
    engine.submit(Turn("copied", "copied", None, agent_turns(1, args.copy_tokens, 1, vocab, seed=7)[0].tokens,
                       max_tokens=1))
    cache = None
    while engine.has_work():
        for r in engine.step():
            cache = r.cache
    start = max(0, args.copy_tokens - args.delta) if args.delta else 0
    copy_mb = sum(x.nbytes for x in cache_to_host(cache, start).tensors.values()) / 1e6
    rows = agent_turns(args.rows, args.context, len(PHASES) * args.rounds * args.steps + 64, vocab)
    for t in rows:
        engine.submit(t)
    while len(engine.decoding) < args.rows:
        engine.step()
    for _ in range(10):
        engine.step()
    mx.synchronize()
    results = {name: ([], [], 0.0) for name in PHASES}
    with tempfile.TemporaryDirectory(prefix="kvactors-copy-") as folder:
        for _ in range(args.rounds):
            for name in results:
                t0 = time.perf_counter()
                steps, copies = phase(engine, args.steps, None if name == "idle" else cache,
                                      Path(folder) / "cache.kvc" if name == "write" else None, start)
                s, c, secs = results[name]
                results[name] = (s + steps, c + copies, secs + time.perf_counter() - t0)
    out = [summary(name, s, c, secs, copy_mb) for name, (s, c, secs) in results.items()]
    for row in out:
        print(row)
    notes = (f"model {args.model}; {args.rows} rows decoding at {args.context} tokens of context; the copied cache "
             f"holds {args.copy_tokens} tokens, copied from position {start} on; {args.rounds} rounds of {args.steps} steps a phase, alternating.")
    write_results(args.name or f"copy_interference-{args.model}", env, out, COLUMNS, args.out, notes)


if __name__ == "__main__":
    main()
