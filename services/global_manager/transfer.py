"""Turn "fill these targets with model M" into a TransferPlan (the multicast planner's chains).

Adapter around the pure planner (`core/multicast.py`): it gathers the sources from the
parameter manager's locations (host-cache shards and live instances), completes the
configured topology with any host it does not name (one leaf, default bandwidth: the local
mesh), and converts the planner's chains and all-gathers into the protobuf plan every target
receives. An all-gather becomes one-hop chains between the members of a fast-link group: a
member pulls from another member the groups that one receives (our pull model serves groups
while they are still arriving).
"""

from __future__ import annotations

import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from blitzmesh.v1 import param_manager_pb2, worker_pb2
from services.global_manager.core.multicast import (
    HostLink,
    MulticastPlan,
    Source,
    SourceKind,
    Target,
    Topology,
    TrafficDirection,
    plan_multicast,
    validate_plan,
)

DEFAULT_LEAF = "leaf-0"
DEFAULT_BW_GBPS = 10.0


@dataclass(frozen=True)
class Node:
    """A participant the plan can name: how to reach it over gRPC and the data plane."""

    node_id: str
    host: str
    grpc_address: str
    dataplane_address: bytes
    dataplane_kind: str

    def endpoint(self) -> worker_pb2.TransferEndpoint:
        return worker_pb2.TransferEndpoint(
            id=self.node_id,
            grpc_address=self.grpc_address,
            dataplane_address=self.dataplane_address,
            dataplane_kind=self.dataplane_kind,
        )


def complete_topology(configured: Mapping[str, Any] | None, hosts: Sequence[str]) -> Topology:
    """The configured topology, plus every unnamed host on DEFAULT_LEAF at DEFAULT_BW_GBPS."""
    base = Topology.from_dict(configured) if configured else Topology(hosts={})
    links = dict(base.hosts)
    for h in hosts:
        links.setdefault(h, HostLink(leaf=DEFAULT_LEAF, bw_gbps=DEFAULT_BW_GBPS))
    return Topology(hosts=links, fast_groups=base.fast_groups)


def sources_from_locations(
    where: param_manager_pb2.LocateResponse, exclude: set[str]
) -> tuple[list[Source], dict[str, Node]]:
    """Planner sources (instances hold everything, host caches their shard) and their nodes."""
    held: dict[str, set[str]] = {}
    nodes: dict[str, Node] = {}
    kinds: dict[str, SourceKind] = {}
    all_groups = [loc.group for loc in where.locations]
    for loc in where.locations:
        for h in loc.holder_info:
            if h.holder_id in exclude or not h.dataplane_address:
                continue
            held.setdefault(h.holder_id, set()).add(loc.group)
            nodes[h.holder_id] = Node(
                h.holder_id, h.host or h.holder_id, h.grpc_address, h.dataplane_address, h.dataplane_kind
            )
            kinds[h.holder_id] = SourceKind.HOST_CACHE if h.kind == "host_cache" else SourceKind.INSTANCE
    sources = []
    for node_id in sorted(held):
        kind = kinds[node_id]
        complete = kind is SourceKind.INSTANCE and held[node_id] >= set(all_groups)
        sources.append(
            Source(
                node_id=node_id,
                host=nodes[node_id].host,
                kind=kind,
                groups=None if complete else frozenset(held[node_id]),
            )
        )
    return sources, nodes


def to_proto(plan: MulticastPlan, nodes: Mapping[str, Node], timeout_s: float) -> worker_pb2.TransferPlan:
    chains = [
        worker_pb2.ChainSpec(
            source=nodes[c.source].endpoint(), hops=[nodes[h].endpoint() for h in c.hops], groups=list(c.groups)
        )
        for c in plan.chains
    ]
    for ag in plan.allgather:
        for member in ag.members:
            for other in ag.members:
                if other != member and ag.received.get(other):
                    chains.append(
                        worker_pb2.ChainSpec(
                            source=nodes[other].endpoint(),
                            hops=[nodes[member].endpoint()],
                            groups=list(ag.received[other]),
                        )
                    )
    return worker_pb2.TransferPlan(plan_id=uuid.uuid4().hex[:12], chains=chains, timeout_s=timeout_s)


def build_plan(
    targets: Sequence[Node],
    where: param_manager_pb2.LocateResponse,
    groups: Sequence[str],
    topology: Mapping[str, Any] | None = None,
    timeout_s: float = 300.0,
    serving_traffic: Mapping[str, TrafficDirection] | None = None,
) -> tuple[worker_pb2.TransferPlan, MulticastPlan]:
    """The plan that fills `targets` with every group, and the planner's own plan (for logs).

    `serving_traffic` (node id -> direction, `traffic_from_instances`) lets the planner keep
    parameters off links that already carry serving traffic out: with prefill/decode split,
    parameters come from decode instances, then host shards, and prefill instances only for a
    group nobody else holds.
    """
    target_ids = {t.node_id for t in targets}
    sources, nodes = sources_from_locations(where, exclude=target_ids)
    nodes.update({t.node_id: t for t in targets})
    topo = complete_topology(topology, [n.host for n in nodes.values()])
    planned = plan_multicast(
        [Target(t.node_id, t.host) for t in targets], sources, topo, serving_traffic, groups=list(groups)
    )
    validate_plan(planned, [Target(t.node_id, t.host) for t in targets], sources, list(groups))
    return to_proto(planned, nodes, timeout_s), planned
