"""Tokenizer wrapper for serving: encode/decode, chat template, streaming detokenization, stop strings.

Wraps a `tokenizers.Tokenizer` read from an HF `tokenizer.json`. Streaming output goes through
`IncrementalDetokenizer` (never emits half a UTF-8 character) and `StopStringMatcher` (never emits
a stop string, holds back what could still become one).
"""

from __future__ import annotations

import codecs
import json
import re
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from tokenizers import Tokenizer as _HFTokenizer

TOKENIZER_FILE = "tokenizer.json"
TOKENIZER_CONFIG_FILE = "tokenizer_config.json"

# The template the synthetic checkpoints ship, in Jinja for HF tooling; `apply_chat_template`
# implements the same text in Python so serving does not depend on a template engine.
CHAT_TEMPLATE_JINJA = (
    "{% for message in messages %}<|{{ message['role'] }}|>\n{{ message['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)

_ROLE_RE = re.compile(r"^[A-Za-z_][A-Za-z0-9_-]*$")


def _bytes_to_unicode() -> dict[int, str]:
    """The byte -> printable character table of byte-level BPE (GPT-2 layout, as in `tokenizers`).

    Printable Latin-1 bytes map to themselves; the others are shifted to code points from 256 up,
    in byte order.
    """
    printable = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAC + 1), *range(0xAE, 0xFF + 1)]
    table: dict[int, str] = {b: chr(b) for b in printable}
    shift = 0
    for b in range(256):
        if b not in table:
            table[b] = chr(256 + shift)
            shift += 1
    return table


_CHAR_TO_BYTE: dict[str, int] = {c: b for b, c in _bytes_to_unicode().items()}


class Tokenizer:
    """A `tokenizer.json` plus the special tokens a server needs (BOS, EOS)."""

    def __init__(
        self,
        path: str | Path,
        *,
        bos_token: str | None = None,
        eos_token: str | None = None,
    ) -> None:
        """`path` is a `tokenizer.json` or a checkpoint directory holding one.

        BOS/EOS come from the arguments, else `tokenizer_config.json` next to the file, else the
        Llama defaults `<s>` / `</s>`.
        """
        p = Path(path)
        file = p / TOKENIZER_FILE if p.is_dir() else p
        if not file.is_file():
            raise FileNotFoundError(f"tokenizer file not found: {str(file)!r}")
        self.path = file
        self._tok = _HFTokenizer.from_file(str(file))
        # Special-token text typed by a user is plain text, not a control token: a prompt saying
        # "</s>" must not end the sequence.
        self._tok.encode_special_tokens = True
        cfg = _read_tokenizer_config(file.parent / TOKENIZER_CONFIG_FILE)
        self.bos_token = bos_token or _token_text(cfg.get("bos_token")) or "<s>"
        self.eos_token = eos_token or _token_text(cfg.get("eos_token")) or "</s>"
        self.bos_token_id = self._require_id(self.bos_token)
        self.eos_token_id = self._require_id(self.eos_token)
        added = self._tok.get_added_tokens_decoder()
        self.special_token_ids: frozenset[int] = frozenset(i for i, t in added.items() if t.special)
        self._added_text: dict[int, str] = {i: t.content for i, t in added.items()}
        decoder = json.loads(self._tok.to_str()).get("decoder") or {}
        self.byte_level = decoder.get("type") == "ByteLevel"

    def _require_id(self, token: str) -> int:
        token_id = self._tok.token_to_id(token)
        if token_id is None:
            raise ValueError(f"special token {token!r} is not in the vocabulary of {str(self.path)!r}")
        return token_id

    @property
    def vocab_size(self) -> int:
        """Number of ids, added tokens included."""
        return self._tok.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str, add_bos: bool = True) -> list[int]:
        """Token ids of `text`, with BOS first unless `add_bos=False`."""
        ids = self._tok.encode(text, add_special_tokens=False).ids
        return [self.bos_token_id, *ids] if add_bos else list(ids)

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        """Text of `ids`; invalid or truncated UTF-8 becomes U+FFFD."""
        return self._tok.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def token_bytes(self, token_id: int, skip_special_tokens: bool = True) -> bytes:
        """Raw bytes one token stands for (byte-level BPE only)."""
        if token_id in self._added_text:
            if skip_special_tokens and token_id in self.special_token_ids:
                return b""
            return self._added_text[token_id].encode("utf-8")
        piece = self._tok.id_to_token(token_id)
        if piece is None:
            raise ValueError(f"token id {token_id} is outside the vocabulary (size {self.vocab_size})")
        return bytes(_CHAR_TO_BYTE[c] for c in piece)

    def apply_chat_template(self, messages: Sequence[Mapping[str, Any]], add_generation_prompt: bool = True) -> str:
        """Render `[{"role": ..., "content": ...}]` as `<|role|>\\ncontent\\n` blocks, then `<|assistant|>\\n`."""
        if not messages:
            raise ValueError("apply_chat_template needs at least one message, got []")
        parts: list[str] = []
        for i, message in enumerate(messages):
            role, content = message.get("role"), message.get("content")
            if not isinstance(role, str) or not _ROLE_RE.match(role):
                raise ValueError(f"message {i} has an invalid role {role!r}")
            if not isinstance(content, str):
                raise ValueError(f"message {i} content must be a string, got {type(content).__name__}")
            parts.append(f"<|{role}|>\n{content}\n")
        if add_generation_prompt:
            parts.append("<|assistant|>\n")
        return "".join(parts)

    def incremental_detokenizer(self, skip_special_tokens: bool = True) -> IncrementalDetokenizer:
        """A fresh streaming detokenizer for one sequence."""
        return IncrementalDetokenizer(self, skip_special_tokens=skip_special_tokens)


def _read_tokenizer_config(file: Path) -> dict[str, Any]:
    if not file.is_file():
        return {}
    try:
        data = json.loads(file.read_text(encoding="utf-8"))
    except json.JSONDecodeError as exc:
        raise ValueError(f"{str(file)!r} is not valid JSON: {exc}") from exc
    return data if isinstance(data, dict) else {}


def _token_text(value: Any) -> str | None:
    # tokenizer_config.json writes special tokens either as strings or as AddedToken dicts.
    if isinstance(value, str):
        return value
    if isinstance(value, dict) and isinstance(value.get("content"), str):
        return value["content"]
    return None


class IncrementalDetokenizer:
    """Turns a stream of token ids into text deltas whose concatenation equals the full decode.

    Byte-level BPE tokens can split a UTF-8 character; the bytes of an unfinished character are
    held until the rest arrives. Other tokenizers (e.g. SentencePiece) are handled by re-decoding a
    short window and emitting what it adds, waiting while it ends in U+FFFD.
    """

    def __init__(self, tokenizer: Tokenizer, skip_special_tokens: bool = True, byte_level: bool | None = None) -> None:
        """`byte_level` picks the algorithm; None means whichever fits `tokenizer`."""
        self._tokenizer = tokenizer
        self._skip = skip_special_tokens
        self._byte_level = tokenizer.byte_level if byte_level is None else byte_level
        self._utf8 = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self._ids: list[int] = []
        self._prefix = 0  # window start (generic path)
        self._read = 0  # ids already turned into emitted text (generic path)
        self.text = ""  # everything emitted so far

    def add(self, token_ids: int | Sequence[int]) -> str:
        """Feed one or more ids; return the new text that is now certain (possibly "")."""
        ids = [token_ids] if isinstance(token_ids, int) else list(token_ids)
        if self._byte_level:
            data = b"".join(self._tokenizer.token_bytes(i, self._skip) for i in ids)
            delta = self._utf8.decode(data, final=False)
        else:
            self._ids.extend(ids)
            delta = self._window_delta(final=False)
        self.text += delta
        return delta

    def flush(self) -> str:
        """End of stream: return whatever was held back (a broken character becomes U+FFFD)."""
        if self._byte_level:
            delta = self._utf8.decode(b"", final=True)
        else:
            delta = self._window_delta(final=True)
        self.text += delta
        return delta

    def _window_delta(self, final: bool) -> str:
        decode = self._tokenizer.decode
        before = decode(self._ids[self._prefix : self._read], self._skip)
        after = decode(self._ids[self._prefix :], self._skip)
        if len(after) <= len(before) or (after.endswith("\ufffd") and not final):
            return ""
        # Slide the window so each call re-decodes a few tokens only, keeping one emitted token as
        # left context (some decoders drop a leading space at the start of a sequence).
        self._prefix, self._read = self._read, len(self._ids)
        return after[len(before) :]


def find_stop(text: str, stop: Sequence[str], emitted: int = 0) -> tuple[str, bool]:
    """Stop-string check over accumulated output `text`, of which `emitted` chars were already sent.

    Returns `(text_to_emit, stopped)`. When a stop string occurs, the text before the earliest one is
    emitted and `stopped` is True; the stop string itself never is. Otherwise the longest tail of
    `text` that is a prefix of some stop string is held back, since later text may complete it.
    """
    stops = [s for s in stop if s]
    if not stops:
        return text[emitted:], False
    # A match must end after `emitted`, or it would have been found earlier.
    search_from = max(0, emitted - max(len(s) for s in stops) + 1)
    hits = [i for i in (text.find(s, search_from) for s in stops) if i >= 0]
    if hits:
        cut = min(hits)
        return text[emitted:cut] if cut > emitted else "", True
    hold = 0
    for s in stops:
        for k in range(min(len(s) - 1, len(text)), hold, -1):
            if text.endswith(s[:k]):
                hold = k
                break
    end = max(emitted, len(text) - hold)
    return text[emitted:end], False


class StopStringMatcher:
    """Stateful `find_stop` for one stream: feed deltas, get what may be sent."""

    def __init__(self, stop: Sequence[str]) -> None:
        for s in stop:
            if not isinstance(s, str) or not s:
                raise ValueError(f"stop strings must be non-empty strings, got {s!r}")
        self._stop = list(stop)
        self._text = ""
        self._emitted = 0
        self.stopped = False

    def feed(self, delta: str) -> tuple[str, bool]:
        """Add text; return `(text_to_emit, stopped)`. After a stop, further text is ignored."""
        if self.stopped:
            return "", True
        self._text += delta
        out, self.stopped = find_stop(self._text, self._stop, self._emitted)
        self._emitted += len(out)
        return out, self.stopped

    def flush(self) -> str:
        """End of stream without a stop: release the held-back tail."""
        if self.stopped:
            return ""
        out = self._text[self._emitted :]
        self._emitted = len(self._text)
        return out
