"""Replay a trace (or a synthetic step/spike) against a running gateway, open loop.

Usage:
    python -m bench.replay --gateway http://127.0.0.1:8000 --admin 127.0.0.1:50051 \
        [--trace traces/azure_llm_2023_code.csv --start-s 480 --span-s 600 --compress 10 --thin 10]
        [--pattern step --base-rps 1 --burst-rps 6 --burst-start-s 10 --burst-end-s 30 --duration-s 60]
        [--max-requests N] [--max-duration-s S] [--out bench/results/replay.json]

Writes the schedule description, every request record, the instance samples, the cluster
events and the summary (completed / errored / lost, TTFT and TBT percentiles, SLO
attainment, instance-seconds) as JSON.
"""

from __future__ import annotations

import argparse
import asyncio
import json
from pathlib import Path

from blitzmesh.replay.runner import replay
from blitzmesh.replay.schedule import TokenScaling, TraceWindow, describe, from_trace, spike_pattern, step_pattern
from blitzmesh.replay.summary import Slo, summarize
from blitzmesh.replay.trace import read_azure_trace

REPO_ROOT = Path(__file__).resolve().parents[2]
DEFAULT_TRACE = REPO_ROOT / "traces" / "azure_llm_2023_code.csv"


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m bench.replay", description=__doc__.splitlines()[0])
    p.add_argument("--gateway", required=True, help="gateway HTTP base URL, e.g. http://127.0.0.1:8000")
    p.add_argument("--admin", default="", help="gateway gRPC address for instance sampling and events")
    p.add_argument("--model", default="small")
    p.add_argument("--vocab-size", type=int, default=2048, help="prompt ids are drawn below this")
    p.add_argument("--pattern", choices=("trace", "step", "spike"), default="trace")
    p.add_argument("--trace", type=Path, default=DEFAULT_TRACE, help="Azure LLM trace CSV")
    p.add_argument("--start-s", type=float, default=0.0, help="trace time to start at")
    p.add_argument("--span-s", type=float, default=600.0, help="trace seconds to replay")
    p.add_argument("--compress", type=float, default=10.0, help="trace seconds per replay second")
    p.add_argument("--thin", type=int, default=10, help="keep every n-th request of the window")
    p.add_argument("--prompt-scale", type=float, default=1 / 16)
    p.add_argument("--max-prompt-tokens", type=int, default=512)
    p.add_argument("--max-output-tokens", type=int, default=128)
    p.add_argument("--context-tokens", type=int, default=2048)
    p.add_argument("--base-rps", type=float, default=1.0)
    p.add_argument("--burst-rps", type=float, default=6.0)
    p.add_argument("--burst-start-s", type=float, default=10.0)
    p.add_argument("--burst-end-s", type=float, default=30.0)
    p.add_argument("--duration-s", type=float, default=60.0)
    p.add_argument("--prompt-tokens", type=int, default=32, help="synthetic patterns")
    p.add_argument("--output-tokens", type=int, default=32, help="synthetic patterns")
    p.add_argument("--max-requests", type=int, default=2000)
    p.add_argument("--max-duration-s", type=float, default=600.0)
    p.add_argument("--request-timeout-s", type=float, default=120.0)
    p.add_argument("--drain-timeout-s", type=float, default=60.0)
    p.add_argument("--ttft-slo-s", type=float, default=2.0)
    p.add_argument("--tbt-slo-s", type=float, default=0.25)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", type=Path, default=Path("bench/results/replay.json"))
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.pattern == "trace":
        scaling = TokenScaling(
            prompt_scale=args.prompt_scale,
            max_prompt_tokens=args.max_prompt_tokens,
            max_output_tokens=args.max_output_tokens,
            context_tokens=args.context_tokens,
        )
        window = TraceWindow(start_s=args.start_s, span_s=args.span_s, compress=args.compress, thin=args.thin)
        arrivals = from_trace(
            read_azure_trace(args.trace),
            window,
            scaling,
            max_requests=args.max_requests,
            max_duration_s=args.max_duration_s,
        )
    else:
        common = dict(
            prompt_tokens=args.prompt_tokens,
            output_tokens=args.output_tokens,
            seed=args.seed,
            max_requests=args.max_requests,
        )
        if args.pattern == "step":
            arrivals = step_pattern(
                base_rps=args.base_rps,
                burst_rps=args.burst_rps,
                burst_start_s=args.burst_start_s,
                burst_end_s=args.burst_end_s,
                duration_s=args.duration_s,
                **common,
            )
        else:
            arrivals = spike_pattern(
                base_rps=args.base_rps,
                spike_rps=args.burst_rps,
                spike_at_s=args.burst_start_s,
                spike_len_s=args.burst_end_s - args.burst_start_s,
                duration_s=args.duration_s,
                **common,
            )
    print(f"replaying {len(arrivals)} requests: {describe(arrivals)}")
    result = asyncio.run(
        replay(
            arrivals,
            http_url=args.gateway,
            model=args.model,
            admin_target=args.admin or None,
            request_timeout_s=args.request_timeout_s,
            drain_timeout_s=args.drain_timeout_s,
            vocab_size=args.vocab_size,
            seed=args.seed,
        )
    )
    summary = summarize(result.records, result.instances, result.duration_s, Slo(args.ttft_slo_s, args.tbt_slo_s))
    out = {
        "schedule": {"pattern": args.pattern, **describe(arrivals)},
        "summary": summary,
        "notes": result.notes,
        "records": [r.to_json() for r in result.records],
        "instances": [{"t_s": s.t_s, **s.counts} for s in result.instances],
        "events": result.events,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(out, indent=1) + "\n")
    print(json.dumps(summary, indent=2))
    print(f"wrote {args.out}")
    return 0 if summary["lost"] == 0 else 1


if __name__ == "__main__":
    raise SystemExit(main())
