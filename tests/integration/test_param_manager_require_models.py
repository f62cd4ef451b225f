"""--require-models: the index exits at start, naming the models it lacks, so an orchestrator that
cannot order start-up (Docker Swarm) restarts it until model-init has put them in place."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

from services.model_format.synth import synthesize


def _start_index(model_dir: Path, required: list[str], tmp_path: Path) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [
            sys.executable,
            "-m",
            "services.param_manager",
            "--insecure",
            "--port",
            "0",
            "--model-dir",
            str(model_dir),
            "--require-models",
            json.dumps(required),
            "--port-file",
            str(tmp_path / "ports.json"),
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )


def test_a_missing_required_model_stops_the_index_and_a_present_one_serves(tmp_path: Path) -> None:
    models = tmp_path / "models"
    models.mkdir()
    proc = _start_index(models, ["tiny"], tmp_path)
    out, _ = proc.communicate(timeout=120)
    assert proc.returncode != 0
    assert "required models ['tiny'] are not in" in out and not (tmp_path / "ports.json").exists()

    synthesize(models / "tiny", "tiny", seed=0)
    proc = _start_index(models, ["tiny"], tmp_path)
    try:
        deadline = time.monotonic() + 120  # the port file is written once it is SERVING
        while not (tmp_path / "ports.json").exists() and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.1)
        assert proc.poll() is None and (tmp_path / "ports.json").exists()
    finally:
        proc.terminate()
        proc.wait(timeout=30)
