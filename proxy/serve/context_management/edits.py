"""``context_management`` emulated for an upstream that does not apply it (a litellm route,
``context_management: emulate``).

What is emulated follows Anthropic's documentation as of 2026-12 and the request and
response types of the official SDK (``anthropic`` 2.14: ``BetaClearToolUses20250919EditParam``,
``BetaClearThinking20251015EditParam``, ``BetaCompact20260112EditParam``,
``BetaContextManagementResponse``, ``BetaCompactionBlock``):

- https://platform.claude.com/docs/en/build-with-claude/context-editing
  ``clear_tool_uses_20250919`` (beta ``context-management-2025-06-27``): once ``trigger`` is
  exceeded (default 100,000 input tokens; or a number of ``tool_uses``), the oldest tool results
  are replaced by placeholder text, chronologically, keeping the ``keep`` most recent tool uses
  (default 3); ``exclude_tools`` are never cleared; ``clear_tool_inputs`` (true, or a list of tool
  names) clears the calls' inputs too; ``clear_at_least``: the context is only modified if at least
  that many tokens can be removed. Reported as ``cleared_tool_uses`` and ``cleared_input_tokens``.
  ``clear_thinking_20251015``: thinking blocks of older assistant turns are removed, keeping the
  last ``keep`` turns (``{"type": "thinking_turns", "value": N}``, default 1; ``"all"`` keeps
  every one). An assistant turn is everything the assistant says between two user messages that
  carry more than tool results. Reported as ``cleared_thinking_turns`` and ``cleared_input_tokens``.
- https://platform.claude.com/docs/en/build-with-claude/compaction
  ``compact_20260112`` (beta ``compact-2026-01-12``): once the input exceeds ``trigger`` (default
  150,000 tokens, at least 50,000) the conversation is summarised, the answer starts with a
  ``compaction`` block holding the summary (alone, with ``stop_reason: "compaction"``, when
  ``pause_after_compaction``), and on later requests every block before the last compaction block
  is dropped. ``instructions`` are added to the summarisation prompt.

Departures, deliberate: the summary comes from ctxproxy's own cached, single-flight summariser
(so the same history is summarised once, whatever wire or edit asked for it); it covers the
history before the current user turn, which is forwarded verbatim, and the compaction block it
returns records (in ``encrypted_content``, which clients round-trip verbatim) where the kept part
starts, so a later request keeps that turn instead of losing it. Token figures are the proxy's
own counts scaled by the model's calibration factor.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from proxy.core.errors import BadRequest
from proxy.core.tokens import TokenCounter
from proxy.wire.messages.items import THINKING, count_block

CLEAR_TOOL_USES = "clear_tool_uses_20250919"
CLEAR_THINKING = "clear_thinking_20251015"
COMPACT = "compact_20260112"
EDIT_TYPES = (CLEAR_TOOL_USES, CLEAR_THINKING, COMPACT)
TOOL_USES_TRIGGER = 100_000
TOOL_USES_KEEP = 3
THINKING_KEEP = 1
COMPACT_TRIGGER = 150_000
COMPACT_MIN_TRIGGER = 50_000
CLEARED = "[ctxproxy: this tool result was cleared by context_management (clear_tool_uses_20250919)]"
# encrypted_content of the compaction blocks ctxproxy makes: where the kept part starts
MARKER = "ctxproxy-compaction/1:"

Message = dict[str, Any]


@dataclass(frozen=True)
class Edit:
    type: str
    params: dict[str, Any]


def parse_edits(value: Any) -> list[Edit]:
    """The request's ``context_management.edits``, validated (BadRequest in Anthropic's words otherwise)."""
    if not isinstance(value, dict):
        raise BadRequest("context_management: must be an object", param="context_management",
                         code="invalid_context_management")
    edits = value.get("edits", [])
    if not isinstance(edits, list):
        raise BadRequest("context_management.edits: must be an array", param="context_management.edits",
                         code="invalid_context_management")
    out: list[Edit] = []
    for i, edit in enumerate(edits):
        where = f"context_management.edits.{i}"
        if not isinstance(edit, dict) or edit.get("type") not in EDIT_TYPES:
            kind = edit.get("type") if isinstance(edit, dict) else None
            raise BadRequest(f"{where}.type: must be one of {', '.join(EDIT_TYPES)}, got {str(kind)[:60]!r}",
                             param=f"{where}.type", code="invalid_context_management")
        _check_params(edit, where)
        out.append(Edit(edit["type"], edit))
    return out


def _check_params(edit: dict[str, Any], where: str) -> None:
    kind = edit["type"]
    if kind == CLEAR_TOOL_USES:
        _threshold(edit.get("trigger"), f"{where}.trigger", ("input_tokens", "tool_uses"))
        _threshold(edit.get("keep"), f"{where}.keep", ("tool_uses",))
        _threshold(edit.get("clear_at_least"), f"{where}.clear_at_least", ("input_tokens",))
        exclude = edit.get("exclude_tools")
        if exclude is not None and not (isinstance(exclude, list) and all(isinstance(t, str) for t in exclude)):
            raise _bad(f"{where}.exclude_tools", "must be an array of tool names")
        inputs = edit.get("clear_tool_inputs")
        if inputs is not None and not isinstance(inputs, bool) and not (
                isinstance(inputs, list) and all(isinstance(t, str) for t in inputs)):
            raise _bad(f"{where}.clear_tool_inputs", "must be a boolean or an array of tool names")
    elif kind == CLEAR_THINKING:
        keep = edit.get("keep")
        if keep is not None and keep != "all" and not (isinstance(keep, dict) and keep.get("type") == "all"):
            _threshold(keep, f"{where}.keep", ("thinking_turns",))
    else:
        trigger = _threshold(edit.get("trigger"), f"{where}.trigger", ("input_tokens",))
        if trigger is not None and trigger < COMPACT_MIN_TRIGGER:
            raise _bad(f"{where}.trigger.value", f"must be at least {COMPACT_MIN_TRIGGER}")
        if edit.get("instructions") is not None and not isinstance(edit["instructions"], str):
            raise _bad(f"{where}.instructions", "must be a string")
        if edit.get("pause_after_compaction") is not None and not isinstance(edit["pause_after_compaction"], bool):
            raise _bad(f"{where}.pause_after_compaction", "must be a boolean")


def _threshold(value: Any, where: str, kinds: tuple[str, ...]) -> int | None:
    if value is None:
        return None
    if not isinstance(value, dict) or value.get("type") not in kinds:
        raise _bad(where, f"must be an object with type {' or '.join(kinds)} and an integer value")
    number = value.get("value")
    if isinstance(number, bool) or not isinstance(number, int) or number < 0:
        raise _bad(f"{where}.value", "must be a non-negative integer")
    return number


def _bad(where: str, what: str) -> BadRequest:
    return BadRequest(f"{where}: {what}", param=where, code="invalid_context_management")


# -- the clearing edits ------------------------------------------------------------------------------


def starts_turn(message: Message) -> bool:
    """A user message with more than tool results: where a turn (and an assistant turn) begins."""
    if message.get("role") != "user":
        return False
    content = message.get("content")
    if isinstance(content, str):
        return True
    return isinstance(content, list) and any(isinstance(b, dict) and b.get("type") != "tool_result" for b in content)


def clear_thinking(messages: list[Message], edit: Edit, counter: TokenCounter) -> tuple[list[Message], dict[str, Any]]:
    keep_value = edit.params.get("keep")
    if keep_value == "all" or (isinstance(keep_value, dict) and keep_value.get("type") == "all"):
        return messages, {"type": CLEAR_THINKING, "cleared_thinking_turns": 0, "cleared_input_tokens": 0}
    keep = keep_value["value"] if isinstance(keep_value, dict) else THINKING_KEEP
    turn = 0
    turn_of: list[int] = []
    for message in messages:
        if starts_turn(message):
            turn += 1
        turn_of.append(turn)
    assistant_turns = sorted({t for m, t in zip(messages, turn_of) if m.get("role") == "assistant"})
    kept_turns = set(assistant_turns[len(assistant_turns) - keep:]) if keep > 0 else set()
    out: list[Message] = []
    cleared_turns: set[int] = set()
    cleared = 0
    for message, t in zip(messages, turn_of):
        content = message.get("content")
        if message.get("role") != "assistant" or t in kept_turns or not isinstance(content, list):
            out.append(message)
            continue
        kept = [b for b in content if not (isinstance(b, dict) and b.get("type") in THINKING)]
        if len(kept) == len(content):
            out.append(message)
            continue
        cleared += sum(count_block(counter, b) for b in content if isinstance(b, dict) and b.get("type") in THINKING)
        cleared_turns.add(t)
        if kept:
            out.append({**message, "content": kept})
    return out, {"type": CLEAR_THINKING, "cleared_thinking_turns": len(cleared_turns), "cleared_input_tokens": cleared}


@dataclass
class _Use:
    message: int
    block: int
    name: str
    result: tuple[int, int] | None  # (message, block) of its tool_result in the next message


def _tool_uses(messages: list[Message]) -> list[_Use]:
    uses: list[_Use] = []
    for i, message in enumerate(messages):
        content = message.get("content")
        if message.get("role") != "assistant" or not isinstance(content, list):
            continue
        following = messages[i + 1].get("content") if i + 1 < len(messages) else None
        results: dict[str, int] = {}
        if isinstance(following, list) and messages[i + 1].get("role") == "user":
            for k, block in enumerate(following):
                if isinstance(block, dict) and block.get("type") == "tool_result":
                    results.setdefault(str(block.get("tool_use_id")), k)
        for j, block in enumerate(content):
            if isinstance(block, dict) and block.get("type") == "tool_use":
                found = results.get(str(block.get("id")))
                uses.append(_Use(i, j, str(block.get("name")), (i + 1, found) if found is not None else None))
    return uses


def clear_tool_uses(messages: list[Message], edit: Edit, counter: TokenCounter,
                    input_tokens: int) -> tuple[list[Message], dict[str, Any] | None]:
    """The edit, or (messages, None) when it does not fire or would clear too little."""
    p = edit.params
    uses = _tool_uses(messages)
    trigger = p.get("trigger") or {"type": "input_tokens", "value": TOOL_USES_TRIGGER}
    measured = len(uses) if trigger["type"] == "tool_uses" else input_tokens
    if measured <= trigger["value"]:
        return messages, None
    keep = (p.get("keep") or {}).get("value", TOOL_USES_KEEP)
    exclude = set(p.get("exclude_tools") or ())
    inputs = p.get("clear_tool_inputs") or False
    candidates = [u for u in (uses[: len(uses) - keep] if keep > 0 else uses) if u.name not in exclude]
    plan: list[tuple[_Use, bool, bool]] = []  # (use, clear its result, clear its input)
    total = 0
    for use in candidates:
        result = _block(messages, use.result) if use.result is not None else None
        clear_result = result is not None and result.get("content") != CLEARED
        call = messages[use.message]["content"][use.block]
        clear_input = (inputs is True or (isinstance(inputs, list) and use.name in inputs)) and call.get("input") != {}
        if not clear_result and not clear_input:
            continue
        if clear_result and result is not None:
            total += max(0, count_block(counter, result) - count_block(counter, {**result, "content": CLEARED}))
        if clear_input:
            total += max(0, counter.json(call.get("input")) - counter.json({}))
        plan.append((use, clear_result, clear_input))
    least = (p.get("clear_at_least") or {}).get("value", 0)
    if not plan or total < least:
        return messages, None
    out = list(messages)
    copies: dict[int, list[Any]] = {}
    for use, clear_result, clear_input in plan:
        if clear_input:
            _replace(out, copies, use.message, use.block, lambda b: {**b, "input": {}})
        if clear_result and use.result is not None:
            _replace(out, copies, use.result[0], use.result[1], lambda b: {**b, "content": CLEARED})
    return out, {"type": CLEAR_TOOL_USES, "cleared_tool_uses": len(plan), "cleared_input_tokens": total}


def _block(messages: list[Message], where: tuple[int, int]) -> dict[str, Any] | None:
    block = messages[where[0]]["content"][where[1]]
    return block if isinstance(block, dict) else None


def _replace(messages: list[Message], copies: dict[int, list[Any]], i: int, j: int,
             change: Callable[[dict[str, Any]], dict[str, Any]]) -> None:
    """Edit block j of message i in a copy of that message (the client's objects are never changed).

    ``copies`` holds the content lists already copied, by message: a message is copied once however
    many of its blocks are edited (a user message may hold thousands of results).
    """
    content = copies.get(i)
    if content is None:
        content = copies[i] = list(messages[i]["content"])
        messages[i] = {**messages[i], "content": content}
    content[j] = change(content[j])


# -- compaction ----------------------------------------------------------------------------------------


def resume_compaction(messages: list[Message]) -> list[Message]:
    """Drop what the last compaction block covers and put its summary first (as a user text message).

    A block ctxproxy made says where its kept part starts (``MARKER``); any other follows
    Anthropic's rule: every block before the compaction block is dropped.
    """
    found: tuple[int, int] | None = None
    for i in range(len(messages) - 1, -1, -1):
        content = messages[i].get("content")
        if messages[i].get("role") == "assistant" and isinstance(content, list):
            for j in range(len(content) - 1, -1, -1):
                if isinstance(content[j], dict) and content[j].get("type") == "compaction":
                    found = (i, j)
                    break
        if found:
            break
    if found is None:
        return messages
    i, j = found
    block = messages[i]["content"][j]
    start = _marker(block.get("encrypted_content"))
    kept: list[Message | None]
    if start is not None and 0 <= start <= i:
        kept = [_without_compaction(m) for m in messages[start:]]
    else:
        rest = messages[i]["content"][j + 1:]
        kept = [{**messages[i], "content": rest}] if rest else []
        kept.extend(_without_compaction(m) for m in messages[i + 1:])
    out = [m for m in kept if m is not None]
    summary = block.get("content")
    if isinstance(summary, str) and summary:
        out.insert(0, summary_message(summary))
    return out


def summary_message(text: str) -> Message:
    """The compaction summary as the forwarded conversation's first message (where the pipeline puts its own)."""
    return {"role": "user", "content": [{"type": "text", "text": text}]}


def compaction_block(text: str, start: int) -> dict[str, Any]:
    return {"type": "compaction", "content": text, "encrypted_content": f"{MARKER}{start}"}


def _marker(value: Any) -> int | None:
    if isinstance(value, str) and value.startswith(MARKER) and value[len(MARKER):].isdigit():
        return int(value[len(MARKER):])
    return None


def _without_compaction(message: Message) -> Message | None:
    content = message.get("content")
    if message.get("role") != "assistant" or not isinstance(content, list):
        return message
    kept = [b for b in content if not (isinstance(b, dict) and b.get("type") == "compaction")]
    if len(kept) == len(content):
        return message
    return {**message, "content": kept} if kept else None
