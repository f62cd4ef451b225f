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


def _decode_logits(model, graphs_on: bool, steps: int = 4) -> tuple[list[list[int]], list[torch.Tensor]]:
    """Prefill three prompts, then `steps` greedy decode steps through the CUDA graphs or the
    eager paged forward; the tokens and each step's logits."""
    from services.worker.engine.kv_cache import KVCache
    from services.worker.model.attention import ForwardBatch
    from services.worker.model.cuda_graphs import DecodeGraphs

    bs = 16
    lens = [5, 40, 17]
    kv = KVCache.for_model(model.config, num_blocks=32, block_size=bs, dtype=model.dtype, device="cuda")
    tables = [[1, 2, 3], [4, 5, 6, 7], [8, 9, 10]]
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, model.config.vocab_size, (n,), generator=g).tolist() for n in lens]
    batch = ForwardBatch.build(lens, [0, 0, 0], tables, bs, device="cuda")
    logits = model.forward_batch(torch.tensor([t for p in prompts for t in p], device="cuda"), batch, kv)
    ids = logits.argmax(-1).tolist()
    graphs = DecodeGraphs(model, kv, max_batch_size=8) if graphs_on else None
    out_ids, out_logits = [ids], []
    ctx = list(lens)
    for _ in range(steps):
        if graphs is not None:
            step = graphs.run(ids, ctx, tables).clone()
        else:
            step = model.forward_batch(
                torch.tensor(ids, device="cuda"), ForwardBatch.build([1, 1, 1], ctx, tables, bs, device="cuda"), kv
            )
        out_logits.append(step.float().cpu())
        ids = step.argmax(-1).tolist()
        out_ids.append(ids)
        ctx = [c + 1 for c in ctx]
    if graphs is not None:
        assert graphs.num_graphs >= 1
    return out_ids, out_logits


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cuda_graph_decode_matches_eager(tmp_path, dtype) -> None:
    """Graph replays give the eager step's greedy tokens, and its logits within 1e-4 in float32
    (bfloat16: within the dtype's rounding of the logits' scale)."""
    path = synth.synthesize(tmp_path / "small", "small", seed=1)
    model = load_model(str(path), device="cuda", dtype=dtype)
    eager_ids, eager_logits = _decode_logits(model, graphs_on=False)
    graph_ids, graph_logits = _decode_logits(model, graphs_on=True)
    assert graph_ids == eager_ids
    tol = 1e-4 if dtype == torch.float32 else 3e-2
    for got, want in zip(graph_logits, eager_logits, strict=True):
        torch.testing.assert_close(got, want, atol=tol, rtol=tol)


@pytest.mark.gpu
@needs_cuda
def test_flash_varlen_matches_sdpa(tmp_path, monkeypatch) -> None:
    """A mixed step (a fresh prompt, a chunk after cached context, a decode) through
    FlashAttention's varlen kernel and through the SDPA paths: same greedy tokens, logits within
    bfloat16 rounding."""
    from services.worker.engine.kv_cache import KVCache
    from services.worker.model import flash
    from services.worker.model.attention import ForwardBatch

    if not flash.supported():
        pytest.skip("this torch has no torch.nn.attention.varlen")
    path = synth.synthesize(tmp_path / "small", "small", seed=2)
    model = load_model(str(path), device="cuda", dtype=torch.bfloat16)
    bs = 16

    def run() -> torch.Tensor:
        kv = KVCache.for_model(model.config, num_blocks=32, block_size=bs, dtype=model.dtype, device="cuda")
        tables = [[1, 2, 3, 4], [5, 6, 7, 8], [9, 10]]
        g = torch.Generator().manual_seed(5)
        first = [30, 20, 24]  # step 1: three fresh prompts
        ids = torch.randint(3, model.config.vocab_size, (sum(first),), generator=g).cuda()
        model.forward_batch(ids, ForwardBatch.build(first, [0, 0, 0], tables, bs, device="cuda"), kv)
        second = ([17, 9, 1], [0, 20, 24])  # a fresh prompt (reuses seq 0's blocks), a chunk, a decode
        ids = torch.randint(3, model.config.vocab_size, (sum(second[0]),), generator=g).cuda()
        batch = ForwardBatch.build(second[0], second[1], tables, bs, device="cuda")
        assert (batch.flash is not None) == flash.supported()
        return model.forward_batch(ids, batch, kv).float().cpu()

    with_flash = run()
    assert flash.supported(), flash._disabled
    monkeypatch.setattr(flash, "_disabled", "turned off by the test")
    with_sdpa = run()
    assert torch.equal(with_flash.argmax(-1), with_sdpa.argmax(-1))
    torch.testing.assert_close(with_flash, with_sdpa, atol=3e-2, rtol=3e-2)


@pytest.mark.gpu
@needs_cuda
def test_sampling_on_the_device_matches_the_cpu() -> None:
    """Greedy picks are identical; seeded samples draw the same uniform numbers, so they agree
    but for ties of the device's rounding."""
    from services.worker.engine.sampling import sample

    g = torch.Generator().manual_seed(0)
    logits = torch.randn(64, 4096, generator=g) * 3
    greedy = [SamplingParams(temperature=0, logprobs=2)] * 64
    cpu = sample(logits, greedy, [None] * 64)
    gpu = sample(logits.cuda(), greedy, [None] * 64)
    assert gpu.tokens == cpu.tokens
    assert gpu.logprobs == pytest.approx(cpu.logprobs, abs=1e-4)
    assert [t[0][0] for t in gpu.top_logprobs] == [t[0][0] for t in cpu.top_logprobs]
    params = [SamplingParams(temperature=0.8, top_p=0.9, top_k=50, seed=i) for i in range(64)]
    cpu = sample(logits, params, [p.make_generator() for p in params])
    gpu = sample(logits.cuda(), params, [p.make_generator() for p in params])
    agree = sum(a == b for a, b in zip(cpu.tokens, gpu.tokens, strict=True))
    assert agree >= 60, (cpu.tokens, gpu.tokens)


@pytest.mark.gpu
@needs_cuda
def test_engine_with_cuda_graphs_gives_the_eager_tokens(tmp_path) -> None:
    """The whole engine (continuous batching, prefill via the varlen kernel, decodes via graph
    replays) gives the same greedy tokens with graphs on and off."""
    path = synth.synthesize(tmp_path / "small", "small", seed=4)
    prompts = [[1, *range(5 + 7 * i, 5 + 7 * i + 9 + 5 * i)] for i in range(6)]
    out = {}
    for graphs in (False, True):
        config = EngineConfig(max_batch_size=8, max_num_tokens=256, num_kv_blocks=128, cuda_graphs=graphs)
        engine = Engine.create(load_model(str(path), device="cuda", dtype=torch.float32), (2,), config)
        out[graphs] = asyncio.run(_greedy(engine, prompts))
        if graphs:
            assert engine.runner.decode_graphs is not None and engine.runner.decode_graphs.num_graphs >= 1
    assert out[True] == out[False]
