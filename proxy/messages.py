"""Bands, turns and tool groups over the raw message objects (DESIGN §2).

Messages stay the exact ``dict`` objects the client sent; nothing here copies or
rewrites them, so an untouched message is forwarded equal to what was received.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

Message = dict[str, Any]

SYSTEM_ROLES = frozenset({"system", "developer"})
KNOWN_ROLES = frozenset({"system", "developer", "user", "assistant", "tool", "function"})


@dataclass
class Bands:
    """system band | committed history | current user turn | in-turn working memory."""

    system: list[Message]
    history: list[Message]
    current: Message | None
    working_memory: list[Message] = field(default_factory=list)

    def flatten(self, summary: Message | None = None) -> list[Message]:
        out = list(self.system)
        if summary is not None:
            out.append(summary)
        out.extend(self.history)
        if self.current is not None:
            out.append(self.current)
        out.extend(self.working_memory)
        return out


def role_of(message: Message) -> str:
    role = message.get("role")
    return role if isinstance(role, str) else ""


def split_bands(messages: list[Message]) -> Bands:
    """Split a (repaired) message list into its four bands."""
    n = len(messages)
    start = 0
    while start < n and messages[start].get("role") in SYSTEM_ROLES:
        start += 1
    last_user = -1
    for i in range(n - 1, start - 1, -1):
        if messages[i].get("role") == "user":
            last_user = i
            break
    if last_user < 0:
        return Bands(messages[:start], [], None, messages[start:])
    return Bands(messages[:start], messages[start:last_user], messages[last_user], messages[last_user + 1 :])


def split_turns(history: list[Message]) -> list[list[Message]]:
    """A turn starts at a user message; anything before the first one is a preamble turn."""
    turns: list[list[Message]] = []
    current: list[Message] | None = None
    for message in history:
        if current is None or message.get("role") == "user":
            current = [message]
            turns.append(current)
        else:
            current.append(message)
    return turns


def tool_call_ids(message: Message) -> list[str]:
    """Ids of the calls an assistant message makes (legacy ``function_call``: its function name)."""
    calls = message.get("tool_calls")
    if isinstance(calls, list) and calls:
        out = []
        for call in calls:
            if isinstance(call, dict) and isinstance(call.get("id"), str):
                out.append(call["id"])
        return out
    legacy = message.get("function_call")
    if isinstance(legacy, dict) and isinstance(legacy.get("name"), str):
        return [legacy["name"]]
    return []


def is_call(message: Message) -> bool:
    if role_of(message) != "assistant":
        return False
    calls = message.get("tool_calls")
    return (isinstance(calls, list) and len(calls) > 0) or isinstance(message.get("function_call"), dict)


def is_result(message: Message) -> bool:
    return role_of(message) in ("tool", "function")


def result_id(message: Message) -> str | None:
    if role_of(message) == "tool":
        tid = message.get("tool_call_id")
        return tid if isinstance(tid, str) else None
    name = message.get("name")
    return name if isinstance(name, str) else None


def tool_groups(messages: list[Message]) -> list[list[Message]]:
    """Atomic units for trimming: an assistant call message with the results right after it, or one message."""
    groups: list[list[Message]] = []
    for message in messages:
        if is_result(message) and groups and (is_call(groups[-1][0])):
            groups[-1].append(message)
        else:
            groups.append([message])
    return groups
