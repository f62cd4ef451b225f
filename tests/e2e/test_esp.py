"""ESP with real processes: four worker processes of 128 KV tokens each (data plane `auto`: UCX
where ucxx imports, else TCP), the manager routing prompts no single worker holds to a group.
A 300-token prompt (2.3x one worker's KV) gives one instance's greedy and seeded tokens; a
holder SIGKILLed mid-stream ends the stream with the same tokens: re-routed to a new group of the
three left, resumed after the tokens so far."""

from __future__ import annotations

import asyncio
import signal
from collections.abc import AsyncIterator, Callable
from pathlib import Path

import openai
import pytest
import pytest_asyncio
import torch

import blitzmesh
from blitzmesh.v1 import admin_pb2, global_manager_pb2_grpc
from services.mesh.launcher import Mesh, MeshConfig
from services.worker.engine.sampling import SamplingParams, sample
from services.worker.model.llama import load_model

pytestmark = [pytest.mark.e2e, pytest.mark.asyncio(loop_scope="module"), pytest.mark.timeout(300)]

KV_TOKENS = 128


@pytest_asyncio.fixture(loop_scope="module", scope="module")
async def esp_mesh(
    make_mesh_config: Callable[..., MeshConfig], tmp_path_factory: pytest.TempPathFactory
) -> AsyncIterator[Mesh]:
    cfg = make_mesh_config(tmp_path_factory.mktemp("run-esp"), workers=4)
    cfg.worker_args = [*cfg.worker_args, "--kv-cache-tokens", str(KV_TOKENS)]
    m = Mesh(cfg)
    try:
        await m.start()
        yield m
    finally:
        await m.stop()


def reference(model_dir: Path, prompt: list[int], params: SamplingParams, steps: int) -> list[int]:
    model = load_model(str(model_dir / "tiny"))
    ids, out = list(prompt), []
    gen = params.make_generator()
    for _ in range(steps):
        token = sample(model.forward(torch.tensor(ids))[-1:], [params], [gen]).tokens[0]
        out.append(token)
        ids.append(token)
    return out


def prompt_of(n: int, seed: int) -> list[int]:
    return torch.randint(3, 2048, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


async def groups(mesh: Mesh) -> list[admin_pb2.EspGroupInfo]:
    async with mesh.channel("global_manager") as ch:
        cluster = await global_manager_pb2_grpc.GlobalManagerStub(ch).GetCluster(
            admin_pb2.GetClusterRequest(), timeout=5
        )
    return list(cluster.esp_groups)


async def test_a_prompt_no_worker_holds_gives_one_instances_tokens(esp_mesh: Mesh, model_dir: Path) -> None:
    prompt = prompt_of(300, 1)
    async with blitzmesh.AsyncClient(esp_mesh.gateway_grpc, timeout_s=120, max_retries=0) as client:
        for seed in (None, 5):
            temperature = 0.0 if seed is None else 0.8
            done = await client.complete(
                model="tiny",
                prompt_token_ids=prompt,
                max_tokens=12,
                temperature=temperature,
                seed=seed,
                ignore_eos=True,
                return_token_ids=True,
            )
            want = reference(model_dir, prompt, SamplingParams(temperature=temperature, seed=seed, max_tokens=12), 12)
            assert list(done.token_ids) == want, seed
            assert done.usage is not None and done.usage.prompt_tokens == 300
    formed = await groups(esp_mesh)
    assert formed and formed[0].degree >= 3 and formed[0].bounds[-1] == 300
    # The OpenAI endpoint, unchanged for the user.
    client = openai.AsyncOpenAI(base_url=esp_mesh.gateway_http + "/v1", api_key="unused", max_retries=0)
    try:
        done = await client.completions.create(
            model="tiny", prompt=prompt, max_tokens=12, temperature=0, extra_body={"ignore_eos": True}
        )
    finally:
        await client.close()
    assert done.usage is not None and (done.usage.prompt_tokens, done.usage.completion_tokens) == (300, 12)


async def test_a_holder_killed_mid_stream_ends_in_the_same_tokens_or_a_clear_error(
    esp_mesh: Mesh, model_dir: Path
) -> None:
    prompt = prompt_of(200, 2)
    want = reference(model_dir, prompt, SamplingParams(temperature=0.0, max_tokens=120), 120)
    tokens: list[int] = []
    killed = None
    error = None
    async with blitzmesh.AsyncClient(esp_mesh.gateway_grpc, timeout_s=120, max_retries=0) as client:
        stream = client.generate(
            model="tiny",
            prompt_token_ids=prompt,
            max_tokens=120,
            temperature=0,
            ignore_eos=True,
            return_token_ids=True,
        )
        try:
            async with asyncio.timeout(90):
                async for chunk in stream:
                    tokens.extend(chunk.token_ids)
                    if killed is None:
                        group = (await groups(esp_mesh))[0]
                        assert group.bounds[-1] == 200
                        killed = group.member_ids[0]
                        esp_mesh.procs[killed].process.send_signal(signal.SIGKILL)
        except blitzmesh.BlitzmeshError as e:
            error = e
    assert killed is not None
    # The gateway saw the holder's call fail, ended the master's stream at once (not after the
    # group's 30 s timeout) and re-routed the request, resumed, to a group of the three left.
    assert error is None, error
    assert tokens == want
