"""A hung worker with real processes: SIGSTOP freezes an instance serving streams. The manager
marks it LOST after its heartbeat timeout, the gateway hears that on its cluster-event watch and
resumes the streams elsewhere, long before the gateway's own stall timeout (60 s). SIGCONT
brings the worker back without breaking anything."""

from __future__ import annotations

import asyncio
import signal
import time
from collections.abc import AsyncIterator, Callable

import pytest
import pytest_asyncio

import blitzmesh
from services.common.waiting import wait_until
from services.mesh.launcher import Mesh, MeshConfig

pytestmark = [pytest.mark.e2e, pytest.mark.asyncio(loop_scope="module")]

MODEL = "tiny"
LOST_AFTER_S = 2.0
# LOST after LOST_AFTER_S of silence (+ a control tick), the event, then a resumed stream on the
# other instance recomputing the prompt and the tokens so far: seconds, on a slow machine too.
FAILOVER_BOUND_S = LOST_AFTER_S + 13.0
STREAMS = 4


@pytest_asyncio.fixture(loop_scope="module", scope="module")
async def hang_mesh(
    make_mesh_config: Callable[..., MeshConfig], tmp_path_factory: pytest.TempPathFactory
) -> AsyncIterator[Mesh]:
    m = Mesh(
        make_mesh_config(
            tmp_path_factory.mktemp("run-hang"),
            workers=2,
            manager_args=["--lost-after-s", str(LOST_AFTER_S)],
        )
    )
    try:
        await m.start()
        yield m
    finally:
        await m.stop()


async def _instance_state(client: blitzmesh.AsyncClient, instance_id: str) -> str:
    cluster = await client.cluster()
    return next((i.state for i in cluster.instances if i.instance_id == instance_id), "absent")


async def test_streams_on_a_stopped_worker_complete_elsewhere_and_it_comes_back(hang_mesh: Mesh) -> None:
    args = {"model": MODEL, "max_tokens": 200, "ignore_eos": True, "temperature": 0, "return_token_ids": True}
    async with blitzmesh.AsyncClient(hang_mesh.gateway_grpc, timeout_s=120, max_retries=0) as client:
        whole = await client.complete("Count forever", **args)
        streams = [client.generate("Count forever", **args) for _ in range(STREAMS)]
        firsts = [await anext(s) for s in streams]
        victim = firsts[0].instance_id
        on_victim = sum(f.instance_id == victim for f in firsts)
        process = hang_mesh.procs[victim].process
        process.send_signal(signal.SIGSTOP)
        stopped_s = time.monotonic()
        try:

            async def rest(
                first: blitzmesh.TokenChunk, stream: AsyncIterator[blitzmesh.TokenChunk]
            ) -> list[blitzmesh.TokenChunk]:
                return [first, *[c async for c in stream]]

            async with asyncio.timeout(FAILOVER_BOUND_S):
                results = await asyncio.gather(*(rest(f, s) for f, s in zip(firsts, streams, strict=True)))
            failover_s = time.monotonic() - stopped_s
            print(
                f"\n{on_victim} of {STREAMS} streams were on the stopped {victim}; all done {failover_s:.2f} s after SIGSTOP"
            )
            for chunks in results:
                assert [t for c in chunks for t in c.token_ids] == list(whole.token_ids)
                assert chunks[-1].finish_reason == "length" and chunks[-1].instance_id != victim
            assert await _instance_state(client, victim) == "lost"
        finally:
            process.send_signal(signal.SIGCONT)
        # Running again, it re-registers (what it holds was written off; it reports what it has)
        # and the mesh serves on, on either instance.
        await wait_until(lambda: _not_lost(client, victim), 30, what=f"{victim} to re-register after SIGCONT")
        assert process.returncode is None
        again = await asyncio.gather(*(client.complete("Count forever", **args) for _ in range(STREAMS)))
        assert all(list(c.token_ids) == list(whole.token_ids) for c in again)


async def _not_lost(client: blitzmesh.AsyncClient, instance_id: str) -> bool:
    return await _instance_state(client, instance_id) in ("serving", "idle", "loading")
