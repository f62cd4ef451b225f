"""Prefix-affinity routing in the global manager: the approximate index of routed block hashes
and the affinity term of `choose_instance` (Dynamo's KV router cost)."""

from __future__ import annotations

import dataclasses

import pytest

from services.common.prefix import block_hashes
from services.global_manager.core.prefix_index import PrefixIndex
from services.global_manager.core.routing import PrefixAffinity, affinity_cost, choose_instance, plan_route
from services.global_manager.core.types import InstanceState, InstanceView, LoadSample, Role

S = InstanceState
BS = 16


def inst(
    iid: str,
    *,
    running: int = 0,
    waiting: int = 0,
    kv_used: int = 0,
    kv_total: int = 1000,
    waiting_prefill_tokens: int = 0,
    routes: int = 0,
    role: Role = Role.COLOCATED,
    state: InstanceState = S.SERVING,
    model: str = "m",
    prefill_capacity_tps: float = 0.0,
    est_tpot_s: float | None = None,
) -> InstanceView:
    load = LoadSample(
        iid,
        0.0,
        running=running,
        waiting=waiting,
        waiting_prefill_tokens=waiting_prefill_tokens,
        kv_blocks_used=kv_used,
        kv_blocks_total=kv_total,
        prefill_capacity_tps=prefill_capacity_tps,
        est_tpot_s=est_tpot_s,
    )
    layers = 8 if state in (S.SERVING, S.DRAINING) else 0
    return InstanceView(iid, model, role, state, layers, 8, "h", 0.0, load, routes)


def affinity(matched: dict[str, int], prompt_blocks: int = 10, weight: float = 1.0) -> PrefixAffinity:
    return PrefixAffinity(matched, prompt_blocks, weight, BS)


# ---- the cost ----------------------------------------------------------------------------------


def test_cost_is_weighted_blocks_to_compute_plus_blocks_in_use() -> None:
    view = inst("a", kv_used=40, waiting_prefill_tokens=33, routes=2)
    aff = affinity({"a": 4}, prompt_blocks=10, weight=2.0)
    # 2 * (10 - 4) + (40 held + ceil(33 / 16) = 3 queued + 2 routes * ceil(200 / 16) = 13 each)
    assert affinity_cost(view, aff, request_tokens=200) == 2.0 * 6 + 40 + 3 + 26
    # More matched than the prompt has (a stale index): never a negative prefill term.
    assert affinity_cost(inst("a"), affinity({"a": 99}, prompt_blocks=10), 0) == 0.0
    # No report yet: only what was routed there since it registered.
    fresh = dataclasses.replace(inst("b"), load=None, routes_since_heartbeat=1)
    assert affinity_cost(fresh, affinity({}, prompt_blocks=3), request_tokens=32) == 3 + 2


def test_affinity_validates_its_parameters() -> None:
    with pytest.raises(ValueError, match="overlap_weight"):
        PrefixAffinity({}, 1, -1.0, BS)
    with pytest.raises(ValueError, match="block_size"):
        PrefixAffinity({}, 1, 1.0, 0)


# ---- the choice --------------------------------------------------------------------------------


def test_the_instance_holding_the_prefix_wins_against_a_slightly_less_loaded_one() -> None:
    pool = [inst("a", running=3, kv_used=30), inst("b", running=1, kv_used=10)]
    assert choose_instance(pool, 160).instance_id == "b"  # least loaded without affinity
    # a holds 8 of the 10 prompt blocks: 1 * 2 + 30 = 32 against 1 * 10 + 10 = 20 ... b still.
    assert choose_instance(pool, 160, affinity=affinity({"a": 8})).instance_id == "b"
    # Weighted up, the saved prefill outweighs a's 20 extra blocks: 4 * 2 + 30 = 38 < 4 * 10 + 10 = 50.
    assert choose_instance(pool, 160, affinity=affinity({"a": 8}, weight=4.0)).instance_id == "a"


def test_a_long_cached_prefix_beats_a_moderate_load_gap() -> None:
    pool = [inst("a", running=2, kv_used=60), inst("b", running=0, kv_used=0), inst("c", running=1, kv_used=30)]
    aff = affinity({"a": 100, "c": 20}, prompt_blocks=128)
    # a: 28 + 60 = 88, b: 128 + 0, c: 108 + 30 = 138.
    assert choose_instance(pool, 128 * BS, affinity=aff).instance_id == "a"


def test_weight_zero_or_no_overlap_anywhere_is_plain_least_loaded() -> None:
    # b is less loaded by requests but holds more blocks; without overlap the choice is by load.
    pool = [inst("a", running=2, kv_used=5), inst("b", running=1, kv_used=90)]
    assert choose_instance(pool, affinity=affinity({})).instance_id == "b"
    assert choose_instance(pool, affinity=affinity({"a": 10}, weight=0.0)).instance_id == "b"
    # Overlap only on an ineligible instance (excluded) does not switch the cost either.
    assert choose_instance(pool, exclude_ids={"a"}, affinity=affinity({"a": 10})).instance_id == "b"


def test_kv_fit_still_comes_first_and_ids_break_ties() -> None:
    full = inst("a", kv_used=995, kv_total=1000)
    roomy = inst("b", kv_used=500, kv_total=1000)
    aff = affinity({"a": 10, "b": 0}, prompt_blocks=10, weight=100.0)
    assert choose_instance([full, roomy], 160, kv_block_size_tokens=BS, affinity=aff).instance_id == "b"
    twins = [inst("y"), inst("x")]
    assert choose_instance(twins, affinity=affinity({"x": 3, "y": 3})).instance_id == "x"


def test_routes_since_the_heartbeat_spread_a_burst_over_equal_matches() -> None:
    # A burst of one shared prefix, cached on both: each route adds its blocks to the cost.
    a, b = inst("a"), inst("b")
    aff = affinity({"a": 10, "b": 10})
    picks = []
    for _ in range(4):
        chosen = choose_instance([a, b], 160, affinity=aff)
        assert chosen is not None
        picks.append(chosen.instance_id)
        if chosen is a:
            a = dataclasses.replace(a, routes_since_heartbeat=a.routes_since_heartbeat + 1)
        else:
            b = dataclasses.replace(b, routes_since_heartbeat=b.routes_since_heartbeat + 1)
    assert picks == ["a", "b", "a", "b"]


def test_a_split_deployment_weighs_only_the_prefill_side() -> None:
    pool = [
        inst("p1", role=Role.PREFILL, kv_used=50),
        inst("p2", role=Role.PREFILL, kv_used=0),
        inst("d1", role=Role.DECODE, kv_used=0),
        inst("d2", role=Role.DECODE, kv_used=10),
    ]
    aff = affinity({"p1": 60, "d2": 60}, prompt_blocks=64)
    hops = plan_route(pool, model="m", prompt_tokens=64 * BS, max_tokens=16, affinity=aff)
    assert [h.instance_id for h in hops] == ["p1", "d1"]
    hops = plan_route(pool, model="m", prompt_tokens=64 * BS, max_tokens=16)
    assert [h.instance_id for h in hops] == ["p2", "d1"]


# ---- the index ---------------------------------------------------------------------------------


def test_index_matches_the_leading_run_of_routed_blocks() -> None:
    index = PrefixIndex(max_blocks_per_instance=100)
    system = list(range(1, 65))  # 4 blocks
    first = block_hashes([*system, *range(500, 532)], BS)
    index.record("a", "m", first)
    second = block_hashes([*system, *range(600, 632)], BS)
    assert index.overlap("a", "m", second) == 4
    assert index.overlap("a", "m", first) == 6
    assert index.overlap("a", "other-model", first) == 0
    assert index.overlap("b", "m", first) == 0
    # A block hash chains all before it: a different first block shares nothing after it.
    assert index.overlap("a", "m", block_hashes([0, *system[1:]], BS)) == 0
    assert index.overlaps([inst("a"), inst("b")], second) == {"a": 4}


def test_index_is_bounded_per_instance_least_recent_first() -> None:
    index = PrefixIndex(max_blocks_per_instance=6)
    old = block_hashes(list(range(0, 64)), BS)  # 4 blocks
    new = block_hashes(list(range(1000, 1064)), BS)
    index.record("a", "m", old)
    index.record("a", "m", new)  # 8 > 6: the two least recent of `old` go
    assert index.blocks_of("a") == 6
    assert index.overlap("a", "m", new) == 4
    assert index.overlap("a", "m", old) == 0  # its first block is gone, so its chain is
    index.record("a", "m", old[:2])  # seen again: the most recent now (old[2:] go to make room)
    assert index.overlap("a", "m", old) == 2 and index.overlap("a", "m", new) == 4
    index.record("a", "m", block_hashes(list(range(2000, 2032)), BS))  # 2 more: `new`'s first two go
    assert index.overlap("a", "m", old) == 2 and index.overlap("a", "m", new) == 0


def test_index_drops_instances_that_leave_or_change_model() -> None:
    index = PrefixIndex(max_blocks_per_instance=10)
    hashes = block_hashes(list(range(32)), BS)
    for iid in ("a", "b", "c", "d", "e"):
        index.record(iid, "m", hashes)
    index.sync(
        [
            inst("a"),
            inst("b", state=S.DRAINING),
            inst("c", model="other"),  # unloaded and loaded another model since
            inst("e", state=S.LOADING),  # a live ZigZag instance: its blocks are whole once loaded
        ]  # d is gone from the registry
    )
    assert "a" in index and "e" in index and len(index) == 2
    index.forget("e")
    index.record("a", "other", hashes)  # now routed for another model: starts afresh
    assert index.overlap("a", "m", hashes) == 0 and index.overlap("a", "other", hashes) == 2
    index.forget("a")
    assert len(index) == 0
    with pytest.raises(ValueError, match="max_blocks_per_instance"):
        PrefixIndex(0)
