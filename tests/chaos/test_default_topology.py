"""Faults in the default topology of `make up` (issue 24): 3 workers, 1 loaded and 2 idle,
autoscaling on (the launcher's LOCAL_POLICY_PARAMS), a supervised mesh that restarts what dies,
the UCX data plane where ucxx imports. Here the only SERVING instance is the one that breaks.

- the only SERVING worker is SIGKILLed with 40 streams in flight and the scale-out they set off
  under way: no stream lost (each resumes elsewhere with its tokens so far, the exact greedy
  text), 10 requests sent right after the kill all succeed, and the pool serves again (the time
  against the model's load time + 2 s goes to bench/results/chaos.json under bench.chaos);
- the scale-out's chain source, or its middle hop, is SIGKILLed the moment the plan exists,
  before the targets connect: the targets take the host-cache fallback at once (no 30 s
  stall), nothing is rolled back, and every load error that reaches the manager is typed;
- the global manager or the parameter manager is SIGKILLed with 40 streams in flight: none lost.

Tiny model, emulated accelerator pacing and 10 Mbit/s data-plane links (as the rest of the chaos
suite), so a load takes a few seconds and faults land while parameters move.
"""

from __future__ import annotations

import asyncio
import contextlib
import signal
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import openai
import pytest
import pytest_asyncio

import blitzmesh
from services.common.waiting import wait_until
from services.mesh.launcher import Mesh
from tests.chaos.conftest import default_topology_config
from tests.chaos.harness import MODEL, gateway_counter, write_row

pytestmark = pytest.mark.asyncio(loop_scope="function")

STREAMS = 40
AFTER = 10
MAX_TOKENS = 400  # long enough that the streams outlast the autoscaler's reaction (~5 s)
PROMPT = "Once upon a time"
STALL_S = 30.0  # the stall a load used to suffer from a dropped hop (publish_wait_s)


@pytest_asyncio.fixture(loop_scope="function")
async def default_mesh(chaos_model_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> AsyncIterator[Mesh]:
    monkeypatch.setenv("BLITZMESH_PARAM_MANAGER_DATAPLANE_LINK_GBPS", "0.01")
    async with Mesh(default_topology_config(chaos_model_dir, tmp_path / "run")) as m:
        yield m


class Watch:
    """The cluster's events, as the chaos harness records them (t_s on this test's clock)."""

    def __init__(self, mesh: Mesh) -> None:
        self.mesh = mesh
        self.t0 = time.monotonic()
        self.events: list[dict[str, Any]] = []
        self._task: asyncio.Task[None] | None = None

    async def __aenter__(self) -> Watch:
        client = blitzmesh.AsyncClient(self.mesh.gateway_grpc, timeout_s=30)

        async def run() -> None:
            async with client:
                while True:
                    with contextlib.suppress(blitzmesh.BlitzmeshError):
                        async for ev in client.watch_events():
                            self.events.append(
                                {
                                    "t_s": time.monotonic() - self.t0,
                                    "action": ev.action,
                                    "status": ev.status,
                                    "instance_id": ev.instance_id,
                                    "target": ev.target,
                                    "reason": ev.reason,
                                }
                            )
                    await asyncio.sleep(0.1)

        self._task = asyncio.create_task(run())
        return self

    async def __aexit__(self, *exc: object) -> None:
        assert self._task is not None
        self._task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await self._task

    def find(self, action: str, status: str | None = None, after_s: float = 0.0) -> list[dict[str, Any]]:
        return [
            e
            for e in self.events
            if e["action"] == action and (status is None or e["status"] == status) and e["t_s"] >= after_s
        ]

    def now(self) -> float:
        return time.monotonic() - self.t0


def _client(mesh: Mesh) -> openai.AsyncOpenAI:
    # No client retries: whatever is not lost, the mesh kept.
    return openai.AsyncOpenAI(base_url=f"{mesh.gateway_http}/v1", api_key="none", max_retries=0, timeout=120)


async def _stream(client: openai.AsyncOpenAI, tokens: list[int]) -> str:
    """One streamed greedy completion; `tokens[0]` counts the chunks seen so far."""
    stream = await client.completions.create(
        model=MODEL,
        prompt=PROMPT,
        max_tokens=MAX_TOKENS,
        temperature=0,
        stream=True,
        extra_body={"ignore_eos": True},
    )
    text = ""
    async for chunk in stream:
        if chunk.choices:
            text += chunk.choices[0].text
            tokens[0] += 1
    return text


async def _complete(client: openai.AsyncOpenAI, max_tokens: int = 8) -> str:
    resp = await client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=max_tokens, temperature=0)
    return resp.choices[0].text


async def _states(mesh: Mesh) -> dict[str, str]:
    try:
        async with blitzmesh.AsyncClient(mesh.gateway_grpc, timeout_s=5) as c:
            return {i.instance_id: i.state for i in (await c.cluster()).instances}
    except blitzmesh.BlitzmeshError:
        return {}


async def _serving(mesh: Mesh) -> list[str]:
    return sorted(i for i, s in (await _states(mesh)).items() if s == "serving")


async def _settled(mesh: Mesh) -> bool:
    """Every worker registered, none LOADING or DRAINING, one SERVING."""
    states = await _states(mesh)
    workers = {n for n in mesh.procs if n.startswith("worker")}
    return (
        workers <= set(states)
        and not any(states[w] in ("loading", "draining", "lost") for w in workers)
        and "serving" in states.values()
    )


async def _streams_under_way(mesh: Mesh, watch: Watch, *, scale_out: bool) -> tuple[list[asyncio.Task[str]], list[int]]:
    """40 streams started, some past their first token (the rest queued on the instance), and
    with `scale_out` the scale-out they set off planned; a TimeoutError otherwise."""
    client = _client(mesh)
    counts = [[0] for _ in range(STREAMS)]
    started_s = watch.now()
    tasks = [asyncio.create_task(_stream(client, c)) for c in counts]
    if scale_out:
        # The moment the scale-out's plan exists: parameters are about to move from the source.
        await wait_until(
            lambda: watch.find("transfer_plan", after_s=started_s), 30, what="the autoscaler's scale-out plan"
        )
    # Streaming: one instance runs a batch of them and queues the rest (in flight too).
    await wait_until(lambda: any(c[0] >= 1 for c in counts), 30, what="a stream past its first token")
    done = [t for t in tasks if t.done()]
    assert not done, f"{len(done)} streams ended before the fault (nothing would be in flight): " + repr(
        [t.exception() or len(t.result()) for t in done][:3]
    )
    return tasks, [c[0] for c in counts]


async def test_only_serving_worker_sigkilled_with_40_streams(default_mesh: Mesh) -> None:
    mesh = default_mesh
    (victim,) = await _serving(mesh)
    async with Watch(mesh) as watch:
        streams, before = await _streams_under_way(mesh, watch, scale_out=True)
        plan = watch.find("transfer_plan")[-1]["reason"]
        old = mesh.procs[victim]
        old.process.send_signal(signal.SIGKILL)
        killed_s = watch.now()
        client = _client(mesh)
        after = [asyncio.create_task(_complete(client)) for _ in range(AFTER)]

        # Serving again: an instance other than the dead one is SERVING (or the victim, restarted,
        # has left SERVING and come back to it).
        victim_left = False

        async def back() -> str | None:
            nonlocal victim_left
            states = await _states(mesh)
            victim_left = victim_left or states.get(victim, "serving") != "serving"
            up = [i for i, s in states.items() if s == "serving" and (i != victim or victim_left)]
            return up[0] if up else None

        first = await wait_until(back, 90, interval_s=0.05, what="an instance SERVING again after the kill")
        serving_again_s = watch.now() - killed_s
        results = await asyncio.gather(*streams, *after, return_exceptions=True)
        errors = [repr(r) for r in results if isinstance(r, BaseException)]
        texts = [r for r in results[:STREAMS] if isinstance(r, str)]
        reference = await _stream(_client(mesh), [0])  # whole, on one instance, after the fault
        loads = watch.find("load_result", "ok")
        first_load = next((e for e in reversed(loads) if e["instance_id"] == first), None)
        load_s = float(first_load["reason"].removeprefix("load_s=")) if first_load else None
        # The model's load time: the quickest load of this run (the first serving instance's own
        # load may include the fault's cost, so it is no yardstick).
        fastest_load_s = min((float(e["reason"].removeprefix("load_s=")) for e in loads), default=None)
        rolled = watch.find("scale_out", "rolled_back")
        untyped = [e["reason"] for e in watch.find("load_result", "failed") if e["reason"].startswith("UNKNOWN")]
        await wait_until(lambda: _settled(mesh), 120, interval_s=0.2, what="the cluster settled after the kill")
        row = {
            "fault": "default_topology_only_serving_worker_sigkill",
            "requests": STREAMS + AFTER,
            "completed": STREAMS + AFTER - len(errors),
            "migrated": STREAMS,
            "errors": len(errors),
            "lost": len(errors),
            "hung": 0,
            "recovery_s": round(serving_again_s, 2),
            "killed": victim,
            "chain": plan.removeprefix("chains: "),
            "streams_past_first_token_at_kill": sum(n >= 1 for n in before),
            "kill_to_serving_s": round(serving_again_s, 2),
            "first_serving": first,
            "its_load_s": load_s,
            "model_load_s": fastest_load_s,
            "target_s": None if fastest_load_s is None else round(fastest_load_s + 2.0, 2),
            "meets_target": fastest_load_s is not None and serving_again_s <= fastest_load_s + 2.0,
            "rolled_back": len(rolled),
            "topology": "make up default: 3 workers, 1 loaded + 2 idle, autoscaling, supervised",
        }
        write_row(row)
    assert not errors, errors[:3]
    assert len(set(texts)) == 1 and texts[0] == reference, "a migrated stream differs from the whole one"
    assert not untyped, untyped
    assert load_s is not None, (first, loads)
    # The target is the model's load time + 2 s (`meets_target` in the row; a speed
    # target, so it is recorded, not asserted). Reloads used to take ~20 s here: the host cache
    # kept a UCX endpoint paired with one the reloading worker had dropped, and every retry
    # through it was cancelled (fixed by endpoint generations in the UCX handshake). Bounded
    # well below that, so a regression to it fails.
    assert serving_again_s <= 15.0, row


async def _kill_at_plan(mesh: Mesh, pick: str) -> dict[str, Any]:
    """Scale out by 2 through the admin API (a chain source -> hop -> tail), SIGKILL the chain's
    source or its first hop the moment the plan is reported (before the targets connect), and
    return what happened to the loads."""
    (serving,) = await _serving(mesh)
    async with Watch(mesh) as watch, blitzmesh.AsyncClient(mesh.gateway_grpc, timeout_s=120) as admin:
        # The streams keep the source SERVING and busy while it would send.
        client = _client(mesh)
        counts = [[0] for _ in range(8)]
        streams = [asyncio.create_task(_stream(client, c)) for c in counts]
        await wait_until(lambda: all(c[0] >= 1 for c in counts), 60, what="streams past their first token")
        scaling = asyncio.create_task(admin.scale(MODEL, 2, wait=True, timeout_s=120))
        await wait_until(lambda: watch.find("transfer_plan"), 30, what="the scale-out's plan")
        plan = watch.find("transfer_plan")[-1]["reason"].removeprefix("chains: ")
        chain = plan.split(";")[0].split(" (")[0].strip().split("->")
        source, hops = chain[0], chain[1:]
        victim = source if pick == "source" else hops[0]
        killed_s = watch.now()
        if victim.startswith("worker"):
            mesh.procs[victim].process.send_signal(signal.SIGKILL)
        with contextlib.suppress(blitzmesh.BlitzmeshError):
            await scaling
        results = await asyncio.gather(*streams, return_exceptions=True)
        await wait_until(lambda: _settled(mesh), 120, interval_s=0.2, what="the cluster settled after the kill")
        targets = [h for h in hops if h != victim] if pick != "source" else hops
        loads = {e["instance_id"]: e for e in watch.find("load_result", after_s=killed_s)}
        return {
            "serving_before": serving,
            "plan": plan,
            "victim": victim,
            "targets": targets,
            "loads": loads,
            # Rollbacks of the chain's targets before they served (the killed hop's own load
            # fails: that is the fault; later scale-outs by the autoscaler are not this plan's).
            "rolled_back": [
                e
                for e in watch.find("scale_out", "rolled_back")
                if e["instance_id"] in targets
                and e["t_s"]
                < min(
                    (x["t_s"] for x in watch.find("load_result", "ok") if x["instance_id"] == e["instance_id"]),
                    default=float("inf"),
                )
            ],
            "failed": watch.find("load_result", "failed"),
            "stream_errors": [repr(r) for r in results if isinstance(r, BaseException)],
            "final": await _states(mesh),
            "killed_s": killed_s,
        }


@pytest.mark.parametrize("pick", ["source", "middle_hop"])
async def test_chain_node_killed_before_the_targets_connect(default_mesh: Mesh, pick: str) -> None:
    out = await _kill_at_plan(default_mesh, pick)
    if not out["victim"].startswith("worker"):
        pytest.skip(f"the plan's {pick} is a host cache, not a worker: {out['plan']}")
    served = {
        t: float(e["reason"].removeprefix("load_s="))
        for t, e in out["loads"].items()
        if t in out["targets"] and e["status"] == "ok"
    }
    write_row(
        {
            "fault": f"default_topology_chain_{pick}_killed_before_connect",
            "requests": 8,
            "completed": 8 - len(out["stream_errors"]),
            "migrated": 0,
            "errors": len(out["stream_errors"]),
            "lost": len(out["stream_errors"]),
            "hung": 0,
            "recovery_s": round(max(served.values(), default=0.0), 2),
            "killed": out["victim"],
            "chain": out["plan"],
            "targets_load_s": served,
            "rolled_back": len(out["rolled_back"]),
        }
    )
    assert not out["stream_errors"], out["stream_errors"][:3]
    assert not out["rolled_back"], out["rolled_back"]
    # Every target of the chain loaded (from the host-cache fallback) without the old 30 s stall.
    assert set(served) == set(out["targets"]), (out["targets"], out["loads"], out["final"])
    assert all(s < STALL_S / 2 for s in served.values()), served
    assert all(not e["reason"].startswith("UNKNOWN") for e in out["failed"]), out["failed"]


@pytest.mark.parametrize("name", ["global_manager", "param_manager"])
async def test_manager_sigkilled_with_40_streams_loses_none(default_mesh: Mesh, name: str) -> None:
    mesh = default_mesh
    async with Watch(mesh) as watch:
        streams, _ = await _streams_under_way(mesh, watch, scale_out=False)
        old = mesh.procs[name]
        old.process.send_signal(signal.SIGKILL)
        results = await asyncio.gather(*streams, return_exceptions=True)
        errors = [repr(r) for r in results if isinstance(r, BaseException)]
        await wait_until(lambda: mesh.procs[name] is not old, 60, what=f"{name} restarted")
        await wait_until(lambda: _settled(mesh), 120, interval_s=0.2, what="the cluster settled")
        after = await asyncio.gather(*[_complete(_client(mesh)) for _ in range(AFTER)], return_exceptions=True)
        after_errors = [repr(r) for r in after if isinstance(r, BaseException)]
    write_row(
        {
            "fault": f"default_topology_{name}_sigkill",
            "requests": STREAMS + AFTER,
            "completed": STREAMS + AFTER - len(errors) - len(after_errors),
            "migrated": 0,
            "errors": len(errors) + len(after_errors),
            "lost": len(errors),
            "hung": 0,
            "recovery_s": 0.0,
            "killed": name,
        }
    )
    assert not errors, errors[:3]
    assert not after_errors, after_errors[:3]


async def test_only_serving_worker_hung_with_40_streams(default_mesh: Mesh) -> None:
    """The only SERVING worker hangs (SIGSTOP) with 40 streams in flight and the scale-out they
    set off about to pull from it: the manager marks it LOST after its heartbeat timeout, the
    scale-out's targets give up on the silent source (hello timeout, liveness probe) and load
    from the host cache, and the streams resume there with the exact greedy text. Once LOST,
    the worker is SIGCONTed and rejoins."""
    mesh = default_mesh
    (victim,) = await _serving(mesh)
    migrated_before = await gateway_counter(mesh, "blitzmesh_gateway_migrations")
    async with Watch(mesh) as watch:
        streams, before = await _streams_under_way(mesh, watch, scale_out=True)
        proc = mesh.procs[victim].process
        proc.send_signal(signal.SIGSTOP)
        stopped_s = watch.now()
        try:
            lost = await wait_until(
                lambda: [e for e in watch.find("instance_lost", after_s=stopped_s) if e["instance_id"] == victim],
                30,
                what="the hung worker marked LOST",
            )
        finally:
            proc.send_signal(signal.SIGCONT)
        results = await asyncio.gather(*streams, return_exceptions=True)
        done_s = watch.now()
        errors = [repr(r) for r in results if isinstance(r, BaseException)]
        texts = [r for r in results if isinstance(r, str)]
        reference = await _stream(_client(mesh), [0])
        migrated = await gateway_counter(mesh, "blitzmesh_gateway_migrations") - migrated_before
        rolled = watch.find("scale_out", "rolled_back", after_s=stopped_s)
        untyped = [e["reason"] for e in watch.find("load_result", "failed") if e["reason"].startswith("UNKNOWN")]
        served = [e["t_s"] for e in watch.find("load_result", "ok", after_s=stopped_s) if e["instance_id"] != victim]
        await wait_until(lambda: _settled(mesh), 120, interval_s=0.2, what="the cluster settled after the hang")
    write_row(
        {
            "fault": "default_topology_only_serving_worker_sigstop",
            "requests": STREAMS,
            "completed": len(texts),
            "migrated": round(migrated),
            "errors": len(errors),
            "lost": len(errors),
            "hung": 0,
            # From the hang to the first other instance serving (the streams then resume there).
            "recovery_s": round(min(served) - stopped_s, 2) if served else None,
            "streams_done_s": round(done_s - stopped_s, 2),
            "killed": victim,
            "lost_after_s": round(lost[0]["t_s"] - stopped_s, 2),
            "streams_past_first_token_at_fault": sum(n >= 1 for n in before),
            "rolled_back": len(rolled),
            "topology": "make up default: 3 workers, 1 loaded + 2 idle, autoscaling, supervised",
        }
    )
    assert not errors, errors[:3]
    assert migrated >= 1, "no stream was moved off the hung worker"
    assert len(set(texts)) == 1 and texts[0] == reference, "a migrated stream differs from the whole one"
    assert not untyped, untyped
