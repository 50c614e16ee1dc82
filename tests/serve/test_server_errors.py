"""Every failure on the wire ends in OpenAI's error shape (or an SSE error event), never a traceback."""

from __future__ import annotations

import asyncio
import json
import socket
import time
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import openai
import pytest

from tests.conftest import base_config
from tests.fake_upstream import FakeUpstream

MODEL = "gpt-4o-mini"
MESSAGES = [{"role": "user", "content": "Hello there."}]




def client(proxy: Any, **kw: Any) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=proxy.base_url, api_key="sk-client", max_retries=0, **kw)


async def post_raw(url: str, data: Any, headers: dict[str, str] | None = None) -> tuple[int, Any, bytes]:
    hdrs = {"Content-Type": "application/json", **(headers or {})}
    async with aiohttp.ClientSession() as s, s.post(url, data=data, headers=hdrs) as r:
        return r.status, r.headers, await r.read()


def openai_error(raw: bytes) -> dict[str, Any]:
    """The body must be exactly {"error": {"message", "type", "param", "code"}}; returns the inner object."""
    assert b"Traceback" not in raw
    body = json.loads(raw)
    assert isinstance(body, dict) and set(body) == {"error"}, body
    err = body["error"]
    assert set(err) == {"message", "type", "param", "code"}, err
    assert isinstance(err["message"], str) and err["message"]
    assert isinstance(err["type"], str) and err["type"]
    return err


def sse_events(raw: bytes) -> list[bytes]:
    return [line[5:].strip() for line in raw.split(b"\n") if line.startswith(b"data:")]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


async def eventually(predicate: Any, timeout: float = 1.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        await asyncio.sleep(0.01)
    return bool(predicate())


# --- the request itself is wrong -------------------------------------------------------------------------


@pytest.mark.parametrize("raw", [b"{not json", b"", b'{"model": "gpt-4o-mini", "messages": [}', b"\xff\xfe{}"])
async def test_body_not_json(upstream: FakeUpstream, start_proxy: Any, raw: bytes) -> None:
    proxy = await start_proxy(base_config(upstream.base_url))
    status, headers, out = await post_raw(proxy.url + "/v1/chat/completions", raw)
    assert status == 400
    assert headers["Content-Type"].startswith("application/json")
    err = openai_error(out)
    assert err["type"] == "invalid_request_error"
    assert err["code"] == "invalid_json"
    assert "x-request-id" in headers
    assert not upstream.chat


@pytest.mark.parametrize("raw", [b"[]", b'[{"model": "gpt-4o-mini"}]', b'"text"', b"42", b"null"])
async def test_json_not_an_object(upstream: FakeUpstream, start_proxy: Any, raw: bytes) -> None:
    proxy = await start_proxy(base_config(upstream.base_url))
    status, _, out = await post_raw(proxy.url + "/v1/chat/completions", raw)
    assert status == 400
    err = openai_error(out)
    assert err["type"] == "invalid_request_error"
    assert err["code"] == "invalid_body"
    assert not upstream.chat


BAD_BODIES = [
    ({"model": MODEL}, "invalid_messages", "messages"),
    ({"model": MODEL, "messages": "hello"}, "invalid_messages", "messages"),
    ({"model": MODEL, "messages": {"role": "user", "content": "x"}}, "invalid_messages", "messages"),
    ({"model": MODEL, "messages": []}, "empty_messages", "messages"),
    ({"model": MODEL, "messages": [42]}, "invalid_message", "messages[0]"),
    ({"model": MODEL, "messages": [{"role": "robot", "content": "x"}]}, "invalid_role", "messages[0].role"),
    ({"model": MODEL, "messages": [{"content": "x"}]}, "invalid_role", "messages[0].role"),
    ({"model": MODEL, "messages": [{"role": "user"}]}, "missing_content", "messages[0].content"),
    ({"model": MODEL, "messages": [{"role": "user", "content": 5}]}, "invalid_content", "messages[0].content"),
    ({"model": MODEL, "messages": [{"role": "user", "content": [{"text": "no type"}]}]}, "invalid_content",
     "messages[0].content[0]"),
    ({"model": MODEL, "messages": [
        {"role": "user", "content": "x"},
        {"role": "assistant", "content": None, "tool_calls": {"id": "c1"}}]}, "invalid_tool_call",
     "messages[1].tool_calls"),
    ({"model": MODEL, "messages": [
        {"role": "user", "content": "x"},
        {"role": "assistant", "content": None, "tool_calls": [{"type": "function", "function": {"name": "f"}}]},
    ]}, "invalid_tool_call", "messages[1].tool_calls[0].id"),
    ({"model": MODEL, "messages": [
        {"role": "user", "content": "x"},
        {"role": "assistant", "content": None, "tool_calls": [{"id": "c1", "type": "function", "function": {}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "r"}]}, "invalid_tool_call",
     "messages[1].tool_calls[0].function.name"),
    ({"model": MODEL, "messages": [{"role": "user", "content": "x"}, {"role": "tool", "content": "r"}]},
     "missing_tool_call_id", "messages[1].tool_call_id"),
    ({"messages": MESSAGES}, "missing_model", "model"),
    ({"model": 42, "messages": MESSAGES}, "missing_model", "model"),
    ({"model": MODEL, "messages": MESSAGES, "max_tokens": "many"}, "invalid_max_tokens", "max_tokens"),
    ({"model": MODEL, "messages": MESSAGES, "max_completion_tokens": 0}, "invalid_max_tokens",
     "max_completion_tokens"),
]


@pytest.mark.parametrize(("body", "code", "param"), BAD_BODIES, ids=[c for _, c, _ in BAD_BODIES])
async def test_bad_request_shapes(upstream: FakeUpstream, start_proxy: Any, body: Any, code: str, param: str) -> None:
    proxy = await start_proxy(base_config(upstream.base_url))
    status, _, out = await post_raw(proxy.url + "/v1/chat/completions", json.dumps(body).encode())
    assert status == 400
    err = openai_error(out)
    assert err["type"] == "invalid_request_error"
    assert err["code"] == code
    assert err["param"] == param
    assert not upstream.chat and not upstream.summaries


async def test_bad_request_through_openai_client(upstream: FakeUpstream, start_proxy: Any) -> None:
    proxy = await start_proxy(base_config(upstream.base_url))
    async with client(proxy) as c:
        with pytest.raises(openai.BadRequestError) as info:
            await c.chat.completions.create(model=MODEL, messages=[{"role": "tool", "content": "orphan"}])
    assert info.value.status_code == 400
    assert info.value.code == "missing_tool_call_id"
    assert info.value.param == "messages[0].tool_call_id"
    assert info.value.type == "invalid_request_error"
    assert not upstream.chat


async def test_unknown_model_when_not_allowed(upstream: FakeUpstream, start_proxy: Any) -> None:
    proxy = await start_proxy(base_config(upstream.base_url, allow_unknown_models=False))
    async with client(proxy) as c:
        with pytest.raises(openai.NotFoundError) as info:
            await c.chat.completions.create(model="no-such-model", messages=MESSAGES)
    assert info.value.code == "model_not_found"
    assert info.value.param == "model"
    openai_error(info.value.response.content)
    assert not upstream.chat


async def test_unknown_route_is_openai_404(upstream: FakeUpstream, start_proxy: Any) -> None:
    proxy = await start_proxy(base_config(upstream.base_url))
    async with aiohttp.ClientSession() as s, s.get(proxy.url + "/nope") as r:
        assert r.status == 404
        err = openai_error(await r.read())
    assert err["code"] == "not_found"


def _unfittable() -> list[dict[str, Any]]:
    return [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "an earlier question"},
        {"role": "assistant", "content": "an earlier answer"},
        {"role": "user", "content": "Please review this log: " + " ".join(f"line-{i} ok" for i in range(3000))},
    ]


TINY = [{"name": "tiny", "context_window": 2000, "max_output_tokens": 200}]


@pytest.mark.parametrize("stream", [False, True])
async def test_context_length_exceeded_never_reaches_upstream(upstream: FakeUpstream, start_proxy: Any,
                                                              stream: bool) -> None:
    proxy = await start_proxy(base_config(upstream.base_url, models=TINY))
    async with client(proxy) as c:
        with pytest.raises(openai.BadRequestError) as info:
            await c.chat.completions.create(model="tiny", messages=_unfittable(), stream=stream)
    err = openai_error(info.value.response.content)
    assert info.value.status_code == 400
    assert err["code"] == "context_length_exceeded"
    assert err["type"] == "invalid_request_error"
    assert err["param"] == "messages"
    assert "1600" in err["message"]  # the budget it could not meet: 2000 - 200 - 200
    assert not upstream.chat


async def test_context_length_exceeded_without_history_makes_no_call(upstream: FakeUpstream,
                                                                     start_proxy: Any) -> None:
    proxy = await start_proxy(base_config(upstream.base_url, models=TINY))
    async with client(proxy) as c:
        with pytest.raises(openai.BadRequestError) as info:
            await c.chat.completions.create(model="tiny", messages=_unfittable()[-1:])
    assert info.value.code == "context_length_exceeded"
    assert not upstream.chat and not upstream.summaries and not upstream.other


async def test_context_length_exceeded_makes_no_summariser_call(upstream: FakeUpstream, start_proxy: Any) -> None:
    proxy = await start_proxy(base_config(upstream.base_url, models=TINY))
    async with client(proxy) as c:
        with pytest.raises(openai.BadRequestError) as info:
            await c.chat.completions.create(model="tiny", messages=_unfittable())
    assert info.value.code == "context_length_exceeded"
    assert not upstream.chat
    assert not upstream.summaries


async def test_body_over_max_body_mb(upstream: FakeUpstream, start_proxy: Any) -> None:
    cfg = base_config(upstream.base_url)
    cfg["server"] = {"max_body_mb": 0.01}
    proxy = await start_proxy(cfg)
    big = [{"role": "user", "content": "x " * 20_000}]
    async with client(proxy) as c:
        with pytest.raises(openai.APIStatusError) as info:
            await c.chat.completions.create(model=MODEL, messages=big)
    assert info.value.status_code == 413
    err = openai_error(info.value.response.content)
    assert err["code"] == "request_too_large"
    # a small body still goes through
    async with client(proxy) as c:
        await c.chat.completions.create(model=MODEL, messages=MESSAGES)
    assert len(upstream.chat) == 1


async def test_chunked_body_over_max_body_mb(upstream: FakeUpstream, start_proxy: Any) -> None:
    cfg = base_config(upstream.base_url)
    cfg["server"] = {"max_body_mb": 0.01}
    proxy = await start_proxy(cfg)

    async def chunks() -> AsyncIterator[bytes]:  # no Content-Length: the limit must apply while reading
        yield b'{"model": "gpt-4o-mini", "messages": [{"role": "user", "content": "'
        for _ in range(40):
            yield b"x" * 1000
        yield b'"}]}'

    status, _, out = await post_raw(proxy.url + "/v1/chat/completions", chunks())
    assert status == 413
    assert openai_error(out)["code"] == "request_too_large"
    assert not upstream.chat


# --- the upstream fails ---------------------------------------------------------------------------------


async def test_upstream_unreachable_502(upstream: FakeUpstream, start_proxy: Any) -> None:
    cfg = base_config(f"http://127.0.0.1:{free_port()}/v1")
    proxy = await start_proxy(cfg)
    async with client(proxy) as c:
        with pytest.raises(openai.APIStatusError) as info:
            await c.chat.completions.create(model=MODEL, messages=MESSAGES)
    assert info.value.status_code == 502
    err = openai_error(info.value.response.content)
    assert err["code"] == "upstream_unreachable"
    assert "x-ctxproxy-tokens-in" in info.value.response.headers
    assert info.value.response.headers["x-request-id"]


async def test_upstream_unreachable_on_stream_502(upstream: FakeUpstream, start_proxy: Any) -> None:
    proxy = await start_proxy(base_config(f"http://127.0.0.1:{free_port()}/v1"))
    body = json.dumps({"model": MODEL, "messages": MESSAGES, "stream": True}).encode()
    status, _, out = await post_raw(proxy.url + "/v1/chat/completions", body)
    assert status == 502
    assert openai_error(out)["code"] == "upstream_unreachable"


async def test_upstream_slow_first_byte_504(upstream: FakeUpstream, start_proxy: Any) -> None:
    upstream.mode, upstream.delay = "slow_first_byte", 5
    cfg = base_config(upstream.base_url)
    cfg["server"] = {"first_byte_timeout": 0.5}
    proxy = await start_proxy(cfg)
    started = time.monotonic()
    async with client(proxy) as c:
        with pytest.raises(openai.APIStatusError) as info:
            await c.chat.completions.create(model=MODEL, messages=MESSAGES, stream=True)
    assert time.monotonic() - started < 3
    assert info.value.status_code == 504
    err = openai_error(info.value.response.content)
    assert err["code"] == "upstream_timeout"
    # the proxy gave up on the upstream request: it is cancelled there, not left running
    assert await eventually(lambda: upstream.active == 0, 2.0)


@pytest.mark.parametrize(("status", "exc"), [(500, openai.InternalServerError), (429, openai.RateLimitError),
                                             (503, openai.InternalServerError), (401, openai.AuthenticationError)])
async def test_upstream_status_relayed(upstream: FakeUpstream, start_proxy: Any, status: int, exc: Any) -> None:
    upstream.mode, upstream.status = "status", status
    upstream.status_body = {"error": {"message": f"upstream says {status}", "type": "requests", "param": None,
                                      "code": "rate_limit_exceeded" if status == 429 else None}}
    upstream.status_headers = {"Retry-After": "7", "x-ratelimit-remaining-requests": "0"}
    cfg = base_config(upstream.base_url)
    cfg["upstreams"]["fake"]["api_key"] = None  # the client's own key goes upstream: its 401 is the client's
    proxy = await start_proxy(cfg)
    async with client(proxy) as c:
        with pytest.raises(exc) as info:
            await c.chat.completions.create(model=MODEL, messages=MESSAGES)
    assert info.value.status_code == status
    assert json.loads(info.value.response.content) == upstream.status_body
    headers = info.value.response.headers
    assert headers["retry-after"] == "7"
    assert headers["x-ratelimit-remaining-requests"] == "0"
    assert headers["content-type"].startswith("application/json")
    assert "x-request-id" in headers
    assert len(upstream.chat) == 1  # max_retries=0: exactly one attempt


async def test_upstream_429_on_stream_relayed(upstream: FakeUpstream, start_proxy: Any) -> None:
    upstream.mode, upstream.status = "status", 429
    upstream.status_headers = {"Retry-After": "2"}
    proxy = await start_proxy(base_config(upstream.base_url))
    body = json.dumps({"model": MODEL, "messages": MESSAGES, "stream": True}).encode()
    status, headers, out = await post_raw(proxy.url + "/v1/chat/completions", body)
    assert status == 429
    assert headers["Retry-After"] == "2"
    assert openai_error(out)["message"] == "upstream failure"


async def test_gemini_error_shape_normalised(upstream: FakeUpstream, start_proxy: Any) -> None:
    upstream.mode, upstream.status = "status", 400
    upstream.status_body = [{"error": {"code": 400, "message": "Request contains an invalid argument.",
                                       "status": "INVALID_ARGUMENT"}}]
    proxy = await start_proxy(base_config(upstream.base_url))
    async with client(proxy) as c:
        with pytest.raises(openai.BadRequestError) as info:
            await c.chat.completions.create(model=MODEL, messages=MESSAGES)
    err = openai_error(info.value.response.content)
    assert info.value.status_code == 400
    assert err["message"] == "Request contains an invalid argument."
    assert err["type"] == "INVALID_ARGUMENT"
    assert err["code"] == "400"
    assert err["param"] is None


@pytest.mark.parametrize("payload", ["<html>Bad Gateway</html>", {"detail": "model overloaded"}, {"error": "boom"},
                                     {"unexpected": True}, None])
async def test_other_upstream_error_shapes_normalised(upstream: FakeUpstream, start_proxy: Any, payload: Any) -> None:
    upstream.mode, upstream.status = "status", 503
    upstream.status_body = payload if payload is not None else {}
    proxy = await start_proxy(base_config(upstream.base_url))
    status, _, out = await post_raw(proxy.url + "/v1/chat/completions",
                                    json.dumps({"model": MODEL, "messages": MESSAGES}).encode())
    assert status == 503
    err = openai_error(out)
    assert err["type"] == "upstream_error"


# --- failures after the stream started -------------------------------------------------------------------


def _assert_ends_in_error(raw: bytes) -> dict[str, Any]:
    assert b"Traceback" not in raw
    events = sse_events(raw)
    assert b"[DONE]" not in events
    assert b"data: [DONE]" not in raw
    last = json.loads(events[-1])
    assert set(last) == {"error"}
    assert isinstance(last["error"].get("message"), str)
    return last["error"]


@pytest.mark.parametrize("mode", ["stall", "break", "no_done", "error_in_stream"])
async def test_stream_failure_ends_with_error_event(upstream: FakeUpstream, start_proxy: Any, mode: str) -> None:
    upstream.mode = mode
    cfg = base_config(upstream.base_url)
    cfg["server"] = {"idle_timeout": 0.5}
    proxy = await start_proxy(cfg)
    body = json.dumps({"model": MODEL, "messages": MESSAGES, "stream": True}).encode()
    started = time.monotonic()
    status, headers, raw = await post_raw(proxy.url + "/v1/chat/completions", body)
    assert time.monotonic() - started < 3
    assert status == 200
    assert headers["Content-Type"].startswith("text/event-stream")
    events = sse_events(raw)
    if mode != "break":  # (on "break", aiohttp may drop bytes that arrived together with the connection loss)
        assert json.loads(events[0])["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    err = _assert_ends_in_error(raw)
    if mode == "error_in_stream":
        assert b'{"error": {"message": "overloaded", "type": "server_error"}}' in events
    else:
        assert set(err) == {"message", "type", "param", "code"}
        assert err["code"] == ("upstream_timeout" if mode == "stall" else "upstream_unreachable")
    assert await eventually(lambda: upstream.active == 0)


@pytest.mark.parametrize("mode", ["stall", "break", "no_done"])
async def test_stream_failure_raises_in_openai_client(upstream: FakeUpstream, start_proxy: Any, mode: str) -> None:
    """The official client must not mistake a truncated stream for a complete answer."""
    upstream.mode = mode
    cfg = base_config(upstream.base_url)
    cfg["server"] = {"idle_timeout": 0.5}
    proxy = await start_proxy(cfg)
    got: list[str] = []
    async with client(proxy) as c:
        stream = await c.chat.completions.create(model=MODEL, messages=MESSAGES, stream=True)
        with pytest.raises(openai.APIError) as info:
            async for chunk in stream:
                got.append(chunk.choices[0].delta.content or "" if chunk.choices else "")
    assert "upstream" in str(info.value.message).lower() or "stream" in str(info.value.message).lower()


async def test_malformed_sse_relayed(upstream: FakeUpstream, start_proxy: Any) -> None:
    upstream.mode = "malformed"
    proxy = await start_proxy(base_config(upstream.base_url))
    body = json.dumps({"model": MODEL, "messages": MESSAGES, "stream": True}).encode()
    status, _, raw = await post_raw(proxy.url + "/v1/chat/completions", body)
    assert status == 200
    assert b"data: {not json\n\n" in raw
    assert raw.endswith(b"data: [DONE]\n\n")
    assert b'"error"' not in raw


async def test_client_disconnect_cancels_upstream(upstream: FakeUpstream, start_proxy: Any) -> None:
    upstream.mode = "stall"  # sends two chunks, then waits an hour
    proxy = await start_proxy(base_config(upstream.base_url))
    body = json.dumps({"model": MODEL, "messages": MESSAGES, "stream": True}).encode()
    async with aiohttp.ClientSession() as s:
        resp = await s.post(proxy.url + "/v1/chat/completions", data=body,
                            headers={"Content-Type": "application/json"})
        assert resp.status == 200
        first = await asyncio.wait_for(resp.content.readuntil(b"\n\n"), 2)
        assert first.startswith(b"data: ")
        assert upstream.active == 1
        resp.close()  # drop the connection mid-stream
    assert await eventually(lambda: upstream.cancelled == 1 and upstream.active == 0, 1.0), \
        (upstream.cancelled, upstream.active)
    # and the proxy's pooled connection to the upstream was closed, not returned to the pool
    session = next(s for key, s in proxy.state.shared.pool._sessions.items() if key[0] == upstream.base_url)
    assert await eventually(lambda: session.connections() == (0, 0), 1.0)
    # the proxy keeps serving
    upstream.mode = "ok"
    async with client(proxy) as c:
        out = await c.chat.completions.create(model=MODEL, messages=MESSAGES)
    assert out.choices[0].message.content


async def test_client_disconnect_while_waiting_for_first_byte(upstream: FakeUpstream, start_proxy: Any) -> None:
    upstream.mode = "hang"
    proxy = await start_proxy(base_config(upstream.base_url))
    body = json.dumps({"model": MODEL, "messages": MESSAGES}).encode()
    async with aiohttp.ClientSession() as s:
        task = asyncio.ensure_future(s.post(proxy.url + "/v1/chat/completions", data=body,
                                            headers={"Content-Type": "application/json"}))
        assert await eventually(lambda: upstream.active == 1, 2.0)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
    assert await eventually(lambda: upstream.cancelled == 1 and upstream.active == 0, 1.0)
