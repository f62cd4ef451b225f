"""The admin boundary through the real gateway gRPC server: admin calls take admin keys (an
inference key is refused), a gateway without admin keys serves them to loopback callers only,
and the SDK sends its admin key (argument or BLITZMESH_ADMIN_API_KEY) on admin calls only.

The managers are small fakes; a caller on this machine's own non-loopback address plays a
remote one."""

from __future__ import annotations

import asyncio
import contextlib
import socket
from collections.abc import AsyncIterator, Callable
from typing import Any

import aiohttp
import grpc
import grpc.aio
import pytest
from grpc_health.v1 import health, health_pb2_grpc
from prometheus_client import CollectorRegistry

import blitzmesh
from blitzmesh.client import ADMIN_API_KEY_ENV
from blitzmesh.v1 import (
    admin_pb2,
    admin_pb2_grpc,
    common_pb2,
    global_manager_pb2_grpc,
    param_manager_pb2_grpc,
)
from services.common.server import wait_for_serving
from services.gateway.config import GatewayConfig
from services.gateway.service import GatewayService

pytestmark = [pytest.mark.timeout(20), pytest.mark.filterwarnings("error")]

MODEL = "tiny-chat"
INFERENCE_KEY = "sk-inference-key-0001"
ADMIN_KEY = "adm-operator-key-0001"


class FakeGlobalManager(global_manager_pb2_grpc.GlobalManagerServicer):
    """Answers the admin calls the gateway forwards and records the unary ones that reached it
    (the gateway also watches events on its own account, so watches are not counted)."""

    def __init__(self) -> None:
        self.calls: list[str] = []

    async def GetCluster(self, request, context):
        self.calls.append("GetCluster")
        return admin_pb2.ClusterState(instances=[common_pb2.InstanceInfo(instance_id="w-1")], policy="heteroscale")

    async def Scale(self, request, context):
        self.calls.append("Scale")
        return admin_pb2.ScaleResponse(instance_ids=["w-2"], reason=f"manual {request.delta:+d}")

    async def SetPolicy(self, request, context):
        self.calls.append("SetPolicy")
        return admin_pb2.SetPolicyResponse(policy=request.policy, params=request.params)

    async def WatchEvents(self, request, context):
        yield admin_pb2.ClusterEvent(time_s=1.0, action="scale_out", target=MODEL)
        await asyncio.Event().wait()  # a watch stays open until its caller leaves

    async def GetHistory(self, request, context):
        """On a manager clock at 100 s: a scale-out at 40 s and two samples, 99 s the newest."""
        samples = [
            admin_pb2.ClusterSample(time_s=98.0, request_rate=1.5, instances_by_state={"serving": 1}),
            admin_pb2.ClusterSample(time_s=99.0, request_rate=2.5, ttft_p50_s=0.2, instances_by_state={"serving": 2}),
        ]
        after = request.since_s if request.HasField("since_s") else -1.0
        return admin_pb2.ClusterHistory(
            now_s=100.0,
            window_s=900.0,
            period_s=1.0,
            events=[] if request.samples_only else [admin_pb2.ClusterEvent(time_s=40.0, action="scale_out")],
            samples=[x for x in samples if x.time_s > after],
        )


class FakeParamManager(param_manager_pb2_grpc.ParamManagerServicer):
    async def ListModels(self, request, context):
        return admin_pb2.ListModelsResponse(models=[common_pb2.ModelInfo(model_id=MODEL)])


async def _start(add: Callable[[grpc.aio.Server], None]) -> tuple[grpc.aio.Server, str]:
    server = grpc.aio.server()
    add(server)
    health_pb2_grpc.add_HealthServicer_to_server(health.aio.HealthServicer(), server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    return server, f"127.0.0.1:{port}"


def _non_loopback_ipv4() -> str | None:
    """This machine's own outward address (a UDP connect sends nothing), or None."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            s.connect(("203.0.113.1", 9))  # TEST-NET-3: only picks the route
        except OSError:
            return None
        address = s.getsockname()[0]
    return None if address.startswith("127.") or address == "0.0.0.0" else address


@pytest.fixture
async def managers() -> AsyncIterator[tuple[FakeGlobalManager, str, str]]:
    gm = FakeGlobalManager()
    gm_server, gm_address = await _start(lambda s: global_manager_pb2_grpc.add_GlobalManagerServicer_to_server(gm, s))
    pm_server, pm_address = await _start(
        lambda s: param_manager_pb2_grpc.add_ParamManagerServicer_to_server(FakeParamManager(), s)
    )
    try:
        yield gm, gm_address, pm_address
    finally:
        await gm_server.stop(0)
        await pm_server.stop(0)


@pytest.fixture
def start_gateway(managers, serve_in_process) -> Callable[..., contextlib.AbstractAsyncContextManager[Any]]:
    _, gm_address, pm_address = managers

    @contextlib.asynccontextmanager
    async def start(**overrides: Any) -> AsyncIterator[Any]:
        cfg = GatewayConfig(
            port=0,
            http_port=0,
            global_manager=gm_address,
            param_manager=pm_address,
            shutdown_grace_s=0.2,
            **overrides,
        )
        service = GatewayService(cfg, registry=CollectorRegistry())
        async with serve_in_process(service, cfg) as ctx:
            await wait_for_serving(ctx.address, 5)
            yield ctx

    return start


def _bearer(key: str) -> tuple[tuple[str, str], ...]:
    return (("authorization", f"Bearer {key}"),)


async def test_admin_calls_take_the_admin_key_and_refuse_the_inference_key(managers, start_gateway) -> None:
    gm, _, _ = managers
    async with (
        start_gateway(api_keys=[INFERENCE_KEY], admin_api_keys=[ADMIN_KEY]) as ctx,
        grpc.aio.insecure_channel(ctx.address) as channel,
    ):
        admin = admin_pb2_grpc.AdminStub(channel)
        scale = admin_pb2.ScaleRequest(model_id=MODEL, delta=1)

        with pytest.raises(grpc.aio.AioRpcError) as err:
            await admin.Scale(scale, metadata=_bearer(INFERENCE_KEY))
        assert err.value.code() == grpc.StatusCode.PERMISSION_DENIED
        details = err.value.details() or ""
        assert "is an inference API key" in details and "admin_api_keys" in details
        assert "'sk-...01'" in details and INFERENCE_KEY not in details
        # Keys configured: loopback gets no pass, and a missing key is named as such.
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await admin.SetPolicy(admin_pb2.SetPolicyRequest(policy="latency"))
        assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED
        assert "missing admin API key" in (err.value.details() or "")
        with pytest.raises(grpc.aio.AioRpcError) as err:
            async for _ in admin.WatchEvents(admin_pb2.WatchEventsRequest(), metadata=_bearer(INFERENCE_KEY)):
                pass
        assert err.value.code() == grpc.StatusCode.PERMISSION_DENIED
        assert gm.calls == []  # nothing refused reached the manager

        assert (await admin.Scale(scale, metadata=_bearer(ADMIN_KEY))).reason == "manual +1"
        assert [
            i.instance_id
            for i in (await admin.GetCluster(admin_pb2.GetClusterRequest(), metadata=_bearer(ADMIN_KEY))).instances
        ] == ["w-1"]
        watch = admin.WatchEvents(admin_pb2.WatchEventsRequest(), metadata=_bearer(ADMIN_KEY))
        assert (await watch.read()).action == "scale_out"
        watch.cancel()
        assert gm.calls == ["Scale", "GetCluster"]

        # ListModels is an inference call (GET /v1/models): the inference key, not the admin one.
        models = await admin.ListModels(admin_pb2.ListModelsRequest(), metadata=_bearer(INFERENCE_KEY))
        assert [m.model_id for m in models.models] == [MODEL]
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await admin.ListModels(admin_pb2.ListModelsRequest(), metadata=_bearer(ADMIN_KEY))
        assert err.value.code() == grpc.StatusCode.PERMISSION_DENIED and "is an admin key" in (
            err.value.details() or ""
        )


async def test_an_admin_key_does_not_open_the_http_api(start_gateway) -> None:
    async with start_gateway(api_keys=[INFERENCE_KEY], admin_api_keys=[ADMIN_KEY]) as ctx:
        url = f"http://127.0.0.1:{ctx.extra_ports['http_port']}/v1/models"
        async with aiohttp.ClientSession() as session:
            async with session.get(url, headers={"Authorization": f"Bearer {ADMIN_KEY}"}) as resp:
                body = await resp.json()
                assert resp.status == 403 and body["error"]["type"] == "permission_error"
            async with session.get(url, headers={"Authorization": f"Bearer {INFERENCE_KEY}"}) as resp:
                assert resp.status == 200


async def test_without_admin_keys_loopback_is_served_and_a_remote_caller_refused(managers, start_gateway) -> None:
    gm, _, _ = managers
    address = _non_loopback_ipv4()
    if address is None:
        pytest.skip("this machine has no non-loopback IPv4 address to call from")
    async with start_gateway(host=address) as ctx:
        assert not ctx.address.startswith("127.")
        async with grpc.aio.insecure_channel(ctx.address) as channel:
            admin = admin_pb2_grpc.AdminStub(channel)
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await admin.Scale(admin_pb2.ScaleRequest(model_id=MODEL, delta=1))
            assert err.value.code() == grpc.StatusCode.PERMISSION_DENIED
            details = err.value.details() or ""
            assert f"from '{address}'" in details and "only from loopback" in details
            assert "admin_api_keys" in details and "BLITZMESH_ADMIN_API_KEY" in details
            # Inference is unchanged: no inference keys, so open to every caller.
            models = await admin.ListModels(admin_pb2.ListModelsRequest())
            assert [m.model_id for m in models.models] == [MODEL]
        assert gm.calls == []

    # The same defaults on loopback, as `make up` binds: admin calls need no key.
    async with start_gateway() as ctx, blitzmesh.AsyncClient(ctx.address, timeout_s=5) as client:
        assert (await client.scale(MODEL, 1)).instance_ids == ("w-2",)
        assert gm.calls == ["Scale"]


async def test_admin_allow_loopback_off_refuses_loopback_too(start_gateway) -> None:
    async with (
        start_gateway(admin_allow_loopback=False) as ctx,
        blitzmesh.AsyncClient(ctx.address, timeout_s=5) as client,
    ):
        with pytest.raises(blitzmesh.AuthenticationError) as err:
            await client.cluster()
        assert err.value.code == "PERMISSION_DENIED" and "admin_allow_loopback is off" in (err.value.details or "")
        assert [m.model_id for m in await client.list_models()] == [MODEL]


async def test_the_sdk_sends_its_admin_key_on_admin_calls(managers, start_gateway, monkeypatch) -> None:
    gm, _, _ = managers
    monkeypatch.delenv(ADMIN_API_KEY_ENV, raising=False)
    async with start_gateway(api_keys=[INFERENCE_KEY], admin_api_keys=[ADMIN_KEY]) as ctx:
        async with blitzmesh.AsyncClient(ctx.address, api_key=INFERENCE_KEY, admin_api_key=ADMIN_KEY) as client:
            assert (await client.scale(MODEL, 1)).reason == "manual +1"
            assert (await client.set_policy("latency", advisory=True)).policy == "latency"
            async with contextlib.aclosing(client.watch_events(timeout_s=5)) as events:
                assert (await anext(events)).action == "scale_out"
            assert [m.model_id for m in await client.list_models()] == [MODEL]  # the inference key still

        async with blitzmesh.AsyncClient(ctx.address, api_key=INFERENCE_KEY) as no_admin_key:
            with pytest.raises(blitzmesh.AuthenticationError) as err:
                await no_admin_key.scale(MODEL, 1)
            assert err.value.code == "PERMISSION_DENIED" and "is an inference API key" in (err.value.details or "")

        monkeypatch.setenv(ADMIN_API_KEY_ENV, ADMIN_KEY)
        async with blitzmesh.AsyncClient(ctx.address, api_key=INFERENCE_KEY) as from_env:
            assert (await from_env.cluster()).policy == "heteroscale"
        # The blocking client, from a thread: the gateway runs on this test's event loop.
        blocking = blitzmesh.Client(ctx.address, admin_api_key=ADMIN_KEY)
        try:
            assert (await asyncio.to_thread(blocking.scale, MODEL, -1)).reason == "manual -1"
        finally:
            await asyncio.to_thread(blocking.close)
    assert gm.calls == ["Scale", "SetPolicy", "GetCluster", "Scale"]


async def _read_sse(resp: aiohttp.ClientResponse, kinds: set[str]) -> dict[str, str]:
    """The first message of each kind in `kinds` (event name -> data), bounded by the test's timeout."""
    got: dict[str, str] = {}
    kind = ""
    async for raw in resp.content:
        line = raw.decode().rstrip("\n")
        if line.startswith("event: "):
            kind = line[len("event: ") :]
        elif line.startswith("data: ") and kind in kinds:
            got.setdefault(kind, line[len("data: ") :])
            if set(got) == kinds:
                return got
    raise AssertionError(f"the stream ended with only {sorted(got)}")


async def test_the_dashboard_takes_admin_access_like_the_admin_api(start_gateway) -> None:
    async with start_gateway() as ctx, aiohttp.ClientSession() as session:
        base = f"http://127.0.0.1:{ctx.extra_ports['http_port']}/dashboard"
        async with session.get(base) as resp:  # loopback, no admin keys: served
            assert resp.status == 200 and "<title>Blitzmesh dashboard</title>" in await resp.text()
        async with session.get(f"{base}/assets/app.js") as resp:
            assert resp.status == 200 and resp.content_type == "text/javascript"
        async with session.get(f"{base}/assets/index.html") as resp:  # the page itself is not an open asset
            assert resp.status == 404 and "no dashboard asset" in (await resp.json())["error"]["message"]
        async with session.get(f"{base}/assets/vendor/uPlot.iife.min.js") as resp:
            assert resp.status == 200 and resp.content_type == "text/javascript" and "uPlot" in await resp.text()
        async with session.get(f"{base}/assets/vendor/uPlot.iife.js") as resp:  # only the files named in ASSETS
            assert resp.status == 404
        async with session.get(f"{base}/stream") as resp:
            assert resp.status == 200 and resp.content_type == "text/event-stream"
            got = await _read_sse(resp, {"hello", "cluster", "event", "sample"})
        assert '"instance_id":"w-1"' in got["cluster"] and '"request_rate":0.0' in got["cluster"]
        assert '"action":"scale_out"' in got["event"]
        assert '"time_s":98.0' in got["sample"]  # the stream's first samples overlap the history
        async with session.get(f"{base}/history") as resp:
            assert resp.status == 200
            history = await resp.json()
        # Manager times map to the gateway's wall clock: 60 s and 1 s before its reply.
        (event,) = history["events"]
        assert event["action"] == "scale_out" and event["time_s"] == 40.0
        assert history["now_s"] - event["at_s"] == pytest.approx(60.0)
        assert [x["request_rate"] for x in history["samples"]] == [1.5, 2.5]
        assert history["samples"][1]["ttft_p50_s"] == 0.2 and history["samples"][0]["ttft_p50_s"] is None
        assert history["samples"][1]["instances"] == {"serving": 2}

    async with start_gateway(admin_api_keys=[ADMIN_KEY], api_keys=[INFERENCE_KEY]) as ctx:
        base = f"http://127.0.0.1:{ctx.extra_ports['http_port']}/dashboard"
        async with aiohttp.ClientSession() as session:
            async with session.get(base) as resp:
                assert resp.status == 401 and "missing admin API key" in (await resp.json())["error"]["message"]
            async with session.get(f"{base}?key={INFERENCE_KEY}") as resp:
                assert resp.status == 403 and "is an inference API key" in (await resp.json())["error"]["message"]
            async with session.get(f"{base}/stream", headers={"Authorization": f"Bearer {ADMIN_KEY}"}) as resp:
                assert resp.status == 200
            async with session.get(f"{base}/history") as resp:
                assert resp.status == 401
            async with session.get(f"{base}/history?key={ADMIN_KEY}") as resp:
                assert resp.status == 200
            async with session.get(f"{base}?key={ADMIN_KEY}") as resp:
                assert resp.status == 200

    async with start_gateway(admin_allow_loopback=False) as ctx, aiohttp.ClientSession() as session:
        async with session.get(f"http://127.0.0.1:{ctx.extra_ports['http_port']}/dashboard") as resp:
            assert resp.status == 403 and "admin_allow_loopback is off" in (await resp.json())["error"]["message"]


async def test_dashboard_history_answers_503_when_the_manager_is_gone(managers, serve_in_process) -> None:
    """The history is read when the page opens: a manager that went away is a quick, named 503."""
    gm = FakeGlobalManager()
    gm_server, gm_address = await _start(lambda s: global_manager_pb2_grpc.add_GlobalManagerServicer_to_server(gm, s))
    cfg = GatewayConfig(port=0, http_port=0, global_manager=gm_address, param_manager=managers[2], shutdown_grace_s=0.2)
    async with serve_in_process(GatewayService(cfg, registry=CollectorRegistry()), cfg) as ctx:
        await wait_for_serving(ctx.address, 5)
        url = f"http://127.0.0.1:{ctx.extra_ports['http_port']}/dashboard/history"
        async with aiohttp.ClientSession() as session:
            async with session.get(url) as resp:
                assert resp.status == 200
            await gm_server.stop(0)
            started = asyncio.get_running_loop().time()
            async with session.get(url) as resp:
                message = (await resp.json())["error"]["message"]
            assert resp.status == 503, message
            assert asyncio.get_running_loop().time() - started < cfg.rpc_timeout_s
            assert message.startswith("the global manager's GetHistory failed: UNAVAILABLE"), message
