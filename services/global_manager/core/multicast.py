"""Multicast planner: turns "load these targets" into serial forwarding chains (docs/algorithms.md 2).

The plan, step by step:
1. Prune sources whose outgoing link already carries serving traffic (in P/D disaggregation the
   prefill side ships KV out, so parameters come from decode instances). Pruned sources come
   back, best first, only if without them some parameter group would have no source at all.
2. Collapse fast-local-link groups: targets on one host or in one `Topology.fast_groups` entry
   form one unit. A unit whose group also holds sources that together have every parameter group
   is filled over the fast link alone (`Chain.local`), without touching the network.
3. Chains ("lanes"), one per leaf switch that has both sources and targets. Units on leaves with
   no source go to lanes fed from source-only leaves (at most one such lane per orphan unit),
   then to whichever lane is shortest. At most `max_chains` lanes; so the lane count is at most
   min(sources, target units, max_chains). Within a lane, units are ordered by decreasing link
   bandwidth: a faster receiver finishes, and starts serving, sooner.
4. Sharded transfer: a lane whose largest unit has m members uses g = min(m, sources on the
   leaf) sources; each sends a disjoint, interleaved ~1/g of the parameter groups (group i goes
   to the least-loaded source holding it, so the first layers arrive first) along its own chain,
   entering each unit at a different member; the members then all-gather the rest over the fast
   link. Partial sources (host-cache shards) are topped up with other sources that hold what
   the lane lacks, same leaf first, each taking at most a shard's share (len(groups) / the
   lane's chains) while the lane has NICs for more chains. A source already sending for an
   earlier lane goes after the idle ones (its NIC would carry two chains).

Everything is pure and deterministic: ties break on names, never on dict or set order.
Bandwidth is in gigabits per second (`bw_gbps`), sizes in bytes.
"""

from __future__ import annotations

import heapq
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from enum import Enum
from typing import Any

from .types import InstanceState, InstanceView

__all__ = [
    "AllGather",
    "Chain",
    "HostLink",
    "MulticastPlan",
    "SendingLinks",
    "Source",
    "SourceKind",
    "Target",
    "Topology",
    "TrafficDirection",
    "chain_fill_time_s",
    "estimate_plan_time_s",
    "plan_multicast",
    "traffic_from_instances",
    "traffic_from_roles",
    "unicast_fill_time_s",
    "validate_plan",
]


class SourceKind(str, Enum):
    INSTANCE = "instance"  # a live worker holding the whole model
    HOST_CACHE = "host_cache"  # a parameter-manager process holding some layers in host memory


class TrafficDirection(str, Enum):
    """Serving traffic on a node's network link, seen from the node."""

    OUT = "out"  # e.g. a prefill instance shipping KV to decode instances
    IN = "in"  # e.g. a decode instance receiving that KV
    BOTH = "both"


@dataclass(frozen=True, slots=True)
class HostLink:
    leaf: str
    bw_gbps: float


@dataclass(frozen=True)
class Topology:
    """Leaf switch and NIC bandwidth of every host, and which hosts share a fast local link.

    Nodes on the same host always share its fast local link; `fast_groups` joins hosts further
    (e.g. an NVLink domain spanning trays).
    """

    hosts: Mapping[str, HostLink]
    fast_groups: tuple[frozenset[str], ...] = ()
    _group_of: dict[str, frozenset[str]] = field(default_factory=dict, init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        for host, link in self.hosts.items():
            if not link.bw_gbps > 0:
                raise ValueError(f"host {host!r}: bw_gbps must be > 0, got {link.bw_gbps!r}")
            if not link.leaf:
                raise ValueError(f"host {host!r}: leaf switch name must be non-empty")
        for group in self.fast_groups:
            unknown = sorted(h for h in group if h not in self.hosts)
            if unknown:
                raise ValueError(f"fast group {sorted(group)!r} names unknown hosts {unknown!r}")
            for host in group:
                if host in self._group_of:
                    raise ValueError(
                        f"host {host!r} is in two fast groups: {sorted(self._group_of[host])!r} and {sorted(group)!r}"
                    )
                self._group_of[host] = group

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> Topology:
        """`{"hosts": {"h0": {"leaf": "leaf0", "bw_gbps": 100}}, "fast_groups": [["h0", "h1"]]}`."""
        extra = sorted(set(data) - {"hosts", "fast_groups"})
        if extra:
            raise ValueError(f"topology has unknown keys {extra!r}; expected 'hosts' and 'fast_groups'")
        hosts_in = data.get("hosts")
        if not isinstance(hosts_in, Mapping):
            raise ValueError(f"topology 'hosts' must map host -> {{leaf, bw_gbps}}, got {hosts_in!r}")
        hosts: dict[str, HostLink] = {}
        for host, entry in hosts_in.items():
            if not isinstance(entry, Mapping) or set(entry) != {"leaf", "bw_gbps"}:
                raise ValueError(f"topology host {host!r} needs exactly 'leaf' and 'bw_gbps', got {entry!r}")
            try:
                bw_gbps = float(entry["bw_gbps"])
            except (TypeError, ValueError):
                raise ValueError(f"topology host {host!r}: bw_gbps {entry['bw_gbps']!r} is not a number") from None
            hosts[str(host)] = HostLink(leaf=str(entry["leaf"]), bw_gbps=bw_gbps)
        groups = tuple(frozenset(str(h) for h in g) for g in data.get("fast_groups", ()))
        return cls(hosts=hosts, fast_groups=groups)

    def link(self, host: str) -> HostLink:
        try:
            return self.hosts[host]
        except KeyError:
            raise ValueError(f"host {host!r} is not in the topology") from None

    def group_key(self, host: str) -> str:
        """A name for the fast-link group of `host` (the smallest host name in it)."""
        group = self._group_of.get(host)
        return min(group) if group else host


@dataclass(frozen=True, slots=True)
class Source:
    """Somewhere parameters can be read from. `groups` None means every group (a live
    instance); a host-cache shard lists the groups it holds."""

    node_id: str
    host: str
    kind: SourceKind = SourceKind.INSTANCE
    groups: frozenset[str] | None = None

    def holds(self, group: str) -> bool:
        return self.groups is None or group in self.groups


@dataclass(frozen=True, slots=True)
class Target:
    node_id: str
    host: str


@dataclass(frozen=True, slots=True)
class Chain:
    """`source` sends `groups` (in this order) to hops[0], which forwards each chunk to hops[1]
    as soon as it lands, and so on. Shards of one lane share `lane`; `local` chains run over a
    fast local link only."""

    source: str
    hops: tuple[str, ...]
    groups: tuple[str, ...]
    lane: int = 0
    local: bool = False


@dataclass(frozen=True, slots=True)
class AllGather:
    """Targets on one fast link that exchange what each received until all hold every group.
    `received[member]` lists the groups that member got from chains."""

    members: tuple[str, ...]
    received: Mapping[str, tuple[str, ...]]


@dataclass(frozen=True, slots=True)
class MulticastPlan:
    chains: tuple[Chain, ...]
    allgather: tuple[AllGather, ...]
    pruned_sources: tuple[str, ...] = ()
    busy_sources_used: tuple[str, ...] = ()

    @property
    def num_lanes(self) -> int:
        """Network chains, counting the shards of one lane once."""
        return len({c.lane for c in self.chains if not c.local})


def traffic_from_roles(roles: Mapping[str, str]) -> dict[str, TrafficDirection]:
    """Serving traffic per node from its role name: prefill ships KV out, decode takes it in.
    Colocated instances only stream tokens, which does not count."""
    table = {"PREFILL": TrafficDirection.OUT, "DECODE": TrafficDirection.IN}
    return {node: table[r.upper()] for node, r in roles.items() if r.upper() in table}


def traffic_from_instances(instances: Iterable[InstanceView], model: str | None = None) -> dict[str, TrafficDirection]:
    """Serving traffic of the instances that carry it now: SERVING or DRAINING (a draining
    prefill instance still ships the KV of its last requests) instances of `model` (any model
    when None), by role. LOADING ones serve nothing yet. Keys are instance ids, which are the
    holder ids a live instance has in the parameter manager's locations."""
    live = (InstanceState.SERVING, InstanceState.DRAINING)
    return traffic_from_roles(
        {v.instance_id: v.role.value for v in instances if v.state in live and (model is None or v.model == model)}
    )


class SendingLinks:
    """Which nodes' outgoing links carry parameters now: the sources and middle hops of the
    network chains of plans whose targets are still loading.

    A scale-out decided while an earlier one still transfers should not start a second chain
    from the same sender: both would get half its link (measured in bench.live_scaling, where
    two chains from one serving instance took 1.8x the single-chain time each). `traffic`
    marks those nodes as sending, so `plan_multicast` prunes them like serving traffic and
    takes another source (a host-cache copy, another instance) when one holds the groups.
    """

    def __init__(self) -> None:
        self._targets_by_sender: dict[str, set[str]] = {}

    def start(self, plan: MulticastPlan, targets: Iterable[str]) -> None:
        """`plan` now transfers to `targets`."""
        waiting = set(targets)
        for chain in plan.chains:
            if chain.local:
                continue  # a fast local link, not the network
            for node in (chain.source, *chain.hops[:-1]):
                self._targets_by_sender.setdefault(node, set()).update(waiting)

    def finish(self, target: str) -> None:
        """`target`'s load ended (done or failed): its senders are free of it."""
        for node in list(self._targets_by_sender):
            self._targets_by_sender[node].discard(target)
            if not self._targets_by_sender[node]:
                del self._targets_by_sender[node]

    @property
    def senders(self) -> frozenset[str]:
        return frozenset(self._targets_by_sender)

    def traffic(self, serving: Mapping[str, TrafficDirection]) -> dict[str, TrafficDirection]:
        """`serving` traffic plus OUT for every sending node (BOTH where serving traffic is IN)."""
        out = dict(serving)
        for node in self._targets_by_sender:
            out[node] = (
                TrafficDirection.OUT
                if out.get(node, TrafficDirection.OUT) is TrafficDirection.OUT
                else TrafficDirection.BOTH
            )
        return out


# ------------------------------------------------------------------------------------------
# Planning
# ------------------------------------------------------------------------------------------


@dataclass(slots=True)
class _Unit:
    key: str
    members: list[Target]
    leaf: str
    bw_gbps: float

    @property
    def name(self) -> str:
        return self.members[0].node_id


@dataclass(slots=True)
class _Lane:
    leaf: str
    sources: list[Source]
    units: list[_Unit]


def _check_inputs(
    targets: Sequence[Target],
    sources: Sequence[Source],
    topology: Topology,
    groups: Sequence[str],
    max_chains: int | None,
) -> None:
    if not groups:
        raise ValueError("groups must list at least one parameter group")
    if len(set(groups)) != len(groups):
        raise ValueError(f"groups has duplicates: {sorted(g for g in set(groups) if groups.count(g) > 1)!r}")
    if max_chains is not None and max_chains < 1:
        raise ValueError(f"max_chains must be >= 1, got {max_chains!r}")
    seen: set[str] = set()
    for node in (*targets, *sources):
        if node.node_id in seen:
            raise ValueError(f"node {node.node_id!r} is given twice (as target or source)")
        seen.add(node.node_id)
        topology.link(node.host)
    known = set(groups)
    for src in sources:
        if src.groups is not None and not src.groups <= known:
            raise ValueError(f"source {src.node_id!r} holds unknown groups {sorted(src.groups - known)!r}")


def _source_order(topology: Topology) -> Callable[[Source], tuple[bool, float, str]]:
    # Live instances first, then host shards, then faster links, then name (docs/algorithms.md 2).
    def key(src: Source) -> tuple[bool, float, str]:
        return (src.kind is not SourceKind.INSTANCE, -topology.link(src.host).bw_gbps, src.node_id)

    return key


def _covers(sources: Iterable[Source], groups: Sequence[str]) -> bool:
    srcs = list(sources)
    if any(s.groups is None for s in srcs):
        return True
    held: set[str] = set()
    for s in srcs:
        held |= s.groups or frozenset()
    return held.issuperset(groups)


def _prune(
    sources: list[Source], traffic: Mapping[str, TrafficDirection], groups: Sequence[str]
) -> tuple[list[Source], list[str], list[str]]:
    busy_dirs = (TrafficDirection.OUT, TrafficDirection.BOTH)
    kept = [s for s in sources if traffic.get(s.node_id) not in busy_dirs]
    busy = [s for s in sources if traffic.get(s.node_id) in busy_dirs]
    used_busy: list[str] = []
    full_copy = any(s.groups is None for s in kept)
    held: set[str] = set() if full_copy else set().union(*(s.groups or () for s in kept))
    # Fallback: a busy link beats no source at all, but only for groups nobody else has.
    for group in groups:
        if full_copy or group in held:
            continue
        helper = next((s for s in busy if s.holds(group) and s.node_id not in used_busy), None)
        if helper is None:
            raise ValueError(f"no source holds parameter group {group!r}")
        kept.append(helper)
        used_busy.append(helper.node_id)
        if helper.groups is None:
            full_copy = True
        else:
            held |= helper.groups
    pruned = [s.node_id for s in busy if s.node_id not in used_busy]
    return kept, sorted(pruned), sorted(used_busy)


def _assign(
    groups: Sequence[str],
    lane_sources: list[Source],
    backups: Callable[[], Iterable[Source]],
    max_chains: int | None = None,
) -> dict[str, list[str]]:
    """Give each group to the source holding it that has the fewest so far (earlier on ties),
    so full sources interleave layers round-robin. When no lane source holds a group, the first
    backup that does joins the lane. With `max_chains` (the chains the lane's units have NICs
    for), another backup also joins when the group would go to a backup that already carries
    its share, len(groups) / max_chains, and the lane has fewer chains than that: partial lane
    sources (host-cache shards) leave the groups they lack to backups, and one backup taking all
    of them would be the lane's slowest chain by far. Mutates `lane_sources`."""
    share = -(-len(groups) // max_chains) if max_chains is not None else 0
    assigned: dict[str, list[str]] = {s.node_id: [] for s in lane_sources}
    joined: set[str] = set()
    for group in groups:
        best: Source | None = None
        for src in lane_sources:
            if src.holds(group) and (best is None or len(assigned[src.node_id]) < len(assigned[best.node_id])):
                best = src
        spread = (
            max_chains is not None
            and best is not None
            and best.node_id in joined
            and len(assigned[best.node_id]) >= share
            and len(lane_sources) < max_chains
        )
        if best is None or spread:
            backup = next((s for s in backups() if s.holds(group) and s.node_id not in assigned), None)
            if backup is None and best is None:
                raise ValueError(f"no source holds parameter group {group!r}")
            if backup is not None:
                lane_sources.append(backup)
                assigned[backup.node_id] = []
                joined.add(backup.node_id)
                best = backup
        assert best is not None
        assigned[best.node_id].append(group)
    return assigned


def plan_multicast(
    targets: Sequence[Target],
    sources: Sequence[Source],
    topology: Topology,
    serving_traffic: Mapping[str, TrafficDirection] | None = None,
    *,
    groups: Sequence[str],
    max_chains: int | None = None,
) -> MulticastPlan:
    """Plan how `targets` receive every parameter group in `groups` (in load order) from
    `sources`. `serving_traffic` maps node id -> direction of its serving traffic.
    `max_chains` caps the network lanes (the "needed" of docs/algorithms.md 2).
    Raises ValueError for bad input or a group that no source holds."""
    _check_inputs(targets, sources, topology, groups, max_chains)
    if not targets:
        return MulticastPlan(chains=(), allgather=())
    order = _source_order(topology)
    all_sources = sorted(sources, key=order)

    # Step 2: units. Members fastest first so a chain enters each unit at its best NIC.
    by_key: dict[str, list[Target]] = {}
    for t in targets:
        by_key.setdefault(topology.group_key(t.host), []).append(t)
    units: list[_Unit] = []
    for key in sorted(by_key):
        members = sorted(by_key[key], key=lambda t: (-topology.link(t.host).bw_gbps, t.node_id))
        first = topology.link(members[0].host)
        units.append(_Unit(key=key, members=members, leaf=first.leaf, bw_gbps=first.bw_gbps))

    chains: list[Chain] = []
    lane_no = 0
    # A unit whose own fast-link group holds a full copy needs no network at all.
    sources_by_key: dict[str, list[Source]] = {}
    for src in all_sources:
        sources_by_key.setdefault(topology.group_key(src.host), []).append(src)
    remote_units: list[_Unit] = []
    for unit in units:
        local = sources_by_key.get(unit.key, [])
        if local and _covers(local, groups):
            # One full source suffices; otherwise the local shards split the groups.
            feeders = [local[0]] if local[0].groups is None else list(local)
            chains.extend(_lane_chains([unit], feeders, lambda: (), groups, lane=lane_no, local=True))
            lane_no += 1
        else:
            remote_units.append(unit)
    if not remote_units:
        return MulticastPlan(chains=tuple(chains), allgather=_allgathers(units, chains))

    # Step 1: prune, for network sends only (a fast-link copy does not touch the NIC).
    kept, pruned, used_busy = _prune(all_sources, serving_traffic or {}, groups)
    # Busy sources that had to come back go last, so they only fill what others lack.
    busy_ids = set(used_busy)
    kept.sort(key=lambda s: (s.node_id in busy_ids, *order(s)))

    # Step 3: lanes.
    src_by_leaf: dict[str, list[Source]] = {}
    for src in kept:
        src_by_leaf.setdefault(topology.link(src.host).leaf, []).append(src)
    units_by_leaf: dict[str, list[_Unit]] = {}
    for unit in remote_units:
        units_by_leaf.setdefault(unit.leaf, []).append(unit)

    lanes: list[_Lane] = []
    orphans: list[_Unit] = []
    for leaf in sorted(units_by_leaf, key=lambda lf: (-len(units_by_leaf[lf]), lf)):
        if leaf in src_by_leaf:
            lanes.append(_Lane(leaf=leaf, sources=src_by_leaf[leaf], units=list(units_by_leaf[leaf])))
        else:
            orphans.extend(units_by_leaf[leaf])
    if orphans:
        spare = sorted(
            (lf for lf in src_by_leaf if lf not in units_by_leaf), key=lambda lf: (order(src_by_leaf[lf][0]), lf)
        )
        lanes.extend(_Lane(leaf=lf, sources=src_by_leaf[lf], units=[]) for lf in spare[: len(orphans)])
    if max_chains is not None and len(lanes) > max_chains:
        for lane in lanes[max_chains:]:
            orphans.extend(lane.units)
        del lanes[max_chains:]
    # _prune guarantees a source, and every source's leaf is a lane or a spare: never empty.
    assert lanes, "no lane despite sources"
    # Orphans, fastest first, each to the currently shortest lane (earlier lane on ties).
    heap = [(len(lane.units), i) for i, lane in enumerate(lanes)]
    heapq.heapify(heap)
    for unit in sorted(orphans, key=lambda u: (-u.bw_gbps, u.name)):
        length, i = heapq.heappop(heap)
        lanes[i].units.append(unit)
        heapq.heappush(heap, (length + 1, i))

    # Step 4: shards and chains per lane. A source already sending for an earlier lane goes
    # after those that are not (a stable reorder): its NIC would be shared.
    sending: set[str] = set()
    for lane in lanes:
        if not lane.units:
            continue
        lane.units.sort(key=lambda u: (-u.bw_gbps, u.name))
        shards = min(len(lane.sources), max(len(u.members) for u in lane.units))
        lane.sources = sorted(_spread_hosts(lane.sources), key=lambda src: src.node_id in sending)
        lane_ids = {s.node_id for s in lane.sources}
        # Ordered once per lane (`sending` grows only after the lane is planned).
        others = sorted((s for s in kept if s.node_id not in lane_ids), key=lambda src: src.node_id in sending)

        def backups(lane: _Lane = lane, shards: int = shards, others: list[Source] = others) -> Iterable[Source]:
            # Same leaf first (no spine hop), then anyone, best first; idle senders first.
            yield from lane.sources[shards:]
            yield from others

        lane_chains = _lane_chains(lane.units, list(lane.sources[:shards]), backups, groups, lane=lane_no, local=False)
        sending.update(c.source for c in lane_chains)
        chains.extend(lane_chains)
        lane_no += 1

    return MulticastPlan(
        chains=tuple(chains),
        allgather=_allgathers(units, chains),
        pruned_sources=tuple(pruned),
        busy_sources_used=tuple(used_busy),
    )


def _spread_hosts(sources: list[Source]) -> list[Source]:
    """Stable reorder putting each host's best source before any host's second: shards on
    one host would share its NIC and gain nothing."""
    rank: dict[str, int] = {}
    keyed = []
    for i, src in enumerate(sources):
        n = rank.get(src.host, 0)
        rank[src.host] = n + 1
        keyed.append((n, i, src))
    return [src for _, _, src in sorted(keyed, key=lambda x: (x[0], x[1]))]


def _lane_chains(
    units: list[_Unit],
    feeders: list[Source],
    backups: Callable[[], Iterable[Source]],
    groups: Sequence[str],
    *,
    lane: int,
    local: bool,
) -> list[Chain]:
    # A network lane enters each unit at member k (mod size): it has NICs for that many chains.
    assigned = _assign(groups, feeders, backups, None if local else max(len(u.members) for u in units))
    chains = []
    for k, src in enumerate(feeders):
        carried = assigned[src.node_id]
        if not carried:
            continue
        if local:
            hops = tuple(m.node_id for u in units for m in u.members)
        else:
            # Shard k enters every unit at member k (mod size): disjoint NICs take disjoint shards.
            hops = tuple(u.members[k % len(u.members)].node_id for u in units)
        chains.append(Chain(source=src.node_id, hops=hops, groups=tuple(carried), lane=lane, local=local))
    return chains


def _allgathers(units: Sequence[_Unit], chains: Sequence[Chain]) -> tuple[AllGather, ...]:
    received: dict[str, list[str]] = {}
    for chain in chains:
        for hop in chain.hops:
            received.setdefault(hop, []).extend(chain.groups)
    out = []
    for unit in units:
        if len(unit.members) < 2:
            continue
        names = tuple(m.node_id for m in unit.members)
        got = {n: tuple(received.get(n, ())) for n in names}
        pooled = set().union(*got.values())
        if all(set(g) == pooled for g in got.values()):
            continue  # every member already has everything (e.g. a local chain through all)
        out.append(AllGather(members=names, received=got))
    return tuple(out)


# ------------------------------------------------------------------------------------------
# Validation and cost model
# ------------------------------------------------------------------------------------------


def validate_plan(
    plan: MulticastPlan, targets: Sequence[Target], sources: Sequence[Source], groups: Sequence[str]
) -> None:
    """Raise ValueError naming the first problem: unknown node, empty chain, duplicate target,
    a source sending what it does not hold, or a target left missing some groups."""
    target_ids = {t.node_id for t in targets}
    source_by_id = {s.node_id: s for s in sources}
    known_groups = set(groups)
    delivered: dict[tuple[str, str], int] = {}
    received: dict[str, set[str]] = {t: set() for t in target_ids}
    for i, chain in enumerate(plan.chains):
        src = source_by_id.get(chain.source)
        if src is None:
            raise ValueError(f"chain {i}: unknown source node {chain.source!r}")
        if not chain.hops:
            raise ValueError(f"chain {i} from {chain.source!r} is empty (no hops)")
        if not chain.groups:
            raise ValueError(f"chain {i} from {chain.source!r} carries no parameter groups")
        unknown = [h for h in chain.hops if h not in target_ids]
        if unknown:
            raise ValueError(f"chain {i} from {chain.source!r}: unknown target nodes {unknown!r}")
        dupes = sorted({h for h in chain.hops if chain.hops.count(h) > 1})
        if dupes:
            raise ValueError(f"chain {i} from {chain.source!r}: duplicate targets {dupes!r}")
        bad_groups = sorted(set(chain.groups) - known_groups)
        if bad_groups:
            raise ValueError(f"chain {i} from {chain.source!r}: unknown parameter groups {bad_groups!r}")
        missing = sorted(g for g in chain.groups if not src.holds(g))
        if missing:
            raise ValueError(f"chain {i}: source {chain.source!r} does not hold groups {missing!r}")
        for hop in chain.hops:
            for group in chain.groups:
                if (hop, group) in delivered:
                    raise ValueError(
                        f"duplicate target {hop!r}: group {group!r} arrives by chains {delivered[(hop, group)]} and {i}"
                    )
                delivered[(hop, group)] = i
            received[hop].update(chain.groups)
    complete = {t: set(g) for t, g in received.items()}
    in_gather: set[str] = set()
    for gather in plan.allgather:
        unknown = [m for m in gather.members if m not in target_ids]
        if unknown:
            raise ValueError(f"all-gather {list(gather.members)!r}: unknown target nodes {unknown!r}")
        twice = [m for m in gather.members if m in in_gather]
        if twice:
            raise ValueError(f"targets {twice!r} are in more than one all-gather")
        in_gather.update(gather.members)
        pooled = set().union(*(received[m] for m in gather.members))
        for member in gather.members:
            complete[member] = pooled
    for target in sorted(target_ids):
        gap = [g for g in groups if g not in complete[target]]
        if gap:
            raise ValueError(f"layer coverage gap: target {target!r} never receives groups {gap!r}")


def chain_fill_time_s(size_bytes: float, chunk_bytes: float, n_targets: int, bw_gbps: float) -> float:
    """Pipelined chain with the network as bottleneck: size/bw + (n - 1) * chunk/bw."""
    if n_targets < 1:
        raise ValueError(f"n_targets must be >= 1, got {n_targets!r}")
    bytes_per_s = bw_gbps * 1e9 / 8
    return size_bytes / bytes_per_s + (n_targets - 1) * min(chunk_bytes, size_bytes) / bytes_per_s


def unicast_fill_time_s(size_bytes: float, n_targets: int, bw_gbps: float) -> float:
    """One source sending the whole payload to each target in turn: n * size/bw."""
    return n_targets * size_bytes / (bw_gbps * 1e9 / 8)


def estimate_plan_time_s(
    plan: MulticastPlan,
    topology: Topology,
    hosts: Mapping[str, str],
    bytes_per_group: float,
    chunk_bytes: float,
    fast_link_gbps: float = 900.0,
) -> float:
    """Rough time until every target holds every group: the slowest chain (its bottleneck link
    over its hops), plus the all-gather over the fast link. Ignores NICs shared by several
    chains; good for comparing plans, not for promising a number. `hosts` maps node -> host."""
    worst_s = 0.0
    for chain in plan.chains:
        size = bytes_per_group * len(chain.groups)
        if chain.local:
            bw = fast_link_gbps
        else:
            bw = min(topology.link(hosts[n]).bw_gbps for n in (chain.source, *chain.hops))
        worst_s = max(worst_s, chain_fill_time_s(size, chunk_bytes, len(chain.hops), bw))
    gather_s = 0.0
    for gather in plan.allgather:
        got = [set(g) for g in gather.received.values()]
        total = len(set().union(*got))
        # The member that got the least over the network waits for the rest over the fast link.
        missing = total - min((len(g) for g in got), default=0)
        gather_s = max(gather_s, missing * bytes_per_group / (fast_link_gbps * 1e9 / 8))
    return worst_s + gather_s
