"""Elastic sequence parallelism (LoongServe), its exact core: one request's attention split over
key ranges that different instances hold, merged by the log-sum-exp rule.

Softmax attention over keys K = K_1 u ... u K_n splits exactly: with `o_i` the attention of a
query over K_i alone and `l_i` the log-sum-exp of its scaled scores there,

    o = sum_i exp(l_i - L) o_i,   L = log sum_i exp(l_i)

So each instance computes `partial_attention` over the keys it holds and returns `(o_i, l_i)`;
whoever holds the query merges (`merge`). Nothing else in a decoder layer mixes tokens, so:

- `sequence_parallel_prefill`: a prompt cut into slices, one per member of a group. Each member
  computes Q/K/V of its slice and keeps that slice's K/V in its own cache (the "proactive
  scale-down" of the paper: after the prefill the request's KV already sits where it will be
  decoded from, nothing moves). A member's queries attend to its own slice and to every earlier
  slice's K/V, which travel to it ring-style; the partials merge into the single instance's
  result.
- `distributed_decode_step`: a request whose KV is spread over several holders. The master runs
  the layer's token-local work; each holder attends the new query to the KV it holds; the master
  merges. The new token's K/V goes to the last holder with room; when none has room the caller
  adds a holder (scale-up during decode) and the old KV stays where it is.

This module runs the members in one process over their own caches (what the exactness tests
check against one instance's tokens); the data-plane exchange between instances and the global
manager's ESP scheduler build on it.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from services.worker.engine.kv_cache import KVCache, OutOfBlocks
from services.worker.model.llama import LlamaForCausalLM


@dataclass(frozen=True)
class Partial:
    """Attention of some queries over part of their keys: the output normalised over that part
    (`out [T, heads, d]`, float32; zero where no key of the part is visible) and the log-sum-exp
    of the scaled scores there (`lse [T, heads]`, -inf where none is visible)."""

    out: torch.Tensor
    lse: torch.Tensor


def partial_attention(
    q: torch.Tensor,
    q_pos: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    k_pos: torch.Tensor,
    window: int | None = None,
) -> Partial:
    """Queries `q [T, heads, d]` at absolute positions `q_pos [T]` over keys `k, v [S, kv_heads,
    d]` at positions `k_pos [S]`: a key is visible to a query at or after its position (and, with
    a `window`, fewer than `window` positions before it). Grouped-query heads share their KV head.
    Computed in float32."""
    t, heads, d = q.shape
    s, kv_heads, _ = k.shape
    if heads % kv_heads:
        raise ValueError(f"{heads} query heads do not group over {kv_heads} KV heads")
    g = heads // kv_heads
    qf = q.float().view(t, kv_heads, g, d).permute(1, 2, 0, 3)  # [KVH, G, T, d]
    kf = k.float().permute(1, 0, 2)  # [KVH, S, d]
    vf = v.float().permute(1, 0, 2)
    scores = torch.einsum("hgtd,hsd->hgts", qf, kf) * (1.0 / math.sqrt(d))
    visible = k_pos.view(1, -1) <= q_pos.view(-1, 1)  # [T, S]
    if window is not None:
        visible &= k_pos.view(1, -1) > q_pos.view(-1, 1) - window
    scores = scores.masked_fill(~visible, float("-inf"))
    lse = torch.logsumexp(scores, dim=-1)  # [KVH, G, T]
    probs = torch.exp(scores - lse.unsqueeze(-1).clamp(min=torch.finfo(torch.float32).min))
    probs = torch.nan_to_num(probs, nan=0.0)
    out = torch.einsum("hgts,hsd->hgtd", probs, vf)  # [KVH, G, T, d]
    return Partial(out.permute(2, 0, 1, 3).reshape(t, heads, d), lse.permute(2, 0, 1).reshape(t, heads))


def merge(parts: Sequence[Partial]) -> torch.Tensor:
    """The attention output over the union of the parts' keys, `[T, heads, d]` float32."""
    if not parts:
        raise ValueError("merge needs at least one partial result")
    lse = torch.stack([p.lse for p in parts])  # [n, T, H]
    top = lse.max(dim=0).values
    if torch.isneginf(top).any():
        raise ValueError("a query sees no key in any part (every query must see at least itself)")
    weights = torch.exp(lse - top)  # exp(-inf) = 0 for a part with no visible key
    out = sum(w.unsqueeze(-1) * p.out for w, p in zip(weights, parts, strict=True))
    assert isinstance(out, torch.Tensor)
    return out / weights.sum(dim=0).unsqueeze(-1)


@dataclass
class Shard:
    """The KV of positions [start, end) of one request, held in `cache` under `seq_id`."""

    cache: KVCache
    seq_id: str
    start: int
    end: int
    # The slots of all of the shard's tokens, for `kv`, kept while the shard does not grow (its
    # blocks only ever grow at the end, so a slot once known stays).
    _all_slots: tuple[int, torch.Tensor] | None = field(default=None, repr=False, compare=False)

    @property
    def num_tokens(self) -> int:
        return self.end - self.start

    def slots(self, first: int, count: int) -> torch.Tensor:
        """Flat cache slots of this shard's local token indices [first, first + count)."""
        table = torch.tensor(self.cache.block_table(self.seq_id), dtype=torch.long)
        local = torch.arange(first, first + count)
        bs = self.cache.block_size
        return (table[local // bs] * bs + local % bs).to(self.cache.device)

    def kv(self, layer: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """`k, v [n, kv_heads, d]` of the shard's tokens at `layer`, and their positions `[n]`."""
        k_cache, v_cache = self.cache.layer_cache(layer)
        if self._all_slots is None or self._all_slots[0] != self.num_tokens:
            self._all_slots = (self.num_tokens, self.slots(0, self.num_tokens))
        slots = self._all_slots[1]
        k = k_cache.view(-1, *k_cache.shape[2:]).index_select(0, slots)
        v = v_cache.view(-1, *v_cache.shape[2:]).index_select(0, slots)
        return k, v, torch.arange(self.start, self.end, device=k.device)


@dataclass
class Placement:
    """Where one request's KV lives: its shards in position order (contiguous, starting at 0)."""

    request_id: str
    shards: list[Shard] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return self.shards[-1].end if self.shards else 0

    def free(self) -> None:
        for s in self.shards:
            s.cache.free(s.seq_id)
        self.shards.clear()


def _layer_partials(
    model: LlamaForCausalLM, layer: int, q: torch.Tensor, q_pos: torch.Tensor, holders: Sequence[Shard]
) -> torch.Tensor:
    window = model.layer_window(layer)
    parts = []
    for shard in holders:
        k, v, pos = shard.kv(layer)
        parts.append(partial_attention(q, q_pos, k, v, pos, window))
    return merge(parts).to(q.dtype)


@torch.inference_mode()
def sequence_parallel_prefill(
    model: LlamaForCausalLM, caches: Sequence[KVCache], request_id: str, prompt: Sequence[int], bounds: Sequence[int]
) -> tuple[torch.Tensor, Placement]:
    """Prefill `prompt` over a group: member j (`caches[j]`) computes positions
    [bounds[j], bounds[j + 1]) and keeps their KV. Returns the float32 logits of the prompt's last
    token `[vocab]` and the request's KV placement (each member's slice, nothing moved).
    `bounds` starts at 0 and ends at len(prompt), strictly increasing, one slice per cache."""
    n = len(prompt)
    if len(bounds) != len(caches) + 1 or bounds[0] != 0 or bounds[-1] != n:
        raise ValueError(f"bounds {list(bounds)} must run from 0 to the prompt's {n} tokens, one slice per member")
    if any(a >= b for a, b in zip(bounds, bounds[1:], strict=False)):
        raise ValueError(f"bounds {list(bounds)} must be strictly increasing (no empty slice)")
    placement = Placement(request_id)
    try:
        for cache, a, b in zip(caches, bounds, bounds[1:], strict=False):
            cache.allocate(request_id, b - a)
            placement.shards.append(Shard(cache, request_id, a, b))
    except OutOfBlocks:
        placement.free()
        raise
    ids = torch.tensor(list(prompt), dtype=torch.long)
    slices = [(s.start, s.end) for s in placement.shards]
    positions = [torch.arange(a, b, device=model.device) for a, b in slices]
    hidden = [model.embed(ids[a:b]) for a, b in slices]
    rope = [model.rope_tables(p) for p in positions]
    for layer in range(model.config.num_hidden_layers):
        qs = []
        for j, shard in enumerate(placement.shards):
            q, k, v = model.attention_inputs(layer, hidden[j], *rope[j])
            shard.cache.write(layer, shard.slots(0, shard.num_tokens), k, v)
            qs.append(q)
        # Member j attends to its own slice and to slices 0..j-1 (their K/V passed round the ring).
        hidden = [
            model.finish_layer(
                layer, hidden[j], _layer_partials(model, layer, qs[j], positions[j], placement.shards[: j + 1])
            )
            for j in range(len(placement.shards))
        ]
    return model.head(hidden[-1][-1:])[0], placement


def _room_for_next(placement: Placement, caches: Sequence[KVCache]) -> Shard:
    """The shard the request's next token goes to: its last holder while that can hold one more
    token, else a new holder on the first of `caches` with a free block (scale-up during decode:
    the old KV stays where it is). OutOfBlocks when none can take it."""
    tail = placement.shards[-1]
    try:
        tail.cache.extend(tail.seq_id, tail.num_tokens + 1)
        return tail
    except OutOfBlocks:
        pass
    seq = f"{placement.request_id}@{len(placement.shards)}"
    for cache in caches:
        if cache is tail.cache:
            continue
        try:
            cache.allocate(seq, 1)
        except OutOfBlocks:
            continue
        shard = Shard(cache, seq, tail.end, tail.end)
        placement.shards.append(shard)
        return shard
    raise OutOfBlocks(f"no holder has a free block for request {placement.request_id!r}'s next token")


@torch.inference_mode()
def distributed_decode_step(
    model: LlamaForCausalLM, placement: Placement, token: int, caches: Sequence[KVCache] = ()
) -> torch.Tensor:
    """One decode step of a request whose KV `placement` spreads over several holders: `token`
    at the next position, its K/V appended to the last holder, or to a new one taken from
    `caches` when the last is full. Each holder attends the query to its own KV; the partial
    results merge. Returns the float32 logits `[vocab]`."""
    tail = _room_for_next(placement, caches)
    pos = placement.num_tokens
    tail.end += 1
    q_pos = torch.tensor([pos], device=model.device)
    hidden = model.embed(torch.tensor([token], dtype=torch.long))
    cos, sin_half = model.rope_tables(q_pos)
    for layer in range(model.config.num_hidden_layers):
        q, k, v = model.attention_inputs(layer, hidden, cos, sin_half)
        tail.cache.write(layer, tail.slots(tail.num_tokens - 1, 1), k, v)
        hidden = model.finish_layer(layer, hidden, _layer_partials(model, layer, q, q_pos, placement.shards))
    return model.head(hidden)[0]
