"""``stack`` (``full-history``): the last ``max_messages`` history messages, cut at a group boundary."""

from __future__ import annotations

import asyncio
import math
from typing import Any

from pydantic import Field

from plugins.base import ContextManager, HistoryResult, HistoryView, Params, stable_cut
from proxy.core.bands import split_turns, tool_groups
from proxy.core.budget import TrimmerParams


class StackParams(Params):
    max_messages: int | None = Field(None, ge=1, description="Cap on history messages (omit = no cap).")
    cut_step: int | None = Field(
        None, ge=1, description="Messages cut at once when the cap is reached (default ceil(max_messages/4)), "
        "so the forwarded prefix changes rarely. 1 = cut one message at a time."
    )
    working_memory_messages: int | None = Field(None, ge=1, description="Cap on in-turn working-memory rows.")
    trimmer: TrimmerParams | None = None


class Stack(ContextManager):
    name = "stack"
    Params = StackParams

    async def manage_history(self, view: HistoryView) -> HistoryResult:
        if view.offload:  # a large conversation: its items are walked in a worker thread
            return await asyncio.to_thread(self._cut, view)
        return self._cut(view)

    def _cut(self, view: HistoryView) -> HistoryResult:
        params: Any = self.params
        cap = params.max_messages
        flat = [item for turn in view.turns for item in turn]
        if cap is None or len(flat) <= cap:
            return HistoryResult.unchanged(view)
        step = params.cut_step or max(1, math.ceil(cap / 4))
        want = stable_cut(len(flat) - cap, step, len(flat))
        # advance to the first group boundary at or after `want`: groups are atomic, and a
        # leading tool result would have lost its call
        cut = 0
        for group in tool_groups(flat):
            if cut >= want:
                break
            cut += len(group)
        kept = flat[cut:]
        return HistoryResult(
            turns=split_turns(kept),
            turns_dropped=sum(1 for item in flat[:cut] if item.starts_turn),
            removed={"windowed": sum(item.tokens for item in flat[:cut])},
        )
