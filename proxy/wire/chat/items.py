"""Chat Completions messages as items: one item per message, its token formula, its meaning (atoms).

Every message is one item; its ``raw`` is the client's own message object, so a kept
message is forwarded exactly as received. Calls pair by ``tool_call_id`` (every
tool-call type: ``function``, ``custom`` …); legacy ``function_call`` pairs with a
``function`` message by name, in a namespace of its own (``LEGACY``).
"""

from __future__ import annotations

from collections.abc import Collection, Iterator
from typing import Any

from proxy.core import describe, media
from proxy.core.fields import check_keys
from proxy.core.items import ASSISTANT, OTHER, SYSTEM, TOOL, USER, Item, canonical_arguments, media_digest
from proxy.core.tokens import TokenCounter

TOKENS_PER_MESSAGE = 3
TOKENS_PER_NAME = 1
TOOL_CALL_OVERHEAD = 3
KNOWN_ROLES = frozenset({"system", "developer", "user", "assistant", "tool", "function"})
ROLES = {"system": SYSTEM, "developer": SYSTEM, "user": USER, "assistant": ASSISTANT, "tool": TOOL,
         "function": TOOL}
SALT = 0x1  # content keys of chat messages, distinct from other wires' formulas in the shared LRU
# legacy function_call ids are the function's name in a namespace no tool_call id can reach in practice (a NUL
# prefix), so a tool call never answers a legacy call or the other way round; a client id that starts with NUL is
# refused, so it cannot reach into that namespace
RESERVED = "\x00"
LEGACY = RESERVED + "fn:"

Message = dict[str, Any]


def count_message(counter: TokenCounter, message: Message) -> int:
    """OpenAI's per-message formula: 3 + every string field (+1 for ``name``) + parts + calls."""
    check_keys(message)
    n = TOKENS_PER_MESSAGE
    for key, value in message.items():
        if isinstance(value, str):
            n += counter.text(value)
            if key == "name":
                n += TOKENS_PER_NAME
        elif key == "content" and isinstance(value, list):
            n += _count_parts(counter, value)
        elif key == "tool_calls" and isinstance(value, list):
            for call in value:
                if isinstance(call, dict):
                    n += TOOL_CALL_OVERHEAD + _count_call(counter, call)
        elif key == "function_call" and isinstance(value, dict):
            for part in (value.get("name"), value.get("arguments")):
                if isinstance(part, str):
                    n += counter.text(part)
        elif key == "audio" and isinstance(value, dict):
            transcript = value.get("transcript")
            n += counter.text(transcript) if isinstance(transcript, str) else 0
    return n


def _count_call(counter: TokenCounter, call: dict[str, Any]) -> int:
    check_keys(call)
    body = call.get("function")
    if not isinstance(body, dict):
        kind = call.get("type")
        body = call.get(kind) if isinstance(kind, str) else None
    if not isinstance(body, dict):
        return counter.json(call)
    n = 0
    for value in body.values():
        n += counter.text(value) if isinstance(value, str) else counter.json(value)
    return n


def _count_parts(counter: TokenCounter, parts: list[Any]) -> int:
    n = 0
    for part in parts:
        if not isinstance(part, dict):
            continue
        check_keys(part)
        kind = part.get("type")
        if kind == "text" and isinstance(part.get("text"), str):
            n += counter.text(part["text"])
        elif kind == "image_url":
            image = part.get("image_url")
            url = image.get("url") if isinstance(image, dict) else None
            n += media.image_tokens(url if isinstance(url, str) else None,
                                    image.get("detail") if isinstance(image, dict) else None)
        elif kind == "input_audio":
            audio = part.get("input_audio")
            if isinstance(audio, dict) and isinstance(audio.get("data"), str):
                n += media.audio_tokens(audio["data"], audio.get("format"))
            else:
                n += counter.json(part)
        elif kind == "file":
            file = part.get("file")
            data = file.get("file_data") if isinstance(file, dict) else None
            n += media.file_tokens(counter, data if isinstance(data, str) else None)
        else:
            n += counter.json(part)
    return n


def _text_of(content: Any) -> tuple[str, list[str]]:
    """The text of a content field, and placeholders for its media parts."""
    if isinstance(content, str):
        return content, []
    texts: list[str] = []
    media_parts: list[str] = []
    if isinstance(content, list):
        for part in content:
            if not isinstance(part, dict):
                continue
            kind = part.get("type")
            if kind == "text" and isinstance(part.get("text"), str):
                texts.append(part["text"])
            elif kind == "image_url":
                media_parts.append("[image]")
            elif kind == "input_audio":
                media_parts.append("[audio]")
            elif kind == "file":
                file = part.get("file")
                name = file.get("filename") if isinstance(file, dict) else None
                media_parts.append(f"[file {name}]" if isinstance(name, str) else "[file]")
            else:
                media_parts.append(f"[{kind if isinstance(kind, str) else 'part'}]")
    return "\n".join(texts), media_parts


def _media_atoms(role: str, content: Any) -> Iterator[tuple[str, ...]]:
    if not isinstance(content, list):
        return
    for part in content:
        if not isinstance(part, dict) or part.get("type") == "text":
            continue
        body = part.get(part.get("type")) if isinstance(part.get("type"), str) else None
        ref = None
        if isinstance(body, dict):
            ref = body.get("url") or body.get("data") or body.get("file_data") or body.get("file_id")
        yield ("media", role, media_digest(ref if isinstance(ref, str) else describe.as_text(part)))


def _call_parts(call: dict[str, Any]) -> tuple[str, Any, Any]:
    """(id, name, arguments/input) of any tool-call type."""
    cid: str = call["id"] if isinstance(call.get("id"), str) else ""
    body = call.get("function")
    if isinstance(body, dict):
        return cid, body.get("name"), body.get("arguments")
    kind = call.get("type")
    body = call.get(kind) if isinstance(kind, str) else None
    if isinstance(body, dict):
        return cid, body.get("name"), body.get("input", body.get("arguments"))
    return cid, kind, None


class ChatItem(Item):
    __slots__ = ()

    def describe(self, keep: Collection[str] = ()) -> str:
        m: Message = self.raw
        role = m.get("role") if isinstance(m.get("role"), str) else ""
        text, media_parts = _text_of(m.get("content"))
        if self.role == TOOL:
            ident = self.result_id or ""
            ident = ident[len(LEGACY):] if ident.startswith(LEGACY) else ident
            return describe.result(ident, " ".join([text, *media_parts]).strip(), keep)
        audio = m.get("audio")
        transcript = audio.get("transcript") if isinstance(audio, dict) else None
        lines = [describe.said(str(role), " ".join([text, *media_parts]).strip())]
        if isinstance(transcript, str):
            lines.append(describe.said(str(role), f"[audio: {transcript}]"))
        if isinstance(m.get("refusal"), str) and m["refusal"]:
            lines.append(f"REFUSAL: {m['refusal']}")
        calls = m.get("tool_calls")
        if isinstance(calls, list):
            for call in calls:
                if isinstance(call, dict):
                    lines.append(describe.call(*_call_parts(call)))
        legacy = m.get("function_call")
        if isinstance(legacy, dict):
            lines.append(describe.call("", legacy.get("name"), legacy.get("arguments")))
        return describe.lines(*lines)

    def atoms(self) -> Iterator[tuple[str, ...]]:
        m: Message = self.raw
        content = m.get("content")
        text, _ = _text_of(content)
        if self.role == TOOL:
            yield ("result", self.result_id or "", text)
            yield from _media_atoms(TOOL, content)
            return
        if text:
            yield ("text", self.role, text)
        yield from _media_atoms(self.role, content)
        if isinstance(m.get("refusal"), str) and m["refusal"]:
            yield ("text", "refusal", m["refusal"])
        audio = m.get("audio")
        if isinstance(audio, dict):
            transcript = audio.get("transcript")
            ref = transcript if isinstance(transcript, str) else describe.as_text(audio.get("id"))
            yield ("media", "assistant_audio", media_digest(ref))
        calls = m.get("tool_calls")
        if isinstance(calls, list):
            for call in calls:
                if isinstance(call, dict):
                    cid, name, arguments = _call_parts(call)
                    yield ("call", cid, str(name), canonical_arguments(arguments))
        legacy = m.get("function_call")
        if isinstance(legacy, dict):
            name = str(legacy.get("name"))
            yield ("call", LEGACY + name, name, canonical_arguments(legacy.get("arguments")))


    def calls(self) -> list[tuple[str, str]]:
        # the ids and names of ``atoms``' call atoms, without canonicalising their arguments
        if self.role == TOOL:
            return []
        m: Message = self.raw
        out: list[tuple[str, str]] = []
        calls = m.get("tool_calls")
        if isinstance(calls, list):
            for call in calls:
                if isinstance(call, dict):
                    cid, name, _ = _call_parts(call)
                    out.append((cid, str(name)))
        legacy = m.get("function_call")
        if isinstance(legacy, dict):
            name = str(legacy.get("name"))
            out.append((LEGACY + name, name))
        return out


def build_items(messages: list[Message], keys: list[int], counts: list[int], start: int = 0) -> list[Item]:
    """Every message from ``start`` on as an item (a malformed one, which the shape check refuses anyway, as a
    plain item); ``keys`` and ``counts`` are those of ``messages[start:]``.

    One loop with positional arguments: this runs for every message of every request.
    """
    out: list[Item] = []
    append = out.append
    roles = ROLES
    for i in range(start, len(messages)):
        message = messages[i]
        role = message.get("role")
        neutral = roles.get(role, OTHER) if type(role) is str else OTHER
        if neutral is ASSISTANT:
            calls = message.get("tool_calls")
            if calls and type(calls) is list:
                ids = tuple([c["id"] for c in calls if type(c) is dict and type(c.get("id")) is str])
                item = ChatItem(message, ASSISTANT, ids, None, i)
            else:
                legacy = message.get("function_call")
                name = legacy.get("name") if type(legacy) is dict else None
                item = ChatItem(message, ASSISTANT, (LEGACY + name,) if type(name) is str else (), None, i)
        elif neutral is TOOL:
            rid = message.get("tool_call_id") if role == "tool" else message.get("name")
            if type(rid) is not str:
                item = ChatItem(message, OTHER, (), None, i)
            else:
                item = ChatItem(message, TOOL, (), rid if role == "tool" else LEGACY + rid, i)
        else:
            item = ChatItem(message, neutral, (), None, i)
        item.key = keys[i - start]
        item.tokens = counts[i - start]
        append(item)
    return out
