"""``deadline`` and ``deadline_unless``: a timer around an await, and none where the await cannot wait."""

from __future__ import annotations

import asyncio

import pytest

from proxy.core.deadline import deadline, deadline_unless


async def test_a_deadline_times_out_a_wait_that_is_too_long() -> None:
    with pytest.raises(asyncio.TimeoutError):
        async with deadline(0.05):
            await asyncio.sleep(5)


async def test_deadline_unless_arms_the_timer_while_something_may_wait() -> None:
    with pytest.raises(asyncio.TimeoutError):
        async with deadline_unless(False, 0.05):
            await asyncio.sleep(5)


async def test_deadline_unless_arms_no_timer_when_nothing_is_left_to_wait_for() -> None:
    loop = asyncio.get_running_loop()
    before = len(loop._scheduled)  # type: ignore[attr-defined]
    async with deadline_unless(True, 0.0):  # a zero deadline would time out at the first await
        assert len(loop._scheduled) == before  # type: ignore[attr-defined]
        await asyncio.sleep(0)
    async with deadline_unless(False, 30):
        assert len(loop._scheduled) == before + 1  # type: ignore[attr-defined]
