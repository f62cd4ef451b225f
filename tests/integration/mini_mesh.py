"""A whole mesh in this process for integration tests: a parameter manager, a global manager, one
worker (or several, e.g. a prefill and a decode one) serving the `tiny` model (weights over the TCP data plane: ucxx allows one worker per
process, UCX is covered elsewhere) and a gateway, over real gRPC and HTTP."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator, Callable, Mapping
from dataclasses import dataclass, field
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
    worker: WorkerService  # the first worker
    worker_address: str
    workers: dict[str, WorkerService] = field(default_factory=dict)  # every worker, by instance id


@contextlib.asynccontextmanager
async def mini_mesh(
    tiny_models: Path,
    serve_in_process: Callable[..., Any],
    *,
    workers: Mapping[str, Mapping[str, Any]] | None = None,
    manager: Mapping[str, Any] | None = None,
    **worker_extra: Any,
) -> AsyncIterator[MiniMesh]:
    """Start the mesh (`worker_extra`: more WorkerConfig options of its one worker, `w-0`; or
    `workers`: instance id -> WorkerConfig options, one worker each, e.g. a `role`; `manager`:
    more GlobalManagerConfig options) and yield once every worker is SERVING in the global
    manager; everything stops on exit."""
    if workers is not None and worker_extra:
        raise ValueError(f"give worker options in `workers` or as keywords, not both: {sorted(worker_extra)}")
    specs = workers if workers is not None else {"w-0": worker_extra}
    async with contextlib.AsyncExitStack() as stack:
        pm = ParamManagerService(ParamManagerConfig(port=0, model_dir=tiny_models, dataplane="tcp"))
        pm_ctx = await stack.enter_async_context(serve_in_process(pm, pm.servicer.config))
        gm = GlobalManagerService(GlobalManagerConfig(port=0, param_manager=pm_ctx.address, **(manager or {})))
        gm_ctx = await stack.enter_async_context(serve_in_process(gm, gm.servicer.cfg))
        started: dict[str, tuple[WorkerService, str]] = {}
        for iid, extra in specs.items():
            wk = WorkerService(
                WorkerConfig(
                    **{
                        "port": 0,
                        "instance_id": iid,
                        "param_manager": pm_ctx.address,
                        "global_manager": gm_ctx.address,
                        "preload_model": MODEL,
                        "kv_cache_tokens": 4096,
                        "heartbeat_interval_s": 0.2,
                        "dataplane": "tcp",
                        **extra,
                    }
                )
            )
            wk_ctx = await stack.enter_async_context(serve_in_process(wk, wk.cfg))
            started[iid] = (wk, wk_ctx.address)
        ch = await stack.enter_async_context(channel(gm_ctx.address))

        async def serving() -> bool:
            cluster = await global_manager_pb2_grpc.GlobalManagerStub(ch).GetCluster(
                admin_pb2.GetClusterRequest(), timeout=5
            )
            up = {i.instance_id for i in cluster.instances if i.state == common_pb2.INSTANCE_STATE_SERVING}
            return up >= started.keys()

        await wait_until(serving, 30, interval_s=0.05, what=f"workers {sorted(started)} SERVING in the global manager")
        cfg = GatewayConfig(
            port=0, http_port=0, global_manager=gm_ctx.address, param_manager=pm_ctx.address, shutdown_grace_s=0.5
        )
        gw_ctx = await stack.enter_async_context(
            serve_in_process(GatewayService(cfg, registry=CollectorRegistry()), cfg)
        )
        (wk, address), *_ = started.values()
        yield MiniMesh(
            f"http://127.0.0.1:{gw_ctx.extra_ports['http_port']}/v1",
            gw_ctx.address,
            wk,
            address,
            {iid: w for iid, (w, _) in started.items()},
        )
