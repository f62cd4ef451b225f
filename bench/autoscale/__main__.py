"""Autoscaling on the local mesh against a compressed replay of the Azure code trace.

Usage:
    python -m bench.autoscale [--quick] [--trace traces/azure_llm_2023_code.csv]
        [--policy heteroscale] [--policy-params '{"scale_in_cooldown_s": 20}']
        [--step-time-a-s 0.05 --step-time-b-s 0.002] [--runs autoscaled,fixed_average,fixed_peak]
        [--out bench/results/autoscale.json] [--plot bench/results/autoscale.png]

One mesh of `small`-model workers with the emulated accelerator on (every engine step paced to
a + b * batch tokens; the profile is in the result) replays the same open-loop schedule for each
run: `autoscaled` (one instance at first, the policy acting, HeteroScale by default, the other
workers IDLE), `autoscaled_bounds` (the same with the BlitzScale-bounds policy, which reads
waiting prefill tokens), `fixed_average` (a fixed pool sized for the mean request rate) and
`fixed_peak` (sized for the busiest 5 s). Between runs the policy is put in advisory mode and the pool is resized through the
Admin API (Scale, which drains or loads instances), then the load windows are let empty.
Writes the JSON result (requests_sent, completed, errored, lost, slo_attainment,
instance_seconds per run), a PNG of instances / request rate / TTFT p99 over time, and the
autoscaled runs' decision logs (`time,action,target,status,reason`) beside the PNG.
`--quick` replays 8 trace minutes in 40 s (under 5 minutes in all); the default 30 minutes in
300 s. The two CPU cores do not add compute with more workers: the pacing is what scales, and
the machine's other load shows up in the numbers.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import os
import platform
import re
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import aiohttp

import blitzmesh
from bench.autoscale.sizing import Profile, size_pools
from blitzmesh.replay import (
    Slo,
    TokenScaling,
    TraceWindow,
    describe,
    from_trace,
    read_azure_trace,
    replay,
    summarize,
    timeline,
    token_rate,
)
from services.global_manager.config import ZIGZAG_DEFAULTS
from services.global_manager.core.reconcile import kept_warm_s
from services.mesh.launcher import Mesh, MeshConfig, metrics_targets

REPO_ROOT = Path(__file__).resolve().parents[2]
TOKEN_RATE_BIN_S = 1.0
DEFAULT_TRACE = REPO_ROOT / "traces" / "azure_llm_2023_code.csv"
SCALE_EVENTS = (
    "autoscaling_decision",
    "autoscaling_bound",
    "scale_out",
    "scale_in",
    "load_result",
    "drain_result",
    "rebalance",
    "live_scaling",
    "zigzag_pair",
    "zigzag_stopped",
    "live_migration",
    "zigzag_take_back",
)

# Replay windows of the code trace (trace seconds) and how hard they are squeezed.
QUICK = {"start_s": 480.0, "span_s": 480.0, "compress": 12.0, "thin": 24}
FULL = {"start_s": 0.0, "span_s": 1800.0, "compress": 6.0, "thin": 12}


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m bench.autoscale", description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="8 trace minutes in 40 s per run")
    p.add_argument("--trace", type=Path, default=DEFAULT_TRACE)
    p.add_argument("--model", default="small")
    p.add_argument("--model-dir", type=Path, default=REPO_ROOT / "models")
    p.add_argument("--vocab-size", type=int, default=8000, help="prompt ids are drawn below this")
    p.add_argument("--step-time-a-s", type=float, default=0.05, help="emulated accelerator: fixed step time")
    p.add_argument("--step-time-b-s", type=float, default=0.002, help="emulated accelerator: per batch token")
    p.add_argument("--target-utilization", type=float, default=0.7, help="what the fixed pools are sized for")
    p.add_argument(
        "--autoscale-utilization",
        type=float,
        default=0.5,
        help="what the policy's decode-TPS target is set at: lower than the fixed pools' because a "
        "reactive policy needs headroom for its lag (the TPS window, the load time)",
    )
    p.add_argument("--policy", default="heteroscale")
    p.add_argument("--policy-params", default="{}", help="JSON object overriding the derived parameters")
    p.add_argument("--ttft-slo-s", type=float, default=1.5)
    p.add_argument("--tbt-slo-s", type=float, default=0.2, help="SLO on each request's mean time between tokens")
    p.add_argument(
        "--runs",
        default="autoscaled,autoscaled_bounds,fixed_average,fixed_peak",
        help="comma-separated subset; autoscaled_bounds runs the BlitzScale-bounds policy (waiting "
        "prefill tokens) as a second autoscaler",
    )
    p.add_argument(
        "--dataplane",
        choices=("tcp", "ucx", "auto"),
        default="tcp",
        help="workers' and parameter manager's transport; tcp by default, as in the recorded runs, which "
        "predate services/dataplane/ucx.py's own progress loop (ucxx's kept an idle UCX process at a "
        "full core; now ucx idles at 0%% too)",
    )
    p.add_argument(
        "--rebalance",
        choices=("on", "off", "both"),
        default="on",
        help="the manager's rebalancing of queued requests onto a new instance; 'both' replays the runs "
        "with it on, then off, each in a fresh mesh, and adds the key `rebalance` (SLO attainment and "
        "instance-seconds side by side)",
    )
    p.add_argument(
        "--zigzag",
        choices=("on", "off", "both"),
        default="on",
        help="ZigZag live scaling in the manager; 'both' replays the runs with it on and off, each in a fresh "
        "mesh, --repeats times in alternating order, and adds the key `zigzag` (side by side)",
    )
    p.add_argument(
        "--zigzag-dispatch",
        choices=("route", "pull"),
        default=ZIGZAG_DEFAULTS.dispatch,
        help="how ZigZag work reaches a loading instance (the manager's --zigzag-dispatch, default its own)",
    )
    p.add_argument(
        "--repeats",
        type=int,
        default=1,
        help="with --zigzag/--rebalance both: on/off pairs to run; otherwise the runs are replayed this many "
        "times, each time in a fresh mesh and in alternating order, and `targets` takes the median of the "
        "paired differences",
    )
    p.add_argument(
        "--link-gbps",
        type=float,
        default=0.0,
        help="emulated data-plane link of every sender (parameter manager, workers), Gbit/s; 0 = unshaped. A "
        "slower link makes loads last as they would for a model that is large against its link",
    )
    p.add_argument(
        "--max-batch-size",
        type=int,
        default=0,
        help="workers' max batch size (0 = the worker's default, 32); a smaller batch makes a burst queue, "
        "which is what ZigZag's gate waits for",
    )
    p.add_argument(
        "--max-num-tokens",
        type=int,
        default=256,
        help="workers' token budget per engine step (0 = the worker's default, 2048). At the emulated 2 ms a "
        "token, 2048 prompt tokens make one step last 4.1 s, longer than the TTFT SLO, and a burst's prompts "
        "all start in that step on the instance they reached, where no new instance can take them. 256 "
        "tokens is a 0.56 s step: the size a deployment picks for its accelerator's step time",
    )
    p.add_argument(
        "--warmup",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="serve the schedule's first requests on every worker, unmeasured, before the runs of each mesh",
    )
    p.add_argument("--bin-s", type=float, default=2.5, help="plot and timeline bin")
    p.add_argument("--out", type=Path, default=REPO_ROOT / "bench" / "results" / "autoscale.json")
    p.add_argument("--plot", type=Path, default=None, help="default: the --out path with .png")
    p.add_argument("--run-dir", type=Path, default=REPO_ROOT / "run" / "bench-autoscale")
    args = p.parse_args(argv)
    if args.repeats < 1:
        p.error(f"--repeats must be at least 1, got {args.repeats}")
    if args.max_num_tokens < 0:
        p.error(f"--max-num-tokens must be 0 (the worker's default) or more, got {args.max_num_tokens}")
    return args


async def _settle(admin: blitzmesh.AsyncClient, model: str, serving: int, timeout_s: float) -> None:
    """Until exactly `serving` instances serve, none loads or drains, and the load reports are
    quiet (so the next run's policy does not see the last run's tail)."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    while True:
        cluster = await admin.cluster()
        mine = [i for i in cluster.instances if i.model_id == model and i.state in ("loading", "serving", "draining")]
        states = [i.state for i in mine]
        busy = sum(i.load.running + i.load.waiting for i in mine)
        held = {i.instance_id: (i.load.running, i.load.waiting) for i in mine if i.load.running + i.load.waiting}
        tps = sum(i.load.decode_tps for i in mine)
        if states.count("serving") == serving and len(states) == serving and busy == 0 and tps < 0.5:
            return
        if loop.time() > deadline:
            raise TimeoutError(
                f"cluster did not settle at {serving} serving in {timeout_s}s: states={states} "
                f"running+waiting={busy} (running, waiting by instance: {held}) decode_tps={tps:.2f}"
            )
        await asyncio.sleep(0.5)


async def _zigzag_continued(admin: blitzmesh.AsyncClient, model: str) -> int:
    """ZigZag requests the model's instances have taken over from loading ones so far (from
    their load reports, up to a heartbeat old)."""
    cluster = await admin.cluster()
    return sum(i.load.zigzag_continued_total for i in cluster.instances if i.model_id == model)


async def _resize(admin: blitzmesh.AsyncClient, model: str, n: int) -> None:
    cluster = await admin.cluster()
    live = [i for i in cluster.instances if i.model_id == model and i.state in ("loading", "serving")]
    if len(live) != n:
        await admin.scale(model, n - len(live), wait=True, timeout_s=180)


async def run_all(
    names: list[str],
    mesh_cfg: MeshConfig,
    pools: dict[str, int],
    arrivals: list[Any],
    args: argparse.Namespace,
    policies: dict[str, tuple[str, dict[str, Any]]],
    drain_timeout_s: float,
) -> dict[str, dict[str, Any]]:
    mesh = Mesh(mesh_cfg)
    started = time.perf_counter()
    runs: dict[str, dict[str, Any]] = {}
    slo = Slo(ttft_s=args.ttft_slo_s, tbt_s=args.tbt_slo_s)
    try:
        await mesh.start()
        print(f"mesh up in {time.perf_counter() - started:.1f}s ({mesh_cfg.workers} workers)", flush=True)
        async with blitzmesh.AsyncClient(mesh.gateway_grpc, timeout_s=30) as admin:
            if args.warmup:
                await _warm_up(admin, mesh, arrivals, args, pools, policies, drain_timeout_s)
            for name in names:
                policy, params = policies.get(name, policies["autoscaled"])
                await admin.set_policy(policy, params, advisory=True)  # hold still while resizing
                await _resize(admin, args.model, pools[name])
                await _settle(admin, args.model, pools[name], timeout_s=90)
                if name in policies:
                    await admin.set_policy(policy, params, advisory=False)
                print(f"[{name}] {pools[name]} serving; replaying {len(arrivals)} requests", flush=True)
                zigzag_before = await _gateway_counter(mesh, "blitzmesh_gateway_zigzag_total")
                routes_before = await _gateway_counter(mesh, "blitzmesh_gm_schedule_total", "global_manager")
                continued_before = await _zigzag_continued(admin, args.model)
                result = await _replay(mesh, arrivals, args, drain_timeout_s, seed=PROMPT_SEEDS.get(name, 0))
                summary = summarize(result.records, result.instances, result.duration_s, slo)
                zigzag_after = await _gateway_counter(mesh, "blitzmesh_gateway_zigzag_total")
                routes_after = await _gateway_counter(mesh, "blitzmesh_gm_schedule_total", "global_manager")
                summary.update(
                    {
                        "initial_instances": pools[name],
                        "notes": result.notes,
                        "zigzag_requests": {k: round(v - zigzag_before.get(k, 0.0)) for k, v in zigzag_after.items()},
                        # The manager's Schedule answers by outcome (pd_pair, one_hop, borrowed, ...).
                        "routes": {k: round(v - routes_before.get(k, 0.0)) for k, v in routes_after.items()},
                        # Taken over by a partner after their first layers ran on a loading
                        # instance, however they got there (routed, or pulled from the queue).
                        "zigzag_continued": await _zigzag_continued(admin, args.model) - continued_before,
                        "missed": missed_requests(result.records, slo),
                    }
                )
                # Drained instances that kept the weights held their GPU meanwhile.
                warm_s = warm_instance_seconds(result.events, result.duration_s)
                summary["instance_seconds_held"] = summary["instance_seconds"]
                summary["warm_instance_seconds"] = warm_s
                summary["instance_seconds"] = round(summary["instance_seconds"] + warm_s, 2)
                print(
                    f"[{name}] "
                    + json.dumps(
                        {
                            k: summary[k]
                            for k in (
                                "requests_sent",
                                "completed",
                                "errored",
                                "lost",
                                "slo_attainment",
                                "instance_seconds",
                                "ttft_s",
                            )
                        }
                    ),
                    flush=True,
                )
                runs[name] = {
                    "summary": summary,
                    "timeline": timeline(result.records, result.instances, args.bin_s, result.duration_s, slo),
                    "samples": [(round(s.t_s, 2), s.held) for s in result.instances],
                    "tokens_per_s": token_rate(result.records, TOKEN_RATE_BIN_S, result.duration_s),
                    "loading": [(round(s.t_s, 2), s.loading) for s in result.instances if s.loading],
                    "events": [e for e in result.events if e["action"] in SCALE_EVENTS],
                }
    finally:
        await mesh.stop()
    return runs


# The token ids each replay draws its prompts from (the same lengths and times, other ids). The
# runs share a mesh, and an instance kept across a resize keeps its prefix cache: with one seed
# for every run (until 2026-11-29), a later run found the KV of an earlier run's identical
# prompts on the instances it kept, and the warm-up's on its first 24 requests. Other callers of
# `run_all` (bench.live_scaling: a fresh mesh per setup, no warm-up) keep seed 0.
PROMPT_SEEDS = {"warm-up": 100, "autoscaled": 1, "fixed_average": 2, "fixed_peak": 3, "autoscaled_bounds": 4}


async def _replay(
    mesh: Mesh, arrivals: list[Any], args: argparse.Namespace, drain_timeout_s: float, *, seed: int
) -> Any:
    return await replay(
        arrivals,
        http_url=mesh.gateway_http,
        model=args.model,
        admin_target=mesh.gateway_grpc,
        request_timeout_s=60.0,
        drain_timeout_s=drain_timeout_s,
        vocab_size=args.vocab_size,
        seed=seed,
    )


WARMUP_REQUESTS = 24


async def _warm_up(
    admin: blitzmesh.AsyncClient,
    mesh: Mesh,
    arrivals: list[Any],
    args: argparse.Namespace,
    pools: dict[str, int],
    policies: dict[str, tuple[str, dict[str, Any]]],
    drain_timeout_s: float,
) -> None:
    """Serve the schedule's first requests on every worker once, unmeasured. A fresh mesh's first
    requests are slow everywhere (first engine steps, first routes); without this, whichever run
    came first paid for it: 0.13-0.20 of SLO attainment for `autoscaled` when it ran first
    (2026-11-28, `autoscale_repeats_cold_quick.json`)."""
    policy, params = policies["autoscaled"]
    await admin.set_policy(policy, params, advisory=True)
    peak = max(pools.values())
    await _resize(admin, args.model, peak)
    await _settle(admin, args.model, peak, timeout_s=90)
    started = time.perf_counter()
    await _replay(mesh, arrivals[:WARMUP_REQUESTS], args, drain_timeout_s, seed=PROMPT_SEEDS["warm-up"])
    print(
        f"warm-up: {WARMUP_REQUESTS} requests on {peak} instances in {time.perf_counter() - started:.1f}s", flush=True
    )


async def _gateway_counter(mesh: Mesh, name: str, service: str = "gateway") -> dict[str, float]:
    """A counter's samples by label set, from the /metrics of `service` (the gateway's HTTP port,
    or another process's metrics port)."""
    url = mesh.gateway_http if service == "gateway" else f"http://{metrics_targets(mesh)[service]}"
    async with aiohttp.ClientSession() as s, s.get(url + "/metrics") as r:
        text = await r.text()
    return {labels: float(v) for labels, v in re.findall(rf"^{name}\{{([^}}]*)\}} (\S+)$", text, re.M)}


def _ab_comparison(by_setting: dict[str, list[dict[str, dict[str, Any]]]], flag: str) -> dict[str, Any]:
    """Per run: SLO attainment, instance-seconds, TTFT p50/p99, lost, and what the feature did, with
    `flag` on and off, every repeat, and the on - off difference of each pair."""
    repeats = len(by_setting["on"])
    out: dict[str, Any] = {
        "order": "pairs in alternating order (on, off), (off, on), ...; each run in a fresh mesh on the same "
        "arrival schedule",
        "repeats": repeats,
    }
    for name in by_setting["on"][0]:
        row: dict[str, Any] = {}
        for setting, reps in by_setting.items():
            row[setting] = []
            for runs in reps:
                s = runs[name]["summary"]
                moved = sum(1 for e in runs[name]["events"] if e["action"] == "rebalance" and e["status"] == "moved")
                row[setting].append(
                    {
                        **_run_row(s),
                        "rebalance_events_moved": moved,
                        "zigzag_requests": s.get("zigzag_requests", {}),
                        "zigzag_pairs": sum(1 for e in runs[name]["events"] if e["action"] == "zigzag_pair"),
                    }
                )
        diffs = [
            round(a["slo_attainment"] - b["slo_attainment"], 4)
            for a, b in zip(row["on"], row["off"], strict=True)
            if a["slo_attainment"] is not None and b["slo_attainment"] is not None
        ]
        row["slo_attainment_on_minus_off"] = diffs
        ttft = [
            round(a["ttft_p99_s"] / b["ttft_p99_s"], 3)
            for a, b in zip(row["on"], row["off"], strict=True)
            if a["ttft_p99_s"] and b["ttft_p99_s"]
        ]
        row["ttft_p99_on_over_off"] = ttft
        out[name] = row
    out["flag"] = flag
    return out


SLO_GAIN_TARGET = 0.1  # autoscaled over the pool sized for the average, in SLO attainment


def _median(xs: list[float]) -> float | None:
    return round(statistics.median(xs), 4) if xs else None


def autoscale_targets(repeats: list[dict[str, dict[str, Any]]]) -> dict[str, Any]:
    """The issue's target, taken repeat by repeat (each repeat replays every run in one fresh
    mesh): autoscaled's SLO attainment minus the average-sized pool's (>= +0.1), and
    autoscaled's instance-seconds against the peak-sized pool's (fewer). `{}` when a run is
    missing."""
    names = ("autoscaled", "fixed_average", "fixed_peak")
    if not repeats or any(n not in r for r in repeats for n in names):
        return {}
    summaries = [{n: r[n]["summary"] for n in names} for r in repeats]
    gains = [
        round(s["autoscaled"]["slo_attainment"] - s["fixed_average"]["slo_attainment"], 4)
        for s in summaries
        if s["autoscaled"]["slo_attainment"] is not None and s["fixed_average"]["slo_attainment"] is not None
    ]
    cost = [
        round(s["autoscaled"]["instance_seconds"] / s["fixed_peak"]["instance_seconds"], 3)
        for s in summaries
        if s["fixed_peak"]["instance_seconds"]
    ]
    gain, share = _median(gains), _median(cost)
    return {
        "slo_autoscaled_minus_fixed_average": {
            "value": gain,
            "per_repeat": gains,
            "target": SLO_GAIN_TARGET,
            "met": gain is not None and gain >= SLO_GAIN_TARGET,
        },
        "instance_seconds_autoscaled_over_fixed_peak": {
            "value": share,
            "per_repeat": cost,
            "target": "< 1",
            "met": share is not None and share < 1,
        },
        "lost": {"value": sum(s[n]["lost"] for s in summaries for n in names), "target": 0},
    }


def missed_requests(records: list[Any], slo: Slo) -> list[dict[str, Any]]:
    """The requests that missed the SLO, each with why and the times that tell where it was
    held up (seconds after the replay started), in order of arrival."""
    out = []
    for r in sorted(records, key=lambda r: r.scheduled_s):
        cause = slo.miss(r)
        if cause is not None:
            out.append(
                {
                    "index": r.index,
                    "cause": cause,
                    "scheduled_s": round(r.scheduled_s, 3),
                    "ttft_s": None if r.ttft_s is None else round(r.ttft_s, 3),
                    "tbt_mean_s": None if r.tbt_mean_s is None else round(r.tbt_mean_s, 3),
                    "tbt_max_s": None if r.tbt_max_s is None else round(r.tbt_max_s, 3),
                    "prompt_tokens": r.prompt_tokens,
                    "completion_tokens": r.completion_tokens,
                }
            )
    return out


def _repeat_rows(repeats: list[dict[str, dict[str, Any]]]) -> dict[str, list[dict[str, Any]]]:
    """Per run, each repeat's SLO attainment, instance-seconds, TTFT p50/p99 and lost."""
    rows: dict[str, list[dict[str, Any]]] = {}
    for runs in repeats:
        for name, run in runs.items():
            rows.setdefault(name, []).append(_run_row(run["summary"]))
    return rows


def _run_row(s: dict[str, Any]) -> dict[str, Any]:
    """One run's SLO attainment and its misses by cause, instance-seconds, TTFT p50/p99 and
    lost, from its summary."""
    return {
        "slo_attainment": s["slo_attainment"],
        "slo_misses": s["slo_misses"],
        "missed": s.get("missed", []),
        "instance_seconds": s["instance_seconds"],
        "ttft_p50_s": s["ttft_s"]["p50"],
        "ttft_p99_s": s["ttft_s"]["p99"],
        "lost": s["lost"],
    }


def warm_instance_seconds(events: list[dict[str, Any]], end_s: float) -> float:
    """Instance-seconds that drained instances held the weights after a scale-in (the manager's
    keep-warm): from each drain's end to the first of its reload, its keep time's end and
    `end_s`. The GPU holds them, so they count as the pool's."""
    keep: dict[str, float] = {}
    since: dict[str, tuple[float, float]] = {}
    total = 0.0
    for e in sorted(events, key=lambda e: e["t_s"]):
        iid = e.get("instance_id") or ""
        if e["action"] == "scale_in" and e["status"] == "draining":
            keep[iid] = kept_warm_s(e["reason"])
        elif e["action"] == "drain_result" and e["status"] == "idle" and keep.get(iid, 0.0) > 0:
            since[iid] = (e["t_s"], e["t_s"] + keep.pop(iid))
        elif e["action"] == "scale_out" and e["status"] == "loading" and iid in since:
            start, until = since.pop(iid)
            total += max(0.0, min(e["t_s"], until) - start)
    total += sum(max(0.0, min(end_s, until) - start) for start, until in since.values())
    return round(total, 2)


def decision_log(events: list[dict[str, Any]]) -> list[str]:
    """`time,action,target,status,reason` lines, time in seconds since the replay started."""
    lines = ["time,action,target,status,reason"]
    for e in events:
        reason = e["reason"].replace(",", ";").replace("\n", " ")
        who = f" [{e['instance_id']}]" if e.get("instance_id") else ""
        lines.append(f"{e['t_s']:.3f},{e['action']},{e['target']},{e['status']},{reason}{who}")
    return lines


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    window_kw = QUICK if args.quick else FULL
    window = TraceWindow(**window_kw)
    scaling = TokenScaling(prompt_scale=1 / 16, max_prompt_tokens=512, max_output_tokens=128, context_tokens=2048)
    arrivals = from_trace(
        read_azure_trace(args.trace),
        window,
        scaling,
        max_requests=5000,
        max_duration_s=window.span_s / window.compress if window.span_s else None,
    )
    workload = describe(arrivals, peak_bin_s=5.0)
    profile = Profile(args.step_time_a_s, args.step_time_b_s)
    sizing = size_pools(
        profile,
        mean_rps=workload["mean_rps"],
        peak_rps=workload["peak_rps"],
        mean_prompt_tokens=workload["mean_prompt_tokens"],
        mean_output_tokens=workload["mean_output_tokens"],
        target_utilization=args.target_utilization,
    )
    target_tps = sizing.capacity_rps * args.autoscale_utilization * workload["mean_output_tokens"]
    policy_params: dict[str, Any] = {
        "target_decode_tps_per_instance": round(target_tps, 2),
        "scale_out_cooldown_s": 2.0,
        "scale_in_cooldown_s": 10.0 if args.quick else 20.0,
        "tbt_slo_s": args.tbt_slo_s,
    }
    if args.policy == "heteroscale":
        # The HeteroScale extensions (see HeteroScaleConfig): a burst queues requests and breaks
        # TTFT before decode TPS moves, and a scale-in right after a scale-out would read the
        # lagging TPS window, not the load.
        policy_params.update(
            {
                "hold_scale_in_on_panic": True,
                "ttft_slo_s": args.ttft_slo_s,
                "scale_in_stabilization_s": policy_params["scale_in_cooldown_s"],
                "target_requests_per_instance": round(sizing.requests_per_instance(args.autoscale_utilization), 2),
            }
        )
    else:
        policy_params = {}
    policy_params.update(json.loads(args.policy_params))
    policy_params = {k: v for k, v in policy_params.items() if v is not None}  # null = leave at the default
    pool_max = sizing.fixed_peak
    print(f"workload: {json.dumps({k: round(v, 2) for k, v in workload.items()})}")
    print(f"profile a={profile.a_s}s b={profile.b_s}s/token; sizing: {json.dumps(sizing.to_json())}")
    print(f"policy {args.policy} {json.dumps(policy_params)}", flush=True)

    manager_args = [
        "--autoscale",
        "--advisory",
        "--policy",
        args.policy,
        "--policy-params",
        json.dumps(policy_params),
        "--max-instances",
        str(pool_max),
        "--window-s",
        "2",
        "--tick-s",
        "0.5",
        "--decision-repeat-s",
        "10",
    ]
    mesh_cfg = MeshConfig(
        workers=pool_max,
        initial_instances=1,
        model=args.model,
        model_dir=args.model_dir,
        run_dir=args.run_dir,
        http_port=0,
        grpc_port=0,
        ready_timeout_s=180.0,
        worker_args=[
            *profile.worker_args(),
            *(["--max-batch-size", str(args.max_batch_size)] if args.max_batch_size else []),
            *(["--max-num-tokens", str(args.max_num_tokens)] if args.max_num_tokens else []),
        ],
        manager_args=manager_args,
    )
    # The launcher's children inherit the environment, which the services' config layer reads.
    os.environ["BLITZMESH_WORKER_DATAPLANE"] = args.dataplane
    os.environ["BLITZMESH_PARAM_MANAGER_DATAPLANE"] = args.dataplane
    if args.link_gbps > 0:
        os.environ["BLITZMESH_WORKER_DATAPLANE_LINK_GBPS"] = str(args.link_gbps)
        os.environ["BLITZMESH_PARAM_MANAGER_DATAPLANE_LINK_GBPS"] = str(args.link_gbps)
    pools = {
        "fixed_peak": sizing.fixed_peak,
        "fixed_average": sizing.fixed_average,
        "autoscaled": 1,
        "autoscaled_bounds": 1,
    }
    bounds_params = {
        "prefill_tps_per_replica": round(1 / profile.b_s, 1),
        "scale_out_cooldown_s": 2.0,
        "scale_in_cooldown_s": policy_params.get("scale_in_cooldown_s", 10.0),
    }
    policies = {"autoscaled": (args.policy, policy_params), "autoscaled_bounds": ("blitzscale_bounds", bounds_params)}
    wanted = [r.strip() for r in args.runs.split(",") if r.strip()]
    unknown = set(wanted) - set(pools)
    if unknown:
        raise SystemExit(f"unknown runs {sorted(unknown)}; choose from {sorted(pools)}")
    drain_timeout_s = 15.0 if args.quick else 40.0
    if args.rebalance == "both" and args.zigzag == "both":
        raise SystemExit("compare one feature at a time: --rebalance both or --zigzag both, not both")
    ab_flag = "rebalance" if args.rebalance == "both" else ("zigzag" if args.zigzag == "both" else None)
    fixed_flags = [
        f"--{flag}" if getattr(args, flag) == "on" else f"--no-{flag}"
        for flag in ("rebalance", "zigzag")
        if flag != ab_flag
    ] + ["--zigzag-dispatch", args.zigzag_dispatch]
    ab_result: dict[str, Any] | None = None
    repeats: list[dict[str, dict[str, Any]]] = []
    if ab_flag is not None:
        by_setting: dict[str, list[dict[str, dict[str, Any]]]] = {"on": [], "off": []}
        for rep in range(args.repeats):
            for setting in ("on", "off") if rep % 2 == 0 else ("off", "on"):
                flag = f"--{ab_flag}" if setting == "on" else f"--no-{ab_flag}"
                cfg = dataclasses.replace(mesh_cfg, manager_args=[*manager_args, *fixed_flags, flag])
                print(f"--- {ab_flag} {setting} (pair {rep + 1}/{args.repeats}) ---", flush=True)
                by_setting[setting].append(
                    asyncio.run(run_all(wanted, cfg, pools, arrivals, args, policies, drain_timeout_s))
                )
        runs = by_setting["on"][0]
        ab_result = _ab_comparison(by_setting, ab_flag)
    else:
        mesh_cfg.manager_args = [*manager_args, *fixed_flags]
        for rep in range(args.repeats):
            order = wanted if rep % 2 == 0 else wanted[::-1]
            if args.repeats > 1:
                print(f"--- repeat {rep + 1}/{args.repeats}: {', '.join(order)} ---", flush=True)
            done = asyncio.run(run_all(order, mesh_cfg, pools, arrivals, args, policies, drain_timeout_s))
            repeats.append({name: done[name] for name in wanted})
        runs = repeats[0]

    plot_path = args.plot or args.out.with_suffix(".png")
    log_path = plot_path.with_name(plot_path.stem + "_decisions.csv")
    auto_events = runs.get("autoscaled", {}).get("events", [])
    result: dict[str, Any] = {name: run["summary"] for name, run in runs.items()}
    result["setup"] = {
        "quick": args.quick,
        "trace": args.trace.name,
        "trace_window": window_kw,
        "token_scaling": {
            "prompt_scale": scaling.prompt_scale,
            "max_prompt_tokens": scaling.max_prompt_tokens,
            "max_output_tokens": scaling.max_output_tokens,
        },
        "workload": {k: round(v, 3) for k, v in workload.items()},
        "model": args.model,
        "accelerator_profile": {
            "step_time_a_s": profile.a_s,
            "step_time_b_s": profile.b_s,
            "meaning": "each engine iteration lasts at least a + b * batch_tokens; "
            "the real model still computes every token",
        },
        "mesh": {
            "workers": pool_max,
            "pools": pools,
            "manager_args": manager_args,
            "dataplane": args.dataplane,
            "note": "one mesh for every run; pools resized through Admin.Scale between runs",
        },
        "sizing": {
            **sizing.to_json(),
            "target_utilization": args.target_utilization,
            "autoscale_utilization": args.autoscale_utilization,
            "rule": "pool = ceil(rate / (capacity_rps * target_utilization)); peak = busiest 5 s",
        },
        "policy": args.policy,
        "policy_params": policy_params,
        "autoscaled_bounds_policy": {"policy": "blitzscale_bounds", "params": bounds_params},
        "slo": {"ttft_s": args.ttft_slo_s, "tbt_mean_s": args.tbt_slo_s},
        "machine": {"cpus": 2, "python": sys.version.split()[0], "platform": platform.platform()},
        "decision_log": log_path.name,
        "decision_logs_of_later_repeats": f"{log_path.stem}_r<repeat>.csv",
        "plot": plot_path.name,
    }
    result["setup"]["rebalance"] = args.rebalance
    result["setup"]["zigzag"] = args.zigzag
    result["setup"]["zigzag_dispatch"] = args.zigzag_dispatch
    result["setup"]["link_gbps"] = args.link_gbps
    result["setup"]["warmup"] = f"{WARMUP_REQUESTS} requests on the peak pool, per mesh" if args.warmup else "none"
    result["setup"]["prompt_seeds"] = {
        **PROMPT_SEEDS,
        "meaning": "each run, and the warm-up, replays prompts of its own token ids (same lengths and times): "
        "no run finds another's prompts in the prefix cache of an instance kept across a resize",
    }
    result["setup"]["max_batch_size"] = args.max_batch_size or "worker default (32)"
    result["setup"]["max_num_tokens"] = args.max_num_tokens or "worker default (2048)"
    if ab_result is not None:
        result[ab_flag] = ab_result
    else:
        result["targets"] = autoscale_targets(repeats)
        result["repeats"] = {
            "count": args.repeats,
            "order": "each repeat in a fresh mesh, the runs in the given order, then reversed, ...; the "
            "top-level summaries are the first repeat's",
            "runs": _repeat_rows(repeats),
        }
    result["timelines"] = {name: run["timeline"] for name, run in runs.items()}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    log_path.write_text("\n".join(decision_log(auto_events)) + "\n")
    for i, rep in enumerate(repeats[1:], start=2):  # the later repeats' logs beside the first's
        if "autoscaled" in rep:
            rep_log = log_path.with_name(f"{log_path.stem}_r{i}.csv")
            rep_log.write_text("\n".join(decision_log(rep["autoscaled"]["events"])) + "\n")
    if "autoscaled_bounds" in runs:
        bounds_log = log_path.with_name(log_path.stem + "_bounds.csv")
        bounds_log.write_text("\n".join(decision_log(runs["autoscaled_bounds"]["events"])) + "\n")
    from bench.autoscale.plot import plot

    decisions = [e for e in auto_events if e["action"] == "autoscaling_decision" and e["target"] != "no_change"]
    title = (
        f"code trace, {window_kw['span_s'] / 60:.0f} trace min in {window_kw['span_s'] / window_kw['compress']:.0f} s "
        f"(1/{window_kw['thin']} of requests), model {args.model}, "
        f"step = {profile.a_s} s + {profile.b_s} s/token, policy {args.policy}"
    )
    plot(runs, decisions, args.ttft_slo_s, title, plot_path)
    print(f"\n{'run':<14} {'sent':>5} {'ok':>5} {'err':>4} {'lost':>4} {'SLO':>6} {'inst-s':>8} {'TTFT p99':>9}")
    for name, run in runs.items():
        s = run["summary"]
        print(
            f"{name:<14} {s['requests_sent']:>5} {s['completed']:>5} {s['errored']:>4} {s['lost']:>4} "
            f"{s['slo_attainment']:>6} {s['instance_seconds']:>8} {s['ttft_s']['p99']!s:>9}"
        )
    for key, t in result.get("targets", {}).items():
        print(f"{key}: {t.get('value')} per repeat {t.get('per_repeat', '')} target {t['target']}")
    print(f"wrote {args.out}, {plot_path}, {log_path}")
    checked = repeats or [runs]  # every repeat; with an A/B flag, the "on" setting's first (as before)
    return 0 if all(run["summary"]["lost"] == 0 for rep in checked for run in rep.values()) else 1


if __name__ == "__main__":
    raise SystemExit(main())
