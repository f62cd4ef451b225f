"""A link's rate collapsed to 1% mid-transfer (`tc change` on a real shaped link).

This fault is injected where real links exist: data-plane node processes on network-namespace
hosts, each behind a `tc tbf` uplink (services/mesh/netns.py), not the in-process emulated
links of the mesh. A chain S -> A -> B loads a model, each hop with a fallback source F (a host
cache holding it). Once a third of the model has left S, S's uplink drops to 1% of its rate:
A's chunks stop arriving within its stall timeout, so A re-sources the missing bytes from F and
B (pulling from A) never notices beyond the pause. Needs root and iproute2; skipped otherwise.
"""

from __future__ import annotations

import os
import subprocess
import time

import pytest

from bench.dataplane.links import node_spec
from services.mesh.netns import ShapedNetwork, plan, unavailable_reason
from tests.chaos.harness import write_row
from tests.harness.dataplane_nodes import ModelSpec, start_nodes

REASON = unavailable_reason()
pytestmark = [
    pytest.mark.netns,
    pytest.mark.timeout(180),
    pytest.mark.skipif(REASON is not None, reason=f"network namespaces unavailable: {REASON}"),
]

RATE_MBIT = 80  # 10 MB/s; collapsed: 0.8 Mbit/s, a 256 KiB chunk then takes 2.6 s
STALL_S = 1.0


def test_link_rate_collapse_mid_transfer_resources_from_the_fallback() -> None:
    netplan = plan(4, prefix=f"bmdp-{os.getpid()}-chaos", subnet="10.77.11", rate_mbit=RATE_MBIT)
    with ShapedNetwork(netplan) as net:
        nodes = start_nodes([node_spec("tcp", h) for h in net.hosts], timeout_s=60)
        try:
            s, a, b, f = nodes
            model = ModelSpec(model_id="collapse", num_layers=6, layer_bytes=1 << 20, chunk_bytes=256 * 1024)
            manifest, digests = s.serve(model)
            manifest_f, _ = f.serve(model)
            assert manifest_f == manifest
            total = sum(1 << 20 for _ in range(model.num_layers))  # about: the layers dominate
            tx0 = net.tx_bytes(net.hosts[0])
            started = time.monotonic()
            a.receive(manifest, [(s.address, None, (f.address,))], stall_timeout_s=STALL_S)
            b.receive(manifest, [(a.address, None, (f.address,))], stall_timeout_s=STALL_S)
            deadline = time.monotonic() + 30
            while net.tx_bytes(net.hosts[0]) - tx0 < total // 3:  # a third of the model has left S
                assert time.monotonic() < deadline, "the transfer never got going"
                time.sleep(0.01)
            collapsed_at = time.monotonic()
            slow = [*netplan.tbf_args()]
            slow[slow.index("rate") + 1] = f"{RATE_MBIT / 100:g}mbit"
            h0 = net.hosts[0]
            subprocess.run(["tc", "-n", h0.netns, "qdisc", "change", "dev", h0.device, "root", *slow], check=True)
            assert f"{RATE_MBIT / 100:g}" in net.qdisc(h0) or "800Kbit" in net.qdisc(h0), net.qdisc(h0)
            out_a, out_b = a.expect(120), b.expect(120)
            done_s = time.monotonic() - collapsed_at
        finally:
            for n in nodes:
                n.stop()
    assert out_a[0] == "done" and out_b[0] == "done", (out_a, out_b)
    assert out_a[1]["digests"] == digests and out_b[1]["digests"] == digests
    assert out_a[1]["resourced"], "A should have re-sourced from the fallback"
    # At 1% the rest of S's share would take minutes; re-sourcing finishes in seconds.
    rest_at_collapsed_rate_s = (2 * total / 3) / (RATE_MBIT / 100 * 1e6 / 8)
    assert done_s < rest_at_collapsed_rate_s / 4, f"{done_s:.1f} s after the collapse"
    write_row(
        {
            "fault": "link_rate_collapse",
            "requests": 0,
            "completed": 0,
            "migrated": 0,
            "errors": 0,
            "lost": 0,
            "hung": 0,
            "recovery_s": round(done_s, 2),
            "setup": "data plane on netns hosts with tc tbf 80 Mbit/s, S uplink cut to 0.8 Mbit/s; "
            "no mesh and no requests: the transfer is what the fault hits",
            "resourced_groups": len(out_a[1]["resourced"]),
            "elapsed_s": round(time.monotonic() - started, 2),
        }
    )
