"""The gateway as a `Service` for serve(): gRPC Inference + Admin, the aiohttp OpenAI API beside
it, and SERVING on the health service once both managers answer."""

from __future__ import annotations

import asyncio

import grpc
import structlog
from prometheus_client import REGISTRY, CollectorRegistry

from blitzmesh.v1 import admin_pb2_grpc, inference_pb2_grpc
from services.common import roles
from services.common.server import ServeContext, wait_for_serving
from services.gateway.backend import Backend
from services.gateway.config import GatewayConfig
from services.gateway.grpc_api import AdminServicer, InferenceServicer
from services.gateway.http_api import HttpApi
from services.gateway.metrics import GatewayMetrics

log = structlog.get_logger(__name__)

INFERENCE_SERVICE = "blitzmesh.v1.Inference"
ADMIN_SERVICE = "blitzmesh.v1.Admin"


class GatewayService:
    name = INFERENCE_SERVICE
    role = roles.GATEWAY
    # Its gRPC port is the public edge: API keys, no client certificates (docs/security.md).
    public = True

    def __init__(self, config: GatewayConfig, registry: CollectorRegistry | None = None) -> None:
        """`registry` defaults to the process-wide one, so the common metrics port shows it too."""
        if registry is None:
            registry = REGISTRY
        self.config = config
        self.backend = Backend(config, GatewayMetrics(registry))
        self.http = HttpApi(self.backend, config)
        self.http_port: int | None = None

    def register(self, server: grpc.aio.Server) -> list[str]:
        inference_pb2_grpc.add_InferenceServicer_to_server(InferenceServicer(self.backend, self.config), server)
        admin_pb2_grpc.add_AdminServicer_to_server(AdminServicer(self.backend, self.config), server)
        return [INFERENCE_SERVICE, ADMIN_SERVICE]

    async def start(self, ctx: ServeContext) -> None:
        await self.backend.start()
        self.http_port = await self.http.start()
        ctx.extra_ports["http_port"] = self.http_port
        ctx.tasks.spawn(self._become_ready(ctx), name="gateway-ready")

    async def _become_ready(self, ctx: ServeContext) -> None:
        """SERVING once both managers report SERVING; until then the gateway answers 503s."""
        timeout_s = self.config.ready_timeout_s or None
        upstreams = {"global_manager": self.config.global_manager, "param_manager": self.config.param_manager}
        peers = {"global_manager": roles.GLOBAL_MANAGER, "param_manager": roles.PARAM_MANAGER}
        try:
            async with asyncio.timeout(timeout_s):
                for name, address in upstreams.items():
                    while True:
                        try:
                            await wait_for_serving(address, timeout_s=30.0, peer=peers[name])
                            break
                        except TimeoutError:
                            log.warning("upstream_not_serving", upstream=name, address=address)
        except TimeoutError:
            raise RuntimeError(
                f"managers not SERVING within ready_timeout_s={self.config.ready_timeout_s}: {upstreams}"
            ) from None
        await ctx.set_serving()

    async def stop(self) -> None:
        # serve() has already stopped the gRPC server with its grace, upstream channels still
        # open, so its streams could finish; the HTTP ones get theirs inside http.stop().
        await self.http.stop()
        await self.backend.drain(self.config.shutdown_grace_s)
        await self.backend.close()
