"""Persistent cache for conversation summaries: memory, disk (SQLite) and Redis backends.

Every backend stores JSON objects only (serialised with orjson) and offers a cross-process lock
with expiry.  Backends raise :class:`CacheBackendError` on I/O failure; :class:`SafeCache` (what
:func:`open_cache` returns) turns every such failure into "no cache" so requests keep flowing.

Cancellation: every backend operation runs to completion in its own task/thread even if the awaiting
coroutine is cancelled (``asyncio.shield``).  A Redis connection is therefore never returned to the
pool with an unread reply (the redis-py #2624 class of bug), and a lock acquired by a call whose caller
was cancelled is released in the background instead of being leaked until its TTL.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import secrets
import sqlite3
import stat
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from concurrent.futures import ThreadPoolExecutor
from contextlib import AbstractAsyncContextManager, asynccontextmanager
from typing import Any, Protocol, TypeVar

import diskcache
import orjson
import redis.asyncio as aioredis
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff

__all__ = [
    "Cache",
    "CacheBackendError",
    "DiskCache",
    "MemoryCache",
    "RedisCache",
    "SafeCache",
    "open_cache",
]

log = logging.getLogger(__name__)

T = TypeVar("T")
ErrorHook = Callable[[str, BaseException], None]

_LOCK_PREFIX = "__lock__:"  # lock keys live next to the values; callers' keys must not use this prefix
_POLL_INTERVAL = 0.025  # seconds between lock attempts while waiting
_DRAIN_TIMEOUT = 2.0  # close(): how long to let in-flight operations finish
# Redis: compare-and-delete, so a holder whose lock expired cannot free someone else's lock.
_RELEASE_LUA = (
    "if redis.call('get', KEYS[1]) == ARGV[1] then return redis.call('del', KEYS[1]) else return 0 end"
)


class CacheBackendError(Exception):
    """A cache backend could not complete an operation (I/O error, corrupt data, backend down)."""


class Cache(Protocol):
    """Async key -> JSON-object store with TTL and a cross-process lock."""

    name: str
    """Backend name: ``"disk"``, ``"redis"`` or ``"memory"``."""

    async def get(self, key: str) -> dict[str, Any] | None:
        """Return the stored object, or None when missing or expired."""
        ...

    async def set(self, key: str, value: dict[str, Any], ttl: float | None = None) -> None:
        """Store ``value`` (a JSON object) for ``ttl`` seconds (None: the backend's default TTL)."""
        ...

    def lock(self, key: str, ttl: float, wait: float) -> AbstractAsyncContextManager[bool]:
        """Cross-process mutual exclusion on ``key``.

        The lock expires after ``ttl`` seconds so a crashed holder cannot block forever.  Waits up to
        ``wait`` seconds to acquire; the context manager yields True if acquired, False if it gave up.
        Releasing only deletes the lock if this holder still owns it.
        """
        ...

    async def ping(self) -> bool:
        """True when the backend is usable (for /readyz)."""
        ...

    async def close(self) -> None:
        """Release connections, threads and file handles."""
        ...


def _dumps(value: dict[str, Any]) -> bytes:
    if not isinstance(value, dict):
        raise CacheBackendError(f"cache values must be JSON objects, not {type(value).__name__}")
    try:
        return orjson.dumps(value)
    except TypeError as exc:  # orjson.JSONEncodeError
        raise CacheBackendError(f"cache value is not JSON-serialisable: {exc}") from exc


def _loads(raw: bytes | str) -> dict[str, Any]:
    try:
        value = orjson.loads(raw)
    except orjson.JSONDecodeError as exc:
        raise CacheBackendError("corrupt cache entry (not JSON)") from exc
    if not isinstance(value, dict):
        raise CacheBackendError("corrupt cache entry (not a JSON object)")
    return value


class _BaseCache:
    """Shared TTL default, cancellation guard and polling lock."""

    name: str

    def __init__(self, ttl: float | None) -> None:
        self._default_ttl = ttl
        self._inflight: set[asyncio.Future[Any]] = set()

    def _ttl(self, ttl: float | None) -> float | None:
        return self._default_ttl if ttl is None else ttl

    def _track(self, fut: asyncio.Future[Any]) -> None:
        self._inflight.add(fut)
        fut.add_done_callback(self._untrack)

    def _untrack(self, fut: asyncio.Future[Any]) -> None:
        self._inflight.discard(fut)
        if not fut.cancelled():
            fut.exception()  # mark as retrieved: an abandoned failure must not be logged as "never retrieved"

    async def _guarded(self, aw: Awaitable[T], on_orphan: Callable[[T], None] | None = None) -> T:
        """Await ``aw`` but let it run to completion if the caller is cancelled.

        ``on_orphan`` receives the result of an operation whose caller was cancelled (to undo it).
        """
        fut = asyncio.ensure_future(aw)
        self._track(fut)
        try:
            return await asyncio.shield(fut)
        except asyncio.CancelledError:
            if on_orphan is not None:
                callback = on_orphan

                def _undo(done: asyncio.Future[T]) -> None:
                    if not done.cancelled() and done.exception() is None:
                        callback(done.result())

                fut.add_done_callback(_undo)
            raise

    async def _drain(self) -> None:
        if self._inflight:
            await asyncio.wait(set(self._inflight), timeout=_DRAIN_TIMEOUT)

    async def _try_acquire(self, lock_key: str, token: str, ttl: float) -> bool:
        raise NotImplementedError

    async def _release(self, lock_key: str, token: str) -> None:
        raise NotImplementedError

    def lock(self, key: str, ttl: float, wait: float) -> AbstractAsyncContextManager[bool]:
        return self._lock(_LOCK_PREFIX + key, ttl, wait)

    @asynccontextmanager
    async def _lock(self, lock_key: str, ttl: float, wait: float) -> AsyncIterator[bool]:
        token = secrets.token_hex(16)
        loop = asyncio.get_running_loop()
        deadline = loop.time() + max(0.0, wait)

        def release_orphan(acquired: bool) -> None:
            if acquired:
                self._track(asyncio.ensure_future(self._release(lock_key, token)))

        while True:
            acquired = await self._guarded(self._try_acquire(lock_key, token, ttl), release_orphan)
            remaining = deadline - loop.time()
            if acquired or remaining <= 0:
                break
            await asyncio.sleep(min(_POLL_INTERVAL, remaining))
        try:
            yield acquired
        finally:
            if acquired:
                await self._guarded(self._release(lock_key, token))


class MemoryCache(_BaseCache):
    """In-process dict with TTL (tests, single-process deployments); the lock is process-local."""

    name = "memory"

    def __init__(self, ttl: float | None = None, max_entries: int = 10_000) -> None:
        super().__init__(ttl)
        self._max_entries = max_entries
        self._data: dict[str, tuple[bytes, float | None]] = {}
        self._locks: dict[str, tuple[str, float]] = {}

    async def get(self, key: str) -> dict[str, Any] | None:
        item = self._data.get(key)
        if item is None:
            return None
        raw, expires = item
        if expires is not None and expires <= time.monotonic():
            del self._data[key]
            return None
        return _loads(raw)

    async def set(self, key: str, value: dict[str, Any], ttl: float | None = None) -> None:
        ttl = self._ttl(ttl)
        raw = _dumps(value)
        self._data.pop(key, None)  # re-insert at the end: dict order == age
        self._data[key] = (raw, None if ttl is None else time.monotonic() + ttl)
        if len(self._data) > self._max_entries:
            now = time.monotonic()
            for k in [k for k, (_, exp) in self._data.items() if exp is not None and exp <= now]:
                del self._data[k]
            while len(self._data) > self._max_entries:
                del self._data[next(iter(self._data))]

    async def _try_acquire(self, lock_key: str, token: str, ttl: float) -> bool:
        now = time.monotonic()
        current = self._locks.get(lock_key)
        if current is not None and current[1] > now:
            return False
        self._locks[lock_key] = (token, now + ttl)
        return True

    async def _release(self, lock_key: str, token: str) -> None:
        current = self._locks.get(lock_key)
        if current is not None and current[0] == token:
            del self._locks[lock_key]

    async def ping(self) -> bool:
        return True

    async def close(self) -> None:
        self._data.clear()
        self._locks.clear()


class _JSONBytesDisk(diskcache.Disk):  # type: ignore[misc]
    """diskcache serialiser that never pickles (CVE-2025-69872).

    Keys must be ``str``; values must be ``bytes`` (orjson output) and are stored inline in SQLite.
    Reading refuses anything else -- pickled rows, value files -- so a tampered cache cannot make us
    unpickle, read or delete arbitrary files.
    """

    def put(self, key: Any) -> tuple[Any, bool]:
        if type(key) is not str:
            raise TypeError("cache keys must be str")
        return key, True

    def get(self, key: Any, raw: bool) -> Any:
        if not raw:
            raise CacheBackendError("refusing to unpickle a cache key")
        return bytes(key) if isinstance(key, memoryview) else key

    def store(self, value: Any, read: bool, key: Any = None) -> tuple[int, int, None, Any]:
        if read or type(value) is not bytes:
            raise TypeError("cache values must be bytes")
        return 0, diskcache.core.MODE_RAW, None, sqlite3.Binary(value)

    def fetch(self, mode: int, filename: str | None, value: Any, read: bool) -> bytes:
        if mode != diskcache.core.MODE_RAW or filename is not None or read or not isinstance(value, bytes):
            raise CacheBackendError(f"refusing non-JSON cache entry (mode {mode})")
        return value

    def remove(self, file_path: str) -> None:
        """Never delete files: we create none, and a tampered row must not name one for us."""


class DiskCache(_BaseCache):
    """SQLite-backed cache (diskcache) in a private directory, shared by processes on one host.

    The database is opened lazily, at the first operation, in a dedicated worker thread: the
    constructor never touches the disk and never raises for a bad directory or a corrupt file.
    Instead, each operation raises :class:`CacheBackendError` while the directory is unusable or the
    database is corrupt, and opening is retried on the next operation (so deleting a corrupt file heals
    the cache without a restart).  All sqlite work happens in the worker thread, never on the loop.
    """

    name = "disk"

    def __init__(self, path: str, ttl: float | None, size_limit_mb: int, *, timeout: float = 1.0) -> None:
        super().__init__(ttl)
        self.path = os.path.abspath(os.path.expanduser(path))
        self._size_limit = max(1, size_limit_mb) * 1024 * 1024
        self._timeout = timeout  # sqlite busy timeout: a contended write fails after this instead of hanging
        self._dc: Any = None  # diskcache.Cache; only touched from the worker thread
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="ctxproxy-diskcache")
        self._closed = False

    # -- worker-thread side -------------------------------------------------------------------
    def _open(self) -> Any:
        path = self.path
        os.makedirs(path, mode=0o700, exist_ok=True)
        st = os.stat(path)
        if st.st_uid == os.geteuid():
            if stat.S_IMODE(st.st_mode) != 0o700:
                os.chmod(path, 0o700)
        elif st.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
            raise CacheBackendError(f"refusing cache directory {path}: not ours and writable by others")
        db = os.path.join(path, diskcache.core.DBNAME)
        # Create the database 0600 whatever the umask; sqlite gives -wal/-shm the same mode.
        os.close(os.open(db, os.O_RDWR | os.O_CREAT | getattr(os, "O_NOFOLLOW", 0), 0o600))
        for name in (db, db + "-wal", db + "-shm"):
            with contextlib.suppress(FileNotFoundError):
                fst = os.stat(name)
                if fst.st_uid == os.geteuid() and fst.st_mode & 0o077:
                    os.chmod(name, 0o600)
        return diskcache.Cache(
            path,
            timeout=self._timeout,
            disk=_JSONBytesDisk,
            size_limit=self._size_limit,
            eviction_policy="least-recently-stored",
            statistics=0,
            tag_index=0,
        )

    def _drop(self) -> None:
        dc, self._dc = self._dc, None
        if dc is not None:
            with contextlib.suppress(Exception):
                dc.close()

    def _call(self, fn: Callable[[Any], T]) -> T:
        try:
            if self._dc is None:
                self._dc = self._open()
            return fn(self._dc)
        except CacheBackendError:
            raise
        except Exception as exc:
            if isinstance(exc, (sqlite3.Error, OSError)):
                self._drop()  # reopen on the next call
            raise CacheBackendError(f"disk cache {self.path}: {type(exc).__name__}: {exc}") from exc

    # -- loop side ----------------------------------------------------------------------------
    async def _run(self, fn: Callable[[Any], T]) -> T:
        if self._closed:
            raise CacheBackendError("disk cache is closed")
        loop = asyncio.get_running_loop()
        return await self._guarded(loop.run_in_executor(self._executor, self._call, fn))

    async def get(self, key: str) -> dict[str, Any] | None:
        def op(dc: Any) -> dict[str, Any] | None:
            raw = dc.get(key)
            return None if raw is None else _loads(raw)

        return await self._run(op)

    async def set(self, key: str, value: dict[str, Any], ttl: float | None = None) -> None:
        data, expire = _dumps(value), self._ttl(ttl)
        await self._run(lambda dc: dc.set(key, data, expire=expire))

    async def _try_acquire(self, lock_key: str, token: str, ttl: float) -> bool:
        def op(dc: Any) -> bool:
            try:
                return bool(dc.add(lock_key, token.encode(), expire=ttl))  # atomic; takes over expired locks
            except diskcache.Timeout:  # database busy: not acquired this round
                return False

        return await self._run(op)

    async def _release(self, lock_key: str, token: str) -> None:
        def op(dc: Any) -> None:
            with dc.transact():
                if dc.get(lock_key) == token.encode():
                    dc.delete(lock_key)

        await self._run(op)

    async def ping(self) -> bool:
        try:
            await self._run(lambda dc: dc.get(_LOCK_PREFIX + "ping"))
        except CacheBackendError:
            return False
        return True

    async def close(self) -> None:
        if self._closed:
            return
        await self._drain()
        self._closed = True
        with contextlib.suppress(Exception):
            await asyncio.get_running_loop().run_in_executor(self._executor, self._drop)
        self._executor.shutdown(wait=False)


class RedisCache(_BaseCache):
    """Redis-backed cache shared by replicas; values are JSON strings under ``prefix``.

    Socket timeouts are short so a down Redis fails fast; the pool reconnects on the next call once
    Redis is back.  Commands run shielded to completion, so cancelling a caller never leaves a pooled
    connection with an unread reply.  ``max_connections`` bounds the pool (callers then wait for a
    free connection instead of failing).
    """

    name = "redis"

    def __init__(
        self,
        url: str,
        ttl: float | None,
        prefix: str = "ctxproxy:",
        *,
        max_connections: int | None = None,
        socket_timeout: float = 1.5,
        socket_connect_timeout: float = 1.0,
    ) -> None:
        super().__init__(ttl)
        self._prefix = prefix
        options: dict[str, Any] = {
            "socket_timeout": socket_timeout,
            "socket_connect_timeout": socket_connect_timeout,
            "retry": Retry(NoBackoff(), 1),  # one immediate retry: replaces a stale pooled connection
            "protocol": 2,  # RESP2: no HELLO, works with any Redis-compatible server or proxy
        }
        pool: aioredis.ConnectionPool
        if max_connections is None:
            pool = aioredis.ConnectionPool.from_url(url, **options)
        else:
            pool = aioredis.BlockingConnectionPool.from_url(
                url, max_connections=max_connections, timeout=5.0, **options
            )
        self._client = aioredis.Redis.from_pool(pool)
        self._execute: Callable[..., Awaitable[Any]] = self._client.execute_command

    async def _cmd(self, *args: Any) -> Any:
        try:
            return await self._guarded(self._execute(*args))
        except Exception as exc:
            raise CacheBackendError(f"redis {args[0]}: {type(exc).__name__}: {exc}") from exc

    @staticmethod
    def _ms(ttl: float) -> int:
        return max(1, round(ttl * 1000))

    async def get(self, key: str) -> dict[str, Any] | None:
        raw = await self._cmd("GET", self._prefix + key)
        return None if raw is None else _loads(raw)

    async def set(self, key: str, value: dict[str, Any], ttl: float | None = None) -> None:
        ttl = self._ttl(ttl)
        args: list[Any] = ["SET", self._prefix + key, _dumps(value)]
        if ttl is not None:
            args += ["PX", self._ms(ttl)]
        await self._cmd(*args)

    async def _try_acquire(self, lock_key: str, token: str, ttl: float) -> bool:
        return bool(await self._cmd("SET", self._prefix + lock_key, token, "NX", "PX", self._ms(ttl)))

    async def _release(self, lock_key: str, token: str) -> None:
        await self._cmd("EVAL", _RELEASE_LUA, 1, self._prefix + lock_key, token)

    async def ping(self) -> bool:
        try:
            return bool(await self._cmd("PING"))
        except CacheBackendError:
            return False

    async def close(self) -> None:
        await self._drain()
        await self._client.aclose()


_WRITES = frozenset({"set", "lock", "unlock"})


def _kind(operation: str) -> str:
    return "write" if operation in _WRITES else "read"


class SafeCache:
    """Wraps a backend so cache failures never fail a request.

    Every backend exception is swallowed: ``get`` -> None, ``set`` -> no-op, ``lock`` -> yields True
    (fail open: proceed without the cross-process lock), ``ping`` -> False.  Each failure is reported
    to ``on_error(operation, exc)``; a warning is logged once per error streak (again only after a
    success followed by a new failure).  A streak that began with a failed write (``set``/``lock``/``unlock``)
    is ended only by a write that works: a full disk still serves reads, and must not log on every request.
    ``asyncio.CancelledError`` is never swallowed.
    """

    def __init__(self, inner: Cache, on_error: ErrorHook | None = None) -> None:
        self.inner = inner
        self.name = inner.name
        self._on_error = on_error
        self._failing: str | None = None  # "read" or "write": the kind of operation that began the streak

    def _failed(self, operation: str, exc: BaseException) -> None:
        if self._on_error is not None:
            try:
                self._on_error(operation, exc)
            except Exception:
                log.exception("cache on_error hook failed")
        if self._failing is not None:
            log.debug("cache %s %s failed: %s", self.name, operation, exc)
            return
        self._failing = _kind(operation)
        log.warning(
            "cache backend %r: %s failed (%s: %s); continuing without cache "
            "(further errors are not logged until it recovers)",
            self.name,
            operation,
            type(exc).__name__,
            exc,
        )

    def _ok(self, operation: str) -> None:
        if self._failing is not None and self._failing == _kind(operation):
            self._failing = None
            log.info("cache backend %r recovered", self.name)

    async def get(self, key: str) -> dict[str, Any] | None:
        try:
            value = await self.inner.get(key)
        except Exception as exc:
            self._failed("get", exc)
            return None
        self._ok("get")
        return value

    async def set(self, key: str, value: dict[str, Any], ttl: float | None = None) -> None:
        try:
            await self.inner.set(key, value, ttl)
        except Exception as exc:
            self._failed("set", exc)
            return
        self._ok("set")

    def lock(self, key: str, ttl: float, wait: float) -> AbstractAsyncContextManager[bool]:
        return self._lock(key, ttl, wait)

    @asynccontextmanager
    async def _lock(self, key: str, ttl: float, wait: float) -> AsyncIterator[bool]:
        held: AbstractAsyncContextManager[bool] | None = None
        acquired = True  # fail open
        try:
            cm = self.inner.lock(key, ttl, wait)
            acquired = await cm.__aenter__()
            held = cm
        except Exception as exc:
            self._failed("lock", exc)
        else:
            self._ok("lock")
        try:
            yield acquired
        finally:
            if held is not None:
                try:
                    # The body's own exception (if any) keeps propagating; the inner lock only releases.
                    await held.__aexit__(None, None, None)
                except Exception as exc:
                    self._failed("unlock", exc)

    async def ping(self) -> bool:
        try:
            ok = await self.inner.ping()
        except Exception as exc:
            self._failed("ping", exc)
            return False
        if ok:
            self._ok("ping")
        return ok

    async def close(self) -> None:
        try:
            await self.inner.close()
        except Exception as exc:
            self._failed("close", exc)


def open_cache(
    backend: str,
    *,
    path: str,
    url: str | None,
    ttl: float | None,
    size_limit_mb: int,
    on_error: ErrorHook | None = None,
) -> SafeCache:
    """Build the configured backend wrapped in :class:`SafeCache`.

    Never does I/O: an unusable disk directory, a corrupt database or a down Redis surface later as
    swallowed errors (requests continue without caching).  Raises ValueError for a bad configuration
    (unknown backend, redis without url, malformed url).
    """
    inner: Cache
    if backend == "memory":
        inner = MemoryCache(ttl)
    elif backend == "disk":
        inner = DiskCache(path, ttl, size_limit_mb)
    elif backend == "redis":
        if not url:
            raise ValueError("cache backend 'redis' requires cache.url")
        inner = RedisCache(url, ttl)
    else:
        raise ValueError(f"unknown cache backend {backend!r} (expected 'disk', 'redis' or 'memory')")
    return SafeCache(inner, on_error)
