"""bench.simulate's fast paths against the step-by-step reference: event skipping in the
worker, the least-loaded index beside `plan_route`, streamed arrivals, and the hour1000
scenario's pieces. Every comparison is for identity, not closeness."""

from __future__ import annotations

import dataclasses
import json
import random
from pathlib import Path
from typing import Any

import pytest

from bench.simulate.__main__ import _write_key
from bench.simulate.cluster import RunConfig, Simulation
from bench.simulate.events import EventLoop
from bench.simulate.fastroute import IndexedRegistry
from bench.simulate.links import ClusterSpec, Network, gbps
from bench.simulate.profiles import PUBLISHED_PROFILES
from bench.simulate.scenarios import SCENARIOS, build_runs, replicate
from bench.simulate.worker import SimRequest, SimWorker
from blitzmesh.replay.schedule import Arrival
from blitzmesh.replay.summary import Slo
from services.global_manager.core.routing import plan_route
from services.global_manager.core.types import InstanceState, LoadSample, Role

pytestmark = [pytest.mark.timeout(120), pytest.mark.filterwarnings("error")]

H100 = PUBLISHED_PROFILES["h100-llama3-8b"]


def _both(cfg: RunConfig) -> tuple[tuple[dict[str, Any], list[tuple[Any, ...]], int], ...]:
    out = []
    for fast in (False, True):
        sim = Simulation(dataclasses.replace(cfg, fast_path=fast))
        summary = sim.run()
        events = summary.pop("sim_events")
        summary.pop("sim_wall_s")
        per_request = [(r.index, r.first_token_s, r.end_s, r.worker, r.generated, r.resumed) for r in sim.requests]
        out.append((summary, per_request, events))
    return tuple(out)


@pytest.mark.parametrize("variant", ["blitzmesh", "hpa", "serverlessllm", "fixed_peak"])
def test_fast_path_gives_the_reference_results_on_smoke(variant: str) -> None:
    (cfg,), _ = build_runs(SCENARIOS["smoke"], (variant,))
    (ref, ref_requests, ref_events), (fast, fast_requests, fast_events) = _both(cfg)
    assert fast_requests == ref_requests  # every TTFT and end time, bit for bit
    assert fast == ref
    assert fast_events < ref_events


@pytest.mark.parametrize("variant", ["pd_kill", "pd_migrate", "colocated"])
def test_fast_path_gives_the_reference_results_with_pd_kills_and_migration(variant: str) -> None:
    (cfg,), _ = build_runs(SCENARIOS["disagg16"], (variant,))
    (ref, ref_requests, ref_events), (fast, fast_requests, fast_events) = _both(cfg)
    assert fast_requests == ref_requests
    assert fast == ref
    assert fast_events < ref_events


@pytest.mark.parametrize(
    ("live", "gate", "dispatch", "bound"),
    [
        ("all", "always", "route", False),
        ("tails", "all_overloaded", "route", False),
        ("all", "all_overloaded", "route", False),
        ("all", "all_overloaded", "pull", False),
        ("all", "always", "route", True),
    ],
)
def test_fast_path_gives_the_reference_results_with_report_windows_and_zigzag(
    live: str, gate: str, dispatch: str, bound: bool
) -> None:
    # The engine-faithful reports (per-step appends to a sliding window) and ZigZag's speedups
    # changing under running spans: a small H100 cluster under a burst, every target live.
    arrivals = [Arrival(i, 0.02 * i, 1500 + 37 * (i % 11), 20 + 13 * (i % 7)) for i in range(1500)]
    cfg = RunConfig(
        name="zz",
        profile=H100,
        cluster=ClusterSpec(hosts=2, gpus_per_host=4, hosts_per_leaf=1, rdma_gbps=10.0),
        arrivals=tuple(arrivals),
        initial=1,
        max_instances=8,
        policy_params={"target_requests_per_instance": 4.0, "scale_out_cooldown_s": 1.0},
        slo=Slo(ttft_s=1.0, tbt_s=0.1),
        report_window_s=10.0,
        zigzag_live=live,  # type: ignore[arg-type]
        zigzag_gate=gate,  # type: ignore[arg-type]
        zigzag_ttft_s=0.5,
        zigzag_dispatch=dispatch,  # type: ignore[arg-type]
        zigzag_decode_free_bound=bound,
        grace_s=120.0,
    )
    (ref, ref_requests, _), (fast, fast_requests, _) = _both(cfg)
    if gate == "always" or dispatch == "pull":
        assert ref["zigzag"]["loading_instances_paired"] > 0  # the speedups did change mid-run
    assert fast_requests == ref_requests
    assert fast == ref


# ---- the worker alone ----------------------------------------------------------------------
def _drive(skip: bool, seed: int) -> tuple[list[tuple[Any, ...]], list[LoadSample], list[float]]:
    """One worker, requests arriving at random times (some while it decodes), its speedup
    changing and heartbeats sampled in between; what it reports and when each request ends."""
    loop = EventLoop(seed)
    rng = random.Random(seed)
    done: list[SimRequest] = []
    w = SimWorker("w", "h", dataclasses.replace(H100, max_batch=6), loop, lambda r: None, done.append, lambda i: None)
    w.skip = skip
    w.kv_total = 40  # KV for only a few requests: admissions wait on finishes
    samples: list[LoadSample] = []
    requests = [SimRequest(i, rng.uniform(0, 5), rng.randint(10, 200), rng.randint(2, 60)) for i in range(60)]
    for r in requests:
        loop.at(r.arrival_s, lambda r=r: w.submit(r))
    for k in range(12):
        loop.at(0.41 * k + 0.2, lambda k=k: setattr(w, "speedup", 1.0 + (k % 3) / 2))

    def heartbeat() -> None:
        sample = w.sample(loop.now_s, 0.25, serving=True)
        # The queued prompt tokens, kept as they change, against a count from scratch.
        queued = sum(r.ctx for r in w.waiting if r.phase != "decode")
        assert sample.waiting_prefill_tokens == queued + sum(r.ctx - r.prefilled for r in w.prefilling)
        samples.append(sample)

    def rebalance() -> None:  # queued requests leave and (no better instance) come back
        for r in w.release_waiting(2):
            w.submit(r)

    loop.every(0.25, heartbeat, start_s=0.25)
    for k in range(8):
        loop.at(0.63 * k + 0.1, rebalance)
    loop.run(30.0)
    ends = [(r.index, r.first_token_s, r.end_s) for r in requests]
    return ends, samples, [w.busy_s, w.step_no]


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_worker_skipping_decode_steps_matches_stepping_them(seed: int) -> None:
    ref = _drive(False, seed)
    fast = _drive(True, seed)
    assert all(end is not None for _, _, end in ref[0])
    assert fast == ref


def test_worker_does_skip_steps() -> None:
    loop = EventLoop()
    w = SimWorker("w", "h", H100, loop, lambda r: None, lambda r: None, lambda i: None)
    w.submit(SimRequest(0, 0.0, 100, 500))
    loop.run(60.0)
    assert w.step_no == 500 and loop.events_run < 10  # spans of 8, 16, ... 256 steps


def test_a_live_migration_leaves_rows_too_close_to_their_end() -> None:
    """As the engine's `release_running(min_tokens_left=...)`: the manager's hand-back moves
    only rows with enough tokens left to be worth a move."""
    loop = EventLoop()
    w = SimWorker("w", "h", H100, loop, lambda r: None, lambda r: None, lambda i: None)
    near, far = SimRequest(0, 0.0, 100, 30), SimRequest(1, 0.0, 100, 500)
    w.submit(near)
    w.submit(far)
    loop.run(0.2)  # both decoding; `near` has fewer than 30 tokens left, `far` hundreds
    assert len(w.decoding) == 2
    assert [r.index for r in w.release_running(2, min_tokens_left=50)] == [1]
    assert far.generated > 0 and far.remaining >= 50
    assert [r.index for r in w.release_running(2, min_tokens_left=50)] == []


# ---- routing index ---------------------------------------------------------------------------
def _plan_route(reg: IndexedRegistry, tokens: int, exclude: set[str]) -> tuple[Any, ...]:
    """The core's answer for a request of `tokens` (16-token KV blocks) on model "m"."""
    return plan_route(
        reg.views(model="m"),
        model="m",
        prompt_tokens=tokens,
        max_tokens=0,
        exclude_ids=exclude,
        kv_block_size_tokens=16,
    )


def test_least_loaded_index_agrees_with_plan_route() -> None:
    rng = random.Random(3)
    reg = IndexedRegistry("m")
    ids = [f"i{n:03d}" for n in range(60)]
    for iid in ids:
        reg.register(iid, model="m", role=Role.COLOCATED, host=f"h{rng.randint(0, 7)}", num_layers=4, now_s=0.0)
    checked = 0
    for step in range(3000):
        iid = rng.choice(ids)
        view = reg.get(iid)
        roll = rng.random()
        if view.state is InstanceState.IDLE and roll < 0.5:
            reg.transition(iid, InstanceState.LOADING, model="m")
        elif view.state is InstanceState.LOADING:
            reg.transition(iid, InstanceState.SERVING)
        elif view.state is InstanceState.SERVING and roll < 0.05:
            reg.transition(iid, InstanceState.DRAINING)
        elif view.state is InstanceState.DRAINING:
            reg.transition(iid, InstanceState.IDLE)
        elif view.state is InstanceState.SERVING and roll < 0.5:
            total = rng.choice([0, 100])
            reg.heartbeat(
                LoadSample(
                    iid,
                    now_s=float(step),
                    running=rng.randint(0, 4),
                    waiting=rng.randint(0, 2),
                    kv_blocks_used=rng.randint(0, total),
                    kv_blocks_total=total,
                )
            )
        elif view.state is InstanceState.SERVING:
            reg.note_routed(iid)
        tokens = rng.choice([16, 400, 1200, 1700])
        exclude = set(rng.sample(ids, rng.choice([0, 0, 1, 3, 40])))
        got = reg.index.route(tokens, 16, exclude)
        want = _plan_route(reg, tokens, exclude)
        if got is not None:
            assert got == want
            checked += 1
    assert checked > 2000
    # A serving prefill instance: only plan_route can say (it may pair).
    reg.register("p", model="m", role=Role.PREFILL, host="h0", num_layers=4, now_s=0.0, state=InstanceState.SERVING)
    assert reg.index.route(16, 16) is None


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_route_many_answers_as_plan_route_one_after_another(seed: int) -> None:
    """A rebalance's batch: `route_many` gives what `plan_route` gives for each request in
    turn with the previous ones noted, up to where it stops, and stops only where the index
    could not answer or the answer is dead; the registry is left as noting each would."""
    rng = random.Random(seed)
    batches = stopped_early = 0
    for _ in range(300):
        reg = IndexedRegistry("m")
        ids = [f"i{n:02d}" for n in range(rng.randint(1, 8))]
        for iid in ids:
            reg.register(iid, model="m", role=Role.COLOCATED, host="h0", num_layers=4, now_s=0.0)
            if rng.random() < 0.8:
                reg.transition(iid, InstanceState.LOADING, model="m")
                reg.transition(iid, InstanceState.SERVING)
                if rng.random() < 0.8:
                    total = rng.choice([0, 40, 100])
                    reg.heartbeat(
                        LoadSample(
                            iid,
                            now_s=1.0,
                            running=rng.randint(0, 3),
                            waiting=rng.randint(0, 3),
                            kv_blocks_used=rng.randint(0, total),
                            kv_blocks_total=total,
                        )
                    )
                for _ in range(rng.randint(0, 3)):
                    reg.note_routed(iid)
        exclude = set(rng.sample(ids, rng.choice([0, 1])))
        dead = set(rng.sample(ids, rng.choice([0, 0, 1])))
        sizes = [rng.choice([16, 160, 400, 900]) for _ in range(rng.randint(2, 12))]
        hops = reg.index.route_many(sizes, 16, exclude, dead)
        expected = IndexedRegistry("m")  # the same registry, noted one request at a time
        for v in reg:
            expected.register(v.instance_id, model="m", role=v.role, host=v.host, num_layers=4, now_s=0.0)
            if v.state is InstanceState.SERVING:
                expected.transition(v.instance_id, InstanceState.LOADING, model="m")
                expected.transition(v.instance_id, InstanceState.SERVING)
                if v.load is not None:
                    expected.heartbeat(v.load)
                for _ in range(v.routes_since_heartbeat):
                    expected.note_routed(v.instance_id)
        for i, tokens in enumerate(sizes):
            want = _plan_route(expected, tokens, exclude)
            if i == len(hops):
                # It stopped here, and only where the index asked alone would not answer (only
                # `plan_route` can say), nothing serves, or the answer is dead.
                alone = expected.index.route(tokens, 16, exclude)
                assert alone is None or alone == () or alone[0].instance_id in dead
                if alone is not None:
                    assert alone == want
                stopped_early += 1
                break
            assert want and hops[i].instance_id == want[0].instance_id
            expected.note_routed(want[0].instance_id)
        counts: dict[str, int] = {}
        for hop in hops:
            counts[hop.instance_id] = counts.get(hop.instance_id, 0) + 1
        for iid, n in counts.items():
            reg.note_routed(iid, n)
        assert [(v.instance_id, v.routes_since_heartbeat) for v in reg] == [
            (v.instance_id, v.routes_since_heartbeat) for v in expected
        ]
        batches += bool(hops)
    assert batches > 100 and stopped_early > 20


# ---- event loop, workload, results file ------------------------------------------------------
def test_stream_runs_in_the_order_of_timers_scheduled_up_front() -> None:
    times = [0.0, 0.5, 0.5, 1.0, 1.0, 1.0, 2.5]

    def trace(streamed: bool) -> list[tuple[float, str]]:
        loop = EventLoop()
        seen: list[tuple[float, str]] = []
        loop.at(0.5, lambda: seen.append((loop.now_s, "before")))
        if streamed:
            loop.stream(times, lambda i: seen.append((loop.now_s, f"a{i}")))
        else:
            for i, t in enumerate(times):
                loop.at(t, lambda i=i: seen.append((loop.now_s, f"a{i}")))
        loop.at(1.0, lambda: seen.append((loop.now_s, "after")))
        loop.every(0.5, lambda: seen.append((loop.now_s, "tick")))
        loop.run(3.0)
        return seen

    assert trace(True) == trace(False)


def test_replicate_scales_the_rate_and_keeps_the_shape() -> None:
    base = [Arrival(i, 10.0 * i, 100 + i, 5 + i) for i in range(30)]
    out = replicate(base, 7, 3.0, seed=1)
    assert out == replicate(base, 7, 3.0, seed=1)
    assert len(out) == 7 * 30
    assert [a.index for a in out] == list(range(len(out)))
    assert [a.t_s for a in out] == sorted(a.t_s for a in out)
    for a in out:
        src = base[a.prompt_tokens - 100]
        assert a.output_tokens == src.output_tokens and 0 <= a.t_s - src.t_s < 3.0


def test_hour1000_is_a_thousand_instance_cluster_of_an_8b_published_profile() -> None:
    sc = SCENARIOS["hour1000"]
    assert sc.profile() in PUBLISHED_PROFILES.values()
    assert sc.max_instances == 1000
    assert sc.cluster.hosts * sc.cluster.gpus_per_host >= 1000
    assert sc.variants == ("blitzmesh",)
    assert sc.wall_key == "wall_s_1h_1000"


def test_write_key_keeps_the_other_keys(tmp_path: Path) -> None:
    path = tmp_path / "simulator.json"
    path.write_text(json.dumps({"validation": {"a": 1}}), encoding="utf-8")
    _write_key(path, "wall_s_1h_1000", {"wall_s": 1.5})
    assert json.loads(path.read_text(encoding="utf-8")) == {"validation": {"a": 1}, "wall_s_1h_1000": {"wall_s": 1.5}}


# ---- link sharing -----------------------------------------------------------------------------
def _scan_rates(net: Network) -> dict[int, float]:
    """Progressive filling as first written: every round scans every link for the least share."""
    cap: dict[int, float] = {}
    left: dict[int, int] = {}
    for flow in net.flows.values():
        for li in flow.links:
            cap.setdefault(li, net.links[li].bytes_per_s)
            left[li] = left.get(li, 0) + 1
    rates: dict[int, float] = {}
    while len(rates) < len(net.flows):
        li = min((i for i in cap if left[i] > 0), key=lambda i: (cap[i] / left[i], i))
        share = cap[li] / left[li]
        for fid in sorted(net.links[li].flows - set(rates)):
            rates[fid] = share
            for lj in net.flows[fid].links:
                cap[lj] = max(0.0, cap[lj] - share)
                left[lj] -= 1
    return rates


@pytest.mark.parametrize("seed", range(40))
def test_link_rates_from_the_heap_match_scanning_every_link(seed: int) -> None:
    rng = random.Random(seed)
    net = Network(EventLoop())
    n = rng.randint(1, 30)
    for i in range(n):
        net.add_link(f"l{i}", rng.choice([50.0, 100.0, 200.0, 33.3, gbps(200.0)]))
    for _ in range(rng.randint(1, 60)):
        net.start(tuple(rng.sample(range(n), rng.randint(1, min(4, n)))), rng.uniform(1, 1000), lambda: None)
    assert {fid: f.rate for fid, f in net.flows.items()} == _scan_rates(net)


def test_the_workers_report_built_through_its_slots_equals_the_constructors() -> None:
    from bench.simulate.worker import _SAMPLE_GIVEN, _load_sample

    values: list[Any] = ["i7", 3.5, 120.0, 900.0, 0.2, 0.9, None, 0.05, 4, 2, 3000, 40, 100, 8000.0]
    built = _load_sample(*values)
    assert type(built) is LoadSample
    assert built == LoadSample(**dict(zip(_SAMPLE_GIVEN, values, strict=True)))
    with pytest.raises(ValueError, match="kv_blocks_used=101"):
        _load_sample(*values[:11], 101, 100, 8000.0)
    with pytest.raises(ValueError):
        _load_sample(*values[:-1])  # every reported field must be given
