"""What the Docker tests share (tests/e2e/test_compose.py, tests/e2e/test_swarm.py): whether an
engine runs, the image built by docker/build.sh, and completions from the published gateway."""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import socket
import subprocess
import time
import urllib.request
from collections.abc import Callable
from pathlib import Path

import openai

ROOT = Path(__file__).resolve().parents[2]
GATEWAY_PORTS = (8000, 50051)
# What skips say: `make test` runs the suite through scripts/with_system.sh, which installs and
# starts these parts as root on Debian.
INSTALL_HINT = "as root on Debian `make test` installs and starts it: scripts/with_system.sh"
MODEL = "smollm2-135m-instruct"
CHAT = [{"role": "user", "content": "Tell me a short story about a lighthouse."}]
STREAM_TOKENS = 48


# The admin key the stacks are brought up with (their gateway sees the host's calls from the Docker
# network, not loopback), so that the tests can ask which instance serves.
ADMIN_KEY = "docker-e2e-admin-key"


def run(*cmd: str, timeout: float = 600, check: bool = True) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "BLITZMESH_GATEWAY_ADMIN_API_KEYS": json.dumps([ADMIN_KEY])}
    return subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=timeout, check=check, env=env)


def serving_instances() -> list[str]:
    """The ids of the SERVING instances, from the published gateway's admin API."""
    import blitzmesh

    with blitzmesh.Client("127.0.0.1:50051", admin_api_key=ADMIN_KEY, timeout_s=10) as client:
        return sorted(i.instance_id for i in client.cluster().instances if i.state == "serving")


def skip_reason(*tools: str) -> str | None:
    """Why a Docker test cannot run here (None: it can): a missing tool, no engine, a busy port."""
    missing = [tool for tool in ("docker", *tools) if shutil.which(tool) is None]
    if missing:
        return f"{' and '.join(missing)} not installed ({INSTALL_HINT})"
    if subprocess.run(["docker", "info"], capture_output=True, timeout=20).returncode != 0:
        return f"no Docker engine is running ({INSTALL_HINT})"
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


async def stream_chats(
    n: int, fault: Callable[[], None] | None = None, timeout_s: float = 300
) -> list[str | BaseException]:
    """n greedy chat streams through the published gateway, their texts (or what each raised);
    `fault` runs once, as soon as one stream is past its first token (the rest in flight or
    queued), so it lands with all of them under way."""
    client = openai.AsyncOpenAI(base_url="http://127.0.0.1:8000/v1", api_key="none", max_retries=0, timeout=timeout_s)
    first = asyncio.Event()

    async def one() -> str:
        parts: list[str] = []
        stream = await client.chat.completions.create(
            model=MODEL, messages=CHAT, max_tokens=STREAM_TOKENS, temperature=0, stream=True
        )
        async for chunk in stream:
            if chunk.choices and chunk.choices[0].delta.content:
                parts.append(chunk.choices[0].delta.content)
                first.set()
        return "".join(parts)

    tasks = [asyncio.create_task(one()) for _ in range(n)]
    if fault is not None:
        await asyncio.wait_for(first.wait(), timeout_s)
        assert not any(t.done() for t in tasks), "a stream ended before the fault: nothing would be in flight"
        fault()
    try:
        return list(await asyncio.gather(*tasks, return_exceptions=True))
    finally:
        await client.close()


def project_leftovers(label: str, value: str) -> dict[str, list[str]]:
    """What Docker still holds of a project (containers, exited ones too; networks; volumes)."""
    found = {}
    for kind, cmd in (
        ("containers", ("ps", "-aq")),
        ("networks", ("network", "ls", "-q")),
        ("volumes", ("volume", "ls", "-q")),
    ):
        ids = run("docker", *cmd, "--filter", f"label={label}={value}").stdout.split()
        if ids:
            found[kind] = ids
    return found
