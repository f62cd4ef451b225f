"""The gateway's attempt decisions, without a gRPC server: each rule of `attempts.decide`, the
counters it spends, and a whole sequence of outcomes as the attempt loop feeds them."""

from __future__ import annotations

import grpc
import pytest

from services.gateway import attempts as at

C = grpc.StatusCode
LIMITS = at.AttemptLimits(retries_before_first_token=2, max_migrations=1)


def failed(
    code: C = C.UNAVAILABLE, generated: int = 0, *, moved: str | None = None, slo: str | None = None
) -> at.WorkerFailed:
    return at.WorkerFailed("w0", code, generated, moved=moved, slo_kind=slo)


def test_a_failure_before_the_first_token_waits_for_capacity_elsewhere_until_the_retries_run_out() -> None:
    state = at.AttemptState()
    for n in (1, 2):
        verdict = at.decide(state, failed(C.UNAVAILABLE), LIMITS)
        assert isinstance(verdict, at.Wait) and verdict.instance_id == "w0"
        state = verdict.state
        assert state.retries == n and state.last_code is C.UNAVAILABLE
        assert state.schedule_waits(generated=0)  # after an exclusion the next route waits
    verdict = at.decide(state, failed(C.RESOURCE_EXHAUSTED), LIMITS)
    assert isinstance(verdict, at.Fail) and verdict.why == "retries_exhausted" and verdict.excluded
    assert verdict.state.last_code is C.RESOURCE_EXHAUSTED  # back-pressure, told as OVERLOADED


def test_a_failure_after_tokens_migrates_up_to_max_migrations() -> None:
    verdict = at.decide(at.AttemptState(), failed(C.UNAVAILABLE, generated=5), LIMITS)
    assert isinstance(verdict, at.Migrate) and verdict.state.migrations == 1 and verdict.state.retries == 0
    again = at.decide(verdict.state, failed(C.UNAVAILABLE, generated=9), LIMITS)
    assert isinstance(again, at.Fail) and again.why == "migrations_exhausted" and again.excluded
    assert again.state.migrations == 1


def test_a_released_request_moves_without_spending_a_retry_up_to_max_moves() -> None:
    state = at.AttemptState()
    for n in range(1, at.MAX_MOVES + 1):
        verdict = at.decide(state, failed(C.ABORTED, moved="rebalance"), LIMITS)
        assert isinstance(verdict, at.Move) and verdict.reason == "rebalance"
        state = verdict.state
        assert (state.moves, state.retries) == (n, 0)
    # One move too many counts as the failure it is (ABORTED is retryable): a waiting retry.
    beyond = at.decide(state, failed(C.ABORTED, moved="rebalance"), LIMITS)
    assert isinstance(beyond, at.Wait) and beyond.state.retries == 1


def test_an_slo_refusal_asks_one_other_instance_without_waiting_then_is_the_answer() -> None:
    first = at.decide(at.AttemptState(), failed(C.RESOURCE_EXHAUSTED, slo="ttft"), LIMITS)
    assert isinstance(first, at.Retry) and first.state.slo_refusals == 1 and first.state.retries == 1
    assert not first.state.schedule_waits(generated=0)  # SLO refusals do not wait for capacity
    assert first.state.schedule_waits(generated=3)  # a stream already under way does
    second = at.decide(first.state, failed(C.RESOURCE_EXHAUSTED, slo="tpot"), LIMITS)
    assert isinstance(second, at.Fail) and second.why == "slo" and second.excluded
    no_retries = at.decide(at.AttemptState(), failed(C.RESOURCE_EXHAUSTED, slo="ttft"), at.AttemptLimits(0, 0))
    assert isinstance(no_retries, at.Fail) and no_retries.why == "slo"


def test_an_slo_refusal_after_tokens_is_an_ordinary_failure() -> None:
    verdict = at.decide(at.AttemptState(), failed(C.RESOURCE_EXHAUSTED, generated=4, slo="tpot"), LIMITS)
    assert isinstance(verdict, at.Migrate) and verdict.state.slo_refusals == 0


@pytest.mark.parametrize(
    ("code", "generated", "why"),
    [
        (C.DEADLINE_EXCEEDED, 0, "timeout"),
        (C.DEADLINE_EXCEEDED, 7, "timeout"),
        (C.INVALID_ARGUMENT, 0, "invalid"),
        (C.INVALID_ARGUMENT, 7, "not_retryable"),  # mid-stream it is the instance's failure
        (C.PERMISSION_DENIED, 0, "not_retryable"),
        (C.OUT_OF_RANGE, 3, "not_retryable"),
    ],
)
def test_final_failures_end_the_choice_without_excluding_the_instance(code: C, generated: int, why: str) -> None:
    verdict = at.decide(at.AttemptState(), failed(code, generated), LIMITS)
    assert isinstance(verdict, at.Fail) and verdict.why == why and not verdict.excluded


def test_a_deadline_beats_a_release() -> None:
    verdict = at.decide(at.AttemptState(), failed(C.DEADLINE_EXCEEDED, moved="rebalance"), LIMITS)
    assert isinstance(verdict, at.Fail) and verdict.why == "timeout"


@pytest.mark.parametrize(
    ("slo_refusals", "generated", "timeout", "why"),
    [
        (0, 0, False, "no_route"),
        (1, 0, False, "slo"),  # the refusal is the answer, not "no instance"
        (1, 0, True, "no_route"),  # the deadline passed: that is the answer
        (0, 5, False, "not_migrated"),
        (0, 5, True, "no_route"),
    ],
)
def test_a_schedule_failure(slo_refusals: int, generated: int, timeout: bool, why: str) -> None:
    verdict = at.decide(at.AttemptState(slo_refusals=slo_refusals), at.ScheduleFailed(generated, timeout), LIMITS)
    assert isinstance(verdict, at.Fail) and verdict.why == why


def test_a_normal_failure_after_an_slo_refusal_reroutes_without_waiting() -> None:
    refused = at.decide(at.AttemptState(), failed(C.RESOURCE_EXHAUSTED, slo="ttft"), LIMITS)
    verdict = at.decide(refused.state, failed(C.UNAVAILABLE), LIMITS)
    assert isinstance(verdict, at.Wait) and verdict.state.retries == 2
    assert not verdict.state.schedule_waits(generated=0)


@pytest.mark.parametrize("bad", [-1, 1.5, True])
def test_limits_reject_a_bad_value(bad: object) -> None:
    with pytest.raises(ValueError, match=rf"retries_before_first_token must be an int >= 0, got {bad!r}"):
        at.AttemptLimits(bad, 1)  # type: ignore[arg-type]
