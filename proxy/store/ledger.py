"""The cost ledger: hourly totals per tenant and model, kept in the cache backend (``ctxproxy report``).

Why a ledger and not the metrics: Prometheus counters live in one process and start again from zero
with it; a report "since 24h" from them needs a Prometheus server with its retention, and its
``increase()`` extrapolates. The ledger records the same amounts, at the same places in the code, as
the counters (``proxy.serve.metrics.Metrics`` feeds both), so its totals equal the counters' over the
life of a process, and it outlives restarts and sums replicas.

How it is kept, and why so:

- **Hourly buckets**: a report's resolution is the hour (``--since`` rounds down to one); 31 days of
  buckets are kept (``RETENTION_SECONDS``, the keys' TTL).
- **One key per replica per hour** (``ledger:v1:<hour>:<replica>``): a replica is the only writer of
  its keys, so it writes its whole bucket (no read-modify-write, no lost increments between replicas,
  which ``Cache.get/set`` could not make atomic). An index per hour lists the replicas that wrote it;
  it is updated once per replica and hour, under the cache's cross-process lock.
- **Written every ``FLUSH_SECONDS``** in the background and at shutdown, never on a request's path:
  a crash loses at most that much. The admin endpoint flushes before it reads.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import time
import uuid
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

from proxy.store.cache import Cache, SafeCache

log = logging.getLogger("ctxproxy.ledger")

FIELDS = (
    "requests", "tokens_received", "tokens_forwarded", "tokens_removed", "summaries_created", "summaries_reused",
    "summarizer_usd", "gross_usd", "cache_effect_usd", "net_usd", "unpriced",
)
FLUSH_SECONDS = 10.0
HOUR = 3600
RETENTION_SECONDS = 31 * 24 * HOUR
PREFIX = "ledger:v1:"


def hour_of(t: float) -> int:
    """The bucket of unix time ``t``: its hour, as hours since the epoch."""
    return int(t // HOUR)


@dataclass
class Row:
    tenant: str
    model: str
    amounts: dict[str, float] = field(default_factory=lambda: dict.fromkeys(FIELDS, 0.0))

    def add(self, amounts: dict[str, float]) -> None:
        for name, value in amounts.items():
            if name in self.amounts and math.isfinite(value):
                self.amounts[name] += value

    def as_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {"tenant": self.tenant, "model": self.model}
        for name, value in self.amounts.items():
            out[name] = value if name.endswith("_usd") else round(value)
        return out


class Ledger:
    """This process's buckets and the shared store they are flushed to (one per app: ``Shared.ledger``)."""

    def __init__(self, cache: Cache | SafeCache, *, flush_every: float = FLUSH_SECONDS,
                 clock: Callable[[], float] = time.time) -> None:
        self.cache = cache
        self.flush_every = flush_every
        self.clock = clock
        self.replica = uuid.uuid4().hex[:16]
        self._hours: dict[int, dict[tuple[str, str], Row]] = {}
        self._dirty: set[int] = set()
        self._indexed: set[int] = set()
        self._lock = asyncio.Lock()

    def add(self, tenant: str, model: str, **amounts: float) -> None:
        """Add to this hour's row of (tenant, model); labels are the metrics' bounded ones."""
        hour = hour_of(self.clock())
        rows = self._hours.setdefault(hour, {})
        row = rows.get((tenant, model))
        if row is None:
            row = rows[(tenant, model)] = Row(tenant, model)
        row.add(amounts)
        self._dirty.add(hour)

    async def flush(self) -> None:
        """Write every bucket changed since the last flush (its whole content: this replica owns the key)."""
        async with self._lock:
            for hour in sorted(self._dirty):
                rows = [row.as_dict() for row in self._hours.get(hour, {}).values()]
                await self._index(hour)
                await self.cache.set(f"{PREFIX}{hour}:{self.replica}", {"hour": hour, "replica": self.replica,
                                                                         "rows": rows}, RETENTION_SECONDS)
                # clean only once written: a flush cancelled half-way (shutdown) loses no hour
                self._dirty.discard(hour)
            current = hour_of(self.clock())
            for hour in [h for h in self._hours if h < current - 1 and h not in self._dirty]:
                del self._hours[hour]  # written, and no request adds to it any more

    async def _index(self, hour: int) -> None:
        if hour in self._indexed:
            return
        key = f"{PREFIX}index:{hour}"
        async with self.cache.lock(key, ttl=10.0, wait=10.0):
            index = await self.cache.get(key) or {}
            replicas = [r for r in index.get("replicas", []) if isinstance(r, str)]
            if self.replica not in replicas:
                await self.cache.set(key, {"replicas": [*replicas, self.replica]}, RETENTION_SECONDS)
        self._indexed.add(hour)

    async def run(self) -> None:
        """Flush every ``flush_every`` seconds until cancelled (the app's background task)."""
        while True:
            await asyncio.sleep(self.flush_every)
            try:
                await self.flush()
            except Exception:  # a bug must not stop the ledger for good; the cache's own errors are swallowed
                log.exception("ledger flush failed")

    async def close(self) -> None:
        with contextlib.suppress(Exception):
            await asyncio.wait_for(self.flush(), timeout=5.0)


async def read(cache: Cache | SafeCache, since: float, until: float) -> list[Row]:
    """Every replica's rows of the hours from ``since`` (rounded down to its hour) to ``until``, summed."""
    hours = list(range(hour_of(since), hour_of(until) + 1))
    indexes = await cache.get_many([f"{PREFIX}index:{h}" for h in hours])
    keys = [f"{PREFIX}{h}:{replica}" for h, index in zip(hours, indexes) if isinstance(index, dict)
            for replica in index.get("replicas", []) if isinstance(replica, str)]
    buckets = await cache.get_many(keys) if keys else []
    return merge(row for bucket in buckets if isinstance(bucket, dict)
                 for row in bucket.get("rows", []) if isinstance(row, dict))


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
