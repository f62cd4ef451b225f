"""The simulator's clock: a heap of timestamped callbacks, run in (time, insertion) order.

Deterministic: ties at one time run in the order they were scheduled, and the only randomness
is `rng`, seeded by the caller. Nothing here reads the wall clock. The heap holds
(time, sequence, timer) tuples, compared in C; `stream` feeds a sorted series (a trace's
arrivals) one entry at a time under sequence numbers reserved up front, so millions of arrivals
run in the order they would as millions of timers without sitting in the heap at once.
"""

from __future__ import annotations

import heapq
import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

__all__ = ["EventLoop", "Timer"]


@dataclass(order=True, slots=True)
class Timer:
    """A scheduled callback; `cancel()` makes the loop skip it when its time comes."""

    at_s: float
    seq: int
    fn: Callable[[], None] = field(compare=False)
    cancelled: bool = field(default=False, compare=False)

    def cancel(self) -> None:
        self.cancelled = True


class EventLoop:
    """`now_s` only moves forward, to the time of the next event run."""

    def __init__(self, seed: int = 0) -> None:
        self.now_s = 0.0
        self.rng = random.Random(seed)
        self._heap: list[tuple[float, int, Timer]] = []
        self._seq = 0
        self.events_run = 0

    def at(self, at_s: float, fn: Callable[[], None]) -> Timer:
        """Run `fn` at `at_s` (never before now: a past time runs at once, after what is due)."""
        timer = Timer(max(at_s, self.now_s), self._seq, fn)
        self._seq += 1
        heapq.heappush(self._heap, (timer.at_s, timer.seq, timer))
        return timer

    def stream(self, times: Sequence[float], fn: Callable[[int], None]) -> None:
        """Run `fn(i)` at `times[i]` (sorted, none in the past) for every i, in the order that
        scheduling each with `at` now would give: the sequence numbers are taken now, and only
        the next entry is in the heap at any time."""
        first = self._seq
        self._seq += len(times)

        def fire(i: int) -> None:
            if i + 1 < len(times):
                nxt = Timer(times[i + 1], first + i + 1, lambda: fire(i + 1))
                heapq.heappush(self._heap, (nxt.at_s, nxt.seq, nxt))
            fn(i)

        if times:
            timer = Timer(max(times[0], self.now_s), first, lambda: fire(0))
            heapq.heappush(self._heap, (timer.at_s, timer.seq, timer))

    def after(self, delay_s: float, fn: Callable[[], None]) -> Timer:
        if delay_s < 0:
            raise ValueError(f"delay_s must be >= 0, got {delay_s!r}")
        return self.at(self.now_s + delay_s, fn)

    def every(self, period_s: float, fn: Callable[[], None], *, start_s: float = 0.0) -> None:
        """Run `fn` at start_s, start_s + period_s, ... for as long as the loop runs."""
        if not period_s > 0:
            raise ValueError(f"period_s must be > 0, got {period_s!r}")

        def tick(n: int = 0) -> None:
            fn()
            # Multiply, do not accumulate: 0.1 added 600 times drifts off the grid.
            self.at(start_s + (n + 1) * period_s, lambda: tick(n + 1))

        self.at(start_s, tick)

    def run(self, until_s: float, stop: Callable[[], bool] | None = None) -> None:
        """Run events up to `until_s` (inclusive), or until `stop()` is true after an event."""
        heap = self._heap
        while heap and heap[0][0] <= until_s:
            at_s, _, timer = heapq.heappop(heap)
            if timer.cancelled:
                continue
            self.now_s = at_s
            timer.fn()
            self.events_run += 1
            if stop is not None and stop():
                return
        self.now_s = max(self.now_s, until_s) if not heap or heap[0][0] > until_s else self.now_s
