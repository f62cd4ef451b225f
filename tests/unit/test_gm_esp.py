"""The ESP scheduler's pure core (services/global_manager/core/esp.py): the batching DP against
the vectors of docs/algorithms.md 6 and against brute force, dispatching, instance allocation
and the decode degree."""

from __future__ import annotations

import math
import random

import pytest

from services.global_manager.core.esp import (
    EspInstance,
    EspRequest,
    StepTimeModel,
    allocate_instances,
    decode_degree,
    dispatch,
    plan_batch_slices,
    plan_batches,
)

MODELS = {1: StepTimeModel(10, 0.01, 1e-6), 2: StepTimeModel(15, 0.005, 5e-7)}


def _reqs(lengths):
    return [EspRequest(f"r{i}", n, float(i)) for i, n in enumerate(lengths)]


def _insts(free):
    return [EspInstance(f"i{k}", 0, f) for k, f in enumerate(free)]


def test_the_vectors() -> None:
    plan = plan_batches(_reqs([3000, 1000]), _insts([5000, 5000]), MODELS)
    assert plan is not None and plan.cost == pytest.approx(0.037333, abs=1e-6)
    assert [b.request_ids for b in plan.batches] == [("r0",), ("r1",)]
    assert all(len(b.instance_ids) == 1 for b in plan.batches)
    plan = plan_batches(_reqs([8000, 4000, 2000]), _insts([10000, 10000]), MODELS)
    assert plan is not None and plan.cost == pytest.approx(0.08675, abs=1e-6)
    assert [b.request_ids for b in plan.batches] == [("r0",), ("r1", "r2")]
    assert sum(b.cost for b in plan.batches) == pytest.approx(plan.cost)


def _brute(lengths, free, models):
    """Every cut of the sorted requests into runs, each run on a run of instances after the
    previous run's (instances sorted by used, here all 0: by id), some instances unused."""
    order = sorted(range(len(lengths)), key=lambda i: -lengths[i])
    ls = [lengths[i] for i in order]
    best = float("inf")

    def place(start_req, start_inst, acc):
        nonlocal best
        if start_req == len(ls):
            best = min(best, acc)
            return
        for end in range(start_req + 1, len(ls) + 1):
            batch = ls[start_req:end]
            for first in range(start_inst, len(free)):
                for u, m in models.items():
                    if first + u > len(free) or sum(batch) > sum(free[first : first + u]):
                        continue
                    t = m.time(sum(batch), sum(x * x for x in batch))
                    place(end, first + u, acc + t * sum(1 / x for x in batch))

    place(0, 0, 0.0)
    return best


@pytest.mark.parametrize("seed", range(12))
def test_the_dp_finds_the_brute_force_optimum(seed) -> None:
    rng = random.Random(seed)
    lengths = [rng.choice([200, 900, 1500, 3000, 4500, 7000]) for _ in range(rng.randint(1, 5))]
    free = [rng.choice([3000, 5000, 8000, 12000]) for _ in range(rng.randint(1, 4))]
    models = {1: MODELS[1], 2: MODELS[2], 3: StepTimeModel(18, 0.0035, 3.5e-7)}
    plan = plan_batches(_reqs(lengths), _insts(free), models)
    want = _brute(lengths, free, models)
    if want == float("inf"):
        assert plan is None
    else:
        assert plan is not None and plan.cost == pytest.approx(want, rel=1e-9)
        placed = [r for b in plan.batches for r in b.request_ids]
        assert sorted(placed) == sorted(f"r{i}" for i in range(len(lengths)))
        used = [i for b in plan.batches for i in b.instance_ids]
        assert len(used) == len(set(used))


def _reference_dp(lengths, free, models):
    """The recurrence of docs/algorithms.md 6 written out over every state and every batch,
    with no bound at all: the band and reach limits of plan_batches must not change its value."""
    ls = sorted(lengths, reverse=True)
    n, kk = len(ls), len(free)
    f = [[math.inf] * (kk + 1) for _ in range(n + 1)]
    for k in range(kk + 1):
        f[0][k] = 0.0
    for k in range(1, kk + 1):
        for i in range(1, n + 1):
            best = f[i][k - 1]
            for u, m in models.items():
                if u > k:
                    continue
                room = sum(free[k - u : k])
                for j in range(i):
                    batch = ls[j:i]
                    if sum(batch) <= room and f[j][k - u] < math.inf:
                        t = m.time(sum(batch), sum(x * x for x in batch))
                        best = min(best, t * sum(1 / x for x in batch) + f[j][k - u])
            f[i][k] = best
    return f[n][kk]


def test_the_exchange_costs_what_the_compute_does_not_hide() -> None:
    m = StepTimeModel(1.0, 0.01, 1e-6, r=0.02, hidden=0.75)
    # 100 tokens, sum l^2 = 10,000: compute 1.0 + 0.01 s, the exchange 2.0 s; 0.75 of the shorter hidden.
    assert m.time(100, 10_000) == pytest.approx(1.0 + 1.01 + 2.0 - 0.75 * 1.01)
    # 1,000 tokens, sum l^2 = 10^6: compute 10 + 1 = 11 s, the exchange 20 s: the compute is the shorter.
    assert m.time(1_000, 1_000_000) == pytest.approx(1.0 + 11.0 + 20.0 - 0.75 * 11.0)
    assert StepTimeModel(1.0, 0.01, 1e-6, r=0.02, hidden=1.0).time(100, 10_000) == pytest.approx(3.0)
    assert StepTimeModel(1.0, 0.01, 1e-6).time(100, 10_000) == pytest.approx(2.01)
    with pytest.raises(ValueError, match="hidden=1.5"):
        StepTimeModel(1.0, 0.01, 1e-6, r=0.02, hidden=1.5)


@pytest.mark.parametrize("seed", range(8))
@pytest.mark.parametrize("exchange", [False, True])
def test_the_bounded_dp_equals_the_unbounded_recurrence(seed, exchange) -> None:
    """Larger than brute force reaches: 24-34 requests on 7-10 instances of uneven free KV, with
    lengths that fill rooms exactly (the bounds' edge cases), and degrees 1-4; with and without
    a K/V exchange partly hidden behind the compute (a cost no longer linear in the sums)."""
    rng = random.Random(100 + seed)
    lengths = [rng.choice([500, 1000, 2000, 4000, 6000]) for _ in range(rng.randint(24, 34))]
    free = [rng.choice([4000, 6000, 8000, 12000, 24000, 32000]) for _ in range(rng.randint(7, 10))]
    models = {1: MODELS[1], 2: MODELS[2], 3: StepTimeModel(18, 0.0035, 3.5e-7), 4: StepTimeModel(22, 0.0026, 2.6e-7)}
    if exchange:
        models = {u: StepTimeModel(m.a, m.b, m.c, r=0.002 * (u - 1) / u, hidden=0.8) for u, m in models.items()}
    plan = plan_batches(_reqs(lengths), _insts(free), models)
    want = _reference_dp(lengths, free, models)
    if want == math.inf:
        assert plan is None
    else:
        assert plan is not None and plan.cost == pytest.approx(want, rel=1e-12)
        assert sum(b.cost for b in plan.batches) == pytest.approx(plan.cost, rel=1e-12)
        assert sorted(r for b in plan.batches for r in b.request_ids) == sorted(f"r{i}" for i in range(len(lengths)))


def test_a_prompt_longer_than_any_instance_gets_a_group() -> None:
    plan = plan_batches(_reqs([9000]), _insts([5000, 5000]), MODELS)
    assert plan is not None and plan.batches[0].instance_ids == ("i0", "i1")
    assert plan_batches(_reqs([9000]), _insts([5000, 3000]), MODELS) is None
    assert plan_batches([], _insts([1]), MODELS).batches == ()


def test_bad_input_is_named() -> None:
    with pytest.raises(ValueError, match="'r0' has length 0"):
        plan_batches(_reqs([0]), _insts([10]), MODELS)
    with pytest.raises(ValueError, match=r"\[0\]"):
        plan_batches(_reqs([5]), _insts([10]), {0: MODELS[1]})
    with pytest.raises(ValueError, match="-1"):
        dispatch(_reqs([5]), -1)


def test_dispatch_is_in_arrival_order_and_stops_at_the_first_that_does_not_fit() -> None:
    queue = [EspRequest("late", 10, 5.0), EspRequest("a", 300, 1.0), EspRequest("b", 900, 2.0)]
    assert [r.request_id for r in dispatch(queue, 1000)] == ["a"]
    assert [r.request_id for r in dispatch(queue, 1300)] == ["a", "b", "late"]
    assert [r.request_id for r in dispatch(queue, 1300, max_requests=2)] == ["a", "b"]


def test_dispatch_backfills_past_a_request_that_does_not_fit_until_it_has_waited_long_enough() -> None:
    queue = [
        EspRequest("long", 900, 1.0),
        EspRequest("a", 300, 2.0),
        EspRequest("b", 500, 3.0),
        EspRequest("c", 100, 4.0),
    ]
    assert dispatch(queue, 800) == []  # strict arrival order: nothing passes the long request
    # Backfilling: the long one is passed over; a and b fill 800 of the free KV; c would not fit (100 > 0 left).
    backfilled = dispatch(queue, 800, now_s=10.0, backfill_wait_s=30.0)
    assert [r.request_id for r in backfilled] == ["a", "b"]
    assert [r.request_id for r in dispatch(queue, 850, now_s=10.0, backfill_wait_s=30.0)] == ["a", "b"]
    assert [r.request_id for r in dispatch(queue, 900, now_s=10.0, backfill_wait_s=30.0)] == ["long"]
    # Once it has waited 30 s, nothing passes it any more: the free KV accumulates for it.
    assert dispatch(queue, 800, now_s=31.0, backfill_wait_s=30.0) == []
    # A later request that does not fit is passed over too, and the cap still holds.
    assert [r.request_id for r in dispatch(queue, 500, now_s=10.0, backfill_wait_s=30.0)] == ["a", "c"]
    assert [r.request_id for r in dispatch(queue, 500, 1, now_s=10.0, backfill_wait_s=30.0)] == ["a"]
    with pytest.raises(ValueError, match="needs now_s"):
        dispatch(queue, 800, backfill_wait_s=30.0)
    with pytest.raises(ValueError, match="-1"):
        dispatch(queue, 800, now_s=1.0, backfill_wait_s=-1)


def test_shortest_first_dispatch_still_serves_a_request_that_has_waited_first() -> None:
    queue = [EspRequest("long", 900, 1.0), EspRequest("mid", 500, 2.0), EspRequest("short", 100, 3.0)]
    kw = {"backfill_wait_s": 30.0, "order": "shortest"}
    assert [r.request_id for r in dispatch(queue, 1000, now_s=10.0, **kw)] == ["short", "mid"]
    assert [r.request_id for r in dispatch(queue, 600, 1, now_s=10.0, **kw)] == ["short"]
    # The long one has waited 30 s: it goes first, and nothing passes it while it does not fit.
    assert [r.request_id for r in dispatch(queue, 1000, now_s=31.0, **kw)] == ["long", "short"]
    assert dispatch(queue, 800, now_s=31.0, **kw) == []
    with pytest.raises(ValueError, match="needs backfill_wait_s"):
        dispatch(queue, 800, now_s=1.0, order="shortest")
    with pytest.raises(ValueError, match="'random'"):
        dispatch(queue, 800, order="random")  # type: ignore[arg-type]


def test_allocation_takes_idle_first_then_preempts_the_least_used() -> None:
    insts = [
        EspInstance("busy-heavy", 900, 1000, idle=False),
        EspInstance("idle-small", 600, 1000),
        EspInstance("busy-light", 100, 1000, idle=False),
        EspInstance("idle-big", 0, 1000),
    ]
    chosen, preempted = allocate_instances(insts, 1200)
    assert [i.instance_id for i in chosen] == ["idle-big", "idle-small"] and preempted == []
    chosen, preempted = allocate_instances(insts, 2000)
    assert [i.instance_id for i in chosen] == ["idle-big", "idle-small", "busy-light"]
    assert preempted == ["busy-light"]
    with pytest.raises(ValueError, match="5000 KV tokens needed"):
        allocate_instances(insts, 5000)
    # all_idle: every idle instance is offered (the DP picks the degree), busy ones only as needed.
    chosen, preempted = allocate_instances(insts, 500, all_idle=True)
    assert [i.instance_id for i in chosen] == ["idle-big", "idle-small"] and preempted == []
    chosen, preempted = allocate_instances(insts, 2000, all_idle=True)
    assert [i.instance_id for i in chosen] == ["idle-big", "idle-small", "busy-light"]
    assert preempted == ["busy-light"]


def test_decode_runs_on_the_fewest_holders_and_grows_on_shortage() -> None:
    holders = [EspInstance("a", 900, 1000), EspInstance("b", 200, 1000), EspInstance("c", 500, 1000)]
    assert [i.instance_id for i in decode_degree(300, holders)] == ["b"]
    assert [i.instance_id for i in decode_degree(1000, holders)] == ["b", "c"]
    with pytest.raises(ValueError, match="have 1400 free"):
        decode_degree(2000, holders)


def test_decision_size_of_the_issue_runs() -> None:
    """64 instances and 256 requests plan (the time is a benchmark's, not a test's)."""
    rng = random.Random(1)
    reqs = [EspRequest(f"r{i}", rng.randint(100, 8000), float(i)) for i in range(256)]
    insts = [EspInstance(f"i{k}", rng.randint(0, 4000), 40000) for k in range(64)]
    models = {u: StepTimeModel(10 + 2 * u, 0.01 / u, 1e-6 / u) for u in (1, 2, 4, 8)}
    plan = plan_batches(reqs, insts, models)
    assert plan is not None
    assert sorted(r for b in plan.batches for r in b.request_ids) == sorted(r.request_id for r in reqs)
    for b in plan.batches:
        need = sum(next(r.length for r in reqs if r.request_id == rid) for rid in b.request_ids)
        assert need <= sum(i.free for i in insts if i.instance_id in b.instance_ids)


# -- plan_group: one request's group, as the live manager asks for it -----------------------------


def test_plan_group_cuts_a_prompt_no_instance_holds_among_the_fewest_that_do() -> None:
    from services.global_manager.core.esp import GroupPlan, plan_group

    insts = [EspInstance(f"i{k}", used=0, capacity=64) for k in range(4)]
    plan = plan_group(EspRequest("r", 150), 20, insts, block_size=16)
    assert isinstance(plan, GroupPlan)
    assert plan.bounds[0] == 0 and plan.bounds[-1] == 150
    slices = [b - a for a, b in zip(plan.bounds, plan.bounds[1:], strict=False)]
    assert len(plan.members) == len(slices) >= 3 and all(0 < n <= 64 for n in slices)
    # Whole blocks for every member but where the remainder lands; the master keeps room to decode.
    assert slices[-1] + 20 <= 64 or plan.spares
    assert set(plan.spares) == {i.instance_id for i in insts} - set(plan.members)


def test_plan_group_prefers_one_instance_for_a_short_prompt_and_refuses_what_cannot_fit() -> None:
    from services.global_manager.core.esp import plan_group

    insts = [EspInstance("a", used=0, capacity=4096), EspInstance("b", used=100, capacity=4096)]
    plan = plan_group(EspRequest("r", 120), 16, insts, block_size=16)
    assert plan is not None and plan.members == ("a",) and plan.bounds == (0, 120) and plan.spares == ("b",)
    small = [EspInstance(f"s{k}", used=0, capacity=32) for k in range(3)]
    assert plan_group(EspRequest("r", 97), 0, small, block_size=16) is None
    with pytest.raises(ValueError, match="decode_tokens"):
        plan_group(EspRequest("r", 10), -1, small)


def test_the_manager_does_not_plan_two_groups_on_the_same_room_until_heartbeats_show_it() -> None:
    from blitzmesh.v1 import global_manager_pb2
    from services.global_manager.core.types import InstanceState, InstanceView, LoadSample, Role
    from services.global_manager.esp_routing import EspRouter, EspUnplaced

    def views(sampled_s: float, used: int = 0) -> list[InstanceView]:
        return [
            InstanceView(
                f"w{k}", "m", Role.COLOCATED, InstanceState.SERVING, 2, 2, "h", sampled_s,
                load=LoadSample(f"w{k}", sampled_s, kv_blocks_used=used, kv_blocks_total=4),
            )
            for k in range(4)
        ]  # fmt: skip

    router = EspRouter(block_size=16)
    hops = {f"w{k}": global_manager_pb2.RouteHop(instance_id=f"w{k}") for k in range(4)}
    req = global_manager_pb2.ScheduleRequest(request_id="a", model_id="m", prompt_tokens=150, max_tokens=30)
    assert router.wants_group(views(0.0), 150, 30) and not router.wants_group(views(0.0), 250, 30)
    first = router.plan(req, views(0.0), hops, now_s=10.0)
    assert first.esp.bounds[-1] == 150
    req.request_id = "b"
    with pytest.raises(EspUnplaced, match="needs 150 \\+ 30 KV tokens"):
        router.plan(req, views(0.0), hops, now_s=10.1)  # the same stale heartbeats: no room left
    # Heartbeats sampled after the group started count its blocks; then the room is theirs to tell.
    second = router.plan(req, views(10.6, used=0), hops, now_s=10.7)
    assert second.esp.bounds[-1] == 150
    assert [g.request_id for g in router.to_proto()] == ["b", "a"]


def test_the_manager_follows_a_groups_holders_its_scale_up_and_its_end_from_heartbeats() -> None:
    from blitzmesh.v1 import global_manager_pb2
    from services.global_manager.core.types import InstanceState, InstanceView, LoadSample, Role
    from services.global_manager.esp_routing import EspRouter

    views = [
        InstanceView(
            f"w{k}", "m", Role.COLOCATED, InstanceState.SERVING, 2, 2, "h", 0.0,
            load=LoadSample(f"w{k}", 0.0, kv_blocks_used=0, kv_blocks_total=4),
        )
        for k in range(4)
    ]  # fmt: skip
    router = EspRouter(block_size=16)
    hops = {f"w{k}": global_manager_pb2.RouteHop(instance_id=f"w{k}") for k in range(4)}
    req = global_manager_pb2.ScheduleRequest(request_id="a", model_id="m", prompt_tokens=150, max_tokens=30)
    hop = router.plan(req, views, hops, now_s=10.0)
    gid, members = hop.esp.group_id, [m.instance_id for m in hop.esp.members]
    spare = next(i for i in hops if i not in members)
    t0 = router.recent[0].formed_s
    (info,) = router.to_proto()
    assert info.live and not info.holder_ids  # formed; no heartbeat has named it yet
    slices = dict(zip(members, (b - a for a, b in zip(hop.esp.bounds, hop.esp.bounds[1:], strict=False)), strict=True))
    for m in members:
        assert router.observe(m, ["other", gid], t0 + 0.5, [7, slices[m]]) == []
    info = router.to_proto()[0]
    assert list(info.holder_ids) == sorted(members)
    # Where its KV lies, by the holders' heartbeats: each member's slice.
    assert list(info.holder_kv_tokens) == [slices[m] for m in sorted(members)]
    # The master's KV fills up and a spare joins: its heartbeat names the group, with its share.
    (event,) = router.observe(spare, [gid], t0 + 1.0, [3])
    assert event[0] == "esp_scale_up" and event[1].group_id == gid and spare in event[2]
    assert router.observe(spare, [gid], t0 + 1.5) == []  # told once; no figure: the last one holds
    info = router.to_proto()[0]
    assert dict(zip(info.holder_ids, info.holder_kv_tokens, strict=True))[spare] == 3
    # The request ends: each holder's next heartbeat leaves it out; the last one ends the group.
    for m in [*members, spare][:-1]:
        assert router.observe(m, [], t0 + 2.0) == []
    (end,) = router.observe(spare, [], t0 + 2.0)
    assert end[0] == "esp_group_end" and "no instance reports it any more" in end[2]
    info = router.to_proto()[0]
    assert not info.live and not info.holder_ids
    assert router.observe(spare, [gid], t0 + 2.5) == []  # an ended group stays ended
    # A group no heartbeat ever named (it ended between two) ends once that is long enough ago,
    # and a holder that stops reporting (a lost instance) is dropped after as long.
    req.request_id = "b"
    later = router.plan(req, views, hops, now_s=30.0)
    t1 = router.recent[0].formed_s
    assert router.observe(members[0], [], t1 + 1.0) == []
    (gone,) = router.observe(members[0], [], t1 + 11.0)
    assert gone[1].group_id == later.esp.group_id and "no heartbeat ever showed it" in gone[2]
    req.request_id = "c"
    third = router.plan(req, views, hops, now_s=60.0)
    t2 = router.recent[0].formed_s
    assert router.observe("w0", [third.esp.group_id], t2 + 0.5) == []
    assert router.observe("w1", [], t2 + 5.0) == []  # w0 heard from 4.5 s ago: still a holder
    (lost,) = router.observe("w1", [], t2 + 11.0)  # w0 silent for 10.5 s: dropped, the group ends
    assert lost[0] == "esp_group_end" and lost[1].group_id == third.esp.group_id


# -- plan_batch_slices: several requests in one group iteration ------------------------------------


def test_a_batch_gives_each_request_its_fewest_holders_and_its_own_master() -> None:
    members = [EspInstance("a", 0, 1000), EspInstance("b", 400, 1000), EspInstance("c", 600, 1000)]
    plans = plan_batch_slices([(EspRequest("short", 500), 20), (EspRequest("long", 900), 50)], members)
    assert plans is not None
    # Longest first: 950 tokens fit a (1000 free) alone; then 520 go to b (600 free), not to a (50 left).
    assert plans["long"].members == ("a",) and plans["long"].bounds == (0, 900)
    assert plans["short"].members == ("b",) and plans["short"].bounds == (0, 500)
    assert plans["long"].spares == ("b", "c") and plans["short"].spares == ("c", "a")


def test_a_request_no_member_holds_is_cut_in_proportion_with_the_master_last() -> None:
    members = [EspInstance("a", 0, 1000), EspInstance("b", 200, 1000)]
    plans = plan_batch_slices([(EspRequest("r", 1500), 100)], members)
    assert plans is not None
    # b (800 free) and a (1000 free, less 100 for the decoded tokens: 900): 1500 * 800 // 1700 = 705,
    # 1500 * 900 // 1700 = 794, the 1 left to the first with room; a, with the most free, is master.
    assert plans["r"].members == ("b", "a") and plans["r"].bounds == (0, 706, 1500)
    assert plans["r"].spares == ()


def test_the_requests_of_a_batch_share_members_within_their_free_kv() -> None:
    members = [EspInstance("a", 0, 2048), EspInstance("b", 0, 2048), EspInstance("c", 1024, 2048)]
    reqs = [(EspRequest("r1", 2500), 100), (EspRequest("r2", 1200), 40), (EspRequest("r3", 300), 8)]
    plans = plan_batch_slices(reqs, members, block_size=16)
    assert plans is not None and set(plans) == {"r1", "r2", "r3"}
    held = {m.instance_id: 0 for m in members}
    for req, decode in reqs:
        plan = plans[req.request_id]
        assert plan.bounds[0] == 0 and plan.bounds[-1] == req.length
        for m, lo, hi in zip(plan.members, plan.bounds, plan.bounds[1:], strict=False):
            n = hi - lo + (decode if m == plan.members[-1] else 0)
            held[m] += -(-n // 16) * 16  # each slice in whole blocks of its own
    assert all(held[m.instance_id] <= m.free for m in members), held
    assert len({plans[r].members[-1] for r in plans}) >= 2  # several masters in one group
    # Tight: 40 tokens take 3 of a's 4 blocks, so 20 more cannot go to a alone (24 tokens, 1 block).
    tight = [EspInstance("a", 0, 64), EspInstance("b", 48, 64)]
    plans = plan_batch_slices([(EspRequest("r1", 40), 0), (EspRequest("r2", 20), 0)], tight, block_size=16)
    assert plans is not None and plans["r1"].members == ("a",)
    assert plans["r2"].members == ("a", "b") and plans["r2"].bounds == (0, 16, 20)  # a block on each


def test_a_batch_that_does_not_fit_is_refused_and_bad_input_named() -> None:
    members = [EspInstance("a", 0, 1000), EspInstance("b", 0, 1000)]
    assert plan_batch_slices([(EspRequest("r1", 1200), 0), (EspRequest("r2", 900), 0)], members) is None
    with pytest.raises(ValueError, match="'r0'"):
        plan_batch_slices([(EspRequest("r0", 0), 1)], members)
    with pytest.raises(ValueError, match="block_size must be >= 1, got 0"):
        plan_batch_slices([], members, block_size=0)


def test_plan_batches_then_slices_place_every_request_of_a_batched_plan() -> None:
    """A large fixed cost per iteration makes the DP batch requests together; every batch's
    requests then get slices on that batch's instances only, within their free KV."""
    models = {1: StepTimeModel(1000, 0.01, 1e-6), 2: StepTimeModel(1100, 0.005, 5e-7)}
    reqs = _reqs([3000, 2500, 1200, 800, 400])
    insts = [EspInstance(f"i{k}", 1000 * k, 6000) for k in range(4)]
    plan = plan_batches(reqs, insts, models)
    assert plan is not None and max(len(b.request_ids) for b in plan.batches) >= 2
    by_id = {r.request_id: r for r in reqs}
    for batch in plan.batches:
        members = [i for i in insts if i.instance_id in batch.instance_ids]
        plans = plan_batch_slices([(by_id[r], 0) for r in batch.request_ids], members)
        assert plans is not None and set(plans) == set(batch.request_ids)
        assert all(set(p.members) <= set(batch.instance_ids) for p in plans.values())
