"""Relaying an upstream SSE stream chunk by chunk, never buffered.

A failure after the stream has started (an upstream that stalls, breaks, or
ends without ``[DONE]``) ends the client's stream with one
``data: {"error": {...}}`` event and no ``[DONE]``, so the client can never
mistake a truncated answer for a complete one.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

import aiohttp
import orjson
from aiohttp import web
from multidict import CIMultiDict

from proxy.deadline import deadline
from proxy.errors import CtxProxyError, UpstreamTimeout, UpstreamUnreachable

SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
# set when a stream failed after it started (the response status is already sent)
STREAM_ERROR = web.RequestKey("stream_error", str)


class StreamWatcher:
    """Watches relayed SSE bytes for ``[DONE]``, the usage object and the first token, without altering them."""

    def __init__(self, started: float) -> None:
        self.started = started
        self.done = False
        self.usage: dict[str, Any] | None = None
        self.ttft: float | None = None
        self._partial = b""

    def feed(self, chunk: bytes) -> None:
        if self.ttft is None:
            self.ttft = time.perf_counter() - self.started
        data = self._partial + chunk
        lines = data.split(b"\n")
        self._partial = lines.pop()
        for line in lines:
            if not line.startswith(b"data:"):
                continue
            payload = line[5:].strip()
            if payload == b"[DONE]":
                self.done = True
            elif b'"usage"' in payload:
                try:
                    event = orjson.loads(payload)
                except orjson.JSONDecodeError:
                    continue
                usage = event.get("usage") if isinstance(event, dict) else None
                if isinstance(usage, dict):
                    self.usage = usage


def error_event(error: CtxProxyError) -> bytes:
    return b"data: " + orjson.dumps(error.to_openai()) + b"\n\n"


async def relay_stream(
    request: web.Request,
    upstream: aiohttp.ClientResponse,
    headers: CIMultiDict[str],
    *,
    idle_timeout: float,
    watcher: StreamWatcher,
) -> web.StreamResponse:
    headers = CIMultiDict(headers)
    headers["Content-Type"] = upstream.headers.get("Content-Type", "text/event-stream")
    headers.update(SSE_HEADERS)
    response = web.StreamResponse(status=upstream.status, headers=headers)
    clean = False
    try:
        await response.prepare(request)
        error: CtxProxyError | None = None
        while True:
            try:
                async with deadline(idle_timeout):
                    chunk = await upstream.content.readany()
            except asyncio.TimeoutError:
                error = UpstreamTimeout(f"The upstream stream stalled for more than {idle_timeout:g}s.")
                break
            except (aiohttp.ClientPayloadError, aiohttp.ClientConnectionError, OSError):
                error = UpstreamUnreachable("The upstream closed the stream before it was complete.")
                break
            if not chunk:
                if not watcher.done:
                    error = UpstreamUnreachable("The upstream stream ended without [DONE].")
                break
            watcher.feed(chunk)
            await response.write(chunk)
        if error is not None:
            request[STREAM_ERROR] = error.code or "stream_error"
            await response.write(error_event(error))
        clean = error is None
        await response.write_eof()
        return response
    finally:
        if clean:
            upstream.release()
        else:
            upstream.close()  # drops the upstream connection: the provider stops generating
