"""The pairing pass and the payload check (DESIGN §5).

``repair`` makes every tool call have exactly one result right after its
assistant message, counting each repair by kind; ``check`` is the proxy's
ProviderPayloadError: whatever is still invalid is refused, never forwarded.
Pairing works group by group, so the same ``tool_call_id`` may appear in two
different groups.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import Any

from proxy.errors import PayloadError
from proxy.messages import KNOWN_ROLES, Message, is_call, is_result, result_id, tool_call_ids

PLACEHOLDER = "[ctxproxy: no result was recorded for this tool call]"

# Repair kinds, as counted in reports, headers and metrics.
ORPHAN = "orphan_result"
DUPLICATE = "duplicate_result"
MOVED = "moved_result"
PLACEHOLDER_FILLED = "missing_result"
CALLS_DROPPED = "unanswered_calls"
EMPTY_DROPPED = "empty_assistant"


@dataclass
class _Group:
    call: Message
    ids: list[str]
    results: dict[str, Message] = field(default_factory=dict)
    order: list[str] = field(default_factory=list)
    displaced: bool = False


def repair(messages: list[Message]) -> tuple[list[Message], Counter[str]]:
    """Return the repaired list (the same list object when nothing changed) and repairs by kind."""
    repairs: Counter[str] = Counter()
    items: list[Message | _Group] = []
    open_by_id: dict[str, _Group] = {}
    answered: set[str] = set()
    last_item_group: _Group | None = None
    for message in messages:
        if not isinstance(message, dict):
            items.append(message)
            last_item_group = None
            continue
        if is_call(message):
            ids = tool_call_ids(message)
            group = _Group(message, ids)
            for tid in ids:
                open_by_id[tid] = group
                answered.discard(tid)
            items.append(group)
            last_item_group = group
            continue
        if is_result(message):
            rid = result_id(message)
            if rid is None:
                items.append(message)  # left for the payload check to name
                last_item_group = None
                continue
            owner = open_by_id.get(rid)
            if owner is None:
                repairs[DUPLICATE if rid in answered else ORPHAN] += 1
                continue
            if owner is not last_item_group:
                owner.displaced = True
                repairs[MOVED] += 1
            owner.results[rid] = message
            owner.order.append(rid)
            del open_by_id[rid]
            answered.add(rid)
            continue
        items.append(message)
        last_item_group = None

    changed = bool(repairs)
    out: list[Message] = []
    for item in items:
        if not isinstance(item, _Group):
            out.append(item)
            continue
        if not item.results:
            if item.ids:
                repairs[CALLS_DROPPED] += 1
                changed = True
                stripped = {k: v for k, v in item.call.items() if k not in ("tool_calls", "function_call")}
                if _has_content(stripped):
                    out.append(stripped)
                else:
                    repairs[EMPTY_DROPPED] += 1
            else:
                out.append(item.call)
            continue
        out.append(item.call)
        out.extend(item.results[tid] for tid in item.order)
        seen = set(item.order)
        for tid in item.ids:
            if tid not in seen:
                seen.add(tid)
                repairs[PLACEHOLDER_FILLED] += 1
                changed = True
                out.append(_placeholder(item.call, tid))
    return (out if changed else messages), repairs


def _has_content(message: Message) -> bool:
    content = message.get("content")
    if isinstance(content, str):
        return content.strip() != ""
    if isinstance(content, list):
        return len(content) > 0
    return bool(message.get("refusal"))


def _placeholder(call: Message, tid: str) -> Message:
    if isinstance(call.get("function_call"), dict):
        return {"role": "function", "name": tid, "content": PLACEHOLDER}
    return {"role": "tool", "tool_call_id": tid, "content": PLACEHOLDER}


def check_shape(messages: Any) -> None:
    """Raise PayloadError unless every message is well formed (pairing aside: ``repair`` fixes that)."""
    if not isinstance(messages, list):
        raise PayloadError("'messages' must be an array of message objects", param="messages",
                           code="invalid_messages")
    if not messages:
        raise PayloadError("'messages' must contain at least one message", param="messages",
                           code="empty_messages")
    for i, message in enumerate(messages):
        _check_one(message, i)


def scan(messages: Any) -> bool:
    """One fast pass: raise PayloadError for a malformed message; return whether pairing is valid.

    This runs on every request, so the common case (string contents, well-formed
    tool calls) costs a few dict lookups per message; anything unusual falls back
    to ``check_shape`` for a precise error.
    """
    if type(messages) is not list or not messages:
        check_shape(messages)
    pending: set[str] | None = None
    valid = True
    for i, m in enumerate(messages):
        if type(m) is not dict:
            check_shape(messages)
        role = m.get("role")
        content = m.get("content")
        if role == "tool":
            tid = m.get("tool_call_id")
            if type(tid) is not str or type(content) is not str:
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
                return _slow_scan(messages)
            calls = m.get("tool_calls")
            if calls is not None:
                if type(calls) is not list:
                    _check_one(m, i)
                ids: set[str] = set()
                for call in calls:
                    fn = call.get("function") if type(call) is dict else None
                    cid = call.get("id") if type(call) is dict else None
                    if type(cid) is not str or not cid or type(fn) is not dict or type(fn.get("name")) is not str \
                            or not fn["name"]:
                        _check_one(m, i)
                    ids.add(cid)  # type: ignore[arg-type]
                pending = ids or None
            if content is not None and type(content) is not str:
                _check_one(m, i)
        elif role == "user" or role == "system" or role == "developer":
            if type(content) is not str:
                _check_one(m, i)
        elif role == "function":
            return _slow_scan(messages)
        else:
            _check_one(m, i)
    return valid and not pending


def _check_one(message: Any, i: int) -> None:
    """The precise checks for one message that the fast scan found unusual (may well be valid)."""
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
    elif role in ("tool", "function") and result_id(message) is None:
        field_name = "tool_call_id" if role == "tool" else "name"
        raise PayloadError(f"{param} ({role}) has no {field_name}", param=f"{param}.{field_name}",
                           code="missing_tool_call_id")


def _slow_scan(messages: list[Any]) -> bool:
    check_shape(messages)
    return is_valid(messages)


def check(messages: Any) -> None:
    """The payload check: raise PayloadError (HTTP 400) unless a provider would accept ``messages``."""
    if not scan(messages):
        _check_pairing(messages)


def _check_pairing(messages: list[Message]) -> None:
    """Raise the precise pairing error (the slow path, taken only when ``scan`` found one)."""
    pending: set[str] = set()
    group_open = False
    for i, message in enumerate(messages):
        param = f"messages[{i}]"
        if is_result(message):
            tid = result_id(message)
            if not group_open or tid not in pending:
                raise PayloadError(f"{param} answers tool call {_short(tid)}, which is not pending right before it",
                                   param=param, code="unpaired_tool_result")
            pending.discard(tid or "")
            continue
        if pending:
            raise PayloadError(f"tool call(s) {sorted(pending)[:5]} got no result before {param}",
                               param=param, code="unpaired_tool_call")
        ids = tool_call_ids(message) if is_call(message) else []
        pending = set(ids)
        group_open = bool(ids)
    if pending:
        raise PayloadError(f"tool call(s) {sorted(pending)[:5]} got no result", param="messages",
                           code="unpaired_tool_call")


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
            fn = call.get("function")
            if not isinstance(fn, dict) or not isinstance(fn.get("name"), str) or not fn["name"]:
                raise PayloadError(f"{where} has no function name", param=f"{where}.function.name",
                                   code="invalid_tool_call")
    legacy = message.get("function_call")
    if legacy is not None and (not isinstance(legacy, dict) or not isinstance(legacy.get("name"), str)):
        raise PayloadError(f"{param}.function_call has no name", param=f"{param}.function_call",
                           code="invalid_tool_call")


def is_valid(messages: list[Message]) -> bool:
    """Whether ``messages`` passes the payload check (shape and pairing)."""
    try:
        check_shape(messages)
        _check_pairing(messages)
    except PayloadError:
        return False
    return True
