"""The step loop that serves many agents' turns on one model, with Q4 caches.

`Engine` knows nothing of actors: `submit` queues a `Turn`, each `step` does
one decode step for every decoding row and then at most one prefill chunk, and
returns the turns that finished (a `TurnResult`: one that ends in a decode step
comes back from the next `step`, see `step`) or failed (a `TurnError`). A
turn is admitted when the memory budget allows, prefilled in chunks (so a
decoding row waits at most one chunk, and prefilling rows take turns chunk by
chunk: a short prompt never waits behind a long one's whole prefill), then joins the decode batch
(`extend`). A row that ends hands over its cache at once (`extract`) but stays in the
batch, finished, until the batch changes anyway (a join), until finished rows outnumber
the decoding ones (unless, on CUDA, those end within SHORT_TAIL steps: the batch's last
rows then ride along to its end), or until the budget needs its room (`_drop_finished`): each filter of the
batch copies every buffer and gives the next step a new shape, which MLX-CUDA pays for
on the host. Turns whose whole
prompt fits one chunk (an agent's next message) share that chunk when several
wait: one forward pass for all, the rows' tokens right-aligned (`merge`'s `lead`),
so that a round of agents costs one chunk's host work instead of one per agent.

Everything runs on the thread that calls `step` (MLX streams are per thread);
every array handed out (the result cache) is evaluated.
"""

from __future__ import annotations

import collections
import contextlib
import math
import os
import threading
import time
from dataclasses import dataclass, field
from typing import Callable, NamedTuple

import mlx.core as mx

from runtime import attention, cudacopy
from runtime.detok import AnchoredDetokenizer
from runtime.errors import AdvisedError
from runtime.model import token_rows
from runtime.prepare import last_logits, record_decode
from runtime.qgemv import available as on_cuda
from runtime.q4cache import (
    STEP,
    cache_tokens,
    extend_cache,
    filter_cache,
    history_tokens,
    merge_caches,
    queue_rows,
    reserve_cache,
    route_for,
    row_arrays,
    settle,
)

BLOCK = STEP  # the memory budget's unit is the cache buffers' growth step: a reserved block is a real one


MAX_TOKENS = 128  # tokens a turn generates at most unless its caller says otherwise
# Steps within which every decoding row ends for sure (its max_tokens) for finished rows to ride along to the batch's
# end rather than be filtered out, on CUDA (`Engine.short_tail`): there a filter copies every buffer and gives the
# next step a new shape (on an H200 a step after one took 13.5 ms against 7.7 for a plain step), while a step
# carrying finished rows costs the host no more than one without them. On CPU the rows' compute is the cost: the
# tiny model's workload decoded 0.19 s (20%) slower with them riding along, so there they are filtered as before.
SHORT_TAIL = 16


@dataclass(frozen=True)
class Sampling:
    """How to pick tokens: temperature 0 is greedy, and so is top_p 0 (its nucleus holds the single most likely
    token); otherwise seeded top-p sampling, `seed` making it reproducible."""

    temperature: float = 0.0
    top_p: float = 1.0
    seed: int = 0

    @property
    def greedy(self) -> bool:
        """Whether every token is the most likely one: temperature 0 or top_p 0 (then `seed` plays no part)."""
        return self.temperature <= 0 or self.top_p <= 0


@dataclass
class Turn:
    """One request: feed `tokens` after `cache` (None: no history) and generate.

    `on_token`, if given, is called with each new piece of detokenized text, and
    `on_progress` with (tokens prefilled, tokens to prefill) after each prefill
    chunk, both on the engine's thread: keep them short and never block in them.
    An exception in either (or in `cancel`) fails this turn only, with `CallbackFailed`.
    `cancel`, if given, is asked after each generated token; once it returns True the
    turn finishes with what it has, finish reason "cancelled". `abandoned`, if given,
    says the caller is gone (it already got an error): it is asked before each prefill
    chunk and after each token, and once True the turn is dropped with no result
    (`TurnAbandoned`), freeing its place (and its share of the memory budget once the
    batch filters it out, see `Engine._drop_finished`).
    """

    turn_id: str
    agent_id: str
    cache: list | None
    tokens: list[int]
    sampling: Sampling = Sampling()
    max_tokens: int = MAX_TOKENS
    stop_strings: tuple[str, ...] = ()
    on_token: Callable[[str], None] | None = None
    on_progress: Callable[[int, int], None] | None = None
    cancel: Callable[[], bool] | None = None
    abandoned: Callable[[], bool] | None = None


@dataclass
class Timings:
    """Seconds and token counts of one turn, measured by the engine."""

    queue_s: float = 0.0
    ttft_s: float = 0.0
    prefill_tokens: int = 0
    prefill_s: float = 0.0
    decode_tokens: int = 0
    decode_s: float = 0.0


@dataclass
class TurnResult:
    """A finished turn.

    `cache` is a per-layer list of evaluated `QuantizedKVCache` holding the turn's
    history, its prompt and every generated token but the last (which was
    sampled, never fed to the model): `cached_tokens` tokens in all.
    `finish_reason` is "stop" (eos or stop string), "length" or "cancelled".
    `text` spells `tokens` as they follow the turn's last fed token
    (`runtime.detok`), cut before a stop string; eos tokens add no text.
    """

    turn_id: str
    agent_id: str
    tokens: list[int]
    text: str
    cache: list
    cached_tokens: int
    finish_reason: str
    timings: Timings


class TurnError(AdvisedError, RuntimeError):
    """A turn failed; `turn_id` says which. The engine stays usable."""

    def __init__(self, turn_id: str, message: str, advice: str = ""):
        super().__init__(message, advice, turn_id)


class TurnAbandoned(TurnError):
    """The turn's `abandoned` returned True: it was dropped at the next step, with no result."""


class CallbackFailed(TurnError):
    """A callback of the turn's caller (`on_token`, `on_progress` or `cancel`) raised: the turn ended with no
    result and nothing else was affected. The caller's mistake, not a fault: fix the callback and ask again."""


class TurnTooLarge(TurnError):
    """The turn can never fit the memory budget (or the context limit)."""


class DecodeStep(NamedTuple):
    """One decode step, as `EngineStats` records it (seconds from `time.perf_counter`)."""

    rows: int
    build_s: float  # building and queueing the next step's graph (the host's side)
    queue_s: float  # of build_s, inside mx.async_eval (encoding, launching; MLX waits there past 10 unfinished batches)
    wait_s: float  # then waiting for this step's tokens (the device's)
    total_s: float  # all of it, taking the tokens included: where rows end, the batch changes
    changes: str  # what happened to the batch since the step before (see EngineStats)
    start: float  # when the step began
    ended: int = 0  # rows whose turns ended at this step's tokens (their caches queued within total_s)
    finish_s: float = 0.0  # of total_s, handing those turns over (`_finish`: their caches' extraction queued)
    gap_s: float = 0.0  # since the batch's step before began (what a decoding row waits between two tokens, the
    # prefill chunks and hand-overs between the steps included); 0 for a batch's first step
    chunks_s: float = 0.0  # of gap_s, prefill chunks run since the step before
    end: int = 0  # the batch's columns after the step this call built (its attention's end): where the
    # kernels' 64-column parameter blocks (`q4sdpa.meta`) and the buffers' growth fall


@dataclass
class EngineStats:
    """What the engine did, for profiles in place (the most recent 100,000 of each).

    `decode_steps`: a `DecodeStep` per decode step, whose `changes` names what
    happened to the batch since the step before, "+"-joined
    in this order: "join" (rows joined), "leave" (finished rows were filtered out,
    `Engine._drop_finished`), "chunk" (a prefill chunk ran), "grow" (the buffers widened
    for this step); "" for none (a batch whose last row ends is dropped, and no step
    records that). `rows` counts the batch's rows, finished ones not yet filtered out
    included; `ended` the rows whose turns ended at the step; `gap_s` the time since the batch's
    step before began, which is what a row decoding through both waits between its tokens
    (the prefill chunks run between the steps included, `chunks_s` of it);
    `prefill_chunks`: (tokens fed, tokens of context before (the longest row's),
    seconds, rows) per chunk.

    `shapes` counts the steps and chunks per shape: ("decode", rows, cache width)
    or ("prefill", rows, tokens fed a row with padding, cache width). A backend that sets up
    kernels per shape (MLX-CUDA) pays once for each new one; `first_shapes`
    lists (shape, seconds) for each step or chunk that met its shape for the first time.
    """

    decode_steps: collections.deque = field(default_factory=lambda: collections.deque(maxlen=100_000))
    prefill_chunks: collections.deque = field(default_factory=lambda: collections.deque(maxlen=100_000))
    shapes: collections.Counter = field(default_factory=collections.Counter)
    first_shapes: collections.deque = field(default_factory=lambda: collections.deque(maxlen=100_000))

    def count_shape(self, shape: tuple, seconds: float) -> None:
        """Count one step or chunk of `shape` that took `seconds`."""
        if not self.shapes[shape]:
            self.first_shapes.append((shape, seconds))
        self.shapes[shape] += 1


@dataclass
class _Row:
    turn: Turn
    submitted: float
    reserved: int = 0
    pending: list[int] = field(default_factory=list)
    cache: list | None = None  # a batch of one while prefilling
    generated: list[int] = field(default_factory=list)
    text: str = ""
    detok: object = None
    admitted: float = 0.0
    first_token: float = 0.0
    prefill_s: float = 0.0
    key: object = None
    finished: bool = False  # ended (cache handed over, or failed); a row of the batch until Engine._drop_finished


def device_memory() -> int:
    """Bytes of memory the device computes in: the GPU's own (CUDA), unified memory (Metal), else the host's RAM."""
    info = mx.device_info()
    size = info.get("memory_size") or info.get("total_memory")  # Metal names it one way, CUDA the other
    return int(size) if size else os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def default_memory_budget() -> int:
    """Half the device's memory (`device_memory`), in bytes."""
    return device_memory() // 2


def default_hot_budget() -> int:
    """An eighth of the device's memory (`device_memory`), in bytes: idle agents' caches kept in memory."""
    return device_memory() // 8


def default_query_bucket() -> int:
    """Prefill chunks are padded to a multiple of this many tokens: 64 on CUDA, else 1.

    MLX-CUDA sets up kernels per shape (tens of ms for each new query length of a
    short prefill on an H100); with lengths from a small set, a server meets each
    shape once. The padding tokens are computed and then trimmed from the cache
    exactly. Elsewhere shapes cost nothing and padding would only add work.
    """
    return 64 if on_cuda() else 1


def prefill_chunk_size(context: int, largest: int = 2048) -> int:
    """Tokens per prefill chunk for a row that already holds `context` tokens.

    2048 up to 4K of context, 1024 up to 16K, 512 beyond: the longer the context,
    the costlier a chunk, and decoding rows wait for at most one chunk.
    """
    size = 2048 if context < 4096 else 1024 if context < 16384 else 512
    return max(1, min(size, largest))


class Engine:
    """Serves turns for one model; see the module docstring for the step loop.

    `memory_budget` bytes cover every admitted turn's Q4 cache in 256-token
    blocks (history + prompt + max_tokens), plus its 16-bit working copy under
    the "dequant_once" route. `max_batch` bounds the admitted turns.
    """

    def __init__(
        self,
        model,
        tokenizer,
        spec,
        memory_budget: int | None = None,
        max_batch: int = 16,
        route: str | None = None,
        max_prefill_chunk: int = 2048,
        query_bucket: int | None = None,
    ):
        attention.install()  # the model's attention over batch caches: see runtime.attention
        cudacopy.reserve_pool()  # new buffer sizes carved from spare pool memory, not mapped each (CUDA only)
        self.model = model
        self.token_rows = token_rows(model)  # every fed token id is below it (None: not known)
        self.tokenizer = tokenizer
        self.spec = spec
        self.route = route_for(spec, route)
        self.memory_budget = memory_budget or default_memory_budget()
        self.max_batch = max_batch
        self.max_prefill_chunk = max_prefill_chunk
        self.query_bucket = query_bucket or default_query_bucket()
        self.short_tail = SHORT_TAIL if on_cuda() else 0  # see SHORT_TAIL
        self.waiting: collections.deque[_Row] = collections.deque()
        self.prefilling: list[_Row] = []
        self._rows: list[_Row] = []  # the batch's rows in its order: decoding ones and finished ones not yet dropped
        self.batch = None  # per-layer BatchQuantizedKVCache of `_rows`
        self._next = None  # the tokens the step in flight samples, one per row of the batch (`_rows`; lazy)
        self._handing: list = []  # (step count, TurnResult): finished turns whose cache copies are queued
        self._steps = 0  # calls of step()
        self._changes: set = set()  # what happened to the batch since the last decode step (EngineStats)
        self._queued = 0.0  # seconds in mx.async_eval since the decode step began (DecodeStep.queue_s)
        self._finishing = 0.0  # seconds in the last `_accept`'s `_finish` (DecodeStep.finish_s)
        self._last_step = None  # when the batch's last recorded decode step began (DecodeStep.gap_s)
        self._chunked = 0.0  # seconds of prefill chunks since then (DecodeStep.chunks_s)
        self.peak_admitted = 0
        self.stats = EngineStats()
        per_token = spec.q4_bytes_per_token()
        if self.route == "dequant_once":
            per_token += spec.fp16_bytes_per_token()
        self._bytes_per_block = math.ceil(per_token * BLOCK)

    # -- public -------------------------------------------------------------------

    def submit(self, turn: Turn) -> None:
        """Queue `turn` (FIFO). Raises TurnTooLarge at once if it can never fit, TurnError for no tokens or a token
        id the model does not have (it would be read past the embedding's bounds)."""
        if not turn.tokens:
            raise TurnError(turn.turn_id, "no tokens to feed: a turn needs at least one new token")
        if self.token_rows is not None and not 0 <= min(turn.tokens) <= max(turn.tokens) < self.token_rows:
            bad = next(t for t in turn.tokens if not 0 <= t < self.token_rows)
            raise TurnError(turn.turn_id, f"token id {bad} is not one of the model's {self.token_rows}")
        need = self.turn_bytes(turn)
        if need > self.memory_budget:
            raise TurnTooLarge(
                turn.turn_id,
                f"needs {need} bytes of KV cache but the whole budget is {self.memory_budget}",
                "; lower max_tokens, shorten the history, or raise memory_budget",
            )
        self.waiting.append(_Row(turn=turn, submitted=time.perf_counter(), reserved=need))

    def turn_bytes(self, turn: Turn) -> int:
        """Bytes reserved for `turn`: its final length in 256-token blocks."""
        total = cache_tokens(turn.cache) + len(turn.tokens) + turn.max_tokens
        return math.ceil(total / BLOCK) * self._bytes_per_block

    @property
    def decoding(self) -> list:
        """The admitted turns' rows that are decoding, in batch order."""
        return [r for r in self._rows if not r.finished]

    def has_work(self) -> bool:
        """True while any turn is queued, prefilling, decoding, or finished but not yet returned by `step`."""
        return bool(self.waiting or self.prefilling or self.decoding or self._handing)

    def active(self) -> int:
        """Number of admitted turns (prefilling or decoding)."""
        return len(self.prefilling) + len(self.decoding)

    @property
    def reserved(self) -> int:
        """Bytes of the budget reserved by the admitted turns and by finished rows still in the batch."""
        return sum(r.reserved for r in self.prefilling) + sum(r.reserved for r in self._rows)

    def step(self) -> list:
        """Admit what fits, decode one token for every decoding row, prefill one chunk.

        Decoding is pipelined (see `_decode_step`): a call queues the next decode
        step and takes the tokens of the one before, so the call after the batch
        was empty only queues.

        Returns the turns that ended: `TurnResult`s and `TurnError`s. A turn that ends in
        a decode step is returned by the next call, while a step is in flight (its cache
        copy is queued behind that step, and waiting for it here would leave the device
        idle while the next step is built), else by this one.
        """
        self._steps += 1
        done = []
        self._admit()
        if self.decoding:
            done += self._decode_step()
        if self.prefilling:
            done += self._prefill_chunk()
            self._changes.add("chunk")
        return done + self._hand_over(everything=self._next is None)

    def record_graphs(self) -> int:
        """Record the model's compiled decode graphs for every batch size up to `max_batch` now
        (`prepare.record_decode`: Python's tracing only), so that no decode step pays it when a batch
        first reaches a size. Call it on the engine's thread before its first step; returns the (block, batch
        size) pairs recorded (0 where no block is compiled, as on CPU)."""
        return record_decode(self.model, range(1, self.max_batch + 1))

    def warmup(self, progress: Callable[[int, int, str], None] | None = None) -> float:
        """Serve synthetic turns so one-time setup happens now, not in users' turns; returns seconds.

        Prefills one chunk of each bucketed length up to `max_prefill_chunk`, then one
        chunk after a cache (a hot turn), then decodes `max_batch` turns of up to 32 query
        buckets (2048 tokens on CUDA), one bucket fewer each so that each joins on its own,
        that all join the batch before the first ends, the last going on alone past `short_tail`
        steps (so the others are filtered out down to it), so every batch size from 1 to
        `max_batch` runs, at a context as long as a user's. On CUDA this pays MLX's
        per-shape kernel builds and the first-use compiles of our kernels (tens of seconds
        on an H100, and about 2 s for the first step of 5 or more rows at a long context);
        elsewhere it costs little and buys little. `progress(done, total, what)` is called
        after each stage. Must run on the engine's thread with no turn in flight.
        """
        if self.has_work():
            raise RuntimeError("warm up before submitting turns")
        t0 = time.perf_counter()
        lengths, n = [], self.query_bucket
        while n < self.max_prefill_chunk:
            lengths.append(n)
            n *= 4
        lengths.append(self.max_prefill_chunk)
        ids = self.tokenizer.encode("warm up the engine", add_special_tokens=False) or [0]
        total = len(lengths) + 2
        first = None
        for done, n in enumerate(lengths, 1):
            result = self._serve([Turn(f"warmup-p{n}", "warmup", None, (ids * n)[:n], max_tokens=1)])[0]
            first = first or result
            if progress:
                progress(done, total, f"prefill {n} tokens")
        n = self.query_bucket
        self._serve([Turn("warmup-hot", "warmup", first.cache, (ids * n)[:n], max_tokens=1)])
        if progress:
            progress(total - 1, total, f"prefill {n} tokens after a cache")
        n = min(self.max_prefill_chunk, self.query_bucket * 32)
        long = [(ids * n)[: max(1, n - i * self.query_bucket)] for i in range(self.max_batch)]  # no chunk shared
        last = self.max_batch - 1  # goes on past short_tail alone, so that the others are filtered out down to it
        self._serve([Turn(f"warmup-d{i}", "warmup", None, long[i],
                          max_tokens=2 * self.max_batch + 2 * i + (self.short_tail + 2) * (i == last))
                     for i in range(self.max_batch)])
        if progress:
            progress(total, total, f"decode at batch 1..{self.max_batch}")
        return time.perf_counter() - t0

    def _serve(self, turns) -> list:
        """Submit `turns` and step until every turn has ended; return their results (raise the first error)."""
        for turn in turns:
            self.submit(turn)
        results = []
        while self.has_work():
            for outcome in self.step():
                if isinstance(outcome, TurnError):
                    raise outcome
                results.append(outcome)
        return results

    def fail_all(self, make_error: Callable[[str], Exception]) -> list:
        """End every queued and admitted turn with `make_error(turn_id)`; returns them."""
        rows = list(self.waiting) + self.prefilling + self.decoding
        self.waiting.clear()
        self.prefilling, self._rows, self.batch, self._next = [], [], None, None
        return self._hand_over(everything=True) + [make_error(r.turn.turn_id) for r in rows]

    def _hand_over(self, everything: bool) -> list:
        """The finished turns whose cache copies were queued in an earlier step (all of them if `everything`),
        their caches evaluated (`TurnResult` promises it); a copy that fails fails its turn."""
        ready = [r for n, r in self._handing if everything or n < self._steps]
        if not ready:
            return []
        self._handing = [] if everything else [(n, r) for n, r in self._handing if n == self._steps]
        out = []
        for r in ready:
            try:
                mx.eval(row_arrays(r.cache))
                out.append(r)
            except Exception as e:
                out.append(_own_error(r.turn_id, e, "extracting the cache failed"))
        return out

    # -- admission -------------------------------------------------------------------

    def _admit(self):
        now = time.perf_counter()
        while self.waiting and self.active() < self.max_batch:
            row = self.waiting[0]
            if self.reserved + row.reserved > self.memory_budget:
                held = sum(r.reserved for r in self._rows if r.finished)
                if held and self.reserved - held + row.reserved <= self.memory_budget:
                    self._drop_finished()  # their room is needed now
                    continue
                break  # FIFO: nobody overtakes the head of the queue
            self.waiting.popleft()
            row.admitted = now
            row.pending = list(row.turn.tokens)
            row.detok = AnchoredDetokenizer(self.tokenizer, row.turn.tokens[-1])  # spelled in context
            if not row.turn.sampling.greedy:
                row.key = mx.random.key(row.turn.sampling.seed)
            self.prefilling.append(row)
        self.peak_admitted = max(self.peak_admitted, self.active())

    # -- prefill -------------------------------------------------------------------

    def _prefill_chunk(self):
        """Prefill one chunk: the first prefilling row's, shared with rows behind it where they fit
        (`_sharers`); rows take turns chunk by chunk.

        A row whose caller is gone (`abandoned`) is dropped before its chunk.
        """
        row = self.prefilling[0]
        if row.turn.abandoned is not None and row.turn.abandoned():
            self.prefilling.pop(0)
            return [TurnAbandoned(row.turn.turn_id, "its caller gave up during the prefill")]
        rows = self._sharers()
        if len(rows) > 1:
            return self._shared_chunk(rows)
        t0 = time.perf_counter()
        try:
            if row.cache is None:
                row.cache = merge_caches(self.spec, [row.turn.cache], self.route, room=self._room([row]))
            else:
                settle(row.cache)  # its last chunk's writes, queued in one call rather than one a layer
            context = row.cache[0].size()
            n = prefill_chunk_size(context, self.max_prefill_chunk)
            chunk, row.pending = row.pending[:n], row.pending[n:]
            pad = _bucketed(len(chunk), self.query_bucket) - len(chunk)  # see default_query_bucket
            logits = last_logits(self.model, mx.array(chunk + chunk[-1:] * pad)[None], row.cache, len(chunk) - 1)
            shape = ("prefill", 1, len(chunk) + pad, _width(row.cache))
            for layer in row.cache:
                layer.trim(pad)
            if row.pending:  # the logits stay unevaluated: MLX never computes them
                mx.eval([c.state for c in row.cache])
                row.prefill_s += self._chunk_done(t0, len(chunk), context, shape, 1)
                _report_progress(row)
                self.prefilling.append(self.prefilling.pop(0))  # fair: the next row's chunk comes next
                return []
            picks = self._sample([row], logits)
            mx.eval(picks, [c.state for c in row.cache])
            token = picks.tolist()[0]
            row.prefill_s += self._chunk_done(t0, len(chunk), context, shape, 1)
            row.first_token = time.perf_counter()
            _report_progress(row)
        except Exception as e:
            self.prefilling.pop(0)
            return [_own_error(row.turn.turn_id, e, "prefill failed")]
        self.prefilling.pop(0)
        cache, row.cache = row.cache, None
        return self._join([row], cache, [token])

    def _sharers(self) -> list:
        """The first prefilling row, and the rows behind it that share its chunk.

        Rows share a chunk when it is each one's whole prompt (its first and last) and
        their prompts round up to one length L (the query bucket, `default_query_bucket`),
        so that none computes more padding than alone. Their tokens are right-aligned in
        `rows` x L query slots (at most `max_prefill_chunk`): a shorter row's padding
        queries sit over the last columns of its history, which must hold that many
        tokens (`merge`'s `lead`).
        """
        first = self.prefilling[0]
        width = _bucketed(len(first.pending), self.query_bucket)
        rows = []
        for row in self.prefilling:
            if (row.cache is None and _bucketed(len(row.pending), self.query_bucket) == width
                    and width <= prefill_chunk_size(cache_tokens(row.turn.cache), self.max_prefill_chunk)
                    and width - len(row.pending) <= history_tokens(row.turn.cache)
                    and (len(rows) + 1) * width <= self.max_prefill_chunk
                    and (row is first or row.turn.abandoned is None or not row.turn.abandoned())):
                rows.append(row)
            elif row is first:
                break
        return rows or [first]

    def _shared_chunk(self, rows):
        """Prefill `rows` (from `_sharers`) in one chunk; they join the decode batch together."""
        t0 = time.perf_counter()
        for row in rows:
            self.prefilling.remove(row)
        try:
            width = _bucketed(max(len(r.pending) for r in rows), self.query_bucket)
            lead = [width - len(r.pending) for r in rows]
            cache = merge_caches(self.spec, [r.turn.cache for r in rows], self.route, lead, self._room(rows))
            tokens = mx.array([r.pending[:1] * n + r.pending for r, n in zip(rows, lead)])
            logits = last_logits(self.model, tokens, cache, width - 1)
            shape = ("prefill", len(rows), width, _width(cache))
            picks = self._sample(rows, logits)
            mx.eval(picks, [c.state for c in cache])
            firsts = picks.tolist()
            seconds = self._chunk_done(t0, sum(len(r.pending) for r in rows),
                                       max(cache_tokens(r.turn.cache) for r in rows), shape, len(rows))
        except Exception as e:
            return [TurnError(r.turn.turn_id, f"prefill failed: {type(e).__name__}: {e}") for r in rows]
        now, kept, failed = time.perf_counter(), [], []
        for i, row in enumerate(rows):
            row.pending, row.prefill_s, row.first_token = [], row.prefill_s + seconds, now
            try:
                _report_progress(row)
                kept.append(i)
            except Exception as e:
                failed.append(_own_error(row.turn.turn_id, e, "prefill failed"))
        if len(kept) < len(rows):
            if not kept:
                return failed
            filter_cache(cache, kept)
        return failed + self._join([rows[i] for i in kept], cache, [firsts[i] for i in kept])

    def _join(self, rows, cache, tokens):
        """Rows whose prefill ended (their batch `cache`, their first tokens) join the decode batch."""
        extended = self.batch is not None
        if extended:
            self._drop_finished(queue=False)  # the batch changes shape now anyway; queued with the extension
            extend_cache(self.batch, cache, self._room(self._rows + rows))  # after the step in flight
        else:
            self.batch = cache
        self._rows += rows
        self._changes.add("join")
        if self._next is not None:
            # join the step in flight's output: the next step feeds these tokens too, and
            # the rows take them with the others' (no wait for the device, no extra step)
            self._next = mx.concatenate([self._next, mx.array(tokens, dtype=self._next.dtype)])
        if extended:
            self._queue_surgery()
        if self._next is not None:
            return []
        first = len(self._rows) - len(rows)
        return self._accept(list(enumerate(tokens, first)), fed=False)

    def _room(self, rows) -> int:
        """Columns a batch of `rows` allocates beyond its longest row when it is merged or joined: what its rows
        may still take (the prompt left, padded to the query bucket, and the tokens left to generate), so that
        no chunk or step grows the buffers (a copy of each, and new shapes) until the batch changes.

        Every row of a batch has the same columns, while the budget reserves each turn its own final
        length (`turn_bytes`): the room stops where the rows' reservations, shared evenly, end (rounded up
        to a whole block, so at most a block a row past them), and past it the buffers grow as they fill.
        """
        need = max(_bucketed(len(r.pending), self.query_bucket) + r.turn.max_tokens - len(r.generated)
                   for r in rows)
        blocks = sum(r.reserved for r in rows) // self._bytes_per_block
        covered = -(-blocks // len(rows)) * BLOCK  # the rows' reserved blocks shared evenly, rounded up
        longest = max(cache_tokens(r.turn.cache) + len(r.turn.tokens) - len(r.pending) + len(r.generated)
                      for r in rows)
        return max(1, min(need, covered - longest))

    # -- decode -------------------------------------------------------------------

    def _decode_step(self):
        """One token for every decoding row, pipelined: the next step is built while this one runs.

        `_next` holds the tokens the step in flight samples. Before reading them,
        the step that feeds them is built and queued, so MLX builds a step's graph
        while the device runs the previous one. A row that finishes has then been
        fed its last token once too often: `_finish` leaves that column out of its
        cache; the row stays in the batch, finished, until `_drop_finished`. A row that joins
        while a step is in flight appends its first token to `_next` and takes it
        with the others at the next step (`_join`). With no step in flight (the batch
        was empty), a call only queues the first step and takes its tokens at the next
        call, so every call builds one step's graph.
        """
        try:
            t0, self._queued = time.perf_counter(), 0.0
            if reserve_cache(self.batch, 1):  # the step built below
                self._queue_surgery()
                self._changes.add("grow")
            if self._next is None:
                self._drop_finished()  # rows that ended at their first token (none was fed), in a new shape anyway
                self._next = self._forward(mx.array([[r.generated[-1]] for r in self._rows]))
                self._last_step = None  # a new batch: its rows' first tokens came from their prefill
                return []
            current = self._next
            self._next = self._forward(current[:, None])
            built, end = time.perf_counter(), _columns(self.batch)
            tokens = current.tolist()
            waited = time.perf_counter() - built
            changes = "+".join(c for c in ("join", "leave", "chunk", "grow") if c in self._changes)
            self._changes.clear()
            shape = ("decode", len(tokens), _width(self.batch))
        except Exception as e:
            rows, self._rows, self.batch, self._next = self.decoding, [], None, None
            return [TurnError(r.turn.turn_id, f"decode step failed: {type(e).__name__}: {e}") for r in rows]
        live = len(self.decoding)
        done = self._accept(list(enumerate(tokens)), fed=True)
        seconds = time.perf_counter() - t0  # taking the tokens too: where rows end, the batch changes
        gap, chunked = (0.0, 0.0) if self._last_step is None else (t0 - self._last_step, self._chunked)
        self._last_step, self._chunked = t0, 0.0
        self.stats.decode_steps.append(DecodeStep(len(tokens), built - t0, self._queued, waited, seconds,
                                                   changes, t0, live - len(self.decoding), self._finishing, gap,
                                                   chunked, end))
        self.stats.count_shape(shape, seconds)
        return done

    def _queue_surgery(self):
        """Queue the batch's new buffers (a join, a filter, a growth) for the device as an evaluation of
        their own, so that the next decode step's graph is the same as every step's: MLX-CUDA replays it
        as a CUDA graph it has already made, where copies inside it made a new one each time."""
        self._async_eval([c.state for c in self.batch], [] if self._next is None else self._next)

    def _forward(self, inputs):
        """Queue a decode step over the batch; returns its sampled tokens (being computed)."""
        logits = self.model(inputs, cache=self.batch)
        picks = self._sample(self._rows, logits[:, -1, :])
        self._async_eval(picks, [c.state for c in self.batch])
        return picks

    def _async_eval(self, *arrays):
        """`mx.async_eval`, its seconds added to the step's `queue_s`."""
        t0 = time.perf_counter()
        mx.async_eval(*arrays)
        self._queued += time.perf_counter() - t0

    def _chunk_done(self, t0, tokens, context, shape, rows):
        seconds = time.perf_counter() - t0
        self._chunked += seconds
        self.stats.prefill_chunks.append((tokens, context, seconds, rows))
        self.stats.count_shape(shape, seconds)
        return seconds

    def _sample(self, rows, logits):
        """The next token of every row (a lazy array): greedy, or seeded top-p sampling (finished rows: greedy)."""
        greedy = mx.argmax(logits, axis=-1)
        if all(r.turn.sampling.greedy or r.finished for r in rows):
            return greedy
        picks = []
        for i, r in enumerate(rows):
            s = r.turn.sampling
            if s.greedy or r.finished:
                picks.append(greedy[i])
                continue
            r.key, sub = mx.random.split(r.key)
            picks.append(_sample_top_p(logits[i], s.temperature, s.top_p, sub))
        return mx.stack(picks)

    def _accept(self, row_tokens, fed: bool):
        """Record sampled tokens of the batch's rows (`(index, token)` pairs; finished rows' are ignored);
        finish rows that hit a stop; return the turns that failed (the finished ones wait in `_handing`).

        `fed`: a step already queued feeds these tokens to the cache (see `_decode_step`).
        """
        finished, results, ending = [], [], []
        for i, token in row_tokens:
            row = self._rows[i]
            if row.finished:
                continue
            if row.turn.abandoned is not None and row.turn.abandoned():
                finished.append(row)
                results.append(TurnAbandoned(row.turn.turn_id, "its caller gave up during the decode"))
                continue
            try:
                reason = self._add_token(row, token)
            except Exception as e:  # a failing callback (or detokenizer) fails its own turn
                finished.append(row)
                results.append(_own_error(row.turn.turn_id, e, "taking its token failed"))
                continue
            if reason:
                finished.append(row)
                error = self._last_text(row, reason)
                if error is None:
                    ending.append((i, row, reason))
                else:
                    results.append(error)
        t0 = time.perf_counter()
        results += self._finish(ending, fed)
        self._finishing = time.perf_counter() - t0
        for row in finished:
            row.finished = True
        live = self.decoding
        if not live:
            self._rows, self.batch, self._next = [], None, None
        elif len(self._rows) - len(live) > len(live) and _steps_left(live) > self.short_tail:
            self._drop_finished()
        return results

    def _drop_finished(self, queue: bool = True) -> None:
        """Filter the finished rows out of the batch, if any (and queue that for the device unless `queue` is off:
        the caller changes the batch again and queues both).

        A finished row stays in the batch (each step computes it and ignores its token)
        until the batch changes shape anyway (a join), until finished rows outnumber
        decoding ones that may still take more than `short_tail` steps, or until the budget
        needs their room (`_admit`): a filter copies every buffer and the next step has a
        new shape, which on MLX-CUDA costs the host more than a step's work for a few rows more.
        """
        keep = [i for i, r in enumerate(self._rows) if not r.finished]
        if len(keep) == len(self._rows):
            return
        self._rows = [self._rows[i] for i in keep]
        self._changes.add("leave")
        if not keep:
            self.batch = self._next = None
            return
        filter_cache(self.batch, keep)
        if self._next is not None:
            self._next = self._next[mx.array(keep)]
        if queue:
            self._queue_surgery()

    def _add_token(self, row, token) -> str | None:
        turn = row.turn
        row.generated.append(token)
        if token in self.tokenizer.eos_token_ids:
            return "stop"
        row.detok.add_token(token)
        piece = row.detok.last_segment
        row.text += piece
        for s in turn.stop_strings:
            at = row.text.find(s, max(0, len(row.text) - len(piece) - len(s)))
            if at >= 0:
                row.text = row.text[:at]
                return "stop"
        if piece and turn.on_token:
            _call(turn, "on_token", piece)
        if len(row.generated) >= turn.max_tokens:
            return "length"
        if turn.cancel is not None and _call(turn, "cancel", truth=True):
            return "cancelled"
        return None

    def _last_text(self, row, reason) -> CallbackFailed | None:
        """Flush a turn's last text where it did not end on a stop (its detokenizer may hold a
        character's first bytes); a failing callback fails its own turn, as in _accept."""
        if reason in ("length", "cancelled"):
            row.detok.finalize()
            tail = row.detok.last_segment
            row.text += tail
            if tail and row.turn.on_token:
                try:
                    _call(row.turn, "on_token", tail)
                except CallbackFailed as e:
                    return e
        return None

    def _finish(self, ending, fed) -> list:
        """Hand over the turns of `ending` ((index, row, reason) of each row whose turn ends): their
        caches queued for the device together, the results waiting in `_handing` for the next step
        (see step); returns the turns that failed."""
        if not ending:
            return []
        try:
            caches = queue_rows(self.batch, [i for i, _, _ in ending], drop=int(fed))  # evaluated in _hand_over
        except Exception:
            caches = [self._queue_row(i, row, fed) for i, row, _ in ending]  # a row's failure fails its turn alone
        now, failed = time.perf_counter(), []
        for (_, row, reason), cache in zip(ending, caches):
            if isinstance(cache, TurnError):
                failed.append(cache)
                continue
            timings = Timings(
                queue_s=row.admitted - row.submitted,
                ttft_s=row.first_token - row.submitted,
                prefill_tokens=len(row.turn.tokens),
                prefill_s=row.prefill_s,
                decode_tokens=len(row.generated),
                decode_s=now - row.first_token,
            )
            self._handing.append((self._steps, TurnResult(
                turn_id=row.turn.turn_id,
                agent_id=row.turn.agent_id,
                tokens=row.generated,
                text=row.text,
                cache=cache,
                cached_tokens=cache_tokens(cache),
                finish_reason=reason,
                timings=timings,
            )))
        return failed

    def _queue_row(self, i, row, fed):
        """Row `i`'s cache queued alone, a layer at a time (`queue_rows`), or the TurnError its failure makes."""
        try:
            return queue_rows(self.batch, [i], drop=int(fed), together=False)[0]
        except Exception as e:
            return _own_error(row.turn.turn_id, e, "extracting the cache failed")


def _steps_left(rows) -> int:
    """The most decode steps any of `rows` may still take (each ends by its max_tokens, or sooner)."""
    return max(r.turn.max_tokens - len(r.generated) for r in rows)


def _columns(cache) -> int:
    """Columns in use in a per-layer batch cache (its `size()`; 0 without layers)."""
    return cache[0].size() if cache else 0


def _width(cache) -> int:
    """Columns allocated in a per-layer batch cache (0 while empty): what attention's shapes follow."""
    layer = cache[0] if cache else None
    keys = getattr(layer, "keys", None)
    return 0 if keys is None else keys[0].shape[2]


def _bucketed(n: int, bucket: int) -> int:
    """`n` rounded up to a multiple of `bucket`."""
    return -(-n // bucket) * bucket


def _report_progress(row):
    if row.turn.on_progress:
        total = len(row.turn.tokens)
        _call(row.turn, "on_progress", total - len(row.pending), total)


_callbacks = threading.local()  # .name: the turn callback running on this thread (see running_callback)


def running_callback() -> str | None:
    """The name of the caller's callback this thread is running (a turn's `on_token`, `on_progress` or `cancel`,
    or a reply future's "done" callback), else None.

    They run on the Runtime's threads: a call that waits for the Runtime could wait for itself there."""
    return getattr(_callbacks, "name", None)


@contextlib.contextmanager
def running(name: str):
    """Within the block, `running_callback()` on this thread is `name`."""
    outer, _callbacks.name = running_callback(), name
    try:
        yield
    finally:
        _callbacks.name = outer


def passes_through(error: BaseException) -> bool:
    """Whether `error`, raised inside a caller's callback, goes on as it is rather than failing the callback's
    turn: a KeyboardInterrupt or SystemExit on the main thread (a Ctrl-C, or the caller's own exit). Anything a
    callback raises on the Runtime's threads, those included, is the callback's failure: the shared threads
    must outlive it."""
    return isinstance(error, (KeyboardInterrupt, SystemExit)) and threading.current_thread() is threading.main_thread()


def _call(turn, name: str, *args, truth: bool = False):
    """`turn.<name>(*args)` (a caller's callback), or with `truth` its answer's truth value (`bool`, which may
    run the caller's code too, as for a numpy array); whatever either raises becomes CallbackFailed (but what
    `passes_through`)."""
    try:
        with running(name):
            answer = getattr(turn, name)(*args)
            return bool(answer) if truth else answer
    except CallbackFailed as e:
        if e.turn_id == turn.turn_id:
            raise  # relayed from the caller's side, naming its callback (runtime.api.rayhost)
        raise CallbackFailed(turn.turn_id, f"its {name} callback raised CallbackFailed: {e}") from e
    except BaseException as e:
        if passes_through(e):
            raise
        raise CallbackFailed(turn.turn_id, f"its {name} callback raised {type(e).__name__}: {e}") from e


def _own_error(turn_id: str, error: Exception, what: str) -> TurnError:
    """The error that ends turn `turn_id` alone: a CallbackFailed as it is, anything else as a TurnError
    saying `what` failed and why."""
    if isinstance(error, CallbackFailed):
        return error
    return TurnError(turn_id, f"{what}: {type(error).__name__}: {error}")


def _sample_top_p(logits, temperature, top_p, key):
    # shifted so that the largest logit is 0, and divided by at least float32's smallest normal number: a
    # temperature too small for float32 (1e-300, which it rounds to 0) then keeps that logit at 0 and sends the
    # others to -inf, which is greedy, where they became +-inf and NaN
    # (a NaN logit, as from a broken model, is never drawn, and +inf counts as the largest finite float32)
    f32 = mx.finfo(mx.float32)
    logits = mx.nan_to_num(logits.astype(mx.float32), nan=-math.inf, posinf=f32.max, neginf=-math.inf)
    logits = (logits - logits.max()) / max(temperature, f32.smallest_normal)
    if top_p < 1.0:
        order = mx.argsort(-logits)
        probs = mx.softmax(logits[order])
        keep = (mx.cumsum(probs) - probs) < top_p
        masked = mx.where(keep, logits[order], -math.inf)
        return order[mx.random.categorical(masked, key=key)]
    return mx.random.categorical(logits, key=key)
