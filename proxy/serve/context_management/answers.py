"""Answers on the Messages wire that emulation changes or makes: the ``context_management`` report, a compaction block.

``ResponseEdits`` edits an upstream's answer as Anthropic would have written it: the
``context_management`` report (``{"applied_edits": [...]}``) at the top of a message, or on
the stream's ``message_delta`` event; and, after an emulated compaction, a ``compaction``
block first in the content (every later block's stream index moves up by one). An answer
that is not a message (an error, another shape) passes through unchanged.
``local_answer`` is the answer to a request paused after compaction: the block alone,
``stop_reason: "compaction"``, no upstream call.

These wrap any object with the ``Answer`` shape of ``proxy.upstream.base`` (``AnswerLike``: the
shape is all they need).
"""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator
from typing import Any, Protocol

import orjson
from multidict import CIMultiDict

from proxy.wire.messages.stream import sse
from proxy.wire.sse import Block, EventReader

SHIFTED = frozenset({b"content_block_start", b"content_block_delta", b"content_block_stop"})


class AnswerLike(Protocol):
    status: int
    headers: CIMultiDict[str]
    streaming: bool

    def chunks(self, idle_timeout: float) -> AsyncIterator[bytes]: ...

    async def read(self, idle_timeout: float) -> bytes: ...

    def close(self, clean: bool) -> None: ...


class ResponseEdits:
    """What to change in one answer: the report (None: the request had no context_management) and a compaction block."""

    def __init__(self, applied: list[dict[str, Any]] | None, compaction: dict[str, Any] | None) -> None:
        self.applied = applied
        self.compaction = compaction

    @property
    def needed(self) -> bool:
        return self.applied is not None or self.compaction is not None

    def report(self) -> dict[str, Any]:
        return {"applied_edits": list(self.applied or [])}

    def edit_json(self, raw: bytes) -> bytes:
        try:
            message = orjson.loads(raw)
        except orjson.JSONDecodeError:
            return raw
        if not isinstance(message, dict) or message.get("type") != "message":
            return raw
        if self.compaction is not None and isinstance(message.get("content"), list):
            message["content"] = [self.compaction, *message["content"]]
        if self.applied is not None:
            message["context_management"] = self.report()
        return orjson.dumps(message)

    def event(self, name: bytes, data: Any) -> list[bytes] | None:
        """The events one upstream event becomes (None: relay its bytes as they came)."""
        if not isinstance(data, dict):
            return None
        if name == b"message_start" and self.compaction is not None:
            return [sse(name, data), *compaction_events(self.compaction, 0)]
        if name in SHIFTED and self.compaction is not None and isinstance(data.get("index"), int):
            return [sse(name, {**data, "index": data["index"] + 1})]
        if name == b"message_delta" and self.applied is not None:
            return [sse(name, {**data, "context_management": self.report()})]
        return None


class StreamEditor:
    """Applies ``ResponseEdits`` to an SSE byte stream, event by event (other events keep their bytes)."""

    def __init__(self, edits: ResponseEdits) -> None:
        self.edits = edits
        self._reader = EventReader()

    def feed(self, chunk: bytes) -> bytes:
        return b"".join(part for block in self._reader.feed(chunk) for part in self._edit(block))

    def flush(self) -> bytes:
        return self._reader.pending

    def _edit(self, block: Block) -> list[bytes]:
        if block.data is None:
            return [block.raw]
        try:
            payload = orjson.loads(block.data)
        except orjson.JSONDecodeError:
            return [block.raw]
        name = block.event
        if not name and isinstance(payload, dict) and isinstance(payload.get("type"), str):
            name = payload["type"].encode()
        edited = self.edits.event(name, payload)
        return [block.raw] if edited is None else edited


class EditedAnswer:
    """An upstream answer with ``ResponseEdits`` applied, streamed or not."""

    def __init__(self, answer: AnswerLike, edits: ResponseEdits) -> None:
        self.answer = answer
        self.edits = edits
        self.status = answer.status
        self.headers = answer.headers
        self.streaming = answer.streaming

    async def chunks(self, idle_timeout: float) -> AsyncIterator[bytes]:
        editor = StreamEditor(self.edits)
        async for chunk in self.answer.chunks(idle_timeout):
            out = editor.feed(chunk)
            if out:
                yield out
        tail = editor.flush()
        if tail:
            yield tail

    async def read(self, idle_timeout: float) -> bytes:
        return self.edits.edit_json(await self.answer.read(idle_timeout))

    def close(self, clean: bool) -> None:
        self.answer.close(clean)


class LocalAnswer:
    """An answer the proxy makes itself: a JSON body, or SSE events."""

    def __init__(self, body: bytes | None = None, events: list[bytes] | None = None) -> None:
        self.status = 200
        self.streaming = events is not None
        self.headers: CIMultiDict[str] = CIMultiDict(
            {"Content-Type": "text/event-stream" if self.streaming else "application/json"})
        self._body = body or b""
        self._events = events or []

    async def chunks(self, idle_timeout: float) -> AsyncIterator[bytes]:
        for event in self._events:
            yield event

    async def read(self, idle_timeout: float) -> bytes:
        return self._body

    def close(self, clean: bool) -> None:
        """Nothing to release."""


def compaction_events(block: dict[str, Any], index: int) -> list[bytes]:
    """A compaction block as stream events: the SDK sets content and encrypted_content from one delta."""
    start = {"type": "content_block_start", "index": index,
             "content_block": {"type": "compaction", "content": None, "encrypted_content": None}}
    delta = {"type": "content_block_delta", "index": index,
             "delta": {"type": "compaction_delta", "content": block.get("content"),
                       "encrypted_content": block.get("encrypted_content")}}
    return [sse(b"content_block_start", start), sse(b"content_block_delta", delta),
            sse(b"content_block_stop", {"type": "content_block_stop", "index": index})]


def local_answer(model: str, compaction: dict[str, Any], report: dict[str, Any] | None, stream: bool) -> LocalAnswer:
    """The answer to a request paused after compaction (``pause_after_compaction``): the block alone."""
    message: dict[str, Any] = {
        "id": f"msg_ctxproxy_{uuid.uuid4().hex[:24]}", "type": "message", "role": "assistant", "model": model,
        "content": [compaction], "stop_reason": "compaction", "stop_sequence": None,
        "usage": {"input_tokens": 0, "output_tokens": 0},
    }
    if report is not None:
        message["context_management"] = report
    if not stream:
        return LocalAnswer(body=orjson.dumps(message))
    start = {**message, "content": [], "stop_reason": None}
    start.pop("context_management", None)
    delta: dict[str, Any] = {"type": "message_delta", "delta": {"stop_reason": "compaction", "stop_sequence": None},
                             "usage": {"output_tokens": 0}}
    if report is not None:
        delta["context_management"] = report
    events = [sse(b"message_start", {"type": "message_start", "message": start}), *compaction_events(compaction, 0),
              sse(b"message_delta", delta), sse(b"message_stop", {"type": "message_stop"})]
    return LocalAnswer(events=events)
