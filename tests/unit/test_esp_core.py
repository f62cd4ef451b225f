"""Elastic sequence parallelism's exact core (services/worker/model/esp.py): attention split over
key ranges and merged by log-sum-exp equals attention over all keys; a prompt prefilled by a
group of 1-4 members and decoded with its KV spread over them (a holder joining mid-decode)
gives a single instance's logits (float32, 1e-4) and greedy tokens."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from services.model_format import synth
from services.worker.engine.kv_cache import KVCache, OutOfBlocks
from services.worker.model.esp import (
    Placement,
    distributed_decode_step,
    merge,
    partial_attention,
    sequence_parallel_prefill,
)
from services.worker.model.llama import load_model

BLOCK = 4


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return load_model(str(synth.synthesize(tmp_path_factory.mktemp("m") / "tiny", "tiny", seed=5)))


@pytest.fixture(scope="module")
def windowed(tmp_path_factory):
    path = synth.synthesize(
        tmp_path_factory.mktemp("w") / "tiny", "tiny", seed=6, overrides={"sliding_window": 7, "model_type": "mistral"}
    )
    return load_model(str(path))


def _cache(model, blocks: int = 64) -> KVCache:
    return KVCache.for_model(model.config, num_blocks=blocks, block_size=BLOCK, dtype=model.dtype)


@pytest.mark.parametrize("window", [None, 5])
def test_partials_merge_to_the_whole(window) -> None:
    g = torch.Generator().manual_seed(0)
    t, s, heads, kv_heads, d = 6, 23, 8, 2, 16
    q = torch.randn(t, heads, d, generator=g)
    k, v = torch.randn(s, kv_heads, d, generator=g), torch.randn(s, kv_heads, d, generator=g)
    q_pos = torch.arange(s - t, s)  # the last t positions query all keys before them
    k_pos = torch.arange(s)
    whole = partial_attention(q, q_pos, k, v, k_pos, window)
    # The reference: SDPA with the same visibility.
    visible = (k_pos.view(1, -1) <= q_pos.view(-1, 1)) & (k_pos.view(1, -1) > q_pos.view(-1, 1) - (window or s + 1))
    ref = F.scaled_dot_product_attention(
        q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), attn_mask=visible, enable_gqa=True
    ).transpose(0, 1)
    torch.testing.assert_close(whole.out, ref, atol=1e-5, rtol=1e-5)
    for cuts in ([9], [3, 11, 20], [1, 2, 3, 4, 5, 22]):
        edges = [0, *cuts, s]
        parts = [
            partial_attention(q, q_pos, k[a:b], v[a:b], k_pos[a:b], window)
            for a, b in zip(edges, edges[1:], strict=False)
        ]
        torch.testing.assert_close(merge(parts), whole.out, atol=1e-5, rtol=1e-5)
    # Any partition, not only ranges: keys in a scattered order.
    perm = torch.randperm(s, generator=g)
    halves = [perm[: s // 2], perm[s // 2 :]]
    parts = [partial_attention(q, q_pos, k[i], v[i], k_pos[i], window) for i in halves]
    torch.testing.assert_close(merge(parts), whole.out, atol=1e-5, rtol=1e-5)


def test_a_query_that_sees_no_key_is_refused() -> None:
    q = torch.randn(1, 2, 4)
    k = v = torch.randn(3, 2, 4)
    part = partial_attention(q, torch.tensor([0]), k, v, torch.tensor([5, 6, 7]))
    assert torch.isneginf(part.lse).all() and (part.out == 0).all()
    with pytest.raises(ValueError, match="sees no key"):
        merge([part])
    with pytest.raises(ValueError, match="at least one"):
        merge([])


def _greedy_reference(model, prompt: list[int], steps: int) -> tuple[list[int], list[torch.Tensor]]:
    """One instance, no cache at all: the whole sequence recomputed every step."""
    ids, logits = list(prompt), []
    for _ in range(steps):
        row = model.forward(torch.tensor(ids))[-1]
        logits.append(row)
        ids.append(int(row.argmax()))
    return ids[len(prompt) :], logits


@pytest.mark.parametrize("bounds", [[0, 37], [0, 20, 37], [0, 5, 6, 37], [0, 9, 18, 27, 37]])
def test_a_group_prefills_and_decodes_like_one_instance(model, bounds) -> None:
    g = torch.Generator().manual_seed(len(bounds))
    prompt = torch.randint(3, model.config.vocab_size, (37,), generator=g).tolist()
    want_tokens, want_logits = _greedy_reference(model, prompt, 8)
    caches = [_cache(model) for _ in range(len(bounds) - 1)]
    logits, placement = sequence_parallel_prefill(model, caches, "r", prompt, bounds)
    torch.testing.assert_close(logits, want_logits[0], atol=1e-4, rtol=1e-4)
    # Proactive scale-down: each member holds exactly its slice, nothing moved.
    assert [(s.start, s.end) for s in placement.shards] == list(zip(bounds, bounds[1:], strict=False))
    tokens = [int(logits.argmax())]
    for step in range(1, 8):
        row = distributed_decode_step(model, placement, tokens[-1], caches)
        torch.testing.assert_close(row, want_logits[step], atol=1e-4, rtol=1e-4)
        tokens.append(int(row.argmax()))
    assert tokens == want_tokens
    assert placement.num_tokens == len(prompt) + 7
    placement.free()
    assert all(c.free_blocks == c.num_blocks for c in caches)


def test_a_prompt_no_instance_can_hold_is_served_by_a_group_that_grows_while_decoding(model) -> None:
    """Each member holds 12 tokens (3 blocks); the 30-token prompt needs three of them, and its
    decode fills the last and moves on to a fourth (scale-up): the old KV stays in place."""
    g = torch.Generator().manual_seed(9)
    prompt = torch.randint(3, model.config.vocab_size, (30,), generator=g).tolist()
    want_tokens, want_logits = _greedy_reference(model, prompt, 10)
    caches = [_cache(model, blocks=3) for _ in range(4)]
    with pytest.raises(OutOfBlocks):
        sequence_parallel_prefill(model, [_cache(model, blocks=3)], "alone", prompt, [0, 30])
    logits, placement = sequence_parallel_prefill(model, caches[:3], "r", prompt, [0, 12, 24, 30])
    before = [s.kv(0)[0].clone() for s in placement.shards]
    tokens = [int(logits.argmax())]
    for step in range(1, 10):
        row = distributed_decode_step(model, placement, tokens[-1], caches)
        torch.testing.assert_close(row, want_logits[step], atol=1e-4, rtol=1e-4)
        tokens.append(int(row.argmax()))
    assert tokens == want_tokens
    assert [(s.start, s.end) for s in placement.shards] == [(0, 12), (12, 24), (24, 36), (36, 39)]
    assert placement.shards[-1].cache is caches[3]
    for old, shard in zip(before, placement.shards, strict=False):
        assert torch.equal(shard.kv(0)[0][: old.shape[0]], old)
    full = [_cache(model, blocks=1) for _ in range(2)]
    lone = Placement("x")
    _, lone = sequence_parallel_prefill(model, full[:1], "x", prompt[:4], [0, 4])
    full[1].allocate("other", 4)
    with pytest.raises(OutOfBlocks, match="no holder"):
        distributed_decode_step(model, lone, 5, full)


def test_sliding_window_layers_split_exactly(windowed) -> None:
    g = torch.Generator().manual_seed(4)
    prompt = torch.randint(3, windowed.config.vocab_size, (29,), generator=g).tolist()
    assert any(windowed.layer_window(i) for i in range(windowed.config.num_hidden_layers))
    _, want = _greedy_reference(windowed, prompt, 3)
    caches = [_cache(windowed) for _ in range(3)]
    logits, placement = sequence_parallel_prefill(windowed, caches, "r", prompt, [0, 10, 20, 29])
    torch.testing.assert_close(logits, want[0], atol=1e-4, rtol=1e-4)
    row = distributed_decode_step(windowed, placement, int(logits.argmax()), caches)
    torch.testing.assert_close(row, want[1], atol=1e-4, rtol=1e-4)


def test_bad_bounds_are_refused_quoting_them(model) -> None:
    caches = [_cache(model), _cache(model)]
    with pytest.raises(ValueError, match=r"\[0, 5\]"):
        sequence_parallel_prefill(model, caches, "r", list(range(3, 13)), [0, 5])
    with pytest.raises(ValueError, match=r"\[0, 5, 5\]"):
        sequence_parallel_prefill(model, caches, "r", list(range(3, 8)), [0, 5, 5])
    assert all(c.free_blocks == c.num_blocks for c in caches)
