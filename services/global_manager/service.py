"""Global manager servicer: instance registry (registration, heartbeats), the execution
scheduler (routing), admin RPCs, and the control loop around the reconcile core.

Each control tick observes (the load monitor, what the actuator owns), asks the pure core
(`core.reconcile.Reconciler`) what to do and hands the actions to the actuator (`actuator.
GrpcActuator` by default, a `core.actuator.RecordingActuator` in tests and simulators); the
actuator reports outcomes back here (the servicer is its `ActionSink`), and the core decides
the follow-ups. This module adapts protobuf, owns the clock (injected) and publishes events.

Autoscaling: every control tick the policy decides on a snapshot of the load monitor. Each
decision carries its reason; changes are always reported, "no change" only when its reason
changes or every `decision_repeat_s` (`core.decisions.DecisionThrottle`). Reported decisions go
to the log as `time,action,target,status,reason` lines, to `Admin.WatchEvents` with the same
columns (action=autoscaling_decision, target=scale_out/scale_in/no_change, status=the count
change), and to Prometheus. In advisory mode nothing is acted on.

Actuator guarantees: a scale-out load that fails is retried on another IDLE worker
(`load_retries`), else rolled back (the instance IDLE again) and reported; a scale-in drains the
least-loaded SERVING instance (the worker refuses new requests, in-flight ones finish), removes
it from the parameter manager's locations, unloads it and returns it to IDLE. Action tasks never
raise into the task group: a failure is an event, not a crashed manager.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import json
import math
import time
from collections.abc import Callable, Collection
from typing import Any

import grpc
import structlog
from prometheus_client import Counter, Gauge, Histogram

from blitzmesh.v1 import admin_pb2, global_manager_pb2, global_manager_pb2_grpc
from services.common import roles
from services.common.backlog import backlog_is_news, sample_wait_s
from services.common.security import require_instance
from services.common.server import ServeContext
from services.common.waiting import wait_for
from services.global_manager.actuator import GrpcActuator
from services.global_manager.config import GlobalManagerConfig
from services.global_manager.convert import (
    role_from_proto,
    role_to_proto,
    sample_from_proto,
    state_from_proto,
    state_to_proto,
)
from services.global_manager.core.actions import (
    Action,
    Count,
    DrainInstance,
    LoadInstances,
    MigrateRequests,
    Report,
    ResumeInstance,
    UpdateLocation,
)
from services.global_manager.core.actuator import Actuator
from services.global_manager.core.decisions import DecisionThrottle
from services.global_manager.core.load_monitor import LoadMonitor
from services.global_manager.core.multicast import Topology
from services.global_manager.core.policies import Policy, make_policy
from services.global_manager.core.prefix_index import PrefixIndex
from services.global_manager.core.reconcile import (
    Observations,
    Reconciler,
    ReconcileSettings,
    decision_roles,
    live,
    release_report,
)
from services.global_manager.core.routing import BorrowPrefill, PrefixAffinity, choose_borrower, plan_route
from services.global_manager.core.types import InstanceState, InstanceView, Role, ScaleDecision
from services.global_manager.core.zigzag import (
    HandBack,
    LiveLayers,
    Paired,
    StoppedLive,
    WentLive,
    ZigzagSettings,
    ZigzagStep,
    ZigzagTracker,
    plan_hand_back,
    plan_take_back,
)
from services.global_manager.esp_routing import EspRouter, EspUnplaced
from services.global_manager.history import HistoryRecorder
from services.global_manager.instance_table import InstanceTable, Suspicion

log = structlog.get_logger(__name__)

S = InstanceState
INSTANCES = Gauge("blitzmesh_gm_instances", "Instances by state", ["state"])
SCHEDULED = Counter(
    "blitzmesh_gm_schedule_total",
    "Schedule calls by outcome (pd_pair, one_hop, borrowed, unavailable, esp_group, esp_unplaced)",
    ["outcome"],
)
ZIGZAG_ROUTES = Counter(
    "blitzmesh_gm_zigzag_routes_total", "Requests routed to a LOADING instance and its partner (ZigZag)", ["instance"]
)
ZIGZAG_LAYERS = Gauge(
    "blitzmesh_gm_zigzag_layers_loaded", "k of a live (ZigZag-serving) LOADING instance", ["instance"]
)
DECISIONS = Counter("blitzmesh_gm_decisions_total", "Autoscaling decisions by policy and action", ["policy", "action"])
DESIRED = Gauge("blitzmesh_gm_desired_instances", "Instances the policy wants, per pool", ["model", "role"])
CURRENT = Gauge(
    "blitzmesh_gm_current_instances", "Instances counted as capacity (LOADING + SERVING)", ["model", "role"]
)
SIGNALS = Gauge(
    "blitzmesh_gm_policy_signal", "Numbers behind the latest decision (ratio, need, tps)", ["model", "signal"]
)
DECIDE_SECONDS = Histogram(
    "blitzmesh_gm_decide_seconds",
    "Load snapshot + policy decision, per control tick",
    buckets=(0.0001, 0.0003, 0.001, 0.003, 0.01, 0.03, 0.1),
)
ACTIONS = Counter("blitzmesh_gm_scale_actions_total", "Actuator outcomes", ["kind", "outcome"])
MOVED = Counter(
    "blitzmesh_gm_requests_moved_total", "Requests moved between instances by the manager, by reason", ["reason"]
)
ADVISORY = Gauge("blitzmesh_gm_advisory", "1 while the policy only advises")
SUSPECTS = Counter(
    "blitzmesh_gm_suspects_total",
    "Instances a gateway reported failed, by outcome (reported, lost: the probe found it dead, cleared)",
    ["outcome"],
)


def routed_total() -> float:
    """Requests `Schedule` routed so far (one manager per process: the counter is the process's)."""
    return sum(
        sample.value
        for family in SCHEDULED.collect()
        for sample in family.samples
        if sample.name.endswith("_total") and sample.labels.get("outcome") not in ("unavailable", "esp_unplaced")
    )


def _param_from_proto(value: str) -> Any:
    """Policy parameters travel as strings; lists and objects (a periodic schedule) as JSON."""
    text = value.strip()
    if text[:1] in ("[", "{"):
        try:
            return json.loads(text)
        except ValueError:
            return value
    return value


def _param_to_proto(value: Any) -> str:
    return value if isinstance(value, str) else json.dumps(value)


def reconcile_settings(cfg: GlobalManagerConfig) -> ReconcileSettings:
    """The settings the reconcile core reads, from the manager's config."""
    return ReconcileSettings(
        default_model=cfg.default_model,
        pool_floors=cfg.pool_floors(),
        max_instances=cfg.max_instances,
        disaggregated=cfg.disaggregated,
        autoscale=cfg.autoscale,
        lost_after_s=cfg.lost_after_s,
        load_retries=cfg.load_retries,
        rebalance=cfg.rebalance,
        live_migration=cfg.live_migration,
        migration_kv_high=cfg.migration_kv_high,
        migration_tbt_slo_s=cfg.migration_tbt_slo_s,
        migration_cooldown_s=cfg.migration_cooldown_s,
        keep_warm_max_s=cfg.keep_warm_max_s,
    )


class EventBus:
    """Fan-out of cluster events to WatchEvents subscribers (bounded queues; slow ones drop)."""

    def __init__(self) -> None:
        self._subscribers: set[asyncio.Queue[admin_pb2.ClusterEvent]] = set()

    def publish(self, event: admin_pb2.ClusterEvent) -> None:
        for q in list(self._subscribers):
            with contextlib.suppress(asyncio.QueueFull):
                q.put_nowait(event)

    def subscribe(self) -> asyncio.Queue[admin_pb2.ClusterEvent]:
        q: asyncio.Queue[admin_pb2.ClusterEvent] = asyncio.Queue(maxsize=1000)
        self._subscribers.add(q)
        return q

    def unsubscribe(self, q: asyncio.Queue[admin_pb2.ClusterEvent]) -> None:
        self._subscribers.discard(q)


class GlobalManagerServicer(global_manager_pb2_grpc.GlobalManagerServicer):
    def __init__(
        self,
        cfg: GlobalManagerConfig,
        *,
        clock: Callable[[], float] = time.monotonic,
        actuator: Callable[[GlobalManagerServicer], Actuator] | None = None,
    ) -> None:
        """`clock`: seconds on a monotonic clock; every time the control path reads goes through
        it, so tests (and a simulator) can drive the manager on a fake clock. `actuator`: builds
        the actuator from the servicer (its sink); the gRPC one by default."""
        self.cfg = cfg
        self.clock = clock
        self.table = InstanceTable()
        self.monitor = LoadMonitor(window_s=cfg.window_s, lost_after_s=cfg.lost_after_s)
        self.policy_params = dict(cfg.policy_params)
        self.reconciler = Reconciler(
            reconcile_settings(cfg),
            self._make_policy(cfg.policy, cfg.policy_params),
            advisory=cfg.advisory,
            decision_repeat_s=cfg.decision_repeat_s,
        )
        ADVISORY.set(1 if self.advisory else 0)
        # The reported decisions as `time,action,target,status,reason` lines (newest last).
        self.decision_log: collections.deque[str] = collections.deque(maxlen=10_000)
        self.events = EventBus()
        # The recent past (events and cluster samples) for GetHistory: a dashboard opened late.
        self.history = HistoryRecorder(cfg, self.monitor, routed_total)
        self.actuator: Actuator = actuator(self) if actuator is not None else GrpcActuator(cfg, self.table, sink=self)
        self._load_started: dict[str, float] = {}  # instance id -> when its load began
        # Instance id of a load target -> the nodes upstream of it on its transfer chain (the
        # chain's source and the hops before it): a target whose upstream is gone is doomed.
        self._upstreams: dict[str, frozenset[str]] = {}
        # Host -> leaf switch, for routing the decode side of a P/D pair near its prefill side.
        # Hosts the topology does not name share one default leaf, as in the multicast planner.
        topology = Topology.from_dict(cfg.topology) if cfg.topology else Topology(hosts={})
        self.leaves: dict[str, str] = {host: link.leaf for host, link in topology.hosts.items()}
        self.ctx: ServeContext | None = None
        # ZigZag live scaling: the pure core's state (chain tails, live instances, partners).
        self.zigzag = ZigzagTracker(
            ZigzagSettings(
                live=cfg.zigzag_live,  # type: ignore[arg-type]
                ttft_s=cfg.zigzag_ttft_s,
                stall_s=cfg.zigzag_stall_s,
                hand_back=cfg.zigzag_hand_back,
                hand_back_min_tokens_left=cfg.zigzag_hand_back_min_tokens_left,
                hand_back_wait_s=cfg.zigzag_hand_back_wait_s,
                pull_limit=cfg.zigzag_pull_limit,
                dispatch=cfg.zigzag_dispatch,  # type: ignore[arg-type]
            )
        )
        # Borrowed prefill: while the prefill pool is backlogged, a decode-light decode instance
        # runs a new request whole (None: off).
        self.borrow: BorrowPrefill | None = (
            BorrowPrefill(cfg.borrow_prefill_wait_s, cfg.borrow_prefill_max_decode_requests)
            if cfg.borrow_prefill
            else None
        )
        self._t0 = clock()
        self._wake = asyncio.Event()
        # Models whose scale from zero is being decided (a parameter-manager lookup in flight).
        self._waking: set[str] = set()
        # Prefix-affinity routing: block hashes of the prompts routed to each SERVING instance.
        self.prefix_index = PrefixIndex(cfg.prefix_index_blocks)
        self.esp = EspRouter(
            block_size=cfg.kv_block_size_tokens, min_prompt_tokens=cfg.esp_min_prompt_tokens, enabled=cfg.esp
        )

    def _make_policy(self, name: str, params: dict[str, Any]) -> Policy:
        """The manager's own bounds are the policy's defaults, so the policy does not ask for
        instances the manager will refuse (and say so every tick). The policy has one floor for
        every pool; split, it takes the smaller pool's and the actuator holds each pool at its own."""
        bounded = {
            "min_instances": max(1, min(self.cfg.pool_floors().values())),
            "max_instances": self.cfg.max_instances,
            **params,
        }
        return make_policy(name, bounded)

    @property
    def policy(self) -> Policy:
        return self.reconciler.policy

    @property
    def policy_name(self) -> str:
        return self.reconciler.policy.name

    @property
    def advisory(self) -> bool:
        return self.reconciler.advisory

    @property
    def throttle(self) -> DecisionThrottle:
        return self.reconciler.throttle

    @property
    def last_decision(self) -> ScaleDecision | None:
        return self.reconciler.last_decision

    def now_s(self) -> float:
        return self.clock() - self._t0

    def emit(
        self, action: str, target: str, status: str, reason: str, instance_id: str = "", time_s: float | None = None
    ) -> None:
        ev = admin_pb2.ClusterEvent(
            time_s=self.now_s() if time_s is None else time_s,
            action=action,
            target=target,
            status=status,
            reason=reason,
            instance_id=instance_id,
        )
        log.info("cluster_event", action=action, target=target, status=status, reason=reason, instance_id=instance_id)
        self.events.publish(ev)
        self.history.record(ev)

    # ---- registry -----------------------------------------------------------------------
    async def RegisterInstance(self, request, context):
        info = request.instance
        await require_instance(context, "RegisterInstance", info.instance_id)
        if not info.instance_id or not info.address:
            await context.abort(
                grpc.StatusCode.INVALID_ARGUMENT,
                f"instance_id and address are required, got {info.instance_id!r}, {info.address!r}",
            )
        view = self.table.upsert(info, self.now_s())
        self.monitor.mark_seen(info.instance_id, self.now_s())
        self.emit(
            "instance_registered", view.model or "-", view.state.value, f"address={info.address}", view.instance_id
        )
        if view.state is S.SERVING and view.model and self.actuator.ready:
            # Re-registration after a manager restart (or a LOST comeback): the parameter
            # manager must list what the instance holds again.
            self._execute([UpdateLocation(view.model, view.instance_id, present=True)])
        self._wake_reconcile()
        return global_manager_pb2.RegisterInstanceResponse(heartbeat_interval_s=self.cfg.heartbeat_interval_s)

    async def Heartbeat(self, request, context):
        iid = request.instance_id
        await require_instance(context, "Heartbeat", iid)
        if iid not in self.table.registry or self.table.registry.get(iid).state is S.LOST:
            return global_manager_pb2.HeartbeatResponse(reregister=True)
        now = self.now_s()
        state = state_from_proto(request.state)
        before_view = self.table.registry.get(iid)
        before = before_view.state
        busy = self.actuator.busy()
        if iid not in busy:
            # While the actuator loads or drains an instance it owns the transitions; a
            # heartbeat sent before the worker heard the command would only move it back.
            self.table.follow(iid, state, request.model_id, request.layers_loaded, request.num_layers)
        # Even while an action owns the transitions: a route must carry the full layer range.
        view = self.table.learn_num_layers(iid, request.model_id, request.num_layers)
        self.table.note_engine(iid, request.engine if request.HasField("engine") else None)
        state = view.state
        sample = sample_from_proto(iid, now, request.load)
        self.table.registry.heartbeat(sample)
        self.monitor.observe(sample)
        previous = before_view.load
        if backlog_is_news(
            sample_wait_s(sample.waiting_prefill_tokens, sample.prefill_capacity_tps),
            sample_wait_s(previous.waiting_prefill_tokens, previous.prefill_capacity_tps) if previous else 0.0,
        ):
            # A backlog formed (or doubled) on this instance: the queue trigger decides now, not
            # at the next tick.
            self._wake_reconcile()
        for kind, group, detail in self.esp.observe(
            iid, request.load.esp_groups, time.time(), request.load.esp_group_kv_tokens
        ):
            # Named after the spare that joined, or the group's first master when it ends.
            self.emit(
                kind, group.model_id, group.group_id, detail, iid if kind == "esp_scale_up" else group.members[-1]
            )
        suspicion = self.table.suspects.get(iid)
        if suspicion is not None and not suspicion.probing:
            # The probe got no answer, but the worker talks to us: it is alive (a slow or
            # partitioned instance the gateway could not reach is the gateway's to exclude).
            self._clear_suspicion(iid, "it heartbeats again")
        if before is not state:
            self.emit("instance_state", request.model_id or "-", state.value, f"{before.value}->{state.value}", iid)
            if before is S.SERVING and before_view.model and iid not in busy and self.actuator.ready:
                # The worker left SERVING on its own (its engine died, or it drains on SIGTERM):
                # no route goes there from now on (it is no longer SERVING here), and no transfer
                # may pick it as a source. The pool is topped up by the next tick.
                self._execute([UpdateLocation(before_view.model, iid, present=False)])
            self._wake_reconcile()
        return global_manager_pb2.HeartbeatResponse(zigzag_peers=self._zigzag_pull_peers(iid))

    async def DeregisterInstance(self, request, context):
        iid = request.instance_id
        await require_instance(context, "DeregisterInstance", iid)
        if iid in self.table.registry:
            self.table.registry.mark_lost(iid)
            self.table.registry.remove(iid)
            self.monitor.forget(iid)
            self.actuator.forget(iid)
            self.emit("instance_deregistered", "-", "removed", "worker stopping", iid)
            self._wake_reconcile()
        return global_manager_pb2.DeregisterInstanceResponse()

    async def ReportInstanceFailure(self, request, context):
        """A gateway saw `instance_id` fail: suspect at once (routed around, no transfer source,
        no capacity), then probed: dead (refused) or another incarnation -> LOST now; answering
        SERVING -> cleared; no answer -> suspect until it heartbeats again or goes LOST."""
        iid = request.instance_id
        if not iid:
            await context.abort(
                grpc.StatusCode.INVALID_ARGUMENT, f"instance_id is required, got {request.instance_id!r}"
            )
        if iid not in self.table.registry:
            return global_manager_pb2.ReportInstanceFailureResponse(known=False)
        view = self.table.registry.get(iid)
        if view.state in (S.SERVING, S.LOADING) and iid not in self.table.suspects:
            reason = f"reported by {request.reporter or 'a gateway'}: {request.reason or 'no reason given'}"
            suspicion = self.table.suspects[iid] = Suspicion(self.now_s(), reason)
            SUSPECTS.labels("reported").inc()
            self.emit("instance_suspect", view.model or "-", view.state.value, reason, iid)
            if self.ctx is not None:
                self.ctx.tasks.spawn(self._probe(iid, suspicion), name=f"probe-{iid}")
            self._wake_reconcile()
        return global_manager_pb2.ReportInstanceFailureResponse(known=True, state=state_to_proto(view.state))

    async def _probe(self, iid: str, suspicion: Suspicion) -> None:
        """Ask a suspect instance for its status and act on the answer (see ReportInstanceFailure)."""
        outcome = await self.actuator.probe(iid, self.cfg.probe_timeout_s)
        if self.table.suspects.get(iid) is not suspicion or iid not in self.table.registry:
            return  # cleared meanwhile (re-registered, LOST, a heartbeat)
        view = self.table.registry.get(iid)
        if outcome == "dead" or (outcome not in ("silent", view.state.value) and iid not in self.actuator.busy()):
            # Nothing listens on its address, or another incarnation (a restarted process) does.
            SUSPECTS.labels("lost").inc()
            del self.table.suspects[iid]
            why = "refused the manager's probe" if outcome == "dead" else f"answers {outcome} (restarted)"
            self._execute(self.reconciler.mark_lost(self.table.registry, iid, f"{suspicion.reason}; {why}"))
            self.actuator.forget(iid)
            self._wake_reconcile()
        elif outcome == "silent":
            suspicion.probing = False  # its next heartbeat clears it; silence makes it LOST
        else:
            self._clear_suspicion(iid, f"it answers the manager's probe as {outcome}")

    def _clear_suspicion(self, iid: str, why: str) -> None:
        if self.table.suspects.pop(iid, None) is None:
            return
        SUSPECTS.labels("cleared").inc()
        model = self.table.registry.get(iid).model if iid in self.table.registry else ""
        self.emit("instance_suspect", model or "-", "cleared", why, iid)
        self._wake_reconcile()

    # ---- execution scheduler ------------------------------------------------------------
    async def Schedule(self, request, context):
        views = self.table.registry.views(model=request.model_id)
        # The request's own exclusions (instances that failed it), and every suspect instance.
        excluded = set(request.exclude_instance_ids) | self.table.suspects.keys()
        esp_hop = await self._esp_route(request, views, excluded, context)
        if esp_hop is not None:
            SCHEDULED.labels("esp_group").inc()
            return global_manager_pb2.Route(request_id=request.request_id, hops=[esp_hop])
        try:
            hops = plan_route(
                views,
                model=request.model_id,
                prompt_tokens=request.prompt_tokens,
                max_tokens=request.max_tokens,
                exclude_ids=excluded,
                kv_block_size_tokens=self.cfg.kv_block_size_tokens,
                leaves=self.leaves,
                tpot_slo_s=request.slo.tpot_s if request.slo.HasField("tpot_s") else None,
                affinity=self._prefix_affinity(request, views),
            )
        except ValueError as e:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"request {request.request_id!r}: {e}")
        if not hops:
            waking = await self._scale_from_zero(request.model_id, request.request_id, excluded)
            views = self.table.registry.views(model=request.model_id)
            SCHEDULED.labels("unavailable").inc()
            states = sorted(f"{v.instance_id}:{v.role.value}:{v.state.value}" for v in views)
            suspects = sorted(self.table.suspects.keys() & {v.instance_id for v in views})
            await context.abort(
                grpc.StatusCode.UNAVAILABLE,
                f"no SERVING instance of model {request.model_id!r} "
                f"(instances: {states or 'none'}, excluded: {sorted(request.exclude_instance_ids)}, "
                f"suspect: {suspects}){waking}",
            )
        pd_pair = len(hops) == 2 and hops[0].role is Role.PREFILL and hops[1].role is Role.DECODE
        outcome = "pd_pair" if len(hops) == 2 else "one_hop"
        if pd_pair and self.borrow is not None:
            lender = choose_borrower(
                views,
                self.borrow,
                prompt_tokens=request.prompt_tokens,
                max_tokens=request.max_tokens,
                exclude_ids=excluded,
                model=request.model_id,
                kv_block_size_tokens=self.cfg.kv_block_size_tokens,
                tpot_slo_s=request.slo.tpot_s if request.slo.HasField("tpot_s") else None,
            )
            if lender is not None:
                # The prefill pool is backlogged: the decode instance runs the request whole (and
                # no ZigZag split: a single DECODE hop is neither condition below).
                hops, pd_pair, outcome = (lender,), False, "borrowed"
        if self.cfg.zigzag and ((len(hops) == 1 and hops[0].role is Role.COLOCATED) or pd_pair):
            # ZigZag splits the pool that runs prompts: the colocated one, or the prefill pool
            # (then the route's decode instance takes the whole prompt's KV from the partner).
            pool = Role.PREFILL if pd_pair else Role.COLOCATED
            split = self._zigzag_route(request.model_id, views, excluded, pool)
            if split is not None:
                if request.prefix_block_hashes and self.cfg.prefix_overlap_weight > 0 and not pd_pair:
                    # The loading instance caches the prompt's blocks if its load completes
                    # under the request, so the request moved off its partner's backlog then
                    # prefers it (served from its prefix cache).
                    self.prefix_index.record(split[0].instance_id, request.model_id, request.prefix_block_hashes)
                if pd_pair:
                    self.table.registry.note_routed(hops[1].instance_id)
                    split.append(self._hop(hops[1]))
                return global_manager_pb2.Route(request_id=request.request_id, hops=split)
        for view in hops:
            # Until its next heartbeat shows the request, routing counts it here.
            self.table.registry.note_routed(view.instance_id)
        if request.prefix_block_hashes and self.cfg.prefix_overlap_weight > 0:
            # The first hop computes the prompt and caches its blocks (a decode hop pulls them).
            self.prefix_index.record(hops[0].instance_id, hops[0].model, request.prefix_block_hashes)
        SCHEDULED.labels(outcome).inc()
        return global_manager_pb2.Route(
            request_id=request.request_id,
            # A pair is [PREFILL, DECODE]; a single hop keeps its instance's role (a prefill- or
            # decode-role instance serving alone while the other pool is gone, or a decode instance
            # lending to a backlogged prefill pool).
            hops=[self._hop(view) for view in hops],
        )

    async def _esp_route(
        self, request: global_manager_pb2.ScheduleRequest, views: list[InstanceView], excluded: set[str], context: Any
    ) -> global_manager_pb2.RouteHop | None:
        """An ESP group's master hop for a request no single instance holds (esp_routing.py);
        None for the ordinary routes. UNAVAILABLE when no group holds it now."""
        pool = [
            v
            for v in self.esp.candidates(views, excluded, self.table.dataplane)
            if v.role is Role.COLOCATED and v.model == request.model_id
        ]
        if not self.esp.wants_group(pool, request.prompt_tokens, request.max_tokens):
            return None
        hops = {v.instance_id: self._hop(v) for v in pool}
        for iid, hop in hops.items():
            hop.dataplane_address = self.table.dataplane[iid][0]
        try:
            hop = self.esp.plan(request, pool, hops, self.now_s())
        except EspUnplaced as e:
            SCHEDULED.labels("esp_unplaced").inc()
            await context.abort(grpc.StatusCode.UNAVAILABLE, str(e))
        g = hop.esp
        slices = " ".join(
            f"{m.instance_id}[{a}:{b})" for m, a, b in zip(g.members, g.bounds, g.bounds[1:], strict=False)
        )
        spares = " ".join(s.instance_id for s in g.spares) or "-"
        self.emit(
            "esp_group",
            request.model_id,
            "formed",
            f"group={g.group_id} request={request.request_id} degree={len(g.members)} members={slices} spares={spares}",
            hop.instance_id,
        )
        return hop

    def _prefix_affinity(
        self, request: global_manager_pb2.ScheduleRequest, views: list[InstanceView]
    ) -> PrefixAffinity | None:
        """What each instance probably has cached of the request's prompt (None: no affinity)."""
        hashes = list(request.prefix_block_hashes)
        if not hashes or self.cfg.prefix_overlap_weight <= 0:
            return None
        self.prefix_index.sync(self.table.registry)
        bs = self.cfg.kv_block_size_tokens
        return PrefixAffinity(
            matched_blocks=self.prefix_index.overlaps(views, hashes),
            prompt_blocks=max(len(hashes), math.ceil(request.prompt_tokens / bs)),
            overlap_weight=self.cfg.prefix_overlap_weight,
            block_size=bs,
        )

    async def _scale_from_zero(self, model: str, request_id: str, excluded: Collection[str] = ()) -> str:
        """Scale from zero (Knative's activator, here in the manager): a request for a model the
        parameter manager lists finds no SERVING or LOADING instance, so one IDLE worker starts
        loading it. The caller still answers UNAVAILABLE; the gateway retries with backoff
        within the request's deadline (its `schedule_wait_s`) until the instance serves. At most
        one such load per model: the next request sees it LOADING. Instances the request
        excluded, suspect ones and doomed ones (`_unhealthy`) are no capacity: with the only
        SERVING instance dead, the load starts at once. Returns a note for the UNAVAILABLE
        details ('' when nothing is loading for it)."""
        if not self.cfg.scale_from_zero or not model or not self.actuator.ready or not self.cfg.param_manager:
            return ""
        if self._has_capacity(model, excluded):
            return self._loading_note(model)
        if self.cfg.disaggregated and model == self.cfg.default_model:
            return ""  # its prefill and decode pools are refilled by top_up, role by role
        if model in self._waking:
            return "; scale_from_zero: deciding, retry"
        if not self._idle_free():
            return ""
        # Only a listed model: a typo must not take a worker. One lookup per model at a time.
        self._waking.add(model)
        try:
            await self._check_model(model)
        except LookupError:
            return ""
        except grpc.aio.AioRpcError as e:
            log.warning("scale_from_zero_lookup_failed", model=model, code=e.code().name, details=e.details())
            return ""
        finally:
            self._waking.discard(model)
        if self._has_capacity(model, excluded):  # another request, or top_up, started one meanwhile
            return self._loading_note(model)
        reason = (
            f"scale_from_zero: request {request_id!r} for listed model {model!r} found no SERVING or LOADING "
            f"instance; {len(self._idle_free())} IDLE worker(s) free"
        )
        chosen = self.scale_out(model, 1, Role.COLOCATED, reason, exclude=excluded)
        if not chosen:
            return ""
        ACTIONS.labels("scale_from_zero", "started").inc()
        self.decision_log.append(f"{self.now_s():.1f},scale_from_zero,{model},{chosen[0]},{reason}")
        self.emit("scale_from_zero", model, "loading", reason, chosen[0])
        return f"; scale_from_zero: {chosen[0]} LOADING, retry"

    def _has_capacity(self, model: str, excluded: Collection[str] = ()) -> bool:
        """Whether some instance of `model` serves or will: SERVING or LOADING, and none of
        `excluded`, suspect or doomed (`_unhealthy`)."""
        return bool(live(self.table.registry, model, unhealthy={*excluded, *self._unhealthy()}))

    def _loading_note(self, model: str) -> str:
        unhealthy = self._unhealthy()
        ids = sorted(
            v.instance_id
            for v in self.table.registry.views(model=model)
            if v.state is S.LOADING and v.instance_id not in unhealthy
        )
        return f"; waiting for {', '.join(ids)} LOADING" if ids else ""

    def _unhealthy(self) -> frozenset[str]:
        """SERVING or LOADING instances that count as no capacity: suspect ones (a gateway
        reported them failed), and doomed ones: LOADING from a chain whose source or an earlier
        hop is an instance that is suspect, gone, or no longer SERVING or LOADING (its load falls
        back to the host caches, but a floor must not wait on it)."""
        registry = self.table.registry
        bad = set(self.table.suspects)

        def gone(node: str) -> bool:  # `_upstreams` holds instances only, never host caches
            return node in bad or node not in registry or registry.get(node).state not in (S.SERVING, S.LOADING)

        for iid, upstream in self._upstreams.items():
            if iid in registry and registry.get(iid).state is S.LOADING and any(gone(n) for n in upstream):
                bad.add(iid)
        return frozenset(bad)

    def _idle_free(self) -> list[InstanceView]:
        """IDLE workers no action owns."""
        busy = self.actuator.busy()
        return [v for v in self.table.registry.views(state=S.IDLE) if v.instance_id not in busy]

    def _hop(self, view: InstanceView) -> global_manager_pb2.RouteHop:
        """A hop running every layer on `view`'s instance."""
        return global_manager_pb2.RouteHop(
            instance_id=view.instance_id,
            address=self.table.addresses[view.instance_id],
            layer_start=0,
            layer_end=view.num_layers,
            role=role_to_proto(view.role),
        )

    def _zigzag_route(
        self, model: str, views: list[InstanceView], excluded: Collection[str], pool: Role = Role.COLOCATED
    ) -> list[global_manager_pb2.RouteHop] | None:
        """ZigZag (docs/algorithms.md 3, `ZigzagTracker.route`): while every SERVING instance is
        overloaded, a live LOADING instance runs the request's first layers and the overloaded
        instance with the fewest used KV blocks finishes them. None: route as usual."""
        if self.cfg.zigzag_dispatch != "route":
            return None
        now = self.now_s()
        reachable = {iid for iid, (dp, _) in self.table.dataplane.items() if dp}
        step = self.zigzag.route(now, views, model, pool, excluded, reachable)
        self._zigzag_effects(step, now)
        if step.split is None:
            return None
        new, old, k = step.split.new, step.split.partner, step.split.k
        self.table.registry.note_routed(new.instance_id)
        self.table.registry.note_routed(old.instance_id)
        SCHEDULED.labels("zigzag").inc()
        ZIGZAG_ROUTES.labels(new.instance_id).inc()
        return [
            global_manager_pb2.RouteHop(
                instance_id=new.instance_id,
                address=self.table.addresses[new.instance_id],
                layer_start=0,
                layer_end=k,
                role=role_to_proto(new.role),
                dataplane_address=self.table.dataplane[new.instance_id][0],
            ),
            global_manager_pb2.RouteHop(
                instance_id=old.instance_id,
                address=self.table.addresses[old.instance_id],
                layer_start=k,
                layer_end=step.split.num_layers,
                role=role_to_proto(old.role),
                # Embeds the prompt for the loading instance until its embedding lands.
                dataplane_address=self.table.dataplane[old.instance_id][0],
            ),
        ]

    def _zigzag_effects(self, step: ZigzagStep, now: float) -> None:
        """Carry out the ZigZag core's effects: events, the decision log and the k gauge."""
        for e in step.effects:
            if isinstance(e, WentLive):
                tail = " (the tail of its transfer chain)" if e.chain_tail else ""
                detail = f"serves ZigZag requests with the layers it holds{tail}"
                self.emit("live_scaling", e.model, f"{e.layers}/{e.num_layers}", detail, e.instance_id)
            elif isinstance(e, LiveLayers):
                ZIGZAG_LAYERS.labels(e.instance_id).set(e.layers)
            elif isinstance(e, StoppedLive):
                with contextlib.suppress(KeyError):
                    ZIGZAG_LAYERS.remove(e.instance_id)
                if e.stalled:
                    self.emit("zigzag_stopped", e.model, "stalled", e.reason, e.instance_id)
            elif isinstance(e, Paired):
                self.decision_log.append(f"{now:.1f},zigzag_pair,{e.instance_id},{e.partner_id},{e.reason}")
                self.emit("zigzag_pair", e.model, e.partner_id, e.reason, e.instance_id)

    def _hand_back(self, step: ZigzagStep) -> list[Action]:
        """A live instance that split requests is SERVING now: its partner's running requests
        above an even share move to it with their KV (`plan_hand_back`), and with pulled
        dispatch the partner's queued requests it ran ahead go to it too (`plan_take_back`)."""
        actions: list[Action] = []
        pulled = self.cfg.zigzag_dispatch == "pull"
        for e in step.effects:
            if isinstance(e, HandBack):
                views = self.table.registry.views(model=e.model)
                take_back = plan_take_back(views, e) if pulled and e.queued else None
                if take_back is not None:
                    actions.append(take_back)
                move = plan_hand_back(views, e) if e.running else None
                if move is not None:
                    actions.append(move)
                    waited = (
                        f" (waited {e.waited_s:.2f} s for its link to stop sending parameters)" if e.waited_s else ""
                    )
                    reason = f"{move.n} running: {move.why}{waited}"
                    self.emit("zigzag_hand_back", e.model, e.partner_id, reason, e.instance_id)
        return actions

    def _zigzag_pull_peers(self, iid: str) -> list[global_manager_pb2.ZigzagPeer]:
        """`--zigzag-dispatch pull`: the live LOADING instances that pull queued requests from
        SERVING instance `iid` (`ZigzagTracker.pull_peers`), each with its in-flight cap now."""
        if not (self.cfg.zigzag and self.cfg.zigzag_dispatch == "pull" and self.zigzag.started):
            return []
        now = self.now_s()
        reachable = {i for i, (dp, _) in self.table.dataplane.items() if dp and self.table.addresses.get(i, "")}
        step = self.zigzag.pull_peers(now, list(self.table.registry), self.table.registry.get(iid), reachable)
        self._zigzag_effects(step, now)
        return [
            global_manager_pb2.ZigzagPeer(
                instance_id=p.instance.instance_id,
                address=self.table.addresses[p.instance.instance_id],
                dataplane_address=self.table.dataplane[p.instance.instance_id][0],
                layers_loaded=p.instance.layers_loaded,
                num_layers=p.instance.num_layers,
                inflight_limit=p.inflight_limit,
            )
            for p in step.peers
        ]

    # ---- admin --------------------------------------------------------------------------
    async def GetCluster(self, request, context):
        now = self.now_s()
        return admin_pb2.ClusterState(
            instances=[self.table.to_proto(v, now) for v in sorted(self.table.registry, key=lambda v: v.instance_id)],
            policy=self.policy_name,
            advisory=self.advisory,
            policy_params={k: _param_to_proto(v) for k, v in self.policy_params.items()},
            esp_groups=self.esp.to_proto(),
        )

    async def Scale(self, request, context):
        if not request.model_id:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "model_id is required")
        if request.delta == 0:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "delta must be non-zero, got 0")
        if request.delta > 0 and request.instance_ids:
            await context.abort(
                grpc.StatusCode.INVALID_ARGUMENT,
                f"delta={request.delta} with instance_ids {list(request.instance_ids)}: naming instances "
                "drains them (delta < 0); a scale-out picks its own",
            )
        try:
            await self._check_model(request.model_id)
        except LookupError as e:
            await context.abort(grpc.StatusCode.NOT_FOUND, str(e))
        try:
            role = role_from_proto(request.role)
        except ValueError as e:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        resumed = 0
        if request.delta > 0:
            chosen = self.scale_out(request.model_id, request.delta, role, reason="Admin.Scale")
            resumed = sum(self.table.registry.get(iid).state is S.SERVING for iid in chosen)
            if len(chosen) < request.delta and not chosen:
                idle = len(self.table.registry.views(state=S.IDLE))
                await context.abort(
                    grpc.StatusCode.RESOURCE_EXHAUSTED,
                    f"asked for {request.delta} more instances of {request.model_id!r}, {idle} IDLE workers free",
                )
        elif request.instance_ids:
            chosen = await self._drain_named(request, context)
        else:
            chosen = self.scale_in(request.model_id, -request.delta, reason="Admin.Scale")
            if not chosen:
                await context.abort(
                    grpc.StatusCode.FAILED_PRECONDITION, f"no SERVING instance of {request.model_id!r} to drain"
                )
        if request.wait:
            await self.actuator.wait(chosen)
        if request.delta < 0:
            reason = f"{len(chosen)} instance(s) draining"
        elif resumed:
            reason = f"{len(chosen) - resumed} instance(s) loading, {resumed} taken back from draining"
        else:
            reason = f"{len(chosen)} instance(s) loading"
        return admin_pb2.ScaleResponse(instance_ids=chosen, reason=reason)

    async def _drain_named(self, request, context) -> list[str]:
        """Admin.Scale with instance_ids: drain exactly those SERVING instances of the model."""
        ids = list(dict.fromkeys(request.instance_ids))
        if request.delta != -len(ids):
            await context.abort(
                grpc.StatusCode.INVALID_ARGUMENT,
                f"delta={request.delta} with {len(ids)} instance_ids {ids}: delta must be -{len(ids)}",
            )
        registry = self.table.registry
        for iid in ids:
            if iid not in registry:
                known = sorted(v.instance_id for v in registry)
                await context.abort(grpc.StatusCode.NOT_FOUND, f"unknown instance {iid!r}; instances: {known}")
            view = registry.get(iid)
            if view.model != request.model_id or view.state is not S.SERVING:
                await context.abort(
                    grpc.StatusCode.FAILED_PRECONDITION,
                    f"instance {iid!r} is {view.state.value} with model {view.model or '-'!r}; only a SERVING "
                    f"instance of {request.model_id!r} can be drained",
                )
        chosen = self.scale_in(request.model_id, len(ids), reason="Admin.Scale (named)", only=ids)
        if len(chosen) < len(ids):
            await context.abort(
                grpc.StatusCode.FAILED_PRECONDITION,
                f"instances {sorted(set(ids) - set(chosen))} are busy with another action; try again shortly",
            )
        return chosen

    async def SetPolicy(self, request, context):
        """Switch or retune the policy. The request names the policy (the one in force to keep
        it, e.g. to toggle advisory mode only); the given params replace the current ones.
        A request naming none changes nothing (INVALID_ARGUMENT): an empty or garbled message
        must not flip the manager into advisory mode. Cooldown timers carry over: they protect
        the cluster, whichever rule is in force."""
        if not request.policy:
            await context.abort(
                grpc.StatusCode.INVALID_ARGUMENT,
                f"policy is required, got {request.policy!r} (with advisory="
                f"{request.advisory if request.HasField('advisory') else 'unset'}, {len(request.params)} params); "
                f"name the policy in force ({self.policy_name!r}) to change only its mode",
            )
        name = request.policy
        params = {k: _param_from_proto(v) for k, v in request.params.items()}
        try:
            policy = self._make_policy(name, params)
        except ValueError as e:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        policy.cooldown = self.policy.cooldown
        self.reconciler.policy, self.policy_params = policy, params
        if request.HasField("advisory"):
            self.reconciler.advisory = request.advisory
            ADVISORY.set(1 if self.advisory else 0)
        self.throttle.reset()
        self.emit(
            "policy", self.policy_name, "set", f"params={json.dumps(params, sort_keys=True)} advisory={self.advisory}"
        )
        self._wake_reconcile()
        return admin_pb2.SetPolicyResponse(
            policy=self.policy_name,
            params={k: _param_to_proto(v) for k, v in params.items()},
            advisory=self.advisory,
        )

    async def WatchEvents(self, request, context):
        q = self.events.subscribe()
        try:
            while True:
                yield await q.get()
        finally:
            self.events.unsubscribe(q)

    async def GetHistory(self, request, context):
        return self.history.to_proto(
            self.now_s(), request.since_s if request.HasField("since_s") else None, request.samples_only
        )

    # ---- acting: the reconcile core's actions, the actuator's outcomes ----------------------
    async def _check_model(self, model_id: str) -> None:
        known = await self.actuator.list_models()
        if known is not None and model_id not in known:
            raise LookupError(f"unknown model {model_id!r}; registered: {known}")

    def live(self, model_id: str, role: Role | None = None) -> list[str]:
        """Instances of `model_id` that count as capacity: LOADING + SERVING."""
        return live(self.table.registry, model_id, role)

    def _busy(self) -> set[str]:
        return set(self.actuator.busy())

    def _execute(self, actions: list[Action]) -> None:
        for action in actions:
            if isinstance(action, LoadInstances):
                for iid in action.instance_ids:
                    self._load_started[iid] = self.now_s()
        self.actuator.execute(actions)

    def scale_out(self, model_id: str, n: int, role: Role, reason: str, exclude: Collection[str] = ()) -> list[str]:
        """Assign up to n IDLE workers (none of `exclude`) to `model_id` as `role`; each loads in
        the background."""
        chosen, actions = self.reconciler.scale_out(
            self.table.registry,
            self._busy(),
            model_id,
            n,
            role,
            reason,
            exclude=frozenset(exclude),
            unhealthy=self._unhealthy(),
        )
        self._execute(actions)
        return chosen

    def scale_in(
        self, model_id: str, n: int, reason: str, role: Role | None = None, only: Collection[str] | None = None
    ) -> list[str]:
        """Drain the n least-loaded SERVING instances of `model_id` (of `role` if given; among
        `only` if given)."""
        chosen, actions = self.reconciler.scale_in(
            self.table.registry, self._busy(), model_id, n, reason, role, only=only
        )
        self._execute(actions)
        return chosen

    # ActionSink: what the actuator reports back.
    def report(self, action: Report | Count) -> None:
        if isinstance(action, Count):
            ACTIONS.labels(action.kind, action.outcome).inc()
            return
        if action.log_line:
            self.decision_log.append(action.log_line)
            if action.action == "autoscaling_decision":
                log.info("autoscaling_decision", line=action.log_line, advisory=self.advisory)
        self.emit(action.action, action.target, action.status, action.reason, action.instance_id, action.time_s)

    def chain_tails(self, instance_ids: Collection[str]) -> None:
        self.zigzag.chain_tails(instance_ids)

    def load_upstreams(self, upstreams: dict[str, frozenset[str]]) -> None:
        self._upstreams.update(upstreams)

    def load_progress(self, load: LoadInstances, iid: str, layers_loaded: int, groups_total: int, done: bool) -> None:
        self.monitor.mark_seen(iid, self.now_s())  # progress proves it is alive
        if iid in self.table.registry and self.table.registry.get(iid).state is S.LOADING:
            if groups_total > 2:  # embed + L layers + head: the model's size, known now
                self.table.learn_num_layers(iid, load.model, groups_total - 2)
            view = self.table.registry.get(iid)
            with contextlib.suppress(ValueError):
                view = self.table.registry.set_layers_loaded(iid, min(layers_loaded, view.num_layers))
            if not done:
                now = self.now_s()
                step = self.zigzag.load_progress(now, iid, load.model, view.layers_loaded, view.num_layers)
                self._zigzag_effects(step, now)

    def load_finished(self, load: LoadInstances, iid: str, error: str) -> list[Action]:
        now = self.now_s()
        self.monitor.mark_seen(iid, now)  # its silence clock restarts after the action
        ended = self.zigzag.load_done(iid, loaded=not error, now_s=now, sending=self.actuator.sending())
        self._zigzag_effects(ended, now)
        self._upstreams.pop(iid, None)
        started = self._load_started.pop(iid, now)
        if error:
            follow = self.reconciler.load_failed(
                self.table.registry, self._busy(), load, iid, error, unhealthy=self._unhealthy()
            )
        else:
            follow = self.reconciler.load_succeeded(self.table.registry, load, iid, now - started)
        follow += self._hand_back(ended)  # a failed load's ending can free a link others waited for
        for action in follow:  # a retry's load_s counts from now
            if isinstance(action, LoadInstances):
                for target in action.instance_ids:
                    self._load_started[target] = now
        return follow

    def drain_finished(
        self, drain: DrainInstance, error: str, finished: int, aborted: int, *, resumed: bool = False
    ) -> list[Action]:
        self.monitor.mark_seen(drain.instance_id, self.now_s())
        follow = self.reconciler.drain_finished(self.table.registry, drain, error, finished, aborted, resumed=resumed)
        if not error:
            self._wake_reconcile()
        return follow

    def resume_finished(self, action: ResumeInstance, error: str) -> list[Action]:
        return self.reconciler.resume_finished(action, error)

    def released(self, action: MigrateRequests, moved: int | None) -> list[Action]:
        if moved is not None:
            MOVED.labels("live_migration" if action.running else "scale_out").inc(moved)
        report = release_report(action, moved)
        return [report] if report is not None else []

    # ---- control loop -------------------------------------------------------------------
    def _wake_reconcile(self) -> None:
        if self.ctx is not None:
            self._wake.set()

    async def control_loop(self) -> None:
        """Tick every `tick_s` of real time (or when woken). A simulator calls `tick()` itself."""
        while True:
            with contextlib.suppress(asyncio.TimeoutError):
                await wait_for(self._wake.wait(), self.cfg.tick_s)
            self._wake.clear()
            self.tick()

    def tick(self) -> None:
        """Observe, reconcile, act."""
        now = self.now_s()
        # The time the decision costs is measured on the wall clock, whatever `clock` says.
        started = time.perf_counter()
        previous = self.reconciler.last_decision
        lost = {v.instance_id for v in self.table.registry.views(state=S.LOST)}
        # Suspicions of instances that left SERVING/LOADING (LOST, drained) have done their job.
        for iid in list(self.table.suspects):
            if iid not in self.table.registry or self.table.registry.get(iid).state not in (S.SERVING, S.LOADING):
                del self.table.suspects[iid]
        actions = self.reconciler.reconcile(
            now,
            self.table.registry,
            Observations(monitor=self.monitor, busy=self.actuator.busy(), unhealthy=self._unhealthy()),
        )
        decision = self.reconciler.last_decision
        if decision is not None and decision is not previous:
            DECIDE_SECONDS.observe(time.perf_counter() - started)
            self._decision_metrics(self.cfg.default_model, decision)
        for view in self.table.registry.views(state=S.LOST):
            if view.instance_id not in lost:
                self.actuator.forget(view.instance_id)
        # Hand-backs that waited for a partner's link (a chain ended, or they waited long enough).
        actions += self._hand_back(self.zigzag.hand_backs_due(now, self.actuator.sending()))
        self._execute(actions)
        for state in S:
            INSTANCES.labels(state.value).set(len(self.table.registry.views(state=state)))
        # An instance that left SERVING takes its cached prefixes with it (between two routes too).
        self.prefix_index.sync(self.table.registry)
        self.history.tick(now, self.table.registry)

    def _decision_metrics(self, model: str, decision: ScaleDecision) -> None:
        DECISIONS.labels(decision.policy, decision.action).inc()
        for role in decision_roles(decision):
            before = (
                decision.instances_from
                if role is Role.COLOCATED
                else (decision.prefill_from if role is Role.PREFILL else decision.decode_from)
            )
            CURRENT.labels(model, role.value).set(before or 0)
            DESIRED.labels(model, role.value).set((before or 0) + decision.delta(role))
        for name, value in decision.extra.items():
            SIGNALS.labels(model, name).set(value)


class GlobalManagerService:
    name = "blitzmesh.v1.GlobalManager"
    role = roles.GLOBAL_MANAGER

    def __init__(
        self,
        cfg: GlobalManagerConfig,
        *,
        clock: Callable[[], float] = time.monotonic,
        actuator: Callable[[GlobalManagerServicer], Actuator] | None = None,
    ) -> None:
        self.servicer = GlobalManagerServicer(cfg, clock=clock, actuator=actuator)

    def register(self, server: grpc.aio.Server) -> list[str]:
        global_manager_pb2_grpc.add_GlobalManagerServicer_to_server(self.servicer, server)
        return [self.name]

    async def start(self, ctx: ServeContext) -> None:
        self.servicer.ctx = ctx
        if isinstance(self.servicer.actuator, GrpcActuator):
            self.servicer.actuator.bind(ctx.tasks.spawn)
        ctx.tasks.spawn(self.servicer.control_loop(), name="control-loop")
        await ctx.set_serving()

    async def stop(self) -> None:
        await self.servicer.actuator.aclose()
