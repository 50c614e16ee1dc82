"""``observation-masking`` (``mask-observations``): older tool outputs replaced by a placeholder, nothing else.

Under the summary threshold T nothing changes. Over it, the outputs of the oldest tool results
give way to a placeholder naming the tool, the call id and the size removed, on the grid of
``plugins.masking`` (at least ``mask_step`` results and a hysteresis step of tokens at a time), until the
conversation is under T or only
the last ``keep_recent`` results are left. Calls, reasoning, messages, the current turn and
the working memory are never touched; when masking is not enough the trimmer still drops whole
tool groups, oldest first. No summariser is ever called.
"""

from __future__ import annotations

import asyncio
from typing import Any

from pydantic import Field

from plugins.base import ContextManager, HistoryResult, HistoryView, Params
from plugins.masking import MASK_STEP, mask_observations
from proxy.core.budget import TrimmerParams


class ObservationMaskingParams(Params):
    keep_recent: int = Field(10, ge=0, description="The most recent tool results of the conversation never "
                             "masked (those in the working memory count toward them).")
    mask_step: int = Field(
        MASK_STEP, ge=1, description="Results masked at once, at least: counted from the conversation's first "
        "result, a grid line falls after every run of at least mask_step results holding at least one hysteresis "
        "step (hysteresis_ratio x B tokens) of output, and the number masked is always on a line; the forwarded "
        "prefix changes only when the masked set moves to the next line. 1 = as few as the step of tokens allows."
    )
    hysteresis_ratio: float = Field(0.1, ge=0.0, le=1.0, description="T = B/(1+ratio): masking starts over T.")
    summary_threshold: int = Field(0, ge=0, description="Explicit T in tokens; 0 derives it from B.")
    working_memory_messages: int | None = Field(None, ge=1, description="Cap on in-turn working-memory rows.")
    trimmer: TrimmerParams | None = None


class ObservationMasking(ContextManager):
    name = "observation-masking"
    Params = ObservationMaskingParams

    async def manage_history(self, view: HistoryView) -> HistoryResult:
        if view.offload:  # a large conversation: its items are walked in a worker thread
            return await asyncio.to_thread(self._mask, view)
        return self._mask(view)

    def _mask(self, view: HistoryView) -> HistoryResult:
        params: Any = self.params
        masking = mask_observations(view, params.keep_recent, params.mask_step)
        return HistoryResult.unchanged(view) if masking is None else masking.result()
