"""Tests for proxy.cache: memory / disk / redis backends, SafeCache and open_cache."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import pickle
import random
import sqlite3
import stat
import time
import uuid
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import diskcache
import pytest
import redis.asyncio as aioredis
import redis.asyncio.connection as redis_connection

from proxy.store import disk as cache_mod
from proxy.store.backends import open_cache
from proxy.store.cache import Cache, CacheBackendError, LockHandle, SafeCache
from proxy.store.disk import DiskCache
from proxy.store.memory import MemoryCache
from proxy.store.redis import RedisCache
from tests.redis_server import RedisServer, redis_server_fixture

redis_server = redis_server_fixture(scope="module")

VALUE: dict[str, Any] = {
    "summary": 'Zusammenfassung — 摘要 — резюме 🚀 "quoted" \\ \n tab\t',
    "nested": {
        "list": [1, 2.5, None, True, {"ü": "ß", "emoji": "👩‍💻"}],
        "empty": {},
        "deep": {"a": {"b": {"c": []}}},
    },
    "big_int": 2**53 + 1,
}

Factory = Callable[..., Cache]
Errors = list[tuple[str, BaseException]]


def _recorder(errors: Errors) -> Callable[[str, BaseException], None]:
    return lambda op, exc: errors.append((op, exc))


def _mode(p: Path) -> int:
    return stat.S_IMODE(p.stat().st_mode)


@pytest.fixture(params=["memory", "disk", "redis"])
async def make(request: pytest.FixtureRequest, tmp_path: Path) -> AsyncIterator[Factory]:
    """Factory of independent cache objects on the same store (two "processes").

    The memory backend is per-process, so there the same object plays both roles.
    """
    backend: str = request.param
    url = request.getfixturevalue("redis_server").url if backend == "redis" else ""
    prefix = f"test-{uuid.uuid4().hex}:"
    created: list[Cache] = []
    memory: dict[float | None, MemoryCache] = {}

    def factory(ttl: float | None = None) -> Cache:
        c: Cache
        if backend == "memory":
            if ttl not in memory:
                memory[ttl] = MemoryCache(ttl)
                created.append(memory[ttl])
            return memory[ttl]
        if backend == "disk":
            c = DiskCache(str(tmp_path / "cache"), ttl, 16)
        else:
            c = RedisCache(url, ttl, prefix=prefix)
        created.append(c)
        return c

    yield factory
    for c in created:
        await c.close()


# ---------------------------------------------------------------- all backends


async def test_round_trip_visible_to_other_process(make: Factory) -> None:
    a, b = make(), make()
    await a.set("conv:1", VALUE)
    assert await a.get("conv:1") == VALUE
    assert await b.get("conv:1") == VALUE
    await b.set("conv:1", {"v": 2})
    assert await a.get("conv:1") == {"v": 2}
    assert a.name in {"memory", "disk", "redis"}
    assert await a.ping() is True


async def test_missing_key_is_none(make: Factory) -> None:
    c = make()
    await c.set("present", {"x": 1})
    assert await c.get("absent") is None
    assert await c.get("") is None


async def test_get_many_in_key_order_and_first_hit(make: Factory) -> None:
    cache = make()
    await cache.set("b", {"v": 2})
    await cache.set("c", {"v": 3})
    assert await cache.get_many(["a", "b", "c"]) == [None, {"v": 2}, {"v": 3}]
    got = await cache.get_many(["a", "b", "c"], first_hit=True)  # the keys after the first hit may stay unread
    assert got[:2] == [None, {"v": 2}] and got[2] in (None, {"v": 3})
    assert await cache.get_many(["x", "y"], first_hit=True) == [None, None]


async def test_get_many_reads_past_a_corrupt_record(make: Factory) -> None:
    """A record that is not a JSON object is missing to get_many: it never hides the others (first_hit too)."""
    cache = make()
    await cache.set("good", {"v": 1})
    raw = getattr(cache, "_dc", None) or getattr(cache, "_data", None)
    if cache.name == "disk":
        await cache._run(lambda dc: dc.set("bad", b"not json"))  # type: ignore[attr-defined]
    elif cache.name == "redis":
        await cache._cmd("SET", cache._prefix + "bad", b"[1, 2]")  # type: ignore[attr-defined]
    else:
        pytest.skip(f"the memory backend stores objects, not bytes ({raw is not None})")
    assert await cache.get_many(["bad", "good"]) == [None, {"v": 1}]
    assert (await cache.get_many(["bad", "good"], first_hit=True))[1] == {"v": 1}


async def test_ttl_expiry(make: Factory) -> None:
    c, with_default = make(), make(ttl=0.3)
    await c.set("short", {"a": 1}, ttl=0.3)
    await c.set("forever", {"b": 2})
    await with_default.set("default-ttl", {"c": 3})
    await with_default.set("override", {"d": 4}, ttl=30)
    assert await c.get("short") == {"a": 1}
    assert await with_default.get("default-ttl") == {"c": 3}
    await asyncio.sleep(0.45)
    assert await c.get("short") is None
    assert await with_default.get("default-ttl") is None
    assert await c.get("forever") == {"b": 2}
    assert await with_default.get("override") == {"d": 4}


async def test_non_json_value_is_a_backend_error(make: Factory) -> None:
    c = make()
    with pytest.raises(CacheBackendError):
        await c.set("k", {"x": object()})
    with pytest.raises(CacheBackendError):
        await c.set("k", ["not", "an", "object"])  # type: ignore[arg-type]


async def _hold(c: Cache, key: str, wait: float) -> tuple[LockHandle, float]:
    async with c.lock(key, ttl=5, wait=wait) as got:
        return got, time.monotonic()


async def test_lock_excludes_second_holder_then_waiter_gets_it(make: Factory) -> None:
    a, b = make(), make()
    async with a.lock("job", ttl=5, wait=0) as got_a:
        assert got_a.acquired is True
        t0 = time.monotonic()
        async with b.lock("job", ttl=5, wait=0.2) as got_b:
            assert got_b.acquired is False  # gave up after `wait`
        assert 0.18 <= time.monotonic() - t0 < 2
        async with b.lock("other-job", ttl=5, wait=0) as got_other:
            assert got_other.acquired is True  # different key, no conflict
        waiter = asyncio.create_task(_hold(b, "job", wait=3))
        await asyncio.sleep(0.15)
        assert not waiter.done()
        released_at = time.monotonic()
    got, acquired_at = await asyncio.wait_for(waiter, 3)
    assert got.acquired is True
    assert acquired_at >= released_at
    async with a.lock("job", ttl=5, wait=0) as again:
        assert again.acquired is True  # the waiter released it


async def test_expired_lock_is_taken_over_and_stale_holder_cannot_release_it(make: Factory) -> None:
    a, b = make(), make()
    crashed = a.lock("job", ttl=0.3, wait=0)
    assert (await crashed.__aenter__()).acquired is True  # holder "crashes": never releases in time
    async with b.lock("job", ttl=5, wait=0) as got:
        assert got.acquired is False
    await asyncio.sleep(0.4)
    async with b.lock("job", ttl=5, wait=0.5) as got_b:
        assert got_b.acquired is True
        await crashed.__aexit__(None, None, None)  # stale holder wakes up and "releases"
        async with a.lock("job", ttl=5, wait=0) as got_a:
            assert got_a.acquired is False  # ...but b's lock survived: release is compare-and-delete


# ---------------------------------------------------------------- disk


async def test_disk_directory_and_files_are_private(tmp_path: Path) -> None:
    new_dir = tmp_path / "a" / "cache"
    existing = tmp_path / "existing"
    existing.mkdir()
    os.chmod(existing, 0o755)
    old_umask = os.umask(0)  # prove we do not rely on the umask
    try:
        caches = [DiskCache(str(new_dir), None, 16), DiskCache(str(existing), None, 16)]
        for c in caches:
            await c.set("k", VALUE)
            assert await c.get("k") == VALUE
    finally:
        os.umask(old_umask)
    try:
        for d in (new_dir, existing):
            assert _mode(d) == 0o700
            files = list(d.iterdir())
            assert any(f.name == "cache.db" for f in files)
            for f in files:
                assert _mode(f) & 0o077 == 0, f"{f} is {oct(_mode(f))}"
    finally:
        for c in caches:
            await c.close()


def _pwn(marker: str, _padding: str = "") -> None:
    Path(marker).touch()


class _Evil:
    def __init__(self, marker: Path, size: int) -> None:
        self.marker, self.size = str(marker), size

    def __reduce__(self) -> tuple[Any, ...]:
        return (_pwn, (self.marker, "x" * self.size))


async def test_disk_never_unpickles(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = tmp_path / "cache"
    marker = tmp_path / "PWNED"
    ours = DiskCache(str(path), None, 16)
    try:
        await ours.set("good", {"ok": True})
        # Someone with write access to the cache dir plants pickles with stock diskcache:
        # a small one (inline in sqlite) and a large one (in a value file).
        plain = diskcache.Cache(str(path))
        plain.set("small", _Evil(marker, 10))
        plain.set("large", _Evil(marker, 100_000))
        plain.close()
        # ...and raw rows written straight into the sqlite file.
        with contextlib.closing(sqlite3.connect(path / "cache.db")) as db:
            blob = pickle.dumps(_Evil(marker, 10))
            now = time.time()
            rows = [
                ("raw-pickle", diskcache.core.MODE_PICKLE, None, blob),
                ("raw-mode-pickle-bytes", diskcache.core.MODE_RAW, None, blob),
                ("file-row", diskcache.core.MODE_BINARY, str(tmp_path / "PWNED-file"), None),
            ]
            for key, mode, filename, value in rows:
                db.execute(
                    "INSERT INTO Cache (key, raw, store_time, expire_time, access_time, size, mode, filename, value)"
                    " VALUES (?, 1, ?, NULL, ?, 0, ?, ?, ?)",
                    (key, now, now, mode, filename, value),
                )
            db.commit()
        (tmp_path / "PWNED-file").write_bytes(b'{"read": "an arbitrary file"}')

        unpickled: list[str] = []
        real_load, real_loads = pickle.load, pickle.loads

        def spy_load(*a: Any, **k: Any) -> Any:
            unpickled.append("load")
            return real_load(*a, **k)

        def spy_loads(*a: Any, **k: Any) -> Any:
            unpickled.append("loads")
            return real_loads(*a, **k)

        monkeypatch.setattr(pickle, "load", spy_load)
        monkeypatch.setattr(pickle, "loads", spy_loads)

        errors: Errors = []
        safe = SafeCache(ours, on_error=_recorder(errors))
        for key in ("small", "large", "raw-pickle", "raw-mode-pickle-bytes", "file-row"):
            with pytest.raises(CacheBackendError):
                await ours.get(key)
            assert await safe.get(key) is None
        assert [op for op, _ in errors] == ["get"] * 5
        assert unpickled == []
        assert not marker.exists()
        assert (tmp_path / "PWNED-file").exists()  # never read, never deleted
        assert await ours.get("good") == {"ok": True}  # the cache still works
        await ours.set("small", {"replaced": 1})  # overwriting a planted row works
        assert await ours.get("small") == {"replaced": 1}
        assert (tmp_path / "PWNED-file").exists()
    finally:
        await ours.close()


async def test_disk_corrupt_database_is_served_as_miss(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    path = tmp_path / "cache"
    path.mkdir(mode=0o700)
    (path / "cache.db").write_bytes(b"this is not an sqlite database\n" * 200)
    errors: Errors = []
    safe = open_cache(
        "disk", path=str(path), url=None, ttl=None, size_limit_mb=16, on_error=_recorder(errors)
    )
    assert isinstance(safe, SafeCache) and safe.name == "disk"
    try:
        with caplog.at_level(logging.DEBUG, logger="ctxproxy.cache"):
            for _ in range(3):
                assert await safe.get("k") is None
                await safe.set("k", VALUE)
            async with safe.lock("k", ttl=1, wait=0) as got:
                assert got.acquired is True  # fail open
            assert await safe.ping() is False
        assert [op for op, _ in errors] == ["get", "set"] * 3 + ["lock"]
        assert all(isinstance(e, CacheBackendError) for _, e in errors)
        warnings = [r for r in caplog.records if r.name == "ctxproxy.cache" and r.levelno == logging.WARNING]
        assert len(warnings) == 1, [r.getMessage() for r in warnings]
        # Opening is retried: removing the corrupt file heals the cache without a restart.
        (path / "cache.db").unlink()
        await safe.set("k", VALUE)
        assert await safe.get("k") == VALUE
        assert await safe.ping() is True
        assert len(errors) == 7
    finally:
        await safe.close()


async def test_disk_unusable_directory_is_served_as_miss(tmp_path: Path) -> None:
    # We may run as root, where chmod 000 does not stop us: put the cache "under" a regular file.
    blocker = tmp_path / "a-file"
    blocker.write_text("not a directory")
    errors: Errors = []
    safe = open_cache(
        "disk", path=str(blocker / "sub"), url=None, ttl=None, size_limit_mb=16, on_error=_recorder(errors)
    )
    try:
        assert await safe.get("k") is None
        await safe.set("k", VALUE)
        async with safe.lock("k", ttl=1, wait=0.1) as got:
            assert got.acquired is True
        assert await safe.ping() is False
        assert [op for op, _ in errors] == ["get", "set", "lock"]
        assert isinstance(errors[0][1], CacheBackendError)
        assert isinstance(errors[0][1].__cause__, NotADirectoryError)
    finally:
        await safe.close()


async def test_disk_size_limit_evicts_oldest(tmp_path: Path) -> None:
    c = DiskCache(str(tmp_path / "cache"), None, size_limit_mb=1)
    try:
        blob = "x" * 50_000
        for i in range(80):  # ~4 MB through a 1 MB cache
            await c.set(f"k{i}", {"i": i, "blob": blob})
        assert await c.get("k0") is None
        assert await c.get("k79") == {"i": 79, "blob": blob}
        assert (tmp_path / "cache" / "cache.db").stat().st_size < 3 * 1024 * 1024
    finally:
        await c.close()


async def test_disk_io_runs_off_the_event_loop(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    c = DiskCache(str(tmp_path / "cache"), None, 16)
    try:
        await c.set("k", {"v": 1})
        real_fetch = cache_mod._JSONBytesDisk.fetch

        def slow_fetch(self: Any, *args: Any) -> bytes:
            time.sleep(0.3)  # a slow disk
            return real_fetch(self, *args)

        monkeypatch.setattr(cache_mod._JSONBytesDisk, "fetch", slow_fetch)
        ticks = 0

        async def ticker() -> None:
            nonlocal ticks
            while True:
                await asyncio.sleep(0.01)
                ticks += 1

        t = asyncio.create_task(ticker())
        assert await c.get("k") == {"v": 1}
        t.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await t
        assert ticks >= 10  # the loop kept running while sqlite was busy
    finally:
        await c.close()


# ---------------------------------------------------------------- redis


def _force_naive_redis_py(monkeypatch: pytest.MonkeyPatch) -> None:
    """Make redis-py keep a connection after a cancelled read (its own #2624 guard switched off)."""
    real = redis_connection.Connection.read_response

    async def read_response(self: Any, *args: Any, **kwargs: Any) -> Any:
        kwargs["disconnect_on_error"] = False
        return await real(self, *args, **kwargs)

    monkeypatch.setattr(redis_connection.Connection, "read_response", read_response)


async def test_cancel_scenario_breaks_a_naive_client(redis_server: RedisServer) -> None:
    """Self-check of the scenario below: without a guard, the next command reads the cancelled reply."""
    blocker = aioredis.Redis.from_url(redis_server.url)
    conn = redis_connection.Connection(host=redis_server.host, port=redis_server.port)
    try:
        await blocker.set("naive:slow", "slow-value")
        await blocker.set("naive:other", "other-value")
        await conn.connect()  # (connecting to a sleeping server would wait for it)
        sleeper = asyncio.create_task(blocker.execute_command("DEBUG", "SLEEP", "0.1"))
        await asyncio.sleep(0.01)
        await conn.send_command("GET", "naive:slow")
        reader = asyncio.create_task(conn.read_response(disconnect_on_error=False))
        await asyncio.sleep(0.02)
        reader.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await reader
        await conn.send_command("GET", "naive:other")
        assert await conn.read_response() == b"slow-value"  # someone else's reply
        await sleeper
    finally:
        await conn.disconnect()
        await blocker.aclose()


@pytest.mark.parametrize("naive_redis_py", [False, True], ids=["redis-py", "redis-py-without-its-guard"])
async def test_redis_cancellation_never_mixes_replies(
    redis_server: RedisServer, monkeypatch: pytest.MonkeyPatch, naive_redis_py: bool
) -> None:
    if naive_redis_py:
        _force_naive_redis_py(monkeypatch)
    cache = RedisCache(redis_server.url, None, prefix=f"cancel-{uuid.uuid4().hex}:", max_connections=1)
    blocker = aioredis.Redis.from_url(redis_server.url)
    rng = random.Random(2624)
    try:
        await cache.set("slow", {"v": "slow"})
        await cache.set("other", {"v": "other"})
        for _ in range(50):
            sleeper = asyncio.create_task(blocker.execute_command("DEBUG", "SLEEP", "0.04"))
            await asyncio.sleep(0.004)  # the server is now blocked: our GET's reply will be late
            victim = asyncio.create_task(cache.get("slow"))
            await asyncio.sleep(rng.uniform(0, 0.035))
            victim.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await victim
            assert await cache.get("other") == {"v": "other"}
            await sleeper
        assert await cache.get("slow") == {"v": "slow"}
    finally:
        await cache.close()
        await blocker.aclose()


async def test_redis_lock_acquired_by_cancelled_caller_is_released(redis_server: RedisServer) -> None:
    cache = RedisCache(redis_server.url, None, prefix=f"orphan-{uuid.uuid4().hex}:")
    blocker = aioredis.Redis.from_url(redis_server.url)
    try:
        sleeper = asyncio.create_task(blocker.execute_command("DEBUG", "SLEEP", "0.1"))
        await asyncio.sleep(0.01)
        cm = cache.lock("job", ttl=30, wait=0)
        enter = asyncio.create_task(cm.__aenter__())
        await asyncio.sleep(0.03)  # SET NX sent, reply pending
        enter.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await enter
        await sleeper
        # The SET NX did run; without the orphan release the lock would be stuck for 30 s.
        async with cache.lock("job", ttl=5, wait=5.0) as got:
            assert got.acquired is True
    finally:
        await cache.close()
        await blocker.aclose()


async def test_redis_down_and_back() -> None:
    with RedisServer.started() as server:
        errors: Errors = []
        safe = SafeCache(RedisCache(server.url, None, prefix="down:"), on_error=_recorder(errors))
        try:
            await safe.set("k", VALUE)
            assert await safe.get("k") == VALUE
            server.stop()
            t0 = time.monotonic()
            assert await safe.get("k") is None
            await safe.set("k", VALUE)
            async with safe.lock("k", ttl=1, wait=0.1) as got:
                assert got.acquired is True  # fail open
            assert await safe.ping() is False
            assert time.monotonic() - t0 < 3
            assert [op for op, _ in errors] == ["get", "set", "lock"]
            assert all(isinstance(e, CacheBackendError) for _, e in errors)
            server.start()  # same port; the server lost its data (no persistence)
            await safe.set("k", VALUE)
            assert await safe.get("k") == VALUE
            assert await safe.ping() is True
            assert len(errors) == 3
        finally:
            await safe.close()


async def test_redis_down_at_startup_fails_fast() -> None:
    with RedisServer.started() as server:
        url = server.url
        server.stop()
        errors: Errors = []
        safe = open_cache("redis", path="", url=url, ttl=60, size_limit_mb=1, on_error=_recorder(errors))
        try:
            t0 = time.monotonic()
            assert await safe.get("k") is None
            assert await safe.ping() is False
            assert time.monotonic() - t0 < 3
            assert [op for op, _ in errors] == ["get"]
            server.start()
            await safe.set("k", {"up": True})
            assert await safe.get("k") == {"up": True}
        finally:
            await safe.close()


# ---------------------------------------------------------------- SafeCache / open_cache


class _Flaky:
    """A backend that fails on demand."""

    name = "flaky"
    read_answered = True

    def __init__(self) -> None:
        self.inner = MemoryCache()
        self.fail: BaseException | None = None

    def _check(self) -> None:
        if self.fail is not None:
            raise self.fail

    async def get(self, key: str) -> dict[str, Any] | None:
        self._check()
        return await self.inner.get(key)

    async def set(self, key: str, value: dict[str, Any], ttl: float | None = None) -> None:
        self._check()
        await self.inner.set(key, value, ttl)

    async def get_many(self, keys: list[str], first_hit: bool = False) -> list[dict[str, Any] | None]:
        self._check()
        return await self.inner.get_many(keys, first_hit)

    def lock(self, key: str, ttl: float, wait: float, ready: Any = None) -> contextlib.AbstractAsyncContextManager[Any]:
        self._check()
        return self.inner.lock(key, ttl, wait, ready)

    async def ping(self) -> bool:
        self._check()
        return True

    async def close(self) -> None:
        self._check()


async def test_safe_cache_logs_once_per_error_streak(caplog: pytest.LogCaptureFixture) -> None:
    flaky = _Flaky()
    errors: Errors = []
    safe = SafeCache(flaky, on_error=_recorder(errors))

    def warnings() -> int:
        return sum(1 for r in caplog.records if r.name == "ctxproxy.cache" and r.levelno == logging.WARNING)

    with caplog.at_level(logging.INFO, logger="ctxproxy.cache"):
        await safe.set("k", {"v": 1})
        flaky.fail = CacheBackendError("down")
        assert await safe.get("k") is None
        await safe.set("k", {"v": 2})
        assert await safe.ping() is False
        assert warnings() == 1
        flaky.fail = None
        assert await safe.get("k") == {"v": 1}  # success ends the streak
        flaky.fail = OSError("down again")
        assert await safe.get("k") is None
        assert await safe.get("k") is None
        assert warnings() == 2
    assert [op for op, _ in errors] == ["get", "set", "ping", "get", "get"]


async def test_safe_cache_lock_fails_open_and_keeps_body_exceptions() -> None:
    flaky = _Flaky()
    errors: Errors = []
    safe = SafeCache(flaky, on_error=_recorder(errors))
    flaky.fail = CacheBackendError("down")
    async with safe.lock("k", ttl=1, wait=0) as got:
        assert got.acquired is True
    with pytest.raises(ValueError, match="body"):
        async with safe.lock("k", ttl=1, wait=0):
            raise ValueError("body")
    flaky.fail = None
    with pytest.raises(ValueError, match="body"):
        async with safe.lock("k", ttl=5, wait=0) as got:
            assert got.acquired is True
            raise ValueError("body")
    async with safe.lock("k", ttl=5, wait=0) as got:
        assert got.acquired is True  # released despite the exception
        async with safe.lock("k", ttl=5, wait=0) as second:
            assert second.acquired is False  # a working lock is still a lock
    assert [op for op, _ in errors] == ["lock", "lock"]


async def test_safe_cache_never_swallows_cancellation() -> None:
    flaky = _Flaky()
    errors: Errors = []
    safe = SafeCache(flaky, on_error=_recorder(errors))
    flaky.fail = asyncio.CancelledError()
    with pytest.raises(asyncio.CancelledError):
        await safe.get("k")
    with pytest.raises(asyncio.CancelledError):
        await safe.set("k", {"v": 1})
    with pytest.raises(asyncio.CancelledError):
        async with safe.lock("k", ttl=1, wait=0):
            pass
    assert errors == []

    # A caller cancelled while waiting for a lock sees the cancellation.
    flaky.fail = None
    async with safe.lock("k", ttl=5, wait=0):
        waiter = asyncio.create_task(_hold(safe, "k", wait=5))
        await asyncio.sleep(0.05)
        waiter.cancel()
        with pytest.raises(asyncio.CancelledError):
            await waiter
    assert errors == []


async def test_safe_cache_survives_a_broken_on_error_hook() -> None:
    def hook(op: str, exc: BaseException) -> None:
        raise RuntimeError("metrics broken")

    flaky = _Flaky()
    flaky.fail = CacheBackendError("down")
    safe = SafeCache(flaky, on_error=hook)
    assert await safe.get("k") is None
    await safe.close()


async def test_open_cache_backends(tmp_path: Path) -> None:
    for backend, url in (("memory", None), ("disk", None), ("redis", "redis://127.0.0.1:1/0")):
        c = open_cache(backend, path=str(tmp_path / "c"), url=url, ttl=10, size_limit_mb=8)
        assert isinstance(c, SafeCache)
        assert c.name == backend
        await c.close()
    with pytest.raises(ValueError, match="unknown cache backend"):
        open_cache("sqlite", path="", url=None, ttl=None, size_limit_mb=1)
    with pytest.raises(ValueError, match="requires"):
        open_cache("redis", path="", url=None, ttl=None, size_limit_mb=1)
