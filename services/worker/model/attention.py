"""Batch metadata and attention over a paged KV cache for a flat batch of tokens from many sequences.

A step's tokens are laid out flat (`[num_tokens, ...]`) so the projections and MLP run as one
matmul with no padding; only attention pads, per sequence, to `[batch, max_len, ...]` and uses
`scaled_dot_product_attention` with a mask that encodes both causality and each sequence's
length. Everything derived from the layout is built once per step and shared by all layers.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import torch
import torch.nn.functional as F


class PagedKV(Protocol):
    """What attention needs from a paged KV cache (the engine's `KVCache` implements it)."""

    @property
    def block_size(self) -> int: ...

    def write(self, layer: int, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """Store `k, v [T, kv_heads, head_dim]` of decoder layer `layer` at flat slots `slots [T]`."""
        ...

    def gather(self, layer: int, blocks: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V of `blocks [N]` of layer `layer`, each `[N, block_size, kv_heads, head_dim]`.

        The result may live in a scratch buffer that the next `gather` overwrites.
        """
        ...


@dataclass(frozen=True)
class ForwardBatch:
    """Layout of one step: sequence b contributes `query_lens[b]` new tokens after `context_lens[b]`
    tokens already in the KV cache. Tensors are precomputed here, not per layer."""

    query_lens: tuple[int, ...]
    context_lens: tuple[int, ...]
    positions: torch.Tensor  # [T] long: absolute position of every new token
    logits_indices: torch.Tensor  # [R] long: rows of the flat batch whose logits are wanted
    max_query_len: int
    # Paged KV (None when attention runs over the new tokens only, with no cache).
    slot_mapping: torch.Tensor | None  # [T] long: flat cache slot each new token's K/V goes to
    block_tables: torch.Tensor | None  # [B, max_blocks] long, padded with block 0 (masked out)
    # Scatter index of the flat tokens into the padded [B * max_query_len] query layout; None when
    # the flat layout already is the padded one (all query lengths equal).
    query_pad_index: torch.Tensor | None
    # [B, 1, max_query_len, kv_len] bool, True = may attend; None means plain causal attention
    # over a single sequence with no cached context.
    attn_mask: torch.Tensor | None

    @property
    def num_seqs(self) -> int:
        return len(self.query_lens)

    @property
    def num_tokens(self) -> int:
        return int(self.positions.shape[0])

    @property
    def uses_cache(self) -> bool:
        return self.slot_mapping is not None

    @classmethod
    def build(
        cls,
        query_lens: Sequence[int],
        context_lens: Sequence[int] | None = None,
        block_tables: Sequence[Sequence[int]] | None = None,
        block_size: int | None = None,
        logits_rows: Sequence[int] | None = None,
        device: torch.device | str = "cpu",
    ) -> ForwardBatch:
        """Precompute the layout.

        `block_tables[b]` must cover `context_lens[b] + query_lens[b]` tokens. `logits_rows` lists
        the sequences whose last new token needs logits (default: all of them).
        """
        q_lens = tuple(int(n) for n in query_lens)
        ctx_lens = tuple(int(n) for n in context_lens) if context_lens is not None else (0,) * len(q_lens)
        if not q_lens or len(ctx_lens) != len(q_lens):
            raise ValueError(
                f"ForwardBatch needs one context length per sequence, got query_lens={q_lens} "
                f"context_lens={ctx_lens}"
            )
        if min(q_lens) <= 0 or min(ctx_lens) < 0:
            raise ValueError(f"ForwardBatch query_lens must be > 0, got {q_lens}; contexts {ctx_lens}")
        paged = block_tables is not None
        if not paged and any(ctx_lens):
            raise ValueError(f"cached context {ctx_lens} needs block tables")
        num_seqs = len(q_lens)
        max_q = max(q_lens)
        q_len_t = torch.tensor(q_lens, dtype=torch.long)
        ctx_t = torch.tensor(ctx_lens, dtype=torch.long)
        starts = torch.cumsum(q_len_t, 0) - q_len_t  # first flat row of each sequence
        seq_of_token = torch.repeat_interleave(torch.arange(num_seqs), q_len_t)
        offset_in_seq = torch.arange(int(q_len_t.sum())) - starts[seq_of_token]
        positions = ctx_t[seq_of_token] + offset_in_seq

        rows = range(num_seqs) if logits_rows is None else logits_rows
        logits_indices = torch.tensor([int(starts[b]) + q_lens[b] - 1 for b in rows], dtype=torch.long)

        slot_mapping = None
        tables = None
        if paged:
            assert block_tables is not None
            if block_size is None or block_size <= 0:
                raise ValueError(f"paged ForwardBatch needs a positive block_size, got {block_size!r}")
            if len(block_tables) != num_seqs:
                raise ValueError(f"{len(block_tables)} block tables for {num_seqs} sequences")
            for b, table in enumerate(block_tables):
                need = -(-(ctx_lens[b] + q_lens[b]) // block_size)
                if len(table) < need:
                    raise ValueError(
                        f"sequence {b} needs {need} blocks for {ctx_lens[b] + q_lens[b]} tokens, "
                        f"its block table has {len(table)}"
                    )
            max_blocks = max(len(t) for t in block_tables)
            tables = torch.zeros((num_seqs, max_blocks), dtype=torch.long)
            for b, table in enumerate(block_tables):
                tables[b, : len(table)] = torch.tensor(list(table), dtype=torch.long)
            block_of_token = tables[seq_of_token, positions // block_size]
            slot_mapping = block_of_token * block_size + positions % block_size

        query_pad_index = None
        if any(n != max_q for n in q_lens):
            query_pad_index = seq_of_token * max_q + offset_in_seq

        # Without cached context attention runs over the new tokens only; a lone sequence then
        # needs no mask at all (plain causal attention).
        attn_mask = None
        use_context = tables is not None and any(ctx_lens)
        if use_context or num_seqs > 1:
            kv_len = tables.shape[1] * block_size if use_context else max_q  # type: ignore[union-attr,operator]
            key_pos = torch.arange(kv_len).view(1, 1, kv_len)
            # Query i of sequence b sits at position ctx_b + i and sees keys 0..ctx_b + i. Padded
            # query rows (i >= q_len_b) still see key 0, so no softmax row is empty (NaN); their
            # outputs are dropped.
            q_pos = ctx_t.view(-1, 1, 1) + torch.arange(max_q).view(1, max_q, 1)
            seq_len = (ctx_t + q_len_t).view(-1, 1, 1)
            attn_mask = ((key_pos <= q_pos) & (key_pos < seq_len)).unsqueeze(1)

        dev = torch.device(device)
        return cls(
            query_lens=q_lens,
            context_lens=ctx_lens,
            positions=positions.to(dev),
            logits_indices=logits_indices.to(dev),
            max_query_len=max_q,
            slot_mapping=None if slot_mapping is None else slot_mapping.to(dev),
            block_tables=None if tables is None else tables.to(dev),
            query_pad_index=None if query_pad_index is None else query_pad_index.to(dev),
            attn_mask=None if attn_mask is None else attn_mask.to(dev),
        )


def _pad(x: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
    """Flat `[T, heads, d]` -> padded `[B, max_query_len, heads, d]`."""
    b, q = batch.num_seqs, batch.max_query_len
    if batch.query_pad_index is None:
        return x.view(b, q, *x.shape[1:])
    out = x.new_zeros((b * q, *x.shape[1:]))
    out.index_copy_(0, batch.query_pad_index, x)
    return out.view(b, q, *x.shape[1:])


def _unpad(x: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
    """Padded `[B, max_query_len, ...]` -> flat `[T, ...]`."""
    flat = x.reshape(batch.num_seqs * batch.max_query_len, *x.shape[2:])
    if batch.query_pad_index is None:
        return flat
    return flat.index_select(0, batch.query_pad_index)


def attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    batch: ForwardBatch,
    kv: PagedKV | None,
    layer: int,
) -> torch.Tensor:
    """Attention for flat `q [T, H, d]`, `k, v [T, KVH, d]` (RoPE applied); returns `[T, H, d]`.

    With a cache, the new K/V are first written to their slots, then each sequence's whole
    context is gathered through its block table.
    """
    if batch.uses_cache:
        if kv is None:
            raise ValueError("ForwardBatch was built with block tables but no KV cache was given")
        assert batch.slot_mapping is not None
        kv.write(layer, batch.slot_mapping, k, v)
    qp = _pad(q, batch).transpose(1, 2)  # [B, H, Q, d]
    if batch.uses_cache and any(batch.context_lens):
        assert kv is not None and batch.block_tables is not None
        b, max_blocks = batch.block_tables.shape
        # Each sequence's whole context, copied block by block into one padded [B, S, KVH, d].
        k_blocks, v_blocks = kv.gather(layer, batch.block_tables.view(-1))
        s = max_blocks * k_blocks.shape[1]
        keys = k_blocks.view(b, s, *k_blocks.shape[2:]).transpose(1, 2)
        values = v_blocks.view(b, s, *v_blocks.shape[2:]).transpose(1, 2)
    else:
        keys = _pad(k, batch).transpose(1, 2)
        values = _pad(v, batch).transpose(1, 2)
    gqa = qp.shape[1] != keys.shape[1]
    if batch.attn_mask is None:
        out = F.scaled_dot_product_attention(qp, keys, values, is_causal=True, enable_gqa=gqa)
    else:
        out = F.scaled_dot_product_attention(qp, keys, values, attn_mask=batch.attn_mask, enable_gqa=gqa)
    return _unpad(out.transpose(1, 2), batch)
