"""services.common.waiting: bounded waits that never swallow a cancellation."""

from __future__ import annotations

import asyncio

import pytest

from services.common.waiting import wait_for, wait_until


async def test_wait_for_keeps_a_cancellation_that_lands_as_the_awaited_thing_completes() -> None:
    """The race that kept an ESP holder serving after its call was cancelled: the future completes
    and the task is cancelled in the same loop iteration. asyncio.wait_for on 3.11 returns the
    result there; ours raises CancelledError."""
    loop = asyncio.get_running_loop()
    fut: asyncio.Future[int] = loop.create_future()
    task = asyncio.ensure_future(wait_for(fut, 10))
    await asyncio.sleep(0)  # the task is now awaiting the future
    fut.set_result(1)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task


async def test_wait_for_returns_the_result_and_times_out() -> None:
    async def later(value: int) -> int:
        await asyncio.sleep(0.01)
        return value

    assert await wait_for(later(7), 5) == 7
    assert await wait_for(later(8), None) == 8
    never: asyncio.Future[None] = asyncio.get_running_loop().create_future()
    with pytest.raises(TimeoutError):
        await wait_for(never, 0.05)
    assert never.cancelled()  # the awaited future is cancelled on timeout, as asyncio.wait_for does


async def test_wait_until_names_what_it_waited_for() -> None:
    with pytest.raises(TimeoutError, match="the flag"):
        await wait_until(lambda: False, 0.05, what="the flag")
    with pytest.raises(ValueError, match="timeout_s > 0"):
        await wait_until(lambda: True, 0)
