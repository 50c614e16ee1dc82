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

Summaries are made off the critical path (``summary_prefetch_ratio``, default 0.8; 0 turns it off):
a conversation that comes within a lead of where it will need a summary, ``(1 - ratio) x T`` tokens
before T (none cached yet) or before B (a cached one in use), starts its summary in the background
(``Compactor.prefetch``), cut so that the payload is one hysteresis step under that point again when
the summary is used. The request that crosses T then finds it ready and keeps the turns since verbatim
while they fit under B. A request that masking alone brings under T starts nothing (masking is what
keeps it there; the request masking no longer fits under T starts the summary). A request whose payload fits under B
without a summary never waits for one
(status ``pending`` while the background summary is under way); a request waits for the summariser
only when nothing else fits under B: no cached summary brings it under B and its payload without one
is over B. It then joins the summary being made when that one fits, else makes its own, and says so
(``HistoryResult.waited``; ``x-ctxproxy-summary: waited``). A conversation whose last summary failed
is never waited for again: the trimmer serves it (status ``failed``, as on any failure) while the
background retries after the back-off.

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
import time
from typing import Any

from pydantic import Field

from plugins.base import (
    CachedSummary,
    ContextManager,
    HistoryResult,
    HistoryView,
    Params,
    Services,
    window,
)
from plugins.masking import MASK_STEP, Masking, mask_observations
from proxy.core import values
from proxy.core.budget import Budget, TrimmerParams
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
    summary_prefetch_ratio: float = Field(
        0.8, ge=0.0, le=1.0, description="Start a conversation's summary in the background once its payload is "
        "within (1 - ratio) x T of where it will need one (T, or B while a summary is in use); 0: never, the "
        "request that crosses T waits for it.")
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
            # masking alone was enough: what comes next is more masking on its grid, not a summary; the request
            # that masking no longer fits under T starts one (forwarded masked, pending, while it fits under B)
            return masking.result()
        return masking.note(await self._summarise(view, masking.view))

    async def _mask(self, view: HistoryView) -> Masking | None:
        params: Any = self.params
        if not params.mask_observations:
            return None
        if view.offload:  # a large conversation: its items are walked in a worker thread
            return await asyncio.to_thread(mask_observations, view, params.keep_recent, params.mask_step)
        return mask_observations(view, params.keep_recent, params.mask_step)

    # -- off the critical path --------------------------------------------------------------------------

    def _lead(self, budget: Budget) -> int | None:
        """How many tokens before it needs a summary a conversation starts one in the background (None: never)."""
        params: Any = self.params
        ratio: float = params.summary_prefetch_ratio
        return int((1.0 - ratio) * budget.threshold) if ratio > 0 else None

    def look_ahead_point(self, budget: Budget) -> int | None:
        lead = self._lead(budget)
        return None if lead is None else budget.threshold - lead

    def _ahead(self, services: Services) -> bool:
        """Whether summaries are made in the background for this request (else the request makes its own)."""
        compaction = services.compaction
        params: Any = self.params
        return (params.summary_prefetch_ratio > 0 and not services.dry_run and compaction is not None
                and compaction.background and self.summarizer is not None
                and compaction.unavailable(self.summarizer, services) is None)

    async def look_ahead(self, view: HistoryView) -> str:
        services = view.services
        compaction = services.compaction
        if not view.turns or compaction is None or self.summarizer is None or not self._ahead(services):
            return ""
        chain = await view.chain_hashes()
        found = await compaction.lookup(self.summarizer, services, chain)
        return await self._prefetch(view, chain, found)

    async def _prefetch(self, client: HistoryView, chain: list[str], found: CachedSummary | None) -> str:
        """Start the summary a later request will need, in the background, once the conversation is within the
        lead of needing it: at T with no summary cached, at B with one (``client``: the client's turns)."""
        budget = client.budget
        services = client.services
        compaction = services.compaction
        lead = self._lead(budget)
        if compaction is None or self.summarizer is None or lead is None:
            return ""
        need = budget.hard_budget if found is not None else budget.threshold
        point = need - lead
        # where the conversation stands with masking doing all it can down to the point, and the summary in use
        ahead = dataclasses.replace(client, budget=dataclasses.replace(budget, threshold=point))
        masking = await self._mask(ahead)
        view = masking.view if masking is not None else ahead
        covered = found.covered_turns if found is not None else 0
        now = view.payload_tokens(covered, self._tokens(view, found))
        if now < point:
            return ""
        # cut so that, when a request uses it (the first crossing T; later ones, the next request), the payload
        # is a hysteresis step under the point where the following summary starts
        until_used = max(0, budget.threshold - now) if found is None else 0
        cut, reserve = await self._plan(view, budget.hard_budget - lead - budget.step - until_used)
        if cut <= covered or view.payload_tokens(cut, reserve) > budget.hard_budget:
            return ""
        if found is not None and found.narrowed:
            # decided from this process's copy, some longer prefixes unasked: decided again from a longer summary
            # another replica made meanwhile, if there is one (else the one made here would repeat it)
            longer = await compaction.lookup(self.summarizer, services, chain, recheck=True)
            if longer is not None and longer.covered_turns > found.covered_turns:
                return await self._prefetch(client, chain, longer)
        return compaction.prefetch(self.summarizer, services, client.turns, chain, cut)

    def _tokens(self, view: HistoryView, summary: CachedSummary | None) -> int:
        if summary is None:
            return 0
        return view.summary_item(summary_text(summary.covered_turns, summary.text), summary.covered_turns).tokens

    # -- summaries ----------------------------------------------------------------------------------------

    async def _summarise(self, client: HistoryView, view: HistoryView) -> HistoryResult:
        """Summarise (or drop) older turns of ``view`` (over T); the summariser sees them as in ``client``."""
        budget = view.budget
        services = view.services
        compaction = services.compaction  # the one compaction service (proxy.store.compaction)
        if self.summarizer is None or compaction is None or compaction.unavailable(self.summarizer, services):
            return await self._drop(view)  # drop (or no summariser): older turns go, on a prefix-stable grid
        chain = await view.chain_hashes()
        found = await compaction.lookup(self.summarizer, services, chain)
        ahead = self._ahead(services)
        for recheck in (False, True):
            if found is not None:
                reused = self._with(view, found, "reused")
                if reused.summary is not None and view.payload_tokens(
                        found.covered_turns, reused.summary.tokens) <= budget.hard_budget:
                    compaction.used(self.summarizer, services, found)
                    if ahead:
                        reused.background = await self._prefetch(client, chain, found)
                    return reused
            if recheck or found is None or not found.narrowed:
                break
            # this process's copy does not fit: before a newer one is made or waited for, the longer prefixes the
            # lookup took as missing a moment ago are asked for again (another replica may have made one)
            longer = await compaction.lookup(self.summarizer, services, chain, recheck=True)
            if longer is None or longer.covered_turns < found.covered_turns:
                break
            found, grew = longer, longer.covered_turns > found.covered_turns  # (no longer narrowed either way)
            if not grew:
                break
        if ahead and view.payload_tokens() <= budget.hard_budget:
            # it fits under B without a summary: served now, and the summary is made for a later request
            started = await self._prefetch(client, chain, found)
            return HistoryResult(turns=view.turns, summary_status="pending" if started in ("started", "busy")
                                 else "none", background=started)
        cut, reserve = await self._plan(view)
        if view.payload_tokens(cut, reserve) > budget.hard_budget:
            return await self._drop(view)  # not even a summary would fit: keep the recent turns, trim the rest
        if cut == 0 or (found is not None and cut <= found.covered_turns):
            return self._with(view, found, "reused") if found is not None else HistoryResult.unchanged(view)
        if ahead:  # nothing fits under B without a summary: this request waits, unless the summariser is failing
            making = compaction.making(self.summarizer, services, chain)
            if making > (found.covered_turns if found is not None else 0) and view.payload_tokens(
                    making, reserve) <= budget.hard_budget:
                cut = making  # the one being made fits: wait for it rather than make another
            else:
                failing = compaction.failing(self.summarizer, services, chain)
                if failing is not None:  # never wait for a failing summariser again: retry in the background
                    started = await self._prefetch(client, chain, found)
                    return HistoryResult(turns=view.turns, summary_status="failed", background=started,
                                         detail={"reason": "backoff" if failing == "backoff" else "retrying"})
        began = time.perf_counter()
        made = await compaction.compact(self.summarizer, services, client.turns, chain, cut=cut, found=found,
                                        looked=True)
        if made.status == "would_create":
            return self._would_create(view, cut, found, made.text, reserve)
        waited = time.perf_counter() - began
        if made.summary is None:
            return HistoryResult(turns=view.turns, summary_status=made.status, detail={"reason": made.reason},
                                 waited=waited if made.reason not in ("backoff", "drop", "no_summariser") else None)
        compaction.used(self.summarizer, services, made.summary)
        result = self._with(view, made.summary, made.status)
        result.waited = waited
        return result

    async def _plan(self, view: HistoryView, target: int | None = None) -> tuple[int, int]:
        """Where to cut, and the most tokens the summary may take there: the summariser's text at its cap plus
        the values section of the turns it covers (at most its cap). The section grows with the cut and the cut
        with the section, so the two are planned in turn, a few times (any excess left is the trimmer's).
        ``target``: as in ``_cut``."""
        services = view.services
        reserve = services.summary_tokens
        cut = self._cut(view, reserve, target)
        for _ in range(3):
            if cut == 0 or services.values_tokens <= 0:
                break
            section, _ = await self._values(view, cut, values.SUMMARY_LEAD)
            size = view.counter.text(values.SEPARATOR + section.text) if section.text else 0
            if services.summary_tokens + size <= reserve:
                break
            reserve = services.summary_tokens + size
            cut = self._cut(view, reserve, target)
        return cut, reserve

    def _cut(self, view: HistoryView, summary_tokens: int, target: int | None = None) -> int:
        """Summarise all but the last keep_turns turns, and more if the rest would leave no headroom (the payload
        over ``target``: by default T, and one hysteresis step under B)."""
        params: Any = self.params
        n = len(view.turns)
        budget = view.budget
        if target is None:
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
