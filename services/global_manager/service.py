"""Global manager: instance registry, heartbeats, the execution scheduler (routing), and the
actuator that turns scaling decisions into worker and parameter-manager calls.

The decisions themselves come from the pure core (services/global_manager/core); this module
only adapts protobuf, owns the clock and performs the I/O.

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
import dataclasses
import json
import math
import time
from collections.abc import Callable, Collection
from typing import Any

import grpc
import structlog
from prometheus_client import Counter, Gauge, Histogram

from blitzmesh.v1 import (
    admin_pb2,
    global_manager_pb2,
    global_manager_pb2_grpc,
    param_manager_pb2,
    param_manager_pb2_grpc,
    worker_pb2,
    worker_pb2_grpc,
)
from services.common.grpc_util import channel
from services.common.server import ServeContext
from services.global_manager.config import GlobalManagerConfig
from services.global_manager.convert import role_from_proto, role_to_proto, sample_from_proto, state_from_proto
from services.global_manager.core.decisions import DecisionThrottle, bounded_delta
from services.global_manager.core.load_monitor import LoadMonitor
from services.global_manager.core.multicast import SendingLinks, Topology, traffic_from_instances
from services.global_manager.core.placement import (
    assign_idle,
    choose_idle,
    pick_scale_in_victim,
    plan_live_migration,
    plan_rebalance,
)
from services.global_manager.core.policies import Policy, make_policy
from services.global_manager.core.prefix_index import PrefixIndex
from services.global_manager.core.routing import PrefixAffinity, plan_route
from services.global_manager.core.types import InstanceState, InstanceView, Role, ScaleDecision
from services.global_manager.core.zigzag import choose_live_instance, choose_zigzag_partner, should_zigzag
from services.global_manager.instance_table import InstanceTable
from services.global_manager.transfer import Node, build_plan

log = structlog.get_logger(__name__)

S = InstanceState
INSTANCES = Gauge("blitzmesh_gm_instances", "Instances by state", ["state"])
SCHEDULED = Counter(
    "blitzmesh_gm_schedule_total", "Schedule calls by outcome (pd_pair, one_hop, unavailable)", ["outcome"]
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
RELEASE_TIMEOUT_S = 5.0
ADVISORY = Gauge("blitzmesh_gm_advisory", "1 while the policy only advises")
LOCATION_RETRIES = 3


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
    def __init__(self, cfg: GlobalManagerConfig, *, clock: Callable[[], float] = time.monotonic) -> None:
        """`clock`: seconds on a monotonic clock; every time the control path reads goes through
        it, so tests (and a simulator) can drive the manager on a fake clock."""
        self.cfg = cfg
        self.clock = clock
        self.table = InstanceTable()
        self.monitor = LoadMonitor(window_s=cfg.window_s, lost_after_s=cfg.lost_after_s)
        self.policy_name = cfg.policy
        self.policy_params = dict(cfg.policy_params)
        self.policy = self._make_policy(cfg.policy, cfg.policy_params)
        self.policy_name = self.policy.name
        self.advisory = cfg.advisory
        ADVISORY.set(1 if self.advisory else 0)
        self.throttle = DecisionThrottle(repeat_s=cfg.decision_repeat_s)
        # The reported decisions as `time,action,target,status,reason` lines (newest last).
        self.decision_log: collections.deque[str] = collections.deque(maxlen=10_000)
        self.last_decision: ScaleDecision | None = None
        self.events = EventBus()
        # Host -> leaf switch, for routing the decode side of a P/D pair near its prefill side.
        # Hosts the topology does not name share one default leaf, as in the multicast planner.
        topology = Topology.from_dict(cfg.topology) if cfg.topology else Topology(hosts={})
        self.leaves: dict[str, str] = {host: link.leaf for host, link in topology.hosts.items()}
        self.ctx: ServeContext | None = None
        self._actions: dict[str, asyncio.Task[None]] = {}  # instance id -> load/drain in progress
        # ZigZag live scaling: the tails of this manager's transfer chains (they go live), when
        # each went live, when its layer count last grew, and the partner it was last paired with.
        self._chain_tails: set[str] = set()
        # Chain senders of loads still in flight: the next plan keeps off their links.
        self._sending = SendingLinks()
        self.zigzag_started: dict[str, float] = {}
        self._zigzag_progress: dict[str, tuple[int, float]] = {}
        self.zigzag_partner: dict[str, str] = {}
        self._migrated_at: dict[str, float] = {}  # live migration: last move off each instance
        self._t0 = clock()
        self._wake = asyncio.Event()
        # Models whose scale from zero is being decided (a parameter-manager lookup in flight).
        self._waking: set[str] = set()
        # Prefix-affinity routing: block hashes of the prompts routed to each SERVING instance.
        self.prefix_index = PrefixIndex(cfg.prefix_index_blocks)

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

    # ---- registry -----------------------------------------------------------------------
    async def RegisterInstance(self, request, context):
        info = request.instance
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
        if view.state is S.SERVING and view.model and self.ctx is not None:
            # Re-registration after a manager restart (or a LOST comeback): the parameter
            # manager must list what the instance holds again.
            self.ctx.tasks.spawn(self._update_location(view.model, view.instance_id, present=True), name="location")
        self._wake_reconcile()
        return global_manager_pb2.RegisterInstanceResponse(heartbeat_interval_s=self.cfg.heartbeat_interval_s)

    async def Heartbeat(self, request, context):
        iid = request.instance_id
        if iid not in self.table.registry or self.table.registry.get(iid).state is S.LOST:
            return global_manager_pb2.HeartbeatResponse(reregister=True)
        now = self.now_s()
        state = state_from_proto(request.state)
        before_view = self.table.registry.get(iid)
        before = before_view.state
        if iid not in self._actions:
            # While the actuator loads or drains an instance it owns the transitions; a
            # heartbeat sent before the worker heard the command would only move it back.
            self.table.follow(iid, state, request.model_id, request.layers_loaded, request.num_layers)
        # Even while an action owns the transitions: a route must carry the full layer range.
        view = self.table.learn_num_layers(iid, request.model_id, request.num_layers)
        state = view.state
        self.table.registry.heartbeat(sample_from_proto(iid, now, request.load))
        self.monitor.observe(sample_from_proto(iid, now, request.load))
        if before is not state:
            self.emit("instance_state", request.model_id or "-", state.value, f"{before.value}->{state.value}", iid)
            if before is S.SERVING and before_view.model and iid not in self._actions and self.ctx is not None:
                # The worker left SERVING on its own (its engine died, or it drains on SIGTERM):
                # no route goes there from now on (it is no longer SERVING here), and no transfer
                # may pick it as a source. The pool is topped up by the next tick.
                self.ctx.tasks.spawn(self._update_location(before_view.model, iid, present=False), name="location")
            self._wake_reconcile()
        return global_manager_pb2.HeartbeatResponse()

    async def DeregisterInstance(self, request, context):
        iid = request.instance_id
        if iid in self.table.registry:
            self.table.registry.mark_lost(iid)
            self.table.registry.remove(iid)
            self.monitor.forget(iid)
            self.emit("instance_deregistered", "-", "removed", "worker stopping", iid)
            self._wake_reconcile()
        return global_manager_pb2.DeregisterInstanceResponse()

    # ---- execution scheduler ------------------------------------------------------------
    async def Schedule(self, request, context):
        views = self.table.registry.views(model=request.model_id)
        excluded = set(request.exclude_instance_ids)
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
            waking = await self._scale_from_zero(request.model_id, request.request_id)
            views = self.table.registry.views(model=request.model_id)
            SCHEDULED.labels("unavailable").inc()
            states = sorted(f"{v.role.value}:{v.state.value}" for v in views)
            await context.abort(
                grpc.StatusCode.UNAVAILABLE,
                f"no SERVING instance of model {request.model_id!r} "
                f"(instances: {states or 'none'}, excluded: {sorted(excluded)}){waking}",
            )
        pd_pair = len(hops) == 2 and hops[0].role is Role.PREFILL and hops[1].role is Role.DECODE
        if self.cfg.zigzag and ((len(hops) == 1 and hops[0].role is Role.COLOCATED) or pd_pair):
            # ZigZag splits the pool that runs prompts: the colocated one, or the prefill pool
            # (then the route's decode instance takes the whole prompt's KV from the partner).
            pool = Role.PREFILL if pd_pair else Role.COLOCATED
            split = self._zigzag_route(request.model_id, views, excluded, pool)
            if split is not None:
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
        SCHEDULED.labels("pd_pair" if len(hops) == 2 else "one_hop").inc()
        return global_manager_pb2.Route(
            request_id=request.request_id,
            # A pair is [PREFILL, DECODE]; a single hop keeps its instance's role (a prefill- or
            # decode-role instance serving alone while the other pool is gone).
            hops=[self._hop(view) for view in hops],
        )

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

    async def _scale_from_zero(self, model: str, request_id: str) -> str:
        """Scale from zero (Knative's activator, here in the manager): a request for a model the
        parameter manager lists finds no SERVING or LOADING instance, so one IDLE worker starts
        loading it. The caller still answers UNAVAILABLE; the gateway retries with backoff
        within the request's deadline (its `schedule_wait_s`) until the instance serves. At most
        one such load per model: the next request sees it LOADING. Returns a note for the
        UNAVAILABLE details ('' when nothing is loading for it)."""
        if not self.cfg.scale_from_zero or not model or self.ctx is None or not self.cfg.param_manager:
            return ""
        if self._has_capacity(model):
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
        if self._has_capacity(model):  # another request, or top_up, started one meanwhile
            return self._loading_note(model)
        reason = (
            f"scale_from_zero: request {request_id!r} for listed model {model!r} found no SERVING or LOADING "
            f"instance; {len(self._idle_free())} IDLE worker(s) free"
        )
        chosen = self.scale_out(model, 1, Role.COLOCATED, reason)
        if not chosen:
            return ""
        ACTIONS.labels("scale_from_zero", "started").inc()
        self.decision_log.append(f"{self.now_s():.1f},scale_from_zero,{model},{chosen[0]},{reason}")
        self.emit("scale_from_zero", model, "loading", reason, chosen[0])
        return f"; scale_from_zero: {chosen[0]} LOADING, retry"

    def _has_capacity(self, model: str) -> bool:
        return any(v.state in (S.SERVING, S.LOADING) for v in self.table.registry.views(model=model))

    def _loading_note(self, model: str) -> str:
        ids = sorted(v.instance_id for v in self.table.registry.views(model=model) if v.state is S.LOADING)
        return f"; waiting for {', '.join(ids)} LOADING" if ids else ""

    def _idle_free(self) -> list[InstanceView]:
        """IDLE workers no action owns."""
        return [v for v in self.table.registry.views(state=S.IDLE) if v.instance_id not in self._actions]

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
        """ZigZag (ALGORITHMS.md section 3): while every SERVING instance has requests waiting,
        a live LOADING instance (>= 1 layer, under its in-flight cap, layers still arriving; every
        scale-out target, or only chain tails with zigzag_live="tails") runs the request's first
        layers, and the overloaded instance with the fewest used KV blocks takes it over and
        finishes it. None: route as usual.

        Why every target by default: on a chain the tail gets its first layer only after the
        hops before it have forwarded it; measured on bench.autoscale (3 targets, 0.2 Gbit/s
        links) the tail had its first layer 4 s after the decision, when the chain's head was
        already SERVING, so tails alone left no window to serve in."""
        now = self.now_s()
        for iid, (_, grew_s) in list(self._zigzag_progress.items()):
            if iid in self.zigzag_started and now - grew_s > self.cfg.zigzag_stall_s:
                # A stalled load: no more ZigZag work for it (what it holds is relayed as usual).
                del self.zigzag_started[iid]
                with contextlib.suppress(KeyError):
                    ZIGZAG_LAYERS.remove(iid)
                self.emit(
                    "zigzag_stopped",
                    model,
                    "stalled",
                    f"no new layer for {now - grew_s:.1f}s > zigzag_stall_s={self.cfg.zigzag_stall_s}",
                    iid,
                )
        live = {iid: t for iid, t in self.zigzag_started.items() if iid not in excluded}
        if not live:
            return None
        gate = should_zigzag(views, model=model, role=pool, ttft_s=self.cfg.zigzag_ttft_s)
        if not gate.zigzag:
            return None
        views = [v for v in views if v.role is pool]
        inflight = {
            v.instance_id: (v.load.zigzag_running if v.load is not None else 0) + v.routes_since_heartbeat
            for v in views
            if v.instance_id in live
        }
        choice = choose_live_instance(views, model, inflight, now, live)
        if choice is None:
            return None
        new = choice.instance
        pair = choose_zigzag_partner(views, new.instance_id, model, exclude_ids=excluded)
        if pair is None:
            return None
        old = pair.partner
        k, num_layers = new.layers_loaded, old.num_layers
        if not 0 < k < num_layers or not self.table.dataplane.get(new.instance_id, (b"", ""))[0]:
            return None
        self.table.registry.note_routed(new.instance_id)
        self.table.registry.note_routed(old.instance_id)
        SCHEDULED.labels("zigzag").inc()
        ZIGZAG_ROUTES.labels(new.instance_id).inc()
        if self.zigzag_partner.get(new.instance_id) != old.instance_id:
            self.zigzag_partner[new.instance_id] = old.instance_id
            reason = f"{gate.reason}; new: {choice.reason}; partner {old.instance_id}: {pair.reason}"
            self.decision_log.append(f"{now:.1f},zigzag_pair,{new.instance_id},{old.instance_id},{reason}")
            self.emit("zigzag_pair", model, old.instance_id, reason, new.instance_id)
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
                layer_end=num_layers,
                role=role_to_proto(old.role),
            ),
        ]

    def _zigzag_load_progress(self, iid: str, model_id: str, layers: int, num_layers: int) -> None:
        """A load reported `layers` of `num_layers`: a chain tail goes live with its first layer;
        its progress clock restarts whenever the count grows."""
        now = self.now_s()
        before = self._zigzag_progress.get(iid, (0, now))[0]
        if layers > before or iid not in self._zigzag_progress:
            self._zigzag_progress[iid] = (layers, now)
        goes_live = self.cfg.zigzag_live == "all" or iid in self._chain_tails
        if goes_live and iid not in self.zigzag_started and 1 <= layers < num_layers:
            self.zigzag_started[iid] = now
            self.emit(
                "live_scaling",
                model_id,
                f"{layers}/{num_layers}",
                "serves ZigZag requests with the layers it holds"
                + (" (the tail of its transfer chain)" if iid in self._chain_tails else ""),
                iid,
            )
        if iid in self.zigzag_started:
            ZIGZAG_LAYERS.labels(iid).set(layers)

    def _zigzag_done(self, iid: str) -> None:
        """The load ended (SERVING, or failed): the instance is no longer live-loading."""
        self._chain_tails.discard(iid)
        self._zigzag_progress.pop(iid, None)
        self.zigzag_partner.pop(iid, None)
        if self.zigzag_started.pop(iid, None) is not None:
            with contextlib.suppress(KeyError):
                ZIGZAG_LAYERS.remove(iid)

    # ---- admin --------------------------------------------------------------------------
    async def GetCluster(self, request, context):
        now = self.now_s()
        return admin_pb2.ClusterState(
            instances=[self.table.to_proto(v, now) for v in sorted(self.table.registry, key=lambda v: v.instance_id)],
            policy=self.policy_name,
            advisory=self.advisory,
        )

    async def Scale(self, request, context):
        if not request.model_id:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "model_id is required")
        if request.delta == 0:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "delta must be non-zero, got 0")
        try:
            await self._check_model(request.model_id)
        except LookupError as e:
            await context.abort(grpc.StatusCode.NOT_FOUND, str(e))
        try:
            role = role_from_proto(request.role)
        except ValueError as e:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        if request.delta > 0:
            chosen = self.scale_out(request.model_id, request.delta, role, reason="Admin.Scale")
            if len(chosen) < request.delta and not chosen:
                idle = len(self.table.registry.views(state=S.IDLE))
                await context.abort(
                    grpc.StatusCode.RESOURCE_EXHAUSTED,
                    f"asked for {request.delta} more instances of {request.model_id!r}, {idle} IDLE workers free",
                )
        else:
            chosen = self.scale_in(request.model_id, -request.delta, reason="Admin.Scale")
            if not chosen:
                await context.abort(
                    grpc.StatusCode.FAILED_PRECONDITION, f"no SERVING instance of {request.model_id!r} to drain"
                )
        if request.wait:
            await asyncio.gather(*(self._actions[i] for i in chosen if i in self._actions), return_exceptions=True)
        return admin_pb2.ScaleResponse(
            instance_ids=chosen, reason=f"{len(chosen)} instance(s) {'loading' if request.delta > 0 else 'draining'}"
        )

    async def SetPolicy(self, request, context):
        """Switch or retune the policy. The given params replace the current ones (none given
        with no policy named keeps them, e.g. to toggle advisory mode only). Cooldown timers
        carry over: they protect the cluster, whichever rule is in force."""
        name = request.policy or self.policy_name
        if request.params or request.policy:
            params = {k: _param_from_proto(v) for k, v in request.params.items()}
        else:
            params = dict(self.policy_params)
        try:
            policy = self._make_policy(name, params)
        except ValueError as e:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        policy.cooldown = self.policy.cooldown
        self.policy, self.policy_name, self.policy_params = policy, policy.name, params
        if request.HasField("advisory"):
            self.advisory = request.advisory
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

    # ---- actuator -----------------------------------------------------------------------
    async def _check_model(self, model_id: str) -> None:
        if not self.cfg.param_manager:
            return
        async with channel(self.cfg.param_manager) as ch:
            models = await param_manager_pb2_grpc.ParamManagerStub(ch).ListModels(
                admin_pb2.ListModelsRequest(), timeout=5
            )
        known = [m.model_id for m in models.models]
        if model_id not in known:
            raise LookupError(f"unknown model {model_id!r}; registered: {known}")

    def _spawn(self, iid: str, coro) -> None:
        assert self.ctx is not None
        task = self.ctx.tasks.spawn(coro, name=f"action-{iid}")
        self._actions[iid] = task

        def done(t: asyncio.Task[None], iid: str = iid) -> None:
            if self._actions.get(iid) is t:
                del self._actions[iid]

        task.add_done_callback(done)

    def live(self, model_id: str, role: Role | None = None) -> list[str]:
        """Instances of `model_id` that count as capacity: LOADING + SERVING."""
        return [
            v.instance_id
            for v in self.table.registry.views(model=model_id, role=role)
            if v.state in (S.LOADING, S.SERVING)
        ]

    def scale_out(
        self,
        model_id: str,
        n: int,
        role: Role,
        reason: str,
        *,
        exclude: frozenset[str] = frozenset(),
        attempt: int = 0,
        only: Collection[str] | None = None,
    ) -> list[str]:
        """Assign up to n IDLE workers (of `only` when given) to `model_id` as `role`; each loads
        in the background."""
        room = max(0, self.cfg.max_instances - len(self.live(model_id)))
        candidates = [v for v in self.table.registry.views(state=S.IDLE) if only is None or v.instance_id in only]
        idle = choose_idle(candidates, min(n, room), role, {*self._actions, *exclude})
        for v in idle:
            self.table.registry.transition(v.instance_id, S.LOADING, model=model_id, role=role)
            self.emit("scale_out", model_id, "loading", reason, v.instance_id)
        # One multicast plan for the whole batch: chains make n targets cost about one.
        plan = asyncio.ensure_future(self._plan(model_id, [v.instance_id for v in idle])) if idle else None
        for v in idle:
            assert plan is not None
            self._spawn(
                v.instance_id, self._load(v.instance_id, model_id, role, exclude | {v.instance_id}, attempt, plan)
            )
        return [v.instance_id for v in idle]

    def _drop_stale_holders(self, where: param_manager_pb2.LocateResponse) -> None:
        """Keep instances that are not SERVING here out of a plan's sources: the index hears of an
        instance leaving (its engine died, it drains, it went LOST) only when our UpdateLocation
        lands, and a chain from a dropped instance stalls its targets for the whole stall timeout."""

        def stale(holder_id: str, kind: str) -> bool:
            if holder_id in self.table.registry:
                return self.table.registry.get(holder_id).state is not S.SERVING
            return kind == "instance"

        for loc in where.locations:
            kinds = {h.holder_id: h.kind for h in loc.holder_info}
            gone = {h for h in loc.holders if stale(h, kinds.get(h, ""))} | {
                h.holder_id for h in loc.holder_info if stale(h.holder_id, h.kind)
            }
            if not gone:
                continue
            holders = [h for h in loc.holders if h not in gone]
            infos = [h for h in loc.holder_info if h.holder_id not in gone]
            del loc.holders[:]
            loc.holders.extend(holders)
            del loc.holder_info[:]
            loc.holder_info.extend(infos)

    async def _plan(self, model_id: str, targets: list[str]) -> worker_pb2.TransferPlan | None:
        """The chain plan for `targets`; None (each target pulls from the pool) if it cannot be made."""
        if not self.cfg.param_manager or not self.cfg.transfer_plans:
            return None
        try:
            async with channel(self.cfg.param_manager) as ch:
                where = await param_manager_pb2_grpc.ParamManagerStub(ch).Locate(
                    param_manager_pb2.LocateRequest(model_id=model_id), timeout=10
                )
            self._drop_stale_holders(where)
            nodes = []
            for iid in targets:
                dp_address, dp_kind = self.table.dataplane.get(iid, (b"", ""))
                host = self.table.registry.get(iid).host or iid
                nodes.append(Node(iid, host, self.table.addresses[iid], dp_address, dp_kind))
            # Serving traffic by role (prefill sends KV out, decode takes it in), so parameters
            # come from decode instances, then host shards, and off the prefill side's busy links.
            # And links already sending parameters to an earlier scale-out's targets.
            traffic = self._sending.traffic(traffic_from_instances(self.table.registry.views(model=model_id)))
            plan, planned = build_plan(
                nodes,
                where,
                [loc.group for loc in where.locations],
                self.cfg.topology,
                self.cfg.load_timeout_s,
                serving_traffic=traffic,
            )
        except (grpc.aio.AioRpcError, ValueError, KeyError) as e:
            log.warning("transfer_plan_failed", model=model_id, targets=targets, error=repr(e))
            return None
        # The last target of each chain loads last (the lowest bandwidth): it goes live (ZigZag).
        self._chain_tails |= {c.hops[-1] for c in planned.chains if c.hops}
        self._sending.start(planned, targets)
        chains = "; ".join(f"{c.source}->{'->'.join(c.hops)} ({len(c.groups)} groups)" for c in planned.chains)
        self.emit("transfer_plan", model_id, plan.plan_id, f"chains: {chains}")
        return plan

    def scale_in(
        self, model_id: str, n: int, reason: str, role: Role | None = None, *, keep_serving: int = 0
    ) -> list[str]:
        """Drain the n least-loaded SERVING instances of `model_id` (of `role` if given), leaving
        at least `keep_serving` SERVING: capacity still loading cannot take requests yet."""
        chosen: list[str] = []
        for _ in range(n):
            views = [v for v in self.table.registry.views(model=model_id) if v.instance_id not in self._actions]
            serving = [v for v in views if v.state is S.SERVING and (role is None or v.role is role)]
            if len(serving) <= keep_serving:
                break
            victim = pick_scale_in_victim(views, model=model_id, role=role)
            if victim is None:
                break
            self.table.registry.transition(victim.instance_id, S.DRAINING)
            self.emit("scale_in", model_id, "draining", reason, victim.instance_id)
            self._spawn(victim.instance_id, self._drain(victim.instance_id, model_id))
            chosen.append(victim.instance_id)
        return chosen

    async def _load(
        self,
        iid: str,
        model_id: str,
        role: Role,
        tried: frozenset[str],
        attempt: int,
        plan: asyncio.Future[worker_pb2.TransferPlan | None],
    ) -> None:
        address = self.table.addresses[iid]
        started = self.now_s()
        error = ""
        try:
            done = False
            # The role travels with the load: the worker serves as what the manager counts it as.
            request = worker_pb2.LoadParametersRequest(
                model_id=model_id, param_manager_address=self.cfg.param_manager, role=role_to_proto(role)
            )
            transfer_plan = await plan
            if transfer_plan is not None:
                request.plan.CopyFrom(transfer_plan)
            else:
                self._chain_tails.add(iid)  # it pulls from the pool alone: a chain of its own
            async with channel(address) as ch:
                stub = worker_pb2_grpc.WorkerStub(ch)
                call = stub.LoadParameters(request, timeout=self.cfg.load_timeout_s)
                async for p in call:
                    done = done or p.done
                    self.monitor.mark_seen(iid, self.now_s())  # progress proves it is alive
                    if iid in self.table.registry and self.table.registry.get(iid).state is S.LOADING:
                        if p.groups_total > 2:  # embed + L layers + head: the model's size, known now
                            self.table.learn_num_layers(iid, model_id, p.groups_total - 2)
                        view = self.table.registry.get(iid)
                        with contextlib.suppress(ValueError):
                            view = self.table.registry.set_layers_loaded(iid, min(p.layers_loaded, view.num_layers))
                        if not p.done:
                            self._zigzag_load_progress(iid, model_id, view.layers_loaded, view.num_layers)
            if not done:
                error = "LoadParameters ended before the load was done"
        except asyncio.CancelledError:
            raise
        except grpc.aio.AioRpcError as e:
            error = f"{e.code().name}: {e.details()}"
        except Exception as e:
            error = repr(e)
        self.monitor.mark_seen(iid, self.now_s())  # its silence clock restarts after the action
        self._zigzag_done(iid)
        self._sending.finish(iid)
        if not error:
            state = self.table.registry.get(iid).state if iid in self.table.registry else None
            if state is S.LOADING:
                self.table.registry.transition(iid, S.SERVING)
            elif state is not S.SERVING:
                # Written off (deregistered) meanwhile: the worker re-registers in the state it
                # reports, so there is nothing to roll back here.
                self.emit(
                    "load_result",
                    model_id,
                    "orphaned",
                    f"loaded, but the instance is {state.value if state else 'unregistered'} here; "
                    "it re-registers in the state it reports",
                    iid,
                )
                return
        if not error:
            load_s = self.now_s() - started
            await self._update_location(model_id, iid, present=True)
            ACTIONS.labels("load", "ok").inc()
            self.emit("load_result", model_id, "ok", f"load_s={load_s:.3f}", iid)
            if self.cfg.rebalance:
                await self._rebalance(model_id, iid)
            return
        # Roll back this instance: the worker returns itself to IDLE on failure; mirror that.
        ACTIONS.labels("load", "failed").inc()
        self.emit("load_result", model_id, "failed", error, iid)
        self._reset_idle(iid)
        if attempt < self.cfg.load_retries:
            # Another worker, not this one: whatever broke its load may break it again.
            retry = self.scale_out(
                model_id,
                1,
                role,
                f"retry {attempt + 1}/{self.cfg.load_retries} after {iid} failed: {error}",
                exclude=tried,
                attempt=attempt + 1,
            )
            if retry:
                ACTIONS.labels("load", "retried").inc()
                return
        ACTIONS.labels("load", "rolled_back").inc()
        self.emit(
            "scale_out",
            model_id,
            "rolled_back",
            f"load on {iid} failed ({error}); it is IDLE again and no other IDLE worker is left to retry on"
            if attempt < self.cfg.load_retries
            else f"load on {iid} failed ({error}); it is IDLE again after {attempt} retries",
            iid,
        )

    async def _rebalance(self, model_id: str, iid: str) -> None:
        """`iid` just became SERVING: busier instances of its pool release queued requests above
        an even share (`plan_rebalance`); the gateway re-routes each, and routing sends them to
        the least loaded instance, the new one."""
        for source, n in plan_rebalance(self.table.registry.views(model=model_id), iid):
            moved = await self._release(source, n, f"scale_out: {iid} is SERVING", running=False)
            if moved is None:
                continue
            self.emit(
                "rebalance",
                model_id,
                "moved" if moved else "none",
                f"scale_out: {iid} is SERVING; {source} released {moved} of the {n} queued requests above an even"
                " share",
                source,
            )

    async def _drain(self, iid: str, model_id: str) -> None:
        address = self.table.addresses[iid]
        error = ""
        resp = worker_pb2.DrainResponse()
        try:
            async with channel(address) as ch:
                stub = worker_pb2_grpc.WorkerStub(ch)
                resp = await stub.Drain(
                    worker_pb2.DrainRequest(timeout_s=self.cfg.drain_timeout_s), timeout=self.cfg.drain_timeout_s + 10
                )
                # Out of the location index before its weights go, so no transfer picks it as a source.
                await self._update_location(model_id, iid, present=False)
                await self._unload(stub)
        except asyncio.CancelledError:
            raise
        except grpc.aio.AioRpcError as e:
            error = f"{e.code().name}: {e.details()}"
        except Exception as e:
            error = repr(e)
        self.monitor.mark_seen(iid, self.now_s())
        if error:
            # From here the worker's own heartbeats decide where it is (SERVING again, or LOST).
            ACTIONS.labels("drain", "failed").inc()
            self.emit("drain_result", model_id, "failed", f"{error}; following the worker's reports", iid)
            return
        if iid in self.table.registry and self.table.registry.get(iid).state is S.DRAINING:
            self.table.registry.transition(iid, S.IDLE)
        ACTIONS.labels("drain", "ok").inc()
        self.emit("drain_result", model_id, "idle", f"finished={resp.finished} aborted={resp.aborted}", iid)
        self._wake_reconcile()

    async def _unload(self, stub: worker_pb2_grpc.WorkerStub) -> None:
        # Drain returns once the requests it aborted have unwound, so one call suffices; a
        # refusal (still in flight) fails the drain and the worker's reports take over.
        await stub.Unload(worker_pb2.UnloadRequest(), timeout=30)

    def _reset_idle(self, iid: str) -> None:
        if iid not in self.table.registry:
            return
        if self.table.registry.get(iid).state is S.LOADING:
            self.table.registry.transition(iid, S.IDLE)

    async def _update_location(self, model_id: str, iid: str, present: bool) -> None:
        if not self.cfg.param_manager:
            return
        dp_address, dp_kind = self.table.dataplane.get(iid, (b"", ""))
        host = self.table.registry.get(iid).host if iid in self.table.registry else ""
        request = param_manager_pb2.UpdateLocationRequest(
            model_id=model_id,
            holder=iid,
            present=present,
            holder_address=self.table.addresses.get(iid, ""),
            dataplane_address=dp_address,
            dataplane_kind=dp_kind,
            host=host,
        )
        for attempt in range(LOCATION_RETRIES):
            try:
                async with channel(self.cfg.param_manager) as ch:
                    await param_manager_pb2_grpc.ParamManagerStub(ch).UpdateLocation(request, timeout=5)
                return
            except grpc.aio.AioRpcError as e:
                if attempt + 1 == LOCATION_RETRIES or e.code() not in (
                    grpc.StatusCode.UNAVAILABLE,
                    grpc.StatusCode.DEADLINE_EXCEEDED,
                ):
                    ACTIONS.labels("location", "failed").inc()
                    log.warning("location_update_failed", model=model_id, instance_id=iid, code=e.code().name)
                    self.emit("location", model_id, "failed", f"present={present}: {e.code().name}: {e.details()}", iid)
                    return
            await asyncio.sleep(0.2 * 2**attempt)

    # ---- control loop -------------------------------------------------------------------
    def _wake_reconcile(self) -> None:
        if self.ctx is not None:
            self._wake.set()

    async def control_loop(self) -> None:
        """Tick every `tick_s` of real time (or when woken). A simulator calls `tick()` itself."""
        while True:
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self._wake.wait(), self.cfg.tick_s)
            self._wake.clear()
            self.tick()

    def tick(self) -> None:
        now = self.now_s()
        for iid in self.monitor.lost(now):
            if iid in self._actions:
                # A load or drain RPC is in flight: its own deadline judges the worker (a busy
                # worker may miss heartbeats while it unpacks parameters).
                continue
            if iid in self.table.registry and self.table.registry.get(iid).state is not S.LOST:
                model = self.table.registry.get(iid).model
                self.table.registry.mark_lost(iid)
                self.emit("instance_lost", "-", "LOST", f"no heartbeat for {self.cfg.lost_after_s}s", iid)
                if model and self.ctx is not None:
                    self.ctx.tasks.spawn(self._update_location(model, iid, present=False), name="location")
        for state in S:
            INSTANCES.labels(state.value).set(len(self.table.registry.views(state=state)))
        # An instance that left SERVING takes its cached prefixes with it (between two routes too).
        self.prefix_index.sync(self.table.registry)
        model = self.cfg.default_model
        if model:
            self.top_up(model)
        if self.cfg.autoscale and model:
            self.autoscale(now, model)
        if self.cfg.live_migration and model and self.ctx is not None:
            self.migrate_running(now, model)

    def migrate_running(self, now: float, model: str) -> None:
        """Live migration: instances over their KV or TBT target release running requests, which
        the gateway resumes elsewhere with their KV (`plan_live_migration`)."""
        plan = plan_live_migration(
            self.table.registry.views(model=model),
            model,
            kv_high=self.cfg.migration_kv_high,
            tbt_slo_s=self.cfg.migration_tbt_slo_s,
        )
        for source, n, why in plan:
            if now - self._migrated_at.get(source, -math.inf) < self.cfg.migration_cooldown_s:
                continue
            if source in self._actions or source not in self.table.addresses:
                continue
            self._migrated_at[source] = now
            assert self.ctx is not None
            self.ctx.tasks.spawn(self._release_running(model, source, n, why), name=f"migrate-{source}")

    async def _release(self, source: str, n: int, reason: str, *, running: bool) -> int | None:
        """Ask `source` to let up to `n` requests go (queued ones, or with `running` decoding ones
        with their KV) for the gateway to re-route; how many it released, None if it could not
        be asked. Counted in MOVED by cause."""
        address = self.table.addresses.get(source)
        if address is None:
            return None
        rpc = "ReleaseRunning" if running else "ReleaseWaiting"
        request_type = worker_pb2.ReleaseRunningRequest if running else worker_pb2.ReleaseWaitingRequest
        try:
            async with channel(address) as ch:
                resp = await getattr(worker_pb2_grpc.WorkerStub(ch), rpc)(
                    request_type(max_requests=n, reason=reason), timeout=RELEASE_TIMEOUT_S
                )
        except grpc.aio.AioRpcError as e:
            log.warning("release_failed", rpc=rpc, instance_id=source, code=e.code().name, details=e.details())
            return None
        moved = len(resp.request_ids)
        MOVED.labels("live_migration" if running else "scale_out").inc(moved)
        return moved

    async def _release_running(self, model: str, source: str, n: int, why: str) -> None:
        moved = await self._release(source, n, f"live migration: {why}", running=True)
        if moved is None:
            return
        self.emit(
            "live_migration",
            model,
            "moved" if moved else "none",
            f"{why}: released {moved} of {n} running requests with their KV",
            source,
        )

    def top_up(self, model: str) -> None:
        """Bring each pool of `model` (colocated, or prefill and decode) up to its floor from the
        IDLE pool (`assign_idle`: workers started for a role fill that pool; scarce others form
        a P/D pair first)."""
        floors = {role: n for role, n in self.cfg.pool_floors().items() if n > 0}
        if not floors:
            return
        live = {role: len(self.live(model, role)) for role in floors}
        if all(live[role] >= n for role, n in floors.items()):
            return
        idle = [v for v in self.table.registry.views(state=S.IDLE) if v.instance_id not in self._actions]
        for role, views in assign_idle(floors, live, idle).items():
            reason = f"{self.cfg.floor_name(role)}={floors[role]}"
            self.scale_out(model, len(views), role, reason, only={v.instance_id for v in views})

    def autoscale(self, now: float, model: str) -> ScaleDecision:
        """One policy decision for `model`: reported (see the module docstring) and acted on."""
        # The time the decision costs is measured on the wall clock, whatever `clock` says.
        started = time.perf_counter()
        # A configured split is split even before its first instance serves; otherwise the
        # monitor tells from the instances' roles.
        snapshot = self.monitor.snapshot(
            now,
            self.table.registry.views(model=model),
            model=model,
            disaggregated=True if self.cfg.disaggregated and model == self.cfg.default_model else None,
        )
        decision: ScaleDecision = self.policy.decide(now, snapshot)
        DECIDE_SECONDS.observe(time.perf_counter() - started)
        self.last_decision = decision
        DECISIONS.labels(decision.policy, decision.action).inc()
        roles = (Role.PREFILL, Role.DECODE) if not decision.is_colocated else (Role.COLOCATED,)
        for role in roles:
            before = (
                decision.instances_from
                if role is Role.COLOCATED
                else (decision.prefill_from if role is Role.PREFILL else decision.decode_from)
            )
            CURRENT.labels(model, role.value).set(before or 0)
            DESIRED.labels(model, role.value).set((before or 0) + decision.delta(role))
        for name, value in decision.extra.items():
            SIGNALS.labels(model, name).set(value)
        reported = self.throttle.should_report(decision)
        if reported:
            if self.advisory and decision.action != "no_change":
                decision = dataclasses.replace(decision, reason=f"{decision.reason}; ADVISORY: not acted on")
            line = decision.to_log_line()
            self.decision_log.append(line)
            log.info("autoscaling_decision", line=line, model=model, advisory=self.advisory)
            self.emit("autoscaling_decision", decision.action, decision.target_str(), decision.reason, time_s=now)
        if self.advisory or decision.action == "no_change":
            return decision
        for role in roles:
            self._act(model, role, decision, reported)
        return decision

    def _act(self, model: str, role: Role, decision: ScaleDecision, reported: bool) -> None:
        """Carry out one pool's part of a decision. Shortfalls (a manager bound, no IDLE worker)
        are told when the decision is, so a change that cannot happen is not told every tick."""
        current = len(self.live(model, role))
        low = self.cfg.pool_floors().get(role, 0) if model == self.cfg.default_model else 0
        delta, note = bounded_delta(
            current,
            current + decision.delta(role),
            low=low,
            high=self.cfg.max_instances,
            low_name=self.cfg.floor_name(role),
        )
        wanted = current + delta
        if note and reported:
            self.emit("autoscaling_bound", model, role.value, note)
        if delta > 0:
            chosen = self.scale_out(model, delta, role, reason=decision.reason)
            if len(chosen) < delta and reported:
                ACTIONS.labels("load", "short").inc()
                self.emit(
                    "scale_out",
                    model,
                    "partial",
                    f"wanted {delta} more {role.value} instances, assigned {len(chosen)}: no more IDLE workers",
                )
        elif delta < 0:
            chosen = self.scale_in(
                model, -delta, reason=decision.reason, role=role, keep_serving=1 if wanted > 0 else 0
            )
            if len(chosen) < -delta and reported:
                self.emit(
                    "scale_in",
                    model,
                    "partial",
                    f"wanted {-delta} fewer {role.value} instances, draining {len(chosen)}: "
                    "the rest are loading or busy with another action",
                )


class GlobalManagerService:
    name = "blitzmesh.v1.GlobalManager"

    def __init__(self, cfg: GlobalManagerConfig, *, clock: Callable[[], float] = time.monotonic) -> None:
        self.servicer = GlobalManagerServicer(cfg, clock=clock)

    def register(self, server: grpc.aio.Server) -> list[str]:
        global_manager_pb2_grpc.add_GlobalManagerServicer_to_server(self.servicer, server)
        return [self.name]

    async def start(self, ctx: ServeContext) -> None:
        self.servicer.ctx = ctx
        ctx.tasks.spawn(self.servicer.control_loop(), name="control-loop")
        await ctx.set_serving()

    async def stop(self) -> None:
        return None
