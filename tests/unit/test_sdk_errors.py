"""Tests of the mapping from gRPC status codes to SDK exceptions (blitzmesh.errors)."""

from __future__ import annotations

import pickle

import grpc
import grpc.aio
import pytest

from blitzmesh import errors

pytestmark = [pytest.mark.timeout(10), pytest.mark.filterwarnings("error")]

EXPECTED = {
    grpc.StatusCode.OK: errors.InternalError,
    grpc.StatusCode.CANCELLED: errors.RequestCancelledError,
    grpc.StatusCode.UNKNOWN: errors.InternalError,
    grpc.StatusCode.INVALID_ARGUMENT: errors.InvalidRequestError,
    grpc.StatusCode.DEADLINE_EXCEEDED: errors.DeadlineExceededError,
    grpc.StatusCode.NOT_FOUND: errors.NotFoundError,
    grpc.StatusCode.ALREADY_EXISTS: errors.InvalidRequestError,
    grpc.StatusCode.PERMISSION_DENIED: errors.AuthenticationError,
    grpc.StatusCode.RESOURCE_EXHAUSTED: errors.OverloadedError,
    grpc.StatusCode.FAILED_PRECONDITION: errors.InvalidRequestError,
    grpc.StatusCode.ABORTED: errors.InternalError,
    grpc.StatusCode.OUT_OF_RANGE: errors.InvalidRequestError,
    grpc.StatusCode.UNIMPLEMENTED: errors.UnimplementedError,
    grpc.StatusCode.INTERNAL: errors.InternalError,
    grpc.StatusCode.UNAVAILABLE: errors.UnavailableError,
    grpc.StatusCode.DATA_LOSS: errors.InternalError,
    grpc.StatusCode.UNAUTHENTICATED: errors.AuthenticationError,
}


def rpc_error(code: grpc.StatusCode, details: str | None) -> grpc.aio.AioRpcError:
    return grpc.aio.AioRpcError(code, grpc.aio.Metadata(), grpc.aio.Metadata(), details=details)


def test_every_status_code_has_an_expected_class():
    assert set(EXPECTED) == set(grpc.StatusCode)


@pytest.mark.parametrize("code", list(grpc.StatusCode), ids=lambda c: c.name)
def test_status_code_maps_to_its_exception(code):
    err = errors.from_rpc_error(rpc_error(code, "model 'x' is not served"), request_id="r1")
    assert type(err) is EXPECTED[code]
    assert isinstance(err, errors.BlitzmeshError)
    assert err.code == code.name
    assert err.details == "model 'x' is not served"
    assert err.request_id == "r1"


def test_missing_details_fall_back_to_the_code_name():
    err = errors.from_rpc_error(rpc_error(grpc.StatusCode.UNAVAILABLE, None))
    assert err.details == "UNAVAILABLE" and err.request_id is None


def test_rpc_error_without_status_accessors_is_unknown():
    err = errors.from_rpc_error(grpc.RpcError())
    assert type(err) is errors.InternalError and err.code == "UNKNOWN"


def test_str_names_code_details_and_request_id():
    err = errors.NotFoundError("no model 'x'", code="NOT_FOUND", request_id="r7")
    assert str(err) == "NOT_FOUND: no model 'x' (request_id=r7)"
    assert "NotFoundError" in repr(err)


def test_errors_survive_pickling():
    err = errors.OverloadedError("queue full", code="RESOURCE_EXHAUSTED", request_id="r2")
    back = pickle.loads(pickle.dumps(err))
    assert type(back) is errors.OverloadedError
    assert (back.details, back.code, back.request_id) == ("queue full", "RESOURCE_EXHAUSTED", "r2")
