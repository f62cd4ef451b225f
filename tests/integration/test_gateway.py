"""The gateway over real sockets: its HTTP and gRPC APIs in front of real grpc.aio servers that
play the global manager, the parameter manager and scripted workers, with a real tokenizer.json.

Checks the OpenAI wire format (with the official client too), usage, stop strings, re-routing
before the first token, migration when an instance dies, stalls or drains mid-stream (and the
error event when it cannot be migrated), cancellation reaching
the worker, admission (429), auth (401) and the Admin forwarding.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import grpc
import grpc.aio
import openai
import pytest
from grpc_health.v1 import health, health_pb2_grpc
from prometheus_client import CollectorRegistry
from tokenizers import Tokenizer as HFTokenizer
from tokenizers import decoders, models, pre_tokenizers, trainers

from blitzmesh.v1 import (
    admin_pb2,
    admin_pb2_grpc,
    common_pb2,
    global_manager_pb2,
    global_manager_pb2_grpc,
    inference_pb2,
    inference_pb2_grpc,
    kv_pb2,
    param_manager_pb2,
    param_manager_pb2_grpc,
    worker_pb2,
    worker_pb2_grpc,
)
from services.common.grpc_util import MOVED_METADATA_KEY
from services.common.prefix import block_hashes
from services.common.server import ServeContext, serve, wait_for_serving
from services.common.waiting import wait_until
from services.gateway.config import GatewayConfig
from services.gateway.service import GatewayService
from services.model_format.tokenizer import Tokenizer
from tests.integration.conftest import plaintext

pytestmark = [pytest.mark.timeout(20), pytest.mark.filterwarnings("error")]

MODEL = "tiny-chat"
MAX_CONTEXT = 128
# Non-ASCII on purpose: byte-level BPE splits these characters across tokens.
REPLY = "Hello there, friend. The café answer is 42 ☕ STOP and then more words follow."
CORPUS = [
    REPLY,
    "hello world, the quick brown fox jumps over the lazy dog",
    "<|system|>\nYou are terse.\n<|user|>\nSay hi\n<|assistant|>\n",
    "What is the answer? Tell me a story about a café.",
]


# ---- upstream fakes --------------------------------------------------------------------------


class FakeWorker(worker_pb2_grpc.WorkerServicer):
    """Streams the token ids of REPLY, one per message; tests script failures and delays. A
    migrated request (resume_token_ids) continues the script after the tokens it brings, as a
    real worker continues a greedy stream."""

    def __init__(self, instance_id: str, reply_ids: list[int]) -> None:
        self.instance_id = instance_id
        self.reply_ids = reply_ids
        self.fail_code: grpc.StatusCode | None = None  # fail before any token
        self.die_after: int | None = None  # fail with UNAVAILABLE after this many tokens
        self.stall_after: int | None = None  # go silent (alive, no more tokens) after this many
        self.abort_after: int | None = None  # end with finish_reason ABORT (a drain) after this many
        self.migrate_after: int | None = None  # leave with the KV (live migration) after this many
        self.release = False  # release the request before its first token, as rebalancing does
        self.gate: asyncio.Event | None = None  # hold the first token until set
        self.delay_s = 0.0
        # Sent on every message of a request it prefills, as a real worker reports its prefix-cache
        # hits; a request whose KV it pulls (decode_from_kv) gets none, as from a real worker.
        self.cached_tokens: int | None = None
        self.requests: list[worker_pb2.WorkerGenerateRequest] = []
        self.started = asyncio.Event()
        self.cancelled = asyncio.Event()
        self.aborts: list[str] = []

    async def Generate(self, request, context):
        self.requests.append(request)
        self.started.set()
        if self.fail_code is not None:
            await context.abort(self.fail_code, f"{self.instance_id} is draining")
        if self.release:
            self.release = False
            context.set_trailing_metadata(((MOVED_METADATA_KEY, "rebalance"),))
            await context.abort(grpc.StatusCode.ABORTED, f"{self.instance_id} released the queued request")
        try:
            if request.WhichOneof("mode") == "zigzag_first_layers":
                # A loading instance: its part ends when the partner relays the request.
                yield worker_pb2.WorkerGenerateResponse(zigzag_layers=1)
                return
            if self.gate is not None:
                await self.gate.wait()
            budget = request.sampling.max_tokens
            n = min(budget, len(self.reply_ids))
            for i in range(len(request.resume_token_ids), n):
                if self.die_after is not None and i == self.die_after:
                    await context.abort(grpc.StatusCode.UNAVAILABLE, f"{self.instance_id} lost its accelerator")
                if self.stall_after is not None and i == self.stall_after:
                    await asyncio.Event().wait()
                if self.migrate_after is not None and i == self.migrate_after:
                    self.migrate_after = None
                    desc = handoff_descriptor(self.instance_id, request)
                    desc.num_tokens = len(request.prompt_token_ids) + i - 1
                    yield worker_pb2.WorkerGenerateResponse(kv_handoff=desc)
                    return
                if self.abort_after is not None and i == self.abort_after:
                    yield worker_pb2.WorkerGenerateResponse(
                        prompt_tokens=len(request.prompt_token_ids),
                        completion_tokens=i,
                        finish_reason=common_pb2.FINISH_REASON_ABORT,
                    )
                    return
                if self.delay_s:
                    await asyncio.sleep(self.delay_s)
                msg = worker_pb2.WorkerGenerateResponse(
                    token_ids=[self.reply_ids[i]],
                    prompt_tokens=len(request.prompt_token_ids),
                    completion_tokens=i + 1,
                )
                if self.cached_tokens is not None and request.WhichOneof("mode") != "decode_from_kv":
                    msg.cached_tokens = self.cached_tokens
                if request.WhichOneof("mode") in ("prefill_handoff", "zigzag_partner_handoff") and i < n - 1:
                    # A prefill instance: the first token, then the prompt's KV is offered.
                    msg.kv_handoff.CopyFrom(handoff_descriptor(self.instance_id, request))
                    yield msg
                    return
                if i == n - 1:
                    # The reply ends with eos; running out of budget first is "length".
                    eos = n == len(self.reply_ids)
                    msg.finish_reason = common_pb2.FINISH_REASON_STOP if eos else common_pb2.FINISH_REASON_LENGTH
                yield msg
        except asyncio.CancelledError:
            self.cancelled.set()
            raise

    async def Abort(self, request, context):
        self.aborts.append(request.request_id)
        return worker_pb2.AbortResponse(found=True)


def handoff_descriptor(instance_id: str, request: worker_pb2.WorkerGenerateRequest) -> kv_pb2.KVTransferDescriptor:
    return kv_pb2.KVTransferDescriptor(
        transfer_id=f"{instance_id}/{request.request_id}",
        request_id=request.request_id,
        model_id=request.model_id,
        layer_start=0,
        layer_end=2,
        num_tokens=len(request.prompt_token_ids),
        block_size=16,
        num_kv_heads=1,
        head_dim=8,
        dtype="float32",
        producer_address=instance_id.encode(),
        size_bytes=1024,
    )


class FakeGlobalManager(global_manager_pb2_grpc.GlobalManagerServicer):
    """Routes to the first registered instance that is not excluded; with `roles` set, a
    [prefill, decode] route of the first of each role not excluded, as a disaggregated
    deployment's manager does (one hop to what is left when a pool is gone)."""

    def __init__(self) -> None:
        self.instances: list[tuple[str, str]] = []
        self.schedules: list[global_manager_pb2.ScheduleRequest] = []
        self.roles: dict[str, int] = {}
        self.route: list[global_manager_pb2.RouteHop] | None = None  # a fixed route, when set
        self.reports: list[global_manager_pb2.ReportInstanceFailureRequest] = []
        self.suspect: set[str] = set()

    async def ReportInstanceFailure(self, request, context):
        # As the manager does: a reported instance is suspect, and no route goes there until it
        # registers again (`Cluster.add_worker`).
        self.reports.append(request)
        self.suspect.add(request.instance_id)
        return global_manager_pb2.ReportInstanceFailureResponse(known=True)

    def _first(self, request: global_manager_pb2.ScheduleRequest, role: int) -> global_manager_pb2.RouteHop | None:
        for instance_id, address in self.instances:
            if instance_id not in request.exclude_instance_ids and self.roles.get(instance_id) == role:
                return global_manager_pb2.RouteHop(instance_id=instance_id, address=address, role=role)
        return None

    async def Schedule(self, request, context):
        self.schedules.append(request)
        if request.model_id != MODEL:
            await context.abort(grpc.StatusCode.NOT_FOUND, f"unknown model {request.model_id!r}")
        if self.route is not None and not request.exclude_instance_ids:
            return global_manager_pb2.Route(request_id=request.request_id, hops=self.route)
        prefill = self._first(request, common_pb2.INSTANCE_ROLE_PREFILL)
        decode = self._first(request, common_pb2.INSTANCE_ROLE_DECODE)
        if prefill is not None and decode is not None:
            return global_manager_pb2.Route(request_id=request.request_id, hops=[prefill, decode])
        for instance_id, address in self.instances:
            if instance_id not in request.exclude_instance_ids and instance_id not in self.suspect:
                hop = global_manager_pb2.RouteHop(instance_id=instance_id, address=address)
                return global_manager_pb2.Route(request_id=request.request_id, hops=[hop])
        await context.abort(grpc.StatusCode.UNAVAILABLE, f"no SERVING instance of {request.model_id!r}")

    async def GetCluster(self, request, context):
        return admin_pb2.ClusterState(
            instances=[common_pb2.InstanceInfo(instance_id=i, address=a) for i, a in self.instances],
            policy="heteroscale",
        )

    async def Scale(self, request, context):
        if request.delta == 0:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "delta=0 does nothing")
        return admin_pb2.ScaleResponse(instance_ids=["w-new"], reason=f"manual {request.delta:+d}")

    async def SetPolicy(self, request, context):
        return admin_pb2.SetPolicyResponse(policy=request.policy, params=request.params)

    async def WatchEvents(self, request, context):
        for i in range(3):
            yield admin_pb2.ClusterEvent(time_s=float(i), action="instance_state", target=f"w-{i}")


class FakeParamManager(param_manager_pb2_grpc.ParamManagerServicer):
    def __init__(self, files: dict[str, bytes]) -> None:
        self.files = files
        self.file_requests = 0

    async def ListModels(self, request, context):
        return admin_pb2.ListModelsResponse(
            models=[
                common_pb2.ModelInfo(model_id=MODEL, max_context=MAX_CONTEXT, num_layers=2, created_unix_s=1700000000)
            ]
        )

    async def GetModelFiles(self, request, context):
        self.file_requests += 1
        if request.model_id != MODEL:
            await context.abort(grpc.StatusCode.NOT_FOUND, f"unknown model {request.model_id!r}")
        return param_manager_pb2.ModelFiles(files=self.files)


def write_model_files(directory: Path) -> dict[str, bytes]:
    """A small byte-level BPE tokenizer trained here, plus the config the gateway reads."""
    tok = HFTokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=320, special_tokens=["<s>", "</s>"], initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    tok.train_from_iterator(CORPUS * 4, trainer)
    tok.save(str(directory / "tokenizer.json"))
    (directory / "tokenizer_config.json").write_text(json.dumps({"bos_token": "<s>", "eos_token": "</s>"}))
    config = {"max_position_embeddings": MAX_CONTEXT, "vocab_size": tok.get_vocab_size()}
    (directory / "config.json").write_text(json.dumps(config))
    return {
        name: (directory / name).read_bytes() for name in ("tokenizer.json", "tokenizer_config.json", "config.json")
    }


async def start_server(*adders: Callable[[grpc.aio.Server], None]) -> tuple[grpc.aio.Server, str]:
    server = grpc.aio.server()
    for add in adders:
        add(server)
    servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    return server, f"127.0.0.1:{port}"


@dataclass
class Cluster:
    gm: FakeGlobalManager
    pm: FakeParamManager
    gm_address: str
    pm_address: str
    tokenizer: Tokenizer
    reply_ids: list[int]
    workers: dict[str, FakeWorker] = field(default_factory=dict)
    worker_servers: dict[str, grpc.aio.Server] = field(default_factory=dict)

    async def add_worker(self, instance_id: str) -> FakeWorker:
        worker = FakeWorker(instance_id, self.reply_ids)
        server, address = await start_server(lambda s: worker_pb2_grpc.add_WorkerServicer_to_server(worker, s))
        self.workers[instance_id] = worker
        self.worker_servers[instance_id] = server
        self.gm.instances.append((instance_id, address))
        self.gm.suspect.discard(instance_id)
        return worker


@dataclass
class Gateway:
    service: GatewayService
    http: str
    grpc_address: str
    stop: asyncio.Event
    task: asyncio.Task[None]


@pytest.fixture
async def cluster(tmp_path: Path) -> AsyncIterator[Cluster]:
    files = write_model_files(tmp_path)
    tokenizer = Tokenizer(tmp_path)
    reply_ids = tokenizer.encode(REPLY, add_special_tokens=False)
    gm, pm = FakeGlobalManager(), FakeParamManager(files)
    gm_server, gm_address = await start_server(
        lambda s: global_manager_pb2_grpc.add_GlobalManagerServicer_to_server(gm, s)
    )
    pm_server, pm_address = await start_server(
        lambda s: param_manager_pb2_grpc.add_ParamManagerServicer_to_server(pm, s)
    )
    c = Cluster(gm, pm, gm_address, pm_address, tokenizer, reply_ids)
    try:
        yield c
    finally:
        for server in (*c.worker_servers.values(), gm_server, pm_server):
            await server.stop(0)


@pytest.fixture
async def start_gateway(cluster: Cluster) -> AsyncIterator[Callable[..., Awaitable[Gateway]]]:
    stops: list[tuple[asyncio.Event, asyncio.Task[None]]] = []

    async def start(**overrides: Any) -> Gateway:
        overrides.setdefault("shutdown_grace_s", 0.5)
        cfg = GatewayConfig(
            port=0,
            http_port=0,
            global_manager=cluster.gm_address,
            param_manager=cluster.pm_address,
            **overrides,
        )
        service = GatewayService(cfg, registry=CollectorRegistry())
        bound: asyncio.Future[ServeContext] = asyncio.get_running_loop().create_future()

        async def on_bound(ctx: ServeContext) -> None:
            bound.set_result(ctx)

        stop = asyncio.Event()
        task = asyncio.create_task(serve(service, plaintext(cfg), stop_event=stop, on_bound=on_bound))
        stops.append((stop, task))
        ctx = await asyncio.wait_for(bound, 5)
        await wait_for_serving(ctx.address, 5)
        return Gateway(service, f"http://127.0.0.1:{ctx.extra_ports['http_port']}", ctx.address, stop, task)

    try:
        yield start
    finally:
        for stop, task in stops:
            stop.set()
            await task


async def post(url: str, body: Any, headers: dict[str, str] | None = None) -> tuple[int, Any]:
    async with aiohttp.ClientSession() as session, session.post(url, json=body, headers=headers) as resp:
        return resp.status, await resp.json()


async def get_json(url: str) -> tuple[int, Any]:
    async with aiohttp.ClientSession() as session, session.get(url) as resp:
        return resp.status, await resp.json()


async def sse_events(url: str, body: Any) -> list[Any]:
    """Every `data:` payload of an SSE response, parsed; checks the framing on the way."""
    async with aiohttp.ClientSession() as session, session.post(url, json=body) as resp:
        assert resp.status == 200, await resp.text()
        assert resp.headers["Content-Type"].startswith("text/event-stream")
        raw = (await resp.read()).decode()
    frames = raw.split("\n\n")
    assert frames[-1] == "", f"stream must end with a blank line: {raw[-40:]!r}"
    out: list[Any] = []
    for frame in frames[:-1]:
        assert frame.startswith("data: "), frame
        payload = frame[len("data: ") :]
        out.append(payload if payload == "[DONE]" else json.loads(payload))
    assert out[-1] == "[DONE]"
    return out


def chat_body(**extra: Any) -> dict[str, Any]:
    return {"model": MODEL, "messages": [{"role": "user", "content": "Say hi"}], **extra}


def chat_prompt_tokens(cluster: Cluster, content: str = "Say hi") -> int:
    return len(cluster.tokenizer.encode_chat([{"role": "user", "content": content}]))


def usage_body(prompt: int, completion: int, cached: int = 0) -> dict[str, Any]:
    """An OpenAI `usage` object as the gateway sends it."""
    return {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
        "prompt_tokens_details": {"cached_tokens": cached},
    }


# ---- the OpenAI HTTP API -----------------------------------------------------------------------


async def test_openai_client_streams_chat_with_usage(cluster: Cluster, start_gateway) -> None:
    await cluster.add_worker("w-1")
    gw = await start_gateway()
    client = openai.AsyncOpenAI(base_url=gw.http + "/v1", api_key="unused", max_retries=0)
    try:
        stream = await client.chat.completions.create(
            model=MODEL,
            messages=[{"role": "user", "content": "Say hi"}],
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
        models = await client.models.list()
    finally:
        await client.close()
    assert text == REPLY
    assert finish == "stop"
    assert usage is not None
    assert usage.prompt_tokens == chat_prompt_tokens(cluster)
    assert usage.completion_tokens == len(cluster.reply_ids)
    assert usage.total_tokens == usage.prompt_tokens + usage.completion_tokens
    assert [m.id for m in models.data] == [MODEL]
    # The worker got exactly the tokens of the rendered chat prompt.
    assert len(cluster.workers["w-1"].requests[0].prompt_token_ids) == usage.prompt_tokens


async def test_openai_client_completion_length_and_params(cluster: Cluster, start_gateway) -> None:
    worker = await cluster.add_worker("w-1")
    gw = await start_gateway()
    client = openai.AsyncOpenAI(base_url=gw.http + "/v1", api_key="unused", max_retries=0)
    try:
        done = await client.completions.create(
            model=MODEL, prompt="Hello", max_tokens=5, temperature=0.5, top_p=0.9, seed=7, extra_body={"top_k": 3}
        )
    finally:
        await client.close()
    assert done.choices[0].finish_reason == "length"
    metrics = await _get_text(gw.http + "/metrics")
    assert 'blitzmesh_gateway_requests_total{api="http",outcome="length"} 1.0' in metrics
    assert 'blitzmesh_gateway_tokens_total{kind="completion"} 5.0' in metrics
    assert done.choices[0].text == cluster.tokenizer.decode(cluster.reply_ids[:5])
    assert done.usage is not None
    assert (done.usage.prompt_tokens, done.usage.completion_tokens) == (len(cluster.tokenizer.encode("Hello")), 5)
    sampling = worker.requests[0].sampling
    assert sampling.max_tokens == 5 and sampling.seed == 7 and sampling.top_k == 3
    assert sampling.temperature == pytest.approx(0.5) and sampling.top_p == pytest.approx(0.9)


async def test_schedule_carries_the_prompts_block_hashes(cluster: Cluster, start_gateway) -> None:
    """For prefix-affinity routing: the chained hashes of the prompt's first full KV blocks."""
    worker = await cluster.add_worker("w-1")
    gw = await start_gateway(prefix_routing_max_blocks=2)
    client = openai.AsyncOpenAI(base_url=gw.http + "/v1", api_key="unused", max_retries=0)
    try:
        await client.completions.create(model=MODEL, prompt="Hello there " * 12, max_tokens=2)
        await client.completions.create(model=MODEL, prompt="Hi", max_tokens=2)
    finally:
        await client.close()
    long_ids, short_ids = (list(r.prompt_token_ids) for r in worker.requests)
    assert len(long_ids) > 3 * 16
    assert list(cluster.gm.schedules[0].prefix_block_hashes) == block_hashes(long_ids, 16)[:2]
    assert len(short_ids) < 16 and list(cluster.gm.schedules[1].prefix_block_hashes) == []


async def test_sse_shape_of_completions(cluster: Cluster, start_gateway) -> None:
    await cluster.add_worker("w-1")
    gw = await start_gateway()
    events = await sse_events(gw.http + "/v1/completions", {"model": MODEL, "prompt": "Hi", "stream": True})
    chunks = events[:-1]
    assert all(c["object"] == "text_completion" and c["model"] == MODEL for c in chunks)
    assert len({c["id"] for c in chunks}) == 1
    assert "".join(c["choices"][0]["text"] for c in chunks) == REPLY
    assert [c["choices"][0]["finish_reason"] for c in chunks][-1] == "stop"
    assert all(c["choices"][0]["finish_reason"] is None for c in chunks[:-1])
    assert all("usage" not in c for c in chunks)  # only with stream_options.include_usage


async def test_sse_shape_of_chat_with_usage(cluster: Cluster, start_gateway) -> None:
    await cluster.add_worker("w-1")
    gw = await start_gateway()
    events = await sse_events(
        gw.http + "/v1/chat/completions", chat_body(stream=True, stream_options={"include_usage": True})
    )
    chunks = events[:-1]
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert all(c["object"] == "chat.completion.chunk" for c in chunks)
    usage_chunk = chunks[-1]
    assert usage_chunk["choices"] == []
    assert usage_chunk["usage"]["completion_tokens"] == len(cluster.reply_ids)
    assert usage_chunk["usage"]["prompt_tokens"] == chat_prompt_tokens(cluster)
    assert chunks[-2]["choices"][0] == {"index": 0, "delta": {}, "logprobs": None, "finish_reason": "stop"}
    assert all(c["usage"] is None for c in chunks[:-1])
    assert "".join(c["choices"][0]["delta"].get("content", "") for c in chunks[:-1]) == REPLY


# ---- the benchmark clients: GuideLLM, `vllm bench serve`, AIPerf ----------------------------------
# Bodies as their request builders write them (GuideLLM 0.8 backends/openai/request_handlers.py,
# vllm/benchmarks/lib/endpoint_request_func.py, AIPerf endpoints/openai_*.py with the
# `--extra-inputs min_tokens:N ignore_eos:true` of its tutorial).

CONTINUOUS_USAGE = {"include_usage": True, "continuous_usage_stats": True}


def check_usage_so_far(cluster: Cluster, chunks: list[Any], prompt_tokens: int, text_of: Callable[[Any], str]) -> None:
    """Each content chunk's usage: the prompt, the completion tokens up to it (strictly growing,
    and covering the text sent so far), their total."""
    counts, text = [], ""
    for c in chunks:
        usage = c["usage"]
        text += text_of(c["choices"][0])
        assert usage["prompt_tokens"] == prompt_tokens, c
        assert usage["total_tokens"] == prompt_tokens + usage["completion_tokens"], c
        assert cluster.tokenizer.decode(cluster.reply_ids[: usage["completion_tokens"]]).startswith(text), c
        counts.append(usage["completion_tokens"])
    assert len(counts) >= 2 and counts == sorted(set(counts)) and counts[0] >= 1, counts


async def test_guidellm_chat_stream_carries_usage_on_every_chunk(cluster: Cluster, start_gateway) -> None:
    worker = await cluster.add_worker("w-1")
    gw = await start_gateway()
    body = {
        "model": MODEL,
        "stream": True,
        "stream_options": CONTINUOUS_USAGE,
        "max_completion_tokens": 12,
        "stop": None,
        "ignore_eos": True,
        "messages": [{"role": "user", "content": [{"type": "text", "text": "Say hi"}]}],
    }
    role, *content, finish, final = (await sse_events(gw.http + "/v1/chat/completions", body))[:-1]
    prompt = chat_prompt_tokens(cluster)
    assert role["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert role["usage"] == usage_body(prompt, 0)
    check_usage_so_far(cluster, content, prompt, lambda choice: choice["delta"]["content"])
    assert finish["choices"][0]["finish_reason"] == "length"
    assert finish["usage"] == usage_body(prompt, 12)
    assert final["choices"] == [] and final["usage"] == finish["usage"]  # the final usage matches
    sampling = worker.requests[0].sampling
    assert sampling.ignore_eos and sampling.max_tokens == 12 and not sampling.stop


async def test_guidellm_completions_usage_keeps_growing_across_a_migration(cluster: Cluster, start_gateway) -> None:
    (await cluster.add_worker("w-1")).die_after = 4
    other = await cluster.add_worker("w-2")
    gw = await start_gateway()
    body = {
        "model": MODEL,
        "stream": True,
        "stream_options": CONTINUOUS_USAGE,
        "max_tokens": len(cluster.reply_ids),
        "stop": None,
        "ignore_eos": True,
        "prompt": "Hi",
    }
    *content, finish, final = (await sse_events(gw.http + "/v1/completions", body))[:-1]
    prompt = len(cluster.tokenizer.encode("Hi"))
    check_usage_so_far(cluster, content, prompt, lambda choice: choice["text"])
    assert "".join(c["choices"][0]["text"] for c in content) + finish["choices"][0]["text"] == REPLY
    assert list(other.requests[0].resume_token_ids) == cluster.reply_ids[:4]  # it did move
    n = len(cluster.reply_ids)
    assert finish["usage"]["completion_tokens"] == final["usage"]["completion_tokens"] == n
    assert final["usage"] == usage_body(prompt, n)


async def test_continuous_usage_of_n_choices_is_per_choice(cluster: Cluster, start_gateway) -> None:
    await cluster.add_worker("w-1")
    gw = await start_gateway()
    body = chat_body(n=2, max_tokens=6, stream=True, stream_options=CONTINUOUS_USAGE)
    chunks = (await sse_events(gw.http + "/v1/chat/completions", body))[:-1]
    prompt = chat_prompt_tokens(cluster)
    for i in (0, 1):
        mine = [c for c in chunks if c["choices"] and c["choices"][0]["index"] == i]
        assert mine[0]["usage"]["completion_tokens"] == 0  # the role chunk
        check_usage_so_far(cluster, mine[1:-1], prompt, lambda choice: choice["delta"]["content"])
        assert mine[-1]["choices"][0]["finish_reason"] == "length" and mine[-1]["usage"]["completion_tokens"] == 6
    assert chunks[-1]["choices"] == []
    assert chunks[-1]["usage"] == usage_body(prompt, 12)


async def test_vllm_bench_serve_bodies_are_served(cluster: Cluster, start_gateway) -> None:
    worker = await cluster.add_worker("w-1")
    gw = await start_gateway()
    status, models = await get_json(gw.http + "/v1/models")
    assert status == 200 and models["data"][0]["root"] == MODEL  # what it reads without --model
    prompt_ids = cluster.tokenizer.encode("Hi")
    completions = {
        "model": MODEL,
        "prompt": prompt_ids,  # timed_trace sends token ids; other datasets a string
        "repetition_penalty": 1.0,
        "max_tokens": 7,
        "logprobs": None,
        "stream": True,
        "stream_options": {"include_usage": True},
        "ignore_eos": True,
        "temperature": 0.0,  # --temperature 0 (extra_body)
    }
    chat = {
        "model": MODEL,
        "messages": [{"role": "user", "content": [{"type": "text", "text": "Say hi"}]}],
        "max_completion_tokens": 7,
        "stream": True,
        "stream_options": {"include_usage": True},
        "ignore_eos": True,
    }
    for path, body, prompt in (
        ("/v1/completions", completions, len(prompt_ids)),
        ("/v1/chat/completions", chat, chat_prompt_tokens(cluster)),
    ):
        chunks = (await sse_events(gw.http + path, body))[:-1]
        assert all(c["usage"] is None for c in chunks[:-1])  # no continuous_usage_stats asked
        assert chunks[-1]["usage"] == usage_body(prompt, 7)
    assert [list(r.prompt_token_ids) for r in worker.requests][0] == prompt_ids
    assert all(r.sampling.ignore_eos and r.sampling.max_tokens == 7 for r in worker.requests)


async def test_aiperf_bodies_with_min_tokens_are_served(cluster: Cluster, start_gateway) -> None:
    worker = await cluster.add_worker("w-1")
    gw = await start_gateway()
    chat = {
        "messages": [{"role": "user", "content": "Say hi"}],
        "model": MODEL,
        "stream": True,
        "max_completion_tokens": 9,
        "min_tokens": 9,
        "ignore_eos": True,
        "stream_options": {"include_usage": True},
    }
    chunks = (await sse_events(gw.http + "/v1/chat/completions", chat))[:-1]
    assert chunks[-1]["usage"]["completion_tokens"] == 9
    # Without ignore_eos, a min_tokens equal to max_tokens is honoured by setting it.
    completions = {"prompt": ["Hi"], "model": MODEL, "stream": False, "max_tokens": 9, "min_tokens": 9}
    status, done = await post(gw.http + "/v1/completions", completions)
    assert status == 200, done
    assert done["usage"]["completion_tokens"] == 9 and done["choices"][0]["finish_reason"] == "length"
    assert [(r.sampling.ignore_eos, r.sampling.max_tokens) for r in worker.requests] == [(True, 9), (True, 9)]


@pytest.mark.parametrize(
    ("extra", "param", "quoted"),
    [
        ({"min_p": 0.05}, "min_p", "min_p=0.05"),  # vllm bench serve --min-p 0.05
        ({"min_tokens": 4}, "min_tokens", "min_tokens=4"),  # below max_tokens, no ignore_eos
        ({"stream_options": {"include_usage": True, "continuous_usage_stats": 1}}, "stream_options", "1"),
    ],
)
async def test_what_cannot_be_honoured_is_a_400_naming_the_field(
    cluster: Cluster, start_gateway, extra: dict[str, Any], param: str, quoted: str
) -> None:
    worker = await cluster.add_worker("w-1")
    gw = await start_gateway()
    body = {"model": MODEL, "prompt": "Hi", "max_tokens": 8, "stream": True, **extra}
    status, reply = await post(gw.http + "/v1/completions", body)
    assert status == 400, reply
    assert reply["error"]["type"] == "invalid_request_error" and reply["error"]["param"].startswith(param)
    assert quoted in reply["error"]["message"], reply
    assert not worker.requests


async def test_stop_string_cuts_text_and_aborts_worker(cluster: Cluster, start_gateway) -> None:
    worker = await cluster.add_worker("w-1")
    worker.delay_s = 0.01  # the stop lands well before the worker would finish
    gw = await start_gateway()
    status, body = await post(gw.http + "/v1/completions", {"model": MODEL, "prompt": "Hi", "stop": ["STOP", "zzz"]})
    assert status == 200, body
    assert body["choices"][0]["text"] == REPLY[: REPLY.index("STOP")]
    assert body["choices"][0]["finish_reason"] == "stop"
    assert body["usage"]["completion_tokens"] < len(cluster.reply_ids)
    await asyncio.wait_for(worker.cancelled.wait(), 5)
    for _ in range(100):  # Abort is sent in the background right after the cancel
        if worker.aborts:
            break
        await asyncio.sleep(0.02)
    assert worker.aborts == [body["id"]]


async def test_retry_on_another_instance_before_first_token(cluster: Cluster, start_gateway) -> None:
    bad = await cluster.add_worker("w-bad")
    bad.fail_code = grpc.StatusCode.UNAVAILABLE
    await cluster.add_worker("w-good")
    gw = await start_gateway()
    events = await sse_events(gw.http + "/v1/chat/completions", chat_body(stream=True))
    assert "".join(c["choices"][0]["delta"].get("content", "") for c in events[:-1]) == REPLY
    assert [list(s.exclude_instance_ids) for s in cluster.gm.schedules] == [[], ["w-bad"]]
    metrics = await _get_text(gw.http + "/metrics")
    assert 'blitzmesh_gateway_retries_total{code="UNAVAILABLE"} 1.0' in metrics
    assert 'blitzmesh_gateway_requests_total{api="http",outcome="stop"} 1.0' in metrics
    assert "blitzmesh_gateway_ttft_seconds_count 1.0" in metrics


class _FinishReasonWorker(FakeWorker):
    """Ends its stream with the given finish_reason value instead of STOP or LENGTH."""

    def __init__(self, instance_id: str, reply_ids: list[int], finish_reason: int) -> None:
        super().__init__(instance_id, reply_ids)
        self.finish_reason = finish_reason

    async def Generate(self, request, context):
        async for msg in super().Generate(request, context):
            if msg.HasField("finish_reason"):
                msg.finish_reason = self.finish_reason  # type: ignore[assignment]
            yield msg


@pytest.mark.parametrize(
    ("finish_reason", "code"), [(common_pb2.FINISH_REASON_ABORT, "ABORTED"), (99, "INTERNAL")], ids=["abort", "unknown"]
)
async def test_worker_abort_or_unknown_finish_is_retried_elsewhere(
    cluster: Cluster, start_gateway, finish_reason: int, code: str
) -> None:
    odd = _FinishReasonWorker("w-odd", cluster.reply_ids, finish_reason)
    server, address = await start_server(lambda s: worker_pb2_grpc.add_WorkerServicer_to_server(odd, s))
    cluster.worker_servers["w-odd"] = server
    cluster.gm.instances.append(("w-odd", address))
    await cluster.add_worker("w-good")
    gw = await start_gateway()
    # One token: the odd finish arrives with the first message, before anything reached the client.
    status, body = await post(gw.http + "/v1/completions", {"model": MODEL, "prompt": "Hi", "max_tokens": 1})
    assert status == 200, body
    assert body["choices"][0]["finish_reason"] == "length"
    assert [list(s.exclude_instance_ids) for s in cluster.gm.schedules] == [[], ["w-odd"]]
    assert f'blitzmesh_gateway_retries_total{{code="{code}"}} 1.0' in await _get_text(gw.http + "/metrics")


async def test_all_instances_fail_before_first_token_is_503(cluster: Cluster, start_gateway) -> None:
    for name in ("w-1", "w-2"):
        (await cluster.add_worker(name)).fail_code = grpc.StatusCode.UNAVAILABLE
    gw = await start_gateway(retries_before_first_token=2)
    status, body = await post(gw.http + "/v1/chat/completions", chat_body())
    assert status == 503
    message = body["error"]["message"]
    assert "w-1" in message and "w-2" in message and "no SERVING instance" in message


@pytest.mark.parametrize("failure", ["dies", "stalls", "drains"])
async def test_instance_failing_mid_stream_migrates_the_stream(cluster: Cluster, start_gateway, failure: str) -> None:
    """The stream resumes on another instance from the prompt plus the 3 tokens already sent:
    the client sees the whole reply once, no error, no token repeated or missing."""
    worker = await cluster.add_worker("w-1")
    setattr(worker, {"dies": "die_after", "stalls": "stall_after", "drains": "abort_after"}[failure], 3)
    other = await cluster.add_worker("w-2")
    gw = await start_gateway(token_stall_timeout_s=0.3)
    events = await sse_events(
        gw.http + "/v1/completions",
        {"model": MODEL, "prompt": "Hi", "stream": True, "stream_options": {"include_usage": True}},
    )
    assert events[-1] == "[DONE]" and "error" not in events[-2]
    text = "".join(e["choices"][0]["text"] for e in events[:-1] if e["choices"])
    assert text == REPLY
    assert events[-2]["usage"]["completion_tokens"] == len(cluster.reply_ids)
    assert [list(s.exclude_instance_ids) for s in cluster.gm.schedules] == [[], ["w-1"]]
    assert list(other.requests[0].resume_token_ids) == cluster.reply_ids[:3]
    assert list(other.requests[0].prompt_token_ids) == list(worker.requests[0].prompt_token_ids)
    code = {"dies": "UNAVAILABLE", "stalls": "UNAVAILABLE", "drains": "ABORTED"}[failure]
    assert f'blitzmesh_gateway_migrations_total{{code="{code}"}} 1.0' in await _get_text(gw.http + "/metrics")
    if failure == "stalls":
        await wait_until(lambda: worker.aborts == [events[0]["id"]], 5, what="the stalled call aborted")


async def test_openai_client_stream_survives_a_dying_instance(cluster: Cluster, start_gateway) -> None:
    (await cluster.add_worker("w-1")).die_after = 5
    await cluster.add_worker("w-2")
    gw = await start_gateway()
    client = openai.AsyncOpenAI(base_url=gw.http + "/v1", api_key="unused", max_retries=0)
    try:
        stream = await client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "Hi"}], stream=True
        )
        text = "".join([c.choices[0].delta.content or "" async for c in stream if c.choices])
    finally:
        await client.close()
    assert text == REPLY


async def test_a_released_request_is_rerouted_without_counting_as_a_failure(cluster: Cluster, start_gateway) -> None:
    busy = await cluster.add_worker("w-busy")
    busy.release = True
    fresh = await cluster.add_worker("w-new")
    # No retries allowed: a release is a move, not a failure, so it must not need one.
    gw = await start_gateway(retries_before_first_token=0)
    status, body = await post(gw.http + "/v1/completions", {"model": MODEL, "prompt": "Hi"})
    assert status == 200 and body["choices"][0]["text"] == REPLY
    assert [list(s.exclude_instance_ids) for s in cluster.gm.schedules] == [[], ["w-busy"]]
    assert len(fresh.requests) == 1
    metrics = await _get_text(gw.http + "/metrics")
    assert 'blitzmesh_gateway_moves_total{reason="rebalance"} 1.0' in metrics
    assert "blitzmesh_gateway_retries_total{" not in metrics
    # Kept off one route only: the busy instance serves the next request again.
    status, _ = await post(gw.http + "/v1/completions", {"model": MODEL, "prompt": "Hi"})
    assert status == 200 and len(busy.requests) == 2


async def test_mid_stream_failure_with_no_instance_left_ends_with_error_event(cluster: Cluster, start_gateway) -> None:
    worker = await cluster.add_worker("w-1")
    worker.die_after = 3
    gw = await start_gateway(schedule_wait_s=0.5)
    events = await sse_events(gw.http + "/v1/completions", {"model": MODEL, "prompt": "Hi", "stream": True})
    assert events[-1] == "[DONE]"
    error = events[-2]["error"]
    assert "could not be migrated after 3 tokens" in error["message"]
    assert "w-1: UNAVAILABLE: w-1 lost its accelerator" in error["message"]
    assert "no SERVING instance" in error["message"]
    # It waited for a route before giving up, and says for how long and for what.
    assert "waited 0." in error["message"] and "(up to schedule_wait_s=0.5) for a SERVING instance" in error["message"]
    assert error["type"] == "server_error"
    text = "".join(e["choices"][0]["text"] for e in events[:-2])
    assert text == cluster.tokenizer.decode(cluster.reply_ids[:3])

    # The official client surfaces the in-band error as an exception, not a silent end. (w-1
    # registers again first, as a restarted worker does: the report made it suspect.)
    assert cluster.gm.suspect == {"w-1"}
    cluster.gm.suspect.discard("w-1")
    client = openai.AsyncOpenAI(base_url=gw.http + "/v1", api_key="unused", max_retries=0)
    try:
        with pytest.raises(openai.APIError, match="could not be migrated"):
            stream = await client.completions.create(model=MODEL, prompt="Hi", stream=True)
            async for _ in stream:
                pass
    finally:
        await client.close()


async def _wait_for(condition: Callable[[], bool], timeout_s: float, what: str) -> None:
    deadline = asyncio.get_running_loop().time() + timeout_s
    while not condition():
        assert asyncio.get_running_loop().time() < deadline, f"no {what} within {timeout_s}s"
        await asyncio.sleep(0.01)


async def test_streams_on_the_only_instance_wait_for_capacity_and_resume_exactly(
    cluster: Cluster, start_gateway
) -> None:
    """Issue 24: the only instance dies mid-stream. The stream and a request sent after it are
    held (not failed) while no instance serves, the manager hears of the failure at once, and
    when an instance is back both complete: the stream keeps its tokens so far and resumes from
    them, so the client sees the exact reply."""
    (await cluster.add_worker("w-1")).die_after = 3
    gw = await start_gateway(schedule_wait_s=30)
    stream = asyncio.create_task(
        sse_events(gw.http + "/v1/completions", {"model": MODEL, "prompt": "Hi", "stream": True})
    )
    await _wait_for(lambda: any(list(s.exclude_instance_ids) == ["w-1"] for s in cluster.gm.schedules), 10, "re-route")
    late = asyncio.create_task(post(gw.http + "/v1/completions", {"model": MODEL, "prompt": "Hi"}))
    # Both are waiting now: the late request has asked for a route too, and been told none serves.
    await _wait_for(lambda: len({s.request_id for s in cluster.gm.schedules}) >= 2, 10, "the late request's route")
    assert not stream.done() and not late.done()
    assert [(r.instance_id, r.reason) for r in cluster.gm.reports] == [("w-1", "UNAVAILABLE: w-1 lost its accelerator")]
    cluster.gm.instances.remove(next(i for i in cluster.gm.instances if i[0] == "w-1"))
    fresh = await cluster.add_worker("w-2")
    events = await asyncio.wait_for(stream, 10)
    assert events[-1] == "[DONE]" and "error" not in events[-2], events[-2]
    assert "".join(e["choices"][0]["text"] for e in events[:-1] if e.get("choices")) == REPLY
    resumed = [r for r in fresh.requests if r.resume_token_ids]
    assert [list(r.resume_token_ids) for r in resumed] == [cluster.reply_ids[:3]]
    status, body = await asyncio.wait_for(late, 10)
    assert status == 200 and body["choices"][0]["text"] == REPLY


async def test_migration_limit(cluster: Cluster, start_gateway) -> None:
    for name, after in (("w-1", 2), ("w-2", 4), ("w-3", None)):
        (await cluster.add_worker(name)).die_after = after
    gw = await start_gateway(max_migrations=1)
    events = await sse_events(gw.http + "/v1/completions", {"model": MODEL, "prompt": "Hi", "stream": True})
    message = events[-2]["error"]["message"]
    assert "instance w-2 failed mid-stream after 4 tokens" in message
    assert "already migrated 1 times (max_migrations=1)" in message
    assert [list(s.exclude_instance_ids) for s in cluster.gm.schedules] == [[], ["w-1"]]


async def test_worker_process_gone_mid_stream(cluster: Cluster, start_gateway) -> None:
    worker = await cluster.add_worker("w-1")
    worker.delay_s = 0.05
    gw = await start_gateway(schedule_wait_s=0.5)  # no instance comes back: it waits that long
    async with (
        aiohttp.ClientSession() as session,
        session.post(gw.http + "/v1/completions", json={"model": MODEL, "prompt": "Hi", "stream": True}) as resp,
    ):
        assert resp.status == 200
        first = await resp.content.readuntil(b"\n\n")
        assert first.startswith(b"data: {")
        await cluster.worker_servers["w-1"].stop(0)  # the connection drops under the stream
        rest = (await asyncio.wait_for(resp.read(), 5)).decode()
    assert "could not be migrated" in rest and "w-1: UNAVAILABLE" in rest and rest.endswith("data: [DONE]\n\n")


async def test_client_disconnect_cancels_and_aborts_worker(cluster: Cluster, start_gateway) -> None:
    worker = await cluster.add_worker("w-1")
    worker.delay_s = 0.2
    gw = await start_gateway()
    async with aiohttp.ClientSession() as session:
        resp = await session.post(gw.http + "/v1/chat/completions", json=chat_body(stream=True))
        assert resp.status == 200
        await resp.content.readuntil(b"\n\n")
        resp.close()  # hang up mid-stream
    await asyncio.wait_for(worker.cancelled.wait(), 5)
    for _ in range(100):
        if worker.aborts:
            break
        await asyncio.sleep(0.02)
    assert len(worker.aborts) == 1 and worker.aborts[0].startswith("chatcmpl-")
    for _ in range(100):  # the slot comes back
        if gw.service.backend.admission.in_flight == 0:
            break
        await asyncio.sleep(0.02)
    assert gw.service.backend.admission.in_flight == 0


async def test_queue_full_is_429_and_queued_requests_run(cluster: Cluster, start_gateway) -> None:
    worker = await cluster.add_worker("w-1")
    worker.gate = asyncio.Event()
    gw = await start_gateway(max_concurrency=1, max_queue=1, queue_timeout_s=5)
    url = gw.http + "/v1/completions"
    first = asyncio.create_task(post(url, {"model": MODEL, "prompt": "Hi", "max_tokens": 2}))
    await asyncio.wait_for(worker.started.wait(), 5)
    queued = asyncio.create_task(post(url, {"model": MODEL, "prompt": "Hi", "max_tokens": 2}))
    for _ in range(100):
        if gw.service.backend.admission.waiting == 1:
            break
        await asyncio.sleep(0.01)
    async with aiohttp.ClientSession() as session, session.post(url, json={"model": MODEL, "prompt": "Hi"}) as resp:
        status, body, retry_after = resp.status, await resp.json(), resp.headers.get("Retry-After")
    assert status == 429 and retry_after == "1"  # a hint for the client: a slot frees when any request ends
    assert body["error"]["type"] == "rate_limit_error"
    assert "max_queue=1" in body["error"]["message"] and "max_concurrency=1" in body["error"]["message"]
    worker.gate.set()
    assert (await first)[0] == 200
    assert (await queued)[0] == 200


async def test_queue_timeout_is_429(cluster: Cluster, start_gateway) -> None:
    worker = await cluster.add_worker("w-1")
    worker.gate = asyncio.Event()
    gw = await start_gateway(max_concurrency=1, max_queue=4, queue_timeout_s=0.2)
    url = gw.http + "/v1/completions"
    first = asyncio.create_task(post(url, {"model": MODEL, "prompt": "Hi", "max_tokens": 2}))
    await asyncio.wait_for(worker.started.wait(), 5)
    status, body = await post(url, {"model": MODEL, "prompt": "Hi"})
    assert status == 429 and "queue_timeout_s=0.2" in body["error"]["message"]
    worker.gate.set()
    assert (await first)[0] == 200


async def test_api_keys(cluster: Cluster, start_gateway) -> None:
    await cluster.add_worker("w-1")
    gw = await start_gateway(api_keys=["sk-right-key-123"])
    url = gw.http + "/v1/chat/completions"
    status, body = await post(url, chat_body())
    assert status == 401 and "missing API key" in body["error"]["message"]
    status, body = await post(url, chat_body(), {"Authorization": "Bearer sk-wrong-key-999"})
    assert status == 401 and body["error"]["code"] == "invalid_api_key"
    assert "sk-wrong-key-999" not in body["error"]["message"]  # never echo a secret in full
    status, body = await post(url, chat_body(), {"Authorization": "Bearer sk-right-key-123"})
    assert status == 200 and body["choices"][0]["message"]["content"] == REPLY
    async with aiohttp.ClientSession() as session, session.get(gw.http + "/health") as resp:
        assert resp.status == 200  # probes carry no key

    client = openai.AsyncOpenAI(base_url=gw.http + "/v1", api_key="sk-wrong", max_retries=0)
    try:
        with pytest.raises(openai.AuthenticationError):
            await client.models.list()
    finally:
        await client.close()


async def test_http_errors_have_openai_shape(cluster: Cluster, start_gateway) -> None:
    await cluster.add_worker("w-1")
    gw = await start_gateway(max_body_bytes=4096)
    url = gw.http + "/v1/completions"

    status, body = await post(url, {"model": "no-such-model", "prompt": "Hi"})
    assert status == 404 and '"no-such-model"' in body["error"]["message"] and body["error"]["param"] == "model"

    long_prompt = "hello world " * 200
    status, body = await post(url, {"model": MODEL, "prompt": "Hi", "max_tokens": 500})
    assert status == 400 and "128" in body["error"]["message"] and "max_tokens=500" in body["error"]["message"]
    assert body["error"]["code"] == "context_length_exceeded"
    status, body = await post(url, {"model": MODEL, "prompt": long_prompt[:3000]})
    assert status == 400 and "maximum context length is 128" in body["error"]["message"]

    status, body = await post(url, {"model": MODEL, "prompt": "x" * 10_000})
    assert status == 413 and "max_body_bytes=4096" in body["error"]["message"]

    async with aiohttp.ClientSession() as session:
        async with session.post(url, data=b"{not json", headers={"Content-Type": "application/json"}) as resp:
            assert resp.status == 400
            assert "not valid JSON" in (await resp.json())["error"]["message"]
        async with session.get(gw.http + "/v1/nothing") as resp:
            assert resp.status == 404 and "error" in await resp.json()

    status, body = await post(url, {"model": MODEL, "prompt": "Hi", "temperature": 3})
    assert status == 400 and body["error"]["param"] == "temperature" and "3" in body["error"]["message"]
    status, body = await post(url, {"model": MODEL, "prompt": "Hi", "n": 17})
    assert status == 400 and body["error"]["param"] == "n" and "max_n=16" in body["error"]["message"]
    # logit_bias ids are checked against the model's vocabulary (320 here), the bad one quoted.
    status, body = await post(url, {"model": MODEL, "prompt": "Hi", "logit_bias": {"5": 1, "320": -100}})
    assert status == 400 and body["error"]["param"] == "logit_bias"
    assert "logit_bias token id 320" in body["error"]["message"] and "vocab_size=320" in body["error"]["message"]


async def test_no_instance_is_503_and_health(cluster: Cluster, start_gateway) -> None:
    gw = await start_gateway()
    status, body = await post(gw.http + "/v1/chat/completions", chat_body())
    assert status == 503 and body["error"]["type"] == "service_unavailable"
    assert "no SERVING instance" in body["error"]["message"]
    async with aiohttp.ClientSession() as session, session.get(gw.http + "/health") as resp:
        assert resp.status == 200
        assert (await resp.json())["global_manager"] == "SERVING"
    metrics = await _get_text(gw.http + "/metrics")
    assert 'blitzmesh_gateway_requests_total{api="http",outcome="unavailable"} 1.0' in metrics


async def test_tokenizer_fetched_once_for_concurrent_requests(cluster: Cluster, start_gateway) -> None:
    await cluster.add_worker("w-1")
    gw = await start_gateway()
    results = await asyncio.gather(*(post(gw.http + "/v1/chat/completions", chat_body()) for _ in range(8)))
    assert all(status == 200 for status, _ in results)
    assert cluster.pm.file_requests == 1


async def test_model_chat_template_is_used_and_its_refusal_is_400(cluster: Cluster, start_gateway) -> None:
    # The parameter manager serves the model's chat_template.jinja: the gateway renders it, with the
    # control tokens it writes as ids, and a template's raise_exception becomes a 400 quoting it.
    cluster.pm.files["chat_template.jinja"] = (
        b"{% for m in messages %}{% if m['role'] == 'system' %}{{ raise_exception('No system role, sorry') }}"
        b"{% endif %}{{ bos_token + m['role'] + ': ' + m['content'] + eos_token }}{% endfor %}"
    )
    worker = await cluster.add_worker("w-1")
    gw = await start_gateway()
    url = gw.http + "/v1/chat/completions"
    status, _ = await post(url, {"model": MODEL, "messages": [{"role": "user", "content": "Say hi </s>"}]})
    assert status == 200
    tok = cluster.tokenizer
    bos, eos = tok.bos_token_id, tok.eos_token_id
    expected = [bos, *tok.encode("user: Say hi </s>", add_special_tokens=False), eos]
    assert list(worker.requests[0].prompt_token_ids) == expected
    system = {"role": "system", "content": "Be brief."}
    status, body = await post(url, {"model": MODEL, "messages": [system, {"role": "user", "content": "hi"}]})
    assert status == 400 and body["error"]["param"] == "messages"
    message = body["error"]["message"]
    assert "(chat_template.jinja) refused the conversation: No system role, sorry" in message and MODEL in message


# ---- n > 1: one worker request per choice ------------------------------------------------------


async def test_n_choices_fan_out_with_seed_plus_index(cluster: Cluster, start_gateway) -> None:
    worker = await cluster.add_worker("w-1")
    gw = await start_gateway()
    top = 2**63 - 1
    body = {"model": MODEL, "prompt": "Hi", "n": 3, "seed": top - 1, "stop": ["zzz"]}
    status, reply = await post(gw.http + "/v1/completions", body)
    assert status == 200, reply
    assert [c["index"] for c in reply["choices"]] == [0, 1, 2]
    assert all(c["text"] == REPLY and c["finish_reason"] == "stop" for c in reply["choices"])
    assert reply["usage"]["prompt_tokens"] == len(cluster.tokenizer.encode("Hi"))  # the prompt once
    assert reply["usage"]["completion_tokens"] == 3 * len(cluster.reply_ids)
    seeds = {r.request_id: r.sampling.seed for r in worker.requests}
    # Choice i samples with seed + i, wrapped into 64 bits; stop strings stay in the gateway.
    assert seeds == {f"{reply['id']}-0": top - 1, f"{reply['id']}-1": top, f"{reply['id']}-2": -(2**63)}
    assert all(not r.sampling.stop for r in worker.requests)
    metrics = await _get_text(gw.http + "/metrics")
    assert 'blitzmesh_gateway_requests_total{api="http",outcome="stop"} 1.0' in metrics


async def test_n_choices_stream_interleaved_with_one_usage(cluster: Cluster, start_gateway) -> None:
    await cluster.add_worker("w-1")
    gw = await start_gateway()
    events = await sse_events(
        gw.http + "/v1/chat/completions", chat_body(n=2, stream=True, stream_options={"include_usage": True})
    )
    chunks = events[:-1]
    assert [c["choices"][0]["delta"] for c in chunks[:2]] == [{"role": "assistant", "content": ""}] * 2
    assert [c["choices"][0]["index"] for c in chunks[:2]] == [0, 1]
    for i in (0, 1):
        mine = [c["choices"][0] for c in chunks if c["choices"] and c["choices"][0]["index"] == i]
        assert "".join(c["delta"].get("content", "") for c in mine) == REPLY
        assert [c["finish_reason"] for c in mine if c["finish_reason"]] == ["stop"]
    assert chunks[-1]["choices"] == []
    assert chunks[-1]["usage"]["completion_tokens"] == 2 * len(cluster.reply_ids)
    assert chunks[-1]["usage"]["prompt_tokens"] == chat_prompt_tokens(cluster)


async def test_n_choices_each_rerouted_before_its_first_token(cluster: Cluster, start_gateway) -> None:
    (await cluster.add_worker("w-bad")).fail_code = grpc.StatusCode.UNAVAILABLE
    good = await cluster.add_worker("w-good")
    gw = await start_gateway()
    status, reply = await post(gw.http + "/v1/completions", {"model": MODEL, "prompt": "Hi", "n": 2})
    assert status == 200 and [c["text"] for c in reply["choices"]] == [REPLY, REPLY]
    assert sorted(list(s.exclude_instance_ids) for s in cluster.gm.schedules) == [[], [], ["w-bad"], ["w-bad"]]
    assert len(good.requests) == 2


async def test_n_choices_dying_mid_stream_end_with_an_error(cluster: Cluster, start_gateway) -> None:
    worker = await cluster.add_worker("w-1")
    worker.die_after = 3
    gw = await start_gateway()
    events = await sse_events(gw.http + "/v1/completions", {"model": MODEL, "prompt": "Hi", "n": 2, "stream": True})
    assert events[-1] == "[DONE]" and "could not be migrated" in events[-2]["error"]["message"]
    backend = gw.service.backend
    await wait_until(lambda: backend.admission.in_flight == 0, 5, what="the request's slot back")


async def test_worker_without_logprobs_is_a_worker_failure(cluster: Cluster, start_gateway) -> None:
    # The scripted worker knows nothing of log-probs, like a worker from before them.
    worker = await cluster.add_worker("w-old")
    gw = await start_gateway(retries_before_first_token=0)
    status, body = await post(gw.http + "/v1/completions", {"model": MODEL, "prompt": "Hi", "logprobs": 1})
    assert status == 503 and "malformed log-probs: 0 log-prob entries for 1 tokens" in body["error"]["message"]
    await wait_until(lambda: len(worker.aborts) == 1, 5, what="the abort of the old worker's call")


async def test_n_choices_cancelled_together(cluster: Cluster, start_gateway) -> None:
    worker = await cluster.add_worker("w-1")
    worker.delay_s = 0.1
    gw = await start_gateway()
    async with aiohttp.ClientSession() as session:
        resp = await session.post(
            gw.http + "/v1/completions", json={"model": MODEL, "prompt": "Hi", "n": 3, "stream": True}
        )
        assert resp.status == 200
        await resp.content.readuntil(b"\n\n")
        request_id = resp.headers["X-Request-Id"]
        resp.close()  # hang up mid-stream: every choice's worker call must end
    backend = gw.service.backend
    await wait_until(
        lambda: len(worker.aborts) == 3 and backend.admission.in_flight == 0, 5, what="3 aborts and a free slot"
    )
    assert sorted(worker.aborts) == [f"{request_id}-{i}" for i in range(3)]


async def _get_text(url: str) -> str:
    async with aiohttp.ClientSession() as session, session.get(url) as resp:
        assert resp.status == 200
        return await resp.text()


# ---- the gRPC API --------------------------------------------------------------------------------


async def test_grpc_generate_complete_and_errors(cluster: Cluster, start_gateway) -> None:
    worker = await cluster.add_worker("w-1")
    gw = await start_gateway(api_keys=["k-1"])
    auth = (("authorization", "Bearer k-1"),)
    async with grpc.aio.insecure_channel(gw.grpc_address) as ch:
        stub = inference_pb2_grpc.InferenceStub(ch)
        req = inference_pb2.GenerateRequest(
            model=MODEL,
            messages=[inference_pb2.ChatMessage(role="user", content="Say hi")],
            request_id="sdk-1",
            return_token_ids=True,
        )
        replies = [r async for r in stub.Generate(req, metadata=auth)]
        assert "".join(r.text for r in replies) == REPLY
        assert [t for r in replies for t in r.token_ids] == cluster.reply_ids
        assert replies[-1].finish_reason == common_pb2.FINISH_REASON_STOP
        assert replies[-1].usage.completion_tokens == len(cluster.reply_ids)
        assert {r.instance_id for r in replies} == {"w-1"} and {r.request_id for r in replies} == {"sdk-1"}

        one = await stub.Complete(
            inference_pb2.GenerateRequest(model=MODEL, prompt="Hi", sampling=common_pb2.SamplingParams(max_tokens=4)),
            metadata=auth,
        )
        assert one.finish_reason == common_pb2.FINISH_REASON_LENGTH and one.usage.completion_tokens == 4

        with pytest.raises(grpc.aio.AioRpcError) as err:
            await stub.Complete(inference_pb2.GenerateRequest(model=MODEL, prompt="Hi"))
        assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED
        with pytest.raises(grpc.aio.AioRpcError) as err:
            bad = common_pb2.SamplingParams(top_p=0.0)
            await stub.Complete(inference_pb2.GenerateRequest(model=MODEL, prompt="Hi", sampling=bad), metadata=auth)
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "top_p" in (err.value.details() or "")
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await stub.Complete(inference_pb2.GenerateRequest(model="nope", prompt="Hi"), metadata=auth)
        assert err.value.code() == grpc.StatusCode.NOT_FOUND and '"nope"' in (err.value.details() or "")

        worker.die_after = 2
        with pytest.raises(grpc.aio.AioRpcError) as err:
            async for _ in stub.Generate(inference_pb2.GenerateRequest(model=MODEL, prompt="Hi"), metadata=auth):
                pass
        assert err.value.code() == grpc.StatusCode.INTERNAL
        assert "could not be migrated after 2 tokens (w-1: UNAVAILABLE" in (err.value.details() or "")


async def test_grpc_cancel_reaches_worker(cluster: Cluster, start_gateway) -> None:
    worker = await cluster.add_worker("w-1")
    worker.delay_s = 0.2
    gw = await start_gateway()
    async with grpc.aio.insecure_channel(gw.grpc_address) as ch:
        stub = inference_pb2_grpc.InferenceStub(ch)
        call = stub.Generate(inference_pb2.GenerateRequest(model=MODEL, prompt="Hi", request_id="sdk-cancel"))
        await call.read()
        call.cancel()
    await asyncio.wait_for(worker.cancelled.wait(), 5)
    for _ in range(100):
        if worker.aborts:
            break
        await asyncio.sleep(0.02)
    assert worker.aborts == ["sdk-cancel"]


async def test_grpc_admin_forwards(cluster: Cluster, start_gateway) -> None:
    await cluster.add_worker("w-1")
    gw = await start_gateway()
    async with grpc.aio.insecure_channel(gw.grpc_address) as ch:
        admin = admin_pb2_grpc.AdminStub(ch)
        models = await admin.ListModels(admin_pb2.ListModelsRequest())
        assert [m.model_id for m in models.models] == [MODEL]
        state = await admin.GetCluster(admin_pb2.GetClusterRequest())
        assert state.policy == "heteroscale" and [i.instance_id for i in state.instances] == ["w-1"]
        scaled = await admin.Scale(admin_pb2.ScaleRequest(model_id=MODEL, delta=2))
        assert scaled.reason == "manual +2"
        policy = await admin.SetPolicy(admin_pb2.SetPolicyRequest(policy="latency", params={"ttft_s": "1"}))
        assert policy.policy == "latency" and dict(policy.params) == {"ttft_s": "1"}
        events = [e async for e in admin.WatchEvents(admin_pb2.WatchEventsRequest())]
        assert [e.target for e in events] == ["w-0", "w-1", "w-2"]
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await admin.Scale(admin_pb2.ScaleRequest(model_id=MODEL, delta=0))
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "delta=0" in (err.value.details() or "")


async def test_many_cancelled_requests_leak_nothing(cluster: Cluster, start_gateway) -> None:
    worker = await cluster.add_worker("w-1")
    worker.delay_s = 0.05
    gw = await start_gateway(max_concurrency=4, max_queue=16)

    async def one() -> None:
        async with aiohttp.ClientSession() as session:
            resp = await session.post(
                gw.http + "/v1/completions", json={"model": MODEL, "prompt": "Hi", "stream": True}
            )
            await resp.content.readuntil(b"\n\n")
            resp.close()

    await asyncio.gather(*(one() for _ in range(4)))
    backend = gw.service.backend
    for _ in range(200):
        if backend.admission.in_flight == 0 and backend.admission.waiting == 0 and len(worker.aborts) == 4:
            break
        await asyncio.sleep(0.02)
    assert (backend.admission.in_flight, backend.admission.waiting, len(worker.aborts)) == (0, 0, 4)
    metrics = await _get_text(gw.http + "/metrics")
    assert 'blitzmesh_gateway_requests_total{api="http",outcome="cancelled"} 4.0' in metrics


async def test_shutdown_lets_inflight_streams_finish(cluster: Cluster, start_gateway) -> None:
    worker = await cluster.add_worker("w-1")
    worker.delay_s = 0.01
    gw = await start_gateway(shutdown_grace_s=5)
    async with grpc.aio.insecure_channel(gw.grpc_address) as ch:
        call = inference_pb2_grpc.InferenceStub(ch).Generate(inference_pb2.GenerateRequest(model=MODEL, prompt="Hi"))
        first = await call.read()
        gw.stop.set()  # SIGTERM while the stream runs
        rest = []
        while (reply := await call.read()) is not grpc.aio.EOF:
            rest.append(reply)
    assert first.text + "".join(r.text for r in rest) == REPLY
    assert rest[-1].finish_reason == common_pb2.FINISH_REASON_STOP
    await asyncio.wait_for(gw.task, 5)


# ---- prefill/decode disaggregation -------------------------------------------------------------


async def pd_cluster(cluster: Cluster, decodes: int = 1) -> tuple[FakeWorker, list[FakeWorker]]:
    prefill = await cluster.add_worker("p0")
    cluster.gm.roles["p0"] = common_pb2.INSTANCE_ROLE_PREFILL
    decode = []
    for i in range(decodes):
        decode.append(await cluster.add_worker(f"d{i}"))
        cluster.gm.roles[f"d{i}"] = common_pb2.INSTANCE_ROLE_DECODE
    return prefill, decode


async def test_a_disaggregated_route_streams_prefill_then_decode_as_one(cluster: Cluster, start_gateway) -> None:
    """The gateway runs the prompt on the prefill hop with kv_handoff, then the decode hop with
    the offer it got back and the first token as resumed; the client sees one stream."""
    (prefill, (decode,)), gw = await pd_cluster(cluster), await start_gateway()
    async with openai.AsyncOpenAI(base_url=f"{gw.http}/v1", api_key="unused") as client:
        stream = await client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "Say hi"}], stream=True, max_tokens=64
        )
        text = "".join([c.choices[0].delta.content or "" async for c in stream if c.choices])
    assert text == REPLY
    (p_req,), (d_req,) = prefill.requests, decode.requests
    assert p_req.WhichOneof("mode") == "prefill_handoff" and not p_req.resume_token_ids
    assert d_req.WhichOneof("mode") == "decode_from_kv" and list(d_req.resume_token_ids) == cluster.reply_ids[:1]
    assert d_req.decode_from_kv.transfer_id == f"p0/{p_req.request_id}"
    assert list(d_req.prompt_token_ids) == list(p_req.prompt_token_ids)
    metrics = await fetch_text(f"{gw.http}/metrics")
    assert 'blitzmesh_gateway_kv_handoffs_total{outcome="handed_off"} 1.0' in metrics


async def test_a_request_ending_on_its_first_token_never_reaches_decode(cluster: Cluster, start_gateway) -> None:
    (prefill, (decode,)), gw = await pd_cluster(cluster), await start_gateway()
    status, body = await post(f"{gw.http}/v1/chat/completions", chat_body(max_tokens=1))
    assert status == 200 and body["choices"][0]["finish_reason"] == "length"
    assert len(prefill.requests) == 1 and not decode.requests
    assert body["usage"]["completion_tokens"] == 1


async def test_a_decode_instance_dying_mid_stream_migrates_to_another(cluster: Cluster, start_gateway) -> None:
    """The decode side fails after 5 tokens: the stream resumes on the other decode instance
    from prompt + tokens so far (recomputed there, no KV source), and the text is whole."""
    (prefill, (d0, d1)), gw = await pd_cluster(cluster, decodes=2), await start_gateway()
    d0.die_after = 5
    status, body = await post(f"{gw.http}/v1/chat/completions", chat_body(max_tokens=64))
    assert status == 200, body
    assert body["choices"][0]["message"]["content"] == REPLY
    assert len(prefill.requests) == 1 and len(d0.requests) == 1 and len(d1.requests) == 1
    (resumed,) = d1.requests
    assert list(resumed.resume_token_ids) == cluster.reply_ids[:5] and resumed.WhichOneof("mode") == "colocated"
    assert list(cluster.gm.schedules[-1].exclude_instance_ids) == ["d0"]


async def test_a_prefill_instance_failing_before_its_token_is_retried(cluster: Cluster, start_gateway) -> None:
    (p0, (decode,)), gw = await pd_cluster(cluster), await start_gateway()
    p0.fail_code = grpc.StatusCode.UNAVAILABLE
    p1 = await cluster.add_worker("p1")
    cluster.gm.roles["p1"] = common_pb2.INSTANCE_ROLE_PREFILL
    status, body = await post(f"{gw.http}/v1/chat/completions", chat_body(max_tokens=64))
    assert status == 200 and body["choices"][0]["message"]["content"] == REPLY
    assert len(p1.requests) == 1 and p1.requests[0].WhichOneof("mode") == "prefill_handoff"
    assert decode.requests[0].decode_from_kv.transfer_id.startswith("p1/")


async def fetch_text(url: str) -> str:
    async with aiohttp.ClientSession() as session, session.get(url) as resp:
        return await resp.text()


async def test_a_live_migrated_stream_resumes_elsewhere_with_its_kv(cluster: Cluster, start_gateway) -> None:
    """A worker releases a running request with its KV (no token, a kv_handoff): the gateway
    resumes it on another instance with that KV source and the tokens so far; one stream."""
    w0, w1 = await cluster.add_worker("w0"), await cluster.add_worker("w1")
    w0.migrate_after = 6
    gw = await start_gateway()
    status, body = await post(f"{gw.http}/v1/chat/completions", chat_body(max_tokens=64))
    assert status == 200 and body["choices"][0]["message"]["content"] == REPLY
    (resumed,) = w1.requests
    assert list(resumed.resume_token_ids) == cluster.reply_ids[:6]
    assert (
        resumed.decode_from_kv.transfer_id.startswith("w0/")
        and resumed.decode_from_kv.num_tokens == len(resumed.prompt_token_ids) + 5
    )
    # A move, not a failure: w0 is not excluded for good, only for that route.
    assert list(cluster.gm.schedules[-1].exclude_instance_ids) == ["w0"]
    metrics = await fetch_text(f"{gw.http}/metrics")
    assert 'blitzmesh_gateway_moves_total{reason="live_migration"} 1.0' in metrics


@pytest.mark.parametrize(
    ("path", "cached"),
    [
        ("prefill_decode", 4),  # the decode side pulls the KV and reports none: the prefill's count
        ("live_migration", 4),  # the next instance pulls the KV: the first instance's count
        ("retried", 2),  # the next instance prefills prompt + tokens so far again: its own count
    ],
)
@pytest.mark.parametrize("stream", [False, True])
async def test_cached_tokens_are_those_of_the_last_prefill(
    cluster: Cluster, start_gateway, path: str, cached: int, stream: bool
) -> None:
    """usage.prompt_tokens_details.cached_tokens is what the last instance that prefilled the
    prompt reported: an instance that pulled the KV (P/D decode, live migration) changes nothing;
    one that computed it again (a retry elsewhere) counts anew."""
    if path == "prefill_decode":
        (first, (second,)) = await pd_cluster(cluster)
    else:
        first, second = await cluster.add_worker("w0"), await cluster.add_worker("w1")
        if path == "live_migration":
            first.migrate_after = 3
        else:
            first.die_after = 3
    first.cached_tokens, second.cached_tokens = 4, 2
    gw = await start_gateway()
    body = chat_body(max_tokens=64)
    if stream:
        body.update(stream=True, stream_options={"include_usage": True})
        *_, final = (await sse_events(f"{gw.http}/v1/chat/completions", body))[:-1]
        usage = final["usage"]
    else:
        status, reply = await post(f"{gw.http}/v1/chat/completions", body)
        assert status == 200, reply
        usage = reply["usage"]
    assert second.requests  # the request did reach the second instance
    assert usage == usage_body(chat_prompt_tokens(cluster), len(cluster.reply_ids), cached)


async def test_a_zigzag_route_in_a_split_deployment_runs_three_hops_as_one_stream(
    cluster: Cluster, start_gateway
) -> None:
    """[loading prefill 0..1, partner prefill 1..2, decode]: the loading instance gets the
    ZigZag part, the partner relays from it and hands off, the decode instance pulls from it."""
    new, partner, decode = [await cluster.add_worker(i) for i in ("n", "p", "d")]
    addresses = dict(cluster.gm.instances)
    P, D = common_pb2.INSTANCE_ROLE_PREFILL, common_pb2.INSTANCE_ROLE_DECODE
    cluster.gm.route = [
        global_manager_pb2.RouteHop(
            instance_id="n", address=addresses["n"], layer_start=0, layer_end=1, role=P, dataplane_address=b"dp-n"
        ),
        global_manager_pb2.RouteHop(instance_id="p", address=addresses["p"], layer_start=1, layer_end=2, role=P),
        global_manager_pb2.RouteHop(instance_id="d", address=addresses["d"], layer_start=0, layer_end=2, role=D),
    ]
    gw = await start_gateway()
    status, body = await post(f"{gw.http}/v1/chat/completions", chat_body(max_tokens=64))
    assert status == 200 and body["choices"][0]["message"]["content"] == REPLY
    await wait_until(lambda: new.requests, 5, what="the loading instance's part")
    assert new.requests[0].WhichOneof("mode") == "zigzag_first_layers"
    (p_req,), (d_req,) = partner.requests, decode.requests
    assert p_req.zigzag_partner_handoff.dataplane_address == b"dp-n"
    assert d_req.decode_from_kv.transfer_id.startswith("p/") and list(d_req.resume_token_ids) == cluster.reply_ids[:1]
