"""The agent API beside ask: reset, notes, forget, cancel, and the tokens a cache served."""

import pytest

from runtime import AgentCrashed, Runtime, SystemPromptChanged
from runtime.store import JOURNAL_FILE, InvalidAgentId, read_journal
from runtime.api.testing import inject_crash


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
        with pytest.raises(SystemPromptChanged):
            rt.spawn("resettable", system="not the stored one")
        history = rt.spawn("resettable").history()  # no prompt: resume with the stored one
        assert history[0]["text"] == "a new persona" and turns(history) == []


def test_a_reset_to_no_system_prompt_survives_a_restart(tmp_path):
    with Runtime(cache_dir=tmp_path) as rt:
        a = rt.spawn("quiet", system="You are loud.")
        a.reset([{"role": "user", "text": "hush"}], system="").get(timeout=30)
        inject_crash(a)
        with pytest.raises(AgentCrashed):
            a.ask("crash here", max_tokens=2)
        assert turns(a.history()) == [("user", "hush")]  # the restarted actor, spawned with "You are loud."
        assert rt._env.refs["quiet"].proxy().system.get(timeout=10) == ""  # the journal's prompt wins
    with Runtime(cache_dir=tmp_path) as rt:
        with pytest.raises(SystemPromptChanged):
            rt.spawn("quiet", system="You are loud.")


def test_reset_refuses_malformed_records_in_the_caller(tmp_path):
    with Runtime(cache_dir=tmp_path) as rt:
        a = rt.spawn("strict")
        for bad in ([{"role": "tool", "text": "x"}], [{"role": "user"}], [{"role": "user", "text": "x", "sender": 3}],
                    [{"role": "system", "text": 3}]):
            with pytest.raises(ValueError):
                a.reset(bad)
        with pytest.raises(ValueError, match="give one of them"):  # two prompts: which one?
            a.reset([{"role": "system", "text": "x"}], system="y")
        a.ask("Hello.", max_tokens=2)
        kept = a.history()
        a.reset(kept).get(timeout=60)  # history()'s own shape: the same conversation again
        assert [(r["role"], r["text"]) for r in a.history() if r["role"] != "system"] == [
            (r["role"], r["text"]) for r in kept if r["role"] != "system"]
        a.reset([{"role": "system", "text": "You are new."}]).get(timeout=60)
        assert [(r["role"], r["text"]) for r in a.history()] == [("system", "You are new.")]
        with pytest.raises(ValueError):
            a.note("")


def test_a_reset_to_a_conversation_no_turn_could_hold_is_refused_in_the_caller(tmp_path):
    """A reset's records all end up in the next turn's prompt. Records with more characters than the model's
    positions can spell (a long conversation brought over from a bigger model), or more records than it has
    positions, were recorded, and every later turn failed with TurnTooLong; a sender's name is rendered with its
    message and counts too. They are refused as a note and an HTTP request that could never fit are."""
    from runtime import InvalidArgument

    with Runtime(cache_dir=tmp_path) as rt:
        a = rt.spawn("crowded", system="be brief")
        a.ask("Hello.", max_tokens=2)
        before = a.history()
        half = "x" * (rt.max_context * rt.longest_token_chars // 2)
        many = [{"role": "user", "text": "m"}] * (rt.max_context - 1)
        named = [{"role": "user", "text": half, "sender": "y" * len(half)}]
        for records, says in (([{"role": "user", "text": half}, {"role": "assistant", "text": half}], "characters"),
                              (many, f"has {len(many)} messages"), (named, "characters")):
            with pytest.raises(InvalidArgument, match=says):
                a.reset(records)
        most = "x" * ((rt.max_context - 2) * rt.longest_token_chars - 10)  # fits, but not with a system prompt
        with pytest.raises(InvalidArgument, match="characters"):
            a.reset([{"role": "user", "text": most}], system="z" * 20)
        assert a.history() == before  # nothing was recorded
        a.reset([{"role": "user", "text": "x" * 100}]).get(timeout=30)  # one that fits is taken
        assert a.ask("Hi.", max_tokens=2).agent == "crowded"


def test_notes_join_the_history_before_the_next_turn(tmp_path):
    with Runtime(cache_dir=tmp_path) as rt:
        a = rt.spawn("listener")
        a.note("first")
        a.note("second", sender="bob")
        a.ask("third", max_tokens=2)
        assert [(r["role"], r["text"], r["sender"]) for r in a.history()][:3] == [
            ("user", "first", None), ("user", "second", "bob"), ("user", "third", None)]


def test_history_shows_every_note_and_turn_sent_before_it(tmp_path):
    """A note waiting behind another note's write, and a turn still running, were missing from a history() sent
    after them: `reset(history())` right after notes dropped the later ones."""
    with Runtime(cache_dir=tmp_path) as rt:
        a = rt.spawn("scribe", system="You are S.")
        a.note("first")
        a.note("second", sender="bob")
        assert turns(a.history()) == [("user", "first"), ("user", "second")]
        future = a.send("third", max_tokens=3)
        a.note("fourth")
        assert turns(a.history()) == [("user", "first"), ("user", "second"), ("user", "third"),
                                      ("assistant", future.get(timeout=60).text), ("user", "fourth")]
        a.note("fifth")
        a.note("sixth")
        a.reset(a.history()).get(timeout=60)  # the conversation as sent so far, every note in it
        assert [t for r, t in turns(a.history()) if r == "user"] == ["first", "second", "third", "fourth", "fifth",
                                                                     "sixth"]


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


def test_spawn_with_reset_deletes_the_stored_agent_and_starts_afresh(tmp_path):
    with Runtime(cache_dir=tmp_path) as rt:
        rt.spawn("phoenix", system="old self").ask("remember me", max_tokens=3)
        with pytest.raises(ValueError, match="already running"):
            rt.spawn("phoenix", reset=True)  # a running agent is never deleted under its actor
    with Runtime(cache_dir=tmp_path) as rt:
        folder = next(tmp_path.glob("*/phoenix"))
        assert (folder / "cache.safetensors").exists() and b"remember me" in (folder / JOURNAL_FILE).read_bytes()
        a = rt.spawn("phoenix", system="new self", reset=True)
        assert [(r["role"], r["text"]) for r in a.history()] == [("system", "new self")]
        assert not (folder / "cache.safetensors").exists()
        assert [r["text"] for r in read_journal(tmp_path, rt.spec, "phoenix")] == ["new self"]
        journal = (folder / JOURNAL_FILE).read_bytes()
        assert b"remember me" not in journal and b"old self" not in journal  # the old records are gone from disk
        r = a.ask("who are you?", max_tokens=3)
        assert r.cache == "cold" and r.reused_tokens == 0
        fresh = rt.spawn("newborn", reset=True)  # nothing stored: reset is harmless
        assert fresh.history() == []


def test_a_changed_system_prompt_is_refused_in_the_caller_unless_reset(tmp_path):
    with Runtime(cache_dir=tmp_path) as rt:
        rt.spawn("persona", system="You are Ann.").ask("hello", max_tokens=3)
        rt.spawn("plain").ask("hello", max_tokens=3)  # stored without a system prompt
    with Runtime(cache_dir=tmp_path) as rt:
        with pytest.raises(SystemPromptChanged, match="reset=True") as caught:
            rt.spawn("persona", system="You are Bob.")
        assert isinstance(caught.value, ValueError)
        assert (caught.value.agent, caught.value.stored, caught.value.given) == ("persona", "You are Ann.", "You are Bob.")
        assert rt.running() == [] and rt.dead_letters == []  # nothing started, no actor crashed
        # Giving a prompt to an agent stored without one would hide its history: refused too.
        with pytest.raises(SystemPromptChanged):
            rt.spawn("plain", system="You are new.")
        same = rt.spawn("persona", system="You are Ann.")  # the stored prompt: resumes
        assert same.history()[0]["text"] == "You are Ann." and len(turns(same.history())) == 2
        same.stop()
        resumed = rt.spawn("persona")
        assert resumed.ask("again", max_tokens=3).cache == "warm"
        resumed.stop()
        renamed = rt.spawn("persona", system="You are Bob.", reset=True)
        assert [(r["role"], r["text"]) for r in renamed.history()] == [("system", "You are Bob.")]
        assert len(turns(rt.spawn("plain").history())) == 2


def test_a_turn_longer_than_the_context_is_refused_and_nothing_is_recorded(tmp_path):
    from runtime import TurnTooLong

    with Runtime(cache_dir=tmp_path) as rt:
        a = rt.spawn("verbose")
        a.ask("short one", max_tokens=2)
        before = a.history()
        limit = rt.max_context
        with pytest.raises(TurnTooLong, match=str(limit)) as e:
            a.ask("word " * limit, max_tokens=2, timeout=60)
        assert e.value.turn_id and a.history() == before
        assert a.ask("and another", max_tokens=2).cache == "hot"  # the agent is unharmed, its cache kept
        seqs = [r["seq"] for r in a.history()]
        assert seqs == list(range(seqs[0], seqs[0] + len(seqs)))  # no seq was skipped by the refused turn



def test_a_reset_back_to_an_earlier_turn_answers_as_that_turn_did_hot(tmp_path):
    """After a reset to a short prefix of a long conversation, the next turn feeds the kept reply as it was
    generated (its record's tokens), as a hot turn had, whether the cache still serves part of it or the turn
    goes cold: it answers as an agent that took only those turns does (it went cold and tokenized the whole
    history from its text again)."""
    texts, follow = ["Plan a bake sale.", "Go on.", "Who bakes?", "And then?"], "What next?"
    with Runtime(cache_dir=tmp_path) as rt:
        for i in range(6):
            ref, b = rt.spawn(f"ref{i}", system=f"You are planner {i}."), rt.spawn(f"b{i}", system=f"You are planner {i}.")
            ref.ask(texts[0], max_tokens=16)
            want = ref.ask(follow, max_tokens=8)
            for t in texts:
                b.ask(t, max_tokens=16)
            b.reset([{k: r[k] for k in ("role", "text", "tokens") if k in r} for r in b.history()[1:3]]).get(timeout=30)
            got = b.ask(follow, max_tokens=8)
            assert got.tokens == want.tokens


def test_the_advice_of_system_prompt_changed_keeps_the_history_under_the_new_prompt(tmp_path):
    """SystemPromptChanged says how to keep an agent's history under a new prompt; that call, as it says it,
    works (a history() holds its system record, which reset refuses beside another system=)."""
    with Runtime(cache_dir=tmp_path) as rt:
        a = rt.spawn("persona", system="You are Ann.")
        a.ask("hello", max_tokens=3)
        kept = turns(a.history())
    with Runtime(cache_dir=tmp_path) as rt:
        with pytest.raises(SystemPromptChanged) as caught:
            rt.spawn("persona", system="You are Bea.")
        assert "ref.reset([r for r in ref.history() if r['role'] != 'system'], system=...)" in str(caught.value)
        ref = rt.spawn("persona")
        ref.reset([r for r in ref.history() if r["role"] != "system"], system="You are Bea.").get(timeout=30)
        assert ref.history()[0]["role"] == "system" and ref.history()[0]["text"] == "You are Bea."
        assert turns(ref.history()) == kept
    with Runtime(cache_dir=tmp_path) as rt:
        assert turns(rt.spawn("persona", system="You are Bea.").history()) == kept


def test_history_of_an_agent_whose_journal_cannot_be_reread_now_does_not_crash_it(tmp_path, monkeypatch):
    """history() of an agent whose journal is unreadable rereads it first (the file may have been fixed). A reread
    that fails there (a slow disk: the persistence actor's answer timed out) was logged, and history() raised the
    JournalError; queued, the request crashed the agent instead (a restart, counted toward escalation)."""
    import pykka

    from actors.agent import AgentActor
    from runtime import store

    with Runtime(cache_dir=tmp_path) as rt:
        rt.spawn("scribe", system="You are S.").stop()
        path = store.agent_dir(tmp_path, rt.spec.fingerprint, "scribe") / JOURNAL_FILE
        path.write_bytes(b"not a journal")
        a = rt.spawn("scribe")
        with pytest.raises(store.JournalError):
            a.history()
        actor = rt._env.refs["scribe"]

        def slow_disk(self):
            raise pykka.Timeout("no answer from the persistence actor within io_timeout")

        monkeypatch.setattr(AgentActor, "_load_durable", slow_disk)
        with pytest.raises(store.JournalError):
            a.history()
        assert rt._env.refs["scribe"] is actor and actor.is_alive()  # no crash, no restart


def test_history_of_a_stopped_agent_raises_unknown_agent_and_leaves_no_dead_letter(tmp_path):
    """A history request is a question, not a message for the agent: asked of an agent that is not running it
    raises UnknownAgent, as it did, and leaves nothing in `dead_letters` (which grew, with a warning logged, at
    every such call once history() became a queued request)."""
    from runtime import UnknownAgent

    with Runtime(cache_dir=tmp_path) as rt:
        a = rt.spawn("scribe", system="You are S.")
        a.note("first")
        assert turns(a.history()) == [("user", "first")]
        a.stop()
        for _ in range(3):
            with pytest.raises(UnknownAgent):
                a.history()
        assert rt.dead_letters == []
