"""Faults of processes during a scale-out under a burst of the Azure code trace: a worker
SIGKILLed mid-stream, a chain hop killed mid-transfer, the chain's source killed, a parameter
host restarted, the global manager restarted.

Each asserts: no accepted request lost or hung past its deadline, every scale-out finished or
rolled back, the cluster healthy again (and reports how long that took in bench/results/chaos.json).
"""

from __future__ import annotations

import asyncio
import signal
import time
from typing import Any

import pytest

import blitzmesh
from services.mesh.launcher import Mesh
from tests.chaos.harness import MODEL, ChaosOutcome, code_trace_burst, run_chaos, wait_event

pytestmark = pytest.mark.asyncio(loop_scope="function")


def chain_of(events: list[dict[str, Any]]) -> tuple[str, list[str]]:
    """(source, hops) of the first network chain in the latest transfer plan's reason,
    e.g. "chains: worker-0->worker-2->worker-3 (4 groups)"."""
    plan = [e for e in events if e["action"] == "transfer_plan"][-1]
    first = plan["reason"].removeprefix("chains: ").split(";")[0].split(" (")[0]
    source, *hops = first.strip().split("->")
    return source, hops


def proc_name(node_id: str) -> str:
    """The launcher's process name of a plan's node id (host caches are named by slot)."""
    if node_id.startswith("host-cache-"):
        slot = int(node_id.removeprefix("host-cache-"))
        return "param_manager" if slot == 0 else f"host_cache-{slot}"
    return node_id


async def wait_mid_transfer(mesh: Mesh, instance_id: str, timeout_s: float = 20.0) -> None:
    """Until `instance_id` is LOADING with some layers in but not all (parameters moving)."""
    deadline = time.monotonic() + timeout_s
    async with blitzmesh.AsyncClient(mesh.gateway_grpc, timeout_s=10) as client:
        while True:
            cluster = await client.cluster()
            inst = next((i for i in cluster.instances if i.instance_id == instance_id), None)
            if inst is not None and inst.state == "loading" and inst.layers_loaded >= 1:
                return
            if inst is not None and inst.state == "serving":
                raise AssertionError(f"{instance_id} finished loading before the fault could land")
            if time.monotonic() > deadline:
                raise TimeoutError(f"{instance_id} not mid-transfer within {timeout_s}s")
            await asyncio.sleep(0.02)


async def busiest_bystander(mesh: Mesh, events: list[dict[str, Any]]) -> str:
    """The SERVING instance with the most requests running that does not feed the chain."""
    source, _ = chain_of(events)
    async with blitzmesh.AsyncClient(mesh.gateway_grpc, timeout_s=10) as client:
        cluster = await client.cluster()
    serving = [i for i in cluster.instances if i.state == "serving" and i.instance_id != source]
    return max(serving, key=lambda i: i.load.running).instance_id


def assert_nothing_lost(out: ChaosOutcome, *, errors_allowed: int = 0) -> None:
    assert out.lost == 0 and out.hung == 0, out.row()
    assert out.errors <= errors_allowed, out.error_messages
    assert out.completed + out.errors == out.requests
    assert not out.unresolved_scale_outs(), out.unresolved_scale_outs()


async def test_worker_killed_mid_stream(chaos_mesh: Mesh) -> None:
    """A SERVING worker that is not feeding the chain is SIGKILLed with streams in flight: its
    streams resume elsewhere and the scale-out completes."""

    async def fault(mesh: Mesh, events: list[dict[str, Any]]) -> dict[str, Any]:
        victim = await busiest_bystander(mesh, events)
        mesh.procs[victim].process.send_signal(signal.SIGKILL)
        return {"killed": victim}

    out = await run_chaos(chaos_mesh, "worker_sigkill_mid_stream", fault, arrivals=code_trace_burst())
    assert_nothing_lost(out)
    assert out.migrated >= 1, out.row()  # the victim had streams in flight


async def test_chain_hop_killed_mid_transfer(chaos_mesh: Mesh) -> None:
    """The middle hop of a two-hop chain is SIGKILLed while parameters move: the tail re-sources
    the missing bytes and serves; the hop's load fails and is rolled back or retried."""

    async def fault(mesh: Mesh, events: list[dict[str, Any]]) -> dict[str, Any]:
        source, hops = chain_of(events)
        assert len(hops) >= 2, f"expected a chain of two hops, got {source}->{hops}"
        await wait_mid_transfer(mesh, hops[0])
        mesh.procs[hops[0]].process.send_signal(signal.SIGKILL)
        return {"killed": hops[0], "chain": "->".join([source, *hops])}

    out = await run_chaos(chaos_mesh, "chain_hop_killed", fault, arrivals=code_trace_burst())
    assert_nothing_lost(out)
    tail = out.notes["chain"].split("->")[-1]
    assert out.final_states.get(tail) == "serving", out.final_states


async def test_chain_source_killed_mid_transfer(chaos_mesh: Mesh) -> None:
    """The chain's source is killed while parameters move: the targets re-source from a host
    cache shard (or another holder) and serve, or are rolled back if every fallback failed."""

    async def fault(mesh: Mesh, events: list[dict[str, Any]]) -> dict[str, Any]:
        source, hops = chain_of(events)
        await wait_mid_transfer(mesh, hops[0])
        name = proc_name(source)
        if name.startswith("worker"):
            mesh.procs[name].process.send_signal(signal.SIGKILL)
        else:
            await mesh.restart(name)  # a parameter host: it comes back (its shard is on disk)
        return {"killed": name, "chain": "->".join([source, *hops])}

    out = await run_chaos(chaos_mesh, "chain_source_killed", fault, arrivals=code_trace_burst())
    assert_nothing_lost(out)
    hops = out.notes["chain"].split("->")[1:]
    # The targets re-source and serve (judged by the final cluster state: a load_result event
    # is sent a moment after the instance turns SERVING). A target whose fallback failed too
    # is rolled back (assert_nothing_lost checked that), as happened once under a loaded CI
    # machine; the scale-out still added capacity.
    serving = [h for h in hops if out.final_states.get(h) == "serving"]
    assert serving, (hops, out.final_states)
    out.notes["targets_serving"] = f"{len(serving)}/{len(hops)}"


async def test_param_host_restarted_mid_transfer(chaos_mesh: Mesh) -> None:
    """A parameter host (a host-cache process) is restarted while a scale-out loads: loads
    finish (from the other holders, or from it once back), and a later load works again."""

    async def fault(mesh: Mesh, events: list[dict[str, Any]]) -> dict[str, Any]:
        source, hops = chain_of(events)
        await wait_mid_transfer(mesh, hops[0])
        # The chain's own source if a host cache feeds it, else the other host cache.
        name = proc_name(source) if source.startswith("host-cache-") else "host_cache-1"
        await mesh.restart(name)
        return {"restarted": name, "chain": "->".join([source, *hops])}

    out = await run_chaos(chaos_mesh, "param_host_restarted", fault, arrivals=code_trace_burst())
    assert_nothing_lost(out)
    async with blitzmesh.AsyncClient(chaos_mesh.gateway_grpc, timeout_s=120) as client:
        cluster = await client.cluster()
        idle = [i for i in cluster.instances if i.state == "idle"]
        if idle:  # a later load still works with the restarted host
            result = await client.scale(MODEL, 1, wait=True, timeout_s=120)
            assert result.instance_ids


async def test_global_manager_restarted_mid_scale_out(chaos_mesh: Mesh) -> None:
    """The global manager is SIGKILLed and restarted while a scale-out loads: workers
    re-register, loads already under way finish, and every request completes."""

    async def fault(mesh: Mesh, events: list[dict[str, Any]]) -> dict[str, Any]:
        _, hops = chain_of(events)
        await wait_mid_transfer(mesh, hops[0])
        await mesh.restart("global_manager")
        return {"restarted": "global_manager"}

    out = await run_chaos(chaos_mesh, "global_manager_restarted", fault, arrivals=code_trace_burst())
    # The restarted manager does not know the scale-out it did not start: its loads are seen
    # from the workers' re-registration, not from load_result events.
    assert out.lost == 0 and out.hung == 0 and out.errors == 0, out.row()


async def test_worker_hung_with_sigstop(chaos_mesh: Mesh) -> None:
    """A SERVING worker is SIGSTOPped with streams in flight: the manager marks it LOST after
    its heartbeat timeout, the gateway fails its streams over (they resume elsewhere), and once
    it is LOST it is SIGCONTed: it re-registers and the cluster is whole again."""

    async def fault(mesh: Mesh, events: list[dict[str, Any]]) -> dict[str, Any]:
        victim = await busiest_bystander(mesh, events)
        proc = mesh.procs[victim].process
        proc.send_signal(signal.SIGSTOP)
        try:
            lost = await wait_event(
                events, lambda e: e["action"] == "instance_lost" and e["instance_id"] == victim, 30.0, "instance_lost"
            )
        finally:
            proc.send_signal(signal.SIGCONT)
        return {"hung": victim, "lost_after_s": lost["t_s"]}

    out = await run_chaos(chaos_mesh, "worker_sigstop", fault, arrivals=code_trace_burst())
    assert_nothing_lost(out)
    assert out.migrated >= 1, out.row()


async def test_gateway_restarted(chaos_mesh: Mesh) -> None:
    """The gateway is SIGKILLed and restarted (same ports) during a scale-out. Streams it held
    end with a connection error (nothing could carry them over); requests the `openai` client
    sends meanwhile succeed through its own retries; the scale-out finishes."""
    retried: list[str] = []

    async def via_openai(i: int) -> None:
        import openai

        client = openai.AsyncOpenAI(base_url=f"{chaos_mesh.gateway_http}/v1", api_key="none", max_retries=5)
        done = await client.completions.create(model=MODEL, prompt=f"during restart {i}", max_tokens=4)
        retried.append(done.choices[0].finish_reason)

    async def fault(mesh: Mesh, events: list[dict[str, Any]]) -> dict[str, Any]:
        proc = mesh.procs["gateway"].process
        proc.send_signal(signal.SIGKILL)
        await proc.wait()
        clients = asyncio.gather(*(via_openai(i) for i in range(4)))  # sent while it is down
        await mesh.restart("gateway")
        await asyncio.wait_for(clients, 60)
        return {"restarted": "gateway"}

    out = await run_chaos(chaos_mesh, "gateway_restarted", fault, arrivals=code_trace_burst())
    assert out.lost == 0 and out.hung == 0, out.row()
    connection = ("Connection", "connect", "Payload", "Disconnected", "closed")
    assert all(any(c in m for c in connection) for m in out.error_messages), out.error_messages
    assert len(retried) == 4 and all(r in ("stop", "length") for r in retried), retried
    assert not out.unresolved_scale_outs(), out.unresolved_scale_outs()


@pytest.mark.parametrize("chaos_mesh", [{"worker_args_extra": ["--dataplane-corrupt-sends", "1"]}], indirect=True)
async def test_corrupted_chunk_on_the_wire(chaos_mesh: Mesh) -> None:
    """Every worker flips a byte in the first parameter chunk it sends (the chain's source and
    its middle hop): receivers catch it by checksum, fetch the group again, and serve the same
    tokens as the instances loaded before."""
    async with blitzmesh.AsyncClient(chaos_mesh.gateway_grpc, timeout_s=60) as client:
        reference = await client.complete("The quick brown fox", model=MODEL, max_tokens=8, temperature=0)

    async def fault(mesh: Mesh, events: list[dict[str, Any]]) -> dict[str, Any]:
        source, hops = chain_of(events)
        return {"chain": "->".join([source, *hops])}  # the corruption is already on the wire

    out = await run_chaos(chaos_mesh, "corrupted_chunk", fault, arrivals=code_trace_burst())
    assert_nothing_lost(out)
    logs = "".join(chaos_mesh.log_path(n).read_text() for n in chaos_mesh.procs if n.startswith("worker"))
    refetches = logs.count("dataplane_checksum_refetch")
    assert "dataplane_fault_corrupted_send" in logs and refetches >= 1, "the corruption was caught and refetched"
    out.notes["refetched_groups"] = refetches
    async with blitzmesh.AsyncClient(chaos_mesh.gateway_grpc, timeout_s=60) as client:
        cluster = await client.cluster()
        for inst in [i for i in cluster.instances if i.state == "serving"]:
            again = await client.complete("The quick brown fox", model=MODEL, max_tokens=8, temperature=0)
            assert again.text == reference.text, inst.instance_id
