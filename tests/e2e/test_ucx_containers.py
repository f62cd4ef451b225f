"""UCX between containers: two blitzmesh containers move a model's parameters over UCX.

Each container sits on two bridge networks, as a swarm task does: `ucx-mesh` (the one peers
reach it by; its alias is what it advertises) and `ucx-gw`, a bridge with inter-container
traffic off, like swarm's docker_gwbridge. Without the transport's interface choice
(services/dataplane/netdev.py) the first transfer here never progressed (docs/deploy.md, "UCX
between containers"). The containers run this checkout's services/ and tests/ (mounted), the
image provides Python, ucxx and UCX. Needs a running Docker engine and blitzmesh:latest
(docker/build.sh); skipped with the reason otherwise.
"""

from __future__ import annotations

import json
import secrets
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
IMAGE = "blitzmesh:latest"

pytestmark = [pytest.mark.docker, pytest.mark.e2e, pytest.mark.timeout(120)]


def _docker(*args: str, timeout: float = 60, check: bool = True) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["docker", *args], capture_output=True, text=True, timeout=timeout, check=check)


def _skip_reason() -> str | None:
    if shutil.which("docker") is None:
        return "docker is not installed"
    if subprocess.run(["docker", "info"], capture_output=True, timeout=20).returncode != 0:
        return "no Docker engine is running"
    if _docker("image", "inspect", IMAGE, check=False).returncode != 0:
        return f"image {IMAGE} not built (docker/build.sh)"
    return None


@pytest.fixture
def networks() -> Iterator[tuple[str, str, str]]:
    reason = _skip_reason()
    if reason:
        pytest.skip(reason)
    tag = f"bmucx-{secrets.token_hex(3)}"
    mesh, gw = f"{tag}-mesh", f"{tag}-gw"
    _docker("network", "create", mesh)
    _docker("network", "create", "-o", "com.docker.network.bridge.enable_icc=false", gw)
    try:
        yield tag, mesh, gw
    finally:
        names = _docker("ps", "-aq", "--filter", f"name={tag}-", check=False).stdout.split()
        if names:
            _docker("rm", "-f", *names, check=False)
        _docker("network", "rm", mesh, gw, check=False)


def _container(tag: str, mesh: str, gw: str, role: str, folder: Path) -> str:
    # The alias, unlike the container's name, resolves on `mesh` alone, as a swarm service name
    # resolves on the stack's overlay and not on the gateway bridge.
    name, alias = f"{tag}-{role}", f"{role}-{tag}"
    _docker(
        "create", "--name", name, "--network", mesh, "--network-alias", alias, "-e", f"ADVERTISE_HOST={alias}",
        "-e", "PYTHONPATH=/app", "-v", f"{ROOT / 'services'}:/app/services:ro", "-v", f"{ROOT / 'tests'}:/app/tests:ro",
        "-v", f"{folder}:/pair", IMAGE, "timeout", "60", "python", "-m", "tests.harness.ucx_pair", role, "/pair",
    )  # fmt: skip
    _docker("network", "connect", gw, name)  # the second interface, as swarm's gateway bridge
    return name


def test_parameters_move_over_ucx_between_containers(networks: tuple[str, str, str], tmp_path: Path) -> None:
    tag, mesh, gw = networks
    tmp_path.chmod(0o777)
    server = _container(tag, mesh, gw, "serve", tmp_path)
    puller = _container(tag, mesh, gw, "pull", tmp_path)
    _docker("start", server)
    done = _docker("start", "-a", puller, timeout=90, check=False)
    logs = _docker("logs", server, check=False)
    detail = f"puller:\n{done.stdout}{done.stderr}\nserver:\n{logs.stdout}{logs.stderr}"
    assert done.returncode == 0, detail
    assert "net_devices=eth" in done.stdout + done.stderr, detail  # UCX was given one interface
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert result["identical"] and result["bytes"] > 16 << 20, detail
