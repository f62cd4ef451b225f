"""A Qwen2 checkpoint written by transformers, served by the parameter manager and loaded by a
worker over the data plane: its Q/K/V biases travel in their layer groups, its windowed layer
is honoured, and the worker's `dtype` option decides the weights' and KV cache's dtype."""

from __future__ import annotations

import math
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch

from blitzmesh.v1 import common_pb2, worker_pb2, worker_pb2_grpc
from services.common.grpc_util import channel
from services.model_format.checkpoint import iter_groups
from services.param_manager.service import ParamManagerConfig, ParamManagerService
from services.worker.config import WorkerConfig
from services.worker.engine.engine import Engine, EngineConfig
from services.worker.engine.sampling import SamplingParams
from services.worker.model import kernels
from services.worker.model.llama import load_model
from services.worker.service import WorkerService

transformers = pytest.importorskip("transformers")

ServeFactory = Any  # tests/integration/conftest.py: serve_in_process

pytestmark = pytest.mark.timeout(120)

PROMPT = [1, 5, 9, 42, 7, 100, 3, 77, 12, 200, 31, 8]  # longer than the window
NEW_TOKENS = 10


@pytest.fixture(scope="module")
def qwen2_models(tmp_path_factory: pytest.TempPathFactory, tiny_models: Path) -> Path:
    root = tmp_path_factory.mktemp("family-models")
    cfg = transformers.Qwen2Config(
        vocab_size=256,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=128,
        use_sliding_window=True,
        sliding_window=4,
        max_window_layers=1,
        bos_token_id=1,
        eos_token_id=2,
    )
    model = transformers.AutoModelForCausalLM.from_config(cfg)
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=g)
            if name.endswith("norm.weight"):
                p.copy_(1 + 0.1 * noise)
            elif p.dim() == 1:
                p.copy_(0.5 * noise)
            else:
                p.copy_(noise if "embed" in name else noise * 2 / math.sqrt(p.shape[1]))
    model.save_pretrained(root / "qwen2")
    # The parameter manager serves a tokenizer with every model; the worker never reads it.
    shutil.copy(tiny_models / "tiny" / "tokenizer.json", root / "qwen2" / "tokenizer.json")
    return root


async def _load_and_generate(pm_address: str, serve_in_process: ServeFactory, dtype: str) -> tuple[Any, list[int]]:
    wk = WorkerService(
        WorkerConfig(port=0, param_manager=pm_address, instance_id=f"w-{dtype}", dataplane="tcp", dtype=dtype)
    )
    async with serve_in_process(wk, wk.cfg) as w_ctx, channel(w_ctx.address) as ch:
        stub = worker_pb2_grpc.WorkerStub(ch)
        load = worker_pb2.LoadParametersRequest(model_id="qwen2", instance_id=f"w-{dtype}")
        progress = [p async for p in stub.LoadParameters(load, timeout=60)]
        assert progress[-1].done
        req = worker_pb2.WorkerGenerateRequest(
            request_id="r1",
            model_id="qwen2",
            prompt_token_ids=PROMPT,
            sampling=common_pb2.SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True),
        )
        tokens = [t async for m in stub.Generate(req, timeout=30) for t in m.token_ids]
        instance = wk.servicer.instance
        assert instance is not None and instance.engine is not None
        return instance, tokens


async def test_qwen2_over_the_data_plane_in_checkpoint_dtype_matches_transformers(
    qwen2_models: Path, serve_in_process: ServeFactory
) -> None:
    pm = ParamManagerService(ParamManagerConfig(port=0, model_dir=qwen2_models, chunk_bytes=64 * 1024, dataplane="tcp"))
    async with serve_in_process(pm, pm.servicer.config) as pm_ctx:
        instance, tokens = await _load_and_generate(pm_ctx.address, serve_in_process, "auto")
    model = instance.model
    assert model.dtype == torch.float32 and model.config.model_type == "qwen2"
    for name, tensors in iter_groups(qwen2_models / "qwen2"):
        got = model.export_group(name)
        assert set(got) == set(tensors)  # the biases came over the data plane with their layer
        for tname, t in tensors.items():
            assert torch.equal(got[tname], t), tname
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(qwen2_models / "qwen2"), dtype=torch.float32)
    hf.generation_config.eos_token_id = None
    out = hf.generate(torch.tensor([PROMPT]), max_new_tokens=NEW_TOKENS, do_sample=False, pad_token_id=0)
    assert tokens == out[0, len(PROMPT) :].tolist()


async def test_worker_dtype_option_serves_bfloat16(
    qwen2_models: Path, serve_in_process: ServeFactory, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Forced kernels keep the dtype as asked, so bfloat16 is served even where its GEMMs are slow.
    monkeypatch.setenv("BLITZMESH_KERNELS", "native")
    pm = ParamManagerService(ParamManagerConfig(port=0, model_dir=qwen2_models, chunk_bytes=64 * 1024, dataplane="tcp"))
    async with serve_in_process(pm, pm.servicer.config) as pm_ctx:
        instance, tokens = await _load_and_generate(pm_ctx.address, serve_in_process, "bfloat16")
    model, engine = instance.model, instance.engine
    assert model.dtype == torch.bfloat16
    assert engine.kv_cache.layer_cache(0)[0].dtype == torch.bfloat16
    for name, tensors in iter_groups(qwen2_models / "qwen2"):
        got = model.export_group(name)
        for tname, t in tensors.items():
            assert torch.equal(got[tname], t.to(torch.bfloat16)), tname
    # The same tokens as the same bfloat16 model in an in-process engine of the worker's block size.
    local = Engine.create(
        load_model(qwen2_models / "qwen2", dtype=torch.bfloat16),
        (2,),
        EngineConfig(block_size=engine.kv_cache.block_size, num_kv_blocks=64, num_threads=1),
    )
    params = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True)
    async with local:
        expected = [ev.token_id async for ev in local.generate("r", PROMPT, params)]
    assert tokens == expected


async def test_bfloat16_follows_the_measured_choice_under_auto_kernels(
    qwen2_models: Path, serve_in_process: ServeFactory
) -> None:
    """Asked for bfloat16 with the kernels measured (the default), the worker holds the model in
    the dtype the measurement picked for this CPU (float32 where bfloat16 GEMMs are far slower)
    and says so in its status."""
    pm = ParamManagerService(ParamManagerConfig(port=0, model_dir=qwen2_models, chunk_bytes=64 * 1024, dataplane="tcp"))
    async with serve_in_process(pm, pm.servicer.config) as pm_ctx:
        instance, tokens = await _load_and_generate(pm_ctx.address, serve_in_process, "bfloat16")
    want = kernels.choose_dtype(instance.model.config, torch.bfloat16)  # read back from the cache
    assert instance.model.dtype == getattr(torch, want.dtype)
    assert instance.engine.kv_cache.layer_cache(0)[0].dtype == getattr(torch, want.dtype)
    assert len(tokens) == NEW_TOKENS
