"""Batch metadata and attention over a paged KV cache for a flat batch of tokens from many sequences.

A step's tokens are laid out flat (`[num_tokens, ...]`) so the projections and MLP run as one
matmul with no padding. Attention runs per kind of sequence:

- no cached context (a whole prompt): causal `scaled_dot_product_attention` over the sequence's
  own new tokens, one call per sequence (or one batched call when all have the same length), so
  prompts of mixed lengths cost no padding and no mask;
- cached context (decodes, later chunks of a prompt): the context is gathered from the paged cache
  into `[batch, max_len, ...]` and attended with a mask that encodes causality and each length.
  Decodes are bucketed by context length so a short sequence is not padded to the longest one.

Everything derived from the layout is built once per step and shared by all layers.

Sliding-window layers (Mistral, some Qwen2 layers) pass `window`: a query at position q sees keys
q - window + 1 .. q only. Prompts longer than the window get a banded mask instead of `is_causal`,
cached-context groups a banded mask (torch path) or the kernel's window (native path). The masks
for a window are built on first use in a step and shared by the layers that use it. Keys that
fell out of every query's window stay in the cache (their blocks are freed with the sequence).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Protocol

import torch
import torch.nn.functional as F

from services.worker.model import flash as flash_attn
from services.worker.model import native, varlen


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

    def layer_cache(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The whole K and V storage of layer `layer`, each `[num_blocks, block_size, kv_heads, head_dim]`."""
        ...


@dataclass(frozen=True)
class AttentionGroup:
    """Sequences with cached context whose attention runs as one padded SDPA call.

    Decodes (one new token each) and prefills are separate groups, so a long prompt in the same
    step does not pad every decode's query to the prompt's length; decodes are further split by
    context length.
    """

    seqs: tuple[int, ...]  # sequence indices in the ForwardBatch
    token_index: torch.Tensor | None  # [t] flat rows of the group's tokens; None = all, in order
    max_query_len: int
    # Scatter index of the group's tokens into the padded [b * max_query_len] query layout; None
    # when every sequence of the group has max_query_len new tokens.
    query_pad_index: torch.Tensor | None
    # [b, max_blocks] blocks to gather the whole context from.
    block_tables: torch.Tensor
    # [b, 1, max_query_len, kv_len] bool, True = may attend.
    attn_mask: torch.Tensor
    seq_lens: torch.Tensor  # [b] long: context + new tokens of each member (its keys)
    max_seq_len: int
    context_lens: torch.Tensor  # [b] long: cached tokens of each member
    # Largest block id in block_tables: checked against the cache's size in Python, so kernels
    # that read the cache in place need no reduction over the tables each layer.
    max_block_id: int = 0
    # Each member's new tokens and cached tokens, as ints (the torch chunk path loops over them).
    query_lens: tuple[int, ...] = ()
    context_list: tuple[int, ...] = ()
    # Banded masks by window size, built on first use (see `window_mask`).
    _window_masks: dict[int, torch.Tensor] = field(default_factory=dict, init=False, repr=False, compare=False)

    @property
    def num_seqs(self) -> int:
        return len(self.seqs)

    def window_mask(self, window: int) -> torch.Tensor:
        """`attn_mask` narrowed to a sliding window: query position q also needs key > q - window.

        Padded query rows (past a member's new tokens) are treated as its last real one, so no
        row is empty; their outputs are dropped anyway.
        """
        mask = self._window_masks.get(window)
        if mask is None:
            kv_len = self.attn_mask.shape[-1]
            device = self.attn_mask.device
            key_pos = torch.arange(kv_len, device=device).view(1, 1, kv_len)
            q_pos = self.context_lens.view(-1, 1, 1) + torch.arange(self.max_query_len, device=device).view(1, -1, 1)
            q_pos = torch.minimum(q_pos, self.seq_lens.view(-1, 1, 1) - 1)
            mask = self.attn_mask & (key_pos > q_pos - window).unsqueeze(1)
            self._window_masks[window] = mask
        return mask

    def to(self, device: torch.device) -> AttentionGroup:
        def move(t: torch.Tensor | None) -> torch.Tensor | None:
            return None if t is None else t.to(device)

        return dataclasses.replace(
            self,
            token_index=move(self.token_index),
            query_pad_index=move(self.query_pad_index),
            block_tables=self.block_tables.to(device),
            attn_mask=self.attn_mask.to(device),
            seq_lens=self.seq_lens.to(device),
            context_lens=self.context_lens.to(device),
        )


@dataclass(frozen=True)
class CausalSpans:
    """Sequences without cached context: each attends causally over its own new tokens only.

    `starts[i], lengths[i]` are sequence i's rows in the flat batch. When `uniform`, the spans are
    back to back from row `starts[0]` with one length, so one batched call covers them all.
    """

    seqs: tuple[int, ...]
    starts: tuple[int, ...]
    lengths: tuple[int, ...]
    uniform: bool
    _band_masks: dict[tuple[int, int], torch.Tensor] = field(
        default_factory=dict, init=False, repr=False, compare=False
    )

    def band_mask(self, length: int, window: int, device: torch.device) -> torch.Tensor:
        """`[length, length]` bool: causal, and each query sees at most `window` keys (itself included)."""
        mask = self._band_masks.get((length, window))
        if mask is None:
            pos = torch.arange(length, device=device)
            delta = pos.view(-1, 1) - pos.view(1, -1)  # query - key
            mask = (delta >= 0) & (delta < window)
            self._band_masks[(length, window)] = mask
        return mask


@dataclass(frozen=True)
class PrefillSet:
    """The sequences of a paged step that carry prompt tokens (every one but the decodes), laid
    out for the varlen kernel (`varlen.paged_prefill`), which reads all their keys in place."""

    rows: torch.Tensor  # [n] long: first flat row of each
    query_lens: torch.Tensor  # [n] long
    context_lens: torch.Tensor  # [n] long
    block_tables: torch.Tensor  # [n, max_blocks] long, padded with block 0
    max_block_id: int


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
    groups: tuple[AttentionGroup, ...]  # sequences with cached context
    causal: CausalSpans | None = None  # sequences without
    # Largest entry of slot_mapping (-1 without a cache): lets kernels that write the cache
    # directly check the slots against its size without a reduction over a tensor.
    max_slot: int = -1
    # With a cache: the sequences that are not decodes, for the varlen kernel (None: none).
    prefill: PrefillSet | None = None
    # With a cache on a CUDA device: every sequence laid out for FlashAttention's varlen kernel.
    flash: flash_attn.FlashLayout | None = None

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
                f"ForwardBatch needs one context length per sequence, got query_lens={q_lens} context_lens={ctx_lens}"
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
        positions: list[int] = []
        for c, n in zip(ctx_lens, q_lens, strict=True):
            positions.extend(range(c, c + n))
        rows = range(len(q_lens)) if logits_rows is None else logits_rows
        logits_indices = [starts[b] + q_lens[b] - 1 for b in rows]

        slot_mapping = None
        max_slot = -1
        if paged:
            assert block_tables is not None and block_size is not None
            # Token i of sequence b sits in block table[b][(ctx_b + i) // block_size].
            slots: list[int] = []
            for b, table in enumerate(block_tables):
                c, n = ctx_lens[b], q_lens[b]
                slots.extend(table[pos // block_size] * block_size + pos % block_size for pos in range(c, c + n))
            slot_mapping = torch.tensor(slots, dtype=torch.long)
            max_slot = max(slots)

        decode = [b for b, n in enumerate(q_lens) if n == 1 and ctx_lens[b] > 0]
        prefill = None
        if paged and len(decode) < len(q_lens):
            assert block_tables is not None and block_size is not None
            members = [b for b in range(len(q_lens)) if not (q_lens[b] == 1 and ctx_lens[b] > 0)]
            needs = [-(-(ctx_lens[b] + q_lens[b]) // block_size) for b in members]
            width = max(needs)
            prefill = PrefillSet(
                rows=torch.tensor([starts[b] for b in members], dtype=torch.long),
                query_lens=torch.tensor([q_lens[b] for b in members], dtype=torch.long),
                context_lens=torch.tensor([ctx_lens[b] for b in members], dtype=torch.long),
                block_tables=torch.tensor(
                    [
                        list(block_tables[b][:need]) + [0] * (width - need)
                        for b, need in zip(members, needs, strict=True)
                    ],
                    dtype=torch.long,
                ),
                max_block_id=max(max(block_tables[b][:need]) for b, need in zip(members, needs, strict=True)),
            )
        chunked = [b for b, n in enumerate(q_lens) if n > 1 and ctx_lens[b] > 0]
        fresh = [b for b, c in enumerate(ctx_lens) if c == 0]
        dev = torch.device(device)
        member_sets: list[list[int]] = []
        if decode:
            assert block_size is not None
            if dev.type == "cpu" and native.paged_decode() is not None:
                # The native kernel reads each context in place, unpadded: one group.
                member_sets.append(decode)
            else:
                member_sets.extend(_bucket_by_length(decode, ctx_lens, block_size))
        if chunked:
            member_sets.append(chunked)
        groups = tuple(
            _build_group(members, q_lens, ctx_lens, starts, block_tables, block_size)  # type: ignore[arg-type]
            for members in member_sets
        )
        causal = None
        if fresh:
            lengths = tuple(q_lens[b] for b in fresh)
            spans_starts = tuple(starts[b] for b in fresh)
            uniform = len(set(lengths)) == 1 and all(
                spans_starts[i] == spans_starts[0] + i * lengths[0] for i in range(len(fresh))
            )
            causal = CausalSpans(tuple(fresh), spans_starts, lengths, uniform)
        flash = None
        if paged and dev.type == "cuda" and flash_attn.supported():
            assert block_tables is not None and block_size is not None
            flash = flash_attn.FlashLayout.build(q_lens, ctx_lens, block_tables, block_size, dev)
        return cls(
            flash=flash,
            query_lens=q_lens,
            context_lens=ctx_lens,
            positions=torch.tensor(positions, dtype=torch.long, device=dev),
            logits_indices=torch.tensor(logits_indices, dtype=torch.long, device=dev),
            slot_mapping=None if slot_mapping is None else slot_mapping.to(dev),
            groups=tuple(g.to(dev) for g in groups),
            causal=causal,
            max_slot=max_slot,
            prefill=prefill,
        )


# Fixed cost of one more decode group (a gather, a mask, an SDPA call per layer), in units of one
# sequence-block of padded attention: splitting pays when it saves more padding than this.
_GROUP_COST_BLOCKS = 16


def _bucket_by_length(members: list[int], ctx_lens: tuple[int, ...], block_size: int) -> list[list[int]]:
    """Split decodes into groups of similar context length, minimising padded blocks + group cost.

    A padded group costs (members x its longest table); an exact partition of the sorted lengths
    by dynamic programming (at most a few hundred decodes: O(n^2) is nothing).
    """
    order = sorted(members, key=lambda b: ctx_lens[b])
    blocks = [-(-(ctx_lens[b] + 1) // block_size) for b in order]
    n = len(order)
    best = [0.0] + [math.inf] * n  # best[j]: cost of the first j sequences
    cut = [0] * (n + 1)
    for j in range(1, n + 1):
        for i in range(j):  # last group is order[i:j]; its longest is blocks[j - 1]
            cost = best[i] + (j - i) * blocks[j - 1] + _GROUP_COST_BLOCKS
            if cost < best[j]:
                best[j], cut[j] = cost, i
    out: list[list[int]] = []
    j = n
    while j > 0:
        i = cut[j]
        out.append(sorted(order[i:j]))
        j = i
    return out[::-1]


def _build_group(
    members: list[int],
    q_lens: tuple[int, ...],
    ctx_lens: tuple[int, ...],
    starts: list[int],
    block_tables: Sequence[Sequence[int]],
    block_size: int,
) -> AttentionGroup:
    q = [q_lens[b] for b in members]
    ctx = [ctx_lens[b] for b in members]
    max_q = max(q)
    # A group holding every sequence holds every token, in flat order: no gather/scatter needed.
    token_rows = None
    if len(members) != len(q_lens):
        rows: list[int] = []
        for b in members:
            rows.extend(range(starts[b], starts[b] + q_lens[b]))
        token_rows = torch.tensor(rows, dtype=torch.long)
    query_pad_index = None
    if any(n != max_q for n in q):
        query_pad_index = torch.cat([torch.arange(n) + i * max_q for i, n in enumerate(q)])
    needs = [-(-(c + n) // block_size) for c, n in zip(ctx, q, strict=True)]
    max_blocks = max(needs)
    # Padding entries point at block 0: gathered, then masked out.
    tables = torch.tensor(
        [list(block_tables[b][:need]) + [0] * (max_blocks - need) for b, need in zip(members, needs, strict=True)],
        dtype=torch.long,
    )
    kv_len = max_blocks * block_size
    ctx_t = torch.tensor(ctx)
    key_pos = torch.arange(kv_len).view(1, 1, kv_len)
    # Query i of a sequence sits at position ctx + i and sees keys 0..ctx + i. Padded query rows
    # (i >= q_len) still see key 0, so no softmax row is empty (NaN); their outputs are dropped.
    q_pos = ctx_t.view(-1, 1, 1) + torch.arange(max_q).view(1, max_q, 1)
    seq_len = (ctx_t + torch.tensor(q)).view(-1, 1, 1)
    attn_mask = ((key_pos <= q_pos) & (key_pos < seq_len)).unsqueeze(1)
    lens = [c + n for c, n in zip(ctx, q, strict=True)]
    return AttentionGroup(
        seqs=tuple(members),
        token_index=token_rows,
        max_query_len=max_q,
        query_pad_index=query_pad_index,
        block_tables=tables,
        attn_mask=attn_mask,
        seq_lens=torch.tensor(lens, dtype=torch.long),
        max_seq_len=max(lens),
        context_lens=ctx_t,
        max_block_id=max(max(block_tables[b][:need]) for b, need in zip(members, needs, strict=True)),
        query_lens=tuple(q),
        context_list=tuple(ctx),
    )


def _pad(x: torch.Tensor, g: AttentionGroup) -> torch.Tensor:
    """The group's flat `[t, heads, d]` -> padded `[b, max_query_len, heads, d]`."""
    b, q = g.num_seqs, g.max_query_len
    if g.query_pad_index is None:
        return x.reshape(b, q, *x.shape[1:])
    out = x.new_zeros((b * q, *x.shape[1:]))
    out.index_copy_(0, g.query_pad_index, x)
    return out.view(b, q, *x.shape[1:])


def _unpad(x: torch.Tensor, g: AttentionGroup) -> torch.Tensor:
    """Padded `[b, max_query_len, ...]` -> the group's flat `[t, ...]`."""
    flat = x.reshape(g.num_seqs * g.max_query_len, *x.shape[2:])
    return flat if g.query_pad_index is None else flat.index_select(0, g.query_pad_index)


def _group_attention(
    q: torch.Tensor, g: AttentionGroup, kv: PagedKV, layer: int, window: int | None = None
) -> torch.Tensor:
    """Attention of the group's queries `[t, H, d]` over their whole context (or its last `window`
    keys per query), from the cache."""
    if g.max_query_len == 1 and q.dtype in native.KV_DTYPES and q.device.type == "cpu":
        kernel = native.paged_decode()
        if kernel is not None:
            k_cache, v_cache = kv.layer_cache(layer)
            if k_cache.dtype == q.dtype:
                # Lengths are >= 1 and covered by the tables by construction; block ids are checked
                # here against this cache (the kernel checks them itself if they fall outside).
                checked = g.max_block_id < k_cache.shape[0]
                return kernel(q, k_cache, v_cache, g.block_tables, g.seq_lens, g.max_seq_len, window or 0, checked)
    if g.max_query_len > 1 and window is None and _FLASH_CPU is not None and q.device.type == "cpu" and g.query_lens:
        return _chunk_attention(q, g, kv, layer)
    qp = _pad(q, g).transpose(1, 2)  # [b, H, Q, d]
    b, max_blocks = g.block_tables.shape
    # Each sequence's whole context, copied block by block into one padded [b, S, KVH, d].
    k_blocks, v_blocks = kv.gather(layer, g.block_tables.view(-1))
    s = max_blocks * k_blocks.shape[1]
    keys = k_blocks.view(b, s, *k_blocks.shape[2:]).transpose(1, 2)
    values = v_blocks.view(b, s, *v_blocks.shape[2:]).transpose(1, 2)
    gqa = qp.shape[1] != keys.shape[1]
    mask = g.attn_mask if window is None else g.window_mask(window)
    out = F.scaled_dot_product_attention(qp, keys, values, attn_mask=mask, enable_gqa=gqa)
    return _unpad(out.transpose(1, 2), g)


# torch's CPU flash attention kernel, which also returns each query row's log-sum-exp.
_FLASH_CPU = getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu", None)


def _chunk_attention(q: torch.Tensor, g: AttentionGroup, kv: PagedKV, layer: int) -> torch.Tensor:
    """Chunks after cached context (`[t, H, d]` queries, members back to back), one member at a
    time and with no mask: every query of a chunk sees all of its member's `ctx` cached keys, and
    its own new keys causally. So the chunk attends to the cached keys unmasked and to its new keys
    with `is_causal`, each through the CPU flash kernel, and the two halves are merged by their
    log-sum-exps: with weights w = sigmoid(lse_ctx - lse_new), `w * o_ctx + (1 - w) * o_new` is
    the softmax over both key sets. Nothing is padded: the masked path padded every member to the
    group's longest context and query and ran a `[Q, S]` boolean mask through SDPA, which on a
    2-core AVX2 host cost about twice a causal call of the same keys."""
    assert _FLASH_CPU is not None
    scale = 1.0 / math.sqrt(q.shape[-1])
    bs = kv.block_size
    out = q.new_empty(q.shape)
    row = 0
    for i, (n, ctx) in enumerate(zip(g.query_lens, g.context_list, strict=True)):
        nb = -(-(ctx + n) // bs)
        k_blocks, v_blocks = kv.gather(layer, g.block_tables[i, :nb])
        keys = k_blocks.view(nb * bs, *k_blocks.shape[2:])  # [S, KVH, d]
        values = v_blocks.view(nb * bs, *v_blocks.shape[2:])
        qm = q[row : row + n].transpose(0, 1).unsqueeze(0)  # [1, H, n, d]
        k_ctx, v_ctx = (x[:ctx].transpose(0, 1).unsqueeze(0) for x in (keys, values))
        k_new, v_new = (x[ctx : ctx + n].transpose(0, 1).unsqueeze(0) for x in (keys, values))
        if qm.dtype != keys.dtype:
            k_ctx, v_ctx, k_new, v_new = (x.to(qm.dtype) for x in (k_ctx, v_ctx, k_new, v_new))
        o_ctx, lse_ctx = _FLASH_CPU(qm, k_ctx, v_ctx, 0.0, False, scale=scale)
        o_new, lse_new = _FLASH_CPU(qm, k_new, v_new, 0.0, True, scale=scale)
        w = torch.sigmoid(lse_ctx - lse_new).unsqueeze(-1)  # [1, H, n, 1], float32
        if o_new.dtype == torch.float32:
            merged = torch.lerp(o_new, o_ctx, w)
        else:
            merged = torch.lerp(o_new.float(), o_ctx.float(), w).to(o_new.dtype)
        out[row : row + n] = merged[0].transpose(0, 1)
        row += n
    return out


def _causal_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    spans: CausalSpans,
    out: torch.Tensor,
    window: int | None = None,
) -> None:
    """Causal attention of each span over its own tokens (the last `window` of them per query when
    windowed), written into `out`'s rows."""
    gqa = q.shape[1] != k.shape[1]

    def sdpa(qs: torch.Tensor, ks: torch.Tensor, vs: torch.Tensor, n: int) -> torch.Tensor:
        if window is None or n <= window:
            return F.scaled_dot_product_attention(qs, ks, vs, is_causal=True, enable_gqa=gqa)
        mask = spans.band_mask(n, window, qs.device)
        return F.scaled_dot_product_attention(qs, ks, vs, attn_mask=mask, enable_gqa=gqa)

    if spans.uniform:
        n, first = spans.lengths[0], spans.starts[0]
        rows = slice(first, first + n * len(spans.lengths))
        b = len(spans.lengths)
        qs, ks, vs = (x[rows].reshape(b, n, *x.shape[1:]).transpose(1, 2) for x in (q, k, v))
        o = sdpa(qs, ks, vs, n)
        out[rows] = o.transpose(1, 2).reshape(b * n, *out.shape[1:])
        return
    for start, n in zip(spans.starts, spans.lengths, strict=True):
        rows = slice(start, start + n)
        qs, ks, vs = (x[rows].unsqueeze(0).transpose(1, 2) for x in (q, k, v))
        o = sdpa(qs, ks, vs, n)
        out[rows] = o[0].transpose(0, 1)


def _varlen_attention(
    q: torch.Tensor, batch: ForwardBatch, prefill: PrefillSet, kv: PagedKV, layer: int, window: int | None
) -> torch.Tensor | None:
    """Every sequence with prompt tokens through the varlen kernel, reading K/V in place (they
    were written before attention); the decodes through the decode kernel's group. None when the
    kernel cannot run here (the torch paths then do)."""
    kernel = varlen.paged_prefill()
    if kernel is None:
        return None
    k_cache, v_cache = kv.layer_cache(layer)
    if k_cache.dtype != q.dtype or k_cache.dtype not in native.KV_DTYPES or prefill.max_block_id >= k_cache.shape[0]:
        return None
    out = kernel(
        q, k_cache, v_cache, prefill.block_tables, prefill.rows, prefill.query_lens, prefill.context_lens, window or 0
    )
    for g in batch.groups:
        if g.max_query_len != 1:
            continue  # chunks after cached context: done by the kernel above
        assert g.token_index is not None  # the step has prompt rows too
        part = _group_attention(q.index_select(0, g.token_index), g, kv, layer, window)
        out.index_copy_(0, g.token_index, part.to(out.dtype))
    return out if q.dtype == out.dtype else out.to(q.dtype)


def attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    batch: ForwardBatch,
    kv: PagedKV | None,
    layer: int,
    window: int | None = None,
    *,
    kv_written: bool = False,
) -> torch.Tensor:
    """Attention for flat `q [T, H, d]`, `k, v [T, KVH, d]` (RoPE applied); returns `[T, H, d]`.

    With a cache, the new K/V are first written to their slots (unless the caller already did,
    `kv_written`); sequences with cached context then attend over their whole context gathered
    through their block tables, the others over their own new tokens. `window`: the layer's
    sliding window (keys per query, itself included).
    """
    if batch.uses_cache and not kv_written:
        if kv is None:
            raise ValueError("ForwardBatch was built with block tables but no KV cache was given")
        assert batch.slot_mapping is not None
        kv.write(layer, batch.slot_mapping, k, v)
    if batch.groups and kv is None:
        raise ValueError("ForwardBatch has cached context but no KV cache was given")
    if batch.flash is not None and kv is not None and flash_attn.available(q, window):
        k_cache, v_cache = kv.layer_cache(layer)
        out = flash_attn.attention(q, k, v, batch.flash, k_cache, v_cache, window)
        if out is not None:
            return out
    if kv_written and batch.prefill is not None and kv is not None and q.device.type == "cpu":
        out = _varlen_attention(q, batch, batch.prefill, kv, layer, window)
        if out is not None:
            return out
    if len(batch.groups) == 1 and batch.groups[0].token_index is None:
        assert kv is not None
        return _group_attention(q, batch.groups[0], kv, layer, window)  # every token has cached context
    out = q.new_empty(q.shape)
    if batch.causal is not None:
        _causal_attention(q, k, v, batch.causal, out, window)
    for g in batch.groups:
        assert kv is not None and g.token_index is not None
        part = _group_attention(q.index_select(0, g.token_index), g, kv, layer, window)
        out.index_copy_(0, g.token_index, part)
    return out
