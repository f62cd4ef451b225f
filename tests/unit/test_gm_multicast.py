"""Multicast planner (docs/algorithms.md 2): pruning, collapsing, chains per leaf, ordering, shards."""

from __future__ import annotations

from typing import Any

import pytest

from services.global_manager.core.multicast import (
    AllGather,
    Chain,
    MulticastPlan,
    SendingLinks,
    Source,
    SourceKind,
    Target,
    Topology,
    TrafficDirection,
    chain_fill_time_s,
    estimate_plan_time_s,
    plan_multicast,
    traffic_from_roles,
    unicast_fill_time_s,
    validate_plan,
)

GROUPS = [f"layer.{i}" for i in range(8)]


def topo(hosts: dict[str, tuple[str, float]], fast_groups: list[list[str]] | None = None) -> Topology:
    data: dict[str, Any] = {"hosts": {h: {"leaf": leaf, "bw_gbps": bw} for h, (leaf, bw) in hosts.items()}}
    if fast_groups:
        data["fast_groups"] = fast_groups
    return Topology.from_dict(data)


def plan_ok(targets: list[Target], sources: list[Source], topology: Topology, **kw: Any) -> MulticastPlan:
    plan = plan_multicast(targets, sources, topology, kw.pop("traffic", None), groups=kw.pop("groups", GROUPS), **kw)
    validate_plan(plan, targets, sources, kw.get("groups", GROUPS))
    return plan


def test_chain_orders_targets_by_decreasing_bandwidth() -> None:
    t = topo({"src": ("L0", 100), "slow": ("L0", 10), "fast": ("L0", 100), "mid": ("L0", 40)})
    targets = [Target("t_slow", "slow"), Target("t_fast", "fast"), Target("t_mid", "mid")]
    plan = plan_ok(targets, [Source("s", "src")], t)
    assert plan.chains == (Chain("s", ("t_fast", "t_mid", "t_slow"), tuple(GROUPS), lane=0),)
    assert plan.allgather == ()


def test_one_chain_per_leaf_with_source_and_targets() -> None:
    t = topo(
        {"a0": ("A", 100), "a1": ("A", 100), "a2": ("A", 50), "b0": ("B", 100), "b1": ("B", 100), "c0": ("C", 100)}
    )
    targets = [Target("ta1", "a1"), Target("ta2", "a2"), Target("tb1", "b1")]
    sources = [Source("sa", "a0"), Source("sb", "b0"), Source("sc", "c0")]
    plan = plan_ok(targets, sources, t)
    assert plan.num_lanes == 2
    by_source = {c.source: c.hops for c in plan.chains}
    assert by_source == {"sa": ("ta1", "ta2"), "sb": ("tb1",)}  # sc's leaf has no targets


def test_number_of_chains_is_min_of_sources_targets_needed() -> None:
    hosts = {f"h{i}": (f"L{i}", 100.0) for i in range(6)}
    t = topo(hosts)
    # Three leaves with a source and a target each -> 3 lanes; capped at 2 by max_chains.
    targets = [Target(f"t{i}", f"h{i}") for i in range(3)]
    sources = [Source(f"s{i}", f"h{i + 3}") for i in range(3)]  # all sources on other leaves
    assert plan_ok(targets, sources, t).num_lanes == 3
    assert plan_ok(targets, sources, t, max_chains=2).num_lanes == 2
    assert plan_ok(targets, sources[:1], t).num_lanes == 1
    assert plan_ok(targets[:1], sources, t).num_lanes == 1


def test_orphan_targets_join_the_shortest_lane() -> None:
    t = topo(
        {"a0": ("A", 100), "a1": ("A", 100), "a2": ("A", 100), "b0": ("B", 100), "b1": ("B", 100), "x": ("X", 100)}
    )
    targets = [Target("ta1", "a1"), Target("ta2", "a2"), Target("tb1", "b1"), Target("tx", "x")]
    plan = plan_ok(targets, [Source("sa", "a0"), Source("sb", "b0")], t)
    assert {c.source: c.hops for c in plan.chains} == {"sa": ("ta1", "ta2"), "sb": ("tb1", "tx")}


def test_prunes_sources_whose_link_carries_serving_traffic_out() -> None:
    t = topo({"p": ("L0", 200), "d": ("L0", 100), "t": ("L0", 100)})
    sources = [Source("prefill0", "p"), Source("decode0", "d")]
    traffic = traffic_from_roles({"prefill0": "prefill", "decode0": "decode"})
    assert traffic == {"prefill0": TrafficDirection.OUT, "decode0": TrafficDirection.IN}
    plan = plan_ok([Target("t0", "t")], sources, t, traffic=traffic)
    assert [c.source for c in plan.chains] == ["decode0"]
    assert plan.pruned_sources == ("prefill0",) and plan.busy_sources_used == ()


def test_a_second_scale_out_keeps_off_the_links_of_one_still_sending() -> None:
    """Chain sources and middle hops of a load in flight count as sending until each of that
    plan's targets finished: the next plan takes the host cache instead of a second chain
    from the same instance, and the sender is free again once the first load ends."""
    t = topo({h: ("L0", 100) for h in ("w0", "w1", "w2", "w3", "w4", "pm")})
    sources = [Source("w0", "w0"), Source("cache0", "pm", SourceKind.HOST_CACHE, frozenset(GROUPS))]
    sending = SendingLinks()
    first = MulticastPlan(chains=(Chain("w0", ("w1", "w2"), tuple(GROUPS)),), allgather=())
    sending.start(first, ["w1", "w2"])
    assert sending.senders == {"w0", "w1"}  # the tail only receives
    traffic = sending.traffic({"w9": TrafficDirection.IN})
    assert traffic == {"w0": TrafficDirection.OUT, "w1": TrafficDirection.OUT, "w9": TrafficDirection.IN}
    plan = plan_ok([Target("w3", "w3"), Target("w4", "w4")], sources, t, traffic=traffic)
    assert {c.source for c in plan.chains} == {"cache0"} and plan.pruned_sources == ("w0",)
    sending.finish("w1")
    assert sending.senders == {"w0", "w1"}  # w2 still loads through both
    sending.finish("w2")
    assert sending.senders == frozenset() and sending.traffic({}) == {}


def test_sending_marks_a_receiving_link_as_both() -> None:
    sending = SendingLinks()
    sending.start(MulticastPlan(chains=(Chain("d0", ("t0",), tuple(GROUPS)),), allgather=()), ["t0"])
    assert sending.traffic({"d0": TrafficDirection.IN}) == {"d0": TrafficDirection.BOTH}


def test_busy_source_is_used_only_when_nothing_else_holds_a_group() -> None:
    t = topo({"p": ("L0", 100), "c": ("L0", 100), "t": ("L0", 100)})
    sources = [Source("prefill0", "p"), Source("cache0", "c", SourceKind.HOST_CACHE, frozenset(GROUPS[:4]))]
    plan = plan_ok([Target("t0", "t")], sources, t, traffic={"prefill0": TrafficDirection.BOTH})
    assert plan.busy_sources_used == ("prefill0",)
    carried = {c.source: c.groups for c in plan.chains}
    assert set(carried["cache0"]) == set(GROUPS[:4])
    assert set(carried["prefill0"]) == set(GROUPS[4:])


def test_sharded_transfer_into_fast_link_group_then_allgather() -> None:
    t = topo(
        {"s0": ("L0", 100), "s1": ("L0", 100), "s2": ("L0", 100), "g0": ("L0", 100), "g1": ("L0", 50)},
        fast_groups=[["g0", "g1"]],
    )
    targets = [Target("gpu0", "g0"), Target("gpu1", "g0"), Target("gpu2", "g1"), Target("gpu3", "g1")]
    sources = [Source("a", "s0"), Source("b", "s1"), Source("c", "s2")]
    plan = plan_ok(targets, sources, t)
    # One unit of 4 members, 3 sources on the leaf -> 3 shards, each ~1/3 of the layers,
    # interleaved so the first layers arrive first, entering at different members.
    assert [(c.source, c.hops, c.groups) for c in plan.chains] == [
        ("a", ("gpu0",), ("layer.0", "layer.3", "layer.6")),
        ("b", ("gpu1",), ("layer.1", "layer.4", "layer.7")),
        ("c", ("gpu2",), ("layer.2", "layer.5")),
    ]
    assert plan.num_lanes == 1
    assert plan.allgather == (
        AllGather(
            members=("gpu0", "gpu1", "gpu2", "gpu3"),
            received={
                "gpu0": ("layer.0", "layer.3", "layer.6"),
                "gpu1": ("layer.1", "layer.4", "layer.7"),
                "gpu2": ("layer.2", "layer.5"),
                "gpu3": (),
            },
        ),
    )


def test_shards_prefer_distinct_source_hosts() -> None:
    t = topo({"s0": ("L0", 100), "s1": ("L0", 100), "g": ("L0", 100)})
    sources = [Source("a1", "s0"), Source("a2", "s0"), Source("b1", "s1")]
    targets = [Target("gpu0", "g"), Target("gpu1", "g")]
    assert [c.source for c in plan_ok(targets, sources, t).chains] == ["a1", "b1"]


def test_host_cache_shards_cover_layers_across_leaves() -> None:
    t = topo({"c0": ("A", 100), "c1": ("B", 100), "t0": ("A", 100), "t1": ("B", 100)})
    sources = [
        Source("cache0", "c0", SourceKind.HOST_CACHE, frozenset(GROUPS[:5])),
        Source("cache1", "c1", SourceKind.HOST_CACHE, frozenset(GROUPS[5:])),
    ]
    targets = [Target("x", "t0"), Target("y", "t1")]
    plan = plan_ok(targets, sources, t)
    assert plan.num_lanes == 2
    for chain in plan.chains:
        assert set(chain.groups) <= {g for s in sources if s.node_id == chain.source for g in (s.groups or ())}


def test_groups_the_lanes_shards_lack_spread_over_backups_at_a_shard_each() -> None:
    """Leaf A has two host-cache shards of 2 groups each and a unit of 4 targets; the other 4
    groups must cross the spine from leaf B's live instances. One backup used to take all 4
    (the lane's slowest chain by 2x); each now takes one shard's share (8 groups / 4 chains)."""
    t = topo({"cA": ("A", 100), "cA2": ("A", 100), "tA": ("A", 100), "iB": ("B", 100)})
    sources = [
        Source("cache0", "cA", SourceKind.HOST_CACHE, frozenset(GROUPS[0:2])),
        Source("cache1", "cA2", SourceKind.HOST_CACHE, frozenset(GROUPS[2:4])),
        Source("live0", "iB"),
        Source("live1", "iB"),
    ]
    targets = [Target(f"t{i}", "tA") for i in range(4)]
    plan = plan_ok(targets, sources, t)
    carried = {c.source: c.groups for c in plan.chains}
    assert carried == {
        "cache0": ("layer.0", "layer.1"),
        "cache1": ("layer.2", "layer.3"),
        "live0": ("layer.4", "layer.5"),
        "live1": ("layer.6", "layer.7"),
    }
    # Entering the unit at four different members: four NICs, no chain sharing one.
    assert len({c.hops[0] for c in plan.chains}) == 4


def test_a_source_sending_for_one_lane_goes_after_idle_ones_in_the_next() -> None:
    """Leaf A's lane (two units) is planned first and takes backups "b0" and "b1" from leaf B.
    Leaf B's own lane then picks its idle sources before them, so no NIC carries two chains."""
    t = topo({"cA": ("A", 100), "tA1": ("A", 100), "tA2": ("A", 100), "sB": ("B", 100), "tB": ("B", 100)})
    sources = [
        Source("cacheA", "cA", SourceKind.HOST_CACHE, frozenset(GROUPS[0:2])),
        *(Source(f"b{i}", "sB") for i in range(4)),
    ]
    targets = [Target("a1", "tA1"), Target("a1b", "tA1"), Target("a2", "tA2"), Target("bt", "tB"), Target("bt2", "tB")]
    plan = plan_ok(targets, sources, t)
    lanes: dict[int, set[str]] = {}
    for c in plan.chains:
        lanes.setdefault(c.lane, set()).add(c.source)
    assert len(lanes) == 2
    first, second = (lanes[k] for k in sorted(lanes))
    assert first == {"cacheA", "b0"} and second == {"b1", "b2"}
    assert not first & second


def test_live_instances_are_preferred_over_host_cache() -> None:
    t = topo({"c": ("L0", 400), "i": ("L0", 100), "t": ("L0", 100)})
    sources = [Source("cache", "c", SourceKind.HOST_CACHE, frozenset(GROUPS)), Source("inst", "i")]
    assert [c.source for c in plan_ok([Target("t0", "t")], sources, t).chains] == ["inst"]


def test_target_next_to_a_full_source_copies_over_the_fast_link() -> None:
    t = topo({"h": ("L0", 100), "o": ("L0", 100), "s": ("L0", 100)})
    sources = [Source("live", "h"), Source("far", "s")]
    targets = [Target("new0", "h"), Target("new1", "h"), Target("other", "o")]
    plan = plan_ok(targets, sources, t)
    local = [c for c in plan.chains if c.local]
    assert local == [Chain("live", ("new0", "new1"), tuple(GROUPS), lane=0, local=True)]
    assert [c.hops for c in plan.chains if not c.local] == [("other",)]


def test_no_source_for_a_group_is_an_error() -> None:
    t = topo({"c": ("L0", 100), "t": ("L0", 100)})
    sources = [Source("cache", "c", SourceKind.HOST_CACHE, frozenset(GROUPS[:2]))]
    with pytest.raises(ValueError, match="no source holds parameter group 'layer.2'"):
        plan_multicast([Target("t0", "t")], sources, t, groups=GROUPS)


def test_input_validation() -> None:
    t = topo({"a": ("L0", 100)})
    with pytest.raises(ValueError, match="host 'zz' is not in the topology"):
        plan_multicast([Target("t", "zz")], [Source("s", "a")], t, groups=GROUPS)
    with pytest.raises(ValueError, match="node 's' is given twice"):
        plan_multicast([Target("s", "a")], [Source("s", "a")], t, groups=GROUPS)
    with pytest.raises(ValueError, match="unknown groups"):
        plan_multicast([Target("t", "a")], [Source("s", "a", groups=frozenset({"x"}))], t, groups=GROUPS)
    with pytest.raises(ValueError, match="bw_gbps must be > 0, got 0.0"):
        topo({"a": ("L0", 0)})
    with pytest.raises(ValueError, match="unknown hosts"):
        topo({"a": ("L0", 1)}, fast_groups=[["a", "b"]])
    with pytest.raises(ValueError, match="exactly 'leaf' and 'bw_gbps'"):
        Topology.from_dict({"hosts": {"a": {"leaf": "L0"}}})
    assert plan_multicast([], [], t, groups=GROUPS) == MulticastPlan((), ())


def test_validate_plan_catches_bad_plans() -> None:
    targets = [Target("t0", "h"), Target("t1", "h")]
    sources = [Source("s", "h"), Source("half", "h", SourceKind.HOST_CACHE, frozenset(GROUPS[:4]))]
    g = tuple(GROUPS)

    def check(plan: MulticastPlan, match: str) -> None:
        with pytest.raises(ValueError, match=match):
            validate_plan(plan, targets, sources, GROUPS)

    check(MulticastPlan((Chain("nope", ("t0",), g),), ()), "unknown source node 'nope'")
    check(MulticastPlan((Chain("s", (), g),), ()), "is empty")
    check(MulticastPlan((Chain("s", ("t0",), ()),), ()), "carries no parameter groups")
    check(MulticastPlan((Chain("s", ("t0", "tX"), g),), ()), "unknown target nodes \\['tX'\\]")
    check(MulticastPlan((Chain("s", ("t0", "t1", "t0"), g),), ()), "duplicate targets \\['t0'\\]")
    check(
        MulticastPlan((Chain("s", ("t0", "t1"), g), Chain("s", ("t1",), g[:1])), ()),
        "duplicate target 't1': group 'layer.0' arrives by chains 0 and 1",
    )
    check(MulticastPlan((Chain("half", ("t0", "t1"), g),), ()), "'half' does not hold groups")
    check(MulticastPlan((Chain("s", ("t0",), g),), ()), "layer coverage gap: target 't1'")
    check(MulticastPlan((Chain("s", ("t0", "t1"), g[:7]),), ()), "never receives groups \\['layer.7'\\]")
    # An all-gather closes the gap.
    ok = MulticastPlan((Chain("s", ("t0",), g[:4]), Chain("half", ("t1",), g[4:])), ())
    with pytest.raises(ValueError, match="'half' does not hold"):
        validate_plan(ok, targets, sources, GROUPS)
    ok2 = MulticastPlan(
        (Chain("s", ("t0",), g[4:]), Chain("half", ("t1",), g[:4])),
        (AllGather(("t0", "t1"), {"t0": g[4:], "t1": g[:4]}),),
    )
    validate_plan(ok2, targets, sources, GROUPS)


def test_chain_time_is_nearly_independent_of_targets() -> None:
    size, chunk, bw = 16e9, 4 * 2**20, 100.0
    one = chain_fill_time_s(size, chunk, 1, bw)
    eight = chain_fill_time_s(size, chunk, 8, bw)
    assert one == pytest.approx(size / (bw * 1e9 / 8))
    assert eight == pytest.approx(one + 7 * chunk / (bw * 1e9 / 8))
    assert eight < 1.01 * one
    assert unicast_fill_time_s(size, 8, bw) == pytest.approx(8 * one)


def test_estimate_uses_bottleneck_link_and_shards_cut_time() -> None:
    hosts = {"s0": ("L0", 100.0), "s1": ("L0", 100.0), "g": ("L0", 100.0), "g2": ("L0", 100.0)}
    t = topo(hosts, fast_groups=[["g", "g2"]])
    targets = [Target("a", "g"), Target("b", "g2")]
    node_hosts = {"a": "g", "b": "g2", "x": "s0", "y": "s1"}
    one = plan_ok(targets, [Source("x", "s0")], t)
    two = plan_ok(targets, [Source("x", "s0"), Source("y", "s1")], t)
    t_one = estimate_plan_time_s(one, t, node_hosts, bytes_per_group=1e9, chunk_bytes=4e6)
    t_two = estimate_plan_time_s(two, t, node_hosts, bytes_per_group=1e9, chunk_bytes=4e6)
    # 8 GB at 12.5 GB/s, then 8 GB over the 900 Gbit/s fast link; two shards halve both.
    assert t_one == pytest.approx(8e9 / 12.5e9 + 8e9 / 112.5e9)
    assert t_two == pytest.approx(4e9 / 12.5e9 + 4e9 / 112.5e9)


@pytest.mark.parametrize("seed", range(40))
def test_random_plans_hold_the_invariants(seed: int) -> None:
    import random

    rng = random.Random(seed)
    n_hosts = rng.randint(2, 30)
    hosts = {f"h{i}": (f"L{rng.randrange(4)}", rng.choice([25.0, 50.0, 100.0, 200.0])) for i in range(n_hosts)}
    names = sorted(hosts)
    pairs = [names[i : i + 2] for i in range(0, n_hosts - 1, 5) if rng.random() < 0.5]
    t = topo(hosts, fast_groups=pairs)
    groups = [f"g{i}" for i in range(rng.randint(1, 12))]
    targets = [Target(f"t{i}", rng.choice(names)) for i in range(rng.randint(1, 25))]
    sources: list[Source] = [Source(f"s{i}", rng.choice(names)) for i in range(rng.randint(0, 6))]
    for i in range(rng.randint(0 if sources else 1, 4)):
        sources.append(
            Source(
                f"c{i}", rng.choice(names), SourceKind.HOST_CACHE, frozenset(g for g in groups if rng.random() < 0.6)
            )
        )
    # Make sure every group has at least one holder.
    sources.append(Source("c_all", rng.choice(names), SourceKind.HOST_CACHE, frozenset(groups)))
    traffic = {s.node_id: rng.choice(list(TrafficDirection)) for s in sources if rng.random() < 0.4}
    max_chains = rng.choice([None, 1, 2, 3])
    plan = plan_multicast(targets, sources, t, traffic, groups=groups, max_chains=max_chains)
    validate_plan(plan, targets, sources, groups)

    unit_bw: dict[str, float] = {}
    for tgt in targets:
        key = t.group_key(tgt.host)
        unit_bw[key] = max(unit_bw.get(key, 0.0), t.link(tgt.host).bw_gbps)
    host_of = {tgt.node_id: tgt.host for tgt in targets}
    units = len(unit_bw)
    usable = len([s for s in sources if s.node_id not in plan.pruned_sources])
    assert plan.num_lanes <= min(usable, units, max_chains or units)
    for chain in plan.chains:
        if not chain.local:  # a fast-link copy does not use the busy NIC, so it may use any source
            assert chain.source not in plan.pruned_sources
            bws = [unit_bw[t.group_key(host_of[h])] for h in chain.hops]
            assert bws == sorted(bws, reverse=True), chain
