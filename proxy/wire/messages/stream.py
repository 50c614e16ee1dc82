"""The Messages API stream: named events, ended by ``message_stop``; usage split over ``message_start`` and
``message_delta``; errors as Anthropic's ``error`` event."""

from __future__ import annotations

from typing import Any

import orjson

from proxy.core.errors import CtxProxyError
from proxy.wire.messages.errors import error_body
from proxy.wire.sse import StreamEnd

# An upstream's own ``error`` event ends its stream too (it closes after it): nothing is added after it
TERMINAL = frozenset({b"message_stop", b"error"})


class MessagesStreamEnd(StreamEnd):
    name = "messages"
    needs_terminal = True

    def terminal(self, event: bytes, data: bytes) -> bool:
        return event in TERMINAL or (not event and b'"message_stop"' in data)

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
        return b"event: error\ndata: " + orjson.dumps(error_body(error)) + b"\n\n"


STREAM = MessagesStreamEnd()
