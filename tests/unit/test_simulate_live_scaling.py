"""The simulator's ZigZag is honest: a loading instance at k of L paired with a saturated partner
serves exactly the layer-level model's throughput, nothing more; with ZigZag off (or the live
GM's gate shut) a loading instance serves nothing; and the live8b scenario's stop-the-world run
never serves a request on an instance before it is SERVING."""

from __future__ import annotations

import statistics
from typing import Any

import pytest

from bench.simulate.cluster import RunConfig, Simulation, partner_speedup
from bench.simulate.links import ClusterSpec
from bench.simulate.live_scaling import live8b_runs
from bench.simulate.profiles import PUBLISHED_PROFILES
from bench.simulate.worker import SimRequest
from bench.simulate.zigzag import layer_level_throughput
from services.global_manager.core.types import InstanceState
from services.global_manager.core.zigzag import pair_throughput

pytestmark = [pytest.mark.timeout(60), pytest.mark.filterwarnings("error")]

PROFILE = PUBLISHED_PROFILES["h100-llama3-8b"]
L = PROFILE.model.num_layers
OLD, NEW = "h00g0", "h00g1"


def _config(gpus: int, **changes: Any) -> RunConfig:
    """A one-host cluster of `gpus` H100s, no arrivals, no autoscaling, with `changes`."""
    return RunConfig(
        name="pair",
        profile=PROFILE,
        cluster=ClusterSpec(hosts=1, gpus_per_host=gpus, hosts_per_leaf=1),
        arrivals=(),
        initial=1,
        autoscale=False,
        max_instances=gpus,
        **changes,
    )


def _pair(
    zigzag: bool, k: int, queued: int = 1500, gate: str = "all_overloaded", dispatch: str = "route"
) -> tuple[Simulation, float, float]:
    """One SERVING instance with `queued` prefill-only requests (2,048-token prompts, 1 output
    token) and one LOADING instance holding k of L layers, ZigZag as the live GM runs it.
    Returns the simulation, the partner's speedup, and the requests per second the pair
    completes over 20 s of saturation."""
    cfg = _config(
        gpus=2,
        zigzag=zigzag,
        zigzag_live="all",
        zigzag_ttft_s=1.0,
        zigzag_stall_s=60.0,  # the load is held at k on purpose: not a stall over the 21 s
        zigzag_gate=gate,
        zigzag_dispatch=dispatch,
    )
    sim = Simulation(cfg)
    sim.registry.transition(NEW, InstanceState.LOADING, model=PROFILE.model.name, num_layers=L)
    if k:
        sim.registry.set_layers_loaded(NEW, k)
        # As a load reports its layers: the manager's ZigZag core takes it live.
        sim.zigzag.load_progress(0.0, NEW, PROFILE.model.name, k, L)
    reqs = [SimRequest(i, 0.0, 2048, 1) for i in range(queued)]
    for r in reqs:
        sim.workers[OLD].submit(r)
    sim.loop.run(1.0)
    sim._heartbeats()  # the LoadReports the gate reads
    sim._update_zigzag()
    speedup = sim.workers[OLD].speedup
    t0, done0 = sim.loop.now_s, sim.done
    sim.loop.run(t0 + 20.0)
    assert queued < 100 or sim.done < queued, "the partner must stay saturated over the window"
    return sim, speedup, (sim.done - done0) / 20.0


@pytest.mark.parametrize("k", [1, 4, 8, 16, 24, 31])
def test_a_loading_instance_at_k_of_l_gives_the_pair_the_layer_level_throughput(k: int) -> None:
    _, off_speedup, alone = _pair(zigzag=False, k=k)
    sim, speedup, paired = _pair(zigzag=True, k=k)
    expected = L * pair_throughput(L, k)  # the fluid optimum, relative to one instance alone
    assert off_speedup == 1.0
    assert speedup == pytest.approx(expected)
    assert paired / alone == pytest.approx(expected, rel=0.01)
    # The discrete layer-time simulation of the heuristic reaches the same figure.
    assert L * layer_level_throughput(L, k, horizon=50_000) == pytest.approx(expected, rel=3e-3)
    # Every prefill finished on the boosted partner; the loading instance's share of each is
    # 1 - 1/speedup, and no request ever sits on the loading instance itself.
    assert sim.zigzag_assisted > 0
    assert sim.zigzag_served_while_loading == pytest.approx(sim.zigzag_assisted * (1 - 1 / expected))
    assert sim.workers[NEW].stats.prefill_tokens == 0 and sim.workers[NEW].empty


def test_zigzag_off_or_gate_shut_or_no_layer_serves_nothing_while_loading() -> None:
    off, speedup, _ = _pair(zigzag=False, k=16)
    assert speedup == 1.0 and off.zigzag_assisted == 0 and off.zigzag_served_while_loading == 0
    assert not off.boosted
    # The live GM's gate: one request on the partner, nothing waiting, TTFT well under 1 s.
    idle, speedup, _ = _pair(zigzag=True, k=16, queued=1)
    assert speedup == 1.0 and idle.zigzag_assisted == 0
    # No layer yet: nothing to run.
    empty, speedup, _ = _pair(zigzag=True, k=0)
    assert speedup == 1.0 and empty.zigzag_assisted == 0
    # The ungated upper bound pairs regardless of the gate.
    _, speedup, _ = _pair(zigzag=True, k=16, queued=1, gate="always")
    assert speedup == pytest.approx(2.0)


def test_pulled_zigzag_speeds_the_partner_up_only_while_requests_wait_in_its_queue() -> None:
    # Saturated: requests wait, the loading instance runs ahead the partner's queued prompts.
    sim, speedup, _ = _pair(zigzag=True, k=8, dispatch="pull")
    assert speedup == pytest.approx(L * pair_throughput(L, 8))
    assert sim.zigzag.partner == {NEW: OLD} and sim.zigzag.split_with == {NEW: OLD}
    # One request, admitted at once: nothing waits, nothing to hand over, no speedup.
    idle, speedup, _ = _pair(zigzag=True, k=8, queued=1, dispatch="pull")
    assert speedup == 1.0 and idle.zigzag_assisted == 0 and NEW not in idle.zigzag.split_with


def test_a_prompt_admitted_but_not_started_counts_as_waiting_for_a_pulled_partner() -> None:
    # The simulated worker admits past the step's token budget; the live engine would still
    # hold those prompts waiting, so a pulled partner hands them over too.
    sim, _, _ = _pair(zigzag=False, k=0, queued=0)
    worker = sim.workers[OLD]
    assert not worker.unstarted_prompts
    for i in range(3):
        worker.submit(SimRequest(i, sim.loop.now_s, worker.max_num_tokens, 1))
    assert worker.waiting and worker.unstarted_prompts  # the first runs, two queue behind its step
    for _ in range(10_000):  # a bound: the first step ends within seconds of simulated time
        if not worker.waiting:
            break
        sim.loop.run(sim.loop.now_s + 0.01)
    # Both admitted when the step ended, one step's budget for one of them: nothing prefilled
    # of either yet, and the live engine would still hold the second waiting.
    assert not worker.waiting and [r.prefilled for r in worker.prefilling] == [0, 0]
    assert worker.unstarted_prompts


def test_the_decode_bound_prices_a_boosted_partners_decode_at_nothing() -> None:
    """`zigzag_decode_free_bound`: a sped-up partner's decode rows and context cost nothing
    (a bound on pipelined decode); unboosted, or with the bound off, they cost what they do."""
    costs = {}
    for bound in (False, True):
        # Every step an event (the fast path gives the same: test_simulate_fastpath).
        cfg = _config(gpus=1, zigzag_decode_free_bound=bound, fast_path=False)
        sim = Simulation(cfg)
        w = sim.workers[OLD]
        for i in range(64):
            w.submit(SimRequest(i, 0.0, 512, 400))
        sim.loop.run(2.0)  # all prefilled, decoding
        assert len(w.decoding) == 64
        n = len(w.stats.tbts)
        sim.loop.run(3.0)
        plain = statistics.median(w.stats.tbts[n:])  # each decode step's duration
        w.speedup = 2.0
        n = len(w.stats.tbts)
        sim.loop.run(4.0)
        costs[bound] = (plain, statistics.median(w.stats.tbts[n:]))
    (plain_off, boosted_off), (plain_on, boosted_on) = costs[False], costs[True]
    assert plain_on == pytest.approx(plain_off)  # unboosted: the same steps
    # Boosted: half the time each (the context grew a little between the two windows).
    assert boosted_off == pytest.approx(plain_off / 2, rel=0.05)
    base = (w.step.base + w.step.overhead) / 2  # boosted under the bound: no rows, no context
    assert boosted_on < boosted_off and boosted_on == pytest.approx(base)


def test_partner_speedup_extends_the_pair_model_to_shared_partners() -> None:
    for k in range(1, L):
        assert partner_speedup(L, [k]) == pytest.approx(L * pair_throughput(L, k))
    # Below L/2 the partner is the bottleneck: a second loading instance adds nothing.
    assert partner_speedup(L, [8, 8]) == pytest.approx(partner_speedup(L, [8]))
    # Near L each loading instance is a whole one: it runs k layers, the partner L - k.
    assert partner_speedup(L, [30, 30, 30]) == pytest.approx(4.0)
    # Never more than the instances involved, all busy.
    assert all(partner_speedup(L, [k] * n) <= 1 + n + 1e-12 for k in range(1, L + 1) for n in (1, 2, 3, 8))
    # All L layers (the embedding and head still loading): a whole instance beside the partner.
    assert partner_speedup(L, [L]) == pytest.approx(2.0)
    assert partner_speedup(L, [L, L, 30]) == pytest.approx(3.0 + partner_speedup(L, [30]) - 1.0)


def test_live8b_stop_the_world_serves_only_on_serving_instances() -> None:
    (cfg,), meta = live8b_runs(("stop_the_world",), gbps=10.0)
    sim = Simulation(cfg)
    initial = {v.instance_id for v in sim.registry.views() if v.state is InstanceState.SERVING}
    summary = sim.run()
    assert summary["lost"] == 0 and summary["completed"] == summary["requests_sent"]
    assert summary["loads"]["count"] > 20 and summary["loads"]["mean_s"] > 1.0  # loads take seconds
    assert summary["zigzag"] == {
        "assisted_requests": 0,
        "served_while_loading": 0.0,
        "loading_instances_paired": 0,
        "hand_back_requested": 0,
        "hand_backs_waited": 0,
        "hand_back_wait_max_s": 0.0,
    }
    assert summary["zigzag_boost_instance_s"] == 0
    assert all(w.speedup == 1.0 for w in sim.workers.values())
    # When each instance first reached SERVING (a drained one may load again later).
    serving_at: dict[str, float] = {}
    for t, iid in sim.reached_serving:
        serving_at.setdefault(iid, t)
    for r in sim.requests:
        # Initially serving, or SERVING before this request's first token.
        assert r.first_token_s is not None
        assert r.worker in initial or serving_at[r.worker] <= r.first_token_s
    assert meta["sizing"]["initial"] == 8
