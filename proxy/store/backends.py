"""``open_cache``: the configured cache backend, wrapped so its failures never fail a request."""

from __future__ import annotations

from proxy.store.cache import Cache, ErrorHook, SafeCache
from proxy.store.disk import DiskCache
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
