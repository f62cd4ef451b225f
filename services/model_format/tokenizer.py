"""Tokenizer wrapper for serving: encode/decode, chat template, streaming detokenization, stop strings.

Wraps a `tokenizers.Tokenizer` read from an HF `tokenizer.json`, with the special tokens and chat
template of the checkpoint's `tokenizer_config.json` (and `special_tokens_map.json`,
`chat_template.jinja`). Prompts get exactly the ids transformers gives (`encode`, `encode_chat`).
Streaming output goes through `IncrementalDetokenizer` (never emits half a UTF-8 character) and
`StopStringMatcher` (never emits a stop string, holds back what could still become one).
"""

from __future__ import annotations

import codecs
import json
import re
import tempfile
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import structlog
from tokenizers import Tokenizer as _HFTokenizer
from tokenizers import processors

from services.model_format.chat_template import (
    CHAT_TEMPLATE_FILE,
    CHAT_TEMPLATE_JINJA,
    ChatTemplate,
    ChatTemplateError,
    control_token_pattern,
    mark_control_tokens,
    marker_pattern,
    read_chat_template,
)

__all__ = [
    "CHAT_TEMPLATE_JINJA",
    "TOKENIZER_FILES",
    "IncrementalDetokenizer",
    "StopStringMatcher",
    "Tokenizer",
    "find_stop",
]

log = structlog.get_logger(__name__)

TOKENIZER_FILE = "tokenizer.json"
TOKENIZER_CONFIG_FILE = "tokenizer_config.json"
SPECIAL_TOKENS_MAP_FILE = "special_tokens_map.json"
# Every file a Tokenizer reads from a checkpoint directory.
TOKENIZER_FILES = (TOKENIZER_FILE, TOKENIZER_CONFIG_FILE, SPECIAL_TOKENS_MAP_FILE, CHAT_TEMPLATE_FILE)

# transformers' named special tokens; each set one is a variable of the chat template.
_NAMED_SPECIAL_TOKENS = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")

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
    """A checkpoint's tokenizer: exact prompt ids, its chat template, and the special tokens a server needs.

    Two kinds of text are encoded, and differently:
    - user text (`encode`): text that looks like a special token (`</s>`, `<|im_end|>`) stays plain
      text, and the checkpoint's own special tokens are added as its `tokenizer.json` post-processor
      says (transformers' ids for ordinary text);
    - a rendered chat template (`encode_chat`): the control tokens the template writes become their
      ids, nothing is added around them, and control-token text inside the messages stays plain text.
    """

    def __init__(
        self,
        path: str | Path,
        *,
        bos_token: str | None = None,
        eos_token: str | None = None,
    ) -> None:
        """`path` is a `tokenizer.json` or a checkpoint directory holding one.

        BOS/EOS come from the arguments, else the tokenizer config (`tokenizer_config.json`, with a
        legacy `special_tokens_map.json`), else the Llama defaults `<s>` / `</s>` where the vocabulary
        has them; a checkpoint may have none (`bos_token_id` is then None).
        """
        p = Path(path)
        file = p / TOKENIZER_FILE if p.is_dir() else p
        if not file.is_file():
            raise FileNotFoundError(f"tokenizer file not found: {str(file)!r}")
        self.path = file
        directory = file.parent
        # Two copies that differ in one flag, so threads encoding both kinds of text never share a
        # mutable setting. User text: special-token text is plain text (a prompt saying "</s>" must
        # not end the sequence). Template text: the template's control tokens are matched.
        self._tok = _HFTokenizer.from_file(str(file))
        self._tok.encode_special_tokens = True
        self._template_tok = _HFTokenizer.from_file(str(file))
        self._template_tok.encode_special_tokens = False
        cfg = _tokenizer_config(directory)
        self.special_tokens: dict[str, str] = _named_special_tokens(cfg)
        if bos_token:
            self.special_tokens["bos_token"] = bos_token
        if eos_token:
            self.special_tokens["eos_token"] = eos_token
        self.bos_token, self.bos_token_id = self._special("bos_token", cfg, "<s>")
        self.eos_token, self.eos_token_id = self._special("eos_token", cfg, "</s>")
        added = self._tok.get_added_tokens_decoder()
        self.special_token_ids: frozenset[int] = frozenset(i for i, t in added.items() if t.special)
        self._added_text: dict[int, str] = {i: t.content for i, t in added.items()}
        decoder = json.loads(self._tok.to_str()).get("decoder") or {}
        self.byte_level = decoder.get("type") == "ByteLevel"
        self._apply_bos_eos_flags(cfg)
        self._newline_ids = {
            plain: self._encode_with(self._tok if plain else self._template_tok, "\n") for plain in (True, False)
        }
        self._chat_control_tokens = cfg.get("chat_control_tokens")
        self._chat_template: ChatTemplate | None = None
        self._chat_template_error: ChatTemplateError | None = None
        self.has_chat_template = False
        try:
            found = read_chat_template(directory, cfg)
            self.has_chat_template = found is not None
            source, origin = found or (CHAT_TEMPLATE_JINJA, "built-in template")
            self._chat_template = ChatTemplate(source, self.special_tokens, origin)
        except ChatTemplateError as e:
            # Completions still work; chat requests get this error, quoting the template's problem.
            self._chat_template_error = e
            log.warning("chat_template_unusable", path=str(directory), error=str(e))

    @classmethod
    def from_files(cls, files: Mapping[str, bytes]) -> Tokenizer:
        """A Tokenizer from a checkpoint's side files (name -> bytes), e.g. as the parameter manager serves them."""
        if TOKENIZER_FILE not in files:
            raise FileNotFoundError(f"no {TOKENIZER_FILE} among the files {sorted(files)}")
        with tempfile.TemporaryDirectory(prefix="blitzmesh-tok-") as tmp:
            for name in TOKENIZER_FILES:
                if name in files:
                    (Path(tmp) / name).write_bytes(files[name])
            return cls(tmp)

    def _special(self, name: str, cfg: Mapping[str, Any], llama_default: str) -> tuple[str | None, int | None]:
        token = self.special_tokens.get(name)
        if token is None:
            if name in cfg or self._tok.token_to_id(llama_default) is None:
                return None, None  # declared absent (e.g. Qwen2's bos_token: null), or no Llama default
            token = llama_default
        token_id = self._tok.token_to_id(token)
        if token_id is None:
            raise ValueError(f"special token {token!r} ({name}) is not in the vocabulary of {str(self.path)!r}")
        return token, token_id

    def _apply_bos_eos_flags(self, cfg: Mapping[str, Any]) -> None:
        """Honour `add_bos_token` / `add_eos_token` where `tokenizer.json` has no post-processor.

        A post-processor in `tokenizer.json` decides which special tokens a prompt gets, as in
        transformers 5 (which ignores the flags whenever `tokenizer.json` exists). Without one, the
        flags build it the way transformers' fast Llama tokenizer does (a missing flag means False).
        """
        flags = {k: cfg[k] for k in ("add_bos_token", "add_eos_token") if k in cfg}
        if not flags:
            return
        add_bos = bool(flags.get("add_bos_token")) and self.bos_token_id is not None
        add_eos = bool(flags.get("add_eos_token")) and self.eos_token_id is not None
        if self._tok.post_processor is not None:
            probe = self._tok.encode("", add_special_tokens=True).ids
            if (self.bos_token_id in probe[:1]) != add_bos or (self.eos_token_id in probe[-1:]) != add_eos:
                log.warning(
                    "tokenizer_flags_ignored",
                    path=str(self.path),
                    flags=flags,
                    reason="tokenizer.json has a post-processor, which decides (as in transformers 5)",
                )
            return
        bos, eos = self.bos_token, self.eos_token
        single = " ".join([*([f"{bos}:0"] if add_bos else []), "$A:0", *([f"{eos}:0"] if add_eos else [])])
        pair = " ".join([single, *([f"{bos}:1"] if add_bos else []), "$B:1", *([f"{eos}:1"] if add_eos else [])])
        specials = [*([(bos, self.bos_token_id)] if add_bos else []), *([(eos, self.eos_token_id)] if add_eos else [])]
        for tok in (self._tok, self._template_tok):
            tok.post_processor = processors.TemplateProcessing(single=single, pair=pair, special_tokens=specials)

    @property
    def vocab_size(self) -> int:
        """Number of ids, added tokens included."""
        return self._tok.get_vocab_size(with_added_tokens=True)

    def token_to_id(self, token: str) -> int | None:
        """The id of one token (vocabulary entry or added token), None if there is none."""
        return self._tok.token_to_id(token)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of user text, with the special tokens the checkpoint adds (its BOS, if any) unless
        `add_special_tokens=False`. Special-token text inside `text` is encoded as plain text."""
        return self._encode_with(self._tok, text, add_special_tokens)

    @staticmethod
    def _encode_with(tok: _HFTokenizer, text: str, add_special_tokens: bool = False) -> list[int]:
        # encode_batch releases the GIL (encode does not), so a long prompt encoded on a worker
        # thread leaves the event loop free; the ids are the same.
        return list(tok.encode_batch([text], add_special_tokens=add_special_tokens)[0].ids)

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

    # ---- chat ------------------------------------------------------------------------------------

    @property
    def chat_template(self) -> ChatTemplate:
        """The checkpoint's template (the built-in `<|role|>` one if it ships none)."""
        if self._chat_template is None:
            assert self._chat_template_error is not None
            raise self._chat_template_error
        return self._chat_template

    def apply_chat_template(self, messages: Sequence[Mapping[str, Any]], add_generation_prompt: bool = True) -> str:
        """The conversation as text, as transformers' `apply_chat_template(..., tokenize=False)` renders it."""
        _check_messages(messages)
        return self.chat_template.render(messages, add_generation_prompt)

    def encode_chat(self, messages: Sequence[Mapping[str, Any]], add_generation_prompt: bool = True) -> list[int]:
        """Prompt ids of a conversation: transformers' `apply_chat_template(..., tokenize=True)`.

        The template's own control tokens become their ids and nothing else is added. Control-token
        text in the messages is encoded as plain text (transformers' `sanitize_control_tokens=True`),
        so a user cannot end a turn or forge a system message by typing `<|im_end|>`.
        """
        _check_messages(messages)
        template = self.chat_template
        marked = mark_control_tokens(list(messages), self._control_pattern(template))
        rendered = template.render(marked, add_generation_prompt)
        return self._encode_marked(rendered)

    def _control_pattern(self, template: ChatTemplate) -> re.Pattern[str]:
        # transformers' control tokens: every special added token, plus the added tokens the template
        # writes literally (or those the config lists in `chat_control_tokens`).
        added = self._tok.get_added_tokens_decoder().values()
        listed = self._chat_control_tokens
        if isinstance(listed, list):
            wanted = {t for t in listed if isinstance(t, str)}
            tokens = [t.content for t in added if t.special or t.content in wanted]
        else:
            text = template.literal_text
            tokens = [t.content for t in added if t.special or (t.content in text and not t.content.isspace())]
        return control_token_pattern(tokens)

    def _encode_marked(self, rendered: str) -> list[int]:
        """Encode a template rendered from marked messages: marked tokens as plain text, the rest as is."""
        pieces = marker_pattern(self._added_text.values()).split(rendered)
        ids = self._encode_with(self._template_tok, pieces[0])
        for i, piece in enumerate(pieces[1:], start=1):
            if not piece:
                continue  # an empty stretch, or the None a lone marker leaves
            plain = i % 2 == 1  # odd pieces are the marked control tokens
            piece_ids = self._encode_piece(piece, plain)
            if plain and self._tok.token_to_id(piece) in piece_ids:
                raise ValueError(f"cannot encode {piece!r} as plain text: the tokenizer makes it a control token")
            ids += piece_ids
        return ids

    def _encode_piece(self, piece: str, plain: bool) -> list[int]:
        # As transformers: encode after a newline, so a SentencePiece tokenizer does not add the prefix
        # space it adds at the start of a text, then drop the newline's ids again.
        tok = self._tok if plain else self._template_tok
        newline = self._newline_ids[plain]
        ids = self._encode_with(tok, "\n" + piece)
        if ids[: len(newline)] == newline:
            return ids[len(newline) :]
        return self._encode_with(tok, piece)

    def incremental_detokenizer(self, skip_special_tokens: bool = True) -> IncrementalDetokenizer:
        """A fresh streaming detokenizer for one sequence."""
        return IncrementalDetokenizer(self, skip_special_tokens=skip_special_tokens)


def _check_messages(messages: Sequence[Mapping[str, Any]]) -> None:
    if not messages:
        raise ValueError("a chat needs at least one message, got []")
    for i, message in enumerate(messages):
        if not isinstance(message, Mapping):
            raise ValueError(f"message {i} must be a mapping with 'role' and 'content', got {message!r}")
        role, content = message.get("role"), message.get("content")
        # Roles are written into control tokens by many templates ('<|' + role + '|>'): only names pass.
        if not isinstance(role, str) or not _ROLE_RE.match(role):
            raise ValueError(f"message {i} has an invalid role {role!r}")
        if not isinstance(content, str):
            raise ValueError(f"message {i} content must be a string, got {type(content).__name__}")


def _read_json(file: Path) -> dict[str, Any]:
    if not file.is_file():
        return {}
    try:
        data = json.loads(file.read_text(encoding="utf-8"))
    except json.JSONDecodeError as exc:
        raise ValueError(f"{str(file)!r} is not valid JSON: {exc}") from exc
    return data if isinstance(data, dict) else {}


def _tokenizer_config(directory: Path) -> dict[str, Any]:
    """`tokenizer_config.json`, with a legacy `special_tokens_map.json` merged in as transformers does
    (its entries win, and only when the config has no `added_tokens_decoder`)."""
    cfg = _read_json(directory / TOKENIZER_CONFIG_FILE)
    if "added_tokens_decoder" not in cfg:
        cfg.update(_read_json(directory / SPECIAL_TOKENS_MAP_FILE))
    return cfg


def _named_special_tokens(cfg: Mapping[str, Any]) -> dict[str, str]:
    """The template variables transformers passes: the named special tokens, plus any other `*_token`
    key whose value is a token (e.g. a model-specific `image_token`)."""
    out: dict[str, str] = {}
    for key, value in cfg.items():
        if key in _NAMED_SPECIAL_TOKENS or key.endswith("_token"):
            text = _token_text(value)
            if text is not None:
                out[key] = text
    return out


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
