"""A model load timed on the links, layer by layer (one parameter group = one chunk).

A `Transfer` is a set of edges (sender -> receiver). Each edge sends the groups of its list in
order, one flow at a time, and may send group i only once its sender holds it: a serial
forwarding chain is a line of edges (store-and-forward per chunk, so with equal links a chain
of n hops fills in `size/bw + (n - 1) * chunk/bw`), a fan-out is several edges from one node
(host memory to each GPU of the host). All-gather: a member of an `AllGather` group that
receives a group over the network forwards it to the members that lack it, over the fast link.
Receivers report every group as it lands (`on_group`) and once they hold all (`on_done`).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

from services.global_manager.core.multicast import MulticastPlan

from .links import LeafSpine

__all__ = ["Edge", "Transfer"]


@dataclass(slots=True)
class Edge:
    sender: str
    receiver: str
    groups: tuple[str, ...]
    next_i: int = 0
    busy: bool = False


@dataclass
class Transfer:
    fabric: LeafSpine
    group_bytes: Mapping[str, float]
    all_groups: tuple[str, ...]
    on_group: Callable[[str, str], None]
    on_done: Callable[[str], None]
    kind: str = "load"
    edges: list[Edge] = field(default_factory=list)
    _sent_by: dict[str, list[Edge]] = field(default_factory=dict)  # sender -> its edges, in order
    have: dict[str, set[str]] = field(default_factory=dict)
    targets: set[str] = field(default_factory=set)
    gather_peers: dict[str, tuple[str, ...]] = field(default_factory=dict)
    _gather_sent: set[tuple[str, str]] = field(default_factory=set)
    _done: set[str] = field(default_factory=set)

    def add_source(self, node: str, groups: Sequence[str] | None = None) -> None:
        self.have.setdefault(node, set()).update(self.all_groups if groups is None else groups)

    def add_edge(self, sender: str, receiver: str, groups: Sequence[str]) -> None:
        self.have.setdefault(sender, set())
        self.have.setdefault(receiver, set())
        edge = Edge(sender, receiver, tuple(groups))
        self.edges.append(edge)
        self._sent_by.setdefault(sender, []).append(edge)

    def add_target(self, node: str) -> None:
        self.targets.add(node)
        self.have.setdefault(node, set())

    @classmethod
    def from_plan(
        cls,
        plan: MulticastPlan,
        fabric: LeafSpine,
        group_bytes: Mapping[str, float],
        all_groups: tuple[str, ...],
        source_groups: Mapping[str, Sequence[str] | None],
        on_group: Callable[[str, str], None],
        on_done: Callable[[str], None],
    ) -> Transfer:
        """The transfer the GM's multicast plan describes: its chains and all-gathers."""
        t = cls(fabric, group_bytes, all_groups, on_group, on_done)
        for chain in plan.chains:
            t.add_source(chain.source, source_groups.get(chain.source))
            nodes = (chain.source, *chain.hops)
            for a, b in zip(nodes, nodes[1:], strict=False):
                t.add_edge(a, b, chain.groups)
            for hop in chain.hops:
                t.add_target(hop)
        for gather in plan.allgather:
            for member in gather.members:
                t.add_target(member)
                t.gather_peers[member] = tuple(m for m in gather.members if m != member)
        return t

    def start(self) -> None:
        for node in sorted(self.targets):
            self._check_done(node)
        for edge in self.edges:
            self._pump(edge)

    def holds(self, node: str) -> set[str]:
        return self.have.get(node, set())

    def layers_prefix(self, node: str) -> int:
        """Groups held from the first on, without a gap: the layers [0, k) a loading GPU can run."""
        held = self.have.get(node, set())
        k = 0
        for g in self.all_groups:
            if g not in held:
                break
            k += 1
        return k

    # ---- internals -------------------------------------------------------------------------
    def _pump(self, edge: Edge) -> None:
        if edge.busy or edge.next_i >= len(edge.groups):
            return
        group = edge.groups[edge.next_i]
        if group not in self.have[edge.sender]:
            return
        edge.busy = True
        path = self.fabric.path(edge.sender, edge.receiver)
        self.fabric.net.start(path, self.group_bytes[group], lambda: self._landed(edge, group), kind=self.kind)

    def _landed(self, edge: Edge, group: str) -> None:
        edge.busy = False
        edge.next_i += 1
        self._receive(edge.receiver, group, gathered=False)
        self._pump(edge)

    def _receive(self, node: str, group: str, *, gathered: bool) -> None:
        held = self.have[node]
        if group in held:
            return
        held.add(group)
        if node in self.targets:
            self.on_group(node, group)
        for edge in self._sent_by.get(node, ()):
            self._pump(edge)
        if not gathered:
            for peer in self.gather_peers.get(node, ()):
                if group not in self.have[peer] and (peer, group) not in self._gather_sent:
                    self._gather_sent.add((peer, group))
                    path = self.fabric.path(node, peer)
                    self.fabric.net.start(
                        path,
                        self.group_bytes[group],
                        lambda peer=peer, group=group: self._receive(peer, group, gathered=True),
                        kind="allgather",
                    )
        self._check_done(node)

    def _check_done(self, node: str) -> None:
        if node in self.targets and node not in self._done and len(self.have[node]) >= len(self.all_groups):
            self._done.add(node)
            self.on_done(node)
