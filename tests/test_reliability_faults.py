"""Faults around the proxy, each with a defined outcome, and nothing leaked afterwards.

Already covered elsewhere (not repeated here):

* tests/test_server_errors.py -- upstream 500/503/401/429 relayed with Retry-After and rate-limit headers,
  connection refused (502), slow first byte (504), stall between chunks / upstream closing mid-stream /
  no [DONE] / error object inside a 200 stream (error event, never [DONE]), malformed SSE relayed, the
  openai client raising on a truncated stream, a client disconnect cancelling one upstream request.
* tests/test_summarisation.py -- a summariser answering 500 / hanging / empty: served by the trimmer alone.
* tests/test_summarisation_redis.py::test_redis_down_then_back -- Redis down (served, 503 on /readyz,
  cache errors counted) and back (summaries created and reused again).

Here: what those leave open -- leaks counted after client disconnects (asyncio tasks in the proxy's loop,
the upstream connector's connections, the fake upstream's active handlers, file descriptors), a raw TCP
upstream that misbehaves below HTTP, the summariser deadline, and a disk cache that is unwritable, full
or corrupt.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import re
import sqlite3
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from tests.conftest import RunningProxy, base_config
from tests.fake_upstream import FakeUpstream

MODEL = "gpt-4o-mini"
MESSAGES = [{"role": "user", "content": "Hello there."}]


# --------------------------------------------------------------------------- helpers


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
            connector = session.connector
            acquired += len(connector._acquired)
            pooled += sum(len(v) for v in connector._conns.values())
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


async def chat(session: aiohttp.ClientSession, url: str, body: dict[str, Any] | None = None,
               **kw: Any) -> tuple[int, Any, bytes]:
    payload = body if body is not None else {"model": MODEL, "messages": MESSAGES}
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
        status, _, _ = await chat(s, proxy.url)
        assert status == 200
        status, _, _ = await chat(s, proxy.url, {"model": MODEL, "messages": MESSAGES, "stream": True})
        assert status == 200
    await asyncio.sleep(0.05)
    return Resources.take(proxy, upstream)


# --------------------------------------------------------------------------- client disconnects, counted


async def test_many_clients_disconnect_mid_stream_nothing_leaks(upstream: FakeUpstream, start_proxy: Any) -> None:
    """20 streams cut by their clients mid-stream: 20 upstream requests cancelled, no task, connection or fd
    left behind, and the proxy keeps serving."""
    proxy = await start_proxy(base_config(upstream.base_url))
    before = await warm(proxy, upstream)
    upstream.mode = "stall"  # two chunks, then an hour of silence
    body = {"model": MODEL, "messages": MESSAGES, "stream": True}
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
        status, _, raw = await chat(s, proxy.url, body)
    assert status == 200 and raw.endswith(b"data: [DONE]\n\n")


async def test_client_gone_while_waiting_for_headers_nothing_leaks(upstream: FakeUpstream,
                                                                   start_proxy: Any) -> None:
    proxy = await start_proxy(base_config(upstream.base_url))
    before = await warm(proxy, upstream)
    upstream.mode = "hang"
    async with aiohttp.ClientSession() as s:
        pending = [asyncio.ensure_future(chat(s, proxy.url)) for _ in range(10)]
        assert await eventually(lambda: upstream.active == 10)
        for task in pending:
            task.cancel()
        await asyncio.gather(*pending, return_exceptions=True)
    assert await eventually(lambda: upstream.cancelled == 10)
    await settle(proxy, upstream, before)


async def test_client_gone_from_a_relayed_stream_nothing_leaks(start_proxy: Any) -> None:
    """The generic /v1/* relay: a client leaving a stream closes the upstream request too."""
    slow = await SlowStreamUpstream(chunks=3, interval=0.01).start()
    try:
        proxy = await start_proxy(base_config(slow.base_url))
        async with aiohttp.ClientSession() as s, s.get(proxy.url + "/v1/anything/stream") as r:
            assert r.status == 200  # warm: one full relayed stream
            await r.read()
        before = Resources.take(proxy)
        slow.chunks, slow.interval = 50, 3600
        async with aiohttp.ClientSession() as s:
            r = await s.get(proxy.url + "/v1/anything/stream")
            assert r.status == 200
            await asyncio.wait_for(r.content.readuntil(b"\n\n"), 3)
            assert slow.active == 1
            r.close()
        assert await eventually(lambda: slow.active == 0 and slow.cancelled == 1)
        await settle(proxy, None, before)
    finally:
        await slow.stop()


async def test_client_gone_while_the_summariser_runs(upstream: FakeUpstream, start_proxy: Any) -> None:
    """The summary is shielded (others may wait for it); it still ends at its deadline, leaving nothing."""
    proxy = await start_proxy(summarising_config(upstream, summarizer={"timeout_seconds": 1,
                                                                       "retry_backoff_seconds": 0}))
    before = await warm(proxy, upstream)
    upstream.summary_mode = "hang"
    async with aiohttp.ClientSession() as s:
        task = asyncio.ensure_future(chat(s, proxy.url, {"model": SMALL, "messages": conversation(30)}))
        assert await eventually(lambda: len(upstream.summaries) == 1)
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
    started = time.monotonic()
    await settle(proxy, upstream, before, timeout=4)
    assert time.monotonic() - started < 2.5  # the summariser's deadline (1 s), not the upstream's hour


# --------------------------------------------------------------------------- the summariser hangs


SMALL = "small-model"


def summarising_config(upstream: FakeUpstream, **extra: Any) -> dict[str, Any]:
    cfg = base_config(
        upstream.base_url,
        models=[{"name": SMALL, "context_window": 8000, "max_output_tokens": 1000},
                {"name": MODEL, "context_window": 128000, "max_output_tokens": 16384}],
        summarizer_model=MODEL,
        context_manager={"type": "summarising", "params": {"keep_turns": 4}},
        summarizer={"retry_backoff_seconds": 0, "timeout_seconds": 2, "max_summary_tokens": 300},
    )
    cfg.update(extra)
    return cfg


def conversation(turns: int, tag: str = "") -> list[dict[str, Any]]:
    messages: list[dict[str, Any]] = [{"role": "system", "content": "You are a travel agent assistant."}]
    for i in range(turns - 1):
        messages += [
            {"role": "user", "content": f"{tag}Turn {i}: please check booking ZX{i}Q and its seat."},
            {"role": "assistant", "content": f"Booking ZX{i}Q: seat 14C, price 412.{i % 60:02d} USD. " * 12},
        ]
    messages.append({"role": "user", "content": f"Turn {turns - 1}: anything else?"})
    return messages


@pytest.mark.parametrize("timeout", [0.5, 1.0])
async def test_hanging_summariser_meets_its_deadline(upstream: FakeUpstream, start_proxy: Any,
                                                     timeout: float) -> None:
    """summarizer.timeout_seconds bounds the wait; then the failure path: served by the trimmer, 'failed'."""
    proxy = await start_proxy(summarising_config(upstream, summarizer={"timeout_seconds": timeout,
                                                                       "retry_backoff_seconds": 0}))
    async with aiohttp.ClientSession() as s:
        await chat(s, proxy.url)  # loads the tokenizer: the timing below is the summariser's alone
        upstream.summary_mode = "hang"
        started = time.monotonic()
        status, headers, raw = await chat(s, proxy.url, {"model": SMALL, "messages": conversation(40)})
        elapsed = time.monotonic() - started
    assert status == 200, raw[:300]
    assert headers["x-ctxproxy-summary"] == "failed"
    assert int(headers["x-ctxproxy-tokens-out"]) <= 8000 - 1000 - 800
    assert timeout <= elapsed < timeout + 1.0, elapsed
    assert len(upstream.chat) == 2  # the warm-up, then this request


async def test_hanging_summariser_concurrent_requests_share_one_deadline(upstream: FakeUpstream,
                                                                         start_proxy: Any) -> None:
    proxy = await start_proxy(summarising_config(upstream, summarizer={"timeout_seconds": 1,
                                                                       "retry_backoff_seconds": 0}))
    async with aiohttp.ClientSession() as s:
        await chat(s, proxy.url)  # loads the tokenizer: the timing below is the summariser's alone
        upstream.summary_mode = "hang"
        started = time.monotonic()
        results = await asyncio.gather(*(chat(s, proxy.url, {"model": SMALL, "messages": conversation(40)})
                                         for _ in range(10)))
        elapsed = time.monotonic() - started
    assert [r[0] for r in results] == [200] * 10
    assert {r[1]["x-ctxproxy-summary"] for r in results} == {"failed"}
    assert len(upstream.summaries) == 1  # single flight: one call, one deadline
    assert elapsed < 2.5


async def test_hanging_summariser_with_on_error_fail_is_502_at_the_deadline(upstream: FakeUpstream,
                                                                            start_proxy: Any) -> None:
    proxy = await start_proxy(summarising_config(upstream, on_summarizer_error="fail",
                                                 summarizer={"timeout_seconds": 0.5, "retry_backoff_seconds": 0}))
    async with aiohttp.ClientSession() as s:
        await chat(s, proxy.url)  # loads the tokenizer: the timing below is the summariser's alone
        upstream.summary_mode = "hang"
        started = time.monotonic()
        status, _, raw = await chat(s, proxy.url, {"model": SMALL, "messages": conversation(40)})
    assert time.monotonic() - started < 1.5
    assert status == 502
    assert openai_error(raw)["code"] == "summarizer_failed"
    assert len(upstream.chat) == 1  # the warm-up only: the refused request was never forwarded


# --------------------------------------------------------------------------- the disk cache breaks


CACHE_WARNING = re.compile(r"cache backend 'disk': \w+ failed")


async def _metric(proxy: RunningProxy, name: str) -> float:
    async with aiohttp.ClientSession() as s, s.get(proxy.url + "/metrics") as r:
        text = await r.text()
    total = 0.0
    for line in text.splitlines():
        if line.startswith(name):
            total += float(line.rsplit(" ", 1)[1])
    return total


async def _three_summarised_requests(proxy: RunningProxy) -> list[str]:
    out = []
    async with aiohttp.ClientSession() as s:
        for n in (40, 41, 42):
            status, headers, raw = await chat(s, proxy.url, {"model": SMALL, "messages": conversation(n)})
            assert status == 200, raw[:300]
            assert int(headers["x-ctxproxy-tokens-out"]) <= 8000 - 1000 - 800
            out.append(headers["x-ctxproxy-summary"])
    return out


def _cache_warnings(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records
            if r.name == "ctxproxy.cache" and r.levelno >= logging.WARNING and CACHE_WARNING.search(r.getMessage())]


async def _assert_served_counted_logged_once(proxy: RunningProxy, caplog: pytest.LogCaptureFixture,
                                             errors: int = 3) -> None:
    statuses = await _three_summarised_requests(proxy)
    assert set(statuses) <= {"waited", "reused"}, statuses  # it waited for the summary it needed
    assert await _metric(proxy, "ctxproxy_cache_errors_total") >= errors
    warnings = _cache_warnings(caplog)
    assert len(warnings) == 1, warnings


async def test_cache_directory_unusable(upstream: FakeUpstream, start_proxy: Any, tmp_path: Path,
                                        caplog: pytest.LogCaptureFixture) -> None:
    # we may be root, for whom chmod 000 is no obstacle: put the cache directory "under" a regular file
    blocker = tmp_path / "not-a-directory"
    blocker.write_text("x")
    caplog.set_level(logging.DEBUG)
    proxy = await start_proxy(summarising_config(upstream, cache={"backend": "disk", "path": str(blocker / "c")}))
    await _assert_served_counted_logged_once(proxy, caplog)
    async with aiohttp.ClientSession() as s, s.get(proxy.url + "/readyz") as r:
        assert r.status == 503
        assert (await r.json())["cache"] == "unavailable"


async def test_cache_database_corrupt_at_start(upstream: FakeUpstream, start_proxy: Any, tmp_path: Path,
                                               caplog: pytest.LogCaptureFixture) -> None:
    path = tmp_path / "cache"
    path.mkdir(mode=0o700)
    (path / "cache.db").write_bytes(os.urandom(64 * 1024))
    caplog.set_level(logging.DEBUG)
    proxy = await start_proxy(summarising_config(upstream, cache={"backend": "disk", "path": str(path)}))
    await _assert_served_counted_logged_once(proxy, caplog)
    # removing the corrupt file heals the cache without a restart
    for name in os.listdir(path):
        os.unlink(path / name)
    statuses = await _three_summarised_requests(proxy)
    assert statuses[-1] == "reused"
    assert any("recovered" in r.getMessage() for r in caplog.records if r.name == "ctxproxy.cache")


async def test_cache_database_corrupted_while_running(upstream: FakeUpstream, start_proxy: Any, tmp_path: Path,
                                                      caplog: pytest.LogCaptureFixture) -> None:
    path = tmp_path / "cache"
    caplog.set_level(logging.DEBUG)
    proxy = await start_proxy(summarising_config(upstream, cache={"backend": "disk", "path": str(path)}))
    async with aiohttp.ClientSession() as s:
        status, headers, _ = await chat(s, proxy.url, {"model": SMALL, "messages": conversation(40)})
    assert (status, headers["x-ctxproxy-summary"]) == (200, "waited")
    for name in os.listdir(path):  # garbage over the database and its WAL while the proxy has them open
        with open(path / name, "r+b") as f:
            size = max(f.seek(0, 2), 4096)
            f.seek(0)
            f.write(os.urandom(size))
    async with aiohttp.ClientSession() as s:
        for n in (50, 51, 52):
            status, headers, raw = await chat(s, proxy.url, {"model": SMALL, "messages": conversation(n)})
            assert status == 200, raw[:300]
    assert await _metric(proxy, "ctxproxy_cache_errors_total") >= 1
    assert len(_cache_warnings(caplog)) == 1, _cache_warnings(caplog)


async def test_cache_database_full(upstream: FakeUpstream, start_proxy: Any, tmp_path: Path,
                                   caplog: pytest.LogCaptureFixture) -> None:
    """SQLITE_FULL, the error a full disk gives: the database is filled up to a page limit it may not pass."""
    import diskcache

    from proxy.store.disk import _JSONBytesDisk

    path = tmp_path / "cache"
    stock = diskcache.Cache(str(path), disk=_JSONBytesDisk)
    pages = stock._sql("PRAGMA page_count").fetchall()[0][0] + 4
    # diskcache applies stored sqlite_* settings as pragmas at every open: the limit holds for the proxy too
    stock._sql("INSERT INTO Settings VALUES ('sqlite_max_page_count', ?)", (pages,))
    stock._sql(f"PRAGMA max_page_count = {pages}")
    for i in range(100_000):  # fill every page
        try:
            stock.set(f"filler-{i}", b"{}")
        except sqlite3.OperationalError as exc:
            assert "full" in str(exc)
            break
    stock.close()
    caplog.set_level(logging.DEBUG)
    proxy = await start_proxy(summarising_config(upstream, cache={"backend": "disk", "path": str(path)}))
    # the first request's lock and write fail; the others reuse its summary from the process's memory
    await _assert_served_counted_logged_once(proxy, caplog, errors=2)
    ops = await _metric_labels(proxy, "ctxproxy_cache_errors_total")
    assert ops.get("set", 0) >= 1 and ops.get("get", 0) == 0, ops  # reads work, writes fail


async def _metric_labels(proxy: RunningProxy, name: str) -> dict[str, float]:
    async with aiohttp.ClientSession() as s, s.get(proxy.url + "/metrics") as r:
        text = await r.text()
    out: dict[str, float] = {}
    for m in re.finditer(name + r'\{operation="(\w+)"\} (\S+)', text):
        out[m.group(1)] = float(m.group(2))
    return out


async def test_cache_size_limit_tiny(upstream: FakeUpstream, start_proxy: Any, tmp_path: Path,
                                     caplog: pytest.LogCaptureFixture) -> None:
    """size_limit_mb 1, and the cache already holds 3 MB: diskcache evicts the oldest entries instead of
    failing -- served, the new summary is stored and reused, no errors, and the file stays bounded."""
    import diskcache

    from proxy.store.disk import _JSONBytesDisk

    path = tmp_path / "cache"
    stock = diskcache.Cache(str(path), disk=_JSONBytesDisk)
    for i in range(60):
        stock.set(f"filler-{i}", b'{"x": "' + b"f" * 50_000 + b'"}')
    stock.close()
    caplog.set_level(logging.DEBUG)
    proxy = await start_proxy(summarising_config(upstream, cache={"backend": "disk", "path": str(path),
                                                                  "size_limit_mb": 1}))
    statuses = await _three_summarised_requests(proxy)
    assert statuses[0] == "waited" and statuses[-1] == "reused", statuses
    assert await _metric(proxy, "ctxproxy_cache_errors_total") == 0
    assert not _cache_warnings(caplog)
    await proxy.runner.cleanup()
    stock = diskcache.Cache(str(path), disk=_JSONBytesDisk)
    try:
        assert stock.volume() < 4 * 1024 * 1024
        assert sum(1 for k in stock.iterkeys() if str(k).startswith("filler-")) < 60  # culled
    finally:
        stock.close()


# --------------------------------------------------------------------------- a raw TCP upstream misbehaving


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


@pytest.mark.parametrize(("mode", "stream", "status", "code"), RAW_FAULTS, ids=[f[0] for f in RAW_FAULTS])
async def test_raw_upstream_faults(start_proxy: Any, mode: str, stream: bool, status: int, code: str) -> None:
    raw_up = await RawUpstream(mode).start()
    try:
        cfg = base_config(raw_up.url)
        cfg["server"] = {"first_byte_timeout": 0.5, "idle_timeout": 0.5}
        proxy = await start_proxy(cfg)
        async with aiohttp.ClientSession() as s:
            started = time.monotonic()
            got, headers, raw = await chat(s, proxy.url, {"model": MODEL, "messages": MESSAGES, "stream": stream})
            elapsed = time.monotonic() - started
        assert elapsed < 3
        assert got == status, raw[:300]
        if stream:
            events = sse_data(raw)
            assert b"[DONE]" not in events
            err = json.loads(events[-1])["error"]
        else:
            err = openai_error(raw)
            assert headers["x-request-id"]
        # (a chunk-framing error is seen as a stall: the client's parser drops the connection's data)
        assert err["code"] == code or (mode == "bad_chunked_stream" and err["code"] == "upstream_timeout")
        assert raw_up.connections == 1  # no retry behind the client's back
        # the broken connection is not kept for reuse
        assert await eventually(lambda: Resources.take(proxy).acquired == 0)
    finally:
        await raw_up.stop()


@pytest.mark.parametrize("mode", ["close_at_once", "garbage", "silent", "short_body", "stall_body"])
async def test_raw_upstream_faults_on_the_relay(start_proxy: Any, mode: str) -> None:
    """Any other /v1/* path: failures before the answer are 502/504; after it started, the client's answer is
    cut short (never a clean end) and the proxy stays up."""
    raw_up = await RawUpstream(mode).start()
    try:
        cfg = base_config(raw_up.url)
        cfg["server"] = {"first_byte_timeout": 0.5, "idle_timeout": 0.5}
        proxy = await start_proxy(cfg)
        async with aiohttp.ClientSession() as s:
            started = time.monotonic()
            async with s.get(proxy.url + "/v1/files/file-1/content") as r:
                status = r.status
                try:
                    raw = await r.read()
                    complete = True
                except aiohttp.ClientPayloadError:
                    raw, complete = b"", False
            assert time.monotonic() - started < 3
        if mode in ("short_body", "stall_body"):
            assert status == 200 and not complete  # headers were relayed, then the body was cut
        else:
            assert status == (504 if mode == "silent" else 502)
            openai_error(raw)
        assert await eventually(lambda: Resources.take(proxy).acquired == 0)
    finally:
        await raw_up.stop()


# --------------------------------------------------------------------------- a slow streaming upstream


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
                chunk = {"id": "c", "object": "chat.completion.chunk", "created": 0, "model": MODEL,
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
    body = {"model": MODEL, "messages": MESSAGES, "stream": True}
    async with session.post(url + "/v1/chat/completions", json=body) as r:
        assert r.status == 200
        return await r.read()


@pytest.fixture
async def slow_upstream() -> AsyncIterator[SlowStreamUpstream]:
    slow = await SlowStreamUpstream(chunks=10, interval=0.1).start()
    yield slow
    await slow.stop()


async def test_slow_streams_relayed_chunk_by_chunk(slow_upstream: SlowStreamUpstream, start_proxy: Any) -> None:
    """A stream that takes 1 s arrives piece by piece (first chunk long before the end), complete."""
    proxy = await start_proxy(base_config(slow_upstream.base_url))
    body = {"model": MODEL, "messages": MESSAGES, "stream": True}
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

