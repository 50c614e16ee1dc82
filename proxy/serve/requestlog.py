"""One structured JSON line per request (logger ``ctxproxy.requests``).

Fields: request id, wire, tenant, model, status, mode, tokens in/out, what was removed and
how, how many tool outputs were masked, the re-fetches the request showed (by how: masked, summarised,
dropped; ``proxy.store.refetch``), summary status, repairs, overhead and upstream latency, and what
became of a refusal for length (``overflow``: recovered or failed). In observe
mode (``mode: "observe"``) the client's payload was forwarded, and tokens out, removed, the summary and the
cost's gross are what enforce would have done (``would_refuse``: the code enforce would have refused it
with). Keys and prompt text are never part of a record.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import orjson

from proxy.pipeline import Report
from proxy.serve.logsink import STRUCTURED

if TYPE_CHECKING:
    from proxy.core.refusal import Refusal
    from proxy.serve.costs import RequestCost

log = logging.getLogger("ctxproxy.requests")


@dataclass
class RequestRecord:
    request_id: str
    started: float
    wire: str = "chat"
    event: str = "request"
    tenant: str = "default"
    model: str | None = None
    status: int = 0
    error: str | None = None
    report: Report | None = None
    overhead: float | None = None
    upstream: float | None = None
    ttft: float | None = None
    usage: dict[str, Any] | None = None
    refusal: Refusal | None = None  # the provider refused the payload for length (learned from; not logged)
    overflow: str | None = None  # recovered | failed: what became of a refusal for length (proxy.serve.overflow)
    refetched: dict[str, int] | None = None  # calls repeating one whose output was removed, by how
    cost: RequestCost | None = None

    def fields(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "event": self.event,
            "request_id": self.request_id,
            "wire": self.wire,
            "tenant": self.tenant,
            "model": self.model[:200] if self.model else None,
            "status": self.status,
        }
        if self.error:
            out["error"] = self.error
        if self.overflow:
            out["overflow"] = self.overflow
        r = self.report
        if r is not None:
            out.update(
                mode=r.mode,
                tokens_in=r.tokens_before,
                tokens_out=r.tokens_after,
                hard_budget=r.hard_budget,
                removed=r.removed,
                summary=r.summary,
                turns_summarised=r.turns_summarised,
                turns_dropped=r.turns_dropped,
                repairs=r.repairs,
                context_manager=r.context_manager,
            )
            if r.summary_wait is not None:
                out["summary_wait_ms"] = round(r.summary_wait * 1000, 3)  # it waited for a summariser
            if r.background:
                out["background"] = r.background  # a summary asked for in the background, and what came of it
            if r.masked:
                out["outputs_masked"] = len(r.masked)  # tool outputs masked (which ones: explain, assemble)
            if self.refetched:
                out["refetched"] = self.refetched
            if r.warnings:
                out["warnings"] = len(r.warnings)
            if r.would_refuse:
                out["would_refuse"] = r.would_refuse
            if r.unmanaged:
                out["unmanaged"] = r.unmanaged  # the provider holds part of the history (a bounded reason)
        if self.overhead is not None:
            out["overhead_ms"] = round(self.overhead * 1000, 3)
        if self.upstream is not None:
            out["upstream_ms"] = round(self.upstream * 1000, 3)
        if self.ttft is not None:
            out["ttft_ms"] = round(self.ttft * 1000, 3)
        if self.usage:
            out["usage"] = {k: v for k, v in self.usage.items() if isinstance(v, int)}
        c = self.cost
        if c is not None:
            out["cost"] = {"calibration": r.calibration if r is not None else None, "gross_usd": c.gross_usd,
                           "summarizer_usd": c.summarizer_usd, "cache_break_usd": c.cache_break_usd,
                           "cache_removed_usd": c.cache_removed_usd, "net_usd": c.net_usd}
        return out

    def log(self) -> None:
        if log.isEnabledFor(logging.INFO):
            log.info(orjson.dumps(self.fields()).decode(), extra=STRUCTURED)
