"""bench.simulate's second slice: P/D disaggregation with KV transfers timed on the links, KV and
parameter loads sharing those links, failures the real Reconciler finds LOST and replaces, and
the core's live migrations carried out with their KV."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest

from bench.simulate.cluster import Kill, RunConfig, Simulation
from bench.simulate.links import ClusterSpec, gbps
from bench.simulate.profiles import (
    PUBLISHED_PROFILES,
    SMOLLM2_135M_CONFIG,
    FastStep,
    kv_bytes_per_token,
)
from bench.simulate.transfer import Transfer
from blitzmesh.replay.schedule import Arrival
from services.global_manager.core.actions import LoadInstances, MigrateRequests
from services.global_manager.core.multicast import HostLink, Source, Target, Topology, plan_multicast
from services.global_manager.core.types import InstanceState, Role

pytestmark = [pytest.mark.timeout(60), pytest.mark.filterwarnings("error")]

H100 = PUBLISHED_PROFILES["h100-llama3-8b"]
REPO_ROOT = Path(__file__).resolve().parents[2]


def _pd_config(cluster: ClusterSpec, arrivals: list[Arrival], **kw: object) -> RunConfig:
    base: dict[str, object] = {
        "name": "pd",
        "profile": H100,
        "cluster": cluster,
        "arrivals": tuple(arrivals),
        "autoscale": False,
        "disaggregated": True,
        "initial_prefill": 1,
        "initial_decode": 1,
        "max_instances": cluster.hosts * cluster.gpus_per_host,
        "grace_s": 60.0,
    }
    base.update(kw)
    return RunConfig(**base)  # type: ignore[arg-type]


# ---- KV size ------------------------------------------------------------------------------------
def test_kv_bytes_per_token_from_the_model_configs() -> None:
    assert kv_bytes_per_token({"num_hidden_layers": 32, "num_attention_heads": 32, "hidden_size": 4096}, 2) == (
        2 * 32 * 32 * 128 * 2
    )  # no KV-head field: multi-head attention
    assert H100.model.kv_bytes_per_token == 2 * 32 * 8 * 128 * 2
    config = REPO_ROOT / "models" / "smollm2-135m-instruct" / "config.json"
    if config.exists():
        fields = json.loads(config.read_text(encoding="utf-8"))
        assert {k: fields[k] for k in SMOLLM2_135M_CONFIG} == SMOLLM2_135M_CONFIG


# ---- one request on a P/D pair ----------------------------------------------------------------------
@pytest.mark.parametrize(
    ("cluster", "layout", "link_gbps", "path"),
    [
        (ClusterSpec(hosts=1, gpus_per_host=2, hosts_per_leaf=1, nvlink_gbps=3600.0), "mixed", 3600.0, "nvlink"),
        (ClusterSpec(hosts=2, gpus_per_host=1, hosts_per_leaf=2, rdma_gbps=200.0), "split_hosts", 200.0, "rdma_leaf"),
        (ClusterSpec(hosts=2, gpus_per_host=1, hosts_per_leaf=1, rdma_gbps=100.0), "split_hosts", 100.0, "rdma_spine"),
    ],
    ids=["nvlink", "rdma-one-leaf", "rdma-across-spine"],
)
def test_one_request_on_a_pd_pair_matches_the_closed_form(
    cluster: ClusterSpec, layout: str, link_gbps: float, path: str
) -> None:
    """TTFT = the prefill step; then the prompt's KV (tokens x KV bytes per token) crosses the
    link at its bandwidth and the decode instance runs output - 1 steps: end = arrival + prefill
    + KV bytes / bw + decode steps."""
    prompt, output, t0 = 1000, 10, 0.1
    cfg = _pd_config(cluster, [Arrival(0, t0, prompt, output)], pd_layout=layout)
    sim = Simulation(cfg)
    summary = sim.run()
    (req,) = sim.requests
    prefill_iid, decode_iid = (
        cluster.gpu_name(0, 0),
        (cluster.gpu_name(0, 1) if cluster.gpus_per_host > 1 else cluster.gpu_name(1, 0)),
    )
    assert sim.registry.get(prefill_iid).role is Role.PREFILL
    assert sim.registry.get(decode_iid).role is Role.DECODE
    step = FastStep(H100.step)
    prefill_s = step(prompt, prompt * (prompt + 1) / 2, 1, 0, 0)
    kv_s = prompt * H100.model.kv_bytes_per_token / gbps(link_gbps)
    decode_s = sum(step(0, 0, 0, 1, prompt + 1 + i) for i in range(output - 1))
    assert req.first_token_s == pytest.approx(t0 + prefill_s, rel=1e-9)
    assert req.end_s == pytest.approx(t0 + prefill_s + kv_s + decode_s, rel=1e-9)
    assert req.worker == decode_iid
    assert summary["kv_paths"] == {path: 1}
    assert summary["kv_transfers"]["kv"]["count"] == 1
    assert summary["kv_transfers"]["kv"]["mean_ms"] == pytest.approx(1e3 * kv_s, abs=1e-4)
    assert sim.net.bytes_by_kind["kv"] == prompt * H100.model.kv_bytes_per_token
    tpot = (req.end_s - req.first_token_s) / (output - 1)
    assert tpot == pytest.approx((kv_s + decode_s) / (output - 1), rel=1e-9)
    # The prefill instance held the prompt's KV until the pull landed, then let it go.
    assert sim.workers[prefill_iid].kv_used == 0 and sim.workers[decode_iid].kv_used == 0


def test_a_request_that_ends_at_its_first_token_never_moves_kv() -> None:
    cluster = ClusterSpec(hosts=1, gpus_per_host=2, hosts_per_leaf=1)
    sim = Simulation(_pd_config(cluster, [Arrival(0, 0.1, 300, 1)]))
    summary = sim.run()
    assert summary["completed"] == 1 and summary["kv_paths"] == {}
    assert sim.requests[0].worker == cluster.gpu_name(0, 0)


# ---- KV and loads share the links ---------------------------------------------------------------------
def test_kv_transfer_during_a_chain_load_on_the_same_nic_gets_half_of_it() -> None:
    """The prefill GPU h00g0 also sends a chain load to h02g0 over its NIC: the KV pull to
    h01g0 shares nic_out@h00g0 with the load, max-min fair, so it takes twice as long as alone,
    and the load ends later by the KV's time alone (the NIC carried the KV bytes too)."""
    cluster = ClusterSpec(hosts=3, gpus_per_host=1, hosts_per_leaf=3, rdma_gbps=200.0)
    prompt, output = 2000, 4

    def run(with_load: bool) -> tuple[Simulation, float | None]:
        cfg = _pd_config(cluster, [Arrival(0, 0.05, prompt, output)], pd_layout="split_hosts", initial_decode=1)
        sim = Simulation(cfg)
        load_done: list[float] = []
        if with_load:
            groups = H100.model.groups
            topology = Topology(hosts={cluster.host_name(h): HostLink("leaf0", 200.0) for h in range(3)})
            plan = plan_multicast([Target("h02g0", "h02")], [Source("h00g0", "h00")], topology, groups=groups)
            transfer = Transfer.from_plan(
                plan,
                sim.fabric,
                sim.group_bytes,
                groups,
                {},
                on_group=lambda node, g: None,
                on_done=lambda node: load_done.append(sim.loop.now_s),
            )
            sim.loop.at(0.0, transfer.start)
        sim.run()
        sim.loop.run(sim.loop.now_s + 5.0)
        return sim, (load_done[0] if load_done else None)

    alone, _ = run(False)
    shared, load_end = run(True)
    kv_alone_s = prompt * H100.model.kv_bytes_per_token / gbps(200.0)
    assert alone.kv_times["kv"] == [pytest.approx(kv_alone_s, rel=1e-9)]
    assert shared.kv_times["kv"] == [pytest.approx(2 * kv_alone_s, rel=1e-9)]
    load_alone_s = H100.model.size_bytes / gbps(200.0)
    assert load_end == pytest.approx(load_alone_s + kv_alone_s, rel=1e-9)
    assert shared.net.bytes_by_kind["load"] == pytest.approx(H100.model.size_bytes)


# ---- failures -------------------------------------------------------------------------------------------
def _steady(n: int, span_s: float, prompt: int = 600, output: int = 200) -> list[Arrival]:
    return [Arrival(i, 0.05 + i * span_s / n, prompt, output) for i in range(n)]


@pytest.mark.parametrize("mode", ["sigkill", "hang"])
def test_a_killed_decode_instance_loses_no_request_and_the_core_tops_its_pool_up(mode: str) -> None:
    cluster = ClusterSpec(hosts=2, gpus_per_host=4, hosts_per_leaf=2)
    kill_s = 3.0
    cfg = _pd_config(
        cluster,
        _steady(300, 15.0),
        initial_prefill=2,
        initial_decode=2,
        kills=(Kill(kill_s, role=Role.DECODE, mode=mode),),  # type: ignore[arg-type]
    )
    sim = Simulation(cfg)
    summary = sim.run()
    assert summary["lost"] == 0 and summary["completed"] == 300
    (killed,) = summary["failures"]["killed"]
    victim = killed["instance_id"]
    assert killed["role"] == "decode" and killed["running"] > 0
    # Silent from the kill on: the real Reconciler marks it LOST once lost_after_s has passed
    # since its last heartbeat (on the tick grid), and tops the decode pool up from IDLE.
    lost_s = summary["failures"]["lost_at_s"][victim]
    assert kill_s + cfg.lost_after_s - cfg.heartbeat_s < lost_s <= kill_s + cfg.lost_after_s + cfg.tick_s
    assert sim.registry.get(victim).state is InstanceState.LOST
    topups = [a for a in sim.actuator.executed if isinstance(a, LoadInstances)]
    assert len(topups) == 1 and topups[0].role is Role.DECODE and topups[0].reason == "min_decode=2"
    (new,) = topups[0].instance_ids
    assert any(iid == new and t >= lost_s for t, iid in sim.reached_serving)
    assert len(sim.registry.views(role=Role.DECODE, state=InstanceState.SERVING)) == 2
    fo = summary["failures"]["failover"]
    assert fo["resumed"] >= killed["running"] - 1
    if mode == "sigkill":
        # The gateway saw the broken streams at once and resumed them.
        resumed = [r for r in sim.requests if r.resumed]
        assert resumed and all(r.end_s is not None for r in resumed)
    else:
        # Requests kept queueing on the hung instance until the core declared it LOST.
        assert fo["resumed"] + fo.get("retried", 0) > killed["running"] + killed["waiting"]
        assert all(r.end_s is not None and r.end_s > lost_s for r in sim.requests if r.resumed)


def test_a_prefill_instance_killed_mid_pull_makes_the_decode_side_recompute() -> None:
    """The prefill instance dies while its KV crosses the NIC: the pull fails at once and the
    decode instance recomputes prompt + first token, which yields the second token, then decodes
    the rest; the first token (TTFT) stands."""
    cluster = ClusterSpec(hosts=3, gpus_per_host=1, hosts_per_leaf=3, rdma_gbps=200.0)
    prompt, output, t0 = 1000, 10, 0.1
    step = FastStep(H100.step)
    prefill_s = step(prompt, prompt * (prompt + 1) / 2, 1, 0, 0)
    kv_s = prompt * H100.model.kv_bytes_per_token / gbps(200.0)
    kill_s = t0 + prefill_s + kv_s / 2
    cfg = _pd_config(cluster, [Arrival(0, t0, prompt, output)], pd_layout="split_hosts", kills=(Kill(kill_s, "h00g0"),))
    sim = Simulation(cfg)
    summary = sim.run()
    (req,) = sim.requests
    recompute_s = step(prompt + 1, (prompt + 1) * (prompt + 2) / 2, 1, 0, 0)
    decode_s = sum(step(0, 0, 0, 1, prompt + 2 + i) for i in range(output - 2))
    assert req.first_token_s == pytest.approx(t0 + prefill_s, rel=1e-9)
    assert req.end_s == pytest.approx(kill_s + recompute_s + decode_s, rel=1e-9)
    assert req.worker == "h01g0" and summary["failures"]["failover"] == {"kv_recomputed": 1}
    assert sim.net.bytes_by_kind["kv"] == pytest.approx(prompt * H100.model.kv_bytes_per_token / 2)


def test_a_killed_prefill_instance_loses_no_request_and_is_replaced() -> None:
    cluster = ClusterSpec(hosts=2, gpus_per_host=4, hosts_per_leaf=2)
    cfg = _pd_config(
        cluster,
        _steady(300, 10.0, prompt=3000, output=50),
        initial_prefill=2,
        initial_decode=2,
        kills=(Kill(2.0, role=Role.PREFILL),),
    )
    sim = Simulation(cfg)
    summary = sim.run()
    assert summary["lost"] == 0 and summary["completed"] == 300
    topups = [a for a in sim.actuator.executed if isinstance(a, LoadInstances)]
    assert [a.reason for a in topups] == ["min_prefill=2"]
    fo = summary["failures"]["failover"]
    assert fo.get("retried", 0) + fo.get("kv_recomputed", 0) > 0


# ---- live migration --------------------------------------------------------------------------------------
def test_live_migration_moves_running_requests_with_their_kv() -> None:
    """Ten requests land on one of two colocated instances (bypassing the gateway): its KV use
    passes the core's `migration_kv_high`, so the Reconciler releases running requests, which
    move with their KV (prompt + tokens so far - 1) over the NIC and finish on the other."""
    cluster = ClusterSpec(hosts=2, gpus_per_host=1, hosts_per_leaf=2, rdma_gbps=200.0)
    profile = dataclasses.replace(H100, kv_blocks=1000)
    prompt, output = 1000, 400
    cfg = RunConfig(
        name="migrate",
        profile=profile,
        cluster=cluster,
        arrivals=tuple(Arrival(i, 0.01, prompt, output) for i in range(10)),
        initial=2,
        autoscale=False,
        max_instances=2,
        live_migration=True,
        migration_kv_high=0.5,
    )
    sim = Simulation(cfg)
    sim._arrive = lambda req: sim.workers["h00g0"].submit(req)  # type: ignore[method-assign]
    summary = sim.run()
    assert summary["lost"] == 0 and summary["completed"] == 10
    migrations = [a for a in sim.actuator.executed if isinstance(a, MigrateRequests)]
    assert migrations and all(a.running and a.source == "h00g0" for a in migrations)
    moved = [r for r in sim.requests if r.worker == "h01g0"]
    assert len(moved) == summary["failures"]["failover"]["migrated"] == sum(a.n for a in migrations[:1])
    assert summary["actions"]["live_migration"] == len(migrations)
    kv = H100.model.kv_bytes_per_token
    moved_bytes = sim.net.bytes_by_kind["migration"]
    assert summary["kv_transfers"]["migration"]["count"] == len(moved)
    # Each moved the KV of every token but the last: between prompt and prompt + output tokens.
    assert len(moved) * prompt * kv < moved_bytes < len(moved) * (prompt + output) * kv
    # Migrated requests still produced all their tokens, and finish sooner than those left behind.
    assert all(r.end_s is not None for r in sim.requests)
    stayed = [r for r in sim.requests if r.worker == "h00g0"]
    assert max(r.end_s for r in moved) < max(r.end_s for r in stayed)  # type: ignore[type-var]


# ---- the disagg16 scenario ----------------------------------------------------------------------------------
def test_disagg16_runs_in_seconds_and_its_failures_are_replaced() -> None:
    import time

    from bench.simulate.scenarios import SCENARIOS, build_runs

    started = time.perf_counter()
    (mixed, kill), _ = build_runs(SCENARIOS["disagg16"], ("pd_mixed", "pd_kill"))
    base = Simulation(mixed).run()
    sim = Simulation(kill)
    summary = sim.run()
    assert time.perf_counter() - started < 20
    for s in (base, summary):
        assert s["requests_sent"] > 3000 and s["lost"] == 0 and s["completed"] == s["requests_sent"]
        assert s["kv_transfers"]["kv"]["count"] > 3000
    assert base["kv_paths"]["nvlink"] > base["kv_paths"].get("rdma_leaf", 0)
    killed = summary["failures"]["killed"]
    assert [(k["role"], k["mode"]) for k in killed] == [("decode", "sigkill"), ("prefill", "hang")]
    loads = [a for a in sim.actuator.executed if isinstance(a, LoadInstances)]
    assert sorted(a.reason for a in loads) == ["min_decode=8", "min_prefill=8"]
    for role in (Role.PREFILL, Role.DECODE):
        assert len(sim.registry.views(role=role, state=InstanceState.SERVING)) == 8
