"""A host's CPU cores shared by the simulated workers computing on it (opt-in CPU contention).

The real worker paces an engine iteration (`services/worker/engine/engine.py`): it computes the
step (`compute_s`), then sleeps `pace - compute_s` if that is positive, so a step lasts
max(pace, compute). On a host with fewer cores than busy processes the compute stretches.
`HostCpu` models that as processor sharing: each worker in the compute part of a step is a job
of `work_s` CPU-seconds (its compute time alone on a core); while n jobs run, each progresses at
min(1, (cores - reserved) / n) CPU-seconds per second, recomputed whenever a job starts, ends or
is cancelled (exact, not an approximation at step start). `reserved` is the share of the cores
taken by the host's other processes (gateway, manager, parameter manager). A worker sleeping out
its pace takes no CPU.
"""

from __future__ import annotations

from collections.abc import Callable

from .events import EventLoop, Timer

__all__ = ["HostCpu"]

_EPS = 1e-12


class HostCpu:
    def __init__(self, loop: EventLoop, cores: float, reserved: float = 0.0) -> None:
        if not cores - reserved > 0:
            raise ValueError(f"cores - reserved must be > 0, got {cores!r} - {reserved!r}")
        self.loop = loop
        self.cores = cores - reserved
        self.jobs: dict[str, list] = {}  # key -> [CPU-seconds left, callback]
        self._last = loop.now_s
        self._timer: Timer | None = None
        self._next: str | None = None
        self.peak_jobs = 0

    def rate(self) -> float:
        """CPU-seconds per second each running job gets now."""
        n = len(self.jobs)
        return min(1.0, self.cores / n) if n else 1.0

    def start(self, key: str, work_s: float, done: Callable[[], None]) -> None:
        """Run `work_s` CPU-seconds for `key`; `done()` when they are through."""
        self._advance()
        self.jobs[key] = [max(0.0, work_s), done]
        self.peak_jobs = max(self.peak_jobs, len(self.jobs))
        self._reschedule()

    def cancel(self, key: str) -> None:
        self._advance()
        if self.jobs.pop(key, None) is not None:
            self._reschedule()

    def _advance(self) -> None:
        now = self.loop.now_s
        dt = now - self._last
        if dt > 0 and self.jobs:
            r = self.rate()
            for job in self.jobs.values():
                job[0] -= dt * r
        self._last = now

    def _reschedule(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        self._next = None
        if not self.jobs:
            return
        key = min(self.jobs, key=lambda k: self.jobs[k][0])
        self._next = key
        self._timer = self.loop.after(max(0.0, self.jobs[key][0]) / self.rate(), self._complete)

    def _complete(self) -> None:
        self._timer = None
        self._advance()
        done = [k for k, j in self.jobs.items() if k == self._next or j[0] <= _EPS]
        callbacks = [self.jobs.pop(k)[1] for k in done]
        self._reschedule()
        for cb in callbacks:
            cb()
