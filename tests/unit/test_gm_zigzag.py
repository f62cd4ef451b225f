"""ZigZag execution scheduling in the global manager's pure core: the prefill ILP against a
brute-force enumeration, C3 as printed versus with T_i = 0 allowed, the in-flight cap, partner
and live-instance choice, the zigzag gate, and the docs/algorithms.md 3 throughput vector."""

from __future__ import annotations

import dataclasses
import itertools
import math
from fractions import Fraction

import pytest

from services.global_manager.core.types import InstanceState, InstanceView, LoadSample, Role
from services.global_manager.core.zigzag import (
    ZigzagIlpInfeasibleError,
    choose_live_instance,
    choose_zigzag_partner,
    ilp_objective_layers,
    pair_throughput,
    plan_prefill_ilp,
    should_zigzag,
    zigzag_req_limit,
)

S = InstanceState
P, D, C = Role.PREFILL, Role.DECODE, Role.COLOCATED


# ------------------------------------------------------------------------------------------
# ILP: an independent reading of the printed constraints, and brute force over it
# ------------------------------------------------------------------------------------------


def feasible(t: tuple[int, ...], L: int, tl: float, k0: int, *, printed_c3: bool) -> bool:
    """docs/algorithms.md 3 read literally, 1-based; `printed_c3=False` lets T_i = 0 skip C3."""
    n = len(t)
    s = [L - x for x in t]  # C1
    if any(not 0 <= x <= L for x in t) or t[0] > k0:
        return False
    for i in range(2, n + 1):
        ti = t[i - 1]
        if sum(t[:i]) > sum(s[: i - 1]):  # C2
            return False
        c3_applies = printed_c3 or ti > 0
        if c3_applies and tl * ti > sum(t[: i - 1]) + (n - i + 1) * (ti - 1) + 1e-9:  # C3
            return False
    return True


def objective(t: tuple[int, ...], L: int) -> Fraction:
    """(1/N) sum_{req} sum_{i<=req} S_i, as the double sum (not the weighted form under test)."""
    n = len(t)
    s = [L - x for x in t]
    return Fraction(sum(sum(s[:req]) for req in range(1, n + 1)), n)


def brute_force(L: int, N: int, tl: float, k0: int, *, printed_c3: bool) -> Fraction | None:
    best = None
    for t in itertools.product(range(L + 1), repeat=N):
        if feasible(t, L, tl, k0, printed_c3=printed_c3):
            value = objective(t, L)
            best = value if best is None else min(best, value)
    return best


def test_objective_is_the_weighted_sum_of_s() -> None:
    # S = (1, 2, 3): batch 1 waits 1, batch 2 waits 1 + 2, batch 3 waits 1 + 2 + 3 -> 10/3.
    assert ilp_objective_layers([1, 2, 3]) == pytest.approx(10 / 3)
    for s in [(4,), (0, 4), (3, 1, 0, 2), (5, 5, 5)]:
        t = tuple(5 - x for x in s)
        assert ilp_objective_layers(s) == pytest.approx(float(objective(t, 5)))
    with pytest.raises(ValueError, match="at least one batch"):
        ilp_objective_layers([])


CASES = [
    (L, N, tl, k0)
    for L, N in [(3, 1), (3, 2), (3, 3), (4, 3), (4, 4), (5, 3)]
    for tl in (0, 0.5, 1, 2, 3.5)
    for k0 in sorted({0, 1, L})
]


@pytest.mark.parametrize(("L", "N", "tl", "k0"), CASES)
def test_ilp_matches_brute_force_and_keeps_every_constraint(L: int, N: int, tl: float, k0: int) -> None:
    plan = plan_prefill_ilp(L, N, tl, k0_layers=k0)
    assert plan.status == "optimal"
    assert len(plan.new_layers) == len(plan.old_layers) == N
    assert all(t + s == L for t, s in zip(plan.new_layers, plan.old_layers, strict=True))  # C1
    assert feasible(plan.new_layers, L, tl, k0, printed_c3=False)
    assert Fraction(plan.objective_layers).limit_denominator(N) == objective(plan.new_layers, L)
    assert objective(plan.new_layers, L) == brute_force(L, N, tl, k0, printed_c3=False)


@pytest.mark.parametrize(("L", "N", "tl", "k0"), [c for c in CASES if c[1] >= 2][::3])
def test_printed_c3_agrees_with_brute_force_where_feasible(L: int, N: int, tl: float, k0: int) -> None:
    expected = brute_force(L, N, tl, k0, printed_c3=True)
    if expected is None:
        with pytest.raises(ZigzagIlpInfeasibleError):
            plan_prefill_ilp(L, N, tl, k0_layers=k0, c3="as_printed")
    else:
        plan = plan_prefill_ilp(L, N, tl, k0_layers=k0, c3="as_printed")
        assert feasible(plan.new_layers, L, tl, k0, printed_c3=True)
        assert objective(plan.new_layers, L) == expected


def test_printed_c3_is_infeasible_where_ours_is_not() -> None:
    # L = 4, N = 3, Time_l = 2, nothing loaded at the start: T_1 = 0, and batch 2 can neither
    # skip the new instance (C3: 0 <= 0 + 2 * (0 - 1) is false) nor use it
    # (2 * T_2 <= 2 * (T_2 - 1) is false for every T_2).
    L, N, tl, k0 = 4, 3, 2.0, 0
    assert brute_force(L, N, tl, k0, printed_c3=True) is None
    with pytest.raises(ZigzagIlpInfeasibleError, match=r"L=4 N=3 Time_l=2.0 k0=0 c3='as_printed'"):
        plan_prefill_ilp(L, N, tl, k0_layers=k0, c3="as_printed")
    plan = plan_prefill_ilp(L, N, tl, k0_layers=k0)
    # With T_i = 0 allowed the old instance runs everything: stop-the-world for this sequence.
    assert plan.new_layers == (0, 0, 0)
    assert plan.old_layers == (4, 4, 4)
    assert plan.objective_layers == pytest.approx((4 + 8 + 12) / 3)
    assert brute_force(L, N, tl, k0, printed_c3=False) == Fraction(8)


def test_both_forms_agree_when_printed_c3_never_binds_at_zero() -> None:
    # Loading as fast as computing and a head start of L layers: the printed form is feasible
    # and both forms reach the same optimum (the relaxation only adds T_i = 0 points).
    ours = plan_prefill_ilp(4, 3, 0.5, k0_layers=4)
    printed = plan_prefill_ilp(4, 3, 0.5, k0_layers=4, c3="as_printed")
    assert ours.objective_layers == pytest.approx(printed.objective_layers)


def test_first_batch_runs_only_the_layers_loaded_at_the_start() -> None:
    assert plan_prefill_ilp(8, 1, 1.0, k0_layers=3).new_layers == (3,)
    assert plan_prefill_ilp(8, 1, 1.0, k0_layers=0).new_layers == (0,)
    full = plan_prefill_ilp(8, 1, 1.0, k0_layers=8)
    assert full.new_layers == (8,) and full.objective_layers == 0.0
    for k0 in (0, 2):
        assert plan_prefill_ilp(6, 4, 1.0, k0_layers=k0).new_layers[0] <= k0


def dp_optimum(L: int, N: int, tl: float, k0: int) -> Fraction:
    """Exact optimum by dynamic programming over A = sum_{j<i} T_j, which is all that C2 and
    C3 read of the past (sum_{j<i} S_j = (i - 1) * L - A). Maximises sum_i (N - i + 1) T_i."""
    best = {t1: N * t1 for t1 in range(k0 + 1)}  # A_1 -> best weighted sum so far
    for i in range(2, N + 1):
        r = N - i + 1
        nxt: dict[int, int] = {}
        for a, value in best.items():
            for t in range(L + 1):
                if a + t > (i - 1) * L - a:  # C2
                    break
                if t > 0 and tl * t > a + r * (t - 1) + 1e-9:  # C3, T_i = 0 exempt
                    continue
                if nxt.get(a + t, -1) < value + r * t:
                    nxt[a + t] = value + r * t
        best = nxt
    return Fraction(L * N * (N + 1) // 2 - max(best.values()), N)


@pytest.mark.parametrize("tl", [0.5, 2.0, 8.0, 10.0, 13.0, 14.5, 16.0])
@pytest.mark.parametrize("k0", [0, 1, 4])
def test_ilp_is_optimal_at_the_benchmark_size(tl: float, k0: int) -> None:
    plan = plan_prefill_ilp(32, 16, tl, k0_layers=k0)
    assert feasible(plan.new_layers, 32, tl, k0, printed_c3=False)
    assert objective(plan.new_layers, 32) == dp_optimum(32, 16, tl, k0)


def test_dp_oracle_agrees_with_brute_force() -> None:
    for L, N, tl, k0 in CASES:
        assert dp_optimum(L, N, tl, k0) == brute_force(L, N, tl, k0, printed_c3=False)


def test_benchmark_size_keeps_every_constraint() -> None:
    for tl in (0.5, 2.0, 8.0, 16.0):
        plan = plan_prefill_ilp(32, 16, tl, k0_layers=1)
        assert plan.status == "optimal"
        assert feasible(plan.new_layers, 32, tl, 1, printed_c3=False)
        assert plan.objective_layers <= ilp_objective_layers([32 - 1] + [32] * 15) + 1e-9  # beats stop-the-world


def test_plan_is_frozen() -> None:
    plan = plan_prefill_ilp(4, 2, 1.0, k0_layers=1)
    with pytest.raises(dataclasses.FrozenInstanceError):
        plan.objective_layers = 0.0  # type: ignore[misc]


@pytest.mark.parametrize(
    ("args", "kwargs", "match"),
    [
        ((0, 3, 1.0), {"k0_layers": 0}, r"num_layers \(L\) must be >= 1, got 0"),
        ((4, 0, 1.0), {"k0_layers": 0}, r"num_batches \(N\) must be >= 1, got 0"),
        ((4, 3, -0.5), {"k0_layers": 0}, r"Time_l\) must be finite and >= 0, got -0.5"),
        ((4, 3, math.nan), {"k0_layers": 0}, r"got nan"),
        ((4, 3, 1.0), {"k0_layers": 5}, r"k0_layers must be in \[0, num_layers=4\], got 5"),
        ((4, 3, 1.0), {"k0_layers": -1}, r"got -1"),
        ((4.0, 3, 1.0), {"k0_layers": 0}, r"num_layers \(L\) must be an int, got 4.0"),
        ((4, True, 1.0), {"k0_layers": 0}, r"num_batches \(N\) must be an int, got True"),
        ((4, 3, "1"), {"k0_layers": 0}, r"must be a number, got '1'"),
        ((4, 3, 1.0), {"k0_layers": 0, "c3": "loose"}, r"c3 must be .*, got 'loose'"),
        ((4, 3, 1.0), {"k0_layers": 0, "time_limit_s": 0}, r"time_limit_s must be finite and > 0, got 0"),
    ],
)
def test_ilp_rejects_bad_inputs_quoting_them(args: tuple, kwargs: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        plan_prefill_ilp(*args, **kwargs)


# ------------------------------------------------------------------------------------------
# In-flight cap
# ------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("elapsed_s", "limit"),
    [(0.0, 4), (0.199, 4), (0.2, 3), (0.399, 3), (0.4, 2), (0.6, 2), (10.0, 2), (-1.0, 4)],
)
def test_req_limit_shrinks_by_one_per_200ms_to_two(elapsed_s: float, limit: int) -> None:
    assert zigzag_req_limit(100.0 + elapsed_s, 100.0) == limit


def test_req_limit_overrides_and_step_boundaries() -> None:
    # 0.7 - 0.1 is 0.6 minus a float ulp: still three whole steps of 0.2 s.
    assert zigzag_req_limit(0.7, 0.1, start=10) == 7
    assert zigzag_req_limit(0.35, 0.0, start=6, step_s=0.1, floor=1) == 3
    assert zigzag_req_limit(5.0, 0.0, start=6, step_s=0.1, floor=1) == 1
    assert zigzag_req_limit(5.0, 0.0, start=3, floor=3) == 3


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"step_s": 0.0}, r"step_s must be finite and > 0, got 0.0"),
        ({"floor": 5}, r"floor=5 start=4"),
        ({"floor": -1}, r"floor=-1"),
    ],
)
def test_req_limit_rejects_bad_parameters(kwargs: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        zigzag_req_limit(1.0, 0.0, **kwargs)
    with pytest.raises(ValueError, match="now_s must be finite, got nan"):
        zigzag_req_limit(math.nan, 0.0)


# ------------------------------------------------------------------------------------------
# Pairing and routing
# ------------------------------------------------------------------------------------------


def view(
    iid: str,
    state: InstanceState = S.SERVING,
    *,
    role: Role = P,
    model: str = "m",
    layers: int | None = None,
    num_layers: int = 8,
    waiting: int | None = 0,
    running: int = 0,
    kv_used: int = 0,
) -> InstanceView:
    """A view with a load report (`waiting=None`: no report yet)."""
    if layers is None:
        layers = num_layers if state in (S.SERVING, S.DRAINING) else 0
    load = (
        None
        if waiting is None
        else LoadSample(
            instance_id=iid, now_s=0.0, running=running, waiting=waiting, kv_blocks_used=kv_used, kv_blocks_total=1000
        )
    )
    return InstanceView(
        instance_id=iid,
        model=model,
        role=role,
        state=state,
        layers_loaded=layers,
        num_layers=num_layers,
        host="h0",
        last_heartbeat_s=0.0,
        load=load,
    )


NEW = view("new", S.LOADING, layers=2)


def test_partner_is_the_overloaded_one_with_fewest_used_kv_blocks() -> None:
    views = [
        NEW,
        view("idle", kv_used=10),
        view("busy", waiting=2, kv_used=300),
        view("full", waiting=1, kv_used=120),
    ]
    choice = choose_zigzag_partner(views, "new", "m")
    assert choice is not None
    assert choice.partner.instance_id == "full"
    assert choice.reason == "fewest used KV blocks (120) among 2 overloaded SERVING PREFILL instances of 'm'"


def test_partner_falls_back_to_fewest_kv_blocks_when_none_is_overloaded() -> None:
    choice = choose_zigzag_partner([NEW, view("a", kv_used=50), view("b", kv_used=40)], "new", "m")
    assert choice is not None and choice.partner.instance_id == "b"
    assert "none overloaded" in choice.reason and "(40)" in choice.reason


def test_partner_ties_and_unreported_instances() -> None:
    views = [NEW, view("z", waiting=1, kv_used=5), view("y", waiting=3, kv_used=5), view("x", waiting=1, kv_used=5)]
    assert choose_zigzag_partner(views, "new", "m").partner.instance_id == "x"  # fewer waiting, then id
    quiet = [NEW, view("unreported", waiting=None), view("reported", kv_used=900)]
    assert choose_zigzag_partner(quiet, "new", "m").partner.instance_id == "reported"
    only = choose_zigzag_partner([NEW, view("unreported", waiting=None)], "new", "m")
    assert only is not None and "no load report yet" in only.reason


def test_partner_capacity_makes_an_instance_overloaded() -> None:
    views = [NEW, view("a", running=8, kv_used=500), view("b", running=3, kv_used=100)]
    assert choose_zigzag_partner(views, "new", "m").partner.instance_id == "b"
    capped = choose_zigzag_partner(views, "new", "m", max_running_by_instance={"a": 8, "b": 16})
    assert capped.partner.instance_id == "a" and "among 1 overloaded" in capped.reason


def test_partner_filters_state_model_role_and_exclusions() -> None:
    views = [
        NEW,
        view("other-model", model="m2", waiting=5),
        view("decode", role=D, waiting=5),
        view("loading", S.LOADING, layers=4, waiting=5),
        view("draining", S.DRAINING, waiting=5),
        view("taken", waiting=5),
    ]
    assert choose_zigzag_partner(views, "new", "m", exclude_ids={"taken"}) is None
    assert choose_zigzag_partner(views, "new", "m").partner.instance_id == "taken"
    colocated = [view("new-c", S.LOADING, role=C, layers=1), view("p", waiting=1), view("c", role=C, waiting=1)]
    assert choose_zigzag_partner(colocated, "new-c", "m").partner.instance_id == "c"


def test_partner_rejects_an_unknown_or_mismatched_new_instance() -> None:
    with pytest.raises(ValueError, match=r"new instance 'ghost' is not among the 1 views"):
        choose_zigzag_partner([view("a")], "ghost", "m")
    with pytest.raises(ValueError, match=r"loads model 'm', not 'm2'"):
        choose_zigzag_partner([NEW, view("a", model="m2")], "new", "m2")


def test_live_instance_prefers_most_layers_under_its_cap() -> None:
    views = [view("a", S.LOADING, layers=2), view("b", S.LOADING, layers=5), view("c", S.LOADING, layers=3)]
    started = {"a": 0.0, "b": 0.0, "c": 0.0}
    choice = choose_live_instance(views, "m", {}, 0.0, started)
    assert choice is not None and choice.instance.instance_id == "b"
    assert (choice.inflight, choice.limit) == (0, 4)
    assert choice.reason.startswith("most layers loaded (5/8) among 3 live LOADING instances")
    # b is at its cap of 4: c takes the next one.
    assert choose_live_instance(views, "m", {"b": 4}, 0.0, started).instance.instance_id == "c"


def test_live_instance_cap_shrinks_as_loading_goes_on() -> None:
    views = [view("a", S.LOADING, layers=4)]
    assert choose_live_instance(views, "m", {"a": 2}, 10.0, {"a": 10.0}).limit == 4
    assert choose_live_instance(views, "m", {"a": 2}, 10.2, {"a": 10.0}).limit == 3
    assert choose_live_instance(views, "m", {"a": 2}, 10.4, {"a": 10.0}) is None
    assert choose_live_instance(views, "m", {"a": 1}, 99.0, {"a": 10.0}).limit == 2
    custom = choose_live_instance(views, "m", {"a": 5}, 10.0, {"a": 10.0}, limit_start=8, limit_floor=3)
    assert custom is not None and custom.limit == 8


def test_live_instance_eligibility() -> None:
    views = [
        view("no-start", S.LOADING, layers=4),  # a chain middle: never went live
        view("empty", S.LOADING, layers=0),
        view("serving"),
        view("other-model", S.LOADING, model="m2", layers=4),
    ]
    started = {v.instance_id: 0.0 for v in views if v.instance_id != "no-start"}
    assert choose_live_instance(views, "m", {}, 0.0, started) is None
    # Every decoder layer but not yet the embedding and head: still runs ahead (all L layers).
    full = choose_live_instance([*views, view("all-layers", S.LOADING, layers=8)], "m", {}, 0.0, {"all-layers": 0.0})
    assert full is not None and full.instance.instance_id == "all-layers"
    tie = [view("y", S.LOADING, layers=3), view("x", S.LOADING, layers=3), view("w", S.LOADING, layers=3)]
    pick = choose_live_instance(tie, "m", {"w": 1}, 0.0, {"x": 0.0, "y": 0.0, "w": 0.0})
    assert pick.instance.instance_id == "x"  # fewer in flight, then id
    with pytest.raises(ValueError, match=r"counts must be >= 0, got \{'x': -1\}"):
        choose_live_instance(tie, "m", {"x": -1}, 0.0, {})


def test_should_zigzag_only_when_every_serving_instance_is_overloaded() -> None:
    gate = should_zigzag([])
    assert not gate.zigzag and gate.reason == "no SERVING instance to partner with"
    assert not should_zigzag([view("a", waiting=3), view("b", waiting=0)]).zigzag
    gate = should_zigzag([view("a", waiting=3), view("b", waiting=1), view("l", S.LOADING, layers=2)])
    assert gate.zigzag and gate.reason.startswith("all 2 SERVING instances overloaded")
    # A full batch counts only when the capacity is reported.
    busy = [view("a", waiting=1), view("b", running=16)]
    assert not should_zigzag(busy).zigzag
    assert should_zigzag(busy, max_running_by_instance={"b": 16}).zigzag
    assert not should_zigzag(busy, max_running_by_instance={"b": 32}).zigzag
    # No report yet counts as idle; filters by model and role.
    assert not should_zigzag([view("a", waiting=1), view("new", waiting=None)]).zigzag
    mixed = [view("a", waiting=1), view("b", model="m2"), view("c", role=D)]
    assert should_zigzag(mixed, model="m", role=P).zigzag
    assert not should_zigzag(mixed).zigzag


# ------------------------------------------------------------------------------------------
# Throughput model
# ------------------------------------------------------------------------------------------


def test_pair_throughput_vectors() -> None:
    # docs/algorithms.md 3: a 7-layer model serves 1/7 of a request per layer-time; with one layer
    # on the new instance the pair serves 1/6; with half the layers, twice the old rate.
    assert pair_throughput(7, 0) == pytest.approx(1 / 7)
    assert pair_throughput(7, 1) == pytest.approx(1 / 6)
    assert pair_throughput(7, 3) == pytest.approx(1 / 4)
    assert pair_throughput(7, 4) == pytest.approx(2 / 7)
    assert pair_throughput(8, 4) == pytest.approx(2 * pair_throughput(8, 0))
    assert pair_throughput(7, 7) == pytest.approx(2 / 7)  # two full instances
    rates = [pair_throughput(32, k) for k in range(33)]
    assert all(a <= b for a, b in itertools.pairwise(rates))


def test_pair_throughput_is_the_fluid_lp_optimum() -> None:
    # The docstring's LP solved numerically: max x + y s.t. k x <= 1, (L - k) x + L y <= 1.
    from scipy.optimize import linprog

    for L, k in [(7, 0), (7, 1), (7, 2), (7, 5), (10, 5), (32, 31)]:
        res = linprog([-1, -1], A_ub=[[k, 0], [L - k, L]], b_ub=[1, 1], bounds=[(0, None), (0, None)])
        assert res.status == 0
        assert pair_throughput(L, k) == pytest.approx(-res.fun)


def test_pair_throughput_rejects_bad_inputs() -> None:
    with pytest.raises(ValueError, match=r"num_layers must be >= 1, got 0"):
        pair_throughput(0, 0)
    with pytest.raises(ValueError, match=r"k_layers must be in \[0, num_layers=7\], got 8"):
        pair_throughput(7, 8)
    with pytest.raises(ValueError, match=r"k_layers must be an int, got 1.5"):
        pair_throughput(7, 1.5)  # type: ignore[arg-type]


def test_the_gate_opens_on_slow_first_tokens_when_asked() -> None:
    """With no request waiting, prefill work can still crowd every step: a TTFT p50 at or over
    `ttft_s` on every SERVING instance opens the gate too."""
    slow = [
        dataclasses.replace(v, load=dataclasses.replace(v.load, ttft_p50_s=t))
        for v, t in ((view("a", waiting=0), 1.5), (view("b", waiting=0), 1.0))
    ]
    assert not should_zigzag(slow).zigzag
    gate = should_zigzag(slow, ttft_s=1.0)
    assert gate.zigzag and "TTFT p50 >= 1.0s" in gate.reason
    assert not should_zigzag(slow, ttft_s=1.2).zigzag
