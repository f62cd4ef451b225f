"""`blitzmesh certs rotate` on a running mesh (manager, parameter manager, a host cache, a
worker) under a steady stream of requests: every internal service presents its renewed
certificate to new connections within 10 s, without a restart, and not one request fails."""

from __future__ import annotations

import asyncio
import dataclasses
import io
from collections.abc import Callable
from pathlib import Path

import pytest

import blitzmesh
from blitzmesh import cli
from services.common import pki
from services.common.waiting import wait_until
from services.mesh.launcher import Mesh, MeshConfig, instance_of, role_of
from tests.e2e.conftest import running_mesh
from tests.integration.test_cert_reload import PICKUP_S, file_serial, presented_serial

MODEL = "tiny"
pytestmark = [pytest.mark.e2e, pytest.mark.asyncio(loop_scope="session")]


def own_serial(mesh: Mesh, name: str) -> int:
    """The serial of the certificate on disk that process `name` presents."""
    named = instance_of(name)
    tls_dir = mesh.cfg.tls_path
    return file_serial(tls_dir, *named) if named is not None else file_serial(tls_dir, role_of(name))


async def test_rotation_under_load_is_picked_up_within_10_s_with_no_failed_request(
    make_mesh_config: Callable[..., MeshConfig], tmp_path: Path
) -> None:
    cfg = dataclasses.replace(make_mesh_config(tmp_path / "run", workers=1, host_caches=2), initial_instances=1)
    async with running_mesh(cfg) as mesh:
        internal = sorted(name for name in mesh.procs if name != "gateway")  # the gateway's port is public
        assert len(internal) >= 4, internal
        tls_dir = mesh.cfg.tls_path
        before = {name: own_serial(mesh, name) for name in internal}
        pids = {name: proc.process.pid for name, proc in mesh.procs.items()}
        for name in internal:
            assert await presented_serial(mesh.procs[name].grpc_address, tls_dir, role_of(name)) == before[name]

        done: list[str] = []
        failed: list[str] = []
        stop = asyncio.Event()

        async def load() -> None:
            async with blitzmesh.AsyncClient(mesh.gateway_grpc, timeout_s=60) as client:
                while not stop.is_set():
                    try:
                        out = await client.complete("The quick brown fox", model=MODEL, max_tokens=8, temperature=0)
                        done.append(out.text)
                    except blitzmesh.BlitzmeshError as e:
                        failed.append(repr(e))

        loaders = [asyncio.create_task(load()) for _ in range(4)]
        try:
            await wait_until(lambda: len(done) >= 8, 60, interval_s=0.05, what="the load running")
            out = io.StringIO()
            code = await asyncio.to_thread(cli.main, ["certs", "rotate", "--tls-dir", str(tls_dir), "--json"], out)
            assert code == 0, out.getvalue()
            rotated_s = asyncio.get_running_loop().time()
            after = {name: own_serial(mesh, name) for name in internal}
            assert all(after[n] != before[n] for n in internal), (before, after)

            async def all_new() -> bool:
                for name in internal:
                    seen = await presented_serial(mesh.procs[name].grpc_address, tls_dir, role_of(name))
                    if seen != after[name]:
                        return False
                return True

            await wait_until(all_new, PICKUP_S, interval_s=0.1, what="every service presenting its new certificate")
            pickup_s = asyncio.get_running_loop().time() - rotated_s
            # Keep the load going past the pickup: calls over the renewed channels succeed too.
            at_pickup = len(done)
            await wait_until(lambda: len(done) >= at_pickup + 8, 60, interval_s=0.05, what="load after the pickup")
        finally:
            stop.set()
            await asyncio.gather(*loaders)
        print(f"certificate pickup {pickup_s:.2f} s; {len(done)} requests, {len(failed)} failed")
        assert failed == []
        # Nobody was restarted for it.
        assert {name: proc.process.pid for name, proc in mesh.procs.items()} == pids
        assert all(proc.process.returncode is None for proc in mesh.procs.values())
        assert len(pki.leaf_certificates(tls_dir)) >= len(internal)
