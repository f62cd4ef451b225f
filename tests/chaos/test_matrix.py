"""The chaos fault matrix: every fault kind of tests/chaos/faults.py, injected during a scale-out
under a burst of the Azure code trace, in the 4-worker chaos mesh and in the default topology of
`make up`.

Each asserts: no accepted request lost or hung past its deadline, no error but the fault's
designed one, no scale-out rolled back or left unresolved, the cluster healthy again (the time to
that goes to bench/results/chaos.json under `python -m bench.chaos`), and what the kind checks on top. `make test` keeps the
4-worker runs of the kinds it always had (and test_default_topology.py's kills of the default
topology); the rest carry the `chaos_full` marker and run under `python -m bench.chaos`.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from services.mesh.launcher import Mesh
from tests.chaos.conftest import chaos_config, default_topology_config
from tests.chaos.faults import FAULTS, FaultKind, run_fault
from tests.chaos.harness import TOPOLOGIES

pytestmark = pytest.mark.asyncio(loop_scope="function")

CASES = [
    pytest.param(
        topology, kind, id=f"{topology}-{kind.name}", marks=() if topology in kind.ci else pytest.mark.chaos_full
    )
    for topology in TOPOLOGIES
    for kind in FAULTS
]


@pytest.mark.parametrize(("topology", "kind"), CASES)
async def test_fault(
    topology: str, kind: FaultKind, chaos_model_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The host caches' links too (children inherit the environment).
    monkeypatch.setenv("BLITZMESH_PARAM_MANAGER_DATAPLANE_LINK_GBPS", "0.01")
    config = default_topology_config if topology == "default" else chaos_config
    async with Mesh(config(chaos_model_dir, tmp_path / "run", **kind.mesh)) as mesh:
        await run_fault(kind, mesh, TOPOLOGIES[topology])
