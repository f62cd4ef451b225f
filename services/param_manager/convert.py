"""Converters between the parameter store's dataclasses and protobuf (the process boundary)."""

from __future__ import annotations

from blitzmesh.v1 import common_pb2, param_manager_pb2
from services.param_manager.store import HostModel, PackedGroup, TensorSlot


def slot_to_proto(s: TensorSlot) -> common_pb2.TensorInfo:
    return common_pb2.TensorInfo(
        name=s.name, dtype=s.dtype, shape=list(s.shape), offset_bytes=s.offset_bytes, size_bytes=s.size_bytes
    )


def slot_from_proto(p: common_pb2.TensorInfo) -> TensorSlot:
    return TensorSlot(p.name, p.dtype, tuple(p.shape), p.offset_bytes, p.size_bytes)


def group_to_proto(g: PackedGroup) -> common_pb2.GroupLayout:
    return common_pb2.GroupLayout(
        name=g.name, tensors=[slot_to_proto(s) for s in g.tensors], size_bytes=g.size_bytes, checksum=g.checksum
    )


def model_info(m: HostModel) -> common_pb2.ModelInfo:
    return common_pb2.ModelInfo(
        model_id=m.model_id,
        num_layers=m.config.num_hidden_layers,
        size_bytes=m.size_bytes,
        max_context=m.config.max_position_embeddings,
        vocab_size=m.config.vocab_size,
        dtype=str(m.config.torch_dtype),
        created_unix_s=m.created_unix_s,
        num_parameters=m.num_parameters,
    )


def layout_to_proto(m: HostModel) -> param_manager_pb2.ModelLayout:
    return param_manager_pb2.ModelLayout(
        info=model_info(m), config_json=m.config_json, groups=[group_to_proto(g) for g in m.groups]
    )
