"""The Redis cache backend: shared by replicas; values are JSON strings under a key prefix."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

import redis.asyncio as aioredis
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff
from redis.exceptions import ConnectionError as RedisConnectionError

from proxy.core.errors import CacheBackendError
from proxy.store.cache import BaseCache, dumps, loads, loads_or_none
from proxy.store.guard import Guard

# compare-and-delete / compare-and-extend, so a holder whose lock expired cannot touch someone else's lock
_RELEASE_LUA = "if redis.call('get', KEYS[1]) == ARGV[1] then return redis.call('del', KEYS[1]) else return 0 end"
_RENEW_LUA = ("if redis.call('get', KEYS[1]) == ARGV[1] then return redis.call('pexpire', KEYS[1], ARGV[2]) "
              "else return 0 end")


class RedisCache(BaseCache):
    """Redis-backed cache shared by replicas; values are JSON strings under ``prefix``.

    Socket timeouts are short so a down Redis fails fast; the pool reconnects on the next call once
    Redis is back. A broken pooled connection is retried once at once; a timeout is not (a stalled
    Redis would only be waited for twice): it goes to the guard's breaker instead. Commands run shielded
    to completion, so cancelling a caller never leaves a pooled connection with an unread reply.
    ``max_connections`` bounds the pool (callers then wait for a free connection instead of failing).
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
        guard: Guard | None = None,
    ) -> None:
        super().__init__(ttl, guard)
        self._prefix = prefix
        options: dict[str, Any] = {
            "socket_timeout": socket_timeout,
            "socket_connect_timeout": min(socket_connect_timeout, socket_timeout),
            # one immediate retry of a broken connection: replaces a stale pooled one
            "retry": Retry(NoBackoff(), 1, supported_errors=(RedisConnectionError,)),
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

    async def _cmd(self, *args: Any, on_late: Callable[[Any], None] | None = None, essential: bool = False) -> Any:
        try:
            return await self._io(lambda: self._execute(*args), on_late=on_late, essential=essential)
        except CacheBackendError:
            raise
        except Exception as exc:
            raise CacheBackendError(f"redis {args[0]}: {type(exc).__name__}: {exc}") from exc

    async def _probe(self) -> None:
        await self._guarded(self._execute("PING"))

    @staticmethod
    def _ms(ttl: float) -> int:
        return max(1, round(ttl * 1000))

    async def get(self, key: str) -> dict[str, Any] | None:
        raw = await self._cmd("GET", self._prefix + key)
        return None if raw is None else loads(raw)

    async def set(self, key: str, value: dict[str, Any], ttl: float | None = None) -> None:
        ttl = self._ttl(ttl)
        args: list[Any] = ["SET", self._prefix + key, dumps(value)]
        if ttl is not None:
            args += ["PX", self._ms(ttl)]
        await self._cmd(*args)

    async def _try_acquire(self, lock_key: str, token: str, ttl: float) -> bool:
        return bool(await self._cmd("SET", self._prefix + lock_key, token, "NX", "PX", self._ms(ttl),
                                    on_late=self._release_orphan(lock_key, token)))

    async def get_many(self, keys: list[str], first_hit: bool = False) -> list[dict[str, Any] | None]:
        if not keys:
            return []
        raws = await self._cmd("MGET", *[self._prefix + key for key in keys])
        return [None if raw is None else loads_or_none(raw) for raw in raws]

    async def _renew(self, lock_key: str, token: str, ttl: float) -> None:
        await self._cmd("EVAL", _RENEW_LUA, 1, self._prefix + lock_key, token, self._ms(ttl), essential=True)

    async def _release(self, lock_key: str, token: str) -> None:
        await self._cmd("EVAL", _RELEASE_LUA, 1, self._prefix + lock_key, token, essential=True)

    async def ping(self) -> bool:
        try:
            return bool(await self._cmd("PING"))
        except CacheBackendError:
            return False

    async def close(self) -> None:
        await self._drain()
        await self._client.aclose()
