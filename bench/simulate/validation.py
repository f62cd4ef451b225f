"""Validation of the simulator against the real mesh: `bench.autoscale --quick` replayed in the
simulator, compared with the stored real-mesh result (`bench/results/autoscale_quick.json`).

The scenario `autoscale_quick` is that run's setup, read from the stored file: the same trace
slice built by the same `blitzmesh.replay` calls (`from_trace`, `TraceWindow`, `TokenScaling`), the
emulated accelerator as a `StepTimeModel` (base_s = a, prefill_token_s = decode_row_s = b, every
other term 0), 4 workers (one host: the real mesh is one 2-core machine over loopback TCP), the
same pools, policies and policy params, the manager's `--window-s 2 --tick-s 0.5
--decision-repeat-s 10`, the worker's 1 s heartbeat, its engine defaults of the day (batch 32,
1,024 tokens per iteration, 32,768 KV tokens), no rebalancing and no ZigZag (the stored run
predates both), and loads of the `small` model (87.6 MB) over links sized so that one lasts the
mean load time the real run's decision logs record (`load_result ... load_s=`).

The real side is the stored file: the same trace slice and configuration, run on an earlier day,
not side by side with the simulation.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

from blitzmesh.replay.schedule import Arrival, TokenScaling, TraceWindow, from_trace
from blitzmesh.replay.summary import Slo, timeline
from blitzmesh.replay.trace import read_azure_trace, repo_relative
from services.common.worker_profile import StepTimeModel

from .cluster import RunConfig, Simulation
from .links import ClusterSpec
from .profiles import ModelSpec, SimProfile, kv_bytes_per_token
from .scenarios import TRACES

__all__ = [
    "METRICS",
    "NOTES",
    "REAL_RESULT",
    "arrivals",
    "build_validation_runs",
    "measured_load_times",
    "relative_error",
    "table",
    "validate",
]

REPO_ROOT = Path(__file__).resolve().parents[2]
REAL_RESULT = REPO_ROOT / "bench" / "results" / "autoscale_quick.json"
METRICS = ("ttft_p50_s", "ttft_p99_s", "slo_attainment", "instance_seconds")
TOLERANCE = 0.20

# models/small/config.json: 6 layers, 4 KV heads x head_dim 64, float32; model.safetensors 87,588,824 B.
SMALL_CONFIG = {"num_hidden_layers": 6, "num_attention_heads": 8, "num_key_value_heads": 4, "head_dim": 64}
SMALL_BYTES = 87_588_824
# The worker's engine defaults of the stored run (services/worker/config.py).
MAX_BATCH, MAX_NUM_TOKENS, KV_CACHE_TOKENS, BLOCK_SIZE = 32, 1024, 32768, 16
# bench.autoscale's token scaling for the small model (its main(): context_tokens=2048).
CONTEXT_TOKENS = 2048
# The global manager's and worker's settings of the stored run.
HEARTBEAT_S = 1.0  # services/worker/config.py heartbeat_interval_s
LOST_AFTER_S = 5.0  # services/global_manager/config.py lost_after_s
ENGINE_STATS_WINDOW_S = 10.0  # services/worker/engine EngineConfig.stats_window_s
# CPU contention (RunConfig.host_cpu_cores, bench/simulate/cpu.py): the real mesh ran its 4 workers
# (plus gateway, manager, parameter manager) on setup.machine.cpus = 2 cores. The small model's
# compute per step alone on a core, c0 + c1 x batch tokens, is not measured here (the stored run
# and profiles/ are for other models): it is fitted to the real runs' TBT-mean p50 (not one of
# the validated metrics) over a grid (c0 0-0.05 s, c1 0-0.004 s, reserved 0-0.5 cores),
# constrained to c1 <= b = 0.002 s, because with 2 instances on the 2 cores the real TBT and TTFT
# p50 match plain pacing (compute alone never exceeds the pace). Best: c0 = 0.03 s, c1 = 0.002 s,
# no reserved share (0.25 fits no better): TBT-mean p50 0.099 / 0.100 / 0.162 / 0.102 s simulated
# vs 0.090 / 0.101 / 0.177 / 0.114 s real (fixed_peak / fixed_average / autoscaled / _bounds).
HOST_CPU_CORES = 2.0
HOST_CPU_RESERVED = 0.0
CPU_STEP_BASE_S = 0.03
CPU_STEP_TOKEN_S = 0.002


def load_real(path: Path = REAL_RESULT) -> dict[str, Any]:
    return json.loads(path.read_text(encoding="utf-8"))


def arrivals(setup: dict[str, Any], traces: Path = TRACES) -> list[Arrival]:
    """The request schedule `bench.autoscale` builds for `setup` (its `main()`, call for call)."""
    window = TraceWindow(**setup["trace_window"])
    ts = setup["token_scaling"]
    scaling = TokenScaling(
        prompt_scale=ts["prompt_scale"],
        max_prompt_tokens=ts["max_prompt_tokens"],
        max_output_tokens=ts["max_output_tokens"],
        context_tokens=CONTEXT_TOKENS,
    )
    return from_trace(
        read_azure_trace(traces / setup["trace"]),
        window,
        scaling,
        max_requests=5000,
        max_duration_s=window.span_s / window.compress if window.span_s else None,
    )


def measured_load_times(results_dir: Path, setup: dict[str, Any]) -> list[float]:
    """`load_s=` of every `load_result` in the stored run's decision logs (both autoscaled runs)."""
    log = results_dir / setup.get("decision_log", "autoscale_quick_decisions.csv")
    out: list[float] = []
    for path in (log, log.with_name(log.stem + "_bounds.csv")):
        if path.exists():
            text = path.read_text(encoding="utf-8")
            out += [float(x) for x in re.findall(r"load_result,[^,]*,ok,load_s=([0-9.]+)", text)]
    return out


def profile(setup: dict[str, Any]) -> SimProfile:
    acc = setup["accelerator_profile"]
    a, b = float(acc["step_time_a_s"]), float(acc["step_time_b_s"])
    step = StepTimeModel(base_s=a, prefill_token_s=b, decode_row_s=b)
    return SimProfile(
        device="emulated accelerator (bench.autoscale pacing)",
        model=ModelSpec(
            setup["model"], SMALL_BYTES, SMALL_CONFIG["num_hidden_layers"], kv_bytes_per_token(SMALL_CONFIG, 4)
        ),
        step=step,
        max_batch=MAX_BATCH,
        max_num_tokens=MAX_NUM_TOKENS,
        kv_blocks=KV_CACHE_TOKENS // BLOCK_SIZE,
        block_size=BLOCK_SIZE,
        source="emulated",
        source_ref=f"step = {a} s + {b} s x batch tokens (bench.autoscale --step-time-a-s/--step-time-b-s)",
    )


def cluster_for_load_time(workers: int, load_s: float) -> ClusterSpec:
    """One host of `workers` GPUs whose every link moves the small model in `load_s`."""
    g = SMALL_BYTES * 8 / load_s / 1e9
    return ClusterSpec(
        hosts=1, gpus_per_host=workers, hosts_per_leaf=1, rdma_gbps=g, nvlink_gbps=g, pcie_gbps=g, host_nic_gbps=g
    )


def _manager_arg(args: list[str], flag: str, default: float) -> float:
    return float(args[args.index(flag) + 1]) if flag in args else default


def build_validation_runs(
    real: dict[str, Any],
    results_dir: Path = REAL_RESULT.parent,
    *,
    engine_reports: bool = True,
    contention: bool = True,
) -> tuple[list[RunConfig], dict[str, Any]]:
    """One `RunConfig` per real run in the stored file, and what they were built from."""
    setup = real["setup"]
    arr = tuple(arrivals(setup))
    loads = measured_load_times(results_dir, setup)
    load_s = sum(loads) / len(loads) if loads else 1.0
    mesh = setup["mesh"]
    margs = mesh["manager_args"]
    slo = Slo(ttft_s=setup["slo"]["ttft_s"], tbt_s=setup["slo"]["tbt_mean_s"])
    common: dict[str, Any] = {
        "profile": profile(setup),
        "cluster": cluster_for_load_time(mesh["workers"], load_s),
        "arrivals": arr,
        "slo": slo,
        "max_instances": int(_manager_arg(margs, "--max-instances", mesh["workers"])),
        "tick_s": _manager_arg(margs, "--tick-s", 0.5),
        "window_s": _manager_arg(margs, "--window-s", 10.0),
        "decision_repeat_s": _manager_arg(margs, "--decision-repeat-s", 30.0),
        "heartbeat_s": HEARTBEAT_S,
        "lost_after_s": LOST_AFTER_S,
        "zigzag": False,
        "rebalance": False,
        "keep_alive_s": 0.0,
        "report_window_s": ENGINE_STATS_WINDOW_S if engine_reports else None,
    }
    if contention:
        common |= {
            "host_cpu_cores": HOST_CPU_CORES,
            "host_cpu_reserved": HOST_CPU_RESERVED,
            "cpu_step_base_s": CPU_STEP_BASE_S,
            "cpu_step_token_s": CPU_STEP_TOKEN_S,
        }
    policies = {
        "autoscaled": (setup["policy"], setup["policy_params"]),
        "autoscaled_bounds": (setup["autoscaled_bounds_policy"]["policy"], setup["autoscaled_bounds_policy"]["params"]),
    }
    runs = []
    for name, pool in mesh["pools"].items():
        if name not in real:
            continue
        if name in policies:
            policy, params = policies[name]
            runs.append(RunConfig(name=name, initial=pool, policy=policy, policy_params=dict(params), **common))
        else:
            runs.append(RunConfig(name=name, initial=pool, autoscale=False, **common))
    meta = {
        "requests": len(arr),
        "load_s_measured": [round(x, 3) for x in loads],
        "load_s_modelled": round(load_s, 3),
        "link_gbps": round(common["cluster"].rdma_gbps, 4),
    }
    return runs, meta


def relative_error(simulated: float | None, real: float | None) -> float | None:
    if simulated is None or real is None or real == 0:
        return None
    return round((simulated - real) / real, 4)


def _metrics(summary: dict[str, Any]) -> dict[str, float | None]:
    return {
        "ttft_p50_s": summary["ttft_s"]["p50"],
        "ttft_p99_s": summary["ttft_s"]["p99"],
        "slo_attainment": summary["slo_attainment"],
        "instance_seconds": summary["instance_seconds"],
    }


def compare(simulated: dict[str, Any], real: dict[str, Any]) -> dict[str, Any]:
    """Per metric `{simulated, real, relative_error, within_20pct}`."""
    sim_m, real_m = _metrics(simulated), _metrics(real)
    out: dict[str, Any] = {}
    for m in METRICS:
        err = relative_error(sim_m[m], real_m[m])
        out[m] = {
            "simulated": sim_m[m],
            "real": real_m[m],
            "relative_error": err,
            "within_20pct": err is not None and abs(err) <= TOLERANCE + 1e-9,
        }
    return out


NOTES = {
    "autoscaling_reports": "load reports: the simulator's default LoadReport covers the last heartbeat (1 s) with one "
    "TBT sample per engine step, so a step carrying a burst's prompts (up to 1,024 tokens = 2.1 s) makes the window "
    "TBT p50 ~1 s and HeteroScale panics at t=9 s; the real engine reports over a sliding 10 s window with one TBT "
    "sample per token (services/worker/engine stats_window_s) and did not panic. With report_window_s=10 (used here) "
    "the simulated decisions follow the real log: 1->2 at 17.0 s (real 18.05), 2->3 at 20.0 (20.11), 3->4 at 22.0 "
    "(23.13), 4->3 at 28.0 (28.65); instance-seconds moved from +11% to -4%.",
    "cpu_contention": "step time: modelled (host_cpu_cores=2, compute 0.03 s + 0.002 s x tokens per step, processor-"
    "shared, step = max(pace, compute); fitted to TBT-mean p50 only). It fixed fixed_peak's TTFT p99 (-59% -> +9%) and "
    "SLO attainment (+26% -> -10%) and autoscaled's TTFT p50 (-27% -> -7%), but overshoots TTFT p50 with 4 instances "
    "(fixed_peak +41%, autoscaled_bounds +28%): the fit is flat along c0 vs c1 and TTFT p50 is not (c0 = 0.04, c1 = "
    "0.0015 fits TBT almost as well and gives fixed_peak TTFT p50 0.51 s). With 2 instances it changes nothing "
    "(compute <= pace), so fixed_average's TTFT p99 (-24%, the real t=30 s burst at ~4.0 s) is left to what is not "
    "modelled: the gateway, manager and parameter manager's own CPU (a reserved share of 0.25 core fitted no better).",
    "slo_tbt": "SLO attainment needs TTFT <= 1.5 s AND mean TBT <= 0.2 s; the real TBT-mean p50 is 0.09-0.18 s, close "
    "to the line (simulated with the contention term 0.10-0.16 s), so a small error in the step-time term moves "
    "many requests across 0.2 s: attainment is the metric most sensitive to it (autoscaled: 0.16 real, the lowest, "
    "because its one instance served the first burst alone for 18 s; 0.35 simulated).",
    "load_time": "load time: one link rate for every load, set so the small model (87.6 MB) loads in the mean of the "
    "real runs' load_s (2.55 s); the real ones range 0.29-6.19 s (CPU contention again), which moves when each new "
    "instance serves by +-2 s.",
    "not_side_by_side": "the real side is bench/results/autoscale_quick.json (same trace slice and configuration, run "
    "on 2026-11-23 before the reconcile core, rebalancing and ZigZag existed; those are off here), not re-run beside "
    "the simulation; one run per side, so run-to-run noise of the real mesh (not measured here) is inside the errors.",
}


def _notes(per_run: dict[str, Any]) -> dict[str, Any]:
    """For each metric outside +-20%, which model term is off (keys of NOTES)."""
    terms = {
        "ttft_p50_s": ["cpu_contention"],
        "ttft_p99_s": ["cpu_contention", "load_time"],
        "slo_attainment": ["slo_tbt", "cpu_contention"],
        "instance_seconds": ["autoscaling_reports", "load_time"],
    }
    out: dict[str, Any] = {}
    for run, metrics in per_run.items():
        off = {m: terms[m] for m, v in metrics.items() if not v["within_20pct"]}
        if off:
            out[run] = off
    return {"outside_20pct": out, "terms": NOTES}


def validate(real_path: Path = REAL_RESULT, *, engine_reports: bool = True, contention: bool = True) -> dict[str, Any]:
    """The `validation` object of bench/results/simulator.json."""
    real = load_real(real_path)
    runs, meta = build_validation_runs(real, real_path.parent, engine_reports=engine_reports, contention=contention)
    per_run: dict[str, Any] = {}
    detail: dict[str, Any] = {}
    for cfg in runs:
        sim = Simulation(cfg)
        summary = sim.run()
        per_run[cfg.name] = compare(summary, real[cfg.name])
        records = sim.records
        tl = timeline(records, sim.samples, 2.5, summary["duration_s"])
        real_tl = real.get("timelines", {}).get(cfg.name, {})
        detail[cfg.name] = {
            "simulated_tbt_mean_p50_s": summary["tbt_mean_s"]["p50"],
            "real_tbt_mean_p50_s": real[cfg.name]["tbt_mean_s"]["p50"],
            "simulated_reached_serving_s": [round(t, 2) for t, _ in sim.reached_serving],
            "simulated_decisions": [line for line in sim.decision_log if ",no_change," not in line],
            "timeline": {
                "t_s": tl["t_s"],
                "instances": {"simulated": tl["instances"], "real": real_tl.get("instances")},
                "ttft_p99_s": {
                    "simulated": [None if x is None else round(x, 3) for x in tl["ttft_p99_s"]],
                    "real": [None if x is None else round(x, 3) for x in real_tl.get("ttft_p99_s", [])],
                },
            },
        }
    return {
        "real": repo_relative(real_path),
        "real_note": NOTES["not_side_by_side"],
        "scenario": "autoscale_quick",
        "model": {
            **meta,
            "step_time": "a + b x batch tokens as StepTimeModel(base_s=a, prefill_token_s=decode_row_s=b)",
            "reports": "sliding 10 s window, TBT per token (real engine)" if engine_reports else "per heartbeat",
            "rebalance": False,
            "zigzag": False,
            "cpu_contention": {
                "host_cpu_cores": HOST_CPU_CORES,
                "host_cpu_reserved": HOST_CPU_RESERVED,
                "cpu_step_base_s": CPU_STEP_BASE_S,
                "cpu_step_token_s": CPU_STEP_TOKEN_S,
                "model": "step = max(a + b x tokens, compute); compute = c0 + c1 x tokens CPU-seconds, processor-"
                "shared among the host's workers computing at once (rate min(1, cores / n), recomputed on every "
                "change); c0, c1 fitted to the real TBT-mean p50 with c1 <= b",
            }
            if contention
            else None,
        },
        "tolerance": TOLERANCE,
        "runs": per_run,
        "within_20pct": {run: all(v["within_20pct"] for v in m.values()) for run, m in per_run.items()},
        "notes": _notes(per_run),
        "detail": detail,
    }


def table(validation: dict[str, Any]) -> list[str]:
    lines = [f"{'run':<18} {'metric':<17} {'simulated':>10} {'real':>10} {'rel.err':>8}"]
    for run, metrics in validation["runs"].items():
        for m, v in metrics.items():
            err = v["relative_error"]
            flag = "" if v["within_20pct"] else "  *"
            lines.append(
                f"{run:<18} {m:<17} {_fmt(v['simulated']):>10} {_fmt(v['real']):>10} "
                f"{'-' if err is None else f'{err:+.1%}':>8}{flag}"
            )
    return lines


def _fmt(x: float | None) -> str:
    return "-" if x is None else f"{x:.3f}"
