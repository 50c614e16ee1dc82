"""The Responses API stream: named events, ended by ``response.completed`` / ``.failed`` / ``.incomplete``."""

from __future__ import annotations

from typing import Any

import orjson

from proxy.core.errors import CtxProxyError
from proxy.wire.responses.errors import error_body
from proxy.wire.sse import StreamEnd

# An upstream's own ``error`` event ends its stream too (it closes after it): nothing is added after it
TERMINAL = frozenset({b"response.completed", b"response.failed", b"response.incomplete", b"error"})


class ResponsesStreamEnd(StreamEnd):
    name = "responses"
    needs_terminal = True

    def terminal(self, event: bytes, data: bytes) -> bool:
        if event in TERMINAL:
            return True
        if not event and data.startswith(b"{") and b'"type"' in data:
            try:
                payload = orjson.loads(data)
            except orjson.JSONDecodeError:
                return False
            return isinstance(payload, dict) and str(payload.get("type", "")).encode() in TERMINAL
        return False

    def usage(self, payload: dict[str, Any], seen: dict[str, Any] | None) -> dict[str, Any] | None:
        response = payload.get("response")
        usage = response.get("usage") if isinstance(response, dict) else None
        return usage if isinstance(usage, dict) else seen

    def error_event(self, error: CtxProxyError) -> bytes:
        # OpenAI's ``error`` event is flat ({"type": "error", "code", "message", "param"}); the official
        # SDK raises APIError only for an event that carries an ``error`` object, so it carries both
        body = error_body(error)["error"]
        payload = {"type": "error", "code": body.get("code"), "message": body.get("message"),
                   "param": body.get("param"), "sequence_number": 0, "error": body}
        return b"event: error\ndata: " + orjson.dumps(payload) + b"\n\n"


STREAM = ResponsesStreamEnd()
