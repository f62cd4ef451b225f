"""The live autoscaler against fake workers and a fake parameter manager (real gRPC servers):
the gRPC control loop and actuator end to end. What the loop decides, tick by tick, is tested on
a fake clock in tests/unit/test_gm_control_loop.py (no sockets, no sleeps).

The fakes keep their own state the way real workers do (LoadParameters: IDLE -> LOADING ->
SERVING, Drain: DRAINING, Unload: IDLE) and a background task heartbeats it with a load the
test sets, so the manager's control loop sees what it would see in a mesh.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any

import grpc
import pytest

from blitzmesh.v1 import (
    admin_pb2,
    common_pb2,
    global_manager_pb2,
    global_manager_pb2_grpc,
    param_manager_pb2,
    param_manager_pb2_grpc,
    worker_pb2,
    worker_pb2_grpc,
)
from services.common.grpc_util import channel
from services.common.waiting import wait_until
from services.global_manager.config import GlobalManagerConfig
from services.global_manager.service import GlobalManagerService

pytestmark = pytest.mark.timeout(60)

ST = common_pb2.InstanceState
MODEL = "m"
HEARTBEAT_S = 0.05


GROUPS = ("embed", "layers.0", "layers.1", "head")


class FakeParamManager(param_manager_pb2_grpc.ParamManagerServicer):
    def __init__(self) -> None:
        self.holders: set[str] = set()
        self.updates: list[tuple[str, bool]] = []
        # One host-cache shard holds everything; live instances are added as they load.
        self.shard = common_pb2.Holder(
            holder_id="hc0", kind="host_cache", host="cache-host", grpc_address="hc0:1", dataplane_address=b"hc0"
        )

    async def ListModels(self, request, context):
        return admin_pb2.ListModelsResponse(models=[common_pb2.ModelInfo(model_id=MODEL)])

    async def UpdateLocation(self, request, context):
        self.updates.append((request.holder, request.present))
        (self.holders.add if request.present else self.holders.discard)(request.holder)
        return param_manager_pb2.UpdateLocationResponse()

    async def Locate(self, request, context):
        instances = [
            common_pb2.Holder(
                holder_id=h, kind="instance", host=f"host-{h}", grpc_address=f"{h}:1", dataplane_address=h.encode()
            )
            for h in sorted(self.holders)
        ]
        return param_manager_pb2.LocateResponse(
            locations=[common_pb2.GroupLocation(group=g, holder_info=[*instances, self.shard]) for g in GROUPS]
        )


class FakeWorker(worker_pb2_grpc.WorkerServicer):
    def __init__(self, iid: str) -> None:
        self.iid = iid
        self.address = ""
        self.state = ST.INSTANCE_STATE_IDLE
        self.load = common_pb2.LoadReport()
        self.fail_load = False
        self.fail_drain = False
        self.load_s = 0.05
        self.mute = False  # no heartbeats (a worker busy unpacking parameters)
        self.drains = 0
        # The role it registers with until a LoadParameters names one, as the real worker's --role.
        self.role: common_pb2.InstanceRole.ValueType = common_pb2.INSTANCE_ROLE_COLOCATED
        self.load_requests: list[worker_pb2.LoadParametersRequest] = []
        self.release_running: list[worker_pb2.ReleaseRunningRequest] = []

    async def LoadParameters(self, request, context):
        self.load_requests.append(request)
        if request.role:
            self.role = request.role
        self.state = ST.INSTANCE_STATE_LOADING
        yield worker_pb2.LoadProgress(layers_loaded=1, groups_total=4, groups_loaded=2)
        await asyncio.sleep(self.load_s)
        if self.fail_load:
            self.state = ST.INSTANCE_STATE_IDLE  # the real worker drops the half-loaded model
            await context.abort(grpc.StatusCode.DATA_LOSS, f"{self.iid}: crc mismatch in layers.1")
        self.state = ST.INSTANCE_STATE_SERVING
        yield worker_pb2.LoadProgress(layers_loaded=2, groups_total=4, groups_loaded=4, done=True)

    async def Drain(self, request, context):
        if self.fail_drain:
            await context.abort(grpc.StatusCode.INTERNAL, f"{self.iid}: drain broke")
        self.state = ST.INSTANCE_STATE_DRAINING
        self.drains += 1
        return worker_pb2.DrainResponse(finished=int(self.load.running))

    async def ReleaseRunning(self, request, context):
        self.release_running.append(request)
        return worker_pb2.ReleaseRunningResponse(request_ids=[f"{self.iid}-r{i}" for i in range(request.max_requests)])

    async def Unload(self, request, context):
        self.state = ST.INSTANCE_STATE_IDLE
        self.load = common_pb2.LoadReport()
        return worker_pb2.UnloadResponse()

    def info(self) -> common_pb2.InstanceInfo:
        serving = self.state in (ST.INSTANCE_STATE_SERVING, ST.INSTANCE_STATE_DRAINING)
        return common_pb2.InstanceInfo(
            instance_id=self.iid,
            address=self.address,
            host="h0",
            state=self.state,
            model_id=MODEL if self.state != ST.INSTANCE_STATE_IDLE else "",
            role=self.role,
            layers_loaded=2 if serving else 0,
            num_layers=2 if self.state != ST.INSTANCE_STATE_IDLE else 0,
            dataplane_address=f"dp-{self.iid}".encode(),
            dataplane_kind="tcp",
        )


@contextlib.asynccontextmanager
async def grpc_server(add: Callable[[Any, grpc.aio.Server], None], servicer: Any) -> AsyncIterator[str]:
    server = grpc.aio.server()
    add(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    try:
        yield f"127.0.0.1:{port}"
    finally:
        await server.stop(0)


@dataclass
class Cluster:
    gm: GlobalManagerService
    stub: global_manager_pb2_grpc.GlobalManagerStub
    pm: FakeParamManager
    workers: dict[str, FakeWorker]
    events: list[admin_pb2.ClusterEvent] = field(default_factory=list)
    _new_event: asyncio.Event = field(default_factory=asyncio.Event)

    def state(self, iid: str) -> str:
        return self.gm.servicer.table.registry.get(iid).state.value

    async def wait_event(
        self, pred: Callable[[admin_pb2.ClusterEvent], bool], timeout_s: float = 10.0, count: int = 1
    ) -> list[admin_pb2.ClusterEvent]:
        async with asyncio.timeout(timeout_s):
            while True:
                hits = [e for e in self.events if pred(e)]
                if len(hits) >= count:
                    return hits
                self._new_event.clear()
                await self._new_event.wait()

    def set_load(self, **load: float) -> None:
        for w in self.workers.values():
            if w.state == ST.INSTANCE_STATE_SERVING:
                w.load = common_pb2.LoadReport(**load)


async def _heartbeats(stub: global_manager_pb2_grpc.GlobalManagerStub, workers: dict[str, FakeWorker]) -> None:
    registered: set[str] = set()
    while True:
        for w in workers.values():
            if w.mute:
                continue
            if w.iid not in registered:
                await stub.RegisterInstance(global_manager_pb2.RegisterInstanceRequest(instance=w.info()), timeout=5)
                registered.add(w.iid)
            info = w.info()
            resp = await stub.Heartbeat(
                global_manager_pb2.HeartbeatRequest(
                    instance_id=w.iid,
                    state=info.state,
                    model_id=info.model_id,
                    layers_loaded=info.layers_loaded,
                    num_layers=info.num_layers,
                    load=w.load,
                ),
                timeout=5,
            )
            if resp.reregister:
                registered.discard(w.iid)
        await asyncio.sleep(HEARTBEAT_S)


async def _watch(cluster: Cluster, address: str) -> None:
    async with channel(address) as ch:
        async for ev in global_manager_pb2_grpc.GlobalManagerStub(ch).WatchEvents(admin_pb2.WatchEventsRequest()):
            cluster.events.append(ev)
            cluster._new_event.set()


@contextlib.asynccontextmanager
async def cluster(
    serve_in_process: Any, n_workers: int = 3, roles: dict[str, int] | None = None, **cfg: Any
) -> AsyncIterator[Cluster]:
    pm = FakeParamManager()
    workers = {f"w{i}": FakeWorker(f"w{i}") for i in range(n_workers)}
    for iid, role in (roles or {}).items():
        workers[iid].role = role  # type: ignore[assignment]
    async with contextlib.AsyncExitStack() as stack:
        pm_address = await stack.enter_async_context(
            grpc_server(param_manager_pb2_grpc.add_ParamManagerServicer_to_server, pm)
        )
        for w in workers.values():
            w.address = await stack.enter_async_context(grpc_server(worker_pb2_grpc.add_WorkerServicer_to_server, w))
        params = {
            "target_decode_tps_per_instance": 10,
            "scale_out_cooldown_s": 0,
            "scale_in_cooldown_s": 0,
            "enable_latency_trigger": False,
            **cfg.pop("policy_params", {}),
        }
        settings = {
            "port": 0,
            "param_manager": pm_address,
            "default_model": MODEL,
            "min_instances": 1,
            "max_instances": 3,
            "autoscale": True,
            "tick_s": 0.05,
            "window_s": 0.5,
            "lost_after_s": 30,
            "policy_params": params,
            **cfg,
        }
        config = GlobalManagerConfig(**settings)
        gm = GlobalManagerService(config)
        ctx = await stack.enter_async_context(serve_in_process(gm, config))
        ch = await stack.enter_async_context(channel(ctx.address))
        c = Cluster(gm, global_manager_pb2_grpc.GlobalManagerStub(ch), pm, workers)
        tasks = [asyncio.create_task(_watch(c, ctx.address))]
        try:
            # The watch is live before any worker registers, so no event is missed.
            await wait_until(lambda: gm.servicer.events._subscribers, 5, what="the event watch subscribed")
            tasks.append(asyncio.create_task(_heartbeats(c.stub, workers)))
            yield c
        finally:
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)


def is_decision(action: str) -> Callable[[admin_pb2.ClusterEvent], bool]:
    return lambda e: e.action == "autoscaling_decision" and e.target == action


async def test_scale_out_then_in_moves_instances_and_locations(serve_in_process: Any) -> None:
    async with cluster(serve_in_process) as c:
        # min_instances brings one instance up from the idle pool.
        await c.wait_event(lambda e: e.action == "load_result" and e.status == "ok")
        assert c.pm.holders == {"w0"}

        # Load: 50 decode tokens/s against a target of 10 per instance -> wants 5; the manager's
        # max_instances=3 is the policy's default bound, so it asks for 3 at most.
        c.set_load(decode_tps=50, running=4)
        outs = await c.wait_event(is_decision("scale_out"))
        assert outs[0].reason.startswith("SCALE_OUT: ratio=") and outs[0].status.startswith("instances:1->")
        loaded = await c.wait_event(lambda e: e.action == "load_result" and e.status == "ok", count=3)
        assert {e.instance_id for e in loaded} == {"w0", "w1", "w2"}
        assert c.pm.holders == {"w0", "w1", "w2"}
        assert all(c.state(i) == "SERVING" for i in c.workers)
        assert not [e for e in c.events if e.action == "scale_out" and e.status == "partial"]

        # The burst ends; w0 still has a request running, so the idle ones are drained.
        c.set_load(decode_tps=0, running=0)
        c.workers["w0"].load = common_pb2.LoadReport(running=1)
        ins = await c.wait_event(is_decision("scale_in"))
        assert ins[0].status.startswith("instances:3->") and "SCALE_IN" in ins[0].reason
        drained = await c.wait_event(lambda e: e.action == "drain_result" and e.status == "idle", count=2)
        assert {e.instance_id for e in drained} == {"w1", "w2"}
        assert c.pm.holders == {"w0"} and ("w1", False) in c.pm.updates
        assert [c.state(i) for i in ("w0", "w1", "w2")] == ["SERVING", "IDLE", "IDLE"]
        assert c.workers["w0"].drains == 0

        # Every reported decision is also a `time,action,target,status,reason` log line.
        lines = list(c.gm.servicer.decision_log)
        assert any(
            ",autoscaling_decision,scale_out,instances:1->" in line and ",SCALE_OUT: ratio=" in line for line in lines
        )
        assert all(len(line.split(",", 4)) == 5 for line in lines)


async def test_failed_load_is_retried_on_another_worker(serve_in_process: Any) -> None:
    async with cluster(serve_in_process) as c:
        await c.wait_event(lambda e: e.action == "load_result" and e.status == "ok")
        c.workers["w1"].fail_load = True
        c.set_load(decode_tps=15, running=2)  # wants 2
        (failed,) = await c.wait_event(lambda e: e.action == "load_result" and e.status == "failed")
        assert failed.instance_id == "w1" and "DATA_LOSS" in failed.reason and "crc" in failed.reason
        retry = await c.wait_event(lambda e: e.action == "scale_out" and e.reason.startswith("retry 1/1"))
        assert retry[0].instance_id == "w2"
        await c.wait_event(lambda e: e.action == "load_result" and e.status == "ok" and e.instance_id == "w2")
        assert c.state("w1") == "IDLE" and c.state("w2") == "SERVING"
        assert "w1" not in c.pm.holders


async def test_set_policy_tunes_and_keeps_cooldowns(serve_in_process: Any) -> None:
    async with cluster(serve_in_process, policy_params={"scale_out_cooldown_s": 600}) as c:
        await c.wait_event(lambda e: e.action == "load_result" and e.status == "ok")
        c.set_load(decode_tps=15, running=2)
        await c.wait_event(is_decision("scale_out"))
        await c.wait_event(lambda e: e.action == "load_result" and e.status == "ok", count=2)
        # A retune (lower target) wants more, but the scale-out cooldown carries over.
        await c.stub.SetPolicy(
            admin_pb2.SetPolicyRequest(
                policy="heteroscale",
                params={
                    "target_decode_tps_per_instance": "2",
                    "scale_out_cooldown_s": "600",
                    "scale_in_cooldown_s": "600",
                    "enable_latency_trigger": "false",
                },
            ),
            timeout=5,
        )
        (held,) = await c.wait_event(lambda e: is_decision("no_change")(e) and "COOLDOWN" in e.reason)
        assert "scale_out held until" in held.reason
        # A periodic schedule travels as a JSON string.
        resp = await c.stub.SetPolicy(
            admin_pb2.SetPolicyRequest(policy="periodic", params={"schedule": '[{"at_s": 0, "instances": 1}]'}),
            timeout=5,
        )
        assert resp.policy == "periodic" and resp.params["schedule"] == '[{"at_s": 0, "instances": 1}]'
        with pytest.raises(grpc.aio.AioRpcError) as e:
            await c.stub.SetPolicy(
                admin_pb2.SetPolicyRequest(policy="heteroscale", params={"pd_ratio": "7"}), timeout=5
            )
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "pd_ratio" in (e.value.details() or "")


async def test_failed_drain_follows_the_worker(serve_in_process: Any) -> None:
    async with cluster(serve_in_process, policy_params={"scale_out_cooldown_s": 600, "scale_in_cooldown_s": 600}) as c:
        await c.wait_event(lambda e: e.action == "load_result" and e.status == "ok")
        c.set_load(decode_tps=15, running=2)
        await c.wait_event(lambda e: e.action == "load_result" and e.status == "ok", count=2)
        for w in c.workers.values():
            w.fail_drain = True
        now = await c.stub.GetCluster(admin_pb2.GetClusterRequest(), timeout=5)
        await c.stub.SetPolicy(
            admin_pb2.SetPolicyRequest(policy=now.policy, params=now.policy_params, advisory=True), timeout=5
        )
        resp = await c.stub.Scale(admin_pb2.ScaleRequest(model_id=MODEL, delta=-1, wait=True), timeout=10)
        (victim,) = resp.instance_ids
        (failed,) = await c.wait_event(lambda e: e.action == "drain_result" and e.status == "failed")
        assert failed.instance_id == victim and "drain broke" in failed.reason
        # The worker still reports SERVING: the registry follows it back instead of staying DRAINING.
        await wait_until(lambda: c.state(victim) == "SERVING", 5, what=f"{victim} back to SERVING")
        assert victim in c.pm.holders


def test_config_rejects_bad_policy_params() -> None:
    with pytest.raises(ValueError, match="target_decode_tps_per_instance"):
        GlobalManagerConfig(policy_params={"target_decode_tps_per_instance": -1})
    with pytest.raises(ValueError, match="default_model"):
        GlobalManagerConfig(autoscale=True)
    cfg = GlobalManagerConfig(policy="utilization", policy_params={"target_utilization": 0.5})
    assert cfg.policy_params == {"target_utilization": 0.5}


async def test_scale_with_an_unknown_role_is_invalid(serve_in_process: Any) -> None:
    async with cluster(serve_in_process, n_workers=1) as c:
        with pytest.raises(grpc.aio.AioRpcError) as e:
            await c.stub.Scale(admin_pb2.ScaleRequest(model_id=MODEL, delta=1, role=99), timeout=5)  # type: ignore[arg-type]
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "99" in (e.value.details() or "")


# ---- prefill/decode disaggregation ----------------------------------------------------------

ROLE = common_pb2.InstanceRole


def load_roles(c: Cluster) -> dict[str, list[int]]:
    return {iid: [r.role for r in w.load_requests] for iid, w in c.workers.items() if w.load_requests}


async def test_split_pools_fill_by_role_route_pairs_and_load_from_decode(serve_in_process: Any) -> None:
    # w0 was started as a prefill worker and w1 as a decode one: each gets its own pool.
    roles = {"w0": ROLE.INSTANCE_ROLE_PREFILL, "w1": ROLE.INSTANCE_ROLE_DECODE}
    settings = {"min_instances": 0, "min_prefill": 1, "min_decode": 1, "max_instances": 4, "autoscale": False}
    async with cluster(serve_in_process, n_workers=4, roles=roles, **settings) as c:
        loaded = await c.wait_event(lambda e: e.action == "load_result" and e.status == "ok", count=2)
        assert {e.instance_id for e in loaded} == {"w0", "w1"}
        assert load_roles(c) == {"w0": [ROLE.INSTANCE_ROLE_PREFILL], "w1": [ROLE.INSTANCE_ROLE_DECODE]}
        reasons = sorted(e.reason for e in c.events if e.action == "scale_out")
        assert reasons == ["min_decode=1", "min_prefill=1"]
        # The manager assigned the model without knowing its size; heartbeats tell it.
        registry = c.gm.servicer.table.registry
        await wait_until(lambda: registry.get("w0").num_layers == registry.get("w1").num_layers == 2, 5)

        route = await c.stub.Schedule(
            global_manager_pb2.ScheduleRequest(request_id="r1", model_id=MODEL, prompt_tokens=8, max_tokens=8),
            timeout=5,
        )
        assert [(h.instance_id, h.role, h.layer_start, h.layer_end) for h in route.hops] == [
            ("w0", ROLE.INSTANCE_ROLE_PREFILL, 0, 2),
            ("w1", ROLE.INSTANCE_ROLE_DECODE, 0, 2),
        ]
        # The decode instance failed this request: the prefill instance runs it alone.
        route = await c.stub.Schedule(
            global_manager_pb2.ScheduleRequest(model_id=MODEL, exclude_instance_ids=["w1"]), timeout=5
        )
        assert [(h.instance_id, h.role) for h in route.hops] == [("w0", ROLE.INSTANCE_ROLE_PREFILL)]

        # A new prefill instance loads from the decode instance, not from the prefill one
        # (first by name, but its link carries KV out), nor from the host shard.
        await c.stub.Scale(admin_pb2.ScaleRequest(model_id=MODEL, delta=1, role=ROLE.INSTANCE_ROLE_PREFILL), timeout=5)
        (plan,) = await c.wait_event(lambda e: e.action == "transfer_plan" and "->w2" in e.reason)
        assert plan.reason.startswith("chains: w1->w2 ("), plan.reason
        await c.wait_event(lambda e: e.action == "load_result" and e.status == "ok" and e.instance_id == "w2")
        assert load_roles(c)["w2"] == [ROLE.INSTANCE_ROLE_PREFILL]


async def test_split_autoscale_logs_and_grows_both_pools(serve_in_process: Any) -> None:
    roles = {"w0": ROLE.INSTANCE_ROLE_PREFILL, "w1": ROLE.INSTANCE_ROLE_DECODE}
    settings = {
        "min_instances": 0,
        "min_prefill": 1,
        "min_decode": 1,
        "max_instances": 4,
        "policy_params": {"pd_ratio": 1.0},
    }
    async with cluster(serve_in_process, n_workers=4, roles=roles, **settings) as c:
        await c.wait_event(lambda e: e.action == "load_result" and e.status == "ok", count=2)
        # 40 decode tokens/s on the decode pool against 10 per instance: need 4, split 1:1 -> 2 + 2.
        c.set_load(decode_tps=40, running=4)
        (out,) = await c.wait_event(lambda e: is_decision("scale_out")(e) and e.reason.startswith("SCALE_OUT"))
        assert out.status == "prompt:1->2_token:1->2", out.status
        assert any(
            ",autoscaling_decision,scale_out,prompt:1->2_token:1->2," in line for line in c.gm.servicer.decision_log
        )
        await c.wait_event(lambda e: e.action == "load_result" and e.status == "ok", count=4)
        assert load_roles(c) == {
            "w0": [ROLE.INSTANCE_ROLE_PREFILL],
            "w1": [ROLE.INSTANCE_ROLE_DECODE],
            "w2": [ROLE.INSTANCE_ROLE_PREFILL],
            "w3": [ROLE.INSTANCE_ROLE_DECODE],
        }
        registry = c.gm.servicer.table.registry
        assert {v.instance_id: v.role.value for v in registry} == {
            "w0": "PREFILL",
            "w1": "DECODE",
            "w2": "PREFILL",
            "w3": "DECODE",
        }


# ---- ZigZag live scaling ---------------------------------------------------------------------


def schedule(c: Cluster, rid: str = "r") -> Any:
    return c.stub.Schedule(
        global_manager_pb2.ScheduleRequest(request_id=rid, model_id=MODEL, prompt_tokens=8, max_tokens=8), timeout=5
    )


async def test_zigzag_splits_requests_with_a_live_loading_instance_while_the_pool_is_overloaded(
    serve_in_process: Any,
) -> None:
    # Routed dispatch (the default pulls: test_gm_zigzag_pull.py).
    settings = {"min_instances": 1, "max_instances": 2, "autoscale": False, "zigzag_stall_s": 30.0}
    async with cluster(serve_in_process, n_workers=2, zigzag_dispatch="route", **settings) as c:
        await c.wait_event(lambda e: e.action == "load_result" and e.status == "ok")
        c.workers["w1"].load_s = 60.0  # the new instance holds 1 of 2 layers for the whole test
        # w0 is busy but nothing waits: requests go to it whole.
        c.set_load(running=4, waiting=0, kv_blocks_used=10, kv_blocks_total=100)
        await c.stub.Scale(admin_pb2.ScaleRequest(model_id=MODEL, delta=1), timeout=5)
        live = await c.wait_event(lambda e: e.action == "live_scaling" and e.instance_id == "w1")
        assert live[0].status == "1/2"
        assert [h.instance_id for h in (await schedule(c)).hops] == ["w0"]
        # Now requests wait on w0: the next one is split, [0, 1) on w1 then [1, 2) on w0.
        c.set_load(running=4, waiting=3, kv_blocks_used=10, kv_blocks_total=100)
        registry = c.gm.servicer.table.registry
        await wait_until(lambda: (v := registry.get("w0")).load is not None and v.load.waiting == 3, 5)
        route = await schedule(c)
        assert [(h.instance_id, h.layer_start, h.layer_end) for h in route.hops] == [("w1", 0, 1), ("w0", 1, 2)]
        assert route.hops[0].dataplane_address == b"dp-w1"
        (pair,) = await c.wait_event(lambda e: e.action == "zigzag_pair")
        assert pair.instance_id == "w1" and pair.status == "w0" and "fewest used KV blocks (10)" in pair.reason
        assert any(",zigzag_pair,w1,w0," in line for line in c.gm.servicer.decision_log)
        # The in-flight cap (4 at the start of live scaling, then 1 less every 200 ms, at least 2)
        # bounds how many go to w1 between its heartbeats.
        c.workers["w1"].mute = True
        hops = [len((await schedule(c, f"r{i}")).hops) for i in range(6)]
        assert 1 <= hops.count(2) <= 3 and hops[-1] == 1


async def test_a_stalled_load_gets_no_more_zigzag_work(serve_in_process: Any) -> None:
    settings = {"min_instances": 1, "max_instances": 2, "autoscale": False, "zigzag_stall_s": 0.5}
    async with cluster(serve_in_process, n_workers=2, **settings) as c:
        await c.wait_event(lambda e: e.action == "load_result" and e.status == "ok")
        c.workers["w1"].load_s = 60.0
        c.set_load(running=4, waiting=3, kv_blocks_used=10, kv_blocks_total=100)
        await c.stub.Scale(admin_pb2.ScaleRequest(model_id=MODEL, delta=1), timeout=5)
        await c.wait_event(lambda e: e.action == "live_scaling" and e.instance_id == "w1")

        async def whole() -> bool:
            return len((await schedule(c)).hops) == 1 and any(e.action == "zigzag_stopped" for e in c.events)

        # Its layer count stays at 1: after zigzag_stall_s the scheduler stops trusting it.
        await wait_until(whole, 10, interval_s=0.1, what="ZigZag stopped for the stalled load")
        (stopped,) = [e for e in c.events if e.action == "zigzag_stopped"]
        assert stopped.instance_id == "w1" and "zigzag_stall_s=0.5" in stopped.reason


# ---- live migration ----------------------------------------------------------------------------


async def test_an_instance_over_its_kv_target_releases_running_requests(serve_in_process: Any) -> None:
    settings = {"min_instances": 2, "max_instances": 2, "autoscale": False, "migration_cooldown_s": 60.0}
    async with cluster(serve_in_process, n_workers=2, **settings) as c:
        await c.wait_event(lambda e: e.action == "load_result" and e.status == "ok", count=2)
        c.workers["w1"].load = common_pb2.LoadReport(running=1, kv_blocks_used=10, kv_blocks_total=100)
        c.workers["w0"].load = common_pb2.LoadReport(running=9, kv_blocks_used=97, kv_blocks_total=100)
        (moved,) = await c.wait_event(lambda e: e.action == "live_migration")
        assert moved.instance_id == "w0" and moved.status == "moved"
        assert "KV 0.97 > 0.95" in moved.reason and "released 4 of 4" in moved.reason
        (call,) = c.workers["w0"].release_running
        assert call.max_requests == 4 and call.reason.startswith("live migration")
        assert not c.workers["w1"].release_running


async def test_zigzag_in_a_split_deployment_splits_the_prefill_pool(serve_in_process: Any) -> None:
    """Disaggregated: a loading prefill instance runs the first layers, the overloaded prefill
    instance finishes the prompt, and the route's decode instance takes the KV from it."""
    roles = {"w0": ROLE.INSTANCE_ROLE_PREFILL, "w1": ROLE.INSTANCE_ROLE_DECODE, "w2": ROLE.INSTANCE_ROLE_PREFILL}
    settings = {"min_instances": 0, "min_prefill": 1, "min_decode": 1, "max_instances": 3, "autoscale": False}
    async with cluster(
        serve_in_process, n_workers=3, roles=roles, zigzag_stall_s=30.0, zigzag_dispatch="route", **settings
    ) as c:
        await c.wait_event(lambda e: e.action == "load_result" and e.status == "ok", count=2)
        c.workers["w2"].load_s = 60.0
        c.workers["w0"].load = common_pb2.LoadReport(running=4, waiting=3, kv_blocks_used=10, kv_blocks_total=100)
        await c.stub.Scale(admin_pb2.ScaleRequest(model_id=MODEL, delta=1, role=ROLE.INSTANCE_ROLE_PREFILL), timeout=5)
        await c.wait_event(lambda e: e.action == "live_scaling" and e.instance_id == "w2")
        registry = c.gm.servicer.table.registry
        await wait_until(lambda: (v := registry.get("w0")).load is not None and v.load.waiting == 3, 5)
        route = await schedule(c)
        assert [(h.instance_id, h.layer_start, h.layer_end, h.role) for h in route.hops] == [
            ("w2", 0, 1, ROLE.INSTANCE_ROLE_PREFILL),
            ("w0", 1, 2, ROLE.INSTANCE_ROLE_PREFILL),
            ("w1", 0, 2, ROLE.INSTANCE_ROLE_DECODE),
        ]
