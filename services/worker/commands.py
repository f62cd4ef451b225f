"""What a lifecycle command from the global manager must say before a worker acts on it.

Every command names the instance it is for (`instance_id`); LoadParameters names the model and
Drain its timeout. Each function returns the INVALID_ARGUMENT message quoting the bad value, or
None for a request that may be acted on: an empty or garbled request changes nothing (issue 46).
Pure, so tests/unit/test_worker_commands.py pins every rule without a server.
"""

from __future__ import annotations

import math

from blitzmesh.v1 import worker_pb2


def target_error(method: str, instance_id: str, own_id: str) -> str | None:
    """A command must name this instance (the manager addresses one worker per call)."""
    if instance_id != own_id:
        return f"{method}: instance_id {instance_id!r} is not this worker ({own_id!r}); the command must name it"
    return None


def load_error(request: worker_pb2.LoadParametersRequest, own_id: str) -> str | None:
    if request.instance_id != own_id:
        return target_error("LoadParameters", request.instance_id, own_id)
    if not request.model_id:
        return f"LoadParameters: model_id is required, got {request.model_id!r}"
    return None


def drain_error(request: worker_pb2.DrainRequest, own_id: str) -> str | None:
    if request.instance_id != own_id:
        return target_error("Drain", request.instance_id, own_id)
    if not (math.isfinite(request.timeout_s) and request.timeout_s > 0):
        return f"Drain: timeout_s must be a finite number > 0, got {request.timeout_s!r}"
    return None


def unload_error(request: worker_pb2.UnloadRequest, own_id: str) -> str | None:
    if request.instance_id != own_id:
        return target_error("Unload", request.instance_id, own_id)
    if not (math.isfinite(request.keep_warm_s) and request.keep_warm_s >= 0):
        return f"Unload: keep_warm_s must be a finite number >= 0, got {request.keep_warm_s!r}"
    return None
