"""Engines on one machine split its cores: each takes cores // engines running now."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from services.worker.engine.cpu_share import CpuShare


def test_engines_split_the_cores_and_follow_joins_and_leaves(tmp_path: Path) -> None:
    now = [0.0]
    a = CpuShare(tmp_path, cores=4, recount_s=1.0, clock=lambda: now[0])
    b = CpuShare(tmp_path, cores=4, recount_s=1.0, clock=lambda: now[0])
    a.join("a")
    assert a.threads() == 4  # alone: every core
    b.join("b")
    assert b.threads() == 2
    assert a.threads() == 4  # counted less than recount_s ago
    now[0] = 1.0
    assert a.threads() == 2
    b.leave()
    now[0] = 2.0
    assert a.threads() == 4
    a.leave()
    assert list(tmp_path.iterdir()) == []


def test_never_fewer_than_one_thread(tmp_path: Path) -> None:
    shares = [CpuShare(tmp_path, cores=2) for _ in range(3)]
    for i, share in enumerate(shares):
        share.join(str(i))
    assert [s.threads() for s in shares] == [1, 1, 1]


def test_an_engine_of_a_killed_process_stops_counting(tmp_path: Path) -> None:
    done = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    dead_pid = int(done.stdout)
    (tmp_path / f"{dead_pid}-engine1.engine").touch()  # left behind by a SIGKILLed worker
    share = CpuShare(tmp_path, cores=2)
    share.join("me")
    assert share.threads() == 2
    assert not (tmp_path / f"{dead_pid}-engine1.engine").exists()


def test_cores_must_be_positive(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="cores must be >= 1, got 0"):
        CpuShare(tmp_path, cores=0)
