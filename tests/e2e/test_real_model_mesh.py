"""The real default model (SmolLM2-135M-Instruct) served by the whole mesh, through the official client.

What a user checks first: the answer is right, the text equals transformers' own greedy text for
the same prompt, and the OpenAI features (logprobs, n, stop on the model's end-of-turn token) work.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path

import openai
import pytest
import pytest_asyncio
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from services.mesh.launcher import Mesh, MeshConfig
from services.model_format.default_model import DEFAULT_MODEL_ID

pytestmark = [pytest.mark.e2e, pytest.mark.real_model, pytest.mark.asyncio(loop_scope="module")]


@pytest_asyncio.fixture(loop_scope="module", scope="module")
async def real_mesh(real_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[Mesh]:
    cfg = MeshConfig(
        workers=1,
        model=DEFAULT_MODEL_ID,
        model_dir=real_model_dir.parent,
        run_dir=tmp_path_factory.mktemp("run-real"),
        http_port=0,
        grpc_port=0,
        initial_instances=1,
        ready_timeout_s=300.0,
    )
    mesh = Mesh(cfg)
    try:
        await mesh.start()
        yield mesh
    finally:
        await mesh.stop()


@pytest_asyncio.fixture(loop_scope="module")
async def client(real_mesh: Mesh) -> AsyncIterator[openai.AsyncOpenAI]:
    async with openai.AsyncOpenAI(
        base_url=f"{real_mesh.gateway_http}/v1", api_key="unused", max_retries=0, timeout=120
    ) as c:
        yield c


async def test_chat_answers_the_capital_of_france(client: openai.AsyncOpenAI) -> None:
    resp = await client.chat.completions.create(
        model=DEFAULT_MODEL_ID,
        messages=[{"role": "user", "content": "What is the capital of France?"}],
        max_tokens=32,
        temperature=0,
    )
    choice = resp.choices[0]
    assert "Paris" in choice.message.content, choice.message.content
    # SmolLM2 ends its turn with <|im_end|>: the stream stops there, not at max_tokens.
    assert choice.finish_reason == "stop", (choice.finish_reason, choice.message.content)
    assert "<|im_end|>" not in choice.message.content


async def test_completion_text_equals_transformers_greedy(client: openai.AsyncOpenAI, real_model_dir: Path) -> None:
    prompt, n_tokens = "The capital of Germany is", 16
    tok = AutoTokenizer.from_pretrained(real_model_dir)
    model = AutoModelForCausalLM.from_pretrained(real_model_dir, dtype=torch.float32)
    ids = tok(prompt, return_tensors="pt").input_ids
    with torch.no_grad():
        out = model.generate(ids, max_new_tokens=n_tokens, min_new_tokens=n_tokens, do_sample=False)
    expected = tok.decode(out[0, ids.shape[1] :], skip_special_tokens=True)

    resp = await client.completions.create(
        model=DEFAULT_MODEL_ID, prompt=prompt, max_tokens=n_tokens, temperature=0, extra_body={"ignore_eos": True}
    )
    assert resp.choices[0].text == expected
    assert resp.usage.prompt_tokens == ids.shape[1]


async def test_logprobs_and_two_seeded_choices(client: openai.AsyncOpenAI) -> None:
    messages = [{"role": "user", "content": "Name a colour."}]
    resp = await client.chat.completions.create(
        model=DEFAULT_MODEL_ID, messages=messages, max_tokens=8, temperature=0, logprobs=True, top_logprobs=3
    )
    content = resp.choices[0].logprobs.content
    assert content and all(t.logprob <= 0 for t in content)
    assert all(1 <= len(t.top_logprobs) <= 3 and t.top_logprobs[0].logprob >= t.logprob - 1e-6 for t in content)

    kw = {"model": DEFAULT_MODEL_ID, "messages": messages, "max_tokens": 8, "temperature": 1.0, "seed": 7, "n": 2}
    first = await client.chat.completions.create(**kw)
    again = await client.chat.completions.create(**kw)
    assert sorted(c.index for c in first.choices) == [0, 1]
    assert [c.message.content for c in first.choices] == [c.message.content for c in again.choices]
