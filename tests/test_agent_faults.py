"""Faults at the edges of supervision and the facade: a temporary agent that crashed, one turn id in two agents,
token ids past the model's embedding, a batcher crash with a full batch in flight, a shutdown during a long
engine step. Each promise: a clear error in the caller, no crash of a shared actor, no escalation for one fault."""

from __future__ import annotations

import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest

from actors import pykka_compat
from actors.batcher import Submit
from actors.supervisor import Backoff
from runtime import AgentCrashed, Runtime, TurnTimeout, UnknownAgent
from runtime.api.testing import inject_crash
from runtime.engine import Turn
from test_agents import stalled_batcher

ROOT = Path(__file__).resolve().parent.parent
FAST = Backoff(min=0.001, max=0.02, reset=10.0)


# -- a temporary agent that crashed is not running -------------------------------------------------------------------


def crash_temporary(rt):
    """Spawn agent "tmp" as temporary, give it a turn, crash it; its supervisor drops it (no restart). Its ref."""
    tmp = rt.spawn("tmp", system="You are T.", restart="temporary")
    tmp.ask("One.", max_tokens=4)
    inject_crash(tmp)
    with pytest.raises(AgentCrashed):
        tmp.ask("Crash.", max_tokens=4)
    time.sleep(0.3)
    return tmp


def test_a_crashed_temporary_agent_can_be_spawned_again_and_forgotten(tmp_path):
    with Runtime(model=None, cache_dir=tmp_path, backoff=FAST) as rt:
        crash_temporary(rt)
        # was InvalidArgument "agent 'tmp' is already running; use rt.agent('tmp')":
        again = rt.spawn("tmp", system="You are T.")  # its durable history is still there
        assert again.ask("Two.", max_tokens=4).agent == "tmp"


def test_running_does_not_list_a_temporary_agent_that_crashed(tmp_path):
    with Runtime(model=None, cache_dir=tmp_path, backoff=FAST) as rt:
        crash_temporary(rt)
        assert rt.running() == []  # was ['tmp']


def test_a_crashed_temporary_agent_is_not_running_for_agent_agents_or_broadcast(tmp_path):
    """`running()` left it out, but `agent()` still returned its ref, `agents()` listed it as running, and
    `broadcast` with it sent the other agents their turns (their futures lost) before raising UnknownAgent."""
    with Runtime(model=None, cache_dir=tmp_path, backoff=FAST) as rt:
        other = rt.spawn("other")
        tmp = crash_temporary(rt)
        with pytest.raises(UnknownAgent, match="'tmp'"):
            rt.agent("tmp")
        assert [(a.name, a.running) for a in rt.agents()] == [("other", True), ("tmp", False)]  # tmp: stored
        with pytest.raises(UnknownAgent, match="'tmp'"):
            rt.broadcast([other, tmp], "Hello all.", max_tokens=4)
        assert other.history() == []  # nobody took a turn


def test_forget_deletes_a_crashed_temporary_agents_files(tmp_path):
    with Runtime(model=None, cache_dir=tmp_path, backoff=FAST) as rt:
        crash_temporary(rt)
        assert rt.forget("tmp") is True  # raised UnknownChild, and the files stayed
        assert not rt.stored("tmp")


def test_a_send_that_its_restarting_agent_never_takes_carries_the_turn_id_to_retry_with(tmp_path):
    """AgentCrashed says to retry with the same turn_id, but a send that gave up waiting for its agent's restart
    raised it with turn_id None, so a caller of a fresh id had none to retry with."""
    slow = Backoff(min=11.0, max=11.0, reset=10.0)  # the restart comes after a send stops waiting for it (10 s)
    with Runtime(model=None, cache_dir=tmp_path, backoff=slow) as rt:
        a = rt.spawn("a")
        inject_crash(a)
        with pytest.raises(AgentCrashed):
            a.ask("Crash.", max_tokens=2)
        with pytest.raises(AgentCrashed) as e:
            a.send("Again.", max_tokens=2)  # a fresh turn id, which only the error can tell
        turn_id = e.value.turn_id
        assert turn_id is not None and str(e.value).startswith(f"turn {turn_id}: ") and "retry" in str(e.value)
        assert a.ask("Again.", max_tokens=2, turn_id=turn_id, timeout=60).turn_id == turn_id  # restarted by now


# -- turn ids are each agent's own -----------------------------------------------------------------------------------


def test_two_agents_may_use_the_same_turn_id_at_once(tmp_path):
    escalated = threading.Event()
    with Runtime(model=None, cache_dir=tmp_path, backoff=FAST, max_restarts=0,
                 on_escalate=lambda name, error: escalated.set()) as rt:
        a, b = rt.spawn("a"), rt.spawn("b")
        with stalled_batcher(rt):  # both turns reach the batcher before either finishes
            fa = a.send("Hello.", max_tokens=4, turn_id="req-1")
            fb = b.send("Hello.", max_tokens=4, turn_id="req-1")  # turn ids are each agent's own idempotency keys
            time.sleep(0.2)
        assert fa.get(timeout=60).turn_id == "req-1"
        assert fb.get(timeout=60).turn_id == "req-1"  # AgentCrashed: "a turn with this id is already running"
        assert not escalated.is_set()
        assert a.ask("Again.", max_tokens=4).agent == "a"  # RuntimeEscalated with max_restarts=0


def test_a_turn_waiting_for_another_agents_turn_of_its_id_times_out_without_disturbing_it(tmp_path):
    """b's turn "req-1" waits at the batcher while a's "req-1" decodes. Its caller got TurnTimeout at its deadline,
    but the turn stayed at the batcher until a's ended, and every later message of b's waited behind it."""
    with Runtime(model=None, cache_dir=tmp_path, backoff=FAST) as rt:
        a, b = rt.spawn("a"), rt.spawn("b")
        decoding = threading.Event()

        def slowly(piece):  # about 5 s of decode for a's turn
            decoding.set()
            time.sleep(0.005)

        long = a.send("Hello.", max_tokens=1000, turn_id="req-1", on_token=slowly, timeout=300)
        assert decoding.wait(30)
        with pytest.raises(TurnTimeout) as waited:
            b.ask("Hello.", max_tokens=4, turn_id="req-1", timeout=0.5)
        assert waited.value.turn_id == "req-1"
        assert b.ask("Next.", max_tokens=4, timeout=3).agent == "b"  # b is free again while a's turn decodes
        assert b.result("req-1", timeout=3) is None  # dropped: it never ran
        with pytest.raises(TurnTimeout):
            long.get(timeout=0)  # a's turn is still decoding
        done = long.get(timeout=120)
        assert (done.turn_id, done.finish_reason, len(done.tokens)) == ("req-1", "length", 1000)


def test_turns_waiting_for_one_id_each_run_when_one_of_them_is_refused(tmp_path):
    """Three turns of one id at the batcher: the one waiting behind the running turn is refused at its submit (no
    tokens), and the third still runs after it."""
    from actors.batcher import submit

    with Runtime(model=None, cache_dir=tmp_path, backoff=FAST) as rt:
        tokens = rt.tokenizer.encode("hello", add_special_tokens=False)
        with stalled_batcher(rt):
            batcher = rt._env.batcher()
            first = submit(batcher, Turn("same", "x", None, tokens, max_tokens=2))
            refused = submit(batcher, Turn("same", "y", None, [], max_tokens=2))
            third = submit(batcher, Turn("same", "z", None, tokens, max_tokens=2))
        assert first.get(timeout=60).turn_id == "same"
        with pytest.raises(Exception, match="no tokens"):
            refused.get(timeout=60)
        assert third.get(timeout=60).turn_id == "same"


# -- reset records whose tokens the model does not have (read past its embedding, the process segfaulted) ------------


CHILD = textwrap.dedent("""
    import sys
    from runtime import Runtime
    with Runtime(model=None, cache_dir=sys.argv[1]) as rt:
        a = rt.spawn("a", system="You are A.")
        a.ask("Hello there.", max_tokens=4)
        h = [r for r in a.history() if r["role"] != "system"]
        tokens = list(h[-1]["tokens"])
        h[-1] = dict(h[-1], tokens=tokens[:1] + [10**6] + tokens[1:])  # an id far past the vocabulary
        try:
            a.reset(h).get(timeout=60)
        except ValueError as e:
            print("refused:", e)
            sys.exit(0)
        print("reset accepted", flush=True)
        print(a.ask("Again.", max_tokens=4).cache, flush=True)
""")


def test_reset_refuses_token_ids_past_the_vocabulary_instead_of_crashing_the_process(tmp_path):
    p = subprocess.run([sys.executable, "-c", CHILD, str(tmp_path)], capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, f"rc {p.returncode}: {p.stdout[-500:]} {p.stderr[-1500:]}"
    assert "refused" in p.stdout


# -- one batcher crash is one fault, however many turns it held ------------------------------------------------------


def test_a_batcher_crash_with_a_full_batch_in_flight_does_not_escalate(tmp_path):
    escalated = threading.Event()
    with Runtime(model=None, cache_dir=tmp_path, backoff=FAST,  # the defaults: max_restarts=3, restart_period=5
                 on_escalate=lambda name, error: escalated.set()) as rt:
        agents = [rt.spawn(f"a{i}") for i in range(4)]
        for a in agents:
            a.ask("One.", max_tokens=4)
        old = rt._env.batcher()
        with stalled_batcher(rt):
            futures = [a.send("Two.", max_tokens=4) for a in agents]
            deadline = time.monotonic() + 10
            while pykka_compat.queued(old) < len(agents) and time.monotonic() < deadline:
                time.sleep(0.005)
            old.tell(object())  # an unknown message: the batcher crashes, failing the 4 turns in flight
        for f in futures:
            with pytest.raises(AgentCrashed):
                f.get(timeout=30)
        time.sleep(0.5)
        assert not escalated.is_set()  # the agents' supervisor counted 4 "crashes" and gave up
        assert agents[0].ask("Three.", max_tokens=4).agent == "a0"  # RuntimeEscalated


# -- shutdown while the batcher is in a long step --------------------------------------------------------------------


def test_shutdown_during_a_long_engine_step_raises_a_kvactors_error_and_can_be_retried(tmp_path, monkeypatch):
    from runtime import WaitTimeout
    from runtime.api import facade

    monkeypatch.setattr(facade, "STOP_WAIT_S", 1.0)
    rt = Runtime(model=None, cache_dir=tmp_path)
    entered, release = threading.Event(), threading.Event()

    def reply(outcome):  # a step that takes long (a big prefill chunk on a CPU, a slow callback)
        entered.set()
        release.wait(120)

    tokens = rt.tokenizer.encode("gate", add_special_tokens=False)
    rt._env.batcher().tell(Submit(Turn("gate-1", "gate", None, tokens, max_tokens=1), reply))
    assert entered.wait(30)
    try:
        with pytest.raises(WaitTimeout, match="shutdown"):  # was pykka.Timeout, not a KvactorsError
            rt.shutdown()
    finally:
        release.set()
    rt.shutdown()  # once the step is over, a second call finishes the job
    with Runtime(model=None, cache_dir=tmp_path) as again:  # CacheDirInUse: the first one never let go
        assert again.spawn("a").ask("Hi.", max_tokens=2).agent == "a"


@pytest.mark.parametrize("raising", [True, False])
def test_a_with_block_left_during_a_long_engine_step_raises_its_own_exception(tmp_path, monkeypatch, caplog, raising):
    """__exit__'s shutdown raised WaitTimeout over the exception leaving the block (kept only as its __context__):
    that exception goes on, the WaitTimeout is logged; a block that raised nothing still gets the WaitTimeout."""
    from runtime import WaitTimeout
    from runtime.api import facade

    monkeypatch.setattr(facade, "STOP_WAIT_S", 1.0)
    entered, release = threading.Event(), threading.Event()

    def slow(piece):  # a slow callback: the engine's step lasts past the stop wait
        entered.set()
        release.wait(120)

    expected = (KeyError, "the caller's own") if raising else (WaitTimeout, r"call shutdown\(\) again")
    try:
        with pytest.raises(expected[0], match=expected[1]):
            with Runtime(model=None, cache_dir=tmp_path) as rt:
                rt.spawn("a").send("Hi.", max_tokens=2, on_token=slow)
                assert entered.wait(30)
                if raising:
                    raise KeyError("the caller's own")
    finally:
        release.set()
    assert ("call shutdown() again" in caplog.text) is raising  # logged where it could not be raised
    rt.shutdown()  # once the step is over, a second call finishes the job
    with Runtime(model=None, cache_dir=tmp_path) as again:
        assert again.spawn("a").ask("Hi.", max_tokens=2).agent == "a"


def test_agent_in_a_done_callback_does_not_wait_for_a_supervisor_stopping_that_agent(tmp_path):
    """A reply's done callback runs on the agent's thread, also while its supervisor stops it (`stop`): there
    `rt.agent(other)` asked the supervisor, which waited for this very thread, and both hung 10 s. The batcher
    holds the turn, so the stop fails it and runs its callback within the stop: `rt.agent` answers there without
    leaving a request for the supervisor."""
    with Runtime(model=None, cache_dir=tmp_path) as rt:
        a, b = rt.spawn("a"), rt.spawn("b")
        got = []

        def done(_):
            got.append((rt.agent("b").name, rt._env.stopped_by_user("a"), pykka_compat.queued(rt._supervisor)))

        with stalled_batcher(rt):
            future = a.send("Hello there.", max_tokens=4)
            future.add_done_callback(done)
            a.stop()
        assert got == [("b", True, 0)], got  # within the stop, and nothing queued for the supervisor
        assert rt.running() == ["b"] and b.name == "b"
