"""Named scenarios: a workload, a cluster, a profile, and the variants compared on them.

Variants of the autoscaling scenarios (`VARIANTS`): `blitzmesh` (HeteroScale, the GM's
multicast chains, ZigZag while loading), `hpa` (the HPA-style `utilization` policy, same data
plane), `serverlessllm` (the same policy, ServerlessLLM loading: a per-host cache with
keep-alive, a miss reads the SSD, no ZigZag), `fixed_peak` (DistServe/vLLM style: a fixed pool
sized for the busiest 5 s, no scaling).

Variants of a disaggregated scenario (`PD_VARIANTS`, fixed pools of `pd` prefill + decode
instances, IDLE spares beside them): `pd_mixed` (prefill and decode GPUs alternate on each
host: KV mostly over NVLink), `pd_split_hosts` (prefill GPUs on their own hosts: every KV
transfer over RDMA), `pd_kill` (`pd_mixed` with the busiest decode instance SIGKILLed and the
busiest prefill instance hung mid-burst), `pd_migrate` (`pd_mixed` with the core's live
migration on), `colocated` (the same GPUs as whole-request instances).

`hour1000` is the control plane at cluster scale: the whole hour of the Azure code trace,
rate-scaled x`HOUR_COPIES` (seeded copies, each shifted by up to `HOUR_SHIFT_S`), on 1,024 A100s
with the autoscaled pool bounded at 1,000; it runs HeteroScale only unless asked for more, and
`python -m bench.simulate --scenario hour1000` also writes its wall time to
bench/results/simulator.json `wall_s_1h_1000` (`Scenario.wall_key`).
"""

from __future__ import annotations

import dataclasses
import json
import math
import random
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from blitzmesh.replay.schedule import Arrival, TokenScaling, TraceWindow, from_trace
from blitzmesh.replay.summary import Slo
from blitzmesh.replay.trace import read_azure_trace
from services.global_manager.core.types import Role

from .cluster import Kill, RunConfig
from .links import ClusterSpec
from .profiles import PUBLISHED_PROFILES, FastStep, SimProfile, decode_capacity, measured_profile

__all__ = ["PD_VARIANTS", "SCENARIOS", "VARIANTS", "Scenario", "build_runs"]

REPO_ROOT = Path(__file__).resolve().parents[2]


TRACES = REPO_ROOT / "traces"  # the Azure traces, kept in the repository
VARIANTS = ("blitzmesh", "hpa", "serverlessllm", "fixed_peak")
PD_VARIANTS = ("pd_mixed", "pd_split_hosts", "pd_kill", "pd_migrate", "colocated")
TARGET_UTILIZATION = 0.7
# Prompts and outputs as the trace has them, within Llama-3-8B's 8,192-token context.
FULL_SIZE = TokenScaling(
    prompt_scale=1.0, max_prompt_tokens=6144, output_scale=1.0, max_output_tokens=2048, context_tokens=8192
)


@dataclass(frozen=True)
class Scenario:
    name: str
    description: str
    profile: Callable[[], SimProfile]
    cluster: ClusterSpec
    arrivals: Callable[[], list[Arrival]]
    slo: Slo
    initial: int | None  # None: sized for the mean rate
    max_instances: int
    batch_for_sizing: int
    scale_out_cooldown_s: float
    scale_in_cooldown_s: float
    keep_alive_s: float = 60.0
    pd: tuple[int, int] | None = None  # a disaggregated scenario: (prefill, decode) instances
    kills_at_s: tuple[float, float] = (0.0, 0.0)  # pd_kill: decode SIGKILLed, prefill hung
    default_variants: tuple[str, ...] = ()  # run unless --variants says otherwise (empty: all)
    wall_key: str = ""  # also write the run's wall time to bench/results/simulator.json under this key

    @property
    def variants(self) -> tuple[str, ...]:
        return self.default_variants or (PD_VARIANTS if self.pd else VARIANTS)


def peak_rps(arrivals: list[Arrival], bin_s: float = 5.0) -> float:
    counts: dict[int, int] = {}
    for a in arrivals:
        counts[int(a.t_s // bin_s)] = counts.get(int(a.t_s // bin_s), 0) + 1
    return max(counts.values(), default=0) / bin_s


def overlay(arrivals: list[Arrival], copies: int, span_s: float, seed: int) -> list[Arrival]:
    """`copies` copies of a trace slice, each rotated by a seeded offset within the slice: the
    rate times `copies`, the request mix and the slice's shape kept, the bursts smeared."""
    rng = random.Random(seed)
    out = list(arrivals)
    for _ in range(copies - 1):
        shift = rng.uniform(0, span_s)
        out += [dataclasses.replace(a, t_s=(a.t_s + shift) % span_s) for a in arrivals]
    out.sort(key=lambda a: (a.t_s, a.index))
    return [Arrival(i, a.t_s, a.prompt_tokens, a.output_tokens) for i, a in enumerate(out)]


def replicate(arrivals: list[Arrival], copies: int, shift_s: float, seed: int) -> list[Arrival]:
    """`copies` copies of the arrivals, each later by its own seeded offset in [0, shift_s): the
    rate times `copies`, the shape at scales longer than `shift_s` kept, bursts shorter than it
    smeared over it. Ties in time keep (copy, index) order. Numpy, for millions of requests."""
    rng = random.Random(seed)
    shifts = np.array([0.0] + [rng.uniform(0, shift_s) for _ in range(copies - 1)])
    t = np.array([a.t_s for a in arrivals], dtype=np.float64)
    prompt = np.array([a.prompt_tokens for a in arrivals], dtype=np.int64)
    output = np.array([a.output_tokens for a in arrivals], dtype=np.int64)
    times = (t[None, :] + shifts[:, None]).ravel()
    order = np.argsort(times, kind="stable")
    n = len(arrivals)
    return [
        Arrival(i, ts, p, o)
        for i, (ts, p, o) in enumerate(
            zip(times[order].tolist(), prompt[order % n].tolist(), output[order % n].tolist(), strict=True)
        )
    ]


def burst(arrivals: list[Arrival], start_s: float, end_s: float, extra: int, span_s: float, seed: int) -> list[Arrival]:
    """`arrivals` plus `extra` rotated copies of them kept only inside [start_s, end_s): the
    rate is (1 + extra) times higher there, a step up and down for the autoscaler."""
    more = [a for a in overlay(arrivals, extra + 1, span_s, seed)[len(arrivals) :] if start_s <= a.t_s < end_s]
    merged = sorted([*arrivals, *more], key=lambda a: (a.t_s, a.index))
    return [Arrival(i, a.t_s, a.prompt_tokens, a.output_tokens) for i, a in enumerate(merged)]


def _smoke_arrivals() -> list[Arrival]:
    # The code trace around its busiest minute (trace seconds 2400-2460 hold a 30+ req/s
    # burst), every 4th request, prompts scaled as bench.autoscale does for the small model.
    rows = read_azure_trace(TRACES / "azure_llm_2023_code.csv")
    window = TraceWindow(start_s=_busiest_start(rows) - 20.0, span_s=60.0, thin=4)
    return from_trace(rows, window, TokenScaling(prompt_scale=1 / 16, max_prompt_tokens=256, max_output_tokens=64))


def _busiest_start(rows: Any, bin_s: float = 10.0) -> float:
    counts: dict[int, int] = {}
    for r in rows:
        counts[int(r.t_s // bin_s)] = counts.get(int(r.t_s // bin_s), 0) + 1
    best = max(sorted(counts), key=lambda b: counts[b])
    return max(20.0, best * bin_s)


def _conv_arrivals() -> list[Arrival]:
    # A 10-minute slice of the conversation trace at 8x its rate (8 rotated copies, ~44 req/s),
    # 3x that from minute 4 to 6 (a step the trace itself lacks: its busiest 10 s are only 1.8x
    # its mean); full-size prompts and outputs (Llama-3-8B context 8192).
    rows = read_azure_trace(TRACES / "azure_llm_2023_conv.csv")
    base = from_trace(
        rows,
        TraceWindow(start_s=600.0, span_s=600.0),
        FULL_SIZE,
    )
    steady = overlay(base, 8, 600.0, seed=1)
    return burst(steady, 240.0, 360.0, extra=2, span_s=600.0, seed=2)


def _code_burst_arrivals() -> list[Arrival]:
    # The code trace's busiest 90 s (from 30 s before its busiest 10 s), full-size prompts
    # (mean ~2,000 tokens) and outputs (mean ~26), 4 rotated copies: 3,140 requests, ~35 req/s
    # on average and 67 in the busiest 5 s (the rotation smears the trace's own burst).
    rows = read_azure_trace(TRACES / "azure_llm_2023_code.csv")
    base = from_trace(
        rows,
        TraceWindow(start_s=_busiest_start(rows) - 30.0, span_s=90.0),
        FULL_SIZE,
    )
    return overlay(base, 4, 90.0, seed=3)


# The code trace is bursty: minutes with no request, 10 s at 33 req/s. Copies shifted by up to
# 10 s keep that shape (10-s bins), and x80 is what makes its bursts take the autoscaled pool to
# its bound of 1,000 instances (measured: 705,520 requests, 2,759 req/s in the busiest 5 s, the
# pool at 1,000 at the peak and 309 on average); copies shifted by up to a minute would smear the
# bursts and need x290 (2.6M requests) for the same peak pool.
HOUR_COPIES = 80
HOUR_SHIFT_S = 10.0


def _code_hour_arrivals() -> list[Arrival]:
    # The code trace's whole hour (8,819 requests over 57 min: mean 2.6 req/s, busiest minute
    # 10.5 req/s, quietest 0), full-size prompts (mean ~2,000 tokens) and outputs (mean 28).
    rows = read_azure_trace(TRACES / "azure_llm_2023_code.csv")
    base = from_trace(rows, TraceWindow(), FULL_SIZE)
    return replicate(base, HOUR_COPIES, HOUR_SHIFT_S, seed=5)


def _code_churn_arrivals() -> list[Arrival]:
    # The code trace's first 200 s (its first burst, a lull, a second burst) at x8, copies
    # shifted by up to 10 s as in hour1000: 1,792 requests.
    rows = read_azure_trace(TRACES / "azure_llm_2023_code.csv")
    base = from_trace(rows, TraceWindow(start_s=0.0, span_s=200.0), FULL_SIZE)
    return replicate(base, 8, HOUR_SHIFT_S, seed=5)


SCENARIOS: dict[str, Scenario] = {
    "smoke": Scenario(
        name="smoke",
        description="8 CPU workers (the measured SmolLM2-135M profile), 2 hosts x 4 on 2 leaves, 100 Gbps "
        "RDMA; the code trace's busiest minute, every 4th request; one instance at first",
        profile=measured_profile,
        cluster=ClusterSpec(hosts=2, gpus_per_host=4, hosts_per_leaf=1, rdma_gbps=100.0, nvlink_gbps=1600.0),
        arrivals=_smoke_arrivals,
        slo=Slo(ttft_s=1.5, tbt_s=0.2),
        initial=1,
        max_instances=8,
        batch_for_sizing=8,
        scale_out_cooldown_s=2.0,
        scale_in_cooldown_s=10.0,
        keep_alive_s=10.0,
    ),
    "conv64": Scenario(
        name="conv64",
        description="64 H100s (published-spec Llama-3-8B estimate), 8 hosts x 8 on 2 leaves, 200 Gbps RDMA per "
        "GPU, NVLink 3.6 Tbps, PCIe 400 Gbps, SSD 10 Gbps; a 10-minute conversation-trace slice at 8x rate, 24x in "
        "minutes 4-6; the autoscaled pools start sized for the mean rate",
        profile=lambda: PUBLISHED_PROFILES["h100-llama3-8b"],
        cluster=ClusterSpec(hosts=8, gpus_per_host=8, hosts_per_leaf=4, rdma_gbps=200.0, nvlink_gbps=3600.0),
        arrivals=_conv_arrivals,
        slo=Slo(ttft_s=1.0, tbt_s=0.1),
        initial=None,
        max_instances=64,
        batch_for_sizing=32,
        scale_out_cooldown_s=5.0,
        scale_in_cooldown_s=60.0,
        keep_alive_s=60.0,
    ),
    "disagg16": Scenario(
        name="disagg16",
        description="16 H100s (published-spec Llama-3-8B estimate) serving as 8 prefill + 8 decode instances, "
        "8 IDLE spares: 3 hosts x 8 on 2 leaves (hosts 0-1 serve, host 2 spare), 200 Gbps RDMA per GPU, NVLink "
        "3.6 Tbps; the code trace's busiest 90 s at 2x, full-size prompts; fixed pools (the floors), so a lost "
        "instance is replaced from the spares",
        profile=lambda: PUBLISHED_PROFILES["h100-llama3-8b"],
        cluster=ClusterSpec(hosts=3, gpus_per_host=8, hosts_per_leaf=2, rdma_gbps=200.0, nvlink_gbps=3600.0),
        arrivals=_code_burst_arrivals,
        slo=Slo(ttft_s=1.0, tbt_s=0.1),
        initial=16,
        max_instances=24,
        batch_for_sizing=32,
        scale_out_cooldown_s=5.0,
        scale_in_cooldown_s=60.0,
        pd=(8, 8),
        kills_at_s=(35.0, 45.0),
    ),
    "hour1000": Scenario(
        name="hour1000",
        description="1,024 A100s (published-spec Llama-3-8B estimate), 128 hosts x 8 on 16 leaves, 200 Gbps RDMA "
        "per GPU, NVLink 2.4 Tbps; the Azure code trace's whole hour at x80 (copies shifted by up to 10 s), "
        "full-size prompts; HeteroScale bounded at 1,000 instances, starting sized for the mean rate",
        profile=lambda: PUBLISHED_PROFILES["a100-llama3-8b"],
        cluster=ClusterSpec(hosts=128, gpus_per_host=8, hosts_per_leaf=8, rdma_gbps=200.0, nvlink_gbps=2400.0),
        arrivals=_code_hour_arrivals,
        slo=Slo(ttft_s=1.0, tbt_s=0.1),
        initial=None,
        max_instances=1000,
        batch_for_sizing=32,
        scale_out_cooldown_s=5.0,
        scale_in_cooldown_s=60.0,
        keep_alive_s=60.0,
        default_variants=("blitzmesh",),
        wall_key="wall_s_1h_1000",
    ),
    # hour1000 in miniature for tests/unit/test_simulate_identity.py: every decision kind of the
    # hour (scale-outs by the queue trigger, ZigZag pairs and hand-backs, rebalances, scale-ins,
    # drains taken back, loads onto kept weights) in a few seconds. The 10 s scale-in cooldown
    # and stabilization (hour1000: 60 s) make the pool churn, so drains still waiting meet the
    # next burst's scale-out.
    "churn64": Scenario(
        name="churn64",
        description="64 A100s (published-spec Llama-3-8B estimate), 8 hosts x 8 on 2 leaves, 200 Gbps RDMA per "
        "GPU, NVLink 2.4 Tbps; the Azure code trace's first 200 s at x8 (copies shifted by up to 10 s), full-size "
        "prompts; HeteroScale bounded at 60 instances with 10 s scale-in cooldown and stabilization, starting "
        "sized for the mean rate",
        profile=lambda: PUBLISHED_PROFILES["a100-llama3-8b"],
        cluster=ClusterSpec(hosts=8, gpus_per_host=8, hosts_per_leaf=4, rdma_gbps=200.0, nvlink_gbps=2400.0),
        arrivals=_code_churn_arrivals,
        slo=Slo(ttft_s=1.0, tbt_s=0.1),
        initial=None,
        max_instances=60,
        batch_for_sizing=32,
        scale_out_cooldown_s=5.0,
        scale_in_cooldown_s=10.0,
        keep_alive_s=60.0,
        default_variants=("blitzmesh",),
    ),
}


def sizing(sc: Scenario, profile: SimProfile, arrivals: list[Arrival]) -> dict[str, Any]:
    """Per-instance capacity and the pool sizes and policy targets that follow from it."""
    n = max(1, len(arrivals))
    prompt = sum(a.prompt_tokens for a in arrivals) / n
    output = sum(a.output_tokens for a in arrivals) / n
    cap_rps = decode_capacity(profile, prompt, output, sc.batch_for_sizing)
    step = FastStep(profile.step)
    b = sc.batch_for_sizing
    latency_s = step(prompt, prompt * (prompt + 1) / 2, 1, b, 0) + (output - 1) * step(
        0, 0, 0, b, b * (prompt + output / 2)
    )
    peak = peak_rps(arrivals)

    def pool(rps: float) -> int:
        return min(sc.max_instances, max(1, math.ceil(rps / (cap_rps * TARGET_UTILIZATION) - 1e-9)))

    return {
        "mean_prompt_tokens": round(prompt, 1),
        "mean_output_tokens": round(output, 1),
        "capacity_rps_per_instance": round(cap_rps, 3),
        "peak_rps_5s": peak,
        "mean_rps": round(n / max(a.t_s for a in arrivals), 3) if arrivals else 0.0,
        "fixed_peak": pool(peak),
        "fixed_mean": pool(n / max(a.t_s for a in arrivals) if arrivals else 0.0),
        "target_decode_tps_per_instance": round(cap_rps * TARGET_UTILIZATION * output, 2),
        "target_requests_per_instance": round(cap_rps * TARGET_UTILIZATION * latency_s, 2),
    }


def build_runs(
    sc: Scenario, variants: tuple[str, ...] = VARIANTS, seed: int = 0
) -> tuple[list[RunConfig], dict[str, Any]]:
    profile = sc.profile()
    arrivals = tuple(sc.arrivals())
    size = sizing(sc, profile, list(arrivals))
    if sc.pd is not None:
        return _pd_runs(sc, profile, arrivals, variants, seed), {"sizing": size}
    hetero = {
        "target_decode_tps_per_instance": size["target_decode_tps_per_instance"],
        "target_requests_per_instance": size["target_requests_per_instance"],
        "scale_out_cooldown_s": sc.scale_out_cooldown_s,
        "scale_in_cooldown_s": sc.scale_in_cooldown_s,
        "scale_in_stabilization_s": sc.scale_in_cooldown_s,
        "hold_scale_in_on_panic": True,
        "ttft_slo_s": sc.slo.ttft_s,
        "tbt_slo_s": sc.slo.tbt_s,
    }
    hpa = {
        "scale_out_cooldown_s": 0.0,
        "scale_in_cooldown_s": sc.scale_in_cooldown_s,
        "colocated_metric": "tps",
        "decode_capacity_tps_per_instance": round(size["capacity_rps_per_instance"] * size["mean_output_tokens"], 2),
    }
    initial = size["fixed_mean"] if sc.initial is None else sc.initial
    common = {
        "profile": profile,
        "cluster": sc.cluster,
        "arrivals": arrivals,
        "slo": sc.slo,
        "max_instances": sc.max_instances,
        "keep_alive_s": sc.keep_alive_s,
        "seed": seed,
    }
    table = {
        "blitzmesh": RunConfig(name="blitzmesh", initial=initial, policy_params=hetero, **common),
        "hpa": RunConfig(name="hpa", initial=initial, policy="utilization", policy_params=hpa, **common),
        "serverlessllm": RunConfig(
            name="serverlessllm", initial=initial, policy_params=hetero, loader="serverless", zigzag=False, **common
        ),
        "fixed_peak": RunConfig(name="fixed_peak", initial=size["fixed_peak"], autoscale=False, **common),
    }
    unknown = sorted(set(variants) - set(table))
    if unknown:
        raise ValueError(f"unknown variants {unknown!r}; known: {sorted(table)!r}")
    return [table[v] for v in variants], {"sizing": size, "policy_params": {"heteroscale": hetero, "utilization": hpa}}


def _pd_runs(
    sc: Scenario, profile: SimProfile, arrivals: tuple[Arrival, ...], variants: tuple[str, ...], seed: int
) -> list[RunConfig]:
    assert sc.pd is not None
    p, d = sc.pd
    common: dict[str, Any] = {
        "profile": profile,
        "cluster": sc.cluster,
        "arrivals": arrivals,
        "slo": sc.slo,
        "max_instances": sc.max_instances,
        "autoscale": False,
        "seed": seed,
    }
    pd: dict[str, Any] = {**common, "disaggregated": True, "initial_prefill": p, "initial_decode": d}
    decode_at, prefill_at = sc.kills_at_s
    table = {
        "pd_mixed": RunConfig(name="pd_mixed", **pd),
        "pd_split_hosts": RunConfig(name="pd_split_hosts", pd_layout="split_hosts", **pd),
        "pd_kill": RunConfig(
            name="pd_kill",
            kills=(Kill(decode_at, role=Role.DECODE), Kill(prefill_at, role=Role.PREFILL, mode="hang")),
            **pd,
        ),
        "pd_migrate": RunConfig(name="pd_migrate", live_migration=True, migration_tbt_slo_s=sc.slo.tbt_s, **pd),
        "colocated": RunConfig(name="colocated", initial=p + d, **common),
    }
    unknown = sorted(set(variants) - set(table))
    if unknown:
        raise ValueError(f"unknown variants {unknown!r}; known: {sorted(table)!r}")
    return [table[v] for v in variants]


def heteroscale_overrides(items: list[str]) -> dict[str, Any]:
    """`--heteroscale KEY=JSON` pairs as a dict; a pair without `=` or with a value that is not
    JSON is refused with the pair quoted."""
    out: dict[str, Any] = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise SystemExit(f"--heteroscale takes KEY=JSON, got {item!r}")
        try:
            out[key] = json.loads(value)
        except json.JSONDecodeError as e:
            raise SystemExit(f"--heteroscale {item!r}: the value is not JSON ({e.msg})") from e
    return out
