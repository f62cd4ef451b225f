"""blitzmesh.replay's pure parts: trace parsing, token scaling, schedules, stream folding, summaries."""

from __future__ import annotations

import itertools
import json
import math
import random
from pathlib import Path

import pytest

from blitzmesh.replay import (
    Arrival,
    InstanceSample,
    RequestRecord,
    Slo,
    StreamState,
    TokenScaling,
    TraceRow,
    TraceWindow,
    describe,
    from_trace,
    instance_seconds,
    parse_timestamp,
    parse_timestamp_ns,
    percentile,
    percentiles,
    piecewise_pattern,
    prompt_ids,
    rate_per_bin,
    read_azure_trace,
    spike_pattern,
    step_pattern,
    summarize,
    timeline,
)
from blitzmesh.replay.trace import REPO_ROOT, repo_relative

CSV = """TIMESTAMP,ContextTokens,GeneratedTokens
2023-11-16 18:17:04.0319600,3180,8
2023-11-16 18:17:03.9799600,4808,10
2023-11-16 18:17:05.5000000,100,300
2023-11-16 18:17:13.9799600,16,1
"""


@pytest.fixture
def trace_file(tmp_path: Path) -> Path:
    path = tmp_path / "t.csv"
    path.write_text(CSV)
    return path


def test_parse_timestamp_keeps_seven_digits(tmp_path: Path) -> None:
    a = parse_timestamp_ns("2023-11-16 18:17:03.9799600")
    assert parse_timestamp_ns("2023-11-16 18:17:03.9799601") - a == 100
    assert parse_timestamp_ns("2023-11-16 18:17:04") - a == 20_040_000
    assert parse_timestamp("1970-01-01 00:00:01.5") == 1.5
    with pytest.raises(ValueError, match="'yesterday'"):
        parse_timestamp("yesterday")
    path = tmp_path / "fine.csv"
    path.write_text(
        "TIMESTAMP,ContextTokens,GeneratedTokens\n2023-11-16 18:17:03.9799600,1,1\n2023-11-16 18:17:03.9799601,1,1\n"
    )
    assert read_azure_trace(path)[1].t_s == pytest.approx(1e-7, rel=1e-6)


def test_read_trace_sorts_and_rebases(trace_file: Path) -> None:
    rows = read_azure_trace(trace_file)
    assert [r.prompt_tokens for r in rows] == [4808, 3180, 100, 16]
    assert rows[0].t_s == 0.0
    assert rows[1].t_s == pytest.approx(0.052)
    assert rows[3].t_s == pytest.approx(10.0)


def test_read_trace_quotes_bad_input(tmp_path: Path) -> None:
    bad = tmp_path / "bad.csv"
    bad.write_text("TIMESTAMP,ContextTokens\n2023-11-16 18:17:04.0,3\n")
    with pytest.raises(ValueError, match="GeneratedTokens"):
        read_azure_trace(bad)
    bad.write_text("TIMESTAMP,ContextTokens,GeneratedTokens\n2023-11-16 18:17:04.0,x,3\n")
    with pytest.raises(ValueError, match="line 2"):
        read_azure_trace(bad)


def test_real_code_trace_shape() -> None:
    path = Path(__file__).resolve().parents[2] / "traces" / "azure_llm_2023_code.csv"
    if not path.exists():
        pytest.skip(f"{path} not present")
    rows = read_azure_trace(path)
    assert len(rows) == 8819
    assert 56 * 60 < rows[-1].t_s < 58 * 60
    # traces/README.md's busiest 10 s: 32.7 req/s.
    peak = max(rate_per_bin([Arrival(0, r.t_s, 1, 1) for r in rows], 10.0))
    assert peak == pytest.approx(32.7, abs=0.1)


def test_token_scaling() -> None:
    s = TokenScaling(
        prompt_scale=0.1,
        min_prompt_tokens=4,
        max_prompt_tokens=100,
        min_output_tokens=2,
        max_output_tokens=50,
        context_tokens=120,
    )
    assert s.apply(500, 10) == (50, 10)
    assert s.apply(10, 1) == (4, 2)  # clamped up
    assert s.apply(5000, 500) == (70, 50)  # clamped, then prompt cut to fit the context
    with pytest.raises(ValueError, match="context_tokens"):
        TokenScaling(min_prompt_tokens=10, max_output_tokens=100, context_tokens=100)
    with pytest.raises(ValueError, match="prompt_scale"):
        TokenScaling(prompt_scale=0)


def test_from_trace_window_compress_thin_bound() -> None:
    rows = [TraceRow(float(t), 160, 20) for t in range(100)]
    a = from_trace(rows, TraceWindow(start_s=10, span_s=50, compress=10, thin=5), TokenScaling(prompt_scale=0.5))
    assert [x.t_s for x in a] == pytest.approx([0.0, 0.5, 1.0, 1.5, 2.0, 2.5, 3.0, 3.5, 4.0, 4.5])
    assert [x.index for x in a] == list(range(10))
    assert {(x.prompt_tokens, x.output_tokens) for x in a} == {(80, 20)}
    assert len(from_trace(rows, TraceWindow(compress=10), max_requests=7)) == 7
    assert max(x.t_s for x in from_trace(rows, TraceWindow(compress=10), max_duration_s=3.0)) < 3.0
    with pytest.raises(ValueError, match="thin"):
        TraceWindow(thin=0)


def test_step_pattern_rates_and_determinism() -> None:
    kw = dict(base_rps=2.0, burst_rps=20.0, burst_start_s=10.0, burst_end_s=20.0, duration_s=30.0)
    even = step_pattern(**kw, poisson=False)
    assert len(even) == 20 + 200 + 20
    assert all(b.t_s >= a.t_s for a, b in itertools.pairwise(even))
    rates = rate_per_bin(even, 10.0, 30.0)
    assert rates == pytest.approx([2.0, 20.0, 2.0])
    p1 = step_pattern(**kw, seed=3, prompt_tokens=(8, 16))
    p2 = step_pattern(**kw, seed=3, prompt_tokens=(8, 16))
    assert p1 == p2 and all(8 <= a.prompt_tokens <= 16 for a in p1)
    assert 150 < len(p1) < 340  # Poisson around 240
    with pytest.raises(ValueError, match="burst_start_s"):
        step_pattern(base_rps=1, burst_rps=2, burst_start_s=20, burst_end_s=10, duration_s=30)


def test_spike_and_piecewise() -> None:
    s = spike_pattern(base_rps=0, spike_rps=10, spike_at_s=5, spike_len_s=1, duration_s=20, poisson=False)
    assert [a.t_s for a in s] == pytest.approx([5 + i / 10 for i in range(10)])
    p = piecewise_pattern([(0, 2, 1), (2, 4, 0)], poisson=False, max_requests=1)
    assert len(p) == 1
    with pytest.raises(ValueError, match="segment"):
        piecewise_pattern([(2, 1, 1)])


def test_describe() -> None:
    arrivals = [Arrival(i, i * 0.5, 10, 20) for i in range(40)]  # 2 req/s over 20 s
    d = describe(arrivals, peak_bin_s=5.0)
    assert d["requests"] == 40 and d["peak_rps"] == 2.0 and d["mean_output_tokens"] == 20
    assert d["mean_rps"] == pytest.approx(40 / 19.5)
    assert describe([])["requests"] == 0


def test_prompt_ids() -> None:
    ids = prompt_ids(5, 100, random.Random(0))
    assert len(ids) == 5 and ids[0] == 1 and all(3 <= i < 100 for i in ids[1:])
    with pytest.raises(ValueError):
        prompt_ids(0, 100, random.Random(0))


def _line(obj: object) -> str:
    return "data: " + json.dumps(obj)


def test_stream_state_ok() -> None:
    rec = RequestRecord(0, 0.0, 10, 4, sent_s=1.0)
    st = StreamState(rec)
    chunk = lambda text, fin=None: _line({"choices": [{"text": text, "finish_reason": fin}]})  # noqa: E731
    assert not st.feed(": keep-alive", 1.1)
    assert not st.feed(chunk("a"), 1.5)
    assert not st.feed(chunk("b"), 1.6)
    assert not st.feed(chunk("c"), 1.9)
    assert not st.feed(chunk("", "length"), 1.9)
    assert not st.feed(_line({"choices": [], "usage": {"completion_tokens": 4}}), 1.9)
    assert st.feed("data: [DONE]", 1.9)
    assert rec.outcome == "ok" and rec.finish_reason == "length"
    assert rec.ttft_s == pytest.approx(0.5)
    assert rec.tbt_mean_s == pytest.approx(0.4 / 3)  # 4 tokens, one gave no text of its own
    assert rec.tbt_max_s == pytest.approx(0.3)
    assert rec.completion_tokens == 4


def test_stream_state_error_and_lost() -> None:
    rec = RequestRecord(1, 0.0, 10, 4, sent_s=0.0)
    st = StreamState(rec)
    st.feed(_line({"choices": [{"text": "a", "finish_reason": None}]}), 0.2)
    assert st.feed(_line({"error": {"message": "instance worker-1 died mid-stream"}}), 0.3)
    assert rec.outcome == "error" and "worker-1" in rec.error
    lost = RequestRecord(2, 0.0, 10, 4, sent_s=0.0)
    StreamState(lost).feed(_line({"choices": [{"text": "a", "finish_reason": None}]}), 0.2)
    assert lost.outcome == "lost"


def test_percentile_and_instance_seconds() -> None:
    assert percentile([], 0.5) is None
    assert percentile([3, 1, 2], 0.5) == 2
    assert percentile(range(1, 101), 0.99) == 99
    # Several levels from one sort: each the nearest rank of its own.
    assert percentiles([5, 1, 4, 2, 3], (0.0, 0.2, 0.5, 0.61, 1.0)) == [1, 1, 3, 4, 5]
    assert percentiles([], (0.5, 0.9)) == [None, None]
    samples = [
        InstanceSample(0.0, {"serving": 1}),
        InstanceSample(10.0, {"serving": 2, "loading": 1, "idle": 3}),
        InstanceSample(20.0, {"serving": 1, "draining": 1}),
    ]
    assert samples[1].held == 3
    assert instance_seconds(samples, 30.0) == pytest.approx(10 + 30 + 20)
    assert instance_seconds(samples, 15.0) == pytest.approx(10 + 15)
    assert instance_seconds([], 10.0) == 0.0


def test_summarize_and_timeline() -> None:
    recs = [
        RequestRecord(0, 0.0, 8, 4, sent_s=0.1, outcome="ok", ttft_s=0.5, tbt_mean_s=0.05, completion_tokens=4),
        RequestRecord(1, 0.5, 8, 4, sent_s=0.6, outcome="ok", ttft_s=3.0, tbt_mean_s=0.05, completion_tokens=4),
        RequestRecord(2, 1.0, 8, 4, sent_s=1.1, outcome="error", error="HTTP 503: no SERVING instance"),
        RequestRecord(3, 1.5, 8, 4, sent_s=1.6),
    ]
    samples = [InstanceSample(0.0, {"serving": 1}), InstanceSample(1.0, {"serving": 2})]
    s = summarize(recs, samples, 2.0, Slo(ttft_s=2.0, tbt_s=0.1))
    assert (s["requests_sent"], s["completed"], s["errored"], s["lost"]) == (4, 2, 1, 1)
    assert s["slo_attainment"] == 0.25 and s["instance_seconds"] == 3.0
    assert s["errors"] == {"HTTP 503: no SERVING instance": 1}
    assert s["ttft_s"]["p99"] == 3.0 and s["instances_max"] == 2
    assert s["slo_misses"] == {"ttft": 1, "tbt_mean": 0, "not_completed": 2}
    tl = timeline(recs, samples, 1.0, 2.0)
    assert tl["t_s"] == [0.0, 1.0] and tl["rps"] == [2.0, 2.0]
    assert tl["ttft_p99_s"] == [3.0, None] and tl["instances"] == [2, 2]
    assert math.isclose(sum(tl["rps"]), 4.0)
    assert "slo_missed" not in tl
    assert timeline(recs, samples, 1.0, 2.0, Slo(ttft_s=2.0, tbt_s=0.1))["slo_missed"] == [1, 2]


def test_a_miss_is_named_by_what_broke_first() -> None:
    slo = Slo(ttft_s=1.0, tbt_s=0.1)
    slow_tokens = RequestRecord(0, 0.0, 8, 4, outcome="ok", ttft_s=0.5, tbt_mean_s=0.2)
    late_and_slow = RequestRecord(1, 0.0, 8, 4, outcome="ok", ttft_s=1.5, tbt_mean_s=0.2)
    one_token = RequestRecord(2, 0.0, 8, 1, outcome="ok", ttft_s=0.5)  # no TBT: only the TTFT counts
    assert [slo.miss(r) for r in (slow_tokens, late_and_slow, one_token)] == ["tbt_mean", "ttft", None]
    assert slo.met(one_token) and not slo.met(slow_tokens)


def test_results_name_repository_files_relative_to_it(tmp_path: Path) -> None:
    shipped = REPO_ROOT / "traces" / "azure_llm_2023_code.csv"
    assert repo_relative(shipped) == "traces/azure_llm_2023_code.csv"
    assert repo_relative(REPO_ROOT / "bench" / ".." / "traces" / "x.csv") == "traces/x.csv"
    outside = tmp_path / "mine.csv"
    assert repo_relative(outside) == str(outside)
