"""A lifecycle command that does not say which instance it is for, or says it wrongly, changes
nothing: a real worker (in this process, loaded with the tiny model) sent the empty and the
wrong-target versions of every state-changing command. On the code before this check an empty
Drain drained the instance and an empty Unload dropped its model."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import grpc
import pytest

from blitzmesh.v1 import common_pb2, worker_pb2
from tests.integration.test_disagg_worker import collect_tokens, request, workers

pytestmark = pytest.mark.timeout(120)

SERVING = common_pb2.INSTANCE_STATE_SERVING

# (rpc, request, the bad value its refusal must quote)
REFUSED: list[tuple[str, Any, str]] = [
    ("Drain", worker_pb2.DrainRequest(), "instance_id ''"),
    ("Drain", worker_pb2.DrainRequest(timeout_s=60, instance_id="w9"), "instance_id 'w9'"),
    ("Drain", worker_pb2.DrainRequest(instance_id="w"), "timeout_s must be a finite number > 0, got 0.0"),
    ("Drain", worker_pb2.DrainRequest(instance_id="w", timeout_s=float("nan")), "got nan"),
    ("Unload", worker_pb2.UnloadRequest(), "instance_id ''"),
    ("Unload", worker_pb2.UnloadRequest(instance_id="w9"), "instance_id 'w9'"),
    ("Unload", worker_pb2.UnloadRequest(instance_id="w", keep_warm_s=-1.5), "got -1.5"),
    ("Resume", worker_pb2.ResumeRequest(), "instance_id ''"),
    ("ReleaseWaiting", worker_pb2.ReleaseWaitingRequest(max_requests=5), "instance_id ''"),
    ("ReleaseRunning", worker_pb2.ReleaseRunningRequest(max_requests=5, instance_id="x"), "instance_id 'x'"),
    ("LoadParameters", worker_pb2.LoadParametersRequest(model_id="tiny"), "instance_id ''"),
    ("LoadParameters", worker_pb2.LoadParametersRequest(instance_id="w"), "model_id is required, got ''"),
]


async def _call(stub: Any, rpc: str, req: Any) -> None:
    if rpc == "LoadParameters":
        async for _ in stub.LoadParameters(req, timeout=10):
            pass
    else:
        await getattr(stub, rpc)(req, timeout=10)


async def test_every_command_without_its_target_or_with_a_bad_field_is_refused_and_changes_nothing(
    tiny_models: Path, serve_in_process: Any
) -> None:
    async with workers(tiny_models, serve_in_process, {"w": common_pb2.INSTANCE_ROLE_COLOCATED}) as ws:
        svc, stub = ws["w"]
        prompt = [1, *range(5, 20)]
        before = await collect_tokens(stub.Generate(request("a", prompt), timeout=30))
        model = svc.servicer.instance.model  # type: ignore[union-attr]
        for rpc, req, quoted in REFUSED:
            with pytest.raises(grpc.aio.AioRpcError) as e:
                await _call(stub, rpc, req)
            assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT, (rpc, req, e.value.details())
            assert quoted in (e.value.details() or ""), (rpc, e.value.details())
            status = await stub.GetStatus(worker_pb2.GetStatusRequest(), timeout=5)
            assert (status.state, status.model_id) == (SERVING, "tiny"), (rpc, req)
        assert svc.servicer.instance.model is model  # type: ignore[union-attr]
        assert await collect_tokens(stub.Generate(request("b", prompt), timeout=30)) == before
        # The same commands naming it are acted on: drained, then unloaded.
        drained = await stub.Drain(worker_pb2.DrainRequest(timeout_s=5, instance_id="w"), timeout=10)
        assert (drained.finished, drained.aborted) == (0, 0)
        await stub.Unload(worker_pb2.UnloadRequest(instance_id="w"), timeout=10)
        status = await stub.GetStatus(worker_pb2.GetStatusRequest(), timeout=5)
        assert status.state == common_pb2.INSTANCE_STATE_IDLE
