"""The Chat Completions stream: ``data:`` chunks, ``data: [DONE]`` at the end, errors in OpenAI's shape."""

from __future__ import annotations

from proxy.wire.sse import StreamEnd, error_payload


class ChatStreamEnd(StreamEnd):
    name = "chat"
    needs_terminal = True

    def terminal(self, event: bytes, data: bytes) -> bool:
        # an OpenAI-compatible server that fails mid-stream sends ``data: {"error": {…}}`` and closes
        return data == b"[DONE]" or (data[:1] == b"{" and b'"error"' in data and error_payload(data))


STREAM = ChatStreamEnd()
