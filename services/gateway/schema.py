"""Internal request and event types of the gateway, and the checks both APIs share.

The HTTP and gRPC front ends convert their wire formats into `InferenceRequest`; the backend
turns it into a stream of `TokenDelta` events, each choice closed by one `Finish`. No protobuf
in here. The sampling type is the SDK's `SamplingParams` (None = "the worker's or gateway's
default"), so one converter (`blitzmesh.convert`) serves both sides of the public wire.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, fields
from typing import Any

from blitzmesh.types import SamplingParams as Sampling
from blitzmesh.types import SLOAttainment
from services.gateway.errors import invalid, quote

# re-exported: the gateway's names for the SDK's SamplingParams and SLOAttainment
__all__ = ["SLOAttainment", "Sampling"]

INT32_MAX = 2**31 - 1
INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1
MAX_STOP_SEQUENCES = 4
MAX_N = 128  # OpenAI's limit on n; GatewayConfig.max_n may set a lower one
MAX_TOP_LOGPROBS = 20
CHAT_ROLES = frozenset({"system", "developer", "user", "assistant", "tool"})

FINISH_STOP = "stop"  # eos, a stop token id or a stop string
FINISH_LENGTH = "length"  # max_tokens or the context limit


@dataclass(frozen=True)
class ChatMessage:
    role: str
    content: str


@dataclass(frozen=True)
class SLO:
    """A request's latency objectives in seconds; None = none of that kind. `ttft_s`: from the
    gateway accepting the request to its first token; `tpot_s`: mean time per output token
    after the first. Checked by `validate_request` (positive, finite)."""

    ttft_s: float | None = None
    tpot_s: float | None = None

    @property
    def is_empty(self) -> bool:
        return self.ttft_s is None and self.tpot_s is None

    def value(self, kind: str) -> float | None:
        return self.ttft_s if kind == "ttft" else self.tpot_s


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
    n: int = 1  # independent choices; choice i of a seeded request samples with seed + i
    echo: bool = False  # prepend the prompt text to each choice (prompts only, not messages)
    slo: SLO = field(default_factory=SLO)  # as given; the backend fills in the deployment's defaults
    arrived_s: float | None = None  # time.monotonic() when the backend accepted it (the TTFT clock)


@dataclass(frozen=True)
class Usage:
    prompt_tokens: int
    completion_tokens: int
    slo: SLOAttainment | None = None  # set when the request had an SLO
    # Of prompt_tokens, those whose KV came from a prefix cache (the last time the prompt was
    # prefilled for this answer; docs/architecture/gateway.md, "Cached prompt tokens").
    cached_tokens: int = 0

    @property
    def total_tokens(self) -> int:
        return self.prompt_tokens + self.completion_tokens


def total_usage(usages: Sequence[Usage]) -> Usage:
    """The usage of a request with n choices: the prompt once (its tokens, and those of them
    cached, the largest over the choices), every choice's completion tokens, and the worst
    choice's SLO attainment."""
    return Usage(
        max((u.prompt_tokens for u in usages), default=0),
        sum(u.completion_tokens for u in usages),
        combine_attainment([u.slo for u in usages if u.slo is not None]),
        max((u.cached_tokens for u in usages), default=0),
    )


def slo_attainment(slo: SLO, ttft_observed_s: float, tpot_observed_s: float, tokens: int) -> SLOAttainment | None:
    """One choice's attainment: TTFT met if within its objective; TPOT met if within its
    objective, or trivially with fewer than two tokens (no gap to miss). None without an SLO."""
    if slo.is_empty:
        return None
    return SLOAttainment(
        ttft_s=slo.ttft_s,
        tpot_s=slo.tpot_s,
        ttft_met=None if slo.ttft_s is None else ttft_observed_s <= slo.ttft_s,
        tpot_met=None if slo.tpot_s is None else tokens < 2 or tpot_observed_s <= slo.tpot_s,
        ttft_observed_s=ttft_observed_s,
        tpot_observed_s=tpot_observed_s if tokens >= 2 else 0.0,
    )


def combine_attainment(parts: Sequence[SLOAttainment]) -> SLOAttainment | None:
    """A request of several choices met an objective only if every choice did; the observed
    figures are the worst choice's."""
    if not parts:
        return None
    first = parts[0]

    def met(name: str) -> bool | None:
        values = [getattr(p, name) for p in parts if getattr(p, name) is not None]
        return all(values) if values else None

    return SLOAttainment(
        ttft_s=first.ttft_s,
        tpot_s=first.tpot_s,
        ttft_met=met("ttft_met"),
        tpot_met=met("tpot_met"),
        ttft_observed_s=max(p.ttft_observed_s for p in parts),
        tpot_observed_s=max(p.tpot_observed_s for p in parts),
    )


@dataclass(frozen=True)
class TopLogprob:
    """One of the most likely tokens at a position, with its text (`token`) and exact bytes."""

    token_id: int
    logprob: float
    token: str
    bytes: bytes


@dataclass(frozen=True)
class TokenLogprob:
    """A token's log-prob under the model's raw distribution (None for the first prompt token),
    its text and bytes, the most likely tokens at its position, and where its text starts in
    the choice's text (characters; the prompt counts when it is echoed)."""

    token_id: int
    logprob: float | None
    token: str
    bytes: bytes
    top: tuple[TopLogprob, ...]
    text_offset: int


@dataclass(frozen=True)
class TokenDelta:
    """New text of choice `index` (possibly empty when only token ids or log-probs are asked
    for). `logprobs` has one entry per token of `token_ids` when the request asked for them;
    a choice's first delta carries `prompt_logprobs` when asked for, and the echoed prompt at
    the start of its `text`. `completion_tokens` counts the choice's tokens generated so far,
    these included (also those whose text is still held back, on every instance it ran on);
    `prompt_tokens` is its prompt's length and `cached_tokens` how many of those came from a
    prefix cache, as known so far (streamed usage, continuous_usage_stats)."""

    text: str
    token_ids: tuple[int, ...]
    instance_id: str
    index: int = 0
    logprobs: tuple[TokenLogprob, ...] = ()
    prompt_logprobs: tuple[TokenLogprob, ...] = ()
    completion_tokens: int = 0
    prompt_tokens: int = 0
    cached_tokens: int = 0


@dataclass(frozen=True)
class Finish:
    """The last event of each choice of a successful stream; `usage` is that choice's."""

    finish_reason: str
    usage: Usage
    instance_id: str
    index: int = 0


Event = TokenDelta | Finish


def _check_sampling(v: Mapping[str, Any], max_tokens_param: str) -> None:
    temperature, top_p, top_k, max_tokens = v["temperature"], v["top_p"], v["top_k"], v["max_tokens"]
    if temperature is not None and not (math.isfinite(temperature) and 0.0 <= temperature <= 2.0):
        raise invalid(f"temperature must be between 0 and 2, got {quote(temperature)}", "temperature")
    if top_p is not None and not (math.isfinite(top_p) and 0.0 < top_p <= 1.0):
        raise invalid(f"top_p must be in (0, 1], got {quote(top_p)}", "top_p")
    if top_k is not None and not (-1 <= top_k <= INT32_MAX):
        raise invalid(f"top_k must be -1 or 0 (off) or a positive integer, got {quote(top_k)}", "top_k")
    if max_tokens is not None:
        if max_tokens <= 0:
            raise invalid(f"{max_tokens_param} must be at least 1, got {quote(max_tokens)}", max_tokens_param)
        if max_tokens > INT32_MAX:
            raise invalid(f"{max_tokens_param} must be at most {INT32_MAX}, got {quote(max_tokens)}", max_tokens_param)
    stop = list(v["stop"])
    if len(stop) > MAX_STOP_SEQUENCES:
        raise invalid(f"stop holds at most {MAX_STOP_SEQUENCES} sequences, got {len(stop)}: {quote(stop)}", "stop")
    for seq in stop:
        if not seq:
            raise invalid(f"stop sequences must be non-empty strings, got {quote(stop)}", "stop")
    seed = v["seed"]
    if seed is not None and not (INT64_MIN <= seed <= INT64_MAX):
        raise invalid(f"seed must fit in 64 bits, got {quote(seed)}", "seed")
    for tid in v["stop_token_ids"]:
        if not (0 <= tid <= INT32_MAX):
            raise invalid(f"stop_token_ids must be non-negative token ids, got {quote(tid)}", "stop_token_ids")
    for name in ("presence_penalty", "frequency_penalty"):
        value = v[name]
        if value is not None and not (math.isfinite(value) and -2.0 <= value <= 2.0):
            raise invalid(f"{name} must be between -2 and 2, got {quote(value)}", name)
    rep = v["repetition_penalty"]
    if rep is not None and not (math.isfinite(rep) and rep > 0):
        raise invalid(f"repetition_penalty must be a number > 0 (1 = off), got {quote(rep)}", "repetition_penalty")
    bias = v["logit_bias"]
    for token, value in bias.items() if isinstance(bias, Mapping) else bias:
        if not 0 <= token <= INT32_MAX:
            raise invalid(f"logit_bias keys must be token ids >= 0, got {quote(token)}", "logit_bias")
        if not (math.isfinite(value) and -100.0 <= value <= 100.0):
            raise invalid(
                f"logit_bias values must be between -100 and 100, got {quote(value)} for token {token}", "logit_bias"
            )
    for name in ("logprobs", "prompt_logprobs"):
        value = v[name]
        if value is not None and not 0 <= value <= MAX_TOP_LOGPROBS:
            raise invalid(f"{name} must be between 0 and {MAX_TOP_LOGPROBS}, got {quote(value)}", name)


def build_sampling(values: Mapping[str, Any], *, max_tokens_param: str = "max_tokens") -> Sampling:
    """A Sampling from already type-checked values; GatewayError(INVALID) naming the param when
    a value is out of range (checked here first, so the SDK type's own checks never fire)."""
    full = {f.name: values.get(f.name, f.default) for f in fields(Sampling)}
    _check_sampling(full, max_tokens_param)
    try:
        return Sampling(**full)
    except ValueError as e:  # a check the gateway's missed: still the client's value
        raise invalid(str(e)) from e


def validate_sampling(s: Sampling, *, max_tokens_param: str = "max_tokens") -> None:
    """Range checks shared by both APIs; raises GatewayError(INVALID) quoting the bad value."""
    _check_sampling({f.name: getattr(s, f.name) for f in fields(s)}, max_tokens_param)


def validate_slo(slo: SLO) -> None:
    """Each objective, when given, a positive finite number of seconds; GatewayError(INVALID)
    naming the field (`ttft_slo_s`, `tpot_slo_s`) and quoting the value."""
    for name, value in (("ttft_slo_s", slo.ttft_s), ("tpot_slo_s", slo.tpot_s)):
        if value is None:
            continue
        if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value) or value <= 0:
            raise invalid(f"{name} must be a positive number of seconds, got {quote(value)}", name)


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
    if not 1 <= req.n <= MAX_N:
        raise invalid(f"n must be between 1 and {MAX_N}, got {quote(req.n)}", "n")
    if req.echo and req.messages:
        raise invalid("echo needs a prompt (or prompt_token_ids): chat messages have no prompt text to echo", "echo")
    validate_sampling(req.sampling)
    validate_slo(req.slo)
