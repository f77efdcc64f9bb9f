"""The actor layer's own costs.

- echo turns: an agent's whole turn path (render, prefix match, batcher message,
  durable journal write, acknowledgement) with a batcher that answers at once
  instead of running the model: round-trip latency p50 / p99, and turns per
  second with several agents at once;
- crash recovery: from an injected crash to the restarted agent's answer,
  against the first answer of a freshly spawned agent (cold start);
- warm after restart: the restarted agent's TTFT (its cache reloaded from disk)
  against the cold TTFT of the same history.

    python -m benchmarks.actors [--model tiny|llama-8b-shape]
"""

from __future__ import annotations

import sys
import tempfile
import time
from pathlib import Path

import pykka
from mlx_lm.models.cache import QuantizedKVCache

from actors.batcher import Submit
from benchmarks.common import bench_model_folder, bench_parser, environment, plot_bars, write_results
from benchmarks.ttft import long_text
from runtime import AgentCrashed, Runtime
from runtime.engine import Timings, TurnResult
from runtime.api.testing import inject_crash

COLUMNS = ["measure", "value", "unit", "note"]


class EchoBatcher(pykka.ThreadingActor):
    """Answers every turn at once with an empty cache: the actor path without the model."""

    def __init__(self, n_layers):
        super().__init__()
        self.n_layers = n_layers

    def on_receive(self, message):
        if isinstance(message, Submit):
            t = message.turn
            cache = [QuantizedKVCache(group_size=64, bits=4) for _ in range(self.n_layers)]
            message.reply(TurnResult(t.turn_id, t.agent_id, [0], "echo", cache, 0, "stop", Timings()))


def echo(model_path, cache_dir, n, agents):
    with Runtime(model=model_path, cache_dir=cache_dir, warmup=False) as rt:
        rt._env.refs["@batcher"] = EchoBatcher.start(rt.spec.n_layers)
        refs = [rt.spawn(f"echo{i}") for i in range(agents)]
        lat = []
        for i in range(n):
            t0 = time.perf_counter()
            refs[0].ask(f"ping {i}", timeout=30)
            lat.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        futures = [r.send(f"ping {i}") for i in range(n) for r in refs]
        for f in futures:
            f.get(timeout=60)
        rate = len(futures) / (time.perf_counter() - t0)
        rt._env.refs["@batcher"].stop()
    lat.sort()
    return lat[len(lat) // 2], lat[int(len(lat) * 0.99) - 1], rate


def recovery(model_path, cache_dir, context, max_tokens):
    with Runtime(model=model_path, cache_dir=cache_dir, warmup=False) as rt:
        system = long_text(rt.tokenizer, context)
        t0 = time.perf_counter()
        a = rt.spawn("crashy", system=system)
        cold = a.ask("first question", max_tokens=max_tokens, timeout=600)
        cold_start_s = time.perf_counter() - t0
        a.ask("second question", max_tokens=max_tokens, timeout=600)
        inject_crash(a)
        try:
            a.ask("this turn crashes", max_tokens=max_tokens, timeout=600)
        except AgentCrashed:
            pass
        t0 = time.perf_counter()
        after = a.ask("are you back?", max_tokens=max_tokens, timeout=600)
        recovered_s = time.perf_counter() - t0
    return cold_start_s, recovered_s, cold.timings.ttft_s, after


def main(argv=None) -> int:
    ap = bench_parser(__doc__)
    ap.add_argument("--echo-turns", type=int, default=200)
    ap.add_argument("--agents", type=int, default=4)
    ap.add_argument("--context", type=int, default=1024, help="history tokens for the crash and warm measures")
    ap.add_argument("--max-tokens", type=int, default=8)
    args = ap.parse_args(argv)
    env = environment()
    print(env, flush=True)
    with tempfile.TemporaryDirectory() as tmp:
        model_path = bench_model_folder(args.model, Path(tmp))
        p50, p99, rate = echo(model_path, Path(tmp) / "echo", args.echo_turns, args.agents)
        recovery(model_path, Path(tmp) / "warmup", 128, args.max_tokens)  # compile kernels
        cold_start, recovered, cold_ttft, after = recovery(model_path, Path(tmp) / "crash", args.context, args.max_tokens)
    rows = [
        dict(measure="echo turn round trip p50", value=p50 * 1e3, unit="ms", note="durable journal write included"),
        dict(measure="echo turn round trip p99", value=p99 * 1e3, unit="ms"),
        dict(measure=f"echo turns/s, {args.agents} agents", value=rate, unit="turns/s"),
        dict(measure="cold start to first answer", value=cold_start, unit="s", note=f"spawn + {args.context}-token prefill"),
        dict(measure="crash to restarted agent's answer", value=recovered, unit="s",
             note=f"x cold start {recovered / cold_start:.3f}; its cache: {after.cache}"),
        dict(measure="TTFT after restart / cold TTFT", value=after.timings.ttft_s / cold_ttft, unit="ratio",
             note=f"{after.timings.ttft_s * 1e3:.1f} ms vs {cold_ttft * 1e3:.1f} ms"),
    ]
    name = args.name or f"actors-{args.model}"
    write_results(name, env, rows, COLUMNS, args.out, notes=f"model {args.model}")
    plot_bars(args.out / f"{name}.png", {"cold start": cold_start, "crash to answer": recovered,
                                         "cold TTFT": cold_ttft, "TTFT after restart": after.timings.ttft_s},
              "seconds", f"recovery against a cold start, {args.model}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
