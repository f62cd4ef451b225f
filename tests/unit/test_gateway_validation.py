"""Request validation of the gateway without sockets: OpenAI bodies, gRPC requests, auth, limits.

Every refusal must carry the right status and a message that quotes the offending value.
"""

from __future__ import annotations

import json
from typing import Any

import grpc
import pytest

from blitzmesh.v1 import common_pb2, inference_pb2
from services.gateway.auth import check_bearer
from services.gateway.backend import _resolve_max_tokens
from services.gateway.errors import ErrorKind, GatewayError
from services.gateway.grpc_api import request_from_proto
from services.gateway.http_api import _too_large
from services.gateway.openai_protocol import (
    SSE_DONE,
    ChoiceOutput,
    full_response,
    logprobs_json,
    parse_chat,
    parse_completion,
    parse_json_body,
    sse_event,
    stream_chunk,
    usage_chunk,
)
from services.gateway.schema import InferenceRequest, Sampling, TokenLogprob, TopLogprob, Usage, total_usage
from services.gateway.tokenization import ModelAssets

pytestmark = pytest.mark.filterwarnings("error")

MODEL = "tiny"


def completion(**fields: Any) -> dict[str, Any]:
    return {"model": MODEL, "prompt": "Hello", **fields}


def chat(**fields: Any) -> dict[str, Any]:
    return {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], **fields}


def refused(fn: Any, *args: Any) -> GatewayError:
    with pytest.raises(GatewayError) as err:
        fn(*args)
    return err.value


# ---- body ---------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("raw", "needle"),
    [
        (b"", "empty"),
        (b"{not json", "not valid JSON"),
        (b'{"model": "tiny", "temperature": NaN}', "NaN"),
        (b'{"temperature": Infinity}', "Infinity"),
        (b"\xff\xfe", "UTF-8"),
        (b"[1, 2]", "[1, 2]"),
        (b'"just a string"', '"just a string"'),
    ],
)
def test_malformed_bodies_are_400(raw: bytes, needle: str) -> None:
    err = refused(parse_json_body, raw)
    assert err.kind.http_status == 400
    assert needle in err.message


def test_good_body_parses() -> None:
    assert parse_json_body(json.dumps(completion()).encode()) == completion()


# ---- /v1/completions and /v1/chat/completions fields --------------------------------------------


@pytest.mark.parametrize(
    ("fields", "param", "quoted"),
    [
        ({"temperature": -0.1}, "temperature", "-0.1"),
        ({"temperature": 2.5}, "temperature", "2.5"),
        ({"temperature": "hot"}, "temperature", '"hot"'),
        ({"temperature": True}, "temperature", "true"),
        ({"top_p": 0}, "top_p", "0"),
        ({"top_p": 1.5}, "top_p", "1.5"),
        ({"top_k": -2}, "top_k", "-2"),
        ({"top_k": 2.5}, "top_k", "2.5"),
        ({"max_tokens": 0}, "max_tokens", "0"),
        ({"max_tokens": -5}, "max_tokens", "-5"),
        ({"max_tokens": "10"}, "max_tokens", '"10"'),
        ({"max_tokens": 2**31}, "max_tokens", str(2**31)),
        ({"stop": ["a", "b", "c", "d", "e"]}, "stop", '["a", "b", "c", "d", "e"]'),
        ({"stop": ""}, "stop", '""'),
        ({"stop": ["ok", ""]}, "stop", '["ok", ""]'),
        ({"stop": [1]}, "stop", "[1]"),
        ({"seed": "abc"}, "seed", '"abc"'),
        ({"seed": 2**64}, "seed", str(2**64)),
        ({"n": 129}, "n", "got 129"),
        ({"n": 0}, "n", "got 0"),
        ({"n": "2"}, "n", '"2"'),
        ({"stream": "yes"}, "stream", '"yes"'),
        ({"stream_options": {"include_usage": True}}, "stream_options", "include_usage"),
        ({"stream": True, "stream_options": {"include_usage": "y"}}, "stream_options.include_usage", '"y"'),
        ({"stream": True, "stream_options": {"bogus": 1}}, "stream_options", "bogus"),
        (
            {"stream": True, "stream_options": {"include_usage": True, "continuous_usage_stats": "y"}},
            "stream_options.continuous_usage_stats",
            '"y"',
        ),
        ({"min_p": 0.05}, "min_p", "min_p=0.05"),
        ({"min_p": True}, "min_p", "min_p=true"),
        ({"min_tokens": "8"}, "min_tokens", '"8"'),
        ({"min_tokens": -1, "max_tokens": 8}, "min_tokens", "min_tokens=-1"),
        ({"min_tokens": 8}, "min_tokens", "min_tokens=8"),  # no max_tokens to hold it to
        ({"min_tokens": 9, "max_tokens": 8}, "min_tokens", "max_tokens=8"),
        ({"min_tokens": 4, "max_tokens": 8}, "min_tokens", "min_tokens=4"),  # needs ignore_eos
        ({"min_tokens": 4, "max_tokens": 8, "ignore_eos": True, "stop": "x"}, "min_tokens", 'stop="x"'),
        ({"min_tokens": 8, "max_tokens": 8, "stop_token_ids": [2]}, "min_tokens", "stop_token_ids=[2]"),
        ({"presence_penalty": 2.5}, "presence_penalty", "2.5"),
        ({"presence_penalty": "high"}, "presence_penalty", '"high"'),
        ({"frequency_penalty": -2.1}, "frequency_penalty", "-2.1"),
        ({"repetition_penalty": 0}, "repetition_penalty", "0"),
        ({"repetition_penalty": -1.5}, "repetition_penalty", "-1.5"),
        ({"logit_bias": {"42": 101}}, "logit_bias", "101"),
        ({"logit_bias": {"abc": 5}}, "logit_bias", '"abc"'),
        ({"logit_bias": {"-3": 5}}, "logit_bias", '"-3"'),
        ({"logit_bias": {"7": "up"}}, "logit_bias", '"up"'),
        ({"logit_bias": [1, 2]}, "logit_bias", "[1, 2]"),
        ({"stop_token_ids": [1, "x"]}, "stop_token_ids", '[1, "x"]'),
        ({"stop_token_ids": [-3]}, "stop_token_ids", "-3"),
        ({"ignore_eos": 1}, "ignore_eos", "1"),
        ({"frobnicate": 1}, "frobnicate", '"frobnicate"'),
        ({"model": ""}, "model", '""'),
        ({"model": 7}, "model", "7"),
        ({"model": None}, "model", "null"),
    ],
)
@pytest.mark.parametrize("kind", ["completion", "chat"])
def test_bad_fields_are_400_quoting_the_value(kind: str, fields: dict[str, Any], param: str, quoted: str) -> None:
    body, parse = (completion(**fields), parse_completion) if kind == "completion" else (chat(**fields), parse_chat)
    err = refused(parse, body, "req-1")
    assert err.kind is ErrorKind.INVALID and err.kind.http_status == 400
    assert err.param == param
    assert quoted in err.message, err.message
    assert err.openai_body()["error"] == {
        "message": err.message,
        "type": "invalid_request_error",
        "param": param,
        "code": None,
    }


@pytest.mark.parametrize(
    ("fields", "param", "quoted"),
    [
        ({"prompt": None}, "prompt", "null"),
        ({"prompt": 123}, "prompt", "123"),
        ({"prompt": []}, "prompt", "[]"),
        ({"prompt": ["a", "b"]}, "prompt", "batch of 2"),
        ({"prompt": [[1, 2], [3]]}, "prompt", "batch of 2"),
        ({"prompt": [1, "a"]}, "prompt", '[1, "a"]'),
        ({"prompt": [-1, 5]}, "prompt", "-1"),
        ({"echo": "yes"}, "echo", '"yes"'),
        ({"best_of": 3}, "best_of", "3"),
        ({"best_of": 2, "n": 3}, "best_of", "best_of=2"),
        ({"suffix": "end"}, "suffix", '"end"'),
        ({"logprobs": 6}, "logprobs", "6"),
        ({"logprobs": -1}, "logprobs", "-1"),
        ({"logprobs": True}, "logprobs", "true"),
        ({"max_completion_tokens": 5}, "max_completion_tokens", '"max_completion_tokens"'),
    ],
)
def test_bad_completion_fields(fields: dict[str, Any], param: str, quoted: str) -> None:
    err = refused(parse_completion, completion(**fields), "req-1")
    assert err.kind.http_status == 400 and err.param == param
    assert quoted in err.message, err.message


@pytest.mark.parametrize(
    ("fields", "param", "quoted"),
    [
        ({"messages": None}, "messages", "null"),
        ({"messages": []}, "messages", "[]"),
        ({"messages": "hi"}, "messages", '"hi"'),
        ({"messages": [1]}, "messages[0]", "1"),
        ({"messages": [{"content": "x"}]}, "messages[0].role", "null"),
        ({"messages": [{"role": "wizard", "content": "x"}]}, "messages[0].role", '"wizard"'),
        ({"messages": [{"role": "user", "content": 5}]}, "messages[0].content", "5"),
        (
            {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "u"}}]}]},
            "messages[0].content",
            "image_url",
        ),
        (
            {"messages": [{"role": "assistant", "content": None, "tool_calls": [{"id": "c"}]}]},
            "messages[0].tool_calls",
            '"c"',
        ),
        ({"max_completion_tokens": 0}, "max_completion_tokens", "0"),
        ({"max_tokens": 0}, "max_tokens", "0"),
        ({"logprobs": 1}, "logprobs", "1"),
        ({"top_logprobs": 3}, "top_logprobs", "top_logprobs=3"),
        ({"logprobs": True, "top_logprobs": 21}, "top_logprobs", "21"),
        ({"logprobs": True, "top_logprobs": -1}, "top_logprobs", "-1"),
        ({"echo": True}, "echo", '"echo"'),
        ({"tools": [{"type": "function"}]}, "tools", "function"),
        ({"tool_choice": "auto"}, "tool_choice", '"auto"'),
        ({"response_format": {"type": "json_object"}}, "response_format", "json_object"),
        ({"prompt": "x"}, "prompt", '"prompt"'),
    ],
)
def test_bad_chat_fields(fields: dict[str, Any], param: str, quoted: str) -> None:
    err = refused(parse_chat, chat(**fields), "req-1")
    assert err.kind.http_status == 400 and err.param == param
    assert quoted in err.message, err.message


def test_completion_accepts_every_prompt_form() -> None:
    assert parse_completion(completion(prompt="Hi"), "r").inference.prompt == "Hi"
    assert parse_completion(completion(prompt=["Hi"]), "r").inference.prompt == "Hi"
    assert parse_completion(completion(prompt=[1, 2, 3]), "r").inference.prompt_token_ids == (1, 2, 3)
    assert parse_completion(completion(prompt=[[4, 5]]), "r").inference.prompt_token_ids == (4, 5)


def test_good_request_maps_every_field() -> None:
    parsed = parse_completion(
        completion(
            temperature=0,
            top_p=0.5,
            top_k=-1,
            max_tokens=16.0,  # JSON writers emit integral floats
            stop="###",
            seed=-3,
            n=1,
            stream=True,
            stream_options={"include_usage": True},
            presence_penalty=0,
            user="u-1",
            ignore_eos=True,
            stop_token_ids=[7],
        ),
        "cmpl-1",
    )
    assert parsed.stream and parsed.include_usage and parsed.kind == "completion" and not parsed.logprobs
    assert parsed.inference == InferenceRequest(
        model=MODEL,
        request_id="cmpl-1",
        sampling=Sampling(
            temperature=0.0,
            top_p=0.5,
            top_k=-1,
            max_tokens=16,
            stop=("###",),
            seed=-3,
            stop_token_ids=(7,),
            ignore_eos=True,
            presence_penalty=0.0,
        ),
        prompt="Hello",
    )


def test_openai_features_map_onto_the_request() -> None:
    parsed = parse_completion(
        completion(
            n=3,
            best_of=3,
            echo=True,
            logprobs=2,
            presence_penalty=-0.5,
            frequency_penalty=1.5,
            repetition_penalty=1.2,
            logit_bias={"42": -100, "7": 2.5},
            seed=9,
        ),
        "cmpl-2",
    )
    inf = parsed.inference
    assert (inf.n, inf.echo, parsed.logprobs) == (3, True, True)
    s = inf.sampling
    assert (s.logprobs, s.prompt_logprobs, s.presence_penalty, s.frequency_penalty) == (2, 2, -0.5, 1.5)
    assert s.repetition_penalty == 1.2 and dict(s.logit_bias) == {42: -100.0, 7: 2.5} and s.seed == 9
    # Without echo there are no prompt log-probs to compute.
    assert parse_completion(completion(logprobs=0), "r").inference.sampling.prompt_logprobs is None
    chat_lp = parse_chat(chat(logprobs=True, top_logprobs=5, n=2), "c").inference
    assert (chat_lp.sampling.logprobs, chat_lp.sampling.prompt_logprobs, chat_lp.n) == (5, None, 2)
    assert parse_chat(chat(logprobs=True), "c").inference.sampling.logprobs == 0
    assert parse_chat(chat(logprobs=False, top_logprobs=None), "c").inference.sampling.logprobs is None
    assert parse_chat(chat(top_logprobs=0), "c").inference.sampling.logprobs is None


def test_chat_text_parts_and_max_completion_tokens() -> None:
    parsed = parse_chat(
        chat(
            messages=[
                {"role": "system", "content": "Be brief."},
                {"role": "user", "content": [{"type": "text", "text": "Hi "}, {"type": "text", "text": "there"}]},
            ],
            max_tokens=50,
            max_completion_tokens=8,
            response_format={"type": "text"},
            tools=[],
        ),
        "chatcmpl-1",
    )
    assert [m.content for m in parsed.inference.messages] == ["Be brief.", "Hi there"]
    assert parsed.inference.sampling.max_tokens == 8
    assert not parsed.stream


# ---- what the benchmark clients send ------------------------------------------------------------
# The bodies as GuideLLM 0.8 (backends/openai/request_handlers.py), `vllm bench serve`
# (vllm/benchmarks/lib/endpoint_request_func.py) and AIPerf (endpoints/openai_*.py, with the
# `--extra-inputs min_tokens:N --extra-inputs ignore_eos:true` of its tutorial) build them.

CONTINUOUS = {"include_usage": True, "continuous_usage_stats": True}
BENCH_BODIES: dict[str, tuple[str, dict[str, Any]]] = {
    "guidellm-completions": (
        "completion",
        {"model": MODEL, "stream": True, "stream_options": CONTINUOUS, "max_tokens": 8, "stop": None,
         "ignore_eos": True, "prompt": "Hello"},
    ),
    "guidellm-chat": (
        "chat",
        {"model": MODEL, "stream": True, "stream_options": CONTINUOUS, "max_completion_tokens": 8, "stop": None,
         "ignore_eos": True,
         "messages": [{"role": "system", "content": "Be brief."},
                      {"role": "user", "content": [{"type": "text", "text": "Hi"}]}]},
    ),
    "vllm-completions": (
        "completion",
        {"model": MODEL, "prompt": "Hello", "repetition_penalty": 1.0, "max_tokens": 8, "logprobs": None,
         "stream": True, "stream_options": {"include_usage": True}, "ignore_eos": True,
         # --temperature/--top-p/--top-k/--min-p 0/... go into the body as extra_body
         "temperature": 0.0, "top_p": 0.9, "top_k": 5, "min_p": 0.0},
    ),
    "vllm-chat": (
        "chat",
        {"model": MODEL, "messages": [{"role": "user", "content": [{"type": "text", "text": "Hi"}]}],
         "max_completion_tokens": 8, "stream": True, "stream_options": {"include_usage": True}, "ignore_eos": True},
    ),
    "aiperf-chat": (
        "chat",
        {"messages": [{"role": "user", "content": "Hi"}], "model": MODEL, "stream": True,
         "max_completion_tokens": 8, "min_tokens": 8, "ignore_eos": True, "stream_options": CONTINUOUS},
    ),
    "aiperf-completions": (
        "completion",
        {"prompt": ["Hello"], "model": MODEL, "stream": False, "max_tokens": 8, "min_tokens": 8, "ignore_eos": True},
    ),
}  # fmt: skip


@pytest.mark.parametrize("client", sorted(BENCH_BODIES))
def test_benchmark_client_bodies_are_accepted_as_sent(client: str) -> None:
    kind, body = BENCH_BODIES[client]
    parsed = (parse_completion if kind == "completion" else parse_chat)(json.loads(json.dumps(body)), "r")
    inf, s = parsed.inference, parsed.inference.sampling
    assert parsed.kind == kind and parsed.stream == body["stream"]
    assert parsed.include_usage == ("stream_options" in body)
    assert parsed.continuous_usage == (body.get("stream_options") == CONTINUOUS)
    assert s.max_tokens == 8 and s.ignore_eos and s.stop == () and s.stop_token_ids == ()
    assert s.logprobs is None and (inf.prompt == "Hello" if kind == "completion" else inf.messages[-1].content == "Hi")
    if client == "vllm-completions":
        assert (s.temperature, s.top_p, s.top_k, s.repetition_penalty) == (0.0, 0.9, 5, 1.0)


def test_continuous_usage_needs_include_usage_as_in_vllm() -> None:
    on = parse_chat(chat(stream=True, stream_options=CONTINUOUS), "r")
    assert on.include_usage and on.continuous_usage
    alone = parse_chat(chat(stream=True, stream_options={"continuous_usage_stats": True}), "r")
    assert not alone.include_usage and not alone.continuous_usage  # vLLM sends no usage then either
    off = parse_completion(completion(stream=True, stream_options={**CONTINUOUS, "continuous_usage_stats": False}), "r")
    assert off.include_usage and not off.continuous_usage


def test_min_tokens_is_honoured_through_ignore_eos() -> None:
    # Equal to max_tokens: exactly what ignore_eos guarantees, so the gateway sets it.
    exact = parse_completion(completion(max_tokens=8, min_tokens=8), "r").inference.sampling
    assert exact.ignore_eos and exact.max_tokens == 8
    # Below max_tokens with ignore_eos: nothing but max_tokens ends the choice.
    assert parse_chat(chat(max_completion_tokens=8, min_tokens=3, ignore_eos=True), "r").inference.sampling.ignore_eos
    # 0 (or null) asks for nothing and changes nothing.
    assert not parse_completion(completion(max_tokens=8, min_tokens=0), "r").inference.sampling.ignore_eos
    assert not parse_chat(chat(min_tokens=None), "r").inference.sampling.ignore_eos
    # The chat's max_completion_tokens is the limit min_tokens is held to, and is named.
    err = refused(parse_chat, chat(max_completion_tokens=4, min_tokens=5), "r")
    assert err.param == "min_tokens" and "max_completion_tokens=4" in err.message


def test_streamed_chunk_carries_usage_so_far_when_given() -> None:
    chunk = stream_chunk(
        "chat",
        "c",
        MODEL,
        1,
        text="a",
        finish_reason=None,
        include_usage=True,
        index=1,
        usage=Usage(7, 3, cached_tokens=2),
    )
    assert chunk["usage"] == {
        "prompt_tokens": 7,
        "completion_tokens": 3,
        "total_tokens": 10,
        "prompt_tokens_details": {"cached_tokens": 2},
    }
    assert "usage" not in stream_chunk("chat", "c", MODEL, 1, text="a", finish_reason=None, include_usage=False)


# ---- the context window ---------------------------------------------------------------------------


def _assets(max_context: int | None) -> ModelAssets:
    return ModelAssets(MODEL, tokenizer=None, max_context=max_context, vocab_size=None)  # type: ignore[arg-type]


def test_prompt_plus_max_tokens_beyond_context_is_400_with_numbers() -> None:
    req = InferenceRequest(model=MODEL, request_id="r", prompt="x", sampling=Sampling(max_tokens=100))
    err = refused(_resolve_max_tokens, _assets(128), req, 40, 256)
    assert err.kind.http_status == 400 and err.param == "max_tokens" and err.code == "context_length_exceeded"
    for number in ("128", "140", "40", "max_tokens=100"):
        assert number in err.message


def test_prompt_alone_beyond_context_is_400() -> None:
    req = InferenceRequest(model=MODEL, request_id="r", prompt="x")
    err = refused(_resolve_max_tokens, _assets(128), req, 128, 256)
    assert err.kind.http_status == 400 and "128" in err.message


def test_default_max_tokens_fills_what_the_context_leaves() -> None:
    req = InferenceRequest(model=MODEL, request_id="r", prompt="x")
    assert _resolve_max_tokens(_assets(128), req, 100, 256) == 28
    assert _resolve_max_tokens(_assets(None), req, 100, 256) == 256
    fits = InferenceRequest(model=MODEL, request_id="r", prompt="x", sampling=Sampling(max_tokens=28))
    assert _resolve_max_tokens(_assets(128), fits, 100, 256) == 28


# ---- gRPC requests ----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("request_msg", "quoted"),
    [
        (inference_pb2.GenerateRequest(prompt="Hi"), "model is required"),
        (inference_pb2.GenerateRequest(model=MODEL), "none"),
        (
            inference_pb2.GenerateRequest(
                model=MODEL, prompt="Hi", messages=[inference_pb2.ChatMessage(role="user", content="x")]
            ),
            "['prompt', 'messages']",
        ),
        (
            inference_pb2.GenerateRequest(model=MODEL, messages=[inference_pb2.ChatMessage(role="robot", content="x")]),
            '"robot"',
        ),
        (inference_pb2.GenerateRequest(model=MODEL, prompt_token_ids=[3, -1]), "-1"),
        (
            inference_pb2.GenerateRequest(model=MODEL, prompt="Hi", sampling=common_pb2.SamplingParams(temperature=9)),
            "9.0",
        ),
        (inference_pb2.GenerateRequest(model=MODEL, prompt="Hi", sampling=common_pb2.SamplingParams(top_p=0)), "0.0"),
        (
            inference_pb2.GenerateRequest(model=MODEL, prompt="Hi", sampling=common_pb2.SamplingParams(max_tokens=0)),
            "0",
        ),
        (
            inference_pb2.GenerateRequest(model=MODEL, prompt="Hi", sampling=common_pb2.SamplingParams(stop=["a"] * 5)),
            "5",
        ),
        (inference_pb2.GenerateRequest(model=MODEL, prompt="Hi", n=200), "200"),
        (inference_pb2.GenerateRequest(model=MODEL, prompt="Hi", n=-1), "-1"),
        (
            inference_pb2.GenerateRequest(model=MODEL, messages=[inference_pb2.ChatMessage(role="user")], echo=True),
            "echo needs a prompt",
        ),
        (
            inference_pb2.GenerateRequest(
                model=MODEL, prompt="Hi", sampling=common_pb2.SamplingParams(frequency_penalty=2.5)
            ),
            "2.5",
        ),
        (
            inference_pb2.GenerateRequest(
                model=MODEL, prompt="Hi", sampling=common_pb2.SamplingParams(logit_bias={3: -150.0})
            ),
            "-150.0",
        ),
        (
            inference_pb2.GenerateRequest(model=MODEL, prompt="Hi", sampling=common_pb2.SamplingParams(logprobs=30)),
            "30",
        ),
    ],
)
def test_grpc_requests_are_validated(request_msg: inference_pb2.GenerateRequest, quoted: str) -> None:
    err = refused(request_from_proto, request_msg)
    assert err.kind.grpc_code == grpc.StatusCode.INVALID_ARGUMENT
    assert quoted in err.message, err.message


def test_grpc_request_maps_optional_fields() -> None:
    req = request_from_proto(
        inference_pb2.GenerateRequest(
            model=MODEL, prompt="Hi", sampling=common_pb2.SamplingParams(temperature=0, seed=5, stop=["x"])
        )
    )
    assert req.sampling == Sampling(temperature=0.0, seed=5, stop=("x",))
    assert req.request_id.startswith("gen-") and req.api == "grpc" and (req.n, req.echo) == (1, False)
    more = request_from_proto(
        inference_pb2.GenerateRequest(
            model=MODEL,
            prompt="Hi",
            n=4,
            echo=True,
            sampling=common_pb2.SamplingParams(logprobs=3, prompt_logprobs=1, logit_bias={5: -1.5}),
        )
    )
    assert (more.n, more.echo, more.sampling.logprobs, more.sampling.prompt_logprobs) == (4, True, 3, 1)
    assert more.sampling.logit_bias == ((5, -1.5),)


# ---- auth, size, error kinds -------------------------------------------------------------------------


def test_bearer_keys() -> None:
    check_bearer(None, [])  # no keys configured: open
    check_bearer("Bearer sk-good", ["sk-other", "sk-good"])
    check_bearer("bearer   sk-good ", ["sk-good"])
    for header, needle in [
        (None, "missing API key"),
        ("", "missing API key"),
        ("Basic abc", "'Basic'"),
        ("Bearer", "'Bearer'"),
        ("Bearer sk-wrong-but-long", "sk-...ng"),
    ]:
        err = refused(check_bearer, header, ["sk-good"])
        assert err.kind.http_status == 401 and err.kind.grpc_code == grpc.StatusCode.UNAUTHENTICATED
        assert needle in err.message, err.message
        assert "sk-wrong-but-long" not in err.message


def test_oversized_body_is_413_quoting_the_limit() -> None:
    err = _too_large("2000000 bytes", 1024 * 1024)
    assert err.kind.http_status == 413 and "max_body_bytes=1048576" in err.message and "2000000" in err.message


def test_each_error_kind_maps_to_http_and_grpc() -> None:
    expected = {
        ErrorKind.INVALID: (400, grpc.StatusCode.INVALID_ARGUMENT),
        ErrorKind.UNAUTHENTICATED: (401, grpc.StatusCode.UNAUTHENTICATED),
        ErrorKind.NOT_FOUND: (404, grpc.StatusCode.NOT_FOUND),
        ErrorKind.TOO_LARGE: (413, grpc.StatusCode.INVALID_ARGUMENT),
        ErrorKind.OVERLOADED: (429, grpc.StatusCode.RESOURCE_EXHAUSTED),
        ErrorKind.UNAVAILABLE: (503, grpc.StatusCode.UNAVAILABLE),
        ErrorKind.MID_STREAM: (500, grpc.StatusCode.INTERNAL),
    }
    for kind, (status, code) in expected.items():
        assert (kind.http_status, kind.grpc_code) == (status, code)


# ---- response objects -----------------------------------------------------------------------------------


def test_response_objects_follow_openai() -> None:
    usage = Usage(prompt_tokens=3, completion_tokens=2)
    done = full_response("chat", "chatcmpl-1", MODEL, 1, [ChoiceOutput(0, "hey", "length")], usage)
    assert done["object"] == "chat.completion"
    assert done["choices"][0]["message"] == {"role": "assistant", "content": "hey"}
    assert done["choices"][0]["logprobs"] is None
    assert done["usage"] == {
        "prompt_tokens": 3,
        "completion_tokens": 2,
        "total_tokens": 5,
        "prompt_tokens_details": {"cached_tokens": 0},
    }
    chunk = stream_chunk("completion", "cmpl-1", MODEL, 1, text="a", finish_reason=None, include_usage=True)
    assert chunk["choices"][0]["text"] == "a" and chunk["usage"] is None
    last = usage_chunk("completion", "cmpl-1", MODEL, 1, usage)
    assert last["choices"] == [] and last["usage"]["total_tokens"] == 5
    assert sse_event({"a": "é"}) == 'data: {"a":"é"}\n\n'.encode()
    assert SSE_DONE == b"data: [DONE]\n\n"


def test_logprobs_objects_follow_openai() -> None:
    cafe = "é".encode()
    entries = [
        TokenLogprob(1, None, "<s>", b"<s>", (), 0),  # first prompt token: nothing to condition on
        TokenLogprob(9, -0.25, "Hi", b"Hi", (TopLogprob(9, -0.25, "Hi", b"Hi"), TopLogprob(4, -2.0, " a", b" a")), 0),
        TokenLogprob(5, -3.5, "bytes:\\xc3", cafe[:1], (TopLogprob(7, -0.5, "!", b"!"),), 2),
    ]
    chat_lp = logprobs_json("chat", entries[1:])
    assert chat_lp["refusal"] is None
    assert chat_lp["content"][0] == {
        "token": "Hi",
        "logprob": -0.25,
        "bytes": [72, 105],
        "top_logprobs": [
            {"token": "Hi", "logprob": -0.25, "bytes": [72, 105]},
            {"token": " a", "logprob": -2.0, "bytes": [32, 97]},
        ],
    }
    assert chat_lp["content"][1]["bytes"] == [0xC3]
    legacy = logprobs_json("completion", entries)
    assert legacy["tokens"] == ["<s>", "Hi", "bytes:\\xc3"]
    assert legacy["token_logprobs"] == [None, -0.25, -3.5]
    assert legacy["text_offset"] == [0, 0, 2]
    # The chosen token is always listed, next to the top alternatives (up to logprobs + 1).
    assert legacy["top_logprobs"] == [None, {"Hi": -0.25, " a": -2.0}, {"!": -0.5, "bytes:\\xc3": -3.5}]
    chunk = stream_chunk(
        "chat", "c", MODEL, 1, text="Hi", finish_reason=None, include_usage=False, index=2, logprobs=entries[1:2]
    )
    assert chunk["choices"][0]["index"] == 2 and chunk["choices"][0]["logprobs"]["content"][0]["token"] == "Hi"


def test_n_choices_usage_counts_the_prompt_once() -> None:
    total = total_usage([Usage(7, 3, cached_tokens=4), Usage(7, 5), Usage(7, 1, cached_tokens=5)])
    assert (total.prompt_tokens, total.completion_tokens, total.total_tokens) == (7, 9, 16)
    assert total.cached_tokens == 5  # the prompt once: the largest count over the choices
    body = full_response(
        "completion",
        "cmpl-n",
        MODEL,
        1,
        [ChoiceOutput(1, "b", "length", []), ChoiceOutput(0, "a", "stop", [])],
        total,
    )
    assert [c["index"] for c in body["choices"]] == [0, 1] and [c["text"] for c in body["choices"]] == ["a", "b"]
    assert body["choices"][0]["logprobs"] == {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
