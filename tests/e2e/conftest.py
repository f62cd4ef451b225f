"""E2E fixtures: a real mesh of service processes on a tiny synthesized model.

Internal services bind port 0; the gateway too. Ready means SERVING on gRPC health and the
manager reporting the instances SERVING, never a sleep.
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator, Callable
from pathlib import Path

import pytest
import pytest_asyncio

from services.mesh.launcher import Mesh, MeshConfig
from services.model_format.synth import synthesize


@pytest.fixture(scope="session")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("models")
    synthesize(root / "tiny", "tiny", seed=0)
    return root


def mesh_config(model_dir: Path, run_dir: Path, workers: int = 2, **kw: object) -> MeshConfig:
    return MeshConfig(
        workers=workers,
        model="tiny",
        model_dir=model_dir,
        run_dir=run_dir,
        http_port=0,
        grpc_port=0,
        initial_instances=workers,
        ready_timeout_s=120.0,
        # Emulated accelerator pacing (5 ms a step) so a long generation outlives the
        # actions a test takes mid-stream (cancel, SIGKILL); the model still computes every token.
        worker_args=["--step-time-a-s", "0.005", "--step-time-b-s", "0"],
        **kw,  # type: ignore[arg-type]
    )


@pytest.fixture(scope="session")
def make_mesh_config(model_dir: Path) -> Callable[..., MeshConfig]:
    """Factory for tests that need a mesh of their own (e.g. to break it)."""

    def make(run_dir: Path, workers: int = 2, **kw: object) -> MeshConfig:
        return mesh_config(model_dir, run_dir, workers, **kw)

    return make


@contextlib.asynccontextmanager
async def running_mesh(cfg: MeshConfig) -> AsyncIterator[Mesh]:
    """A started mesh, stopped (every process) on the way out, also when the start failed."""
    m = Mesh(cfg)
    try:
        await m.start()
        yield m
    finally:
        await m.stop()


@pytest_asyncio.fixture(loop_scope="session", scope="session")
async def mesh(model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[Mesh]:
    """One shared mesh for the tests that do not break it."""
    async with running_mesh(mesh_config(model_dir, tmp_path_factory.mktemp("run"))) as m:
        yield m
