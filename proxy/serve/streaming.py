"""Relaying an upstream's answer to the client: a body, or an SSE stream chunk by chunk, never buffered.

A stream is relayed byte for byte, whole events at a time, and nothing is added
after a clean end. Only a stream that breaks off (connection lost, framing error,
idle timeout, or a clean close before the wire's whole terminal event) ends with
one error event in the wire's own shape (``proxy.wire.sse``), so a client never
mistakes a truncated answer for a complete one: the event in progress when it
broke is never relayed, so the error event stands on its own.
"""

from __future__ import annotations

import time
from typing import Any

import orjson
from aiohttp import web
from multidict import CIMultiDict

from proxy.core.errors import CtxProxyError, UpstreamUnreachable
from proxy.upstream.base import Answer
from proxy.wire.sse import SSE_HEADERS, StreamWatcher

# set when a stream failed after it started (the response status is already sent); "" in a request scope until then
STREAM_ERROR = web.RequestKey("stream_error", str)


async def relay_answer(
    request: web.Request,
    answer: Answer,
    headers: CIMultiDict[str],
    *,
    idle_timeout: float,
    watcher: StreamWatcher,
) -> web.StreamResponse:
    """Send ``answer`` to the client with ``headers``; the watcher sees every relayed byte."""
    out_headers: CIMultiDict[str] = CIMultiDict(headers)
    out_headers.extend(answer.headers)
    if not answer.streaming:
        raw = await answer.read(idle_timeout)
        watcher.ttft = time.perf_counter() - watcher.started
        watcher.usage = usage_of(raw)
        out_headers.setdefault("Content-Type", "application/json")
        return web.Response(body=raw, status=answer.status, headers=out_headers)
    out_headers["Content-Type"] = answer.headers.get("Content-Type", "text/event-stream")
    out_headers.update(SSE_HEADERS)
    response = web.StreamResponse(status=answer.status, headers=out_headers)
    clean = broken = False
    try:
        await response.prepare(request)
        error: CtxProxyError | None = None
        try:
            async for chunk in answer.chunks(idle_timeout):
                out = watcher.feed(chunk)
                if out:
                    await response.write(out)
        except CtxProxyError as exc:
            broken = True
            # after the wire's whole terminal event the stream is complete: a lost connection adds
            # nothing, and a half event after it is not relayed (the error is kept without its traceback:
            # the frame that holds it would otherwise form a cycle that keeps the request and the answer
            # alive until the collector runs)
            error = None if watcher.done else exc.with_traceback(None)
        else:
            if not watcher.complete:
                error = UpstreamUnreachable("The upstream closed the stream before it was complete.")
        if error is None and watcher.failed:
            request[STREAM_ERROR] = "upstream_error"  # relayed as the upstream sent it; counted as a failure
        if error is not None:
            request[STREAM_ERROR] = error.code or "stream_error"
            # what was relayed ends between two events: the error is an event of its own
            await response.write(watcher.end.error_event(error))
        elif not broken:
            tail = watcher.pending  # after a clean close: the upstream's last bytes as they came
            if tail:
                await response.write(tail)
        clean = not broken and error is None
        await response.write_eof()
        return response
    finally:
        answer.close(clean)  # not clean: drop the upstream connection, so the provider stops generating


def usage_of(raw: bytes) -> dict[str, Any] | None:
    """The ``usage`` object of a JSON answer (every wire puts it at the top level)."""
    if b'"usage"' not in raw:
        return None
    try:
        payload = orjson.loads(raw)
    except orjson.JSONDecodeError:
        return None
    usage = payload.get("usage") if isinstance(payload, dict) else None
    return usage if isinstance(usage, dict) else None
