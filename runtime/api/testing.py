"""Faults on purpose, for tests and demos."""

from __future__ import annotations

import contextlib
import threading

import pykka

from actors import agent as agent_mod
from actors import pykka_compat
from actors.agent import AgentCrashed


def inject_crash(ref) -> None:
    """Make the agent behind `ref` (an `AgentRef`, of a Runtime or a `ClusterRuntime`) crash at the end of its next
    turn.

    The crash comes before anything of that turn is written, so supervision restarts the
    agent and the turn's caller gets `AgentCrashed`. Raises `AgentCrashed` at once if the
    agent is restarting now (retry). On a cluster, the agent's host runs this through Ray's
    `__ray_call__` (as `held_stops` does).
    """
    runtime = ref.runtime
    if hasattr(runtime, "_hosts"):  # a ClusterRuntime: crash it on its host
        from runtime.api import cluster

        host = runtime._hosts[runtime._index(ref.name)]
        cluster._value(runtime._ray.get(host.__ray_call__.remote(_crash_on_host, ref.name)))
        return
    _crash(runtime, ref.name)


def _crash_on_host(host, name) -> tuple:
    """On `host` (a NodeHost): `_crash` its agent `name`; ("ok", None) or ("error", packed), as host methods answer."""
    from runtime.api import rayhost

    return rayhost.outcome(_crash, host.rt, name)


def _crash(runtime, name) -> None:
    try:
        runtime._ref(name).tell(agent_mod._Fault())
    except pykka.ActorDeadError:
        raise AgentCrashed(None, f"agent {name!r} is restarting; retry") from None


def host_pid(runtime, node_id: str) -> int:
    """The process id of the host on Ray node `node_id` of a `ClusterRuntime`, to kill it on purpose.

    Raises KeyError if no host of `runtime` lives on that node.
    """
    return runtime._info[_host_index(runtime, node_id)]["pid"]


def restarted_unnoticed(runtime, node_id: str, timeout: float = 60.0) -> None:
    """Kill the process of the host of `runtime` (a `ClusterRuntime`) on Ray node `node_id`, and return once Ray has
    restarted it: the new process answers Ray, and `runtime` is not told (it learns of it at its next call there).

    Raises KeyError if no host of `runtime` lives on that node, TimeoutError if it is not back within `timeout` s.
    """
    import os
    import time

    index = _host_index(runtime, node_id)
    pid = runtime._info[index]["pid"]
    os.kill(pid, 9)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            if runtime._ray.get(runtime._hosts[index].info.remote(), timeout=5)[1]["pid"] != pid:
                return
        except Exception:  # noqa: BLE001 - not back yet
            pass
        time.sleep(0.2)
    raise TimeoutError(f"the host on node {node_id} was not restarted within {timeout:g} s")


@contextlib.contextmanager
def held_stops(runtime, node_id: str, wait_s: float):
    """Hold up the stops of agents on the host of `runtime` (a `ClusterRuntime`) on Ray node `node_id` in the block.

    That host's agents' supervisor is kept busy, so a stop there (`AgentRef.stop`, `forget`) does not finish and
    raises WaitTimeout after `wait_s` seconds (instead of STOP_WAIT_S); when the block exits, the stops go on.
    The host runs this through Ray's `__ray_call__` (its developer API for running a function on an actor).
    Raises KeyError if no host of `runtime` lives on that node.
    """
    host = runtime._hosts[_host_index(runtime, node_id)]
    runtime._ray.get(host.__ray_call__.remote(_hold_stops, wait_s))
    try:
        yield
    finally:
        runtime._ray.get(host.__ray_call__.remote(_release_stops))


def _host_index(runtime, node_id: str) -> int:
    for i, info in enumerate(runtime._info):
        if info["node_id"] == node_id:
            return i
    raise KeyError(f"no host of this runtime on node {node_id}")


_HELD: dict = {}  # in a host's process, while `held_stops` holds it: what `_release_stops` undoes


def park_supervisor(runtime, hold_s: float = 120.0) -> threading.Event:
    """Park the agents' supervisor of `runtime` (a Runtime) inside a `children()` call until the returned event is
    set (or `hold_s` seconds pass): meanwhile it starts, restarts and stops no agent. Returns once it is parked;
    RuntimeError if it does not take the call within 30 s."""
    supervisor = pykka_compat.actor_of(runtime._supervisor)
    entered, release = threading.Event(), threading.Event()
    children = supervisor.children

    def parked():
        entered.set()
        release.wait(hold_s)
        return children()

    supervisor.children = parked
    runtime._supervisor.proxy().children()  # not waited for: the supervisor runs it, and waits there
    try:
        if not entered.wait(30):
            raise RuntimeError("the agents' supervisor never took the call")
    finally:
        del supervisor.children  # the class's method again; the parked call goes on
    return release


def _hold_stops(host, wait_s: float) -> None:
    """On `host` (a NodeHost): park its agents' supervisor (`park_supervisor`); stops there wait `wait_s`."""
    from runtime.api import facade

    _HELD.update(release=park_supervisor(host.rt), stop_wait_s=facade.STOP_WAIT_S)
    facade.STOP_WAIT_S = wait_s


def _release_stops(host) -> None:
    """On `host`: undo `_hold_stops`, if it holds them (a host that Ray restarted meanwhile holds nothing)."""
    from runtime.api import facade

    if _HELD:
        facade.STOP_WAIT_S = _HELD.pop("stop_wait_s")
        _HELD.pop("release").set()
