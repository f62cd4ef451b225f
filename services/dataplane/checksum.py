"""Checksums of parameter groups and KV blocks, computed chunk by chunk as the bytes land.

A buffer is cut into 64 KiB blocks; each block gets a 64-bit digest from a library hash, and
the checksum is blake2b over the digest array and the size, written `"<algo>:<hex>"`. Because
digests are per block, a receiver computes them as chunks land, in any order, and the final
hash touches only 1/8192 of the data. Every user (manifests, the parameter manager, the KV
transfer) takes `DEFAULT_CHECKSUM_ALGO` unless told otherwise; a checksum names its algo, so one
made with any algo below (blocksum64 and crc32 were the only ones before xxh3) still verifies.

Measured on the development machine (2 cores, AMD EPYC with AVX-512; `bench.checksums` in
`python -m bench.dataplane`): one core digesting 256 MiB of random bytes in 16 MiB chunks
through `GroupDigests.add` (cold: larger than the cache), best of 3; the checked one-hop pull
of a 256 MiB model over UCX (16 MiB chunks, 6 interleaved rounds, median; the transport alone
moved the same bytes at 16.4 GB/s, the pull with the digest step skipped at about 10):

| algo | library | GB/s, one core | holds the GIL | checked pull GB/s (inline / thread) |
| --- | --- | --- | --- | --- |
| `xxh3` (default) | xxhash `xxh3_64` per block | 18-19 | yes (xxhash releases it above 64 KiB only) | 6.6 / 5.2 |
| `crc32c` | google-crc32c per block | 11-13 | yes (released for `bytes` >= 1 MiB only) | 4.8 / 4.3 |
| `blocksum64` | hand-written: wrapping uint64 sum per block (numpy) | 27-28 | no | 6.7 / 5.3 |
| `crc32` | zlib per block | 4.5-6.3 | no | (not run: slowest) |

The pull is bound by memory and the two cores, not by the hash: the digest is a second pass
over bytes the transport just copied, and it costs the same with xxh3 as with blocksum64
(within run-to-run noise), 25-30% more with crc32c. So the default is `xxh3`: a maintained
library hash, as fast in the pull as the hand-written sum, and a real hash, where blocksum64
misses two words swapped inside a block. Digests of an algo that holds the GIL are computed on
the receiving loop (see chain.py): a thread could not run beside it, and inline the chunk is
still in cache (the "inline" column against "thread").
"""

from __future__ import annotations

import hashlib
import zlib
from collections.abc import Callable
from typing import Any, Final, Literal

import google_crc32c
import numpy as np
import xxhash

from .buffers import as_uint8_array

__all__ = [
    "BLOCK_BYTES",
    "CHECKSUM_ALGOS",
    "DEFAULT_CHECKSUM_ALGO",
    "ChecksumAlgo",
    "GroupDigests",
    "block_digests",
    "checksum_algo_of",
    "group_checksum",
    "releases_gil",
]

BLOCK_BYTES: Final = 64 * 1024
ChecksumAlgo = Literal["xxh3", "crc32c", "blocksum64", "crc32"]
_WORDS_PER_BLOCK: Final = BLOCK_BYTES // 8
_HEX_CHARS: Final = 32


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


def _per_block(hash_block: Callable[[np.ndarray], int]) -> Callable[[np.ndarray], np.ndarray]:
    """Digests of every block by a library function of one block's bytes (an int < 2**64)."""

    def digests(data: np.ndarray) -> np.ndarray:
        # numpy slices, not memoryview ones: google_crc32c takes only buffers without a
        # release hook ("y#"), which a memoryview has and an ndarray does not.
        blocks = [data[i : i + BLOCK_BYTES] for i in range(0, int(data.size), BLOCK_BYTES)]
        return np.fromiter(map(hash_block, blocks), dtype=np.uint64, count=len(blocks))

    return digests


_BLOCK_DIGESTS: Final[dict[str, Callable[[np.ndarray], np.ndarray]]] = {
    "xxh3": _per_block(xxhash.xxh3_64_intdigest),
    "crc32c": _per_block(google_crc32c.value),
    "blocksum64": _blocksum64,
    "crc32": _per_block(zlib.crc32),
}
CHECKSUM_ALGOS: Final[tuple[str, ...]] = tuple(_BLOCK_DIGESTS)
DEFAULT_CHECKSUM_ALGO: Final[ChecksumAlgo] = "xxh3"
# Algos whose block digests run with the GIL released: numpy's reduction, and zlib above 5 KiB.
# xxhash releases it only above 64 KiB and google_crc32c only for `bytes` of 1 MiB or more, so
# one block at a time they hold it (a thread beside them waits ~5 ms, measured).
_RELEASES_GIL: Final = frozenset({"blocksum64", "crc32"})


def _check_algo(algo: str) -> None:
    if algo not in _BLOCK_DIGESTS:
        raise ValueError(f"unknown checksum algo {algo!r}, known: {list(CHECKSUM_ALGOS)}")


def releases_gil(algo: str) -> bool:
    """Whether digesting with `algo` lets other threads run: only then is a thread worth it."""
    _check_algo(algo)
    return algo in _RELEASES_GIL


def block_digests(data: Any, algo: str = DEFAULT_CHECKSUM_ALGO) -> np.ndarray:
    """Digest of each 64 KiB block of `data` (contiguous bytes: numpy, torch CPU tensor,
    memoryview), which starts on a block boundary of the buffer it is part of."""
    _check_algo(algo)
    return _BLOCK_DIGESTS[algo](as_uint8_array(data, writable=False))


def _finish(algo: str, digests: np.ndarray, size_bytes: int) -> str:
    h = hashlib.blake2b(digest_size=_HEX_CHARS // 2)
    h.update(digests.astype("<u8", copy=False).tobytes())
    h.update(size_bytes.to_bytes(8, "little"))
    return f"{algo}:{h.hexdigest()}"


def group_checksum(data: Any, algo: str = DEFAULT_CHECKSUM_ALGO) -> str:
    """Checksum of a whole buffer (a parameter group, a run of KV blocks), as `"<algo>:<hex>"`."""
    arr = as_uint8_array(data, writable=False)
    return _finish(algo, block_digests(arr, algo), int(arr.size))


def checksum_algo_of(checksum: str) -> str:
    """The algo named in a `"<algo>:<hex>"` checksum; ValueError quoting it if malformed."""
    algo, sep, hexpart = checksum.partition(":")
    if not sep or len(hexpart) != _HEX_CHARS:
        raise ValueError(f"malformed checksum {checksum!r}, want '<algo>:<32 hex>' with algo in {list(CHECKSUM_ALGOS)}")
    if algo not in _BLOCK_DIGESTS:
        raise ValueError(f"unknown checksum algo {algo!r} in checksum {checksum!r}, known: {list(CHECKSUM_ALGOS)}")
    try:
        int(hexpart, 16)
    except ValueError:
        raise ValueError(f"malformed checksum {checksum!r}: not hex") from None
    return algo


class GroupDigests:
    """Per-block digests of one buffer of `size_bytes`, filled chunk by chunk as chunks land."""

    def __init__(self, size_bytes: int, algo: str = DEFAULT_CHECKSUM_ALGO) -> None:
        _check_algo(algo)
        if size_bytes < 0:
            raise ValueError(f"size_bytes must be >= 0, got {size_bytes}")
        self.size_bytes = size_bytes
        self.algo = algo
        self._digests = np.zeros(-(-size_bytes // BLOCK_BYTES), dtype=np.uint64)

    def add(self, offset_bytes: int, data: Any) -> None:
        """Digest the chunk `data` that sits at `offset_bytes` (a block boundary) in the buffer.

        A chunk is whole blocks, except the buffer's last one. Thread-safe for disjoint
        chunks: each writes its own slice of the digest array.
        """
        arr = as_uint8_array(data, writable=False)
        end = offset_bytes + int(arr.size)
        if offset_bytes % BLOCK_BYTES or offset_bytes < 0:
            raise ValueError(f"chunk offset {offset_bytes} is not a non-negative multiple of {BLOCK_BYTES}")
        if end > self.size_bytes or (arr.size % BLOCK_BYTES and end != self.size_bytes):
            raise ValueError(
                f"chunk [{offset_bytes}, {end}) of a {self.size_bytes}-byte buffer must be whole "
                f"{BLOCK_BYTES}-byte blocks or end the buffer"
            )
        first = offset_bytes // BLOCK_BYTES
        d = _BLOCK_DIGESTS[self.algo](arr)
        self._digests[first : first + d.size] = d

    def checksum(self) -> str:
        return _finish(self.algo, self._digests, self.size_bytes)
