"""The chaos suite's fault kinds: one definition each, injected in either topology.

A `FaultKind` says how to inject one fault into a running mesh (`inject`), what to set up
before the burst (`prepare`), what to check after it on top of "nothing lost, no rollback"
(`check`), and which MeshConfig fields it needs (`mesh`, e.g. the gateway's limits for the
flood). The victim is chosen from the topology: in the 4-worker mesh a SERVING bystander (an
instance that does not feed the scale-out's chain) stays; in the default topology of `make up`
the only SERVING instance is the one that breaks, and the chain is the autoscaler's scale-out.

Every injection asserts that it fired (the process died with the signal sent, was seen stopped,
the corruption was logged, the flood was refused with 429s); a fault that did not land is a
failed test, never a row.
"""

from __future__ import annotations

import asyncio
import json
import signal
import time
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp

import blitzmesh
from services.common.waiting import wait_until
from services.mesh.launcher import Mesh
from tests.chaos.harness import (
    DEFAULT,
    MODEL,
    ChaosOutcome,
    Topology,
    code_trace_burst,
    run_chaos,
    wait_event,
    write_row,
)

HANG_S = 4.0  # a hung (SIGSTOPped) manager, gateway or host cache: under the manager's 5 s lost_after_s
EXIT_TIMEOUT_S = 60.0  # a SIGTERMed worker drains (its streams end or move) and exits within this
MAX_CONCURRENCY = 8  # the gateway's limits in the flood
MAX_QUEUE = 16


@dataclass
class FaultRun:
    """One fault in one mesh: the events the harness watches, the instances the fault killed or
    hung, and what `prepare` left for `check`."""

    mesh: Mesh
    topology: Topology
    events: list[dict[str, Any]] = field(default_factory=list)
    victims: list[str] = field(default_factory=list)
    state: dict[str, Any] = field(default_factory=dict)


Step = Callable[[FaultRun], Awaitable[None]]


@dataclass(frozen=True)
class FaultKind:
    name: str
    inject: Callable[[FaultRun], Awaitable[dict[str, Any]]]
    prepare: Step | None = None
    check: Callable[[FaultRun, ChaosOutcome], Awaitable[None]] | None = None
    mesh: Mapping[str, Any] = field(default_factory=dict)  # chaos_config keywords
    ci: frozenset[str] = frozenset()  # topologies whose run `make test` keeps
    errors_allowed: bool = False  # the fault's designed answer is an error (429, a dead gateway's streams)


# --- what the scale-out looks like --------------------------------------------------------------


def chains_of(events: list[dict[str, Any]]) -> list[list[str]]:
    """The network chains of the latest transfer plan, each [source, hop, ...], from its reason,
    e.g. "chains: worker-0->worker-2->worker-3 (4 groups)"."""
    plan = [e for e in events if e["action"] == "transfer_plan"][-1]
    return [c.split(" (")[0].strip().split("->") for c in plan["reason"].removeprefix("chains: ").split(";")]


def chain_of(events: list[dict[str, Any]], min_hops: int = 1) -> tuple[str, list[str]]:
    """(source, hops) of the first chain with at least `min_hops` hops."""
    chains = chains_of(events)
    for source, *hops in chains:
        if len(hops) >= min_hops:
            return source, hops
    raise AssertionError(f"no chain of {min_hops} hops in the plan: {chains}")


def proc_name(node_id: str) -> str:
    """The launcher's process name of a plan's node id (host caches are named by slot)."""
    if node_id.startswith("host-cache-"):
        slot = int(node_id.removeprefix("host-cache-"))
        return "param_manager" if slot == 0 else f"host_cache-{slot}"
    return node_id


async def instances(mesh: Mesh) -> list[Any]:
    async with blitzmesh.AsyncClient(mesh.gateway_grpc, timeout_s=10) as client:
        return list((await client.cluster()).instances)


async def wait_mid_transfer(mesh: Mesh, instance_id: str, timeout_s: float = 30.0) -> None:
    """Until `instance_id` is LOADING (after the plan: its pulls are under way), failing if it
    is SERVING first. Not "some layers in": the chaos model's two layers are small beside its
    embedding and head (0.7 MB each against 1 MB), they land together about 2.1 s into a ~3 s
    load, and a busy 2-core box then polled past the remaining 0.8 s (CI, stop 33)."""

    async def moving() -> bool:
        inst = next((i for i in await instances(mesh) if i.instance_id == instance_id), None)
        if inst is not None and inst.state == "serving":
            raise AssertionError(f"{instance_id} finished loading before the fault could land")
        return inst is not None and inst.state == "loading"

    await wait_until(moving, timeout_s, interval_s=0.02, what=f"{instance_id} mid-transfer")


async def serving_victim(run: FaultRun) -> str:
    """The SERVING instance a worker fault hits: in the 4-worker mesh the busiest one that does
    not feed the chain (a bystander); in the default topology the only SERVING one (the chain's
    source, when a worker feeds it)."""
    source, _ = chain_of(run.events)
    serving = [i for i in await instances(run.mesh) if i.state == "serving"]
    if run.topology is not DEFAULT:
        serving = [i for i in serving if i.instance_id != source]
    assert serving, "no SERVING instance to hit"
    return max(serving, key=lambda i: i.load.running).instance_id


# --- injections that prove they fired -----------------------------------------------------------


async def signal_and_wait(run: FaultRun, name: str, sig: int, timeout_s: float = 10.0) -> None:
    """Send `sig` to process `name` and wait until it has exited by it (SIGKILL: returncode -9;
    SIGTERM: the graceful exit, 0)."""
    proc = run.mesh.procs[name].process
    proc.send_signal(sig)
    code = await asyncio.wait_for(proc.wait(), timeout_s)
    expected = (-signal.SIGKILL,) if sig == signal.SIGKILL else (0, -sig)
    assert code in expected, f"{name} exited with {code} after signal {sig}"
    if name.startswith("worker"):
        run.victims.append(name)


async def restarted(run: FaultRun, name: str) -> None:
    """SIGKILL a service and have it back on its ports: restarted here, or by the supervisor
    where the mesh has one (restarting it here too would race it)."""
    old = run.mesh.procs[name]
    if not run.mesh.cfg.supervise:
        await run.mesh.restart(name)
        assert old.process.returncode == -signal.SIGKILL, old.process.returncode
        return
    await signal_and_wait(run, name, signal.SIGKILL)
    new = await wait_until(lambda: run.mesh.procs[name] is not old and run.mesh.procs[name], 30, what=f"{name} back")
    await run.mesh.wait_ready(new, 60)


def stopped(pid: int) -> bool:
    """The process is stopped (state T in /proc/<pid>/stat)."""
    stat = Path(f"/proc/{pid}/stat").read_text()
    return stat[stat.rindex(")") + 2] in "Tt"


async def hang(run: FaultRun, name: str, until: Callable[[], Awaitable[Any]] | None = None) -> float:
    """SIGSTOP `name` (asserting it stopped) until `until` returns, or for HANG_S; then SIGCONT.
    Returns how long it was hung."""
    proc = run.mesh.procs[name].process
    proc.send_signal(signal.SIGSTOP)
    started = time.monotonic()
    try:
        await wait_until(lambda: stopped(proc.pid), 5, what=f"{name} stopped")
        if name.startswith("worker"):
            run.victims.append(name)
        if until is not None:
            await until()
        else:
            await asyncio.sleep(HANG_S)  # the fault's length: a pause of a fixed length, not a wait for a condition
    finally:
        proc.send_signal(signal.SIGCONT)
    return round(time.monotonic() - started, 2)


# --- the kinds ----------------------------------------------------------------------------------


async def worker_sigkill(run: FaultRun) -> dict[str, Any]:
    victim = await serving_victim(run)
    await signal_and_wait(run, victim, signal.SIGKILL)
    return {"killed": victim}


async def worker_sigterm(run: FaultRun) -> dict[str, Any]:
    """A preempted node: SIGTERM, the worker drains (streams end or move) and exits."""
    victim = await serving_victim(run)
    started = time.monotonic()
    await signal_and_wait(run, victim, signal.SIGTERM, EXIT_TIMEOUT_S)
    return {"terminated": victim, "drained_in_s": round(time.monotonic() - started, 2)}


async def worker_sigstop(run: FaultRun) -> dict[str, Any]:
    victim = await serving_victim(run)
    lost_at: list[float] = []

    async def until_lost() -> None:
        lost = await wait_event(
            run.events, lambda e: e["action"] == "instance_lost" and e["instance_id"] == victim, 30.0, "instance_lost"
        )
        lost_at.append(lost["t_s"])

    hung_s = await hang(run, victim, until_lost)
    return {"stopped": victim, "stopped_s": hung_s}


async def chain_hop_sigkill(run: FaultRun) -> dict[str, Any]:
    source, hops = chain_of(run.events, min_hops=2)
    await wait_mid_transfer(run.mesh, hops[0])
    await signal_and_wait(run, hops[0], signal.SIGKILL)
    return {"killed": hops[0], "chain": "->".join([source, *hops])}


async def chain_tail_sigkill(run: FaultRun) -> dict[str, Any]:
    source, hops = chain_of(run.events, min_hops=2)
    await wait_mid_transfer(run.mesh, hops[-1])
    await signal_and_wait(run, hops[-1], signal.SIGKILL)
    return {"killed": hops[-1], "chain": "->".join([source, *hops])}


async def chain_source_killed(run: FaultRun) -> dict[str, Any]:
    source, hops = chain_of(run.events)
    await wait_mid_transfer(run.mesh, hops[0])
    name = proc_name(source)
    if name.startswith("worker"):
        await signal_and_wait(run, name, signal.SIGKILL)
    else:
        await restarted(run, name)  # a parameter host comes back (its shard is on disk)
    return {"killed": name, "chain": "->".join([source, *hops])}


def host_cache_of(run: FaultRun) -> str:
    """The chain's source if a host cache feeds it; else the host cache every load falls back to
    (the 4-worker mesh's second one, the default topology's only one)."""
    source, _ = chain_of(run.events)
    if source.startswith("host-cache-"):
        return proc_name(source)
    return "host_cache-1" if "host_cache-1" in run.mesh.procs else "param_manager"


async def param_host_restarted(run: FaultRun) -> dict[str, Any]:
    _, hops = chain_of(run.events)
    await wait_mid_transfer(run.mesh, hops[0])
    name = host_cache_of(run)
    await restarted(run, name)
    return {"restarted": name, "chain": "->".join(chains_of(run.events)[0])}


async def param_host_sigstop(run: FaultRun) -> dict[str, Any]:
    """A host cache hung mid-multicast (SIGSTOP for HANG_S): loads pulling from it stall, probe
    it, and take another source or carry on once it answers again."""
    _, hops = chain_of(run.events)
    await wait_mid_transfer(run.mesh, hops[0])
    name = host_cache_of(run)
    hung_s = await hang(run, name)
    return {"stopped": name, "stopped_s": hung_s, "chain": "->".join(chains_of(run.events)[0])}


async def global_manager_restarted(run: FaultRun) -> dict[str, Any]:
    _, hops = chain_of(run.events)
    await wait_mid_transfer(run.mesh, hops[0])
    await restarted(run, "global_manager")
    return {"restarted": "global_manager"}


async def global_manager_sigstop(run: FaultRun) -> dict[str, Any]:
    """The manager hung (not dead) mid-scale-out: heartbeats and routes wait on it meanwhile."""
    _, hops = chain_of(run.events)
    await wait_mid_transfer(run.mesh, hops[0])
    return {"stopped": "global_manager", "stopped_s": await hang(run, "global_manager")}


async def gateway_sigstop(run: FaultRun) -> dict[str, Any]:
    """The gateway paused (a long GC pause, a frozen VM) with streams in flight."""
    return {"stopped": "gateway", "stopped_s": await hang(run, "gateway")}


async def two_workers_sigkill(run: FaultRun) -> dict[str, Any]:
    """Two workers at once (a rack's power): the SERVING victim and the chain's first hop."""
    _, hops = chain_of(run.events)
    victim = await serving_victim(run)
    pair = [victim, hops[0] if hops[0] != victim else hops[-1]]
    assert pair[0] != pair[1], pair
    for name in pair:
        run.mesh.procs[name].process.send_signal(signal.SIGKILL)
    for name in pair:
        code = await asyncio.wait_for(run.mesh.procs[name].process.wait(), 10)
        assert code == -signal.SIGKILL, (name, code)
        run.victims.append(name)
    return {"killed": "+".join(pair)}


async def openai_during_restart(run: FaultRun) -> None:
    import openai

    client = openai.AsyncOpenAI(base_url=f"{run.mesh.gateway_http}/v1", api_key="none", max_retries=5)
    done = await client.completions.create(model=MODEL, prompt="during restart", max_tokens=4)
    run.state.setdefault("retried", []).append(done.choices[0].finish_reason)


async def gateway_restarted(run: FaultRun) -> dict[str, Any]:
    """SIGKILL and restart (same ports): the streams it held end with a connection error; the
    `openai` client's own retries carry requests sent while it is down."""
    old = run.mesh.procs["gateway"]
    await signal_and_wait(run, "gateway", signal.SIGKILL)
    clients = asyncio.gather(*(openai_during_restart(run) for _ in range(4)))
    if run.mesh.cfg.supervise:
        new = await wait_until(lambda: run.mesh.procs["gateway"] is not old and run.mesh.procs["gateway"], 30)
        await run.mesh.wait_ready(new, 60)
    else:
        await run.mesh.restart("gateway")
    await asyncio.wait_for(clients, 60)
    return {"restarted": "gateway"}


async def check_gateway_restarted(run: FaultRun, out: ChaosOutcome) -> None:
    connection = ("Connection", "connect", "Payload", "Disconnected", "closed")
    assert all(any(c in m for c in connection) for m in out.error_messages), out.error_messages
    retried = run.state.get("retried", [])
    assert len(retried) == 4 and all(r in ("stop", "length") for r in retried), retried


REFERENCE_PROMPT = "The quick brown fox"


async def reference_text(run: FaultRun) -> None:
    async with blitzmesh.AsyncClient(run.mesh.gateway_grpc, timeout_s=60) as client:
        done = await client.complete(REFERENCE_PROMPT, model=MODEL, max_tokens=8, temperature=0)
    run.state["reference"] = done.text


async def corrupted_chunk(run: FaultRun) -> dict[str, Any]:
    return {"chain": "->".join(chains_of(run.events)[0])}  # the corruption is already on the wire


async def check_corrupted_chunk(run: FaultRun, out: ChaosOutcome) -> None:
    """The corruption fired and was caught by checksum and refetched; every SERVING instance
    answers the text of the instance loaded before."""
    mesh = run.mesh
    logs = "".join(mesh.log_path(n).read_text() for n in mesh.procs if n.startswith("worker"))
    refetches = logs.count("dataplane_checksum_refetch")
    assert "dataplane_fault_corrupted_send" in logs and refetches >= 1, "the corruption was caught and refetched"
    out.notes["refetched_groups"] = refetches
    async with blitzmesh.AsyncClient(mesh.gateway_grpc, timeout_s=60) as client:
        for inst in [i for i in (await client.cluster()).instances if i.state == "serving"]:
            again = await client.complete(REFERENCE_PROMPT, model=MODEL, max_tokens=8, temperature=0)
            assert again.text == run.state["reference"], inst.instance_id


def rss_bytes(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError(f"no VmRSS for pid {pid}")


async def gateway_rss(run: FaultRun) -> None:
    run.state["pid"] = pid = run.mesh.procs["gateway"].process.pid
    run.state["rss"] = rss_bytes(pid)


def gateway_growth(run: FaultRun, limit: int) -> None:
    growth = rss_bytes(run.state["pid"]) - run.state["rss"]
    assert growth < limit, f"gateway grew {growth / 1e6:.1f} MB"


async def slow_consumer(run: FaultRun) -> dict[str, Any]:
    """A client reads its stream one event a second, then leaves after 8."""
    events: list[str] = run.state.setdefault("slow_events", [])

    async def reader() -> None:
        body = {"model": MODEL, "prompt": "tell me everything", "max_tokens": 400, "stream": True, "ignore_eos": True}
        async with (
            aiohttp.ClientSession(read_bufsize=1024) as s,
            s.post(f"{run.mesh.gateway_http}/v1/completions", json=body) as resp,
        ):
            assert resp.status == 200
            async for line in resp.content:
                if line.strip():
                    events.append(line.decode())
                if len(events) >= 8:
                    return  # the client gives up and closes the connection
                await asyncio.sleep(1.0)

    run.state["task"] = asyncio.create_task(reader())
    return {"slow_consumer": "1 event/s, 8 events, then gone"}


async def check_slow_consumer(run: FaultRun, out: ChaosOutcome) -> None:
    await asyncio.wait_for(run.state["task"], 60)
    assert len(run.state["slow_events"]) == 8
    gateway_growth(run, 64 * 1024 * 1024)


async def flood(run: FaultRun) -> dict[str, Any]:
    """10x the gateway's max_concurrency at once on top of the burst."""
    statuses: list[int] = run.state.setdefault("statuses", [])
    bodies: list[str] = run.state.setdefault("bodies", [])

    async def one(s: aiohttp.ClientSession, i: int) -> None:
        body = {"model": MODEL, "prompt": f"flood {i}", "max_tokens": 8}
        async with s.post(f"{run.mesh.gateway_http}/v1/completions", json=body) as resp:
            statuses.append(resp.status)
            text = await resp.text()
            if resp.status != 200:
                bodies.append(text)
            else:
                assert json.loads(text)["choices"][0]["finish_reason"] in ("stop", "length")

    async def all_of_it() -> None:
        async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as s:
            await asyncio.gather(*(one(s, i) for i in range(10 * MAX_CONCURRENCY)))

    run.state["task"] = asyncio.create_task(all_of_it())
    return {"flood": 10 * MAX_CONCURRENCY}


async def check_flood(run: FaultRun, out: ChaosOutcome) -> None:
    """Only 200s and 429s (with the reason) for the flood; the burst's own errors are 429s."""
    await asyncio.wait_for(run.state["task"], 120)
    statuses, bodies = run.state["statuses"], run.state["bodies"]
    assert len(statuses) == 10 * MAX_CONCURRENCY
    assert set(statuses) <= {200, 429}, sorted(set(statuses))
    assert 429 in statuses, sorted(set(statuses))
    if run.topology is not DEFAULT:
        # In the default topology the burst's 16 long requests hold all 8 slots and half the
        # queue for their 400 tokens, so the whole flood may be refused: that is the design.
        assert 200 in statuses, sorted(set(statuses))
    run.state["flood_statuses"] = {str(c): statuses.count(c) for c in sorted(set(statuses))}
    assert all("overloaded" in b or "queue" in b for b in bodies), bodies[:3]
    assert all("429" in m for m in out.error_messages), out.error_messages
    out.notes["flood_statuses"] = run.state["flood_statuses"]
    gateway_growth(run, 128 * 1024 * 1024)


async def check_migrated(run: FaultRun, out: ChaosOutcome) -> None:
    assert out.migrated >= 1, out.row()  # the victim had streams in flight


async def check_targets_serve(run: FaultRun, out: ChaosOutcome) -> None:
    """The chain's targets other than the fault's victims serve at the end."""
    hops = out.notes["chain"].split("->")[1:]
    serving = [h for h in hops if h not in run.victims and out.final_states.get(h) == "serving"]
    assert serving, (hops, out.final_states)
    out.notes["targets_serving"] = f"{len(serving)}/{len([h for h in hops if h not in run.victims])}"


BOTH = frozenset({"four", "default"})
FOUR_ONLY = frozenset({"four"})

FAULTS: tuple[FaultKind, ...] = (
    FaultKind("worker_sigkill_mid_stream", worker_sigkill, check=check_migrated, ci=FOUR_ONLY),
    FaultKind("worker_sigstop", worker_sigstop, check=check_migrated, ci=FOUR_ONLY),
    FaultKind("worker_sigterm_preempted", worker_sigterm),
    FaultKind("two_workers_sigkill", two_workers_sigkill),
    FaultKind("chain_hop_killed", chain_hop_sigkill, check=check_targets_serve, ci=FOUR_ONLY),
    FaultKind("chain_tail_killed", chain_tail_sigkill),
    FaultKind("chain_source_killed", chain_source_killed, check=check_targets_serve, ci=FOUR_ONLY),
    FaultKind("param_host_restarted", param_host_restarted, ci=FOUR_ONLY),
    FaultKind("param_host_sigstop", param_host_sigstop),
    FaultKind("global_manager_restarted", global_manager_restarted, ci=FOUR_ONLY),
    FaultKind("global_manager_sigstop", global_manager_sigstop),
    FaultKind("gateway_restarted", gateway_restarted, check=check_gateway_restarted, ci=FOUR_ONLY, errors_allowed=True),
    FaultKind("gateway_sigstop", gateway_sigstop),
    FaultKind(
        "corrupted_chunk",
        corrupted_chunk,
        prepare=reference_text,
        check=check_corrupted_chunk,
        mesh={"worker_args_extra": ("--dataplane-corrupt-sends", "1")},
        ci=FOUR_ONLY,
    ),
    FaultKind("slow_consumer", slow_consumer, prepare=gateway_rss, check=check_slow_consumer, ci=FOUR_ONLY),
    FaultKind(
        "flood_10x_max_concurrency",
        flood,
        prepare=gateway_rss,
        check=check_flood,
        mesh={"gateway_args": ["--max-concurrency", str(MAX_CONCURRENCY), "--max-queue", str(MAX_QUEUE)]},
        ci=FOUR_ONLY,
        errors_allowed=True,
    ),
)


def assert_nothing_lost(out: ChaosOutcome, *, errors_allowed: bool = False) -> None:
    """No request lost or hung past its deadline, every error a designed one, every scale-out
    finished (none rolled back, none left unresolved)."""
    assert out.lost == 0 and out.hung == 0, out.row()
    assert errors_allowed or out.errors == 0, out.error_messages
    assert out.completed + out.errors == out.requests
    assert not out.rolled_back, out.rolled_back
    assert not out.unresolved_scale_outs(), out.unresolved_scale_outs()


async def run_fault(kind: FaultKind, mesh: Mesh, topology: Topology) -> ChaosOutcome:
    """Inject `kind` into `mesh` during its topology's scale-out under the code trace burst, and
    check that nothing was lost."""
    run = FaultRun(mesh, topology)
    if kind.prepare is not None:
        await kind.prepare(run)

    async def inject(mesh: Mesh, events: list[dict[str, Any]]) -> dict[str, Any]:
        run.events = events  # the harness's list, filled as events arrive
        return await kind.inject(run)

    out = await run_chaos(
        mesh, kind.name, inject, arrivals=code_trace_burst(), topology=topology, victims=lambda: tuple(run.victims)
    )
    assert_nothing_lost(out, errors_allowed=kind.errors_allowed)
    if kind.check is not None:
        await kind.check(run, out)
        write_row(out.row())  # with what the check noted
    return out
