"""Admission control: at most `max_concurrency` requests run, at most `max_queue` wait (FIFO).

A freed slot is handed straight to the oldest waiter, so a burst cannot starve early arrivals.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
from collections.abc import AsyncIterator, Callable

from services.gateway.errors import ErrorKind, GatewayError

# The `Retry-After` of a 429 for a full or slow queue: a slot frees whenever any request in flight
# ends, which the gateway cannot foresee; a second is a hint for a well-behaved client, not a promise.
QUEUE_RETRY_AFTER_S = 1.0


class Admission:
    def __init__(
        self,
        max_concurrency: int,
        max_queue: int,
        queue_timeout_s: float,
        on_change: Callable[[int, int], None] | None = None,
    ) -> None:
        self.max_concurrency = max_concurrency
        self.max_queue = max_queue
        self.queue_timeout_s = queue_timeout_s
        self._in_flight = 0
        self._waiters: collections.deque[asyncio.Future[None]] = collections.deque()
        self._on_change = on_change
        self._idle = asyncio.Event()
        self._idle.set()

    @property
    def in_flight(self) -> int:
        return self._in_flight

    @property
    def waiting(self) -> int:
        return len(self._waiters)

    async def wait_idle(self) -> None:
        """Return once nothing is in flight or waiting (used to drain before shutdown)."""
        await self._idle.wait()

    def _changed(self) -> None:
        if self._in_flight or self._waiters:
            self._idle.clear()
        else:
            self._idle.set()
        if self._on_change is not None:
            self._on_change(self._in_flight, len(self._waiters))

    @contextlib.asynccontextmanager
    async def slot(self) -> AsyncIterator[None]:
        """Hold one slot for the body; raises GatewayError(OVERLOADED) when none comes."""
        await self._acquire()
        try:
            yield
        finally:
            self._release()

    async def _acquire(self) -> None:
        if self._in_flight < self.max_concurrency and not self._waiters:
            self._in_flight += 1
            self._changed()
            return
        if len(self._waiters) >= self.max_queue:
            raise GatewayError(
                ErrorKind.OVERLOADED,
                f"server overloaded: {self._in_flight} requests in flight (max_concurrency={self.max_concurrency})"
                f" and {len(self._waiters)} waiting (max_queue={self.max_queue}); retry later",
                code="queue_full",
                retry_after_s=QUEUE_RETRY_AFTER_S,
            )
        fut: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._waiters.append(fut)
        self._changed()
        try:
            async with asyncio.timeout(self.queue_timeout_s):
                await fut
        except BaseException as e:
            if fut.done() and not fut.cancelled():
                # The slot was handed over just as we gave up (timeout or cancel): pass it on.
                self._release()
            else:
                fut.cancel()
                with contextlib.suppress(ValueError):
                    self._waiters.remove(fut)
                self._changed()
            if isinstance(e, TimeoutError):
                raise GatewayError(
                    ErrorKind.OVERLOADED,
                    f"no capacity within queue_timeout_s={self.queue_timeout_s}: {self._in_flight} requests in"
                    f" flight (max_concurrency={self.max_concurrency}), {len(self._waiters)} waiting; retry later",
                    code="queue_timeout",
                    retry_after_s=QUEUE_RETRY_AFTER_S,
                ) from None
            raise
        self._changed()

    def _release(self) -> None:
        while self._waiters:
            waiter = self._waiters.popleft()
            if not waiter.done():
                waiter.set_result(None)  # the slot moves to the waiter; in_flight stays the same
                self._changed()
                return
        self._in_flight -= 1
        self._changed()
