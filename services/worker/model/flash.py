"""Attention of a paged step on a CUDA device through FlashAttention's varlen kernel, as torch
ships it (`torch.nn.attention.varlen.varlen_attn`, PyTorch >= 2.9, float16/bfloat16).

One call covers every sequence of the step (fresh prompts, chunks after cached context, prefix
hits and decodes alike): queries packed in the step's flat order, keys packed per sequence in
position order. The kernel's causal mask is aligned bottom-right, so the last query of a
sequence sees all of its keys and a chunk's first query sees its context: exactly the engine's
attention. When no sequence has cached context, the step's own K/V are the keys; otherwise the
keys are gathered from the cache (after this step's K/V were written) through `FlashLayout`.

Where torch has no such function, or the device, dtype or window rules it out, `available`
says so and the caller keeps the SDPA paths.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import structlog
import torch

log = structlog.get_logger(__name__)

DTYPES = (torch.float16, torch.bfloat16)


def _load() -> tuple[Callable[..., Any] | None, frozenset[str]]:
    try:
        from torch.nn.attention.varlen import varlen_attn
    except ImportError:
        return None, frozenset()
    return varlen_attn, frozenset(inspect.signature(varlen_attn).parameters)


_VARLEN, _PARAMS = _load()
_disabled: str | None = None  # why the kernel was turned off after a failed call


@dataclass(frozen=True)
class FlashLayout:
    """A paged step laid out for the varlen kernel."""

    cu_q: torch.Tensor  # [n + 1] int32: first query row of each sequence
    cu_k: torch.Tensor  # [n + 1] int32: first packed key of each sequence
    max_q: int
    max_k: int
    # [sum(context + query)] long: the flat cache slot of every key, in position order per
    # sequence; None when no sequence has cached context (the step's own K/V are the keys).
    key_slots: torch.Tensor | None

    @classmethod
    def build(
        cls,
        query_lens: Sequence[int],
        context_lens: Sequence[int],
        block_tables: Sequence[Sequence[int]],
        block_size: int,
        device: torch.device,
    ) -> FlashLayout:
        kv_lens = [c + n for c, n in zip(context_lens, query_lens, strict=True)]
        cu_q, cu_k = [0], [0]
        for n, m in zip(query_lens, kv_lens, strict=True):
            cu_q.append(cu_q[-1] + n)
            cu_k.append(cu_k[-1] + m)
        key_slots = None
        if any(context_lens):
            offsets = torch.arange(block_size)
            parts = []
            for table, m in zip(block_tables, kv_lens, strict=True):
                blocks = torch.as_tensor(table[: -(-m // block_size)], dtype=torch.long)
                parts.append((blocks.view(-1, 1) * block_size + offsets).view(-1)[:m])
            key_slots = torch.cat(parts).to(device, non_blocking=True)
        return cls(
            cu_q=torch.tensor(cu_q, dtype=torch.int32).to(device, non_blocking=True),
            cu_k=torch.tensor(cu_k, dtype=torch.int32).to(device, non_blocking=True),
            max_q=max(query_lens),
            max_k=max(kv_lens),
            key_slots=key_slots,
        )


def supported() -> bool:
    """Whether this torch has the kernel (and no call of it failed)."""
    return _VARLEN is not None and _disabled is None


def available(q: torch.Tensor, window: int | None) -> bool:
    """Whether the varlen kernel can take a step with these queries and this layer's window."""
    if _VARLEN is None or _disabled is not None or not q.is_cuda or q.dtype not in DTYPES:
        return False
    return window is None or "window_size" in _PARAMS


def attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    layout: FlashLayout,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    window: int | None,
) -> torch.Tensor | None:
    """`[T, H, d]` attention of the step's queries (RoPE applied; the step's K/V already in the
    cache), or None when the kernel refused the call (it is then turned off for the process and
    the caller's SDPA path runs)."""
    global _disabled
    assert _VARLEN is not None
    if layout.key_slots is None:
        keys, values = k, v
    else:
        keys = k_cache.view(-1, *k_cache.shape[2:]).index_select(0, layout.key_slots)
        values = v_cache.view(-1, *v_cache.shape[2:]).index_select(0, layout.key_slots)
    kwargs: dict[str, Any] = {}
    # The causal mask: older torch takes `is_causal`, newer a (left, right) window (left: keys
    # before the query's own, so a window of w keys is w - 1).
    if "is_causal" in _PARAMS:
        kwargs["is_causal"] = True
    if "window_size" in _PARAMS:
        kwargs["window_size"] = (-1 if window is None else window - 1, 0)
    if "enable_gqa" in _PARAMS and q.shape[1] != k.shape[1]:
        kwargs["enable_gqa"] = True
    try:
        out = _VARLEN(q, keys, values, layout.cu_q, layout.cu_k, layout.max_q, layout.max_k, **kwargs)
    except (RuntimeError, TypeError, ValueError) as exc:
        _disabled = f"{type(exc).__name__}: {exc}"
        log.warning("flash_varlen_disabled", reason=_disabled)
        return None
    return out[0] if isinstance(out, tuple) else out
