"""A mesh on network-namespace hosts (`MeshConfig.netns_rate_mbit`): every worker and the host
cache on an emulated host behind a `tc tbf` uplink, the manager and the gateway in this
namespace. It serves, a scale-out's parameters leave through a shaped uplink, a live ZigZag
split crosses those links with the exact tokens, and the namespaces are gone after the stop.
Needs root and iproute2; skipped otherwise."""

from __future__ import annotations

import asyncio
import ipaddress
import subprocess
from pathlib import Path

import pytest

import blitzmesh
from services.common.waiting import wait_until
from services.mesh.launcher import Mesh, MeshConfig
from services.mesh.netns import unavailable_reason
from services.model_format.synth import synthesize
from tests.e2e.test_zigzag import split_during_scale_out

REASON = unavailable_reason()

pytestmark = [
    pytest.mark.e2e,
    pytest.mark.netns,
    pytest.mark.asyncio,
    pytest.mark.timeout(240),
    pytest.mark.skipif(REASON is not None, reason=f"network namespaces unavailable: {REASON}"),
]

MODEL = "tiny6"
RATE_MBIT = 20  # the ~6 MB model takes seconds to arrive, layer by layer


async def test_a_mesh_on_shaped_hosts_serves_scales_out_and_splits_exactly(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = synthesize(tmp_path / "models" / MODEL, "tiny", seed=0, overrides={"num_hidden_layers": 6})
    model_bytes = sum(f.stat().st_size for f in path.glob("*.safetensors"))
    for service in ("WORKER", "PARAM_MANAGER"):
        monkeypatch.setenv(f"BLITZMESH_{service}_DATAPLANE", "tcp")
        monkeypatch.setenv(f"BLITZMESH_{service}_DATAPLANE_LINK_GBPS", "0")  # the qdiscs shape
    cfg = MeshConfig(
        workers=2,
        initial_instances=1,
        model=MODEL,
        model_dir=tmp_path / "models",
        run_dir=tmp_path / "run",
        http_port=0,
        grpc_port=0,
        ready_timeout_s=120.0,
        netns_rate_mbit=RATE_MBIT,
        # A busy instance (a small batch, emulated pacing) so that requests queue during the load.
        worker_args=["--step-time-a-s", "0.03", "--step-time-b-s", "0.0005", "--max-batch-size", "2"],
        manager_args=["--zigzag-dispatch", "route", "--zigzag-stall-s", "30", "--zigzag-ttft-s", "0.001"],
    )
    mesh = Mesh(cfg)
    try:
        await mesh.start()
        net = mesh.network
        assert net is not None and net.plan.root_address is not None
        subnet = ipaddress.ip_network(f"{net.plan.root_address}/24", strict=False)
        for name in ("worker-0", "worker-1", "param_manager"):
            proc = mesh.procs[name]
            assert proc.netns is not None and ipaddress.ip_address(proc.host) in subnet, (name, proc)
        assert "tbf" in net.qdisc(net.hosts[0]) and f"{RATE_MBIT}Mbit" in net.qdisc(net.hosts[0])
        prompts = [f"netns {i} " * (1 + i % 4) for i in range(14)]
        async with blitzmesh.AsyncClient(mesh.gateway_grpc, timeout_s=120, max_retries=0) as client:
            state = await client.cluster()
            assert {i.address.rsplit(":", 1)[0] for i in state.instances} == {h.address for h in net.hosts[:2]}
            tx_before = sum(net.tx_bytes(h) for h in net.hosts)
            # References served whole, then a burst split with the instance loading behind its link.
            await split_during_scale_out(client, prompts, None)

            async def split_and_serving() -> bool:
                instances = (await client.cluster()).instances
                continued = sum(i.load.zigzag_continued_total for i in instances)
                return continued >= 1 and sum(i.state == "serving" for i in instances) == 2

            await wait_until(split_and_serving, 120, interval_s=0.2, what="a split request, then both SERVING")
            # The parameters left through the shaped uplinks (a chain from worker-0, or the cache).
            sent = sum(net.tx_bytes(h) for h in net.hosts) - tx_before
            assert sent >= model_bytes, (sent, model_bytes)
        names = {h.netns for h in net.hosts} | {net.plan.switch}
    finally:
        await mesh.stop()
    done = await asyncio.to_thread(subprocess.run, ["ip", "netns", "list"], capture_output=True, text=True)
    listed = done.stdout
    assert not names & {line.split()[0] for line in listed.splitlines() if line.strip()}
