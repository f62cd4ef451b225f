"""Parameter manager: the global parameter pool, as one or more host-cache processes.

The *index* process (no `--index` given) reads each checkpoint once to build its manifest,
holds cache slot 0's shard, and keeps the location index: for every group of every model,
which host caches and live instances hold it. Other processes (`--index ADDRESS
--cache-slot k`) hold slot k's shard, announce it with RegisterHostCache and keep announcing
it (so a restarted index relearns them). Every process serves its shard over the data plane.
Host memory for M models on H hosts is one copy per model, not H.
"""

from __future__ import annotations

import asyncio
import contextlib
from dataclasses import dataclass
from pathlib import Path

import grpc
import structlog
from prometheus_client import Gauge
from pydantic import Field, model_validator

from blitzmesh.v1 import admin_pb2, common_pb2, param_manager_pb2, param_manager_pb2_grpc
from services.common import roles
from services.common.config import ServiceConfig
from services.common.grpc_util import channel
from services.common.security import dataplane_key, require_instance
from services.common.server import ServeContext
from services.dataplane import make_transport
from services.dataplane.chain import GroupServer
from services.dataplane.faults import maybe_corrupting
from services.dataplane.manifest import Manifest
from services.dataplane.shaped import maybe_shaped
from services.dataplane.transport import Transport
from services.param_manager.convert import layout_to_proto, model_info
from services.param_manager.store import (
    HostModel,
    big_buffers_from_mmap,
    discover_models,
    index_model,
    load_shard,
    partition,
)

log = structlog.get_logger(__name__)

HOST_BYTES = Gauge("blitzmesh_param_host_bytes", "Bytes of parameters held in this process's host memory")
MODELS = Gauge("blitzmesh_param_models", "Models registered in the parameter pool")


class ParamManagerConfig(ServiceConfig):
    model_dir: Path = Field(Path("models"), description="directory whose sub-directories are HF checkpoints")
    chunk_bytes: int = Field(4 * 1024 * 1024, gt=0, le=64 * 1024 * 1024, description="data-plane chunk size")
    index: str = Field("", description="address of the index process; empty = this process is the index")
    cache_slots: int = Field(1, ge=1, description="host-cache processes sharing the pool (index only)")
    cache_slot: int = Field(0, ge=0, description="which shard this process holds (0 is the index's)")
    require_models: list[str] = Field(
        default_factory=list,
        description="index only: exit at start, naming them, if any of these models is not in model_dir "
        "(where an orchestrator cannot order start-up, e.g. swarm, it restarts the index until model-init "
        "has put them there; a conversion appears whole or not at all)",
    )
    topology_host: str = Field("host-0", description="host (topology node) this process runs on")
    advertise_host: str = Field("", description="host name peers use to reach this process; empty = --host")
    dataplane: str = Field("auto", pattern="^(auto|ucx|tcp)$", description="data-plane transport")
    dataplane_link_gbps: float = Field(
        0.0, ge=0, description="emulate an egress link of this many Gbit/s on one machine (0 = off; benchmarks, tests)"
    )
    dataplane_link_per_peer: bool = Field(
        False,
        description="with dataplane_link_gbps: every receiver gets a link of that rate of its own, as if it read a "
        "copy on its own host (ServerlessLLM-style baselines in benchmarks)",
    )
    dataplane_param_link_gbps: float = Field(
        0.0,
        ge=0,
        description="emulation (benchmarks): the parameter streams this process serves go at most this many Gbit/s "
        "(per receiver with dataplane_link_per_peer), on top of dataplane_link_gbps: a model with more bytes than "
        "it has; 0 = off",
    )
    dataplane_corrupt_sends: int = Field(
        0,
        ge=0,
        description="chaos testing: flip a byte in each of the first N large data-plane messages this process sends; "
        "receivers must catch it by checksum and fetch again (0 = off)",
    )
    announce_interval_s: float = Field(2.0, gt=0, description="how often a host cache re-announces its shard")

    @model_validator(mode="after")
    def _check(self) -> ParamManagerConfig:
        if not self.index and self.cache_slot != 0:
            raise ValueError(f"the index process holds cache slot 0, got cache_slot={self.cache_slot}")
        if self.index and self.cache_slot == 0:
            raise ValueError("cache slot 0 belongs to the index; a host cache needs cache_slot >= 1, got 0")
        return self


@dataclass
class CacheRecord:
    cache_id: str
    slot: int
    holder: common_pb2.Holder


class LocationIndex:
    """model -> group -> holder id -> Holder. A lookup is two dict accesses: O(1) in hosts."""

    def __init__(self) -> None:
        self._index: dict[str, dict[str, dict[str, common_pb2.Holder]]] = {}

    def set(self, model_id: str, holder: common_pb2.Holder, groups: list[str]) -> None:
        """Replace what `holder` is known to hold of `model_id` with `groups`."""
        self.remove(model_id, holder.holder_id)
        by_group = self._index.setdefault(model_id, {})
        for g in groups:
            by_group.setdefault(g, {})[holder.holder_id] = holder

    def remove(self, model_id: str, holder_id: str) -> None:
        for holders in self._index.get(model_id, {}).values():
            holders.pop(holder_id, None)

    def holders(self, model_id: str, group: str) -> list[common_pb2.Holder]:
        return [h for _, h in sorted(self._index.get(model_id, {}).get(group, {}).items())]


class ParamManagerServicer(param_manager_pb2_grpc.ParamManagerServicer):
    def __init__(self, config: ParamManagerConfig) -> None:
        self.config = config
        self.models: dict[str, HostModel] = {}
        self.manifests: dict[str, Manifest] = {}
        self.locations = LocationIndex()
        self.caches: dict[int, CacheRecord] = {}
        self.cache_id = f"host-cache-{config.cache_slot}"
        self.holder = common_pb2.Holder(holder_id=self.cache_id, kind="host_cache", host=config.topology_host)

    @property
    def is_index(self) -> bool:
        return not self.config.index

    def index_models(self) -> None:
        """Index process: manifest of every model, and slot 0's shard."""
        for model_id, path in discover_models(self.config.model_dir).items():
            model = index_model(model_id, path, self.config.cache_slots, 0, self.config.chunk_bytes)
            self.models[model_id] = model
            self.manifests[model_id] = model.manifest
            self.locations.set(model_id, self.holder, model.held_groups)
        self._update_gauges()
        if not self.models:
            log.warning("no_models", model_dir=str(self.config.model_dir))

    def load_shards(self, layouts: list[param_manager_pb2.ModelLayout], slots: int) -> None:
        """Host cache: pack this slot's shard of every model the index lists."""
        for layout in layouts:
            model_id = layout.info.model_id
            manifest = Manifest.from_bytes(layout.manifest)
            path = self.config.model_dir / model_id
            groups = partition(manifest, slots)[self.config.cache_slot] if self.config.cache_slot < slots else []
            self.models[model_id] = load_shard(model_id, path, manifest, groups)
            self.manifests[model_id] = manifest
        self._update_gauges()

    def _update_gauges(self) -> None:
        HOST_BYTES.set(sum(m.held_bytes for m in self.models.values()))
        MODELS.set(len(self.models))

    async def _model(self, model_id: str, context: grpc.aio.ServicerContext) -> HostModel:
        model = self.models.get(model_id)
        if model is None:
            await context.abort(
                grpc.StatusCode.NOT_FOUND, f"unknown model {model_id!r}; registered: {sorted(self.models)}"
            )
        assert model is not None
        return model

    async def ListModels(self, request, context):
        return admin_pb2.ListModelsResponse(models=[model_info(m) for m in self.models.values()])

    async def GetModel(self, request, context):
        return layout_to_proto(await self._model(request.model_id, context))

    async def GetModelFiles(self, request, context):
        model = await self._model(request.model_id, context)
        return param_manager_pb2.ModelFiles(files=model.files)

    async def FetchGroups(self, request, context):
        """gRPC fallback of the data plane (and the baseline it is measured against)."""
        model = await self._model(request.model_id, context)
        names = list(request.groups) or model.held_groups
        chunk = request.chunk_bytes or self.config.chunk_bytes
        for name in names:
            try:
                gi = model.manifest.group_index(name)
            except (KeyError, ValueError):
                await context.abort(grpc.StatusCode.NOT_FOUND, f"model {model.model_id!r} has no group {name!r}")
            buf = model.buffers[gi]
            if buf is None:
                await context.abort(
                    grpc.StatusCode.NOT_FOUND,
                    f"{self.cache_id} does not hold group {name!r} of {model.model_id!r}; ask Locate who does",
                )
            assert buf is not None
            size = int(buf.nbytes)
            for offset in range(0, max(size, 1), chunk):
                end = min(offset + chunk, size)
                yield param_manager_pb2.ParameterChunk(
                    group=name, offset_bytes=offset, data=buf[offset:end].tobytes(), last_of_group=end >= size
                )

    async def Locate(self, request, context):
        model_id = request.model_id
        manifest = self.manifests.get(model_id)
        if manifest is None:
            await context.abort(
                grpc.StatusCode.NOT_FOUND, f"unknown model {model_id!r}; registered: {sorted(self.manifests)}"
            )
        assert manifest is not None
        names = list(request.groups) or manifest.group_names
        out = []
        for n in names:
            holders = self.locations.holders(model_id, n)
            out.append(common_pb2.GroupLocation(group=n, holders=[h.holder_id for h in holders], holder_info=holders))
        return param_manager_pb2.LocateResponse(locations=out)

    async def UpdateLocation(self, request, context):
        if not request.holder:
            await context.abort(
                grpc.StatusCode.INVALID_ARGUMENT,
                f"holder is required, got {request.holder!r} (model {request.model_id!r})",
            )
        manifest = self.manifests.get(request.model_id)
        if manifest is None:
            await context.abort(grpc.StatusCode.NOT_FOUND, f"unknown model {request.model_id!r}")
        assert manifest is not None
        holder = common_pb2.Holder(
            holder_id=request.holder,
            kind="instance",
            grpc_address=request.holder_address,
            dataplane_address=request.dataplane_address,
            dataplane_kind=request.dataplane_kind,
            host=request.host,
        )
        if request.present:
            self.locations.set(request.model_id, holder, list(request.groups) or manifest.group_names)
        else:
            self.locations.remove(request.model_id, request.holder)
        log.info("location_update", model=request.model_id, holder=request.holder, present=request.present)
        return param_manager_pb2.UpdateLocationResponse()

    async def RegisterHostCache(self, request, context):
        await require_instance(context, "RegisterHostCache", request.cache_id)
        if not self.is_index:
            await context.abort(
                grpc.StatusCode.FAILED_PRECONDITION, f"{self.cache_id} is not the index; ask {self.config.index}"
            )
        slots = self.config.cache_slots
        if request.cache_id != f"host-cache-{request.slot}" or not request.address:
            await context.abort(
                grpc.StatusCode.INVALID_ARGUMENT,
                f"cache_id {request.cache_id!r} with slot {request.slot} and address {request.address!r}: "
                f"the host cache of slot {request.slot} is 'host-cache-{request.slot}' and gives its address",
            )
        if not 1 <= request.slot < slots:
            await context.abort(
                grpc.StatusCode.INVALID_ARGUMENT,
                f"cache slot {request.slot} of {request.cache_id!r} is outside [1, {slots}) (slot 0 is the index)",
            )
        holder = common_pb2.Holder(
            holder_id=request.cache_id,
            kind="host_cache",
            grpc_address=request.address,
            dataplane_address=request.dataplane_address,
            dataplane_kind=request.dataplane_kind,
            host=request.host,
        )
        known = self.caches.get(request.slot)
        if known is None or known.holder != holder:
            log.info("host_cache_registered", cache_id=request.cache_id, slot=request.slot, shards=len(request.shards))
        self.caches[request.slot] = CacheRecord(request.cache_id, request.slot, holder)
        for shard in request.shards:
            if shard.model_id in self.manifests:
                self.locations.set(shard.model_id, holder, list(shard.groups))
        return param_manager_pb2.RegisterHostCacheResponse(
            cache_slots=slots, heartbeat_interval_s=self.config.announce_interval_s
        )


class ParamManagerService:
    name = "blitzmesh.v1.ParamManager"

    def __init__(self, config: ParamManagerConfig) -> None:
        self.config = config
        # The index is the parameter manager; a process pointed at an index is a host cache.
        self.role = roles.HOST_CACHE if config.index else roles.PARAM_MANAGER
        self.servicer = ParamManagerServicer(config)
        # A host cache presents its own instance's certificate (serve()); the index its role's.
        self.instance_id = self.servicer.cache_id
        self.transport: Transport | None = None
        self.group_server: GroupServer | None = None

    def register(self, server: grpc.aio.Server) -> list[str]:
        param_manager_pb2_grpc.add_ParamManagerServicer_to_server(self.servicer, server)
        return [self.name]

    async def start(self, ctx: ServeContext) -> None:
        cfg = self.config
        s = self.servicer
        self.transport = maybe_corrupting(
            maybe_shaped(
                make_transport(
                    cfg.dataplane,
                    host=cfg.host,
                    advertise_host=cfg.advertise_host or None,
                    auth_key=dataplane_key(cfg),
                ),
                cfg.dataplane_link_gbps,
                per_peer=cfg.dataplane_link_per_peer,
            ),
            cfg.dataplane_corrupt_sends,
        )
        await self.transport.start()
        self.group_server = GroupServer(
            self.transport, stream_gbps=cfg.dataplane_param_link_gbps, stream_per_peer=cfg.dataplane_link_per_peer
        )
        await self.group_server.start()
        s.holder.grpc_address = f"{cfg.advertise_host or cfg.host}:{ctx.grpc_port}"
        s.holder.dataplane_address = self.transport.address()
        s.holder.dataplane_kind = self.transport.kind
        big_buffers_from_mmap()
        if s.is_index:
            # Reading checkpoints is blocking file I/O: keep the event loop (health checks) alive.
            await asyncio.to_thread(s.index_models)
            missing = sorted(set(cfg.require_models) - set(s.models))
            if missing:
                raise SystemExit(
                    f"required models {missing} are not in {str(cfg.model_dir)!r} (found {sorted(s.models)}); "
                    "model-init puts the default one there"
                )
            for model_id in s.models:
                s.locations.set(model_id, s.holder, s.models[model_id].held_groups)
        else:
            layouts, slots = await self._fetch_index_layouts()
            await asyncio.to_thread(s.load_shards, layouts, slots)
            await self._announce()
            ctx.tasks.spawn(self._announce_loop(), name="announce")
        for model in s.models.values():
            self.group_server.publish(model.store())
        await ctx.set_serving()

    async def _fetch_index_layouts(self) -> tuple[list[param_manager_pb2.ModelLayout], int]:
        """Ask the index (retrying until it serves) for the slot count and every model's layout."""
        cfg = self.config
        async with channel(cfg.index, roles.PARAM_MANAGER) as ch:
            stub = param_manager_pb2_grpc.ParamManagerStub(ch)
            while True:
                try:
                    resp = await stub.RegisterHostCache(self._announcement(shards=False), timeout=5)
                    models = await stub.ListModels(admin_pb2.ListModelsRequest(), timeout=5)
                    layouts = [
                        await stub.GetModel(param_manager_pb2.GetModelRequest(model_id=m.model_id), timeout=30)
                        for m in models.models
                    ]
                    return layouts, resp.cache_slots
                except grpc.aio.AioRpcError as e:
                    if e.code() != grpc.StatusCode.UNAVAILABLE:
                        raise
                    log.info("waiting_for_index", index=cfg.index, details=e.details())
                    await asyncio.sleep(0.5)

    def _announcement(self, shards: bool = True) -> param_manager_pb2.RegisterHostCacheRequest:
        s = self.servicer
        return param_manager_pb2.RegisterHostCacheRequest(
            cache_id=s.cache_id,
            host=self.config.topology_host,
            address=s.holder.grpc_address,
            dataplane_address=s.holder.dataplane_address,
            dataplane_kind=s.holder.dataplane_kind,
            slot=self.config.cache_slot,
            shards=[
                param_manager_pb2.ModelShard(model_id=m.model_id, groups=m.held_groups, size_bytes=m.held_bytes)
                for m in s.models.values()
            ]
            if shards
            else [],
        )

    async def _announce(self) -> None:
        async with channel(self.config.index, roles.PARAM_MANAGER) as ch:
            await param_manager_pb2_grpc.ParamManagerStub(ch).RegisterHostCache(self._announcement(), timeout=5)

    async def _announce_loop(self) -> None:
        while True:
            await asyncio.sleep(self.config.announce_interval_s)
            try:
                await self._announce()
            except grpc.aio.AioRpcError as e:
                log.warning("announce_failed", index=self.config.index, code=e.code().name)

    async def stop(self) -> None:
        if self.group_server is not None:
            await self.group_server.close()
        if self.transport is not None:
            with contextlib.suppress(Exception):
                await self.transport.close()
