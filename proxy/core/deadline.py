"""``deadline(seconds)``: a timeout around an await that does not spawn a task.

``asyncio.wait_for`` wraps its awaitable in a new task (tens of microseconds,
on every request and every relayed chunk); ``asyncio.timeout`` (Python 3.11+)
and ``async_timeout`` (its backport, an aiohttp dependency) only arm a timer.
Both raise ``asyncio.TimeoutError`` (``TimeoutError``) when the time is up.

Arming and cancelling that timer still costs some 6 µs (a timer handle in the loop's heap, then its
cancellation): about 1 % of a small request each time. ``deadline_unless(done, seconds)`` arms none
when the awaited read cannot wait (``done``: what it reads has all arrived).
"""

from __future__ import annotations

import asyncio
import sys
from contextlib import AbstractAsyncContextManager, nullcontext
from typing import Any

if sys.version_info >= (3, 11):

    def deadline(seconds: float) -> AbstractAsyncContextManager[Any]:
        return asyncio.timeout(seconds)

    def deadline_at(when: float) -> AbstractAsyncContextManager[Any]:
        """``deadline`` at the loop's time ``when``."""
        return asyncio.timeout_at(when)

else:  # pragma: no cover - Python 3.10
    import async_timeout

    def deadline(seconds: float) -> AbstractAsyncContextManager[Any]:
        return async_timeout.timeout(seconds)  # type: ignore[no-any-return]

    def deadline_at(when: float) -> AbstractAsyncContextManager[Any]:
        return async_timeout.timeout_at(when)  # type: ignore[no-any-return]


def deadline_unless(done: bool, seconds: float) -> AbstractAsyncContextManager[Any]:
    """``deadline(seconds)``, or nothing when ``done`` (the read it guards has nothing left to wait for)."""
    return nullcontext() if done else deadline(seconds)
