"""The one compaction service: a conversation's turns -> a summary's text, and how it came about.

Three things compact a conversation: the ``summarising`` context manager (older turns replaced by
a summary), ``POST /v1/responses/compact`` when ctxproxy answers it (``proxy.serve.compact``), and
Anthropic's ``compact_20260112`` edit when ctxproxy emulates ``context_management``
(``proxy.serve.context_management``). All three ask ``Compaction.compact``, so they agree:

- one cache: a summary is looked up in the summary store, made at most once (single flight) and
  reused whoever asks, on whatever wire (``proxy.store.summaries``);
- one dry run: explain, count_tokens and ``ctxproxy assemble`` never make a summary; what would
  be made is forwarded as one placeholder, ``WOULD_CREATE`` (status ``would_create``);
- one rule for a policy whose summariser is ``drop``: it never calls a model to summarise, so a
  compaction under it is ``unavailable`` (``DROPS_OLDER_TURNS``): the context manager drops older
  turns instead (and puts their values section in their place), ``/responses/compact`` answers 400
  ``compaction_unavailable``, and a Messages
  compaction is not applied (a warning says why). Nobody is billed for it in one place and
  refused in another;
- one cost path: every summariser call is priced and counted where it is made, in the summary
  store's ``on_call`` (``proxy.serve.metrics.Metrics.summary_call``), whoever asked for it;
- one values section: whatever the summariser writes, the values the summarised turns acted on that
  its text leaves out are appended to it (``proxy.core.values``, at most ``values_tokens``), before it
  is cached, so the cached record holds them, a reused summary carries them, and an incremental
  summary checks the values of every turn it covers (the previous summary's included). The section
  depends on its cap, so the cap is part of the summary's scope. The sections a ``drop`` policy puts
  in place of dropped turns, and those the summarising manager plans a cut with, are made here too
  (``values_section``), kept in a small LRU of this process under the chained hash of the turns they
  cover: a conversation's next request finds them, however long its older turns are.

A policy without a summariser of its own (``sliding-window``) compacts with the default ``llm``
one (``summarizer_for``).
"""

from __future__ import annotations

import asyncio
import dataclasses
from collections import OrderedDict
from collections.abc import Awaitable, Sequence
from typing import Any

import orjson

from plugins.base import (
    CachedSummary,
    Compacted,
    Completion,
    Engine,
    Services,
    SummarizeFn,
    Summarizer,
    SummaryScope,
    SummaryStore,
    SummaryUnavailable,
)
from plugins.summarizers.llm import PROMPT, LLMParams, LLMSummarizer
from proxy.core import values
from proxy.core.items import Item
from proxy.store.background import BackgroundSummaries
from proxy.store.summaries import conversation_key, summary_key

# what a dry run forwards in place of a summary it would make (explain, count_tokens, ``ctxproxy assemble``)
WOULD_CREATE = "[ctxproxy explain: a summary of these turns would be created here]"
DROPS_OLDER_TURNS = "compaction unavailable: this policy drops older turns (summarizer: drop)"
NO_SUMMARISER = "compaction unavailable: no summariser is available"
VALUES_VERSION = "1"  # of the values section's rules: a change makes summaries anew
SECTIONS = 4096  # values sections remembered by this process (tenant + the turns' chained hash + cap + lead)


def summarizer_for(own: Summarizer | None, instructions: Any = None) -> Summarizer:
    """The summariser a compaction uses under a policy whose own is ``own``: that one (``drop`` included: it
    makes none), else the default ``llm``; ``instructions`` (a client's) are added to an ``llm`` prompt."""
    if own is not None and own.name != "llm":
        return own
    if not isinstance(instructions, str) or not instructions.strip():
        return own if own is not None else LLMSummarizer(LLMParams())
    params: Any = own.params if own is not None else LLMParams()
    base = params.instructions or PROMPT
    return LLMSummarizer(LLMParams.model_validate(
        {"model": params.model, "instructions": f"{base}\n\nAlso: {instructions.strip()}"}))


class Compaction:
    """``plugins.base.Compactor`` over a summary store, with the process's background runner when there is one."""

    def __init__(self, store: SummaryStore, background: BackgroundSummaries | None = None,
                 sections: int = SECTIONS) -> None:
        self.store = store
        self.runner = background
        self._sections: OrderedDict[tuple[str, str, str, int, str], tuple[values.Section, int]] = OrderedDict()
        self._size = sections

    async def values_section(self, services: Services, turns: Sequence[Sequence[Item]], link: str, lead: str,
                             *, offload: bool = False) -> tuple[values.Section, int]:
        """The values section of ``turns`` (all their values, at most ``values_tokens``) and its tokens;
        ``link``: the chained hash of ``turns``, under which it is remembered. With ``offload`` (a large
        conversation) it is made in a worker thread."""
        counter = services.counter
        encoding = counter.encoding_name if counter is not None else ""
        key = (services.tenant, encoding, link, services.values_tokens, lead)
        found = self._sections.get(key)
        if found is not None:
            self._sections.move_to_end(key)
            return found
        count = _counting(services)
        if offload:
            made = await asyncio.to_thread(values.section_of, turns, services.values_tokens, count, lead)
        else:
            made = values.section_of(turns, services.values_tokens, count, lead)
        out = (made, count(made.text) if made.text else 0)
        self._sections[key] = out
        while len(self._sections) > self._size:
            self._sections.popitem(last=False)
        return out

    @property
    def background(self) -> bool:
        return self.runner is not None and self.runner.enabled

    def _bind(self, summarizer: Summarizer, services: Services) -> SummarizeFn | None:
        """``summarizer``'s function for this request, its model calls each made once across replicas."""
        engine = services.engine
        if engine is not None:
            services = dataclasses.replace(services, engine=_CallsOnce(engine, self.store, services.tenant))
        return summarizer.bind(services)

    def unavailable(self, summarizer: Summarizer | None, services: Services) -> str | None:
        if summarizer is not None and summarizer.name == "drop":
            return DROPS_OLDER_TURNS
        if summarizer is None or summarizer.bind(services) is None:
            return NO_SUMMARISER
        return None

    async def lookup(self, summarizer: Summarizer, services: Services, chain: Sequence[str], *,
                     recheck: bool = False) -> CachedSummary | None:
        return await self.store.lookup(_scope(summarizer, services), chain, recheck=recheck)

    async def compact(self, summarizer: Summarizer | None, services: Services, turns: Sequence[Sequence[Item]],
                      chain: Sequence[str], *, cut: int | None = None,
                      found: CachedSummary | None = None, looked: bool = False) -> Compacted:
        cut = len(turns) if cut is None else cut
        reason = self.unavailable(summarizer, services)
        summarize = self._bind(summarizer, services) if summarizer is not None and reason is None else None
        if summarizer is None or summarize is None:
            why = reason or NO_SUMMARISER
            return Compacted("unavailable", why, reason="drop" if why == DROPS_OLDER_TURNS else "no_summariser")
        scope = _scope(summarizer, services)
        if not looked:  # (a compaction asked for: marks ignored, a summary made meanwhile elsewhere is built on)
            found = await self.store.lookup(scope, chain, recheck=True)
        if found is not None and found.covered_turns >= cut:
            return Compacted("reused", found.text, found)
        if services.dry_run:
            return Compacted("would_create", WOULD_CREATE)
        try:
            made, fresh = await self.store.obtain(scope, chain, cut, turns, found,
                                                  keeping_values(summarize, turns[:cut], services),
                                                  request_id=services.request_id, model=services.model)
        except SummaryUnavailable as exc:
            status = "pending" if exc.reason == "pending" else "failed"
            return Compacted(status, str(exc), reason=exc.reason)
        return Compacted("created" if fresh else "reused", made.text, made)


    def prefetch(self, summarizer: Summarizer, services: Services, turns: Sequence[Sequence[Item]],
                 chain: Sequence[str], cut: int) -> str:
        runner = self.runner
        summarize = self._bind(summarizer, services)
        if runner is None or summarize is None or services.dry_run or not 0 < cut <= min(len(turns), len(chain)):
            return ""
        scope = _scope(summarizer, services)
        if self.store.failing(scope, chain) == "backoff":
            return "backoff"
        conversation = conversation_key(scope, chain)
        if runner.busy(conversation):
            return "busy"
        aged = [list(turn) for turn in turns[:cut]]  # the job outlives the request: it keeps what it summarises
        links = list(chain[:cut])
        store = self.store

        async def make() -> tuple[CachedSummary, bool] | None:
            # looked up when its turn comes: a longer summary may be cached by then (nothing to do), or a
            # newer prefix one to build on (incrementally)
            found = await store.lookup(scope, links, recheck=True)
            if found is not None and found.covered_turns >= cut:
                return None
            return await store.obtain(scope, links, cut, aged, found, keeping_values(summarize, aged, services),
                                      request_id=services.request_id, model=services.model)

        return runner.submit(summary_key(scope, links[cut - 1]), conversation, services.tenant, services.model, make)

    def making(self, summarizer: Summarizer, services: Services, chain: Sequence[str]) -> int:
        return self.store.making(_scope(summarizer, services), chain)

    def failing(self, summarizer: Summarizer, services: Services, chain: Sequence[str]) -> str | None:
        return self.store.failing(_scope(summarizer, services), chain)

    def used(self, summarizer: Summarizer, services: Services, summary: CachedSummary) -> None:
        if self.runner is not None and not services.dry_run:
            self.runner.used(summary_key(_scope(summarizer, services), summary.chain))


class _CallsOnce:
    """An ``Engine`` whose summariser calls go through the summary store's single flight (``call_once``): a
    summary folded in chunks shares each chunk's call with any other summary that folds the same one."""

    def __init__(self, engine: Engine, store: SummaryStore, tenant: str) -> None:
        self.engine = engine
        self.store = store
        self.tenant = tenant

    async def complete(self, model: str, messages: list[dict[str, Any]], *, max_tokens: int, timeout: float,
                       purpose: str, request_id: str = "") -> Completion:
        def call() -> Awaitable[Completion]:
            return self.engine.complete(model, messages, max_tokens=max_tokens, timeout=timeout, purpose=purpose,
                                        request_id=request_id)

        if purpose != "summarize":
            return await call()
        material = orjson.dumps({"model": model, "messages": messages, "max_tokens": max_tokens})
        return await self.store.call_once(self.tenant, material, call)


def keeping_values(summarize: SummarizeFn, covered: Sequence[Sequence[Item]], services: Services) -> SummarizeFn:
    """``summarize``, whose answer then carries the values of ``covered`` (every turn the summary covers) that its
    text leaves out; an empty answer is left empty (a failure)."""
    count = _counting(services)

    async def summarize_keeping_values(previous: str | None, turns: Sequence[Sequence[Item]]) -> Completion:
        made = await summarize(previous, turns)
        text = made.text.strip()
        if not text:
            return made
        # extraction walks every covered turn: off the event loop
        text = await asyncio.to_thread(values.keep_values, text, covered, services.values_tokens, count)
        return dataclasses.replace(made, text=text)

    return summarize_keeping_values


def _counting(services: Services) -> Any:
    """The request's token count of a text (an estimate without a counter)."""
    counter = services.counter
    if counter is not None:
        return counter.text
    return lambda text: len(text) // 4 + 1


def _scope(summarizer: Summarizer, services: Services) -> SummaryScope:
    """Who may share a summary: the tenant, and what its text depends on besides the turns (the values cap too)."""
    return SummaryScope(services.tenant,
                        f"{summarizer.settings_id(services)}/values{VALUES_VERSION}:{services.values_tokens}")
