"""Internal request and event types of the gateway, and the checks both APIs share.

The HTTP and gRPC front ends convert their wire formats into `InferenceRequest`; the backend
turns it into a stream of `TokenDelta` events closed by one `Finish`. No protobuf in here.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from services.gateway.errors import invalid, quote

INT32_MAX = 2**31 - 1
INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1
MAX_STOP_SEQUENCES = 4
CHAT_ROLES = frozenset({"system", "developer", "user", "assistant", "tool"})

FINISH_STOP = "stop"  # eos, a stop token id or a stop string
FINISH_LENGTH = "length"  # max_tokens or the context limit


@dataclass(frozen=True)
class Sampling:
    """Sampling parameters; None means "the worker's (or gateway's) default"."""

    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    max_tokens: int | None = None
    stop: tuple[str, ...] = ()
    seed: int | None = None
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False


@dataclass(frozen=True)
class ChatMessage:
    role: str
    content: str


@dataclass(frozen=True)
class InferenceRequest:
    """One generation request; exactly one of prompt, messages, prompt_token_ids is set."""

    model: str
    request_id: str
    sampling: Sampling = field(default_factory=Sampling)
    prompt: str | None = None
    messages: tuple[ChatMessage, ...] = ()
    prompt_token_ids: tuple[int, ...] = ()
    return_token_ids: bool = False
    api: str = "http"  # which front end took it; a metrics label


@dataclass(frozen=True)
class Usage:
    prompt_tokens: int
    completion_tokens: int

    @property
    def total_tokens(self) -> int:
        return self.prompt_tokens + self.completion_tokens


@dataclass(frozen=True)
class TokenDelta:
    """New completion text (possibly empty when only token ids are asked for)."""

    text: str
    token_ids: tuple[int, ...]
    instance_id: str


@dataclass(frozen=True)
class Finish:
    """The last event of every successful stream."""

    finish_reason: str
    usage: Usage
    instance_id: str


Event = TokenDelta | Finish


def validate_sampling(s: Sampling, *, max_tokens_param: str = "max_tokens") -> None:
    """Range checks shared by both APIs; raises GatewayError(INVALID) quoting the bad value."""
    if s.temperature is not None and not (math.isfinite(s.temperature) and 0.0 <= s.temperature <= 2.0):
        raise invalid(f"temperature must be between 0 and 2, got {quote(s.temperature)}", "temperature")
    if s.top_p is not None and not (math.isfinite(s.top_p) and 0.0 < s.top_p <= 1.0):
        raise invalid(f"top_p must be in (0, 1], got {quote(s.top_p)}", "top_p")
    if s.top_k is not None and not (-1 <= s.top_k <= INT32_MAX):
        raise invalid(f"top_k must be -1 or 0 (off) or a positive integer, got {quote(s.top_k)}", "top_k")
    if s.max_tokens is not None:
        if s.max_tokens <= 0:
            raise invalid(f"{max_tokens_param} must be at least 1, got {quote(s.max_tokens)}", max_tokens_param)
        if s.max_tokens > INT32_MAX:
            raise invalid(
                f"{max_tokens_param} must be at most {INT32_MAX}, got {quote(s.max_tokens)}", max_tokens_param
            )
    if len(s.stop) > MAX_STOP_SEQUENCES:
        raise invalid(
            f"stop holds at most {MAX_STOP_SEQUENCES} sequences, got {len(s.stop)}: {quote(list(s.stop))}", "stop"
        )
    for seq in s.stop:
        if not seq:
            raise invalid(f"stop sequences must be non-empty strings, got {quote(list(s.stop))}", "stop")
    if s.seed is not None and not (INT64_MIN <= s.seed <= INT64_MAX):
        raise invalid(f"seed must fit in 64 bits, got {quote(s.seed)}", "seed")
    for tid in s.stop_token_ids:
        if not (0 <= tid <= INT32_MAX):
            raise invalid(f"stop_token_ids must be non-negative token ids, got {quote(tid)}", "stop_token_ids")


def validate_request(req: InferenceRequest) -> None:
    """Shape checks that need no model: model named, one kind of input, sane sampling."""
    if not req.model:
        raise invalid("model is required (a model id from GET /v1/models)", "model")
    given = [
        name
        for name, present in (
            ("prompt", req.prompt is not None),
            ("messages", bool(req.messages)),
            ("prompt_token_ids", bool(req.prompt_token_ids)),
        )
        if present
    ]
    if len(given) != 1:
        raise invalid(f"give exactly one of prompt, messages, prompt_token_ids; got {given or 'none'}", "prompt")
    for i, msg in enumerate(req.messages):
        if msg.role not in CHAT_ROLES:
            raise invalid(
                f"messages[{i}].role must be one of {sorted(CHAT_ROLES)}, got {quote(msg.role)}", f"messages[{i}].role"
            )
    for tid in req.prompt_token_ids:
        if tid < 0:
            raise invalid(f"prompt token ids must be non-negative, got {quote(tid)}", "prompt")
    validate_sampling(req.sampling)
