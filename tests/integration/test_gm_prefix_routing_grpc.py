"""Prefix-affinity routing through the global manager's Schedule: prompts sharing cached blocks go
back to the instance they were routed to, until it leaves SERVING."""

from __future__ import annotations

from typing import Any

import pytest

from blitzmesh.v1 import common_pb2, global_manager_pb2, global_manager_pb2_grpc
from services.common.grpc_util import channel
from services.common.prefix import block_hashes
from services.global_manager.config import GlobalManagerConfig
from services.global_manager.service import GlobalManagerService

pytestmark = pytest.mark.timeout(60)

SYSTEM = list(range(1, 129))  # 8 blocks of 16 shared by every prompt below


def info(iid: str) -> common_pb2.InstanceInfo:
    return common_pb2.InstanceInfo(
        instance_id=iid,
        address=f"127.0.0.1:{1000 + int(iid[-1])}",
        host="h0",
        model_id="m",
        state=common_pb2.INSTANCE_STATE_SERVING,
        role=common_pb2.INSTANCE_ROLE_COLOCATED,
        layers_loaded=4,
        num_layers=4,
    )


async def test_prompts_sharing_a_prefix_follow_it(serve_in_process: Any) -> None:
    gm = GlobalManagerService(GlobalManagerConfig(port=0))
    async with serve_in_process(gm, gm.servicer.cfg) as ctx, channel(ctx.address) as ch:
        stub = global_manager_pb2_grpc.GlobalManagerStub(ch)

        async def heartbeat(iid: str, load: common_pb2.LoadReport, state: int = common_pb2.INSTANCE_STATE_SERVING):
            await serving_beat(stub, iid, load, state)

        async def schedule(suffix: int | None) -> str:
            prompt = [*SYSTEM, *range(1000 * (suffix or 0), 1000 * (suffix or 0) + 40)]
            hashes = block_hashes(prompt, 16) if suffix is not None else []
            route = await stub.Schedule(
                global_manager_pb2.ScheduleRequest(
                    model_id="m", prompt_tokens=len(prompt), max_tokens=16, prefix_block_hashes=hashes
                ),
                timeout=5,
            )
            (hop,) = route.hops
            return hop.instance_id

        idle = common_pb2.LoadReport(kv_blocks_total=1000)
        for iid in ("w1", "w2"):
            await stub.RegisterInstance(global_manager_pb2.RegisterInstanceRequest(instance=info(iid)), timeout=5)
            await heartbeat(iid, idle)
        assert await schedule(1) == "w1"  # nothing cached anywhere: the least loaded (ids break the tie)
        # w1 now runs it: busier, but it holds the 8 shared blocks (10 blocks of that prompt were
        # routed there), which the next prompt of 11 blocks would otherwise compute on w2.
        busy = common_pb2.LoadReport(running=1, kv_blocks_used=5, kv_blocks_total=1000)
        await heartbeat("w1", busy)
        await heartbeat("w2", idle)
        assert await schedule(None) == "w2"  # no hashes: plain least loaded
        await heartbeat("w2", idle)
        assert await schedule(2) == "w1"  # cost 1 * (11 - 8) + 5 = 8 against 11 + 0
        assert gm.servicer.prefix_index.overlap("w1", "m", block_hashes([*SYSTEM, *range(3000, 3040)], 16)) == 8

        # Leaving SERVING takes the cache with it: the next prompt goes by load.
        await heartbeat("w1", busy, common_pb2.INSTANCE_STATE_DRAINING)
        assert await schedule(3) == "w2"
        assert "w1" not in gm.servicer.prefix_index and "w2" in gm.servicer.prefix_index


async def test_a_zigzag_split_leaves_its_prompt_with_the_loading_instance(serve_in_process: Any) -> None:
    """The loading instance of a ZigZag split computes the prompt's blocks as its layers arrive
    (whole once its load completes under the request): the manager remembers them for it, so the
    request, moved off its partner's backlog when the load completes, goes back to them
    (routed dispatch: the split is the manager's)."""
    from services.global_manager.core.actions import LoadInstances
    from services.global_manager.core.types import Role

    gm = GlobalManagerService(GlobalManagerConfig(port=0, zigzag_dispatch="route"))
    svc = gm.servicer
    async with serve_in_process(gm, svc.cfg) as ctx, channel(ctx.address) as ch:
        stub = global_manager_pb2_grpc.GlobalManagerStub(ch)
        prompt = [*SYSTEM, *range(5000, 5040)]
        hashes = block_hashes(prompt, 16)
        backlog = common_pb2.LoadReport(running=4, waiting=6, waiting_prefill_tokens=2000, kv_blocks_total=1000)
        await stub.RegisterInstance(global_manager_pb2.RegisterInstanceRequest(instance=info("w1")), timeout=5)
        loading = info("w3")
        loading.state = common_pb2.INSTANCE_STATE_LOADING
        loading.layers_loaded = 0
        loading.dataplane_address = b"127.0.0.1:7003"
        loading.dataplane_kind = "tcp"
        await stub.RegisterInstance(global_manager_pb2.RegisterInstanceRequest(instance=loading), timeout=5)
        await serving_beat(stub, "w1", backlog)
        svc.load_progress(LoadInstances("m", Role.COLOCATED, ("w3",), "test"), "w3", 2, 6, done=False)
        route = await schedule_prompt(stub, prompt)
        assert [(h.instance_id, h.layer_start, h.layer_end) for h in route.hops] == [("w3", 0, 2), ("w1", 2, 4)]
        assert svc.prefix_index.overlap("w3", "m", hashes) == len(hashes)
        other = [*range(7000, 7100)]
        await schedule_prompt(stub, other)  # routed while w3 still loads: what w3 is remembered for stays
        assert svc.prefix_index.overlap("w3", "m", hashes) == len(hashes)
        # The load completes: w3 is SERVING, w1 still holds the backlog. The request, moved off it,
        # goes to the blocks w3 holds.
        await serving_beat(stub, "w3", common_pb2.LoadReport(running=1, kv_blocks_used=12, kv_blocks_total=1000))
        moved = await schedule_prompt(stub, prompt)
        assert [h.instance_id for h in moved.hops] == ["w3"]


async def serving_beat(
    stub: Any, iid: str, load: common_pb2.LoadReport, state: int = common_pb2.INSTANCE_STATE_SERVING
) -> None:
    """A heartbeat of `iid`, holding all 4 layers of model m (SERVING unless `state` says)."""
    await stub.Heartbeat(
        global_manager_pb2.HeartbeatRequest(
            instance_id=iid, state=state, model_id="m", layers_loaded=4, num_layers=4, load=load
        ),
        timeout=5,
    )


async def schedule_prompt(stub: Any, prompt: list[int]) -> global_manager_pb2.Route:
    return await stub.Schedule(
        global_manager_pb2.ScheduleRequest(
            model_id="m", prompt_tokens=len(prompt), max_tokens=16, prefix_block_hashes=block_hashes(prompt, 16)
        ),
        timeout=5,
    )
