"""The engine's step loop: batched == solo, staggered joins, budget, stops, sampling, continuation."""

import pytest

from runtime.engine import Engine, Sampling, Turn, TurnAbandoned, TurnError, TurnTooLarge
from runtime.model import ModelCacheSpec


# the CPU's defaults, and the CUDA defaults (working copy with whole-width masks,
# chunks padded to 64 tokens), so the CUDA path's bookkeeping is tested here too
PATHS = {"default": {}, "cuda-path": {"route": "dequant_once", "query_bucket": 64}}


@pytest.fixture(scope="module", params=list(PATHS))
def llama(request, tiny_model_path, load_tiny):
    model, tokenizer = load_tiny("llama")
    return model, tokenizer, ModelCacheSpec.from_model(model, tiny_model_path("llama")), PATHS[request.param]


def run(engine, turns, on_step=None):
    """Submit `turns`, step until idle; return {turn_id: result or error}."""
    for t in turns:
        engine.submit(t)
    out = {}
    while engine.has_work():
        for r in engine.step():
            out[r.turn_id] = r
        if on_step:
            on_step(engine, out)
    return out


def encode(tokenizer, text):
    return tokenizer.encode(text, add_special_tokens=False)


def with_history(engine, tokenizer, name, words):
    """A turn of agent `name` whose cache holds a first turn over `words` words."""
    first = run(engine, [Turn(f"{name}-h", name, None, encode(tokenizer, "the cat sat " * words), max_tokens=4)])
    r = first[f"{name}-h"]
    return Turn(name, name, r.cache, [r.tokens[-1]] + encode(tokenizer, " and then?"), max_tokens=24)


def solo(llama, turn):
    model, tokenizer, spec, opts = llama
    return run(Engine(model, tokenizer, spec, **opts), [turn])[turn.turn_id]


def test_four_agents_together_equal_solo(llama):
    model, tokenizer, spec, opts = llama
    engine = Engine(model, tokenizer, spec, **opts)
    turns = [with_history(engine, tokenizer, f"a{i}", w) for i, w in enumerate((1, 9, 30, 4))]
    together = run(engine, turns)
    assert engine.peak_admitted == 4
    for t in turns:
        assert together[t.turn_id].tokens == solo(llama, t).tokens
        assert together[t.turn_id].cached_tokens == t.cache[0].offset + len(t.tokens) + 23


def test_next_messages_of_several_agents_share_one_chunk_and_equal_solo(llama):
    """Agents' next messages of different lengths within one query bucket, waiting together, are prefilled
    in one chunk (right-aligned over their histories); a failing progress report fails only its own turn,
    and the rest equal solo."""
    model, tokenizer, spec, opts = llama
    opts = {**opts, "query_bucket": opts.get("query_bucket", 16)}
    engine = Engine(model, tokenizer, spec, **opts)
    turns = [with_history(engine, tokenizer, f"s{i}", w) for i, w in enumerate((30, 45, 25, 60))]
    messages = (" and then?", " why did the cat sit there for so long?", " ok", " tell me more about the mat")
    turns = [Turn(t.turn_id, t.agent_id, t.cache, t.tokens[:1] + encode(tokenizer, m), max_tokens=12)
             for t, m in zip(turns, messages)]
    assert len({len(t.tokens) for t in turns}) == 4 and max(len(t.tokens) for t in turns) <= 16
    llama = (model, tokenizer, spec, opts)  # solo with the same bucket

    def broken(done, total):
        raise ValueError("progress bar broke")

    turns[2] = Turn(turns[2].turn_id, turns[2].agent_id, turns[2].cache, turns[2].tokens, max_tokens=12,
                    on_progress=broken)
    chunks = len(engine.stats.prefill_chunks)
    together = run(engine, turns)
    assert [c[3] for c in list(engine.stats.prefill_chunks)[chunks:]] == [4]  # one chunk, four rows
    assert isinstance(together["s2"], TurnError) and "progress bar broke" in str(together["s2"])
    for t in turns[:2] + turns[3:]:
        assert together[t.turn_id].tokens == solo(llama, t).tokens
        assert together[t.turn_id].cached_tokens == t.cache[0].offset + len(t.tokens) + 11
    assert engine.reserved == 0


def test_turns_share_a_chunk_only_where_none_computes_more_padding_than_alone(llama):
    """Messages that round up to different lengths, or a message longer than one chunk, go alone."""
    model, tokenizer, spec, opts = llama
    engine = Engine(model, tokenizer, spec, **opts, max_prefill_chunk=128)
    bucket = engine.query_bucket
    turns = [with_history(engine, tokenizer, f"p{i}", 50) for i in range(4)]
    lengths = (bucket, bucket + 1, bucket, 130)  # the second rounds up further; the last takes two chunks
    turns = [Turn(t.turn_id, t.agent_id, t.cache, (t.tokens * 200)[:n], max_tokens=3) for t, n in zip(turns, lengths)]
    chunks = len(engine.stats.prefill_chunks)
    out = run(engine, turns)
    rows = sorted(c[3] for c in list(engine.stats.prefill_chunks)[chunks:])
    assert rows == [1, 1, 1, 2]  # p0 and p2 together; p1 alone; p3 in two chunks alone
    for t in turns:
        assert out[t.turn_id].tokens == solo(llama, t).tokens


def test_staggered_arrival_gets_first_token_before_others_finish(llama):
    model, tokenizer, spec, opts = llama
    engine = Engine(model, tokenizer, spec, **opts)
    early = [Turn(f"e{i}", f"e{i}", None, encode(tokenizer, "one two three " * (i + 1)), max_tokens=40) for i in range(2)]
    late = Turn("late", "late", None, encode(tokenizer, "a late arrival " * 5), max_tokens=10)
    seen = {}

    def join_late(eng, out):
        seen.setdefault("steps", 0)
        seen["steps"] += 1
        if seen["steps"] == 5:
            eng.submit(late)
        if "late_first" not in seen and any(r.turn.turn_id == "late" and r.generated for r in eng.decoding):
            seen["late_first"] = set(out)

    out = run(engine, early, join_late)
    assert seen["late_first"] == set()  # no early turn had finished yet
    assert out["late"].tokens == solo(llama, late).tokens
    for t in early:
        assert out[t.turn_id].tokens == solo(llama, t).tokens


def test_budget_for_two_admits_at_most_two(llama):
    model, tokenizer, spec, opts = llama
    probe = Engine(model, tokenizer, spec, **opts)
    turns = [Turn(f"t{i}", f"t{i}", None, encode(tokenizer, "budget " * (3 + i)), max_tokens=12) for i in range(5)]
    per_turn = max(probe.turn_bytes(t) for t in turns)
    engine = Engine(model, tokenizer, spec, **opts, memory_budget=2 * per_turn)
    peaks = []
    out = run(engine, turns, lambda eng, _: peaks.append(eng.active()))
    assert sorted(out) == [t.turn_id for t in turns]
    assert all(not isinstance(r, TurnError) for r in out.values())
    assert max(peaks) == 2 and engine.peak_admitted == 2


def test_finished_rows_stay_in_the_batch_until_they_outnumber_the_decoding_ones(llama):
    """A row that ends is handed over at once but stays in the batch (no filter, no new shape) while the
    decoding rows are at least as many; once finished rows outnumber them they are filtered out together.
    Every row's tokens and cache equal solo."""
    model, tokenizer, spec, opts = llama
    engine = Engine(model, tokenizer, spec, **opts)
    prompt = encode(tokenizer, "four rows decode together " * 3)
    turns = [Turn(f"f{i}", f"f{i}", None, prompt, max_tokens=n) for i, n in enumerate((6, 9, 12, 30))]
    out = run(engine, turns)
    rows = [s.rows for s in engine.stats.decode_steps]
    after = rows[rows.index(4):]  # from the step with all four (they join together or one by one)
    assert after == [4] * after.count(4) + [1] * after.count(1) and after.count(1) >= 30 - 12
    assert [s.changes for s in engine.stats.decode_steps].count("leave") == 1
    assert [s.ended for s in engine.stats.decode_steps if s.ended] == [1, 1, 1, 1]  # each row's last step
    for t in turns:
        alone = solo(llama, t)
        assert out[t.turn_id].tokens == alone.tokens
        assert out[t.turn_id].cached_tokens == alone.cached_tokens == len(prompt) + t.max_tokens - 1
    assert engine.reserved == 0 and not engine.has_work()


def test_finished_rows_ride_along_to_the_end_when_the_rest_end_within_a_short_tail(llama):
    """Once finished rows outnumber the decoding ones, they are still not filtered out if every decoding row
    ends within `short_tail` steps (its max_tokens; SHORT_TAIL on CUDA, 0 on CPU, where the rows' compute costs
    more than a filter): the batch keeps its shape to its end, with no filter at all. Every row's tokens and cache
    equal solo."""
    from runtime.engine import SHORT_TAIL

    model, tokenizer, spec, opts = llama
    engine = Engine(model, tokenizer, spec, **opts)
    engine.short_tail = SHORT_TAIL  # as on CUDA
    prompt = encode(tokenizer, "four rows decode together " * 3)
    last = 12 + SHORT_TAIL // 2  # the last row ends within SHORT_TAIL steps of the third, however the rows joined
    turns = [Turn(f"t{i}", f"t{i}", None, prompt, max_tokens=n) for i, n in enumerate((6, 9, 12, last))]
    out = run(engine, turns)
    rows = [s.rows for s in engine.stats.decode_steps]
    after = rows[rows.index(4):]
    assert after == [4] * len(after) and len(after) >= last - 12
    assert not [s for s in engine.stats.decode_steps if "leave" in s.changes]
    for t in turns:
        alone = solo(llama, t)
        assert out[t.turn_id].tokens == alone.tokens
        assert out[t.turn_id].cached_tokens == alone.cached_tokens == len(prompt) + t.max_tokens - 1
    assert engine.reserved == 0 and not engine.has_work()


def test_a_join_filters_out_finished_rows_in_the_same_change(llama):
    """Rows that join a batch holding a finished row replace it: the batch never computes three rows."""
    model, tokenizer, spec, opts = llama
    engine = Engine(model, tokenizer, spec, **opts)
    short = Turn("short", "short", None, encode(tokenizer, "a short turn " * 2), max_tokens=3)
    long = Turn("long", "long", None, encode(tokenizer, "a long turn " * 2), max_tokens=30)
    late = Turn("late", "late", None, encode(tokenizer, "a late turn " * 3), max_tokens=8)

    sent = []

    def submit_late(eng, out):
        if "short" in out and not sent:
            sent.append(eng.submit(late))

    out = run(engine, [short, long], submit_late)
    rows = [s.rows for s in engine.stats.decode_steps]
    assert max(rows) == 2 and rows.count(2) > 3  # short and long, then long and late: never three
    for t in (short, long, late):
        assert out[t.turn_id].tokens == solo(llama, t).tokens


def test_the_budget_counts_a_finished_row_until_a_waiting_turn_needs_its_room(llama):
    """A finished row's reservation holds while it stays in the batch; the head of the queue that needs the
    room gets it at once, before the other row ends, and the budget is never exceeded."""
    model, tokenizer, spec, opts = llama
    probe = Engine(model, tokenizer, spec, **opts)
    turns = [Turn(name, name, None, encode(tokenizer, f"turn {name} " * 3), max_tokens=n)
             for name, n in (("a", 4), ("b", 40), ("c", 6))]
    engine = Engine(model, tokenizer, spec, **opts, memory_budget=2 * max(probe.turn_bytes(t) for t in turns))
    seen = []

    def check(eng, out):
        assert eng.reserved <= eng.memory_budget
        live = {r.turn.turn_id for r in eng.decoding}
        seen.append(live)

    out = run(engine, turns, check)
    assert any({"b", "c"} <= live for live in seen)  # c decoded beside b: it did not wait for b to end
    assert max(s.rows for s in engine.stats.decode_steps) == 2
    for t in turns:
        assert out[t.turn_id].tokens == solo(llama, t).tokens


def test_turns_allocate_what_they_may_take_at_once_so_no_chunk_or_step_grows_the_buffers(llama):
    """A turn's cache is allocated for its whole prompt and every token it may generate when it is merged, and
    a batch for its rows' remaining tokens when rows join: across several 256-column blocks, no decode step
    grows the buffers, and every chunk of a turn's prompt sees one width. Tokens equal solo."""
    model, tokenizer, spec, opts = llama
    engine = Engine(model, tokenizer, spec, **opts, max_prefill_chunk=128)
    prompt = (encode(tokenizer, "grow once ") * 200)[:300]  # three chunks
    turns = [Turn(f"g{i}", f"g{i}", None, prompt[i:], max_tokens=300) for i in range(2)]  # chunks alternate
    out = run(engine, turns)
    assert not any("grow" in s.changes for s in engine.stats.decode_steps)
    assert len({shape for shape in engine.stats.shapes if shape[0] == "decode"}) <= 2  # g0 alone, then with g1
    assert len({shape[-1] for shape in engine.stats.shapes if shape[0] == "prefill"}) == 1  # every chunk: one width
    for t in turns:
        assert out[t.turn_id].tokens == solo(llama, t).tokens
        assert out[t.turn_id].cached_tokens == len(t.tokens) + t.max_tokens - 1


def test_a_row_abandoned_at_its_first_token_does_not_fail_the_batch_it_started(llama):
    """Two agents' next messages share a chunk that starts the batch; one caller gives up between the chunk's
    start and its first token: that turn is dropped, the other decodes on and equals solo."""
    model, tokenizer, spec, opts = llama
    opts = {**opts, "query_bucket": opts.get("query_bucket", 16)}
    engine = Engine(model, tokenizer, spec, **opts)
    a, b = (with_history(engine, tokenizer, name, 30) for name in ("ab0", "ab1"))
    asked = []

    def gone():  # asked when the chunk's rows are chosen, then after the first token
        asked.append(1)
        return len(asked) >= 2

    b = Turn(b.turn_id, b.agent_id, b.cache, b.tokens, max_tokens=12, abandoned=gone)
    chunks = len(engine.stats.prefill_chunks)
    out = run(engine, [a, b])
    assert [c[3] for c in list(engine.stats.prefill_chunks)[chunks:]] == [2]  # one chunk for both
    assert isinstance(out[b.turn_id], TurnAbandoned)
    assert out[a.turn_id].tokens == solo((model, tokenizer, spec, opts), a).tokens


class HeldBack:
    """The tokenizer, except that every spelled sequence ends inside a character: a turn's text is held back
    until the turn ends and flushed then (`AnchoredDetokenizer.finalize`), as a real tokenizer's byte
    tokens are when a turn ends in the middle of a character."""

    def __init__(self, tokenizer):
        self._tokenizer = tokenizer

    def decode(self, ids):
        return self._tokenizer.decode(ids) + "\ufffd" if ids else ""

    def __getattr__(self, name):
        return getattr(self._tokenizer, name)


def test_an_on_token_that_raises_on_the_flushed_last_piece_fails_its_own_turn_only(llama):
    model, tokenizer, spec, opts = llama

    def boom(piece):
        raise RuntimeError("display gone")

    engine = Engine(model, HeldBack(tokenizer), spec, **opts)
    bad = Turn("bad", "bad", None, encode(tokenizer, "the last piece breaks"), max_tokens=3, on_token=boom)
    good = Turn("good", "good", None, encode(tokenizer, "the others go on"), max_tokens=9)
    out = run(engine, [bad, good])
    assert isinstance(out["bad"], TurnError) and "display gone" in str(out["bad"])
    assert out["good"].tokens == solo(llama, good).tokens
    assert engine.reserved == 0 and not engine.has_work()


def ending_together(llama, name: str, held_back: bool = False):
    """(llama with the bucket used, an engine, three turns): agents whose next messages share one chunk, so they
    decode in step and end in one step (5 tokens each). `held_back`: the engine's tokenizer is `HeldBack`."""
    model, tokenizer, spec, opts = llama
    opts = {**opts, "query_bucket": opts.get("query_bucket", 16)}
    engine = Engine(model, HeldBack(tokenizer) if held_back else tokenizer, spec, **opts)
    turns = [with_history(engine, tokenizer, f"{name}{i}", w) for i, w in enumerate((20, 35, 50))]
    turns = [Turn(t.turn_id, t.agent_id, t.cache, t.tokens[:1] + encode(tokenizer, m), max_tokens=5)
             for t, m in zip(turns, (" and then?", " why so?", " tell me more"))]
    return (model, tokenizer, spec, opts), engine, turns


def test_rows_that_end_in_one_step_hand_over_together_and_continue_as_solo(llama, monkeypatch):
    """Agents whose next messages share a chunk decode in step and end in one step: their caches are taken
    in one hand-over (`queue_rows`), one whose flushed last piece fails its callback fails alone, and each
    other's cache continues exactly as its solo cache does."""
    import runtime.engine as engine_module

    llama, engine, turns = ending_together(llama, "e", held_back=True)
    tokenizer = llama[1]

    def boom(piece):
        raise RuntimeError("display gone")

    turns[1] = Turn(turns[1].turn_id, turns[1].agent_id, turns[1].cache, turns[1].tokens, max_tokens=5,
                    on_token=boom)
    handed, real = [], engine_module.queue_rows

    def recording(batch, rows, drop=0, together=True):
        handed.append(list(rows))
        return real(batch, rows, drop, together)

    monkeypatch.setattr(engine_module, "queue_rows", recording)
    together = run(engine, turns)
    assert handed == [[0, 2]]  # the two that did not fail, in one hand-over
    assert isinstance(together["e1"], TurnError) and "display gone" in str(together["e1"])
    for t in (turns[0], turns[2]):
        alone = solo(llama, Turn(t.turn_id, t.agent_id, t.cache, t.tokens, max_tokens=5))
        got = together[t.turn_id]
        assert got.tokens == alone.tokens and got.cached_tokens == alone.cached_tokens
        follow = encode(tokenizer, " go on")
        after = [solo(llama, Turn("n", t.agent_id, r.cache, [r.tokens[-1]] + follow, max_tokens=6)).tokens
                 for r in (got, alone)]
        assert after[0] == after[1]


def test_a_row_whose_cache_cannot_be_taken_fails_alone_when_rows_end_together(llama, monkeypatch):
    """Rows that end in one step are handed over together; if that fails, each is taken alone, so only the turn
    whose cache cannot be taken fails, and the others are returned as solo."""
    import runtime.engine as engine_module

    llama, engine, turns = ending_together(llama, "f")
    real = engine_module.queue_rows

    def failing(batch, rows, drop=0, together=True):
        if 1 in rows:
            raise RuntimeError("device lost row 1")
        return real(batch, rows, drop, together)

    monkeypatch.setattr(engine_module, "queue_rows", failing)
    out = run(engine, turns)
    assert isinstance(out["f1"], TurnError) and "device lost row 1" in str(out["f1"])
    for t in (turns[0], turns[2]):
        assert out[t.turn_id].tokens == solo(llama, t).tokens
    assert engine.reserved == 0 and not engine.has_work()


def test_rows_whose_all_layers_extraction_fails_are_taken_a_layer_at_a_time(llama, monkeypatch):
    """Where taking a row from every layer at once fails (a kernel that does not compile, a buffer too large), the
    retry takes each row a layer at a time: no turn fails."""
    import runtime.engine as engine_module

    llama, engine, turns = ending_together(llama, "g")
    real, retried = engine_module.queue_rows, []

    def failing_together(batch, rows, drop=0, together=True):
        if together:
            raise RuntimeError("the all-layers kernel did not compile")
        retried.append(list(rows))
        return real(batch, rows, drop, together)

    monkeypatch.setattr(engine_module, "queue_rows", failing_together)
    out = run(engine, turns)
    assert sorted(retried) == [[0], [1], [2]]
    for t in turns:
        assert out[t.turn_id].tokens == solo(llama, t).tokens


def test_one_long_turn_does_not_make_every_row_allocate_its_length(llama):
    """Rows of a batch share their columns, the budget reserves each turn its own length: a join allocates
    room only as far as the rows' reservations cover it (a block a row at most past them)."""
    model, tokenizer, spec, opts = llama
    engine = Engine(model, tokenizer, spec, **opts)
    prompt = encode(tokenizer, "x y " * 20)
    turns = [Turn("long", "long", None, prompt, max_tokens=3000)]
    turns += [Turn(f"s{i}", f"s{i}", None, prompt, max_tokens=8) for i in range(7)]
    per_block = engine.turn_bytes(Turn("b", "b", None, [1], max_tokens=1))
    worst = []

    def held(eng, _):
        if eng.batch is not None:
            rows, width = len(eng.batch[0].left_padding.tolist()), eng.batch[0].keys[0].shape[2]
            worst.append(rows * width / 256 * per_block / eng.reserved)

    for t in turns:
        engine.submit(t)
    while len(engine.stats.decode_steps) < 12:
        engine.step()
        held(engine, None)
    assert max(worst) <= 1.5  # packed bytes held against reserved: at most a block a row past the reservations
    engine.fail_all(lambda turn_id: TurnError(turn_id, "stopped"))


def test_turn_that_can_never_fit_fails_at_once(llama):
    model, tokenizer, spec, opts = llama
    engine = Engine(model, tokenizer, spec, **opts, memory_budget=1000)
    with pytest.raises(TurnTooLarge, match="raise memory_budget"):
        engine.submit(Turn("huge", "x", None, [5] * 10, max_tokens=100))
    assert not engine.has_work()


def test_a_token_id_the_model_does_not_have_fails_its_turn_at_once(llama):
    """An id at or past the embedding's rows (or below 0) would be read out of its bounds: refused at submit."""
    model, tokenizer, spec, opts = llama
    engine = Engine(model, tokenizer, spec, **opts)
    rows = model.args.vocab_size
    assert engine.token_rows == rows
    for bad in (rows, 10**6, -1):
        with pytest.raises(TurnError, match=f"token id {bad} is not one of the model's {rows}"):
            engine.submit(Turn("bad", "x", None, [5, bad, 7], max_tokens=2))
    assert not engine.has_work()
    assert run(engine, [Turn("edge", "x", None, [0, rows - 1], max_tokens=2)])["edge"].tokens


def test_max_tokens_eos_and_stop_strings(llama):
    model, tokenizer, spec, opts = llama
    prompt = encode(tokenizer, "stop conditions are checked here")
    free = solo(llama, Turn("free", "s", None, prompt, max_tokens=16))
    assert free.finish_reason == "length" and len(free.tokens) == 16

    k = 5
    first = free.tokens.index(free.tokens[k])
    saved = set(tokenizer.eos_token_ids)
    tokenizer.eos_token_ids = saved | {free.tokens[k]}
    try:
        eos = solo(llama, Turn("eos", "s", None, prompt, max_tokens=16))
    finally:
        tokenizer.eos_token_ids = saved
    assert eos.finish_reason == "stop" and eos.tokens == free.tokens[: first + 1]

    stop = free.text[len(free.text) // 2 : len(free.text) // 2 + 2]
    cut = solo(llama, Turn("ss", "s", None, prompt, max_tokens=16, stop_strings=(stop,)))
    assert cut.finish_reason == "stop"
    assert cut.text == free.text[: free.text.find(stop)]


def test_seeded_sampling_is_reproducible_alone_and_batched(llama):
    model, tokenizer, spec, opts = llama
    prompt = encode(tokenizer, "sample me something")

    def turn(tid, seed):
        return Turn(tid, tid, None, prompt, Sampling(temperature=1.0, top_p=0.9, seed=seed), max_tokens=20)

    a = solo(llama, turn("a", 7)).tokens
    assert solo(llama, turn("b", 7)).tokens == a
    batched = run(Engine(model, tokenizer, spec, **opts), [turn("c", 7), turn("d", 8)])
    assert batched["c"].tokens == a
    assert batched["d"].tokens != a


@pytest.mark.parametrize("temperature", [1e-300, 5e-324, 1e-45])
@pytest.mark.parametrize("top_p", [1.0, 0.5])
def test_a_temperature_too_small_for_float32_samples_greedily(llama, temperature, top_p):
    """A valid temperature below float32's range (> 0, finite) became 0 in the division: every logit turned
    +-inf or NaN and the turn ended at once with token 1 ("stop") instead of the greedy tokens."""
    model, tokenizer, spec, opts = llama
    prompt = encode(tokenizer, "sample me something")
    greedy = solo(llama, Turn("g", "g", None, prompt, max_tokens=12)).tokens
    cold = Turn("t", "t", None, prompt, Sampling(temperature=temperature, top_p=top_p, seed=3), max_tokens=12)
    assert solo(llama, cold).tokens == greedy


@pytest.mark.parametrize("seed", [3, 4])
def test_top_p_0_decodes_greedily_whatever_the_temperature_and_seed(llama, seed):
    """The nucleus of top_p 0 is the single most likely token: the turn decodes as at temperature 0."""
    model, tokenizer, spec, opts = llama
    prompt = encode(tokenizer, "sample me something")
    greedy = solo(llama, Turn("g", "g", None, prompt, max_tokens=12)).tokens
    turn = Turn("t", "t", None, prompt, Sampling(temperature=2.0, top_p=0.0, seed=seed), max_tokens=12)
    assert solo(llama, turn).tokens == greedy


def test_sampling_never_draws_a_nan_logit_and_takes_an_infinite_one_as_the_largest():
    """Logits from a float16 model can overflow to +inf, or a broken one give NaN: shifting by the maximum made
    every logit NaN then (inf - inf), and the draw returned token 0 whatever the logits said."""
    import mlx.core as mx

    from runtime.engine import _sample_top_p

    def draws(values, temperature, top_p):
        x = mx.array(values, dtype=mx.float16)
        return {_sample_top_p(x, temperature, top_p, mx.random.key(s)).item() for s in range(16)}

    inf, nan = float("inf"), float("nan")
    for temperature, top_p in ((1e-300, 1.0), (1.0, 1.0), (1.0, 0.5)):
        assert draws([1, 2, inf, 3], temperature, top_p) == {2}
        assert 2 not in draws([1, 2, nan, 3], temperature, top_p)
        assert draws([-inf, 2, -inf, 3], temperature, top_p) <= {1, 3}


def test_returned_cache_continues_like_one_longer_turn(llama):
    model, tokenizer, spec, opts = llama
    p, q = encode(tokenizer, "first part of the talk"), encode(tokenizer, " and the second part")
    r1 = solo(llama, Turn("1", "c", None, p, max_tokens=10))
    assert r1.cached_tokens == len(p) + 9
    r2 = solo(llama, Turn("2", "c", r1.cache, [r1.tokens[-1]] + q, max_tokens=12))
    whole = solo(llama, Turn("w", "c", None, p + r1.tokens + q, max_tokens=12))
    assert r2.tokens == whole.tokens


def test_failing_callback_fails_only_its_turn(llama):
    model, tokenizer, spec, opts = llama
    engine = Engine(model, tokenizer, spec, **opts)

    def boom(piece):
        raise RuntimeError("callback exploded")

    good = Turn("good", "g", None, encode(tokenizer, "all is well"), max_tokens=8)
    bad = Turn("bad", "b", None, encode(tokenizer, "all is not well"), max_tokens=8, on_token=boom)
    out = run(engine, [good, bad])
    assert isinstance(out["bad"], TurnError) and out["bad"].turn_id == "bad"
    assert out["good"].tokens == solo(llama, good).tokens
    assert engine.reserved == 0
    again = run(engine, [Turn("again", "g", None, good.tokens, max_tokens=8)])
    assert again["again"].tokens == out["good"].tokens


def test_streamed_pieces_add_up_to_the_text(llama):
    pieces = []
    turn = Turn("s", "s", None, encode(llama[1], "stream this"), max_tokens=16, on_token=pieces.append)
    r = solo(llama, turn)
    assert "".join(pieces) == r.text


def test_warmup_leaves_the_engine_idle_and_output_unchanged(llama, monkeypatch):
    from runtime import q4cache

    model, tokenizer, spec, opts = llama
    turn = Turn("t", "t", None, encode(tokenizer, "after a warm up"), max_tokens=8)
    engine = Engine(model, tokenizer, spec, **opts, max_batch=3, max_prefill_chunk=256)
    seen, at_once, real = [], [], q4cache._all_layers
    monkeypatch.setattr(q4cache, "_all_layers", lambda *a: at_once.append(a[1]) or real(*a))
    assert engine.warmup(lambda done, total, what: seen.append((done, total))) > 0
    assert seen[-1][0] == seen[-1][1] and not engine.has_work() and engine.peak_admitted == 3
    assert {rows for rows, *_ in engine.stats.decode_steps} == {1, 2, 3}  # every batch size decoded
    changes = {c for step in engine.stats.decode_steps for c in step.changes.split("+")}
    assert {"join", "leave", "chunk", ""} <= changes  # the step profile names what changed before a step
    assert any(context > 0 for _, context, _, _ in engine.stats.prefill_chunks)  # a chunk after a cache (hot)
    if engine.route == "q4kernel":  # a turn ended in a decode step: the all-layers extraction compiled now
        assert at_once
    assert run(engine, [turn])["t"].tokens == solo(llama, turn).tokens


def test_decode_steps_record_the_gap_a_decoding_row_waits_prefill_chunks_included(llama):
    """`DecodeStep.gap_s`: the time since the batch's step before began (so a chunk prefilled between two steps
    counts in it, `chunks_s` of it), 0 for a batch's first step."""
    model, tokenizer, spec, opts = llama
    engine = Engine(model, tokenizer, spec, **opts, max_prefill_chunk=16)
    engine.submit(Turn("a", "a", None, encode(tokenizer, "count to ten"), max_tokens=30))
    while not engine.decoding:
        engine.step()
    for _ in range(3):
        engine.step()
    chunks_before = len(engine.stats.prefill_chunks)
    out = run(engine, [Turn("b", "b", None, encode(tokenizer, "a prompt of several chunks " * 5), max_tokens=4)])
    assert set(out) == {"a", "b"}
    steps = list(engine.stats.decode_steps)
    assert steps[0].gap_s == 0
    for before, step in zip(steps, steps[1:]):
        assert step.gap_s in (0, step.start - before.start)
    chunks = [c[2] for c in list(engine.stats.prefill_chunks)[chunks_before:]]
    after_chunks = [(before, step) for before, step in zip(steps, steps[1:]) if "chunk" in step.changes and step.gap_s]
    assert after_chunks  # "a" decoded while "b" prefilled
    assert all(step.chunks_s in chunks and step.gap_s >= before.total_s + step.chunks_s for before, step in after_chunks)
    assert all(step.chunks_s == 0 for step in steps if "chunk" not in step.changes)
    assert sum(1 for s in steps if s.gap_s == 0) == 1  # one batch throughout
    plain = [(before, step) for before, step in zip(steps, steps[1:]) if not step.changes]
    assert plain and all(step.end == before.end + 1 for before, step in plain)  # a plain step is one column more


def test_prefill_reports_progress_after_every_chunk_and_a_failing_report_fails_only_its_turn(llama):
    model, tokenizer, spec, opts = llama
    engine = Engine(model, tokenizer, spec, **opts, max_prefill_chunk=16)
    reports = []
    prompt = encode(tokenizer, "a long prompt that takes several chunks " * 6)
    assert len(prompt) > 3 * 16

    def broken(done, total):
        raise ValueError("progress bar broke")

    watched = Turn("w", "w", None, prompt, max_tokens=4, on_progress=lambda *p: reports.append(p))
    out = run(engine, [watched, Turn("x", "x", None, prompt, max_tokens=4, on_progress=broken)])
    total = len(prompt)
    assert reports == [(min(k, total), total) for k in range(16, total + 16, 16)]
    assert isinstance(out["x"], TurnError) and "progress bar broke" in str(out["x"])
    assert out["w"].tokens == solo(llama, Turn("s", "s", None, prompt, max_tokens=4)).tokens


def test_prefilling_rows_take_turns_chunk_by_chunk(llama):
    """A short prompt behind a long one gets its first token before the long prefill ends."""
    model, tokenizer, spec, opts = llama
    engine = Engine(model, tokenizer, spec, **opts, max_prefill_chunk=16)
    long_prompt = encode(tokenizer, "a long prompt that takes many chunks " * 12)
    assert len(long_prompt) > 6 * 16
    order = []

    def note(engine, out):
        for tid in out:
            if tid not in order:
                order.append(tid)

    first_token = {}
    long_turn = Turn("long", "l", None, long_prompt, max_tokens=2,
                     on_progress=lambda done, total: first_token.setdefault("long_chunks", []).append(done))
    short_turn = Turn("short", "s", None, encode(tokenizer, "hi"), max_tokens=1)
    out = run(engine, [long_turn, short_turn], on_step=note)
    assert order[0] == "short"  # FIFO prefill would finish the long prompt's 7 chunks first
    assert out["long"].tokens == solo(llama, Turn("l2", "l", None, long_prompt, max_tokens=2)).tokens
    assert out["short"].tokens == solo(llama, Turn("s2", "s", None, encode(tokenizer, "hi"), max_tokens=1)).tokens


def test_an_abandoned_turn_is_dropped_at_its_next_chunk_or_token(llama):
    from runtime.engine import TurnAbandoned

    model, tokenizer, spec, opts = llama
    engine = Engine(model, tokenizer, spec, **opts, max_prefill_chunk=16)
    prompt = encode(tokenizer, "a long prompt that takes several chunks " * 6)
    chunks, tokens = [], []
    in_prefill = Turn("gone", "g", None, prompt, max_tokens=50, on_progress=lambda d, t: chunks.append(d),
                      abandoned=lambda: len(chunks) >= 2)
    in_decode = Turn("later", "l", None, prompt, max_tokens=50, on_token=tokens.append,
                     abandoned=lambda: len(tokens) >= 3)
    out = run(engine, [in_prefill, in_decode, Turn("stay", "s", None, prompt, max_tokens=3)])
    assert isinstance(out["gone"], TurnAbandoned) and len(chunks) == 2  # no chunk after it gave up
    assert isinstance(out["later"], TurnAbandoned) and len(tokens) == 3  # no token after it gave up
    assert out["stay"].tokens == solo(llama, Turn("s2", "s", None, prompt, max_tokens=3)).tokens
    assert not engine.has_work() and engine.reserved == 0


def test_a_row_left_with_padding_after_the_longest_leaves_equals_solo(llama):
    # the long row ends first; the short one keeps part of its left padding (less than a
    # block is not worth a copy), so its later steps must still mask that padding
    model, tokenizer, spec, opts = llama
    long = Turn("long", "long", None, encode(tokenizer, "a long prompt of many words " * 12), max_tokens=4)
    short = Turn("short", "short", None, encode(tokenizer, "short one"), max_tokens=16)
    together = run(Engine(model, tokenizer, spec, **opts), [long, short])
    for t in (long, short):
        assert together[t.turn_id].tokens == solo(llama, t).tokens


def test_a_turn_that_ends_while_others_decode_is_returned_evaluated_and_never_lost(llama):
    """A turn that ends while other rows decode is returned by the next step (its cache copy queued
    behind the step in flight, see Engine.step), evaluated and equal to solo; the engine has work
    until then, and stopping it in between (`fail_all`) returns that turn's result, not an error."""
    model, tokenizer, spec, opts = llama
    prompt = encode(tokenizer, "a prompt for two rows")
    short, long = Turn("short", "s", None, prompt, max_tokens=3), Turn("long", "l", None, prompt, max_tokens=20)
    engine = Engine(model, tokenizer, spec, **opts)
    out = run(engine, [short, long])
    assert out["short"].tokens == solo(llama, short).tokens and out["long"].tokens == solo(llama, long).tokens
    assert out["short"].cached_tokens == len(prompt) + 2 == out["short"].cache[0].offset

    tokens = []
    engine.submit(Turn("short2", "s", None, prompt, max_tokens=3, on_token=tokens.append))
    engine.submit(Turn("long2", "l", None, prompt, max_tokens=20))
    returned = []
    while len(tokens) < 3:  # the step in which short2 ends (three pieces of text: one a token here)
        returned += engine.step()
    assert "short2" not in [r.turn_id for r in returned] and engine.has_work()
    stopped = {r.turn_id: r for r in engine.fail_all(lambda tid: TurnError(tid, "stopped"))}
    assert stopped["short2"].tokens == out["short"].tokens  # a result, its cache usable
    assert stopped["short2"].cache[0].offset == out["short"].cache[0].offset
    assert isinstance(stopped["long2"], TurnError) and not engine.has_work()


def test_a_step_builds_at_most_one_decode_step_also_when_rows_join_an_empty_batch(llama):
    """Every `step()` queues at most one decode step's graph, so steps cost alike: after the batch
    was empty, a call only queues the first step and the next call takes its tokens. Rows joining
    an empty batch and a batch in flight, then leaving at different steps, still equal solo."""
    model, tokenizer, spec, opts = llama
    calls = []

    def counting(inputs, cache=None):
        calls[-1] += inputs.shape[1] == 1  # a decode step; a prefill chunk feeds a bucket of tokens
        return model(inputs, cache=cache)

    engine = Engine(counting, tokenizer, spec, **opts)
    turns = [Turn(f"t{i}", f"a{i}", None, encode(tokenizer, f"agent {i} opens with this"), max_tokens=3 + 4 * i)
             for i in range(3)]
    for t in turns:
        engine.submit(t)
    out = {}
    while engine.has_work():
        calls.append(0)
        out.update((r.turn_id, r) for r in engine.step())
    assert max(calls) == 1 and sum(calls) >= max(t.max_tokens for t in turns) - 1
    for t in turns:
        assert out[t.turn_id].tokens == solo(llama, t).tokens


@pytest.mark.parametrize("info, size", [({"total_memory": 80 << 30, "free_memory": 1 << 30}, 80 << 30),  # CUDA's name
                                        ({"memory_size": 64 << 30}, 64 << 30),  # Metal's
                                        ({"architecture": "x86_64"}, None)])  # CPU: the host's RAM
def test_default_budgets_follow_the_memory_the_device_computes_in(monkeypatch, info, size):
    """The GPU's own memory where MLX reports it (each backend under its own key), else the host's RAM."""
    import os

    import runtime.engine as engine

    monkeypatch.setattr(engine.mx, "device_info", lambda: info)  # another backend's report cannot exist here
    size = size or os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    assert engine.device_memory() == size
    assert (engine.default_memory_budget(), engine.default_hot_budget()) == (size // 2, size // 8)


def test_a_short_history_decoded_beside_a_long_one_comes_back_as_solo_in_sliding_layers(tiny_model_path, load_tiny):
    """gemma3-style layers: a bounded sliding layer stores fewer columns than a full one, so a row's padding
    differs between layers; the short row's returned cache holds what solo's does and continues the same."""
    from runtime.q4cache import stored_tokens

    model, tokenizer = load_tiny("gemma3_text")
    spec = ModelCacheSpec.from_model(model, tiny_model_path("gemma3_text"))
    first = Engine(model, tokenizer, spec)
    long = run(first, [Turn("h-long", "long", None, list(range(3, 423)), max_tokens=2)])["h-long"]
    short = run(first, [Turn("h-short", "short", None, list(range(5, 45)), max_tokens=2)])["h-short"]

    def turns():
        return [Turn("long", "long", long.cache, [7, 8, 9], max_tokens=30),
                Turn("short", "short", short.cache, [7, 8, 9], max_tokens=6)]

    together = run(Engine(model, tokenizer, spec), turns())["short"]
    alone = run(Engine(model, tokenizer, spec), turns()[1:])["short"]
    assert together.tokens == alone.tokens
    assert [stored_tokens(c) for c in together.cache] == [stored_tokens(c) for c in alone.cache]

    def next_turn(cache):
        return run(Engine(model, tokenizer, spec), [Turn("next", "short", cache, [11, 12], max_tokens=12)])["next"].tokens

    assert next_turn(together.cache) == next_turn(alone.cache)
