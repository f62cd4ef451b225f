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

Samples live in one column-major numpy table (a row per heartbeat) so a snapshot is a handful
of vector operations instead of a Python loop over every sample: at 1000 instances with a 30 s
window of 1 s heartbeats that is 30k rows, and the control tick must stay under 10 ms. Rows
older than any future window are compacted away; memory stays about one window of samples.
Per instance, samples must arrive in time order (the adapter stamps them on receipt). Rows
more than a window older than the newest sample are dropped when the table fills, so a
snapshot must not lag the heartbeats by more than a window.
"""

from __future__ import annotations

import math
from collections.abc import Iterable

import numpy as np

from .types import ClusterSnapshot, InstanceState, InstanceView, LoadSample, PoolSnapshot, Role

__all__ = ["LoadMonitor", "nearest_rank"]

# Row layout of the sample table. Latency "no observation" (None) is stored as NaN.
_COLUMNS = (
    "now_s",
    "decode_tps",
    "prefill_tps",
    "running",
    "waiting",
    "waiting_prefill_tokens",
    "kv_blocks_used",
    "kv_blocks_total",
    "ttft_p50_s",
    "ttft_p99_s",
    "tbt_p50_s",
    "tbt_p99_s",
    # The queue trigger's inputs, from each sample's measured prefill capacity (0 = none yet):
    # the capacity, whether there is one, the wait its queued prompt tokens make at it, and the
    # queued prompt tokens of an instance without one. A queue is a state, not a rate: these
    # take each instance's latest sample in the window (a window mean would show a burst's
    # queue at a tenth of its size a second in).
    "prefill_capacity_tps",
    "prefill_measured",
    "prefill_wait_s",
    "unmeasured_prefill_tokens",
)
_T = 0
_MEAN_COLS = range(1, 8)
_LATEST_COLS = range(12, 16)
_LATENCY_COLS = ((8, 0.5), (9, 0.99), (10, 0.5), (11, 0.99))
_ROLE_ORDER = (Role.COLOCATED, Role.PREFILL, Role.DECODE)
_ROLE_CODE = {role: code for code, role in enumerate(_ROLE_ORDER)}
_LOAD_STATES = frozenset({InstanceState.SERVING, InstanceState.LOADING, InstanceState.DRAINING})
_INITIAL_ROWS = 1024


def _rank(n: int, q: float) -> int:
    # The epsilon keeps q*n = 99.00000000000001 from pushing the rank past an exact integer.
    return min(n, max(1, math.ceil(q * n - 1e-9)))


def nearest_rank(values: Iterable[float], q: float) -> float | None:
    """The k-th smallest of `values` with k = ceil(q * n), clamped to [1, n]; None if empty."""
    arr = np.asarray(values if isinstance(values, np.ndarray) else list(values), dtype=np.float64)
    n = arr.size
    if n == 0:
        return None
    k = _rank(n, q)
    return float(np.partition(arr, k - 1)[k - 1])  # O(n), unlike a sort


class LoadMonitor:
    """Sliding-window view of heartbeats. Pure: every method takes the time it should use."""

    def __init__(self, window_s: float, lost_after_s: float) -> None:
        if not window_s > 0:
            raise ValueError(f"window_s must be > 0, got {window_s!r}")
        if not lost_after_s > 0:
            raise ValueError(f"lost_after_s must be > 0, got {lost_after_s!r}")
        self.window_s = float(window_s)
        self.lost_after_s = float(lost_after_s)
        self._rows = np.empty((len(_COLUMNS), _INITIAL_ROWS), dtype=np.float64)
        self._owner = np.empty(_INITIAL_ROWS, dtype=np.int64)  # row -> instance index
        self._end = 0
        # Samples observed since the last read, appended to the table in one block when a
        # snapshot needs them: a numpy column write per heartbeat costs more than the rest of
        # `observe` (a thousand instances heartbeat every second).
        self._pending: list[tuple[float, ...]] = []
        self._pending_owner: list[int] = []
        # Instance id -> index into per-instance arrays. `forget` drops the id, so its old rows
        # belong to an index nobody maps to any more and vanish at the next compaction.
        self._index: dict[str, int] = {}
        self._next_index = 0
        self._last_sample_s: dict[str, float] = {}
        self._last_seen_s: dict[str, float] = {}
        self._newest_s = -math.inf
        self._last_snapshot_s = -math.inf

    # -- input -------------------------------------------------------------------------------

    def observe(self, sample: LoadSample) -> None:
        """Add one heartbeat. Raises ValueError if it is older than the instance's previous one."""
        iid = sample.instance_id
        previous_s = self._last_sample_s.get(iid)
        if previous_s is not None and sample.now_s < previous_s:
            raise ValueError(
                f"heartbeat of instance {iid!r} at now_s={sample.now_s!r} is older than its previous "
                f"one at now_s={previous_s!r}; samples must arrive in time order"
            )
        index = self._index.get(iid)
        if index is None:
            index = self._index[iid] = self._next_index
            self._next_index += 1
        nan = math.nan
        capacity, queued = sample.prefill_capacity_tps, sample.waiting_prefill_tokens
        self._pending.append(
            (
                sample.now_s,
                sample.decode_tps,
                sample.prefill_tps,
                sample.running,
                sample.waiting,
                sample.waiting_prefill_tokens,
                sample.kv_blocks_used,
                sample.kv_blocks_total,
                nan if sample.ttft_p50_s is None else sample.ttft_p50_s,
                nan if sample.ttft_p99_s is None else sample.ttft_p99_s,
                nan if sample.tbt_p50_s is None else sample.tbt_p50_s,
                nan if sample.tbt_p99_s is None else sample.tbt_p99_s,
                capacity,
                1.0 if capacity > 0 else 0.0,
                queued / capacity if capacity > 0 else 0.0,
                0 if capacity > 0 else queued,
            )
        )
        self._pending_owner.append(index)
        if len(self._pending) >= _INITIAL_ROWS:
            self._flush()  # bounded without snapshots too (autoscaling off): the table compacts
        now_s = sample.now_s
        self._last_sample_s[iid] = now_s
        # Comparisons, not max(): a heartbeat per instance per period makes this a hot path.
        seen = self._last_seen_s
        if now_s > seen.get(iid, -math.inf):
            seen[iid] = now_s
        if now_s > self._newest_s:
            self._newest_s = now_s

    def mark_seen(self, instance_id: str, now_s: float) -> None:
        """Start (or restart) an instance's silence clock without a sample, e.g. on registration."""
        self._last_seen_s[instance_id] = max(self._last_seen_s.get(instance_id, -math.inf), now_s)

    def mark_seen_many(self, instance_ids: Iterable[str], now_s: float) -> None:
        """`mark_seen` for each of `instance_ids` at one time (many silent-but-alive workers at
        once, e.g. a thousand IDLE ones heartbeating)."""
        seen = self._last_seen_s
        for iid in instance_ids:
            if seen.get(iid, -math.inf) < now_s:
                seen[iid] = now_s

    def forget(self, instance_id: str) -> None:
        """Drop everything about an instance (after it is marked LOST or removed)."""
        self._index.pop(instance_id, None)
        self._last_sample_s.pop(instance_id, None)
        self._last_seen_s.pop(instance_id, None)

    # -- output ------------------------------------------------------------------------------

    def last_seen_s(self, instance_id: str) -> float | None:
        return self._last_seen_s.get(instance_id)

    def lost(self, now_s: float) -> list[str]:
        """Instances silent for longer than `lost_after_s`, sorted; reported until `forget`."""
        deadline_s = now_s - self.lost_after_s
        return sorted(iid for iid, seen_s in self._last_seen_s.items() if seen_s < deadline_s)

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
        go backwards between calls, because samples before the window are dropped for good.
        """
        if now_s < self._last_snapshot_s:
            raise ValueError(
                f"snapshot now_s={now_s!r} is before the previous snapshot at {self._last_snapshot_s!r}; "
                "dropped samples cannot come back"
            )
        self._last_snapshot_s = now_s
        horizon_s = now_s - self.window_s

        # Which instance index feeds which pool, and the capacity counts per pool.
        state_counts = {role: [0, 0, 0] for role in Role}  # serving, loading, draining
        fed_indices: list[int] = []
        fed_codes: list[int] = []
        split_seen = False
        # Names bound once: this loop visits every instance (most of them IDLE at scale) on
        # every reconcile.
        index, load_states, colocated = self._index, _LOAD_STATES, Role.COLOCATED
        serving, loading = InstanceState.SERVING, InstanceState.LOADING
        for view in instances:
            if model is not None and view.model != model:
                continue
            role = view.role
            if role is not colocated:
                split_seen = True
            state = view.state
            if state not in load_states:
                continue
            counts = state_counts[role]
            counts[0 if state is serving else 1 if state is loading else 2] += 1
            i = index.get(view.instance_id)
            if i is not None:
                fed_indices.append(i)
                fed_codes.append(_ROLE_CODE[role])

        self._flush()
        aggregates = self._aggregate(now_s, horizon_s, fed_indices, fed_codes)
        self._maybe_compact(horizon_s)
        pools = {}
        for role in Role:
            serving, loading, draining = state_counts[role]
            pools[role] = PoolSnapshot(
                role=role, serving=serving, loading=loading, draining=draining, **aggregates.get(role, {})
            )
        return ClusterSnapshot(
            now_s=now_s,
            pools=pools,
            disaggregated=split_seen if disaggregated is None else disaggregated,
            model=model,
        )

    # -- internals ---------------------------------------------------------------------------

    def _aggregate(
        self, now_s: float, horizon_s: float, fed_indices: list[int], fed_codes: list[int]
    ) -> dict[Role, dict[str, float | int | None]]:
        n = self._end
        if n == 0 or not fed_indices:
            return {}
        rows = self._rows[:, :n]
        owner = self._owner[:n]
        pool_of = np.full(self._next_index, -1, dtype=np.int64)
        pool_of[np.asarray(fed_indices, dtype=np.int64)] = fed_codes
        times = rows[_T]
        row_pool = pool_of[owner]
        selected = (row_pool >= 0) & (times > horizon_s) & (times <= now_s)
        if not selected.any():
            return {}
        sel_owner = owner[selected]
        sel_pool = row_pool[selected]
        per_instance = np.bincount(sel_owner, minlength=self._next_index)
        reporting = per_instance > 0
        reporting_pool = pool_of[reporting]
        reporting_count = per_instance[reporting]
        out: dict[Role, dict[str, float | int | None]] = {}
        n_reporting = np.bincount(reporting_pool, minlength=len(_ROLE_ORDER))
        means: dict[str, np.ndarray] = {}
        for col in _MEAN_COLS:
            sums = np.bincount(sel_owner, weights=rows[col][selected], minlength=self._next_index)
            # Mean per instance, then summed per pool.
            means[_COLUMNS[col]] = np.bincount(
                reporting_pool, weights=sums[reporting] / reporting_count, minlength=len(_ROLE_ORDER)
            )
        # Rows are in time order for each instance, so its last selected row is its latest sample.
        last_row = np.full(self._next_index, -1, dtype=np.int64)
        np.maximum.at(last_row, sel_owner, np.flatnonzero(selected))
        latest_rows = last_row[reporting]
        for col in _LATEST_COLS:
            means[_COLUMNS[col]] = np.bincount(
                reporting_pool, weights=rows[col][latest_rows], minlength=len(_ROLE_ORDER)
            )
        latency_cols = {col: rows[col][selected] for col, _ in _LATENCY_COLS}
        for code, role in enumerate(_ROLE_ORDER):
            if n_reporting[code] == 0:
                continue
            fields: dict[str, float | int | None] = {"instances_reporting": int(n_reporting[code])}
            for name, totals in means.items():
                fields[name] = float(totals[code])
            in_pool = sel_pool == code
            for col, q in _LATENCY_COLS:
                values = latency_cols[col][in_pool]
                fields[_COLUMNS[col]] = nearest_rank(values[~np.isnan(values)], q)
            out[role] = fields
        return out

    def _flush(self) -> None:
        """Append the samples observed since the last read to the table, in their order."""
        k = len(self._pending)
        if k == 0:
            return
        while self._end + k > self._rows.shape[1]:
            self._make_room(k)
        self._rows[:, self._end : self._end + k] = np.array(self._pending, dtype=np.float64).T
        self._owner[self._end : self._end + k] = self._pending_owner
        self._end += k
        self._pending.clear()
        self._pending_owner.clear()

    def _make_room(self, k: int = 1) -> None:
        # Drop rows no window can reach any more (older than the newest sample's window), and
        # grow only if that frees less than half the table.
        self._compact(self._newest_s - self.window_s)
        capacity = self._rows.shape[1]
        if self._end + k > capacity // 2:
            rows = np.empty((len(_COLUMNS), capacity * 2), dtype=np.float64)
            rows[:, : self._end] = self._rows[:, : self._end]
            owner = np.empty(capacity * 2, dtype=np.int64)
            owner[: self._end] = self._owner[: self._end]
            self._rows, self._owner = rows, owner

    def _maybe_compact(self, horizon_s: float) -> None:
        n = self._end
        if n == 0:
            return
        stale = int(np.count_nonzero(self._rows[_T, :n] <= horizon_s))
        # Compacting copies the live rows: wait until at least half are dead (amortised O(1)).
        if stale * 2 >= n:
            self._compact(horizon_s)

    def _compact(self, horizon_s: float) -> None:
        n = self._end
        owner = self._owner[:n]
        live_indices = np.fromiter(self._index.values(), dtype=np.int64, count=len(self._index))
        mapped = np.zeros(self._next_index, dtype=bool)
        mapped[live_indices] = True
        keep = (self._rows[_T, :n] > horizon_s) & mapped[owner]
        m = int(np.count_nonzero(keep))
        self._rows[:, :m] = self._rows[:, :n][:, keep]
        self._owner[:m] = owner[keep]
        self._end = m
