"""Supervision: intensity and backoff arithmetic, strategies, restart types, containment.

The arithmetic is tested with explicit clock values (hypothesis); the actor tests use
real threads with a fast backoff (10-20 ms) and poll with a deadline instead of sleeping.
Children are identified by `actor_urn`: a restart is a new pykka actor with a new urn.
"""

import itertools
import random
import threading
import time

import pykka
import pytest
from hypothesis import given
from hypothesis import strategies as st

from actors.supervisor import (
    Backoff,
    ChildExited,
    ChildSpec,
    RestartIntensity,
    SupervisedActor,
    Supervisor,
    UnknownChild,
)

pytestmark = pytest.mark.timeout(30)

FAST = Backoff(min=0.01, max=0.02, reset=10.0)


def wait_until(predicate, timeout=5.0, what="condition"):
    """Poll `predicate` until it is truthy; fail the test after `timeout` seconds."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.005)
    pytest.fail(f"timed out after {timeout} s waiting for {what}")


@pytest.fixture(autouse=True)
def _stop_all_actors():
    yield
    pykka.ActorRegistry.stop_all()


class Worker(SupervisedActor):
    """Echoes messages; "crash" raises, "exit" raises SystemExit, "stop" stops normally."""

    def __init__(self, supervisor, fail_on_start=None):
        super().__init__(supervisor)
        self.fail_on_start = fail_on_start
        self.failures = []

    def on_start(self):
        if self.fail_on_start is not None:
            raise self.fail_on_start

    def on_receive(self, message):
        if message == "crash":
            raise RuntimeError("boom")
        if message == "exit":
            raise SystemExit(3)
        if message == "stop":
            self.stop()
            return None
        if isinstance(message, tuple) and message[0] == "sleep":
            time.sleep(message[1])
        return message

    def explode(self):
        raise ValueError("proxy boom")

    def on_failure(self, exception_type, exception_value, traceback):
        FAILURES.append((self.actor_urn, exception_type))


FAILURES = []


class Plain(pykka.ThreadingActor):
    def on_receive(self, message):
        return message


def start_group(strategy="one_for_one", restarts=None, **kwargs):
    """A supervisor with Worker children a, b, c (restart types from `restarts`)."""
    kwargs.setdefault("backoff", FAST)
    sup = Supervisor.start(strategy, **kwargs)
    for name in "abc":
        restart = (restarts or {}).get(name, "permanent")
        sup.proxy().start_child(ChildSpec(name, lambda: Worker.start(sup), restart)).get()
    return sup


def urns(sup):
    return {n: r.actor_urn if r else None for n, r in sup.proxy().children().get().items()}


def wait_restarted(sup, name, old_urn):
    def fresh():
        ref = sup.proxy().children().get().get(name)
        return ref if ref is not None and ref.actor_urn != old_urn else None

    return wait_until(fresh, what=f"{name} restarted")


# --- arithmetic --------------------------------------------------------------------------

times_st = st.lists(st.floats(0, 3, allow_nan=False), max_size=40).map(
    lambda steps: list(itertools.accumulate(steps))
)


@given(times_st, st.integers(0, 5), st.floats(0.1, 10))
def test_intensity_allows_exactly_max_restarts_per_period(times, max_restarts, period):
    intensity = RestartIntensity(max_restarts, period)
    accepted = []
    for now in times:
        in_window = sum(1 for t in accepted if now - t < period)
        allowed = intensity.allow(now)
        # escalation exactly on the next failure once the window holds max_restarts
        assert allowed == (in_window < max_restarts)
        if allowed:
            accepted.append(now)
    for end in accepted:  # no window of `period` seconds holds more than max_restarts
        assert sum(1 for t in accepted if 0 <= end - t < period) <= max_restarts


def test_intensity_escalates_on_fourth_failure_by_default_and_recovers_after_period():
    intensity = RestartIntensity()
    assert [intensity.allow(t) for t in (0.0, 1.0, 2.0, 4.9)] == [True, True, True, False]
    assert intensity.allow(5.0)  # the restart at 0.0 has left the window


@given(
    st.floats(0, 1),
    st.floats(0, 10),
    st.floats(0, 20),
    st.lists(st.floats(0, 30, allow_nan=False), min_size=1, max_size=30),
    st.integers(0, 2**32),
)
def test_backoff_within_bounds_grows_and_resets(lo, extra, reset, ran_fors, seed):
    backoff = Backoff(min=lo, max=lo + extra, reset=reset)
    rng = random.Random(seed)
    attempt = 0
    for ran_for in ran_fors:
        delay, next_attempt = backoff.next_delay(attempt, ran_for, rng)
        assert backoff.min <= delay <= backoff.max
        if ran_for >= reset:  # quiet long enough: back to the first step
            assert next_attempt == 1
            assert delay <= min(backoff.max, 2 * backoff.min)
        else:  # exponential: at least min * 2**attempt (capped at max)
            assert next_attempt == attempt + 1
            assert delay >= min(backoff.max, backoff.min * 2**attempt)
        attempt = next_attempt


def test_backoff_jitter_is_deterministic_per_seed_and_reaches_max():
    backoff = Backoff(min=0.1, max=1.0, reset=5.0)
    first = [backoff.next_delay(a, 0.0, random.Random(7))[0] for a in range(6)]
    again = [backoff.next_delay(a, 0.0, random.Random(7))[0] for a in range(6)]
    assert first == again
    assert len({backoff.next_delay(0, 0.0, random.Random(s))[0] for s in range(5)}) > 1
    assert backoff.next_delay(60, 0.0, random.Random(0))[0] == 1.0
    assert backoff.next_delay(10**6, 0.0, random.Random(0))[0] == 1.0  # no overflow


def test_invalid_settings_raise_value_error_naming_the_valid_values():
    with pytest.raises(ValueError, match="permanent, transient, temporary"):
        ChildSpec("a", lambda: None, restart="sometimes")
    with pytest.raises(ValueError, match="one_for_one, one_for_all, rest_for_one"):
        Supervisor.start("one_for_some")
    with pytest.raises(ValueError, match="min <= max"):
        Backoff(min=2.0, max=1.0)
    with pytest.raises(ValueError, match="period"):
        RestartIntensity(3, 0)


# --- strategies and restart types --------------------------------------------------------


@pytest.mark.parametrize(
    ("strategy", "crashed", "expected"),
    [
        ("one_for_one", "b", {"b"}),
        ("one_for_all", "b", {"a", "b", "c"}),
        ("rest_for_one", "b", {"b", "c"}),
        ("rest_for_one", "a", {"a", "b", "c"}),
        ("rest_for_one", "c", {"c"}),
    ],
)
def test_strategy_restarts_exactly_the_affected_children(strategy, crashed, expected):
    sup = start_group(strategy)
    before = urns(sup)
    old_refs = sup.proxy().children().get()
    old_refs[crashed].tell("crash")
    wait_restarted(sup, crashed, before[crashed])
    # a restart group is started in one supervisor message: all of it is visible now
    after = urns(sup)
    assert {n for n in before if after[n] != before[n]} == expected
    assert list(after) == ["a", "b", "c"]  # start order kept
    for name in expected:
        assert not old_refs[name].is_alive()
        assert sup.proxy().whereis(name).get().ask("ping") == "ping"


@pytest.mark.parametrize(
    ("restart", "message", "restarted"),
    [
        ("permanent", "crash", True),
        ("permanent", "stop", True),
        ("transient", "crash", True),
        ("transient", "stop", False),
        ("temporary", "crash", False),
        ("temporary", "stop", False),
    ],
)
def test_restart_types(restart, message, restarted):
    sup = start_group(restarts={"b": restart})
    before = urns(sup)
    sup.proxy().whereis("b").get().tell(message)
    if restarted:
        wait_restarted(sup, "b", before["b"])
    else:
        wait_until(lambda: "b" not in sup.proxy().children().get(), what="b removed")
        with pytest.raises(UnknownChild, match="no child named 'b'"):
            sup.proxy().whereis("b").get()
    after = urns(sup)
    assert after["a"] == before["a"] and after["c"] == before["c"]


def test_one_for_all_removes_temporary_siblings_and_restarts_transient_ones():
    sup = start_group("one_for_all", restarts={"b": "temporary", "c": "transient"})
    before = urns(sup)
    sup.proxy().whereis("a").get().tell("crash")
    wait_restarted(sup, "a", before["a"])
    after = urns(sup)
    assert list(after) == ["a", "c"]
    assert after["c"] != before["c"]


def test_restart_waits_for_the_old_sibling_to_stop():
    sup = Supervisor.start("one_for_all", backoff=FAST)
    made = []

    def start_b():
        alive_at_start = [ref.is_alive() for ref in made]
        made.append(Worker.start(sup))
        starts.append(alive_at_start)
        return made[-1]

    starts = []
    sup.proxy().start_child(ChildSpec("a", lambda: Worker.start(sup))).get()
    sup.proxy().start_child(ChildSpec("b", start_b)).get()
    made[0].tell(("sleep", 0.2))  # b is busy for longer than the backoff
    sup.proxy().whereis("a").get().tell("crash")
    wait_until(lambda: len(starts) == 2, what="b restarted")
    assert starts[1] == [False]


def test_restart_is_delayed_by_the_backoff():
    sup = Supervisor.start(backoff=Backoff(min=0.15, max=0.15, reset=10.0))
    started = []

    def start():
        started.append(time.monotonic())
        return Worker.start(sup)

    ref = sup.proxy().start_child(ChildSpec("a", start)).get()
    crashed_at = time.monotonic()
    ref.tell("crash")
    wait_until(lambda: len(started) == 2, what="restart")
    assert started[1] - crashed_at >= 0.15


def test_start_child_contract():
    sup = Supervisor.start()
    sup.proxy().start_child(ChildSpec("a", lambda: Worker.start(sup))).get()
    with pytest.raises(ValueError, match="'a' already exists"):
        sup.proxy().start_child(ChildSpec("a", lambda: Worker.start(sup))).get()
    with pytest.raises(TypeError, match="must return a started pykka.ActorRef"):
        sup.proxy().start_child(ChildSpec("b", lambda: "not a ref")).get()
    with pytest.raises(ZeroDivisionError):
        sup.proxy().start_child(ChildSpec("c", lambda: 1 / 0)).get()
    assert list(sup.proxy().children().get()) == ["a"]
    assert sup.is_alive()


def test_stop_child_stops_it_without_restart():
    sup = start_group()
    ref = sup.proxy().whereis("b").get()
    sup.proxy().stop_child("b").get()
    assert not ref.is_alive()
    assert list(urns(sup)) == ["a", "c"]
    with pytest.raises(UnknownChild):
        sup.proxy().stop_child("b").get()


# --- the pykka failure paths --------------------------------------------------------------


def test_ask_failure_is_a_crash_not_a_half_changed_actor():
    sup = start_group()
    ref = sup.proxy().whereis("a").get()
    with pytest.raises(RuntimeError, match="boom"):
        ref.ask("crash")
    assert not ref.is_alive()  # plain pykka would keep it running
    new = wait_restarted(sup, "a", ref.actor_urn)
    assert new.ask("ping") == "ping"
    assert (ref.actor_urn, RuntimeError) in FAILURES  # on_failure ran for the ask too


def test_ask_failure_through_a_proxy_is_a_crash():
    sup = start_group()
    ref = sup.proxy().whereis("a").get()
    with pytest.raises(ValueError, match="proxy boom"):
        ref.proxy().explode().get()
    wait_restarted(sup, "a", ref.actor_urn)


def test_tell_failure_reaches_the_supervisor_and_restarts():
    sup = start_group()
    ref = sup.proxy().whereis("a").get()
    ref.tell("crash")
    new = wait_restarted(sup, "a", ref.actor_urn)
    assert new.ask("ping") == "ping"


def test_on_start_failure_reaches_the_supervisor_and_restarts():
    sup = Supervisor.start(backoff=FAST)
    attempts = itertools.count()

    def start():
        fail = RuntimeError("no start") if next(attempts) == 0 else None
        return Worker.start(sup, fail_on_start=fail)

    first = sup.proxy().start_child(ChildSpec("a", start)).get()
    new = wait_restarted(sup, "a", first.actor_urn)
    assert new.ask("ping") == "ping"
    assert not first.is_alive()
    assert (first.actor_urn, RuntimeError) in FAILURES  # on_failure even after on_start


@pytest.mark.parametrize("path", ["tell", "ask", "on_start"])
def test_system_exit_is_contained_to_the_one_actor(path):
    bystander = Plain.start()  # unsupervised: pykka's SystemExit handling would stop it
    sup = Supervisor.start(backoff=FAST)
    attempts = itertools.count()

    def start():
        fail = SystemExit(3) if path == "on_start" and next(attempts) == 0 else None
        return Worker.start(sup, fail_on_start=fail)

    ref = sup.proxy().start_child(ChildSpec("a", start)).get()
    sibling = sup.proxy().start_child(ChildSpec("b", lambda: Worker.start(sup))).get()
    if path == "tell":
        ref.tell("exit")
    elif path == "ask":
        with pytest.raises(pykka.ActorDeadError, match="SystemExit"):
            ref.ask("exit")
    new = wait_restarted(sup, "a", ref.actor_urn)
    assert new.ask("ping") == "ping"
    assert not ref.is_alive()
    assert bystander.ask("still here") == "still here"
    assert sibling.ask("ping") == "ping"
    assert sup.is_alive()
    assert bystander in pykka.ActorRegistry.get_all()


def test_reports_from_an_old_incarnation_are_ignored():
    sup = start_group()
    old = sup.proxy().whereis("a").get()
    old.tell("crash")
    new = wait_restarted(sup, "a", old.actor_urn)
    sup.tell(ChildExited(old.actor_urn, RuntimeError("late")))
    sup.proxy().children().get()  # the report has been handled
    assert sup.proxy().whereis("a").get() is new
    assert new.is_alive()


# --- escalation, names, shutdown ---------------------------------------------------------


def test_escalation_beyond_intensity_stops_the_group_and_calls_on_escalate():
    calls = []
    escalated = threading.Event()

    def on_escalate(name, error):
        calls.append((name, error))
        escalated.set()

    sup = start_group("one_for_one", max_restarts=2, period=5.0, on_escalate=on_escalate)
    siblings = [sup.proxy().whereis(n).get() for n in "bc"]
    for _ in range(2):  # two restarts are within the limit
        ref = sup.proxy().whereis("a").get()
        ref.tell("crash")
        wait_restarted(sup, "a", ref.actor_urn)
    assert calls == []
    last = sup.proxy().whereis("a").get()
    last.tell("crash")  # the next failure escalates
    assert escalated.wait(5)
    assert [(name, type(error), str(error)) for name, error in calls] == [
        ("a", RuntimeError, "boom")
    ]
    assert not sup.is_alive()
    assert not any(ref.is_alive() for ref in siblings)
    assert pykka.ActorRegistry.get_by_class(Worker) == []


def test_a_child_that_never_starts_escalates_instead_of_looping():
    escalated = threading.Event()
    calls = []
    sup = Supervisor.start(
        backoff=FAST, on_escalate=lambda n, e: (calls.append((n, e)), escalated.set())
    )
    sup.proxy().start_child(
        ChildSpec("a", lambda: Worker.start(sup, fail_on_start=RuntimeError("bad config")))
    ).get()
    assert escalated.wait(5)
    assert calls[0][0] == "a" and "bad config" in str(calls[0][1])
    assert not sup.is_alive()


def test_whereis_follows_restarts_and_is_none_while_pending():
    sup = Supervisor.start(backoff=Backoff(min=0.2, max=0.2, reset=10.0))
    first = sup.proxy().start_child(ChildSpec("a", lambda: Worker.start(sup))).get()
    assert sup.proxy().whereis("a").get() is first
    first.tell("crash")
    wait_until(lambda: sup.proxy().whereis("a").get() is None, what="restart pending")
    new = wait_until(lambda: sup.proxy().whereis("a").get(), what="restarted")
    assert new.actor_urn != first.actor_urn and new.is_alive()
    with pytest.raises(UnknownChild):
        sup.proxy().whereis("zed").get()


def test_stopping_the_supervisor_stops_children_and_cancels_pending_restarts():
    sup = Supervisor.start(backoff=Backoff(min=5.0, max=5.0, reset=10.0))
    starts = []

    def start():
        starts.append(Worker.start(sup))
        return starts[-1]

    sup.proxy().start_child(ChildSpec("a", start)).get()
    b = sup.proxy().start_child(ChildSpec("b", lambda: Worker.start(sup))).get()
    starts[0].tell("crash")
    wait_until(lambda: sup.proxy().whereis("a").get() is None, what="restart pending")
    assert any(t.name.startswith("Supervisor-restart") for t in threading.enumerate())
    sup.stop()
    assert not b.is_alive()
    wait_until(
        lambda: not any(t.name.startswith("Supervisor-restart") for t in threading.enumerate()),
        timeout=1.0,
        what="pending restart cancelled",
    )
    assert len(starts) == 1


class _Leftovers(SupervisedActor):
    """Blocks on "block", crashes on "halt", and collects the str tells still queued then."""

    def __init__(self, gate, taken):
        super().__init__(None)
        self.gate, self.taken = gate, taken

    def on_receive(self, message):
        if message == "block":
            self.gate.wait(10)
        elif message == "halt":
            raise RuntimeError("halt")

    def on_failure(self, *exc_info):
        self.taken.extend(self.take_leftover(str))


def test_take_leftover_returns_queued_tells_and_leaves_asks_to_pykka():
    gate, taken = threading.Event(), []
    ref = _Leftovers.start(gate, taken)
    ref.tell("block")
    ref.tell("halt")
    ref.tell("x")
    asked = ref.ask("y", block=False)
    ref.tell(42)  # not a str: left for pykka, which drops tells
    gate.set()
    with pytest.raises(pykka.ActorDeadError):
        asked.get(timeout=10)  # answered by pykka's teardown, not swallowed
    assert taken == ["x"]
