"""The manager's recent past (services/global_manager/core/history.py) on a clock the tests pass
in: bounded by count and by age, samples at their period with the routed rate between them, and
the wire converters round-trip."""

from __future__ import annotations

import math

import pytest

from blitzmesh.convert import cluster_event_to_proto
from blitzmesh.types import ClusterEvent
from services.global_manager.config import GlobalManagerConfig
from services.global_manager.core.history import ClusterSample, History, Ring, cluster_sample
from services.global_manager.core.load_monitor import LoadMonitor
from services.global_manager.core.types import InstanceState, InstanceView, LoadSample, Role
from services.global_manager.history import HistoryRecorder, sample_from_proto, sample_to_proto

S = InstanceState


def test_ring_keeps_at_most_max_items_the_oldest_dropped() -> None:
    ring: Ring[int] = Ring(window_s=1000, max_items=3)
    for t in range(10):
        ring.add(float(t), t)
    assert len(ring) == 3
    assert ring.since(9.0) == [7, 8, 9]


def test_ring_trims_to_its_window_when_written_and_when_read() -> None:
    ring: Ring[str] = Ring(window_s=10, max_items=100)
    ring.add(0.0, "a")
    ring.add(5.0, "b")
    ring.add(10.0, "c")
    assert ring.since(10.0) == ["a", "b", "c"]  # a is exactly 10 s old: still in
    ring.add(12.0, "d")
    assert ring.since(12.0) == ["b", "c", "d"]  # written: a left
    assert ring.since(15.5) == ["c", "d"]  # read later: b left too, without a write
    assert len(ring) == 2
    assert ring.since(15.5, after_s=10.0) == ["d"]
    assert ring.since(100.0) == []


def test_ring_refuses_time_going_backwards_and_bad_bounds() -> None:
    ring: Ring[int] = Ring(window_s=10, max_items=5)
    ring.add(3.0, 1)
    with pytest.raises(ValueError, match=r"time_s=2\.0 is older than the newest one at 3\.0"):
        ring.add(2.0, 2)
    with pytest.raises(ValueError, match="window_s must be > 0, got 0"):
        Ring(window_s=0, max_items=5)
    with pytest.raises(ValueError, match="max_items must be >= 1, got 0"):
        Ring(window_s=1, max_items=0)


def test_history_events_keep_arrival_order_even_when_stamped_a_little_early() -> None:
    h = History(window_s=60, period_s=1, max_events=100)
    h.record(ClusterEvent(10.0, "scale_out", "tiny", "loading", "Admin.Scale", "w-2"))
    h.record(ClusterEvent(9.5, "autoscaling_decision", "scale_out", "+1", "tick's own time"))  # stamped before
    assert [e.action for e in h.events.since(10.0)] == ["scale_out", "autoscaling_decision"]
    assert h.events.since(10.0)[1].time_s == 9.5  # its own time is kept


def test_history_samples_at_its_period_with_the_routed_rate() -> None:
    h = History(window_s=10, period_s=2, max_events=10)

    def make(now_s: float):
        return lambda rate: ClusterSample(now_s, rate, 0.0, None, None, None, None, {})

    assert h.sample(0.0, 100.0, make(0.0)).request_rate == 0.0  # type: ignore[union-attr]  # no previous count
    assert h.sample(1.0, 150.0, make(1.0)) is None  # not due
    assert h.sample(2.0, 120.0 + 100.0, make(2.0)).request_rate == 60.0  # type: ignore[union-attr]
    assert h.sample(4.0, 200.0, make(4.0)).request_rate == 0.0  # type: ignore[union-attr]  # a reset counter
    for t in range(6, 40, 2):
        h.sample(float(t), 0.0, make(float(t)))
    samples = h.samples.since(38.0)
    assert [s.time_s for s in samples] == [28.0, 30.0, 32.0, 34.0, 36.0, 38.0]  # the window, no more
    assert len(h.samples) <= math.ceil(10 / 2) + 1


def test_history_bounds_are_checked() -> None:
    with pytest.raises(ValueError, match="period_s=20 is longer than window_s=10"):
        History(window_s=10, period_s=20, max_events=1)
    with pytest.raises(ValueError, match="history_period_s=20.0 must be <= history_window_s=10.0"):
        GlobalManagerConfig(history_window_s=10, history_period_s=20)


def _view(iid: str, state: InstanceState, role: Role = Role.COLOCATED) -> InstanceView:
    return InstanceView(
        instance_id=iid,
        model="tiny",
        role=role,
        state=state,
        layers_loaded=0,
        num_layers=2,
        host="",
        last_heartbeat_s=0.0,
    )


def test_cluster_sample_reads_the_monitors_window_and_counts_states() -> None:
    monitor = LoadMonitor(window_s=10, lost_after_s=5)
    for t, ttft in ((1.0, 0.1), (2.0, 0.3)):
        monitor.observe(LoadSample("w-1", t, decode_tps=40.0, ttft_p50_s=ttft, ttft_p99_s=2 * ttft, tbt_p50_s=0.02))
    views = [_view("w-1", S.SERVING), _view("w-2", S.LOADING), _view("w-3", S.IDLE), _view("w-4", S.IDLE)]
    sample = cluster_sample(2.0, monitor.snapshot(2.0, views), (v.state for v in views), request_rate=3.0)
    assert sample.decode_tps == 40.0 and sample.request_rate == 3.0
    assert sample.ttft_p50_s == 0.1 and sample.ttft_p99_s == 0.6  # nearest rank over the window's samples
    assert sample.tbt_p50_s == 0.02 and sample.tbt_p99_s is None
    assert sample.states == {"idle": 2, "loading": 1, "serving": 1, "draining": 0, "lost": 0}


def test_recorder_samples_on_tick_and_answers_since() -> None:
    cfg = GlobalManagerConfig(history_window_s=30, history_period_s=1)
    routed = [0.0]
    recorder = HistoryRecorder(cfg, LoadMonitor(window_s=10, lost_after_s=5), lambda: routed[0])
    views = [_view("w-1", S.SERVING)]
    for t in range(5):
        routed[0] += 4
        recorder.tick(float(t), views)
        recorder.tick(t + 0.5, views)  # not due: no sample
    recorder.record(cluster_event_to_proto(ClusterEvent(3.2, "scale_out", "tiny", "loading", "why", "w-2")))
    reply = recorder.to_proto(4.5)
    assert reply.now_s == 4.5 and reply.window_s == 30 and reply.period_s == 1
    assert [s.time_s for s in reply.samples] == [0, 1, 2, 3, 4]
    assert [s.request_rate for s in reply.samples] == [0, 4, 4, 4, 4]
    assert [e.action for e in reply.events] == ["scale_out"]
    later = recorder.to_proto(4.5, since_s=3.0, samples_only=True)
    assert [s.time_s for s in later.samples] == [4] and not later.events


def test_sample_converter_round_trips() -> None:
    for sample in (
        ClusterSample(2.0, 1.5, 30.0, 0.1, 0.4, 0.02, 0.05, {"serving": 2, "idle": 1}),
        ClusterSample(3.0, 0.0, 0.0, None, None, None, None, {}),
    ):
        assert sample_from_proto(sample_to_proto(sample)) == sample
    assert not sample_to_proto(ClusterSample(3.0, 0.0, 0.0, None, 0.2, None, None, {})).HasField("ttft_p50_s")
