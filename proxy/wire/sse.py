"""Server-sent events, wire-neutral: the parser, the watcher of a relayed stream, and a dialect's base.

A stream's end is the wire's business (``StreamEnd``, subclassed by each wire's
``stream`` module: Chat Completions ends with ``data: [DONE]``, the Responses API with
a terminal ``response.*`` event, Anthropic's Messages API with ``message_stop``); any
other stream ends when the upstream closes cleanly. The end is the whole terminal event
as a client's SSE parser dispatches it (its data line ended, then the blank line
that ends the event; CR, LF and CRLF line ends alike), never its ``event:`` line
alone. Only a stream that breaks off before its end gets an error event, in the
wire's own shape.

``EventReader`` splits a stream into whole blocks (events, comments) as the SSE
standard reads it; ``StreamWatcher`` reads the relayed bytes through it without
altering them: whether the end was seen, the provider's usage (for metrics and
calibration) and the time to the first byte.
"""

from __future__ import annotations

import re
import time
from collections.abc import Callable
from typing import Any

import orjson

from proxy.core.errors import CtxProxyError

SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}

class StreamEnd:
    """One wire's stream dialect: its terminal event, where usage sits, and its error event.

    This base is a stream of no wire (a relayed path of none): it ends when the upstream closes
    cleanly; each wire's ``stream`` module subclasses it (``proxy.wire.<name>.stream``).
    """

    name = "sse"
    needs_terminal = False  # a clean close is a complete stream

    def terminal(self, event: bytes, data: bytes) -> bool:
        return False

    def usage(self, payload: dict[str, Any], seen: dict[str, Any] | None) -> dict[str, Any] | None:
        usage = payload.get("usage")
        return usage if isinstance(usage, dict) else seen

    def error_event(self, error: CtxProxyError) -> bytes:
        return b"data: " + orjson.dumps(error.to_openai()) + b"\n\n"


SSE = StreamEnd()


def error_payload(payload: bytes) -> bool:
    """Whether an event's data is an error (``{"type": "error", …}`` or ``{"error": {…}}`` without choices), not a
    chunk that merely has an ``error`` key."""
    try:
        data = orjson.loads(payload)
    except orjson.JSONDecodeError:
        return False
    if not isinstance(data, dict):
        return False
    return data.get("type") == "error" or (isinstance(data.get("error"), dict) and "choices" not in data)


def _is_error(event: bytes, payload: bytes) -> bool:
    """Whether a terminal event is an error event (read once per stream, at its end)."""
    return event == b"error" if event else error_payload(payload)


class Block:
    """A piece of an SSE stream that ends where the client's parser is between events: an event with its
    blank line, a blank line alone, or a comment line outside any event. ``data`` is None when nothing was
    dispatched (a comment, a blank line, an event without data lines)."""

    __slots__ = ("data", "event", "raw")

    def __init__(self, raw: bytes, event: bytes, data: bytes | None) -> None:
        self.raw = raw
        self.event = event
        self.data = data


_EOL = re.compile(rb"\r\n?|\n")
_BOM = b"\xef\xbb\xbf"


class EventReader:
    """Splits an SSE byte stream into blocks as the HTML living standard's parser reads it, on any chunking.

    A line ends with CRLF, LF or CR (a CR at the end of a chunk ends its line; an LF that starts the next
    chunk belongs to it); an event is dispatched at the blank line that ends it, never before, and only
    with at least one ``data`` line. Bytes after the last block are held (``pending``) until it completes.
    """

    def __init__(self) -> None:
        self._buf = bytearray()
        self._pos = 0  # where the line in progress starts in _buf
        self._skip_lf = False  # the previous chunk ended with a CR: an LF now is the rest of its line end
        self._first = True  # the stream's first line (a UTF-8 BOM before it is not part of it)
        self._open = False  # a field line was read since the last blank line
        self._event = b""
        self._data: list[bytes] = []

    @property
    def pending(self) -> bytes:
        """What was fed but does not yet form a whole block (an event without its blank line, half a line)."""
        return bytes(self._buf)

    def feed(self, chunk: bytes) -> list[Block]:
        buf = self._buf
        buf += chunk
        pos, cut = self._pos, 0
        blocks: list[Block] = []
        if self._skip_lf and pos < len(buf):
            self._skip_lf = False
            if buf[pos] == 0x0A:
                pos += 1
                if not self._open:  # the line end of a blank line or a comment already relayed: relay it too
                    blocks.append(Block(bytes(buf[:pos]), b"", None))
                    cut = pos
        size = len(buf)
        while pos < size:
            match = _EOL.search(buf, pos)
            if match is None:
                break
            end = match.end()
            if end == size and buf[end - 1] == 0x0D:
                self._skip_lf = True
            line = bytes(buf[pos:match.start()])
            pos = end
            if self._first:
                self._first = False
                line = line.removeprefix(_BOM)
            if not line:
                event, data = self._event, self._data
                self._event, self._data, self._open = b"", [], False
                blocks.append(Block(bytes(buf[cut:pos]), event.strip(), b"\n".join(data) if data else None))
                cut = pos
            elif line[0] == 0x3A:  # ":" a comment
                if not self._open:
                    blocks.append(Block(bytes(buf[cut:pos]), b"", None))
                    cut = pos
            else:
                self._open = True
                name, _, value = line.partition(b":")
                if value[:1] == b" ":
                    value = value[1:]
                if name == b"data":
                    self._data.append(value)
                elif name == b"event":
                    self._event = value
        del buf[:cut]
        self._pos = pos - cut
        return blocks


class StreamWatcher:
    """Watches relayed SSE bytes for the wire's end, the usage object and the first byte, without altering them.

    ``feed`` returns the bytes that may go to the client now: whole blocks only (``EventReader``), so a stream
    that breaks off never leaves half an event at the client, and an error event that follows stands alone.
    The stream is ``done`` once its terminal event was dispatched: its data line whole and its blank line read.
    """

    def __init__(self, started: float, end: StreamEnd, clock: Callable[[], float] = time.perf_counter) -> None:
        self.started = started
        self.end = end
        self.done = False
        self.failed = False  # the stream ended with the upstream's own error event
        self.usage: dict[str, Any] | None = None
        self.ttft: float | None = None
        self._clock = clock
        self._reader = EventReader()

    @property
    def complete(self) -> bool:
        """Whether a clean close now means a complete stream."""
        return self.done or not self.end.needs_terminal

    @property
    def pending(self) -> bytes:
        """Bytes fed but not yet returned by ``feed``: relayed only after a clean close that completes the stream."""
        return self._reader.pending

    def feed(self, chunk: bytes) -> bytes:
        if self.ttft is None:
            self.ttft = self._clock() - self.started
        blocks = self._reader.feed(chunk)
        for block in blocks:
            if block.data is not None:
                self._dispatched(block.event, block.data.strip())
        return blocks[0].raw if len(blocks) == 1 else b"".join(block.raw for block in blocks)

    def _dispatched(self, event: bytes, payload: bytes) -> None:
        end = self.end
        if end.terminal(event, payload):
            self.failed = self.failed or _is_error(event, payload)  # an error stays one ([DONE] after it)
            self.done = True
        if b'"usage"' in payload:
            try:
                parsed = orjson.loads(payload)
            except orjson.JSONDecodeError:
                return
            if isinstance(parsed, dict):
                self.usage = end.usage(parsed, self.usage)
