"""docker compose, for real: build the image, bring the stack up, ask it for a completion,
SIGKILL a worker's process and see compose restart it while the mesh keeps answering.

Needs a running Docker engine and docker-compose (skipped otherwise, with the reason). The image
is built by docker/build.sh; where no registry is reachable, set BASE_IMAGE to a base made
locally by docker/make-base-image.sh (the test uses blitzmesh-base:bookworm when it exists and
python:3.11-slim does not). Ports 8000 and 50051 must be free.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import time
import urllib.request
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PROJECT = "bmtest"

pytestmark = [pytest.mark.docker, pytest.mark.e2e, pytest.mark.timeout(900)]


def _run(*cmd: str, timeout: float = 600, check: bool = True) -> subprocess.CompletedProcess[str]:
    return subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=timeout, check=check)


def _skip_reason() -> str | None:
    if shutil.which("docker") is None or shutil.which("docker-compose") is None:
        return "docker or docker-compose is not installed"
    if subprocess.run(["docker", "info"], capture_output=True, timeout=20).returncode != 0:
        return "no Docker engine is running (start dockerd)"
    for port in (8000, 50051):
        with socket.socket() as s:
            if s.connect_ex(("127.0.0.1", port)) == 0:
                return f"port {port} is in use"
    return None


def _image_exists(name: str) -> bool:
    return subprocess.run(["docker", "image", "inspect", name], capture_output=True).returncode == 0


def _complete(prompt: str, timeout_s: float = 30) -> dict:
    body = json.dumps({"model": "smollm2-135m-instruct", "prompt": prompt, "max_tokens": 8, "temperature": 0})
    req = urllib.request.Request(
        "http://127.0.0.1:8000/v1/completions", body.encode(), {"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(req, timeout=timeout_s) as resp:
        return json.loads(resp.read())


def _wait_completion(prompt: str, timeout_s: float) -> dict:
    deadline = time.monotonic() + timeout_s
    last: Exception | None = None
    while time.monotonic() < deadline:
        try:
            return _complete(prompt)
        except OSError as e:  # not up yet: connection refused/reset, 503 while the model loads
            last = e
            time.sleep(2)
    raise TimeoutError(f"no completion from the compose stack within {timeout_s}s: {last!r}")


@pytest.fixture(scope="module")
def stack() -> object:
    reason = _skip_reason()
    if reason:
        pytest.skip(reason)
    env = dict(os.environ)
    if "BASE_IMAGE" not in env and not _image_exists("python:3.11-slim") and _image_exists("blitzmesh-base:bookworm"):
        env["BASE_IMAGE"] = "blitzmesh-base:bookworm"
    subprocess.run([str(ROOT / "docker" / "build.sh")], cwd=ROOT, env=env, check=True, capture_output=True, timeout=900)
    _run("docker-compose", "-p", PROJECT, "up", "-d")
    try:
        yield
    finally:
        _run("docker-compose", "-p", PROJECT, "down", "-v", check=False)


def test_compose_stack_serves_and_restarts_a_killed_worker(stack: object) -> None:
    first = _wait_completion("The capital of France is", timeout_s=300)
    assert first["choices"][0]["finish_reason"] in ("stop", "length")
    container = f"{PROJECT}_worker-0_1"
    pid = _run("docker", "inspect", "-f", "{{.State.Pid}}", container).stdout.strip()
    os.kill(int(pid), 9)  # a crash, not `docker kill` (compose does not restart what it was told to stop)
    deadline = time.monotonic() + 60
    while True:
        running, restarts = _run(
            "docker", "inspect", "-f", "{{.State.Running}} {{.RestartCount}}", container
        ).stdout.split()
        if running == "true" and int(restarts) >= 1:
            break
        assert time.monotonic() < deadline, f"{container} not restarted: running={running} restarts={restarts}"
        time.sleep(0.5)
    again = _wait_completion("The capital of France is", timeout_s=120)
    assert again["choices"][0]["text"] == first["choices"][0]["text"]  # greedy: same answer after the restart
