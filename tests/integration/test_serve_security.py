"""serve()'s security choices on a real grpc.aio server in this process: mTLS unless plaintext
is asked for (with a warning), the caller check per method, reflection only when asked for."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from pathlib import Path

import grpc
import pytest
import structlog
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from blitzmesh.v1 import common_pb2, worker_pb2, worker_pb2_grpc
from services.common import pki, roles
from services.common.config import ServiceConfig
from services.common.grpc_util import channel
from services.common.security import load_identity, process_identity, use_identity
from services.common.server import ServeContext, configure_security, serve


class _Worker(worker_pb2_grpc.WorkerServicer):
    def __init__(self) -> None:
        self.drains = 0

    async def GetStatus(self, request, context):
        return common_pb2.InstanceInfo(instance_id="w")

    async def Drain(self, request, context):
        self.drains += 1
        return worker_pb2.DrainResponse(finished=1)


class _WorkerService:
    name = "blitzmesh.v1.Worker"
    role = roles.WORKER

    def __init__(self) -> None:
        self.servicer = _Worker()

    def register(self, server: grpc.aio.Server) -> list[str]:
        worker_pb2_grpc.add_WorkerServicer_to_server(self.servicer, server)
        return [self.name]

    async def start(self, ctx: ServeContext) -> None:
        await ctx.set_serving()

    async def stop(self) -> None:
        pass


@contextlib.asynccontextmanager
async def _serving(service: _WorkerService, config: ServiceConfig) -> AsyncIterator[ServeContext]:
    stop = asyncio.Event()
    bound: asyncio.Future[ServeContext] = asyncio.get_running_loop().create_future()

    async def on_bound(ctx: ServeContext) -> None:
        bound.set_result(ctx)

    before = process_identity()
    task = asyncio.create_task(serve(service, config, stop_event=stop, on_bound=on_bound))
    try:
        done, _ = await asyncio.wait({task, bound}, return_when=asyncio.FIRST_COMPLETED)
        if task in done:
            task.result()
        yield bound.result()
    finally:
        stop.set()
        await task
        use_identity(before)


@pytest.fixture(scope="module")
def tls_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("tls")
    pki.ensure_pki(path)
    return path


def test_a_service_without_certificates_or_the_opt_in_does_not_start(tmp_path: Path) -> None:
    with pytest.raises(SystemExit, match="--tls-dir DIR.*worker.pem.*--insecure"):
        configure_security(_WorkerService(), ServiceConfig(port=0))
    with pytest.raises(SystemExit, match=f"{tmp_path / 'ca.pem'}.*python -m services.common.pki"):
        configure_security(_WorkerService(), ServiceConfig(port=0, tls_dir=tmp_path))


async def test_plaintext_is_an_opt_in_that_warns_and_reflection_is_off_by_default() -> None:
    with structlog.testing.capture_logs() as logs:
        async with _serving(_WorkerService(), ServiceConfig(port=0, insecure=True)) as ctx:
            async with channel(ctx.address, identity=None) as ch:
                call = reflection_pb2_grpc.ServerReflectionStub(ch).ServerReflectionInfo(
                    iter([reflection_pb2.ServerReflectionRequest(list_services="")]), timeout=5
                )
                with pytest.raises(grpc.aio.AioRpcError) as e:
                    async for _ in call:
                        pass
                assert e.value.code() == grpc.StatusCode.UNIMPLEMENTED
    warnings = [e for e in logs if e["event"] == "insecure_plaintext"]
    assert warnings and warnings[0]["log_level"] == "warning"


async def test_mtls_checks_each_caller_against_the_table(tls_dir: Path) -> None:
    service = _WorkerService()
    async with _serving(service, ServiceConfig(port=0, tls_dir=tls_dir, reflection=True)) as ctx:
        manager = load_identity(tls_dir, roles.GLOBAL_MANAGER)
        gateway = load_identity(tls_dir, roles.GATEWAY)
        admin = load_identity(tls_dir, roles.ADMIN)
        async with channel(ctx.address, roles.WORKER, identity=manager) as ch:
            assert (await worker_pb2_grpc.WorkerStub(ch).Drain(worker_pb2.DrainRequest(), timeout=5)).finished == 1
        async with channel(ctx.address, roles.WORKER, identity=gateway) as ch:
            with pytest.raises(grpc.aio.AioRpcError) as e:
                await worker_pb2_grpc.WorkerStub(ch).Drain(worker_pb2.DrainRequest(), timeout=5)
            assert e.value.code() == grpc.StatusCode.PERMISSION_DENIED
            assert "role 'gateway' may not call it (allowed: ['global-manager'])" in (e.value.details() or "")
            # Every role may ask for health.
            resp = await health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=5)
            assert resp.status == health_pb2.HealthCheckResponse.SERVING
        assert service.servicer.drains == 1
        # A server certificate must name the role the client expects there.
        async with channel(ctx.address, roles.GLOBAL_MANAGER, identity=admin) as ch:
            with pytest.raises(grpc.aio.AioRpcError) as e:
                await worker_pb2_grpc.WorkerStub(ch).GetStatus(worker_pb2.GetStatusRequest(), timeout=5)
            assert e.value.code() == grpc.StatusCode.UNAVAILABLE
        # Plaintext never reaches the server.
        async with channel(ctx.address, identity=None) as ch:
            with pytest.raises(grpc.aio.AioRpcError) as e:
                await worker_pb2_grpc.WorkerStub(ch).GetStatus(worker_pb2.GetStatusRequest(), timeout=5)
            assert e.value.code() == grpc.StatusCode.UNAVAILABLE
        # Reflection, asked for, is the admin's.
        for who, code in ((admin, None), (gateway, grpc.StatusCode.PERMISSION_DENIED)):
            async with channel(ctx.address, roles.WORKER, identity=who) as ch:
                call = reflection_pb2_grpc.ServerReflectionStub(ch).ServerReflectionInfo(
                    iter([reflection_pb2.ServerReflectionRequest(list_services="")]), timeout=5
                )
                try:
                    names = [s.name async for r in call for s in r.list_services_response.service]
                    assert code is None and "blitzmesh.v1.Worker" in names
                except grpc.aio.AioRpcError as err:
                    assert err.code() == code


async def test_the_health_port_answers_health_in_plaintext_and_nothing_else(tls_dir: Path) -> None:
    """--health-port: what kubelet's native grpc probe (no TLS) reaches; the mTLS port keeps the rest."""
    async with _serving(_WorkerService(), ServiceConfig(port=0, tls_dir=tls_dir, health_port=0)) as ctx:
        health_port = ctx.extra_ports["health_port"]
        assert health_port not in (0, ctx.grpc_port)
        async with channel(f"127.0.0.1:{health_port}", identity=None) as ch:
            for name in ("", "blitzmesh.v1.Worker"):
                resp = await health_pb2_grpc.HealthStub(ch).Check(
                    health_pb2.HealthCheckRequest(service=name), timeout=5
                )
                assert resp.status == health_pb2.HealthCheckResponse.SERVING, name
            with pytest.raises(grpc.aio.AioRpcError) as e:
                await worker_pb2_grpc.WorkerStub(ch).GetStatus(worker_pb2.GetStatusRequest(), timeout=5)
            assert e.value.code() == grpc.StatusCode.UNIMPLEMENTED
        async with channel(ctx.address, identity=None) as ch:  # the main port still wants mTLS
            with pytest.raises(grpc.aio.AioRpcError) as e:
                await health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=5)
            assert e.value.code() == grpc.StatusCode.UNAVAILABLE
