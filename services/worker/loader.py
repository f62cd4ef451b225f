"""Fill a model with parameter groups from the parameter manager over a gRPC stream.

This is the data plane's fallback path (and the only path until the UCX data plane is wired
in): chunks land straight in each group's preallocated buffer, the group's checksum is
verified, and the model takes tensors that are views of that buffer (no second copy).
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass

import numpy as np
import torch

from blitzmesh.v1 import param_manager_pb2, param_manager_pb2_grpc
from services.common.grpc_util import channel
from services.param_manager.convert import slot_from_proto
from services.param_manager.store import group_checksum, unpack_group
from services.worker.model.config import LlamaConfig


class ChecksumMismatch(ValueError):
    pass


@dataclass
class Progress:
    groups_loaded: int
    groups_total: int
    bytes_loaded: int
    elapsed_s: float


async def fetch_layout(pm_address: str, model_id: str, timeout_s: float) -> param_manager_pb2.ModelLayout:
    async with channel(pm_address) as ch:
        stub = param_manager_pb2_grpc.ParamManagerStub(ch)
        return await stub.GetModel(param_manager_pb2.GetModelRequest(model_id=model_id), timeout=timeout_s)


def config_of(layout: param_manager_pb2.ModelLayout) -> LlamaConfig:
    return LlamaConfig.from_hf_dict(json.loads(layout.config_json))


async def stream_groups(
    pm_address: str,
    layout: param_manager_pb2.ModelLayout,
    on_group: Callable[[str, dict[str, torch.Tensor]], None],
    timeout_s: float,
) -> AsyncIterator[Progress]:
    """Receive every group in layer order; call on_group(name, tensors) once each verifies."""
    started = time.perf_counter()
    groups = {g.name: g for g in layout.groups}
    buffers = {g.name: torch.empty(g.size_bytes, dtype=torch.uint8) for g in layout.groups}
    loaded = 0
    loaded_bytes = 0
    async with channel(pm_address) as ch:
        stub = param_manager_pb2_grpc.ParamManagerStub(ch)
        call = stub.FetchGroups(
            param_manager_pb2.FetchGroupsRequest(model_id=layout.info.model_id), timeout=timeout_s
        )
        async for chunk in call:
            spec = groups.get(chunk.group)
            if spec is None:
                raise ValueError(f"parameter manager sent group {chunk.group!r} that the layout does not list")
            end = chunk.offset_bytes + len(chunk.data)
            if end > spec.size_bytes:
                raise ValueError(
                    f"chunk of {chunk.group!r} ends at byte {end}, past the group's {spec.size_bytes} bytes"
                )
            view = buffers[chunk.group].numpy()
            view[chunk.offset_bytes : end] = np.frombuffer(chunk.data, dtype=np.uint8)
            loaded_bytes += len(chunk.data)
            if not chunk.last_of_group:
                continue
            buf = buffers.pop(chunk.group)
            actual = await asyncio.to_thread(group_checksum, buf)
            if actual != spec.checksum:
                raise ChecksumMismatch(
                    f"group {chunk.group!r} of {layout.info.model_id!r}: checksum {actual} != expected {spec.checksum}"
                )
            on_group(chunk.group, unpack_group(buf, [slot_from_proto(s) for s in spec.tensors]))
            loaded += 1
            yield Progress(loaded, len(groups), loaded_bytes, time.perf_counter() - started)
    if buffers:
        raise ValueError(f"parameter stream ended before groups {sorted(buffers)} arrived")
