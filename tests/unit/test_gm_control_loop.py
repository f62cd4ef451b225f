"""The manager's control loop on a fake clock: the real servicer (registration, heartbeats,
ticks, events, decision log) with a `RecordingActuator` in place of gRPC. No sockets, no
sleeps: time moves when the test says, and loads and drains end when the test finishes them.

These replace the sleep-then-assert tests of test_global_manager_autoscale.py; that file keeps
the end-to-end run of the real gRPC loop.
"""

from __future__ import annotations

from typing import Any

import pytest
from prometheus_client import REGISTRY

from blitzmesh.v1 import admin_pb2, common_pb2, global_manager_pb2
from services.global_manager.config import GlobalManagerConfig
from services.global_manager.core.actions import (
    DrainInstance,
    LoadInstances,
    MigrateRequests,
    ResumeInstance,
    UpdateLocation,
)
from services.global_manager.core.actuator import RecordingActuator
from services.global_manager.service import GlobalManagerServicer

pytestmark = [pytest.mark.timeout(10), pytest.mark.filterwarnings("error")]

ST = common_pb2.InstanceState
MODEL = "m"
TICK_S = 0.05


class FakeClock:
    def __init__(self, start_s: float = 1000.0) -> None:
        self.now_s = start_s

    def __call__(self) -> float:
        return self.now_s


class Aborted(Exception):
    pass


class Context:
    """Enough of a grpc.aio context for the handlers: abort raises; no transport security (as
    an --insecure mesh: nobody's instance is checked)."""

    def auth_context(self) -> dict[str, list[bytes]]:
        return {}

    async def abort(self, code: Any, details: str) -> None:
        raise Aborted(f"{code.name}: {details}")


class Mesh:
    """A manager on a fake clock and the workers it sees, each in the state it would report."""

    def __init__(self, n_workers: int = 3, **cfg: Any) -> None:
        params = {
            "target_decode_tps_per_instance": 10,
            "scale_out_cooldown_s": 0,
            "scale_in_cooldown_s": 0,
            "enable_latency_trigger": False,
            **cfg.pop("policy_params", {}),
        }
        settings = {
            "port": 0,
            "param_manager": "pm:1",
            "default_model": MODEL,
            "min_instances": 1,
            "max_instances": 3,
            "autoscale": True,
            "tick_s": TICK_S,
            "window_s": 0.5,
            "lost_after_s": 30,
            "policy_params": params,
            **cfg,
        }
        self.clock = FakeClock()
        self.gm = GlobalManagerServicer(
            GlobalManagerConfig(**settings),
            clock=self.clock,
            actuator=lambda sink: RecordingActuator(sink=sink, models=[MODEL]),
        )
        actuator = self.gm.actuator
        assert isinstance(actuator, RecordingActuator)
        self.act = actuator
        self.queue = self.gm.events.subscribe()
        self.events: list[admin_pb2.ClusterEvent] = []
        self.workers = {f"w{i}": ST.INSTANCE_STATE_IDLE for i in range(n_workers)}
        self.loads = {iid: common_pb2.LoadReport() for iid in self.workers}
        self.mute: set[str] = set()

    def drain_events(self) -> list[admin_pb2.ClusterEvent]:
        while not self.queue.empty():
            self.events.append(self.queue.get_nowait())
        return self.events

    def state(self, iid: str) -> str:
        return self.gm.table.registry.get(iid).state.value

    def info(self, iid: str) -> common_pb2.InstanceInfo:
        st = self.workers[iid]
        return common_pb2.InstanceInfo(
            instance_id=iid,
            address=f"{iid}:1",
            host="h0",
            state=st,
            model_id=MODEL if st != ST.INSTANCE_STATE_IDLE else "",
            num_layers=2 if st != ST.INSTANCE_STATE_IDLE else 0,
            layers_loaded=2 if st in (ST.INSTANCE_STATE_SERVING, ST.INSTANCE_STATE_DRAINING) else 0,
        )

    async def start(self) -> None:
        for iid in self.workers:
            await self.gm.RegisterInstance(
                global_manager_pb2.RegisterInstanceRequest(instance=self.info(iid)), Context()
            )

    async def heartbeat(self, iid: str) -> global_manager_pb2.HeartbeatResponse:
        info = self.info(iid)
        return await self.gm.Heartbeat(
            global_manager_pb2.HeartbeatRequest(
                instance_id=iid,
                state=info.state,
                model_id=info.model_id,
                layers_loaded=info.layers_loaded,
                num_layers=info.num_layers,
                load=self.loads[iid],
            ),
            Context(),
        )

    async def heartbeats(self) -> None:
        for iid in self.workers:
            if iid in self.mute:
                continue
            if (await self.heartbeat(iid)).reregister:
                await self.gm.RegisterInstance(
                    global_manager_pb2.RegisterInstanceRequest(instance=self.info(iid)), Context()
                )

    async def run(self, seconds: float) -> None:
        """Heartbeat and tick every TICK_S for `seconds` of fake time."""
        for _ in range(round(seconds / TICK_S)):
            self.clock.now_s += TICK_S
            await self.heartbeats()
            self.gm.tick()
        self.drain_events()

    def finish_loads(self, error: str = "") -> list[str]:
        """Every load in flight ends (the workers' state follows), in instance order."""
        done = sorted(self.act.loading)
        for iid in done:
            self.workers[iid] = ST.INSTANCE_STATE_IDLE if error else ST.INSTANCE_STATE_SERVING
            self.act.finish_load(iid, error)
        self.drain_events()
        return done

    def finish_load(self, iid: str, error: str = "") -> None:
        self.workers[iid] = ST.INSTANCE_STATE_IDLE if error else ST.INSTANCE_STATE_SERVING
        self.act.finish_load(iid, error)
        self.drain_events()

    def finish_drains(self) -> list[str]:
        done = sorted(self.act.draining)
        for iid in done:
            self.workers[iid] = ST.INSTANCE_STATE_IDLE
            self.loads[iid] = common_pb2.LoadReport()
            self.act.finish_drain(iid, finished=0)
        self.drain_events()
        return done

    def set_load(self, **load: float) -> None:
        for iid, st in self.workers.items():
            if st == ST.INSTANCE_STATE_SERVING:
                self.loads[iid] = common_pb2.LoadReport(**load)

    def find(self, action: str, status: str | None = None, target: str | None = None) -> list[admin_pb2.ClusterEvent]:
        return [
            e
            for e in self.drain_events()
            if e.action == action and (status is None or e.status == status) and (target is None or e.target == target)
        ]


async def started(n_workers: int = 3, **cfg: Any) -> Mesh:
    """A mesh whose min_instances floor is loaded (w0, ... SERVING)."""
    mesh = Mesh(n_workers, **cfg)
    await mesh.start()
    await mesh.run(TICK_S)
    floor = cfg.get("min_instances", 1)
    assert mesh.finish_loads() == [f"w{i}" for i in range(floor)]
    await mesh.run(TICK_S)
    return mesh


async def test_scale_out_on_load_then_in_with_a_victim_drained_each() -> None:
    mesh = await started()
    assert (MODEL, "w0", True) in [(a.model, a.instance_id, a.present) for a in mesh.act.of_type(UpdateLocation)]
    # 50 decode tokens/s against 10 per instance: wants 5, held at max_instances=3. The window
    # fills one heartbeat at a time, so on this clock the decisions are exactly 1->2, then 2->3.
    mesh.set_load(decode_tps=50, running=4)
    await mesh.run(0.6)
    outs = mesh.find("autoscaling_decision", target="scale_out")
    assert [e.status for e in outs] == ["instances:1->2", "instances:2->3"]
    assert all(e.reason.startswith("SCALE_OUT: ratio=") for e in outs)
    loads = [a.instance_ids for a in mesh.act.of_type(LoadInstances) if a.reason.startswith("SCALE_OUT")]
    assert loads == [("w1",), ("w2",)]
    assert [mesh.state(i) for i in ("w1", "w2")] == ["LOADING", "LOADING"]
    # The same load on a full window, while the two load: at the bound, nothing more is asked.
    await mesh.run(0.6)
    assert len(mesh.act.of_type(LoadInstances)) == 3
    assert mesh.finish_loads() == ["w1", "w2"]
    await mesh.run(0.6)  # w0 alone still reports the 50 tokens/s
    assert REGISTRY.get_sample_value("blitzmesh_gm_desired_instances", {"model": MODEL, "role": "COLOCATED"}) == 3
    assert REGISTRY.get_sample_value("blitzmesh_gm_policy_signal", {"model": MODEL, "signal": "need"}) == 5
    assert not mesh.find("scale_out", status="partial")

    # The burst ends; w0 still runs a request, so the idle ones are the victims.
    mesh.set_load(decode_tps=0, running=0)
    mesh.loads["w0"] = common_pb2.LoadReport(running=1)
    await mesh.run(0.6)
    ins = mesh.find("autoscaling_decision", target="scale_in")
    assert [e.status for e in ins] == ["instances:3->2", "instances:2->1"]
    assert all("SCALE_IN" in e.reason for e in ins)
    # Each time the least loaded SERVING instance (ties by id) is the victim.
    assert [a.instance_id for a in mesh.act.of_type(DrainInstance)] == ["w1", "w2"]
    assert mesh.finish_drains() == ["w1", "w2"]
    assert [mesh.state(i) for i in ("w0", "w1", "w2")] == ["SERVING", "IDLE", "IDLE"]
    assert ("w1", False) in [(a.instance_id, a.present) for a in mesh.act.of_type(UpdateLocation)]
    assert len(mesh.find("drain_result", status="idle")) == 2
    lines = list(mesh.gm.decision_log)
    assert any(",autoscaling_decision,scale_out,instances:1->2,SCALE_OUT: ratio=" in line for line in lines)
    assert all(len(line.split(",", 4)) == 5 for line in lines)


async def test_steady_load_reports_no_change_once() -> None:
    mesh = await started()
    before = REGISTRY.get_sample_value("blitzmesh_gm_decisions_total", {"policy": "heteroscale", "action": "no_change"})
    mesh.set_load(decode_tps=10, running=1)  # ratio 1: in band
    await mesh.run(2.0)  # 40 ticks
    in_band = [e for e in mesh.find("autoscaling_decision", target="no_change") if "IN_BAND" in e.reason]
    assert len(in_band) == 1, [e.reason for e in in_band]
    after = REGISTRY.get_sample_value("blitzmesh_gm_decisions_total", {"policy": "heteroscale", "action": "no_change"})
    assert after is not None and after - (before or 0) >= 30


async def test_scale_out_cooldown_holds_the_next_one() -> None:
    mesh = await started(policy_params={"scale_out_cooldown_s": 10})
    mesh.set_load(decode_tps=15, running=2)  # wants 2
    await mesh.run(0.6)
    assert mesh.finish_loads() == ["w1"]
    mesh.set_load(decode_tps=45, running=4)  # wants 3 (the bound), 2 now
    await mesh.run(2.0)
    (held,) = [e for e in mesh.find("autoscaling_decision", target="no_change") if "COOLDOWN" in e.reason]
    assert "scale_out held until" in held.reason
    assert mesh.state("w2") == "IDLE"
    await mesh.run(8.0)  # the cooldown (from the first scale-out) runs out
    assert mesh.state("w2") == "LOADING"


async def test_failed_load_is_retried_on_another_worker_then_rolled_back() -> None:
    mesh = await started(load_retries=1, policy_params={"scale_out_cooldown_s": 600})
    mesh.set_load(decode_tps=15, running=2)  # wants 2
    await mesh.run(0.6)
    mesh.finish_load("w1", error="DATA_LOSS: w1: crc mismatch in layers.1")
    (failed,) = mesh.find("load_result", status="failed")
    assert failed.instance_id == "w1" and "crc" in failed.reason
    (retry,) = [e for e in mesh.find("scale_out", status="loading") if e.reason.startswith("retry 1/1")]
    assert retry.instance_id == "w2" and mesh.state("w1") == "IDLE"
    assert mesh.act.of_type(LoadInstances)[-1] == LoadInstances(
        MODEL, mesh.gm.table.registry.get("w2").role, ("w2",), retry.reason, attempt=1, tried=frozenset({"w1"})
    )
    # The retry fails too: no retries left, rolled back, both IDLE, nothing listed for them.
    mesh.finish_load("w2", error="DATA_LOSS: w2: crc mismatch")
    (rolled,) = mesh.find("scale_out", status="rolled_back")
    assert rolled.instance_id == "w2" and "IDLE again after 1 retries" in rolled.reason
    await mesh.run(0.3)
    assert [mesh.state(i) for i in ("w1", "w2")] == ["IDLE", "IDLE"]
    assert {a.instance_id for a in mesh.act.of_type(UpdateLocation) if a.present} == {"w0"}


async def test_failed_load_without_spare_is_rolled_back() -> None:
    mesh = await started(n_workers=2, load_retries=1, policy_params={"scale_out_cooldown_s": 600})
    mesh.set_load(decode_tps=15, running=2)
    await mesh.run(0.6)
    mesh.finish_load("w1", error="DATA_LOSS: crc")
    (rolled,) = mesh.find("scale_out", status="rolled_back")
    assert rolled.instance_id == "w1" and "no other IDLE worker is left" in rolled.reason
    await mesh.run(0.3)
    assert mesh.state("w1") == "IDLE" and not mesh.act.loading


async def test_advisory_mode_decides_without_acting() -> None:
    mesh = await started(advisory=True)  # min_instances still holds
    mesh.set_load(decode_tps=50, running=4)
    await mesh.run(0.6)
    outs = mesh.find("autoscaling_decision", target="scale_out")
    assert [e.status for e in outs] == ["instances:1->2", "instances:1->3"]
    assert all(e.reason.endswith("ADVISORY: not acted on") for e in outs)
    assert [mesh.state(i) for i in ("w1", "w2")] == ["IDLE", "IDLE"]
    assert [e.reason for e in mesh.find("scale_out")] == ["min_instances=1"]
    now = await mesh.gm.GetCluster(admin_pb2.GetClusterRequest(), Context())
    resp = await mesh.gm.SetPolicy(
        admin_pb2.SetPolicyRequest(policy=now.policy, params=now.policy_params, advisory=False), Context()
    )
    assert not resp.advisory
    await mesh.run(TICK_S)  # the next tick acts
    assert [mesh.state(i) for i in ("w1", "w2")] == ["LOADING", "LOADING"]


async def test_a_lost_instance_is_replaced_to_keep_min_instances() -> None:
    mesh = await started(lost_after_s=1.0, autoscale=False)
    mesh.mute.add("w0")  # its heartbeats stop
    await mesh.run(0.9)
    assert mesh.state("w0") == "SERVING"
    await mesh.run(0.2)
    (lost,) = mesh.find("instance_lost")
    assert lost.instance_id == "w0" and mesh.state("w0") == "LOST"
    assert ("w0", False) in [(a.instance_id, a.present) for a in mesh.act.of_type(UpdateLocation)]
    # The same tick tops the pool up from the IDLE workers.
    assert mesh.state("w1") == "LOADING" and mesh.find("scale_out", status="loading")[-1].instance_id == "w1"


async def test_a_busy_loading_worker_is_not_written_off() -> None:
    mesh = await started(lost_after_s=0.5, policy_params={"scale_out_cooldown_s": 600})
    mesh.mute.add("w1")  # silent while it unpacks parameters
    mesh.set_load(decode_tps=15, running=2)
    await mesh.run(2.0)  # 4x lost_after_s, the load still in flight
    assert mesh.state("w1") == "LOADING" and not mesh.find("instance_lost")
    mesh.finish_load("w1")
    mesh.mute.discard("w1")
    await mesh.run(0.3)
    assert mesh.state("w1") == "SERVING" and not mesh.find("instance_lost")


async def test_scale_in_keeps_one_instance_serving_while_capacity_loads() -> None:
    """The keep-serving rule: a scale-in never drains the last SERVING instance while any is
    wanted, even when the policy counts LOADING ones as capacity."""
    mesh = await started(min_instances=1, max_instances=3, autoscale=False)
    await mesh.gm.Scale(admin_pb2.ScaleRequest(model_id=MODEL, delta=2), Context())
    assert [mesh.state(i) for i in ("w1", "w2")] == ["LOADING", "LOADING"]
    drained = mesh.gm.reconciler.scale_in(
        mesh.gm.table.registry, set(mesh.act.busy()), MODEL, 2, "test", keep_serving=1
    )[0]
    assert drained == []
    assert mesh.state("w0") == "SERVING"


async def test_failed_drain_follows_the_worker() -> None:
    mesh = await started(policy_params={"scale_out_cooldown_s": 600, "scale_in_cooldown_s": 600})
    mesh.set_load(decode_tps=15, running=2)
    await mesh.run(0.6)
    mesh.finish_loads()
    now = await mesh.gm.GetCluster(admin_pb2.GetClusterRequest(), Context())
    await mesh.gm.SetPolicy(
        admin_pb2.SetPolicyRequest(policy=now.policy, params=now.policy_params, advisory=True), Context()
    )
    resp = await mesh.gm.Scale(admin_pb2.ScaleRequest(model_id=MODEL, delta=-1), Context())
    (victim,) = resp.instance_ids
    assert mesh.state(victim) == "DRAINING"
    mesh.act.finish_drain(victim, error="INTERNAL: drain broke")
    (failed,) = mesh.find("drain_result", status="failed")
    assert failed.instance_id == victim and "drain broke" in failed.reason
    await mesh.run(TICK_S)  # the worker still reports SERVING: the registry follows it back
    assert mesh.state(victim) == "SERVING"


async def test_live_migration_releases_running_requests_once_per_cooldown() -> None:
    mesh = await started(
        n_workers=2, min_instances=2, max_instances=2, autoscale=False, live_migration=True, migration_cooldown_s=5
    )
    mesh.loads["w1"] = common_pb2.LoadReport(running=1, kv_blocks_used=10, kv_blocks_total=100)
    mesh.loads["w0"] = common_pb2.LoadReport(running=9, kv_blocks_used=97, kv_blocks_total=100)
    await mesh.run(1.0)
    (move,) = mesh.act.of_type(MigrateRequests)
    assert (move.source, move.n, move.running) == ("w0", 4, True) and "KV 0.97 > 0.95" in move.why
    mesh.act.finish_release(move, moved=4)
    (ev,) = mesh.find("live_migration")
    assert ev.status == "moved" and "released 4 of 4" in ev.reason
    await mesh.run(4.5)
    assert len(mesh.act.of_type(MigrateRequests)) == 2  # the cooldown ran out once


async def test_a_heartbeat_whose_backlog_formed_or_doubled_wakes_the_control_loop() -> None:
    """The queue trigger decides on a burst's first heartbeat, not at the next tick."""
    mesh = Mesh(n_workers=1)
    mesh.gm.ctx = object()  # type: ignore[assignment]  # as when serving: wakes are taken
    await mesh.start()

    async def woken_by(queued: int) -> bool:
        mesh.gm._wake.clear()
        mesh.loads["w0"] = common_pb2.LoadReport(waiting_prefill_tokens=queued, prefill_capacity_tps=1000.0)
        await mesh.heartbeat("w0")
        return mesh.gm._wake.is_set()

    assert not await woken_by(100)  # 0.1 s of wait: under the 0.25 s floor
    assert await woken_by(400)  # 0.4 s, from 0.1 s
    assert not await woken_by(500)  # 0.5 s is not twice 0.4 s
    assert await woken_by(1000)  # doubled
    assert not await woken_by(0)


async def test_the_manager_holds_a_hand_back_while_the_partners_link_sends_parameters() -> None:
    """The servicer's path: w1 loaded while w0, its ZigZag partner, feeds another load's chain.
    The running requests (their KV would leave by w0's link) stay; once that link is free a tick
    hands them back, and the event says how long they waited."""
    mesh = await started(zigzag=True)
    mesh.set_load(decode_tps=50, running=4)  # wants 5, held at max_instances=3: w1 and w2 load
    await mesh.run(0.6)
    assert sorted(mesh.act.loading) == ["w1", "w2"]
    mesh.act.progress("w1", 1, 4)  # its first layer: live
    mesh.gm.zigzag.note_split("w1", "w0")  # as a route that split a request does
    mesh.loads["w0"] = common_pb2.LoadReport(running=6)
    await mesh.run(TICK_S)
    mesh.act.senders = {"w0"}  # w0's link still feeds w2's chain
    mesh.finish_load("w1")
    running = [a for a in mesh.act.of_type(MigrateRequests) if a.running]
    assert running == [] and set(mesh.gm.zigzag.waiting_hand_backs) == {"w1"}
    await mesh.run(TICK_S)
    assert [a for a in mesh.act.of_type(MigrateRequests) if a.running] == []  # still sending
    mesh.act.senders = set()
    await mesh.run(TICK_S)
    (move,) = [a for a in mesh.act.of_type(MigrateRequests) if a.running]
    assert (move.source, move.n) == ("w0", 3)
    (event,) = mesh.find("zigzag_hand_back")
    assert "waited" in event.reason and "for its link to stop sending parameters" in event.reason


async def test_a_burst_during_a_scale_in_takes_the_drain_back() -> None:
    mesh = await started(n_workers=2, max_instances=2)
    mesh.set_load(decode_tps=15, running=2)
    await mesh.run(0.6)
    assert mesh.finish_loads() == ["w1"]
    # A lull: the policy drains one; w0 still runs a request, so w1 is the victim.
    mesh.set_load(decode_tps=0, running=0)
    mesh.loads["w0"] = common_pb2.LoadReport(running=1)
    await mesh.run(0.6)
    assert [a.instance_id for a in mesh.act.of_type(DrainInstance)] == ["w1"] and mesh.state("w1") == "DRAINING"
    # The burst returns before w1's drain ends: no IDLE worker is left, and the drain is taken back.
    mesh.set_load(decode_tps=15, running=2)
    mesh.loads["w1"] = common_pb2.LoadReport(running=1)  # what w1 still runs while it drains
    await mesh.run(0.6)
    assert mesh.act.of_type(ResumeInstance) == [ResumeInstance("w1", MODEL, mesh.act.resuming["w1"].reason)]
    assert mesh.state("w1") == "SERVING"
    (resumed,) = mesh.find("scale_out", status="resumed")
    assert resumed.instance_id == "w1" and "no load" in resumed.reason
    assert not mesh.find("scale_out", status="partial") and len(mesh.act.of_type(LoadInstances)) == 2
    # The worker answers; its Drain then returns "resumed": no unload, still in the location index.
    mesh.act.finish_resume("w1")
    mesh.act.finish_drain("w1", resumed=True)
    mesh.drain_events()
    assert ("w1", False) not in [(a.instance_id, a.present) for a in mesh.act.of_type(UpdateLocation)]
    (result,) = mesh.find("drain_result")
    assert result.status == "resumed" and result.instance_id == "w1"
    await mesh.run(0.2)  # its reports (SERVING) agree
    assert mesh.state("w1") == "SERVING" and not mesh.act.busy()


async def test_the_history_holds_a_scale_out_and_the_samples_around_it() -> None:
    """GetHistory (what a dashboard opened late draws): the events and the cluster samples of the
    last history_window_s, one sample per history_period_s of ticks."""
    mesh = await started(history_window_s=2.0, history_period_s=0.1)
    mesh.set_load(decode_tps=50, running=4, ttft_p50_s=0.3)
    await mesh.run(0.6)
    reply = await mesh.gm.GetHistory(admin_pb2.GetHistoryRequest(), Context())
    assert reply.now_s == mesh.gm.now_s() and reply.window_s == 2.0 and reply.period_s == 0.1
    outs = [e for e in reply.events if e.action == "scale_out"]
    assert [e.instance_id for e in outs] == ["w0", "w1", "w2"]  # the floor, then the two on load
    assert [e.time_s for e in reply.events] == sorted(e.time_s for e in reply.events)
    times = [s.time_s for s in reply.samples]
    assert all(b - a >= 0.1 - 1e-9 for a, b in zip(times, times[1:], strict=False))
    last = reply.samples[-1]
    assert last.decode_tps == 50 and last.ttft_p50_s == 0.3
    assert dict(last.instances_by_state) == {"serving": 1, "loading": 2, "idle": 0, "draining": 0, "lost": 0}
    newer = await mesh.gm.GetHistory(admin_pb2.GetHistoryRequest(since_s=times[-2], samples_only=True), Context())
    assert [s.time_s for s in newer.samples] == times[-1:] and not newer.events
    # Two seconds on, the scale-out is out of the window; the samples keep coming.
    await mesh.run(2.5)
    later = await mesh.gm.GetHistory(admin_pb2.GetHistoryRequest(), Context())
    assert not [e for e in later.events if e.action == "scale_out"]
    assert later.samples[0].time_s >= later.now_s - 2.0 and len(later.samples) <= 21
