"""What the reconcile core asks for: plain, frozen data that an `Actuator` carries out.

The core decides and updates its registry at once (an instance it loads is LOADING from the
decision on, one it drains DRAINING); the actions are the I/O that follows. `Report` is the
exception: an event to publish (and, with `log_line`, a line of the decision log), not I/O on a
worker; nor is `Count`, an outcome for the metrics.
"""

from __future__ import annotations

import dataclasses

from .types import Role

__all__ = [
    "Action",
    "Count",
    "DrainInstance",
    "LoadInstances",
    "MigrateRequests",
    "Report",
    "ResumeInstance",
    "UpdateLocation",
]


@dataclasses.dataclass(frozen=True, slots=True)
class LoadInstances:
    """Load `model` as `role` on each of `instance_ids` (already LOADING in the registry), all
    from one multicast transfer plan, so n targets cost about one. The actuator makes the plan:
    it needs the parameter manager's location index, which is I/O.

    `attempt` counts retries of a failed load; `tried` holds the workers it failed on, which
    a retry does not pick again."""

    model: str
    role: Role
    instance_ids: tuple[str, ...]
    reason: str
    attempt: int = 0
    tried: frozenset[str] = frozenset()


@dataclasses.dataclass(frozen=True, slots=True)
class DrainInstance:
    """Drain `instance_id` (already DRAINING: no new requests, in-flight ones finish), take it
    out of the parameter manager's locations, then unload it. `keep_warm_s` > 0: the worker
    keeps the weights that long after it unloads, so a load of the same model within it costs
    no transfer (a scale-in the next decision reverses)."""

    instance_id: str
    model: str
    reason: str
    keep_warm_s: float = 0.0


@dataclasses.dataclass(frozen=True, slots=True)
class ResumeInstance:
    """Take back the drain of `instance_id` (SERVING again in the registry from the decision
    on): the worker ends its drain while the drain still waits for requests, and serves again
    with the weights it holds; no load. If the drain has already finished, the worker refuses
    and the drain's own outcome moves the instance on (`Reconciler.drain_finished`)."""

    instance_id: str
    model: str
    reason: str


@dataclasses.dataclass(frozen=True, slots=True)
class UpdateLocation:
    """Tell the parameter manager that `instance_id` holds `model` (or no longer does)."""

    model: str
    instance_id: str
    present: bool


@dataclasses.dataclass(frozen=True, slots=True)
class MigrateRequests:
    """Ask `source` to release up to `n` requests for the gateway to re-route: running ones with
    their KV (live migration, `why` the target it is over; only those with at least
    `min_tokens_left` tokens left to generate) or, with `running=False`, queued ones (a rebalance
    after a scale-out, `why` the instance that joined). `ran_ahead_by` (queued only): an
    instance that has just finished loading; `source` also releases every queued request it ran
    ahead (ZigZag pulled), beyond `n`, and offers it no more."""

    source: str
    model: str
    n: int
    running: bool
    why: str
    min_tokens_left: int = 0
    ran_ahead_by: str = ""

    @property
    def reason(self) -> str:
        """What the worker is told (it logs it with each request it lets go)."""
        return f"live migration: {self.why}" if self.running else f"scale_out: {self.why}"


@dataclasses.dataclass(frozen=True, slots=True)
class Report:
    """A cluster event (`Admin.WatchEvents` columns). `log_line`: also a line of the decision
    log. `time_s`: the event's time when it is not the time it is published."""

    action: str
    target: str
    status: str
    reason: str
    instance_id: str = ""
    time_s: float | None = None
    log_line: str = ""


@dataclasses.dataclass(frozen=True, slots=True)
class Count:
    """One actuator outcome for the metrics (`kind`: load, drain, scale_from_zero; `outcome`)."""

    kind: str
    outcome: str


Action = LoadInstances | DrainInstance | ResumeInstance | UpdateLocation | MigrateRequests | Report | Count
