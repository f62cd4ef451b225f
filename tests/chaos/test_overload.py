"""Overload during a scale-out under a burst of the Azure code trace: a slow consumer reading
one token a second, and a flood of 10x the gateway's max_concurrency.

Both assert no request lost or hung, the gateway's memory bounded, and (flood) only 429s for
what is refused, never a 5xx.
"""

from __future__ import annotations

import asyncio
import json
import time
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from services.mesh.launcher import Mesh
from tests.chaos.harness import MODEL, code_trace_burst, run_chaos

pytestmark = pytest.mark.asyncio(loop_scope="function")

MAX_CONCURRENCY = 8
MAX_QUEUE = 16


def rss_bytes(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError(f"no VmRSS for pid {pid}")


async def test_slow_consumer_is_bounded_and_harms_no_other_stream(chaos_mesh: Mesh) -> None:
    """A client reads its stream one event a second, then leaves: the other requests of the
    burst all complete, the gateway's memory stays bounded, and the slow request's work stops
    once its client has gone."""
    gateway_pid = chaos_mesh.procs["gateway"].process.pid
    before = rss_bytes(gateway_pid)
    slow_events: list[str] = []

    async def slow_reader() -> None:
        body = {"model": MODEL, "prompt": "tell me everything", "max_tokens": 400, "stream": True, "ignore_eos": True}
        async with (
            aiohttp.ClientSession(read_bufsize=1024) as s,
            s.post(f"{chaos_mesh.gateway_http}/v1/completions", json=body) as resp,
        ):
            assert resp.status == 200
            async for line in resp.content:
                if line.strip():
                    slow_events.append(line.decode())
                if len(slow_events) >= 8:
                    return  # the client gives up and closes the connection
                await asyncio.sleep(1.0)

    reader: asyncio.Task[None] | None = None

    async def fault(mesh: Mesh, events: list[dict[str, Any]]) -> dict[str, Any]:
        nonlocal reader
        reader = asyncio.create_task(slow_reader())
        return {"slow_consumer": "1 event/s, 8 events, then gone"}

    out = await run_chaos(chaos_mesh, "slow_consumer", fault, arrivals=code_trace_burst())
    assert reader is not None
    await asyncio.wait_for(reader, 60)
    assert out.lost == 0 and out.hung == 0 and out.errors == 0, out.row()
    assert len(slow_events) == 8
    growth = rss_bytes(gateway_pid) - before
    assert growth < 64 * 1024 * 1024, f"gateway grew {growth / 1e6:.1f} MB"


@pytest.mark.parametrize(
    "chaos_mesh",
    [{"gateway_args": ["--max-concurrency", str(MAX_CONCURRENCY), "--max-queue", str(MAX_QUEUE)]}],
    indirect=True,
)
async def test_flood_gets_429s_never_5xx(chaos_mesh: Mesh) -> None:
    """10x max_concurrency requests at once on top of the burst: what the gateway cannot take
    gets a 429 with a reason, never a 5xx; everything it took completes; memory stays bounded."""
    gateway_pid = chaos_mesh.procs["gateway"].process.pid
    before = rss_bytes(gateway_pid)
    statuses: list[int] = []
    bodies: list[str] = []
    flood: asyncio.Task[Any] | None = None

    async def one(s: aiohttp.ClientSession, i: int) -> None:
        body = {"model": MODEL, "prompt": f"flood {i}", "max_tokens": 8}
        async with s.post(f"{chaos_mesh.gateway_http}/v1/completions", json=body) as resp:
            statuses.append(resp.status)
            text = await resp.text()
            if resp.status != 200:
                bodies.append(text)
            else:
                assert json.loads(text)["choices"][0]["finish_reason"] in ("stop", "length")

    async def flood_all() -> None:
        conn = aiohttp.TCPConnector(limit=0)
        async with aiohttp.ClientSession(connector=conn) as s:
            await asyncio.gather(*(one(s, i) for i in range(10 * MAX_CONCURRENCY)))

    async def fault(mesh: Mesh, events: list[dict[str, Any]]) -> dict[str, Any]:
        nonlocal flood
        flood = asyncio.create_task(flood_all())
        return {"flood": 10 * MAX_CONCURRENCY}

    started = time.monotonic()
    out = await run_chaos(chaos_mesh, "flood_10x_max_concurrency", fault, arrivals=code_trace_burst())
    assert flood is not None
    await asyncio.wait_for(flood, 120)
    assert len(statuses) == 10 * MAX_CONCURRENCY
    assert set(statuses) <= {200, 429}, sorted(set(statuses))
    assert 429 in statuses and 200 in statuses
    assert all("overloaded" in b or "queue" in b for b in bodies), bodies[:3]
    # The burst's own requests: completed, or refused with a 429 (clear, retryable), never lost.
    assert out.lost == 0 and out.hung == 0, out.row()
    assert all("429" in m for m in out.error_messages), out.error_messages
    growth = rss_bytes(gateway_pid) - before
    assert growth < 128 * 1024 * 1024, f"gateway grew {growth / 1e6:.1f} MB in {time.monotonic() - started:.0f} s"
