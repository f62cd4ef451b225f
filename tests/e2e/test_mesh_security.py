"""Nobody without the right certificate gets past an internal service: a mesh of real processes
with real mTLS (as `make up` starts it), every method of every internal service called as every
kind of caller (bench/security/probe.py). On the code before mTLS every one of these calls was
answered by the servicer."""

from __future__ import annotations

import dataclasses
import json
import random
from collections.abc import AsyncIterator, Callable
from pathlib import Path

import pytest
import pytest_asyncio

import blitzmesh
from bench.security import probe
from blitzmesh.v1 import param_manager_pb2, param_manager_pb2_grpc
from services.common import pki, roles
from services.common.pki import read_key
from services.dataplane import make_transport
from services.dataplane.auth import AuthenticatedTransport
from services.dataplane.chain import fetch_manifest
from services.dataplane.errors import TransportError
from services.mesh.launcher import Mesh, MeshConfig

MODEL = "tiny"
pytestmark = [pytest.mark.e2e, pytest.mark.asyncio(loop_scope="session")]

ALL_CALLERS = [*probe.UNCERTIFIED, "unknown-name", *(f"role:{r}" for r in roles.ALL_ROLES)]


@pytest_asyncio.fixture(loop_scope="session")
async def secure_mesh(make_mesh_config: Callable[..., MeshConfig], tmp_path: Path) -> AsyncIterator[Mesh]:
    """One SERVING worker, one IDLE (a load it starts is a state change), two host caches."""
    cfg = dataclasses.replace(make_mesh_config(tmp_path / "run", workers=2, host_caches=2), initial_instances=1)
    async with Mesh(cfg) as mesh:
        yield mesh


async def _complete(mesh: Mesh) -> str:
    async with blitzmesh.AsyncClient(mesh.gateway_grpc, timeout_s=60) as client:
        return (await client.complete("The quick brown fox", model=MODEL, max_tokens=4, temperature=0)).text


async def test_every_internal_method_refuses_callers_without_the_right_certificate(
    secure_mesh: Mesh, tmp_path: Path
) -> None:
    assert not secure_mesh.cfg.insecure
    callers = probe.Callers(secure_mesh.cfg.tls_path, tmp_path)
    targets = probe.targets(secure_mesh)
    assert {t.role for t in targets} == {roles.WORKER, roles.GLOBAL_MANAGER, roles.PARAM_MANAGER, roles.HOST_CACHE}
    before = await probe.snapshot(secure_mesh, MODEL)
    assert before["worker-1"][0] != before["worker-0"][0]  # one SERVING, one IDLE to be talked into a load

    # An empty request is a valid message of every type: refused, it is never even parsed.
    tally = await probe.sweep(callers, targets, ALL_CALLERS, [b""], timeout_s=5.0, select="refused")

    assert tally.unexpected == []
    assert tally.hangs == []
    assert tally.ok == 0 and tally.other == {}
    assert tally.calls == tally.refused + tally.handshake_refused > 100
    assert await probe.snapshot(secure_mesh, MODEL) == before
    assert all(probe.alive(secure_mesh).values())
    assert await _complete(secure_mesh)  # the mesh's own callers still get through


async def test_fuzz_without_credentials_changes_nothing(secure_mesh: Mesh, tmp_path: Path) -> None:
    callers = probe.Callers(secure_mesh.cfg.tls_path, tmp_path)
    targets = probe.targets(secure_mesh)
    payloads = list(probe.fuzz_payloads(random.Random(24), 4))
    before = await probe.snapshot(secure_mesh, MODEL)

    refused = await probe.sweep(callers, targets, ALL_CALLERS, payloads, timeout_s=5.0, select="refused")
    assert refused.unexpected == [] and refused.hangs == [] and refused.ok == 0
    assert await probe.snapshot(secure_mesh, MODEL) == before


FUZZ_CALLS = 2000


async def test_garbage_from_every_role_to_every_method_it_may_call_changes_nothing(
    secure_mesh: Mesh, tmp_path: Path
) -> None:
    """Each role's real certificate (a worker's and a host cache's own instance's) sends garbage
    to every method the table lets it call: at least FUZZ_CALLS calls. Whatever parses must be
    refused for what it says (no instance named, the wrong instance, no policy, a bad field),
    so the cluster's policy, mode, every instance's state and model, the location index and
    the pool are what they were; no process dies; no call but a watch stream runs into its
    deadline. On the code before per-instance identities and request checks, garbage
    DeregisterInstance, Unload, Drain and SetPolicy calls changed that state."""
    callers = probe.Callers(secure_mesh.cfg.tls_path, tmp_path)
    assert callers.instances[roles.WORKER] == "worker-0" and callers.instances[roles.HOST_CACHE] == "host-cache-1"
    targets = probe.targets(secure_mesh)
    role_callers = [f"role:{r}" for r in roles.ALL_ROLES]
    allowed_pairs = sum(probe.refusal_expected(c, m) is None for t in targets for m in t.methods for c in role_callers)
    payloads = list(probe.fuzz_payloads(random.Random(46), -(-FUZZ_CALLS // allowed_pairs)))
    before = await probe.snapshot(secure_mesh, MODEL)

    tally = await probe.sweep(
        callers, targets, role_callers, payloads, timeout_s=5.0, watch_timeout_s=0.5, select="allowed", concurrency=32
    )
    print("fuzz with credentials:", json.dumps(tally.to_dict(), sort_keys=True))

    assert tally.calls >= FUZZ_CALLS
    assert len([c for c, n in tally.by_caller.items() if n > 0]) >= 4, tally.by_caller
    assert tally.hangs == []
    assert probe.alive(secure_mesh) == dict.fromkeys(secure_mesh.procs, True)
    assert await probe.snapshot(secure_mesh, MODEL) == before
    assert await _complete(secure_mesh)  # and it still serves


async def test_the_data_plane_serves_no_peer_without_the_mesh_key(secure_mesh: Mesh) -> None:
    """Every data plane server of the mesh (the SERVING worker, the pool's host caches) answers
    a manifest request from a peer that proved it holds the key, and nothing to one that did
    not: the stranger's connection is dropped after the handshake's timeout, unanswered."""
    async with secure_mesh.channel("param_manager") as ch:
        where = await param_manager_pb2_grpc.ParamManagerStub(ch).Locate(
            param_manager_pb2.LocateRequest(model_id=MODEL), timeout=10
        )
    servers = {h.holder_id: (h.dataplane_address, h.dataplane_kind) for loc in where.locations for h in loc.holder_info}
    assert any(kind for _, kind in servers.values()) and len(servers) >= 3  # worker-0 and the host caches
    key = read_key(secure_mesh.cfg.tls_path / pki.DATAPLANE_KEY)
    for holder, (address, kind) in sorted(servers.items()):
        # One transport (ucxx allows one per process): connections through the wrapper prove
        # the key, those made on the bare transport underneath do not.
        stranger = make_transport(kind)  # type: ignore[arg-type]
        insider = AuthenticatedTransport(stranger, key)
        await insider.start()
        try:
            manifest = await fetch_manifest(insider, address, MODEL, timeout_s=10)
            assert manifest.model_id == MODEL, holder
            with pytest.raises(TransportError):
                await fetch_manifest(stranger, address, MODEL, timeout_s=8)
        finally:
            await insider.close()
