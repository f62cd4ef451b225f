"""Scale-in and SIGTERM kill no request: a draining instance finishes what it can within its
drain timeout and aborts the rest, and the gateway resumes each aborted stream on another
instance (greedy output identical to an uninterrupted run)."""

from __future__ import annotations

import asyncio
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


async def _streams_through(mesh: Mesh, act: Callable[[blitzmesh.AsyncClient, set[str]], object]) -> list[list]:
    """Start STREAMS streams, call `act` once every stream has its first token, collect all."""
    async with blitzmesh.AsyncClient(mesh.gateway_grpc, timeout_s=120, max_retries=0) as client:
        started: set[str] = set()
        all_started = asyncio.Event()

        async def run(prompt: str) -> list:
            chunks = []
            async for chunk in client.generate(prompt, **ARGS):
                chunks.append(chunk)
                started.add(prompt)
                if len(started) == STREAMS:
                    all_started.set()
            return chunks

        tasks = [asyncio.create_task(run(f"stream {i}")) for i in range(STREAMS)]
        async with asyncio.timeout(60):
            await all_started.wait()
            result = act(client, await _serving(client))
            if asyncio.iscoroutine(result):
                await result
            return await asyncio.gather(*tasks)


def _check(streams: list[list], references: dict[str, tuple[int, ...]]) -> None:
    for i, chunks in enumerate(streams):
        assert [t for c in chunks for t in c.token_ids] == list(references[f"stream {i}"]), i
        assert chunks[-1].finish_reason == "length" and chunks[-1].usage.completion_tokens == ARGS["max_tokens"]


async def test_scale_in_during_streams_loses_none(drain_mesh: Mesh, references: dict[str, tuple[int, ...]]) -> None:
    before = await _migrations(drain_mesh)

    async def scale_in(client: blitzmesh.AsyncClient, serving: set[str]) -> None:
        assert len(serving) == 3
        result = await client.scale(MODEL, -1)
        assert len(result.instance_ids) == 1

    streams = await _streams_through(drain_mesh, scale_in)
    _check(streams, references)
    assert await _migrations(drain_mesh) > before  # the 0.5 s drain cannot finish 400-token streams


async def test_sigterm_on_a_worker_drains_and_migrates(
    drain_mesh: Mesh, references: dict[str, tuple[int, ...]]
) -> None:
    async with blitzmesh.AsyncClient(drain_mesh.gateway_grpc, timeout_s=60) as client:
        serving = await _serving(client)
    assert len(serving) >= 2
    before = await _migrations(drain_mesh)
    victim: list[str] = []

    def terminate(client: blitzmesh.AsyncClient, serving: set[str]) -> None:
        victim.append(sorted(serving)[0])
        drain_mesh.procs[victim[0]].process.send_signal(signal.SIGTERM)

    streams = await _streams_through(drain_mesh, terminate)
    _check(streams, references)
    assert await _migrations(drain_mesh) > before
    process = drain_mesh.procs[victim[0]].process
    await wait_until(lambda: process.returncode is not None, 20, what=f"{victim[0]} to exit after SIGTERM")
    assert process.returncode == 0
