"""Placement choices for the actuator: which IDLE workers to load for a pool (`choose_idle`,
`assign_idle`), which SERVING instance to drain (`pick_scale_in_victim`), and which requests to
move when an instance joins (`plan_rebalance`) or runs over its targets (`plan_live_migration`).
"""

from __future__ import annotations

import math
from collections.abc import Collection, Iterable, Mapping

from .decisions import plan_top_up
from .routing import instance_load
from .types import InstanceState, InstanceView, Role

__all__ = [
    "assign_idle",
    "choose_idle",
    "pick_scale_in_victim",
    "plan_live_migration",
    "plan_rebalance",
    "scale_in_order",
]

S = InstanceState


def choose_idle(
    instances: Iterable[InstanceView],
    n: int,
    role: Role,
    exclude_ids: Collection[str] = (),
    warm: Collection[str] = (),
) -> list[InstanceView]:
    """Up to `n` IDLE workers to load for `role`: first those still holding the model's weights
    from a recent scale-in (`warm`: their load costs no transfer), then those registered with
    that role (a worker started with `--role decode` is meant to decode), then unassigned
    (COLOCATED) ones, then those of the other split role; by id within each group."""
    if n < 0:
        raise ValueError(f"n must be >= 0, got {n!r}")

    def rank(v: InstanceView) -> tuple[int, int, str]:
        return (
            0 if v.instance_id in warm else 1,
            0 if v.role is role else 1 if v.role is Role.COLOCATED else 2,
            v.instance_id,
        )

    idle = [v for v in instances if v.state is S.IDLE and v.instance_id not in exclude_ids]
    return sorted(idle, key=rank)[:n]


def assign_idle(
    floors: Mapping[Role, int], live: Mapping[Role, int], instances: Iterable[InstanceView]
) -> dict[Role, list[InstanceView]]:
    """IDLE workers (of `instances`) to load into each pool below its floor (`plan_top_up`).

    A worker registered with a pool's role goes to that pool first, whatever order the workers
    registered in: a worker started as `--role decode` must not become the prefill instance
    because it happened to register first. The others are then shared by `plan_top_up` (a P/D
    pair first) and picked with `choose_idle`.
    """
    have = {role: live.get(role, 0) for role in floors}
    out: dict[Role, list[InstanceView]] = {}
    rest: list[InstanceView] = []
    for view in sorted((v for v in instances if v.state is S.IDLE), key=lambda v: v.instance_id):
        if view.role in floors and have[view.role] < floors[view.role]:
            out.setdefault(view.role, []).append(view)
            have[view.role] += 1
        else:
            rest.append(view)
    for role, n in plan_top_up(floors, have, len(rest)).items():
        picked = choose_idle(rest, n, role)
        out.setdefault(role, []).extend(picked)
        taken = {v.instance_id for v in picked}
        rest = [v for v in rest if v.instance_id not in taken]
    return out


def pick_scale_in_victim(
    instances: Iterable[InstanceView], *, role: Role | None = None, model: str | None = None
) -> InstanceView | None:
    """The SERVING instance to drain: the least loaded (least work to finish or migrate), as
    the router would choose it (`instance_load`, then the smaller id)."""
    order = scale_in_order(instances, role=role, model=model)
    return order[0] if order else None


def scale_in_order(
    instances: Iterable[InstanceView], *, role: Role | None = None, model: str | None = None
) -> list[InstanceView]:
    """The SERVING instances of `model` (and `role`, when given) in the order a scale-in drains
    them: `pick_scale_in_victim`'s choice, then its choice with that one gone, and so on.
    Draining one changes no other's load, so n victims are the first n, sorted once."""
    serving = [
        v
        for v in instances
        if v.state is S.SERVING and (role is None or v.role is role) and (model is None or v.model == model)
    ]
    return sorted(serving, key=lambda v: (instance_load(v), v.instance_id))


def plan_live_migration(
    instances: Iterable[InstanceView],
    model: str,
    *,
    kv_high: float,
    tbt_slo_s: float | None = None,
    max_moves: int = 4,
) -> list[tuple[str, int, str]]:
    """Running requests to move with their KV (Llumnix-style live migration): (source, how many,
    why). A SERVING instance of `model` is over target when its KV use exceeds `kv_high` or its
    TBT p99 exceeds `tbt_slo_s`; it sheds running requests toward the pool's mean, at most
    `max_moves` at a time, only while an instance of its role under both targets can take them
    (the gateway re-routes each to the least loaded). Instances without a report are left alone."""
    if not 0 < kv_high <= 1:
        raise ValueError(f"kv_high must be in (0, 1], got {kv_high!r}")
    pool = [v for v in instances if v.state is S.SERVING and v.model == model and v.load is not None]
    moves: list[tuple[str, int, str]] = []
    for role in {v.role for v in pool}:
        peers = [v for v in pool if v.role is role]

        def over(v: InstanceView) -> str:
            load = v.load
            assert load is not None
            if load.kv_blocks_total and load.kv_utilization > kv_high:
                return f"KV {load.kv_utilization:.2f} > {kv_high}"
            if tbt_slo_s is not None and load.tbt_p99_s is not None and load.tbt_p99_s > tbt_slo_s:
                return f"TBT p99 {load.tbt_p99_s:.3f}s > {tbt_slo_s}s"
            return ""

        room = [v for v in peers if not over(v)]
        if not room:
            continue
        mean = sum(v.load.running for v in peers if v.load is not None) / len(peers)
        for v in sorted(peers, key=lambda v: v.instance_id):
            why = over(v)
            assert v.load is not None
            excess = math.floor(v.load.running - mean)
            if why and excess > 0:
                moves.append((v.instance_id, min(excess, max_moves), why))
    return sorted(moves)


def plan_rebalance(instances: Iterable[InstanceView], new_instance_id: str) -> list[tuple[str, int]]:
    """Queued requests to move when `new_instance_id` becomes SERVING: (instance id, how many).

    The queued requests of its pool (SERVING instances of its model and role, by their latest
    load reports, plus the requests routed to each since, which its report cannot show yet) are
    shared evenly over the pool with the new instance counted, starting empty; each instance
    gives up what it holds above its share, rounded up, so the new one gets at most an even
    share and nobody is left with more than one over it. Instances are listed most queued
    first; requests already running are never moved here (a routed request that is running by
    now is not queued: the worker releases only what still is).

    The routes matter in a burst: an instance that joined a moment earlier takes every new
    request as the least loaded, and its last report (up to a heartbeat old) shows none of them.
    """
    views = list(instances)
    new = next((v for v in views if v.instance_id == new_instance_id), None)
    if new is None:
        return []
    pool = [
        v
        for v in views
        if v.instance_id != new_instance_id and v.state is S.SERVING and v.model == new.model and v.role is new.role
    ]
    queued = {v.instance_id: (v.load.waiting if v.load is not None else 0) + v.routes_since_heartbeat for v in pool}
    total = sum(queued.values())
    if total == 0:
        return []
    share = math.ceil(total / (len(pool) + 1))
    moves = [(iid, n - share) for iid, n in queued.items() if n > share]
    return sorted(moves, key=lambda m: (-m[1], m[0]))
