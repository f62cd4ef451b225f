"""Group checksums that keep up with a 5+ GB/s link and can be computed chunk by chunk.

A group's bytes are cut into 64 KiB blocks; each block gets a 64-bit digest, and the group
checksum is blake2b over the digest array and the group size, written `"<algo>:<hex>"`.
Because digests are per block, a receiver computes them as chunks land, in any order and off
the event loop, and the final hash touches only 1/8192 of the data.

Measured on the development machine (one core, 1 GiB, 4 MiB pieces):

| algo | GB/s |
| --- | --- |
| `blocksum64` (wrapping sum of uint64 words per block, numpy, GIL released) | 22 |
| `crc32` (zlib, per block) | 3.0 |
| adler32 / sha1 / blake2b / md5 over the bytes | 3.4 / 1.9 / 0.8 / 0.8 |

crc32 would take a whole core at 3 GB/s on every hop of a chain, on a machine with two, so the
default is `blocksum64`: it catches flipped or stale bytes, truncation and chunks landed at the
wrong offset (block order enters the final hash), but not two words swapped inside one block,
which no transfer bug here produces. `crc32` stays available for stronger checks.
"""

from __future__ import annotations

import hashlib
import zlib
from typing import Final, Literal

import numpy as np

__all__ = [
    "BLOCK_BYTES",
    "CHECKSUM_ALGOS",
    "ChecksumAlgo",
    "GroupDigests",
    "block_digests",
    "checksum_algo_of",
    "group_checksum",
]

BLOCK_BYTES: Final = 64 * 1024
ChecksumAlgo = Literal["blocksum64", "crc32"]
CHECKSUM_ALGOS: Final[tuple[str, ...]] = ("blocksum64", "crc32")
_WORDS_PER_BLOCK: Final = BLOCK_BYTES // 8


def _blocksum64(data: np.ndarray) -> np.ndarray:
    n_bytes = int(data.size)
    full = n_bytes // BLOCK_BYTES
    out = np.empty(-(-n_bytes // BLOCK_BYTES), dtype=np.uint64)
    if full:
        words = data[: full * BLOCK_BYTES].view(np.uint64).reshape(full, _WORDS_PER_BLOCK)
        words.sum(axis=1, dtype=np.uint64, out=out[:full])
    if out.size > full:
        tail = data[full * BLOCK_BYTES :]
        # Zero-pad the last partial block to whole words; it is smaller than one block.
        padded = np.zeros(-(-tail.size // 8) * 8, dtype=np.uint8)
        padded[: tail.size] = tail
        out[full] = padded.view(np.uint64).sum(dtype=np.uint64)
    return out


def _crc32_blocks(data: np.ndarray) -> np.ndarray:
    mv = data.data  # a memoryview, without a copy
    return np.fromiter(
        (zlib.crc32(mv[i : i + BLOCK_BYTES]) for i in range(0, data.size, BLOCK_BYTES)),
        dtype=np.uint64,
        count=-(-data.size // BLOCK_BYTES),
    )


def block_digests(data: np.ndarray, algo: str) -> np.ndarray:
    """Digest of each 64 KiB block of `data` (a flat uint8 array starting on a block boundary)."""
    if algo == "blocksum64":
        return _blocksum64(data)
    if algo == "crc32":
        return _crc32_blocks(data)
    raise ValueError(f"unknown checksum algo {algo!r}, known: {list(CHECKSUM_ALGOS)}")


def _finish(algo: str, digests: np.ndarray, size_bytes: int) -> str:
    h = hashlib.blake2b(digest_size=16)
    h.update(digests.astype("<u8", copy=False).tobytes())
    h.update(size_bytes.to_bytes(8, "little"))
    return f"{algo}:{h.hexdigest()}"


def group_checksum(data: np.ndarray, algo: str = "blocksum64") -> str:
    """Checksum of a whole group buffer (flat uint8)."""
    return _finish(algo, block_digests(data, algo), int(data.size))


def checksum_algo_of(checksum: str) -> str:
    """The algo named in a `"<algo>:<hex>"` checksum; ValueError quoting it if malformed."""
    algo, sep, hexpart = checksum.partition(":")
    if not sep or algo not in CHECKSUM_ALGOS or len(hexpart) != 32:
        raise ValueError(f"malformed checksum {checksum!r}, want '<algo>:<32 hex>' with algo in {list(CHECKSUM_ALGOS)}")
    try:
        int(hexpart, 16)
    except ValueError:
        raise ValueError(f"malformed checksum {checksum!r}: not hex") from None
    return algo


class GroupDigests:
    """Per-block digests of one group, filled chunk by chunk as chunks land."""

    def __init__(self, size_bytes: int, algo: str) -> None:
        if algo not in CHECKSUM_ALGOS:
            raise ValueError(f"unknown checksum algo {algo!r}, known: {list(CHECKSUM_ALGOS)}")
        self.size_bytes = size_bytes
        self.algo = algo
        self._digests = np.zeros(-(-size_bytes // BLOCK_BYTES), dtype=np.uint64)

    def add(self, offset_bytes: int, data: np.ndarray) -> None:
        """Digest the chunk `data` that sits at `offset_bytes` (a block boundary) in the group.

        Thread-safe for disjoint chunks: each writes its own slice of the digest array.
        """
        if offset_bytes % BLOCK_BYTES:
            raise ValueError(f"chunk offset {offset_bytes} is not a multiple of {BLOCK_BYTES}")
        first = offset_bytes // BLOCK_BYTES
        d = block_digests(data, self.algo)
        self._digests[first : first + d.size] = d

    def checksum(self) -> str:
        return _finish(self.algo, self._digests, self.size_bytes)
