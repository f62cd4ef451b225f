"""The gRPC actuator: carries out the reconcile core's actions on workers and the parameter
manager, over long-lived channels (one per address, reused by every call, closed when its
instance leaves or the manager stops).

Guarantees: a load or drain runs as one owned task per instance (`busy` until its outcome and
the follow-ups the sink answers with are done); a batch of loads shares one multicast transfer
plan; action tasks never raise into the task group: a failure is an outcome (an event), not a
crashed manager.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Collection, Coroutine, Sequence
from typing import Any

import grpc
import structlog

from blitzmesh.v1 import admin_pb2, param_manager_pb2, param_manager_pb2_grpc, worker_pb2, worker_pb2_grpc
from services.common import roles
from services.common.grpc_util import channel
from services.global_manager.config import GlobalManagerConfig
from services.global_manager.convert import role_to_proto, state_from_proto
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
from services.global_manager.core.actuator import ActionSink
from services.global_manager.core.multicast import SendingLinks, traffic_from_instances
from services.global_manager.core.types import InstanceState
from services.global_manager.instance_table import InstanceTable
from services.global_manager.transfer import Node, build_plan
from services.model_format.groups import live_load_order

log = structlog.get_logger(__name__)

RELEASE_TIMEOUT_S = 5.0
LOCATION_RETRIES = 3

Spawn = Callable[[Coroutine[Any, Any, Any], str], "asyncio.Task[Any]"]


class GrpcActuator:
    """`Actuator` over gRPC. `bind(spawn)` (the service's task group) makes it ready."""

    def __init__(self, cfg: GlobalManagerConfig, table: InstanceTable, sink: ActionSink) -> None:
        self.cfg = cfg
        self.table = table
        self.sink = sink
        self._spawn_task: Spawn | None = None
        self._tasks: dict[str, asyncio.Task[None]] = {}  # instance id -> its load or drain
        self._channels: dict[str, grpc.aio.Channel] = {}  # address -> channel
        self._leaving: set[str] = set()  # instances gone: close their channel once idle
        # Chain senders of loads still in flight: the next plan keeps off their links.
        self._sending = SendingLinks()

    @property
    def ready(self) -> bool:
        return self._spawn_task is not None

    def bind(self, spawn: Spawn) -> None:
        self._spawn_task = spawn

    def busy(self) -> frozenset[str]:
        return frozenset(self._tasks)

    def sending(self) -> frozenset[str]:
        return self._sending.senders

    async def wait(self, instance_ids: Collection[str]) -> None:
        await asyncio.gather(*(self._tasks[i] for i in instance_ids if i in self._tasks), return_exceptions=True)

    async def aclose(self) -> None:
        channels, self._channels = list(self._channels.values()), {}
        for ch in channels:
            await ch.close()

    # ---- channels -------------------------------------------------------------------------
    def _channel(self, address: str, peer: str = roles.WORKER) -> grpc.aio.Channel:
        ch = self._channels.get(address)
        if ch is None:
            ch = self._channels[address] = channel(address, peer)
        return ch

    def forget(self, instance_id: str) -> None:
        """`instance_id` left (deregistered, lost, or re-registered elsewhere): its channel is
        closed, after the load or drain it runs, if any."""
        if instance_id in self._tasks:
            self._leaving.add(instance_id)
        else:
            self._close(self.table.addresses.get(instance_id, ""))

    def _close(self, address: str) -> None:
        in_use = {self.table.addresses.get(i) for i in self._tasks}
        ch = self._channels.get(address)
        if ch is None or address in in_use or address == self.cfg.param_manager:
            return
        del self._channels[address]
        self._spawn(ch.close(), "close-channel")

    def _worker(self, iid: str) -> worker_pb2_grpc.WorkerStub:
        return worker_pb2_grpc.WorkerStub(self._channel(self.table.addresses[iid]))

    def _pm(self) -> param_manager_pb2_grpc.ParamManagerStub:
        return param_manager_pb2_grpc.ParamManagerStub(self._channel(self.cfg.param_manager, roles.PARAM_MANAGER))

    # ---- execution ------------------------------------------------------------------------
    def _spawn(self, coro: Coroutine[Any, Any, Any], name: str) -> asyncio.Task[Any]:
        assert self._spawn_task is not None, "GrpcActuator.bind() first"
        return self._spawn_task(coro, name)

    def _own(self, iid: str, coro: Coroutine[Any, Any, None]) -> None:
        task = self._spawn(coro, f"action-{iid}")
        self._tasks[iid] = task

        def done(t: asyncio.Task[None], iid: str = iid) -> None:
            if self._tasks.get(iid) is t:
                del self._tasks[iid]
            if iid in self._leaving and iid not in self._tasks:
                self._leaving.discard(iid)
                self._close(self.table.addresses.get(iid, ""))

        task.add_done_callback(done)

    def execute(self, actions: Sequence[Action]) -> None:
        for action in actions:
            if isinstance(action, (Report, Count)):
                self.sink.report(action)
            elif isinstance(action, LoadInstances):
                # One multicast plan for the whole batch: chains make n targets cost about one.
                plan = asyncio.ensure_future(self._plan(action.model, list(action.instance_ids)))
                for iid in action.instance_ids:
                    self._own(iid, self._load(action, iid, plan))
            elif isinstance(action, DrainInstance):
                self._own(action.instance_id, self._drain(action))
            elif isinstance(action, ResumeInstance):
                # Not owned: the drain it takes back owns the instance until it answers.
                self._spawn(self._resume(action), f"resume-{action.instance_id}")
            elif isinstance(action, UpdateLocation):
                self._spawn(self._update_location(action), "location")
            elif isinstance(action, MigrateRequests):
                self._spawn(self._release(action), f"migrate-{action.source}")
            else:  # pragma: no cover - the union is closed
                raise TypeError(f"unknown action {action!r}")

    async def _follow_up(self, actions: Sequence[Action]) -> None:
        """An outcome's follow-ups, in order, inside the action that led to them: location
        updates and releases are awaited; new loads and drains start their own tasks."""
        for action in actions:
            if isinstance(action, UpdateLocation):
                await self._update_location(action)
            elif isinstance(action, MigrateRequests):
                await self._release(action)
            else:
                self.execute([action])

    async def probe(self, instance_id: str, timeout_s: float) -> str:
        """The state `instance_id` reports ("SERVING", "IDLE", ...: its InstanceState value),
        "dead" when nothing answers on its address (refused), "silent" when no answer came."""
        address = self.table.addresses.get(instance_id)
        if not address:
            return "dead"
        try:
            info = await self._worker(instance_id).GetStatus(worker_pb2.GetStatusRequest(), timeout=timeout_s)
        except grpc.aio.AioRpcError as e:
            return "dead" if e.code() == grpc.StatusCode.UNAVAILABLE else "silent"
        return state_from_proto(info.state).value

    async def list_models(self) -> list[str] | None:
        if not self.cfg.param_manager:
            return None
        models = await self._pm().ListModels(admin_pb2.ListModelsRequest(), timeout=5)
        return [m.model_id for m in models.models]

    # ---- loads ----------------------------------------------------------------------------
    def _drop_stale_holders(self, where: param_manager_pb2.LocateResponse) -> None:
        """Keep instances that are not SERVING here, or are suspect (a gateway reported them
        failed), out of a plan's sources: the index hears of an instance leaving (its engine
        died, it drains, it went LOST) only when our UpdateLocation lands, and a chain from a
        dropped instance stalls its targets for the whole stall timeout."""
        registry = self.table.registry

        def stale(holder_id: str, kind: str) -> bool:
            if holder_id in self.table.suspects:
                return True
            if holder_id in registry:
                return registry.get(holder_id).state is not InstanceState.SERVING
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
            where = await self._pm().Locate(param_manager_pb2.LocateRequest(model_id=model_id), timeout=10)
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
                # Layers first, the embedding after: a ZigZag instance goes live with its first layer.
                live_load_order(loc.group for loc in where.locations),
                self.cfg.topology,
                self.cfg.load_timeout_s,
                serving_traffic=traffic,
            )
        except (grpc.aio.AioRpcError, ValueError, KeyError) as e:
            log.warning("transfer_plan_failed", model=model_id, targets=targets, error=repr(e))
            return None
        # The last target of each chain loads last (the lowest bandwidth): it goes live (ZigZag).
        self.sink.chain_tails({c.hops[-1] for c in planned.chains if c.hops})
        # The instances upstream of each target: should one fail, the target is doomed (no
        # capacity to count on, though its load falls back to the host caches).
        upstreams: dict[str, set[str]] = {}
        for c in planned.chains:
            for i, hop in enumerate(c.hops):
                before = (c.source, *c.hops[:i])
                upstreams.setdefault(hop, set()).update(n for n in before if n in self.table.registry)
        self.sink.load_upstreams({t: frozenset(u) for t, u in upstreams.items()})
        self._sending.start(planned, targets)
        chains = "; ".join(f"{c.source}->{'->'.join(c.hops)} ({len(c.groups)} groups)" for c in planned.chains)
        self.sink.report(Report("transfer_plan", model_id, plan.plan_id, f"chains: {chains}"))
        return plan

    async def _load(self, load: LoadInstances, iid: str, plan: asyncio.Future[worker_pb2.TransferPlan | None]) -> None:
        error = ""
        try:
            done = False
            # The role travels with the load: the worker serves as what the manager counts it as.
            request = worker_pb2.LoadParametersRequest(
                model_id=load.model,
                param_manager_address=self.cfg.param_manager,
                role=role_to_proto(load.role),
                instance_id=iid,
            )
            transfer_plan = await plan
            if transfer_plan is not None:
                request.plan.CopyFrom(transfer_plan)
            else:
                self.sink.chain_tails({iid})  # it pulls from the pool alone: a chain of its own
            call = self._worker(iid).LoadParameters(request, timeout=self.cfg.load_timeout_s)
            async for p in call:
                done = done or p.done
                self.sink.load_progress(load, iid, p.layers_loaded, p.groups_total, p.done)
            if not done:
                error = "LoadParameters ended before the load was done"
        except asyncio.CancelledError:
            raise
        except grpc.aio.AioRpcError as e:
            error = f"{e.code().name}: {e.details()}"
        except Exception as e:
            error = repr(e)
        self._sending.finish(iid)
        await self._follow_up(self.sink.load_finished(load, iid, error))

    # ---- drains ---------------------------------------------------------------------------
    async def _drain(self, drain: DrainInstance) -> None:
        iid = drain.instance_id
        error = ""
        resp = worker_pb2.DrainResponse()
        try:
            stub = self._worker(iid)
            resp = await stub.Drain(
                worker_pb2.DrainRequest(timeout_s=self.cfg.drain_timeout_s, instance_id=iid),
                timeout=self.cfg.drain_timeout_s + 10,
            )
            if resp.resumed:
                # Taken back (ResumeInstance): it serves on, in the location index as before.
                await self._follow_up(self.sink.drain_finished(drain, "", resp.finished, 0, resumed=True))
                return
            # Out of the location index before its weights go, so no transfer picks it as a source.
            await self._update_location(UpdateLocation(drain.model, iid, present=False))
            # Drain returns once the requests it aborted have unwound, so one call suffices; a
            # refusal (still in flight) fails the drain and the worker's reports take over.
            await stub.Unload(worker_pb2.UnloadRequest(keep_warm_s=drain.keep_warm_s, instance_id=iid), timeout=30)
        except asyncio.CancelledError:
            raise
        except grpc.aio.AioRpcError as e:
            error = f"{e.code().name}: {e.details()}"
        except Exception as e:
            error = repr(e)
        await self._follow_up(self.sink.drain_finished(drain, error, resp.finished, resp.aborted))

    async def _resume(self, action: ResumeInstance) -> None:
        error = ""
        try:
            await self._worker(action.instance_id).Resume(
                worker_pb2.ResumeRequest(reason=action.reason, instance_id=action.instance_id),
                timeout=RELEASE_TIMEOUT_S,
            )
        except asyncio.CancelledError:
            raise
        except grpc.aio.AioRpcError as e:
            error = f"{e.code().name}: {e.details()}"
        except Exception as e:
            error = repr(e)
        await self._follow_up(self.sink.resume_finished(action, error))

    # ---- parameter-manager locations, releases --------------------------------------------
    async def _update_location(self, action: UpdateLocation) -> None:
        if not self.cfg.param_manager:
            return
        iid = action.instance_id
        dp_address, dp_kind = self.table.dataplane.get(iid, (b"", ""))
        host = self.table.registry.get(iid).host if iid in self.table.registry else ""
        request = param_manager_pb2.UpdateLocationRequest(
            model_id=action.model,
            holder=iid,
            present=action.present,
            holder_address=self.table.addresses.get(iid, ""),
            dataplane_address=dp_address,
            dataplane_kind=dp_kind,
            host=host,
        )
        for attempt in range(LOCATION_RETRIES):
            try:
                await self._pm().UpdateLocation(request, timeout=5)
                return
            except grpc.aio.AioRpcError as e:
                if attempt + 1 == LOCATION_RETRIES or e.code() not in (
                    grpc.StatusCode.UNAVAILABLE,
                    grpc.StatusCode.DEADLINE_EXCEEDED,
                ):
                    log.warning("location_update_failed", model=action.model, instance_id=iid, code=e.code().name)
                    self.sink.report(Count("location", "failed"))
                    self.sink.report(
                        Report(
                            "location",
                            action.model,
                            "failed",
                            f"present={action.present}: {e.code().name}: {e.details()}",
                            iid,
                        )
                    )
                    return
            await asyncio.sleep(0.2 * 2**attempt)

    async def _release(self, action: MigrateRequests) -> None:
        """Ask `action.source` to let requests go; the sink hears how many (None: not asked)."""
        moved: int | None = None
        address = self.table.addresses.get(action.source)
        rpc = "ReleaseRunning" if action.running else "ReleaseWaiting"
        request_type = worker_pb2.ReleaseRunningRequest if action.running else worker_pb2.ReleaseWaitingRequest
        if address is not None:
            try:
                stub = worker_pb2_grpc.WorkerStub(self._channel(address))
                request = request_type(max_requests=action.n, reason=action.reason, instance_id=action.source)
                if action.running:
                    request.min_tokens_left = action.min_tokens_left
                elif action.ran_ahead_by:
                    request.ran_ahead_by = action.ran_ahead_by
                resp = await getattr(stub, rpc)(request, timeout=RELEASE_TIMEOUT_S)
                moved = len(resp.request_ids)
            except grpc.aio.AioRpcError as e:
                log.warning(
                    "release_failed", rpc=rpc, instance_id=action.source, code=e.code().name, details=e.details()
                )
        await self._follow_up(self.sink.released(action, moved))
