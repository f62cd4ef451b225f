"""ZigZag pulled by loading instances, the manager's side (`--zigzag-dispatch pull`), on the
control-loop harness's fake clock: a live LOADING instance is paired with an overloaded SERVING
one, which learns it (with its in-flight cap) from its heartbeat answer; no request is routed to
the pair; the pairing ends when the load does."""

from __future__ import annotations

import pytest

from blitzmesh.v1 import common_pb2, global_manager_pb2
from tests.unit.test_gm_control_loop import MODEL, Context, Mesh, started

pytestmark = [pytest.mark.timeout(10), pytest.mark.filterwarnings("error")]


class DataplaneMesh(Mesh):
    """Workers that advertise a data plane (a ZigZag peer must have one)."""

    def info(self, iid: str) -> common_pb2.InstanceInfo:
        info = super().info(iid)
        info.dataplane_address = f"dp-{iid}".encode()
        return info


async def test_a_live_loading_instance_is_paired_with_an_overloaded_one_through_its_heartbeat(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr("tests.unit.test_gm_control_loop.Mesh", DataplaneMesh)
    mesh = await started(3, zigzag_dispatch="pull", max_instances=2)
    assert (mesh.gm.zigzag.settings.dispatch, mesh.gm.zigzag.settings.pull_limit) == ("pull", 8)
    mesh.set_load(decode_tps=50, running=4, waiting=6, kv_blocks_used=10, kv_blocks_total=100)
    await mesh.run(0.3)
    assert mesh.state("w1") == "LOADING"
    assert (await mesh.heartbeat("w0")).zigzag_peers == []  # no layer yet: not live
    # 1 of 4 decoder layers in (embed + 4 layers + head = 6 groups): w1 goes live.
    mesh.act.progress("w1", 1, 6)
    (peer,) = (await mesh.heartbeat("w0")).zigzag_peers
    assert (peer.instance_id, peer.layers_loaded, peer.num_layers) == ("w1", 1, 4)
    assert peer.dataplane_address == b"dp-w1" and peer.address == "w1:1"
    assert peer.inflight_limit == 8  # --zigzag-pull-limit: a puller runs ahead a step's worth of admissions
    (pair,) = mesh.find("zigzag_pair")
    assert (pair.instance_id, pair.target, pair.status) == (
        "w1",
        MODEL,
        "w0",
    ) and "pulls queued requests from w0" in pair.reason
    # 0.6 s later k has grown; a puller's cap does not shrink (the routed one is down to 2).
    mesh.clock.now_s += 0.6
    mesh.act.progress("w1", 3, 6)
    (peer,) = (await mesh.heartbeat("w0")).zigzag_peers
    assert (peer.layers_loaded, peer.inflight_limit) == (3, 8)
    # Every decoder layer, the head still loading: it still pulls, and runs all four.
    mesh.act.progress("w1", 4, 6)
    (peer,) = (await mesh.heartbeat("w0")).zigzag_peers
    assert (peer.instance_id, peer.layers_loaded) == ("w1", 4)
    # Nothing is routed to the pair: the partner's queue is the work.
    route = await mesh.gm.Schedule(global_manager_pb2.ScheduleRequest(request_id="r", model_id=MODEL), Context())
    assert [h.instance_id for h in route.hops] == ["w0"]
    # The load ends: no peer any more.
    mesh.finish_load("w1")
    await mesh.run(0.1)
    assert (await mesh.heartbeat("w0")).zigzag_peers == []
    assert len(mesh.find("zigzag_pair")) == 1


async def test_route_dispatch_names_no_peer(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("tests.unit.test_gm_control_loop.Mesh", DataplaneMesh)
    mesh = await started(3, zigzag_dispatch="route", max_instances=2)
    mesh.set_load(decode_tps=50, running=4, waiting=6)
    await mesh.run(0.3)
    mesh.act.progress("w1", 1, 6)
    assert (await mesh.heartbeat("w0")).zigzag_peers == []
