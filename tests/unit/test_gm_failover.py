"""Failover in the manager on a fake clock (issue 24, part 1): a gateway reports a failed
instance, the manager marks it suspect at once, routes around it, counts it as no capacity
(nor the loads chained from it) and probes it; retried loads time their own load.

The real servicer with a `RecordingActuator` (see test_gm_control_loop.py): no sockets, no sleeps.
"""

from __future__ import annotations

import pytest

from blitzmesh.v1 import admin_pb2, global_manager_pb2, param_manager_pb2
from services.global_manager.actuator import GrpcActuator
from services.global_manager.config import GlobalManagerConfig
from services.global_manager.core.actions import LoadInstances, UpdateLocation
from services.global_manager.instance_table import InstanceTable, Suspicion
from tests.unit.test_gm_control_loop import MODEL, ST, TICK_S, Aborted, Context, Mesh, started

pytestmark = [pytest.mark.timeout(10), pytest.mark.filterwarnings("error")]


async def report(mesh: Mesh, iid: str, reason: str = "UNAVAILABLE: Socket closed") -> str:
    resp = await mesh.gm.ReportInstanceFailure(
        global_manager_pb2.ReportInstanceFailureRequest(instance_id=iid, reason=reason, reporter="gw"), Context()
    )
    assert resp.known
    mesh.drain_events()
    return str(resp.state)


async def schedule(mesh: Mesh, exclude: tuple[str, ...] = ()) -> global_manager_pb2.Route:
    return await mesh.gm.Schedule(
        global_manager_pb2.ScheduleRequest(request_id="r", model_id=MODEL, exclude_instance_ids=exclude), Context()
    )


async def test_the_only_serving_instance_reported_failed_is_routed_around_and_replaced_at_once() -> None:
    """The default topology's kill: w0 (the only SERVING instance) dies. Long before it would
    go LOST (lost_after_s=30 here), the gateway's report makes it suspect: no route goes there,
    and the first request's Schedule starts a scale-from-zero onto an IDLE worker."""
    mesh = await started(autoscale=False, scale_from_zero=True)
    assert (await schedule(mesh)).hops[0].instance_id == "w0"
    await report(mesh, "w0")
    (suspect,) = mesh.find("instance_suspect")
    assert suspect.instance_id == "w0" and "reported by gw: UNAVAILABLE: Socket closed" in suspect.reason
    with pytest.raises(Aborted) as info:
        await schedule(mesh, exclude=("w0",))
    message = str(info.value)
    assert message.startswith("UNAVAILABLE") and "suspect: ['w0']" in message, message
    assert "scale_from_zero: w1 LOADING" in message, message  # the load started now, not after 30 s
    assert mesh.act.of_type(LoadInstances)[-1].instance_ids == ("w1",)
    # A second report of the same instance changes nothing (40 streams broke at once).
    await report(mesh, "w0")
    assert len(mesh.find("instance_suspect")) == 1
    mesh.finish_load("w1")
    await mesh.run(TICK_S)
    assert (await schedule(mesh)).hops[0].instance_id == "w1"


async def test_the_floor_is_topped_up_past_a_suspect_instance() -> None:
    """min_instances=1 and the one SERVING instance suspect: the next tick loads another, even
    with max_instances reached by counting the suspect one."""
    mesh = await started(autoscale=False, max_instances=1)
    await report(mesh, "w0")
    await mesh.run(TICK_S)
    assert [a.instance_ids for a in mesh.act.of_type(LoadInstances)][-1] == ("w1",)
    assert [e.reason for e in mesh.find("scale_out", status="loading")][-1] == "min_instances=1"


async def test_a_load_chained_from_a_suspect_instance_is_doomed_and_not_counted() -> None:
    mesh = await started(autoscale=False, min_instances=2, n_workers=4)
    assert mesh.state("w1") == "SERVING"
    # A scale-out onto w2, chained from w1 (the planner's report of its chains).
    await mesh.gm.Scale(admin_pb2.ScaleRequest(model_id=MODEL, delta=1), Context())
    assert "w2" in mesh.act.loading
    mesh.gm.load_upstreams({"w2": frozenset({"w1"})})
    assert mesh.gm._unhealthy() == frozenset()
    await report(mesh, "w1")
    assert mesh.gm._unhealthy() == frozenset({"w1", "w2"})
    await mesh.run(TICK_S)
    # Floor 2: w0 is the only instance to count on, so the last IDLE worker loads.
    assert mesh.act.of_type(LoadInstances)[-1].instance_ids == ("w3",)


async def test_the_probe_decides_lost_cleared_or_wait_for_a_heartbeat() -> None:
    mesh = await started(autoscale=False, n_workers=3, min_instances=2)
    gm = mesh.gm
    # Refused: LOST now, its location withdrawn, the event the gateways act on.
    await report(mesh, "w0")
    mesh.act.probes["w0"] = "dead"
    await gm._probe("w0", gm.table.suspects["w0"])
    assert mesh.state("w0") == "LOST" and "w0" not in gm.table.suspects
    (lost,) = mesh.find("instance_lost")
    assert lost.instance_id == "w0" and "refused the manager's probe" in lost.reason
    assert UpdateLocation(MODEL, "w0", present=False) in mesh.act.of_type(UpdateLocation)
    # Answers SERVING: cleared at once.
    await report(mesh, "w1")
    mesh.act.probes["w1"] = "SERVING"
    await gm._probe("w1", gm.table.suspects["w1"])
    assert "w1" not in gm.table.suspects and mesh.state("w1") == "SERVING"
    assert mesh.find("instance_suspect", status="cleared")[-1].instance_id == "w1"
    # No answer (SIGSTOP, or just slow): suspect until it heartbeats again.
    del mesh.act.probes["w1"]  # the recording actuator's probe then answers "silent"
    await report(mesh, "w1")
    await gm._probe("w1", gm.table.suspects["w1"])
    assert "w1" in gm.table.suspects
    mesh.mute = {"w0", "w2"}
    await mesh.run(TICK_S)
    assert "w1" not in gm.table.suspects


async def test_report_validates_and_ignores_unknown_instances() -> None:
    mesh = await started(autoscale=False)
    with pytest.raises(Aborted, match="instance_id is required, got ''"):
        await mesh.gm.ReportInstanceFailure(global_manager_pb2.ReportInstanceFailureRequest(), Context())
    resp = await mesh.gm.ReportInstanceFailure(
        global_manager_pb2.ReportInstanceFailureRequest(instance_id="nobody"), Context()
    )
    assert not resp.known
    # A re-registration (a restarted worker) is a new incarnation: not suspect.
    await report(mesh, "w0")
    await mesh.gm.RegisterInstance(global_manager_pb2.RegisterInstanceRequest(instance=mesh.info("w0")), Context())
    assert "w0" not in mesh.gm.table.suspects


async def test_a_retried_load_reports_its_own_load_time() -> None:
    """A load retried on another worker counts its load_s from the retry (it said 0.000)."""
    mesh = await started(load_retries=1, policy_params={"scale_out_cooldown_s": 600})
    mesh.set_load(decode_tps=15, running=2)  # wants 2
    await mesh.run(0.6)
    mesh.finish_load("w1", error="FAILED_PRECONDITION: loading 'm': PeerUnreachable: dead source")
    assert "w2" in mesh.act.loading
    mesh.clock.now_s += 2.5
    mesh.finish_load("w2")
    ok = mesh.find("load_result", status="ok")[-1]
    assert ok.instance_id == "w2" and ok.reason == "load_s=2.500", ok.reason


def test_the_planner_never_names_a_suspect_source() -> None:
    table = InstanceTable()
    cfg = GlobalManagerConfig(port=0)
    actuator = GrpcActuator(cfg, table, sink=None)  # type: ignore[arg-type]
    mesh = Mesh(2)
    for iid in ("w0", "w1"):
        mesh.workers[iid] = ST.INSTANCE_STATE_SERVING
        table.upsert(mesh.info(iid), 0.0)
    table.suspects["w0"] = Suspicion(1.0, "reported by gw: UNAVAILABLE")
    where = param_manager_pb2.LocateResponse()
    loc = where.locations.add(group="embed", holders=["w0", "w1", "host-cache-0"])
    for holder, kind in (("w0", "instance"), ("w1", "instance"), ("host-cache-0", "host_cache")):
        loc.holder_info.add(holder_id=holder, kind=kind)
    actuator._drop_stale_holders(where)
    assert list(where.locations[0].holders) == ["w1", "host-cache-0"]
    assert [h.holder_id for h in where.locations[0].holder_info] == ["w1", "host-cache-0"]
