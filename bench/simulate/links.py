"""Links as shared-bandwidth resources and the flows on them, in a leaf-spine cluster.

Every link is one direction of one resource (a GPU's RDMA NIC out, its NIC in, its NVLink
port out and in, its PCIe lane from host memory, a host's SSD, a leaf's uplink and downlink to
the spine). A flow crosses a list of links; concurrent flows share each link's capacity
max-min fairly (progressive filling: the most contended link splits evenly among its flows,
those flows are fixed at that rate, repeat), the fluid processor-sharing model. Two flows on
one otherwise idle link each get half of it. Rates are recomputed whenever a flow starts or
ends, and one timer waits for the next flow to finish.
"""

from __future__ import annotations

import heapq
from collections.abc import Callable
from dataclasses import dataclass, field

from .events import EventLoop, Timer

__all__ = ["ClusterSpec", "Flow", "LeafSpine", "Link", "Network", "gbps"]


def gbps(x: float) -> float:
    """Gigabits per second -> bytes per second."""
    return x * 1e9 / 8


@dataclass(slots=True)
class Link:
    name: str
    bytes_per_s: float
    flows: set[int] = field(default_factory=set)
    bytes_carried: float = 0.0


@dataclass(slots=True)
class Flow:
    fid: int
    links: tuple[int, ...]
    size_bytes: float
    on_done: Callable[[], None]
    started_s: float
    remaining: float = 0.0
    rate: float = 0.0
    kind: str = ""


class Network:
    """Links and the flows crossing them, on an event loop."""

    def __init__(self, loop: EventLoop, *, batch: bool = False) -> None:
        self.loop = loop
        # Batch the rate recomputations of one instant: flows started or cancelled by one event
        # (a group landing starts the next hop and the all-gather to 7 peers) are priced once,
        # after it, instead of once each. Nothing moves between them (no time passes), so the
        # rates and completion times are those of pricing after each.
        self.batch = batch
        self._pending = False
        self.links: list[Link] = []
        self._by_name: dict[str, int] = {}
        self.flows: dict[int, Flow] = {}
        self._next_fid = 0
        self._last_s = 0.0
        self._timer: Timer | None = None
        self.bytes_by_kind: dict[str, float] = {}

    def add_link(self, name: str, bytes_per_s: float) -> int:
        if not bytes_per_s > 0:
            raise ValueError(f"link {name!r}: bandwidth must be > 0, got {bytes_per_s!r} B/s")
        if name in self._by_name:
            raise ValueError(f"link {name!r} added twice")
        self._by_name[name] = len(self.links)
        self.links.append(Link(name, bytes_per_s))
        return self._by_name[name]

    def link(self, name: str) -> int:
        return self._by_name[name]

    def start(self, links: tuple[int, ...], size_bytes: float, on_done: Callable[[], None], kind: str = "") -> int:
        """A flow of `size_bytes` over `links`; `on_done` runs when its last byte lands."""
        if not links:
            raise ValueError("a flow needs at least one link")
        self._advance()
        fid = self._next_fid
        self._next_fid += 1
        flow = Flow(fid, links, float(size_bytes), on_done, self.loop.now_s, remaining=float(size_bytes), kind=kind)
        self.flows[fid] = flow
        for li in links:
            self.links[li].flows.add(fid)
        self.bytes_by_kind[kind] = self.bytes_by_kind.get(kind, 0.0) + size_bytes
        self._changed()
        return fid

    def cancel(self, fid: int) -> bool:
        """Stop a flow where it is (its sender or receiver died); `on_done` never runs. Returns
        whether it was still moving."""
        self._advance()
        flow = self.flows.pop(fid, None)
        if flow is None:
            return False
        for li in flow.links:
            self.links[li].flows.discard(fid)
        self.bytes_by_kind[flow.kind] -= max(0.0, flow.remaining)
        self._changed()
        return True

    # ---- internals -----------------------------------------------------------------------
    def _advance(self) -> None:
        """Move every flow forward by the time since the last change, at its current rate."""
        dt = self.loop.now_s - self._last_s
        self._last_s = self.loop.now_s
        if dt <= 0:
            return
        for flow in self.flows.values():
            moved = flow.rate * dt
            flow.remaining -= moved
            for li in flow.links:
                self.links[li].bytes_carried += moved

    def _rates(self) -> None:
        """Max-min fair rates by progressive filling, ties broken by link index (deterministic).

        The most contended link (least capacity left per unfixed flow on it, then the lowest
        index) is found from a heap of (share, link) entries, one pushed whenever a link's share
        changes and stale ones dropped as they surface: the same links in the same order, and
        the same arithmetic, as scanning every link each round, without the rounds x links."""
        cap: dict[int, float] = {}
        left: dict[int, int] = {}
        links = self.links
        for flow in self.flows.values():
            for li in flow.links:
                if li not in cap:
                    cap[li] = links[li].bytes_per_s
                    left[li] = 0
                left[li] += 1
        heap = [(cap[li] / n, li) for li, n in left.items()]
        heapq.heapify(heap)
        unfixed = set(self.flows)
        while unfixed:
            share, li = heapq.heappop(heap)
            if left[li] <= 0 or cap[li] / left[li] != share:
                continue  # stale: the link's share changed since this entry
            touched = set()
            for fid in sorted(links[li].flows & unfixed):
                flow = self.flows[fid]
                flow.rate = share
                unfixed.discard(fid)
                for lj in flow.links:
                    cap[lj] = max(0.0, cap[lj] - share)
                    left[lj] -= 1
                    touched.add(lj)
            for lj in touched:
                if left[lj] > 0:
                    heapq.heappush(heap, (cap[lj] / left[lj], lj))

    def _changed(self) -> None:
        if not self.batch:
            self._reschedule()
            return
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        if not self._pending:
            self._pending = True
            self.loop.at(self.loop.now_s, self._flush)

    def _flush(self) -> None:
        self._pending = False
        self._reschedule()

    def _reschedule(self) -> None:
        self._rates()
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        if not self.flows:
            return
        eta = min(max(0.0, f.remaining) / f.rate for f in self.flows.values())
        self._timer = self.loop.after(eta, self._on_timer)

    def _on_timer(self) -> None:
        self._timer = None
        self._advance()
        # Done: within a nanosecond of its rate (floating-point residue of the fluid update).
        done = sorted(fid for fid, f in self.flows.items() if f.remaining <= f.rate * 1e-9 + 1e-6)
        finished = [self.flows.pop(fid) for fid in done]
        for flow in finished:
            for li in flow.links:
                self.links[li].flows.discard(flow.fid)
        self._reschedule()
        for flow in finished:
            flow.on_done()


@dataclass(frozen=True)
class ClusterSpec:
    """Hosts of `gpus_per_host` GPUs, `hosts_per_leaf` per leaf switch, a non-blocking spine
    unless `oversubscription` > 1. Bandwidths per GPU (RDMA NIC, NVLink, PCIe) or per host (SSD,
    the host NIC that host-memory copies leave by), in Gbps, one direction."""

    hosts: int
    gpus_per_host: int
    hosts_per_leaf: int
    rdma_gbps: float = 200.0
    nvlink_gbps: float = 3600.0
    pcie_gbps: float = 400.0
    ssd_gbps: float = 10.0
    host_nic_gbps: float = 200.0
    oversubscription: float = 1.0

    def __post_init__(self) -> None:
        for name in ("hosts", "gpus_per_host", "hosts_per_leaf"):
            if getattr(self, name) < 1:
                raise ValueError(f"ClusterSpec.{name} must be >= 1, got {getattr(self, name)!r}")

    def host_name(self, h: int) -> str:
        return f"h{h:02d}"

    def leaf_of(self, h: int) -> str:
        return f"leaf{h // self.hosts_per_leaf}"

    def gpu_name(self, h: int, g: int) -> str:
        return f"h{h:02d}g{g}"


class LeafSpine:
    """The links of a `ClusterSpec` on a `Network`, and the path between any two endpoints.

    Endpoints: a GPU ("h03g5"), a host's memory ("mem@h03") and its SSD ("ssd@h03"). GPU to
    GPU on one host: NVLink out, NVLink in. Across hosts: NIC out, the leaves' spine uplink and
    downlink when the leaves differ, NIC in (GPUDirect RDMA: no PCIe hop). Host memory to a GPU
    of its host: that GPU's PCIe; to another host's GPU: the host NIC, spine, the GPU's NIC.
    SSD to a GPU of its host: SSD then PCIe.
    """

    def __init__(self, net: Network, spec: ClusterSpec) -> None:
        self.net = net
        self.spec = spec
        self.host_of: dict[str, str] = {}
        self.leaf_of_host: dict[str, str] = {}
        leaves: set[str] = set()
        for h in range(spec.hosts):
            host = spec.host_name(h)
            leaf = spec.leaf_of(h)
            self.leaf_of_host[host] = leaf
            leaves.add(leaf)
            net.add_link(f"ssd@{host}", gbps(spec.ssd_gbps))
            net.add_link(f"hostnic_out@{host}", gbps(spec.host_nic_gbps))
            self.host_of[f"mem@{host}"] = host
            self.host_of[f"ssd@{host}"] = host
            for g in range(spec.gpus_per_host):
                gpu = spec.gpu_name(h, g)
                self.host_of[gpu] = host
                net.add_link(f"nic_out@{gpu}", gbps(spec.rdma_gbps))
                net.add_link(f"nic_in@{gpu}", gbps(spec.rdma_gbps))
                net.add_link(f"nvl_out@{gpu}", gbps(spec.nvlink_gbps))
                net.add_link(f"nvl_in@{gpu}", gbps(spec.nvlink_gbps))
                net.add_link(f"pcie@{gpu}", gbps(spec.pcie_gbps))
        per_leaf = spec.hosts_per_leaf * spec.gpus_per_host * spec.rdma_gbps / spec.oversubscription
        for leaf in sorted(leaves):
            net.add_link(f"up@{leaf}", gbps(per_leaf))
            net.add_link(f"down@{leaf}", gbps(per_leaf))
        self._paths: dict[tuple[str, str], tuple[int, ...]] = {}

    @property
    def gpus(self) -> list[str]:
        s = self.spec
        return [s.gpu_name(h, g) for h in range(s.hosts) for g in range(s.gpus_per_host)]

    def path(self, src: str, dst: str) -> tuple[int, ...]:
        key = (src, dst)
        cached = self._paths.get(key)
        if cached is None:
            cached = self._paths[key] = tuple(self.net.link(n) for n in self._path_names(src, dst))
        return cached

    def _path_names(self, src: str, dst: str) -> list[str]:
        if dst.startswith(("mem@", "ssd@")):
            if src.startswith("ssd@") and dst.startswith("mem@") and self.host_of[src] == self.host_of[dst]:
                return [src]  # SSD into its host's memory
            raise ValueError(f"no path {src!r} -> {dst!r}: only GPUs (and host memory from its SSD) receive")
        s_host, d_host = self.host_of[src], self.host_of[dst]
        if src.startswith("ssd@"):
            if s_host != d_host:
                raise ValueError(f"no path {src!r} -> {dst!r}: an SSD feeds its own host only")
            return [src, f"pcie@{dst}"]
        if src.startswith("mem@"):
            if s_host == d_host:
                return [f"pcie@{dst}"]
            return [f"hostnic_out@{s_host}", *self._spine(s_host, d_host), f"nic_in@{dst}"]
        if s_host == d_host:
            return [f"nvl_out@{src}", f"nvl_in@{dst}"]
        return [f"nic_out@{src}", *self._spine(s_host, d_host), f"nic_in@{dst}"]

    def _spine(self, s_host: str, d_host: str) -> list[str]:
        a, b = self.leaf_of_host[s_host], self.leaf_of_host[d_host]
        return [] if a == b else [f"up@{a}", f"down@{b}"]
