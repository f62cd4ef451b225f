"""The manager's recent past for a page opened late: the cluster events of the last window and
periodic cluster samples, in bounded memory. Pure: every method takes the time it should use.

Memory is bounded twice: by age (nothing older than `window_s` before the newest time seen is
kept) and by count (`max_items` per ring, the oldest dropped first), so a storm of events
cannot grow it whatever the window.
"""

from __future__ import annotations

import collections
import dataclasses
import math
from collections.abc import Callable, Iterable
from typing import Generic, TypeVar

from blitzmesh.types import ClusterEvent

from .types import ClusterSnapshot, InstanceState

__all__ = ["ClusterSample", "History", "Ring", "cluster_sample"]

T = TypeVar("T")


class Ring(Generic[T]):
    """Items stamped with a time, oldest first: those within `window_s` of the newest time seen,
    at most `max_items`. Times must not go backwards (a later item stamped earlier is refused)."""

    def __init__(self, window_s: float, max_items: int) -> None:
        if not window_s > 0:
            raise ValueError(f"window_s must be > 0, got {window_s!r}")
        if max_items < 1:
            raise ValueError(f"max_items must be >= 1, got {max_items!r}")
        self.window_s = float(window_s)
        self._items: collections.deque[tuple[float, T]] = collections.deque(maxlen=max_items)

    def __len__(self) -> int:
        return len(self._items)

    @property
    def newest_s(self) -> float:
        return self._items[-1][0] if self._items else -math.inf

    def add(self, time_s: float, item: T) -> None:
        if time_s < self.newest_s:
            raise ValueError(f"item at time_s={time_s!r} is older than the newest one at {self.newest_s!r}")
        self._items.append((time_s, item))  # the deque's maxlen drops the oldest
        self.trim(time_s)

    def trim(self, now_s: float) -> None:
        """Drop the items older than the window ending at `now_s`."""
        horizon_s = now_s - self.window_s
        items = self._items
        while items and items[0][0] < horizon_s:
            items.popleft()

    def since(self, now_s: float, after_s: float = -math.inf) -> list[T]:
        """The items in the window ending at `now_s` stamped after `after_s`, oldest first."""
        self.trim(now_s)
        return [item for t, item in self._items if t > after_s]


@dataclasses.dataclass(frozen=True, slots=True)
class ClusterSample:
    """The cluster at one time: requests routed per second since the previous sample, the
    load monitor's window figures, and the instances by state."""

    time_s: float
    request_rate: float
    decode_tps: float
    ttft_p50_s: float | None
    ttft_p99_s: float | None
    tbt_p50_s: float | None
    tbt_p99_s: float | None
    states: dict[str, int]  # "serving" -> 2, as the dashboard names states


def cluster_sample(
    now_s: float, snapshot: ClusterSnapshot, states: Iterable[InstanceState], request_rate: float
) -> ClusterSample:
    """One sample from a whole-cluster snapshot of the load monitor. TTFT is the pool's that
    computes prompts (PREFILL when split, COLOCATED otherwise), TBT and throughput the pool's
    that produces tokens: the figures the policies read too."""
    prompts = snapshot.prefill if snapshot.disaggregated else snapshot.colocated
    tokens = snapshot.token_pool
    counts = {state.value.lower(): 0 for state in InstanceState}
    for state in states:
        counts[state.value.lower()] += 1
    return ClusterSample(
        time_s=now_s,
        request_rate=request_rate,
        decode_tps=tokens.decode_tps,
        ttft_p50_s=prompts.ttft_p50_s,
        ttft_p99_s=prompts.ttft_p99_s,
        tbt_p50_s=tokens.tbt_p50_s,
        tbt_p99_s=tokens.tbt_p99_s,
        states=counts,
    )


class History:
    """The events of the last `window_s` and a sample every `period_s` over the same window."""

    def __init__(self, window_s: float, period_s: float, max_events: int) -> None:
        if not period_s > 0:
            raise ValueError(f"period_s must be > 0, got {period_s!r}")
        if period_s > window_s:
            raise ValueError(f"period_s={period_s!r} is longer than window_s={window_s!r}")
        self.window_s = float(window_s)
        self.period_s = float(period_s)
        self.events: Ring[ClusterEvent] = Ring(window_s, max_events)
        # One more than the window holds, so a full window is there after a trim.
        self.samples: Ring[ClusterSample] = Ring(window_s, math.ceil(window_s / period_s) + 1)
        self._routed_total: float | None = None
        self._routed_at_s = -math.inf

    def record(self, event: ClusterEvent) -> None:
        # Events may be stamped by a caller slightly behind the newest (an action's own time):
        # they keep arrival order, at the newest time seen at the latest.
        self.events.add(max(event.time_s, self.events.newest_s), event)

    def due(self, now_s: float) -> bool:
        return now_s - self.samples.newest_s >= self.period_s

    def sample(
        self,
        now_s: float,
        routed_total: float,
        make: Callable[[float], ClusterSample],
    ) -> ClusterSample | None:
        """Add a sample if one is due: `make(request_rate)` builds it, with the rate of the
        routed-requests counter `routed_total` since the previous sample (0 for the first)."""
        if not self.due(now_s):
            return None
        previous, previous_s = self._routed_total, self._routed_at_s
        rate = 0.0
        if previous is not None and now_s > previous_s:
            rate = max(0.0, routed_total - previous) / (now_s - previous_s)
        self._routed_total, self._routed_at_s = routed_total, now_s
        sample = make(rate)
        self.samples.add(now_s, sample)
        return sample
