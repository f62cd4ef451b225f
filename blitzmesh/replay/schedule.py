"""Arrival schedules: a trace window compressed in time and scaled in tokens, or a synthetic
step/spike rate pattern. Pure and seeded, so a schedule is the same on every run.

An arrival's `t_s` is seconds after the replay starts; the replay sends it then whatever
happened to earlier requests (open loop).
"""

from __future__ import annotations

import math
import random
from collections.abc import Sequence
from dataclasses import dataclass

from .trace import TraceRow

__all__ = [
    "Arrival",
    "TokenScaling",
    "TraceWindow",
    "describe",
    "from_trace",
    "piecewise_pattern",
    "rate_per_bin",
    "spike_pattern",
    "step_pattern",
]


@dataclass(frozen=True, slots=True)
class Arrival:
    index: int
    t_s: float
    prompt_tokens: int
    output_tokens: int


@dataclass(frozen=True)
class TokenScaling:
    """Maps a trace's token counts onto a small model: prompt and output lengths are scaled,
    clamped, and the prompt shortened if prompt + output would not fit the context."""

    prompt_scale: float = 1 / 16
    min_prompt_tokens: int = 4
    max_prompt_tokens: int = 512
    output_scale: float = 1.0
    min_output_tokens: int = 1
    max_output_tokens: int = 128
    context_tokens: int = 2048

    def __post_init__(self) -> None:
        if not (self.prompt_scale > 0 and self.output_scale > 0):
            raise ValueError(
                f"scales must be > 0, got prompt_scale={self.prompt_scale!r} output_scale={self.output_scale!r}"
            )
        if not 1 <= self.min_prompt_tokens <= self.max_prompt_tokens:
            raise ValueError(
                f"need 1 <= min_prompt_tokens={self.min_prompt_tokens!r} <= "
                f"max_prompt_tokens={self.max_prompt_tokens!r}"
            )
        if not 1 <= self.min_output_tokens <= self.max_output_tokens:
            raise ValueError(
                f"need 1 <= min_output_tokens={self.min_output_tokens!r} <= "
                f"max_output_tokens={self.max_output_tokens!r}"
            )
        if self.min_prompt_tokens + self.max_output_tokens > self.context_tokens:
            raise ValueError(
                f"min_prompt_tokens + max_output_tokens = "
                f"{self.min_prompt_tokens + self.max_output_tokens} exceeds "
                f"context_tokens={self.context_tokens!r}"
            )

    def apply(self, prompt_tokens: int, output_tokens: int) -> tuple[int, int]:
        output = _clamp(round(output_tokens * self.output_scale), self.min_output_tokens, self.max_output_tokens)
        prompt = _clamp(round(prompt_tokens * self.prompt_scale), self.min_prompt_tokens, self.max_prompt_tokens)
        return min(prompt, self.context_tokens - output), output


@dataclass(frozen=True)
class TraceWindow:
    """Which part of a trace to replay and how fast.

    `start_s`/`span_s` pick trace time [start, start + span); `compress` trace seconds pass per
    replay second; `thin` keeps every thin-th request of the window (a 10x compression with
    thin=10 keeps the trace's mean rate while its bursts come 10x closer together).
    """

    start_s: float = 0.0
    span_s: float | None = None
    compress: float = 1.0
    thin: int = 1

    def __post_init__(self) -> None:
        if self.start_s < 0 or (self.span_s is not None and self.span_s <= 0):
            raise ValueError(f"need start_s >= 0 and span_s > 0, got {self.start_s!r}, {self.span_s!r}")
        if not self.compress > 0:
            raise ValueError(f"compress must be > 0, got {self.compress!r}")
        if self.thin < 1:
            raise ValueError(f"thin must be >= 1, got {self.thin!r}")


def _clamp(x: int, low: int, high: int) -> int:
    return min(high, max(low, x))


def _bound(arrivals: list[Arrival], max_requests: int | None, max_duration_s: float | None) -> list[Arrival]:
    if max_requests is not None and max_requests < 0:
        raise ValueError(f"max_requests must be >= 0, got {max_requests!r}")
    if max_duration_s is not None:
        arrivals = [a for a in arrivals if a.t_s < max_duration_s]
    if max_requests is not None:
        arrivals = arrivals[:max_requests]
    return [Arrival(i, a.t_s, a.prompt_tokens, a.output_tokens) for i, a in enumerate(arrivals)]


def from_trace(
    rows: Sequence[TraceRow],
    window: TraceWindow = TraceWindow(),
    scaling: TokenScaling = TokenScaling(),
    *,
    max_requests: int | None = None,
    max_duration_s: float | None = None,
) -> list[Arrival]:
    """The window's requests, in time order, compressed, thinned, scaled and bounded."""
    end_s = math.inf if window.span_s is None else window.start_s + window.span_s
    picked = [r for r in rows if window.start_s <= r.t_s < end_s]
    picked.sort(key=lambda r: r.t_s)
    arrivals = []
    for i, row in enumerate(picked[:: window.thin]):
        prompt, output = scaling.apply(row.prompt_tokens, row.output_tokens)
        arrivals.append(Arrival(i, (row.t_s - window.start_s) / window.compress, prompt, output))
    return _bound(arrivals, max_requests, max_duration_s)


def _tokens(rng: random.Random, spec: int | tuple[int, int]) -> int:
    if isinstance(spec, int):
        return spec
    low, high = spec
    return rng.randint(low, high)


def piecewise_pattern(
    segments: Sequence[tuple[float, float, float]],
    *,
    prompt_tokens: int | tuple[int, int] = 32,
    output_tokens: int | tuple[int, int] = 32,
    poisson: bool = True,
    seed: int = 0,
    max_requests: int | None = None,
) -> list[Arrival]:
    """Arrivals at rate `rps` during each `(start_s, end_s, rps)` segment: Poisson (seeded
    exponential gaps) or evenly spaced. Token counts are fixed or uniform in a (low, high) range."""
    rng = random.Random(seed)
    arrivals: list[Arrival] = []
    for start_s, end_s, rps in sorted(segments):
        if end_s < start_s or rps < 0:
            raise ValueError(f"segment ({start_s!r}, {end_s!r}, {rps!r}) needs end_s >= start_s and rps >= 0")
        if rps == 0:
            continue
        k = 0
        t = start_s + (rng.expovariate(rps) if poisson else 0.0)
        while t < end_s - 1e-9:
            arrivals.append(Arrival(0, t, _tokens(rng, prompt_tokens), _tokens(rng, output_tokens)))
            k += 1
            # Even spacing from the index, not by summing 1/rps (which drifts past end_s).
            t = t + rng.expovariate(rps) if poisson else start_s + k / rps
    arrivals.sort(key=lambda a: a.t_s)
    return _bound(arrivals, max_requests, None)


def step_pattern(
    *,
    base_rps: float,
    burst_rps: float,
    burst_start_s: float,
    burst_end_s: float,
    duration_s: float,
    **kw: object,
) -> list[Arrival]:
    """`base_rps`, then `burst_rps` in [burst_start_s, burst_end_s), then `base_rps` again."""
    if not 0 <= burst_start_s <= burst_end_s <= duration_s:
        raise ValueError(
            f"need 0 <= burst_start_s={burst_start_s!r} <= burst_end_s={burst_end_s!r} <= duration_s={duration_s!r}"
        )
    segments = [
        (0.0, burst_start_s, base_rps),
        (burst_start_s, burst_end_s, burst_rps),
        (burst_end_s, duration_s, base_rps),
    ]
    return piecewise_pattern(segments, **kw)  # type: ignore[arg-type]


def spike_pattern(
    *,
    base_rps: float,
    spike_rps: float,
    spike_at_s: float,
    spike_len_s: float,
    duration_s: float,
    **kw: object,
) -> list[Arrival]:
    """A short spike on a base rate: a step whose burst lasts `spike_len_s`."""
    return step_pattern(
        base_rps=base_rps,
        burst_rps=spike_rps,
        burst_start_s=spike_at_s,
        burst_end_s=min(duration_s, spike_at_s + spike_len_s),
        duration_s=duration_s,
        **kw,
    )


def rate_per_bin(arrivals: Sequence[Arrival], bin_s: float, duration_s: float | None = None) -> list[float]:
    """Requests per second in consecutive `bin_s` bins from t=0 (to `duration_s` or the last arrival)."""
    if not bin_s > 0:
        raise ValueError(f"bin_s must be > 0, got {bin_s!r}")
    end_s = duration_s if duration_s is not None else (max((a.t_s for a in arrivals), default=0.0) + 1e-9)
    counts = [0] * max(1, math.ceil(end_s / bin_s))
    for a in arrivals:
        i = int(a.t_s // bin_s)
        if 0 <= i < len(counts):
            counts[i] += 1
    return [c / bin_s for c in counts]


def describe(arrivals: Sequence[Arrival], peak_bin_s: float = 10.0) -> dict[str, float]:
    """Count, span, mean and peak (busiest `peak_bin_s`) rates, mean token counts."""
    n = len(arrivals)
    if n == 0:
        return {
            "requests": 0,
            "duration_s": 0.0,
            "mean_rps": 0.0,
            "peak_rps": 0.0,
            "mean_prompt_tokens": 0.0,
            "mean_output_tokens": 0.0,
            "peak_bin_s": peak_bin_s,
        }
    duration_s = max(a.t_s for a in arrivals)
    span_s = max(duration_s, peak_bin_s)
    return {
        "requests": n,
        "duration_s": duration_s,
        "mean_rps": n / span_s,
        "peak_rps": max(rate_per_bin(arrivals, peak_bin_s)),
        "mean_prompt_tokens": sum(a.prompt_tokens for a in arrivals) / n,
        "mean_output_tokens": sum(a.output_tokens for a in arrivals) / n,
        "peak_bin_s": peak_bin_s,
    }
