"""Replay a burst from an Azure LLM trace against a running mesh and print its scale-out live.

Usage: python -m services.mesh.burst [--gateway http://127.0.0.1:8000] [--admin 127.0.0.1:50051]
           [--model smollm2-135m-instruct] [--trace traces/azure_llm_2023_code.csv]
           [--peak-rps 8] [--lead-s 20] [--span-s 60] [--tail-s 40] [--cluster-every-s 1]

Picks the trace's busiest `--bin-s` seconds, replays from `--lead-s` before it for `--span-s`
(trace time, real speed), thinned so the busiest bin comes at about `--peak-rps` requests/s, and
sends every request open loop to the gateway's OpenAI HTTP API (blitzmesh.replay's sender). Meanwhile
it watches the cluster's events through the gateway's Admin API and prints, as they happen:
autoscaling decisions with their reasons, scale-outs and scale-ins, live-scaling instances with
k/L layers, ZigZag pairs, load results; and every `--cluster-every-s` a GetCluster line with each
instance's state, k/L while loading, requests running and waiting, ZigZag requests in flight and
those done. Bounded: the replay ends `--drain-timeout-s` after its last arrival, the watch
`--tail-s` after that (long enough to see the scale-in). Exit code 1 if a request was lost.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import math
import sys
import time
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import blitzmesh
from blitzmesh.replay.runner import replay
from blitzmesh.replay.schedule import Arrival, TokenScaling, TraceWindow, describe, from_trace
from blitzmesh.replay.summary import InstanceSample, Slo, summarize
from blitzmesh.replay.trace import TraceRow, read_azure_trace
from services.model_format.default_model import DEFAULT_MODEL_ID

DEFAULT_TRACE = Path(__file__).resolve().parents[2] / "traces" / "azure_llm_2023_code.csv"
# The events that tell the story of a scale-out (others, e.g. instance_state, repeat them).
SHOWN = (
    "autoscaling_decision",
    "autoscaling_bound",
    "scale_from_zero",
    "scale_out",
    "transfer_plan",
    "live_scaling",
    "zigzag_pair",
    "zigzag_stopped",
    "load_result",
    "rebalance",
    "scale_in",
    "drain_result",
    "instance_lost",
)


@dataclass(frozen=True)
class BurstPlan:
    """The slice of the trace to replay, and why."""

    window: TraceWindow
    busiest_start_s: float
    busiest_rps: float
    arrivals: list[Arrival]


def busiest_bin(rows: Sequence[TraceRow], bin_s: float) -> tuple[float, float]:
    """Start (trace seconds) and request rate of the busiest `bin_s`-long bin, bins aligned at 0;
    the earliest of equals."""
    if not bin_s > 0:
        raise ValueError(f"bin_s must be > 0, got {bin_s!r}")
    if not rows:
        raise ValueError("the trace has no rows")
    counts = Counter(math.floor(r.t_s / bin_s) for r in rows)
    top = max(counts.values())
    first = min(b for b, n in counts.items() if n == top)
    return first * bin_s, top / bin_s


def thin_for(busiest_rps: float, peak_rps: float) -> int:
    """Keep every n-th request so that the busiest bin comes at about `peak_rps` (n >= 1)."""
    if not peak_rps > 0:
        raise ValueError(f"peak_rps must be > 0, got {peak_rps!r}")
    return max(1, round(busiest_rps / peak_rps))


def plan_burst(
    rows: Sequence[TraceRow],
    *,
    peak_rps: float,
    lead_s: float,
    span_s: float,
    bin_s: float,
    scaling: TokenScaling,
    max_requests: int,
) -> BurstPlan:
    """The window from `lead_s` before the busiest bin, `span_s` long, at real speed, thinned to
    `peak_rps` at its peak."""
    if lead_s < 0 or not span_s > 0:
        raise ValueError(f"need lead_s >= 0 and span_s > 0, got {lead_s!r}, {span_s!r}")
    start_s, rps = busiest_bin(rows, bin_s)
    window = TraceWindow(start_s=max(0.0, start_s - lead_s), span_s=span_s, compress=1.0, thin=thin_for(rps, peak_rps))
    arrivals = from_trace(rows, window, scaling, max_requests=max_requests)
    return BurstPlan(window, start_s, rps, arrivals)


@dataclass
class ZigzagTally:
    """ZigZag requests done since the watch began, from the instances' cumulative counters
    (`zigzag_continued_total` on partners, `zigzag_relayed_total` on loading instances). A counter
    that goes down (the worker reloaded its engine) restarts from there."""

    continued: int = 0
    relayed: int = 0
    _last: dict[str, tuple[int, int]] = field(default_factory=dict)

    def update(self, state: blitzmesh.ClusterState) -> None:
        for inst in state.instances:
            now = (inst.load.zigzag_continued_total, inst.load.zigzag_relayed_total)
            before = self._last.get(inst.instance_id)
            if before is not None:
                self.continued += now[0] - before[0] if now[0] >= before[0] else now[0]
                self.relayed += now[1] - before[1] if now[1] >= before[1] else now[1]
            self._last[inst.instance_id] = now


def format_event(ev: blitzmesh.ClusterEvent, t_s: float) -> str | None:
    """One line per event of the scale-out story; None for the others."""
    if ev.action not in SHOWN:
        return None
    who = ev.instance_id or "-"
    if ev.action == "autoscaling_decision":
        # action=decision, target=scale_out/scale_in/no_change, status=the count change.
        text = f"decision      {ev.target} {ev.status}: {ev.reason}"
    elif ev.action == "live_scaling":
        text = f"live_scaling  {who} serves with {ev.status} layers: {ev.reason}"
    elif ev.action == "zigzag_pair":
        text = f"zigzag_pair   {who} runs the first layers, {ev.status} the rest: {ev.reason}"
    elif ev.action == "zigzag_stopped":
        text = f"zigzag_stop   {who} ({ev.status}): {ev.reason}"
    elif ev.action == "load_result":
        text = f"load_result   {who} {ev.status}: {ev.reason}"
    else:
        text = f"{ev.action:<13} {who} {ev.status}: {ev.reason}"
    return f"{t_s:7.1f}s  {text}"


def format_cluster(state: blitzmesh.ClusterState, model: str, t_s: float, tally: ZigzagTally) -> str:
    """The instances of `model` (IDLE workers counted) with k/L while loading, requests and ZigZag."""
    parts: list[str] = []
    idle = 0
    for inst in sorted(state.instances, key=lambda i: i.instance_id):
        if inst.state == "idle":
            idle += 1
            continue
        if inst.model_id != model:
            continue
        load = inst.load
        text = f"{inst.instance_id} {inst.state}"
        if inst.state == "loading":
            text += f" {inst.layers_loaded}/{inst.num_layers or '?'}"
        text += f" run={load.running} wait={load.waiting}"
        if load.zigzag_running:
            text += f" zigzag={load.zigzag_running}"
        parts.append(text)
    held = len(parts)
    body = " | ".join(parts) if parts else "no instance"
    return (
        f"{t_s:7.1f}s  cluster       {held} held, {idle} idle: {body}"
        f" || zigzag done {tally.continued} (relayed {tally.relayed})"
    )


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m services.mesh.burst", description=__doc__.splitlines()[0])
    p.add_argument("--gateway", default="http://127.0.0.1:8000", help="gateway HTTP base URL")
    p.add_argument("--admin", default="127.0.0.1:50051", help="gateway gRPC address (Admin API: events, cluster)")
    p.add_argument("--model", default=DEFAULT_MODEL_ID, help="a model the mesh lists")
    p.add_argument("--trace", type=Path, default=DEFAULT_TRACE, help="Azure LLM trace CSV")
    p.add_argument("--peak-rps", type=float, default=8.0, help="request rate of the busiest bin after thinning")
    p.add_argument("--bin-s", type=float, default=10.0, help="bin that finds the busiest part of the trace")
    p.add_argument("--lead-s", type=float, default=20.0, help="trace seconds replayed before the busiest bin")
    p.add_argument("--span-s", type=float, default=60.0, help="trace seconds replayed (at real speed)")
    p.add_argument("--max-requests", type=int, default=1000)
    p.add_argument("--prompt-scale", type=float, default=1 / 16, help="trace prompt tokens times this")
    p.add_argument("--max-prompt-tokens", type=int, default=512)
    p.add_argument("--max-output-tokens", type=int, default=128)
    p.add_argument("--request-timeout-s", type=float, default=120.0)
    p.add_argument(
        "--drain-timeout-s", type=float, default=60.0, help="after the last arrival, then open ones are lost"
    )
    p.add_argument("--tail-s", type=float, default=40.0, help="keep watching this long after the replay (scale-in)")
    p.add_argument("--cluster-every-s", type=float, default=1.0, help="period of the GetCluster lines")
    p.add_argument("--ttft-slo-s", type=float, default=2.0)
    p.add_argument("--tbt-slo-s", type=float, default=0.25)
    p.add_argument("--seed", type=int, default=0)
    return p


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = build_parser()
    a = p.parse_args(argv)
    positive = ("peak_rps", "bin_s", "span_s", "request_timeout_s", "cluster_every_s", "prompt_scale")
    for name in positive:
        if not getattr(a, name) > 0:
            p.error(f"--{name.replace('_', '-')} must be > 0, got {getattr(a, name)}")
    for name in ("lead_s", "drain_timeout_s", "tail_s"):
        if getattr(a, name) < 0:
            p.error(f"--{name.replace('_', '-')} must be >= 0, got {getattr(a, name)}")
    for name in ("max_requests", "max_prompt_tokens", "max_output_tokens"):
        if getattr(a, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1, got {getattr(a, name)}")
    if not a.gateway.startswith(("http://", "https://")):
        p.error(f"--gateway must be an http(s) URL, got {a.gateway!r}")
    if not a.trace.is_file():
        p.error(f"--trace {str(a.trace)!r} is not a file (the Azure traces are in the repository's traces/)")
    return a


async def _watch(client: blitzmesh.AsyncClient, t0: float, seen: Counter[str]) -> None:
    try:
        async for ev in client.watch_events():
            seen[ev.action] += 1
            line = format_event(ev, time.monotonic() - t0)
            if line is not None:
                print(line, flush=True)
    except blitzmesh.BlitzmeshError as e:
        print(f"{time.monotonic() - t0:7.1f}s  event watch ended: {e}", file=sys.stderr, flush=True)


async def _poll(
    client: blitzmesh.AsyncClient,
    model: str,
    t0: float,
    period_s: float,
    tally: ZigzagTally,
    samples: list[InstanceSample],
) -> None:
    while True:
        t_s = time.monotonic() - t0
        try:
            state = await client.cluster(timeout_s=5)
        except blitzmesh.BlitzmeshError as e:
            print(f"{t_s:7.1f}s  cluster       GetCluster failed: {e}", file=sys.stderr, flush=True)
        else:
            tally.update(state)
            counts = Counter(i.state for i in state.instances if i.model_id == model or i.state in ("idle", "lost"))
            samples.append(InstanceSample(t_s, dict(counts)))
            print(format_cluster(state, model, t_s, tally), flush=True)
        await asyncio.sleep(period_s)


async def run(a: argparse.Namespace) -> int:
    async with blitzmesh.AsyncClient(a.admin, timeout_s=10) as client:
        models = {m.model_id: m for m in await client.list_models()}
        if a.model not in models:
            print(
                f"model {a.model!r} is not listed by the mesh at {a.admin}; listed: {sorted(models)}", file=sys.stderr
            )
            return 2
        info = models[a.model]
        state = await client.cluster()
        scaling = TokenScaling(
            prompt_scale=a.prompt_scale,
            max_prompt_tokens=a.max_prompt_tokens,
            max_output_tokens=a.max_output_tokens,
            context_tokens=info.max_context or 2048,
        )
        plan = plan_burst(
            read_azure_trace(a.trace),
            peak_rps=a.peak_rps,
            lead_s=a.lead_s,
            span_s=a.span_s,
            bin_s=a.bin_s,
            scaling=scaling,
            max_requests=a.max_requests,
        )
        w = plan.window
        d = describe(plan.arrivals, peak_bin_s=a.bin_s)
        print(
            f"burst: {a.trace.name} t=[{w.start_s:.0f}, {w.start_s + (w.span_s or 0):.0f}) s, busiest {a.bin_s:g} s at "
            f"t={plan.busiest_start_s:.0f} s ({plan.busiest_rps:.1f} req/s), every {w.thin}th request: "
            f"{d['requests']} requests over {d['duration_s']:.0f} s, peak {d['peak_rps']:.1f} req/s, "
            f"mean {d['mean_prompt_tokens']:.0f} prompt + {d['mean_output_tokens']:.0f} output tokens",
            flush=True,
        )
        print(f"mesh: policy {state.policy}{' (advisory)' if state.advisory else ''}, model {a.model!r}", flush=True)
        tally, seen = ZigzagTally(), Counter[str]()
        samples: list[InstanceSample] = []
        t0 = time.monotonic()
        tasks = [
            asyncio.create_task(_watch(client, t0, seen)),
            asyncio.create_task(_poll(client, a.model, t0, a.cluster_every_s, tally, samples)),
        ]
        try:
            result = await replay(
                plan.arrivals,
                http_url=a.gateway,
                model=a.model,
                request_timeout_s=a.request_timeout_s,
                drain_timeout_s=a.drain_timeout_s,
                vocab_size=info.vocab_size or 2048,
                seed=a.seed,
            )
            print(f"{time.monotonic() - t0:7.1f}s  replay done; watching {a.tail_s:g} s more", flush=True)
            await asyncio.sleep(a.tail_s)
        finally:
            for task in tasks:
                task.cancel()
            for task in tasks:
                with contextlib.suppress(asyncio.CancelledError):
                    await task
    s = summarize(result.records, samples, result.duration_s, Slo(a.ttft_slo_s, a.tbt_slo_s))
    print(
        f"summary: {s['completed']}/{s['requests_sent']} completed, {s['errored']} errored, {s['lost']} lost; "
        f"TTFT p50 {s['ttft_s']['p50']} s p99 {s['ttft_s']['p99']} s; instances max {s['instances_max']}; "
        f"scale-outs {seen['scale_out']}, live-scaling instances {seen['live_scaling']}, "
        f"ZigZag requests done {tally.continued}",
        flush=True,
    )
    for message, n in sorted(s["errors"].items(), key=lambda kv: -kv[1])[:5]:
        print(f"  error x{n}: {message}", flush=True)
    return 1 if s["lost"] else 0


def main(argv: list[str] | None = None) -> int:
    return asyncio.run(run(parse_args(argv)))


if __name__ == "__main__":
    sys.exit(main())
