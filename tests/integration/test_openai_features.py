"""The OpenAI features through the whole path, on real services in this process: the official
`openai` client and the SDK -> gateway -> a real global manager -> a real worker (engine, tiny
synthetic model, weights from a real parameter manager).

Covers log-probs (chat and completions, streamed and not), n > 1 with seeds (reproducible, choice 0
equal to n=1), echo with prompt log-probs, the penalties and logit_bias (accepted and acting), bad
values refused with a 400 that quotes them, and the prompt tokens served from the worker's prefix
cache (usage.prompt_tokens_details.cached_tokens, and the SDK's usage.cached_tokens).
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import openai
import pytest

import blitzmesh
from blitzmesh.v1 import worker_pb2, worker_pb2_grpc
from services.common.grpc_util import channel
from services.model_format.tokenizer import Tokenizer
from tests.integration.mini_mesh import mini_mesh

ServeFactory = Any  # tests/integration/conftest.py: serve_in_process

pytestmark = [pytest.mark.timeout(120), pytest.mark.filterwarnings("error")]

MODEL = "tiny"
PROMPT = "the quick brown fox"


@dataclass
class Mesh:
    http: str
    grpc_address: str
    tokenizer: Tokenizer
    worker_address: str


@pytest.fixture
async def mesh(tiny_models: Path, serve_in_process: ServeFactory) -> AsyncIterator[Mesh]:
    async with mini_mesh(tiny_models, serve_in_process) as m:
        yield Mesh(m.http, m.grpc_address, Tokenizer(tiny_models / MODEL), m.worker_address)


@contextlib.asynccontextmanager
async def openai_client(mesh: Mesh) -> AsyncIterator[openai.AsyncOpenAI]:
    client = openai.AsyncOpenAI(base_url=mesh.http, api_key="unused", max_retries=0)
    try:
        yield client
    finally:
        await client.close()


def _check_top(entries: list[Any]) -> None:
    """Each entry's alternatives are sorted, <= 0, and (greedy) led by the chosen token itself."""
    for e in entries:
        values = [t.logprob for t in e.top_logprobs]
        assert values == sorted(values, reverse=True) and all(v <= 0 for v in values)
        assert e.top_logprobs[0].token == e.token and e.top_logprobs[0].logprob == e.logprob


async def test_chat_logprobs_streamed_and_not(mesh: Mesh) -> None:
    ask: dict[str, Any] = {
        "model": MODEL,
        "messages": [{"role": "user", "content": "tell me about the fox"}],
        "max_tokens": 8,
        "temperature": 0,
        "logprobs": True,
        "top_logprobs": 3,
        "extra_body": {"ignore_eos": True},
    }
    async with openai_client(mesh) as client:
        done = await client.chat.completions.create(**ask)
        stream = await client.chat.completions.create(**ask, stream=True)
        streamed: list[Any] = []
        async for chunk in stream:
            if chunk.choices and chunk.choices[0].logprobs is not None:
                streamed.extend(chunk.choices[0].logprobs.content or [])
    choice = done.choices[0]
    assert choice.logprobs is not None and choice.logprobs.content is not None
    content = choice.logprobs.content
    assert done.usage is not None and len(content) == done.usage.completion_tokens == 8
    assert all(e.logprob <= 0 and len(e.top_logprobs) == 3 for e in content)
    _check_top(content)
    # The tokens' exact bytes rebuild the text (the random model splits characters: those come
    # out as U+FFFD in the text, as in the bytes decoded with errors="replace").
    data = bytes(b for e in content for b in (e.bytes or []))
    assert data.decode(errors="replace") == choice.message.content
    # Streaming carries the same entries, chunk by chunk: the same tokens, and log-probs equal up
    # to float rounding (the second request starts from the first's cached prompt blocks, whose
    # attention sums in another order than a whole prefill's).
    assert [e.token for e in streamed] == [e.token for e in content]
    assert [e.logprob for e in streamed] == pytest.approx([e.logprob for e in content], abs=1e-4)


async def test_completions_logprobs_with_echo(mesh: Mesh) -> None:
    prompt_ids = mesh.tokenizer.encode(PROMPT)  # BOS first
    async with openai_client(mesh) as client:
        done = await client.completions.create(
            model=MODEL,
            prompt=PROMPT,
            max_tokens=5,
            temperature=0,
            logprobs=2,
            echo=True,
            extra_body={"ignore_eos": True},
        )
        plain = await client.completions.create(
            model=MODEL, prompt=PROMPT, max_tokens=5, temperature=0, extra_body={"ignore_eos": True}
        )
    choice = done.choices[0]
    assert choice.text == PROMPT + plain.choices[0].text  # echo prepends the prompt
    lp = choice.logprobs
    assert lp is not None and lp.tokens is not None and lp.token_logprobs is not None
    assert lp.top_logprobs is not None and lp.text_offset is not None
    assert len(lp.tokens) == len(prompt_ids) + 5
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None  # nothing precedes the first token
    assert all(v is not None and v <= 0 for v in lp.token_logprobs[1:])
    for token, value, top in zip(lp.tokens[1:], lp.token_logprobs[1:], lp.top_logprobs[1:], strict=True):
        assert top is not None and token in top and top[token] == value and 2 <= len(top) <= 3
    assert lp.text_offset == sorted(lp.text_offset)
    assert lp.text_offset[len(prompt_ids)] == len(PROMPT)  # the first generated token starts after the prompt
    assert done.usage is not None and done.usage.prompt_tokens == len(prompt_ids)
    assert done.usage.completion_tokens == 5


async def test_n_choices_with_a_seed_reproduce(mesh: Mesh) -> None:
    ask: dict[str, Any] = {"model": MODEL, "prompt": PROMPT, "max_tokens": 10, "temperature": 1.0, "seed": 1234}
    async with openai_client(mesh) as client:
        first = await client.completions.create(**ask, n=2)
        again = await client.completions.create(**ask, n=2)
        single = await client.completions.create(**ask)
        stream = await client.completions.create(**ask, n=2, stream=True, stream_options={"include_usage": True})
        texts = {0: "", 1: ""}
        finishes: dict[int, str] = {}
        usage = None
        async for chunk in stream:
            for c in chunk.choices:
                texts[c.index] += c.text
                if c.finish_reason is not None:
                    finishes[c.index] = c.finish_reason
            usage = chunk.usage or usage
    assert [c.index for c in first.choices] == [0, 1]
    assert [c.text for c in again.choices] == [c.text for c in first.choices]
    assert first.choices[0].text != first.choices[1].text  # independent choices
    assert first.choices[0].text == single.choices[0].text  # choice 0 samples with the seed itself
    assert [texts[0], texts[1]] == [c.text for c in first.choices] and set(finishes) == {0, 1}
    prompt_tokens = len(mesh.tokenizer.encode(PROMPT))
    assert first.usage is not None and first.usage.prompt_tokens == prompt_tokens  # once, not per choice
    assert first.usage.completion_tokens == 20 or first.choices[0].finish_reason == "stop"
    assert usage is not None and usage.completion_tokens == first.usage.completion_tokens


async def test_penalties_and_logit_bias_act(mesh: Mesh) -> None:
    forced = mesh.tokenizer.encode(" fox", add_special_tokens=False)[0]
    forced_text = mesh.tokenizer.decode([forced])
    base: dict[str, Any] = {"model": MODEL, "prompt": PROMPT, "max_tokens": 6, "temperature": 0}
    async with openai_client(mesh) as client:
        plain = await client.completions.create(**base, extra_body={"ignore_eos": True})
        penalized = await client.completions.create(
            **base,
            presence_penalty=2.0,
            frequency_penalty=2.0,
            extra_body={"ignore_eos": True, "repetition_penalty": 1.5},
        )
        biased = await client.completions.create(**base, logit_bias={str(forced): 100}, extra_body={"ignore_eos": True})
        chat = await client.chat.completions.create(
            model=MODEL,
            messages=[{"role": "user", "content": "hi"}],
            max_tokens=4,
            temperature=0,
            presence_penalty=-1,
            frequency_penalty=0.5,
            logit_bias={str(forced): 100},
            extra_body={"ignore_eos": True},
        )
    assert penalized.choices[0].text != plain.choices[0].text  # accepted, and they act
    assert biased.choices[0].text == forced_text * 6  # +100 forces the token every time
    assert chat.choices[0].message.content == forced_text * 4


async def test_benchmark_usage_stream_and_min_tokens_on_a_real_worker(mesh: Mesh) -> None:
    """What GuideLLM / AIPerf ask for: usage on every chunk (continuous_usage_stats) and a
    min_tokens equal to max_tokens, which a real engine then runs to (ignore_eos)."""
    options: Any = {"include_usage": True, "continuous_usage_stats": True}  # vLLM's key, not in the SDK's type
    async with openai_client(mesh) as client:
        stream = await client.chat.completions.create(
            model=MODEL,
            messages=[{"role": "user", "content": [{"type": "text", "text": "tell me about the fox"}]}],
            max_completion_tokens=10,
            temperature=0,
            stream=True,
            stream_options=options,
            extra_body={"min_tokens": 10},
        )
        chunks = [c async for c in stream]
    usages = [c.usage for c in chunks]
    assert all(u is not None for u in usages)
    prompt = usages[0].prompt_tokens if usages[0] else -1
    counts = [u.completion_tokens if u else -1 for u in usages]
    assert counts[0] == 0  # the role chunk
    assert counts[1:-2] == sorted(set(counts[1:-2])) and len(counts) >= 5 and counts[-3] <= 10, counts
    assert all(u and u.total_tokens == prompt + u.completion_tokens for u in usages)
    # The finish chunk and the final usage chunk: exactly max_tokens, min_tokens held.
    assert chunks[-2].choices[0].finish_reason == "length" and counts[-2:] == [10, 10]
    assert chunks[-1].choices == [] and usages[-1] and usages[-1].prompt_tokens == prompt


# Longer than a few KV blocks of 16 tokens (181 tokens as a prompt, 198 as a chat).
LONG_PROMPT = "The prefix cache keeps the KV blocks of a long shared prompt so a repeat skips them. " * 4


async def prefix_hit_tokens(mesh: Mesh) -> int:
    """The worker engine's own count of prompt tokens served from its prefix cache, so far."""
    async with channel(mesh.worker_address) as ch:
        info = await worker_pb2_grpc.WorkerStub(ch).GetStatus(worker_pb2.GetStatusRequest(), timeout=5)
    return info.load.prefix_hit_tokens


async def cached_tokens_of_one_request(mesh: Mesh, api: str, stream: bool) -> tuple[int, int]:
    """LONG_PROMPT sent once through `api`: (prompt_tokens, cached_tokens) as the client parsed them."""
    usage: Any
    if api == "sdk":
        async with blitzmesh.AsyncClient(mesh.grpc_address, timeout_s=60) as sdk:
            if stream:
                chunks = [c async for c in sdk.generate(LONG_PROMPT, model=MODEL, max_tokens=4, temperature=0)]
                usage = chunks[-1].usage
            else:
                usage = (await sdk.complete(LONG_PROMPT, model=MODEL, max_tokens=4, temperature=0)).usage
        return usage.prompt_tokens, usage.cached_tokens
    options: Any = {"stream": True, "stream_options": {"include_usage": True}} if stream else {}
    async with openai_client(mesh) as client:
        if api == "completions":
            reply: Any = await client.completions.create(
                model=MODEL, prompt=LONG_PROMPT, max_tokens=4, temperature=0, **options
            )
        else:
            reply = await client.chat.completions.create(
                model=MODEL, messages=[{"role": "user", "content": LONG_PROMPT}], max_tokens=4, temperature=0, **options
            )
        if stream:
            chunks = [c async for c in reply]
            assert all(c.usage is None for c in chunks[:-1]) and chunks[-1].choices == []
            reply = chunks[-1]
    usage = reply.usage
    return usage.prompt_tokens, usage.prompt_tokens_details.cached_tokens


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
@pytest.mark.parametrize("api", ["completions", "chat", "sdk"])
async def test_a_repeated_prompt_reports_its_cached_tokens(mesh: Mesh, api: str, stream: bool) -> None:
    """The same long prompt twice: nothing cached the first time; the second time, the prompt
    tokens the worker's engine counted as prefix-cache hits for it (its prefix_hit_tokens delta):
    every full block short of the last token. As parsed by the `openai` client (HTTP) and by the
    SDK (the gateway's gRPC API)."""
    hits_before = await prefix_hit_tokens(mesh)
    prompt, cached = await cached_tokens_of_one_request(mesh, api, stream)
    assert prompt >= 4 * 16 and cached == 0 and await prefix_hit_tokens(mesh) == hits_before
    again, cached = await cached_tokens_of_one_request(mesh, api, stream)
    hits = await prefix_hit_tokens(mesh) - hits_before
    assert again == prompt and cached == hits == (prompt - 1) // 16 * 16, (prompt, cached, hits)


@pytest.mark.parametrize(
    ("kind", "fields", "quoted"),
    [
        ("completion", {"presence_penalty": 3}, "3"),
        ("completion", {"logprobs": 6}, "6"),
        ("completion", {"n": 0}, "0"),
        ("completion", {"logit_bias": {"999999": 1}}, "999999"),
        ("completion", {"logit_bias": {"5": 150}}, "150"),
        ("chat", {"logprobs": True, "top_logprobs": 25}, "25"),
        ("chat", {"frequency_penalty": -2.5}, "-2.5"),
        ("chat", {"repetition_penalty": 0}, "0"),
    ],
)
async def test_bad_values_are_400_quoting_them(mesh: Mesh, kind: str, fields: dict[str, Any], quoted: str) -> None:
    async with openai_client(mesh) as client:
        with pytest.raises(openai.BadRequestError) as err:
            if kind == "completion":
                await client.completions.create(model=MODEL, prompt="x", extra_body=fields)
            else:
                await client.chat.completions.create(
                    model=MODEL, messages=[{"role": "user", "content": "x"}], extra_body=fields
                )
    assert err.value.status_code == 400 and quoted in err.value.message
    param = err.value.body["param"] if isinstance(err.value.body, dict) else None
    assert param in fields


async def test_sdk_over_grpc(mesh: Mesh) -> None:
    prompt_ids = mesh.tokenizer.encode(PROMPT)
    async with blitzmesh.AsyncClient(mesh.grpc_address, timeout_s=60) as client:
        done = await client.complete(
            PROMPT,
            model=MODEL,
            n=2,
            seed=7,
            temperature=0.8,
            max_tokens=5,
            ignore_eos=True,
            logprobs=2,
            prompt_logprobs=1,
            echo=True,
            return_token_ids=True,
            frequency_penalty=0.5,
        )
        chunks = [
            c
            async for c in client.generate(
                PROMPT, model=MODEL, n=2, seed=7, temperature=0.8, max_tokens=5, ignore_eos=True, logprobs=2
            )
        ]
    assert [c.index for c in done.choices] == [0, 1] and done.text == done.choices[0].text
    assert done.usage.prompt_tokens == len(prompt_ids) and done.usage.completion_tokens == 10
    for choice in done.choices:
        assert choice.text.startswith(PROMPT) and choice.finish_reason == "length"
        assert [e.token_id for e in choice.logprobs] == list(choice.token_ids) and len(choice.token_ids) == 5
        assert all(e.logprob is not None and e.logprob <= 0 and len(e.top_logprobs) == 2 for e in choice.logprobs)
    assert [e.token_id for e in done.prompt_logprobs] == prompt_ids
    assert done.prompt_logprobs[0].logprob is None and all(e.logprob <= 0 for e in done.prompt_logprobs[1:])  # type: ignore[operator]
    # The stream interleaves both choices; without echo or penalties each must still end.
    finished = {c.index: c.finish_reason for c in chunks if c.finish_reason is not None}
    assert finished == {0: "length", 1: "length"}
    per_choice = {i: [e.token_id for c in chunks if c.index == i for e in c.logprobs] for i in (0, 1)}
    assert all(len(ids) == 5 for ids in per_choice.values())
