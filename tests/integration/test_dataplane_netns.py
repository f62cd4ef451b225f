"""Node processes in network namespaces behind tc-shaped links (services/mesh/netns.py):
a transfer crosses the shaped veth, is paced by it, arrives bit-identical, and the namespaces
are gone afterwards. Needs root and iproute2; skipped otherwise."""

from __future__ import annotations

import os
import subprocess
import time

import pytest

from bench.dataplane.links import node_spec
from services.dataplane import ucx_available
from services.mesh.netns import ShapedNetwork, plan, unavailable_reason
from tests.harness.dataplane_nodes import ModelSpec, start_nodes

REASON = unavailable_reason()
UCX_OK, UCX_REASON = ucx_available()

pytestmark = [
    pytest.mark.netns,
    pytest.mark.timeout(180),
    pytest.mark.skipif(REASON is not None, reason=f"network namespaces unavailable: {REASON}"),
]

RATE_MBIT = 80  # 10 MB/s: 4 MiB takes about 0.42 s on the wire


@pytest.mark.parametrize(
    "kind",
    [
        "tcp",
        pytest.param(
            "ucx", marks=[pytest.mark.ucx, pytest.mark.skipif(not UCX_OK, reason=f"ucxx does not import: {UCX_REASON}")]
        ),
    ],
)
def test_transfer_between_namespaces_is_paced_by_the_link(kind: str) -> None:
    netplan = plan(2, prefix=f"bmdp-{os.getpid()}-test-{kind}", subnet="10.77.9", rate_mbit=RATE_MBIT)
    with ShapedNetwork(netplan) as net:
        assert "tbf" in net.qdisc(net.hosts[0])
        nodes = start_nodes([node_spec(kind, h) for h in net.hosts], timeout_s=60)
        try:
            source, target = nodes
            manifest, digests = source.serve(
                ModelSpec(model_id=f"netns-{kind}", num_layers=3, layer_bytes=1 << 20, chunk_bytes=256 * 1024)
            )
            tx0 = net.tx_bytes(net.hosts[0])
            t0 = time.monotonic()
            target.receive(manifest, [(source.address, None, ())])
            msg = target.expect(60)
            elapsed = time.monotonic() - t0
            assert msg[0] == "done", msg
            out = msg[1]
            assert out["digests"] == digests
            sent = net.tx_bytes(net.hosts[0]) - tx0
            assert sent >= out["bytes"]  # the bytes left through the shaped veth, not a shortcut
            wire_s = out["bytes"] / netplan.link_bytes_per_s
            assert elapsed >= 0.8 * wire_s, f"{out['bytes']} bytes in {elapsed:.3f}s beat a {RATE_MBIT} Mbit link"
        finally:
            for n in nodes:
                n.stop()
    names = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    assert netplan.prefix not in names
