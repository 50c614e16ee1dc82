"""The cost ledger: hourly totals per tenant and model, kept in a store of its own (``ctxproxy report``).

Why a ledger and not the metrics: Prometheus counters live in one process and start again from zero
with it; a report "since 24h" from them needs a Prometheus server with its retention, and its
``increase()`` extrapolates. The ledger records the same amounts, at the same places in the code, as
the counters (``proxy.serve.metrics.Metrics`` feeds both), so its totals equal the counters' over the
life of a process, and it outlives restarts and sums replicas.

How it is kept, and why so:

- **Its own store** (``proxy.store.ledger_store``), never the summary cache: a cache evicts, and the
  summaries it counts would push the ledger out. Nothing expires there; the ledger prunes the hours
  older than 31 days (``RETENTION_HOURS``) itself.
- **Hourly buckets**: a report's resolution is the hour (``--since`` rounds down to one).
- **One bucket per replica per hour**: a replica is the only writer of its buckets, so it writes each
  whole (no read-modify-write, no increment lost between replicas).
- **Written every ``FLUSH_SECONDS``** in the background and at shutdown, never on a request's path:
  a crash loses at most that much. A bucket stays dirty until the store confirms the write; one that
  fails is written again (with everything added meanwhile) by the next flush, so a store that refuses
  writes for a while loses nothing that finished. The admin endpoint flushes before it reads.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
import uuid
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from proxy.core.errors import LedgerUnavailable
from proxy.store.ledger_store import LedgerStore

log = logging.getLogger("ctxproxy.ledger")

FIELDS = (
    "requests", "tokens_received", "tokens_forwarded", "tokens_removed", "summaries_created", "summaries_reused",
    "summarizer_usd", "gross_usd", "cache_effect_usd", "net_usd", "unpriced",
    "refetched_masked", "refetched_summarised", "refetched_dropped",  # ``proxy.store.refetch``
    # observe mode: requests forwarded as sent, and what enforce would have done with them (a bucket written
    # before these existed reads them as 0)
    "observed_requests", "observed_tokens_received", "observed_tokens_forwarded", "observed_tokens_removed",
    "observed_gross_usd", "observed_refusals",
)
FLUSH_SECONDS = 10.0
CLOSE_SECONDS = 5.0  # how long shutdown waits for the last flush
HOUR = 3600
RETENTION_HOURS = 31 * 24
RETENTION_SECONDS = RETENTION_HOURS * HOUR


def hour_of(t: float) -> int:
    """The bucket of unix time ``t``: its hour, as hours since the epoch."""
    return int(t // HOUR)


@dataclass
class Row:
    tenant: str
    model: str
    amounts: dict[str, float] = field(default_factory=lambda: dict.fromkeys(FIELDS, 0.0))

    def add(self, amounts: Mapping[str, float]) -> None:
        mine = self.amounts
        isfinite = math.isfinite
        for name, value in amounts.items():
            if value and name in mine and isfinite(value):  # (most of a request's amounts are 0)
                mine[name] += value

    def as_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {"tenant": self.tenant, "model": self.model}
        for name, value in self.amounts.items():
            out[name] = value if name.endswith("_usd") else round(value)
        return out


class Ledger:
    """This process's buckets and the store they are flushed to (one per app: ``Shared.ledger``)."""

    def __init__(self, store: LedgerStore, *, flush_every: float = FLUSH_SECONDS,
                 clock: Callable[[], float] = time.time) -> None:
        self.store = store
        self.flush_every = flush_every
        self.clock = clock
        self.replica = uuid.uuid4().hex[:16]
        self._hours: dict[int, dict[tuple[str, str], Row]] = {}
        self._dirty: set[int] = set()
        self._created = False
        self._pruned = -1  # the hour of the last prune
        self._failing: str | None = None  # why the last flush failed, while it keeps failing
        self._lock = asyncio.Lock()

    def add(self, tenant: str, model: str, **amounts: float) -> None:
        """Add to this hour's row of (tenant, model); labels are the metrics' bounded ones."""
        self.add_all(tenant, model, amounts)

    def add_all(self, tenant: str, model: str, amounts: Mapping[str, float]) -> None:
        """``add``, the amounts given as a dict (as the metrics collect them)."""
        hour = int(self.clock() // HOUR)  # (``hour_of``, inline: three of these a request)
        rows = self._hours.setdefault(hour, {})
        row = rows.get((tenant, model))
        if row is None:
            row = rows[(tenant, model)] = Row(tenant, model)
        row.add(amounts)
        self._dirty.add(hour)

    @property
    def unwritten(self) -> int:
        """Hours whose latest figures the store has not confirmed."""
        return len(self._dirty)

    async def flush(self) -> None:
        """Write every bucket changed since its last confirmed write (its whole content: this replica owns it).

        Raises ``LedgerUnavailable`` when the store refuses; what was not written stays dirty for the next flush.
        """
        async with self._lock:
            if not self._created:
                await self.store.create()
                self._created = True
            for hour in sorted(self._dirty):
                # clean before the snapshot, with no await between: a row added while the write is under way
                # marks the hour dirty again, and the next flush writes it
                self._dirty.discard(hour)
                rows = [row.as_dict() for row in self._hours.get(hour, {}).values()]
                try:
                    await self.store.write(hour, self.replica, rows)
                except BaseException:  # refused, or cancelled half-way (shutdown): not written
                    self._dirty.add(hour)
                    raise
            current = hour_of(self.clock())
            if self._pruned != current:
                await self.store.prune(current - RETENTION_HOURS)
                self._pruned = current
            for hour in [h for h in self._hours if h < current - 1 and h not in self._dirty]:
                del self._hours[hour]  # written, and no request adds to it any more
            for hour in [h for h in self._hours if h < current - RETENTION_HOURS]:
                del self._hours[hour]  # never written, and past what a report may ask for
                self._dirty.discard(hour)

    async def run(self) -> None:
        """Flush at once (the ledger then exists, empty or not), then every ``flush_every`` seconds until cancelled
        (the server's background task)."""
        while True:
            await self._flush_logged()
            await asyncio.sleep(self.flush_every)

    async def _flush_logged(self) -> None:
        try:
            await self.flush()
        except LedgerUnavailable as exc:
            if self._failing is None:
                log.warning("cost ledger: cannot write (%s); this process keeps its figures (%d hour(s)) "
                            "and tries again every %.0f s", exc, self.unwritten, self.flush_every)
            self._failing = str(exc)
        except Exception:  # a bug must not stop the ledger for good
            log.exception("ledger flush failed")
        else:
            if self._failing is not None:
                log.info("cost ledger: written to %s again", self.store.where)
                self._failing = None

    async def close(self) -> None:
        """The last flush (bounded; none when nothing is unwritten, so ``ctxproxy assemble`` creates no ledger),
        then the store."""
        try:
            if self._dirty:
                await asyncio.wait_for(self.flush(), timeout=CLOSE_SECONDS)
        except (LedgerUnavailable, asyncio.TimeoutError) as exc:
            log.error("cost ledger: the last figures of this process (%d hour(s)) could not be written (%s)",
                      self.unwritten, str(exc) or f"{self.store.where}: timed out")
        except Exception:
            log.exception("ledger flush failed")
        finally:
            await self.store.close()


async def read(store: LedgerStore, since: float, until: float) -> list[Row]:
    """Every replica's rows of the hours from ``since`` (rounded down to its hour) to ``until``, summed.

    Raises ``LedgerUnavailable`` when the store cannot be read: never an empty report for a ledger it cannot see.
    """
    buckets = await store.read(hour_of(since), hour_of(until))
    return merge(row for rows in buckets for row in rows)


def merge(rows: Iterable[dict[str, Any]]) -> list[Row]:
    out: dict[tuple[str, str], Row] = {}
    for raw in rows:
        tenant, model = raw.get("tenant"), raw.get("model")
        if not isinstance(tenant, str) or not isinstance(model, str):
            continue
        row = out.get((tenant, model))
        if row is None:
            row = out[(tenant, model)] = Row(tenant, model)
        row.add({k: float(v) for k, v in raw.items()
                 if k in FIELDS and isinstance(v, (int, float)) and not isinstance(v, bool)})
    return sorted(out.values(), key=lambda r: (r.tenant, r.model))
