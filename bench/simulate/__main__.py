"""Discrete-event cluster simulator driving the global manager's reconcile core.

Usage:
    python -m bench.simulate --scenario smoke|conv64|disagg16 [--variants blitzmesh,fixed_peak]
        [--seed 0] [--out bench/results/simulate_smoke.json]
    python -m bench.simulate --validate [--out bench/results/simulator.json]

Runs each variant of the scenario (`bench.simulate.scenarios`: blitzmesh, hpa, serverlessllm,
fixed_peak; for the disaggregated disagg16 pd_mixed, pd_split_hosts, pd_kill, pd_migrate,
colocated) on simulated workers and links, and writes one JSON: per variant the
`bench.replay.summary` figures (TTFT p50/p99, SLO attainment, instance-seconds = GPU-seconds,
lost) plus loads, actions and the simulator's own cost, and the scenario's sizing.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from .cluster import Simulation
from .scenarios import PD_VARIANTS, SCENARIOS, VARIANTS, build_runs

REPO_ROOT = Path(__file__).resolve().parents[2]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.simulate", description=__doc__.splitlines()[0])
    p.add_argument("--scenario", choices=sorted(SCENARIOS), default="smoke")
    p.add_argument(
        "--variants",
        default=None,
        help="comma-separated (default: all of the scenario's): "
        + ", ".join(VARIANTS)
        + "; or "
        + ", ".join(PD_VARIANTS),
    )
    p.add_argument("--seed", type=int, default=0)
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
    sc = SCENARIOS[args.scenario]
    variants = sc.variants if args.variants is None else tuple(v for v in args.variants.split(",") if v)
    runs, meta = build_runs(sc, variants, seed=args.seed)
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
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n", encoding="utf-8")
    print(f"wrote {out}")
    return 0


def _validate(out: Path) -> int:
    from .validation import table, validate

    validation = validate()
    for line in table(validation):
        print(line)
    existing = json.loads(out.read_text(encoding="utf-8")) if out.exists() else {}
    existing["validation"] = validation
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(existing, indent=2) + "\n", encoding="utf-8")
    print(f"wrote {out} (validation)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
