"""An upstream that fails mid-stream sends its own error event and closes: the client gets it, and nothing more.

OpenAI-compatible servers end a failed Chat Completions stream with ``data: {"error": …}``; the Responses
API and Anthropic's Messages API with ``event: error``. That event ends the stream as the wire's terminal
event does, so the proxy must not append a second error of its own (the SDKs raise on the first one,
the upstream's real error). A small aiohttp upstream on 127.0.0.1 streams exactly such endings.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import pytest
from aiohttp import web

from tests.conftest import StartProxy, base_config

CHAT = (b'data: {"id":"c1","object":"chat.completion.chunk","choices":[{"index":0,"delta":{"content":"he"}}]}\n\n'
        b'data: {"error":{"message":"The server had an error while processing your request.",'
        b'"type":"server_error","param":null,"code":null}}\n\n')
RESPONSES = (b'event: response.created\ndata: {"type":"response.created","sequence_number":0,'
             b'"response":{"id":"resp_1","object":"response","status":"in_progress","output":[]}}\n\n'
             b'event: error\ndata: {"type":"error","sequence_number":1,"code":"server_error",'
             b'"message":"The model failed.","param":null}\n\n')
MESSAGES = (b'event: message_start\ndata: {"type":"message_start","message":{"id":"msg_1","type":"message",'
            b'"role":"assistant","content":[],"model":"claude-sonnet-4-5","usage":{"input_tokens":5,'
            b'"output_tokens":1}}}\n\n'
            b'event: error\ndata: {"type":"error","error":{"type":"overloaded_error","message":"Overloaded"}}\n\n')
STREAMS = {"/v1/chat/completions": CHAT, "/v1/responses": RESPONSES, "/v1/messages": MESSAGES}


@pytest.fixture
async def failing_upstream() -> AsyncIterator[str]:
    async def handle(request: web.Request) -> web.StreamResponse:
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        await response.write(STREAMS[request.path])
        await response.write_eof()
        return response

    app = web.Application()
    for path in STREAMS:
        app.router.add_post(path, handle)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    yield f"http://127.0.0.1:{port}/v1"
    await runner.cleanup()


BODIES: dict[str, dict[str, Any]] = {
    "/v1/chat/completions": {"model": "gpt-4o-mini", "stream": True, "messages": [{"role": "user", "content": "hi"}]},
    "/v1/responses": {"model": "gpt-4o-mini", "stream": True, "input": "hi"},
    "/v1/messages": {"model": "claude-sonnet-4-5", "stream": True, "max_tokens": 32,
                     "messages": [{"role": "user", "content": "hi"}]},
}


@pytest.mark.parametrize("path", list(STREAMS))
async def test_the_upstreams_own_error_event_ends_the_stream(
        start_proxy: StartProxy, failing_upstream: str, path: str) -> None:
    cfg = base_config(failing_upstream, upstreams={"fake": {"base_url": failing_upstream, "api_key": "sk-up",
                                                            "api": "openai"}})
    proxy = await start_proxy(cfg)
    async with aiohttp.ClientSession() as s, s.post(proxy.url + path, json=BODIES[path],
                                                    headers={"Authorization": "Bearer sk-client"}) as r:
        assert r.status == 200
        raw = await r.read()
    assert raw == STREAMS[path]  # the upstream's bytes, its error last, nothing appended
