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
    # Another process (another container's, as far as the count can tell) joins and is SIGKILLed:
    # the kernel drops its lock, and the next count removes its file.
    code = (
        "import os, sys; from services.worker.engine.cpu_share import CpuShare; "
        f"CpuShare({str(tmp_path)!r}, cores=2).join('engine1'); print('joined', flush=True); sys.stdin.read()"
    )
    other = subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert other.stdout is not None and other.stdout.readline().strip() == "joined"
        share = CpuShare(tmp_path, cores=2)
        share.join("me")
        assert share.threads() == 1  # the other engine's lock is held: two engines
        other.kill()
        other.wait(timeout=10)
    finally:
        other.kill()
    later = CpuShare(tmp_path, cores=2)
    assert later.members() == 1  # only "me" is left
    assert [p.name.endswith("-me.engine") for p in tmp_path.iterdir()] == [True]


def test_cores_must_be_positive(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="cores must be >= 1, got 0"):
        CpuShare(tmp_path, cores=0)
