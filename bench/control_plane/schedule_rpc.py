"""Per-request `GlobalManager.Schedule` overhead through real gRPC.

A global manager runs as its own process (as in the mesh); this process registers N fake
SERVING instances, heartbeats each once with a random load, then times sequential Schedule
calls on one channel, the way the gateway asks for a route per request.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import random
import statistics
import sys
import tempfile
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import grpc

from blitzmesh.v1 import common_pb2, global_manager_pb2, global_manager_pb2_grpc
from services.common.server import wait_for_serving
from services.mesh.launcher import child_env

MODEL = "m"
NUM_LAYERS = 32


@contextlib.asynccontextmanager
async def manager_process() -> AsyncIterator[str]:
    """A `python -m services.global_manager` child on a free port; yields its address."""
    with tempfile.TemporaryDirectory() as tmp:
        port_file = Path(tmp) / "gm.ports.json"
        proc = await asyncio.create_subprocess_exec(
            sys.executable,
            "-m",
            "services.global_manager",
            "--port",
            "0",
            "--port-file",
            str(port_file),
            # Fake instances heartbeat once; they must not be written off mid-measurement.
            "--lost-after-s",
            "3600",
            # Plaintext: one client here plays both the workers (RegisterInstance) and the gateway
            # (Schedule), which under mTLS are two roles (docs/security.md).
            "--insecure",
            "--log-level",
            "warning",
            stdout=asyncio.subprocess.DEVNULL,
            stderr=asyncio.subprocess.DEVNULL,
            env=child_env(),
        )
        try:
            async with asyncio.timeout(60):
                while not port_file.exists():
                    if proc.returncode is not None:
                        raise RuntimeError(f"global manager exited with {proc.returncode}")
                    await asyncio.sleep(0.05)
            address = f"127.0.0.1:{json.loads(port_file.read_text())['grpc_port']}"
            await wait_for_serving(address, 30)
            yield address
        finally:
            with contextlib.suppress(ProcessLookupError):
                proc.terminate()
            await proc.wait()


async def _register(stub: global_manager_pb2_grpc.GlobalManagerStub, n: int, rng: random.Random) -> None:
    for i in range(n):
        iid = f"i{i}"
        await stub.RegisterInstance(
            global_manager_pb2.RegisterInstanceRequest(
                instance=common_pb2.InstanceInfo(
                    instance_id=iid,
                    address=f"10.0.{i // 250}.{i % 250}:50051",
                    host=f"h{i // 8}",
                    model_id=MODEL,
                    state=common_pb2.INSTANCE_STATE_SERVING,
                    role=common_pb2.INSTANCE_ROLE_COLOCATED,
                    layers_loaded=NUM_LAYERS,
                    num_layers=NUM_LAYERS,
                )
            ),
            timeout=10,
        )
        load = common_pb2.LoadReport(
            running=rng.randrange(0, 32),
            waiting=rng.randrange(0, 4),
            kv_blocks_used=rng.randrange(0, 1000),
            kv_blocks_total=1000,
        )
        await stub.Heartbeat(
            global_manager_pb2.HeartbeatRequest(
                instance_id=iid,
                state=common_pb2.INSTANCE_STATE_SERVING,
                model_id=MODEL,
                layers_loaded=NUM_LAYERS,
                num_layers=NUM_LAYERS,
                load=load,
            ),
            timeout=10,
        )


def _pct(sorted_ms: list[float], q: float) -> float:
    return sorted_ms[min(len(sorted_ms) - 1, max(0, int(round(q * len(sorted_ms) + 0.5)) - 1))]


async def measure(n_instances: int, calls: int, warmup: int = 200, seed: int = 0) -> dict[str, Any]:
    """Schedule round-trip times in ms over `calls` sequential calls against N instances."""
    rng = random.Random(seed)
    async with manager_process() as address, grpc.aio.insecure_channel(address) as ch:
        stub = global_manager_pb2_grpc.GlobalManagerStub(ch)
        await _register(stub, n_instances, rng)
        samples: list[float] = []
        for k in range(warmup + calls):
            req = global_manager_pb2.ScheduleRequest(
                request_id=f"r{k}", model_id=MODEL, prompt_tokens=rng.randrange(8, 512)
            )
            start = time.perf_counter()
            route = await stub.Schedule(req, timeout=5)
            elapsed_ms = (time.perf_counter() - start) * 1e3
            if not route.hops:
                raise RuntimeError(f"Schedule returned an empty route for {req.request_id}")
            if k >= warmup:
                samples.append(elapsed_ms)
    samples.sort()
    return {
        "p50": round(_pct(samples, 0.50), 4),
        "p99": round(_pct(samples, 0.99), 4),
        "mean": round(statistics.fmean(samples), 4),
        "max": round(samples[-1], 4),
        "calls": calls,
    }


def run(sizes: tuple[int, ...], calls: int) -> dict[str, Any]:
    by_n = {n: asyncio.run(measure(n, calls)) for n in sizes}
    return by_n
