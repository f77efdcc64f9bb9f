"""The Runtime on a Ray cluster: the same agents, spread over its nodes.

    with Runtime(model="tiny", cache_dir="/shared/kvactors", cluster="ray") as rt:   # or address="auto"
        alice = rt.spawn("alice", system="You are Alice.")
        r = alice.ask("hi", max_tokens=64, timeout=60)

`Runtime(..., cluster="ray")` (or `address=`) returns a `ClusterRuntime`. It starts
one `NodeHost` Ray actor per GPU of the cluster (one per node when the nodes have no
GPU), each loading the model itself and running the agents placed with it (see
runtime/api/rayhost.py). Agents are the same `AgentRef`s: `spawn`, `agent`,
`ask`, `send`, `send_to`, `stream`, `astream`, `note`, `reset`, `result`, `history`, `stop`, `converse`
and `broadcast` behave as on one machine. An agent is placed on the host with the
fewest agents and stays there; its cache stays on that node, its messages cross.

`cache_dir` must be a folder every node sees at the same path (a shared file
system): it holds the journals and caches in the format of one machine, and the
per-agent locks that keep one live actor per agent name across the cluster. A host
holds an agent's lock until its actor has stopped, or has exited and was not
restarted (a temporary agent that crashed): `running()`, `placement()` and `hosts()` ask
the hosts, as one machine asks its supervisor, so such an agent is not running; once
one of them, a call to it or a spawn of its name finds it gone, its host lets go of
its lock, the cluster forgets where it was (a recovery of that host does not start it
again), and the name starts again on any host. (An exit that nothing asked about before
its host's process died cannot be told from an agent that ran: the recovery starts it.)
A stop that ran past its wait
(WaitTimeout) keeps it, and the next spawn, stop or forget of the name goes to that
host and waits for the stop there, as on one machine.

When a host's node dies, Ray reports its actor dead: the turns in flight there fail
with AgentCrashed (retry them with the same turn id: a turn that had committed
answers "committed", nothing runs twice), and its agents are started again on the
other hosts, where they reload their durable state from the shared folder ("warm").
When only a host's process dies, Ray restarts it in place (`max_restarts`) and its
agents are started again there. An agent that a recovery could not start again (such as
one whose lock another process holds) still counts as running: each call on it, and each
recovery of its host, starts it again (a call raises AgentCrashed, saying to retry,
while that fails), and a stop of it is done at once. A stop or forget of an agent whose
host died so recovers it too: the agent's actor died with the process and its files stay
on the shared disk, so the stop is done (a forget then deletes the files on a live host).
What was acknowledged is on the shared disk, so nothing acknowledged is lost.

`stream`/`astream` and the `on_token`, `on_progress` and `cancel` callbacks work as
on one machine (the same pieces, then the same Reply), but the callbacks run in this
process, on a thread of the runtime's, not on the batcher's thread: the host relays
the turn's pieces and progress as they come (see `NodeHost.events`). `cancel` is asked
after each piece that arrives here, so a cancelled turn ends a few tokens later than on
one machine. A reply future's done callbacks run on a thread of the runtime's too (never
on Ray's own, where a call that waits for Ray would never return): `spawn` and `send`
work there, as on one machine. `agents()` and `flush()` cover every host;
`engine_stats()` gives one snapshot per host. `ask_async` and `astream` cancelled before
their turn is told to the agent send nothing, as on one machine: the host, which waits
for an agent that restarts, asks right before it tells the agent whether the call was
cancelled (a cancellation that reaches it later goes on as a sent turn). Not on a
cluster: `on_escalate`.
"""

from __future__ import annotations

import inspect
import itertools
import logging
import threading
import time
import uuid

from actors.agent import AgentCrashed, Ask, Lookup, Note, Reset, UnknownAgent
from runtime import store
from runtime.api import rayhost
from runtime.api.facade import (AgentInfo, AgentRef, DeadLetter, DeadLetters, Runtime, RuntimeClosed, WaitTimeout,
                                _begin_send, _check_options, _choice, _positive, cache_folder, not_running,
                                shutdown_on_exit)
from runtime.engine import CallbackFailed, passes_through
from runtime.errors import InvalidArgument, InvalidArgumentType, KvactorsError
from runtime.kvscheme import from_options as scheme_from_options

log = logging.getLogger(__name__)
CLUSTERS = ("ray",)
RECOVER_S = 60.0  # how long a host that Ray reports unavailable may take to come back or be reported dead
HOST_THREADS = 64  # a host's concurrent calls but for the waits below
WAIT_THREADS = 256  # a host's concurrent waits for an agent's answer (`NodeHost.wait`, `events`): one a turn in
# flight there and one a forwarded note's recipient, in a group of their own, so that they never hold up a call;
# past that many, waits queue (Ray makes a group's threads at the host's start: 1,024 took 1,100 threads a host)


class RayMissing(KvactorsError, ImportError):
    """`cluster="ray"` was asked for, but Ray is not installed: `pip install 'kvactors[ray]'`."""


class NodeDown(rayhost.ClusterError):
    """The host of an agent did not answer: Ray reports its actor unavailable or dead.

    `ClusterRuntime` handles it (the agents move, or wait for Ray's restart); it reaches
    a caller only when an agent could not be reached twice in a row: retry.
    """

    def __init__(self, index: int, cause):
        super().__init__(f"host {index}: {cause}; its agents are being started again: retry")
        self.index = index


def import_ray():
    """The `ray` module; RayMissing (saying what to install) if it is not importable."""
    try:
        import ray
    except ImportError as e:
        raise RayMissing(f"Runtime(cluster='ray') needs Ray: pip install 'kvactors[ray]' ({e})") from None
    return ray


class ClusterRuntime:
    """Agents on one model, on the nodes of a Ray cluster; see the module docstring. Use as a context manager.

    Takes `Runtime`'s options (checked the same way, here, before anything starts) and
    `cluster` ("ray") / `address` (a running cluster's address, passed to `ray.init`;
    None with `cluster="ray"`: the cluster this process is connected to, or a new
    local one). `max_restarts` is also how often Ray restarts a host's process.
    Raises RayMissing without Ray, ValueError for `on_escalate` (supervision that gives
    up stops that node's host alone; its agents' calls then raise RuntimeEscalated), and
    ValueError for an `address` other than the cluster this process is connected to.
    """

    converse = Runtime.converse  # the same round-robin and fan-out: they only use AgentRefs
    broadcast = Runtime.broadcast
    agent = Runtime.agent  # the same checks of the same names
    _name_held = Runtime._name_held  # the same rule: one spawn, stop or forget of a name at a time

    def __init__(self, model=None, cache_dir=None, kv_bits=None, memory_budget=None, *, cluster: str | None = None,
                 address: str | None = None, **options):
        if cluster is not None:
            _choice("cluster", cluster, CLUSTERS)
        if address is not None and not isinstance(address, str):
            raise InvalidArgumentType(f"address must be a str (such as 'ray://head:10001' or 'auto') or None, "
                                      f"got {type(address).__name__}")
        ray = import_ray()
        if options.get("on_escalate") is not None:
            raise InvalidArgument("on_escalate is not supported on a cluster: "
                                  "a host whose supervision gives up stops alone")
        bound = inspect.signature(Runtime.__init__).bind(None, model, cache_dir, kv_bits, memory_budget, **options)
        bound.apply_defaults()
        runtime_options = {k: v for k, v in bound.arguments.items()
                           if k not in ("self", "model", "cache_dir", "cluster", "address")}
        scheme_from_options(runtime_options["kv_bits"], runtime_options["kv_group_size"], runtime_options["kv_scheme"])
        _check_options(**{k: runtime_options[k] for k in inspect.signature(_check_options).parameters})
        self.cache_dir = cache_folder(cache_dir)
        self._ray, self._owns_ray, self._closed = ray, False, False
        self._lock = threading.RLock()  # the placement tables below: held while agents move, never for a stop
        self._naming = threading.Lock()  # `_name_held`: one lock per agent name, held while a host starts or stops it
        self._name_locks: dict[str, threading.RLock] = {}
        self._pending: dict[str, int] = {}  # agent -> the host that a spawn is starting it on (`_least_loaded`)
        self._names: dict[str, None] = {}  # running agents' ids, in spawn order
        self._where: dict[str, int] = {}  # agent -> host index
        self._serials: dict[str, int] = {}  # agent -> its placement's serial number (`_place`): which placement it is
        self._serial = itertools.count()
        self._restart: dict[str, str] = {}  # agent -> its restart type
        self._stopping: dict[str, int] = {}  # agent -> the host where its stop ran past its wait (`_on_host_of`)
        self._unstarted: set[str] = set()  # placed agents that a recovery could not start again (`_recover`)
        self._letters = DeadLetters()  # what `_deliver` found undeliverable (`_dead_letter`)
        self._hosts_letters: list[DeadLetter] = []  # the hosts' letters as `shutdown` found them (`dead_letters`)
        self._hosts: list = []
        self._info: list[dict] = []
        self._dead: set[int] = set()
        self._recovering: dict[int, threading.Lock] = {}  # host -> held while it is recovered (`_recover`)
        self._connect(address)
        try:
            self._start_hosts(model, runtime_options)
        except BaseException:
            self.shutdown()
            raise
        self.max_context = self._info[0]["max_context"]
        self.longest_token_chars = self._info[0]["longest_token_chars"]
        self.vocab_size = self._info[0]["vocab_size"]  # what `AgentRef.reset` checks a record's token ids against
        self.fingerprint = self._info[0]["fingerprint"]

    def _connect(self, address):
        """Connect to the cluster at `address` (None: the one this process is on, or a new local one)."""
        ray = self._ray
        if ray.is_initialized():
            here = ray.get_runtime_context().gcs_address
            if address not in (None, "auto") and not address.startswith("ray://") and address != here:
                raise InvalidArgument(f"this process is connected to the Ray cluster at {here}, not {address}: "
                                      "call ray.shutdown() first, or pass address=None")
            return
        if address is None:  # a new local cluster: no dashboard to serve
            ray.init(include_dashboard=False, log_to_driver=False, logging_level="warning")
        else:
            ray.init(address=address, log_to_driver=False, logging_level="warning")
        self._owns_ray = True

    def _start_hosts(self, model, options):
        """One NodeHost per GPU (per node without GPUs), pinned to its node; wait until every one has the model."""
        from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

        ray = self._ray
        directory = f"kvactors-directory-{uuid.uuid4().hex}"  # hosts find it by name: no handle in their arguments
        here = NodeAffinitySchedulingStrategy(ray.get_runtime_context().get_node_id(), soft=True)  # dies with us only
        self._directory = ray.remote(rayhost.Directory).options(num_cpus=0, name=directory,
                                                                scheduling_strategy=here).remote()
        host_class = ray.remote(concurrency_groups={rayhost.WAITS: WAIT_THREADS})(rayhost.NodeHost)
        for node in sorted((n for n in ray.nodes() if n["Alive"]), key=lambda n: n["NodeID"]):
            gpus = int(node["Resources"].get("GPU", 0))
            for _ in range(max(1, gpus)):
                self._hosts.append(host_class.options(
                    num_cpus=0, num_gpus=1 if gpus else 0, max_restarts=options["max_restarts"], max_concurrency=HOST_THREADS,
                    scheduling_strategy=NodeAffinitySchedulingStrategy(node["NodeID"], soft=False),
                ).remote(model, str(self.cache_dir), options, directory))
        self._info = [_value(ray.get(h.info.remote())) for h in self._hosts]

    # -- agents ------------------------------------------------------------------

    def spawn(self, name: str, system: str = "", restart: str = "permanent", *, reset: bool = False,
              timeout: float = 60.0) -> AgentRef:
        """Start agent `name` on the host with the fewest agents (resuming it from `cache_dir`); return its ref.

        As `Runtime.spawn`; also raises AgentInUse if a process outside this runtime runs it. An agent whose
        stop ran past its wait starts on the host that stops it, once that stop is done (WaitTimeout meanwhile).
        Another spawn, stop or forget of the name waits for this one (`_name_held`; WaitTimeout past `timeout`);
        calls on other agents do not.
        """
        self._check_running()
        store.check_agent_id(name)
        _positive("timeout", timeout)
        with self._name_held(name, timeout):
            if self._actor_alive(name):  # not one that exited there and was not restarted (it is unplaced)
                raise InvalidArgument(f"agent {name!r} is already running; use rt.agent({name!r})")
            with self._lock:
                self._pending[name] = index = self._spawn_host(name)
            try:
                for attempt in range(2):
                    try:
                        started = self._on_host_of(name, index, "spawn", system, restart, reset, timeout)
                    except NodeDown:
                        if attempt:
                            raise
                        self._recover(index)
                    else:
                        if self._place_running(name, index, started, restart):
                            return AgentRef(self, name)
                        self._recover(index)  # Ray may have restarted it before this spawn, and nothing noticed
                        if self._place_running(name, index, started, restart):
                            return AgentRef(self, name)
                        if attempt:  # its host was recovered, without it, as it started it there
                            raise NodeDown(index, f"it was restarted as it started agent {name!r}")
                    with self._lock:
                        self._pending.pop(name, None)  # not counted by `_least_loaded` as it picks again
                        self._pending[name] = index = self._spawn_host(name)
            finally:
                with self._lock:
                    self._pending.pop(name, None)

    def _place_running(self, name, index, incarnation, restart) -> bool:
        """Place agent `name` (restart type `restart`) on host `index`, where it runs on the host's `incarnation`,
        if that is the host as this runtime knows it (alive, and not restarted since: a recovery brings an earlier
        view up to date); whether it did. Otherwise the agent died with that incarnation, or its host is not yet
        recovered (`_recover`)."""
        with self._lock:
            if index in self._dead or self._info[index]["incarnation"] != incarnation:
                return False
            self._place(name, index)
            self._restart[name] = restart
            self._names[name] = None
            return True

    def running(self) -> list[str]:
        """Names of the running agents, in spawn order: not a temporary agent that exited. Raises RuntimeClosed after
        `shutdown`.

        As on one machine, where the supervisor is asked: each host with agents placed on it is asked which of them
        run there (`Runtime.running`), and lets go of the lock of any that exited (`_running_where`). An agent whose
        host does not answer (it is down: its agents start again) counts as running."""
        self._check_running()
        return list(self._running_where())

    def _running_where(self) -> dict[str, int]:
        """Running agent -> its host index, in spawn order, as the hosts with agents placed on them answer
        (`_runs_on`). An agent its host no longer runs (it exited and was not restarted: a temporary agent that
        crashed) is unplaced: no longer listed, and not started again by its host's recovery."""
        with self._lock:
            placed = [(n, self._where[n], self._serials[n]) for n in self._names]
        on_host = {index: self._runs_on(index) for index in {i for _, i, _ in placed}}
        where = {}
        for name, index, serial in placed:
            if self._counts_as_running(name, on_host[index]):
                where[name] = index
            else:
                self._unplace_exited(name, serial)
        return where

    def _actor_alive(self, name: str) -> bool:
        """Whether agent `name` runs on its host (`Runtime._actor_alive`): that host alone is asked, so a group
        call or `agent()` asks one host an agent rather than every host (`running()`). One that exited there is
        unplaced (`_running_where`)."""
        with self._lock:
            index, serial = self._where.get(name), self._serials.get(name)
        if index is None:
            return False
        if self._counts_as_running(name, self._runs_on(index)):
            return True
        self._unplace_exited(name, serial)
        return False

    def _counts_as_running(self, name: str, runs: set | None) -> bool:
        """Whether placed agent `name` counts as running, its host answering that it runs `runs` (`_runs_on`): if
        it runs there, if its host did not answer (its agents start again), or if a recovery could not start it
        again (`_recover`: its next call does)."""
        return runs is None or name in runs or name in self._unstarted

    def _runs_on(self, index: int) -> set | None:
        """The agents host `index` runs (its `Runtime.running`, which lets go of the locks of agents that exited),
        or None where it is down and does not answer, or answers as a new incarnation that is not yet recovered:
        its agents start again, and count as running meanwhile."""
        if index in self._dead:
            return None
        try:
            names, incarnation = self._call(index, "running")
        except (AgentCrashed, rayhost.ClusterError):  # a host that just died
            return None
        return set(names) if incarnation == self._info[index]["incarnation"] else None

    def _unplace_exited(self, name: str, serial: int) -> None:
        """Unplace agent `name`, which its host answered it no longer runs, unless it was placed again since that
        placement (`serial`): spawned again, or started again by a recovery."""
        with self._lock:
            if self._serials.get(name) == serial:
                self._unplace(name)

    def placement(self) -> dict[str, str]:
        """Running agent name -> the Ray node id it runs on now, in spawn order; the hosts are asked, as in
        `running()`: an agent that exited is not listed."""
        where = self._running_where()
        with self._lock:
            return {name: self._info[i]["node_id"] for name, i in where.items()}

    def hosts(self) -> list[dict]:
        """The live hosts, in host order: each {"node_id", "gpus" (the GPU ids Ray gave it; [] on CPU), "pid",
        "agents" (the running agents on it, in spawn order)}; the hosts are asked, as in `running()`."""
        where = self._running_where()
        with self._lock:
            return [dict(node_id=info["node_id"], gpus=list(info["gpus"]), pid=info["pid"],
                         agents=[n for n, at in where.items() if at == i])
                    for i, info in enumerate(self._info) if i not in self._dead]

    def nodes(self) -> list[str]:
        """The Ray node ids of the live hosts (one per GPU, or per node), in host order."""
        return [info["node_id"] for i, info in enumerate(self._info) if i not in self._dead]

    def forget(self, name: str, timeout: float = 60.0) -> bool:
        """Stop agent `name` if it runs and delete its cache and journal; return whether any were stored.

        As `Runtime.forget`: WaitTimeout if the agent's stop (or another wait) takes more than `timeout` seconds;
        the stop goes on, and the files stay until a call again finds it done. Only calls on this name wait for it
        (`_leave`). Whether any were stored is whether they were when this call began, as the shared folder says
        here: a host asked again (`_leave`), after one that deleted them failed to answer, finds none.
        """
        self._check_running()
        store.check_agent_id(name)
        _positive("timeout", timeout)
        with self._name_held(name, timeout):
            stored = self.stored(name)  # before any host deletes a file of it
            return self._leave(name, "forget", timeout) or stored

    def stored(self, name: str) -> bool:
        """Whether agent `name` has a journal or cache in `cache_dir` (running or not)."""
        store.check_agent_id(name)
        return store.agent_dir(self.cache_dir, self.fingerprint, name).exists()

    def agents(self, timeout: float = 60.0) -> list[AgentInfo]:
        """Every agent stored in `cache_dir` for this model and every running one, sorted by name, as
        `Runtime.agents()`: running on any host; "hot" where its host holds its cache in memory."""
        self._check_running()
        merged: dict[str, AgentInfo] = {}
        for infos in self._each_live_host("agents", timeout):
            for a in infos:
                b = merged.get(a.name)
                if b is None:
                    merged[a.name] = a
                    continue
                cache = "hot" if "hot" in (a.cache, b.cache) else a.cache if a.cache != "none" else b.cache
                turns = max((t for t in (a.turns, b.turns) if t is not None), default=None)
                merged[a.name] = AgentInfo(a.name, a.running or b.running, turns, cache)
        return [merged[n] for n in sorted(merged)]

    def flush(self, timeout: float = 60.0) -> None:
        """Return once the cache of every acknowledged turn on every live host is on disk (`Runtime.flush`)."""
        self._check_running()
        self._each_live_host("flush", timeout)

    def engine_stats(self, timeout: float = 10.0) -> list:
        """Snapshots of every live host's `EngineStats`, in host order (as `hosts()`): one engine per GPU."""
        self._check_running()
        return self._each_live_host("engine_stats", timeout)

    def _each_live_host(self, method, *args) -> list:
        """`method(*args)` on every live host, in host order; a host that dies meanwhile is left out."""
        out = []
        for i in range(len(self._hosts)):
            if i not in self._dead:
                try:
                    out.append(self._call(i, method, *args))
                except (AgentCrashed, rayhost.ClusterError):
                    pass  # a host that just died: its agents start again elsewhere
        return out

    @property
    def dead_letters(self) -> list[DeadLetter]:
        """Undeliverable messages, oldest first, as plain data (`rayhost.plain_message`: a payload decoded): those of
        every host (notes forwarded to an agent that was gone, an agent's notes left when it stopped), a host that has
        died since among them (the directory keeps a copy of each: `rayhost.RelayedDeadLetters`), and those sent here
        to an agent that was not running (`_deliver`); each host, the directory and this runtime keep their newest
        `DEAD_LETTERS_KEPT` (`runtime.api.facade`). After `shutdown`, those there were when it stopped the hosts."""
        on_hosts = self._hosts_letters if self._closed else self._host_letters()
        return sorted(self._letters.snapshot() + on_hosts, key=lambda d: d.at)

    def _host_letters(self) -> list[DeadLetter]:
        """The hosts' dead letters: every live host's, and the directory's copies of every host's, each once."""
        on_hosts = [d for on_host in self._each_live_host("dead_letters") for d in on_host]
        try:  # a copy of every host's letters, of hosts that died too (one just recorded may not be there yet)
            copies = self._ray.get(self._directory.dead_letters.remote())
        except Exception as e:  # noqa: BLE001 - the live hosts' letters are still the answer
            log.warning("the directory did not give its copies of the hosts' dead letters: %s", e)
            copies = []
        letters, seen = [], {}
        for d in on_hosts + copies:
            same = seen.setdefault((d.recipient, d.reason, d.at), [])
            if d.message not in same:  # a letter both a live host and the directory hold is one letter
                same.append(d.message)
                letters.append(d)
        return letters

    # -- life cycle ------------------------------------------------------------------

    def shutdown(self) -> None:
        """Stop every agent on every host, flush every write, stop the hosts. Idempotent."""
        if self._closed:
            return
        self._closed = True
        ray = self._ray
        for i, host in enumerate(self._hosts):
            if i not in self._dead:
                try:
                    ray.get(host.shutdown.remote(), timeout=120)
                except Exception as e:  # noqa: BLE001 - a dead host has nothing left to flush
                    log.warning("host %d did not shut down cleanly: %s", i, e)
        if getattr(self, "_directory", None) is not None:
            try:
                self._hosts_letters = self._host_letters()  # what `dead_letters` gives from now on
            except Exception as e:  # noqa: BLE001 - the hosts stop either way
                log.warning("the hosts' dead letters could not be kept past the shutdown: %s", e)
            _kill(ray, self._directory)
        for host in self._hosts:
            _kill(ray, host)
        if self._owns_ray:
            ray.shutdown()

    def __enter__(self):
        return self

    def __exit__(self, exc_type, exc, tb):
        shutdown_on_exit(self.shutdown, exc)

    # -- what AgentRef calls ------------------------------------------------------------------

    def _deliver(self, name, message, future):
        """Put `message` in agent `name`'s mailbox on its host, in order; `future` gets the answer.

        An ask with callbacks (`on_token`, `on_progress`, `cancel`) is relayed: a thread
        of this process calls them as its host's `events` arrive, then sets `future`.

        A turn of `ask_async` or `astream` (its `future.tell`) is begun right before it leaves for its host
        (`_begin_send`: called off before, it is not sent), and its host begins it again right before it tells the
        agent, after any wait there for the agent's restart: a cancellation meanwhile reaches the host
        (`NodeHost.signal` "call_off"), which then does not tell it, as one machine would not. One that comes
        while no host holds it (a recovery between two attempts) is kept here: the next attempt sends nothing.

        A host that failed, or did not run the agent, is recovered and the message delivered again
        (`_on_agent_host`); AgentCrashed (retry) when that does not reach the agent: no dead letter, as one machine
        raises it for an agent that does not come back from a restart. A message to an agent that is not running
        (`_index` refuses it; or it was stopped meanwhile, or exited on its host) raises UnknownAgent and is a dead
        letter, recorded here (`_dead_letter`), as `Runtime._deliver` records it: a host records none (`NodeHost.deliver`),
        since a host that does not run the agent may be asked again.
        """
        kind, data, callbacks = _envelope(message)
        turn_id = _turn_id(message)
        tell = getattr(future, "tell", None)
        call_off = None if tell is None else uuid.uuid4().hex  # the host's name for this send, to call it off
        called_off = threading.Event()  # a cancellation once the send had begun: no attempt sends it again

        def send(index):
            if tell is not None:
                tell.late = lambda host=self._hosts[index]: (called_off.set(), host.signal.remote(call_off, "call_off"))
            _begin_send(future, called_off.is_set())
            try:
                return self._call(index, "deliver", name, kind, data, future is not None, callbacks, call_off)
            finally:
                if tell is not None:  # no host holds the send now: a cancellation is kept for the next attempt
                    tell.late = called_off.set

        try:
            index, key = self._on_agent_host(name, turn_id, send)
        except UnknownAgent as e:
            self._dead_letter(name, message, e)
            raise
        if future is None:
            return
        if callbacks:
            threading.Thread(target=self._settle, args=(future, lambda: self._relay(index, key, message), name, index,
                                                        turn_id), daemon=True, name="kvactors-stream").start()
        else:  # Ray calls back on its own thread, where a call that waits for Ray never returns: settle on ours
            ref = self._hosts[index].wait.options(concurrency_group=rayhost.WAITS).remote(key)
            ref.future().add_done_callback(lambda done: threading.Thread(
                target=self._settle, args=(future, done.result, name, index, turn_id), daemon=True,
                name="kvactors-settle").start())

    def _relay(self, index, key, message) -> tuple:
        """Call `message`'s callbacks with streamed turn `key`'s events from host `index`, in order; its outcome.

        The caller's `cancel` is asked after each piece; once it says True the host
        ends the turn at its next token. A callback that raises gets no more events,
        and the turn fails (CallbackFailed) at its next token on the host, unless it had
        finished there: then its reply stands.
        """
        host, failure, cancelled = self._hosts[index], None, False
        for ref in host.events.options(num_returns="streaming", concurrency_group=rayhost.WAITS).remote(key):
            event = self._ray.get(ref)
            if event[0] == "end":
                if failure is not None and event[1][0] != "ok":  # a turn that finished first stands, as on one machine
                    return "error", rayhost.pack_error(CallbackFailed(_turn_id(message), failure))
                return event[1]
            if failure is not None:
                continue
            what = "on_token" if event[0] == "token" else "on_progress"
            try:
                if what == "on_progress":
                    if message.on_progress:
                        message.on_progress(*event[1:])
                    continue
                if message.on_token:
                    message.on_token(event[1])
                what = "cancel"
                if message.cancel and not cancelled and message.cancel():
                    cancelled = True
                    host.signal.remote(key, "cancel")
            except BaseException as e:  # as on one machine, a failing callback (SystemExit too) fails its own turn
                if passes_through(e):
                    raise
                failure = f"its {what} callback raised {type(e).__name__}: {e}"
                host.signal.remote(key, "fail", failure)
        raise rayhost.ClusterError(f"the events of turn {_turn_id(message)} ended without its outcome")

    def _history(self, name, timeout):
        """Agent `name`'s conversation (`AgentRef.history`) from its host; a host that failed or was restarted is
        recovered first, as for a message to the agent (`_on_agent_host`): the agent answers from where it runs then."""
        return self._on_agent_host(name, None, lambda index: self._call(index, "history", name, timeout))[1]

    def _check_system_fits(self, system: str) -> None:
        """Raise SystemPromptTooLong here if `system` leaves the model no room for a turn: a host checks it, with
        the model's tokenizer (`Runtime._check_system_fits`), the least loaded first; one that does not answer
        (NodeDown) is passed over for the next, and the last one's NodeDown is raised."""
        hosts = self._by_load()
        for index in hosts:
            try:
                return self._call(index, "check_system_fits", system)
            except NodeDown:
                if index == hosts[-1]:
                    raise

    def _stop_agent(self, name):
        """Stop running agent `name` (`AgentRef.stop`) on its host, which waits STOP_WAIT_S for it (`_leave`)."""
        self._check_running()
        with self._name_held(name, None):
            self._leave(name, "stop")

    def _leave(self, name, method, *args):
        """Host's `method(name, *args)`, a "stop" or "forget" of agent `name`; the caller holds `_name_held(name)`.

        The agent counts as running no more from the start, as on one machine, where a stop drops the name before
        it waits for the actor: its calls raise UnknownAgent meanwhile, and no recovery starts it again. The host
        may wait up to STOP_WAIT_S (or `timeout`) for the stop: only calls on this name wait with it, as `_lock` is
        not held meanwhile.

        A host that does not answer (NodeDown), or answers UnknownAgent, is recovered as for any other call
        (`_recover`). If its process died (Ray restarted it, or its node is gone), the agent's actor died with it,
        its lock with it, and its files are on the shared disk: the stop is done, and a forget deletes the files on
        a live host. If the host lives on as it was, it is asked once more (NodeDown again reaches the caller). A
        forget asked again may find the files gone, deleted by the call that failed: `forget` says whether they were
        stored.
        An error that says nothing of the agent's stop (not a WaitTimeout, `_on_host_of`, nor UnknownAgent: it was
        not running there) from a host that lives on as it was places the agent back there. A stop of an agent that a
        recovery could not start again (`_recover`) is done at once: it runs nowhere.
        """
        with self._lock:
            index = self._stopping_on(name)
            index = self._where.get(name) if index is None else index
            if index is None:
                if method == "stop":
                    raise not_running(name, self._names)
                index = self._least_loaded()
            restart = self._restart.get(name) if name in self._names else None
            unstarted = name in self._unstarted
            incarnation = self._info[index]["incarnation"]
            self._unplace(name)
        if unstarted and method == "stop":
            return None  # a recovery could not start it again: it runs nowhere

        def as_it_was() -> bool:
            with self._lock:
                return index not in self._dead and self._info[index]["incarnation"] == incarnation

        try:
            try:
                return self._on_host_of(name, index, method, *args)
            except (NodeDown, UnknownAgent) as e:
                self._recover(index)
                if as_it_was():
                    if isinstance(e, UnknownAgent):
                        raise
                    try:  # a passing failure: the first call may have stopped it
                        return self._on_host_of(name, index, method, *args)
                    except UnknownAgent:
                        if method == "stop" and restart is not None:
                            return None
                        raise
            return None if method == "stop" else self._on_host_of(name, self._least_loaded(), method, *args)
        except BaseException as e:
            if restart is not None and not isinstance(e, (WaitTimeout, UnknownAgent)):
                if self._place_running(name, index, incarnation, restart) and unstarted:
                    self._unstarted.add(name)  # placed back as it was: still to be started again
            raise

    def _on_host_of(self, name, index, method, *args):
        """Host `index`'s `method(name, *args)`, a spawn, stop or forget of agent `name`; the caller holds
        `_name_held(name)`, not `_lock`.

        A WaitTimeout of a stop or a forget (or of a spawn that waited for such a stop) says that the agent's stop
        goes on past its wait: the agent runs no more (as on one machine), and that host keeps its lock until its
        actor has stopped, so the next spawn, stop or forget of the name goes there and waits for the stop
        (`_stopping_on`), until one of them succeeds there: any other error may have come before the wait (a
        spawn's bad system prompt, a host that did not answer), and keeps it so. A spawn's own WaitTimeout started
        nothing, and leaves the placement as it was.
        """
        with self._lock:
            stopping = self._stopping.get(name)
        try:
            value = self._call(index, method, name, *args)
        except WaitTimeout:
            if method != "spawn" or stopping is not None:
                with self._lock:
                    self._unplace(name)
                    self._stopping[name] = index
            raise
        with self._lock:
            self._stopping.pop(name, None)
        return value

    def _spawn_host(self, name) -> int:
        """The host a spawn of agent `name` goes to: the one where its stop went on past its wait, if it lives
        (`_stopping_on`), else the live host with the fewest agents (`_least_loaded`)."""
        index = self._stopping_on(name)
        return self._least_loaded() if index is None else index

    def _stopping_on(self, name) -> int | None:
        """The live host where a stop of agent `name` went on past its wait, if any (a dead host's lock is gone)."""
        index = self._stopping.get(name)
        return None if index is None or index in self._dead else index

    # -- internals ------------------------------------------------------------------

    def _settle(self, future, result, name, index, turn_id):
        """Resolve the caller's `future` from `result()`, a host's `wait` or `_relay`, on a thread of this runtime's:
        the future's done callbacks run there, and may call this runtime (`spawn`, `send`), as on one machine."""
        try:
            status, value = result()
        except _host_gone(self._ray):
            threading.Thread(target=self._recover, args=(index,), daemon=True, name="kvactors-recover").start()
            error = AgentCrashed(turn_id, f"the node of agent {name!r} went down during this turn; the agent comes back "
                                          "on another node from its durable state: retry with the same turn_id")
            future.set_exception((type(error), error, None))
            return
        except Exception as e:  # noqa: BLE001 - the caller must hear of anything else too
            error = rayhost.ClusterError(f"waiting for agent {name!r} failed: {e}")
            future.set_exception((type(error), error, None))
            return
        if status == "ok":
            future.set(value)
        else:
            error = rayhost.unpack_error(value)
            future.set_exception((type(error), error, None))

    def _call(self, index, method, *args):
        """Host `index`'s `method(*args)`: its value, or its error raised here; NodeDown if the host is unreachable."""
        ray = self._ray
        try:
            status, value = ray.get(getattr(self._hosts[index], method).remote(*args))
        except _host_gone(ray) as e:
            raise NodeDown(index, type(e).__name__) from None
        if status == "error":
            raise rayhost.unpack_error(value)
        return value

    def _on_agent_host(self, name, turn_id, call) -> tuple:
        """(host index, `call(index)`): `call` run for agent `name` on its host, as every call to a running agent runs
        (a message: `_deliver`; a question: `_history`).

        A host that does not answer (NodeDown), or answers that it does not run the agent (UnknownAgent: Ray restarted
        its process, and the agent died with it), is recovered (`_recover`: the agent starts again, there or on
        another host), and `call` runs once more, on the agent's host then. Raises UnknownAgent if the agent is not
        running (`_index`), was stopped meanwhile, exited on its host (then unplaced: no recovery starts it again), or
        its host does not run it after a recovery; AgentCrashed carrying `turn_id` (retry) if a recovery could not
        start it again, or its host did not answer twice.
        """
        for attempt in range(2):
            index = self._index(name)
            try:
                return index, call(index)
            except NodeDown:
                self._recover(index)
            except UnknownAgent:
                if attempt or name not in self._names:
                    self._actor_alive(name)  # or it exited there: unplaced, not started again by a recovery
                    raise
                self._recover(index)
                if name in self._unstarted:
                    raise AgentCrashed(turn_id, f"agent {name!r} could not be started again on a node (see the log); "
                                                "retry") from None
        raise AgentCrashed(turn_id, f"agent {name!r} could not be reached on its node; retry")

    def _dead_letter(self, name, message, error: UnknownAgent) -> None:
        """Record `message` (an AgentRef envelope) to agent `name`, which `error` says is not running, as a dead
        letter (`dead_letters`), as `Runtime._deliver` does: to `name`, the message (as plain data, as a host gives
        it), `str(error)` as the reason, and a warning logged. A question (a `Lookup`) is not one: its caller has the
        answer, the error."""
        if isinstance(message, Lookup):
            return
        self._letters.record(name, rayhost.plain_message(message), str(error))

    def _index(self, name) -> int:
        self._check_running()
        with self._lock:
            if name not in self._names:
                raise not_running(name, self._names)
            return self._where[name]

    def _least_loaded(self) -> int:
        """The live host with the fewest agents, counting those that a spawn is starting there."""
        return self._by_load()[0]

    def _by_load(self) -> list[int]:
        """The live hosts, those with the fewest agents (counting those that a spawn is starting there) first;
        ClusterError if none is alive."""
        with self._lock:
            live = [i for i in range(len(self._hosts)) if i not in self._dead]
            if not live:
                raise rayhost.ClusterError("no host of the cluster is alive; start a new Runtime")
            load = {i: 0 for i in live}
            for i in [*self._where.values(), *self._pending.values()]:
                if i in load:
                    load[i] += 1
            return sorted(live, key=lambda i: (load[i], i))

    def _place(self, name, index):
        self._where[name] = index
        self._unstarted.discard(name)
        self._serials[name] = next(self._serial)
        self._ray.get(self._directory.set.remote(name, self._hosts[index]))

    def _unplace(self, name):
        self._names.pop(name, None)
        self._unstarted.discard(name)
        self._where.pop(name, None)
        self._serials.pop(name, None)
        self._restart.pop(name, None)
        self._ray.get(self._directory.set.remote(name, None))

    def _recover(self, index) -> None:
        """Host `index` failed a call: wait until Ray restarts it or reports it dead, then start its agents again.

        Restarted in place (a new incarnation): its agents start there again. Dead (its
        node died), or not back within RECOVER_S: it is given up, and its agents start
        on the live hosts with the fewest agents. Either way each agent reloads its
        durable state from the shared folder. As it was (a passing failure): only its
        agents that a recovery could not start again start there. An agent whose start
        fails stays placed, to be started again by the next recovery of its host, which
        the next call on it runs (`_on_agent_host`). One recovery of a host runs at a time:
        a call on one of its agents that failed meanwhile waits for it, then finds its agent
        placed anew; calls on the agents of other hosts, and spawns, go on (the placement
        lock is held only while the tables change).
        """
        with self._lock:
            recovering = self._recovering.setdefault(index, threading.Lock())
        with recovering:
            with self._lock:
                if self._closed:
                    return
                placed = {n: self._serials[n] for n, i in self._where.items() if i == index}
                dead = index in self._dead
            if not dead:
                info = self._probe(index)
                with self._lock:
                    if info is None:
                        log.warning("host %d (node %s) is dead: moving its agents", index, self._info[index]["node_id"])
                        self._dead.add(index)
                    elif info["incarnation"] == self._info[index]["incarnation"]:
                        placed = {n: s for n, s in placed.items() if n in self._unstarted}  # the others run there
                    else:
                        log.warning("host %d was restarted by Ray: starting its agents again", index)
                        self._info[index] = info
            for name, serial in placed.items():
                self._start_again(name, serial, index)

    def _start_again(self, name, serial, index) -> None:
        """Start agent `name`, placed (`serial`) on host `index` that a recovery found restarted or dead, again: there,
        or on the live host with the fewest agents where `index` is dead; unless it was stopped, or placed anew,
        meanwhile. A start that fails leaves it placed and unstarted (its next call tries again)."""
        with self._lock:
            if self._closed or self._serials.get(name) != serial:
                return
            restart = self._restart[name]
        target = self._least_loaded() if index in self._dead else index
        try:
            self._call(target, "spawn", name, "", restart, False, 60.0)
            with self._lock:
                if self._serials.get(name) == serial:
                    self._place(name, target)  # the directory's update may fail too
                    return
        except Exception as e:  # noqa: BLE001 - one agent that cannot move must not strand the others
            with self._lock:
                if self._serials.get(name) == serial:
                    self._unstarted.add(name)
            log.error("agent %s could not be started again on host %d (the next call on it tries again): %s",
                      name, target, e)
            return
        try:  # stopped (or spawned anew) as it started: the copy started here is not wanted
            self._call(target, "stop", name)
        except UnknownAgent:
            pass  # the stop that unplaced it reached it there first
        except Exception as e:  # noqa: BLE001 - a host that failed meanwhile: its recovery finds nothing placed
            log.warning("agent %s, stopped as a recovery started it again on host %d, may still run there: %s",
                        name, target, e)

    def _probe(self, index) -> dict | None:
        """Host `index`'s info once it answers; None once Ray reports it dead or after RECOVER_S."""
        ray = self._ray
        deadline = time.monotonic() + RECOVER_S
        while time.monotonic() < deadline:
            try:
                return _value(ray.get(self._hosts[index].info.remote(), timeout=10))
            except (ray.exceptions.ActorDiedError, ray.exceptions.ActorUnschedulableError):
                return None  # dead, or pinned to a node that is gone
            except (ray.exceptions.RayActorError, ray.exceptions.GetTimeoutError):
                time.sleep(0.5)  # unavailable: restarting, or its node is not yet known to be dead
        return None

    def _check_running(self):
        if self._closed:
            raise RuntimeClosed("the Runtime was shut down", "; start a new Runtime to talk to its agents")


def _kill(ray, actor) -> None:
    try:
        ray.kill(actor, no_restart=True)
    except Exception as e:  # noqa: BLE001 - gone already
        log.debug("killing %s: %s", actor, e)


def _host_gone(ray) -> tuple:
    """Ray's errors for an actor that does not answer: unavailable or dead, or pinned to a node that is gone."""
    return ray.exceptions.RayActorError, ray.exceptions.ActorUnschedulableError


def _value(result):
    status, value = result
    if status == "error":
        raise rayhost.unpack_error(value)
    return value


def _envelope(message) -> tuple:
    """(kind, data, callbacks) of an AgentRef envelope: `callbacks` names an ask's callbacks that its host relays.

    A `cancel` is asked after each piece, so its host sends pieces for it even without `on_token`.
    """
    if isinstance(message, Ask):
        callbacks = tuple(name for name in rayhost.CALLBACKS if getattr(message, name) is not None)
        if message.cancel is not None and "on_token" not in callbacks:
            callbacks = ("on_token", *callbacks)
        return "ask", message.payload, callbacks
    if isinstance(message, Note):
        return "note", message.payload, ()
    if isinstance(message, Reset):
        return "reset", message.payload, ()
    if isinstance(message, Lookup):
        return "result", message.turn_id, ()
    raise TypeError(f"not an agent envelope: {message!r:.100}")


def _turn_id(message):
    return getattr(getattr(message, "future", None), "turn_id", None) or getattr(message, "turn_id", None)
