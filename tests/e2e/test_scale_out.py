"""Scale-out through the gateway's Admin API while requests flow: parameters move along a
chain from the serving instance and the host-cache shards, targets become SERVING with
bit-identical weights, and no request is lost."""

from __future__ import annotations

import asyncio
import contextlib
import signal
from collections.abc import AsyncIterator, Callable

import pytest
import pytest_asyncio

import blitzmesh
from blitzmesh.v1 import (
    admin_pb2_grpc,
    param_manager_pb2,
    param_manager_pb2_grpc,
    worker_pb2,
    worker_pb2_grpc,
)
from services.common.waiting import wait_until
from services.mesh.launcher import Mesh, MeshConfig
from tests.harness.admin import unchanged_policy

pytestmark = [pytest.mark.e2e, pytest.mark.asyncio(loop_scope="module")]

MODEL = "tiny"


@pytest_asyncio.fixture(loop_scope="module", scope="module")
async def scale_mesh(
    make_mesh_config: Callable[..., MeshConfig], tmp_path_factory: pytest.TempPathFactory
) -> AsyncIterator[Mesh]:
    cfg = make_mesh_config(tmp_path_factory.mktemp("run-scale"), workers=6, host_caches=2)
    cfg.initial_instances = 1
    # Emulated 50 Mbit/s worker links: a 3.5 MB copy takes ~0.6 s, long enough to kill a hop
    # mid-transfer; a receiver re-sources from a host shard after 2 s of silence.
    cfg.worker_args = [*cfg.worker_args, "--dataplane-link-gbps", "0.05", "--stall-timeout-s", "2"]
    m = Mesh(cfg)
    try:
        await m.start()
        yield m
    finally:
        await m.stop()


async def watch_is_live(mesh: Mesh, events: list[blitzmesh.ClusterEvent]) -> None:
    """Return once the watch that fills `events` receives events: a SetPolicy of the policy in
    force changes nothing and emits a "policy" event; it is sent until the watch has seen one. (A
    watch subscribes over two hops; a scale-out started before that loses its first events.)"""
    async with mesh.channel("gateway") as ch:
        admin = admin_pb2_grpc.AdminStub(ch)
        for _ in range(30):  # one SetPolicy a second, for 30 s at most
            await admin.SetPolicy(await unchanged_policy(admin), timeout=10)
            with contextlib.suppress(TimeoutError):
                await wait_until(
                    lambda: any(e.action == "policy" for e in events), 1.0, interval_s=0.02, what="a policy event"
                )
                return
    raise TimeoutError("the event watch received no event within 30 s")


async def test_scale_out_while_serving(scale_mesh: Mesh) -> None:
    async with blitzmesh.AsyncClient(scale_mesh.gateway_grpc, timeout_s=120) as client:
        reference = await client.complete("The quick brown fox", model=MODEL, max_tokens=8, temperature=0)
        events: list[blitzmesh.ClusterEvent] = []

        async def watch() -> None:
            async for ev in client.watch_events():
                events.append(ev)

        async def traffic() -> list[blitzmesh.Completion]:
            # A bounded stream of requests that overlaps the scale-out.
            return list(
                await asyncio.gather(*(client.complete(f"req {i}", model=MODEL, max_tokens=6) for i in range(12)))
            )

        watcher = asyncio.create_task(watch())
        await watch_is_live(scale_mesh, events)  # the watch must see the scale-out's first events
        flowing = asyncio.create_task(traffic())
        result = await client.scale(MODEL, 2, wait=True, timeout_s=120)
        assert len(result.instance_ids) == 2
        done = await flowing
        # The events arrive on their own stream: wait (bounded) for both loads' results.
        await wait_until(
            lambda: {e.instance_id for e in events if e.action == "load_result"} >= set(result.instance_ids),
            10,
            what="a load_result event for each new instance",
        )
        watcher.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await watcher

        assert all(r.finish_reason in ("stop", "length") for r in done), "every request completes"
        cluster = await client.cluster()
        serving = sorted(i.instance_id for i in cluster.instances if i.state == "serving")
        assert len(serving) == 3 and set(result.instance_ids) <= set(serving)
        plans = [e for e in events if e.action == "transfer_plan"]
        assert plans and "->" in plans[0].reason, [e.action for e in events]
        loads = {e.instance_id: e.status for e in events if e.action == "load_result"}
        assert all(loads.get(i) == "ok" for i in result.instance_ids), loads

        # Same greedy output from every instance: the weights arrived bit-identical (each group
        # is also checksum-verified on arrival).
        for _ in range(6):
            again = await client.complete("The quick brown fox", model=MODEL, max_tokens=8, temperature=0)
            assert again.text == reference.text

    # The pool's location index lists the new instances as holders of every group.
    async with scale_mesh.channel("param_manager") as ch:
        where = await param_manager_pb2_grpc.ParamManagerStub(ch).Locate(
            param_manager_pb2.LocateRequest(model_id=MODEL), timeout=5
        )
    for loc in where.locations:
        assert set(result.instance_ids) <= set(loc.holders), (loc.group, list(loc.holders))
        assert any(h.startswith("host-cache") for h in loc.holders)


async def test_middle_hop_killed_mid_transfer_tail_finishes_from_host_shard(scale_mesh: Mesh) -> None:
    async with blitzmesh.AsyncClient(scale_mesh.gateway_grpc, timeout_s=120) as client:
        events: list[blitzmesh.ClusterEvent] = []
        plan_seen = asyncio.Event()

        async def watch() -> None:
            async for ev in client.watch_events():
                events.append(ev)
                if ev.action == "transfer_plan":
                    plan_seen.set()

        watcher = asyncio.create_task(watch())
        await watch_is_live(scale_mesh, events)  # the transfer plan is among the first events
        result = await client.scale(MODEL, 3, timeout_s=30)
        assert len(result.instance_ids) == 3
        async with asyncio.timeout(30):
            await plan_seen.wait()
        plan = next(e for e in events if e.action == "transfer_plan")
        # "chains: a->b->c (4 groups); d->e (2 groups)"
        chains = [c.split(" (")[0].split("->") for c in plan.reason.removeprefix("chains: ").split("; ")]
        chain = max(chains, key=len)
        assert len(chain) == 4, plan.reason  # source -> 3 targets
        _, first, middle, tail = chain

        # SIGKILL the middle hop once it has some layers but not all.
        async with scale_mesh.channel(middle) as ch:
            stub = worker_pb2_grpc.WorkerStub(ch)
            await wait_until(lambda: _layers_loaded(stub), 30, what=f"{middle} to hold a layer")
        scale_mesh.procs[middle].process.send_signal(signal.SIGKILL)

        await wait_until(
            lambda: {first, tail} <= {e.instance_id for e in events if e.action == "load_result"},
            90,
            interval_s=0.1,
            what="both live targets to finish loading",
        )
        watcher.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await watcher
        outcome = {e.instance_id: e.status for e in events if e.action == "load_result"}
        assert outcome[first] == "ok" and outcome[tail] == "ok", outcome
        cluster = await client.cluster()
        states = {i.instance_id: i.state for i in cluster.instances}
        assert states[tail] == "serving" and states[first] == "serving"
        done = await client.complete("after the fault", model=MODEL, max_tokens=4)
        assert done.finish_reason in ("stop", "length")

    # The tail's own record of the load: groups re-sourced from a host shard.
    log_text = (scale_mesh.cfg.run_dir / f"{tail}.log").read_text()
    loaded = [line for line in log_text.splitlines() if "event='model_loaded'" in line]
    assert loaded and "resourced=[]" not in loaded[-1], loaded


async def _host_cache_holders(mesh: Mesh) -> dict[str, tuple[bytes, frozenset[str]]]:
    """Per host cache listed by the index: its data-plane address and the groups it holds."""
    async with mesh.channel("param_manager") as ch:
        where = await param_manager_pb2_grpc.ParamManagerStub(ch).Locate(
            param_manager_pb2.LocateRequest(model_id=MODEL), timeout=10
        )
    held: dict[str, tuple[bytes, set[str]]] = {}
    for loc in where.locations:
        for h in loc.holder_info:
            if h.kind == "host_cache":
                held.setdefault(h.holder_id, (h.dataplane_address, set()))[1].add(loc.group)
    return {k: (addr, frozenset(groups)) for k, (addr, groups) in held.items()}


async def test_restarted_host_cache_reloads_and_reannounces_its_shard(scale_mesh: Mesh) -> None:
    before = await _host_cache_holders(scale_mesh)
    assert set(before) == {"host-cache-0", "host-cache-1"}, before
    old_address, shard = before["host-cache-1"]
    assert shard and shard.isdisjoint(before["host-cache-0"][1])  # one copy, split over the caches

    await scale_mesh.restart("host_cache-1")

    async def moved() -> dict | None:
        holders = await _host_cache_holders(scale_mesh)
        return holders if holders["host-cache-1"][0] != old_address else None

    now = await wait_until(moved, 30, interval_s=0.2, what="host-cache-1 at a new address")
    # The same shard, read again from the checkpoint, announced at the new process's address.
    assert now["host-cache-1"][1] == shard and now["host-cache-0"] == before["host-cache-0"]
    log_text = (scale_mesh.cfg.run_dir / "host_cache-1.log").read_text()
    assert log_text.count("event='shard_loaded'") >= 2, "the restarted cache did not reload its shard"

    # A new instance fills from the pool with the restarted cache in it (the earlier tests used
    # every worker: scale in by one first, which drains one back to IDLE).
    async with blitzmesh.AsyncClient(scale_mesh.gateway_grpc, timeout_s=120) as client:
        await client.scale(MODEL, -1, wait=True, timeout_s=60)
        assert [i for i in (await client.cluster()).instances if i.state == "idle"]
        result = await client.scale(MODEL, 1, wait=True, timeout_s=60)
        assert len(result.instance_ids) == 1
        states = {i.instance_id: i.state for i in (await client.cluster()).instances}
        assert states[result.instance_ids[0]] == "serving"


async def _layers_loaded(stub: worker_pb2_grpc.WorkerStub) -> bool:
    return (await stub.GetStatus(worker_pb2.GetStatusRequest(), timeout=5)).layers_loaded >= 1
