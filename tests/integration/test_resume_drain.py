"""A scale-out takes back a scale-in whose drain still waits: the worker's Resume ends the drain,
the instance serves on with its weights and its requests (no reload, nothing moved), and every
stream gives the tokens of a run that was never drained. A drain that is final (SIGTERM's, or
one that has finished) is not taken back. Real workers and a real mesh, in this process."""

from __future__ import annotations

import asyncio
import collections
from pathlib import Path
from typing import Any

import grpc
import pytest
from prometheus_client import REGISTRY

import blitzmesh
from blitzmesh.v1 import common_pb2, worker_pb2
from services.common.waiting import wait_until
from tests.integration.mini_mesh import MODEL, mini_mesh
from tests.integration.test_disagg_worker import collect_tokens, request, workers

pytestmark = pytest.mark.timeout(180)

ServeFactory = Any  # tests/integration/conftest.py: serve_in_process
PROMPT = [1, *range(5, 30)]
# 10 ms a step (emulated pacing): 150 tokens outlive the few RPCs between a drain and its resume.
PACING = {"step_time_a_s": 0.01, "step_time_b_s": 0.0}
COLOCATED = {"w": common_pb2.INSTANCE_ROLE_COLOCATED}


async def test_resume_ends_a_waiting_drain_and_the_request_runs_on_unchanged(
    tiny_models: Path, serve_in_process: ServeFactory
) -> None:
    async with workers(tiny_models, serve_in_process, COLOCATED, **PACING) as ws:
        svc, stub = ws["w"]
        reference = await collect_tokens(stub.Generate(request("ref", PROMPT, max_tokens=150), timeout=60))
        running = asyncio.create_task(collect_tokens(stub.Generate(request("a", PROMPT, max_tokens=150), timeout=60)))
        await wait_until(lambda: bool(svc.servicer._inflight), 10, interval_s=0.01, what="request a in flight")
        drain = asyncio.ensure_future(stub.Drain(worker_pb2.DrainRequest(timeout_s=60, instance_id="w"), timeout=70))
        await wait_until(lambda: svc.servicer.state == "draining", 10, interval_s=0.01, what="the drain to start")
        resumed = await stub.Resume(worker_pb2.ResumeRequest(reason="test", instance_id="w"), timeout=10)
        assert resumed.in_flight == 1
        drained = await drain
        assert drained.resumed and drained.aborted == 0
        assert not running.done()  # the drain ended before its request did
        status = await stub.GetStatus(worker_pb2.GetStatusRequest(), timeout=10)
        assert status.state == common_pb2.INSTANCE_STATE_SERVING
        assert await running == reference and len(reference) == 150
        # It takes new work again, with the same weights.
        assert await collect_tokens(stub.Generate(request("b", PROMPT, max_tokens=150), timeout=60)) == reference
        # Nothing to take back now: refused, saying why.
        with pytest.raises(grpc.aio.AioRpcError) as e:
            await stub.Resume(worker_pb2.ResumeRequest(instance_id="w"), timeout=10)
        assert e.value.code() == grpc.StatusCode.FAILED_PRECONDITION and "SERVING" in (e.value.details() or "")


async def test_a_final_drain_is_not_taken_back(tiny_models: Path, serve_in_process: ServeFactory) -> None:
    async with workers(tiny_models, serve_in_process, COLOCATED, **PACING) as ws:
        svc, stub = ws["w"]
        running = asyncio.create_task(collect_tokens(stub.Generate(request("a", PROMPT, max_tokens=150), timeout=60)))
        await wait_until(lambda: bool(svc.servicer._inflight), 10, interval_s=0.01, what="request a in flight")
        # SIGTERM's drain (not the manager's): final.
        shutdown = asyncio.create_task(svc.servicer.drain(60))
        await wait_until(lambda: svc.servicer.state == "draining", 10, interval_s=0.01, what="the drain to start")
        with pytest.raises(grpc.aio.AioRpcError) as e:
            await stub.Resume(worker_pb2.ResumeRequest(instance_id="w"), timeout=10)
        assert e.value.code() == grpc.StatusCode.FAILED_PRECONDITION and "final" in (e.value.details() or "")
        assert len(await running) == 150  # it finished where it ran
        assert tuple(await shutdown) == (1, 0, False)
        # The manager's drain of an instance with nothing in flight finishes at once: too late.
        done = await stub.Drain(worker_pb2.DrainRequest(timeout_s=60, instance_id="w"), timeout=70)
        assert (done.finished, done.aborted, done.resumed) == (0, 0, False)
        with pytest.raises(grpc.aio.AioRpcError) as e:
            await stub.Resume(worker_pb2.ResumeRequest(instance_id="w"), timeout=10)
        assert e.value.code() == grpc.StatusCode.FAILED_PRECONDITION and "DRAINING" in (e.value.details() or "")


def _actions(kind: str, outcome: str) -> float:
    return REGISTRY.get_sample_value("blitzmesh_gm_scale_actions_total", {"kind": kind, "outcome": outcome}) or 0.0


async def test_a_scale_out_takes_back_the_scale_in_it_overtakes(tiny_models: Path, serve_in_process: Any) -> None:
    """Admin.Scale -1 drains an instance with streams on it; Admin.Scale +1 before they end
    takes that drain back (no IDLE worker is left: before, it was refused): its streams finish
    where they run, with the tokens of an undrained run, and the instance serves on."""
    args = {"model": MODEL, "max_tokens": 150, "ignore_eos": True, "temperature": 0, "return_token_ids": True}
    prompts = [f"stream {i}" for i in range(4)]
    async with (
        mini_mesh(
            tiny_models,
            serve_in_process,
            workers={"w-0": PACING, "w-1": PACING},
            manager={"drain_timeout_s": 60},
        ) as mesh,
        blitzmesh.AsyncClient(mesh.grpc_address, timeout_s=90, max_retries=0) as client,
    ):
        whole = await asyncio.gather(*(client.complete(p, **args) for p in prompts))
        reference = {p: c.token_ids for p, c in zip(prompts, whole, strict=True)}
        before = {o: _actions("drain", o) for o in ("resumed", "ok")}
        started: dict[str, str] = {}
        all_started = asyncio.Event()

        async def stream(prompt: str) -> list:
            chunks = []
            async for chunk in client.generate(prompt, **args):
                chunks.append(chunk)
                started.setdefault(prompt, chunk.instance_id)
                if len(started) == len(prompts):
                    all_started.set()
            return chunks

        tasks = [asyncio.create_task(stream(p)) for p in prompts]
        async with asyncio.timeout(30):
            await all_started.wait()
        on = collections.Counter(started.values())
        assert set(on) == {"w-0", "w-1"}, on  # both serving instances hold streams
        (victim,) = (await client.scale(MODEL, -1)).instance_ids
        victim_worker = mesh.workers[victim].servicer
        await wait_until(lambda: victim_worker.state == "draining", 10, interval_s=0.01, what=f"{victim} draining")
        out = await client.scale(MODEL, 1)
        assert list(out.instance_ids) == [victim] and "taken back" in out.reason, out
        await wait_until(lambda: victim_worker.state == "serving", 10, interval_s=0.01, what=f"{victim} serving")
        streams = dict(zip(prompts, await asyncio.gather(*tasks), strict=True))
        for prompt, chunks in streams.items():
            assert [t for c in chunks for t in c.token_ids] == list(reference[prompt]), prompt
            assert {c.instance_id for c in chunks} == {started[prompt]}, prompt  # none moved
            assert chunks[-1].finish_reason == "length"
        assert any(started[p] == victim for p in prompts)
        state = {i.instance_id: i.state for i in (await client.cluster()).instances}
        assert state == {"w-0": "serving", "w-1": "serving"}, state
        assert _actions("drain", "resumed") == before["resumed"] + 1
        assert _actions("drain", "ok") == before["ok"]
