"""Faults on purpose, for tests and demos."""

from __future__ import annotations

import pykka

from actors import agent as agent_mod
from actors.agent import AgentCrashed


def inject_crash(ref) -> None:
    """Make the agent behind `ref` (an `AgentRef`) crash at the end of its next turn.

    The crash comes before anything of that turn is written, so supervision restarts the
    agent and the turn's caller gets `AgentCrashed`. Raises `AgentCrashed` at once if the
    agent is restarting now (retry).
    """
    try:
        ref.runtime._ref(ref.name).tell(agent_mod._Fault())
    except pykka.ActorDeadError:
        raise AgentCrashed(None, f"agent {ref.name!r} is restarting; retry") from None


def host_pid(runtime, node_id: str) -> int:
    """The process id of the host on Ray node `node_id` of a `ClusterRuntime`, to kill it on purpose.

    Raises KeyError if no host of `runtime` lives on that node.
    """
    for info in runtime._info:
        if info["node_id"] == node_id:
            return info["pid"]
    raise KeyError(f"no host of this runtime on node {node_id}")
