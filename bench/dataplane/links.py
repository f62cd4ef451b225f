"""Parts 2 and 3 of the data-plane benchmark: chains, sequential unicast and sharded transfer
between emulated hosts (network namespaces with tc-shaped uplinks, see netns.py).

Every node is a real process (`tests.harness.dataplane_nodes`) that enters its host's namespace
before it opens a socket, binds the namespace address, and moves bytes over the veth pair and
the bridge; each host's uplink is a `tbf` qdisc, so the link, not the CPU, sets the pace.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Sequence
from typing import Any

from services.dataplane.manifest import Manifest
from services.mesh.netns import NetnsHost, ShapedNetwork
from tests.harness.dataplane_nodes import ModelSpec, NodeProcess, NodeSpec, start_nodes

SHAPED_LAYERS = 32  # 33 layer-sizes: g = 2, 4 shards balance within 3%


def split_groups(sizes: Sequence[tuple[str, int]], g: int) -> list[list[str]]:
    """Split named groups into `g` disjoint shards of about equal bytes (largest first onto the
    lightest shard); each shard keeps the groups' original (layer) order."""
    if g < 1:
        raise ValueError(f"g must be >= 1, got {g}")
    if g > len(sizes):
        raise ValueError(f"cannot split {len(sizes)} groups into {g} non-empty shards")
    order = {name: i for i, (name, _) in enumerate(sizes)}
    loads = [0] * g
    shards: list[list[str]] = [[] for _ in range(g)]
    for name, size in sorted(sizes, key=lambda ns: (-ns[1], order[ns[0]])):
        k = min(range(g), key=lambda i: (loads[i], i))
        shards[k].append(name)
        loads[k] += size
    return [sorted(s, key=order.__getitem__) for s in shards]


def node_spec(kind: str, host: NetnsHost) -> NodeSpec:
    """A node on `host`: TCP bound to the namespace address; UCX restricted to its tcp
    transport on the host's veth (shared memory between namespaces would bypass the link)."""
    if kind == "tcp":
        return NodeSpec(transport="tcp", netns=host.netns, transport_options={"host": host.address})
    if kind == "ucx":
        env = {"UCX_TLS": "tcp", "UCX_NET_DEVICES": host.device}
        return NodeSpec(transport="ucx", netns=host.netns, env=env)
    raise ValueError(f"unknown transport kind {kind!r} for shaped links")


def _done(node: NodeProcess, timeout_s: float) -> dict[str, Any]:
    msg = node.expect(timeout_s)
    if msg[0] != "done":
        raise RuntimeError(f"receive failed: {msg}")
    return msg[1]


def _chain(source: NodeProcess, receivers: list[NodeProcess], manifest: bytes, timeout_s: float) -> float:
    t0 = time.monotonic()  # CLOCK_MONOTONIC is system-wide (no time namespaces here)
    ups = [source, *receivers[:-1]]
    for node, up in reversed(list(zip(receivers, ups, strict=True))):
        node.receive(manifest, [(up.address, None, ())], reuse_buffers=True, digests=False)
    return max(_done(n, timeout_s)["t_done"] for n in receivers) - t0


def _unicast(source: NodeProcess, receivers: list[NodeProcess], manifest: bytes, timeout_s: float) -> list[float]:
    """One sequential unicast to every receiver; element k-1 is the fill time of the first k."""
    t0 = time.monotonic()
    fills = []
    for node in receivers:
        node.receive(manifest, [(source.address, None, ())], reuse_buffers=True, digests=False)
        fills.append(_done(node, timeout_s)["t_done"] - t0)
    return fills


def _sharded(
    sources: list[NodeProcess], target: NodeProcess, manifest: Manifest, raw: bytes, timeout_s: float
) -> tuple[float, dict[str, int]]:
    shards = split_groups([(e.name, e.size_bytes) for e in manifest.groups], len(sources))
    t0 = time.monotonic()
    target.receive(
        raw,
        [(s.address, shard, ()) for s, shard in zip(sources, shards, strict=True)],
        reuse_buffers=True,
        digests=False,
    )
    out = _done(target, timeout_s)
    return out["t_done"] - t0, out["bytes_by_source"]


def bench_shaped(
    kind: str,
    network: ShapedNetwork,
    payload_bytes: int,
    chunk_bytes: int,
    max_n: int,
    gs: Sequence[int],
    runs: int,
) -> dict[str, Any]:
    """Chain fill and sequential unicast to n = 1..max_n targets, sharded transfer from g
    sources, on hosts h0 (the source) .. h<max_n>; best (and median) of `runs` rounds."""
    hosts = network.hosts[: max_n + 1]
    if len(hosts) < max_n + 1 or max(gs) > max_n:
        raise ValueError(f"need {max_n + 1} hosts and g <= {max_n}")
    link = network.plan.link_bytes_per_s
    hop_s = payload_bytes / link
    timeout_s = 10 * hop_s * max_n + 60
    nodes = start_nodes([node_spec(kind, h) for h in hosts], timeout_s=120)
    source, receivers = nodes[0], nodes[1:]
    try:
        layer_bytes = payload_bytes // (SHAPED_LAYERS + 1)
        spec = ModelSpec(
            model_id=f"shaped-{kind}", num_layers=SHAPED_LAYERS, layer_bytes=layer_bytes, chunk_bytes=chunk_bytes
        )
        raw, _ = source.serve(spec, timeout_s=300)
        manifest = Manifest.from_bytes(raw)
        chain: dict[str, list[float]] = {str(n): [] for n in range(1, max_n + 1)}
        unicast: dict[str, list[float]] = {str(n): [] for n in range(1, max_n + 1)}
        sharded: dict[str, list[float]] = {str(g): [] for g in gs}
        by_source: dict[str, dict[str, int]] = {}
        wire: dict[str, int] = {}
        for r in range(runs):
            for n in range(1, max_n + 1):
                tx0 = network.tx_bytes(hosts[0]) if (r == 0 and n == 1) else 0
                chain[str(n)].append(_chain(source, receivers[:n], raw, timeout_s))
                if r == 0 and n == 1:
                    # What left the source's shaped uplink during the one-hop transfer.
                    wire = {
                        "payload_bytes": manifest.total_bytes,
                        "source_uplink_tx_bytes": network.tx_bytes(hosts[0]) - tx0,
                    }
            for n, t in enumerate(_unicast(source, receivers[:max_n], raw, timeout_s), start=1):
                unicast[str(n)].append(t)
            target = receivers[max_n - 1]
            for g in gs:
                t, bs = _sharded([source, *receivers[: g - 1]], target, manifest, raw, timeout_s)
                sharded[str(g)].append(t)
                by_source[str(g)] = bs

        def best(d: dict[str, list[float]]) -> dict[str, float]:
            return {k: round(min(v), 3) for k, v in d.items()}

        def med(d: dict[str, list[float]]) -> dict[str, float]:
            return {k: round(statistics.median(v), 3) for k, v in d.items()}

        one_hop_s = min(chain["1"])
        return {
            "payload_bytes": manifest.total_bytes,
            "link_mbit": network.plan.rate_mbit,
            "ideal_hop_s": round(manifest.total_bytes / link, 3),
            "one_hop_gbps": round(manifest.total_bytes / one_hop_s / 1e9, 4),
            "link_utilisation": round(manifest.total_bytes / one_hop_s / link, 3),
            "wire": wire,
            "chain_fill_s": best(chain),
            "chain_fill_median_s": med(chain),
            "unicast_fill_s": best(unicast),
            "unicast_fill_median_s": med(unicast),
            "sharded_s": best(sharded),
            "sharded_median_s": med(sharded),
            "sharded_bytes_by_source": by_source,
            "runs_s": {"chain": chain, "unicast": unicast, "sharded": sharded},
        }
    finally:
        for node in nodes:
            node.stop()
