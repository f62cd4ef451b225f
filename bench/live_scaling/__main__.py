"""Live scaling: one step burst against five setups, side by side in one run.

Usage:
    python -m bench.live_scaling [--quick] [--rdma-gbps 1.0] [--param-scale 20] [--shape code|conv]
        [--out bench/results/live_scaling.json]

Each setup is a fresh mesh of `small`-model workers with EMULATED accelerator pacing (every
engine step lasts at least a + b * batch tokens; the model still computes every token) and
EMULATED links: every data-plane sender is paced (services/dataplane/shaped.py) at the rate its
path would have, in the ratio of BlitzScale's testbed, RDMA 200 : PCIe host-to-GPU 256 : SSD 10
Gbit/s, scaled so that the RDMA link is `--rdma-gbps`; concurrent messages share a link slice by
slice, as flows do on a `tc tbf` link. The model's parameters are EMULATED `--param-scale` times
larger than the `small` model's 88 MB: every parameter stream (chains and host caches) goes at
most at its link's rate over that factor, so a load takes that much longer, while KV hand-offs and
ZigZag's hidden states keep the model's real sizes (a bigger model's KV per token grows far less
than its parameters do). The same open-loop step burst (`--shape`: the code trace's
long prompts and short outputs by default) is replayed against:
  (a) stop_the_world  autoscaled (HeteroScale, concurrency signal), multicast chains over RDMA,
                      a new instance serves only once loaded (ZigZag off);
  (b) zigzag          the same with ZigZag on: new instances serve while their layers arrive;
  (c) sllm_hit        ServerlessLLM-style: every new instance loads from its host's cached copy
                      at the PCIe pace (no chains), ZigZag off;
  (d) sllm_miss       the same, loading from SSD at the SSD pace;
  (e) fixed_peak      a fixed pool sized for the burst's peak, no scaling;
  (f) hand_back       ZigZag, and when a live instance finishes loading its partner's running
                      requests above an even share move to it by live migration with their KV
                      (the manager's --zigzag-hand-back); (b) runs with it off: prefill-only ZigZag.
A disaggregated burst, the same arrivals against a split deployment (1 prefill + 1 decode worker
to start, the other workers IDLE; the policy grows both pools, the prefill pool first):
  disagg_stop_the_world  ZigZag off, borrowed prefill off: new prefill instances serve once loaded;
  disagg_zigzag          new prefill instances serve while their layers arrive (ZigZag with a full
                         prefill partner, which hands the prompt's KV to the decode instance);
  disagg_borrowed        the same, and borrowed prefill (the manager's --borrow-prefill): while every
                         prefill instance has a backlog, a decode-light decode instance runs new
                         requests whole.
(g) pipelined decode is not built (`python -m bench.simulate.live_scaling`: even free decode on
every ZigZag partner, its bound, leaves the tail where it is); (h) borrowed prefill is the disaggregated setup only (a
colocated pool has no decode instances to borrow). Every autoscaled setup runs the same policy,
HeteroScale with its shipped queue-aware trigger (`queue_target_s`).
Per setup: TTFT p50/p99 (`ttft_p50_s`, `ttft_p99_s`), TBT p99, SLO attainment, instance-seconds,
`lost`, host memory for cached copies (one copy in the pool for a-b, one per host for c-d),
`served_while_loading` (ZigZag requests whose first layers ran on a loading instance), and
`load_overhead` (decision to SERVING over model bytes / link rate, per load). Setups run one
after another (a fresh mesh each); the machine is shared and has 2 cores.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path
from typing import Any

from bench.autoscale.__main__ import TOKEN_RATE_BIN_S, run_all
from bench.live_scaling.plot import plot
from blitzmesh.replay import describe, piecewise_pattern
from blitzmesh.replay.summary import percentile
from services.mesh.launcher import MeshConfig
from services.mesh.netns import unavailable_reason
from services.model_format.synth import PRESETS, synthesize

REPO_ROOT = Path(__file__).resolve().parents[2]
MODEL = "small"
STEP_A_S = 0.05
STEP_B_S = 0.002
WORKERS = 4
PCIE_OVER_RDMA = 256 / 200
SSD_OVER_RDMA = 10 / 200
POLICY = {
    # Concurrency signal (Knative KPA style) for a burst on a small mesh; HeteroScale's TPS rule
    # reacts to throughput, which a burst of queued prompts does not raise at first.
    "target_requests_per_instance": 4,
    "enable_latency_trigger": False,
    "scale_out_cooldown_s": 2.0,
    "scale_in_cooldown_s": 60.0,
    "scale_in_stabilization_s": 60.0,
}
# The split deployment's pools: HeteroScale's default pd_ratio (0.33, 1 prefill : 3 decode)
# grows the decode pool to 3 of the 4 workers at the first decision, before any burst (decode =
# prefill x round(1 / pd_ratio)), and leaves no worker for the prefill pool this prompt-heavy
# burst needs. 1:1 is the most prefill instances the policy allows per decode instance.
DISAGG_POLICY = {**POLICY, "pd_ratio": 1.0}
BULKY = ("timeline", "events", "tokens_per_s", "loading")
DISAGG_SETUPS = ("disagg_stop_the_world", "disagg_zigzag", "disagg_borrowed")
SETUPS = ("stop_the_world", "zigzag", "sllm_hit", "sllm_miss", "fixed_peak", "hand_back", *DISAGG_SETUPS)
# The setups that serve while loading: the best of them is compared with stop-the-world.
LIVE_SETUPS = ("zigzag", "hand_back", "zigzag_relay_first", "zigzag_route", "zigzag_routed_cap")
# The same for the disaggregated burst, against disagg_stop_the_world.
DISAGG_LIVE_SETUPS = ("disagg_zigzag", "disagg_borrowed")
# Ablations, run on request: ZigZag with the partner taking relayed requests before its own
# (the worker's --zigzag-partner-order relay_first) instead of in arrival order; ZigZag routed
# (the manager's --zigzag-dispatch route: new requests are sent to a loading instance and its
# partner, two hops; the default pulls, BlitzScale's NewPrefill: loading instances run the first
# layers of the requests queued on their partner); `zigzag_routed_cap`, pulled but each puller
# held to the routed cap (4 shrinking to 2, --zigzag-pull-limit 0) instead of 8; and
# `instant_load`, stop-the-world with every link INSTANT_OVER_RDMA times faster, so a load takes a
# fraction of a second: the same decisions with no loading window, the floor no live-scaling
# scheme can go below (ZigZag only ever makes the loading window behave more like no window).
ABLATIONS = ("zigzag_relay_first", "zigzag_route", "zigzag_routed_cap", "instant_load")
INSTANT_OVER_RDMA = 100.0
# The links and the model's emulated size. The earlier runs (--rdma-gbps 0.1 --param-scale 1)
# paced every byte at 0.1 Gbit/s: a load took 7 s, so the queue-aware trigger's instances served
# within a third of the quick burst; and a 256-token prompt's KV (3 MB) took 0.25 s, so at the
# burst's 5 requests/s one prefill worker's hand-offs (15 MB/s) outran its link (12.5 MB/s),
# which an 8B model's KV over RDMA never does. Now the link is 10 times faster and the
# parameters 20 times larger: a load takes about 14 s (two thirds of the quick burst), and the
# KV and hidden states take a tenth of what they did.
RDMA_GBPS = 1.0
PARAM_SCALE = 20.0


# Request shapes (prompt tokens, output tokens), uniform in each range. `code` follows the Azure
# code trace, whose prompts are long and outputs short (mean 2,048 prompt tokens to 28 output
# tokens, 73:1): a burst of prefill, the work ZigZag splits. Its prompts are cut to what 2 CPU
# cores compute for 4 workers within the emulated step time (26:1 here). `conv` is the
# conversation trace's 5:1, where decoding, which stays whole on the partner, dominates.
SHAPES: dict[str, tuple[tuple[int, int], tuple[int, int]]] = {
    "code": ((128, 384), (4, 16)),
    "conv": ((64, 384), (16, 64)),
}


def burst(quick: bool, shape: str = "code") -> list[Any]:
    base, peak = 0.7, 5.0
    span = (8.0, 30.0, 45.0) if quick else (15.0, 60.0, 90.0)
    prompt_tokens, output_tokens = SHAPES[shape]
    return piecewise_pattern(
        [(0.0, span[0], base), (span[0], span[1], peak), (span[1], span[2], base)],
        prompt_tokens=prompt_tokens,
        output_tokens=output_tokens,
        seed=7,
    )


def _links(setup: str, rdma_gbps: float) -> tuple[float, float]:
    """(worker egress, parameter manager egress) in Gbit/s for `setup`."""
    if setup == "sllm_hit":
        return rdma_gbps, rdma_gbps * PCIE_OVER_RDMA
    if setup == "sllm_miss":
        return rdma_gbps, rdma_gbps * SSD_OVER_RDMA
    if setup == "instant_load":
        return rdma_gbps * INSTANT_OVER_RDMA, rdma_gbps * INSTANT_OVER_RDMA
    return rdma_gbps, rdma_gbps


def _manager_args(setup: str, policy: dict[str, Any] = POLICY) -> list[str]:
    live = setup.startswith("zigzag") or setup in ("hand_back", "disagg_zigzag", "disagg_borrowed")
    flags = ["--zigzag" if live else "--no-zigzag"]
    flags.append("--zigzag-hand-back" if setup == "hand_back" else "--no-zigzag-hand-back")
    flags.append("--borrow-prefill" if setup == "disagg_borrowed" else "--no-borrow-prefill")
    if setup == "zigzag_route":
        flags += ["--zigzag-dispatch", "route"]
    if setup == "zigzag_routed_cap":
        flags += ["--zigzag-pull-limit", "0"]
    if setup.startswith("sllm"):
        flags.append("--no-transfer-plans")
    return [
        "--autoscale",
        "--advisory",
        "--policy",
        "heteroscale",
        "--policy-params",
        json.dumps(policy),
        "--max-instances",
        str(WORKERS),
        "--window-s",
        "2",
        "--tick-s",
        "0.5",
        "--decision-repeat-s",
        "10",
        *flags,
    ]


def load_overheads(events: list[dict[str, Any]], model_bytes: int, link_gbps: float) -> list[float]:
    """Per load: time from its scale_out decision to its load_result ok, over bytes / rate."""
    ideal_s = model_bytes * 8 / (link_gbps * 1e9)
    started: dict[str, float] = {}
    out: list[float] = []
    for e in events:
        if e["action"] == "scale_out" and e["status"] == "loading" and e.get("instance_id"):
            started[e["instance_id"]] = e["t_s"]
        elif e["action"] == "load_result" and e["status"] == "ok" and e.get("instance_id") in started:
            out.append(round((e["t_s"] - started.pop(e["instance_id"])) / ideal_s, 3))
    return out


def run_setup(
    setup: str,
    arrivals: list[Any],
    run_args: argparse.Namespace,
    model_dir: Path,
    model_bytes: int,
    rdma_gbps: float,
    use_netns: bool = False,
    param_scale: float = PARAM_SCALE,
) -> dict[str, Any]:
    """Replay `arrivals` once against a fresh mesh in `setup`; the figures of that one run.
    `use_netns`: every worker and the host cache on a network-namespace host behind a `tc tbf`
    uplink at the setup's rate (one link per host: not for the ServerlessLLM setups, whose
    every host reads its own copy), instead of pacing each sender in process. `param_scale`:
    the parameters emulated that many times larger (parameter streams at each link's rate over
    it; 1 = the model's own bytes)."""
    worker_gbps, pm_gbps = _links(setup, rdma_gbps)
    emulated_bytes = model_bytes * param_scale
    if use_netns and worker_gbps != pm_gbps:
        raise ValueError(f"{setup}: its hosts' links differ ({worker_gbps} / {pm_gbps} Gbit/s); run it without --netns")
    os.environ["BLITZMESH_WORKER_DATAPLANE"] = "tcp"
    os.environ["BLITZMESH_PARAM_MANAGER_DATAPLANE"] = "tcp"
    # 0 turns in-process pacing off: the namespaces' qdiscs shape the links instead.
    os.environ["BLITZMESH_WORKER_DATAPLANE_LINK_GBPS"] = "0" if use_netns else str(worker_gbps)
    os.environ["BLITZMESH_PARAM_MANAGER_DATAPLANE_LINK_GBPS"] = "0" if use_netns else str(pm_gbps)
    # ServerlessLLM keeps a copy on every host: each new instance reads its own at that pace.
    os.environ["BLITZMESH_PARAM_MANAGER_DATAPLANE_LINK_PER_PEER"] = "1" if setup.startswith("sllm") else "0"
    # Parameter streams only (a model with more bytes): 0 turns that pacing off.
    for var, gbps in (("WORKER", worker_gbps), ("PARAM_MANAGER", pm_gbps)):
        os.environ[f"BLITZMESH_{var}_DATAPLANE_PARAM_LINK_GBPS"] = "0" if param_scale == 1 else str(gbps / param_scale)
    disagg = setup in DISAGG_SETUPS
    cfg = MeshConfig(
        workers=WORKERS,
        initial_instances=1,
        prefill=1 if disagg else 0,
        decode=1 if disagg else 0,
        model=MODEL,
        model_dir=model_dir,
        run_dir=REPO_ROOT / "run" / f"bench-live-scaling-{setup}",
        http_port=0,
        grpc_port=0,
        # The first instance loads over the host-cache link too: at the SSD pace that takes minutes.
        ready_timeout_s=240.0 + 2 * emulated_bytes * 8 / (pm_gbps * 1e9),
        worker_args=[
            "--step-time-a-s",
            str(STEP_A_S),
            "--step-time-b-s",
            str(STEP_B_S),
            *(["--zigzag-partner-order", "relay_first"] if setup == "zigzag_relay_first" else []),
        ],
        manager_args=_manager_args(setup, DISAGG_POLICY if disagg else POLICY),
        netns_rate_mbit=worker_gbps * 1000 if use_netns else None,
    )
    # The peak pool: every worker loaded from the start.
    name = "fixed_peak" if setup == "fixed_peak" else "autoscaled"
    pools = {"autoscaled": 2 if disagg else 1, "fixed_peak": WORKERS}
    policies = {"autoscaled": ("heteroscale", DISAGG_POLICY if disagg else POLICY)}
    print(f"--- {setup}: worker link {worker_gbps} Gbit/s, host cache {pm_gbps} Gbit/s ---", flush=True)
    run = asyncio.run(run_all([name], cfg, pools, arrivals, run_args, policies, 40.0))[name]
    s = run["summary"]
    loads = (
        []
        if setup == "fixed_peak"
        else load_overheads(run["events"], emulated_bytes, pm_gbps if setup.startswith("sllm") else worker_gbps)
    )
    result = {
        "ttft_p50_s": s["ttft_s"]["p50"],
        "ttft_p99_s": s["ttft_s"]["p99"],
        "tbt_p99_s": s["tbt_mean_s"]["p99"],
        "slo_attainment": s["slo_attainment"],
        "instance_seconds": s["instance_seconds"],
        "lost": s["lost"],
        "completed": s["completed"],
        "requests_sent": s["requests_sent"],
        "host_memory_cached_bytes": (WORKERS if setup.startswith("sllm") else 1) * model_bytes,
        "served_while_loading": max(
            s.get("zigzag_requests", {}).get('outcome="relayed"', 0), s.get("zigzag_continued", 0)
        ),
        "zigzag_requests": s.get("zigzag_requests", {}),
        # Requests a decode instance ran whole for a backlogged prefill pool (disagg_borrowed).
        "borrowed": s.get("routes", {}).get('outcome="borrowed"', 0),
        "routes": s.get("routes", {}),
        "load_overhead": loads,
        "load_overhead_median": percentile(loads, 0.5),
        # How busy the shared machine was as the run ended (1, 5, 15 min load averages).
        "load_average": [round(x, 2) for x in os.getloadavg()],
        "timeline": run["timeline"],
        "tokens_per_s": run["tokens_per_s"],
        "loading": run["loading"],
        "events": [e for e in run["events"] if e["action"] != "autoscaling_decision" or e["target"] != "no_change"],
    }
    print(f"[{setup}] {json.dumps({k: v for k, v in result.items() if k not in BULKY})}", flush=True)
    return result


def replay_args(quick: bool) -> argparse.Namespace:
    """What `bench.autoscale.run_all` reads of its command line, for one setup's run. No warm-up:
    it would load every worker before the run, and a setup's loads are what it measures."""
    return argparse.Namespace(
        model=MODEL, vocab_size=8000, ttft_slo_s=1.5, tbt_slo_s=0.2, bin_s=2.5, quick=quick, warmup=False
    )


MEDIAN_KEYS = (
    "ttft_p50_s",
    "ttft_p99_s",
    "tbt_p99_s",
    "slo_attainment",
    "instance_seconds",
    "served_while_loading",
    "borrowed",
)
SUMMED_KEYS = ("lost", "completed", "requests_sent")


def combine(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """One setup's figures over its repeats: the median of each of MEDIAN_KEYS, the sums of
    SUMMED_KEYS, every load's overhead, and the series of the first repeat (for the figure).
    `runs` lists each repeat's scalar figures. A single run is returned as it is."""
    if len(runs) == 1:
        return runs[0]
    out = dict(runs[0])
    for key in MEDIAN_KEYS:
        out[key] = round(statistics.median(r[key] for r in runs), 4)
    for key in SUMMED_KEYS:
        out[key] = sum(r[key] for r in runs)
    out["load_overhead"] = [x for r in runs for x in r["load_overhead"]]
    out["load_overhead_median"] = percentile(out["load_overhead"], 0.5)
    out["runs"] = [{k: v for k, v in r.items() if k not in BULKY} for r in runs]
    return out


def paired_ratio(num: list[dict[str, Any]], den: list[dict[str, Any]], target: float | None) -> dict[str, Any]:
    """p99 TTFT of `num` over `den`, repeat by repeat (the runs taken side by side), and their
    median; `met` when a target is given and the median is at most it."""
    ratios = [round(a["ttft_p99_s"] / b["ttft_p99_s"], 3) for a, b in zip(num, den, strict=True)]
    value = round(statistics.median(ratios), 3)
    out: dict[str, Any] = {"value": value, "per_repeat": ratios}
    if target is not None:
        out.update(target=target, met=value <= target)
    return out


def best_live(
    by_setup: dict[str, list[dict[str, Any]]],
    target: float = 0.6,
    live: tuple[str, ...] = LIVE_SETUPS,
    baseline: str = "stop_the_world",
) -> dict[str, Any] | None:
    """The setup of `live` with the lowest median p99 TTFT over `baseline` (stop-the-world), as
    `{value, per_repeat, setup, target, met}`; None without the baseline or a live setup."""
    if baseline not in by_setup:
        return None
    ratios = {s: paired_ratio(by_setup[s], by_setup[baseline], target) for s in live if s in by_setup}
    if not ratios:
        return None
    setup = min(ratios, key=lambda s: (ratios[s]["value"], s))
    return {**ratios[setup], "setup": setup}


def write_results(
    by_setup: dict[str, list[dict[str, Any]]],
    args: argparse.Namespace,
    workload: dict[str, Any],
    model_bytes: int,
    run_args: argparse.Namespace,
    started: float,
) -> dict[str, Any]:
    """Combine the repeats so far, write the JSON and the figure to `args.out`; the targets."""
    results = {setup: combine(runs) for setup, runs in by_setup.items()}
    targets: dict[str, Any] = {}
    for num, den, target in (
        ("zigzag", "stop_the_world", 0.5),
        ("hand_back", "stop_the_world", None),
        ("hand_back", "zigzag", None),
        ("zigzag", "sllm_miss", 0.5),
        ("instant_load", "stop_the_world", None),
        ("zigzag", "instant_load", None),
        ("zigzag_route", "stop_the_world", None),
        ("zigzag", "zigzag_route", None),
        ("zigzag_routed_cap", "stop_the_world", None),
        ("zigzag", "zigzag_routed_cap", None),
        ("disagg_zigzag", "disagg_stop_the_world", None),
        ("disagg_borrowed", "disagg_stop_the_world", None),
        ("disagg_borrowed", "disagg_zigzag", None),
    ):
        if num in by_setup and den in by_setup:
            targets[f"ttft_p99_{num}_over_{den}"] = paired_ratio(by_setup[num], by_setup[den], target)
    best = best_live(by_setup)
    if best is not None:
        targets["ttft_p99_best_live_over_stop_the_world"] = best
    best = best_live(by_setup, live=DISAGG_LIVE_SETUPS, baseline="disagg_stop_the_world")
    if best is not None:
        targets["ttft_p99_disagg_best_live_over_stop_the_world"] = best
    overheads = [
        x
        for k in ("stop_the_world", "zigzag", "disagg_stop_the_world", "disagg_zigzag")
        if k in results
        for x in results[k]["load_overhead"]
    ]
    if overheads:
        med = percentile(overheads, 0.5)
        targets["load_overhead"] = {"median": med, "max": max(overheads), "target": 1.2, "met": med <= 1.2}
    targets["lost"] = {"value": sum(r["lost"] for r in results.values()), "target": 0}
    out = {
        **results,
        "targets": targets,
        "setup": {
            "quick": args.quick,
            "repeats": args.repeats,
            "repeats_done": min(len(runs) for runs in by_setup.values()),
            "model": MODEL,
            "model_bytes": model_bytes,
            "param_scale": args.param_scale,
            "emulated_model_bytes": round(model_bytes * args.param_scale),
            "workers": WORKERS,
            "burst": workload,
            "shape": {
                "name": args.shape,
                "prompt_tokens": SHAPES[args.shape][0],
                "output_tokens": SHAPES[args.shape][1],
            },
            "pacing": {"emulated": True, "step_a_s": STEP_A_S, "step_b_s_per_token": STEP_B_S},
            "links": {
                "emulated": "network-namespace hosts, each uplink a tc tbf qdisc"
                if args.netns
                else "app-level pacing of each sender (not netns + tc tbf)",
                "rdma_gbps": args.rdma_gbps,
                "pcie_gbps": round(args.rdma_gbps * PCIE_OVER_RDMA, 4),
                "ssd_gbps": round(args.rdma_gbps * SSD_OVER_RDMA, 4),
            },
            "policy": POLICY,
            "disagg_policy": DISAGG_POLICY,
            "slo": {"ttft_s": run_args.ttft_slo_s, "tbt_mean_s": run_args.tbt_slo_s},
            "machine": {"cpus": os.cpu_count(), "python": sys.version.split()[0], "platform": platform.platform()},
            "elapsed_s": round(time.monotonic() - started, 1),
        },
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(out, indent=2) + "\n")
    plot_path = args.out.with_suffix(".png")
    plot(
        results,
        TOKEN_RATE_BIN_S,
        f"one burst ({args.shape} shape), {WORKERS} workers, emulated accelerator pacing and links"
        f" (RDMA {args.rdma_gbps} Gbit/s, parameters x{args.param_scale:g})",
        plot_path,
    )
    print(f"wrote {plot_path}")
    return targets


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.live_scaling", description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="a 45 s burst instead of 90 s")
    p.add_argument(
        "--rdma-gbps",
        type=float,
        default=RDMA_GBPS,
        help=f"the emulated RDMA link (default {RDMA_GBPS:g}: with --param-scale {PARAM_SCALE:g} a load takes 14 s,"
        " several decision intervals, as a multi-GB model does over RDMA; KV and hidden states go at this rate);"
        " PCIe and SSD scale with it",
    )
    p.add_argument(
        "--param-scale",
        type=float,
        default=PARAM_SCALE,
        help="emulate parameters this many times larger than the model's: every parameter stream goes at its"
        f" link's rate over this (default {PARAM_SCALE:g}: a load lasts about 14 s, two thirds of the quick"
        " burst); KV and hidden states keep their sizes. --rdma-gbps 0.1 --param-scale 1 is the earlier runs'"
        " setting",
    )
    p.add_argument("--setups", default=",".join(SETUPS), help=f"comma-separated, of {SETUPS + ABLATIONS}")
    p.add_argument("--shape", choices=sorted(SHAPES), default="code", help="request shape of the burst (see SHAPES)")
    p.add_argument(
        "--netns",
        action="store_true",
        help="put every worker and the host cache on a network-namespace host behind a tc tbf uplink at the"
        " RDMA rate (needs root), instead of pacing each sender in process; not for the sllm setups",
    )
    p.add_argument(
        "--repeats",
        type=int,
        default=1,
        help="run the setups this many times, alternating (a b c a b c); figures are medians over the"
        " repeats and each ratio target is the median of the per-repeat ratios, with all of them listed",
    )
    p.add_argument("--out", type=Path, default=REPO_ROOT / "bench" / "results" / "live_scaling.json")
    args = p.parse_args(argv)
    if args.repeats < 1:
        p.error(f"--repeats must be >= 1, got {args.repeats}")
    if not args.param_scale >= 1:
        p.error(f"--param-scale must be >= 1, got {args.param_scale}")
    if args.netns and (reason := unavailable_reason()) is not None:
        p.error(f"--netns: {reason}")
    setups = [s.strip() for s in args.setups.split(",") if s.strip()]
    if args.netns and (sllm := [s for s in setups if s.startswith("sllm")]):
        p.error(
            f"--netns gives every host one link; {sllm} read a copy on each host at another rate: run them without it"
        )
    unknown = set(setups) - set(SETUPS + ABLATIONS)
    if unknown:
        p.error(f"unknown setups {sorted(unknown)}, known: {list(SETUPS + ABLATIONS)}")
    arrivals = burst(args.quick, args.shape)
    workload = describe(arrivals, peak_bin_s=5.0)
    model_dir = REPO_ROOT / "models"
    synthesize(model_dir / MODEL, MODEL)
    model_bytes = PRESETS[MODEL].num_parameters() * 4
    # What bench.autoscale's run_all reads from its arguments.
    run_args = replay_args(args.quick)
    started = time.monotonic()
    # Repeats alternate the setups (a b c a b c ...), so a slow patch of the shared machine lands
    # on every setup rather than on one.
    by_setup: dict[str, list[dict[str, Any]]] = {}
    for i in range(args.repeats):
        for setup in setups:
            print(f"--- repeat {i + 1}/{args.repeats} ---", flush=True)
            by_setup.setdefault(setup, []).append(
                run_setup(
                    setup, arrivals, run_args, model_dir, model_bytes, args.rdma_gbps, args.netns, args.param_scale
                )
            )
        # Written after every repeat: a run cut short keeps the repeats it finished.
        targets = write_results(by_setup, args, workload, model_bytes, run_args, started)
    print(json.dumps(targets, indent=2))
    print(f"wrote {args.out}")
    return 0 if targets["lost"]["value"] == 0 else 1


if __name__ == "__main__":
    raise SystemExit(main())
