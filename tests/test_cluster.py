"""The Runtime on a Ray cluster: a local cluster of three CPU nodes on this machine, the tiny model.

One cluster for the module (a head and two nodes, 2 logical CPUs each, on loopback),
one `Runtime(cluster="ray")` on it for the agent-level tests, and the node-death
test last, since it takes a node away. The shared folder is a temp folder: every
node of a local cluster sees it.
"""

from __future__ import annotations

import asyncio
import os
import random
import signal
import subprocess
import sys
import threading
import time

import msgpack
import pytest

from runtime import (AgentCrashed, AgentInUse, AgentRef, CacheDirInUse, CallbackFailed, InvalidArgument, KvactorsError,
                     NodeDown, RayMissing, Runtime, SystemPromptChanged, SystemPromptTooLong, TurnTimeout, UnknownAgent,
                     WaitTimeout)
from runtime import store
from runtime.api import testing

ray = pytest.importorskip("ray", reason="the Ray tests need `pip install 'kvactors[ray]'`")
from ray.cluster_utils import Cluster  # noqa: E402

NODE = dict(num_cpus=2, object_store_memory=128 << 20)
# Node death is noticed after 10 missed health checks of 1 s (Ray's default waits longer; fewer risks
# taking a busy node for dead on a 2-core machine).
HEAD = dict(NODE, include_dashboard=False,
            _system_config={"health_check_period_ms": 1000, "health_check_failure_threshold": 10})
OPTS = dict(max_tokens=4, timeout=120)
LONG = dict(max_tokens=3800, timeout=300)  # a turn of many seconds on the tiny model: its agent is busy meanwhile


@pytest.fixture(scope="module")
def cluster():
    c = Cluster(initialize_head=True, head_node_args=HEAD)
    for _ in range(2):
        c.add_node(**NODE)
    ray.init(address=c.address, log_to_driver=False, logging_level="warning")
    c.wait_for_nodes()
    yield c
    ray.shutdown()
    c.shutdown()


@pytest.fixture(scope="module")
def shared(tmp_path_factory):
    return tmp_path_factory.mktemp("shared")


@pytest.fixture(scope="module")
def rt(cluster, shared):
    with Runtime(model="tiny", cache_dir=shared, cluster="ray") as runtime:
        yield runtime


def local_spec(runtime):
    """What `store.read_journal` needs of a model spec: its fingerprint."""
    return type("Spec", (), {"fingerprint": runtime.fingerprint})()


def _turns(history) -> list[tuple]:
    return [(r["role"], r["text"], r.get("sender")) for r in history]


def test_one_host_per_node_and_agents_spread_over_them(rt):
    assert len(set(rt.nodes())) == 3
    refs = [rt.spawn(f"spread{i}", system="Be brief.") for i in range(3)]
    placed = rt.placement()
    assert {placed[r.name] for r in refs} == set(rt.nodes())
    hosts = rt.hosts()  # the same placement, host by host: no GPUs here
    assert [h["node_id"] for h in hosts] == rt.nodes() and all(h["gpus"] == [] for h in hosts)
    assert {name: h["node_id"] for h in hosts for name in h["agents"]} == {r.name: placed[r.name] for r in refs}
    assert len({h["pid"] for h in hosts}) == 3
    assert [r.ask("Hello?", **OPTS).cache for r in refs] == ["cold"] * 3


def test_the_same_conversation_as_on_one_machine(rt, tmp_path):
    """ask, send, note, send_to, converse, broadcast, history: the same replies and records as a local Runtime."""

    def play(runtime):
        a, b = runtime.spawn("same-a", system="You are A."), runtime.spawn("same-b", system="You are B.")
        out = [a.ask("Hi there.", **OPTS), a.send("And again.", **OPTS).get(timeout=120)]
        a.note("A remark.", sender="same-b")
        out.append(b.send_to(a, "From b to a.", **OPTS).get(timeout=120))
        out += runtime.converse([a, b], "Talk.", 2, max_tokens=3, timeout=120)
        out += [f.get(timeout=120) for f in runtime.broadcast([a, b], "All of you.", max_tokens=3, timeout=120)]
        return [(r.agent, r.text, r.tokens) for r in out], _turns(a.history()), _turns(b.history()), \
            [r.cache for r in out]

    on_cluster = play(rt)
    with Runtime(model="tiny", cache_dir=tmp_path) as local:
        on_one = play(local)
    assert rt.placement()["same-a"] != rt.placement()["same-b"]  # the send_to reply crossed nodes
    assert on_cluster == on_one  # replies, tokens, both histories and cache states


def test_agents_flush_and_engine_stats_cover_every_host(rt, shared):
    """agents() lists what a local Runtime would over the shared folder; every host's engine shows its own turns."""
    refs = [rt.spawn(f"census{i}", system="Be brief.") for i in range(3)]
    before = [len(st.prefill_chunks) for st in rt.engine_stats()]
    for r in refs:
        r.ask("Hello?", **OPTS)
    refs[0].ask("Again?", **OPTS)
    rt.flush()
    infos = {a.name: a for a in rt.agents()}
    assert [(infos[r.name].running, infos[r.name].turns, infos[r.name].cache) for r in refs] == \
        [(True, 2, "hot"), (True, 1, "hot"), (True, 1, "hot")]
    assert all(store.agent_dir(shared, rt.fingerprint, r.name).exists() for r in refs)
    stats, hosts = rt.engine_stats(), rt.hosts()
    assert len(stats) == len(hosts) == len(before) == 3
    for st, host, n in zip(stats, hosts, before):  # each turn prefilled (one short chunk) on its agent's host
        assert len(st.prefill_chunks) - n == sum(2 if r is refs[0] else 1 for r in refs if r.name in host["agents"])
    refs[1].stop()
    assert rt.agents()[[a.name for a in rt.agents()].index(refs[1].name)].running is False  # stored, not running


def test_turn_ids_make_retries_idempotent_and_result_finds_them(rt):
    a = rt.spawn("idem", system="Be brief.")
    first = a.ask("Once.", turn_id="idem-1", **OPTS)
    again = a.ask("Once.", turn_id="idem-1", **OPTS)
    assert again.cache == "committed" and again.text == first.text
    assert a.result("idem-1").text == first.text and a.result("idem-nope") is None
    assert sum(r.get("turn_id") == "idem-1" and r["role"] == "assistant" for r in a.history()) == 1


def test_per_sender_order_holds_for_messages_sent_without_waiting(rt):
    a = rt.spawn("order", system="Be brief.")
    futures = [a.send(f"message {i}", max_tokens=2, timeout=120) for i in range(6)]
    replies = [f.get(timeout=300) for f in futures]
    users = [r["text"] for r in a.history() if r["role"] == "user"]
    assert users == [f"message {i}" for i in range(6)]
    assert [r["turn_id"] for r in a.history() if r["role"] == "assistant"] == [r.turn_id for r in replies]


def test_one_live_actor_per_name_across_the_cluster(rt, shared):
    a = rt.spawn("single", system="Be brief.")
    a.ask("Hello?", **OPTS)
    with pytest.raises(ValueError, match="already running"):
        rt.spawn("single")
    with pytest.raises(AgentInUse, match="one live actor"):  # any other process sharing the folder is refused
        store.lock_agent(shared, rt.fingerprint, "single")
    with pytest.raises(CacheDirInUse):  # nor does a Runtime of one machine write there meanwhile
        Runtime(model="tiny", cache_dir=shared)
    a.stop()
    os.close(store.lock_agent(shared, rt.fingerprint, "single"))  # released by stop
    with pytest.raises(UnknownAgent):
        a.ask("Anyone?", **OPTS)
    assert rt.spawn("single").ask("Back?", **OPTS).cache == "warm"  # wherever it lands, it reloads


def test_forget_of_a_running_agent_lets_its_name_start_again(rt, shared):
    """forget stopped a running agent and deleted its files, but its host kept the agent's lock: spawning the name
    again (there, or on any host) raised AgentInUse although the agent was gone."""
    a = rt.spawn("forgotten", system="Be brief.")
    a.ask("Hello?", **OPTS)
    assert rt.forget("forgotten") is True and not rt.stored("forgotten") and "forgotten" not in rt.running()
    assert rt.spawn("forgotten", system="Be brief.").ask("Hello again?", **OPTS).cache == "cold"  # a fresh start
    rt.forget("forgotten")
    os.close(store.lock_agent(shared, rt.fingerprint, "forgotten"))  # no host holds it


def crash_temporary(rt, name) -> tuple:
    """Spawn agent `name` as temporary, give it a turn, crash it on its host; its supervisor there drops it (no
    restart). Its ref and first reply."""
    a = rt.spawn(name, system="Be brief.", restart="temporary")
    first = a.ask("Hello?", **OPTS)
    testing.inject_crash(a)
    with pytest.raises(AgentCrashed):
        a.ask("Crash.", **OPTS)
    return a, first


@pytest.mark.parametrize("noticed_by", ["ask", "running"])
def test_a_temporary_agent_that_crashed_is_gone_and_its_name_starts_again_on_any_host(rt, shared, noticed_by):
    """A temporary agent that crashed was dropped by its host's supervisor, as on one machine, but the cluster still
    listed it in `running()` and refused to spawn the name ("already running"), and its host kept the agent's lock,
    so no other host or process could run it either. The cluster asks the host, as one machine asks its supervisor:
    the agent is not running, its host lets go of its lock once it finds it gone, and the name starts again."""
    name = f"fleeting-{noticed_by}"
    a, first = crash_temporary(rt, name)
    if noticed_by == "ask":
        with pytest.raises(UnknownAgent, match=repr(name)):
            a.ask("Anyone?", **OPTS)
        assert name not in rt.running()
        # one dead letter, as on one machine: its host, asked again after a recovery, recorded it each time
        assert [d.message["text"] for d in rt.dead_letters if d.recipient == name] == ["Anyone?"]
    else:  # the supervisor drops it soon after the crash; only `running()` asks
        deadline = time.monotonic() + 60
        while name in rt.running() and time.monotonic() < deadline:
            time.sleep(0.1)
        assert name not in rt.running()
    with pytest.raises(UnknownAgent, match=repr(name)):
        rt.agent(name)
    os.close(store.lock_agent(shared, rt.fingerprint, name))  # its host let go: another process or host may run it
    again = rt.spawn(name, system="Be brief.")  # was InvalidArgument "already running"
    assert name in rt.running()
    assert again.ask("Back?", **OPTS).agent == name
    assert [r["turn_id"] for r in again.history() if r["role"] == "assistant"][0] == first.turn_id  # resumed
    with pytest.raises(AgentInUse, match="one live actor"):
        store.lock_agent(shared, rt.fingerprint, name)
    again.stop()


@pytest.mark.parametrize("call", ["stop", "forget"])
def test_a_stop_past_its_wait_keeps_the_agent_locked_until_its_actor_has_stopped(rt, shared, call):
    """A stop on a host that ran past its wait (WaitTimeout) released the agent's lock while its actor still ran, so
    another process could start a second actor of the name beside it, both writing its files. The host holds the
    lock until the actor has stopped, as one machine holds the name: meanwhile the name is refused elsewhere, the
    agent takes no messages, and a spawn of it waits for the stop (WaitTimeout saying to call it again); the call
    made again waits for the stop and releases the lock (forget then deletes the files)."""
    name = f"lingering-{call}"
    a = rt.spawn(name, system="Be brief.")
    first = a.ask("Hello?", **OPTS)
    with testing.held_stops(rt, rt.placement()[name], wait_s=0.5):
        with pytest.raises(WaitTimeout, match=rf"{call}\(\) waited .*the stop goes on.*call {call}\(\) again"):
            {"stop": a.stop, "forget": lambda: rt.forget(name, timeout=0.5)}[call]()
        with pytest.raises(AgentInUse, match="one live actor"):  # its actor may still run: no other one starts
            store.lock_agent(shared, rt.fingerprint, name)
        assert name not in rt.running()
        with pytest.raises(UnknownAgent):
            a.ask("Anyone there?", **OPTS)
        advice = rf"spawn\(\) waited 0.5 s .* stop agent '{name}'.*call spawn\(\) again"
        with pytest.raises(WaitTimeout, match=advice):  # its spawn waits for the stop, on the host that stops it
            rt.spawn(name, timeout=0.5)
        with pytest.raises(AgentInUse, match="one live actor"):
            store.lock_agent(shared, rt.fingerprint, name)
    {"stop": a.stop, "forget": lambda: rt.forget(name)}[call]()  # made again, it waits for the stop to finish
    os.close(store.lock_agent(shared, rt.fingerprint, name))  # released once stopped
    assert rt.stored(name) is (call == "stop") and name not in rt.running()
    again = rt.spawn(name, system="Be brief.")
    assert again.ask("Back?", **OPTS).cache == ("warm" if call == "stop" else "cold")
    assert ([r["turn_id"] for r in again.history() if r["role"] == "assistant"][0] == first.turn_id) is (call == "stop")
    again.stop()


def test_a_stop_past_its_wait_is_still_waited_for_after_a_spawn_of_its_name_failed(rt, shared):
    """A spawn of a name whose stop ran past its wait goes to the host that stops it; one that failed there before
    waiting for that stop (here its system prompt did not fit) made the cluster forget where the stop went on: a
    stop of the name then raised UnknownAgent, and a spawn went to any host (AgentInUse there), while the old actor
    still stopped. The stop is still waited for on its host until a call there succeeds."""
    name = "lingering-refused"
    a = rt.spawn(name, system="Be brief.")
    a.ask("Hello?", **OPTS)
    with testing.held_stops(rt, rt.placement()[name], wait_s=0.5):
        with pytest.raises(WaitTimeout):
            a.stop()
        with pytest.raises(SystemPromptTooLong):
            rt.spawn(name, system="word " * rt.max_context, timeout=0.5)
        with pytest.raises(WaitTimeout, match=r"stop\(\) waited .*the stop goes on"):  # was UnknownAgent
            a.stop()
    a.stop()  # made again, it waits for the stop to finish
    os.close(store.lock_agent(shared, rt.fingerprint, name))  # released once stopped
    assert rt.spawn(name).ask("Back?", **OPTS).cache == "warm"
    rt.agent(name).stop()


def test_errors_cross_nodes_with_their_types(rt):
    a = rt.spawn("errs", system="Be brief.")
    with pytest.raises(UnknownAgent):
        rt.agent("nobody")
    a.ask("Hi", **OPTS)
    a.stop()
    with pytest.raises(SystemPromptChanged) as e:  # raised on a node, caught here as the same type, fields and all
        rt.spawn("errs", system="Another prompt.")
    assert isinstance(e.value, (KvactorsError, ValueError)) and e.value.stored == "Be brief."
    assert "errs" not in rt.running()


def test_a_message_to_an_agent_that_is_not_running_is_a_dead_letter_as_on_one_machine(rt, tmp_path):
    """A send, send_to, note or reset to an agent that was not running (stopped, or never spawned) raised UnknownAgent
    on a cluster, as on one machine, but left no dead letter, where one machine records one for each: the cluster
    records it, to the same recipient, with the same message, and the error the caller got as its reason. A question
    (result, history) leaves none, as on one machine."""

    def fields(message) -> dict:  # a cluster gives a message as plain data, one machine as its envelope
        message = message if isinstance(message, dict) else msgpack.unpackb(message.payload)
        return {k: message.get(k) for k in ("text", "sender", "system", "records")}

    def play(runtime):
        a, b = runtime.spawn("letter-a", system="Be brief."), runtime.spawn("letter-b", system="Be brief.")
        a.stop()
        nobody = AgentRef(runtime, "letter-nobody")
        reasons = []
        for call in (lambda: a.send("Sent.", **OPTS), lambda: b.send_to(a, "Sent to.", **OPTS),
                     lambda: a.note("Noted.", sender="letter-b"), lambda: a.reset([], system="Be terse."),
                     lambda: nobody.send("Boo.", **OPTS)):
            with pytest.raises(UnknownAgent) as e:
                call()
            reasons.append(str(e.value))
        for question in (lambda: a.result("letter-a-1"), a.history, nobody.history):
            with pytest.raises(UnknownAgent):
                question()
        letters = [d for d in runtime.dead_letters if d.recipient in (a.name, nobody.name)]
        assert [d.reason for d in letters] == reasons
        b.stop()
        return [(d.recipient, fields(d.message)) for d in letters]

    on_cluster = play(rt)
    with Runtime(model="tiny", cache_dir=tmp_path) as local:
        on_one = play(local)
    assert on_cluster == on_one and len(on_one) == 5


def letter_to_a_gone_sender(runtime, prefix) -> tuple:
    """(gone, peer, reply, letters): agent `prefix`-gone (temporary) crashes, then `peer`, on another host, answers
    its send_to; the reply's copy, which peer's host forwards to gone's host (no call has asked that host about it,
    so the cluster still takes it for placed there), is one dead letter, recorded by peer's host: `letters`."""
    gone = runtime.spawn(f"{prefix}-gone", system="Be brief.", restart="temporary")
    node = runtime.placement()[gone.name]
    peer = spawn_where(runtime, f"{prefix}-peer", lambda n: n != node)
    testing.inject_crash(gone)
    with pytest.raises(AgentCrashed):
        gone.ask("Crash.", **OPTS)
    reply = gone.send_to(peer, "A reply to a sender that is gone.", **OPTS).get(timeout=120)
    letters = [d for d in runtime.dead_letters if d.recipient == gone.name]
    assert [(d.message["sender"], d.message["text"]) for d in letters] == [(peer.name, reply.text)]
    return gone, peer, reply, letters


def test_a_reply_forwarded_to_an_agent_gone_from_its_host_is_one_dead_letter(rt):
    """The copy of a send_to reply that the replying agent's host forwards to the sender's host, where the sender had
    exited (a temporary agent that crashed), was dead-lettered twice: by the host that found it gone, and by the host
    that forwarded it. It is one dead letter, as on one machine, and the caller still gets the reply."""
    _, peer, reply, _ = letter_to_a_gone_sender(rt, "forward")
    assert reply.agent == peer.name
    peer.stop()


def test_a_hosts_dead_letters_outlive_its_process_and_the_runtime(cluster, tmp_path):
    """A host kept the dead letters it recorded in its own process, and `dead_letters` asked the live hosts: a host
    whose process died took its letters with it, and after `shutdown` none were left. The cluster's directory keeps
    a copy of each now, and the runtime keeps them past its shutdown, as one machine does."""
    with Runtime(model="tiny", cache_dir=tmp_path, cluster="ray") as small:
        gone, peer, _, letters = letter_to_a_gone_sender(small, "letters")
        os.kill(testing.host_pid(small, small.placement()[peer.name]), 9)
        peer.ask("After.", **OPTS)  # Ray restarts the host's process: the agent is back, without the letter there
        assert [d for d in small.dead_letters if d.recipient == gone.name] == letters
    assert [d for d in small.dead_letters if d.recipient == gone.name] == letters


def still_busy(long) -> None:
    """Fail unless `long` (a LONG turn's future) is still unanswered: its agent is still in that turn."""
    with pytest.raises(TurnTimeout):
        long.get(timeout=0)


def test_a_reply_forwarded_to_a_busy_agent_is_recorded_after_its_turn_and_is_no_dead_letter(cluster, tmp_path):
    """The host that forwarded the copy of a send_to reply waited io_timeout for the sender, busy in a long turn, to
    record it, then dead-lettered it and resolved the future, though the copy was still queued there and was recorded
    after the turn: one message both dead-lettered and delivered. As on one machine, the copies wait for the turn,
    are recorded in the order they were sent, and their futures resolve then; no dead letter."""
    with Runtime(model="tiny", cache_dir=tmp_path, cluster="ray", io_timeout=1.0) as quick:
        busy = quick.spawn("forward-busy", system="Be brief.")
        peer = spawn_where(quick, "forward-busy-peer", lambda n: n != quick.placement()[busy.name])
        long = busy.send("Tell me a long story.", **LONG)
        copies = [busy.send_to(peer, f"Reply {i} to a busy sender.", **OPTS) for i in range(3)]
        time.sleep(5)  # five times io_timeout: every copy has reached the busy agent's host
        still_busy(long)
        for copy in copies:
            with pytest.raises(TurnTimeout):
                copy.get(timeout=0)  # it resolves once the busy agent has recorded its copy
        assert [d for d in quick.dead_letters if d.recipient == busy.name] == []
        long.get(timeout=300)
        replies = [copy.get(timeout=120) for copy in copies]
        assert _turns(busy.history())[-3:] == [("user", r.text, peer.name) for r in replies]
        assert [d for d in quick.dead_letters if d.recipient == busy.name] == []


def test_a_reply_forwarded_to_a_busy_agent_holds_up_no_other_forward(rt):
    """A host forwarded one note at a time and waited (up to io_timeout, 60 s) for each to be recorded: while the
    sender of one was busy in a long turn, every copy of a reply that host forwarded next, to any agent on any host,
    waited behind it. Another agent's copy is recorded, and its send_to future resolves, while the first waits."""
    busy = rt.spawn("forward-held", system="Be brief.")
    node = rt.placement()[busy.name]
    peer = spawn_where(rt, "forward-held-peer", lambda n: n != node)  # its host forwards both copies
    other = spawn_where(rt, "forward-held-other", lambda n: n not in (node, rt.placement()[peer.name]))
    long = busy.send("Tell me a long story.", **LONG)
    held = busy.send_to(peer, "A reply to a busy sender.", **OPTS)
    reply = other.send_to(peer, "A reply to an idle sender.", **OPTS).get(timeout=60)
    still_busy(long)  # `other`'s copy did not wait for the busy agent's turn
    assert _turns(other.history())[-1] == ("user", reply.text, peer.name)
    long.get(timeout=300)
    assert _turns(busy.history())[-1] == ("user", held.get(timeout=120).text, peer.name)
    assert [d for d in rt.dead_letters if d.recipient in (busy.name, other.name)] == []
    for ref in (busy, peer, other):
        ref.stop()


def test_a_host_that_does_not_answer_holds_up_no_note_to_another_hosts_agents(rt):
    """A host delivered the notes it forwarded one at a time, each delivery waiting (with no timeout: Ray raises if
    the receiving host dies) for the receiving host to answer: one host alive but not answering (its process
    stopped) held up every note forwarded after it, to any agent on any host. Now only the notes to its own agents
    wait, and they are delivered, in order, once it answers again."""
    peer = rt.spawn("hung-peer", system="Be brief.")
    peer_node = rt.placement()[peer.name]
    stuck = spawn_where(rt, "hung-sender", lambda n: n != peer_node)  # peer's host forwards both copies
    stuck_node = rt.placement()[stuck.name]
    other = spawn_where(rt, "hung-other", lambda n: n not in (peer_node, stuck_node))
    pid = next(h["pid"] for h in rt.hosts() if h["node_id"] == stuck_node)
    os.kill(pid, signal.SIGSTOP)
    try:
        held = [stuck.send_to(peer, f"Reply {i} to a sender whose host hangs.", **OPTS) for i in range(2)]
        reply = other.send_to(peer, "A reply to a sender whose host answers.", **OPTS).get(timeout=60)
        assert _turns(other.history())[-1] == ("user", reply.text, peer.name)
        for copy in held:
            with pytest.raises(TurnTimeout):
                copy.get(timeout=0)  # its copy waits for the stopped host
    finally:
        os.kill(pid, signal.SIGCONT)
    replies = [copy.get(timeout=120) for copy in held]
    assert _turns(stuck.history())[-2:] == [("user", r.text, peer.name) for r in replies]
    assert [d for d in rt.dead_letters if d.recipient in (stuck.name, other.name)] == []
    for ref in (peer, stuck, other):
        ref.stop()


def test_turns_in_flight_past_a_hosts_call_threads_hold_up_no_other_call_there(cluster, tmp_path, monkeypatch):
    """A turn in flight waits on its host (`NodeHost.wait`) until its agent answers. Those waits took the host's call
    threads (HOST_THREADS), so with that many turns in flight there, every other call to that host (another agent's
    turn, a note, a spawn, a stop) waited until one of the turns ended. They now wait in a group of their own."""
    from runtime.api import cluster as cluster_mod

    monkeypatch.setattr(cluster_mod, "HOST_THREADS", 2)
    with Runtime(model="tiny", cache_dir=tmp_path, cluster="ray") as small:
        first = spawn_where(small, "threads-busy-a", lambda n: True)
        node = small.placement()[first.name]
        busy = [first, spawn_where(small, "threads-busy-b", lambda n: n == node)]
        quick = spawn_where(small, "threads-quick", lambda n: n == node)
        longs = [ref.send("Tell me a long story.", max_tokens=1500, timeout=300) for ref in busy]
        reply = quick.ask("Hello.", **OPTS)
        for long in longs:
            still_busy(long)  # the quick turn did not wait for a long one to end
        assert quick.history()[-1]["text"] == reply.text
        for long in longs:
            long.get(timeout=300)


def test_a_hosts_recovery_holds_up_no_call_on_another_agent(rt, monkeypatch):
    """A recovery waits up to RECOVER_S for a failed host to answer again, then starts its agents again; it held the
    placement lock throughout, so every call on every agent of the cluster waited for it. Now calls on the agents
    of other hosts, and a spawn, go on meanwhile; a call on one of the host's own agents waits for its recovery."""
    a = rt.spawn("recover-held-a", system="Be brief.")
    b = spawn_where(rt, "recover-held-b", lambda n: n != rt.placement()[a.name])
    index = rt._index(a.name)
    probe, probing, release = rt._probe, threading.Event(), threading.Event()

    def slow_probe(i):
        probing.set()
        release.wait(30)
        return probe(i)

    monkeypatch.setattr(rt, "_probe", slow_probe)
    recovery = threading.Thread(target=rt._recover, args=(index,))
    recovery.start()
    try:
        assert probing.wait(10)
        reply = b.ask("Hello.", **OPTS)  # waited for the recovery: here, until slow_probe gave up waiting
        assert b.history()[-1]["text"] == reply.text
        other = rt.spawn("recover-held-new", system="Be brief.")
        assert recovery.is_alive()
    finally:
        release.set()
        recovery.join(60)
    assert a.ask("Hello again.", **OPTS).text  # its host answered as it was: a passing failure, nothing moved
    for ref in (a, b, other):
        ref.stop()


def test_an_agent_stopped_while_its_host_is_recovered_is_not_started_again(cluster, tmp_path, monkeypatch):
    """A recovery no longer holds the placement lock while it waits for its host, so a stop can run meanwhile: of the
    agents placed on the host when the recovery began, it starts again those still placed, not a stopped one."""
    with Runtime(model="tiny", cache_dir=tmp_path, cluster="ray") as small:
        gone = small.spawn("recover-stop-gone", system="Be brief.")
        index = small._index(gone.name)
        kept = spawn_where(small, "recover-stop-kept", lambda n: n == small.placement()[gone.name])
        started, call = [], small._call

        def spy(i, method, *args):
            if method == "spawn":
                started.append(args[0])
            return call(i, method, *args)

        def probe_as_restarted(i):  # a stop while the host is probed; then it answers as a new incarnation
            gone.stop()
            return dict(small._info[i], incarnation="another")

        monkeypatch.setattr(small, "_call", spy)
        monkeypatch.setattr(small, "_probe", probe_as_restarted)
        small._recover(index)
        assert started == [kept.name]
        assert gone.name not in small.running()


def test_forget_says_whether_the_agent_was_stored_when_its_hosts_answer_was_lost(rt, monkeypatch):
    """A forget whose host did not answer (Ray reported it unavailable: NodeDown) asks the host once more. When the
    host had deleted the agent's files before its answer was lost, the second ask found nothing stored, and forget
    returned False for the agent it had just forgotten. It says whether the agent was stored when it began, as on
    one machine; a forget again finds nothing."""
    name = "forgotten-unanswered"
    a = rt.spawn(name, system="Be brief.")
    a.ask("Hello?", **OPTS)
    call, lost = rt._call, []

    def answer_lost(index, method, *args):  # the host runs the call; its first answer to a forget never comes back
        value = call(index, method, *args)
        if method == "forget" and not lost:
            lost.append(index)
            raise NodeDown(index, "ActorUnavailableError")
        return value

    monkeypatch.setattr(rt, "_call", answer_lost)
    assert rt.forget(name) is True  # was False
    monkeypatch.undo()
    assert lost and not rt.stored(name) and name not in rt.running()
    assert rt.forget(name) is False


def test_reset_refuses_token_ids_past_the_vocabulary_in_the_caller_as_on_one_machine(rt, tmp_path):
    """An id past the embedding reached the host's engine, which refused the turn: the agent crashed instead of
    the reset raising in the caller."""
    a = rt.spawn("vocab", system="Be brief.")
    a.ask("Hello.", **OPTS)
    before = a.history()
    with Runtime(model="tiny", cache_dir=tmp_path) as local:
        records = [dict(r, tokens=[local.vocab_size]) if r["role"] == "assistant" else r
                   for r in before if r["role"] != "system"]
        with pytest.raises(InvalidArgument) as here:
            local.spawn("vocab").reset(records)
    with pytest.raises(InvalidArgument) as there:
        a.reset(records)
    assert str(there.value) == str(here.value)
    assert a.history() == before and a.ask("Again?", **OPTS).cache == "hot"  # nothing reached the agent


def test_reset_to_the_history_or_to_a_new_system_prompt_works_as_on_one_machine(rt, tmp_path):
    """reset(history()) (its system record) and reset(records, system=) raised AttributeError in the caller: the
    cluster runtime had no check of a system prompt's room."""
    a = rt.spawn("renewed", system="Be brief.")
    a.ask("Hello.", **OPTS)
    before = a.history()
    a.reset(before).get(timeout=120)
    assert _turns(a.history()) == _turns(before)
    a.reset([], system="Be terse.").get(timeout=120)
    assert _turns(a.history()) == [("system", "Be terse.", None)]
    too_long = "word " * rt.max_context
    with Runtime(model="tiny", cache_dir=tmp_path) as local:
        with pytest.raises(SystemPromptTooLong) as here:
            local.spawn("renewed").reset([], system=too_long)
    with pytest.raises(SystemPromptTooLong) as there:
        a.reset([], system=too_long)
    assert str(there.value) == str(here.value)


def test_a_system_prompts_check_passes_over_a_host_that_does_not_answer(rt, monkeypatch):
    """A reset with a system prompt has a host check the prompt's room (the model's tokenizer is there): the least
    loaded one only, so one that did not answer (NodeDown) failed the reset though any other host could check it.
    The next host checks it now; NodeDown only when none answers."""
    a = rt.spawn("fits-check", system="Be brief.")
    first = rt._least_loaded()
    real, asked, down = type(rt)._call, [], {first}

    def call(self, index, method, *args):
        if method == "check_system_fits":
            asked.append(index)
            if index in down:
                raise NodeDown(index, "down for this test")
        return real(self, index, method, *args)

    monkeypatch.setattr(type(rt), "_call", call)
    a.reset([], system="Be terse.").get(timeout=120)
    assert asked[0] == first and len(asked) == 2 and _turns(a.history()) == [("system", "Be terse.", None)]
    with pytest.raises(SystemPromptTooLong):  # the next host's answer, as the first would have given it
        a.reset([], system="word " * rt.max_context)
    down.update(range(len(rt._hosts)))
    with pytest.raises(NodeDown):
        a.reset([], system="Be terser.")
    monkeypatch.undo()
    a.stop()


def test_streams_and_callbacks_give_what_one_machine_gives(rt, shared, tmp_path):
    """stream, astream, on_token and on_progress: the same pieces in the same order, the same progress and
    the same Replies as a local Runtime; the streamed turns are in the agent's journal on the shared folder."""
    long = dict(max_tokens=12, timeout=120)

    def play(runtime):
        a, b = runtime.spawn("stream-a", system="You are A."), runtime.spawn("stream-b", system="You are A.")
        streamed = list(a.stream("Tell me a story.", turn_id="stream-1", **long))
        k = len(streamed[0])
        stop = streamed[-1].text[k - 1: k + 1]  # a stop string across two pieces: held back, then cut off
        stopped = list(b.stream("Tell me a story.", turn_id="stream-2", stop=stop, **long))
        tokens, progress = [], []
        called = a.ask("Once more.", turn_id="stream-3", on_token=tokens.append,
                       on_progress=lambda *p: progress.append(p), **long)

        async def collect():
            return [item async for item in a.astream("And now?", turn_id="stream-4", **long)]

        astreamed = asyncio.run(collect())
        replies = [streamed[-1], stopped[-1], called, astreamed[-1]]
        return ([streamed[:-1], stopped[:-1], tokens, progress, astreamed[:-1]],
                [(r.turn_id, r.text, r.tokens, r.cache, r.finish_reason) for r in replies], _turns(a.history()))

    on_cluster = play(rt)
    with Runtime(model="tiny", cache_dir=tmp_path) as local:
        on_one = play(local)
    assert on_cluster == on_one
    pieces, replies, _ = on_cluster
    assert len(pieces[0]) > 1 and "".join(pieces[0]) == replies[0][1]
    assert replies[1][4] == "stop" and "".join(pieces[1]) == replies[1][1]
    assert pieces[3] and pieces[3][-1][0] == pieces[3][-1][1]  # progress ends with the whole prompt prefilled
    on_disk = [r["turn_id"] for r in store.read_journal(shared, local_spec(rt), "stream-a") if r["role"] == "assistant"]
    assert on_disk == ["stream-1", "stream-3", "stream-4"]


def test_a_cancelled_stream_ends_early_and_is_stored_and_a_failing_callback_fails_its_turn(rt):
    a = rt.spawn("stream-c", system="You are A.")
    *pieces, reply = a.stream("Tell me a long story.", max_tokens=400, timeout=120, turn_id="cancel-1",
                              cancel=lambda: True)  # asked here after each piece; the host stops a few tokens later
    assert reply.finish_reason == "cancelled" and len(reply.tokens) < 400 and "".join(pieces) == reply.text
    assert a.result("cancel-1").text == reply.text

    def boom(piece):
        raise RuntimeError("no more")

    with pytest.raises(CallbackFailed, match="on_token callback raised RuntimeError: no more") as e:
        a.ask("Another long story.", max_tokens=400, timeout=120, turn_id="boom-1", on_token=boom)
    assert e.value.turn_id == "boom-1"
    assert a.ask("Still there?", **OPTS).cache in ("hot", "warm")  # the agent answers on


def test_a_done_callback_spawns_and_sends_as_on_one_machine(rt):
    """A reply future's done callback ran on Ray's own callback thread, where a call that waits for Ray never returns:
    a spawn or a send there (each a call to a host) hung the callback, and Ray with it, for good. It runs on a thread
    of the runtime's: both work as on one machine, and a call that waits for a reply still raises WaitsInCallback."""
    from runtime import WaitsInCallback

    a = rt.spawn("done-a", system="You are A.")
    seen, called = [], threading.Event()

    def follow_up(future):
        try:
            b = rt.spawn("done-b", system="You are B.")
            seen.append(b.send("Chained.", **OPTS))
            b.ask("And then?", **OPTS)
        except Exception as e:  # noqa: BLE001 - recorded, asserted below
            seen.append(e)
        called.set()

    first = a.send("First.", **OPTS)
    first.add_done_callback(follow_up)
    assert first.get(timeout=120).agent == "done-a"
    assert called.wait(120), "the done callback hung"
    chained, refused = seen
    assert chained.get(timeout=120).agent == "done-b"
    assert isinstance(refused, WaitsInCallback) and "done callback" in str(refused)
    assert [r["text"] for r in rt.agent("done-b").history() if r["role"] == "user"] == ["Chained."]


def test_state_machine_invariants_on_the_cluster(rt, shared):
    """Random ask / send_to / note / reset across nodes; after it, the journals on disk hold every
    acknowledged turn exactly once, in per-sender order, and a local Runtime resumes them warm."""
    rng = random.Random(18)
    names = [f"sm{i}" for i in range(3)]
    refs = {n: rt.spawn(n, system=f"You are {n}.") for n in names}
    acked: dict[str, list[str]] = {n: [] for n in names}  # turn ids acknowledged, per agent, in order
    for step in range(14):
        op, who = rng.choice(["ask", "ask", "send_to", "note"]), rng.choice(names)
        if op == "ask":
            r = refs[who].ask(f"step {step}", turn_id=f"{who}-s{step}", **OPTS)
            acked[who].append(r.turn_id)
        elif op == "send_to":
            other = rng.choice([n for n in names if n != who])
            r = refs[who].send_to(refs[other], f"step {step}", turn_id=f"{other}-s{step}", **OPTS).get(timeout=120)
            acked[other].append(r.turn_id)
        else:
            refs[who].note(f"note {step}")
    histories = {n: refs[n].history() for n in names}
    for n in names:
        refs[n].stop()
    for n in names:
        turns = [r["turn_id"] for r in histories[n] if r["role"] == "assistant"]
        assert turns == acked[n]
        seqs = [r["seq"] for r in histories[n]]
        assert seqs == sorted(set(seqs))
        on_disk = [r["turn_id"] for r in store.read_journal(shared, local_spec(rt), n)
                   if r["role"] == "assistant" and r["seq"] >= histories[n][0]["seq"]]
        assert on_disk == acked[n]
    other = shared.parent / "resumed"
    # the same format: a Runtime of one machine resumes them from the shared folder, warm
    import shutil
    shutil.copytree(shared / rt.fingerprint, other / rt.fingerprint)
    with Runtime(model="tiny", cache_dir=other) as local:
        for n in names:
            ref = local.spawn(n)
            assert _turns(ref.history()) == _turns(histories[n])
            if acked[n]:
                assert ref.ask("And now?", **OPTS).cache == "warm"


def test_another_process_connects_by_address(cluster, tmp_path):
    code = ("import sys; from runtime import Runtime\n"
            "with Runtime(model='tiny', cache_dir=sys.argv[2], address=sys.argv[1]) as rt:\n"
            "    print(rt.spawn('remote', system='Be brief.').ask('Hi', max_tokens=2, timeout=120).cache, len(rt.nodes()))\n")
    out = subprocess.run([sys.executable, "-c", code, cluster.address, str(tmp_path)], check=True, capture_output=True,
                         text=True, timeout=240)
    assert out.stdout.split()[-2:] == ["cold", "3"], out.stdout[-2000:]


def test_an_address_other_than_the_connected_cluster_is_refused(cluster, tmp_path):
    with pytest.raises(ValueError, match="call ray.shutdown"):
        Runtime(model="tiny", cache_dir=tmp_path, address="127.0.0.1:1")


def test_ray_missing_says_what_to_install(monkeypatch, tmp_path):
    monkeypatch.setitem(sys.modules, "ray", None)  # `import ray` raises ImportError
    with pytest.raises(RayMissing, match=r"pip install 'kvactors\[ray\]'") as e:
        Runtime(model="tiny", cache_dir=tmp_path, cluster="ray")
    assert isinstance(e.value, ImportError)


def test_ray_is_imported_only_when_a_cluster_is_asked_for():
    code = ("import sys, runtime; from runtime import Runtime, ClusterRuntime, RayMissing, NodeDown; "
            "import runtime.api.rayhost; assert 'ray' not in sys.modules, 'ray imported'")
    subprocess.run([sys.executable, "-c", code], check=True)


def in_thread(call) -> tuple[threading.Thread, list]:
    """Start `call()` on a thread of its own; (the thread, a list that gets its result or the exception it raised)."""
    outcome = []

    def run():
        try:
            outcome.append(call())
        except Exception as e:  # noqa: BLE001 - the caller asserts on it
            outcome.append(e)

    thread = threading.Thread(target=run)
    thread.start()
    return thread, outcome


def spawn_where(rt, prefix, wanted, **options) -> object:
    """Spawn agents named `prefix`0, 1, ... (with `options`) until one lands on a Ray node that `wanted(node)` accepts
    (each goes to the least loaded host, so the others fill up), then stop the others; its ref."""
    refs = []
    try:
        for i in range(40):
            refs.append(rt.spawn(f"{prefix}{i}", system="Be brief.", **options))
            if wanted(rt.placement()[refs[-1].name]):
                return refs.pop()
        raise AssertionError("no agent landed where wanted")
    finally:
        for ref in refs:
            ref.stop()


def test_an_exited_temporary_agent_leaves_the_placement_and_the_hosts(rt, shared):
    """A temporary agent that crashed was dropped by its host's supervisor, yet `placement()` and `hosts()` listed it
    until its name was used again. They ask the hosts, as `running()` does, and an agent found exited is unplaced."""
    name = "exited-listed"
    crash_temporary(rt, name)
    deadline = time.monotonic() + 20
    while name in rt.placement() and time.monotonic() < deadline:  # the supervisor drops it soon after the crash
        time.sleep(0.1)
    assert name not in rt.placement()
    assert all(name not in h["agents"] for h in rt.hosts())
    os.close(store.lock_agent(shared, rt.fingerprint, name))  # its host let go of it


@pytest.mark.slow
def test_a_hosts_recovery_does_not_start_an_exited_temporary_agent_again(rt, shared):
    """A temporary agent that crashed, and that its caller found gone (UnknownAgent), stayed placed on its host: when
    that host's process died and Ray restarted it, the recovery started the agent again, running and holding its
    name, though it had exited for good. The recovery starts the host's running agents only."""
    node = rt.nodes()[0]  # each test that kills a host kills another one: Ray restarts each one max_restarts times
    a = spawn_where(rt, "exited-recovered", lambda n: n == node, restart="temporary")
    name = a.name
    a.ask("Hello?", **OPTS)
    testing.inject_crash(a)
    with pytest.raises(AgentCrashed):
        a.ask("Crash.", **OPTS)
    deadline = time.monotonic() + 20
    while True:  # the supervisor drops it soon after the crash: until then a turn waits for a restart
        try:
            a.ask("Anyone?", **OPTS)
        except UnknownAgent:
            break
        except AgentCrashed:
            assert time.monotonic() < deadline
    peer = spawn_where(rt, "exited-peer", lambda n: n == node)
    peer.ask("Hello?", **OPTS)
    os.kill(testing.host_pid(rt, node), 9)
    assert peer.ask("Still there?", **OPTS).agent == peer.name  # the host comes back, and the peer with it
    assert rt.placement()[peer.name] == node
    assert name not in rt.running() and name not in rt.placement()
    os.close(store.lock_agent(shared, rt.fingerprint, name))  # no host runs it
    peer.stop()


def test_a_slow_stop_on_one_host_holds_up_no_other_agent(rt, shared):
    """The cluster held its placement lock while a host stopped an agent, which may wait STOP_WAIT_S: every ask,
    spawn and stop of any other agent, on any host, waited behind it. Only calls on the same name wait for it."""
    name = "slow-stop"
    a = rt.spawn(name, system="Be brief.")
    node = rt.placement()[name]
    other = spawn_where(rt, "slow-stop-other", lambda n: n != node)
    other.ask("Hello?", **OPTS)
    with testing.held_stops(rt, node, wait_s=20):
        stopping, outcome = in_thread(a.stop)
        time.sleep(1)  # the stop waits on its host
        assert other.ask("Still there?", **OPTS).agent == other.name
        assert name not in rt.placement() and other.name in rt.placement()
        with pytest.raises(WaitTimeout, match="being started or stopped by another call"):
            rt.spawn(name, timeout=0.5)  # the same name waits for its stop
        assert stopping.is_alive(), "the other agent's calls waited for the stop"
    stopping.join(60)
    assert not stopping.is_alive() and outcome == [None]
    os.close(store.lock_agent(shared, rt.fingerprint, name))  # stopped: its host let go of it
    other.stop()


@pytest.mark.slow
@pytest.mark.parametrize("call", ["stop", "forget"])
def test_a_host_that_dies_during_a_stop_is_recovered_and_the_call_completes(rt, shared, call):
    """A host whose process died while it stopped or forgot an agent raised NodeDown to the caller, and the host's
    other agents waited for another call to recover it. The cluster recovers the host, as for any other call, and
    the stop is done (the agent's actor died with the process; its files stay), or the forget deletes the files."""
    node = rt.nodes()[1 if call == "stop" else 2]  # each test that kills a host kills another one
    a = spawn_where(rt, f"stop-down-{call}", lambda n: n == node)
    name = a.name
    first = a.ask("Hello?", **OPTS)
    rt.flush()
    peer = spawn_where(rt, f"stop-down-{call}-peer", lambda n: n == node)
    pid = testing.host_pid(rt, node)
    with testing.held_stops(rt, node, wait_s=60):
        leaving, outcome = in_thread(a.stop if call == "stop" else lambda: rt.forget(name))
        time.sleep(1)  # the call waits on the host
        os.kill(pid, 9)
        leaving.join(120)
    assert outcome == [None if call == "stop" else True]
    assert name not in rt.running() and name not in rt.placement()
    assert rt.placement()[peer.name] == node  # the host was recovered, its other agents with it
    assert rt.stored(name) is (call == "stop")
    os.close(store.lock_agent(shared, rt.fingerprint, name))
    again = rt.spawn(name, system="Be brief.")
    assert again.ask("Back?", **OPTS).cache == ("warm" if call == "stop" else "cold")
    assert ([r["turn_id"] for r in again.history() if r["role"] == "assistant"][0] == first.turn_id) is (call == "stop")
    again.stop()
    peer.stop()


def test_an_async_ask_cancelled_while_its_host_waits_for_the_agents_restart_is_never_sent(rt):
    """An ask_async cancelled before its turn was told to the agent sent it all the same on a cluster: the wait for
    the agent's restart is on its host, which told the agent regardless. The host asks, right before it tells the
    agent, whether the call was cancelled, as one machine does: a call cancelled before then sends nothing."""
    name = "called-off"
    a = rt.spawn(name, system="Be brief.")
    a.ask("Hello?", **OPTS)
    node = rt.placement()[name]

    async def cancelled():
        with testing.held_stops(rt, node, wait_s=1):  # the host's supervisor is parked: the agent's restart waits
            testing.inject_crash(a)
            with pytest.raises(AgentCrashed):
                a.ask("Crash.", **OPTS)
            task = asyncio.ensure_future(a.ask_async("Never sent.", turn_id="called-off-1", **OPTS))
            await asyncio.sleep(1.5)  # its host waits for the restart
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
        # the supervisor restarts the agent; the host then finds the call called off

    asyncio.run(cancelled())
    assert a.ask("After.", **OPTS).agent == name
    assert a.result("called-off-1") is None
    assert "Never sent." not in [r["text"] for r in a.history() if r["role"] == "user"]
    a.stop()


def test_an_async_ask_whose_call_off_reaches_its_host_before_the_turn_is_never_sent(rt, monkeypatch):
    """Ray does not order the calls to a host, which runs them on many threads: the call-off of an async call that
    was cancelled as its turn left could run there before the turn's delivery, found no send to call off and was
    dropped, and the turn was sent all the same. The host keeps a call-off that finds no send, for the delivery
    that comes after it, which it calls off: nothing is sent, and the caller gets CancelledError."""
    name = "called-off-early"
    a = rt.spawn(name, system="Be brief.")
    a.ask("Hello?", **OPTS)
    call = rt._call

    def call_off_first(index, method, *args):  # the order Ray may run them in: the call-off, then the delivery
        if method == "deliver" and args[5] is not None:  # its call-off key
            rt._ray.get(rt._hosts[index].signal.remote(args[5], "call_off"))
        return call(index, method, *args)

    monkeypatch.setattr(rt, "_call", call_off_first)
    with pytest.raises(asyncio.CancelledError):
        asyncio.run(a.ask_async("Never sent.", turn_id="called-off-early-1", **OPTS))
    monkeypatch.undo()
    assert a.ask("After.", **OPTS).agent == name
    assert a.result("called-off-early-1") is None
    assert "Never sent." not in [r["text"] for r in a.history() if r["role"] == "user"]
    a.stop()


def test_a_send_called_off_on_its_host_raises_cancelled_error_as_on_one_machine():
    """A host answers a send called off before it told the agent (`NodeHost.deliver`) with asyncio's CancelledError,
    as one machine raises it; it came back to the caller as a ClusterError naming it, which asyncio code does not
    take for a cancellation."""
    from runtime.api import rayhost

    error = rayhost.unpack_error(rayhost.pack_error(asyncio.CancelledError("turn t-1: its call was cancelled")))
    assert type(error) is asyncio.CancelledError and str(error) == "turn t-1: its call was cancelled"


@pytest.mark.slow
def test_a_spawn_on_a_host_that_ray_restarted_unnoticed_starts_the_agent_there(rt):
    """A spawn that landed on a host whose process Ray had restarted, with no call there since, started the agent on
    the new process, took that process for one the runtime did not know, and started it there again: InvalidArgument
    ("already running"), and the agent ran there unplaced, holding its name. The spawn recovers the host, as any
    call that finds it restarted, and places the agent it started."""
    node = rt.nodes()[0]  # each test that kills a host kills another one, and one kills this one already
    testing.restarted_unnoticed(rt, node)
    a = spawn_where(rt, "unnoticed", lambda n: n == node)  # each spawn goes to the least loaded host: one goes there
    assert a.ask("Hello?", **OPTS).agent == a.name
    assert a.name in rt.running()
    a.stop()


@pytest.mark.slow
def test_an_async_ask_cancelled_while_its_host_is_recovered_is_never_sent(rt):
    """An ask_async whose host answered that it did not run the agent (Ray had restarted the host) waited for the
    host's recovery to start the agent again, then sent its turn there: a cancellation meanwhile, when no host held
    the send, went nowhere, and the turn was sent all the same. It is heard of before the send goes to a host again."""
    node = rt.nodes()[1]  # each test that kills a host kills another one
    a = spawn_where(rt, "called-off-recovered", lambda n: n == node)
    a.ask("Hello?", **OPTS)
    testing.restarted_unnoticed(rt, node)

    async def cancelled():
        with testing.held_stops(rt, node, wait_s=1):  # the host's supervisor is parked: the recovery's start waits
            task = asyncio.ensure_future(a.ask_async("Never sent.", turn_id="called-off-recovered-1", **OPTS))
            await asyncio.sleep(1.5)  # the host did not run the agent: its recovery starts it again
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
        # the supervisor starts the agent, the recovery ends, and the send finds its call cancelled

    asyncio.run(cancelled())
    assert a.ask("After.", **OPTS).agent == a.name
    assert a.result("called-off-recovered-1") is None
    assert "Never sent." not in [r["text"] for r in a.history() if r["role"] == "user"]
    a.stop()


@pytest.mark.slow
def test_an_agent_its_hosts_recovery_could_not_start_again_is_started_by_its_next_call(rt, shared):
    """A permanent agent that its host's recovery could not start again (here another process held its lock) was
    logged as "the next call retries", but nothing retried: the next call found it not running there, and it was
    unplaced as if it had exited, gone from `running()` with no error. It counts as running until a call starts it
    again (AgentCrashed, saying to retry, while that fails; a stop of it is done), and its next call starts it, warm.
    Its host dead-lettered each call that it found it did not run, though the cluster then started the agent and
    delivered it, or the call raised: what the cluster delivers after recovering the host is no dead letter."""
    node = rt.nodes()[2]  # each test that kills a host kills another one, and one kills this one already
    a = spawn_where(rt, "unstarted", lambda n: n == node)
    peer = spawn_where(rt, "unstarted-peer", lambda n: n == node)
    first = a.ask("Hello?", **OPTS)
    rt.flush()
    testing.restarted_unnoticed(rt, node)
    held = [store.lock_agent(shared, rt.fingerprint, r.name) for r in (a, peer)]  # the recovery cannot start them
    try:
        with pytest.raises(AgentCrashed, match="could not be started again.*retry"):
            a.ask("Anyone?", **OPTS)
        assert {a.name, peer.name} <= set(rt.running())
        assert peer.stop() is None and peer.name not in rt.running()  # it ran nowhere: the stop is done
    finally:
        for fd in held:
            os.close(fd)
    after = a.ask("Back?", turn_id="unstarted-back", **OPTS)
    assert after.cache == "warm" and rt.placement()[a.name] == node
    # the host did not run it when each ask came, yet both were not dead letters: one delivered, one failed its caller
    assert [d for d in rt.dead_letters if d.recipient == a.name] == []
    assert [r["turn_id"] for r in a.history() if r["role"] == "assistant"] == [first.turn_id, "unstarted-back"]
    with pytest.raises(UnknownAgent):
        rt.agent(peer.name)
    a.stop()


@pytest.mark.slow
def test_a_host_process_killed_is_restarted_by_ray_and_its_agents_reload_warm(rt, shared):
    a = rt.spawn("phoenix", system="Be brief.")
    first = a.ask("Before.", **OPTS)
    node = rt.placement()["phoenix"]
    cache = store.agent_dir(shared, rt.fingerprint, "phoenix") / store.CACHE_FILE
    deadline = time.monotonic() + 60
    while not cache.exists() and time.monotonic() < deadline:  # written after the ack: a kill before it reloads cold
        time.sleep(0.05)
    os.kill(testing.host_pid(rt, node), 9)
    after = a.ask("After.", turn_id="phoenix-after", **OPTS)
    assert after.cache == "warm" and rt.placement()["phoenix"] == node  # restarted in place, reloaded from disk
    assert [r["turn_id"] for r in a.history() if r["role"] == "assistant"] == [first.turn_id, "phoenix-after"]


@pytest.mark.slow
def test_history_of_an_agent_whose_hosts_process_died_recovers_the_host_as_an_ask_does(rt):
    """history() of an agent whose host's process had died raised NodeDown (or UnknownAgent, from the process Ray
    restarted without the agent), where an ask recovers the host and starts the agent again there: history() does
    the same, and answers with the agent's conversation, reloaded from the shared folder."""
    # each test that kills a host kills another one (each twice so far), and phoenix's once more: Ray restarts a
    # host max_restarts (3) times
    phoenix = rt.placement().get("phoenix")
    node = next(n for n in rt.nodes() if n != phoenix)
    a = spawn_where(rt, "history-down", lambda n: n == node)
    first = a.ask("Hello?", **OPTS)
    before = a.history()
    os.kill(testing.host_pid(rt, node), 9)
    after = a.history()  # was NodeDown
    assert _turns(after) == _turns(before)
    assert [r["turn_id"] for r in after if r["role"] == "assistant"] == [first.turn_id]
    assert rt.placement()[a.name] == node  # restarted in place, the agent with it
    a.stop()


@pytest.mark.slow
def test_a_node_killed_mid_conversation_its_agents_come_back_warm_elsewhere(rt, cluster, shared):
    head = cluster.head_node.node_id
    refs = [rt.spawn(f"kill{i}", system="Be brief.") for i in range(3)]
    acked = {r.name: [r.ask("First.", turn_id=f"{r.name}-1", **OPTS).turn_id] for r in refs}
    victim = next(r for r in refs if rt.placement()[r.name] != head)
    doomed_node = rt.placement()[victim.name]
    on_doomed = [r for r in refs if rt.placement()[r.name] == doomed_node]
    pid = testing.host_pid(rt, doomed_node)
    in_flight = victim.send("A long answer, please.", max_tokens=400, timeout=120, turn_id=f"{victim.name}-2")
    time.sleep(0.5)
    node = next(n for n in cluster.list_all_nodes() if n.node_id == doomed_node)
    t0 = time.monotonic()
    cluster.remove_node(node, allow_graceful=False)
    os.kill(pid, 9)  # a dead machine takes its processes with it
    caches = []
    try:
        reply = in_flight.get(timeout=120)  # it may have finished before the node died
    except AgentCrashed as e:
        assert e.turn_id == f"{victim.name}-2"
        reply = victim.ask("A long answer, please.", max_tokens=400, timeout=120, turn_id=f"{victim.name}-2")
        assert reply.cache in ("warm", "committed"), reply.cache  # nothing runs twice
        caches.append(reply.cache)
    back_s = time.monotonic() - t0
    acked[victim.name].append(reply.turn_id)
    for r in on_doomed:
        nxt = r.ask("Still there?", turn_id=f"{r.name}-3", **OPTS)
        assert rt.placement()[r.name] != doomed_node
        caches.append(nxt.cache)
        acked[r.name].append(nxt.turn_id)
    assert "warm" in caches and set(caches) <= {"warm", "hot", "committed"}, caches
    for r in refs:
        assert [h["turn_id"] for h in r.history() if h["role"] == "assistant"] == acked[r.name]
    assert doomed_node not in rt.nodes()
    print(f"\nnode death to the retried turn's reply: {back_s:.1f} s")
