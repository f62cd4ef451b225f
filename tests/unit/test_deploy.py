"""The compose deployment stays true to the code: every command parses with its service's config."""

from __future__ import annotations

import importlib
from pathlib import Path

import pytest
import yaml

from services.common.config import load_config
from services.gateway.config import GatewayConfig
from services.global_manager.config import GlobalManagerConfig
from services.model_format.__main__ import build_parser
from services.model_format.default_model import DEFAULT_MODEL_ID
from services.param_manager.service import ParamManagerConfig
from services.worker.config import WorkerConfig

ROOT = Path(__file__).resolve().parents[2]
CONFIGS = {
    "services.gateway": (GatewayConfig, "gateway"),
    "services.global_manager": (GlobalManagerConfig, "global_manager"),
    "services.param_manager": (ParamManagerConfig, "param_manager"),
    "services.worker": (WorkerConfig, "worker"),
}


def compose_services() -> dict[str, dict]:
    return yaml.safe_load((ROOT / "docker-compose.yml").read_text())["services"]


@pytest.mark.parametrize("name", sorted(compose_services()))
def test_compose_command_parses(name: str) -> None:
    svc = compose_services()[name]
    python, dash_m, module, *args = svc["command"]
    assert (python, dash_m) == ("python", "-m")
    importlib.import_module(module)
    if module in CONFIGS:
        cls, service = CONFIGS[module]
        cfg = load_config(cls, service, args, env={})
        assert cfg.host == "0.0.0.0"  # reachable from the other containers
    for dep in svc.get("depends_on", {}):
        assert dep in compose_services(), f"{name} depends on unknown service {dep!r}"


def test_workers_advertise_their_container_name() -> None:
    for name, svc in compose_services().items():
        if svc["command"][2] == "services.worker":
            cfg = load_config(WorkerConfig, "worker", svc["command"][3:], env={})
            assert cfg.advertise_host == name and cfg.instance_id == name


def test_model_init_fetches_the_model_the_manager_serves() -> None:
    services = compose_services()
    python, dash_m, module, *args = services["model-init"]["command"]
    assert (python, dash_m, module) == ("python", "-m", "services.model_format")
    parsed = build_parser().parse_args(args)
    assert parsed.command == "fetch-default"
    # The volume model-init writes is the one the parameter manager reads.
    pm = load_config(ParamManagerConfig, "param_manager", services["param_manager"]["command"][3:], env={})
    assert parsed.model_dir == pm.model_dir
    gm = load_config(GlobalManagerConfig, "global_manager", services["global_manager"]["command"][3:], env={})
    assert gm.default_model == DEFAULT_MODEL_ID
