"""The request hook of the Messages wire: ``context_management`` forwarded, or emulated before the pipeline runs.

An upstream that applies ``context_management`` itself (``api: anthropic``, unless configured
``context_management: emulate``) gets the request unchanged. For any other (a litellm route, an
OpenAI-compatible gateway, an upstream configured to emulate) the edits are applied here, in the
order given (``proxy.wire.messages.context``), the field is removed from the forwarded body, and
the answer gets the report (and a compaction block) Anthropic would have written
(``proxy.wire.messages.answers``). Compaction summaries come from the proxy's summary cache, the
one the ``summarising`` context manager uses: the same history is summarised once.

Explain and ``ctxproxy assemble`` run the hook in dry-run (``dry_run=True``): the clearing edits
apply as on a real request, and compaction only looks a summary up in the cache; when none covers
the history it reports ``would_create`` and forwards a placeholder, never calling (billing) the
summariser. ``Exchange.describe`` says what the emulation did.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from plugins.base import Services, SummarizeFn, Summarizer, SummaryScope, SummaryStore, SummaryUnavailable
from plugins.summarizers.llm import PROMPT, LLMParams, LLMSummarizer
from proxy.core.bands import Bands, split_bands, split_turns
from proxy.core.items import Item
from proxy.core.offload import run_step
from proxy.pipeline import chain_hashes, prepare
from proxy.policy import ModelRoute, Policy
from proxy.runtime import Runtime
from proxy.settings import Config, Tenant
from proxy.wire.messages.adapter import WIRE
from proxy.wire.messages.answers import AnswerLike, EditedAnswer, LocalAnswer, ResponseEdits, local_answer
from proxy.wire.messages.context import (
    CLEAR_THINKING,
    CLEAR_TOOL_USES,
    COMPACT_TRIGGER,
    Edit,
    Message,
    clear_thinking,
    clear_tool_uses,
    compaction_block,
    parse_edits,
    resume_compaction,
    starts_turn,
    summary_message,
)
from proxy.wire.messages.shape import check_body

# what a dry-run compaction forwards in place of a summary it would make (explain, ``ctxproxy assemble``)
WOULD_COMPACT = "[ctxproxy explain: a compaction summary of these turns would be created here]"


@dataclass
class Exchange:
    """One request after the hook: the body for the pipeline, and what the answer needs."""

    body: dict[str, Any]
    edited: bool
    edits: ResponseEdits
    local: LocalAnswer | None = None
    warnings: list[str] = field(default_factory=list)
    compaction: str | None = None  # created | reused | would_create (dry-run), None: not compacted

    def local_answer(self) -> AnswerLike | None:
        return self.local

    def describe(self) -> dict[str, Any]:
        """What the emulation did to the request (for explain's report): the edits' report, the compaction."""
        return {"emulated": True, "applied_edits": self.edits.applied, "compaction": self.compaction,
                "paused_after_compaction": self.local is not None}

    def wrap(self, answer: AnswerLike) -> AnswerLike:
        if answer is self.local or not self.edits.needed:
            return answer  # the local answer is already complete
        return EditedAnswer(answer, self.edits)


def emulates(config: Config, route: ModelRoute) -> bool:
    """Whether this route's upstream lacks ``context_management`` (so the proxy applies it)."""
    if route.provider == "litellm":
        return True
    upstream = config.settings.upstreams.get(route.upstream)
    return upstream is None or upstream.emulates_context_management


class ContextManagementHook:
    """``proxy.serve.managed.RequestHook`` for the Messages wire."""

    async def begin(self, runtime: Runtime, tenant: Tenant | None, body: dict[str, Any], *,
                    override: str | None, request_id: str, dry_run: bool = False,
                    offload: bool = False) -> Exchange | None:
        """The request as the pipeline should see it, or None when nothing is emulated; with ``offload`` (a
        large body) the edits, which walk every message, run in a worker thread."""
        if "context_management" not in body or not isinstance(body.get("model"), str):
            return None
        route = runtime.route(body["model"])
        if not emulates(runtime.config, route):
            return None  # the upstream applies it: forwarded unchanged
        if body["context_management"] is None:
            # null asks for no edits: the field still goes, an upstream without it may refuse it; no report
            out = {k: v for k, v in body.items() if k != "context_management"}
            return Exchange(out, True, ResponseEdits(None, None))
        edits = parse_edits(body["context_management"])
        # the edits read the messages: refuse a malformed body first, as the pipeline would
        await run_step(offload, check_body, body)
        policy = runtime.policy(tenant, body["model"], override)
        services = runtime.services(route, policy, request_id=request_id, dry_run=dry_run)
        calibration = runtime.calibration.factor(route, policy.tenant) if runtime.calibration is not None else 1.0
        session = _Session(body, services, calibration, offload)
        messages = await run_step(offload, resume_compaction, body["messages"])
        compaction: dict[str, Any] | None = None
        pause = False
        for edit in edits:
            if edit.type == CLEAR_THINKING:
                messages, report = await run_step(offload, clear_thinking, messages, edit, session.counter)
                session.applied.append(session.scaled(report))
            elif edit.type == CLEAR_TOOL_USES:
                measured = await run_step(offload, session.measure, messages)
                messages, maybe = await run_step(offload, clear_tool_uses, messages, edit, session.counter, measured)
                if maybe is not None:
                    session.applied.append(session.scaled(maybe))
            else:
                compacted = await session.compact(messages, edit, policy)
                if compacted is not None:
                    messages, compaction = compacted
                    pause = edit.params.get("pause_after_compaction") is True
        out = {k: v for k, v in body.items() if k != "context_management"}
        out["messages"] = messages
        response = ResponseEdits(session.applied, compaction)
        exchange = Exchange(out, True, response, warnings=session.warnings, compaction=session.compaction)
        if pause and compaction is not None:
            exchange.local = local_answer(body["model"], compaction, response.report(), body.get("stream") is True)
        return exchange


class _Session:
    def __init__(self, body: dict[str, Any], services: Services, calibration: float, offload: bool) -> None:
        self.body = body
        self.offload = offload
        self.services = services
        self.calibration = calibration
        assert services.counter is not None
        self.counter = services.counter
        self.applied: list[dict[str, Any]] = []
        self.warnings: list[str] = []
        self.compaction: str | None = None

    def scaled(self, report: dict[str, Any]) -> dict[str, Any]:
        """A report's token figure in the provider's units (the calibration factor times the proxy's count)."""
        return {**report, "cleared_input_tokens": round(report["cleared_input_tokens"] * self.calibration)}

    def measure(self, messages: list[Message]) -> int:
        """Input tokens of the body with these messages, in the provider's units."""
        conversation = WIRE.parse({**self.body, "messages": messages}, self.counter)
        return round((conversation.fixed_tokens + sum(i.tokens for i in conversation.items)) * self.calibration)

    async def compact(self, messages: list[Message], edit: Edit,
                      policy: Policy) -> tuple[list[Message], dict[str, Any]] | None:
        trigger = (edit.params.get("trigger") or {}).get("value", COMPACT_TRIGGER)
        if await run_step(self.offload, self.measure, messages) <= trigger:
            return None
        client = self.body["messages"]
        start = next((i for i in range(len(client) - 1, -1, -1) if starts_turn(client[i])), -1)
        bands, turns = await run_step(self.offload, self._turns, messages)
        if start < 0 or bands.current is None or not turns:
            return None  # nothing before the current turn to summarise
        summarizer = _summarizer(policy, edit.params.get("instructions"))
        summarize = summarizer.bind(self.services)
        store = self.services.summaries
        if summarize is None or store is None:
            self.warnings.append("context_management compact_20260112 not applied: no summariser is available")
            return None
        scope = SummaryScope(self.services.tenant, summarizer.settings_id(self.services))
        try:
            text = await self._summary(store, scope, turns, summarize)
        except SummaryUnavailable as exc:
            self.warnings.append(f"context_management compact_20260112 not applied: the summariser failed ({exc})")
            return None
        kept = messages[bands.current.source:]
        return [summary_message(text), *kept], compaction_block(text, start)

    def _turns(self, messages: list[Message]) -> tuple[Bands, list[list[Item]]]:
        """The bands of the body with these messages, and its history's turns."""
        prepared = prepare({**self.body, "messages": messages}, WIRE, self.counter)
        bands = split_bands(prepared.repaired)
        return bands, split_turns(bands.history)

    async def _summary(self, store: SummaryStore, scope: SummaryScope, turns: list[list[Item]],
                       summarize: SummarizeFn) -> str:
        """The summary of every turn: cached, else made (single flight); in dry-run never made, a placeholder."""
        chain = await run_step(self.offload, chain_hashes, turns, self.counter)
        found = await store.lookup(scope, chain)
        if found is not None and found.covered_turns == len(turns):
            self.compaction = "reused"
            return found.text
        if self.services.dry_run:
            self.compaction = "would_create"
            return WOULD_COMPACT
        made, fresh = await store.obtain(scope, chain, len(turns), turns, found, summarize,
                                         request_id=self.services.request_id, model=self.services.model)
        self.compaction = "created" if fresh else "reused"
        return made.text


def _summarizer(policy: Policy, instructions: Any) -> Summarizer:
    """The policy's summariser (its model and prompt), or ``llm``; ``instructions`` are added to its prompt."""
    own = policy.manager.summarizer
    if own is not None and own.name != "llm":
        return own  # e.g. ``drop``: this policy never calls a model to summarise, so compaction is not applied
    if not isinstance(instructions, str) or not instructions.strip():
        return own if own is not None else LLMSummarizer(LLMParams())
    params: Any = own.params if own is not None else LLMParams()
    base = params.instructions or PROMPT
    return LLMSummarizer(LLMParams.model_validate(
        {"model": params.model, "instructions": f"{base}\n\nAlso: {instructions.strip()}"}))


HOOK = ContextManagementHook()
