"""docker compose, for real: build the image, bring the stack up, ask it for a chat answer, SIGKILL
the serving worker's process with 40 streams in flight and see every stream finish with the
greedy text it would have had whole, compose restart the worker, and `down` leave nothing of the
project behind (no container, network or volume).

Needs a running Docker engine and docker-compose; `make test` installs and starts them as root on
Debian (scripts/with_system.sh) and skips with the reason elsewhere. The image is built by
docker/build.sh FROM the locally made base (docker/make-base-image.sh) where python:3.11-slim is
not here. Ports 8000 and 50051 must be free.
"""

from __future__ import annotations

import asyncio
import os
import time

import pytest

from tests.e2e.docker_stack import (
    build_image,
    project_leftovers,
    run,
    serving_instances,
    skip_reason,
    stream_chats,
    wait_completion,
)

PROJECT = "bmtest"
STREAMS = 40

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
        run("docker-compose", "-p", PROJECT, "down", "-v", "--remove-orphans", check=False)


def _restarted(container: str, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while True:
        running, restarts = run(
            "docker", "inspect", "-f", "{{.State.Running}} {{.RestartCount}}", container
        ).stdout.split()
        if running == "true" and int(restarts) >= 1:
            return
        assert time.monotonic() < deadline, f"{container} not restarted: running={running} restarts={restarts}"
        time.sleep(0.5)


def test_compose_stack_keeps_40_streams_through_a_worker_kill_and_leaves_nothing(stack: object) -> None:
    first = wait_completion("The capital of France is", timeout_s=300)
    assert first["choices"][0]["finish_reason"] in ("stop", "length")
    (reference,) = asyncio.run(stream_chats(1))  # whole, on one instance, before any fault
    assert reference, "an empty greedy answer makes the comparison below vacuous"
    # A SERVING worker (the autoscaler may have loaded all three by now: 40 streams spread over
    # them, and the killed one's move to the others).
    serving = serving_instances()
    assert serving, "no SERVING instance after a completion was answered"
    container = f"{PROJECT}_{serving[0]}_1"
    pid = int(run("docker", "inspect", "-f", "{{.State.Pid}}", container).stdout.strip())

    def kill() -> None:  # a crash, not `docker kill` (compose does not restart what it was told to stop)
        os.kill(pid, 9)

    texts = asyncio.run(stream_chats(STREAMS, fault=kill))
    lost = [i for i, t in enumerate(texts) if isinstance(t, BaseException)]
    assert not lost, [repr(texts[i]) for i in lost[:3]]
    differ = [t for t in texts if t != reference]
    assert not differ, f"{len(differ)}/{STREAMS} streams differ from the whole answer: {differ[:2]!r} vs {reference!r}"
    _restarted(container, timeout_s=60)
    again = wait_completion("The capital of France is", timeout_s=120)
    assert again["choices"][0]["text"] == first["choices"][0]["text"]  # greedy: same answer after the restart

    run("docker-compose", "-p", PROJECT, "down", "-v", "--remove-orphans")
    assert project_leftovers("com.docker.compose.project", PROJECT) == {}
