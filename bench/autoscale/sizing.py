"""How big a pool a workload needs under an emulated accelerator profile. Pure.

The workers pace each engine iteration to `a + b * batch_tokens` seconds. A request of p prompt
and o output tokens then costs about `b * (p + o)` seconds of token work plus its share of the
per-iteration cost, `a * o / batch`, with `batch` requests decoding together. One instance
serves `1 / cost` requests per second at full load; pools are sized to run at
`target_utilization` of that, and HeteroScale's decode-TPS target is the same point expressed
in decode tokens per second.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Any

__all__ = ["Profile", "Sizing", "size_pools"]


@dataclass(frozen=True)
class Profile:
    """Emulated accelerator step time: `a_s + b_s * batch_tokens` per engine iteration."""

    a_s: float
    b_s: float

    def __post_init__(self) -> None:
        if self.a_s < 0 or self.b_s < 0 or self.a_s + self.b_s <= 0:
            raise ValueError(f"step-time profile needs a_s, b_s >= 0, not both 0; got {self.a_s!r}, {self.b_s!r}")

    def worker_args(self) -> list[str]:
        return ["--step-time-a-s", repr(self.a_s), "--step-time-b-s", repr(self.b_s)]


@dataclass(frozen=True)
class Sizing:
    request_cost_s: float
    capacity_rps: float
    target_decode_tps_per_instance: float
    fixed_average: int
    fixed_peak: int
    latency_s: float = 0.0  # one request's time in the system at the typical batch

    def requests_per_instance(self, utilization: float) -> float:
        """Little's law: requests in flight on one instance serving `utilization` of its capacity."""
        return self.capacity_rps * utilization * self.latency_s

    def to_json(self) -> dict[str, Any]:
        return {k: round(v, 4) if isinstance(v, float) else v for k, v in asdict(self).items()}


def size_pools(
    profile: Profile,
    *,
    mean_rps: float,
    peak_rps: float,
    mean_prompt_tokens: float,
    mean_output_tokens: float,
    typical_batch: float = 6.0,
    target_utilization: float = 0.7,
) -> Sizing:
    """Per-instance capacity and the fixed pools for the mean and the peak request rate."""
    if not 0 < target_utilization <= 1:
        raise ValueError(f"target_utilization must be in (0, 1], got {target_utilization!r}")
    if typical_batch < 1:
        raise ValueError(f"typical_batch must be >= 1, got {typical_batch!r}")
    if mean_rps < 0 or peak_rps < mean_rps:
        raise ValueError(f"need 0 <= mean_rps <= peak_rps, got {mean_rps!r}, {peak_rps!r}")
    cost_s = profile.b_s * (mean_prompt_tokens + mean_output_tokens) + profile.a_s * mean_output_tokens / typical_batch
    capacity_rps = 1.0 / cost_s
    usable_rps = capacity_rps * target_utilization

    def pool(rps: float) -> int:
        return max(1, math.ceil(rps / usable_rps - 1e-9))

    return Sizing(
        request_cost_s=cost_s,
        capacity_rps=capacity_rps,
        target_decode_tps_per_instance=usable_rps * mean_output_tokens,
        fixed_average=pool(mean_rps),
        fixed_peak=pool(peak_rps),
        # One prefill step, then one decode step per output token alongside typical_batch others.
        latency_s=(profile.a_s + profile.b_s * mean_prompt_tokens)
        + mean_output_tokens * (profile.a_s + profile.b_s * typical_batch),
    )
