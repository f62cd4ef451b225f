"""Global manager: instance registry, heartbeats, the execution scheduler (routing), and the
actuator that turns scaling decisions into worker and parameter-manager calls.

The decisions themselves come from the pure core (services/global_manager/core); this module
only adapts protobuf, owns the clock and performs the I/O.
"""

from __future__ import annotations

import asyncio
import contextlib
import time

import grpc
import structlog
from prometheus_client import Counter, Gauge

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
from services.global_manager.core.load_monitor import LoadMonitor
from services.global_manager.core.policies import make_policy
from services.global_manager.core.router import choose_instance, pick_scale_in_victim
from services.global_manager.core.types import InstanceState, Role, ScaleDecision
from services.global_manager.registry import ROLE_FROM_PROTO, STATE_FROM_PROTO, InstanceTable, sample_from_proto

log = structlog.get_logger(__name__)

S = InstanceState
INSTANCES = Gauge("blitzmesh_gm_instances", "Instances by state", ["state"])
SCHEDULED = Counter("blitzmesh_gm_schedule_total", "Schedule calls by outcome", ["outcome"])
DECISIONS = Counter("blitzmesh_gm_decisions_total", "Autoscaling decisions by action", ["action"])


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
    def __init__(self, cfg: GlobalManagerConfig) -> None:
        self.cfg = cfg
        self.table = InstanceTable()
        self.monitor = LoadMonitor(window_s=cfg.window_s, lost_after_s=cfg.lost_after_s)
        self.policy_name = cfg.policy
        self.policy_params = dict(cfg.policy_params)
        self.policy = make_policy(cfg.policy, cfg.policy_params)
        self.advisory = cfg.advisory
        self.events = EventBus()
        self.ctx: ServeContext | None = None
        self._actions: dict[str, asyncio.Task[None]] = {}  # instance id -> load/drain in progress
        self._t0 = time.monotonic()
        self._wake = asyncio.Event()

    def now_s(self) -> float:
        return time.monotonic() - self._t0

    def emit(self, action: str, target: str, status: str, reason: str, instance_id: str = "") -> None:
        ev = admin_pb2.ClusterEvent(
            time_s=self.now_s(), action=action, target=target, status=status, reason=reason, instance_id=instance_id
        )
        log.info("cluster_event", action=action, target=target, status=status, reason=reason, instance_id=instance_id)
        self.events.publish(ev)

    # ---- registry -----------------------------------------------------------------------
    async def RegisterInstance(self, request, context):  # noqa: N802 (gRPC names)
        info = request.instance
        if not info.instance_id or not info.address:
            await context.abort(
                grpc.StatusCode.INVALID_ARGUMENT,
                f"instance_id and address are required, got {info.instance_id!r}, {info.address!r}",
            )
        view = self.table.upsert(info, self.now_s())
        self.monitor.mark_seen(info.instance_id, self.now_s())
        self.emit("instance_registered", view.model or "-", view.state.value, f"address={info.address}", view.instance_id)
        self._wake_reconcile()
        return global_manager_pb2.RegisterInstanceResponse(heartbeat_interval_s=self.cfg.heartbeat_interval_s)

    async def Heartbeat(self, request, context):  # noqa: N802
        iid = request.instance_id
        if iid not in self.table.registry or self.table.registry.get(iid).state is S.LOST:
            return global_manager_pb2.HeartbeatResponse(reregister=True)
        now = self.now_s()
        state = STATE_FROM_PROTO.get(request.state, S.IDLE)
        before = self.table.registry.get(iid).state
        if iid not in self._actions:
            # While the actuator loads or drains an instance it owns the transitions; a
            # heartbeat sent before the worker heard the command would only move it back.
            self.table.follow(iid, state, request.model_id, request.layers_loaded, request.num_layers)
        state = self.table.registry.get(iid).state
        self.table.registry.heartbeat(sample_from_proto(iid, now, request.load))
        self.monitor.observe(sample_from_proto(iid, now, request.load))
        if before is not state:
            self.emit("instance_state", request.model_id or "-", state.value, f"{before.value}->{state.value}", iid)
            self._wake_reconcile()
        return global_manager_pb2.HeartbeatResponse()

    async def DeregisterInstance(self, request, context):  # noqa: N802
        iid = request.instance_id
        if iid in self.table.registry:
            self.table.registry.mark_lost(iid)
            self.table.registry.remove(iid)
            self.monitor.forget(iid)
            self.emit("instance_deregistered", "-", "removed", "worker stopping", iid)
            self._wake_reconcile()
        return global_manager_pb2.DeregisterInstanceResponse()

    # ---- execution scheduler ------------------------------------------------------------
    async def Schedule(self, request, context):  # noqa: N802
        views = self.table.registry.views(model=request.model_id)
        chosen = choose_instance(views, exclude_ids=set(request.exclude_instance_ids), model=request.model_id)
        if chosen is None:
            SCHEDULED.labels("unavailable").inc()
            states = sorted(v.state.value for v in views)
            await context.abort(
                grpc.StatusCode.UNAVAILABLE,
                f"no SERVING instance of model {request.model_id!r} "
                f"(instances: {states or 'none'}, excluded: {list(request.exclude_instance_ids)})",
            )
        assert chosen is not None
        SCHEDULED.labels("ok").inc()
        return global_manager_pb2.Route(
            request_id=request.request_id,
            hops=[
                global_manager_pb2.RouteHop(
                    instance_id=chosen.instance_id,
                    address=self.table.addresses[chosen.instance_id],
                    layer_start=0,
                    layer_end=chosen.num_layers,
                )
            ],
        )

    # ---- admin --------------------------------------------------------------------------
    async def GetCluster(self, request, context):  # noqa: N802
        now = self.now_s()
        return admin_pb2.ClusterState(
            instances=[self.table.to_proto(v, now) for v in sorted(self.table.registry, key=lambda v: v.instance_id)],
            policy=self.policy_name,
            advisory=self.advisory,
        )

    async def Scale(self, request, context):  # noqa: N802
        if not request.model_id:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "model_id is required")
        if request.delta == 0:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "delta must be non-zero, got 0")
        try:
            await self._check_model(request.model_id)
        except LookupError as e:
            await context.abort(grpc.StatusCode.NOT_FOUND, str(e))
        role = ROLE_FROM_PROTO[request.role]
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
        return admin_pb2.ScaleResponse(instance_ids=chosen, reason=f"{len(chosen)} instance(s) {'loading' if request.delta > 0 else 'draining'}")

    async def SetPolicy(self, request, context):  # noqa: N802
        name = request.policy or self.policy_name
        params = dict(request.params) if request.params or request.policy else self.policy_params
        try:
            policy = make_policy(name, params)
        except ValueError as e:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        self.policy, self.policy_name, self.policy_params = policy, name, params
        if request.HasField("advisory"):
            self.advisory = request.advisory
        self.emit("policy", name, "set", f"params={params} advisory={self.advisory}")
        return admin_pb2.SetPolicyResponse(policy=name, params=params, advisory=self.advisory)

    async def WatchEvents(self, request, context):  # noqa: N802
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
        task.add_done_callback(lambda _t, iid=iid: self._actions.pop(iid, None))

    def scale_out(self, model_id: str, n: int, role: Role, reason: str) -> list[str]:
        """Assign up to n IDLE workers to `model_id`; each loads in the background."""
        live = [v for v in self.table.registry.views(model=model_id) if v.state in (S.LOADING, S.SERVING)]
        room = max(0, self.cfg.max_instances - len(live))
        idle = sorted(
            (v for v in self.table.registry.views(state=S.IDLE) if v.instance_id not in self._actions),
            key=lambda v: v.instance_id,
        )[: min(n, room)]
        for v in idle:
            self.table.registry.transition(v.instance_id, S.LOADING, model=model_id, role=role)
            self.emit("scale_out", model_id, "loading", reason, v.instance_id)
            self._spawn(v.instance_id, self._load(v.instance_id, model_id, role))
        return [v.instance_id for v in idle]

    def scale_in(self, model_id: str, n: int, reason: str) -> list[str]:
        chosen: list[str] = []
        for _ in range(n):
            views = [v for v in self.table.registry.views(model=model_id) if v.instance_id not in self._actions]
            victim = pick_scale_in_victim(views, model=model_id)
            if victim is None:
                break
            self.table.registry.transition(victim.instance_id, S.DRAINING)
            self.emit("scale_in", model_id, "draining", reason, victim.instance_id)
            self._spawn(victim.instance_id, self._drain(victim.instance_id, model_id))
            chosen.append(victim.instance_id)
        return chosen

    async def _load(self, iid: str, model_id: str, role: Role) -> None:
        address = self.table.addresses[iid]
        started = time.perf_counter()
        try:
            async with channel(address) as ch:
                stub = worker_pb2_grpc.WorkerStub(ch)
                call = stub.LoadParameters(
                    worker_pb2.LoadParametersRequest(model_id=model_id, param_manager_address=self.cfg.param_manager),
                    timeout=self.cfg.load_timeout_s,
                )
                async for p in call:
                    if iid in self.table.registry and self.table.registry.get(iid).state is S.LOADING:
                        with contextlib.suppress(ValueError):
                            self.table.registry.set_layers_loaded(iid, min(p.layers_loaded, self.table.registry.get(iid).num_layers))
            view = self.table.registry.get(iid)
            if view.state is S.LOADING:
                self.table.registry.transition(iid, S.SERVING)
            self.emit("load_result", model_id, "ok", f"load_s={time.perf_counter() - started:.3f}", iid)
            await self._update_location(model_id, iid, present=True)
        except grpc.aio.AioRpcError as e:
            # Roll back: the worker returns itself to IDLE on failure; mirror that here.
            self.emit("load_result", model_id, "failed", f"{e.code().name}: {e.details()}", iid)
            self._reset_idle(iid)
        except asyncio.CancelledError:
            raise

    async def _drain(self, iid: str, model_id: str) -> None:
        address = self.table.addresses[iid]
        try:
            async with channel(address) as ch:
                stub = worker_pb2_grpc.WorkerStub(ch)
                resp = await stub.Drain(
                    worker_pb2.DrainRequest(timeout_s=self.cfg.drain_timeout_s), timeout=self.cfg.drain_timeout_s + 10
                )
                await stub.Unload(worker_pb2.UnloadRequest(), timeout=30)
            await self._update_location(model_id, iid, present=False)
            if iid in self.table.registry and self.table.registry.get(iid).state is S.DRAINING:
                self.table.registry.transition(iid, S.IDLE)
            self.emit("drain_result", model_id, "idle", f"finished={resp.finished} aborted={resp.aborted}", iid)
        except grpc.aio.AioRpcError as e:
            self.emit("drain_result", model_id, "failed", f"{e.code().name}: {e.details()}", iid)

    def _reset_idle(self, iid: str) -> None:
        if iid not in self.table.registry:
            return
        if self.table.registry.get(iid).state is S.LOADING:
            self.table.registry.transition(iid, S.IDLE)

    async def _update_location(self, model_id: str, iid: str, present: bool) -> None:
        if not self.cfg.param_manager:
            return
        try:
            async with channel(self.cfg.param_manager) as ch:
                await param_manager_pb2_grpc.ParamManagerStub(ch).UpdateLocation(
                    param_manager_pb2.UpdateLocationRequest(
                        model_id=model_id, holder=iid, present=present, holder_address=self.table.addresses.get(iid, "")
                    ),
                    timeout=5,
                )
        except grpc.aio.AioRpcError as e:
            log.warning("location_update_failed", model=model_id, instance_id=iid, code=e.code().name)

    # ---- control loop -------------------------------------------------------------------
    def _wake_reconcile(self) -> None:
        if self.ctx is not None:
            self._wake.set()

    async def control_loop(self) -> None:
        while True:
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self._wake.wait(), self.cfg.tick_s)
            self._wake.clear()
            self.tick()

    def tick(self) -> None:
        now = self.now_s()
        for iid in self.monitor.lost(now):
            if iid in self.table.registry and self.table.registry.get(iid).state is not S.LOST:
                self.table.registry.mark_lost(iid)
                self.emit("instance_lost", "-", "LOST", f"no heartbeat for {self.cfg.lost_after_s}s", iid)
        for state in S:
            INSTANCES.labels(state.value).set(len(self.table.registry.views(state=state)))
        model = self.cfg.default_model
        if model and self.cfg.min_instances:
            live = [v for v in self.table.registry.views(model=model) if v.state in (S.LOADING, S.SERVING)]
            missing = self.cfg.min_instances - len(live)
            if missing > 0 and self.table.registry.views(state=S.IDLE):
                self.scale_out(model, missing, Role.COLOCATED, reason=f"min_instances={self.cfg.min_instances}")
        if self.cfg.autoscale and model:
            self.autoscale(now, model)

    def autoscale(self, now: float, model: str) -> None:
        views = self.table.registry.views(model=model)
        decision: ScaleDecision = self.policy.decide(now, self.monitor.snapshot(now, views, model=model))
        DECISIONS.labels(decision.action).inc()
        if decision.action == "no_change":
            return
        status = "advisory" if self.advisory else "acting"
        log.info("autoscaling_decision", line=decision.to_log_line(), status=status)
        self.emit("autoscaling_decision", decision.target_str(), status, decision.reason)
        if self.advisory or decision.instances_to is None or decision.instances_from is None:
            return
        delta = decision.instances_to - decision.instances_from
        if delta > 0:
            self.scale_out(model, delta, Role.COLOCATED, reason=decision.reason)
        elif delta < 0:
            self.scale_in(model, -delta, reason=decision.reason)


class GlobalManagerService:
    name = "blitzmesh.v1.GlobalManager"

    def __init__(self, cfg: GlobalManagerConfig) -> None:
        self.servicer = GlobalManagerServicer(cfg)

    def register(self, server: grpc.aio.Server) -> list[str]:
        global_manager_pb2_grpc.add_GlobalManagerServicer_to_server(self.servicer, server)
        return [self.name]

    async def start(self, ctx: ServeContext) -> None:
        self.servicer.ctx = ctx
        ctx.tasks.spawn(self.servicer.control_loop(), name="control-loop")
        await ctx.set_serving()

    async def stop(self) -> None:
        return None
