"""docker compose, for real: build the image, bring the stack up, ask it for a completion,
SIGKILL a worker's process and see compose restart it while the mesh keeps answering.

Needs a running Docker engine and docker-compose (skipped otherwise, with the reason). The image
is built by docker/build.sh; where no registry is reachable, set BASE_IMAGE to a base made
locally by docker/make-base-image.sh (the test uses blitzmesh-base:bookworm when it exists and
python:3.11-slim does not). Ports 8000 and 50051 must be free.
"""

from __future__ import annotations

import os
import time

import pytest

from tests.e2e.docker_stack import build_image, run, skip_reason, wait_completion

PROJECT = "bmtest"

pytestmark = [pytest.mark.docker, pytest.mark.e2e, pytest.mark.timeout(900)]


@pytest.fixture(scope="module")
def stack() -> object:
    reason = skip_reason("docker-compose")
    if reason:
        pytest.skip(reason)
    build_image()
    run("docker-compose", "-p", PROJECT, "up", "-d")
    try:
        yield
    finally:
        run("docker-compose", "-p", PROJECT, "down", "-v", check=False)


def test_compose_stack_serves_and_restarts_a_killed_worker(stack: object) -> None:
    first = wait_completion("The capital of France is", timeout_s=300)
    assert first["choices"][0]["finish_reason"] in ("stop", "length")
    container = f"{PROJECT}_worker-0_1"
    pid = run("docker", "inspect", "-f", "{{.State.Pid}}", container).stdout.strip()
    os.kill(int(pid), 9)  # a crash, not `docker kill` (compose does not restart what it was told to stop)
    deadline = time.monotonic() + 60
    while True:
        running, restarts = run(
            "docker", "inspect", "-f", "{{.State.Running}} {{.RestartCount}}", container
        ).stdout.split()
        if running == "true" and int(restarts) >= 1:
            break
        assert time.monotonic() < deadline, f"{container} not restarted: running={running} restarts={restarts}"
        time.sleep(0.5)
    again = wait_completion("The capital of France is", timeout_s=120)
    assert again["choices"][0]["text"] == first["choices"][0]["text"]  # greedy: same answer after the restart
