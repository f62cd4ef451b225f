"""What the worker's Generate makes of a request's mode and of the errors its stream ends with.

Pure (no server, no engine): `mode_of` reads the request's `mode` oneof as the engine's
`RequestMode` (their names are the same), and `refusal_for` maps an error to the outcome counted
in the worker's metrics, the gRPC status the gateway acts on, its details and trailing metadata.
The gateway's reading of those statuses is `services/gateway/replies.py`.
"""

from __future__ import annotations

from dataclasses import dataclass

import grpc

from services.common.grpc_util import MOVED_METADATA_KEY, RETRY_AFTER_METADATA_KEY, SLO_METADATA_KEY
from services.worker.engine.engine import EngineDeadError, EngineStoppedError, RequestMovedError, RequestTooLarge
from services.worker.engine.request import RequestMode
from services.worker.engine.slo import RequestSLO, SLOUnattainable

ESP_MEMBER = "esp_member"  # not an engine mode: the ESP worker serves it


def mode_of(oneof: str | None) -> RequestMode:
    """The engine mode a WorkerGenerateRequest's `mode` oneof names (none set: colocated)."""
    try:
        return RequestMode(oneof or RequestMode.COLOCATED.value)
    except ValueError:
        modes = [m.value for m in RequestMode]
        raise ValueError(f"mode {oneof!r} is not one of {modes}") from None


@dataclass(frozen=True)
class Refusal:
    """How a Generate stream ends on an error."""

    outcome: str  # the worker's requests counter label
    code: grpc.StatusCode
    details: str
    trailing: tuple[tuple[str, str], ...] = ()


def slo_refusal_message(instance_id: str, e: SLOUnattainable, slo: RequestSLO | None) -> str:
    """The details of an SLO refusal: the objective, its value as this worker got it, and why."""
    value = None if slo is None else (slo.ttft_s if e.slo == "ttft" else slo.tpot_s)
    objective = f"{e.slo.upper()} SLO" + (f" of {value:g} s" if value is not None else "")
    return f"instance {instance_id}: {objective} unattainable: {e} (retry after {e.retry_after_s:.3f} s)"


def refusal_for(e: BaseException, instance_id: str, slo: RequestSLO | None) -> Refusal | None:
    """The reply to an error a request's stream raised; None: not the request's fault nor a
    known engine state (the caller lets it propagate)."""
    if isinstance(e, RequestMovedError):
        # Released by rebalancing before it started: the gateway re-routes it, uncounted.
        return Refusal(
            "moved", grpc.StatusCode.ABORTED, f"instance {instance_id}: {e}", ((MOVED_METADATA_KEY, "rebalance"),)
        )
    if isinstance(e, SLOUnattainable):
        # Refused before its first token: the gateway may try another instance, else tells its
        # client 429 with Retry-After.
        return Refusal(
            "slo_rejected",
            grpc.StatusCode.RESOURCE_EXHAUSTED,
            slo_refusal_message(instance_id, e, slo),
            ((RETRY_AFTER_METADATA_KEY, f"{e.retry_after_s:.3f}"), (SLO_METADATA_KEY, e.slo)),
        )
    if isinstance(e, (EngineDeadError, EngineStoppedError)):
        # The gateway retries UNAVAILABLE on another instance if no token was sent yet.
        return Refusal("engine_down", grpc.StatusCode.UNAVAILABLE, f"instance {instance_id}: {e}")
    if isinstance(e, (RequestTooLarge, ValueError)):
        return Refusal("rejected", grpc.StatusCode.INVALID_ARGUMENT, str(e))
    return None
