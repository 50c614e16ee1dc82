"""The Messages API stream: named events, ended by ``message_stop``; usage split over ``message_start`` and
``message_delta``; errors as Anthropic's ``error`` event; and a whole message told as such a stream
(``message_events``)."""

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


# what a stream tells in its message_delta, not in its message_start (null there): why it stopped, and the container
ENDING = ("stop_reason", "stop_sequence", "stop_details", "container")


def message_events(message: dict[str, Any]) -> list[bytes]:
    """A whole message (Anthropic's non-streaming answer) as the events a stream of it is made of, in the order
    Anthropic sends them, each block's content in one delta: what the ``anthropic`` SDK and Claude Code read
    from a stream builds the same message. Usage: the input side in ``message_start``, the output in
    ``message_delta``."""
    usage: dict[str, Any] = message["usage"] if isinstance(message.get("usage"), dict) else {}
    ending = {key: message.get(key) for key in ENDING if key in message or key in ("stop_reason", "stop_sequence")}
    start = {**message, **dict.fromkeys(ending), "content": [], "usage": {**usage, "output_tokens": 0}}
    events = [sse(b"message_start", {"type": "message_start", "message": start})]
    blocks: list[Any] = message["content"] if isinstance(message.get("content"), list) else []
    for index, block in enumerate(blocks):
        events += _block_events(index, block if isinstance(block, dict) else {"type": "text", "text": str(block)})
    delta = {"type": "message_delta", "delta": ending, "usage": {"output_tokens": usage.get("output_tokens", 0)}}
    return [*events, sse(b"message_delta", delta), sse(b"message_stop", {"type": "message_stop"})]


def _block_events(index: int, block: dict[str, Any]) -> list[bytes]:
    """One content block's start, its content as one delta (text, a tool's input, thinking and its signature),
    and its stop; a block of another kind (redacted thinking, a server tool's result …) starts whole."""
    kind = block.get("type")
    deltas: list[dict[str, Any]] = []
    if kind == "text":
        start = {**block, "text": ""}
        deltas.append({"type": "text_delta", "text": block.get("text", "")})
    elif kind in ("tool_use", "server_tool_use", "mcp_tool_use") and "input" in block:
        start = {**block, "input": {}}
        deltas.append({"type": "input_json_delta", "partial_json": orjson.dumps(block["input"]).decode()})
    elif kind == "thinking":
        start = {**block, "thinking": "", "signature": ""}
        deltas.append({"type": "thinking_delta", "thinking": block.get("thinking", "")})
        if block.get("signature"):
            deltas.append({"type": "signature_delta", "signature": block["signature"]})
    else:
        start = block
    return [sse(b"content_block_start", {"type": "content_block_start", "index": index, "content_block": start}),
            *[sse(b"content_block_delta", {"type": "content_block_delta", "index": index, "delta": delta})
              for delta in deltas],
            sse(b"content_block_stop", {"type": "content_block_stop", "index": index})]


def sse(name: bytes, data: Any) -> bytes:
    """One named event of a Messages stream."""
    return b"event: " + name + b"\ndata: " + orjson.dumps(data) + b"\n\n"
