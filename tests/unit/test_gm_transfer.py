"""Plans built from parameter-manager locations give every target each group exactly once."""

from __future__ import annotations

import pytest

from blitzmesh.v1 import common_pb2, param_manager_pb2
from services.dataplane.manifest import Manifest, pack_groups
from services.global_manager.transfer import Node, build_plan
from services.worker.loader import plan_pulls

GROUPS = ["embed", *(f"layers.{i}" for i in range(6)), "head"]


def manifest() -> Manifest:
    import torch

    return pack_groups("m", [(g, {"w": torch.zeros(64)}) for g in GROUPS])[0]


def holder(hid: str, kind: str, host: str) -> common_pb2.Holder:
    return common_pb2.Holder(
        holder_id=hid,
        kind=kind,
        host=host,
        grpc_address=f"{hid}:1",
        dataplane_address=f"TCP1{hid}".encode(),
        dataplane_kind="tcp",
    )


def locations(shards: dict[str, list[str]], instances: list[str]) -> param_manager_pb2.LocateResponse:
    out = []
    for g in GROUPS:
        hs = [holder(c, "host_cache", f"cache-host-{c}") for c, gs in shards.items() if g in gs]
        hs += [holder(i, "instance", f"host-{i}") for i in instances]
        out.append(common_pb2.GroupLocation(group=g, holders=[h.holder_id for h in hs], holder_info=hs))
    return param_manager_pb2.LocateResponse(locations=out)


def target(i: int, host: str | None = None) -> Node:
    tid = f"w{i}"
    return Node(tid, host or f"host-{tid}", f"{tid}:1", f"TCP1{tid}".encode(), "tcp")


@pytest.mark.parametrize("n_targets", [1, 2, 3, 4])
@pytest.mark.parametrize("instances", [[], ["s0"]])
def test_every_target_gets_every_group_once(n_targets: int, instances: list[str]) -> None:
    shards = {"hc0": GROUPS[:4], "hc1": GROUPS[4:]}
    where = locations(shards, instances)
    targets = [target(i) for i in range(n_targets)]
    plan, planned = build_plan(targets, where, GROUPS)
    assert planned.chains
    for t in targets:
        pulls = plan_pulls(t.node_id, manifest(), plan, where)
        got = sorted(g for p in pulls for g in (p.groups or ()))
        assert got == sorted(GROUPS)


def test_targets_on_one_host_all_gather() -> None:
    where = locations({"hc0": GROUPS[:4], "hc1": GROUPS[4:]}, [])
    targets = [target(i, host="host-shared") for i in range(3)]
    plan, planned = build_plan(targets, where, GROUPS)
    assert planned.allgather
    for t in targets:
        pulls = plan_pulls(t.node_id, manifest(), plan, where)
        assert sorted(g for p in pulls for g in (p.groups or ())) == sorted(GROUPS)


def test_chain_pulls_fall_back_to_the_host_shard() -> None:
    shards = {"hc0": GROUPS[:4], "hc1": GROUPS[4:]}
    where = locations(shards, ["s0"])
    targets = [target(i) for i in range(3)]
    plan, _ = build_plan(targets, where, GROUPS)
    tail = plan.chains[0].hops[-1].id
    for p in plan_pulls(tail, manifest(), plan, where):
        if p.address not in (b"TCP1hc0", b"TCP1hc1"):
            assert p.fallbacks in ((b"TCP1hc0",), (b"TCP1hc1",))
