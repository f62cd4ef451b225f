"""Liveness with real gRPC servers: a worker whose engine loop crashes stops advertising itself
(health NOT_SERVING, a DRAINING heartbeat at once), the manager stops routing to it and tops the
pool up; serve() shuts down in the order that lets in-flight requests finish."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import grpc
import pytest
import structlog
import structlog.testing
from grpc_health.v1 import health_pb2, health_pb2_grpc

from blitzmesh.v1 import admin_pb2, common_pb2, global_manager_pb2, global_manager_pb2_grpc, worker_pb2, worker_pb2_grpc
from services.common.config import ServiceConfig
from services.common.grpc_util import channel
from services.common.server import ServeContext, serve
from services.common.waiting import wait_until
from services.global_manager.config import GlobalManagerConfig
from services.global_manager.core.types import InstanceState as S
from services.global_manager.service import GlobalManagerService
from services.param_manager.service import ParamManagerConfig, ParamManagerService
from services.worker.config import WorkerConfig
from services.worker.model.llama import LlamaForCausalLM
from services.worker.service import WorkerService
from tests.integration.conftest import plaintext

pytestmark = pytest.mark.timeout(120)

ServeFactory = Any  # tests/integration/conftest.py: serve_in_process


def _pm(model_dir: Path) -> ParamManagerService:
    # In one process ucxx allows one worker: TCP here (see test_param_worker.py).
    return ParamManagerService(ParamManagerConfig(port=0, model_dir=model_dir, chunk_bytes=64 * 1024, dataplane="tcp"))


def _worker(iid: str, pm: str, gm: str = "", **kw: Any) -> WorkerService:
    return WorkerService(
        WorkerConfig(
            port=0,
            param_manager=pm,
            global_manager=gm,
            instance_id=iid,
            kv_cache_tokens=4096,
            dataplane="tcp",
            heartbeat_interval_s=0.2,
            **kw,
        )
    )


async def _health(address: str) -> int:
    async with channel(address) as ch:
        resp = await health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=5)
    return resp.status


def _request(rid: str, max_tokens: int) -> worker_pb2.WorkerGenerateRequest:
    return worker_pb2.WorkerGenerateRequest(
        request_id=rid,
        model_id="tiny",
        prompt_token_ids=[1, 5, 9, 42, 7],
        sampling=common_pb2.SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True),
    )


async def test_a_crashed_engine_leaves_the_routes_and_the_pool_is_topped_up(
    tiny_models: Path, serve_in_process: ServeFactory, monkeypatch: pytest.MonkeyPatch
) -> None:
    crash = {"on": False}
    head = LlamaForCausalLM.head

    def failing_head(self: LlamaForCausalLM, hidden: Any) -> Any:
        if crash["on"]:
            raise RuntimeError("injected device fault")
        return head(self, hidden)

    monkeypatch.setattr(LlamaForCausalLM, "head", failing_head)

    pm = _pm(tiny_models)
    async with serve_in_process(pm, pm.servicer.config) as pm_ctx:
        gm = GlobalManagerService(
            GlobalManagerConfig(port=0, param_manager=pm_ctx.address, default_model="tiny", min_instances=1, tick_s=0.1)
        )
        workers: dict[str, ServeContext] = {}
        # What the manager heard, and what the worker's health said at that moment.
        heard: list[tuple[str, S, int, list[str]]] = []
        heartbeat = gm.servicer.Heartbeat

        async def recording_heartbeat(request: global_manager_pb2.HeartbeatRequest, context: Any) -> Any:
            resp = await heartbeat(request, context)
            known = request.instance_id in gm.servicer.table.registry and request.instance_id in workers
            state = gm.servicer.table.registry.get(request.instance_id).state if known else None
            if state is S.DRAINING:
                serving = [v.instance_id for v in gm.servicer.table.registry.views(model="tiny", state=S.SERVING)]
                heard.append((request.instance_id, state, await _health(workers[request.instance_id].address), serving))
            return resp

        gm.servicer.Heartbeat = recording_heartbeat  # type: ignore[method-assign]
        async with serve_in_process(gm, gm.servicer.cfg) as gm_ctx:
            w0, w1 = (_worker(iid, pm_ctx.address, gm_ctx.address) for iid in ("w0", "w1"))
            async with serve_in_process(w0, w0.cfg) as c0, serve_in_process(w1, w1.cfg) as c1:
                workers.update(w0=c0, w1=c1)
                services = {"w0": w0, "w1": w1}

                def serving() -> list[str]:
                    return [v.instance_id for v in gm.servicer.table.registry.views(model="tiny", state=S.SERVING)]

                first = (await wait_until(serving, 30, what="the manager's min_instances load"))[0]
                victim = services[first]
                crash["on"] = True
                async with channel(workers[first].address) as ch:
                    with pytest.raises(grpc.aio.AioRpcError) as err:
                        async for _ in worker_pb2_grpc.WorkerStub(ch).Generate(_request("r-crash", 8), timeout=10):
                            pass
                assert err.value.code() == grpc.StatusCode.UNAVAILABLE
                assert "engine loop crashed" in (err.value.details() or "")
                crash["on"] = False

                # Told at once: a DRAINING heartbeat while health said NOT_SERVING, and from that
                # moment the manager had no route to it.
                await wait_until(lambda: heard, 10, what="the crashed worker's DRAINING heartbeat")
                iid, state, health, routable = heard[0]
                assert (iid, state, health) == (first, S.DRAINING, health_pb2.HealthCheckResponse.NOT_SERVING)
                assert first not in routable
                # The broken instance is dropped, the worker is IDLE and healthy again, and the
                # manager's floor loads the model again (on whichever IDLE worker it picks).
                await wait_until(lambda: victim.servicer.engine_deaths == 1 and victim.servicer.state != "draining", 10)
                assert await _health(workers[first].address) == health_pb2.HealthCheckResponse.SERVING
                again = await wait_until(serving, 30, what="the pool topped up to min_instances")
                async with channel(workers[again[0]].address) as ch:
                    out = [
                        t
                        async for m in worker_pb2_grpc.WorkerStub(ch).Generate(_request("r-after", 4), timeout=10)
                        for t in m.token_ids
                    ]
                assert len(out) == 4
                async with channel(gm_ctx.address) as ch:
                    cluster = await global_manager_pb2_grpc.GlobalManagerStub(ch).GetCluster(
                        admin_pb2.GetClusterRequest(), timeout=5
                    )
                assert [
                    i.instance_id for i in cluster.instances if i.state == common_pb2.INSTANCE_STATE_SERVING
                ] == again


class _OrderRecorder:
    """A service that records what serve() lets it see at each shutdown step."""

    name = "blitzmesh.v1.Test"

    def __init__(self) -> None:
        self.steps: list[tuple[str, str]] = []
        self.address = ""

    def register(self, server: grpc.aio.Server) -> list[str]:
        return []

    async def start(self, ctx: ServeContext) -> None:
        self.address = ctx.address
        await ctx.set_serving()

    async def _server_says(self) -> str:
        try:
            return health_pb2.HealthCheckResponse.ServingStatus.Name(await _health(self.address))
        except grpc.aio.AioRpcError as e:
            return e.code().name

    async def drain(self) -> None:
        self.steps.append(("drain", await self._server_says()))

    async def stop(self) -> None:
        self.steps.append(("stop", await self._server_says()))
        raise RuntimeError("stop failed on purpose")


async def test_serve_drains_while_serving_then_stops_the_server_then_the_service_and_logs_its_errors() -> None:
    service = _OrderRecorder()
    stop = asyncio.Event()
    bound = asyncio.Event()

    async def on_bound(ctx: ServeContext) -> None:
        bound.set()

    with structlog.testing.capture_logs() as logs:
        task = asyncio.create_task(
            serve(service, ServiceConfig(port=0, insecure=True), stop_event=stop, on_bound=on_bound)
        )
        async with asyncio.timeout(10):
            await bound.wait()
            stop.set()
            await task
    # The drain runs while the server still answers (NOT_SERVING already), the service's stop
    # after the server is gone; the stop's error is logged, not swallowed.
    assert service.steps == [("drain", "NOT_SERVING"), ("stop", "UNAVAILABLE")]
    failed = [e for e in logs if e["event"] == "service_stop_failed"]
    assert failed and failed[0]["service"] == service.name and failed[0]["log_level"] == "error"


async def test_a_stopped_worker_finishes_its_in_flight_request_before_it_exits(
    tiny_models: Path, serve_in_process: ServeFactory
) -> None:
    pm = _pm(tiny_models)
    async with serve_in_process(pm, pm.servicer.config) as pm_ctx:
        # 30 tokens at 50 ms a step outlive the gRPC grace (0.1 s): only the drain lets them finish.
        wk = _worker(
            "w0", pm_ctx.address, preload_model="tiny", step_time_a_s=0.05, step_time_b_s=0.0, shutdown_grace_s=0.1
        )
        stop = asyncio.Event()
        bound: asyncio.Future[ServeContext] = asyncio.get_running_loop().create_future()

        async def on_bound(ctx: ServeContext) -> None:
            bound.set_result(ctx)

        task = asyncio.create_task(serve(wk, plaintext(wk.cfg), stop_event=stop, on_bound=on_bound))
        async with asyncio.timeout(60):
            ctx = await bound
            tokens: list[int] = []
            finish = 0
            async with channel(ctx.address) as ch:
                async for msg in worker_pb2_grpc.WorkerStub(ch).Generate(_request("r-drain", 30), timeout=30):
                    tokens.extend(msg.token_ids)
                    if tokens and not stop.is_set():
                        stop.set()  # SIGTERM's effect, with the request in flight
                    finish = msg.finish_reason or finish
            await task
        assert len(tokens) == 30 and finish == common_pb2.FINISH_REASON_LENGTH
        assert wk.servicer.instance is None and wk.servicer.state == "idle"
