"""Part "serving": colocated serving on 2 workers against prefill/decode disaggregation on 1P+1D.

Both meshes run at once (`tiny` synthetic model; emulated accelerator pacing: each engine
iteration lasts at least `STEP_A_S + STEP_B_S * batch_tokens`, so a prompt costs what it would on
an accelerator and a decode step shares its iteration with whatever prefill joins it; the model
still computes every token on the CPU). For each rate, rising, each mesh in turn (A B per rate,
the order alternating) replays the same open-loop Poisson arrivals, with prompt and output
lengths drawn from the Azure conversation trace and scaled to the model. Per mesh and rate: TTFT
and mean TBT p50/p99 as the client saw them, SLO attainment and goodput (requests that met the
SLO per second of offered load).
"""

from __future__ import annotations

import argparse
import asyncio
import random
from pathlib import Path
from typing import Any

from blitzmesh.replay.runner import replay
from blitzmesh.replay.schedule import Arrival, TokenScaling
from blitzmesh.replay.summary import Slo, summarize
from blitzmesh.replay.trace import read_azure_trace
from services.mesh.launcher import Mesh, MeshConfig

REPO_ROOT = Path(__file__).resolve().parents[2]
TRACE = REPO_ROOT / "traces" / "azure_llm_2023_conv.csv"
MODEL = "tiny"
STEP_A_S = 0.02
STEP_B_S = 0.0004
SLO = Slo(ttft_s=1.0, tbt_s=0.05)
SCALING = TokenScaling(prompt_scale=1 / 4, max_prompt_tokens=384, max_output_tokens=96, context_tokens=2048)

NOTES = {
    "serving": f"colocated 2 workers vs 1 prefill + 1 decode, same open-loop Poisson arrivals per rate (conv trace "
    f"lengths x{SCALING.prompt_scale:g} prompt, <= {SCALING.max_output_tokens} output); EMULATED accelerator pacing "
    f"{STEP_A_S} s + {STEP_B_S} s per batch token per iteration (model {MODEL}); SLO TTFT <= {SLO.ttft_s} s and mean "
    f"TBT <= {SLO.tbt_s} s; goodput = SLO-met requests per second"
}


def arrivals(rate_rps: float, duration_s: float, seed: int) -> list[Arrival]:
    """Poisson arrivals at `rate_rps` for `duration_s`, lengths from the conversation trace."""
    rows = read_azure_trace(TRACE)
    rng = random.Random(seed)
    out: list[Arrival] = []
    t = rng.expovariate(rate_rps)
    while t < duration_s:
        row = rows[rng.randrange(len(rows))]
        prompt, output = SCALING.apply(row.prompt_tokens, row.output_tokens)
        out.append(Arrival(len(out), t, prompt, output))
        t += rng.expovariate(rate_rps)
    return out


def mesh_config(name: str, **roles: int) -> MeshConfig:
    return MeshConfig(
        model=MODEL,
        model_dir=REPO_ROOT / "models",
        run_dir=REPO_ROOT / "run" / f"bench-disagg-serving-{name}",
        http_port=0,
        grpc_port=0,
        ready_timeout_s=180.0,
        worker_args=["--step-time-a-s", str(STEP_A_S), "--step-time-b-s", str(STEP_B_S)],
        **roles,  # type: ignore[arg-type]
    )


def run(args: argparse.Namespace) -> dict[str, Any]:
    return asyncio.run(_run(args))


async def _run(args: argparse.Namespace) -> dict[str, Any]:
    rates, duration_s = ([2.0, 5.0], 15.0) if args.quick else ([2.0, 4.0, 6.0, 8.0], 30.0)
    meshes = {
        "colocated_2": Mesh(mesh_config("colocated", workers=2, initial_instances=2)),
        "disagg_1p1d": Mesh(mesh_config("disagg", workers=2, prefill=1, decode=1)),
    }
    results: dict[str, list[dict[str, Any]]] = {name: [] for name in meshes}
    try:
        for mesh in meshes.values():
            await mesh.start()
        for i, rate in enumerate(rates):
            schedule = arrivals(rate, duration_s, seed=i)
            order = list(meshes) if i % 2 == 0 else list(reversed(meshes))
            for name in order:
                mesh = meshes[name]
                res = await replay(schedule, http_url=mesh.gateway_http, model=MODEL, drain_timeout_s=60.0)
                summary = summarize(res.records, [], res.duration_s, SLO)
                met = round(sum(SLO.met(r) for r in res.records) / duration_s, 3)
                row = {
                    "rate_rps": rate,
                    "requests": len(schedule),
                    "ttft_s": summary["ttft_s"],
                    "tbt_mean_s": summary["tbt_mean_s"],
                    "slo_attainment": summary["slo_attainment"],
                    "goodput_rps": met,
                    "output_tokens_per_s": round(summary["output_tokens"] / res.duration_s, 1),
                    "completed": summary["completed"],
                    "errored": summary["errored"],
                    "lost": summary["lost"],
                }
                results[name].append(row)
                print(f"[serving] {name} rate={rate}: {row}", flush=True)
    finally:
        for mesh in meshes.values():
            await mesh.stop()
    return {
        **results,
        "setup": {
            "rates_rps": rates,
            "duration_s": duration_s,
            "model": MODEL,
            "pacing": {"emulated": True, "step_a_s": STEP_A_S, "step_b_s_per_token": STEP_B_S},
            "slo": {"ttft_s": SLO.ttft_s, "tbt_mean_s": SLO.tbt_s},
            "scaling": {
                "prompt_scale": SCALING.prompt_scale,
                "max_prompt_tokens": SCALING.max_prompt_tokens,
                "max_output_tokens": SCALING.max_output_tokens,
            },  # fmt: skip
        },
    }


def targets(result: dict[str, Any]) -> dict[str, Any]:
    """Reported, not a pass/fail target: the issue asks for the comparison. Lost must be 0."""
    lost = sum(r["lost"] for name in ("colocated_2", "disagg_1p1d") for r in result.get(name, []))
    gains = {
        str(c["rate_rps"]): round(d["goodput_rps"] / c["goodput_rps"], 2) if c["goodput_rps"] else None
        for c, d in zip(result.get("colocated_2", []), result.get("disagg_1p1d", []), strict=False)
    }
    return {
        "serving_lost": {"value": lost, "target": 0, "met": lost == 0},
        "serving_goodput_disagg_over_colocated": {"value": gains, "target": "reported"},
    }
