"""`live8b`: a scenario where live scaling matters, and ZigZag against stop-the-world at scale.

Usage:
    python -m bench.simulate.live_scaling [--variants stop_the_world,zigzag,fixed_peak,serverlessllm]
        [--sweep 25,50,100,200,400] [--seed 0] [--out bench/results/simulate_live8b.json]

The regime BlitzScale (OSDI'25) reports live scaling in: an 8B-class model (the simulator's
published-spec H100 ESTIMATE, `profiles.PUBLISHED_PROFILES["h100-llama3-8b"]`, 16.06 GB of
weights, 32 layers) on 64 GPUs (8 hosts x 8, 2 leaves), loads that take seconds (`rdma_gbps`
per GPU and the host NIC the parameter manager's host-memory copy leaves by, 50 Gbps by default:
16 GB in ~2.6 s over one link), and a step burst on the Azure code trace that needs scaling out
from a small pool: a 150 s slice (full-size prompts, mean ~2,000 tokens, short outputs) at
`COPIES` rotated copies, 8x that from 40 s to 100 s.

Variants: `stop_the_world` (HeteroScale, the GM's multicast chains, ZigZag off: a new instance
serves only once fully loaded), `zigzag` (the same with ZigZag as the live GM runs it by
default: every LOADING target live from its first layer, pulling: each keeps a partner by the
core's `pull_pairs` and speeds it up while the partner holds prompts not started),
`zigzag_route` (the GM's `--zigzag-dispatch route`: live instances paired while the gate is open,
i.e. every SERVING instance has requests waiting, is at batch capacity or has a TTFT p50 of at
least 1 s), `zigzag_decode_bound` (a bound on pipelined decode, not a mechanism: routed ZigZag's
partners decode for free while sped up), `zigzag_ungated` (a bound of the routed layer-level
model: every live instance paired whatever the gate says), `serverlessllm` (same
policy, per-host cache with keep-alive, a miss reads the 10 Gbps SSD, no ZigZag), `fixed_peak` (a
pool sized for the busiest 5 s, no scaling). The sweep reruns stop_the_world, zigzag and
zigzag_ungated over the link bandwidth, i.e. the load time.

Simulated figures of an unvalidated step-time estimate, not measurements.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from blitzmesh.replay.schedule import Arrival, TraceWindow, from_trace
from blitzmesh.replay.summary import Slo, percentile
from blitzmesh.replay.trace import read_azure_trace

from .cluster import RunConfig, Simulation
from .links import ClusterSpec
from .profiles import PUBLISHED_PROFILES
from .scenarios import (
    FULL_SIZE,
    TARGET_UTILIZATION,
    TRACES,
    Scenario,
    build_runs,
    burst,
    heteroscale_overrides,
    overlay,
)

__all__ = ["VARIANTS", "live8b_runs", "main", "run_variant"]

REPO_ROOT = Path(__file__).resolve().parents[2]
VARIANTS = (
    "stop_the_world",
    "zigzag",
    "zigzag_route",
    "zigzag_decode_bound",
    "zigzag_ungated",
    "instant_load",
    "fixed_peak",
    "serverlessllm",
)
PAIR = ("stop_the_world", "zigzag", "zigzag_route", "zigzag_decode_bound", "zigzag_ungated", "instant_load")
SWEEP_PAIR = ("stop_the_world", "zigzag", "zigzag_ungated")
SPAN_S = 150.0
BURST = (40.0, 100.0)
BURST_FACTOR = 8
COPIES = 12
TRACE_START_S = 1200.0
DEFAULT_GBPS = 10.0
SWEEP_GBPS = (5.0, 10.0, 25.0, 50.0, 100.0, 200.0, 400.0)
SEEDS = (0, 1, 2)
INITIAL = 8
# HeteroScale as configured for every variant but the policy check: the latency panic doubles
# the pool (the default 1.2x ramps 8 -> 64 over ~20 s, so the policy, not the load, sets the
# tail); the rest as the other scenarios (`scenarios.build_runs`).
POLICY_OVERRIDES = {"latency_panic_scale_factor": 2.0}
SLO = Slo(ttft_s=1.0, tbt_s=0.1)
TARGET = 0.6  # p99 TTFT, ZigZag over stop-the-world


def live8b_arrivals(seed: int = 0) -> list[Arrival]:
    """150 s of the code trace from trace second 1200, 12 rotated copies (rotations seeded),
    8x that in [40, 100) s."""
    rows = read_azure_trace(TRACES / "azure_llm_2023_code.csv")
    base = from_trace(
        rows,
        TraceWindow(start_s=TRACE_START_S, span_s=SPAN_S),
        FULL_SIZE,
    )
    steady = overlay(base, COPIES, SPAN_S, seed=11 + 2 * seed)
    return burst(steady, BURST[0], BURST[1], extra=BURST_FACTOR - 1, span_s=SPAN_S, seed=12 + 2 * seed)


def cluster(gbps: float) -> ClusterSpec:
    return ClusterSpec(
        hosts=8,
        gpus_per_host=8,
        hosts_per_leaf=4,
        rdma_gbps=gbps,
        nvlink_gbps=3600.0,
        pcie_gbps=400.0,
        ssd_gbps=10.0,
        host_nic_gbps=gbps,
    )


def scenario(gbps: float = DEFAULT_GBPS, arrivals: list[Arrival] | None = None) -> Scenario:
    arr = arrivals if arrivals is not None else live8b_arrivals()
    return Scenario(
        name="live8b",
        description=f"64 H100s (published-spec Llama-3-8B ESTIMATE), 8 hosts x 8 on 2 leaves, {gbps:g} Gbps RDMA per "
        f"GPU and host NIC, NVLink 3.6 Tbps, PCIe 400 Gbps, SSD 10 Gbps; the Azure code trace from second "
        f"{TRACE_START_S:g}, {SPAN_S:g} s, {COPIES} rotated copies, {BURST_FACTOR}x in [{BURST[0]:g}, {BURST[1]:g}) s "
        "(a step burst); autoscaled pools start sized for the pre-burst rate",
        profile=lambda: PUBLISHED_PROFILES["h100-llama3-8b"],
        cluster=cluster(gbps),
        arrivals=lambda: arr,
        slo=SLO,
        initial=None,
        max_instances=64,
        batch_for_sizing=32,
        scale_out_cooldown_s=2.0,
        scale_in_cooldown_s=60.0,
        keep_alive_s=60.0,
    )


def live8b_runs(
    variants: tuple[str, ...] = VARIANTS,
    gbps: float = DEFAULT_GBPS,
    seed: int = 0,
    arrivals: list[Arrival] | None = None,
    policy_overrides: dict[str, Any] | None = None,
) -> tuple[list[RunConfig], dict[str, Any]]:
    """The variants' run configs at `gbps`. `instant_load`: stop-the-world on links 10^5 times
    faster (a load takes milliseconds), the floor any live-scaling scheme could reach."""
    sc = scenario(gbps, arrivals if arrivals is not None else live8b_arrivals(seed))
    runs, meta = build_runs(sc, ("blitzmesh", "serverlessllm", "fixed_peak"), seed=seed)
    over = POLICY_OVERRIDES if policy_overrides is None else policy_overrides
    blitz, sllm, fixed = (
        dataclasses.replace(r, policy_params={**r.policy_params, **over}) if r.autoscale else r for r in runs
    )
    meta["policy_overrides"] = dict(over)
    arr = list(blitz.arrivals)
    before = [a for a in arr if a.t_s < BURST[0]]
    pre_rps = len(before) / BURST[0]
    cap = meta["sizing"]["capacity_rps_per_instance"]
    meta["sizing"]["pre_burst_rps"] = round(pre_rps, 3)
    meta["sizing"]["pre_burst_pool_at_target"] = max(1, math.ceil(pre_rps / (cap * TARGET_UTILIZATION)))
    # The autoscaled pools start at, and never fall below, INITIAL: the size HeteroScale settles
    # at on the pre-burst rate (started smaller it scales 1 -> 8 in the first second, whose
    # loads, 13 s from SSD for ServerlessLLM, would trip its latency panic before the burst).
    initial = INITIAL
    meta["sizing"]["initial"] = initial
    blitz, sllm = (dataclasses.replace(r, min_instances=initial) for r in (blitz, sllm))

    def zigzag(name: str, **changes: Any) -> RunConfig:
        """ZigZag as the live GM runs it (every target live from its first layer), with `changes`."""
        return dataclasses.replace(
            blitz, name=name, initial=initial, zigzag=True, zigzag_live="all", zigzag_ttft_s=1.0, **changes
        )

    table = {
        "stop_the_world": dataclasses.replace(blitz, name="stop_the_world", initial=initial, zigzag=False),
        "zigzag": zigzag("zigzag"),  # the shipped dispatch: pulled
        "zigzag_route": zigzag("zigzag_route", zigzag_dispatch="route"),
        # Both bounds are of the routed model (a partner sped up whenever the gate is open).
        "zigzag_decode_bound": zigzag("zigzag_decode_bound", zigzag_dispatch="route", zigzag_decode_free_bound=True),
        "zigzag_ungated": zigzag("zigzag_ungated", zigzag_dispatch="route", zigzag_gate="always"),
        "instant_load": dataclasses.replace(
            blitz,
            name="instant_load",
            initial=initial,
            zigzag=False,
            cluster=dataclasses.replace(
                blitz.cluster,
                rdma_gbps=gbps * 1e5,
                host_nic_gbps=gbps * 1e5,
                nvlink_gbps=3600.0 * 1e5,
                pcie_gbps=400.0 * 1e5,
            ),
        ),
        "serverlessllm": dataclasses.replace(sllm, initial=initial),
        "fixed_peak": fixed,
    }
    unknown = sorted(set(variants) - set(table))
    if unknown:
        raise ValueError(f"unknown variants {unknown!r}; known: {sorted(table)!r}")
    return [table[v] for v in variants], meta


def run_variant(cfg: RunConfig) -> dict[str, Any]:
    """One run's figures: the summary's TTFT, SLO, GPU-seconds and loads, ZigZag's counters,
    and the TTFT of the requests that arrived in the burst."""
    sim = Simulation(cfg)
    s = sim.run()
    in_burst = [
        r.first_token_s - r.arrival_s
        for r in sim.requests
        if BURST[0] <= r.arrival_s < BURST[1] and r.first_token_s is not None
    ]
    return {
        "ttft_p50_s": s["ttft_s"]["p50"],
        "ttft_p99_s": s["ttft_s"]["p99"],
        "burst_ttft_p50_s": _r(percentile(in_burst, 0.5)),
        "burst_ttft_p99_s": _r(percentile(in_burst, 0.99)),
        "slo_attainment": s["slo_attainment"],
        "gpu_seconds": s["gpu_seconds"],
        "instances_max": s["instances_max"],
        "completed": s["completed"],
        "lost": s["lost"],
        "loads": s["loads"],
        "zigzag_boost_instance_s": s["zigzag_boost_instance_s"],
        "zigzag": s["zigzag"],
        "sim_wall_s": s["sim_wall_s"],
    }


def _r(x: float | None) -> float | None:
    return None if x is None else round(x, 4)


def _ratio(a: float | None, b: float | None) -> float | None:
    return None if a is None or not b else round(a / b, 3)


SWEEP_KEYS = (
    "ttft_p50_s",
    "ttft_p99_s",
    "burst_ttft_p99_s",
    "slo_attainment",
    "gpu_seconds",
    "instances_max",
    "zigzag_boost_instance_s",
    "zigzag",
)


def _short(out: dict[str, Any]) -> dict[str, Any]:
    row = {k: out[k] for k in SWEEP_KEYS}
    row["load_mean_s"] = out["loads"]["mean_s"]
    row["load_max_s"] = out["loads"]["max_s"]
    return row


def _ratios(r: dict[str, dict[str, Any]]) -> dict[str, float | None]:
    stw = r.get("stop_the_world", {})
    out = {}
    for name in ("zigzag", "zigzag_route", "zigzag_decode_bound", "zigzag_ungated", "instant_load"):
        if name in r:
            out[f"p99_{name}_over_stop_the_world"] = _ratio(r[name]["ttft_p99_s"], stw.get("ttft_p99_s"))
    floor = out.get("p99_instant_load_over_stop_the_world")
    zz = out.get("p99_zigzag_over_stop_the_world")
    if floor is not None and zz is not None and floor < 1:
        # The share of the gap between stop-the-world (1) and instant loads (the floor) that
        # ZigZag recovers: the "recover >= 2/3 of the gap".
        out["gap_recovered_zigzag"] = round((1 - zz) / (1 - floor), 3)
    if "zigzag" in r and "serverlessllm" in r:
        out["p99_zigzag_over_serverlessllm"] = _ratio(r["zigzag"]["ttft_p99_s"], r["serverlessllm"]["ttft_p99_s"])
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.simulate.live_scaling", description=__doc__.splitlines()[0])
    p.add_argument("--variants", default=",".join(VARIANTS))
    p.add_argument("--gbps", type=float, default=DEFAULT_GBPS, help="RDMA and host NIC bandwidth of the main table")
    p.add_argument("--sweep", default=",".join(f"{g:g}" for g in SWEEP_GBPS), help="Gbps values; '' for none")
    p.add_argument("--seeds", default=",".join(str(x) for x in SEEDS), help="trace rotations for the seed check")
    p.add_argument(
        "--heteroscale",
        action="append",
        default=[],
        metavar="KEY=JSON",
        help="override one HeteroScale parameter of every autoscaled run, e.g. queue_project_min_s=0.125 "
        "(repeatable; on top of the scenario's own overrides, and recorded in the JSON)",
    )
    p.add_argument("--out", type=Path, default=REPO_ROOT / "bench" / "results" / "simulate_live8b.json")
    args = p.parse_args(argv)
    wall = time.perf_counter()
    extra = heteroscale_overrides(args.heteroscale)
    over = {**POLICY_OVERRIDES, **extra}
    arrivals = live8b_arrivals(0)
    variants = tuple(v for v in args.variants.split(",") if v)
    runs, meta = live8b_runs(variants, args.gbps, 0, arrivals, policy_overrides=over)
    profile = runs[0].profile
    sc = scenario(args.gbps, arrivals)
    result: dict[str, Any] = {
        "scenario": "live8b",
        "simulated": "SIMULATED: bench.simulate on the published-spec H100 ESTIMATE (roofline, assumed "
        "efficiencies), not a measurement",
        "description": sc.description,
        "profile": {"device": profile.device, "model": profile.model.name, "source_ref": profile.source_ref},
        "cluster": vars(sc.cluster),
        "slo": {"ttft_s": SLO.ttft_s, "tbt_s": SLO.tbt_s},
        "burst_window_s": list(BURST),
        "requests": len(arrivals),
        **meta,
        "runs": {},
    }
    for cfg in runs:
        out = run_variant(cfg)
        result["runs"][cfg.name] = out
        print(_line(f"live8b@{args.gbps:g}/{cfg.name}", out), flush=True)
    result["ratios"] = {**_ratios(result["runs"]), "target": TARGET}
    print(f"ratios: {result['ratios']}", flush=True)

    # The same at other trace rotations: how much of a difference is the run's own noise.
    result["seeds"] = []
    for seed in [int(x) for x in args.seeds.split(",") if x]:
        pair, _ = live8b_runs(PAIR, args.gbps, seed, policy_overrides=over)
        result["seeds"].append(_run_pair(pair, {"seed": seed}, f"seed{seed}@{args.gbps:g}"))

    per_seed = [row["ratios"].get("p99_zigzag_over_stop_the_world") for row in result["seeds"]]
    if per_seed and None not in per_seed:
        result["ratios"]["p99_zigzag_over_stop_the_world_per_seed"] = per_seed
        result["ratios"]["p99_zigzag_over_stop_the_world_seed_median"] = sorted(per_seed)[len(per_seed) // 2]

    # The load time: link bandwidth per GPU NIC and host NIC.
    result["sweep"] = []
    for gbps in [float(g) for g in args.sweep.split(",") if g]:
        pair, _ = live8b_runs(SWEEP_PAIR, gbps, 0, arrivals, policy_overrides=over)
        row = {"gbps": gbps, "one_link_16gb_s": round(16.06e9 * 8 / (gbps * 1e9), 2)}
        result["sweep"].append(_run_pair(pair, row, f"sweep@{gbps:g}"))

    # The policy as shipped (latency panic x1.2): a slower ramp, so more of the burst is spent
    # loading while every SERVING instance is overloaded.
    result["policy_default"] = []
    for seed in [int(x) for x in args.seeds.split(",") if x]:
        pair, _ = live8b_runs(PAIR, args.gbps, seed, policy_overrides=extra)
        row = {"seed": seed, "policy_overrides": extra}
        result["policy_default"].append(_run_pair(pair, row, f"policy_default seed{seed}@{args.gbps:g}"))

    result["sim_wall_s"] = round(time.perf_counter() - wall, 1)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n", encoding="utf-8")
    print(f"wrote {args.out} ({result['sim_wall_s']} s)")
    return 0


def _run_pair(pair: Sequence[RunConfig], row: dict[str, Any], tag: str) -> dict[str, Any]:
    """Run each variant, add its short summary and the ratios to `row`, print as it goes."""
    for cfg in pair:
        out = run_variant(cfg)
        row[cfg.name] = _short(out)
        print(_line(f"{tag}/{cfg.name}", out), flush=True)
    row["ratios"] = _ratios(row)
    print(f"{tag}: {row['ratios']}", flush=True)
    return row


def _line(tag: str, out: dict[str, Any]) -> str:
    return (
        f"{tag}: ttft p50 {out['ttft_p50_s']} p99 {out['ttft_p99_s']} (burst p99 {out['burst_ttft_p99_s']}) "
        f"slo {out['slo_attainment']} gpu_s {out['gpu_seconds']} max {out['instances_max']} lost {out['lost']} "
        f"loads {out['loads']['count']} (mean {out['loads']['mean_s']} max {out['loads']['max_s']} s) "
        f"zz {out['zigzag']} boost {out['zigzag_boost_instance_s']} wall {out['sim_wall_s']} s"
    )


if __name__ == "__main__":
    sys.exit(main())
