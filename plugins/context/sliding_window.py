"""``sliding-window``: the last ``keep_turns`` user turns; older turns dropped, no summariser."""

from __future__ import annotations

from typing import Any

from pydantic import Field

from plugins.base import ContextManager, HistoryResult, HistoryView, Params, window
from proxy.core.budget import TrimmerParams


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
        return window(view, params.keep_turns, params.cut_step)
