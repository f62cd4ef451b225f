"""Llama decoder, config, parameter groups, checkpoint reader and synthetic checkpoints.

The decoder is checked against `transformers.LlamaForCausalLM` on the same files.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file, save_file

from services.model_format import synth
from services.model_format.checkpoint import Checkpoint, CheckpointError, iter_groups, load_config
from services.model_format.config import LlamaConfig
from services.model_format.groups import group_of, group_tensor_shapes, param_groups
from services.worker.engine.kv_cache import KVCache
from services.worker.model import native
from services.worker.model.attention import ForwardBatch, _bucket_by_length
from services.worker.model.llama import LlamaForCausalLM, load_model

# Float32 on both sides; the two implementations differ only in summation order.
HF_ATOL = 1e-4

VARIANTS: dict[str, dict[str, Any]] = {
    "untied-gqa": {},  # the tiny preset: 4 query heads over 2 KV heads
    "tied-gqa": {"tie_word_embeddings": True},
    "untied-mha": {"num_key_value_heads": 4},
}


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("ckpt")
    return {
        name: synth.synthesize(root / name, "tiny", seed=1, overrides=overrides) for name, overrides in VARIANTS.items()
    }


def _ids(n: int, batch: int = 1, seed: int = 0, vocab: int = 2048) -> torch.Tensor:
    return torch.randint(0, vocab, (batch, n), generator=torch.Generator().manual_seed(seed))


# ---- config ------------------------------------------------------------------------------------


def test_config_round_trips_through_hf_dict() -> None:
    cfg = synth.PRESETS["small"]
    d = cfg.to_hf_dict()
    assert d["architectures"] == ["LlamaForCausalLM"] and d["model_type"] == "llama"
    assert LlamaConfig.from_hf_dict(d) == cfg
    assert LlamaConfig.from_hf_dict(json.loads(json.dumps(d))) == cfg


def test_config_reads_hf_variants() -> None:
    base = {
        "vocab_size": 100,
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
    }
    cfg = LlamaConfig.from_hf_dict({**base, "rope_theta": 5e5, "eos_token_id": [7, 8]})
    assert cfg.head_dim == 16 and cfg.num_key_value_heads == 4  # derived defaults
    assert cfg.rope_theta == 5e5 and cfg.eos_token_id == 7
    cfg5 = LlamaConfig.from_hf_dict({**base, "rope_parameters": {"rope_type": "default", "rope_theta": 1234.0}})
    assert cfg5.rope_theta == 1234.0


@pytest.mark.parametrize(
    ("change", "quoted"),
    [
        ({"hidden_size": 100, "num_attention_heads": 3}, "100"),
        ({"num_key_value_heads": 3}, "num_key_value_heads=3"),
        ({"num_hidden_layers": 0}, "0"),
        ({"torch_dtype": "int8"}, "'int8'"),
        ({"rope_scaling": {"rope_type": "longrope", "factor": 8.0}}, "'longrope'"),
        ({"rope_scaling": {"rope_type": "llama3", "factor": 8.0}}, "low_freq_factor"),
        ({"hidden_act": "gelu"}, "'gelu'"),
        ({"eos_token_id": 100}, "100"),
    ],
)
def test_config_rejects_bad_values_quoting_them(change: dict[str, Any], quoted: str) -> None:
    d = {
        "vocab_size": 100,
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        **change,
    }
    with pytest.raises(ValueError, match=quoted.replace("(", r"\(").replace("[", r"\[")):
        LlamaConfig.from_hf_dict(d)


def test_config_counts_parameters() -> None:
    cfg = synth.PRESETS["tiny"]
    total = sum(int(torch.Size(s).numel()) for g in param_groups(cfg) for s in group_tensor_shapes(cfg, g).values())
    assert cfg.num_parameters() == total
    assert 500_000 < total < 2_000_000
    assert 10e6 < synth.PRESETS["small"].num_parameters() < 30e6
    assert 100e6 <= synth.PRESETS["bench"].num_parameters() <= 150e6


# ---- groups ------------------------------------------------------------------------------------


def test_param_groups_order_and_membership() -> None:
    cfg = synth.PRESETS["tiny"]
    assert param_groups(cfg) == ["embed", "layers.0", "layers.1", "head"]
    assert group_of("model.embed_tokens.weight") == "embed"
    assert group_of("model.layers.1.self_attn.k_proj.weight") == "layers.1"
    assert group_of("model.layers.12.mlp.down_proj.weight") == "layers.12"
    assert group_of("model.layers.0.post_attention_layernorm.weight") == "layers.0"
    assert group_of("model.norm.weight") == "head"
    assert group_of("lm_head.weight") == "head"
    assert group_of("model.layers.0.self_attn.q_proj.bias") == "layers.0"  # Qwen2's biases travel with their layer
    with pytest.raises(ValueError, match="'model.layers.0.self_attn.q_norm.weight'"):
        group_of("model.layers.0.self_attn.q_norm.weight")
    tied = cfg.replace(tie_word_embeddings=True)
    assert list(group_tensor_shapes(tied, "head")) == ["model.norm.weight"]
    assert list(group_tensor_shapes(cfg, "head")) == ["model.norm.weight", "lm_head.weight"]


# ---- checkpoint --------------------------------------------------------------------------------


def test_iter_groups_yields_each_group_in_order(ckpts: dict[str, Path]) -> None:
    path = ckpts["untied-gqa"]
    cfg = load_config(path)
    seen = []
    for name, tensors in iter_groups(path):
        seen.append(name)
        assert list(tensors) == list(group_tensor_shapes(cfg, name))
        assert all(tuple(t.shape) == group_tensor_shapes(cfg, name)[n] for n, t in tensors.items())
    assert seen == param_groups(cfg)
    tied = dict(iter_groups(ckpts["tied-gqa"]))
    assert list(tied["head"]) == ["model.norm.weight"]


def test_checkpoint_errors_quote_path_and_name(tmp_path: Path, ckpts: dict[str, Path]) -> None:
    with pytest.raises(FileNotFoundError, match=repr(str(tmp_path / "config.json"))):
        load_config(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps(synth.PRESETS["tiny"].to_hf_dict()))
    with pytest.raises(FileNotFoundError, match="no \\*.safetensors"):
        Checkpoint(tmp_path)
    tensors = load_file(str(ckpts["untied-gqa"] / "model.safetensors"))
    del tensors["model.layers.1.mlp.up_proj.weight"]
    save_file(tensors, str(tmp_path / "model.safetensors"))
    groups = Checkpoint(tmp_path).iter_groups()
    assert next(groups)[0] == "embed"
    assert next(groups)[0] == "layers.0"
    with pytest.raises(CheckpointError, match="'model.layers.1.mlp.up_proj.weight'"):
        next(groups)


def test_checkpoint_rejects_wrong_shape(tmp_path: Path, ckpts: dict[str, Path]) -> None:
    (tmp_path / "config.json").write_text(json.dumps(synth.PRESETS["tiny"].to_hf_dict()))
    tensors = load_file(str(ckpts["untied-gqa"] / "model.safetensors"))
    tensors["model.norm.weight"] = torch.ones(7)
    save_file(tensors, str(tmp_path / "model.safetensors"))
    with pytest.raises(CheckpointError, match=r"'model.norm.weight'.*\(7,\)"):
        Checkpoint(tmp_path).read_group("head")


def test_sharded_checkpoint_reads_like_single_file(
    tmp_path: Path, ckpts: dict[str, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(synth, "MAX_SHARD_BYTES", 1_000_000)
    sharded = synth.synthesize(tmp_path / "sharded", "tiny", seed=1)
    index = json.loads((sharded / "model.safetensors.index.json").read_text())
    shard_files = sorted(set(index["weight_map"].values()))
    assert len(shard_files) > 1 and not (sharded / "model.safetensors").exists()
    # Whole groups per shard, so one group never spans files.
    assert all(
        len({index["weight_map"][n] for n in group_tensor_shapes(synth.PRESETS["tiny"], g)}) == 1
        for g in param_groups(synth.PRESETS["tiny"])
    )
    single = dict(iter_groups(ckpts["untied-gqa"]))
    for name, tensors in iter_groups(sharded):
        for tname, t in tensors.items():
            assert torch.equal(t, single[name][tname]), tname


# ---- synthetic checkpoints ---------------------------------------------------------------------


def test_synth_is_deterministic_and_idempotent(tmp_path: Path, ckpts: dict[str, Path]) -> None:
    again = synth.synthesize(tmp_path / "again", "tiny", seed=1)
    for file in ("model.safetensors", "tokenizer.json", "config.json", "tokenizer_config.json"):
        assert (again / file).read_bytes() == (ckpts["untied-gqa"] / file).read_bytes(), file
    other_seed = synth.synthesize(tmp_path / "seed2", "tiny", seed=2)
    assert (other_seed / "model.safetensors").read_bytes() != (again / "model.safetensors").read_bytes()

    stamp = (again / "model.safetensors").stat().st_mtime_ns
    assert synth.synthesize(again, "tiny", seed=1) == again
    assert (again / "model.safetensors").stat().st_mtime_ns == stamp  # untouched
    with pytest.raises(FileExistsError, match="seed=3"):
        synth.synthesize(again, "tiny", seed=3)
    synth.synthesize(again, "tiny", seed=3, force=True)
    assert json.loads((again / synth.MARKER_FILE).read_text())["seed"] == 3


def test_synth_cli(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert synth.main(["--out", str(tmp_path / "m"), "--preset", "tiny", "--seed", "4"]) == 0
    assert "params=" in capsys.readouterr().out
    assert load_config(tmp_path / "m") == synth.PRESETS["tiny"]
    assert synth.main(["--out", str(tmp_path / "m"), "--preset", "tiny", "--seed", "5"]) == 2


# ---- the decoder against transformers ------------------------------------------------------------


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_logits_match_transformers(ckpts: dict[str, Path], variant: str) -> None:
    transformers = pytest.importorskip("transformers")
    path = ckpts[variant]
    hf = transformers.LlamaForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()
    ours = load_model(str(path))
    assert ours.is_complete and ours.num_layers_loaded == ours.config.num_hidden_layers
    ids = _ids(45, batch=2)
    with torch.no_grad():
        expected = hf(ids).logits
    got = ours(ids)
    assert got.shape == expected.shape == (2, 45, ours.config.vocab_size)
    torch.testing.assert_close(got, expected, atol=HF_ATOL, rtol=0)
    # Single sequence, unbatched input.
    torch.testing.assert_close(ours(ids[0]), expected[0], atol=HF_ATOL, rtol=0)


def test_layer_ranges_compose_into_full_forward(ckpts: dict[str, Path]) -> None:
    """A partial instance runs [0, k) and hands hidden states to a full one for [k, L) (ZigZag)."""
    path = ckpts["untied-gqa"]
    ckpt = Checkpoint(path)
    full = load_model(str(path))
    cfg = full.config
    k = 1
    partial = LlamaForCausalLM(cfg)
    assert partial.loaded_groups == [] and partial.num_layers_loaded == 0 and not partial.is_complete
    partial.load_groups(ckpt.iter_groups(["embed", "layers.0"]))
    assert partial.num_layers_loaded == k and not partial.is_complete
    ids = _ids(30, seed=3)[0]
    batch = ForwardBatch.build([30])
    hidden = partial.run_layers(partial.embed(ids), 0, k, batch)
    with pytest.raises(RuntimeError, match="layers.1"):
        partial.run_layers(hidden, k, cfg.num_hidden_layers, batch)
    logits = full.head(full.run_layers(hidden, k, cfg.num_hidden_layers, batch))
    torch.testing.assert_close(logits, full(ids), atol=1e-5, rtol=0)


def test_out_of_order_groups_count_only_the_contiguous_prefix(ckpts: dict[str, Path]) -> None:
    ckpt = Checkpoint(ckpts["untied-gqa"])
    model = LlamaForCausalLM(ckpt.config)
    model.load_groups(ckpt.iter_groups(["layers.1", "head"]))
    assert model.num_layers_loaded == 0
    assert model.loaded_groups == ["layers.1", "head"]
    model.load_groups(ckpt.iter_groups(["layers.0", "embed"]))
    assert model.num_layers_loaded == 2 and model.is_complete


def test_load_group_rejects_mismatched_tensors(ckpts: dict[str, Path]) -> None:
    ckpt = Checkpoint(ckpts["untied-gqa"])
    model = LlamaForCausalLM(ckpt.config)
    tensors = ckpt.read_group("layers.0")
    tensors["model.layers.0.mlp.down_proj.weight"] = torch.zeros(3, 3)
    with pytest.raises(ValueError, match=r"'model.layers.0.mlp.down_proj.weight'.*\(3, 3\)"):
        model.load_group("layers.0", tensors)
    with pytest.raises(ValueError, match="'model.layers.1.input_layernorm.weight'"):
        model.load_group("layers.0", {**ckpt.read_group("layers.0"), **ckpt.read_group("layers.1")})
    assert model.loaded_groups == []


def test_export_group_returns_checkpoint_tensors(ckpts: dict[str, Path]) -> None:
    ckpt = Checkpoint(ckpts["tied-gqa"])
    model = load_model(str(ckpts["tied-gqa"]))
    for name, tensors in ckpt.iter_groups():
        exported = model.export_group(name)
        assert list(exported) == list(tensors)
        for tname, t in tensors.items():
            assert torch.equal(exported[tname], t), tname


@pytest.fixture(params=["native", "torch"])
def decode_attention(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """Run a test with the native decode-attention kernel and with the torch path (SDPA over a
    padded gather, decodes bucketed by length)."""
    if request.param == "native":
        if native.paged_decode() is None:
            pytest.skip("native paged attention cannot be built here")
    else:
        monkeypatch.setattr(native, "paged_decode", lambda: None)
    return str(request.param)


def test_paged_prefill_and_decode_match_reference(ckpts: dict[str, Path], decode_attention: str) -> None:
    """Chunked prefill and batched decode through the paged cache give the no-cache logits."""
    model = load_model(str(ckpts["untied-gqa"]))
    kv = KVCache.for_model(model.config, num_blocks=32, block_size=4)
    seqs = {"a": _ids(13, seed=5)[0], "b": _ids(6, seed=6)[0], "c": _ids(9, seed=7)[0]}
    ref = {name: model(ids) for name, ids in seqs.items()}
    # Step 1: a's first 8 tokens and all of b, in one flat batch.
    # Step 2: the rest of a, one decode token of b, all of c.
    plan = [{"a": (0, 8), "b": (0, 5)}, {"a": (8, 13), "b": (5, 6), "c": (0, 9)}]
    for step in plan:
        names = list(step)
        for n in names:
            if not kv.has(n):
                kv.allocate(n, 0)
            kv.extend(n, step[n][1])
        batch = ForwardBatch.build(
            [e - s for s, e in step.values()],
            [s for s, _ in step.values()],
            [kv.block_table(n) for n in names],
            kv.block_size,
        )
        ids = torch.cat([seqs[n][s:e] for n, (s, e) in step.items()])
        logits = model.forward_batch(ids, batch, kv)
        for row, n in enumerate(names):
            end = step[n][1]
            torch.testing.assert_close(logits[row], ref[n][end - 1], atol=1e-5, rtol=0)


def test_batched_decode_of_mixed_lengths_matches_reference(ckpts: dict[str, Path], decode_attention: str) -> None:
    """Prompts of very different lengths prefilled together (no padding between them), then
    decoded together for a few steps: every step's logits equal the no-cache forward's."""
    model = load_model(str(ckpts["untied-gqa"]))
    kv = KVCache.for_model(model.config, num_blocks=128, block_size=4)
    lengths = [1, 3, 17, 40, 5, 64, 2, 33]
    seqs = [_ids(n + 4, seed=20 + i)[0] for i, n in enumerate(lengths)]
    names = [f"s{i}" for i in range(len(seqs))]
    for name in names:
        kv.allocate(name, 0)
    done = [0] * len(seqs)
    for step in range(5):
        q_lens = [lengths[i] if step == 0 else 1 for i in range(len(seqs))]
        for i, name in enumerate(names):
            kv.extend(name, done[i] + q_lens[i])
        batch = ForwardBatch.build(q_lens, done, [kv.block_table(n) for n in names], kv.block_size)
        ids = torch.cat([seqs[i][done[i] : done[i] + q_lens[i]] for i in range(len(seqs))])
        logits = model.forward_batch(ids, batch, kv)
        for i in range(len(seqs)):
            done[i] += q_lens[i]
            expected = model(seqs[i][: done[i]])[-1]
            torch.testing.assert_close(logits[i], expected, atol=1e-5, rtol=0)


def test_decode_buckets_partition_by_length() -> None:
    ctx = (3, 500, 7, 480, 10, 20, 490)
    buckets = _bucket_by_length(list(range(len(ctx))), ctx, 16)
    assert sorted(b for bucket in buckets for b in bucket) == list(range(len(ctx)))
    # The long contexts are not padded together with the short ones.
    assert {1, 3, 6} in [set(bucket) for bucket in buckets]
    assert _bucket_by_length([0, 1], (5, 6), 16) == [[0, 1]]  # splitting would save nothing


def test_native_paged_decode_matches_sdpa() -> None:
    kernel = native.paged_decode()
    if kernel is None:
        pytest.skip("native paged attention cannot be built here")
    g = torch.Generator().manual_seed(3)
    for heads, kv_heads, d in ((12, 4, 64), (6, 6, 36)):
        blocks, bs = 80, 16
        k = torch.randn(blocks, bs, kv_heads, d, generator=g)
        v = torch.randn(blocks, bs, kv_heads, d, generator=g)
        lens = torch.tensor([1, 15, 16, 17, 200])
        tables = torch.randperm(blocks, generator=g)[: 5 * 13].view(5, 13)
        q = torch.randn(5, heads, d, generator=g)
        got = kernel(q, k, v, tables, lens, 200)
        for s in range(5):
            want = native.reference_decode(q[s], k, v, tables[s], int(lens[s]))
            torch.testing.assert_close(got[s], want, atol=1e-5, rtol=1e-5)
        bad = tables.clone()
        bad[0, 0] = blocks
        with pytest.raises(ValueError, match="block ids"):
            kernel(q, k, v, bad, lens, 200)


@pytest.mark.parametrize("pack_weights", [True, False])
def test_long_batch_matches_transformers(ckpts: dict[str, Path], pack_weights: bool) -> None:
    """Enough tokens in one batch that the large-batch GEMM path runs, with and without packed
    weights."""
    transformers = pytest.importorskip("transformers")
    path = ckpts["untied-gqa"]
    hf = transformers.LlamaForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()
    ckpt = Checkpoint(path)
    ours = LlamaForCausalLM(ckpt.config, pack_weights=pack_weights)
    ours.load_groups(ckpt.iter_groups())
    ids = _ids(300, batch=2, seed=4)
    with torch.no_grad():
        expected = hf(ids).logits
    torch.testing.assert_close(ours(ids), expected, atol=HF_ATOL, rtol=0)


def test_bfloat16_is_honoured_and_close(ckpts: dict[str, Path]) -> None:
    ckpt = Checkpoint(ckpts["untied-gqa"])
    model = LlamaForCausalLM(ckpt.config, dtype=torch.bfloat16)
    model.load_groups(ckpt.iter_groups())
    assert model.export_group("embed")["model.embed_tokens.weight"].dtype == torch.bfloat16
    ids = _ids(20, seed=8)[0]
    reference = load_model(str(ckpts["untied-gqa"]))(ids)
    # bfloat16 keeps 8 bits of mantissa: logits of magnitude ~1 agree to a few 1e-2.
    torch.testing.assert_close(model(ids), reference, atol=0.1, rtol=0)
