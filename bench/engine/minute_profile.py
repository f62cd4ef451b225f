"""The thinned trace minute (`replay.thin`) fed in-process to one engine built as a worker builds
it, to see where its CPU goes when dozens of prompts queue.

Usage:
    python -m bench.engine.minute_profile [--span 60] [--label NAME] [--cprofile FILE]
        [--solo] [--offered TOK_S] [--max-num-tokens N] [--max-batch-size N]
        [--kv-cache-tokens N] [--capacity-policy P] [--prefix-caching] [--out FILE] [--no-write]

The engine is a worker's (WorkerConfig defaults as the bench's mesh runs them: float32, prefix
caching off unless `--prefix-caching`; `kv_pool.engine_config` over a pool of `kv_cache_tokens`;
`Engine.create`), on the real default model. The requests of the first `--span` seconds of the
stored minute are thinned exactly as `replay.replay_minute` thins them (the same seeded random
token ids), and each is added open-loop at its arrival time, greedy, `ignore_eos`. Reported:
drain time (first arrival to the last request's end), TTFT p50/p99 (from each scheduled arrival),
the process's CPU seconds over the run (every thread: the event loop and the compute thread),
CPU per prompt token, and the steps (how many, their token and sequence counts, their mix).
`--solo` also times a few prompts of the minute's sizes one at a time on the same engine: the
CPU per prompt token when nothing is queued, the figure the minute is compared with.

`--cprofile FILE` profiles the compute thread and the event loop (both into FILE, pstats format)
and adds the top functions by own time to the report. The record goes into
bench/results/engine_minute_profile.json under `--label` (other labels kept), with the CPU model
and flags, the torch version and the environment used. Run with BLITZMESH_VARLEN_ATTENTION=0 for
the torch attention paths (what a CPU without AVX-512 uses).
"""

from __future__ import annotations

import argparse
import asyncio
import cProfile
import io
import json
import os
import platform
import pstats
import random
import time
from pathlib import Path
from typing import Any

import torch

from bench.engine.replay import MAX_PROMPT, load_minute, thin
from blitzmesh.replay.summary import percentile
from services.model_format.checkpoint import load_config
from services.model_format.generation import eos_token_ids_in
from services.worker.config import WorkerConfig
from services.worker.engine.engine import Engine
from services.worker.engine.sampling import SamplingParams
from services.worker.kv_pool import engine_config
from services.worker.model.llama import load_model, resolve_dtype

REPO = Path(__file__).resolve().parents[2]
MODEL_DIR = REPO / "models" / "smollm2-135m-instruct"
RESULTS = REPO / "bench" / "results" / "engine_minute_profile.json"
_ENV_KEYS = ("BLITZMESH_VARLEN_ATTENTION", "OMP_NUM_THREADS", "KMP_AFFINITY", "LD_PRELOAD")
_STEP_HISTORY = 1_000_000
# The load the problem was seen at: 75 requests of the minute, 63,922 prompt tokens in 60 s (four
# times replay.py's default OFFERED_TOK_S, which keeps 20 and never builds a queue).
OFFERED = 1200.0


def cpu_info() -> dict[str, Any]:
    """The CPU model, its core count and the SIMD flags that pick kernels (from /proc/cpuinfo)."""
    model, flags = platform.processor() or platform.machine(), []
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        text = ""
    for line in text.splitlines():
        key, _, value = line.partition(":")
        if key.strip() == "model name" and model in ("", platform.machine(), platform.processor()):
            model = value.strip()
        if key.strip() == "flags" and not flags:
            flags = value.split()
    wanted = ("avx", "avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512_bf16", "avx512_vnni", "amx_bf16")
    return {
        "model": model,
        "cores": os.cpu_count(),
        "simd_flags": [f for f in wanted if f in flags],
        "flags": sorted(flags),
    }


def build_engine(worker: WorkerConfig, model_dir: Path) -> tuple[Engine, int]:
    """The engine a worker with these options runs on this model (as `bench.profile.runner` builds
    it), and the model's vocabulary size."""
    mcfg = load_config(model_dir)
    device = torch.device(worker.device)
    dtype = resolve_dtype(worker.dtype, mcfg, device)
    model = load_model(str(model_dir), dtype=dtype, device=device)
    engine_cfg = engine_config(worker, worker.kv_cache_tokens // worker.block_size)
    engine = Engine.create(model, eos_token_ids_in(model_dir), engine_cfg, step_history=_STEP_HISTORY)
    return engine, mcfg.vocab_size


class _Steps:
    """Wraps the engine's compute-thread step (`Engine._execute`): each step's composition and the
    process CPU and wall time it took, and (when profiling) a cProfile of the compute thread,
    enabled inside it, beside one of the event loop."""

    def __init__(self, engine: Engine, profile: bool) -> None:
        self.loop = cProfile.Profile() if profile else None
        self.compute = cProfile.Profile() if profile else None
        self.on = False
        self.records: list[dict[str, Any]] = []
        execute = engine._execute

        def timed(inp: Any) -> Any:
            if not self.on:
                return execute(inp)
            cpu0, wall0 = time.process_time(), time.perf_counter()
            if self.compute is not None:
                self.compute.enable()
            try:
                return execute(inp)
            finally:
                if self.compute is not None:
                    self.compute.disable()
                q, c = inp.query_lens, inp.context_lens
                self.records.append(
                    {
                        "decodes": sum(1 for n, k in zip(q, c, strict=True) if n == 1 and k > 0),
                        "fresh_tokens": sum(n for n, k in zip(q, c, strict=True) if k == 0),
                        "chunk_tokens": sum(n for n, k in zip(q, c, strict=True) if n > 1 and k > 0),
                        "chunk_context": sum(k for n, k in zip(q, c, strict=True) if n > 1 and k > 0),
                        "cpu_s": time.process_time() - cpu0,
                        "wall_s": time.perf_counter() - wall0,
                    }
                )

        engine._execute = timed  # type: ignore[method-assign]

    def start(self) -> None:
        self.on = True
        if self.loop is not None:
            self.loop.enable()

    def stop(self) -> None:
        if self.loop is not None:
            self.loop.disable()
        self.on = False

    def summary(self) -> dict[str, Any]:
        """The steps by kind: decode-only, with prompt tokens (fresh prompts only, or with a later
        chunk of a prompt), each kind's count, tokens and CPU."""
        kinds: dict[str, list[dict[str, Any]]] = {"decode_only": [], "prompt_no_chunk": [], "prompt_with_chunk": []}
        for r in self.records:
            if r["chunk_tokens"]:
                kinds["prompt_with_chunk"].append(r)
            elif r["fresh_tokens"]:
                kinds["prompt_no_chunk"].append(r)
            else:
                kinds["decode_only"].append(r)
        out: dict[str, Any] = {
            "steps": len(self.records),
            "step_cpu_s": round(sum(r["cpu_s"] for r in self.records), 2),
            "step_wall_s": round(sum(r["wall_s"] for r in self.records), 2),
        }
        for kind, rs in kinds.items():
            out[kind] = {
                "steps": len(rs),
                "decodes": sum(r["decodes"] for r in rs),
                "fresh_tokens": sum(r["fresh_tokens"] for r in rs),
                "chunk_tokens": sum(r["chunk_tokens"] for r in rs),
                "chunk_context_mean": round(
                    sum(r["chunk_context"] for r in rs) / max(1, sum(1 for r in rs if r["chunk_tokens"])), 1
                ),
                "cpu_s": round(sum(r["cpu_s"] for r in rs), 2),
                "wall_s": round(sum(r["wall_s"] for r in rs), 2),
                "decodes_per_step_mean": round(sum(r["decodes"] for r in rs) / max(1, len(rs)), 1),
            }
        return derive_costs(out)

    def dump(self, path: Path, top: int = 25) -> list[dict[str, Any]]:
        assert self.compute is not None and self.loop is not None
        stats = pstats.Stats(self.compute)
        stats.add(self.loop)
        stats.dump_stats(str(path))
        rows = []
        raw: dict[Any, Any] = stats.stats  # type: ignore[attr-defined]
        for (file, line, name), (_cc, calls, tottime, cumtime, _callers) in sorted(
            raw.items(), key=lambda kv: -kv[1][2]
        )[:top]:
            where = file.replace(str(REPO) + "/", "")
            rows.append(
                {
                    "function": f"{where}:{line}({name})",
                    "calls": calls,
                    "own_s": round(tottime, 3),
                    "cum_s": round(cumtime, 3),
                }
            )
        buf = io.StringIO()
        pstats.Stats(str(path), stream=buf).sort_stats("tottime").print_stats(top)
        print(buf.getvalue())
        return rows


def derive_costs(summary: dict[str, Any]) -> dict[str, Any]:
    """`summary` (from `_Steps.summary`) with each kind's CPU per token added: per decode for the
    decode-only steps, per prompt token for the others, and each kind's share of the steps' CPU."""
    total = summary["step_cpu_s"] or 1.0
    for kind in ("decode_only", "prompt_no_chunk", "prompt_with_chunk"):
        k = summary[kind]
        k["cpu_share"] = round(k["cpu_s"] / total, 3)
        prompt = k["fresh_tokens"] + k["chunk_tokens"]
        if prompt:
            k["cpu_ms_per_prompt_token"] = round(1000 * k["cpu_s"] / prompt, 3)
            k["prompt_tokens_per_step_mean"] = round(prompt / max(1, k["steps"]), 1)
        elif k["decodes"]:
            k["cpu_ms_per_decode"] = round(1000 * k["cpu_s"] / k["decodes"], 3)
    return summary


async def _request(
    engine: Engine, request_id: str, prompt: list[int], n: int, at_s: float, t0: float
) -> dict[str, float]:
    await asyncio.sleep(max(0.0, t0 + at_s - time.perf_counter()))
    start = t0 + at_s
    params = SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)
    first = None
    tokens: list[int] = []
    async for ev in engine.generate(request_id, prompt, params):
        if ev.token_id is not None:
            tokens.append(ev.token_id)
            if first is None:
                first = time.perf_counter()
    end = time.perf_counter()
    if first is None or len(tokens) != n:
        raise RuntimeError(f"{request_id}: {len(tokens)} tokens, asked {n}")
    return {"ttft_s": first - start, "end_s": end - t0, "tokens": tokens}  # type: ignore[dict-item]


async def run_minute(
    engine: Engine, vocab: int, span_s: float, offered: float, seed: int, steps: _Steps
) -> dict[str, Any]:
    k, picked = thin(load_minute(), span_s, offered)
    rng = random.Random(seed)
    # The same prompts `replay.replay_minute` sends (ids in [100, 40000), below the vocabulary).
    prompts = [[rng.randrange(100, min(40000, vocab)) for _ in range(int(p))] for _, p, _ in picked]
    steps.start()
    cpu0, wall0 = time.process_time(), time.perf_counter()
    t0 = time.perf_counter() + 0.05
    results = await asyncio.gather(
        *(
            _request(engine, f"m{i}", prompt, int(o), float(t), t0)
            for i, ((t, _, o), prompt) in enumerate(zip(picked, prompts, strict=True))
        )
    )
    cpu, wall = time.process_time() - cpu0, time.perf_counter() - wall0
    steps.stop()
    ttfts = sorted(r["ttft_s"] for r in results)
    first_arrival = float(picked[0][0])
    drain = max(r["end_s"] for r in results) - first_arrival
    prompt_tokens = sum(len(p) for p in prompts)
    out = {
        "stride": k,
        "span_s": span_s,
        "offered_prompt_tok_s": offered,
        "requests": len(picked),
        "prompt_tokens": prompt_tokens,
        "output_tokens": int(sum(o for _, _, o in picked)),
        "drain_s": round(drain, 2),
        "ttft_p50_s": round(percentile(ttfts, 0.5) or 0.0, 2),
        "ttft_p99_s": round(percentile(ttfts, 0.99) or 0.0, 2),
        "wall_s": round(wall, 2),
        "cpu_s": round(cpu, 2),
        "cpu_ms_per_prompt_token": round(1000 * cpu / prompt_tokens, 3),
        "tokens_digest": _digest([r["tokens"] for r in results]),
    }
    out["steps"] = steps.summary()
    return out


def _digest(tokens: list[list[int]]) -> str:
    import hashlib

    return hashlib.sha256(json.dumps(tokens).encode()).hexdigest()[:16]


async def run_solo(engine: Engine, vocab: int, lens: tuple[int, ...], seed: int) -> list[dict[str, Any]]:
    """Prompts of `lens` tokens one at a time, one output token each: CPU per prompt token alone."""
    rng = random.Random(seed + 1)
    out = []
    for n in lens:
        prompt = [rng.randrange(100, min(40000, vocab)) for _ in range(n)]
        cpu0, wall0 = time.process_time(), time.perf_counter()
        res = await _request(engine, f"solo-{n}", prompt, 1, 0.0, time.perf_counter())
        cpu, wall = time.process_time() - cpu0, time.perf_counter() - wall0
        out.append(
            {
                "prompt_tokens": n,
                "ttft_s": round(res["ttft_s"], 3),
                "wall_s": round(wall, 3),
                "cpu_s": round(cpu, 3),
                "cpu_ms_per_prompt_token": round(1000 * cpu / n, 3),
            }
        )
    return out


async def main_async(args: argparse.Namespace) -> dict[str, Any]:
    options: dict[str, Any] = {"dtype": args.dtype, "enable_prefix_caching": args.prefix_caching}
    for name in ("max_num_tokens", "max_batch_size", "kv_cache_tokens", "capacity_policy"):
        if getattr(args, name):
            options[name] = getattr(args, name)
    worker = WorkerConfig(**options)
    engine, vocab = build_engine(worker, Path(args.model))
    steps = _Steps(engine, bool(args.cprofile))
    report: dict[str, Any] = {
        "worker": {
            "dtype": worker.dtype,
            "max_num_tokens": worker.max_num_tokens,
            "max_batch_size": worker.max_batch_size,
            "block_size": worker.block_size,
            "kv_cache_tokens": worker.kv_cache_tokens,
            "enable_chunked_prefill": worker.enable_chunked_prefill,
            "enable_prefix_caching": worker.enable_prefix_caching,
            "capacity_policy": worker.capacity_policy,
        }
    }
    async with engine:
        # Warm-up, not measured: kernels built, first-call costs paid.
        await asyncio.gather(
            *(_request(engine, f"warm{i}", [100 + i] * 300, 4, 0.0, time.perf_counter()) for i in range(3))
        )
        if args.solo:
            report["solo"] = await run_solo(engine, vocab, (512, 1024, MAX_PROMPT), args.seed)
        report["minute"] = await run_minute(engine, vocab, args.span, args.offered, args.seed, steps)
    if args.cprofile:
        report["top_own_time"] = steps.dump(Path(args.cprofile))
    return report


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--span", type=float, default=60.0, help="seconds of the minute to replay (thinned)")
    ap.add_argument(
        "--offered",
        type=float,
        default=OFFERED,
        help="thin to at most this many offered prompt tokens/s (replay.py's 300 keeps 20 requests; 1200: 75)",
    )
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--max-num-tokens", type=int, default=0, help="override WorkerConfig.max_num_tokens")
    ap.add_argument("--max-batch-size", type=int, default=0, help="override WorkerConfig.max_batch_size")
    ap.add_argument("--kv-cache-tokens", type=int, default=0, help="override WorkerConfig.kv_cache_tokens")
    ap.add_argument("--capacity-policy", default="", help="override WorkerConfig.capacity_policy")
    ap.add_argument("--prefix-caching", action="store_true", help="on (the bench's mesh runs it off)")
    ap.add_argument("--solo", action="store_true", help="also time prompts one at a time")
    ap.add_argument("--cprofile", default="", help="write a cProfile of the run here")
    ap.add_argument("--model", default=str(MODEL_DIR))
    ap.add_argument("--label", default="run")
    ap.add_argument("--note", default="")
    ap.add_argument("--out", default=str(RESULTS))
    ap.add_argument("--no-write", action="store_true")
    args = ap.parse_args(argv)
    report = asyncio.run(main_async(args))
    report.update(
        {
            "label": args.label,
            "note": args.note,
            "when": time.strftime("%Y-%m-%dT%H:%M:%S"),
            "cpu": cpu_info(),
            "torch": torch.__version__,
            "torch_threads": torch.get_num_threads(),
            "env": {k: os.environ[k] for k in _ENV_KEYS if k in os.environ},
            "loadavg_after": Path("/proc/loadavg").read_text().split()[:3] if Path("/proc/loadavg").exists() else None,
        }
    )
    print(json.dumps({k: v for k, v in report.items() if k != "top_own_time"}, indent=1))
    if not args.no_write:
        out = Path(args.out)
        record = json.loads(out.read_text()) if out.exists() else {"runs": {}}
        record["runs"][args.label] = report
        out.write_text(json.dumps(record, indent=1) + "\n")


if __name__ == "__main__":
    main()
