"""A worker request's mode is one typed value (the `mode` oneof of WorkerGenerateRequest), built
by the gateway from what the request needs."""

from __future__ import annotations

import pytest

from blitzmesh.v1 import kv_pb2, worker_pb2
from services.gateway.backend import generate_mode


def _mode(**kw) -> str | None:
    return worker_pb2.WorkerGenerateRequest(**generate_mode(**kw)).WhichOneof("mode")


def test_each_need_maps_to_one_mode() -> None:
    source = worker_pb2.ZigzagSource(instance_id="w1", dataplane_address=b"dp")
    desc = kv_pb2.KVTransferDescriptor(transfer_id="t")
    assert _mode() == "colocated"
    assert _mode(handoff=True) == "prefill_handoff"
    assert _mode(kv_source=desc) == "decode_from_kv"
    assert _mode(zigzag_source=source) == "zigzag_partner"
    assert _mode(zigzag_source=source, handoff=True) == "zigzag_partner_handoff"
    req = worker_pb2.WorkerGenerateRequest(**generate_mode(kv_source=desc))
    assert req.decode_from_kv.transfer_id == "t"


def test_contradictory_needs_are_refused() -> None:
    desc = kv_pb2.KVTransferDescriptor(transfer_id="t")
    with pytest.raises(ValueError, match="neither hands off nor relays"):
        generate_mode(kv_source=desc, handoff=True)


def test_setting_a_second_mode_replaces_the_first() -> None:
    req = worker_pb2.WorkerGenerateRequest(prefill_handoff=worker_pb2.PrefillHandoffMode())
    req.zigzag_first_layers.SetInParent()
    assert req.WhichOneof("mode") == "zigzag_first_layers" and not req.HasField("prefill_handoff")
