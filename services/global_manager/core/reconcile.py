"""The global manager's control loop as a pure core: `Reconciler.reconcile(now_s, registry,
observations) -> actions`, plus the decisions an action's outcome calls for (a retry, a rollback,
a rebalance).

No asyncio, no gRPC, no clock reads: the caller passes the time and what it observed, the core
moves its registry through the transitions it commands (an instance it loads is LOADING from the
decision on) and returns the I/O as `actions` for an `Actuator`. The live manager and a
simulator run the same core.

One tick (`reconcile`): instances silent for `lost_after_s` (and no action in flight) become
LOST and leave the parameter manager's locations; each pool of the default model is topped up
to its floor from the IDLE workers; the policy decides on the load monitor's snapshot (reported
when `DecisionThrottle` says so, acted on unless advisory), each pool's part bounded by the
manager's own floor and `max_instances`, a scale-in keeping one instance SERVING while any is
wanted (capacity still loading cannot take requests); and instances over their KV or TBT target
release running requests (live migration, at most once per `migration_cooldown_s` each).
"""

from __future__ import annotations

import dataclasses
import math
import re
from collections.abc import Collection, Mapping

from .actions import (
    Action,
    Count,
    DrainInstance,
    LoadInstances,
    MigrateRequests,
    Report,
    ResumeInstance,
    UpdateLocation,
)
from .decisions import DecisionThrottle, bounded_delta
from .instances import Registry
from .load_monitor import LoadMonitor
from .placement import assign_idle, choose_idle, plan_live_migration, plan_rebalance, scale_in_order
from .policies import Policy
from .types import InstanceState, Role, ScaleDecision

__all__ = [
    "KEEP_WARM_MAX_S",
    "Observations",
    "ReconcileSettings",
    "Reconciler",
    "floor_name",
    "kept_warm_s",
    "release_report",
]

S = InstanceState


def floor_name(role: Role) -> str:
    """The setting behind a pool's floor, for messages."""
    return {Role.PREFILL: "min_prefill", Role.DECODE: "min_decode"}.get(role, "min_instances")


@dataclasses.dataclass(frozen=True, slots=True)
class ReconcileSettings:
    """The manager settings the core reads (see `GlobalManagerConfig` for each)."""

    default_model: str = ""
    pool_floors: Mapping[Role, int] = dataclasses.field(default_factory=lambda: {Role.COLOCATED: 0})
    max_instances: int = 8
    disaggregated: bool = False
    autoscale: bool = False
    lost_after_s: float = 10.0
    load_retries: int = 1
    rebalance: bool = True
    live_migration: bool = False
    migration_kv_high: float = 0.95
    migration_tbt_slo_s: float | None = None
    migration_cooldown_s: float = 5.0
    # A drained instance keeps the weights for as long as its model's last load took (the
    # break-even of keeping against reloading), at most this; 0: unloaded at once.
    keep_warm_max_s: float = 0.0


@dataclasses.dataclass(frozen=True, slots=True)
class Observations:
    """What the manager saw since the last tick. `monitor`: the heartbeat windows (silence and
    load); `busy`: instances whose load or drain is in flight (the actuator owns them: their own
    RPC deadline judges them, not their heartbeats); `unhealthy`: instances that count as no
    capacity although SERVING or LOADING: suspect (a gateway reported it failed) or doomed
    (LOADING from a source that is gone), so the floor is topped up without waiting for them."""

    monitor: LoadMonitor
    busy: frozenset[str] = frozenset()
    unhealthy: frozenset[str] = frozenset()


# The manager's default bound on how long a drained instance keeps its weights (the sim's too).
KEEP_WARM_MAX_S = 30.0
# How a scale-in's report says so (`kept_warm_s` reads it back, e.g. for a benchmark's accounting).
KEEP_WARM_NOTE = "; it keeps the weights {:.3g}s after it drains"
_KEEP_WARM_RE = re.compile(r"; it keeps the weights ([0-9.e+-]+)s after it drains")


def kept_warm_s(reason: str) -> float:
    """How long a scale-in's report says the drained instance keeps its weights (0 if not)."""
    m = _KEEP_WARM_RE.search(reason)
    return float(m.group(1)) if m else 0.0


LIVE_STATES = (S.LOADING, S.SERVING)  # what counts as capacity: already paid for by a scale-out


def live(registry: Registry, model: str, role: Role | None = None, unhealthy: Collection[str] = ()) -> list[str]:
    """Instances of `model` that count as capacity: LOADING + SERVING, none of `unhealthy`."""
    return [
        v.instance_id
        for v in registry.views(model=model, role=role)
        if v.state in LIVE_STATES and v.instance_id not in unhealthy
    ]


def _has_live(registry: Registry, model: str, role: Role, n: int, unhealthy: Collection[str] = ()) -> bool:
    """Whether `live(registry, model, role, unhealthy)` holds at least n, counting only until it
    does (a floor of one in a pool of a thousand is met by the first instance found)."""
    if unhealthy:
        return len(live(registry, model, role, unhealthy)) >= n
    return registry.count(model=model, role=role, states=LIVE_STATES, up_to=n) >= n


def release_report(action: MigrateRequests, moved: int | None) -> Report | None:
    """The event for a release's outcome (None: the worker could not be asked)."""
    if moved is None:
        return None
    status = "moved" if moved else "none"
    if action.running:
        reason = f"{action.why}: released {moved} of {action.n} running requests with their KV"
        return Report("live_migration", action.model, status, reason, action.source)
    if action.ran_ahead_by:
        reason = f"{action.why}; {action.source} released {moved} queued requests it ran ahead"
        if action.n:
            reason = f"{reason} and up to {action.n} more"
        return Report("zigzag_take_back", action.model, status, reason, action.source)
    reason = (
        f"scale_out: {action.why}; {action.source} released {moved} of the {action.n} queued requests above an "
        "even share"
    )
    return Report("rebalance", action.model, status, reason, action.source)


class Reconciler:
    """The control loop's decisions and the state it keeps between ticks: the policy (swapped by
    `Admin.SetPolicy`, cooldowns carried over), advisory mode, the report throttle, the latest
    decision and when each instance last shed requests."""

    def __init__(
        self, settings: ReconcileSettings, policy: Policy, *, advisory: bool = False, decision_repeat_s: float = 30.0
    ) -> None:
        self.settings = settings
        self.policy = policy
        self.advisory = advisory
        self.throttle = DecisionThrottle(repeat_s=decision_repeat_s)
        self.last_decision: ScaleDecision | None = None
        self.migrated_at: dict[str, float] = {}
        self.load_s: dict[str, float] = {}  # model -> how long its last load took
        # Drained instances that keep a model's weights a while (instance -> model), preferred
        # by a scale-out of that model, and the loads handed to them (their time is no reload's).
        self.warm: dict[str, str] = {}
        self.warm_loads: set[str] = set()
        # Drains of a pool's scale-in still in flight (instance -> model), which a scale-out of
        # that model may take back (`ResumeInstance`), and the ones it took back, whose drain's
        # outcome says whether the worker heard in time.
        self.resumable: dict[str, str] = {}
        self.resuming: set[str] = set()

    # ---- one tick -------------------------------------------------------------------------
    def reconcile(self, now_s: float, registry: Registry, observations: Observations) -> list[Action]:
        """One control tick; `registry` takes the transitions the returned actions follow from."""
        busy = set(observations.busy)
        actions: list[Action] = []
        for iid in observations.monitor.lost(now_s):
            if iid in busy:
                # A load or drain RPC is in flight: its own deadline judges the worker (a busy
                # worker may miss heartbeats while it unpacks parameters).
                continue
            actions += self.mark_lost(registry, iid, f"no heartbeat for {self.settings.lost_after_s}s")
        model = self.settings.default_model
        unhealthy = observations.unhealthy
        if model:
            actions += self.top_up(registry, busy, model, unhealthy)
        if self.settings.autoscale and model:
            actions += self.autoscale(now_s, registry, observations.monitor, busy, model, unhealthy)
        if self.settings.live_migration and model:
            actions += self.migrate_running(now_s, registry, busy, model)
        return actions

    def mark_lost(self, registry: Registry, iid: str, reason: str) -> list[Action]:
        """`iid` is gone (silent past `lost_after_s`, or found dead by a probe): LOST, reported,
        and out of the parameter manager's locations. Nothing if it is unknown or LOST already."""
        if iid not in registry or registry.get(iid).state is S.LOST:
            return []
        model = registry.get(iid).model
        registry.mark_lost(iid)
        self.warm.pop(iid, None)
        self.resumable.pop(iid, None)
        self.resuming.discard(iid)
        actions: list[Action] = [Report("instance_lost", "-", "LOST", reason, iid)]
        if model:
            actions.append(UpdateLocation(model, iid, present=False))
        return actions

    def top_up(self, registry: Registry, busy: set[str], model: str, unhealthy: Collection[str] = ()) -> list[Action]:
        """Bring each pool of `model` (colocated, or prefill and decode) up to its floor from the
        IDLE pool (`assign_idle`: workers started for a role fill that pool; scarce others form
        a P/D pair first). `unhealthy` instances (suspect, doomed) do not count toward a floor."""
        floors = {role: n for role, n in self.settings.pool_floors.items() if n > 0}
        if not floors or all(_has_live(registry, model, role, n, unhealthy) for role, n in floors.items()):
            return []
        have = {role: len(live(registry, model, role, unhealthy)) for role in floors}
        idle = [v for v in registry.views(state=S.IDLE) if v.instance_id not in busy]
        actions: list[Action] = []
        for role, views in assign_idle(floors, have, idle).items():
            reason = f"{floor_name(role)}={floors[role]}"
            actions += self.scale_out(
                registry,
                busy,
                model,
                len(views),
                role,
                reason,
                only={v.instance_id for v in views},
                unhealthy=unhealthy,
            )[1]
        return actions

    def autoscale(
        self,
        now_s: float,
        registry: Registry,
        monitor: LoadMonitor,
        busy: set[str],
        model: str,
        unhealthy: Collection[str] = (),
    ) -> list[Action]:
        """One policy decision for `model` (kept in `last_decision`): reported, then acted on
        unless advisory or "no change"."""
        # A configured split is split even before its first instance serves; otherwise the
        # monitor tells from the instances' roles.
        snapshot = monitor.snapshot(
            now_s,
            registry.views(model=model),
            model=model,
            disaggregated=True if self.settings.disaggregated and model == self.settings.default_model else None,
        )
        decision: ScaleDecision = self.policy.decide(now_s, snapshot)
        self.last_decision = decision
        actions: list[Action] = []
        reported = self.throttle.should_report(decision)
        if reported:
            if self.advisory and decision.action != "no_change":
                decision = dataclasses.replace(decision, reason=f"{decision.reason}; ADVISORY: not acted on")
            actions.append(
                Report(
                    "autoscaling_decision",
                    decision.action,
                    decision.target_str(),
                    decision.reason,
                    time_s=now_s,
                    log_line=decision.to_log_line(),
                )
            )
        if self.advisory or decision.action == "no_change":
            return actions
        for role in decision_roles(decision):
            actions += self._act(registry, busy, model, role, decision, reported, unhealthy)
        return actions

    def _act(
        self,
        registry: Registry,
        busy: set[str],
        model: str,
        role: Role,
        decision: ScaleDecision,
        reported: bool,
        unhealthy: Collection[str] = (),
    ) -> list[Action]:
        """One pool's part of a decision. Shortfalls (a manager bound, no IDLE worker) are told
        when the decision is, so a change that cannot happen is not told every tick."""
        current = len(live(registry, model, role))
        low = self.settings.pool_floors.get(role, 0) if model == self.settings.default_model else 0
        delta, note = bounded_delta(
            current,
            current + decision.delta(role),
            low=low,
            high=self.settings.max_instances,
            low_name=floor_name(role),
        )
        wanted = current + delta
        actions: list[Action] = []
        if note and reported:
            actions.append(Report("autoscaling_bound", model, role.value, note))
        if delta > 0:
            chosen, acts = self.scale_out(
                registry, busy, model, delta, role, reason=decision.reason, unhealthy=unhealthy
            )
            actions += acts
            if len(chosen) < delta and reported:
                actions.append(Count("load", "short"))
                actions.append(
                    Report(
                        "scale_out",
                        model,
                        "partial",
                        f"wanted {delta} more {role.value} instances, assigned {len(chosen)}: no more IDLE workers"
                        " nor drains to take back",
                    )
                )
        elif delta < 0:
            # Keep one SERVING while any instance is wanted: capacity still loading serves nothing.
            chosen, acts = self.scale_in(
                registry, busy, model, -delta, reason=decision.reason, role=role, keep_serving=1 if wanted > 0 else 0
            )
            actions += acts
            if len(chosen) < -delta and reported:
                actions.append(
                    Report(
                        "scale_in",
                        model,
                        "partial",
                        f"wanted {-delta} fewer {role.value} instances, draining {len(chosen)}: "
                        "the rest are loading or busy with another action",
                    )
                )
        return actions

    def migrate_running(self, now_s: float, registry: Registry, busy: Collection[str], model: str) -> list[Action]:
        """Live migration: instances over their KV or TBT target release running requests, which
        the gateway resumes elsewhere with their KV (`plan_live_migration`)."""
        plan = plan_live_migration(
            registry.views(model=model),
            model,
            kv_high=self.settings.migration_kv_high,
            tbt_slo_s=self.settings.migration_tbt_slo_s,
        )
        actions: list[Action] = []
        for source, n, why in plan:
            if now_s - self.migrated_at.get(source, -math.inf) < self.settings.migration_cooldown_s:
                continue
            if source in busy:
                continue
            self.migrated_at[source] = now_s
            actions.append(MigrateRequests(source, model, n, running=True, why=why))
        return actions

    # ---- commands (the tick, Admin.Scale, scale from zero) ----------------------------------
    def scale_out(
        self,
        registry: Registry,
        busy: set[str],
        model: str,
        n: int,
        role: Role,
        reason: str,
        *,
        exclude: frozenset[str] = frozenset(),
        attempt: int = 0,
        only: Collection[str] | None = None,
        unhealthy: Collection[str] = (),
    ) -> tuple[list[str], list[Action]]:
        """Assign up to n instances to `model` as `role`, within `max_instances` (`unhealthy`
        instances take no room: they are about to leave). First the pool's own drains still in
        flight (none of `exclude`; not with `only`): they serve again at once, SERVING from here
        on (`ResumeInstance`); then IDLE workers (of `only` when given, none of `busy` or
        `exclude`): LOADING from here on, and `busy` holds them. Returns their ids and the
        actions (one `LoadInstances` for the batch)."""
        room = max(0, self.settings.max_instances - len(live(registry, model, unhealthy=unhealthy)))
        actions: list[Action] = []
        resumed: list[str] = []
        if only is None:
            resumed = self._resumable(registry, model, role, exclude)[: min(n, room)]
        for iid in resumed:
            registry.transition(iid, S.SERVING)
            del self.resumable[iid]
            self.resuming.add(iid)
            actions.append(Report("scale_out", model, "resumed", reason + " (its drain taken back: no load)", iid))
            actions.append(ResumeInstance(iid, model, reason))
        n, room = n - len(resumed), room - len(resumed)
        candidates = [v for v in registry.views(state=S.IDLE) if only is None or v.instance_id in only]
        warm = {iid for iid, m in self.warm.items() if m == model}
        idle = choose_idle(candidates, min(n, room), role, {*busy, *exclude}, warm=warm)
        for v in idle:
            registry.transition(v.instance_id, S.LOADING, model=model, role=role)
            busy.add(v.instance_id)
            note = ""
            if self.warm.pop(v.instance_id, None) == model:
                self.warm_loads.add(v.instance_id)
                note = " (it may still hold the weights: then no transfer)"
            actions.append(Report("scale_out", model, "loading", reason + note, v.instance_id))
        ids = tuple(v.instance_id for v in idle)
        if ids:
            actions.append(LoadInstances(model, role, ids, reason, attempt=attempt, tried=exclude))
        return [*resumed, *ids], actions

    def _resumable(self, registry: Registry, model: str, role: Role, exclude: Collection[str]) -> list[str]:
        """The pool's drains a scale-out may take back, busiest first (the most requests still
        on it: the furthest from finishing, and the most its resume keeps where they run)."""
        views = [
            registry.get(iid)
            for iid, m in self.resumable.items()
            if m == model and iid in registry and iid not in exclude
        ]
        views = [v for v in views if v.state is S.DRAINING and v.role is role]
        views.sort(key=lambda v: (-(v.load.running + v.load.waiting if v.load else 0), v.instance_id))
        return [v.instance_id for v in views]

    def scale_in(
        self,
        registry: Registry,
        busy: set[str],
        model: str,
        n: int,
        reason: str,
        role: Role | None = None,
        *,
        keep_serving: int = 0,
        only: Collection[str] | None = None,
    ) -> tuple[list[str], list[Action]]:
        """Drain the n least-loaded SERVING instances of `model` (of `role` if given, among
        `only` if given) that no action owns, leaving at least `keep_serving` SERVING. Returns
        their ids and actions. A pool's scale-in (no `only`) may be taken back by a scale-out
        while its drains wait; drains of named instances (an operator's) are final."""
        chosen: list[str] = []
        actions: list[Action] = []
        order = scale_in_order(
            (
                v
                for v in registry.views(model=model)
                if v.instance_id not in busy and (only is None or v.instance_id in only)
            ),
            model=model,
            role=role,
        )
        keep_s = self.keep_warm_s(model)
        for victim in order[: max(0, min(n, len(order) - keep_serving))]:
            registry.transition(victim.instance_id, S.DRAINING)
            busy.add(victim.instance_id)
            note = KEEP_WARM_NOTE.format(keep_s) if keep_s > 0 else ""
            actions.append(Report("scale_in", model, "draining", reason + note, victim.instance_id))
            actions.append(DrainInstance(victim.instance_id, model, reason, keep_warm_s=keep_s))
            chosen.append(victim.instance_id)
            if only is None:
                self.resumable[victim.instance_id] = model
        return chosen, actions

    def keep_warm_s(self, model: str) -> float:
        """How long a drained instance of `model` keeps its weights: as long as the model's last
        load took (keeping them longer costs more instance-seconds than the reload it might
        save; shorter, a reversal within that time pays the load), within `keep_warm_max_s`; 0
        before any load was measured."""
        return min(self.settings.keep_warm_max_s, self.load_s.get(model, 0.0))

    # ---- outcomes ---------------------------------------------------------------------------
    def load_succeeded(self, registry: Registry, load: LoadInstances, iid: str, load_s: float) -> list[Action]:
        """`iid` finished loading: SERVING, listed at the parameter manager, and (with
        `rebalance`) the busier instances of its pool release queued requests above an even
        share (`plan_rebalance`), which routing then sends to the new one."""
        state = registry.get(iid).state if iid in registry else None
        if state is S.LOADING:
            registry.transition(iid, S.SERVING)
        elif state is not S.SERVING:
            # Written off (deregistered) meanwhile: the worker re-registers in the state it
            # reports, so there is nothing to roll back here.
            return [
                Report(
                    "load_result",
                    load.model,
                    "orphaned",
                    f"loaded, but the instance is {state.value if state else 'unregistered'} here; "
                    "it re-registers in the state it reports",
                    iid,
                )
            ]
        if iid not in self.warm_loads:
            # A load onto a warm copy took no transfer: it says nothing of what a reload costs.
            self.load_s[load.model] = load_s
        self.warm_loads.discard(iid)
        actions: list[Action] = [
            UpdateLocation(load.model, iid, present=True),
            Count("load", "ok"),
            Report("load_result", load.model, "ok", f"load_s={load_s:.3f}", iid),
        ]
        if self.settings.rebalance:
            # SERVING views only: the pool `plan_rebalance` reads, and the new instance is one.
            for source, n in plan_rebalance(registry.views(model=load.model, state=S.SERVING), iid):
                actions.append(MigrateRequests(source, load.model, n, running=False, why=f"{iid} is SERVING"))
        return actions

    def load_failed(
        self,
        registry: Registry,
        busy: set[str],
        load: LoadInstances,
        iid: str,
        error: str,
        unhealthy: Collection[str] = (),
    ) -> list[Action]:
        """`iid`'s load failed: IDLE again (the worker drops the half-loaded model), and the load
        is retried on another IDLE worker (`load_retries`), else rolled back and reported."""
        actions: list[Action] = [Count("load", "failed"), Report("load_result", load.model, "failed", error, iid)]
        self.warm_loads.discard(iid)
        if iid in registry and registry.get(iid).state is S.LOADING:
            registry.transition(iid, S.IDLE)
        retries = self.settings.load_retries
        if load.attempt < retries:
            # Another worker, not this one: whatever broke its load may break it again.
            chosen, acts = self.scale_out(
                registry,
                busy,
                load.model,
                1,
                load.role,
                f"retry {load.attempt + 1}/{retries} after {iid} failed: {error}",
                exclude=load.tried | {iid},
                attempt=load.attempt + 1,
                unhealthy=unhealthy,
            )
            if chosen:
                return [*actions, *acts, Count("load", "retried")]
        reason = (
            f"load on {iid} failed ({error}); it is IDLE again and no other IDLE worker is left to retry on"
            if load.attempt < retries
            else f"load on {iid} failed ({error}); it is IDLE again after {load.attempt} retries"
        )
        return [*actions, Count("load", "rolled_back"), Report("scale_out", load.model, "rolled_back", reason, iid)]

    def drain_finished(
        self,
        registry: Registry,
        drain: DrainInstance,
        error: str,
        finished: int = 0,
        aborted: int = 0,
        *,
        resumed: bool = False,
    ) -> list[Action]:
        """A drain ended: IDLE (unloaded; with `keep_warm_s`, holding the weights until then);
        `resumed`: taken back, SERVING; on failure the worker's own reports decide where it is
        (SERVING again, or LOST). A drain that finished although a scale-out took it back (the
        worker heard the resume too late) leaves the instance IDLE all the same."""
        iid = drain.instance_id
        self.resumable.pop(iid, None)
        took_back = iid in self.resuming
        self.resuming.discard(iid)
        if error:
            return [
                Count("drain", "failed"),
                Report("drain_result", drain.model, "failed", f"{error}; following the worker's reports", iid),
            ]
        state = registry.get(iid).state if iid in registry else None
        if resumed:
            if state is S.DRAINING:
                registry.transition(iid, S.SERVING)
            return [
                Count("drain", "resumed"),
                Report("drain_result", drain.model, "resumed", f"taken back, serving again; finished={finished}", iid),
            ]
        note = ""
        if state is S.SERVING and took_back:
            # The resume came after the drain had finished: the worker has unloaded.
            registry.transition(iid, S.DRAINING)
            state = S.DRAINING
            note = "; the resume came after the drain had finished"
        if state is S.DRAINING:
            registry.transition(iid, S.IDLE)
            if drain.keep_warm_s > 0:
                self.warm[iid] = drain.model
        return [
            Count("drain", "ok"),
            Report("drain_result", drain.model, "idle", f"finished={finished} aborted={aborted}{note}", iid),
        ]

    def resume_finished(self, action: ResumeInstance, error: str) -> list[Action]:
        """The worker answered a `ResumeInstance` ("" error: serving again). A refusal is only
        reported: the drain's own outcome moves the instance on (`drain_finished`)."""
        if not error:
            return [Count("resume", "ok")]
        return [
            Count("resume", "refused"),
            Report(
                "scale_out", action.model, "resume_refused", f"{error}; its drain's outcome decides", action.instance_id
            ),
        ]


def decision_roles(decision: ScaleDecision) -> tuple[Role, ...]:
    """The pools a decision speaks for: prefill and decode, or the colocated one."""
    return (Role.PREFILL, Role.DECODE) if not decision.is_colocated else (Role.COLOCATED,)
