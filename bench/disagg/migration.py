"""Part "migration": how long a stream stalls when its instance dies, and whether any is lost.

A real mesh (`tiny` synthetic model, 3 workers, emulated accelerator pacing of 20 ms per engine
step so that streams outlive the kill; the model still computes every token) serves `streams`
greedy streams of `tokens` tokens through the SDK. Once every stream has sent its first token and
run for a while, the busiest worker is SIGKILLed. The gateway resumes each of its streams on
another instance from the prompt plus the tokens generated so far. Per migrated stream:

- `gap_s`: from the kill to its next token (the detection of the dead connection, a Schedule, the
  re-prefill of prompt + generated tokens on the new instance, one decode step);
- identical: its whole token sequence equals the same request served uninterrupted afterwards.

Lost = any stream that did not end with all its tokens (must be 0). Rounds restart the killed
worker and load it again before the next kill.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import statistics
import time
from pathlib import Path
from typing import Any

import blitzmesh
from services.mesh.launcher import Mesh, MeshConfig

REPO_ROOT = Path(__file__).resolve().parents[2]
MODEL = "tiny"
STEP_S = 0.02

NOTES = {
    "migration": "SIGKILL of the busiest of 3 workers mid-stream; gap = kill -> next token of each of its streams "
    f"(resumed elsewhere from prompt + generated tokens); emulated accelerator pacing {STEP_S} s a step, model tiny"
}


def _pct(values: list[float], q: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    return round(ordered[min(len(ordered) - 1, int(q * len(ordered)))], 4)


async def _round(mesh: Mesh, client: blitzmesh.AsyncClient, streams: int, tokens: int, run_s: float) -> dict[str, Any]:
    args = {"model": MODEL, "max_tokens": tokens, "ignore_eos": True, "temperature": 0, "return_token_ids": True}
    records: dict[int, list[tuple[float, blitzmesh.TokenChunk]]] = {i: [] for i in range(streams)}
    ended: dict[int, str] = {}

    async def run(i: int) -> None:
        try:
            async for chunk in client.generate(f"migrate {i}", **args):
                records[i].append((time.monotonic(), chunk))
            ended[i] = "ok"
        except blitzmesh.BlitzmeshError as e:
            ended[i] = f"error: {e}"

    tasks = [asyncio.create_task(run(i)) for i in range(streams)]
    deadline = time.monotonic() + 60
    while any(not r for r in records.values()):
        if time.monotonic() > deadline:
            raise TimeoutError("streams did not all start within 60 s")
        await asyncio.sleep(0.05)
    await asyncio.sleep(run_s)
    serving_on = collections.Counter(r[-1][1].instance_id for r in records.values() if r)
    victim = serving_on.most_common(1)[0][0]
    affected = [i for i, r in records.items() if r[-1][1].instance_id == victim and i not in ended]
    killed_s = time.monotonic()
    restart = asyncio.create_task(mesh.restart(victim))
    await asyncio.gather(*tasks)
    await restart
    references = await asyncio.gather(*(client.complete(f"migrate {i}", **args) for i in range(streams)))
    gaps = []
    for i in affected:
        after = [t for t, _ in records[i] if t > killed_s]
        if after:
            gaps.append(after[0] - killed_s)
    lost = [i for i in range(streams) if ended.get(i) != "ok" or sum(len(c.token_ids) for _, c in records[i]) != tokens]
    identical = sum(
        1 for i in range(streams) if [t for _, c in records[i] for t in c.token_ids] == list(references[i].token_ids)
    )
    # The killed worker comes back IDLE and the manager loads it again (min_instances = 3).
    deadline = time.monotonic() + 60
    while sum(i.state == "serving" for i in (await client.cluster()).instances) < 3:
        if time.monotonic() > deadline:
            raise TimeoutError(f"{victim} did not serve again within 60 s")
        await asyncio.sleep(0.2)
    return {"victim": victim, "migrated": len(affected), "gaps_s": [round(g, 4) for g in gaps], "lost": len(lost),
            "identical": identical, "streams": streams}  # fmt: skip


def run(args: argparse.Namespace) -> dict[str, Any]:
    return asyncio.run(_run(args))


async def _run(args: argparse.Namespace) -> dict[str, Any]:
    rounds, streams, tokens, run_s = (1, 16, 200, 1.0) if args.quick else (3, 24, 300, 2.0)
    cfg = MeshConfig(
        workers=3,
        initial_instances=3,
        model=MODEL,
        model_dir=REPO_ROOT / "models",
        run_dir=REPO_ROOT / "run" / "bench-disagg-migration",
        http_port=0,
        grpc_port=0,
        ready_timeout_s=180.0,
        worker_args=["--step-time-a-s", str(STEP_S), "--step-time-b-s", "0"],
    )
    mesh = Mesh(cfg)
    results = []
    try:
        await mesh.start()
        async with blitzmesh.AsyncClient(mesh.gateway_grpc, timeout_s=120, max_retries=0) as client:
            for r in range(rounds):
                results.append(await _round(mesh, client, streams, tokens, run_s))
                print(f"[migration] round {r + 1}: {results[-1]}", flush=True)
    finally:
        await mesh.stop()
    gaps = [g for r in results for g in r["gaps_s"]]
    return {
        "rounds": results,
        "migrated_streams": sum(r["migrated"] for r in results),
        "gap_p50_s": _pct(gaps, 0.5),
        "gap_p99_s": _pct(gaps, 0.99),
        "gap_max_s": round(max(gaps), 4) if gaps else None,
        "gap_mean_s": round(statistics.fmean(gaps), 4) if gaps else None,
        "lost": sum(r["lost"] for r in results),
        "identical_to_uninterrupted": f"{sum(r['identical'] for r in results)}/{sum(r['streams'] for r in results)}",
        "setup": {"streams": streams, "tokens": tokens, "run_before_kill_s": run_s, "step_s": STEP_S, "workers": 3},
    }


def targets(result: dict[str, Any]) -> dict[str, Any]:
    return {"migration_lost": {"value": result["lost"], "target": 0, "met": result["lost"] == 0}}
