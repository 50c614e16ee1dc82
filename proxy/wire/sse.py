"""Server-sent events: how each wire's stream ends, and what a relayed stream reports on the way.

A stream's end is the wire's business (issue 18): Chat Completions ends with
``data: [DONE]``; the Responses API with a terminal ``response.completed`` /
``response.failed`` / ``response.incomplete`` event; Anthropic's Messages API with
``message_stop``; any other stream when the upstream closes cleanly. Only a stream
that breaks off before its end gets an error event, in the wire's own shape.

``StreamWatcher`` reads the relayed bytes without altering them: whether the end
was seen, the provider's usage (for metrics and calibration) and the time to the
first byte.
"""

from __future__ import annotations

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


class StreamWatcher:
    """Watches relayed SSE bytes for the wire's end, the usage object and the first byte, without altering them."""

    def __init__(self, started: float, end: StreamEnd = CHAT, clock: Callable[[], float] = time.perf_counter) -> None:
        self.started = started
        self.end = end
        self.done = False
        self.failed = False  # the stream ended with the upstream's own error event
        self.usage: dict[str, Any] | None = None
        self.ttft: float | None = None
        self._clock = clock
        self._partial = b""
        self._event = b""

    @property
    def complete(self) -> bool:
        """Whether a clean close now means a complete stream."""
        return self.done or not self.end.needs_terminal

    def feed(self, chunk: bytes) -> None:
        if self.ttft is None:
            self.ttft = self._clock() - self.started
        data = self._partial + chunk
        lines = data.split(b"\n")
        self._partial = lines.pop()
        end = self.end
        for line in lines:
            line = line.rstrip(b"\r")
            if not line:
                self._event = b""
                continue
            if line.startswith(b"event:"):
                self._event = line[6:].strip()
                if end.terminal(self._event, b""):
                    self.done = True
                    self.failed = self.failed or self._event == b"error"
                continue
            if not line.startswith(b"data:"):
                continue
            payload = line[5:].strip()
            if end.terminal(self._event, payload):
                self.failed = self.failed or _is_error(self._event, payload)  # an error stays one ([DONE] after it)
                self.done = True
            if b'"usage"' in payload:
                try:
                    event = orjson.loads(payload)
                except orjson.JSONDecodeError:
                    continue
                if isinstance(event, dict):
                    self.usage = end.usage(event, self.usage)
