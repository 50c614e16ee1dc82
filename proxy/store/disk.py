"""The disk cache backend: SQLite through diskcache, JSON only (never pickle), in a private directory."""

from __future__ import annotations

import asyncio
import contextlib
import os
import sqlite3
import stat
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

import diskcache

from proxy.core.errors import CacheBackendError
from proxy.store.cache import LOCK_PREFIX, BaseCache, dumps, loads, loads_or_none
from proxy.store.guard import Guard

T = TypeVar("T")


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


class DiskCache(BaseCache):
    """SQLite-backed cache (diskcache) in a private directory, shared by processes on one host.

    The database is opened lazily, at the first operation, in a dedicated worker thread: the
    constructor never touches the disk and never raises for a bad directory or a corrupt file.
    Instead, each operation raises :class:`CacheBackendError` while the directory is unusable or the
    database is corrupt, and opening is retried on the next operation (so deleting a corrupt file heals
    the cache without a restart).  All sqlite work happens in the worker thread, never on the loop.
    """

    name = "disk"

    def __init__(self, path: str, ttl: float | None, size_limit_mb: int, *, timeout: float = 1.0,
                 guard: Guard | None = None) -> None:
        super().__init__(ttl, guard)
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
    async def _run(self, fn: Callable[[Any], T], *, on_late: Callable[[T], None] | None = None,
                   essential: bool = False) -> T:
        if self._closed:
            raise CacheBackendError("disk cache is closed")
        loop = asyncio.get_running_loop()
        return await self._io(lambda: loop.run_in_executor(self._executor, self._call, fn), on_late=on_late,
                              essential=essential)

    async def _probe(self) -> None:
        loop = asyncio.get_running_loop()
        await self._guarded(loop.run_in_executor(self._executor, self._call, lambda dc: dc.get(LOCK_PREFIX + "ping")))

    async def get(self, key: str) -> dict[str, Any] | None:
        def op(dc: Any) -> dict[str, Any] | None:
            raw = dc.get(key)
            return None if raw is None else loads(raw)

        return await self._run(op)

    async def set(self, key: str, value: dict[str, Any], ttl: float | None = None) -> None:
        data, expire = dumps(value), self._ttl(ttl)
        await self._run(lambda dc: dc.set(key, data, expire=expire))

    async def _try_acquire(self, lock_key: str, token: str, ttl: float) -> bool:
        def op(dc: Any) -> bool:
            try:
                return bool(dc.add(lock_key, token.encode(), expire=ttl))  # atomic; takes over expired locks
            except diskcache.Timeout:  # database busy: not acquired this round
                return False

        return await self._run(op, on_late=self._release_orphan(lock_key, token))

    async def get_many(self, keys: list[str], first_hit: bool = False) -> list[dict[str, Any] | None]:
        def op(dc: Any) -> list[dict[str, Any] | None]:
            out: list[dict[str, Any] | None] = [None] * len(keys)
            for i, key in enumerate(keys):  # one SQLite read per key: stop at the first hit when that is all
                raw = dc.get(key)
                if raw is not None:
                    out[i] = loads_or_none(raw)
                    if first_hit and out[i] is not None:
                        break
            return out

        return await self._run(op)

    async def _renew(self, lock_key: str, token: str, ttl: float) -> None:
        def op(dc: Any) -> None:
            with dc.transact():
                if dc.get(lock_key) == token.encode():
                    dc.set(lock_key, token.encode(), expire=ttl)

        await self._run(op, essential=True)

    async def _release(self, lock_key: str, token: str) -> None:
        def op(dc: Any) -> None:
            with dc.transact():
                if dc.get(lock_key) == token.encode():
                    dc.delete(lock_key)

        await self._run(op, essential=True)

    async def ping(self) -> bool:
        try:
            await self._run(lambda dc: dc.get(LOCK_PREFIX + "ping"))
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
