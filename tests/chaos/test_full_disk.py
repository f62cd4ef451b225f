"""A full disk while a checkpoint is converted: the conversion fails with the OS's own "no
space" error naming the path, leaves nothing behind (no half checkpoint a parameter manager
could index, no temporary directory), and a later conversion with room succeeds.

The disk is a size-limited tmpfs mounted for the test (needs root; skipped otherwise). No mesh
and no requests: checkpoints are converted before serving (`python -m services.model_format
convert-gguf`, or the default model's fetch), which is what the fault hits.
"""

from __future__ import annotations

import errno
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from services.model_format.gguf import convert_gguf
from tests.chaos.harness import write_row
from tests.unit.test_gguf import write_tiny_gguf


@pytest.fixture
def small_disk(tmp_path: Path) -> Iterator[Path]:
    disk = tmp_path / "disk"
    disk.mkdir()
    done = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=96k", "tmpfs", str(disk)], capture_output=True, text=True
    )
    if done.returncode != 0:
        pytest.skip(f"cannot mount a small tmpfs: {done.stderr.strip() or done.returncode}")
    try:
        yield disk
    finally:
        subprocess.run(["umount", "-l", str(disk)], capture_output=True)


def test_full_disk_during_conversion_leaves_nothing_and_says_why(small_disk: Path, tmp_path: Path) -> None:
    source = tmp_path / "tiny.gguf"
    write_tiny_gguf(source)
    started = time.monotonic()
    with pytest.raises(OSError) as info:
        convert_gguf(source, small_disk / "tiny")
    assert info.value.errno == errno.ENOSPC, info.value
    assert "No space left" in str(info.value) and str(small_disk) in str(info.value), str(info.value)
    assert sorted(p.name for p in small_disk.iterdir()) == [], "a half checkpoint or temporary directory was left"
    roomy = tmp_path / "roomy"
    result = convert_gguf(source, roomy / "tiny")  # the same conversion with room succeeds
    assert (roomy / "tiny" / "config.json").exists() and result is not None
    write_row(
        {
            "fault": "full_disk_during_conversion",
            "requests": 0,
            "completed": 0,
            "migrated": 0,
            "errors": 1,
            "lost": 0,
            "hung": 0,
            "recovery_s": round(time.monotonic() - started, 2),
            "setup": "convert-gguf into a 96 KiB tmpfs: ENOSPC named with its path, nothing left behind; "
            "no mesh and no requests",
        }
    )
