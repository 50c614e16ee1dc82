"""The cache's circuit breaker and per-request budget (proxy.store.guard), on real stalls.

A stalled Redis (SIGSTOP on a real redis-server, or a TCP server that accepts and never answers) used to
add ~15 s to every request that needed a summary, and each of them paid a new summariser call: every
cache operation waited its socket timeout and one retry (3 s), about five ran per summarised request,
and nothing short-circuited a failing cache (``/readyz`` took 3 s too). A refused connection fails in
milliseconds and must not open the breaker.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest
import redis.asyncio as aioredis

from proxy.core.errors import SummaryUnavailable
from proxy.store.cache import SafeCache
from proxy.store.disk import DiskCache
from proxy.store.guard import FREE_SECONDS, Guard, cache_budget
from proxy.store.redis import RedisCache
from tests.conftest import RunningProxy, StartProxy
from tests.fake_upstream import FakeUpstream
from tests.outside import metric_total, scrape
from tests.redis_server import RedisServer, redis_server_fixture
from tests.store.test_summaries import Summarizer, obtain
from tests.store.test_summaries import service as summary_service
from tests.store.test_summaries_http import config, conversation, post

redis_server = redis_server_fixture(scope="module")


class SilentServer:
    """127.0.0.1:0: accepts every connection, reads what it is sent, never answers."""

    def __init__(self) -> None:
        self.received = bytearray()
        self._server: asyncio.Server | None = None
        self._writers: list[asyncio.StreamWriter] = []
        self.port = 0

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self._writers.append(writer)
        while data := await reader.read(65536):
            self.received += data

    async def start(self) -> SilentServer:
        self._server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        self.port = self._server.sockets[0].getsockname()[1]
        return self

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    async def stop(self) -> None:
        for writer in self._writers:
            writer.close()
        if self._server is not None:
            self._server.close()
            await self._server.wait_closed()


@pytest.fixture
async def silent() -> AsyncIterator[SilentServer]:
    server = await SilentServer().start()
    yield server
    await server.stop()


def guarded_redis(url: str, *, timeout: float = 0.3, threshold: int = 2, cooldown: float = 60.0,
                  prefix: str = "guard:") -> tuple[SafeCache, Guard]:
    guard = Guard("redis", timeout=timeout, threshold=threshold, cooldown=cooldown)
    return SafeCache(RedisCache(url, None, prefix=prefix, socket_timeout=timeout, guard=guard)), guard


# ---------------------------------------------------------------------------- the breaker


async def test_timeouts_open_the_breaker_and_then_nothing_is_sent(silent: SilentServer) -> None:
    cache, guard = guarded_redis(silent.url)
    try:
        assert await cache.get("a") is None  # times out
        assert not guard.is_open
        assert await cache.get("b") is None  # the second timeout in a row opens it
        assert guard.is_open
        sent = len(silent.received)
        assert await cache.get("c") is None
        await cache.set("d", {"v": 1})
        async with cache.lock("e", ttl=1, wait=1) as held:
            assert held.acquired  # fail open: go on without the cross-process lock
        assert await cache.ping() is False  # what /readyz asks
        assert len(silent.received) == sent  # bypassed: not one more command sent
    finally:
        await cache.close()


async def test_refused_connections_never_open_the_breaker() -> None:
    with RedisServer.started() as server:
        url = server.url
        server.stop()
        cache, guard = guarded_redis(url)
        try:
            for i in range(10):
                assert await cache.get(f"k{i}") is None
            assert not guard.is_open
            server.start()
            await cache.set("k", {"up": True})
            assert await cache.get("k") == {"up": True}
        finally:
            await cache.close()


async def test_the_breaker_probes_in_the_background_and_closes_once_redis_answers(
        redis_server: RedisServer) -> None:
    prefix = f"probe-{uuid.uuid4().hex}:"
    cache, guard = guarded_redis(redis_server.url, cooldown=0.5, prefix=prefix)
    try:
        await cache.set("k", {"v": 1})
        with redis_server.paused():
            assert await cache.get("k") is None
            assert await cache.get("k") is None
            assert guard.is_open
            await asyncio.sleep(0.6)
            assert await cache.get("k") is None  # the cool-down is over: this starts the probe, and fails at once
            assert guard._probe is not None
            await asyncio.sleep(0.5)  # the probe times out: open for another cool-down
            assert guard.is_open and guard._probe is None
        await asyncio.sleep(0.6)
        assert await cache.get("k") is None  # starts a probe that Redis answers
        for _ in range(100):
            if not guard.is_open:
                break
            await asyncio.sleep(0.02)
        assert not guard.is_open
        assert await cache.get("k") == {"v": 1}
    finally:
        await cache.close()


async def test_a_hung_disk_opens_the_breaker(tmp_path: Path) -> None:
    """A hung mount: the disk worker thread never returns; operations queue behind it and time out."""
    guard = Guard("disk", timeout=0.2, threshold=2, cooldown=60)
    disk = DiskCache(str(tmp_path / "cache"), None, 16, guard=guard)
    cache = SafeCache(disk)
    try:
        await cache.set("k", {"v": 1})
        release = asyncio.Event()
        loop = asyncio.get_running_loop()
        hung = loop.run_in_executor(disk._executor, lambda: asyncio.run_coroutine_threadsafe(
            release.wait(), loop).result())
        for _ in range(2):  # two requests, each with its budget
            with cache_budget(1.0):
                assert await cache.get("k") is None
        assert guard.is_open
        release.set()
        await hung
    finally:
        await cache.close()


# ---------------------------------------------------------------------------- the request's budget


def test_each_operations_first_moments_are_free() -> None:
    guard = Guard("redis", timeout=1, threshold=2, cooldown=10)
    with cache_budget(1.0) as budget:
        assert budget is not None
        for _ in range(1000):
            guard.charge(FREE_SECONDS / 2)  # a healthy backend, polled for a long time: free
        assert budget.spent == 0
        guard.charge(0.45 + FREE_SECONDS)
        assert budget.spent == pytest.approx(0.45)
    guard.charge(5)  # no request: nothing to charge


async def test_a_request_waits_no_longer_than_its_budget_then_skips_the_cache(silent: SilentServer) -> None:
    cache, guard = guarded_redis(silent.url, timeout=30)  # the breaker would take 30 s to see anything
    errors: list[str] = []
    cache._on_error = lambda op, exc: errors.append(str(exc))
    try:
        with cache_budget(0.2):
            assert await cache.get("a") is None
            assert await cache.get("b") is None
        assert "no answer within this request's cache time budget" in errors[0]
        assert "budget (0.2 s) is spent" in errors[1]
        assert not guard.is_open
        with cache_budget(0.2):  # another request has its own budget
            assert await cache.get("c") is None
        assert "no answer within" in errors[2]
    finally:
        await silent.stop()  # the connections close: the operations still waiting end
        await cache.close()


async def test_a_lock_acquired_after_its_caller_gave_up_is_released(redis_server: RedisServer) -> None:
    """The SET NX reaches a stalled Redis; the request stops waiting; Redis wakes and grants it: released."""
    prefix = f"late-{uuid.uuid4().hex}:"
    cache, _ = guarded_redis(redis_server.url, timeout=5, prefix=prefix)
    client = aioredis.Redis.from_url(redis_server.url)
    try:
        with redis_server.paused(), cache_budget(0.2):
            async with cache.lock("job", ttl=30, wait=0) as held:
                assert held.acquired  # fail open: the request goes on
        for _ in range(100):  # Redis runs the queued SET NX, the reply arrives, the release follows
            assert isinstance(cache.inner, RedisCache)
            if not await client.exists(prefix + "__lock__:job") and not cache.inner._inflight:
                break
            await asyncio.sleep(0.02)
        assert not await client.exists(prefix + "__lock__:job")
        async with cache.lock("job", ttl=5, wait=0) as held:
            assert held.acquired
    finally:
        await client.aclose()
        await cache.close()


# ---------------------------------------------------------------------------- summaries and the budget
# `make check` found summaries made two and three times for one content by three replicas on one Redis: a
# summary ran on the cache-time budget of the request that started it, so once a loaded request had spent
# it, the summary's lock failed open and its record write was skipped, and another replica made it again.


async def test_a_request_whose_cache_budget_is_spent_reuses_the_summary_another_replica_made(
        redis_server: RedisServer) -> None:
    prefix = f"spent-{uuid.uuid4().hex}:"
    a, _ = guarded_redis(redis_server.url, prefix=prefix)
    b, _ = guarded_redis(redis_server.url, prefix=prefix)
    made_by_a, made_by_b = Summarizer("made by a"), Summarizer("made by b")
    try:
        await obtain(summary_service(a), made_by_a)
        with cache_budget(0.5) as budget:
            assert budget is not None
            budget.spent = 5.0  # a loaded request: its lookups already took all of it
            summary, created = await obtain(summary_service(b), made_by_b)
        assert (summary.text, created) == ("made by a", False)
        assert made_by_b.calls == []
    finally:
        await a.close()
        await b.close()


async def test_a_waiter_whose_cache_stops_answering_never_makes_a_second_summary(redis_server: RedisServer) -> None:
    """Replica b waits on a's lock; Redis stalls: b is served without the summary instead of making it too."""
    prefix = f"contended-{uuid.uuid4().hex}:"
    a, _ = guarded_redis(redis_server.url, prefix=prefix)
    b, b_guard = guarded_redis(redis_server.url, timeout=0.2, prefix=prefix)
    made_by_a, made_by_b = Summarizer("made by a"), Summarizer("made by b")
    made_by_a.gate = asyncio.Event()
    try:
        holder = asyncio.create_task(obtain(summary_service(a), made_by_a))
        await made_by_a.started.wait()  # a holds the lock in Redis and is summarising
        waiter = asyncio.create_task(obtain(summary_service(b, lock_wait=10, max_wait=60), made_by_b))
        await asyncio.sleep(0.2)  # b has seen the lock held
        assert not waiter.done()
        with redis_server.paused():
            with pytest.raises(SummaryUnavailable) as err:
                await asyncio.wait_for(waiter, 5)
            assert b_guard.is_open
        assert err.value.reason == "pending"
        assert made_by_b.calls == []
        made_by_a.gate.set()
        summary, created = await asyncio.wait_for(holder, 5)
        assert (summary.text, created) == ("made by a", True)
    finally:
        await a.close()
        await b.close()


async def test_without_a_holder_a_stalled_cache_still_lets_the_summary_be_made(redis_server: RedisServer) -> None:
    """Failing open stays the rule when nobody else was seen holding the lock (Redis down from the start)."""
    cache, _ = guarded_redis(redis_server.url, timeout=0.2, prefix=f"alone-{uuid.uuid4().hex}:")
    fn = Summarizer()
    try:
        with redis_server.paused():
            _, created = await asyncio.wait_for(obtain(summary_service(cache), fn), 5)
        assert created and len(fn.calls) == 1
    finally:
        await cache.close()


# ---------------------------------------------------------------------------- through the proxy


def stall_config(upstream: FakeUpstream, url: str) -> dict[str, Any]:
    # every request over T goes to the summary cache: no masking first (it would keep some requests from it)
    return config(upstream.base_url, cache={"backend": "redis", "url": url, "timeout_seconds": 0.5,
                                            "budget_seconds": 0.5, "breaker_cooldown_seconds": 1},
                  context_manager={"type": "summarising", "params": {"keep_turns": 4, "mask_observations": False}})


@pytest.fixture
def redis() -> Iterator[RedisServer]:
    with RedisServer.started() as server:
        yield server


async def timed_post(s: aiohttp.ClientSession, proxy: RunningProxy, n: int) -> tuple[str, float]:
    begun = time.perf_counter()
    status, headers, body = await post(s, proxy.url, conversation(n))
    assert status == 200, body
    return headers["x-ctxproxy-summary"], time.perf_counter() - begun


async def test_a_stalled_redis_is_bypassed_and_summaries_are_made_once(
        upstream: FakeUpstream, start_proxy: StartProxy, redis: RedisServer) -> None:
    proxy = await start_proxy(stall_config(upstream, redis.url))
    async with aiohttp.ClientSession() as s:
        assert (await post(s, proxy.url, conversation(3)))[0] == 200  # warm: tokenizers, calibration, ledger
        with redis.paused():
            statuses = [(await timed_post(s, proxy, n))[0] for n in range(30, 35)]
            assert statuses == ["waited"] + ["reused"] * 4  # this process's copy of its summary
            assert len(upstream.summaries) == 1
            async with s.get(proxy.url + "/readyz") as r:
                assert r.status == 503 and (await r.json())["cache"] == "unavailable"
        assert metric_total(await scrape(proxy), "ctxproxy_cache_breaker_opened_total") == 1
        for _ in range(100):  # after the cool-down a probe finds Redis answering again
            async with s.get(proxy.url + "/readyz") as r:
                if r.status == 200:
                    break
            await asyncio.sleep(0.05)
        assert r.status == 200
        other = conversation(40)
        other[1]["content"] += " (another trip)"
        status, headers, _ = await post(s, proxy.url, other)
        assert (status, headers["x-ctxproxy-summary"]) == (200, "waited")
    client = aioredis.Redis.from_url(redis.url)
    try:  # the summary made after the stall went to Redis
        assert len([k async for k in client.scan_iter(match="ctxproxy:sum:*")]) >= 1
    finally:
        await client.aclose()


@pytest.mark.slow
async def test_a_stalled_redis_costs_a_request_at_most_its_budget(
        upstream: FakeUpstream, start_proxy: StartProxy, redis: RedisServer) -> None:
    """Timings (budget 0.5 s, timeout 0.5 s): the first request pays at most its budget; once the breaker is
    open a summarised request pays nothing, and /readyz answers at once."""
    proxy = await start_proxy(stall_config(upstream, redis.url))
    async with aiohttp.ClientSession() as s:
        _, healthy = await timed_post(s, proxy, 29)
        with redis.paused():
            timings = [await timed_post(s, proxy, n) for n in range(30, 36)]
            begun = time.perf_counter()
            async with s.get(proxy.url + "/readyz") as r:
                assert r.status == 503
            readyz = time.perf_counter() - begun
    print(f"healthy {healthy:.3f}s; stalled: {[f'{t:.3f}' for _, t in timings]}; readyz {readyz:.3f}s")
    assert timings[0][1] < healthy + 0.5 + 1.0
    assert all(t < healthy + 0.5 for _, t in timings[2:])
    assert readyz < 0.2
