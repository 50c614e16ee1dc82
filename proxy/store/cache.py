"""The cache seam: an async JSON-object store with TTL and a renewable cross-process lock.

Backends: ``memory`` (``proxy.store.memory``), ``disk`` (SQLite through diskcache,
``proxy.store.disk``) and ``redis`` (``proxy.store.redis``). Every backend stores JSON
objects only (serialised with orjson; never pickle) and raises ``CacheBackendError``
on I/O failure; ``SafeCache`` (what ``proxy.store.backends.open_cache`` returns) turns every such failure
into "no cache" so requests keep flowing.

Cancellation: every backend operation runs to completion in its own task/thread even if the awaiting
coroutine is cancelled (``asyncio.shield``). A Redis connection is therefore never returned to the
pool with an unread reply (the redis-py #2624 class of bug), and a lock acquired by a call whose caller
was cancelled is released in the background instead of being leaked until its TTL.

A stalled backend: the disk and Redis backends run every I/O operation through their ``Guard``
(``proxy.store.guard``): a circuit breaker that bypasses a backend whose operations time out, and the
request's cache-time budget. A caller that stops waiting is treated as a cancelled one (above).
"""

from __future__ import annotations

import asyncio
import logging
import secrets
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import AbstractAsyncContextManager, asynccontextmanager
from typing import Any, Protocol, TypeVar

import orjson

from proxy.core.deadline import deadline
from proxy.core.errors import CacheBackendError
from proxy.store.guard import Guard

__all__ = ["Cache", "CacheBackendError", "LockHandle", "SafeCache"]

log = logging.getLogger("ctxproxy.cache")

T = TypeVar("T")
ErrorHook = Callable[[str, BaseException], None]
Ready = Callable[[], Awaitable[bool]]

LOCK_PREFIX = "__lock__:"  # lock keys live next to the values; callers' keys must not use this prefix
_POLL_INTERVAL = 0.025  # seconds between lock attempts while waiting
_DRAIN_TIMEOUT = 2.0  # close(): how long to let in-flight operations finish


class LockHandle:
    """A lock attempt's outcome: ``acquired``, and ``renew()`` to extend a held lock's expiry.

    ``failed_open``: the cache could not be asked, so ``acquired`` only means "go on without the lock"
    (``SafeCache``); nothing stops another process from doing the same work.
    """

    def __init__(self, acquired: bool, renew: Callable[[], Awaitable[None]] | None = None, *,
                 failed_open: bool = False, error: BaseException | None = None) -> None:
        self.acquired = acquired
        self.failed_open = failed_open
        self.error = error  # the cache error that ended the wait (the lock was held by another meanwhile)
        self._renew = renew

    async def renew(self) -> None:
        if self.acquired and self._renew is not None:
            await self._renew()


class Cache(Protocol):
    """Async key -> JSON-object store with TTL and a cross-process lock."""

    name: str
    """Backend name: ``"disk"``, ``"redis"`` or ``"memory"``."""

    read_answered: bool
    """Whether the last read returned what the backend holds (False: it failed, and ``SafeCache`` returned None for
    it): a None then says nothing about the key."""

    async def get(self, key: str) -> dict[str, Any] | None:
        """Return the stored object, or None when missing or expired."""
        ...

    async def get_many(self, keys: list[str], first_hit: bool = False) -> list[dict[str, Any] | None]:
        """``get`` for many keys in one round trip (one MGET, one disk call). ``first_hit``: the caller needs
        only the first record present, in key order; a backend may leave the keys after it unread (None)."""
        ...

    async def set(self, key: str, value: dict[str, Any], ttl: float | None = None) -> None:
        """Store ``value`` (a JSON object) for ``ttl`` seconds (None: the backend's default TTL)."""
        ...

    def lock(
        self, key: str, ttl: float, wait: float, ready: Ready | None = None
    ) -> AbstractAsyncContextManager[LockHandle]:
        """Cross-process mutual exclusion on ``key``.

        The lock expires after ``ttl`` seconds unless its holder renews it (``LockHandle.renew``),
        so a crashed holder cannot block forever. Waits up to ``wait`` seconds to acquire, and stops
        waiting early when ``ready()`` says the work the lock guards is done; the handle says whether
        it was acquired. Releasing only deletes the lock if this holder still owns it.
        """
        ...

    async def ping(self) -> bool:
        """True when the backend is usable (for /readyz)."""
        ...

    async def close(self) -> None:
        """Release connections, threads and file handles."""
        ...


def dumps(value: dict[str, Any]) -> bytes:
    if not isinstance(value, dict):
        raise CacheBackendError(f"cache values must be JSON objects, not {type(value).__name__}")
    try:
        return orjson.dumps(value)
    except TypeError as exc:  # orjson.JSONEncodeError
        raise CacheBackendError(f"cache value is not JSON-serialisable: {exc}") from exc


def loads_or_none(raw: bytes | str) -> dict[str, Any] | None:
    """``loads`` for one record of many: a corrupt one is missing, so it never hides the others."""
    try:
        return loads(raw)
    except CacheBackendError:
        return None


def loads(raw: bytes | str) -> dict[str, Any]:
    try:
        value = orjson.loads(raw)
    except orjson.JSONDecodeError as exc:
        raise CacheBackendError("corrupt cache entry (not JSON)") from exc
    if not isinstance(value, dict):
        raise CacheBackendError("corrupt cache entry (not a JSON object)")
    return value


class BaseCache:
    """Shared TTL default, cancellation guard and the polling, renewable lock."""

    name: str
    read_answered = True  # a read that fails raises

    def __init__(self, ttl: float | None, guard: Guard | None = None) -> None:
        self._default_ttl = ttl
        self._inflight: set[asyncio.Future[Any]] = set()
        self.guard = guard

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

    async def _io(self, start: Callable[[], Awaitable[T]], *, on_late: Callable[[T], None] | None = None,
                  essential: bool = False) -> T:
        """One backend I/O operation under the guard: refused at once while the breaker is open or the request's
        cache budget is spent; otherwise waited for within the budget, and watched by the breaker.

        ``on_late`` receives the result of an operation its caller stopped waiting for (to undo it);
        ``essential`` operations (releasing a lock) are issued even when the budget is spent.
        """
        guard = self.guard
        if guard is None:
            return await self._guarded(start(), on_late)
        wait = guard.admit(self._probe, essential)
        fut = asyncio.ensure_future(start())
        guard.watch(fut)
        loop = asyncio.get_running_loop()
        begun = loop.time()
        try:
            if wait is None:
                return await self._guarded(fut, on_late)
            async with deadline(wait):
                return await self._guarded(fut, on_late)
        except asyncio.TimeoutError:
            raise CacheBackendError(f"{self.name} cache: no answer within this request's cache time budget "
                                    "(the operation goes on in the background)") from None
        finally:
            guard.charge(loop.time() - begun)

    async def _probe(self) -> None:
        """The breaker's probe: one cheap operation, outside the guard."""
        raise NotImplementedError

    def _release_orphan(self, lock_key: str, token: str) -> Callable[[Any], None]:
        """Undo a lock acquired for a caller that is no longer there (cancelled, or out of budget)."""
        def undo(acquired: Any) -> None:
            if acquired:
                self._track(asyncio.ensure_future(self._release(lock_key, token)))

        return undo

    async def _drain(self) -> None:
        if self._inflight:
            await asyncio.wait(set(self._inflight), timeout=_DRAIN_TIMEOUT)
        if self.guard is not None:
            await self.guard.close()

    async def get(self, key: str) -> dict[str, Any] | None:
        raise NotImplementedError

    async def get_many(self, keys: list[str], first_hit: bool = False) -> list[dict[str, Any] | None]:
        out: list[dict[str, Any] | None] = [None] * len(keys)
        for i, key in enumerate(keys):
            out[i] = await self.get(key)
            if first_hit and out[i] is not None:
                break
        return out

    async def _try_acquire(self, lock_key: str, token: str, ttl: float) -> bool:
        raise NotImplementedError

    async def _renew(self, lock_key: str, token: str, ttl: float) -> None:
        raise NotImplementedError

    async def _release(self, lock_key: str, token: str) -> None:
        raise NotImplementedError

    def lock(
        self, key: str, ttl: float, wait: float, ready: Ready | None = None
    ) -> AbstractAsyncContextManager[LockHandle]:
        return self._lock(LOCK_PREFIX + key, ttl, wait, ready)

    @asynccontextmanager
    async def _lock(self, lock_key: str, ttl: float, wait: float, ready: Ready | None) -> AsyncIterator[LockHandle]:
        token = secrets.token_hex(16)
        loop = asyncio.get_running_loop()
        give_up = loop.time() + max(0.0, wait)
        release_orphan = self._release_orphan(lock_key, token)

        held_by_another = False
        error: CacheBackendError | None = None
        while True:
            try:
                acquired = await self._guarded(self._try_acquire(lock_key, token, ttl), release_orphan)
            except CacheBackendError as exc:
                if not held_by_another:
                    raise
                # the cache stopped answering while another holder had the lock: stop waiting, never take
                # it over (failing open here would let two processes do the guarded work at once)
                acquired, error = False, exc
                break
            held_by_another = not acquired
            remaining = give_up - loop.time()
            if acquired or remaining <= 0 or (ready is not None and await ready()):
                break
            await asyncio.sleep(min(_POLL_INTERVAL, remaining))

        async def renew() -> None:
            await self._guarded(self._renew(lock_key, token, ttl))

        try:
            yield LockHandle(acquired, renew, error=error)
        finally:
            if acquired:
                await self._guarded(self._release(lock_key, token))


_WRITES = frozenset({"set", "lock", "unlock", "renew"})


def _kind(operation: str) -> str:
    return "write" if operation in _WRITES else "read"


class SafeCache:
    """Wraps a backend so cache failures never fail a request.

    Every backend exception is swallowed: ``get`` -> None, ``set`` -> no-op, ``lock`` -> an acquired
    handle (fail open: proceed without the cross-process lock), ``ping`` -> False. Each failure is reported
    to ``on_error(operation, exc)``; a warning is logged once per error streak (again only after a
    success followed by a new failure). A streak that began with a failed write (``set``/``lock``/``unlock``)
    is ended only by a write that works: a full disk still serves reads, and must not log on every request.
    ``asyncio.CancelledError`` is never swallowed.
    """

    def __init__(self, inner: Cache, on_error: ErrorHook | None = None) -> None:
        self.inner = inner
        self.name = inner.name
        self._on_error = on_error
        self._failing: str | None = None  # "read" or "write": the kind of operation that began the streak
        self.read_answered = True

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
            self.read_answered = False
            self._failed("get", exc)
            return None
        self.read_answered = True
        self._ok("get")
        return value

    async def get_many(self, keys: list[str], first_hit: bool = False) -> list[dict[str, Any] | None]:
        try:
            values = await self.inner.get_many(keys, first_hit)
        except Exception as exc:
            self.read_answered = False
            self._failed("get", exc)
            return [None] * len(keys)
        self.read_answered = True
        self._ok("get")
        return values

    async def set(self, key: str, value: dict[str, Any], ttl: float | None = None) -> None:
        try:
            await self.inner.set(key, value, ttl)
        except Exception as exc:
            self._failed("set", exc)
            return
        self._ok("set")

    def lock(
        self, key: str, ttl: float, wait: float, ready: Ready | None = None
    ) -> AbstractAsyncContextManager[LockHandle]:
        return self._lock(key, ttl, wait, ready)

    @asynccontextmanager
    async def _lock(self, key: str, ttl: float, wait: float, ready: Ready | None) -> AsyncIterator[LockHandle]:
        held: AbstractAsyncContextManager[LockHandle] | None = None
        handle = LockHandle(True, failed_open=True)
        try:
            cm = self.inner.lock(key, ttl, wait, ready)
            inner = await cm.__aenter__()
            held = cm
        except Exception as exc:
            self._failed("lock", exc)
        else:
            if inner.error is not None:
                self._failed("lock", inner.error)
            else:
                self._ok("lock")
            handle = LockHandle(inner.acquired, self._renewer(inner))
        try:
            yield handle
        finally:
            if held is not None:
                try:
                    # The body's own exception (if any) keeps propagating; the inner lock only releases.
                    await held.__aexit__(None, None, None)
                except Exception as exc:
                    self._failed("unlock", exc)

    def _renewer(self, inner: LockHandle) -> Callable[[], Awaitable[None]]:
        async def renew() -> None:
            try:
                await inner.renew()
            except Exception as exc:
                self._failed("renew", exc)

        return renew

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
