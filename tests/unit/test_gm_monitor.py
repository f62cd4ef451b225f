"""Load monitor: window math, per-pool aggregation, eviction and lost-instance detection."""

from __future__ import annotations

import math
import random

import pytest

from services.global_manager.core.load_monitor import LoadMonitor, nearest_rank
from services.global_manager.core.types import InstanceState, InstanceView, LoadSample, Role

S = InstanceState


def view(iid: str, role: Role = Role.DECODE, state: InstanceState = S.SERVING, model: str = "m") -> InstanceView:
    layers = 4 if state in (S.SERVING, S.DRAINING) else 0
    return InstanceView(iid, model, role, state, layers, 4, "h0", 0.0)


def sample(iid: str, t: float, **kw: float) -> LoadSample:
    return LoadSample(instance_id=iid, now_s=t, **kw)  # type: ignore[arg-type]


def test_window_keeps_samples_in_half_open_interval() -> None:
    mon = LoadMonitor(window_s=5.0, lost_after_s=10.0)
    for t in range(1, 11):
        mon.observe(sample("a", float(t), decode_tps=float(t), running=t))
    snap = mon.snapshot(10.0, [view("a")])
    # (10 - 5, 10] holds t = 6..10: mean 8.
    assert snap.decode.decode_tps == pytest.approx(8.0)
    assert snap.decode.running == pytest.approx(8.0)
    assert snap.decode.instances_reporting == 1
    # At t=12 only 8..10 remain (7 < t is required; t=7 is exactly on the edge and dropped).
    assert mon.snapshot(12.0, [view("a")]).decode.decode_tps == pytest.approx(9.0)
    assert mon.snapshot(100.0, [view("a")]).decode.instances_reporting == 0


def test_pool_sums_per_instance_means_and_counts_states() -> None:
    mon = LoadMonitor(window_s=10.0, lost_after_s=10.0)
    mon.observe(sample("d1", 1.0, decode_tps=100.0, kv_blocks_used=10, kv_blocks_total=100))
    mon.observe(sample("d1", 2.0, decode_tps=300.0, kv_blocks_used=30, kv_blocks_total=100))
    mon.observe(sample("d2", 2.0, decode_tps=50.0, kv_blocks_used=50, kv_blocks_total=100))
    mon.observe(sample("drain", 2.0, decode_tps=10.0))
    mon.observe(sample("idle", 2.0, decode_tps=999.0))
    mon.observe(sample("p1", 2.0, prefill_tps=5000.0, waiting_prefill_tokens=700, waiting=3))
    instances = [
        view("d1"),
        view("d2"),
        view("drain", state=S.DRAINING),
        view("idle", state=S.IDLE),
        view("lost", state=S.LOST),
        view("new", state=S.LOADING),
        view("p1", role=Role.PREFILL),
    ]
    snap = mon.snapshot(5.0, instances)
    assert snap.disaggregated
    d = snap.decode
    assert d.decode_tps == pytest.approx(200.0 + 50.0 + 10.0)  # DRAINING load counts, IDLE not
    assert (d.serving, d.loading, d.draining, d.count) == (2, 1, 1, 3)
    assert (d.kv_blocks_used, d.kv_blocks_total) == (pytest.approx(70.0), pytest.approx(200.0))
    assert d.kv_utilization == pytest.approx(0.35)
    assert d.kv_blocks_per_instance == pytest.approx(200.0 / 3)
    p = snap.prefill
    assert (p.prefill_tps, p.waiting_prefill_tokens, p.waiting, p.count) == (5000.0, 700.0, 3.0, 1)
    assert snap.decode_tps == pytest.approx(260.0)


def test_latency_quantiles_are_nearest_rank_over_pool_samples() -> None:
    mon = LoadMonitor(window_s=100.0, lost_after_s=100.0)
    values = [0.01, 0.02, 0.03, 0.04, 0.05, 0.06, 0.07, 0.08, 0.09, 0.5]
    for i, v in enumerate(values):
        iid = "a" if i % 2 else "b"
        mon.observe(sample(iid, float(i), tbt_p50_s=v, tbt_p99_s=v * 2, ttft_p50_s=v * 10))
    mon.observe(sample("a", 20.0))  # no observation: must not count as zero
    snap = mon.snapshot(20.0, [view("a"), view("b")])
    assert snap.decode.tbt_p50_s == 0.05  # 5th of 10
    assert snap.decode.tbt_p99_s == 1.0  # ceil(9.9) = 10th of 10
    assert snap.decode.ttft_p50_s == pytest.approx(0.5)
    assert snap.decode.ttft_p99_s is None
    assert snap.decode.tbt_s("p99") == 1.0


def test_nearest_rank_small_and_large_paths_agree() -> None:
    assert nearest_rank([], 0.5) is None
    assert nearest_rank([3.0, 1.0, 2.0], 0.5) == 2.0
    assert nearest_rank([3.0, 1.0, 2.0, 4.0], 0.5) == 2.0
    rng = random.Random(7)
    big = [rng.random() for _ in range(1001)]
    for q in (0.5, 0.9, 0.99, 1.0):
        k = max(1, math.ceil(q * len(big) - 1e-9))
        assert nearest_rank(big, q) == sorted(big)[k - 1]


def test_running_sums_stay_exact_after_many_evictions() -> None:
    mon = LoadMonitor(window_s=10.0, lost_after_s=10.0)
    rng = random.Random(1)
    history = []
    for t in range(1, 2001):
        v = rng.uniform(0, 1e4) if t % 3 else rng.uniform(0, 1e-3)
        history.append((float(t), v))
        mon.observe(sample("a", float(t), decode_tps=v))
    kept = [v for t, v in history if t > 1990.0]
    assert mon.snapshot(2000.0, [view("a")]).decode.decode_tps == pytest.approx(math.fsum(kept) / len(kept), rel=1e-12)


def test_lost_detection() -> None:
    mon = LoadMonitor(window_s=5.0, lost_after_s=3.0)
    mon.observe(sample("a", 10.0))
    mon.observe(sample("b", 12.0))
    mon.mark_seen("c", 11.0)  # registered, never heartbeated
    assert mon.lost(13.0) == []  # a silent for exactly 3 s: not yet
    assert mon.lost(13.5) == ["a"]
    assert mon.lost(14.5) == ["a", "c"]
    assert mon.last_seen_s("b") == 12.0
    mon.forget("a")
    assert mon.lost(14.5) == ["c"]
    mon.observe(sample("c", 14.0))
    assert mon.lost(16.0) == ["b"]


def test_mark_seen_many_is_mark_seen_for_each() -> None:
    one, many = LoadMonitor(window_s=5.0, lost_after_s=10.0), LoadMonitor(window_s=5.0, lost_after_s=10.0)
    for mon in (one, many):
        mon.mark_seen("a", 3.0)
        mon.mark_seen("b", 9.0)  # later than the batch: kept
    for iid in ("a", "b", "c"):
        one.mark_seen(iid, 5.0)
    many.mark_seen_many(["a", "b", "c"], 5.0)
    assert [many.last_seen_s(i) for i in "abc"] == [one.last_seen_s(i) for i in "abc"] == [5.0, 9.0, 5.0]
    assert many.lost(16.0) == one.lost(16.0) == ["a", "c"]


def test_snapshot_filters_model_and_detects_colocated() -> None:
    mon = LoadMonitor(window_s=5.0, lost_after_s=3.0)
    mon.observe(sample("x", 1.0, decode_tps=10.0))
    mon.observe(sample("y", 1.0, decode_tps=20.0))
    instances = [view("x", role=Role.COLOCATED, model="m1"), view("y", role=Role.DECODE, model="m2")]
    snap = mon.snapshot(2.0, instances, model="m1")
    assert not snap.disaggregated and snap.model == "m1"
    assert snap.decode_tps == 10.0 and snap.token_pool is snap.colocated
    assert mon.snapshot(2.0, instances, model="m2").decode_tps == 20.0


def test_rejects_time_going_backwards() -> None:
    mon = LoadMonitor(window_s=5.0, lost_after_s=3.0)
    mon.observe(sample("a", 5.0))
    with pytest.raises(ValueError, match=r"'a' at now_s=4.0 is older than its previous one at now_s=5.0"):
        mon.observe(sample("a", 4.0))
    mon.snapshot(10.0, [])
    with pytest.raises(ValueError, match="before the previous snapshot"):
        mon.snapshot(9.0, [])
    with pytest.raises(ValueError, match="window_s must be > 0, got 0"):
        LoadMonitor(window_s=0, lost_after_s=1)


def test_future_samples_are_left_out_of_an_earlier_snapshot() -> None:
    mon = LoadMonitor(window_s=10.0, lost_after_s=3.0)
    mon.observe(sample("a", 1.0, decode_tps=10.0))
    mon.observe(sample("a", 3.0, decode_tps=30.0))
    assert mon.snapshot(2.0, [view("a")]).decode.decode_tps == 10.0
    assert mon.snapshot(3.0, [view("a")]).decode.decode_tps == 20.0


def test_sample_validation() -> None:
    with pytest.raises(ValueError, match=r"kv_blocks_used=5 exceeds kv_blocks_total=4"):
        LoadSample("a", 0.0, kv_blocks_used=5, kv_blocks_total=4)
    with pytest.raises(ValueError, match=r"decode_tps must be >= 0, got -1"):
        LoadSample("a", 0.0, decode_tps=-1)


def _reference(
    samples: list[LoadSample], views: list[InstanceView], now_s: float, window_s: float
) -> dict[Role, dict[str, float | None]]:
    """Brute force version of the window math in the module docstring."""
    out: dict[Role, dict[str, float | None]] = {}
    for role in Role:
        ids = {v.instance_id for v in views if v.role is role and v.state in (S.SERVING, S.LOADING, S.DRAINING)}
        rows = [s for s in samples if s.instance_id in ids and now_s - window_s < s.now_s <= now_s]
        pool: dict[str, float | None] = {}
        for name in ("decode_tps", "kv_blocks_used", "waiting_prefill_tokens"):
            total = 0.0
            for iid in ids:
                mine = [getattr(s, name) for s in rows if s.instance_id == iid]
                total += sum(mine) / len(mine) if mine else 0.0
            pool[name] = total
        for name, q in (("tbt_p50_s", 0.5), ("ttft_p99_s", 0.99)):
            vals = sorted(v for s in rows if (v := getattr(s, name)) is not None)
            pool[name] = vals[max(1, math.ceil(q * len(vals) - 1e-9)) - 1] if vals else None
        out[role] = pool
    return out


def test_matches_brute_force_through_growth_compaction_and_forget() -> None:
    rng = random.Random(3)
    mon = LoadMonitor(window_s=7.0, lost_after_s=5.0)
    roles = [Role.PREFILL, Role.DECODE, Role.COLOCATED]
    views = [
        view(f"i{k}", role=roles[k % 3], state=[S.SERVING, S.LOADING, S.DRAINING, S.IDLE][k % 4]) for k in range(60)
    ]
    samples: list[LoadSample] = []
    for step in range(1, 80):  # 60 instances x 79 steps: well past the initial table size
        for v in views:
            if rng.random() < 0.8:
                s = sample(
                    v.instance_id,
                    float(step),
                    decode_tps=rng.uniform(0, 100),
                    kv_blocks_used=rng.randrange(10),
                    kv_blocks_total=10,
                    waiting_prefill_tokens=rng.randrange(1000),
                    tbt_p50_s=rng.random() if rng.random() < 0.7 else None,
                    ttft_p99_s=rng.random() if rng.random() < 0.5 else None,
                )
                mon.observe(s)
                samples.append(s)
        if step == 40:
            mon.forget("i0")  # re-observed later as a new instance: old rows must not count
            samples = [s for s in samples if s.instance_id != "i0"]
        if step % 9 == 0:
            snap = mon.snapshot(float(step) + 0.5, views)
            ref = _reference(samples, views, float(step) + 0.5, 7.0)
            for role in Role:
                pool = snap.pool(role)
                for name, expected in ref[role].items():
                    got = getattr(pool, name)
                    assert got == (pytest.approx(expected) if expected is not None else None), (step, role, name)
    assert mon._end <= 2 * 60 * 8  # bounded: about one window of rows, plus slack


def test_table_stays_bounded_without_snapshots() -> None:
    """With autoscaling off nothing reads the window, yet heartbeats keep coming: the samples
    held (table plus those not yet appended) stay about a window's worth."""
    mon = LoadMonitor(window_s=5.0, lost_after_s=5.0)
    for step in range(1, 2000):  # 40,000 heartbeats, 100 in a window
        for k in range(20):
            mon.observe(sample(f"i{k}", float(step), decode_tps=1.0))
    assert len(mon._pending) < 1024 and mon._rows.shape[1] <= 4 * 1024
