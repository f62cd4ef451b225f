"""SCORPIO's pure core (docs/algorithms.md 4): TRP/VBS, credits, the TPOT fit, the output-length
predictor, the admission check and the TTFT guard."""

from __future__ import annotations

import math

import numpy as np
import pytest

from services.worker.engine.scorpio import (
    BacklogRate,
    CreditBatcher,
    Member,
    OutputLengthPredictor,
    PrefillRate,
    ScorpioState,
    TPOTFit,
    TPOTFitter,
    deadline_s,
    judge_tpot,
    judge_ttft,
    trp,
    vbs,
)


def run_iterations(stps: dict[str, float | None], n: int) -> list[list[str]]:
    batcher = CreditBatcher()
    return [batcher.step(stps) for _ in range(n)]


def iterations_of(batches: list[list[str]], request_id: str) -> list[int]:
    return [i + 1 for i, batch in enumerate(batches) if request_id in batch]


# ---- docs/algorithms.md 4 vectors -------------------------------------------------------------------


def test_vector_trp_and_vbs_50_100_200() -> None:
    stps: dict[str, float | None] = {"0": 50, "1": 100, "2": 200}
    assert trp(stps) == {"0": 1.0, "1": 0.5, "2": 0.25}
    assert vbs(stps.values()) == 1.75


def test_vector_credits_50_100_200() -> None:
    batches = run_iterations({"0": 50, "1": 100, "2": 200}, 12)
    assert batches[:4] == [["0"], ["0", "1"], ["0"], ["0", "1", "2"]]
    assert batches[4:8] == batches[:4] and batches[8:12] == batches[:4]  # then repeat


def test_vector_credits_50_150() -> None:
    batches = run_iterations({"0": 50, "1": 150}, 6)
    assert iterations_of(batches, "1") == [3, 6]
    assert iterations_of(batches, "0") == [1, 2, 3, 4, 5, 6]


def test_vector_credits_40_100() -> None:
    batches = run_iterations({"0": 40, "1": 100}, 8)
    assert iterations_of(batches, "1") == [3, 5, 8]
    assert iterations_of(batches, "0") == list(range(1, 9))


def test_vector_admission_step_time_quarter_of_batch() -> None:
    fit = TPOTFit(b=0.25, terms=("B",))  # step time 0.25 x batch
    running = [Member(s, 10) for s in (1.0, 1.0, 2.0, 1.0)]
    first = judge_tpot(Member(2.0, 10), running, fit)  # the set {1, 1, 2, 1, 2}
    assert (first.admit, first.vbs, first.est_tpot_s, first.min_tpot_s) == (True, 4.0, 1.0, 1.0)
    running.append(Member(2.0, 10))
    second = judge_tpot(Member(1.0, 10), running, fit)
    assert (second.admit, second.vbs, second.est_tpot_s) == (False, 5.0, 1.25)


def test_vector_admission_with_a_fitted_model() -> None:
    """The same vector with the coefficients learned from step times of 0.25 x batch."""
    fitter = TPOTFitter()
    for batch in range(1, 17):
        fitter.observe(batch, 100 + 7 * batch, 0.25 * batch)
    fit = fitter.fit()
    assert fit is not None
    running = [Member(s, 10) for s in (1.0, 1.0, 2.0, 1.0)]
    assert judge_tpot(Member(2.0, 10), running, fit).admit
    assert not judge_tpot(Member(1.0, 10), [*running, Member(2.0, 10)], fit).admit


# ---- credits: edge cases -----------------------------------------------------------------------


def test_requests_without_a_tpot_slo_run_every_iteration() -> None:
    batches = run_iterations({"a": None, "b": None}, 3)
    assert batches == [["a", "b"]] * 3
    # Next to SLO requests they count as TRP 1 and still run every iteration.
    mixed = run_iterations({"free": None, "tight": 0.05, "loose": 0.2}, 4)
    assert iterations_of(mixed, "free") == iterations_of(mixed, "tight") == [1, 2, 3, 4]
    assert iterations_of(mixed, "loose") == [4]
    assert trp({"x": None}) == {"x": 1.0} and vbs([None, None, 0.1]) == 3.0 and vbs([]) == 0


def test_credits_persist_new_requests_start_at_zero_and_leavers_are_forgotten() -> None:
    batcher = CreditBatcher()
    assert batcher.step({"a": 1.0, "b": 2.0}) == ["a"]
    assert batcher.credit("b") == 0.5
    # c joins: it starts at 0 while b keeps its half credit.
    assert batcher.step({"a": 1.0, "b": 2.0, "c": 4.0}) == ["a", "b"]
    assert batcher.credit("c") == 0.25
    # The tight one leaves: b becomes the minimum (TRP 1), c's TRP doubles.
    assert batcher.step({"b": 2.0, "c": 4.0}) == ["b"]
    assert batcher.credit("c") == 0.75 and batcher.credit("a") == 0.0
    assert batcher.step({"b": 2.0, "c": 4.0}) == ["b", "c"]
    assert batcher.step({}) == [] and batcher.credit("b") == 0.0


def test_the_tightest_request_always_runs() -> None:
    rng = np.random.default_rng(3)
    batcher = CreditBatcher()
    for _ in range(200):
        ids = [f"r{i}" for i in rng.choice(20, size=rng.integers(1, 8), replace=False)]
        stps: dict[str, float | None] = {r: float(rng.uniform(0.01, 1.0)) for r in ids}
        tightest = min(ids, key=lambda r: stps[r])  # type: ignore[arg-type, return-value]
        assert tightest in batcher.step(stps)


def test_long_run_rates_match_trp() -> None:
    batches = run_iterations({"a": 30, "b": 70, "c": 110}, 7700)
    for r, rate in trp({"a": 30, "b": 70, "c": 110}).items():
        assert len(iterations_of(batches, r)) == pytest.approx(7700 * rate, abs=1)


# ---- the TPOT fit ------------------------------------------------------------------------------


def test_fitter_recovers_known_coefficients() -> None:
    a, b, c, d = 2e-6, 0.004, 3e-5, 0.02
    rng = np.random.default_rng(0)
    fitter = TPOTFitter(window=512)
    for _ in range(400):
        batch, length = int(rng.integers(1, 33)), float(rng.uniform(10, 2000))
        fitter.observe(batch, length, a * batch * length + b * batch + c * length + d)
    fit = fitter.fit()
    assert fit is not None and fit.terms == ("BL", "B", "L", "1") and fit.points == 400
    assert (fit.a, fit.b, fit.c, fit.d) == pytest.approx((a, b, c, d), rel=1e-6)
    assert fit.r2 == pytest.approx(1.0) and fit.mae_s is not None and fit.mae_s < 1e-9
    assert fit.estimate(4, 500) == pytest.approx(a * 2000 + b * 4 + c * 500 + d)


def test_fitter_with_noise_is_close() -> None:
    a, b, c, d = 1e-6, 0.003, 2e-5, 0.015
    rng = np.random.default_rng(1)
    fitter = TPOTFitter(window=512)
    for _ in range(2000):  # only the last 512 are kept
        batch, length = int(rng.integers(1, 33)), float(rng.uniform(10, 2000))
        fitter.observe(batch, length, a * batch * length + b * batch + c * length + d + rng.normal(0, 5e-4))
    fit = fitter.fit()
    assert fit is not None and fit.points == 512
    assert fit.estimate(16, 1000) == pytest.approx(a * 16000 + b * 16 + c * 1000 + d, rel=0.02)
    assert fit.r2 is not None and fit.r2 > 0.99 and fit.mae_s is not None and fit.mae_s < 1e-3


def test_fitter_falls_back_to_fewer_terms() -> None:
    fitter = TPOTFitter(min_points=8)
    assert fitter.fit() is None
    fitter.observe(4, 100, 0.05)
    one = fitter.fit()
    assert one is not None and one.terms == ("B",) and one.estimate(8, 100) == pytest.approx(0.1)
    # A single request decoding alone: B is always 1, so B*L and L coincide and B and 1 too.
    alone = TPOTFitter()
    for length in range(10, 40):
        alone.observe(1, length, 0.03)
    fit = alone.fit()
    assert fit is not None and fit.terms == ("B",) and fit.estimate(1, 50) == pytest.approx(0.03)
    # Batch varies, length constant: the affine model in B.
    flat = TPOTFitter()
    for batch in range(1, 20):
        flat.observe(batch, 64, 0.01 + 0.002 * batch)
    fit = flat.fit()
    assert fit is not None and fit.terms == ("B", "1")
    assert (fit.b, fit.d) == pytest.approx((0.002, 0.01)) and fit.r2 == pytest.approx(1.0)
    # Fewer points than the full model needs, though B and L both vary.
    few = TPOTFitter(min_points=8)
    for batch, length in ((1, 10), (2, 50), (3, 20), (5, 70)):
        few.observe(batch, length, 0.01 + 0.002 * batch + 1e-4 * length)
    fit = few.fit()
    assert fit is not None and fit.terms == ("B", "L", "1")
    assert (fit.b, fit.c, fit.d) == pytest.approx((0.002, 1e-4, 0.01))


def test_fitter_ignores_bad_observations_and_refits_only_on_news() -> None:
    fitter = TPOTFitter()
    for bad in ((0, 10, 0.1), (-1, 10, 0.1), (1, math.nan, 0.1), (1, 10, math.inf), (1, 10, -0.1)):
        fitter.observe(*bad)
    assert fitter.points == 0 and fitter.fit() is None
    fitter.observe(2, 10, 0.1)
    first = fitter.fit()
    assert fitter.fit() is first  # cached until the next observation
    fitter.observe(4, 10, 0.2)
    assert fitter.fit() is not first
    with pytest.raises(ValueError, match="window >= 1"):
        TPOTFitter(window=0)


def test_fit_estimate_is_never_negative_and_reports() -> None:
    fit = TPOTFit(b=0.001, d=-0.5, terms=("B", "1"), points=3, r2=0.5, mae_s=0.01)
    assert fit.estimate(1, 10) == 0.0
    assert fit.report() == {
        "a": 0.0,
        "b": 0.001,
        "c": 0.0,
        "d": -0.5,
        "terms": ["B", "1"],
        "points": 3,
        "r2": 0.5,
        "mae_s": 0.01,
    }


def test_prefill_rate() -> None:
    rate = PrefillRate(window=3)
    assert rate.tokens_per_s is None
    rate.observe(0, 0.1)  # no prompt tokens: not a prefill step
    rate.observe(100, 0.0)
    assert rate.tokens_per_s is None
    # Steps of 20 ms + 1 ms per token, all of the same size: the plain ratio.
    rate.observe(100, 0.12)
    rate.observe(100, 0.12)
    assert rate.tokens_per_s == pytest.approx(100 / 0.12)
    # Sizes that vary: the slope, 1000 tokens/s (the 20 ms are the step the guard adds).
    rate.observe(300, 0.32)
    assert rate.tokens_per_s == pytest.approx(1000)
    rate.observe(10, 0.03)  # the window keeps the last three
    assert rate.tokens_per_s == pytest.approx(1000)
    # A slope that says nothing (noise): the ratio.
    noisy = PrefillRate()
    for tokens, seconds in ((10, 0.05), (20, 0.03), (30, 0.04)):
        noisy.observe(tokens, seconds)
    assert noisy.tokens_per_s == pytest.approx(60 / 0.12)


# ---- the output-length predictor ---------------------------------------------------------------


def test_output_length_predictor_buckets_default_and_error() -> None:
    p = OutputLengthPredictor(default_tokens=100, min_bucket_points=2)
    assert p.predict(10, 500) == 100 and p.predict(10, 40) == 40  # the default, capped by max_tokens
    assert p.mae_tokens is None
    p.observe(10, 20, predicted=100)
    # One point in the bucket: the mean over all buckets.
    assert p.predict(12, 500) == 20 and p.predict(1000, 500) == 20
    p.observe(12, 30, predicted=20)  # 10 and 12 share the bucket [8, 16)
    p.observe(1000, 300)
    p.observe(900, 400)
    assert p.predict(15, 500) == 25  # its bucket's mean
    assert p.predict(600, 500) == 350 and p.predict(600, 100) == 100
    assert p.predict(3, 500) == math.ceil((20 + 30 + 300 + 400) / 4)  # empty bucket: all buckets
    assert p.mae_tokens == pytest.approx((80 + 10) / 2)
    assert p.report() == {"mae_tokens": 45.0, "scored": 2, "buckets": 2}
    p.observe(10, 0)  # nothing generated: ignored
    assert p.report()["scored"] == 2 and p.predict(1, 0) == 1


# ---- admission edge cases ----------------------------------------------------------------------


def test_admission_without_fit_or_without_a_tpot_slo() -> None:
    fit = TPOTFit(b=1.0, terms=("B",))
    running = [Member(0.5, 10)]
    # A candidate without a TPOT SLO is never gated (FCFS), even past the others' SLOs.
    free = judge_tpot(Member(None, 10), running, fit)
    assert free.admit and free.est_tpot_s == 2.0 and free.min_tpot_s == 0.5
    # No fit yet: admitted blind.
    blind = judge_tpot(Member(0.001, 10), running, None)
    assert blind.admit and blind.est_tpot_s is None
    # Alone, against its own SLO; the set's length is the mean.
    alone = judge_tpot(Member(0.9, 30), [], fit)
    assert not alone.admit and alone.vbs == 1.0 and alone.mean_len == 30
    lengthy = TPOTFit(a=0.001, terms=("BL",))
    decision = judge_tpot(Member(1.0, 300), [Member(None, 100)], lengthy)
    assert decision.mean_len == 200 and decision.est_tpot_s == pytest.approx(0.4) and decision.admit


def test_a_loose_candidate_can_be_refused_for_the_tight_ones_already_running() -> None:
    fit = TPOTFit(b=0.1, terms=("B",))
    running = [Member(0.2, 10), Member(0.2, 10)]  # VBS 2: 0.2 s, just within
    assert not judge_tpot(Member(10.0, 10), running, fit).admit  # VBS 2.02 -> 0.202 > 0.2
    assert judge_tpot(Member(10.0, 10), running[:1], fit).admit


# ---- the TTFT guard ----------------------------------------------------------------------------


def test_deadline_key_and_least_deadline_first_order() -> None:
    assert deadline_s(10.0, None) == math.inf and deadline_s(10.0, 0.5) == 10.5
    queue = [("a", deadline_s(0.0, None)), ("b", deadline_s(1.0, 5.0)), ("c", deadline_s(2.0, 1.0)), ("d", math.inf)]
    assert [name for name, _ in sorted(queue, key=lambda q: q[1])] == ["c", "b", "a", "d"]


def test_ttft_guard() -> None:
    # 1000 tokens/s, 300 queued ahead, 100 its own, a step of 0.05 s in flight: 0.45 s.
    ok = judge_ttft(10.0, 10.5, 300, 100, 1000.0, 0.05)
    assert ok.admit and ok.est_ttft_s == pytest.approx(0.45) and ok.retry_after_s == pytest.approx(0.35)
    late = judge_ttft(10.0, 10.4, 300, 100, 1000.0, 0.05)
    assert not late.admit and late.retry_after_s == pytest.approx(0.35)
    # 1 ms behind a long queue.
    assert not judge_ttft(0.0, 0.001, 5000, 10, 2000.0, 0.03).admit
    # No measured rate: only a deadline already past refuses.
    assert judge_ttft(10.0, 10.001, 10**6, 10, None, 1.0).admit
    gone = judge_ttft(10.002, 10.001, 0, 10, None, 1.0)
    assert not gone.admit and gone.est_ttft_s is None and gone.retry_after_s == 0.0


def test_state_report_shape() -> None:
    state = ScorpioState()
    assert state.report() == {
        "tpot_model": {"points": 0},
        "prefill_tokens_per_s": None,
        "queue_tokens_per_s": None,
        "output_length": {"mae_tokens": None, "scored": 0, "buckets": 0},
        "rejected": {"ttft": 0, "tpot": 0},
    }
    state.tpot.observe(2, 10, 0.1)
    state.rejected["ttft"] += 2
    report = state.report()
    assert report["tpot_model"]["terms"] == ["B"] and state.rejected_total == 2


def test_backlog_rate_is_what_the_queue_was_served_at_bounded_by_the_marginal_rate() -> None:
    backlog = BacklogRate(window=16, min_steps=4, floor_share=0.05)
    assert backlog.tokens_per_s(2000.0) == 2000.0  # too few steps: the marginal rate
    # A full batch: decode steps serve no prompt for 3 of every 4 steps.
    for tokens in (400, 0, 0, 0) * 4:
        backlog.observe(tokens, 0.1)
    assert backlog.tokens_per_s(2000.0) == pytest.approx(1000.0)  # 1600 tokens in 1.6 s
    assert backlog.tokens_per_s(500.0) == 500.0  # never above the marginal rate
    for _ in range(16):
        backlog.observe(0, 0.1)  # a stretch that served no prompt at all
    assert backlog.tokens_per_s(2000.0) == pytest.approx(100.0)  # the floor, not "never"
    assert backlog.tokens_per_s(None) is None
    backlog.observe(1, -1.0)  # ignored
    assert backlog.tokens_per_s(2000.0) == pytest.approx(100.0)
