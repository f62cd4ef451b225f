"""Faults with real processes: a worker SIGKILLed mid-stream (its streams migrate), a global
manager restart.

Every accepted request must end in a completion or a clear error; nobody hangs.
"""

from __future__ import annotations

import asyncio
import signal
from collections.abc import AsyncIterator, Callable

import grpc
import openai
import pytest
import pytest_asyncio

import blitzmesh
from blitzmesh.replay import replay, step_pattern
from blitzmesh.v1 import worker_pb2, worker_pb2_grpc
from services.mesh.launcher import Mesh, MeshConfig

pytestmark = [pytest.mark.e2e, pytest.mark.asyncio(loop_scope="module")]

MODEL = "tiny"


@pytest_asyncio.fixture(loop_scope="module", scope="module")
async def fault_mesh(
    make_mesh_config: Callable[..., MeshConfig], tmp_path_factory: pytest.TempPathFactory
) -> AsyncIterator[Mesh]:
    m = Mesh(make_mesh_config(tmp_path_factory.mktemp("run-faults"), workers=3))
    try:
        await m.start()
        yield m
    finally:
        await m.stop()


async def _running(mesh: Mesh, name: str) -> int:
    """Requests running on a worker; 0 for one that is gone (killed by an earlier test)."""
    try:
        async with mesh.channel(name) as ch:
            info = await worker_pb2_grpc.WorkerStub(ch).GetStatus(worker_pb2.GetStatusRequest(), timeout=5)
    except grpc.aio.AioRpcError:
        return 0
    return info.load.running


def _kill(mesh: Mesh, instance_id: str) -> None:
    mesh.procs[instance_id].process.send_signal(signal.SIGKILL)


PROMPT = "Count forever"


async def test_worker_killed_mid_stream_sdk_stream_migrates(fault_mesh: Mesh) -> None:
    """SIGKILL of the instance serving a stream: the stream goes on from another instance, with
    the tokens an uninterrupted run gives (greedy), none repeated or missing."""
    async with blitzmesh.AsyncClient(fault_mesh.gateway_grpc, timeout_s=60, max_retries=0) as client:
        args = {"model": MODEL, "max_tokens": 200, "ignore_eos": True, "temperature": 0, "return_token_ids": True}
        whole = await client.complete(PROMPT, **args)
        stream = client.generate(PROMPT, **args)
        first = await anext(stream)
        victim = first.instance_id
        assert victim in fault_mesh.procs
        _kill(fault_mesh, victim)
        async with asyncio.timeout(30):
            chunks = [first, *[c async for c in stream]]
    assert [t for c in chunks for t in c.token_ids] == list(whole.token_ids)
    assert "".join(c.text for c in chunks) == whole.text
    assert chunks[-1].finish_reason == "length" and chunks[-1].usage is not None
    assert chunks[-1].usage.completion_tokens == 200
    assert chunks[-1].instance_id != victim


async def test_worker_killed_mid_stream_openai_stream_completes(fault_mesh: Mesh) -> None:
    alive = [n for n, p in fault_mesh.procs.items() if n.startswith("worker") and p.process.returncode is None]
    assert len(alive) >= 2, alive
    client = openai.AsyncOpenAI(base_url=fault_mesh.gateway_http + "/v1", api_key="unused", max_retries=0)
    args = {"model": MODEL, "prompt": PROMPT, "max_tokens": 200, "temperature": 0, "extra_body": {"ignore_eos": True}}
    try:
        whole = await client.completions.create(**args)
        stream = await client.completions.create(**args, stream=True)
        text, killed, finish = "", None, None
        async with asyncio.timeout(30):
            async for chunk in stream:
                text += chunk.choices[0].text
                finish = chunk.choices[0].finish_reason or finish
                if killed is None:
                    for name in alive:
                        if await _running(fault_mesh, name) > 0:
                            killed = name
                            _kill(fault_mesh, name)
                            break
    finally:
        await client.close()
    assert killed is not None
    assert text == whole.choices[0].text and finish == "length"


async def test_requests_still_served_after_kills(fault_mesh: Mesh) -> None:
    async with blitzmesh.AsyncClient(fault_mesh.gateway_grpc, timeout_s=60) as client:
        results = await asyncio.gather(*(client.complete(f"prompt {i}", model=MODEL, max_tokens=4) for i in range(6)))
    assert all(r.finish_reason in ("stop", "length") for r in results)


async def test_global_manager_restart_mid_run_loses_no_instance_and_no_request(fault_mesh: Mesh) -> None:
    """Requests keep arriving (open loop) while the manager is killed and restarted: the
    registry is rebuilt from re-registration and every request completes (the gateway waits
    for a route while the manager is away; streams already routed never touch it)."""
    arrivals = step_pattern(
        base_rps=4.0,
        burst_rps=4.0,
        burst_start_s=0.0,
        burst_end_s=0.0,
        duration_s=6.0,
        prompt_tokens=(4, 12),
        output_tokens=24,
        seed=3,
        poisson=False,
    )
    async with blitzmesh.AsyncClient(fault_mesh.gateway_grpc, timeout_s=60) as client:
        alive = {n for n, p in fault_mesh.procs.items() if p.process.returncode is None}
        # Workers killed by earlier tests may still be listed until their heartbeats time out.
        before = {i.instance_id for i in (await client.cluster()).instances if i.state == "serving"} & alive
        assert before
        traffic = asyncio.create_task(
            replay(
                arrivals,
                http_url=fault_mesh.gateway_http,
                model=MODEL,
                request_timeout_s=40,
                drain_timeout_s=40,
                vocab_size=2048,
            )
        )
        await asyncio.sleep(1.0)  # requests are in flight on the workers
        await fault_mesh.restart("global_manager")
        # Workers hear `reregister` on their next heartbeat (1 s period); wait on the registry.
        async with asyncio.timeout(30):
            while True:
                try:
                    cluster = await client.cluster()
                except blitzmesh.UnavailableError:
                    cluster = None  # the gateway's channel to the new manager is reconnecting
                after = {i.instance_id for i in cluster.instances if i.state == "serving"} if cluster else set()
                if after == before:
                    break
                await asyncio.sleep(0.2)
        result = await traffic
        outcomes = [r.outcome for r in result.records]
        assert len(outcomes) == len(arrivals) == 24
        assert outcomes.count("ok") == len(outcomes), [(r.outcome, r.error) for r in result.records if r.error]
        done = await client.complete("after restart", model=MODEL, max_tokens=4)
        assert done.usage.completion_tokens >= 1
