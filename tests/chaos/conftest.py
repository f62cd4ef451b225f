"""Chaos fixtures: the two topologies a fault runs in (a fresh mesh of real processes per test,
each fault breaks it), on the tiny model with emulated accelerator pacing (10 ms + 0.2 ms per
token a step) and emulated 10 Mbit/s data-plane links, so a load of the 3.6 MB model takes
about 3 s and a fault can land while parameters are moving.

- `chaos_config`: four workers, two SERVING and two IDLE to scale into, autoscaling off (each
  test scales out through the admin API at a moment of its choosing);
- `default_topology_config`: `make up`'s shape, 3 workers (1 SERVING), autoscaling, supervised.

Kinds marked `chaos_full` are skipped unless BLITZMESH_CHAOS_FULL=1 (`python -m bench.chaos`).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest

from services.mesh.__main__ import LOCAL_POLICY_PARAMS, LOCAL_WINDOW_S, SCHEDULE_WAIT_S
from services.mesh.launcher import MeshConfig
from services.mesh.supervision import RestartPolicy
from services.model_format.synth import synthesize
from tests.chaos.harness import MODEL, TRACE

# `python -m bench.chaos` sets it: the whole fault matrix runs, not only the kinds `make test` keeps.
FULL_MATRIX_ENV = "BLITZMESH_CHAOS_FULL"


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    full = os.environ.get(FULL_MATRIX_ENV) == "1"
    skip = pytest.mark.skip(
        reason=f"an extra kind of the chaos matrix: `python -m bench.chaos` runs it ({FULL_MATRIX_ENV}=1), "
        "`make test` keeps the suite's time down"
    )
    for item in items:
        if "tests/chaos/" in str(item.path).replace("\\", "/"):
            item.add_marker(pytest.mark.chaos)
            item.add_marker(pytest.mark.e2e)
            if item.get_closest_marker("chaos_full") is not None and not full:
                item.add_marker(skip)


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


def default_topology_config(
    model_dir: Path, run_dir: Path, worker_args_extra: tuple[str, ...] = (), **kw: Any
) -> MeshConfig:
    """`make up`'s shape on the chaos suite's model, pacing and links: 3 workers, 1 loaded and 2
    idle, one host cache, autoscaling on (LOCAL_POLICY_PARAMS), supervised."""
    return chaos_config(
        model_dir,
        run_dir,
        # After a kill, up to 3 workers reload from the one host cache at once: its 10 Mbit/s
        # link then moves each ~1 MiB group message in ~2.5 s, past the suite's 2 s stall timeout,
        # and every reload would restart from its late group again and again.
        ("--stall-timeout-s", "5", *worker_args_extra),
        **{
            "workers": 3,
            "initial_instances": 1,
            "host_caches": 1,
            "autoscale": True,
            "policy_params": dict(LOCAL_POLICY_PARAMS),
            "window_s": LOCAL_WINDOW_S,
            "schedule_wait_s": SCHEDULE_WAIT_S,
            "supervise": True,
            "restart_policy": RestartPolicy(initial_backoff_s=0.2, max_backoff_s=1.0, max_restarts=5, window_s=120.0),
            **kw,
        },
    )
