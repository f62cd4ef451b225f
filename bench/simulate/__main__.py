"""Discrete-event cluster simulator driving the global manager's reconcile core.

Usage:
    python -m bench.simulate --scenario smoke|conv64|disagg16|hour1000|churn64 [--variants blitzmesh,fixed_peak]
        [--seed 0] [--out bench/results/simulate_smoke.json]
    python -m bench.simulate --validate [--out bench/results/simulator.json]
    python -m bench.simulate --scenario esp [--quick] [--out bench/results/simulate_esp.json]

Runs each variant of the scenario (`bench.simulate.scenarios`: blitzmesh, hpa, serverlessllm,
fixed_peak; for the disaggregated disagg16 pd_mixed, pd_split_hosts, pd_kill, pd_migrate,
colocated) on simulated workers and links, and writes one JSON: per variant the
`blitzmesh.replay.summary` figures (TTFT p50/p99, SLO attainment, instance-seconds = GPU-seconds,
lost) plus loads, actions and the simulator's own cost, and the scenario's sizing. A scenario
with a `wall_key` (hour1000: `wall_s_1h_1000`) also records its first variant's wall time (trace
read and replicated, simulated, summarized), size and machine under that key: in its own JSON,
and, unless `--out` names another file, in bench/results/simulator.json, keeping that file's
other keys (so a trial or profiled run with `--out` leaves the published figure alone).

`--scenario esp` (bench/simulate/esp.py) is of another kind: elastic sequence parallelism, driven
by the global manager's ESP core, against chunked prefill and P/D disaggregation on 16 emulated
A100s, each at rising rates, in each regime of bench/simulate/esp.py's REGIMES (Llama-3-8B on the
conversation trace stretched to 128k; LoongServe's LWM-Text-1M on its Zipf mix and on LV-Eval
lengths); it writes the max throughput at SLO of each, and plots ESP's group degree over time
(`<out stem>_degrees.png`).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import platform
import resource
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from .cluster import Simulation
from .scenarios import PD_VARIANTS, SCENARIOS, VARIANTS, build_runs, heteroscale_overrides

REPO_ROOT = Path(__file__).resolve().parents[2]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.simulate", description=__doc__.splitlines()[0])
    p.add_argument("--scenario", choices=sorted([*SCENARIOS, "esp"]), default="smoke")
    p.add_argument("--quick", action="store_true", help="esp: fewer requests per rate")
    p.add_argument(
        "--variants",
        default=None,
        help="comma-separated (default: all of the scenario's): "
        + ", ".join(VARIANTS)
        + "; or "
        + ", ".join(PD_VARIANTS),
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--heteroscale",
        action="append",
        default=[],
        metavar="KEY=JSON",
        help="override one HeteroScale parameter of the scenario's runs, e.g. queue_target_s=0.25 or "
        "queue_rate='\"served\"' (repeatable; recorded in the JSON's policy_params)",
    )
    p.add_argument("--out", type=Path, default=None, help="default bench/results/simulate_<scenario>.json")
    p.add_argument(
        "--validate",
        action="store_true",
        help="replay bench.autoscale --quick's stored runs (bench/results/autoscale_quick.json) in the simulator "
        "and write the comparison to bench/results/simulator.json `validation`",
    )
    args = p.parse_args(argv)
    if args.validate:
        return _validate(args.out or REPO_ROOT / "bench" / "results" / "simulator.json")
    started = time.perf_counter()
    load_before = os.getloadavg()
    if args.scenario == "esp":
        return _esp(
            args.out or REPO_ROOT / "bench" / "results" / "simulate_esp.json", args.quick, args.seed, load_before
        )
    sc = SCENARIOS[args.scenario]
    variants = sc.variants if args.variants is None else tuple(v for v in args.variants.split(",") if v)
    runs, meta = build_runs(sc, variants, seed=args.seed)
    overrides = heteroscale_overrides(args.heteroscale)
    if overrides:
        runs = [
            dataclasses.replace(r, policy_params={**r.policy_params, **overrides}) if r.policy == "heteroscale" else r
            for r in runs
        ]
        meta.setdefault("policy_params", {}).setdefault("heteroscale", {}).update(overrides)
    build_s = time.perf_counter() - started
    out = args.out or REPO_ROOT / "bench" / "results" / f"simulate_{sc.name}.json"
    result = {
        "scenario": sc.name,
        "description": sc.description,
        "profile": {
            "device": runs[0].profile.device,
            "model": runs[0].profile.model.name,
            "source": runs[0].profile.source,
            "source_ref": runs[0].profile.source_ref,
        },
        "cluster": vars(sc.cluster),
        "seed": args.seed,
        "requests": len(runs[0].arrivals),
        **meta,
        "runs": {},
    }
    for cfg in runs:
        summary = Simulation(cfg).run()
        result["runs"][cfg.name] = summary
        ttft = summary["ttft_s"]
        print(
            f"{sc.name}/{cfg.name}: ttft p50 {ttft['p50']} p99 {ttft['p99']} slo {summary['slo_attainment']} "
            f"gpu_s {summary['gpu_seconds']} max {summary['instances_max']} lost {summary['lost']} "
            f"loads {summary['loads']['count']} (mean {summary['loads']['mean_s']} s) wall {summary['sim_wall_s']} s",
            flush=True,
        )
        if sc.wall_key and cfg is runs[0]:
            wall = {
                "wall_s": round(build_s + summary["sim_wall_s"], 2),
                "build_s": round(build_s, 2),
                "sim_wall_s": summary["sim_wall_s"],
                # CPU time (user + sys) of the whole process so far: less noisy than the wall
                # time on a machine shared with other jobs.
                "cpu_s": round(_cpu_s(), 2),
                "scenario": sc.name,
                "variant": cfg.name,
                "requests": len(cfg.arrivals),
                "events": summary["sim_events"],
                "instances_max": summary["instances_max"],
                "machine": _machine(load_before),
                "command": f"python -m bench.simulate --scenario {sc.name}"
                + "".join(f" --heteroscale {item}" for item in args.heteroscale),
            }
            result[sc.wall_key] = wall
            # The CPU the speed figure holds for, at the top level as every result records it.
            result["cpu"] = {"model": wall["machine"]["cpu"], "flags": wall["machine"]["cpu_flags"]}
            if args.out is None:
                _write_key(REPO_ROOT / "bench" / "results" / "simulator.json", sc.wall_key, wall)
            print(f"{sc.wall_key}: {wall['wall_s']} s ({build_s:.1f} s building the workload)", flush=True)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n", encoding="utf-8")
    print(f"wrote {out}")
    return 0


def _cpu_s() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def _machine(load_before: tuple[float, float, float]) -> dict[str, Any]:
    cpu = platform.processor() or platform.machine()
    flags: list[str] = []
    try:
        for line in Path("/proc/cpuinfo").read_text(encoding="utf-8").splitlines():
            key, _, value = line.partition(":")
            if key.strip() == "model name":
                cpu = value.strip()
            elif key.strip() == "flags":
                flags = sorted(value.split())
            if flags and cpu:
                break
    except OSError:
        pass
    return {
        "cpu": cpu,
        "cpu_flags": flags,
        "commit": _commit(),
        "cores": os.cpu_count(),
        "python": platform.python_version(),
        "load_avg_1m_before": round(load_before[0], 2),
        "load_avg_1m_after": round(os.getloadavg()[0], 2),
    }


def _commit() -> str:
    """The repository's commit, with "+dirty" when its tracked files differ from it ("" outside git)."""
    try:
        head = subprocess.run(
            ["git", "rev-parse", "HEAD"], cwd=REPO_ROOT, capture_output=True, text=True, check=True
        ).stdout.strip()
        dirty = subprocess.run(
            ["git", "status", "--porcelain", "--untracked-files=no"],
            cwd=REPO_ROOT,
            capture_output=True,
            text=True,
            check=True,
        ).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return ""
    return head + ("+dirty" if dirty else "")


def _write_key(path: Path, key: str, value: Any) -> None:
    """Set one key of a JSON object file, keeping the others (read, modify, write)."""
    existing = json.loads(path.read_text(encoding="utf-8")) if path.exists() else {}
    existing[key] = value
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(existing, indent=2) + "\n", encoding="utf-8")


def _esp(out: Path, quick: bool, seed: int, load_before: tuple[float, float, float]) -> int:
    from .esp import run_regimes
    from .plots import plot_esp_degrees

    result = run_regimes(quick=quick, seed=seed)
    result["machine"] = _machine(load_before)
    for name, r in result["regimes"].items():
        for s, rate in r["max_rate_at_slo_rps"].items():
            print(f"esp {name}/{s}: max rate at SLO {rate} rps", flush=True)
    print(", ".join(f"{k} {v}" for k, v in result.items() if k.startswith("esp_over")) + " (EMULATED)")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n", encoding="utf-8")
    print(f"wrote {out}")
    print(f"wrote {plot_esp_degrees(result['regimes'], out.with_name(out.stem + '_degrees.png'))}")
    return 0


def _validate(out: Path) -> int:
    from .validation import table, validate

    validation = validate()
    for line in table(validation):
        print(line)
    _write_key(out, "validation", validation)
    print(f"wrote {out} (validation)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
