"""The simulator's drained instances keep their weights as the live worker does: the core sets
the time (the model's last load, within `keep_warm_max_s`), a load onto a warm instance within
it is instant, one after it moves the bytes, and the kept time counts in `gpu_seconds`."""

from __future__ import annotations

import pytest

from bench.simulate.cluster import RunConfig, Simulation
from bench.simulate.links import ClusterSpec
from bench.simulate.profiles import PUBLISHED_PROFILES
from blitzmesh.replay.schedule import Arrival
from services.global_manager.core.actions import DrainInstance, LoadInstances
from services.global_manager.core.types import InstanceState, Role

pytestmark = [pytest.mark.timeout(60), pytest.mark.filterwarnings("error")]

PROFILE = PUBLISHED_PROFILES["h100-llama3-8b"]
MODEL = PROFILE.model.name


def _sim(keep_warm_max_s: float = 30.0) -> Simulation:
    """Two SERVING instances on two hosts, no arrivals, no policy: the test drives the core."""
    return Simulation(
        RunConfig(
            name="warm",
            profile=PROFILE,
            cluster=ClusterSpec(hosts=2, gpus_per_host=1, hosts_per_leaf=2, rdma_gbps=100.0, host_nic_gbps=100.0),
            arrivals=(),
            initial=2,
            autoscale=False,
            max_instances=2,
            zigzag=False,
            keep_warm_max_s=keep_warm_max_s,
        )
    )


def _drain_then_load(sim: Simulation, gap_s: float) -> tuple[str, float]:
    """Drain one instance (its model's last load took 4 s), load it again `gap_s` after its drain
    ended; returns it and how long that load took."""
    sim.reconciler.load_s[MODEL] = 4.0
    (victim,), acts = sim.reconciler.scale_in(sim.registry, set(sim.actuator.busy()), MODEL, 1, "test")
    assert [a.keep_warm_s for a in acts if isinstance(a, DrainInstance)] == [min(4.0, sim.cfg.keep_warm_max_s)]
    sim.actuator.execute(acts)
    sim.loop.run(sim.loop.now_s + 0.01)
    assert sim.registry.get(victim).state is InstanceState.IDLE
    sim.loop.run(sim.loop.now_s + gap_s)
    chosen, acts = sim.reconciler.scale_out(sim.registry, set(sim.actuator.busy()), MODEL, 1, Role.COLOCATED, "test")
    assert chosen == [victim] and any(isinstance(a, LoadInstances) for a in acts)
    started = sim.loop.now_s
    sim.actuator.execute(acts)
    sim.loop.run(started + 30.0)
    (ready,) = [t for t, iid in sim.reached_serving if iid == victim]
    return victim, ready - started


def test_a_load_within_the_kept_time_is_instant_and_the_time_is_counted() -> None:
    sim = _sim()
    _, load_s = _drain_then_load(sim, gap_s=1.0)
    assert load_s == 0.0 and sim.warm_loads == 1
    assert sim.warm_s == pytest.approx(1.0, abs=0.05)  # held from the drain to the reload
    assert sim.load_times == []  # no transfer, so no load time to report


def test_after_the_kept_time_or_with_it_off_the_load_moves_the_bytes() -> None:
    sim = _sim()
    _, load_s = _drain_then_load(sim, gap_s=6.0)
    assert load_s > 0.5 and sim.warm_loads == 0
    assert sim.warm_s == pytest.approx(4.0, abs=0.05)  # held for the whole 4 s, then freed
    off = _sim(keep_warm_max_s=0.0)
    _, load_s = _drain_then_load(off, gap_s=1.0)
    assert load_s > 0.5 and off.warm_loads == 0 and off.warm_s == 0.0


def test_a_drain_with_requests_on_it_is_taken_back_by_the_next_scale_out() -> None:
    """The simulated worker does as the live one: a scale-out while a pool's drain still waits
    for its requests ends the drain (no load, no transfer), the requests finish where they run,
    and the instance serves on."""
    sim = Simulation(
        RunConfig(
            name="resume",
            profile=PROFILE,
            cluster=ClusterSpec(hosts=2, gpus_per_host=1, hosts_per_leaf=2, rdma_gbps=100.0, host_nic_gbps=100.0),
            arrivals=tuple(Arrival(i, 0.0, 256, 2000) for i in range(4)),
            initial=2,
            autoscale=False,
            max_instances=2,
            zigzag=False,
        )
    )
    seen: dict[str, object] = {}

    def scale_in() -> None:
        (victim,), acts = sim.reconciler.scale_in(sim.registry, set(sim.actuator.busy()), MODEL, 1, "lull")
        seen["victim"] = victim
        seen["running"] = sim.workers[victim].empty
        sim.actuator.execute(acts)

    def scale_out() -> None:
        victim = seen["victim"]
        seen["draining"] = sim.registry.get(victim).state  # type: ignore[arg-type]
        chosen, acts = sim.reconciler.scale_out(
            sim.registry, set(sim.actuator.busy()), MODEL, 1, Role.COLOCATED, "burst"
        )
        seen["chosen"] = chosen
        sim.actuator.execute(acts)

    sim.loop.at(1.0, scale_in)
    sim.loop.at(2.0, scale_out)
    summary = sim.run()
    victim = seen["victim"]
    assert seen["running"] is False and seen["draining"] is InstanceState.DRAINING  # it held requests
    assert seen["chosen"] == [victim]
    assert summary["actions"]["drain:resumed"] == 1 and summary["actions"]["resume:ok"] == 1
    assert "drain:ok" not in summary["actions"] and summary["loads"]["count"] == 0
    assert sim.registry.get(victim).state is InstanceState.SERVING
    assert all(r.outcome == "ok" and r.completion_tokens == 2000 for r in sim.records)
