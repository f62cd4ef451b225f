"""An instance acts only for itself: the global manager (and the parameter manager's host-cache
registry) served with real mTLS in this process, called with each instance's own certificate.

Before per-instance certificates every worker presented the one `worker` certificate, and any
of them could register, heartbeat or deregister any instance; each test below shows one worker's
certificate refused for another instance, with the state unchanged, and the owner let through.
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any

import grpc
import pytest

from blitzmesh.v1 import (
    admin_pb2,
    common_pb2,
    global_manager_pb2,
    global_manager_pb2_grpc,
    param_manager_pb2,
    param_manager_pb2_grpc,
)
from services.common import pki, roles
from services.common.grpc_util import channel
from services.common.security import Identity, load_identity, process_identity, use_identity
from services.global_manager.config import GlobalManagerConfig
from services.global_manager.service import GlobalManagerService
from services.param_manager.service import ParamManagerConfig, ParamManagerService

pytestmark = pytest.mark.timeout(60)

WORKERS = ("worker-0", "worker-1")
SERVING = common_pb2.INSTANCE_STATE_SERVING


@pytest.fixture(scope="module")
def tls_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("tls")
    pki.ensure_pki(path, instances=[*((roles.WORKER, w) for w in WORKERS), (roles.HOST_CACHE, "host-cache-1")])
    return path


@contextlib.asynccontextmanager
async def _manager(serve_in_process: Any, tls_dir: Path) -> AsyncIterator[str]:
    before = process_identity()  # serve() sets this process's identity to the manager's
    gm = GlobalManagerService(GlobalManagerConfig(port=0, tls_dir=tls_dir))
    try:
        async with serve_in_process(gm, gm.servicer.cfg) as ctx:
            yield ctx.address
    finally:
        use_identity(before)


def _worker(tls_dir: Path, iid: str | None) -> Identity:
    return load_identity(tls_dir, roles.WORKER, iid)


async def _call(address: str, identity: Identity, rpc: str, request: Any) -> Any:
    async with channel(address, roles.GLOBAL_MANAGER, identity=identity) as ch:
        return await getattr(global_manager_pb2_grpc.GlobalManagerStub(ch), rpc)(request, timeout=5)


async def _instances(address: str, tls_dir: Path) -> dict[str, tuple[int, str]]:
    cluster = await _call(address, load_identity(tls_dir, roles.ADMIN), "GetCluster", admin_pb2.GetClusterRequest())
    return {i.instance_id: (i.state, i.model_id) for i in cluster.instances}


def _register(iid: str) -> global_manager_pb2.RegisterInstanceRequest:
    return global_manager_pb2.RegisterInstanceRequest(
        instance=common_pb2.InstanceInfo(
            instance_id=iid,
            address=f"127.0.0.1:{1000 + int(iid[-1])}",
            state=SERVING,
            model_id="m",
            layers_loaded=4,
            num_layers=4,
            role=common_pb2.INSTANCE_ROLE_COLOCATED,
        )
    )


async def _denied(call: Awaitable[Any], caller: str | None, target: str) -> None:
    with pytest.raises(grpc.aio.AioRpcError) as e:
        await call
    assert e.value.code() == grpc.StatusCode.PERMISSION_DENIED, e.value.details()
    details = e.value.details() or ""
    assert f"names instance {caller!r}" in details and f"request instance {target!r}" in details, details


ImpostorCall = Callable[[str], Any]
CASES: dict[str, ImpostorCall] = {
    "RegisterInstance": _register,
    "Heartbeat": lambda iid: global_manager_pb2.HeartbeatRequest(
        instance_id=iid, state=common_pb2.INSTANCE_STATE_DRAINING, model_id="m", layers_loaded=4, num_layers=4
    ),
    "DeregisterInstance": lambda iid: global_manager_pb2.DeregisterInstanceRequest(instance_id=iid),
}


@pytest.mark.parametrize("rpc", list(CASES))
async def test_a_worker_certificate_cannot_act_for_another_instance(
    rpc: str, serve_in_process: Any, tls_dir: Path
) -> None:
    async with _manager(serve_in_process, tls_dir) as address:
        if rpc != "RegisterInstance":  # worker-1 is there, SERVING, registered by itself
            await _call(address, _worker(tls_dir, "worker-1"), "RegisterInstance", _register("worker-1"))
        before = await _instances(address, tls_dir)

        # worker-0's own certificate, and the role certificate that names no instance.
        await _denied(_call(address, _worker(tls_dir, "worker-0"), rpc, CASES[rpc]("worker-1")), "worker-0", "worker-1")
        await _denied(_call(address, _worker(tls_dir, None), rpc, CASES[rpc]("worker-1")), None, "worker-1")
        assert await _instances(address, tls_dir) == before

        # The owner is let through, and its call does what it says.
        await _call(address, _worker(tls_dir, "worker-1"), rpc, CASES[rpc]("worker-1"))
        after = await _instances(address, tls_dir)
        expected = {
            "RegisterInstance": {"worker-1": (SERVING, "m")},
            "Heartbeat": {"worker-1": (common_pb2.INSTANCE_STATE_DRAINING, "m")},
            "DeregisterInstance": {},
        }[rpc]
        assert after == expected


async def test_a_host_cache_registers_only_as_itself(tiny_models: Path, serve_in_process: Any, tls_dir: Path) -> None:
    before = process_identity()
    pm = ParamManagerService(ParamManagerConfig(port=0, tls_dir=tls_dir, model_dir=tiny_models, cache_slots=3))
    own = load_identity(tls_dir, roles.HOST_CACHE, "host-cache-1")

    async def register(cache_id: str, slot: int) -> Any:
        async with channel(ctx.address, roles.PARAM_MANAGER, identity=own) as ch:
            return await param_manager_pb2_grpc.ParamManagerStub(ch).RegisterHostCache(
                param_manager_pb2.RegisterHostCacheRequest(cache_id=cache_id, slot=slot, address="127.0.0.1:1"),
                timeout=5,
            )

    try:
        async with serve_in_process(pm, pm.config) as ctx:
            await _denied(register("host-cache-2", 2), "host-cache-1", "host-cache-2")
            assert 2 not in pm.servicer.caches
            assert (await register("host-cache-1", 1)).cache_slots == 3
            assert pm.servicer.caches[1].cache_id == "host-cache-1"
    finally:
        use_identity(before)
