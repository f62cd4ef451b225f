"""The compose deployment stays true to the code: every command parses with its service's config."""

from __future__ import annotations

import importlib
from pathlib import Path

import pytest
import yaml

from services.common.config import load_config
from services.gateway.config import GatewayConfig
from services.global_manager.config import GlobalManagerConfig
from services.mesh.__main__ import LOCAL_POLICY_PARAMS, LOCAL_WINDOW_S, SCHEDULE_WAIT_S
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


def blitzmesh_services() -> dict[str, dict]:
    """The containers of the Blitzmesh image (the others, e.g. Prometheus, have images of their own)."""
    return {k: v for k, v in compose_services().items() if v.get("image") == "blitzmesh:latest"}


@pytest.mark.parametrize("name", sorted(blitzmesh_services()))
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
    for name, svc in blitzmesh_services().items():
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


def profile(name: str | None) -> dict[str, dict]:
    """The services of a profile; None: those with no profile, which every `docker compose up` starts."""
    return {k: v for k, v in compose_services().items() if (name in v["profiles"] if "profiles" in v else name is None)}


def test_the_default_deployment_stays_colocated_and_autoscales_like_make_up() -> None:
    default = profile(None)
    workers = ["worker-0", "worker-1", "worker-2"]
    assert sorted(default) == ["certs-init", "gateway", "global_manager", "model-init", "param_manager", *workers]
    gm = load_config(GlobalManagerConfig, "global_manager", default["global_manager"]["command"][3:], env={})
    assert not gm.disaggregated and gm.min_instances == 1
    # One instance loaded at start, HeteroScale into the other workers, with make up's parameters.
    assert gm.autoscale and gm.policy == "heteroscale" and gm.max_instances == len(workers)
    assert gm.policy_params == LOCAL_POLICY_PARAMS and gm.window_s == LOCAL_WINDOW_S and gm.scale_from_zero
    gateway = load_config(GatewayConfig, "gateway", default["gateway"]["command"][3:], env={})
    assert gateway.schedule_wait_s == SCHEDULE_WAIT_S  # covers a load from zero
    for name, svc in default.items():
        assert all(dep in default for dep in svc.get("depends_on", {})), f"{name} needs a profile service"
        if svc["command"][2] == "services.worker":
            assert load_config(WorkerConfig, "worker", svc["command"][3:], env={}).role == "colocated"


def test_disagg_profile_runs_one_prefill_and_one_decode_worker() -> None:
    services = compose_services()
    split = profile("disagg")
    assert sorted(split) == ["gateway-disagg", "global_manager-disagg", "worker-decode", "worker-prefill"]
    gm = load_config(GlobalManagerConfig, "global_manager", split["global_manager-disagg"]["command"][3:], env={})
    assert gm.disaggregated and (gm.min_prefill, gm.min_decode, gm.min_instances) == (1, 1, 0)
    default_gm = load_config(GlobalManagerConfig, "global_manager", services["global_manager"]["command"][3:], env={})
    assert gm.default_model == default_gm.default_model
    workers = {
        name: load_config(WorkerConfig, "worker", svc["command"][3:], env={})
        for name, svc in split.items()
        if svc["command"][2] == "services.worker"
    }
    assert {name: w.role for name, w in workers.items()} == {"worker-prefill": "prefill", "worker-decode": "decode"}
    assert {w.global_manager for w in workers.values()} == {"global_manager-disagg:50061"}
    gateway = load_config(GatewayConfig, "gateway", split["gateway-disagg"]["command"][3:], env={})
    assert gateway.global_manager == "global_manager-disagg:50061"
    # `up gateway-disagg` brings the whole split stack, and it can run beside the default one.
    assert {"worker-prefill", "worker-decode", "global_manager-disagg"} <= set(split["gateway-disagg"]["depends_on"])
    published = {p.split(":")[0] for p in split["gateway-disagg"]["ports"]}
    assert not published & {p.split(":")[0] for p in services["gateway"]["ports"]}


def test_every_internal_service_runs_mtls_with_the_certificates_certs_init_makes() -> None:
    services = compose_services()
    assert services["certs-init"]["command"][2] == "services.common.pki"
    assert "tls:/tls" in services["certs-init"]["volumes"]
    assert "tls:/tls:ro" in services["param_manager"]["volumes"]
    assert "certs-init" in services["param_manager"]["depends_on"]
    for name, svc in services.items():
        module = svc["command"][2]
        if module not in CONFIGS:
            continue
        cls, service = CONFIGS[module]
        cfg = load_config(cls, service, svc["command"][3:], env={})
        assert str(cfg.tls_dir) == "/tls" and not cfg.insecure, name
        assert "tls:/tls:ro" in svc["volumes"], name
        health = svc["healthcheck"]["test"]
        if module != "services.gateway":  # the gateway's port is the public edge: plaintext, API keys
            assert health[health.index("--tls-dir") + 1] == "/tls", name


def test_every_service_serves_metrics_and_prometheus_scrapes_the_default_stack() -> None:
    runs_a_service = {n: v for n, v in blitzmesh_services().items() if v["command"][2] in CONFIGS}
    assert len(runs_a_service) >= 6
    for name, svc in runs_a_service.items():
        cls, service = CONFIGS[svc["command"][2]]
        assert load_config(cls, service, svc["command"][3:], env={}).metrics_port == 9100, name
    scrape = yaml.safe_load((ROOT / "deploy" / "prometheus" / "prometheus.yml").read_text())["scrape_configs"]
    targets = {t for job in scrape for static in job["static_configs"] for t in static["targets"]}
    assert targets == {f"{name}:9100" for name in runs_a_service if name in profile(None)}
    assert compose_services()["prometheus"]["profiles"] == ["observability"]
