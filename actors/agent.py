"""AgentActor: one LLM agent, owning its KV-cache handle, running its turns one at a time.

An agent's work arrives as `Ask` (take a turn on a message), `Note` (append a
message to the history without a turn) and `Reset` (start the conversation over
from given messages) envelopes whose payload is msgpack, so no
mutable object is shared between actors. Work items run strictly in arrival order:
a turn renders the conversation with the chat template, matches the rendered text
against the text its cache holds (`runtime.prefix`), sends only the new tokens to
the batcher and returns to its mailbox; the result comes back as a message. The
cache is then handed to the persistence actor (on the device: the persistence
actor copies only the rows it writes), and the caller's future resolves once the
turn is durable (`durability="durable"`, the default), which is once its journal
records are fsynced: the cache file is written after that, in the background, and
a crash before it lands costs only the re-prefill of the turns it lacks, found by
comparing the history with the text the older cache holds. With
`durability="memory"` the future resolves at once (a crash may lose the last turns).

Before its first message the agent loads its durable state: the journal (the
history) and the cache if it is valid; a bad or missing cache means the next turn
re-prefills the history ("cold"), its replies as the tokens they were generated as
(`replayed`), so that it continues as a hot turn would. Any failure in a turn is a crash: the caller
gets `AgentCrashed`, the actor stops and its supervisor starts a fresh one, which
reloads the durable state. The caller's own mistakes are not: a turn that can never
fit (`TurnTooLong`, `TurnTooLarge`), whose conversation the model's chat template refuses
(`ChatTemplateError`) or whose callback raised (`CallbackFailed`) fails alone, with nothing
recorded. A turn's `timeout` counts from `send` (its payload's
`deadline`); running past it is not a failure: its caller gets `TurnTimeout` at
once. A turn still queued then is dropped when it comes up, never run; one in
progress stays this agent's item until the batcher answers: dropped at the
batcher's next step (`Turn.abandoned`), or, if it had finished by then, committed
like any other turn.
The actor never blocks on another actor's future, except on the persistence
actor, which never waits on agents.
"""

from __future__ import annotations

import collections
import logging
import re
import threading
import time
import uuid
from dataclasses import dataclass, replace
from typing import Any, Callable

import msgpack
import pykka

from actors import persistence
from actors.batcher import BatcherCrashed, BatcherStopped, Submit
from actors.supervisor import SupervisedActor
from runtime import chat, prefix, store
from runtime.detok import AnchoredDetokenizer
from runtime.engine import CallbackFailed, Sampling, Timings, Turn, TurnResult, TurnTooLarge
from runtime.errors import AdvisedError, KvactorsError
from runtime.q4cache import can_trim, can_trim_held

log = logging.getLogger(__name__)
DURABILITY = ("durable", "memory")
TURN_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9._:-]{0,127}")  # what a turn id looks like (the caller's or one made here)
_thread = threading.local()  # `agent`: (env, name) of the agent whose actor runs on this thread, set in its on_start


def agent_here() -> tuple[Any, str] | None:
    """(env, name) of the agent whose actor runs on this thread, else None. A reply's done callback runs on the
    thread of the agent that answered the turn: this says whose."""
    return getattr(_thread, "agent", None)


def new_turn_id(agent: str, *parts) -> str:
    """A fresh turn id for agent `agent` (a valid agent name): `<agent>-<parts>-<random hex>`, the agent's name
    cut so that the id matches TURN_ID whatever the name's length (a caller may send it back as `turn_id`)."""
    tail = "".join(f"-{p}" for p in parts) + f"-{uuid.uuid4().hex[:12]}"
    return agent[: 128 - len(tail)] + tail


class AgentError(KvactorsError, RuntimeError):
    """Base class of the errors an agent's caller can get."""


class AgentCrashed(AdvisedError, AgentError):
    """The agent crashed during turn `turn_id` (it restarts from its durable state), or the batcher did while it
    held the turn (the batcher restarts; the agent keeps its state and reloads its cache from disk).

    Retry with the same turn id (`send(..., turn_id=e.turn_id)`): if the turn did
    commit after all, the retry returns its reply instead of running it twice.
    """

    def __init__(self, turn_id: str | None, message: str, advice: str = ""):
        super().__init__(message, advice, turn_id)


class TurnTimeout(AgentCrashed):
    """The turn did not finish in time; its caller stopped waiting, nothing crashed.

    Raised by the agent's watchdog after `send(timeout=)`: the turn is dropped at the
    batcher's next step unless it had finished by then, in which case it commits as
    usual. Raised also by a reply future's `get(timeout=)` or `ask`'s wait when the wait
    runs out: then only the wait ended, and the turn goes on. Either way
    `AgentRef.result(turn_id)` says whether it committed. `dropped` is True where the turn had not started: it
    never runs, and nothing of it is recorded.
    """

    def __init__(self, turn_id: str | None, message: str, advice: str = "", dropped: bool = False):
        super().__init__(turn_id, message, advice)
        self.dropped = dropped


class AgentStopped(AgentCrashed):
    """The agent was stopped by its user (`AgentRef.stop`, `Runtime.forget`, the Runtime's shutdown) before turn
    `turn_id` finished, or before it started.

    Nothing crashed, and the agent does not restart: the turn was not acknowledged and
    is not in the history. Spawn the agent again and retry with the same turn id (if
    the turn committed after all, the retry returns its reply).
    """


class TurnNotSaved(AgentCrashed):
    """Turn `turn_id` ran, but writing it to the journal failed (a full disk, an I/O error).

    The journal is as it was before the turn, and the agent went back to its durable
    state: the turn is not in the history. Retry once the disk is fixed.
    """


class TurnTooLong(AdvisedError, AgentError):
    """Turn `turn_id` needs more positions than the model has (history + message + max_tokens).

    Nothing was recorded. Shorten the message, lower max_tokens, or start the
    conversation over (`ref.reset([])` keeps the system prompt; `rt.spawn(name,
    reset=True)` deletes the agent's files first).
    """

    def __init__(self, turn_id: str | None, message: str, fix: str = "message", advice: str = ""):
        super().__init__(message, advice, turn_id)
        self.fix = fix  # what would make it fit: "message" (shorten it or lower max_tokens), "reset" (a shorter
        # conversation would do) or "system" (the system prompt alone leaves no room)


class UnknownAgent(AdvisedError, AgentError, KeyError):
    """No agent has that name (never spawned, or stopped); spawn it first. `detail` says which, `advice` what to
    call (the running agents' names, where the Runtime has them)."""

    def __init__(self, message: str, advice: str = ""):
        super().__init__(message, advice)

    def __str__(self):
        return str(self.args[0])


@dataclass(frozen=True)
class Reply:
    """An agent's answer to one turn.

    `cache` is "cold" (the whole context was prefilled), "hot" (the agent's cache was
    in memory), "warm" (loaded from disk) or "committed" (a retry of a turn id that
    had already committed, answered from the history: nothing ran, timings are
    zero). `reused_tokens` is how many of the prompt's tokens the cache served (0
    when cold); the prompt held `reused_tokens + timings.prefill_tokens` tokens.
    `timings.ttft_s` counts from the moment the agent started the turn, a reload
    from disk included. `text` is spelled as the tokens follow the prompt (a first
    token's leading space is kept), and the same text goes to the journal and to
    the text the agent's cache holds.
    """

    agent: str
    turn_id: str
    text: str
    tokens: list
    cache: str
    finish_reason: str
    timings: Timings
    reused_tokens: int = 0


@dataclass(frozen=True)
class Ask:
    """Envelope: take a turn on msgpack `payload`; resolve `future` with the Reply.

    `on_token` and `on_progress` go to the engine's `Turn` as they are (they run on
    the batcher's thread); everything else about the turn is in the payload, every
    option included, as `AgentRef.send` checked it (the defaults are set there).
    """

    payload: bytes
    future: Any
    on_token: Callable[[str], None] | None = None
    on_progress: Callable[[int, int], None] | None = None
    cancel: Callable[[], bool] | None = None


@dataclass(frozen=True)
class Note:
    """Envelope: append the msgpack `payload` message to the history; no turn.

    A `send_to` reply carries the caller's `future` and the `reply` to resolve it with
    once the note is durable (or dead-lettered: see `AgentRef.send_to`).
    """

    payload: bytes
    future: Any = None
    reply: Any = None


@dataclass(frozen=True)
class Reset:
    """Envelope: start a new conversation from msgpack `payload`; resolve `future` once durable.

    The payload holds `system` (None keeps the current system prompt) and `records`
    ({"role": "user" | "assistant", "text", "sender"} dicts). The journal gets a
    system record followed by those messages: a system record starts a conversation,
    so the history is what follows the last one. The cache is kept; the next turn
    reuses whatever prefix of it the new conversation still matches.
    """

    payload: bytes
    future: Any


@dataclass(frozen=True)
class Lookup:
    """Envelope: resolve `future` with the committed Reply of turn `turn_id`, or None if it never committed.

    Queued like a turn, so it is answered once everything the agent took before it is
    done: a turn in progress with that id either commits first or never does.
    """

    turn_id: str
    future: Any


@dataclass(frozen=True)
class History:
    """Envelope: resolve `future` with the conversation as journal records, oldest first (JournalError while the
    journal cannot be read).

    Queued like a turn, so it is answered once everything the agent took before it is
    done: the notes and resets before it are in it, and the turns before it too unless
    they failed.
    """

    future: Any


@dataclass(eq=False)  # an item is itself: two with equal fields are still two items
class _Item:
    """One unit of an agent's work: a turn ("ask"), a note, a reset, a lookup ("result") or a "history" request,
    until it is answered."""

    kind: str
    msg: dict
    future: Any = None
    on_token: Callable[[str], None] | None = None
    on_progress: Callable[[int, int], None] | None = None
    cancel: Callable[[], bool] | None = None
    turn_id: str | None = None
    reply: Reply | None = None
    records: list | None = None  # written, awaiting the ack
    pending: dict | None = None  # a turn in the batcher: what was rendered, kept and fed
    watchdog: int | None = None  # the turn's deadline handle (env.deadlines), set when the agent receives it
    forward: tuple | None = None  # a send_to turn: (sender, note payload) to deliver once durable
    given_up: bool = False  # its caller was answered (an error): the engine drops the turn at its next step,
    # and a turn that finished anyway commits without answering anyone


@dataclass(frozen=True)
class _Done:
    turn_id: str
    outcome: Any


@dataclass(frozen=True)
class _Watchdog:
    item: _Item  # this agent's own item: the message never leaves the actor


@dataclass(frozen=True)
class _Fault:
    pass


def encode_message(text: str, sender: str | None = None, **fields) -> bytes:
    """A message payload: sender, text, conversation id, message id, plus turn options."""
    fields.setdefault("message_id", uuid.uuid4().hex)
    fields.setdefault("conversation_id", None)
    return msgpack.packb({"text": text, "sender": sender, **fields})


def render_messages(system: str, records) -> list[dict]:
    """Chat messages for the template from a system prompt and journal records.

    A message from another agent is a user message prefixed with its sender's name.
    """
    messages = [{"role": "system", "content": system}] if system else []
    for r in records:
        if r["role"] == "assistant":
            messages.append({"role": "assistant", "content": r["text"]})
        elif r["role"] == "user":
            text = f"{r['sender']}: {r['text']}" if r.get("sender") else r["text"]
            messages.append({"role": "user", "content": text})
    return messages


current_conversation = store.current_conversation  # the history: from the last system record on


def render(tokenizer, system: str, records) -> str:
    """The chat-template text of a conversation, ending with the assistant's prompt."""
    return render_chat(tokenizer, system, records).text


def render_chat(tokenizer, system: str, records) -> chat.Rendered:
    """`render`, with the spans of message text that `chat.encode` keeps as text."""
    return chat.render(tokenizer, render_messages(system, records))


def system_crowds_out(tokenizer, system: str, max_tokens: int, limit: int) -> int | None:
    """The system prompt's token count where it and `max_tokens` leave no position of the model's `limit` for a
    message (every turn would fail with TurnTooLong), else None."""
    tokens = len(chat.encode_text(tokenizer, system)) if system else 0
    return tokens if tokens + max_tokens >= limit else None


REPLAYED = 32  # replies a cold turn prefills as generated (`replayed`); earlier ones from their text


def continued(tokenizer, held, rendered: chat.Rendered):
    """How a cache holding `held` (a `CacheMeta`: token ids, their ends, the text they spell) serves `rendered`:
    (tokens to feed, kept ids, kept ends, kept text), or None where it serves nothing (start over). Kept ids
    are the cache's first tokens (cut back to them), fed tokens what follows (`prefix.match_prefix`)."""
    match = prefix.match_prefix(held.text, held.token_ids, held.token_ends, rendered.text, spans=rendered.spans,
                                held_spans=held.spans)
    if match.kind == prefix.COLD:
        return None
    fed = list(match.refeed) + (chat.encode(tokenizer, rendered, match.start) if match.suffix else [])
    keep_text = (rendered.text[: match.start] if not match.refeed
                 else held.text[: max([0, *held.token_ends[: match.keep]])])
    return fed, list(held.token_ids[: match.keep]), list(held.token_ends[: match.keep]), keep_text


def continued_held(tokenizer, held, rendered: chat.Rendered, spec=None):
    """`continued` for a cache known by its metadata alone (`held`, None: no cache), as a turn handed it out:
    None also where model `spec`'s sliding-window layers could not be cut back as asked (`can_trim_held`)."""
    go = None if held is None else continued(tokenizer, held, rendered)
    if go is not None and spec is not None and not can_trim_held(spec, len(held.token_ids), len(go[1])):
        return None
    return go


def held_after(tokenizer, rendered: str, keep_ids, keep_ends, keep_text: str, fed, generated, reply: str,
               cached: int, seq: int, turn_id: str | None, spans=()) -> store.CacheMeta:
    """What a turn's cache holds: kept tokens + fed tokens + generated tokens but the last (`cached` in all).

    Its text is the prompt `rendered` + the `reply`'s text, the very text the next render
    appends (the engine spells replies as `prefix.token_ends` does); its spans are the prompt's
    message texts (`spans`, `chat.Rendered.spans`: none known where empty) and the reply. A cached token
    whose text lies past that text (after a stop string) gets end -1, so the next
    turn's prefix match cuts the cache before it.
    """
    new_ids = list(fed) + list(generated[:-1])
    ids = (list(keep_ids) + new_ids)[:cached]
    text = rendered + reply
    limit = len(text)
    kept = list(keep_ends)
    if kept and max(kept) > limit:  # never, for ends within the kept text: a whole conversation's, on a GIL thread
        kept = [e if e <= limit else -1 for e in kept]
    new = prefix.token_ends(tokenizer, new_ids, len(keep_text), keep_ids[-1] if keep_ids else None)
    ends = (kept + [e if e <= limit else -1 for e in new])[: len(ids)]
    held = None  # no spans known
    if spans:
        held = (*spans, (len(rendered), limit)) if reply else tuple(spans)
    return store.CacheMeta(seq=seq, token_ids=ids, token_ends=ends, text=text, turn_id=turn_id, spans=held)


def replayed(tokenizer, system: str, records, spec=None, held=None):
    """What an agent's cache would hold had every turn of the conversation `records` (the current one's
    journal records) been hot: each reply as the tokens it was generated as (its record's `tokens`), each prompt
    fed as a hot turn feeds it (`continued`). None where nothing was generated. With `held` (a cache's
    metadata), what that cache would hold had the turns after it been hot: only the replies past its seq are
    replayed. A reply whose tokens do not
    spell its text with this tokenizer (a history written by another model) breaks the chain: the turn after
    it starts over from its text. Only the last REPLAYED replies are replayed (each renders the conversation
    up to it): the chain starts from the text before them. With model `spec`, a cut its sliding-window layers
    could not have made (`can_trim_held`) starts over from the text, as the hot turn did; without, every cut
    is taken as possible."""
    eos = set(getattr(tokenizer, "eos_token_ids", None) or ())
    for i in _replayable(records, held)[-REPLAYED:]:
        r, generated = records[i], [int(t) for t in records[i]["tokens"]]
        rendered = render_chat(tokenizer, system, records[:i])
        go = continued_held(tokenizer, held, rendered, spec)
        fed, keep_ids, keep_ends, keep_text = (chat.encode(tokenizer, rendered), [], [], "") if go is None else go
        if not fed or not _spells(tokenizer, fed[-1], [t for t in generated if t not in eos], r["text"]):
            held = None
            continue
        cached = len(keep_ids) + len(fed) + len(generated) - 1
        held = held_after(tokenizer, rendered.text, keep_ids, keep_ends, keep_text, fed, generated, r["text"], cached,
                          r["seq"], r.get("turn_id"), rendered.spans)
    return held


def _replayable(records, held=None) -> list:
    """The indexes of the replies in `records` that keep their generated tokens, past `held`'s seq if given."""
    return [i for i, r in enumerate(records) if r["role"] == "assistant" and r.get("tokens")
            and (held is None or r["seq"] > held.seq)]


def _spells(tokenizer, anchor: int, tokens, text: str) -> bool:
    """Whether `tokens`, after token `anchor`, spell `text` and possibly more (a reply cut at a stop string)."""
    spelled = AnchoredDetokenizer(tokenizer, anchor)
    spelled.add_tokens(tokens)
    spelled.finalize()
    return spelled.text.startswith(text)


class AgentActor(SupervisedActor):
    """One agent. Started by the runtime's supervisor; talk to it through an `AgentRef`.

    `env` carries what all agents share (see `runtime.api.facade.Env`): the tokenizer,
    the model spec, the current batcher and persistence refs, the hot-cache tier,
    the directory of agents and the dead-letter sink.
    """

    def __init__(self, supervisor, env, name: str, system: str):
        super().__init__(supervisor)
        self.env, self.name, self.system = env, name, system
        self.records: list[dict] = []
        self.seq = 0
        self.conv: int | None = None  # the seq that started the current conversation: every record names it
        self.earlier: dict[str, int] = {}  # turn id -> seq of the turns committed in earlier conversations
        self.check = store.prompt_check(system)  # the system prompt's checksum: every record carries it
        self.meta: store.CacheMeta | None = None  # what the cache holds
        self.work: collections.deque = collections.deque()
        self.current: _Item | None = None  # the item in progress, until its write is acked
        self.fault = False
        self.load_s = 0.0
        self.from_disk = False
        self.broken: Exception | None = None  # files it cannot read or write: each item retries, then fails

    # -- life cycle ------------------------------------------------------------------

    def on_start(self):
        _thread.agent = (self.env, self.name)  # this actor's own thread, for its whole life
        t0 = time.perf_counter()
        self._restore()
        self.load_s = time.perf_counter() - t0

    def _restore(self):
        """Take the durable state as this agent's state; files it cannot read or write leave it `broken`."""
        loaded = self._load_durable()
        self.broken = loaded.journal_error
        self.env.hot.discard(self.name)
        self.records, self.seq, self.meta, self.from_disk = [], 0, None, False
        if self.broken is not None:
            log.error("agent %s cannot take turns until its files are fixed: %s", self.name, self.broken)
            return
        self.records = current_conversation(loaded.records)
        start = self.records[0]["seq"] if self.records else 0
        self.earlier = _turn_seqs(r for r in loaded.records if r["seq"] < start)
        self.seq = max(loaded.records[-1]["seq"] if loaded.records else 0, loaded.last_seq)  # never reuse a seq
        self.conv = self.records[-1].get("conv", self.records[0]["seq"]) if self.records else None
        stored = store.conversation_prompt(self.records)
        if stored is not None and self.records:
            # The journal wins: `Runtime.spawn` refused a different prompt before this actor
            # started, and after a restart the stored one is the latest (a reset may have set it).
            self.system = stored
        self.check = store.prompt_check(self.system)
        restore = stored is None and self._prompt_lost()
        if (restore or not self.records) and self.system:
            try:  # a system record: it starts the conversation, or restores the lost prompt in it
                self._persist_now([self._record("system", self.system)])
            except OSError as e:  # a full disk: each later item retries instead of crash-looping
                self.broken = e
                log.error("agent %s cannot record its system prompt: %s", self.name, e)
                return
        if loaded.host is not None:
            self.env.hot.put(self.name, store.host_to_cache(loaded.host))
            self.meta = loaded.meta
            self.from_disk = True
        elif loaded.error is not None and not isinstance(loaded.error, store.CacheMissing):
            log.warning("agent %s: unusable cache, re-prefilling from the journal: %s", self.name, loaded.error)

    def _prompt_lost(self) -> bool:
        """The record that held the conversation's system prompt was destroyed; return whether to record it again.

        A prompt that matches the checksum the records carry (`Runtime.spawn` checked the
        one it was given) is the lost one: `_restore` records it again. Otherwise the
        agent goes on with none, says so, and its records keep the lost prompt's checksum
        for a later spawn to match.
        """
        lost = self.records[-1].get("check")
        if self.system and lost in (None, self.check):
            log.warning("agent %s: the journal record holding its system prompt was lost; it is restored from "
                        "the prompt given to spawn", self.name)
            return True
        log.error("agent %s: the journal record holding its system prompt was lost, so the prompt is unknown; it "
                  "goes on without one: spawn it with its system prompt to restore it", self.name)
        self.system = ""
        self.check = self.check if lost is None else lost
        return False

    def on_failure(self, exception_type, exception_value, traceback):
        self.env.hot.discard(self.name)
        why = f"{exception_type.__name__}: {exception_value}"
        if self.current is not None:
            error = exception_value  # e.g. the watchdog's TurnTimeout: the caller gets it as is
            if not (isinstance(error, AgentCrashed) and error.turn_id == self.current.turn_id):
                error = AgentCrashed(self.current.turn_id, f"the agent crashed ({why})")
            self._abandon(self.current, error, f"the agent crashed while recording this note ({why})")
        self._drop_work(f"the agent crashed before this message ({why}); retry it")
        self._drain_inbox(why)

    def on_stop(self):
        # A stop can come while a turn is in flight or queued in `work`: answer them too. The user's stop is for
        # good (AgentStopped); the supervisor's (a sibling crashed, or supervision gave up) is a crash to the caller.
        if self.env.stopped_by_user(self.name):
            error, why, retry = AgentStopped, "the agent was stopped", "spawn it again and retry"
        else:
            error, why, retry = AgentCrashed, "the agent was stopped by its supervisor", "retry"
        if self.current is not None:
            self._abandon(self.current, error(self.current.turn_id, f"{why} before the turn finished", f"; {retry}"),
                          f"{why} while recording this note")
        self._drop_work(f"{why} before this message; {retry}", error)
        self._drain_inbox(why, error, retry)

    def _drop_work(self, why, error=AgentCrashed):
        # Items taken from the inbox but not started: fail the turns (with `error`), dead-letter the notes.
        for item in self.work:
            self._abandon(item, error(item.turn_id, why), why)
        self.work.clear()

    def _abandon(self, item: _Item, error: AgentError, why: str):
        """Fail a turn's caller with `error` (unless it was answered already); dead-letter a note (its send_to future gets its reply)."""
        answered, item.given_up = item.given_up, True
        self.env.deadlines.cancel(item.watchdog)
        if self.current is item:
            self.current = None
        if item.kind == "note":
            _dead_letter(self.env, self.name, Note(msgpack.packb(item.msg), item.future, item.reply), why)
        elif not answered:
            _fail(item.future, error)

    def _drain_inbox(self, why, error=AgentCrashed, retry="retry it"):
        for msg in self.take_leftover(Ask, Note, Reset, Lookup, History):
            if isinstance(msg, Ask):
                turn_id = msgpack.unpackb(msg.payload).get("turn_id")
                _fail(msg.future, error(turn_id, f"{why} before this message; {retry}"))
            elif isinstance(msg, Lookup):
                _fail(msg.future, error(msg.turn_id, f"{why} before this lookup; ask again"))
            elif isinstance(msg, History):
                _fail(msg.future, error(None, f"{why} before this request for its history; ask again"))
            elif isinstance(msg, Reset):
                _fail(msg.future, error(None, f"{why} before this message; {retry}"))
            elif isinstance(msg, Note):
                _dead_letter(self.env, self.name, msg, why)

    # -- the mailbox ------------------------------------------------------------------

    def on_receive(self, message):
        if isinstance(message, Ask):
            msg = msgpack.unpackb(message.payload)
            item = _Item("ask", msg, message.future, turn_id=msg.get("turn_id"), on_token=message.on_token,
                         on_progress=message.on_progress, cancel=message.cancel)
            if msg.get("deadline") is not None:
                item.watchdog = self.env.deadlines.schedule(msg["deadline"] - time.monotonic(), _tell_quietly,
                                                            self.actor_ref, _Watchdog(item))
            self.work.append(item)
        elif isinstance(message, Note):
            self.work.append(_Item("note", msgpack.unpackb(message.payload), message.future, reply=message.reply))
        elif isinstance(message, Reset):
            self.work.append(_Item("reset", msgpack.unpackb(message.payload), message.future))
        elif isinstance(message, Lookup):
            self.work.append(_Item("result", {}, message.future, turn_id=message.turn_id))
        elif isinstance(message, History):
            self.work.append(_Item("history", {}, message.future))
        elif isinstance(message, _Done):
            self._finish_turn(message)
        elif isinstance(message, persistence.Ack):
            self._acked(message)
        elif isinstance(message, _Watchdog):
            self._timed_out(message.item)
        elif isinstance(message, _Fault):
            self.fault = True
        else:
            raise TypeError(f"agent {self.name} got an unknown message {message!r}")
        self._next()

    def _answer_history(self, item: _Item):
        """Answer history request `item` with the conversation as journal records (seq, role, text, sender, ...),
        oldest first: everything taken before it is done, so they are durable (with durability="memory", handed to
        the persistence actor). While the journal cannot be read it fails with JournalError (an empty list would
        pass for a conversation that never happened)."""
        if isinstance(self.broken, store.JournalError):
            self._abandon(item, store.JournalError(f"agent {self.name}: {self.broken}"), str(self.broken))
            return
        item.reply = [dict(r) for r in self.records]
        self._complete(item)

    def _reread(self, item: _Item):
        """`_restore` for an agent whose files were broken, before taking `item`. For a history request, a reread of
        an unreadable journal that fails now (say, a slow disk) is no crash either: the journal is still unreadable,
        and the request fails with JournalError (`_answer_history`)."""
        broken = self.broken
        try:
            self._restore()
        except Exception as e:  # noqa: BLE001 - re-raised unless it failed before changing anything
            if item.kind != "history" or not isinstance(broken, store.JournalError) or self.broken is not broken:
                raise
            log.warning("agent %s: rereading its journal failed: %s", self.name, e)

    def _next(self):
        while self.current is None and self.work:
            item = self.current = self.work.popleft()
            if self.broken is not None:
                self._reread(item)  # the files may have been fixed meanwhile
            if item.kind == "history":
                self._answer_history(item)
            elif item.kind == "result" and not isinstance(self.broken, store.JournalError):
                self._answer_if_committed(item)  # the history is loaded: it says
            elif self.broken is not None:
                error = (store.JournalError(f"agent {self.name}: {self.broken}") if isinstance(self.broken, store.JournalError)
                         else TurnNotSaved(item.turn_id, f"agent {self.name} cannot record its system prompt ({self.broken}); "
                                                 "retry once the disk is fixed"))
                self._abandon(item, error, f"agent {self.name} cannot record messages: {self.broken}")
            elif item.kind == "ask" and _overdue(item):
                self._timed_out(item)  # its caller stopped waiting before it started: it never runs
            elif item.kind == "ask" and self._answer_if_committed(item):
                pass  # a retry of a turn that already committed: answered with its reply, nothing runs
            elif item.kind == "note":
                msg = item.msg
                item.records = [self._record("user", msg["text"], sender=msg.get("sender"), msg=msg)]
                self.records += item.records
                self._persist(item.records)
            elif item.kind == "reset":
                self._reset(item)
            else:
                self._start_turn(item)

    def _reset(self, item: _Item):
        msg = item.msg
        if msg.get("system") is not None:
            self.system = msg["system"]
        self.check, self.conv = store.prompt_check(self.system), None  # the system record starts a conversation
        upto = self.seq + 1 + len(msg["records"])  # one append: the reader drops it whole if it was cut short
        item.records = [self._record("system", self.system, upto=upto)] + [
            self._record(r["role"], r["text"], sender=r.get("sender"), **({"tokens": r["tokens"]} if "tokens" in r else {}))
            for r in msg["records"]]
        self.earlier.update(_turn_seqs(self.records))
        self.records = list(item.records)
        self._persist(item.records)

    # -- a turn ------------------------------------------------------------------

    def _start_turn(self, item: _Item):
        msg = item.msg
        turn_id = item.turn_id = item.turn_id or new_turn_id(self.name, self.seq + 1)
        user = self._record("user", msg["text"], sender=msg.get("sender"), msg=msg, turn_id=turn_id)
        try:
            rendered = render_chat(self.env.tokenizer, self.system, self.records + [user])
        except chat.ChatTemplateError as e:  # the conversation's fault, not the agent's: no crash, nothing recorded
            self.seq = user["seq"] - 1
            error = chat.ChatTemplateError(e.detail, turn_id, e.advice)
            self._abandon(item, error, str(error))
            return
        cache, tokens, label, keep_ids, keep_ends, keep_text = self._reuse(rendered)
        reuse = None if cache is None else (self.meta.seq, len(keep_ids))  # lets the store write a delta
        item.pending = dict(user=user, rendered=rendered.text, spans=rendered.spans, label=label, keep_ids=keep_ids,
                            keep_ends=keep_ends, keep_text=keep_text, fed=tokens, reuse=reuse)
        max_tokens = msg["max_tokens"]
        need, limit = len(keep_ids) + len(tokens) + max_tokens, self.env.max_context
        if limit is not None and need > limit:
            self.seq = user["seq"] - 1  # the user record was never written
            fix, advice = self._too_long_advice(msg, max_tokens, limit)
            error = TurnTooLong(turn_id, f"it needs {need} positions ({len(keep_ids)} cached + {len(tokens)} new tokens "
                                         f"+ max_tokens {max_tokens}) but the model has {limit}", fix, f"; {advice}")
            self._abandon(item, error, str(error))
            return
        turn = Turn(
            turn_id=turn_id,
            agent_id=self.name,
            cache=cache,
            tokens=tokens,
            sampling=Sampling(msg["temperature"], msg["top_p"], msg["seed"]),
            max_tokens=max_tokens,
            stop_strings=tuple(msg["stop"]),
            on_token=item.on_token,
            on_progress=item.on_progress,
            cancel=item.cancel,
            abandoned=lambda: item.given_up,
        )
        me = self.actor_ref
        env = self.env

        def reply(outcome):  # runs on the batcher's thread: never raise there
            try:
                me.tell(_Done(turn_id, outcome))
            except pykka.ActorDeadError:
                env.dead_letter(self.name, outcome, "the agent was gone when its turn finished")

        env.submit_turn(Submit(turn, reply), me)  # held while the batcher restarts

    def _timed_out(self, item: _Item):
        """Turn `item` ran past its deadline: answer its caller now; no crash, no restart.

        A turn that has not started is dropped: it never runs (the agent may be taking
        it up right now: `_next` calls this then). One in progress stays the item in
        progress, so everything queued behind it still waits: the batcher drops it at
        its next step (`_finish_turn` then gets TurnAbandoned), or it finished
        meanwhile and commits as usual. An item already answered or done is left alone.
        """
        if item.given_up or (item is not self.current and not any(w is item for w in self.work)):
            return
        if item.pending is None:  # not started
            self.work = collections.deque(w for w in self.work if w is not item)
            self._abandon(item, TurnTimeout(item.turn_id, "the turn did not start within its timeout (it waited "
                                                          "behind the agent's earlier work); it was dropped and never "
                                                          "runs", ": retry it", dropped=True), "timed out")
            return
        item.given_up, item.watchdog = True, None
        where = ("it is being written and commits unless the write fails" if item.records is not None
                 else "it is cancelled at the batcher's next step unless it finished meanwhile")
        _fail(item.future, TurnTimeout(item.turn_id, f"the turn did not finish within its timeout; {where}",
                                       ": ref.result(turn_id) says whether it committed"))

    def _too_long_advice(self, msg: dict, max_tokens: int, limit: int) -> tuple[str, str]:
        """What to do about a turn that does not fit (`TurnTooLong.fix`, then the advice in words): a reset only
        helps if the system prompt and the message do."""
        tokenizer = self.env.tokenizer
        fresh = render_chat(tokenizer, self.system, [{"role": "user", "text": msg["text"], "sender": msg.get("sender")}])
        alone = len(chat.encode(tokenizer, fresh)) + max_tokens
        if alone <= limit:
            return "reset", "shorten the message, lower max_tokens, or start the conversation over (ref.reset([]))"
        system = system_crowds_out(tokenizer, self.system, max_tokens, limit)
        if system is not None:
            return "system", (f"the system prompt alone is {system} tokens: forget the agent (rt.forget(name)) and "
                              "spawn it with a shorter one")
        return "message", f"even in a fresh conversation it would need {alone}: shorten the message or lower max_tokens"

    def _reuse(self, rendered: chat.Rendered):
        """(cache, tokens to feed, cache label, kept ids, kept ends, kept text) for `rendered`.

        Message text is tokenized as text: a special-token string in a message stays text.
        """
        cache = self.env.hot.get(self.name) if self.meta else None
        label = "warm" if self.from_disk else "hot"
        if cache is None and self.meta is not None:
            t0 = time.perf_counter()
            loaded = self._load_durable()
            if loaded.host is not None and loaded.meta == self.meta:
                cache = store.host_to_cache(loaded.host)
                label = "warm"
            self.load_s += time.perf_counter() - t0
        if cache is None:
            return None, self._cold_tokens(rendered), "cold", [], [], ""
        go = self._continued(rendered)
        if go is None or not can_trim(self.env.spec, cache, len(go[1])):
            return None, self._cold_tokens(rendered), "cold", [], [], ""
        fed, keep_ids, keep_ends, keep_text = go
        if len(keep_ids) < len(self.meta.token_ids):
            cache = store.trim_cache(cache, len(keep_ids))
        return cache, fed, label, keep_ids, keep_ends, keep_text

    def _continued(self, rendered: chat.Rendered):
        """`continued` for the cache `self.meta` describes. Where the journal has replies past that cache (its file
        had not landed when the process died, or a later one was damaged), they are fed as they were generated
        (`replayed` from the cache on), as the hot turns that are lost had fed them: a turn after a crash then
        continues as it would have without it; the text is tokenized where that cannot be known."""
        tokenizer, held = self.env.tokenizer, self.meta
        if _replayable(self.records, held):
            try:
                ahead = replayed(tokenizer, self.system, self.records, self.env.spec, held)
            except Exception as e:  # a replay is for fidelity only: it never fails a turn
                log.warning("agent %s: replaying its replies' tokens past its cache failed (%s: %s); they are "
                            "tokenized from their text", self.name, type(e).__name__, e)
                ahead = None
            if ahead is not None:  # as the hot turn did: a cut the sliding windows could not make starts over
                go = continued_held(tokenizer, ahead, rendered, self.env.spec)
                if go is None:
                    return None
                fed, keep_ids, keep_ends, keep_text = go
                n = prefix.common_prefix_len(held.token_ids, keep_ids)  # the cache holds these: the replayed rest is fed
                if len(keep_ids) > n:
                    fed, keep_ids, keep_ends = list(keep_ids[n:]) + fed, keep_ids[:n], keep_ends[:n]
                    keep_text = ahead.text[: max([0, *keep_ends])]
                return fed, keep_ids, keep_ends, keep_text
        return continued(tokenizer, held, rendered)

    def _cold_tokens(self, rendered: chat.Rendered) -> list:
        """The tokens a turn with no cache prefills: what a cache kept through every turn of the conversation
        would hold (`replayed`: replies as their tokens, not their text tokenized again) and then feed, so that a
        cold turn continues as a hot one would; the whole text tokenized where that cannot be known."""
        tokenizer = self.env.tokenizer
        try:
            spec = self.env.spec
            go = continued_held(tokenizer, replayed(tokenizer, self.system, self.records, spec), rendered, spec)
        except Exception as e:  # a replay is for fidelity only: it never fails a turn
            log.warning("agent %s: replaying its replies' tokens failed (%s: %s); its history is tokenized from "
                        "its text", self.name, type(e).__name__, e)
            go = None
        if go is None:
            return chat.encode(tokenizer, rendered)
        fed, keep_ids, _, _ = go
        return list(keep_ids) + fed

    def _finish_turn(self, done: _Done):
        item = self.current
        if item is None or item.turn_id != done.turn_id:
            return  # a late answer to a turn that already failed
        msg, turn_id, outcome = item.msg, item.turn_id, done.outcome
        if isinstance(outcome, (TurnTooLarge, CallbackFailed)) or (item.given_up and isinstance(outcome, BaseException)):
            # it can never fit the memory budget, its caller's callback raised, or its caller gave up and it was
            # dropped: not a fault
            self.seq = item.pending["user"]["seq"] - 1  # the user record was never written
            self._abandon(item, outcome, str(outcome))
            return
        if isinstance(outcome, (BatcherCrashed, BatcherStopped)):
            # the batcher's fault, not this agent's: the turn fails, nothing of it was recorded, no restart (a full
            # batch of agents restarting at once would exceed the restart intensity and stop the Runtime)
            self.seq = item.pending["user"]["seq"] - 1
            self.env.hot.discard(self.name)  # the engine held the cache: the next turn reloads it from disk
            self._abandon(item, AgentCrashed(turn_id, f"the turn failed: {outcome}", "; retry with the same turn_id"),
                          str(outcome))
            return
        if isinstance(outcome, BaseException):
            raise AgentCrashed(turn_id, f"the turn failed: {outcome}") from outcome
        if self.fault:
            self.fault = False
            raise AgentCrashed(turn_id, "injected fault (runtime.api.testing.inject_crash)")
        p = item.pending
        result: TurnResult = outcome
        assistant = self._record("assistant", result.text, turn_id=turn_id, tokens=[int(t) for t in result.tokens],
                                 finish_reason=result.finish_reason)
        meta = self._cache_meta(p, result, assistant["seq"])
        self.records.append(p["user"])
        self.records.append(assistant)
        self.meta = meta
        self.from_disk = False
        self.env.hot.put(self.name, result.cache)
        timings = replace(result.timings, ttft_s=result.timings.ttft_s + self.load_s)
        self.load_s = 0.0
        item.reply = Reply(self.name, turn_id, result.text, list(result.tokens), p["label"], result.finish_reason, timings,
                           reused_tokens=len(p["keep_ids"]))
        item.records = [p["user"], assistant]
        if msg.get("reply_to_agent"):  # the reply goes to the sender once this turn is durable: see _complete
            item.forward = (msg["reply_to_agent"], encode_message(result.text, sender=self.name,
                                                                  conversation_id=msg.get("conversation_id")))
        self._persist(item.records, store.on_device(result.cache), meta, p["reuse"])

    def _cache_meta(self, p, result, seq) -> store.CacheMeta:
        """What the returned cache holds (`held_after`)."""
        return held_after(self.env.tokenizer, p["rendered"], p["keep_ids"], p["keep_ends"], p["keep_text"], p["fed"],
                          result.tokens, result.text, result.cached_tokens, seq, result.turn_id, p["spans"])

    # -- persistence ------------------------------------------------------------------

    def _record(self, role, text, sender=None, msg=None, turn_id=None, **fields):
        """The next journal record; the first one after `conv` was cleared starts a conversation."""
        self.seq += 1
        if self.conv is None:
            self.conv = self.seq
        extra = {}
        if msg:
            extra = {"message_id": msg.get("message_id"), "conversation_id": msg.get("conversation_id")}
        return store.journal_record(self.seq, role, text, turn_id=turn_id, sender=sender, conv=self.conv,
                                    check=self.check, **extra, **fields)

    def _answer_if_committed(self, item: _Item) -> bool:
        """Answer `item` with the Reply of its turn id if that turn committed; return whether it was answered.

        A lookup ("result") is always answered: with None when the turn never committed.
        A turn of an earlier conversation is read back from the journal; if that fails,
        the item fails with JournalError.
        """
        try:
            item.reply = self._committed(item.turn_id)
        except store.JournalError as e:
            self._abandon(item, e, str(e))
            return True
        if item.reply is None and item.kind != "result":
            return False
        self._complete(item)
        return True

    def _committed(self, turn_id) -> Reply | None:
        """The Reply of turn `turn_id` if it committed, in this conversation or an earlier one (cache "committed"), else None.

        Raises JournalError when the turn is in an earlier conversation and the journal
        cannot be read back.
        """
        if turn_id is None:
            return None
        found = [r for r in self.records if r["role"] == "assistant" and r.get("turn_id") == turn_id]
        if not found and turn_id in self.earlier:
            records = self.env.persistence().proxy().records(self.name).get(timeout=self.env.io_timeout)
            if records is None:
                raise store.JournalError(f"agent {self.name}: turn {turn_id} committed in an earlier conversation, "
                                         "but the journal cannot be read back now; fix its file and ask again")
            found = [r for r in records if r["seq"] == self.earlier[turn_id]]
        if not found:
            return None
        r = found[-1]
        return Reply(self.name, turn_id, r["text"], list(r.get("tokens", [])), "committed",
                     r.get("finish_reason", "unknown"), Timings())

    def _load_durable(self) -> store.Loaded:
        # Blocks on the persistence actor, which never waits on agents: no deadlock.
        return self.env.persistence().proxy().load(self.name).get(timeout=self.env.io_timeout)

    def _persist_now(self, records):
        persistence.submit(self.env.persistence(), self.name, records[-1]["seq"], records=records).get(
            timeout=self.env.io_timeout)
        self.records += records

    def _persist(self, records, cache=None, meta=None, reuse=None):
        persistence.submit(self.env.persistence(), self.name, records[-1]["seq"], cache, meta, records,
                           reply_to=self.actor_ref, reuse=reuse)
        if self.env.durability == "memory":
            self._complete(self.current)

    def _acked(self, ack: persistence.Ack):
        item = self.current
        mine = item is not None and item.records and ack.seq == item.records[-1]["seq"]
        if ack.error is not None:
            if not mine or self.env.durability != "durable":  # memory: later items already built on it
                raise AgentCrashed(None, f"persisting seq {ack.seq} failed: {ack.error}") from ack.error
            # The journal is as before this item (the store cuts a failed append back): so is the agent.
            log.error("agent %s: writing seq %d failed, the item is dropped: %s", self.name, ack.seq, ack.error)
            self._restore()
            error = TurnNotSaved(item.turn_id, f"the turn was not saved ({ack.error}); it is not in the history, retry it")
            self._abandon(item, error, f"recording this note failed: {ack.error}")
        elif mine:
            self._complete(item)

    def _complete(self, item: _Item):
        """The item is durable (or, with durability="memory", handed to the persistence actor): answer it."""
        self.current = None
        self.env.deadlines.cancel(item.watchdog)
        future = None if item.given_up else item.future  # a timed-out caller was answered already
        if item.forward is not None:  # send_to: the caller's future resolves once the sender has the reply too
            self.env.notify(*item.forward, future=future, reply=item.reply)
        elif future is not None:
            future.set(item.reply)


def _turn_seqs(records) -> dict[str, int]:
    """Turn id -> seq of the assistant records (the committed turns) among `records`."""
    return {r["turn_id"]: r["seq"] for r in records if r["role"] == "assistant" and r.get("turn_id")}


def _overdue(item: _Item) -> bool:
    """Whether turn `item`'s deadline (counted from `send`) has passed."""
    deadline = item.msg.get("deadline")
    return deadline is not None and time.monotonic() >= deadline


def _fail(future, error):
    if future is not None:
        future.set_exception((type(error), error, None))


def _dead_letter(env, name: str, note: Note, why: str):
    """Dead-letter `note`; a send_to reply's future resolves with the reply (the dead letter keeps the copy)."""
    env.dead_letter(name, note, why)
    if note.future is not None:
        note.future.set(note.reply)


def _tell_quietly(ref, message):
    try:
        ref.tell(message)
    except pykka.ActorDeadError:
        pass

