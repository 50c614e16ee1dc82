"""Compact text lines for the summariser, shared by every wire's ``Item.describe``.

Each kind of content has one line shape, whatever wire it came on: ``USER: …``,
``ASSISTANT: …``, ``TOOL CALL <id> name(args)``, ``TOOL RESULT <id>: …``,
``REFUSAL: …``, ``[image]``/``[audio: transcript]``/``[file name]`` placeholders.
Long tool results and arguments are shortened in the middle, keeping both ends; a long result
keeps, besides, the passages that hold the values a later turn used (``keep``), so no value the
conversation went on to use is cut away before the summariser sees it.
"""

from __future__ import annotations

import re
from collections.abc import Collection
from itertools import pairwise
from typing import Any

import orjson

TOOL_RESULT_CHARS = 1500
ARGUMENT_CHARS = 600
PASSAGE_CHARS = 200  # a kept passage: the line that holds the value, or this much text around it


def shorten(text: str, limit: int, keep: Collection[str] = ()) -> str:
    """``text`` cut in the middle to about ``limit`` characters, keeping both ends, and a passage around the
    first whole occurrence of each value of ``keep`` that the cut would remove; every gap says its size."""
    if len(text) <= limit:
        return text
    half = limit // 2
    spans = [(0, half), (len(text) - half, len(text))]
    for value in keep:
        at = _whole(text, value)
        if at is not None and not any(s <= at and at + len(value) <= e for s, e in spans[:2]):
            spans.append(_passage(text, at, len(value)))
    if len(spans) == 2:
        return f"{text[:half]} […{len(text) - limit} chars…] {text[-half:]}"
    merged: list[tuple[int, int]] = []
    for start, end in sorted(spans):
        if merged and start <= merged[-1][1]:
            merged[-1] = (merged[-1][0], max(merged[-1][1], end))
        else:
            merged.append((start, end))
    out = [text[merged[0][0]:merged[0][1]]]
    for (_, end), (start, stop) in pairwise(merged):
        out.append(f" […{start - end} chars…] {text[start:stop]}")
    shortened = "".join(out)
    return shortened if len(shortened) < len(text) else text


def _whole(text: str, value: str) -> int | None:
    """Where ``value`` first occurs in ``text`` as a whole token (not inside a longer word), or None."""
    if not value or value not in text:
        return None
    match = re.search(r"(?<![A-Za-z0-9_])" + re.escape(value) + r"(?![A-Za-z0-9_])", text)
    return match.start() if match else None


def _passage(text: str, at: int, size: int) -> tuple[int, int]:
    """The line holding ``text[at:at+size]`` when it is short, else ``PASSAGE_CHARS`` around it."""
    start = text.rfind("\n", 0, at) + 1
    end = text.find("\n", at + size)
    end = len(text) if end < 0 else end
    if end - start <= PASSAGE_CHARS:
        return start, end
    room = max(0, PASSAGE_CHARS - size) // 2
    return max(start, at - room), min(end, at + size + room)


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


def result(call_id: str, text: str, keep: Collection[str] = ()) -> str:
    """A result's line; ``keep``: the values a later turn used (the passages that hold them are kept)."""
    return f"TOOL RESULT {call_id}: {shorten(text, TOOL_RESULT_CHARS, keep)}"


def lines(*parts: str) -> str:
    return "\n".join(p for p in parts if p)
