"""Which autoscaling decisions are worth reporting, and how the actuator bounds them and tops
pools up to their floors.

The policy decides every tick; most ticks say "no change" with fresh numbers in the reason.
Reporting each one would drown the log and the event stream, so a decision is reported when its
*kind* differs from the last one reported (action, pool sizes, and the reason with its numbers
masked) or when `repeat_s` passed since the last report. Every scale decision that can take
effect is therefore told (it moves the pool sizes, so the next one differs); only the same
change asked again and again, because the actuator could not carry it out (no IDLE worker, a
manager bound), is told at the reduced rate. Pure: the caller passes the time in the decision.
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping
from dataclasses import dataclass

from .types import Role, ScaleDecision

__all__ = ["DecisionThrottle", "bounded_delta", "plan_top_up", "reason_key"]

# Numbers in reasons ("ratio=0.625", "t=180", "1e-05") vary every tick; their shape does not.
_NUMBER = re.compile(r"[-+]?(?:\d+\.?\d*|\.\d+)(?:[eE][-+]?\d+)?|\binf\b|\bnan\b")


def reason_key(decision: ScaleDecision) -> str:
    """The decision with its numbers masked: equal keys mean "nothing new to report"."""
    return f"{decision.policy}|{decision.action}|{decision.target_str()}|{_NUMBER.sub('#', decision.reason)}"


@dataclass
class DecisionThrottle:
    """Says which decisions to report: each new kind at once, repeats every `repeat_s`."""

    repeat_s: float = 30.0
    _last_key: str | None = None
    _last_report_s: float = -math.inf

    def __post_init__(self) -> None:
        if not self.repeat_s > 0:
            raise ValueError(f"repeat_s must be > 0, got {self.repeat_s!r}")

    def should_report(self, decision: ScaleDecision) -> bool:
        key = reason_key(decision)
        report = key != self._last_key or decision.now_s - self._last_report_s >= self.repeat_s
        if report:
            self._last_key, self._last_report_s = key, decision.now_s
        return report

    def reset(self) -> None:
        """Forget the last report (e.g. after a policy change), so the next decision is told."""
        self._last_key, self._last_report_s = None, -math.inf


def bounded_delta(
    current: int, wanted: int, *, low: int, high: int, low_name: str = "min_instances"
) -> tuple[int, str]:
    """Instances to add (> 0) or drain (< 0) to move `current` toward `wanted` within the
    manager's own [low, high]; the note says what the bound held back ("" when nothing).
    `low_name` names the setting behind `low` (min_prefill for the prefill pool, ...)."""
    if low > high:
        raise ValueError(f"low={low!r} must be <= high={high!r}")
    target = min(high, max(low, wanted))
    note = ""
    if target != wanted:
        bound = "max_instances" if wanted > high else low_name
        note = f"held at manager {bound}={target} (policy wanted {wanted})"
    return target - current, note


_TOP_UP_ORDER = (Role.PREFILL, Role.DECODE, Role.COLOCATED)


def plan_top_up(floors: Mapping[Role, int], live: Mapping[Role, int], idle: int) -> dict[Role, int]:
    """How many of `idle` free workers each pool gets to reach its floor (`floors`, e.g.
    min_prefill / min_decode), given its `live` (LOADING + SERVING) count.

    One worker at a time: first to a pool that has none yet, so that with too few workers for
    every floor a prefill and a decode instance still serve as a pair (two half-filled pools
    serve; one full pool and an empty one serve only through the single-hop fallback); then to
    the pool furthest below its floor; ties in the order prefill, decode, colocated. Pools at or
    above their floor get nothing, and the result omits them.
    """
    if idle < 0:
        raise ValueError(f"idle must be >= 0, got {idle!r}")
    for role, n in (*floors.items(), *live.items()):
        if n < 0:
            raise ValueError(f"pool {role.value}: counts must be >= 0, got {n!r}")
    have = {role: live.get(role, 0) for role in floors}
    given: dict[Role, int] = {}
    order = {role: i for i, role in enumerate(_TOP_UP_ORDER)}
    for _ in range(idle):
        short = [role for role, floor in floors.items() if have[role] < floor]
        if not short:
            break
        role = min(short, key=lambda r: (have[r] > 0, have[r] - floors[r], order[r]))
        have[role] += 1
        given[role] = given.get(role, 0) + 1
    return given
