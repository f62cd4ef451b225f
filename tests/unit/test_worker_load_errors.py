"""The worker's LoadParameters answers every failure typed (issue 24): a code of its own, never
UNKNOWN, and the error's type in the message, so the manager's load_result says what broke."""

from __future__ import annotations

import grpc
import pytest

from services.dataplane.errors import ChecksumMismatch, InsufficientMemory, ModelNotHeld, PeerUnreachable
from services.worker.service import load_error_status


class UCXXShmemSegmentError(Exception):
    """Stands in for an error of a library below the data plane that slipped through."""


@pytest.mark.parametrize(
    ("error", "code", "named"),
    [
        (PeerUnreachable("cannot open a UCX endpoint"), grpc.StatusCode.FAILED_PRECONDITION, "PeerUnreachable"),
        (
            ModelNotHeld("w1: model 'm' is not served here (dropped)"),
            grpc.StatusCode.FAILED_PRECONDITION,
            "ModelNotHeld",
        ),
        (
            ChecksumMismatch("bad", group="embed", expected="a", actual="b"),
            grpc.StatusCode.FAILED_PRECONDITION,
            "ChecksumMismatch",
        ),
        (InsufficientMemory("needs 9 bytes, budget is 1"), grpc.StatusCode.RESOURCE_EXHAUSTED, "InsufficientMemory"),
        (TimeoutError("load_timeout_s"), grpc.StatusCode.FAILED_PRECONDITION, "TimeoutError"),
        (UCXXShmemSegmentError("Shared memory error"), grpc.StatusCode.INTERNAL, "UCXXShmemSegmentError"),
        (KeyError("layers.3"), grpc.StatusCode.INTERNAL, "KeyError"),
    ],
)
def test_every_load_error_is_typed(error: Exception, code: grpc.StatusCode, named: str) -> None:
    got, detail = load_error_status(error, "pm:1")
    assert got == code and got != grpc.StatusCode.UNKNOWN
    assert named in detail, detail
