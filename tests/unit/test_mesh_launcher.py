"""The local launcher's flags and what they start: colocated by default (3 workers, 1 loaded,
HeteroScale autoscaling into the others), or P prefill + D decode workers with the manager's
pool floors to match."""

from __future__ import annotations

import pytest

from services.common.config import load_config
from services.gateway.config import GatewayConfig
from services.global_manager.config import GlobalManagerConfig
from services.mesh.__main__ import LOCAL_POLICY_PARAMS, parse_args
from services.mesh.launcher import MeshConfig, describe_workers
from services.worker.config import WorkerConfig


def test_make_up_autoscales_into_idle_workers_by_default() -> None:
    cfg = parse_args([])
    assert (cfg.workers, cfg.prefill, cfg.decode, cfg.initial_instances) == (3, 0, 0, 1)
    assert not cfg.disaggregated and cfg.worker_count == 3
    assert [cfg.worker_role(i) for i in range(3)] == ["colocated"] * 3
    assert cfg.manager_pool_args() == ["--min-instances", "1"]
    assert cfg.serving_wanted() == {"any": 1}  # ready (and the first request answered) with one
    assert cfg.autoscale and cfg.policy_params == LOCAL_POLICY_PARAMS
    assert cfg.gateway_wait_args() == ["--schedule-wait-s", "60.0"]
    # The manager accepts exactly what the launcher passes it: HeteroScale up to every worker.
    argv = ["--default-model", "m", *cfg.manager_pool_args(), *cfg.manager_autoscale_args()]
    gm = load_config(GlobalManagerConfig, "global_manager", argv, env={})
    assert gm.autoscale and gm.policy == "heteroscale" and gm.scale_from_zero
    assert (gm.min_instances, gm.max_instances, gm.window_s) == (1, 3, 4.0)
    assert gm.policy_params == LOCAL_POLICY_PARAMS
    gw = load_config(
        GatewayConfig,
        "gateway",
        ["--global-manager", "a:1", "--param-manager", "b:2", *cfg.gateway_wait_args()],
        env={},
    )
    assert gw.schedule_wait_s == 60.0
    assert describe_workers(cfg, {}) == "3 workers (1 loaded, 2 idle)"


def test_make_up_workers_share_the_cores_among_loaded_instances() -> None:
    cfg = parse_args([])
    assert cfg.worker_threads == 0
    args = cfg.worker_thread_args()
    assert args[:2] == ["--num-threads", "0"] and args[2] == "--cpu-share-dir"
    assert args[3] == str((cfg.run_dir / "cpu-share").resolve())
    # The worker accepts exactly that.
    worker = load_config(WorkerConfig, "worker", ["--instance-id", "w", *args], env={})
    assert worker.num_threads == 0 and worker.cpu_share_dir == args[3]
    assert parse_args(["--worker-threads", "3"]).worker_thread_args() == ["--num-threads", "3"]
    assert MeshConfig().worker_thread_args() == ["--num-threads", "1"]  # meshes built in code


def test_autoscale_flags() -> None:
    off = parse_args(["--no-autoscale", "--workers", "2", "--initial-instances", "2"])
    assert not off.autoscale and off.manager_autoscale_args() == [] and off.policy_params == {}
    assert off.manager_pool_args() == ["--min-instances", "2"]
    assert describe_workers(off, {}) == "2 workers"
    tuned = parse_args(["--policy-params", '{"scale_in_cooldown_s": 5, "target_requests_per_instance": 2}'])
    assert tuned.policy_params == {**LOCAL_POLICY_PARAMS, "scale_in_cooldown_s": 5, "target_requests_per_instance": 2}
    # Scale from zero: none loaded at start.
    cold = parse_args(["--no-autoscale", "--initial-instances", "0"])
    assert cold.manager_pool_args() == ["--min-instances", "0"] and cold.serving_wanted() == {"any": 0}
    # The split pools autoscale too, bounded by the workers started.
    split = parse_args(["--prefill", "1", "--decode", "2", "--workers", "4"])
    assert (
        "--max-instances" in (args := split.manager_autoscale_args()) and args[args.index("--max-instances") + 1] == "4"
    )


def test_meshes_built_in_code_keep_their_settings() -> None:
    # Tests and benchmarks construct MeshConfig with what they mean; its defaults add nothing.
    cfg = MeshConfig()
    assert (cfg.workers, cfg.initial_instances, cfg.autoscale) == (2, 2, False)
    assert cfg.manager_autoscale_args() == [] and cfg.gateway_wait_args() == []


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
        (["--workers", "2", "--initial-instances", "3"], "--initial-instances 3 must be between 0 and --workers 2"),
        (["--policy-params", '{"scale_out_cooldown_s": -1}'], "scale_out_cooldown_s"),
        (["--policy-params", '{"no_such": 1}'], "no_such"),
        (["--policy-params", "[1]"], "--policy-params must be a JSON object"),
        (["--schedule-wait-s", "-1"], "--schedule-wait-s must be >= 0"),
        (["--worker-threads", "-2"], "--worker-threads must be >= 0 (0 = auto), got -2"),
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
