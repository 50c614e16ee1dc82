"""``summarising`` (default): older turns replaced by one cached, reused summary (docs/design.md#6-summaries).

Under the summary threshold T nothing changes. Over it, the last ``keep_turns``
user turns stay verbatim and older turns go to the summariser. A cached summary
of a prefix of this history is reused while the payload built from it stays
within the hard budget B; past B a new one is made incrementally (previous
summary + the newly aged turns), cutting so the result leaves one hysteresis
step of headroom, so summariser calls grow with conversation growth, not with
request count. With the ``drop`` summariser (or no engine) older turns are
dropped instead, on a prefix-stable grid.
"""

from __future__ import annotations

from typing import Any

from pydantic import Field

from plugins.base import (
    CachedSummary,
    ContextManager,
    HistoryResult,
    HistoryView,
    Params,
    SummaryScope,
    SummaryUnavailable,
    window,
)
from proxy.core.budget import TrimmerParams
from proxy.core.items import Item


class SummarisingParams(Params):
    keep_turns: int = Field(10, ge=0, description="Recent user turns kept verbatim (aliases window_size, max_turns).")
    hysteresis_ratio: float = Field(0.1, ge=0.0, le=1.0, description="T = B/(1+ratio); reuse until B.")
    summary_threshold: int = Field(0, ge=0, description="Explicit T in tokens; 0 derives it from B.")
    summarizer: Any = Field("llm", description="Summariser binding: llm (default) or drop.")
    working_memory_messages: int | None = Field(20, ge=1, description="Cap on in-turn working-memory rows.")
    cut_step: int | None = Field(None, ge=1, description="Turns dropped at once on the drop path "
                                 "(default ceil(keep_turns/2); see sliding-window).")
    trimmer: TrimmerParams | None = None


def summary_text(covered_turns: int, text: str) -> str:
    """The text every wire renders as its summary item."""
    return f"[Conversation summary — {covered_turns} earlier turns]\n{text}"


WOULD_SUMMARISE = "[ctxproxy explain: a summary of these turns would be created here]"


class Summarising(ContextManager):
    name = "summarising"
    Params = SummarisingParams

    async def manage_history(self, view: HistoryView) -> HistoryResult:
        budget = view.budget
        n = len(view.turns)
        if n == 0 or view.payload_tokens() <= budget.threshold:
            return HistoryResult.unchanged(view)
        services = view.services
        summarize = None
        if self.summarizer is not None and services.summaries is not None:
            summarize = self.summarizer.bind(services)
        if summarize is None or self.summarizer is None or services.summaries is None:
            return self._drop(view)
        scope = SummaryScope(services.tenant, self.summarizer.settings_id(services))
        chain = await view.chain_hashes()
        found = await services.summaries.lookup(scope, chain)
        if found is not None:
            reused = self._with(view, found, "reused")
            if reused.summary is not None and view.payload_tokens(
                    found.covered_turns, reused.summary.tokens) <= budget.hard_budget:
                return reused
        cut = self._cut(view, services.summary_tokens)
        if view.payload_tokens(cut, services.summary_tokens) > budget.hard_budget:
            return self._drop(view)  # not even a summary would fit: keep the recent turns, trim the rest
        if cut == 0 or (found is not None and cut <= found.covered_turns):
            return self._with(view, found, "reused") if found is not None else HistoryResult.unchanged(view)
        if services.dry_run:
            return self._would_create(view, cut, found)
        try:
            made, fresh = await services.summaries.obtain(scope, chain, cut, view.turns, found, summarize,
                                                          request_id=services.request_id, model=services.model)
        except SummaryUnavailable as exc:
            status = "pending" if exc.reason == "pending" else "failed"
            return HistoryResult(turns=view.turns, summary_status=status, detail={"reason": exc.reason})
        return self._with(view, made, "created" if fresh else "reused")

    def _cut(self, view: HistoryView, summary_tokens: int) -> int:
        """Summarise all but the last keep_turns turns, and more if the rest would leave no headroom."""
        params: Any = self.params
        n = len(view.turns)
        budget = view.budget
        target = min(budget.threshold, budget.hard_budget - budget.step)
        keep: int = params.keep_turns
        cut = max(0, n - keep)
        while cut < n and view.payload_tokens(cut, summary_tokens) > target:
            cut += 1
        return cut

    def _with(self, view: HistoryView, summary: CachedSummary, status: str) -> HistoryResult:
        k = summary.covered_turns
        item: Item = view.summary_item(summary_text(k, summary.text), k)
        replaced = sum(view.turn_tokens[:k])
        detail: dict[str, Any] = {"turns": k, "tokens_replaced": replaced, "cached": True}
        made = summary.made_with
        if status == "created" and made is not None:  # what making it cost (priced in proxy.serve.costs)
            detail["summarizer"] = {"model": made.model, "priced_model": made.priced_model,
                                    "prompt_tokens": made.prompt_tokens, "completion_tokens": made.completion_tokens}
        return HistoryResult(
            turns=view.turns[k:],
            summary=item,
            turns_summarised=k,
            summary_status=status,
            removed={"summarised": max(0, replaced - item.tokens)},
            detail=detail,
        )

    def _would_create(self, view: HistoryView, cut: int, found: CachedSummary | None) -> HistoryResult:
        """Explain and ``assemble``: what a summary would replace, with a placeholder, and nobody billed."""
        item: Item = view.summary_item(WOULD_SUMMARISE, cut)
        replaced = sum(view.turn_tokens[:cut])
        return HistoryResult(
            turns=view.turns[cut:],
            summary=item,
            turns_summarised=cut,
            summary_status="would_create",
            removed={"summarised": max(0, replaced - view.services.summary_tokens)},
            detail={"turns": cut, "tokens_replaced": replaced, "cached": False,
                    "cached_prefix_turns": found.covered_turns if found is not None else 0,
                    "summary_tokens_at_most": view.services.summary_tokens},
        )

    def _drop(self, view: HistoryView) -> HistoryResult:
        params: Any = self.params
        return window(view, params.keep_turns, params.cut_step)


