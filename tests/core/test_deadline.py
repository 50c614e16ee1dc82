"""``deadline`` and ``deadline_at``: a timer around an await."""

from __future__ import annotations

import asyncio

import pytest

from proxy.core.deadline import deadline, deadline_at


async def test_a_deadline_times_out_a_wait_that_is_too_long() -> None:
    with pytest.raises(asyncio.TimeoutError):
        async with deadline(0.05):
            await asyncio.sleep(5)


async def test_a_deadline_at_a_time_of_the_loop() -> None:
    loop = asyncio.get_running_loop()
    with pytest.raises(asyncio.TimeoutError):
        async with deadline_at(loop.time() + 0.05):
            await asyncio.sleep(5)
    async with deadline_at(loop.time() + 5):
        await asyncio.sleep(0.01)
