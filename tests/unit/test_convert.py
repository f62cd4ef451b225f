"""Converters at the process boundary: parameter layouts and the manager's registry adapter."""

from __future__ import annotations

import torch

from blitzmesh.v1 import common_pb2
from services.global_manager.core.types import InstanceState, Role
from services.global_manager.registry import InstanceTable, sample_from_proto
from services.param_manager.convert import group_to_proto, slot_from_proto, slot_to_proto
from services.param_manager.store import group_checksum, pack_group, unpack_group


def test_pack_unpack_round_trip_is_exact_and_zero_copy() -> None:
    g = torch.Generator().manual_seed(0)
    tensors = {
        "b": torch.randn(3, 5, generator=g),
        "a": torch.randn(7, generator=g).to(torch.bfloat16),
        "c": torch.arange(6, dtype=torch.int64).reshape(2, 3),
    }
    packed = pack_group("layers.0", tensors)
    assert [s.name for s in packed.tensors] == ["a", "b", "c"]
    assert all(s.offset_bytes % 64 == 0 for s in packed.tensors)
    assert packed.size_bytes == packed.tensors[-1].offset_bytes + packed.tensors[-1].size_bytes
    out = unpack_group(packed.buffer, packed.tensors)
    for name, t in tensors.items():
        assert torch.equal(out[name], t) and out[name].dtype == t.dtype
    # Views of the buffer: writing through the buffer shows in the tensor.
    packed.buffer[: out["a"].element_size()] = 0
    assert out["a"][0].item() == 0
    assert packed.checksum == group_checksum(pack_group("layers.0", tensors).buffer) != group_checksum(packed.buffer)


def test_layout_proto_round_trip() -> None:
    packed = pack_group("embed", {"w": torch.ones(4, 2)})
    proto = group_to_proto(packed)
    assert proto.name == "embed" and proto.size_bytes == 32 and proto.checksum == packed.checksum
    assert [slot_from_proto(s) for s in proto.tensors] == packed.tensors
    assert slot_from_proto(slot_to_proto(packed.tensors[0])) == packed.tensors[0]


def test_registry_adapter_round_trip_and_resync() -> None:
    table = InstanceTable()
    info = common_pb2.InstanceInfo(
        instance_id="w1", address="a:1", host="h", model_id="m", state=common_pb2.INSTANCE_STATE_SERVING,
        role=common_pb2.INSTANCE_ROLE_DECODE, layers_loaded=8, num_layers=8,
    )
    view = table.upsert(info, now_s=1.0)
    assert view.state is InstanceState.SERVING and view.role is Role.DECODE
    back = table.to_proto(view, now_s=3.0)
    assert back.instance_id == "w1" and back.address == "a:1" and back.state == info.state
    assert back.role == info.role and back.num_layers == 8 and back.last_heartbeat_age_s == 2.0
    # SERVING -> IDLE is not a legal step; the adapter takes the worker's word for it.
    assert table.follow("w1", InstanceState.IDLE, "", 0, 0).state is InstanceState.IDLE
    # A legal step goes through the state machine, with the new model.
    view = table.follow("w1", InstanceState.LOADING, "m2", 0, 6)
    assert view.state is InstanceState.LOADING and view.model == "m2" and view.num_layers == 6
    assert table.follow("w1", InstanceState.LOADING, "m2", 3, 6).layers_loaded == 3


def test_load_sample_zero_latency_means_no_observation() -> None:
    s = sample_from_proto("w", 1.0, common_pb2.LoadReport(decode_tps=5, tbt_p50_s=0.0, ttft_p50_s=0.2))
    assert s.tbt_p50_s is None and s.ttft_p50_s == 0.2 and s.decode_tps == 5
