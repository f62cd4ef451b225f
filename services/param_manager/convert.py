"""Converters between the parameter store and protobuf (the process boundary)."""

from __future__ import annotations

from blitzmesh.v1 import common_pb2, param_manager_pb2
from services.dataplane.manifest import GroupEntry
from services.param_manager.store import HostModel


def group_to_proto(g: GroupEntry) -> common_pb2.GroupLayout:
    return common_pb2.GroupLayout(
        name=g.name,
        tensors=[
            common_pb2.TensorInfo(
                name=t.name, dtype=t.dtype, shape=list(t.shape), offset_bytes=t.offset_bytes, size_bytes=t.size_bytes
            )
            for t in g.tensors
        ],
        size_bytes=g.size_bytes,
        checksum=g.checksum,
    )


def model_info(m: HostModel) -> common_pb2.ModelInfo:
    return common_pb2.ModelInfo(
        model_id=m.model_id,
        num_layers=m.config.num_hidden_layers,
        size_bytes=m.manifest.total_bytes,
        max_context=m.config.max_position_embeddings,
        vocab_size=m.config.vocab_size,
        dtype=str(m.config.torch_dtype),
        created_unix_s=m.created_unix_s,
        num_parameters=m.num_parameters,
    )


def layout_to_proto(m: HostModel) -> param_manager_pb2.ModelLayout:
    return param_manager_pb2.ModelLayout(
        info=model_info(m),
        config_json=m.config_json,
        groups=[group_to_proto(g) for g in m.manifest.groups],
        manifest=m.manifest.to_bytes(),
    )
