"""System (b): the worker's engine in this process, on the same checkpoint and EngineConfig."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path
from types import TracebackType

import torch

from bench.serving.results import RequestTiming, SystemResult
from bench.serving.workload import Request
from services.model_format.checkpoint import load_config
from services.model_format.generation import eos_token_ids_in
from services.worker.config import WorkerConfig
from services.worker.engine.engine import Engine, EngineConfig
from services.worker.engine.sampling import SamplingParams
from services.worker.kv_pool import engine_config
from services.worker.model.llama import LlamaForCausalLM, load_model, resolve_dtype


def worker_engine_config(worker: WorkerConfig) -> EngineConfig:
    """The EngineConfig a worker with these options builds (see WorkerServicer._make_engine), with
    the pool at its cap, kv_cache_tokens (what a worker gets when memory is not short)."""
    return engine_config(worker, worker.kv_cache_tokens // worker.block_size)


def _load_single_threaded(path: Path, device: str, dtype: str) -> LlamaForCausalLM:
    """Load as a worker does: torch single-threaded outside the engine's compute thread (a second
    OpenMP team in the process slows the compute thread's, see services.worker.service)."""
    torch.set_num_threads(1)
    cfg = load_config(path)
    return load_model(str(path), device=device, dtype=resolve_dtype(dtype, cfg, device))


def greedy(n: int) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)


class EngineSystem:
    """A started Engine on the checkpoint; `serve()` submits a closed batch and times the streams."""

    name = "engine"

    def __init__(self, model_path: Path, config: EngineConfig, device: str = "cpu", dtype: str = "auto") -> None:
        self.model_path = model_path
        self.config = config
        self.device = device
        self.dtype = dtype
        self._engine: Engine | None = None
        self._rounds = 0

    async def __aenter__(self) -> EngineSystem:
        model = await asyncio.to_thread(_load_single_threaded, self.model_path, self.device, self.dtype)
        eos_ids = await asyncio.to_thread(eos_token_ids_in, self.model_path)
        self._engine = Engine.create(model, eos_ids, self.config)
        await self._engine.start()
        return self

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        if self._engine is not None:
            await self._engine.stop()

    async def serve(self, requests: list[Request]) -> SystemResult:
        engine = self._engine
        assert engine is not None, "use `async with EngineSystem(...)`"
        self._rounds += 1
        tag = f"round{self._rounds}"

        async def one(req: Request, t0: float) -> RequestTiming:
            timing = RequestTiming(req.index, req.output_tokens)
            async for ev in engine.generate(f"{tag}-{req.index}", req.prompt_ids, greedy(req.output_tokens)):
                if ev.token_id is not None:
                    timing.token_times_s.append(time.perf_counter() - t0)
            if len(timing.token_times_s) != req.output_tokens:
                raise RuntimeError(
                    f"engine request {req.index} produced {len(timing.token_times_s)} tokens, asked {req.output_tokens}"
                )
            return timing

        t0 = time.perf_counter()
        timings = await asyncio.gather(*(one(r, t0) for r in requests))
        wall_s = time.perf_counter() - t0
        return SystemResult(
            name=self.name,
            wall_s=wall_s,
            useful_tokens=sum(r.output_tokens for r in requests),
            requests=list(timings),
        )
