"""The SLO refusal path through real services in this process: the `openai` client -> gateway ->
a real global manager -> a real worker (engine, tiny synthetic model, weights from a real
parameter manager), over real gRPC.

`test_slo_reaches_the_engine_and_usage_reports_it`: the objectives a client sets reach the
worker's engine (the gateway passes the TTFT budget left), a malformed one is refused at the
worker's edge, and `usage.slo` reports attainment. `test_unattainable_ttft_behind_queued_work_is_429`:
a SCORPIO worker on an emulated accelerator, busy with queued work, refuses a 1 ms TTFT for a
real reason; the worker's RESOURCE_EXHAUSTED carries `retry-after-s` and `slo-kind`, and the
`openai` client gets a 429 with `Retry-After` while the queued work completes.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import grpc
import grpc.aio
import openai
import pytest

from blitzmesh.v1 import common_pb2, worker_pb2, worker_pb2_grpc
from services.common.grpc_util import RETRY_AFTER_METADATA_KEY, SLO_METADATA_KEY, channel
from services.common.waiting import wait_until
from services.worker.engine.slo import RequestSLO
from services.worker.service import REQUESTS, WorkerService
from tests.integration.mini_mesh import mini_mesh

ServeFactory = Any  # tests/integration/conftest.py: serve_in_process

pytestmark = [pytest.mark.timeout(120), pytest.mark.filterwarnings("error")]

MODEL = "tiny"
MESSAGES = [{"role": "user", "content": "the quick brown fox"}]


def record_slos(wk: WorkerService, seen: list[RequestSLO | None]) -> None:
    """Record the objectives each request brings to the real engine (behaviour unchanged)."""
    inst = wk.servicer.instance
    assert inst is not None and inst.engine is not None
    engine = inst.engine
    real: Callable[..., AsyncIterator[Any]] = engine.generate

    async def generate(*args: Any, slo: RequestSLO | None = None, **kwargs: Any) -> AsyncIterator[Any]:
        seen.append(slo)
        async for event in real(*args, slo=slo, **kwargs):
            yield event

    engine.generate = generate  # type: ignore[method-assign]


async def test_slo_reaches_the_engine_and_usage_reports_it(tiny_models: Path, serve_in_process: ServeFactory) -> None:
    seen: list[RequestSLO | None] = []
    async with mini_mesh(tiny_models, serve_in_process) as m:
        record_slos(m.worker, seen)
        async with channel(m.worker_address) as ch:
            # An objective that is not a positive number is the caller's mistake.
            bad = worker_pb2_grpc.WorkerStub(ch).Generate(
                worker_pb2.WorkerGenerateRequest(
                    request_id="direct-2",
                    model_id=MODEL,
                    prompt_token_ids=[1, 5, 9],
                    sampling=common_pb2.SamplingParams(max_tokens=2),
                    slo=common_pb2.RequestSLO(tpot_s=0.0),
                ),
                timeout=10,
            )
            with pytest.raises(grpc.aio.AioRpcError) as err:
                async for _ in bad:
                    pass
            assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "tpot_s" in (err.value.details() or "")

        client = openai.AsyncOpenAI(base_url=m.http, api_key="unused", max_retries=0)
        try:
            done = await client.chat.completions.create(
                model=MODEL, messages=MESSAGES, max_tokens=4, extra_body={"ttft_slo_s": 60, "tpot_slo_s": 30}
            )
        finally:
            await client.close()
        assert done.usage is not None
        slo = (done.usage.model_extra or {})["slo"]
        assert slo["ttft_met"] is True and slo["tpot_met"] is True and slo["ttft_s"] == 60
        last = seen[-1]
        assert last is not None and last.tpot_s == 30 and last.ttft_s is not None and 0 < last.ttft_s <= 60


async def test_unattainable_ttft_behind_queued_work_is_429(tiny_models: Path, serve_in_process: ServeFactory) -> None:
    pacing = {"step_time_a_s": 0.05, "step_time_b_s": 0.002, "max_batch_size": 2, "scheduling_policy": "scorpio"}
    async with mini_mesh(tiny_models, serve_in_process, **pacing) as m:
        client = openai.AsyncOpenAI(base_url=m.http, api_key="unused", max_retries=0)
        try:
            # Queued work: long generations filling the batch, more waiting behind them.
            backlog = [
                asyncio.create_task(
                    client.chat.completions.create(
                        model=MODEL, messages=MESSAGES, max_tokens=48, extra_body={"ignore_eos": True}
                    )
                )
                for _ in range(6)
            ]

            async def busy() -> bool:
                inst = m.worker.servicer.instance
                return inst is not None and inst.engine is not None and inst.engine.stats().waiting > 0

            await wait_until(busy, 30, interval_s=0.02, what="requests queued on the worker")
            rejected_before = REQUESTS.labels("slo_rejected")._value.get()
            # The worker's own API: RESOURCE_EXHAUSTED naming the objective, with the retry hint.
            async with channel(m.worker_address) as ch:
                refused = worker_pb2_grpc.WorkerStub(ch).Generate(
                    worker_pb2.WorkerGenerateRequest(
                        request_id="direct-1",
                        model_id=MODEL,
                        prompt_token_ids=[1, 5, 9],
                        sampling=common_pb2.SamplingParams(max_tokens=2),
                        slo=common_pb2.RequestSLO(ttft_s=0.001),
                    ),
                    timeout=10,
                )
                with pytest.raises(grpc.aio.AioRpcError) as err:
                    async for _ in refused:
                        pass
            assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            assert "TTFT SLO of 0.001 s" in (err.value.details() or "")
            trailing = dict(err.value.trailing_metadata() or ())
            assert float(trailing[RETRY_AFTER_METADATA_KEY]) >= 0 and trailing[SLO_METADATA_KEY] == "ttft"
            assert REQUESTS.labels("slo_rejected")._value.get() == rejected_before + 1
            with pytest.raises(openai.RateLimitError) as rate:
                await asyncio.wait_for(
                    client.chat.completions.create(
                        model=MODEL, messages=MESSAGES, max_tokens=4, extra_body={"ttft_slo_s": 0.001}
                    ),
                    30,
                )
            assert rate.value.status_code == 429
            retry_after = rate.value.response.headers["Retry-After"]
            assert retry_after.isdigit() and int(retry_after) >= 1
            assert "ttft" in rate.value.response.json()["error"]["message"].lower()
            # The queued work itself is unharmed.
            done = await asyncio.wait_for(asyncio.gather(*backlog), 60)
            assert all(d.choices[0].finish_reason == "length" for d in done)
        finally:
            await client.close()
