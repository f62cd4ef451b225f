"""Data plane benchmark: one hop, chains against unicast, sharded transfer, host memory.

Usage:
    python -m bench.dataplane [--quick] [--transports ucx,ucx-cma,tcp] [--shaped-transports ucx,tcp]
                              [--out bench/results/dataplane.json]

Four parts, measured in one run, every transfer between separate real processes
(`tests.harness.dataplane_nodes` nodes) over real sockets / UCX:

1. One hop on this host (CPU/memory-bound), payload 1 GiB (256 MiB with --quick):
   - memcpy_gbps: np.copyto of the payload in one process (warm, best of 5): the ceiling.
   - ucx_perftest_gbps: `ucx_perftest -t tag_bw` from the libucx wheel with the UCX_TLS our
     transport uses ("^cma", see services/dataplane/ucx.py); ucx_perftest_all_tls_gbps with
     UCX's default (cma included); best of the runs before, between and after our transports
     (ucx_perftest_runs_gbps). Null when the binary is not installed.
   - one_hop_gbps[kind]: a receiver pulls the whole model from a source (manifest, chunks, a
     checksum over every received byte, algo `checksum_algo`, --checksum-algo); best warm run
     (receive buffers reused, as a worker reuses its memory); one_hop_cold_gbps[kind]: the
     first run.
   - one_hop_by_checksum_gbps[kind][algo]: the same pull of a model (at most 256 MiB)
     checksummed with each algo of --compare-checksums, between the same two nodes, rounds
     interleaved; best warm run, all in one_hop_by_checksum_runs_gbps, and
     one_hop_by_checksum_over_transport = best / one_hop_transport_gbps.
   - checksum_gbps[algo] / checksum_hot_gbps[algo]: one core digesting 256 MiB chunk by chunk
     (cold) and one chunk in cache (hot); checksum_thread_stall_ms[algo]: how late a 0.2 ms
     sleep wakes beside a digesting thread (~5 ms: the algo holds the GIL). See
     bench/dataplane/checksums.py.
     kinds: "ucx" (our default UCX_TLS=^cma), "ucx-cma" (UCX_TLS=all), "tcp" (asyncio sockets).
   - one_hop_transport_gbps[kind]: the same bytes through the transport alone between two fresh
     nodes (tagged messages of chunk_bytes, 4 in flight, no checksums): like for like with
     ucx_perftest; best warm round (all rounds in one_hop_transport_runs_gbps, the first cold).
   - local_chain_fill_s[kind][n] / local_unicast_fill_s[kind][n]: the same-host chain (all
     started at once; seconds until the last receiver holds every byte) and sequential unicast,
     n = 1..3, best of 2 rounds. On 2 cores these are CPU-bound, so they do not show the
     chain's independence of n (that is part 2's job).
2. Chain over shaped links: hosts are network namespaces behind a bridge, each with a
   `tc tbf` uplink (800 Mbit by default; services/mesh/netns.py), payload 512 MiB (128 MiB
   with --quick), 4 MiB chunks. chain_fill_s[n], n = 1..4: source h0 -> h1 -> ... -> hn, all
   started at once, seconds until the last target holds every byte. unicast_fill_s[n]: h0
   sends to h1..h4 one after the other; [n] is when the n-th is full (one sequential run).
3. sharded_s[g], g = 1, 2, 4: one target (h4) pulls disjoint shards of about equal bytes from g
   sources at once (h0..h<g-1>, each holding the model), over the same shaped links.
   Parts 2-3 need root and iproute2; otherwise they are skipped with the reason printed and
   recorded (shaped_skipped). They run for every kind in --shaped-transports; the top-level
   chain_fill_s / unicast_fill_s / sharded_s are those of the first kind that completed
   (shaped_transport); every kind's figures are under shaped[kind]. UCX there is forced onto
   its tcp transport on the namespace's veth (UCX_TLS=tcp, UCX_NET_DEVICES=bm0): shared memory
   would bypass the link. shaped_ucx_perftest_gbps is ucx_perftest over the same shaped link.
4. Host memory for H = 1..4 hosts: real parameter-manager processes on a synthetic checkpoint
   (preset "bench", 403 MB; "small", 88 MB with --quick; see bench/dataplane/hostmem.py):
   host_bytes_o1[H] sums the bytes each process of the O(1) pool (index + H-1 host caches)
   reports holding; host_bytes_per_host[H] the same for H independent whole-model caches
   (ServerlessLLM's per-host cache). host_memory holds RSS growth over an idle process and
   every process's own figures; host_bytes_per_host_computed[H] = H x model bytes.

Results go to bench/results/dataplane.json (--quick: dataplane_quick.json) and a figure next
to it (.png). The machine is shared and has 2 cores: load_avg is recorded before and after,
and fill times and rates are the best of several runs (medians are recorded too).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import signal
import socket
import statistics
import subprocess
import sys
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np

from bench.dataplane import hostmem, links
from bench.dataplane.checksums import checksum_rates
from bench.dataplane.plot import plot
from services.dataplane import ucx_available
from services.dataplane.checksum import CHECKSUM_ALGOS, DEFAULT_CHECKSUM_ALGO
from services.mesh import netns
from tests.harness.dataplane_nodes import ModelSpec, NodeProcess, NodeSpec, start_nodes

MIB = 1 << 20
NUM_LAYERS = 8  # plus embed and head, half a layer each: 9 layer-sizes in all
# The checksum comparison pulls one model per algo from one source: at most this much each.
COMPARE_PAYLOAD_BYTES = 256 * MIB


def _load() -> list[float]:
    return [round(x, 2) for x in os.getloadavg()]


def memcpy_gbps(size_bytes: int, repeats: int = 5) -> float:
    src = np.ones(size_bytes, np.uint8)
    dst = np.empty_like(src)
    np.copyto(dst, src)  # fault the pages in first
    best = min(_timed(lambda: np.copyto(dst, src)) for _ in range(repeats))
    return size_bytes / best / 1e9


def _timed(fn: Any) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


# -- ucx_perftest ---------------------------------------------------------------------------------


def _perftest_binary() -> Path | None:
    try:
        import libucx  # the wheel that ucxx-cu12 pulls in
    except ImportError:
        return None
    root = Path(libucx.__file__).parent
    binary = root / "bin" / "ucx_perftest"
    return binary if binary.exists() else None


def _free_port() -> int:
    # ucx_perftest takes a port number, not a bound socket: ask the OS for a free one.
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def ucx_perftest_gbps(
    size_bytes: int,
    iterations: int,
    tls: str | None,
    *,
    host: str = "127.0.0.1",
    server_wrap: list[str] | None = None,
    client_wrap: list[str] | None = None,
    extra_env: dict[str, str] | None = None,
) -> float | None:
    """ucx_perftest tag_bw bandwidth in GB/s; `*_wrap` prefix the commands (e.g. `ip netns
    exec NS`) and `host` is where the client finds the server."""
    binary = _perftest_binary()
    if binary is None:
        return None
    env = dict(os.environ, LD_LIBRARY_PATH=str(binary.parent.parent / "lib"), UCX_WARN_UNUSED_ENV_VARS="n")
    env.pop("UCX_TLS", None)
    if tls is not None:
        env["UCX_TLS"] = tls
    env.update(extra_env or {})
    port = _free_port()
    server = subprocess.Popen(
        [*(server_wrap or []), str(binary), "-p", str(port)],
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        for _ in range(50):  # the server needs a moment to listen; retry the client on refusal
            client = subprocess.run(
                [
                    *(client_wrap or []),
                    str(binary),
                    host,
                    "-p",
                    str(port),
                    "-t",
                    "tag_bw",
                    "-s",
                    str(size_bytes),
                    "-n",
                    str(iterations),
                    "-w",
                    "2",
                ],
                env=env,
                capture_output=True,
                text=True,
                timeout=120,
            )
            match = re.search(r"^Final:\s+(.*)$", client.stdout, re.MULTILINE)
            if match:
                fields = match.group(1).split()
                # iterations, latency p50/avg/overall (usec), bandwidth avg/overall (MB/s = 2^20 B/s), ...
                return float(fields[5]) * MIB / 1e9
            time.sleep(0.1)
        return None
    finally:
        server.kill()
        server.wait(10)


# -- node based measurements ----------------------------------------------------------------------


def _model(kind: str, payload_bytes: int, chunk_bytes: int, checksum_algo: str, tag: str = "") -> ModelSpec:
    return ModelSpec(
        model_id=f"bench-{kind}{tag}",
        num_layers=NUM_LAYERS,
        layer_bytes=payload_bytes // (NUM_LAYERS + 1),
        chunk_bytes=chunk_bytes,
        checksum_algo=checksum_algo,
    )


def _outcome(node: NodeProcess, timeout_s: float) -> dict[str, Any]:
    msg = node.expect(timeout_s)
    if msg[0] != "done":
        raise RuntimeError(f"receive failed: {msg}")
    return msg[1]


def _one_hop(source: NodeProcess, receiver: NodeProcess, manifest: bytes, runs: int) -> tuple[float, list[float]]:
    rates = []
    for _ in range(runs):
        receiver.receive(manifest, [(source.address, None, ())], reuse_buffers=True, digests=False)
        out = _outcome(receiver, 300)
        rates.append(out["bytes"] / out["elapsed_s"] / 1e9)
    return rates[0], rates[1:]


def _chain_fill_s(source: NodeProcess, receivers: list[NodeProcess], manifest: bytes) -> float:
    t0 = time.monotonic()  # CLOCK_MONOTONIC is system-wide: comparable with the nodes' stamps
    ups = [source, *receivers[:-1]]
    for node, up in reversed(list(zip(receivers, ups, strict=True))):
        node.receive(manifest, [(up.address, None, ())], reuse_buffers=True, digests=False)
    return max(_outcome(n, 300)["t_done"] for n in receivers) - t0


def _unicast_fill_s(source: NodeProcess, receivers: list[NodeProcess], manifest: bytes) -> float:
    t0 = time.monotonic()
    t_done = t0
    for node in receivers:
        node.receive(manifest, [(source.address, None, ())], reuse_buffers=True, digests=False)
        t_done = _outcome(node, 300)["t_done"]
    return t_done - t0


def _node_spec(kind: str) -> NodeSpec:
    if kind == "ucx-cma":
        # UCX with every transport, cma included: faster on one host, but a sender that dies
        # mid-message aborts its receiver (see services/dataplane/ucx.py, SAFE_TLS).
        return NodeSpec(transport="ucx", env={"UCX_TLS": "all"})
    return NodeSpec(transport=kind)


def transport_one_hop_gbps(kind: str, payload_bytes: int, chunk_bytes: int, window: int, rounds: int) -> list[float]:
    """The transport alone between two fresh nodes: `payload_bytes` as tagged messages of
    `chunk_bytes`, `window` in flight, into one reused buffer; GB/s of each round (the first
    is cold). What ucx_perftest measures, through our Python transport."""
    spec = replace(_node_spec(kind), group_server=False)
    sender, receiver = start_nodes([spec, spec], timeout_s=120)
    try:
        sender.stream("send", None, payload_bytes, chunk_bytes, window, rounds)
        receiver.stream("receive", sender.address, payload_bytes, chunk_bytes, window, rounds)
        got, sent = receiver.expect(300), sender.expect(300)
        if got[0] != "streamed" or sent[0] != "streamed":
            raise RuntimeError(f"transport stream failed: receiver {got!r}, sender {sent!r}")
        return [payload_bytes / t / 1e9 for t in got[1]]
    finally:
        sender.stop()
        receiver.stop()


def _one_hop_by_checksum(
    source: NodeProcess,
    receiver: NodeProcess,
    kind: str,
    payload_bytes: int,
    chunk_bytes: int,
    algos: list[str],
    runs: int,
) -> dict[str, list[float]]:
    """The one-hop pull of the same synthetic model checksummed with each algo, between the
    same two nodes, rounds interleaved (algo a, b, c, a, b, c, ...) so that a change of load
    hits every algo alike; GB/s of each warm run (round 0 is dropped: first-use costs)."""
    manifests = {
        a: source.serve(_model(kind, payload_bytes, chunk_bytes, a, tag=f"-{a}"), timeout_s=300)[0] for a in algos
    }
    rates: dict[str, list[float]] = {a: [] for a in algos}
    for r in range(runs + 1):
        for a in algos:
            receiver.receive(manifests[a], [(source.address, None, ())], reuse_buffers=True, digests=False)
            out = _outcome(receiver, 300)
            if r:
                rates[a].append(out["bytes"] / out["elapsed_s"] / 1e9)
    return rates


def bench_transport(
    kind: str,
    payload_bytes: int,
    chunk_bytes: int,
    max_n: int,
    runs: int,
    checksum_algo: str,
    compare_algos: list[str],
) -> dict[str, Any]:
    nodes = start_nodes([_node_spec(kind) for _ in range(max_n + 1)], timeout_s=120)
    source, receivers = nodes[0], nodes[1:]
    by_checksum: dict[str, list[float]] = {}
    try:
        manifest, _ = source.serve(_model(kind, payload_bytes, chunk_bytes, checksum_algo), timeout_s=300)
        cold, warm = _one_hop(source, receivers[0], manifest, runs + 1)
        if compare_algos:
            by_checksum = _one_hop_by_checksum(
                source, receivers[0], kind, min(payload_bytes, COMPARE_PAYLOAD_BYTES), chunk_bytes, compare_algos, runs
            )
        for r in receivers[1:]:  # fault in every receiver's buffers once, as for receiver 1
            _one_hop(source, r, manifest, 1)
        chain: dict[str, list[float]] = {}
        unicast: dict[str, list[float]] = {}
        for n in range(1, max_n + 1):
            chain[str(n)] = [_chain_fill_s(source, receivers[:n], manifest) for _ in range(runs)]
            unicast[str(n)] = [_unicast_fill_s(source, receivers[:n], manifest) for _ in range(runs)]
    finally:
        for node in nodes:
            node.stop()
    # After the protocol's nodes are gone: the same bytes through the transport alone.
    raw = transport_one_hop_gbps(kind, payload_bytes, chunk_bytes, 4, runs + 2)
    transport = max(raw[1:])
    return {
        "one_hop_by_checksum_gbps": {a: round(max(v), 3) for a, v in by_checksum.items()},
        "one_hop_by_checksum_runs_gbps": {a: [round(x, 3) for x in v] for a, v in by_checksum.items()},
        "one_hop_by_checksum_over_transport": {a: round(max(v) / transport, 3) for a, v in by_checksum.items()},
        "one_hop_transport_gbps": round(transport, 3),
        "one_hop_transport_runs_gbps": [round(x, 3) for x in raw],
        "one_hop_cold_gbps": round(cold, 3),
        "one_hop_gbps": round(max(warm), 3),
        "one_hop_runs_gbps": [round(x, 3) for x in warm],
        "chain_fill_s": {n: round(min(v), 4) for n, v in chain.items()},
        "chain_fill_median_s": {n: round(statistics.median(v), 4) for n, v in chain.items()},
        "unicast_fill_s": {n: round(min(v), 4) for n, v in unicast.items()},
        "unicast_fill_median_s": {n: round(statistics.median(v), 4) for n, v in unicast.items()},
    }


# -- parts 2-3: shaped links between namespaces ---------------------------------------------------


def shaped_perftest_gbps(net: netns.ShapedNetwork, size_bytes: int, iterations: int) -> float | None:
    """ucx_perftest tag_bw from h0 to h1 over the shaped link (UCX tcp on the veth)."""
    a, b = net.hosts[0], net.hosts[1]
    return ucx_perftest_gbps(
        size_bytes,
        iterations,
        tls="tcp",
        host=b.address,
        server_wrap=["ip", "netns", "exec", b.netns],
        client_wrap=["ip", "netns", "exec", a.netns],
        extra_env={"UCX_NET_DEVICES": b.device},
    )


def run_shaped(args: argparse.Namespace, results: dict[str, Any], ucx_ok: bool) -> None:
    reason = netns.unavailable_reason()
    kinds = [k for k in args.shaped_transports.split(",") if k]
    if not ucx_ok and "ucx" in kinds:
        print("parts 2-3: skipping ucx over shaped links: ucxx does not import", file=sys.stderr)
        kinds.remove("ucx")
    if reason is None and not kinds:
        reason = "no transport to run over shaped links"
    payload = args.shaped_mib * MIB
    results["shaped_link"] = {
        "rate_mbit": args.link_mbit,
        "payload_bytes": payload,
        "chunk_bytes": args.shaped_chunk_mib * MIB,
        "runs": args.shaped_runs,
        "hosts": args.max_targets + 1,
    }
    if reason is not None:
        print(f"parts 2-3 (shaped links) skipped: {reason}", file=sys.stderr)
        results["shaped_skipped"] = reason
        return
    stale = netns.remove_stale()
    if stale:
        print(f"removed namespaces left by dead runs: {stale}", file=sys.stderr)
    gs = [g for g in (1, 2, 4) if g <= args.max_targets]
    shaped: dict[str, Any] = {}
    with netns.ShapedNetwork(netns.plan(args.max_targets + 1, rate_mbit=args.link_mbit)) as net:
        results["shaped_link"]["qdisc_h0"] = net.qdisc(net.hosts[0])
        results["shaped_link"]["namespaces"] = [h.netns for h in net.hosts]
        if ucx_ok:
            pt = shaped_perftest_gbps(net, min(payload, 64 * MIB), 8)
            results["shaped_ucx_perftest_gbps"] = None if pt is None else round(pt, 4)
        for kind in kinds:
            t0 = time.monotonic()
            print(f"parts 2-3: {kind} over {args.link_mbit:g} Mbit links, {payload // MIB} MiB", file=sys.stderr)
            try:
                shaped[kind] = links.bench_shaped(
                    kind, net, payload, args.shaped_chunk_mib * MIB, args.max_targets, gs, args.shaped_runs
                )
            except (RuntimeError, TimeoutError, OSError) as exc:
                print(f"parts 2-3: {kind} failed: {exc}", file=sys.stderr)
                shaped[kind] = {"error": f"{type(exc).__name__}: {exc}"}
            shaped[kind]["elapsed_s"] = round(time.monotonic() - t0, 1)
    results["shaped"] = shaped
    primary = next((k for k in kinds if "chain_fill_s" in shaped.get(k, {})), None)
    results["shaped_transport"] = primary
    if primary is not None:
        for key in ("chain_fill_s", "unicast_fill_s", "sharded_s"):
            results[key] = shaped[primary][key]


# -- part 4: host memory --------------------------------------------------------------------------


def run_host_memory(args: argparse.Namespace, results: dict[str, Any]) -> None:
    from services.model_format.synth import synthesize

    preset = args.hostmem_preset
    model_dir = Path(args.model_root) / f"dataplane-{preset}"
    path = synthesize(model_dir / preset, preset)  # once; later runs find it (same bytes)
    hosts = list(range(1, args.max_targets + 1))
    print(f"part 4: host memory, preset {preset!r}, H = {hosts}", file=sys.stderr)
    hm = hostmem.measure_host_memory(model_dir, hosts)
    hm["model"] = {"preset": preset, "path": str(path)}
    results["host_bytes_o1"] = hm["host_bytes_o1"]
    results["host_bytes_per_host"] = hm["host_bytes_per_host"]
    results["host_memory"] = hm


# -- ratios against the targets -----------------------------------------------------------


def _ratio(a: float | None, b: float | None) -> float | None:
    return None if not a or not b else round(a / b, 3)


def _at_least(value: float | None, target: float) -> dict[str, Any]:
    return {"value": value, "target": f">= {target:.2f}", "met": None if value is None else value >= target}


def targets(results: dict[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    one_hop = results.get("one_hop_gbps") or {}
    transport = results.get("one_hop_transport_gbps") or {}
    pt, pt_default = results.get("ucx_perftest_gbps"), results.get("ucx_perftest_all_tls_gbps")
    # The target, like for like: our UCX transport moving the bytes as tagged messages
    # against ucx_perftest tag_bw with the same UCX_TLS.
    out["ucx_transport_over_ucx_perftest"] = _at_least(_ratio(transport.get("ucx"), pt), 0.70)
    # The whole pull (manifest, chunks, a checksum over every received byte), which does more
    # than ucx_perftest: against the same-TLS figure and against its default (all TLS) run.
    out["ucx_pull_over_ucx_perftest"] = _at_least(_ratio(one_hop.get("ucx"), pt), 0.70)
    out["ucx_pull_over_ucx_perftest_default"] = _at_least(_ratio(one_hop.get("ucx"), pt_default), 0.70)
    chain, uni, sh = results.get("chain_fill_s"), results.get("unicast_fill_s"), results.get("sharded_s")
    if chain:
        n = str(max(int(k) for k in chain))
        r = _ratio(chain[n], chain["1"])
        out[f"chain_n{n}_over_n1"] = {"value": r, "target": "<= 1.3", "met": r is not None and r <= 1.3}
    if uni:
        n = str(max(int(k) for k in uni))
        r = _ratio(uni[n], uni["1"])
        out[f"unicast_n{n}_over_n1"] = {"value": r, "target": f"about {n}", "met": None}
    if sh:
        g = str(max(int(k) for k in sh))
        r = _ratio(sh["1"], sh[g])
        out[f"sharded_speedup_g{g}"] = {
            "value": r,
            "target": f"about {g} (time about 1/g)",
            "met": r is not None and r >= 0.8 * int(g),
        }
    o1, ph = results.get("host_bytes_o1"), results.get("host_bytes_per_host")
    if o1 and ph:
        h = str(max(int(k) for k in o1))
        r = _ratio(o1[h], ph[h])
        out[f"host_bytes_o1_over_per_host_H{h}"] = {
            "value": r,
            "target": f"about 1/{h}",
            "met": r is not None and r <= 1.1 / int(h),
        }
    return out


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.dataplane", description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="smaller payloads and fewer runs (under 5 minutes)")
    parser.add_argument("--transports", default="ucx,ucx-cma,tcp", help="part 1 kinds: ucx, ucx-cma, tcp")
    parser.add_argument("--chunk-mib", type=int, default=16, help="part 1 chunk size in MiB")
    parser.add_argument("--max-n", type=int, default=3, help="part 1: longest same-host chain")
    parser.add_argument(
        "--checksum-algo",
        default=DEFAULT_CHECKSUM_ALGO,
        choices=CHECKSUM_ALGOS,
        help="part 1: the checksum of the synthetic model's groups (the pull verifies it)",
    )
    parser.add_argument(
        "--compare-checksums",
        default=",".join(CHECKSUM_ALGOS),
        help="part 1: algos whose one-hop pulls are measured side by side (empty: none)",
    )
    parser.add_argument(
        "--shaped-transports", default="ucx,tcp", help="parts 2-3 kinds (first that completes is reported at top level)"
    )
    parser.add_argument("--link-mbit", type=float, default=800, help="parts 2-3: tbf rate of every host's uplink")
    parser.add_argument("--shaped-mib", type=int, help="parts 2-3 payload in MiB (default 512, --quick 128)")
    parser.add_argument("--shaped-chunk-mib", type=int, default=4, help="parts 2-3 chunk size in MiB")
    parser.add_argument("--shaped-runs", type=int, default=2, help="parts 2-3 rounds (best is reported)")
    parser.add_argument(
        "--max-targets", type=int, default=4, help="parts 2-4: chain length n, sources g, hosts H up to this"
    )
    parser.add_argument("--hostmem-preset", help="part 4 synthetic model preset (default bench, --quick small)")
    parser.add_argument("--model-root", default="models", help="part 4: where the synthetic checkpoint is kept")
    parser.add_argument("--parts", default="1,2,4", help="which parts to run: 1, 2 (parts 2 and 3), 4")
    parser.add_argument("--out", help="JSON path (default bench/results/dataplane.json, --quick: dataplane_quick.json)")
    args = parser.parse_args(argv)
    if args.shaped_mib is None:
        args.shaped_mib = 128 if args.quick else 512
    if args.hostmem_preset is None:
        args.hostmem_preset = "small" if args.quick else "bench"
    out = Path(args.out or ("bench/results/dataplane_quick.json" if args.quick else "bench/results/dataplane.json"))
    parts = {p.strip() for p in args.parts.split(",")}
    # SIGTERM ends the run like Ctrl-C does: through every `finally` (namespaces, processes).
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))

    payload = (256 if args.quick else 1024) * MIB
    runs = 2  # part 1: rounds of each same-host chain / unicast; one_hop: 1 cold + 2 warm runs
    kinds = [k for k in args.transports.split(",") if k]
    compare_algos = [a for a in args.compare_checksums.split(",") if a]
    unknown = sorted(set(compare_algos) - set(CHECKSUM_ALGOS))
    if unknown:
        parser.error(f"--compare-checksums: unknown algos {unknown}, known: {list(CHECKSUM_ALGOS)}")
    ucx_ok, ucx_reason = ucx_available()
    if not ucx_ok and any(k.startswith("ucx") for k in kinds):
        print(f"skipping ucx: {ucx_reason}", file=sys.stderr)
        kinds = [k for k in kinds if not k.startswith("ucx")]

    started = time.monotonic()
    results: dict[str, Any] = {
        "quick": args.quick,
        "payload_bytes": payload,
        "chunk_bytes": args.chunk_mib * MIB,
        "checksum_algo": args.checksum_algo,
        "runs": runs,
        "machine": {"cpus": os.cpu_count(), "python": platform.python_version(), "load_avg_before": _load()},
        "elapsed_s": {},
    }

    if "1" in parts:
        t0 = time.monotonic()
        print(f"part 1: one hop and same-host chains, {payload // MIB} MiB, {kinds}", file=sys.stderr)
        results["memcpy_gbps"] = round(memcpy_gbps(payload), 3)
        results.update(checksum_rates(min(payload, COMPARE_PAYLOAD_BYTES), args.chunk_mib * MIB))
        perftest_iters = 8
        # ucx_perftest before, between and after our transports, best of the runs: like our
        # figures, a best of runs on a machine whose load changes under us.
        pt_runs: dict[str, list[float]] = {"^cma": [], "all": []}

        def perftest_round() -> None:
            if not ucx_ok:
                return
            for tls in pt_runs:
                v = ucx_perftest_gbps(payload, perftest_iters, tls=None if tls == "all" else tls)
                if v is not None:
                    pt_runs[tls].append(round(v, 3))

        perftest_round()
        per_kind = {}
        for k in kinds:
            per_kind[k] = bench_transport(
                k, payload, args.chunk_mib * MIB, args.max_n, runs, args.checksum_algo, compare_algos
            )
            perftest_round()  # between kinds and after the last: side by side with every kind
        pt_safe = max(pt_runs["^cma"], default=None)
        pt_all = max(pt_runs["all"], default=None)
        results["ucx_perftest_gbps"] = pt_safe
        results["ucx_perftest_all_tls_gbps"] = pt_all
        results["ucx_perftest_runs_gbps"] = pt_runs
        for key in (
            "one_hop_gbps",
            "one_hop_cold_gbps",
            "one_hop_runs_gbps",
            "one_hop_transport_gbps",
            "one_hop_transport_runs_gbps",
            "one_hop_by_checksum_gbps",
            "one_hop_by_checksum_runs_gbps",
            "one_hop_by_checksum_over_transport",
        ):
            results[key] = {k: v[key] for k, v in per_kind.items()}
        for key in ("chain_fill_s", "chain_fill_median_s", "unicast_fill_s", "unicast_fill_median_s"):
            results["local_" + key] = {k: v[key] for k, v in per_kind.items()}
        if "ucx" in per_kind and pt_safe:
            results["ucx_over_perftest"] = round(per_kind["ucx"]["one_hop_gbps"] / pt_safe, 3)
            results["ucx_transport_over_perftest"] = round(per_kind["ucx"]["one_hop_transport_gbps"] / pt_safe, 3)
        if "ucx-cma" in per_kind and pt_all:
            results["ucx_cma_over_perftest_all_tls"] = round(per_kind["ucx-cma"]["one_hop_gbps"] / pt_all, 3)
        results["elapsed_s"]["part1"] = round(time.monotonic() - t0, 1)
        results["machine"]["load_avg_after_part1"] = _load()

    if "2" in parts or "3" in parts:
        t0 = time.monotonic()
        run_shaped(args, results, ucx_ok)
        results["elapsed_s"]["parts2_3"] = round(time.monotonic() - t0, 1)
        results["machine"]["load_avg_after_parts2_3"] = _load()

    if "4" in parts:
        t0 = time.monotonic()
        run_host_memory(args, results)
        results["elapsed_s"]["part4"] = round(time.monotonic() - t0, 1)

    results["machine"]["load_avg_after"] = _load()
    results["elapsed_s"]["total"] = round(time.monotonic() - started, 1)
    results["targets"] = targets(results)
    results["notes"] = NOTES
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(results, indent=2) + "\n")
    png = plot(results, out.with_suffix(".png"))
    print(json.dumps({k: v for k, v in results.items() if k not in ("host_memory", "shaped", "notes")}, indent=2))
    print(f"wrote {out}" + (f" and {png}" if png else " (no plot: matplotlib missing)"), file=sys.stderr)


NOTES = {
    "measured": (
        "Every rate and fill time is measured between separate processes over real sockets/UCX. Part 1 runs on "
        "this host's loopback/shared memory (CPU-bound on 2 cores). Parts 2-3 run between network namespaces "
        "joined by veth pairs and a bridge; every host's uplink is a tc tbf qdisc (shaped_link), and the source's "
        "uplink byte counter is recorded around the first one-hop transfer (shaped[kind].wire) to show the bytes "
        "crossed the shaped link. Downlinks are not shaped, so a target can take g uplinks at once (part 3). "
        "Part 4: host_bytes_o1 and host_bytes_per_host are the sums of the bytes each real parameter-manager "
        "process reports holding (its blitzmesh_param_host_bytes gauge); host_memory.host_rss_growth_* are the "
        "sums of each process's RssAnon minus that of an idle parameter manager holding no model."
    ),
    "computed": (
        "host_memory.host_bytes_per_host_computed = H x model bytes (the formula the measured per-host figure is "
        "checked against); targets.* ratios are computed from the measured figures."
    ),
    "transports": (
        "ucx = UCX_TLS=^cma on one host (shared-memory copy-in/copy-out: a dead sender cannot abort its receiver); "
        "ucx-cma = UCX_TLS=all; over shaped links UCX is forced to UCX_TLS=tcp on the namespace's veth "
        "(UCX_NET_DEVICES=bm0) and the node's mount namespace gets its own /sys so UCX finds that device. "
        "UCX's tcp path keeps up with the link when the CPU is free but loses more than TCP when other jobs "
        "load the 2 cores (see machine.load_avg_*)."
    ),
    "ucx_on_one_host": (
        "With UCX_TLS=^cma, UCX moves a large message between two processes of one host as 'rendezvous "
        "fragmented copy-in copy-out' over sysv shared memory in 8 KiB fragments (UCX_PROTO_INFO=y): the sender "
        "copies in, the receiver copies out, a core each on this 2-core machine. one_hop_transport_gbps is that "
        "path through our transport (tagged messages of chunk_bytes, 4 in flight, no checksums): what "
        "ucx_perftest measures. one_hop_gbps is the whole pull, which also computes a checksum over every "
        "received byte (checksum_algo): a second pass over memory that has no core of its own here. With xxh3 "
        "(the default) the pull is 5-20% slower than with the hand-written blocksum64 and 10% faster than with "
        "crc32c (one_hop_by_checksum_gbps; services/dataplane/checksum.py has the interleaved runs); xxh3 and "
        "crc32c hold the GIL, so their digests run on the receiving loop while the chunk is in cache, blocksum64 "
        "and crc32 in a thread. Measured by hand with the digest step skipped, the pull reached 0.65-0.85 of the "
        "transport: the rest of the gap is the protocol. "
        "Before ucxx's progress was replaced (services/dataplane/ucx.py, _ArmedProgress) every idle node "
        "process spun a core, and the same-host figures were several times worse (one hop 1.00 GB/s, a chain of "
        "one 4.67 s)."
    ),
    "contention": "shared 2-core machine: best of runs is reported, medians and all runs are kept alongside.",
}


if __name__ == "__main__":
    main()
