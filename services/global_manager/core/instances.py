"""Instance registry: the lifecycle state machine of every worker the manager knows.

Lifecycle: IDLE -> LOADING -> SERVING -> DRAINING -> IDLE; LOADING -> IDLE when a load fails;
DRAINING -> SERVING when a scale-out takes a drain back before it finishes; any state -> LOST; LOST -> IDLE when
the worker registers again. Anything else raises `IllegalTransitionError` naming both states.
Routing (`routing.py`) only ever picks SERVING instances: LOADING ones are reached through the
zigzag planner, DRAINING ones take no new work, IDLE ones hold no model and LOST ones are gone.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Collection, Iterator

from .types import InstanceState, InstanceView, LoadSample, Role

__all__ = [
    "IllegalTransitionError",
    "Registry",
    "RegistryError",
    "UnknownInstanceError",
    "is_legal_transition",
]

S = InstanceState

_NEXT: dict[InstanceState, frozenset[InstanceState]] = {
    S.IDLE: frozenset({S.LOADING, S.LOST}),
    # LOADING -> IDLE is the rollback of a failed load (bad checksum, no room, timeout).
    S.LOADING: frozenset({S.SERVING, S.IDLE, S.LOST}),
    S.SERVING: frozenset({S.DRAINING, S.LOST}),
    # DRAINING -> SERVING: a scale-out resumes an instance whose drain still waits (no reload).
    S.DRAINING: frozenset({S.IDLE, S.SERVING, S.LOST}),
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

    def count(
        self,
        *,
        model: str | None = None,
        role: Role | None = None,
        states: Collection[InstanceState] = (),
        up_to: int | None = None,
    ) -> int:
        """How many views are of `model`, `role` and one of `states` (any, when not given);
        with `up_to`, counting stops once it reaches that many."""
        count = 0
        for v in self._views.values():
            if (
                (model is None or v.model == model)
                and (role is None or v.role is role)
                and (not states or v.state in states)
            ):
                count += 1
                if count == up_to:
                    break
        return count

    def _put(self, instance_id: str, old: InstanceView | None, view: InstanceView) -> None:
        """Store `view` (replacing `old`, None for a new instance): every write goes through here
        and `_drop`, so a subclass can keep an index of the table in step."""
        self._views[instance_id] = view

    def _drop(self, instance_id: str, old: InstanceView) -> None:
        del self._views[instance_id]

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
        self._put(instance_id, old, view)
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
        self._put(instance_id, old, view)
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
        view = _evolve(old, layers_loaded=layers_loaded)
        self._put(instance_id, old, view)
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
        self._put(instance_id, old, view)
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
        view = _evolve(
            old, last_heartbeat_s=max(old.last_heartbeat_s, sample.now_s), load=sample, routes_since_heartbeat=0
        )
        self._put(sample.instance_id, old, view)
        return view

    def note_routed(self, instance_id: str, n: int = 1) -> InstanceView:
        """Count `n` requests routed to the instance since its last heartbeat (see `instance_load`)."""
        if n < 1:
            raise ValueError(f"instance {instance_id!r}: n must be >= 1 routes, got {n!r}")
        old = self.get(instance_id)
        view = _evolve(old, routes_since_heartbeat=old.routes_since_heartbeat + n)
        self._put(instance_id, old, view)
        return view

    def remove(self, instance_id: str) -> InstanceView:
        """Forget an instance for good; only IDLE or LOST ones, which hold no work."""
        old = self.get(instance_id)
        if old.state not in (S.IDLE, S.LOST):
            raise RegistryError(
                f"instance {instance_id!r} is {old.state.value}; only IDLE or LOST instances can be removed"
            )
        self._drop(instance_id, old)
        return old


# The slot setters of `InstanceView`, in its field order: `_evolve` fills a new view through
# them, which takes half the time of the frozen dataclass's `__init__` (one `object.__setattr__`
# per field, looked up by name).
_VIEW_SETTERS = tuple(InstanceView.__dict__[f.name].__set__ for f in dataclasses.fields(InstanceView))


def _evolve(
    old: InstanceView,
    *,
    layers_loaded: int | None = None,
    last_heartbeat_s: float | None = None,
    load: LoadSample | None = None,
    routes_since_heartbeat: int | None = None,
) -> InstanceView:
    """`dataclasses.replace` for the registry's hot paths (a route noted, a report, a layer
    landed), written out: the generic one inspects the fields on every call, and a simulated
    cluster of 1,000 instances makes millions of these. `load=None` keeps the old report.
    Every field is set, in `InstanceView`'s field order (a unit test pins that every field is
    copied), and `__post_init__` checks the result as the constructor would."""
    view = object.__new__(InstanceView)
    s0, s1, s2, s3, s4, s5, s6, s7, s8, s9 = _VIEW_SETTERS
    s0(view, old.instance_id)
    s1(view, old.model)
    s2(view, old.role)
    s3(view, old.state)
    s4(view, old.layers_loaded if layers_loaded is None else layers_loaded)
    s5(view, old.num_layers)
    s6(view, old.host)
    s7(view, old.last_heartbeat_s if last_heartbeat_s is None else last_heartbeat_s)
    s8(view, old.load if load is None else load)
    s9(view, old.routes_since_heartbeat if routes_since_heartbeat is None else routes_since_heartbeat)
    view.__post_init__()
    return view
