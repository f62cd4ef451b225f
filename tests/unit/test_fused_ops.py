"""The fused native kernels of a decoder layer against the eager torch ops they replace, and the
model's fused path against its eager path."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from services.model_format import synth
from services.worker.engine.kv_cache import KVCache
from services.worker.model import fused
from services.worker.model.attention import ForwardBatch
from services.worker.model.llama import LlamaForCausalLM, load_model

# Every test at every instruction-set level this machine runs (the `kernel_isa` fixture).
pytestmark = [
    pytest.mark.skipif(fused.fused_ops() is None, reason="no C compiler: the eager path is used"),
    pytest.mark.usefixtures("kernel_isa"),
]

# Float32: the kernels differ from the eager ops only in the order of a float32 sum and the last
# bit of exp. bfloat16: both round every intermediate to bfloat16 the same way; one bfloat16 ulp
# (2^-8 relative) of a value of magnitude ~3 is the most a different float32 sum can flip.
TOL = {torch.float32: 1e-5, torch.bfloat16: 3e-2}


def _ops() -> fused.FusedOps:
    ops = fused.fused_ops()
    assert ops is not None
    return ops


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [1, 7, 600])  # 600 rows x 576 takes the threaded path
def test_norms_match_eager(dtype: torch.dtype, rows: int) -> None:
    g = torch.Generator().manual_seed(rows)
    h = 576
    base = torch.randn(rows, 2 * h, generator=g).to(dtype)
    x = base[:, :h]  # a strided view, as a fused QKV output slice would be
    delta = torch.randn(rows, h, generator=g).to(dtype)
    w = (1 + 0.1 * torch.randn(h, generator=g)).to(dtype)
    tol = TOL[dtype]
    torch.testing.assert_close(_ops().rms_norm(x, w, 1e-5), fused.reference_rms_norm(x, w, 1e-5), atol=tol, rtol=tol)
    want_sum = x + delta
    normed, summed = _ops().add_rms_norm(x, delta, w, 1e-5)
    assert summed is delta  # the sum is written over delta
    torch.testing.assert_close(summed, want_sum, atol=0, rtol=0)  # one rounding of one add: exact
    torch.testing.assert_close(normed, fused.reference_rms_norm(want_sum, w, 1e-5), atol=tol, rtol=tol)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [1, 300])
def test_silu_mul_matches_eager_over_the_whole_range(dtype: torch.dtype, rows: int) -> None:
    g = torch.Generator().manual_seed(3)
    gate_up = (8 * torch.randn(rows, 2 * 1536, generator=g)).to(dtype)
    gate_up[0, :6] = torch.tensor([0.0, -0.0, 90.0, -90.0, 1e-30, -200.0]).to(dtype)  # extremes of exp
    tol = TOL[dtype]
    torch.testing.assert_close(_ops().silu_mul(gate_up), fused.reference_silu_mul(gate_up), atol=tol, rtol=tol)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rope_write_rotates_in_place_and_fills_the_slots(dtype: torch.dtype) -> None:
    g = torch.Generator().manual_seed(5)
    rows, heads, kvh, d = 37, 9, 3, 64
    qkv = torch.randn(rows, (heads + 2 * kvh) * d, generator=g).to(dtype)
    ang = torch.rand(rows, d // 2, generator=g) * 100
    cos = torch.cat([ang.cos(), ang.cos()], dim=-1).to(dtype)
    sin_half = ang.sin().to(dtype)
    cache_k = torch.zeros(8, 16, kvh, d, dtype=dtype)
    cache_v = torch.zeros_like(cache_k)
    slots = torch.randperm(8 * 16, generator=g)[:rows]
    rot = (heads + kvh) * d
    want = fused.reference_rope(qkv[:, :rot].view(rows, heads + kvh, d), cos[:, None], sin_half[:, None])
    v_want = qkv[:, rot:].view(rows, kvh, d).clone()
    got = qkv.clone()
    _ops().rope_write(got, heads, kvh, d, cos, sin_half, slots, cache_k, cache_v)
    tol = TOL[dtype]
    torch.testing.assert_close(got[:, :rot].view(rows, heads + kvh, d), want, atol=tol, rtol=tol)
    torch.testing.assert_close(got[:, rot:], qkv[:, rot:], atol=0, rtol=0)  # V untouched
    flat_k, flat_v = cache_k.view(-1, kvh, d), cache_v.view(-1, kvh, d)
    torch.testing.assert_close(flat_k[slots], want[:, heads:], atol=tol, rtol=tol)
    torch.testing.assert_close(flat_v[slots], v_want, atol=0, rtol=0)
    others = torch.ones(8 * 16, dtype=torch.bool)
    others[slots] = False
    assert not flat_k[others].any() and not flat_v[others].any()  # nothing written elsewhere


def test_bad_shapes_are_refused_naming_them() -> None:
    with pytest.raises(ValueError, match="silu_mul"):
        _ops().silu_mul(torch.zeros(2, 7))
    with pytest.raises(ValueError, match="one dtype"):
        _ops().rms_norm(torch.zeros(2, 4), torch.zeros(4, dtype=torch.bfloat16), 1e-5)
    with pytest.raises(ValueError, match="rope_write"):
        _ops().rope_write(torch.zeros(3, 10), 1, 1, 4, torch.zeros(3, 4), torch.zeros(3, 2))


@pytest.fixture(scope="module")
def tiny_ckpt(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return synth.synthesize(tmp_path_factory.mktemp("fused") / "tiny", "tiny", seed=2)


def _eager_twin(model: LlamaForCausalLM) -> LlamaForCausalLM:
    twin = LlamaForCausalLM(model.config, dtype=model.dtype, fused_ops=False)
    twin.load_groups((g, model.export_group(g)) for g in model.loaded_groups)
    return twin


def test_fused_model_matches_eager_without_and_with_a_paged_cache(tiny_ckpt: Path) -> None:
    model = load_model(tiny_ckpt)
    eager = _eager_twin(model)
    ids = torch.randint(0, model.config.vocab_size, (2, 70), generator=torch.Generator().manual_seed(0))
    torch.testing.assert_close(model(ids), eager(ids), atol=1e-4, rtol=0)
    # Through the paged cache: a prompt in two chunks, then a decode step, each model its own cache.
    caches = [KVCache.for_model(model.config, num_blocks=16, block_size=8) for _ in range(2)]
    table = list(range(12))
    steps = [([40], [0]), ([29], [40]), ([1], [69])]
    flat = ids[0]
    for q_lens, ctx in steps:
        batch = ForwardBatch.build(q_lens, ctx, [table], 8)
        tokens = flat[ctx[0] : ctx[0] + q_lens[0]]
        got = model.forward_batch(tokens, batch, caches[0])
        want = eager.forward_batch(tokens, batch, caches[1])
        torch.testing.assert_close(got, want, atol=1e-4, rtol=0)
    torch.testing.assert_close(caches[0].layer_cache(0)[0], caches[1].layer_cache(0)[0], atol=1e-5, rtol=0)


def test_a_slot_outside_the_cache_is_refused(tiny_ckpt: Path) -> None:
    model = load_model(tiny_ckpt)
    cache = KVCache.for_model(model.config, num_blocks=2, block_size=8)
    batch = ForwardBatch.build([4], [0], [[5]], 8)  # block 5 of a 2-block cache
    with pytest.raises(ValueError, match="outside the KV cache"):
        model.forward_batch(torch.tensor([1, 2, 3, 4]), batch, cache)


def test_decode_kernel_reads_strided_queries_and_trusts_checked_bounds() -> None:
    """The decode-attention kernel takes Q as the strided view of the fused QKV output (no copy),
    and `checked=True` skips only the bounds reductions: same result as the checked call."""
    from services.worker.model import native

    kernel = native.paged_decode()
    if kernel is None:
        pytest.skip("native decode kernel unavailable")
    g = torch.Generator().manual_seed(9)
    heads, kvh, d, bs = 9, 3, 64, 16
    k = torch.randn(12, bs, kvh, d, generator=g)
    v = torch.randn(12, bs, kvh, d, generator=g)
    qkv = torch.randn(4, (heads + 2 * kvh) * d, generator=g)
    q = qkv[:, : heads * d].view(4, heads, d)  # row stride (heads + 2 kvh) * d
    tables = torch.randperm(12, generator=g)[:12].view(4, 3)
    lens = torch.tensor([1, 17, 33, 48])
    got = kernel(q, k, v, tables, lens, 48, 0, True)
    torch.testing.assert_close(got, kernel(q.contiguous(), k, v, tables, lens, 48, 0, False), atol=0, rtol=0)
    for s in range(4):
        want = native.reference_decode(q[s], k, v, tables[s], int(lens[s]))
        torch.testing.assert_close(got[s], want, atol=1e-5, rtol=1e-5)
