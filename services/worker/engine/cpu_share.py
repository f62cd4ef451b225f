"""The cores of one machine shared among the engines running on it, so they never oversubscribe.

On a CPU, an engine's compute thread runs torch's OpenMP team of N threads. Two engines with
N = all the cores each, stepping at once, fight for every core: OpenMP's waiting threads spin,
and on the 2-core development box two 2-thread engines decoded at a third of the tokens/s of two
1-thread ones. One engine alone on 1 of 2 cores, on the other hand, serves at about half speed.
So each engine takes `cores // n` threads, where n is the number of engines running on the
machine now, and follows n as instances are loaded and dropped.

Membership is a file per running engine in a directory the workers of a machine share (the
launcher gives them one; compose and swarm a volume of the host). The engine holds an exclusive
`flock` on its file while it runs, so liveness needs no process id: that works across containers,
whose PID namespaces differ. An engine counts the files whose lock is held, at most once a
second; the file of a process that was killed is unlocked by the kernel and removed by the next
count. A file is locked before it takes its counted name, so no count sees it unlocked.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import socket
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


def _held(path: Path) -> bool:
    """Whether a running engine holds `path`'s lock (False: its process is gone)."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except BlockingIOError:
        return True
    finally:
        os.close(fd)  # closing drops the shared lock taken just now, if it was taken
    return False


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
        self._fd: int | None = None
        self._members = 1
        self._counted_s: float | None = None

    def join(self, name: str) -> None:
        """Count this engine (`name` unique within the process) until `leave()`."""
        self.directory.mkdir(parents=True, exist_ok=True)
        stem = f"{socket.gethostname()}-{os.getpid()}-{name}"
        staging = self.directory / f"{stem}.joining"
        fd = os.open(staging, os.O_RDWR | os.O_CREAT, 0o644)
        fcntl.flock(fd, fcntl.LOCK_EX)
        self._file = self.directory / f"{stem}{_SUFFIX}"
        os.replace(staging, self._file)
        self._fd = fd
        self._counted_s = None

    def leave(self) -> None:
        if self._file is not None:
            self._file.unlink(missing_ok=True)
            self._file = None
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None

    def members(self) -> int:
        """Engines running on the machine now (this one included while joined)."""
        live = 0
        for path in self.directory.glob(f"*{_SUFFIX}"):
            if path == self._file or _held(path):
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
