"""bench.simulate's parts alone: the event loop, link sharing, chain loads against the closed
form, the ZigZag layer-level model, and the worker's step-time formula."""

from __future__ import annotations

import pytest

from bench.simulate.events import EventLoop
from bench.simulate.links import ClusterSpec, LeafSpine, Network, gbps
from bench.simulate.profiles import PUBLISHED_PROFILES, FastStep, measured_profile
from bench.simulate.transfer import Transfer
from bench.simulate.worker import SimRequest, SimWorker
from bench.simulate.zigzag import layer_level_throughput
from services.common.worker_profile import StepFeatures
from services.global_manager.core.multicast import (
    HostLink,
    Source,
    Target,
    Topology,
    chain_fill_time_s,
    plan_multicast,
)
from services.global_manager.core.zigzag import pair_throughput

pytestmark = [pytest.mark.timeout(30), pytest.mark.filterwarnings("error")]


# ---- event loop ------------------------------------------------------------------------------
def _trace(seed: int) -> list[tuple[float, str, float]]:
    loop = EventLoop(seed)
    out: list[tuple[float, str, float]] = []

    def fire(name: str) -> None:
        out.append((loop.now_s, name, round(loop.rng.random(), 12)))
        if len(out) < 40:
            loop.after(loop.rng.choice([0.0, 0.5, 1.0]), lambda: fire(f"{name}+"))

    for name in ("a", "b", "c"):
        loop.at(1.0, lambda name=name: fire(name))  # a tie: insertion order decides
    loop.run(100.0)
    return out


def test_event_loop_is_deterministic_with_a_seed() -> None:
    first = _trace(7)
    assert first == _trace(7)
    assert first != _trace(8)
    assert [name for _, name, _ in first[:3]] == ["a", "b", "c"]
    times = [t for t, _, _ in first]
    assert times == sorted(times)


def test_every_stays_on_its_grid_and_cancelled_timers_do_not_run() -> None:
    loop = EventLoop()
    seen: list[float] = []
    loop.every(0.1, lambda: seen.append(loop.now_s))
    timer = loop.at(0.35, lambda: seen.append(-1.0))
    timer.cancel()
    loop.run(60.0)
    assert len(seen) == 601
    assert seen[-1] == pytest.approx(60.0, abs=1e-12)
    assert -1.0 not in seen


# ---- links -----------------------------------------------------------------------------------
def _done_times(net: Network, flows: list[tuple[tuple[int, ...], float]]) -> list[float]:
    done: list[float] = [0.0] * len(flows)
    for i, (links, size) in enumerate(flows):
        net.start(links, size, lambda i=i: done.__setitem__(i, net.loop.now_s))
    net.loop.run(1e9)
    return done


def test_two_flows_on_one_link_each_get_half() -> None:
    net = Network(EventLoop())
    link = net.add_link("l", 100.0)  # bytes per second
    assert _done_times(net, [((link,), 100.0), ((link,), 100.0)]) == pytest.approx([2.0, 2.0])


def test_a_flow_that_ends_frees_its_share() -> None:
    net = Network(EventLoop())
    link = net.add_link("l", 100.0)
    # Both at 50 B/s until the short one ends at t=1; the long one then has the link: 150 B left.
    assert _done_times(net, [((link,), 50.0), ((link,), 200.0)]) == pytest.approx([1.0, 2.5])


def test_max_min_fairness_across_a_bottleneck() -> None:
    net = Network(EventLoop())
    a, b = net.add_link("a", 100.0), net.add_link("b", 30.0)
    # Flow 1 crosses a and b (b is its bottleneck: 15 while shared with flow 2, which also
    # crosses b); flow 3 on a alone gets what flow 1 leaves of a.
    net.start((a, b), 1e9, lambda: None)
    net.start((b,), 1e9, lambda: None)
    net.start((a,), 1e9, lambda: None)
    rates = sorted(f.rate for f in net.flows.values())
    assert rates == pytest.approx([15.0, 15.0, 85.0])


def test_leaf_spine_paths() -> None:
    spec = ClusterSpec(hosts=4, gpus_per_host=2, hosts_per_leaf=2)
    fabric = LeafSpine(Network(EventLoop()), spec)
    names = lambda s, d: [fabric.net.links[i].name for i in fabric.path(s, d)]  # noqa: E731
    assert names("h00g0", "h00g1") == ["nvl_out@h00g0", "nvl_in@h00g1"]
    assert names("h00g0", "h01g0") == ["nic_out@h00g0", "nic_in@h01g0"]
    assert names("h00g0", "h02g1") == ["nic_out@h00g0", "up@leaf0", "down@leaf1", "nic_in@h02g1"]
    assert names("mem@h01", "h01g1") == ["pcie@h01g1"]
    assert names("ssd@h01", "h01g1") == ["ssd@h01", "pcie@h01g1"]
    assert names("ssd@h01", "mem@h01") == ["ssd@h01"]


# ---- chain loads -----------------------------------------------------------------------------
@pytest.mark.parametrize("n_targets", [1, 2, 3, 5])
def test_chain_load_time_matches_the_closed_form(n_targets: int) -> None:
    """The real planner's chain from one serving GPU to n GPUs on other hosts of its leaf, timed
    on the links: size/bw + (n - 1) * chunk/bw, chunk = one layer."""
    layers, layer_bytes, bw = 16, 1e9, 200.0
    spec = ClusterSpec(hosts=n_targets + 1, gpus_per_host=1, hosts_per_leaf=n_targets + 1, rdma_gbps=bw)
    fabric = LeafSpine(Network(EventLoop()), spec)
    topology = Topology(hosts={spec.host_name(h): HostLink("leaf0", bw) for h in range(spec.hosts)})
    groups = tuple(f"layer.{i:03d}" for i in range(layers))
    targets = [Target(spec.gpu_name(h, 0), spec.host_name(h)) for h in range(1, spec.hosts)]
    plan = plan_multicast(targets, [Source("h00g0", "h00")], topology, groups=groups)
    assert len(plan.chains) == 1 and len(plan.chains[0].hops) == n_targets
    done: dict[str, float] = {}
    progress: dict[str, int] = {}
    t = Transfer.from_plan(
        plan,
        fabric,
        dict.fromkeys(groups, layer_bytes),
        groups,
        {},
        on_group=lambda node, g: progress.__setitem__(node, progress.get(node, 0) + 1),
        on_done=lambda node: done.__setitem__(node, fabric.net.loop.now_s),
    )
    t.start()
    fabric.net.loop.run(1e9)
    expected = chain_fill_time_s(layers * layer_bytes, layer_bytes, n_targets, bw)
    assert max(done.values()) == pytest.approx(expected, rel=1e-9)
    assert all(progress[x.node_id] == layers for x in targets)
    # Nearly independent of n: sequential unicast would take n * size/bw.
    assert max(done.values()) < layers * layer_bytes / gbps(bw) * (1 + n_targets / layers)


def test_sharded_load_with_allgather_on_one_host() -> None:
    """Two sources on other hosts, two targets on one host: each source sends half the layers
    to a different target, which all-gather the rest over NVLink (much faster than the NIC)."""
    layers, layer_bytes, bw = 8, 1e9, 200.0
    spec = ClusterSpec(hosts=3, gpus_per_host=2, hosts_per_leaf=3, rdma_gbps=bw, nvlink_gbps=3600.0)
    fabric = LeafSpine(Network(EventLoop()), spec)
    topology = Topology(hosts={spec.host_name(h): HostLink("leaf0", bw) for h in range(3)})
    groups = tuple(f"layer.{i:03d}" for i in range(layers))
    plan = plan_multicast(
        [Target("h02g0", "h02"), Target("h02g1", "h02")],
        [Source("h00g0", "h00"), Source("h01g0", "h01")],
        topology,
        groups=groups,
    )
    assert len(plan.chains) == 2 and plan.allgather
    done: dict[str, float] = {}
    t = Transfer.from_plan(
        plan,
        fabric,
        dict.fromkeys(groups, layer_bytes),
        groups,
        {},
        on_group=lambda node, g: None,
        on_done=lambda node: done.__setitem__(node, fabric.net.loop.now_s),
    )
    t.start()
    fabric.net.loop.run(1e9)
    half_over_nic = layers / 2 * layer_bytes / gbps(bw)
    one_layer_nvlink = layer_bytes / gbps(3600.0)
    assert sorted(done) == ["h02g0", "h02g1"]
    assert max(done.values()) == pytest.approx(half_over_nic + one_layer_nvlink, rel=1e-6)


# ---- ZigZag ------------------------------------------------------------------------------------
@pytest.mark.parametrize(("k", "expected"), [(0, 1 / 7), (1, 1 / 6), (4, 2 / 7), (7, 2 / 7)])
def test_zigzag_seven_layer_vector(k: int, expected: float) -> None:
    """docs/algorithms.md 3: 1/7 alone, 1/6 with one layer, twice the old rate from half the layers."""
    assert pair_throughput(7, k) == pytest.approx(expected)
    assert layer_level_throughput(7, k) == pytest.approx(expected, rel=1e-3)


def test_zigzag_layer_level_model_matches_the_fluid_optimum_for_every_k() -> None:
    for k in range(0, 33):
        assert layer_level_throughput(32, k, horizon=50_000) == pytest.approx(pair_throughput(32, k), rel=2e-3)


# ---- workers -----------------------------------------------------------------------------------
@pytest.mark.parametrize("profile", [measured_profile(), *PUBLISHED_PROFILES.values()], ids=lambda p: p.device)
def test_fast_step_is_the_step_time_model(profile) -> None:  # type: ignore[no-untyped-def]
    fast = FastStep(profile.step)
    for f in (
        StepFeatures(prefill_tokens=300, prefill_attn_pairs=45150, prefill_seqs=1),
        StepFeatures(decode_rows=24, decode_context_tokens=24 * 900),
        StepFeatures(
            prefill_tokens=64, prefill_attn_pairs=2080, prefill_seqs=2, decode_rows=8, decode_context_tokens=800
        ),
        StepFeatures(),
    ):
        got = fast(f.prefill_tokens, f.prefill_attn_pairs, f.prefill_seqs, f.decode_rows, f.decode_context_tokens)
        assert got == pytest.approx(profile.step.step_s(f), rel=1e-12)


def test_published_h100_estimate_is_in_a_plausible_range() -> None:
    step = FastStep(PUBLISHED_PROFILES["h100-llama3-8b"].step)
    # Batch-64 decode at 1k context: ~12 ms (about 5k tokens/s), weights-read bound.
    assert 0.008 < step(0, 0, 0, 64, 64_000) < 0.02


def test_worker_runs_one_request_on_the_step_model() -> None:
    profile = measured_profile()
    loop = EventLoop()
    finished: list[SimRequest] = []
    w = SimWorker("w", "h", profile, loop, lambda r: None, finished.append, lambda iid: None)
    r = SimRequest(0, 0.0, prompt=40, output=5)
    w.submit(r)
    loop.run(100.0)
    fast = FastStep(profile.step)
    prefill = fast(40, 40 * 41 / 2, 1, 0, 0)
    decode = sum(fast(0, 0, 0, 1, 41 + i) for i in range(4))
    assert finished == [r]
    assert r.first_token_s == pytest.approx(prefill)
    assert r.end_s == pytest.approx(prefill + decode)
    assert w.kv_used == 0 and w.empty and not w.busy
