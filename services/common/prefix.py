"""Chained hashes of a token sequence's full KV blocks: the keys of the worker's prefix cache and of
the manager's prefix-affinity routing, so both must compute them identically in every process.

Block i's hash covers block i's token ids and, through its parent (block i-1's hash), every token
before it: two sequences share block i's hash only if they share their first (i + 1) blocks. The
hash is BLAKE2b with an 8-byte digest (an unsigned 64-bit int, a protobuf uint64), never Python's
`hash()`, which is salted per process.
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Sequence

__all__ = ["ROOT_HASH", "block_hashes", "chain_hash"]

#: The parent hash of a sequence's first block.
ROOT_HASH = 0

_MAX_TOKEN_ID = 0xFFFF_FFFF


def chain_hash(parent: int, token_ids: Sequence[int]) -> int:
    """The hash of one block: its parent's hash (the previous block's, or ROOT_HASH) and its
    token ids, as 8 + 4 * len(token_ids) little-endian bytes."""
    try:
        data = struct.pack(f"<Q{len(token_ids)}I", parent, *token_ids)
    except struct.error:
        bad = [t for t in token_ids if not isinstance(t, int) or not 0 <= t <= _MAX_TOKEN_ID]
        raise ValueError(
            f"a block hash needs a parent in [0, 2**64) and token ids in [0, 2**32): parent {parent!r}, "
            f"tokens {bad[:5]!r}"
        ) from None
    return int.from_bytes(hashlib.blake2b(data, digest_size=8).digest(), "little")


def block_hashes(token_ids: Sequence[int], block_size: int, *, max_blocks: int | None = None) -> list[int]:
    """The chained hashes of `token_ids`' full blocks of `block_size` tokens, in order (a
    trailing partial block has none), at most `max_blocks` of them."""
    if block_size <= 0:
        raise ValueError(f"block_size must be > 0, got {block_size!r}")
    if max_blocks is not None and max_blocks < 0:
        raise ValueError(f"max_blocks must be >= 0, got {max_blocks!r}")
    n = len(token_ids) // block_size
    if max_blocks is not None:
        n = min(n, max_blocks)
    hashes: list[int] = []
    parent = ROOT_HASH
    for i in range(n):
        parent = chain_hash(parent, token_ids[i * block_size : (i + 1) * block_size])
        hashes.append(parent)
    return hashes
