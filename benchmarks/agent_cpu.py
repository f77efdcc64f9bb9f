"""How long each agent message holds an agent's thread on a CPU, and where: the agent's Python shares the GIL
with the engine's thread, so a long message is a decode step that waits.

    python -m benchmarks.agent_cpu --layers 32 --system-tokens 2000

Runs --agents agents for --turns rounds on a tiny llama of --layers layers (any machine; the agent's work
scales with the layers and the conversation, not the model's width), timing every `AgentActor.on_receive`
with the thread's CPU clock and profiling it; prints the longest messages and the functions that took most.
On CI's CPU the defaults take minutes: MLX's CPU prefill of the 2,000-token prompts dominates the run.
"""

from __future__ import annotations

import collections
import cProfile
import pstats
import tempfile
import threading
import time
from pathlib import Path

import mlx_lm

from actors import agent as agent_module
from benchmarks.common import environment
from benchmarks.workload import script
from runtime.api.facade import Runtime
from runtime.tiny import make_tiny_model


def main(argv=None) -> int:
    import argparse

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--agents", type=int, default=5)
    ap.add_argument("--turns", type=int, default=4)
    ap.add_argument("--system-tokens", type=int, default=2000)
    ap.add_argument("--turn-tokens", type=int, default=200)
    ap.add_argument("--new", type=int, default=16)
    ap.add_argument("--top", type=int, default=20, help="functions to list, by their own time")
    args = ap.parse_args(argv)
    print(environment(), flush=True)
    messages, profiles, lock = [], [], threading.Lock()
    receive = agent_module.AgentActor.on_receive

    def timed(self, message):
        c0, t0, profile = time.thread_time(), time.perf_counter(), cProfile.Profile()
        profile.enable()
        try:
            return receive(self, message)
        finally:
            profile.disable()
            with lock:
                messages.append(((time.thread_time() - c0) * 1e3, (time.perf_counter() - t0) * 1e3,
                                 type(message).__name__))
                profiles.append(profile)

    with tempfile.TemporaryDirectory() as tmp:
        path = make_tiny_model(Path(tmp) / "model", arch="llama", num_hidden_layers=args.layers)
        _, tokenizer = mlx_lm.load(str(path))
        systems, texts = script(tokenizer, args.agents, args.turns, args.turn_tokens, args.system_tokens)
        agent_module.AgentActor.on_receive = timed
        try:
            with Runtime(model=str(path), cache_dir=Path(tmp) / "agents", warmup=False) as rt:
                agents = [rt.spawn(f"agent{a}", system=s) for a, s in enumerate(systems)]
                for t in range(args.turns):
                    futures = [a.send(texts[i][t], max_tokens=args.new, timeout=600) for i, a in enumerate(agents)]
                    for f in futures:
                        f.get(timeout=900)
                rt.flush()
        finally:
            agent_module.AgentActor.on_receive = receive
    messages.sort(reverse=True)
    print("longest messages (CPU ms, wall ms, kind):",
          [(round(c, 1), round(w, 1), kind) for c, w, kind in messages[:10]], flush=True)
    by_kind = collections.defaultdict(list)
    for c, _, kind in messages:
        by_kind[kind].append(c)
    print("by kind (messages, CPU ms in all, longest):",
          {k: (len(v), round(sum(v), 1), round(max(v), 1)) for k, v in by_kind.items()}, flush=True)
    stats = pstats.Stats(profiles[0])
    for p in profiles[1:]:
        stats.add(p)
    stats.sort_stats("tottime").print_stats(args.top)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
