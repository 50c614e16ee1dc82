"""The cost report: per tenant and model, from the cost ledger (``proxy.store.ledger``).

``ctxproxy report --since 24h`` reads the ledger's store directly; ``GET /admin/report`` (admin key)
flushes the serving process's buckets first, then reads the same. Both print, per tenant and model:
requests, tokens received / forwarded / removed, summaries created / reused, re-fetches (calls the model
made again after their output was removed: ``refetched``, and in the JSON by how: ``refetched_masked``,
``refetched_summarised``, ``refetched_dropped``), the summariser's cost, the gross saving, the prompt-cache
effect and the net saving of the requests ctxproxy enforced, and next to them those it observed
(``mode: observe``: forwarded as sent): how many, the tokens enforce would have removed, the gross saving it
would have made (priced as the enforced one) and how many it would have refused; with a total line.

A report that cannot read its ledger (the store is down or stalled, the path names no ledger) or cannot
write the serving process's figures first fails, naming why (``LedgerUnavailable``: 503, exit 1); an
all-zero report means that nothing was recorded in the period.
"""

from __future__ import annotations

import re
import time
from typing import Any

from proxy.store.ledger import HOUR, RETENTION_SECONDS, Row, read
from proxy.store.ledger_store import LedgerStore
from proxy.store.refetch import HOW

_SINCE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([smhd]?)\s*$")
_UNITS = {"s": 1, "m": 60, "h": HOUR, "d": 24 * HOUR, "": HOUR}


def parse_since(text: str) -> float:
    """``90m``, ``24h``, ``7d`` (a bare number is hours) as seconds; at most the ledger's retention."""
    match = _SINCE.match(text or "")
    if match is None:
        raise ValueError(f"since: expected a duration such as 90m, 24h or 7d, got {text[:40]!r}")
    seconds = float(match.group(1)) * _UNITS[match.group(2)]
    if not 0 < seconds <= RETENTION_SECONDS:
        raise ValueError(f"since: must be more than 0 and at most {RETENTION_SECONDS // (24 * HOUR)}d")
    return seconds


async def cost_report(store: LedgerStore, since_seconds: float, now: float | None = None) -> dict[str, Any]:
    """The report of the last ``since_seconds``; raises ``LedgerUnavailable`` when the ledger cannot be read."""
    now = time.time() if now is None else now
    since = now - since_seconds
    rows = await read(store, since, now)
    total = Row("*", "*")
    for row in rows:
        total.add(row.amounts)
    return {
        "since": since, "until": now, "resolution": "hour",
        "note": "from the cost ledger (hourly buckets, kept 31 days outside the cache's eviction); "
                "the first hour is counted whole",
        "ledger": store.where,
        "rows": [_with_refetches(row.as_dict()) for row in rows],
        "total": _with_refetches(total.as_dict()),
    }


def _with_refetches(row: dict[str, Any]) -> dict[str, Any]:
    """A row with its re-fetches summed over how (``refetched``), beside the three it sums."""
    row["refetched"] = sum(row.get(f"refetched_{how}", 0) for how in HOW)
    return row


COLUMNS = (
    ("tenant", "tenant"), ("model", "model"), ("requests", "requests"), ("tokens_received", "received"),
    ("tokens_forwarded", "forwarded"), ("tokens_removed", "removed"), ("summaries_created", "sum.new"),
    ("summaries_reused", "sum.reused"), ("refetched", "re-fetches"), ("summarizer_usd", "summariser $"),
    ("gross_usd", "gross $"), ("cache_effect_usd", "cache effect $"), ("net_usd", "net $"),
    ("observed_requests", "observed"), ("observed_tokens_removed", "would remove"),
    ("observed_gross_usd", "would save $"), ("observed_refusals", "would refuse"),
)


def render(report: dict[str, Any]) -> str:
    """The report as a plain-text table."""
    def cell(name: str, value: Any) -> str:
        if name.endswith("_usd"):
            return f"{value:.6f}"
        return str(value)

    lines = [[title for _, title in COLUMNS]]
    for row in [*report["rows"], report["total"]]:
        lines.append([cell(name, row.get(name, 0)) for name, _ in COLUMNS])
    widths = [max(len(line[i]) for line in lines) for i in range(len(COLUMNS))]
    out = []
    for n, line in enumerate(lines):
        if n == len(lines) - 1:
            out.append("  ".join("-" * w for w in widths))
        out.append("  ".join(c.ljust(w) if i < 2 else c.rjust(w) for i, (c, w) in enumerate(zip(line, widths))))
    since = time.strftime("%Y-%m-%d %H:00 UTC", time.gmtime(report["since"]))
    until = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime(report["until"]))
    unpriced = report["total"].get("unpriced", 0)
    footer = f"from {since} to {until}; net = gross - summariser - cache effect"
    if report["total"].get("observed_requests", 0):
        footer += ("; observed: requests forwarded as sent (mode: observe), with what enforce would have removed, "
                   "saved (gross) and refused")
    if unpriced:
        footer += f"; {unpriced} request(s) had no price and are not in the $ columns"
    return "\n".join([*out, footer]) + "\n"
