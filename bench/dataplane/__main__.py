"""Data plane throughput: one hop, forwarding chains and sequential unicast, UCX and TCP.

Usage:
    python -m bench.dataplane [--quick] [--transports ucx,tcp] [--out bench/results/dataplane.json]

Every number comes from separate node processes (`services.dataplane.testing`) on this host:
- memcpy_gbps: np.copyto of the payload in one process (warm, best of 5): the ceiling.
- ucx_perftest_gbps: `ucx_perftest -t tag_bw` from the libucx wheel, with the UCX_TLS our
  transport uses ("^cma", see services/dataplane/ucx.py), and ucx_perftest_all_tls_gbps with
  UCX's default (cma included). Null when the binary is not installed.
- kinds: "ucx" (our default UCX_TLS=^cma), "ucx-cma" (UCX_TLS=all: cma allowed, faster on one
  host, unsafe when a sender dies), "tcp" (asyncio sockets).
- one_hop_gbps[kind]: a receiver pulls the whole model from a source; best of the warm runs
  (receive buffers reused, as a worker reuses its memory); one_hop_cold_gbps: the first run.
- chain_fill_s[kind][n]: source -> R1 -> ... -> Rn, all started at once; seconds until the
  last receiver holds every byte (best of runs). unicast_fill_s[kind][n]: the same n receivers
  pulling from the source one after the other.
The machine is shared and has 2 cores: load_avg is recorded before and after, and the best of
several runs is reported because other jobs steal the CPU in bursts.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

from services.dataplane.testing import ModelSpec, NodeProcess, NodeSpec, start_nodes
from services.dataplane.transport import ucx_available

MIB = 1 << 20
NUM_LAYERS = 8  # plus embed and head, half a layer each: 9 layer-sizes in all


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


def ucx_perftest_gbps(size_bytes: int, iterations: int, tls: str | None) -> float | None:
    binary = _perftest_binary()
    if binary is None:
        return None
    env = dict(os.environ, LD_LIBRARY_PATH=str(binary.parent.parent / "lib"), UCX_WARN_UNUSED_ENV_VARS="n")
    env.pop("UCX_TLS", None)
    if tls is not None:
        env["UCX_TLS"] = tls
    port = _free_port()
    server = subprocess.Popen(
        [str(binary), "-p", str(port)], env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
    )
    try:
        for _ in range(50):  # the server needs a moment to listen; retry the client on refusal
            client = subprocess.run(
                [
                    str(binary),
                    "127.0.0.1",
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


def _model(kind: str, payload_bytes: int, chunk_bytes: int) -> ModelSpec:
    return ModelSpec(
        model_id=f"bench-{kind}",
        num_layers=NUM_LAYERS,
        layer_bytes=payload_bytes // (NUM_LAYERS + 1),
        chunk_bytes=chunk_bytes,
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


def bench_transport(kind: str, payload_bytes: int, chunk_bytes: int, max_n: int, runs: int) -> dict[str, Any]:
    nodes = start_nodes([_node_spec(kind) for _ in range(max_n + 1)], timeout_s=120)
    source, receivers = nodes[0], nodes[1:]
    try:
        manifest, _ = source.serve(_model(kind, payload_bytes, chunk_bytes), timeout_s=300)
        cold, warm = _one_hop(source, receivers[0], manifest, runs + 1)
        for r in receivers[1:]:  # fault in every receiver's buffers once, as for receiver 1
            _one_hop(source, r, manifest, 1)
        chain: dict[str, list[float]] = {}
        unicast: dict[str, list[float]] = {}
        for n in range(1, max_n + 1):
            chain[str(n)] = [_chain_fill_s(source, receivers[:n], manifest) for _ in range(runs)]
            unicast[str(n)] = [_unicast_fill_s(source, receivers[:n], manifest) for _ in range(runs)]
        return {
            "one_hop_cold_gbps": round(cold, 3),
            "one_hop_gbps": round(max(warm), 3),
            "one_hop_runs_gbps": [round(x, 3) for x in warm],
            "chain_fill_s": {n: round(min(v), 4) for n, v in chain.items()},
            "chain_fill_median_s": {n: round(statistics.median(v), 4) for n, v in chain.items()},
            "unicast_fill_s": {n: round(min(v), 4) for n, v in unicast.items()},
            "unicast_fill_median_s": {n: round(statistics.median(v), 4) for n, v in unicast.items()},
        }
    finally:
        for node in nodes:
            node.stop()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.dataplane", description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="256 MiB payload and 2 runs (default 1 GiB, 3)")
    parser.add_argument("--transports", default="ucx,ucx-cma,tcp", help="comma-separated: ucx, ucx-cma, tcp")
    parser.add_argument("--chunk-mib", type=int, default=16, help="chunk size in MiB")
    parser.add_argument("--max-n", type=int, default=3, help="longest chain / most unicast receivers")
    parser.add_argument("--out", default="bench/results/dataplane.json")
    args = parser.parse_args(argv)
    payload = (256 if args.quick else 1024) * MIB
    runs = 2 if args.quick else 3
    kinds = [k for k in args.transports.split(",") if k]
    ucx_ok, ucx_reason = ucx_available()
    if not ucx_ok and any(k.startswith("ucx") for k in kinds):
        print(f"skipping ucx: {ucx_reason}", file=sys.stderr)
        kinds = [k for k in kinds if not k.startswith("ucx")]

    results: dict[str, Any] = {
        "payload_bytes": payload,
        "chunk_bytes": args.chunk_mib * MIB,
        "runs": runs,
        "machine": {"cpus": os.cpu_count(), "python": platform.python_version(), "load_avg_before": _load()},
    }
    results["memcpy_gbps"] = round(memcpy_gbps(payload), 3)
    perftest_iters = 8 if args.quick else 16
    pt_safe = ucx_perftest_gbps(payload, perftest_iters, tls="^cma") if ucx_ok else None
    pt_all = ucx_perftest_gbps(payload, perftest_iters, tls=None) if ucx_ok else None
    results["ucx_perftest_gbps"] = None if pt_safe is None else round(pt_safe, 3)
    results["ucx_perftest_all_tls_gbps"] = None if pt_all is None else round(pt_all, 3)
    per_kind = {k: bench_transport(k, payload, args.chunk_mib * MIB, args.max_n, runs) for k in kinds}
    for key in (
        "one_hop_gbps",
        "one_hop_cold_gbps",
        "one_hop_runs_gbps",
        "chain_fill_s",
        "chain_fill_median_s",
        "unicast_fill_s",
        "unicast_fill_median_s",
    ):
        results[key] = {k: v[key] for k, v in per_kind.items()}
    if "ucx" in per_kind and pt_safe:
        results["ucx_over_perftest"] = round(per_kind["ucx"]["one_hop_gbps"] / pt_safe, 3)
    if "ucx-cma" in per_kind and pt_all:
        results["ucx_cma_over_perftest_all_tls"] = round(per_kind["ucx-cma"]["one_hop_gbps"] / pt_all, 3)
    results["machine"]["load_avg_after"] = _load()
    results["notes"] = (
        "ucx = UCX_TLS=^cma (shared-memory copy-in/copy-out: a dead sender cannot abort its receiver, "
        "but it stalls when the CPU is oversubscribed); ucx-cma = UCX_TLS=all; one_hop_gbps is the best "
        "warm run, fill times are the best of runs; shared 2-core machine, see machine.load_avg_*."
    )
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(results, indent=2) + "\n")
    print(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
