"""Log-probs from the workers' wire messages, made readable: each token's text and exact bytes,
and where its text starts in the choice's text.

Token text follows OpenAI: a token that decodes to whole UTF-8 reads as that text; one that
holds part of a character (byte-level BPE splits them) reads `bytes:\\xe2\\x98` and its
`bytes` field carries the exact bytes, so concatenating `bytes` rebuilds the text. Special
tokens (an end-of-turn token) read as their literal text.
"""

from __future__ import annotations

from collections.abc import Sequence

from blitzmesh.convert import token_logprob_from_proto
from blitzmesh.v1 import common_pb2
from services.gateway.schema import TokenLogprob, TopLogprob
from services.model_format.tokenizer import Tokenizer


def token_bytes(tokenizer: Tokenizer, token_id: int) -> bytes:
    """The bytes one token stands for. Exact for byte-level BPE; for other tokenizers the
    token's own decode (SentencePiece's leading-space marker may be lost)."""
    try:
        if tokenizer.byte_level:
            return tokenizer.token_bytes(token_id, skip_special_tokens=False)
        return tokenizer.decode([token_id], skip_special_tokens=False).encode("utf-8")
    except (ValueError, KeyError, OverflowError):
        # An id the model's head has but the tokenizer lacks (padding rows of the vocab).
        return b""


def token_text(data: bytes) -> str:
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError:
        return "bytes:" + "".join(f"\\x{b:02x}" for b in data)


def text_offsets(tokenizer: Tokenizer, token_ids: Sequence[int], start: int = 0) -> list[int]:
    """Where each token's text starts, in characters, when `token_ids` are detokenized from
    `start` (special tokens add no text; a split character counts where it completes)."""
    detok = tokenizer.incremental_detokenizer()
    offsets, length = [], start
    for token in token_ids:
        offsets.append(length)
        length += len(detok.add(token))
    return offsets


def from_proto(
    tokenizer: Tokenizer, msgs: Sequence[common_pb2.TokenLogprob], offsets: Sequence[int]
) -> tuple[TokenLogprob, ...]:
    """Worker log-probs (via the SDK's one converter of the wire type) with text, bytes and offsets."""
    if len(msgs) != len(offsets):
        raise ValueError(f"{len(msgs)} log-prob entries for {len(offsets)} tokens")
    out: list[TokenLogprob] = []
    for msg, offset in zip(msgs, offsets, strict=True):
        entry = token_logprob_from_proto(msg)
        data = token_bytes(tokenizer, entry.token_id)
        top = []
        for t in entry.top_logprobs:
            t_data = token_bytes(tokenizer, t.token_id)
            top.append(TopLogprob(t.token_id, t.logprob, token_text(t_data), t_data))
        out.append(TokenLogprob(entry.token_id, entry.logprob, token_text(data), data, tuple(top), offset))
    return tuple(out)
