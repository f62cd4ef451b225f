"""The worker's Generate: the request's `mode` oneof read as the engine's mode, and each error a
stream can end with mapped to its counter label, gRPC status and trailing metadata."""

from __future__ import annotations

import grpc
import pytest

from blitzmesh.v1 import worker_pb2
from services.common.grpc_util import MOVED_METADATA_KEY, RETRY_AFTER_METADATA_KEY, SLO_METADATA_KEY
from services.worker.engine.engine import EngineDeadError, EngineStoppedError, RequestMovedError, RequestTooLarge
from services.worker.engine.request import RequestMode
from services.worker.engine.slo import RequestSLO, SLOUnattainable
from services.worker.generate_reply import ESP_MEMBER, mode_of, refusal_for


def test_every_engine_mode_of_the_oneof_reads_as_that_mode() -> None:
    oneof = worker_pb2.WorkerGenerateRequest.DESCRIPTOR.oneofs_by_name["mode"]
    names = {f.name for f in oneof.fields} - {ESP_MEMBER}
    assert names == {m.value for m in RequestMode}  # a new wire mode needs an engine mode, and back
    for name in names:
        assert mode_of(name) is RequestMode(name)
    assert mode_of(None) is RequestMode.COLOCATED  # none set: colocated
    with pytest.raises(ValueError, match="'nonsense' is not one of"):
        mode_of("nonsense")


def test_each_error_has_its_reply() -> None:
    slo = RequestSLO(ttft_s=0.5)
    moved = refusal_for(RequestMovedError("released"), "w0", None)
    assert moved is not None and (moved.outcome, moved.code) == ("moved", grpc.StatusCode.ABORTED)
    assert moved.trailing == ((MOVED_METADATA_KEY, "rebalance"),)
    refused = refusal_for(SLOUnattainable("queue too long", slo="ttft", retry_after_s=1.25), "w0", slo)
    assert refused is not None and (refused.outcome, refused.code) == (
        "slo_rejected",
        grpc.StatusCode.RESOURCE_EXHAUSTED,
    )
    assert dict(refused.trailing) == {RETRY_AFTER_METADATA_KEY: "1.250", SLO_METADATA_KEY: "ttft"}
    assert "TTFT SLO of 0.5 s unattainable" in refused.details
    for error in (EngineDeadError("crashed"), EngineStoppedError("stopped")):
        down = refusal_for(error, "w0", None)
        assert down is not None and (down.outcome, down.code) == ("engine_down", grpc.StatusCode.UNAVAILABLE)
        assert down.details.startswith("instance w0: ")
    for error in (RequestTooLarge("prompt of 9000 tokens"), ValueError("bad sampling")):
        bad = refusal_for(error, "w0", None)
        assert bad is not None and (bad.outcome, bad.code) == ("rejected", grpc.StatusCode.INVALID_ARGUMENT)
        assert bad.details == str(error)
    assert refusal_for(RuntimeError("a bug"), "w0", None) is None
