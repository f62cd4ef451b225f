"""Chained block hashes (services/common/prefix.py) and the KV allocator's prefix cache:
reference counts, hash-chain matching, LRU eviction, and every block back after every request."""

from __future__ import annotations

import random
import subprocess
import sys

import pytest

from services.common.prefix import ROOT_HASH, block_hashes, chain_hash
from services.worker.engine.kv_cache import KVCache, OutOfBlocks

BS = 4


def make_cache(num_blocks: int = 8) -> KVCache:
    return KVCache(num_layers=1, num_blocks=num_blocks, block_size=BS, num_kv_heads=1, head_dim=4)


def start(kv: KVCache, seq_id: str, tokens: list[int]) -> list[int]:
    """What the engine does for a request: match its prefix (short of its last token), start
    from it, compute the rest, register its full blocks. Returns the blocks it matched."""
    n = (len(tokens) - 1) // BS * BS
    matched = kv.match_prefix(tokens[:n])
    kv.allocate(seq_id, 0, prefix_blocks=matched)
    done = len(matched) * BS
    kv.extend(seq_id, len(tokens))
    kv.check_writable(seq_id, done)
    hashes = block_hashes(tokens, BS)
    kv.register(seq_id, len(matched), hashes, tokens[len(matched) * BS : len(hashes) * BS])
    return matched


def assert_all_back(kv: KVCache) -> None:
    assert kv.sequences() == []
    assert kv.free_blocks == kv.total_blocks and kv.used_blocks == 0
    assert all(kv.ref_count(b) == 0 for b in range(kv.total_blocks))


# ---- hashes ------------------------------------------------------------------------------------


def test_block_hashes_cover_full_blocks_and_chain_their_parents() -> None:
    tokens = list(range(10))
    hashes = block_hashes(tokens, BS)
    assert len(hashes) == 2  # the partial third block has none
    assert hashes[0] == chain_hash(ROOT_HASH, tokens[:4])
    assert hashes[1] == chain_hash(hashes[0], tokens[4:8])
    assert all(0 <= h < 2**64 for h in hashes)
    assert block_hashes(tokens, BS, max_blocks=1) == hashes[:1]
    assert block_hashes(tokens[:3], BS) == []
    # A block's hash depends on everything before it, not only on its own tokens.
    other = [9, 9, 9, 9, *tokens[4:8]]
    assert block_hashes(other, BS)[1] != hashes[1]
    # Same tokens, same hashes; one token changed changes its block's hash and all later ones.
    changed = [*tokens[:5], 99, *tokens[6:]]
    assert block_hashes(changed, BS)[0] == hashes[0] and block_hashes(changed, BS)[1] != hashes[1]


def test_block_hashes_are_stable_across_processes() -> None:
    # Not Python's hash(): a fresh interpreter (another PYTHONHASHSEED) computes the same values.
    code = "from services.common.prefix import block_hashes; print(block_hashes(list(range(40)), 16))"
    out = subprocess.run(
        [sys.executable, "-c", code], check=True, capture_output=True, text=True, env={"PYTHONHASHSEED": "123"}
    )
    assert out.stdout.strip() == str(block_hashes(list(range(40)), 16))
    # Pinned: the gateway, the manager and every worker must agree, release after release.
    assert block_hashes([1, 2, 3, 4], 4) == [chain_hash(0, [1, 2, 3, 4])]
    assert chain_hash(0, [1, 2, 3, 4]) == int.from_bytes(
        __import__("hashlib")
        .blake2b(b"\0" * 8 + b"".join(t.to_bytes(4, "little") for t in (1, 2, 3, 4)), digest_size=8)
        .digest(),
        "little",
    )


def test_block_hashes_reject_bad_input() -> None:
    with pytest.raises(ValueError, match="block_size"):
        block_hashes([1, 2], 0)
    with pytest.raises(ValueError, match="max_blocks"):
        block_hashes([1, 2], 1, max_blocks=-1)
    with pytest.raises(ValueError, match=r"\[-1\]"):
        block_hashes([1, -1], 2)


# ---- allocator ---------------------------------------------------------------------------------


def test_registered_blocks_are_shared_with_reference_counts() -> None:
    kv = make_cache()
    a = list(range(100, 110))  # 2 full blocks + 2 tokens
    assert start(kv, "a", a) == []
    ta = kv.block_table("a")
    assert kv.cached_blocks == 2 and kv.block_hash(ta[2]) is None
    # Same first 8 tokens, then different ones: shares the two full blocks.
    b = [*a[:8], 7, 7, 7]
    assert start(kv, "b", b) == ta[:2]
    tb = kv.block_table("b")
    assert tb[:2] == ta[:2] and tb[2] != ta[2]
    assert [kv.ref_count(x) for x in ta] == [2, 2, 1]
    assert kv.used_blocks == 4  # 2 shared + 1 private each
    kv.free("a")
    assert [kv.ref_count(x) for x in tb] == [1, 1, 1]
    assert kv.used_blocks == 3
    kv.free("b")
    assert kv.cached_blocks == 2 and kv.evictable_blocks == 2
    assert_all_back(kv)


def test_match_stops_at_the_first_missing_or_different_block() -> None:
    kv = make_cache()
    a = list(range(100, 113))  # 3 full blocks
    start(kv, "a", a)
    ta = kv.block_table("a")
    assert kv.match_prefix(a) == ta[:3]
    assert kv.match_prefix(a[:11]) == ta[:2]  # full blocks of what is given only
    assert kv.match_prefix([*a[:4], 0, *a[5:]]) == ta[:1]
    assert kv.match_prefix([0, *a[1:]]) == []
    # Precomputed hashes give the same answer.
    assert kv.match_prefix(a[:12], block_hashes(a, BS)) == ta[:3]
    # A wrong hash (a collision, in effect) never hands out a block holding other tokens.
    assert kv.match_prefix([5, 5, 5, 5], block_hashes(a, BS)[:1]) == []
    kv.free("a")


def test_a_request_never_matches_its_last_token() -> None:
    # A prompt of exactly two blocks matches one: the last token's logits must be computed.
    kv = make_cache()
    a = list(range(100, 108))
    start(kv, "a", a)
    kv.free("a")
    assert start(kv, "b", a) == kv.block_table("b")[:1]
    kv.free("b")
    assert_all_back(kv)


def test_eviction_waits_for_the_free_list_and_goes_least_recently_freed_first() -> None:
    kv = make_cache(num_blocks=6)
    a = list(range(100, 109))  # blocks a0 a1 cached + a2 private
    start(kv, "a", a)
    ta = kv.block_table("a")
    kv.free("a")  # a2 -> free list; a1 then a0 evictable (the chain's tail first)
    b = list(range(200, 205))  # b0 cached + b1 private
    start(kv, "b", b)
    tb = kv.block_table("b")
    assert not set(tb) & set(ta[:2])  # never-cached blocks are used before any eviction
    kv.free("b")
    assert kv.evictable_blocks == 3 and kv.free_blocks == 6
    # 4 fresh blocks: the 3 never-cached ones, then one eviction: the least recently freed, a1.
    kv.allocate("c", 4 * BS)
    assert kv.match_prefix(a[:8]) == ta[:1]  # a1 is gone, a0 still cached
    assert kv.match_prefix(b[:4]) == tb[:1]
    kv.extend("c", 5 * BS)  # then a0
    assert kv.match_prefix(a[:8]) == []
    assert kv.match_prefix(b[:4]) == tb[:1]
    kv.free("c")
    assert kv.cached_blocks == 1
    assert_all_back(kv)


def test_a_cached_block_in_use_is_never_evicted_and_a_reused_one_moves_to_the_back() -> None:
    kv = make_cache(num_blocks=4)
    a = list(range(100, 105))
    b = list(range(200, 205))
    start(kv, "a", a)
    start(kv, "b", b)
    a0, b0 = kv.block_table("a")[0], kv.block_table("b")[0]
    kv.free("a")
    kv.free("b")  # LRU: a0, b0
    start(kv, "a2", a)  # a0 matched again: held, then freed after b0
    kv.free("a2")  # LRU: b0, a0
    kv.allocate("c", 3 * BS)  # 2 never-cached blocks, then b0
    assert kv.match_prefix(b[:4]) == [] and kv.match_prefix(a[:4]) == [a0]
    kv.free("c")
    assert b0 not in kv.match_prefix(b[:4])
    # Held blocks stay: c holds the matched a0; asking for more than the rest is OutOfBlocks.
    kv.allocate("d", 0, prefix_blocks=[a0])
    with pytest.raises(OutOfBlocks):
        kv.allocate("e", 4 * BS)
    assert kv.match_prefix(a[:4]) == [a0]
    kv.free("d")
    assert_all_back(kv)


def test_a_failed_allocation_gives_its_prefix_back() -> None:
    kv = make_cache(num_blocks=3)
    a = list(range(100, 109))
    start(kv, "a", a)
    ta = kv.block_table("a")
    kv.free("a")
    with pytest.raises(OutOfBlocks):
        kv.allocate("b", 5 * BS, prefix_blocks=ta[:2])
    assert kv.evictable_blocks == 2 and kv.match_prefix(a[:8]) == ta[:2]
    assert_all_back(kv)


def test_only_cached_blocks_can_be_shared_and_shared_blocks_are_never_writable() -> None:
    kv = make_cache()
    kv.allocate("a", 2 * BS)
    private = kv.block_table("a")
    with pytest.raises(ValueError, match="caches no prefix"):
        kv.allocate("b", 0, prefix_blocks=private[:1])
    kv.register("a", 0, block_hashes(list(range(8)), BS), list(range(8)))
    # Registered: no longer writable, even by its owner.
    with pytest.raises(RuntimeError, match="shared"):
        kv.check_writable("a", 0)
    kv.allocate("b", 0, prefix_blocks=private)
    kv.extend("b", 2 * BS + 1)
    kv.check_writable("b", 2 * BS)  # its own new block
    with pytest.raises(RuntimeError, match="held by 2"):
        kv.check_writable("b", BS)
    with pytest.raises(ValueError, match="repeat"):
        kv.allocate("c", 0, prefix_blocks=[private[0], private[0]])
    kv.free("a")
    kv.free("b")
    assert_all_back(kv)


def test_the_same_prefix_computed_twice_is_cached_once() -> None:
    kv = make_cache()
    a = list(range(100, 109))
    hashes = block_hashes(a, BS)
    for seq in ("x", "y"):  # admitted together: neither found the other's blocks
        kv.allocate(seq, len(a))
    assert kv.register("x", 0, hashes, a[:8]) == 2
    assert kv.register("y", 0, hashes, a[:8]) == 0  # y's copies stay private
    assert kv.match_prefix(a[:8]) == kv.block_table("x")[:2]
    kv.free("y")
    assert kv.free_blocks == kv.total_blocks - 3 and kv.evictable_blocks == 0
    kv.free("x")
    assert kv.cached_blocks == 2
    assert_all_back(kv)


def test_rename_keeps_shared_blocks_shared() -> None:
    kv = make_cache()
    a = list(range(100, 109))
    start(kv, "a", a)
    start(kv, "b", a)
    shared = kv.block_table("b")[:2]
    kv.rename("b", "b#handoff-1")
    assert [kv.ref_count(x) for x in shared] == [2, 2]
    kv.free("a")
    assert kv.match_prefix(a[:8]) == shared  # still held by the parked copy
    assert kv.free("b#handoff-1") == 3
    assert_all_back(kv)


def test_random_requests_leak_nothing() -> None:
    rng = random.Random(0)
    kv = make_cache(num_blocks=16)
    prefixes = [[rng.randrange(1000) for _ in range(rng.randrange(0, 12))] for _ in range(4)]
    live: list[str] = []
    for i in range(300):
        if live and (rng.random() < 0.5 or kv.free_blocks < 5):
            kv.free(live.pop(rng.randrange(len(live))))
        else:
            tokens = rng.choice(prefixes) + [rng.randrange(1000) for _ in range(rng.randrange(1, 8))]
            start(kv, f"r{i}", tokens)
            live.append(f"r{i}")
        held = sum(kv.num_blocks_of(s) for s in kv.sequences())
        assert sum(kv.ref_count(b) for b in range(kv.total_blocks)) == held
        assert kv.used_blocks == sum(1 for b in range(kv.total_blocks) if kv.ref_count(b) > 0)
    for seq in live:
        kv.free(seq)
    assert_all_back(kv)
