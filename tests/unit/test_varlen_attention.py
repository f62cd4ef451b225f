"""The varlen prefill kernel: against the obvious gather + mask + SDPA, and inside `attention`
against the torch paths on a mixed step (fresh prompts, a chunk after unaligned cached context,
a one-token prompt, decodes)."""

from __future__ import annotations

import pytest
import torch

from services.model_format import synth
from services.worker.engine.kv_cache import KVCache
from services.worker.model import varlen, varlen_dot
from services.worker.model.attention import ForwardBatch, attention
from services.worker.model.varlen_reference import reference_prefill

# Every test at every instruction-set level this machine runs (the `kernel_isa` fixture).
pytestmark = [
    pytest.mark.skipif(varlen.paged_prefill() is None, reason="no C compiler: the torch paths are used"),
]


@pytest.fixture(autouse=True)
def _level(kernel_isa: str) -> None:
    """Each test at every level this machine runs where the kernel is built (not portable)."""
    if varlen.paged_prefill_at(kernel_isa) is None:
        pytest.skip(f"no varlen kernel at the {kernel_isa} level (portable C measured 0.05-0.21x torch)")


def _kernel() -> varlen.PagedPrefill:
    kernel = varlen.paged_prefill()
    assert kernel is not None
    return kernel


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("window", [0, 50])
def test_kernel_matches_the_reference_on_long_unaligned_chunks(dtype: torch.dtype, window: int) -> None:
    g = torch.Generator().manual_seed(1)
    heads, kvh, d, bs = 9, 3, 64, 16
    blocks = 64
    k = torch.randn(blocks, bs, kvh, d, generator=g).to(dtype)
    v = torch.randn(blocks, bs, kvh, d, generator=g).to(dtype)
    lens, ctxs = [200, 131, 1], [0, 77, 300]  # tiles of 32 over chunks of 64 keys, misaligned
    q = torch.randn(sum(lens), heads, d, generator=g)
    perm = torch.randperm(blocks, generator=g).tolist()
    tables = [perm[0:20], perm[20:40], perm[40:60]]
    rows = [0, 200, 331]
    got = _kernel()(q, k, v, torch.tensor(tables), torch.tensor(rows), torch.tensor(lens), torch.tensor(ctxs), window)
    for s in range(3):
        want = reference_prefill(q[rows[s] : rows[s] + lens[s]], k, v, tables[s], ctxs[s], window)
        torch.testing.assert_close(got[rows[s] : rows[s] + lens[s]], want, atol=2e-5, rtol=2e-5)


@pytest.mark.parametrize("window", [None, 40])
def test_a_mixed_step_matches_the_torch_paths(window: int | None) -> None:
    cfg = synth.PRESETS["tiny"]
    heads, kvh, d = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
    bs = 8
    g = torch.Generator().manual_seed(2)
    cache = KVCache.for_model(cfg, num_blocks=80, block_size=bs)
    # Fill every cached position first, so context keys exist.
    for layer in range(cfg.num_hidden_layers):
        k_cache, v_cache = cache.layer_cache(layer)
        k_cache.copy_(torch.randn(k_cache.shape, generator=g))
        v_cache.copy_(torch.randn(v_cache.shape, generator=g))
    q_lens = [70, 33, 1, 1, 1, 12]
    ctx_lens = [0, 45, 0, 60, 9, 0]
    tables = [list(range(i * 13, i * 13 + 13)) for i in range(len(q_lens))]
    batch = ForwardBatch.build(q_lens, ctx_lens, tables, bs)
    t = sum(q_lens)
    q = torch.randn(t, heads, d, generator=g)
    k = torch.randn(t, kvh, d, generator=g)
    v = torch.randn(t, kvh, d, generator=g)
    assert batch.slot_mapping is not None
    cache.write(0, batch.slot_mapping, k, v)
    fast = attention(q, k, v, batch, cache, 0, window, kv_written=True)
    slow = attention(q, k, v, batch, cache, 0, window)  # writes the same K/V again, torch paths
    assert batch.prefill is not None and batch.prefill.query_lens.tolist() == [70, 33, 1, 12]
    torch.testing.assert_close(fast, slow, atol=2e-5, rtol=2e-5)


def _dot_kernel() -> None:
    if varlen_dot.bf16_dot_prefill() is None:
        pytest.skip("no AVX512-BF16 on this CPU (or BLITZMESH_BF16_DOT_ATTENTION=0)")


@pytest.mark.parametrize("window", [0, 50])
def test_bf16_dot_products_stay_within_bfloat16_rounding_of_the_reference(window: int) -> None:
    _dot_kernel()
    g = torch.Generator().manual_seed(3)
    heads, kvh, d, bs, blocks = 9, 3, 64, 16, 64
    k = torch.randn(blocks, bs, kvh, d, generator=g).to(torch.bfloat16)
    v = torch.randn(blocks, bs, kvh, d, generator=g).to(torch.bfloat16)
    lens, ctxs = [200, 131, 1], [0, 77, 300]
    q = torch.randn(sum(lens), heads, d, generator=g).to(torch.bfloat16)
    perm = torch.randperm(blocks, generator=g).tolist()
    tables = torch.tensor([perm[0:20], perm[20:40], perm[40:60]])
    rows = [0, 200, 331]
    args = (tables, torch.tensor(rows), torch.tensor(lens), torch.tensor(ctxs), window)
    dot = _kernel()(q, k, v, *args)
    exact = _kernel()(q, k, v, *args, bf16_dot=False)
    assert dot.dtype == torch.bfloat16
    assert not torch.equal(dot, exact), "the bfloat16 dot products did not run"
    for s in range(3):
        part = slice(rows[s], rows[s] + lens[s])
        want = reference_prefill(q[part].float(), k, v, tables[s].tolist(), ctxs[s], window)
        # The float32-math kernel's own error (its output rounded to bfloat16) and the dot
        # products' (probabilities rounded too) are of one size.
        err_dot = (dot[part].float() - want).abs().max().item()
        err_exact = (exact[part].float() - want).abs().max().item()
        assert err_dot < 2e-2 and err_dot < 3 * err_exact + 1e-3, (err_dot, err_exact)


def test_bf16_dot_products_give_a_row_the_same_bits_however_its_prompt_is_chunked() -> None:
    """A prompt prefilled whole, and the same prompt as a first chunk plus a continuation over
    its cached context: every row's output identical (what split, migrated and preempted
    requests rely on for the same greedy tokens)."""
    _dot_kernel()
    g = torch.Generator().manual_seed(4)
    heads, kvh, d, bs, blocks = 9, 3, 64, 16, 32
    k = torch.randn(blocks, bs, kvh, d, generator=g).to(torch.bfloat16)
    v = torch.randn(blocks, bs, kvh, d, generator=g).to(torch.bfloat16)
    n, cut = 300, 77
    q = torch.randn(n, heads, d, generator=g).to(torch.bfloat16)
    table = torch.randperm(blocks, generator=g)[:20].view(1, -1)
    zero = torch.tensor([0])
    whole = _kernel()(q, k, v, table, zero, torch.tensor([n]), zero, 0)
    first = _kernel()(q[:cut], k, v, table, zero, torch.tensor([cut]), zero, 0)
    rest = _kernel()(q[cut:], k, v, table, zero, torch.tensor([n - cut]), torch.tensor([cut]), 0)
    assert torch.equal(whole, torch.cat([first, rest]))


@pytest.mark.parametrize("window", [0, 50])
def test_float32_math_gives_a_row_the_same_bits_however_its_prompt_is_chunked(window: int) -> None:
    """The float32-math kernel (any cache dtype), with and without a sliding window: chunks of
    keys start at multiples of 64 whatever the tile, so a continuation over cached context
    computes every row exactly as the whole prompt did."""
    g = torch.Generator().manual_seed(5)
    heads, kvh, d, bs, blocks = 9, 3, 64, 16, 32
    for dtype in (torch.float32, torch.bfloat16):
        k = torch.randn(blocks, bs, kvh, d, generator=g).to(dtype)
        v = torch.randn(blocks, bs, kvh, d, generator=g).to(dtype)
        n, cut = 300, 77
        q = torch.randn(n, heads, d, generator=g).to(dtype)
        table = torch.randperm(blocks, generator=g)[:20].view(1, -1)
        zero = torch.tensor([0])
        run = _kernel()
        whole = run(q, k, v, table, zero, torch.tensor([n]), zero, window, bf16_dot=False)
        first = run(q[:cut], k, v, table, zero, torch.tensor([cut]), zero, window, bf16_dot=False)
        rest = run(q[cut:], k, v, table, zero, torch.tensor([n - cut]), torch.tensor([cut]), window, bf16_dot=False)
        assert torch.equal(whole, torch.cat([first, rest])), dtype
