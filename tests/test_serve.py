"""`kvactors serve` through the real `openai` client against a real uvicorn server on loopback (tiny model)."""

import asyncio
import json
import logging
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import openai
import pykka
import pytest
import uvicorn

from runtime import AgentRef, Runtime
from runtime.api.serve import (FORCED_STOP, ChatRequest, Plan, Server, build_app, derive_agent_id, parse_chat,
                                parse_messages, plan_turn)

ROOT = Path(__file__).resolve().parent.parent
SYSTEM = {"role": "system", "content": "You answer briefly."}


class Served:
    """A Runtime over `cache_dir` (on `model`, default the tests' model) behind a uvicorn server on a free loopback
    port, in a thread."""

    def __init__(self, cache_dir, api_key=None, model=None, runtime_options=None, **server_options):
        self.rt = Runtime(model=model, cache_dir=cache_dir, **(runtime_options or {}))
        self.server = Server(self.rt, "kvactors-tiny", api_key=api_key, **{"default_max_tokens": 4, **server_options})
        sock = socket.socket()
        sock.bind(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{sock.getsockname()[1]}"
        self.uvicorn = uvicorn.Server(uvicorn.Config(build_app(self.server), log_level="warning"))
        self.thread = threading.Thread(target=self.uvicorn.run, kwargs={"sockets": [sock]}, daemon=True)
        self.thread.start()
        while not self.uvicorn.started:
            if not self.thread.is_alive():
                raise RuntimeError("the server did not start")
            time.sleep(0.01)

    def client(self, **kw):
        return openai.OpenAI(base_url=self.url + "/v1", api_key="unused", max_retries=0, **kw)

    def request(self, method, path, body=None, headers=None):
        """(status, parsed JSON body, headers) of a raw request."""
        data = body if isinstance(body, bytes) or body is None else json.dumps(body).encode()
        req = urllib.request.Request(self.url + path, data=data, method=method,
                                     headers={"Content-Type": "application/json", **(headers or {})})
        try:
            with urllib.request.urlopen(req, timeout=120) as r:
                return r.status, json.loads(r.read()), r.headers
        except urllib.error.HTTPError as e:
            return e.code, json.loads(e.read()), e.headers

    def close(self):
        self.uvicorn.should_exit = True
        self.thread.join(timeout=60)
        self.rt.shutdown()


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    s = Served(tmp_path_factory.mktemp("serve"))
    yield s
    s.close()


def extra(obj):
    return obj.model_extra["kvactors"]


def test_two_turns_of_a_resent_conversation_the_second_hot(served):
    client = served.client()
    messages = [SYSTEM, {"role": "user", "content": "Name a colour."}]
    raw = client.chat.completions.with_raw_response.create(model="kvactors-tiny", messages=messages, max_tokens=4)
    first = raw.parse()
    assert raw.headers["x-kv-cache"] == "cold" and extra(first)["cache"] == "cold"
    assert first.choices[0].message.role == "assistant" and first.choices[0].finish_reason in ("stop", "length")
    assert first.usage.completion_tokens >= 1 and first.usage.prompt_tokens_details.cached_tokens == 0
    messages += [{"role": "assistant", "content": first.choices[0].message.content},
                 {"role": "user", "content": "Another one."}]
    second = client.chat.completions.create(model="kvactors-tiny", messages=messages, max_tokens=4)
    assert extra(second)["agent"] == extra(first)["agent"] == raw.headers["x-agent-id"]
    assert extra(second)["cache"] == "hot"
    assert second.usage.prompt_tokens_details.cached_tokens > 0
    assert second.usage.prompt_tokens > first.usage.prompt_tokens
    assert extra(second)["prefill_tokens"] < second.usage.prompt_tokens


def test_a_streamed_reply_arrives_in_order_and_adds_up_to_the_stored_reply(served):
    client = served.client()
    stream = client.chat.completions.create(
        model="kvactors-tiny", messages=[{"role": "user", "content": "Stream to me."}], max_tokens=6,
        stream=True, stream_options={"include_usage": True}, extra_headers={"X-Agent-Id": "streamer"})
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    finish = [c for c in chunks if c.choices and c.choices[0].finish_reason]
    assert len(finish) == 1 and extra(finish[0])["agent"] == "streamer"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens >= 1  # the usage chunk comes last
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    status, history, _ = served.request("GET", "/v1/agents/streamer")
    assert status == 200 and history["messages"][-1] == {**history["messages"][-1], "role": "assistant", "content": text}


def test_the_async_client_runs_conversations_concurrently(served):
    async def main():
        client = openai.AsyncOpenAI(base_url=served.url + "/v1", api_key="unused", max_retries=0)
        replies = await asyncio.gather(*(client.chat.completions.create(
            model="kvactors-tiny", messages=[{"role": "user", "content": f"question {i}"}], max_tokens=3)
            for i in range(4)))
        streamed = await client.chat.completions.create(
            model="kvactors-tiny", messages=[{"role": "user", "content": "question 0"}], max_tokens=3, stream=True)
        pieces = [c async for c in streamed]
        await client.close()
        return replies, pieces

    replies, pieces = asyncio.run(main())
    assert len({extra(r)["agent"] for r in replies}) == 4
    assert all(r.choices[0].message.content is not None for r in replies)
    assert pieces[-1].choices[0].finish_reason in ("stop", "length")


BAD = [
    ({"messages": [{"role": "user", "content": "hi"}], "n": 2}, "n"),
    ({"messages": [{"role": "user", "content": "hi"}], "tools": [{"type": "function", "function": {"name": "f"}}]}, "tools"),
    ({"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]}, "messages"),
    ({"messages": [{"role": "user", "content": "hi"}], "temperature": 3}, "temperature"),
    ({"messages": [{"role": "user", "content": "hi"}], "max_tokens": 0}, "max_tokens"),
    ({"messages": [{"role": "user", "content": "hi"}], "max_completion_tokens": "many"}, "max_completion_tokens"),
    ({"messages": [{"role": "user", "content": "hi"}], "top_p": -0.1}, "top_p"),
    ({"messages": [{"role": "user", "content": "hi"}], "top_p": 1.5}, "top_p"),
    # json.loads takes NaN and every comparison with it is False: it passed to the Runtime after an agent spawned
    ({"messages": [{"role": "user", "content": "hi"}], "temperature": float("nan")}, "temperature"),
    ({"messages": [{"role": "user", "content": "hi"}], "top_p": float("nan")}, "top_p"),
    ({"messages": [{"role": "user", "content": "hi"}], "seed": -1}, "seed"),
    ({"messages": [{"role": "user", "content": "hi"}], "stop": ["a", "b", "c", "d", "e"]}, "stop"),
    ({"messages": [{"role": "user", "content": "hi"}], "stream_options": {"include_usage": True}}, "stream_options"),
    ({"messages": [{"role": "user", "content": "hi"}], "user": 7}, "user"),
    ({"messages": []}, "messages"),
    ({"messages": [{"role": "user", "content": ""}]}, "messages[0].content"),
    ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]}, "messages[0].content"),
    ({"messages": [{"role": "tool", "content": "42", "tool_call_id": "c"}, {"role": "user", "content": "hi"}]}, "messages[0]"),
    ({"messages": [{"role": "user", "content": "hi"}, {"role": "system", "content": "late"}, {"role": "user", "content": "x"}]}, "messages[1]"),
    ({"messages": [{"role": "wizard", "content": "hi"}]}, "messages[0].role"),
]


@pytest.mark.parametrize("body,param", BAD, ids=[p for _, p in BAD])
def test_bad_requests_get_a_400_with_an_openai_error_body(served, body, param):
    status, reply, _ = served.request("POST", "/v1/chat/completions", {"model": "kvactors-tiny", **body})
    assert status == 400
    assert set(reply["error"]) == {"message", "type", "param", "code"}
    assert reply["error"]["param"] == param and reply["error"]["type"] == "invalid_request_error"


def test_a_default_max_tokens_the_model_cannot_hold_is_refused_at_start(served):
    """`kvactors serve --max-tokens` at or past the model's positions started, then refused every request that
    set none with a 400 blaming its client."""
    from runtime import InvalidArgument

    with pytest.raises(InvalidArgument, match="leaves no room for a prompt"):
        Server(served.rt, "kvactors-tiny", default_max_tokens=served.rt.max_context)


def test_an_api_key_no_client_can_send_is_refused_at_start(served, tmp_path):
    """An empty --api-key served every request without one (anyone could use and forget the agents); a key with a
    space at an end, or a character an HTTP header cannot carry (a line end read with it from a file), started a
    server that answered every request with a 401 blaming its client."""
    from runtime import InvalidArgument

    for key in ("", "sesame ", " sesame", "sesame\n", "sesame\r", "s\x00same", "sésame"):
        with pytest.raises(InvalidArgument, match="api_key"):
            Server(served.rt, "kvactors-tiny", api_key=key)
    key = "s3s-ame_.~+/=!"  # what a header carries as it is: the key that was set is the one that works
    s = Served(tmp_path, api_key=key)
    try:
        with pytest.raises(openai.AuthenticationError):
            s.client().models.list()
        ok = openai.OpenAI(base_url=s.url + "/v1", api_key=key, max_retries=0)
        assert [m.id for m in ok.models.list()] == ["kvactors-tiny"]
    finally:
        s.close()
    out = subprocess.run([sys.executable, "-m", "runtime.api.cli", "serve", "--model", tmp_path / "no-model",
                          "--api-key", ""], capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert out.returncode == 2 and "api_key is empty" in out.stderr and "Traceback" not in out.stderr, out.stderr


def test_the_openai_client_raises_its_own_errors(served):
    client = served.client()
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model="kvactors-tiny", messages=[{"role": "user", "content": "hi"}], n=3)
    assert e.value.status_code == 400 and e.value.body["param"] == "n"
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model="kvactors-tiny", messages=[{"role": "user", "content": "hi"}],
                                       extra_headers={"X-Agent-Id": "../etc"})
    assert e.value.body["code"] == "invalid_agent_id"
    with pytest.raises(openai.BadRequestError) as e:  # longer than the model's 4,096 positions
        client.chat.completions.create(model="kvactors-tiny", messages=[{"role": "user", "content": "word " * 5000}],
                                       max_tokens=4, extra_headers={"X-Agent-Id": "verbose"})
    assert e.value.body["code"] == "context_length_exceeded" and "4096" in e.value.body["message"]
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("kvactors-tiny")  # no such route: a JSON 404, not a crash
    assert [m.id for m in client.models.list()] == ["kvactors-tiny"]


def test_malformed_bodies_and_unknown_routes_are_4xx_json(served):
    for raw in (b"{not json", b"[" * 100000 + b"]" * 100000):  # the second had been a 500 (RecursionError)
        status, reply, _ = served.request("POST", "/v1/chat/completions", raw)
        assert status == 400 and reply["error"]["code"] == "invalid_json"
    status, reply, _ = served.request("POST", "/v1/chat/completions", [1, 2])
    assert status == 400
    status, reply, _ = served.request("POST", "/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}]})
    assert status == 400 and reply["error"]["param"] == "model"
    status, reply, _ = served.request("GET", "/v1/nothing-here")
    assert status == 404 and "error" in reply
    status, reply, _ = served.request("GET", "/v1/chat/completions")
    assert status == 405 and "error" in reply
    assert served.request("GET", "/health")[0] == 200


def test_a_lone_surrogate_escape_in_any_string_is_a_400_not_a_server_error(served, caplog):
    """JSON can escape half a surrogate pair ("\\ud800"); such a string is not text. It failed deep in the
    handler (a 400 carrying a codec's message, logged as "Exception in ASGI application")."""
    for body in ('{"model": "kvactors-tiny", "messages": [{"role": "user", "content": "hi \\ud800"}]}',
                 '{"model": "kvactors-tiny", "user": "\\udc00", "messages": [{"role": "user", "content": "hi"}]}',
                 '{"model": "kvactors-tiny", "stream": true, "messages": [{"role": "system", "content": "\\ud800"}, '
                 '{"role": "user", "content": "hi"}]}'):
        status, reply, _ = served.request("POST", "/v1/chat/completions", body.encode())
        assert status == 400 and reply["error"]["code"] == "invalid_json", reply
        assert "lone surrogate" in reply["error"]["message"]
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR]
    fine = '{"model": "kvactors-tiny", "messages": [{"role": "user", "content": "a pair \\ud83d\\ude00 is fine"}]}'
    assert served.request("POST", "/v1/chat/completions", fine.encode())[0] == 200


def test_a_body_larger_than_any_request_the_model_can_hold_is_a_413_before_it_is_read(served):
    import http.client

    from runtime.api.serve import body_limit

    limit = served.server.body_limit
    assert limit == body_limit(served.rt)

    def post(headers, parts=()):
        conn = http.client.HTTPConnection(served.url.removeprefix("http://"), timeout=60)
        conn.putrequest("POST", "/v1/chat/completions")
        for k, v in {"Content-Type": "application/json", **headers}.items():
            conn.putheader(k, v)
        conn.endheaders()
        try:
            for part in parts:
                conn.send(b"%x\r\n%s\r\n" % (len(part), part))
            conn.send(b"0\r\n\r\n")
        except (BrokenPipeError, ConnectionResetError):
            pass  # the server answered and closed before the last bytes: it did not read them
        r = conn.getresponse()
        status, reply = r.status, json.loads(r.read())
        conn.close()
        return status, reply

    status, reply = post({"Content-Length": str(limit + 1)})  # declared: refused without waiting for a byte
    assert status == 413 and reply["error"]["code"] == "request_too_large" and str(limit) in reply["error"]["message"]
    piece = b" " * (1 << 20)  # chunked, no length given: refused once the bytes read pass the limit
    status, reply = post({"Transfer-Encoding": "chunked"}, [piece] * (limit // len(piece)) + [b" " * (limit % len(piece) + 1)])
    assert status == 413 and reply["error"]["code"] == "request_too_large"
    status, reply = post({"Transfer-Encoding": "chunked"}, [b'{"model": "kvactors-tiny", "messages": []}'])
    assert status == 400  # a small chunked body is read and checked as before
    body = b'{"model": "kvactors-tiny", "messages": []}'
    status, reply = post({"Transfer-Encoding": "chunked"}, [body + b" " * (limit - len(body))])
    assert status == 400 and reply["error"]["code"] != "request_too_large"  # exactly the limit: read whole
    assert served.request("GET", "/health")[0] == 200


def test_a_model_that_does_not_say_its_positions_still_bounds_the_body(tmp_path):
    """Without max_position_embeddings no body size follows from the model: a fixed limit keeps one request
    from filling the server's memory."""
    import http.client
    import shutil

    from runtime.api.serve import UNBOUNDED_BODY_LIMIT
    from runtime.tiny import tiny_llama_path

    folder = tmp_path / "model"
    shutil.copytree(tiny_llama_path(), folder)
    config = json.loads((folder / "config.json").read_text())
    del config["max_position_embeddings"]
    (folder / "config.json").write_text(json.dumps(config))
    s = Served(tmp_path / "c", model=str(folder))
    try:
        assert s.rt.max_context is None and s.server.body_limit == UNBOUNDED_BODY_LIMIT
        conn = http.client.HTTPConnection(s.url.removeprefix("http://"), timeout=60)
        conn.putrequest("POST", "/v1/chat/completions")
        conn.putheader("Content-Type", "application/json")
        conn.putheader("Content-Length", str(UNBOUNDED_BODY_LIMIT + 1))
        conn.endheaders()
        r = conn.getresponse()
        assert r.status == 413 and json.loads(r.read())["error"]["code"] == "request_too_large"
        conn.close()
        status, reply, _ = s.request("POST", "/v1/chat/completions", {"model": "m", "messages": [
            {"role": "user", "content": "hi"}], "max_tokens": 2})
        assert status == 200 and reply["kvactors"]["cache"] == "cold"
    finally:
        s.close()


def test_a_conversation_the_chat_template_refuses_is_a_400_and_the_server_goes_on(tmp_path):
    from test_chat import STRICT, model_with_template

    s = Served(tmp_path / "c", model=model_with_template(tmp_path, STRICT))
    try:
        status, reply, _ = s.request("POST", "/v1/chat/completions", {"model": "m", "max_tokens": 2, "messages": [
            {"role": "assistant", "content": "I speak first."}, {"role": "user", "content": "hi"}]})
        assert status == 400 and "chat template refuses this conversation" in reply["error"]["message"]
        assert "ref." not in reply["error"]["message"]  # the Python advice (ref.reset) means nothing over HTTP
        status, reply, _ = s.request("POST", "/v1/chat/completions", {"model": "m", "max_tokens": 2, "messages": [
            {"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi"}]})
        assert status == 200 and reply["kvactors"]["cache"] == "cold"  # a system prompt the template has no role for
    finally:
        s.close()


def test_native_agent_routes_spawn_send_to_history_and_forget(served):
    status, alice, _ = served.request("POST", "/v1/agents", {"name": "alice", "system": "You are Alice."})
    assert status == 200 and alice["system"] == "You are Alice." and alice["messages"] == []
    served.request("POST", "/v1/agents", {"name": "bob", "system": "You are Bob."})
    status, sent, headers = served.request("POST", "/v1/agents/alice/send_to", {"to": "bob", "content": "hello bob", "max_tokens": 3})
    assert status == 200 and sent["to"] == "bob" and headers["X-KV-Cache"] == "cold"
    bob = served.request("GET", "/v1/agents/bob")[1]
    assert [(m["role"], m["name"]) for m in bob["messages"]] == [("user", "alice"), ("assistant", None)]
    alice = served.request("GET", "/v1/agents/alice")[1]
    assert alice["messages"] == [{**alice["messages"][0], "role": "user", "name": "bob", "content": sent["content"]}]
    assert {"alice", "bob"} <= {a["id"] for a in served.request("GET", "/v1/agents")[1]["data"]}
    assert served.request("DELETE", "/v1/agents/bob")[1] == {"id": "bob", "object": "agent.deleted", "deleted": True}
    assert served.request("GET", "/v1/agents/bob")[0] == 404
    assert served.request("POST", "/v1/agents/alice/send_to", {"to": "alice", "content": "me"})[0] == 400
    for path, body, param in (("/v1/agents/alice/send_to", {"to": "ghost2", "content": "hi"}, "to"),
                              ("/v1/agents/ghost1/send_to", {"to": "alice", "content": "hi"}, "name")):
        status, answer, _ = served.request("POST", path, body)  # a misspelt name used to create the agent
        assert (status, answer["error"]["param"]) == (404, param) and not served.rt.stored(body["to"] if param == "to" else "ghost1")
    assert served.request("POST", "/v1/agents", {"name": "no/slashes"})[0] == 400


def test_spawn_takes_a_null_system_as_no_system_prompt(served):
    """JSON null is an absent field everywhere else in the server's bodies; `"system": null` got a 400."""
    status, agent, _ = served.request("POST", "/v1/agents", {"name": "nullsys", "system": None})
    assert status == 200 and agent["system"] == "" and agent["messages"] == []
    served.request("POST", "/v1/chat/completions", {"model": "kvactors-tiny", "max_tokens": 2,
                                                    "messages": [{"role": "system", "content": "Be brief."},
                                                                 {"role": "user", "content": "hi"}]},
                   {"X-Agent-Id": "nullsys"})
    status, agent, _ = served.request("POST", "/v1/agents", {"name": "nullsys", "system": None})
    assert status == 200 and agent["system"] == "Be brief."  # resumed under its own prompt, as with none given
    status, answer, _ = served.request("POST", "/v1/agents", {"name": "nullsys2", "system": 3})
    assert status == 400 and answer["error"]["param"] == "system"


def test_send_to_honours_the_chat_routes_options_and_refuses_what_it_cannot_honour(served):
    """send_to passed five of the chat route's fields on and dropped the rest unread: max_completion_tokens was
    ignored, and stream, logit_bias or n > 1 were answered with a 200 as if honoured."""
    for name in ("opt-sender", "opt-receiver"):
        served.request("POST", "/v1/agents", {"name": name})
    path = "/v1/agents/opt-sender/send_to"
    status, sent, _ = served.request("POST", path, {"to": "opt-receiver", "content": "hello", "max_completion_tokens": 1,
                                                    "max_tokens": 3})  # as on the chat route, the newer name wins
    assert status == 200 and sent["usage"]["completion_tokens"] == 1, sent
    for field, value in (("stream", True), ("logit_bias", {"42": -100}), ("n", 2), ("tools", [{"type": "function"}]),
                         ("stream_options", {"include_usage": True})):
        status, answer, _ = served.request("POST", path, {"to": "opt-receiver", "content": "hi", field: value})
        assert status == 400 and answer["error"]["param"] == field, (field, answer)
    status, sent, _ = served.request("POST", path, {"to": "opt-receiver", "content": "hi", "max_tokens": 1,
                                                    "stream": False, "logit_bias": {}, "n": 1})
    assert status == 200 and sent["usage"]["completion_tokens"] == 1


def test_a_system_prompt_that_fills_the_model_is_refused_with_400_and_no_agent(served):
    """A system prompt whose tokens leave no room for a turn was taken by POST /v1/agents and by a chat request
    (stored, then every turn refused); it is now refused first, as the context length it exceeds."""
    import openai

    words = "plan " * served.rt.max_context
    status, body, _ = served.request("POST", "/v1/agents", {"name": "windy", "system": words})
    assert status == 400 and body["error"]["code"] == "context_length_exceeded" and body["error"]["param"] == "system"
    assert "shorter system prompt" in body["error"]["message"] and not served.rt.stored("windy")
    with pytest.raises(openai.BadRequestError) as e:
        served.client().chat.completions.create(
            model="kvactors-tiny", max_tokens=2, extra_headers={"X-Agent-Id": "windy2"},
            messages=[{"role": "system", "content": words}, {"role": "user", "content": "Hi."}])
    assert e.value.code == "context_length_exceeded" and not served.rt.stored("windy2")
    assert "windy2" not in served.rt.running()


def test_a_request_whose_messages_can_never_fit_is_refused_before_any_is_taken(served):
    """Each earlier user message of a request is taken as a note before the turn; 20,000 of them took 23 s before
    the turn was refused as too long. Whatever the agent holds, every message ends up in its conversation: more
    messages than positions, or more characters than the positions can spell, are refused first."""
    many = [{"role": "user", "content": f"m{i}"} for i in range(served.rt.max_context)]
    half = "x" * (served.rt.max_context * served.rt.longest_token_chars // 2 + 1)
    cases = [(many, "the request has 4096 messages"),
             ([{"role": "user", "content": half}, {"role": "assistant", "content": "ok"},
               {"role": "user", "content": half}], "characters: more tokens")]
    for n, (messages, said) in enumerate(cases):
        status, body, _ = served.request("POST", "/v1/chat/completions", {
            "model": "kvactors-tiny", "max_tokens": 2, "messages": messages}, {"X-Agent-Id": f"crowd{n}"})
        assert status == 400 and body["error"]["code"] == "context_length_exceeded", body
        assert said in body["error"]["message"] and not served.rt.stored(f"crowd{n}")


def test_a_user_name_counts_toward_what_can_never_fit(served):
    """A user message's name is rendered with its text ("name: text"); names were not counted, so a request that
    could never fit spawned and stored its agent, reset it and took its notes before its turn was refused."""
    half = "x" * (served.rt.max_context * served.rt.longest_token_chars // 2 + 1)
    status, body, _ = served.request("POST", "/v1/chat/completions", {
        "model": "kvactors-tiny", "max_tokens": 2, "messages": [
            {"role": "user", "content": "a", "name": half}, {"role": "assistant", "content": "ok"},
            {"role": "user", "content": half}]}, {"X-Agent-Id": "named-crowd"})
    assert status == 400 and body["error"]["code"] == "context_length_exceeded", body
    assert "characters: more tokens" in body["error"]["message"] and not served.rt.stored("named-crowd")


def test_a_streamed_turn_cancelled_before_its_first_piece_is_a_503_not_a_broken_stream(served, monkeypatch):
    """A stream's turn task cancelled (the server stopping) before its first piece began a 200 stream and then
    raised CancelledError out of it: the client got a cut-off body. It now gets a 503 before any stream."""
    async def cancelled(req, name, pieces, cancel=None):
        raise asyncio.CancelledError

    monkeypatch.setattr(served.server, "run_chat", cancelled)
    status, body, _ = served.request("POST", "/v1/chat/completions", {
        "model": "kvactors-tiny", "max_tokens": 2, "stream": True, "messages": [{"role": "user", "content": "hi"}]})
    assert status == 503 and body["error"]["code"] == "runtime_stopped", body


def test_a_refused_turn_leaves_no_trace_of_its_request_in_the_history(served):
    """A request refused with a 400 (too long for the model, a bad sender) had its earlier messages written as
    notes, or its conversation reset, before its turn was refused: a corrected resend then doubled them."""
    agent = {"X-Agent-Id": "careful"}

    def chat(messages):
        return served.request("POST", "/v1/chat/completions",
                              {"model": "kvactors-tiny", "messages": messages, "max_tokens": 2}, agent)

    def conversation():
        body = served.request("GET", "/v1/agents/careful")[1]
        return body["system"], [(m["role"], m["content"], m["name"]) for m in body["messages"]]

    assert chat([{"role": "system", "content": "Be careful."}, {"role": "user", "content": "kept"}])[0] == 200
    before = conversation()
    huge = "hello " * (served.rt.max_context + 10)
    refused = [
        ([{"role": "user", "content": "NOTE-A"}, {"role": "user", "content": huge}],
         "context_length_exceeded", "messages"),  # notes, then the turn is too long
        ([{"role": "user", "content": "other"}, {"role": "assistant", "content": "reply"},
          {"role": "user", "content": huge}], "context_length_exceeded", "messages"),  # a reset, then too long
        ([{"role": "user", "content": "NOTE-B"}, {"role": "user", "content": "hi", "name": "Bob Smith"}],
         "invalid_agent_id", "messages[1].name"),  # refused before anything is written
    ]
    for messages, code, param in refused:
        status, body, _ = chat(messages)
        assert (status, body["error"]["code"], body["error"]["param"]) == (400, code, param), body
        assert conversation() == before, messages[0]
    assert chat([{"role": "user", "content": "NOTE-A"}, {"role": "user", "content": "short"}])[0] == 200
    assert [m[1] for m in conversation()[1] if m[0] == "user"] == ["kept", "NOTE-A", "short"]


def test_answers_to_runtime_errors_are_not_logged_as_server_faults(served, caplog):
    """A 4xx from the runtime's own refusal (here SystemPromptChanged) is an answer: no traceback in the log."""
    served.request("POST", "/v1/agents", {"name": "quiet", "system": "You are Q."})
    with caplog.at_level("ERROR"):
        status, body, _ = served.request("POST", "/v1/agents", {"name": "quiet", "system": "You are R."})
        assert status == 409 and body["error"]["code"] == "system_prompt_changed"
        assert served.request("POST", "/v1/agents", {"name": "no/slashes"})[0] == 400
    assert not [r for r in caplog.records if r.levelname == "ERROR"], caplog.text


def test_a_named_agent_takes_only_the_new_message_and_a_changed_system_prompt_starts_over(served):
    client = served.client()
    ask = lambda messages: client.chat.completions.create(  # noqa: E731
        model="kvactors-tiny", messages=messages, max_tokens=3, extra_headers={"X-Agent-Id": "stateful"})
    ask([{"role": "system", "content": "one persona"}, {"role": "user", "content": "first"}])
    second = ask([{"role": "user", "content": "second"}])
    assert extra(second)["cache"] == "hot"
    history = served.request("GET", "/v1/agents/stateful")[1]
    assert history["system"] == "one persona"
    assert [m["content"] for m in history["messages"] if m["role"] == "user"] == ["first", "second"]
    third = ask([{"role": "system", "content": "another persona"}, {"role": "user", "content": "third"}])
    assert extra(third)["cache"] == "cold"  # a new system prompt: nothing of the cache matches
    history = served.request("GET", "/v1/agents/stateful")[1]
    assert history["system"] == "another persona" and len(history["messages"]) == 2


def test_an_edited_resend_keeps_the_tokens_of_the_replies_it_repeats(served):
    """A client that edits its last message is reset to its messages: the replies it repeats keep the tokens they
    were generated as, so the turn answers as an agent that re-prefills that history (no cache) answers it."""
    client = served.client()
    ask = lambda messages: client.chat.completions.create(  # noqa: E731
        model="kvactors-tiny", messages=messages, max_tokens=6, temperature=0)
    messages = [SYSTEM, {"role": "user", "content": "Edit me 🙂 ☃."}]
    first = ask(messages)
    messages += [{"role": "assistant", "content": first.choices[0].message.content}, {"role": "user", "content": "Go."}]
    ask(messages)
    ref = served.rt.agent(extra(first)["agent"])
    replied = [r["tokens"] for r in ref.history() if r["role"] == "assistant"]
    messages[-1] = {"role": "user", "content": "Go on."}
    edited = ask(messages)
    assert extra(edited)["cache"] == "hot"
    history = ref.history()
    assert [r.get("tokens") for r in history if r["role"] == "assistant"][0] == replied[0]
    cold = served.rt.spawn("edited-cold", system=SYSTEM["content"])
    cold.reset([r for r in history[:-2] if r["role"] != "system"]).get(timeout=60)
    again = cold.ask("Go on.", max_tokens=6)
    assert again.cache == "cold" and again.tokens == history[-1]["tokens"]


def test_a_client_that_leaves_mid_stream_cancels_its_turn(served):
    req = urllib.request.Request(served.url + "/v1/chat/completions", method="POST", headers={
        "Content-Type": "application/json", "X-Agent-Id": "leaver"}, data=json.dumps({
            "model": "kvactors-tiny", "stream": True, "max_tokens": 4000,
            "messages": [{"role": "user", "content": "talk"}]}).encode())
    with urllib.request.urlopen(req, timeout=120) as r:
        assert r.readline().startswith(b"data: ")  # the role chunk; then hang up
    after = served.client().chat.completions.create(
        model="kvactors-tiny", messages=[{"role": "user", "content": "still there?"}], max_tokens=3,
        extra_headers={"X-Agent-Id": "leaver"})
    assert after.choices[0].message.content is not None
    users = [m["content"] for m in served.request("GET", "/v1/agents/leaver")[1]["messages"] if m["role"] == "user"]
    assert users == ["talk", "still there?"]  # the cut-short turn stays in the history
    assert served.request("GET", "/health")[1]["turns_cancelled"] == 1


def test_max_tokens_beyond_the_models_positions_is_a_400_before_any_stream(served):
    for wanted in (100000, served.rt.max_context):  # all of them leave no room for the prompt either
        status, body, _ = served.request("POST", "/v1/chat/completions", {
            "model": "kvactors-tiny", "stream": True, "max_tokens": wanted, "messages": [{"role": "user", "content": "hi"}]})
        assert status == 400 and body["error"]["param"] == "max_tokens" and "lower it" in body["error"]["message"]


def test_a_restarted_server_serves_the_same_conversations_warm(tmp_path):
    messages = [SYSTEM, {"role": "user", "content": "Remember me."}]
    s = Served(tmp_path)
    try:
        first = s.client().chat.completions.create(model="kvactors-tiny", messages=messages, max_tokens=3)
        named = s.client().chat.completions.create(model="kvactors-tiny", messages=[{"role": "user", "content": "a"}],
                                                   max_tokens=3, extra_headers={"X-Agent-Id": "keeper"})
    finally:
        s.close()
    s = Served(tmp_path)
    try:
        messages += [{"role": "assistant", "content": first.choices[0].message.content},
                     {"role": "user", "content": "Do you?"}]
        again = s.client().chat.completions.create(model="kvactors-tiny", messages=messages, max_tokens=3)
        assert extra(again)["agent"] == extra(first)["agent"] and extra(again)["cache"] == "warm"
        assert again.usage.prompt_tokens_details.cached_tokens > 0
        resumed = s.client().chat.completions.create(model="kvactors-tiny", messages=[{"role": "user", "content": "b"}],
                                                     max_tokens=3, extra_headers={"X-Agent-Id": "keeper"})
        assert extra(resumed)["cache"] == "warm" and extra(named)["cache"] == "cold"
    finally:
        s.close()


def test_idle_agents_beyond_max_agents_stop_and_resume_from_disk(tmp_path):
    s = Served(tmp_path)
    s.server.max_agents = 2
    try:
        client = s.client()
        for name in ("a1", "a2", "a3"):
            client.chat.completions.create(model="kvactors-tiny", messages=[{"role": "user", "content": "hi"}],
                                           max_tokens=2, extra_headers={"X-Agent-Id": name})
        assert len(s.rt.running()) == 2 and "a1" not in s.rt.running()
        back = client.chat.completions.create(model="kvactors-tiny", messages=[{"role": "user", "content": "again"}],
                                              max_tokens=2, extra_headers={"X-Agent-Id": "a1"})
        assert extra(back)["cache"] == "warm"
    finally:
        s.close()


def running_once(s, done, deadline_s=30):
    """`s.rt.running()` once `done` of it is true (the idle agents beyond max_agents stop after the answers), or
    as it is at the deadline."""
    deadline = time.monotonic() + deadline_s
    while not done(names := s.rt.running()) and time.monotonic() < deadline:
        time.sleep(0.01)
    return names


def test_a_burst_of_conversations_leaves_at_most_max_agents_running_once_it_ends(tmp_path):
    """Busy agents are never stopped, and idle ones were stopped only when a new agent came: after a burst of
    concurrent conversations, every agent of the burst stayed running until the next new one."""
    s = Served(tmp_path)
    s.server.max_agents = 2

    async def burst():
        client = openai.AsyncOpenAI(base_url=s.url + "/v1", api_key="unused", max_retries=0)
        try:
            return await asyncio.gather(*(client.chat.completions.create(
                model="kvactors-tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=8,
                extra_headers={"X-Agent-Id": f"b{i}"}) for i in range(8)))
        finally:
            await client.close()

    try:
        replies = asyncio.run(burst())
        assert sorted(extra(r)["agent"] for r in replies) == [f"b{i}" for i in range(8)]
        assert len(running_once(s, lambda names: len(names) <= 2)) <= 2, s.rt.running()  # stopped after the answers
        again = s.client().chat.completions.create(model="kvactors-tiny", messages=[{"role": "user", "content": "hm"}],
                                                   max_tokens=2, extra_headers={"X-Agent-Id": "b0"})
        assert extra(again)["cache"] in ("hot", "warm") and len(s.rt.running()) <= 2, s.rt.running()
    finally:
        s.close()


def test_a_response_does_not_wait_for_idle_agents_beyond_max_agents_to_stop(tmp_path, monkeypatch):
    """Stopping the idle agents beyond max_agents when a request ends waits for their cache writes: it runs after
    that request's response, which arrives while the stop is still under way."""
    s = Served(tmp_path)
    answered = threading.Event()
    seen = []  # whether the response had arrived when each stop went on
    stop = AgentRef.stop

    def stop_after_the_answer(ref):
        seen.append(answered.wait(30))  # False: no response in 30 s, as it waited for this stop
        stop(ref)

    try:
        client = s.client()
        for name in ("x1", "x2"):
            client.chat.completions.create(model="kvactors-tiny", messages=[{"role": "user", "content": "hi"}],
                                           max_tokens=2, extra_headers={"X-Agent-Id": name})
        monkeypatch.setattr(AgentRef, "stop", stop_after_the_answer)
        s.server.max_agents = 1  # x1 and x2 run, one too many: x2's next request, running, stops idle x1 as it ends
        reply = client.chat.completions.create(model="kvactors-tiny", messages=[{"role": "user", "content": "again"}],
                                               max_tokens=2, extra_headers={"X-Agent-Id": "x2"})
        answered.set()
        assert extra(reply)["agent"] == "x2"
        assert running_once(s, lambda names: "x1" not in names) == ["x2"]
        assert seen == [True], "the response waited for x1 to stop"
    finally:
        answered.set()
        s.close()


def test_the_server_shuts_down_once_the_idle_agents_it_is_stopping_have_stopped(tmp_path, monkeypatch):
    """The idle agents beyond max_agents stop in a task of the server's: as it shuts down, the app waits for that
    task (`Server.drain`), so the event loop never closes with the stops midway, nor the Runtime before them."""
    s = Served(tmp_path)
    draining = threading.Event()
    seen = []  # whether the server was shutting down when each stop went on
    stop, drain = AgentRef.stop, s.server.drain

    def stop_once_draining(ref):
        seen.append(draining.wait(30))  # False: 30 s passed without the shutdown waiting for this stop
        stop(ref)

    async def drain_noted():
        draining.set()
        await drain()

    try:
        client = s.client()
        for name in ("y1", "y2", "y3"):
            client.chat.completions.create(model="kvactors-tiny", messages=[{"role": "user", "content": "hi"}],
                                           max_tokens=2, extra_headers={"X-Agent-Id": name})
        monkeypatch.setattr(AgentRef, "stop", stop_once_draining)
        monkeypatch.setattr(s.server, "drain", drain_noted)
        s.server.max_agents = 1  # y3's next request stops idle y1 and y2 as it ends
        client.chat.completions.create(model="kvactors-tiny", messages=[{"role": "user", "content": "again"}],
                                       max_tokens=2, extra_headers={"X-Agent-Id": "y3"})
        s.uvicorn.should_exit = True
        s.thread.join(60)
        assert not s.thread.is_alive()
        assert s.rt.running() == ["y3"] and seen == [True, True], (s.rt.running(), seen)  # before rt.shutdown()
    finally:
        draining.set()
        s.close()


def test_the_least_recently_used_agent_is_the_one_whose_last_request_ended_first(tmp_path, monkeypatch):
    """An agent is as recent as the end of its last request: one whose long turn just ended stays running, and one
    whose request ended while that turn ran stops first. (Recency was set as a request began: the long turn's
    agent, which began first, was stopped the moment it finished.)"""
    s = Served(tmp_path)
    s.server.max_agents = 2
    started, finish = threading.Event(), threading.Event()
    turn = s.server._turn

    async def long_turn(ref, plan, options, pieces):
        if ref.name == "long":
            started.set()
            await asyncio.to_thread(finish.wait, 30)
        return await turn(ref, plan, options, pieces)

    monkeypatch.setattr(s.server, "_turn", long_turn)
    client = s.client()

    def chat(name):
        return client.chat.completions.create(model="kvactors-tiny", messages=[{"role": "user", "content": "hi"}],
                                              max_tokens=2, extra_headers={"X-Agent-Id": name})

    try:
        with ThreadPoolExecutor(1) as pool:
            long = pool.submit(chat, "long")
            assert started.wait(30)
            chat("short")  # begins after "long" began, ends before it ends
            finish.set()
            assert extra(long.result(timeout=60))["agent"] == "long"
        chat("new")  # room for it: "short", whose request ended first, stops
        assert sorted(s.rt.running()) == ["long", "new"], s.rt.running()
    finally:
        finish.set()
        s.close()


def test_an_idle_agent_whose_stop_failed_stays_tracked_and_stops_when_room_is_next_needed(tmp_path, monkeypatch,
                                                                                         caplog):
    """A stop that fails is logged and the agent stays among those the server stops beyond max_agents: the next
    idle agent stops in its place, and it stops itself when room is next needed. (It was dropped from the server's
    list before its stop: it ran on, never stopped again, past max_agents for good; and the request that needed the
    room failed with a 500.)"""
    s = Served(tmp_path)
    s.server.max_agents = 2
    stop, failed = AgentRef.stop, []

    def stop_fails_once(ref):
        if not failed:
            failed.append(ref.name)
            raise pykka.Timeout("the supervisor did not answer")
        stop(ref)

    client = s.client()

    def chat(name):
        return client.chat.completions.create(model="kvactors-tiny", messages=[{"role": "user", "content": "hi"}],
                                              max_tokens=2, extra_headers={"X-Agent-Id": name})

    try:
        chat("f1")
        chat("f2")
        monkeypatch.setattr(AgentRef, "stop", stop_fails_once)
        with caplog.at_level(logging.WARNING, logger="runtime.api.serve"):
            assert extra(chat("f3"))["agent"] == "f3"  # f1's stop fails: f2 stops in its place
        assert failed == ["f1"] and sorted(s.rt.running()) == ["f1", "f3"], s.rt.running()
        assert any("f1" in r.getMessage() and "the supervisor did not answer" in r.getMessage()
                   for r in caplog.records), caplog.text
        chat("f4")  # f1, the least recently used, stops now
        assert sorted(s.rt.running()) == ["f3", "f4"], s.rt.running()
    finally:
        s.close()


def test_a_stored_agent_with_another_system_prompt_is_reset_by_chat_and_refused_by_spawn(tmp_path):
    s = Served(tmp_path)
    s.server.max_agents = 1
    try:
        client = s.client()

        def chat(name, system):
            return client.chat.completions.create(
                model="kvactors-tiny", max_tokens=2, extra_headers={"X-Agent-Id": name},
                messages=[{"role": "system", "content": system}, {"role": "user", "content": "hi"}])

        chat("p1", "You are P.")
        chat("p2", "You are Q.")  # max_agents=1: p1 stops, its files stay
        assert s.rt.running() == ["p2"]
        chat("p1", "You are R.")  # resumed under its stored prompt, then reset to the request's
        assert s.request("GET", "/v1/agents/p1")[1]["system"] == "You are R."
        status, body, _ = s.request("POST", "/v1/agents", {"name": "p2", "system": "You are Z."})  # p2 stopped: stored
        assert status == 409 and body["error"]["code"] == "system_prompt_changed", body
        assert s.request("GET", "/v1/agents/p2")[1]["system"] == "You are Q."
        status, body, _ = s.request("POST", "/v1/agents", {"name": "p1", "system": "You are Z."})  # p1 running
        assert status == 409 and body["error"]["code"] == "system_prompt_changed", body
        assert s.request("POST", "/v1/agents", {"name": "p1", "system": "You are R."})[0] == 200  # its own prompt
        assert s.request("GET", "/v1/agents/p1")[1]["system"] == "You are R."
    finally:
        s.close()


def test_the_command_line_server_checks_the_api_key(tmp_path):
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    sock.close()
    proc = subprocess.Popen([sys.executable, "-m", "runtime.api.cli", "serve", "--cache-dir", str(tmp_path), "--port",
                             str(port), "--api-key", "sesame", "--log-level", "warning"], cwd=ROOT,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    url = f"http://127.0.0.1:{port}"
    try:
        for _ in range(1200):  # bounded wait for the server to listen (model load included)
            try:
                with urllib.request.urlopen(url + "/health", timeout=5) as r:
                    assert r.status == 200  # health needs no key
                break
            except (urllib.error.URLError, ConnectionError):
                assert proc.poll() is None, proc.stdout.read()
                time.sleep(0.1)
        with pytest.raises(openai.AuthenticationError) as e:
            openai.OpenAI(base_url=url + "/v1", api_key="wrong", max_retries=0).models.list()
        assert e.value.status_code == 401 and e.value.body["code"] == "invalid_api_key"
        client = openai.OpenAI(base_url=url + "/v1", api_key="sesame", max_retries=0)
        reply = client.chat.completions.create(model="kvactors-tiny", messages=[{"role": "user", "content": "hi"}],
                                               max_tokens=2)
        assert extra(reply)["cache"] == "cold"
    finally:
        proc.terminate()
        proc.wait(timeout=60)


class ServeProcess:
    """`kvactors serve` over `cache_dir` on the tests' model (the tiny one), in a subprocess on a free loopback port;
    its log is collected line by line, in a thread."""

    def __init__(self, cache_dir):
        sock = socket.socket()
        sock.bind(("127.0.0.1", 0))
        self.port = sock.getsockname()[1]
        sock.close()
        self.proc = subprocess.Popen([sys.executable, "-m", "runtime.api.cli", "serve", "--cache-dir", str(cache_dir),
                                      "--port", str(self.port)],
                                     cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        self.lines = []

        def read():
            for line in self.proc.stdout:
                self.lines.append(line)

        self.reader = threading.Thread(target=read, daemon=True)
        self.reader.start()
        self.wait_until(lambda: self.get("/health").get("status") == "ok", "the server to listen")

    def log(self):
        return "".join(self.lines)

    def exit_log(self):
        """The whole log of a server that has exited, its last lines included."""
        self.reader.join(timeout=30)
        return self.log()

    def get(self, path):
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{self.port}{path}", timeout=5) as r:
                return json.loads(r.read())
        except (urllib.error.URLError, ConnectionError):
            return {}

    def wait_until(self, done, what):
        for _ in range(1200):  # bounded: 2 minutes at most, a model load included
            if done():
                return
            assert self.proc.poll() is None, f"the server exited waiting for {what}:\n{self.log()}"
            time.sleep(0.1)
        raise AssertionError(f"waited too long for {what}:\n{self.log()}")

    def leave_a_turn_running(self, agent, max_tokens):
        """Ask `agent` for a long greedy reply (the tiny model runs it to max_tokens) without streaming, and hang up
        once the turn runs: it goes on without its client."""
        body = json.dumps({"model": "kvactors-tiny", "messages": [{"role": "user", "content": "hi"}],
                           "max_tokens": max_tokens, "temperature": 0}).encode()
        with socket.create_connection(("127.0.0.1", self.port)) as client:
            client.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                           b"X-Agent-Id: %s\r\nContent-Length: %d\r\n\r\n%s" % (agent.encode(), len(body), body))
            self.wait_until(lambda: {"id": agent, "object": "agent"} in self.get("/v1/agents").get("data", []),
                            f"agent {agent} to take its turn")

    def close(self):
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait(timeout=60)


def replies_stored(cache_dir, agent):
    """How many replies `agent` has in its journal in `cache_dir` (0: none, or no agent)."""
    with Runtime(cache_dir=cache_dir) as rt:
        return {a.name: a.turns for a in rt.agents()}.get(agent, 0)


STOP_SIGNALS = pytest.mark.parametrize("stop", [signal.SIGINT, signal.SIGTERM], ids=["SIGINT", "SIGTERM"])


@STOP_SIGNALS
def test_a_stop_signal_lets_a_turn_whose_client_left_finish(tmp_path, stop):
    """One Ctrl-C (or SIGTERM) is graceful: the server stops taking requests and waits for the turn that still runs,
    its client gone, to end and be recorded, then exits as that signal ends a process."""
    server = ServeProcess(tmp_path)
    try:
        server.leave_a_turn_running("long", max_tokens=1000)
        server.proc.send_signal(stop)
        assert server.proc.wait(timeout=120) == -stop, server.log()
        assert "Waiting for background tasks to complete" in server.log()  # the turn ran on past the signal
        assert "Traceback" not in server.exit_log() and FORCED_STOP not in server.log(), server.log()
    finally:
        server.close()
    assert replies_stored(tmp_path, "long") == 1


@STOP_SIGNALS
def test_a_second_stop_signal_stops_the_server_without_waiting_for_a_turn_whose_client_left(tmp_path, stop):
    """A second Ctrl-C (or SIGTERM) while the server waits for a long turn whose client left (3900 tokens: seconds
    on the tiny model) stops it then: it exits as one such signal does, that turn unfinished and unrecorded (nobody
    was answered), with one line that says so and no traceback, and the Runtime opens the folder again. The wait is
    uvicorn's own, for the request's task, which awaits its turn whether or not its client is there, and uvicorn's
    `force_exit` ends it; the app's lifespan shutdown (`Server.drain`), which it then skips, never waits for such
    a turn."""
    server = ServeProcess(tmp_path)
    try:
        server.leave_a_turn_running("long", max_tokens=3900)
        server.proc.send_signal(stop)
        server.wait_until(lambda: "Waiting for background tasks to complete" in server.log(), "the shutdown to wait")
        server.proc.send_signal(stop)
        assert server.proc.wait(timeout=120) == -stop, server.log()
        assert "Traceback" not in server.exit_log() and server.log().count(FORCED_STOP) == 1, server.log()
    finally:
        server.close()
    assert replies_stored(tmp_path, "long") == 0


def test_drain_waits_for_the_background_tasks_and_a_forced_stop_ends_the_wait(served):
    """`Server.drain` (the app's shutdown) waits for what `background` started, a task it starts while waiting
    included; after `force_stop` (a second signal) it returns at once, leaving what runs to the loop's close."""
    server = Server(served.rt, "kvactors-tiny")

    async def run():
        ended = []

        async def later():
            await asyncio.sleep(0.3)
            server.background(asyncio.sleep(0.2)).add_done_callback(lambda _: ended.append("second"))

        server.background(later())
        t0 = time.monotonic()
        await server.drain()
        waited = time.monotonic() - t0
        stuck = server.background(asyncio.sleep(60))
        loop = asyncio.get_running_loop()
        loop.call_later(0.3, server.force_stop)
        t1 = time.monotonic()
        await asyncio.wait_for(server.drain(), 10)
        forced = time.monotonic() - t1
        stuck.cancel()
        return ended, waited, forced

    ended, waited, forced = asyncio.run(run())
    assert ended == ["second"] and waited >= 0.5
    assert 0.3 <= forced < 2


SLOW_SHUTDOWN = """
import sys
from runtime import Runtime
from runtime.api.serve import signals_end_shutdown
from runtime.api.testing import park_supervisor

with signals_end_shutdown() as shutting_down, Runtime("tiny", cache_dir=sys.argv[1]) as rt:
    rt.spawn("a").ask("hi", max_tokens=4)
    park_supervisor(rt, hold_s=60)  # the shutdown waits for the agents' supervisor: a minute at most
    shutting_down()
    print("shutting down", flush=True)
print("shut down", flush=True)
"""


@STOP_SIGNALS
def test_a_signal_while_the_runtime_shuts_down_ends_the_process_at_once_without_a_traceback(tmp_path, stop):
    """As `kvactors serve` shuts its Runtime down (uvicorn stopped), a signal ends the process as that signal does by
    default, at once, with one line that says nothing answered is lost: not a KeyboardInterrupt's traceback out of
    the shutdown (then the exit hook's shutdown waiting again), nor SIGTERM's silent end. The Runtime here is a real
    one whose shutdown waits for a parked supervisor; the agent's answered turn is in its journal after."""
    from runtime.api.serve import ENDED_IN_SHUTDOWN

    proc = subprocess.Popen([sys.executable, "-c", SLOW_SHUTDOWN, str(tmp_path)], cwd=ROOT, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline() == "shutting down\n", proc.stderr.read()
        time.sleep(0.5)  # inside the shutdown's wait
        proc.send_signal(stop)
        out, err = proc.communicate(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == -stop and "shut down" not in out, (out, err)
    assert ENDED_IN_SHUTDOWN.strip() in err and "Traceback" not in err, err
    with Runtime("tiny", cache_dir=tmp_path) as rt:
        assert {a.name: a.turns for a in rt.agents()} == {"a": 1}


# -- the mapping of a request onto an agent's history (no server) ---------------------------------


def records(system, *pairs):
    out = [{"role": "system", "text": system, "sender": None}] if system is not None else []
    return out + [{"role": r, "text": t, "sender": None} for r, t in pairs]


def request(messages, named=False):
    system, parsed = parse_messages(messages)
    return ChatRequest(system, parsed, agent="x" if named else None)


def test_plan_continues_a_resent_conversation_and_resets_a_divergent_one():
    history = records("s", ("user", "u1"), ("assistant", "a1"))
    resent = request([{"role": "system", "content": "s"}, {"role": "user", "content": "u1"},
                      {"role": "assistant", "content": "a1"}, {"role": "user", "content": "u2"},
                      {"role": "user", "content": "u3"}])
    plan = plan_turn(history, resent, named=False)
    assert plan.reset is None and plan.notes == (("u2", None),) and plan.ask == "u3"
    edited = request([{"role": "system", "content": "s"}, {"role": "user", "content": "u1"},
                      {"role": "assistant", "content": "a1, edited"}, {"role": "user", "content": "u2"}])
    plan = plan_turn(history, edited, named=False)
    assert plan.reset == [{"role": "user", "text": "u1", "sender": None},
                          {"role": "assistant", "text": "a1, edited", "sender": None}] and plan.system is None
    fresh = request([{"role": "user", "content": "u1"}])
    assert plan_turn(history, fresh, named=False).reset == []  # a stateless client starting over
    assert plan_turn(history, fresh, named=True).reset is None  # a named agent: the new message is appended
    other = request([{"role": "system", "content": "t"}, {"role": "user", "content": "u"}])
    assert plan_turn(history, other, named=True).system == "t"


def test_derived_ids_are_valid_stable_and_scoped_by_user():
    a = derive_agent_id(None, "s", "hello")
    assert a == derive_agent_id(None, "s", "hello") != derive_agent_id("bob", "s", "hello")
    assert a != derive_agent_id(None, None, "s hello") and a.startswith("chat-")


def test_the_load_benchmark_loses_nothing(tmp_path):
    from benchmarks import serve as bench

    argv = ["--clients", "4", "--turns", "2", "--new", "4", "--system-words", "20", "--turn-words", "8",
            "--servers", "kvactors", "--out", str(tmp_path)]
    assert bench.main(argv) == 0
    row = json.loads((tmp_path / "serve-tiny.json").read_text())["rows"][0]
    assert (row["requests"], row["failed"]) == (8, 0)
    assert row["cache states"] == "cold 4 hot 4"  # each conversation's second turn reuses its cache


def test_request_defaults_follow_openai():
    body = {"model": "any", "messages": [{"role": "developer", "content": "d"}, {"role": "user", "content": "hi", "name": "ann"}]}
    a, b = parse_chat(body), parse_chat(body)
    assert (a.temperature, a.top_p, a.max_tokens, a.stream, a.stop) == (1.0, 1.0, None, False, [])
    assert a.seed != b.seed  # unseeded requests sample differently
    assert a.system == "d" and a.messages == [("user", "hi", "ann")]
    c = parse_chat({**body, "seed": 5, "stop": "x", "max_completion_tokens": 3, "max_tokens": 9, "n": 1})
    assert (c.seed, c.stop, c.max_tokens) == (5, ["x"], 3)


def test_runtime_errors_are_answered_with_their_own_status_and_code():
    """An unreadable journal or a failed journal write is the server's state, not a crash of the agent: each
    gets a 503 with a code of its own and a message that says what to do."""
    from runtime import AgentCrashed, AgentStopped, JournalError, TurnNotSaved
    from runtime.api.serve import error_for

    cases = {JournalError("agent a: not a kvactors journal"): (503, "journal_unreadable", "move aside"),
             TurnNotSaved("t1", "the journal write failed: disk full"): (503, "turn_not_saved", "retry once"),
             AgentCrashed("t2", "the turn failed"): (503, "agent_crashed", "restarts from its durable state"),
             AgentStopped("t3", "the agent was stopped"): (503, "agent_stopped", "retry the request")}
    for error, (status, code, advice) in cases.items():
        answer = error_for(error)
        assert (answer.status, answer.code) == (status, code) and advice in answer.message


def test_a_streamed_request_refused_before_its_first_token_gets_a_400_not_a_200_and_an_error_event(served):
    """The stream began (200, the role chunk) before the turn was checked, so a message too long for the model came
    back as a 200 whose stream carried an error event; the openai client saw no error status. Now the response
    waits for the turn's first piece: a turn refused before it is answered with its own status."""
    huge = "hello " * (served.rt.max_context + 10)
    with pytest.raises(openai.BadRequestError) as e:
        served.client().chat.completions.create(model="kvactors-tiny", stream=True, max_tokens=2,
                                                messages=[{"role": "user", "content": huge}],
                                                extra_headers={"X-Agent-Id": "streamer"})
    assert e.value.status_code == 400 and e.value.code == "context_length_exceeded"
    chunks = list(served.client().chat.completions.create(  # a turn that fits streams as before
        model="kvactors-tiny", stream=True, max_tokens=3, messages=[{"role": "user", "content": "hi"}],
        extra_headers={"X-Agent-Id": "streamer"}))
    assert chunks[0].choices[0].delta.role == "assistant" and chunks[-1].choices[0].finish_reason


def test_an_unnamed_conversation_refused_at_its_first_turn_leaves_no_agent_behind(served):
    """An unnamed request spawns the agent its messages name (`derive_agent_id`); refused (too long for the model),
    it left that agent running and its files on disk, one more for every such request. Refused at its first turn,
    the conversation is forgotten; one that went on before keeps its history (the refusal undoes only itself)."""
    huge = "hello " * (served.rt.max_context + 10)
    for stream in (False, True):
        messages = [{"role": "system", "content": f"alone {stream}"}, {"role": "user", "content": huge}]
        name = derive_agent_id(None, messages[0]["content"], huge)
        with pytest.raises(openai.BadRequestError):
            served.client().chat.completions.create(model="kvactors-tiny", stream=stream, max_tokens=2,
                                                    messages=messages)
        assert name not in served.rt.running() and not served.rt.stored(name)
    first = [SYSTEM, {"role": "user", "content": "an unnamed talk"}]
    reply = served.client().chat.completions.create(model="kvactors-tiny", max_tokens=2, messages=first)
    name = extra(reply)["agent"]
    follow = first + [{"role": "assistant", "content": reply.choices[0].message.content},
                      {"role": "user", "content": huge}]
    with pytest.raises(openai.BadRequestError):
        served.client().chat.completions.create(model="kvactors-tiny", max_tokens=2, messages=follow)
    assert name in served.rt.running() and served.rt.stored(name)
    assert [m["content"] for m in served.request("GET", f"/v1/agents/{name}")[1]["messages"]] == [
        "an unnamed talk", reply.choices[0].message.content]


def test_a_turn_too_long_over_http_gives_advice_an_http_client_can_follow(served):
    """TurnTooLong's message told HTTP clients to call `rt.forget(name)` or `ref.reset([])`; the server now words
    the advice itself, by what would make the turn fit, and keeps the figures."""
    max_tokens = 2
    room = served.rt.max_context - max_tokens
    cases = [  # (system prompt, message, max_tokens, advice expected)
        ("You answer briefly.", "hello " * (served.rt.max_context + 10), max_tokens, "shorten the last message"),
        # a prompt that leaves room for a turn (spawn takes it), but not with this max_tokens
        ("word " * (room - 400), "hi", 500, "the system prompt alone leaves no room"),
    ]
    for n, (system, text, tokens, advice) in enumerate(cases):
        status, body, _ = served.request("POST", "/v1/chat/completions", {
            "model": "kvactors-tiny", "max_tokens": tokens, "messages": [
                {"role": "system", "content": system}, {"role": "user", "content": text}]},
            {"X-Agent-Id": f"toolong{n}"})
        message = body["error"]["message"]
        assert status == 400 and body["error"]["code"] == "context_length_exceeded", body
        assert advice in message and "rt." not in message and "ref." not in message, message
    served.request("POST", "/v1/chat/completions", {"model": "kvactors-tiny", "max_tokens": max_tokens, "messages": [
        {"role": "user", "content": "word " * (room // 2)}]}, {"X-Agent-Id": "toolong2"})  # half the room, kept
    status, body, _ = served.request("POST", "/v1/chat/completions", {
        "model": "kvactors-tiny", "max_tokens": max_tokens, "messages": [
            {"role": "user", "content": "word " * (room // 2 + 20)}]}, {"X-Agent-Id": "toolong2"})
    assert status == 400 and "send fewer earlier messages" in body["error"]["message"], body
    assert "positions" in body["error"]["message"] and "ref." not in body["error"]["message"]


def test_an_int_too_long_to_read_or_print_is_a_400(served):
    """JSON ints of more than 4,300 digits are past what Python turns to or from text: the request is refused as bad
    input (400), never a server fault; a shorter huge int is named by its digit count, not printed whole."""
    for field in ("max_tokens", "seed", "temperature"):
        for digits in (5000, 4200):  # past what json reads; what it reads, but no message should print whole
            body = ('{"model": "kvactors-tiny", "messages": [{"role": "user", "content": "hi"}], "%s": %s}'
                    % (field, "9" * digits)).encode()
            status, reply, _ = served.request("POST", "/v1/chat/completions", body)
            assert status == 400 and reply["error"]["type"] == "invalid_request_error", (field, reply)
            assert len(reply["error"]["message"]) < 300, (field, digits)


PYTHON_ADVICE = ("rt.", "ref.", "Runtime", "memory_budget", "turn_id", "reset=", "spawn it")


def test_runtime_errors_over_http_advise_what_an_http_client_can_do(served, tmp_path):
    """The runtime's errors end with advice on Python calls (rt.forget, ref.reset, ref.result(turn_id), raise
    memory_budget, start a new Runtime), which an HTTP client cannot follow: the server words its own advice
    after each error's `detail`."""
    from runtime import AgentStopped, RuntimeEscalated, TurnTimeout, UnknownAgent
    from runtime.api.facade import not_running
    from runtime.api.serve import error_for

    def python_free(message):
        return not any(word in message for word in PYTHON_ADVICE)

    chat = {"model": "kvactors-tiny", "max_tokens": 2, "messages": [{"role": "user", "content": "hi"}]}
    assert served.request("POST", "/v1/chat/completions", chat, {"X-Agent-Id": "Twin"})[0] == 200
    for path, body, headers in (("/v1/chat/completions", chat, {"X-Agent-Id": "twin"}),
                                ("/v1/agents", {"name": "TWIN"}, {})):  # ids that differ only in case
        status, reply, _ = served.request("POST", path, body, headers)
        message = reply["error"]["message"]
        assert status == 400 and "DELETE /v1/agents/Twin" in message and python_free(message), message

    slow = Served(tmp_path / "slow", turn_timeout=1e-6)  # every turn runs past its timeout
    try:
        status, reply, _ = slow.request("POST", "/v1/chat/completions", chat, {"X-Agent-Id": "slow"})
        message = reply["error"]["message"]
        assert status == 504 and reply["error"]["code"] == "timeout" and python_free(message), message
    finally:
        slow.close()

    small = Served(tmp_path / "small", runtime_options={"memory_budget": 1})  # no turn fits its KV budget
    try:
        status, reply, _ = small.request("POST", "/v1/chat/completions", chat, {"X-Agent-Id": "big"})
        message = reply["error"]["message"]
        assert status == 400 and reply["error"]["code"] == "turn_too_large" and python_free(message), message
        assert "lower max_tokens" in message
        small.rt.shutdown()  # the server still answers, its runtime gone
        status, reply, _ = small.request("POST", "/v1/chat/completions", chat, {"X-Agent-Id": "big"})
        message = reply["error"]["message"]
        assert status == 503 and reply["error"]["code"] == "runtime_stopped" and python_free(message), message
    finally:
        small.close()

    # errors no request here can bring about, made as the runtime makes them
    errors = [TurnTimeout("a-1", "the turn did not finish within its timeout; it is being written", ": ref.result("
                          "turn_id) says whether it committed"),
              AgentStopped("a-1", "the agent was stopped before the turn finished", "; spawn it again and retry"),
              RuntimeEscalated("supervision gave up after 'a' kept failing (boom)", "; start a new Runtime"),
              UnknownAgent("agent 'a' exited and was not restarted", "; spawn it again"),
              not_running("a", ["someone-elses"])]  # an agent stopped between the server's look and its call
    for error in errors:
        message = error_for(error, "a").message
        assert python_free(message) and error.detail in message and "someone-elses" not in message, message
    assert "GET /v1/agents/a " in error_for(errors[0], "a").message  # names the agent to look at


def test_no_agent_lock_outlives_its_requests(served):
    """The server kept a lock for every agent name a request ever named, dropped only when an idle agent was
    evicted: each refused unnamed request (its agent forgotten) and each forgotten agent left one for good, so
    a client could grow the server's memory without bound. A lock now lives while requests hold or await it."""
    huge = "hello " * (served.rt.max_context + 10)
    names = []
    for n in range(3):
        messages = [{"role": "user", "content": f"{n} {huge}"}]
        names.append(derive_agent_id(None, None, messages[0]["content"]))
        status, _, _ = served.request("POST", "/v1/chat/completions",
                                      {"model": "kvactors-tiny", "max_tokens": 2, "messages": messages})
        assert status == 400 and names[-1] not in served.rt.running()
    served.request("POST", "/v1/agents", {"name": "fleeting"})
    assert served.request("DELETE", "/v1/agents/fleeting")[1]["deleted"] is False  # never spoke: nothing stored
    assert not set(names + ["fleeting"]) & set(served.server._locks)


def test_an_unnamed_conversation_whose_first_turn_is_dropped_leaves_no_agent_behind(tmp_path):
    """A turn that times out before it starts is dropped and never runs (TurnTimeout.dropped): as for a refused
    one, nothing of it is recorded, and the unnamed conversation it began was left running with no history."""
    slow = Served(tmp_path / "c", turn_timeout=1e-6)  # every turn runs past its timeout before it starts
    try:
        messages = [{"role": "user", "content": "an early question"}, {"role": "assistant", "content": "an answer"},
                    {"role": "user", "content": "too late"}]
        name = derive_agent_id(None, None, messages[0]["content"])
        status, reply, _ = slow.request("POST", "/v1/chat/completions",
                                        {"model": "kvactors-tiny", "max_tokens": 2, "messages": messages})
        assert status == 504 and "retry the request" in reply["error"]["message"], reply
        assert name not in slow.rt.running() and not slow.rt.stored(name)
    finally:
        slow.close()


HUGE_WORDS = "hello "


def test_a_refused_request_does_not_leave_its_system_prompt_on_an_agent_that_had_none(served):
    """A request to a named agent that has no system prompt, carrying a new system prompt and a message too long
    for the model, is refused with a 400; the server undoes the reset the request made first, but the agent kept
    the refused request's system prompt, and every later turn ran under it."""
    agent = {"X-Agent-Id": "promptless"}

    def chat(messages):
        return served.request("POST", "/v1/chat/completions",
                              {"model": "kvactors-tiny", "max_tokens": 2, "messages": messages}, agent)

    assert chat([{"role": "user", "content": "hi"}])[0] == 200
    before = served.request("GET", "/v1/agents/promptless")[1]
    assert before["system"] == ""
    huge = HUGE_WORDS * (served.rt.max_context + 10)
    status, body, _ = chat([{"role": "system", "content": "You are a pirate."}, {"role": "user", "content": huge}])
    assert status == 400 and body["error"]["code"] == "context_length_exceeded", body
    after = served.request("GET", "/v1/agents/promptless")[1]
    assert after["system"] == "", after["system"]  # was "You are a pirate."
    assert [m["content"] for m in after["messages"]] == [m["content"] for m in before["messages"]]


def test_conversations_that_open_with_one_assistant_greeting_are_not_one_agent(served):
    """Without X-Agent-Id the agent is 'a hash of the user field, the system prompt and the first user message'
    (README, module docstring). The server hashed the first message after the system prompt, whatever its role:
    every conversation of a chat app that opens with the same assistant greeting landed on one agent, so they
    waited for each other and reset each other's conversation (and cache) at every turn."""
    greeting = {"role": "assistant", "content": "Hello! How can I help you today?"}
    agents = set()
    for question in ("What is the capital of France?", "Write me a haiku about rain."):
        status, body, _ = served.request("POST", "/v1/chat/completions", {
            "model": "kvactors-tiny", "max_tokens": 2, "messages": [greeting, {"role": "user", "content": question}]})
        assert status == 200, body
        agents.add(body["kvactors"]["agent"])
    assert len(agents) == 2, agents


def test_sampling_fields_the_server_cannot_honour_are_refused_not_ignored(served):
    """REFUSED's rule is 'fields we cannot honour: refused rather than silently ignored', but logit_bias and the
    frequency and presence penalties, which the runtime has no way to apply, were taken with a 200 and ignored:
    a client banning a token with logit_bias -100 could get it. Their neutral values (0, {}), which some
    clients always send, are still taken."""
    hi = [{"role": "user", "content": "hi"}]
    for field, value in (("logit_bias", {"42": -100}), ("frequency_penalty", 1.5), ("presence_penalty", -1)):
        status, body, _ = served.request("POST", "/v1/chat/completions",
                                         {"model": "kvactors-tiny", "max_tokens": 2, "messages": hi, field: value})
        assert status == 400 and body["error"]["param"] == field, (field, status, body)
    status, _, _ = served.request("POST", "/v1/chat/completions", {
        "model": "kvactors-tiny", "max_tokens": 2, "messages": hi, "logit_bias": {}, "frequency_penalty": 0,
        "presence_penalty": 0.0})
    assert status == 200


def test_top_p_0_picks_the_most_likely_token_over_http_and_in_python(served):
    """OpenAI's top_p runs from 0 to 1, and clients send 0 to ask for greedy decoding: it was refused with a 400.
    The nucleus of top_p 0 holds the single most likely token, so the turn decodes greedily whatever the
    temperature and seed, in a request as in `ask`."""
    client, hi = served.client(), [{"role": "user", "content": "Pick a word."}]

    def text(agent, **options):
        reply = client.chat.completions.create(model="kvactors-tiny", messages=hi, max_tokens=6,
                                               extra_headers={"X-Agent-Id": agent}, **options)
        return reply.choices[0].message.content

    greedy = text("top-p-greedy", temperature=0)
    assert text("top-p-zero-a", temperature=1.5, top_p=0, seed=1) == greedy
    assert text("top-p-zero-b", temperature=1.5, top_p=0, seed=2) == greedy
    asked = [served.rt.spawn(name).ask("Pick a word.", max_tokens=6, **options).text
             for name, options in (("py-greedy", {}), ("py-top-p-zero", dict(temperature=1.5, top_p=0, seed=9)))]
    assert asked[1] == asked[0]


@pytest.mark.parametrize("method,path", [("GET", "/health"), ("GET", "/v1/agents"), ("GET", "/v1/agents/nobody"),
                                         ("POST", "/v1/chat/completions")])
def test_a_busy_supervisor_holds_its_own_request_and_not_the_others(served, monkeypatch, method, path):
    """`rt.running()` asks the supervisor, which may be busy (restarting an agent, up to 10 s): asked on the event
    loop, it stopped every other request meanwhile. While one request waits on it, another is answered."""
    entered, release, returned = threading.Event(), threading.Event(), threading.Event()
    real = served.rt.running

    def busy():
        entered.set()
        release.wait(30)
        returned.set()
        return real()

    monkeypatch.setattr(served.rt, "running", busy)
    body = {"model": "kvactors-tiny", "max_tokens": 1, "messages": [{"role": "user", "content": "hi"}]}
    done = []
    waiting = threading.Thread(target=lambda: done.append(served.request(method, path, body if method == "POST"
                                                                         else None)[0]))
    waiting.start()
    try:
        assert entered.wait(30)
        status, listed, _ = served.request("GET", "/v1/models")
        assert status == 200 and listed["data"][0]["id"] == "kvactors-tiny"
        assert not returned.is_set()  # answered while the other request still waited on the supervisor
    finally:
        release.set()
        waiting.join(60)
    assert done and done[0] in (200, 404)


def test_a_request_for_an_agent_whose_actor_restarts_does_not_hold_the_other_requests(tmp_path, monkeypatch):
    """While an agent's actor is not alive (its supervisor restarts it), `rt.agent(name)` asks the supervisor
    whether it still runs, as `rt.running()` does, and the supervisor may be busy (stopping another agent, up to
    its 10 s). The request for that agent waits for the answer in a thread: every other request is answered
    meanwhile. (`rt.agent` was called on the event loop, which held every request until the supervisor answered.)"""
    s = Served(tmp_path)
    entered, release, returned = threading.Event(), threading.Event(), threading.Event()
    real, alive = s.rt.running, s.rt._actor_alive
    calls = []

    def busy_once_the_agent_is_known():  # the request's first question runs as ever; the next one waits
        calls.append(threading.current_thread().name)
        if len(calls) > 1:
            entered.set()
            release.wait(30)
            returned.set()
        return real()

    body = {"model": "kvactors-tiny", "max_tokens": 1, "messages": [{"role": "user", "content": "hi"}]}
    done = []
    waiting = threading.Thread(target=lambda: done.append(s.request("POST", "/v1/chat/completions", body,
                                                                    {"X-Agent-Id": "r1"})[0]))
    try:
        assert s.request("POST", "/v1/chat/completions", body, {"X-Agent-Id": "r1"})[0] == 200
        monkeypatch.setattr(s.rt, "running", busy_once_the_agent_is_known)
        monkeypatch.setattr(s.rt, "_actor_alive", lambda name: name != "r1" and alive(name))  # r1 restarts
        waiting.start()
        assert entered.wait(30)
        status, listed, _ = s.request("GET", "/v1/models")
        assert status == 200 and listed["data"][0]["id"] == "kvactors-tiny"
        assert not returned.is_set()  # answered while the request for r1 still waited on the supervisor
    finally:
        release.set()
        if waiting.ident is not None:  # started
            waiting.join(60)
        s.close()
    assert done == [200]


@pytest.mark.parametrize("what", ["note", "reset"])
def test_a_requests_messages_to_an_agent_that_restarts_wait_for_it_off_the_event_loop(tmp_path, what):
    """A request's plan sends a note or a reset before its turn. Sent to an agent that crashed and whose restart
    waits behind its busy supervisor, the message waits for the restart (up to RESTART_WAIT_S) in a thread: a 10 ms
    ticker keeps ticking, and once the supervisor is free the message and the turn go to the restarted agent. (They
    were sent on the event loop, which held every request meanwhile, and here the supervisor's release with them:
    the request failed with AgentCrashed after 10 s.)"""
    from test_agents import FAST, run_while_restarting, ticking_until_released

    with Runtime(model=None, cache_dir=tmp_path, backoff=FAST) as rt:
        a = rt.spawn("a", system="You are A.")
        old = rt._env.refs["a"]
        records = [{"role": "user", "text": "Hi.", "sender": None},
                   {"role": "assistant", "text": "Hello.", "sender": None}]
        plan = Plan(ask="Tick.", notes=(("A note.", "bob"),)) if what == "note" else Plan(ask="Tick.", reset=records)

        reply = run_while_restarting(rt, a, lambda release: ticking_until_released(
            Server._turn(a, plan, {"max_tokens": 4}, None), release))
        sent = [(r["text"], r["sender"]) for r in a.history() if r["role"] == "user"]
    assert len(reply.tokens) == 4 and rt._env.refs["a"] is not old
    assert sent[-2:] == ([("A note.", "bob")] if what == "note" else [("Hi.", None)]) + [("Tick.", None)]
