"""The summary cache: content-addressed, persistent, single-flight.

A summary is stored under tenant + summariser settings + the chained hash of the
turns it covers, so identical histories share it, any edit misses it, and one
tenant never sees another's. The chained hashes are wire-neutral (``Item.atoms``),
so one conversation summarised once is reused whatever wire it arrives on
(docs/design.md#reuse-content-addressed-and-persistent).

A lookup asks the cache for every prefix of the conversation at once, longest
first (one ``get_many``: one Redis MGET; the disk backend stops reading at the
first record it finds), and takes the longest usable one, so there is no
per-conversation index to lose updates or overflow: each summary is its own
entry, bounded by the cache's TTL and size.

A small LRU of the summaries this process made or read last (``local_entries``) sits in front of the
shared cache: a lookup it answers with the longest prefix costs no cache operation, and while the
shared cache is slow or down (its breaker open, the request's cache budget spent) the summaries this
process made are still reused instead of being made again on every request.

Concurrent requests needing the same summary wait for one summariser call: in
one process through a shared task, across processes and replicas through the
cache's lock, which its holder renews while it works. Waiters keep waiting while
the holder is alive and never make a second summary; only past the longest a
live holder can take, or when the cache stops answering while another holds the
lock, is a request served without it (status ``pending``). A summary runs with a
cache-time budget of its own (``proxy.store.guard.own_budget``), not that of the
request that started it. A failure caches nothing
and starts a per-conversation back-off.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import hashlib
import logging
import time
from collections import OrderedDict
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Any

from plugins.base import CachedSummary, Completion, SummarizeFn, SummaryScope
from proxy.core.errors import SummaryUnavailable
from proxy.core.items import Item
from proxy.store.cache import Cache, LockHandle
from proxy.store.guard import FREE_SECONDS, own_budget

log = logging.getLogger("ctxproxy.summaries")

FAILURES_TRACKED = 10_000
LOCK_TTL = 30.0  # seconds; the holder renews it every LOCK_TTL / 3 while it summarises
MIN_WAIT = 0.1  # seconds a waiter polls the lock before it re-checks (lock_wait 0 must not spin)
# A lookup that holds a summary of its own (this process's copy) asks the shared cache only for the longer prefixes
# it has not found missing there in the last ABSENT_SECONDS: a longer summary another replica makes is seen within
# that time (and always before this process makes one: ``recheck``), and a conversation resent or growing at hundreds
# of requests a second reads the shared cache for its new prefixes alone, not for every prefix past its summary on
# every request. One mark per conversation summary, at most ABSENT_ENTRIES of them.
ABSENT_SECONDS = 1.0
ABSENT_ENTRIES = 4096

SummaryCall = Callable[[str, Completion, str], None]  # (tenant, the call, the request's model)
SummaryFailure = Callable[[str, str], None]  # (tenant, reason)


def summary_key(scope: SummaryScope, link: str) -> str:
    raw = f"{scope.tenant}\x00{scope.settings_id}\x00{link}".encode()
    return f"sum:{hashlib.sha256(raw).hexdigest()}"


def conversation_key(scope: SummaryScope, chain: Sequence[str]) -> str:
    """A conversation's identity, for back-off and background work: its first turn, in its scope."""
    return summary_key(scope, "conversation:" + chain[0])


@dataclass
class _Call:
    """One summariser call being made in this process; the first caller to get a fresh answer pays for it."""

    task: asyncio.Task[tuple[dict[str, Any], bool]]
    claimed: bool = False


def _answer_ok(record: dict[str, Any]) -> bool:
    """A cached summariser answer that can be used (a damaged one is made again and replaced)."""
    text, model = record.get("text"), record.get("model")
    tokens = (record.get("prompt_tokens"), record.get("completion_tokens"))
    return isinstance(text, str) and bool(text.strip()) and isinstance(model, str) \
        and all(type(n) is int for n in tokens)


@dataclass
class _Flight:
    """One summary being made in this process; the first request to get a fresh result reports it created."""

    task: asyncio.Task[tuple[CachedSummary, bool]]
    claimed: bool = False


class SummaryService:
    """Implements ``plugins.base.SummaryStore`` over a ``proxy.store.cache.Cache``."""

    def __init__(
        self,
        cache: Cache,
        *,
        ttl: float | None,
        lock_wait: float,
        backoff_first: float,
        backoff_max: float,
        lock_ttl: float = LOCK_TTL,
        max_wait: float = 600.0,
        local_entries: int = 0,
        on_call: SummaryCall | None = None,
        on_failure: SummaryFailure | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.cache = cache
        self.lock_ttl = lock_ttl
        self.on_call = on_call
        self.on_failure = on_failure
        self.clock = clock
        self._flights: dict[str, _Flight] = {}
        self._calls: dict[str, _Call] = {}  # summariser calls under way
        self._failures: OrderedDict[str, tuple[int, float]] = OrderedDict()  # conversation -> (failures, last at)
        self._local: OrderedDict[str, tuple[dict[str, Any], float | None]] = OrderedDict()  # key -> record, expiry
        # a local copy's key -> (until when, chain length, last link): the prefixes longer than that copy, up to that
        # length of that chain, were missing in the shared cache (``lookup``)
        self._absent: OrderedDict[str, tuple[float, int, str]] = OrderedDict()
        self.configure(ttl=ttl, local_entries=local_entries, lock_wait=lock_wait, max_wait=max_wait,
                       backoff_first=backoff_first, backoff_max=backoff_max)

    def configure(self, *, ttl: float | None, local_entries: int, lock_wait: float, max_wait: float,
                  backoff_first: float, backoff_max: float) -> None:
        """Set the settings a reload may change; a back-off in progress is measured with the new ones."""
        self.ttl = ttl
        self.local_entries = local_entries
        while len(self._local) > max(0, local_entries):
            self._local.popitem(last=False)
        if local_entries <= 0:
            self._absent.clear()
        self.lock_wait = lock_wait
        self.max_wait = max_wait
        self.backoff_first = backoff_first
        self.backoff_max = backoff_max

    def _backoff_until(self, conversation: str) -> float | None:
        failing = self._failures.get(conversation)
        if failing is None or not self.backoff_first:
            return None
        count, at = failing
        return at + min(self.backoff_max, self.backoff_first * 2.0 ** min(count - 1, 62))

    def _local_get(self, key: str) -> dict[str, Any] | None:
        item = self._local.get(key)
        if item is None:
            return None
        record, expires = item
        if expires is not None and self.clock() >= expires:
            del self._local[key]
            return None
        self._local.move_to_end(key)
        return record

    def _remember(self, key: str, record: dict[str, Any]) -> None:
        if self.local_entries <= 0:
            return
        self._local[key] = (record, None if self.ttl is None else self.clock() + self.ttl)
        self._local.move_to_end(key)
        while len(self._local) > self.local_entries:
            self._local.popitem(last=False)

    async def _get(self, key: str, remember: bool = True) -> dict[str, Any] | None:
        """One record: this process's copy, else the shared cache's (then kept here too, with ``remember``)."""
        record = self._local_get(key) if remember else None
        if record is None:
            record = await self.cache.get(key)
            if record is not None and remember:
                self._remember(key, record)
        return record

    async def lookup(self, scope: SummaryScope, chain: Sequence[str], *,
                     recheck: bool = False) -> CachedSummary | None:
        """The longest usable summary of a prefix of ``chain``. ``recheck``: ask the shared cache for every prefix
        longer than this process's copy, even those it found missing there less than ``ABSENT_SECONDS`` ago (a
        summary is about to be made: another replica may have made it meanwhile)."""
        if not chain:
            return None
        # longest prefix first; a backend that reads key by key (disk) may stop at the first record found
        # keys are made only as far back as this process's copy of a summary (a growing conversation's)
        local: CachedSummary | None = None
        keys: list[str] = []
        for i, link in enumerate(reversed(chain)):
            key = summary_key(scope, link)
            keys.append(key)
            record = self._local_get(key) if self._local else None
            if record is not None:
                local = _summary(record, len(chain) - i, chain[len(chain) - i - 1])
                if local is not None:
                    break  # only a longer prefix is worth asking the shared cache for
        if local is None:
            return (await self._shared(chain, keys, len(keys)))[0]
        # keys[j] is the prefix of len(chain) - j turns; the prefixes up to a recent mark's length were missing
        now, mark = self.clock(), None if recheck else self._absent.get(keys[-1])
        known = mark is not None and now < mark[0] and mark[1] <= len(chain) and chain[mark[1] - 1] == mark[2]
        limit = min(len(keys) - 1, len(chain) - mark[1]) if known and mark is not None else len(keys) - 1
        if limit <= 0:
            return dataclasses.replace(local, narrowed=True) if limit < len(keys) - 1 else local
        found, answered = await self._shared(chain, keys, limit)
        if found is None and limit < len(keys) - 1:
            local = dataclasses.replace(local, narrowed=True)  # (the prefixes past ``limit`` were not asked for)
        if found is None and answered and self.local_entries > 0:
            # every longer prefix is missing there: until when the oldest of those answers holds (a mark does not
            # outlive what it was read from), as far as this chain goes
            until = mark[0] if known and mark is not None else now + ABSENT_SECONDS
            self._absent[keys[-1]] = (until, len(chain), chain[-1])
            self._absent.move_to_end(keys[-1])
            if len(self._absent) > ABSENT_ENTRIES:
                self._absent.popitem(last=False)
        return found if found is not None else local

    async def _shared(self, chain: Sequence[str], keys: list[str],
                      limit: int) -> tuple[CachedSummary | None, bool]:
        """The longest usable summary the shared cache holds under ``keys[:limit]`` (longest prefix first), and
        whether the cache answered for every key it was asked for (a failed or short read did not)."""
        start = 0
        answered = True
        while start < limit:
            records = await self.cache.get_many(keys[start:limit], first_hit=True)
            answered = self.cache.read_answered and len(records) >= limit - start
            for offset, record in enumerate(records[:limit - start]):
                if record is None:
                    continue
                k = len(chain) - start - offset
                summary = _summary(record, k, chain[k - 1])
                if summary is not None:
                    self._remember(keys[start + offset], record)
                    return summary, True
                start += offset + 1  # a record that is not a summary of this prefix: read on past it
                break
            else:
                break
        return None, answered

    def making(self, scope: SummaryScope, chain: Sequence[str]) -> int:
        """How many turns the longest summary of this history being made in this process now covers (0: none)."""
        if not self._flights:
            return 0
        for k in range(len(chain), 0, -1):
            if summary_key(scope, chain[k - 1]) in self._flights:
                return k
        return 0

    def failing(self, scope: SummaryScope, chain: Sequence[str]) -> str | None:
        """Whether this conversation's last summary failed: ``backoff`` (backing off now), ``failed`` (since
        then no summary of it succeeded), or None."""
        if not chain:
            return None
        conversation = conversation_key(scope, chain)
        if conversation not in self._failures:
            return None
        until = self._backoff_until(conversation)
        return "backoff" if until is not None and self.clock() < until else "failed"

    async def obtain(
        self,
        scope: SummaryScope,
        chain: Sequence[str],
        cut: int,
        turns: Sequence[Sequence[Item]],
        previous: CachedSummary | None,
        summarize: SummarizeFn,
        request_id: str = "",
        model: str = "",
    ) -> tuple[CachedSummary, bool]:
        conversation = conversation_key(scope, chain)
        until = self._backoff_until(conversation)
        if until is not None and self.clock() < until:
            raise SummaryUnavailable(f"summariser backing off for {until - self.clock():.0f}s after a failure",
                                     reason="backoff")
        key = summary_key(scope, chain[cut - 1])
        flight = self._flights.get(key)
        if flight is None:
            job = _Job(key, conversation, scope, chain[cut - 1], cut, list(turns[:cut]), previous, summarize,
                       request_id, model)
            flight = _Flight(asyncio.create_task(self._make(job)))
            self._flights[key] = flight
            flight.task.add_done_callback(lambda t: self._done(self._flights, key, t))
        # shielded: a client that disconnects must not cancel the summary others are waiting for
        summary, fresh = await asyncio.shield(flight.task)
        created = fresh and not flight.claimed
        if created:
            flight.claimed = True
        return summary, created

    async def _make(self, job: _Job) -> tuple[CachedSummary, bool]:
        try:
            with own_budget():  # several requests may wait for it; none of them pays its cache time
                record, fresh = await self._record(job)
        except SummaryUnavailable as exc:
            if exc.reason != "pending":
                self._failed(job, exc)
            raise
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # an engine or plugin bug: never fail the client's request for it
            log.error("summariser bug for request %s", job.request_id or "-", exc_info=True)
            failure = SummaryUnavailable(f"summariser failed: {type(exc).__name__}: {exc}", reason="error")
            self._failed(job, failure)
            raise failure from exc
        summary = _summary(record, job.cut, job.link)
        if summary is None:
            raise SummaryUnavailable("cached summary is unreadable", reason="error")
        if fresh:  # what it cost, for the request that reports it created (proxy.serve.costs)
            summary = dataclasses.replace(summary, made_with=_usage(record.get("usage")))
        return summary, fresh

    async def _record(self, job: _Job) -> tuple[dict[str, Any], bool]:
        """The cached record of ``job``'s summary, or a new one made under the cross-process lock."""
        return await self._once(job.key, lambda: self._summarise(job), "summary",
                                valid=lambda record: _summary(record, job.cut, job.link) is not None)

    async def _once(self, key: str, make: Callable[[], Awaitable[dict[str, Any]]], what: str,
                    remember: bool = True, valid: Callable[[dict[str, Any]], bool] = bool
                    ) -> tuple[dict[str, Any], bool]:
        """The record cached under ``key``, or one ``make`` makes under the cross-process lock (never two at once),
        then cached (``remember``: in this process's copies too); True when made here. A record that is not
        ``valid`` (damaged) counts as missing, and is replaced.

        A waiter re-checks every ``lock_wait`` seconds and keeps waiting while another holder is alive
        (it renews its lock); when the holder dies its lock expires and a waiter takes over. Past
        ``max_wait`` (the longest a live holder can take) the request is served without it.
        """
        record = await self._get(key, remember)
        if record is not None and valid(record):
            return record, False
        give_up = self.clock() + self.max_wait
        contended = False  # another holder had the lock: what it makes is on the way
        while True:
            async with self.cache.lock("lock:" + key, ttl=self.lock_ttl, wait=max(self.lock_wait, MIN_WAIT),
                                       ready=lambda: self._ready(key, remember, valid)) as held:
                record = await self._get(key, remember)  # another replica may have made it meanwhile
                if record is not None and valid(record):
                    return record, False
                if held.acquired and not (held.failed_open and contended):
                    return await self._made(key, held, make, remember), True
                if held.acquired:  # the cache stopped answering while another replica makes it: never a second
                    raise SummaryUnavailable(f"the cache stopped answering while another replica makes this {what}; "
                                             "served without it", reason="pending")
                contended = True
            if self.clock() >= give_up:
                raise SummaryUnavailable(f"another request is still making this {what}; served without it",
                                         reason="pending")

    async def _made(self, key: str, held: LockHandle, make: Callable[[], Awaitable[dict[str, Any]]],
                    remember: bool) -> dict[str, Any]:
        renewing = asyncio.create_task(self._renew(held))
        try:
            record = await make()
        finally:
            renewing.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await renewing
        if remember:
            self._remember(key, record)  # first: reused here even if the shared cache cannot take it now
        with own_budget(FREE_SECONDS):  # issued whatever the waits so far cost (others wait for it), hardly waited for
            await self.cache.set(key, record, self.ttl)
        return record

    async def _ready(self, key: str, remember: bool, valid: Callable[[dict[str, Any]], bool]) -> bool:
        record = await self._get(key, remember)
        return record is not None and valid(record)

    async def _summarise(self, job: _Job) -> dict[str, Any]:
        previous, cut = job.previous, job.cut
        start = previous.covered_turns if previous is not None and previous.covered_turns < cut else 0
        completion = await job.summarize(previous.text if previous is not None and start else None,
                                         job.turns[start:])
        text = completion.text.strip()
        if not text:
            raise SummaryUnavailable("the summariser returned an empty answer", reason="empty")
        self._failures.pop(job.conversation, None)
        if self.on_call is not None:
            self.on_call(job.scope.tenant, completion, job.model)
        return {"text": text, "turns": cut, "chain": job.link, "model": completion.model,
                "incremental": bool(start), "created": time.time(),
                "usage": {"model": completion.model, "upstream_model": completion.upstream_model,
                          "prompt_tokens": completion.prompt_tokens,
                          "completion_tokens": completion.completion_tokens}}

    async def call_once(self, tenant: str, material: bytes, call: Callable[[], Awaitable[Completion]]) -> Completion:
        """One summariser call whose exact request is ``material``, made at most once at a time across requests
        and replicas, its answer cached with the summaries: two summaries of overlapping turns (made at once in
        one process or on two replicas) fold their common chunks once. It runs on the cache-time budget of the
        summary it is part of. Its tokens go to the first caller that gets a fresh answer (the summary that pays
        for it); any other caller, and a reused answer, has 0 tokens."""
        key = "call:" + hashlib.sha256(tenant.encode() + b"\x00" + material).hexdigest()
        flight = self._calls.get(key)
        if flight is None:
            async def make() -> dict[str, Any]:
                out = await call()
                if not out.text.strip():  # a failure: nothing is cached
                    raise SummaryUnavailable("the summariser returned an empty answer", reason="empty")
                return {"text": out.text, "model": out.model, "upstream_model": out.upstream_model,
                        "prompt_tokens": out.prompt_tokens, "completion_tokens": out.completion_tokens}

            flight = _Call(asyncio.create_task(self._once(key, make, "summariser call", remember=False,
                                                          valid=_answer_ok)))
            self._calls[key] = flight
            flight.task.add_done_callback(lambda t: self._done(self._calls, key, t))
        record, fresh = await asyncio.shield(flight.task)
        upstream = record.get("upstream_model")
        upstream = upstream if isinstance(upstream, str) else ""
        if not fresh or flight.claimed:
            return Completion(record["text"], record["model"], 0, 0, upstream)
        flight.claimed = True
        return Completion(record["text"], record["model"], int(record["prompt_tokens"]),
                          int(record["completion_tokens"]), upstream)

    @staticmethod
    def _done(running: dict[str, Any], key: str, task: asyncio.Task[Any]) -> None:
        running.pop(key, None)
        if not task.cancelled():
            task.exception()  # retrieved: a waiter that was cancelled no longer reads it (asyncio would log it)

    async def _renew(self, held: LockHandle) -> None:
        while True:
            await asyncio.sleep(self.lock_ttl / 3)
            await held.renew()

    def _failed(self, job: _Job, exc: SummaryUnavailable) -> None:
        if exc.reason != "backoff":
            count = self._failures.get(job.conversation, (0, 0.0))[0] + 1
            self._failures[job.conversation] = (count, self.clock())
            self._failures.move_to_end(job.conversation)
            while len(self._failures) > FAILURES_TRACKED:
                self._failures.popitem(last=False)
        log.warning("summariser failed for request %s (tenant %s, reason %s): %s; serving with the trimmer alone",
                    job.request_id or "-", job.scope.tenant, exc.reason, exc)
        if self.on_failure is not None:
            self.on_failure(job.scope.tenant, exc.reason)

    async def close(self) -> None:
        for flight in list(self._flights.values()):
            flight.task.cancel()
        self._flights.clear()
        for call in list(self._calls.values()):
            call.task.cancel()
        self._calls.clear()


@dataclass(frozen=True)
class _Job:
    """One summary to make: turns[:cut] of a conversation, from ``previous`` when there is one."""

    key: str
    conversation: str
    scope: SummaryScope
    link: str  # the chained hash of turns[:cut]
    cut: int
    turns: list[Sequence[Item]]
    previous: CachedSummary | None
    summarize: SummarizeFn
    request_id: str
    model: str  # the model of the request the summary is made for (its cost is attributed there)


def _usage(raw: Any) -> Completion | None:
    if not isinstance(raw, dict):
        return None
    model, upstream = raw.get("model"), raw.get("upstream_model")
    prompt, completion = raw.get("prompt_tokens"), raw.get("completion_tokens")
    if not isinstance(model, str) or not isinstance(prompt, int) or not isinstance(completion, int):
        return None
    return Completion("", model, max(0, prompt), max(0, completion), upstream if isinstance(upstream, str) else "")


def _summary(record: dict[str, Any] | None, turns: int, chain: str) -> CachedSummary | None:
    if not isinstance(record, dict) or not isinstance(record.get("text"), str) or not record["text"]:
        return None
    if record.get("chain") not in (None, chain):
        return None
    return CachedSummary(turns, chain, record["text"])
