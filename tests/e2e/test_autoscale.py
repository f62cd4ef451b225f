"""Autoscaling end to end: a step burst against a mesh of IDLE workers makes the manager scale
out (parameters really move: LOADING -> SERVING, the parameter manager lists the new holders),
the burst ends and it scales back in after the cooldown; every request sent ends in a
completion or a clear error, none is lost.

The workers pace each engine step like an accelerator (A + B * batch tokens), so capacity
grows with instances even on two cores, and the policy's target is low enough that a modest
burst needs the whole pool whatever the machine's speed.
"""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
import json
from collections.abc import AsyncIterator, Callable

import pytest
import pytest_asyncio

import blitzmesh
from blitzmesh.replay import replay, step_pattern
from blitzmesh.types import ClusterEvent
from blitzmesh.v1 import param_manager_pb2, param_manager_pb2_grpc
from services.mesh.launcher import Mesh, MeshConfig

pytestmark = [pytest.mark.e2e, pytest.mark.slow, pytest.mark.asyncio(loop_scope="module"), pytest.mark.timeout(150)]

MODEL = "tiny"
WORKERS = 4
SCALE_IN_COOLDOWN_S = 4.0
POLICY = {
    # 4 requests/s of 48 tokens is ~190 decode tokens/s: at 30 per instance that wants > 4.
    "target_decode_tps_per_instance": 30,
    "scale_out_cooldown_s": 1.0,
    "scale_in_cooldown_s": SCALE_IN_COOLDOWN_S,
    "scale_in_threshold": 0.3,
    "enable_latency_trigger": False,
}


@pytest_asyncio.fixture(loop_scope="module", scope="module")
async def autoscale_mesh(
    make_mesh_config: Callable[..., MeshConfig], tmp_path_factory: pytest.TempPathFactory
) -> AsyncIterator[Mesh]:
    cfg = make_mesh_config(tmp_path_factory.mktemp("run-autoscale"), workers=WORKERS)
    cfg = dataclasses.replace(
        cfg,
        initial_instances=1,
        worker_args=["--step-time-a-s", "0.02", "--step-time-b-s", "0.0005"],
        manager_args=[
            "--autoscale",
            "--policy",
            "heteroscale",
            "--policy-params",
            json.dumps(POLICY),
            "--max-instances",
            str(WORKERS),
            "--window-s",
            "2",
            "--tick-s",
            "0.25",
            "--decision-repeat-s",
            "5",
        ],
    )
    m = Mesh(cfg)
    try:
        await m.start()
        yield m
    finally:
        await m.stop()


async def _holders(mesh: Mesh) -> set[str]:
    """Instances the parameter manager lists as holding every group of the model."""
    async with mesh.channel("param_manager") as ch:
        resp = await param_manager_pb2_grpc.ParamManagerStub(ch).Locate(
            param_manager_pb2.LocateRequest(model_id=MODEL), timeout=5
        )
    per_group = [{h for h in loc.holders if h.startswith("worker-")} for loc in resp.locations]
    return set.intersection(*per_group) if per_group else set()


async def _states(client: blitzmesh.AsyncClient) -> dict[str, str]:
    return {i.instance_id: i.state for i in (await client.cluster()).instances}


async def _wait_for(events: list[ClusterEvent], pred: Callable[[ClusterEvent], bool], timeout_s: float) -> ClusterEvent:
    async with asyncio.timeout(timeout_s):
        while True:
            for ev in events:
                if pred(ev):
                    return ev
            await asyncio.sleep(0.1)


async def test_step_burst_scales_out_then_in(autoscale_mesh: Mesh) -> None:
    mesh = autoscale_mesh
    events: list[ClusterEvent] = []
    async with blitzmesh.AsyncClient(mesh.gateway_grpc, timeout_s=30) as client:

        async def watch() -> None:
            async for ev in client.watch_events():
                events.append(ev)

        watcher = asyncio.create_task(watch())
        try:
            states = await _states(client)
            first = {i for i, s in states.items() if s == "serving"}
            assert len(first) == 1 and sorted(s for s in states.values()) == ["idle", "idle", "idle", "serving"]
            assert await _holders(mesh) == first

            # A 12 s step burst, open loop, then quiet.
            arrivals = step_pattern(
                base_rps=0.0,
                burst_rps=4.0,
                burst_start_s=0.5,
                burst_end_s=12.5,
                duration_s=12.5,
                prompt_tokens=(8, 24),
                output_tokens=48,
                seed=7,
                poisson=False,
            )
            burst = asyncio.create_task(
                replay(
                    arrivals,
                    http_url=mesh.gateway_http,
                    model=MODEL,
                    admin_target=mesh.gateway_grpc,
                    request_timeout_s=40,
                    drain_timeout_s=30,
                    vocab_size=2048,
                )
            )

            # Scale-out: a decision with its reason, then parameters move to a new instance.
            out = await _wait_for(events, lambda e: e.action == "autoscaling_decision" and e.target == "scale_out", 25)
            assert out.reason.startswith("SCALE_OUT: ratio=") and out.status.startswith("instances:1->")
            loaded = await _wait_for(
                events, lambda e: e.action == "load_result" and e.status == "ok" and e.instance_id not in first, 25
            )
            new = loaded.instance_id
            assert new in await _holders(mesh)  # the parameter manager lists the new holder
            went_loading = [
                e for e in events if e.action == "scale_out" and e.status == "loading" and e.instance_id == new
            ]
            assert went_loading, "the new instance was never LOADING"

            result = await burst
            peak = max((s.serving for s in result.instances), default=0)
            assert peak >= 2, [(s.t_s, s.counts) for s in result.instances]

            # Every request ended in a completion or a clear error; none was lost.
            outcomes = [r.outcome for r in result.records]
            assert len(outcomes) == len(arrivals) == 48
            assert outcomes.count("lost") == 0, [r.error for r in result.records if r.outcome == "lost"]
            assert all(r.error for r in result.records if r.outcome == "error")
            assert outcomes.count("ok") >= 0.9 * len(outcomes), [r.error for r in result.records if r.error]

            # Scale-in after the burst: drained back to one SERVING instance, the rest IDLE.
            async with asyncio.timeout(45):
                while True:
                    states = await _states(client)
                    if sorted(states.values()) == ["idle", "idle", "idle", "serving"]:
                        break
                    await asyncio.sleep(0.25)
            ins = [e for e in events if e.action == "autoscaling_decision" and e.target == "scale_in"]
            assert ins and all("SCALE_IN" in e.reason for e in ins)
            for a, b in itertools.pairwise(ins):
                assert b.time_s - a.time_s >= SCALE_IN_COOLDOWN_S - 1e-6  # cooldowns respected
            assert sorted(e.status for e in events if e.action == "drain_result") == ["idle"] * len(
                [e for e in events if e.action == "drain_result"]
            )
            drained = {e.instance_id for e in events if e.action == "drain_result" and e.status == "idle"}
            assert drained and all(states[i] == "idle" for i in drained)
            remaining = {i for i, s in states.items() if s == "serving"}
            assert await _holders(mesh) == remaining  # drained instances left the location index

            # The cluster still serves after scaling in.
            done = await client.complete("after the burst", model=MODEL, max_tokens=4)
            assert done.usage.completion_tokens >= 1
        finally:
            watcher.cancel()
            await asyncio.gather(watcher, return_exceptions=True)
