"""Server-sent events: how each wire's stream ends, and what a relayed stream reports on the way.

A stream's end is the wire's business: Chat Completions ends with ``data: [DONE]``;
the Responses API with a terminal ``response.completed`` / ``response.failed`` /
``response.incomplete`` event; Anthropic's Messages API with ``message_stop``; any
other stream when the upstream closes cleanly. The end is the whole terminal event
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

# An upstream's own ``error`` event ends its stream too (it closes after it): nothing is added after it
RESPONSES_TERMINAL = frozenset({b"response.completed", b"response.failed", b"response.incomplete", b"error"})
MESSAGES_TERMINAL = frozenset({b"message_stop", b"error"})


class StreamEnd:
    """One wire's stream conventions: its terminal event, where usage sits, and its error event."""

    name = "sse"
    needs_terminal = False  # a clean close is a complete stream

    def terminal(self, event: bytes, data: bytes) -> bool:
        return False

    def usage(self, payload: dict[str, Any], seen: dict[str, Any] | None) -> dict[str, Any] | None:
        usage = payload.get("usage")
        return usage if isinstance(usage, dict) else seen

    def error_event(self, error: CtxProxyError) -> bytes:
        return b"data: " + orjson.dumps(error.to_openai()) + b"\n\n"


class ChatStreamEnd(StreamEnd):
    name = "chat"
    needs_terminal = True

    def terminal(self, event: bytes, data: bytes) -> bool:
        # an OpenAI-compatible server that fails mid-stream sends ``data: {"error": {…}}`` and closes
        return data == b"[DONE]" or (data[:1] == b"{" and b'"error"' in data and _error_payload(data))


class ResponsesStreamEnd(StreamEnd):
    name = "responses"
    needs_terminal = True

    def terminal(self, event: bytes, data: bytes) -> bool:
        if event in RESPONSES_TERMINAL:
            return True
        if not event and data.startswith(b"{") and b'"type"' in data:
            try:
                payload = orjson.loads(data)
            except orjson.JSONDecodeError:
                return False
            return isinstance(payload, dict) and str(payload.get("type", "")).encode() in RESPONSES_TERMINAL
        return False

    def usage(self, payload: dict[str, Any], seen: dict[str, Any] | None) -> dict[str, Any] | None:
        response = payload.get("response")
        usage = response.get("usage") if isinstance(response, dict) else None
        return usage if isinstance(usage, dict) else seen

    def error_event(self, error: CtxProxyError) -> bytes:
        # OpenAI's ``error`` event is flat ({"type": "error", "code", "message", "param"}); the official
        # SDK raises APIError only for an event that carries an ``error`` object, so it carries both
        body = error.to_openai()["error"]
        payload = {"type": "error", "code": body.get("code"), "message": body.get("message"),
                   "param": body.get("param"), "sequence_number": 0, "error": body}
        return b"event: error\ndata: " + orjson.dumps(payload) + b"\n\n"


class MessagesStreamEnd(StreamEnd):
    name = "messages"
    needs_terminal = True

    def terminal(self, event: bytes, data: bytes) -> bool:
        return event in MESSAGES_TERMINAL or (not event and b'"message_stop"' in data)

    def usage(self, payload: dict[str, Any], seen: dict[str, Any] | None) -> dict[str, Any] | None:
        kind = payload.get("type")
        usage = None
        if kind == "message_start" and isinstance(payload.get("message"), dict):
            usage = payload["message"].get("usage")
        elif kind == "message_delta":
            usage = payload.get("usage")
        if not isinstance(usage, dict):
            return seen
        merged = dict(seen or {})
        merged.update({k: v for k, v in usage.items() if v is not None})
        return merged

    def error_event(self, error: CtxProxyError) -> bytes:
        from proxy.wire.errors import anthropic_error_body

        return b"event: error\ndata: " + orjson.dumps(anthropic_error_body(error)) + b"\n\n"


SSE = StreamEnd()
CHAT = ChatStreamEnd()
RESPONSES = ResponsesStreamEnd()
MESSAGES = MessagesStreamEnd()


def stream_end_for_path(path: str) -> StreamEnd:
    """The conventions of a relayed path (``/v1/responses`` …); unknown paths end on a clean close."""
    tail = path.split("?", 1)[0].rstrip("/")
    if tail.endswith("/chat/completions"):
        return CHAT
    if tail.endswith("/responses") or tail.endswith("/responses/compact"):
        return RESPONSES
    if tail.endswith("/messages"):
        return MESSAGES
    return SSE


def _error_payload(payload: bytes) -> bool:
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
    return event == b"error" if event else _error_payload(payload)


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

    def __init__(self, started: float, end: StreamEnd = CHAT, clock: Callable[[], float] = time.perf_counter) -> None:
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
