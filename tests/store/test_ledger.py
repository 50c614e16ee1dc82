"""The cost ledger (proxy.store.ledger) and its stores (proxy.store.ledger_store).

From the outside: the ledger is not evicted with the summaries it counts (a disk cache over its size
limit, Redis under an LRU policy), and a store that refuses writes for a while loses nothing. Inside:
a bucket is clean only once the store confirmed it, rows that finish during a write are written by the
next flush, old hours are pruned.
"""

from __future__ import annotations

import asyncio
import sqlite3
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import aiohttp
import diskcache
import pytest
import redis.asyncio as aioredis

from proxy.core.errors import LedgerUnavailable
from proxy.store.disk import _JSONBytesDisk
from proxy.store.ledger import HOUR, RETENTION_HOURS, Ledger, hour_of, read
from proxy.store.ledger_store import (
    DiskLedgerStore,
    LedgerStore,
    MemoryLedgerStore,
    RedisLedgerStore,
    redis_address,
)
from tests.conftest import RunningProxy, StartProxy
from tests.fake_upstream import FakeUpstream
from tests.outside import metric_total, scrape
from tests.redis_server import RedisServer, redis_server_fixture
from tests.store.test_summaries_http import config, conversation, post

redis_server = redis_server_fixture(scope="module")

ADMIN = "sk-admin"
FILLER = b'{"text": "' + b"s" * 50_000 + b'"}'  # another conversation's summary, 50 kB


async def admin_report(s: aiohttp.ClientSession, proxy: RunningProxy) -> tuple[int, Any]:
    async with s.get(proxy.url + "/admin/report?since=1h", headers={"Authorization": f"Bearer {ADMIN}"}) as r:
        return r.status, await r.json()


async def summarised(s: aiohttp.ClientSession, proxy: RunningProxy, turns: range) -> None:
    for n in turns:
        status, _, body = await post(s, proxy.url, conversation(n))
        assert status == 200, body


async def assert_report_equals_metrics(s: aiohttp.ClientSession, proxy: RunningProxy, requests: int) -> None:
    status, report = await admin_report(s, proxy)
    assert status == 200, report
    text = await scrape(proxy)
    assert metric_total(text, "ctxproxy_requests_total") == requests
    assert report["total"]["requests"] == requests
    assert report["total"]["tokens_received"] == metric_total(text, "ctxproxy_tokens_received_total")
    assert report["total"]["tokens_removed"] == metric_total(text, "ctxproxy_tokens_removed_total")


# ---------------------------------------------------------------------------- out of eviction's reach


async def test_the_ledger_is_not_evicted_with_the_disk_caches_summaries(
        upstream: FakeUpstream, start_proxy: StartProxy, tmp_path: Path) -> None:
    """A disk cache over its size limit evicts the oldest entries on every write. The ledger used to be
    such entries: its hour index went first, and the report said 0 requests where the metrics said 12."""
    path = tmp_path / "cache"
    proxy = await start_proxy(config(upstream.base_url, admin={"keys": [ADMIN]},
                                     cache={"backend": "disk", "path": str(path), "size_limit_mb": 1}))
    async with aiohttp.ClientSession() as s:
        await summarised(s, proxy, range(30, 32))
        await assert_report_equals_metrics(s, proxy, 2)  # flushed: the hour is in the ledger
        other = diskcache.Cache(str(path), disk=_JSONBytesDisk)  # other conversations' summaries: 3 MB
        for i in range(60):
            other.set(f"sum:other-{i}", FILLER)
        other.close()
        await summarised(s, proxy, range(32, 42))  # each summary written evicts the oldest entries
        await assert_report_equals_metrics(s, proxy, 12)
    assert (path / "ledger.db").is_file()


async def test_the_ledger_is_not_evicted_by_redis_under_volatile_lru(
        upstream: FakeUpstream, start_proxy: StartProxy) -> None:
    """Redis under maxmemory with volatile-lru evicts keys with a TTL; the ledger's keys have none, so the
    summaries (which have one) go instead. The ledger's TTL'd keys used to go first: report 0, metrics 12."""
    with RedisServer.started() as server:
        proxy = await start_proxy(config(upstream.base_url, admin={"keys": [ADMIN]},
                                         cache={"backend": "redis", "url": server.url}))
        client = aioredis.Redis.from_url(server.url)
        try:
            async with aiohttp.ClientSession() as s:
                await summarised(s, proxy, range(30, 32))
                await assert_report_equals_metrics(s, proxy, 2)
                used = int((await client.info("memory"))["used_memory"])
                await client.config_set("maxmemory", str(used + 2_000_000))
                await client.config_set("maxmemory-policy", "volatile-lru")
                for i in range(200):  # 10 MB of other conversations' summaries, each with its TTL
                    await client.set(f"ctxproxy:sum:other-{i}", FILLER, px=3_600_000)
                assert int((await client.info("stats"))["evicted_keys"]) > 100
                await summarised(s, proxy, range(32, 42))
                await assert_report_equals_metrics(s, proxy, 12)
            ledger_keys = [k async for k in client.scan_iter(match="ctxproxy:ledger:*")]
            assert ledger_keys and all([await client.ttl(k) == -1 for k in ledger_keys])
        finally:
            await client.aclose()


async def test_an_allkeys_policy_is_warned_about(redis_server: RedisServer, caplog: pytest.LogCaptureFixture) -> None:
    """Under allkeys-* Redis may evict any key, the ledger's too: the writer says so once it has created the ledger."""
    client = aioredis.Redis.from_url(redis_server.url)
    await client.config_set("maxmemory-policy", "allkeys-lru")
    try:
        store = RedisLedgerStore(redis_server.url, prefix="warned:")
        await store.create()
        await store.close()
    finally:
        await client.config_set("maxmemory-policy", "noeviction")
        await client.aclose()
    assert any("allkeys-lru" in r.getMessage() and "volatile" in r.getMessage() for r in caplog.records)


# ---------------------------------------------------------------------------- written until written


async def test_a_write_redis_refused_is_written_once_it_recovers(
        upstream: FakeUpstream, start_proxy: StartProxy) -> None:
    """Redis refused writes for a while (maxmemory, noeviction). The flush used to mark the buckets written
    anyway: after Redis recovered the report said 5 requests and the metrics 10, for good. Now the report
    is a 503 naming the refusal while it lasts, and equals the metrics once Redis takes writes again."""
    with RedisServer.started() as server:
        proxy = await start_proxy(config(upstream.base_url, admin={"keys": [ADMIN]},
                                         cache={"backend": "redis", "url": server.url}))
        client = aioredis.Redis.from_url(server.url)
        try:
            async with aiohttp.ClientSession() as s:
                await summarised(s, proxy, range(30, 35))
                await assert_report_equals_metrics(s, proxy, 5)
                await client.config_set("maxmemory-policy", "noeviction")
                await client.config_set("maxmemory", "1")  # every write refused from now on
                await summarised(s, proxy, range(35, 40))
                status, body = await admin_report(s, proxy)
                assert status == 503 and body["error"]["code"] == "ledger_unavailable"
                assert "OutOfMemoryError" in body["error"]["message"]
                assert server.url.removesuffix("/0") in body["error"]["message"]
                await proxy.state.shared.ledger._flush_logged()  # the background flush: refused, kept
                await client.config_set("maxmemory", "0")
                await assert_report_equals_metrics(s, proxy, 10)
        finally:
            await client.aclose()


class GatedStore(MemoryLedgerStore):
    """A store whose writes wait for ``gate`` (and fail while ``refuse`` is set)."""

    def __init__(self) -> None:
        super().__init__()
        self.gate = asyncio.Event()
        self.gate.set()
        self.writing = asyncio.Event()
        self.refuse = False
        self.writes = 0

    async def write(self, hour: int, replica: str, rows: list[dict[str, Any]]) -> None:
        self.writing.set()
        await self.gate.wait()
        self.writes += 1
        if self.refuse:
            raise LedgerUnavailable("refused")
        await super().write(hour, replica, rows)


async def requests_in(store: LedgerStore) -> float:
    return sum(row.amounts["requests"] for row in await read(store, 0, 10 * HOUR))


async def test_rows_that_finish_during_a_write_are_written_by_the_next_flush() -> None:
    """The flush used to take its snapshot, await the store, then mark the hour clean: a request that
    finished while the write was under way was never written."""
    store = GatedStore()
    ledger = Ledger(store, clock=lambda: 5 * HOUR + 1)
    ledger.add("acme", "m", requests=1)
    store.gate.clear()
    flushing = asyncio.create_task(ledger.flush())
    await store.writing.wait()
    ledger.add("acme", "m", requests=1)  # finishes while the first write is under way
    store.gate.set()
    await flushing
    assert await requests_in(store) == 1 and ledger.unwritten == 1
    await ledger.flush()
    assert await requests_in(store) == 2 and ledger.unwritten == 0


async def test_a_refused_write_stays_unwritten_until_the_store_takes_it() -> None:
    """A refused write raises (it is not swallowed), keeps the hour dirty and is written whole later."""
    store = GatedStore()
    ledger = Ledger(store, clock=lambda: 5 * HOUR + 1)
    ledger.add("acme", "m", requests=1)
    store.refuse = True
    with pytest.raises(LedgerUnavailable):
        await ledger.flush()
    ledger.add("acme", "m", requests=1)
    await ledger._flush_logged()  # the background loop's flush: refused again, logged, kept
    assert ledger.unwritten == 1 and await requests_in(store) == 0
    store.refuse = False
    await ledger.flush()
    assert ledger.unwritten == 0 and await requests_in(store) == 2


async def test_a_flush_cancelled_during_its_write_loses_nothing() -> None:
    store = GatedStore()
    ledger = Ledger(store, clock=lambda: 5 * HOUR + 1)
    ledger.add("acme", "m", requests=3)
    store.gate.clear()
    flushing = asyncio.create_task(ledger.flush())
    await store.writing.wait()
    flushing.cancel()
    with pytest.raises(asyncio.CancelledError):
        await flushing
    assert ledger.unwritten == 1
    store.gate.set()
    await ledger.close()  # shutdown: the last flush writes it
    assert ledger.unwritten == 0


async def test_closing_a_ledger_with_nothing_recorded_creates_no_ledger(tmp_path: Path) -> None:
    """``ctxproxy assemble`` builds the shared objects too: it must not leave a ledger behind."""
    ledger = Ledger(DiskLedgerStore(str(tmp_path / "cache"), create=True))
    await ledger.close()
    assert not (tmp_path / "cache").exists()


# ---------------------------------------------------------------------------- the stores


@pytest.fixture(params=["memory", "disk", "redis"])
async def stores(request: pytest.FixtureRequest, tmp_path: Path) -> AsyncIterator[Callable[[bool], LedgerStore]]:
    """A factory of stores on one ledger: ``create`` True for a writer, False for a reader."""
    made: list[LedgerStore] = []
    memory = MemoryLedgerStore()
    prefix = f"test-{id(made)}:"

    def factory(create: bool) -> LedgerStore:
        store: LedgerStore
        if request.param == "memory":
            return memory
        if request.param == "disk":
            store = DiskLedgerStore(str(tmp_path / "cache"), create=create)
        else:
            store = RedisLedgerStore(request.getfixturevalue("redis_server").url, prefix=prefix)
        made.append(store)
        return store

    yield factory
    for store in made:
        await store.close()


async def test_buckets_are_per_replica_and_hours_older_than_the_retention_are_pruned(
        stores: Callable[[bool], LedgerStore]) -> None:
    now = [1000 * HOUR + 5.0]
    a, b = Ledger(stores(True), clock=lambda: now[0]), Ledger(stores(True), clock=lambda: now[0])
    a.add("acme", "m", requests=2, gross_usd=0.5)
    b.add("acme", "m", requests=3, gross_usd=0.25)
    b.add("globex", "m", requests=1)
    await a.flush()
    await b.flush()
    reader = stores(False)
    rows = {(r.tenant, r.model): r.amounts for r in await read(reader, now[0] - HOUR, now[0])}
    assert rows[("acme", "m")]["requests"] == 5 and rows[("acme", "m")]["gross_usd"] == 0.75
    assert rows[("globex", "m")]["requests"] == 1
    now[0] += (RETENTION_HOURS + 1) * HOUR  # 31 days and an hour later
    a.add("acme", "m", requests=7)
    await a.flush()
    assert [r.amounts["requests"] for r in await read(reader, 0, now[0])] == [7]  # the old hour is gone


async def test_a_ledger_that_does_not_exist_is_an_error_not_an_empty_report(
        stores: Callable[[bool], LedgerStore], tmp_path: Path) -> None:
    """An existing cache directory or Redis where no server has recorded anything is not an empty report."""
    reader = stores(False)
    if isinstance(reader, MemoryLedgerStore):
        pytest.skip("the memory ledger lives in its server: there is nothing else to read")
    (tmp_path / "cache").mkdir()
    with pytest.raises(LedgerUnavailable, match="no ctxproxy server has recorded anything"):
        await read(reader, 0, 10 * HOUR)
    await Ledger(stores(True)).flush()  # a server started: the ledger exists, empty
    assert await read(reader, 0, 10 * HOUR) == []


async def test_the_disk_reader_creates_nothing(tmp_path: Path) -> None:
    """A mistyped path used to report zeros (and create the folder)."""
    missing = tmp_path / "typo" / "cache"
    store = DiskLedgerStore(str(missing), create=False)
    with pytest.raises(LedgerUnavailable, match="does not exist"):
        await store.read(0, 10)
    await store.close()
    assert not (tmp_path / "typo").exists()
    (tmp_path / "a-file").write_text("")
    store = DiskLedgerStore(str(tmp_path / "a-file"), create=False)
    with pytest.raises(LedgerUnavailable, match="is not a directory"):
        await store.read(0, 10)
    await store.close()


async def test_the_disk_ledger_is_private_and_reopens_after_a_broken_file(tmp_path: Path) -> None:
    path = tmp_path / "cache"
    store = DiskLedgerStore(str(path), create=True)
    await store.write(hour_of(0), "r1", [{"tenant": "t", "model": "m", "requests": 1}])
    assert (path.stat().st_mode & 0o777) == 0o700 and ((path / "ledger.db").stat().st_mode & 0o777) == 0o600
    await store.close()
    (path / "ledger.db").write_bytes(b"not a database" * 100)
    broken = DiskLedgerStore(str(path), create=True)
    with pytest.raises(LedgerUnavailable, match=r"ledger\.db"):
        await broken.write(1, "r1", [])
    (path / "ledger.db").unlink()
    await broken.write(1, "r1", [{"tenant": "t", "model": "m", "requests": 2}])  # healed without a restart
    assert [r.amounts["requests"] for r in await read(broken, 0, 2 * HOUR)] == [2]
    await broken.close()


async def test_a_bucket_that_is_not_rows_is_skipped(tmp_path: Path) -> None:
    store = DiskLedgerStore(str(tmp_path), create=True)
    await store.write(1, "good", [{"tenant": "t", "model": "m", "requests": 4}])
    await store.close()
    db = sqlite3.connect(tmp_path / "ledger.db")
    db.execute("INSERT INTO buckets VALUES (1, 'bad', ?)", (b'{"not": "rows"}',))
    db.execute("INSERT INTO buckets VALUES (1, 'worse', ?)", (b"\xff garbage",))
    db.commit()
    db.close()
    reader = DiskLedgerStore(str(tmp_path), create=False)
    assert [r.amounts["requests"] for r in await read(reader, HOUR, 2 * HOUR)] == [4]
    await reader.close()


def test_a_redis_address_never_carries_its_password() -> None:
    assert redis_address("redis://user:s3cret@cache.internal:6380/2") == "redis://cache.internal:6380/2"
    assert redis_address("rediss://:s3cret@h:1/0") == "rediss://h:1/0"
    assert redis_address("redis://h:1/0") == "redis://h:1/0"
