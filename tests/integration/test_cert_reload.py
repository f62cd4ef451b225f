"""Certificates renewed on disk reach a running grpc.aio server and its callers without a
restart: the server hands new handshakes the new certificate (dynamic server credentials), and a
stub made once on a `grpc_util.channel()` presents the new client certificate from a call after
the renewal on, while calls keep succeeding throughout."""

from __future__ import annotations

import asyncio
import contextlib
import ssl
from collections.abc import AsyncIterator
from pathlib import Path

import grpc
from cryptography import x509

from blitzmesh.v1 import common_pb2, worker_pb2, worker_pb2_grpc
from services.common import pki, roles
from services.common.grpc_util import RenewingChannel, channel
from services.common.security import (
    AuthorizationInterceptor,
    IdentityWatch,
    dynamic_server_credentials,
    load_identity,
    process_identity,
    use_identity,
)
from services.common.waiting import wait_until

PICKUP_S = 10.0


def serial_of(pem: bytes) -> int:
    return x509.load_pem_x509_certificate(pem).serial_number


def file_serial(tls_dir: Path, role: str, instance: str | None = None) -> int:
    return serial_of(pki.cert_path(tls_dir, role, instance).read_bytes())


async def presented_serial(address: str, tls_dir: Path, peer: str, as_role: str = roles.ADMIN) -> int:
    """The serial of the certificate the mTLS server at `address` presents to a new connection."""
    ctx = ssl.create_default_context(ssl.Purpose.SERVER_AUTH, cafile=str(tls_dir / pki.CA_CERT))
    ctx.load_cert_chain(pki.cert_path(tls_dir, as_role), pki.key_path(tls_dir, as_role))
    ctx.set_alpn_protocols(["h2"])
    host, _, port = address.rpartition(":")
    _, writer = await asyncio.wait_for(
        asyncio.open_connection(host, int(port), ssl=ctx, server_hostname=peer), timeout=5
    )
    try:
        der = writer.get_extra_info("ssl_object").getpeercert(binary_form=True)
    finally:
        writer.transport.abort()  # no TLS close exchange: the server waits for HTTP/2, not for us
    return x509.load_der_x509_certificate(der).serial_number


class _EchoCaller(worker_pb2_grpc.WorkerServicer):
    """GetStatus answers with the serial of the caller's client certificate."""

    async def GetStatus(self, request, context):
        pem = context.auth_context()["x509_pem_cert"][0]
        return common_pb2.InstanceInfo(instance_id=format(serial_of(pem), "x"))


@contextlib.asynccontextmanager
async def _worker_server(tls_dir: Path) -> AsyncIterator[str]:
    watch = IdentityWatch(load_identity(tls_dir, roles.WORKER, "worker-0"), check_interval_s=0.5)
    server = grpc.aio.server(interceptors=[AuthorizationInterceptor()])
    worker_pb2_grpc.add_WorkerServicer_to_server(_EchoCaller(), server)
    port = server.add_secure_port("127.0.0.1:0", dynamic_server_credentials(watch))
    await server.start()
    try:
        yield f"127.0.0.1:{port}"
    finally:
        await server.stop(0)


async def test_a_server_and_a_channel_take_renewed_certificates_without_a_failed_call(tmp_path: Path) -> None:
    tls_dir = tmp_path / "tls"
    pki.ensure_pki(tls_dir, instances=[(roles.WORKER, "worker-0")])
    before = process_identity()
    use_identity(load_identity(tls_dir, roles.GATEWAY))
    try:
        async with _worker_server(tls_dir) as address:
            async with channel(address, roles.WORKER) as ch:
                assert isinstance(ch, RenewingChannel)
                stub = worker_pb2_grpc.WorkerStub(ch)  # made once, as the services do
                old_gateway = file_serial(tls_dir, roles.GATEWAY)
                old_worker = file_serial(tls_dir, roles.WORKER, "worker-0")
                assert await presented_serial(address, tls_dir, roles.WORKER) == old_worker
                seen = await stub.GetStatus(worker_pb2.GetStatusRequest(), timeout=5)
                assert int(seen.instance_id, 16) == old_gateway

                calls = failed = 0
                stop = asyncio.Event()

                async def load() -> None:
                    nonlocal calls, failed
                    while not stop.is_set():
                        calls += 1
                        try:
                            await stub.GetStatus(worker_pb2.GetStatusRequest(), timeout=5)
                        except grpc.aio.AioRpcError:
                            failed += 1
                        await asyncio.sleep(0.01)

                loaders = [asyncio.create_task(load()) for _ in range(4)]
                try:
                    renewed = dict(await asyncio.to_thread(pki.renew, tls_dir))
                    new_gateway, new_worker = renewed["gateway.pem"], renewed["worker/worker-0.pem"]
                    assert new_gateway != old_gateway and new_worker != old_worker

                    async def picked_up() -> bool:
                        server_side = await presented_serial(address, tls_dir, roles.WORKER) == new_worker
                        reply = await stub.GetStatus(worker_pb2.GetStatusRequest(), timeout=5)
                        return server_side and int(reply.instance_id, 16) == new_gateway

                    await wait_until(picked_up, PICKUP_S, interval_s=0.1, what="the renewed certificates in use")
                finally:
                    stop.set()
                    await asyncio.gather(*loaders)
                assert calls > 0 and failed == 0
    finally:
        use_identity(before)


def test_a_watch_keeps_its_identity_until_a_whole_new_pair_is_on_disk(tmp_path: Path) -> None:
    pki.ensure_pki(tmp_path)
    now = [0.0]
    watch = IdentityWatch(load_identity(tmp_path, roles.GATEWAY), check_interval_s=1.0, clock=lambda: now[0])
    first = watch.current()
    now[0] = 1.0
    assert watch.current() is first  # the files as they were: the same object

    ca = x509.load_pem_x509_certificate((tmp_path / pki.CA_CERT).read_bytes())
    cert_pem, key_pem = pki.issue_from(tmp_path, roles.GATEWAY)
    pki.write_private(pki.key_path(tmp_path, roles.GATEWAY), key_pem)  # the key alone, as mid-rotation
    now[0] = 2.0
    assert watch.current() is first  # the new key with the old certificate is not taken
    pki.cert_path(tmp_path, roles.GATEWAY).write_bytes(cert_pem)
    now[0] = 2.01
    assert watch.current() is first  # not looked at again yet (a retry waits a moment) ...
    now[0] = 2.1
    renewed = watch.current()
    assert renewed is not first and renewed.cert_pem == cert_pem and renewed.key_pem == key_pem
    assert x509.load_pem_x509_certificate(renewed.cert_pem).issuer == ca.subject
    assert serial_of(renewed.cert_pem) != serial_of(first.cert_pem)
