"""The reference both paged-prefill kernels (`varlen`, and its AVX512-BF16 dot-product variant
`varlen_dot`) are checked against at load and in the tests: one sequence's attention the obvious
way. A leaf module, so that neither kernel module imports the other for it."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def reference_prefill(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, table: list[int], ctx: int, window: int = 0
) -> torch.Tensor:
    """One sequence the obvious way: gather its ctx + n keys, causal (and windowed) mask, SDPA in
    float32. q `[n, H, D]` -> `[n, H, D]`."""
    n, heads, d = q.shape
    kv_heads = k_cache.shape[2]
    total = ctx + n
    keys = k_cache[table].reshape(-1, kv_heads, d)[:total].float().transpose(0, 1)
    values = v_cache[table].reshape(-1, kv_heads, d)[:total].float().transpose(0, 1)
    qpos = torch.arange(ctx, total).view(-1, 1)
    kpos = torch.arange(total).view(1, -1)
    mask = kpos <= qpos
    if window > 0:
        mask &= kpos > qpos - window
    out: torch.Tensor = F.scaled_dot_product_attention(
        q.float().transpose(0, 1), keys, values, attn_mask=mask, enable_gqa=True
    ).transpose(0, 1)
    return out
