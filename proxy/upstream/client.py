"""A lean HTTP/1.1 client for the upstreams: pooled keep-alive connections on asyncio protocols.

ctxproxy sends every request to a handful of upstreams it knows, one origin each, and relays what comes back.
aiohttp's client did that with a general machine (cookie handling, redirects, proxies, tracing, multipart
payloads, a stream reader per response) whose bookkeeping cost more instructions than ctxproxy's whole
pass-through (the benchmark's small request: 0.33 M of the floor relay's 0.59 M). This one does only what an
upstream call needs:

- one pool per origin (scheme, host, port): at most ``limit`` connections, idle ones kept ``keepalive``
  seconds and reused newest first, one taken from the pool checked for a close it has already seen;
- a request written in one go (head and body), ``Host``, ``Content-Length``, ``Accept: */*`` and
  ``Accept-Encoding: gzip, deflate`` added unless given (and ``Content-Type: application/octet-stream`` for a
  body of a method that has one, as aiohttp did);
- the answer's head parsed strictly (``HTTP/1.0`` or ``1.1``, a three-digit status, ``name: value`` lines,
  64 KiB at most; informational 1xx heads skipped), its body framed by ``Transfer-Encoding: chunked``,
  ``Content-Length`` or the connection's close, decoded from gzip or deflate, and given to the reader as it
  comes (reading paused above ``HIGH_WATER`` bytes not yet read);
- a connection reused only after an answer read to its end that did not ask to close;
- a request of an idempotent method that finds its reused connection closed before any answer is sent once
  more on a new connection (a POST never is: the upstream may have acted on it).

Every failure is a ``ClientError``: ``ConnectTimeout``, ``ConnectFailed`` (refused, unresolvable, TLS),
``Disconnected`` (closed before the answer was complete) or ``InvalidResponse`` (not HTTP, bad framing,
a body that does not decode). Timeouts of the answer are the caller's (``proxy.core.deadline``).
"""

from __future__ import annotations

import asyncio
import base64
import collections
import re
import socket
import ssl
import zlib
from typing import Any
from urllib.parse import quote, unquote_to_bytes, urlsplit

import aiohappyeyeballs
from multidict import CIMultiDict, CIMultiDictProxy

from proxy.core.deadline import deadline, deadline_at

MAX_LEADING_LINES = 4  # empty lines accepted before an answer's status line
HEAD_LIMIT = 64 * 1024  # an answer's head (status line and headers), and a chunk's size line with its extensions
HIGH_WATER = 1024 * 1024  # bytes received and not yet read: reading from the socket pauses above this
IDEMPOTENT = frozenset({"GET", "HEAD", "OPTIONS", "TRACE", "PUT", "DELETE"})
NO_BODY_METHODS = frozenset({"GET", "HEAD", "OPTIONS", "TRACE", "CONNECT"})
_TOKEN = re.compile(rb"[!#$%&'*+\-.^_`|~0-9A-Za-z]+")
_TOKEN_STR = re.compile(r"[!#$%&'*+\-.^_`|~0-9A-Za-z]+")
_HEX = re.compile(rb"[0-9A-Fa-f]{1,16}")
_DIGITS = re.compile(r"[0-9]{1,18}")
_TARGET = re.compile(r"[!-~]+")  # visible ASCII: a request target as it may be sent


class ClientError(Exception):
    """A request that got no usable answer (``kind``: what failed, as error messages name it)."""

    def __init__(self, message: str, *, kind: str | None = None) -> None:
        super().__init__(message)
        self.kind = kind or type(self).__name__


class ConnectTimeout(ClientError):
    """No connection within the connect timeout."""


class ConnectFailed(ClientError):
    """No connection: refused, unresolvable, unreachable, or the TLS handshake failed."""


class Disconnected(ClientError):
    """The connection closed before the answer was complete."""


class InvalidResponse(ClientError):
    """What came back is not a valid HTTP/1.1 answer (status line, headers, framing or encoding)."""


class _Decoder:
    """gzip (one member or several) or deflate (zlib-wrapped, or raw as some servers send it), decoded as it is
    read, at most ``limit`` bytes at a time (a small body that inflates to a huge one is never inflated at once);
    a body that ends inside its compressed data is refused at its end (``finish``)."""

    def __init__(self, coding: str) -> None:
        self._gzip = coding in ("gzip", "x-gzip")
        self._z: Any = zlib.decompressobj(16 + zlib.MAX_WBITS) if self._gzip else None
        self._held = b""  # deflate: the first byte, until the second says whether it is zlib-wrapped
        self._tail = b""  # input not decoded yet (what the last limit left)
        self._fed = False
        self._between = b""  # gzip: bytes after a member's end, until two say whether another member follows
        self._ignoring = False  # gzip: what follows the last member is not part of the body

    @property
    def pending(self) -> bool:
        return bool(self._tail)

    def feed(self, data: bytes, limit: int) -> bytes:
        if not data:
            return b""
        self._fed = True
        if self._z is None:
            data, self._held = self._held + data, b""
            if len(data) < 2:
                self._held = data
                return b""
            wrapped = data[0] & 0x0F == 8 and (data[0] << 8 | data[1]) % 31 == 0
            self._z = zlib.decompressobj(zlib.MAX_WBITS if wrapped else -zlib.MAX_WBITS)
        if self._ignoring or (self._z.eof and not self._gzip):
            return b""  # (bytes after the compressed data are not part of the body)
        if self._z.eof:  # between two gzip members, or after the last
            data = self._between + data
            self._between = b""
            if not self._next_member(data):
                return b""
        self._tail += data
        return self.more(limit)

    def _next_member(self, data: bytes) -> bool:
        """After a gzip member: whether ``data`` starts another (else it is held, or ignored from here on)."""
        if data.startswith(b"\x1f\x8b"):
            self._z = zlib.decompressobj(16 + zlib.MAX_WBITS)
            return True
        if data == b"\x1f":
            self._between = data  # (the next byte decides)
        else:
            self._ignoring = True
        return False

    def more(self, limit: int) -> bytes:
        data, self._tail = self._tail, b""
        z = self._z
        try:
            out: bytes = z.decompress(data, limit)
        except zlib.error:
            raise InvalidResponse(f"The answer's body is not valid {'gzip' if self._gzip else 'deflate'}.") from None
        tail = z.unconsumed_tail
        if not tail and z.eof and self._gzip and z.unused_data and self._next_member(z.unused_data):
            tail = z.unused_data
        self._tail = tail
        return out

    def finish(self) -> None:
        if self._fed and (self._z is None or not self._z.eof or self._held):
            raise InvalidResponse("The answer's body ends inside its compressed data.")


class Response:
    """An answer: its status and headers at once, its body as it arrives (``readany``, ``read``).

    ``release()`` gives the connection back to its pool when the body was read to its end (else closes it);
    ``close()`` closes it (the upstream stops sending)."""

    def __init__(self, connection: _Connection, status: int, reason: str, headers: CIMultiDictProxy[str],
                 keep_alive: bool) -> None:
        self.connection: _Connection | None = connection
        self.status = status
        self.reason = reason
        self.headers = headers
        self.keep_alive = keep_alive
        self._chunks: collections.deque[bytes] = collections.deque()
        self._buffered = 0
        self._complete = False  # every byte of the body has arrived
        self._error: ClientError | None = None
        self._waiter: asyncio.Future[None] | None = None
        self._decoder: _Decoder | None = None  # the body's Content-Encoding, decoded as it is read

    @property
    def content_type(self) -> str:
        value = self.headers.get("Content-Type")
        if value is None:
            return "application/octet-stream"
        return value.split(";", 1)[0].strip().lower()

    # fed by the connection

    def _feed(self, data: bytes) -> None:
        if data:
            self._chunks.append(data)
            self._buffered += len(data)
            if self._buffered > HIGH_WATER and self.connection is not None:
                self.connection.pause()
            self._wake()

    def _end(self) -> None:
        self._complete = True
        self._wake()

    def _fail(self, error: ClientError) -> None:
        if not self._complete and self._error is None:
            self._error = error
        self._wake()

    def _wake(self) -> None:
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    # read by the caller

    def exception(self) -> ClientError | None:
        return self._error

    def is_eof(self) -> bool:
        """The whole body has arrived (it may not all be read yet)."""
        return self._complete

    def at_eof(self) -> bool:
        """The whole body has arrived and been read."""
        return self._complete and not self._chunks and (self._decoder is None or not self._decoder.pending)

    def read_nowait(self) -> bytes:
        """What has arrived and was not read yet (b"" when nothing); raises the connection's failure."""
        return self._next() or b""

    async def readany(self) -> bytes:
        """The next bytes of the body, waiting for them; b"" at its end."""
        while True:
            data = self._next()
            if data is not None:
                return data
            self._waiter = asyncio.get_running_loop().create_future()
            try:
                await self._waiter
            finally:
                self._waiter = None

    def _next(self) -> bytes | None:
        """The next bytes of the body that are here (decoded): b"" at its end, None when more must arrive."""
        try:
            return self._decoded()
        except InvalidResponse as exc:  # a body that does not decode: nothing more is read from its connection
            self._error = exc
            self._chunks.clear()
            self._decoder = None
            self.close()
            raise

    def _decoded(self) -> bytes | None:
        decoder = self._decoder
        while True:
            if decoder is not None and decoder.pending:
                data = decoder.more(HIGH_WATER)
            elif self._chunks:
                data = self._take() if decoder is None else decoder.feed(self._take(), HIGH_WATER)
            elif self._error is not None:
                raise self._error
            elif self._complete:
                if decoder is not None:
                    decoder.finish()
                return b""
            else:
                return None
            if data:
                return data

    def _take(self) -> bytes:
        chunks = self._chunks
        data = chunks.popleft() if len(chunks) == 1 else b"".join(chunks)
        chunks.clear()
        self._buffered = 0
        if self.connection is not None:
            self.connection.resume()
        return data

    async def read(self) -> bytes:
        """The whole body (what is left of it)."""
        parts = []
        while True:
            data = await self.readany()
            if not data:
                break
            parts.append(data)
        return parts[0] if len(parts) == 1 else b"".join(parts)

    def read_arrived(self) -> bytes:
        """``read`` of a body that has arrived whole (``is_eof``), without waiting."""
        if not self._complete:
            raise RuntimeError("read_arrived() before the whole body has arrived")
        parts = []
        while data := self._next():  # (never None once complete: b"" at the end)
            parts.append(data)
        return parts[0] if len(parts) == 1 else b"".join(parts)

    def release(self) -> None:
        """Done with the answer: its connection goes back to the pool if it can carry another request."""
        connection, self.connection = self.connection, None
        if connection is not None:
            if self.at_eof() and self._error is None and self.keep_alive:
                connection.finished()
            else:
                connection.close()

    def close(self) -> None:
        connection, self.connection = self.connection, None
        if connection is not None:
            connection.close()

    async def __aenter__(self) -> Response:
        return self

    async def __aexit__(self, *exc: object) -> None:
        self.release()


class _Connection(asyncio.Protocol):
    """One connection to an origin: writes a request, parses its answer as the bytes come."""

    def __init__(self, pool: _Origin) -> None:
        self.pool = pool
        self.transport: asyncio.Transport | None = None
        self.lost = False
        self.idle_since = 0.0
        self.used = False  # has carried a request before the current one
        self._paused = False
        self._buf = b""
        self._head: asyncio.Future[Response] | None = None  # the current request's, until its head arrives
        self._response: Response | None = None  # the answer whose body is arriving
        self._method = "GET"
        self.got_bytes = False  # the current request's answer has begun to arrive
        self._state = 0  # 0 head, 1 body by length, 2 chunk size, 3 chunk data, 4 chunk CRLF, 5 trailers, 6 close
        self._left = 0

    # asyncio.Protocol

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def data_received(self, data: bytes) -> None:
        self.got_bytes = True
        if self._head is None and self._response is None:
            # bytes nobody asked for: the connection cannot be trusted with another request
            self.close()
            return
        try:
            self._buf = self._buf + data if self._buf else data
            self._parse()
        except ClientError as exc:
            self._failed(exc)

    def connection_lost(self, exc: Exception | None) -> None:
        self.lost = True
        self.pool.forget(self)
        response = self._response
        if response is not None and self._state == 6:  # a body framed by the close has ended
            self._state = 0
            self._response = None
            response._end()
            return
        self._failed(Disconnected("The upstream closed the connection before its answer was complete."))

    # the pool's and the response's

    def send(self, method: str, head: bytes, body: bytes | None) -> asyncio.Future[Response]:
        assert self.transport is not None
        self._method = method
        self.got_bytes = False
        self._head = self.pool.loop.create_future()
        if body:
            self.transport.writelines((head, body))
        else:
            self.transport.write(head)
        return self._head

    def pause(self) -> None:
        if not self._paused and self.transport is not None and not self.lost:
            self._paused = True
            self.transport.pause_reading()

    def resume(self) -> None:
        if self._paused and self.transport is not None and not self.lost:
            self._paused = False
            self.transport.resume_reading()

    def finished(self) -> None:
        """The answer was read to its end and the connection may carry another request."""
        if self._buf or self.lost:  # bytes past the answer's end: not a connection to reuse
            self.close()
        else:
            self.pool.put(self)

    def close(self) -> None:
        self.lost = True
        self.pool.forget(self)
        if self.transport is not None:
            self.transport.abort()
        self._failed(Disconnected("The connection to the upstream was closed."))

    def _failed(self, error: ClientError) -> None:
        head, self._head = self._head, None
        if head is not None and not head.done():
            head.set_exception(error)
        response, self._response = self._response, None
        if response is not None:
            response._fail(error)
        if not self.lost:
            self.lost = True
            self.pool.forget(self)
            if self.transport is not None:
                self.transport.abort()

    # parsing

    def _parse(self) -> None:
        buf, pos = self._buf, 0
        try:
            while pos < len(buf):
                state = self._state
                if state == 0:
                    after = self._parse_head(buf, pos)
                elif state == 1 or state == 3:  # a body by its length, or a chunk's data
                    after = self._take_data(buf, pos)
                elif state == 6:  # a body framed by the close: all of it
                    self._deliver(buf[pos:] if pos else buf)
                    after = len(buf)
                else:
                    after = self._chunk_framing(buf, pos)
                if after < 0:  # the rest must arrive first
                    break
                pos = after
        finally:  # (what was parsed is dropped, also when the parse failed: the connection is closed then)
            self._buf = buf[pos:] if pos else buf

    def _parse_head(self, buf: bytes, pos: int) -> int:
        for _ in range(MAX_LEADING_LINES):  # empty lines before a status line (RFC 9112 §2.2), a few
            if buf.startswith(b"\r\n", pos):
                pos += 2
            elif buf.startswith(b"\n", pos):
                pos += 1
            else:
                break
        else:
            if buf.startswith(b"\n", pos) or buf.startswith(b"\r", pos):
                raise InvalidResponse("The answer starts with empty lines.")
        end, after = _head_end(buf, pos)
        if end < 0 or end - pos > HEAD_LIMIT:
            if len(buf) - pos > HEAD_LIMIT:
                raise InvalidResponse("The answer's head is too large.")
            return -1
        head = buf[pos:end]
        lines = head.split(b"\r\n")
        if head.count(b"\n") != len(lines) - 1 or head.count(b"\r") != len(lines) - 1 or b"\x00" in head:
            lines = _lenient_lines(head)
        parts = lines[0].split(b" ", 2)
        version = parts[0]
        if version not in (b"HTTP/1.1", b"HTTP/1.0") or len(parts) < 2 or len(parts[1]) != 3 \
                or not parts[1].isdigit() or parts[1][0] == 48:  # (48: "0")
            raise InvalidResponse("The answer's status line is not HTTP/1.1.")
        status = int(parts[1])
        fields: list[tuple[bytes, bytes]] = []
        for line in lines[1:]:
            name, colon, value = line.partition(b":")
            if colon and _TOKEN.fullmatch(name):
                fields.append((name, value.strip(b" \t")))
            elif line[:1] in (b" ", b"\t") and fields:  # obs-fold: the previous value goes on (RFC 9112 §5.2)
                fields[-1] = (fields[-1][0], fields[-1][1] + b" " + line.strip(b" \t"))
            else:
                raise InvalidResponse("The answer's headers are malformed.")
        headers: CIMultiDict[str] = CIMultiDict(
            [(name.decode("ascii"), value.decode("utf-8", "surrogateescape")) for name, value in fields])
        if 100 <= status < 200 and status != 101:
            return end + after  # informational (100 Continue, 103 Early Hints): the answer's own head follows
        response = Response(self, status, parts[2].decode("latin-1") if len(parts) > 2 else "",
                            CIMultiDictProxy(headers), _keep_alive(version, headers))
        self._frame(response, headers, status)  # (an invalid framing fails the request waiting for this head)
        head_future, self._head = self._head, None
        if head_future is None or head_future.done():  # the request was given up (timeout, cancelled)
            self.close()
            return -1
        head_future.set_result(response)
        return end + after

    def _frame(self, response: Response, headers: CIMultiDict[str], status: int) -> None:
        coding = headers.get("Content-Encoding", "").strip().lower()
        decoder = _Decoder(coding) if coding in ("gzip", "deflate", "x-gzip") else None
        if decoder is None and coding not in ("", "identity") and self._method != "HEAD" \
                and status not in (204, 304):  # (only gzip and deflate are asked for: Accept-Encoding)
            raise InvalidResponse(f"The answer is in an encoding that was not asked for ({coding[:40]}).")
        if self._method == "HEAD" or status in (204, 304) or status == 101:
            self._state = 0
            if status == 101:  # switching protocols, which nothing here asked for: not HTTP from here on
                response.keep_alive = False
            response._end()
            return
        codings = headers.getall("Transfer-Encoding", ())
        lengths = headers.getall("Content-Length", ())
        if codings:
            last = ",".join(codings).rsplit(",", 1)[-1].strip().lower()
            if last == "chunked":
                state = 2
                if lengths:  # both framings: chunked wins, the connection is not reused
                    response.keep_alive = False
            else:  # a body framed by the close (RFC 9112 §6.3)
                state, response.keep_alive = 6, False
        elif lengths:
            values = {value.strip() for joined in lengths for value in joined.split(",")}
            value = values.pop() if len(values) == 1 else ""
            if not _DIGITS.fullmatch(value):
                raise InvalidResponse("The answer's Content-Length is invalid.")
            self._left = int(value)
            if self._left == 0:
                self._state = 0
                response._end()
                return
            state = 1
        else:
            state, response.keep_alive = 6, False
        self._state, self._response, response._decoder = state, response, decoder

    def _take_data(self, buf: bytes, pos: int) -> int:
        left = self._left
        end = min(len(buf), pos + left)
        self._deliver(buf if pos == 0 and end == len(buf) else buf[pos:end])
        self._left = left - (end - pos)
        if self._left == 0:
            if self._state == 1:
                self._done()
            else:
                self._state = 4
        return end

    def _chunk_framing(self, buf: bytes, pos: int) -> int:
        state = self._state
        if state == 4:  # the CRLF after a chunk's data
            if len(buf) - pos < 2:
                return -1
            if buf[pos:pos + 2] != b"\r\n":
                raise InvalidResponse("The answer's chunked framing is invalid.")
            self._state = 2
            return pos + 2
        end = buf.find(b"\r\n", pos)  # a chunk's size line, or a trailer line
        if end < 0 or end - pos > HEAD_LIMIT:
            if len(buf) - pos > HEAD_LIMIT:
                raise InvalidResponse("The answer's chunked framing is too long.")
            return -1
        if state == 2:
            size = buf[pos:end].split(b";", 1)[0].strip(b" \t")
            if not _HEX.fullmatch(size):
                raise InvalidResponse("The answer's chunked framing is invalid.")
            self._left = int(size, 16)
            self._state = 3 if self._left else 5
        elif end == pos:  # the empty line after the trailers
            self._done()
        return end + 2

    def _deliver(self, data: bytes) -> None:
        if self._response is not None:
            self._response._feed(data)

    def _done(self) -> None:
        response, self._response = self._response, None
        self._state = 0
        if response is not None:
            response._end()


def _head_end(buf: bytes, pos: int) -> tuple[int, int]:
    """Where the head starting at ``pos`` ends (its last line's CR or LF) and how long its end is: at the first empty
    line, however its lines end (CRLF, or a bare LF as RFC 9112 §2.2 lets a recipient accept); (-1, 0): not yet."""
    crlf = buf.find(b"\n\r\n", pos)  # (an LF, then an empty line ended by CRLF)
    lf = buf.find(b"\n\n", pos, crlf + 1 if crlf >= 0 else len(buf))
    if lf >= 0:
        at, after = lf, 2
    elif crlf >= 0:
        at, after = crlf, 3
    else:
        return -1, 0
    if at > pos and buf[at - 1] == 13:  # the last line's CR
        return at - 1, after + 1
    return at, after


def _lenient_lines(head: bytes) -> list[bytes]:
    """A head's lines split at LF, each without the CR before it; any other CR, or a NUL, is refused."""
    lines = [line[:-1] if line.endswith(b"\r") else line for line in head.split(b"\n")]
    if any(b"\r" in line or b"\x00" in line for line in lines):
        raise InvalidResponse("The answer's head has a stray CR or NUL.")
    return lines


def _keep_alive(version: bytes, headers: CIMultiDict[str]) -> bool:
    tokens = {token.strip().lower() for value in headers.getall("Connection", ()) for token in value.split(",")}
    if version == b"HTTP/1.0":
        return "keep-alive" in tokens
    return "close" not in tokens


class _Origin:
    """The pool of one origin's connections."""

    def __init__(self, client: HTTPClient, scheme: str, host: str, port: int) -> None:
        self.client = client
        self.loop = asyncio.get_running_loop()  # (its connections' loop; asked once, not per request)
        self.host, self.port = host, port
        self.ssl: ssl.SSLContext | None = client.ssl_context() if scheme == "https" else None
        default = 443 if scheme == "https" else 80
        self.host_header = (f"[{host}]" if ":" in host else host) + ("" if port == default else f":{port}")
        self._idle: list[_Connection] = []
        self._open: set[_Connection] = set()
        self._waiters: collections.deque[asyncio.Future[None]] = collections.deque()
        self._woken = 0  # waiters woken that have not run yet (a request arriving meanwhile queues behind them)
        self._timer: asyncio.TimerHandle | None = None

    async def acquire(self, fresh: bool = False) -> _Connection:
        """An idle connection (not when ``fresh``), a new one within the limit, or the next one freed: first come,
        first served (a request that arrives while others wait queues behind them)."""
        woken = False
        while True:
            if self.client.closed:
                raise ConnectFailed("The client is closed.")
            if woken or not (self._waiters or self._woken):
                if not fresh:
                    connection = self._idle_connection()
                    if connection is not None:
                        self._pass_on()
                        return connection
                elif self._idle and len(self._open) >= self.client.limit:
                    self._idle[0].close()  # the oldest idle connection makes room (likely stale as well)
                if len(self._open) < self.client.limit:
                    connection = await self._connect()
                    self._pass_on()
                    return connection
            waiter = self.loop.create_future()
            if woken:
                self._waiters.appendleft(waiter)  # (woken, and beaten to it: first again)
            else:
                self._waiters.append(waiter)
            try:
                await waiter
            except BaseException:
                if waiter in self._waiters:
                    self._waiters.remove(waiter)
                elif waiter.done() and not waiter.cancelled() and waiter.exception() is None:
                    self._woken -= 1
                    self._wake()  # what it was woken for goes to the next waiter
                raise
            self._woken -= 1
            woken = True

    def ready(self) -> _Connection | None:
        """``acquire``'s idle connection, at once, when no request waits before this one (None: ``acquire``)."""
        if self._waiters or self._woken or self.client.closed:
            return None
        connection = self._idle_connection()
        if connection is not None:
            self._pass_on()
        return connection

    def _pass_on(self) -> None:
        """A request served while others wait: what is still free goes to the next of them (two connections
        freed in one tick wake one waiter each only if the second finds one queued)."""
        if self._waiters and not self._woken and (self._idle or len(self._open) < self.client.limit):
            self._wake()

    def _idle_connection(self) -> _Connection | None:
        idle = self._idle
        while idle:
            connection = idle.pop()  # (the newest: the least likely to have been closed by the upstream)
            transport = connection.transport
            if not connection.lost and transport is not None and not transport.is_closing() \
                    and self.loop.time() - connection.idle_since < self.client.keepalive:
                return connection
            connection.close()
        return None

    async def _connect(self) -> _Connection:
        connection = _Connection(self)
        self._open.add(connection)
        try:
            async with deadline(self.client.connect_timeout):
                # the host's addresses tried as RFC 8305 says (an unreachable IPv6 one does not hold up the IPv4
                # one for the whole timeout), as aiohttp did; aiohappyeyeballs is aiohttp's own dependency
                infos = await self.loop.getaddrinfo(self.host, self.port, type=socket.SOCK_STREAM)
                sock = await aiohappyeyeballs.start_connection(infos, happy_eyeballs_delay=0.25, interleave=1,
                                                               loop=self.loop)
                try:
                    await self.loop.create_connection(lambda: connection, sock=sock, ssl=self.ssl,
                                                      server_hostname=self.host if self.ssl is not None else None)
                except BaseException:
                    sock.close()
                    raise
        except asyncio.TimeoutError:
            self.forget(connection)
            raise ConnectTimeout(f"Connecting to {self.host_header} timed out.") from None
        except (OSError, ssl.SSLError) as exc:
            self.forget(connection)
            raise ConnectFailed(f"Could not connect to {self.host_header} ({type(exc).__name__}).",
                                kind=type(exc).__name__) from None
        except BaseException:
            connection.close()
            raise
        if self.client.closed:  # closed while this one connected
            connection.close()
            raise ConnectFailed("The client is closed.")
        return connection

    def put(self, connection: _Connection) -> None:
        if self.client.closed:
            connection.close()
            return
        loop = self.loop
        connection.idle_since = loop.time()
        connection.used = True
        self._idle.append(connection)
        if self._timer is None:
            self._timer = loop.call_at(connection.idle_since + self.client.keepalive, self._expire)
        self._wake()

    def forget(self, connection: _Connection) -> None:
        if connection in self._open:
            self._open.discard(connection)
            if connection in self._idle:
                self._idle.remove(connection)
            self._wake()

    def _wake(self) -> None:
        while self._waiters:
            waiter = self._waiters.popleft()
            if not waiter.done():
                waiter.set_result(None)
                self._woken += 1
                return

    def _expire(self) -> None:
        self._timer = None
        loop = self.loop
        now = loop.time()
        for connection in [c for c in self._idle if now - c.idle_since >= self.client.keepalive]:
            connection.close()
        if self._idle:
            self._timer = loop.call_at(min(c.idle_since for c in self._idle) + self.client.keepalive, self._expire)

    def close(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        waiters, self._waiters = self._waiters, collections.deque()
        for waiter in waiters:
            if not waiter.done():
                waiter.set_exception(ConnectFailed("The client is closed."))
        for connection in list(self._open):
            connection.close()


class HTTPClient:
    """Pooled HTTP/1.1 connections to the origins of the URLs it is asked for."""

    def __init__(self, *, limit: int = 100, keepalive: float = 15.0, connect_timeout: float = 30.0) -> None:
        self.limit = max(1, limit)
        self.keepalive = keepalive
        self.connect_timeout = connect_timeout
        self.closed = False
        self._origins: dict[tuple[str, str, int], _Origin] = {}
        self._targets: dict[str, tuple[_Origin, str, str | None]] = {}
        self._ssl: ssl.SSLContext | None = None

    def ssl_context(self) -> ssl.SSLContext:
        if self._ssl is None:
            self._ssl = ssl.create_default_context()
        return self._ssl

    def _target(self, url: str) -> tuple[_Origin, str, str | None]:
        known = self._targets.get(url)
        if known is not None:
            return known
        parts = urlsplit(url)
        scheme = parts.scheme.lower()
        if scheme not in ("http", "https") or not parts.hostname:
            raise ValueError(f"not an http(s) URL: {url[:200]!r}")
        try:
            port = parts.port or (443 if scheme == "https" else 80)
        except ValueError:
            raise ValueError(f"not a valid port in {url[:200]!r}") from None
        key = (scheme, parts.hostname, port)
        origin = self._origins.get(key)
        if origin is None:
            origin = self._origins[key] = _Origin(self, scheme, parts.hostname, port)
        basic = None
        if parts.username or parts.password:  # user:password@ in the URL: HTTP basic auth, for this URL
            pair = unquote_to_bytes(parts.username or "") + b":" + unquote_to_bytes(parts.password or "")
            basic = "Basic " + base64.b64encode(pair).decode("ascii")
        target = (parts.path or "/") + (f"?{parts.query}" if parts.query else "")
        if not _TARGET.fullmatch(target):  # sent as its UTF-8, percent-encoded (what is encoded already stays)
            target = quote(target, safe="/?&=%:@!$'()*+,;~-._[]")
        if len(self._targets) >= 1024:
            self._targets.clear()
        self._targets[url] = (origin, target, basic)
        return origin, target, basic

    async def request(self, method: str, url: str, *, data: bytes | None = None,
                      headers: Any = (), timeout: float | None = None) -> Response:
        """Send a request and wait for its answer's head; its body is read from the ``Response``.

        ``timeout``: the seconds it may take until the head has arrived, waiting for a connection included
        (``TimeoutError`` then). A connection idle in the pool is taken, and the head awaited, under a timer of
        the loop's that fails the head's future: no ``asyncio.timeout`` (a cancellation scope) on every request."""
        if self.closed:
            raise ConnectFailed("The client is closed.")
        origin, target, basic = self._target(str(url))
        head = _head(method, target, origin.host_header, headers, data, basic)
        retry, fresh = method in IDEMPOTENT, False
        loop = origin.loop
        until = None if timeout is None else loop.time() + timeout
        while True:
            connection = None if fresh else origin.ready()
            if connection is None:
                if until is None:
                    connection = await origin.acquire(fresh)
                else:
                    async with deadline_at(until):
                        connection = await origin.acquire(fresh)
            reused = connection.used
            try:
                answer = connection.send(method, head, data)
                if until is None:
                    return await answer
                timer = loop.call_at(until, _expire, answer)
                try:
                    return await answer
                finally:
                    timer.cancel()
            except Disconnected:
                if not (retry and reused and not connection.got_bytes):
                    raise
                retry = False  # once, on a new connection (a reused one the upstream had closed)
                fresh = True
            except BaseException:
                connection.close()
                raise

    def connections(self) -> tuple[int, int]:
        """Connections open (idle ones included) and idle, over every origin."""
        return (sum(len(o._open) for o in self._origins.values()), sum(len(o._idle) for o in self._origins.values()))

    async def __aenter__(self) -> HTTPClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def close(self) -> None:
        self.closed = True
        for origin in self._origins.values():
            origin.close()
        self._origins.clear()
        self._targets.clear()


def _expire(answer: asyncio.Future[Response]) -> None:
    if not answer.done():
        answer.set_exception(asyncio.TimeoutError())  # (TimeoutError on Python 3.11+)


def _head(method: str, target: str, host: str, headers: Any, data: bytes | None, basic: str | None = None) -> bytes:
    if not _TOKEN_STR.fullmatch(method):
        raise ValueError(f"not a method: {method[:100]!r}")
    lines = [f"{method} {target} HTTP/1.1"]
    seen = set()
    items = headers.items() if hasattr(headers, "items") else headers
    for name, value in items:
        if "\n" in value or "\r" in value or not _TOKEN_STR.fullmatch(name):
            raise ValueError(f"a header that would break the request: {name[:100]!r}")
        lower = name.lower()
        if lower == "content-length" or lower == "transfer-encoding":
            continue  # the body's length is the client's to say
        seen.add(lower)
        lines.append(f"{name}: {value}")
    if "host" not in seen:
        lines.append(f"Host: {host}")
    if basic is not None and "authorization" not in seen:
        lines.append(f"Authorization: {basic}")
    if "accept" not in seen:
        lines.append("Accept: */*")
    if "accept-encoding" not in seen:
        lines.append("Accept-Encoding: gzip, deflate")
    if data is not None:
        lines.append(f"Content-Length: {len(data)}")
        if "content-type" not in seen and method not in NO_BODY_METHODS:
            lines.append("Content-Type: application/octet-stream")
    elif method not in NO_BODY_METHODS:
        lines.append("Content-Length: 0")
    lines.append("\r\n")
    return "\r\n".join(lines).encode("utf-8", "surrogateescape")
