"""Checksums of parameter groups and KV blocks, computed chunk by chunk as the bytes land.

A buffer is cut into 64 KiB blocks; each block gets a 64-bit digest (a library hash by default), and
the checksum is blake2b over the digest array and the size, written `"<algo>:<hex>"`. Because
digests are per block, a receiver computes them as chunks land, in any order, and the final
hash touches only 1/8192 of the data. Every user (manifests, the parameter manager, the KV
transfer) takes `DEFAULT_CHECKSUM_ALGO` unless told otherwise; a checksum names its algo, so one
made with any algo below (blocksum64 and crc32 were the only ones before xxh3) still verifies.

Measured on the development machine (2 cores, AMD EPYC with AVX-512). Raw: one core digests
256 MiB of random bytes in 16 MiB chunks through `GroupDigests.add`, best of 3 (cold: more
than the cache), and one 16 MiB chunk over and over (hot: as a chunk that has just landed);
bench/dataplane/checksums.py. Pull: a 256 MiB model pulled over UCX in 16 MiB chunks by one
receiver, algos interleaved, 8 rounds, median of the medians of 2-3 runs; the transport alone
moved the same bytes at 15-17 GB/s in those runs, the pull with the digest step skipped at
10-13 GB/s:

| algo | computed by | cold GB/s | hot GB/s | GIL | pull GB/s, digest inline / in a thread |
| --- | --- | --- | --- | --- | --- |
| `xxh3` (default) | xxhash `xxh3_64_intdigest` per block | 20-22 | 48-50 | held | 7.2 / 5.2-6.1 |
| `crc32c` | google-crc32c `value` per block | 13-14 | 14 | held | 6.6 / 4.3-5.5 |
| `blocksum64` | hand-written: wrapping uint64 sum per block, numpy | 26-28 | 52-55 | released | 8.9 / 5.3-9.2 |
| `crc32` | zlib per block | 4.5-6.3 | 6.4 | released | 2.3-2.9 (one bench run) |

xxhash releases the GIL only above 64 KiB, google_crc32c only for `bytes` of 1 MiB or more, so
one block at a time they hold it (a thread beside them waits ~5 ms). Digests of such an algo
are computed on the receiving loop as each chunk lands (chain.py): a thread could not run
beside them anyway, and inline the chunk is still in cache. Larger xxh3 blocks (256 KiB, 1 MiB:
fewer calls, GIL released) were measured too and pulled no faster.

The pull is bound by memory and the two cores more than by the hash: the digest is a second
pass over bytes the transport has just copied. The default is `xxh3`, the fastest maintained
library hash here (crc32c is 10% slower in the pull and 35-70% slower raw) and a real hash,
where the wrapping sum misses two words swapped inside a block; it costs 5-20% of the pull
rate against the hand-written blocksum64, which stays readable with crc32 for old manifests.
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


def _per_block(hash_block: Callable[[Any], int], *, ndarray_blocks: bool = False) -> Callable[[np.ndarray], np.ndarray]:
    """Digests of every block by a library function of one block's bytes (an int < 2**64).

    Blocks are memoryview slices, the cheapest to cut (15-20% faster than ndarray slices for
    xxh3 on cached data); `ndarray_blocks` for google_crc32c, which takes only buffers without
    a release hook ("y#"), as an ndarray is and a memoryview is not.
    """

    def digests(data: np.ndarray) -> np.ndarray:
        src = data if ndarray_blocks else data.data
        n = int(data.size)
        return np.fromiter(
            (hash_block(src[i : i + BLOCK_BYTES]) for i in range(0, n, BLOCK_BYTES)),
            dtype=np.uint64,
            count=-(-n // BLOCK_BYTES),
        )

    return digests


_BLOCK_DIGESTS: Final[dict[str, Callable[[np.ndarray], np.ndarray]]] = {
    "xxh3": _per_block(xxhash.xxh3_64_intdigest),
    "crc32c": _per_block(google_crc32c.value, ndarray_blocks=True),
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
