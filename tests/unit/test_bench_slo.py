"""bench.slo's summary: attainment, goodput and the target comparison, on hand-made records."""

from __future__ import annotations

import pytest

from bench.slo.summary import SloRecord, compare, summarize


def record(i: int, *, outcome: str = "ok", ttft: float = 0.5, tpot: float = 0.05, tokens: int = 5, **kw) -> SloRecord:
    rec = SloRecord(i, kw.get("cls", 0), ttft_slo_s=1.0, tpot_slo_s=0.1, sent_s=10.0, output_tokens=tokens)
    rec.outcome = outcome  # type: ignore[assignment]
    if outcome == "ok":
        rec.first_token_s = 10.0 + ttft
        rec.last_token_s = rec.first_token_s + tpot * (tokens - 1)
        rec.tokens = tokens
    if outcome == "rejected":
        rec.rejected_slo = kw.get("slo", "ttft")
    return rec


def test_attainment_counts_refusals_as_misses_and_goodput_per_second() -> None:
    records = [
        record(0),  # meets both
        record(1, ttft=1.5),  # misses TTFT
        record(2, tpot=0.2),  # misses TPOT
        record(3, outcome="rejected", slo="tpot"),
        record(4, tokens=1),  # one token: TPOT 0, meets
    ]
    s = summarize(records, window_s=2.0)
    assert (s["sent"], s["admitted"], s["rejected"], s["rejected_tpot"], s["met_both"]) == (5, 4, 1, 1, 2)
    assert s["attainment"] == 0.4 and s["attainment_admitted"] == 0.5
    assert s["goodput_rps"] == 1.0
    assert s["ttft_attainment"] == 0.6 and s["tpot_attainment"] == 0.6
    assert records[2].tpot_s == pytest.approx(0.2)
    with pytest.raises(ValueError, match="window_s"):
        summarize(records, 0)


def test_compare_picks_the_first_rate_where_fcfs_falls_under_half() -> None:
    def summary(attainment: float, goodput: float, admitted: float) -> dict:
        return {"attainment": attainment, "goodput_rps": goodput, "attainment_admitted": admitted}

    results = {
        "fcfs": {"4": summary(0.9, 3.6, 0.9), "8": summary(0.4, 3.2, 0.4), "16": summary(0.1, 1.6, 0.1)},
        "scorpio": {"4": summary(0.95, 3.8, 0.95), "8": summary(0.85, 6.8, 0.93), "16": summary(0.5, 8.0, 0.9)},
    }
    c = compare(results, [4.0, 8.0, 16.0])
    assert c["rate_rps"] == 8.0 and c["goodput_ratio_scorpio_fcfs"] == pytest.approx(2.125)
    assert c["met"] == {"goodput_ratio": True, "attainment_admitted": True}
    results["scorpio"]["8"] = summary(0.5, 4.0, 0.8)
    assert compare(results, [4.0, 8.0, 16.0])["met"] == {"goodput_ratio": False, "attainment_admitted": False}
    assert compare({"fcfs": {"4": summary(0.9, 3.6, 0.9)}, "scorpio": {}}, [4.0])["rate_rps"] is None
