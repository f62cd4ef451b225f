"""Paged KV cache: fixed-size blocks of K/V storage per layer, a reference-counted allocator with a
prefix cache, and block tables.

A sequence's tokens live in whichever blocks it was given, in block-table order, so memory is
handed out in `block_size` steps and returned the moment a sequence ends. A full block whose KV
is computed can be registered under its chained hash (`services.common.prefix`); it is then
shared, read-only, by later sequences that start with the same tokens (`match_prefix`, then
`allocate(..., prefix_blocks=...)`), and when no sequence holds it any more it stays cached
until the pool runs out of never-cached blocks and evicts it, least recently freed first
(vLLM's automatic prefix caching).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from services.common.prefix import ROOT_HASH, chain_hash
from services.model_format.config import LlamaConfig


class OutOfBlocks(RuntimeError):
    """The allocator has fewer free blocks than a request asked for."""


@dataclass(frozen=True, slots=True)
class _Cached:
    """A registered block: where its KV is and what it was computed from. The parent hash and
    tokens are compared on every match, so a 64-bit hash collision cannot hand out wrong KV."""

    block: int
    parent: int
    tokens: tuple[int, ...]


class KVCache:
    """K/V storage `[num_blocks, block_size, kv_heads, head_dim]` per layer plus its allocator.

    Covers decoder layers [first_layer, first_layer + num_layers): a worker that runs only part of
    the model keeps KV for its own layers only. Not thread-safe: the allocator is driven from the
    engine loop; the storage is written by the compute thread, for blocks the loop has handed out.
    """

    def __init__(
        self,
        *,
        num_layers: int,
        num_blocks: int,
        block_size: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
        first_layer: int = 0,
    ) -> None:
        for name, value in (
            ("num_layers", num_layers),
            ("num_blocks", num_blocks),
            ("block_size", block_size),
            ("num_kv_heads", num_kv_heads),
            ("head_dim", head_dim),
        ):
            if not isinstance(value, int) or value <= 0:
                raise ValueError(f"KVCache {name} must be a positive int, got {value!r}")
        if first_layer < 0:
            raise ValueError(f"KVCache first_layer must be >= 0, got {first_layer}")
        self._block_size = block_size
        self.num_blocks = num_blocks
        self.first_layer = first_layer
        self.num_layers = num_layers
        shape = (num_layers, num_blocks, block_size, num_kv_heads, head_dim)
        # Zeros, not empty: padded attention reads unused slots (masked out), and 0 * NaN garbage
        # would still poison the output.
        self._k = torch.zeros(shape, dtype=dtype, device=device)
        self._v = torch.zeros(shape, dtype=dtype, device=device)
        # LIFO free list of blocks that cache nothing: a just-freed block is handed out first
        # (warm in cache). Blocks that cache a prefix wait in `_evictable` instead, and are only
        # reused once this list is empty.
        self._free: list[int] = list(range(num_blocks - 1, -1, -1))
        self._tables: dict[str, list[int]] = {}
        # Sequences holding each block: > 1 only for shared (registered, full, read-only) blocks.
        self._refs: list[int] = [0] * num_blocks
        self._cached: dict[int, _Cached] = {}  # chained hash -> registered block
        self._hash_of: dict[int, int] = {}  # registered block -> its hash
        # Registered blocks no sequence holds, least recently freed first: the eviction order.
        self._evictable: OrderedDict[int, None] = OrderedDict()
        # Reused destination of `gather`: a fresh multi-MB tensor per layer per step costs page
        # faults that took as long as the copy itself. Grows to the largest gather seen.
        self._scratch_k = torch.empty(0, dtype=dtype, device=device)
        self._scratch_v = torch.empty(0, dtype=dtype, device=device)

    @classmethod
    def for_model(
        cls,
        cfg: LlamaConfig,
        *,
        num_blocks: int,
        block_size: int = 16,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
        layers: tuple[int, int] | None = None,
    ) -> KVCache:
        """A cache shaped for `cfg` (all layers, or the range `layers=(start, end)`)."""
        start, end = layers if layers is not None else (0, cfg.num_hidden_layers)
        if not 0 <= start < end <= cfg.num_hidden_layers:
            raise ValueError(f"KVCache layer range {layers!r} outside [0, {cfg.num_hidden_layers})")
        return cls(
            num_layers=end - start,
            num_blocks=num_blocks,
            block_size=block_size,
            num_kv_heads=cfg.num_key_value_heads,
            head_dim=cfg.head_dim,
            dtype=dtype,
            device=device,
            first_layer=start,
        )

    @staticmethod
    def blocks_for_budget(
        cfg: LlamaConfig, budget_bytes: int, block_size: int = 16, dtype: torch.dtype = torch.float32
    ) -> int:
        """How many blocks of all layers fit in `budget_bytes`."""
        per_block = cfg.kv_bytes_per_token(dtype) * block_size
        return int(budget_bytes) // per_block

    @classmethod
    def from_memory_budget(
        cls,
        cfg: LlamaConfig,
        budget_bytes: int,
        *,
        block_size: int = 16,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
    ) -> KVCache:
        """As many blocks as `budget_bytes` holds; ValueError if not even one fits."""
        num_blocks = cls.blocks_for_budget(cfg, budget_bytes, block_size, dtype)
        if num_blocks < 1:
            raise ValueError(
                f"KV budget of {budget_bytes} bytes holds no block of {block_size} tokens "
                f"({cfg.kv_bytes_per_token(dtype) * block_size} bytes each)"
            )
        return cls.for_model(cfg, num_blocks=num_blocks, block_size=block_size, dtype=dtype, device=device)

    # ---- storage ------------------------------------------------------------------------------

    @property
    def block_size(self) -> int:
        return self._block_size

    @property
    def num_kv_heads(self) -> int:
        return int(self._k.shape[3])

    @property
    def head_dim(self) -> int:
        return int(self._k.shape[4])

    @property
    def dtype(self) -> torch.dtype:
        return self._k.dtype

    @property
    def device(self) -> torch.device:
        return self._k.device

    @property
    def layers(self) -> tuple[int, int]:
        """The decoder layers cached here, as a range [start, end)."""
        return self.first_layer, self.first_layer + self.num_layers

    @property
    def block_bytes(self) -> int:
        """Bytes of one block of K (or of V) of one layer."""
        return self._block_size * self.num_kv_heads * self.head_dim * self._k.element_size()

    def storage(self) -> tuple[torch.Tensor, torch.Tensor]:
        """All of K and all of V, `[num_layers, num_blocks, block_size, kv_heads, head_dim]` each
        (contiguous): block `b` of layer `first_layer + i` starts at byte `(i * num_blocks + b) * block_bytes`."""
        return self._k, self._v

    def block_run(self, layer: int, first_block: int, num_blocks: int) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V of blocks [first_block, first_block + num_blocks) of `layer`: contiguous views of the
        storage, `[num_blocks, block_size, kv_heads, head_dim]` each (what a transfer sends or lands in)."""
        if num_blocks < 1 or first_block < 0 or first_block + num_blocks > self.num_blocks:
            raise IndexError(
                f"block run [{first_block}, {first_block + num_blocks}) outside the pool of {self.num_blocks} blocks"
            )
        k_cache, v_cache = self.layer_cache(layer)
        return k_cache[first_block : first_block + num_blocks], v_cache[first_block : first_block + num_blocks]

    @property
    def nbytes(self) -> int:
        """Bytes of K and V storage."""
        return self._k.numel() * self._k.element_size() * 2

    @property
    def capacity_tokens(self) -> int:
        """Tokens the whole pool holds."""
        return self.num_blocks * self._block_size

    def layer_cache(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V of absolute decoder layer `layer`, each `[num_blocks, block_size, kv_heads, head_dim]`."""
        i = layer - self.first_layer
        if not 0 <= i < self.num_layers:
            raise IndexError(
                f"layer {layer} is not cached here "
                f"(layers {self.first_layer}..{self.first_layer + self.num_layers - 1})"
            )
        return self._k[i], self._v[i]

    def write(self, layer: int, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """Store `k, v [T, kv_heads, head_dim]` of `layer` at flat slots `slots [T]`
        (slot = block * block_size + offset)."""
        k_cache, v_cache = self.layer_cache(layer)
        k_cache.view(-1, *k_cache.shape[2:]).index_copy_(0, slots, k)
        v_cache.view(-1, *v_cache.shape[2:]).index_copy_(0, slots, v)

    def gather(self, layer: int, blocks: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V of `blocks [N]` of `layer`, each `[N, block_size, kv_heads, head_dim]`.

        Returned tensors are views of scratch buffers, overwritten by the next call.
        """
        k_cache, v_cache = self.layer_cache(layer)
        shape = (int(blocks.shape[0]), *k_cache.shape[1:])
        numel = int(torch.Size(shape).numel())
        if self._scratch_k.numel() < numel:
            self._scratch_k = torch.empty(numel, dtype=k_cache.dtype, device=k_cache.device)
            self._scratch_v = torch.empty(numel, dtype=v_cache.dtype, device=v_cache.device)
        k_out = self._scratch_k[:numel].view(shape)
        v_out = self._scratch_v[:numel].view(shape)
        torch.index_select(k_cache, 0, blocks, out=k_out)
        torch.index_select(v_cache, 0, blocks, out=v_out)
        return k_out, v_out

    # ---- allocator ----------------------------------------------------------------------------

    @property
    def total_blocks(self) -> int:
        return self.num_blocks

    @property
    def free_blocks(self) -> int:
        """Blocks a sequence can be given now: never-cached ones plus cached ones no sequence
        holds (evicted when taken)."""
        return len(self._free) + len(self._evictable)

    @property
    def used_blocks(self) -> int:
        """Blocks held by at least one sequence."""
        return self.num_blocks - self.free_blocks

    @property
    def cached_blocks(self) -> int:
        """Blocks registered in the prefix cache, held by a sequence or evictable."""
        return len(self._cached)

    @property
    def evictable_blocks(self) -> int:
        """Registered blocks no sequence holds (counted in `free_blocks`)."""
        return len(self._evictable)

    def ref_count(self, block: int) -> int:
        """Sequences holding `block`."""
        return self._refs[block]

    def block_hash(self, block: int) -> int | None:
        """The hash `block` is registered under, None if it caches nothing."""
        return self._hash_of.get(block)

    def blocks_needed(self, num_tokens: int) -> int:
        """Blocks that hold `num_tokens` tokens."""
        if num_tokens < 0:
            raise ValueError(f"num_tokens must be >= 0, got {num_tokens}")
        return -(-num_tokens // self._block_size)

    def has(self, seq_id: str) -> bool:
        return seq_id in self._tables

    def num_blocks_of(self, seq_id: str) -> int:
        """Blocks `seq_id` holds (0 if none), shared ones included."""
        return len(self._tables.get(seq_id, ()))

    def block_table(self, seq_id: str) -> list[int]:
        """The blocks of `seq_id`, in token order (a copy)."""
        try:
            return list(self._tables[seq_id])
        except KeyError:
            raise KeyError(f"sequence {seq_id!r} has no blocks") from None

    def _take(self, n: int, seq_id: str) -> list[int]:
        if n > self.free_blocks:
            raise OutOfBlocks(
                f"sequence {seq_id!r} needs {n} more blocks, {self.free_blocks} of {self.num_blocks} are free"
            )
        k = min(n, len(self._free))
        taken = self._free[len(self._free) - k :][::-1]
        del self._free[len(self._free) - k :]
        for _ in range(n - k):
            block, _none = self._evictable.popitem(last=False)
            del self._cached[self._hash_of.pop(block)]
            taken.append(block)
        for block in taken:
            self._refs[block] = 1
        return taken

    def allocate(self, seq_id: str, num_tokens: int, *, prefix_blocks: Sequence[int] = ()) -> list[int]:
        """Give a new sequence the blocks for `num_tokens` tokens; returns its block table.

        `prefix_blocks` (from `match_prefix`) start the table: cached blocks whose KV the
        sequence reads as its first tokens instead of computing them. They are shared and must
        never be written; the blocks after them are the sequence's own."""
        if seq_id in self._tables:
            raise ValueError(f"sequence {seq_id!r} already has blocks")
        shared = list(prefix_blocks)
        for block in shared:
            if block not in self._hash_of:
                raise ValueError(f"sequence {seq_id!r}: block {block} caches no prefix and cannot be shared")
        if len(set(shared)) != len(shared):
            raise ValueError(f"sequence {seq_id!r}: prefix blocks {shared!r} repeat a block")
        missing = max(0, self.blocks_needed(num_tokens) - len(shared))
        # Acquire the prefix first: taking fresh blocks must not evict one of them.
        for block in shared:
            if self._refs[block] == 0:
                del self._evictable[block]
            self._refs[block] += 1
        try:
            added = self._take(missing, seq_id)
        except OutOfBlocks:
            self._release(shared)
            raise
        self._tables[seq_id] = shared + added
        return list(self._tables[seq_id])

    def extend(self, seq_id: str, num_tokens: int) -> list[int]:
        """Grow `seq_id`'s table to hold `num_tokens` tokens in all; returns the blocks added
        (always fresh ones, held by `seq_id` alone)."""
        table = self._tables.get(seq_id)
        if table is None:
            raise KeyError(f"sequence {seq_id!r} has no blocks")
        missing = self.blocks_needed(num_tokens) - len(table)
        if missing <= 0:
            return []
        added = self._take(missing, seq_id)
        table.extend(added)
        return added

    def check_writable(self, seq_id: str, start_token: int) -> None:
        """Raise RuntimeError unless every block of `seq_id` from token `start_token` on is its
        own and caches nothing: what a step is about to write must not be KV others read."""
        table = self._tables.get(seq_id, [])
        for block in table[start_token // self._block_size :]:
            if self._refs[block] != 1 or block in self._hash_of:
                raise RuntimeError(
                    f"sequence {seq_id!r} would write token {start_token}+ into block {block}, which is shared "
                    f"(held by {self._refs[block]}, hash {self._hash_of.get(block)})"
                )

    def rename(self, seq_id: str, new_id: str) -> None:
        """Hand `seq_id`'s blocks, unchanged, to `new_id` (e.g. KV parked for a hand-off, so the
        request's id is free to run again while the blocks are still being sent). Shared blocks
        stay shared: the holder changes its name, not its count."""
        if new_id in self._tables:
            raise ValueError(f"sequence {new_id!r} already has blocks")
        try:
            self._tables[new_id] = self._tables.pop(seq_id)
        except KeyError:
            raise KeyError(f"sequence {seq_id!r} has no blocks") from None

    def _release(self, blocks: Sequence[int]) -> None:
        # Last block first: of one sequence's cached blocks the later ones are evicted first, as
        # a chain is only matched up to its first missing block.
        for block in reversed(blocks):
            self._refs[block] -= 1
            if self._refs[block] > 0:
                continue
            if block in self._hash_of:
                self._evictable[block] = None
            else:
                self._free.append(block)

    def free(self, seq_id: str) -> int:
        """Drop `seq_id`'s hold on its blocks; those no other sequence holds are free at once
        (cached ones stay matchable until evicted). Returns the blocks it held, 0 if none."""
        table = self._tables.pop(seq_id, None)
        if not table:
            return 0
        self._release(table)
        return len(table)

    def sequences(self) -> Sequence[str]:
        """Ids of sequences holding blocks."""
        return list(self._tables)

    # ---- swapping (preemption to host memory) ---------------------------------------------------

    def copy_out(
        self, seq_id: str, num_tokens: int, device: torch.device | str = "cpu"
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Copies of the K and V of `seq_id`'s first `num_tokens` tokens (whole blocks), every
        layer cached here: `[num_layers, blocks, block_size, kv_heads, head_dim]` each, on
        `device` (host memory by default). The sequence keeps its blocks; free them after."""
        table = self._tables.get(seq_id)
        if table is None:
            raise KeyError(f"sequence {seq_id!r} has no blocks")
        n = self.blocks_needed(num_tokens)
        if n > len(table):
            raise ValueError(f"sequence {seq_id!r} holds {len(table)} blocks, {num_tokens} tokens need {n}")
        index = torch.tensor(table[:n], dtype=torch.long, device=self._k.device)
        # index_select copies, so the result never aliases the pool, even on the same device.
        return self._k.index_select(1, index).to(device), self._v.index_select(1, index).to(device)

    def copy_in(self, seq_id: str, k: torch.Tensor, v: torch.Tensor) -> list[int]:
        """Give the new sequence `seq_id` fresh blocks holding `k, v` as `copy_out` returned them;
        returns its block table (OutOfBlocks if the pool lacks them)."""
        expected = (self.num_layers, self.num_kv_heads, self.head_dim, self._block_size)
        for name, t in (("k", k), ("v", v)):
            if t.dim() != 5 or (t.shape[0], t.shape[3], t.shape[4], t.shape[2]) != expected:
                raise ValueError(
                    f"copy_in {name} of shape {tuple(t.shape)} does not fit a pool of [layers, blocks, block_size,"
                    f" kv_heads, head_dim] = [{self.num_layers}, *, {self._block_size}, {self.num_kv_heads},"
                    f" {self.head_dim}]"
                )
        if k.shape != v.shape:
            raise ValueError(f"copy_in k {tuple(k.shape)} and v {tuple(v.shape)} differ")
        table = self.allocate(seq_id, int(k.shape[1]) * self._block_size)
        index = torch.tensor(table, dtype=torch.long, device=self._k.device)
        self._k.index_copy_(1, index, k.to(device=self._k.device, dtype=self._k.dtype))
        self._v.index_copy_(1, index, v.to(device=self._v.device, dtype=self._v.dtype))
        return table

    # ---- prefix cache -------------------------------------------------------------------------

    def match_prefix(self, token_ids: Sequence[int], hashes: Sequence[int] | None = None) -> list[int]:
        """The cached blocks holding the KV of `token_ids`' longest prefix of full blocks, in
        order (the caller caps `token_ids` at what it may skip). `hashes`: the chained hashes of
        those blocks if already known (`services.common.prefix.block_hashes`), else computed."""
        bs = self._block_size
        blocks: list[int] = []
        parent = ROOT_HASH
        for i in range(len(token_ids) // bs):
            tokens = tuple(token_ids[i * bs : (i + 1) * bs])
            h = hashes[i] if hashes is not None and i < len(hashes) else chain_hash(parent, tokens)
            entry = self._cached.get(h)
            if entry is None or entry.parent != parent or entry.tokens != tokens:
                break
            blocks.append(entry.block)
            parent = h
        return blocks

    def register(self, seq_id: str, start: int, hashes: Sequence[int], token_ids: Sequence[int]) -> int:
        """Cache blocks [start, len(hashes)) of `seq_id`'s table, whose KV is computed.

        `hashes` are the chained hashes of the sequence's full blocks from its first (those
        before `start` give the parent); `token_ids` are the tokens of blocks [start,
        len(hashes)) only. A block already cached, or whose hash another block holds (the same
        prefix computed by two sequences at once), is left as it is. Returns how many blocks
        were registered."""
        table = self._tables.get(seq_id)
        if table is None:
            raise KeyError(f"sequence {seq_id!r} has no blocks")
        bs = self._block_size
        if not 0 <= start <= len(hashes) <= len(table) or len(token_ids) != (len(hashes) - start) * bs:
            raise ValueError(
                f"sequence {seq_id!r}: blocks [{start}, {len(hashes)}) of a table of {len(table)} "
                f"with {len(token_ids)} tokens"
            )
        added = 0
        for i in range(start, len(hashes)):
            block, h = table[i], hashes[i]
            if block in self._hash_of or h in self._cached:
                continue
            parent = hashes[i - 1] if i > 0 else ROOT_HASH
            j = (i - start) * bs
            self._cached[h] = _Cached(block, parent, tuple(token_ids[j : j + bs]))
            self._hash_of[block] = h
            added += 1
        return added
