"""The in-process cache backend (tests, single-process deployments); its lock is process-local."""

from __future__ import annotations

import time
from typing import Any

from proxy.store.cache import BaseCache, dumps, loads


class MemoryCache(BaseCache):
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
        return loads(raw)

    async def set(self, key: str, value: dict[str, Any], ttl: float | None = None) -> None:
        ttl = self._ttl(ttl)
        raw = dumps(value)
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

    async def _renew(self, lock_key: str, token: str, ttl: float) -> None:
        current = self._locks.get(lock_key)
        if current is not None and current[0] == token:
            self._locks[lock_key] = (token, time.monotonic() + ttl)

    async def _release(self, lock_key: str, token: str) -> None:
        current = self._locks.get(lock_key)
        if current is not None and current[0] == token:
            del self._locks[lock_key]

    async def ping(self) -> bool:
        return True

    async def close(self) -> None:
        self._data.clear()
        self._locks.clear()
