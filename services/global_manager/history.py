"""The manager's side of GetHistory: feeds the pure `core.history.History` from the servicer's
events, the load monitor and the routing counter, and converts it to the wire type."""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable

from blitzmesh.convert import cluster_event_from_proto, cluster_event_to_proto
from blitzmesh.v1 import admin_pb2
from services.global_manager.config import GlobalManagerConfig
from services.global_manager.core.history import ClusterSample, History, cluster_sample
from services.global_manager.core.load_monitor import LoadMonitor
from services.global_manager.core.types import InstanceView


def sample_to_proto(sample: ClusterSample) -> admin_pb2.ClusterSample:
    out = admin_pb2.ClusterSample(
        time_s=sample.time_s,
        request_rate=sample.request_rate,
        decode_tps=sample.decode_tps,
        instances_by_state=sample.states,
    )
    for name in ("ttft_p50_s", "ttft_p99_s", "tbt_p50_s", "tbt_p99_s"):
        value = getattr(sample, name)
        if value is not None:
            setattr(out, name, value)
    return out


def sample_from_proto(sample: admin_pb2.ClusterSample) -> ClusterSample:
    def opt(name: str) -> float | None:
        return getattr(sample, name) if sample.HasField(name) else None

    return ClusterSample(
        time_s=sample.time_s,
        request_rate=sample.request_rate,
        decode_tps=sample.decode_tps,
        ttft_p50_s=opt("ttft_p50_s"),
        ttft_p99_s=opt("ttft_p99_s"),
        tbt_p50_s=opt("tbt_p50_s"),
        tbt_p99_s=opt("tbt_p99_s"),
        states=dict(sample.instances_by_state),
    )


class HistoryRecorder:
    """Owns the manager's `History`; the servicer calls `record` from `emit` and `tick` from
    its control tick."""

    def __init__(self, cfg: GlobalManagerConfig, monitor: LoadMonitor, routed_total: Callable[[], float]) -> None:
        self.history = History(cfg.history_window_s, cfg.history_period_s, cfg.history_max_events)
        self.monitor = monitor
        self.routed_total = routed_total

    def record(self, event: admin_pb2.ClusterEvent) -> None:
        self.history.record(cluster_event_from_proto(event))

    def tick(self, now_s: float, instances: Iterable[InstanceView]) -> None:
        """A sample when one is due, from the monitor's window over every instance."""
        if not self.history.due(now_s):
            return
        views = list(instances)
        self.history.sample(
            now_s,
            self.routed_total(),
            lambda rate: cluster_sample(now_s, self.monitor.snapshot(now_s, views), (v.state for v in views), rate),
        )

    def to_proto(
        self, now_s: float, since_s: float | None = None, samples_only: bool = False
    ) -> admin_pb2.ClusterHistory:
        """What the history holds at `now_s`, newer than `since_s` if given."""
        h = self.history
        after_s = -math.inf if since_s is None else since_s
        return admin_pb2.ClusterHistory(
            now_s=now_s,
            window_s=h.window_s,
            period_s=h.period_s,
            events=[] if samples_only else [cluster_event_to_proto(e) for e in h.events.since(now_s, after_s)],
            samples=[sample_to_proto(s) for s in h.samples.since(now_s, after_s)],
        )
