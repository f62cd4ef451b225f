"""The simulator's workers send the live worker's early heartbeat: a backlog that forms between
two heartbeats reaches the manager's queue trigger at the worker's next check, not a period
later, and the manager reconciles at once on it (`services.common.backlog`)."""

from __future__ import annotations

from typing import Any

import pytest

from bench.simulate.cluster import RunConfig, Simulation
from bench.simulate.links import ClusterSpec
from bench.simulate.profiles import PUBLISHED_PROFILES
from bench.simulate.worker import SimRequest
from blitzmesh.replay.schedule import Arrival

pytestmark = [pytest.mark.timeout(60), pytest.mark.filterwarnings("error")]

PROFILE = PUBLISHED_PROFILES["h100-llama3-8b"]
BURST_S = 1.05  # just after the heartbeat of 1.0 s


def _run(**changes: Any) -> tuple[Simulation, dict[str, Any]]:
    """One SERVING instance of two GPUs; 300 prompts of 2,048 tokens arrive at once."""
    cfg = RunConfig(
        name="backlog",
        profile=PROFILE,
        cluster=ClusterSpec(hosts=1, gpus_per_host=2, hosts_per_leaf=1),
        arrivals=tuple(Arrival(i, BURST_S, 2048, 2) for i in range(300)),
        initial=1,
        max_instances=2,
        zigzag=False,
        **changes,
    )
    sim = Simulation(cfg)
    return sim, sim.run()


def _first_scale_out_s(sim: Simulation) -> float:
    times = [float(line.split(",")[0]) for line in sim.decision_log if line.split(",")[2] == "scale_out"]
    assert times, sim.decision_log[:5]
    return times[0]


def test_a_backlog_between_heartbeats_scales_out_at_the_next_check() -> None:
    sim, summary = _run()
    assert sim.counts["backlog_heartbeats"] >= 1
    # The first check after the burst (every 0.25 s), not the heartbeat at 2.0 s.
    assert _first_scale_out_s(sim) == pytest.approx(1.25)
    assert summary["lost"] == 0 and summary["completed"] == 300


def test_without_the_check_the_scale_out_waits_for_the_heartbeat() -> None:
    sim, summary = _run(heartbeat_backlog_check_s=0.0)
    assert "backlog_heartbeats" not in sim.counts
    assert _first_scale_out_s(sim) >= 2.0
    assert summary["lost"] == 0 and summary["completed"] == 300


def test_a_reported_backlog_goes_out_early_again_only_once_its_wait_doubles() -> None:
    """The rule's doubling: more prompts onto a backlog the last report showed send nothing
    early until its wait has doubled, so a standing queue costs no extra reports."""
    sim = Simulation(
        RunConfig(
            name="backlog",
            profile=PROFILE,
            cluster=ClusterSpec(hosts=1, gpus_per_host=1, hosts_per_leaf=1),
            arrivals=(),
            initial=1,
            autoscale=False,
            max_instances=1,
            zigzag=False,
        )
    )
    ((iid, worker),) = sim.workers.items()
    early = lambda: sim.counts.get("backlog_heartbeats", 0)  # noqa: E731
    sim.loop.run(BURST_S)
    for i in range(40):
        worker.submit(SimRequest(i, BURST_S, 2048, 1))
    sim.loop.run(1.3)  # the check at 1.25
    assert early() == 1
    reported = worker.reported_wait_s
    assert reported >= 0.25
    for i in range(40, 50):  # a quarter more: not news
        worker.submit(SimRequest(i, 1.3, 2048, 1))
    sim.loop.run(1.55)
    assert early() == 1 and worker.reported_wait_s == reported
    for i in range(50, 150):  # well over twice the reported wait
        worker.submit(SimRequest(i, 1.55, 2048, 1))
    sim.loop.run(1.8)
    assert early() == 2 and worker.reported_wait_s >= 2 * reported
    assert sim.counts.get("backlog_heartbeats") == 2 and iid in sim.registry
