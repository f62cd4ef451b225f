"""Part 4 of the data-plane benchmark: host memory of the O(1) parameter pool against a
per-host cache (ServerlessLLM's way: every host caches the whole model), for H hosts.

Both are measured with real `services.param_manager` processes on a synthetic checkpoint,
launched as the mesh launches them (`services.mesh.launcher.Mesh.spawn`):
- O(1) pool, H hosts: the index process (`--cache-slots H`, holds shard 0) plus H-1 host
  caches (`--index ADDR --cache-slot k`), each holding its shard;
- per-host cache, H hosts: H independent index processes with `--cache-slots 1`, each holding
  the whole model, as a per-host cache would.
For every process we read the bytes it reports holding (its `blitzmesh_param_host_bytes`
gauge, from its /metrics endpoint) and its anonymous resident memory (RssAnon in
/proc/PID/status), minus the RssAnon of an idle parameter manager that holds no model (the
same program with an empty model directory): "RSS growth".
"""

from __future__ import annotations

import asyncio
import contextlib
import re
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Any

from services.common.waiting import wait_for
from services.mesh.launcher import Mesh, MeshConfig, Proc

MODULE = "services.param_manager"


def proc_status_kib(pid: int) -> dict[str, int]:
    """VmRSS, RssAnon, RssFile, VmHWM of a process, in KiB (from /proc/PID/status)."""
    out: dict[str, int] = {}
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        key, _, value = line.partition(":")
        if key in ("VmRSS", "RssAnon", "RssFile", "VmHWM"):
            out[key] = int(value.split()[0])
    return out


def reported_host_bytes(metrics_text: str) -> int:
    """The value of the blitzmesh_param_host_bytes gauge in a Prometheus text exposition."""
    m = re.search(r"^blitzmesh_param_host_bytes\s+([0-9.eE+-]+)\s*$", metrics_text, re.MULTILINE)
    if m is None:
        raise ValueError("no blitzmesh_param_host_bytes sample in the metrics text")
    return int(float(m.group(1)))


def _scrape(proc: Proc) -> int:
    port = proc.ports["metrics_port"]
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as resp:
        return reported_host_bytes(resp.read().decode())


def _common(model_dir: Path) -> list[str]:
    # TCP data plane: these processes serve but move nothing here; UCX would only add its context.
    return ["--model-dir", str(model_dir), "--dataplane", "tcp", "--metrics-port", "0", "--log-level", "warning"]


async def _measure(mesh: Mesh, procs: list[Proc]) -> list[dict[str, Any]]:
    await asyncio.sleep(0.5)  # let freed pages go back after the last allocation
    rows = []
    for p in procs:
        status = proc_status_kib(p.process.pid)
        rows.append(
            {
                "name": p.name,
                "pid": p.process.pid,
                "reported_bytes": await asyncio.to_thread(_scrape, p),
                "rss_anon_bytes": status["RssAnon"] * 1024,
                "rss_bytes": status["VmRSS"] * 1024,
                "peak_rss_bytes": status["VmHWM"] * 1024,
            }
        )
    return rows


async def _o1_pool(mesh: Mesh, model_dir: Path, h: int, timeout_s: float) -> list[dict[str, Any]]:
    index = await mesh.spawn(
        f"o1-H{h}-index", MODULE, [*_common(model_dir), "--cache-slots", str(h), "--topology-host", "host-0"]
    )
    await mesh.wait_ready(index, timeout_s)
    caches = [
        await mesh.spawn(
            f"o1-H{h}-cache{k}",
            MODULE,
            [
                *_common(model_dir),
                "--index",
                index.grpc_address,
                "--cache-slot",
                str(k),
                "--topology-host",
                f"host-{k}",
            ],
        )
        for k in range(1, h)
    ]
    await asyncio.gather(*(mesh.wait_ready(c, timeout_s) for c in caches))
    return await _measure(mesh, [index, *caches])


async def _per_host(mesh: Mesh, model_dir: Path, h: int, timeout_s: float) -> list[dict[str, Any]]:
    procs = [
        await mesh.spawn(
            f"perhost-H{h}-host{k}", MODULE, [*_common(model_dir), "--cache-slots", "1", "--topology-host", f"host-{k}"]
        )
        for k in range(h)
    ]
    await asyncio.gather(*(mesh.wait_ready(p, timeout_s) for p in procs))
    return await _measure(mesh, procs)


async def _baseline(mesh: Mesh, empty_dir: Path, timeout_s: float) -> dict[str, Any]:
    proc = await mesh.spawn("baseline-empty", MODULE, [*_common(empty_dir), "--cache-slots", "1"])
    await mesh.wait_ready(proc, timeout_s)
    return (await _measure(mesh, [proc]))[0]


async def _stop(mesh: Mesh, timeout_s: float = 10.0) -> None:
    """SIGTERM every process of `mesh`, SIGKILL what is left after `timeout_s` (Mesh.stop only
    signals the service names of a mesh)."""
    live = [p.process for p in mesh.procs.values() if p.process.returncode is None]
    for proc in live:
        with contextlib.suppress(ProcessLookupError):
            proc.terminate()
    for proc in live:
        try:
            await wait_for(proc.wait(), timeout_s)
        except TimeoutError:
            with contextlib.suppress(ProcessLookupError):
                proc.kill()
            await proc.wait()


async def _run(model_dir: Path, hosts: list[int], timeout_s: float) -> dict[str, Any]:
    with tempfile.TemporaryDirectory(prefix="bmdp-hostmem-") as tmp:
        run_dir = Path(tmp)
        empty = run_dir / "empty-models"
        empty.mkdir()

        async def stage(fn: Any, *args: Any) -> Any:
            # A fresh Mesh per stage: its stop() ends exactly the processes of that stage.
            mesh = Mesh(MeshConfig(run_dir=run_dir / "logs", log_to_files=True))
            try:
                return await fn(mesh, *args)
            finally:
                await _stop(mesh)

        base = await stage(_baseline, empty, timeout_s)
        o1: dict[str, list[dict[str, Any]]] = {}
        per_host: dict[str, list[dict[str, Any]]] = {}
        for h in hosts:
            # Both layouts of one H side by side (separate processes; each one's memory is its own).
            o1[str(h)], per_host[str(h)] = await asyncio.gather(
                stage(_o1_pool, model_dir, h, timeout_s), stage(_per_host, model_dir, h, timeout_s)
            )
        return {"baseline": base, "o1": o1, "per_host": per_host}


def measure_host_memory(model_dir: Path, hosts: list[int], timeout_s: float = 300.0) -> dict[str, Any]:
    """Run the pools for every H in `hosts`; sums per H, and every process's own figures.
    `model_dir` must hold exactly the one model to measure. The model's bytes are what one
    whole-model cache reports holding (the pool's packed layout)."""
    started = time.monotonic()
    raw = asyncio.run(_run(model_dir, hosts, timeout_s))
    base_anon = raw["baseline"]["rss_anon_bytes"]
    model_bytes = raw["per_host"][str(hosts[0])][0]["reported_bytes"]

    def sums(kind: str, field: str) -> dict[str, int]:
        return {h: sum(r[field] for r in rows) for h, rows in raw[kind].items()}

    def growth(kind: str) -> dict[str, int]:
        return {h: sum(r["rss_anon_bytes"] - base_anon for r in rows) for h, rows in raw[kind].items()}

    return {
        "model_bytes": model_bytes,
        "host_bytes_o1": sums("o1", "reported_bytes"),
        "host_bytes_per_host": sums("per_host", "reported_bytes"),
        "host_bytes_per_host_computed": {str(h): h * model_bytes for h in hosts},
        "host_rss_growth_o1": growth("o1"),
        "host_rss_growth_per_host": growth("per_host"),
        "baseline_rss_anon_bytes": base_anon,
        "processes": {"o1": raw["o1"], "per_host": raw["per_host"], "baseline": raw["baseline"]},
        "elapsed_s": round(time.monotonic() - started, 1),
    }
