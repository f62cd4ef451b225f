"""Unit tests of the block checksums shared by parameter groups and KV blocks (no sockets)."""

from __future__ import annotations

import hashlib
import zlib
from concurrent.futures import ThreadPoolExecutor

import google_crc32c
import numpy as np
import pytest
import torch
import xxhash

from services.dataplane.checksum import (
    BLOCK_BYTES,
    CHECKSUM_ALGOS,
    DEFAULT_CHECKSUM_ALGO,
    GroupDigests,
    block_digests,
    checksum_algo_of,
    group_checksum,
    releases_gil,
)
from services.dataplane.errors import ManifestError
from services.dataplane.manifest import GroupEntry, Manifest, TensorEntry, build_manifest
from tests.harness.dataplane_nodes import ModelSpec, synthetic_model

SIZE = 7 * BLOCK_BYTES + 13  # a partial last block


def _data(seed: int = 0, size: int = SIZE) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, size=size, dtype=np.uint8)


@pytest.mark.parametrize("algo", CHECKSUM_ALGOS)
def test_a_flipped_byte_anywhere_changes_the_checksum(algo: str) -> None:
    data = _data()
    ref = group_checksum(data, algo)
    assert ref.startswith(algo + ":") and checksum_algo_of(ref) == algo
    for pos in (0, BLOCK_BYTES - 1, 3 * BLOCK_BYTES + 5, SIZE - 1):
        flipped = data.copy()
        flipped[pos] ^= 0x01
        assert group_checksum(flipped, algo) != ref, f"flip at byte {pos} not seen"


@pytest.mark.parametrize("algo", CHECKSUM_ALGOS)
def test_truncation_and_a_stale_block_change_the_checksum(algo: str) -> None:
    data = _data()
    ref = group_checksum(data, algo)
    assert group_checksum(data[:-1], algo) != ref
    assert group_checksum(data[: 6 * BLOCK_BYTES], algo) != ref  # cut on a block boundary
    padded = np.concatenate([data, np.zeros(1, np.uint8)])
    assert group_checksum(padded, algo) != ref  # a trailing zero is not free either
    stale = data.copy()
    stale[BLOCK_BYTES : 2 * BLOCK_BYTES] = 0  # a chunk that never landed
    assert group_checksum(stale, algo) != ref


@pytest.mark.parametrize("algo", CHECKSUM_ALGOS)
def test_a_block_landed_at_the_wrong_offset_changes_the_checksum(algo: str) -> None:
    data = _data()
    ref = group_checksum(data, algo)
    swapped = data.copy()
    swapped[:BLOCK_BYTES], swapped[2 * BLOCK_BYTES : 3 * BLOCK_BYTES] = (
        data[2 * BLOCK_BYTES : 3 * BLOCK_BYTES],
        data[:BLOCK_BYTES],
    )
    assert group_checksum(swapped, algo) != ref
    # The same through the receive path: chunk 2's bytes digested as if they sat at chunk 1.
    digests = GroupDigests(data.size, algo)
    for off in range(0, data.size, BLOCK_BYTES):
        src = 2 * BLOCK_BYTES if off == BLOCK_BYTES else off
        digests.add(off, data[src : src + BLOCK_BYTES] if off + BLOCK_BYTES <= data.size else data[off:])
    assert digests.checksum() != ref


@pytest.mark.parametrize("algo", CHECKSUM_ALGOS)
def test_chunk_digests_in_any_order_and_from_threads_equal_the_whole_buffer(algo: str) -> None:
    data = _data(1)
    ref = group_checksum(data, algo)
    rng = np.random.default_rng(7)
    # Chunks of 1-3 blocks (the last one partial), added in a shuffled order.
    bounds = [0]
    while bounds[-1] < data.size:
        bounds.append(min(data.size, bounds[-1] + int(rng.integers(1, 4)) * BLOCK_BYTES))
    pieces = [(a, data[a:b]) for a, b in zip(bounds, bounds[1:], strict=False)]
    order = rng.permutation(len(pieces))
    serial = GroupDigests(data.size, algo)
    for i in order:
        serial.add(*pieces[i])
    assert serial.checksum() == ref
    threaded = GroupDigests(data.size, algo)
    with ThreadPoolExecutor(4) as pool:
        list(pool.map(lambda p: threaded.add(*p), [pieces[i] for i in order]))
    assert threaded.checksum() == ref
    # block_digests of a chunk are that chunk's slice of the whole buffer's digests.
    whole = block_digests(data, algo)
    assert np.array_equal(block_digests(data[2 * BLOCK_BYTES :], algo), whole[2:])


@pytest.mark.parametrize(
    ("algo", "hash_block"),
    [
        ("xxh3", xxhash.xxh3_64_intdigest),
        ("crc32c", google_crc32c.value),
        ("crc32", zlib.crc32),
    ],
)
def test_library_algos_are_the_documented_format(algo: str, hash_block: object) -> None:
    """'<algo>:' + blake2b-128(the library's digest of each 64 KiB block as <u8, then the size as <u8)."""
    data = _data(2)
    h = hashlib.blake2b(digest_size=16)
    for off in range(0, data.size, BLOCK_BYTES):
        h.update(int(hash_block(data[off : off + BLOCK_BYTES].tobytes())).to_bytes(8, "little"))  # type: ignore[operator]
    h.update(data.size.to_bytes(8, "little"))
    assert group_checksum(data, algo) == f"{algo}:{h.hexdigest()}"


def test_checksums_made_before_xxh3_still_verify() -> None:
    # Values written by the blocksum64/crc32-only module (commit c58d0b8), pinned: manifests
    # and parameter-manager indexes made then must keep verifying.
    data = (np.arange(300_000) % 256).astype(np.uint8)
    assert group_checksum(data, "blocksum64") == "blocksum64:932abbeb758b6a065a9f1f09a9530283"
    assert group_checksum(data, "crc32") == "crc32:fa3aed7148aa88b9153d3f501734b66d"
    old = "blocksum64:932abbeb758b6a065a9f1f09a9530283"
    digests = GroupDigests(data.size, checksum_algo_of(old))  # what a receiver does
    digests.add(0, data[: 2 * BLOCK_BYTES])
    digests.add(2 * BLOCK_BYTES, data[2 * BLOCK_BYTES :])
    assert digests.checksum() == old


def test_an_unknown_algo_is_refused_quoting_it() -> None:
    bad = "md5:" + "0" * 32
    with pytest.raises(ValueError, match=r"unknown checksum algo 'md5' in checksum 'md5:0+'"):
        checksum_algo_of(bad)
    with pytest.raises(ValueError, match="unknown checksum algo 'xxh4'"):
        group_checksum(_data(size=10), "xxh4")
    with pytest.raises(ValueError, match="unknown checksum algo 'sha1'"):
        GroupDigests(10, "sha1")
    with pytest.raises(ValueError, match="unknown checksum algo 'adler'"):
        block_digests(_data(size=10), "adler")
    with pytest.raises(ValueError, match="unknown checksum algo 'fnv'"):
        releases_gil("fnv")
    with pytest.raises(ValueError, match=r"malformed checksum 'xxh3:abc'"):
        checksum_algo_of("xxh3:abc")
    t = TensorEntry(name="w", dtype="uint8", shape=(4,), offset_bytes=0, size_bytes=4)
    with pytest.raises(ManifestError, match=r"group 'layers.0': unknown checksum algo 'md5'"):
        Manifest(
            model_id="m",
            groups=(GroupEntry(name="layers.0", tensors=(t,), size_bytes=4, checksum=bad),),
            total_bytes=4,
            chunk_bytes=BLOCK_BYTES,
        )


def test_group_digests_refuse_chunks_off_the_block_grid() -> None:
    digests = GroupDigests(3 * BLOCK_BYTES + 10)
    with pytest.raises(ValueError, match="chunk offset 100 is not a non-negative multiple of 65536"):
        digests.add(100, _data(size=BLOCK_BYTES))
    with pytest.raises(ValueError, match=r"chunk \[0, 1000\) of a 196618-byte buffer must be whole"):
        digests.add(0, _data(size=1000))
    with pytest.raises(ValueError, match=r"chunk \[131072, 262144\) of a 196618-byte buffer"):
        digests.add(2 * BLOCK_BYTES, _data(size=2 * BLOCK_BYTES))
    digests.add(3 * BLOCK_BYTES, _data(size=10))  # the partial last block is fine
    with pytest.raises(ValueError, match="size_bytes must be >= 0, got -1"):
        GroupDigests(-1)


def test_torch_tensors_numpy_and_empty_buffers_digest_alike() -> None:
    # KV blocks are torch tensors: the checksum is that of their bytes, whatever the dtype.
    t = torch.arange(3 * BLOCK_BYTES // 2, dtype=torch.bfloat16).reshape(-1, 64)
    raw = t.view(torch.uint8).reshape(-1).numpy()
    assert group_checksum(t) == group_checksum(raw) == group_checksum(raw.copy())
    empty = np.zeros(0, np.uint8)
    assert group_checksum(empty) == GroupDigests(0).checksum()
    assert group_checksum(empty) != group_checksum(np.zeros(1, np.uint8))


def test_one_default_algo_everywhere() -> None:
    assert DEFAULT_CHECKSUM_ALGO in CHECKSUM_ALGOS
    assert group_checksum(_data(size=10)).startswith(DEFAULT_CHECKSUM_ALGO + ":")
    m = build_manifest("m", [("layers.0", {"w": np.ones(8, np.float32)})], chunk_bytes=BLOCK_BYTES)
    assert checksum_algo_of(m.groups[0].checksum) == DEFAULT_CHECKSUM_ALGO
    manifest, _ = synthetic_model(ModelSpec(num_layers=1, layer_bytes=BLOCK_BYTES))
    assert {checksum_algo_of(g.checksum) for g in manifest.groups} == {DEFAULT_CHECKSUM_ALGO}
