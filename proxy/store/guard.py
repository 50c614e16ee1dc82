"""What keeps a stalled cache from stalling requests: a circuit breaker, and a budget per request.

A cache that refuses connections fails in milliseconds; one that stalls (a stopped Redis, a hung
mount) makes every operation wait for its timeout, and a summarised request makes about six. So:

- **The breaker** (``Guard``, one per backend). An operation still unanswered after ``timeout`` has
  timed out. After ``threshold`` timeouts in a row the breaker opens: every operation fails at once
  (``SafeCache`` turns that into a miss, a no-op, a lock held open) for ``cooldown`` seconds. Then one
  probe runs in the background, never on a request's path: an answer within ``timeout`` closes the
  breaker; another timeout keeps it open for one more cool-down. Any answer within the timeout, even
  an error, ends a run of timeouts: fast failures (a refused connection, a full disk, a corrupt
  record) cost nothing and never open it.
- **The budget** (``cache_budget``, entered once per HTTP request by the error middleware). A request
  may wait on slow cache operations for ``budget_seconds`` in all; each operation's first
  ``FREE_SECONDS`` are free, so a request that polls a lock while another replica summarises spends
  none of it. Past the budget, its operations fail at once (the request goes on without the cache).
  An operation the request stopped waiting for still runs to its end in the background, and its
  outcome still counts for the breaker; a lock it acquires late is released.

The budget travels in a ``ContextVar``: each request's task (and the tasks it starts) sees its own
``RequestBudget``; nothing is shared between requests. A summary (which several requests may wait for) and a
background summary run with a budget of their own (``own_budget``), never the starting request's.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Awaitable, Callable, Iterator
from contextvars import ContextVar, Token
from dataclasses import dataclass
from typing import Any

from proxy.core.deadline import deadline
from proxy.core.errors import CacheBackendError

__all__ = ["FREE_SECONDS", "CacheBudget", "Guard", "RequestBudget", "cache_budget", "own_budget"]

log = logging.getLogger("ctxproxy.cache")

FREE_SECONDS = 0.05  # a healthy backend answers far faster; a lock polled for minutes costs no budget


@dataclass
class RequestBudget:
    """What one request may still wait on slow cache operations."""

    seconds: float
    spent: float = 0.0

    def left(self) -> float:
        return self.seconds - self.spent


_BUDGET: ContextVar[RequestBudget | None] = ContextVar("ctxproxy_cache_budget", default=None)


def cache_budget(seconds: float | None) -> CacheBudget:
    """The cache-time budget of the request running in this context (and of the tasks it starts); None: none."""
    return CacheBudget(seconds)


class CacheBudget:
    """``cache_budget``'s context (a class: every request enters one, and a generator's context costs more)."""

    __slots__ = ("_seconds", "_token")

    def __init__(self, seconds: float | None) -> None:
        self._seconds = seconds
        self._token: Token[RequestBudget | None] | None = None

    def __enter__(self) -> RequestBudget | None:
        if self._seconds is None:
            return None
        budget = RequestBudget(self._seconds)
        self._token = _BUDGET.set(budget)
        return budget

    def __exit__(self, *exc: object) -> None:
        if self._token is not None:
            _BUDGET.reset(self._token)
            self._token = None


@contextlib.contextmanager
def own_budget(seconds: float | None = None) -> Iterator[None]:
    """A budget of its own (``seconds``; None: as large as the request's) for work that outlives or serves more
    than the request that started it (a summary several requests wait for, a summary made in the background).
    Sharing the request's would let one spend the other's: a summary whose lock or record write is skipped for
    a spent budget is made a second time by another replica. A request that makes a summary may so wait on a
    slow cache for its own budget and the summary's."""
    budget = _BUDGET.get()
    if budget is None:
        yield
        return
    token = _BUDGET.set(RequestBudget(budget.seconds if seconds is None else seconds))
    try:
        yield
    finally:
        _BUDGET.reset(token)


Probe = Callable[[], Awaitable[Any]]


class Guard:
    """The circuit breaker of one cache backend, and the budget check of each operation."""

    def __init__(self, name: str, *, timeout: float, threshold: int, cooldown: float,
                 on_open: Callable[[], None] | None = None, clock: Callable[[], float] = time.monotonic) -> None:
        self.name = name
        self.timeout = timeout
        self.threshold = max(1, threshold)
        self.cooldown = cooldown
        self.on_open = on_open
        self.clock = clock
        self._timeouts = 0  # in a row
        self._open_until: float | None = None
        self._probe: asyncio.Task[None] | None = None
        self._counted: set[asyncio.Future[Any]] = set()  # operations already counted as timed out

    @property
    def is_open(self) -> bool:
        return self._open_until is not None

    def admit(self, probe: Probe, essential: bool = False) -> float | None:
        """Before an operation: how long its caller may wait for it (None: no budget, as long as it takes).

        Raises ``CacheBackendError`` at once while the breaker is open, or when this request's budget is
        spent, unless the operation is ``essential`` (a lock release: issued anyway, hardly waited for).
        """
        if self._open_until is not None:
            if self.clock() >= self._open_until and self._probe is None:
                self._probe = asyncio.ensure_future(self._run_probe(probe))
            raise CacheBackendError(f"{self.name} cache bypassed: {self.threshold} operation(s) timed out in a row "
                                    "(circuit breaker open)")
        budget = _BUDGET.get()
        if budget is None:
            return None
        left = budget.left()
        if left <= 0 and not essential:
            raise CacheBackendError(f"{self.name} cache skipped: this request's cache time budget "
                                    f"({budget.seconds:g} s) is spent")
        return max(0.0, left) + FREE_SECONDS

    def charge(self, waited: float) -> None:
        """Charge this request's budget for ``waited`` seconds of one operation (its first FREE_SECONDS free)."""
        budget = _BUDGET.get()
        if budget is not None and waited > FREE_SECONDS:
            budget.spent += waited - FREE_SECONDS

    def watch(self, fut: asyncio.Future[Any]) -> None:
        """Count ``fut`` as timed out if it has no outcome after ``timeout`` seconds, as answered otherwise."""
        loop = asyncio.get_running_loop()
        begun = loop.time()
        timer = loop.call_later(self.timeout, self._timed_out, fut)

        def done(f: asyncio.Future[Any]) -> None:
            timer.cancel()
            if f in self._counted:
                self._counted.discard(f)  # counted when its time was up; a late answer changes nothing
            elif loop.time() - begun >= self.timeout:
                self._timed_out(f)  # its own timeout (Redis's socket timeout) beat the timer
                self._counted.discard(f)
            else:
                self._timeouts = 0

        fut.add_done_callback(done)

    def _timed_out(self, fut: asyncio.Future[Any]) -> None:
        if fut in self._counted:
            return
        self._counted.add(fut)
        self._timeouts += 1
        if self._timeouts >= self.threshold and self._open_until is None:
            self._open_until = self.clock() + self.cooldown
            log.warning("cache backend %r: %d operation(s) timed out in a row (%g s each); bypassing it for %g s "
                        "(circuit breaker open), then probing it in the background",
                        self.name, self._timeouts, self.timeout, self.cooldown)
            if self.on_open is not None:
                try:
                    self.on_open()
                except Exception:
                    log.exception("cache breaker hook failed")

    async def _run_probe(self, probe: Probe) -> None:
        try:
            async with deadline(self.timeout):
                await probe()
            answered = True
        except asyncio.TimeoutError:
            answered = False
        except Exception:  # an error within the timeout: it no longer stalls (SafeCache handles its errors)
            answered = True
        finally:
            self._probe = None
        if answered:
            self._open_until = None
            self._timeouts = 0
            log.info("cache backend %r answers again: circuit breaker closed", self.name)
        else:
            self._open_until = self.clock() + self.cooldown

    async def close(self) -> None:
        probe, self._probe = self._probe, None
        if probe is not None:
            probe.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await probe
