"""``open_cache`` and ``open_ledger_store``: the configured cache backend, and where the cost ledger lives."""

from __future__ import annotations

from collections.abc import Callable

from proxy.settings import CacheSettings
from proxy.store.cache import Cache, ErrorHook, SafeCache
from proxy.store.disk import DiskCache
from proxy.store.guard import Guard
from proxy.store.ledger_store import DiskLedgerStore, LedgerStore, MemoryLedgerStore, RedisLedgerStore
from proxy.store.memory import MemoryCache
from proxy.store.redis import RedisCache


def open_cache(
    backend: str,
    *,
    path: str,
    url: str | None,
    ttl: float | None,
    size_limit_mb: int,
    on_error: ErrorHook | None = None,
    guard: Guard | None = None,
) -> SafeCache:
    """Build the configured backend wrapped in :class:`SafeCache`.

    Never does I/O: an unusable disk directory, a corrupt database or a down Redis surface later as
    swallowed errors (requests continue without caching). ``guard`` (the breaker and the request budget)
    watches the disk and Redis backends; its timeout is Redis's socket timeout. Raises ValueError for a bad
    configuration (unknown backend, redis without url, malformed url).
    """
    inner: Cache
    if backend == "memory":
        inner = MemoryCache(ttl)
    elif backend == "disk":
        inner = DiskCache(path, ttl, size_limit_mb, guard=guard)
    elif backend == "redis":
        if not url:
            raise ValueError("cache backend 'redis' requires cache.url")
        if guard is None:
            inner = RedisCache(url, ttl)
        else:
            inner = RedisCache(url, ttl, socket_timeout=guard.timeout, guard=guard)
    else:
        raise ValueError(f"unknown cache backend {backend!r} (expected 'disk', 'redis' or 'memory')")
    return SafeCache(inner, on_error)


def cache_guard(settings: CacheSettings, on_open: Callable[[], None] | None = None) -> Guard:
    """The breaker of the configured backend, with the configuration's timeout, threshold and cool-down."""
    return Guard(settings.backend, timeout=settings.timeout_seconds, threshold=settings.breaker_timeouts,
                 cooldown=settings.breaker_cooldown_seconds, on_open=on_open)


def open_ledger_store(settings: CacheSettings, *, create: bool) -> LedgerStore:
    """Where the cost ledger lives for this cache configuration (``proxy.store.ledger_store``).

    ``create``: the server, which writes it; ``ctxproxy report`` reads and never creates anything.
    Does no I/O.
    """
    if settings.backend == "disk":
        return DiskLedgerStore(settings.path, create=create)
    if settings.backend == "redis":
        if not settings.url:
            raise ValueError("cache backend 'redis' requires cache.url")
        return RedisLedgerStore(settings.url, timeout=settings.timeout_seconds)
    return MemoryLedgerStore()
