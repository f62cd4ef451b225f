"""The worker's device option: validated at the edge; on a CUDA device (tests marked `gpu`, which
skip with their reason where torch sees none) the model, its KV cache and the engine's greedy
tokens match the CPU's, and parameter groups land in pinned host memory."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest
import torch

from services.dataplane.manifest import GroupEntry
from services.mesh.__main__ import parse_args
from services.model_format import synth
from services.worker.config import WorkerConfig
from services.worker.engine.engine import Engine, EngineConfig
from services.worker.engine.sampling import SamplingParams
from services.worker.loader import pinned_allocate
from services.worker.model.llama import load_model

CUDA = torch.cuda.is_available()
needs_cuda = pytest.mark.skipif(not CUDA, reason="torch sees no CUDA device on this machine")


def test_device_is_validated_quoting_the_value() -> None:
    assert WorkerConfig().device == "cpu"
    with pytest.raises(ValueError, match="tpu"):
        WorkerConfig(device="tpu")
    with pytest.raises(ValueError, match="cuda:x"):
        WorkerConfig(device="cuda:x")


@pytest.mark.skipif(CUDA, reason="checks the error a machine without CUDA gives")
def test_cuda_without_a_device_is_a_clear_error() -> None:
    with pytest.raises(ValueError, match=r"device='cuda:1': no CUDA device"):
        WorkerConfig(device="cuda:1")


def test_the_mesh_passes_worker_args_through() -> None:
    cfg = parse_args(["--worker-arg=--device", "--worker-arg=cpu", "--worker-arg=--dtype=bfloat16"])
    assert cfg.worker_args == ["--device", "cpu", "--dtype=bfloat16"]
    assert parse_args([]).worker_args == []


async def _greedy(engine: Engine, prompts: list[list[int]]) -> list[list[int]]:
    async def one(i: int, prompt: list[int]) -> list[int]:
        params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
        return [ev.token_id async for ev in engine.generate(f"r{i}", prompt, params) if ev.token_id is not None]

    await engine.start()
    try:
        return await asyncio.wait_for(asyncio.gather(*(one(i, p) for i, p in enumerate(prompts))), 120)
    finally:
        await engine.stop()


@pytest.mark.gpu
@needs_cuda
def test_cuda_engine_matches_cpu_greedy_tokens(tmp_path) -> None:
    path = synth.synthesize(tmp_path / "tiny", "tiny", seed=0)
    prompts = [[1, *range(5 + 7 * i, 5 + 7 * i + 9 + 5 * i)] for i in range(4)]
    config = EngineConfig(max_batch_size=4, max_num_tokens=128, num_kv_blocks=64)
    cpu = asyncio.run(_greedy(Engine.create(load_model(str(path)), (2,), config), prompts))
    gpu_model = load_model(str(path), device="cuda")
    gpu_engine = Engine.create(gpu_model, (2,), config)
    assert gpu_engine.kv_cache.device.type == "cuda"
    gpu = asyncio.run(_greedy(gpu_engine, prompts))
    # float32 on both; kernels differ, so a near tie may flip: most tokens must agree exactly.
    agree = sum(a == b for c, g in zip(cpu, gpu, strict=True) for a, b in zip(c, g, strict=True))
    assert agree >= 0.9 * sum(len(c) for c in cpu), (cpu, gpu)


@pytest.mark.gpu
@needs_cuda
def test_groups_land_in_pinned_host_memory() -> None:
    entry = GroupEntry(name="layers.0", tensors=(), size_bytes=1 << 20, checksum="")
    buf = pinned_allocate(entry)
    assert isinstance(buf, np.ndarray) and buf.size == entry.size_bytes
    assert torch.from_numpy(buf).is_pinned()
