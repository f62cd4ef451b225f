"""How much of the machine other work took while a system was measured (Linux /proc).

The development box is shared: another process that runs during a round slows it, and with torch
spinning on every core the slowdown is far larger than that process's CPU share. Each round
records the CPU time spent outside the benchmark's own processes, so a noisy figure can be told
from a real one.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

_TICK_S = 1.0 / os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 0.01


def _machine_busy_s() -> float | None:
    """CPU seconds all cores spent not idle since boot (user, nice, system, irq, softirq, steal)."""
    try:
        fields = Path("/proc/stat").read_text().split("\n", 1)[0].split()
    except OSError:
        return None
    user, nice, system, _idle, _iowait, irq, softirq, steal = (int(v) for v in fields[1:9])
    return (user + nice + system + irq + softirq + steal) * _TICK_S


def _process_cpu_s(pid: int) -> float:
    """User + system CPU seconds of one process (all its threads); 0 if it is gone."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return 0.0
    # The command name may hold spaces; the fields after its closing parenthesis are fixed.
    fields = stat.rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) * _TICK_S


@dataclass(frozen=True)
class Interference:
    own_cpu_s: dict[str, float]  # per benchmark process
    foreign_cpu_s: float

    def as_dict(self, wall_s: float) -> dict[str, object]:
        cores = os.cpu_count() or 1
        return {
            "own_cpu_s": {name: round(v, 2) for name, v in self.own_cpu_s.items()},
            "foreign_cpu_s": round(self.foreign_cpu_s, 2),
            # Share of the machine's capacity during the round used by processes outside the bench.
            "foreign_cpu_share": round(self.foreign_cpu_s / (wall_s * cores), 3),
        }


class CpuMeter:
    """Start before a round, `stop()` after it; `pids` names the benchmark's own processes."""

    def __init__(self, pids: Mapping[str, int]) -> None:
        self._pids = dict(pids)
        self._busy0 = _machine_busy_s()
        self._own0 = {name: _process_cpu_s(pid) for name, pid in self._pids.items()}

    def stop(self) -> Interference | None:
        busy1 = _machine_busy_s()
        if busy1 is None or self._busy0 is None:
            return None
        own = {name: _process_cpu_s(pid) - self._own0[name] for name, pid in self._pids.items()}
        return Interference(own, max(0.0, busy1 - self._busy0 - sum(own.values())))
