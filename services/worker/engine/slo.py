"""Per-request service-level objectives as the engine sees them, and the error that refuses a
request whose objective cannot be met (SCORPIO's admission control and TTFT guard)."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

SLOKind = Literal["ttft", "tpot"]


@dataclass(frozen=True)
class RequestSLO:
    """A request's latency objectives, in seconds; None = no objective of that kind.

    `ttft_s`: time from arrival at the engine to the first token. `tpot_s`: mean time per output
    token after the first."""

    ttft_s: float | None = None
    tpot_s: float | None = None

    def __post_init__(self) -> None:
        for name in ("ttft_s", "tpot_s"):
            value = getattr(self, name)
            if value is not None and not (isinstance(value, int | float) and math.isfinite(value) and value > 0):
                raise ValueError(f"{name} must be a positive number of seconds, got {value!r}")

    @property
    def is_empty(self) -> bool:
        return self.ttft_s is None and self.tpot_s is None


class SLOUnattainable(RuntimeError):
    """Refused before it started: the request's `slo` objective cannot be met here now. Retryable:
    `retry_after_s` is when the engine expects room (the gateway's 429 `Retry-After`)."""

    def __init__(self, message: str, *, slo: SLOKind, retry_after_s: float) -> None:
        super().__init__(message)
        self.slo: SLOKind = slo
        self.retry_after_s = max(0.0, float(retry_after_s))
