"""Run the benchmark scenarios: `python -m benchmarks [SCENARIO ...] [--model M] [--out DIR]`.

Scenarios (each writes JSON, a markdown table and, where it has curves, a PNG, into a fresh
folder `benchmark-runs/<date-time>` unless `--out` says where; the README's tables are in
`benchmarks/results/cpu` and `benchmarks/results/h100`):
  ttft       cold / hot / warm time to first token at several contexts
  workload   5 agents x 8 turns: stateless re-prefill vs mlx-lm prompt cache vs kvactors
  cluster    the workload on a local Ray cluster of 1, 2 and 3 nodes: throughput against one node
  batching   batched vs sequential agents, engine overhead, resident capacity Q4 vs fp16
  q4         prefill / decode speed of the Q4 cache routes against fp16 KV
  persistence  save / load time against size and the disk's read bandwidth
  actors     actor round trips, crash-to-answer time, warm vs cold after a restart
  profile    where a turn's time goes: merge, hot prefill per shape, decode per batch size
  anatomy    one decode step's primitives by type, and its host time: build, launch, wait
  serve      `kvactors serve` under 16 clients x 8 turns over HTTP, against `mlx_lm server`
  quality    perplexity and greedy agreement of 8- and 4-bit KV caches on a real model (SmolLM2-135M)
  invariance batched against solo greedy output on a real model, prompt by prompt
With no scenario, all run. `--model tiny` (default) runs on any machine; on a GPU use
`--model llama-8b-shape` (Llama-3.1-8B's shape, random 4-bit weights). With one scenario,
any other options go to it after the model's presets, so they override them
(`python -m benchmarks workload --model llama-8b-shape --variants c`); its own options:
`python -m benchmarks.<module> --help`.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from pathlib import Path

from benchmarks.common import RESULTS

SCENARIOS = {
    "ttft": ("benchmarks.ttft", {"llama-8b-shape": ["--contexts", "1024,4096,16384,32768"],
                                 "tiny": ["--contexts", "1024,2048,3072"]}),  # the tiny model has 4,096 positions
    "workload": ("benchmarks.workload", {"llama-8b-shape": ["--system-tokens", "2000", "--turn-tokens", "200", "--new", "64"]}),
    "cluster": ("benchmarks.cluster", {}),
    "batching": ("benchmarks.batching", {"llama-8b-shape": ["--prompt", "1024", "--new", "64", "--agents", "1,2,4,8,16"]}),
    "q4": ("benchmarks.q4_attention", {"llama-8b-shape": ["--contexts", "4096,16384", "--chunk", "2048"]}),
    "persistence": ("benchmarks.persistence", {}),
    "actors": ("benchmarks.actors", {}),
    "profile": ("benchmarks.profile", {}),
    "anatomy": ("benchmarks.anatomy", {}),
    "serve": ("benchmarks.serve", {"llama-8b-shape": ["--system-words", "1500", "--turn-words", "150", "--new", "64"]}),
    "quality": ("benchmarks.quality", {}),  # always a real model: it maps the random-weight presets to the default
    "invariance": ("benchmarks.batch_invariance", {}),  # likewise
}


def main(argv=None) -> int:
    """Run the chosen scenarios in order; returns non-zero if any failed."""
    ap = argparse.ArgumentParser(prog="python -m benchmarks", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("scenarios", nargs="*", choices=[[], *SCENARIOS], metavar="SCENARIO",
                    help=f"any of {', '.join(SCENARIOS)} (default: all)")
    ap.add_argument("--model", default="tiny", help="'tiny' (any machine) or 'llama-8b-shape' (GPU)")
    ap.add_argument("--out", type=Path, default=RESULTS, help="output folder (default: %(default)s)")
    args, extra = ap.parse_known_args(argv)
    if extra and len(args.scenarios) != 1:
        ap.error(f"options {' '.join(extra)} go to one scenario: name exactly one (or run python -m benchmarks.<module>)")
    failed = []
    for name in args.scenarios or list(SCENARIOS):
        module, presets = SCENARIOS[name]
        argv = ["--out", str(args.out)] + presets.get(args.model, []) + extra
        if name != "persistence":
            argv += ["--model", args.model]
        print(f"== {name}: python -m {module} {' '.join(argv)}", flush=True)
        try:
            importlib.import_module(module).main(argv)
        except Exception as e:  # one scenario failing must not hide the others' results
            print(f"== {name} failed: {type(e).__name__}: {e}", flush=True)
            failed.append(name)
    if failed:
        print(f"failed scenarios: {', '.join(failed)}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
