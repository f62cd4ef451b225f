"""The gateway's attempt decisions, pure: `plan_attempt(hops, ...) -> AttemptPlan`, then
`decide(state, outcome) -> Retry | Wait | Migrate | Move | Fail`, and `error_for(fail, ...)`.

One choice of a request runs on one instance after another until it ends: an instance fails
before the first token (re-route), after it (migrate: resume from the tokens so far), releases
a queued request to a new instance (move), or refuses it for an SLO it cannot meet (ask one
other instance, without waiting). `Backend._attempts` does the I/O (scheduling, streaming,
reporting a failed instance to the manager) and asks this module what comes next, the vLLM v1
way: schedule, plan the attempt on the route (`plan_attempt`: which hop streams, which runs the
prompt first, where KV comes from), stream, decide on the outcome, apply the verdict. Each
verdict carries its effects (`exclude`, `report`, and the state it leaves, which holds the
exclusions and the failures so far); a `Fail` becomes the client's error in one place
(`error_for`). Nothing here reads a clock, opens a channel or logs, so every rule is tested
without a gRPC server (`tests/unit/test_gateway_attempts.py`, `tests/unit/test_gateway_plan.py`).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import ClassVar, Literal, Protocol

import grpc

from blitzmesh.v1 import common_pb2, global_manager_pb2, kv_pb2
from services.gateway.errors import ErrorKind, GatewayError, invalid, quote
from services.gateway.schema import InferenceRequest

__all__ = [
    "MAX_MOVES",
    "RETRYABLE",
    "AttemptLimits",
    "AttemptPlan",
    "AttemptState",
    "Decision",
    "Fail",
    "Migrate",
    "Move",
    "Outcome",
    "Retry",
    "ScheduleFailed",
    "Wait",
    "WorkerFailed",
    "decide",
    "error_for",
    "plan_attempt",
    "slo_error",
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
    everywhere reads as back-pressure, not an outage).

    And what it keeps off the next routes: `excluded`, each instance that failed it with its
    incarnation then (an instance registered again since is no longer excluded: the caller
    knows incarnations); `released`, the instance that released it from its queue (off the next
    route only: it is busy, not broken); `failures`, one line per excluded instance for the
    error messages; `refusals`, the SLO refusals (for the 429's objective and Retry-After)."""

    retries: int = 0
    migrations: int = 0
    moves: int = 0
    slo_refusals: int = 0
    last_code: grpc.StatusCode = grpc.StatusCode.UNAVAILABLE
    excluded: tuple[tuple[str, int], ...] = ()
    released: tuple[str, ...] = ()
    failures: tuple[str, ...] = ()
    refusals: tuple[WorkerFailed, ...] = ()

    def routed(self) -> AttemptState:
        """After a route was scheduled: a released request stays off that instance no longer."""
        return replace(self, released=()) if self.released else self

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
    `slo_kind`: it refused the request for an SLO ("ttft"/"tpot"), and `retry_after_s` when it
    expects room; `detail`: the status's message; `incarnation`: the instance's registrations
    seen when it failed (an exclusion holds until it registers again)."""

    instance_id: str
    code: grpc.StatusCode
    generated: int
    moved: str | None = None
    slo_kind: str | None = None
    detail: str = ""
    retry_after_s: float | None = None
    incarnation: int = 0

    @property
    def line(self) -> str:
        """How the failure reads in an error message."""
        return f"{self.instance_id}: {self.code.name}: {self.detail}"


@dataclass(frozen=True, slots=True)
class ScheduleFailed:
    """Schedule gave no route; `timeout`: the request's own deadline ran out; `error`: the
    error Schedule raised (the answer when nothing was streamed yet)."""

    generated: int
    timeout: bool
    error: GatewayError | None = None


Outcome = WorkerFailed | ScheduleFailed


@dataclass(frozen=True, slots=True)
class Retry:
    """Refused for its SLO before the first token: exclude the instance (not reported: it is
    busy, not broken) and ask the manager once more, without waiting for capacity."""

    exclude: ClassVar[bool] = True
    report: ClassVar[bool] = False
    refused: ClassVar[bool] = True

    instance_id: str
    state: AttemptState


@dataclass(frozen=True, slots=True)
class Wait:
    """Failed before the first token: exclude and report the instance, and re-route, waiting for
    capacity (`AttemptState.schedule_waits`)."""

    exclude: ClassVar[bool] = True
    report: ClassVar[bool] = True
    refused: ClassVar[bool] = False

    instance_id: str
    state: AttemptState


@dataclass(frozen=True, slots=True)
class Migrate:
    """Failed after tokens: exclude and report the instance; another resumes the stream from the
    prompt plus the tokens so far, waiting for capacity when none is free."""

    exclude: ClassVar[bool] = True
    report: ClassVar[bool] = True
    refused: ClassVar[bool] = False

    instance_id: str
    state: AttemptState


@dataclass(frozen=True, slots=True)
class Move:
    """Released from a busy instance's queue (rebalancing): keep it off the next route only
    (`AttemptState.released`)."""

    exclude: ClassVar[bool] = False
    report: ClassVar[bool] = False
    refused: ClassVar[bool] = False

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

    @property
    def exclude(self) -> bool:
        return self.excluded

    @property
    def report(self) -> bool:
        """An excluded instance is reported to the manager, unless it refused for its SLO."""
        return self.excluded and self.why != "slo"

    @property
    def refused(self) -> bool:
        return self.excluded and self.why == "slo"


Decision = Retry | Wait | Migrate | Move | Fail


def decide(state: AttemptState, outcome: Outcome, limits: AttemptLimits) -> Decision:
    """What the attempt loop does next after `outcome`, with the verdict's effects on the lists
    in its state already applied (`with_effects`). The rules, in order:

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
    verdict = _verdict(state, outcome, limits)
    return with_effects(verdict, outcome) if isinstance(outcome, WorkerFailed) else verdict


def with_effects(verdict: Decision, failed: WorkerFailed) -> Decision:
    """`verdict` with its effects in its state: an excluded instance (with its incarnation) and
    its failure line, an SLO refusal kept for the 429, a releasing instance kept off the next route."""
    state = verdict.state
    if verdict.exclude:
        state = replace(
            state,
            excluded=(*state.excluded, (failed.instance_id, failed.incarnation)),
            failures=(*state.failures, failed.line),
        )
    if verdict.refused:
        state = replace(state, refusals=(*state.refusals, failed))
    if isinstance(verdict, Move):
        state = replace(state, released=(failed.instance_id,))
    return replace(verdict, state=state)


def _verdict(state: AttemptState, outcome: Outcome, limits: AttemptLimits) -> Decision:
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


# ---- the plan of one attempt --------------------------------------------------------------------

RouteHop = global_manager_pb2.RouteHop


@dataclass(frozen=True, slots=True)
class AttemptPlan:
    """How one attempt runs on the route Schedule gave. `hop` streams the tokens to the end.
    `prefill` (a disaggregated route, nothing generated yet) runs first: the prompt and the first
    token, then hands the prompt's KV to `hop`. `relay` (ZigZag, nothing generated yet): the
    loading instance and its full partner; the loading instance runs the prompt's first layers
    and the partner (the first streamed hop) takes the request over. `kv_source`: the KV a stream
    live-migrated off its instance left, for `hop` to pull."""

    hop: RouteHop
    prefill: RouteHop | None = None
    relay: tuple[RouteHop, RouteHop] | None = None
    kv_source: kv_pb2.KVTransferDescriptor | None = None


def plan_attempt(
    hops: Sequence[RouteHop], generated: int, handoff: kv_pb2.KVTransferDescriptor | None = None
) -> AttemptPlan:
    """The plan for `hops` of a choice that has `generated` tokens, and the KV its last instance
    handed off by live migration (`handoff`, used only when resuming). A resumed stream (tokens
    already generated) runs on the route's last hop of a ZigZag route, the decode hop of a
    disaggregated one (which recomputes the prompt and those tokens), else the first hop. A
    ZigZag route in a disaggregated deployment (a third hop, DECODE) has its partner prefill."""
    prefill, hop = split_route(hops)
    relay = zigzag_route(hops)
    if generated:
        return AttemptPlan(hops[-1] if relay is not None else hop, kv_source=handoff)
    if relay is not None:
        hop = relay[1]
        if len(hops) == 3 and hops[2].role == common_pb2.INSTANCE_ROLE_DECODE:
            prefill, hop = hop, hops[2]
    return AttemptPlan(hop, prefill, relay)


def split_route(hops: Sequence[RouteHop]) -> tuple[RouteHop | None, RouteHop]:
    """(prefill hop, the hop that decodes): a [PREFILL, DECODE] route is disaggregated; any
    other route runs on its first hop (ZigZag routes are read by `zigzag_route`)."""
    if (
        len(hops) == 2
        and hops[0].role == common_pb2.INSTANCE_ROLE_PREFILL
        and hops[1].role == common_pb2.INSTANCE_ROLE_DECODE
    ):
        return hops[0], hops[1]
    return None, hops[0]


def zigzag_route(hops: Sequence[RouteHop]) -> tuple[RouteHop, RouteHop] | None:
    """(loading instance, full partner) of a ZigZag route: its first two hops split by layer
    range, the first ending where the second starts (a third hop is the decode instance of a
    disaggregated deployment); None for any other route."""
    if (
        len(hops) in (2, 3)
        and hops[0].layer_start == 0
        and 0 < hops[0].layer_end == hops[1].layer_start < hops[1].layer_end
        and hops[0].dataplane_address
    ):
        return hops[0], hops[1]
    return None


# ---- the client's error -------------------------------------------------------------------------


class Refusal(Protocol):
    """An SLO refusal as `slo_error` reads it."""

    @property
    def slo_kind(self) -> str | None: ...

    @property
    def retry_after_s(self) -> float | None: ...


def error_for(
    fail: Fail, outcome: Outcome, req: InferenceRequest, limits: AttemptLimits, request_timeout_s: float
) -> GatewayError:
    """The client's error for a choice that ends with `fail` after `outcome` (the one place a
    failure becomes an error). Before anything was streamed it is the request's status; after,
    MID_STREAM (or TIMEOUT). A choice some instance refused for its SLO ends with the 429 of
    `slo_error` when it runs out of instances to ask, whatever the last one did."""
    state = fail.state
    if fail.why == "slo" or (fail.why == "retries_exhausted" and state.refusals):
        # No other instance to ask: an SLO refusal is the answer, not "no instance".
        return slo_error(req, state.refusals, state.failures)
    if isinstance(outcome, ScheduleFailed):
        return _schedule_error(fail, outcome, req)
    iid, resumed, code, detail = outcome.instance_id, outcome.generated, outcome.code, outcome.detail
    if fail.why == "timeout":
        return GatewayError(
            ErrorKind.TIMEOUT,
            f"request {req.request_id} exceeded request_timeout_s={request_timeout_s}"
            f" on instance {iid} after {count(resumed, 'token')}",
        )
    if fail.why == "invalid":
        return invalid(f"instance {iid} rejected the request: {detail}")
    if fail.why == "migrations_exhausted":
        return GatewayError(
            ErrorKind.MID_STREAM,
            f"instance {iid} failed mid-stream after {count(resumed, 'token')}"
            f" ({code.name}: {detail}) and the request was already migrated {state.migrations}"
            f" times (max_migrations={limits.max_migrations})",
            code="instance_failed",
        )
    if fail.why == "retries_exhausted":
        # Every instance tried was full rather than broken: that is back-pressure, not an outage.
        last = state.last_code
        return GatewayError(
            ErrorKind.OVERLOADED if last == grpc.StatusCode.RESOURCE_EXHAUSTED else ErrorKind.UNAVAILABLE,
            f"request {req.request_id} failed on {state.retries + 1} instances before the first token"
            f" (retries_before_first_token={limits.retries_before_first_token}): {'; '.join(state.failures)}",
            code="instances_failed",
        )
    return GatewayError(
        ErrorKind.MID_STREAM if resumed else ErrorKind.INTERNAL,
        f"instance {iid} failed after {count(resumed, 'token')}: {code.name}: {detail}",
        code="instance_failed" if resumed else None,
    )


def _schedule_error(fail: Fail, outcome: ScheduleFailed, req: InferenceRequest) -> GatewayError:
    """No route: before the first token (or past the deadline) Schedule's own error is the answer;
    after tokens the stream could not be migrated (MID_STREAM)."""
    if fail.why == "no_route" and outcome.error is not None:
        return outcome.error
    because = outcome.error.message if outcome.error is not None else "no route"
    return GatewayError(
        ErrorKind.MID_STREAM,
        f"request {req.request_id} could not be migrated after {count(outcome.generated, 'token')}"
        f" ({'; '.join(fail.state.failures)}): {because}",
        code="instance_failed",
    )


def slo_error(req: InferenceRequest, refusals: Sequence[Refusal], failures: Sequence[str]) -> GatewayError:
    """429 for a request whose objective no instance tried could meet: names the objective and
    its value, and when to retry (the soonest any of them expects room, at least 1 s)."""
    kind = refusals[-1].slo_kind or "ttft"
    value = req.slo.value(kind)
    objective = f"{kind}_slo_s={quote(value)}" if value is not None else f"its {kind} SLO"
    waits = [f.retry_after_s for f in refusals if f.retry_after_s is not None]
    retry_after_s = max(min(waits), 1.0) if waits else 1.0
    return GatewayError(
        ErrorKind.SLO_UNATTAINABLE,
        f"request {req.request_id}: the {kind.upper()} objective {objective} cannot be met now"
        f" ({'; '.join(failures)}); retry after {math.ceil(retry_after_s)} s or relax the objective",
        param=f"{kind}_slo_s",
        code=429,
        retry_after_s=retry_after_s,
        slo_kind=kind,
    )


def count(n: int, noun: str) -> str:
    return f"{n} {noun}" if n == 1 else f"{n} {noun}s"
