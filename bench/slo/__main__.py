"""SLO mix on one worker: FCFS vs MAX_UTILIZATION vs SCORPIO, side by side, at rising request rates.

Usage:
    python -m bench.slo [--quick] [--model-dir models] [--trace PATH] [--out FILE]

EMULATED ACCELERATOR: the worker's engine runs the synthetic `tiny` model (its compute is a few
ms per step here) paced to `base_s + per_token_s * batch_tokens` per iteration, so its step times
are those of an accelerator, not of this CPU. The three setups are the worker's Engine, built as
a worker builds it, differing only in policy:
  fcfs             today's engine: FCFS admission under GUARANTEED_NO_EVICT;
  max_utilization  TensorRT-LLM's MAX_UTILIZATION: admit on the next step's blocks, pause
                   (recompute) the most recently started request when blocks run out;
  scorpio          SCORPIO: least-deadline-first queue, credit-based decode batching by TPOT
                   ratio, VBS admission with a TPOT model fitted online, a TTFT guard.

Workload: per rate, Poisson arrivals over a window; lengths sampled from the Azure
conversation trace (prompts scaled so the longest sampled is 384 tokens, outputs x0.25 clamped
to [4, 64]); each request is in one of three SLO classes, TPOT 50/100/200 ms with TTFT 1/2/4 s
(at the emulated pace); greedy decoding with ignore_eos, so every setup generates the same
tokens. The same requests and arrival times go to each setup, one setup at a time, rates
rising; each setup's engine lives across the rates (SCORPIO's fit carries over) and drains
between them.

Reported per setup and rate (`summary.summarize`): `goodput_rps` (requests meeting both SLOs
per second), `attainment` (over the requests sent; a refusal is a miss) and
`attainment_admitted` (over those not refused), TTFT/TPOT percentiles, refusals by SLO.
Target (`comparison`): at the lowest rate where FCFS attains under 50%, SCORPIO's goodput is
>= 2x FCFS's and >= 90% of the requests it admits meet their SLOs.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import json
import math
import platform
import random
import sys
import time
from pathlib import Path
from typing import Any

import torch

from bench.serving.workload import Request, WorkloadSpec, build
from bench.slo.summary import SloRecord, compare, rate_key, summarize
from blitzmesh.replay.trace import repo_relative
from services.common.log import configure_logging
from services.model_format import synth
from services.model_format.generation import eos_token_ids_in
from services.worker.engine.engine import Engine, EngineConfig, PacingProfile
from services.worker.engine.sampling import SamplingParams
from services.worker.engine.slo import RequestSLO, SLOUnattainable
from services.worker.model.llama import LlamaForCausalLM, load_model

REPO_ROOT = Path(__file__).resolve().parents[2]
DEFAULT_TRACE = REPO_ROOT / "traces" / "azure_llm_2023_conv.csv"
# (TPOT SLO, TTFT SLO) per class, seconds at the emulated pace.
CLASSES = ((0.05, 1.0), (0.10, 2.0), (0.20, 4.0))
PACING = PacingProfile(base_s=0.02, per_token_s=0.0004)
ENGINE = {"max_batch_size": 32, "max_num_tokens": 512, "block_size": 16, "num_kv_blocks": 256, "num_threads": 1}
POLICIES: dict[str, dict[str, Any]] = {
    "fcfs": {"capacity_policy": "GUARANTEED_NO_EVICT", "scheduling_policy": "fcfs"},
    "max_utilization": {"capacity_policy": "MAX_UTILIZATION", "scheduling_policy": "fcfs"},
    "scorpio": {"capacity_policy": "GUARANTEED_NO_EVICT", "scheduling_policy": "scorpio"},
}
# FCFS attained 0.89 at 16/s and 0.26 at 24/s in a calibration run (15 s windows).
QUICK = {"rates": (8.0, 16.0, 24.0, 32.0), "window_s": 15.0}
FULL = {"rates": (4.0, 8.0, 12.0, 16.0, 20.0, 24.0, 32.0, 40.0), "window_s": 30.0}
WARMUP_REQUESTS = 24
DRAIN_S = 180.0  # after the window, how long the stragglers of one rate may take


def engine_config(policy: str) -> EngineConfig:
    fields = {k: v for k, v in POLICIES[policy].items() if k in EngineConfig.model_fields}
    return EngineConfig(**ENGINE, **fields, pacing=PACING, enable_chunked_prefill=True)


def workload(rate: float, window_s: float, trace: Path, vocab_size: int, seed: int) -> list[tuple[float, int, Request]]:
    """(arrival s, SLO class, request), Poisson arrivals over the window, seeded per rate."""
    rng = random.Random(seed)
    arrivals: list[float] = []
    t = rng.expovariate(rate)
    while t < window_s:
        arrivals.append(t)
        t += rng.expovariate(rate)
    spec = WorkloadSpec(
        num_requests=max(1, len(arrivals)),
        max_prompt_tokens=384,
        output_scale=0.25,
        min_output_tokens=4,
        max_output_tokens=64,
        seed=seed,
    )
    requests = build(trace, spec, vocab_size)
    return [(a, rng.randrange(len(CLASSES)), r) for a, r in zip(arrivals, requests, strict=False)]


async def serve_rate(
    engine: Engine, tag: str, items: list[tuple[float, int, Request]], window_s: float
) -> list[SloRecord]:
    t0 = time.monotonic()
    records: list[SloRecord] = []

    async def one(arrival_s: float, cls: int, req: Request) -> None:
        tpot, ttft = CLASSES[cls]
        rec = SloRecord(req.index, cls, ttft, tpot, arrival_s, req.output_tokens)
        records.append(rec)
        await asyncio.sleep(max(0.0, t0 + arrival_s - time.monotonic()))
        rec.sent_s = time.monotonic() - t0
        params = SamplingParams(temperature=0.0, max_tokens=req.output_tokens, ignore_eos=True)
        try:
            stream = engine.generate(
                f"{tag}-{req.index}", list(req.prompt_ids), params, slo=RequestSLO(ttft_s=ttft, tpot_s=tpot)
            )
            async for ev in stream:
                if ev.token_id is not None:
                    now = time.monotonic() - t0
                    rec.first_token_s = now if rec.first_token_s is None else rec.first_token_s
                    rec.last_token_s = now
                    rec.tokens += 1
                if ev.finish_reason == "abort":
                    rec.outcome, rec.error = "error", "aborted"
            if rec.outcome == "lost":
                ok = rec.tokens == req.output_tokens
                rec.outcome = "ok" if ok else "error"
                rec.error = "" if ok else f"{rec.tokens} tokens of {req.output_tokens}"
        except SLOUnattainable as e:
            rec.outcome, rec.rejected_slo, rec.error = "rejected", e.slo, str(e)
        except Exception as e:  # every request ends in a record; the summary counts errors
            rec.outcome, rec.error = "error", f"{type(e).__name__}: {e}"

    tasks = [asyncio.create_task(one(a, c, r)) for a, c, r in items]
    done, pending = await asyncio.wait(tasks, timeout=window_s + DRAIN_S)
    for task in pending:
        task.cancel()  # their records stay "lost"
    await asyncio.gather(*pending, return_exceptions=True)
    for task in done:
        task.result()
    return sorted(records, key=lambda r: r.index)


async def wait_idle(engine: Engine, timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        s = engine.stats()
        if s.running == 0 and s.waiting == 0:
            return
        await asyncio.sleep(0.05)
    raise TimeoutError(f"engine still busy after {timeout_s} s: {engine.stats()}")


def engine_report(engine: Engine) -> dict[str, Any]:
    s = engine.stats()
    report: dict[str, Any] = {"preempted_total": s.preempted_total, "slo_rejected_total": s.slo_rejected_total}
    if s.est_tpot_s is not None:
        report["est_tpot_s"] = round(s.est_tpot_s, 4)
    scorpio_report = getattr(engine, "scorpio_report", None)
    if callable(scorpio_report):
        report["scorpio"] = scorpio_report()
    return report


async def run(args: argparse.Namespace) -> dict[str, Any]:
    settings = QUICK if args.quick else FULL
    rates: tuple[float, ...] = tuple(args.rates) if args.rates else settings["rates"]
    window_s: float = args.window_s or settings["window_s"]
    path = synth.synthesize(args.model_dir / "tiny", "tiny", seed=0)
    model: LlamaForCausalLM = await asyncio.to_thread(load_model, str(path))
    eos = await asyncio.to_thread(eos_token_ids_in, path)
    vocab = model.config.vocab_size
    engines = {name: Engine.create(model, eos, engine_config(name)) for name in args.policies}
    results: dict[str, dict[str, Any]] = {name: {} for name in args.policies}
    try:
        for name, engine in engines.items():
            await engine.start()
            warm = workload(4.0, WARMUP_REQUESTS / 4.0, args.trace, vocab, seed=999)
            await serve_rate(engine, f"warm-{name}", warm, WARMUP_REQUESTS / 4.0)
            await wait_idle(engine)
        for i, rate in enumerate(rates):
            items = workload(rate, window_s, args.trace, vocab, seed=1000 + i)
            for name, engine in engines.items():
                started = time.monotonic()
                records = await serve_rate(engine, f"{name}-r{rate_key(rate)}", items, window_s)
                await wait_idle(engine)
                summary = summarize(records, window_s)
                summary["run_s"] = round(time.monotonic() - started, 2)
                summary["engine"] = engine_report(engine)
                results[name][rate_key(rate)] = summary
                print(
                    f"rate {rate:>5g}/s  {name:<16} sent {summary['sent']:>4}  rejected {summary['rejected']:>4}  "
                    f"attainment {summary['attainment']}  admitted {summary['attainment_admitted']}  "
                    f"goodput {summary['goodput_rps']:.2f}/s  ttft p99 {summary['ttft_p99_s']}  "
                    f"tpot p99 {summary['tpot_p99_s']}",
                    flush=True,
                )
    finally:
        for engine in engines.values():
            await engine.stop()
    return {
        "bench": "slo",
        "quick": bool(args.quick),
        "when": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "host": {"python": platform.python_version(), "torch": torch.__version__, "cpus": _cpus()},
        "emulated_accelerator": {
            "note": "EMULATED accelerator pacing: step time = base_s + per_token_s * batch tokens; the tiny "
            "model's own compute is far below it",
            "base_s": PACING.base_s,
            "per_token_s": PACING.per_token_s,
        },
        "engine": {**ENGINE, "enable_chunked_prefill": True, "model": "synthetic tiny (2 layers)"},
        "slo_classes": [{"class": i, "tpot_slo_s": t, "ttft_slo_s": f} for i, (t, f) in enumerate(CLASSES)],
        "workload": {
            "trace": repo_relative(args.trace),
            "arrivals": "Poisson, seeded per rate; the same requests and times for every setup",
            "window_s": window_s,
            "rates_rps": list(rates),
            "prompts": "trace ContextTokens scaled so the longest sampled is 384 tokens",
            "outputs": "trace GeneratedTokens x0.25 clamped to [4, 64]; greedy, ignore_eos",
        },
        **results,
        "comparison": compare(results, rates),
    }


def _cpus() -> int:
    import os

    return len(os.sched_getaffinity(0))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.slo", description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help=f"rates {QUICK['rates']}, {QUICK['window_s']} s each")
    p.add_argument("--rates", type=float, nargs="+", help="request rates to run (per second)")
    p.add_argument(
        "--policies", nargs="+", choices=list(POLICIES), default=list(POLICIES), help="setups to run (default: all)"
    )
    p.add_argument("--window-s", type=float, default=None, help="arrival window per rate")
    p.add_argument("--model-dir", type=Path, default=REPO_ROOT / "models")
    p.add_argument("--trace", type=Path, default=DEFAULT_TRACE)
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args(argv)
    for rate in args.rates or ():
        if not (math.isfinite(rate) and rate > 0):
            p.error(f"--rates must be positive, got {rate!r}")
    if not args.trace.is_file():
        p.error(f"--trace {str(args.trace)!r} does not exist")
    configure_logging("bench.slo", "warning")  # a refusal is logged per request; the table says enough
    out = args.out or REPO_ROOT / "bench" / "results" / ("slo_quick.json" if args.quick else "slo.json")
    result = asyncio.run(run(args))
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n", encoding="utf-8")
    print(json.dumps(result["comparison"], indent=2))
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
