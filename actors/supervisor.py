"""Supervision: restart strategies, restart intensity, backoff, and crash containment.

A `Supervisor` owns a group of children, each a `ChildSpec` (a name, a zero-argument
start function returning a started `pykka.ActorRef`, and a restart type). Children
subclass `SupervisedActor`, which turns every pykka failure path into one `ChildExited`
report to the supervisor:

- a failing **ask** would leave a plain pykka actor running with half-changed state;
- a failing **tell** stops it (`on_failure`), but tells nobody;
- a failing `on_start` stops it without `on_failure`;
- a `SystemExit` (any non-`Exception` `BaseException`) stops **every** pykka actor
  (`ActorRegistry.stop_all()` in pykka 4.5's actor loop), and out of `on_start` it kills
  the thread and leaves a dead actor registered.

A `SupervisedActor` instead stops itself on all of these, runs `on_failure`, and reports
the crash; nothing reaches pykka's global handling. The supervisor restarts per its
strategy after an exponential backoff, counted against its restart intensity; beyond the
intensity it stops its group and calls `on_escalate`. A pykka actor can't restart, so a
restart is a new actor: callers hold a name and ask `whereis(name)` for the current ref.
The loop that does this uses pykka's private API, all of it through `actors.pykka_compat`.

Clocks and randomness are injected into the pure parts (`RestartIntensity`, `Backoff`) so
their arithmetic is testable without sleeping.
"""

from __future__ import annotations

import logging
import random
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import pykka
from pykka import ActorDeadError, ActorRef

from actors import pykka_compat
from runtime.deadlines import wait_seconds
from runtime.errors import InvalidArgument, InvalidArgumentType, KvactorsError, shown

__all__ = [
    "RESTART_TYPES",
    "STRATEGIES",
    "Backoff",
    "ChildExited",
    "ChildSpec",
    "RestartIntensity",
    "SupervisedActor",
    "Supervisor",
    "UnknownChild",
]

logger = logging.getLogger(__name__)

RESTART_TYPES = ("permanent", "transient", "temporary")
STRATEGIES = ("one_for_one", "one_for_all", "rest_for_one")


class UnknownChild(KvactorsError, LookupError):
    """The supervisor has no child of that name (never started, stopped, or not restarted)."""


# --- pure parts --------------------------------------------------------------------------


class RestartIntensity:
    """At most `max_restarts` restarts within any `period` seconds.

    `allow(now)` is asked once per failure that wants a restart. It records a restart at
    `now` and returns True while fewer than `max_restarts` recorded restarts are younger
    than `period` seconds (`now - t < period`); otherwise it records nothing and returns
    False: the supervisor must escalate. `now` values must not decrease.
    """

    def __init__(self, max_restarts: int = 3, period: float = 5.0) -> None:
        if max_restarts < 0:
            raise InvalidArgument(f"max_restarts must be >= 0, got {shown(max_restarts)}")
        if not period > 0:
            raise InvalidArgument(f"period must be > 0 seconds, got {shown(period)}")
        self.max_restarts = max_restarts
        self.period = period
        self._times: deque[float] = deque()

    def allow(self, now: float) -> bool:
        """Record a restart at `now` and return True, or return False when over the limit."""
        while self._times and now - self._times[0] >= self.period:
            self._times.popleft()
        if len(self._times) >= self.max_restarts:
            return False
        self._times.append(now)
        return True


@dataclass(frozen=True)
class Backoff:
    """Exponential backoff with jitter, in seconds: `min` <= delay <= `max`.

    The delay before restart number `attempt` (0 for the first since the last reset) is
    drawn uniformly from [b, min(2b, max)] with b = min(max, min * 2**attempt). A child
    that ran `reset` seconds or more before failing starts over at attempt 0.
    """

    min: float = 0.05
    max: float = 5.0
    reset: float = 10.0

    def __post_init__(self) -> None:
        if not 0 <= self.min <= self.max:
            raise InvalidArgument(f"backoff needs 0 <= min <= max, got min={self.min} max={self.max}")
        if self.reset < 0:
            raise InvalidArgument(f"backoff reset must be >= 0 seconds, got {self.reset}")

    def next_delay(self, attempt: int, ran_for: float, rng: random.Random) -> tuple[float, int]:
        """Return (delay before the restart, attempt to pass at the next failure).

        `attempt` is what the previous call returned (0 at first), `ran_for` the seconds the
        child ran since its last start before this failure.
        """
        if ran_for >= self.reset:
            attempt = 0
        low = min(self.max, self.min * 2.0 ** min(attempt, 64))
        high = min(self.max, 2 * low)
        delay = low + rng.random() * (high - low)
        return max(self.min, min(high, delay)), attempt + 1


# --- messages and specs ------------------------------------------------------------------


@dataclass(frozen=True)
class ChildSpec:
    """A supervised child: `name`, `start` (no arguments, returns a started ActorRef), `restart`.

    `restart` is "permanent" (always restarted), "transient" (restarted only after a crash,
    not after a normal stop) or "temporary" (never restarted; removed when it exits).
    """

    name: str
    start: Callable[[], ActorRef[Any]]
    restart: str = "permanent"

    def __post_init__(self) -> None:
        if self.restart not in RESTART_TYPES:
            raise InvalidArgument(
                f"restart must be one of {', '.join(RESTART_TYPES)}; got {self.restart!r}"
            )


@dataclass(frozen=True)
class ChildExited:
    """Told by a child to its supervisor when it stops: `error` is None for a normal stop.

    The child is identified by `actor_urn`, so a late report from an earlier incarnation
    of a restarted child is ignored. `SupervisedActor` sends it; other actors may too.
    """

    actor_urn: str
    error: BaseException | None


@dataclass(frozen=True)
class _Restart:
    token: int


# --- containment -------------------------------------------------------------------------


class SupervisedActor(pykka_compat.OwnLoopActor):
    """A ThreadingActor whose every failure is a crash reported to its supervisor.

    Any BaseException out of `on_start`, `on_receive` or a proxy call or attribute access
    (SystemExit included), or a non-`Exception` out of `on_stop` (pykka logs an `Exception`
    from `on_stop` and the stop counts as normal), stops this actor only: it is
    unregistered, an ask that raised gets the exception (a non-`Exception` such as
    SystemExit becomes `pykka.ActorDeadError`, so it can't stop the caller), queued asks get
    `ActorDeadError`, `on_failure` runs (also after an `on_start` failure, unlike pykka),
    and then `ChildExited(actor_urn, error)` is told to `supervisor`. A normal stop reports
    `ChildExited(actor_urn, None)`. Subclasses call `super().__init__(supervisor)`;
    with `supervisor=None` the containment holds and failures are only logged.

    Runs its own actor loop (`pykka_compat.OwnLoopActor`); the tests pin that behaviour.
    """

    def __init__(self, supervisor: ActorRef[Any] | None) -> None:
        super().__init__()
        self.supervisor = supervisor

    def actor_loop(self) -> None:
        """This actor's life on its thread: start, receive until stopped, report how it ended."""
        try:
            self.on_start()
        except BaseException as exc:  # noqa: BLE001 - contained: reported, never re-raised
            pykka_compat.mark_stopped(self)
            error: BaseException | None = exc
        else:
            error = self._receive_until_stopped()
        if error is not None:
            logger.error("%s crashed", self, exc_info=error)
            try:
                self.on_failure(type(error), error, error.__traceback__)
            except BaseException:  # noqa: BLE001
                logger.exception("on_failure of %s raised", self)
        pykka_compat.teardown(self)
        if self.supervisor is None:
            return
        try:
            self.supervisor.tell(ChildExited(self.actor_urn, error))
        except ActorDeadError:
            log = logger.warning if error is not None else logger.debug
            log("%s exited (%r) but its supervisor is gone", self, error)

    def _receive_until_stopped(self) -> BaseException | None:
        while not self.actor_stopped.is_set():
            message, reply_to = pykka_compat.next_message(self)
            try:
                response = pykka_compat.handle(self, message)
            except BaseException as exc:  # noqa: BLE001 - contained: reported, never re-raised
                pykka_compat.mark_stopped(self)  # before replying, so the caller sees it dead
                if reply_to is not None:
                    reply_to.set_exception(exc_info=self._caller_exc_info(exc))
                return exc
            if reply_to is not None:
                reply_to.set(response)
        return None

    def take_leftover(self, *types: type) -> list:
        """Remove and return the tells of `types` still queued for this stopping actor.

        pykka drops tells left in a stopped actor's inbox without a word, so an actor
        whose messages carry a reply answers them from here (in `on_stop` or
        `on_failure`). Every other envelope goes back, in order, for pykka's teardown
        (which answers queued asks with ActorDeadError).
        """
        return pykka_compat.take_tells(self, types)

    def _caller_exc_info(self, exc: BaseException) -> tuple[type[BaseException], Any, Any]:
        if isinstance(exc, Exception):
            return type(exc), exc, exc.__traceback__
        dead = ActorDeadError(f"{self} stopped: {exc!r} raised while handling the message")
        return ActorDeadError, dead, None


# --- the supervisor ----------------------------------------------------------------------


@dataclass(eq=False)
class _Child:
    spec: ChildSpec
    ref: ActorRef[Any] | None  # None while a restart is pending
    started_at: float
    attempt: int = 0
    pending: int | None = None  # token of the scheduled restart


def _restarts(restart: str, error: BaseException | None) -> bool:
    return restart == "permanent" or (restart == "transient" and error is not None)


def _start(spec: ChildSpec) -> ActorRef[Any]:
    try:
        ref = spec.start()
    except Exception:
        raise
    except BaseException as exc:  # a SystemExit on the supervisor's thread would stop all actors
        raise RuntimeError(f"start function of child {spec.name!r} raised {exc!r}") from exc
    if not isinstance(ref, ActorRef):
        raise InvalidArgumentType(
            f"start function of child {spec.name!r} must return a started pykka.ActorRef, "
            f"got {type(ref).__name__}"
        )
    return ref


def _restart_after(
    supervisor: ActorRef[Any],
    token: int,
    delay: float,
    stops: list[pykka.Future[bool]],
    cancelled: threading.Event,
) -> None:
    deadline = time.monotonic() + delay
    for stop in stops:  # never two live actors for one name: wait out the old ones' on_stop
        stop.get()
    if cancelled.wait(wait_seconds(max(0.0, deadline - time.monotonic()))):
        return
    try:
        supervisor.tell(_Restart(token))
    except ActorDeadError:
        pass


@dataclass(eq=False)
class _State:
    children: dict[str, _Child] = field(default_factory=dict)  # in start order
    stopping: list[tuple[ActorRef[Any], pykka.Future[bool]]] = field(default_factory=list)
    token: int = 0
    escalation: tuple[str | None, BaseException] | None = None


class Supervisor(pykka.ThreadingActor):
    """A pykka actor that starts, restarts and stops a group of children.

    Use through a proxy: `sup = Supervisor.start("one_for_all", on_escalate=cb)`, then
    `sup.proxy().start_child(ChildSpec("a", lambda: Worker.start(sup))).get()`.

    When a child reports `ChildExited` and its restart type asks for a restart, the strategy
    picks who restarts: "one_for_one" the child alone; "one_for_all" every child;
    "rest_for_one" the child and those started after it. Affected siblings are stopped
    (temporary ones are removed), and all of them are started again, in start order, after
    the failing child's `Backoff` delay and once every old actor has stopped. The mailbox
    stays free meanwhile (a timer thread sends the restart). A restart beyond
    `RestartIntensity(max_restarts, period)` escalates instead: the supervisor stops its
    children and itself and calls `on_escalate(name, error)` on its own thread (`name` is
    None if the supervisor itself failed); without `on_escalate` it only logs.
    A start function that raises during a restart counts as a crash of that child.
    Stopping the supervisor stops its children (last started first) and cancels pending
    restarts. `rng` draws the backoff jitter.
    """

    def __init__(
        self,
        strategy: str = "one_for_one",
        *,
        max_restarts: int = 3,
        period: float = 5.0,
        backoff: Backoff = Backoff(),
        on_escalate: Callable[[str | None, BaseException], None] | None = None,
        rng: random.Random | None = None,
    ) -> None:
        if strategy not in STRATEGIES:
            raise InvalidArgument(f"strategy must be one of {', '.join(STRATEGIES)}; got {strategy!r}")
        super().__init__()
        self.strategy = strategy
        self.backoff = backoff
        self._intensity = RestartIntensity(max_restarts, period)
        self._on_escalate = on_escalate
        self._rng = rng or random.Random()
        self._state = _State()
        self._cancelled = threading.Event()

    # public, called through a proxy

    def start_child(self, spec: ChildSpec) -> ActorRef[Any]:
        """Start `spec` as the last child and return its ref.

        Raises ValueError if the name is taken, TypeError if `start` does not return an
        ActorRef, or whatever `start` raised (the child is then not added).
        """
        if spec.name in self._state.children:
            raise InvalidArgument(
                f"child {spec.name!r} already exists; stop_child it first or pick another name"
            )
        ref = _start(spec)
        self._state.children[spec.name] = _Child(spec, ref, time.monotonic())
        return ref

    def stop_child(self, name: str) -> None:
        """Remove child `name` from the group and stop it; returns once it has stopped.

        Waits for the child to handle its queued messages (so the child must not ask its
        supervisor from `on_stop`). Raises UnknownChild if there is no such child.
        """
        child = self._state.children.pop(name, None)
        if child is None:
            raise UnknownChild(f"no child named {name!r}; children: {list(self._state.children)}")
        if child.ref is not None:
            child.ref.stop()

    def whereis(self, name: str) -> ActorRef[Any] | None:
        """The current ref of child `name`, or None while its restart is pending.

        Raises UnknownChild if the group has no such child (never started, stopped, or
        exited without a restart).
        """
        child = self._state.children.get(name)
        if child is None:
            raise UnknownChild(f"no child named {name!r}; children: {list(self._state.children)}")
        return child.ref

    def children(self) -> dict[str, ActorRef[Any] | None]:
        """Name -> current ref (None while restarting) of every child, in start order."""
        return {name: child.ref for name, child in self._state.children.items()}

    # pykka hooks

    def on_receive(self, message: Any) -> Any:
        if isinstance(message, ChildExited):
            name = self._name_of(message.actor_urn)
            if name is not None:  # else: a stale report from a replaced or removed actor
                self._handle_exit(name, message.error)
        elif isinstance(message, _Restart):
            self._handle_restart(message.token)
        else:
            return super().on_receive(message)
        return None

    def on_stop(self) -> None:
        self._shutdown()

    def on_failure(self, exception_type: Any, exception_value: Any, traceback: Any) -> None:
        self._state.escalation = self._state.escalation or (None, exception_value)
        self._shutdown()

    # internals

    def _name_of(self, actor_urn: str) -> str | None:
        for name, child in self._state.children.items():
            if child.ref is not None and child.ref.actor_urn == actor_urn:
                return name
        return None

    def _affected(self, name: str) -> list[str]:
        names = list(self._state.children)
        if self.strategy == "one_for_all":
            return names
        if self.strategy == "rest_for_one":
            return names[names.index(name):]
        return [name]

    def _handle_exit(self, name: str, error: BaseException | None) -> None:
        state = self._state
        child = state.children[name]
        child.ref = None
        if not _restarts(child.spec.restart, error):
            del state.children[name]
            logger.info("child %r exited (%r); %s, not restarted", name, error, child.spec.restart)
            return
        now = time.monotonic()
        if not self._intensity.allow(now):
            if error is None:
                error = RuntimeError(f"permanent child {name!r} stopped (normal exit)")
            state.escalation = (name, error)
            pykka_compat.stop_now(self)  # skipping the rest of the inbox; on_stop escalates
            return
        delay, child.attempt = self.backoff.next_delay(
            child.attempt, now - child.started_at, self._rng
        )
        state.stopping = [(ref, stop) for ref, stop in state.stopping if ref.is_alive()]
        stops = []  # the failing child has stopped: it reports after its on_failure/on_stop
        state.token += 1
        for other in self._affected(name):
            sibling = state.children[other]
            if sibling.ref is not None:
                stops.append(sibling.ref.stop(block=False))
                state.stopping.append((sibling.ref, stops[-1]))
                sibling.ref = None
            if sibling.spec.restart == "temporary" and other != name:
                del state.children[other]
            else:
                sibling.pending = state.token
        logger.info("child %r exited (%r); %s restart in %.3f s", name, error, self.strategy, delay)
        threading.Thread(
            target=_restart_after,
            args=(self.actor_ref, state.token, delay, stops, self._cancelled),
            name=f"Supervisor-restart-{state.token}",
            daemon=True,
        ).start()

    def _handle_restart(self, token: int) -> None:
        for name in [n for n, c in self._state.children.items() if c.pending == token]:
            child = self._state.children.get(name)
            if child is None or child.pending != token:  # superseded by a failure below
                continue
            child.pending = None
            child.started_at = time.monotonic()
            try:
                child.ref = _start(child.spec)
            except BaseException as exc:  # noqa: BLE001 - a failed start is a crash of that child
                logger.error("restarting child %r failed", name, exc_info=exc)
                self._handle_exit(name, exc)
                if self.actor_stopped.is_set():
                    return

    def _shutdown(self) -> None:
        self._cancelled.set()
        state = self._state
        for child in reversed(list(state.children.values())):
            if child.ref is not None:
                child.ref.stop()
        for _, stop in state.stopping:
            stop.get()
        state.children.clear()
        state.stopping.clear()
        if state.escalation is None:
            return
        name, error = state.escalation
        logger.error("%s escalates: child %r failed beyond intensity", self, name, exc_info=error)
        if self._on_escalate is not None:
            try:
                self._on_escalate(name, error)
            except BaseException:  # noqa: BLE001
                logger.exception("on_escalate of %s raised", self)
