"""Routing choices: least loaded (with the routes handed out since each instance's last heartbeat
counted as load), for a prefill/decode split a (prefill, decode) pair placed by load, KV room
and topology (`plan_route`), and borrowed prefill: while the whole prefill pool has a backlog, a
decode-light decode instance runs a new request whole (`choose_borrower`). Only SERVING instances
are ever picked.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Collection, Iterable, Mapping

from .types import InstanceState, InstanceView, Role

__all__ = [
    "NEAR_EQUAL_LOAD",
    "BorrowPrefill",
    "PrefixAffinity",
    "affinity_cost",
    "choose_borrower",
    "choose_instance",
    "choose_near",
    "choose_pair",
    "instance_load",
    "meets_tpot",
    "plan_route",
    "prompt_wait_s",
]

S = InstanceState


#: Loads closer than this (one request) count as equal when the decode side of a P/D pair is
#: chosen by topology: the KV fraction and a route not yet reported only break ties, while a
#: whole extra request in the queue outweighs a shorter path for the KV transfer.
NEAR_EQUAL_LOAD = 1.0


def instance_load(view: InstanceView, more_routes: int = 0) -> float:
    """running + waiting + routes since the last heartbeat + KV utilisation.

    The KV fraction (< 1) only separates instances with equal queues, preferring the one with
    more free cache. Routes handed out since the heartbeat are requests the report cannot show
    yet. No heartbeat yet counts as idle, plus what was routed to it since it registered.
    `more_routes`: the load once that many more are noted (the same arithmetic, so the same
    float, as the view `Registry.note_routed` would then hold).
    """
    load = view.load
    routed = view.routes_since_heartbeat + more_routes
    if load is None:
        return float(routed)
    return load.running + load.waiting + routed + load.kv_utilization


def _fits(view: InstanceView, blocks_needed: int) -> bool:
    load = view.load
    # An instance that has not reported its cache yet gets the benefit of the doubt.
    return load is None or load.kv_blocks_total == 0 or load.kv_blocks_total - load.kv_blocks_used >= blocks_needed


def _blocks_needed(request_tokens: int, kv_block_size_tokens: int | None) -> int:
    if request_tokens < 0:
        raise ValueError(f"request_tokens must be >= 0, got {request_tokens!r}")
    if kv_block_size_tokens is not None and kv_block_size_tokens <= 0:
        raise ValueError(f"kv_block_size_tokens must be > 0, got {kv_block_size_tokens!r}")
    return math.ceil(request_tokens / kv_block_size_tokens) if kv_block_size_tokens else 0


@dataclasses.dataclass(frozen=True, slots=True)
class PrefixAffinity:
    """Prefix-affinity routing (Dynamo's KV-aware router cost, see `affinity_cost`) for one
    request: how many of its prompt's first KV blocks each instance probably has cached."""

    matched_blocks: Mapping[str, int]  # instance id -> leading prompt blocks cached there (absent: 0)
    prompt_blocks: int  # blocks the whole prompt fills
    overlap_weight: float  # what one prompt block to compute costs against one block in use
    block_size: int  # tokens per KV block

    def __post_init__(self) -> None:
        if self.overlap_weight < 0 or self.prompt_blocks < 0 or self.block_size <= 0:
            raise ValueError(
                f"PrefixAffinity needs overlap_weight >= 0, prompt_blocks >= 0 and block_size > 0, got "
                f"{self.overlap_weight!r}, {self.prompt_blocks!r}, {self.block_size!r}"
            )


def affinity_cost(view: InstanceView, affinity: PrefixAffinity, request_tokens: int) -> float:
    """Dynamo's KV router cost, lower is better:

        overlap_weight * (prompt_blocks - matched_blocks) + active_blocks

    the prompt blocks the instance would compute (those not cached there), weighed against the
    KV blocks its decodes hold: active_blocks = kv_blocks_used + the blocks of its queued prompt
    tokens (waiting_prefill_tokens) + routes since its last heartbeat x this request's blocks
    (prompt + max_tokens; a route the report cannot show yet holds about as much). Each cached
    block thus saves `overlap_weight` blocks' worth of load: weight 1 trades one block of
    prefill for one block of decode."""
    cached = min(affinity.matched_blocks.get(view.instance_id, 0), affinity.prompt_blocks)
    prefill = affinity.prompt_blocks - cached
    bs = affinity.block_size
    active = view.routes_since_heartbeat * math.ceil(request_tokens / bs)
    if view.load is not None:
        active += view.load.kv_blocks_used + math.ceil(view.load.waiting_prefill_tokens / bs)
    return affinity.overlap_weight * prefill + active


def _eligible(view: InstanceView, exclude_ids: Collection[str], role: Role | None, model: str | None) -> bool:
    return (
        view.state is S.SERVING
        and view.instance_id not in exclude_ids
        and (role is None or view.role is role)
        and (model is None or view.model == model)
    )


def meets_tpot(view: InstanceView, tpot_slo_s: float | None) -> bool:
    """Whether the instance's TPOT estimate meets the objective; no objective, or no estimate
    yet (no report, or 0 on the wire), counts as meeting it."""
    if tpot_slo_s is None or view.load is None or not view.load.est_tpot_s:
        return True
    return view.load.est_tpot_s <= tpot_slo_s


def choose_instance(
    instances: Iterable[InstanceView],
    request_tokens: int = 0,
    exclude_ids: Collection[str] = (),
    *,
    role: Role | None = None,
    model: str | None = None,
    kv_block_size_tokens: int | None = None,
    tpot_slo_s: float | None = None,
    affinity: PrefixAffinity | None = None,
) -> InstanceView | None:
    """The least-loaded SERVING instance, or None if there is none.

    Filters: not in `exclude_ids` (e.g. instances that already failed this request), of `role`
    and `model` when given. Ties break on the smaller instance_id so the choice is
    deterministic. With `kv_block_size_tokens`, instances whose free KV blocks can hold the
    request's `request_tokens` are preferred; if none can, the least loaded still gets it and
    queues it, because refusing would only move the wait to the client. With `tpot_slo_s` (the
    request's TPOT objective), instances whose reported `est_tpot_s` meets it come first (see
    `meets_tpot`); if none does, the choice is as without it (the instance may refuse it).

    With `affinity` (and a weight > 0) and some candidate holding part of the prompt cached,
    "least loaded" is `affinity_cost` instead; with no overlap anywhere it stays `instance_load`.
    """
    if tpot_slo_s is not None and not (math.isfinite(tpot_slo_s) and tpot_slo_s > 0):
        raise ValueError(f"tpot_slo_s must be a positive number of seconds, got {tpot_slo_s!r}")
    blocks_needed = _blocks_needed(request_tokens, kv_block_size_tokens)
    candidates = [v for v in instances if _eligible(v, exclude_ids, role, model)]
    by_affinity = (
        affinity is not None
        and affinity.overlap_weight > 0
        and any(affinity.matched_blocks.get(v.instance_id, 0) > 0 for v in candidates)
    )
    best: InstanceView | None = None
    best_key: tuple[int, int, float, str] | None = None
    for view in candidates:
        load = affinity_cost(view, affinity, request_tokens) if by_affinity and affinity else instance_load(view)
        key = (
            0 if meets_tpot(view, tpot_slo_s) else 1,
            0 if not blocks_needed or _fits(view, blocks_needed) else 1,
            load,
            view.instance_id,
        )
        if best_key is None or key < best_key:
            best, best_key = view, key
    return best


def _distance(a: InstanceView, b: InstanceView, leaves: Mapping[str, str]) -> int:
    """0 on the same host, 1 under the same leaf switch, 2 across the spine. A host the
    topology does not name sits on the one shared default leaf (as the multicast planner reads
    it); an empty host is unknown and is never "the same host"."""
    if a.host and a.host == b.host:
        return 0
    return 1 if leaves.get(a.host, "") == leaves.get(b.host, "") else 2


def choose_near(
    instances: Iterable[InstanceView],
    near: InstanceView,
    request_tokens: int = 0,
    exclude_ids: Collection[str] = (),
    *,
    role: Role | None = None,
    model: str | None = None,
    kv_block_size_tokens: int | None = None,
    leaves: Mapping[str, str] | None = None,
    load_slack: float = NEAR_EQUAL_LOAD,
) -> InstanceView | None:
    """Like `choose_instance`, but among the candidates whose load is within `load_slack` of the
    least (after the KV-fit preference), the one closest to `near` wins: same host, then same
    leaf (`leaves` maps host -> leaf switch), then the lower load, then the id.

    Load first, topology second: a close but busy instance would cost more in queueing than the
    shorter path saves on the KV transfer.
    """
    if load_slack < 0:
        raise ValueError(f"load_slack must be >= 0, got {load_slack!r}")
    blocks_needed = _blocks_needed(request_tokens, kv_block_size_tokens)
    candidates = [v for v in instances if _eligible(v, exclude_ids, role, model)]
    if blocks_needed:
        candidates = [v for v in candidates if _fits(v, blocks_needed)] or candidates
    if not candidates:
        return None
    loads = {v.instance_id: instance_load(v) for v in candidates}
    least = min(loads.values())
    equal = [v for v in candidates if loads[v.instance_id] <= least or loads[v.instance_id] - least < load_slack]
    links = leaves or {}
    return min(equal, key=lambda v: (_distance(near, v, links), loads[v.instance_id], v.instance_id))


def choose_pair(
    instances: Iterable[InstanceView],
    request_tokens: int = 0,
    exclude_ids: Collection[str] = (),
    *,
    model: str | None = None,
    kv_block_size_tokens: int | None = None,
    prompt_tokens: int = 0,
    leaves: Mapping[str, str] | None = None,
    load_slack: float = NEAR_EQUAL_LOAD,
    affinity: PrefixAffinity | None = None,
) -> tuple[InstanceView, InstanceView] | None:
    """A (prefill, decode) pair for a split deployment; None unless both roles serve.

    Prefill: the least loaded, preferring one whose free KV blocks hold the prompt
    (`prompt_tokens`), which it keeps until the decode side has pulled it. Decode: by load with
    the KV preference for the whole request (`request_tokens`, prompt + max tokens: the decode
    side keeps the cache to the end), and among nearly equal loads the one closest to the chosen
    prefill instance (`choose_near`), so the KV transfer takes the shortest path. `affinity`
    weighs the prefill side only: the decode side pulls the prompt's KV, it computes none.
    """
    pool = list(instances)
    prefill = choose_instance(
        pool,
        prompt_tokens,
        exclude_ids,
        role=Role.PREFILL,
        model=model,
        kv_block_size_tokens=kv_block_size_tokens,
        affinity=affinity,
    )
    if prefill is None:
        return None
    decode = choose_near(
        pool,
        prefill,
        request_tokens,
        exclude_ids,
        role=Role.DECODE,
        model=model,
        kv_block_size_tokens=kv_block_size_tokens,
        leaves=leaves,
        load_slack=load_slack,
    )
    return None if decode is None else (prefill, decode)


@dataclasses.dataclass(frozen=True, slots=True)
class BorrowPrefill:
    """Borrowed prefill (TokenScale) in a split deployment: while every prefill instance has a
    backlog, a decode-light decode instance runs a new request whole (its prompt and its decode,
    no KV transfer) instead of queueing it behind the prefill pool. See `choose_borrower`.

    `wait_s`: the backlog, as the seconds every SERVING prefill instance's queued prompt tokens take
    at its measured prefill capacity (`prompt_wait_s`), above which a request may be borrowed.
    `max_decode_requests`: a decode instance lends while it holds fewer requests than this
    (running + waiting + routed since its heartbeat), so with the borrowed one at most this many.
    """

    wait_s: float = 0.5
    max_decode_requests: int = 4

    def __post_init__(self) -> None:
        if not (math.isfinite(self.wait_s) and self.wait_s >= 0):
            raise ValueError(f"BorrowPrefill.wait_s must be a finite number of seconds >= 0, got {self.wait_s!r}")
        if self.max_decode_requests < 1:
            raise ValueError(f"BorrowPrefill.max_decode_requests must be >= 1, got {self.max_decode_requests!r}")


def prompt_wait_s(view: InstanceView, mean_capacity_tps: float, tokens_per_route: int = 0) -> float:
    """Seconds the instance's queued prompt tokens take at its measured prefill capacity, the wait
    `policies.queue_wait_s` averages over a pool, taken from its latest report: its queued tokens
    (`waiting_prefill_tokens`) plus `tokens_per_route` for each route its report cannot show yet,
    over its `prefill_capacity_tps`, or over `mean_capacity_tps` while it has measured none."""
    if not mean_capacity_tps > 0:
        raise ValueError(f"mean_capacity_tps must be > 0, got {mean_capacity_tps!r}")
    queued = view.routes_since_heartbeat * tokens_per_route
    capacity = mean_capacity_tps
    if view.load is not None:
        queued += view.load.waiting_prefill_tokens
        capacity = view.load.prefill_capacity_tps or mean_capacity_tps
    return queued / capacity


def _requests(view: InstanceView) -> int:
    held = 0 if view.load is None else view.load.running + view.load.waiting
    return held + view.routes_since_heartbeat


def choose_borrower(
    instances: Iterable[InstanceView],
    borrow: BorrowPrefill,
    *,
    prompt_tokens: int,
    max_tokens: int = 0,
    exclude_ids: Collection[str] = (),
    model: str | None = None,
    kv_block_size_tokens: int | None = None,
    tpot_slo_s: float | None = None,
) -> InstanceView | None:
    """The decode instance that runs a new request whole because the prefill pool is backlogged,
    or None for the ordinary (prefill, decode) pair.

    Borrow only when:
    - every SERVING prefill instance (of `model`, not excluded) has a queue wait above
      `borrow.wait_s` (`prompt_wait_s`; a route since its report counts as this request's
      prompt). Without a prefill instance, or before any has measured its capacity, there is
      no backlog to read: None;
    - a SERVING decode instance is decode-light: fewer than `borrow.max_decode_requests`
      requests, free KV blocks for the whole request, its TPOT estimate within `tpot_slo_s`,
      and its own queued prompt tokens a shorter wait than the shortest prefill queue (it starts
      this prompt sooner).
    Of those, the least loaded (`instance_load`, then the id)."""
    if prompt_tokens < 0 or max_tokens < 0:
        raise ValueError(f"prompt_tokens and max_tokens must be >= 0, got {prompt_tokens!r} and {max_tokens!r}")
    pool = list(instances)
    prefills = [v for v in pool if _eligible(v, exclude_ids, Role.PREFILL, model)]
    measured = [v.load.prefill_capacity_tps for v in prefills if v.load is not None and v.load.prefill_capacity_tps > 0]
    if not measured:
        return None
    mean_capacity = sum(measured) / len(measured)
    shortest = min(prompt_wait_s(v, mean_capacity, prompt_tokens) for v in prefills)
    if shortest <= borrow.wait_s:
        return None
    blocks_needed = _blocks_needed(prompt_tokens + max_tokens, kv_block_size_tokens)
    light = [
        v
        for v in pool
        if _eligible(v, exclude_ids, Role.DECODE, model)
        and _requests(v) < borrow.max_decode_requests
        and (not blocks_needed or _fits(v, blocks_needed))
        and meets_tpot(v, tpot_slo_s)
        # Its routes are mostly decode halves of pairs (no prompt to compute): only the
        # reported queue counts.
        and prompt_wait_s(v, mean_capacity) < shortest
    ]
    return min(light, key=lambda v: (instance_load(v), v.instance_id), default=None)


def plan_route(
    instances: Iterable[InstanceView],
    *,
    model: str | None,
    prompt_tokens: int = 0,
    max_tokens: int = 0,
    exclude_ids: Collection[str] = (),
    kv_block_size_tokens: int | None = None,
    leaves: Mapping[str, str] | None = None,
    load_slack: float = NEAR_EQUAL_LOAD,
    tpot_slo_s: float | None = None,
    affinity: PrefixAffinity | None = None,
) -> tuple[InstanceView, ...]:
    """The instances one request runs on, in order; empty when none serves.

    (prefill, decode) whenever the model has SERVING instances of both roles (after
    `exclude_ids`), even if colocated instances serve too: the split deployment is what the
    operator asked for. Otherwise one instance, the least loaded SERVING one of any role,
    preferring those whose TPOT estimate meets `tpot_slo_s` (`choose_instance`).
    `affinity`: prefix-affinity routing of the instance that runs the prompt (`choose_instance`).
    """
    if prompt_tokens < 0 or max_tokens < 0:
        raise ValueError(f"prompt_tokens and max_tokens must be >= 0, got {prompt_tokens!r} and {max_tokens!r}")
    pool = list(instances)
    request_tokens = prompt_tokens + max_tokens
    pair = choose_pair(
        pool,
        request_tokens,
        exclude_ids,
        model=model,
        kv_block_size_tokens=kv_block_size_tokens,
        prompt_tokens=prompt_tokens,
        leaves=leaves,
        load_slack=load_slack,
        affinity=affinity,
    )
    if pair is not None:
        return pair
    # No pair: a colocated deployment, or a split one that lost a whole pool (every decode
    # instance dead, drained or excluded after failing this request). A prefill- or
    # decode-role worker still runs whole requests, so one hop to any SERVING instance keeps
    # requests from failing until the pool is back.
    single = choose_instance(
        pool,
        request_tokens,
        exclude_ids,
        model=model,
        kv_block_size_tokens=kv_block_size_tokens,
        tpot_slo_s=tpot_slo_s,
        affinity=affinity,
    )
    return () if single is None else (single,)
