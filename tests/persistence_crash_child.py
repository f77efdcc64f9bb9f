"""Child process of the crash test (tests/test_persistence.py): writes forever until killed.

`python tests/persistence_crash_child.py CACHE_DIR` resumes each agent after the last
seq in its journal, then loops: submits writes (a cache + a journal record) through a
PersistenceActor, a few in flight at a time, and prints `ack <agent> <seq>` once each is
acknowledged. Every write's content is a pure function of (agent, seq): `expected`.
"""

import sys
import types
import zlib
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from actors.persistence import PersistenceActor, submit  # noqa: E402
from runtime import store  # noqa: E402

AGENTS = ("alpha", "beta")
SPEC = types.SimpleNamespace(
    fingerprint="crash", n_layers=2, n_kv_heads=2, k_head_dim=64, v_head_dim=64, kv_bits=4, kv_group_size=64,
    model_id="crash-test-model",
)
IN_FLIGHT = 3


def expected(agent: str, seq: int):
    """(HostCache, CacheMeta, journal record) written for `agent` at `seq`."""
    rng = np.random.default_rng([seq, zlib.crc32(agent.encode())])
    T = int(rng.integers(1, 3000))  # up to ~1 MB, so kills land inside writes too
    dtype = ("float32", "bfloat16")[seq % 2]
    scale = np.uint16 if dtype == "bfloat16" else np.float32
    tensors = {}
    for i in range(SPEC.n_layers):
        for kind in ("keys", "values"):
            tensors[f"layers.{i}.{kind}.packed"] = rng.integers(0, 2**32, (1, 2, T, 8), dtype=np.uint32)
            for part in ("scales", "biases"):
                tensors[f"layers.{i}.{kind}.{part}"] = rng.integers(0, 2**15, (1, 2, T, 1)).astype(scale)
    host = store.HostCache(tensors, dtype, 4, 64, SPEC.n_layers, T)
    text = f"{agent}:{seq}:" + "x" * T
    meta = store.CacheMeta(seq, list(range(T)), list(range(len(text) - T + 1, len(text) + 1)), text, f"turn-{seq}", created=1.0)
    record = {"seq": seq, "turn_id": f"turn-{seq}", "role": "assistant", "sender": agent, "text": text[:200]}
    return host, meta, record


def main(cache_dir: str) -> None:
    ref = PersistenceActor.start(cache_dir, SPEC)
    seqs = {}
    for agent in AGENTS:
        records = store.read_journal(cache_dir, SPEC, agent)
        seqs[agent] = records[-1]["seq"] + 1 if records else 0
    print("ready", flush=True)
    in_flight = []
    while True:
        for agent in AGENTS:
            seq = seqs[agent]
            host, meta, record = expected(agent, seq)
            in_flight.append((agent, seq, submit(ref, agent, seq, host, meta, [record])))
            seqs[agent] += 1
        while len(in_flight) > IN_FLIGHT:
            agent, seq, future = in_flight.pop(0)
            future.get(timeout=30)
            print(f"ack {agent} {seq}", flush=True)


if __name__ == "__main__":
    main(sys.argv[1])
