"""``deadline(seconds)``: a timeout around an await that does not spawn a task.

``asyncio.wait_for`` wraps its awaitable in a new task (tens of microseconds,
on every request and every relayed chunk); ``asyncio.timeout`` (Python 3.11+)
and ``async_timeout`` (its backport, an aiohttp dependency) only arm a timer.
Both raise ``asyncio.TimeoutError`` (``TimeoutError``) when the time is up.

Arming and cancelling that timer still costs some 6 µs (a timer handle in the loop's heap, then its
cancellation, and the scope's own bookkeeping): about 2 % of a small request each time. So a read whose
bytes have all arrived is made without one (the request body, an upstream answer), and the upstream
client times a request's head with a bare loop timer (``proxy.upstream.client``).
"""

from __future__ import annotations

import asyncio
import sys
from contextlib import AbstractAsyncContextManager
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

