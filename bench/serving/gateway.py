"""System (a): a real mesh (param manager, global manager, one worker, gateway) driven through the
OpenAI HTTP API with SSE streaming; token times are taken from the stream as the client sees it."""

from __future__ import annotations

import asyncio
import json
import os
import time
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType

import aiohttp

from bench.serving.host import CpuMeter
from bench.serving.results import RequestTiming, SystemResult
from bench.serving.workload import Request
from services.mesh.launcher import Mesh, MeshConfig
from services.worker.config import WorkerConfig


def mesh_config(
    model_dir: Path, model: str, run_dir: Path, threads: int, worker: WorkerConfig, dataplane: str
) -> MeshConfig:
    return MeshConfig(
        workers=1,
        model=model,
        model_dir=model_dir,
        run_dir=run_dir,
        http_port=0,
        grpc_port=0,
        initial_instances=1,
        worker_threads=threads,
        # Spelled out so the worker runs exactly the EngineConfig system (b) builds.
        worker_args=[
            "--max-batch-size", str(worker.max_batch_size),
            "--max-num-tokens", str(worker.max_num_tokens),
            "--block-size", str(worker.block_size),
            "--kv-cache-tokens", str(worker.kv_cache_tokens),
            "--dataplane", dataplane,
            "--device", worker.device,
            "--dtype", worker.dtype,
        ],
    )  # fmt: skip


_PM_DATAPLANE_ENV = "BLITZMESH_PARAM_MANAGER_DATAPLANE"


@dataclass
class _Streamed:
    timing: RequestTiming
    text_chunks: int
    completion_tokens: int


class GatewaySystem:
    """A running mesh plus an HTTP session; `serve()` sends a closed batch and times the streams."""

    name = "gateway"

    def __init__(self, cfg: MeshConfig, dataplane: str) -> None:
        self.cfg = cfg
        self.dataplane = dataplane
        self.mesh = Mesh(cfg)
        self.start_s = 0.0
        self._session: aiohttp.ClientSession | None = None
        self._url = ""

    async def __aenter__(self) -> GatewaySystem:
        started = time.perf_counter()
        # The parameter manager takes its data plane from the environment only (no launcher flag);
        # children copy the environment when they are spawned, during start().
        previous = os.environ.get(_PM_DATAPLANE_ENV)
        os.environ[_PM_DATAPLANE_ENV] = self.dataplane
        try:
            await self.mesh.start()
        except BaseException:
            await self.mesh.stop()
            raise
        finally:
            if previous is None:
                del os.environ[_PM_DATAPLANE_ENV]
            else:
                os.environ[_PM_DATAPLANE_ENV] = previous
        self.start_s = time.perf_counter() - started
        self._url = f"{self.mesh.gateway_http}/v1/completions"
        # No connection cap: every request must be in flight at once, as from that many clients.
        self._session = aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(limit=0), timeout=aiohttp.ClientTimeout(total=None, sock_read=600)
        )
        return self

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        try:
            if self._session is not None:
                await self._session.close()
        finally:
            await self.mesh.stop()

    def pids(self) -> dict[str, int]:
        return {name: p.process.pid for name, p in self.mesh.procs.items()}

    async def idle_cpu_share(self, seconds: float) -> dict[str, float]:
        """Per process, the share of one core it burns while no request is in flight."""
        meter = CpuMeter(self.pids())
        await asyncio.sleep(seconds)
        used = meter.stop()
        return {} if used is None else {name: round(s / seconds, 3) for name, s in used.own_cpu_s.items()}

    async def serve(self, requests: list[Request]) -> SystemResult:
        t0 = time.perf_counter()
        streamed = await asyncio.gather(*(self._one(r, t0) for r in requests))
        wall_s = time.perf_counter() - t0
        tokens = sum(s.completion_tokens for s in streamed)
        chunks = sum(s.text_chunks for s in streamed)
        return SystemResult(
            name=self.name,
            wall_s=wall_s,
            useful_tokens=tokens,
            requests=[s.timing for s in streamed],
            # Below 1.0 when some tokens had no printable text of their own: such a token reaches
            # the client with the next chunk, whose gap then spans two tokens.
            notes={"sse_text_chunks_per_token": round(chunks / tokens, 4)},
        )

    async def _one(self, req: Request, t0: float) -> _Streamed:
        assert self._session is not None, "use `async with GatewaySystem(...)`"
        body = {
            "model": self.cfg.model,
            "prompt": list(req.prompt_ids),
            "max_tokens": req.output_tokens,
            "temperature": 0.0,
            "ignore_eos": True,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        timing = RequestTiming(req.index, req.output_tokens)
        usage = None
        async with self._session.post(self._url, json=body) as resp:
            if resp.status != 200:
                raise RuntimeError(f"gateway answered {resp.status} to request {req.index}: {await resp.text()}")
            async for raw in resp.content:
                now = time.perf_counter()
                line = raw.strip()
                if not line.startswith(b"data:"):
                    continue
                data = line[5:].strip()
                if data == b"[DONE]":
                    break
                event = json.loads(data)
                if "error" in event:
                    raise RuntimeError(f"gateway stream of request {req.index} failed: {event['error']}")
                if event.get("usage"):
                    usage = event["usage"]
                choices = event.get("choices") or []
                if choices and choices[0].get("text"):
                    timing.token_times_s.append(now - t0)
        if usage is None or usage["completion_tokens"] != req.output_tokens:
            raise RuntimeError(f"request {req.index}: usage {usage!r}, expected {req.output_tokens} completion tokens")
        return _Streamed(timing, len(timing.token_times_s), usage["completion_tokens"])
