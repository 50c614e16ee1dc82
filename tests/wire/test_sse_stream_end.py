"""A stream's end is the wire's business.

Chat Completions ends with ``data: [DONE]``; the Responses API with a terminal
``response.completed`` / ``response.incomplete`` / ``response.failed`` event and
no ``[DONE]``; Anthropic Messages with ``event: message_stop``; any other relayed
SSE stream when the upstream closes cleanly. For relayed paths the proxy must pass
the upstream's bytes through unchanged and add nothing after a clean end; only a
truncated stream (connection lost, framing error, idle timeout) gets an error
event, in the wire's own shape. The end is the whole terminal event (its data line
and the blank line that dispatches it), whatever the line ends (CR, LF, CRLF).

Driven from the outside only: the official ``openai`` and ``anthropic`` clients
(and raw aiohttp for byte-exact checks) against the proxy, with the fake upstream
ending its streams exactly as the providers do (``tests/fake_upstream.py``).
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Awaitable, Callable
from typing import Any

import aiohttp
import anthropic
import openai
import pytest
from aiohttp import web

from tests.conftest import Handler, RunningProxy, StartProxy, base_config
from tests.fake_upstream import REPLY, FakeUpstream, responses_events
from tests.outside import share_model_map

MODEL = "gpt-4o-mini"
CLAUDE = "claude-sonnet-4-5"
TERMINAL = ("response.completed", "response.incomplete", "response.failed")

Event = tuple[str | None, Any]


@pytest.fixture(autouse=True)
def _shared_model_map(monkeypatch: pytest.MonkeyPatch) -> None:
    share_model_map(monkeypatch)  # speed only


async def proxy_for(upstream: FakeUpstream, start_proxy: StartProxy, **server: Any) -> RunningProxy:
    return await start_proxy(base_config(upstream.base_url, server={"idle_timeout": 5, **server}))


def parse_sse(raw: bytes) -> list[Event]:
    """(event name or None, parsed data or the raw data string) for every SSE event in ``raw``."""
    out: list[Event] = []
    for block in raw.replace(b"\r\n", b"\n").split(b"\n\n"):
        name: str | None = None
        data: list[str] = []
        for line in block.decode("utf-8", "replace").split("\n"):
            if line.startswith("event:"):
                name = line[6:].strip()
            elif line.startswith("data:"):
                data.append(line[5:].strip())
        if name is None and not data:
            continue
        text = "\n".join(data)
        try:
            out.append((name, json.loads(text)))
        except ValueError:
            out.append((name, text))
    return out


async def post_stream(url: str, body: dict[str, Any], headers: dict[str, str] | None = None
                      ) -> tuple[int, bytes, BaseException | None]:
    """POST and read the whole streamed body; a cut connection is returned, not raised."""
    hdrs = {"Authorization": "Bearer sk-client", **(headers or {})}
    async with aiohttp.ClientSession() as s, s.post(url, json=body, headers=hdrs) as r:
        chunks: list[bytes] = []
        try:
            async for chunk in r.content.iter_any():
                chunks.append(chunk)
        except aiohttp.ClientError as exc:
            return r.status, b"".join(chunks), exc
        return r.status, b"".join(chunks), None


def openai_client(proxy: RunningProxy) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=proxy.base_url, api_key="sk-client", max_retries=0)


def anthropic_client(proxy: RunningProxy) -> anthropic.AsyncAnthropic:
    # the SDK appends /v1/messages itself
    return anthropic.AsyncAnthropic(base_url=proxy.url, api_key="sk-ant-client", max_retries=0)


ANTHROPIC_BODY: dict[str, Any] = {"model": CLAUDE, "max_tokens": 64, "messages": [{"role": "user", "content": "hi"}]}


# --------------------------------------------------------------------------- Chat Completions (control)


async def test_chat_completions_stream_still_ends_with_done_and_nothing_after(
    upstream: FakeUpstream, start_proxy: StartProxy
) -> None:
    """Control: the Chat Completions wire keeps ending with data: [DONE] and nothing after it."""
    proxy = await proxy_for(upstream, start_proxy)
    status, raw, cut = await post_stream(proxy.base_url + "/chat/completions", {
        "model": MODEL, "stream": True, "messages": [{"role": "user", "content": "hi"}]})
    assert (status, cut) == (200, None)
    assert raw.endswith(b"data: [DONE]\n\n")
    assert not any(isinstance(d, dict) and "error" in d for _, d in parse_sse(raw))


# --------------------------------------------------------------------------- Responses API


@pytest.mark.parametrize("end", TERMINAL)
async def test_responses_stream_with_the_openai_client_completes(
    upstream: FakeUpstream, start_proxy: StartProxy, end: str
) -> None:
    """client.responses.create(stream=True) through the relay ends at the terminal event, no error."""
    upstream.responses_end = end
    proxy = await proxy_for(upstream, start_proxy)
    async with openai_client(proxy) as client:
        stream = await client.responses.create(model=MODEL, input="hi", stream=True)
        events = [event async for event in stream]
    assert [e.type for e in events][-1] == end
    text = "".join(getattr(e, "delta", "") for e in events if e.type == "response.output_text.delta")
    assert text == REPLY
    assert len(upstream.responses) == 1


async def test_responses_stream_bytes_pass_through_unchanged(upstream: FakeUpstream, start_proxy: StartProxy) -> None:
    """a relayed Responses stream reaches the client byte for byte, with nothing after response.completed."""
    proxy = await proxy_for(upstream, start_proxy)
    async with openai_client(proxy) as client, client.responses.with_streaming_response.create(
        model=MODEL, input="hi", stream=True
    ) as response:
        raw = b"".join([chunk async for chunk in response.iter_bytes()])
    assert parse_sse(upstream.sent)[-1][0] == "response.completed"  # as OpenAI ends it: no [DONE]
    assert b"[DONE]" not in upstream.sent
    assert raw == upstream.sent


async def test_truncated_responses_stream_surfaces_as_an_error_in_the_sdk(
    upstream: FakeUpstream, start_proxy: StartProxy
) -> None:
    """a Responses stream cut mid-way never looks complete to the openai SDK."""
    upstream.wire_mode = "break"
    proxy = await proxy_for(upstream, start_proxy)
    events: list[Any] = []
    async with openai_client(proxy) as client:
        try:
            stream = await client.responses.create(model=MODEL, input="hi", stream=True)
            async for event in stream:
                events.append(event)
        except openai.APIError:
            return  # surfaced as an error: good
    # or, in the wire's own shape, a last event that says so
    assert events and events[-1].type in ("error", "response.failed"), [e.type for e in events]


async def test_truncated_responses_stream_ends_with_an_error_event_in_the_responses_shape(
    upstream: FakeUpstream, start_proxy: StartProxy
) -> None:
    """after a cut, the client gets the upstream's bytes, then one named Responses error event."""
    upstream.wire_mode = "break"
    proxy = await proxy_for(upstream, start_proxy)
    status, raw, _cut = await post_stream(proxy.base_url + "/responses", {"model": MODEL, "input": "hi",
                                                                          "stream": True})
    assert status == 200
    assert raw.startswith(upstream.sent)
    added = parse_sse(raw[len(upstream.sent):])
    assert len(added) == 1, added
    name, data = added[0]
    # OpenAI's Responses error event: event: error, data {"type": "error", "code", "message", ...}
    # (a response.failed event with response.status "failed" is the other shape the wire knows)
    assert name in ("error", "response.failed"), added
    assert isinstance(data, dict) and data.get("type") == name, added


# --------------------------------------------------------------------------- Anthropic Messages


async def test_anthropic_stream_with_the_anthropic_client_gets_the_whole_message(
    upstream: FakeUpstream, start_proxy: StartProxy
) -> None:
    """messages.stream through the relay."""
    proxy = await proxy_for(upstream, start_proxy)
    async with anthropic_client(proxy) as client, client.messages.stream(**ANTHROPIC_BODY) as stream:
        message = await stream.get_final_message()
    assert message.content[0].text == REPLY  # type: ignore[union-attr]
    assert message.stop_reason == "end_turn"
    assert len(upstream.messages) == 1
    assert upstream.messages[0].headers["Authorization"] == "Bearer sk-upstream-secret"


async def test_anthropic_stream_bytes_end_with_message_stop(upstream: FakeUpstream, start_proxy: StartProxy) -> None:
    """client.messages.create(stream=True) sees the upstream's bytes and nothing after message_stop."""
    proxy = await proxy_for(upstream, start_proxy)
    async with anthropic_client(proxy) as client, client.messages.with_streaming_response.create(
        **ANTHROPIC_BODY, stream=True
    ) as response:
        raw = b"".join([chunk async for chunk in response.iter_bytes()])
    assert upstream.sent.endswith(b'event: message_stop\ndata: {"type":"message_stop"}\n\n')
    assert raw == upstream.sent
    assert parse_sse(raw)[-1][0] == "message_stop"


async def test_truncated_anthropic_stream_raises_in_the_anthropic_client(
    upstream: FakeUpstream, start_proxy: StartProxy
) -> None:
    """a cut Anthropic stream ends with event: error ({"type": "error", "error": {...}}); the SDK raises."""
    upstream.wire_mode = "break"
    proxy = await proxy_for(upstream, start_proxy)
    async with anthropic_client(proxy) as client:
        with pytest.raises(anthropic.APIError):
            stream = await client.messages.create(**ANTHROPIC_BODY, stream=True)
            async for _event in stream:
                pass
    status, raw, _cut = await post_stream(proxy.url + "/v1/messages", {**ANTHROPIC_BODY, "stream": True},
                                          {"anthropic-version": "2023-06-01"})
    assert status == 200
    name, data = parse_sse(raw)[-1]
    assert name == "error"
    assert isinstance(data, dict) and data.get("type") == "error" and isinstance(data.get("error"), dict)


# --------------------------------------------------------------------------- unknown relayed SSE


# --------------------------------------------------------------------------- the whole terminal event, any line end

WIRES = ["chat", "responses", "messages"]
TERMINAL_DATA = {"chat": b"data: [DONE]", "responses": b"data: {\"type\":\"response.completed\"",
                 "messages": b"data: {\"type\":\"message_stop\""}


async def stream_raw(proxy: RunningProxy, wire: str) -> tuple[int, bytes, BaseException | None]:
    if wire == "chat":
        return await post_stream(proxy.base_url + "/chat/completions", {
            "model": MODEL, "stream": True, "messages": [{"role": "user", "content": "hi"}]})
    if wire == "responses":
        return await post_stream(proxy.base_url + "/responses", {"model": MODEL, "input": "hi", "stream": True})
    return await post_stream(proxy.url + "/v1/messages", {**ANTHROPIC_BODY, "stream": True},
                             {"anthropic-version": "2023-06-01"})


def cut_in_terminal(wire: str, where: str) -> Any:
    """An edit that cuts a stream inside its terminal event: half its data line, or before its blank line."""
    def edit(stream: bytes) -> bytes:
        at = stream.rindex(TERMINAL_DATA[wire])
        line_end = stream.index(b"\n", at)
        return stream[:at + len(TERMINAL_DATA[wire]) - 4] if where == "half-line" else stream[:line_end + 1]
    return edit


def before_terminal(cut: bytes) -> bytes:
    """A stream cut inside its terminal event, up to the start of that event (the end of the one before)."""
    return cut[:cut.rindex(b"\n\n") + 2]


@pytest.mark.parametrize("close", ["drop", "eof"])
@pytest.mark.parametrize("where", ["half-line", "no-blank-line"])
@pytest.mark.parametrize("wire", WIRES)
async def test_a_stream_cut_inside_its_terminal_event_ends_with_the_wires_error_event(
    upstream: FakeUpstream, start_proxy: StartProxy, wire: str, where: str, close: str
) -> None:
    """The terminal event's name (or half its data line) is not the end: cut inside the terminal event, by a
    dropped connection or a clean close, the client gets the events before it, none of its bytes, and one error
    event in the wire's shape."""
    upstream.stream_edit, upstream.stream_close = cut_in_terminal(wire, where), close
    proxy = await proxy_for(upstream, start_proxy)
    status, raw, _cut = await stream_raw(proxy, wire)
    assert status == 200
    head = before_terminal(upstream.sent)
    assert raw.startswith(head), raw[-300:]
    added = parse_sse(raw[len(head):])
    assert len(added) == 1, raw[len(head):]
    name, data = added[0]
    assert isinstance(data, dict)
    if wire == "chat":
        assert name is None and data["error"]["code"] == "upstream_unreachable"
    else:
        assert name == "error" and data["type"] == "error", data


@pytest.mark.parametrize("wire", WIRES)
async def test_a_break_after_the_whole_terminal_event_is_harmless(
    upstream: FakeUpstream, start_proxy: StartProxy, wire: str
) -> None:
    """Once the terminal event was dispatched, a dropped connection adds nothing: the bytes as sent, no error."""
    upstream.stream_edit, upstream.stream_close = (lambda stream: stream), "drop"
    proxy = await proxy_for(upstream, start_proxy)
    status, raw, _cut = await stream_raw(proxy, wire)
    assert status == 200 and raw == upstream.sent


async def test_the_openai_sdk_raises_on_a_responses_stream_cut_inside_response_completed(
    upstream: FakeUpstream, start_proxy: StartProxy
) -> None:
    """The official SDK used to end normally, without response.completed, when the upstream sent that event's
    name and half its data line: now it raises."""
    upstream.stream_edit, upstream.stream_close = cut_in_terminal("responses", "half-line"), "drop"
    proxy = await proxy_for(upstream, start_proxy)
    events: list[Any] = []
    async with openai_client(proxy) as client:
        with pytest.raises(openai.APIError):
            stream = await client.responses.create(model=MODEL, input="hi", stream=True)
            async for event in stream:
                events.append(event)
    assert "response.completed" not in [e.type for e in events]


async def test_the_anthropic_sdk_raises_on_a_stream_cut_inside_message_stop(
    upstream: FakeUpstream, start_proxy: StartProxy
) -> None:
    """message_stop's event line and data line without the blank line that dispatches it: the SDK raises."""
    upstream.stream_edit, upstream.stream_close = cut_in_terminal("messages", "no-blank-line"), "drop"
    proxy = await proxy_for(upstream, start_proxy)
    async with anthropic_client(proxy) as client:
        with pytest.raises(anthropic.APIError):
            stream = await client.messages.create(**ANTHROPIC_BODY, stream=True)
            async for _event in stream:
                pass


@pytest.mark.parametrize("eol", [b"\r", b"\r\n"], ids=["cr", "crlf"])
@pytest.mark.parametrize("wire", WIRES)
async def test_a_stream_with_cr_or_crlf_line_ends_is_relayed_whole(
    upstream: FakeUpstream, start_proxy: StartProxy, wire: str, eol: bytes
) -> None:
    """The SSE format allows CR, LF and CRLF line ends: a CR-only stream used to be withheld entirely and
    replaced by an error event; it now reaches the client byte for byte, complete."""
    upstream.stream_edit = lambda stream: stream.replace(b"\n", eol)
    proxy = await proxy_for(upstream, start_proxy)
    status, raw, cut = await stream_raw(proxy, wire)
    assert (status, cut) == (200, None)
    assert eol + eol in upstream.sent and raw == upstream.sent


async def test_the_official_sdks_read_a_cr_only_stream_through_the_proxy(
    upstream: FakeUpstream, start_proxy: StartProxy
) -> None:
    """openai (chat and responses) and anthropic each get the whole answer of a CR-only stream."""
    upstream.stream_edit = lambda stream: stream.replace(b"\n", b"\r")
    proxy = await proxy_for(upstream, start_proxy)
    async with openai_client(proxy) as client:
        chat = await client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}],
                                                    stream=True)
        assert "".join([c.choices[0].delta.content or "" async for c in chat if c.choices]) == REPLY
        stream = await client.responses.create(model=MODEL, input="hi", stream=True)
        events = [event async for event in stream]
        assert events[-1].type == "response.completed"
    async with anthropic_client(proxy) as aclient, aclient.messages.stream(**ANTHROPIC_BODY) as astream:
        message = await astream.get_final_message()
    assert message.content[0].text == REPLY  # type: ignore[union-attr]


def cut_stream(head: bytes) -> Handler:
    async def handler(request: web.Request) -> web.StreamResponse:
        await request.read()
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        await resp.write(head)
        await asyncio.sleep(0.05)
        assert request.transport is not None
        request.transport.close()
        return resp

    return handler


CHUNK = (b'data: {"id":"chatcmpl-1","object":"chat.completion.chunk","created":0,"model":"gpt-4o-mini",'
         b'"choices":[{"index":0,"delta":{"content":"Hello"},"finish_reason":null}]}\n\n')


async def test_a_connection_lost_after_the_terminal_event_adds_nothing_to_a_complete_stream(
    serve_routes: Callable[[dict[str, Handler]], Awaitable[str]], start_proxy: StartProxy
) -> None:
    """An upstream that closes the connection right after a complete Responses stream loses nothing: the client
    gets the bytes as sent and no error event, and the SDK ends on ``response.completed``."""
    sent = b"".join(responses_events(MODEL))

    async def responses(request: web.Request) -> web.StreamResponse:
        await request.read()
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream; charset=utf-8"})
        await resp.prepare(request)
        await resp.write(sent)
        await asyncio.sleep(0.05)
        assert request.transport is not None
        request.transport.close()  # the stream is complete; the connection ends without the last chunk
        return resp

    base = await serve_routes({"/v1/responses": responses})
    proxy = await start_proxy(base_config(base, server={"idle_timeout": 5}))
    async with aiohttp.ClientSession() as s, s.post(proxy.base_url + "/responses", json={
            "model": MODEL, "input": "hi", "stream": True}, headers={"Authorization": "Bearer sk-client"}) as r:
        raw = await r.read()
    assert raw == sent, raw[len(sent):]
    client = openai.AsyncOpenAI(base_url=proxy.base_url, api_key="sk-client", max_retries=0)
    async with client:
        stream = await client.responses.create(model=MODEL, input="hi", stream=True)
        events = [event async for event in stream]
    assert events[-1].type == "response.completed"


@pytest.mark.parametrize("cut", [10, 40, len(CHUNK) - 1], ids=["in-data-prefix", "mid-json", "before-blank-line"])
async def test_an_error_event_after_a_cut_inside_a_line_is_its_own_event(
    serve_routes: Callable[[dict[str, Handler]], Awaitable[str]], start_proxy: StartProxy, cut: int
) -> None:
    """A stream cut inside an SSE line: the error event the proxy appends starts on a line of its own, so the
    SDK reads an error ("closed the stream"), not a garbled chunk."""
    base = await serve_routes({"/v1/chat/completions": cut_stream(CHUNK + CHUNK[:cut])})
    proxy = await start_proxy(base_config(base, server={"idle_timeout": 5}))
    client = openai.AsyncOpenAI(base_url=proxy.base_url, api_key="sk-client", max_retries=0)
    async with client:
        stream = await client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}],
                                                      stream=True)
        with pytest.raises(openai.APIError) as err:
            async for _ in stream:
                pass
    assert "closed the stream" in str(err.value)
