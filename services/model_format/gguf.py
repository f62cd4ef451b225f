"""Convert a Llama-family GGUF file (llama.cpp's single-file format) into an HF checkpoint directory.

Accepted: `general.architecture == "llama"`, dense (Llama 1/2/3, SmolLM, TinyLlama, Mistral 7B as
llama.cpp writes them), tensors in F32, F16, BF16, Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q2_K, Q3_K, Q4_K,
Q5_K or Q6_K, and a `gpt2` (byte-level BPE) or `llama` (SentencePiece BPE with byte fallback)
tokenizer. Anything else is refused by name. The directory written (`config.json`,
`*.safetensors`, `tokenizer.json`, `tokenizer_config.json`, `generation_config.json`) is what
`services.model_format.checkpoint` and transformers read. It appears whole or not at all: it is
built next to its target and renamed into place.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import json
import os
import shutil
import tempfile
import time
from collections import Counter
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import structlog
import torch
from gguf import GGMLQuantizationType, GGUFReader, ReaderTensor
from gguf.quants import dequantize
from safetensors import SafetensorError
from safetensors.torch import save_file
from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers, processors
from tokenizers.pre_tokenizers import PreTokenizer

from services.model_format.config import LlamaConfig
from services.model_format.groups import EMBED_WEIGHT, LM_HEAD_WEIGHT, NORM_WEIGHT, group_tensor_shapes, param_groups
from services.model_format.tokenizer import _bytes_to_unicode

log = structlog.get_logger(__name__)

SUPPORTED_ARCHITECTURES = ("llama",)
SUPPORTED_TENSOR_TYPES: tuple[GGMLQuantizationType, ...] = tuple(
    GGMLQuantizationType[name]
    for name in ("F32", "F16", "BF16", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K")
)
DTYPES: dict[str, torch.dtype] = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}

# Written last into every converted directory: what it was made from, by which converter version.
MARKER_FILE = "blitzmesh_gguf.json"
# Bump when the files written for the same GGUF change, so stale conversions are redone.
FORMAT_VERSION = 1
# Above this many bytes of weights the checkpoint is split into shards with an index, like HF.
MAX_SHARD_BYTES = 2 * 1024**3

# llama.cpp token types (`tokenizer.ggml.token_type`).
TOKEN_NORMAL, TOKEN_UNKNOWN, TOKEN_CONTROL, TOKEN_USER_DEFINED, TOKEN_UNUSED, TOKEN_BYTE = 1, 2, 3, 4, 5, 6

# GGUF tensor name -> HF name. Per layer: `blk.{i}.{key}.weight` -> `model.layers.{i}.{value}.weight`.
_GLOBAL_TENSORS = {
    "token_embd.weight": EMBED_WEIGHT,
    "output_norm.weight": NORM_WEIGHT,
    "output.weight": LM_HEAD_WEIGHT,
}
_LAYER_TENSORS = {
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

# Pre-tokenizers of byte-level vocabularies, by `tokenizer.ggml.pre`, as llama.cpp splits text
# (llama-vocab.cpp). These regexes are the ones the models' own tokenizer.json files use.
_GPT2_PRE = ("gpt2", "mpt", "olmo", "jais")
# "\p{N}" isolated first, then the GPT-2 split: HF writes this as Digits(individual_digits=True).
_DIGITS_PRE = ("smollm", "starcoder", "refact", "command-r", "codeshell", "exaone", "minerva")
_LLAMA3_PRE = ("llama3", "llama-v3", "llama-bpe", "smaug-bpe", "falcon3", "pixtral")
_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
SUPPORTED_PRE_TOKENIZERS = (*_GPT2_PRE, *_DIGITS_PRE, *_LLAMA3_PRE)


class GGUFError(ValueError):
    """A GGUF file that cannot be converted: unreadable, truncated, or describing an unsupported model."""


@dataclass(frozen=True)
class ConversionResult:
    """What `convert_gguf` wrote."""

    path: Path
    config: LlamaConfig
    tensor_types: dict[str, int]  # GGUF tensor type name -> count
    duration_s: float


# ---- reading --------------------------------------------------------------------------------------


def read_gguf(path: str | Path) -> GGUFReader:
    """Open a GGUF file; a truncated or corrupt one raises GGUFError naming the file."""
    file = Path(path)
    if not file.is_file():
        raise FileNotFoundError(f"GGUF file not found: {str(file)!r}")
    try:
        reader = GGUFReader(file)
    except (ValueError, IndexError, TypeError, KeyError, OverflowError, MemoryError) as exc:
        # The reader memory-maps the file and parses as it goes: a file cut short or a damaged
        # header shows up as a failed reshape, a bad magic or an impossible length.
        raise GGUFError(f"{str(file)!r} is not a readable GGUF file (truncated or corrupt): {exc}") from exc
    size = file.stat().st_size
    for t in reader.tensors:
        if t.data_offset + t.n_bytes > size:
            raise GGUFError(
                f"{str(file)!r} is truncated: tensor {t.name!r} ends at byte {t.data_offset + t.n_bytes}, "
                f"the file has {size}"
            )
    return reader


def gguf_metadata(reader: GGUFReader) -> dict[str, Any]:
    """All key/value metadata of a GGUF file as Python values (arrays as lists)."""
    meta: dict[str, Any] = {}
    for key, field in reader.fields.items():
        try:
            meta[key] = field.contents()
        except (ValueError, IndexError, UnicodeDecodeError) as exc:
            raise GGUFError(f"GGUF metadata key {key!r} cannot be read: {exc}") from exc
    return meta


def _get(meta: Mapping[str, Any], key: str, kind: type | tuple[type, ...], default: Any = ...) -> Any:
    """`meta[key]` checked to be of `kind`; a missing required key or a wrong type is a GGUFError."""
    if key not in meta:
        if default is ...:
            raise GGUFError(f"GGUF metadata lacks required key {key!r}")
        return default
    value = meta[key]
    if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
        raise GGUFError(f"GGUF metadata {key!r} should be {getattr(kind, '__name__', kind)}, got {value!r}")
    return value


# ---- config ---------------------------------------------------------------------------------------


def _architecture(meta: Mapping[str, Any]) -> str:
    arch = _get(meta, "general.architecture", str)
    if arch not in SUPPORTED_ARCHITECTURES:
        raise GGUFError(
            f"GGUF architecture {arch!r} is not supported; this converter accepts {list(SUPPORTED_ARCHITECTURES)}"
        )
    return arch


def _rope_scaling(meta: Mapping[str, Any], arch: str) -> dict[str, Any] | None:
    """HF rope parameters for `{arch}.rope.scaling.*`, None when the file has no scaling."""
    kind = meta.get(f"{arch}.rope.scaling.type")
    if kind in (None, "none"):
        return None
    factor = float(_get(meta, f"{arch}.rope.scaling.factor", (int, float)))
    if kind == "linear":
        return {"rope_type": "linear", "factor": factor}
    if kind == "yarn":
        scaling: dict[str, Any] = {
            "rope_type": "yarn",
            "factor": factor,
            "original_max_position_embeddings": _get(meta, f"{arch}.rope.scaling.original_context_length", int),
        }
        for gguf_key, hf_key in (("yarn_beta_fast", "beta_fast"), ("yarn_beta_slow", "beta_slow")):
            if f"{arch}.rope.scaling.{gguf_key}" in meta:
                scaling[hf_key] = float(meta[f"{arch}.rope.scaling.{gguf_key}"])
        return scaling
    raise GGUFError(f"GGUF {arch}.rope.scaling.type={kind!r} is not supported (only 'none', 'linear', 'yarn')")


def _token_id(meta: Mapping[str, Any], name: str, vocab_size: int) -> int | None:
    key = f"tokenizer.ggml.{name}_token_id"
    value = _get(meta, key, int, None)
    if value is not None and not 0 <= value < vocab_size:
        raise GGUFError(f"GGUF {key}={value} is outside the vocabulary (size {vocab_size})")
    return value


def eos_token_ids(meta: Mapping[str, Any], vocab_size: int) -> list[int]:
    """Every id that ends generation: EOS, end-of-turn and end-of-message, in that order, once each."""
    ids: list[int] = []
    for name in ("eos", "eot", "eom"):
        value = _token_id(meta, name, vocab_size)
        if value is not None and value not in ids:
            ids.append(value)
    return ids


def hf_config(meta: Mapping[str, Any], tensors: Mapping[str, ReaderTensor], dtype: str) -> dict[str, Any]:
    """The HF `config.json` a GGUF file describes (transformers 4.x and 5.x keys)."""
    arch = _architecture(meta)

    def key(name: str, kind: type | tuple[type, ...] = int, default: Any = ...) -> Any:
        return _get(meta, f"{arch}.{name}", kind, default)

    if key("expert_count", int, 0) > 0:
        raise GGUFError(
            f"GGUF {arch}.expert_count={meta[f'{arch}.expert_count']} (mixture of experts) is not supported"
        )
    if "rope_freqs.weight" in tensors:
        raise GGUFError("GGUF tensor 'rope_freqs.weight' (Llama 3.1-style per-frequency RoPE factors) is not supported")
    hidden = key("embedding_length")
    heads = key("attention.head_count")
    kv_heads = key("attention.head_count_kv", int, heads)
    head_dim = key("attention.key_length", int, None)
    if head_dim is None:
        if hidden % heads:
            raise GGUFError(f"GGUF {arch}.embedding_length={hidden} is not a multiple of head_count={heads}")
        head_dim = hidden // heads
    value_dim = key("attention.value_length", int, head_dim)
    if value_dim != head_dim:
        raise GGUFError(f"GGUF {arch}.attention.value_length={value_dim} differs from key_length={head_dim}")
    rope_dim = key("rope.dimension_count", int, head_dim)
    if rope_dim != head_dim:
        raise GGUFError(f"GGUF {arch}.rope.dimension_count={rope_dim} != head_dim={head_dim} (partial RoPE)")
    embed = tensors.get("token_embd.weight")
    if embed is None:
        raise GGUFError("GGUF file has no tensor 'token_embd.weight'")
    vocab = int(embed.shape[1])
    declared_vocab = key("vocab_size", int, vocab)
    if declared_vocab != vocab:
        raise GGUFError(f"GGUF {arch}.vocab_size={declared_vocab} but token_embd.weight has {vocab} rows")
    rope_theta = float(key("rope.freq_base", (int, float), 10000.0))
    rope_parameters: dict[str, Any] = {"rope_type": "default", "rope_theta": rope_theta}
    scaling = _rope_scaling(meta, arch)
    if scaling is not None:
        rope_parameters = {**scaling, "rope_theta": rope_theta}
    eos = _token_id(meta, "eos", vocab)
    config: dict[str, Any] = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": vocab,
        "hidden_size": hidden,
        "intermediate_size": key("feed_forward_length"),
        "num_hidden_layers": key("block_count"),
        "num_attention_heads": heads,
        "num_key_value_heads": kv_heads,
        "head_dim": head_dim,
        "hidden_act": "silu",
        "max_position_embeddings": key("context_length"),
        # float32 in the file; kept as read (9.999999747378752e-06, not 1e-5), as transformers does.
        "rms_norm_eps": float(key("attention.layer_norm_rms_epsilon", (int, float))),
        "rope_theta": rope_theta,
        "rope_parameters": rope_parameters,
        "attention_bias": False,
        "mlp_bias": False,
        "tie_word_embeddings": "output.weight" not in tensors,
        "bos_token_id": _token_id(meta, "bos", vocab),
        "eos_token_id": eos,
        "torch_dtype": dtype,
        "dtype": dtype,
        "use_cache": True,
    }
    if scaling is not None:
        config["rope_scaling"] = scaling  # transformers 4.x reads this one
    pad = _token_id(meta, "padding", vocab)
    if pad is not None:
        config["pad_token_id"] = pad
    return config


def _geometry(config: Mapping[str, Any]) -> LlamaConfig:
    """The loader's own view of the geometry; its validation errors become GGUFErrors."""
    try:
        return LlamaConfig(
            vocab_size=config["vocab_size"],
            hidden_size=config["hidden_size"],
            intermediate_size=config["intermediate_size"],
            num_hidden_layers=config["num_hidden_layers"],
            num_attention_heads=config["num_attention_heads"],
            num_key_value_heads=config["num_key_value_heads"],
            head_dim=config["head_dim"],
            max_position_embeddings=config["max_position_embeddings"],
            tie_word_embeddings=config["tie_word_embeddings"],
            torch_dtype=config["torch_dtype"],
        )
    except ValueError as exc:
        raise GGUFError(f"GGUF metadata describes an invalid model: {exc}") from exc


# ---- tensors --------------------------------------------------------------------------------------


def hf_tensor_name(gguf_name: str) -> str:
    """HF name of a GGUF tensor name; GGUFError for one this converter does not know."""
    if gguf_name in _GLOBAL_TENSORS:
        return _GLOBAL_TENSORS[gguf_name]
    parts = gguf_name.split(".")
    if len(parts) == 4 and parts[0] == "blk" and parts[1].isdigit() and parts[3] == "weight":
        mapped = _LAYER_TENSORS.get(parts[2])
        if mapped is not None:
            return f"model.layers.{int(parts[1])}.{mapped}.weight"
    raise GGUFError(f"GGUF tensor {gguf_name!r} is not part of a dense Llama model (biases, experts, ...)")


def unpermute_rows(weight: np.ndarray, n_head: int) -> np.ndarray:
    """Undo llama.cpp's Q/K row order (convert_hf_to_gguf's `permute`).

    llama.cpp rotates adjacent channel pairs (GPT-J style), HF rotates the two halves of each head;
    the converter to GGUF reorders each head's rows from [half0, half1] to interleaved pairs. This
    puts them back: per head, rows (pair i, element j) return to (half j, position i).
    """
    rows = weight.shape[0]
    if rows % (2 * n_head):
        raise GGUFError(f"cannot un-permute {rows} rows into {n_head} heads of even size")
    return weight.reshape(n_head, rows // n_head // 2, 2, *weight.shape[1:]).swapaxes(1, 2).reshape(weight.shape)


def dequantize_tensor(t: ReaderTensor) -> np.ndarray:
    """A GGUF tensor as float32 in HF shape (GGUF lists dimensions innermost first)."""
    if t.tensor_type not in SUPPORTED_TENSOR_TYPES:
        supported = ", ".join(q.name for q in SUPPORTED_TENSOR_TYPES)
        raise GGUFError(
            f"GGUF tensor {t.name!r} has type {t.tensor_type.name}, which is not supported (supported: {supported})"
        )
    shape = tuple(int(d) for d in reversed(t.shape.tolist()))
    values = dequantize(t.data, t.tensor_type)
    if values.size != int(np.prod(shape)):
        raise GGUFError(f"GGUF tensor {t.name!r} holds {values.size} values, its shape {shape} needs {np.prod(shape)}")
    # A copy: the reader's arrays are read-only views of the memory-mapped file.
    return np.array(values, dtype=np.float32).reshape(shape)


def _hf_tensors(
    tensors: Mapping[str, ReaderTensor], config: Mapping[str, Any], names: Sequence[str], dtype: torch.dtype
) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield `(hf_name, tensor)` for the HF names asked for, dequantized, un-permuted, cast."""
    by_hf = {hf_tensor_name(name): t for name, t in tensors.items()}
    for name in names:
        t = by_hf[name]
        values = dequantize_tensor(t)
        if name.endswith("self_attn.q_proj.weight"):
            values = unpermute_rows(values, config["num_attention_heads"])
        elif name.endswith("self_attn.k_proj.weight"):
            values = unpermute_rows(values, config["num_key_value_heads"])
        yield name, torch.from_numpy(values).to(dtype).contiguous()


def _check_tensors(tensors: Mapping[str, ReaderTensor], geometry: LlamaConfig) -> list[str]:
    """HF tensor names in load order, after checking the file has exactly these, with these shapes."""
    expected: dict[str, tuple[int, ...]] = {}
    for group in param_groups(geometry):
        expected.update(group_tensor_shapes(geometry, group))
    found: dict[str, str] = {}
    for name in tensors:
        found[hf_tensor_name(name)] = name
    missing = [name for name in expected if name not in found]
    if missing:
        raise GGUFError(f"GGUF file lacks tensors for {missing[:5]!r} ({len(missing)} missing)")
    extra = [found[name] for name in found if name not in expected]
    if extra:
        raise GGUFError(f"GGUF tensors {extra[:5]!r} do not fit a {geometry.num_hidden_layers}-layer model")
    for name, shape in expected.items():
        t = tensors[found[name]]
        got = tuple(int(d) for d in reversed(t.shape.tolist()))
        if got != shape:
            raise GGUFError(f"GGUF tensor {found[name]!r} has shape {got}, the metadata implies {shape}")
    return list(expected)


# ---- tokenizer ------------------------------------------------------------------------------------


def _byte_level_pre_tokenizer(pre: str) -> tuple[PreTokenizer, bool]:
    """(pre-tokenizer, ignore_merges) of a byte-level vocabulary with `tokenizer.ggml.pre == pre`."""
    if pre in _GPT2_PRE:
        return pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True), False
    if pre in _DIGITS_PRE:
        digits = pre_tokenizers.Digits(individual_digits=True)
        return pre_tokenizers.Sequence(
            [digits, pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)]
        ), False
    if pre in _LLAMA3_PRE:
        split = pre_tokenizers.Split(Regex(_LLAMA3_SPLIT), behavior="isolated")
        byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
        # llama.cpp and Llama 3's own tokenizer.json look whole words up before merging.
        return pre_tokenizers.Sequence([split, byte_level]), True
    raise GGUFError(
        f"GGUF tokenizer.ggml.pre={pre!r} is not supported for a byte-level vocabulary "
        f"(supported: {list(SUPPORTED_PRE_TOKENIZERS)})"
    )


def _merges(meta: Mapping[str, Any]) -> list[tuple[str, str]]:
    merges = []
    for merge in _get(meta, "tokenizer.ggml.merges", list):
        parts = merge.split(" ")
        if len(parts) != 2 or not all(parts):
            raise GGUFError(f"GGUF tokenizer.ggml.merges holds {merge!r}, not two tokens separated by one space")
        merges.append((parts[0], parts[1]))
    return merges


def _merges_from_scores(vocab: Mapping[str, int], scores: Sequence[float]) -> list[tuple[str, str]]:
    """BPE merges a SentencePiece vocabulary implies: every split of a token into two tokens,
    best-scored result first (the order transformers' `generate_merges` gives)."""
    by_token = {token: scores[i] for token, i in vocab.items()}
    merges: list[tuple[str, str, float]] = []
    for token, score in by_token.items():
        local = [
            (token[:k], token[k:], score) for k in range(1, len(token)) if token[:k] in vocab and token[k:] in vocab
        ]
        local.sort(key=lambda m: (vocab[m[0]], vocab[m[1]]))
        merges.extend(local)
    merges.sort(key=lambda m: (m[2], len(m[0]), len(m[1])), reverse=True)
    return [(left, right) for left, right, _ in merges]


def _vocab(tokens: Sequence[str], respell: Callable[[str], str] | None = None) -> dict[str, int]:
    vocab: dict[str, int] = {}
    duplicates = []
    for i, token in enumerate(tokens):
        spelled = respell(token) if respell else token
        if spelled in vocab:
            duplicates.append((spelled, vocab[spelled], i))
        vocab[spelled] = i
    if duplicates:
        # The later id wins, as in transformers' conversion; the earlier one can still be decoded.
        log.warning("gguf_duplicate_tokens", count=len(duplicates), first=duplicates[:3])
    return vocab


def build_tokenizer(meta: Mapping[str, Any]) -> Tokenizer:
    """The `tokenizers` tokenizer a GGUF file's `tokenizer.ggml.*` metadata describes."""
    kind = _get(meta, "tokenizer.ggml.model", str)
    tokens: list[str] = _get(meta, "tokenizer.ggml.tokens", list)
    types: list[int] = _get(meta, "tokenizer.ggml.token_type", list, [TOKEN_NORMAL] * len(tokens))
    if len(types) != len(tokens):
        raise GGUFError(f"GGUF has {len(tokens)} tokens but {len(types)} token types")
    if kind == "gpt2":
        table = _bytes_to_unicode()
        alphabet = set(table.values())

        def respell(token: str) -> str:
            # A token with characters outside the byte alphabet is stored as raw text; the
            # byte-level model looks tokens up by their byte spelling.
            return token if set(token) <= alphabet else "".join(table[b] for b in token.encode("utf-8"))

        vocab = _vocab(tokens, respell)
        pre, ignore_merges = _byte_level_pre_tokenizer(_get(meta, "tokenizer.ggml.pre", str, "(missing)"))
        tok = Tokenizer(models.BPE(vocab=vocab, merges=_merges(meta), ignore_merges=ignore_merges))
        tok.pre_tokenizer = pre
        tok.decoder = decoders.ByteLevel()
        special_chars: set[str] | None = alphabet
    elif kind == "llama":
        vocab = _vocab(tokens)
        scores = _get(meta, "tokenizer.ggml.scores", list)
        if len(scores) != len(tokens):
            raise GGUFError(f"GGUF has {len(tokens)} tokens but {len(scores)} scores")
        merges = _merges(meta) if "tokenizer.ggml.merges" in meta else _merges_from_scores(vocab, scores)
        unk = _token_id(meta, "unknown", len(tokens))
        tok = Tokenizer(
            models.BPE(
                vocab=vocab,
                merges=merges,
                unk_token=tokens[unk] if unk is not None else None,
                fuse_unk=True,
                byte_fallback=True,
            )
        )
        prefix = _get(meta, "tokenizer.ggml.add_space_prefix", bool, True)
        tok.pre_tokenizer = pre_tokenizers.Metaspace(
            replacement="\u2581", prepend_scheme="first" if prefix else "never", split=False
        )
        steps = [decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse()]
        if prefix:
            steps.append(decoders.Strip(content=" ", left=1, right=0))
        tok.decoder = decoders.Sequence(steps)
        special_chars = None
    else:
        raise GGUFError(
            f"GGUF tokenizer.ggml.model={kind!r} is not supported (supported: 'gpt2' byte-level BPE, "
            "'llama' SentencePiece)"
        )
    # Control tokens stay whole and are special (skipped when decoding for output); user-defined
    # ones stay whole but are text. A byte-level "control" token outside the byte alphabet is a
    # llama.cpp mislabel that the model never saw as one token: left to the BPE.
    special_ids = {_token_id(meta, n, len(tokens)) for n in ("bos", "eos", "eot", "eom", "unknown", "padding")}
    control = [
        AddedToken(token, normalized=False, special=True)
        for i, (token, kind_id) in enumerate(zip(tokens, types, strict=True))
        if (kind_id == TOKEN_CONTROL or (i in special_ids and kind_id != TOKEN_BYTE))
        and (special_chars is None or set(token) <= special_chars)
    ]
    if control:
        tok.add_special_tokens(control)
    user = [
        AddedToken(token, normalized=False, special=False)
        for token, kind_id in zip(tokens, types, strict=True)
        if kind_id == TOKEN_USER_DEFINED and token in vocab
    ]
    if user:
        tok.add_tokens(user)
    if tok.get_vocab_size(with_added_tokens=True) != len(tokens):
        raise GGUFError(
            f"tokenizer built from the GGUF has {tok.get_vocab_size(with_added_tokens=True)} ids, the file lists "
            f"{len(tokens)} tokens"
        )
    tok.post_processor = _post_processor(meta, tokens, kind)
    return tok


def _add_flags(meta: Mapping[str, Any], kind: str) -> tuple[bool, bool]:
    # Without a flag llama.cpp adds BOS to a SentencePiece vocabulary and not to a byte-level one.
    add_bos = _get(meta, "tokenizer.ggml.add_bos_token", bool, kind == "llama")
    add_eos = _get(meta, "tokenizer.ggml.add_eos_token", bool, False)
    return add_bos, add_eos


def _post_processor(meta: Mapping[str, Any], tokens: Sequence[str], kind: str) -> processors.PostProcessor:
    add_bos, add_eos = _add_flags(meta, kind)
    specials: list[tuple[str, int]] = []
    before: list[str] = []
    after: list[str] = []
    for wanted, name, where in ((add_bos, "bos", before), (add_eos, "eos", after)):
        if wanted:
            token_id = _token_id(meta, name, len(tokens))
            if token_id is None:
                raise GGUFError(f"GGUF tokenizer.ggml.add_{name}_token is set but {name}_token_id is missing")
            where.append(tokens[token_id])
            specials.append((tokens[token_id], token_id))
    single = [*before, "$A", *after]
    pair = [*single, *before, "$B:1", *after]
    return processors.TemplateProcessing(single=single, pair=pair, special_tokens=list(dict.fromkeys(specials)))


def tokenizer_config(meta: Mapping[str, Any], max_length: int) -> dict[str, Any]:
    """`tokenizer_config.json`: special tokens, BOS/EOS flags and the chat template."""
    kind = _get(meta, "tokenizer.ggml.model", str)
    tokens = meta["tokenizer.ggml.tokens"]
    add_bos, add_eos = _add_flags(meta, kind)
    cfg: dict[str, Any] = {"tokenizer_class": "PreTrainedTokenizerFast"}
    for hf_name, gguf_name in (("bos", "bos"), ("eos", "eos"), ("unk", "unknown"), ("pad", "padding")):
        token_id = _token_id(meta, gguf_name, len(tokens))
        if token_id is not None:
            cfg[f"{hf_name}_token"] = tokens[token_id]
    cfg.update(
        add_bos_token=add_bos,
        add_eos_token=add_eos,
        model_max_length=max_length,
        clean_up_tokenization_spaces=False,
    )
    template = _get(meta, "tokenizer.chat_template", str, None)
    if template is not None:
        cfg["chat_template"] = template
    return cfg


# ---- writing --------------------------------------------------------------------------------------


def _write_json(path: Path, data: Mapping[str, Any]) -> None:
    path.write_text(json.dumps(data, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        for chunk in iter(lambda: f.read(16 * 1024 * 1024), b""):
            digest.update(chunk)
    return digest.hexdigest()


def _save_safetensors(tensors: dict[str, torch.Tensor], path: Path, metadata: dict[str, str]) -> None:
    """`save_file`, with its I/O failures (which name no path and are no OSError) raised as the
    OSError they are, naming the file: a full disk reads "No space left on device: <path>"."""
    try:
        save_file(tensors, str(path), metadata=metadata)
    except SafetensorError as e:
        text = str(e)
        code = errno.ENOSPC if "os error 28" in text or "No space left" in text else errno.EIO
        raise OSError(code, f"{os.strerror(code)} writing {path} ({text})", str(path)) from e


def _write_weights(
    tensors: Mapping[str, ReaderTensor], config: Mapping[str, Any], names: Sequence[str], dtype: torch.dtype, out: Path
) -> None:
    """Write `model.safetensors`, or shards of whole tensors with an index above MAX_SHARD_BYTES."""
    elem = torch.empty((), dtype=dtype).element_size()
    by_hf = {hf_tensor_name(name): t for name, t in tensors.items()}
    sizes = {name: int(by_hf[name].n_elements) * elem for name in names}
    shards: list[list[str]] = [[]]
    acc = 0
    for name in names:
        if shards[-1] and acc + sizes[name] > MAX_SHARD_BYTES:
            shards.append([])
            acc = 0
        shards[-1].append(name)
        acc += sizes[name]
    meta = {"format": "pt"}
    if len(shards) == 1:
        _save_safetensors(dict(_hf_tensors(tensors, config, names, dtype)), out / "model.safetensors", meta)
        return
    weight_map: dict[str, str] = {}
    for n, shard in enumerate(shards, start=1):
        file = f"model-{n:05d}-of-{len(shards):05d}.safetensors"
        _save_safetensors(dict(_hf_tensors(tensors, config, shard, dtype)), out / file, meta)
        weight_map.update(dict.fromkeys(shard, file))
    _write_json(
        out / "model.safetensors.index.json",
        {"metadata": {"total_size": sum(sizes.values())}, "weight_map": weight_map},
    )


def _check_target(out: Path, force: bool) -> None:
    if out.exists() and not out.is_dir():
        raise FileExistsError(f"{str(out)!r} exists and is not a directory")
    if out.is_dir() and any(out.iterdir()) and not force:
        raise FileExistsError(f"{str(out)!r} is not empty; pass --force to replace it")


def _move_into_place(tmp: Path, out: Path, force: bool) -> None:
    """Rename the finished directory onto `out`; a replaced one is removed only after."""
    _check_target(out, force)
    if not out.exists():
        os.rename(tmp, out)
        return
    old = Path(tempfile.mkdtemp(dir=out.parent, prefix=f".{out.name}.old-"))
    os.rename(out, old / "dir")
    try:
        os.rename(tmp, out)
    except OSError:
        os.rename(old / "dir", out)
        raise
    finally:
        shutil.rmtree(old, ignore_errors=True)


def convert_gguf(
    gguf_path: str | Path, out_dir: str | Path, *, dtype: str = "float32", force: bool = False
) -> ConversionResult:
    """Convert a Llama GGUF file into an HF checkpoint at `out_dir`; return what was written.

    Refuses (FileExistsError) a non-empty `out_dir` unless `force`. On any error nothing is left
    at `out_dir` (or the previous content is untouched).
    """
    if dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {sorted(DTYPES)}, got {dtype!r}")
    source = Path(gguf_path)
    out = Path(out_dir)
    _check_target(out, force)
    start_s = time.perf_counter()
    reader = read_gguf(source)
    meta = gguf_metadata(reader)
    tensors = {t.name: t for t in reader.tensors}
    if len(tensors) != len(reader.tensors):
        raise GGUFError(f"{str(source)!r} lists a tensor name twice")
    config = hf_config(meta, tensors, dtype)
    geometry = _geometry(config)
    names = _check_tensors(tensors, geometry)
    tensor_types = dict(Counter(t.tensor_type.name for t in reader.tensors))
    log.info(
        "gguf_convert_start",
        source=str(source),
        size_bytes=source.stat().st_size,
        architecture=meta["general.architecture"],
        name=meta.get("general.name"),
        layers=geometry.num_hidden_layers,
        tensor_types=tensor_types,
        out=str(out),
        dtype=dtype,
    )
    tok = build_tokenizer(meta)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=out.parent, prefix=f".{out.name}.tmp-"))
    try:
        _write_weights(tensors, config, names, DTYPES[dtype], tmp)
        _write_json(tmp / "config.json", config)
        tok.save(str(tmp / "tokenizer.json"))
        _write_json(tmp / "tokenizer_config.json", tokenizer_config(meta, config["max_position_embeddings"]))
        generation: dict[str, Any] = {
            "bos_token_id": config["bos_token_id"],
            "eos_token_id": eos_token_ids(meta, geometry.vocab_size),
        }
        if "pad_token_id" in config:
            generation["pad_token_id"] = config["pad_token_id"]
        _write_json(tmp / "generation_config.json", {k: v for k, v in generation.items() if v is not None})
        _write_json(
            tmp / MARKER_FILE,
            {
                "format_version": FORMAT_VERSION,
                "source": source.name,
                "source_size_bytes": source.stat().st_size,
                "source_sha256": _sha256(source),
                "architecture": meta["general.architecture"],
                "name": meta.get("general.name"),
                "license": meta.get("general.license"),
                "tensor_types": tensor_types,
                "dtype": dtype,
            },
        )
        # mkdtemp makes a 0700 directory; checkpoints are read by other users (containers).
        os.chmod(tmp, 0o755)
        for file in tmp.iterdir():
            os.chmod(file, 0o644)
        _move_into_place(tmp, out, force)
    finally:
        with contextlib.suppress(FileNotFoundError):
            shutil.rmtree(tmp)
    duration_s = time.perf_counter() - start_s
    log.info("gguf_convert_done", out=str(out), tensors=len(names), duration_s=round(duration_s, 2))
    return ConversionResult(path=out, config=geometry, tensor_types=tensor_types, duration_s=duration_s)
