"""proxy.upstream.client from the outside: real sockets on 127.0.0.1 and scripted servers that misbehave.

Raw servers (``asyncio.start_server``) say exactly the bytes a test needs; the parser's property feeds
``_Connection.data_received`` directly (the seam the socket stands in for). Faults found are strict xfails.
"""

from __future__ import annotations

import asyncio
import gzip
import random
import socket
import time
import zlib
from collections.abc import Awaitable, Callable
from itertools import pairwise
from typing import Any, TypeAlias
from unittest.mock import Mock

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from proxy.upstream.client import (
    HIGH_WATER,
    ClientError,
    ConnectFailed,
    Disconnected,
    HTTPClient,
    InvalidResponse,
    _Connection,
    _Origin,
)

R: TypeAlias = asyncio.StreamReader
W: TypeAlias = asyncio.StreamWriter
Handler = Callable[[R, W, int], Awaitable[None]]


def ok(body: bytes = b"ok", *extra: str, version: str = "1.1") -> bytes:
    head = "\r\n".join([f"HTTP/{version} 200 OK", f"Content-Length: {len(body)}", *extra])
    return (head + "\r\n\r\n").encode() + body


def chunked(*chunks: bytes, extra: str = "") -> bytes:
    return (b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n" + extra.encode() + b"\r\n"
            + b"".join(b"%x\r\n%s\r\n" % (len(c), c) for c in chunks) + b"0\r\n\r\n")


async def read_request(reader: R) -> tuple[bytes, bytes] | None:
    """A request's head and body, or None at the connection's end."""
    try:
        head = await reader.readuntil(b"\r\n\r\n")
    except (asyncio.IncompleteReadError, ConnectionError):
        return None
    lengths = [v for k, _, v in (line.partition(b":") for line in head.split(b"\r\n"))
               if k.lower() == b"content-length"]
    return head, await reader.readexactly(int(lengths[0]) if lengths else 0)


class Raw:
    """A scripted server: ``handler(reader, writer, n)`` runs for its n-th connection (from 0)."""

    def __init__(self, handler: Handler) -> None:
        self.handler = handler
        self.peers: list[Any] = []
        self.open = self.max_open = 0
        self.changed = asyncio.Event()
        self._tasks: set[asyncio.Task[Any]] = set()

    async def __aenter__(self) -> Raw:
        self.server = await asyncio.start_server(self._handle, "127.0.0.1", 0)
        self.port = self.server.sockets[0].getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}/v1/x"
        return self

    async def __aexit__(self, *exc: object) -> None:
        self.server.close()
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)

    async def _handle(self, reader: R, writer: W) -> None:
        self._tasks.add(asyncio.current_task())  # type: ignore[arg-type]
        n = len(self.peers)
        self.peers.append(writer.get_extra_info("peername"))
        self.open += 1
        self.max_open = max(self.max_open, self.open)
        try:
            await self.handler(reader, writer, n)
        except (ConnectionError, asyncio.IncompleteReadError, asyncio.CancelledError):
            pass  # (cancelled: the test is over; a cancelled handler would be logged as an error)
        finally:
            self.open -= 1
            self.changed.set()
            writer.close()

    async def until_all_closed(self) -> None:
        while self.open:
            self.changed.clear()
            await self.changed.wait()


def replies(answer: bytes | Callable[[bytes, bytes], bytes], log: list[Any] | None = None) -> Handler:
    """Answer every request on every connection (keep-alive as the answer says)."""
    async def handler(reader: R, writer: W, n: int) -> None:
        while (request := await read_request(reader)) is not None:
            if log is not None:
                log.append((n, *request))
            writer.write(answer(*request) if callable(answer) else answer)
            await writer.drain()
    return handler


def once(answer: bytes, close: bool = False) -> Handler:
    """Say ``answer`` to the first request, then close (or wait for the client to)."""
    async def handler(reader: R, writer: W, n: int) -> None:
        await read_request(reader)
        writer.write(answer)
        await writer.drain()
        if not close:
            await reader.read()
    return handler


async def get(client: HTTPClient, url: str, method: str = "GET", **kw: Any) -> tuple[int, bytes]:
    async with await client.request(method, url, **kw) as response:
        return response.status, await response.read()


# --------------------------------------------------------------------------- framing and decoding


BODY = bytes(range(256)) * 40
FRAMINGS = {
    "length": ok(BODY),
    "chunked": b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n5;name=value;q=\"x\"\r\n" + BODY[:5] + b"\r\n"
               + b"%X\r\n" % (len(BODY) - 5) + BODY[5:] + b"\r\n0\r\nX-Trailer: t\r\nX-Other: o\r\n\r\n",
    "http/1.0": b"HTTP/1.0 200 OK\r\nX-A: a\r\n\r\n" + BODY,
    "no length": b"HTTP/1.1 200 OK\r\nX-A: a\r\n\r\n" + BODY,
}


@pytest.mark.parametrize("wire", FRAMINGS.values(), ids=FRAMINGS.keys())
async def test_framings_with_the_answer_written_in_pieces(wire: bytes) -> None:
    async def handler(reader: R, writer: W, n: int) -> None:
        await read_request(reader)
        for i in range(0, len(wire), 997):
            writer.write(wire[i:i + 997])
            await writer.drain()
            await asyncio.sleep(0)
        if b"Length" in wire or b"chunked" in wire:
            await reader.read()  # (else the close ends the body)

    async with Raw(handler) as server, HTTPClient() as client:
        assert await get(client, server.url) == (200, BODY)


NAMES = st.text("abcdefghijklmnopqrstuvwxyz-", min_size=1, max_size=8).map(lambda s: "X-" + s)
VALUES = st.text(st.characters(min_codepoint=0x21, max_codepoint=0x7E), max_size=10)


@st.composite
def answers(draw: st.DrawFn) -> tuple[bytes, int, list[tuple[str, str]], bytes, str]:
    status = draw(st.sampled_from([200, 201, 299, 400, 404, 500, 599]))
    headers = draw(st.lists(st.tuples(NAMES, VALUES), max_size=4))
    body = draw(st.binary(max_size=300))
    framing = draw(st.sampled_from(["length", "chunked", "close"]))
    wire = gzip.compress(body) if draw(st.booleans()) else body
    if wire is not body:
        headers.append(("Content-Encoding", "gzip"))
    payload = wire
    if framing == "length":
        headers.append(("Content-Length", str(len(wire))))
    elif framing == "chunked":
        headers.append(("Transfer-Encoding", "chunked"))
        pieces, at = [], 0
        for size in [*draw(st.lists(st.integers(1, 64), max_size=12)), len(wire)]:
            pieces.append(wire[at:at + size])
            at += size
        ext = draw(st.sampled_from([b"", b";a=b", b' ; x="y z"']))
        payload = b"".join(b"%x%s\r\n%s\r\n" % (len(p), ext, p) for p in pieces if p)
        payload += b"0\r\n" + draw(st.sampled_from([b"", b"X-T: 1\r\n", b"A: b\r\nC: d\r\n"])) + b"\r\n"
    prefix = draw(st.sampled_from([b"", b"HTTP/1.1 100 Continue\r\n\r\n",
                                   b"HTTP/1.1 103 Early Hints\r\nLink: </s.css>; rel=preload\r\n\r\n"]))
    version = "1.0" if framing == "close" and draw(st.booleans()) else "1.1"
    head = f"HTTP/{version} {status} Some Reason\r\n" + "".join(f"{n}: {v}\r\n" for n, v in headers)
    return prefix + head.encode() + b"\r\n" + payload, status, headers, body, framing


def parse_in_pieces(wire: bytes, cuts: list[int], close: bool) -> tuple[int, list[tuple[str, str]], bytes, bool]:
    async def run() -> tuple[int, list[tuple[str, str]], bytes, bool]:
        connection = _Connection(_Origin(HTTPClient(), "http", "upstream.test", 80))
        connection.connection_made(Mock())  # a transport that takes anything
        head = connection.send("GET", b"GET / HTTP/1.1\r\n\r\n", None)
        points = [0, *sorted({c % (len(wire) + 1) for c in cuts}), len(wire)]
        for a, b in pairwise(points):
            if b > a:
                connection.data_received(wire[a:b])
        if close:
            connection.connection_lost(None)
        response = head.result()
        assert response.is_eof()
        return response.status, list(response.headers.items()), await response.read(), response.keep_alive
    return asyncio.run(run())


@settings(max_examples=50, deadline=None)
@given(answer=answers(), cuts=st.one_of(st.lists(st.integers(0, 2000), max_size=30), st.just(list(range(2000)))))
def test_any_split_of_a_valid_answer_parses_the_same(answer: Any, cuts: list[int]) -> None:
    wire, status, headers, body, framing = answer
    assert parse_in_pieces(wire, cuts, close=framing == "close") == (status, headers, body, framing != "close")


def raw_deflate(data: bytes) -> bytes:
    packer = zlib.compressobj(wbits=-15)
    return packer.compress(data) + packer.flush()


@pytest.mark.parametrize("coding", ["gzip", "deflate", "raw deflate", "x-gzip"])
async def test_compressed_bodies_are_decoded(coding: str) -> None:
    body = b"the same words again and again " * 500
    wire = {"deflate": zlib.compress(body), "raw deflate": raw_deflate(body)}.get(coding) \
        or gzip.compress(body)
    name = coding.split()[-1]
    async with Raw(replies(ok(wire, f"Content-Encoding: {name}"))) as server, HTTPClient() as client:
        assert await get(client, server.url) == (200, body)
    answer = chunked(wire[:7], wire[7:100], wire[100:], extra=f"Content-Encoding: {name}\r\n")
    async with Raw(replies(answer)) as server, HTTPClient() as client:
        assert await get(client, server.url) == (200, body)


# --------------------------------------------------------------------------- the pool


@pytest.mark.parametrize("answer, reused", [
    (ok(b"x", "Connection: close"), False), (ok(b"x", version="1.0"), False),
    (b"HTTP/1.1 200 OK\r\nConnection: keep-alive, close\r\nContent-Length: 1\r\n\r\nx", False),
    (b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\nContent-Length: 1\r\n\r\n1\r\nx\r\n0\r\n\r\n", False),
    (ok(b"x", "Connection: Keep-Alive", version="1.0"), True), (ok(b"x", "Connection: upgrade"), True)],
    ids=["close", "1.0", "keep-alive, close", "chunked and length", "1.0 keep-alive", "1.1"])
async def test_reuse_follows_the_answer(answer: bytes, reused: bool) -> None:
    async with Raw(replies(answer)) as server, HTTPClient() as client:
        for _ in range(3):
            assert await get(client, server.url) == (200, b"x")
            assert client.connections() == ((1, 1) if reused else (0, 0))
        assert len(server.peers) == (1 if reused else 3)


async def test_the_limit_holds_and_every_request_completes() -> None:
    async def slow(reader: R, writer: W, n: int) -> None:
        while await read_request(reader) is not None:
            await asyncio.sleep(0.01)
            writer.write(ok(b"done"))
            await writer.drain()

    async with Raw(slow) as server, HTTPClient(limit=2) as client:
        assert await asyncio.gather(*(get(client, server.url) for _ in range(6))) == [(200, b"done")] * 6
        assert server.max_open == 2 and len(server.peers) == 2 and client.connections() == (2, 2)
    async with HTTPClient(limit=1) as client:  # (the server is gone: refused, and every slot comes back)
        results = await asyncio.gather(*(client.request("GET", server.url) for _ in range(5)), return_exceptions=True)
        assert all(isinstance(r, ConnectFailed) for r in results) and client.connections() == (0, 0)


async def test_idle_connections_expire_after_keepalive() -> None:
    async with Raw(replies(ok())) as server, HTTPClient(keepalive=0.05) as client:
        await asyncio.gather(get(client, server.url), get(client, server.url))
        assert client.connections() == (2, 2)
        await asyncio.wait_for(server.until_all_closed(), 2)
        assert client.connections() == (0, 0)
        assert await get(client, server.url) == (200, b"ok")


async def closes_the_second_request(reader: R, writer: W, n: int) -> None:
    """Connection 0 answers one request, then closes on the next without answering; later ones answer."""
    await read_request(reader)
    writer.write(ok(b"one") if n == 0 else ok(b"two"))
    await writer.drain()
    await (read_request(reader) if n == 0 else reader.read())


@pytest.mark.parametrize("method", ["GET", "POST"])
async def test_a_stale_connection_resends_only_an_idempotent_request(method: str) -> None:
    async with Raw(closes_the_second_request) as server, HTTPClient() as client:
        assert await get(client, server.url) == (200, b"one")
        if method == "GET":
            assert await get(client, server.url) == (200, b"two")  # once more, on a new connection
        else:
            with pytest.raises(Disconnected):
                await client.request("POST", server.url, data=b"{}")
        assert len(server.peers) == (2 if method == "GET" else 1)


# --------------------------------------------------------------------------- invalid and cut answers

CHUNKED = b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n"
INVALID = {
    "not HTTP": b"220 smtp.example.com ESMTP ready\r\n\r\n",
    "status abc": b"HTTP/1.1 abc OK\r\n\r\n",
    "HTTP/2": b"HTTP/2 200 OK\r\n\r\n",
    "status 2000": b"HTTP/1.1 2000 OK\r\n\r\n",
    "head over 64 KiB": b"HTTP/1.1 200 OK\r\nX: " + b"a" * 70_000 + b"\r\n\r\n",
    "bare LF": b"HTTP/1.1 200 OK\r\nX: a\nb\r\nContent-Length: 0\r\n\r\n",
    "bare CR": b"HTTP/1.1 200 OK\r\nX: a\rb\r\nContent-Length: 0\r\n\r\n",
    "NUL": b"HTTP/1.1 200 OK\r\nX: a\x00b\r\nContent-Length: 0\r\n\r\n",
    "space before colon": b"HTTP/1.1 200 OK\r\nContent-Length : 5\r\n\r\nhello",
    "folded": b"HTTP/1.1 200 OK\r\n Folded: x\r\n\r\n",
    **{f"chunk size {size!r}": CHUNKED + size + b"\r\n" + b"x" * 16 + b"\r\n0\r\n\r\n"
       for size in [b"0x10", b"-1", b"1_0", b"+5", b"", b"g", b"1" + b"0" * 16]},
    "no CRLF after a chunk": CHUNKED + b"2\r\nabXY0\r\n\r\n",
    "endless size line": CHUNKED + b"1" * 70_000,
    "corrupt gzip": ok(gzip.compress(b"x" * 1000)[:12] + b"\xff" * 8 + gzip.compress(b"x" * 1000)[20:],
                       "Content-Encoding: gzip"),
}


@pytest.mark.parametrize("wire", INVALID.values(), ids=INVALID.keys())
async def test_invalid_answers_are_refused(wire: bytes) -> None:
    async with Raw(once(wire)) as server, HTTPClient() as client:
        with pytest.raises(InvalidResponse):
            response = await asyncio.wait_for(client.request("GET", server.url), 5)
            await response.read()
        assert client.connections() == (0, 0)


CUT = {"length": ok(b"0123456789")[:-4], "in chunk CRLF": chunked(b"abcdef", b"ghij")[:-7],
       "before last chunk": chunked(b"abcdef")[:-5], "huge chunk": CHUNKED + b"f" * 16 + b"\r\nabc",
       "in head": b"HTTP/1.1 200 OK\r\nContent-Le", "after 100": b"HTTP/1.1 100 Continue\r\n\r\n"}


@pytest.mark.parametrize("wire", CUT.values(), ids=CUT.keys())
async def test_a_close_before_the_answer_ends_is_disconnected(wire: bytes) -> None:
    async with Raw(once(wire, close=True)) as server, HTTPClient() as client:
        with pytest.raises(Disconnected):
            response = await client.request("GET", server.url)
            while await response.readany():
                pass
        with pytest.raises(Disconnected):
            response = await client.request("GET", server.url)
            await response.read()


# --------------------------------------------------------------------------- heads and bodies


async def test_heads_without_a_body_or_informational() -> None:
    def answer(head: bytes, body: bytes) -> bytes:
        if head.startswith(b"POST"):
            return (b"HTTP/1.1 100 Continue\r\n\r\nHTTP/1.1 103 Early Hints\r\nLink: </a.css>; rel=preload\r\n\r\n"
                    b"HTTP/1.1 201 Created\r\nX-Final: yes\r\nContent-Length: 3\r\n\r\nyes")
        if head.startswith(b"HEAD"):
            return b"HTTP/1.1 200 OK\r\nContent-Length: 1000\r\nContent-Type: text/plain\r\n\r\n"
        if b"/304" in head.split(b"\r\n")[0]:
            return b"HTTP/1.1 304 Not Modified\r\nETag: \"e\"\r\nContent-Length: 50\r\n\r\n"
        return b"HTTP/1.1 204 No Content\r\n\r\n"

    log: list[Any] = []
    async with Raw(replies(answer, log)) as server, HTTPClient() as client:
        for method, path, status in [("HEAD", "", 200), ("DELETE", "", 204), ("GET", "/304", 304), ("HEAD", "", 200)]:
            response = await client.request(method, server.url + path)
            assert response.status == status and response.is_eof() and await response.read() == b""
            response.release()
            assert client.connections() == (1, 1)
        response = await client.request("POST", server.url, data=b"{}")  # 100 and 103 before the answer
        assert (response.status, response.reason, response.headers["X-Final"]) == (201, "Created", "yes")
        assert "Link" not in response.headers and await response.read() == b"yes"
        response.release()
        assert len(server.peers) == 1 and len(log) == 5


async def test_a_request_given_up_closes_its_connection() -> None:
    async def silent_first(reader: R, writer: W, n: int) -> None:
        await (once(b"", close=False) if n == 0 else replies(ok()))(reader, writer, n)

    async with Raw(silent_first) as server, HTTPClient() as client:
        with pytest.raises(asyncio.TimeoutError):
            await asyncio.wait_for(client.request("GET", server.url), 0.05)
        assert client.connections() == (0, 0)
        await asyncio.wait_for(server.until_all_closed(), 2)  # the server saw the close
        assert await get(client, server.url) == (200, b"ok")


async def test_a_large_body_read_slowly_arrives_whole_and_in_order() -> None:
    body = b"".join(i.to_bytes(4, "big") for i in range(5 * 1024 * 1024 // 4))
    async with Raw(once(ok(body))) as server, HTTPClient() as client:
        response = await client.request("GET", server.url)
        pieces = []
        while piece := await response.readany():
            pieces.append(piece)
            await asyncio.sleep(0.002)
        assert b"".join(pieces) == body
        assert max(map(len, pieces)) <= HIGH_WATER + 256 * 1024  # reading paused above the high water mark
        response.release()
        assert client.connections() == (1, 1)


def request_heads(log: list[Any]) -> list[dict[str, str]]:
    return [{k.lower(): v.strip() for k, _, v in (line.partition(":") for line in head.decode().split("\r\n")[1:-2])}
            | {" line": head.decode().split("\r\n")[0]} for _, head, _ in log]


async def test_the_request_head() -> None:
    log: list[Any] = []
    async with Raw(replies(ok(), log)) as server, HTTPClient() as client:
        await get(client, server.url + "?a=1&b=2")
        await get(client, server.url, "POST", data=b"abc",
                  headers={"Content-Length": "99", "Transfer-Encoding": "chunked", "X-Mine": "m"})
        await get(client, server.url, "POST", data=b"{}", headers=[("Content-Type", "application/json")])
        await get(client, server.url, "POST", headers={"Accept": "text/event-stream", "Accept-Encoding": "identity"})
        await get(client, server.url, "GET", data=b"q")
        assert [b for _, _, b in log] == [b"", b"abc", b"{}", b"", b"q"]
        a, b, c, d, e = request_heads(log)
        assert a == {" line": "GET /v1/x?a=1&b=2 HTTP/1.1", "host": f"127.0.0.1:{server.port}", "accept": "*/*",
                     "accept-encoding": "gzip, deflate"}
        assert (b["content-length"], b["content-type"], b["x-mine"], "transfer-encoding" in b) == \
            ("3", "application/octet-stream", "m", False)
        assert (c["content-length"], c["content-type"]) == ("2", "application/json")
        assert (d["content-length"], d["accept"], d["accept-encoding"], "content-type" in d) == \
            ("0", "text/event-stream", "identity", False)
        assert (e["content-length"], "content-type" in e) == ("1", False)  # (a GET's body is not typed)

        loop = asyncio.get_running_loop()  # any host and port resolves to this server: the Host header is what is seen
        resolve = loop.getaddrinfo
        loop.getaddrinfo = lambda host, port, **kw: resolve("127.0.0.1", server.port, **kw)  # type: ignore
        try:
            await get(client, "http://Upstream.Example/x")
            await get(client, "http://[::1]:8080/y")
        finally:
            del loop.getaddrinfo
        assert [h["host"] for h in request_heads(log[5:])] == ["upstream.example", "[::1]:8080"]

        for bad in [{"X-A": "a\r\nX-Injected: 1"}, {"X-A": "a\nb"}, {"X-A\r\nB": "c"}]:
            with pytest.raises(ValueError):
                await client.request("GET", server.url, headers=bad)
        assert len(log) == 7 and len(server.peers) == 3  # (one connection per origin)


async def test_release_reuses_only_a_connection_read_to_its_end() -> None:
    body = b"x" * 600_000  # more than one socket read: not all here with the head
    async with Raw(replies(ok(body))) as server, HTTPClient() as client:
        assert client.connections() == (0, 0)
        response = await client.request("GET", server.url)
        assert client.connections() == (1, 0)
        response.release()  # the body not read: the connection cannot carry another request
        assert client.connections() == (0, 0)
        with pytest.raises(Disconnected):
            await response.read()
        for _ in range(2):
            assert await get(client, server.url) == (200, body)
            assert client.connections() == (1, 1)
        assert len(server.peers) == 2


# --------------------------------------------------------------------------- hostile and unusual


@pytest.mark.parametrize("stray", [ok(b"pipelined"), b"garbage\r\n\r\n", b"x"])
async def test_bytes_after_the_answer_end_the_connection_not_the_answer(stray: bytes) -> None:
    async with Raw(replies(ok(b"first") + stray)) as server, HTTPClient() as client:
        for _ in range(2):
            assert await get(client, server.url) == (200, b"first")
        assert len(server.peers) == 2


async def test_bytes_sent_to_an_idle_connection_close_it() -> None:
    idle = asyncio.Event()

    async def chatty(reader: R, writer: W, n: int) -> None:
        await read_request(reader)
        writer.write(ok())
        await idle.wait()
        writer.write(ok(b"unasked"))
        await reader.read()

    async with Raw(chatty) as server, HTTPClient() as client:
        assert await get(client, server.url) == (200, b"ok")
        assert client.connections() == (1, 1)
        idle.set()
        await asyncio.wait_for(server.until_all_closed(), 2)
        assert client.connections() == (0, 0)


@pytest.mark.parametrize("close", [False, True])
async def test_an_answer_before_the_request_body_is_read(close: bool) -> None:
    async def early(reader: R, writer: W, n: int) -> None:
        while True:
            head = await reader.readuntil(b"\r\n\r\n")
            writer.write(ok(b"early", *["Connection: close"] * close))  # before reading the body
            await writer.drain()
            if close:
                return  # (the body unread: the close is a reset)
            await reader.readexactly(int(head.lower().split(b"content-length:")[1].split(b"\r\n")[0]))

    async with Raw(early) as server, HTTPClient() as client:
        for _ in range(2):
            assert await get(client, server.url, "POST", data=b"z" * 3_000_000) == (200, b"early")
        assert len(server.peers) == 1 + close


@pytest.mark.parametrize("answer", [b"HTTP/1.1 200 OK\r\n\r\nuntil the end", ok(b"then eof")])
async def test_a_server_that_half_closes(answer: bytes) -> None:
    async def handler(reader: R, writer: W, n: int) -> None:
        await read_request(reader)
        writer.write(answer)
        writer.write_eof()
        await reader.read()

    async with Raw(handler) as server, HTTPClient() as client:
        for _ in range(2):
            assert await get(client, server.url) == (200, answer.rsplit(b"\n", 1)[1])
        assert len(server.peers) == 2


async def test_many_tiny_chunks_and_empty_chunked_bodies() -> None:
    letters = bytes(65 + i % 26 for i in range(20_000))
    async with Raw(replies(chunked(*[letters[i:i + 1] for i in range(len(letters))]))) as server, \
            HTTPClient() as client:
        assert await get(client, server.url) == (200, letters)
    async with Raw(replies(chunked())) as server, HTTPClient() as client:
        for _ in range(3):
            assert await get(client, server.url) == (200, b"")
        assert len(server.peers) == 1


async def test_cancellation_storms_at_the_limit_leak_no_slot() -> None:
    gate = asyncio.Event()

    async def gated(reader: R, writer: W, n: int) -> None:
        while await read_request(reader) is not None:
            await gate.wait()
            writer.write(ok())
            await writer.drain()

    async with Raw(gated) as server, HTTPClient(limit=2) as client:
        holders = [asyncio.create_task(client.request("GET", server.url)) for _ in range(2)]
        storm = [asyncio.create_task(get(client, server.url)) for _ in range(60)]
        timed = [asyncio.create_task(asyncio.wait_for(get(client, server.url), 0.01)) for _ in range(20)]
        patient = [asyncio.create_task(get(client, server.url)) for _ in range(4)]
        await asyncio.sleep(0)
        for i, task in enumerate(storm):
            task.cancel()
            if i % 10 == 0:
                await asyncio.sleep(0)
        assert all(isinstance(r, asyncio.TimeoutError) for r in await asyncio.gather(*timed, return_exceptions=True))
        gate.set()
        for response in await asyncio.gather(*holders):
            await response.read()
            response.release()
        assert await asyncio.wait_for(asyncio.gather(*patient), 5) == [(200, b"ok")] * 4
        assert await asyncio.wait_for(asyncio.gather(*(get(client, server.url) for _ in range(5))), 5) \
            == [(200, b"ok")] * 5
        assert server.max_open == 2 and client.connections() == (2, 2) and all(t.cancelled() for t in storm)


async def test_a_waiter_woken_then_cancelled_passes_its_slot_on() -> None:
    async with Raw(replies(ok())) as server, HTTPClient(limit=1) as client:
        held = await client.request("GET", server.url)
        await held.read()
        woken, next_ = asyncio.create_task(get(client, server.url)), asyncio.create_task(get(client, server.url))
        await asyncio.sleep(0)
        held.release()  # the slot goes to `woken` ...
        woken.cancel()  # ... which gives it up before it runs: `next_` must get it (no other release will come)
        assert await asyncio.wait_for(next_, 2) == (200, b"ok")


async def test_closing_the_client_with_requests_in_flight() -> None:
    second = asyncio.Event()

    async def hold(reader: R, writer: W, n: int) -> None:
        await read_request(reader)
        if n == 0:
            writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 10\r\n\r\nhalf")
        else:
            second.set()
        await reader.read()

    async with Raw(hold) as server:
        client = HTTPClient()
        reading = await client.request("GET", server.url)
        assert await reading.readany() == b"half"
        waiting = asyncio.create_task(client.request("POST", server.url, data=b"{}"))
        await second.wait()
        await client.close()
        with pytest.raises(Disconnected):
            await reading.read()
        with pytest.raises(Disconnected):
            await waiting
        with pytest.raises(ConnectFailed):
            await client.request("GET", server.url)
        assert client.connections() == (0, 0)


# --------------------------------------------------------------------------- faults found (strict xfails)


@pytest.mark.parametrize("length", [b"5\r\nContent-Length: 6", b"5, 6", b"+5", b"", b"0x5"])
async def test_an_invalid_content_length_is_refused(length: bytes) -> None:
    wire = b"HTTP/1.1 200 OK\r\nContent-Length: " + length + b"\r\n\r\nhello!"
    async with Raw(once(wire)) as server, HTTPClient() as client:
        with pytest.raises(InvalidResponse):
            await asyncio.wait_for(client.request("GET", server.url), 0.2)


DATA = random.Random(7).randbytes(20_000)


@pytest.mark.parametrize(("wire", "framing"), [
    (gzip.compress(DATA)[:-100], "length"), (gzip.compress(DATA)[:-100], "close"),
    (gzip.compress(DATA[:100]) + gzip.compress(DATA[100:]), "length"),
], ids=["cut, by length", "cut, by close", "two members"])
async def test_a_gzip_body_is_decoded_whole_or_refused(wire: bytes, framing: str) -> None:
    answer = ok(wire, "Content-Encoding: gzip") if framing == "length" else \
        b"HTTP/1.1 200 OK\r\nContent-Encoding: gzip\r\n\r\n" + wire
    async with Raw(once(answer, close=framing == "close")) as server, HTTPClient() as client:
        response = await client.request("GET", server.url)
        try:
            body = await response.read()
        except InvalidResponse:
            return
        assert body == DATA


async def test_deflate_whose_first_piece_is_one_byte() -> None:
    wire = zlib.compress(b"hello deflate " * 100)
    async with Raw(replies(chunked(wire[:1], wire[1:], extra="Content-Encoding: deflate\r\n"))) as server, \
            HTTPClient() as client:
        assert await get(client, server.url) == (200, b"hello deflate " * 100)


@pytest.mark.parametrize("case", ["connecting", "waiting for a slot", "re-sent"])
async def test_close_fails_every_request_in_flight(case: str) -> None:
    asked = asyncio.Event()

    async def handler(reader: R, writer: W, n: int) -> None:
        if n == 0 and case != "connecting":
            await read_request(reader)
            writer.write(ok(b"one"))
            await read_request(reader)
            asked.set()
            await reader.read()  # never answered
        else:
            await replies(ok(b"sent after close"))(reader, writer, n)

    async with Raw(handler) as server:
        client = HTTPClient(limit=1)
        if case != "connecting":
            assert await get(client, server.url) == (200, b"one")
            held = asyncio.create_task(client.request("GET" if case == "re-sent" else "POST", server.url))
            await asyncio.wait_for(asked.wait(), 2)
        task = held if case == "re-sent" else asyncio.create_task(get(client, server.url))
        await asyncio.sleep(0)  # (it is inside create_connection, or waiting for the one connection)
        await client.close()
        if case == "waiting for a slot":
            with pytest.raises(Disconnected):
                await held
        with pytest.raises(ClientError):
            await asyncio.wait_for(task, 2)  # (what it gets is "sent after close")
        assert len(server.peers) <= 1


async def test_decompression_respects_the_high_water_mark() -> None:
    packer = zlib.compressobj(9, zlib.DEFLATED, 31)
    bomb = packer.compress(bytes(32 * 1024 * 1024)) + packer.flush()
    async with Raw(replies(ok(bomb, "Content-Encoding: gzip"))) as server, HTTPClient() as client:
        response = await client.request("GET", server.url)
        sizes = []
        while piece := await response.readany():
            sizes.append(len(piece))
        response.release()
        assert sum(sizes) == 32 * 1024 * 1024 and max(sizes) <= 4 * HIGH_WATER


def test_chunk_parsing_is_linear_in_the_chunks_received_at_once() -> None:
    def parse_time(n: int, tries: int) -> float:
        wire, best = chunked(*[b"x"] * n), float("inf")
        for _ in range(tries):
            started = time.perf_counter()
            assert len(parse_in_pieces(wire, [], close=False)[2]) == n
            best = min(best, time.perf_counter() - started)
        return best

    # 12 KB and 192 KB of 1-byte chunks (less than one socket read): 16 times the chunks, linear ~16, quadratic ~60
    assert parse_time(32_000, 2) / parse_time(2_000, 3) < 32


@pytest.mark.parametrize("method, headers", [("GET /admin HTTP/1.1\r\nX-A: b\r\n\r\nGET", {}),
                                             ("POST", {"X Injected": "v"}), ("POST", {"": "v"})])
async def test_a_method_or_header_name_that_breaks_the_request_is_refused(method: str, headers: dict[str, str]) -> None:
    async with Raw(replies(ok())) as server, HTTPClient() as client:
        with pytest.raises(ValueError):
            await get(client, server.url, method, headers=headers)


# --------------------------------------------------------------------------- the end-to-end reviewer's findings


async def test_a_retry_goes_out_on_a_new_connection_even_at_the_limit() -> None:
    """An upstream that closes each connection just after its answer, without saying so: a GET that finds its
    reused connection closed is sent again on a new one, also when every slot is taken (limit 1)."""
    async def close_after(reader: R, writer: W, n: int) -> None:
        while await read_request(reader) is not None:
            await asyncio.sleep(0.002)
            writer.write(ok(b"done"))
            await writer.drain()
            await asyncio.sleep(0.001)
            return

    async with Raw(close_after) as server, HTTPClient(limit=1) as client:
        async def loop() -> list[int]:
            return [(await get(client, server.url))[0] for _ in range(15)]
        results = await asyncio.gather(*(loop() for _ in range(6)))
    assert all(status == 200 for statuses in results for status in statuses)


async def test_waiters_are_served_in_the_order_they_came() -> None:
    release = asyncio.Event()
    order: list[str] = []

    async def slow_first(reader: R, writer: W, n: int) -> None:
        first = True
        while await read_request(reader) is not None:
            if first:
                await release.wait()
                first = False
            writer.write(ok())
            await writer.drain()

    async with Raw(slow_first) as server, HTTPClient(limit=1) as client:
        async def one(name: str) -> None:
            await get(client, server.url)
            order.append(name)

        first = asyncio.create_task(one("A"))
        await asyncio.sleep(0.05)
        waiting = [asyncio.create_task(one(f"W{i}")) for i in range(1, 4)]
        await asyncio.sleep(0.05)
        release.set()
        await first  # its connection is freed now; a request that arrives now queues behind the waiters
        late = asyncio.create_task(one("R"))
        await asyncio.gather(*waiting, late)
    assert order == ["A", "W1", "W2", "W3", "R"]


async def test_credentials_in_the_url_are_sent_as_basic_auth() -> None:
    log: list[Any] = []
    async with Raw(replies(ok(), log)) as server, HTTPClient() as client:
        url = server.url.replace("http://", "http://user:p%40ss@")
        assert (await get(client, url))[0] == 200
        assert (await get(client, url, headers={"Authorization": "Bearer mine"}))[0] == 200
    assert b"\r\nAuthorization: Basic dXNlcjpwQHNz\r\n" in log[0][1]
    assert b"Bearer mine" in log[1][1] and b"Basic" not in log[1][1]


@pytest.mark.parametrize("wire", [
    b"HTTP/1.1 200 OK\nContent-Length: 2\n\nok",  # bare LF line ends (RFC 9112 section 2.2)
    b"HTTP/1.1 200 OK\r\nContent-Length: 2\n\r\nok",
    b"\r\nHTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok",  # an empty line before the status line
    b"HTTP/1.1 200 OK\r\nX-A: one\r\n  two\r\nContent-Length: 2\r\n\r\nok",  # obs-fold
], ids=["bare LF", "mixed", "leading CRLF", "obs-fold"])
async def test_lenient_heads_a_recipient_may_accept(wire: bytes) -> None:
    async with Raw(replies(wire)) as server, HTTPClient() as client:
        for _ in range(2):  # (and the connection is reused)
            response = await client.request("GET", server.url)
            assert (response.status, await response.read()) == (200, b"ok")
            response.release()
        assert len(server.peers) == 1
        if b"X-A" in wire:
            assert response.headers["X-A"] == "one two"


async def test_bytes_after_the_last_gzip_member_are_ignored() -> None:
    async with Raw(replies(ok(gzip.compress(b"hello") + b"\n", "Content-Encoding: gzip"))) as server, \
            HTTPClient() as client:
        assert await get(client, server.url) == (200, b"hello")


@pytest.mark.parametrize("coding", ["zstd", "br", "compress"])
async def test_an_encoding_not_asked_for_is_refused(coding: str) -> None:
    async with Raw(replies(ok(b"\x28\xb5\x2f\xfd garbage", f"Content-Encoding: {coding}"))) as server, \
            HTTPClient() as client:
        with pytest.raises(InvalidResponse):
            await client.request("GET", server.url)


async def test_a_target_with_a_space_or_non_ascii_is_percent_encoded() -> None:
    log: list[Any] = []
    async with Raw(replies(ok(), log)) as server, HTTPClient() as client:
        base = server.url.rsplit("/v1/x", 1)[0]
        assert (await get(client, base + "/my prefix/v1/x?q=%41")) == (200, b"ok")
        assert (await get(client, base + "/é/v1")) == (200, b"ok")
    assert log[0][1].startswith(b"GET /my%20prefix/v1/x?q=%41 HTTP/1.1\r\n")
    assert log[1][1].startswith(b"GET /%C3%A9/v1 HTTP/1.1\r\n")


async def test_an_unreachable_address_does_not_hold_up_the_next_one() -> None:
    """Happy Eyeballs (RFC 8305): a host whose first address never answers is reached on its second at once, not
    after the connect timeout (a blackholed IPv6 address in front of a working IPv4 one)."""
    async with Raw(replies(ok())) as server, HTTPClient(connect_timeout=5) as client:
        loop = asyncio.get_running_loop()
        # 192.0.2.1 (TEST-NET-1) is never answered; the second address is the server
        blackhole = (socket.AF_INET, socket.SOCK_STREAM, 6, "", ("192.0.2.1", server.port))
        good = (socket.AF_INET, socket.SOCK_STREAM, 6, "", ("127.0.0.1", server.port))

        async def resolve(host: str, port: int, **kw: Any) -> list[Any]:
            return [blackhole, good]

        loop.getaddrinfo = resolve  # type: ignore[method-assign,assignment]
        try:
            started = time.monotonic()
            assert await get(client, f"http://two-addresses.test:{server.port}/x") == (200, b"ok")
        finally:
            del loop.getaddrinfo
        assert time.monotonic() - started < 2


# --------------------------------------------------------------------------- the second end-to-end review


def test_empty_lines_before_an_answer_are_bounded() -> None:
    with pytest.raises(InvalidResponse):
        parse_in_pieces(b"\r\n" * 5000 + ok(), [], close=False)
    assert parse_in_pieces(b"\r\n\n" + ok(b"hi"), [], close=False)[2] == b"hi"


@pytest.mark.parametrize("wire", [
    b"HTTP/1.1 200 OK\nContent-Length: 12\n\r\nab\r\n\r\ncdefgh",  # a bare-LF head ended by CRLF, CRLFCRLF in its body
    b"HTTP/1.1 200 OK\r\nContent-Length: 12\r\n\nab\r\n\r\ncdefgh",
], ids=["LF then CRLF", "CRLF then LF"])
def test_a_head_ends_at_its_first_empty_line_however_the_bytes_arrive(wire: bytes) -> None:
    whole = parse_in_pieces(wire, [], close=False)
    assert whole[0] == 200 and whole[2] == b"ab\r\n\r\ncdefgh"
    for cut in range(1, len(wire)):
        assert parse_in_pieces(wire, [cut], close=False) == whole


@pytest.mark.parametrize("tail", [b"", b"\x00" * 8, b"\n"], ids=["two members", "zeros after", "newline after"])
def test_gzip_members_and_what_follows_them_however_the_bytes_arrive(tail: bytes) -> None:
    wire = gzip.compress(b"hello ") + (tail or gzip.compress(b"world"))
    answer = b"HTTP/1.1 200 OK\r\nContent-Encoding: gzip\r\nContent-Length: %d\r\n\r\n" % len(wire) + wire
    expected = b"hello world" if not tail else b"hello "
    for cut in range(len(answer) - len(wire), len(answer)):
        assert parse_in_pieces(answer, [cut], close=False)[2] == expected


async def test_a_free_connection_is_not_left_idle_while_a_request_waits() -> None:
    """Two connections freed in one tick while one request waits, and a second request arriving before the first
    waiter runs: both are served at once (the second release must not be lost)."""
    gate = asyncio.Event()

    async def handler(reader: R, writer: W, n: int) -> None:
        while (request := await read_request(reader)) is not None:
            if b"/slow" in request[0]:
                await asyncio.sleep(3)
            elif b"/gate" in request[0]:
                await gate.wait()
            writer.write(ok())
            await writer.drain()

    async with Raw(handler) as server, HTTPClient(limit=2) as client:
        base = server.url.rsplit("/", 1)[0]
        holders = [asyncio.create_task(client.request("GET", base + "/gate")) for _ in range(2)]
        await asyncio.sleep(0.05)
        waiter = asyncio.create_task(get(client, base + "/slow"))  # W: queued, then slow once served
        await asyncio.sleep(0.05)
        gate.set()
        responses = await asyncio.gather(*holders)
        for response in responses:  # both freed in one tick
            await response.read()
            response.release()
        started = time.monotonic()
        assert await get(client, base + "/fast") == (200, b"ok")  # N: arrives before W has run
        assert time.monotonic() - started < 1
        await waiter


async def test_credentials_belong_to_their_url() -> None:
    log: list[Any] = []
    async with Raw(replies(ok(), log)) as server, HTTPClient() as client:
        base = server.url.split("//", 1)[1]
        for url in (f"http://alice:a@{base}", f"http://bob:b@{base}", f"http://{base}", f"http://@{base}",
                    f"http://u:%FF@{base}"):
            await get(client, url)
    auth = [next((line for line in head.split(b"\r\n") if line.startswith(b"Authorization")), None)
            for _, head, _ in log]
    assert auth == [b"Authorization: Basic YWxpY2U6YQ==", b"Authorization: Basic Ym9iOmI=", None, None,
                    b"Authorization: Basic dTr/"]


# --------------------------------------------------------------------------- the head's timeout


async def test_the_timeout_covers_a_pooled_connection_and_closes_it() -> None:
    """A request on an idle pooled connection (no ``asyncio.timeout`` on that way) still times out when the head is
    late; the connection is closed, not handed to the next request, and a head arriving later is not taken for the
    next request's."""
    async def late_second(reader: R, writer: W, n: int) -> None:
        assert await read_request(reader) is not None
        writer.write(ok(b"first"))
        assert await read_request(reader) is not None  # the second request on the same connection: late
        await asyncio.sleep(0.3)
        writer.write(ok(b"late"))
        await reader.read()

    async with Raw(late_second) as server, HTTPClient() as client:
        assert await get(client, server.url) == (200, b"first")
        assert client.connections() == (1, 1)
        started = time.monotonic()
        with pytest.raises(asyncio.TimeoutError):
            await client.request("GET", server.url, timeout=0.05)
        assert time.monotonic() - started < 0.25
        assert client.connections() == (0, 0)
        assert await get(client, server.url, timeout=2) == (200, b"first")  # a new connection, its own answer
        assert len(server.peers) == 2


async def test_the_timeout_covers_the_wait_for_a_connection() -> None:
    release = asyncio.Event()

    async def slow(reader: R, writer: W, n: int) -> None:
        while await read_request(reader) is not None:
            await release.wait()
            writer.write(ok())

    async with Raw(slow) as server, HTTPClient(limit=1) as client:
        first = asyncio.ensure_future(get(client, server.url))
        await asyncio.sleep(0.05)
        with pytest.raises(asyncio.TimeoutError):  # queued behind the first, the only connection
            await client.request("GET", server.url, timeout=0.05)
        release.set()
        assert await first == (200, b"ok")
        assert await get(client, server.url, timeout=2) == (200, b"ok")
        assert server.max_open == 1


async def test_a_head_in_time_disarms_the_timeout() -> None:
    """The timer ends with the head: reading the body for longer than the timeout is not a timeout, and the
    connection goes back to the pool."""
    async def slow_body(reader: R, writer: W, n: int) -> None:
        while await read_request(reader) is not None:
            writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 4\r\n\r\nab")
            await writer.drain()
            await asyncio.sleep(0.2)
            writer.write(b"cd")

    async with Raw(slow_body) as server, HTTPClient() as client:
        for _ in range(2):
            assert await get(client, server.url, timeout=0.05) == (200, b"abcd")
        assert len(server.peers) == 1
