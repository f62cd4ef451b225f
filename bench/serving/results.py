"""Per-request timings and their summary (throughput, TTFT and TBT percentiles) for one system."""

from __future__ import annotations

import itertools
import math
import statistics
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any


@dataclass
class RequestTiming:
    """Token arrival times of one request, seconds since the batch was submitted."""

    index: int
    output_tokens: int  # what the request asked for (= what it got: ignore_eos)
    token_times_s: list[float] = field(default_factory=list)

    @property
    def ttft_s(self) -> float:
        return self.token_times_s[0]

    @property
    def tbt_s(self) -> list[float]:
        t = self.token_times_s
        return [b - a for a, b in itertools.pairwise(t)]


def percentile(values: Sequence[float], q: float) -> float:
    """Nearest-rank percentile (the engine's own definition), q in (0, 1]."""
    if not values:
        raise ValueError("percentile of no values")
    ordered = sorted(values)
    return ordered[max(0, math.ceil(q * len(ordered)) - 1)]


@dataclass
class SystemResult:
    name: str
    wall_s: float
    useful_tokens: int  # each request's own output tokens, summed
    requests: list[RequestTiming]
    computed_tokens: int | None = None  # generated incl. padding rows past a request's end (static batches)
    notes: dict[str, Any] = field(default_factory=dict)

    @property
    def tok_s(self) -> float:
        return self.useful_tokens / self.wall_s

    def summary(self) -> dict[str, Any]:
        ttft = [r.ttft_s for r in self.requests]
        tbt = [gap for r in self.requests for gap in r.tbt_s]
        out: dict[str, Any] = {
            "tok_s": round(self.tok_s, 2),
            "wall_s": round(self.wall_s, 3),
            "useful_tokens": self.useful_tokens,
            "ttft_p50_s": round(percentile(ttft, 0.5), 4),
            "ttft_p99_s": round(percentile(ttft, 0.99), 4),
            "tbt_p50_s": round(percentile(tbt, 0.5), 4) if tbt else None,
            "tbt_p99_s": round(percentile(tbt, 0.99), 4) if tbt else None,
        }
        if self.computed_tokens is not None:
            out["computed_tokens"] = self.computed_tokens
        out.update(self.notes)
        return out


def is_clean(result: SystemResult, max_foreign_share: float) -> bool:
    """Whether other work on the machine took at most `max_foreign_share` of it during the round."""
    share = result.notes.get("foreign_cpu_share")
    return share is None or share <= max_foreign_share


def best_round(rounds: Sequence[SystemResult], max_foreign_share: float) -> SystemResult:
    """The fastest clean round (or the fastest of all, flagged, if none was clean), annotated with
    every round's throughput and foreign CPU share.

    Interference from other work only ever slows a round, so the fastest clean round is the best
    estimate of the system's own speed; the other rounds stay in the report.
    """
    clean = [r for r in rounds if is_clean(r, max_foreign_share)]
    best = max(clean or rounds, key=lambda r: r.tok_s)
    best.notes["contended"] = not clean
    best.notes["rounds"] = [
        {"tok_s": round(r.tok_s, 2), "foreign_cpu_share": r.notes.get("foreign_cpu_share")} for r in rounds
    ]
    best.notes["median_round_tok_s"] = round(statistics.median(r.tok_s for r in rounds), 2)
    return best
