"""Folds worker heartbeats into per-pool sliding windows and notices workers that went silent.

Window math (exact, so tests can pin it): a snapshot at `now_s` sees the samples with
`now_s - window_s < sample.now_s <= now_s`.
- Rates and gauges (decode/prefill TPS, running, waiting, waiting prefill tokens, KV blocks):
  mean over each instance's samples in the window, then summed over the pool. An instance with
  no sample in the window adds nothing (and is not counted in `instances_reporting`).
- Latencies (TTFT, TBT, p50 and p99): nearest-rank quantile over every sample of the pool in the
  window, taking each sample's p50 for the pool p50 and each sample's p99 for the pool p99.
  Nearest rank: the k-th smallest value with k = ceil(q * n). Heartbeats carry percentiles, not
  raw latencies, so this is the usual approximation; merging exactly would need histograms.

Samples must arrive in time order per instance (the adapter stamps them with the manager's
clock on receipt). Memory is bounded: each instance keeps at most one window of samples.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Iterable

import numpy as np

from .types import ClusterSnapshot, InstanceState, InstanceView, LoadSample, PoolSnapshot, Role

__all__ = ["LoadMonitor", "nearest_rank"]

# Fields averaged per instance then summed per pool, in the order of _InstanceWindow.sums.
_MEAN_FIELDS = ("decode_tps", "prefill_tps", "running", "waiting", "waiting_prefill_tokens",
                "kv_blocks_used", "kv_blocks_total")
_LATENCY_FIELDS = ("ttft_p50_s", "ttft_p99_s", "tbt_p50_s", "tbt_p99_s")
_LOAD_STATES = frozenset({InstanceState.SERVING, InstanceState.LOADING, InstanceState.DRAINING})


def nearest_rank(values: list[float], q: float) -> float | None:
    """The k-th smallest of `values` with k = ceil(q * n), clamped to [1, n]; None if empty."""
    n = len(values)
    if n == 0:
        return None
    # The epsilon keeps q*n = 99.00000000000001 from pushing the rank past an exact integer.
    k = min(n, max(1, math.ceil(q * n - 1e-9)))
    if n <= 32:
        return sorted(values)[k - 1]
    # np.partition is O(n); sorting 30k floats per metric per tick would blow the 10 ms budget.
    arr = np.fromiter(values, dtype=np.float64, count=n)
    return float(np.partition(arr, k - 1)[k - 1])


class _LatencySeries:
    """Timestamps and values of one latency metric of one instance, skipping 'no observation'."""

    __slots__ = ("times_s", "values")

    def __init__(self) -> None:
        self.times_s: deque[float] = deque()
        self.values: deque[float] = deque()

    def evict(self, horizon_s: float) -> None:
        times_s, values = self.times_s, self.values
        while times_s and times_s[0] <= horizon_s:
            times_s.popleft()
            values.popleft()


class _InstanceWindow:
    """One instance's samples in the window, with running sums so a snapshot is O(instances)."""

    __slots__ = ("samples", "sums", "evicted_since_resync", "last_seen_s", "latency")

    def __init__(self) -> None:
        self.samples: deque[LoadSample] = deque()
        self.sums = [0.0] * len(_MEAN_FIELDS)
        self.evicted_since_resync = 0
        self.last_seen_s = -math.inf
        self.latency = tuple(_LatencySeries() for _ in _LATENCY_FIELDS)

    def append(self, sample: LoadSample) -> None:
        self.samples.append(sample)
        sums = self.sums
        sums[0] += sample.decode_tps
        sums[1] += sample.prefill_tps
        sums[2] += sample.running
        sums[3] += sample.waiting
        sums[4] += sample.waiting_prefill_tokens
        sums[5] += sample.kv_blocks_used
        sums[6] += sample.kv_blocks_total
        for series, name in zip(self.latency, _LATENCY_FIELDS):
            value = getattr(sample, name)
            if value is not None:
                series.times_s.append(sample.now_s)
                series.values.append(value)

    def evict(self, horizon_s: float) -> None:
        samples = self.samples
        if not samples or samples[0].now_s > horizon_s:
            return
        sums = self.sums
        while samples and samples[0].now_s <= horizon_s:
            old = samples.popleft()
            sums[0] -= old.decode_tps
            sums[1] -= old.prefill_tps
            sums[2] -= old.running
            sums[3] -= old.waiting
            sums[4] -= old.waiting_prefill_tokens
            sums[5] -= old.kv_blocks_used
            sums[6] -= old.kv_blocks_total
            self.evicted_since_resync += 1
        for series in self.latency:
            series.evict(horizon_s)
        # Subtracting floats drifts; recomputing once per window turnover keeps the sums exact
        # to rounding at amortised O(1) per sample.
        if not samples or self.evicted_since_resync >= len(samples):
            self.resync()

    def resync(self) -> None:
        self.sums = [float(math.fsum(getattr(s, name) for s in self.samples)) for name in _MEAN_FIELDS]
        self.evicted_since_resync = 0


class LoadMonitor:
    """Sliding-window view of heartbeats. Pure: every method takes the time it should use."""

    def __init__(self, window_s: float, lost_after_s: float) -> None:
        if not window_s > 0:
            raise ValueError(f"window_s must be > 0, got {window_s!r}")
        if not lost_after_s > 0:
            raise ValueError(f"lost_after_s must be > 0, got {lost_after_s!r}")
        self.window_s = float(window_s)
        self.lost_after_s = float(lost_after_s)
        self._windows: dict[str, _InstanceWindow] = {}
        self._last_snapshot_s = -math.inf

    # -- input -------------------------------------------------------------------------------

    def observe(self, sample: LoadSample) -> None:
        """Add one heartbeat. Raises ValueError if it is older than the instance's previous one."""
        window = self._windows.get(sample.instance_id)
        if window is None:
            window = self._windows[sample.instance_id] = _InstanceWindow()
        elif window.samples and sample.now_s < window.samples[-1].now_s:
            raise ValueError(
                f"heartbeat of instance {sample.instance_id!r} at now_s={sample.now_s!r} is older than "
                f"its previous one at now_s={window.samples[-1].now_s!r}; samples must arrive in time order"
            )
        window.append(sample)
        window.last_seen_s = max(window.last_seen_s, sample.now_s)
        # Evicting here too bounds memory for instances no snapshot asks about.
        window.evict(sample.now_s - self.window_s)

    def mark_seen(self, instance_id: str, now_s: float) -> None:
        """Start (or restart) an instance's silence clock without a sample, e.g. on registration."""
        window = self._windows.get(instance_id)
        if window is None:
            window = self._windows[instance_id] = _InstanceWindow()
        window.last_seen_s = max(window.last_seen_s, now_s)

    def forget(self, instance_id: str) -> None:
        """Drop everything about an instance (after it is marked LOST or removed)."""
        self._windows.pop(instance_id, None)

    # -- output ------------------------------------------------------------------------------

    def last_seen_s(self, instance_id: str) -> float | None:
        window = self._windows.get(instance_id)
        return None if window is None else window.last_seen_s

    def lost(self, now_s: float) -> list[str]:
        """Instances silent for longer than `lost_after_s`, sorted; reported until `forget`."""
        deadline_s = now_s - self.lost_after_s
        return sorted(iid for iid, w in self._windows.items() if w.last_seen_s < deadline_s)

    def snapshot(
        self,
        now_s: float,
        instances: Iterable[InstanceView],
        *,
        model: str | None = None,
        disaggregated: bool | None = None,
    ) -> ClusterSnapshot:
        """Aggregate the window ending at `now_s` over `instances` (filtered to `model` if given).

        `disaggregated` defaults to "some instance has a PREFILL or DECODE role". `now_s` must not
        go backwards between calls, because samples before the window are evicted for good.
        """
        if now_s < self._last_snapshot_s:
            raise ValueError(
                f"snapshot now_s={now_s!r} is before the previous snapshot at {self._last_snapshot_s!r}; "
                "evicted samples cannot come back"
            )
        self._last_snapshot_s = now_s
        horizon_s = now_s - self.window_s

        acc = {role: _PoolAccumulator() for role in Role}
        split_seen = False
        windows = self._windows
        for view in instances:
            if model is not None and view.model != model:
                continue
            role = view.role
            if role is not Role.COLOCATED:
                split_seen = True
            state = view.state
            if state not in _LOAD_STATES:
                continue
            pool = acc[role]
            if state is InstanceState.SERVING:
                pool.serving += 1
            elif state is InstanceState.LOADING:
                pool.loading += 1
            else:
                pool.draining += 1
            window = windows.get(view.instance_id)
            if window is not None:
                window.evict(horizon_s)
                pool.add(window, now_s)

        pools = {role: a.finish(role) for role, a in acc.items()}
        return ClusterSnapshot(
            now_s=now_s,
            pools=pools,
            disaggregated=split_seen if disaggregated is None else disaggregated,
            model=model,
        )


class _PoolAccumulator:
    __slots__ = ("serving", "loading", "draining", "reporting", "totals", "latency")

    def __init__(self) -> None:
        self.serving = 0
        self.loading = 0
        self.draining = 0
        self.reporting = 0
        self.totals = [0.0] * len(_MEAN_FIELDS)
        self.latency: tuple[list[float], ...] = tuple([] for _ in _LATENCY_FIELDS)

    def add(self, window: _InstanceWindow, now_s: float) -> None:
        samples = window.samples
        if not samples:
            return
        if samples[-1].now_s > now_s:
            # A sample stamped after this snapshot's time (only a simulator replaying out of
            # order does this): take the slow exact path rather than let it leak in.
            self._add_filtered(window, now_s)
            return
        n = len(samples)
        self.reporting += 1
        totals = self.totals
        for i, total in enumerate(window.sums):
            totals[i] += total / n
        for dest, series in zip(self.latency, window.latency):
            dest.extend(series.values)

    def _add_filtered(self, window: _InstanceWindow, now_s: float) -> None:
        kept = [s for s in window.samples if s.now_s <= now_s]
        if not kept:
            return
        self.reporting += 1
        for i, name in enumerate(_MEAN_FIELDS):
            self.totals[i] += math.fsum(getattr(s, name) for s in kept) / len(kept)
        for dest, name in zip(self.latency, _LATENCY_FIELDS):
            dest.extend(v for s in kept if (v := getattr(s, name)) is not None)

    def finish(self, role: Role) -> PoolSnapshot:
        t = self.totals
        ttft50, ttft99, tbt50, tbt99 = self.latency
        return PoolSnapshot(
            role=role,
            serving=self.serving,
            loading=self.loading,
            draining=self.draining,
            instances_reporting=self.reporting,
            decode_tps=t[0],
            prefill_tps=t[1],
            running=t[2],
            waiting=t[3],
            waiting_prefill_tokens=t[4],
            kv_blocks_used=t[5],
            kv_blocks_total=t[6],
            ttft_p50_s=nearest_rank(ttft50, 0.5),
            ttft_p99_s=nearest_rank(ttft99, 0.99),
            tbt_p50_s=nearest_rank(tbt50, 0.5),
            tbt_p99_s=nearest_rank(tbt99, 0.99),
        )
