"""A bounded wait for a condition: poll a predicate until it holds or a deadline passes.

For the places that have no event to wait on (another process's state seen over gRPC, a counter
in an engine): the wait is always bounded, and a timeout says what was awaited.
"""

from __future__ import annotations

import asyncio
import inspect
from collections.abc import Awaitable, Callable
from typing import TypeVar

T = TypeVar("T")


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
