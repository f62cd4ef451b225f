"""The cores of one machine shared among the engines running on it, so they never oversubscribe.

On a CPU, an engine's compute thread runs torch's OpenMP team of N threads. Two engines with
N = all the cores each, stepping at once, fight for every core: OpenMP's waiting threads spin,
and on the 2-core development box two 2-thread engines decoded at a third of the tokens/s of two
1-thread ones. One engine alone on 1 of 2 cores, on the other hand, serves at about half speed.
So each engine takes `cores // n` threads, where n is the number of engines running on the
machine now, and follows n as instances are loaded and dropped.

Membership is a file per running engine in a directory the workers of a machine share (the
launcher gives them one). An engine counts the files whose process is alive, at most once a
second; the files of a process that was killed are removed by the next count.
"""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Callable
from pathlib import Path

_SUFFIX = ".engine"


def available_cores() -> int:
    """Cores this process may run on."""
    try:
        return len(os.sched_getaffinity(0)) or 1
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # someone else's process: alive
    return True


class CpuShare:
    """One engine's membership in a machine's share of cores."""

    def __init__(
        self,
        directory: Path | str,
        *,
        cores: int | None = None,
        recount_s: float = 1.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if cores is not None and cores < 1:
            raise ValueError(f"cores must be >= 1, got {cores}")
        self.directory = Path(directory)
        self.cores = cores or available_cores()
        self.recount_s = recount_s
        self._clock = clock
        self._file: Path | None = None
        self._members = 1
        self._counted_s: float | None = None

    def join(self, name: str) -> None:
        """Count this engine (`name` unique within the process) until `leave()`."""
        self.directory.mkdir(parents=True, exist_ok=True)
        self._file = self.directory / f"{os.getpid()}-{name}{_SUFFIX}"
        self._file.touch()
        self._counted_s = None

    def leave(self) -> None:
        if self._file is not None:
            self._file.unlink(missing_ok=True)
            self._file = None

    def members(self) -> int:
        """Engines running on the machine now (this one included while joined)."""
        live = 0
        for path in self.directory.glob(f"*{_SUFFIX}"):
            try:
                pid = int(path.name.split("-", 1)[0])
            except ValueError:
                continue
            if _alive(pid):
                live += 1
            else:
                with contextlib.suppress(OSError):
                    path.unlink()
        return max(1, live)

    def threads(self) -> int:
        """Threads this engine should compute with: its share of the cores, at least 1. The
        count is refreshed at most every `recount_s`."""
        now = self._clock()
        if self._counted_s is None or now - self._counted_s >= self.recount_s:
            self._members = self.members()
            self._counted_s = now
        return max(1, self.cores // self._members)
