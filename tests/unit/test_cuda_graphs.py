"""The fixed-shape decode step that CUDA graphs capture (`LlamaForCausalLM.decode_static`) and
the graphs' bucketing and padding (`DecodeGraphs`), checked eagerly on the CPU against the
engine's own paged forward: same logits (float32, 1e-4), same KV cache after the step. Capture
and replay on a device are checked by the `gpu` tests in test_worker_device.py."""

from __future__ import annotations

import pytest
import torch

from services.model_format import synth
from services.worker.engine.kv_cache import KVCache
from services.worker.model.attention import ForwardBatch
from services.worker.model.cuda_graphs import DecodeGraphs, batch_buckets, block_buckets
from services.worker.model.llama import load_model

BLOCK = 4


def test_buckets() -> None:
    assert batch_buckets(1) == (1,)
    assert batch_buckets(6) == (1, 2, 4, 6)
    assert batch_buckets(32) == (1, 2, 4, 8, 16, 24, 32)
    assert block_buckets(1) == (1,)
    assert block_buckets(12) == (1, 2, 4, 8, 12)
    with pytest.raises(ValueError, match="0"):
        batch_buckets(0)
    with pytest.raises(ValueError, match="-2"):
        block_buckets(-2)


def _prefilled(model, lens: list[int]) -> tuple[KVCache, list[list[int]], list[list[int]]]:
    """A cache holding `lens[i]` prompt tokens of sequence i, their block tables (blocks handed
    out interleaved, so no table is contiguous), and the prompts."""
    cfg = model.config
    kv = KVCache.for_model(cfg, num_blocks=64, block_size=BLOCK, dtype=model.dtype)
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(3, cfg.vocab_size, (n,), generator=g).tolist() for n in lens]
    need = [-(-(n + 4) // BLOCK) for n in lens]  # room for a few decodes
    tables: list[list[int]] = [[] for _ in lens]
    block = 1
    for j in range(max(need)):
        for i, n in enumerate(need):
            if j < n:
                tables[i].append(block)
                block += 1
    batch = ForwardBatch.build(lens, [0] * len(lens), tables, BLOCK)
    model.forward_batch(torch.tensor([t for p in prompts for t in p]), batch, kv)
    return kv, tables, prompts


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    path = synth.synthesize(tmp_path_factory.mktemp("m") / "tiny", "tiny", seed=3)
    return load_model(str(path))


def _eager_decode(model, kv, ids, lens, tables) -> torch.Tensor:
    batch = ForwardBatch.build([1] * len(ids), lens, tables, BLOCK)
    return model.forward_batch(torch.tensor(ids), batch, kv)


def test_decode_static_matches_the_paged_forward(model) -> None:
    lens = [5, 13, 9]
    kv_a, tables, _ = _prefilled(model, lens)
    kv_b, _, _ = _prefilled(model, lens)
    ids = [7, 11, 13]
    want = _eager_decode(model, kv_a, ids, lens, tables)
    width = max(len(t) for t in tables)
    padded = torch.tensor([t + [t[0]] * (width - len(t)) for t in tables])
    slots = torch.tensor([tables[i][n // BLOCK] * BLOCK + n % BLOCK for i, n in enumerate(lens)])
    got = model.decode_static(torch.tensor(ids), torch.tensor(lens), slots, padded, kv_b)
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
    assert torch.equal(got.argmax(-1), want.argmax(-1))
    k_a, v_a = kv_a.layer_cache(1)
    k_b, v_b = kv_b.layer_cache(1)
    torch.testing.assert_close(k_b, k_a, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(v_b, v_a, atol=1e-5, rtol=1e-5)


def test_graph_buckets_pad_without_touching_other_sequences(model) -> None:
    """Three sequences run in the bucket of 4: the padding row repeats row 0, so the cache ends
    as the unpadded step leaves it; three decode steps in a row stay on the eager path's logits
    and greedy tokens."""
    lens = [6, 3, 11]
    kv_a, tables, _ = _prefilled(model, lens)
    kv_b, _, _ = _prefilled(model, lens)
    graphs = DecodeGraphs(model, kv_b, max_batch_size=8, capture=False)
    assert graphs.bucket(3, 12) == (4, 4)
    ids_a = ids_b = [5, 9, 17]
    ctx = list(lens)
    for _ in range(3):
        want = _eager_decode(model, kv_a, ids_a, ctx, tables)
        got = graphs.run(ids_b, ctx, tables)
        assert got.shape == want.shape
        torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
        ids_a, ids_b = want.argmax(-1).tolist(), got.argmax(-1).tolist()
        assert ids_a == ids_b
        ctx = [c + 1 for c in ctx]
    for layer in range(model.config.num_hidden_layers):
        for a, b in zip(kv_a.layer_cache(layer), kv_b.layer_cache(layer), strict=True):
            torch.testing.assert_close(b, a, atol=1e-5, rtol=1e-5)
    assert graphs.num_graphs == 0  # eager on the CPU


def test_graph_inputs_are_checked(model) -> None:
    kv, tables, _ = _prefilled(model, [4, 4])
    graphs = DecodeGraphs(model, kv, max_batch_size=2, capture=False)
    with pytest.raises(ValueError, match="context"):
        graphs.run([1, 2], [0, 4], tables)
    with pytest.raises(ValueError, match="3 sequences"):
        graphs.run([1, 2, 3], [4, 4, 4], tables + tables[:1])
    with pytest.raises(ValueError, match="needs 3 blocks"):
        graphs.run([1], [9], [[1, 2]])
    with pytest.raises(ValueError, match="CUDA"):
        DecodeGraphs(model, kv, max_batch_size=2, capture=True)
