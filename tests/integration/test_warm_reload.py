"""A worker unloaded with `keep_warm_s` keeps the model's weights that long: a load of the same
model within it takes them (no bytes moved) and serves the same greedy tokens; without it, or
once the time is up, a load transfers the model again (real workers, TCP data plane)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import grpc
import pytest

from blitzmesh.v1 import common_pb2, worker_pb2, worker_pb2_grpc
from services.common.waiting import wait_until
from tests.integration.test_disagg_worker import collect_tokens, request, workers

pytestmark = pytest.mark.timeout(120)

ServeFactory = Any  # tests/integration/conftest.py: serve_in_process
PROMPT = [1, *range(5, 40)]
LOAD = worker_pb2.LoadParametersRequest(model_id="tiny", role=common_pb2.INSTANCE_ROLE_COLOCATED, instance_id="w")


async def _load(stub: worker_pb2_grpc.WorkerStub) -> worker_pb2.LoadProgress:
    progress = [p async for p in stub.LoadParameters(LOAD, timeout=60)]
    assert progress[-1].done
    return progress[-1]


async def test_a_load_within_keep_warm_reuses_the_weights_with_the_same_tokens(
    tiny_models: Path, serve_in_process: ServeFactory
) -> None:
    async with workers(tiny_models, serve_in_process, {"w": common_pb2.INSTANCE_ROLE_COLOCATED}) as ws:
        svc, stub = ws["w"]
        before = await collect_tokens(stub.Generate(request("a", PROMPT), timeout=30))
        model = svc.servicer.instance.model  # type: ignore[union-attr]
        await stub.Unload(worker_pb2.UnloadRequest(keep_warm_s=30, instance_id="w"), timeout=10)
        assert (await stub.GetStatus(worker_pb2.GetStatusRequest())).state == common_pb2.INSTANCE_STATE_IDLE
        with pytest.raises(grpc.aio.AioRpcError) as e:  # IDLE serves nothing, kept weights or not
            await collect_tokens(stub.Generate(request("idle", PROMPT), timeout=10))
        assert e.value.code() == grpc.StatusCode.UNAVAILABLE
        done = await _load(stub)
        assert done.bytes_loaded == 0 and done.groups_loaded == done.groups_total > 0
        assert svc.servicer.instance.model is model  # type: ignore[union-attr]
        assert svc.servicer._warm is None
        after = await collect_tokens(stub.Generate(request("b", PROMPT), timeout=30))
        assert after == before and len(after) == 24


async def test_without_keep_warm_or_after_it_the_load_moves_the_bytes(
    tiny_models: Path, serve_in_process: ServeFactory
) -> None:
    async with workers(tiny_models, serve_in_process, {"w": common_pb2.INSTANCE_ROLE_COLOCATED}) as ws:
        svc, stub = ws["w"]
        before = await collect_tokens(stub.Generate(request("a", PROMPT), timeout=30))
        await stub.Unload(worker_pb2.UnloadRequest(instance_id="w"), timeout=10)
        assert svc.servicer._warm is None
        assert (await _load(stub)).bytes_loaded > 0
        await stub.Unload(worker_pb2.UnloadRequest(keep_warm_s=0.2, instance_id="w"), timeout=10)
        assert svc.servicer._warm is not None
        await wait_until(lambda: svc.servicer._warm is None, 10, what="the kept weights freed after 0.2 s")
        assert (await _load(stub)).bytes_loaded > 0
        assert await collect_tokens(stub.Generate(request("b", PROMPT), timeout=30)) == before


async def test_a_negative_keep_warm_is_refused_quoting_it(tiny_models: Path, serve_in_process: ServeFactory) -> None:
    async with workers(tiny_models, serve_in_process, {"w": common_pb2.INSTANCE_ROLE_COLOCATED}) as ws:
        _, stub = ws["w"]
        with pytest.raises(grpc.aio.AioRpcError) as e:
            await stub.Unload(worker_pb2.UnloadRequest(keep_warm_s=-1.5, instance_id="w"), timeout=10)
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "-1.5" in (e.value.details() or "")
        assert (await stub.GetStatus(worker_pb2.GetStatusRequest())).state == common_pb2.INSTANCE_STATE_SERVING
