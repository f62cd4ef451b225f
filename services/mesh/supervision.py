"""When the launcher restarts a child that exited, and when it gives up: a pure policy, as
compose's `restart: unless-stopped` with a crash-loop limit (no I/O, no clock reads).

Backoff doubles from `initial_backoff_s` to `max_backoff_s` over consecutive crashes and starts
again once a child has stayed up `stable_after_s`; more than `max_restarts` restarts of one child
within `window_s` means it cannot run, and the mesh stops.
"""

from __future__ import annotations

import signal
from dataclasses import dataclass, field

from pydantic import BaseModel, ConfigDict, Field, model_validator


class RestartPolicy(BaseModel):
    """How the launcher restarts a child that exits while the mesh runs."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    initial_backoff_s: float = Field(0.5, gt=0, description="wait before the first restart after a crash")
    max_backoff_s: float = Field(10.0, gt=0, description="the longest wait; the backoff doubles up to it")
    max_restarts: int = Field(5, ge=0, description="restarts of one child allowed within window_s; one more stops")
    window_s: float = Field(60.0, gt=0, description="the window max_restarts counts over")
    stable_after_s: float = Field(30.0, gt=0, description="a child up this long starts again from the first backoff")

    @model_validator(mode="after")
    def _check(self) -> RestartPolicy:
        if self.max_backoff_s < self.initial_backoff_s:
            raise ValueError(
                f"max_backoff_s={self.max_backoff_s!r} is below initial_backoff_s={self.initial_backoff_s!r}"
            )
        return self


@dataclass
class ChildHistory:
    """What the policy remembers of one child: its recent restarts and its crash streak."""

    restarts_s: list[float] = field(default_factory=list)
    streak: int = 0


@dataclass(frozen=True)
class Restart:
    attempt: int  # restarts of this child within the window, this one included
    backoff_s: float


@dataclass(frozen=True)
class GiveUp:
    restarts: int  # restarts within the window before this exit
    window_s: float


def decide(
    policy: RestartPolicy, history: ChildHistory, *, now_s: float, started_s: float
) -> tuple[Restart | GiveUp, ChildHistory]:
    """The child started at `started_s` exited at `now_s`: restart it after a backoff, or give up."""
    recent = [t for t in history.restarts_s if now_s - t < policy.window_s]
    if len(recent) >= policy.max_restarts:
        return GiveUp(len(recent), policy.window_s), ChildHistory(recent, history.streak)
    streak = 1 if now_s - started_s >= policy.stable_after_s else history.streak + 1
    backoff_s = min(policy.max_backoff_s, policy.initial_backoff_s * 2.0 ** min(streak - 1, 64))
    return Restart(len(recent) + 1, backoff_s), ChildHistory([*recent, now_s], streak)


def describe_exit(returncode: int) -> str:
    """'code 2' or 'signal SIGKILL' (asyncio reports death by signal N as -N)."""
    if returncode >= 0:
        return f"code {returncode}"
    try:
        return f"signal {signal.Signals(-returncode).name}"
    except ValueError:
        return f"signal {-returncode}"
