"""The smoke scenario end to end: the real Reconciler scales the simulated cluster out under the
code trace's burst, loads finish over the simulated links, nothing is lost, in seconds."""

from __future__ import annotations

import time

import pytest

from bench.simulate.cluster import Simulation
from bench.simulate.scenarios import SCENARIOS, build_runs
from services.global_manager.core.actions import DrainInstance, LoadInstances

pytestmark = [pytest.mark.timeout(60), pytest.mark.filterwarnings("error")]


def _run(variant: str) -> tuple[Simulation, dict]:  # type: ignore[type-arg]
    (cfg,), _ = build_runs(SCENARIOS["smoke"], (variant,))
    sim = Simulation(cfg)
    return sim, sim.run()


def test_smoke_scales_out_with_the_real_reconciler_and_loses_nothing() -> None:
    started = time.perf_counter()
    sim, summary = _run("blitzmesh")
    assert time.perf_counter() - started < 10
    assert summary["requests_sent"] > 100
    assert summary["lost"] == 0 and summary["errored"] == 0
    assert summary["completed"] == summary["requests_sent"]
    loads = [a for a in sim.actuator.executed if isinstance(a, LoadInstances)]
    assert loads, "the burst should make the Reconciler load instances"
    loaded = {iid for a in loads for iid in a.instance_ids}
    assert {iid for _, iid in sim.reached_serving} == loaded  # every load reached SERVING
    assert all(0 < t < 60 for t, _ in sim.reached_serving)  # in simulated time, during the run
    assert summary["instances_max"] > 1
    # One load:ok per target loaded (an instance drained after a burst may load again).
    assert summary["actions"]["load:ok"] == sum(len(a.instance_ids) for a in loads)
    assert any(line.split(",")[2] == "scale_out" for line in sim.decision_log)
    # The scale-in after the burst drains through the core too.
    assert any(isinstance(a, DrainInstance) for a in sim.actuator.executed)
    assert not sim.actuator.busy()


def test_smoke_runs_are_deterministic() -> None:
    _, a = _run("blitzmesh")
    _, b = _run("blitzmesh")
    for key in ("sim_wall_s",):
        a.pop(key), b.pop(key)
    assert a == b


def test_fixed_peak_never_loads_and_serverless_reads_the_ssd_on_a_miss() -> None:
    _, fixed = _run("fixed_peak")
    assert fixed["loads"]["count"] == 0 and fixed["lost"] == 0
    _, sllm = _run("serverlessllm")
    assert sllm["lost"] == 0
    assert sllm["loads"]["sources"].get("ssd_miss", 0) > 0
    assert sllm["bytes_moved_gb"]["load"] > 0
