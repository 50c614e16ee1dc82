"""``{<conversation field>, "report"}`` for a body of any wire: ``ctxproxy assemble`` and POST /v1/ctxproxy/explain.

Explain never bills anyone: summaries are looked up in the cache, and what a new
summary would replace is reported (``summary: would_create``) instead of made,
unless the caller asks for it (``summarize``).

A caller that names no wire gets the wire the body looks surest of (``Wires.sniff``, each
wire's ``sniff``): Responses for a body with ``input`` and no ``messages``, else Chat
Completions (a Messages body looks like a Chat one: it is named by ``/messages``,
``?wire=messages`` or ``--wire messages``).

The body first goes through what the managed handler runs before the pipeline: the wire's
request hook (Messages: ``context_management`` emulated for an upstream that lacks it), in
dry-run as well, so an emulated compaction only looks its summary up in the cache; the
report's ``context_management`` says what the emulation did.

In observe mode (the policy's, or ``mode="observe"``: ``?mode=``, ``--mode``) the conversation shown
is the client's, which is what would be forwarded, and the report (``mode: observe``) says what
enforce would have done; ``mode="enforce"`` shows what enforce would forward, whatever the policy's
mode. Observe mode never makes a summary, ``summarize`` or not.

The report also says which calibration factor the budget used and why
(``calibration_detail``), and what context management saved and cost on this one
request (``cost``, ``proxy.serve.costs``): the gross saving and the summariser's cost
are known here; the prompt-cache effect is measured only from a provider's answer, so
explain gives the net before it.
"""

from __future__ import annotations

from typing import Any

from proxy.core.offload import run_step
from proxy.pipeline import Report
from proxy.policy import ModelRoute
from proxy.runtime import Runtime
from proxy.serve.bodies import parse_body
from proxy.serve.costs import request_cost
from proxy.serve.hooks import HOOKS
from proxy.serve.managed import Exchange
from proxy.settings import Tenant
from proxy.store.calibration import ConfiguredCalibration
from proxy.wire import WIRES, Wires
from proxy.wire.protocol import Wire


async def explain(
    runtime: Runtime, wire: Wire | None, raw: bytes, tenant: Tenant | None, override: str | None,
    *, summarize: bool = False, request_id: str = "", wires: Wires = WIRES, params: dict[str, str] | None = None,
    mode: str | None = None,
) -> dict[str, Any]:
    """What ``wire`` (None: the body's, ``Wires.sniff``) would forward for ``raw``, and the report; nothing is
    sent. ``params``: the request path's (a wire whose model is in its path)."""
    # large bodies are parsed and assembled off the event loop, as on the managed path
    offload = len(raw) > runtime.config.settings.server.offload_bytes
    body = await run_step(offload, parse_body, raw, wires.interpreted_fields)
    return await explain_body(runtime, wire or wires.sniff(body), body, tenant, override, summarize=summarize,
                              request_id=request_id, offload=offload, params=params, mode=mode)


async def explain_body(
    runtime: Runtime, wire: Wire, body: dict[str, Any], tenant: Tenant | None, override: str | None,
    *, summarize: bool = False, request_id: str = "", offload: bool = False, params: dict[str, str] | None = None,
    mode: str | None = None,
) -> dict[str, Any]:
    """``explain`` of a parsed body of ``wire`` (in the policy's mode, or ``mode``)."""
    hook = HOOKS.get(wire.name)
    exchange = None
    if hook is not None:  # as the managed handler does, and as cheaply as the pipeline below (dry-run)
        exchange = await hook.begin(runtime, tenant, body, override=override, request_id=request_id,
                                    dry_run=not summarize, offload=offload)
    if exchange is not None and exchange.edited:
        body = exchange.body  # what the handler would run the pipeline on (and forward)
    assembly, route, _policy = await runtime.assemble(wire, body, tenant=tenant, override=override, offload=offload,
                                                      request_id=request_id, dry_run=not summarize, params=params,
                                                      mode=mode)
    if exchange is not None:
        assembly.report.warnings.extend(hook_warnings(exchange))
    report = assembly.report.as_dict()
    if exchange is not None:
        report["context_management"] = exchange.describe()
    report["calibration_detail"] = calibration_detail(runtime, route, _policy.tenant)
    report["cost"] = cost_figures(runtime, route, assembly.report)
    return {wire.field: assembly.messages, "report": report}


def hook_warnings(exchange: Exchange) -> list[str]:
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
