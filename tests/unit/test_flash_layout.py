"""The CUDA prefill path's own code, checked on the CPU: `FlashLayout` lays a paged step out as
FlashAttention's varlen kernel reads it (cumulative query and key offsets, every key's cache
slot in position order), and `flash.attention` over that layout, with a reference varlen kernel
behind torch's interface, equals the engine's SDPA paths. The kernel itself runs in the `gpu`
tests (test_worker_device.py)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from services.model_format.config import LlamaConfig
from services.worker.engine.kv_cache import KVCache
from services.worker.model import flash
from services.worker.model.attention import ForwardBatch, attention

BS = 4


def test_layout_offsets_and_key_slots() -> None:
    tables = [[7, 2], [1, 4, 9], [3, 5]]
    layout = flash.FlashLayout.build([3, 2, 1], [0, 5, 7], tables, BS, torch.device("cpu"))
    assert layout.cu_q.tolist() == [0, 3, 5, 6] and layout.cu_k.tolist() == [0, 3, 10, 18]
    assert (layout.max_q, layout.max_k) == (3, 8)
    assert layout.cu_q.dtype == torch.int32
    want = [28, 29, 30]  # sequence 0: positions 0-2 in block 7
    want += [4, 5, 6, 7, 16, 17, 18]  # sequence 1: positions 0-6 over blocks 1, 4
    want += [12, 13, 14, 15, 20, 21, 22, 23]  # sequence 2: positions 0-7 over blocks 3, 5
    assert layout.key_slots is not None and layout.key_slots.tolist() == want
    fresh = flash.FlashLayout.build([3, 2], [0, 0], tables[:2], BS, torch.device("cpu"))
    assert fresh.key_slots is None  # no cached context: the step's own K/V are the keys


def _reference_varlen(q, k, v, cu_q, cu_k, max_q, max_k, *, window_size=(-1, -1), enable_gqa=False):
    """FlashAttention's varlen semantics, sequence by sequence: causal aligned bottom-right."""
    out = torch.empty_like(q)
    for s in range(len(cu_q) - 1):
        qa, qb, ka, kb = int(cu_q[s]), int(cu_q[s + 1]), int(cu_k[s]), int(cu_k[s + 1])
        n, m = qb - qa, kb - ka
        q_pos = torch.arange(m - n, m).view(-1, 1)
        k_pos = torch.arange(m).view(1, -1)
        mask = k_pos <= q_pos
        if window_size[0] >= 0:
            mask &= k_pos >= q_pos - window_size[0]
        o = F.scaled_dot_product_attention(
            q[qa:qb].transpose(0, 1),
            k[ka:kb].transpose(0, 1),
            v[ka:kb].transpose(0, 1),
            attn_mask=mask,
            enable_gqa=True,
        )
        out[qa:qb] = o.transpose(0, 1)
    return out


def test_attention_over_the_layout_equals_the_sdpa_paths(monkeypatch) -> None:
    cfg = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=8)  # fmt: skip
    g = torch.Generator().manual_seed(0)
    tables = [[1, 2, 3], [4, 5, 6, 7], [8, 9]]
    q_lens, ctx = [9, 4, 1], [0, 10, 6]  # a fresh prompt, a chunk after context, a decode
    t = sum(q_lens)
    q = torch.randn(t, 4, 8, generator=g)
    k, v = torch.randn(t, 2, 8, generator=g), torch.randn(t, 2, 8, generator=g)
    kv = KVCache.for_model(cfg, num_blocks=12, block_size=BS)
    # The cached context of sequences 1 and 2, written first.
    past = ForwardBatch.build([10, 6], [0, 0], tables[1:], BS)
    kv.write(0, past.slot_mapping, torch.randn(16, 2, 8, generator=g), torch.randn(16, 2, 8, generator=g))
    batch = ForwardBatch.build(q_lens, ctx, tables, BS)
    want = attention(q, k, v, batch, kv, 0)  # writes this step's K/V, then the SDPA paths
    monkeypatch.setattr(flash, "_VARLEN", _reference_varlen)
    monkeypatch.setattr(flash, "_PARAMS", frozenset({"window_size", "enable_gqa"}))
    layout = flash.FlashLayout.build(q_lens, ctx, tables, BS, torch.device("cpu"))
    k_cache, v_cache = kv.layer_cache(0)
    got = flash.attention(q, k, v, layout, k_cache, v_cache, None)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    # A windowed layer: the kernel gets (window - 1, 0).
    want_w = attention(q, k, v, batch, kv, 0, window=3, kv_written=True)
    got_w = flash.attention(q, k, v, layout, k_cache, v_cache, 3)
    torch.testing.assert_close(got_w, want_w, atol=1e-5, rtol=1e-5)


def test_a_refusing_kernel_turns_the_path_off(monkeypatch) -> None:
    def refuse(*_a, **_k):
        raise RuntimeError("FlashAttention only supports fp16 and bf16")

    monkeypatch.setattr(flash, "_VARLEN", refuse)
    monkeypatch.setattr(flash, "_disabled", None)
    layout = flash.FlashLayout.build([2], [0], [[0]], BS, torch.device("cpu"))
    q = torch.randn(2, 2, 4)
    assert flash.attention(q, q, q, layout, torch.zeros(1), torch.zeros(1), None) is None
    assert not flash.supported() and "fp16" in (flash._disabled or "")
