"""The node host: one batcher's process on a Ray cluster, with the agents placed there.

`ClusterRuntime` (runtime/api/cluster.py) starts one `NodeHost` per GPU of the
cluster (one per node on CPU-only clusters) as a Ray actor. A host runs a
`HostedRuntime`: the very Runtime of one machine (batcher, persistence actor,
supervisors, and `AgentActor`s, the agents' turn logic as it is), on a cache folder
that every node sees. So an agent's turns run in the process that holds the model,
and its Q4 cache never leaves that process (hot) or the shared folder (warm): only
messages cross nodes, as msgpack payloads and replies.

Between hosts, `HostedRuntime` differs from a Runtime of one machine in two ways:
- it locks each agent it runs (`store.lock_agent`) and the cache folder only shared,
  so that many hosts share the folder, one agent name has one live actor, and no
  Runtime of one machine writes there meanwhile;
- a note to an agent that is not here (a `send_to` reply to its sender) is forwarded
  to the host that runs it, in the order this host's agents sent them; the wait for
  the agent to record it (after its turn in progress, if any) holds up no other note,
  and a host that does not answer holds up only the notes to its own agents.

A turn with callbacks (`on_token`, `on_progress`, `cancel`: `AgentRef.stream` and
`astream` give them) runs here with callbacks of this host's (`_Streamed`) that queue
its pieces and progress; `NodeHost.events` yields them, then the turn's outcome, as a
Ray streaming generator, and the caller's side calls the caller's callbacks in order.
The caller's `cancel`, asked there after each piece, reaches the turn through
`NodeHost.signal`, as does a callback of the caller's that raised: the turn then fails
at its next token, as it does on one machine.

Errors cross Ray as plain data (`pack_error` / `unpack_error`): kvactors' errors keep
their type and fields, so callers catch the same types as on one machine.

This module never imports Ray: its classes become Ray actors in `runtime.api.cluster`.
"""

from __future__ import annotations

import asyncio
import builtins
import contextlib
import importlib
import logging
import os
import queue
import threading
import time
import uuid
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import msgpack

from actors.agent import Ask, Lookup, Note, Reset, UnknownAgent
from runtime import store
from runtime.api.facade import DeadLetter, DeadLetters, ReplyFuture, Runtime, WaitTimeout, _BeginOrCallOff, _positive
from runtime.engine import CallbackFailed
from runtime.errors import KvactorsError

log = logging.getLogger(__name__)
KINDS = ("ask", "note", "reset", "result")  # the envelopes `NodeHost.deliver` takes
CALLBACKS = ("on_token", "on_progress", "cancel")  # an ask's callbacks that `NodeHost.events` carries to its caller
SIGNALS = ("cancel", "fail", "call_off")  # what `NodeHost.signal` tells a streamed turn, or a send
NAME_POLL_S = 0.01  # how long `HostedRuntime._release_if_exited` waits for a call that holds the name: it is left to it
EARLY_CALL_OFF_S = 60.0  # how long a host keeps a call-off that found no send, for a delivery that comes after it
EARLY_CALL_OFFS = 1024  # how many such call-offs a host keeps at most (the oldest go first)
WAITS = "waits"  # the concurrency group of the calls that wait for a turn (`wait`, `events`): threads of their own


class ClusterError(KvactorsError, RuntimeError):
    """Something failed on another node of the cluster; the message says what and where."""


def pack_error(e: BaseException) -> tuple:
    """`e` as plain data (module, class name, message, fields) that crosses processes without pickle's surprises."""
    fields = {k: v for k, v in vars(e).items() if isinstance(v, (str, int, float, bool, type(None)))}
    message = e.args[0] if isinstance(e, KeyError) and e.args else str(e)
    return type(e).__module__, type(e).__qualname__, str(message), fields


def unpack_error(packed: tuple) -> BaseException:
    """The error `pack_error` packed: the same type with the same message and fields for kvactors' errors and builtins,
    and asyncio's CancelledError (a send called off: `NodeHost.deliver`), as one machine raises it.

    Any other type becomes a ClusterError naming it.
    """
    module, name, message, fields = packed
    cls = None
    try:
        cls = builtins.__dict__.get(name) if module == "builtins" else getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError):
        pass
    if isinstance(cls, type) and issubclass(cls, KvactorsError):
        error = cls.__new__(cls)
        BaseException.__init__(error, message)
        error.__dict__.update(fields)
        return error
    if (isinstance(cls, type) and issubclass(cls, Exception) and module == "builtins") or cls is asyncio.CancelledError:
        return cls(message)
    return ClusterError(f"{module}.{name} on a node of the cluster: {message}")


def outcome(fn, *args, **kwargs) -> tuple:
    """("ok", fn(...)) or ("error", pack_error(e)): what every host method returns."""
    try:
        return "ok", fn(*args, **kwargs)
    except Exception as e:  # noqa: BLE001 - every error goes back to the caller, typed
        return "error", pack_error(e)


class _Streamed:
    """The host's side of a turn's callbacks: its pieces and progress go to `events`; `signal` ends the turn.

    `cancel` is always given to the turn (asked after each generated token): it says
    True once the caller cancelled, and raises once a callback on the caller's side
    raised, so that the turn fails at its next token as it would on one machine.
    """

    END = object()

    def __init__(self, turn_id: str | None):
        self.turn_id = turn_id
        self.events: queue.SimpleQueue = queue.SimpleQueue()
        self.cancelled = False
        self.failure: str | None = None

    def on_token(self, piece: str) -> None:
        self._check()
        self.events.put(("token", piece))

    def on_progress(self, done: int, total: int) -> None:
        self._check()
        self.events.put(("progress", done, total))

    def cancel(self) -> bool:
        self._check()
        return self.cancelled

    def _check(self):
        if self.failure is not None:
            raise CallbackFailed(self.turn_id, self.failure)


class HostedRuntime(Runtime):
    """A Runtime that shares its cache folder with other processes: it locks agents one by one.

    Takes the options of `Runtime`. It holds agent `name`'s lock (`store.lock_agent`) from
    its `spawn` until its actor has stopped, and while `forget` deletes its files; so
    `spawn` and `forget` raise AgentInUse while another process (another node's host)
    runs the agent. An agent that its supervisor dropped (a temporary agent that crashed) lets go of its lock once
    this Runtime finds it gone: in `running()`, a message to it (UnknownAgent), or the next spawn, stop or forget
    of the name. A stop that ran past its wait (WaitTimeout) keeps the lock: the actor
    may still run, and the next stop, forget or spawn of the name here waits for it.
    """

    def __init__(self, *args, **options):
        self._agent_locks: dict[str, int] = {}
        self._locks_guard = threading.Lock()
        super().__init__(*args, **options)

    def _lock_store(self) -> int:
        return store.lock_cache_dir(self.cache_dir, shared=True)  # the agents are locked one by one, in spawn

    def spawn(self, name: str, system: str = "", restart: str = "permanent", *, reset: bool = False,
              timeout: float = 60.0):
        """`Runtime.spawn`, holding agent `name`'s lock while it runs here (AgentInUse if another process runs it)."""
        with self._agent_locked(name, timeout):  # Runtime.spawn takes the name again: the lock and the start as one
            return super().spawn(name, system, restart, reset=reset, timeout=timeout)

    def forget(self, name: str, timeout: float = 60.0) -> bool:
        """`Runtime.forget`, holding agent `name`'s lock until its files are gone (AgentInUse if it runs elsewhere)."""
        with self._agent_locked(name, timeout):
            return super().forget(name, timeout)

    @contextlib.contextmanager
    def _agent_locked(self, name, timeout):
        """Hold `_name_held(name)` and agent `name`'s lock for the block (AgentInUse if another process holds it);
        after it, the lock goes unless the agent runs here or is still stopping. InvalidAgentId and a bad `timeout`
        raise first, as `Runtime.spawn` and `forget` raise them."""
        store.check_agent_id(name)
        _positive("timeout", timeout)
        with self._name_held(name, timeout):
            self._lock_agent(name)
            try:
                yield
            finally:
                self._unlock_if_gone(name)

    def _stop_agent(self, name):
        with self._name_held(name, None):
            try:
                super()._stop_agent(name)
            finally:
                self._unlock_if_gone(name)

    def running(self) -> list[str]:
        """`Runtime.running`; also releases the lock of each agent that its supervisor dropped (a temporary agent
        that crashed), unless a spawn, stop or forget of its name goes on (that call releases it)."""
        names = super().running()
        with self._locks_guard:
            locked = [n for n in self._agent_locks if n not in names]
        for name in locked:
            self._release_if_exited(name)
        return names

    def _deliver(self, name, message, future, dead_letter: bool = True):
        """`Runtime._deliver`; an agent found gone (UnknownAgent: it exited and was not restarted) lets go of its
        lock."""
        try:
            super()._deliver(name, message, future, dead_letter)
        except UnknownAgent:
            self._release_if_exited(name)
            raise

    def _release_if_exited(self, name):
        """Release agent `name`'s lock if its supervisor dropped it or it stopped, counting it as running no more
        (`Runtime._drop_if_exited`); left to the call that holds `_name_held(name)` if one does."""
        try:
            with self._name_held(name, NAME_POLL_S):
                self._drop_if_exited(name)
                self._unlock_if_gone(name)
        except WaitTimeout:
            pass  # a spawn, stop or forget of the name: it releases the lock if the agent is gone

    def shutdown(self) -> None:
        """`Runtime.shutdown`, then release every agent's lock."""
        super().shutdown()
        for name in list(getattr(self, "_agent_locks", {})):
            self._unlock(name)

    def _lock_agent(self, name):
        """Hold agent `name`'s lock, if this process does not already; the caller holds `_name_held(name)`."""
        with self._locks_guard:
            if name not in self._agent_locks:
                self._agent_locks[name] = store.lock_agent(self.cache_dir, self.spec.fingerprint, name)

    def _unlock_if_gone(self, name):
        """Release agent `name`'s lock unless its actor runs here or is still stopping (a stop past its wait); the
        caller holds `_name_held(name)`."""
        if name not in self._names and name not in self._stops:
            self._unlock(name)

    def _unlock(self, name):
        with self._locks_guard:
            fd = self._agent_locks.pop(name, None)
        if fd is not None:
            os.close(fd)


class NodeHost:
    """One batcher (the model and its engine) and the agents placed with it; a Ray actor of `ClusterRuntime`.

    `model`, `cache_dir` and `options` are `Runtime`'s; `directory` names the cluster's
    `Directory` actor (agent name -> its host), used to forward notes to agents on
    other hosts. Every method returns `outcome(...)`: ("ok", value) or ("error", packed).
    """

    def __init__(self, model, cache_dir, options: dict, directory: str):
        import ray

        self.incarnation = uuid.uuid4().hex  # a restart by Ray re-runs this: the caller sees a new one
        self.directory = ray.get_actor(directory)
        self.rt = HostedRuntime(model, cache_dir, **options)
        self.rt._env.forward = self._forward
        self.rt._env.dead_letters = RelayedDeadLetters(self.directory)  # before any agent starts
        self.futures: dict[str, ReplyFuture] = {}
        self.streams: dict[str, _Streamed] = {}  # key -> a streamed turn's callbacks, until `events` ends
        self.sends: dict[str, _BeginOrCallOff] = {}  # call-off key -> a send that `deliver` has not yet told
        self.early_call_offs: dict[str, float] = {}  # call-off key -> when it came, finding no send (`signal`)
        self.sends_lock = threading.Lock()  # `sends` and `early_call_offs`: a send and its call-off meet once
        self.forwarder = ThreadPoolExecutor(1, thread_name_prefix="kvactors-forward")  # one: in send order
        # the forwarder's deliveries, one thread a receiving host (`_forward_now`): a host that does not answer holds
        # up the notes to its own agents only; written by the forwarder's thread alone
        self.deliverers: dict = {}  # the receiving host's actor handle -> its ThreadPoolExecutor(1)
        # forwarded notes' outcomes (`_settle`); never shut down: one may come after `shutdown`
        self.settler = ThreadPoolExecutor(1, thread_name_prefix="kvactors-settle")
        self.unsettled: dict[str, deque] = {}  # agent -> the `_Forwarded` notes it has not recorded yet, oldest first
        self.unsettled_lock = threading.Lock()

    def info(self) -> tuple:
        """("ok", {incarnation, node_id, gpus, pid, fingerprint, max_context, longest_token_chars, vocab_size}): who and
        where this host is, and what its model takes (`Runtime.max_context`, `Runtime.longest_token_chars`,
        `Runtime.vocab_size`)."""
        import ray

        context = ray.get_runtime_context()
        return "ok", dict(incarnation=self.incarnation, node_id=context.get_node_id(),
                          gpus=[str(g) for g in context.get_accelerator_ids().get("GPU", [])], pid=os.getpid(),
                          fingerprint=self.rt.spec.fingerprint, max_context=self.rt.max_context,
                          longest_token_chars=self.rt.longest_token_chars, vocab_size=self.rt.vocab_size)

    def spawn(self, name: str, system: str, restart: str, reset: bool, timeout: float) -> tuple:
        """Start agent `name` here (`Runtime.spawn`); ("ok", this host's incarnation)."""
        return outcome(lambda: (self.rt.spawn(name, system, restart, reset=reset, timeout=timeout), self.incarnation)[1])

    def deliver(self, name: str, kind: str, data, answer: bool = True, callbacks: tuple = (),
                call_off: str | None = None) -> tuple:
        """Put one envelope (`KINDS`: ask / note / reset payload, or a lookup's turn id) in agent `name`'s mailbox.

        Returns ("ok", key) once it is there: with `answer`, `wait(key)` answers it
        (without, the key is None). Callers deliver one envelope at a time, so an agent
        takes each sender's messages in order. `callbacks` (an ask's, of `CALLBACKS`,
        with `answer`) are the ones its caller holds: then `events(key)`, not `wait`,
        carries the turn's pieces and progress and answers it. With a `call_off` key,
        `signal(call_off, "call_off")` before the envelope is told to the agent (it may
        wait for the agent's restart) calls it off: then it raises CancelledError and
        nothing is sent. So does such a signal that Ray ran here before this call, up to
        EARLY_CALL_OFF_S earlier (Ray does not order the calls to a host). For an agent
        not running here it raises UnknownAgent, and the envelope goes to no dead letters
        here: its caller records it where it finds it undeliverable (`ClusterRuntime._deliver`,
        which may yet deliver it elsewhere, and a host that forwards a note, `_forward_now`).
        """
        try:
            return outcome(self._deliver, name, kind, data, answer, tuple(callbacks), call_off)
        except asyncio.CancelledError as e:  # called off: a BaseException, which `outcome` leaves alone
            return "error", pack_error(e)

    def _deliver(self, name, kind, data, answer, callbacks, call_off):
        if kind not in KINDS:
            raise ValueError(f"unknown envelope kind {kind!r}; one of {KINDS}")
        unknown = set(callbacks) - set(CALLBACKS)
        if unknown or (callbacks and (kind != "ask" or not answer)):
            raise ValueError(f"callbacks {callbacks!r}: an answered ask takes some of {CALLBACKS}")
        future, key = ReplyFuture(), uuid.uuid4().hex
        future.turn_id = msgpack.unpackb(data).get("turn_id") if kind == "ask" else data if kind == "result" else None
        streamed = _Streamed(future.turn_id) if callbacks else None
        hooks = {} if streamed is None else dict(
            on_token=streamed.on_token if "on_token" in callbacks else None,
            on_progress=streamed.on_progress if "on_progress" in callbacks else None, cancel=streamed.cancel)
        envelope = {"ask": lambda: Ask(data, future, **hooks), "note": lambda: Note(data, future),
                    "reset": lambda: Reset(data, future), "result": lambda: Lookup(data, future)}[kind]()
        if answer:
            self.futures[key] = future
        if streamed is not None:
            self.streams[key] = streamed
            future.add_done_callback(lambda _: streamed.events.put(_Streamed.END))
        if call_off is not None:
            future.tell = tell = _BeginOrCallOff()  # `Runtime._deliver` begins it: `_begin_send`
            with self.sends_lock:
                self.sends[call_off] = tell
                called_off = self.early_call_offs.pop(call_off, None) is not None
            if called_off:
                tell.call_off()
        try:
            self.rt._deliver(name, envelope, future, dead_letter=False)
        except BaseException:
            self.futures.pop(key, None)
            self.streams.pop(key, None)
            raise
        finally:
            if call_off is not None:
                with self.sends_lock:
                    self.sends.pop(call_off, None)
        return key if answer else None

    def events(self, key: str):
        """The streamed turn `deliver` returned `key` for, as it runs: a generator (Ray: `num_returns="streaming"`).

        Yields ("token", piece) and ("progress", done, total) in the order the turn's
        callbacks were called, then ("end", outcome): ("ok", the Reply) or ("error",
        packed), as `wait` answers. Only ("end", error) for an unknown key. Called in the
        `WAITS` concurrency group, as `wait`.
        """
        streamed = self.streams.get(key)
        if streamed is None:
            yield "end", ("error", pack_error(ClusterError(f"no streamed turn {key} on this host (it restarted meanwhile)")))
            return
        try:
            while (event := streamed.events.get()) is not _Streamed.END:
                yield event
            yield "end", self.wait(key)
        finally:
            self.streams.pop(key, None)

    def signal(self, key: str, what: str, why: str = "") -> tuple:
        """Tell streamed turn `key` (`SIGNALS`): "cancel" ends it at its next token, as `cancel()` returning True
        does; "fail" fails it there with `why` (a callback on the caller's side raised). ("ok", whether it runs here).
        Or "call_off": call off the send that `deliver` was given call-off key `key` for, unless it has told the
        agent; ("ok", whether it was called off). A call-off that finds no such send (Ray may run it before that
        `deliver`, or after it told the agent) is kept for EARLY_CALL_OFF_S, the last EARLY_CALL_OFFS of them, for a
        `deliver` of that key to come: ("ok", None)."""
        return outcome(self._signal, key, what, why)

    def _signal(self, key, what, why):
        if what not in SIGNALS:
            raise ValueError(f"unknown signal {what!r}; one of {SIGNALS}")
        if what == "call_off":
            with self.sends_lock:
                send = self.sends.get(key)
                if send is None:
                    self._keep_call_off(key)
                    return None
            return send.call_off()
        streamed = self.streams.get(key)
        if streamed is None:
            return False
        if what == "cancel":
            streamed.cancelled = True
        else:
            streamed.failure = why or "a callback on the caller's side raised"
        return True

    def _keep_call_off(self, key):
        """Keep call-off `key`, which found no send, for `deliver`; the oldest go past EARLY_CALL_OFF_S or
        EARLY_CALL_OFFS. The caller holds `sends_lock`."""
        now, kept = time.monotonic(), self.early_call_offs
        while kept:
            oldest = next(iter(kept))  # a dict keeps its keys in the order they came
            if kept[oldest] > now - EARLY_CALL_OFF_S and len(kept) < EARLY_CALL_OFFS:
                break
            del kept[oldest]
        kept[key] = now

    def wait(self, key: str) -> tuple:
        """("ok", the answer) to the envelope `deliver` returned `key` for, once the agent gives it; or ("error", ...).
        Called in the `WAITS` concurrency group (as `events`), whose threads no other call takes."""
        future = self.futures.get(key)
        if future is None:
            return "error", pack_error(ClusterError(f"no envelope {key} on this host (it restarted meanwhile)"))
        try:
            return outcome(future.get)
        finally:
            self.futures.pop(key, None)

    def history(self, name: str, timeout: float) -> tuple:
        """Agent `name`'s conversation, once it has done all it was sent before (`AgentRef.history`)."""
        return outcome(self.rt._history, name, timeout)

    def check_system_fits(self, system: str) -> tuple:
        """("ok", None) if system prompt `system` leaves the model room for a turn, else its SystemPromptTooLong
        (`Runtime._check_system_fits`, which needs the model's tokenizer)."""
        return outcome(self.rt._check_system_fits, system)

    def stop(self, name: str) -> tuple:
        """Stop agent `name` for good and release its lock (`AgentRef.stop`); past STOP_WAIT_S, WaitTimeout, and the
        lock stays until the stop is done."""
        return outcome(self.rt._stop_agent, name)

    def forget(self, name: str, timeout: float) -> tuple:
        """Stop agent `name` if it runs here and delete its files (`Runtime.forget`)."""
        return outcome(self.rt.forget, name, timeout)

    def running(self) -> tuple:
        """("ok", (the agents running here, in spawn order; this host's incarnation)): the incarnation says whether
        the caller's view of this host is of this process, or of one before Ray restarted it."""
        return outcome(lambda: (self.rt.running(), self.incarnation))

    def agents(self, timeout: float) -> tuple:
        """`Runtime.agents()` as this host sees it: every stored agent, and those running here."""
        return outcome(self.rt.agents, timeout)

    def flush(self, timeout: float) -> tuple:
        """Return once every acknowledged turn here has its cache file on disk (`Runtime.flush`)."""
        return outcome(self.rt.flush, timeout)

    def engine_stats(self, timeout: float) -> tuple:
        """A snapshot of this host's engine statistics (`Runtime.engine_stats`)."""
        return outcome(self.rt.engine_stats, timeout)

    def dead_letters(self) -> tuple:
        """This host's dead letters, as plain data (a note's payload decoded)."""
        return outcome(lambda: [plain_letter(d) for d in self.rt.dead_letters])

    def shutdown(self) -> tuple:
        """Stop every agent here, flush every write, stop the batcher (`Runtime.shutdown`)."""
        self.forwarder.shutdown(wait=True)  # then no delivery is handed on
        for deliverer in self.deliverers.values():
            deliverer.shutdown(wait=True)
        return outcome(self.rt.shutdown)

    # -- notes to agents on other hosts

    def _forward(self, name, payload, future, reply):
        """`Env.forward`: deliver note `payload` to agent `name` on the host that runs it, after the notes this host
        forwarded to that host before it; `future` (a send_to reply's) gets `reply` once the note is durable there, or
        dead-lettered, as on one machine however long the agent's turn in progress takes; the notes forwarded after it
        do not wait for that. An undeliverable note is one dead letter, here (`_forward_now`, `_settle`) or there."""
        try:
            self.forwarder.submit(self._forward_now, name, payload, future, reply)
        except RuntimeError:  # shutting down
            self._undeliverable(name, payload, future, reply, "the host is shutting down")

    def _forward_now(self, name, payload, future, reply):
        """`_forward`, on the forwarder's thread: find the host of agent `name` (in send order) and hand the note to
        that host's deliverer (`_deliver_now`)."""
        import ray

        try:
            host = ray.get(self.directory.lookup.remote(name), timeout=self.rt._env.io_timeout)
            if host is None:
                raise UnknownAgent(f"no running agent named {name!r} in the cluster")
        except Exception as e:  # noqa: BLE001 - an undeliverable note is a dead letter, never lost silently
            self._undeliverable(name, payload, future, reply, f"forwarding to its node failed: {e}")
            return
        deliverer = self.deliverers.get(host)
        if deliverer is None:
            deliverer = self.deliverers[host] = ThreadPoolExecutor(1, thread_name_prefix="kvactors-deliver")
        deliverer.submit(self._deliver_now, name, payload, future, reply, host)

    def _deliver_now(self, name, payload, future, reply, host):
        """On `host`'s deliverer, in the order the forwarder found them: put the note in agent `name`'s mailbox on
        `host`; then `_await_durable` waits for it beside the forwards after it. A host that does not answer holds up
        the notes to its agents only. A host that does not run agent `name` (the directory is behind: it exited
        there, or moved) records no dead letter (`deliver`): this host does (`_undeliverable`). The delivery has no
        timeout: one given up on here could still reach the agent, and the note would be both delivered and
        dead-lettered (Ray raises if the host dies)."""
        import ray

        try:
            status, key = ray.get(host.deliver.remote(name, "note", payload))
            if status == "error":
                raise unpack_error(key)
        except Exception as e:  # noqa: BLE001 - an undeliverable note is a dead letter, never lost silently
            self._undeliverable(name, payload, future, reply, f"forwarding to its node failed: {e}")
            return
        self._await_durable(_Forwarded(name, payload, future, reply, host, key))

    def _await_durable(self, note):
        """Settle `note` (a `_Forwarded`, in its agent's mailbox) once the agent has recorded it, or dropped it
        (dead-lettered there), with no timeout: an agent records notes between its turns. One note per agent is waited
        for at a time (`_wait_durable`), the oldest: the agent takes them in the order they were delivered, so each
        wait holds one of the agent's host's wait threads (`cluster.WAIT_THREADS`, apart from its call threads),
        whatever the number of notes, and none here."""
        with self.unsettled_lock:
            waiting = self.unsettled.setdefault(note.name, deque())
            waiting.append(note)
            if len(waiting) > 1:
                return  # `_settle` waits for it after the notes before it
        self._wait_durable(note)

    def _wait_durable(self, note):
        """Ask `note`'s host to answer once the note is durable (`wait`), and `_settle` it then on the settler's
        thread: Ray calls back on a thread of its own, where a call to Ray never returns."""
        try:
            done = note.host.wait.options(concurrency_group=WAITS).remote(note.key).future()
        except Exception as e:  # noqa: BLE001 - the note is settled as undeliverable: `_settle` raises it again
            self._on_settler(note, _raiser(e))
            return
        done.add_done_callback(lambda done: self._on_settler(note, done.result))

    def _on_settler(self, note, result):
        try:
            self.settler.submit(self._settle, note, result)
        except RuntimeError:  # the process is exiting: settle it here rather than lose it
            self._settle(note, result)

    def _settle(self, note, result):
        """Resolve forwarded `note` by `result()`, its host's `wait` answer: ("ok", _) once the agent recorded it or
        dead-lettered it there; an error (its host died, or restarted, before that) dead-letters it here. Then wait
        for the agent's next note, if any."""
        try:
            status, value = result()
            if status == "error":
                raise unpack_error(value)
        except Exception as e:  # noqa: BLE001 - an undeliverable note is a dead letter, never lost silently
            self._undeliverable(note.name, note.payload, note.future, note.reply, f"forwarding to its node failed: {e}")
        else:
            if note.future is not None:
                note.future.set(note.reply)
        finally:
            following = self._settled(note)
            if following is not None:
                self._wait_durable(following)

    def _settled(self, note):
        """Take settled `note`, the oldest, off its agent's unsettled notes; the next one, or None."""
        with self.unsettled_lock:
            waiting = self.unsettled[note.name]
            waiting.popleft()
            if waiting:
                return waiting[0]
            del self.unsettled[note.name]
            return None

    def _undeliverable(self, name, payload, future, reply, why):
        self.rt._env.dead_letter(name, payload, why)
        if future is not None:
            future.set(reply)


@dataclass(frozen=True)
class _Forwarded:
    """A note this host forwarded (`NodeHost._forward`), in agent `name`'s mailbox on `host` under `key` (`deliver`),
    until the agent records it; then `future` gets `reply`."""

    name: str
    payload: bytes
    future: object
    reply: object
    host: object
    key: str


def _raiser(error):
    """A `result` callable for `NodeHost._settle` that raises `error`."""
    def result():
        raise error
    return result


def plain_message(message):
    """A dead letter's message as plain data, as hosts and `ClusterRuntime` give it: an envelope's (or a note's)
    payload decoded; anything else as its repr."""
    payload = getattr(message, "payload", message)
    if isinstance(payload, bytes):
        try:
            return msgpack.unpackb(payload)
        except Exception:  # noqa: BLE001 - not msgpack: keep the bytes
            return payload
    return repr(message)


def plain_letter(letter: DeadLetter) -> DeadLetter:
    """`letter` with its message as plain data (`plain_message`), as it crosses Ray."""
    return DeadLetter(letter.recipient, plain_message(letter.message), letter.reason, letter.at)


class RelayedDeadLetters(DeadLetters):
    """A host's dead letters, each also sent to the cluster's `Directory` as it is recorded (as plain data), which
    keeps it past this host's process: `ClusterRuntime.dead_letters` lists a host's letters after the host died."""

    def __init__(self, directory):
        super().__init__()
        self.directory = directory

    def record(self, recipient: str, message, reason: str) -> DeadLetter:
        """`DeadLetters.record`, and the letter sent to the directory (not waited for)."""
        letter = super().record(recipient, message, reason)
        try:
            self.directory.keep_letter.remote(plain_letter(letter))
        except Exception as e:  # noqa: BLE001 - the directory gone (its runtime is closing): this host still has it
            log.warning("a dead letter to %s is kept on this host only: %s", recipient, e)
        return letter


class Directory:
    """Agent name -> the host actor that runs it, and every host's dead letters; a Ray actor of `ClusterRuntime`, read
    by hosts to forward notes."""

    def __init__(self):
        self.hosts: dict[str, object] = {}
        self.letters = DeadLetters()  # hosts' dead letters (`RelayedDeadLetters`), logged where they were recorded

    def set(self, name: str, host) -> None:
        """Agent `name` now runs on `host` (None: nowhere)."""
        if host is None:
            self.hosts.pop(name, None)
        else:
            self.hosts[name] = host

    def lookup(self, name: str):
        """The host of agent `name`, or None."""
        return self.hosts.get(name)

    def keep_letter(self, letter: DeadLetter) -> None:
        """Keep a host's dead letter (plain data) for `dead_letters`."""
        self.letters.keep(letter)

    def dead_letters(self) -> list[DeadLetter]:
        """The hosts' dead letters kept here, in the order they came."""
        return self.letters.snapshot()
