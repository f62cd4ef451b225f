"""Converters at the process boundary (parameter layouts, the manager's registry adapter) and the
pool's sharding."""

from __future__ import annotations

import torch

from blitzmesh.v1 import common_pb2
from services.dataplane.manifest import pack_groups
from services.global_manager.convert import sample_from_proto
from services.global_manager.core.types import InstanceState, Role
from services.global_manager.instance_table import InstanceTable
from services.param_manager.convert import group_to_proto
from services.param_manager.store import partition


def test_layout_proto_matches_manifest() -> None:
    g = torch.Generator().manual_seed(0)
    manifest, _ = pack_groups("m", [("embed", {"w": torch.randn(4, 2, generator=g)}), ("head", {"n": torch.ones(3)})])
    protos = [group_to_proto(e) for e in manifest.groups]
    assert [p.name for p in protos] == ["embed", "head"]
    for p, e in zip(protos, manifest.groups, strict=True):
        assert p.size_bytes == e.size_bytes and p.checksum == e.checksum
        assert [(t.name, t.dtype, tuple(t.shape), t.offset_bytes, t.size_bytes) for t in p.tensors] == [
            (t.name, t.dtype, t.shape, t.offset_bytes, t.size_bytes) for t in e.tensors
        ]


def test_partition_is_one_copy_balanced_and_in_layer_order() -> None:
    groups = [(f"layers.{i}", {"w": torch.zeros(100 + 10 * i)}) for i in range(10)]
    manifest, _ = pack_groups("m", groups)
    for slots in (1, 2, 3, 4):
        shards = partition(manifest, slots)
        flat = [g for shard in shards for g in shard]
        assert flat == manifest.group_names  # every group exactly once, in layer order
        sizes = [sum(manifest.group(g).size_bytes for g in shard) for shard in shards]
        biggest = max(e.size_bytes for e in manifest.groups)
        assert max(sizes) - min(sizes) <= 2 * biggest, sizes


def test_registry_adapter_round_trip_and_resync() -> None:
    table = InstanceTable()
    info = common_pb2.InstanceInfo(
        instance_id="w1",
        address="a:1",
        host="h",
        model_id="m",
        state=common_pb2.INSTANCE_STATE_SERVING,
        role=common_pb2.INSTANCE_ROLE_DECODE,
        layers_loaded=8,
        num_layers=8,
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


def test_the_table_keeps_each_instances_engine_until_it_reports_none() -> None:
    table = InstanceTable()
    engine = common_pb2.EngineInfo(
        requested_dtype="bfloat16",
        dtype="float32",
        isa="avx2",
        kernels=[common_pb2.KernelChoice(op="paged_decode", impl="native", isa="avx2", native_ms=1.0, torch_ms=6.0)],
    )
    info = common_pb2.InstanceInfo(
        instance_id="w1", model_id="m", state=common_pb2.INSTANCE_STATE_SERVING, num_layers=4, layers_loaded=4
    )
    info.engine.CopyFrom(engine)
    view = table.upsert(info, now_s=1.0)
    assert table.to_proto(view, now_s=1.0).engine == engine
    table.note_engine("w1", None)  # a heartbeat without one: the worker holds no model now
    assert not table.to_proto(view, now_s=1.0).HasField("engine")
