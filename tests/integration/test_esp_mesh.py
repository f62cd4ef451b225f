"""ESP through the whole mesh (parameter manager, global manager, 4 workers, gateway, in one
process over real gRPC, TCP data plane): workers of 64 KV tokens each serve a 200-token prompt
(3.1x one instance's KV) with the greedy and seeded tokens of one instance that holds it whole;
the manager plans the group (core/esp.py) and shows it in GetCluster; the OpenAI endpoint just
works; a request too long for every group fails with a message that says so."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import openai
import pytest
import torch
from prometheus_client import CollectorRegistry

from blitzmesh.v1 import admin_pb2, common_pb2, global_manager_pb2_grpc, inference_pb2, inference_pb2_grpc
from services.common.grpc_util import channel
from services.common.waiting import wait_until
from services.gateway.config import GatewayConfig
from services.gateway.service import GatewayService
from services.global_manager.config import GlobalManagerConfig
from services.global_manager.service import GlobalManagerService
from services.param_manager.service import ParamManagerConfig, ParamManagerService
from services.worker.config import WorkerConfig
from services.worker.engine.sampling import SamplingParams, sample
from services.worker.model.llama import load_model
from services.worker.service import WorkerService

pytestmark = pytest.mark.timeout(240)

KV_TOKENS = 64
WORKERS = 4


@dataclass
class EspMesh:
    http: str
    inference: inference_pb2_grpc.InferenceStub
    manager: global_manager_pb2_grpc.GlobalManagerStub
    workers: list[WorkerService]
    manager_service: GlobalManagerService


@contextlib.asynccontextmanager
async def esp_mesh(tiny_models: Path, serve_in_process: Any) -> AsyncIterator[EspMesh]:
    async with contextlib.AsyncExitStack() as stack:
        pm = ParamManagerService(ParamManagerConfig(port=0, model_dir=tiny_models, dataplane="tcp"))
        pm_ctx = await stack.enter_async_context(serve_in_process(pm, pm.servicer.config))
        gm = GlobalManagerService(GlobalManagerConfig(port=0, param_manager=pm_ctx.address))
        gm_ctx = await stack.enter_async_context(serve_in_process(gm, gm.servicer.cfg))
        workers = []
        for k in range(WORKERS):
            wk = WorkerService(
                WorkerConfig(
                    port=0,
                    instance_id=f"w-{k}",
                    param_manager=pm_ctx.address,
                    global_manager=gm_ctx.address,
                    preload_model="tiny",
                    kv_cache_tokens=KV_TOKENS,
                    heartbeat_interval_s=0.2,
                    dataplane="tcp",
                )
            )
            await stack.enter_async_context(serve_in_process(wk, wk.cfg))
            workers.append(wk)
        ch = await stack.enter_async_context(channel(gm_ctx.address))
        manager = global_manager_pb2_grpc.GlobalManagerStub(ch)

        async def serving() -> bool:
            cluster = await manager.GetCluster(admin_pb2.GetClusterRequest(), timeout=5)
            return (
                sum(
                    i.state == common_pb2.INSTANCE_STATE_SERVING and i.load.kv_blocks_total > 0
                    for i in cluster.instances
                )
                == WORKERS
            )

        await wait_until(serving, 60, interval_s=0.05, what="every worker SERVING with its KV reported")
        cfg = GatewayConfig(
            port=0, http_port=0, global_manager=gm_ctx.address, param_manager=pm_ctx.address, shutdown_grace_s=0.5
        )
        gw_ctx = await stack.enter_async_context(
            serve_in_process(GatewayService(cfg, registry=CollectorRegistry()), cfg)
        )
        gw_ch = await stack.enter_async_context(channel(gw_ctx.address))
        yield EspMesh(
            f"http://127.0.0.1:{gw_ctx.extra_ports['http_port']}/v1",
            inference_pb2_grpc.InferenceStub(gw_ch),
            manager,
            workers,
            gm,
        )


def reference(model: Any, prompt: list[int], params: SamplingParams, steps: int) -> list[int]:
    """One instance holding the whole sequence, recomputing it each step, the engine's sampling."""
    ids, out = list(prompt), []
    gen = params.make_generator()
    for _ in range(steps):
        logits = model.forward(torch.tensor(ids))[-1]
        token = sample(logits.unsqueeze(0), [params], [gen]).tokens[0]
        out.append(token)
        ids.append(token)
    return out


async def test_a_prompt_three_times_one_instances_kv_is_served_through_the_gateway(
    tiny_models: Path, serve_in_process: Any
) -> None:
    model = load_model(str(tiny_models / "tiny"))
    g = torch.Generator().manual_seed(3)
    prompt = torch.randint(3, model.config.vocab_size, (200,), generator=g).tolist()
    assert len(prompt) / KV_TOKENS >= 3
    async with esp_mesh(tiny_models, serve_in_process) as mesh:
        events = mesh.manager_service.servicer.events.subscribe()
        for seed in (None, 11):
            params = SamplingParams(temperature=0.0 if seed is None else 0.8, seed=seed, max_tokens=16, ignore_eos=True)
            sampling = common_pb2.SamplingParams(max_tokens=16, ignore_eos=True, temperature=params.temperature)
            if seed is not None:
                sampling.seed = seed
            resp = await mesh.inference.Complete(
                inference_pb2.GenerateRequest(
                    model="tiny", prompt_token_ids=prompt, sampling=sampling, return_token_ids=True
                ),
                timeout=120,
            )
            assert list(resp.token_ids) == reference(model, prompt, params, 16), seed
            assert resp.finish_reason == common_pb2.FINISH_REASON_LENGTH and resp.usage.prompt_tokens == 200
        cluster = await mesh.manager.GetCluster(admin_pb2.GetClusterRequest(), timeout=5)
        assert len(cluster.esp_groups) == 2
        group = cluster.esp_groups[0]
        assert group.degree == len(group.member_ids) == 4  # 200 tokens need all four
        assert group.bounds[0] == 0 and group.bounds[-1] == 200
        slices = [b - a for a, b in zip(group.bounds, group.bounds[1:], strict=False)]
        assert max(slices) <= KV_TOKENS and slices[-1] + 16 <= KV_TOKENS
        # WatchEvents (and the decision log) tell each group's members and slices.
        seen: list[Any] = []

        def drained() -> list[Any]:
            seen.extend(events.get_nowait() for _ in range(events.qsize()))
            return seen

        formed = [e for e in drained() if e.action == "esp_group"]
        assert len(formed) == 2 and formed[-1].status == "formed" and "degree=4" in formed[-1].reason
        assert f"{group.member_ids[0]}[0:{group.bounds[1]})" in formed[-1].reason
        # The OpenAI endpoint, unchanged for the user.
        async with openai.AsyncOpenAI(base_url=mesh.http, api_key="unused", max_retries=0, timeout=120) as client:
            done = await client.completions.create(
                model="tiny", prompt=prompt, max_tokens=8, temperature=0, extra_body={"ignore_eos": True}
            )
        assert done.usage is not None and (done.usage.prompt_tokens, done.usage.completion_tokens) == (200, 8)
        assert done.choices[0].finish_reason == "length"
        for w in mesh.workers:
            engine = w.servicer.instance.engine  # type: ignore[union-attr]
            await wait_until(lambda e=engine: e.kv_cache.used_blocks == 0, 10, what="ESP blocks freed")
        # The workers' heartbeats tell the manager when each group ends.

        async def all_ended() -> bool:
            cluster = await mesh.manager.GetCluster(admin_pb2.GetClusterRequest(), timeout=5)
            return len(cluster.esp_groups) == 3 and not any(g.live or g.holder_ids for g in cluster.esp_groups)

        await wait_until(all_ended, 30, interval_s=0.2, what="all three ESP groups ended")
        ended = {e.status for e in drained() if e.action == "esp_group_end"}
        cluster = await mesh.manager.GetCluster(admin_pb2.GetClusterRequest(), timeout=5)
        assert ended == {g.group_id for g in cluster.esp_groups}


async def test_requests_no_group_holds_fail_saying_so(tiny_models: Path, serve_in_process: Any) -> None:
    """Longer than the 4 workers hold together: 400 at once, naming the KV. Two that fit the
    group only one at a time: the second waits (the manager answers that no group holds it now)
    and is served once the first's KV is freed; both give one instance's tokens."""
    model = load_model(str(tiny_models / "tiny"))
    async with esp_mesh(tiny_models, serve_in_process) as mesh:
        async with openai.AsyncOpenAI(base_url=mesh.http, api_key="unused", max_retries=0, timeout=120) as client:
            with pytest.raises(openai.APIStatusError) as refused:
                await client.completions.create(model="tiny", prompt=[5] * 300, max_tokens=8, temperature=0)
            assert refused.value.status_code == 400, refused.value
            assert "KV blocks" in str(refused.value)
        prompts = [torch.randint(3, 2048, (150,), generator=torch.Generator().manual_seed(s)).tolist() for s in (1, 2)]
        params = common_pb2.SamplingParams(max_tokens=30, ignore_eos=True, temperature=0)
        both = await asyncio.gather(
            *(
                mesh.inference.Complete(
                    inference_pb2.GenerateRequest(
                        model="tiny", prompt_token_ids=p, sampling=params, return_token_ids=True
                    ),
                    timeout=120,
                )
                for p in prompts
            )
        )
        greedy = SamplingParams(temperature=0.0, max_tokens=30)
        for resp, p in zip(both, prompts, strict=True):
            assert list(resp.token_ids) == reference(model, p, greedy, 30)
        cluster = await mesh.manager.GetCluster(admin_pb2.GetClusterRequest(), timeout=5)
        # Each request had its own group of three (150 + 30 tokens over 64-token instances), one
        # after the other. A loaded machine may show a second group for one request: a member
        # whose freed KV its heartbeat did not show yet refuses the attempt, and the gateway asks
        # again within the deadline.
        assert {g.request_id for g in cluster.esp_groups} == {r.request_id for r in both}
        assert all(len(g.member_ids) == 3 for g in cluster.esp_groups), cluster.esp_groups
