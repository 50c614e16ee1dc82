"""Chat Completions (``POST /v1/chat/completions``): the first wire adapter.

Every message is one item; its ``raw`` is the client's own message object, so a
kept message is forwarded exactly as received. Calls pair by ``tool_call_id``
(every tool-call type: ``function``, ``custom`` …); legacy ``function_call`` pairs
with a ``function`` message by name. Errors and stream events have OpenAI's shape;
a stream ends with ``data: [DONE]``.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterator
from typing import Any

import orjson

from proxy.core import describe, media
from proxy.core.conversation import Conversation
from proxy.core.errors import PayloadError
from proxy.core.fields import check_keys
from proxy.core.items import ASSISTANT, OTHER, SYSTEM, TOOL, USER, Item, media_digest
from proxy.core.pairing import PLACEHOLDER, check, is_paired, repair
from proxy.core.tokens import REPLY_PRIMING, TokenCounter, content_key, output_schema
from proxy.wire.sse import CHAT as CHAT_STREAM
from proxy.wire.sse import StreamEnd

NAME = "chat"
TOKENS_PER_MESSAGE = 3
TOKENS_PER_NAME = 1
TOOL_CALL_OVERHEAD = 3
KNOWN_ROLES = frozenset({"system", "developer", "user", "assistant", "tool", "function"})
_ROLES = {"system": SYSTEM, "developer": SYSTEM, "user": USER, "assistant": ASSISTANT, "tool": TOOL,
          "function": TOOL}
_SALT = 0x1  # content keys of chat messages, distinct from other wires' formulas in the shared LRU
# legacy function_call ids are the function's name in a namespace no tool_call id can reach in practice (a NUL
# prefix), so a tool call never answers a legacy call or the other way round; a client id that starts with NUL is
# refused, so it cannot reach into that namespace
RESERVED = "\x00"
LEGACY = RESERVED + "fn:"
COMPLETION_ONLY = ("o1", "o3", "o4", "gpt-5")  # models that accept only max_completion_tokens

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


def canonical_arguments(arguments: Any) -> str:
    """Call arguments as compact sorted JSON when they parse, else as sent (so wires agree)."""
    if isinstance(arguments, str):
        try:
            parsed = orjson.loads(arguments)
        except orjson.JSONDecodeError:
            return arguments
        try:
            return orjson.dumps(parsed, option=orjson.OPT_SORT_KEYS).decode()
        except TypeError:  # it parses (1024 levels) but is nested deeper than orjson writes (254): as sent
            return arguments
    try:
        return orjson.dumps(arguments, option=orjson.OPT_SORT_KEYS).decode()
    except TypeError:
        return describe.as_text(arguments)


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

    def describe(self) -> str:
        m: Message = self.raw
        role = m.get("role") if isinstance(m.get("role"), str) else ""
        text, media_parts = _text_of(m.get("content"))
        if self.role == TOOL:
            ident = self.result_id or ""
            ident = ident[len(LEGACY):] if ident.startswith(LEGACY) else ident
            return describe.result(ident, " ".join([text, *media_parts]).strip())
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


def _items(messages: list[Message], keys: list[int], counts: list[int]) -> list[Item]:
    """Every message as an item (a malformed one, which the shape check refuses anyway, as a plain item).

    One loop with positional arguments: this runs for every message of every request.
    """
    out: list[Item] = []
    append = out.append
    roles = _ROLES
    for i, message in enumerate(messages):
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
        item.key = keys[i]
        item.tokens = counts[i]
        append(item)
    return out


class ChatWire:
    """The Chat Completions adapter (stateless; one shared instance)."""

    name = NAME
    field = "messages"
    merge_call_runs = False
    output_fields: tuple[str, ...] = ("max_completion_tokens", "max_tokens")
    choices_field: str | None = "n"
    path = "/chat/completions"
    error_shape = "openai"
    stream_end: StreamEnd = CHAT_STREAM

    def parse(self, body: dict[str, Any], counter: TokenCounter) -> Conversation:
        messages = body.get("messages")
        paired = _scan(messages)
        assert isinstance(messages, list)
        keys = [content_key(m) ^ _SALT for m in messages]
        items = _items(messages, keys, counter.many(keys, messages, count_message))
        if paired is None:
            paired = is_paired(items)
        fixed = (REPLY_PRIMING + counter.tools(body.get("tools"))
                 + counter.tools(body.get("functions"), "functions")
                 + counter.tools(output_schema(body.get("response_format")), "response_format"))
        return Conversation(items, fixed, paired)

    def render(self, body: dict[str, Any], items: list[Item], changes: dict[str, Any]) -> dict[str, Any]:
        out = dict(body)
        out["messages"] = [item.raw for item in items]
        out.update(changes)
        return out

    def count(self, item: Item, counter: TokenCounter) -> None:
        item.key = content_key(item.raw) ^ _SALT
        item.tokens = counter.cached(item.key, item.raw, count_message)

    def summary(self, text: str, covered_turns: int, counter: TokenCounter) -> Item:
        item = ChatItem({"role": "system", "content": text}, SYSTEM)
        self.count(item, counter)
        return item

    def without_calls(self, item: Item) -> Item | None:
        stripped = {k: v for k, v in item.raw.items() if k not in ("tool_calls", "function_call")}
        if not _has_content(stripped):
            return None
        return ChatItem(stripped, ASSISTANT, source=item.source)

    def placeholder(self, call: Item, call_id: str) -> Item | None:
        if call_id.startswith(LEGACY):
            raw: Message = {"role": "function", "name": call_id[len(LEGACY):], "content": PLACEHOLDER}
        else:
            raw = {"role": "tool", "tool_call_id": call_id, "content": PLACEHOLDER}
        return ChatItem(raw, TOOL, result_id=call_id, source=call.source)

    def mask(self, item: Item, text: str, counter: TokenCounter) -> Item | None:
        masked = mask_result(item, text)
        if masked is not None:
            self.count(masked, counter)
        return masked

    def output_field(self, upstream_model: str) -> str:
        name = upstream_model.rsplit("/", 1)[-1]
        return "max_completion_tokens" if name.startswith(COMPLETION_ONLY) else "max_tokens"


WIRE = ChatWire()


def mask_result(item: Item, text: str) -> Item | None:
    """A ``tool`` (or legacy ``function``) message with ``text`` as its content (observation masking).

    ``tool_call_id``, ``name`` and every other key stay as the client sent them; text parts, images,
    audio and files in the content all give way to ``text``.
    """
    raw = item.raw
    if item.role != TOOL or item.result_id is None or not isinstance(raw, dict):
        return None
    return ChatItem({**raw, "content": text}, TOOL, result_id=item.result_id, source=item.source)


def _has_content(message: Message) -> bool:
    content = message.get("content")
    if isinstance(content, str) and content.strip():
        return True
    if isinstance(content, list) and content:
        return True
    return bool(message.get("refusal")) or bool(message.get("audio"))


# -- the shape check: the fast scan and the precise checks behind it ---------------------------------


def check_shape(messages: Any) -> None:
    """Raise PayloadError unless every message is well formed (pairing aside: the repair fixes that)."""
    if not isinstance(messages, list):
        raise PayloadError("'messages' must be an array of message objects", param="messages",
                           code="invalid_messages")
    if not messages:
        raise PayloadError("'messages' must contain at least one message", param="messages",
                           code="empty_messages")
    for i, message in enumerate(messages):
        _check_one(message, i)


def scan(messages: Any) -> bool:
    """One fast pass: raise PayloadError for a malformed message; return whether pairing is valid."""
    valid = _scan(messages)
    return is_paired(items_of(messages)) if valid is None else valid


def _scan(messages: Any) -> bool | None:
    """``scan``, except that None means: legacy ``function_call`` messages, check pairing on items.

    This runs on every request, so the common case (string contents, well-formed tool calls)
    costs a few dict lookups per message; anything unusual gets the precise checks.
    """
    if type(messages) is not list or not messages:
        check_shape(messages)
    pending: set[str] | None = None
    valid = True
    legacy = False
    for i, m in enumerate(messages):
        if type(m) is not dict:
            check_shape(messages)
        role = m.get("role")
        content = m.get("content")
        if role == "tool":
            tid = m.get("tool_call_id")
            if type(tid) is not str or type(content) is not str or tid[:1] == "\x00":
                _check_one(m, i)
            if pending is not None and tid in pending:
                pending.discard(tid)
            else:
                valid = False
            continue
        if pending:
            valid = False
        pending = None
        if role == "assistant":
            if m.get("function_call") is not None:
                _check_one(m, i)
                legacy = True
            calls = m.get("tool_calls")
            if calls is not None:
                if type(calls) is not list:
                    _check_one(m, i)
                ids: set[str] = set()
                for call in calls:
                    fn = call.get("function") if type(call) is dict else None
                    cid = call.get("id") if type(call) is dict else None
                    if type(cid) is not str or not cid or cid[0] == "\x00" or type(fn) is not dict \
                            or type(fn.get("name")) is not str or not fn["name"]:
                        _check_one(m, i)  # another tool-call type, or an invalid call
                    if cid in ids:
                        valid = False  # the same id twice: the pairing check names it
                    ids.add(cid)  # type: ignore[arg-type]
                pending = ids or None
            if content is not None and type(content) is not str:
                _check_one(m, i)
        elif role == "user" or role == "system" or role == "developer":
            if type(content) is not str:
                _check_one(m, i)
        elif role == "function":
            _check_one(m, i)
            legacy = True
        else:
            _check_one(m, i)
    if legacy:
        return None
    return valid and not pending


def _check_one(message: Any, i: int) -> None:
    """The precise checks for one message that the fast scan found unusual (it may well be valid)."""
    param = f"messages[{i}]"
    if not isinstance(message, dict):
        raise PayloadError(f"{param} must be an object", param=param, code="invalid_message")
    role = message.get("role")
    if not isinstance(role, str) or role not in KNOWN_ROLES:  # (a dict or list role is not even hashable)
        raise PayloadError(f"{param}.role must be one of {sorted(KNOWN_ROLES)}, got {_short(role)}",
                           param=f"{param}.role", code="invalid_role")
    _check_content(message, param, role)
    if role == "assistant":
        _check_calls(message, param)
    elif role == "tool" and not isinstance(message.get("tool_call_id"), str):
        raise PayloadError(f"{param} (tool) has no tool_call_id", param=f"{param}.tool_call_id",
                           code="missing_tool_call_id")
    elif role == "tool" and message["tool_call_id"].startswith(RESERVED):
        raise PayloadError(f"{param}.tool_call_id may not start with a NUL character", param=f"{param}.tool_call_id",
                           code="invalid_tool_call")
    elif role == "function" and not isinstance(message.get("name"), str):
        raise PayloadError(f"{param} (function) has no name", param=f"{param}.name", code="missing_tool_call_id")


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


def _check_content(message: Message, param: str, role: str) -> None:
    content = message.get("content")
    if content is None:
        if role in ("user", "system", "developer", "tool") and "content" not in message:
            raise PayloadError(f"{param} ({role}) has no content", param=f"{param}.content", code="missing_content")
        return
    if isinstance(content, str):
        return
    if isinstance(content, list):
        for j, part in enumerate(content):
            if not isinstance(part, dict) or not isinstance(part.get("type"), str):
                raise PayloadError(f"{param}.content[{j}] must be an object with a 'type'",
                                   param=f"{param}.content[{j}]", code="invalid_content")
        return
    raise PayloadError(f"{param}.content must be a string, an array of parts or null",
                       param=f"{param}.content", code="invalid_content")


def _check_calls(message: Message, param: str) -> None:
    calls = message.get("tool_calls")
    if calls is not None:
        if not isinstance(calls, list):
            raise PayloadError(f"{param}.tool_calls must be an array", param=f"{param}.tool_calls",
                               code="invalid_tool_call")
        for j, call in enumerate(calls):
            where = f"{param}.tool_calls[{j}]"
            if not isinstance(call, dict) or not isinstance(call.get("id"), str) or not call["id"]:
                raise PayloadError(f"{where} has no id", param=f"{where}.id", code="invalid_tool_call")
            if call["id"].startswith(RESERVED):
                raise PayloadError(f"{where}.id may not start with a NUL character", param=f"{where}.id",
                                   code="invalid_tool_call")
            kind = call.get("type", "function")
            body = call.get("function") if kind == "function" else call.get(kind) if isinstance(kind, str) else None
            if kind in ("function", "custom") and (
                    not isinstance(body, dict) or not isinstance(body.get("name"), str) or not body["name"]):
                raise PayloadError(f"{where} has no {kind} name", param=f"{where}.{kind}.name",
                                   code="invalid_tool_call")
    legacy = message.get("function_call")
    if legacy is not None and (not isinstance(legacy, dict) or not isinstance(legacy.get("name"), str)):
        raise PayloadError(f"{param}.function_call has no name", param=f"{param}.function_call",
                           code="invalid_tool_call")


# -- conveniences for callers that hold chat messages (tests, tools) ---------------------------------


def items_of(messages: list[Message], counter: TokenCounter | None = None) -> list[Item]:
    """Chat messages as items (counted when a counter is given)."""
    zeros = [0] * len(messages)
    items = _items(messages, zeros, zeros)
    if counter is not None:
        for item in items:
            WIRE.count(item, counter)
    return items


def repair_messages(messages: list[Message]) -> tuple[list[Message], Counter[str]]:
    """The pairing repair on chat messages (the same list object when nothing changed)."""
    items = items_of(messages)
    repaired, repairs = repair(items, WIRE)
    return (messages if repaired is items else [item.raw for item in repaired]), repairs


def check_messages(messages: Any) -> None:
    """The payload check on chat messages: shape and pairing (raises PayloadError)."""
    scan(messages)
    check(items_of(messages))


def is_valid(messages: Any) -> bool:
    """Whether chat messages pass the payload check."""
    try:
        check_messages(messages)
    except PayloadError:
        return False
    return True


def count(counter: TokenCounter, message: Message) -> int:
    """One chat message's tokens (cached under its content key)."""
    return counter.cached(content_key(message) ^ _SALT, message, count_message)


def counts(counter: TokenCounter, messages: list[Message]) -> list[int]:
    return counter.many([content_key(m) ^ _SALT for m in messages], messages, count_message)
