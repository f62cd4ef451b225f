"""The one serve() skeleton every service runs: gRPC server + health + reflection + metrics,
graceful shutdown on SIGTERM/SIGINT, owned background tasks torn down in one place."""

from __future__ import annotations

import asyncio
import contextlib
import json
import signal
from collections.abc import Awaitable, Callable, Coroutine
from dataclasses import dataclass, field
from typing import Any, Protocol

import grpc
import structlog
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from services.common.config import ServiceConfig
from services.common.grpc_util import PROCESS_IDENTITY, ProcessIdentity
from services.common.grpc_util import channel as mesh_channel
from services.common.metrics import start_metrics_server
from services.common.roles import INSTANCE_ROLES
from services.common.security import (
    AuthorizationInterceptor,
    Identity,
    IdentityWatch,
    dynamic_server_credentials,
    load_identity,
    use_identity,
)

log = structlog.get_logger(__name__)

SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING


class TaskGroup:
    """Owns background tasks: keeps references, surfaces a crash, cancels all on close.

    A task that dies with an exception sets `failed` so serve() stops the process instead
    of running on with a dead loop (a heartbeat or engine loop must never vanish silently).
    """

    def __init__(self) -> None:
        self._tasks: set[asyncio.Task[Any]] = set()
        self.failed: asyncio.Event = asyncio.Event()
        self.error: BaseException | None = None

    def spawn(self, coro: Coroutine[Any, Any, Any], name: str) -> asyncio.Task[Any]:
        task = asyncio.create_task(coro, name=name)
        self._tasks.add(task)
        task.add_done_callback(self._done)
        return task

    def _done(self, task: asyncio.Task[Any]) -> None:
        self._tasks.discard(task)
        if task.cancelled():
            return
        exc = task.exception()
        if exc is not None:
            log.error("background_task_failed", task=task.get_name(), error=repr(exc), exc_info=exc)
            self.error = exc
            self.failed.set()

    async def close(self) -> None:
        tasks = list(self._tasks)
        for t in tasks:
            t.cancel()
        if tasks:
            await asyncio.gather(*tasks, return_exceptions=True)


class Service(Protocol):
    """What serve() needs from a service."""

    name: str  # full gRPC service name used for health, e.g. "blitzmesh.v1.Worker"
    role: str  # the workload role it runs as: its certificate (services/common/roles.py)

    def register(self, server: grpc.aio.Server) -> list[str]:
        """Add servicers; return the full names of the services added (for reflection)."""

    async def start(self, ctx: ServeContext) -> None:
        """Start background work; call ctx.set_serving() when ready (may be later)."""

    async def stop(self) -> None:
        """Release everything start() acquired (after the gRPC server has stopped)."""


# A service of a per-instance role (roles.INSTANCE_ROLES: a worker, a host cache) has an
# `instance_id`: it presents that instance's own certificate (pki.spiffe_id names it), so the
# services it reports to can tell it from the other instances of its role.
# A service may set `public = True` (the gateway): its own port is the public edge, plaintext with
# API keys as before, while its calls into the mesh still present its certificate.
# A service may also define `async def drain(self) -> None`: serve() awaits it on shutdown after
# health says NOT_SERVING and before the gRPC server stops, while in-flight calls still run (the
# worker finishes or releases its requests there). Optional, so it is not part of the Protocol.


@dataclass
class ServeContext:
    config: ServiceConfig
    grpc_port: int
    health_servicer: health.aio.HealthServicer
    service_names: list[str]
    tasks: TaskGroup = field(default_factory=TaskGroup)
    stop_event: asyncio.Event = field(default_factory=asyncio.Event)
    extra_ports: dict[str, int] = field(default_factory=dict)

    @property
    def address(self) -> str:
        return f"{self.config.host}:{self.grpc_port}"

    async def set_serving(self, serving: bool = True) -> None:
        status = SERVING if serving else NOT_SERVING
        for name in ["", *self.service_names]:
            await self.health_servicer.set(name, status)
        log.info("health", status="SERVING" if serving else "NOT_SERVING")


def write_port_file(ctx: ServeContext, metrics_port: int | None) -> None:
    if ctx.config.port_file is None:
        return
    data = {"grpc_port": ctx.grpc_port, "metrics_port": metrics_port, **ctx.extra_ports}
    tmp = ctx.config.port_file.with_suffix(".tmp")
    tmp.write_text(json.dumps(data))
    tmp.replace(ctx.config.port_file)  # atomic: a reader never sees half a file


def configure_security(service: Service, config: ServiceConfig) -> IdentityWatch | None:
    """This process's identity from `config` (also what its channels present), watched for
    renewed files; None with --insecure."""
    if config.insecure:
        log.warning(
            "insecure_plaintext",
            service=service.name,
            detail="--insecure: gRPC is plaintext and every caller may call every method; development only",
        )
        use_identity(None)
        return None
    if config.tls_dir is None:
        raise SystemExit(
            f"{service.name}: no TLS material: pass --tls-dir DIR holding ca.pem, {service.role}.pem and "
            f"{service.role}.key (python -m services.common.pki DIR makes them), or --insecure for a "
            "plaintext development mesh"
        )
    instance = getattr(service, "instance_id", None) if service.role in INSTANCE_ROLES else None
    return use_identity(load_identity(config.tls_dir, service.role, instance))


async def serve(
    service: Service,
    config: ServiceConfig,
    *,
    stop_event: asyncio.Event | None = None,
    on_bound: Callable[[ServeContext], Awaitable[None]] | None = None,
) -> None:
    """Run `service` until SIGTERM/SIGINT (or `stop_event`), then shut down gracefully."""
    identity = configure_security(service, config)
    public = bool(getattr(service, "public", False))
    checked = identity is not None and not public
    server = grpc.aio.server(
        interceptors=[AuthorizationInterceptor()] if checked else None,
        options=[
            ("grpc.max_send_message_length", 64 * 1024 * 1024),
            ("grpc.max_receive_message_length", 64 * 1024 * 1024),
        ],
    )
    health_servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    names = service.register(server)
    # Internal services describe themselves only when asked to; the public edge as before.
    if config.reflection or public:
        reflection.enable_server_reflection([*names, health.SERVICE_NAME, reflection.SERVICE_NAME], server)
    bind = f"{config.host}:{config.port}"
    if checked:
        assert identity is not None
        # Each new handshake gets the certificate on disk now: a renewal needs no restart.
        port = server.add_secure_port(bind, dynamic_server_credentials(identity))
    else:
        port = server.add_insecure_port(bind)
    if port == 0:
        raise SystemExit(f"cannot bind gRPC port {config.host}:{config.port}")
    ctx = ServeContext(config=config, grpc_port=port, health_servicer=health_servicer, service_names=names)
    if stop_event is not None:
        ctx.stop_event = stop_event
    for name in ["", *names]:
        await health_servicer.set(name, NOT_SERVING)

    loop = asyncio.get_running_loop()
    installed: list[int] = []
    for sig in (signal.SIGTERM, signal.SIGINT):
        with contextlib.suppress(NotImplementedError, RuntimeError, ValueError):
            loop.add_signal_handler(sig, ctx.stop_event.set)
            installed.append(sig)

    metrics_port = start_metrics_server(config.host, config.metrics_port) if config.metrics_port >= 0 else None
    health_server = await start_health_server(config, health_servicer, ctx) if config.health_port >= 0 else None
    await server.start()
    log.info(
        "grpc_listening",
        address=ctx.address,
        metrics_port=metrics_port,
        security="mtls" if checked else "public (API keys)" if public else "plaintext (--insecure)",
        role=getattr(service, "role", None),
    )
    try:
        await service.start(ctx)
        if on_bound is not None:
            await on_bound(ctx)
        write_port_file(ctx, metrics_port)
        stop_wait = asyncio.create_task(ctx.stop_event.wait())
        fail_wait = asyncio.create_task(ctx.tasks.failed.wait())
        done, pending = await asyncio.wait({stop_wait, fail_wait}, return_when=asyncio.FIRST_COMPLETED)
        for t in pending:
            t.cancel()
        if fail_wait in done:
            raise RuntimeError(f"{service.name}: a background task failed: {ctx.tasks.error!r}")
    finally:
        # Readiness first (no new callers), then the service's own drain while its server still
        # answers the calls in flight, then the server (calls left get the grace), then what the
        # service holds, then its tasks (heartbeats run through the drain).
        log.info("shutting_down")
        await health_servicer.enter_graceful_shutdown()
        drain = getattr(service, "drain", None)
        if drain is not None:
            try:
                await drain()
            except Exception:
                log.exception("service_drain_failed", service=service.name)
        await server.stop(config.shutdown_grace_s)
        if health_server is not None:
            await health_server.stop(0)
        try:
            await service.stop()
        except Exception:
            log.exception("service_stop_failed", service=service.name)
        await ctx.tasks.close()
        for sig in installed:
            loop.remove_signal_handler(sig)
        log.info("stopped")


async def start_health_server(
    config: ServiceConfig, health_servicer: health.aio.HealthServicer, ctx: ServeContext
) -> grpc.aio.Server:
    """A plaintext server on `health_port` with the health service alone (the same statuses as the
    main port's), for probes that speak no TLS, e.g. kubelet's native `grpc:` probe. It answers
    nothing else, so the mTLS port keeps every call that matters."""
    server = grpc.aio.server()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    port = server.add_insecure_port(f"{config.host}:{config.health_port}")
    if port == 0:
        raise SystemExit(f"cannot bind the health port {config.host}:{config.health_port}")
    ctx.extra_ports["health_port"] = port
    await server.start()
    return server


async def wait_for_serving(
    address: str,
    timeout_s: float,
    service: str = "",
    *,
    peer: str | None = None,
    identity: Identity | None | ProcessIdentity = PROCESS_IDENTITY,
) -> None:
    """Block until `address` reports SERVING on the gRPC health service (no sleeps-and-hope);
    `peer` and `identity` are grpc_util.channel()'s: the role its certificate names, ours."""
    deadline = asyncio.get_running_loop().time() + timeout_s
    async with mesh_channel(address, peer, identity=identity) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        last_error = "no answer"
        while True:
            remaining = deadline - asyncio.get_running_loop().time()
            if remaining <= 0:
                raise TimeoutError(f"{address} not SERVING after {timeout_s}s ({last_error})")
            try:
                # Watch streams status changes, so we wake exactly when it flips.
                async for resp in stub.Watch(health_pb2.HealthCheckRequest(service=service), timeout=remaining):
                    if resp.status == SERVING:
                        return
                    last_error = f"status {health_pb2.HealthCheckResponse.ServingStatus.Name(resp.status)}"
            except grpc.aio.AioRpcError as e:
                last_error = f"{e.code().name}: {e.details()}"
                if e.code() == grpc.StatusCode.DEADLINE_EXCEEDED:
                    continue
                # Server not up yet: retry shortly (connection refused is instant).
                await asyncio.sleep(min(0.1, max(remaining, 0)))
