"""The agent API beside ask: reset, notes, forget, cancel, and the tokens a cache served."""

import pytest

from runtime import Runtime
from runtime.store import InvalidAgentId


def turns(history):
    return [(r["role"], r["text"]) for r in history if r["role"] != "system"]


def test_reset_replaces_the_history_keeps_the_cache_and_survives_a_restart(tmp_path):
    with Runtime(cache_dir=tmp_path) as rt:
        a = rt.spawn("resettable", system="be brief")
        first = a.ask("one", max_tokens=3)
        assert first.cache == "cold" and first.reused_tokens == 0
        second = a.ask("two", max_tokens=3)
        assert second.cache == "hot" and second.reused_tokens > 0
        assert second.reused_tokens + second.timings.prefill_tokens > first.timings.prefill_tokens
        # Start over with the last reply edited: the cache still serves the common prefix (DIVERGE).
        edited = [("user", "one"), ("assistant", first.text), ("user", "two"), ("assistant", "edited")]
        assert a.reset([{"role": r, "text": t} for r, t in edited]).get(timeout=30) is None
        assert turns(a.history()) == edited
        again = a.ask("three", max_tokens=3)
        assert again.cache == "hot" and again.reused_tokens > 0
        a.reset([], system="a new persona").get(timeout=30)
        assert a.history()[0] == {**a.history()[0], "role": "system", "text": "a new persona"}
        assert turns(a.history()) == []
    with Runtime(cache_dir=tmp_path) as rt:
        history = rt.spawn("resettable", system="ignored: the stored one wins").history()
        assert history[0]["text"] == "a new persona" and turns(history) == []


def test_reset_refuses_malformed_records_in_the_caller(tmp_path):
    with Runtime(cache_dir=tmp_path) as rt:
        a = rt.spawn("strict")
        for bad in ([{"role": "system", "text": "x"}], [{"role": "user"}], [{"role": "user", "text": "x", "sender": 3}]):
            with pytest.raises(ValueError):
                a.reset(bad)
        with pytest.raises(ValueError):
            a.note("")


def test_notes_join_the_history_before_the_next_turn(tmp_path):
    with Runtime(cache_dir=tmp_path) as rt:
        a = rt.spawn("listener")
        a.note("first")
        a.note("second", sender="bob")
        a.ask("third", max_tokens=2)
        assert [(r["role"], r["text"], r["sender"]) for r in a.history()][:3] == [
            ("user", "first", None), ("user", "second", "bob"), ("user", "third", None)]


def test_forget_deletes_a_stored_agent(tmp_path):
    with Runtime(cache_dir=tmp_path) as rt:
        rt.spawn("ephemeral", system="s").ask("hello", max_tokens=2)
        assert rt.stored("ephemeral")
        assert rt.forget("ephemeral") is True
        assert not rt.stored("ephemeral") and "ephemeral" not in rt.agents()
        assert rt.forget("ephemeral") is False
        with pytest.raises(InvalidAgentId):
            rt.forget("../escape")
        assert turns(rt.spawn("ephemeral").history()) == []


def test_a_question_asked_again_after_a_reset_reuses_the_cache(tmp_path):
    # The new prompt is a prefix of the cached text ending at a token boundary: nothing new
    # to feed, so the last prompt token is fed again (it used to crash the agent).
    with Runtime(cache_dir=tmp_path) as rt:
        a = rt.spawn("again", system="s")
        first = a.ask("the same question", max_tokens=3)
        a.reset([]).get(timeout=30)
        second = a.ask("the same question", max_tokens=3)
        assert second.cache == "hot" and second.timings.prefill_tokens == 1
        assert second.reused_tokens + 1 == first.timings.prefill_tokens
        assert second.text == first.text


def test_a_cancelled_turn_ends_at_its_next_token_and_is_stored(tmp_path):
    with Runtime(cache_dir=tmp_path) as rt:
        a = rt.spawn("impatient")
        r = a.ask("go on and on", max_tokens=500, cancel=lambda: True)
        assert r.finish_reason == "cancelled" and len(r.tokens) == 1
        assert a.history()[-1]["text"] == r.text
        assert a.ask("next", max_tokens=2).cache == "hot"
        with pytest.raises(TypeError):
            a.send("x", cancel=True)
