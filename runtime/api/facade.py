"""The Runtime: spawn agents, talk to them, and let supervision keep them alive.

    with Runtime(model=None, cache_dir="~/.cache/kvactors/agents") as rt:
        alice = rt.spawn("alice", system="You are Alice.")
        r = alice.ask("hi", max_tokens=64, timeout=60)   # a Reply: r.text, r.tokens, r.cache, r.timings

One Runtime owns one model: a batcher actor (the only thread that runs the
model), a persistence actor (caches and journals on disk), and a supervisor
per group (the agents; the batcher and persistence actor). Agents are found by
name: an `AgentRef` stays valid across restarts of the actor behind it.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import inspect
import logging
import math
import os
import queue
import sys
import threading
import time
import weakref
from dataclasses import dataclass, field
from pathlib import Path
from typing import AsyncIterator, Callable, Iterable, Iterator

import msgpack
import pykka

from actors import agent as agent_mod
from actors.agent import (DURABILITY, TURN_ID, AgentActor, AgentCrashed, AgentError, Ask, History, Lookup, Note, Reply,
                          Reset, TurnTimeout, TurnTooLong, UnknownAgent, new_turn_id)
from actors.batcher import STATS as _STATS, BatcherActor, BatcherStopped, Warmup
from actors.persistence import PersistenceActor
from actors.supervisor import RESTART_TYPES, STRATEGIES, Backoff, ChildSpec, Supervisor, UnknownChild
from runtime import chat, store
from runtime.deadlines import Deadlines, wait_seconds
from runtime.engine import MAX_TOKENS, Sampling, default_hot_budget, passes_through, running, running_callback
from runtime.errors import AdvisedError, InvalidArgument, InvalidArgumentType, KvactorsError, shown
from runtime.kvscheme import from_options as scheme_from_options
from runtime.model import load_model, token_rows
from runtime.q4cache import ROUTES, check_route
from runtime.qgemv import available as on_cuda

log = logging.getLogger(__name__)
DEFAULT_CACHE_DIR = "~/.cache/kvactors/agents"
TURN_TIMEOUT = 60.0  # seconds a turn may take unless its caller says otherwise (None: no watchdog)
MIN_IO_TIMEOUT = 1.0  # the shortest io_timeout: a shorter wait for a loaded disk crash-looped agents into escalation
RESTART_WAIT_S = 10.0  # seconds a call waits for an agent's restart before it raises AgentCrashed
STOP_WAIT_S = 60.0  # seconds `shutdown` waits for each group of actors to stop, and `AgentRef.stop` for its agent


def _emit(item, held, future) -> tuple[list, bool]:
    """What a stream yields for one queued item: text pieces, then (at the end) the `Reply`; and whether it ended."""
    if item is _END:
        reply = future.get(timeout=0)
        tail = held.end(reply.text)
        return ([tail] if tail else []) + [reply], True
    out = held.feed(item)
    return ([out] if out else []), False


def _print_progress(done: int, total: int, what: str) -> None:
    print(f"kvactors: warming up {done}/{total}: {what}", file=sys.stderr, flush=True)


def _shutdown_at_exit(runtime: "Runtime") -> None:
    # threading's exit hooks run before the interpreter joins non-daemon threads (atexit
    # runs after): the actors stop and flush there. A weak reference: no leak.
    ref = weakref.ref(runtime)
    threading._register_atexit(lambda: ref() is not None and ref().shutdown())


class RuntimeEscalated(AdvisedError, RuntimeError):
    """Supervision gave up (too many restarts in too short a time); the runtime is stopped.

    `detail` is the message without its advice on what to call next (an HTTP server words its own).
    """


class RuntimeClosed(AdvisedError, RuntimeError):
    """The Runtime was shut down; start a new one to talk to its agents again.

    `detail` is the message without its advice on what to call next (an HTTP server words its own).
    """


class WaitsInCallback(KvactorsError, RuntimeError):
    """A call that waits for the Runtime was made inside a turn's callback (`on_token`, `on_progress`, `cancel`,
    on the engine's thread) or a reply future's done callback (on the thread that answered the turn, an
    agent's): it would wait for itself, and every agent with it, or for the very agent it runs on."""


def never_fits(runtime, chars: int, reserved: int) -> bool:
    """Whether texts of `chars` characters in all are more than the model's positions less `reserved` can hold as
    tokens of `runtime`'s tokenizer, whatever they are (its longest token's characters each); False when either is
    unknown. Such texts are refused before tokenizing them, which would hold every thread up for nothing."""
    longest, positions = runtime.longest_token_chars, runtime.max_context
    return bool(longest and positions) and chars > (positions - reserved) * longest


def message_chars(text: str, sender: str | None = None) -> int:
    """The characters a message puts in the prompt, as `actors.agent.render_messages` renders it: a user message's
    sender with its text ("sender: text"; the separator left out, so the count never overstates), else the text."""
    return len(text) + len(sender or "")


def check_conversation_fits(runtime, what: str, messages: int, chars: int, reserved: int, leaving: str) -> None:
    """Raise InvalidArgument if a conversation (`what`, the subject of the message) of `messages` messages holding
    `chars` characters in all can never fit the model's positions with `reserved` of them left (`leaving` says for
    what), whatever the tokens: each message takes a position at least, and its characters a token's longest at
    most (`never_fits`). Nothing is refused where the model does not say its positions."""
    positions = runtime.max_context
    if positions is None:
        return
    if messages > positions - reserved:
        raise InvalidArgument(f"{what} has {messages} messages, each at least one of the model's {positions} "
                              f"positions, leaving none for {leaving}")
    if never_fits(runtime, chars, reserved):
        raise InvalidArgument(f"{what} has messages of {chars} characters: more tokens, whatever they are, than the "
                              f"model's {positions} positions leave after {leaving}")


def _not_in_callback(what: str) -> None:
    """Raise WaitsInCallback if this thread is running a turn's callback (see `engine.running_callback`)."""
    name = running_callback()
    if name is not None:
        raise WaitsInCallback(f"{what} waits for the Runtime, and this is one of its threads, running a {name} "
                              "callback: it would wait for itself. Inside a callback use send() or note(), which "
                              "return at once, and wait for their futures from another thread")


class WaitTimeout(KvactorsError, TimeoutError):
    """A wait on the Runtime (`flush`, `forget`, `agents`, `engine_stats`, `spawn`, `AgentRef.stop`, `shutdown`) ran
    past its `timeout`; the message says what goes on, and to call again to wait longer."""


class SystemPromptTooLong(AdvisedError, ValueError):
    """A system prompt that leaves the model no position for a turn: every turn would fail with TurnTooLong.
    `spawn` and `reset` raise it before anything starts or is recorded; `tokens` is the prompt's count (None where
    it was refused by its length in characters, before tokenizing) and `limit` the model's positions."""

    def __init__(self, tokens: int | None, chars: int, limit: int, advice: str = ": shorten it"):
        size = (f"{tokens} tokens of the model's {limit} positions and" if tokens is not None else
                f"{chars} characters: more tokens, whatever they are, than the model's {limit} positions, so it")
        super().__init__(f"the system prompt is {size} leaves none for a message and a reply", advice)
        self.tokens, self.chars, self.limit = tokens, chars, limit


class SystemPromptChanged(KvactorsError, ValueError):
    """`spawn` got a system prompt other than the one agent `agent` is stored with.

    Never silently ignored: pass `reset=True` to start the agent afresh with the new
    prompt (its history and cache are deleted), or pass no system prompt (or the stored
    one, `stored`) to resume it. `stored` is None when journal damage destroyed the
    record that held the prompt: the given one does not match the checksum its
    conversation's records keep.
    """

    def __init__(self, agent: str, stored: str | None, given: str):
        held = ("a system prompt that was lost to journal damage, whose checksum does not match" if stored is None
                else f"the system prompt {stored!r:.120}, not")
        super().__init__(
            f"agent {agent!r} is stored with {held} {given!r:.120}: pass reset=True "
            f"to start it afresh with the new prompt (deleting its history), or no system prompt to resume it; to "
            f"keep its history under a new prompt, resume it and call "
            f"ref.reset([r for r in ref.history() if r['role'] != 'system'], system=...)")
        self.agent, self.stored, self.given = agent, stored, given


@dataclass(frozen=True)
class AgentInfo:
    """One agent of `Runtime.agents()`: stored in `cache_dir` for this model, running, or both.

    `turns`: assistant replies in its history as recorded in its journal (a turn still
    in flight is not counted; None when the journal cannot be read: see `kvactors
    inspect`). `cache`: "hot" (in memory), "warm" (a cache file on disk) or "none"
    (its next turn prefills its whole history).
    """

    name: str
    running: bool
    turns: int | None
    cache: str


@dataclass
class DeadLetter:
    """A message that could not be delivered: to whom, what, and why."""

    recipient: str
    message: object
    reason: str
    at: float = field(default_factory=time.time)


DEAD_LETTERS_KEPT = 1000  # dead letters a runtime keeps in memory, the newest; older ones are dropped


class DeadLetters:
    """Undeliverable messages (`DeadLetter`), the newest `DEAD_LETTERS_KEPT` of them, oldest first: memory stays
    bounded however many a long run makes; `dropped` counts those let go (one warning says so). Thread-safe."""

    def __init__(self):
        self._letters: collections.deque[DeadLetter] = collections.deque(maxlen=DEAD_LETTERS_KEPT)
        self.dropped = 0
        self._lock = threading.Lock()

    def record(self, recipient: str, message, reason: str) -> DeadLetter:
        """Keep a dead letter of `message` to `recipient` and log it (a warning); return it."""
        log.warning("dead letter to %s: %s", recipient, reason)
        letter = DeadLetter(recipient, message, reason)
        self.keep(letter)
        return letter

    def keep(self, letter: DeadLetter) -> None:
        """Keep `letter` as it is (logged where it was recorded); where the deque is full, the oldest goes."""
        with self._lock:
            if len(self._letters) == self._letters.maxlen:
                self.dropped += 1
                if self.dropped == 1:
                    log.warning("more than %d dead letters: the oldest are dropped from now on",
                                self._letters.maxlen)
            self._letters.append(letter)

    def snapshot(self) -> list[DeadLetter]:
        """The dead letters kept, oldest first."""
        with self._lock:
            return list(self._letters)


class Env:
    """What all agents of one runtime share. Thread-safe; agents read it, never block on it."""

    def __init__(self, tokenizer, spec, durability, hot_budget, io_timeout, max_context=None):
        self.tokenizer, self.spec, self.durability = tokenizer, spec, durability
        self.io_timeout = wait_seconds(io_timeout)
        self.max_context = max_context  # the model's positions (None: unknown): a longer turn is refused
        self.hot = store.HotCaches(hot_budget)
        self.refs: dict[str, pykka.ActorRef] = {}  # name -> current actor (agents and services)
        self.dead_letters = DeadLetters()
        self.deadlines = Deadlines("kvactors-watchdog")  # every turn's timeout, on one thread
        self._lock = threading.Lock()
        self._changed = threading.Condition(self._lock)  # notified when a ref is registered
        self._held: list = []  # (Submit, agent ref) told while the batcher was down
        self._closed = False
        self._stopping: set[str] = set()  # agents the user is stopping (AgentRef.stop, forget)
        self._shutting_down = False  # the user is stopping every agent (Runtime.shutdown)
        self.forward: Callable | None = None  # forward(name, payload, future, reply): a note to an agent hosted elsewhere

    def register(self, name: str, ref: pykka.ActorRef) -> None:
        """Make `ref` the current actor of `name`; a new batcher gets the turns held for it."""
        with self._lock:
            self.refs[name] = ref
            held, self._held = (self._held, []) if name == "@batcher" else ([], self._held)
            self._changed.notify_all()
        for submit, agent in held:
            if agent.is_alive():
                self.submit_turn(submit, agent)

    def stopping(self, name: str, on: bool = True) -> None:
        """Mark agent `name` as being stopped by the user (`on`), or no longer (`on` off)."""
        with self._lock:
            (self._stopping.add if on else self._stopping.discard)(name)

    def shutting_down(self) -> None:
        """Mark every agent as being stopped by the user, for good: the Runtime is shutting down."""
        with self._lock:
            self._shutting_down = True

    def stopped_by_user(self, name: str) -> bool:
        """Whether agent `name` is being stopped by the user: for good, not by its supervisor to restart it."""
        with self._lock:
            return self._shutting_down or name in self._stopping

    def wait_changed(self, timeout: float) -> None:
        """Wait until a ref is registered, at most `timeout` seconds."""
        with self._lock:
            self._changed.wait(timeout)

    def submit_turn(self, submit, agent: pykka.ActorRef) -> None:
        """Tell `submit` to the batcher; while its supervisor restarts it, hold it for the next one.

        Held turns go to the new batcher when it is registered, or fail with
        BatcherStopped when the runtime closes first.
        """
        with self._lock:
            if not self._closed:
                try:
                    self.refs["@batcher"].tell(submit)
                    return
                except pykka.ActorDeadError:
                    self._held.append((submit, agent))
                    return
        submit.reply(BatcherStopped(submit.turn.turn_id, "the runtime is shut down"))

    def close(self) -> None:
        """Fail the held turns and stop the watchdog thread (the runtime is stopping). Idempotent."""
        with self._lock:
            self._closed = True
            held, self._held = self._held, []
            self._changed.notify_all()
        for submit, _ in held:
            submit.reply(BatcherStopped(submit.turn.turn_id, "the batcher did not come back before the runtime stopped"))
        self.deadlines.close()

    def render(self, system: str, records) -> str:
        """The chat-template text of a conversation, ending with the assistant's prompt."""
        return agent_mod.render(self.tokenizer, system, records)

    def batcher(self) -> pykka.ActorRef:
        """The current batcher actor (it may be dead while its supervisor restarts it)."""
        return self.refs["@batcher"]

    def persistence(self) -> pykka.ActorRef:
        """The current persistence actor (it may be dead while its supervisor restarts it)."""
        return self.refs["@persistence"]

    def notify(self, name: str, payload: bytes, future=None, reply=None) -> None:
        """Deliver a `Note` to agent `name`, or dead-letter it.

        With a `future` (a send_to reply), the agent resolves it with `reply` once the
        note is durable; a dead-lettered note resolves it at once.
        """
        ref = self.refs.get(name)
        if ref is None and self.forward is not None:  # not here: maybe on another node of the cluster
            self.forward(name, payload, future, reply)
            return
        try:
            if ref is None:
                raise pykka.ActorDeadError(name)
            ref.tell(Note(payload, future, reply))
        except pykka.ActorDeadError:
            self.dead_letter(name, payload, "no running agent with that name")
            if future is not None:
                future.set(reply)

    def dead_letter(self, recipient: str, message, reason: str) -> None:
        """Record an undeliverable message (inspect `Runtime.dead_letters`) and log it (`DeadLetters.record`)."""
        self.dead_letters.record(recipient, message, reason)


class ReplyFuture(pykka.ThreadingFuture):
    """A pykka future of a `Reply` that asyncio code awaits without blocking its event loop.

    `get(timeout=)` raises TurnTimeout (not pykka's Timeout) when no reply came in
    time; such a timeout only ends the wait: the turn may still finish and be
    recorded (see `AgentRef.history`). `await future` (inside a running event loop)
    suspends the coroutine and resumes it through `loop.call_soon_threadsafe` once
    the reply is set: no thread waits for it.
    """

    def __init__(self):
        super().__init__()
        self._callbacks: list | None = []
        self._callbacks_lock = threading.Lock()

    def get(self, *, timeout: float | None = None):
        """The Reply, or the turn's error; TurnTimeout if none came within `timeout` seconds (None: wait as long
        as it takes; else a number >= 0, ValueError or TypeError otherwise)."""
        if timeout is not None:
            _number("timeout", timeout)
            if not (_finite(timeout) and timeout >= 0):
                raise InvalidArgument(f"timeout must be None or a finite number >= 0, got {shown(timeout)}")
        if running_callback() is not None and timeout != 0:  # get(timeout=0) polls: fine anywhere
            try:
                return super().get(timeout=0)  # a reply already here is fine to read
            except pykka.Timeout:
                _not_in_callback("waiting for a reply")
        try:
            return super().get(timeout=wait_seconds(timeout))
        except pykka.Timeout:
            raise TurnTimeout(getattr(self, "turn_id", None), f"no reply within {timeout}s; the turn may still "
                              "finish", ": wait again, or retry with the same turn_id") from None

    def add_done_callback(self, fn: Callable[["ReplyFuture"], None]) -> None:
        """Call `fn(self)` once the future is set: at once if it is, else on the setting thread (the Runtime's:
        calls there that wait for it, such as `ask`, raise WaitsInCallback; `send` returns at once)."""
        with self._callbacks_lock:
            if self._callbacks is not None:
                self._callbacks.append(fn)
                return
        fn(self)

    def set(self, value=None) -> None:
        """Set the value (see `pykka.Future.set`), then run the done callbacks."""
        super().set(value)
        self._run_callbacks()

    def set_exception(self, exc_info=None) -> None:
        """Set the exception (see `pykka.Future.set_exception`), then run the done callbacks."""
        super().set_exception(exc_info or sys.exc_info())
        self._run_callbacks()

    def _run_callbacks(self):
        with self._callbacks_lock:
            callbacks, self._callbacks = self._callbacks or [], None
        for fn in callbacks:
            try:
                with running("done"):
                    fn(self)
            except BaseException as e:  # a callback must never break the thread that set the future
                if passes_through(e):
                    raise
                log.exception("a done callback of a reply future failed")

    def __await__(self):
        return _on_loop(self, asyncio.get_running_loop()).__await__()


def _on_loop(future: ReplyFuture, loop: asyncio.AbstractEventLoop) -> asyncio.Future:
    """An asyncio future on `loop` that takes `future`'s outcome when it is set."""
    result = loop.create_future()

    def settle():
        if not result.done():
            try:
                result.set_result(future.get(timeout=0))
            except Exception as e:
                result.set_exception(e)

    def done(_):
        try:
            loop.call_soon_threadsafe(settle)
        except RuntimeError:  # the loop was closed meanwhile: nobody is waiting any more
            pass

    future.add_done_callback(done)
    return result


class _Pieces:
    """Streamed text, held back by as much as a stop string could still cut off.

    The engine cuts a reply before a stop string only once the whole string is
    there, so a piece could end in its first characters: those are held back
    until the next piece or the end. What `feed` returns, then `end`, adds up to
    exactly `Reply.text`.
    """

    def __init__(self, stop):
        self.hold = max((len(s) for s in stop), default=1) - 1
        self.text, self.sent = "", 0

    def feed(self, piece: str) -> str:
        self.text += piece
        upto = max(self.sent, len(self.text) - self.hold)
        out, self.sent = self.text[self.sent:upto], upto
        return out

    def end(self, reply_text: str) -> str:
        return reply_text[self.sent:]


_END = object()


_async_sends: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # event loop -> {(runtime, agent): its last send}


class _BeginOrCallOff:
    """Work that one thread begins and another may call off, whichever comes first: once begun it cannot be called
    off, once called off it never begins. The start of a spawn the supervisor has not begun within its wait, and a
    send an asyncio call cancelled before it told the agent."""

    def __init__(self):
        self._lock, self.state = threading.Lock(), "pending"  # then "begun" or "called off"
        self.late: Callable[[], None] | None = None  # what a call-off that came once the work had begun calls

    def begin(self) -> bool:
        """Begin the work unless it was called off; whether it may go on."""
        with self._lock:
            if self.state == "pending":
                self.state = "begun"
            return self.state == "begun"

    def call_off(self) -> bool:
        """Call the work off unless it has begun; whether it was called off. Once it has begun, `late()` is called
        if set: the work may still be called off further on, where it goes on (a cluster's host, which tells the
        agent)."""
        with self._lock:
            if self.state == "pending":
                self.state = "called off"
            called_off, late = self.state == "called off", self.late
        if not called_off and late is not None:
            late()
        return called_off


def _begin_send(future, called_off: bool = False) -> None:
    """Begin `future.tell` (its `_BeginOrCallOff`, if any) right before its turn is told to the agent: CancelledError
    if the asyncio call that sends it was cancelled before (or `called_off`: the sender heard of a cancellation after
    an earlier begin, such as a cluster's call that is sent again), and nothing is sent."""
    tell = getattr(future, "tell", None)
    if tell is not None and (not tell.begin() or called_off):
        raise asyncio.CancelledError(f"turn {getattr(future, 'turn_id', None)}: its call was cancelled before it was "
                                     "sent")


class AgentRef:
    """A stable handle on an agent, valid across restarts of its actor."""

    def __init__(self, runtime: "Runtime", name: str):
        self.runtime, self.name = runtime, name

    def __repr__(self):
        return f"AgentRef({self.name!r})"

    async def _send_off_loop(self, text: str, **options) -> ReplyFuture:
        """`send` in a thread of the running loop's default executor, after every earlier `_send_off_loop` to this
        agent on this loop has sent: turns started in one order on a loop reach the agent in that order, as they did
        when `send` ran on the loop, while a send that waits for a restart holds up no other agent's.

        A call cancelled before its turn is sent never sends it: the thread asks right before it tells the agent
        (after any wait for a restart), and the cancellation and that question take one lock, so the turn is
        either sent whole or not at all. One cancelled after that goes on, as any awaited turn whose await ends."""
        loop = asyncio.get_running_loop()
        queued = _async_sends.setdefault(loop, {})
        key = (id(self.runtime), self.name)
        before, mine = queued.get(key), loop.create_future()
        queued[key] = mine
        tell, sending = _BeginOrCallOff(), None  # begun by the thread right before it tells the agent
        try:
            if before is not None:
                await asyncio.shield(before)
            sending = asyncio.ensure_future(asyncio.to_thread(self._send, text, tell=tell, **options))
            return await asyncio.shield(sending)
        except asyncio.CancelledError:
            tell.call_off()
            raise
        finally:  # cancelled while waiting: the next send still waits for the one before, or for this one's tell
            after = before if before is not None and not before.done() else None
            if tell.state == "begun" and not sending.done():
                after = sending
                sending.add_done_callback(lambda done: done.cancelled() or done.exception())  # nobody awaits it
            if after is None:
                mine.set_result(None)
            else:
                after.add_done_callback(lambda _: mine.set_result(None))
            if queued.get(key) is mine:
                del queued[key]

    def send(self, text: str, *, max_tokens: int = MAX_TOKENS, temperature: float = Sampling.temperature,
             top_p: float = Sampling.top_p, seed: int = Sampling.seed, stop: str | Iterable[str] = (),
             timeout: float | None = TURN_TIMEOUT, sender: str | None = None, conversation_id: str | None = None,
             turn_id: str | None = None, on_token: Callable[[str], None] | None = None,
             on_progress: Callable[[int, int], None] | None = None,
             cancel: Callable[[], bool] | None = None) -> ReplyFuture:
        """Queue a turn on `text`; return a future of its `Reply` (`await` it in asyncio code).

        `max_tokens`: tokens to generate at most. `temperature` (0: greedy), `top_p`
        (0: greedy too) and `seed` pick the tokens; `stop` ends the reply before the first of these
        strings. The future raises AgentCrashed (with the turn id) if the agent crashes
        in the turn, TurnTimeout `timeout` seconds after this call (None disables the
        watchdog; the wait behind the agent's earlier work counts: a turn whose time ran
        out before it started never runs, and one that started is cancelled at the
        batcher's next step unless it finished meanwhile; `result(turn_id)` says which:
        no crash, no restart),
        UnknownAgent if the agent is gone, TurnTooLong if the turn needs more positions than
        the model has (raised here at once for a message that could never fit, before it is
        tokenized). `sender` attributes the message to another
        agent; `conversation_id` is recorded with the turn's journal records. While the
        agent restarts, `send` itself waits for it, up to RESTART_WAIT_S seconds (then
        AgentCrashed): asyncio code uses `ask_async` or `astream`, which send off the event loop.

        `on_token(piece)` gets the reply's text piece by piece while it decodes (the
        last pieces may hold the start of a stop string the reply then drops), and
        `on_progress(done, total)` the tokens prefilled so far after each prefill
        chunk. Both run on the batcher's thread: keep them short and never block in
        them; an exception in one (or in `cancel`) fails the turn with CallbackFailed: nothing
        is recorded and the agent goes on. `cancel()` is asked
        after each generated token (on the batcher's thread too, so make it cheap, e.g.
        `threading.Event().is_set`); once it returns True the turn ends with the text so
        far, `finish_reason` "cancelled", and is stored like any other turn. On a
        cluster runtime the three run in the caller's process instead, on a thread of
        the runtime's, and `cancel()` is asked after each piece that arrives there (see
        runtime/api/cluster.py).

        `turn_id` (default: a fresh one, `future.turn_id`) is the idempotency key:
        every error carries it, and a send with the id of a turn that already
        committed returns that turn's reply (cache "committed") instead of running it
        again. So after any error or timeout, retrying with the same id is safe.

        Every option is checked here, in the caller's thread, before any actor sees the
        turn: a bad one raises TypeError or ValueError (see `check_turn_options`).
        `stop` is one string or an iterable of strings.
        """
        return self._send(text, max_tokens=max_tokens, temperature=temperature, top_p=top_p, seed=seed, stop=stop,
                          timeout=timeout, sender=sender, conversation_id=conversation_id, turn_id=turn_id,
                          on_token=on_token, on_progress=on_progress, cancel=cancel)

    def _send(self, text, *, max_tokens, temperature, top_p, seed, stop, timeout, sender, conversation_id, turn_id,
              on_token, on_progress, cancel, reply_to_agent=None, tell=None) -> ReplyFuture:
        """`send`, and `send_to`'s way in: `reply_to_agent` also gets the reply, as a message (see `send_to`).
        `tell` (a `_BeginOrCallOff`) is begun right before the turn is told to the agent; called off, it is not sent
        (CancelledError)."""
        stop = check_turn_options(text, max_tokens, temperature, top_p, seed, stop, timeout,
                                  self.runtime.max_context)
        if sender is not None:
            store.check_agent_id(sender)
        if turn_id is None:
            turn_id = new_turn_id(self.name)
        elif not isinstance(turn_id, str) or not TURN_ID.fullmatch(turn_id):
            raise InvalidArgument(f"turn_id must match {TURN_ID.pattern}, got {turn_id!r}")
        # a message that can never fit is refused here (`never_fits`)
        if never_fits(self.runtime, len(text), max_tokens):
            positions = self.runtime.max_context
            raise TurnTooLong(turn_id, f"the message has {len(text)} characters: more tokens, whatever they are, "
                                       f"than the {positions - max_tokens} positions the model has left after "
                                       f"max_tokens {max_tokens}", "message", "; shorten it")
        for name, fn in (("on_token", on_token), ("on_progress", on_progress), ("cancel", cancel)):
            if fn is not None and not callable(fn):
                raise InvalidArgumentType(f"{name} must be a callable or None, got {type(fn).__name__}")
        if conversation_id is not None and not isinstance(conversation_id, str):
            raise InvalidArgumentType(f"conversation_id must be a str or None, got {type(conversation_id).__name__}")
        if conversation_id is not None:
            check_unicode("conversation_id", conversation_id)
            if len(conversation_id) > MAX_CONVERSATION_ID:  # the journal keeps it with the turn
                raise InvalidArgument(f"conversation_id has {len(conversation_id)} characters; at most "
                                      f"{MAX_CONVERSATION_ID}")
        payload = agent_mod.encode_message(
            text, sender, max_tokens=max_tokens, temperature=float(temperature), top_p=float(top_p), seed=seed,
            stop=list(stop), timeout=timeout, conversation_id=conversation_id, reply_to_agent=reply_to_agent,
            turn_id=turn_id, deadline=None if timeout is None else time.monotonic() + timeout,
        )
        future = ReplyFuture()
        future.turn_id, future.stop = turn_id, stop  # the stop strings as checked: a str is one of them
        future.tell = tell  # `Runtime._deliver` begins it right before it tells the agent
        self.runtime._deliver(self.name, Ask(payload, future, on_token, on_progress, cancel), future)
        return future

    def ask(self, text: str, *, max_tokens: int = MAX_TOKENS, temperature: float = Sampling.temperature,
            top_p: float = Sampling.top_p, seed: int = Sampling.seed, stop: str | Iterable[str] = (),
            timeout: float | None = TURN_TIMEOUT, sender: str | None = None, conversation_id: str | None = None,
            turn_id: str | None = None, on_token: Callable[[str], None] | None = None,
            on_progress: Callable[[int, int], None] | None = None, cancel: Callable[[], bool] | None = None) -> Reply:
        """Take a turn on `text` and wait for its `Reply`; the options and errors are `send`'s.

        Raises WaitsInCallback inside a turn's callback, before anything is sent."""
        _not_in_callback("ask()")
        future = self.send(text, max_tokens=max_tokens, temperature=temperature, top_p=top_p, seed=seed, stop=stop,
                           timeout=timeout, sender=sender, conversation_id=conversation_id, turn_id=turn_id,
                           on_token=on_token, on_progress=on_progress, cancel=cancel)
        return future.get(timeout=None if timeout is None else timeout + 5)

    async def ask_async(self, text: str, *, max_tokens: int = MAX_TOKENS, temperature: float = Sampling.temperature,
                        top_p: float = Sampling.top_p, seed: int = Sampling.seed, stop: str | Iterable[str] = (),
                        timeout: float | None = TURN_TIMEOUT, sender: str | None = None,
                        conversation_id: str | None = None, turn_id: str | None = None,
                        on_token: Callable[[str], None] | None = None,
                        on_progress: Callable[[int, int], None] | None = None,
                        cancel: Callable[[], bool] | None = None) -> Reply:
        """`ask` for asyncio code: awaits the reply without blocking the event loop; the options are `send`'s.

        `send` runs in a thread of the loop's default executor (`asyncio.to_thread`), as it waits while the agent
        restarts (up to RESTART_WAIT_S seconds): the loop runs on meanwhile, and its errors raise here. No thread
        waits for the reply: it is handed to the running loop when it is set. A call cancelled (`wait_for`,
        `task.cancel()`) before its turn was sent never sends it; once sent, the turn goes on and is recorded,
        as when an `await` of `send`'s future is cancelled.
        """
        reply = await self._send_off_loop(text, max_tokens=max_tokens, temperature=temperature, top_p=top_p, seed=seed,
                                          stop=stop, timeout=timeout, sender=sender, conversation_id=conversation_id,
                                          turn_id=turn_id, on_token=on_token, on_progress=on_progress, cancel=cancel)
        try:
            return await asyncio.wait_for(_on_loop(reply, asyncio.get_running_loop()),
                                          None if timeout is None else timeout + 5)
        except asyncio.TimeoutError:
            raise TurnTimeout(reply.turn_id, f"{self.name} did not answer within {timeout}s") from None

    def stream(self, text: str, *, max_tokens: int = MAX_TOKENS, temperature: float = Sampling.temperature,
               top_p: float = Sampling.top_p, seed: int = Sampling.seed, stop: str | Iterable[str] = (),
               timeout: float | None = TURN_TIMEOUT, sender: str | None = None, conversation_id: str | None = None,
               turn_id: str | None = None, on_progress: Callable[[int, int], None] | None = None,
               cancel: Callable[[], bool] | None = None) -> Iterator[str | Reply]:
        """Take a turn on `text`; iterate over its reply's text pieces as they are decoded, then the `Reply`.

        The pieces arrive in order while the batch decodes, and add up to exactly
        `Reply.text`; the last item is the `Reply` itself. The options are `send`'s
        (except `on_token`); bad options raise here, before anything is sent. Iterating
        raises what `ask` raises, after the pieces that came before the failure.
        """
        _not_in_callback("stream()")  # before anything is sent: the turn would run for no one
        pieces: queue.SimpleQueue = queue.SimpleQueue()
        future = self.send(text, max_tokens=max_tokens, temperature=temperature, top_p=top_p, seed=seed, stop=stop,
                           timeout=timeout, sender=sender, conversation_id=conversation_id, turn_id=turn_id,
                           on_token=pieces.put, on_progress=on_progress, cancel=cancel)
        future.add_done_callback(lambda _: pieces.put(_END))
        return self._stream(future, pieces, _Pieces(future.stop), timeout)

    def _stream(self, future, pieces, held, timeout):
        while True:
            try:
                item = pieces.get(timeout=wait_seconds(None if timeout is None else timeout + 5))
            except queue.Empty:
                raise TurnTimeout(future.turn_id, f"{self.name} did not answer within {timeout}s") from None
            outs, done = _emit(item, held, future)
            for out in outs:
                yield out
            if done:
                return

    async def astream(self, text: str, *, max_tokens: int = MAX_TOKENS, temperature: float = Sampling.temperature,
                      top_p: float = Sampling.top_p, seed: int = Sampling.seed, stop: str | Iterable[str] = (),
                      timeout: float | None = TURN_TIMEOUT, sender: str | None = None,
                      conversation_id: str | None = None, turn_id: str | None = None,
                      on_progress: Callable[[int, int], None] | None = None,
                      cancel: Callable[[], bool] | None = None) -> AsyncIterator[str | Reply]:
        """`stream` for asyncio code: `async for piece in ref.astream(text)`; the last item is the `Reply`.

        The options are `send`'s (except `on_token`); `send` runs off the event loop, as in
        `ask_async`, and a cancellation acts as there. Pieces reach the running loop through
        `call_soon_threadsafe`: no thread waits for them. Bad options raise when the iteration starts.
        """
        loop = asyncio.get_running_loop()
        pieces: asyncio.Queue = asyncio.Queue()

        def put(item):
            try:
                loop.call_soon_threadsafe(pieces.put_nowait, item)
            except RuntimeError:  # the loop was closed: nobody is listening any more
                pass

        future = await self._send_off_loop(text, max_tokens=max_tokens, temperature=temperature, top_p=top_p, seed=seed,
                                           stop=stop, timeout=timeout, sender=sender, conversation_id=conversation_id,
                                           turn_id=turn_id, on_token=put, on_progress=on_progress, cancel=cancel)
        future.add_done_callback(lambda _: put(_END))
        held, wait_s = _Pieces(future.stop), None if timeout is None else timeout + 5
        while True:
            try:
                item = await asyncio.wait_for(pieces.get(), wait_s)
            except asyncio.TimeoutError:
                raise TurnTimeout(future.turn_id, f"{self.name} did not answer within {timeout}s") from None
            outs, done = _emit(item, held, future)
            for out in outs:
                yield out
            if done:
                return

    def send_to(self, other: "AgentRef", text: str, *, max_tokens: int = MAX_TOKENS,
                temperature: float = Sampling.temperature, top_p: float = Sampling.top_p, seed: int = Sampling.seed,
                stop: str | Iterable[str] = (), timeout: float | None = TURN_TIMEOUT,
                conversation_id: str | None = None, turn_id: str | None = None,
                on_token: Callable[[str], None] | None = None, on_progress: Callable[[int, int], None] | None = None,
                cancel: Callable[[], bool] | None = None) -> ReplyFuture:
        """Send `text` from this agent to `other`, which takes a turn on it; the options are `send`'s.

        The reply is also added to this agent's history as a message from `other`,
        without starting a turn here. The returned future resolves with `other`'s Reply
        once `other`'s turn and this agent's copy of the reply are both durable (with
        durability="durable"); the copy waits behind this agent's own turn in progress,
        if any. If this agent is not running, crashes or cannot record the copy, the
        copy goes to `Runtime.dead_letters` and the future still resolves with the reply
        (`other`'s turn happened). It fails as `send` does when `other`'s turn fails.
        Raises TypeError unless `other` is an AgentRef, and ValueError if it is this agent or
        belongs to another Runtime.
        """
        _agent_refs(self.runtime, [other], "send_to")  # the reply's copy could not reach this agent from another
        if other.name == self.name:
            raise InvalidArgument(f"agent {self.name!r} cannot send to itself: "
                                  "use send() or ask() for a turn of its own")
        return other._send(text, max_tokens=max_tokens, temperature=temperature, top_p=top_p, seed=seed, stop=stop,
                           timeout=timeout, sender=self.name, conversation_id=conversation_id, turn_id=turn_id,
                           on_token=on_token, on_progress=on_progress, cancel=cancel, reply_to_agent=self.name)

    def result(self, turn_id: str, timeout: float = 60.0) -> Reply | None:
        """The Reply of turn `turn_id` if it committed (cache "committed"), None if it never did.

        For a caller whose wait ended without an answer (TurnTimeout, AgentCrashed, a
        lost connection): the agent answers once it has finished everything sent to it
        before this call, so a turn with that id still queued or in progress has then
        either committed or failed for good. Turns of earlier conversations (before a
        `reset`) are found too, as a retry with the same `turn_id` finds them. Raises
        ValueError for a malformed id, UnknownAgent if the agent is not running,
        JournalError if its journal cannot be read, and AgentError if no answer came
        within `timeout` seconds.
        """
        if not isinstance(turn_id, str) or not TURN_ID.fullmatch(turn_id):
            raise InvalidArgument(f"turn_id must match {TURN_ID.pattern}, got {turn_id!r}")
        _positive("timeout", timeout)
        _not_in_callback("result()")
        return _queued_answer(self.runtime._deliver, self.name, lambda future: Lookup(turn_id, future), timeout,
                              f"did not say within {timeout}s whether turn {turn_id} committed; it is busy: ask again",
                              "about this turn; ask again", turn_id)

    def history(self, timeout: float = 60.0) -> list[dict]:
        """This agent's conversation as journal records (seq, role, text, sender, ...), oldest first.

        The agent answers once it has finished everything sent to it before this call, so
        the history holds every note and reset sent before it, and every turn sent before
        it that committed. Raises JournalError while the agent's journal cannot be read (fix
        or move the file aside), UnknownAgent if the agent is not running, AgentError if no
        answer came within `timeout` seconds (it is busy: ask again), and WaitsInCallback
        inside a turn's callback.
        """
        _positive("timeout", timeout)
        _not_in_callback("history()")
        return self.runtime._history(self.name, timeout)

    def note(self, text: str, sender: str | None = None) -> None:
        """Append a user message to the history without taking a turn (in order with turns).

        `sender` labels the message in the rendered conversation ("sender: text"), as in `reset`'s records.
        Raises ValueError for an empty text, or one longer (with its sender) than any turn could hold (every later
        turn would fail with TurnTooLong), TypeError for a text that is not a str or a sender that is not a str or
        None."""
        if not isinstance(text, str):
            raise InvalidArgumentType(f"a note's text must be a str, got {type(text).__name__} (decode bytes first)")
        if not text:
            raise InvalidArgument("a note needs a non-empty text")
        if sender is not None and not isinstance(sender, str):
            raise InvalidArgumentType(f"sender must be a str or None, got {type(sender).__name__}")
        chars = message_chars(text, sender)
        if never_fits(self.runtime, chars, 1):
            raise InvalidArgument(f"the note has {chars} characters with its sender: more tokens, whatever they are, "
                                  f"than the model's {self.runtime.max_context} positions leave for it; shorten it")
        check_unicode("a note's text", text)
        if sender is not None:
            check_unicode("sender", sender)
        self.runtime._deliver(self.name, Note(agent_mod.encode_message(text, sender)), None)

    def reset(self, records: list[dict], system: str | None = None) -> ReplyFuture:
        """Start the conversation over from `records`; return a future that resolves (to None) once durable.

        `records` are {"role": "user" | "assistant", "text": str, "sender": str | None}
        dicts, oldest first (the shape `history()` returns); an assistant record may keep the
        "tokens" (a list of token ids) it was generated as, as `history()` gives them, so that a
        turn that re-prefills the conversation feeds the reply as those tokens where they spell its
        text (as a cached turn does), not its text tokenized again. `system` replaces the system
        prompt; None keeps it, unless `records` hold a system record (as `history()` does):
        then the last one's text is the prompt (ValueError if `system` says another).
        Queued after the agent's pending work. The journal keeps the old conversation; `history()` shows only the new one. The
        cache is kept and the next turn reuses the prefix of it that the new conversation still
        renders to, where that prefix is most of the cached text (`runtime.prefix`: 80%; else
        the turn re-prefills). Raises ValueError for a malformed record, SystemPromptTooLong for a `system` that
        leaves the model no position for a turn, InvalidArgument for records (with `system`) that can never fit the
        model's positions with a message and a reply (`check_conversation_fits`), TypeError for records that are
        not a list of dicts or a `system` that is not a str or None.
        """
        if not isinstance(records, (list, tuple)) or not all(isinstance(r, dict) for r in records):
            raise InvalidArgumentType(f"records must be a list of dicts (the shape history() returns), "
                                      f"got {records!r:.100}")
        clean, prompts = [], [r.get("text") for r in records if r.get("role") == "system"]
        if prompts:  # history()'s shape: its system record says the prompt
            if not isinstance(prompts[-1], str) or system not in (None, prompts[-1]):
                raise InvalidArgument(f"records say the system prompt is {prompts[-1]!r:.100} and system= says "
                                      f"{system!r:.100}; give one of them (to set system=, leave the system record out: "
                                      "[r for r in records if r['role'] != 'system'])")
            system = prompts[-1]
        for r in records:
            if r.get("role") == "system":
                continue
            if r.get("role") not in ("user", "assistant") or not isinstance(r.get("text"), str):
                raise InvalidArgument(f"a record needs role 'user' or 'assistant' and a str text, got {r!r:.200}")
            sender = r.get("sender")
            if sender is not None and not isinstance(sender, str):
                raise InvalidArgument(f"a record's sender is a str or None, got {sender!r:.100}")
            check_unicode("a record's text", r["text"])
            if sender is not None:
                check_unicode("a record's sender", sender)
            clean.append({"role": r["role"], "text": r["text"], "sender": sender})
            if r["role"] == "assistant" and r.get("tokens") is not None:
                clean[-1]["tokens"] = _token_ids(r["tokens"], self.runtime.vocab_size)
        if system is not None and not isinstance(system, str):
            raise InvalidArgumentType(f"system must be a str or None, got {type(system).__name__}")
        if system is not None:
            check_unicode("system", system)
            self.runtime._check_system_fits(system)
        # every record ends up in the next turn's prompt: a conversation that can never fit would fail every later turn
        chars = sum(message_chars(r["text"], r["sender"] if r["role"] == "user" else None) for r in clean)
        check_conversation_fits(self.runtime, "the conversation", len(clean), chars + len(system or ""), 2,
                                "a message and a token of reply; drop or shorten records")
        future = ReplyFuture()
        payload = msgpack.packb({"system": system, "records": clean})
        self.runtime._deliver(self.name, Reset(payload, future), future)
        return future

    def stop(self) -> None:
        """Stop the agent for good (no restart); its durable state stays on disk.

        Returns once it has stopped. A turn of its still running or waiting then fails with
        `AgentStopped` (not acknowledged, not in the history), and its waiting notes go
        to the dead letters. (An agent its supervisor stops to restart it with a crashed
        sibling fails such turns with `AgentCrashed`: it comes back by itself.)
        Raises WaitsInCallback inside a turn's callback, and WaitTimeout if the agents' supervisor has not stopped
        it within STOP_WAIT_S seconds (busy with another agent's stop): the stop goes on and the agent takes no more
        messages; a call again waits for the stop.
        """
        _not_in_callback(f"stopping agent {self.name!r}")
        self.runtime._stop_agent(self.name)


class Runtime:
    """Agents on one model; see the module docstring. Use as a context manager.

    model: folder, .gguf file, Hugging Face id or "tiny"; None: the default (SmolLM2-135M-Instruct, or $KVACTORS_MODEL).
    cache_dir: where caches and journals live (per model fingerprint, per agent); None: DEFAULT_CACHE_DIR,
    ~/.cache/kvactors/agents (not under $KVACTORS_HOME, which holds models).
    kv_scheme: how the KV cache is quantized, a `runtime.kvscheme` name such as
    "k6v4-g64-hadamard" (None: the model's default, `kvscheme.default_scheme`).
    kv_bits (4 or 8) / kv_group_size (32, 64 or 128) instead pick the unrotated
    scheme of that many bits for keys and values (defaults 4 and 64). A cache stored
    under another scheme is re-prefilled. memory_budget: bytes of KV cache the
    batcher may hold for running turns (None: half the device memory).
    hot_budget: bytes of agents' caches kept in memory between turns (None: an eighth
    of the device memory); beyond it the least recently used go "warm" (disk only).
    max_batch: turns decoded together at most (16: the rows one call of the CUDA
    decode kernels serves). durability: "durable" (a turn
    is acknowledged once its journal records are fsynced; its cache file follows in
    the background, see `flush`) or "memory" (at once).
    route: how attention reads the Q4 cache, one of `q4cache.ROUTES` ("quantized",
    "dequant", "dequant_once", "q4kernel"; None: the machine's default for the model, `q4cache.route_for`:
    "dequant_once" for a model whose code reads keys and values as arrays, as phi's does). The model is
    checked on it at load: a route that fails it raises ModelLoadError (naming "dequant_once" where that one
    serves it), one its layout refuses (attention sinks on "quantized") Q4CacheError.
    strategy / max_restarts / restart_period / backoff: agent supervision.
    retention_s: at start, delete the cache files (never the journals) of agents idle
    longer than this many seconds (None: keep them); such an agent re-prefills.
    on_escalate(name, error): called when supervision gives up; the runtime then stops.
    io_timeout: seconds an agent waits for the persistence actor when it loads its
    history or cache (60; at least 1).
    warmup: serve synthetic turns at start (`Engine.warmup`, a progress line per stage on
    stderr), so MLX's one-time, per-shape setup is paid before the first real turn.
    None (the default): on CUDA only, where a fresh process's first turn otherwise
    spends tens of seconds compiling kernels (longer than a turn's default timeout on
    an H100); it buys little elsewhere.
    cluster / address: run the agents on a Ray cluster instead of in this process
    (`cluster="ray"`, or the `address` of a running cluster, e.g. "ray://head:10001" or
    "auto"): then `Runtime(...)` returns a `runtime.api.cluster.ClusterRuntime` with the
    same methods for agents (see there); it needs `pip install 'kvactors[ray]'`.
    """

    def __new__(cls, *args, cluster: str | None = None, address: str | None = None, **options):
        if cls is Runtime and (cluster is not None or address is not None):
            from runtime.api.cluster import ClusterRuntime  # Ray stays unimported unless asked for

            return ClusterRuntime(*args, cluster=cluster, address=address, **options)
        return super().__new__(cls)

    def __init__(self, model=None, cache_dir=None, kv_bits: int | None = None, memory_budget: int | None = None, *,
                 hot_budget: int | None = None, durability: str = "durable", max_batch: int = 16,
                 route: str | None = None, strategy: str = "one_for_one", max_restarts: int = 3,
                 restart_period: float = 5.0, backoff: Backoff = Backoff(min=0.01, max=1.0, reset=10.0),
                 retention_s: float | None = None, on_escalate=None, io_timeout: float = 60.0,
                 warmup: bool | None = None, kv_group_size: int | None = None, kv_scheme: str | None = None,
                 cluster: str | None = None, address: str | None = None):
        scheme = scheme_from_options(kv_bits, kv_group_size, kv_scheme)
        _check_options(memory_budget=memory_budget,
                       hot_budget=hot_budget, durability=durability,
                       max_batch=max_batch, route=route, strategy=strategy, max_restarts=max_restarts,
                       restart_period=restart_period, backoff=backoff, retention_s=retention_s,
                       on_escalate=on_escalate, io_timeout=io_timeout, warmup=warmup)
        self._lock = self._services = self._supervisor = self._env = None
        self._closed = False
        self._escalation: tuple | None = None
        self._on_escalate = on_escalate
        self._names: dict[str, None] = {}  # running agents' ids, in spawn order (`_add_name`, `_drop_name`)
        self._lowered: dict[str, str] = {}  # each running id lowercased -> the id (`_check_case`)
        self._naming, self._name_locks = threading.Lock(), {}  # see `_name_held`
        self._stops: dict[str, pykka.Future] = {}  # agent -> its stop, while one goes on past its wait (`_stop_held`)
        self.cache_dir = cache_folder(cache_dir)
        self.model, self.tokenizer, self.spec = load_model(model, scheme, route)  # checked on the engine's route
        context = getattr(getattr(self.model, "args", None), "max_position_embeddings", None)
        self.max_context = context if isinstance(context, int) else None  # the model's positions, when it says
        # the most characters one token spells: a message longer than the positions left for it times this can
        # never fit, and is refused before it is tokenized (see `AgentRef.send`)
        self.longest_token_chars = chat.longest_token_chars(self.tokenizer)
        self.vocab_size = token_rows(self.model)  # a token id of a reset's records is below it (None: not known)
        engine_options = dict(memory_budget=memory_budget, max_batch=max_batch, route=route)
        try:  # whatever fails from here on, nothing stays behind: no lock, no thread
            hot = default_hot_budget() if hot_budget is None else hot_budget
            self._env = Env(self.tokenizer, self.spec, durability, hot, io_timeout, self.max_context)
            self._lock = self._lock_store()
            self._services = Supervisor.start("one_for_one", max_restarts=max_restarts, period=restart_period,
                                             backoff=backoff, on_escalate=self._escalated)
            self._supervisor = Supervisor.start(strategy, max_restarts=max_restarts, period=restart_period,
                                               backoff=backoff, on_escalate=self._escalated)
            _shutdown_at_exit(self)
            self._start_child(self._services, "@persistence",
                              lambda sup: PersistenceActor.start(self.cache_dir, self.spec, retention_s=retention_s, supervisor=sup))
            self._start_child(self._services, "@batcher",
                              lambda sup: BatcherActor.start(self.model, self.tokenizer, self.spec, supervisor=sup, **engine_options))
            if warmup or (warmup is None and on_cuda()):
                self._env.batcher().ask(Warmup(_print_progress), timeout=None)
        except BaseException:
            self.shutdown()
            raise

    # -- agents ------------------------------------------------------------------

    def spawn(self, name: str, system: str = "", restart: str = "permanent", *, reset: bool = False,
              timeout: float = 60.0) -> AgentRef:
        """Start agent `name` (resuming its history and cache from `cache_dir` if any); return its ref.

        system: the system prompt. A stored agent keeps the one it is stored with: pass
        none ("") or that same prompt to resume it; another raises SystemPromptChanged
        (nothing starts) unless `reset`. If journal damage destroyed the record that held
        the stored prompt, the same prompt (its checksum is kept) resumes the agent and is
        recorded again; with none, the agent goes on without a prompt and logs that.
        reset: delete the agent's stored journal and cache first (as `forget` does), so
        it starts with an empty history.
        restart: "permanent" (always restarted), "transient" (only after a crash) or
        "temporary" (never). Raises InvalidAgentId for a bad name or one that differs only in case from a
        running or stored agent's (a case-insensitive file system would give both one folder), ValueError if an
        agent of that name is running (stop it first, or `forget` it), SystemPromptTooLong (a ValueError) for a
        system prompt that leaves the model no position for a turn, and TypeError or ValueError for a bad option
        (system a str, restart one of the three, reset a bool, timeout finite and > 0), before anything starts.
        timeout: seconds each wait may take (for another call on this name, the stored agent's files, the agents'
        supervisor): past it, WaitTimeout, and nothing was started (call again to wait longer).

        A reply's done callback may spawn: it runs on the thread of the agent that answered the turn, which the
        supervisor does not wait for, except while the user stops that agent (`AgentRef.stop`, `forget`): there
        a spawn would wait for the supervisor waiting for this very thread, so it raises WaitsInCallback at once.
        """
        self._check_running()
        store.check_agent_id(name)
        if not isinstance(system, str):
            raise InvalidArgumentType(f"system must be a str, got {type(system).__name__}")
        check_unicode("system", system)
        self._check_system_fits(system)  # every turn would fail, and the agent would be stored with it
        _choice("restart", restart, RESTART_TYPES)
        if not isinstance(reset, bool):
            raise InvalidArgumentType(f"reset must be True or False, got {type(reset).__name__}")
        _positive("timeout", timeout)
        here = agent_mod.agent_here()  # the agent whose thread runs this call (in its done callback), if any
        if here is not None and here[0] is self._env and self._env.stopped_by_user(here[1]):
            raise WaitsInCallback(f"spawn() of agent {name!r} waits for the agents' supervisor, which is stopping "
                                  f"agent {here[1]!r} and waits for its thread: this one, running a done callback. "
                                  "Spawn from a thread of your own (hand it the name, e.g. through a queue.Queue)")
        with self._name_held(name, timeout):
            if name in self._stops:  # its earlier actor first: a stop of it that ran past its wait
                self._finish_stop(name, timeout, "spawn()")
            self._drop_if_exited(name)  # a temporary agent that crashed is not running any more
            if name in self._names:
                raise InvalidArgument(f"agent {name!r} is already running; use rt.agent({name!r})")
            self._check_case(name)
            if reset:
                self._on_files(f"deleting agent {name!r}", timeout, lambda p: p.delete(name))
            elif system:
                self._check_system(name, system, timeout)
            self._start_child(self._supervisor, name,
                              lambda sup: AgentActor.start(sup, self._env, name, system), restart, timeout, "spawn()")
            self._add_name(name)
        return AgentRef(self, name)

    def _check_system_fits(self, system: str) -> None:
        """Raise SystemPromptTooLong if `system` leaves the model no position for a message and one token of reply
        (`agent.system_crowds_out`); a text too long whatever its tokens is refused before tokenizing it."""
        if never_fits(self, len(system), 1):
            raise SystemPromptTooLong(None, len(system), self.max_context)
        if system and self.max_context:
            tokens = agent_mod.system_crowds_out(self.tokenizer, system, 1, self.max_context)
            if tokens is not None:
                raise SystemPromptTooLong(tokens, len(system), self.max_context)

    def _add_name(self, name: str) -> None:
        """Count agent `name` as running (its actor started)."""
        self._names[name] = None
        self._lowered[name.lower()] = name

    def _drop_name(self, name: str) -> None:
        """Count agent `name` as running no more (if it was): the case check's entry first, so that a spawn of the
        name in between finds it running, not a case twin of itself."""
        if name in self._names:
            self._lowered.pop(name.lower(), None)
            self._names.pop(name, None)

    def _check_case(self, name: str) -> None:
        """Raise InvalidAgentId if a running or stored agent's id differs from `name` only in case: on a
        case-insensitive file system (macOS's, Windows') both would write one folder's journal and cache."""
        twin = self._lowered.get(name.lower())
        if twin is None:
            twin = store.case_twin(self.cache_dir, self.spec.fingerprint, name)
        if twin is not None:
            raise store.InvalidAgentId(f"agent id {name!r} differs from agent {twin!r}'s only in case; on a "
                                       f"case-insensitive file system the two would share one folder of files",
                                       f": use another name, or rt.forget({twin!r}) first", twin=twin)

    def _check_system(self, name: str, system: str, timeout: float) -> None:
        """Raise SystemPromptChanged if stored agent `name` has a conversation under another system prompt.

        A prompt lost to journal damage is checked against the checksum its
        conversation's records carry; the agent then records the given one again.
        """
        stored = self._on_files(f"reading agent {name!r}", timeout, lambda p: p.stored(name))
        if stored is None or stored.messages == 0:
            return  # nothing stored, or an unreadable journal: the agent itself reports that
        lost_but_same = stored.system is None and stored.check in (None, store.prompt_check(system))
        if stored.system != system and not lost_but_same:
            raise SystemPromptChanged(name, stored.system, system)

    def agent(self, name: str) -> AgentRef:
        """The ref of running agent `name`; raises UnknownAgent otherwise (InvalidAgentId for a bad name,
        RuntimeClosed after `shutdown`)."""
        self._check_running()
        store.check_agent_id(name)
        _check_all_running(self, [name])  # not a temporary agent that exited
        return AgentRef(self, name)

    def agents(self, timeout: float = 60.0) -> list[AgentInfo]:
        """Every agent stored in `cache_dir` for this model and every running one, sorted by name.

        Each is an `AgentInfo(name, running, turns, cache)`. Reads each stored agent's
        journal (after the queued writes land); `running()` is the cheap list of names.
        Raises RuntimeClosed after `shutdown`, and WaitTimeout after `timeout` seconds.
        """
        self._check_running()
        stored = {a.name: a for a in self._on_files("reading the stored agents", timeout, lambda p: p.stored_all())}
        running = set(self.running())
        infos = []
        for name in sorted(running | set(stored)):
            a = stored.get(name)
            cache = "hot" if name in self._env.hot else "warm" if a is not None and a.cache else "none"
            infos.append(AgentInfo(name, name in running, 0 if a is None else a.turns, cache))
        return infos

    def flush(self, timeout: float = 60.0) -> None:
        """Return once the cache of every acknowledged turn is on disk (or its write failed, which is logged).

        A turn is durable once acknowledged (its journal records are on disk); its
        cache file follows in the background, and a crash before it lands only costs
        the re-prefill of the turns it lacks. Call this before reading or copying the
        cache files. Stopping the runtime does the same. Raises RuntimeClosed after `shutdown`, and
        WaitTimeout after `timeout` seconds (the writes go on).
        """
        self._check_running()
        self._on_files("writing every acknowledged turn's cache", timeout, lambda p: p.settle())

    def _on_files(self, what: str, timeout, call):
        """The persistence actor's answer to `call(its proxy)` within `timeout` seconds (`_within`)."""
        return _within(what, timeout, lambda seconds: call(self._env.persistence().proxy()).get(timeout=seconds))

    def running(self) -> list[str]:
        """Names of the running agents, in spawn order (no disk access; see `agents` for the stored ones): not a
        temporary agent that exited. Raises RuntimeClosed after `shutdown`.

        The supervisor is asked only while an agent's actor is not alive (it restarts, or it exited): a reply's done
        callback runs on an agent's thread, which the supervisor may be waiting for (`stop`)."""
        self._check_running()
        names = list(self._names)
        if all(self._actor_alive(n) for n in names):
            return names
        try:
            children = self._supervisor.proxy().children().get(timeout=10)
        except (pykka.ActorDeadError, pykka.Timeout):  # the supervisor stopping or busy: the names as spawned
            return names
        return [n for n in names if n in children]

    def _actor_alive(self, name: str) -> bool:
        """Whether agent `name`'s actor is alive now: then it runs (a temporary agent that exited has none)."""
        ref = self._env.refs.get(name)
        return name in self._names and ref is not None and ref.is_alive()

    def forget(self, name: str, timeout: float = 60.0) -> bool:
        """Stop agent `name` if it runs and delete its cache and journal; return whether any were stored.

        Its queued writes land first, then its folder goes. Raises InvalidAgentId for a bad name,
        WaitTimeout if a wait (for another call on this name, the agent's stop, the files) takes more than `timeout`
        seconds (a stop goes on, and the files stay until a call again finds it done), and WaitsInCallback inside a
        turn's callback.
        """
        self._check_running()
        store.check_agent_id(name)
        _positive("timeout", timeout)
        _not_in_callback(f"forgetting agent {name!r}")
        with self._name_held(name, timeout):  # no spawn of this name between its stop and its files' deletion
            if name in self._names or name in self._stops:
                self._stop_held(name, timeout, "forget()")
            return self._on_files(f"deleting agent {name!r}", timeout, lambda p: p.delete(name))

    def stored(self, name: str) -> bool:
        """Whether agent `name` has a journal or cache in `cache_dir` (running or not)."""
        store.check_agent_id(name)
        return store.agent_dir(self.cache_dir, self.spec.fingerprint, name).exists()

    def converse(self, agents, opening: str, rounds: int, *, max_tokens: int = MAX_TOKENS,
                 temperature: float = Sampling.temperature, top_p: float = Sampling.top_p, seed: int = Sampling.seed,
                 stop: str | Iterable[str] = (), timeout: float | None = TURN_TIMEOUT) -> list[Reply]:
        """Round-robin: the first agent answers `opening`, each next one answers the previous reply.

        Every message is attributed to the agent that wrote it. Every turn takes the
        options given (see `AgentRef.send`). Returns all replies in order. Raises TypeError or
        ValueError, before any turn, unless `agents` are AgentRefs of this Runtime and `rounds` an int >= 0, and
        UnknownAgent, before any turn too, if one of them is not running.
        """
        agents = _agent_refs(self, agents, "converse")
        _at_least("rounds", rounds, 0, int)
        _check_all_running(self, agents)
        replies, text, previous = [], opening, None
        for _ in range(rounds):
            for a in agents:
                r = a.ask(text, sender=previous.name if previous else None, max_tokens=max_tokens,
                          temperature=temperature, top_p=top_p, seed=seed, stop=stop, timeout=timeout)
                replies.append(r)
                text, previous = r.text or "...", a
        return replies

    def broadcast(self, group, text: str, *, max_tokens: int = MAX_TOKENS, temperature: float = Sampling.temperature,
                  top_p: float = Sampling.top_p, seed: int = Sampling.seed, stop: str | Iterable[str] = (),
                  timeout: float | None = TURN_TIMEOUT) -> list[ReplyFuture]:
        """Send `text` to every agent in `group` (each takes a turn with the options given); return their futures.

        Raises TypeError or ValueError, before any turn, unless `group` holds AgentRefs of this Runtime, and
        UnknownAgent, before any turn too, if one of them is not running."""
        group = _agent_refs(self, group, "broadcast")
        _check_all_running(self, group)
        return [a.send(text, max_tokens=max_tokens, temperature=temperature, top_p=top_p, seed=seed, stop=stop,
                       timeout=timeout) for a in group]

    def engine_stats(self, timeout: float = 10.0):
        """A snapshot of the engine's `EngineStats` (decode step and prefill chunk times), for profiles.

        The batcher answers between steps: WaitTimeout if it has not within `timeout` seconds (WaitsInCallback
        inside a turn's callback, which runs in the step)."""
        _not_in_callback("engine_stats()")
        self._check_running()
        return _within("the batcher's answer (it answers between steps)", timeout,
                       lambda seconds: self._env.batcher().ask(_STATS, timeout=seconds))

    @property
    def dead_letters(self) -> list[DeadLetter]:
        """Messages that could not be delivered, oldest first: the newest `DEAD_LETTERS_KEPT` (1000); older ones
        are dropped, with a warning logged the first time."""
        return self._env.dead_letters.snapshot()

    # -- life cycle ------------------------------------------------------------------

    def shutdown(self) -> None:
        """Stop every agent, flush every write to disk, stop the batcher. Idempotent.

        Also runs at interpreter exit for a Runtime that was never shut down, before
        Python waits for the actors' threads, so a forgotten Runtime never hangs the exit.
        Raises WaitsInCallback inside a turn's callback (it waits for the engine to stop), and
        WaitTimeout when the actors have not stopped within STOP_WAIT_S seconds (the engine
        in a long step): the stop goes on, the cache folder stays locked until a later call
        finishes it.
        """
        _not_in_callback("shutdown()")
        self._closed = True
        if self._env is not None:
            self._env.shutting_down()
        engine_thread = self._engine_thread()
        for ref in (self._supervisor, self._services):
            if ref is None:
                continue
            try:
                ref.stop(timeout=STOP_WAIT_S)
            except pykka.ActorDeadError:
                pass
            except pykka.Timeout:  # a long engine step (a big prefill chunk, a slow callback): the stop goes on
                raise WaitTimeout(f"stopping the Runtime did not finish within {STOP_WAIT_S:g} s (the engine is in a "
                                  "long step); it goes on: call shutdown() again to wait longer") from None
        if self._env is not None:
            self._env.close()
        if engine_thread is not None:
            wait_thread_gone(engine_thread)
        if self._lock is not None:
            os.close(self._lock)
            self._lock = None

    def __enter__(self):
        return self

    def __exit__(self, exc_type, exc, tb):
        shutdown_on_exit(self.shutdown, exc)

    # -- internals ------------------------------------------------------------------

    def _engine_thread(self) -> threading.Thread | None:
        """The thread of the current batcher (the one that runs the model), if it is up."""
        try:
            return self._env.batcher().proxy().thread.get(timeout=5)
        except Exception:  # noqa: BLE001 - no batcher (never started, restarting, stopped): nothing to wait for
            return None

    def _start_child(self, sup, name, start, restart="permanent", timeout=60.0, call="Runtime()"):
        """Have supervisor `sup` start child `name` (`start(sup)`, again at each restart) and register its ref.

        WaitTimeout, naming `call`, if `sup` has not begun the start within `timeout` seconds (it is busy, such as
        stopping an agent whose thread is held up): the start is then called off, so nothing starts."""
        env, begin = self._env, _BeginOrCallOff()  # begun by `sup`, or called off past the wait

        def started():
            if not begin.begin():
                raise WaitTimeout(f"{call} of {name!r} was called off: it ran past its wait")
            ref = start(sup)
            env.register(name, ref)
            return ref

        future = sup.proxy().start_child(ChildSpec(name, started, restart))
        try:
            future.get(timeout=wait_seconds(timeout))
            return
        except pykka.Timeout:
            if begin.call_off():
                raise WaitTimeout(f"{call} waited {timeout:g} s for the supervisor to start {name!r}, and it has not "
                                  "begun: it is busy (such as stopping an agent whose thread is held up, e.g. by a "
                                  f"done callback that blocks); nothing was started: call {call} again to wait "
                                  "longer") from None
        future.get()  # `sup` is starting it now: an actor's thread starts at once

    def _ref(self, name: str, turn_id: str | None = None) -> pykka.ActorRef:
        """The current actor of agent `name`, waiting briefly while it restarts; AgentCrashed, carrying the
        `turn_id` the caller means to send (None: none), if it does not come back in that time."""
        self._check_running()
        if name not in self._names:
            raise not_running(name, self._names)
        deadline = time.monotonic() + RESTART_WAIT_S
        while True:
            ref = self._env.refs.get(name)
            if ref is not None and ref.is_alive():
                return ref
            if self._exited(name):  # a temporary (or transient) agent that was not restarted
                with self._name_held(name, None):  # no spawn of this name between the check and the drop
                    gone = self._drop_if_exited(name)
                if gone or name not in self._names:
                    raise UnknownAgent(f"agent {name!r} exited and was not restarted", "; spawn it again")
                continue  # spawned again meanwhile: its new actor
            if time.monotonic() > deadline or self._escalation:
                self._check_running()
                raise AgentCrashed(turn_id, f"agent {name!r} did not come back from a restart within "
                                            f"{RESTART_WAIT_S:g} s", _retry(turn_id))
            self._env.wait_changed(0.05)  # woken when the restarted actor registers

    def _history(self, name: str, timeout: float) -> list[dict]:
        """Agent `name`'s conversation as journal records, once it has done all it was sent before (what
        `AgentRef.history` returns, raising what it raises)."""
        return _queued_answer(self._deliver, name, History, timeout,
                              f"did not answer history() within {timeout} s; it is busy with what was sent to it "
                              "before: ask again", "for its history; retry")

    def _lock_store(self) -> int | None:
        """Take the lock of `cache_dir` for this Runtime alone (CacheDirInUse if another has it); the fd."""
        return store.lock_cache_dir(self.cache_dir)

    def _exited(self, name) -> bool:
        """Whether the agents' supervisor dropped child `name` (so no restart is coming)."""
        try:
            self._supervisor.proxy().whereis(name).get(timeout=10)
        except UnknownChild:
            return name in self._names
        except (pykka.ActorDeadError, pykka.Timeout):
            pass
        return False

    def _deliver(self, name, message, future, dead_letter: bool = True):
        """Tell `message` to agent `name`'s current actor; an AgentCrashed here carries the turn id of `future`.

        For an agent that is not running it raises UnknownAgent; a message (a turn, a note, a reset) also goes to
        the dead letters, a question (`History`, `Lookup`) does not: its caller has the answer, the error. Without
        `dead_letter` a message does not either: its caller may still deliver it (a cluster, once it has started the
        agent again)."""
        turn_id = getattr(future, "turn_id", None)
        try:
            ref = self._ref(name, turn_id)
        except UnknownAgent as e:
            if dead_letter and not isinstance(message, (History, Lookup)):  # a question's caller gets the error
                self._env.dead_letter(name, message, str(e))
            raise
        _begin_send(future)  # its asyncio call may have been cancelled while this waited
        try:
            ref.tell(message)
        except pykka.ActorDeadError:  # it crashed just now: give the next incarnation the message
            try:
                self._ref(name, turn_id).tell(message)
            except pykka.ActorDeadError:
                raise AgentCrashed(turn_id, f"agent {name!r} crashed twice while taking this message",
                                   _retry(turn_id)) from None

    @contextlib.contextmanager
    def _name_held(self, name: str, timeout: float | None):
        """Within the block, no other spawn, stop or forget of agent `name` runs (each holds this).

        A stop lets go of the name before its actor has stopped and its ref is dropped: a
        spawn of that name in between started an agent whose ref the stop then dropped,
        and the agent was unreachable. Raises WaitTimeout if another such call holds the
        name for more than `timeout` seconds (None: no limit). The thread that holds it may
        take it again (a subclass's call around this class's, as `rayhost.HostedRuntime`'s).
        """
        with self._naming:  # one lock for ids that differ only in case (see `_check_case`)
            lock = self._name_locks.setdefault(name.lower(), threading.RLock())
        if not lock.acquire(timeout=-1 if timeout is None else wait_seconds(timeout)):
            raise WaitTimeout(f"agent {name!r} was being started or stopped by another call for over {timeout} s; "
                              "try again")
        try:
            yield
        finally:
            lock.release()

    def _stop_agent(self, name):
        """Stop running agent `name` (`AgentRef.stop`), waiting STOP_WAIT_S seconds for it."""
        with self._name_held(name, None):
            self._stop_held(name, STOP_WAIT_S, "stop()")

    def _stop_held(self, name, timeout, call):
        """`_stop_agent` for a caller, named `call`, that holds `_name_held(name)`; it waits `timeout` seconds for the
        agent to stop (`_finish_stop`). Also finishes a stop of `name` that ran past its wait before."""
        self._check_running()
        if name not in self._names and name not in self._stops:
            raise not_running(name, self._names)
        if name in self._names:
            if self._drop_if_exited(name):
                return  # it exited and was not restarted: nothing to stop
            self._drop_name(name)
            self._env.stopping(name)
            self._stops[name] = self._supervisor.proxy().stop_child(name)
        self._finish_stop(name, timeout, call)

    def _finish_stop(self, name, timeout, call):
        """Wait for the stop of agent `name` that `_stop_held` asked the supervisor for, at most `timeout` seconds.

        Past that, WaitTimeout naming `call`: the stop goes on, the agent still counts as being stopped by the user,
        and the next stop, forget or spawn of the name (which holds `_name_held(name)`) waits for it again."""
        waiting = False
        try:
            self._stops[name].get(timeout=wait_seconds(timeout))
        except pykka.Timeout:
            waiting = True
            raise WaitTimeout(f"{call} waited {timeout:g} s for the supervisor to stop agent {name!r}, and it has not: "
                              "it is busy (such as stopping another agent whose thread is held up, e.g. by a done "
                              "callback that blocks); the stop goes on and the agent takes no more messages: call "
                              f"{call} again to wait longer") from None
        finally:
            if not waiting:  # the stop ended, or failed: either way it is over
                self._stops.pop(name)
                self._env.stopping(name, on=False)
        self._env.refs.pop(name, None)
        self._env.hot.discard(name)

    def _drop_if_exited(self, name) -> bool:
        """Count agent `name` as running no more if its supervisor dropped it (a temporary agent that crashed);
        return whether it did. The caller holds `_name_held(name)`."""
        if name in self._names and self._exited(name):
            self._drop_name(name)
            self._env.refs.pop(name, None)
            self._env.hot.discard(name)
            return True
        return False

    def _escalated(self, name, error):
        self._escalation = (name, error)
        self._env.close()
        log.error("supervision escalated (%s): %s", name, error)
        if self._on_escalate:
            self._on_escalate(name, error)

    def _check_running(self):
        if self._closed and not self._escalation:
            raise RuntimeClosed("the Runtime was shut down", "; start a new Runtime to talk to its agents")
        if self._escalation:
            name, error = self._escalation
            raise RuntimeEscalated(f"supervision gave up after {name!r} kept failing ({error})",
                                   "; start a new Runtime") from error


# `__new__` takes (*args, **options) to hand them on; the signature that callers see is `__init__`'s.
Runtime.__signature__ = inspect.signature(Runtime.__init__).replace(
    parameters=list(inspect.signature(Runtime.__init__).parameters.values())[1:])


def _check_options(*, memory_budget, hot_budget, durability, max_batch, route, strategy,
                   max_restarts, restart_period, backoff, retention_s, on_escalate, io_timeout, warmup) -> None:
    """Raise ValueError/TypeError for a bad Runtime option, before anything is acquired.

    memory_budget None or an int > 0; hot_budget None or an int >= 0;
    durability and strategy one of theirs; max_batch an int in [1, MAX_BATCH]; route None or a
    route that runs here; max_restarts an int >= 0; restart_period finite and > 0;
    backoff a Backoff; retention_s None or finite and >= 0; on_escalate None or a
    callable; io_timeout finite and >= MIN_IO_TIMEOUT; warmup None, True or False.
    """
    _choice("durability", durability, DURABILITY)
    _choice("strategy", strategy, STRATEGIES)
    if memory_budget is not None:
        _at_least("memory_budget", memory_budget, 1, int)
    if hot_budget is not None:
        _at_least("hot_budget", hot_budget, 0, int)
    _at_least("max_batch", max_batch, 1, int)
    if max_batch > MAX_BATCH:
        raise InvalidArgument(f"max_batch must be <= {MAX_BATCH} (rows decoded together), got {shown(max_batch)}")
    if route is not None:
        _choice("route", route, ROUTES)
        check_route(route)  # a route that does not run here (q4kernel off CUDA): Q4CacheError, a ValueError
    _at_least("max_restarts", max_restarts, 0, int)
    _positive("restart_period", restart_period)
    if not isinstance(backoff, Backoff):
        raise InvalidArgumentType(f"backoff must be an actors.supervisor.Backoff, got {type(backoff).__name__}")
    if retention_s is not None:
        _at_least("retention_s", retention_s, 0)
        if not _finite(retention_s):
            raise InvalidArgument(f"retention_s must be None or a finite number of seconds, got {shown(retention_s)}")
    if on_escalate is not None and not callable(on_escalate):
        raise InvalidArgumentType(f"on_escalate must be a callable or None, got {type(on_escalate).__name__}")
    _positive("io_timeout", io_timeout)
    if io_timeout < MIN_IO_TIMEOUT:
        raise InvalidArgument(f"io_timeout must be at least {MIN_IO_TIMEOUT:g} s (an agent that cannot load its files "
                              "within it crashes and restarts, and too many restarts stop the Runtime); "
                              f"got {shown(io_timeout)}")
    if warmup is not None and not isinstance(warmup, bool):
        raise InvalidArgumentType(f"warmup must be None, True or False, got {type(warmup).__name__}")


SHOWN_NAMES = 10  # running agents an UnknownAgent's message names at most
MAX_CONVERSATION_ID = 1024  # characters of a turn's conversation_id
MAX_BATCH = 4096  # most rows a Runtime decodes together (far past a device's; start-up walks every size below it)


def _queued_answer(deliver, name: str, envelope, timeout: float, busy: str, asked: str, turn_id: str | None = None):
    """Send agent `name` the request `envelope(future)` (by `deliver`, a runtime's `_deliver`), queued behind all it
    was sent before, and return its answer. AgentError (saying `busy`) if none came within `timeout` seconds; an
    agent that crashes before answering is asked again, up to three times, then AgentCrashed (asked `asked`)."""
    for _ in range(3):
        future = ReplyFuture()
        future.turn_id = turn_id
        deliver(name, envelope(future), future)
        try:
            return future.get(timeout=timeout)  # ReplyFuture.get caps the wait itself
        except TurnTimeout:
            raise AgentError(f"agent {name!r} {busy}") from None
        except AgentCrashed:
            continue  # it crashed before answering: its next incarnation reloads the durable history
    raise AgentCrashed(turn_id, f"agent {name!r} kept crashing while asked {asked}")


def shutdown_on_exit(shutdown: Callable[[], None], exc: BaseException | None) -> None:
    """A runtime's `__exit__`: call `shutdown()`. Its failure raises, unless the `with` block is already raising
    `exc`: then the failure is logged as a warning (its message says what to do) and `exc` goes on, unmasked."""
    if exc is None:
        shutdown()
        return
    try:
        shutdown()
    except Exception as e:  # noqa: BLE001 - the block's own exception is the one to raise
        log.warning("shutdown() on leaving a with block that raised %s failed: %s", type(exc).__name__, e)


def _retry(turn_id: str | None) -> str:
    """The advice of an AgentCrashed raised before the agent took the message: retry, with the turn's id if any."""
    return "; retry with the same turn_id" if turn_id else "; retry"


def not_running(name: str, running) -> UnknownAgent:
    """The UnknownAgent for agent `name` missing among the `running` names: it lists the first SHOWN_NAMES of them
    (a runtime may run thousands)."""
    running = list(running)
    shown = ", ".join(repr(n) for n in running[:SHOWN_NAMES]) or "none"
    more = f" and {len(running) - SHOWN_NAMES} more" if len(running) > SHOWN_NAMES else ""
    return UnknownAgent(f"no running agent named {name!r}", f"; running: {shown}{more}")


def _choice(name: str, value, choices) -> None:
    if not isinstance(value, str):
        raise InvalidArgumentType(f"{name} must be a str, one of {', '.join(choices)}; got {type(value).__name__}")
    if value not in choices:
        raise InvalidArgument(f"{name} must be one of {', '.join(choices)}; got {value!r}")


def _at_least(name: str, value, least, kind=(int, float)) -> None:
    _number(name, value, kind)
    if not value >= least:
        raise InvalidArgument(f"{name} must be >= {least}, got {shown(value)}")


def _agent_refs(runtime, agents, what: str) -> list:
    """`agents` as a list, checked: each an AgentRef of `runtime` (TypeError, ValueError otherwise)."""
    try:
        refs = list(agents)
    except TypeError:
        raise InvalidArgumentType(f"{what} takes an iterable of AgentRefs, got {type(agents).__name__}") from None
    for ref in refs:
        if not isinstance(ref, AgentRef):
            raise InvalidArgumentType(f"{what} takes AgentRefs (rt.agent(name)), got {type(ref).__name__}")
        if ref.runtime is not runtime:
            raise InvalidArgument(f"{what}: agent {ref.name!r} belongs to another Runtime")
    return refs


def _check_all_running(runtime, agents) -> None:
    """Raise UnknownAgent if an agent of `agents` (AgentRefs or names) is not running (`runtime.running()`), before
    a group call sends a turn: the turns sent before it would run with their replies lost to the caller.

    An agent the runtime does not count as running (never spawned, stopped, or being stopped) is not; one whose
    actor is alive is (a temporary agent that exited has none): only for the others is the supervisor asked. A
    reply's done callback runs on an agent's thread, also while the supervisor waits for that thread to stop its
    agent: asking the supervisor there hung both for `running()`'s 10 s."""
    names = [a if isinstance(a, str) else a.name for a in agents]
    for name in names:
        if name not in runtime._names:
            raise not_running(name, runtime._names)
    doubtful = [n for n in names if not runtime._actor_alive(n)]
    if doubtful:
        running = runtime.running()
        listed = set(running)
        for name in doubtful:
            if name not in listed:
                raise not_running(name, running)


def cache_folder(cache_dir) -> Path:
    """The folder `cache_dir` names (None: DEFAULT_CACHE_DIR), `~` expanded; InvalidArgumentType unless it is None,
    a str or an os.PathLike of a str, InvalidArgument for an empty string or a NUL in it, store.NotAFolder (a
    NotADirectoryError) for a file (or a path under one)."""
    if cache_dir is not None:
        path = os.fspath(cache_dir) if isinstance(cache_dir, (str, os.PathLike)) else None
        if not isinstance(path, str):
            raise InvalidArgumentType(f"cache_dir must be a folder's path (str or pathlib.Path) or None, "
                                      f"got {type(cache_dir).__name__}")
        if not path.strip():
            raise InvalidArgument(f"cache_dir is empty: give a folder, or None for the default ({DEFAULT_CACHE_DIR})")
        if "\0" in path:
            raise InvalidArgument(f"cache_dir holds a NUL character, which no path may: {path!r}")
    return store.check_cache_folder(Path(cache_dir or DEFAULT_CACHE_DIR).expanduser())


def _token_ids(tokens, vocab_size: int | None = None) -> list:
    """`tokens` as a list of token ids (ints 0 to 2**31 - 1, and below the model's `vocab_size` when known), or
    ValueError saying what a record's tokens must be: an id past the embedding would be read out of its bounds."""
    limit = min(2**31, vocab_size or 2**31)
    if not isinstance(tokens, (list, tuple)) or not all(
            isinstance(t, int) and not isinstance(t, bool) and 0 <= t < limit for t in tokens):
        raise InvalidArgument(f"a record's tokens are a list of token ids (ints from 0 to {limit - 1}, the model's), "
                              f"as history() gives them; got {tokens!r:.100}")
    return [int(t) for t in tokens]


def check_unicode(name: str, text: str) -> None:
    """Raise ValueError unless str `text` encodes as UTF-8: a lone surrogate (from `"\\ud800"` in JSON, or from
    bytes decoded with errors="surrogateescape") can be neither tokenized nor written to the journal."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise InvalidArgument(f"{name} is not valid Unicode text: it holds a lone surrogate {text[e.start]!r} at "
                              f"character {e.start}; send text that encodes as UTF-8") from None


def _within(what: str, timeout, wait):
    """`wait(seconds)`, a pykka wait of `timeout` seconds (checked: a finite number > 0); WaitTimeout saying `what`
    did not finish if it ran out."""
    _positive("timeout", timeout)
    try:
        return wait(wait_seconds(timeout))
    except pykka.Timeout:
        raise WaitTimeout(f"{what} did not finish within {timeout} s; it goes on: call again to wait longer") from None


def _positive(name: str, value) -> None:
    _number(name, value)
    if not (_finite(value) and value > 0):
        raise InvalidArgument(f"{name} must be a finite number > 0, got {shown(value)}")


def check_room(max_tokens: int, max_context: int | None) -> None:
    """Raise InvalidArgument if `max_tokens` leaves no position for a prompt in the model's `max_context` positions
    (None: unknown, nothing refused)."""
    if max_context is not None and max_tokens >= max_context:
        raise InvalidArgument(f"max_tokens {shown(max_tokens)} leaves no room for a prompt in the model's {max_context} "
                              "positions; lower it")


def _finite(value) -> bool:
    """Whether the number `value` is finite as a float (an int too large for a float is not)."""
    try:
        return math.isfinite(value)
    except OverflowError:
        return False


def _number(name: str, value, kind=(int, float)) -> None:
    if isinstance(value, bool) or not isinstance(value, kind):
        kinds = " or ".join(k.__name__ for k in (kind if isinstance(kind, tuple) else (kind,)))
        raise InvalidArgumentType(f"{name} must be {kinds}, got {type(value).__name__}")


def wait_thread_gone(thread: threading.Thread, timeout: float = 10.0) -> None:
    """Return once `thread` has ended, down to its OS thread (at most `timeout` seconds).

    A thread that ran MLX-compiled functions (mlx-lm's models do: `swiglu`) frees
    MLX's per-thread compile cache after Python has finished with it, and that takes
    the GIL. If the interpreter is finalizing by then, the process aborts
    ("terminate called without an active exception"). So `shutdown` waits for the
    engine's thread this far: a program may exit right after it. On Linux the OS
    thread is watched in /proc; elsewhere a short grace period stands in for it.
    """
    if thread is threading.current_thread():
        return
    deadline = time.monotonic() + timeout
    thread.join(timeout)
    task = Path(f"/proc/self/task/{thread.native_id}")
    if not Path("/proc/self/task").is_dir():
        time.sleep(0.05)
        return
    while task.exists() and time.monotonic() < deadline:
        time.sleep(0.001)


def check_top_p(top_p) -> None:
    """Raise InvalidArgumentType unless `top_p` is an int or a float, and InvalidArgument unless it is in [0, 1]:
    the probability mass of the most likely tokens a turn samples from, 1 all of them and 0 the single most likely
    one (greedy decoding, as OpenAI's clients mean by it; `engine.Sampling.greedy`)."""
    _number("top_p", top_p)
    if not 0 <= top_p <= 1:  # NaN fails it too
        raise InvalidArgument(f"top_p must be in [0, 1] (0: greedy), got {shown(top_p)}")


def check_turn_options(text, max_tokens, temperature, top_p, seed, stop, timeout, max_context=None) -> tuple:
    """Check a turn's options; return `stop` as a tuple of strings.

    Raises TypeError for a wrong type and ValueError for a value out of range:
    `text` a non-empty str; `max_tokens` an int >= 1 (and at most `max_context`, the
    model's positions, when known); `temperature` finite and >= 0; `top_p` in [0, 1] (`check_top_p`);
    `seed` an int in [0, 2**64); `stop` one non-empty str or an iterable of them; `timeout`
    None or a finite number > 0.
    """
    if not isinstance(text, str):
        raise InvalidArgumentType(f"text must be a str, got {type(text).__name__} (decode bytes first)")
    if not text:
        raise InvalidArgument("an empty message gives the model nothing to answer")
    check_unicode("text", text)
    _number("max_tokens", max_tokens, int)
    if max_tokens < 1:
        raise InvalidArgument(f"max_tokens must be >= 1, got {shown(max_tokens)}")
    check_room(max_tokens, max_context)
    _number("temperature", temperature)
    if not (_finite(temperature) and temperature >= 0):
        raise InvalidArgument(f"temperature must be finite and >= 0, got {shown(temperature)}")
    check_top_p(top_p)
    _number("seed", seed, int)
    if not 0 <= seed < 2**64:
        raise InvalidArgument(f"seed must be in [0, 2**64), got {shown(seed)}")
    stop = (stop,) if isinstance(stop, str) else stop
    try:
        stop = tuple(stop)
    except TypeError:
        raise InvalidArgumentType(f"stop must be a str or an iterable of str, got {type(stop).__name__}") from None
    for s in stop:
        if not isinstance(s, str):
            raise InvalidArgumentType(f"stop strings must be str, got {type(s).__name__}")
        if not s:
            raise InvalidArgument("an empty stop string would stop every turn at once")
        check_unicode("a stop string", s)
    if timeout is not None:
        _number("timeout", timeout)
        if not (_finite(timeout) and timeout > 0):
            raise InvalidArgument(f"timeout must be None or a finite number > 0, got {shown(timeout)}")
    return stop
