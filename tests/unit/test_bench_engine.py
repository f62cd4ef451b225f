"""bench.engine's pure parts: GuideLLM report reduction, ratios, the trace minute's thinning."""

from __future__ import annotations

from typing import Any

import pytest

from bench.engine.__main__ import (
    FLOP_PER_TOKEN,
    HIDDEN,
    LAYERS,
    VOCAB,
    auto_over_torch,
    over_gemm_limit,
    prompt_flop,
    ratios,
)
from bench.engine.limits import SHAPES
from bench.engine.load import summarize
from bench.engine.replay import MAX_OUTPUT, MAX_PROMPT, load_minute, thin


def _report(ttft: list[float], itl_median: float, out_mean: float) -> dict[str, Any]:
    def stat(values: list[float], median: float) -> dict[str, Any]:
        return {"successful": {"count": len(values), "median": median, "mean": sum(values) / len(values),
                               "percentiles": {"p99": max(values)}}}  # fmt: skip

    metrics = {
        "time_to_first_token_ms": stat(ttft, sorted(ttft)[len(ttft) // 2]),
        "inter_token_latency_ms": stat([itl_median], itl_median),
        "output_token_count": {"successful": {"count": len(ttft), "total_sum": out_mean * 20.0}},
        "request_totals": {"successful": len(ttft), "errored": 0},
    }
    return {"benchmarks": [{"metrics": metrics, "duration": 20.0}]}


def test_summarize_takes_medians_and_output_tokens_over_the_span() -> None:
    got = summarize(_report([300.0, 100.0, 200.0], 31.5, 44.4))
    assert got["ttft_ms_median"] == 200.0 and got["ttft_ms_p99"] == 300.0
    assert got["itl_ms_median"] == 31.5 and got["output_tok_s"] == 44.4
    assert got["requests"]["successful"] == 3


def test_summarize_refuses_a_run_with_no_completed_request() -> None:
    report = _report([1.0], 1.0, 1.0)
    report["benchmarks"][0]["metrics"]["time_to_first_token_ms"] = {"successful": {"count": 0}}
    with pytest.raises(RuntimeError, match="completed no request"):
        summarize(report)


def test_ratios_are_ours_over_theirs_where_higher_is_better_and_inverted_for_latency() -> None:
    ours = {
        "prefill_tok_s": {"256": 900.0, "1024": 800.0, "2048": 600.0},
        "itl_c1_ms": 30.0,
        "output_tok_s": {"1": 30.0, "4": 80.0, "16": 120.0},
        "trace": {"ttft_p99_s": 2.0, "ttft_p50_s": 0.5, "drain_s": 80.0},
    }
    theirs = {
        "prefill_tok_s": {"256": 800.0, "1024": 800.0, "2048": 700.0},
        "itl_c1_ms": 36.0,
        "output_tok_s": {"1": 25.0, "4": 100.0, "16": 96.0},
        "trace": {"ttft_p99_s": 3.0, "ttft_p50_s": 0.25, "drain_s": 100.0},
    }
    r = ratios(ours, theirs)
    assert r["prefill_256"] == 1.125 and r["prefill_1024"] == 1.0 and r["prefill_2048"] == 0.857
    assert r["itl_c1"] == 1.2  # their ITL over ours: we are faster
    assert (r["out_c1"], r["out_c4"], r["out_c16"]) == (1.2, 0.8, 1.25)
    assert r["trace_ttft_p99"] == 1.5 and r["trace_ttft_p50"] == 0.5 and r["trace_drain"] == 1.25
    theirs["itl_c1_ms"] = None
    assert ratios(ours, theirs)["itl_c1"] is None  # a missing figure gives no ratio, not a crash


def test_the_stored_minute_is_the_busiest_and_thinning_bounds_the_offered_load() -> None:
    minute = load_minute()
    assert len(minute) == 522 and all(0 <= t < 60 for t, _, _ in minute)
    k, picked = thin(minute, 60.0, offered_tok_s=300.0)
    assert sum(p for _, p, _ in picked) / 60.0 <= 300.0
    # k is the smallest stride that fits: one less would offer more.
    window = [[t, min(int(p), MAX_PROMPT), max(1, min(int(o), MAX_OUTPUT))] for t, p, o in minute]
    assert sum(p for _, p, _ in window[:: k - 1]) / 60.0 > 300.0
    assert all(p <= MAX_PROMPT and 1 <= o <= MAX_OUTPUT for _, p, o in picked)
    assert [t for t, _, _ in picked] == sorted(t for t, _, _ in picked)
    with pytest.raises(ValueError, match="no request"):
        thin([[70.0, 10, 10]], 60.0)


def test_prompt_flop_counts_projections_causal_attention_and_the_head_once() -> None:
    """Counted the slow way (each query row against itself and every earlier key, in every layer);
    the projections' count is the limit's GEMM shapes'."""
    assert FLOP_PER_TOKEN == LAYERS * sum(2 * o * i for o, i in SHAPES)
    for n in (1, 7, 354):
        attention = sum(LAYERS * 2 * 2 * HIDDEN * (row + 1) for row in range(n))
        assert prompt_flop(n) == n * FLOP_PER_TOKEN + attention + 2 * HIDDEN * VOCAB
    assert round(prompt_flop(354) / 354 / 1e6) == 225  # the figure the issue's own arithmetic used
    # at the GEMM rate exactly, a prompt runs at the limit; linear-only reads lower by attention's share
    n, gflops = 2048, 200.0
    tok_s = gflops * 1e9 * n / prompt_flop(n)
    assert over_gemm_limit(tok_s, n, gflops) == 1.0
    assert over_gemm_limit(tok_s, n, gflops, linear_only=True) == round(n * FLOP_PER_TOKEN / prompt_flop(n), 3)


def test_auto_over_torch_is_torchs_time_over_the_chosen_sides() -> None:
    engine = {
        "kernels": [
            {"op": "paged_decode", "impl": "native", "native_ms": 2.0, "torch_ms": 5.0, "speedup": 2.5},
            {"op": "varlen_prefill", "impl": "torch", "native_ms": 9.0, "torch_ms": 3.0, "speedup": 0.333},
            {"op": "small_gemm", "impl": "torch", "native_ms": None, "torch_ms": None, "speedup": None},
        ]
    }
    assert auto_over_torch(engine) == {"paged_decode": 2.5, "varlen_prefill": 1.0, "small_gemm": None}
    assert auto_over_torch(None) == {}
