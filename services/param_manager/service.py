"""Parameter manager (first form): holds each registered model once in host memory, reports
its layout, streams its parameter groups to workers and indexes where every group lives."""

from __future__ import annotations

import asyncio
from collections import defaultdict
from pathlib import Path

import grpc
import structlog
from pydantic import Field
from prometheus_client import Gauge

from blitzmesh.v1 import admin_pb2, common_pb2, param_manager_pb2, param_manager_pb2_grpc
from services.common.config import ServiceConfig
from services.common.server import ServeContext
from services.param_manager.convert import layout_to_proto, model_info
from services.param_manager.store import HostModel, discover_models, load_host_model

log = structlog.get_logger(__name__)

HOST_BYTES = Gauge("blitzmesh_param_host_bytes", "Bytes of parameters held in this process's host memory")
MODELS = Gauge("blitzmesh_param_models", "Models registered in the parameter pool")


class ParamManagerConfig(ServiceConfig):
    model_dir: Path = Field(Path("models"), description="directory whose sub-directories are HF checkpoints")
    chunk_bytes: int = Field(4 * 1024 * 1024, gt=0, le=32 * 1024 * 1024, description="chunk size for FetchGroups")


class LocationIndex:
    """model -> group -> holders. Lookups are a dict access, O(1) in the number of hosts."""

    def __init__(self) -> None:
        self._index: dict[str, dict[str, dict[str, str]]] = defaultdict(lambda: defaultdict(dict))

    def add(self, model_id: str, holder: str, groups: list[str], address: str = "") -> None:
        for g in groups:
            self._index[model_id][g][holder] = address

    def remove(self, model_id: str, holder: str, groups: list[str] | None = None) -> None:
        for g, holders in self._index[model_id].items():
            if groups is None or g in groups:
                holders.pop(holder, None)

    def holders(self, model_id: str, group: str) -> list[str]:
        return sorted(self._index[model_id][group])


class ParamManagerServicer(param_manager_pb2_grpc.ParamManagerServicer):
    def __init__(self, config: ParamManagerConfig) -> None:
        self.config = config
        self.models: dict[str, HostModel] = {}
        self.locations = LocationIndex()
        self.cache_id = "host-cache-0"

    def load_models(self) -> None:
        for model_id, path in discover_models(self.config.model_dir).items():
            model = load_host_model(model_id, path)
            self.models[model_id] = model
            self.locations.add(model_id, self.cache_id, [g.name for g in model.groups])
        HOST_BYTES.set(sum(m.size_bytes for m in self.models.values()))
        MODELS.set(len(self.models))
        if not self.models:
            log.warning("no_models", model_dir=str(self.config.model_dir))

    async def _model(self, model_id: str, context: grpc.aio.ServicerContext) -> HostModel:
        model = self.models.get(model_id)
        if model is None:
            await context.abort(
                grpc.StatusCode.NOT_FOUND, f"unknown model {model_id!r}; registered: {sorted(self.models)}"
            )
        assert model is not None
        return model

    async def ListModels(self, request, context):  # noqa: N802 (gRPC names)
        return admin_pb2.ListModelsResponse(models=[model_info(m) for m in self.models.values()])

    async def GetModel(self, request, context):  # noqa: N802
        return layout_to_proto(await self._model(request.model_id, context))

    async def GetModelFiles(self, request, context):  # noqa: N802
        model = await self._model(request.model_id, context)
        return param_manager_pb2.ModelFiles(files=model.files)

    async def FetchGroups(self, request, context):  # noqa: N802
        model = await self._model(request.model_id, context)
        names = list(request.groups) or [g.name for g in model.groups]
        chunk = request.chunk_bytes or self.config.chunk_bytes
        for name in names:
            try:
                group = model.group(name)
            except KeyError as e:
                await context.abort(grpc.StatusCode.NOT_FOUND, str(e.args[0]))
            data = group.buffer.numpy()
            size = group.size_bytes
            for offset in range(0, max(size, 1), chunk):
                end = min(offset + chunk, size)
                yield param_manager_pb2.ParameterChunk(
                    group=name, offset_bytes=offset, data=data[offset:end].tobytes(), last_of_group=end >= size
                )

    async def Locate(self, request, context):  # noqa: N802
        model = await self._model(request.model_id, context)
        names = list(request.groups) or [g.name for g in model.groups]
        return param_manager_pb2.LocateResponse(
            locations=[
                common_pb2.GroupLocation(group=n, holders=self.locations.holders(model.model_id, n)) for n in names
            ]
        )

    async def UpdateLocation(self, request, context):  # noqa: N802
        model = await self._model(request.model_id, context)
        groups = list(request.groups) or [g.name for g in model.groups]
        if request.present:
            self.locations.add(model.model_id, request.holder, groups, request.holder_address)
        else:
            self.locations.remove(model.model_id, request.holder, list(request.groups) or None)
        log.info("location_update", model=model.model_id, holder=request.holder, present=request.present)
        return param_manager_pb2.UpdateLocationResponse()

    async def RegisterHostCache(self, request, context):  # noqa: N802
        await context.abort(
            grpc.StatusCode.UNIMPLEMENTED, "multi-process host caches arrive with the data-plane issue"
        )


class ParamManagerService:
    name = "blitzmesh.v1.ParamManager"

    def __init__(self, config: ParamManagerConfig) -> None:
        self.servicer = ParamManagerServicer(config)

    def register(self, server: grpc.aio.Server) -> list[str]:
        param_manager_pb2_grpc.add_ParamManagerServicer_to_server(self.servicer, server)
        return [self.name]

    async def start(self, ctx: ServeContext) -> None:
        # Reading checkpoints is blocking file I/O: keep the event loop (health checks) alive.
        await asyncio.to_thread(self.servicer.load_models)
        await ctx.set_serving()

    async def stop(self) -> None:
        return None
