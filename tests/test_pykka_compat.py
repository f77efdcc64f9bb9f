"""Contract of `actors.pykka_compat` against the installed pykka.

Each test pins what one function does with the real pykka. A failure means pykka's
internals changed: the message names the pykka version; fix `actors/pykka_compat.py`
(and only it) before upgrading.
"""

import contextlib
import gc
import threading

import pykka
import pytest

from actors import pykka_compat
from actors.pykka_compat import PYKKA_VERSION


@contextlib.contextmanager
def contract(what: str):
    """Turn any failure inside into one that names pykka's version and what broke."""
    try:
        yield
    except Exception as e:  # noqa: BLE001 - every failure is a broken contract
        pytest.fail(f"pykka {PYKKA_VERSION} broke the contract of actors.pykka_compat: {what} "
                    f"({type(e).__name__}: {e}); update actors/pykka_compat.py for this pykka version", pytrace=True)


@pytest.fixture(autouse=True)
def _stop_all():
    yield
    pykka.ActorRegistry.stop_all()


class Loop(pykka_compat.OwnLoopActor):
    """A minimal own loop: start, handle until stopped, tear down; records what ran where."""

    def __init__(self):
        super().__init__()
        self.log = []
        self.gate = threading.Event()
        self.gate.set()

    def actor_loop(self):
        self.log.append(("loop", threading.current_thread() is not threading.main_thread()))
        self.on_start()
        while not self.actor_stopped.is_set():
            message, reply_to = pykka_compat.next_message(self)
            response = pykka_compat.handle(self, message)
            if reply_to is not None:
                reply_to.set(response)
        pykka_compat.teardown(self)
        self.log.append("ended")

    def on_start(self):
        self.log.append("on_start")

    def on_stop(self):
        self.log.append("on_stop")

    def on_receive(self, message):
        if message == "hold":
            self.gate.wait(10)
        self.log.append(("receive", message))
        return f"got {message}"

    def echo(self, x):
        return x * 2


def test_check_passes_and_names_the_version():
    with contract("check() found the internals it needs missing"):
        pykka_compat.check()
    assert PYKKA_VERSION[0].isdigit()


def test_own_loop_replaces_pykkas_loop_on_the_actors_thread():
    with contract("OwnLoopActor did not run actor_loop on the actor's thread"):
        ref = Loop.start()
        actor = pykka_compat.actor_of(ref)
        ref.stop(timeout=5)
        assert actor.log[0] == ("loop", True)
        assert actor.log[1] == "on_start"  # called by actor_loop, once: pykka's loop did not run
        assert actor.log.count("on_start") == 1 and actor.log[-1] == "ended"


def test_next_message_and_handle_serve_tells_asks_proxies_and_stop():
    with contract("next_message/handle did not dispatch like pykka's loop"):
        ref = Loop.start()
        actor = pykka_compat.actor_of(ref)
        ref.tell("a tell")
        assert ref.ask("an ask", timeout=5) == "got an ask"
        assert ref.proxy().echo(21).get(timeout=5) == 42
        assert ref.stop(timeout=5) is True
        assert ("receive", "a tell") in actor.log and "on_stop" in actor.log
        assert not ref.is_alive() and actor.actor_stopped.is_set()


def test_handle_lets_exceptions_through():
    class Failing(Loop):
        def on_receive(self, message):
            raise KeyError(message)

    with contract("handle() swallowed an exception instead of raising it"):
        actor = Failing()
        with pytest.raises(KeyError):
            pykka_compat.handle(actor, "boom")


def test_teardown_answers_queued_asks_with_actor_dead_error():
    with contract("teardown() did not answer queued asks with ActorDeadError"):
        actor = Loop()  # never started: its inbox is ours to fill
        pykka.ActorRegistry.register(actor.actor_ref)
        future = actor.actor_ref.ask("late", block=False)
        actor.actor_ref.tell("dropped")
        pykka_compat.mark_stopped(actor)
        pykka_compat.teardown(actor)
        with pytest.raises(pykka.ActorDeadError):
            future.get(timeout=0)
        assert pykka_compat.inbox_empty(actor) and ("receive", "late") not in actor.log


def test_stop_now_unregisters_runs_on_stop_and_skips_the_inbox():
    with contract("stop_now() did not stop the actor at once"):
        actor = Loop()
        pykka.ActorRegistry.register(actor.actor_ref)
        actor.actor_ref.tell("skipped")
        pykka_compat.stop_now(actor)
        assert actor.actor_stopped.is_set() and "on_stop" in actor.log
        assert actor.actor_ref not in pykka.ActorRegistry.get_all()
        assert pykka_compat.queued(actor) == 1  # left for teardown


def test_mark_stopped_unregisters_without_on_stop():
    with contract("mark_stopped() did not stop the actor quietly"):
        actor = Loop()
        pykka.ActorRegistry.register(actor.actor_ref)
        pykka_compat.mark_stopped(actor)
        assert actor.actor_stopped.is_set() and not actor.actor_ref.is_alive()
        assert "on_stop" not in actor.log
        assert actor.actor_ref not in pykka.ActorRegistry.get_all()


def test_take_tells_takes_matching_tells_in_order_and_leaves_the_rest():
    with contract("take_tells() took the wrong envelopes or reordered the rest"):
        actor = Loop()
        ref = actor.actor_ref
        ref.tell("one")
        asked = ref.ask("asked", block=False)
        ref.tell(7)
        ref.tell("two")
        assert pykka_compat.queued(ref) == 4 and not pykka_compat.inbox_empty(actor)
        assert pykka_compat.take_tells(actor, (str,)) == ["one", "two"]
        assert pykka_compat.queued(actor) == 2
        rest = [pykka_compat.next_message(actor) for _ in range(2)]
        assert rest[0][0] == "asked" and rest[0][1] is not None
        assert rest[1] == (7, None)
        assert pykka_compat.inbox_empty(actor)
        with pytest.raises(pykka.Timeout):  # the ask was handed back, not answered
            asked.get(timeout=0)


def test_queued_and_inbox_empty_follow_a_held_actor():
    with contract("queued()/inbox_empty() did not count the inbox"):
        ref = Loop.start()
        actor = pykka_compat.actor_of(ref)
        actor.gate.clear()
        ref.tell("hold")
        for k in range(3):
            ref.tell(k)
        pause = threading.Event()
        for _ in range(500):  # until the actor holds "hold" and the three wait behind it
            if pykka_compat.queued(ref) == 3:
                break
            pause.wait(0.01)
        assert pykka_compat.queued(ref) == 3 and not pykka_compat.inbox_empty(actor)
        actor.gate.set()
        ref.stop(timeout=5)
        assert pykka_compat.inbox_empty(actor)


def test_actor_of_is_the_actor_and_none_once_collected():
    with contract("actor_of() did not return the actor behind its ref"):
        actor = Loop()
        ref = actor.actor_ref
        assert pykka_compat.actor_of(ref) is actor
        del actor
        gc.collect()
        assert pykka_compat.actor_of(ref) is None


def test_check_names_the_version_when_an_internal_is_gone(monkeypatch):
    monkeypatch.delattr(pykka.Actor, "_handle_receive")
    with pytest.raises(ImportError, match=f"pykka {PYKKA_VERSION} lacks _handle_receive"):
        pykka_compat.check()


def test_a_broken_contract_names_the_pykka_version():
    with pytest.raises(pytest.fail.Exception, match=f"pykka {PYKKA_VERSION} broke the contract"):
        with contract("an example"):
            raise AttributeError("'Actor' object has no attribute '_stop'")
