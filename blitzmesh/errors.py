"""Exceptions of the Blitzmesh SDK: one class per family of gRPC status codes.

The gateway reports every failure as a gRPC status with details; `from_rpc_error` turns that
status into the matching exception so callers can `except OverloadedError` instead of comparing
status codes.
"""

from __future__ import annotations

import math
from typing import Any

import grpc

RETRY_AFTER_METADATA_KEY = "retry-after-s"
"""Trailing metadata of a RESOURCE_EXHAUSTED status: seconds until the server expects room."""
SLO_METADATA_KEY = "slo-kind"
"""Trailing metadata naming the objective ("ttft" or "tpot") a refused request could not meet."""

__all__ = [
    "AuthenticationError",
    "BlitzmeshError",
    "DeadlineExceededError",
    "InternalError",
    "InvalidRequestError",
    "NotFoundError",
    "OverloadedError",
    "RequestCancelledError",
    "SLOUnattainableError",
    "UnavailableError",
    "UnimplementedError",
    "from_rpc_error",
]


class BlitzmeshError(Exception):
    """Base class of every error the SDK raises for a failed call.

    Attributes:
        code: name of the gRPC status code, e.g. ``"UNAVAILABLE"``.
        details: the server's (or the SDK's) explanation.
        request_id: id of the inference request that failed, when there was one; quote it when
            reading gateway logs.
    """

    def __init__(self, details: str, *, code: str = "UNKNOWN", request_id: str | None = None):
        super().__init__(details)
        self.code = code
        self.details = details
        self.request_id = request_id

    def __str__(self) -> str:
        suffix = f" (request_id={self.request_id})" if self.request_id else ""
        return f"{self.code}: {self.details}{suffix}"

    def __repr__(self) -> str:
        return f"{type(self).__name__}(details={self.details!r}, code={self.code!r}, request_id={self.request_id!r})"

    def __reduce__(self) -> tuple[Any, ...]:
        # The keyword-only fields would be lost by Exception's default pickling, which replays
        # only the positional args; errors cross process boundaries in worker pools.
        return (_rebuild, (type(self), self.details, self.code, self.request_id))


def _rebuild(cls: type[BlitzmeshError], details: str, code: str, request_id: str | None) -> BlitzmeshError:
    return cls(details, code=code, request_id=request_id)


class InvalidRequestError(BlitzmeshError):
    """The request was rejected as malformed or not allowed in the current state."""


class NotFoundError(BlitzmeshError):
    """The named object (e.g. a model) does not exist."""


class AuthenticationError(BlitzmeshError):
    """The API key is missing, wrong, or lacks the permission for this call."""


class OverloadedError(BlitzmeshError):
    """The gateway refused the request for lack of capacity; try again later.

    Attributes:
        retry_after_s: when the server expects room, in seconds, if it said (else ``None``).
    """

    def __init__(
        self,
        details: str,
        *,
        code: str = "RESOURCE_EXHAUSTED",
        request_id: str | None = None,
        retry_after_s: float | None = None,
    ):
        super().__init__(details, code=code, request_id=request_id)
        self.retry_after_s = retry_after_s

    def __reduce__(self) -> tuple[Any, ...]:
        return (_rebuild_overloaded, (type(self), self.details, self.code, self.request_id, self.retry_after_s))


def _rebuild_overloaded(
    cls: type[OverloadedError], details: str, code: str, request_id: str | None, retry_after_s: float | None
) -> OverloadedError:
    return cls(details, code=code, request_id=request_id, retry_after_s=retry_after_s)


class SLOUnattainableError(OverloadedError):
    """The request's latency objective (``ttft_slo_s`` or ``tpot_slo_s``) cannot be met now: the
    instances that could serve it are too busy. Retry after `retry_after_s`, or relax the
    objective. The message names the objective and its value."""


class UnavailableError(BlitzmeshError):
    """The gateway (or the instance serving the request) could not be reached."""


class DeadlineExceededError(BlitzmeshError):
    """The call did not finish within its deadline (``timeout_s``)."""


class RequestCancelledError(BlitzmeshError):
    """The call was cancelled, by the server or by the transport."""


class InternalError(BlitzmeshError):
    """The server failed while handling the call (e.g. a worker died mid-stream), or its reply
    broke the protocol."""


class UnimplementedError(BlitzmeshError):
    """The server does not implement this method (e.g. an older gateway)."""


_BY_CODE: dict[grpc.StatusCode, type[BlitzmeshError]] = {
    grpc.StatusCode.INVALID_ARGUMENT: InvalidRequestError,
    grpc.StatusCode.OUT_OF_RANGE: InvalidRequestError,
    grpc.StatusCode.FAILED_PRECONDITION: InvalidRequestError,
    grpc.StatusCode.ALREADY_EXISTS: InvalidRequestError,
    grpc.StatusCode.NOT_FOUND: NotFoundError,
    grpc.StatusCode.UNAUTHENTICATED: AuthenticationError,
    grpc.StatusCode.PERMISSION_DENIED: AuthenticationError,
    grpc.StatusCode.RESOURCE_EXHAUSTED: OverloadedError,
    grpc.StatusCode.UNAVAILABLE: UnavailableError,
    grpc.StatusCode.DEADLINE_EXCEEDED: DeadlineExceededError,
    grpc.StatusCode.CANCELLED: RequestCancelledError,
    grpc.StatusCode.INTERNAL: InternalError,
    grpc.StatusCode.UNKNOWN: InternalError,
    grpc.StatusCode.DATA_LOSS: InternalError,
    grpc.StatusCode.ABORTED: InternalError,
    grpc.StatusCode.UNIMPLEMENTED: UnimplementedError,
    # A failed call never carries OK; if one does, the server broke the protocol.
    grpc.StatusCode.OK: InternalError,
}


def from_rpc_error(e: grpc.RpcError, *, request_id: str | None = None) -> BlitzmeshError:
    """Map a failed gRPC call to the SDK exception of its status code.

    Args:
        e: the error raised by a grpc (sync or aio) call.
        request_id: the inference request id to attach, if the call had one.
    """
    # grpc.RpcError itself declares no accessors; the concrete errors (grpc.Call, AioRpcError)
    # do. Anything else is reported as UNKNOWN instead of failing inside the error path.
    code_fn = getattr(e, "code", None)
    details_fn = getattr(e, "details", None)
    code = code_fn() if callable(code_fn) else None
    details = details_fn() if callable(details_fn) else None
    if not isinstance(code, grpc.StatusCode):
        code = grpc.StatusCode.UNKNOWN
    cls = _BY_CODE.get(code, InternalError)
    if cls is OverloadedError:
        trailing = _trailing(e)
        retry_after_s = parse_retry_after_s(trailing.get(RETRY_AFTER_METADATA_KEY))
        if trailing.get(SLO_METADATA_KEY):
            cls = SLOUnattainableError
        return cls(details or code.name, code=code.name, request_id=request_id, retry_after_s=retry_after_s)
    return cls(details or code.name, code=code.name, request_id=request_id)


def _trailing(e: grpc.RpcError) -> dict[str, str]:
    fn = getattr(e, "trailing_metadata", None)
    try:
        pairs = fn() if callable(fn) else None
    except Exception:  # an error object that cannot say: treat as none
        return {}
    out: dict[str, str] = {}
    for pair in pairs or ():
        key, value = pair
        out[str(key).lower()] = value.decode("latin-1") if isinstance(value, bytes) else str(value)
    return out


def parse_retry_after_s(value: str | bytes | None) -> float | None:
    """A `retry-after-s` metadata value as seconds; None when absent or not a finite number >= 0."""
    if value is None:
        return None
    try:
        seconds = float(value)
    except ValueError:
        return None
    return seconds if math.isfinite(seconds) and seconds >= 0 else None
