"""Batch metadata and attention over a paged KV cache for a flat batch of tokens from many sequences.

A step's tokens are laid out flat (`[num_tokens, ...]`) so the projections and MLP run as one
matmul with no padding; only attention pads, per sequence, to `[batch, max_len, ...]` and uses
`scaled_dot_product_attention` with a mask that encodes both causality and each sequence's
length. Everything derived from the layout is built once per step and shared by all layers.
"""

from __future__ import annotations

import dataclasses
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
class AttentionGroup:
    """Sequences whose attention runs as one padded SDPA call.

    Decodes (one new token each) and prefills are separate groups, so a long prompt in the same
    step does not pad every decode's query to the prompt's length.
    """

    seqs: tuple[int, ...]  # sequence indices in the ForwardBatch
    token_index: torch.Tensor | None  # [t] flat rows of the group's tokens; None = all, in order
    max_query_len: int
    # Scatter index of the group's tokens into the padded [b * max_query_len] query layout; None
    # when every sequence of the group has max_query_len new tokens.
    query_pad_index: torch.Tensor | None
    # [b, max_blocks] blocks to gather the whole context from; None = attend over new tokens only.
    block_tables: torch.Tensor | None
    # [b, 1, max_query_len, kv_len] bool, True = may attend; None = plain causal attention over a
    # single sequence without cached context.
    attn_mask: torch.Tensor | None

    @property
    def num_seqs(self) -> int:
        return len(self.seqs)

    def to(self, device: torch.device) -> AttentionGroup:
        def move(t: torch.Tensor | None) -> torch.Tensor | None:
            return None if t is None else t.to(device)

        return dataclasses.replace(
            self,
            token_index=move(self.token_index),
            query_pad_index=move(self.query_pad_index),
            block_tables=move(self.block_tables),
            attn_mask=move(self.attn_mask),
        )


@dataclass(frozen=True)
class ForwardBatch:
    """Layout of one step: sequence b contributes `query_lens[b]` new tokens after `context_lens[b]`
    tokens already in the KV cache. Tensors are precomputed here, once, not per layer."""

    query_lens: tuple[int, ...]
    context_lens: tuple[int, ...]
    positions: torch.Tensor  # [T] long: absolute position of every new token
    logits_indices: torch.Tensor  # [R] long: rows of the flat batch whose logits are wanted
    # Flat cache slot each new token's K/V goes to; None when no cache is used.
    slot_mapping: torch.Tensor | None
    groups: tuple[AttentionGroup, ...]

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
        if paged:
            assert block_tables is not None
            if block_size is None or block_size <= 0:
                raise ValueError(f"paged ForwardBatch needs a positive block_size, got {block_size!r}")
            if len(block_tables) != len(q_lens):
                raise ValueError(f"{len(block_tables)} block tables for {len(q_lens)} sequences")
            for b, table in enumerate(block_tables):
                need = -(-(ctx_lens[b] + q_lens[b]) // block_size)
                if len(table) < need:
                    raise ValueError(
                        f"sequence {b} needs {need} blocks for {ctx_lens[b] + q_lens[b]} tokens, "
                        f"its block table has {len(table)}"
                    )

        starts: list[int] = []
        acc = 0
        for n in q_lens:
            starts.append(acc)
            acc += n
        positions = torch.cat([torch.arange(c, c + n) for c, n in zip(ctx_lens, q_lens, strict=True)])
        rows = range(len(q_lens)) if logits_rows is None else logits_rows
        logits_indices = torch.tensor([starts[b] + q_lens[b] - 1 for b in rows], dtype=torch.long)

        slot_mapping = None
        if paged:
            assert block_tables is not None and block_size is not None
            # Token i of sequence b sits in block table[b][(ctx_b + i) // block_size].
            slots = []
            for b, table in enumerate(block_tables):
                pos = torch.arange(ctx_lens[b], ctx_lens[b] + q_lens[b])
                blocks = torch.tensor(list(table), dtype=torch.long)[pos // block_size]
                slots.append(blocks * block_size + pos % block_size)
            slot_mapping = torch.cat(slots)

        decode = [b for b, n in enumerate(q_lens) if n == 1 and ctx_lens[b] > 0]
        prefill = [b for b, n in enumerate(q_lens) if not (n == 1 and ctx_lens[b] > 0)]
        groups = tuple(
            _build_group(members, q_lens, ctx_lens, starts, block_tables, block_size)
            for members in (decode, prefill)
            if members
        )
        dev = torch.device(device)
        return cls(
            query_lens=q_lens,
            context_lens=ctx_lens,
            positions=positions.to(dev),
            logits_indices=logits_indices.to(dev),
            slot_mapping=None if slot_mapping is None else slot_mapping.to(dev),
            groups=tuple(g.to(dev) for g in groups),
        )


def _build_group(
    members: list[int],
    q_lens: tuple[int, ...],
    ctx_lens: tuple[int, ...],
    starts: list[int],
    block_tables: Sequence[Sequence[int]] | None,
    block_size: int | None,
) -> AttentionGroup:
    q = [q_lens[b] for b in members]
    ctx = [ctx_lens[b] for b in members]
    max_q = max(q)
    # A group holding every sequence holds every token, in flat order: no gather/scatter needed.
    token_rows = None
    if len(members) != len(q_lens):
        token_rows = torch.cat([torch.arange(starts[b], starts[b] + q_lens[b]) for b in members])
    query_pad_index = None
    if any(n != max_q for n in q):
        query_pad_index = torch.cat([torch.arange(n) + i * max_q for i, n in enumerate(q)])
    use_context = block_tables is not None and any(ctx)
    tables = None
    if use_context:
        assert block_tables is not None and block_size is not None
        max_blocks = max(-(-(c + n) // block_size) for c, n in zip(ctx, q, strict=True))
        tables = torch.zeros((len(members), max_blocks), dtype=torch.long)
        for i, b in enumerate(members):
            need = -(-(ctx_lens[b] + q_lens[b]) // block_size)
            tables[i, :need] = torch.tensor(list(block_tables[b][:need]), dtype=torch.long)
    attn_mask = None
    if use_context or len(members) > 1:
        assert not use_context or (tables is not None and block_size is not None)
        kv_len = tables.shape[1] * block_size if use_context else max_q  # type: ignore[union-attr,operator]
        ctx_t = torch.tensor(ctx)
        key_pos = torch.arange(kv_len).view(1, 1, kv_len)
        # Query i of a sequence sits at position ctx + i and sees keys 0..ctx + i. Padded query rows
        # (i >= q_len) still see key 0, so no softmax row is empty (NaN); their outputs are dropped.
        q_pos = ctx_t.view(-1, 1, 1) + torch.arange(max_q).view(1, max_q, 1)
        seq_len = (ctx_t + torch.tensor(q)).view(-1, 1, 1)
        attn_mask = ((key_pos <= q_pos) & (key_pos < seq_len)).unsqueeze(1)
    return AttentionGroup(
        seqs=tuple(members),
        token_index=token_rows,
        max_query_len=max_q,
        query_pad_index=query_pad_index,
        block_tables=tables,
        attn_mask=attn_mask,
    )


def _pad(x: torch.Tensor, g: AttentionGroup) -> torch.Tensor:
    """The group's flat `[t, heads, d]` -> padded `[b, max_query_len, heads, d]`."""
    b, q = g.num_seqs, g.max_query_len
    if g.query_pad_index is None:
        return x.view(b, q, *x.shape[1:])
    out = x.new_zeros((b * q, *x.shape[1:]))
    out.index_copy_(0, g.query_pad_index, x)
    return out.view(b, q, *x.shape[1:])


def _unpad(x: torch.Tensor, g: AttentionGroup) -> torch.Tensor:
    """Padded `[b, max_query_len, ...]` -> the group's flat `[t, ...]`."""
    flat = x.reshape(g.num_seqs * g.max_query_len, *x.shape[2:])
    return flat if g.query_pad_index is None else flat.index_select(0, g.query_pad_index)


def _group_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: AttentionGroup, kv: PagedKV | None, layer: int
) -> torch.Tensor:
    qp = _pad(q, g).transpose(1, 2)  # [b, H, Q, d]
    if g.block_tables is not None:
        assert kv is not None
        b, max_blocks = g.block_tables.shape
        # Each sequence's whole context, copied block by block into one padded [b, S, KVH, d].
        k_blocks, v_blocks = kv.gather(layer, g.block_tables.view(-1))
        s = max_blocks * k_blocks.shape[1]
        keys = k_blocks.view(b, s, *k_blocks.shape[2:]).transpose(1, 2)
        values = v_blocks.view(b, s, *v_blocks.shape[2:]).transpose(1, 2)
    else:
        keys = _pad(k, g).transpose(1, 2)
        values = _pad(v, g).transpose(1, 2)
    gqa = qp.shape[1] != keys.shape[1]
    if g.attn_mask is None:
        out = F.scaled_dot_product_attention(qp, keys, values, is_causal=True, enable_gqa=gqa)
    else:
        out = F.scaled_dot_product_attention(qp, keys, values, attn_mask=g.attn_mask, enable_gqa=gqa)
    return _unpad(out.transpose(1, 2), g)


def attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    batch: ForwardBatch,
    kv: PagedKV | None,
    layer: int,
) -> torch.Tensor:
    """Attention for flat `q [T, H, d]`, `k, v [T, KVH, d]` (RoPE applied); returns `[T, H, d]`.

    With a cache, the new K/V are first written to their slots, then each sequence attends over
    its whole context gathered through its block table.
    """
    if batch.uses_cache:
        if kv is None:
            raise ValueError("ForwardBatch was built with block tables but no KV cache was given")
        assert batch.slot_mapping is not None
        kv.write(layer, batch.slot_mapping, k, v)
    if len(batch.groups) == 1 and batch.groups[0].token_index is None:
        return _group_attention(q, k, v, batch.groups[0], kv, layer)
    out = torch.empty_like(q)
    for g in batch.groups:
        assert g.token_index is not None
        rows = g.token_index
        part = _group_attention(
            q.index_select(0, rows), k.index_select(0, rows), v.index_select(0, rows), g, kv, layer
        )
        out.index_copy_(0, rows, part)
    return out
