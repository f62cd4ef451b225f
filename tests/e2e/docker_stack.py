"""What the Docker tests share (tests/e2e/test_compose.py, tests/e2e/test_swarm.py): whether an
engine runs, the image built by docker/build.sh, and completions from the published gateway."""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
GATEWAY_PORTS = (8000, 50051)


def run(*cmd: str, timeout: float = 600, check: bool = True) -> subprocess.CompletedProcess[str]:
    return subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=timeout, check=check)


def skip_reason(*tools: str) -> str | None:
    """Why a Docker test cannot run here (None: it can): a missing tool, no engine, a busy port."""
    missing = [tool for tool in ("docker", *tools) if shutil.which(tool) is None]
    if missing:
        return f"{' and '.join(missing)} not installed"
    if subprocess.run(["docker", "info"], capture_output=True, timeout=20).returncode != 0:
        return "no Docker engine is running (start dockerd)"
    for port in GATEWAY_PORTS:
        with socket.socket() as s:
            if s.connect_ex(("127.0.0.1", port)) == 0:
                return f"port {port} is in use"
    return None


def image_exists(name: str) -> bool:
    return subprocess.run(["docker", "image", "inspect", name], capture_output=True).returncode == 0


def build_image() -> None:
    """blitzmesh:latest by docker/build.sh, FROM the locally made base where no registry's is here."""
    env = dict(os.environ)
    if "BASE_IMAGE" not in env and not image_exists("python:3.11-slim") and image_exists("blitzmesh-base:bookworm"):
        env["BASE_IMAGE"] = "blitzmesh-base:bookworm"
    subprocess.run([str(ROOT / "docker" / "build.sh")], cwd=ROOT, env=env, check=True, capture_output=True, timeout=900)


def complete(prompt: str, timeout_s: float = 30) -> dict:
    body = json.dumps({"model": "smollm2-135m-instruct", "prompt": prompt, "max_tokens": 8, "temperature": 0})
    req = urllib.request.Request(
        "http://127.0.0.1:8000/v1/completions", body.encode(), {"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(req, timeout=timeout_s) as resp:
        return json.loads(resp.read())


def wait_completion(prompt: str, timeout_s: float) -> dict:
    deadline = time.monotonic() + timeout_s
    last: Exception | None = None
    while time.monotonic() < deadline:
        try:
            return complete(prompt)
        except OSError as e:  # not up yet: connection refused/reset, 503 while the model loads
            last = e
            time.sleep(2)
    raise TimeoutError(f"no completion from the gateway on :8000 within {timeout_s}s: {last!r}")
