"""``deadline(seconds)``: a timeout around an await that does not spawn a task.

``asyncio.wait_for`` wraps its awaitable in a new task (tens of microseconds,
on every request and every relayed chunk); ``asyncio.timeout`` (Python 3.11+)
and ``async_timeout`` (its backport, an aiohttp dependency) only arm a timer.
Both raise ``asyncio.TimeoutError`` (``TimeoutError``) when the time is up.
"""

from __future__ import annotations

import asyncio
import sys
from contextlib import AbstractAsyncContextManager
from typing import Any

if sys.version_info >= (3, 11):

    def deadline(seconds: float) -> AbstractAsyncContextManager[Any]:
        return asyncio.timeout(seconds)

else:  # pragma: no cover - Python 3.10
    import async_timeout

    def deadline(seconds: float) -> AbstractAsyncContextManager[Any]:
        return async_timeout.timeout(seconds)  # type: ignore[no-any-return]
