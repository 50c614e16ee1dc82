"""The Messages wire's shape check: what Anthropic's API would refuse is refused here, before anyone is billed.

Pairing is not checked here (the neutral repair fixes what it can and the pairing
check refuses the rest); everything else a provider would answer 400 to is: the
message and block shapes, ``tool_use``/``tool_result`` in the wrong role, empty
content, a missing ``max_tokens``, and more than four ``cache_control`` marks.
Each error names the offending path in Anthropic's own style (``messages.3.content.0``).
"""

from __future__ import annotations

from typing import Any

from proxy.core.errors import BadRequest, PayloadError
from proxy.core.fields import check_keys

MAX_BREAKPOINTS = 4  # Anthropic refuses a request with more than four cache_control marks
ROLES = ("user", "assistant", "system")  # system: mid-conversation system messages (a 2026 beta Claude Code uses)


def check_body(body: dict[str, Any], start: int = 0, known_marks: int = 0) -> int:
    """Raise BadRequest/PayloadError unless ``body`` is a well-formed Messages request; return the cache_control
    marks in its ``messages``.

    ``start``: the messages before it were checked as part of an earlier request of this conversation
    (``proxy.core.warm``) and hold ``known_marks`` marks; only the last of them is checked again (it was the
    final message there, where an empty assistant message is allowed)."""
    if body.get("max_tokens") is None:  # null is missing too: Anthropic requires an integer
        raise BadRequest("max_tokens: Field required", param="max_tokens", code="missing_max_tokens")
    check_system(body.get("system"))
    tools = body.get("tools")
    if tools is not None and (not isinstance(tools, list) or not all(isinstance(t, dict) for t in tools)):
        raise PayloadError("tools: must be an array of tool objects", param="tools", code="invalid_tools")
    messages = body.get("messages")
    if not isinstance(messages, list):
        raise PayloadError("messages: must be an array of message objects", param="messages",
                           code="invalid_messages")
    if not messages:
        raise PayloadError("messages: at least one message is required", param="messages", code="empty_messages")
    last = len(messages) - 1
    for i in range(max(0, start - 1), len(messages)):
        check_message(messages[i], i, final=i == last)
    in_messages = known_marks + sum(_marks(m["content"]) for m in messages[start:] if isinstance(m["content"], list))
    marks = breakpoints(body) + in_messages
    if marks > MAX_BREAKPOINTS:
        raise PayloadError(f"A maximum of {MAX_BREAKPOINTS} blocks with cache_control may be provided. Found {marks}.",
                           param="cache_control", code="too_many_cache_breakpoints")
    return in_messages


def check_system(system: Any) -> None:
    if system is None or isinstance(system, str):
        return
    if not isinstance(system, list):
        raise PayloadError("system: must be a string or an array of text blocks", param="system",
                           code="invalid_system")
    for j, block in enumerate(system):
        if not isinstance(block, dict) or not isinstance(block.get("type"), str):
            raise PayloadError(f"system.{j}: must be an object with a 'type'", param=f"system.{j}",
                               code="invalid_system")


def check_message(message: Any, i: int, *, final: bool) -> None:
    where = f"messages.{i}"
    if not isinstance(message, dict):
        raise PayloadError(f"{where}: must be an object", param=where, code="invalid_message")
    check_keys(message)  # a message split into items (its tool_result blocks) is never counted as a whole
    role = message.get("role")
    if not isinstance(role, str) or role not in ROLES:
        raise PayloadError(f"{where}.role: must be 'user', 'assistant' or 'system', got {_short(role)}",
                           param=f"{where}.role", code="invalid_role")
    content = message.get("content")
    if isinstance(content, str):
        if not content and not (final and role == "assistant"):
            raise PayloadError(f"{where}: all messages must have non-empty content except for the optional final "
                               "assistant message", param=f"{where}.content", code="empty_content")
        return
    if not isinstance(content, list):
        raise PayloadError(f"{where}.content: must be a string or an array of content blocks",
                           param=f"{where}.content", code="invalid_content")
    if not content and not (final and role == "assistant"):
        raise PayloadError(f"{where}: all messages must have non-empty content except for the optional final "
                           "assistant message", param=f"{where}.content", code="empty_content")
    for j, block in enumerate(content):
        check_block(block, f"{where}.content.{j}", role)


def check_block(block: Any, where: str, role: str) -> None:
    if not isinstance(block, dict) or not isinstance(block.get("type"), str):
        raise PayloadError(f"{where}: must be an object with a 'type'", param=where, code="invalid_content")
    kind = block["type"]
    if kind == "tool_use":
        if role != "assistant":
            raise PayloadError(f"{where}: tool_use blocks may only appear in assistant messages", param=where,
                               code="invalid_tool_call")
        if not isinstance(block.get("id"), str) or not block["id"]:
            raise PayloadError(f"{where}.id: a tool_use block needs a non-empty string id", param=f"{where}.id",
                               code="invalid_tool_call")
        if not isinstance(block.get("name"), str) or not block["name"]:
            raise PayloadError(f"{where}.name: a tool_use block needs a non-empty string name",
                               param=f"{where}.name", code="invalid_tool_call")
        if not isinstance(block.get("input"), dict):
            raise PayloadError(f"{where}.input: a tool_use block's input must be an object", param=f"{where}.input",
                               code="invalid_tool_call")
    elif kind == "tool_result":
        if role != "user":
            raise PayloadError(f"{where}: tool_result blocks may only appear in user messages", param=where,
                               code="invalid_tool_result")
        if not isinstance(block.get("tool_use_id"), str) or not block["tool_use_id"]:
            raise PayloadError(f"{where}.tool_use_id: a tool_result block needs a non-empty string tool_use_id",
                               param=f"{where}.tool_use_id", code="missing_tool_call_id")
        content = block.get("content")
        if content is not None and not isinstance(content, str):
            if not isinstance(content, list):
                raise PayloadError(f"{where}.content: must be a string or an array of content blocks",
                                   param=f"{where}.content", code="invalid_content")
            for k, inner in enumerate(content):
                if not isinstance(inner, dict) or not isinstance(inner.get("type"), str):
                    raise PayloadError(f"{where}.content.{k}: must be an object with a 'type'",
                                       param=f"{where}.content.{k}", code="invalid_content")


def breakpoints(body: dict[str, Any]) -> int:
    """``cache_control`` marks of the request outside its messages: tools and system blocks."""
    n = 0
    tools = body.get("tools")
    if isinstance(tools, list):
        n += sum(1 for t in tools if isinstance(t, dict) and t.get("cache_control") is not None)
    system = body.get("system")
    if isinstance(system, list):
        n += sum(1 for b in system if isinstance(b, dict) and b.get("cache_control") is not None)
    return n


def _marks(blocks: list[Any]) -> int:
    n = 0
    for block in blocks:
        if not isinstance(block, dict):
            continue
        if block.get("cache_control") is not None:
            n += 1
        inner = block.get("content") if block.get("type") == "tool_result" else None
        if isinstance(inner, list):
            n += _marks(inner)
    return n


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."
