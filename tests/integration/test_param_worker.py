"""Parameter manager + worker as real gRPC servers: loading, checksums, generation, lifecycle."""

from __future__ import annotations

import asyncio
import socket
from pathlib import Path
from typing import Any

import grpc
import pytest
import structlog
import structlog.testing
import torch
from prometheus_client import generate_latest

from blitzmesh.v1 import common_pb2, param_manager_pb2, param_manager_pb2_grpc, worker_pb2, worker_pb2_grpc
from services.common.grpc_util import channel
from services.common.waiting import wait_until
from services.model_format.checkpoint import iter_groups
from services.param_manager.service import ParamManagerConfig, ParamManagerService
from services.worker.config import WorkerConfig
from services.worker.engine.sampling import SamplingParams
from services.worker.loader import fetch_layout_and_locations, locate_sources
from services.worker.model import kernels
from services.worker.model.llama import load_model
from services.worker.service import WorkerService

ServeFactory = Any  # tests/integration/conftest.py: serve_in_process

pytestmark = pytest.mark.timeout(120)


def pm_config(model_dir: Path) -> ParamManagerConfig:
    # Both services run in this one process, and ucxx allows one worker per process: TCP here;
    # UCX between real processes is covered by the data-plane and e2e tests.
    return ParamManagerConfig(port=0, model_dir=model_dir, chunk_bytes=64 * 1024, dataplane="tcp")


def worker_config(pm_address: str, **kw: object) -> WorkerConfig:
    return WorkerConfig(
        port=0,
        param_manager=pm_address,
        instance_id="w0",
        kv_cache_tokens=4096,
        dataplane="tcp",
        **kw,  # type: ignore[arg-type]
    )


async def _load(worker_address: str, model_id: str) -> list[worker_pb2.LoadProgress]:
    async with channel(worker_address) as ch:
        stub = worker_pb2_grpc.WorkerStub(ch)
        return [
            p
            async for p in stub.LoadParameters(
                worker_pb2.LoadParametersRequest(model_id=model_id, instance_id="w0"), timeout=60
            )
        ]


async def _status(worker_address: str) -> common_pb2.InstanceInfo:
    async with channel(worker_address) as ch:
        return await worker_pb2_grpc.WorkerStub(ch).GetStatus(worker_pb2.GetStatusRequest(), timeout=5)


async def test_layout_lists_every_group_once(tiny_models: Path, serve_in_process: ServeFactory) -> None:
    pm = ParamManagerService(pm_config(tiny_models))
    async with serve_in_process(pm, pm.servicer.config) as ctx, channel(ctx.address) as ch:
        stub = param_manager_pb2_grpc.ParamManagerStub(ch)
        layout = await stub.GetModel(param_manager_pb2.GetModelRequest(model_id="tiny"), timeout=5)
        names = [g.name for g in layout.groups]
        assert names == ["embed", *(f"layers.{i}" for i in range(layout.info.num_layers)), "head"]
        assert layout.info.size_bytes == sum(g.size_bytes for g in layout.groups)
        # One host copy: the pool holds the checkpoint's bytes once (plus < 64 B alignment per tensor).
        ckpt_bytes = sum(
            t.numel() * t.element_size() for _, ts in iter_groups(tiny_models / "tiny") for t in ts.values()
        )
        n_tensors = sum(len(g.tensors) for g in layout.groups)
        assert ckpt_bytes <= layout.info.size_bytes < ckpt_bytes + 64 * n_tensors
        with pytest.raises(grpc.aio.AioRpcError) as e:
            await stub.GetModel(param_manager_pb2.GetModelRequest(model_id="nope"), timeout=5)
        assert e.value.code() == grpc.StatusCode.NOT_FOUND and "'nope'" in (e.value.details() or "")


async def test_worker_loads_from_pool_bit_identical_and_generates(
    tiny_models: Path, serve_in_process: ServeFactory
) -> None:
    pm = ParamManagerService(pm_config(tiny_models))
    async with serve_in_process(pm, pm.servicer.config) as pm_ctx:
        wk = WorkerService(worker_config(pm_ctx.address))
        async with serve_in_process(wk, wk.cfg) as w_ctx:
            assert (await _status(w_ctx.address)).state == common_pb2.INSTANCE_STATE_IDLE
            progress = await _load(w_ctx.address, "tiny")
            assert progress[-1].done and progress[-1].groups_loaded == progress[-1].groups_total
            assert [p.groups_loaded for p in progress[:-1]] == list(range(1, progress[-1].groups_total + 1))
            info = await _status(w_ctx.address)
            assert info.state == common_pb2.INSTANCE_STATE_SERVING
            assert info.layers_loaded == info.num_layers > 0
            # The kernels were chosen for this model on this CPU, and the status says which.
            assert info.engine.dtype == "float32" and info.engine.kernel_mode == "auto"
            assert {k.op for k in info.engine.kernels} == set(kernels.OPS)
            for k in info.engine.kernels:
                assert k.impl in ("native", "torch")
                if k.impl == "native" and k.HasField("speedup"):
                    assert k.speedup > 1.0, k
            metrics = generate_latest().decode()
            for k in info.engine.kernels:
                assert f'blitzmesh_worker_kernel_info{{impl="{k.impl}",isa="{k.isa}",op="{k.op}"}} 1.0' in metrics

            # Parameters on the worker are bit-identical to the checkpoint.
            model = wk.servicer.instance.model  # type: ignore[union-attr]
            for name, tensors in iter_groups(tiny_models / "tiny"):
                got = model.export_group(name)
                for tname, t in tensors.items():
                    assert torch.equal(got[tname], t), tname

            # Greedy generation over gRPC equals the reference model computing the full sequence.
            prompt = [1, 5, 9, 42, 7]
            async with channel(w_ctx.address) as ch:
                stub = worker_pb2_grpc.WorkerStub(ch)
                req = worker_pb2.WorkerGenerateRequest(
                    request_id="r1",
                    model_id="tiny",
                    prompt_token_ids=prompt,
                    sampling=common_pb2.SamplingParams(temperature=0, max_tokens=6, ignore_eos=True),
                )
                out = [t async for m in stub.Generate(req, timeout=30) for t in m.token_ids]
            ref_model = load_model(str(tiny_models / "tiny"))
            seq = list(prompt)
            for _ in range(6):
                logits = ref_model.forward(torch.tensor(seq))
                seq.append(int(logits[-1].argmax()))
            assert out == seq[len(prompt) :]
            assert SamplingParams(temperature=0).greedy


async def test_checksum_mismatch_fails_load_and_worker_returns_idle(
    tiny_models: Path, serve_in_process: ServeFactory
) -> None:
    pm = ParamManagerService(pm_config(tiny_models))
    async with serve_in_process(pm, pm.servicer.config) as pm_ctx:
        # Flip one byte of a layer in the pool after its checksum was taken.
        model = pm.servicer.models["tiny"]
        buf = model.buffers[model.manifest.group_index("layers.1")]
        assert buf is not None
        buf[123] ^= 0xFF
        wk = WorkerService(worker_config(pm_ctx.address))
        async with serve_in_process(wk, wk.cfg) as w_ctx:
            with pytest.raises(grpc.aio.AioRpcError) as e:
                await _load(w_ctx.address, "tiny")
            assert e.value.code() == grpc.StatusCode.FAILED_PRECONDITION
            assert "layers.1" in (e.value.details() or "") and "checksum" in (e.value.details() or "")
            assert (await _status(w_ctx.address)).state == common_pb2.INSTANCE_STATE_IDLE
            with pytest.raises(grpc.aio.AioRpcError) as e2:
                await _load(w_ctx.address, "no-such-model")
            assert e2.value.code() == grpc.StatusCode.NOT_FOUND
            assert (await _status(w_ctx.address)).state == common_pb2.INSTANCE_STATE_IDLE


async def test_generate_on_idle_worker_is_unavailable(tiny_models: Path, serve_in_process: ServeFactory) -> None:
    wk = WorkerService(WorkerConfig(port=0, instance_id="w-idle", dataplane="tcp"))
    async with serve_in_process(wk, wk.cfg) as w_ctx, channel(w_ctx.address) as ch:
        stub = worker_pb2_grpc.WorkerStub(ch)
        with pytest.raises(grpc.aio.AioRpcError) as e:
            async for _ in stub.Generate(worker_pb2.WorkerGenerateRequest(prompt_token_ids=[1]), timeout=5):
                pass
        assert e.value.code() == grpc.StatusCode.UNAVAILABLE and "IDLE" in (e.value.details() or "")


async def test_load_from_another_parameter_source_is_refused(tiny_models: Path, serve_in_process: ServeFactory) -> None:
    """A LoadParameters may not point a worker at weights other than its own parameter manager's."""
    wk = WorkerService(worker_config("127.0.0.1:1"))
    async with serve_in_process(wk, wk.cfg) as w_ctx, channel(w_ctx.address) as ch:
        stub = worker_pb2_grpc.WorkerStub(ch)
        request = worker_pb2.LoadParametersRequest(
            model_id="tiny", param_manager_address="203.0.113.9:50060", instance_id="w0"
        )
        with pytest.raises(grpc.aio.AioRpcError) as e:
            async for _ in stub.LoadParameters(request, timeout=10):
                pass
        assert e.value.code() == grpc.StatusCode.PERMISSION_DENIED
        assert "'203.0.113.9:50060'" in (e.value.details() or "") and "'127.0.0.1:1'" in (e.value.details() or "")
        assert (await _status(w_ctx.address)).state == common_pb2.INSTANCE_STATE_IDLE


async def test_locate_sources_names_whole_holders_host_caches_first(
    tiny_models: Path, serve_in_process: ServeFactory
) -> None:
    """Where a pull's missing groups are now: holders of all of them (host cache first, then a
    SERVING instance), never the asking instance, never one that holds only some."""
    pm = ParamManagerService(pm_config(tiny_models))
    async with serve_in_process(pm, pm.servicer.config) as ctx, channel(ctx.address) as ch:
        stub = param_manager_pb2_grpc.ParamManagerStub(ch)
        for holder, groups in (("w1", []), ("w2", ["embed"]), ("me", [])):
            await stub.UpdateLocation(
                param_manager_pb2.UpdateLocationRequest(
                    model_id="tiny", holder=holder, groups=groups, present=True, dataplane_address=holder.encode()
                ),
                timeout=5,
            )
        cache = pm.transport.address()
        assert await locate_sources(ctx.address, "tiny", ["head"], exclude="me") == [cache, b"w1"]
        assert await locate_sources(ctx.address, "tiny", ["embed"], exclude="me") == [cache, b"w1", b"w2"]
        with pytest.raises(grpc.aio.AioRpcError, match="unknown model"):
            await locate_sources(ctx.address, "nope", ["head"])


async def test_a_restarting_parameter_manager_is_waited_for(tiny_models: Path, serve_in_process: ServeFactory) -> None:
    """A load that asks while the parameter manager is down (its supervisor restarting it)
    waits for it within its time instead of failing; past that time, UNAVAILABLE."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    address = f"127.0.0.1:{port}"
    with pytest.raises(grpc.aio.AioRpcError) as down:
        await fetch_layout_and_locations(address, "tiny", timeout_s=0.5)
    assert down.value.code() == grpc.StatusCode.UNAVAILABLE
    with structlog.testing.capture_logs() as logs:
        asking = asyncio.create_task(fetch_layout_and_locations(address, "tiny", timeout_s=30))
        retried = lambda: any(e["event"] == "param_manager_unavailable" for e in logs)  # noqa: E731
        await wait_until(retried, 10, what="a failed attempt, retried")
        pm = ParamManagerService(pm_config(tiny_models).model_copy(update={"port": port}))
        async with serve_in_process(pm, pm.servicer.config):
            layout, where = await asyncio.wait_for(asking, 30)
    assert [g.name for g in layout.groups] == [loc.group for loc in where.locations]
