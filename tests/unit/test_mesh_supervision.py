"""The launcher's restart policy (pure): capped exponential backoff, reset after a stable run,
and the crash-loop limit that stops the mesh."""

from __future__ import annotations

import signal

import pytest
from pydantic import ValidationError

from services.mesh.__main__ import parse_args
from services.mesh.supervision import ChildHistory, GiveUp, Restart, RestartPolicy, decide, describe_exit

POLICY = RestartPolicy(initial_backoff_s=0.5, max_backoff_s=10.0, max_restarts=5, window_s=60.0, stable_after_s=30.0)


def crash_at(times_s: list[float], policy: RestartPolicy = POLICY, uptime_s: float = 1.0) -> list[Restart | GiveUp]:
    """Decisions for a child that exits at each time, having run `uptime_s` before each exit."""
    history, out = ChildHistory(), []
    for t in times_s:
        decision, history = decide(policy, history, now_s=t, started_s=t - uptime_s)
        out.append(decision)
    return out


def test_backoff_doubles_up_to_the_cap() -> None:
    policy = POLICY.model_copy(update={"max_restarts": 100})
    decisions = crash_at([float(t) for t in range(8)], policy)
    assert [d.backoff_s for d in decisions if isinstance(d, Restart)] == [0.5, 1.0, 2.0, 4.0, 8.0, 10.0, 10.0, 10.0]


def test_a_stable_run_starts_the_backoff_again() -> None:
    history = ChildHistory()
    for t in (0.0, 1.0, 2.0):
        _, history = decide(POLICY, history, now_s=t, started_s=t - 1.0)
    decision, history = decide(POLICY, history, now_s=40.0, started_s=40.0 - POLICY.stable_after_s)
    assert decision == Restart(attempt=4, backoff_s=0.5)
    decision, _ = decide(POLICY, history, now_s=41.0, started_s=40.5)
    assert decision == Restart(attempt=5, backoff_s=1.0)


def test_more_restarts_than_the_limit_within_the_window_gives_up() -> None:
    decisions = crash_at([0.0, 1.0, 2.0, 3.0, 4.0, 5.0])
    assert [d.attempt for d in decisions[:5] if isinstance(d, Restart)] == [1, 2, 3, 4, 5]
    assert decisions[5] == GiveUp(restarts=5, window_s=60.0)


def test_restarts_older_than_the_window_do_not_count() -> None:
    decisions = crash_at([0.0, 1.0, 2.0, 3.0, 4.0, 61.0, 62.0])
    assert all(isinstance(d, Restart) for d in decisions)
    assert decisions[5] == Restart(attempt=4, backoff_s=10.0)  # 1.0 .. 4.0 and 61.0 within 60 s
    assert crash_at([0.0, 1.0, 2.0, 3.0, 4.0, 59.0])[5] == GiveUp(restarts=5, window_s=60.0)


def test_zero_restarts_stops_at_the_first_exit() -> None:
    assert crash_at([0.0], POLICY.model_copy(update={"max_restarts": 0})) == [GiveUp(restarts=0, window_s=60.0)]


def test_a_long_crash_streak_keeps_the_cap() -> None:
    policy = RestartPolicy(max_restarts=1, window_s=1.0, stable_after_s=1000.0)
    decisions = crash_at([10.0 * k for k in range(2000)], policy)
    assert decisions[-1] == Restart(attempt=1, backoff_s=policy.max_backoff_s)


@pytest.mark.parametrize(
    ("fields", "bad"),
    [
        ({"initial_backoff_s": 0}, "initial_backoff_s"),
        ({"initial_backoff_s": 5, "max_backoff_s": 1}, "max_backoff_s=1.0 is below initial_backoff_s=5.0"),
        ({"max_restarts": -1}, "max_restarts"),
        ({"window_s": 0}, "window_s"),
    ],
)
def test_policy_rejects_bad_values(fields: dict[str, float], bad: str) -> None:
    with pytest.raises(ValidationError, match=bad):
        RestartPolicy(**fields)


def test_exit_descriptions() -> None:
    assert describe_exit(2) == "code 2"
    assert describe_exit(-signal.SIGKILL) == "signal SIGKILL"
    assert describe_exit(-200) == "signal 200"


def test_make_up_supervises_with_the_cli_limit() -> None:
    cfg = parse_args(["--max-restarts", "3", "--restart-window-s", "20"])
    assert cfg.supervise
    assert (cfg.restart_policy.max_restarts, cfg.restart_policy.window_s) == (3, 20.0)
    with pytest.raises(SystemExit):
        parse_args(["--max-restarts", "-1"])
