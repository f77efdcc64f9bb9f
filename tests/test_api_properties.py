"""The public API under random options: an invalid call is refused in the caller, a valid one never crashes an actor.

`Runtime(...)`, `rt.spawn(...)` and `AgentRef.send/ask/stream` get options drawn at
random, valid and invalid. Whether a call is valid is decided by the oracles here,
written from the README's API section, apart from the code they check. An invalid
call must raise ValueError or TypeError in the caller's thread before anything
happens: `Runtime` takes no thread and creates no cache folder, `spawn` starts no
actor, `send` delivers nothing to an agent. A valid call must work, and no actor may
crash or restart (the agents, the batcher and the persistence actor stay the same
actors, and supervision never escalates).
"""

from __future__ import annotations

import math
import threading
import uuid

import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from actors.supervisor import Backoff
from runtime import Runtime, SystemPromptChanged, TurnTimeout, TurnTooLarge, WaitTimeout, qgemv

FAST = Backoff(min=0.001, max=0.02, reset=10.0)
SETTINGS = dict(deadline=None, suppress_health_check=list(HealthCheck))
ANY = st.one_of(st.none(), st.booleans(), st.text(max_size=3), st.floats(allow_nan=True), st.integers(-3, 3),
                st.lists(st.integers(), max_size=1))


def is_int(x) -> bool:
    """An int that is not a bool."""
    return isinstance(x, int) and not isinstance(x, bool)


def is_real(x) -> bool:
    """A finite int or float that is not a bool."""
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


# -- Runtime(...) ------------------------------------------------------------------

def options(table: dict, required: tuple = ()) -> st.SearchStrategy:
    """Option dicts from `table` (name -> (valid values, invalid values)): half of them valid throughout.

    Keys in `required` are always present, the others only sometimes.
    """
    def draw(pick):
        return st.fixed_dictionaries({k: pick(*table[k]) for k in required},
                                     optional={k: pick(*v) for k, v in table.items() if k not in required})

    return st.one_of(draw(lambda good, bad: good), draw(lambda good, bad: st.one_of(good, bad, ANY)))


RUNTIME_OPTIONS = options({
    "kv_bits": (st.sampled_from([None, 4, 8]), st.sampled_from([3, 4.0, "4", True])),
    "kv_group_size": (st.sampled_from([None, 32, 64]), st.sampled_from([48, 16, 64.0, "64", True])),
    "memory_budget": (st.sampled_from([None, 1 << 30, 1, 4096]), st.sampled_from([0, -5, 2.5e9, "1G"])),
    "hot_budget": (st.sampled_from([None, 0, 1 << 20, 1 << 30]), st.sampled_from([-1, 1.5, "big"])),
    "durability": (st.sampled_from(["durable", "memory"]), st.sampled_from(["eventually", ["durable"]])),
    "max_batch": (st.integers(1, 16), st.sampled_from([0, -1, 2.0, "8"])),
    "route": (st.sampled_from([None, "quantized", "dequant", "dequant_once"]), st.sampled_from(["nope", "Quantized"])),
    "strategy": (st.sampled_from(["one_for_one", "one_for_all", "rest_for_one"]), st.sampled_from(["nope", 1])),
    "max_restarts": (st.integers(0, 5), st.sampled_from([-1, 2.5, "3"])),
    "restart_period": (st.sampled_from([5.0, 0.5, 60]), st.sampled_from([0, -1, float("inf"), float("nan"), "5"])),
    "backoff": (st.just(FAST), st.sampled_from([0.1, (0.01, 1.0)])),
    "retention_s": (st.sampled_from([None, 3600, 0.5, 0]), st.sampled_from([-1, float("nan"), float("inf"), "1h"])),
    "on_escalate": (st.sampled_from([None, print]), st.sampled_from(["print", 3])),
    "io_timeout": (st.sampled_from([60.0, 5, 1]), st.sampled_from([0, -1, 0.5, float("nan"), float("inf"), "60"])),
    "warmup": (st.sampled_from([None, False]), st.sampled_from(["yes", 1, 0])),
})


HERE_ROUTES = ("dequant", "dequant_once", "q4kernel") if qgemv.available() else ("quantized", "dequant", "dequant_once")


def runtime_valid(o) -> bool:
    """The oracle for `Runtime(**o)` (README: The API, and the Runtime's docstring)."""
    def get(key, default):
        return o.get(key, default)

    def positive_or_none(x):
        return x is None or (is_int(x) and x > 0)

    return ((get("kv_bits", None) is None or (is_int(o["kv_bits"]) and o["kv_bits"] in (4, 8)))
            and (get("kv_group_size", None) is None
                 or (is_int(o["kv_group_size"]) and o["kv_group_size"] in (32, 64, 128)))
            and positive_or_none(get("memory_budget", None))
            and (get("hot_budget", None) is None or (is_int(o["hot_budget"]) and o["hot_budget"] >= 0))
            and isinstance(get("durability", "durable"), str) and get("durability", "durable") in ("durable", "memory")
            and is_int(get("max_batch", 8)) and get("max_batch", 8) >= 1
            and (get("route", None) is None or get("route", None) in HERE_ROUTES)
            and isinstance(get("strategy", "one_for_one"), str)
            and get("strategy", "one_for_one") in ("one_for_one", "one_for_all", "rest_for_one")
            and is_int(get("max_restarts", 3)) and get("max_restarts", 3) >= 0
            and is_real(get("restart_period", 5.0)) and get("restart_period", 5.0) > 0
            and isinstance(get("backoff", FAST), Backoff)
            and (get("retention_s", None) is None or (is_real(o["retention_s"]) and o["retention_s"] >= 0))
            and (get("on_escalate", None) is None or callable(o["on_escalate"]))
            and is_real(get("io_timeout", 60.0)) and get("io_timeout", 60.0) >= 1  # shorter: agents crash-looped
            and get("warmup", None) in (None, True, False) and not is_int(get("warmup", None)))


@settings(max_examples=40, **SETTINGS)
@given(options=RUNTIME_OPTIONS)
def test_runtime_options_are_checked_before_anything_is_taken(tmp_path_factory, options):
    cache_dir = tmp_path_factory.mktemp("rt") / "agents"
    threads = set(threading.enumerate())
    if not runtime_valid(options):
        with pytest.raises((ValueError, TypeError)):
            Runtime(model=None, cache_dir=cache_dir, **options)
        assert not cache_dir.exists()  # no lock taken (it creates the folder)
        assert {t for t in threading.enumerate() if t.is_alive()} <= threads
        return
    with Runtime(model=None, cache_dir=cache_dir, **options) as rt:
        ref = rt.spawn("probe", system="You are careful.")
        before = actors_now(rt)
        try:
            assert ref.ask("Hello.", max_tokens=2).agent == "probe"
        except TurnTooLarge:  # a valid memory_budget too small for any turn: that turn's error, not a crash
            assert options["memory_budget"] < 1 << 20
        no_crash(rt, before)


# -- one Runtime for spawn and turns ----------------------------------------------------


@pytest.fixture(scope="module")
def rt(tmp_path_factory):
    """One Runtime for the module; a second crash within a minute would escalate."""
    with Runtime(model=None, cache_dir=tmp_path_factory.mktemp("api"), max_restarts=1, restart_period=60,
                 backoff=FAST) as rt:
        yield rt


def no_crash(rt, refs: dict) -> None:
    """No actor of `refs` (name -> the actor before the call) restarted, and supervision never escalated."""
    assert rt._escalation is None
    assert {name: rt._env.refs.get(name) for name in refs} == refs


def actors_now(rt) -> dict:
    """name -> the actor now behind it, for every agent and service of `rt`."""
    return {name: ref for name, ref in rt._env.refs.items()}


# -- spawn ------------------------------------------------------------------

SPAWN_OPTIONS = options({
    "name": (st.just("fresh"), st.one_of(st.sampled_from(["", "-x", "../x", "a/b", "a" * 129, "ok name", "é"]),
                                         st.text(max_size=6))),
    "system": (st.text(max_size=8), st.sampled_from([b"sys", 3])),
    "restart": (st.sampled_from(["permanent", "transient", "temporary"]), st.sampled_from(["sometimes", 1])),
    "reset": (st.booleans(), st.sampled_from(["no", 0, 1])),
    "timeout": (st.sampled_from([60.0, 30, 0.5]), st.sampled_from([0, -1, float("nan"), float("inf"), "60"])),
}, required=("name",))


def spawn_valid(o, running) -> bool:
    """The oracle for `rt.spawn(**o)` of a name not stored before (README: The API)."""
    import re

    name = o["name"]
    return (isinstance(name, str) and re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}", name) is not None
            and name not in running
            and isinstance(o.get("system", ""), str)
            and isinstance(o.get("restart", "permanent"), str)
            and o.get("restart", "permanent") in ("permanent", "transient", "temporary")
            and isinstance(o.get("reset", False), bool)
            and is_real(o.get("timeout", 60.0)) and o.get("timeout", 60.0) > 0)


SPAWNED_WITH = {}  # name -> the system prompt it is stored with, for the agents this test stored (names recur)


@settings(max_examples=60, **SETTINGS)
@given(options=SPAWN_OPTIONS)
def test_spawn_refuses_bad_options_in_the_caller_and_valid_agents_serve(rt, options):
    options = dict(options)
    if options["name"] == "fresh":
        options["name"] = f"s-{uuid.uuid4().hex[:8]}"  # never stored before: no stored prompt to differ from
    before, running = actors_now(rt), rt.running()
    if not spawn_valid(options, running):
        with pytest.raises((ValueError, TypeError)):
            rt.spawn(**options)
        assert rt.running() == running and actors_now(rt) == before  # nothing started
        no_crash(rt, before)
        return
    name, system, reset = options["name"], options.get("system", ""), options.get("reset", False)
    assume(name in SPAWNED_WITH or name not in {a.name for a in rt.agents()})  # stored by another test: unknown
    if not reset and name in SPAWNED_WITH and system not in ("", SPAWNED_WITH[name]):
        with pytest.raises(SystemPromptChanged):  # an earlier example stored it under another prompt
            rt.spawn(**options)
        assert rt.running() == running and actors_now(rt) == before
        return
    try:
        ref = rt.spawn(**options)
    except WaitTimeout:  # a wait shorter than the supervisor takes to begin a start (2e-313 s was drawn) runs out
        assert options.get("timeout", 60.0) < 1 and rt.running() == running  # and nothing was started
        no_crash(rt, before)
        return
    assert ref.ask("Hello.", max_tokens=2).agent == name
    if reset or name not in SPAWNED_WITH:
        SPAWNED_WITH[name] = system
    no_crash(rt, before)
    ref.stop()


# -- send, ask, stream ------------------------------------------------------------------

TURN_OPTIONS = options({
    "text": (st.one_of(st.text(min_size=1, max_size=12), st.sampled_from(["<|im_end|>", "\x00", "a\nb"])),
             st.sampled_from(["", b"bytes"])),
    "max_tokens": (st.integers(1, 4096), st.sampled_from([0, -1, 10**9, 4097, "3", 2.0])),
    "temperature": (st.one_of(st.sampled_from([0.0, 1]), st.floats(0, 5)),
                    st.one_of(st.floats(allow_nan=True, allow_infinity=True), st.floats(max_value=-1e-9))),
    "top_p": (st.one_of(st.sampled_from([0, 1]), st.floats(0, 1)),
              st.one_of(st.floats(-1, 0, exclude_max=True), st.floats(1.0001, 2))),
    "seed": (st.integers(0, 2**31), st.integers(-5, -1)),
    "stop": (st.one_of(st.just(()), st.text(min_size=1, max_size=3), st.lists(st.text(min_size=1, max_size=3), max_size=2)),
             st.lists(st.one_of(st.just(""), ANY), min_size=1, max_size=2)),
    "timeout": (st.one_of(st.just(60), st.none()), st.floats(allow_nan=True, allow_infinity=True)),
    "sender": (st.sampled_from([None, "bob", "x.y-z"]), st.sampled_from(["../x", "", "a b"])),
    "turn_id": (st.sampled_from([None, "order-1", "a:b.c_d-e"]), st.sampled_from(["../x", "", "a" * 129])),
    "conversation_id": (st.one_of(st.none(), st.text(max_size=4)), st.sampled_from([3, b"c"])),
    "on_token": (st.sampled_from([None, lambda piece: None]), st.sampled_from(["print", 3])),
    "cancel": (st.sampled_from([None, lambda: False]), st.sampled_from([True, "no"])),
}, required=("text",))


def turn_valid(o, positions: int) -> bool:
    """The oracle for a turn's options (README: The API, `ref.ask`)."""
    import re

    def get(key, default):
        return o.get(key, default)

    stop = get("stop", ())
    stops = [stop] if isinstance(stop, str) else stop
    timeout = get("timeout", 60.0)
    ids = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}")
    return (isinstance(o["text"], str) and o["text"] != ""
            and is_int(get("max_tokens", 128)) and 1 <= get("max_tokens", 128) < positions
            and is_real(get("temperature", 0.0)) and get("temperature", 0.0) >= 0
            and is_real(get("top_p", 1.0)) and 0 <= get("top_p", 1.0) <= 1
            and is_int(get("seed", 0)) and get("seed", 0) >= 0
            and isinstance(stops, (list, tuple)) and all(isinstance(s, str) and s for s in stops)
            and (timeout is None or (is_real(timeout) and timeout > 0))
            and (get("sender", None) is None or (isinstance(o["sender"], str) and ids.fullmatch(o["sender"]) is not None))
            and (get("turn_id", None) is None
                 or (isinstance(o["turn_id"], str) and re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9._:-]{0,127}", o["turn_id"])))
            and (get("conversation_id", None) is None or isinstance(o["conversation_id"], str))
            and all(get(k, None) is None or callable(o[k]) for k in ("on_token", "cancel")))


@settings(max_examples=150, **SETTINGS)
@given(options=TURN_OPTIONS, how=st.sampled_from(["send", "ask", "stream"]))
def test_turns_refuse_bad_options_in_the_caller_and_valid_ones_never_crash_an_actor(rt, options, how):
    name = "turns"
    ref = rt.agent(name) if name in rt.running() else rt.spawn(name, system="You are careful.")
    ref.history()  # started
    options = dict(options)
    before = actors_now(rt)
    text = options.pop("text")
    if not turn_valid({"text": text, **options}, rt.max_context):
        delivered, real = [], rt._deliver
        rt._deliver = lambda *a: delivered.append(a) or real(*a)  # a spy: nothing may reach it
        try:
            with pytest.raises((TypeError, ValueError)):
                call(ref, how, text, options)
        finally:
            del rt._deliver
        assert delivered == []
    else:
        options["max_tokens"] = min(options.get("max_tokens", 2), 3)  # keep it fast
        if options.get("timeout") is not None:
            options["timeout"] = min(options["timeout"], 60)
        if how == "stream":
            options.pop("on_token", None)  # stream takes the pieces itself (one given too is a TypeError)
        if options.get("turn_id") is not None:
            options["turn_id"] = f"{options['turn_id'][:100]}-{uuid.uuid4().hex[:8]}"  # a fresh key: the turn runs
        try:
            reply, pieces = call(ref, how, text, options)
        except TurnTimeout:
            assert options["timeout"] < 60  # a tiny timeout answers its caller; nothing crashes (no_crash below)
        else:
            assert reply.agent == name and reply.finish_reason in ("stop", "length", "cancelled")
            if how == "stream":
                assert "".join(pieces) == reply.text
    no_crash(rt, before)


def call(ref, how: str, text, options):
    """Take the turn with `how` ("send", "ask" or "stream"); return (the Reply, the streamed pieces)."""
    if how == "send":
        return ref.send(text, **options).get(timeout=120), []
    if how == "ask":
        return ref.ask(text, **options), []
    items = list(ref.stream(text, **options))
    return items[-1], items[:-1]



def test_an_int_too_long_to_print_is_refused_with_the_argument_s_own_error(tmp_path):
    """Python refuses to turn an int of more than 4,300 digits into text, so a check that formatted the bad value
    into its message raised that ValueError instead of naming the argument (max_tokens=10**5000, and so on)."""
    from runtime import InvalidArgument, Runtime

    huge = 10 ** 5000
    with Runtime(model="tiny", cache_dir=tmp_path / "a") as rt:
        agent = rt.spawn("big")
        for name in ("max_tokens", "seed", "temperature", "top_p", "timeout"):
            with pytest.raises(InvalidArgument, match=f"^{name} .*an int of about 5001 digits"):
                agent.ask("hi", **{name: huge})
        with pytest.raises(InvalidArgument, match="max_tokens must be >= 1, got an int of about 5001 digits"):
            agent.ask("hi", max_tokens=-huge)
    for name, value in (("max_batch", huge), ("max_restarts", -huge)):
        with pytest.raises(InvalidArgument, match=f"{name} .*an int of about 5001 digits"):
            Runtime(model="tiny", cache_dir=tmp_path / name, **{name: value})
