"""One choice's text, built from the tokens its instances stream: detokenized incrementally, cut at
the first stop string, with each token's log-prob and where its text starts.

`TextAssembler` lives as long as the choice, across every instance it runs on (a migrated stream
resumes from the tokens so far, and its text goes on from the same state), so the client sees no
character twice and none missing. The echoed prompt and the prompt log-probs go out with the
first piece. Nothing here does I/O: `Backend._stream` reads the worker's messages and feeds them
in (`tests/unit/test_gateway_plan.py`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace

from blitzmesh.v1 import common_pb2
from services.gateway import logprobs as lp
from services.gateway.schema import TokenLogprob
from services.model_format.tokenizer import StopStringMatcher, Tokenizer

__all__ = ["Piece", "TextAssembler"]


@dataclass(frozen=True, slots=True)
class Piece:
    """What one worker message adds to the choice: `text` that may be sent (the echoed prompt
    first, on the first piece), whether a stop string `matched` (the text ends before it), and the
    log-probs of its tokens (with their text offsets) and of the prompt (first piece only)."""

    text: str
    matched: bool
    logprobs: tuple[TokenLogprob, ...] = ()
    prompt_logprobs: tuple[TokenLogprob, ...] = ()

    def worth_sending(self, token_ids: Sequence[int], return_token_ids: bool) -> bool:
        """Whether the client hears of it: text, log-probs, or token ids it asked for."""
        return bool(self.text or (return_token_ids and token_ids) or self.logprobs or self.prompt_logprobs)


class TextAssembler:
    """The text state of one choice. `stop`: the request's stop strings (applied here, on text;
    the worker only sees token-level stops). `echo`: the text sent before the first token's.
    `logprobs`: the request asked for the tokens' log-probs; `prompt_ids`: the prompt, when it
    asked for the prompt's log-probs (None otherwise)."""

    def __init__(
        self,
        tokenizer: Tokenizer,
        stop: Sequence[str] = (),
        *,
        echo: str | None = None,
        logprobs: bool = False,
        prompt_ids: Sequence[int] | None = None,
    ) -> None:
        self._tokenizer = tokenizer
        self._detok = tokenizer.incremental_detokenizer()
        self._stops = StopStringMatcher(stop)
        self._echo = echo
        self._want_logprobs = logprobs
        self._prompt_ids = prompt_ids
        self.chars = len(echo) if echo is not None else 0  # the choice's text so far, echo included
        self.first = True  # the echo and the prompt log-probs still go out with the next piece

    def logprobs(
        self,
        token_ids: Sequence[int],
        msgs: Sequence[common_pb2.TokenLogprob],
        prompt_msgs: Sequence[common_pb2.TokenLogprob],
    ) -> tuple[tuple[TokenLogprob, ...], tuple[TokenLogprob, ...]]:
        """The log-probs one message carries, as asked for: (its tokens', the prompt's), offsets
        of the tokens' still 0 (`feed` sets them). Changes nothing; raises ValueError on a
        malformed message (an entry count that does not match), which is the instance's failure:
        check before the tokens count as generated."""
        tokens: tuple[TokenLogprob, ...] = ()
        prompt: tuple[TokenLogprob, ...] = ()
        if self._want_logprobs and token_ids:
            tokens = lp.from_proto(self._tokenizer, msgs, [0] * len(token_ids))
        if self.first and self._prompt_ids is not None:
            prompt = lp.from_proto(self._tokenizer, prompt_msgs, lp.text_offsets(self._tokenizer, self._prompt_ids))
        return tokens, prompt

    def feed(
        self,
        token_ids: Sequence[int],
        logprobs: tuple[TokenLogprob, ...] = (),
        prompt_logprobs: tuple[TokenLogprob, ...] = (),
        *,
        final: bool = False,
    ) -> Piece:
        """Add the tokens of one message (`final`: the worker finished with it, so held-back text
        is released unless a stop string matched). `logprobs` get their text offsets here."""
        if logprobs:
            offsets, piece = [], ""
            for token in token_ids:  # one at a time, for each token's text offset
                offsets.append(self.chars + len(piece))
                piece += self._detok.add(token)
            logprobs = tuple(replace(e, text_offset=o) for e, o in zip(logprobs, offsets, strict=True))
        else:
            piece = self._detok.add(token_ids)
        prefix = ""
        if self.first:
            self.first = False
            prefix = self._echo or ""
        self.chars += len(piece)
        text, matched = self._stops.feed(piece)
        if final and not matched:
            tail, matched = self._stops.feed(self._detok.flush())
            text += tail
            if not matched:
                text += self._stops.flush()
        return Piece(prefix + text, matched, logprobs, prompt_logprobs)
