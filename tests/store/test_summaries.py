"""proxy.store.summaries: SummaryService on MemoryCache with a fake summarise function.

Longest-prefix lookup in one get_many, single flight in one process and across
processes (two services on one cache), the first fresh result claimed once even
when its leader is cancelled, back-off after failures, ``pending`` past max_wait
while a live holder keeps the lock, and lock renewal while summarising.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Sequence
from typing import Any

import pytest

from plugins.base import CachedSummary, Completion, SummaryScope
from proxy.core.errors import SummaryUnavailable
from proxy.core.items import ASSISTANT, USER, Item
from proxy.store.cache import Cache, SafeCache
from proxy.store.memory import MemoryCache
from proxy.store.summaries import ABSENT_SECONDS, SummaryService, summary_key
from tests.fake_upstream import FakeUpstream
from tests.store.test_summaries_http import config as summarising_config

SCOPE = SummaryScope("acme", "llm/v2/gpt-4o-mini/e3b0c44298fc1c14")
CHAIN = [f"{i:032x}" for i in range(1, 9)]
TURNS: list[list[Item]] = [[Item({"t": i}, USER), Item({"a": i}, ASSISTANT)] for i in range(8)]


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


class CountingCache(MemoryCache):
    """MemoryCache that counts its operations (to see a lookup is one round trip)."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: list[str] = []

    async def get(self, key: str) -> dict[str, Any] | None:
        self.ops.append("get")
        return await super().get(key)

    async def get_many(self, keys: list[str], first_hit: bool = False) -> list[dict[str, Any] | None]:
        self.ops.append(f"get_many:{len(keys)}")
        return [await MemoryCache.get(self, k) for k in keys]

    async def _try_acquire(self, lock_key: str, token: str, ttl: float) -> bool:
        self.ops.append("acquire")
        return await super()._try_acquire(lock_key, token, ttl)

    async def _renew(self, lock_key: str, token: str, ttl: float) -> None:
        self.ops.append("renew")
        await super()._renew(lock_key, token, ttl)


class Summarizer:
    """A fake SummarizeFn: records its calls; ``gate`` holds it until set; ``fail`` raises instead."""

    def __init__(self, text: str = "- user Ada (U-42) booked ZX1Q", *, delay: float = 0.0) -> None:
        self.text = text
        self.delay = delay
        self.calls: list[tuple[str | None, list[list[Item]]]] = []
        self.started = asyncio.Event()
        self.gate: asyncio.Event | None = None
        self.fail: BaseException | None = None

    async def __call__(self, previous: str | None, turns: Sequence[Sequence[Item]]) -> Completion:
        self.calls.append((previous, [list(t) for t in turns]))
        self.started.set()
        if self.gate is not None:
            await self.gate.wait()
        if self.delay:
            await asyncio.sleep(self.delay)
        if self.fail is not None:
            raise self.fail
        return Completion(self.text, "gpt-4o-mini", 1000, 100, "gpt-4o-mini-2024-07-18")


def service(cache: Cache | None = None, **kwargs: Any) -> SummaryService:
    options: dict[str, Any] = {"ttl": None, "lock_wait": 0.05, "backoff_first": 0, "backoff_max": 0}
    options.update(kwargs)
    return SummaryService(cache or MemoryCache(), **options)


async def obtain(svc: SummaryService, fn: Summarizer, cut: int = 4, previous: CachedSummary | None = None,
                 scope: SummaryScope = SCOPE) -> tuple[CachedSummary, bool]:
    return await svc.obtain(scope, CHAIN, cut, TURNS, previous, fn, request_id="req-1")


# --------------------------------------------------------------------------- keys and lookup


def test_summary_key_depends_on_tenant_settings_and_link() -> None:
    key = summary_key(SCOPE, CHAIN[0])
    assert key.startswith("sum:") and len(key) == 4 + 64
    assert key == summary_key(SummaryScope("acme", SCOPE.settings_id), CHAIN[0])
    assert key != summary_key(SummaryScope("globex", SCOPE.settings_id), CHAIN[0])
    assert key != summary_key(SummaryScope("acme", "llm/v2/other/e3b0c44298fc1c14"), CHAIN[0])
    assert key != summary_key(SCOPE, CHAIN[1])


async def test_lookup_of_nothing() -> None:
    svc = service()
    assert await svc.lookup(SCOPE, []) is None
    assert await svc.lookup(SCOPE, CHAIN) is None


async def test_lookup_takes_the_longest_cached_prefix_in_one_get_many() -> None:
    cache = CountingCache()
    svc = service(cache)
    for k in (2, 5):
        await cache.set(
            summary_key(SCOPE, CHAIN[k - 1]), {"text": f"summary of {k}", "turns": k, "chain": CHAIN[k - 1]}
        )
    cache.ops.clear()
    found = await svc.lookup(SCOPE, CHAIN)
    assert found == CachedSummary(5, CHAIN[4], "summary of 5")
    assert cache.ops == [f"get_many:{len(CHAIN)}"]
    assert await svc.lookup(SCOPE, CHAIN[:4]) == CachedSummary(2, CHAIN[1], "summary of 2")
    assert await svc.lookup(SummaryScope("globex", SCOPE.settings_id), CHAIN) is None  # never another tenant's


@pytest.mark.parametrize("record", [
    {"text": "", "chain": CHAIN[4]},
    {"text": 42, "chain": CHAIN[4]},
    {"chain": CHAIN[4]},
    {"text": "other chain", "chain": CHAIN[0]},
])
async def test_lookup_skips_unusable_records(record: dict[str, Any]) -> None:
    cache = MemoryCache()
    await cache.set(summary_key(SCOPE, CHAIN[4]), record)
    await cache.set(summary_key(SCOPE, CHAIN[1]), {"text": "fallback", "chain": CHAIN[1]})
    assert await service(cache).lookup(SCOPE, CHAIN) == CachedSummary(2, CHAIN[1], "fallback")


async def test_a_record_without_a_chain_field_is_accepted() -> None:
    cache = MemoryCache()
    await cache.set(summary_key(SCOPE, CHAIN[2]), {"text": "legacy record"})
    assert await service(cache).lookup(SCOPE, CHAIN) == CachedSummary(3, CHAIN[2], "legacy record")


# --------------------------------------------------------------------------- obtain


async def test_obtain_summarises_once_then_serves_from_the_cache() -> None:
    calls: list[tuple[str, Completion]] = []
    cache = MemoryCache()
    svc = service(cache, on_call=lambda tenant, c, _model: calls.append((tenant, c)))
    fn = Summarizer("  - user Ada booked ZX1Q  \n")
    summary, created = await obtain(svc, fn)
    assert created is True
    assert summary == CachedSummary(4, CHAIN[3], "- user Ada booked ZX1Q")
    assert fn.calls == [(None, TURNS[:4])]
    assert [t for t, _ in calls] == ["acme"]
    record = await cache.get(summary_key(SCOPE, CHAIN[3]))
    assert record is not None
    assert {k: record[k] for k in ("text", "turns", "chain", "model", "incremental")} == {
        "text": "- user Ada booked ZX1Q", "turns": 4, "chain": CHAIN[3], "model": "gpt-4o-mini",
        "incremental": False}
    again, created = await obtain(svc, fn)
    assert (again, created) == (summary, False)
    assert len(fn.calls) == 1
    assert await svc.lookup(SCOPE, CHAIN) == summary


async def test_obtain_is_incremental_from_a_previous_summary() -> None:
    cache = MemoryCache()
    svc = service(cache)
    fn = Summarizer("merged")
    previous = CachedSummary(2, CHAIN[1], "- earlier: user Ada")
    summary, created = await obtain(svc, fn, cut=5, previous=previous)
    assert created and summary.covered_turns == 5
    assert fn.calls == [("- earlier: user Ada", TURNS[2:5])]
    record = await cache.get(summary_key(SCOPE, CHAIN[4]))
    assert record is not None and record["incremental"] is True


async def test_a_previous_summary_covering_the_cut_is_not_folded_in() -> None:
    fn = Summarizer()
    await obtain(service(), fn, cut=3, previous=CachedSummary(3, CHAIN[2], "same cut"))
    assert fn.calls == [(None, TURNS[:3])]


# --------------------------------------------------------------------------- single flight in one process


async def test_concurrent_requests_in_one_process_make_one_summary_and_one_claims_it() -> None:
    svc = service()
    fn = Summarizer(delay=0.02)
    results = await asyncio.gather(*(obtain(svc, fn) for _ in range(8)))
    assert len(fn.calls) == 1
    assert sum(created for _, created in results) == 1
    assert len({s for s, _ in results}) == 1


async def test_the_fresh_result_is_claimed_by_a_follower_when_the_leader_is_cancelled() -> None:
    svc = service()
    fn = Summarizer()
    fn.gate = asyncio.Event()
    leader = asyncio.create_task(obtain(svc, fn))
    await fn.started.wait()
    follower = asyncio.create_task(obtain(svc, fn))
    await asyncio.sleep(0.01)
    leader.cancel()  # the client that started the summary went away
    await asyncio.sleep(0.01)
    fn.gate.set()
    summary, created = await follower
    assert created is True  # made for this request's conversation, and nobody else reported it
    assert len(fn.calls) == 1
    with pytest.raises(asyncio.CancelledError):
        await leader
    assert await svc.lookup(SCOPE, CHAIN) == summary


async def test_a_cancelled_leader_alone_still_caches_the_summary() -> None:
    svc = service()
    fn = Summarizer()
    fn.gate = asyncio.Event()
    leader = asyncio.create_task(obtain(svc, fn))
    await fn.started.wait()
    leader.cancel()
    fn.gate.set()
    with pytest.raises(asyncio.CancelledError):
        await leader
    for _ in range(50):
        if await svc.lookup(SCOPE, CHAIN) is not None:
            break
        await asyncio.sleep(0.005)
    assert (await svc.lookup(SCOPE, CHAIN)) is not None
    _, created = await obtain(svc, fn)
    assert created is False and len(fn.calls) == 1


async def test_different_cuts_are_different_flights() -> None:
    svc = service()
    fn = Summarizer(delay=0.01)
    (a, _), (b, _) = await asyncio.gather(obtain(svc, fn, cut=3), obtain(svc, fn, cut=4))
    assert (a.covered_turns, b.covered_turns) == (3, 4)
    assert len(fn.calls) == 2


async def test_close_cancels_flights() -> None:
    svc = service()
    fn = Summarizer()
    fn.gate = asyncio.Event()
    task = asyncio.create_task(obtain(svc, fn))
    await fn.started.wait()
    await svc.close()
    with pytest.raises(asyncio.CancelledError):
        await task


# --------------------------------------------------------------------------- failures and back-off


@pytest.mark.parametrize(("fail", "text", "reason"), [
    (SummaryUnavailable("upstream answered 503: overloaded (route 'gpt-4o-mini')", reason="status"), "x", "status"),
    (SummaryUnavailable("timed out", reason="timeout"), "x", "timeout"),
    (None, "   \n", "empty"),
    (RuntimeError("plugin bug"), "x", "error"),
    (KeyError("choices"), "x", "error"),
])
async def test_failures_become_summary_unavailable_and_cache_nothing(
    fail: BaseException | None, text: str, reason: str
) -> None:
    failures: list[tuple[str, str]] = []
    cache = MemoryCache()
    svc = service(cache, on_failure=lambda tenant, r: failures.append((tenant, r)))
    fn = Summarizer(text)
    fn.fail = fail
    with pytest.raises(SummaryUnavailable) as err:
        await obtain(svc, fn)
    assert err.value.reason == reason
    assert failures == [("acme", reason)]
    assert await cache.get(summary_key(SCOPE, CHAIN[3])) is None
    if isinstance(fail, RuntimeError):
        assert "RuntimeError: plugin bug" in str(err.value)


async def test_back_off_doubles_up_to_its_maximum_then_clears_on_success() -> None:
    clock = Clock()
    failures: list[str] = []
    svc = service(backoff_first=10, backoff_max=25, clock=clock, on_failure=lambda _t, r: failures.append(r))
    fn = Summarizer()
    fn.fail = SummaryUnavailable("down", reason="status")

    async def attempt() -> str:
        try:
            await obtain(svc, fn)
        except SummaryUnavailable as exc:
            return exc.reason
        return "ok"

    assert await attempt() == "status"  # 1st failure: back off 10 s
    clock.now += 9
    assert await attempt() == "backoff"
    assert len(fn.calls) == 1  # nobody called while backing off
    clock.now += 2
    assert await attempt() == "status"  # 2nd: 20 s
    clock.now += 19
    assert await attempt() == "backoff"
    clock.now += 2
    assert await attempt() == "status"  # 3rd: 40 s capped at 25
    clock.now += 24
    assert await attempt() == "backoff"
    clock.now += 2
    fn.fail = None
    assert await attempt() == "ok"
    fn.fail = SummaryUnavailable("down", reason="status")
    assert await attempt() == "ok"  # cached now
    assert failures == ["status", "status", "status"]  # a back-off makes no call: not a failed call


async def test_back_off_is_per_conversation_and_per_tenant() -> None:
    clock = Clock()
    svc = service(backoff_first=60, backoff_max=60, clock=clock)
    bad = Summarizer()
    bad.fail = SummaryUnavailable("down", reason="status")
    with pytest.raises(SummaryUnavailable):
        await obtain(svc, bad)
    good = Summarizer()
    other = SummaryScope("globex", SCOPE.settings_id)
    _, created = await obtain(svc, good, scope=other)
    assert created
    other_chain = [f"{i:032x}" for i in range(100, 108)]
    _, created = await svc.obtain(SCOPE, other_chain, 4, TURNS, None, good)
    assert created
    with pytest.raises(SummaryUnavailable) as err:
        await obtain(svc, good)
    assert err.value.reason == "backoff"


async def test_without_back_off_a_failure_is_retried_at_once() -> None:
    svc = service(backoff_first=0)
    fn = Summarizer()
    fn.fail = SummaryUnavailable("down", reason="status")
    for _ in range(3):
        with pytest.raises(SummaryUnavailable) as err:
            await obtain(svc, fn)
        assert err.value.reason == "status"
    assert len(fn.calls) == 3


# --------------------------------------------------------------------------- across processes: the lock


async def hold_lock(cache: MemoryCache, key: str, ttl: float, *, renew_every: float | None,
                    release: asyncio.Event, result: dict[str, Any] | None = None) -> None:
    """Another replica holding the summary's lock (renewing it, unless it is dead)."""
    async with cache.lock("lock:" + key, ttl=ttl, wait=0) as held:
        assert held.acquired
        while not release.is_set():
            try:
                await asyncio.wait_for(release.wait(), renew_every or 3600)
            except asyncio.TimeoutError:
                await held.renew()
        if result is not None:
            await cache.set(key, result)


async def test_pending_past_max_wait_while_a_live_holder_keeps_the_lock() -> None:
    cache = MemoryCache()
    key = summary_key(SCOPE, CHAIN[3])
    release = asyncio.Event()
    holder = asyncio.create_task(hold_lock(cache, key, ttl=0.1, renew_every=0.03, release=release))
    await asyncio.sleep(0.01)
    failures: list[str] = []
    svc = service(cache, lock_wait=0.05, max_wait=0.3, lock_ttl=0.1, on_failure=lambda _t, r: failures.append(r))
    fn = Summarizer()
    loop = asyncio.get_running_loop()
    started = loop.time()
    with pytest.raises(SummaryUnavailable) as err:
        await obtain(svc, fn)
    waited = loop.time() - started
    assert err.value.reason == "pending"
    assert 0.3 <= waited < 1.0
    assert fn.calls == []  # never a second summary while the holder is alive
    assert failures == []  # pending is not a failure: no back-off, no failure metric
    release.set()
    await holder
    _, created = await obtain(svc, fn)  # the holder gave up without a summary: this request makes it
    assert created and len(fn.calls) == 1


async def test_a_waiter_returns_the_holders_summary_as_soon_as_it_is_cached() -> None:
    cache = MemoryCache()
    key = summary_key(SCOPE, CHAIN[3])
    release = asyncio.Event()
    record = {"text": "made by another replica", "turns": 4, "chain": CHAIN[3]}
    holder = asyncio.create_task(hold_lock(cache, key, ttl=5, renew_every=None, release=release, result=record))
    await asyncio.sleep(0.01)
    svc = service(cache, lock_wait=10, max_wait=30)
    fn = Summarizer()
    waiter = asyncio.create_task(obtain(svc, fn))
    await asyncio.sleep(0.05)
    assert not waiter.done()
    release.set()
    summary, created = await asyncio.wait_for(waiter, 2)
    assert (summary.text, created) == ("made by another replica", False)
    assert fn.calls == []
    await holder


async def test_a_dead_holders_lock_expires_and_a_waiter_takes_over() -> None:
    cache = MemoryCache()
    key = summary_key(SCOPE, CHAIN[3])
    assert (await cache.lock("lock:" + key, ttl=0.15, wait=0).__aenter__()).acquired  # acquired, never released
    svc = service(cache, lock_wait=0.05, max_wait=5)
    fn = Summarizer()
    summary, created = await asyncio.wait_for(obtain(svc, fn), 3)
    assert created and len(fn.calls) == 1 and summary.covered_turns == 4


async def test_the_holder_renews_its_lock_while_summarising_so_no_replica_summarises_twice() -> None:
    cache = CountingCache()
    lock_ttl = 0.12
    a = service(cache, lock_wait=0.03, lock_ttl=lock_ttl, max_wait=5)
    b = service(cache, lock_wait=0.03, lock_ttl=lock_ttl, max_wait=5)  # another replica: its own flights
    slow = Summarizer("made by a", delay=lock_ttl * 5)
    other = Summarizer("made by b")
    first = asyncio.create_task(obtain(a, slow))
    await slow.started.wait()
    (sa, created_a), (sb, created_b) = await asyncio.gather(first, obtain(b, other))
    assert (created_a, created_b) == (True, False)
    assert sa == sb and sa.text == "made by a"
    assert other.calls == []
    assert cache.ops.count("renew") >= 3


async def test_the_renewal_stops_when_the_summary_is_made() -> None:
    cache = CountingCache()
    svc = service(cache, lock_ttl=0.06)
    await obtain(svc, Summarizer(delay=0.05))
    renewals = cache.ops.count("renew")
    await asyncio.sleep(0.1)
    assert cache.ops.count("renew") == renewals


# --------------------------------------------------------------------------- this process's own copies


class DroppingCache(CountingCache):
    """A shared cache that is there for reads but keeps nothing (down, full, or its breaker open)."""

    async def set(self, key: str, value: dict[str, Any], ttl: float | None = None) -> None:
        self.ops.append("set")


async def test_a_summary_made_here_is_reused_when_the_shared_cache_cannot_keep_it() -> None:
    """A stalled cache used to cost every request a new summariser call: the summary it made was lost."""
    fn = Summarizer()
    svc = service(DroppingCache(), local_entries=10)
    made, created = await obtain(svc, fn)
    assert created is True
    assert await svc.lookup(SCOPE, CHAIN) == made
    again, created = await obtain(svc, fn)
    assert (again, created) == (made, False)
    assert len(fn.calls) == 1
    without = service(DroppingCache())  # local_entries 0: every request makes it again
    await obtain(without, fn)
    await obtain(without, fn)
    assert len(fn.calls) == 3


async def test_a_local_hit_asks_the_shared_cache_only_for_longer_prefixes() -> None:
    cache = CountingCache()
    svc = service(cache, local_entries=10)
    await obtain(svc, Summarizer(), cut=4)
    cache.ops.clear()
    assert (await svc.lookup(SCOPE, CHAIN[:4])).covered_turns == 4  # type: ignore[union-attr]
    assert cache.ops == []  # the longest prefix is known here: no round trip at all
    await cache.set(summary_key(SCOPE, CHAIN[5]), {"text": "made by another replica", "chain": CHAIN[5]})
    cache.ops.clear()
    assert await svc.lookup(SCOPE, CHAIN) == CachedSummary(6, CHAIN[5], "made by another replica")
    assert cache.ops == [f"get_many:{len(CHAIN) - 4}"]  # only the prefixes longer than the one known here
    assert await svc.lookup(SummaryScope("globex", SCOPE.settings_id), CHAIN[:4]) is None  # never another tenant's


async def test_a_local_hit_asks_again_for_a_longer_prefix_found_missing_only_after_a_while() -> None:
    """A conversation resent with a summary in hand read every longer prefix from the shared cache each time."""
    cache, clock = CountingCache(), Clock()
    svc = service(cache, local_entries=10, clock=clock)
    await obtain(svc, Summarizer(), cut=4)
    cache.ops.clear()
    asked = await svc.lookup(SCOPE, CHAIN)
    assert asked is not None and asked.covered_turns == 4 and not asked.narrowed
    assert cache.ops == [f"get_many:{len(CHAIN) - 4}"]
    await cache.set(summary_key(SCOPE, CHAIN[5]), {"text": "made by another replica", "chain": CHAIN[5]})
    cache.ops.clear()
    narrowed = await svc.lookup(SCOPE, CHAIN)
    assert narrowed is not None and narrowed.covered_turns == 4 and narrowed.narrowed
    assert cache.ops == []  # found missing a moment ago: not asked again yet (and the answer says so)
    assert (await svc.lookup(SCOPE, CHAIN, recheck=True)).covered_turns == 6  # type: ignore[union-attr]
    assert cache.ops == [f"get_many:{len(CHAIN) - 4}"]  # a summary is about to be made: everything is asked
    svc._local.clear()
    await obtain(svc, Summarizer(), cut=4)
    cache.ops.clear()
    clock.now += ABSENT_SECONDS
    assert await svc.lookup(SCOPE, CHAIN) == CachedSummary(6, CHAIN[5], "made by another replica")
    assert cache.ops == [f"get_many:{len(CHAIN) - 4}"]
    fresh = service(cache, local_entries=10, clock=clock)  # no summary of its own: every prefix is asked for
    cache.ops.clear()
    assert (await fresh.lookup(SCOPE, CHAIN)).covered_turns == 6  # type: ignore[union-attr]
    assert cache.ops == [f"get_many:{len(CHAIN)}"]
    assert fresh._absent == {}  # (nothing to keep from a lookup without a summary in hand)


async def test_a_growing_conversation_asks_for_its_new_prefixes_alone_while_its_mark_holds() -> None:
    cache, clock = CountingCache(), Clock()
    svc = service(cache, local_entries=10, clock=clock)
    await obtain(svc, Summarizer(), cut=4)
    chain = list(CHAIN)
    await svc.lookup(SCOPE, chain)  # the longer prefixes are missing: marked at 1000.0
    for n in range(3):
        clock.now += 0.3
        chain.append(f"{100 + n:032x}")
        cache.ops.clear()
        assert (await svc.lookup(SCOPE, chain)).covered_turns == 4  # type: ignore[union-attr]
        assert cache.ops == ["get_many:1"]  # only the turn that is new
    clock.now += 0.2  # a mark does not outlive the answers it was made from: all of them are a second old now
    cache.ops.clear()
    await svc.lookup(SCOPE, chain)
    assert cache.ops == [f"get_many:{len(chain) - 4}"]
    # a history edited past the summary: a chained hash differs from the edit on (its prefixes are its own)
    edited = [*chain[:6], *(f"{999 + i:032x}" for i in range(len(chain) - 6))]
    cache.ops.clear()
    await svc.lookup(SCOPE, edited)
    assert cache.ops == [f"get_many:{len(edited) - 4}"]


async def test_a_mark_is_timed_from_before_the_read() -> None:
    class Slow(CountingCache):
        async def get_many(self, keys: list[str], first_hit: bool = False) -> list[dict[str, Any] | None]:
            clock.now += 0.6  # the answer is handled 0.6 s after the cache was read
            return await super().get_many(keys, first_hit)

    cache, clock = Slow(), Clock()
    svc = service(cache, local_entries=10, clock=clock)
    await obtain(svc, Summarizer(), cut=4)
    await svc.lookup(SCOPE, CHAIN)
    clock.now += 0.4  # a second after the read
    cache.ops.clear()
    await svc.lookup(SCOPE, CHAIN)
    assert cache.ops == [f"get_many:{len(CHAIN) - 4}"]


async def test_a_cache_that_answers_fewer_records_than_keys_marks_nothing() -> None:
    class Short(CountingCache):
        async def get_many(self, keys: list[str], first_hit: bool = False) -> list[dict[str, Any] | None]:
            return (await super().get_many(keys, first_hit))[:1]

    cache = Short()
    svc = service(cache, local_entries=10)
    await obtain(svc, Summarizer(), cut=4)
    await svc.lookup(SCOPE, CHAIN)
    assert svc._absent == {}


async def test_a_cache_that_answers_more_records_than_keys_is_read_as_far_as_the_keys_go() -> None:
    class Extra(CountingCache):
        async def get_many(self, keys: list[str], first_hit: bool = False) -> list[dict[str, Any] | None]:
            return [*await super().get_many(keys, first_hit), {"text": "stray", "chain": "x"}]

    svc = service(Extra(), local_entries=10)
    await obtain(svc, Summarizer(), cut=4)
    assert (await svc.lookup(SCOPE, CHAIN)).covered_turns == 4  # type: ignore[union-attr]


async def test_a_failed_read_of_the_longer_prefixes_is_not_taken_for_their_absence() -> None:
    class Failing(CountingCache):
        broken = False

        async def get_many(self, keys: list[str], first_hit: bool = False) -> list[dict[str, Any] | None]:
            if self.broken:
                raise OSError("disk gone")
            return await super().get_many(keys, first_hit)

    cache = Failing()
    svc = service(SafeCache(cache), local_entries=10)
    await obtain(svc, Summarizer(), cut=4)
    cache.broken = True
    assert (await svc.lookup(SCOPE, CHAIN)).covered_turns == 4  # type: ignore[union-attr]
    cache.broken = False
    await cache.set(summary_key(SCOPE, CHAIN[5]), {"text": "made by another replica", "chain": CHAIN[5]})
    assert (await svc.lookup(SCOPE, CHAIN)).covered_turns == 6  # type: ignore[union-attr]


async def test_the_local_copies_are_bounded_and_expire_with_the_caches_ttl() -> None:
    clock = Clock()
    svc = service(DroppingCache(), local_entries=2, ttl=60, clock=clock)
    for cut in (2, 3, 4):
        await obtain(svc, Summarizer(f"summary of {cut}"), cut=cut)
    assert len(svc._local) == 2
    assert await svc.lookup(SCOPE, CHAIN[:2]) is None  # the least recently used went
    assert (await svc.lookup(SCOPE, CHAIN[:4])).covered_turns == 4  # type: ignore[union-attr]
    clock.now += 61
    assert await svc.lookup(SCOPE, CHAIN[:4]) is None


async def test_a_reload_that_shrinks_the_local_copies_drops_the_oldest_at_once() -> None:
    svc = service(DroppingCache(), local_entries=3)
    for cut in (2, 3, 4):
        await obtain(svc, Summarizer(f"summary of {cut}"), cut=cut)
    svc.configure(ttl=None, local_entries=1, lock_wait=0.05, max_wait=600, backoff_first=0, backoff_max=0)
    assert len(svc._local) == 1
    assert (await svc.lookup(SCOPE, CHAIN[:4])).covered_turns == 4  # type: ignore[union-attr]
    assert await svc.lookup(SCOPE, CHAIN[:3]) is None
    svc.configure(ttl=None, local_entries=0, lock_wait=0.05, max_wait=600, backoff_first=0, backoff_max=0)
    assert await svc.lookup(SCOPE, CHAIN[:4]) is None


async def test_a_reload_measures_a_back_off_in_progress_with_the_new_settings() -> None:
    clock = Clock()
    svc = service(backoff_first=300, backoff_max=600, clock=clock)
    failing = Summarizer()
    failing.fail = SummaryUnavailable("down", reason="status")
    with pytest.raises(SummaryUnavailable):
        await obtain(svc, failing)
    clock.now += 20
    with pytest.raises(SummaryUnavailable, match="backing off"):
        await obtain(svc, Summarizer())
    svc.configure(ttl=None, local_entries=0, lock_wait=0.05, max_wait=600, backoff_first=10, backoff_max=600)
    assert (await obtain(svc, Summarizer()))[1] is True  # 20 s after the failure: past a 10 s back-off


async def test_lock_wait_zero_does_not_spin_on_the_cache(upstream: FakeUpstream) -> None:
    """With ``lock_wait_seconds: 0`` and another replica holding the summary's lock, the store does not retry
    the lock in a tight loop against the cache (at most a few attempts in half a second)."""
    from plugins.base import SummaryScope
    from proxy.serve.state import build_shared
    from proxy.settings import load_config
    from proxy.store.memory import MemoryCache
    from proxy.store.summaries import summary_key

    class Counting(MemoryCache):
        acquires = 0

        async def _try_acquire(self, lock_key: str, token: str, ttl: float) -> bool:
            Counting.acquires += 1
            return await super()._try_acquire(lock_key, token, ttl)

    cfg = load_config(summarising_config(upstream.base_url, summarizer={"lock_wait_seconds": 0}), env={})
    cache = Counting()
    shared = build_shared(cfg, cache=cache)
    scope = SummaryScope("default", "llm/v2/gpt-4o-mini/x")
    chain = ["0" * 32, "1" * 32]
    key = summary_key(scope, chain[1])

    async def never(previous: str | None, turns: Any) -> Completion:  # pragma: no cover - never called
        raise AssertionError("another replica holds the lock")

    try:
        async with cache.lock("lock:" + key, ttl=30, wait=0) as held:  # another replica, alive, summarising
            assert held.acquired
            Counting.acquires = 0
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(shared.summaries.obtain(scope, chain, 2, [[], []], None, never), 0.5)
            assert Counting.acquires < 100, f"{Counting.acquires} lock attempts in 0.5 s"
    finally:
        await shared.close()


# --------------------------------------------------------------------------- one summariser call per content


async def test_a_summariser_call_is_made_once_across_replicas_and_reused_at_no_cost() -> None:
    cache = MemoryCache()
    a, b = service(cache), service(cache)  # two replicas
    made: list[str] = []
    gate = asyncio.Event()

    async def call() -> Completion:
        made.append("call")
        await gate.wait()
        return Completion("chunk summary", "gpt-4o-mini", 900, 40, "gpt-4o-mini-2024-07-18")

    first = asyncio.create_task(a.call_once("acme", b"the same request", call))
    here = asyncio.create_task(a.call_once("acme", b"the same request", call))  # same process: same flight
    await asyncio.sleep(0.02)
    there = asyncio.create_task(b.call_once("acme", b"the same request", call))  # another replica: its lock
    await asyncio.sleep(0.1)
    gate.set()
    out = await asyncio.gather(first, here, there)
    assert made == ["call"]
    # the first caller pays for it; another in the same process and another replica have it for nothing
    assert [(c.text, c.prompt_tokens, c.completion_tokens) for c in out] == [
        ("chunk summary", 900, 40), ("chunk summary", 0, 0), ("chunk summary", 0, 0)]
    other = await b.call_once("globex", b"the same request", call)  # another tenant never shares it
    assert made == ["call", "call"] and other.prompt_tokens == 900


async def test_an_empty_summariser_answer_is_not_kept_for_the_next_try() -> None:
    svc = service()
    answers = ["", "a summary"]

    async def call() -> Completion:
        return Completion(answers.pop(0), "gpt-4o-mini", 900, 40)

    with pytest.raises(SummaryUnavailable) as err:
        await svc.call_once("acme", b"request", call)
    assert err.value.reason == "empty"
    assert (await svc.call_once("acme", b"request", call)).text == "a summary"
