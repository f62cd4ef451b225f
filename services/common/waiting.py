"""Bounded waits.

`wait_until` polls a predicate until it holds or a deadline passes, for the places that have no
event to wait on (another process's state seen over gRPC, a counter in an engine): the wait is
always bounded, and a timeout says what was awaited.

`wait_for` is `asyncio.wait_for` without its Python 3.11 race: there, a task cancelled in the same
loop iteration as the awaited thing completes returns the result and drops the cancellation. An
ESP holder whose gRPC call was cancelled kept serving its master that way (a fast decode step made
the window common). Every wait with a timeout in the services goes through this one.
"""

from __future__ import annotations

import asyncio
import inspect
from collections.abc import Awaitable, Callable
from typing import TypeVar

T = TypeVar("T")


async def wait_for(aw: Awaitable[T], timeout_s: float | None) -> T:
    """Await `aw` for at most `timeout_s` seconds (None: no bound); TimeoutError past it. A
    cancellation from outside always propagates, even when `aw` has just completed."""
    async with asyncio.timeout(timeout_s):
        return await aw


async def wait_until(
    predicate: Callable[[], T | Awaitable[T]],
    timeout_s: float,
    *,
    interval_s: float = 0.01,
    what: str = "condition",
) -> T:
    """Return the predicate's first truthy value; raise TimeoutError naming `what` after `timeout_s`."""
    if timeout_s <= 0 or interval_s <= 0:
        raise ValueError(f"wait_until needs timeout_s > 0 and interval_s > 0, got {timeout_s!r}, {interval_s!r}")
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    while True:
        value = predicate()
        if inspect.isawaitable(value):
            value = await value
        if value:
            return value
        if loop.time() >= deadline:
            raise TimeoutError(f"waited {timeout_s} s for {what}")
        await asyncio.sleep(interval_s)
