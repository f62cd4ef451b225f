"""ZigZag execution scheduling (docs/algorithms.md 3, BlitzScale OSDI'25): the pure planning pieces.

A LOADING instance holding k of L layers runs layers [0, k) of a request and hands the hidden
states to an overloaded full partner that runs [k, L). This module decides, without I/O or clock
reads (`now_s` is passed in): the layer split of a prefill batch sequence (an ILP), the cap on
in-flight zigzag requests per new instance, the partner, which loading instance takes the next
request, whether to zigzag at all, and the throughput model the vectors in the issue come from.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Collection, Iterable, Mapping
from dataclasses import dataclass, replace
from typing import Literal

from .actions import MigrateRequests
from .types import InstanceState, InstanceView, Role

__all__ = [
    "C3Form",
    "HandBack",
    "LiveChoice",
    "LiveLayers",
    "Paired",
    "PartnerChoice",
    "PullPeer",
    "StoppedLive",
    "WentLive",
    "ZigzagEffect",
    "ZigzagGate",
    "ZigzagIlpInfeasibleError",
    "ZigzagIlpPlan",
    "ZigzagDispatch",
    "ZigzagLive",
    "ZigzagSettings",
    "ZigzagSplit",
    "ZigzagStep",
    "ZigzagTracker",
    "choose_live_instance",
    "choose_pull_partner",
    "choose_zigzag_partner",
    "ilp_objective_layers",
    "pair_throughput",
    "plan_hand_back",
    "plan_take_back",
    "plan_prefill_ilp",
    "should_zigzag",
    "zigzag_req_limit",
]

#: How C3 treats a batch that runs no layer on the new instance (see `plan_prefill_ilp`).
C3Form = Literal["zero_allowed", "as_printed"]

# A float slack for the feasibility check of the rounded solution: C3 has a real coefficient
# (Time_l), so an integer point the solver accepted may miss it by HiGHS's tolerance (1e-6).
_FEAS_TOL = 1e-6


# ------------------------------------------------------------------------------------------
# ILP for a prefill batch sequence
# ------------------------------------------------------------------------------------------


class ZigzagIlpInfeasibleError(ValueError):
    """The ILP has no solution. Only the paper's printed C3 (`c3="as_printed"`) can get here:
    with `"zero_allowed"` the all-on-the-old-instance plan (every T_i = 0) is always feasible."""


@dataclass(frozen=True, slots=True)
class ZigzagIlpPlan:
    """The optimal layer split of N prefill batches between a loading and a full instance.

    `new_layers[i-1]` is the paper's T_i (layers [0, T_i) of batch i run on the new instance);
    `old_layers[i-1]` is S_i = L - T_i (layers [T_i, L) run on the old one). `objective_layers`
    is (1/N) * sum_i (N - i + 1) * S_i in units of one layer's compute: the mean over the N
    batches of the old instance's work queued up to and including that batch. `status` is
    "optimal", or "time_limit" when the solver stopped at `time_limit_s` with a feasible but
    unproven plan. No solve time is measured here (the core reads no clock); the bench does.
    """

    num_layers: int
    num_batches: int
    load_time_layers: float
    k0_layers: int
    c3: C3Form
    new_layers: tuple[int, ...]
    old_layers: tuple[int, ...]
    objective_layers: float
    status: Literal["optimal", "time_limit"]


def _check_ilp_inputs(num_layers: int, num_batches: int, load_time_layers: float, k0_layers: int) -> None:
    for name, value in (("num_layers (L)", num_layers), ("num_batches (N)", num_batches), ("k0_layers", k0_layers)):
        if isinstance(value, bool) or not isinstance(value, int):
            raise ValueError(f"{name} must be an int, got {value!r}")
    if num_layers < 1:
        raise ValueError(f"num_layers (L) must be >= 1, got {num_layers!r}")
    if num_batches < 1:
        raise ValueError(f"num_batches (N) must be >= 1, got {num_batches!r}")
    if not 0 <= k0_layers <= num_layers:
        raise ValueError(f"k0_layers must be in [0, num_layers={num_layers!r}], got {k0_layers!r}")
    if isinstance(load_time_layers, bool) or not isinstance(load_time_layers, int | float):
        raise ValueError(f"load_time_layers (Time_l) must be a number, got {load_time_layers!r}")
    if not (math.isfinite(load_time_layers) and load_time_layers >= 0):
        raise ValueError(f"load_time_layers (Time_l) must be finite and >= 0, got {load_time_layers!r}")


def ilp_objective_layers(old_layers: Iterable[int]) -> float:
    """(1/N) * sum_{req=1..N} sum_{i<=req} S_i = (1/N) * sum_i (N - i + 1) * S_i.

    Batch `req` finishes once the old instance has run its own share and the shares of every
    batch before it (it serves them in order), so the objective is the mean of those running
    sums: batch i's S_i is counted once for itself and for each of the N - i batches after it.
    """
    s = list(old_layers)
    n = len(s)
    if n == 0:
        raise ValueError("old_layers must name at least one batch, got none")
    return sum((n - i) * s_i for i, s_i in enumerate(s)) / n


def plan_prefill_ilp(
    num_layers: int,
    num_batches: int,
    load_time_layers: float,
    *,
    k0_layers: int,
    c3: C3Form = "zero_allowed",
    time_limit_s: float | None = None,
) -> ZigzagIlpPlan:
    """Solve BlitzScale's ILP for a sequence of N prefill batches with `scipy.optimize.milp`.

    Variables, for batches i = 1..N: integers T_i (layers on the new instance) and S_i (on the
    old one) in [0, L]. Minimise (1/N) * sum_i (N - i + 1) * S_i (`ilp_objective_layers`),
    subject to
      C1  S_i + T_i = L;
      C2  sum_{j<=i} T_j <= sum_{j<i} S_j                       (i > 1): as we read it, the
          new instance has finished batch i's share by the time the old one is done with the
          batches before it, so the old instance never waits for a hand-off;
      C3  Time_l * T_i <= sum_{j<i} T_j + (N - i + 1)(T_i - 1)  (i > 1): the layers batch i
          runs on the new instance have arrived by the time it runs them (the right side
          counts the new instance's work as if it ran the remaining batches layer by layer).
          Time_l (`load_time_layers`) is the time to load one layer in units of one layer's
          compute.

    C3 as printed forbids T_i = 0 whenever sum_{j<i} T_j < N - i + 1 (its right side is then
    negative), although running no layer of batch i on the new instance needs no layer at all.
    With k0 = 0 (so T_1 = 0) and Time_l >= N - 1, batch 2 can satisfy it neither with T_2 = 0
    nor with T_2 >= 1, so the printed ILP has no solution at all (e.g. L = 4, N = 3, Time_l = 2:
    loading a layer takes as long as computing two). We treat
    T_i = 0 as always allowed: a binary z_i with z_i <= T_i <= L * z_i (z_i = 1 exactly when
    batch i runs a layer on the new instance), and C3 relaxed by a big-M of M_i = N - i + 1
    when z_i = 0:
          Time_l * T_i - sum_{j<i} T_j - (N - i + 1) * T_i + M_i * z_i <= 0.
    With z_i = 1 this is the printed C3; with z_i = 0 (so T_i = 0) it reads
    -sum_{j<i} T_j <= 0, always true, and M_i is the smallest constant that makes it so. C3
    therefore binds exactly the batches that run at least one layer on the new instance, and
    the plan with every T_i = 0 (stop-the-world for this sequence) is always feasible.
    `c3="as_printed"` solves the printed form instead (z_i fixed to 1, T_i = 0 still allowed
    where the printed C3 holds), for comparison; its infeasibility raises
    `ZigzagIlpInfeasibleError`.

    The optimum tends to alternate (T = 1, 30, 2, 30, 2, ... for L = 32, N = 16, k0 = 1 and
    Time_l = 8): C2 lets a batch that runs almost all of its layers on the new instance follow
    one that runs almost none there, and the objective's weights favour early batches.

    Batch 1: the printed ILP leaves T_1 free, which would let the first batch run all L layers
    on an instance that holds few of them. We assume both instances start batch 1 at once and
    the new instance runs only layers it already holds, so T_1 <= k0 (`k0_layers`, the layers
    loaded when the sequence starts). C3 is kept as printed otherwise: it counts load time from
    the start of the sequence and gives the k0 head start no credit, which is conservative.

    `time_limit_s` is passed to HiGHS as its own limit; the function reads no clock. The
    objective is minimised in the integer form sum_i (N - i + 1) * S_i with a zero relative gap,
    so the plan is optimal, not within HiGHS's default 0.01% of it. The solver sees T, the
    prefix sums A_i = sum_{j<=i} T_j and z (S is substituted through C1); a plan that breaks a
    constraint after rounding raises RuntimeError rather than reaching a caller.

    HiGHS 1.12 (scipy 1.17) sometimes prints a stray line,
    "HighsMipSolverData::transformNewIntegerFeasibleSolution tmpSolver.run();", to stdout while
    repairing an incumbent; it cannot be silenced through scipy and does not affect the plan
    (upstream ERGO-Code/HiGHS#2783); 4 of 576 solves over Time_l 0.5..16 at the bench's sizes did.
    """
    _check_ilp_inputs(num_layers, num_batches, load_time_layers, k0_layers)
    if c3 not in ("zero_allowed", "as_printed"):
        raise ValueError(f"c3 must be 'zero_allowed' or 'as_printed', got {c3!r}")
    if time_limit_s is not None and not (math.isfinite(time_limit_s) and time_limit_s > 0):
        raise ValueError(f"time_limit_s must be finite and > 0, got {time_limit_s!r}")
    # Imported here so the rest of the core (and the manager) imports without scipy.
    import numpy as np
    from scipy.optimize import Bounds, LinearConstraint, milp
    from scipy.sparse import coo_matrix

    L, N, tl = num_layers, num_batches, float(load_time_layers)

    # Columns, 0-based i for batch i + 1: T_i, the prefix sums A_i = sum_{j<=i} T_j, and z_i.
    # S_i = L - T_i (C1) is substituted, so sum_{j<i} S_j = i * L - A_{i-1} for 0-based i.
    # Prefix sums keep every row at 3 non-zeros instead of O(i). With the two tightenings
    # below, the slowest solve over Time_l in 0.5..16 and k0 in {0, 1, 4} at L = 32, N = 16
    # dropped from 32-42 ms (dense rows, neither tightening) to about 20 ms on the dev box;
    # leaving either one out made some load time worse than before (up to 130 ms).
    def t_col(i: int) -> int:
        return i

    def a_col(i: int) -> int:
        return N + i

    def z_col(i: int) -> int:
        return 2 * N + i

    nvar = 3 * N
    row_ids: list[int] = []
    col_ids: list[int] = []
    coefs: list[float] = []
    lo: list[float] = []
    hi: list[float] = []

    def add(terms: dict[int, float], lb: float, ub: float) -> None:
        for col, coef in terms.items():
            row_ids.append(len(lo))
            col_ids.append(col)
            coefs.append(coef)
        lo.append(lb)
        hi.append(ub)

    for i in range(N):
        prefix = {a_col(i): 1.0, t_col(i): -1.0}
        if i > 0:
            prefix[a_col(i - 1)] = -1.0
        add(prefix, 0.0, 0.0)  # A_i = A_{i-1} + T_i
        add({t_col(i): 1.0, z_col(i): -float(L)}, -np.inf, 0.0)  # T_i = 0 unless z_i = 1
        if c3 == "zero_allowed":
            # z_i = 1 only with T_i >= 1: redundant for the integer points, but with it the
            # relaxed C3 below describes the convex hull of "T_i = 0" and "T_i >= 1 with
            # C3" (for fixed A_{i-1}), which tightens the LP relaxation.
            add({t_col(i): 1.0, z_col(i): -1.0}, 0.0, np.inf)
    for i in range(1, N):  # batches 2..N
        add({a_col(i): 1.0, a_col(i - 1): 1.0}, -np.inf, float(i * L))  # C2: A_i <= i*L - A_{i-1}
        remaining = N - i  # N - (i + 1) + 1 batches from this one on
        # C3, relaxed by M_i = remaining when z_i = 0:
        #   Time_l*T_i - A_{i-1} - remaining*T_i + remaining*z_i <= 0
        add({t_col(i): tl - remaining, a_col(i - 1): -1.0, z_col(i): float(remaining)}, -np.inf, 0.0)

    # Objective: sum_i (N - i + 1) * S_i = const - sum_i (N - i + 1) * T_i, weights N - i 0-based.
    c = np.zeros(nvar)
    for i in range(N):
        c[t_col(i)] = -float(N - i)
    lb = np.zeros(nvar)
    ub = np.full(nvar, float(L))
    ub[t_col(0)] = float(k0_layers)
    for i in range(N):
        # C2 of batch i + 2 with A_{i+1} >= A_i gives 2 * A_i <= (i + 1) * L: implied, but
        # stated as a bound it trims the LP relaxation (see the timing note above).
        ub[a_col(i)] = float((i + 1) * L // 2 if i < N - 1 else N * L)
        ub[z_col(i)] = 1.0
        if c3 == "as_printed":
            lb[z_col(i)] = 1.0
    options: dict[str, object] = {"disp": False, "mip_rel_gap": 0.0}
    if time_limit_s is not None:
        options["time_limit"] = float(time_limit_s)
    res = milp(
        c,
        integrality=np.ones(nvar),
        bounds=Bounds(lb, ub),
        constraints=LinearConstraint(
            coo_matrix((coefs, (row_ids, col_ids)), shape=(len(lo), nvar)).tocsr(), np.array(lo), np.array(hi)
        ),
        options=options,
    )
    if res.status == 2:
        raise ZigzagIlpInfeasibleError(
            f"zigzag ILP infeasible for L={L!r} N={N!r} Time_l={load_time_layers!r} k0={k0_layers!r} c3={c3!r}"
        )
    if res.x is None or res.status not in (0, 1):
        # Not reachable for "zero_allowed" short of a solver failure: T = 0 is feasible.
        raise RuntimeError(
            f"zigzag ILP: HiGHS returned no plan for L={L!r} N={N!r} Time_l={load_time_layers!r} "
            f"k0={k0_layers!r} c3={c3!r}: status {res.status!r}, {res.message!r}"
        )
    new = tuple(round(res.x[t_col(i)]) for i in range(N))
    old = tuple(L - t for t in new)
    bad = _violations(new, L, tl, k0_layers, c3)
    if bad:
        raise RuntimeError(f"zigzag ILP: HiGHS plan T={new!r} breaks {bad!r} (L={L!r} N={N!r} Time_l={tl!r})")
    return ZigzagIlpPlan(
        num_layers=L,
        num_batches=N,
        load_time_layers=tl,
        k0_layers=k0_layers,
        c3=c3,
        new_layers=new,
        old_layers=old,
        objective_layers=ilp_objective_layers(old),
        status="optimal" if res.status == 0 else "time_limit",
    )


def _violations(new_layers: tuple[int, ...], L: int, tl: float, k0: int, c3: C3Form) -> list[str]:
    """The constraints a rounded plan breaks, named (`C2[i=3]`); empty when it is feasible."""
    N = len(new_layers)
    out = [f"bounds[i={i + 1}]" for i, t in enumerate(new_layers) if not 0 <= t <= L]
    if new_layers[0] > k0:
        out.append("T_1<=k0")
    for i in range(1, N):
        done_new = sum(new_layers[:i])
        if done_new + new_layers[i] > sum(L - t for t in new_layers[:i]):
            out.append(f"C2[i={i + 1}]")
        if (new_layers[i] > 0 or c3 == "as_printed") and tl * new_layers[i] > done_new + (N - i) * (
            new_layers[i] - 1
        ) + _FEAS_TOL:
            out.append(f"C3[i={i + 1}]")
    return out


# ------------------------------------------------------------------------------------------
# In-flight cap
# ------------------------------------------------------------------------------------------


def zigzag_req_limit(
    now_s: float, live_scaling_started_s: float, *, start: int = 4, step_s: float = 0.2, floor: int = 2
) -> int:
    """The most zigzag requests a new instance may have in flight: `start`, minus 1 per whole
    `step_s` since its live scaling started, never below `floor` (BlitzScale: 4, 200 ms, 2).

    Early on the new instance holds few layers, so each request costs it little and many can
    overlap; as it loads, each request runs more layers on it and the cap shrinks so that a
    queue does not build up on the instance that is still busy receiving weights. Clocks are
    the caller's: a `now_s` before the start (a skew between two readings) counts as the start.
    The step count gets 1e-9 of slack so 0.6 s over 0.2 s steps counts 3 steps, not 2.99...
    """
    for name, value in (("now_s", now_s), ("live_scaling_started_s", live_scaling_started_s)):
        if not math.isfinite(value):
            raise ValueError(f"{name} must be finite, got {value!r}")
    if not (math.isfinite(step_s) and step_s > 0):
        raise ValueError(f"step_s must be finite and > 0, got {step_s!r}")
    if floor < 0 or start < floor:
        raise ValueError(f"need 0 <= floor <= start, got floor={floor!r} start={start!r}")
    elapsed_s = max(0.0, now_s - live_scaling_started_s)
    steps = math.floor(elapsed_s / step_s + 1e-9)
    return max(floor, start - steps)


# ------------------------------------------------------------------------------------------
# Pairing and routing
# ------------------------------------------------------------------------------------------


def _runs_first_layers(view: InstanceView) -> bool:
    """Whether a LOADING instance holds decoder layers to run ahead: at least the first, up
    to all L of them. With all L and the load still going, what is left is the embedding and
    the head (a load streams the decoder layers first): the instance runs every decoder layer
    of a prompt (its partner looks up the prompt's embedding rows for it), and the partner
    only applies the head and decodes. Measured on `bench.live_scaling`: the embedding and the
    head are a fifth of the small model's bytes, about 2.5 s of a 14 s load."""
    return 1 <= view.layers_loaded <= view.num_layers


def _overloaded(
    view: InstanceView, max_running_by_instance: Mapping[str, int] | None, ttft_s: float | None = None
) -> bool:
    """A backlog (requests waiting, or prompt tokens not yet computed: queued or in an unfinished
    chunked prefill), a running batch at its reported capacity, or (with `ttft_s`) a median
    time to first token over its window of at least `ttft_s`. The backlog opens the gate the
    moment the work is there, before TTFT has risen. No report yet means not overloaded:
    `router.instance_load` counts such an instance as idle too."""
    load = view.load
    if load is None:
        return False
    if load.waiting > 0 or load.waiting_prefill_tokens > 0:
        return True
    if ttft_s is not None and load.ttft_p50_s is not None and load.ttft_p50_s >= ttft_s:
        return True
    cap = None if max_running_by_instance is None else max_running_by_instance.get(view.instance_id)
    return cap is not None and load.running >= cap


@dataclass(frozen=True, slots=True)
class PartnerChoice:
    """The full instance that finishes the layers a new instance has not loaded, and why."""

    partner: InstanceView
    reason: str
    overloaded: bool = False  # whether the partner was picked among overloaded instances


def choose_zigzag_partner(
    views: Iterable[InstanceView],
    new_instance_id: str,
    model: str,
    *,
    exclude_ids: Collection[str] = (),
    max_running_by_instance: Mapping[str, int] | None = None,
) -> PartnerChoice | None:
    """The partner of `new_instance_id`: a SERVING instance of `model` with the new instance's
    role, overloaded ones first, and among them the one with the fewest used KV blocks.

    Overloaded first, because zigzag exists to take work off a full instance that cannot keep
    up; an idle partner would serve the request faster alone. Fewest used KV blocks, as
    BlitzScale's router pairs, because the partner holds the KV of layers [k, L) of every
    split request (and, colocated, receives the [0, k) half too), so it needs the most room.
    Ties go to fewer waiting requests, then the smaller id. With no overloaded candidate the
    same rule picks among all of them, and the reason says so. Instances without a load report
    rank after those with one (their KV use is unknown). `exclude_ids` keeps, e.g., a partner
    already paired with another new instance out. None when no SERVING candidate exists.
    Raises ValueError when `new_instance_id` is not among `views` or serves another model.
    """
    pool = list(views)
    new = next((v for v in pool if v.instance_id == new_instance_id), None)
    if new is None:
        raise ValueError(f"new instance {new_instance_id!r} is not among the {len(pool)} views given")
    if new.model != model:
        raise ValueError(f"new instance {new_instance_id!r} loads model {new.model!r}, not {model!r}")
    candidates = [
        v
        for v in pool
        if v.state is InstanceState.SERVING
        and v.model == model
        and v.role is new.role
        and v.instance_id != new_instance_id
        and v.instance_id not in exclude_ids
    ]
    if not candidates:
        return None
    overloaded = [v for v in candidates if _overloaded(v, max_running_by_instance)]
    group = overloaded or candidates

    def rank(v: InstanceView) -> tuple[int, int, int, str]:
        if v.load is None:
            return (1, 0, 0, v.instance_id)
        return (0, v.load.kv_blocks_used, v.load.waiting, v.instance_id)

    best = min(group, key=rank)
    used = "no load report yet" if best.load is None else str(best.load.kv_blocks_used)
    kind = "overloaded SERVING" if overloaded else "SERVING (none overloaded)"
    reason = f"fewest used KV blocks ({used}) among {len(group)} {kind} {new.role.value} instances of {model!r}"
    return PartnerChoice(partner=best, reason=reason, overloaded=bool(overloaded))


def choose_pull_partner(
    views: Iterable[InstanceView],
    new_instance_id: str,
    model: str,
    taken: Mapping[str, int] | Collection[str] = (),
) -> PartnerChoice | None:
    """The partner a live LOADING instance pulls work from (`--zigzag-dispatch pull`): as
    `choose_zigzag_partner`, among the overloaded instances the one the fewest other loading
    instances pull from (`taken`: partner -> how many pull from it; a plain collection counts
    one each), so that new instances spread evenly over the overloaded ones. Evenly, not just
    one each: past half its layers a loading instance is the slower half of its pair (it runs k
    of L layers, the partner L - k), so a partner needs two or more of them to go faster than
    twice its own speed, and piling every late one onto one partner leaves the others at 2x."""
    pool = list(views)
    counts: Mapping[str, int] = taken if isinstance(taken, Mapping) else dict.fromkeys(taken, 1)
    for level in sorted({0, *counts.values()}):
        busier = {p for p, n in counts.items() if n > level}
        if not busier:
            break
        spread = choose_zigzag_partner(pool, new_instance_id, model, exclude_ids=busier)
        if spread is not None and spread.overloaded:
            n = counts.get(spread.partner.instance_id, 0)
            who = f"{n} other loading instance{'' if n == 1 else 's'}"
            return replace(spread, reason=f"pulled by {who}, the fewest; {spread.reason}")
    return choose_zigzag_partner(pool, new_instance_id, model)


@dataclass(frozen=True, slots=True)
class LiveChoice:
    """The LOADING instance that takes the next zigzag request, with its cap at `now_s`."""

    instance: InstanceView
    inflight: int
    limit: int
    reason: str


def choose_live_instance(
    views: Iterable[InstanceView],
    model: str,
    inflight_by_instance: Mapping[str, int],
    now_s: float,
    started_s_by_instance: Mapping[str, float],
    *,
    limit_start: int = 4,
    limit_step_s: float = 0.2,
    limit_floor: int = 2,
) -> LiveChoice | None:
    """The LOADING instance of `model` that runs layers [0, k) of the next zigzag request.

    Eligible: LOADING, at least one decoder layer loaded (`_runs_first_layers`), live scaling started (an
    entry in `started_s_by_instance`), and fewer zigzag requests in flight
    (`inflight_by_instance`, missing = 0) than `zigzag_req_limit` allows at `now_s`.

    Which instances go live at all is decided when live scaling starts, not here: the caller
    puts an entry in `started_s_by_instance` only for the tail of each multicast chain. The
    tail has the lowest bandwidth and loads last, so it gains the most from serving early,
    while the chain's middle members are busy forwarding chunks; `InstanceView` carries no
    chain position, so this function could not tell the tail apart anyway. An instance that
    is LOADING but has no entry (a chain middle, or a load the scheduler has stopped trusting,
    such as a stalled one) gets no zigzag work.

    Among the eligible ones, the most layers loaded wins: it takes the largest share of the
    request off the overloaded partner (ZigZag's gain grows with k up to L/2, see
    `pair_throughput`) and its layers are the least likely to wait on weights still in flight.
    Ties go to fewer requests in flight, then the smaller id. None when none qualifies.
    """
    if not math.isfinite(now_s):
        raise ValueError(f"now_s must be finite, got {now_s!r}")
    bad = {k: v for k, v in inflight_by_instance.items() if v < 0}
    if bad:
        raise ValueError(f"inflight_by_instance counts must be >= 0, got {bad!r}")
    eligible: list[tuple[InstanceView, int, int]] = []
    for v in views:
        if v.state is not InstanceState.LOADING or v.model != model:
            continue
        if not _runs_first_layers(v) or v.instance_id not in started_s_by_instance:
            continue
        limit = zigzag_req_limit(
            now_s, started_s_by_instance[v.instance_id], start=limit_start, step_s=limit_step_s, floor=limit_floor
        )
        inflight = inflight_by_instance.get(v.instance_id, 0)
        if inflight < limit:
            eligible.append((v, inflight, limit))
    if not eligible:
        return None
    view, inflight, limit = min(eligible, key=lambda e: (-e[0].layers_loaded, e[1], e[0].instance_id))
    reason = (
        f"most layers loaded ({view.layers_loaded}/{view.num_layers}) among {len(eligible)} live LOADING "
        f"instances under their zigzag cap ({inflight} in flight, cap {limit})"
    )
    return LiveChoice(instance=view, inflight=inflight, limit=limit, reason=reason)


@dataclass(frozen=True, slots=True)
class ZigzagGate:
    """Whether the next request goes to a LOADING instance, and why."""

    zigzag: bool
    reason: str


def should_zigzag(
    serving_views: Iterable[InstanceView],
    *,
    model: str | None = None,
    role: Role | None = None,
    max_running_by_instance: Mapping[str, int] | None = None,
    ttft_s: float | None = None,
) -> ZigzagGate:
    """Zigzag only when every SERVING instance (of `model` and `role`, when given) is overloaded:
    it has a backlog (requests waiting or prompt tokens not yet computed), or runs as many as
    its batch capacity in `max_running_by_instance` (when that reports one).

    Equivalently: even the best instance the ordinary router could pick would queue the
    request. Then splitting it with a LOADING instance gains time; otherwise a full instance
    serves it sooner and without a hidden-state relay. Views of other states are ignored, so
    the caller may pass the whole registry. No SERVING instance at all means no zigzag: there
    is no partner to finish the layers the new instance lacks. An instance with no load report
    yet counts as not overloaded (as `router.instance_load` counts it as idle).
    """
    serving = [
        v
        for v in serving_views
        if v.state is InstanceState.SERVING and (model is None or v.model == model) and (role is None or v.role is role)
    ]
    if not serving:
        return ZigzagGate(False, "no SERVING instance to partner with")
    free = [v for v in serving if not _overloaded(v, max_running_by_instance, ttft_s)]
    if free:
        best = min(free, key=lambda v: v.instance_id)
        return ZigzagGate(
            False, f"{len(free)} of {len(serving)} SERVING instances not overloaded (e.g. {best.instance_id!r})"
        )
    slow = "" if ttft_s is None else f", or TTFT p50 >= {ttft_s}s"
    return ZigzagGate(
        True,
        f"all {len(serving)} SERVING instances overloaded (a backlog of requests or prompt tokens, or at batch capacity{slow})",
    )


# ------------------------------------------------------------------------------------------
# Throughput model
# ------------------------------------------------------------------------------------------


def pair_throughput(num_layers: int, k_layers: int) -> float:
    """Requests per layer-time served by an old full instance plus a new one holding k layers.

    Fluid model, one layer of one request = one layer-time on either instance. Split requests
    arrive at rate x: the new instance runs k layers of each, the old one the other L - k. The
    old instance spends what time is left on whole requests of its own, at rate y:
        k * x <= 1,  (L - k) * x + L * y <= 1,  maximise x + y.
    x + y = 1/L + x * k / L grows with x, so x = 1 / max(k, L - k), which gives
        1 / (L - k)  for k <= L/2  (the old instance is the bottleneck, doing L - k per request)
        2 / L        for k >= L/2  (the new one is; the pair matches two full instances).
    Vectors (docs/algorithms.md 3): L = 7 serves 1/7 at k = 0, 1/6 at k = 1, and 2/7, twice the
    old rate, once half the layers are in.
    """
    for name, value in (("num_layers", num_layers), ("k_layers", k_layers)):
        if isinstance(value, bool) or not isinstance(value, int):
            raise ValueError(f"{name} must be an int, got {value!r}")
    if num_layers < 1:
        raise ValueError(f"num_layers must be >= 1, got {num_layers!r}")
    if not 0 <= k_layers <= num_layers:
        raise ValueError(f"k_layers must be in [0, num_layers={num_layers!r}], got {k_layers!r}")
    if 2 * k_layers >= num_layers:
        return 2.0 / num_layers
    return 1.0 / (num_layers - k_layers)


# ------------------------------------------------------------------------------------------
# Tracking: which LOADING instances are live, their partners, and the routing decision
# ------------------------------------------------------------------------------------------

#: Which LOADING instances serve ZigZag work: every scale-out target from its first layer, or
#: only the tail of each transfer chain (as BlitzScale picks).
ZigzagLive = Literal["all", "tails"]
#: How ZigZag work reaches a live instance: the manager routes new requests to the pair
#: (`ZigzagTracker.route`), or the live instance runs ahead requests queued on its partner
#: (`ZigzagTracker.pull_pairs`, BlitzScale's NewPrefill).
ZigzagDispatch = Literal["route", "pull"]


@dataclass(frozen=True, slots=True)
class ZigzagSettings:
    """The one set of ZigZag knobs: the manager's config and the simulator both take their
    defaults from here.

    `live`: which LOADING instances go live (`ZigzagLive`). `ttft_s`: the gate also opens when
    every SERVING instance's TTFT p50 is at least this (None: only a backlog opens it).
    `stall_s`: a live instance whose layer count has not grown for this long gets no more
    ZigZag work. `dispatch`: `ZigzagDispatch`. Pulling is the default: on `bench.live_scaling`
    it beat routing in 11 of 12 paired repeats (median p99 TTFT 0.72 of routing's), since a
    routed request holds one of the loading instance's few in-flight slots for its whole wait
    in the partner's queue. `limit_*`: the in-flight cap of `zigzag_req_limit` (routed requests).
    `pull_limit`: the in-flight cap of an instance that pulls (0: `zigzag_req_limit`'s). The
    shrinking cap is for routed requests, which queue on the loading instance; a pulled one runs
    ahead only the head of its partner's queue, and the partner admits a step's worth of prompts
    at once (2,048 tokens of 128-384-token prompts on `bench.live_scaling`: 5 to 16), so a cap
    of 2 leaves most of what the partner admits without run-ahead. `hand_back`: when a live
    instance finishes loading, its partner's running requests above an even share move to it
    with their KV (`plan_hand_back`), those with at least `hand_back_min_tokens_left` tokens left
    to generate. A move costs a release between steps, a new route through the gateway and a KV
    pull, and the moved request takes a batch slot on the instance that should be draining the
    partner's backlog: measured on `bench.live_scaling` (outputs of 4-16 tokens), handing back
    every running request gave 0.97 of stop-the-world's p99 TTFT where ZigZag alone gave 0.70.
    `hand_back_wait_s`: a hand-back waits while its partner's link carries parameters to a load
    (a chain's source or middle hop), at most this long (0: never). The moved requests' KV leaves
    by that link: on `live8b` seed 2 it slowed the loads of a 47-instance scale-out from 2.8 s
    to 3.9 s and ZigZag's tail fell behind stop-the-world's; a partner that keeps decoding a few
    more requests for a while costs less than every load behind its link.

    Why every target by default: on a chain the tail gets its first layer only after the hops
    before it have forwarded it; measured on bench.autoscale (3 targets, 0.2 Gbit/s links) the
    tail had its first layer 4 s after the decision, when the chain's head was already
    SERVING, so tails alone left no window to serve in.
    """

    live: ZigzagLive = "all"
    ttft_s: float | None = 1.0
    stall_s: float = 5.0
    limit_start: int = 4
    limit_step_s: float = 0.2
    limit_floor: int = 2
    hand_back: bool = True
    hand_back_min_tokens_left: int = 16
    hand_back_wait_s: float = 5.0
    dispatch: ZigzagDispatch = "pull"
    pull_limit: int = 8

    def __post_init__(self) -> None:
        if self.live not in ("all", "tails"):
            raise ValueError(f"ZigzagSettings.live must be 'all' or 'tails', got {self.live!r}")
        if self.dispatch not in ("route", "pull"):
            raise ValueError(f"ZigzagSettings.dispatch must be 'route' or 'pull', got {self.dispatch!r}")
        if self.ttft_s is not None and not (math.isfinite(self.ttft_s) and self.ttft_s > 0):
            raise ValueError(f"ZigzagSettings.ttft_s must be None or finite and > 0, got {self.ttft_s!r}")
        if not (math.isfinite(self.stall_s) and self.stall_s > 0):
            raise ValueError(f"ZigzagSettings.stall_s must be finite and > 0, got {self.stall_s!r}")
        if not (math.isfinite(self.hand_back_wait_s) and self.hand_back_wait_s >= 0):
            raise ValueError(f"ZigzagSettings.hand_back_wait_s must be finite and >= 0, got {self.hand_back_wait_s!r}")
        if self.hand_back_min_tokens_left < 0:
            raise ValueError(
                f"ZigzagSettings.hand_back_min_tokens_left must be >= 0, got {self.hand_back_min_tokens_left!r}"
            )
        if not (math.isfinite(self.limit_step_s) and self.limit_step_s > 0):
            raise ValueError(f"ZigzagSettings.limit_step_s must be finite and > 0, got {self.limit_step_s!r}")
        if self.pull_limit < 0:
            raise ValueError(f"ZigzagSettings.pull_limit must be >= 0, got {self.pull_limit!r}")
        if self.limit_floor < 0 or self.limit_start < self.limit_floor:
            raise ValueError(
                f"ZigzagSettings needs 0 <= limit_floor <= limit_start, got {self.limit_floor!r}, {self.limit_start!r}"
            )


@dataclass(frozen=True, slots=True)
class WentLive:
    """Effect: `instance_id` (loading `model`, `layers` of `num_layers` in) serves ZigZag work."""

    instance_id: str
    model: str
    layers: int
    num_layers: int
    chain_tail: bool


@dataclass(frozen=True, slots=True)
class LiveLayers:
    """Effect: a live instance holds `layers` now (a gauge to set)."""

    instance_id: str
    layers: int


@dataclass(frozen=True, slots=True)
class StoppedLive:
    """Effect: `instance_id` no longer serves ZigZag work. `stalled`: its load stopped growing
    (reported as an event); otherwise its load ended (SERVING or failed)."""

    instance_id: str
    model: str
    stalled: bool
    reason: str


@dataclass(frozen=True, slots=True)
class Paired:
    """Effect: live instance `instance_id` is paired with SERVING `partner_id` now."""

    instance_id: str
    partner_id: str
    model: str
    reason: str


@dataclass(frozen=True, slots=True)
class HandBack:
    """Effect: live instance `instance_id` finished loading and is SERVING; `partner_id` finished
    the requests it split, and holds their decode: hand work back (`plan_hand_back`)."""

    instance_id: str
    partner_id: str
    model: str
    min_tokens_left: int = 0  # only running requests with this many tokens left to generate move
    waited_s: float = 0.0  # how long it waited for the partner's link to stop carrying parameters
    queued: bool = True  # the partner's queued requests it ran ahead go to it (`plan_take_back`)
    running: bool = True  # the partner's running requests go with their KV (`plan_hand_back`)


ZigzagEffect = WentLive | LiveLayers | StoppedLive | Paired | HandBack


@dataclass(frozen=True, slots=True)
class ZigzagSplit:
    """A request split: layers [0, k) on the live `new` instance, [k, L) on `partner`."""

    new: InstanceView
    partner: InstanceView
    k: int
    num_layers: int


@dataclass(frozen=True, slots=True)
class PullPeer:
    """A live instance that pulls queued requests from a SERVING one, with its cap now."""

    instance: InstanceView
    inflight_limit: int


@dataclass(frozen=True, slots=True)
class ZigzagStep:
    """What one call decided: the split, peers or pairs (when asked for) and the effects to carry out."""

    effects: tuple[ZigzagEffect, ...] = ()
    split: ZigzagSplit | None = None
    peers: tuple[PullPeer, ...] = ()
    gate: ZigzagGate | None = None
    pairs: tuple[tuple[str, str], ...] = ()  # (live instance, partner) of `pull_pairs`


class ZigzagTracker:
    """ZigZag's state: pure, `(now_s, inputs) -> ZigzagStep`, no I/O and no clock reads.

    It holds the chain tails, when each live instance went live, when its layer count last
    grew, and the partner it was last paired with. The manager's servicer feeds it load
    progress and routing questions and carries out its effects (events, metrics); the
    simulator drives the same object, so both run one implementation with one set of defaults.
    """

    def __init__(self, settings: ZigzagSettings | None = None) -> None:
        self.settings = settings if settings is not None else ZigzagSettings()
        self.tails: set[str] = set()
        self.started: dict[str, float] = {}  # live instance -> when it went live
        self.progress: dict[str, tuple[str, int, float]] = {}  # loading -> (model, layers, when they grew)
        self.partner: dict[str, str] = {}  # live instance -> the SERVING instance it is paired with
        # Live instance -> the partner it last split requests with (kept through a stall): the
        # instance its load hands work back from.
        self.split_with: dict[str, str] = {}
        # New instance -> (when it loaded, its hand-back) while the partner's link sends parameters.
        self.waiting_hand_backs: dict[str, tuple[float, HandBack]] = {}

    # ---- load lifecycle ------------------------------------------------------------------
    def chain_tails(self, instance_ids: Iterable[str]) -> None:
        self.tails |= set(instance_ids)

    def load_progress(self, now_s: float, instance_id: str, model: str, layers: int, num_layers: int) -> ZigzagStep:
        """A load reported `layers` of `num_layers`: a live candidate goes live with its first
        layer; its progress clock restarts whenever the count grows."""
        before = self.progress.get(instance_id)
        if before is None or layers > before[1]:
            self.progress[instance_id] = (model, layers, now_s)
        effects: list[ZigzagEffect] = []
        tail = instance_id in self.tails
        goes_live = self.settings.live == "all" or tail
        if goes_live and instance_id not in self.started and 1 <= layers <= num_layers:
            self.started[instance_id] = now_s
            effects.append(WentLive(instance_id, model, layers, num_layers, tail))
        if instance_id in self.started:
            effects.append(LiveLayers(instance_id, layers))
        return ZigzagStep(effects=tuple(effects))

    def load_done(
        self, instance_id: str, *, loaded: bool = False, now_s: float = 0.0, sending: Collection[str] = ()
    ) -> ZigzagStep:
        """The load ended (`loaded`: SERVING; else failed): the instance is no longer
        live-loading. Loaded, having split requests with a partner, it takes work back
        (`HandBack`, with `hand_back` on), at once unless the partner is in `sending` (the nodes
        whose links carry parameters now, with this load's already taken out): then it waits
        (`hand_backs_due`). Hand-backs that were waiting and are due now come out too."""
        self.tails.discard(instance_id)
        progress = self.progress.pop(instance_id, None)
        self.partner.pop(instance_id, None)
        partner = self.split_with.pop(instance_id, None)
        model = progress[0] if progress is not None else ""
        effects: list[ZigzagEffect] = []
        if self.started.pop(instance_id, None) is not None:
            effects.append(StoppedLive(instance_id, model, stalled=False, reason="load ended"))
        self.waiting_hand_backs.pop(instance_id, None)  # a reload of one whose hand-back still waited
        if loaded and partner is not None and self.settings.hand_back:
            hand_back = HandBack(instance_id, partner, model, self.settings.hand_back_min_tokens_left)
            if partner in sending and self.settings.hand_back_wait_s > 0:
                # The queued requests it ran ahead carry no KV: they go now, the running ones wait.
                effects.append(replace(hand_back, running=False))
                self.waiting_hand_backs[instance_id] = (now_s, replace(hand_back, queued=False))
            else:
                effects.append(hand_back)
        effects.extend(self.hand_backs_due(now_s, sending).effects)
        return ZigzagStep(effects=tuple(effects))

    def hand_backs_due(self, now_s: float, sending: Collection[str]) -> ZigzagStep:
        """The waiting hand-backs (their running requests: the queued ones went at once) whose
        partner is not in `sending` (the nodes whose links carry parameters now) or that have
        waited `hand_back_wait_s`, each with the time it waited.
        The caller asks again whenever a load ends (a link may be free then) and on its ticks."""
        effects: list[ZigzagEffect] = []
        for iid, (since_s, hand_back) in list(self.waiting_hand_backs.items()):
            waited_s = max(0.0, now_s - since_s)
            if hand_back.partner_id in sending and waited_s < self.settings.hand_back_wait_s:
                continue
            del self.waiting_hand_backs[iid]
            effects.append(replace(hand_back, waited_s=waited_s))
        return ZigzagStep(effects=tuple(effects))

    def note_split(self, instance_id: str, partner_id: str) -> None:
        """`instance_id` ran the first layers of requests `partner_id` finished."""
        self.split_with[instance_id] = partner_id

    def expire_stalled(self, now_s: float) -> ZigzagStep:
        """Live instances whose layer count has not grown for `stall_s` get no more ZigZag work
        (what they hold is relayed as usual); they go live again when a layer lands."""
        effects: list[ZigzagEffect] = []
        for iid, (model, _, grew_s) in list(self.progress.items()):
            if iid in self.started and now_s - grew_s > self.settings.stall_s:
                del self.started[iid]
                self.partner.pop(iid, None)
                reason = f"no new layer for {now_s - grew_s:.1f}s > zigzag_stall_s={self.settings.stall_s}"
                effects.append(StoppedLive(iid, model, stalled=True, reason=reason))
        return ZigzagStep(effects=tuple(effects))

    def limit(self, now_s: float, instance_id: str) -> int:
        s = self.settings
        return zigzag_req_limit(
            now_s, self.started[instance_id], start=s.limit_start, step_s=s.limit_step_s, floor=s.limit_floor
        )

    def gate(
        self,
        views: Iterable[InstanceView],
        model: str,
        role: Role | None = None,
        max_running_by_instance: Mapping[str, int] | None = None,
    ) -> ZigzagGate:
        return should_zigzag(
            views,
            model=model,
            role=role,
            max_running_by_instance=max_running_by_instance,
            ttft_s=self.settings.ttft_s,
        )

    # ---- dispatch: route ------------------------------------------------------------------
    def route(
        self,
        now_s: float,
        views: list[InstanceView],
        model: str,
        pool: Role,
        excluded: Collection[str],
        reachable: Collection[str],
    ) -> ZigzagStep:
        """The split of the next request of `model` (`--zigzag-dispatch route`): while the gate
        says every SERVING instance of `pool` is overloaded, the live LOADING instance with the
        most layers under its in-flight cap (`choose_live_instance`; in flight = its reported
        ZigZag requests plus those routed since) runs layers [0, k), and the overloaded instance
        with the fewest used KV blocks (`choose_zigzag_partner`) finishes them. `reachable`:
        the instances whose data plane is known (a new one needs it to relay). No split: route
        as usual."""
        expired = self.expire_stalled(now_s).effects
        live = {iid: t for iid, t in self.started.items() if iid not in excluded}
        if not live:
            return ZigzagStep(effects=expired)
        gate = self.gate(views, model, pool)
        if not gate.zigzag:
            return ZigzagStep(effects=expired, gate=gate)
        views = [v for v in views if v.role is pool]
        inflight = {
            v.instance_id: (v.load.zigzag_running if v.load is not None else 0) + v.routes_since_heartbeat
            for v in views
            if v.instance_id in live
        }
        s = self.settings
        choice = choose_live_instance(
            views,
            model,
            inflight,
            now_s,
            live,
            limit_start=s.limit_start,
            limit_step_s=s.limit_step_s,
            limit_floor=s.limit_floor,
        )
        if choice is None:
            return ZigzagStep(effects=expired, gate=gate)
        new = choice.instance
        pair = choose_zigzag_partner(views, new.instance_id, model, exclude_ids=excluded)
        if pair is None:
            return ZigzagStep(effects=expired, gate=gate)
        old = pair.partner
        k, num_layers = new.layers_loaded, old.num_layers
        if not 0 < k <= num_layers or new.instance_id not in reachable:
            return ZigzagStep(effects=expired, gate=gate)
        effects = list(expired)
        self.split_with[new.instance_id] = old.instance_id
        if self.partner.get(new.instance_id) != old.instance_id:
            self.partner[new.instance_id] = old.instance_id
            reason = f"{gate.reason}; new: {choice.reason}; partner {old.instance_id}: {pair.reason}"
            effects.append(Paired(new.instance_id, old.instance_id, model, reason))
        return ZigzagStep(effects=tuple(effects), split=ZigzagSplit(new, old, k, num_layers), gate=gate)

    # ---- dispatch: pull -------------------------------------------------------------------
    def pull_pairs(
        self, now_s: float, views: list[InstanceView], model: str, role: Role, reachable: Collection[str]
    ) -> ZigzagStep:
        """`--zigzag-dispatch pull`: the partner each live LOADING instance of `model` and `role`
        pulls queued requests from (`ZigzagStep.pairs`, (live instance, partner)).

        Every live LOADING instance (>= 1 decoder layer, in `reachable`: its data plane and
        address known) keeps one partner: the overloaded instance of its model and role that the
        fewest other ones pull from, then the one with the fewest used KV blocks
        (`choose_pull_partner`). It moves when that partner stops SERVING, or when the
        partner has no backlog left and another instance has one. No request is
        routed to the pair: the partner's own queue is the work (it only hands over requests it
        has waiting), so an instance with nothing queued costs nothing to pair, and no gate over
        the whole pool is asked: one backlogged partner is reason enough."""
        if not self.started:
            return ZigzagStep()
        effects = list(self.expire_stalled(now_s).effects)
        by_id = {v.instance_id: v for v in views}
        pairs: list[tuple[str, str]] = []
        pullers = Counter(self.partner.values())  # partner -> live instances pulling from it, kept current
        for new_id in sorted(self.started):
            new = by_id.get(new_id)
            if new is None or new.model != model or new.role is not role:
                continue
            if not _runs_first_layers(new) or new_id not in reachable:
                continue
            partner_id = self.partner.get(new_id)
            partner = by_id.get(partner_id) if partner_id is not None else None
            if partner is None or partner.state is not InstanceState.SERVING or not _overloaded(partner, None):
                if partner_id is not None:
                    pullers[partner_id] -= 1  # the others pulling from it, not this one
                pair = choose_pull_partner(views, new_id, model, pullers)
                moves = pair is not None and pair.partner.instance_id != partner_id
                if moves and (partner is None or partner.state is not InstanceState.SERVING or pair.overloaded):
                    partner_id = self.partner[new_id] = pair.partner.instance_id
                    reason = f"pulls queued requests from {partner_id}: {pair.reason}"
                    effects.append(Paired(new_id, partner_id, model, reason))
                if partner_id is not None:
                    pullers[partner_id] += 1
                if pair is None:
                    continue
            pairs.append((new_id, partner_id))
        return ZigzagStep(effects=tuple(effects), pairs=tuple(pairs))

    def pull_peers(
        self, now_s: float, views: list[InstanceView], me: InstanceView, reachable: Collection[str]
    ) -> ZigzagStep:
        """The live LOADING instances that pull queued requests from SERVING instance `me`
        (`pull_pairs`), each with its in-flight cap now (`ZigzagSettings.pull_limit`)."""
        if me.state is not InstanceState.SERVING or not me.model or not self.started:
            return ZigzagStep()
        step = self.pull_pairs(now_s, views, me.model, me.role, reachable)
        by_id = {v.instance_id: v for v in views}
        peers: list[PullPeer] = []
        for new_id, partner_id in step.pairs:
            if partner_id == me.instance_id:
                self.split_with[new_id] = partner_id
                cap = self.settings.pull_limit or self.limit(now_s, new_id)
                peers.append(PullPeer(by_id[new_id], cap))
        return ZigzagStep(effects=step.effects, peers=tuple(peers))

    # ---- the fluid model's pairing (bench.simulate) ---------------------------------------
    def live_views(self, views: Iterable[InstanceView], model: str) -> list[InstanceView]:
        """The live LOADING instances of `model` among `views` holding 1..L decoder layers, most
        layers first (then id)."""
        return sorted(
            (
                v
                for v in views
                if v.instance_id in self.started
                and v.model == model
                and v.state is InstanceState.LOADING
                and _runs_first_layers(v)
            ),
            key=lambda v: (-v.layers_loaded, v.instance_id),
        )

    @staticmethod
    def pair_all(
        live: list[InstanceView],
        views: list[InstanceView],
        model: str,
        max_running_by_instance: Mapping[str, int] | None = None,
    ) -> list[tuple[str, str]]:
        """(partner, live instance) for every instance of `live` in order, by
        `choose_zigzag_partner`, sharing partners once each SERVING instance has one (those
        with the fewest live instances first): the steady state of routing every request of a
        burst, as a fluid model serves it."""
        pairs: list[tuple[str, str]] = []
        paired: dict[str, int] = {}
        for v in live:
            choice = choose_zigzag_partner(
                views, v.instance_id, model, exclude_ids=set(paired), max_running_by_instance=max_running_by_instance
            )
            if choice is None and paired:
                least = min(paired.values())
                busier = {p for p, n in paired.items() if n > least}
                choice = choose_zigzag_partner(
                    views, v.instance_id, model, exclude_ids=busier, max_running_by_instance=max_running_by_instance
                )
            if choice is None:
                break
            partner = choice.partner.instance_id
            paired[partner] = paired.get(partner, 0) + 1
            pairs.append((partner, v.instance_id))
        return pairs


# ------------------------------------------------------------------------------------------
# Hand-back
# ------------------------------------------------------------------------------------------


def _serving_pair(views: Iterable[InstanceView], hand_back: HandBack) -> tuple[InstanceView, InstanceView] | None:
    """(partner, new instance) of `hand_back` from `views`, or None when either is gone or not
    SERVING: what hand-back and take-back both need before they ask the partner for anything."""
    by_id = {v.instance_id: v for v in views}
    partner, new = by_id.get(hand_back.partner_id), by_id.get(hand_back.instance_id)
    if partner is None or new is None:
        return None
    if partner.state is not InstanceState.SERVING or new.state is not InstanceState.SERVING:
        return None
    return partner, new


def plan_take_back(views: Iterable[InstanceView], hand_back: HandBack) -> MigrateRequests | None:
    """Pulled ZigZag: when a live instance finishes loading, the queued requests of its partner
    that it was running ahead leave the partner for it (`MigrateRequests.ran_ahead_by`; the
    gateway routes each again, to the least loaded, which the new, empty instance is). They are
    the oldest of the partner's queue (a peer pulls from its head), and there they would wait
    for the partner to admit them and then decode in its full steps; the new instance holds
    every layer now and has an empty batch. None when either is gone or not SERVING."""
    if _serving_pair(views, hand_back) is None:
        return None
    why = f"{hand_back.instance_id} finished loading"
    return MigrateRequests(
        hand_back.partner_id, hand_back.model, 0, running=False, why=why, ran_ahead_by=hand_back.instance_id
    )


def plan_hand_back(views: Iterable[InstanceView], hand_back: HandBack) -> MigrateRequests | None:
    """When a live instance finishes loading, its partner's running requests above an even share
    of the two move to it by live migration, with their KV (the gateway resumes each from its
    tokens so far; the new instance pulls the KV and decodes on). The partner's most recently
    started requests leave first (the worker's `release_running` order): the ZigZag requests it
    took over during the load are among the newest. None when the partner is gone, not SERVING,
    or runs no more than its share; queued requests are the rebalance's (`plan_rebalance`)."""
    pair = _serving_pair(views, hand_back)
    if pair is None:
        return None
    partner, new = pair
    if partner.load is None:
        return None
    # Its last report is from while it loaded: the ZigZag first layers it ran then are not its
    # own requests (they leave with their relay), so only the rest counts.
    mine = max(0, new.load.running - new.load.zigzag_running) if new.load is not None else 0
    n = partner.load.running - math.ceil((partner.load.running + mine) / 2)
    if n <= 0:
        return None
    why = f"hand-back to {hand_back.instance_id}: it loaded while {hand_back.partner_id} finished its split requests"
    return MigrateRequests(
        hand_back.partner_id, hand_back.model, n, running=True, why=why, min_tokens_left=hand_back.min_tokens_left
    )
