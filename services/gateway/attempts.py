"""The gateway's attempt decisions, pure: `decide(state, outcome) -> Retry | Wait | Migrate | Move | Fail`.

One choice of a request runs on one instance after another until it ends: an instance fails
before the first token (re-route), after it (migrate: resume from the tokens so far), releases
a queued request to a new instance (move), or refuses it for an SLO it cannot meet (ask one
other instance, without waiting). `Backend._attempts` does the I/O (scheduling, streaming,
reporting a failed instance to the manager) and asks this module what comes next; nothing here
reads a clock, opens a channel or logs, so every rule is tested without a gRPC server
(`tests/unit/test_gateway_attempts.py`).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Literal

import grpc

__all__ = [
    "MAX_MOVES",
    "RETRYABLE",
    "AttemptLimits",
    "AttemptState",
    "Decision",
    "Fail",
    "Migrate",
    "Move",
    "Retry",
    "ScheduleFailed",
    "Wait",
    "WorkerFailed",
    "decide",
]

#: Times one request may be released from a queue for rebalancing (each move is a re-route).
MAX_MOVES = 3
#: Worker failures that another instance may not have; everything else is final.
RETRYABLE = frozenset(
    {
        grpc.StatusCode.UNAVAILABLE,
        grpc.StatusCode.RESOURCE_EXHAUSTED,
        grpc.StatusCode.UNKNOWN,
        grpc.StatusCode.INTERNAL,
        grpc.StatusCode.CANCELLED,
        grpc.StatusCode.ABORTED,
        grpc.StatusCode.NOT_FOUND,
        grpc.StatusCode.FAILED_PRECONDITION,
        grpc.StatusCode.UNIMPLEMENTED,
        grpc.StatusCode.DATA_LOSS,
    }
)


@dataclass(frozen=True, slots=True)
class AttemptLimits:
    retries_before_first_token: int
    max_migrations: int
    max_moves: int = MAX_MOVES

    def __post_init__(self) -> None:
        for name in ("retries_before_first_token", "max_migrations", "max_moves"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ValueError(f"AttemptLimits.{name} must be an int >= 0, got {value!r}")


@dataclass(frozen=True, slots=True)
class AttemptState:
    """What one choice has spent so far. `slo_refusals`: instances that refused it for its SLO
    before its first token; `last_code`: the last failure's status (RESOURCE_EXHAUSTED
    everywhere reads as back-pressure, not an outage)."""

    retries: int = 0
    migrations: int = 0
    moves: int = 0
    slo_refusals: int = 0
    last_code: grpc.StatusCode = grpc.StatusCode.UNAVAILABLE

    def schedule_waits(self, generated: int) -> bool:
        """Whether the next Schedule waits for capacity (up to `schedule_wait_s`). After an
        exclusion it does: the instance was maybe the only one and capacity comes back. Not
        once an instance refused the request for its SLO before its first token: waiting would
        only spend the objective it cannot meet."""
        return not (self.slo_refusals and not generated)


@dataclass(frozen=True, slots=True)
class WorkerFailed:
    """An attempt on `instance_id` ended with `code` after the choice had `generated` tokens.
    `moved`: the instance released the queued request (rebalancing), with the reason;
    `slo_kind`: it refused the request for an SLO ("ttft"/"tpot")."""

    instance_id: str
    code: grpc.StatusCode
    generated: int
    moved: str | None = None
    slo_kind: str | None = None


@dataclass(frozen=True, slots=True)
class ScheduleFailed:
    """Schedule gave no route; `timeout`: the request's own deadline ran out."""

    generated: int
    timeout: bool


Outcome = WorkerFailed | ScheduleFailed


@dataclass(frozen=True, slots=True)
class Retry:
    """Refused for its SLO before the first token: exclude the instance (not reported: it is
    busy, not broken) and ask the manager once more, without waiting for capacity."""

    instance_id: str
    state: AttemptState


@dataclass(frozen=True, slots=True)
class Wait:
    """Failed before the first token: exclude and report the instance, and re-route, waiting for
    capacity (`AttemptState.schedule_waits`)."""

    instance_id: str
    state: AttemptState


@dataclass(frozen=True, slots=True)
class Migrate:
    """Failed after tokens: exclude and report the instance; another resumes the stream from the
    prompt plus the tokens so far, waiting for capacity when none is free."""

    instance_id: str
    state: AttemptState


@dataclass(frozen=True, slots=True)
class Move:
    """Released from a busy instance's queue (rebalancing): keep it off the next route only."""

    instance_id: str
    reason: str
    state: AttemptState


FailWhy = Literal[
    "timeout",  # the request's deadline passed on an instance
    "invalid",  # an instance rejected the request itself, before any token
    "slo",  # refused for its SLO, with no other instance to ask
    "not_retryable",  # a failure another instance would have too
    "migrations_exhausted",  # failed mid-stream after max_migrations moves
    "retries_exhausted",  # failed on 1 + retries_before_first_token instances before a token
    "no_route",  # Schedule gave nothing before the first token: its error is the answer
    "not_migrated",  # Schedule gave nothing to resume on after tokens
]


@dataclass(frozen=True, slots=True)
class Fail:
    """The choice ends with an error. `excluded`: the failing instance was excluded (and, unless
    it refused for its SLO, reported) before the decision, as a retry would have done."""

    why: FailWhy
    state: AttemptState
    instance_id: str = ""
    excluded: bool = False


Decision = Retry | Wait | Migrate | Move | Fail


def decide(state: AttemptState, outcome: Outcome, limits: AttemptLimits) -> Decision:
    """What the attempt loop does next after `outcome`. The rules, in order:

    - Schedule failed: with SLO refusals and no token yet, the SLO error (unless the deadline
      passed); before the first token or on a timeout, Schedule's own error; else MID_STREAM.
    - DEADLINE_EXCEEDED on an instance: timeout.
    - Released for rebalancing: Move, up to `max_moves` times (then it counts as a failure).
    - INVALID_ARGUMENT before the first token: the request is bad, not the instance.
    - SLO refusal before the first token: Retry once elsewhere (within
      `retries_before_first_token`); a second refusal is the answer (429 with Retry-After).
    - Any other status not in `RETRYABLE`: fail.
    - Retryable after tokens: Migrate, up to `max_migrations`.
    - Retryable before the first token: Wait, up to `retries_before_first_token`.
    """
    if isinstance(outcome, ScheduleFailed):
        if state.slo_refusals and not outcome.generated and not outcome.timeout:
            return Fail("slo", state)
        return Fail("no_route" if not outcome.generated or outcome.timeout else "not_migrated", state)
    iid, resumed = outcome.instance_id, outcome.generated
    if outcome.code == grpc.StatusCode.DEADLINE_EXCEEDED:
        return Fail("timeout", state, iid)
    if outcome.moved is not None and state.moves < limits.max_moves:
        return Move(iid, outcome.moved, replace(state, moves=state.moves + 1))
    if outcome.code == grpc.StatusCode.INVALID_ARGUMENT and not resumed:
        return Fail("invalid", state, iid)
    if outcome.slo_kind is not None and not resumed:
        refused = replace(state, slo_refusals=state.slo_refusals + 1)
        if refused.slo_refusals > 1 or state.retries >= limits.retries_before_first_token:
            return Fail("slo", refused, iid, excluded=True)
        return Retry(iid, replace(refused, retries=state.retries + 1))
    if outcome.code not in RETRYABLE:
        return Fail("not_retryable", state, iid)
    failed = replace(state, last_code=outcome.code)
    if resumed:
        if state.migrations >= limits.max_migrations:
            return Fail("migrations_exhausted", failed, iid, excluded=True)
        return Migrate(iid, replace(failed, migrations=state.migrations + 1))
    if state.retries >= limits.retries_before_first_token:
        return Fail("retries_exhausted", failed, iid, excluded=True)
    return Wait(iid, replace(failed, retries=state.retries + 1))
