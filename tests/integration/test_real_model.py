"""The real default model: SmolLM2-135M-Instruct converted by our GGUF converter, against
transformers reading the same GGUF file with its own loader (dequantization, Q/K un-permutation,
tokenizer conversion)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from tokenizers import Tokenizer

from services.model_format.checkpoint import Checkpoint
from services.worker.model.llama import load_model

pytestmark = pytest.mark.real_model

# Measured 1.2e-4 on this prompt (7e-5 on a shorter one, earlier) between this decoder and
# transformers in float32, on logits of magnitude ~20. The bound leaves room for summation-order
# differences across CPUs and stays far below any real mistake (a wrong permutation or norm moves
# logits by whole units).
LOGITS_ATOL = 5e-4
GREEDY_TOKENS = 32
MESSAGES = [{"role": "user", "content": "What is the capital of France? Answer in one sentence."}]


@pytest.fixture(scope="module")
def hf_gguf_model(default_gguf: Path) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(
        str(default_gguf.parent), gguf_file=default_gguf.name, dtype=torch.float32
    ).eval()


@pytest.fixture(scope="module")
def hf_gguf_tokenizer(default_gguf: Path) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(default_gguf.parent), gguf_file=default_gguf.name)


def test_converted_files_describe_smollm2(real_model_dir: Path) -> None:
    cfg = Checkpoint(real_model_dir).config
    assert (cfg.num_hidden_layers, cfg.hidden_size, cfg.num_attention_heads, cfg.num_key_value_heads) == (30, 576, 9, 3)
    assert (cfg.vocab_size, cfg.intermediate_size, cfg.rope_theta, cfg.tie_word_embeddings) == (49152, 1536, 1e5, True)
    tok_cfg = json.loads((real_model_dir / "tokenizer_config.json").read_text())
    assert "<|im_start|>" in tok_cfg["chat_template"] and tok_cfg["eos_token"] == "<|im_end|>"
    assert tok_cfg["add_bos_token"] is False
    generation = json.loads((real_model_dir / "generation_config.json").read_text())
    assert generation["eos_token_id"] == [2]


def test_logits_and_greedy_tokens_match_transformers_gguf_loader(
    real_model_dir: Path, hf_gguf_model: torch.nn.Module, hf_gguf_tokenizer: Any
) -> None:
    prompt = hf_gguf_tokenizer.apply_chat_template(
        MESSAGES, add_generation_prompt=True, tokenize=True, return_dict=False
    )
    ids = torch.tensor(prompt)
    ours = load_model(real_model_dir, dtype=torch.float32)
    with torch.no_grad():
        theirs_logits = hf_gguf_model(ids[None]).logits[0]
        ours_logits = ours(ids)
        assert (ours_logits - theirs_logits).abs().max().item() < LOGITS_ATOL
        ours_ids, theirs_ids = ids, ids
        for _ in range(GREEDY_TOKENS):
            ours_ids = torch.cat([ours_ids, ours(ours_ids)[-1].argmax().view(1)])
            theirs_ids = torch.cat([theirs_ids, hf_gguf_model(theirs_ids[None]).logits[0, -1].argmax().view(1)])
    assert ours_ids.tolist() == theirs_ids.tolist()
    answer = hf_gguf_tokenizer.decode(ours_ids[len(prompt) :], skip_special_tokens=True)
    assert "Paris" in answer, answer


# Text where the two agree: everything but a space before a non-ASCII numeral.
AGREE = [
    "Hello, world! How are you doing today?",
    "<|im_start|>system\nYou are a helpful AI assistant<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n",
    "def f(x):\n    return x**2  # square\n\n\tif x > 10:\n        pass",
    "Numbers: 0 1 12 123 1234 12345 3.14159 -42 1,000,000 2024-11-23 x5 5x $5 5%",
    "café naïve über Straße façade 東京 日本語 数据 😀 → € Ω",
    "   leading spaces and trailing   ",
    "multiple\n\nnewlines\r\n and\ttabs",
    "<|endoftext|><repo_name>x<file_sep><filename>a.py<gh_stars>10",
    "It's we're they've I'm you'll he'd DON'T",
    "x²+y² = z²; a₁ a₂",
    "<|im_start|><|im_start|>",
    "",
]


def test_tokenizer_matches_transformers_gguf_tokenizer(real_model_dir: Path, hf_gguf_tokenizer: Any) -> None:
    ours = Tokenizer.from_file(str(real_model_dir / "tokenizer.json"))
    for text in AGREE:
        ids = ours.encode(text, add_special_tokens=True).ids
        assert ids == hf_gguf_tokenizer.encode(text, add_special_tokens=True), text
        assert ours.decode(ids, skip_special_tokens=False) == text
    special = {t.content for t in ours.get_added_tokens_decoder().values() if t.special}
    assert special == {t.content for t in hf_gguf_tokenizer.added_tokens_decoder.values() if t.special}
    assert len(special) == 17 and {"<|im_start|>", "<|im_end|>", "<|endoftext|>"} <= special
    # Where they differ we follow llama.cpp's "smollm" pre-tokenizer and SmolLM2's own
    # tokenizer.json (digits, \p{N}, split off before the GPT-2 regex); transformers' GGUF
    # conversion leaves the digit split out and merges the space into the numeral's first byte.
    assert ours.encode(" ½").tokens == ["Ġ", "Â½"]
    assert hf_gguf_tokenizer.convert_ids_to_tokens(hf_gguf_tokenizer.encode(" ½")) == ["ĠÂ", "½"]


def _greedy(model: Any, ids: list[int], n: int, stop: set[int]) -> list[int]:
    out = torch.tensor(ids)
    with torch.no_grad():
        for _ in range(n):
            token = int(model(out)[-1].argmax())
            out = torch.cat([out, torch.tensor([token])])
            if token in stop:
                break
    return out[len(ids) :].tolist()


# Chat prompts whose greedy answers bfloat16 and float32 agree on to the end of the answer (24
# tokens). bfloat16 keeps 8 bits of mantissa, so an answer parts where float32's top two
# continuations nearly tie: of the wider set below, "Name three primary colors." parts at its 7th
# token (float32's top two 0.06 apart, of 24), and so do two more at similar near-ties. The
# per-position agreement over the wider set is checked too.
BF16_PROMPTS = [
    "What is the capital of France? Answer in one sentence.",
    "Write a haiku about the sea.",
    "What is 2 + 2?",
    "What color is the sky on a clear day?",
]
BF16_WIDER = [
    *BF16_PROMPTS,
    "Name three primary colors.",
    "List three fruits.",
    "Who wrote Romeo and Juliet?",
    "What is the largest planet in the solar system?",
    "Translate 'hello' into French.",
]


def test_fused_kernels_and_bfloat16_keep_the_greedy_answers(real_model_dir: Path) -> None:
    tok = Tokenizer.from_file(str(real_model_dir / "tokenizer.json"))
    stop = {2, tok.token_to_id("<|im_end|>")}
    fp32 = load_model(real_model_dir, dtype=torch.float32)
    eager = load_model(real_model_dir, dtype=torch.float32)
    eager.fused_ops = False
    bf16 = load_model(real_model_dir, dtype=torch.bfloat16)
    for i, prompt in enumerate(BF16_PROMPTS):
        ids = tok.encode(f"<|im_start|>user\n{prompt}<|im_end|>\n<|im_start|>assistant\n").ids
        want = _greedy(eager, ids, 24, stop)
        if i == 0:
            with torch.no_grad():
                # The eager path's own GEMM order (packed or not) moves these logits by up to 6e-4.
                assert (fp32(torch.tensor(ids)) - eager(torch.tensor(ids))).abs().max().item() < LOGITS_ATOL
            assert "Paris" in tok.decode(want)
        assert _greedy(fp32, ids, 24, stop) == want, prompt
        assert _greedy(bf16, ids, 24, stop) == want, prompt
    # Teacher-forced on float32's answers: bfloat16's next-token choice at every position, and its
    # logits' mean distance (about 0.13 on the development box; a wrong kernel is far off).
    agree = total = 0
    errors = []
    for prompt in BF16_WIDER:
        ids = tok.encode(f"<|im_start|>user\n{prompt}<|im_end|>\n<|im_start|>assistant\n").ids
        seq = torch.tensor(ids + _greedy(eager, ids, 24, stop))
        with torch.no_grad():
            want_logits, got_logits = eager(seq).float(), bf16(seq).float()
        agree += int((want_logits.argmax(-1) == got_logits.argmax(-1)).sum())
        total += len(seq)
        errors.append((want_logits - got_logits).abs().mean().item())
    assert agree >= 0.97 * total, f"{agree}/{total}"
    assert sum(errors) / len(errors) < 0.25, errors
