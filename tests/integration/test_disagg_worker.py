"""Prefill/decode disaggregation between real workers (grpc.aio servers, TCP data plane, one
process): a prefill worker runs the prompt and hands its KV off; a decode worker pulls it over
the data plane and continues with exactly the tokens of a colocated worker."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import grpc
import pytest

from blitzmesh.v1 import common_pb2, worker_pb2, worker_pb2_grpc
from services.common.grpc_util import channel
from services.common.waiting import wait_until
from services.param_manager.service import ParamManagerService
from services.worker.config import WorkerConfig
from services.worker.service import WorkerService
from tests.integration.test_param_worker import pm_config

pytestmark = pytest.mark.timeout(120)

ServeFactory = Any  # tests/integration/conftest.py: serve_in_process


@contextlib.asynccontextmanager
async def workers(
    tiny_models: Path, serve_in_process: ServeFactory, roles: dict[str, int], **kw: Any
) -> AsyncIterator[dict[str, tuple[WorkerService, worker_pb2_grpc.WorkerStub]]]:
    """A parameter manager and one loaded worker per entry of `roles` (id -> InstanceRole)."""
    pm = ParamManagerService(pm_config(tiny_models))
    async with contextlib.AsyncExitStack() as stack:
        pm_ctx = await stack.enter_async_context(serve_in_process(pm, pm.servicer.config))
        out: dict[str, tuple[WorkerService, worker_pb2_grpc.WorkerStub]] = {}
        for iid, role in roles.items():
            cfg = WorkerConfig(
                port=0, param_manager=pm_ctx.address, instance_id=iid, kv_cache_tokens=4096, dataplane="tcp", **kw
            )
            wk = WorkerService(cfg)
            ctx = await stack.enter_async_context(serve_in_process(wk, wk.cfg))
            ch = await stack.enter_async_context(channel(ctx.address))
            stub = worker_pb2_grpc.WorkerStub(ch)
            load = worker_pb2.LoadParametersRequest(model_id="tiny", role=role, instance_id=iid)
            assert [p async for p in stub.LoadParameters(load, timeout=60)][-1].done
            out[iid] = (wk, stub)
        yield out


def request(rid: str, prompt: list[int], max_tokens: int = 24, **kw: Any) -> worker_pb2.WorkerGenerateRequest:
    return worker_pb2.WorkerGenerateRequest(
        request_id=rid,
        model_id="tiny",
        prompt_token_ids=prompt,
        sampling=common_pb2.SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True),
        **kw,
    )


async def split(
    prefill: worker_pb2_grpc.WorkerStub, decode: worker_pb2_grpc.WorkerStub, rid: str, prompt: list[int]
) -> tuple[list[int], worker_pb2.WorkerGenerateResponse]:
    head = [
        m
        async for m in prefill.Generate(
            request(rid, prompt, prefill_handoff=worker_pb2.PrefillHandoffMode()), timeout=30
        )
    ]
    assert len(head) == 1 and len(head[0].token_ids) == 1 and not head[0].HasField("finish_reason")
    desc = head[0].kv_handoff
    assert desc.num_tokens == len(prompt) and desc.transfer_id
    rest = [
        m
        async for m in decode.Generate(
            request(rid, prompt, resume_token_ids=list(head[0].token_ids), decode_from_kv=desc), timeout=30
        )
    ]
    # The prefill side prefilled the prompt and reports its prefix-cache hits; the decode side
    # pulled the KV and reports none (the gateway keeps the prefill side's count).
    assert head[0].HasField("cached_tokens") and not any(m.HasField("cached_tokens") for m in rest)
    return [*head[0].token_ids, *(t for m in rest for t in m.token_ids)], rest[-1]


PROMPTS = [[1, *range(5, 5 + n)] for n in (4, 30, 77)]


async def test_prefill_then_decode_over_the_data_plane_equals_colocated(
    tiny_models: Path, serve_in_process: ServeFactory
) -> None:
    roles = {
        "c": common_pb2.INSTANCE_ROLE_COLOCATED,
        "p": common_pb2.INSTANCE_ROLE_PREFILL,
        "d": common_pb2.INSTANCE_ROLE_DECODE,
    }
    async with workers(tiny_models, serve_in_process, roles) as ws:
        (_, colocated), (p_svc, prefill), (d_svc, decode) = ws["c"], ws["p"], ws["d"]
        # Workers take their role from LoadParameters and report it.
        assert (await prefill.GetStatus(worker_pb2.GetStatusRequest())).role == common_pb2.INSTANCE_ROLE_PREFILL
        assert (await decode.GetStatus(worker_pb2.GetStatusRequest())).role == common_pb2.INSTANCE_ROLE_DECODE
        whole = await asyncio.gather(
            *(collect_tokens(colocated.Generate(request(f"r{i}", p), timeout=30)) for i, p in enumerate(PROMPTS))
        )
        runs = await asyncio.gather(*(split(prefill, decode, f"r{i}", p) for i, p in enumerate(PROMPTS)))
        for (tokens, last), expected in zip(runs, whole, strict=True):
            assert tokens == expected
            assert last.finish_reason == common_pb2.FINISH_REASON_LENGTH and last.completion_tokens == 24
        d_engine = d_svc.servicer.instance.engine  # type: ignore[union-attr]
        p_engine = p_svc.servicer.instance.engine  # type: ignore[union-attr]
        assert d_engine.kv_fills == {"pulled": len(PROMPTS), "recomputed": 0}
        # The prefill side frees each hand-off once its decode side has pulled it.
        await wait_until(lambda: p_engine.kv_cache.used_blocks == 0, 10, what="parked KV freed on the prefill side")
        assert d_engine.kv_cache.used_blocks == 0


async def test_a_source_gone_before_the_pull_is_recomputed(tiny_models: Path, serve_in_process: ServeFactory) -> None:
    """The offer is withdrawn (the prefill instance unloaded) before the decode side pulls it:
    the decode side recomputes the prompt and the tokens are the same."""
    roles = {"p": common_pb2.INSTANCE_ROLE_PREFILL, "d": common_pb2.INSTANCE_ROLE_DECODE}
    async with workers(tiny_models, serve_in_process, roles) as ws:
        (_, prefill), (d_svc, decode) = ws["p"], ws["d"]
        prompt = PROMPTS[1]
        head = [
            m
            async for m in prefill.Generate(
                request("r", prompt, prefill_handoff=worker_pb2.PrefillHandoffMode()), timeout=30
            )
        ]
        desc = head[0].kv_handoff
        expected = await collect_tokens(decode.Generate(request("whole", prompt), timeout=30))
        await prefill.Unload(worker_pb2.UnloadRequest(instance_id="p"), timeout=10)  # the offer goes with it
        rest = await collect_tokens(
            decode.Generate(
                request("r", prompt, resume_token_ids=list(head[0].token_ids), decode_from_kv=desc), timeout=30
            )
        )
        assert [*head[0].token_ids, *rest] == expected
        assert d_svc.servicer.instance.engine.kv_fills == {"pulled": 0, "recomputed": 1}  # type: ignore[union-attr]


async def test_bad_hand_off_requests_are_refused(tiny_models: Path, serve_in_process: ServeFactory) -> None:
    roles = {"p": common_pb2.INSTANCE_ROLE_PREFILL, "d": common_pb2.INSTANCE_ROLE_DECODE}
    # Nobody pulls the hand-off made here: it expires after 1 s instead of holding the drain.
    async with workers(tiny_models, serve_in_process, roles, kv_handoff_timeout_s=1.0) as ws:
        (_, prefill), (_, decode) = ws["p"], ws["d"]
        prompt = PROMPTS[0]
        head = [
            m
            async for m in prefill.Generate(
                request("r", prompt, prefill_handoff=worker_pb2.PrefillHandoffMode()), timeout=30
            )
        ]
        desc = head[0].kv_handoff
        cases = {
            "covers 5 tokens; prompt (5) + resumed (2) - 1 = 6": request(
                "x", prompt, resume_token_ids=[*head[0].token_ids, 7], decode_from_kv=desc
            ),
            "resumes no token": request("y", [*prompt[:-1], prompt[-1], 9][:6], decode_from_kv=desc),
            "zigzag_partner.dataplane_address is empty": request(
                "z", prompt, zigzag_partner=worker_pb2.ZigzagSource(instance_id="elsewhere")
            ),
        }
        for expected, req in cases.items():
            with pytest.raises(grpc.aio.AioRpcError) as e:
                await collect_tokens(decode.Generate(req, timeout=30))
            assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT, expected
            assert expected in (e.value.details() or ""), (expected, e.value.details())
        with pytest.raises(grpc.aio.AioRpcError) as unknown:
            await prefill.LoadParameters(
                worker_pb2.LoadParametersRequest(model_id="tiny", role=7, instance_id="p")
            ).read()
        assert unknown.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "role 7" in (unknown.value.details() or "")


async def collect_tokens(call: Any) -> list[int]:
    return [t async for m in call for t in m.token_ids]


async def test_aborting_a_handed_off_request_frees_its_kv_at_once(
    tiny_models: Path, serve_in_process: ServeFactory
) -> None:
    """A request that ends on its first token (a stop string) or whose client leaves before the
    decode side pulls: the gateway's Abort frees the offered KV on the prefill side at once."""
    roles = {"p": common_pb2.INSTANCE_ROLE_PREFILL}
    async with workers(tiny_models, serve_in_process, roles) as ws:
        p_svc, prefill = ws["p"]
        head = [
            m
            async for m in prefill.Generate(
                request("r", PROMPTS[2], prefill_handoff=worker_pb2.PrefillHandoffMode()), timeout=30
            )
        ]
        assert head[0].HasField("kv_handoff")
        engine = p_svc.servicer.instance.engine  # type: ignore[union-attr]
        assert engine.kv_cache.used_blocks > 0  # held for a decode side (30 s by default)
        assert (await prefill.Abort(worker_pb2.AbortRequest(request_id="r"), timeout=5)).found
        await wait_until(lambda: engine.kv_cache.used_blocks == 0, 5, what="the offered KV freed after Abort")


async def test_a_running_request_live_migrates_with_its_kv(tiny_models: Path, serve_in_process: ServeFactory) -> None:
    """ReleaseRunning: a decoding request leaves its worker with its KV (the stream's last
    message carries kv_handoff, no token); another worker pulls it and continues exactly."""
    roles = {"a": common_pb2.INSTANCE_ROLE_COLOCATED, "b": common_pb2.INSTANCE_ROLE_COLOCATED}
    async with workers(tiny_models, serve_in_process, roles, step_time_a_s=0.02, step_time_b_s=0.0) as ws:
        (_, a), (b_svc, b) = ws["a"], ws["b"]
        prompt = PROMPTS[1]
        expected = await collect_tokens(b.Generate(request("whole", prompt, max_tokens=40), timeout=30))
        messages: list[worker_pb2.WorkerGenerateResponse] = []

        async def run() -> None:
            async for m in a.Generate(request("r", prompt, max_tokens=40), timeout=30):
                messages.append(m)

        task = asyncio.create_task(run())
        await wait_until(lambda: len(messages) >= 4, 10, what="four tokens on worker a")
        released = await a.ReleaseRunning(
            worker_pb2.ReleaseRunningRequest(max_requests=2, reason="test", instance_id="a"), timeout=5
        )
        assert list(released.request_ids) == ["r"]
        await task
        last = messages[-1]
        assert last.HasField("kv_handoff") and not last.token_ids and not last.HasField("finish_reason")
        tokens = [t for m in messages for t in m.token_ids]
        assert last.kv_handoff.num_tokens == len(prompt) + len(tokens) - 1
        rest = await collect_tokens(
            b.Generate(
                request("r", prompt, max_tokens=40, resume_token_ids=tokens, decode_from_kv=last.kv_handoff), timeout=30
            )
        )
        assert tokens + rest == expected
        assert b_svc.servicer.instance.engine.kv_fills == {"pulled": 1, "recomputed": 0}  # type: ignore[union-attr]
