"""``open_cache`` and ``open_ledger_store``: the configured cache backend, and where the cost ledger lives."""

from __future__ import annotations

from proxy.settings import CacheSettings
from proxy.store.cache import Cache, ErrorHook, SafeCache
from proxy.store.disk import DiskCache
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
) -> SafeCache:
    """Build the configured backend wrapped in :class:`SafeCache`.

    Never does I/O: an unusable disk directory, a corrupt database or a down Redis surface later as
    swallowed errors (requests continue without caching). Raises ValueError for a bad configuration
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
