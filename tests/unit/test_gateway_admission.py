"""Admission control of the gateway: concurrency bound, FIFO queue, 429 on a full queue or a
timeout, and no slot leaked when a waiter gives up."""

from __future__ import annotations

import asyncio

import pytest

from services.gateway.admission import Admission
from services.gateway.errors import ErrorKind, GatewayError

pytestmark = [pytest.mark.timeout(10), pytest.mark.filterwarnings("error")]


async def hold(admission: Admission, release: asyncio.Event, order: list[int], tag: int) -> None:
    async with admission.slot():
        order.append(tag)
        await release.wait()


async def settle() -> None:
    for _ in range(5):
        await asyncio.sleep(0)


async def test_runs_up_to_max_concurrency_then_queues_fifo() -> None:
    seen: list[tuple[int, int]] = []
    admission = Admission(2, 10, 5.0, on_change=lambda f, w: seen.append((f, w)))
    release = asyncio.Event()
    order: list[int] = []
    tasks = [asyncio.create_task(hold(admission, release, order, i)) for i in range(5)]
    await settle()
    assert (admission.in_flight, admission.waiting) == (2, 3)
    assert order == [0, 1]
    release.set()
    await asyncio.gather(*tasks)
    assert order == [0, 1, 2, 3, 4]
    assert (admission.in_flight, admission.waiting) == (0, 0)
    assert seen[-1] == (0, 0) and max(w for _, w in seen) == 3


async def test_full_queue_is_429_quoting_the_limits() -> None:
    admission = Admission(1, 1, 5.0)
    release = asyncio.Event()
    tasks = [asyncio.create_task(hold(admission, release, [], i)) for i in range(2)]
    await settle()
    with pytest.raises(GatewayError) as err:
        async with admission.slot():
            pass
    assert err.value.kind is ErrorKind.OVERLOADED and err.value.kind.http_status == 429
    assert "max_queue=1" in err.value.message and "max_concurrency=1" in err.value.message
    release.set()
    await asyncio.gather(*tasks)


async def test_zero_queue_refuses_at_once() -> None:
    admission = Admission(1, 0, 5.0)
    release = asyncio.Event()
    task = asyncio.create_task(hold(admission, release, [], 0))
    await settle()
    with pytest.raises(GatewayError, match="max_queue=0"):
        async with admission.slot():
            pass
    release.set()
    await task


async def test_queue_timeout_is_429_and_leaves_the_queue() -> None:
    admission = Admission(1, 5, 0.05)
    release = asyncio.Event()
    task = asyncio.create_task(hold(admission, release, [], 0))
    await settle()
    with pytest.raises(GatewayError) as err:
        async with admission.slot():
            pass
    assert err.value.kind is ErrorKind.OVERLOADED and "queue_timeout_s=0.05" in err.value.message
    assert admission.waiting == 0
    release.set()
    await task
    assert admission.in_flight == 0


async def test_cancelled_waiter_leaks_no_slot() -> None:
    admission = Admission(1, 5, 5.0)
    release = asyncio.Event()
    holder = asyncio.create_task(hold(admission, release, [], 0))
    await settle()
    waiter = asyncio.create_task(hold(admission, release, [], 1))
    await settle()
    assert admission.waiting == 1
    waiter.cancel()
    await asyncio.gather(waiter, return_exceptions=True)
    assert admission.waiting == 0
    release.set()
    await holder
    assert admission.in_flight == 0


async def test_slot_handed_over_as_the_waiter_is_cancelled_is_passed_on() -> None:
    admission = Admission(1, 5, 5.0)
    release = asyncio.Event()
    order: list[int] = []
    first = asyncio.create_task(hold(admission, asyncio.Event(), order, 0))
    await settle()
    second = asyncio.create_task(hold(admission, release, order, 1))
    third = asyncio.create_task(hold(admission, release, order, 2))
    await settle()
    # The slot moves to `second`, which is cancelled before it can run: `third` must get it.
    first.cancel()
    await asyncio.sleep(0)
    second.cancel()
    await asyncio.gather(first, second, return_exceptions=True)
    await settle()
    assert order == [0, 2]
    release.set()
    await third
    assert (admission.in_flight, admission.waiting) == (0, 0)


async def test_wait_idle_returns_when_the_last_request_leaves() -> None:
    admission = Admission(1, 5, 5.0)
    await asyncio.wait_for(admission.wait_idle(), 1)  # idle from the start
    release = asyncio.Event()
    tasks = [asyncio.create_task(hold(admission, release, [], i)) for i in range(2)]
    await settle()
    idle = asyncio.create_task(admission.wait_idle())
    await settle()
    assert not idle.done()
    release.set()
    await asyncio.gather(*tasks)
    await asyncio.wait_for(idle, 1)
