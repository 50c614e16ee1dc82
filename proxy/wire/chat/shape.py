"""The shape check of a Chat Completions body's ``messages``: one fast scan, and the precise checks behind it.

Pairing aside (the repair fixes that), a malformed message is refused with a ``PayloadError``
that names it (``messages[3].role``).
"""

from __future__ import annotations

from typing import Any

from proxy.core.errors import PayloadError
from proxy.wire.chat.items import KNOWN_ROLES, RESERVED, Message


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


def fast_scan(messages: Any, start: int = 0) -> bool | None:
    """Raise PayloadError for a malformed message; return whether pairing is valid, or None when legacy
    ``function_call`` messages leave it to the check on items.

    This runs on every request, so the common case (string contents, well-formed tool calls)
    costs a few dict lookups per message; anything unusual gets the precise checks. ``start``: the
    messages before it were scanned before (an earlier request of the conversation), found well formed
    and paired with no call left waiting (``proxy.core.warm``); only the messages from ``start`` on are
    scanned, and the answer is the one the whole list would get.
    """
    if type(messages) is not list or not messages:
        check_shape(messages)
    pending: set[str] | None = None
    valid = True
    legacy = False
    for i in range(start, len(messages)):
        m = messages[i]
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
