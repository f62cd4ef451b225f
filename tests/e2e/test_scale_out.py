"""Scale-out through the gateway's Admin API while requests flow: parameters move along a
chain from the serving instance and the host-cache shards, targets become SERVING with
bit-identical weights, and no request is lost."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Callable

import pytest
import pytest_asyncio

import blitzmesh
from blitzmesh.v1 import param_manager_pb2, param_manager_pb2_grpc
from services.common.grpc_util import channel
from services.mesh.launcher import Mesh, MeshConfig

pytestmark = [pytest.mark.e2e, pytest.mark.asyncio(loop_scope="module")]

MODEL = "tiny"


@pytest_asyncio.fixture(loop_scope="module", scope="module")
async def scale_mesh(
    make_mesh_config: Callable[..., MeshConfig], tmp_path_factory: pytest.TempPathFactory
) -> AsyncIterator[Mesh]:
    cfg = make_mesh_config(tmp_path_factory.mktemp("run-scale"), workers=4, host_caches=2)
    cfg.initial_instances = 1
    m = Mesh(cfg)
    try:
        await m.start()
        yield m
    finally:
        await m.stop()


async def test_scale_out_while_serving(scale_mesh: Mesh) -> None:
    async with blitzmesh.AsyncClient(scale_mesh.gateway_grpc, timeout_s=120) as client:
        reference = await client.complete("The quick brown fox", model=MODEL, max_tokens=8, temperature=0)
        events: list[blitzmesh.ClusterEvent] = []

        async def watch() -> None:
            async for ev in client.watch_events():
                events.append(ev)

        async def traffic() -> list[blitzmesh.Completion]:
            # A bounded stream of requests that overlaps the scale-out.
            return list(
                await asyncio.gather(*(client.complete(f"req {i}", model=MODEL, max_tokens=6) for i in range(12)))
            )

        watcher = asyncio.create_task(watch())
        await asyncio.sleep(0)  # let the watch subscribe before the scale-out starts
        flowing = asyncio.create_task(traffic())
        result = await client.scale(MODEL, 2, wait=True, timeout_s=120)
        assert len(result.instance_ids) == 2
        done = await flowing
        watcher.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await watcher

        assert all(r.finish_reason in ("stop", "length") for r in done), "every request completes"
        cluster = await client.cluster()
        serving = sorted(i.instance_id for i in cluster.instances if i.state == "serving")
        assert len(serving) == 3 and set(result.instance_ids) <= set(serving)
        plans = [e for e in events if e.action == "transfer_plan"]
        assert plans and "->" in plans[0].reason, [e.action for e in events]
        loads = {e.instance_id: e.status for e in events if e.action == "load_result"}
        assert all(loads.get(i) == "ok" for i in result.instance_ids), loads

        # Same greedy output from every instance: the weights arrived bit-identical (each group
        # is also checksum-verified on arrival).
        for _ in range(6):
            again = await client.complete("The quick brown fox", model=MODEL, max_tokens=8, temperature=0)
            assert again.text == reference.text

    # The pool's location index lists the new instances as holders of every group.
    async with channel(scale_mesh.procs["param_manager"].grpc_address) as ch:
        where = await param_manager_pb2_grpc.ParamManagerStub(ch).Locate(
            param_manager_pb2.LocateRequest(model_id=MODEL), timeout=5
        )
    for loc in where.locations:
        assert set(result.instance_ids) <= set(loc.holders), (loc.group, list(loc.holders))
        assert any(h.startswith("host-cache") for h in loc.holders)
