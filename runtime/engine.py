"""The step loop that serves many agents' turns on one model, with Q4 caches.

`Engine` knows nothing of actors: `submit` queues a `Turn`, each `step` does
one decode step for every decoding row and then at most one prefill chunk, and
returns the turns that finished (a `TurnResult`) or failed (a `TurnError`). A
turn is admitted when the memory budget allows, prefilled alone in chunks (so
a decoding row waits at most one chunk), then joins the decode batch
(`extend`) and leaves it when done (`filter` + `extract`).

Everything runs on the thread that calls `step` (MLX streams are per thread);
every array handed out (the result cache) is evaluated.
"""

from __future__ import annotations

import collections
import math
import os
import time
from dataclasses import dataclass, field
from typing import Callable

import mlx.core as mx

from runtime.detok import AnchoredDetokenizer
from runtime.q4cache import (
    cache_tokens,
    extend_cache,
    extract_cache,
    filter_cache,
    merge_caches,
    route_for,
)

BLOCK = 256


@dataclass(frozen=True)
class Sampling:
    """How to pick tokens: temperature 0 is greedy; `seed` makes sampling reproducible."""

    temperature: float = 0.0
    top_p: float = 1.0
    seed: int = 0


@dataclass
class Turn:
    """One request: feed `tokens` after `cache` (None: no history) and generate.

    `on_token`, if given, is called with each new piece of detokenized text, and
    `on_progress` with (tokens prefilled, tokens to prefill) after each prefill
    chunk, both on the engine's thread: keep them short and never block in them.
    An exception in either fails this turn only.
    """

    turn_id: str
    agent_id: str
    cache: list | None
    tokens: list[int]
    sampling: Sampling = Sampling()
    max_tokens: int = 128
    stop_tokens: tuple[int, ...] = ()
    stop_strings: tuple[str, ...] = ()
    on_token: Callable[[str], None] | None = None
    on_progress: Callable[[int, int], None] | None = None


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
    `finish_reason` is "stop" (eos, stop token or stop string) or "length".
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


class TurnError(RuntimeError):
    """A turn failed; `turn_id` says which. The engine stays usable."""

    def __init__(self, turn_id: str, message: str):
        super().__init__(f"turn {turn_id}: {message}")
        self.turn_id = turn_id


class TurnTooLarge(TurnError):
    """The turn can never fit the memory budget (or the context limit)."""


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


def default_memory_budget() -> int:
    """Half the device's memory (unified/GPU memory, else the host's RAM), in bytes."""
    size = mx.device_info().get("memory_size")
    if not size:
        size = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    return int(size) // 2


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
        max_batch: int = 8,
        route: str | None = None,
        max_prefill_chunk: int = 2048,
    ):
        self.model = model
        self.tokenizer = tokenizer
        self.spec = spec
        self.route = route_for(spec, route)
        self.memory_budget = memory_budget or default_memory_budget()
        self.max_batch = max_batch
        self.max_prefill_chunk = max_prefill_chunk
        self.waiting: collections.deque[_Row] = collections.deque()
        self.prefilling: list[_Row] = []
        self.decoding: list[_Row] = []
        self.batch = None  # per-layer BatchQuantizedKVCache of the decoding rows
        self.peak_admitted = 0
        per_token = spec.q4_bytes_per_token()
        if self.route == "dequant_once":
            per_token += spec.fp16_bytes_per_token()
        self._bytes_per_block = math.ceil(per_token * BLOCK)

    # -- public -------------------------------------------------------------------

    def submit(self, turn: Turn) -> None:
        """Queue `turn` (FIFO). Raises TurnTooLarge at once if it can never fit."""
        if not turn.tokens:
            raise TurnError(turn.turn_id, "no tokens to feed: a turn needs at least one new token")
        need = self.turn_bytes(turn)
        if need > self.memory_budget:
            raise TurnTooLarge(
                turn.turn_id,
                f"needs {need} bytes of KV cache but the whole budget is {self.memory_budget}; "
                "lower max_tokens, shorten the history, or raise memory_budget",
            )
        self.waiting.append(_Row(turn=turn, submitted=time.perf_counter(), reserved=need))

    def turn_bytes(self, turn: Turn) -> int:
        """Bytes reserved for `turn`: its final length in 256-token blocks."""
        total = cache_tokens(turn.cache) + len(turn.tokens) + turn.max_tokens
        return math.ceil(total / BLOCK) * self._bytes_per_block

    def has_work(self) -> bool:
        """True while any turn is queued, prefilling or decoding."""
        return bool(self.waiting or self.prefilling or self.decoding)

    def active(self) -> int:
        """Number of admitted turns (prefilling or decoding)."""
        return len(self.prefilling) + len(self.decoding)

    @property
    def reserved(self) -> int:
        """Bytes of the budget reserved by the admitted turns."""
        return sum(r.reserved for r in self.prefilling) + sum(r.reserved for r in self.decoding)

    def step(self) -> list:
        """Admit what fits, decode one token for every decoding row, prefill one chunk.

        Returns the turns that ended in this step: `TurnResult`s and `TurnError`s.
        """
        done = []
        self._admit()
        if self.decoding:
            done += self._decode_step()
        if self.prefilling:
            done += self._prefill_chunk()
        return done

    def fail_all(self, make_error: Callable[[str], Exception]) -> list:
        """End every queued and admitted turn with `make_error(turn_id)`; returns them."""
        rows = list(self.waiting) + self.prefilling + self.decoding
        self.waiting.clear()
        self.prefilling, self.decoding, self.batch = [], [], None
        return [make_error(r.turn.turn_id) for r in rows]

    # -- admission -------------------------------------------------------------------

    def _admit(self):
        now = time.perf_counter()
        while self.waiting and self.active() < self.max_batch:
            row = self.waiting[0]
            if self.reserved + row.reserved > self.memory_budget:
                break  # FIFO: nobody overtakes the head of the queue
            self.waiting.popleft()
            row.admitted = now
            row.pending = list(row.turn.tokens)
            row.cache = merge_caches(self.spec, [row.turn.cache], self.route)
            row.detok = AnchoredDetokenizer(self.tokenizer, row.turn.tokens[-1])  # spelled in context
            if row.turn.sampling.temperature > 0:
                row.key = mx.random.key(row.turn.sampling.seed)
            self.prefilling.append(row)
        self.peak_admitted = max(self.peak_admitted, self.active())

    # -- prefill -------------------------------------------------------------------

    def _prefill_chunk(self):
        row = self.prefilling[0]
        t0 = time.perf_counter()
        try:
            n = prefill_chunk_size(row.cache[0].size(), self.max_prefill_chunk)
            chunk, row.pending = row.pending[:n], row.pending[n:]
            logits = self.model(mx.array(chunk)[None], cache=row.cache)
            if row.pending:
                mx.eval([c.state for c in row.cache])
                row.prefill_s += time.perf_counter() - t0
                _report_progress(row)
                return []
            picks = self._sample([row], logits[:, -1, :])
            mx.eval(picks, [c.state for c in row.cache])
            token = picks.tolist()[0]
            row.prefill_s += time.perf_counter() - t0
            row.first_token = time.perf_counter()
            _report_progress(row)
        except Exception as e:
            self.prefilling.pop(0)
            return [TurnError(row.turn.turn_id, f"prefill failed: {type(e).__name__}: {e}")]
        self.prefilling.pop(0)
        if self.batch is None:
            self.batch = row.cache
        else:
            extend_cache(self.batch, row.cache)
        row.cache = None
        self.decoding.append(row)
        return self._accept([(len(self.decoding) - 1, token)])

    # -- decode -------------------------------------------------------------------

    def _decode_step(self):
        try:
            inputs = mx.array([[r.generated[-1]] for r in self.decoding])
            logits = self.model(inputs, cache=self.batch)
            picks = self._sample(self.decoding, logits[:, -1, :])
            mx.eval(picks, [c.state for c in self.batch])  # one sync per step
            tokens = picks.tolist()
        except Exception as e:
            rows, self.decoding, self.batch = self.decoding, [], None
            return [TurnError(r.turn.turn_id, f"decode step failed: {type(e).__name__}: {e}") for r in rows]
        return self._accept(list(enumerate(tokens)))

    def _sample(self, rows, logits):
        """The next token of every row (a lazy array): greedy, or seeded top-p sampling."""
        greedy = mx.argmax(logits, axis=-1)
        if all(r.turn.sampling.temperature <= 0 for r in rows):
            return greedy
        picks = []
        for i, r in enumerate(rows):
            s = r.turn.sampling
            if s.temperature <= 0:
                picks.append(greedy[i])
                continue
            r.key, sub = mx.random.split(r.key)
            picks.append(_sample_top_p(logits[i], s.temperature, s.top_p, sub))
        return mx.stack(picks)

    def _accept(self, row_tokens):
        """Record sampled tokens; finish rows that hit a stop; return their results."""
        finished, results = [], []
        for i, token in row_tokens:
            row = self.decoding[i]
            try:
                reason = self._add_token(row, token)
            except Exception as e:  # a failing on_token callback fails its own turn
                finished.append(i)
                results.append(TurnError(row.turn.turn_id, f"on_token raised {type(e).__name__}: {e}"))
                continue
            if reason:
                finished.append(i)
                results.append(self._finish(row, i, reason))
        if finished:
            keep = [i for i in range(len(self.decoding)) if i not in finished]
            self.decoding = [self.decoding[i] for i in keep]
            if keep:
                filter_cache(self.batch, keep)
            else:
                self.batch = None
            return results
        return []

    def _add_token(self, row, token) -> str | None:
        turn = row.turn
        row.generated.append(token)
        if token in self.tokenizer.eos_token_ids or token in turn.stop_tokens:
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
            turn.on_token(piece)
        if len(row.generated) >= turn.max_tokens:
            return "length"
        return None

    def _finish(self, row, i, reason):
        if reason == "length":
            row.detok.finalize()
            tail = row.detok.last_segment
            row.text += tail
            if tail and row.turn.on_token:
                row.turn.on_token(tail)
        try:
            cache = extract_cache(self.batch, i)
        except Exception as e:
            return TurnError(row.turn.turn_id, f"extracting the cache failed: {type(e).__name__}: {e}")
        now = time.perf_counter()
        timings = Timings(
            queue_s=row.admitted - row.submitted,
            ttft_s=row.first_token - row.submitted,
            prefill_tokens=len(row.turn.tokens),
            prefill_s=row.prefill_s,
            decode_tokens=len(row.generated),
            decode_s=now - row.first_token,
        )
        return TurnResult(
            turn_id=row.turn.turn_id,
            agent_id=row.turn.agent_id,
            tokens=row.generated,
            text=row.text,
            cache=cache,
            cached_tokens=cache_tokens(cache),
            finish_reason=reason,
            timings=timings,
        )


def _report_progress(row):
    if row.turn.on_progress:
        total = len(row.turn.tokens)
        row.turn.on_progress(total - len(row.pending), total)


def _sample_top_p(logits, temperature, top_p, key):
    logits = logits.astype(mx.float32) / temperature
    if top_p < 1.0:
        order = mx.argsort(-logits)
        probs = mx.softmax(logits[order])
        keep = (mx.cumsum(probs) - probs) < top_p
        masked = mx.where(keep, logits[order], -math.inf)
        return order[mx.random.categorical(masked, key=key)]
    return mx.random.categorical(logits, key=key)
