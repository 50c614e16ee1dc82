"""The summary cache: content-addressed, persistent, single-flight (DESIGN §3).

A summary is stored under tenant + summariser settings + the chained hash of
the turns it covers, so identical histories share it, any edit misses it, and
one tenant never sees another's. A small index per conversation (keyed the same
way by its first turn) lists the prefixes that have summaries, so a lookup is
two cache reads whatever the conversation's length, and a creation two writes.

Concurrent requests needing the same summary wait for one summariser call: in
one process through a shared task, across processes through the cache's lock.
A failure caches nothing and starts a per-conversation back-off.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import time
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from plugins.base import CachedSummary, Completion, SummarizeFn, SummaryScope, SummaryUnavailable
from proxy.cache import Cache
from proxy.messages import Message

log = logging.getLogger("ctxproxy.summaries")

INDEX_ENTRIES = 8
FAILURES_TRACKED = 10_000

SummaryCall = Callable[[str, Completion], None]


def _key(kind: str, scope: SummaryScope, link: str) -> str:
    raw = f"{scope.tenant}\x00{scope.settings_id}\x00{link}".encode()
    return f"{kind}:{hashlib.sha256(raw).hexdigest()}"


class SummaryService:
    """Implements ``plugins.base.SummaryStore`` over a ``proxy.cache.Cache``."""

    def __init__(
        self,
        cache: Cache,
        *,
        ttl: float | None,
        lock_wait: float,
        lock_ttl: float,
        backoff_first: float,
        backoff_max: float,
        on_call: SummaryCall | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.cache = cache
        self.ttl = ttl
        self.lock_wait = lock_wait
        self.lock_ttl = lock_ttl
        self.backoff_first = backoff_first
        self.backoff_max = backoff_max
        self.on_call = on_call
        self.clock = clock
        self.calls = 0
        self._flights: dict[str, asyncio.Task[tuple[CachedSummary, bool]]] = {}
        self._failures: OrderedDict[str, tuple[int, float]] = OrderedDict()

    async def lookup(self, scope: SummaryScope, chain: Sequence[str]) -> CachedSummary | None:
        if not chain:
            return None
        index = await self.cache.get(_key("idx", scope, chain[0]))
        best: tuple[int, str] | None = None
        for entry in (index or {}).get("entries", []):
            k, link = entry.get("turns"), entry.get("chain")
            if isinstance(k, int) and 1 <= k <= len(chain) and chain[k - 1] == link and (best is None or k > best[0]):
                best = (k, link)
        if best is None:
            return None
        record = await self.cache.get(_key("sum", scope, best[1]))
        return _summary(record, best[0], best[1])

    async def obtain(
        self,
        scope: SummaryScope,
        chain: Sequence[str],
        cut: int,
        turns: Sequence[Sequence[Message]],
        previous: CachedSummary | None,
        summarize: SummarizeFn,
    ) -> tuple[CachedSummary, bool]:
        conversation = _key("idx", scope, chain[0])
        failing = self._failures.get(conversation)
        if failing is not None and self.clock() < failing[1]:
            raise SummaryUnavailable(f"summariser backing off for {failing[1] - self.clock():.0f}s after a failure")
        key = _key("sum", scope, chain[cut - 1])
        task = self._flights.get(key)
        leader = task is None
        if task is None:
            job = _Job(key, conversation, scope, chain[cut - 1], cut, list(turns[:cut]), previous, summarize)
            task = asyncio.create_task(self._make(job))
            self._flights[key] = task
            task.add_done_callback(lambda _t: self._flights.pop(key, None))
        try:
            # shielded: a client that disconnects must not cancel the summary others are waiting for
            summary, fresh = await asyncio.shield(task)
        except SummaryUnavailable:
            raise
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            raise SummaryUnavailable(f"summariser failed: {type(exc).__name__}: {exc}") from exc
        return summary, fresh and leader

    async def _make(self, job: _Job) -> tuple[CachedSummary, bool]:
        fresh = False
        record = await self.cache.get(job.key)
        if record is None:
            async with self.cache.lock("lock:" + job.key, ttl=self.lock_ttl, wait=self.lock_wait):
                record = await self.cache.get(job.key)  # another replica may have made it meanwhile
                if record is None:
                    record = await self._summarise(job)
                    fresh = True
        summary = _summary(record, job.cut, job.link)
        if summary is None:
            raise SummaryUnavailable("cached summary is unreadable")
        return summary, fresh

    async def _summarise(self, job: _Job) -> dict[str, Any]:
        previous, cut, conversation = job.previous, job.cut, job.conversation
        start = previous.covered_turns if previous is not None and previous.covered_turns < cut else 0
        self.calls += 1
        try:
            completion = await job.summarize(previous.text if previous is not None and start else None,
                                             job.turns[start:])
            text = completion.text.strip()
            if not text:
                raise SummaryUnavailable("the summariser returned an empty answer")
        except asyncio.CancelledError:
            raise
        except BaseException as exc:
            self._fail(conversation)
            log.warning("summariser failed (%s); serving with the trimmer alone", type(exc).__name__)
            if isinstance(exc, SummaryUnavailable):
                raise
            raise SummaryUnavailable(f"summariser failed: {type(exc).__name__}: {exc}") from exc
        self._failures.pop(conversation, None)
        if self.on_call is not None:
            self.on_call(job.scope.tenant, completion)
        record = {"text": text, "turns": cut, "chain": job.link, "model": completion.model,
                  "incremental": bool(start), "created": time.time()}
        await self.cache.set(job.key, record, self.ttl)
        index = await self.cache.get(conversation) or {}
        entries = [e for e in index.get("entries", []) if isinstance(e, dict) and e.get("chain") != job.link]
        entries.append({"turns": cut, "chain": job.link})
        await self.cache.set(conversation, {"entries": entries[-INDEX_ENTRIES:]}, self.ttl)
        return record

    def _fail(self, conversation: str) -> None:
        count = self._failures.get(conversation, (0, 0.0))[0] + 1
        delay = min(self.backoff_max, self.backoff_first * 2 ** (count - 1)) if self.backoff_first else 0.0
        self._failures[conversation] = (count, self.clock() + delay)
        self._failures.move_to_end(conversation)
        while len(self._failures) > FAILURES_TRACKED:
            self._failures.popitem(last=False)

    async def close(self) -> None:
        for task in list(self._flights.values()):
            task.cancel()
        self._flights.clear()


@dataclass(frozen=True)
class _Job:
    """One summary to make: turns[:cut] of a conversation, from ``previous`` when there is one."""

    key: str
    conversation: str
    scope: SummaryScope
    link: str  # the chained hash of turns[:cut]
    cut: int
    turns: list[Sequence[Message]]
    previous: CachedSummary | None
    summarize: SummarizeFn


def _summary(record: dict[str, Any] | None, turns: int, chain: str) -> CachedSummary | None:
    if not isinstance(record, dict) or not isinstance(record.get("text"), str) or not record["text"]:
        return None
    return CachedSummary(turns, chain, record["text"], int(record.get("tokens") or 0))
