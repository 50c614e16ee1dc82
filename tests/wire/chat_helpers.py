"""Chat Completions messages in tests and tools: as items, repaired, checked and counted (on the chat wire)."""

from __future__ import annotations

from collections import Counter
from typing import Any

from proxy.core.errors import PayloadError
from proxy.core.items import Item
from proxy.core.pairing import check, is_paired, repair
from proxy.core.tokens import TokenCounter, content_key
from proxy.wire.chat import WIRE
from proxy.wire.chat.items import SALT, Message, build_items, count_message
from proxy.wire.chat.shape import fast_scan


def scan(messages: Any) -> bool:
    """One fast pass: raise PayloadError for a malformed message; return whether pairing is valid."""
    valid = fast_scan(messages)
    return is_paired(items_of(messages)) if valid is None else valid




def items_of(messages: list[Message], counter: TokenCounter | None = None) -> list[Item]:
    """Chat messages as items (counted when a counter is given)."""
    zeros = [0] * len(messages)
    items = build_items(messages, zeros, zeros)
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
    return counter.cached(content_key(message) ^ SALT, message, count_message)


def counts(counter: TokenCounter, messages: list[Message]) -> list[int]:
    return counter.many([content_key(m) ^ SALT for m in messages], messages, count_message)
