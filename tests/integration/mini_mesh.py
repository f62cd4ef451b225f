"""A whole mesh in this process for integration tests: a parameter manager, a global manager, one
worker serving the `tiny` model (weights over the TCP data plane: ucxx allows one worker per
process, UCX is covered elsewhere) and a gateway, over real gRPC and HTTP."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from prometheus_client import CollectorRegistry

from blitzmesh.v1 import admin_pb2, common_pb2, global_manager_pb2_grpc
from services.common.grpc_util import channel
from services.common.waiting import wait_until
from services.gateway.config import GatewayConfig
from services.gateway.service import GatewayService
from services.global_manager.config import GlobalManagerConfig
from services.global_manager.service import GlobalManagerService
from services.param_manager.service import ParamManagerConfig, ParamManagerService
from services.worker.config import WorkerConfig
from services.worker.service import WorkerService

MODEL = "tiny"


@dataclass
class MiniMesh:
    http: str  # the gateway's OpenAI base URL (…/v1)
    grpc_address: str  # the gateway's gRPC API
    worker: WorkerService
    worker_address: str


@contextlib.asynccontextmanager
async def mini_mesh(
    tiny_models: Path, serve_in_process: Callable[..., Any], **worker_extra: Any
) -> AsyncIterator[MiniMesh]:
    """Start the mesh (`worker_extra`: more WorkerConfig options) and yield once the worker is
    SERVING in the global manager; everything stops on exit."""
    async with contextlib.AsyncExitStack() as stack:
        pm = ParamManagerService(ParamManagerConfig(port=0, model_dir=tiny_models, dataplane="tcp"))
        pm_ctx = await stack.enter_async_context(serve_in_process(pm, pm.servicer.config))
        gm = GlobalManagerService(GlobalManagerConfig(port=0, param_manager=pm_ctx.address))
        gm_ctx = await stack.enter_async_context(serve_in_process(gm, gm.servicer.cfg))
        wk = WorkerService(
            WorkerConfig(
                port=0,
                instance_id="w-0",
                param_manager=pm_ctx.address,
                global_manager=gm_ctx.address,
                preload_model=MODEL,
                kv_cache_tokens=4096,
                heartbeat_interval_s=0.2,
                dataplane="tcp",
                **worker_extra,
            )
        )
        wk_ctx = await stack.enter_async_context(serve_in_process(wk, wk.cfg))
        ch = await stack.enter_async_context(channel(gm_ctx.address))

        async def serving() -> bool:
            cluster = await global_manager_pb2_grpc.GlobalManagerStub(ch).GetCluster(
                admin_pb2.GetClusterRequest(), timeout=5
            )
            return any(i.state == common_pb2.INSTANCE_STATE_SERVING for i in cluster.instances)

        await wait_until(serving, 30, interval_s=0.05, what="the worker SERVING in the global manager")
        cfg = GatewayConfig(
            port=0, http_port=0, global_manager=gm_ctx.address, param_manager=pm_ctx.address, shutdown_grace_s=0.5
        )
        gw_ctx = await stack.enter_async_context(
            serve_in_process(GatewayService(cfg, registry=CollectorRegistry()), cfg)
        )
        yield MiniMesh(f"http://127.0.0.1:{gw_ctx.extra_ports['http_port']}/v1", gw_ctx.address, wk, wk_ctx.address)
