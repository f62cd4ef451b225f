"""Prefill/decode disaggregation in the global manager's pure core: P/D routing by load, KV fit
and topology, the single-hop fallback, routes counted between heartbeats, pool top-up, idle
worker choice, serving traffic for the multicast planner, and the deployment config."""

from __future__ import annotations

import pytest

from blitzmesh.v1 import common_pb2, param_manager_pb2
from services.global_manager.config import GlobalManagerConfig
from services.global_manager.core.decisions import bounded_delta, plan_top_up
from services.global_manager.core.instances import Registry
from services.global_manager.core.multicast import (
    HostLink,
    Source,
    SourceKind,
    Target,
    Topology,
    TrafficDirection,
    plan_multicast,
    traffic_from_instances,
)
from services.global_manager.core.placement import assign_idle, choose_idle
from services.global_manager.core.routing import choose_near, choose_pair, instance_load, plan_route
from services.global_manager.core.types import InstanceState, InstanceView, LoadSample, Role
from services.global_manager.transfer import Node, build_plan

S = InstanceState
P, D, C = Role.PREFILL, Role.DECODE, Role.COLOCATED
LEAVES = {"h0": "l0", "h1": "l0", "h2": "l0", "h9": "l1"}


def inst(
    iid: str,
    role: Role = C,
    *,
    host: str = "h0",
    running: int = 0,
    kv_used: int = 0,
    kv_total: int = 100,
    state: InstanceState = S.SERVING,
    model: str = "m",
) -> InstanceView:
    load = LoadSample(iid, 0.0, running=running, kv_blocks_used=kv_used, kv_blocks_total=kv_total)
    layers = 8 if state in (S.SERVING, S.DRAINING) else 0
    return InstanceView(iid, model, role, state, layers, 8, host, 0.0, load)


def ids(hops: tuple[InstanceView, ...]) -> list[tuple[str, Role]]:
    return [(v.instance_id, v.role) for v in hops]


# ---- routing -------------------------------------------------------------------------------


def test_pair_is_least_loaded_prefill_then_decode() -> None:
    pool = [
        inst("p-busy", P, running=3),
        inst("p-calm", P, running=1),
        inst("d-busy", D, running=5),
        inst("d-calm", D, running=2),
        inst("c", C),  # an idle colocated instance does not win over the pair
    ]
    assert ids(plan_route(pool, model="m")) == [("p-calm", P), ("d-calm", D)]


def test_only_colocated_gives_one_colocated_hop() -> None:
    pool = [inst("c1", C, running=2), inst("c2", C, running=1)]
    assert ids(plan_route(pool, model="m")) == [("c2", C)]
    assert choose_pair(pool) is None


def test_decode_side_prefers_same_host_then_same_leaf_among_equal_loads() -> None:
    prefill = inst("p", P, host="h1")
    far = inst("d-far", D, host="h9", kv_used=0)  # other leaf, the emptiest cache
    leaf = inst("d-leaf", D, host="h2", kv_used=10)  # same leaf
    host = inst("d-host", D, host="h1", kv_used=20)  # same host as the prefill instance
    pool = [prefill, far, leaf, host]
    assert ids(plan_route(pool, model="m", leaves=LEAVES)) == [("p", P), ("d-host", D)]
    assert ids(plan_route([prefill, far, leaf], model="m", leaves=LEAVES))[1] == ("d-leaf", D)
    # Without topology information only the same host counts; then the load (KV fraction) decides.
    assert ids(plan_route([prefill, far, leaf], model="m"))[1] == ("d-far", D)


def test_topology_never_outweighs_a_whole_request_of_load() -> None:
    prefill = inst("p", P, host="h1")
    near_but_busy = inst("d-host", D, host="h1", running=1)
    far_idle = inst("d-far", D, host="h9")
    assert ids(plan_route([prefill, near_but_busy, far_idle], model="m", leaves=LEAVES))[1] == ("d-far", D)
    # With a wider slack one more request counts as "nearly equal" and the same host wins.
    near = choose_near([near_but_busy, far_idle], prefill, role=D, leaves=LEAVES, load_slack=1.5)
    assert near is not None and near.instance_id == "d-host"
    with pytest.raises(ValueError, match="load_slack must be >= 0, got -1"):
        choose_near([far_idle], prefill, load_slack=-1)


def test_kv_fit_prefers_a_decode_instance_that_holds_the_whole_request() -> None:
    prefill = inst("p", P, host="h1")
    near_full = inst("d-host", D, host="h1", kv_used=98)  # 2 free blocks of 16 tokens
    far_roomy = inst("d-far", D, host="h9", running=3)
    pool = [prefill, near_full, far_roomy]
    # prompt 20 + max_tokens 30 = 50 tokens = 4 blocks: only d-far holds it, busier and further.
    route = plan_route(pool, model="m", prompt_tokens=20, max_tokens=30, kv_block_size_tokens=16, leaves=LEAVES)
    assert ids(route) == [("p", P), ("d-far", D)]
    # 2 blocks fit the near one.
    route = plan_route(pool, model="m", prompt_tokens=20, max_tokens=10, kv_block_size_tokens=16, leaves=LEAVES)
    assert ids(route)[1] == ("d-host", D)


def test_prefill_side_prefers_one_whose_cache_holds_the_prompt() -> None:
    full = inst("p-full", P, kv_used=99)  # 1 free block
    roomy = inst("p-roomy", P, running=2)
    pool = [full, roomy, inst("d", D)]
    # The decode side's need (prompt + max_tokens) does not apply to the prefill side: 16 prompt
    # tokens fit p-full even with 1000 max tokens.
    route = plan_route(pool, model="m", prompt_tokens=16, max_tokens=1000, kv_block_size_tokens=16)
    assert ids(route)[0] == ("p-full", P)
    route = plan_route(pool, model="m", prompt_tokens=64, max_tokens=1, kv_block_size_tokens=16)
    assert ids(route)[0] == ("p-roomy", P)


def test_lost_pool_falls_back_to_one_hop_on_any_serving_instance() -> None:
    dead = inst("d", D, state=S.LOST)
    pool = [inst("p1", P, running=2), inst("p2", P, running=1), dead]
    assert ids(plan_route(pool, model="m")) == [("p2", P)]
    # The prefill pool gone instead: a decode instance runs the whole request.
    pool = [inst("p", P, state=S.DRAINING), inst("d1", D, running=4), inst("d2", D, running=3)]
    assert ids(plan_route(pool, model="m")) == [("d2", D)]
    # A colocated instance, if any, competes on load with what is left.
    assert ids(plan_route([*pool, inst("c", C, running=9)], model="m")) == [("d2", D)]
    assert plan_route([dead], model="m") == ()


def test_exclusions_apply_to_both_hops() -> None:
    pool = [inst("p1", P), inst("p2", P, running=1), inst("d1", D), inst("d2", D, running=1)]
    assert ids(plan_route(pool, model="m", exclude_ids={"p1", "d1"})) == [("p2", P), ("d2", D)]
    # Every decode instance excluded (each failed this request): one hop, not a failure.
    assert ids(plan_route(pool, model="m", exclude_ids={"d1", "d2"})) == [("p1", P)]
    assert plan_route(pool, model="m", exclude_ids={"p1", "p2", "d1", "d2"}) == ()


def test_route_filters_the_model_and_rejects_negative_sizes() -> None:
    pool = [inst("p", P, model="other"), inst("d", D, model="other"), inst("c", C)]
    assert ids(plan_route(pool, model="m")) == [("c", C)]
    with pytest.raises(ValueError, match="got -1 and 5"):
        plan_route(pool, model="m", prompt_tokens=-1, max_tokens=5)


# ---- routes counted between heartbeats ---------------------------------------------------------


def serving(reg: Registry, iid: str, role: Role = C, host: str = "h0") -> None:
    reg.register(iid, model="m", role=role, host=host, num_layers=8, now_s=0.0, state=S.SERVING)
    reg.heartbeat(LoadSample(iid, 0.0, kv_blocks_total=100))


def schedule(reg: Registry) -> list[str]:
    hops = plan_route(reg, model="m")
    for v in hops:
        reg.note_routed(v.instance_id)
    return [v.instance_id for v in hops]


def test_a_burst_between_heartbeats_alternates_over_idle_instances() -> None:
    reg = Registry()
    serving(reg, "a")
    serving(reg, "b")
    assert [schedule(reg) for _ in range(4)] == [["a"], ["b"], ["a"], ["b"]]
    assert instance_load(reg.get("a")) == 2.0
    # A heartbeat carries the requests in its report: the count starts again from zero.
    reg.heartbeat(LoadSample("b", 1.0, running=2, kv_blocks_total=100))
    assert reg.get("b").routes_since_heartbeat == 0
    reg.heartbeat(LoadSample("a", 1.0, running=0, kv_blocks_total=100))
    assert schedule(reg) == ["a"]


def test_a_burst_spreads_over_both_pools_of_a_split_deployment() -> None:
    reg = Registry()
    for iid, role in (("p1", P), ("p2", P), ("d1", D), ("d2", D)):
        serving(reg, iid, role)
    assert [schedule(reg) for _ in range(4)] == [["p1", "d1"], ["p2", "d2"], ["p1", "d1"], ["p2", "d2"]]


def test_routes_count_before_the_first_heartbeat_and_reset_when_idle() -> None:
    reg = Registry()
    reg.register("a", model="m", role=C, host="h0", num_layers=8, now_s=0.0, state=S.SERVING)
    reg.note_routed("a")
    assert instance_load(reg.get("a")) == 1.0
    reg.transition("a", S.DRAINING)
    reg.transition("a", S.IDLE)
    assert reg.get("a").routes_since_heartbeat == 0
    with pytest.raises(ValueError, match="routes_since_heartbeat=-1"):
        InstanceView("x", "m", C, S.IDLE, 0, 1, "h", 0.0, None, -1)


# ---- pools: top-up and idle choice -------------------------------------------------------------


@pytest.mark.parametrize(
    ("floors", "live", "idle", "given"),
    [
        ({P: 1, D: 1}, {}, 5, {P: 1, D: 1}),
        ({P: 1, D: 3}, {}, 2, {P: 1, D: 1}),  # a pair first, not three decode instances
        ({P: 1, D: 3}, {}, 3, {P: 1, D: 2}),
        ({P: 2, D: 2}, {P: 2, D: 0}, 1, {D: 1}),
        ({P: 2, D: 4}, {P: 1, D: 1}, 2, {D: 2}),  # then the pool furthest below its floor
        ({P: 1, D: 1}, {P: 1, D: 1}, 4, {}),
        ({C: 3}, {C: 1}, 9, {C: 2}),
        ({P: 1, D: 1}, {}, 0, {}),
    ],
)
def test_top_up_shares_scarce_idle_workers(
    floors: dict[Role, int], live: dict[Role, int], idle: int, given: dict[Role, int]
) -> None:
    assert plan_top_up(floors, live, idle) == given


def test_top_up_rejects_negative_counts() -> None:
    with pytest.raises(ValueError, match="idle must be >= 0, got -1"):
        plan_top_up({P: 1}, {}, -1)
    with pytest.raises(ValueError, match="PREFILL: counts must be >= 0, got -2"):
        plan_top_up({P: -2}, {}, 1)


def test_bounded_delta_names_the_pool_floor() -> None:
    assert bounded_delta(2, 1, low=2, high=9, low_name="min_decode") == (
        0,
        "held at manager min_decode=2 (policy wanted 1)",
    )


def test_idle_workers_started_for_a_role_get_it_first() -> None:
    pool = [
        inst("w0", C, state=S.IDLE),
        inst("w1", D, state=S.IDLE),
        inst("w2", P, state=S.IDLE),
        inst("w3", P, state=S.SERVING),
        inst("w4", C, state=S.IDLE),
    ]
    assert [v.instance_id for v in choose_idle(pool, 2, P)] == ["w2", "w0"]
    assert [v.instance_id for v in choose_idle(pool, 9, D)] == ["w1", "w0", "w4", "w2"]
    assert [v.instance_id for v in choose_idle(pool, 9, C, exclude_ids={"w0"})] == ["w4", "w1", "w2"]
    assert choose_idle(pool, 0, C) == []


def test_assign_idle_gives_workers_started_for_a_role_their_pool() -> None:
    def idle(iid: str, role: Role) -> InstanceView:
        return inst(iid, role, state=S.IDLE)

    def names(out: dict[Role, list[InstanceView]]) -> dict[Role, list[str]]:
        return {role: [v.instance_id for v in views] for role, views in out.items()}

    floors = {P: 1, D: 1}
    # The decode worker registered first: it waits for its own pool rather than taking prefill.
    assert names(assign_idle(floors, {}, [idle("w-decode", D)])) == {D: ["w-decode"]}
    assert names(assign_idle(floors, {}, [idle("a", C), idle("b", D)])) == {D: ["b"], P: ["a"]}
    # Matched workers beyond the floor join the shared rest; unassigned ones fill what is left.
    pool = [idle("d1", D), idle("d2", D), idle("c", C), inst("busy", P, state=S.SERVING)]
    assert names(assign_idle({P: 2, D: 1}, {}, pool)) == {D: ["d1"], P: ["c", "d2"]}
    assert names(assign_idle(floors, {P: 1, D: 1}, pool)) == {}
    assert names(assign_idle({C: 2}, {C: 1}, [idle("x", D), idle("y", C)])) == {C: ["y"]}


# ---- serving traffic for the multicast planner -------------------------------------------------

GROUPS = ["embed", "layers.0", "layers.1", "head"]


def test_serving_traffic_comes_from_serving_instances_by_role() -> None:
    views = [
        inst("p", P),
        inst("d", D),
        inst("c", C),
        inst("p-loading", P, state=S.LOADING),
        inst("d-draining", D, state=S.DRAINING),
        inst("p-other", P, model="x"),
    ]
    assert traffic_from_instances(views, "m") == {
        "p": TrafficDirection.OUT,
        "d": TrafficDirection.IN,
        "d-draining": TrafficDirection.IN,
    }


def topology() -> Topology:
    hosts = ("hp", "hd", "hc0", "hc1", "ht")
    return Topology(hosts={h: HostLink(leaf="l0", bw_gbps=100.0) for h in hosts})


def test_a_new_prefill_instance_loads_from_decode_instances_then_host_shards() -> None:
    views = [inst("a-prefill", P, host="hp"), inst("z-decode", D, host="hd")]
    traffic = traffic_from_instances(views, "m")
    shards = [
        Source("hc0", "hc0", SourceKind.HOST_CACHE, frozenset(GROUPS[:2])),
        Source("hc1", "hc1", SourceKind.HOST_CACHE, frozenset(GROUPS[2:])),
    ]
    instances = [Source("a-prefill", "hp"), Source("z-decode", "hd")]
    targets = [Target("t", "ht")]
    # Without the traffic the prefill instance (first by name) would be the source.
    blind = plan_multicast(targets, [*instances, *shards], topology(), groups=GROUPS)
    assert {c.source for c in blind.chains} == {"a-prefill"}
    plan = plan_multicast(targets, [*instances, *shards], topology(), traffic, groups=GROUPS)
    assert {c.source for c in plan.chains} == {"z-decode"} and plan.pruned_sources == ("a-prefill",)
    # No decode instance holds the model: host shards, still not the prefill instance.
    plan = plan_multicast(targets, [instances[0], *shards], topology(), traffic, groups=GROUPS)
    assert {c.source for c in plan.chains} == {"hc0", "hc1"}
    # The prefill instance is used only for what nobody else holds.
    plan = plan_multicast(targets, [instances[0], shards[0]], topology(), traffic, groups=GROUPS)
    assert plan.busy_sources_used == ("a-prefill",)
    assert {g for c in plan.chains if c.source == "a-prefill" for g in c.groups} == set(GROUPS[2:])


def test_build_plan_passes_the_serving_traffic_to_the_planner() -> None:
    def holder(hid: str, kind: str) -> common_pb2.Holder:
        return common_pb2.Holder(
            holder_id=hid, kind=kind, host=f"host-{hid}", grpc_address=f"{hid}:1", dataplane_address=b"x"
        )

    holders = [holder("a-prefill", "instance"), holder("z-decode", "instance")]
    where = param_manager_pb2.LocateResponse(
        locations=[common_pb2.GroupLocation(group=g, holder_info=holders) for g in GROUPS]
    )
    target = Node("t", "host-t", "t:1", b"t", "tcp")
    traffic = traffic_from_instances([inst("a-prefill", P), inst("z-decode", D)])
    _, planned = build_plan([target], where, GROUPS, serving_traffic=traffic)
    assert {c.source for c in planned.chains} == {"z-decode"}
    _, planned = build_plan([target], where, GROUPS)
    assert {c.source for c in planned.chains} == {"a-prefill"}


# ---- config ----------------------------------------------------------------------------------


def test_config_disaggregated_pools() -> None:
    cfg = GlobalManagerConfig(default_model="m", min_prefill=1, min_decode=2)
    assert cfg.disaggregated and cfg.pool_floors() == {P: 1, D: 2}
    assert cfg.floor_name(D) == "min_decode" and cfg.floor_name(C) == "min_instances"
    colocated = GlobalManagerConfig(default_model="m", min_instances=2)
    assert not colocated.disaggregated and colocated.pool_floors() == {C: 2}


@pytest.mark.parametrize(
    ("settings", "message"),
    [
        ({"min_prefill": 1}, "min_prefill=1 and min_decode=0: set both > 0"),
        ({"min_decode": 3}, "min_prefill=0 and min_decode=3: set both > 0"),
        ({"min_prefill": 1, "min_decode": 1, "min_instances": 2}, "min_instances=2 must be 0 with min_prefill=1"),
        ({"min_prefill": 2, "min_decode": 2, "max_instances": 3}, "min_prefill=2 \\+ min_decode=2 must be <= max"),
        ({"min_prefill": 1, "min_decode": 1, "default_model": ""}, "need default_model"),
        ({"min_prefill": -1, "min_decode": 1}, "greater than or equal to 0"),
    ],
)
def test_config_rejects_half_or_mixed_splits(settings: dict[str, object], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        GlobalManagerConfig(**{"default_model": "m", **settings})  # type: ignore[arg-type]


def test_the_registry_learns_the_layer_count_of_an_assigned_model() -> None:
    reg = Registry()
    reg.register("w", model="", role=C, host="h0", num_layers=1, now_s=0.0)
    with pytest.raises(ValueError, match="it is IDLE"):
        reg.set_num_layers("w", 30)
    reg.transition("w", S.LOADING, model="m", role=D)
    reg.set_layers_loaded("w", 1)
    assert (reg.set_num_layers("w", 30).num_layers, reg.get("w").layers_loaded) == (30, 1)
    reg.transition("w", S.SERVING)
    assert reg.set_num_layers("w", 32).layers_loaded == 32  # a serving instance holds them all
    with pytest.raises(ValueError, match="num_layers must be > 0, got 0"):
        reg.set_num_layers("w", 0)
