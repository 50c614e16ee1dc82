"""Compact text lines for the summariser, shared by every wire's ``Item.describe``.

Each kind of content has one line shape, whatever wire it came on: ``USER: …``,
``ASSISTANT: …``, ``TOOL CALL <id> name(args)``, ``TOOL RESULT <id>: …``,
``REFUSAL: …``, ``[image]``/``[audio: transcript]``/``[file name]`` placeholders.
Long tool results and arguments are shortened in the middle, keeping both ends.
"""

from __future__ import annotations

from typing import Any

import orjson

TOOL_RESULT_CHARS = 1500
ARGUMENT_CHARS = 600


def shorten(text: str, limit: int) -> str:
    if len(text) <= limit:
        return text
    half = limit // 2
    return f"{text[:half]} […{len(text) - limit} chars…] {text[-half:]}"


def as_text(value: Any) -> str:
    """A string as is; anything else as compact JSON."""
    if isinstance(value, str):
        return value
    try:
        return orjson.dumps(value).decode()
    except TypeError:
        return repr(value)


def said(role: str, text: str) -> str:
    return f"{role.upper()}: {text}" if text else ""


def call(call_id: str, name: Any, arguments: Any) -> str:
    return f"TOOL CALL {call_id} {name}({shorten(as_text(arguments), ARGUMENT_CHARS)})"


def result(call_id: str, text: str) -> str:
    return f"TOOL RESULT {call_id}: {shorten(text, TOOL_RESULT_CHARS)}"


def lines(*parts: str) -> str:
    return "\n".join(p for p in parts if p)
