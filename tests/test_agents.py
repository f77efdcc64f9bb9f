"""Agents and the Runtime facade: cache states, restarts, messaging, supervision.

Everything runs on the embedded tiny model (random weights, greedy, a few tokens per
turn). `stalled_batcher` parks the batcher's thread inside a reply callback, so a test
can hold turns in flight deterministically (watchdog, batcher crash, dead letters).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import logging
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from types import SimpleNamespace

import msgpack
import pykka
import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

import agent_restart_child as child
from actors import pykka_compat
from actors.agent import Ask, AgentActor, Note, encode_message
from actors.batcher import Submit
from actors.supervisor import Backoff
from runtime import (AgentCrashed, AgentStopped, CallbackFailed, Reply, Runtime, RuntimeEscalated, TurnTimeout, TurnTooLong,
                     UnknownAgent, WaitTimeout, chat, q4cache, store)
from runtime.engine import Turn
from runtime.api.facade import AgentRef
from runtime.api.testing import inject_crash, park_supervisor

TESTS = Path(__file__).resolve().parent
FAST = Backoff(min=0.001, max=0.02, reset=10.0)


# -- helpers ------------------------------------------------------------------------


@pytest.fixture(scope="module")
def rt(tmp_path_factory):
    """One runtime shared by the tests that only need fresh agent names."""
    with Runtime(model=None, cache_dir=tmp_path_factory.mktemp("agents"), max_restarts=50, backoff=FAST) as r:
        yield r


@contextlib.contextmanager
def stalled_batcher(rt):
    """Park the batcher's thread (inside the reply of a 1-token turn) until the block exits."""
    entered, release = threading.Event(), threading.Event()

    def reply(outcome):
        entered.set()
        release.wait(30)

    tokens = rt.tokenizer.encode("gate", add_special_tokens=False)
    rt._env.batcher().tell(Submit(Turn(f"gate-{uuid.uuid4().hex[:8]}", "gate", None, tokens, max_tokens=1), reply))
    assert entered.wait(30), "the batcher never ran the gate turn"
    try:
        yield release  # set it to let the batcher go before the block exits
    finally:
        release.set()


@contextlib.contextmanager
def busy_supervisor(rt):
    """Park the agents' supervisor's thread (inside a `children()` call) until the block exits."""
    release = park_supervisor(rt, 30)
    try:
        yield release
    finally:
        release.set()


def run_while_restarting(rt, agent, main):
    """Crash `agent` and hold its restart (its supervisor parked); run `main(release)` on a new event loop, the
    restart going on once `main` sets `release`. Returns what `main` returns."""
    old = rt._env.refs[agent.name]
    with busy_supervisor(rt) as release:
        inject_crash(agent)
        with pytest.raises(AgentCrashed):
            agent.ask("Crash.", max_tokens=4)
        wait_for(lambda: not old.is_alive(), what="the agent's crash")
        return asyncio.run(main(release))


async def ticking_until_released(call, release):
    """Run awaitable `call` and tick every 10 ms five times while it waits for a restart (each tick asserting it
    still waits), then set `release` and return its result: a call that held the event loop stops the ticker."""
    task = asyncio.ensure_future(call)
    for _ in range(5):
        await asyncio.sleep(0.01)
        assert not task.done(), task
    release.set()
    return await task


def wait_for(predicate, timeout=10.0, what="condition"):
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.005)


def wait_batcher_restarted(rt, old):
    wait_for(lambda: rt._env.batcher() is not old and rt._env.batcher().is_alive(), what="the batcher's restart")


def note_of(letter):
    """The decoded message of a dead letter (payload bytes or an Ask/Note envelope), or None."""
    message = letter.message
    payload = message.payload if isinstance(message, (Ask, Note)) else message
    return msgpack.unpackb(payload) if isinstance(payload, bytes) else None


def turn_ids(history):
    return [r["turn_id"] for r in history if r["turn_id"] is not None]


def live_agents(env) -> dict[str, int]:
    """Name -> number of live AgentActors of the runtime with `env`."""
    counts: dict[str, int] = {}
    for ref in pykka.ActorRegistry.get_by_class(AgentActor):
        actor = pykka_compat.actor_of(ref)
        if actor is not None and ref.is_alive() and actor.env is env:
            counts[actor.name] = counts.get(actor.name, 0) + 1
    return counts


def journal(cache_dir, rt, name) -> list[dict]:
    """`name`'s journal records as on disk now."""
    path = store.agent_dir(cache_dir, rt.spec.fingerprint, name) / store.JOURNAL_FILE
    return store.parse_journal(path.read_bytes())[0] if path.exists() else []


LONG_SYSTEM = "You are Alice, a careful planner who writes short plans. " * 4


# -- cache states ---------------------------------------------------------------------


def test_cold_then_hot_then_warm_after_a_new_runtime(tmp_path):
    with Runtime(model=None, cache_dir=tmp_path) as rt:
        alice = rt.spawn("alice", system=LONG_SYSTEM)
        r1 = alice.ask("Plan a bake sale.", max_tokens=6)
        r2 = alice.ask("Go on.", max_tokens=6)
        full2 = len(rt.tokenizer.encode(rt._env.render(LONG_SYSTEM, alice.history()), add_special_tokens=False))
    assert (r1.cache, r2.cache) == ("cold", "hot")
    assert isinstance(r1, Reply) and r1.agent == "alice" and len(r1.tokens) == 6 and r1.finish_reason == "length"
    assert r2.timings.prefill_tokens < r1.timings.prefill_tokens  # only the new suffix

    with Runtime(model=None, cache_dir=tmp_path) as rt:
        alice = rt.spawn("alice", system=LONG_SYSTEM)
        assert turn_ids(alice.history()) == [r1.turn_id, r1.turn_id, r2.turn_id, r2.turn_id]
        r3 = alice.ask("And then?", max_tokens=6)
        r4 = alice.ask("Thanks.", max_tokens=6)
    assert (r3.cache, r4.cache) == ("warm", "hot")
    assert r3.timings.prefill_tokens < full2 // 2  # no re-prefill of the history


def test_a_cold_turn_prefills_the_replies_as_generated_and_continues_as_a_hot_one(tmp_path, tiny_model_path):
    """The tiny random model's replies are often tokens that tokenizing their text would not give; a turn whose
    cache is lost prefills them as they were generated, so it continues as the hot turn did (it re-tokenized the
    journal's text, and 5 of these 8 agents continued differently)."""
    model, texts, names = tiny_model_path(), ["Plan a bake sale.", "Go on.", "Who bakes?"], [f"a{i}" for i in range(8)]
    with Runtime(model=model, cache_dir=tmp_path / "hot") as rt:
        hot = {}
        for n in names:
            agent = rt.spawn(n, system=LONG_SYSTEM + n)
            hot[n] = [agent.ask(t, max_tokens=12) for t in texts]
        tok = rt.tokenizer
    with Runtime(model=model, cache_dir=tmp_path / "cold") as rt:
        for n in names:
            agent = rt.spawn(n, system=LONG_SYSTEM + n)
            for t in texts[:2]:
                agent.ask(t, max_tokens=12)
    for f in (tmp_path / "cold").glob("*/*/cache*.safetensors"):
        f.unlink()  # the caches are lost; the journals hold the histories
    with Runtime(model=model, cache_dir=tmp_path / "cold") as rt:
        cold = {n: rt.spawn(n, system=LONG_SYSTEM + n).ask(texts[2], max_tokens=12) for n in names}
    eos = set(tok.eos_token_ids)
    assert any(tok.encode(r.text, add_special_tokens=False) != [t for t in r.tokens if t not in eos]
               for n in names for r in hot[n][:2])
    assert {r.cache for r in cold.values()} == {"cold"}
    assert [cold[n].tokens for n in names] == [hot[n][2].tokens for n in names]


def test_a_reset_to_the_history_keeps_the_replies_tokens_for_a_cold_turn(tmp_path, tiny_model_path):
    """A client resending the conversation it has (`reset(history())`, as the server does to undo a failed
    request) kept only the replies' text: a turn after a lost cache then tokenized it again."""
    model, names = tiny_model_path(), [f"a{i}" for i in range(8)]

    def rewound(cache_dir, lose: bool):
        with Runtime(model=model, cache_dir=cache_dir) as rt:
            for n in names:
                agent = rt.spawn(n, system=LONG_SYSTEM + n)
                for t in ("Plan a bake sale.", "Go on."):
                    agent.ask(t, max_tokens=12)
                agent.reset(agent.history()).get(timeout=60)
                assert [r.get("tokens") for r in agent.history()][-1]  # the reply's tokens are kept
        if lose:
            for f in cache_dir.glob("*/*/cache*.safetensors"):
                f.unlink()
        with Runtime(model=model, cache_dir=cache_dir) as rt:
            return [rt.spawn(n, system=LONG_SYSTEM + n).ask("Who bakes?", max_tokens=12) for n in names]

    kept, lost = rewound(tmp_path / "kept", False), rewound(tmp_path / "lost", True)
    assert {r.cache for r in kept} == {"warm"} and {r.cache for r in lost} == {"cold"}
    assert [r.tokens for r in lost] == [r.tokens for r in kept]


def test_reset_refuses_tokens_that_are_not_token_ids(rt):
    agent = rt.spawn(f"tok-{uuid.uuid4().hex[:6]}")
    for bad in ("1 2 3", [1, "2"], [True], [-1], [2**31]):
        with pytest.raises(ValueError, match="tokens are a list of token ids"):
            agent.reset([{"role": "assistant", "text": "Hi.", "tokens": bad}])


def test_a_replay_holds_what_the_hot_cache_held_and_starts_over_after_a_reply_it_cannot_spell(tmp_path, tiny_model_path,
                                                                                              monkeypatch):
    from actors import agent as agent_module
    from actors.agent import render_chat, replayed

    model = tiny_model_path()
    with Runtime(model=model, cache_dir=tmp_path) as rt:
        agent = rt.spawn("alice", system=LONG_SYSTEM)
        for t in ("Plan a bake sale.", "Go on."):
            agent.ask(t, max_tokens=12)
        records, tok, spec = agent.history(), rt.tokenizer, rt.spec
    _, meta = store.load_cache(tmp_path, spec, "alice")
    held = replayed(tok, LONG_SYSTEM, records)
    assert (held.token_ids, held.token_ends, held.text, held.seq) == (meta.token_ids, meta.token_ends, meta.text, meta.seq)
    replies = [i for i, r in enumerate(records) if r["role"] == "assistant"]
    foreign = [dict(r) for r in records]
    foreign[replies[0]]["tokens"] = foreign[replies[0]]["tokens"][::-1]  # ids that spell something else
    after = replayed(tok, LONG_SYSTEM, foreign)  # the second turn starts over from its text
    prompt = chat.encode(tok, render_chat(tok, LONG_SYSTEM, records[: replies[1]]))
    assert after.token_ids == prompt + records[replies[1]]["tokens"][:-1]
    foreign[replies[1]]["tokens"] = foreign[replies[1]]["tokens"][::-1]
    assert replayed(tok, LONG_SYSTEM, foreign) is None  # a cold turn then tokenizes the whole text, as before
    monkeypatch.setattr(agent_module, "REPLAYED", 1)  # only the last reply replayed: the text before it encoded
    assert replayed(tok, LONG_SYSTEM, records).token_ids == prompt + records[replies[1]]["tokens"][:-1]
    # a cut that a sliding-window layer could not have made (its keys gone) starts over from the text, as hot did
    edited = [dict(r) for r in records]
    edited[replies[1]]["text"] = "Something else entirely."
    rendered = render_chat(tok, LONG_SYSTEM, edited)
    monkeypatch.setattr(q4cache, "SLIDING_SLACK", 0)
    assert agent_module.continued_held(tok, held, rendered) is not None
    assert agent_module.continued_held(tok, held, rendered, SimpleNamespace(windows=(None,))) is not None
    assert agent_module.continued_held(tok, held, rendered, SimpleNamespace(windows=(None, 4))) is None


def test_ids_that_differ_only_in_case_are_refused_running_or_stored(tmp_path):
    """On a case-insensitive file system (macOS's) agents Alice and alice would append to one journal."""
    with Runtime(model=None, cache_dir=tmp_path) as rt:
        alice = rt.spawn("Alice", system=LONG_SYSTEM)
        with pytest.raises(store.InvalidAgentId, match="'Alice'.*only in case"):
            rt.spawn("alice")
        alice.ask("Plan a bake sale.", max_tokens=2)
        assert rt.running() == ["Alice"]
    with Runtime(model=None, cache_dir=tmp_path) as rt:
        with pytest.raises(store.InvalidAgentId, match="rt.forget\\('Alice'\\)"):
            rt.spawn("ALICE")  # Alice is stored, not running
        assert rt.spawn("Alice", system=LONG_SYSTEM).history()[-1]["role"] == "assistant"
        rt.forget("Alice")
        assert rt.spawn("alice").history() == []


@pytest.mark.parametrize("name", ["MODEL.json", "Model.Json"])
def test_an_id_that_differs_from_the_stores_own_file_only_in_case_is_refused(tmp_path, name):
    """The store keeps model.json beside the agents' folders: an agent MODEL.json got a folder beside it, which a
    case-insensitive file system (macOS's) takes for that file."""
    with Runtime(model=None, cache_dir=tmp_path) as rt:
        with pytest.raises(store.InvalidAgentId, match="the store keeps a file named 'model.json'"):
            rt.spawn(name)
        assert rt.running() == [] and not [p for p in tmp_path.glob("*/*") if p.name.lower() == "model.json" and p.is_dir()]


def test_hot_budget_zero_makes_every_turn_warm_with_the_same_output(tmp_path):
    texts = ["Plan a bake sale.", "Go on.", "Who bakes?"]
    with Runtime(model=None, cache_dir=tmp_path / "hot") as rt:
        a = rt.spawn("alice", system=LONG_SYSTEM)
        hot = [a.ask(t, max_tokens=6) for t in texts]
    with Runtime(model=None, cache_dir=tmp_path / "warm", hot_budget=0) as rt:
        a = rt.spawn("alice", system=LONG_SYSTEM)
        warm = [a.ask(t, max_tokens=6) for t in texts]
        assert len(rt._env.hot) == 0
        folder = store.agent_dir(tmp_path / "warm", rt.spec.fingerprint, "alice")
    # turns 2 and 3 continued the cache on disk: each wrote only its new rows
    assert sorted(p.name for p in folder.glob("cache.*")) == [
        "cache.1.delta.safetensors", "cache.2.delta.safetensors", "cache.safetensors"]
    assert [r.cache for r in hot] == ["cold", "hot", "hot"]
    assert [r.cache for r in warm] == ["cold", "warm", "warm"]
    assert [r.tokens for r in warm] == [r.tokens for r in hot]


def test_the_first_turn_after_a_restart_continues_the_chain_on_disk_with_a_delta(tmp_path):
    texts = ["Plan a bake sale.", "Go on.", "Who bakes?", "And the cakes?"]
    system = LONG_SYSTEM * 4  # so that three turns' rows stay smaller than the full file
    with Runtime(model=None, cache_dir=tmp_path / "one") as rt:
        a = rt.spawn("alice", system=system)
        whole = [a.ask(t, max_tokens=6) for t in texts]
    with Runtime(model=None, cache_dir=tmp_path / "two") as rt:
        a = rt.spawn("alice", system=system)
        split = [a.ask(t, max_tokens=6) for t in texts[:2]]
    with Runtime(model=None, cache_dir=tmp_path / "two") as rt:  # a restart: the cache chain is loaded
        a = rt.spawn("alice", system=system)
        split += [a.ask(t, max_tokens=6) for t in texts[2:]]
        folder = store.agent_dir(tmp_path / "two", rt.spec.fingerprint, "alice")
    assert [r.cache for r in split] == ["cold", "hot", "warm", "hot"]
    # one full file, then only new rows, across the restart too (it used to rewrite the full file)
    assert sorted(p.name for p in folder.glob("cache.*")) == [
        "cache.1.delta.safetensors", "cache.2.delta.safetensors", "cache.3.delta.safetensors", "cache.safetensors"]
    assert [r.tokens for r in split] == [r.tokens for r in whole]
    with Runtime(model=None, cache_dir=tmp_path / "two") as rt:  # and the chain loads as the agent left it
        host, meta = store.load_cache(tmp_path / "two", rt.spec, "alice")
        assert meta.seq == store.cache_seq(folder) and meta.turn_id == split[-1].turn_id


def test_process_restart_resumes_warm_with_the_uninterrupted_greedy_output(tmp_path):
    n, cut = len(child.STEPS), 3
    assert child.STEPS[cut][0] == "ask"
    whole = child.run(tmp_path / "whole", 0, n)  # in-process, uninterrupted (also builds the model)

    def run_child(start, end):
        proc = subprocess.run(
            [sys.executable, str(TESTS / "agent_restart_child.py"), str(tmp_path / "split"), str(start), str(end)],
            capture_output=True, text=True, timeout=120, env=dict(os.environ),
        )
        assert proc.returncode == 0, proc.stderr[-3000:]
        return json.loads(proc.stdout.strip().splitlines()[-1])

    first, second = run_child(0, cut), run_child(cut, n)
    assert [r["step"] for r in first + second] == list(range(n))
    assert [r["tokens"] for r in first + second] == [r["tokens"] for r in whole]
    assert [r["text"] for r in first + second] == [r["text"] for r in whole]
    assert whole[cut]["cache"] == "hot"
    assert second[0]["cache"] == "warm"  # alice resumed from disk, no full re-prefill
    assert second[1] == {**second[1], "agent": "bob", "cache": "warm"}


def _text_tokens(tokenizer, text) -> int:
    """Tokens of `text` as plain text (special-token strings in it stay text).

    Not `encode(split_special_tokens=True)`: that flips a flag of the tokenizer the agents share.
    """
    return len(chat.encode_text(tokenizer, text))


def _template_tokens(tokenizer, contents) -> int:
    """Tokens the tiny chat template adds after a reply: its end, each user message, the assistant prompt.

    Counted from the template's literal pieces (testing.CHAT_TEMPLATE), not from the runtime.
    """
    enc = lambda s: len(tokenizer.encode(s, add_special_tokens=False))  # noqa: E731
    user_head, end, assistant_head = ("<|start_header_id|>user<|end_header_id|>\n\n", "<|eot_id|>",
                                      "<|start_header_id|>assistant<|end_header_id|>\n\n")
    messages = sum(enc(user_head) + _text_tokens(tokenizer, c) + enc(end) for c in contents)
    return enc(end) + messages + enc(assistant_head)


def test_every_next_render_starts_with_the_cached_text_and_hot_turns_prefill_only_the_new_messages(rt):
    """A multi-agent conversation: alice and bob ask and send_to each other; check every turn."""
    tok = rt.tokenizer
    alice = rt.spawn("ct-alice", system="You are Alice, a planner.")
    bob = rt.spawn("ct-bob", system="You are Bob, a reviewer.")
    steps = [(alice, None, "Plan a bake sale."), (bob, None, "Review plans today."),
             (alice, bob, "Is the plan sound?"), (bob, alice, "Answer the doubts."),
             (alice, None, "Sum it up."), (bob, None, "Any last words?"),
             (alice, bob, "Final check."), (alice, None, "Thanks.")]
    seen = {alice.name: 0, bob.name: 0}  # history records (system included) in each agent's cache
    states = []
    for who, sender, text in steps:
        rt.flush()  # the cache files follow the acks
        meta = store.load_cache(rt.cache_dir, rt.spec, who.name)[1] if seen[who.name] else None
        r = who.ask(text, max_tokens=8) if sender is None else sender.send_to(who, text, max_tokens=8).get(timeout=60)
        states.append(r.cache)
        history = who.history()
        render = rt._env.render(history[0]["text"], history[1:-1])  # this turn's prompt
        if meta is None:
            assert r.cache == "cold" and r.timings.prefill_tokens == len(tok.encode(render, add_special_tokens=False))
        else:
            assert r.cache == "hot"
            assert render.startswith(meta.text), f"turn {len(states)}: the render does not start with the cached text"
            # what the cache lacks: the end of the last reply (its last token, never fed, or an unfinished
            # character), then the new user messages (notes, then this turn's message) in their template
            last_reply = [x["text"] for x in history[: seen[who.name]] if x["role"] == "assistant"][-1]
            tail = meta.text[max(meta.token_ends):]
            assert meta.text.endswith(last_reply) and len(tail) <= len(last_reply)
            new = [f"{x['sender']}: {x['text']}" if x["sender"] else x["text"]
                   for x in history[seen[who.name]:-1] if x["role"] == "user"]
            assert r.timings.prefill_tokens == _text_tokens(tok, tail) + _template_tokens(tok, new), len(states)
        seen[who.name] = len(history)
    assert states == ["cold", "cold"] + ["hot"] * 6


# -- messages between agents ---------------------------------------------------------


def test_send_to_is_a_turn_of_bob_attributed_to_alice_and_a_note_to_alice(rt):
    alice = rt.spawn("st-alice", system="You are Alice.")
    bob = rt.spawn("st-bob", system="You are Bob.")
    alice.ask("Plan a bake sale.", max_tokens=4)
    before_alice, before_bob = alice.history(), bob.history()

    future = alice.send_to(bob, "Bob, review this.", max_tokens=6)
    r = future.get(timeout=60)
    assert isinstance(r, Reply) and r.agent == "st-bob" and len(r.tokens) == 6

    bob_new = bob.history()[len(before_bob):]
    assert [(x["role"], x["sender"], x["text"], x["turn_id"]) for x in bob_new] == [
        ("user", "st-alice", "Bob, review this.", r.turn_id),
        ("assistant", None, r.text, r.turn_id),
    ]
    # bob's model saw the message as coming from alice
    assert "st-alice: Bob, review this." in rt._env.render(bob.history()[0]["text"], bob.history())

    after_alice = alice.history()
    assert after_alice[: len(before_alice)] == before_alice
    new = after_alice[len(before_alice):]
    assert [(x["role"], x["sender"], x["text"], x["turn_id"]) for x in new] == [("user", "st-bob", r.text, None)]
    time.sleep(0.2)  # no turn of alice follows later either (no ping-pong)
    assert alice.history() == after_alice
    assert len(bob.history()) == len(before_bob) + 2


def test_send_to_refuses_itself_another_runtimes_agent_and_a_name(rt, tmp_path):
    """send_to(self) appended the reply to the sender as a message from itself; an agent of another Runtime got
    the turn while the copy went to that Runtime's dead letters; a name gave an AttributeError."""
    alice = rt.spawn("sx-alice", system="You are Alice.")
    with pytest.raises(ValueError, match="cannot send to itself"):
        alice.send_to(alice, "Me?", max_tokens=2)
    with pytest.raises(TypeError, match="AgentRef"):
        alice.send_to("sx-bob", "You?", max_tokens=2)
    with Runtime(model=None, cache_dir=tmp_path / "other") as other:
        bob = other.spawn("sx-bob", system="You are Bob.")
        with pytest.raises(ValueError, match="another Runtime"):
            alice.send_to(bob, "Over there?", max_tokens=2)
        assert len(bob.history()) == 1 and not other.dead_letters
    assert [r["role"] for r in alice.history()] == ["system"]


def test_mutual_send_to_never_deadlocks(rt):
    alice = rt.spawn("dl-alice", system="You are Alice.")
    bob = rt.spawn("dl-bob", system="You are Bob.")
    rounds, burst = 4, 2
    for i in range(rounds):
        barrier = threading.Barrier(2)
        results, errors = {}, []

        def go(src, dst, i=i, barrier=barrier, results=results, errors=errors):
            try:
                barrier.wait(10)
                futures = [src.send_to(dst, f"{src.name} ping {i}.{k}", max_tokens=4) for k in range(burst)]
                results[src.name] = [f.get(timeout=30) for f in futures]
            except BaseException as e:  # noqa: BLE001
                errors.append(e)

        threads = [threading.Thread(target=go, args=(alice, bob)), threading.Thread(target=go, args=(bob, alice))]
        for t in threads:
            t.start()
        for t in threads:
            t.join(45)
        assert not any(t.is_alive() for t in threads), f"round {i}: mutual send_to deadlocked"
        assert not errors, errors
        assert {r.agent for r in results["dl-alice"]} == {"dl-bob"}
        assert {r.agent for r in results["dl-bob"]} == {"dl-alice"}
    for me, other in ((alice, bob), (bob, alice)):
        h = me.history()  # every reply's copy is in it: each future resolved once its copy was durable
        turns = [x for x in h if x["role"] == "user" and x["turn_id"] is not None]
        notes = [x for x in h if x["role"] == "user" and x["turn_id"] is None]
        assert [x["text"] for x in turns] == [f"{other.name} ping {i}.{k}" for i in range(rounds) for k in range(burst)]
        assert all(x["sender"] == other.name for x in turns + notes)
        assert len(notes) == rounds * burst
        assert len(set(turn_ids(h))) == len(turns)


def test_converse_and_broadcast_attribute_every_message(rt):
    a = rt.spawn("cv-a", system="You are A.")
    b = rt.spawn("cv-b", system="You are B.")
    replies = rt.converse([a, b], "Let us plan.", rounds=2, max_tokens=4)
    assert [r.agent for r in replies] == ["cv-a", "cv-b", "cv-a", "cv-b"]
    assert all(len(r.tokens) <= 4 for r in replies)  # every turn took the options
    b_users = [x for x in b.history() if x["role"] == "user"]
    expected = [("cv-a", replies[0].text or "..."), ("cv-a", replies[2].text or "...")]
    assert [(x["sender"], x["text"]) for x in b_users] == expected
    a_users = [x for x in a.history() if x["role"] == "user"]
    assert [x["sender"] for x in a_users] == [None, "cv-b"]

    futures = rt.broadcast([a, b], "Vote now.", max_tokens=3)
    assert sorted((r.agent, len(r.tokens) <= 3) for r in (f.get(timeout=60) for f in futures)) == [
        ("cv-a", True), ("cv-b", True)]
    assert a.history()[-2]["text"] == b.history()[-2]["text"] == "Vote now."


def test_converse_and_broadcast_check_their_agents_and_rounds_before_any_turn(rt):
    """A name in place of an AgentRef failed with AttributeError after the turns before it had run, rounds=-1
    returned no replies silently, and a generator of agents ran one round of any number asked for."""
    a = rt.spawn("cc-a", system="You are A.")
    b = rt.spawn("cc-b", system="You are B.")
    for call in (lambda: rt.converse([a, "cc-b"], "Plan.", 1), lambda: rt.broadcast([a, "cc-b"], "Vote.")):
        with pytest.raises(TypeError, match="AgentRef"):
            call()
    with pytest.raises(ValueError, match="rounds must be >= 0"):
        rt.converse([a, b], "Plan.", -1)
    with pytest.raises(TypeError, match="rounds must be int"):
        rt.converse([a, b], "Plan.", 1.5)
    assert [r["role"] for r in a.history()] == ["system"]  # nothing ran
    replies = rt.converse((x for x in (a, b)), "Plan.", 2, max_tokens=2)
    assert [r.agent for r in replies] == ["cc-a", "cc-b", "cc-a", "cc-b"]


# -- streaming and asyncio -------------------------------------------------------------


def test_stream_yields_pieces_in_order_then_the_reply_and_they_add_up_to_its_text(rt):
    a, b, c = (rt.spawn(name, system="You are A.") for name in ("sm-a", "sm-b", "sm-c"))
    progress = []
    *pieces, reply = a.stream("Tell me a story.", max_tokens=16, on_progress=lambda *p: progress.append(p))
    assert isinstance(reply, Reply) and reply.agent == "sm-a" and len(reply.tokens) == 16
    assert len(pieces) > 1 and all(isinstance(p, str) and p for p in pieces)
    assert "".join(pieces) == reply.text == a.history()[-1]["text"]
    assert progress[-1] == (reply.timings.prefill_tokens, reply.timings.prefill_tokens)
    # a stop string across two pieces: its first characters were decoded before the engine saw it whole
    k = len(pieces[0])
    stop = reply.text[k - 1 : k + 1]
    *cut, stopped = b.stream("Tell me a story.", max_tokens=16, stop=[stop])
    assert stopped.finish_reason == "stop" and stopped.text == reply.text[: reply.text.find(stop)]
    assert "".join(cut) == stopped.text
    *cut, stopped = c.stream("Tell me a story.", max_tokens=16, stop=stop)  # one str is one stop string
    assert stopped.finish_reason == "stop" and "".join(cut) == stopped.text == reply.text[: reply.text.find(stop)]
    before = a.history()
    with pytest.raises(TypeError, match="on_progress must be a callable"):
        a.stream("Again.", on_progress="a progress bar")  # raised here, nothing was sent
    assert a.history() == before


def test_stream_pieces_arrive_while_the_batch_decodes(rt):
    """A second row holds the batch once the streamed turn has text, until the consumer has a piece.

    Were the pieces delivered only at the end, the consumer would wait for a turn
    that cannot end, until the hold gives up after 30 s (`held` then has False)."""
    a = rt.spawn("sw-a", system="You are A.")
    engine = pykka_compat.actor_of(rt._env.batcher()).engine
    go, release, held = threading.Event(), threading.Event(), []

    def hold(piece):  # runs on the batcher's thread, as every row's on_token
        if any(r.turn.agent_id == a.name and r.text for r in engine.decoding) and not release.is_set():
            held.append(release.wait(30))

    gate = Turn(f"gate-{uuid.uuid4().hex[:8]}", "gate", None, rt.tokenizer.encode("gate", add_special_tokens=False),
                max_tokens=100, on_token=hold, on_progress=lambda *_: go.wait(30))
    batcher = rt._env.batcher()
    batcher.tell(Submit(gate, lambda outcome: None))
    stream = a.stream("Stream to me.", max_tokens=12)
    wait_for(lambda: pykka_compat.queued(batcher) >= 1, what="the turn to reach the batcher")
    go.set()
    first = next(stream)  # once the turn has text the batch is held, so the turn cannot end before this
    still_decoding = any(r.turn.agent_id == a.name for r in engine.decoding)
    release.set()
    *rest, reply = stream
    assert still_decoding and False not in held  # the piece came out while the turn decoded, not at its end
    assert first + "".join(rest) == reply.text and len(reply.tokens) == 12


@pytest.mark.parametrize("how", ["await send", "ask_async", "astream"])
def test_awaiting_a_turn_never_blocks_the_event_loop(rt, how):
    """A 10 ms ticker keeps ticking while a turn is awaited; the turn ends only once it ticked."""
    a = rt.spawn(f"tick-{how.replace(' ', '-')}", system="You are A.")

    async def turn():
        if how == "await send":
            return await a.send("Tick.", max_tokens=4)
        if how == "ask_async":
            return await a.ask_async("Tick.", max_tokens=4)
        return [x async for x in a.astream("Tick.", max_tokens=4)][-1]

    async def main():
        with stalled_batcher(rt) as release:
            task = asyncio.create_task(turn())
            for _ in range(3):
                await asyncio.sleep(0.01)
                assert not task.done()
            release.set()
            return await task

    reply = asyncio.run(main())
    assert isinstance(reply, Reply) and len(reply.tokens) == 4


@pytest.mark.parametrize("how", ["ask_async", "astream"])
def test_a_turn_to_an_agent_that_restarts_waits_for_it_off_the_event_loop(tmp_path, how):
    """An agent crashed, and its restart waits behind its busy supervisor: the turn's call waits for the restart
    (up to RESTART_WAIT_S) in a thread, so a 10 ms ticker keeps ticking; once the supervisor is free, the turn
    goes to the restarted agent. (The call waited on the event loop, which held every coroutine meanwhile, and
    here the supervisor's release with them: the turn failed with AgentCrashed after 10 s.)"""
    with Runtime(model=None, cache_dir=tmp_path, backoff=FAST) as rt:
        a = rt.spawn("a", system="You are A.")
        old = rt._env.refs["a"]

        async def turn():
            if how == "ask_async":
                return await a.ask_async("Tick.", max_tokens=4)
            return [x async for x in a.astream("Tick.", max_tokens=4)][-1]

        reply = run_while_restarting(rt, a,
                                     lambda release: ticking_until_released(turn(), release))
        assert isinstance(reply, Reply) and len(reply.tokens) == 4 and rt._env.refs["a"] is not old


def test_turns_started_in_order_on_a_loop_reach_a_restarting_agent_in_that_order(tmp_path):
    """Eight ask_async calls started one after another while the agent's restart waits: each sends from a thread
    (`_send_off_loop`), yet the agent's journal has the eight messages in the order the calls were made, as when
    `send` ran on the loop itself."""
    with Runtime(model=None, cache_dir=tmp_path, backoff=FAST) as rt:
        a = rt.spawn("a", system="You are A.")

        async def main(release):
            tasks = [asyncio.create_task(a.ask_async(f"Message {i}.", max_tokens=2)) for i in range(8)]
            return await ticking_until_released(asyncio.gather(*tasks), release)

        replies = run_while_restarting(rt, a, main)
        assert len(replies) == 8
        said = [r["text"] for r in a.history() if r["role"] == "user" and r["text"].startswith("Message")]
        assert said == [f"Message {i}." for i in range(8)]


@pytest.mark.parametrize("how", ["wait_for", "task.cancel", "astream"])
def test_a_call_cancelled_while_its_send_waits_for_a_restart_never_sends_its_turn(tmp_path, how):
    """A call cancelled (its `wait_for` ran out, or its task was cancelled) while its send waited in a thread for
    the agent's restart: the turn is never sent, so nothing of it is in the journal, and a later call goes on.
    (The thread sent it once the restart was done: the turn ran for nobody and was recorded as if asked.)"""
    with Runtime(model=None, cache_dir=tmp_path, backoff=FAST) as rt:
        a = rt.spawn("a", system="You are A.")

        async def cancelled():
            if how == "astream":
                return [x async for x in a.astream("Never sent.", max_tokens=2)]
            return await a.ask_async("Never sent.", max_tokens=2)

        async def main(release):
            if how == "wait_for":
                with pytest.raises(asyncio.TimeoutError):
                    await asyncio.wait_for(cancelled(), 0.05)  # the restart is held: it can only time out
            else:
                task = asyncio.create_task(cancelled())
                for _ in range(5):
                    await asyncio.sleep(0.01)
                    assert not task.done(), task
                task.cancel()
                with pytest.raises(asyncio.CancelledError):
                    await task
            return await ticking_until_released(a.ask_async("After.", max_tokens=2), release)

        reply = run_while_restarting(rt, a, main)  # asyncio.run joins the executor's threads
        assert isinstance(reply, Reply)
        said = [r["text"] for r in a.history() if r["role"] == "user"]
        assert "After." in said and "Never sent." not in said, said


@pytest.mark.parametrize("how", ["ask_async", "astream"])
def test_a_call_cancelled_after_its_turn_was_sent_lets_the_turn_finish_and_be_recorded(rt, how):
    """Cancelling an ask_async or astream whose turn was already sent ends only the wait, as for any awaited
    turn: the turn runs on, and it is recorded with its reply."""
    a = rt.spawn(f"sent-{how}", system="You are A.")
    batcher = rt._env.batcher()

    async def turn():
        if how == "ask_async":
            return await a.ask_async("Sent.", max_tokens=2)
        return [x async for x in a.astream("Sent.", max_tokens=2)]

    async def main():
        with stalled_batcher(rt):
            task = asyncio.create_task(turn())
            while pykka_compat.queued(batcher) < 1:  # the turn reached the parked batcher: it was sent
                await asyncio.sleep(0.005)
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
        return await a.ask_async("After.", max_tokens=2)

    assert isinstance(asyncio.run(main()), Reply)
    records = a.history()
    said = [r["text"] for r in records if r["role"] == "user"]
    assert said == ["Sent.", "After."], said
    assert [r["role"] for r in records if r["role"] != "system"] == ["user", "assistant"] * 2


def test_64_concurrent_ask_async_calls_fill_the_batch_with_no_thread_each(tmp_path):
    with Runtime(model=None, cache_dir=tmp_path, max_batch=8) as rt:
        agents = [rt.spawn(f"c{i}", system="You are brief.") for i in range(16)]
        assert all(a.history() for a in agents)  # each has started and stored its system prompt
        batcher = rt._env.batcher()

        async def main():
            # ask_async sends from the loop's default executor: two threads send all 64, waiting for no reply
            asyncio.get_running_loop().set_default_executor(ThreadPoolExecutor(2, thread_name_prefix="sender"))
            with stalled_batcher(rt) as release:
                names = {t.name for t in threading.enumerate()}
                calls = [asyncio.create_task(a.ask_async(f"Call {k}.", max_tokens=2))
                         for k in range(4) for a in agents]
                for _ in range(6000):  # every agent's first turn reaches the parked batcher
                    if pykka_compat.queued(batcher) >= len(agents):
                        break
                    await asyncio.sleep(0.005)
                assert pykka_compat.queued(batcher) >= len(agents), "the calls did not all get through"
                new = {t.name for t in threading.enumerate() if t.name not in names and not t.name.startswith("sender")}
                assert new <= {rt._env.deadlines.name}, new  # no thread waits for a call or its watchdog
                release.set()
                return await asyncio.gather(*calls)

        replies = asyncio.run(main())
        peak = batcher.proxy().engine.get(timeout=10).peak_admitted
    assert len(replies) == 64 and all(len(r.tokens) == 2 for r in replies)
    assert peak == 8


def test_messages_are_msgpack_envelopes(rt, monkeypatch):
    alice = rt.spawn("mp-alice", system="You are Alice.")
    bob = rt.spawn("mp-bob", system="You are Bob.")
    delivered, notified = [], []
    deliver, notify = rt._deliver, rt._env.notify

    def spy_deliver(name, message, future):
        delivered.append((name, message))
        deliver(name, message, future)

    def spy_notify(name, payload, **kw):
        notified.append((name, payload))
        notify(name, payload, **kw)

    monkeypatch.setattr(rt, "_deliver", spy_deliver)
    monkeypatch.setattr(rt._env, "notify", spy_notify)

    r = alice.send_to(bob, "Bob, review this.", conversation_id="conv-1", max_tokens=4).get(timeout=60)
    [(name, ask)] = delivered
    assert name == "mp-bob" and isinstance(ask, Ask) and isinstance(ask.payload, bytes)
    msg = msgpack.unpackb(ask.payload)
    assert msg["sender"] == "mp-alice" and msg["text"] == "Bob, review this." and msg["conversation_id"] == "conv-1"
    assert isinstance(msg["message_id"], str) and msg["message_id"]
    user = next(x for x in bob.history() if x["turn_id"] == r.turn_id and x["role"] == "user")
    assert (user["message_id"], user["conversation_id"]) == (msg["message_id"], "conv-1")

    [(name, payload)] = notified
    note = msgpack.unpackb(payload)
    assert name == "mp-alice" and note["sender"] == "mp-bob" and note["text"] == r.text
    assert note["conversation_id"] == "conv-1" and note["message_id"] and note["message_id"] != msg["message_id"]
    assert alice.history()[-1]["message_id"] == note["message_id"]


# -- dead letters ---------------------------------------------------------------------


def test_a_stopped_agent_is_unknown_and_messages_to_it_are_dead_letters(rt):
    a = rt.spawn("gone-a", system="You are A.")
    a.ask("Hello.", max_tokens=4)
    a.stop()
    assert "gone-a" not in rt.running()
    assert "gone-a" not in live_agents(rt._env)
    n = len(rt.dead_letters)
    with pytest.raises(UnknownAgent):
        a.ask("Anyone there?", max_tokens=4)
    with pytest.raises(UnknownAgent, match="no running agent named 'gone-a'; running: "):
        rt.agent("gone-a")
    ghost = AgentRef(rt, "never-spawned")
    with pytest.raises(UnknownAgent):
        ghost.send("Boo.")
    letters = rt.dead_letters[n:]
    assert [d.recipient for d in letters] == ["gone-a", "never-spawned"]
    assert note_of(letters[0])["text"] == "Anyone there?"
    assert all(d.reason for d in letters)


def test_dead_letters_keep_the_newest_and_say_once_that_older_ones_are_dropped(rt, monkeypatch, caplog):
    """Undeliverable messages are kept in memory for inspection, so they are bounded: past
    `DEAD_LETTERS_KEPT` the oldest go, counted, with one warning saying so (not one per letter)."""
    from runtime.api import facade

    monkeypatch.setattr(facade, "DEAD_LETTERS_KEPT", 3)
    letters = facade.DeadLetters()
    ghost = AgentRef(rt, "never-spawned")
    monkeypatch.setattr(rt._env, "dead_letters", letters)
    with caplog.at_level(logging.WARNING):
        for i in range(7):
            with pytest.raises(UnknownAgent):
                ghost.send(f"Boo {i}.")
    assert [note_of(d)["text"] for d in rt.dead_letters] == ["Boo 4.", "Boo 5.", "Boo 6."]
    assert letters.dropped == 4
    assert sum("dead letters" in r.getMessage() and "dropped" in r.getMessage() for r in caplog.records) == 1


def test_result_of_a_stopped_agent_raises_unknown_agent_and_leaves_no_dead_letter(rt, caplog):
    """A lookup is a question, as a history request is: asked of an agent that is not running, result() raises the
    UnknownAgent history() raises, and records no dead letter (each call appended one, with a warning logged)."""
    a = rt.spawn("result-gone", system="You are A.")
    reply = a.ask("Hello.", max_tokens=2)
    a.stop()
    with pytest.raises(UnknownAgent) as asked_history:
        a.history()
    with caplog.at_level(logging.WARNING, logger="runtime.api.facade"):
        for _ in range(3):
            with pytest.raises(UnknownAgent) as asked_result:
                a.result(reply.turn_id)
            assert str(asked_result.value) == str(asked_history.value)
    assert [d for d in rt.dead_letters if d.recipient == "result-gone"] == []
    assert "dead letter to result-gone" not in caplog.text


def test_a_reply_to_an_agent_stopped_meanwhile_is_a_dead_letter(rt):
    alice = rt.spawn("dlr-alice", system="You are Alice.")
    bob = rt.spawn("dlr-bob", system="You are Bob.")
    n = len(rt.dead_letters)
    with stalled_batcher(rt):
        future = alice.send_to(bob, "Answer me later.", max_tokens=4)
        alice.stop()  # bob's turn can't finish while the batcher is parked
    r = future.get(timeout=60)
    assert r.agent == "dlr-bob"
    wait_for(lambda: len(rt.dead_letters) > n, what="the dead letter")
    [letter] = [d for d in rt.dead_letters[n:] if d.recipient == "dlr-alice"]
    note = note_of(letter)
    assert (note["sender"], note["text"]) == ("dlr-bob", r.text)


def test_stopping_an_agent_answers_its_pending_turns_and_dead_letters_its_pending_notes(rt):
    alice = rt.spawn("stop-alice", system="You are Alice.")
    n = len(rt.dead_letters)
    with stalled_batcher(rt):
        batcher = rt._env.batcher()
        running = alice.send("One.", max_tokens=4)
        wait_for(lambda: pykka_compat.queued(batcher) >= 1, what="the turn to reach the batcher")
        queued = alice.send("Two.", max_tokens=4)
        rt._env.notify("stop-alice", encode_message("A note.", sender="bob"))  # as bob's reply would
        alice.stop()
        for future in (running, queued):
            with pytest.raises(AgentStopped) as stopped:
                future.get(timeout=5)  # not left hanging, and not reported as a crash
            assert stopped.value.turn_id == future.turn_id and isinstance(stopped.value, AgentCrashed)
    notes = [note_of(d) for d in rt.dead_letters[n:] if d.recipient == "stop-alice"]
    assert [(m["sender"], m["text"]) for m in notes if m] == [("bob", "A note.")]


def test_an_agent_its_supervisor_restarts_with_a_crashed_sibling_fails_its_turn_as_a_crash(tmp_path):
    """one_for_all: a's crash stops b to restart it; b's turn in flight fails with AgentCrashed, not AgentStopped
    (b comes back by itself, and spawning it again would be refused), and b answers again."""
    with Runtime(model=None, cache_dir=tmp_path, strategy="one_for_all", backoff=FAST) as r:
        a, b = r.spawn("sib-a", system="You are A."), r.spawn("sib-b", system="You are B.")
        inject_crash(a)
        with stalled_batcher(r):
            long = b.send("Tell me a long story.", max_tokens=400)
            crash = a.send("Hi.", max_tokens=1)  # ends first: a crashes, and its supervisor stops b
        with pytest.raises(AgentCrashed) as crashed:
            crash.get(timeout=60)
        with pytest.raises(AgentCrashed) as stopped:
            long.get(timeout=60)
        assert not isinstance(crashed.value, AgentStopped) and not isinstance(stopped.value, AgentStopped)
        assert "supervisor" in str(stopped.value)
        wait_for(lambda: set(r.running()) == {"sib-a", "sib-b"}, timeout=30, what="both agents back")
        assert b.ask("Are you back?", max_tokens=2, timeout=60).text is not None


def test_a_note_queued_behind_a_timed_out_turn_is_not_silently_dropped(rt):
    alice = rt.spawn("crash-note-alice", system="You are Alice.")
    n = len(rt.dead_letters)
    with stalled_batcher(rt):
        future = alice.send("Hang.", max_tokens=4, timeout=0.2)
        rt._env.notify("crash-note-alice", encode_message("A note.", sender="bob"))
        with pytest.raises(TurnTimeout):
            future.get(timeout=10)
    assert alice.result(future.turn_id) is None  # answered after the note: it is recorded by now
    kept = [x["text"] for x in alice.history() if x["role"] == "user"]
    lettered = [m["text"] for d in rt.dead_letters[n:] if (m := note_of(d))]
    assert "A note." in kept + lettered


# -- crashes and supervision ----------------------------------------------------------


def test_injected_crash_fails_the_turn_and_the_ref_keeps_working(tmp_path):
    with Runtime(model=None, cache_dir=tmp_path / "a", backoff=FAST) as rt:
        alice = rt.spawn("alice", system="You are Alice.")
        r1 = alice.ask("One.", max_tokens=6)
        old = rt._env.refs["alice"]
        inject_crash(alice)
        with pytest.raises(AgentCrashed) as crash:
            alice.ask("Two.", max_tokens=6)
        assert not isinstance(crash.value, TurnTimeout)
        assert crash.value.turn_id and crash.value.turn_id.startswith("alice-") and crash.value.turn_id != r1.turn_id
        r3 = alice.ask("Three.", max_tokens=6)
        assert rt._env.refs["alice"] is not old and live_agents(rt._env) == {"alice": 1}
        assert r3.cache == "warm"  # the restarted actor reloaded its cache from disk
        h = alice.history()
        assert turn_ids(h) == [r1.turn_id] * 2 + [r3.turn_id] * 2
        assert "Two." not in [x["text"] for x in h]
    with Runtime(model=None, cache_dir=tmp_path / "a") as rt:
        assert turn_ids(rt.spawn("alice").history()) == [r1.turn_id] * 2 + [r3.turn_id] * 2
    with Runtime(model=None, cache_dir=tmp_path / "b") as rt:  # as if the crashed turn never happened
        alice = rt.spawn("alice", system="You are Alice.")
        assert [alice.ask(t, max_tokens=6).tokens for t in ("One.", "Three.")] == [r1.tokens, r3.tokens]


def test_too_many_crashes_escalate(tmp_path):
    escalated, calls = threading.Event(), []

    def on_escalate(name, error):
        calls.append((name, error))
        escalated.set()

    with Runtime(model=None, cache_dir=tmp_path, max_restarts=1, restart_period=60, backoff=FAST,
                 on_escalate=on_escalate) as rt:
        alice = rt.spawn("alice", system="You are Alice.")
        alice.ask("One.", max_tokens=4)
        for _ in range(2):
            inject_crash(alice)
            with pytest.raises(AgentCrashed):
                alice.ask("Crash.", max_tokens=4)
        assert escalated.wait(10)
        assert calls[0][0] == "alice" and isinstance(calls[0][1], BaseException)
        with pytest.raises(RuntimeEscalated):
            alice.ask("Still there?", max_tokens=4)
        with pytest.raises(RuntimeEscalated):
            rt.spawn("carol")
        wait_for(lambda: not live_agents(rt._env), what="the group to stop")


def _raise(error: BaseException):
    raise error


def test_callbacks_that_raise_fail_their_turns_only_and_never_escalate(tmp_path):
    """A caller's callback that raises is the caller's mistake: its turn ends with CallbackFailed naming the
    callback, nothing is recorded, and no number of them restarts the agent or escalates."""
    escalated = threading.Event()

    def broken(*_):
        raise ValueError("oops in my UI code")

    class Ambiguous:  # an answer whose truth raises, as a numpy array of two elements does
        def __bool__(self):
            raise ValueError("oops, the truth value of my answer is ambiguous")

    with Runtime(model=None, cache_dir=tmp_path, max_restarts=1, restart_period=60, backoff=FAST,
                 on_escalate=lambda *_: escalated.set()) as rt:
        alice, bob = rt.spawn("cb-alice", system="You are Alice."), rt.spawn("cb-bob", system="You are Bob.")
        first = alice.ask("One.", max_tokens=4)
        for callback in ("on_token", "on_progress", "cancel", "on_token"):
            with pytest.raises(CallbackFailed, match=f"its {callback} callback raised ValueError: oops") as e:
                alice.ask("Break it.", max_tokens=4, **{callback: broken})
            assert e.value.turn_id
        for _ in range(3):  # the answer's truth is part of the call
            with pytest.raises(CallbackFailed, match="its cancel callback raised ValueError: oops, the truth"):
                alice.ask("Break it.", max_tokens=4, cancel=Ambiguous)
        slow = bob.send("Tell me a long story.", max_tokens=64)
        for error in (SystemExit(0), KeyboardInterrupt(), GeneratorExit()):  # not Exceptions: they crashed the batcher
            for callback in ("on_token", "on_progress", "cancel"):
                with pytest.raises(CallbackFailed, match=f"its {callback} callback raised {type(error).__name__}"):
                    alice.ask("Break it.", max_tokens=4, **{callback: lambda *_, error=error: _raise(error)})
        assert slow.get(timeout=60).text  # a turn in the same batcher, untouched
        story = alice.send("Tell me a story.", max_tokens=48)  # the next turn waits for it: its future is not done
        done = alice.send("Once more.", max_tokens=4)
        done.add_done_callback(lambda _: sys.exit(0))  # so this runs on the agent's thread: logged, never its crash
        replies = [story.get(timeout=60).text, done.get(timeout=60).text]
        assert not escalated.is_set()
        texts = [r["text"] for r in alice.history()]
        assert texts == ["You are Alice.", "One.", first.text, "Tell me a story.", replies[0], "Once more.",
                         replies[1]]  # nothing of the failed turns
        assert alice.ask("Still there?", max_tokens=4).cache == "hot"  # no restart: its cache is in memory
        assert bob.ask("Hello.", max_tokens=4).text


def test_one_name_spawned_stopped_and_forgotten_from_several_threads_stays_reachable(rt):
    """A stop let go of the name before it dropped the agent's ref: a spawn of that name in between started an
    agent whose ref the stop then dropped, and every call to it waited 10 s for a restart that never came.
    Spawns of one name at once got the supervisor's wording ("child ... already exists")."""
    from runtime import InvalidArgument

    def spawn_until_free(name):
        for _ in range(400):
            try:
                return rt.spawn(name, system="You are R.")
            except InvalidArgument as e:
                assert "is already running" in str(e), e
                time.sleep(0.002)
        raise AssertionError(f"{name} never came free")

    for i in range(6):
        name = f"racer{i % 2}"
        ref = spawn_until_free(name) if name not in rt.running() else rt.agent(name)
        stopper = threading.Thread(target=ref.stop if i % 3 else lambda: rt.forget(name))
        stopper.start()
        spawn_until_free(name)
        stopper.join()
        assert rt.agent(name).ask("Hi.", max_tokens=2, timeout=20).text is not None
    outcomes = []

    def racer():
        try:
            outcomes.append(rt.spawn("crowd", system="You are C."))
        except InvalidArgument as e:
            outcomes.append(str(e))

    threads = [threading.Thread(target=racer) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sum(not isinstance(o, str) for o in outcomes) == 1, outcomes
    assert all("is already running" in o for o in outcomes if isinstance(o, str)), outcomes


def test_turn_ids_made_for_an_agent_of_the_longest_name_can_be_sent_back(rt):
    """A made turn id was `<name>-<hex>`, longer than a turn id may be for names over 115 characters, so the id an
    error carried could not be retried with or asked about (InvalidArgument)."""
    from actors.agent import TURN_ID, new_turn_id

    name = "x" * 128
    for parts in ((), (12345678,)):
        made = new_turn_id(name, *parts)
        assert TURN_ID.fullmatch(made) and made.startswith("xxx"), made
    a = rt.spawn(name)
    with pytest.raises(TurnTimeout) as e:
        a.ask("Hi.", max_tokens=4, timeout=1e-6)
    turn_id = e.value.turn_id
    a.result(turn_id)  # None or the reply, whichever the timing gave
    assert a.ask("Hi.", max_tokens=4, turn_id=turn_id).turn_id == turn_id


def test_a_message_that_could_never_fit_is_refused_before_it_is_tokenized(rt):
    """Past the model's positions times its longest token's characters no tokenization can fit a message: it is
    refused in the caller's thread (tokenizing megabytes holds every thread of the process for seconds)."""
    a = rt.spawn("huge", system="You are A.")
    assert rt.longest_token_chars == max(map(len, rt.tokenizer.get_vocab()))
    limit = (rt.max_context - 4) * rt.longest_token_chars
    with pytest.raises(TurnTooLong, match=f"the message has {limit + 1} characters"):
        a.ask("x" * (limit + 1), max_tokens=4)
    with pytest.raises(TurnTooLong, match="positions"):  # shorter, and still too long: the agent counts its tokens
        a.ask("word " * (rt.max_context + 1), max_tokens=4)
    beyond = (rt.max_context - 1) * rt.longest_token_chars + 1  # as a note, which had been taken, failing
    with pytest.raises(ValueError, match=f"the note has {beyond} characters"):  # every later turn
        a.note("x" * beyond)
    with pytest.raises(ValueError, match=f"the note has {beyond} characters with its sender"):  # rendered with it
        a.note("x", sender="s" * (beyond - 1))
    assert [r["role"] for r in a.history()] == ["system"]
    assert a.ask("Short.", max_tokens=4).agent == "huge"


def test_a_turn_too_long_says_whether_a_reset_would_help(rt):
    """The advice was always "start the agent afresh (ref.reset())", which keeps the system prompt (and lacked
    reset's records): no help for an agent whose system prompt alone fills the model, nor for a message that
    fills it alone. Where a reset helps, the advice works as written."""
    words = rt.max_context + 10
    stuck = rt.spawn("long-system", system="word " * (rt.max_context - 200))  # room for a turn, not for this one
    with pytest.raises(TurnTooLong, match="the system prompt alone is .* spawn it with a shorter one"):
        stuck.ask("Hello.", max_tokens=400)
    talker = rt.spawn("long-talk", system="You are brief.")
    with pytest.raises(TurnTooLong, match="even in a fresh conversation"):
        talker.ask("word " * words, max_tokens=4)
    for _ in range(6):  # a long history: here a reset helps
        try:
            talker.ask("word " * (rt.max_context // 5), max_tokens=2)
        except TurnTooLong as e:
            assert "ref.reset([])" in str(e) and "fresh conversation" not in str(e)
            talker.reset([]).get(timeout=60)  # the advice works as written
            assert talker.ask("Hello.", max_tokens=2).agent == "long-talk"
            break
    else:
        pytest.fail("the history never outgrew the model")


def test_waits_on_the_files_check_their_timeout_and_run_out_with_wait_timeout(tmp_path, monkeypatch):
    with Runtime(model=None, cache_dir=tmp_path) as rt:
        for bad in (0, -1, float("nan")):
            with pytest.raises(ValueError, match="timeout must be a finite number > 0"):
                rt.flush(timeout=bad)
            with pytest.raises(ValueError, match="timeout must be a finite number > 0"):
                rt.forget("someone", timeout=bad)
        release = threading.Event()
        monkeypatch.setattr(pykka_compat.actor_of(rt._env.persistence()), "settle", lambda: release.wait(10))
        with pytest.raises(WaitTimeout, match="did not finish within 0.05 s"):
            rt.flush(timeout=0.05)
        release.set()
        rt.flush()


def test_a_spawn_its_busy_supervisor_has_not_begun_within_its_timeout_raises_wait_timeout(tmp_path):
    """spawn waited for the agents' supervisor with pykka's get(timeout=60): a supervisor busy past that (stopping
    an agent whose thread is held up) let pykka.Timeout out, no KvactorsError. spawn's timeout bounds the wait, the
    WaitTimeout says to call again, and the start it gave up on never runs."""
    with Runtime(model=None, cache_dir=tmp_path) as rt:
        rt.spawn("a")
        with busy_supervisor(rt):
            advice = r"spawn\(\) waited 0.2 s .* to start 'b'.*nothing was started: call spawn\(\) again"
            with pytest.raises(WaitTimeout, match=advice):
                rt.spawn("b", system="You are B.", timeout=0.2)
            assert rt.running() == ["a"]
        assert list(rt._supervisor.proxy().children().get(timeout=30)) == ["a"]  # asked after the start it gave up
        assert "b" not in rt._env.refs
        assert rt.spawn("b", system="You are B.").ask("Hi.", max_tokens=2).agent == "b"  # the advice works


@pytest.mark.parametrize("call", ["stop", "forget"])
def test_a_stop_its_busy_supervisor_has_not_done_within_its_wait_raises_wait_timeout_and_goes_on(tmp_path, monkeypatch,
                                                                                                 call):
    """stop() and forget() waited for the agents' supervisor with pykka's get(timeout=60): past that, pykka.Timeout
    got out. STOP_WAIT_S (stop) or forget's timeout bounds the wait, and the WaitTimeout says to call again. The
    stop goes on: the agent takes no more messages, its turn in flight fails with AgentStopped once it stops, and
    the call made again waits for it (forget then deletes the agent's files)."""
    from runtime.api import facade

    monkeypatch.setattr(facade, "STOP_WAIT_S", 0.2)
    with Runtime(model=None, cache_dir=tmp_path) as rt:
        a, b = rt.spawn("a", system="You are A."), rt.spawn("b")
        stop = {"stop": a.stop, "forget": lambda: rt.forget("a", timeout=0.2)}[call]
        with stalled_batcher(rt):
            future = a.send("Hello there.", max_tokens=4)
            with busy_supervisor(rt):
                advice = rf"{call}\(\) waited 0.2 s .* agent 'a'.*the stop goes on.*call {call}\(\) again"
                with pytest.raises(WaitTimeout, match=advice):
                    stop()
                assert rt.running() == ["b"]
                with pytest.raises(UnknownAgent):
                    a.send("Anyone there?", max_tokens=2)
            monkeypatch.setattr(facade, "STOP_WAIT_S", 60.0)
            {"stop": a.stop, "forget": lambda: rt.forget("a")}[call]()  # made again, it waits for the stop
            with pytest.raises(AgentStopped):
                future.get(timeout=0)
        assert rt.stored("a") is (call == "stop") and "a" not in rt._env.refs and rt.running() == ["b"]
        assert rt.spawn("a").ask("Hi.", max_tokens=2).agent == "a" and b.ask("Hi.", max_tokens=2).agent == "b"


def test_more_bad_arguments_are_refused_in_the_callers_thread(rt):
    a = rt.spawn("args", system="You are A.")
    with pytest.raises(TypeError, match="sender must be a str or None"):
        a.note("from a number", sender=5)
    with pytest.raises(TypeError, match="records must be a list of dicts"):
        a.reset("abc")
    a.reset(a.history()).get(timeout=60)  # history()'s own shape, system record and all
    with pytest.raises(ValueError, match=r"seed must be in \[0, 2\*\*64\)"):
        a.send("Hi.", seed=2**64)
    future = a.send("Hi.", max_tokens=2)
    for bad in (float("nan"), -1.0):
        with pytest.raises(ValueError, match="timeout must be None or a finite number >= 0"):
            future.get(timeout=bad)
    with pytest.raises(TypeError, match="timeout must be"):
        future.get(timeout="soon")
    assert future.get(timeout=60).agent == "args"
    with pytest.raises(ValueError, match="cache_dir is empty"):
        Runtime(model=None, cache_dir="")
    assert [r["role"] for r in a.history()] == ["system", "user", "assistant"]  # nothing else got in


def test_restart_types_of_agents(tmp_path):
    with Runtime(model=None, cache_dir=tmp_path, backoff=FAST) as rt:
        transient = rt.spawn("tr", system="You are T.", restart="transient")
        temporary = rt.spawn("tmp", system="You are T.", restart="temporary")
        with pytest.raises(ValueError):
            rt.spawn("bad", restart="sometimes")
        for ref in (transient, temporary):
            ref.ask("One.", max_tokens=4)
            inject_crash(ref)
            with pytest.raises(AgentCrashed):
                ref.ask("Crash.", max_tokens=4)
        assert transient.ask("Two.", max_tokens=4).agent == "tr"  # restarted after its crash
        n, t0 = len(rt.dead_letters), time.monotonic()
        with pytest.raises(UnknownAgent):  # not restarted: gone, like a stopped agent
            temporary.ask("Two.", max_tokens=4)
        assert time.monotonic() - t0 < 5
        assert rt.running() == ["tr"] and [d.recipient for d in rt.dead_letters[n:]] == ["tmp"]
        again = rt.spawn("tmp", system="You are T.")  # its durable history is still there
        assert len(turn_ids(again.history())) == 2


def test_hot_caches_over_budget_go_warm(tmp_path):
    with Runtime(model=None, cache_dir=tmp_path) as rt:
        alice = rt.spawn("alice", system="You are Alice.")
        bob = rt.spawn("bob", system="You are Bob.")
        assert alice.ask("One.", max_tokens=4).cache == "cold"
        rt._env.hot.budget_bytes = store.cache_nbytes(rt._env.hot.get("alice")) * 3 // 2  # room for one agent
        assert bob.ask("One.", max_tokens=4).cache == "cold"
        assert "alice" not in rt._env.hot and "bob" in rt._env.hot  # least recently used dropped to warm
        assert alice.ask("Two.", max_tokens=4).cache == "warm"


def test_a_batcher_crash_between_turns_is_survived(tmp_path):
    with Runtime(model=None, cache_dir=tmp_path, backoff=FAST) as rt:
        alice = rt.spawn("alice", system="You are Alice.")
        r1 = alice.ask("One.", max_tokens=4)
        old = rt._env.batcher()
        old.tell(object())  # an unknown message: TypeError inside the batcher
        wait_batcher_restarted(rt, old)
        r2 = alice.ask("Two.", max_tokens=4)
        assert r2.cache == "hot"
        assert turn_ids(alice.history()) == [r1.turn_id] * 2 + [r2.turn_id] * 2


def test_a_turn_during_the_batchers_restart_waits_for_it(tmp_path):
    with Runtime(model=None, cache_dir=tmp_path, backoff=Backoff(min=0.2, max=0.3, reset=10.0)) as rt:
        alice = rt.spawn("alice", system="You are Alice.")
        alice.ask("One.", max_tokens=4)
        me, old = rt._env.refs["alice"], rt._env.batcher()
        old.tell(object())
        wait_for(lambda: not old.is_alive(), what="the batcher's crash")
        r = alice.ask("Two.", max_tokens=4)  # sent while the batcher's restart is pending
        assert rt._env.batcher() is not old
        assert r.cache == "hot" and rt._env.refs["alice"] is me  # the agent did not crash for it


def test_a_batcher_crash_fails_in_flight_turns_and_agents_keep_their_history(tmp_path):
    with Runtime(model=None, cache_dir=tmp_path, backoff=FAST) as rt:
        alice = rt.spawn("alice", system="You are Alice.")
        bob = rt.spawn("bob", system="You are Bob.")
        r1 = alice.ask("One.", max_tokens=4)
        b1 = bob.ask("One.", max_tokens=4)
        old = rt._env.batcher()
        with stalled_batcher(rt):
            futures = [alice.send("Two.", max_tokens=4), bob.send("Two.", max_tokens=4)]
            wait_for(lambda: pykka_compat.queued(old) >= 2, what="the turns to reach the batcher")
            old.tell(object())
        for f in futures:
            with pytest.raises(AgentCrashed) as crash:
                f.get(timeout=30)
            assert crash.value.turn_id and "batcher" in str(crash.value)
        wait_batcher_restarted(rt, old)
        r3, b3 = alice.ask("Three.", max_tokens=4), bob.ask("Three.", max_tokens=4)
        assert turn_ids(alice.history()) == [r1.turn_id] * 2 + [r3.turn_id] * 2
        assert turn_ids(bob.history()) == [b1.turn_id] * 2 + [b3.turn_id] * 2
        assert live_agents(rt._env) == {"alice": 1, "bob": 1}


def test_the_watchdog_answers_a_hung_turn_and_cancels_it_without_a_restart(tmp_path):
    with Runtime(model=None, cache_dir=tmp_path, backoff=FAST) as rt:
        alice = rt.spawn("alice", system="You are Alice.")
        r1 = alice.ask("One.", max_tokens=4)
        old = rt._env.refs["alice"]
        with stalled_batcher(rt):
            t0 = time.monotonic()
            with pytest.raises(TurnTimeout) as timeout:
                alice.ask("Hang.", max_tokens=4, timeout=0.2)
            assert time.monotonic() - t0 < 5  # the watchdog, not the caller's own wait
            assert timeout.value.turn_id and timeout.value.turn_id.startswith("alice-")
        assert alice.result(timeout.value.turn_id) is None  # dropped at the batcher's next step
        r2 = alice.ask("Two.", max_tokens=4)
        assert rt._env.refs["alice"] is old and r2.cache == "hot"  # no crash, no restart
        h = alice.history()
        assert turn_ids(h) == [r1.turn_id] * 2 + [r2.turn_id] * 2
        assert "Hang." not in [x["text"] for x in h]


def test_timeouts_longer_than_any_wait_mean_no_limit_and_leave_the_watchdog_running(tmp_path):
    """A turn sent with timeout=1e10 (valid: finite and > 0) put a deadline past threading.TIMEOUT_MAX on the
    shared watchdog thread, whose wait overflowed and killed it: no turn of any agent timed out after that.
    Waits the caller makes with such timeouts (a reply, a result, a flush, the engine's stats) overflowed too."""
    with Runtime(model=None, cache_dir=tmp_path, backoff=FAST) as rt:
        alice = rt.spawn("alice", system="You are Alice.", timeout=1e10)
        first = alice.send("One.", max_tokens=4, timeout=1e10)
        assert first.get(timeout=1e10).text is not None
        assert alice.result(first.turn_id, timeout=1e10) is not None
        assert list(alice.stream("Two.", max_tokens=2, timeout=1e10))[-1].cache == "hot"
        rt.flush(timeout=1e10)
        rt.engine_stats(timeout=1e10)
        with stalled_batcher(rt):
            with pytest.raises(TurnTimeout):
                alice.ask("Hang.", max_tokens=4, timeout=0.2)  # the watchdog still answers
        assert rt.forget("alice", timeout=1e300)


def test_calls_that_wait_for_the_engine_refuse_inside_a_turns_callback_and_send_works_there(tmp_path):
    """Callbacks run on the engine's thread: an ask (or shutdown, engine_stats, stop, a stream) there waited for the
    engine it was blocking, every agent with it, until a timeout. It now raises WaitsInCallback at once; send
    returns."""
    from runtime import WaitsInCallback

    with Runtime(model=None, cache_dir=tmp_path, backoff=FAST) as rt:
        alice, bob = rt.spawn("alice", system="You are Alice."), rt.spawn("bob", system="You are Bob.")
        seen, sent, polled = [], [], []

        def on_token(piece):
            if seen:
                return
            for call in (lambda: bob.ask("Asked in a callback.", max_tokens=2, timeout=5), rt.engine_stats,
                         rt.shutdown, bob.stop, lambda: rt.forget("bob"),
                         lambda: list(bob.stream("Streamed in a callback.", max_tokens=2, timeout=5)),
                         lambda: bob.result("bob-000000000000")):
                try:
                    call()
                    seen.append(None)
                except WaitsInCallback as e:
                    seen.append(str(e))
            sent.append(bob.send("Hello from a callback.", max_tokens=2))
            try:
                sent[0].get(timeout=0)  # a poll is not a wait: the reply is not there yet
            except TurnTimeout:
                polled.append(True)

        t0 = time.monotonic()
        reply = alice.ask("Talk.", max_tokens=4, on_token=on_token, timeout=60)
        assert time.monotonic() - t0 < 30 and reply.text is not None
        assert len(seen) == 7 and all(s and "callback" in s for s in seen), seen
        assert polled == [True]
        assert sent[0].get(timeout=60).agent == "bob"  # read outside the callback
        # the refused calls sent nothing: only the send's turn reached bob
        assert [r["text"] for r in bob.history() if r["role"] == "user"] == ["Hello from a callback."]
        assert rt.running() == ["alice", "bob"] and bob.ask("Still there?", max_tokens=2).text is not None


def test_a_done_callback_that_would_wait_on_its_agent_raises_and_send_chains_the_next_turn(tmp_path):
    """A reply future's done callback runs on the agent's thread: an ask there waited for that very thread, and
    the agent hung until the ask's timeout (forever without one). It now raises WaitsInCallback at once; send
    chains the next turn."""
    from runtime import WaitsInCallback

    with Runtime(model=None, cache_dir=tmp_path, backoff=FAST) as rt:
        alice = rt.spawn("alice", system="You are Alice.")
        seen, chained, called = [], [], threading.Event()

        def follow_up(future):
            try:
                alice.ask("And then?", max_tokens=2, timeout=None)
                seen.append(None)
            except WaitsInCallback as e:
                seen.append(str(e))
            chained.append(alice.send("Chained.", max_tokens=2))
            called.set()

        first = alice.send("First.", max_tokens=2, timeout=60)
        first.add_done_callback(follow_up)
        assert first.get(timeout=60).text is not None
        t0 = time.monotonic()
        assert called.wait(60)  # the callbacks run after the value is set, on the agent's thread
        assert chained[0].get(timeout=60).text is not None and time.monotonic() - t0 < 30
        assert seen and "done callback" in seen[0]
        assert [r["text"] for r in alice.history() if r["role"] == "user"] == ["First.", "Chained."]


def in_the_callback_of_a_stop(rt, agent, calls):
    """Run each of `calls` (name: function) in the done callback of `agent`'s turn, which `agent.stop()` fails on the
    agent's own thread (the batcher holds the turn): (what each call gave or raised, the requests left unanswered at
    the supervisor after each, the turn's future)."""
    seen, asked = {}, {}

    def done(future):
        for what, call in calls.items():
            try:
                seen[what] = call()
            except Exception as e:  # noqa: BLE001 - recorded for the caller's asserts
                seen[what] = e
            asked[what] = pykka_compat.queued(rt._supervisor)  # a request the supervisor could not answer yet

    with stalled_batcher(rt):
        future = agent.send("Hello there.", max_tokens=4)
        future.add_done_callback(done)
        agent.stop()
    return seen, asked, future


def test_a_done_callback_of_an_agent_being_stopped_is_answered_without_its_supervisor(tmp_path):
    """`stop` has the supervisor wait for the agent's thread, and that thread fails the turn in flight
    (AgentStopped) and runs the turn's done callbacks. There `rt.agent` of that very agent, `broadcast` to it,
    `running()` and `agents()` asked the supervisor, which could not answer before the callback returned: each
    gave its answer only after a 10 s timeout. An agent being stopped is not running, which the Runtime knows
    without asking: no request is left queued for the supervisor."""
    with Runtime(model=None, cache_dir=tmp_path) as rt:
        a, b = rt.spawn("a", system="You are A."), rt.spawn("b", system="You are B.")
        calls = {"agent": lambda: rt.agent("a"), "broadcast": lambda: rt.broadcast([a], "Hi.", max_tokens=1),
                 "running": rt.running, "agents": lambda: [(i.name, i.running) for i in rt.agents()]}
        seen, asked, future = in_the_callback_of_a_stop(rt, a, calls)
        assert asked == dict.fromkeys(calls, 0), asked
        for what in ("agent", "broadcast"):
            assert isinstance(seen[what], UnknownAgent) and "no running agent named 'a'" in str(seen[what])
        assert seen["running"] == ["b"] and seen["agents"] == [("a", False), ("b", True)]
        with pytest.raises(AgentStopped):
            future.get(timeout=0)
        assert rt.running() == ["b"] and b.ask("Still there?", max_tokens=2).agent == "b"


def test_a_done_callback_spawns_an_agent(tmp_path):
    """A reply's done callback runs on its agent's thread; a spawn there works: the supervisor it waits for does not
    wait for that thread."""
    with Runtime(model=None, cache_dir=tmp_path) as rt:
        a = rt.spawn("a", system="You are A.")
        spawned, called = [], threading.Event()

        def done(future):
            spawned.append((threading.current_thread() is threading.main_thread(), rt.spawn("b", system="You are B.")))
            called.set()

        with stalled_batcher(rt):  # the turn is in flight: its callback runs on the agent's thread, not here
            future = a.send("Hello there.", max_tokens=2)
            future.add_done_callback(done)
        assert future.get(timeout=60).agent == "a" and called.wait(60)
        on_main, b = spawned[0]
        assert not on_main and b.ask("Hi.", max_tokens=2).agent == "b" and rt.running() == ["a", "b"]


def test_a_spawn_in_the_done_callback_of_an_agent_being_stopped_raises_at_once(tmp_path):
    """stop() has the supervisor wait for the agent's thread, which fails the turn in flight and runs its done
    callbacks. A spawn there waited for that supervisor: callback and stop hung 60 s each, then pykka.Timeout got
    out of both. The spawn raises WaitsInCallback at once, before it asks the supervisor anything (a spawn of the
    agent being stopped too, whose name the stop holds), and the stop returns."""
    from runtime import WaitsInCallback

    with Runtime(model=None, cache_dir=tmp_path) as rt:
        a = rt.spawn("a", system="You are A.")
        rt.spawn("b", system="You are B.")
        spawns = {name: lambda name=name: rt.spawn(name) for name in ("c", "a")}
        seen, asked, future = in_the_callback_of_a_stop(rt, a, spawns)
        assert asked == {"c": 0, "a": 0}, asked
        for name in ("c", "a"):
            assert isinstance(seen[name], WaitsInCallback), seen[name]
            assert f"spawn() of agent {name!r}" in str(seen[name]) and "stopping agent 'a'" in str(seen[name])
        with pytest.raises(AgentStopped):
            future.get(timeout=0)
        assert rt.running() == ["b"] and "c" not in rt._env.refs
        assert rt.spawn("c").ask("Hi.", max_tokens=2).agent == "c"  # outside the callback it starts


def test_a_queued_turn_whose_deadline_passed_before_it_started_never_runs(tmp_path):
    """The timeout counts from send: a turn stuck behind its agent's earlier work times out
    there, and is dropped when its turn comes, not run for a caller who stopped waiting."""
    with Runtime(model=None, cache_dir=tmp_path, backoff=FAST) as rt:
        alice = rt.spawn("alice", system="You are Alice.")
        old = rt._env.refs["alice"]
        with stalled_batcher(rt):
            first = alice.send("One.", max_tokens=4, timeout=None)  # in progress, held by the batcher
            late = alice.send("Late.", max_tokens=4, timeout=0.2)  # queued behind it
            with pytest.raises(TurnTimeout, match="did not start"):
                late.get(timeout=30)
        r1 = first.get(timeout=60)
        r2 = alice.ask("Two.", max_tokens=4)
        assert alice.result(late.turn_id) is None
        assert [x["text"] for x in alice.history() if x["role"] == "user"] == ["One.", "Two."]
        assert rt._env.refs["alice"] is old and r2.cache == "hot" and r1.turn_id != r2.turn_id  # no crash, no restart


def test_memory_durability(tmp_path):
    with Runtime(model=None, cache_dir=tmp_path, durability="memory") as rt:
        alice = rt.spawn("alice", system="You are Alice.")
        replies = [alice.ask(t, max_tokens=4) for t in ("One.", "Two.")]
        assert [r.cache for r in replies] == ["cold", "hot"]
    with Runtime(model=None, cache_dir=tmp_path, durability="memory") as rt:
        alice = rt.spawn("alice", system="You are Alice.")
        assert turn_ids(alice.history()) == [t for r in replies for t in (r.turn_id, r.turn_id)]
        assert alice.ask("Three.", max_tokens=4).cache == "warm"
    with pytest.raises(ValueError):
        Runtime(model=None, cache_dir=tmp_path, durability="eventually")


# -- the stateful model ---------------------------------------------------------------

NAMES = ("ann", "ben")


class AgentsMachine(RuleBasedStateMachine):
    """Spawn / turn / crash / stop / restart the runtime, against a model of acknowledged turns."""

    def __init__(self):
        super().__init__()
        self.dir = Path(tempfile.mkdtemp(prefix="kvactors-agents-sm-"))
        self.rt = self._runtime()
        self.running: dict[str, AgentRef] = {}
        self.acked: dict[str, list[tuple]] = {n: [] for n in NAMES}  # (turn_id, sender, text, reply text)
        self.crashed: set[str] = set()
        self.notes: dict[str, list[str]] = {n: [] for n in NAMES}  # replies received by send_to
        self.counter = 0

    def _runtime(self):
        return Runtime(model=None, cache_dir=self.dir, max_restarts=1000, backoff=FAST)

    def _text(self):
        self.counter += 1
        return f"m{self.counter}."

    def _turn(self, name, sender=None):
        text = self._text()
        r = self.running[name].ask(text, max_tokens=4, sender=sender, timeout=60)
        assert r.agent == name
        self.acked[name].append((r.turn_id, sender, text, r.text))

    @initialize()
    def spawn_ann(self):
        self.running["ann"] = self.rt.spawn("ann", system="You are ann.")

    @rule(name=st.sampled_from(NAMES))
    def spawn(self, name):
        if name in self.running:
            with pytest.raises(ValueError):
                self.rt.spawn(name, system=f"You are {name}.")
        else:
            self.running[name] = self.rt.spawn(name, system=f"You are {name}.")

    @rule(name=st.sampled_from(NAMES), sender=st.sampled_from([None, *NAMES]))
    def turn(self, name, sender):
        if name in self.running:
            self._turn(name, sender)
        else:
            with pytest.raises(UnknownAgent):
                AgentRef(self.rt, name).ask(self._text(), max_tokens=4)

    @precondition(lambda self: len(self.running) == 2)
    @rule(src=st.sampled_from(NAMES))
    def send_to(self, src):
        dst = next(n for n in NAMES if n != src)
        text = self._text()
        r = self.running[src].send_to(self.running[dst], text, max_tokens=4, timeout=60).get(timeout=65)
        assert r.agent == dst
        self.acked[dst].append((r.turn_id, src, text, r.text))
        self.notes[src].append(r.text)

    @precondition(lambda self: self.running)
    @rule(data=st.data())
    def crash_then_turn(self, data):
        name = data.draw(st.sampled_from(sorted(self.running)))
        inject_crash(self.running[name])
        with pytest.raises(AgentCrashed) as crash:
            self.running[name].ask(self._text(), max_tokens=4)
        assert crash.value.turn_id
        self.crashed.add(crash.value.turn_id)
        self._turn(name)

    @precondition(lambda self: self.running)
    @rule(data=st.data())
    def stop(self, data):
        name = data.draw(st.sampled_from(sorted(self.running)))
        self.running.pop(name).stop()

    @rule()
    def restart_runtime(self):
        self.rt.shutdown()
        for name in NAMES:  # every note was flushed at the shutdown
            notes = [r for r in journal(self.dir, self.rt, name) if r["role"] == "user" and r["turn_id"] is None]
            assert [r["text"] for r in notes] == self.notes[name]
        self.rt = self._runtime()
        self.running = {name: self.rt.spawn(name, system=f"You are {name}.") for name in self.running}
        for name, ref in self.running.items():
            assert [t for t in turn_ids(ref.history())] == [t for a in self.acked[name] for t in (a[0], a[0])]

    @invariant()
    def acknowledged_turns_are_durable_once_and_in_order(self):
        for name in NAMES:
            records = journal(self.dir, self.rt, name)
            assert [r["seq"] for r in records] == sorted({r["seq"] for r in records})
            ids = turn_ids(records)
            by_turn = {}
            for r in records:
                if r["turn_id"] is not None:
                    by_turn.setdefault(r["turn_id"], []).append(r)
            # no turn applied twice: exactly one user and one assistant record per turn id
            assert all([x["role"] for x in rs] == ["user", "assistant"] for rs in by_turn.values()), by_turn
            assert not self.crashed & set(ids)
            # every acknowledged turn, with its sender and text, in acknowledgement order
            assert list(dict.fromkeys(ids)) == [a[0] for a in self.acked[name]]
            for turn_id, sender, text, reply in self.acked[name]:
                user, assistant = by_turn[turn_id]
                assert (user["sender"], user["text"], assistant["text"]) == (sender, text, reply)
            for sender in (None, *NAMES):  # per-sender order
                sent = [int(r["text"][1:-1]) for r in records if r["role"] == "user" and r["sender"] == sender
                        and r["turn_id"] is not None]
                assert sent == sorted(sent)

    @invariant()
    def one_live_actor_per_name(self):
        counts = live_agents(self.rt._env)
        assert all(n == 1 for n in counts.values()), counts
        assert set(counts) <= set(self.running)
        assert sorted(self.rt.running()) == sorted(self.running)

    def teardown(self):
        self.rt.shutdown()
        shutil.rmtree(self.dir, ignore_errors=True)


AgentsMachine.TestCase.settings = settings(
    max_examples=8, stateful_step_count=10, deadline=None, suppress_health_check=list(HealthCheck)
)
test_agents_state_machine = AgentsMachine.TestCase


FORGETFUL = """
import sys
from runtime import Runtime
rt = Runtime(cache_dir=sys.argv[1])          # never shut down
print(rt.spawn("forgetful").ask("hello", max_tokens=4).cache)
"""


def test_a_runtime_never_shut_down_neither_hangs_nor_loses_its_turns(tmp_path):
    script = tmp_path / "forgetful.py"
    script.write_text(FORGETFUL)
    states = []
    for _ in range(2):
        out = subprocess.run([sys.executable, str(script), str(tmp_path / "agents")], capture_output=True,
                             text=True, timeout=120, env=os.environ.copy())
        assert out.returncode == 0, out.stderr
        states.append(out.stdout.split()[-1])
    assert states == ["cold", "warm"]  # the exit flushed the first run's cache to disk


def test_two_runtimes_on_one_cache_dir_is_a_clear_error(tmp_path):
    from runtime.store import CacheDirInUse

    with Runtime(cache_dir=tmp_path) as rt:
        rt.spawn("solo").ask("hi", max_tokens=2)
        with pytest.raises(CacheDirInUse, match="in use by another Runtime"):
            Runtime(cache_dir=tmp_path)
    with Runtime(cache_dir=tmp_path) as rt:  # released by the shutdown
        assert rt.spawn("solo").ask("again", max_tokens=2).cache == "warm"


def test_sliding_window_agent_resumes_warm_from_a_bounded_cache(tmp_path, tiny_model_path):
    path = tiny_model_path("gemma3_text")
    system = " ".join(f"rule{i}" for i in range(250))  # past the window (64) + slack (256)

    def run(folder, restart_before):
        rt = Runtime(model=path, cache_dir=tmp_path / folder)
        agent, out = rt.spawn("sw", system=system), []
        for i, question in enumerate(["first?", "second?", "third?"]):
            if i == restart_before:
                rt.shutdown()
                rt = Runtime(model=path, cache_dir=tmp_path / folder)
                agent = rt.spawn("sw")
            r = agent.ask(question, max_tokens=6)
            out.append((r.tokens, r.cache))
        spec = rt.spec
        rt.shutdown()
        return out, spec

    whole, _ = run("whole", None)
    split, spec = run("split", 2)
    assert [t for t, _ in split] == [t for t, _ in whole]
    assert [c for _, c in split] == ["cold", "hot", "warm"]
    host, _ = store.load_cache(tmp_path / "split", spec, "sw")
    assert host.n_tokens > 400
    assert sorted(set(host.lengths)) == [64 + 256, host.n_tokens]  # sliding layers bounded, full ones not


def test_runtime_warmup_then_a_normal_turn(tmp_path, capsys):
    with Runtime(model=None, cache_dir=tmp_path, warmup=True, max_batch=2) as rt:
        assert "warming up" in capsys.readouterr().err
        assert rt.spawn("w").ask("hello after warming up", max_tokens=4).cache == "cold"


def test_agents_lists_the_stored_and_the_running_ones_with_turns_and_cache(tmp_path):
    from runtime import AgentInfo, RuntimeClosed

    with Runtime(cache_dir=tmp_path) as rt:
        alice = rt.spawn("alice", system="You are Alice.")
        alice.ask("one", max_tokens=2)
        alice.ask("two", max_tokens=2)
        rt.spawn("bob").ask("hi", max_tokens=2)
        rt.agent("bob").stop()
        assert rt.agents() == [AgentInfo("alice", True, 2, "hot"), AgentInfo("bob", False, 1, "warm")]
    with Runtime(cache_dir=tmp_path, hot_budget=0) as rt:  # a fresh Runtime over a populated folder
        assert rt.agents() == [AgentInfo("alice", False, 2, "warm"), AgentInfo("bob", False, 1, "warm")]
        rt.spawn("zed")  # running, nothing stored yet
        assert rt.agents()[-1] == AgentInfo("zed", True, 0, "none")
        rt.agent("zed").ask("hi", max_tokens=2)  # hot_budget=0: the cache goes straight to disk
        assert rt.agents()[-1] == AgentInfo("zed", True, 1, "warm")
        rt.forget("bob")
        assert [a.name for a in rt.agents()] == ["alice", "zed"] and rt.running() == ["zed"]
    with Runtime(cache_dir=tmp_path) as rt:
        rt.spawn("alice").ask("three", max_tokens=2)
        rt.spawn("zed", reset=True)
        assert rt.agents() == [AgentInfo("alice", True, 3, "hot"), AgentInfo("zed", True, 0, "none")]
        with pytest.raises(dataclasses.FrozenInstanceError):
            rt.agents()[0].turns = 0
    for call in (rt.agents, rt.engine_stats):  # engine_stats had raised pykka's ActorDeadError
        with pytest.raises(RuntimeClosed):
            call()


@pytest.mark.skipif(not os.path.isdir("/proc/self/task"), reason="watches OS threads through /proc (Linux)")
def test_shutdown_returns_after_the_engine_thread_is_gone_down_to_its_os_thread(tmp_path):
    """MLX frees a thread's compile cache after Python is done with the thread, taking the GIL:
    a program that exits right after shutdown() must not race it (it would abort at exit)."""
    rt = Runtime(cache_dir=tmp_path)
    rt.spawn("a").ask("hello", max_tokens=2)
    thread = rt._env.batcher().proxy().thread.get(timeout=10)
    assert os.path.isdir(f"/proc/self/task/{thread.native_id}")
    interval = sys.getswitchinterval()
    sys.setswitchinterval(30)  # this thread keeps the GIL unless it waits: the race, made certain
    try:
        rt.shutdown()
        gone = not os.path.exists(f"/proc/self/task/{thread.native_id}")
    finally:
        sys.setswitchinterval(interval)
    assert not thread.is_alive() and gone


def test_kv_group_size_is_a_runtime_option_and_a_cache_of_another_group_is_re_prefilled(tmp_path):
    with Runtime(model=None, cache_dir=tmp_path, kv_group_size=32) as rt:
        first = rt.spawn("alice", system="You are Alice.").ask("Hello.", max_tokens=4)
        rt.flush()  # the cache file follows the ack
        host, meta = store.load_cache(tmp_path, rt.spec, "alice")
    assert rt.spec.kv_group_size == 32 and host.group_size == 32
    with Runtime(model=None, cache_dir=tmp_path) as rt:  # the default group, 64: the stored cache does not fit
        again = rt.spawn("alice", system="You are Alice.").ask("Hello again.", max_tokens=4)
    assert first.cache == "cold" and again.cache == "cold"  # re-prefilled from the journal, nothing lost
    with pytest.raises(ValueError, match="kv_group_size"):
        Runtime(model=None, cache_dir=tmp_path / "x", kv_group_size=48)


def test_an_unknown_agents_message_names_at_most_ten_running_agents():
    """A runtime may run thousands of agents: the UnknownAgent for a missing one names the first ten running and
    counts the rest, and says when none runs."""
    from runtime.api.facade import not_running

    names = [f"agent-{i}" for i in range(10_000)]
    message = str(not_running("ghost", names))
    assert "'agent-0', 'agent-1'" in message and "'agent-9' and 9990 more" in message and "agent-10'" not in message
    assert len(message) < 300
    assert "running: none" in str(not_running("ghost", []))
    assert str(not_running("ghost", ["a", "b"])).endswith("running: 'a', 'b'")
