"""The SDK against a real grpc.aio server bound to port 0, serving a scripted fake gateway.

The fake implements `Inference` and `Admin` just far enough to drive the client's behaviour:
streaming, error mapping, retries before the first token only, deadlines, metadata, the
blocking client from a plain thread, and cancellation when the caller stops reading.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time
from collections.abc import AsyncIterator

import grpc
import grpc.aio
import pytest

import blitzmesh
from blitzmesh import AsyncClient, Client
from blitzmesh.v1 import (
    admin_pb2,
    admin_pb2_grpc,
    common_pb2,
    inference_pb2,
    inference_pb2_grpc,
)

pytestmark = [pytest.mark.timeout(15), pytest.mark.filterwarnings("error")]

MODEL = "tiny"
DELTAS = ["Hel", "lo", " world"]


class FakeGateway(inference_pb2_grpc.InferenceServicer, admin_pb2_grpc.AdminServicer):
    """Scripted gateway; tests set the knobs, then read what the server saw."""

    def __init__(self) -> None:
        self.target = ""
        # Knobs.
        self.fail_first = 0  # the first N calls fail with fail_code before any output
        self.fail_code = grpc.StatusCode.UNAVAILABLE
        self.abort_after_first: grpc.StatusCode | None = None  # fail after one delta
        self.delay_s = 0.0  # before each delta (or unary reply)
        self.endless = False  # stream deltas until the client goes away
        self.send_finish = True
        self.events_then_hang = False
        # Observations.
        self.calls = 0
        self.requests: list[object] = []
        self.metadata: list[dict[str, str]] = []
        self.cancelled = asyncio.Event()

    async def _enter(self, request: object, context: grpc.aio.ServicerContext) -> None:
        self.calls += 1
        self.requests.append(request)
        self.metadata.append({k: v for k, v in context.invocation_metadata() or ()})
        if self.calls <= self.fail_first:
            await context.abort(self.fail_code, f"scripted failure {self.calls}")

    async def Generate(self, request, context):
        await self._enter(request, context)
        if request.model != MODEL:
            await context.abort(grpc.StatusCode.NOT_FOUND, f"unknown model {request.model!r}")
        try:
            i = 0
            while self.endless or i < len(DELTAS):
                await asyncio.sleep(self.delay_s)
                text = DELTAS[i % len(DELTAS)]
                last = not self.endless and i == len(DELTAS) - 1
                msg = inference_pb2.GenerateResponse(
                    request_id=request.request_id,
                    text=text,
                    token_ids=[100 + i] if request.return_token_ids else [],
                    instance_id="w-1",
                )
                if last and self.send_finish:
                    msg.finish_reason = common_pb2.FINISH_REASON_STOP
                    msg.usage.CopyFrom(common_pb2.Usage(prompt_tokens=4, completion_tokens=3, total_tokens=7))
                yield msg
                if self.abort_after_first is not None:
                    await context.abort(self.abort_after_first, "worker w-1 died mid-stream")
                i += 1
        except asyncio.CancelledError:
            self.cancelled.set()
            raise

    async def Complete(self, request, context):
        await self._enter(request, context)
        if request.model != MODEL:
            await context.abort(grpc.StatusCode.NOT_FOUND, f"unknown model {request.model!r}")
        await asyncio.sleep(self.delay_s)
        return inference_pb2.CompleteResponse(
            request_id=request.request_id,
            text="".join(DELTAS),
            token_ids=[100, 101, 102] if request.return_token_ids else [],
            finish_reason=common_pb2.FINISH_REASON_LENGTH,
            usage=common_pb2.Usage(prompt_tokens=4, completion_tokens=3, total_tokens=7),
            instance_id="w-2",
        )

    async def ListModels(self, request, context):
        await self._enter(request, context)
        return admin_pb2.ListModelsResponse(
            models=[common_pb2.ModelInfo(model_id=MODEL, num_layers=4, dtype="float32")]
        )

    async def GetCluster(self, request, context):
        await self._enter(request, context)
        return admin_pb2.ClusterState(
            instances=[
                common_pb2.InstanceInfo(
                    instance_id="w-1",
                    model_id=MODEL,
                    state=common_pb2.INSTANCE_STATE_SERVING,
                    role=common_pb2.INSTANCE_ROLE_COLOCATED,
                    layers_loaded=4,
                    num_layers=4,
                    load=common_pb2.LoadReport(decode_tps=120.0, running=2),
                ),
                common_pb2.InstanceInfo(
                    instance_id="w-2",
                    model_id=MODEL,
                    state=common_pb2.INSTANCE_STATE_LOADING,
                    layers_loaded=1,
                    num_layers=4,
                ),
            ],
            models=[common_pb2.ModelInfo(model_id=MODEL)],
            policy="heteroscale",
            advisory=True,
        )

    async def Scale(self, request, context):
        await self._enter(request, context)
        return admin_pb2.ScaleResponse(instance_ids=["w-3"], reason=f"delta={request.delta}")

    async def SetPolicy(self, request, context):
        await self._enter(request, context)
        advisory = request.advisory if request.HasField("advisory") else False
        return admin_pb2.SetPolicyResponse(policy=request.policy, params=request.params, advisory=advisory)

    async def WatchEvents(self, request, context):
        await self._enter(request, context)
        for i in range(3):
            yield admin_pb2.ClusterEvent(time_s=float(i), action="instance_state", target="w-1", status=f"s{i}")
        if self.events_then_hang:
            try:
                await asyncio.Event().wait()
            except asyncio.CancelledError:
                self.cancelled.set()
                raise


@pytest.fixture
async def gateway() -> AsyncIterator[FakeGateway]:
    fake = FakeGateway()
    server = grpc.aio.server()
    inference_pb2_grpc.add_InferenceServicer_to_server(fake, server)
    admin_pb2_grpc.add_AdminServicer_to_server(fake, server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    fake.target = f"127.0.0.1:{port}"
    try:
        yield fake
    finally:
        await server.stop(grace=None)


@pytest.fixture
async def client(gateway: FakeGateway) -> AsyncIterator[AsyncClient]:
    async with AsyncClient(gateway.target, timeout_s=5.0, retry_backoff_s=0.01) as c:
        yield c


# --- inference --------------------------------------------------------------------------------


async def test_generate_streams_deltas_then_finish_and_usage(gateway, client):
    chunks = [
        c
        async for c in client.generate(
            "Say hello",
            model=MODEL,
            max_tokens=8,
            temperature=0.5,
            stop="\n",
            seed=7,
            return_token_ids=True,
        )
    ]
    assert [c.text for c in chunks] == DELTAS
    assert [c.token_ids for c in chunks] == [(100,), (101,), (102,)]
    assert [c.finish_reason for c in chunks] == [None, None, "stop"]
    assert [c.usage for c in chunks[:-1]] == [None, None]
    assert chunks[-1].usage == blitzmesh.Usage(4, 3, 7)
    assert {c.instance_id for c in chunks} == {"w-1"}

    (request,) = gateway.requests
    assert request.model == MODEL and request.prompt == "Say hello"
    assert request.sampling.max_tokens == 8 and request.sampling.temperature == 0.5
    assert list(request.sampling.stop) == ["\n"] and request.sampling.seed == 7
    assert not request.sampling.HasField("top_p")  # left to the gateway's default
    # The client names the request, and every chunk echoes that id.
    assert request.request_id and {c.request_id for c in chunks} == {request.request_id}


async def test_generate_sends_messages_or_token_ids(gateway, client):
    turns = [blitzmesh.ChatMessage("system", "be brief"), {"role": "user", "content": "hi"}]
    [c async for c in client.generate(messages=turns, model=MODEL, request_id="mine")]
    [c async for c in client.generate(prompt_token_ids=[1, 2, 3], model=MODEL)]
    chat, ids = gateway.requests
    assert [(m.role, m.content) for m in chat.messages] == [("system", "be brief"), ("user", "hi")]
    assert chat.prompt == "" and chat.request_id == "mine"
    assert list(ids.prompt_token_ids) == [1, 2, 3] and not ids.messages


async def test_complete_returns_the_whole_completion(gateway, client):
    completion = await client.complete("Say hello", model=MODEL, return_token_ids=True)
    assert completion == blitzmesh.Completion(
        text="Hello world",
        token_ids=(100, 101, 102),
        finish_reason="length",
        usage=blitzmesh.Usage(4, 3, 7),
        request_id=gateway.requests[0].request_id,
        instance_id="w-2",
    )


async def test_api_key_reaches_the_server_as_bearer_metadata(gateway):
    async with AsyncClient(gateway.target, api_key="sk-test-1") as keyed:
        await keyed.complete("x", model=MODEL)
        [c async for c in keyed.generate("x", model=MODEL)]
    async with AsyncClient(gateway.target) as anonymous:
        await anonymous.list_models()
    assert [m.get("authorization") for m in gateway.metadata] == [
        "Bearer sk-test-1",
        "Bearer sk-test-1",
        None,
    ]
    assert gateway.metadata[0]["user-agent"].startswith("blitzmesh-python/")


async def test_unknown_model_is_not_found_with_details_and_request_id(gateway, client):
    with pytest.raises(blitzmesh.NotFoundError) as info:
        [c async for c in client.generate("x", model="nope", request_id="r-404")]
    assert info.value.code == "NOT_FOUND"
    assert info.value.details == "unknown model 'nope'"
    assert info.value.request_id == "r-404"
    with pytest.raises(blitzmesh.NotFoundError):
        await client.complete("x", model="nope")
    assert gateway.calls == 2  # NOT_FOUND is final: no retry


async def test_generate_retries_unavailable_before_the_first_token(gateway, client):
    gateway.fail_first = 2  # client allows max_retries=2
    chunks = [c async for c in client.generate("x", model=MODEL)]
    assert "".join(c.text for c in chunks) == "Hello world"
    assert gateway.calls == 3
    # A retry is the same request, not a new one.
    assert len({r.request_id for r in gateway.requests}) == 1


async def test_generate_gives_up_after_max_retries(gateway, client):
    gateway.fail_first = 10
    with pytest.raises(blitzmesh.UnavailableError) as info:
        [c async for c in client.generate("x", model=MODEL)]
    assert info.value.details == "scripted failure 3"
    assert gateway.calls == 3


async def test_unavailable_after_a_token_is_raised_not_retried(gateway, client):
    gateway.abort_after_first = grpc.StatusCode.UNAVAILABLE
    seen = []
    with pytest.raises(blitzmesh.UnavailableError) as info:
        async for chunk in client.generate("x", model=MODEL):
            seen.append(chunk.text)
    assert seen == ["Hel"]  # the caller got the token, then the error, and no repeat
    assert info.value.details == "worker w-1 died mid-stream"
    assert gateway.calls == 1


async def test_worker_death_mid_stream_is_an_internal_error(gateway, client):
    gateway.abort_after_first = grpc.StatusCode.INTERNAL
    with pytest.raises(blitzmesh.InternalError, match="died mid-stream"):
        [c async for c in client.generate("x", model=MODEL)]
    assert gateway.calls == 1


async def test_only_unavailable_is_retried(gateway, client):
    gateway.fail_first = 1
    gateway.fail_code = grpc.StatusCode.RESOURCE_EXHAUSTED
    with pytest.raises(blitzmesh.OverloadedError):
        [c async for c in client.generate("x", model=MODEL)]
    with pytest.raises(blitzmesh.OverloadedError):
        gateway.calls = 0
        await client.complete("x", model=MODEL)
    assert gateway.calls == 1


async def test_unary_calls_retry_unavailable(gateway, client):
    gateway.fail_first = 2
    completion = await client.complete("x", model=MODEL)
    assert completion.text == "Hello world"
    assert gateway.calls == 3


async def test_scale_is_never_retried(gateway, client):
    gateway.fail_first = 1
    with pytest.raises(blitzmesh.UnavailableError):
        await client.scale(MODEL, 2)
    assert gateway.calls == 1


async def test_no_retries_when_max_retries_is_zero(gateway):
    gateway.fail_first = 1
    async with AsyncClient(gateway.target, max_retries=0) as c:
        with pytest.raises(blitzmesh.UnavailableError):
            await c.list_models()
    assert gateway.calls == 1


async def test_slow_stream_exceeds_its_deadline(gateway, client):
    gateway.delay_s = 2.0
    start = time.monotonic()
    with pytest.raises(blitzmesh.DeadlineExceededError):
        [c async for c in client.generate("x", model=MODEL, timeout_s=0.2)]
    with pytest.raises(blitzmesh.DeadlineExceededError):
        await client.complete("x", model=MODEL, timeout_s=0.2)
    assert time.monotonic() - start < 1.5


async def test_backoff_never_waits_past_the_deadline(gateway):
    gateway.fail_first = 10
    async with AsyncClient(gateway.target, retry_backoff_s=5.0, timeout_s=0.3) as c:
        start = time.monotonic()
        with pytest.raises(blitzmesh.UnavailableError):
            await c.complete("x", model=MODEL)
    # The real failure is reported at once instead of sleeping into a deadline error.
    assert time.monotonic() - start < 1.0
    assert gateway.calls == 1


async def test_stream_that_ends_without_finish_reason_is_an_error(gateway, client):
    gateway.send_finish = False
    seen = []
    with pytest.raises(blitzmesh.InternalError, match="without a finish_reason"):
        async for chunk in client.generate("x", model=MODEL):
            seen.append(chunk.text)
    assert seen == DELTAS


async def test_leaving_a_stream_early_cancels_it_on_the_server(gateway, client):
    gateway.endless = True
    gateway.delay_s = 0.01
    async with contextlib.aclosing(client.generate("x", model=MODEL)) as stream:
        async for chunk in stream:
            if chunk.text == "lo":
                break
    await asyncio.wait_for(gateway.cancelled.wait(), timeout=2)


async def test_cancelling_the_callers_task_cancels_the_server_stream(gateway, client):
    gateway.endless = True
    gateway.delay_s = 0.01
    first = asyncio.Event()

    async def consume() -> None:
        async for _ in client.generate("x", model=MODEL):
            first.set()

    task = asyncio.create_task(consume())
    await asyncio.wait_for(first.wait(), timeout=5)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    await asyncio.wait_for(gateway.cancelled.wait(), timeout=2)


# --- admin ------------------------------------------------------------------------------------


async def test_admin_calls(gateway, client):
    (model,) = await client.list_models()
    assert model == blitzmesh.ModelInfo(model_id=MODEL, num_layers=4, dtype="float32")

    state = await client.cluster()
    assert [(i.instance_id, i.state, i.role) for i in state.instances] == [
        ("w-1", "serving", "colocated"),
        ("w-2", "loading", "unspecified"),
    ]
    assert state.instances[1].layers_loaded == 1 and state.instances[0].load.running == 2
    assert state.policy == "heteroscale" and state.advisory

    result = await client.scale(MODEL, -1, wait=True, role="decode")
    assert result == blitzmesh.ScaleResult(instance_ids=("w-3",), reason="delta=-1")
    scale_request = gateway.requests[-1]
    assert scale_request.model_id == MODEL and scale_request.wait
    assert scale_request.role == common_pb2.INSTANCE_ROLE_DECODE

    policy = await client.set_policy("latency", {"ttft_slo_s": 0.5, "dry": True}, advisory=True)
    assert policy == blitzmesh.PolicyState("latency", {"ttft_slo_s": "0.5", "dry": "true"}, advisory=True)
    await client.set_policy("latency")
    assert not gateway.requests[-1].HasField("advisory")  # None keeps the current mode


async def test_watch_events_streams_until_the_caller_stops(gateway, client):
    gateway.events_then_hang = True
    events = []
    async with contextlib.aclosing(client.watch_events()) as stream:
        async for event in stream:
            events.append(event)
            if len(events) == 3:
                break
    assert [(e.time_s, e.action, e.status) for e in events] == [
        (0.0, "instance_state", "s0"),
        (1.0, "instance_state", "s1"),
        (2.0, "instance_state", "s2"),
    ]
    await asyncio.wait_for(gateway.cancelled.wait(), timeout=2)


# --- blocking client --------------------------------------------------------------------------


async def test_sync_client_from_a_plain_thread(gateway):
    def use_blocking_client() -> tuple[list[str], str, str, list[str]]:
        with Client(gateway.target, api_key="k", retry_backoff_s=0.01) as c:
            texts = [chunk.text for chunk in c.generate("x", model=MODEL)]
            completion = c.complete("x", model=MODEL)
            try:
                c.complete("x", model="nope")
            except blitzmesh.NotFoundError as e:
                not_found = e.details
            models = [m.model_id for m in c.list_models()]
        return texts, completion.text, not_found, models

    # to_thread: the server's loop keeps running while the blocking client waits on it.
    texts, text, not_found, models = await asyncio.to_thread(use_blocking_client)
    assert texts == DELTAS and text == "Hello world"
    assert not_found == "unknown model 'nope'" and models == [MODEL]
    assert {m["authorization"] for m in gateway.metadata} == {"Bearer k"}


async def test_sync_client_retries_and_cancels_like_the_async_one(gateway):
    gateway.fail_first = 1
    gateway.endless = True
    gateway.delay_s = 0.01

    server_loop = asyncio.get_running_loop()

    def read_two_then_stop() -> list[str]:
        with Client(gateway.target, retry_backoff_s=0.01) as c:
            texts = []
            for chunk in c.generate("x", model=MODEL):
                texts.append(chunk.text)
                if len(texts) == 2:
                    break
            # Still inside `with`: leaving the loop alone must stop the server's work, not
            # only closing the client.
            asyncio.run_coroutine_threadsafe(
                asyncio.wait_for(gateway.cancelled.wait(), timeout=2), server_loop
            ).result()
            return texts

    assert await asyncio.to_thread(read_two_then_stop) == ["Hel", "lo"]
    assert gateway.calls == 2


async def test_sync_client_raises_mid_stream_errors(gateway):
    gateway.abort_after_first = grpc.StatusCode.UNAVAILABLE

    def read_all() -> list[str]:
        seen: list[str] = []
        with Client(gateway.target, retry_backoff_s=0.01) as c:
            with pytest.raises(blitzmesh.UnavailableError):
                for chunk in c.generate("x", model=MODEL):
                    seen.append(chunk.text)
        return seen

    assert await asyncio.to_thread(read_all) == ["Hel"]
    assert gateway.calls == 1


async def test_closing_a_sync_client_ends_calls_other_threads_wait_on(gateway):
    gateway.endless = True
    gateway.delay_s = 0.01
    client = Client(gateway.target)
    started = threading.Event()
    outcome: list[BaseException] = []

    def reader() -> None:
        try:
            for _ in client.generate("x", model=MODEL):
                started.set()
        except BaseException as e:
            outcome.append(e)

    thread = threading.Thread(target=reader)
    thread.start()
    assert await asyncio.to_thread(started.wait, 5)
    await asyncio.to_thread(client.close)
    await asyncio.to_thread(thread.join, 5)
    assert not thread.is_alive()
    assert [type(e) for e in outcome] == [blitzmesh.RequestCancelledError]
    await asyncio.wait_for(gateway.cancelled.wait(), timeout=2)
