"""Scale from zero: a request for a listed model with no instance starts one load and waits for it.

The manager answers UNAVAILABLE while the instance loads; these tests retry the way the gateway
does (capped backoff, bounded) and get a route once it serves. Real gRPC manager, fake workers
and parameter manager (the fixture of test_global_manager_autoscale).
"""

from __future__ import annotations

import asyncio
from typing import Any

import grpc
import pytest

from blitzmesh.v1 import global_manager_pb2, global_manager_pb2_grpc
from services.common.waiting import wait_until
from services.global_manager.core.types import InstanceState
from tests.integration.test_global_manager_autoscale import MODEL, Cluster, cluster, schedule

pytestmark = pytest.mark.timeout(60)

# No floor and no policy: only a request can bring the model up.
COLD = {"min_instances": 0, "autoscale": False, "max_instances": 3}


async def idle_workers(c: Cluster, n: int) -> None:
    registry = c.gm.servicer.table.registry
    await wait_until(lambda: len(registry.views(state=InstanceState.IDLE)) == n, 5, what=f"{n} IDLE workers")


async def route_when_served(c: Cluster, rid: str, timeout_s: float = 10.0) -> tuple[Any, list[str]]:
    """Schedule as the gateway's `_schedule_rpc` does: retry UNAVAILABLE with a capped backoff,
    within a bound. Returns the route and the UNAVAILABLE details seen before it."""
    details: list[str] = []
    backoff_s = 0.05
    async with asyncio.timeout(timeout_s):
        while True:
            try:
                return await schedule(c, rid), details
            except grpc.aio.AioRpcError as e:
                assert e.code() == grpc.StatusCode.UNAVAILABLE, e.details()
                details.append(e.details() or "")
            await asyncio.sleep(backoff_s)
            backoff_s = min(1.0, backoff_s * 2)


def scale_outs(c: Cluster) -> list[str]:
    return [e.instance_id for e in c.events if e.action == "scale_out" and e.status == "loading"]


async def test_a_request_for_a_listed_model_scales_it_from_zero_once(serve_in_process: Any) -> None:
    async with cluster(serve_in_process, n_workers=2, **COLD) as c:
        await idle_workers(c, 2)
        c.workers["w0"].load_s = 0.5
        # A burst of first requests: all wait, one load starts.
        first = await asyncio.gather(*(schedule(c, f"r{i}") for i in range(5)), return_exceptions=True)
        assert all(isinstance(e, grpc.aio.AioRpcError) for e in first), first
        codes = {e.code() for e in first if isinstance(e, grpc.aio.AioRpcError)}
        assert codes == {grpc.StatusCode.UNAVAILABLE}
        details = [e.details() or "" for e in first if isinstance(e, grpc.aio.AioRpcError)]
        assert sum("scale_from_zero: w0 LOADING, retry" in d for d in details) == 1, details
        assert all("w0 LOADING" in d or "scale_from_zero: deciding, retry" in d for d in details), details
        (event,) = await c.wait_event(lambda e: e.action == "scale_from_zero")
        assert event.instance_id == "w0" and event.target == MODEL and event.status == "loading"
        assert "found no SERVING or LOADING instance" in event.reason and f"listed model {MODEL!r}" in event.reason
        assert scale_outs(c) == ["w0"]
        assert any(",scale_from_zero,m,w0,scale_from_zero: request 'r" in line for line in c.gm.servicer.decision_log)

        route, waited = await route_when_served(c, "r-late")
        assert [(h.instance_id, h.layer_start, h.layer_end) for h in route.hops] == [("w0", 0, 2)]
        assert all("waiting for w0 LOADING" in d for d in waited), waited
        await c.wait_event(lambda e: e.action == "load_result" and e.status == "ok" and e.instance_id == "w0")
        # Still one load: the others saw w0 LOADING; w1 stays IDLE for the autoscaler.
        assert scale_outs(c) == ["w0"] and len([e for e in c.events if e.action == "scale_from_zero"]) == 1
        assert c.state("w1") == "IDLE" and c.pm.holders == {"w0"}


async def test_a_failed_load_from_zero_is_retried_and_the_request_still_served(serve_in_process: Any) -> None:
    async with cluster(serve_in_process, n_workers=2, load_retries=1, **COLD) as c:
        await idle_workers(c, 2)
        c.workers["w0"].fail_load = True
        route, _ = await route_when_served(c, "r")
        assert [h.instance_id for h in route.hops] == ["w1"]
        (failed,) = [e for e in c.events if e.action == "load_result" and e.status == "failed"]
        assert failed.instance_id == "w0" and "crc" in failed.reason
        assert scale_outs(c) == ["w0", "w1"]  # the manager's own retry, not a second scale from zero
        assert len([e for e in c.events if e.action == "scale_from_zero"]) == 1


@pytest.mark.parametrize(
    ("n_workers", "settings", "model"),
    [
        (2, {}, "not-listed"),  # a model the parameter manager does not list takes no worker
        (2, {"scale_from_zero": False}, MODEL),  # switched off
        (0, {}, MODEL),  # no IDLE worker to load it on
    ],
    ids=["unlisted", "off", "no_idle_worker"],
)
async def test_no_scale_from_zero(serve_in_process: Any, n_workers: int, settings: dict[str, Any], model: str) -> None:
    async with cluster(serve_in_process, n_workers=n_workers, **COLD, **settings) as c:
        await idle_workers(c, n_workers)
        stub: global_manager_pb2_grpc.GlobalManagerStub = c.stub
        for i in range(3):
            with pytest.raises(grpc.aio.AioRpcError) as e:
                await stub.Schedule(global_manager_pb2.ScheduleRequest(request_id=f"r{i}", model_id=model), timeout=5)
            assert e.value.code() == grpc.StatusCode.UNAVAILABLE
            assert f"no SERVING instance of model {model!r}" in (e.value.details() or "")
            assert "scale_from_zero" not in (e.value.details() or "")
        for _ in range(3):
            c.gm.servicer.tick()  # control ticks, run here: nothing loads on its own either
        assert not [e for e in c.events if e.action in ("scale_out", "scale_from_zero")]
        assert all(c.state(i) == "IDLE" for i in c.workers)
