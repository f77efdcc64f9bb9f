"""`kvactors serve` under load, against `mlx_lm.server` on the same model and workload.

C clients talk at once, each T turns of its own conversation, through the `openai`
async client on loopback. Like the stateless agent frameworks, every client resends
its whole conversation each turn (a system prompt, then the exchanges so far and a
new user message); half of the clients stream. Each server runs in its own process:

- kvactors: `kvactors serve` (durable writes, Q4 KV, the conversation's agent derived
  from its system prompt and first message); kvactors-memory: the same with
  `--durability memory` (turns acknowledged before their writes are fsynced);
- mlx-lm: `mlx_lm server` (its prompt-cache trie, in memory, fp16 KV), with room in
  its prompt cache for every conversation (`--prompt-cache-size`); mlx-lm-default: its
  default of 10 caches, fewer than the conversations, so some turns re-prefill.

Reported per server: total time, requests answered and failed (nothing may be lost),
latency p50 / p99 over all requests, TTFT p50 / p99 over the streamed ones, and for
kvactors the cache state of each turn.

    python -m benchmarks.serve [--model tiny] [--clients 16] [--turns 8] [--servers kvactors,mlx-lm]
"""

from __future__ import annotations

import asyncio
import os
import random
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections import Counter
from pathlib import Path

from benchmarks.common import bench_model_folder, bench_parser, environment, plot_bars, write_results

ROOT = Path(__file__).resolve().parent.parent
COLUMNS = ["server", "requests", "failed", "total s", "req/s", "latency p50 ms", "latency p99 ms",
           "TTFT p50 ms", "TTFT p99 ms", "cache states"]
WORDS = ("the river north stone garden lamp quiet market seven letter window morning bridge signal copper "
         "harbor winter paper orchard candle thunder ladder meadow silver engine village mirror compass").split()


def words(rng: random.Random, n: int) -> str:
    """`n` deterministic words."""
    return " ".join(rng.choice(WORDS) for _ in range(n))


def free_port() -> int:
    """A TCP port that was free on loopback a moment ago."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start(server: str, model: Path, workdir: Path, conversations: int = 16) -> tuple[subprocess.Popen, str]:
    """Start `server` (see the module doc for the names) on `model` in a child process; return it and its URL."""
    port = free_port()
    if server.startswith("kvactors"):
        cmd = [sys.executable, "-m", "runtime.api.cli", "serve", "--model", str(model), "--cache-dir",
               str(workdir / "agents"), "--port", str(port), "--log-level", "warning",
               "--durability", "memory" if server == "kvactors-memory" else "durable"]
    else:
        cmd = [sys.executable, "-m", "mlx_lm", "server", "--model", str(model), "--port", str(port),
               "--log-level", "WARNING"]
        if server == "mlx-lm":
            cmd += ["--prompt-cache-size", str(max(10, 2 * conversations))]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p)}
    log = open(workdir / f"{server}.log", "w")
    proc = subprocess.Popen(cmd, env=env, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 600
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{server} exited: see {workdir / f'{server}.log'}")
        try:
            with urllib.request.urlopen(url + "/v1/models", timeout=5):
                return proc, url
        except OSError:
            time.sleep(0.2)
    proc.kill()
    raise RuntimeError(f"{server} did not start within 600 s")


def stop(proc: subprocess.Popen) -> None:
    """Stop a server started by `start` (SIGTERM, then SIGKILL after 60 s)."""
    proc.terminate()
    try:
        proc.wait(timeout=60)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


async def client(api, model: str, i: int, turns: int, args, out: list) -> None:
    """One conversation of `turns` turns, resent whole every turn; streams when `i` is even."""
    rng = random.Random(i)
    messages = [{"role": "system", "content": f"You are agent {i}. " + words(rng, args.system_words)}]
    stream = i % 2 == 0
    for turn in range(turns):
        messages.append({"role": "user", "content": f"turn {turn}: " + words(rng, args.turn_words)})
        t0 = time.perf_counter()
        ttft, text, cache, failed = None, "", None, None
        try:
            if stream:
                chunks = await api.chat.completions.create(model=model, messages=messages, max_tokens=args.new,
                                                           temperature=0, stream=True)
                async for c in chunks:
                    if c.choices and c.choices[0].delta.content:
                        ttft = ttft or time.perf_counter() - t0
                        text += c.choices[0].delta.content
                    if c.model_extra and c.model_extra.get("kvactors"):
                        cache = c.model_extra["kvactors"]["cache"]
            else:
                r = await api.chat.completions.create(model=model, messages=messages, max_tokens=args.new,
                                                      temperature=0)
                text = r.choices[0].message.content or ""
                cache = (r.model_extra.get("kvactors") or {}).get("cache")
        except Exception as e:  # counted, never hidden: a failed request is lost work
            failed = f"{type(e).__name__}: {e}"
        out.append(dict(client=i, turn=turn, stream=stream, latency=time.perf_counter() - t0, ttft=ttft,
                        cache=cache, failed=failed))
        messages.append({"role": "assistant", "content": text})


async def drive(url: str, model: str, args, first: int = 0) -> tuple[float, list]:
    """Run every client (ids from `first`) at once against `url`; return (total seconds, one record per request)."""
    import openai

    api = openai.AsyncOpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=1800)
    out: list = []
    t0 = time.perf_counter()
    await asyncio.gather(*(client(api, model, i, args.turns, args, out) for i in range(first, first + args.clients)))
    total = time.perf_counter() - t0
    await api.close()
    return total, out


def percentile(xs: list, q: float) -> float:
    """The q-quantile of `xs` (nearest rank); nan when empty."""
    if not xs:
        return float("nan")
    xs = sorted(xs)
    return xs[min(len(xs) - 1, max(0, round(q * len(xs) + 0.5) - 1))]


def summarize(server: str, total: float, records: list) -> dict:
    """One result row of a server's run."""
    ok = [r for r in records if not r["failed"]]
    lat = [r["latency"] for r in ok]
    ttft = [r["ttft"] for r in ok if r["ttft"] is not None]
    states = Counter(r["cache"] for r in ok if r["cache"])
    return {"server": server, "requests": len(ok), "failed": len(records) - len(ok), "total s": total,
            "req/s": len(ok) / total, "latency p50 ms": percentile(lat, 0.5) * 1e3,
            "latency p99 ms": percentile(lat, 0.99) * 1e3, "TTFT p50 ms": percentile(ttft, 0.5) * 1e3,
            "TTFT p99 ms": percentile(ttft, 0.99) * 1e3,
            "cache states": " ".join(f"{k} {v}" for k, v in sorted(states.items())) or "-",
            "errors": sorted({r["failed"] for r in records if r["failed"]})[:5]}


def main(argv=None) -> int:
    """Run the load against each server; write the table, JSON and plot; non-zero if a request was lost."""
    ap = bench_parser(__doc__)
    ap.add_argument("--clients", type=int, default=16)
    ap.add_argument("--turns", type=int, default=8)
    ap.add_argument("--new", type=int, default=16, help="max_tokens per turn")
    ap.add_argument("--system-words", type=int, default=150)
    ap.add_argument("--turn-words", type=int, default=40)
    ap.add_argument("--servers", default="kvactors,kvactors-memory,mlx-lm,mlx-lm-default",
                    help="comma-separated, from the default: %(default)s")
    args = ap.parse_args(argv)
    env = environment()
    print(env, flush=True)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        model = bench_model_folder(args.model, Path(tmp))
        for server in args.servers.split(","):
            workdir = Path(tmp) / server
            workdir.mkdir()
            try:
                proc, url = start(server, model, workdir, args.clients)
            except RuntimeError as e:
                print(f"{server}: not measured ({e})", flush=True)
                continue
            try:
                served = str(model)
                asyncio.run(drive(url, served, argparse_copy(args, clients=2, turns=2), first=1000))  # warm up
                total, records = asyncio.run(drive(url, served, args))
            finally:
                stop(proc)
            row = summarize(server, total, records)
            print(f"{server}: {row}", flush=True)
            rows.append(row)
    base = next((r for r in rows if r["server"] == "mlx-lm"), None)
    notes = " ".join(
        f"{r['server']} against mlx-lm (mlx-lm's time / {r['server']}'s; above 1: {r['server']} is faster): "
        f"total {base['total s'] / r['total s']:.2f}, TTFT p50 {base['TTFT p50 ms'] / r['TTFT p50 ms']:.2f}, "
        f"TTFT p99 {base['TTFT p99 ms'] / r['TTFT p99 ms']:.2f}." for r in rows if base and r is not base)
    notes = (f"{args.clients} clients x {args.turns} turns, each resending its whole conversation; "
             f"even clients stream. System prompt {args.system_words} words, {args.turn_words} words a turn, "
             f"max_tokens {args.new}, temperature 0. Model {args.model}. {notes}")
    name = args.name or f"serve-{args.model}"
    write_results(name, env, rows, COLUMNS, args.out, notes=notes)
    plot(args.out / f"{name}.png", rows, f"{args.clients} clients x {args.turns} turns over HTTP, {args.model}")
    return 1 if any(r["failed"] for r in rows) else 0


def plot(path: Path, rows: list, title: str) -> None:
    """Bars of each server's latency and TTFT percentiles, in seconds."""
    plot_bars(path, {f"{r['server']} {k.removesuffix(' ms')}": r[k] / 1e3 for r in rows
                     for k in ("latency p50 ms", "latency p99 ms", "TTFT p50 ms", "TTFT p99 ms")}, "seconds", title)


def argparse_copy(args, **changes):
    """A copy of the parsed `args` with `changes`."""
    import argparse

    return argparse.Namespace(**{**vars(args), **changes})


if __name__ == "__main__":
    sys.exit(main())
