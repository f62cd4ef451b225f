"""Docker Swarm, for real: a one-node swarm runs deploy/swarm/blitzmesh-stack.yml with the image
built here, answers a completion, replaces a worker container that was SIGKILLed and answers the
same again; then the stack is removed.

Needs a running Docker engine (skipped otherwise, with the reason); the image is built as in
tests/e2e/test_compose.py. The test labels this node for every placement constraint of the
stack, makes the certificates the stack's secrets come from (deploy/swarm/tls, not tracked), and
leaves swarm mode again if it was the one to enter it. Ports 8000 and 50051 must be free.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml

from services.mesh import deployments
from tests.e2e.docker_stack import ROOT, build_image, run, skip_reason, wait_completion

STACK = "bmswarm"
STACK_FILE = ROOT / "deploy" / "swarm" / "blitzmesh-stack.yml"

pytestmark = [pytest.mark.docker, pytest.mark.e2e, pytest.mark.timeout(1200)]


def _labels() -> set[str]:
    """Every node label the stack's placement constraints ask for."""
    services = yaml.safe_load(STACK_FILE.read_text())["services"].values()
    return {c.split("node.labels.")[1].split(" ")[0] for s in services for c in s["deploy"]["placement"]["constraints"]}


def _instance_args() -> list[str]:
    """`--instance ROLE/ID` for every instance certificate the stack's secrets name."""
    files = (Path(v["file"]) for v in yaml.safe_load(STACK_FILE.read_text())["secrets"].values())
    own = sorted({f"{f.parent.name}/{f.stem}" for f in files if f.suffix == ".pem" and f.parent.name != "tls"})
    return [a for spec in own for a in ("--instance", spec)]


def _swarm_state() -> str:
    return run("docker", "info", "--format", "{{.Swarm.LocalNodeState}}").stdout.strip()


def _tasks(service: str) -> list[tuple[str, str, str]]:
    """(task id, desired state, current state) of a service's tasks, newest first."""
    out = run(
        "docker", "service", "ps", "--no-trunc", "--format", "{{.ID}}\t{{.DesiredState}}\t{{.CurrentState}}", service
    )
    return [tuple(line.split("\t")) for line in out.stdout.splitlines() if line.strip()]  # type: ignore[misc]


def _running_container(service: str, timeout_s: float) -> str:
    """The id of the service's running container (this node runs them all)."""
    deadline = time.monotonic() + timeout_s
    while True:
        ids = run("docker", "ps", "-q", "--filter", f"label=com.docker.swarm.service.name={service}").stdout.split()
        if len(ids) == 1:
            return ids[0]
        assert time.monotonic() < deadline, f"{service}: {len(ids)} running containers after {timeout_s}s"
        time.sleep(1)


@pytest.fixture(scope="module")
def swarm_stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[None]:
    reason = skip_reason()
    if reason:
        pytest.skip(reason)
    state = _swarm_state()
    if state not in ("inactive", "active"):
        pytest.skip(f"this engine's swarm is {state!r}")
    build_image()
    joined = state == "inactive"
    if joined:
        run("docker", "swarm", "init", "--advertise-addr", "127.0.0.1")
    tls = ROOT / deployments.SWARM_TLS_DIR
    ca_key = tmp_path_factory.mktemp("ca") / "ca.key"
    subprocess.run(
        [sys.executable, "-m", "services.common.pki", str(tls), "--ca-key", str(ca_key), *_instance_args()],
        cwd=ROOT,
        check=True,
        capture_output=True,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )
    node = run("docker", "info", "--format", "{{.Swarm.NodeID}}").stdout.strip()
    run("docker", "node", "update", *(a for label in sorted(_labels()) for a in ("--label-add", f"{label}=true")), node)
    try:
        run("docker", "stack", "deploy", "-c", str(STACK_FILE), STACK)
        yield
    finally:
        logs = Path(os.environ.get("SWARM_LOG_DIR", tmp_path_factory.getbasetemp()))
        for service in ("param_manager", "global_manager", "worker-0", "gateway"):
            out = run("docker", "service", "logs", "--raw", f"{STACK}_{service}", check=False, timeout=60)
            (logs / f"swarm-{service}.log").write_text(out.stdout + out.stderr)
        run("docker", "stack", "rm", STACK, check=False)
        deadline = time.monotonic() + 120  # its containers (exited ones too) go before its volume can
        while run("docker", "ps", "-aq", "--filter", f"label=com.docker.stack.namespace={STACK}").stdout.strip():
            if time.monotonic() > deadline:
                break
            time.sleep(1)
        run("docker", "volume", "rm", f"{STACK}_models", f"{STACK}_cpu-share", check=False)
        if joined:
            run("docker", "swarm", "leave", "--force", check=False)


def test_swarm_stack_serves_and_replaces_a_killed_worker_container(swarm_stack: None) -> None:
    first = wait_completion("The capital of France is", timeout_s=600)
    assert first["choices"][0]["finish_reason"] in ("stop", "length")
    service = f"{STACK}_worker-0"
    old = _running_container(service, timeout_s=60)
    pid = run("docker", "inspect", "-f", "{{.State.Pid}}", old).stdout.strip()
    os.kill(int(pid), 9)  # a crash: swarm's restart policy replaces the task with a new container
    new = _running_container(service, timeout_s=120)
    deadline = time.monotonic() + 120
    while new == old:
        assert time.monotonic() < deadline, f"{service}: the killed container {old} was not replaced"
        time.sleep(1)
        new = _running_container(service, timeout_s=120)
    tasks = _tasks(service)
    assert any(state.startswith("Failed") for _, _, state in tasks), tasks
    again = wait_completion("The capital of France is", timeout_s=300)
    assert again["choices"][0]["text"] == first["choices"][0]["text"]  # greedy: the same answer
