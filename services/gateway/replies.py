"""What one worker message means for the attempt streaming it, pure:
`classify(message) -> Tokens | HandedOff | Moved | Bad`.

`Backend._stream` reads the messages of one Worker.Generate call and acts on each verdict: new
tokens go to the choice's text (`services/gateway/text.py`), a hand-off ends a prefill
instance's part, a live migration and a bad message end the attempt as the instance's failure.
Tested without a gRPC server (`tests/unit/test_gateway_plan.py`).
"""

from __future__ import annotations

from dataclasses import dataclass

import grpc

from blitzmesh.convert import finish_reason_from_proto
from blitzmesh.v1 import kv_pb2, worker_pb2
from services.gateway.schema import FINISH_LENGTH, FINISH_STOP, Usage

__all__ = ["Bad", "HandedOff", "Moved", "Reply", "Tokens", "classify"]


@dataclass(frozen=True, slots=True)
class Tokens:
    """New tokens (maybe none). `finished`: the message ends the worker's stream, with its
    `finish_reason` (None when it sent FINISH_REASON_UNSPECIFIED) and its own counts of the prompt
    and completion tokens (0 when it sent none). `cached_tokens`: the prompt tokens the instance's
    prefix cache held when it prefilled the prompt; None when it did not prefill it (its KV was
    pulled) or did not say."""

    ids: tuple[int, ...]
    finished: bool = False
    finish_reason: str | None = None
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int | None = None

    def finish(
        self, matched: bool, generated: int, prompt_tokens: int, cached_tokens: int = 0
    ) -> tuple[str, Usage] | None:
        """How the choice ends with this message, given whether a stop string `matched` in its
        text, the tokens `generated` so far (these included) and the prompt tokens that came from
        a prefix cache the last time an instance prefilled it (`cached_tokens`, the stream's
        count): (finish reason, usage), or None while it goes on. A stop string is a "stop"; the
        worker's own end is its reason ("stop" on an EOS or token-level stop, else "length"). The
        usage takes the worker's counts when it finished (they cover every instance the choice
        ran on), never fewer tokens than streamed, and never more cached tokens than prompt."""
        if not (matched or self.finished):
            return None
        reason = FINISH_STOP if matched or self.finish_reason == "stop" else FINISH_LENGTH
        prompt = self.prompt_tokens if self.finished and self.prompt_tokens else prompt_tokens
        return reason, Usage(
            prompt_tokens=prompt,
            completion_tokens=max(generated, self.completion_tokens if self.finished else 0),
            cached_tokens=min(cached_tokens, prompt),
        )


@dataclass(frozen=True, slots=True)
class HandedOff(Tokens):
    """A prefill instance's first token(s), with the request's KV handed off to `kv`: its part
    ends here (unless a stop string matched), and the decode instance pulls the KV from there."""

    kv: kv_pb2.KVTransferDescriptor | None = None


@dataclass(frozen=True, slots=True)
class Moved:
    """Live migration: the instance let the running request go with its KV (`kv`); the next
    instance pulls it and goes on after the tokens so far."""

    kv: kv_pb2.KVTransferDescriptor
    detail: str = "the instance released the running request with its KV (live migration)"
    reason: str = "live_migration"


@dataclass(frozen=True, slots=True)
class Bad:
    """The message ends the attempt as the instance's failure (`code`, `detail`): malformed, or
    an abort (nothing in it counts: the request resumes elsewhere)."""

    code: grpc.StatusCode
    detail: str


Reply = Tokens | HandedOff | Moved | Bad


def classify(msg: worker_pb2.WorkerGenerateResponse, *, handoff: bool, resumed: bool) -> Reply:
    """What `msg` means for an attempt that was (`handoff`) or was not asked to hand its KV off
    after its first token, on a choice that has (`resumed`) or has not generated tokens before.

    - KV handed off, with no token and no finish, by an instance not asked to, after tokens:
      Moved (live migration).
    - Any other hand-off not asked for, or with no token or with a finish: Bad (INTERNAL).
    - A finish reason the gateway does not know: Bad (INTERNAL).
    - An abort (drained or stopped): Bad (ABORTED).
    - Else its tokens: HandedOff when it hands the KV off, Tokens otherwise.
    """
    finished = msg.HasField("finish_reason")
    handed_off = msg.HasField("kv_handoff")
    if handed_off and not handoff and not finished and not msg.token_ids and resumed:
        return Moved(msg.kv_handoff)
    if handed_off and (finished or not handoff or not msg.token_ids):
        return Bad(
            grpc.StatusCode.INTERNAL,
            "the instance handed off KV it was not asked to, or with no token or with a finish_reason",
        )
    try:
        reason = finish_reason_from_proto(msg.finish_reason) if finished else None
    except ValueError as e:
        return Bad(grpc.StatusCode.INTERNAL, str(e))
    if reason == "abort":
        return Bad(grpc.StatusCode.ABORTED, "the instance aborted the request (drained or stopped)")
    ids = tuple(msg.token_ids)
    cached = msg.cached_tokens if msg.HasField("cached_tokens") else None
    if handed_off:
        return HandedOff(ids, cached_tokens=cached, kv=msg.kv_handoff)
    return Tokens(ids, finished, reason, msg.prompt_tokens, msg.completion_tokens, cached)
