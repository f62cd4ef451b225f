"""Scale-in and SIGTERM kill no request: a draining instance finishes what it can within its
drain timeout and aborts the rest, and the gateway resumes each aborted stream on another
instance (greedy output identical to an uninterrupted run)."""

from __future__ import annotations

import asyncio
import collections
import re
import signal
from collections.abc import AsyncIterator, Callable

import aiohttp
import pytest
import pytest_asyncio

import blitzmesh
from services.common.waiting import wait_until
from services.mesh.launcher import Mesh, MeshConfig

pytestmark = [pytest.mark.e2e, pytest.mark.asyncio(loop_scope="module")]

MODEL = "tiny"
STREAMS = 20
# 400 tokens at >= 5 ms a step (emulated pacing) outlive the 0.5 s drains below: some streams
# must be migrated, not just finished.
ARGS = {"model": MODEL, "max_tokens": 400, "ignore_eos": True, "temperature": 0, "return_token_ids": True}


@pytest_asyncio.fixture(loop_scope="module", scope="module")
async def drain_mesh(
    make_mesh_config: Callable[..., MeshConfig], tmp_path_factory: pytest.TempPathFactory
) -> AsyncIterator[Mesh]:
    cfg = make_mesh_config(tmp_path_factory.mktemp("run-migration"), workers=3)
    cfg.worker_args = [*cfg.worker_args, "--drain-timeout-s", "0.5"]
    cfg.manager_args = [*cfg.manager_args, "--drain-timeout-s", "0.5"]
    m = Mesh(cfg)
    try:
        await m.start()
        yield m
    finally:
        await m.stop()


@pytest_asyncio.fixture(loop_scope="module", scope="module")
async def references(drain_mesh: Mesh) -> dict[str, tuple[int, ...]]:
    """Each prompt's greedy tokens, served whole before anything is drained."""
    async with blitzmesh.AsyncClient(drain_mesh.gateway_grpc, timeout_s=120) as client:
        done = await asyncio.gather(*(client.complete(f"stream {i}", **ARGS) for i in range(STREAMS)))
    return {f"stream {i}": c.token_ids for i, c in enumerate(done)}


async def _migrations(mesh: Mesh) -> float:
    async with aiohttp.ClientSession() as s, s.get(mesh.gateway_http + "/metrics") as r:
        text = await r.text()
    return sum(float(v) for v in re.findall(r"^blitzmesh_gateway_migrations_total\{[^}]*\} (\S+)$", text, re.M))


async def _serving(client: blitzmesh.AsyncClient) -> set[str]:
    return {i.instance_id for i in (await client.cluster()).instances if i.state == "serving"}


async def _streams_through(
    mesh: Mesh, act: Callable[[blitzmesh.AsyncClient, collections.Counter[str]], object]
) -> list[list]:
    """Start STREAMS streams; once every stream has its first token, call `act` with how many
    streams each instance serves; collect all."""
    async with blitzmesh.AsyncClient(mesh.gateway_grpc, timeout_s=120, max_retries=0) as client:
        started: dict[str, str] = {}
        all_started = asyncio.Event()

        async def run(prompt: str) -> list:
            chunks = []
            async for chunk in client.generate(prompt, **ARGS):
                chunks.append(chunk)
                started.setdefault(prompt, chunk.instance_id)
                if len(started) == STREAMS:
                    all_started.set()
            return chunks

        tasks = [asyncio.create_task(run(f"stream {i}")) for i in range(STREAMS)]
        async with asyncio.timeout(60):
            await all_started.wait()
            result = act(client, collections.Counter(started.values()))
            if asyncio.iscoroutine(result):
                await result
            return await asyncio.gather(*tasks)


def _check(streams: list[list], references: dict[str, tuple[int, ...]]) -> None:
    for i, chunks in enumerate(streams):
        assert [t for c in chunks for t in c.token_ids] == list(references[f"stream {i}"]), i
        assert chunks[-1].finish_reason == "length" and chunks[-1].usage.completion_tokens == ARGS["max_tokens"]


async def test_scale_in_during_streams_loses_none(drain_mesh: Mesh, references: dict[str, tuple[int, ...]]) -> None:
    before = await _migrations(drain_mesh)

    drained: list[int] = []

    async def scale_in(client: blitzmesh.AsyncClient, streams_on: collections.Counter[str]) -> None:
        assert len(await _serving(client)) == 3
        result = await client.scale(MODEL, -1)
        assert len(result.instance_ids) == 1
        drained.append(streams_on[result.instance_ids[0]])

    streams = await _streams_through(drain_mesh, scale_in)
    _check(streams, references)
    if drained[0]:  # the 0.5 s drain cannot finish 400-token streams: they moved
        assert await _migrations(drain_mesh) >= before + drained[0]


async def test_sigterm_on_a_worker_drains_and_migrates(
    drain_mesh: Mesh, references: dict[str, tuple[int, ...]]
) -> None:
    async with blitzmesh.AsyncClient(drain_mesh.gateway_grpc, timeout_s=60) as client:
        serving = await _serving(client)
    assert len(serving) >= 2
    before = await _migrations(drain_mesh)
    victim: list[str] = []

    def terminate(client: blitzmesh.AsyncClient, streams_on: collections.Counter[str]) -> None:
        victim.append(streams_on.most_common(1)[0][0])  # the busiest: its streams must move
        drain_mesh.procs[victim[0]].process.send_signal(signal.SIGTERM)

    streams = await _streams_through(drain_mesh, terminate)
    _check(streams, references)
    assert await _migrations(drain_mesh) > before
    process = drain_mesh.procs[victim[0]].process
    await wait_until(lambda: process.returncode is not None, 20, what=f"{victim[0]} to exit after SIGTERM")
    assert process.returncode == 0


# ---- rebalancing on scale-out ------------------------------------------------------------------

QUEUED = 8
SLOW = {"model": MODEL, "max_tokens": 100, "ignore_eos": True, "temperature": 0, "return_token_ids": True}


@pytest_asyncio.fixture(loop_scope="module", scope="module")
async def queue_mesh(
    make_mesh_config: Callable[..., MeshConfig], tmp_path_factory: pytest.TempPathFactory
) -> AsyncIterator[Mesh]:
    """One SERVING instance that runs two requests at a time (20 ms steps), one IDLE worker."""
    cfg = make_mesh_config(tmp_path_factory.mktemp("run-rebalance"), workers=2)
    cfg.initial_instances = 1
    cfg.worker_args = ["--step-time-a-s", "0.02", "--step-time-b-s", "0", "--max-batch-size", "2"]
    m = Mesh(cfg)
    try:
        await m.start()
        yield m
    finally:
        await m.stop()


async def test_queued_requests_move_to_a_new_instance(queue_mesh: Mesh) -> None:
    async with blitzmesh.AsyncClient(queue_mesh.gateway_grpc, timeout_s=120, max_retries=0) as client:
        (first,) = await _serving(client)

        async def run(i: int) -> list:
            return [c async for c in client.generate(f"queued {i}", **SLOW)]

        tasks = [asyncio.create_task(run(i)) for i in range(QUEUED)]
        # Two run, six wait on the one instance; a new one joins.
        await wait_until(lambda: _waiting(client, first), 30, what=f"requests queued on {first}", interval_s=0.1)
        scaled = await client.scale(MODEL, 1, wait=True, timeout_s=60)
        (new,) = scaled.instance_ids
        streams = await asyncio.gather(*tasks)
        references = await asyncio.gather(*(client.complete(f"queued {i}", **SLOW) for i in range(QUEUED)))
    for chunks, whole in zip(streams, references, strict=True):
        assert [t for c in chunks for t in c.token_ids] == list(whole.token_ids)
    on_new = sum(1 for chunks in streams if chunks[-1].instance_id == new)
    async with aiohttp.ClientSession() as s, s.get(queue_mesh.gateway_http + "/metrics") as r:
        metrics = await r.text()
    moved = re.search(r'^blitzmesh_gateway_moves_total\{reason="rebalance"\} (\S+)$', metrics, re.M)
    assert moved is not None and float(moved.group(1)) >= 1, metrics[-2000:]
    assert on_new >= float(moved.group(1))  # every moved request ran on the new instance


async def _waiting(client: blitzmesh.AsyncClient, instance_id: str) -> bool:
    for info in (await client.cluster()).instances:
        if info.instance_id == instance_id and info.load is not None:
            return info.load.waiting >= QUEUED - 2
    return False
