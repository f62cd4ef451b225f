"""KV transfer pieces without sockets: the message plan, layout checks, the descriptor's wire form."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from blitzmesh.v1 import kv_pb2
from services.worker.convert import kv_descriptor_from_proto, kv_descriptor_to_proto
from services.worker.engine.kv_cache import KVCache
from services.worker.kv_transfer import KVDescriptor, KVLayoutMismatch, KVMessage, check_layout, plan_messages

DESCRIPTOR = KVDescriptor(
    transfer_id="t-1",
    request_id="req-7",
    model_id="smollm2",
    layer_start=3,
    layer_end=30,
    num_tokens=4097,
    block_size=16,
    num_kv_heads=3,
    head_dim=64,
    dtype="bfloat16",
    producer_address=b"UCX1\x00\x01binary\xff",
    size_bytes=2 * 27 * 257 * 16 * 3 * 64 * 2,
)


def test_plan_splits_where_either_table_breaks_its_run() -> None:
    src = [10, 11, 12, 13, 20, 21]
    dst = [0, 1, 5, 6, 7, 8]
    plan = plan_messages(src, dst, (2, 4))
    runs = [(m.src_block, m.dst_block, m.num_blocks) for m in plan if m.layer == 2 and m.kv == 0]
    assert runs == [(10, 0, 2), (12, 5, 2), (20, 7, 2)]
    # Layer-major, K before V, the same runs for each.
    assert [(m.layer, m.kv) for m in plan[::3]] == [(2, 0), (2, 1), (3, 0), (3, 1)]
    assert len(plan) == 2 * 2 * 3


def test_plan_caps_message_size_in_whole_blocks() -> None:
    plan = plan_messages(list(range(7)), list(range(100, 107)), (0, 1), max_blocks=3)
    assert [(m.kv, m.src_block, m.dst_block, m.num_blocks) for m in plan] == [
        (0, 0, 100, 3),
        (0, 3, 103, 3),
        (0, 6, 106, 1),
        (1, 0, 100, 3),
        (1, 3, 103, 3),
        (1, 6, 106, 1),
    ]
    assert sum(m.num_blocks for m in plan_messages(list(range(7)), list(range(7)), (0, 1))) == 14
    assert KVMessage(5, 1, 0, 9, 2).describe() == "layer 5 V blocks 9..10"


def test_plan_refuses_tables_of_different_lengths() -> None:
    with pytest.raises(ValueError, match="producer 3, consumer 2"):
        plan_messages([1, 2, 3], [1, 2], (0, 1))


def test_layout_check_names_every_difference_with_both_values() -> None:
    producer = {"model_id": "a", "block_size": 16, "num_kv_heads": 3, "head_dim": 64, "dtype": "float32"}
    consumer = {**producer, "block_size": 32, "dtype": "bfloat16"}
    with pytest.raises(KVLayoutMismatch) as err:
        check_layout(producer, consumer, layers=(0, 30), consumer_layers=(0, 12), what="KV transfer 'x'")
    msg = str(err.value)
    assert "block_size producer=16 consumer=32" in msg
    assert "dtype producer='float32' consumer='bfloat16'" in msg
    assert "layers producer=[0, 30] consumer=[0, 12]" in msg
    assert set(err.value.fields) == {"block_size", "dtype", "layers"}
    check_layout(producer, dict(producer), layers=(2, 5), consumer_layers=(0, 12), what="ok")


def test_descriptor_round_trips_through_its_proto() -> None:
    msg = kv_descriptor_to_proto(DESCRIPTOR)
    wire = kv_pb2.KVTransferDescriptor.FromString(msg.SerializeToString())
    assert kv_descriptor_from_proto(wire) == DESCRIPTOR


@pytest.mark.parametrize(
    ("change", "quoted"),
    [
        ({"transfer_id": ""}, "transfer_id is empty"),
        ({"producer_address": b""}, "producer_address is empty"),
        ({"num_tokens": 0}, "num_tokens must be >= 1, got 0"),
        ({"layer_end": 3}, "[3, 3) is empty"),
    ],
)
def test_descriptor_from_proto_refuses_what_no_transfer_could_follow(change: dict[str, object], quoted: str) -> None:
    msg = kv_descriptor_to_proto(dataclasses.replace(DESCRIPTOR, **change))  # type: ignore[arg-type]
    with pytest.raises(ValueError) as err:
        kv_descriptor_from_proto(msg)
    assert quoted in str(err.value)


def test_block_run_is_a_view_of_the_cache() -> None:
    cache = KVCache(num_layers=2, num_blocks=8, block_size=4, num_kv_heads=2, head_dim=8, first_layer=5)
    k, v = cache.block_run(6, 2, 3)
    assert k.shape == (3, 4, 2, 8) and k.is_contiguous() and v.is_contiguous()
    k.fill_(1.0)
    assert bool((cache.layer_cache(6)[0][2:5] == 1).all()) and not cache.layer_cache(6)[0][5].any()
    assert cache.block_bytes == 4 * 2 * 8 * 4 and cache.layers == (5, 7) and cache.dtype == torch.float32
    with pytest.raises(IndexError, match=r"\[6, 9\) outside the pool of 8"):
        cache.block_run(5, 6, 3)
