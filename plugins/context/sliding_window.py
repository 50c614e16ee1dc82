"""``sliding-window``: the last ``keep_turns`` user turns; older turns dropped, no summariser."""

from __future__ import annotations

import math
from typing import Any

from pydantic import Field

from plugins.base import ContextManager, HistoryResult, HistoryView, Params, keep_at_least
from proxy.budget import TrimmerParams


class SlidingWindowParams(Params):
    keep_turns: int = Field(10, ge=1, description="User turns kept (aliases: window_size, max_turns).")
    cut_step: int | None = Field(
        None, ge=1, description="Turns dropped at once when the window moves (default ceil(keep_turns/2)): "
        "between keep_turns and keep_turns + cut_step - 1 turns are kept, and the forwarded prefix stays "
        "identical between moves. 1 = exactly keep_turns, moving every turn."
    )
    working_memory_messages: int | None = Field(None, ge=1, description="Cap on in-turn working-memory rows.")
    trimmer: TrimmerParams | None = None


class SlidingWindow(ContextManager):
    name = "sliding-window"
    Params = SlidingWindowParams

    async def manage_history(self, view: HistoryView) -> HistoryResult:
        params: Any = self.params
        keep = params.keep_turns
        step = params.cut_step or max(1, math.ceil(keep / 2))
        cut = keep_at_least(len(view.turns), keep, step)
        if cut == 0:
            return HistoryResult.unchanged(view)
        return HistoryResult(
            turns=view.turns[cut:],
            turns_dropped=cut,
            removed={"windowed": sum(view.turn_tokens[:cut])},
        )

    def limits(self) -> dict[str, Any]:
        return {"keep_turns": self.params.keep_turns}  # type: ignore[attr-defined]
