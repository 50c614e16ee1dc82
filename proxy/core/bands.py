"""Bands, turns and tool groups over neutral items (docs/design.md#3-bands-turns-and-tool-groups).

system band | committed history | current user turn | in-turn working memory.
A turn starts at a user item; items before the first one form a preamble turn.
A tool group is a call item (or, on wires that merge them, a run of call items)
with the results right after it; groups are atomic for trimming and caps.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass, field
from itertools import accumulate

from proxy.core.items import NO_GROUP, SYSTEM, UNKEPT, USER, Item, same_prefix


@dataclass
class Bands:
    """system band | committed history | current user turn | in-turn working memory."""

    system: list[Item]
    history: list[Item]
    current: Item | None
    working_memory: list[Item] = field(default_factory=list)

    def flatten(self, summary: Item | None = None) -> list[Item]:
        out = list(self.system)
        if summary is not None:
            out.append(summary)
        out.extend(self.history)
        if self.current is not None:
            out.append(self.current)
        out.extend(self.working_memory)
        return out


def split_bands(items: list[Item]) -> Bands:
    """Split a (repaired) item list into its four bands."""
    n = len(items)
    start = 0
    while start < n and items[start].role == SYSTEM:
        start += 1
    last_user = -1
    for i in range(n - 1, start - 1, -1):
        if items[i].role == USER:
            last_user = i
            break
    if last_user < 0:
        return Bands(items[:start], [], None, items[start:])
    return Bands(items[:start], items[start:last_user], items[last_user], items[last_user + 1 :])


def split_turns(history: list[Item]) -> list[list[Item]]:
    """A turn starts at a user item; anything before the first one is a preamble turn."""
    turns: list[list[Item]] = []
    current: list[Item] | None = None
    for item in history:
        if current is None or item.role == USER:
            current = [item]
            turns.append(current)
        else:
            current.append(item)
    return turns


def known_turns(history: list[Item]) -> tuple[list[list[Item]], list[int]]:
    """``split_turns(history)`` and each turn's tokens, reading back the split its first item last began.

    Consecutive requests of a conversation send the same history with turns appended (``Item.split``: the last
    history this item began, its turns, their tokens and ends). Every turn that ends before the first item where
    the two histories differ (as the very items) is the same turn: it ends where the same user item starts the
    next. Only the turns from there are split and counted. The turns' lists are shared with the requests that
    read them back: they are never changed (``plugins.base.HistoryView``). A history with a new item the warm
    memory did not keep (``Item.unkept``) is not remembered: its first item would hold it, uncounted.
    """
    holder = history[0] if history else None
    known = holder.split if holder is not None else None
    start = reused = 0
    turns: list[list[Item]] = []
    tokens: list[int] = []
    if known is not None:
        items, old_turns, old_tokens, old_ends = known
        differ = same_prefix(history, items)
        reused = bisect.bisect_left(old_ends, differ)  # the turns that end before it
        if reused:
            start = old_ends[reused - 1]
            turns, tokens = list(old_turns[:reused]), list(old_tokens[:reused])
    rest = split_turns(history[start:] if start else history)
    turns += rest
    tokens += [sum([item.tokens for item in turn]) for turn in rest]
    if holder is not None and not any(map(UNKEPT, history[start:])):
        holder.split = (history[:], tuple(turns), tuple(tokens), tuple(accumulate(map(len, turns))))
    return turns, tokens


def assign_groups(items: list[Item], merge_call_runs: bool, start: int = 0) -> None:
    """Number the atomic groups of a paired list: a call item (or a run of them) with its results.

    ``start``: the items before it are numbered already (a group number depends on the items before it
    alone); the numbering resumes from the first item of the group ``start - 1`` belongs to, where the
    state below is what it was when that group began.
    """
    if start >= len(items):  # all numbered already (a request that repeats a known one)
        return
    group = 0
    open_call = False  # the current group is a call group still taking results (or further calls)
    previous_was_call = False
    first = 0
    if start > 0:
        group = items[start - 1].group
        first = start - 1
        while first > 0 and items[first - 1].group == group:
            first -= 1
        group -= 1  # the group's first item starts it again, below
    for i in range(first, len(items)):
        item = items[i]
        if item.result_id is not None and open_call:
            previous_was_call = False
        elif item.call_ids and merge_call_runs and previous_was_call:
            pass
        else:
            group += 1
            open_call = bool(item.call_ids)
            previous_was_call = open_call
        item.group = group


def tool_groups(items: list[Item]) -> list[list[Item]]:
    """Atomic units for trimming, in order (an item without a group is a group of its own)."""
    groups: list[list[Item]] = []
    last = NO_GROUP
    for item in items:
        if item.group != NO_GROUP and item.group == last and groups:
            groups[-1].append(item)
        else:
            groups.append([item])
        last = item.group
    return groups
