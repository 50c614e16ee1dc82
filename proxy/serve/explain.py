"""``{<conversation field>, "report"}`` for a body of any wire: ``ctxproxy assemble`` and POST /v1/ctxproxy/explain.

Explain never bills anyone: summaries are looked up in the cache, and what a new
summary would replace is reported (``summary: would_create``) instead of made,
unless the caller asks for it (``summarize``).

A caller that names no wire gets Responses for a body with ``input`` and no ``messages``,
else Chat Completions (a Messages body looks like a Chat one: it is named by ``/messages``,
``?wire=messages`` or ``--wire messages``).

The body first goes through what the managed handler runs before the pipeline: the wire's
request hook (Messages: ``context_management`` emulated for an upstream that lacks it), in
dry-run as well, so an emulated compaction only looks its summary up in the cache; the
report's ``context_management`` says what the emulation did.

The report also says which calibration factor the budget used and why
(``calibration_detail``), and what context management saved and cost on this one
request (``cost``, ``proxy.serve.costs``): the gross saving and the summariser's cost
are known here; the prompt-cache effect is measured only from a provider's answer, so
explain gives the net before it.
"""

from __future__ import annotations

from typing import Any, Protocol

from proxy.core.conversation import WireAdapter
from proxy.core.offload import run_step
from proxy.pipeline import Report
from proxy.policy import ModelRoute
from proxy.runtime import Runtime
from proxy.serve.costs import request_cost
from proxy.serve.http import parse_body
from proxy.settings import Tenant
from proxy.store.calibration import ConfiguredCalibration
from proxy.wire.chat import WIRE as CHAT
from proxy.wire.messages import WIRE as MESSAGES
from proxy.wire.messages.emulate import HOOK as MESSAGES_HOOK
from proxy.wire.responses import WIRE as RESPONSES


class ExplainedExchange(Protocol):
    """What a wire's request hook made of one request, as explain reads it."""

    body: dict[str, Any]
    edited: bool  # the pipeline runs on ``body``, not on the client's
    warnings: list[str]

    def local_answer(self) -> object | None:
        """The answer the proxy would make itself (the request is then not forwarded), or None."""

    def describe(self) -> dict[str, Any]:
        """What the hook did, for the report."""


class DryRunHook(Protocol):
    """``proxy.serve.managed.RequestHook`` that can also run without calling (billing) anyone."""

    async def begin(self, runtime: Runtime, tenant: Tenant | None, body: dict[str, Any], *,
                    override: str | None, request_id: str, dry_run: bool = False,
                    offload: bool = False) -> ExplainedExchange | None: ...


# The hooks the managed handler runs, by wire (``proxy.serve.routes.HOOKS``: the same ones, a test keeps them equal;
# routes imports the explain handler, so this module cannot import routes without a circle).
HOOKS: dict[str, DryRunHook] = {MESSAGES.name: MESSAGES_HOOK}


def wire_of(body: dict[str, Any]) -> WireAdapter:
    """The wire of a body whose caller names none: ``input`` without ``messages`` is Responses, anything else Chat."""
    return RESPONSES if "input" in body and "messages" not in body else CHAT


async def explain(
    runtime: Runtime, wire: WireAdapter | None, raw: bytes, tenant: Tenant | None, override: str | None,
    *, summarize: bool = False, request_id: str = "",
) -> dict[str, Any]:
    """What ``wire`` (None: the body's, ``wire_of``) would forward for ``raw``, and the report; nothing is sent."""
    # large bodies are parsed and assembled off the event loop, as on the managed path
    offload = len(raw) > runtime.config.settings.server.offload_bytes
    body = await run_step(offload, parse_body, raw)
    wire = wire if wire is not None else wire_of(body)
    hook = HOOKS.get(wire.name)
    exchange = None
    if hook is not None:  # as the managed handler does, and as cheaply as the pipeline below (dry-run)
        exchange = await hook.begin(runtime, tenant, body, override=override, request_id=request_id,
                                    dry_run=not summarize, offload=offload)
    if exchange is not None and exchange.edited:
        body = exchange.body  # what the handler would run the pipeline on (and forward)
    assembly, route, _policy = await runtime.assemble(wire, body, tenant=tenant, override=override, offload=offload,
                                                      request_id=request_id, dry_run=not summarize)
    if exchange is not None:
        assembly.report.warnings.extend(hook_warnings(exchange))
    report = assembly.report.as_dict()
    if exchange is not None:
        report["context_management"] = exchange.describe()
    report["calibration_detail"] = calibration_detail(runtime, route, _policy.tenant)
    report["cost"] = cost_figures(runtime, route, assembly.report)
    return {wire.field: assembly.messages, "report": report}


def hook_warnings(exchange: ExplainedExchange) -> list[str]:
    """The hook's warnings, as the handler adds them to the report, and whether the proxy would answer itself."""
    if exchange.local_answer() is None:
        return exchange.warnings
    return [*exchange.warnings, "the proxy would answer this request itself: nothing would be forwarded"]


def calibration_detail(runtime: Runtime, route: ModelRoute, tenant: str) -> dict[str, Any]:
    """The factor ``tenant``'s budget uses on ``route``, and where it comes from."""
    calibration = runtime.calibration
    if isinstance(calibration, ConfiguredCalibration):
        return calibration.effective(route, tenant).describe()
    factor = calibration.factor(route, tenant) if calibration is not None else 1.0
    return {"factor": factor, "source": "runtime" if calibration is not None else "off"}


def cost_figures(runtime: Runtime, route: ModelRoute, report: Report) -> dict[str, Any]:
    """This request's figures in USD, priced on the route's upstream model (None: unknown here)."""
    cost = request_cost(report, route.upstream_model, runtime.model_map)
    prices = runtime.model_map.prices(route.upstream_model)
    summarizer = cost.summarizer_usd
    notes = ["the prompt-cache effect is measured from the provider's answer; explain forwards nothing"]
    if report.summary == "would_create":
        summarizer = None
        notes.append("a summary would be made here: its cost is known once made (?summarize=true makes it)")
    if prices is None:
        notes.append(f"no price for {route.upstream_model!r} in the config or litellm's map")
    before_cache = cost.gross_usd - summarizer if cost.gross_usd is not None and summarizer is not None else None
    return {
        "priced_model": route.upstream_model,
        "prices": None if prices is None else {"input": prices.input, "output": prices.output,
                                               "cache_read": prices.cache_read, "cache_write": prices.cache_write,
                                               "source": prices.source},
        "removed_tokens": cost.removed_tokens,
        "gross_usd": cost.gross_usd,
        "summarizer_usd": summarizer,
        "prompt_cache_usd": None,
        "net_before_prompt_cache_usd": before_cache,
        "notes": notes,
    }
