"""OpenAI wire format: request bodies -> InferenceRequest (every refusal quotes the value), and
the response, chunk and error objects of /v1/completions and /v1/chat/completions. No I/O.

Supported beyond the basics, as OpenAI (and vLLM, for its extensions) define them:
- `n` (1..128, capped by the gateway's `max_n`): n independent choices, index 0..n-1, streamed
  interleaved; usage counts the prompt once and every choice's completion tokens. With a `seed`,
  choice i samples with seed + i.
- log-probs, of the model's raw distribution (before temperature, penalties and logit_bias):
  chat `logprobs: true` + `top_logprobs` 0..20 -> `choices[].logprobs.content[]`; completions
  `logprobs` 0..5 -> `{tokens, token_logprobs, top_logprobs, text_offset}`, where each
  top_logprobs dict also holds the chosen token (so up to logprobs + 1 entries, as OpenAI says).
  A token that is not whole UTF-8 reads `bytes:\\xe2\\x98`, its `bytes` exact.
- `presence_penalty`, `frequency_penalty` (-2..2, over generated tokens), `repetition_penalty`
  (vLLM's, > 0, over prompt + generated tokens), `logit_bias` (token id -> -100..100).
- completions `echo`: the prompt text starts each choice's text; with `logprobs`, the prompt
  tokens' log-probs come first (the first token's is null), computed in the same prefill.
- `usage.prompt_tokens_details.cached_tokens` on every response and final usage chunk: the prompt
  tokens whose KV came from a prefix cache (docs/architecture/gateway.md says which attempt of a
  retried, migrated or split request counts).
- Blitzmesh's per-request SLOs: `ttft_slo_s` and `tpot_slo_s` (positive seconds; unset ones take
  the deployment's defaults). With an SLO, `usage.slo` reports whether each was met; a request no
  instance can serve within its objective gets a 429 with `Retry-After`.
- What the benchmark clients (GuideLLM, `vllm bench serve`, AIPerf) send, as vLLM takes it:
  `stream_options.continuous_usage_stats` (with include_usage, every chunk carries its choice's
  usage so far: the prompt, the completion tokens up to that chunk, their total; the role chunk
  counts 0), `stop: null`, `logprobs: null`, and `min_tokens` where the engine's sampling can
  guarantee it without an EOS mask: with `ignore_eos` (nothing but max_tokens ends a choice) or
  equal to max_tokens (the gateway then sets ignore_eos); both need an explicit max_tokens and no
  stop or stop_token_ids. `min_p` 0 (vLLM's "off") is accepted.
Still refused with a 400: `best_of` other than n, `suffix`, tools, non-text response_format,
`min_p` other than 0 (no min-p filter), `min_tokens` the engine cannot guarantee.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Literal

from services.gateway.errors import invalid, quote
from services.gateway.schema import (
    MAX_N,
    MAX_TOP_LOGPROBS,
    SLO,
    ChatMessage,
    InferenceRequest,
    SLOAttainment,
    TokenLogprob,
    Usage,
    build_sampling,
    validate_request,
)

Kind = Literal["completion", "chat"]

MAX_COMPLETION_LOGPROBS = 5  # OpenAI's limit for the legacy completions API

_COMMON_FIELDS = frozenset(
    {
        "model", "stream", "stream_options", "temperature", "top_p", "top_k", "max_tokens", "stop", "seed",
        "n", "presence_penalty", "frequency_penalty", "repetition_penalty", "logit_bias", "user", "ignore_eos",
        "stop_token_ids", "logprobs", "metadata", "store", "service_tier", "ttft_slo_s", "tpot_slo_s",
        "min_tokens", "min_p",
    }
)  # fmt: skip
_COMPLETION_FIELDS = _COMMON_FIELDS | {"prompt", "best_of", "echo", "suffix"}
_CHAT_FIELDS = _COMMON_FIELDS | {
    "messages", "max_completion_tokens", "top_logprobs", "response_format", "tools", "tool_choice",
    "parallel_tool_calls",
}  # fmt: skip
# include_obfuscation (OpenAI's padding of chunks against length side channels) is accepted and
# ignored: there is no third party between a client and the gateway's stream to hide sizes from.
_STREAM_OPTIONS = frozenset({"include_usage", "continuous_usage_stats", "include_obfuscation"})


@dataclass(frozen=True)
class OpenAIRequest:
    """A parsed request: what to generate plus how to answer (stream, usage in the stream;
    `continuous_usage`: usage on every chunk too, vLLM's `continuous_usage_stats`)."""

    kind: Kind
    inference: InferenceRequest
    stream: bool
    include_usage: bool
    continuous_usage: bool = False

    @property
    def logprobs(self) -> bool:
        """Whether the answer carries log-probs objects (else `"logprobs": null`)."""
        return self.inference.sampling.logprobs is not None


# ---- body -> request ---------------------------------------------------------------------


def _reject_constant(name: str) -> Any:
    raise ValueError(f"{name} is not valid JSON")


def parse_json_body(raw: bytes) -> dict[str, Any]:
    """The request body as a JSON object; NaN/Infinity are refused (they pass range checks)."""
    if not raw:
        raise invalid("the request body is empty; send a JSON object")
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise invalid(f"the request body is not valid UTF-8 (byte {e.start})") from e
    try:
        body = json.loads(text, parse_constant=_reject_constant)
    except ValueError as e:
        raise invalid(f"the request body is not valid JSON: {e}") from e
    if not isinstance(body, dict):
        raise invalid(f"the request body must be a JSON object, got {type(body).__name__}: {quote(body)}")
    return body


def parse_completion(body: dict[str, Any], request_id: str) -> OpenAIRequest:
    """POST /v1/completions."""
    _check_fields(body, _COMPLETION_FIELDS)
    n = _n(body)
    _unsupported(body, "best_of", lambda v: v is None or v == n, f"best_of must equal n={n} (no server-side ranking)")
    _unsupported(body, "suffix", lambda v: v in (None, ""), "suffix is not supported")
    echo = _bool(body, "echo") or False
    logprobs = _int(body, "logprobs")
    if logprobs is not None and not 0 <= logprobs <= MAX_COMPLETION_LOGPROBS:
        raise invalid(
            f"logprobs must be an integer between 0 and {MAX_COMPLETION_LOGPROBS}, got {quote(logprobs)}", "logprobs"
        )
    prompt, prompt_ids = _parse_prompt(body.get("prompt"))
    extra = {"logprobs": logprobs, "prompt_logprobs": logprobs if echo else None}
    return _finish(
        body, "completion", request_id, "max_tokens", extra, n=n, echo=echo, prompt=prompt, prompt_token_ids=prompt_ids
    )


def parse_chat(body: dict[str, Any], request_id: str) -> OpenAIRequest:
    """POST /v1/chat/completions."""
    _check_fields(body, _CHAT_FIELDS)
    want = _bool(body, "logprobs") or False
    top = _int(body, "top_logprobs")
    if top is not None:
        if not 0 <= top <= MAX_TOP_LOGPROBS:
            raise invalid(
                f"top_logprobs must be an integer between 0 and {MAX_TOP_LOGPROBS}, got {quote(top)}", "top_logprobs"
            )
        if top and not want:  # 0 asks for nothing, so it is harmless without logprobs
            raise invalid(f"top_logprobs needs logprobs=true, got top_logprobs={quote(top)} without it", "top_logprobs")
    _unsupported(body, "tools", lambda v: v in (None, []), "tools (function calling) are not supported")
    _unsupported(body, "tool_choice", lambda v: v in (None, "none"), "tool_choice is not supported")
    _unsupported(
        body,
        "response_format",
        lambda v: v is None or (isinstance(v, dict) and v.get("type") == "text"),
        'only response_format {"type": "text"} is supported',
    )
    messages = _parse_messages(body.get("messages"))
    param = "max_tokens"
    if body.get("max_completion_tokens") is not None:
        # The newer name wins; max_tokens is its deprecated alias.
        param = "max_completion_tokens"
    extra = {"logprobs": (top or 0) if want else None}
    return _finish(body, "chat", request_id, param, extra, n=_n(body), messages=messages)


def _finish(
    body: dict[str, Any],
    kind: Kind,
    request_id: str,
    max_tokens_param: str,
    sampling_extra: dict[str, Any],
    **inputs: Any,
) -> OpenAIRequest:
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise invalid(
            f"model must be a non-empty string naming a model from GET /v1/models, got {quote(model)}", "model"
        )
    stream = _bool(body, "stream") or False
    include_usage = continuous_usage = False
    options = body.get("stream_options")
    if options is not None:
        if not stream:
            raise invalid(f"stream_options is only allowed with stream=true, got {quote(options)}", "stream_options")
        if not isinstance(options, dict) or set(options) - _STREAM_OPTIONS:
            raise invalid(
                f"stream_options takes include_usage and continuous_usage_stats (true or false), got {quote(options)}",
                "stream_options",
            )
        include_usage = _bool(options, "include_usage", "stream_options.include_usage") or False
        continuous = _bool(options, "continuous_usage_stats", "stream_options.continuous_usage_stats") or False
        continuous_usage = include_usage and continuous  # as vLLM: per-chunk usage rides on include_usage
    _unsupported(
        body,
        "min_p",
        lambda v: v is None or (not isinstance(v, bool) and v == 0),
        "min_p is not supported (the engine has no min-p filter), only min_p=0 (off)",
    )
    max_tokens = _int(body, max_tokens_param)
    stop = _parse_stop(body.get("stop"))
    stop_token_ids = _int_list(body, "stop_token_ids")
    ignore_eos = _min_tokens_ignore_eos(
        body, max_tokens, max_tokens_param, bool(stop or stop_token_ids), _bool(body, "ignore_eos") or False
    )
    sampling = build_sampling(
        {
            "temperature": _number(body, "temperature"),
            "top_p": _number(body, "top_p"),
            "top_k": _int(body, "top_k"),
            "max_tokens": max_tokens,
            "stop": stop,
            "seed": _int(body, "seed"),
            "stop_token_ids": stop_token_ids,
            "ignore_eos": ignore_eos,
            "presence_penalty": _number(body, "presence_penalty"),
            "frequency_penalty": _number(body, "frequency_penalty"),
            "repetition_penalty": _number(body, "repetition_penalty"),
            "logit_bias": _parse_logit_bias(body.get("logit_bias")),
            **sampling_extra,
        },
        max_tokens_param=max_tokens_param,
    )
    slo = SLO(_slo_s(body, "ttft_slo_s"), _slo_s(body, "tpot_slo_s"))
    req = InferenceRequest(model=model, request_id=request_id, sampling=sampling, api="http", slo=slo, **inputs)
    validate_request(req)
    return OpenAIRequest(kind, req, stream, include_usage, continuous_usage)


def _min_tokens_ignore_eos(
    body: dict[str, Any], max_tokens: int | None, max_tokens_param: str, stops: bool, ignore_eos: bool
) -> bool:
    """The request's ignore_eos once vLLM's `min_tokens` is honoured. The engine has no EOS mask,
    so a minimum is guaranteed only when nothing but max_tokens can end a choice: ignore_eos with
    no stop strings or stop_token_ids and an explicit max_tokens (a prompt + max_tokens beyond the
    context is refused before generating), or min_tokens == max_tokens, which asks exactly that
    (ignore_eos is then set). Anything else is a 400 naming min_tokens."""
    min_tokens = _int(body, "min_tokens")
    if not min_tokens:  # None or 0: no minimum
        return ignore_eos
    got = f"got min_tokens={min_tokens}"
    if min_tokens < 0:
        raise invalid(f"min_tokens must be a non-negative integer, {got}", "min_tokens")
    if max_tokens is None:
        raise invalid(f"min_tokens needs an explicit {max_tokens_param} (at least min_tokens), {got}", "min_tokens")
    if min_tokens > max_tokens:
        raise invalid(f"min_tokens must be at most {max_tokens_param}={max_tokens}, {got}", "min_tokens")
    if stops:
        raise invalid(
            f"min_tokens cannot be combined with stop or stop_token_ids (they cannot be held back until"
            f" min_tokens here), {got} with stop={quote(body.get('stop'))},"
            f" stop_token_ids={quote(body.get('stop_token_ids'))}",
            "min_tokens",
        )
    if ignore_eos or min_tokens == max_tokens:
        return True
    raise invalid(
        f"min_tokens below {max_tokens_param} needs ignore_eos=true (the engine cannot mask EOS until"
        f" min_tokens; min_tokens equal to {max_tokens_param} also works), {got} with"
        f" {max_tokens_param}={max_tokens}",
        "min_tokens",
    )


def _n(body: dict[str, Any]) -> int:
    n = _int(body, "n")
    if n is None:
        return 1
    if not 1 <= n <= MAX_N:
        raise invalid(f"n must be an integer between 1 and {MAX_N}, got {quote(n)}", "n")
    return n


def _parse_logit_bias(value: Any) -> dict[int, float]:
    """`{"token id as a string": bias}`, as JSON writes OpenAI's map; ranges are checked later."""
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise invalid(f"logit_bias must be an object mapping token ids to numbers, got {quote(value)}", "logit_bias")
    out: dict[int, float] = {}
    for key, bias in value.items():
        token = key.strip() if isinstance(key, str) else ""
        if not (token.isdigit() and token.isascii()):
            raise invalid(f"logit_bias keys must be token ids (non-negative integers), got {quote(key)}", "logit_bias")
        if isinstance(bias, bool) or not isinstance(bias, (int, float)) or not math.isfinite(bias):
            raise invalid(f"logit_bias values must be numbers, got {quote(bias)} for token {key}", "logit_bias")
        out[int(token)] = float(bias)
    return out


def _check_fields(body: dict[str, Any], allowed: frozenset[str]) -> None:
    unknown = sorted(set(body) - allowed)
    if unknown:
        raise invalid(f"Unrecognized request argument supplied: {', '.join(quote(u) for u in unknown)}", unknown[0])


def _unsupported(body: dict[str, Any], name: str, ok: Callable[[Any], bool], why: str) -> None:
    value = body.get(name)
    if not ok(value):
        raise invalid(f"{why}; got {name}={quote(value)}", name)


def _is_int(value: Any) -> bool:
    # bool is an int subclass in Python; `true` is not a count.
    return isinstance(value, int) and not isinstance(value, bool)


def _number(body: dict[str, Any], name: str) -> float | None:
    value = body.get(name)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise invalid(f"{name} must be a number, got {quote(value)}", name)
    return float(value)


def _slo_s(body: dict[str, Any], name: str) -> float | None:
    """A latency objective: a positive number of seconds (range checked by validate_request)."""
    value = body.get(name)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise invalid(f"{name} must be a positive number of seconds, got {quote(value)}", name)
    return float(value)


def _int(body: dict[str, Any], name: str) -> int | None:
    value = body.get(name)
    if value is None:
        return None
    if isinstance(value, float) and value.is_integer():
        return int(value)  # JSON writers often send 16.0 for 16
    if not _is_int(value):
        raise invalid(f"{name} must be an integer, got {quote(value)}", name)
    return int(value)


def _bool(body: dict[str, Any], name: str, param: str | None = None) -> bool | None:
    value = body.get(name)
    if value is None:
        return None
    if not isinstance(value, bool):
        raise invalid(f"{param or name} must be true or false, got {quote(value)}", param or name)
    return value


def _int_list(body: dict[str, Any], name: str) -> tuple[int, ...]:
    value = body.get(name)
    if value is None:
        return ()
    if not isinstance(value, list) or not all(_is_int(v) for v in value):
        raise invalid(f"{name} must be a list of integers, got {quote(value)}", name)
    return tuple(value)


def _parse_stop(value: Any) -> tuple[str, ...]:
    if value is None:
        return ()
    if isinstance(value, str):
        if not value:
            raise invalid(f"stop must be a non-empty string or a list of them, got {quote(value)}", "stop")
        return (value,)
    if isinstance(value, list) and all(isinstance(s, str) for s in value):
        return tuple(value)  # count and emptiness are checked by validate_sampling
    raise invalid(f"stop must be a string or a list of at most 4 strings, got {quote(value)}", "stop")


def _parse_prompt(value: Any) -> tuple[str | None, tuple[int, ...]]:
    """OpenAI allows a string, a token list, or a batch of either; a batch must hold one."""
    if isinstance(value, str):
        return value, ()
    if isinstance(value, list):
        if value and all(_is_int(v) for v in value):
            return None, tuple(value)
        if len(value) == 1 and isinstance(value[0], (str, list)):
            return _parse_prompt(value[0])
        if len(value) > 1 and all(isinstance(v, (str, list)) for v in value):
            raise invalid(f"only one prompt per request is supported, got a batch of {len(value)}", "prompt")
    raise invalid(
        f"prompt must be a string, a list of token ids, or a one-element list of either, got {quote(value)}", "prompt"
    )


def _parse_messages(value: Any) -> tuple[ChatMessage, ...]:
    if not isinstance(value, list) or not value:
        raise invalid(
            f'messages must be a non-empty list of {{"role", "content"}} objects, got {quote(value)}', "messages"
        )
    out: list[ChatMessage] = []
    for i, msg in enumerate(value):
        if not isinstance(msg, dict):
            raise invalid(f"messages[{i}] must be an object, got {quote(msg)}", f"messages[{i}]")
        role = msg.get("role")
        if not isinstance(role, str):
            raise invalid(f"messages[{i}].role must be a string, got {quote(role)}", f"messages[{i}].role")
        if msg.get("tool_calls"):
            raise invalid(
                f"messages[{i}].tool_calls are not supported, got {quote(msg['tool_calls'])}",
                f"messages[{i}].tool_calls",
            )
        out.append(ChatMessage(role, _message_text(i, msg.get("content"))))
    return tuple(out)


def _message_text(i: int, content: Any) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts: list[str] = []
        for j, part in enumerate(content):
            if not (isinstance(part, dict) and part.get("type") == "text" and isinstance(part.get("text"), str)):
                raise invalid(
                    f'messages[{i}].content[{j}] must be {{"type": "text", "text": str}} (only text is'
                    f" supported), got {quote(part)}",
                    f"messages[{i}].content",
                )
            parts.append(part["text"])
        return "".join(parts)
    raise invalid(
        f"messages[{i}].content must be a string or a list of text parts, got {quote(content)}",
        f"messages[{i}].content",
    )


# ---- results -> response objects ---------------------------------------------------------


def usage_json(usage: Usage) -> dict[str, Any]:
    """`usage`, with `prompt_tokens_details.cached_tokens` always present (0 when nothing was
    cached), as OpenAI sends it: AIPerf and GuideLLM count prefix-cache hits from it."""
    out: dict[str, Any] = {
        "prompt_tokens": usage.prompt_tokens,
        "completion_tokens": usage.completion_tokens,
        "total_tokens": usage.total_tokens,
        "prompt_tokens_details": {"cached_tokens": usage.cached_tokens},
    }
    if usage.slo is not None:
        out["slo"] = slo_json(usage.slo)
    return out


def slo_json(slo: SLOAttainment) -> dict[str, Any]:
    """`usage.slo`: the objectives (null when not set), whether each was met, and what was seen."""
    return {
        "ttft_s": slo.ttft_s,
        "tpot_s": slo.tpot_s,
        "ttft_met": slo.ttft_met,
        "tpot_met": slo.tpot_met,
        "ttft_observed_s": round(slo.ttft_observed_s, 6),
        "tpot_observed_s": round(slo.tpot_observed_s, 6),
    }


@dataclass(frozen=True)
class ChoiceOutput:
    """One finished choice of a non-streamed answer."""

    index: int
    text: str
    finish_reason: str
    logprobs: Sequence[TokenLogprob] | None = None  # None: not asked for


def logprobs_json(kind: Kind, entries: Sequence[TokenLogprob]) -> dict[str, Any]:
    """The `logprobs` object of a choice (or of a chunk: the entries of its tokens)."""
    if kind == "chat":
        return {
            "content": [
                {
                    "token": e.token,
                    "logprob": e.logprob,
                    "bytes": list(e.bytes),
                    "top_logprobs": [{"token": t.token, "logprob": t.logprob, "bytes": list(t.bytes)} for t in e.top],
                }
                for e in entries
            ],
            "refusal": None,
        }
    top: list[dict[str, float] | None] = []
    for e in entries:
        if e.logprob is None:
            top.append(None)  # the first prompt token: nothing to compare it with
            continue
        alternatives = {t.token: t.logprob for t in e.top}
        alternatives.setdefault(e.token, e.logprob)  # OpenAI: the chosen token is always listed
        top.append(alternatives)
    return {
        "tokens": [e.token for e in entries],
        "token_logprobs": [e.logprob for e in entries],
        "top_logprobs": top,
        "text_offset": [e.text_offset for e in entries],
    }


def full_response(
    kind: Kind, response_id: str, model: str, created_s: int, choices: Sequence[ChoiceOutput], usage: Usage
) -> dict[str, Any]:
    """The non-streaming answer."""
    out: list[dict[str, Any]] = []
    for c in sorted(choices, key=lambda c: c.index):
        logprobs = None if c.logprobs is None else logprobs_json(kind, c.logprobs)
        if kind == "completion":
            out.append({"index": c.index, "text": c.text, "logprobs": logprobs, "finish_reason": c.finish_reason})
        else:
            out.append(
                {
                    "index": c.index,
                    "message": {"role": "assistant", "content": c.text},
                    "logprobs": logprobs,
                    "finish_reason": c.finish_reason,
                }
            )
    return {
        "id": response_id,
        "object": "text_completion" if kind == "completion" else "chat.completion",
        "created": created_s,
        "model": model,
        "choices": out,
        "usage": usage_json(usage),
    }


def stream_chunk(
    kind: Kind,
    response_id: str,
    model: str,
    created_s: int,
    *,
    text: str | None,
    finish_reason: str | None,
    include_usage: bool,
    role: bool = False,
    index: int = 0,
    logprobs: Sequence[TokenLogprob] | None = None,
    usage: Usage | None = None,
) -> dict[str, Any]:
    """One SSE chunk of choice `index` carrying a text delta (with its tokens' log-probs when
    asked for) and/or the finish reason; with include_usage, `usage` is that choice's usage so
    far (continuous_usage_stats) or null."""
    lp = None if logprobs is None else logprobs_json(kind, logprobs)
    if kind == "completion":
        choice: dict[str, Any] = {"index": index, "text": text or "", "logprobs": lp, "finish_reason": finish_reason}
        obj = "text_completion"
    else:
        delta: dict[str, Any] = {}
        if role:
            delta["role"] = "assistant"
        if text is not None:
            delta["content"] = text
        choice = {"index": index, "delta": delta, "logprobs": lp, "finish_reason": finish_reason}
        obj = "chat.completion.chunk"
    chunk: dict[str, Any] = {
        "id": response_id,
        "object": obj,
        "created": created_s,
        "model": model,
        "choices": [choice],
    }
    if include_usage:
        # As OpenAI does, only the last chunk carries usage, unless asked for on every chunk.
        chunk["usage"] = None if usage is None else usage_json(usage)
    return chunk


def usage_chunk(kind: Kind, response_id: str, model: str, created_s: int, usage: Usage) -> dict[str, Any]:
    """The last chunk of a stream with include_usage: no choices, the request's usage."""
    obj = "text_completion" if kind == "completion" else "chat.completion.chunk"
    return {
        "id": response_id,
        "object": obj,
        "created": created_s,
        "model": model,
        "choices": [],
        "usage": usage_json(usage),
    }


def sse_event(data: dict[str, Any] | str) -> bytes:
    payload = data if isinstance(data, str) else json.dumps(data, ensure_ascii=False, separators=(",", ":"))
    return f"data: {payload}\n\n".encode()


SSE_DONE = sse_event("[DONE]")
