"""The chaos suite's harness: replay a burst of the Azure code trace against a mesh, inject one
fault at a chosen moment of a scale-out, and check that nothing was lost.

A test builds a `ChaosMesh` (real processes: parameter manager, global manager, gateway, workers
on the `tiny` model with emulated accelerator pacing and emulated links slow enough that a load
takes a couple of seconds), then calls `run_chaos` with the fault as a coroutine. `run_chaos`:

1. starts the burst (open loop, `blitzmesh.replay`) and a watch on the cluster's events;
2. scales out by `scale_by` instances through the admin API once the burst is under way, so a
   multicast chain is in flight;
3. waits for the moment the fault needs (by default: the scale-out's `transfer_plan` event,
   i.e. parameters are moving) and injects it;
4. waits for the burst to end (each request has a deadline) and for the cluster to be healthy
   again: every worker process alive is registered, none LOADING or DRAINING, the model has a
   SERVING instance and a probe completion succeeds. `recovery_s` is the time from the fault to
   that point;
5. writes one row to its results file (`results_path()`: `bench/results/chaos.json` only under
   `python -m bench.chaos`, a scratch file otherwise) and returns the `ChaosOutcome` for the test
   to assert on.

The same run has two topologies (`Topology`): the 4-worker chaos mesh (2 SERVING, 2 IDLE,
autoscaling off: step 2 is the admin API's scale-out), and the default topology of `make up`
(1 SERVING, 2 IDLE, autoscaling on: long streams added to the burst set the autoscaler off, and
the fault lands in the scale-out it starts; rows are named `default_topology_<fault>`).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import math
import os
import tempfile
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import blitzmesh
from blitzmesh.replay import TokenScaling, TraceWindow, from_trace, read_azure_trace, replay
from blitzmesh.replay.schedule import Arrival
from services.mesh.launcher import Mesh

REPO_ROOT = Path(__file__).resolve().parents[2]
TRACE = REPO_ROOT / "traces" / "azure_llm_2023_code.csv"
# The committed results file: only `python -m bench.chaos` writes it (through RESULTS_ENV); a test
# run of its own (`make test`) writes to a scratch file, so it leaves the tree as it found it.
RESULTS = REPO_ROOT / "bench" / "results" / "chaos.json"
RESULTS_ENV = "BLITZMESH_CHAOS_RESULTS"


def results_path() -> Path:
    """Where the chaos tests' rows go: the file named by `RESULTS_ENV`, else a scratch file."""
    explicit = os.environ.get(RESULTS_ENV)
    if explicit:
        return Path(explicit)
    return Path(tempfile.gettempdir()) / f"blitzmesh-chaos-{os.getuid()}" / "chaos.json"


MODEL = "tiny"
REQUEST_TIMEOUT_S = 60.0


@dataclass(frozen=True)
class Topology:
    """Where a fault is injected, and how the scale-out it lands in starts."""

    name: str
    row_prefix: str  # of the fault's row in chaos.json
    admin_scale_by: int  # the scale-out run_chaos asks for through the admin API (0: the autoscaler's own)
    load_streams: int  # long requests at the burst's start that set the autoscaler off
    plan_timeout_s: float  # how long the scale-out's transfer plan may take to appear


FOUR = Topology("four", "", admin_scale_by=2, load_streams=0, plan_timeout_s=30.0)
DEFAULT = Topology("default", "default_topology_", admin_scale_by=0, load_streams=16, plan_timeout_s=60.0)
TOPOLOGIES = {t.name: t for t in (FOUR, DEFAULT)}
LOAD_STREAM_TOKENS = 400  # with a 16-token prompt, inside the tiny model's 512-token context


def code_trace_burst(span_s: float = 12.0, max_requests: int = 60) -> list[Arrival]:
    """The busiest stretch of the Azure code trace: `span_s` seconds starting at its busiest
    10 s window, prompts scaled to the tiny model (1/32, at most 256 tokens), outputs kept
    short as the trace's are (at most 24 tokens). Falls back to nothing if the trace is absent
    (the caller skips)."""
    rows = read_azure_trace(TRACE)
    times = sorted(r.t_s for r in rows)
    best_start, best_n, j = 0.0, 0, 0
    for i, t in enumerate(times):
        while times[j] < t - 10.0:
            j += 1
        if i - j + 1 > best_n:
            best_n, best_start = i - j + 1, times[j]
    scaling = TokenScaling(prompt_scale=1 / 32, max_prompt_tokens=256, max_output_tokens=24, context_tokens=512)
    return from_trace(rows, TraceWindow(start_s=best_start, span_s=span_s), scaling, max_requests=max_requests)


@dataclass
class ChaosOutcome:
    fault: str
    requests: int
    completed: int
    errors: int
    lost: int
    hung: int
    migrated: int
    recovery_s: float
    error_messages: list[str] = field(default_factory=list)
    events: list[dict[str, Any]] = field(default_factory=list)
    notes: dict[str, Any] = field(default_factory=dict)
    final_states: dict[str, str] = field(default_factory=dict)  # instance id -> state once healthy
    victims: tuple[str, ...] = ()  # instances the fault itself killed or hung

    @property
    def rolled_back(self) -> list[str]:
        """Instances whose scale-out was rolled back, other than the fault's own victims (a
        killed target's load failing is the fault, not a rollback the fault caused)."""
        return sorted(
            {
                e["instance_id"]
                for e in self.events
                if e["action"] == "scale_out" and e["status"] == "rolled_back" and e["instance_id"] not in self.victims
            }
        )

    def row(self) -> dict[str, Any]:
        """The fault's row: the counts, then its notes (a note cannot overwrite a count)."""
        counts = {
            "fault": self.fault,
            "requests": self.requests,
            "completed": self.completed,
            "migrated": self.migrated,
            "errors": self.errors,
            "lost": self.lost,
            "hung": self.hung,
            "recovery_s": round(self.recovery_s, 2),
            "rolled_back": len(self.rolled_back),
        }
        return {**counts, **{k: v for k, v in self.notes.items() if k not in counts}}

    def unresolved_scale_outs(self) -> list[str]:
        """Instances a scale-out started loading that neither served nor were rolled back: no
        load_result or rollback event, and not SERVING or IDLE at the end (an event can be
        missed while the gateway that carries the watch restarts)."""
        started = {e["instance_id"] for e in self.events if e["action"] == "scale_out" and e["status"] == "loading"}
        ended = {
            e["instance_id"]
            for e in self.events
            if e["action"] == "load_result" or (e["action"] == "scale_out" and e["status"] == "rolled_back")
        }
        settled = {iid for iid, state in self.final_states.items() if state in ("serving", "idle")}
        return sorted(started - ended - settled)


def write_row(row: dict[str, Any], path: Path | None = None) -> None:
    """Replace this fault's row in the results file (`results_path()` by default; rows sorted by fault)."""
    path = path or results_path()
    data: dict[str, Any] = {"rows": []}
    if path.exists():
        with contextlib.suppress(ValueError):
            data = json.loads(path.read_text())
    rows = [r for r in data.get("rows", []) if r.get("fault") != row["fault"]]
    rows.append({**row, "at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())})
    data["rows"] = sorted(rows, key=lambda r: r["fault"])
    data["about"] = (
        "tests/chaos: one row per fault; a burst of the Azure code trace against a real mesh (tiny model, "
        "EMULATED accelerator pacing and links), the fault injected during a scale-out"
    )
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data, indent=2) + "\n")


async def gateway_counter(mesh: Mesh, name: str) -> float:
    """Sum of a gateway counter's samples, from its /metrics page (0 if absent)."""
    import aiohttp

    total = 0.0
    async with aiohttp.ClientSession() as s, s.get(f"{mesh.gateway_http}/metrics") as resp:
        for line in (await resp.text()).splitlines():
            if line.startswith(name + "_total") or line.startswith(name + "{") or line.startswith(name + " "):
                with contextlib.suppress(ValueError, IndexError):
                    total += float(line.rsplit(" ", 1)[1])
    return total


async def wait_event(
    events: list[dict[str, Any]], match: Callable[[dict[str, Any]], bool], timeout_s: float, what: str
) -> dict[str, Any]:
    """The first event in `events` (filled by the watcher) that `match`es, waiting up to `timeout_s`."""
    deadline = time.monotonic() + timeout_s
    while True:
        for e in events:
            if match(e):
                return e
        if time.monotonic() > deadline:
            raise TimeoutError(f"no {what} within {timeout_s}s; events: {[(e['action'], e['status']) for e in events]}")
        await asyncio.sleep(0.02)


async def healthy(mesh: Mesh, client: blitzmesh.AsyncClient) -> bool:
    """Every live worker process registered and settled (none LOADING or DRAINING), a SERVING
    instance of the model, and a probe completion answered."""
    try:
        cluster = await client.cluster(timeout_s=5)
    except blitzmesh.BlitzmeshError:
        return False
    alive = {n for n, p in mesh.procs.items() if n.startswith("worker") and p.process.returncode is None}
    states = {i.instance_id: i.state for i in cluster.instances}
    if not alive <= set(states) or any(states[w] in ("loading", "draining", "lost") for w in alive):
        return False
    if not any(i.state == "serving" and i.model_id == MODEL for i in cluster.instances):
        return False
    try:
        done = await client.complete("probe", model=MODEL, max_tokens=2, timeout_s=10)
    except blitzmesh.BlitzmeshError:
        return False
    return done.finish_reason in ("stop", "length")


Fault = Callable[[Mesh, list[dict[str, Any]]], Awaitable[dict[str, Any] | None]]


def with_load_streams(arrivals: list[Arrival], n: int) -> list[Arrival]:
    """`arrivals` with `n` long requests at their start (the default topology's one SERVING
    instance then holds more than the autoscaler's target per instance)."""
    first = max((a.index for a in arrivals), default=-1) + 1
    t0 = arrivals[0].t_s if arrivals else 0.0
    extra = [Arrival(first + i, t0, 16, LOAD_STREAM_TOKENS) for i in range(n)]
    return [*extra, *arrivals]


async def run_chaos(
    mesh: Mesh,
    fault_name: str,
    fault: Fault,
    *,
    arrivals: list[Arrival],
    topology: Topology = FOUR,
    when: Callable[[dict[str, Any]], bool] | None = None,
    recovery_timeout_s: float = 90.0,
    victims: Callable[[], tuple[str, ...]] = tuple,
) -> ChaosOutcome:
    """Replay `arrivals`, start the topology's scale-out, inject `fault` when an event matches
    `when` (default: the scale-out's `transfer_plan`), and measure the aftermath. `victims`
    names, once the fault has run, the instances it killed or hung."""
    arrivals = with_load_streams(arrivals, topology.load_streams)
    fault_name = topology.row_prefix + fault_name
    events: list[dict[str, Any]] = []
    clock0 = time.monotonic()
    async with blitzmesh.AsyncClient(mesh.gateway_grpc, timeout_s=30) as client:

        async def watch() -> None:
            while True:  # a restarted gateway ends the stream: watch again (events meanwhile are missed)
                with contextlib.suppress(blitzmesh.BlitzmeshError):
                    async for ev in client.watch_events():
                        events.append(
                            {
                                "t_s": round(time.monotonic() - clock0, 3),
                                "action": ev.action,
                                "status": ev.status,
                                "instance_id": ev.instance_id,
                                "target": ev.target,
                                "reason": ev.reason,
                            }
                        )
                await asyncio.sleep(0.2)

        migrated_before = await gateway_counter(mesh, "blitzmesh_gateway_migrations")
        retried_before = await gateway_counter(mesh, "blitzmesh_gateway_retries")
        watcher = asyncio.create_task(watch())
        await asyncio.sleep(0)
        traffic = asyncio.create_task(
            replay(
                arrivals,
                http_url=mesh.gateway_http,
                model=MODEL,
                request_timeout_s=REQUEST_TIMEOUT_S,
                drain_timeout_s=REQUEST_TIMEOUT_S,
                vocab_size=2048,
            )
        )
        try:
            # The scale-out starts once the burst is under way: a chosen moment, the quarter of
            # the burst's arrivals (at most 1 s in), not a wait for a condition.
            await asyncio.sleep(min(1.0, arrivals[len(arrivals) // 4].t_s if arrivals else 0.0))
            scaling = asyncio.create_task(
                client.scale(MODEL, topology.admin_scale_by, wait=True, timeout_s=120)
                if topology.admin_scale_by
                else asyncio.sleep(0)  # the autoscaler's scale-out: nothing to ask for
            )
            await wait_event(
                events,
                when or (lambda e: e["action"] == "transfer_plan"),
                topology.plan_timeout_s,
                "moment for the fault",
            )
            fault_at = time.monotonic()
            notes = await fault(mesh, events) or {}
            result = await traffic
            with contextlib.suppress(blitzmesh.BlitzmeshError):
                await scaling  # its instances served or failed; a failure is the fault's doing
            deadline = time.monotonic() + recovery_timeout_s
            while not await healthy(mesh, client):
                if time.monotonic() > deadline:
                    raise TimeoutError(f"cluster not healthy {recovery_timeout_s}s after {fault_name}")
                await asyncio.sleep(0.2)
            recovery_s = time.monotonic() - fault_at
            final_states = {i.instance_id: i.state for i in (await client.cluster()).instances}
        finally:
            traffic.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await traffic
        watcher.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await watcher
        migrated = await gateway_counter(mesh, "blitzmesh_gateway_migrations") - migrated_before
        retried = await gateway_counter(mesh, "blitzmesh_gateway_retries") - retried_before
    records = result.records
    hung = sum(
        1
        for r in records
        if r.outcome == "lost"
        or (r.end_s is not None and not math.isnan(r.sent_s) and r.end_s - r.sent_s > REQUEST_TIMEOUT_S)
    )
    outcome = ChaosOutcome(
        fault=fault_name,
        requests=len(records),
        completed=sum(r.outcome == "ok" for r in records),
        errors=sum(r.outcome == "error" for r in records),
        lost=sum(r.outcome == "lost" for r in records),
        hung=hung,
        # A restarted gateway starts its counters afresh: count from zero then.
        migrated=round(max(0.0, migrated) + max(0.0, retried)),
        recovery_s=recovery_s,
        error_messages=sorted({r.error for r in records if r.outcome == "error"}),
        events=events,
        notes=notes,
        final_states=final_states,
        victims=victims(),
    )
    write_row(outcome.row())
    return outcome
