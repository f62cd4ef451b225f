"""The torch path for chunks after cached context (`attention._chunk_attention`): each member's
cached keys unmasked and its new keys causally, merged by their log-sum-exps, against a padded
gather + boolean mask + SDPA written out here."""

from __future__ import annotations

import asyncio

import pytest
import torch
import torch.nn.functional as F

from services.model_format import synth
from services.model_format.config import LlamaConfig
from services.worker.engine.engine import Engine, EngineConfig
from services.worker.engine.kv_cache import KVCache
from services.worker.engine.sampling import SamplingParams
from services.worker.model import attention as attn
from services.worker.model.attention import ForwardBatch
from services.worker.model.llama import LlamaForCausalLM, load_model

pytestmark = pytest.mark.skipif(attn._FLASH_CPU is None, reason="this torch has no CPU flash kernel op")


def _filled_cache(cfg: LlamaConfig, blocks: int, bs: int, dtype: torch.dtype, seed: int) -> KVCache:
    g = torch.Generator().manual_seed(seed)
    cache = KVCache.for_model(cfg, num_blocks=blocks, block_size=bs, dtype=dtype)
    for layer in range(cfg.num_hidden_layers):
        k_cache, v_cache = cache.layer_cache(layer)
        k_cache.copy_(torch.randn(k_cache.shape, generator=g).to(dtype))
        v_cache.copy_(torch.randn(v_cache.shape, generator=g).to(dtype))
    return cache


def _reference(
    q: torch.Tensor, cache: KVCache, layer: int, tables: list[list[int]], q_lens: list[int], ctx_lens: list[int]
) -> torch.Tensor:
    """Each sequence alone: its context + new keys gathered, a `[n, ctx + n]` mask, SDPA."""
    k_cache, v_cache = cache.layer_cache(layer)
    bs = cache.block_size
    outs, row = [], 0
    for table, n, ctx in zip(tables, q_lens, ctx_lens, strict=True):
        idx = torch.tensor(table)
        keys = k_cache[idx].reshape(-1, *k_cache.shape[2:])[: ctx + n].to(q.dtype)
        values = v_cache[idx].reshape(-1, *v_cache.shape[2:])[: ctx + n].to(q.dtype)
        assert len(table) * bs >= ctx + n
        mask = torch.arange(ctx + n).view(1, -1) <= (ctx + torch.arange(n)).view(-1, 1)
        qs = q[row : row + n].transpose(0, 1).unsqueeze(0)
        o = F.scaled_dot_product_attention(
            qs, keys.transpose(0, 1).unsqueeze(0), values.transpose(0, 1).unsqueeze(0), attn_mask=mask, enable_gqa=True
        )
        outs.append(o[0].transpose(0, 1))
        row += n
    return torch.cat(outs)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_lse_merge_matches_the_masked_reference(dtype: torch.dtype) -> None:
    cfg = synth.PRESETS["tiny"]
    heads, d, bs = cfg.num_attention_heads, cfg.head_dim, 8
    cache = _filled_cache(cfg, 120, bs, dtype, seed=3)
    # Unaligned contexts and chunk lengths, a one-token chunk, members of very different lengths.
    q_lens, ctx_lens = [37, 5, 64, 2], [45, 200, 8, 1]
    tables = [list(range(i * 30, i * 30 + 30)) for i in range(len(q_lens))]
    batch = ForwardBatch.build(q_lens, ctx_lens, tables, bs)
    assert len(batch.groups) == 1 and batch.groups[0].query_lens == tuple(q_lens)
    g = torch.Generator().manual_seed(4)
    q = torch.randn(sum(q_lens), heads, d, generator=g).to(dtype)
    got = attn._chunk_attention(q, batch.groups[0], cache, 1)
    want = _reference(q, cache, 1, tables, q_lens, ctx_lens)
    tol = 2e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(got, want, atol=tol, rtol=tol)
    # The padded masked path the merge replaces agrees too (and would fail on a wrong weight).
    masked = attn._group_attention(q, batch.groups[0], cache, 1, window=10_000)
    torch.testing.assert_close(masked, want, atol=tol, rtol=tol)
    assert (got - want).abs().max() < (got - got.flip(0)).abs().max()


def test_the_merge_weights_the_context_by_its_share_of_the_softmax() -> None:
    # One query, one cached key and one new key: the output is the softmax-weighted mix of the two
    # values, here 3:1 towards the cached one (its score is log 3 higher).
    cfg = synth.PRESETS["tiny"]
    heads, kvh, d, bs = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim, 8
    cache = KVCache.for_model(cfg, num_blocks=4, block_size=bs)
    batch = ForwardBatch.build([1 + 0], [1], [[2]], bs)  # a decode: not the chunk path
    assert batch.groups[0].max_query_len == 1
    batch = ForwardBatch.build([2], [1], [[2]], bs)
    q = torch.zeros(2, heads, d)
    q[0, :, 0] = 1.0
    scale = d**0.5
    k = torch.zeros(3, kvh, d)
    k[0, :, 0] = torch.log(torch.tensor(3.0)) * scale  # cached key: score log 3
    v = torch.zeros(3, kvh, d)
    v[0, :, 1] = 1.0
    v[1, :, 2] = 1.0
    k_cache, v_cache = cache.layer_cache(0)
    k_cache[2, :3], v_cache[2, :3] = k, v
    out = attn._chunk_attention(q, batch.groups[0], cache, 0)
    torch.testing.assert_close(out[0, :, 1], torch.full((heads,), 0.75))
    torch.testing.assert_close(out[0, :, 2], torch.full((heads,), 0.25))


def test_attention_takes_the_merge_for_chunks_and_the_mask_for_windows(monkeypatch: pytest.MonkeyPatch) -> None:
    cfg = synth.PRESETS["tiny"]
    heads, kvh, d, bs = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim, 8
    cache = _filled_cache(cfg, 60, bs, torch.float32, seed=5)
    q_lens, ctx_lens = [20, 1, 30, 9], [0, 40, 0, 17]  # fresh, decode, fresh, a chunk
    tables = [list(range(i * 15, i * 15 + 15)) for i in range(len(q_lens))]
    batch = ForwardBatch.build(q_lens, ctx_lens, tables, bs)
    g = torch.Generator().manual_seed(6)
    t = sum(q_lens)
    q, k, v = torch.randn(t, heads, d, generator=g), torch.randn(t, kvh, d, generator=g), torch.randn(t, kvh, d)
    calls: list[int] = []
    real = attn._chunk_attention

    def spy(*args: object) -> torch.Tensor:
        calls.append(1)
        return real(*args)  # type: ignore[arg-type]

    monkeypatch.setattr(attn, "_chunk_attention", spy)
    monkeypatch.setattr(attn.varlen, "paged_prefill", lambda: None)
    out = attn.attention(q, k, v, batch, cache, 0)
    assert len(calls) == 1
    rows = slice(51, 60)
    want = _reference(q[rows], cache, 0, [tables[3]], [9], [17])
    torch.testing.assert_close(out[rows], want, atol=2e-5, rtol=2e-5)
    attn.attention(q, k, v, batch, cache, 0, window=4)
    assert len(calls) == 1  # windowed layers keep the banded mask


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> LlamaForCausalLM:
    path = synth.synthesize(tmp_path_factory.mktemp("chunk") / "tiny", "tiny", seed=0)
    return load_model(str(path))


async def _greedy(model: LlamaForCausalLM, prompts: list[list[int]], max_num_tokens: int) -> list[list[int]]:
    config = EngineConfig(
        max_batch_size=4, max_num_tokens=max_num_tokens, num_kv_blocks=96, block_size=4, num_threads=1
    )
    engine = Engine.create(model, (2,), config)
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)

    async def one(i: int) -> list[int]:
        return [ev.token_id async for ev in engine.generate(f"r{i}", prompts[i], params) if ev.token_id is not None]

    async with engine:
        return list(await asyncio.gather(*(one(i) for i in range(len(prompts)))))


async def test_chunked_prompts_keep_the_greedy_tokens_of_whole_ones(
    tiny_model: LlamaForCausalLM, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The torch paths (no varlen kernel), as on a host without it: a 23-token budget cuts every
    # prompt into chunks after unaligned cached context, which take the log-sum-exp merge.
    monkeypatch.setattr(attn.varlen, "paged_prefill", lambda: None)
    calls: list[int] = []
    real = attn._chunk_attention

    def spy(*args: object) -> torch.Tensor:
        calls.append(1)
        return real(*args)  # type: ignore[arg-type]

    monkeypatch.setattr(attn, "_chunk_attention", spy)
    g = torch.Generator().manual_seed(7)
    prompts = [[1, *torch.randint(3, 2048, (n - 1,), generator=g).tolist()] for n in (61, 40, 9, 75)]
    whole = await _greedy(tiny_model, prompts, 256)
    assert not calls
    chunked = await _greedy(tiny_model, prompts, 23)
    assert calls
    assert chunked == whole
    # and both are the uncached model's greedy continuation
    for prompt, got in zip(prompts, whole, strict=True):
        ids = list(prompt)
        for _ in range(len(got)):
            ids.append(int(tiny_model(torch.tensor(ids))[-1].argmax()))
        assert ids[len(prompt) :] == got
