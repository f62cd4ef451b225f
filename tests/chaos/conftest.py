"""Chaos fixtures: a mesh of real processes per test (each fault breaks it), on the tiny model.

Four workers, two SERVING at the start and two IDLE to scale into; emulated accelerator pacing
(10 ms + 0.2 ms per token a step) and emulated 20 Mbit/s data-plane links, so a load of the
3.6 MB model takes about 3 s and a fault can land while parameters are moving. Autoscaling
is off: each test scales out through the admin API at a moment of its choosing.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path

import pytest
import pytest_asyncio

from services.mesh.launcher import Mesh, MeshConfig
from services.model_format.synth import synthesize
from tests.chaos.harness import MODEL, TRACE


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        if "tests/chaos/" in str(item.path).replace("\\", "/"):
            item.add_marker(pytest.mark.chaos)
            item.add_marker(pytest.mark.e2e)


@pytest.fixture(scope="session")
def chaos_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    if not TRACE.exists():
        pytest.skip(f"the Azure code trace is not at {TRACE}")
    root = tmp_path_factory.mktemp("chaos-models")
    synthesize(root / MODEL, MODEL, seed=0)
    return root


def chaos_config(model_dir: Path, run_dir: Path, worker_args_extra: tuple[str, ...] = (), **kw: object) -> MeshConfig:
    """The chaos mesh; `kw` overrides any MeshConfig field (the default topology sets workers=3,
    initial_instances=1 and autoscaling)."""
    shape: dict[str, object] = {"workers": 4, "initial_instances": 2, "host_caches": 2, **kw}
    return MeshConfig(
        model=MODEL,
        model_dir=model_dir,
        run_dir=run_dir,
        http_port=0,
        grpc_port=0,
        ready_timeout_s=120.0,
        worker_args=[
            "--step-time-a-s",
            "0.01",
            "--step-time-b-s",
            "0.0002",
            "--dataplane-link-gbps",
            "0.01",
            "--stall-timeout-s",
            "2",
            *worker_args_extra,
        ],
        **shape,  # type: ignore[arg-type]
    )


@pytest_asyncio.fixture(loop_scope="function")
async def chaos_mesh(
    request: pytest.FixtureRequest, chaos_model_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> AsyncIterator[Mesh]:
    """A fresh chaos mesh; `@pytest.mark.parametrize("chaos_mesh", [{...}], indirect=True)`
    passes MeshConfig overrides (e.g. gateway_args)."""
    # The host caches' links too (children inherit the environment).
    monkeypatch.setenv("BLITZMESH_PARAM_MANAGER_DATAPLANE_LINK_GBPS", "0.01")
    m = Mesh(chaos_config(chaos_model_dir, tmp_path / "run", **getattr(request, "param", {})))
    try:
        await m.start()
        yield m
    finally:
        await m.stop()
