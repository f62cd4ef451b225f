"""Instance registry (the lifecycle state machine) and the least-loaded routing choices.

Lifecycle: IDLE -> LOADING -> SERVING -> DRAINING -> IDLE; LOADING -> IDLE when a load fails;
any state -> LOST; LOST -> IDLE when
the worker registers again. Anything else raises `IllegalTransitionError` naming both states.
Routing only ever picks SERVING instances: LOADING ones are reached through the zigzag planner,
DRAINING ones take no new work, IDLE ones hold no model and LOST ones are gone.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Collection, Iterable, Iterator

from .types import InstanceState, InstanceView, LoadSample, Role

__all__ = [
    "IllegalTransitionError",
    "Registry",
    "RegistryError",
    "UnknownInstanceError",
    "choose_instance",
    "choose_pair",
    "instance_load",
    "is_legal_transition",
    "pick_scale_in_victim",
    "plan_rebalance",
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


def instance_load(view: InstanceView) -> float:
    """running + waiting + KV utilisation. The KV fraction (< 1) only separates instances with
    equal queues, preferring the one with more free cache. No heartbeat yet counts as idle."""
    load = view.load
    if load is None:
        return 0.0
    return load.running + load.waiting + load.kv_utilization


def _fits(view: InstanceView, blocks_needed: int) -> bool:
    load = view.load
    # An instance that has not reported its cache yet gets the benefit of the doubt.
    return load is None or load.kv_blocks_total == 0 or load.kv_blocks_total - load.kv_blocks_used >= blocks_needed


def choose_instance(
    instances: Iterable[InstanceView],
    request_tokens: int = 0,
    exclude_ids: Collection[str] = (),
    *,
    role: Role | None = None,
    model: str | None = None,
    kv_block_size_tokens: int | None = None,
) -> InstanceView | None:
    """The least-loaded SERVING instance, or None if there is none.

    Filters: not in `exclude_ids` (e.g. instances that already failed this request), of `role`
    and `model` when given. Ties break on the smaller instance_id so the choice is
    deterministic. With `kv_block_size_tokens`, instances whose free KV blocks can hold the
    request's `request_tokens` are preferred; if none can, the least loaded still gets it and
    queues it, because refusing would only move the wait to the client.
    """
    if request_tokens < 0:
        raise ValueError(f"request_tokens must be >= 0, got {request_tokens!r}")
    if kv_block_size_tokens is not None and kv_block_size_tokens <= 0:
        raise ValueError(f"kv_block_size_tokens must be > 0, got {kv_block_size_tokens!r}")
    blocks_needed = math.ceil(request_tokens / kv_block_size_tokens) if kv_block_size_tokens else 0
    best: InstanceView | None = None
    best_key: tuple[int, float, str] | None = None
    for view in instances:
        if view.state is not S.SERVING or view.instance_id in exclude_ids:
            continue
        if (role is not None and view.role is not role) or (model is not None and view.model != model):
            continue
        key = (0 if not blocks_needed or _fits(view, blocks_needed) else 1, instance_load(view), view.instance_id)
        if best_key is None or key < best_key:
            best, best_key = view, key
    return best


def choose_pair(
    instances: Iterable[InstanceView],
    request_tokens: int = 0,
    exclude_ids: Collection[str] = (),
    *,
    model: str | None = None,
    kv_block_size_tokens: int | None = None,
) -> tuple[InstanceView, InstanceView] | None:
    """Least-loaded (prefill, decode) pair for a split deployment; None unless both exist.

    The KV preference applies to the decode side, which keeps the request's cache.
    """
    pool = list(instances)
    prefill = choose_instance(pool, request_tokens, exclude_ids, role=Role.PREFILL, model=model)
    decode = choose_instance(
        pool, request_tokens, exclude_ids, role=Role.DECODE, model=model, kv_block_size_tokens=kv_block_size_tokens
    )
    return None if prefill is None or decode is None else (prefill, decode)


def pick_scale_in_victim(
    instances: Iterable[InstanceView], *, role: Role | None = None, model: str | None = None
) -> InstanceView | None:
    """The SERVING instance to drain: the least loaded (least work to finish or migrate)."""
    return choose_instance(instances, role=role, model=model)


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

    def heartbeat(self, sample: LoadSample) -> InstanceView:
        """Record the latest load. A LOST instance must register again before it counts."""
        old = self.get(sample.instance_id)
        if old.state is S.LOST:
            raise RegistryError(f"instance {sample.instance_id!r} is LOST; it must register again")
        view = dataclasses.replace(old, last_heartbeat_s=max(old.last_heartbeat_s, sample.now_s), load=sample)
        self._views[sample.instance_id] = view
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
