"""proxy.serve.streaming: relaying an Answer (a fake at the Provider seam) to a real client connection."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import aiohttp
import pytest
from aiohttp import web
from multidict import CIMultiDict

from proxy.core.errors import UpstreamTimeout, UpstreamUnreachable
from proxy.serve.streaming import STREAM_ERROR, relay_answer, usage_of
from proxy.wire.chat.stream import STREAM as CHAT
from proxy.wire.messages.stream import STREAM as MESSAGES
from proxy.wire.responses.stream import STREAM as RESPONSES
from proxy.wire.sse import SSE, StreamEnd, StreamWatcher
from tests.conftest import StartProxy, base_config
from tests.fake_upstream import FakeUpstream
from tests.faults import (
    CHAT_MODEL,
    HELLO,
    Resources,
    SlowStreamUpstream,
    eventually,
    send_chat,
    settle,
    sse_data,
    warm,
)


class FakeAnswer:
    """An Answer: a body, or chunks that may end with an exception."""

    def __init__(self, *, body: bytes = b"", chunks: list[bytes] | None = None, error: Exception | None = None,
                 status: int = 200, headers: dict[str, str] | None = None) -> None:
        self.status = status
        self.streaming = chunks is not None
        self.headers: CIMultiDict[str] = CIMultiDict(headers or {})
        self._body = body
        self._chunks = chunks or []
        self._error = error
        self.closed: list[bool] = []

    async def chunks(self, idle_timeout: float) -> AsyncIterator[bytes]:
        for chunk in self._chunks:
            await asyncio.sleep(0)
            yield chunk
        if self._error is not None:
            raise self._error

    async def read(self, idle_timeout: float) -> bytes:
        return self._body

    def close(self, clean: bool) -> None:
        self.closed.append(clean)


Run = Callable[[FakeAnswer, StreamEnd], Awaitable[tuple[int, dict[str, str], bytes, StreamWatcher, dict[str, Any]]]]


@pytest.fixture
async def run() -> AsyncIterator[Run]:
    runners: list[web.AppRunner] = []

    async def go(answer: FakeAnswer,
                 end: StreamEnd) -> tuple[int, dict[str, str], bytes, StreamWatcher, dict[str, Any]]:
        watcher = StreamWatcher(0.0, end)
        seen: dict[str, Any] = {}

        async def handler(request: web.Request) -> web.StreamResponse:
            try:
                return await relay_answer(request, answer, CIMultiDict({"x-request-id": "rid-1",
                                                                        "x-ctxproxy-tokens-in": "42"}),
                                          idle_timeout=5, watcher=watcher)
            finally:
                seen["stream_error"] = request.get(STREAM_ERROR)

        app = web.Application()
        app.router.add_get("/", handler)
        runner = web.AppRunner(app, access_log=None)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        runners.append(runner)
        port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
        async with aiohttp.ClientSession() as s, s.get(f"http://127.0.0.1:{port}/") as r:
            raw = await r.read()
            return r.status, {k.lower(): v for k, v in r.headers.items()}, raw, watcher, seen

    yield go
    for runner in runners:
        await runner.cleanup()


@pytest.mark.parametrize(("raw", "usage"), [
    (b'{"id": "chatcmpl-1", "usage": {"prompt_tokens": 5, "completion_tokens": 2}}',
     {"prompt_tokens": 5, "completion_tokens": 2}),
    (b'{"id": "msg_1", "usage": {"input_tokens": 9, "output_tokens": 3}}', {"input_tokens": 9, "output_tokens": 3}),
    (b'{"id": "x"}', None),
    (b'{"usage": null}', None),
    (b'{"usage": [1]}', None),
    (b'["usage"]', None),
    (b'{"usage": {broken', None),
    (b"", None),
])
def test_usage_of(raw: bytes, usage: dict[str, int] | None) -> None:
    assert usage_of(raw) == usage


async def test_a_json_answer_is_relayed_with_its_usage(run: Run) -> None:
    body = json.dumps({"id": "chatcmpl-1", "choices": [], "usage": {"prompt_tokens": 5}}).encode()
    answer = FakeAnswer(body=body, headers={"x-ratelimit-remaining-requests": "9"})
    status, headers, raw, watcher, seen = await run(answer, CHAT)
    assert (status, raw) == (200, body)
    assert headers["content-type"] == "application/json"
    assert headers["x-request-id"] == "rid-1" and headers["x-ctxproxy-tokens-in"] == "42"
    assert headers["x-ratelimit-remaining-requests"] == "9"
    assert watcher.usage == {"prompt_tokens": 5} and watcher.ttft is not None
    assert seen["stream_error"] is None


async def test_an_upstream_content_type_is_kept_for_bodies(run: Run) -> None:
    answer = FakeAnswer(body=b"\x00audio", headers={"Content-Type": "audio/mpeg"})
    _, headers, raw, _, _ = await run(answer, SSE)
    assert headers["content-type"] == "audio/mpeg" and raw == b"\x00audio"


COMPLETE = {
    "chat": (CHAT, [b"data: {\"choices\": []}\n\n", b"data: [DONE]\n\n"]),
    "responses": (RESPONSES, [b"event: response.created\ndata: {}\n\n",
                              b"event: response.completed\n"
                              b"data: {\"response\": {\"usage\": {\"input_tokens\": 3}}}\n\n"]),
    "messages": (MESSAGES, [b"event: message_start\ndata: {}\n\n", b"event: message_stop\ndata: {}\n\n"]),
    "sse": (SSE, [b"data: 0\n\n", b"data: 1\n\n"]),
}


@pytest.mark.parametrize("name", list(COMPLETE))
async def test_a_complete_stream_is_relayed_byte_for_byte_and_nothing_added(run: Run, name: str) -> None:
    end, chunks = COMPLETE[name]
    answer = FakeAnswer(chunks=chunks, headers={"Content-Type": "text/event-stream; charset=utf-8"})
    status, headers, raw, watcher, seen = await run(answer, end)
    assert status == 200
    assert raw == b"".join(chunks)
    assert headers["content-type"] == "text/event-stream; charset=utf-8"
    assert headers["cache-control"] == "no-cache" and headers["x-accel-buffering"] == "no"
    assert headers["x-request-id"] == "rid-1"
    assert watcher.complete
    assert answer.closed == [True]
    assert seen["stream_error"] is None


@pytest.mark.parametrize("name", ["chat", "responses", "messages"])
async def test_a_clean_close_before_the_terminal_event_ends_with_the_wires_error_event(run: Run, name: str) -> None:
    end, chunks = COMPLETE[name]
    answer = FakeAnswer(chunks=chunks[:1])
    _, _, raw, _, seen = await run(answer, end)
    assert raw.startswith(chunks[0])
    tail = raw[len(chunks[0]):]
    assert tail == end.error_event(UpstreamUnreachable("The upstream closed the stream before it was complete."))
    assert seen["stream_error"] == "upstream_unreachable"
    assert answer.closed == [False]  # dropped: the provider stops generating


@pytest.mark.parametrize(("error", "code"), [
    (UpstreamTimeout("The upstream stream stalled for more than 5s."), "upstream_timeout"),
    (UpstreamUnreachable("The upstream sent a malformed stream."), "upstream_unreachable"),
])
async def test_a_stream_that_breaks_off_ends_with_one_error_event(run: Run, error: Exception, code: str) -> None:
    end, chunks = COMPLETE["chat"]
    answer = FakeAnswer(chunks=chunks[:1], error=error)
    _, _, raw, watcher, seen = await run(answer, end)
    events = [e for e in raw.split(b"\n\n") if e]
    assert events[0] + b"\n\n" == chunks[0]
    assert len(events) == 2
    assert json.loads(events[1][len(b"data: "):])["error"]["code"] == code
    assert not watcher.done
    assert seen["stream_error"] == code
    assert answer.closed == [False]


MODEL = "gpt-4o-mini"


@pytest.mark.usefixtures("shared_model_map")
async def test_chunk_framing_error_mid_stream_ends_the_stream_at_once(upstream: FakeUpstream, start_proxy: StartProxy
                                                                      ) -> None:
    """The upstream breaks HTTP chunked framing mid-stream: the client's stream ends with an error at once."""
    upstream.mode = "bad_chunk"
    idle = 2.0
    proxy = await start_proxy(base_config(upstream.base_url, server={"idle_timeout": idle}))
    async with aiohttp.ClientSession() as s, s.post(proxy.base_url + "/chat/completions", json={
            "model": MODEL, "stream": True, "messages": [{"role": "user", "content": "hi"}]}) as r:
        assert r.status == 200
        raw = await r.content.readany()  # the first chunk; the framing breaks 0.2 s later
        started = time.monotonic()
        try:
            async for chunk in r.content.iter_any():
                raw += chunk
        except aiohttp.ClientPayloadError:
            pass  # the proxy may also cut the connection
    elapsed = time.monotonic() - started
    assert b'"error"' in raw and b"[DONE]" not in raw, raw[-300:]
    assert elapsed < idle / 2, (
        f"the framing error surfaced {elapsed:.1f} s after the first chunk (idle timeout {idle} s)"
    )


async def test_many_clients_disconnect_mid_stream_nothing_leaks(upstream: FakeUpstream, start_proxy: Any) -> None:
    """20 streams cut by their clients mid-stream: 20 upstream requests cancelled, no task, connection or fd
    left behind, and the proxy keeps serving."""
    proxy = await start_proxy(base_config(upstream.base_url))
    before = await warm(proxy, upstream)
    upstream.mode = "stall"  # two chunks, then an hour of silence
    body = {"model": CHAT_MODEL, "messages": HELLO, "stream": True}
    sessions = [aiohttp.ClientSession() for _ in range(20)]
    try:
        responses = await asyncio.gather(*(s.post(proxy.url + "/v1/chat/completions", json=body)
                                           for s in sessions))
        firsts = await asyncio.gather(*(asyncio.wait_for(r.content.readuntil(b"\n\n"), 3) for r in responses))
        assert all(f.startswith(b"data: ") for f in firsts)
        assert upstream.active == 20
        during = Resources.take(proxy, upstream)
        assert during.acquired == 20
        for r in responses:
            r.close()  # drop the connection mid-stream
    finally:
        for s in sessions:
            await s.close()
    assert await eventually(lambda: upstream.cancelled == 20, 3.0), upstream.cancelled
    after = await settle(proxy, upstream, before)
    print(f"\nbefore {before}\nduring {during}\nafter  {after}")
    upstream.mode = "ok"
    async with aiohttp.ClientSession() as s:
        status, _, raw = await send_chat(s, proxy.url, body)
    assert status == 200 and raw.endswith(b"data: [DONE]\n\n")


async def test_client_gone_while_waiting_for_headers_nothing_leaks(upstream: FakeUpstream,
                                                                   start_proxy: Any) -> None:
    proxy = await start_proxy(base_config(upstream.base_url))
    before = await warm(proxy, upstream)
    upstream.mode = "hang"
    async with aiohttp.ClientSession() as s:
        pending = [asyncio.ensure_future(send_chat(s, proxy.url)) for _ in range(10)]
        assert await eventually(lambda: upstream.active == 10)
        for task in pending:
            task.cancel()
        await asyncio.gather(*pending, return_exceptions=True)
    assert await eventually(lambda: upstream.cancelled == 10)
    await settle(proxy, upstream, before)


async def test_slow_streams_relayed_chunk_by_chunk(slow_upstream: SlowStreamUpstream, start_proxy: Any) -> None:
    """A stream that takes 1 s arrives piece by piece (first chunk long before the end), complete."""
    proxy = await start_proxy(base_config(slow_upstream.base_url))
    body = {"model": CHAT_MODEL, "messages": HELLO, "stream": True}
    async with aiohttp.ClientSession() as s:
        started = time.monotonic()
        async with s.post(proxy.url + "/v1/chat/completions", json=body) as r:
            first = await r.content.readuntil(b"\n\n")
            first_at = time.monotonic() - started
            rest = await r.read()
        total = time.monotonic() - started
    assert first.startswith(b"data: ")
    assert total >= 0.9 and first_at < total - 0.6  # (the first request also loads the tokenizer)
    events = sse_data(first + rest)
    assert events[-1] == b"[DONE]" and len(events) == 11
