"""`kvactors serve`: an OpenAI-compatible HTTP endpoint where every conversation is a persistent agent.

    kvactors serve --model M --cache-dir D [--host 127.0.0.1 --port 8000 --api-key K]

Routes: `POST /v1/chat/completions` (streaming and not), `GET /v1/models`, `GET /health`,
and native agent routes for what OpenAI's API has no words for (`/v1/agents...`: spawn,
history, send_to, forget). Built on starlette + uvicorn, on top of the `Runtime` facade.

Which agent serves a request:
- the header `X-Agent-Id: NAME` names it (a persistent agent, as `rt.spawn(NAME)`);
- otherwise its id is derived from a hash of the `user` field, the system prompt and
  the first user message, so a client that resends its conversation lands on the same
  agent every call. (`user` is an end user's id in OpenAI's API, and one user has many
  conversations: it scopes derived ids, it does not name an agent.)

How a request's messages map onto the agent's history (see `plan_turn`): if the agent's
history is a prefix of the messages and only user messages follow, those are appended
(all but the last as notes, the last as a turn): the cache is hot or warm. Otherwise the
agent's conversation is reset to the request's messages, and its cache still serves the
longest prefix the prefix rules (EXACT / EXTEND / DIVERGE) allow. A named agent also
takes a request holding only user messages (and no new system prompt) as new messages
to append: a stateful client sends only what is new.

The response says which cache state served it: the headers `X-KV-Cache` (non-streaming)
and `X-Agent-Id`, a top-level `kvactors` object {agent, cache, ttft_s, prefill_tokens},
and `usage.prompt_tokens_details.cached_tokens`.

A request body larger than any request the model's positions can hold is refused (413,
`body_limit`) as it arrives, before it is read whole.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import hmac
import json
import logging
import os
import re
import secrets
import signal
import socket
import sys
import threading
import time
import uuid
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, StreamingResponse
from starlette.routing import Route

from runtime import (AgentCrashed, AgentStopped, ChatTemplateError, JournalError, Reply, Runtime, RuntimeClosed,
                     RuntimeEscalated, SystemPromptChanged, SystemPromptTooLong, TurnNotSaved, TurnTimeout, TurnTooLarge,
                     TurnTooLong, UnknownAgent, WaitTimeout)
from runtime.api.facade import (_number as _check_number, _positive, check_conversation_fits, check_room,
                                check_top_p, check_unicode, message_chars)
from runtime.errors import InvalidArgument, InvalidArgumentType, KvactorsError, shown
from runtime.store import InvalidAgentId, check_agent_id, conversation_prompt

log = logging.getLogger(__name__)
REFUSED = {  # fields we cannot honour: refused rather than silently ignored
    "tools": "tools (function calling) are not supported by kvactors serve",
    "functions": "functions (function calling) are not supported by kvactors serve",
    "tool_choice": "tool_choice is not supported: kvactors serve has no function calling",
    "logprobs": "logprobs are not supported by kvactors serve",
    "top_logprobs": "logprobs are not supported by kvactors serve",
    "audio": "audio output is not supported by kvactors serve",
}
NEUTRAL_ONLY = {"logit_bias": {}, "frequency_penalty": 0, "presence_penalty": 0}  # no sampler here has them: only
# their no-op values, which some clients always send, are taken
MAX_STOP = 4


class ApiError(KvactorsError):
    """An error answered as OpenAI's error body with an HTTP status (4xx for a bad request)."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 type: str = "invalid_request_error"):
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.type = status, message, param, code, type

    def response(self) -> JSONResponse:
        """The JSON response: {"error": {"message", "type", "param", "code"}} with the status."""
        return JSONResponse({"error": {"message": self.message, "type": self.type, "param": self.param,
                                       "code": self.code}}, status_code=self.status)


BODY_SLACK = 1 << 20  # bytes a request body may hold beyond its text: field names, roles, the options
UNBOUNDED_BODY_LIMIT = 256 << 20  # the limit where the model does not bound it (64M characters escaped)


def body_limit(rt: Runtime) -> int:
    """The most bytes a request body may hold: 12 per character of the longest text the model can take
    (a character escaped as JSON, a surrogate pair, is 12 bytes) plus BODY_SLACK; UNBOUNDED_BODY_LIMIT where
    the model does not say its positions (`Runtime.max_context`) or the tokenizer does not bound a text's
    characters by them (`Runtime.longest_token_chars`), so that no body can fill the server's memory.

    Any request whose text fits the model's positions, sent as plain JSON, fits under it; a bigger body
    is refused (413) before it is read whole.
    """
    longest, positions = rt.longest_token_chars, rt.max_context
    if not (longest and positions):
        return UNBOUNDED_BODY_LIMIT
    return 12 * positions * longest + BODY_SLACK


def bad(message: str, param: str | None = None, code: str | None = "invalid_value") -> ApiError:
    """A 400 invalid_request_error about `param`."""
    return ApiError(400, message, param, code)


@dataclass
class ChatRequest:
    """A validated chat completion request: who, what, and the sampling options."""

    system: str | None  # None: no system message in the request
    messages: list  # (role, content, sender) tuples after the system message; the last is a user message
    agent: str | None = None  # named by X-Agent-Id
    user: str | None = None
    max_tokens: int | None = None
    temperature: float = 1.0
    top_p: float = 1.0
    seed: int = 0
    stop: list = field(default_factory=list)
    stream: bool = False
    include_usage: bool = False


def _number(body, name, lo, hi, default):
    value = body.get(name)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise bad(f"{name} must be a number, got {type(value).__name__}", name, "invalid_type")
    if not lo <= value <= hi:  # NaN (which json.loads takes) fails it
        raise bad(f"{name} must be in [{lo}, {hi}], got {shown(value)}", name)
    return value


def _checked(body, name, check, default):
    """`body[name]` (`default` where absent or null) if `check`, the Python API's validator of that option, takes
    it; else a 400 about `name`."""
    value = body.get(name)
    if value is None:
        return default
    try:
        check(value)
    except InvalidArgumentType as e:
        raise bad(str(e), name, "invalid_type") from None
    except InvalidArgument as e:
        raise bad(str(e), name) from None
    return value


def _integer(body, name, lo, hi):
    value = body.get(name)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int):
        raise bad(f"{name} must be an integer, got {type(value).__name__}", name, "invalid_type")
    if not lo <= value <= hi:
        raise bad(f"{name} must be between {lo} and {hi}, got {shown(value)}", name)
    return value


def _content(message: dict, i: int) -> str:
    content = message.get("content")
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        texts = []
        for part in content:
            if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise bad("only text content parts are supported (no images, audio or files)",
                          f"messages[{i}].content", "unsupported_content")
            texts.append(part["text"])
        return "".join(texts)
    raise bad("a message's content must be a string or a list of text parts", f"messages[{i}].content", "invalid_type")


def parse_messages(messages) -> tuple[str | None, list]:
    """(system prompt or None, [(role, content, sender)]) from OpenAI `messages`; raises ApiError.

    System (or developer) messages may only lead; tool messages and tool calls are
    refused; the last message must be a non-empty user message.
    """
    if not isinstance(messages, list) or not messages:
        raise bad("messages must be a non-empty list of {role, content} objects", "messages", "invalid_type")
    system, out = None, []
    for i, m in enumerate(messages):
        if not isinstance(m, dict):
            raise bad("each message must be an object with role and content", f"messages[{i}]", "invalid_type")
        role = m.get("role")
        if role in ("tool", "function") or m.get("tool_calls") or m.get("function_call"):
            raise bad("tool messages and tool calls are not supported by kvactors serve",
                      f"messages[{i}]", "unsupported_parameter")
        if role in ("system", "developer"):
            if out:
                raise bad("system messages must come before the conversation's first user or assistant message",
                          f"messages[{i}]")
            text = _content(m, i)
            system = text if system is None else system + "\n\n" + text
        elif role in ("user", "assistant"):
            sender = m.get("name") if role == "user" else None
            if sender is not None and not isinstance(sender, str):
                raise bad("a message's name must be a string", f"messages[{i}].name", "invalid_type")
            out.append((role, _content(m, i), sender or None))
        else:
            raise bad(f"unknown role {role!r}: use system, developer, user or assistant", f"messages[{i}].role")
    if not out or out[-1][0] != "user":
        raise bad("the last message must be a user message (the one to answer)", "messages")
    if not out[-1][1]:
        raise bad("the last user message is empty: give the model something to answer",
                  f"messages[{len(messages) - 1}].content")
    if out[-1][2] is not None:  # the turn's sender: an agent id (an earlier message's name is any string)
        try:
            check_agent_id(out[-1][2])
        except InvalidAgentId as e:
            raise bad(f"the last user message's name is the turn's sender, an agent id: {e}",
                      f"messages[{len(messages) - 1}].name", "invalid_agent_id") from None
    return system, out


def parse_chat(body, agent_header: str | None = None) -> ChatRequest:
    """Validate a /v1/chat/completions body (and the X-Agent-Id header); raise ApiError for bad input."""
    if not isinstance(body, dict):
        raise bad("the request body must be a JSON object", None, "invalid_type")
    for name, why in REFUSED.items():
        if body.get(name) not in (None, False, [], "none"):
            raise bad(why, name, "unsupported_parameter")
    for name, neutral in NEUTRAL_ONLY.items():
        value = body.get(name)
        if value is not None and (isinstance(value, bool) or value != neutral):
            raise bad(f"{name} is not supported by kvactors serve (only {json.dumps(neutral)})", name,
                      "unsupported_parameter")
    if not isinstance(body.get("model"), str):
        raise bad("model is required (a string; this server serves one model, see GET /v1/models)", "model",
                  "missing_required_parameter" if "model" not in body else "invalid_type")
    fmt = body.get("response_format")
    if fmt is not None and fmt != {"type": "text"}:
        raise bad("response_format other than {\"type\": \"text\"} is not supported", "response_format",
                  "unsupported_parameter")
    _integer(body, "n", 1, 1)  # one choice only
    system, messages = parse_messages(body.get("messages"))
    req = ChatRequest(system, messages)
    maxes = [_integer(body, k, 1, 1 << 20) for k in ("max_completion_tokens", "max_tokens")]
    req.max_tokens = next((m for m in maxes if m is not None), None)
    req.temperature = float(_number(body, "temperature", 0, 2, 1.0))
    req.top_p = float(_checked(body, "top_p", check_top_p, 1.0))  # 0: greedy, as in `ask`
    seed = _integer(body, "seed", 0, (1 << 63) - 1)
    req.seed = secrets.randbits(63) if seed is None else seed  # unseeded sampling varies, as OpenAI's does
    stop = body.get("stop")
    if isinstance(stop, str):
        stop = [stop]
    if stop is not None:
        if not isinstance(stop, list) or not all(isinstance(s, str) and s for s in stop) or len(stop) > MAX_STOP:
            raise bad(f"stop must be a non-empty string or a list of up to {MAX_STOP} of them", "stop")
        req.stop = stop
    stream = body.get("stream", False)
    if stream is not None and not isinstance(stream, bool):
        raise bad("stream must be a boolean", "stream", "invalid_type")
    req.stream = bool(stream)
    options = body.get("stream_options")
    if options is not None:
        if not req.stream:
            raise bad("stream_options is only allowed with stream: true", "stream_options")
        if not isinstance(options, dict) or not isinstance(options.get("include_usage", False), bool):
            raise bad("stream_options must be an object like {\"include_usage\": true}", "stream_options", "invalid_type")
        req.include_usage = options.get("include_usage", False)
    user = body.get("user")
    if user is not None and not isinstance(user, str):
        raise bad("user must be a string", "user", "invalid_type")
    req.user = user
    if agent_header is not None:
        try:
            req.agent = check_agent_id(agent_header)
        except InvalidAgentId as e:
            raise bad(str(e), "X-Agent-Id", "invalid_agent_id") from None
    return req


def derive_agent_id(user: str | None, system: str | None, first_user: str) -> str:
    """The agent id of an unnamed conversation: a hash of its user, system prompt and first user message."""
    key = json.dumps([user or "", system or "", first_user], ensure_ascii=False).encode()
    return "chat-" + hashlib.sha256(key).hexdigest()[:32]


@dataclass(frozen=True)
class Plan:
    """What to do to an agent for a request: reset (to `records`, maybe a new system), notes, then a turn."""

    ask: str
    ask_sender: str | None = None
    notes: tuple = ()  # (text, sender) pairs appended before the turn
    reset: list | None = None  # new conversation records, or None to keep the history
    system: str | None = None  # a new system prompt (with reset), or None to keep it


def _messages(history: list[dict]) -> list[dict]:
    """The user and assistant records of `history` (journal records), in order."""
    return [r for r in history if r["role"] in ("user", "assistant")]


def _pair(record: dict) -> tuple:
    """A message record as a request's message: (role, text, sender), the sender a user's only."""
    return record["role"], record["text"], record.get("sender") if record["role"] == "user" else None


def _pairs(history: list[dict]) -> list:
    return [_pair(r) for r in _messages(history)]


def plan_turn(history: list[dict], req: ChatRequest, named: bool) -> Plan:
    """Map a request's messages onto an agent whose current conversation is `history` (journal records).

    Continue (hot/warm) when the history is a prefix of the messages followed by user
    messages only, or, for a named agent, when the request holds user messages only;
    otherwise reset the conversation to the request's messages (the cache still serves
    the longest prefix the prefix rules allow).
    """
    system_now = conversation_prompt(history) or ""
    new_system = req.system is not None and req.system != system_now
    last = req.messages[-1]
    tail = None
    if not new_system:
        have = _pairs(history)
        if named and all(m[0] == "user" for m in req.messages):
            tail = req.messages
        elif req.messages[: len(have)] == have and all(m[0] == "user" for m in req.messages[len(have):]):
            tail = req.messages[len(have):]
    if tail is not None:
        return Plan(last[1], last[2], tuple((m[1], m[2]) for m in tail[:-1]))
    records = [{"role": r, "text": t, "sender": s} for r, t, s in req.messages[:-1]]
    return Plan(last[1], last[2], (), repeated_tokens(records, history), req.system if new_system else None)


def repeated_tokens(records: list[dict], history: list[dict]) -> list[dict]:
    """`records` (a reset's), each reply of their start that repeats `history` (the agent's conversation, journal
    records) message for message keeping the tokens it was generated as: a turn that re-prefills the new
    conversation then feeds those replies as the kept cache holds them, not their text tokenized again."""
    for new, old in zip(records, _messages(history)):
        if (new["role"], new["text"], new["sender"]) != _pair(old):
            break
        if old["role"] == "assistant" and old.get("tokens"):
            new["tokens"] = list(old["tokens"])
    return records


def check_messages_fit(rt: Runtime, req: ChatRequest, max_tokens: int) -> None:
    """Raise a 400 (context_length_exceeded) for a request whose messages can never fit the model's positions
    with `max_tokens`, whatever the agent holds: every message of it ends up in the conversation, a user's name
    with its text (`facade.check_conversation_fits`). Checked before anything
    runs: the agent would take each earlier message as a note first (tens of thousands took tens of seconds)."""
    chars = sum(message_chars(text, sender) for _, text, sender in req.messages) + len(req.system or "")
    try:
        check_conversation_fits(rt, "the request", len(req.messages), chars, max_tokens, f"max_tokens {max_tokens}")
    except InvalidArgument as e:
        raise bad(f"{e}; send fewer or shorter messages", "messages", "context_length_exceeded") from None


async def sent_off_loop(send, *args, **kwargs):
    """What the future `send(*args, **kwargs)` returns gives (a reset's or a turn's), the call made in a thread of
    the loop's executor: a send waits while its agent restarts (up to RESTART_WAIT_S seconds), and every other
    request is served meanwhile, as `ask_async` sends."""
    return await (await asyncio.to_thread(send, *args, **kwargs))


def failure(task: asyncio.Task) -> BaseException | None:
    """What a done turn task failed with: its exception, RuntimeClosed where it was cancelled (the server
    stopping), None where it returned."""
    return RuntimeClosed("the server stopped") if task.cancelled() else task.exception()


def check_server_options(max_agents, default_max_tokens, turn_timeout, api_key=None) -> None:
    """Raise TypeError or ValueError unless `max_agents` and `default_max_tokens` are ints >= 1, `turn_timeout`
    a finite number > 0 (the Runtime's own checks) and `api_key` None or a non-empty str of printable ASCII with no
    space at either end: a server with another would refuse every request, blaming its clients (a client cannot
    send a key an HTTP header cannot carry, and HTTP drops the spaces at a header's ends), or, with an empty key,
    serve every request without one."""
    for name, value in (("max_agents", max_agents), ("max_tokens", default_max_tokens)):
        _check_number(name, value, int)
        if value < 1:
            raise InvalidArgument(f"{name} must be an int >= 1, got {shown(value)}")
    _positive("turn_timeout", turn_timeout)
    if api_key is None:
        return
    if not isinstance(api_key, str):
        raise InvalidArgumentType(f"api_key must be a str or None, got {type(api_key).__name__}")
    if not api_key:
        raise InvalidArgument("api_key is empty: give a key, or none (None, no --api-key) to serve without one")
    if not (api_key.isascii() and api_key.isprintable()) or api_key != api_key.strip():
        raise InvalidArgument("api_key must be printable ASCII with no space or line end at either end (an HTTP "
                              "header carries no other, so every request would be refused); got one of "
                              f"{len(api_key)} characters that is not: strip what was read with it")


# a turn that raised one of these recorded nothing (refused options, too long or large for the model, a chat
# template's refusal): `Server.run_chat` then undoes the reset and notes its request made before it
REFUSED_TURNS = (ValueError, TypeError, TurnTooLong, TurnTooLarge)


def recorded_nothing(e: BaseException) -> bool:
    """Whether a turn that raised `e` recorded nothing: it was refused (REFUSED_TURNS), or it timed out before it
    started and never runs (`TurnTimeout.dropped`)."""
    return isinstance(e, REFUSED_TURNS) or (isinstance(e, TurnTimeout) and e.dropped)


class Server:
    """The HTTP layer's state over one Runtime: agent locks, the running-agent LRU, the routes."""

    def __init__(self, rt: Runtime, model_id: str, *, api_key: str | None = None, max_agents: int = 256,
                 default_max_tokens: int = 512, turn_timeout: float = 600.0):
        check_server_options(max_agents, default_max_tokens, turn_timeout, api_key)
        check_room(default_max_tokens, rt.max_context)  # else each request without max_tokens would be refused
        self.rt, self.model_id, self.api_key = rt, model_id, api_key
        self.max_agents, self.default_max_tokens, self.turn_timeout = max_agents, default_max_tokens, turn_timeout
        self.started = int(time.time())
        self._locks: dict[str, list] = {}  # name: [its lock, the requests holding or awaiting it]
        # running agents, least recently used first: the one whose last request ended earliest (see `lock`)
        self._used: OrderedDict[str, None] = OrderedDict()
        self._spawning = asyncio.Lock()
        self._tasks: set = set()
        self._forced = False  # a forced stop: `drain` waits no more (`force_stop`)
        self.cancelled = 0  # streamed turns cut short because their client hung up
        self.body_limit = body_limit(rt)

    # -- agents ------------------------------------------------------------------

    @contextlib.asynccontextmanager
    async def lock(self, name: str):
        """Hold agent `name`'s lock (`async with`) while a request maps onto it and runs its turn: requests to one
        agent take turns. The lock exists while requests hold or await it, so names seen once (a refused unnamed
        conversation, a forgotten agent) keep nothing; an agent whose lock exists is busy (see `agent`). A request
        that lets go of it makes the agent the most recently used: recency counts from the end of an agent's last
        request, so the idle agent stopped first is the one idle longest. When the last request lets go of it, idle
        agents beyond max_agents stop (more ran while more were busy) in a task of their own: the request answers
        without waiting for them."""
        entry = self._locks.setdefault(name, [asyncio.Lock(), 0])
        entry[1] += 1
        try:
            async with entry[0]:
                yield
        finally:
            if name in self._used:  # not an agent the request forgot
                self._used.move_to_end(name)
            entry[1] -= 1
            if not entry[1]:
                del self._locks[name]
                if len(self._used) > self.max_agents:  # a burst's agents, once idle, are too many
                    self.background(self._stop_idle_beyond_max())

    async def agent(self, name: str, system: str = "", strict: bool = False):
        """The running agent `name`, spawned (resumed from disk if stored) if needed, idle ones stopped to make room.

        A stored agent with another system prompt resumes with its own (the request's
        messages then reset it: see `plan_turn`), or with `strict` raises SystemPromptChanged.
        """
        async with self._spawning:
            ref = await asyncio.to_thread(self._running_ref, name)  # may ask the supervisor: off the event loop
            if ref is not None:
                if strict and system:  # as a stored agent's spawn would refuse it
                    current = conversation_prompt(await asyncio.to_thread(ref.history))
                    if current is not None and current != system:  # None: lost to journal damage, the agent's call
                        raise SystemPromptChanged(name, current, system)
                self._used[name] = None  # its recency is set as its request ends (see `lock`)
                return ref
            await self._evict(self.max_agents - 1, name)  # room for `name`
            try:
                ref = await asyncio.to_thread(self.rt.spawn, name, system)
            except SystemPromptChanged:
                if strict:
                    raise
                ref = await asyncio.to_thread(self.rt.spawn, name)
            self._used[name] = None
            return ref

    def _running_ref(self, name: str):
        """The ref of agent `name` if it runs, else None. Both `rt.running()` and `rt.agent()` ask the supervisor
        while an agent's actor is not alive (it restarts), and the supervisor may be busy: call it in a thread."""
        return self.rt.agent(name) if name in self.rt.running() else None

    async def _evict(self, keep: int, spare: str | None = None) -> None:
        """Stop the least recently used idle agents (no request holds or awaits them; never `spare`) until at most
        `keep` run; busy ones run on. Their durable state stays: they resume from disk (warm). An agent whose stop
        fails and that still runs is logged and stays tracked: the next idle one stops in its place, and it is
        stopped again when room is next needed. Hold `_spawning`."""
        running = None  # asked once, off the event loop (`running()` asks the supervisor), and only if needed
        for old in list(self._used):
            if len(self._used) <= keep:
                break
            if old in self._locks or old == spare:
                continue
            if running is None:
                running = set(await asyncio.to_thread(self.rt.running))
            if old in running:
                try:  # rt.agent may ask the supervisor, as stop does: both off the event loop
                    await asyncio.to_thread(lambda: self.rt.agent(old).stop())
                except Exception as e:  # noqa: BLE001 - whatever failed, what runs decides whether it is still tracked
                    if old in await asyncio.to_thread(self.rt.running):
                        log.warning("agent %s runs on: stopping it to keep to --max-agents failed: %r; another "
                                    "idle agent stops in its place, and it is stopped again when room is next needed",
                                    old, e)
                        continue
            self._used.pop(old, None)

    async def _stop_idle_beyond_max(self) -> None:
        """Stop idle agents beyond max_agents (see `lock`; each stop waits for that agent's queued cache writes); a
        failure is logged: the request it follows has its answer."""
        try:
            async with self._spawning:
                await self._evict(self.max_agents)
        except Exception as e:  # noqa: BLE001 - housekeeping after the answer: never the request's error
            log.warning("stopping idle agents beyond --max-agents failed: %r", e)

    def forgotten(self, name: str) -> None:
        """Drop what the server tracks about agent `name`."""
        self._used.pop(name, None)

    def max_tokens(self, req: ChatRequest) -> int:
        """The tokens `req` may generate: its own bound, else the server's default."""
        return req.max_tokens or self.default_max_tokens

    def options(self, req: ChatRequest) -> dict:
        """The turn options (`AgentRef.send`'s) of a request."""
        return dict(max_tokens=self.max_tokens(req), temperature=req.temperature,
                    top_p=req.top_p, seed=req.seed, stop=tuple(req.stop), timeout=self.turn_timeout)

    async def run_chat(self, req: ChatRequest, name: str, pieces: asyncio.Queue | None, cancel=None) -> Reply:
        """Map `req` onto agent `name` and run its turn, holding the agent's lock; stream pieces into `pieces`.

        `cancel()` returning True ends the turn at its next token (see `AgentRef.send`). A turn
        that recorded nothing (`recorded_nothing`: refused, or dropped before it started) leaves the
        agent's conversation as it was: the reset and notes the request made first are undone (a
        reset to the old history), and an unnamed conversation that the request began is forgotten
        (no agent, no files).
        """
        async with self.lock(name):
            ref = await self.agent(name, req.system or "")
            history = await asyncio.to_thread(ref.history)
            plan = plan_turn(history, req, named=req.agent is not None)
            wrote = plan.reset is not None or any(text for text, _ in plan.notes)
            try:
                return await self._turn(ref, plan, dict(self.options(req), sender=plan.ask_sender, cancel=cancel),
                                        pieces)
            except Exception as e:
                if not recorded_nothing(e):
                    raise
                try:
                    if req.agent is None and not _pairs(history):  # an unnamed conversation this request began
                        await asyncio.to_thread(self.rt.forget, name)
                        self.forgotten(name)
                    elif wrote:  # the request's earlier messages leave no trace either: a corrected resend is not doubled
                        # and its system prompt neither: a history without a system record says none (""), and
                        # reset(history) alone would keep the one the request's reset set
                        await sent_off_loop(ref.reset, history, system=conversation_prompt(history))
                except Exception as undo:  # noqa: BLE001 - the client's answer is the refusal; this is the log's
                    log.warning("agent %s keeps what a refused request began: undoing it failed: %r", name, undo)
                raise

    @staticmethod
    async def _turn(ref, plan: Plan, options: dict, pieces: asyncio.Queue | None) -> Reply:
        """Apply `plan` to `ref` (reset, notes) and run its turn; stream pieces into `pieces` (see `run_chat`).

        Each message is sent in a thread, as `ask_async` and `astream` send theirs: sending waits while the agent
        restarts (up to RESTART_WAIT_S seconds), and every other request is served meanwhile."""
        if plan.reset is not None:
            await sent_off_loop(ref.reset, plan.reset, system=plan.system)
        for text, sender in plan.notes:
            if text:
                await asyncio.to_thread(ref.note, text, sender)
        if pieces is None:
            return await ref.ask_async(plan.ask, **options)
        async for item in ref.astream(plan.ask, **options):
            if isinstance(item, Reply):
                return item
            pieces.put_nowait(item)
        raise AssertionError("a stream ends with its Reply")

    def background(self, coro) -> asyncio.Task:
        """Run `coro` as a task that outlives the request (a turn finishes even if its client left; idle agents stop
        after the answer); `drain` waits for it. Its failure is logged (at debug: a turn's is its request's answer)."""
        task = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(task)

        def done(t):
            self._tasks.discard(t)
            if not t.cancelled() and t.exception() is not None:
                log.debug("a background task failed: %r", t.exception())

        task.add_done_callback(done)
        return task

    async def drain(self) -> None:
        """Return once every task `background` started has ended, those started while waiting included (a turn
        whose end stops idle agents), or at once after `force_stop`. The app awaits it as it shuts down, once no
        request is left: the event loop then closes with none of them midway (but for a forced stop, whose tasks
        are cancelled as it closes), and the Runtime shuts down after them."""
        if self._tasks and not self._forced:
            log.info("Waiting for %d turn(s) or agent stop(s) to end. (CTRL+C again to stop without them)",
                     len(self._tasks))
        while self._tasks and not self._forced:
            await asyncio.wait(set(self._tasks), timeout=0.1)  # a failure is logged by `background`'s callback

    def force_stop(self) -> None:
        """A forced stop (a second signal, `run_uvicorn`): `drain` waits for nothing more. Safe in a signal
        handler: it sets an attribute, which `drain` reads at least every 0.1 s."""
        self._forced = True

    # -- responses ------------------------------------------------------------------

    def kvactors_info(self, reply: Reply) -> dict:
        """The `kvactors` object of a response: agent, cache state, TTFT and tokens prefilled."""
        return {"agent": reply.agent, "cache": reply.cache, "ttft_s": round(reply.timings.ttft_s, 6),
                "prefill_tokens": reply.timings.prefill_tokens}

    @staticmethod
    def usage(reply: Reply) -> dict:
        """OpenAI's usage object of a reply; cached_tokens are the prompt tokens the agent's cache served."""
        prompt = reply.reused_tokens + reply.timings.prefill_tokens
        return {"prompt_tokens": prompt, "completion_tokens": len(reply.tokens),
                "total_tokens": prompt + len(reply.tokens),
                "prompt_tokens_details": {"cached_tokens": reply.reused_tokens}}

    def completion(self, reply: Reply, created: int) -> dict:
        """A chat.completion object for `reply`."""
        return {"id": f"chatcmpl-{reply.turn_id}", "object": "chat.completion", "created": created,
                "model": self.model_id,
                "choices": [{"index": 0, "message": {"role": "assistant", "content": reply.text},
                             "finish_reason": reply.finish_reason, "logprobs": None}],
                "usage": self.usage(reply), "kvactors": self.kvactors_info(reply)}

    def chunk(self, cid: str, created: int, delta: dict | None, finish: str | None = None, **extra) -> str:
        """One SSE event holding a chat.completion.chunk (no choices when `delta` is None)."""
        choices = [] if delta is None else [{"index": 0, "delta": delta, "finish_reason": finish, "logprobs": None}]
        body = {"id": cid, "object": "chat.completion.chunk", "created": created, "model": self.model_id,
                "choices": choices, **extra}
        return f"data: {json.dumps(body, ensure_ascii=False)}\n\n"


# what an HTTP client can do about a turn too long for the model, by `TurnTooLong.fix`
_TOO_LONG_ADVICE = {
    "message": "shorten the last message or lower max_tokens",
    "reset": "send fewer earlier messages (the conversation is then reset to the request's), shorten the last "
             "message, or lower max_tokens",
    "system": "the system prompt alone leaves no room: send a shorter one (for a named agent, "
              "DELETE /v1/agents/NAME first), or lower max_tokens",
}


def error_for(e: BaseException, agent: str | None = None) -> ApiError:
    """The ApiError a runtime exception is answered with (never a 500 for a bad request), its advice worded for an
    HTTP client (the runtime's errors advise Python calls: the server adds its own to their `detail`); `agent`
    is the agent the request went to, where known, for the advice to name."""
    route = f"/v1/agents/{agent}" if agent else "/v1/agents/NAME"
    if isinstance(e, ApiError):
        return e
    if isinstance(e, InvalidAgentId):
        twin = getattr(e, "twin", None)  # an id that differs only in case from an agent's
        return bad(f"{e.detail}: use another name, or DELETE /v1/agents/{twin} first" if twin else str(e), "agent",
                   "invalid_agent_id")
    if isinstance(e, SystemPromptChanged):
        return ApiError(409, f"agent {e.agent!r} exists with another system prompt; forget it first "
                        f"(DELETE /v1/agents/{e.agent}) or create it without one to resume it", "system",
                        "system_prompt_changed")
    if isinstance(e, UnknownAgent):  # stopped or deleted meanwhile; other agents' names are not the client's
        return ApiError(404, f"{e.detail}; retry the request, or create it with POST /v1/agents", None,
                        "agent_not_found")
    if isinstance(e, SystemPromptTooLong):
        return bad(f"{e.detail}; send a shorter system prompt", "system", "context_length_exceeded")
    if isinstance(e, TurnTooLong):
        return bad(f"{e.detail}; {_TOO_LONG_ADVICE[e.fix]}", "messages", "context_length_exceeded")
    if isinstance(e, ChatTemplateError):
        return bad(f"{e.detail}; send a conversation it takes (nothing of this request was recorded)", "messages",
                   "invalid_value")
    if isinstance(e, TurnTimeout):
        if e.dropped:
            return ApiError(504, f"{e.detail}: retry the request", None, "timeout", "server_error")
        return ApiError(504, f"{e.detail}; GET {route} shows whether it committed", None, "timeout", "server_error")
    if isinstance(e, TurnNotSaved):
        return ApiError(503, f"{e}; the server could not write the turn (a full disk?): retry once it can", None,
                        "turn_not_saved", "server_error")
    if isinstance(e, AgentStopped):  # the agent was stopped (the server shutting down, forget): a retry spawns it
        return ApiError(503, f"{e.detail}; retry the request", None, "agent_stopped", "server_error")
    if isinstance(e, AgentCrashed):
        return ApiError(503, f"{e}; the agent restarts from its durable state, retry the request", None,
                        "agent_crashed", "server_error")
    if isinstance(e, JournalError):
        return ApiError(503, f"{e}; the server's operator must fix or move aside that agent's journal file", None,
                        "journal_unreadable", "server_error")
    if isinstance(e, (TypeError, ValueError)):  # the Runtime refused an option in the caller's thread
        return bad(str(e), None, "invalid_value")
    if isinstance(e, TurnTooLarge):
        return bad(f"{e.detail}; lower max_tokens or send a shorter conversation", "max_tokens", "turn_too_large")
    if isinstance(e, WaitTimeout):
        return ApiError(504, f"{e}", None, "timeout", "server_error")
    if isinstance(e, RuntimeEscalated):
        return ApiError(503, f"the server's runtime stopped: {e.detail}; the server must be restarted", None,
                        "runtime_stopped", "server_error")
    if isinstance(e, RuntimeClosed):
        return ApiError(503, "the server is shutting down: retry once it runs again", None, "runtime_stopped",
                        "server_error")
    log.exception("unexpected error", exc_info=e)
    return ApiError(500, f"internal error: {type(e).__name__}: {e}", None, "internal_error", "server_error")


async def _json(request: Request, limit: int):
    """The request's JSON body, read as it arrives and refused (413) once it passes `limit` bytes."""
    declared = request.headers.get("content-length", "")
    if declared.isascii() and declared.isdigit() and int(declared) > limit:
        raise _too_large(int(declared), limit)
    parts, size = [], 0
    async for part in request.stream():
        size += len(part)
        if size > limit:
            raise _too_large(size, limit)
        parts.append(part)
    raw = b"".join(parts)
    try:
        body = json.loads(raw)
    except (ValueError, UnicodeDecodeError) as e:
        raise bad(f"the request body is not valid JSON: {e}", None, "invalid_json") from None
    except RecursionError:
        raise bad("the request body's JSON is nested too deeply to read", None, "invalid_json") from None
    if not _SURROGATE_ESCAPE.search(raw):
        return body
    try:  # JSON may escape a lone surrogate ("\\ud800"), which no text field can hold; a pair is fine
        check_unicode("the request body", json.dumps(body, ensure_ascii=False))
    except ValueError:
        raise bad("a string in the request body holds a lone surrogate (a \\ud800-\\udfff escape without its "
                  "pair), which is not text; send text that encodes as UTF-8", None, "invalid_json") from None
    return body


_SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89a-fA-F]")  # in a body without one, no string can hold a surrogate


def _too_large(size: int, limit: int) -> ApiError:
    return ApiError(413, f"the request body has {size} bytes or more, over this server's limit of {limit} (room "
                         f"for the longest request the model takes); send less (only the new messages, to a named "
                         f"agent)",
                    None, "request_too_large")


def _agent_name(request: Request) -> str:
    try:
        return check_agent_id(request.path_params["name"])
    except InvalidAgentId as e:
        raise bad(str(e), "name", "invalid_agent_id") from None


def routes(server: Server) -> list[Route]:
    """The HTTP routes over `server` (see the module docstring)."""
    rt = server.rt

    # `rt.running()` asks the supervisor (which may be busy restarting an agent) and `rt.stored()` reads the disk:
    # both in a thread, never on the event loop that serves every other request
    async def health(request):
        agents = len(await asyncio.to_thread(rt.running))
        return JSONResponse({"status": "ok", "model": server.model_id, "agents": agents,
                             "turns_cancelled": server.cancelled})

    async def models(request):
        return JSONResponse({"object": "list", "data": [
            {"id": server.model_id, "object": "model", "created": server.started, "owned_by": "kvactors"}]})

    async def chat(request):
        req = parse_chat(await _json(request, server.body_limit), request.headers.get("x-agent-id"))
        try:  # refused before a stream begins
            check_room(server.max_tokens(req), rt.max_context)
        except InvalidArgument as e:
            raise bad(str(e), "max_tokens", "context_length_exceeded") from None
        check_messages_fit(rt, req, server.max_tokens(req))
        name = req.agent or derive_agent_id(req.user, req.system,  # the last message is a user's, at least
                                            next(text for role, text, _ in req.messages if role == "user"))
        created = int(time.time())
        if not req.stream:
            try:
                reply = await asyncio.shield(server.background(server.run_chat(req, name, None)))
            except Exception as e:  # noqa: BLE001 - every error is answered, its advice naming the agent
                raise error_for(e, name) from None
            return JSONResponse(server.completion(reply, created),
                                headers={"X-Agent-Id": name, "X-KV-Cache": reply.cache})
        pieces: asyncio.Queue = asyncio.Queue()
        gone = threading.Event()  # the client hung up: the turn stops at its next token
        task = server.background(server.run_chat(req, name, pieces, cancel=gone.is_set))
        task.add_done_callback(lambda _: pieces.put_nowait(None))
        try:  # the stream begins with the turn's first piece: a turn refused or failed before it gets its own status
            first = await pieces.get()
        except asyncio.CancelledError:
            gone.set()
            raise
        if first is None and (error := failure(task)) is not None:
            raise error_for(error, name)
        cid = f"chatcmpl-{uuid.uuid4().hex}"

        async def events():
            try:
                yield server.chunk(cid, created, {"role": "assistant", "content": ""})
                piece = first
                while piece is not None:
                    yield server.chunk(cid, created, {"content": piece})
                    piece = await pieces.get()
            finally:
                if not task.done():
                    gone.set()
                    server.cancelled += 1
            if (error := failure(task)) is not None:  # the stream has begun: the error goes in an event
                err = error_for(error, name)
                yield f"data: {json.dumps({'error': {'message': err.message, 'type': err.type, 'param': err.param, 'code': err.code}})}\n\n"
                return
            reply = task.result()
            yield server.chunk(cid, created, {}, reply.finish_reason, kvactors=server.kvactors_info(reply))
            if req.include_usage:
                yield server.chunk(cid, created, None, usage=server.usage(reply))
            yield "data: [DONE]\n\n"

        return StreamingResponse(events(), media_type="text/event-stream",
                                 headers={"X-Agent-Id": name, "Cache-Control": "no-cache"})

    async def list_agents(request):
        names = await asyncio.to_thread(rt.running)
        return JSONResponse({"object": "list", "data": [{"id": n, "object": "agent"} for n in names]})

    def agent_view(name, history):
        system = conversation_prompt(history) or ""
        messages = [{"role": r["role"], "content": r["text"], "name": r.get("sender"), "turn_id": r.get("turn_id"),
                     "time": r.get("time")} for r in history if r["role"] in ("user", "assistant")]
        return {"id": name, "object": "agent", "system": system, "messages": messages}

    async def spawn(request):
        body = await _json(request, server.body_limit)
        if not isinstance(body, dict) or not isinstance(body.get("name"), str):
            raise bad("give the agent a name: {\"name\": \"alice\", \"system\": \"...\"}", "name", "invalid_type")
        system = body.get("system")
        if system is None:  # absent or null: no system prompt (a stored agent resumes under its own)
            system = ""
        if not isinstance(system, str):
            raise bad("system must be a string or null", "system", "invalid_type")
        try:
            name = check_agent_id(body["name"])
        except InvalidAgentId as e:
            raise bad(str(e), "name", "invalid_agent_id") from None
        async with server.lock(name):
            ref = await server.agent(name, system, strict=True)
            history = await asyncio.to_thread(ref.history)
        return JSONResponse(agent_view(name, history))

    async def known(name, param="name"):
        """`name`, or a 404 unless that agent runs or is stored."""
        if not await asyncio.to_thread(lambda: name in rt.running() or rt.stored(name)):
            raise ApiError(404, f"no agent named {name!r}: create it with POST /v1/agents", param, "agent_not_found")
        return name

    async def history(request):
        name = await known(_agent_name(request))
        async with server.lock(name):
            ref = await server.agent(name)
            records = await asyncio.to_thread(ref.history)
        return JSONResponse(agent_view(name, records))

    async def send_to(request):
        name = _agent_name(request)
        body = await _json(request, server.body_limit)
        if not isinstance(body, dict):
            raise bad("the request body must be a JSON object", None, "invalid_type")
        try:
            to = check_agent_id(body.get("to"))
        except InvalidAgentId as e:
            raise bad(str(e), "to", "invalid_agent_id") from None
        if to == name:
            raise bad("an agent cannot send to itself: use POST /v1/chat/completions with X-Agent-Id", "to")
        content = body.get("content")
        if not isinstance(content, str) or not content:
            raise bad("content must be a non-empty string", "content")
        # the chat route's options, checked as there (what it refuses is refused here too), but one message
        options = {k: v for k, v in body.items() if k not in ("to", "content")}
        req = parse_chat({**options, "model": server.model_id, "messages": [{"role": "user", "content": content}]})
        if req.stream:
            raise bad("send_to answers with one JSON object and does not stream: leave stream out or false", "stream",
                      "unsupported_parameter")
        await known(name)  # a misspelt name is a 404, as for GET, not a new agent
        await known(to, "to")
        first, second = sorted((name, to))
        async with server.lock(first), server.lock(second):
            sender, receiver = await server.agent(name), await server.agent(to)
            # `to` may restart meanwhile: `server.agent` does not wait for it, the send does
            reply = await sent_off_loop(sender.send_to, receiver, content, **server.options(req))
        return JSONResponse({"from": name, "to": to, "content": reply.text, "finish_reason": reply.finish_reason,
                             "usage": server.usage(reply), "kvactors": server.kvactors_info(reply)},
                            headers={"X-Agent-Id": to, "X-KV-Cache": reply.cache})

    async def forget(request):
        name = _agent_name(request)
        async with server.lock(name):
            async with server._spawning:
                deleted = await asyncio.to_thread(rt.forget, name)
                server.forgotten(name)
        return JSONResponse({"id": name, "object": "agent.deleted", "deleted": deleted})

    return [
        Route("/health", health, methods=["GET"]),
        Route("/v1/models", models, methods=["GET"]),
        Route("/v1/chat/completions", chat, methods=["POST"]),
        Route("/v1/agents", list_agents, methods=["GET"]),
        Route("/v1/agents", spawn, methods=["POST"]),
        Route("/v1/agents/{name}", history, methods=["GET"]),
        Route("/v1/agents/{name}", forget, methods=["DELETE"]),
        Route("/v1/agents/{name}/send_to", send_to, methods=["POST"]),
    ]


class _Auth:
    """ASGI middleware: every request but GET /health needs `Authorization: Bearer <key>`."""

    def __init__(self, app, key: str):
        self.app, self.key = app, f"Bearer {key}".encode()

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http" and scope["path"] != "/health":
            got = dict(scope["headers"]).get(b"authorization", b"")
            if not hmac.compare_digest(got, self.key):
                await ApiError(401, "missing or wrong API key: send the header 'Authorization: Bearer <key>'",
                               None, "invalid_api_key").response()(scope, receive, send)
                return
        await self.app(scope, receive, send)


def build_app(server: Server):
    """The ASGI app of `server`: its routes, OpenAI-style error bodies, the API key check, and, as it shuts down,
    `server.drain()`."""

    async def api_error(request, exc):
        return error_for(exc).response()

    async def http_error(request, exc: HTTPException):
        return ApiError(exc.status_code, exc.detail or "", None, None).response()

    @contextlib.asynccontextmanager
    async def lifespan(app):
        yield
        await server.drain()

    # the runtime's errors are answers, not server faults: handled as such, they are not logged as "Exception in
    # ASGI application"; anything else (a builtin ValueError included) goes through error_for too, logged
    answers = {cls: api_error for cls in (ApiError, KvactorsError)}
    app = Starlette(routes=routes(server), exception_handlers={**answers, HTTPException: http_error,
                                                               Exception: api_error}, lifespan=lifespan)
    return _Auth(app, server.api_key) if server.api_key else app


def serve(model=None, cache_dir=None, host: str = "127.0.0.1", port: int = 8000, api_key: str | None = None,
          max_agents: int = 256, default_max_tokens: int = 512, turn_timeout: float = 600.0,
          log_level: str = "info", **runtime_options) -> int:
    """Run `kvactors serve`: a Runtime on `model` over `cache_dir`, served by uvicorn until a stop signal (see
    `run_uvicorn`). Once the Runtime has shut down, the process ends by the first signal it got (`end_by_signal`),
    after a warning that says what was cut short if a second one forced the stop; a signal while the Runtime shuts
    down ends it at once (`signals_end_shutdown`). Returns 0 if it stopped otherwise."""
    import uvicorn

    check_server_options(max_agents, default_max_tokens, turn_timeout, api_key)  # before the model loads
    sock = bind_socket(host, port)
    if host not in ("127.0.0.1", "localhost", "::1") and not api_key:
        log.warning("serving on %s without --api-key: anyone who can reach it can use and forget your agents", host)
    with sock, signals_end_shutdown() as shutting_down, Runtime(model=model, cache_dir=cache_dir,
                                                                  **runtime_options) as rt:
        server = Server(rt, model_id(model), api_key=api_key, max_agents=max_agents,
                        default_max_tokens=default_max_tokens, turn_timeout=turn_timeout)
        config = uvicorn.Config(build_app(server), log_level=log_level)  # sets up uvicorn's loggers
        bound, bound_port = sock.getsockname()[:2]
        logging.getLogger("uvicorn.error").info("kvactors serving %s on http://%s:%d (press CTRL+C to quit)",
                                                server.model_id, f"[{bound}]" if ":" in bound else bound, bound_port)
        stopped_by = run_uvicorn(config, sock, server.force_stop)
        shutting_down()  # the Runtime's shutdown comes next
    if not stopped_by:
        return 0
    if len(stopped_by) > 1:  # said once the Runtime has shut down, which saved every turn it had answered
        logging.getLogger("uvicorn.error").warning(FORCED_STOP)
    return end_by_signal(stopped_by[0])


ENDED_IN_SHUTDOWN = ("kvactors serve: stopped by a signal while the Runtime shut down: every turn already answered is "
                     "saved; a cache file not yet written is rebuilt from its journal at the agent's next turn\n")


@contextlib.contextmanager
def signals_end_shutdown():
    """For a `with` block around a Runtime: yields `arm`, which makes SIGINT and SIGTERM, from then until the block
    ends (the Runtime's shutdown included, when this block holds it), end the process at once as that signal does
    by default, after one line on standard error (`ENDED_IN_SHUTDOWN`), instead of raising KeyboardInterrupt
    (a traceback out of the shutdown, then the exit hook's shutdown waiting again) or meeting a handler that is
    gone (uvicorn's). Nothing is lost by it: every answered turn is in its journal. The handlers before are back
    when the block ends. Off the main thread, where handlers cannot be set, `arm` does nothing."""
    previous = {}

    def end_now(sig: int, frame) -> None:
        with contextlib.suppress(OSError):
            os.write(2, ENDED_IN_SHUTDOWN.encode())  # a signal handler's write: no buffer that may be mid-use
        end_by_signal(sig)

    def arm() -> None:
        if threading.current_thread() is threading.main_thread():
            previous.update((sig, signal.signal(sig, end_now)) for sig in (signal.SIGINT, signal.SIGTERM))

    try:
        yield arm
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


FORCED_STOP = ("forced stop (a second signal): the requests still open were cut short; a turn that had not finished "
               "is not saved, though a streamed one may keep what it had sent, as when its client hangs up; every "
               "turn already answered is saved")


def run_uvicorn(config, sock: socket.socket, on_force: Callable[[], None]) -> list[int]:
    """Serve `config` (a uvicorn.Config) on `sock` until a stop signal, and return the signals received, in order
    (none: it stopped otherwise). SIGINT (Ctrl-C) and SIGTERM alike: the first stops it gracefully (no new
    connection, the requests still open waited for, then the app's lifespan shutdown); a second, of either kind,
    forces it: nothing more is waited for, and the tasks still running are cancelled as uvicorn's event loop
    closes; what uvicorn would log of those cancellations (a traceback each) is not logged. The signals are not
    raised again as uvicorn does once it has stopped (a SIGINT would then be a KeyboardInterrupt and its
    traceback): the caller ends as they say. `on_force`, called (in the signal handler) when a second signal
    forces the stop, ends what the app itself waits for as it shuts down (`Server.force_stop`), which uvicorn's
    flags do not reach.

    The one place that relies on uvicorn's signal handling: its `Server.handle_exit(sig, frame)`, the handler it
    installs for SIGINT and SIGTERM, and the flags `should_exit` and `force_exit` that its shutdown reads."""
    import uvicorn

    server = uvicorn.Server(config)
    received: list[int] = []
    errors = logging.getLogger("uvicorn.error")

    def handle_exit(sig: int, frame) -> None:
        received.append(sig)
        if server.should_exit:  # SIGINT or SIGTERM alike (uvicorn forces on a second SIGINT only)
            server.force_exit = True
            errors.disabled = True  # an attribute set: safe in a signal handler, where logging is not
            on_force()
        else:
            server.should_exit = True

    server.handle_exit = handle_exit
    try:
        server.run(sockets=[sock])
    finally:
        errors.disabled = False
    return received


def end_by_signal(sig: int) -> int:
    """End this process as signal `sig` ends one by default (a shell shows its status as 128 + sig: 130 for
    Ctrl-C), so that what started it (a shell, a supervisor) sees that it was stopped; standard output and error
    are flushed first. Returns 128 + sig, the status to exit with, if the process is still there after it."""
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):  # a closed or broken stream: nothing more to write there
            stream.flush()
    signal.signal(sig, signal.SIG_DFL)
    signal.raise_signal(sig)
    return 128 + sig


def bind_socket(host: str, port: int) -> socket.socket:
    """A socket bound to (host, port), made before the model loads so that an address that cannot be served
    fails at once: ValueError for a port outside 0-65535, OSError (saying which address and why) for a host
    that does not resolve or an address in use or not allowed. IPv6 where `host` holds a colon. The server
    listens on it once it starts, so a client that connects while the model loads is refused, not kept waiting."""
    if not 0 <= port <= 65535:
        raise InvalidArgument(f"port must be 0 to 65535, got {shown(port)}")
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
        return sock
    except OSError as e:
        sock.close()
        reason = os.strerror(e.errno) if (e.errno or 0) > 0 else "the host name does not resolve"
        raise OSError(e.errno, f"cannot listen on {host}:{port}: {reason}; pick another --host or --port") from None


def model_id(model) -> str:
    """The model id the server reports: the --model value, else the default's ($KVACTORS_MODEL, or
    SmolLM2-135M-Instruct, the embedded default)."""
    return str(model or os.environ.get("KVACTORS_MODEL") or "SmolLM2-135M-Instruct")
