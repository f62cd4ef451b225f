"""Global manager as a real gRPC server: registration, re-registration, routing, policy control."""

from __future__ import annotations

from typing import Any

import grpc
import pytest

from blitzmesh.v1 import admin_pb2, common_pb2, global_manager_pb2, global_manager_pb2_grpc
from services.common.grpc_util import channel
from services.global_manager.config import GlobalManagerConfig
from services.global_manager.service import GlobalManagerService

pytestmark = pytest.mark.timeout(60)


def info(iid: str, state: int, load: common_pb2.LoadReport | None = None) -> common_pb2.InstanceInfo:
    return common_pb2.InstanceInfo(
        instance_id=iid,
        address=f"127.0.0.1:{1000 + int(iid[-1])}",
        host="h0",
        model_id="m" if state != common_pb2.INSTANCE_STATE_IDLE else "",
        state=state,
        role=common_pb2.INSTANCE_ROLE_COLOCATED,
        layers_loaded=4 if state == common_pb2.INSTANCE_STATE_SERVING else 0,
        num_layers=4 if state != common_pb2.INSTANCE_STATE_IDLE else 0,
        load=load,
    )


async def test_register_heartbeat_schedule(serve_in_process: Any) -> None:
    gm = GlobalManagerService(GlobalManagerConfig(port=0))
    async with serve_in_process(gm, gm.servicer.cfg) as ctx, channel(ctx.address) as ch:
        stub = global_manager_pb2_grpc.GlobalManagerStub(ch)
        # Unknown instance: told to register (this is how a restarted manager rebuilds itself).
        hb = await stub.Heartbeat(global_manager_pb2.HeartbeatRequest(instance_id="w1"), timeout=5)
        assert hb.reregister

        with pytest.raises(grpc.aio.AioRpcError) as e:
            await stub.Schedule(global_manager_pb2.ScheduleRequest(model_id="m"), timeout=5)
        assert e.value.code() == grpc.StatusCode.UNAVAILABLE and "'m'" in (e.value.details() or "")

        busy = common_pb2.LoadReport(running=5, kv_blocks_used=10, kv_blocks_total=100)
        calm = common_pb2.LoadReport(running=1, kv_blocks_used=1, kv_blocks_total=100)
        for iid, load in (("w1", busy), ("w2", calm)):
            await stub.RegisterInstance(
                global_manager_pb2.RegisterInstanceRequest(instance=info(iid, common_pb2.INSTANCE_STATE_SERVING)),
                timeout=5,
            )
            hb = await stub.Heartbeat(
                global_manager_pb2.HeartbeatRequest(
                    instance_id=iid,
                    state=common_pb2.INSTANCE_STATE_SERVING,
                    model_id="m",
                    layers_loaded=4,
                    num_layers=4,
                    load=load,
                ),
                timeout=5,
            )
            assert not hb.reregister
        route = await stub.Schedule(global_manager_pb2.ScheduleRequest(request_id="r", model_id="m"), timeout=5)
        assert [h.instance_id for h in route.hops] == ["w2"]  # the least loaded
        assert route.hops[0].address == "127.0.0.1:1002" and route.hops[0].layer_end == 4
        route = await stub.Schedule(
            global_manager_pb2.ScheduleRequest(model_id="m", exclude_instance_ids=["w2"]), timeout=5
        )
        assert [h.instance_id for h in route.hops] == ["w1"]

        # A worker that reports DRAINING takes no new work.
        await stub.Heartbeat(
            global_manager_pb2.HeartbeatRequest(
                instance_id="w2", state=common_pb2.INSTANCE_STATE_DRAINING, model_id="m", layers_loaded=4, num_layers=4
            ),
            timeout=5,
        )
        route = await stub.Schedule(global_manager_pb2.ScheduleRequest(model_id="m"), timeout=5)
        assert [h.instance_id for h in route.hops] == ["w1"]

        cluster = await stub.GetCluster(admin_pb2.GetClusterRequest(), timeout=5)
        states = {i.instance_id: i.state for i in cluster.instances}
        assert states == {"w1": common_pb2.INSTANCE_STATE_SERVING, "w2": common_pb2.INSTANCE_STATE_DRAINING}


async def test_set_policy_validates_and_applies(serve_in_process: Any) -> None:
    gm = GlobalManagerService(GlobalManagerConfig(port=0))
    async with serve_in_process(gm, gm.servicer.cfg) as ctx, channel(ctx.address) as ch:
        stub = global_manager_pb2_grpc.GlobalManagerStub(ch)
        with pytest.raises(grpc.aio.AioRpcError) as e:
            await stub.SetPolicy(admin_pb2.SetPolicyRequest(policy="bogus"), timeout=5)
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "'bogus'" in (e.value.details() or "")
        resp = await stub.SetPolicy(
            admin_pb2.SetPolicyRequest(policy="utilization", params={}, advisory=True), timeout=5
        )
        assert resp.policy == "utilization" and resp.advisory
        cluster = await stub.GetCluster(admin_pb2.GetClusterRequest(), timeout=5)
        assert cluster.policy == "utilization" and cluster.advisory


async def test_a_burst_between_heartbeats_alternates(serve_in_process: Any) -> None:
    gm = GlobalManagerService(GlobalManagerConfig(port=0))
    async with serve_in_process(gm, gm.servicer.cfg) as ctx, channel(ctx.address) as ch:
        stub = global_manager_pb2_grpc.GlobalManagerStub(ch)
        idle = common_pb2.LoadReport(kv_blocks_total=100)

        async def heartbeat(iid: str, load: common_pb2.LoadReport) -> None:
            await stub.Heartbeat(
                global_manager_pb2.HeartbeatRequest(
                    instance_id=iid, state=common_pb2.INSTANCE_STATE_SERVING, model_id="m", num_layers=4, load=load
                ),
                timeout=5,
            )

        for iid in ("w1", "w2"):
            await stub.RegisterInstance(
                global_manager_pb2.RegisterInstanceRequest(instance=info(iid, common_pb2.INSTANCE_STATE_SERVING)),
                timeout=5,
            )
            await heartbeat(iid, idle)

        async def schedule() -> str:
            route = await stub.Schedule(global_manager_pb2.ScheduleRequest(model_id="m"), timeout=5)
            (hop,) = route.hops
            assert hop.role == common_pb2.INSTANCE_ROLE_COLOCATED
            return hop.instance_id

        # Both report idle; each route counts against its instance until the next heartbeat.
        assert [await schedule() for _ in range(4)] == ["w1", "w2", "w1", "w2"]
        await heartbeat("w2", common_pb2.LoadReport(running=1, kv_blocks_total=100))  # w2's count resets to 0
        assert await schedule() == "w2"
