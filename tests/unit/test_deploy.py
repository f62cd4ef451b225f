"""The deployments stay true to the code: compose, the swarm stack and the Helm chart render from
services/mesh/topology.py, and every command they hold parses with its service's config."""

from __future__ import annotations

import copy
import importlib
import re
from pathlib import Path

import pytest
import yaml

from services.common import roles
from services.common.config import load_config
from services.gateway.config import GatewayConfig
from services.global_manager.config import GlobalManagerConfig
from services.mesh import chart, deployments, topology
from services.mesh.__main__ import LOCAL_POLICY_PARAMS, LOCAL_WINDOW_S, SCHEDULE_WAIT_S
from services.mesh.__main__ import parse_args as parse_mesh_args
from services.mesh.launcher import FIXED_PORT_FLAGS
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


# ---- one topology, three renderings ------------------------------------------------------------


def test_the_generated_deployment_files_are_what_the_topology_renders() -> None:
    """docker-compose.yml, the swarm stack and the chart's _args.tpl: `make deploy-gen` writes them."""
    assert deployments.stale() == [], "run `make deploy-gen` (python scripts/gen_deploy.py)"


def test_a_changed_flag_makes_the_generated_files_stale(tmp_path: Path) -> None:
    deployments.write(tmp_path)
    assert deployments.stale(tmp_path) == []
    compose_file = tmp_path / "docker-compose.yml"
    compose_file.write_text(
        compose_file.read_text().replace('"--schedule-wait-s", "60.0"', '"--schedule-wait-s", "61"')
    )
    assert deployments.stale(tmp_path) == ["docker-compose.yml"]


def service_flags() -> set[str]:
    """Every flag of every service's config (`--model-dir`, `--no-insecure`, ...)."""
    flags = set()
    for cls, _ in CONFIGS.values():
        for name in cls.model_fields:
            flag = name.replace("_", "-")
            flags |= {f"--{flag}", f"--no-{flag}"}
    return flags


def test_a_service_flag_is_spelled_out_only_in_the_topology() -> None:
    """The launcher, the renderings and the chart's hand-written templates take every service
    flag from services/mesh/topology.py (the generated files hold them as rendered)."""
    producers = [
        ROOT / "services" / "mesh" / "launcher.py",
        ROOT / "services" / "mesh" / "deployments.py",
        ROOT / "deploy" / "helm" / "blitzmesh" / "values.yaml",
        *(p for p in (ROOT / "deploy" / "helm" / "blitzmesh" / "templates").iterdir() if p.name != "_args.tpl"),
    ]
    flags = service_flags()
    assert {"--model-dir", "--global-manager", "--health-port", "--advertise-host"} <= flags
    for path in producers:
        text = path.read_text()
        # A flag as a string literal ("--flag", '--flag=') or a YAML list item (- --flag).
        found = re.findall(r"""["'](--[a-z][a-z0-9-]*)["'=]""", text) + re.findall(r"-\s+(--[a-z][a-z0-9-]*)", text)
        spelled = {m for m in found if m in flags}
        assert not spelled, f"{path.relative_to(ROOT)} spells {sorted(spelled)}; take them from topology.py"
    assert {m for m in re.findall(r'"(--[a-z][a-z0-9-]*)"', (ROOT / "services/mesh/topology.py").read_text())} & flags


def test_the_launcher_starts_each_service_with_the_topology_s_flags() -> None:
    """make up's processes: the same builders, addresses filled in at run time."""
    cfg = parse_mesh_args([])
    args = topology.worker_args(
        instance_id="worker-0", topology_host="host-0", global_manager="a:1", param_manager="b:2", role="colocated"
    )
    worker = load_config(WorkerConfig, "worker", [*args, *cfg.worker_thread_args()], env={})
    assert (worker.instance_id, worker.global_manager, worker.param_manager, worker.role) == (
        "worker-0",
        "a:1",
        "b:2",
        "colocated",
    )
    assert cfg.security_args() == topology.security_args(str(cfg.tls_path.resolve()))
    assert set(FIXED_PORT_FLAGS.values()) <= service_flags()


# ---- Docker Swarm ----------------------------------------------------------------------------


def stack_services() -> dict[str, dict]:
    return yaml.safe_load((ROOT / "deploy" / "swarm" / "blitzmesh-stack.yml").read_text())["services"]


@pytest.mark.parametrize("name", sorted(stack_services()))
def test_stack_command_parses_and_is_placed_by_node_label(name: str) -> None:
    svc = stack_services()[name]
    python, dash_m, module, *args = svc["command"]
    assert (python, dash_m) == ("python", "-m")
    if module in CONFIGS:
        cls, service = CONFIGS[module]
        cfg = load_config(cls, service, args, env={})
        assert cfg.host == "0.0.0.0" and str(cfg.tls_dir) == "/tls"
        # Its own role's key and no other, from the swarm's secrets; a worker its own instance's.
        targets = {s["target"] for s in svc["secrets"]}
        own = (
            f"worker/{cfg.instance_id}"
            if module == "services.worker"
            else next(r for r in roles.ALL_ROLES if f"/tls/{r}.key" in targets)
        )
        assert {t for t in targets if t.endswith(".key") and t != "/tls/dataplane.key"} == {f"/tls/{own}.key"}
        assert svc["deploy"]["restart_policy"]["condition"] == "any"
    [constraint] = svc["deploy"]["placement"]["constraints"]
    expected = "blitzmesh.worker" if module == "services.worker" else None
    if module in ("services.param_manager", "services.model_format"):
        expected = "blitzmesh.cache"  # the models volume is a node's: model-init fills it there
    assert constraint == f"node.labels.{expected or 'blitzmesh.control'} == true"


def test_the_stack_is_compose_s_default_deployment() -> None:
    stack = stack_services()
    default = {k: v for k, v in compose_services().items() if "profiles" not in v and k != "certs-init"}
    assert sorted(stack) == sorted(default)
    for name, svc in stack.items():
        extra = topology.dataplane_args(deployments.SWARM_DATAPLANE)
        data_plane = svc["command"][2] in ("services.worker", "services.param_manager")
        assert svc["command"] == default[name]["command"] + (extra if data_plane else []), name
    secrets = yaml.safe_load((ROOT / "deploy" / "swarm" / "blitzmesh-stack.yml").read_text())["secrets"]
    used = {s["source"] for svc in stack.values() for s in svc.get("secrets", [])}
    assert used == set(secrets)


# ---- the Helm chart ---------------------------------------------------------------------------

VALUES_SETS = chart.values_sets()


@pytest.fixture(scope="module")
def rendered() -> dict[str, list[dict]]:
    pytest.importorskip("helm_python", reason="the deploy extra: pip install '.[deploy]' (make deploy-check does)")
    return {name: chart.render_file(path) for name, path in VALUES_SETS.items()}


def test_the_values_sets_are_the_four_the_issue_names() -> None:
    assert sorted(VALUES_SETS) == ["default", "disagg", "gpu", "observability"]


@pytest.mark.parametrize("values", sorted(VALUES_SETS))
def test_every_rendered_object_passes_the_kubernetes_schemas(rendered: dict[str, list[dict]], values: str) -> None:
    pytest.importorskip("kubernetes_validate")
    assert chart.validate(rendered[values]) == []


@pytest.mark.parametrize("values", sorted(VALUES_SETS))
def test_chart_commands_parse_and_probes_ports_and_services_agree(rendered: dict[str, list[dict]], values: str) -> None:
    objects = rendered[values]
    commands = [c for c in chart.containers(objects) if not c.init]
    assert len(commands) >= 4  # gateway, global manager, parameter manager, workers (+ host caches, pools)
    for c in commands:
        cls, service = chart.config_of(c.command)
        cfg = load_config(cls, service, chart.without_cuda(chart.expand(c.command)[3:]), env={})
        assert cfg.host == "0.0.0.0" and str(cfg.tls_dir) == "/tls" and not cfg.insecure, c.workload
    assert chart.consistency(objects) == []


def test_the_checks_catch_a_probe_port_a_service_or_a_schema_that_disagree(rendered: dict[str, list[dict]]) -> None:
    objects = copy.deepcopy(rendered["default"])
    gw = next(o for o in objects if o["kind"] == "Deployment" and o["metadata"]["name"].endswith("-gateway"))
    gw["spec"]["template"]["spec"]["containers"][0]["readinessProbe"]["grpc"]["port"] = 9999
    objects = [o for o in objects if not (o["kind"] == "Service" and o["metadata"]["name"].endswith("-global-manager"))]
    problems = "\n".join(chart.consistency(objects))
    assert "readinessProbe on 9999, health port 9101" in problems
    assert "dials blitzmesh-global-manager:50061, no Service 'blitzmesh-global-manager'" in problems
    gw["spec"]["template"]["spec"]["containers"][0]["readinessProbe"]["grpc"]["port"] = "health"
    assert "readinessProbe/grpc/port: 'health' is not of type 'integer'" in "\n".join(chart.validate([gw]))


def test_the_chart_s_shape(rendered: dict[str, list[dict]]) -> None:
    def kinds(values: str) -> dict[str, dict]:
        return {f"{o['kind']}/{o['metadata']['name']}": o for o in rendered[values]}

    default = kinds("default")
    pm = default["StatefulSet/blitzmesh-param-manager"]
    assert pm["spec"]["template"]["spec"]["affinity"]["podAntiAffinity"][
        "requiredDuringSchedulingIgnoredDuringExecution"
    ]
    assert pm["spec"]["template"]["spec"]["initContainers"][0]["command"] == topology.model_init_command()
    assert default["Deployment/blitzmesh-global-manager"]["spec"]["strategy"] == {"type": "Recreate"}
    assert default["StatefulSet/blitzmesh-worker"]["spec"]["replicas"] == 3
    assert not any(k.startswith(("ServiceMonitor", "InferencePool", "HorizontalPodAutoscaler")) for k in default)
    gpu = kinds("gpu")
    worker = gpu["StatefulSet/blitzmesh-worker"]["spec"]["template"]["spec"]["containers"][0]
    assert worker["resources"]["limits"]["nvidia.com/gpu"] == 1 and worker["command"][-2:] == ["--device", "cuda"]
    caches = gpu["StatefulSet/blitzmesh-host-cache"]["spec"]
    assert caches["ordinals"] == {"start": 1} and caches["replicas"] == 1  # shard 1 of 2; 0 is the index's
    disagg = kinds("disagg")
    roles_ = {
        k: load_config(
            WorkerConfig, "worker", chart.expand(o["spec"]["template"]["spec"]["containers"][0]["command"])[3:], env={}
        ).role
        for k, o in disagg.items()
        if o["kind"] == "StatefulSet" and "-worker" in k
    }
    assert roles_ == {
        "StatefulSet/blitzmesh-worker": "colocated",
        "StatefulSet/blitzmesh-worker-prefill": "prefill",
        "StatefulSet/blitzmesh-worker-decode": "decode",
    }
    # The param manager's, the global manager's and the gateway's; each worker's comes from the
    # csi-driver (and each host cache's from a Certificate of its slot: none here, one shard).
    assert sorted(k for k in disagg if k.startswith("Certificate/")) == [
        "Certificate/blitzmesh-gateway",
        "Certificate/blitzmesh-global-manager",
        "Certificate/blitzmesh-param-manager",
    ]
    gm = load_config(
        GlobalManagerConfig,
        "global_manager",
        disagg["Deployment/blitzmesh-global-manager"]["spec"]["template"]["spec"]["containers"][0]["command"][3:],
        env={},
    )
    assert gm.disaggregated and (gm.min_prefill, gm.min_decode, gm.max_instances) == (2, 2, 4)
    obs = kinds("observability")
    assert obs["InferencePool/blitzmesh"]["spec"]["targetPorts"] == [{"number": topology.GATEWAY_HTTP_PORT}]
    assert obs["ServiceMonitor/blitzmesh"]["spec"]["endpoints"][0]["port"] == "metrics"


def render_in_mode(values: str, cert_manager: bool) -> list[dict]:
    """A values set rendered with its TLS mode forced: Secret (tls.secretName) or cert-manager."""
    pytest.importorskip("helm_python", reason="the deploy extra: pip install '.[deploy]' (make deploy-check does)")
    overrides = yaml.safe_load(VALUES_SETS[values].read_text()) or {}
    tls = overrides.setdefault("tls", {})
    tls["certManager"] = {**tls.get("certManager", {}), "enabled": cert_manager}
    return chart.render(overrides)


@pytest.mark.parametrize("cert_manager", [False, True], ids=["secret", "cert-manager"])
@pytest.mark.parametrize("values", sorted(VALUES_SETS))
def test_every_worker_and_host_cache_pod_presents_a_certificate_naming_its_own_instance(
    values: str, cert_manager: bool
) -> None:
    """The manager takes RegisterInstance/Heartbeat for X only from X's certificate (and the
    index RegisterHostCache likewise): every pod the StatefulSets make must find at /tls, as
    load_identity reads it, a certificate whose SPIFFE URI names the instance it runs as, and
    no other instance's key."""
    objects = render_in_mode(values, cert_manager)
    pods = chart.pod_identities(objects)
    sets = {o["metadata"]["name"]: o["spec"] for o in objects if o["kind"] == "StatefulSet"}
    workers = sum(spec["replicas"] for name, spec in sets.items() if "-worker" in name)
    caches = sets.get("blitzmesh-host-cache", {}).get("replicas", 0)
    assert len(pods) == workers + caches and workers > 0
    assert [(i.pod, i.problems) for i in pods if i.problems] == []
    assert len({(i.role, i.instance) for i in pods}) == len(pods)
    for i in pods:
        if i.role == roles.WORKER:
            assert i.instance == i.pod  # --instance-id $(POD_NAME)
            assert i.named_by.startswith("csi-driver" if cert_manager else "Secret blitzmesh-tls"), i
        else:
            assert i.instance == f"host-cache-{i.pod.rsplit('-', 1)[1]}"
            assert i.named_by.startswith("Certificate" if cert_manager else "Secret blitzmesh-tls"), i
    assert chart.identity_problems(objects) == []


def test_the_identity_check_catches_a_shared_or_a_wrong_certificate() -> None:
    secret_mode = copy.deepcopy(render_in_mode("gpu", False))
    worker = next(o for o in secret_mode if o["metadata"]["name"] == "blitzmesh-worker" and o["kind"] == "StatefulSet")
    del worker["spec"]["template"]["spec"]["containers"][0]["volumeMounts"][0]["subPathExpr"]
    problems = "\n".join(chart.identity_problems(secret_mode))
    assert "pod blitzmesh-worker-0 (worker blitzmesh-worker-0): no /tls/ca.pem" in problems
    cache = next(
        o for o in secret_mode if o["metadata"]["name"] == "blitzmesh-host-cache" and o["kind"] == "StatefulSet"
    )
    items = cache["spec"]["template"]["spec"]["volumes"][0]["projected"]["sources"][0]["secret"]["items"]
    items[1]["key"] = "host-cache.pem"  # the role's shared certificate names no instance
    assert "/tls/host-cache/host-cache-1.pem (TlsFile(secret='blitzmesh-tls', key='host-cache.pem'" in "\n".join(
        chart.identity_problems(secret_mode)
    )
    csi_mode = copy.deepcopy(render_in_mode("gpu", True))
    worker = next(o for o in csi_mode if o["metadata"]["name"] == "blitzmesh-worker" and o["kind"] == "StatefulSet")
    csi = next(v for v in worker["spec"]["template"]["spec"]["volumes"] if "csi" in v)["csi"]
    csi["volumeAttributes"]["csi.cert-manager.io/uri-sans"] = "spiffe://blitzmesh/worker/blitzmesh-worker-0"
    problems = chart.identity_problems(csi_mode)
    assert len(problems) == 3 and all(
        "does not name spiffe://blitzmesh/worker/blitzmesh-worker-" in p for p in problems
    )
    assert not any("blitzmesh-worker-0 (" in p for p in problems)  # the one pod it does name


def test_the_chart_s_autoscaling_defaults_are_make_up_s() -> None:
    values = yaml.safe_load((chart.CHART / "values.yaml").read_text())
    assert values["autoscale"]["policyParams"] == LOCAL_POLICY_PARAMS
    assert values["autoscale"]["windowS"] == LOCAL_WINDOW_S and values["gateway"]["scheduleWaitS"] == SCHEDULE_WAIT_S
    assert values["model"]["id"] == DEFAULT_MODEL_ID
