"""Per-request outcomes of an SLO-mix run and their summary: attainment and goodput. Pure."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any, Literal

from blitzmesh.replay.summary import percentile

Outcome = Literal["ok", "rejected", "error", "lost"]


@dataclass
class SloRecord:
    """One request as the client saw it; times in seconds after the rate's start."""

    index: int
    slo_class: int
    ttft_slo_s: float
    tpot_slo_s: float
    sent_s: float
    output_tokens: int
    outcome: Outcome = "lost"
    rejected_slo: str = ""  # "ttft" or "tpot" when refused
    first_token_s: float | None = None
    last_token_s: float | None = None
    tokens: int = 0
    error: str = ""

    @property
    def ttft_s(self) -> float | None:
        return None if self.first_token_s is None else self.first_token_s - self.sent_s

    @property
    def tpot_s(self) -> float | None:
        """Mean gap between tokens after the first; 0 for a one-token answer."""
        if self.first_token_s is None or self.last_token_s is None:
            return None
        return (self.last_token_s - self.first_token_s) / (self.tokens - 1) if self.tokens > 1 else 0.0

    @property
    def meets_ttft(self) -> bool:
        return self.outcome == "ok" and self.ttft_s is not None and self.ttft_s <= self.ttft_slo_s

    @property
    def meets_tpot(self) -> bool:
        return self.outcome == "ok" and self.tpot_s is not None and self.tpot_s <= self.tpot_slo_s

    @property
    def meets_both(self) -> bool:
        return self.meets_ttft and self.meets_tpot

    def to_json(self) -> dict[str, Any]:
        return {**asdict(self), "ttft_s": self.ttft_s, "tpot_s": self.tpot_s}


def _ratio(num: int, den: int) -> float | None:
    return round(num / den, 4) if den else None


def _pct(values: Sequence[float], q: float) -> float | None:
    p = percentile(list(values), q)
    return None if p is None else round(p, 4)


def summarize(records: Sequence[SloRecord], window_s: float) -> dict[str, Any]:
    """Attainment and goodput of one (policy, rate) run.

    - `attainment`: requests meeting both SLOs / requests sent (a refusal counts as a miss);
    - `attainment_admitted`: the same over the requests not refused;
    - `goodput_rps`: requests meeting both SLOs per second of the arrival window.
    """
    if window_s <= 0:
        raise ValueError(f"window_s must be > 0, got {window_s!r}")
    sent = len(records)
    admitted = [r for r in records if r.outcome != "rejected"]
    good = sum(r.meets_both for r in records)
    ok = [r for r in records if r.outcome == "ok"]
    ttfts = [r.ttft_s for r in ok if r.ttft_s is not None]
    tpots = [r.tpot_s for r in ok if r.tpot_s is not None and r.tokens > 1]
    classes: dict[str, Any] = {}
    for c in sorted({r.slo_class for r in records}):
        mine = [r for r in records if r.slo_class == c]
        mine_admitted = [r for r in mine if r.outcome != "rejected"]
        classes[str(c)] = {
            "ttft_slo_s": mine[0].ttft_slo_s,
            "tpot_slo_s": mine[0].tpot_slo_s,
            "sent": len(mine),
            "rejected": len(mine) - len(mine_admitted),
            "attainment": _ratio(sum(r.meets_both for r in mine), len(mine)),
            "attainment_admitted": _ratio(sum(r.meets_both for r in mine_admitted), len(mine_admitted)),
            "ttft_attainment": _ratio(sum(r.meets_ttft for r in mine), len(mine)),
            "tpot_attainment": _ratio(sum(r.meets_tpot for r in mine), len(mine)),
        }
    return {
        "sent": sent,
        "admitted": len(admitted),
        "rejected": sent - len(admitted),
        "rejected_ttft": sum(r.rejected_slo == "ttft" for r in records),
        "rejected_tpot": sum(r.rejected_slo == "tpot" for r in records),
        "errors": sum(r.outcome == "error" for r in records),
        "lost": sum(r.outcome == "lost" for r in records),
        "met_both": good,
        "goodput_rps": round(good / window_s, 4),
        "attainment": _ratio(good, sent),
        "attainment_admitted": _ratio(sum(r.meets_both for r in admitted), len(admitted)),
        "ttft_attainment": _ratio(sum(r.meets_ttft for r in records), sent),
        "tpot_attainment": _ratio(sum(r.meets_tpot for r in records), sent),
        "ttft_p50_s": _pct(ttfts, 0.5),
        "ttft_p99_s": _pct(ttfts, 0.99),
        "tpot_p50_s": _pct(tpots, 0.5),
        "tpot_p99_s": _pct(tpots, 0.99),
        "completed_rps": round(len(ok) / window_s, 4),
        "per_class": classes,
    }


def compare(results: dict[str, dict[str, dict[str, Any]]], rates: Sequence[float]) -> dict[str, Any]:
    """The issue's targets: at the lowest rate where FCFS attains under 50%, SCORPIO's goodput
    over FCFS's (target >= 2) and the share of SCORPIO's admitted requests meeting their SLOs
    (target >= 0.9). `results[policy][rate_key]` holds `summarize` output."""
    out: dict[str, Any] = {"rate_rps": None, "goodput_ratio_scorpio_fcfs": None, "scorpio_attainment_admitted": None}
    for rate in rates:
        key = rate_key(rate)
        fcfs = results.get("fcfs", {}).get(key)
        scorpio = results.get("scorpio", {}).get(key)
        if fcfs is None or scorpio is None or fcfs["attainment"] is None or fcfs["attainment"] >= 0.5:
            continue
        out["rate_rps"] = rate
        out["fcfs_attainment"] = fcfs["attainment"]
        base = fcfs["goodput_rps"]
        out["goodput_ratio_scorpio_fcfs"] = round(scorpio["goodput_rps"] / base, 3) if base > 0 else None
        if base == 0:
            out["note"] = "FCFS goodput is 0 at this rate: the ratio is unbounded"
        out["scorpio_attainment_admitted"] = scorpio["attainment_admitted"]
        break
    out["targets"] = {"goodput_ratio_scorpio_fcfs": ">= 2", "scorpio_attainment_admitted": ">= 0.9"}
    ratio, adm = out["goodput_ratio_scorpio_fcfs"], out["scorpio_attainment_admitted"]
    out["met"] = {
        "goodput_ratio": None if out["rate_rps"] is None else (ratio is None or ratio >= 2.0),
        "attainment_admitted": None if adm is None else adm >= 0.9,
    }
    return out


def rate_key(rate: float) -> str:
    return f"{rate:g}"
