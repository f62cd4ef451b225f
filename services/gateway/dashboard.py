"""The live dashboard the gateway serves at /dashboard: a page of plain HTML/JS/CSS from
services/gateway/static/ (no build step, nothing from outside), fed by one Server-Sent Events
stream at /dashboard/stream.

The stream carries three kinds of message: `event`, each of the global manager's WatchEvents as
it comes (scaling decisions with their reasons, transfer plans, ZigZag pairs, state changes);
`cluster`, every `period_s` a GetCluster snapshot with the gateway's own request rate, TTFT and
TBT over that period; and `sample`, each new cluster sample of the manager's history. On opening,
the page reads the manager's recent past (GetHistory) from /dashboard/history as JSON and draws
it before the live messages. The page, its stream and its history take an admin key, as the
Admin API does (the `Authorization: Bearer` header, or `?key=` since a browser's EventSource
sends no headers); a gateway without admin keys serves them to loopback callers. The assets
themselves are open."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import ipaddress
import json
import time
from pathlib import Path
from typing import Any

import grpc
import structlog
from aiohttp import web

from blitzmesh import convert
from blitzmesh.v1 import admin_pb2
from services.gateway.auth import check_admin
from services.gateway.backend import Backend
from services.gateway.config import GatewayConfig
from services.gateway.errors import ErrorKind, GatewayError, quote
from services.gateway.metrics import GatewayMetrics

log = structlog.get_logger(__name__)

STATIC_DIR = Path(__file__).resolve().parent / "static"
ASSETS = {
    "app.js": "text/javascript",
    "style.css": "text/css",
    # uPlot (MIT, vendor/uPlot.LICENSE), as npm publishes it: the charts of the history.
    "vendor/uPlot.iife.min.js": "text/javascript",
    "vendor/uPlot.min.css": "text/css",
}
OPEN_PREFIX = "/dashboard/assets/"
# A live stream re-sends the samples of this last stretch first, so a page whose history read
# raced the stream's start misses none (the page drops the ones it has by their time).
STREAM_SAMPLES_OVERLAP_S = 60.0


def http_peer(remote: str | None) -> str:
    """An HTTP client's address as a gRPC peer string, which check_admin reads."""
    if not remote:
        return "unknown"
    try:
        version = ipaddress.ip_address(remote).version
    except ValueError:
        return f"unix:{remote}" if remote.startswith("/") else remote
    return f"ipv{version}:{remote}:0" if version == 4 else f"ipv6:[{remote}]:0"


def _histogram(metrics: GatewayMetrics, name: str) -> tuple[float, float]:
    """(sum, count) of one of the gateway's unlabelled histograms."""
    total = count = 0.0
    for family in metrics.registry.collect():
        if family.name != name:
            continue
        for sample in family.samples:
            if sample.name == name + "_sum":
                total = sample.value
            elif sample.name == name + "_count":
                count = sample.value
    return total, count


def gateway_totals(metrics: GatewayMetrics) -> dict[str, float]:
    """The gateway's cumulative figures the dashboard turns into rates and means."""
    requests = 0.0
    for family in metrics.registry.collect():
        if family.name == "blitzmesh_gateway_requests":
            requests = sum(s.value for s in family.samples if s.name.endswith("_total"))
    ttft_sum, ttft_count = _histogram(metrics, "blitzmesh_gateway_ttft_seconds")
    tbt_sum, tbt_count = _histogram(metrics, "blitzmesh_gateway_tbt_seconds")
    return {
        "requests": requests,
        "ttft_sum": ttft_sum,
        "ttft_count": ttft_count,
        "tbt_sum": tbt_sum,
        "tbt_count": tbt_count,
    }


def window_stats(before: dict[str, float], after: dict[str, float], seconds: float) -> dict[str, float | None]:
    """Request rate (finished requests/s) and mean TTFT and TBT over one period."""

    def mean(kind: str) -> float | None:
        n = after[f"{kind}_count"] - before[f"{kind}_count"]
        return (after[f"{kind}_sum"] - before[f"{kind}_sum"]) / n if n > 0 else None

    return {
        "request_rate": max(0.0, after["requests"] - before["requests"]) / seconds if seconds > 0 else 0.0,
        "ttft_mean_s": mean("ttft"),
        "tbt_mean_s": mean("tbt"),
    }


def cluster_json(state: admin_pb2.ClusterState) -> dict[str, Any]:
    sdk = convert.cluster_state_from_proto(state)
    return {
        "policy": sdk.policy,
        "advisory": sdk.advisory,
        "instances": [
            {
                "instance_id": i.instance_id,
                "state": i.state,
                "role": i.role,
                "model": i.model_id,
                "host": i.host,
                "layers_loaded": i.layers_loaded,
                "num_layers": i.num_layers,
                "running": i.load.running,
                "waiting": i.load.waiting,
                "zigzag_running": i.load.zigzag_running,
                "ttft_p50_s": i.load.ttft_p50_s,
                "tbt_p50_s": i.load.tbt_p50_s,
                "kv_used": i.load.kv_blocks_used,
                "kv_total": i.load.kv_blocks_total,
            }
            for i in sdk.instances
        ],
        # Elastic-sequence-parallel groups the manager formed recently (members in slice order,
        # the last one the master; member k computed prompt positions [bounds[k], bounds[k+1])).
        "esp_groups": [
            {
                "group_id": g.group_id,
                "request_id": g.request_id,
                "model": g.model_id,
                "members": list(g.member_ids),
                "bounds": list(g.bounds),
                "spares": list(g.spare_ids),
                "age_s": g.age_s,
                "live": g.live,
                "holders": list(g.holder_ids),
                "holder_kv_tokens": list(g.holder_kv_tokens),  # the KV tokens each holder holds for it
            }
            for g in sdk.esp_groups
        ],
    }


def sample_json(sample: admin_pb2.ClusterSample, offset_s: float) -> dict[str, Any]:
    """One manager sample; `at_s` is its wall-clock time (the manager's time plus `offset_s`)."""

    def opt(name: str) -> float | None:
        return getattr(sample, name) if sample.HasField(name) else None

    return {
        "time_s": sample.time_s,
        "at_s": sample.time_s + offset_s,
        "request_rate": sample.request_rate,
        "decode_tps": sample.decode_tps,
        "ttft_p50_s": opt("ttft_p50_s"),
        "ttft_p99_s": opt("ttft_p99_s"),
        "tbt_p50_s": opt("tbt_p50_s"),
        "tbt_p99_s": opt("tbt_p99_s"),
        "instances": dict(sample.instances_by_state),
    }


def history_json(reply: admin_pb2.ClusterHistory, wall_now_s: float) -> dict[str, Any]:
    """GetHistory as the page reads it. The manager stamps times on its own monotonic clock;
    `at_s` maps each to the wall clock by the reply's `now_s` read at `wall_now_s` (the RPC's
    latency is the error, milliseconds)."""
    offset_s = wall_now_s - reply.now_s
    return {
        "now_s": wall_now_s,
        "window_s": reply.window_s,
        "period_s": reply.period_s,
        "events": [
            dataclasses.asdict(convert.cluster_event_from_proto(ev)) | {"at_s": ev.time_s + offset_s}
            for ev in reply.events
        ],
        "samples": [sample_json(s, offset_s) for s in reply.samples],
    }


def manager_error(what: str, error: grpc.aio.AioRpcError, timeout_s: float) -> GatewayError:
    if error.code() is grpc.StatusCode.DEADLINE_EXCEEDED:
        return GatewayError(ErrorKind.TIMEOUT, f"the global manager did not answer {what} within {timeout_s} s")
    return GatewayError(
        ErrorKind.UNAVAILABLE, f"the global manager's {what} failed: {error.code().name}: {error.details()}"
    )


def sse(kind: str, data: dict[str, Any]) -> bytes:
    return f"event: {kind}\ndata: {json.dumps(data, separators=(',', ':'))}\n\n".encode()


def offer(queue: asyncio.Queue[bytes], kind: str, data: dict[str, Any]) -> None:
    """Queue one message for the browser; a browser that stopped reading loses messages, not memory."""
    with contextlib.suppress(asyncio.QueueFull):
        queue.put_nowait(sse(kind, data))


def offer_problem(queue: asyncio.Queue[bytes], what: str, error: grpc.aio.AioRpcError) -> None:
    offer(queue, "problem", {"message": f"global manager {what}: {error.code().name}: {error.details()}"})


class Dashboard:
    """Routes of the dashboard on the gateway's aiohttp application."""

    def __init__(self, backend: Backend, config: GatewayConfig, period_s: float = 0.5) -> None:
        self.backend = backend
        self.config = config
        self.period_s = period_s

    def add_routes(self, app: web.Application) -> None:
        app.router.add_get("/dashboard", self.page)
        app.router.add_get("/dashboard/", self.page)
        app.router.add_get("/dashboard/stream", self.stream)
        app.router.add_get("/dashboard/history", self.history)
        app.router.add_get(OPEN_PREFIX + "{name:[A-Za-z0-9._/-]+}", self.asset)

    def check(self, request: web.Request) -> None:
        authorization = request.headers.get("Authorization")
        key = request.query.get("key")
        if authorization is None and key:
            authorization = f"Bearer {key}"
        check_admin(
            authorization,
            http_peer(request.remote),
            admin_api_keys=self.config.admin_api_keys,
            api_keys=self.config.api_keys,
            allow_loopback=self.config.admin_allow_loopback,
        )

    async def page(self, request: web.Request) -> web.Response:
        self.check(request)
        return web.FileResponse(STATIC_DIR / "index.html", headers={"Cache-Control": "no-store"})

    async def asset(self, request: web.Request) -> web.StreamResponse:
        name = request.match_info["name"]
        if name not in ASSETS:
            raise GatewayError(ErrorKind.NOT_FOUND, f"no dashboard asset {quote(name)}; there are {sorted(ASSETS)}")
        return web.FileResponse(STATIC_DIR / name, headers={"Content-Type": ASSETS[name]})

    def _gm(self) -> Any:
        gm = self.backend.gm
        if gm is None:
            raise GatewayError(ErrorKind.UNAVAILABLE, "the gateway is not connected to the global manager yet")
        return gm

    async def history(self, request: web.Request) -> web.Response:
        """The manager's recent past as JSON; 503 (or 504) naming the cause when it cannot be read."""
        self.check(request)
        gm, timeout_s = self._gm(), self.config.rpc_timeout_s
        try:
            reply = await gm.GetHistory(admin_pb2.GetHistoryRequest(), timeout=timeout_s)
        except grpc.aio.AioRpcError as e:
            raise manager_error("GetHistory", e, timeout_s) from e
        return web.json_response(history_json(reply, time.time()), headers={"Cache-Control": "no-store"})

    async def stream(self, request: web.Request) -> web.StreamResponse:
        self.check(request)
        gm = self._gm()
        resp = web.StreamResponse(
            headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
        )
        await resp.prepare(request)
        queue: asyncio.Queue[bytes] = asyncio.Queue(maxsize=1000)
        tasks = [
            asyncio.create_task(self._events(gm, queue), name="dashboard-events"),
            asyncio.create_task(self._snapshots(gm, queue), name="dashboard-cluster"),
            asyncio.create_task(self._samples(gm, queue), name="dashboard-samples"),
        ]
        try:
            await resp.write(sse("hello", {"gateway_time_s": time.time(), "period_s": self.period_s}))
            while True:
                await resp.write(await queue.get())
        except (ConnectionResetError, asyncio.CancelledError):
            pass
        finally:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
        return resp

    async def _events(self, gm: Any, queue: asyncio.Queue[bytes]) -> None:
        """The manager's events, as they come; a broken watch is opened again."""
        while True:
            call = gm.WatchEvents(admin_pb2.WatchEventsRequest())
            try:
                async for ev in call:
                    event = dataclasses.asdict(convert.cluster_event_from_proto(ev))
                    offer(queue, "event", event | {"received_s": time.time()})
            except grpc.aio.AioRpcError as e:
                offer_problem(queue, "events", e)
                await asyncio.sleep(1.0)
            finally:
                call.cancel()

    async def _snapshots(self, gm: Any, queue: asyncio.Queue[bytes]) -> None:
        """Every period: the cluster and the gateway's own rates over the period."""
        metrics = self.backend.metrics
        before, since = gateway_totals(metrics), time.monotonic()
        while True:
            try:
                state = await gm.GetCluster(admin_pb2.GetClusterRequest(), timeout=self.config.rpc_timeout_s)
                now, after = time.monotonic(), gateway_totals(metrics)
                data = cluster_json(state) | window_stats(before, after, now - since)
                before, since = after, now
                offer(queue, "cluster", data | {"time_s": time.time()})
            except grpc.aio.AioRpcError as e:
                offer_problem(queue, "cluster", e)
            await asyncio.sleep(self.period_s)

    async def _samples(self, gm: Any, queue: asyncio.Queue[bytes]) -> None:
        """Every period: the manager's history samples since the last one sent."""
        since_s: float | None = None
        while True:
            try:
                request = admin_pb2.GetHistoryRequest(samples_only=True)
                if since_s is not None:
                    request.since_s = since_s
                reply = await gm.GetHistory(request, timeout=self.config.rpc_timeout_s)
                offset_s = time.time() - reply.now_s
                first = since_s is None
                for sample in reply.samples:
                    if not first or sample.time_s > reply.now_s - STREAM_SAMPLES_OVERLAP_S:
                        offer(queue, "sample", sample_json(sample, offset_s))
                    since_s = sample.time_s
                if since_s is None:
                    since_s = reply.now_s - STREAM_SAMPLES_OVERLAP_S
            except grpc.aio.AioRpcError as e:
                offer_problem(queue, "history", e)
                if e.code() is grpc.StatusCode.UNIMPLEMENTED:
                    return  # a manager from before GetHistory: the page draws the live part only
            await asyncio.sleep(self.period_s)
