"""Profile the engine in place: the workload's turns through a Runtime, with cProfile on the batcher.

Runs `--rounds` rounds of the multi-agent workload (variant c, no restart) and
profiles every `Engine.step` on the batcher's thread: which Python functions
and MLX calls (graph building, `async_eval`, waiting in `tolist`/`eval`) take
the time. Prints the top functions by own time and by cumulative time, and the
engine's stats.

    python -m benchmarks.inplace --model llama-8b-shape        # GPU
"""

from __future__ import annotations

import cProfile
import sys
import tempfile
from pathlib import Path

import mlx_lm

from benchmarks.common import bench_model_folder, bench_parser, environment, profile_text
from benchmarks.workload import engine_profile, script
from runtime import Runtime
from runtime.engine import Engine


def main(argv=None) -> int:
    ap = bench_parser(__doc__)
    ap.add_argument("--agents", type=int, default=5)
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--system-tokens", type=int, default=2000)
    ap.add_argument("--turn-tokens", type=int, default=200)
    ap.add_argument("--new", type=int, default=64)
    ap.add_argument("--top", type=int, default=35)
    args = ap.parse_args(argv)
    print(environment(), flush=True)
    profiler = cProfile.Profile()
    step = Engine.step

    def profiled(engine):
        profiler.enable()
        try:
            return step(engine)
        finally:
            profiler.disable()

    with tempfile.TemporaryDirectory() as tmp:
        path = bench_model_folder(args.model, Path(tmp))
        _, tokenizer = mlx_lm.load(str(path))
        systems, messages = script(tokenizer, args.agents, args.rounds + 1, args.turn_tokens, args.system_tokens)
        with Runtime(model=path, cache_dir=Path(tmp) / "agents", warmup=False) as rt:
            agents = [rt.spawn(f"agent{a}", system=s) for a, s in enumerate(systems)]
            for t in range(args.rounds + 1):
                if t == 1:  # the first round warms up every path
                    Engine.step = profiled
                futures = [agent.send(messages[a][t], max_tokens=args.new, timeout=600) for a, agent in enumerate(agents)]
                print([f.get(timeout=900).cache for f in futures], flush=True)
            Engine.step = step
            print(engine_profile([rt.engine_stats()]), flush=True)
    print(profile_text(profiler, args.top, ("tottime", "cumulative")), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
