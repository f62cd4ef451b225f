"""The worker's KV pool sized from free memory, its capacity options wired into the engine, and a
long prompt served whole on the real default model with the worker's defaults."""

from __future__ import annotations

import asyncio
from pathlib import Path
from types import SimpleNamespace

import pydantic
import pytest
import torch

from services.model_format import synth
from services.worker.config import WorkerConfig
from services.worker.engine.engine import Engine, EngineConfig
from services.worker.engine.sampling import SamplingParams
from services.worker.engine.scheduler import CapacityPolicy
from services.worker.kv_pool import engine_config, free_memory_bytes, kv_pool_blocks, mem_available_bytes
from services.worker.model import small_gemm
from services.worker.model.llama import LlamaForCausalLM, load_model
from services.worker.service import WorkerServicer

MiB = 1 << 20


# ---- sizing, pure --------------------------------------------------------------------------------


def test_pool_size_follows_the_fraction() -> None:
    kw = {"bytes_per_token": 1024, "block_size": 16, "max_tokens": 1 << 30}
    full = kv_pool_blocks(free_bytes=1000 * MiB, fraction=0.9, **kw)
    half = kv_pool_blocks(free_bytes=1000 * MiB, fraction=0.45, **kw)
    # 0.9 * 1000 MiB at 16 KiB per block.
    assert full.num_blocks == int(1000 * MiB * 0.9) // (16 * 1024) == 57600 and full.limited_by == "memory"
    assert half.num_blocks == 28800
    assert kv_pool_blocks(free_bytes=1000 * MiB, fraction=1.0, **kw).num_blocks == 64000


def test_pool_size_is_capped_and_floored() -> None:
    kw = {"fraction": 0.9, "bytes_per_token": 1024, "block_size": 16}
    capped = kv_pool_blocks(free_bytes=1000 * MiB, max_tokens=32768, **kw)
    assert capped.num_blocks == 2048 and capped.limited_by == "cap"
    # Too little memory for one 2048-token request: floored at one (and the caller warns).
    short = kv_pool_blocks(free_bytes=MiB, max_tokens=32768, min_tokens=2048, **kw)
    assert short.num_blocks == 128 and short.limited_by == "floor"
    # Nothing free at all (a budget the weights already fill): still one block.
    assert kv_pool_blocks(free_bytes=-5 * MiB, max_tokens=32768, **kw).num_blocks == 1
    # The floor never exceeds the cap.
    assert kv_pool_blocks(free_bytes=0, max_tokens=1024, min_tokens=8192, **kw).num_blocks == 64


@pytest.mark.parametrize("fraction", [0.0, -0.1, 1.5])
def test_pool_fraction_out_of_range_is_refused(fraction: float) -> None:
    with pytest.raises(ValueError, match=f"got {fraction!r}"):
        kv_pool_blocks(free_bytes=MiB, fraction=fraction, bytes_per_token=1, block_size=16, max_tokens=1024)
    with pytest.raises(pydantic.ValidationError, match="kv_cache_free_mem_fraction"):
        WorkerConfig(kv_cache_free_mem_fraction=fraction)


# ---- free memory ---------------------------------------------------------------------------------


def test_free_memory_on_cpu(tmp_path: Path) -> None:
    meminfo = tmp_path / "meminfo"
    meminfo.write_text("MemTotal:       24000000 kB\nMemFree:  100 kB\nMemAvailable:   20000000 kB\n")
    assert mem_available_bytes(meminfo) == 20_000_000 * 1024
    cpu = torch.device("cpu")
    # A budget: what the weights (packed copy included) leave of it.
    assert free_memory_bytes(cpu, weight_bytes=300, memory_budget_bytes=1000, meminfo=meminfo) == 700
    # No budget: MemAvailable now, less the weights still to arrive (measured after loading).
    assert (
        free_memory_bytes(cpu, weight_bytes=300, weight_bytes_to_come=100, meminfo=meminfo) == 20_000_000 * 1024 - 100
    )
    meminfo.write_text("MemTotal: 1 kB\n")
    with pytest.raises(ValueError, match="no MemAvailable"):
        free_memory_bytes(cpu, weight_bytes=0, meminfo=meminfo)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the guard of a machine without CUDA")
def test_free_memory_on_cuda_needs_cuda() -> None:
    with pytest.raises(RuntimeError, match="torch sees no CUDA device"):
        free_memory_bytes(torch.device("cuda:0"), weight_bytes=0)


# ---- the model's bytes ---------------------------------------------------------------------------


@pytest.fixture(scope="module")
def tiny_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return synth.synthesize(tmp_path_factory.mktemp("kv_pool") / "tiny", "tiny", seed=0)


def measured_weight_bytes(model: LlamaForCausalLM) -> int:
    """The bytes of every tensor the model holds, packed copies included, read off the tensors."""

    def nbytes(t: torch.Tensor | None) -> int:
        return 0 if t is None else t.numel() * t.element_size()

    def linear(lin: object) -> int:
        return sum(nbytes(getattr(lin, a)) for a in ("weight", "bias", "_packed", "_pairs"))

    total = nbytes(model._embed) + nbytes(model._norm) + nbytes(model._lm_head)
    if model._head is not None:
        total += nbytes(model._head._packed) + nbytes(model._head._pairs)
    for layer in model._layers:
        if layer is not None:
            total += nbytes(layer.input_norm) + nbytes(layer.post_norm)
            total += sum(linear(x) for x in (layer.qkv, layer.o, layer.gate_up, layer.down))
    return total


@pytest.mark.parametrize("pack", [True, False], ids=["packed", "unpacked"])
def test_weight_bytes_count_the_packed_copies(tiny_path: Path, pack: bool) -> None:
    loaded = load_model(str(tiny_path))
    model = LlamaForCausalLM(loaded.config, pack_weights=pack)
    model.load_groups((g, loaded.export_group(g)) for g in loaded.loaded_groups)
    assert model.weight_bytes() == measured_weight_bytes(model)
    elem = torch.empty((), dtype=model.dtype).element_size()
    if model.packs_weights or (pack and small_gemm.small_gemm() is not None):
        assert model.weight_bytes() > model.config.num_parameters() * elem  # a packed copy
    else:
        assert model.weight_bytes() == model.config.num_parameters() * elem


def test_weight_bytes_of_a_model_still_loading(tiny_path: Path) -> None:
    full = load_model(str(tiny_path))
    partial = LlamaForCausalLM(full.config)
    assert partial.weight_bytes(loaded_only=True) == 0
    partial.load_group("embed", full.export_group("embed"))
    assert partial.weight_bytes(loaded_only=True) == measured_weight_bytes(partial) > 0
    assert partial.weight_bytes() == full.weight_bytes()


# ---- the worker's options ------------------------------------------------------------------------


def test_worker_defaults_and_engine_config() -> None:
    cfg = WorkerConfig()
    assert cfg.enable_chunked_prefill is True and cfg.kv_cache_free_mem_fraction == 0.9
    assert cfg.capacity_policy == "GUARANTEED_NO_EVICT" and cfg.preemption_mode == "recompute"
    ecfg = engine_config(
        WorkerConfig(
            capacity_policy="MAX_UTILIZATION",
            preemption_mode="swap",
            enable_chunked_prefill=False,
            max_num_tokens=256,
            block_size=8,
            step_time_a_s=0.01,
            step_time_b_s=0.001,
        ),
        num_kv_blocks=100,
    )
    assert ecfg.capacity_policy is CapacityPolicy.MAX_UTILIZATION and ecfg.preemption_mode == "swap"
    assert not ecfg.enable_chunked_prefill and ecfg.max_num_tokens == 256 and ecfg.block_size == 8
    assert ecfg.num_kv_blocks == 100 and ecfg.pacing is not None and ecfg.pacing.base_s == 0.01


def test_worker_and_engine_share_their_defaults_and_refuse_a_bad_budget_at_parse_time() -> None:
    worker, engine = WorkerConfig(), EngineConfig()
    for name in ("max_batch_size", "max_num_tokens", "block_size", "enable_chunked_prefill", "enable_prefix_caching"):
        assert getattr(worker, name) == getattr(engine, name), name
    # Refused when the flags are parsed, before any model loads, with both values quoted.
    with pytest.raises(ValueError, match=r"max_num_tokens \(8\) must be >= max_batch_size \(16\)"):
        WorkerConfig(max_num_tokens=8, max_batch_size=16)


def make_engine_as_the_worker(cfg: WorkerConfig, model: LlamaForCausalLM) -> Engine:
    # `_make_engine` reads only the config and the death event of the servicer.
    fake = SimpleNamespace(cfg=cfg, engine_died=asyncio.Event())
    return WorkerServicer._make_engine(fake, model, frozenset({2}))  # type: ignore[arg-type]


def test_the_worker_sizes_its_pool_from_its_budget(tiny_path: Path) -> None:
    model = load_model(str(tiny_path))
    per_token = model.config.kv_bytes_per_token(model.dtype)
    budget = model.weight_bytes() + 1000 * 16 * per_token
    cfg = WorkerConfig(memory_budget_bytes=budget, kv_cache_free_mem_fraction=0.5, kv_cache_tokens=1 << 20)
    engine = make_engine_as_the_worker(cfg, model)
    assert engine.kv_cache.total_blocks == 500  # half of the 1000 blocks the weights leave
    capped = make_engine_as_the_worker(cfg.model_copy(update={"kv_cache_tokens": 4096}), model)
    assert capped.kv_cache.total_blocks == 4096 // 16
    mu = make_engine_as_the_worker(
        cfg.model_copy(update={"capacity_policy": "MAX_UTILIZATION", "preemption_mode": "swap"}), model
    )
    assert mu.config.capacity_policy is CapacityPolicy.MAX_UTILIZATION and mu.config.preemption_mode == "swap"
    assert mu.config.enable_chunked_prefill


# ---- a long prompt, served whole -----------------------------------------------------------------


@pytest.mark.real_model
async def test_a_2300_token_prompt_is_served_with_the_worker_defaults(real_model_dir: Path) -> None:
    """max_num_tokens (2048) is shorter than the prompt: chunked prefill, on by default, splits it;
    the first token is the uncached model's greedy pick."""
    model = load_model(str(real_model_dir))
    assert model.config.max_context_tokens >= 2300
    cfg = WorkerConfig()
    assert cfg.max_num_tokens < 2300
    engine = make_engine_as_the_worker(cfg, model)
    g = torch.Generator().manual_seed(0)
    prompt = torch.randint(100, model.config.vocab_size, (2300,), generator=g).tolist()
    params = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)
    async with engine:
        events = [ev async for ev in engine.generate("long", prompt, params)]
    assert [e.completion_tokens for e in events] == [1, 2, 3] and events[-1].finish_reason == "length"
    assert events[0].prompt_tokens == 2300
    with torch.inference_mode():
        expected = int(model(torch.tensor(prompt))[-1].argmax())
    assert events[0].token_id == expected
    # The prompt ran in two iterations of at most max_num_tokens.
    works = [dict(s.work).get("long", 0) for s in engine.step_log]
    assert works[:2] == [cfg.max_num_tokens, 2300 - cfg.max_num_tokens]
