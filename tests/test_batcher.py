"""BatcherActor: turns by message, interleaved steps, clean stop, crash containment."""

import threading

import pykka
import pytest

from actors.batcher import BatcherActor, BatcherCrashed, BatcherStopped, submit
from runtime.engine import Engine, Turn, TurnTooLarge
from runtime.model import ModelCacheSpec


@pytest.fixture(scope="module")
def llama(tiny_model_path, load_tiny):
    model, tokenizer = load_tiny("llama")
    return model, tokenizer, ModelCacheSpec.from_model(model, tiny_model_path("llama"))


@pytest.fixture
def batcher(llama):
    ref = BatcherActor.start(*llama)
    yield ref
    ref.stop()


def turns(tokenizer, n, max_tokens=16):
    return [
        Turn(f"t{i}", f"a{i}", None, tokenizer.encode("message " * (i + 2), add_special_tokens=False), max_tokens=max_tokens)
        for i in range(n)
    ]


def solo(llama, turn):
    engine = Engine(*llama)
    engine.submit(turn)
    out = []
    while engine.has_work():
        out += engine.step()
    return out[0]


def test_concurrent_turns_by_message_equal_solo(llama, batcher):
    ts = turns(llama[1], 4)
    futures = [submit(batcher, t) for t in ts]
    for t, f in zip(ts, futures):
        assert f.get(timeout=60).tokens == solo(llama, t).tokens


def test_submits_interleave_with_steps(llama, batcher):
    long_turn, short_turn = turns(llama[1], 2, max_tokens=200)
    short_turn.max_tokens = 3
    first_piece = threading.Event()
    long_turn.on_token = lambda piece: first_piece.set()
    f_long = submit(batcher, long_turn)
    assert first_piece.wait(30)
    f_short = submit(batcher, short_turn)
    short = f_short.get(timeout=60)
    with pytest.raises(pykka.Timeout):
        f_long.get(timeout=0)  # the long turn is still decoding: the short one joined it
    assert len(f_long.get(timeout=60).tokens) == 200
    assert short.tokens == solo(llama, short_turn).tokens


def test_stop_fails_in_flight_and_queued_turns(llama):
    ref = BatcherActor.start(*llama, max_batch=1)
    ts = turns(llama[1], 3, max_tokens=400)
    futures = [submit(ref, t) for t in ts]
    ref.stop()
    for f in futures:
        try:
            f.get(timeout=30)  # a turn may have finished before the stop
        except BatcherStopped as e:
            assert e.turn_id.startswith("t")
    with pytest.raises(BatcherStopped, match="not running"):
        submit(ref, ts[0]).get(timeout=5)


def test_too_large_turn_fails_at_once(llama):
    ref = BatcherActor.start(*llama, memory_budget=1000)
    try:
        with pytest.raises(TurnTooLarge):
            submit(ref, turns(llama[1], 1)[0]).get(timeout=10)
    finally:
        ref.stop()


def test_crash_inside_the_actor_fails_turns_clearly(llama):
    model, tokenizer, spec = llama

    def exploding_model(*args, **kwargs):
        raise SystemError("injected fault outside any turn")

    ref = BatcherActor.start(model, tokenizer, spec)
    f = submit(ref, turns(tokenizer, 1, max_tokens=50)[0])
    f.get(timeout=30)  # the engine works
    # A fault the engine does not own (the step loop itself) crashes the actor:
    ref.proxy().engine.get().step = exploding_model
    f2 = submit(ref, turns(tokenizer, 1)[0])
    with pytest.raises(BatcherCrashed, match="injected fault"):
        f2.get(timeout=30)
    assert not ref.is_alive()
    with pytest.raises(BatcherStopped):
        submit(ref, turns(tokenizer, 1)[0]).get(timeout=5)
    assert pykka.ActorRegistry.get_by_class(BatcherActor) == []
