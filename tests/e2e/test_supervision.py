"""A supervised mesh heals itself: the launcher restarts a SIGKILLed worker, global manager or
gateway on the ports it had, each resumes its role, and requests keep completing; a child that
keeps crashing stops the mesh with the reason.

The tests run in order on one mesh; each waits for the mesh to be whole again before it ends.
"""

from __future__ import annotations

import asyncio
import signal
from collections.abc import AsyncIterator, Callable
from pathlib import Path

import openai
import pytest
import pytest_asyncio

import blitzmesh
from services.common.waiting import wait_until
from services.mesh.launcher import Mesh, MeshConfig, Proc
from services.mesh.supervision import RestartPolicy

pytestmark = [pytest.mark.e2e, pytest.mark.asyncio(loop_scope="module")]

MODEL = "tiny"
FAST = RestartPolicy(initial_backoff_s=0.1, max_backoff_s=1.0, max_restarts=3, window_s=60.0)


@pytest_asyncio.fixture(loop_scope="module", scope="module")
async def healing_mesh(
    make_mesh_config: Callable[..., MeshConfig], tmp_path_factory: pytest.TempPathFactory
) -> AsyncIterator[Mesh]:
    m = Mesh(
        make_mesh_config(tmp_path_factory.mktemp("run-supervised"), workers=2, supervise=True, restart_policy=FAST)
    )
    try:
        await m.start()
        yield m
    finally:
        await m.stop()


async def _kill_and_await_restart(mesh: Mesh, name: str) -> tuple[Proc, Proc]:
    """SIGKILL a child and wait (bounded) until the supervisor has a new process for it serving."""
    old = mesh.procs[name]
    old.process.send_signal(signal.SIGKILL)
    await wait_until(lambda: mesh.procs[name] is not old, 30, what=f"{name} respawned")
    new = mesh.procs[name]
    await mesh.wait_ready(new, 60)
    assert new.process.pid != old.process.pid and new.process.returncode is None
    assert mesh.supervisor is not None and not mesh.supervisor.done()
    return old, new


async def _states(client: blitzmesh.AsyncClient) -> dict[str, str]:
    try:
        return {i.instance_id: i.state for i in (await client.cluster()).instances}
    except blitzmesh.UnavailableError:
        return {}  # the manager (or the gateway's channel to it) is coming back


async def _complete(mesh: Mesh, n: int = 4) -> None:
    async with blitzmesh.AsyncClient(mesh.gateway_grpc, timeout_s=60) as client:
        results = await asyncio.gather(*(client.complete(f"prompt {i}", model=MODEL, max_tokens=4) for i in range(n)))
    assert all(r.finish_reason in ("stop", "length") for r in results)


async def test_killed_serving_worker_is_restarted_and_serves_again(healing_mesh: Mesh) -> None:
    """The other instance answers meanwhile; the restarted process registers as a new IDLE
    worker under its instance id and the manager's min-instances top-up loads it again."""
    async with blitzmesh.AsyncClient(healing_mesh.gateway_grpc, timeout_s=60) as client:
        assert await _states(client) == {"worker-0": "serving", "worker-1": "serving"}
        old, new = await _kill_and_await_restart(healing_mesh, "worker-0")
        await _complete(healing_mesh)
        # Not the old view, still SERVING until its heartbeats time out: the new process's own.
        await wait_until(
            lambda: _registrations(healing_mesh, "worker-0") == ["IDLE", "IDLE"],
            30,
            interval_s=0.1,
            what="the restarted worker-0 registered with the manager as a new IDLE worker",
        )
        await wait_until(
            lambda: _both_serving(client), 60, interval_s=0.2, what="worker-0 SERVING again after its restart"
        )
    log = healing_mesh.log_path("worker-0").read_text()
    assert log.count("event='grpc_listening'") == 2, "the restarted worker's log is not appended to the first one's"
    await _complete(healing_mesh)


def _registrations(mesh: Mesh, instance_id: str) -> list[str]:
    """The state of each registration of `instance_id` the manager logged, in order."""
    lines = mesh.log_path("global_manager").read_text().splitlines()
    return [
        line.split("status='")[1].split("'")[0]
        for line in lines
        if "action='instance_registered'" in line and f"instance_id='{instance_id}'" in line
    ]


async def _both_serving(client: blitzmesh.AsyncClient) -> bool:
    return await _states(client) == {"worker-0": "serving", "worker-1": "serving"}


async def test_killed_global_manager_is_restarted_and_relearns_the_workers(healing_mesh: Mesh) -> None:
    old, new = await _kill_and_await_restart(healing_mesh, "global_manager")
    assert new.ports == old.ports  # workers, gateway and param manager hold its address
    async with blitzmesh.AsyncClient(healing_mesh.gateway_grpc, timeout_s=60) as client:
        # Workers hear `reregister` on their next heartbeat and come back in the state they are in.
        await wait_until(lambda: _both_serving(client), 30, interval_s=0.2, what="GetCluster listing both workers")
    await _complete(healing_mesh)


async def test_killed_gateway_comes_back_on_the_same_ports(healing_mesh: Mesh) -> None:
    http, grpc_address = healing_mesh.gateway_http, healing_mesh.gateway_grpc
    old, new = await _kill_and_await_restart(healing_mesh, "gateway")
    assert new.ports == old.ports
    assert (healing_mesh.gateway_http, healing_mesh.gateway_grpc) == (http, grpc_address)
    await _complete(healing_mesh)
    client = openai.AsyncOpenAI(base_url=http + "/v1", api_key="unused", max_retries=0)
    try:
        answer = await client.completions.create(model=MODEL, prompt="Hello", max_tokens=4)
    finally:
        await client.close()
    assert answer.choices[0].finish_reason in ("stop", "length")


async def test_killed_param_manager_is_restarted_and_a_new_load_works(healing_mesh: Mesh) -> None:
    """The restarted index rebuilds its manifests from the checkpoints: a worker that loads
    after it (worker-1, killed and restarted) gets its parameters."""
    await _kill_and_await_restart(healing_mesh, "param_manager")
    await _kill_and_await_restart(healing_mesh, "worker-1")
    async with blitzmesh.AsyncClient(healing_mesh.gateway_grpc, timeout_s=60) as client:
        await wait_until(lambda: _both_serving(client), 60, interval_s=0.2, what="worker-1 loaded from the new PM")
    await _complete(healing_mesh)


async def test_a_child_that_keeps_crashing_stops_the_mesh_with_the_reason(
    make_mesh_config: Callable[..., MeshConfig], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The gateway restarts with a bogus flag, so every restart exits at once (code 2): after
    `max_restarts` restarts the mesh stops every process and `serve` returns 1, naming it."""
    policy = RestartPolicy(initial_backoff_s=0.05, max_backoff_s=0.1, max_restarts=2, window_s=60.0)
    mesh = Mesh(make_mesh_config(tmp_path, workers=0, restart_policy=policy))
    stop = asyncio.Event()
    served = asyncio.create_task(mesh.serve(stop))
    try:
        await wait_until(lambda: mesh.supervisor is not None or served.done(), 120, what="the mesh up")
        assert not served.done()
        mesh.procs["gateway"].args.append("--no-such-flag")
        mesh.procs["gateway"].process.send_signal(signal.SIGKILL)
        async with asyncio.timeout(60):
            code = await served
    finally:
        stop.set()
        await served
    assert code == 1
    assert all(p.process.returncode is not None for p in mesh.procs.values())
    err = capsys.readouterr().err
    assert err.count("blitzmesh: gateway exited") == 3, err
    assert "gateway exited (signal SIGKILL); restart 1 in 0.05 s" in err
    assert (
        f"gateway exited (code 2) after 2 restarts within 60 s; not restarting it (log {tmp_path}/gateway.log)" in err
    )
    assert "stopping the mesh" in err and "all processes stopped" in err
