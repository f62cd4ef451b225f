"""Per-request records and instance samples of a replay, and their summary. Pure."""

from __future__ import annotations

import collections
import math
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any, ClassVar, Literal

__all__ = [
    "InstanceSample",
    "Outcome",
    "RequestRecord",
    "Slo",
    "instance_seconds",
    "percentile",
    "summarize",
    "timeline",
]

Outcome = Literal["ok", "error", "lost"]
#: States whose instances hold the model (paid-for capacity).
HELD_STATES = ("loading", "serving", "draining")


@dataclass
class RequestRecord:
    """One request as the client saw it. Times are seconds after the replay started.

    outcome: "ok" = a finish reason arrived; "error" = an HTTP error or an in-band error event
    (`error` holds its message); "lost" = neither before the stream ended or the replay's bound.
    """

    index: int
    scheduled_s: float
    prompt_tokens: int
    max_tokens: int
    sent_s: float = math.nan
    outcome: Outcome = "lost"
    error: str = ""
    status: int = 0
    ttft_s: float | None = None
    tbt_mean_s: float | None = None
    tbt_max_s: float | None = None
    completion_tokens: int = 0
    finish_reason: str = ""
    end_s: float | None = None

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


@dataclass(frozen=True)
class InstanceSample:
    """Instances of the replayed model by state at `t_s` (state names lower case), and how far
    each loading one is."""

    t_s: float
    counts: dict[str, int] = field(default_factory=dict)
    # k/L (layers usable over layers) of each LOADING instance of the model, by instance id.
    loading: dict[str, float] = field(default_factory=dict)

    @property
    def held(self) -> int:
        return sum(self.counts.get(s, 0) for s in HELD_STATES)

    @property
    def serving(self) -> int:
        return self.counts.get("serving", 0)


@dataclass(frozen=True)
class Slo:
    """A request meets the SLO if it completed with TTFT and mean TBT within these bounds."""

    ttft_s: float = 2.0
    tbt_s: float = 0.25
    # The causes `miss` names.
    MISSES: ClassVar[tuple[str, ...]] = ("ttft", "tbt_mean", "not_completed")

    def met(self, r: RequestRecord) -> bool:
        return self.miss(r) is None

    def miss(self, r: RequestRecord) -> str | None:
        """Why `r` missed: "not_completed", "ttft" (first token late, whatever the TBT),
        "tbt_mean" (in time, but its tokens came too slowly); None when it met the SLO."""
        if r.outcome != "ok" or r.ttft_s is None:
            return "not_completed"
        if r.ttft_s > self.ttft_s:
            return "ttft"
        if r.tbt_mean_s is not None and r.tbt_mean_s > self.tbt_s:
            return "tbt_mean"
        return None


def percentile(values: Iterable[float], q: float) -> float | None:
    """Nearest-rank percentile (q in [0, 1]); None for no values."""
    return percentiles(values, (q,))[0]


def percentiles(values: Iterable[float], qs: Sequence[float]) -> list[float | None]:
    """`percentile` at each of `qs`, sorting once (a CDF's hundred levels of a million values)."""
    xs = sorted(values)
    n = len(xs)
    if not n:
        return [None for _ in qs]
    return [xs[min(n, max(1, math.ceil(q * n - 1e-9))) - 1] for q in qs]


def instance_seconds(samples: Sequence[InstanceSample], end_s: float, start_s: float = 0.0) -> float:
    """Integral of held instances over [start_s, end_s], each sample holding until the next."""
    total = 0.0
    ordered = sorted(samples, key=lambda s: s.t_s)
    for i, s in enumerate(ordered):
        lo = max(start_s, s.t_s)
        hi = min(end_s, ordered[i + 1].t_s if i + 1 < len(ordered) else end_s)
        if hi > lo:
            total += s.held * (hi - lo)
    return total


def _r(x: float | None, digits: int = 4) -> float | None:
    return None if x is None else round(x, digits)


def summarize(
    records: Sequence[RequestRecord], samples: Sequence[InstanceSample], end_s: float, slo: Slo
) -> dict[str, Any]:
    """The figures a replay is judged by (one entry of a benchmark result)."""
    ok = [r for r in records if r.outcome == "ok"]
    ttfts = [r.ttft_s for r in ok if r.ttft_s is not None]
    tbts = [r.tbt_mean_s for r in ok if r.tbt_mean_s is not None]
    sent = len(records)
    errors: dict[str, int] = {}
    for r in records:
        if r.outcome == "error":
            key = r.error[:120]
            errors[key] = errors.get(key, 0) + 1
    held = [s.held for s in samples]
    misses = collections.Counter(slo.miss(r) for r in records)
    ttft_p50, ttft_p90, ttft_p99 = percentiles(ttfts, (0.5, 0.9, 0.99))
    tbt_p50, tbt_p99 = percentiles(tbts, (0.5, 0.99))
    return {
        "requests_sent": sent,
        "completed": len(ok),
        "errored": sum(r.outcome == "error" for r in records),
        "lost": sum(r.outcome == "lost" for r in records),
        "slo_attainment": _r(misses[None] / sent if sent else None),
        "slo": {"ttft_s": slo.ttft_s, "tbt_mean_s": slo.tbt_s},
        "slo_misses": {k: misses[k] for k in Slo.MISSES},
        "instance_seconds": round(instance_seconds(samples, end_s), 2),
        "instances_mean": _r(instance_seconds(samples, end_s) / end_s if end_s > 0 else None, 3),
        "instances_max": max(held, default=0),
        "ttft_s": {"p50": _r(ttft_p50), "p90": _r(ttft_p90), "p99": _r(ttft_p99)},
        "tbt_mean_s": {"p50": _r(tbt_p50), "p99": _r(tbt_p99)},
        "output_tokens": sum(r.completion_tokens for r in ok),
        "duration_s": round(end_s, 2),
        "errors": errors,
    }


def timeline(
    records: Sequence[RequestRecord],
    samples: Sequence[InstanceSample],
    bin_s: float,
    end_s: float,
    slo: Slo | None = None,
) -> dict[str, list[float | None]]:
    """Per `bin_s` bin: start time, request rate sent, TTFT p99 of requests sent in the bin
    (None when none completed), instances held and serving at the bin's end, and with `slo` the
    requests sent in the bin that missed it (where an SLO's misses are)."""
    n = max(1, math.ceil(end_s / bin_s))
    sent = [0] * n
    missed = [0] * n
    ttfts: list[list[float]] = [[] for _ in range(n)]
    for r in records:
        if math.isnan(r.sent_s):
            continue
        i = min(n - 1, int(r.sent_s // bin_s))
        sent[i] += 1
        missed[i] += slo is not None and not slo.met(r)
        if r.outcome == "ok" and r.ttft_s is not None:
            ttfts[i].append(r.ttft_s)
    ordered = sorted(samples, key=lambda s: s.t_s)
    held: list[float | None] = []
    serving: list[float | None] = []
    j = -1
    for i in range(n):
        t_end = (i + 1) * bin_s
        while j + 1 < len(ordered) and ordered[j + 1].t_s <= t_end:
            j += 1
        held.append(ordered[j].held if j >= 0 else None)
        serving.append(ordered[j].serving if j >= 0 else None)
    out: dict[str, list[float | None]] = {
        "t_s": [i * bin_s for i in range(n)],
        "rps": [c / bin_s for c in sent],
        "ttft_p99_s": [percentile(x, 0.99) for x in ttfts],
        "instances": held,
        "serving": serving,
    }
    if slo is not None:
        out["slo_missed"] = list(missed)
    return out


def token_rate(records: Sequence[RequestRecord], bin_s: float, end_s: float) -> list[float]:
    """Tokens served per second in each `bin_s` bin: a completed request's prompt tokens count
    at its first token (the prefill is done then), its completion tokens evenly between the
    first token and its end."""
    if not bin_s > 0:
        raise ValueError(f"bin_s must be > 0, got {bin_s!r}")
    n = max(1, math.ceil(end_s / bin_s))
    tokens = [0.0] * n

    def add(t_s: float, amount: float) -> None:
        tokens[min(n - 1, max(0, int(t_s // bin_s)))] += amount

    for r in records:
        if r.outcome != "ok" or r.ttft_s is None or math.isnan(r.sent_s):
            continue
        first_s = r.sent_s + r.ttft_s
        add(first_s, r.prompt_tokens)
        last_s = r.end_s if r.end_s is not None and r.end_s > first_s else first_s
        if r.completion_tokens <= 0:
            continue
        if last_s == first_s:
            add(first_s, r.completion_tokens)
            continue
        # Spread over the bins the stream overlaps, in proportion to the overlap.
        per_s = r.completion_tokens / (last_s - first_s)
        i = int(first_s // bin_s)
        while i * bin_s < last_s:
            lo, hi = max(first_s, i * bin_s), min(last_s, (i + 1) * bin_s)
            if hi > lo:
                add(lo, per_s * (hi - lo))
            i += 1
    return [round(t / bin_s, 2) for t in tokens]
