"""Config layering (defaults < file < env < CLI) and errors that quote the bad value."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from services.common.config import load_config
from services.gateway.config import GatewayConfig
from services.param_manager.service import ParamManagerConfig
from services.worker.config import WorkerConfig


def test_precedence_file_env_cli(tmp_path: Path) -> None:
    f = tmp_path / "w.json"
    f.write_text(json.dumps({"max_batch_size": 4, "block_size": 8, "role": "decode"}))
    env = {"BLITZMESH_WORKER_BLOCK_SIZE": "32", "BLITZMESH_WORKER_MAX_BATCH_SIZE": "6"}
    cfg = load_config(WorkerConfig, "worker", ["--config", str(f), "--max-batch-size", "9"], env=env)
    assert cfg.max_batch_size == 9  # CLI beats env and file
    assert cfg.block_size == 32  # env beats file
    assert cfg.role == "decode"  # file beats default
    assert cfg.kv_cache_tokens == WorkerConfig.model_fields["kv_cache_tokens"].default


def test_toml_file_and_bool_flags(tmp_path: Path) -> None:
    f = tmp_path / "pm.toml"
    f.write_text('model_dir = "/srv/models"\nlog_json = true\n')
    cfg = load_config(ParamManagerConfig, "param_manager", ["--config", str(f)], env={})
    assert cfg.model_dir == Path("/srv/models") and cfg.log_json is True
    cfg = load_config(ParamManagerConfig, "param_manager", ["--config", str(f), "--no-log-json"], env={})
    assert cfg.log_json is False


@pytest.mark.parametrize(
    ("argv", "env", "quoted"),
    [
        (["--port", "70000"], {}, "70000"),
        (["--role", "chef"], {}, "chef"),
        ([], {"BLITZMESH_WORKER_BLOCK_SIZE": "big"}, "big"),
        (["--kv-cache-tokens", "4", "--block-size", "16"], {}, "kv_cache_tokens=4"),
        (["--step-time-a-s", "0.01"], {}, "step_time_a_s"),
    ],
)
def test_bad_values_are_quoted(argv: list[str], env: dict[str, str], quoted: str) -> None:
    with pytest.raises(SystemExit) as e:
        load_config(WorkerConfig, "worker", argv, env=env)
    assert quoted in str(e.value)


def test_unknown_file_key_rejected(tmp_path: Path) -> None:
    f = tmp_path / "g.json"
    f.write_text(json.dumps({"max_concurency": 3}))
    with pytest.raises(SystemExit) as e:
        load_config(GatewayConfig, "gateway", ["--config", str(f)], env={})
    assert "max_concurency" in str(e.value)


def test_list_fields_from_cli() -> None:
    cfg = load_config(GatewayConfig, "gateway", ["--api-keys", '["k1", "k2"]'], env={})
    assert cfg.api_keys == ["k1", "k2"]
