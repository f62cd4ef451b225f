"""Instance registry (the lifecycle state machine) and the routing choices: least loaded (with
the routes handed out since each instance's last heartbeat counted as load), and for a
prefill/decode split a (prefill, decode) pair placed by load, KV room and topology (`plan_route`).

Lifecycle: IDLE -> LOADING -> SERVING -> DRAINING -> IDLE; LOADING -> IDLE when a load fails;
any state -> LOST; LOST -> IDLE when
the worker registers again. Anything else raises `IllegalTransitionError` naming both states.
Routing only ever picks SERVING instances: LOADING ones are reached through the zigzag planner,
DRAINING ones take no new work, IDLE ones hold no model and LOST ones are gone.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Collection, Iterable, Iterator, Mapping

from .decisions import plan_top_up
from .types import InstanceState, InstanceView, LoadSample, Role

__all__ = [
    "IllegalTransitionError",
    "Registry",
    "RegistryError",
    "UnknownInstanceError",
    "NEAR_EQUAL_LOAD",
    "PrefixAffinity",
    "affinity_cost",
    "assign_idle",
    "choose_idle",
    "choose_instance",
    "choose_near",
    "choose_pair",
    "instance_load",
    "is_legal_transition",
    "pick_scale_in_victim",
    "plan_rebalance",
    "plan_route",
]

S = InstanceState

_NEXT: dict[InstanceState, frozenset[InstanceState]] = {
    S.IDLE: frozenset({S.LOADING, S.LOST}),
    # LOADING -> IDLE is the rollback of a failed load (bad checksum, no room, timeout).
    S.LOADING: frozenset({S.SERVING, S.IDLE, S.LOST}),
    S.SERVING: frozenset({S.DRAINING, S.LOST}),
    S.DRAINING: frozenset({S.IDLE, S.LOST}),
    S.LOST: frozenset({S.IDLE}),
}


def is_legal_transition(src: InstanceState, dst: InstanceState) -> bool:
    return dst in _NEXT[src]


class RegistryError(ValueError):
    """A registry operation that the instance's current state does not allow."""


class IllegalTransitionError(RegistryError):
    def __init__(self, instance_id: str, src: InstanceState, dst: InstanceState, hint: str = "") -> None:
        allowed = ", ".join(sorted(s.value for s in _NEXT[src])) or "nothing"
        message = (
            f"instance {instance_id!r}: illegal transition {src.value} -> {dst.value} (from {src.value} only {allowed})"
        )
        super().__init__(f"{message}; {hint}" if hint else message)
        self.instance_id, self.src, self.dst = instance_id, src, dst


class UnknownInstanceError(RegistryError, LookupError):
    def __init__(self, instance_id: str) -> None:
        super().__init__(f"instance {instance_id!r} is not registered")
        self.instance_id = instance_id


# ------------------------------------------------------------------------------------------
# Routing
# ------------------------------------------------------------------------------------------


#: Loads closer than this (one request) count as equal when the decode side of a P/D pair is
#: chosen by topology: the KV fraction and a route not yet reported only break ties, while a
#: whole extra request in the queue outweighs a shorter path for the KV transfer.
NEAR_EQUAL_LOAD = 1.0


def instance_load(view: InstanceView) -> float:
    """running + waiting + routes since the last heartbeat + KV utilisation.

    The KV fraction (< 1) only separates instances with equal queues, preferring the one with
    more free cache. Routes handed out since the heartbeat are requests the report cannot show
    yet. No heartbeat yet counts as idle, plus what was routed to it since it registered.
    """
    load = view.load
    routed = view.routes_since_heartbeat
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


def choose_idle(
    instances: Iterable[InstanceView], n: int, role: Role, exclude_ids: Collection[str] = ()
) -> list[InstanceView]:
    """Up to `n` IDLE workers to load for `role`: first those registered with that role (a
    worker started with `--role decode` is meant to decode), then unassigned (COLOCATED) ones,
    then those of the other split role; by id within each group."""
    if n < 0:
        raise ValueError(f"n must be >= 0, got {n!r}")

    def rank(v: InstanceView) -> tuple[int, str]:
        return (0 if v.role is role else 1 if v.role is Role.COLOCATED else 2, v.instance_id)

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
    """The SERVING instance to drain: the least loaded (least work to finish or migrate)."""
    return choose_instance(instances, role=role, model=model)


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
    load reports) are shared evenly over the pool with the new instance counted, starting
    empty; each instance gives up what it holds above its share, rounded up, so the new one
    gets at most an even share and nobody is left with more than one over it. Instances are
    listed most queued first; requests already running are never moved here.
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
    total = sum(v.load.waiting for v in pool if v.load is not None)
    if total == 0:
        return []
    share = math.ceil(total / (len(pool) + 1))
    moves = [(v.instance_id, v.load.waiting - share) for v in pool if v.load is not None and v.load.waiting > share]
    return sorted(moves, key=lambda m: (-m[1], m[0]))


# ------------------------------------------------------------------------------------------
# Registry
# ------------------------------------------------------------------------------------------


class Registry:
    """Instance id -> `InstanceView`, changed only through legal transitions.

    Views are immutable; each change stores a new one, so a caller holding an old view keeps a
    consistent picture. After a manager restart the registry is rebuilt from re-registrations,
    which may state the worker's current state and layers (see `register`).
    """

    def __init__(self) -> None:
        self._views: dict[str, InstanceView] = {}

    def __len__(self) -> int:
        return len(self._views)

    def __contains__(self, instance_id: object) -> bool:
        return instance_id in self._views

    def __iter__(self) -> Iterator[InstanceView]:
        return iter(list(self._views.values()))

    def get(self, instance_id: str) -> InstanceView:
        try:
            return self._views[instance_id]
        except KeyError:
            raise UnknownInstanceError(instance_id) from None

    def views(
        self, *, model: str | None = None, role: Role | None = None, state: InstanceState | None = None
    ) -> list[InstanceView]:
        return [
            v
            for v in self._views.values()
            if (model is None or v.model == model)
            and (role is None or v.role is role)
            and (state is None or v.state is state)
        ]

    def register(
        self,
        instance_id: str,
        *,
        model: str,
        role: Role,
        host: str,
        num_layers: int,
        now_s: float,
        state: InstanceState = S.IDLE,
        layers_loaded: int = 0,
    ) -> InstanceView:
        """Add a worker, or take back a LOST one (LOST -> IDLE).

        A worker unknown to the registry may state any state and layer count: that is how the
        registry is rebuilt after a manager restart. A known LOST worker comes back IDLE, since
        whatever it held was already written off. Any other known worker must go through LOST
        first, so a duplicate id cannot silently replace a live instance.
        """
        if not instance_id:
            raise ValueError("instance_id must be non-empty")
        if num_layers <= 0:
            raise ValueError(f"instance {instance_id!r}: num_layers must be > 0, got {num_layers!r}")
        if state is S.LOST:
            raise ValueError(f"instance {instance_id!r}: cannot register in state LOST")
        old = self._views.get(instance_id)
        if old is not None:
            if old.state is not S.LOST:
                raise IllegalTransitionError(
                    instance_id,
                    old.state,
                    state,
                    hint="a registered instance re-registers only from LOST; mark it lost first",
                )
            if state is not S.IDLE:
                raise IllegalTransitionError(instance_id, old.state, state, hint="a LOST instance re-registers as IDLE")
        if state is S.SERVING or state is S.DRAINING:
            layers_loaded = num_layers
        elif state is S.IDLE:
            layers_loaded = 0
        view = InstanceView(
            instance_id=instance_id,
            model=model,
            role=role,
            state=state,
            layers_loaded=layers_loaded,
            num_layers=num_layers,
            host=host,
            last_heartbeat_s=now_s,
            load=None,
        )
        self._views[instance_id] = view
        return view

    def transition(
        self,
        instance_id: str,
        dst: InstanceState,
        *,
        model: str | None = None,
        role: Role | None = None,
        num_layers: int | None = None,
    ) -> InstanceView:
        """Move an instance to `dst`. IDLE -> LOADING may also give it a new model/role/size
        (an idle worker is reused for whatever the planner needs)."""
        old = self.get(instance_id)
        if not is_legal_transition(old.state, dst):
            raise IllegalTransitionError(instance_id, old.state, dst)
        changes: dict[str, object] = {"state": dst}
        if model is not None or role is not None or num_layers is not None:
            if dst is not S.LOADING:
                raise RegistryError(
                    f"instance {instance_id!r}: model/role/num_layers change only on IDLE -> LOADING, "
                    f"not {old.state.value} -> {dst.value}"
                )
            if num_layers is not None and num_layers <= 0:
                raise ValueError(f"instance {instance_id!r}: num_layers must be > 0, got {num_layers!r}")
            changes.update(
                {k: v for k, v in (("model", model), ("role", role), ("num_layers", num_layers)) if v is not None}
            )
        if dst is S.LOADING or dst is S.IDLE:
            changes["layers_loaded"] = 0
        elif dst is S.SERVING:
            changes["layers_loaded"] = old.num_layers
        if dst is S.IDLE:
            changes["load"] = None  # an idle worker holds no model, so its old load means nothing
            changes["routes_since_heartbeat"] = 0
        view = dataclasses.replace(old, **changes)  # type: ignore[arg-type]
        self._views[instance_id] = view
        return view

    def mark_lost(self, instance_id: str) -> InstanceView:
        """Any state -> LOST; idempotent so a lost-detection sweep may repeat itself."""
        old = self.get(instance_id)
        return old if old.state is S.LOST else self.transition(instance_id, S.LOST)

    def set_layers_loaded(self, instance_id: str, layers_loaded: int) -> InstanceView:
        """Progress of a LOADING instance (k of L layers), which zigzag routing reads."""
        old = self.get(instance_id)
        if old.state is not S.LOADING:
            raise RegistryError(f"instance {instance_id!r}: layer progress applies to LOADING, it is {old.state.value}")
        if not old.layers_loaded <= layers_loaded <= old.num_layers:
            raise ValueError(
                f"instance {instance_id!r}: layers_loaded={layers_loaded!r} must be in "
                f"[{old.layers_loaded}, {old.num_layers}] (progress does not go backwards)"
            )
        view = dataclasses.replace(old, layers_loaded=layers_loaded)
        self._views[instance_id] = view
        return view

    def set_num_layers(self, instance_id: str, num_layers: int) -> InstanceView:
        """The model's layer count as the worker reports it. The manager assigns a model to an
        IDLE worker before it knows the model's size; routes must carry the full layer range."""
        old = self.get(instance_id)
        if old.state not in (S.LOADING, S.SERVING, S.DRAINING):
            raise RegistryError(
                f"instance {instance_id!r}: a layer count applies to a model being loaded or served, "
                f"it is {old.state.value}"
            )
        if num_layers <= 0:
            raise ValueError(f"instance {instance_id!r}: num_layers must be > 0, got {num_layers!r}")
        loaded = min(old.layers_loaded, num_layers) if old.state is S.LOADING else num_layers
        view = dataclasses.replace(old, num_layers=num_layers, layers_loaded=loaded)
        self._views[instance_id] = view
        return view

    def heartbeat(self, sample: LoadSample) -> InstanceView:
        """Record the latest load. A LOST instance must register again before it counts.

        The routes counted since the previous heartbeat start again from zero: the report now
        holds the requests that reached the worker. (A route handed out just before the report
        but not yet sent to the worker is missed for one period; the count is an estimate that
        only has to spread a burst, not an exact ledger.)
        """
        old = self.get(sample.instance_id)
        if old.state is S.LOST:
            raise RegistryError(f"instance {sample.instance_id!r} is LOST; it must register again")
        view = dataclasses.replace(
            old, last_heartbeat_s=max(old.last_heartbeat_s, sample.now_s), load=sample, routes_since_heartbeat=0
        )
        self._views[sample.instance_id] = view
        return view

    def note_routed(self, instance_id: str) -> InstanceView:
        """Count one request routed to the instance since its last heartbeat (see `instance_load`)."""
        old = self.get(instance_id)
        view = dataclasses.replace(old, routes_since_heartbeat=old.routes_since_heartbeat + 1)
        self._views[instance_id] = view
        return view

    def remove(self, instance_id: str) -> InstanceView:
        """Forget an instance for good; only IDLE or LOST ones, which hold no work."""
        old = self.get(instance_id)
        if old.state not in (S.IDLE, S.LOST):
            raise RegistryError(
                f"instance {instance_id!r} is {old.state.value}; only IDLE or LOST instances can be removed"
            )
        del self._views[instance_id]
        return old
