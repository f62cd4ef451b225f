"""Drives one worker engine through the profiling sweep and the saturation run.

The engine is built as a worker builds it (WorkerConfig -> `engine_config` -> Engine over a KV
pool of `kv_cache_tokens`, the pool a worker gets when memory is not short) and driven through
its public `generate`; the step times come from its own `step_log`.
"""

from __future__ import annotations

import asyncio
import random
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch

from bench.profile.fit import FitResult, Sample, fit_step_time, residual_stats, step_samples
from services.common.worker_profile import (
    PROFILE_SCHEMA_VERSION,
    TARGET_FRACTION,
    Recommendation,
    Saturation,
    StepFeatures,
    WorkerProfile,
)
from services.model_format.checkpoint import load_config
from services.model_format.generation import eos_token_ids_in
from services.worker.config import WorkerConfig
from services.worker.engine.engine import Engine
from services.worker.engine.sampling import SamplingParams
from services.worker.kv_pool import engine_config
from services.worker.model.llama import load_model, resolve_dtype

# Far more than any sweep runs: every iteration stays in `step_log` until read.
_STEP_HISTORY = 1_000_000


@dataclass(frozen=True)
class Sweep:
    """The designed experiment. Prefill cells: `prefill_batches` prompts of each of `prefill_lens`
    tokens, one output token each (prefill-only iterations), `prefill_reps` times. Decode cells:
    `decode_batches` requests with prompts of `decode_lens` tokens generating `decode_tokens` each
    (their prefill, then decode-only iterations at a context growing from the prompt length).
    Saturation: `max_batch_size` requests always in flight for `saturation_s` seconds, prompts
    of `saturation_prompt` tokens, outputs uniform in `saturation_output`; the first
    `saturation_warmup` of the run is not measured."""

    prefill_lens: tuple[int, ...]
    prefill_batches: tuple[int, ...]
    prefill_reps: int
    decode_batches: tuple[int, ...]
    decode_lens: tuple[int, ...]
    decode_tokens: int
    saturation_s: float
    saturation_prompt: int
    saturation_output: tuple[int, int]
    saturation_warmup: float = 0.25
    warmup_requests: int = 4
    # Prefill cells above this many tokens are skipped (a slow CPU spends seconds on each).
    max_cell_tokens: int = 4096

    def report(self) -> dict[str, Any]:
        return asdict(self)


QUICK = Sweep(
    prefill_lens=(16, 64, 256, 768),
    prefill_batches=(1, 4),
    prefill_reps=2,
    decode_batches=(1, 8, 32),
    decode_lens=(32, 256),
    decode_tokens=12,
    saturation_s=30.0,
    saturation_prompt=32,
    saturation_output=(32, 96),
    max_cell_tokens=1536,
)
FULL = Sweep(
    prefill_lens=(16, 64, 128, 256, 512, 1024),
    prefill_batches=(1, 2, 4, 8),
    prefill_reps=3,
    decode_batches=(1, 4, 8, 16, 32),
    decode_lens=(32, 256, 1024),
    decode_tokens=32,
    saturation_s=90.0,
    saturation_prompt=32,
    saturation_output=(64, 192),
)


@dataclass
class _Driver:
    engine: Engine
    vocab_size: int
    rng: random.Random
    prompt_lens: dict[str, int] = field(default_factory=dict)
    computed: dict[str, int] = field(default_factory=dict)
    seen_steps: int = 0
    counter: int = 0

    def prompt(self, n: int) -> list[int]:
        # Fresh random ids: no prompt shares a cached prefix with another, so every prompt token
        # is computed (the features count them so); checked through the engine's hit counter.
        return [self.rng.randrange(1, self.vocab_size) for _ in range(n)]

    async def request(self, tag: str, prompt_len: int, max_tokens: int, token_times: list[float] | None = None) -> int:
        self.counter += 1
        request_id = f"{tag}-{self.counter}"
        self.prompt_lens[request_id] = prompt_len
        params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
        n = 0
        async for ev in self.engine.generate(request_id, self.prompt(prompt_len), params):
            if ev.token_id is not None:
                n += 1
                if token_times is not None:
                    token_times.append(time.perf_counter())
        if n != max_tokens:
            raise RuntimeError(f"request {request_id} generated {n} tokens, asked {max_tokens}")
        return n

    async def batch(self, tag: str, batch: int, prompt_len: int, max_tokens: int) -> None:
        await asyncio.gather(*(self.request(tag, prompt_len, max_tokens) for _ in range(batch)))

    def new_samples(self) -> list[Sample]:
        """Features of the iterations that ended since the last call."""
        log = self.engine.step_log
        fresh = [r for r in log if r.index > self.seen_steps]
        if fresh:
            self.seen_steps = fresh[-1].index
        return step_samples(fresh, self.prompt_lens, self.computed)


@dataclass(frozen=True)
class ProfileRun:
    profile: WorkerProfile
    fit: FitResult
    samples: list[Sample]
    saturation_samples: list[Sample]
    cells: list[dict[str, Any]]
    sweep: Sweep
    wall_s: float

    def report(self) -> dict[str, Any]:
        """The full record for bench/results: the profile, the fit's evidence, every sample."""
        holdout = residual_stats(self.saturation_samples, self.profile.step_time) if self.saturation_samples else {}
        return {
            "profile": self.profile.model_dump(mode="json"),
            "fit": {
                **self.fit.report(),
                "r2": self.profile.step_time.r2,
                "mae_s": self.profile.step_time.mae_s,
                "holdout_saturation_steps": holdout,
            },
            "sweep": self.sweep.report(),
            "cells": self.cells,
            "samples_columns": ["index", *StepFeatures.model_fields, "step_s", "compute_s"],
            "samples": [s.row() for s in self.samples],
            "wall_s": round(self.wall_s, 2),
        }


def device_description(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    import os
    import platform

    return f"cpu ({os.cpu_count()} cores, {platform.processor() or platform.machine()}, torch {torch.__version__})"


async def profile_engine(
    model_path: Path,
    worker: WorkerConfig,
    sweep: Sweep,
    *,
    model_name: str,
    seed: int = 0,
    source_ref: str = "",
    quick: bool = False,
    created: str = "",
    progress: Any = None,
) -> ProfileRun:
    """Load the model, run the sweep and the saturation run on a fresh engine, fit, and build the
    profile. `progress(str)` hears what it is doing."""
    say = progress or (lambda _msg: None)
    t_begin = time.perf_counter()
    mcfg = load_config(model_path)
    device = torch.device(worker.device)
    dtype = resolve_dtype(worker.dtype, mcfg, device)
    model = await asyncio.to_thread(load_model, str(model_path), dtype=dtype, device=device)
    eos_ids = await asyncio.to_thread(eos_token_ids_in, model_path)
    engine_cfg = engine_config(worker, worker.kv_cache_tokens // worker.block_size)
    max_context = mcfg.max_context_tokens
    engine = Engine.create(model, eos_ids, engine_cfg, step_history=_STEP_HISTORY)
    driver = _Driver(engine, mcfg.vocab_size, random.Random(seed))
    cells: list[dict[str, Any]] = []
    samples: list[Sample] = []
    async with engine:
        say(f"warm-up: {sweep.warmup_requests} requests")
        await driver.batch("warmup", sweep.warmup_requests, 16, 4)
        driver.new_samples()  # not fitted: the first iterations build kernels and caches

        async def cell(kind: str, batch: int, prompt_len: int, max_tokens: int) -> None:
            t0 = time.perf_counter()
            await driver.batch(f"{kind}-b{batch}-l{prompt_len}", batch, prompt_len, max_tokens)
            got = driver.new_samples()
            samples.extend(got)
            cells.append(
                {
                    "kind": kind,
                    "batch": batch,
                    "prompt_tokens": prompt_len,
                    "output_tokens": max_tokens,
                    "iterations": len(got),
                    "wall_s": round(time.perf_counter() - t0, 4),
                    "sum_step_s": round(sum(s.step_s for s in got), 4),
                }
            )

        for prompt_len in sweep.prefill_lens:
            for batch in sweep.prefill_batches:
                if prompt_len + 1 > max_context or batch > engine_cfg.max_batch_size:
                    continue
                if batch * prompt_len > sweep.max_cell_tokens:
                    continue
                say(f"prefill: {batch} x {prompt_len} tokens, {sweep.prefill_reps} times")
                for _ in range(sweep.prefill_reps):
                    await cell("prefill", batch, prompt_len, 1)
        for prompt_len in sweep.decode_lens:
            for batch in sweep.decode_batches:
                if prompt_len + sweep.decode_tokens > max_context or batch > engine_cfg.max_batch_size:
                    continue
                say(f"decode: {batch} requests, context {prompt_len}+{sweep.decode_tokens}")
                await cell("decode", batch, prompt_len, sweep.decode_tokens)

        hit, _query = engine.prefix_cache_tokens
        if hit:
            raise RuntimeError(f"{hit} prompt tokens came from the prefix cache: the features would miscount them")
        say(f"fit: {len(samples)} iterations")
        overhead_s = _loop_overhead_s(cells)
        fit = fit_step_time(samples, loop_overhead_s=overhead_s)

        say(f"saturation: {engine_cfg.max_batch_size} requests in flight for {sweep.saturation_s:.0f} s")
        saturation, sat_samples = await _saturate(driver, engine_cfg.max_batch_size, sweep, fit)

    wall_s = time.perf_counter() - t_begin
    target = round(TARGET_FRACTION * saturation.decode_tps, 2)
    profile = WorkerProfile(
        schema_version=PROFILE_SCHEMA_VERSION,
        model=model_name,
        source="measured",
        source_ref=source_ref,
        device=device_description(device),
        dtype=str(dtype).removeprefix("torch."),
        engine=engine_cfg.model_dump(mode="json"),
        emulated_step_time=None
        if engine_cfg.pacing is None
        else {"base_s": engine_cfg.pacing.base_s, "per_token_s": engine_cfg.pacing.per_token_s},
        step_time=fit.model,
        saturation=saturation,
        recommended=Recommendation(target_decode_tps_per_instance=target, fraction_of_saturation=TARGET_FRACTION),
        created=created,
        quick=quick,
    )
    return ProfileRun(profile, fit, samples, sat_samples, cells, sweep, wall_s)


def _loop_overhead_s(cells: Sequence[dict[str, Any]]) -> float:
    """Per iteration, the wall time of the decode cells that the step timer did not see: the
    scheduling and bookkeeping between iterations (and the cell's start and end, a little)."""
    decode = [c for c in cells if c["kind"] == "decode" and c["iterations"]]
    steps = sum(c["iterations"] for c in decode)
    if not steps:
        return 0.0
    gap = sum(c["wall_s"] - c["sum_step_s"] for c in decode)
    return max(0.0, gap / steps)


async def _saturate(driver: _Driver, batch: int, sweep: Sweep, fit: FitResult) -> tuple[Saturation, list[Sample]]:
    """Keep `batch` requests in flight; measure generated tokens/s after the warm-up share."""
    rng = random.Random(driver.rng.random())
    low, high = sweep.saturation_output
    token_times: list[float] = []
    t_start = time.perf_counter()
    deadline = t_start + sweep.saturation_s
    window_begin = t_start + sweep.saturation_warmup * sweep.saturation_s
    marks: dict[str, tuple[float, int]] = {}

    async def slot() -> None:
        while time.perf_counter() < deadline:
            await driver.request("sat", sweep.saturation_prompt, rng.randint(low, high), token_times)

    async def mark(name: str, at: float) -> None:
        await asyncio.sleep(max(0.0, at - time.perf_counter()))
        marks[name] = (time.perf_counter(), driver.engine.step_log[-1].index if driver.engine.step_log else 0)

    driver.new_samples()
    await asyncio.gather(*(slot() for _ in range(batch)), mark("begin", window_begin), mark("end", deadline))
    (t0, first), (t1, last) = marks["begin"], marks["end"]
    window = [s for s in driver.new_samples() if first < s.index <= last]
    generated = sum(1 for t in token_times if t0 <= t < t1)
    window_s = t1 - t0
    prefill = sum(s.features.prefill_tokens for s in window)
    decode_rows = sum(s.features.decode_rows for s in window)
    rows = sum(s.features.decode_rows + s.features.prefill_seqs for s in window)
    ctx = sum(s.features.decode_context_tokens for s in window)
    predicted_s = sum(fit.model.step_s(s.features) for s in window)
    predicted_tps = rows / predicted_s if predicted_s > 0 else None
    if generated < 1 or not window:
        raise RuntimeError(f"saturation window of {window_s:.2f} s saw {generated} tokens, {len(window)} iterations")
    mean_ctx = ctx / decode_rows if decode_rows else 0.0
    saturation = Saturation(
        decode_tps=round(generated / window_s, 3),
        batch_size=batch,
        mean_running=round(rows / len(window), 3),
        prompt_tokens=sweep.saturation_prompt,
        output_tokens=(low, high),
        window_s=round(window_s, 3),
        generated_tokens=generated,
        steps=len(window),
        prefill_token_share=round(prefill / (prefill + decode_rows), 4) if prefill + decode_rows else 0.0,
        predicted_decode_tps=None if predicted_tps is None else round(predicted_tps, 3),
        mean_context_tokens=round(mean_ctx, 1),
    )
    return saturation, window
