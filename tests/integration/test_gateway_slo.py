"""Per-request SLOs through the gateway over real sockets (the scripted workers and managers of
test_gateway.py): the objectives reach the manager and the worker, `usage.slo` reports the
attainment (HTTP, streamed and not, and gRPC) and the metrics count it, the deployment's defaults
apply, and a worker's SLO refusal is re-routed once and then answered 429 + Retry-After (the
`openai` client's RateLimitError), RESOURCE_EXHAUSTED on the gRPC API (the SDK's
SLOUnattainableError with its retry_after_s)."""

from __future__ import annotations

import aiohttp
import grpc
import grpc.aio
import openai
import pytest

import blitzmesh
from blitzmesh.v1 import common_pb2, inference_pb2, inference_pb2_grpc, worker_pb2_grpc
from services.common.grpc_util import RETRY_AFTER_METADATA_KEY, SLO_METADATA_KEY
from tests.integration import test_gateway
from tests.integration.test_gateway import (
    MODEL,
    REPLY,
    Cluster,
    FakeWorker,
    _get_text,
    chat_body,
    post,
    sse_events,
    start_server,
)

# The fixtures of test_gateway.py, shared: upstream fakes and a gateway in front of them.
cluster = test_gateway.cluster
start_gateway = test_gateway.start_gateway

pytestmark = [pytest.mark.timeout(20), pytest.mark.filterwarnings("error")]


class RefusingWorker(FakeWorker):
    """Refuses every request for its SLO before the first token, as an SLO-aware engine does
    when the objective cannot be met: RESOURCE_EXHAUSTED with `retry-after-s` and `slo-kind`."""

    def __init__(self, instance_id: str, reply_ids: list[int], retry_after_s: float = 2.2) -> None:
        super().__init__(instance_id, reply_ids)
        self.retry_after_s = retry_after_s

    async def Generate(self, request, context):
        self.requests.append(request)
        kind = "ttft" if request.slo.HasField("ttft_s") else "tpot"
        context.set_trailing_metadata(
            ((RETRY_AFTER_METADATA_KEY, f"{self.retry_after_s:.3f}"), (SLO_METADATA_KEY, kind))
        )
        await context.abort(
            grpc.StatusCode.RESOURCE_EXHAUSTED, f"instance {self.instance_id}: {kind.upper()} SLO unattainable"
        )
        yield  # pragma: no cover  (a generator, as the servicer method must be)


async def add_refusing(c: Cluster, instance_id: str, retry_after_s: float = 2.2) -> RefusingWorker:
    worker = RefusingWorker(instance_id, c.reply_ids, retry_after_s)
    server, address = await start_server(lambda s: worker_pb2_grpc.add_WorkerServicer_to_server(worker, s))
    c.workers[instance_id] = worker
    c.worker_servers[instance_id] = server
    c.gm.instances.append((instance_id, address))
    return worker


async def test_objectives_reach_the_manager_and_the_worker(cluster: Cluster, start_gateway) -> None:
    worker = await cluster.add_worker("w-1")
    gw = await start_gateway()
    status, body = await post(gw.http + "/v1/chat/completions", chat_body(ttft_slo_s=5, tpot_slo_s=0.5))
    assert status == 200, body
    schedule = cluster.gm.schedules[0]
    assert schedule.slo.ttft_s == 5.0 and schedule.slo.tpot_s == 0.5
    sent = worker.requests[0].slo
    # The worker gets what is left of the TTFT budget (the gateway's clock started first).
    assert 4.0 < sent.ttft_s <= 5.0 and sent.tpot_s == 0.5
    # No objective: none on the wire either.
    status, _ = await post(gw.http + "/v1/completions", {"model": MODEL, "prompt": "Hi", "max_tokens": 2})
    assert status == 200
    assert not cluster.gm.schedules[1].HasField("slo") and not worker.requests[1].HasField("slo")


async def test_usage_reports_attainment_and_metrics_count_it(cluster: Cluster, start_gateway) -> None:
    worker = await cluster.add_worker("w-1")
    worker.delay_s = 0.005  # a gap between tokens that a 1 us TPOT objective cannot meet
    gw = await start_gateway()
    status, body = await post(gw.http + "/v1/chat/completions", chat_body(ttft_slo_s=30, tpot_slo_s=0.000001))
    assert status == 200, body
    slo = body["usage"]["slo"]
    assert slo["ttft_s"] == 30 and slo["tpot_s"] == 0.000001
    assert slo["ttft_met"] is True and slo["tpot_met"] is False
    assert 0 < slo["ttft_observed_s"] < 30 and slo["tpot_observed_s"] >= 0.004

    # Streamed: in the usage chunk (include_usage), and nowhere else.
    events = await sse_events(
        gw.http + "/v1/completions",
        {"model": MODEL, "prompt": "Hi", "stream": True, "stream_options": {"include_usage": True}, "ttft_slo_s": 30},
    )
    usage_chunks = [e for e in events[:-1] if e.get("usage")]
    assert len(usage_chunks) == 1 and usage_chunks[0] is events[-2]
    streamed = usage_chunks[0]["usage"]["slo"]
    assert streamed["ttft_met"] is True and streamed["tpot_s"] is None and streamed["tpot_met"] is None

    # Without an objective: no `slo` in usage.
    status, plain = await post(gw.http + "/v1/chat/completions", chat_body())
    assert status == 200 and "slo" not in plain["usage"]

    metrics = await _get_text(gw.http + "/metrics")
    assert 'blitzmesh_gateway_slo_requests_total{kind="ttft",met="true",slo="30"} 2.0' in metrics
    assert 'blitzmesh_gateway_slo_requests_total{kind="tpot",met="false",slo="1e-06"} 1.0' in metrics


async def test_deployment_defaults_apply_when_the_request_sets_none(cluster: Cluster, start_gateway) -> None:
    worker = await cluster.add_worker("w-1")
    gw = await start_gateway(default_ttft_slo_s=30.0, model_slo_defaults={MODEL: {"tpot_s": 10.0}})
    status, body = await post(gw.http + "/v1/chat/completions", chat_body())
    assert status == 200, body
    assert body["usage"]["slo"]["ttft_s"] == 30.0 and body["usage"]["slo"]["tpot_s"] == 10.0
    assert body["usage"]["slo"]["ttft_met"] is True and body["usage"]["slo"]["tpot_met"] is True
    assert worker.requests[0].slo.tpot_s == 10.0
    # The request's own objective wins over the defaults.
    status, body = await post(gw.http + "/v1/chat/completions", chat_body(tpot_slo_s=20))
    assert status == 200 and body["usage"]["slo"]["tpot_s"] == 20


async def test_bad_objective_is_a_400_quoting_it(cluster: Cluster, start_gateway) -> None:
    await cluster.add_worker("w-1")
    gw = await start_gateway()
    for field, value, quoted in (("ttft_slo_s", -1, "got -1"), ("tpot_slo_s", "soon", 'got "soon"')):
        status, body = await post(gw.http + "/v1/chat/completions", chat_body(**{field: value}))
        assert status == 400, body
        assert body["error"]["param"] == field and quoted in body["error"]["message"]
    assert cluster.gm.schedules == []


async def test_slo_refusal_is_rerouted_once_then_429_with_retry_after(cluster: Cluster, start_gateway) -> None:
    for name, wait_s in (("w-1", 4.0), ("w-2", 2.2), ("w-3", 1.0)):
        await add_refusing(cluster, name, wait_s)
    gw = await start_gateway()
    client = openai.AsyncOpenAI(base_url=gw.http + "/v1", api_key="unused", max_retries=0)
    try:
        with pytest.raises(openai.RateLimitError) as err:
            await client.chat.completions.create(
                model=MODEL, messages=[{"role": "user", "content": "Say hi"}], extra_body={"ttft_slo_s": 0.001}
            )
    finally:
        await client.close()
    assert err.value.status_code == 429
    assert err.value.response.headers["Retry-After"] == "3"  # the soonest of the two asked, rounded up
    error = err.value.response.json()["error"]
    assert error["type"] == "slo_unattainable" and error["code"] == 429 and error["param"] == "ttft_slo_s"
    assert "TTFT" in error["message"] and "ttft_slo_s=0.001" in error["message"]
    # One other instance was tried (excluding the first), never a third.
    assert [list(s.exclude_instance_ids) for s in cluster.gm.schedules] == [[], ["w-1"]]
    assert not cluster.workers["w-3"].requests
    metrics = await _get_text(gw.http + "/metrics")
    assert 'blitzmesh_gateway_requests_total{api="http",outcome="slo_rejected"} 1.0' in metrics
    assert 'blitzmesh_gateway_retries_total{code="RESOURCE_EXHAUSTED"} 1.0' in metrics


async def test_slo_refusal_with_no_other_instance_is_429_not_503(cluster: Cluster, start_gateway) -> None:
    await add_refusing(cluster, "w-1", 0.2)
    gw = await start_gateway()
    async with aiohttp.ClientSession() as session:
        body = {"model": MODEL, "prompt": "Hi", "stream": True, "tpot_slo_s": 0.01}
        async with session.post(gw.http + "/v1/completions", json=body) as resp:
            assert resp.status == 429
            assert resp.headers["Retry-After"] == "1"  # never 0
            error = (await resp.json())["error"]
    assert error["param"] == "tpot_slo_s" and "tpot_slo_s=0.01" in error["message"]


async def test_another_instance_serves_a_refused_request(cluster: Cluster, start_gateway) -> None:
    await add_refusing(cluster, "w-busy")
    await cluster.add_worker("w-free")
    gw = await start_gateway()
    status, body = await post(gw.http + "/v1/chat/completions", chat_body(ttft_slo_s=10))
    assert status == 200, body
    assert body["choices"][0]["message"]["content"] == REPLY
    assert body["usage"]["slo"]["ttft_met"] is True
    assert [list(s.exclude_instance_ids) for s in cluster.gm.schedules] == [[], ["w-busy"]]


async def test_grpc_api_and_sdk(cluster: Cluster, start_gateway) -> None:
    await cluster.add_worker("w-1")
    gw = await start_gateway()
    async with grpc.aio.insecure_channel(gw.grpc_address) as ch:
        stub = inference_pb2_grpc.InferenceStub(ch)
        slo = common_pb2.RequestSLO(ttft_s=30.0, tpot_s=5.0)
        replies = [r async for r in stub.Generate(inference_pb2.GenerateRequest(model=MODEL, prompt="Hi", slo=slo))]
        final = replies[-1].usage.slo
        assert final.ttft_s == 30.0 and final.ttft_met and final.tpot_met and final.ttft_observed_s > 0
        one = await stub.Complete(inference_pb2.GenerateRequest(model=MODEL, prompt="Hi", slo=slo))
        assert one.usage.slo.tpot_s == 5.0 and one.usage.slo.tpot_met
        with pytest.raises(grpc.aio.AioRpcError) as err:
            bad = common_pb2.RequestSLO(ttft_s=-3.0)
            await stub.Complete(inference_pb2.GenerateRequest(model=MODEL, prompt="Hi", slo=bad))
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "got -3.0" in (err.value.details() or "")

    async with blitzmesh.AsyncClient(gw.grpc_address, max_retries=0) as client:
        done = await client.complete("Hi", model=MODEL, ttft_slo_s=30, tpot_slo_s=5)
        assert done.usage.slo is not None and done.usage.slo.ttft_met and done.usage.slo.tpot_s == 5.0
        chunks = [c async for c in client.generate("Hi", model=MODEL, ttft_slo_s=30)]
        assert chunks[-1].usage is not None and chunks[-1].usage.slo is not None
        assert chunks[-1].usage.slo.ttft_met is True and chunks[-1].usage.slo.tpot_met is None
        plain = await client.complete("Hi", model=MODEL)
        assert plain.usage.slo is None

        # Every instance refuses: RESOURCE_EXHAUSTED with the objective named, and retry_after_s.
        cluster.gm.instances.clear()
        await add_refusing(cluster, "w-busy", 2.5)
        with pytest.raises(blitzmesh.SLOUnattainableError) as sdk_err:
            await client.complete("Hi", model=MODEL, ttft_slo_s=0.001)
        assert sdk_err.value.code == "RESOURCE_EXHAUSTED" and sdk_err.value.retry_after_s == pytest.approx(2.5)
        assert "ttft_slo_s=0.001" in sdk_err.value.details
        with pytest.raises(blitzmesh.SLOUnattainableError):
            async for _ in client.generate("Hi", model=MODEL, tpot_slo_s=0.001):
                pass
