"""The simulator's validation scenario replays exactly bench.autoscale --quick's schedule, and
its output has the documented keys."""

from __future__ import annotations

import pytest

from bench.autoscale.__main__ import QUICK
from bench.simulate import validation as v
from bench.simulate.scenarios import TRACES
from bench.simulate.worker import _wq
from blitzmesh.replay import TokenScaling, TraceWindow, from_trace, read_azure_trace

TRACE = TRACES / "azure_llm_2023_code.csv"
pytestmark = pytest.mark.skipif(not TRACE.exists(), reason=f"trace {TRACE} not present")


def _autoscale_quick_arrivals():
    # bench.autoscale.__main__.main(), --quick: the same calls and parameters.
    window = TraceWindow(**QUICK)
    scaling = TokenScaling(prompt_scale=1 / 16, max_prompt_tokens=512, max_output_tokens=128, context_tokens=2048)
    return from_trace(
        read_azure_trace(TRACE), window, scaling, max_requests=5000, max_duration_s=window.span_s / window.compress
    )


def test_request_list_equals_bench_autoscale_quick() -> None:
    real = v.load_real()
    assert real["setup"]["trace_window"] == QUICK
    ours = v.arrivals(real["setup"])
    theirs = _autoscale_quick_arrivals()
    assert len(ours) == len(theirs) == real["setup"]["workload"]["requests"]
    assert [a.t_s for a in ours] == [a.t_s for a in theirs]
    assert [(a.prompt_tokens, a.output_tokens) for a in ours] == [(a.prompt_tokens, a.output_tokens) for a in theirs]


def test_runs_mirror_the_stored_setup() -> None:
    real = v.load_real()
    runs, meta = v.build_validation_runs(real)
    setup = real["setup"]
    assert {r.name for r in runs} == {k for k in setup["mesh"]["pools"] if k in real}
    for r in runs:
        assert r.initial == setup["mesh"]["pools"][r.name]
        assert r.autoscale == r.name.startswith("autoscaled")
        assert r.profile.step.base_s == setup["accelerator_profile"]["step_time_a_s"]
        assert (
            r.profile.step.prefill_token_s
            == r.profile.step.decode_row_s
            == setup["accelerator_profile"]["step_time_b_s"]
        )
        assert (r.tick_s, r.window_s, r.decision_repeat_s, r.max_instances) == (0.5, 2.0, 10.0, 4)
    assert meta["load_s_measured"] and abs(meta["load_s_modelled"] - 2.549) < 0.01


def test_validation_output_keys() -> None:
    out = v.validate()
    assert set(out) >= {"real", "scenario", "model", "tolerance", "runs", "within_20pct", "notes", "detail"}
    assert set(out["runs"]) == {"autoscaled", "autoscaled_bounds", "fixed_average", "fixed_peak"}
    for metrics in out["runs"].values():
        assert set(metrics) == set(v.METRICS)
        for m in metrics.values():
            assert set(m) == {"simulated", "real", "relative_error", "within_20pct"}
            assert m["relative_error"] == pytest.approx((m["simulated"] - m["real"]) / m["real"], abs=1e-3)
    for run, off in out["notes"]["outside_20pct"].items():
        for metric, terms in off.items():
            assert not out["runs"][run][metric]["within_20pct"]
            assert all(t in out["notes"]["terms"] for t in terms)


def test_relative_error() -> None:
    assert v.relative_error(1.2, 1.0) == pytest.approx(0.2)
    assert v.relative_error(None, 1.0) is None
    assert v.relative_error(1.0, 0.0) is None


def test_weighted_percentile_counts_each_token() -> None:
    # One 2 s prefill-laden step decoding 1 row, ten 0.1 s steps of 5 rows: the per-token p50 is 0.1 s.
    samples = [(2.0, 1)] + [(0.1, 5)] * 10
    assert _wq(samples, 0.5) == 0.1
    assert _wq(samples, 0.9) == 0.1
    assert _wq(samples, 0.99) == 2.0  # rank 51 of 51
    assert _wq([(2.0, 1), (0.1, 1)], 0.99) == 2.0
    assert _wq([], 0.5) is None
