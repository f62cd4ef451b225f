"""The local launcher's flags and what they start: colocated by default, or P prefill + D decode
workers with the manager's pool floors to match."""

from __future__ import annotations

import pytest

from services.common.config import load_config
from services.global_manager.config import GlobalManagerConfig
from services.mesh.__main__ import parse_args
from services.mesh.launcher import MeshConfig, describe_workers


def test_colocated_stays_the_default() -> None:
    cfg = parse_args([])
    assert (cfg.workers, cfg.prefill, cfg.decode, cfg.initial_instances) == (2, 0, 0, 2)
    assert not cfg.disaggregated and cfg.worker_count == 2
    assert [cfg.worker_role(i) for i in range(2)] == ["colocated", "colocated"]
    assert cfg.manager_pool_args() == ["--min-instances", "2"]
    assert cfg.serving_wanted() == {"any": 2}
    assert parse_args(["--workers", "3", "--initial-instances", "1"]).manager_pool_args() == ["--min-instances", "1"]


def test_prefill_and_decode_start_both_pools() -> None:
    cfg = parse_args(["--prefill", "1", "--decode", "2"])
    assert cfg.disaggregated and cfg.worker_count == 3
    assert [cfg.worker_role(i) for i in range(3)] == ["prefill", "decode", "decode"]
    assert cfg.manager_pool_args() == ["--min-prefill", "1", "--min-decode", "2", "--min-instances", "0"]
    assert cfg.serving_wanted() == {"prefill": 1, "decode": 2}
    # The manager accepts exactly what the launcher passes it.
    gm = load_config(GlobalManagerConfig, "global_manager", ["--default-model", "m", *cfg.manager_pool_args()], env={})
    assert gm.disaggregated and (gm.min_prefill, gm.min_decode, gm.min_instances) == (1, 2, 0)
    # Extra workers stay IDLE for the autoscaler.
    spare = parse_args(["--prefill", "1", "--decode", "1", "--workers", "3"])
    assert spare.worker_count == 3 and spare.worker_role(2) == "colocated"


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--prefill", "1"], "--prefill 1 --decode 0: give both > 0"),
        (["--decode", "2"], "--prefill 0 --decode 2: give both > 0"),
        (["--prefill", "-1", "--decode", "1"], "--prefill -1 --decode 1"),
        (["--prefill", "1", "--decode", "2", "--workers", "2"], "--workers 2 is fewer than --prefill 1 + --decode 2"),
        (["--prefill", "1", "--decode", "1", "--initial-instances", "1"], "--initial-instances 1 applies to colocated"),
        (["--workers", "-1"], "--workers must be >= 0, got -1"),
    ],
)
def test_bad_flags_are_refused_quoting_the_values(
    argv: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit):
        parse_args(argv)
    assert message in capsys.readouterr().err


def test_mesh_config_validates_and_raises_the_worker_count() -> None:
    with pytest.raises(ValueError, match="prefill=2 and decode=0: give both > 0"):
        MeshConfig(prefill=2)
    # Built in code (tests, benchmarks) with the default workers=2: enough workers for both pools.
    cfg = MeshConfig(prefill=1, decode=2)
    assert cfg.worker_count == 3


def test_banner_names_the_roles() -> None:
    cfg = MeshConfig(prefill=1, decode=1, workers=3)
    assert describe_workers(cfg, {"worker-1": "decode", "worker-0": "prefill"}) == (
        "1 prefill + 1 decode workers + 1 idle (disaggregated: worker-0 prefill, worker-1 decode)"
    )
    assert describe_workers(MeshConfig(workers=2), {}) == "2 workers"
