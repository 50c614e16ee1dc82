"""``summarising`` (default): older turns replaced by one cached, reused summary (docs/design.md#6-summaries).

Under the summary threshold T nothing changes. Over it, the last ``keep_turns``
user turns stay verbatim and older turns go to the summariser. A cached summary
of a prefix of this history is reused while the payload built from it stays
within the hard budget B; past B a new one is made incrementally (previous
summary + the newly aged turns), cutting so the result leaves one hysteresis
step of headroom, so summariser calls grow with conversation growth, not with
request count. Summaries come from the one compaction service (``Services.compaction``:
``proxy.store.compaction``), which ``/responses/compact`` and the Messages compaction use too; a
summary carries the values its turns acted on that its text leaves out (its values section), and
is planned at its largest: ``max_summary_tokens`` of text plus ``max_values_tokens`` of values.
With the ``drop`` summariser (or no engine) older turns are dropped instead, on a prefix-stable grid,
and replaced by their values section alone (no model call): the summary of a policy that makes none.

Masking comes first (``mask_observations``, on by default; ``plugins.masking``): over T the
outputs of older tool calls are masked on their grid, and only when the masked conversation is
still over T is anything summarised. The summariser then sees the turns it summarises as the
client sent them (nothing a summary covers is lost to masking), summary cache keys stay the
chained hashes of the client's turns, and the turns kept verbatim after the summary are the
masked ones.
"""

from __future__ import annotations

import asyncio
import dataclasses
from typing import Any

from pydantic import Field

from plugins.base import (
    CachedSummary,
    ContextManager,
    HistoryResult,
    HistoryView,
    Params,
    window,
)
from plugins.masking import MASK_STEP, Masking, mask_observations
from proxy.core import values
from proxy.core.budget import TrimmerParams
from proxy.core.items import Item

DROPPED = "Values these turns acted on (the turns were dropped to save context)"


class SummarisingParams(Params):
    keep_turns: int = Field(10, ge=0, description="Recent user turns kept verbatim (aliases window_size, max_turns).")
    hysteresis_ratio: float = Field(0.1, ge=0.0, le=1.0, description="T = B/(1+ratio); reuse until B.")
    summary_threshold: int = Field(0, ge=0, description="Explicit T in tokens; 0 derives it from B.")
    summarizer: Any = Field("llm", description="Summariser binding: llm (default) or drop.")
    working_memory_messages: int | None = Field(None, ge=1, description="Cap on in-turn working-memory rows "
                                                 "(none by default: docs/quality.md).")
    cut_step: int | None = Field(None, ge=1, description="Turns dropped at once on the drop path "
                                 "(default ceil(keep_turns/2); see sliding-window).")
    mask_observations: bool = Field(True, description="Mask older tool outputs first and summarise only when "
                                    "the masked conversation is still over T (see observation-masking).")
    keep_recent: int = Field(10, ge=0, description="Tool results never masked: the conversation's last ones.")
    mask_step: int = Field(MASK_STEP, ge=1, description="Results masked at once (see observation-masking).")
    trimmer: TrimmerParams | None = None


def summary_text(covered_turns: int, text: str) -> str:
    """The text every wire renders as its summary item."""
    return f"[Conversation summary — {covered_turns} earlier turns]\n{text}"


class Summarising(ContextManager):
    name = "summarising"
    Params = SummarisingParams

    async def manage_history(self, view: HistoryView) -> HistoryResult:
        budget = view.budget
        if not view.turns or view.payload_tokens() <= budget.threshold:
            return HistoryResult.unchanged(view)
        masking = await self._mask(view)
        if masking is None:
            return await self._summarise(view, view)
        if masking.view.payload_tokens() <= budget.threshold:
            return masking.result()  # masking alone was enough
        return masking.note(await self._summarise(view, masking.view))

    async def _mask(self, view: HistoryView) -> Masking | None:
        params: Any = self.params
        if not params.mask_observations:
            return None
        if view.offload:  # a large conversation: its items are walked in a worker thread
            return await asyncio.to_thread(mask_observations, view, params.keep_recent, params.mask_step)
        return mask_observations(view, params.keep_recent, params.mask_step)

    async def _summarise(self, client: HistoryView, view: HistoryView) -> HistoryResult:
        """Summarise (or drop) older turns of ``view`` (over T); the summariser sees them as in ``client``."""
        budget = view.budget
        services = view.services
        compaction = services.compaction  # the one compaction service (proxy.store.compaction)
        if self.summarizer is None or compaction is None or compaction.unavailable(self.summarizer, services):
            return await self._drop(view)  # drop (or no summariser): older turns go, on a prefix-stable grid
        chain = await view.chain_hashes()
        found = await compaction.lookup(self.summarizer, services, chain)
        if found is not None:
            reused = self._with(view, found, "reused")
            if reused.summary is not None and view.payload_tokens(
                    found.covered_turns, reused.summary.tokens) <= budget.hard_budget:
                return reused
        cut, reserve = await self._plan(view)
        if view.payload_tokens(cut, reserve) > budget.hard_budget:
            return await self._drop(view)  # not even a summary would fit: keep the recent turns, trim the rest
        if cut == 0 or (found is not None and cut <= found.covered_turns):
            return self._with(view, found, "reused") if found is not None else HistoryResult.unchanged(view)
        made = await compaction.compact(self.summarizer, services, client.turns, chain, cut=cut, found=found,
                                        looked=True)
        if made.status == "would_create":
            return self._would_create(view, cut, found, made.text, reserve)
        if made.summary is None:
            return HistoryResult(turns=view.turns, summary_status=made.status, detail={"reason": made.reason})
        return self._with(view, made.summary, made.status)

    async def _plan(self, view: HistoryView) -> tuple[int, int]:
        """Where to cut, and the most tokens the summary may take there: the summariser's text at its cap plus
        the values section of the turns it covers (at most its cap). The section grows with the cut and the cut
        with the section, so the two are planned in turn, a few times (any excess left is the trimmer's)."""
        services = view.services
        reserve = services.summary_tokens
        cut = self._cut(view, reserve)
        for _ in range(3):
            if cut == 0 or services.values_tokens <= 0:
                break
            section, _ = await self._values(view, cut, values.SUMMARY_LEAD)
            size = view.counter.text(values.SEPARATOR + section.text) if section.text else 0
            if services.summary_tokens + size <= reserve:
                break
            reserve = services.summary_tokens + size
            cut = self._cut(view, reserve)
        return cut, reserve

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

    def _would_create(self, view: HistoryView, cut: int, found: CachedSummary | None, text: str,
                      reserve: int) -> HistoryResult:
        """Explain and ``assemble``: what a summary would replace, with the placeholder ``text``, nobody billed;
        ``reserve``: the most tokens the summary may take."""
        item: Item = view.summary_item(text, cut)
        replaced = sum(view.turn_tokens[:cut])
        return HistoryResult(
            turns=view.turns[cut:],
            summary=item,
            turns_summarised=cut,
            summary_status="would_create",
            removed={"summarised": max(0, replaced - reserve)},
            detail={"turns": cut, "tokens_replaced": replaced, "cached": False,
                    "cached_prefix_turns": found.covered_turns if found is not None else 0,
                    "summary_tokens_at_most": reserve},
        )

    async def _drop(self, view: HistoryView) -> HistoryResult:
        """Older turns dropped on the grid, and replaced by the values they acted on (nobody is billed)."""
        params: Any = self.params
        dropped = window(view, params.keep_turns, params.cut_step)
        cut = dropped.turns_dropped
        if not cut or view.services.values_tokens <= 0:
            return dropped
        kept, _ = await self._values(view, cut, DROPPED)
        if not kept.text:
            return dropped
        item: Item = view.summary_item(summary_text(cut, kept.text), cut)
        return dataclasses.replace(
            dropped, summary=item, removed={"windowed": max(0, dropped.removed.get("windowed", 0) - item.tokens)},
            detail={"turns": cut, "values_only": True, "values": kept.listed, "values_left_out": kept.left_out})

    async def _values(self, view: HistoryView, cut: int, lead: str) -> tuple[values.Section, int]:
        """The values section of ``view.turns[:cut]`` and its tokens: the compaction service's (remembered under
        the turns' chained hash, so a conversation's next request does not read its older turns again)."""
        services = view.services
        compaction = services.compaction
        if compaction is not None:
            chain = await view.chain_hashes()
            return await compaction.values_section(services, view.turns[:cut], chain[cut - 1], lead,
                                                   offload=view.offload)
        if view.offload:  # a large conversation: its items are walked in a worker thread
            made = await asyncio.to_thread(values.section_of, view.turns[:cut], services.values_tokens,
                                           view.counter.text, lead)
        else:
            made = values.section_of(view.turns[:cut], services.values_tokens, view.counter.text, lead)
        return made, view.counter.text(made.text) if made.text else 0
