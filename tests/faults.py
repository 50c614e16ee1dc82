"""Faults and leaks around a running proxy, for tests in several subjects.

What a proxy holds after its clients leave (asyncio tasks in its loop, the upstream connector's connections,
the fake upstream's active handlers, file descriptors), and upstreams that misbehave below HTTP: a raw TCP
server that closes, stalls or sends garbage, and a slow streaming upstream.
"""

from __future__ import annotations

import asyncio
import json
import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import aiohttp

from tests.conftest import RunningProxy
from tests.fake_upstream import FakeUpstream

CHAT_MODEL = "gpt-4o-mini"


HELLO = [{"role": "user", "content": "Hello there."}]


async def eventually(predicate: Callable[[], bool], timeout: float = 3.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        await asyncio.sleep(0.02)
    return predicate()


def open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


@dataclass
class Resources:
    """What a request could leak, counted in this process (proxy and fake upstream share the test's loop)."""

    tasks: int
    fds: int
    acquired: int  # upstream connections in use by the proxy
    pooled: int  # idle upstream connections kept by the proxy
    upstream_active: int

    @classmethod
    def take(cls, proxy: RunningProxy, upstream: FakeUpstream | None = None) -> Resources:
        current = asyncio.current_task()
        tasks = [t for t in asyncio.all_tasks() if t is not current and not t.done()]
        acquired = pooled = 0
        for session in proxy.state.shared.pool._sessions.values():
            open_, idle = session.connections()
            acquired += open_ - idle
            pooled += idle
        return cls(len(tasks), open_fds(), acquired, pooled, upstream.active if upstream else 0)

    def settled(self, now: Resources) -> bool:
        return (now.tasks <= self.tasks and now.fds <= self.fds and now.acquired == 0
                and now.pooled <= self.pooled and now.upstream_active == 0)


async def settle(proxy: RunningProxy, upstream: FakeUpstream | None, before: Resources,
                 timeout: float = 3.0) -> Resources:
    ok = await eventually(lambda: before.settled(Resources.take(proxy, upstream)), timeout)
    now = Resources.take(proxy, upstream)
    assert ok, f"leaked: before {before}, after {now}; tasks: {_task_names()}"
    return now


def _task_names() -> list[str]:
    return sorted(repr(t.get_coro()) for t in asyncio.all_tasks() if t is not asyncio.current_task())[:20]


async def send_chat(session: aiohttp.ClientSession, url: str, body: dict[str, Any] | None = None,
               **kw: Any) -> tuple[int, Any, bytes]:
    payload = body if body is not None else {"model": CHAT_MODEL, "messages": HELLO}
    async with session.post(url + "/v1/chat/completions", json=payload, **kw) as r:
        return r.status, r.headers, await r.read()


def openai_error(raw: bytes) -> dict[str, Any]:
    assert b"Traceback" not in raw
    body = json.loads(raw)
    assert set(body) == {"error"} and set(body["error"]) == {"message", "type", "param", "code"}, body
    return body["error"]


def sse_data(raw: bytes) -> list[bytes]:
    return [line[5:].strip() for line in raw.split(b"\n") if line.startswith(b"data:")]


async def warm(proxy: RunningProxy, upstream: FakeUpstream) -> Resources:
    """One request end to end first, so lazily created objects (pool, tokenizer) exist before counting."""
    async with aiohttp.ClientSession() as s:
        status, _, _ = await send_chat(s, proxy.url)
        assert status == 200
        status, _, _ = await send_chat(s, proxy.url, {"model": CHAT_MODEL, "messages": HELLO, "stream": True})
        assert status == 200
    await asyncio.sleep(0.05)
    return Resources.take(proxy, upstream)


class RawUpstream:
    """A TCP server on 127.0.0.1:0 that does one scripted misbehaviour per connection."""

    def __init__(self, mode: str) -> None:
        self.mode = mode
        self.connections = 0
        self._server: asyncio.Server | None = None
        self._writers: list[asyncio.StreamWriter] = []
        self.url = ""

    async def start(self) -> RawUpstream:
        self._server = await asyncio.start_server(self._handle, "127.0.0.1", 0)
        port = self._server.sockets[0].getsockname()[1]
        self.url = f"http://127.0.0.1:{port}/v1"
        return self

    async def stop(self) -> None:
        for w in self._writers:
            w.close()
        if self._server is not None:
            self._server.close()
            await self._server.wait_closed()

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        self._writers.append(writer)
        try:
            await reader.readuntil(b"\r\n\r\n")
            mode = self.mode
            if mode == "close_at_once":
                writer.close()
                return
            if mode == "silent":
                await asyncio.sleep(3600)
            if mode == "garbage":
                writer.write(b"HELLO THIS IS NOT HTTP\r\n\r\n")
            elif mode == "short_body":
                writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: 1000\r\n\r\n"
                             b'{"id": "x", "choi')
            elif mode == "stall_body":
                writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: 1000\r\n\r\n"
                             b'{"id": "x"')
                await writer.drain()
                await asyncio.sleep(3600)
            elif mode == "bad_chunked_stream":
                event = b'data: {"id": "c", "choices": []}\n\n'
                writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\n\r\n"
                             + f"{len(event):x}\r\n".encode() + event + b"\r\n")
                await writer.drain()
                await asyncio.sleep(0.1)
                writer.write(b"ZZZ\r\nnot a chunk\r\n")
            elif mode == "short_sse":  # an SSE answer with a Content-Length it never reaches
                writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nContent-Length: 5000\r\n\r\n"
                             b'data: {"id": "c", "choices": []}\n\n')
                await writer.drain()
                await asyncio.sleep(0.1)
            elif mode == "huge_header":
                writer.write(b"HTTP/1.1 200 OK\r\nX-Big: " + b"a" * 200_000 + b"\r\n\r\n")
            await writer.drain()
            writer.close()
        except (ConnectionError, asyncio.IncompleteReadError, asyncio.CancelledError):
            writer.close()


RAW_FAULTS = [
    ("close_at_once", False, 502, "upstream_unreachable"),
    ("garbage", False, 502, "upstream_unreachable"),
    ("huge_header", False, 502, "upstream_unreachable"),
    ("silent", False, 504, "upstream_timeout"),
    ("short_body", False, 502, "upstream_unreachable"),
    ("stall_body", False, 504, "upstream_timeout"),
    ("bad_chunked_stream", True, 200, "upstream_unreachable"),
    ("short_sse", True, 200, "upstream_unreachable"),
]


class SlowStreamUpstream:
    """Streams ``chunks`` SSE chunks, ``interval`` seconds apart, then [DONE] (any path, any method)."""

    def __init__(self, chunks: int = 10, interval: float = 0.2) -> None:
        self.chunks = chunks
        self.interval = interval
        self.active = 0
        self.cancelled = 0
        self.url = ""
        self._runner: Any = None

    @property
    def base_url(self) -> str:
        return self.url + "/v1"

    async def start(self) -> SlowStreamUpstream:
        from aiohttp import web

        app = web.Application(client_max_size=64 * 1024 * 1024)
        app.router.add_route("*", "/{tail:.*}", self._stream)
        self._runner = web.AppRunner(app, access_log=None, handler_cancellation=True)
        await self._runner.setup()
        site = web.TCPSite(self._runner, "127.0.0.1", 0)
        await site.start()
        self.url = f"http://127.0.0.1:{site._server.sockets[0].getsockname()[1]}"  # type: ignore[union-attr]
        return self

    async def stop(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()

    async def _stream(self, request: Any) -> Any:
        from aiohttp import web

        await request.read()
        self.active += 1
        try:
            resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
            await resp.prepare(request)
            for i in range(self.chunks):
                chunk = {"id": "c", "object": "chat.completion.chunk", "created": 0, "model": CHAT_MODEL,
                         "choices": [{"index": 0, "delta": {"content": f"piece {i} "}, "finish_reason": None}]}
                await resp.write(b"data: " + json.dumps(chunk).encode() + b"\n\n")
                await asyncio.sleep(self.interval)
            await resp.write(b"data: [DONE]\n\n")
            await resp.write_eof()
            return resp
        except asyncio.CancelledError:
            self.cancelled += 1
            raise
        finally:
            self.active -= 1


async def _stream_all(session: aiohttp.ClientSession, url: str) -> bytes:
    body = {"model": CHAT_MODEL, "messages": HELLO, "stream": True}
    async with session.post(url + "/v1/chat/completions", json=body) as r:
        assert r.status == 200
        return await r.read()
