"""Paged KV cache: fixed-size blocks of K/V storage per layer, a free-list allocator and block tables.

A sequence's tokens live in whichever blocks it was given, in block-table order, so memory is
handed out in `block_size` steps and returned the moment a sequence ends.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from services.model_format.config import LlamaConfig


class OutOfBlocks(RuntimeError):
    """The allocator has fewer free blocks than a request asked for."""


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
        # LIFO free list: a just-freed block is handed out first (warm in cache).
        self._free: list[int] = list(range(num_blocks - 1, -1, -1))
        self._tables: dict[str, list[int]] = {}
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
        return len(self._free)

    @property
    def used_blocks(self) -> int:
        return self.num_blocks - len(self._free)

    def blocks_needed(self, num_tokens: int) -> int:
        """Blocks that hold `num_tokens` tokens."""
        if num_tokens < 0:
            raise ValueError(f"num_tokens must be >= 0, got {num_tokens}")
        return -(-num_tokens // self._block_size)

    def has(self, seq_id: str) -> bool:
        return seq_id in self._tables

    def num_blocks_of(self, seq_id: str) -> int:
        """Blocks `seq_id` holds (0 if none)."""
        return len(self._tables.get(seq_id, ()))

    def block_table(self, seq_id: str) -> list[int]:
        """The blocks of `seq_id`, in token order (a copy)."""
        try:
            return list(self._tables[seq_id])
        except KeyError:
            raise KeyError(f"sequence {seq_id!r} has no blocks") from None

    def _take(self, n: int, seq_id: str) -> list[int]:
        if n > len(self._free):
            raise OutOfBlocks(
                f"sequence {seq_id!r} needs {n} more blocks, {len(self._free)} of {self.num_blocks} are free"
            )
        taken = self._free[len(self._free) - n :][::-1]
        del self._free[len(self._free) - n :]
        return taken

    def allocate(self, seq_id: str, num_tokens: int) -> list[int]:
        """Give a new sequence the blocks for `num_tokens` tokens; returns its block table."""
        if seq_id in self._tables:
            raise ValueError(f"sequence {seq_id!r} already has blocks")
        self._tables[seq_id] = self._take(self.blocks_needed(num_tokens), seq_id)
        return list(self._tables[seq_id])

    def extend(self, seq_id: str, num_tokens: int) -> list[int]:
        """Grow `seq_id`'s table to hold `num_tokens` tokens in all; returns the blocks added."""
        table = self._tables.get(seq_id)
        if table is None:
            raise KeyError(f"sequence {seq_id!r} has no blocks")
        missing = self.blocks_needed(num_tokens) - len(table)
        if missing <= 0:
            return []
        added = self._take(missing, seq_id)
        table.extend(added)
        return added

    def rename(self, seq_id: str, new_id: str) -> None:
        """Hand `seq_id`'s blocks, unchanged, to `new_id` (e.g. KV parked for a hand-off, so the
        request's id is free to run again while the blocks are still being sent)."""
        if new_id in self._tables:
            raise ValueError(f"sequence {new_id!r} already has blocks")
        try:
            self._tables[new_id] = self._tables.pop(seq_id)
        except KeyError:
            raise KeyError(f"sequence {seq_id!r} has no blocks") from None

    def free(self, seq_id: str) -> int:
        """Return all of `seq_id`'s blocks to the pool (reusable at once); 0 if it had none."""
        table = self._tables.pop(seq_id, None)
        if not table:
            return 0
        self._free.extend(reversed(table))
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
