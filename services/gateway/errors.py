"""The gateway's one error type, and how each kind maps onto HTTP, OpenAI and gRPC."""

from __future__ import annotations

import enum
import json
import math
from dataclasses import dataclass
from typing import Any

import grpc

from services.common.grpc_util import RETRY_AFTER_METADATA_KEY, SLO_METADATA_KEY


@dataclass(frozen=True)
class _Mapping:
    http_status: int
    grpc_code: grpc.StatusCode
    openai_type: str
    metric_outcome: str


class ErrorKind(enum.Enum):
    """Every way a request can fail; the value says how each API reports it."""

    INVALID = _Mapping(400, grpc.StatusCode.INVALID_ARGUMENT, "invalid_request_error", "invalid")
    UNAUTHENTICATED = _Mapping(401, grpc.StatusCode.UNAUTHENTICATED, "authentication_error", "unauthenticated")
    # Authenticated, or calling from where it may, but not allowed this call (an inference key on
    # an admin call, an admin call from a remote peer with no admin keys configured).
    FORBIDDEN = _Mapping(403, grpc.StatusCode.PERMISSION_DENIED, "permission_error", "forbidden")
    NOT_FOUND = _Mapping(404, grpc.StatusCode.NOT_FOUND, "invalid_request_error", "not_found")
    TOO_LARGE = _Mapping(413, grpc.StatusCode.INVALID_ARGUMENT, "invalid_request_error", "invalid")
    OVERLOADED = _Mapping(429, grpc.StatusCode.RESOURCE_EXHAUSTED, "rate_limit_error", "overloaded")
    # The request's latency objective cannot be met by any instance tried (they refused it
    # before its first token); retryable after `retry_after_s`.
    SLO_UNATTAINABLE = _Mapping(429, grpc.StatusCode.RESOURCE_EXHAUSTED, "slo_unattainable", "slo_rejected")
    INTERNAL = _Mapping(500, grpc.StatusCode.INTERNAL, "server_error", "internal")
    # The stream already started: reported in-band (SSE error event / INTERNAL status).
    MID_STREAM = _Mapping(500, grpc.StatusCode.INTERNAL, "server_error", "mid_stream_error")
    UNAVAILABLE = _Mapping(503, grpc.StatusCode.UNAVAILABLE, "service_unavailable", "unavailable")
    TIMEOUT = _Mapping(504, grpc.StatusCode.DEADLINE_EXCEEDED, "timeout", "timeout")

    @property
    def http_status(self) -> int:
        return self.value.http_status

    @property
    def grpc_code(self) -> grpc.StatusCode:
        return self.value.grpc_code

    @property
    def openai_type(self) -> str:
        return self.value.openai_type

    @property
    def metric_outcome(self) -> str:
        return self.value.metric_outcome


class GatewayError(Exception):
    """A request failed in a way the client must be told about, with a message quoting values.

    `param` names the offending request field (OpenAI's `error.param`); `code` is OpenAI's
    machine-readable `error.code` (e.g. "model_not_found"). `retry_after_s` (a 429 that knows
    when room is expected) becomes HTTP's `Retry-After` and gRPC's `retry-after-s` trailing
    metadata; `slo_kind` ("ttft" or "tpot") names the objective an SLO refusal is about.
    """

    def __init__(
        self,
        kind: ErrorKind,
        message: str,
        *,
        param: str | None = None,
        code: str | int | None = None,
        retry_after_s: float | None = None,
        slo_kind: str | None = None,
    ) -> None:
        super().__init__(message)
        self.kind = kind
        self.message = message
        self.param = param
        self.code = code
        self.retry_after_s = retry_after_s
        self.slo_kind = slo_kind

    def http_headers(self) -> dict[str, str]:
        """`Retry-After` in whole seconds (rounded up, at least 1) when the error knows it."""
        if self.retry_after_s is None:
            return {}
        return {"Retry-After": str(retry_after_header_s(self.retry_after_s))}

    def grpc_trailing_metadata(self) -> tuple[tuple[str, str], ...]:
        out: list[tuple[str, str]] = []
        if self.retry_after_s is not None:
            out.append((RETRY_AFTER_METADATA_KEY, f"{self.retry_after_s:.3f}"))
        if self.slo_kind is not None:
            out.append((SLO_METADATA_KEY, self.slo_kind))
        return tuple(out)

    def openai_body(self) -> dict[str, Any]:
        """OpenAI's error shape: {"error": {"message", "type", "param", "code"}}."""
        return {
            "error": {
                "message": self.message,
                "type": self.kind.openai_type,
                "param": self.param,
                "code": self.code,
            }
        }

    def __repr__(self) -> str:
        return f"GatewayError({self.kind.name}, {self.message!r})"


def retry_after_header_s(seconds: float) -> int:
    """HTTP's Retry-After holds whole seconds: rounded up, and never 0 (a client would retry at
    once, into the same refusal)."""
    if not math.isfinite(seconds):
        return 1
    return max(1, math.ceil(seconds))


def quote(value: Any) -> str:
    """Render a client-supplied value for an error message, as JSON and bounded in length."""
    try:
        text = json.dumps(value, ensure_ascii=False)
    except (TypeError, ValueError):
        text = repr(value)
    return text if len(text) <= 120 else text[:117] + "..."


def invalid(message: str, param: str | None = None, code: str | None = None) -> GatewayError:
    return GatewayError(ErrorKind.INVALID, message, param=param, code=code)
