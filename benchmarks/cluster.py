"""The multi-agent workload on a Ray cluster of 1, 2 and 3 nodes: throughput against one node.

The workload's script (benchmarks/workload.py: per agent a system prompt, per turn a
user message of about --turn-tokens tokens, --new tokens generated per turn) is served
by `Runtime(cluster="ray")` on a local cluster started here with 1, 2, then 3 nodes
(`ray.cluster_utils.Cluster`, --cpus logical CPUs each, on loopback; one host, so one
batcher, per node), and, as "0 nodes", by a Runtime of one machine without Ray. Every round sends one turn to every agent at once and waits for
all replies; agents are spread evenly over the hosts. A first round (cold prefill of
the system prompts) is not timed; the timed rounds are the hot turns after it.

On one machine the nodes share its cores: on a 2-core machine a second and third node
add batchers but no cores, so the ratios here measure what the cluster layer costs and
what running batches side by side buys on the same cores, not what more machines buy.

With --gpus the sizes are GPU counts instead: a one-node Ray cluster on this machine that
declares that many GPUs, so one batcher per GPU (Ray gives each its own device), against
the same workload on one GPU.

    python -m benchmarks.cluster                      # no Ray, then 1, 2, 3 nodes; tiny model, CPU
    python -m benchmarks.cluster --nodes 1,2 --agents 8
    python -m benchmarks.cluster --model llama-8b-shape --gpus 0,1,2 --agents 16 \
        --system-tokens 2000 --turn-tokens 200 --new 64   # a machine with 2 GPUs
"""

from __future__ import annotations

import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

import mlx_lm.utils

from benchmarks.common import bench_model_folder, bench_parser, environment, write_results
from benchmarks.workload import script
from runtime import Runtime

COLUMNS = ["nodes", "gpus", "agents", "rounds", "total_s", "turns_per_s", "tokens_per_s", "x_one_node", "turn_p50_s",
           "cache_states", "runs_turns_per_s"]


def run(nodes: int, cpus: int, model_path: Path, systems, messages, new: int, gpus: int | None = None) -> dict:
    """One cluster of `nodes` nodes, or (`gpus` given) of one node with `gpus` GPUs (0 either way: a Runtime of one
    machine, no Ray): the timed rounds' wall time, throughput and cache states."""
    size = nodes if gpus is None else gpus
    if size == 0:
        with tempfile.TemporaryDirectory() as folder, Runtime(model=str(model_path), cache_dir=folder) as rt:
            return _workload(rt, systems, messages, new, hosts=0, gpus=gpus)
    import ray

    if gpus is not None:
        cluster = None
        ray.init(num_cpus=cpus, num_gpus=gpus, include_dashboard=False, log_to_driver=False, logging_level="warning")
    else:
        from ray.cluster_utils import Cluster

        cluster = Cluster(initialize_head=True, head_node_args=dict(num_cpus=cpus, object_store_memory=128 << 20,
                                                                    include_dashboard=False))
        for _ in range(nodes - 1):
            cluster.add_node(num_cpus=cpus, object_store_memory=128 << 20)
        ray.init(address=cluster.address, log_to_driver=False, logging_level="warning")
        cluster.wait_for_nodes()
    try:
        with tempfile.TemporaryDirectory() as shared, Runtime(model=str(model_path), cache_dir=shared,
                                                              cluster="ray") as rt:
            return dict(_workload(rt, systems, messages, new, hosts=size, gpus=gpus), nodes=len(set(rt.nodes())))
    finally:
        ray.shutdown()
        if cluster is not None:
            cluster.shutdown()


def _workload(rt, systems, messages, new, hosts: int, gpus: int | None) -> dict:
    """Spawn the agents, run one untimed cold round, then time the others; `hosts` batchers are expected."""
    agents = [rt.spawn(f"agent{a}", system=s) for a, s in enumerate(systems)]
    if hosts:
        placed = rt.hosts()
        assert len(placed) == hosts and all(h["agents"] for h in placed[: len(agents)]), placed
        if gpus:
            assert len({g for h in placed for g in h["gpus"]}) == gpus, placed  # one GPU each, none shared
    _round(agents, [m[0] for m in messages], new)  # cold: the system prompts' prefill, not timed
    t0, states, turn_s, tokens = time.perf_counter(), [], [], 0
    for t in range(1, len(messages[0])):
        replies, seconds = _round(agents, [m[t] for m in messages], new)
        states += [r.cache for r in replies]
        tokens += sum(len(r.tokens) for r in replies)
        turn_s.append(seconds)
    total = time.perf_counter() - t0
    turns = len(states)
    return dict(nodes=1 if gpus is not None else hosts, gpus=gpus, agents=len(systems), rounds=len(messages[0]) - 1,
                total_s=total, turns_per_s=turns / total, tokens_per_s=tokens / total,
                turn_p50_s=statistics.median(turn_s), cache_states=" ".join(sorted(set(states))))


def _round(agents, texts, new):
    start = time.perf_counter()
    futures = [a.send(text, max_tokens=new, timeout=600) for a, text in zip(agents, texts)]
    replies = [f.get(timeout=900) for f in futures]
    return replies, time.perf_counter() - start


def main(argv=None) -> int:
    ap = bench_parser(__doc__)
    ap.add_argument("--nodes", default="0,1,2,3",
                    help="cluster sizes to run, comma-separated (0: a Runtime of one machine, no Ray)")
    ap.add_argument("--gpus", default=None,
                    help="GPU counts to run instead of node counts, comma-separated: a one-node cluster declaring "
                         "that many GPUs, one batcher each (0: a Runtime of one machine, no Ray)")
    ap.add_argument("--cpus", type=int, default=2, help="logical CPUs per node")
    ap.add_argument("--agents", type=int, default=6)
    ap.add_argument("--turns", type=int, default=9, help="turns per agent (the first one is not timed)")
    ap.add_argument("--system-tokens", type=int, default=300)
    ap.add_argument("--turn-tokens", type=int, default=60)
    ap.add_argument("--new", type=int, default=16)
    ap.add_argument("--repeat", type=int, default=3, help="runs of every size; the median run is reported")
    args = ap.parse_args(argv)
    env = environment()
    env["cores"] = os.cpu_count()
    env["machine"] = f"{os.cpu_count()} cores, {platform.system()} {platform.machine()}"
    print(env, flush=True)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        model_path = bench_model_folder(args.model, Path(tmp))
        tokenizer = mlx_lm.utils.load_tokenizer(model_path)  # the driver needs no weights
        systems, messages = script(tokenizer, args.agents, args.turns, args.turn_tokens, args.system_tokens)
        sizes, runs = [int(n) for n in (args.gpus or args.nodes).split(",")], {}
        for _ in range(args.repeat):  # interleaved, so that a busy spell of a shared machine hits every size
            for size in sizes:
                gpus = size if args.gpus else None
                runs.setdefault(size, []).append(run(size, args.cpus, model_path, systems, messages, args.new, gpus))
                print(runs[size][-1], flush=True)
        for size in sizes:
            row = dict(sorted(runs[size], key=lambda r: r["turns_per_s"])[len(runs[size]) // 2])  # the median run
            row["runs_turns_per_s"] = " ".join(f"{r['turns_per_s']:.2f}" for r in runs[size])
            rows.append(row)
        one = next((r for r, size in zip(rows, sizes) if size == 1), None)
        for row in rows:
            row["x_one_node"] = row["turns_per_s"] / one["turns_per_s"] if one else None
    name = args.name or f"cluster-{args.model}" + ("-gpus" if args.gpus else "")
    if any(sizes):  # Ray ran
        import ray

        env["ray"] = ray.__version__
    if args.gpus:
        where = (f"one node of {env['machine']} declaring 1 to {max(sizes)} GPUs ({args.cpus} logical CPUs); one "
                 "batcher per GPU, each its own Ray actor process given one device by Ray")
        zero = "gpus 0: the same workload on a Runtime of one machine (no Ray, one GPU)"
    else:
        where = (f"CPU; machine: {env['machine']}; every node of the local Ray cluster shares these cores "
                 f"({args.cpus} logical CPUs declared per node); one batcher per node")
        zero = "nodes 0: the same workload on a Runtime of one machine (no Ray)"
    write_results(name, env, rows, COLUMNS, args.out,
                  notes=f"model {args.model}; {where}. {args.agents} agents x "
                        f"{args.turns} turns (the first, cold, not timed), +{args.turn_tokens} tokens and {args.new} "
                        f"generated per turn, system prompt {args.system_tokens} tokens; agents spread evenly over "
                        "the batchers; a round sends one turn to every agent and waits for all. "
                        f"Each size ran {args.repeat} times, interleaved; the row is "
                        "the median run (by turns/s), runs_turns_per_s lists them all. x_one_node: timed turns/s "
                        f"against one node (one GPU); {zero}, for what the cluster layer costs.")
    return 0


if __name__ == "__main__":
    sys.exit(main())
