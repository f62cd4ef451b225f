"""The whole mesh as real processes: OpenAI client, SDK, cancellation, bad input."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator

import aiohttp
import openai
import pytest
import pytest_asyncio

import blitzmesh
from blitzmesh.v1 import worker_pb2, worker_pb2_grpc
from services.common import roles
from services.mesh.launcher import Mesh

pytestmark = [pytest.mark.e2e, pytest.mark.asyncio(loop_scope="session")]

MODEL = "tiny"


@pytest_asyncio.fixture(loop_scope="session")
async def client(mesh: Mesh) -> AsyncIterator[openai.AsyncOpenAI]:
    async with openai.AsyncOpenAI(base_url=f"{mesh.gateway_http}/v1", api_key="unused", max_retries=0, timeout=60) as c:
        yield c


async def test_models_listed(client: openai.AsyncOpenAI) -> None:
    models = await client.models.list()
    assert [m.id for m in models.data] == [MODEL]


async def test_streamed_chat_completion_through_openai_client(client: openai.AsyncOpenAI) -> None:
    stream = await client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "Tell me a story"}],
        max_tokens=12,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
    )
    text, finish, usage = "", None, None
    async for chunk in stream:
        if chunk.choices:
            text += chunk.choices[0].delta.content or ""
            finish = chunk.choices[0].finish_reason or finish
        if chunk.usage is not None:
            usage = chunk.usage
    assert finish in ("stop", "length")
    assert usage is not None and usage.prompt_tokens > 0
    assert usage.total_tokens == usage.prompt_tokens + usage.completion_tokens
    if finish == "length":
        assert usage.completion_tokens == 12
    # Non-streamed with the same greedy settings yields the same text.
    full = await client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Tell me a story"}], max_tokens=12, temperature=0
    )
    assert full.choices[0].message.content == text
    assert full.usage.completion_tokens == usage.completion_tokens


async def test_completion_seed_is_reproducible(client: openai.AsyncOpenAI) -> None:

    async def sample(seed: int) -> str:
        r = await client.completions.create(
            model=MODEL,
            prompt="The weather today",
            max_tokens=16,
            temperature=1.0,
            seed=seed,
            extra_body={"ignore_eos": True},
        )
        assert r.choices[0].finish_reason == "length"
        assert r.usage.completion_tokens == 16
        return r.choices[0].text

    a, b, c = await asyncio.gather(sample(7), sample(7), sample(8))
    assert a == b
    assert a != c


async def test_sdk_stream_and_complete(mesh: Mesh) -> None:
    async with blitzmesh.AsyncClient(mesh.gateway_grpc, timeout_s=60) as client:
        models = await client.list_models()
        assert [m.model_id for m in models] == [MODEL]
        chunks = [c async for c in client.generate("Hello there", model=MODEL, max_tokens=8, temperature=0)]
        assert chunks[-1].finish_reason in ("stop", "length")
        assert chunks[-1].usage is not None
        streamed = "".join(c.text for c in chunks)
        done = await client.complete("Hello there", model=MODEL, max_tokens=8, temperature=0)
        assert done.text == streamed
        cluster = await client.cluster()
        serving = [i for i in cluster.instances if i.state == "serving"]
        assert len(serving) == 2
        with pytest.raises(blitzmesh.NotFoundError, match="no-such-model"):
            await client.complete("x", model="no-such-model", max_tokens=2)


async def _kv_used(mesh: Mesh, address: str) -> int:
    async with mesh.connect(address, roles.WORKER) as ch:
        info = await worker_pb2_grpc.WorkerStub(ch).GetStatus(worker_pb2.GetStatusRequest(), timeout=5)
    return info.load.kv_blocks_used


async def test_cancel_mid_stream_frees_kv_blocks(mesh: Mesh) -> None:
    async with blitzmesh.AsyncClient(mesh.gateway_grpc, timeout_s=60) as client:
        cluster = await client.cluster()
        addresses = [i.address for i in cluster.instances if i.state == "serving"]
        stream = client.generate("Count forever", model=MODEL, max_tokens=400, ignore_eos=True, temperature=0)
        got = 0
        async for _chunk in stream:
            got += 1
            if got == 3:
                break
        held = sum([await _kv_used(mesh, a) for a in addresses])
        await stream.aclose()
        assert got == 3
        assert held > 0, "the running request should hold KV blocks before the cancel"
    # KV blocks return as soon as the worker sees the cancellation: poll its status, bounded.
    for _ in range(100):
        used = [await _kv_used(mesh, a) for a in addresses]
        if sum(used) == 0:
            break
        await asyncio.sleep(0.05)
    assert sum(used) == 0, f"KV blocks still held after cancel: {used}"


@pytest.mark.parametrize(
    ("path", "body", "status", "quoted"),
    [
        ("/v1/completions", b"{not json", 400, "JSON"),
        ("/v1/completions", {"model": "nope", "prompt": "x"}, 404, "nope"),
        ("/v1/completions", {"model": MODEL, "prompt": "x", "max_tokens": 0}, 400, "0"),
        ("/v1/completions", {"model": MODEL, "prompt": "x", "max_tokens": 10_000_000}, 400, "10000000"),
        ("/v1/completions", {"model": MODEL, "prompt": "x", "temperature": 7}, 400, "7"),
        ("/v1/completions", {"model": MODEL, "prompt": "x", "top_p": 1.5}, 400, "1.5"),
        ("/v1/chat/completions", {"model": MODEL, "messages": "hi"}, 400, "messages"),
        ("/v1/completions", {"model": MODEL, "prompt": "word " * 5000}, 400, "context"),
    ],
)
async def test_bad_input_gets_clear_4xx(mesh: Mesh, path: str, body: object, status: int, quoted: str) -> None:
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    async with aiohttp.ClientSession() as s:
        async with s.post(mesh.gateway_http + path, data=data, headers={"Content-Type": "application/json"}) as r:
            assert r.status == status
            err = (await r.json())["error"]
            assert quoted in err["message"]


async def test_oversized_body_is_413(mesh: Mesh) -> None:
    async with aiohttp.ClientSession() as s:
        big = json.dumps({"model": MODEL, "prompt": "x" * (2 * 1024 * 1024)}).encode()
        async with s.post(mesh.gateway_http + "/v1/completions", data=big) as r:
            assert r.status == 413
