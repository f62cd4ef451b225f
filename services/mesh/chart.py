"""The Helm chart (deploy/helm/blitzmesh) rendered and checked offline, as `make deploy-check` does.

Rendering is Helm's own template engine (the Go Helm SDK, bundled by the `helm-python-sdk`
wheel: `pip install '.[deploy]'`), not a re-implementation. The rendered objects are then
  - validated against the Kubernetes OpenAPI schemas (`kubernetes-validate`, strict: an unknown
    field fails), the custom resources (ServiceMonitor, Certificate, InferencePool) against
    deploy/helm/schemas/ (the fields the chart sets, from those APIs' v1 CRDs) or, with
    `crd_dir`, against the CRDs themselves;
  - cross-checked: every container command parses with its service's config parser, and the
    probes, ports, Service names and selectors agree across objects (`consistency`), and every
    worker and host-cache pod finds at /tls a certificate naming its own instance and no other
    instance's key (`identity_problems`).
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from services.common import pki
from services.common.roles import HOST_CACHE, WORKER
from services.mesh import topology as t

ROOT = Path(__file__).resolve().parents[2]
CHART = ROOT / "deploy" / "helm" / "blitzmesh"
SCHEMAS = ROOT / "deploy" / "helm" / "schemas"
RELEASE = "blitzmesh"
NAMESPACE = "blitzmesh"
# The oldest Kubernetes the chart supports (StatefulSet start ordinals and the pod-index label
# are GA there) and the newest the validator knows: every object is checked against both.
KUBE_VERSIONS = ("1.32.0", "1.37.0")
# API groups of the custom resources the chart may render (not in Kubernetes' own schemas).
CUSTOM_GROUPS = ("monitoring.coreos.com", "cert-manager.io", "inference.networking.k8s.io")


def values_sets() -> dict[str, Path]:
    """name -> values file: every ci/<name>-values.yaml of the chart."""
    return {p.name.removesuffix("-values.yaml"): p for p in sorted((CHART / "ci").glob("*-values.yaml"))}


def render(values: Mapping[str, Any] | None = None, chart: Path = CHART) -> list[dict[str, Any]]:
    """The chart's objects for `values` (over values.yaml), in template order."""
    from helm_python.chart import Chart

    with Chart.load(str(chart)) as c:
        manifests = c.render(dict(values or {}), name=RELEASE, namespace=NAMESPACE)
    objects: list[dict[str, Any]] = []
    for path in sorted(manifests):
        if not path.endswith(".yaml"):
            continue
        for doc in yaml.safe_load_all(manifests[path]):
            if doc:
                doc.setdefault("metadata", {}).setdefault("namespace", NAMESPACE)
                objects.append(doc)
    return objects


def render_file(values_file: Path) -> list[dict[str, Any]]:
    return render(yaml.safe_load(values_file.read_text()) or {})


def _name(obj: Mapping[str, Any]) -> str:
    return f"{obj.get('kind')}/{obj.get('metadata', {}).get('name')}"


def _crd_schemas(crd_dir: Path) -> dict[tuple[str, str], dict[str, Any]]:
    """(apiVersion, kind) -> openAPIV3Schema of each served version of the CRDs in `crd_dir`."""
    out = {}
    for path in sorted(crd_dir.glob("*.y*ml")):
        for doc in yaml.safe_load_all(path.read_text()):
            if not doc or doc.get("kind") != "CustomResourceDefinition":
                continue
            spec = doc["spec"]
            for version in spec["versions"]:
                key = (f"{spec['group']}/{version['name']}", spec["names"]["kind"])
                out[key] = version["schema"]["openAPIV3Schema"]
    return out


def _own_schemas() -> dict[tuple[str, str], dict[str, Any]]:
    out = {}
    for path in sorted(SCHEMAS.glob("*.json")):
        schema = json.loads(path.read_text())
        out[(schema["x-api-version"], schema["x-kind"])] = schema
    return out


def validate(objects: Iterable[Mapping[str, Any]], crd_dir: Path | None = None) -> list[str]:
    """Schema failures, one line each ("Kind/name (1.32.0): why"); empty when all pass."""
    import jsonschema
    import kubernetes_validate

    custom = _crd_schemas(crd_dir) if crd_dir is not None else _own_schemas()
    failures = []
    for obj in objects:
        key = (obj.get("apiVersion", ""), obj.get("kind", ""))
        if key[0].split("/")[0] in CUSTOM_GROUPS:
            schema = custom.get(key)
            if schema is None:
                failures.append(f"{_name(obj)}: no schema for {key[0]} {key[1]}")
                continue
            for error in jsonschema.Draft7Validator(schema).iter_errors(obj):
                where = "/".join(map(str, error.absolute_path))
                failures.append(f"{_name(obj)} ({key[0]}): {where}: {error.message}")
            continue
        for version in KUBE_VERSIONS:
            try:
                kubernetes_validate.validate(dict(obj), version, strict=True)
            except kubernetes_validate.ValidationError as e:
                where = "/".join(map(str, e.absolute_path))
                failures.append(f"{_name(obj)} ({version}): {where}: {e.message}")
            except (kubernetes_validate.SchemaNotFoundError, kubernetes_validate.InvalidSchemaError) as e:
                failures.append(f"{_name(obj)} ({version}): {e}")
    return failures


# ---- consistency across objects ---------------------------------------------------------------


@dataclass(frozen=True)
class Container:
    workload: str  # Kind/name of the object holding it
    labels: dict[str, str]  # its pod template's labels
    spec: dict[str, Any]
    init: bool

    @property
    def command(self) -> list[str]:
        return list(self.spec.get("command", [])) + list(self.spec.get("args", []))


def containers(objects: Iterable[Mapping[str, Any]]) -> list[Container]:
    out = []
    for obj in objects:
        template = obj.get("spec", {}).get("template")
        if obj.get("kind") not in ("Deployment", "StatefulSet", "Job", "DaemonSet") or template is None:
            continue
        labels = template.get("metadata", {}).get("labels", {})
        pod = template["spec"]
        for init, key in ((True, "initContainers"), (False, "containers")):
            for c in pod.get(key, []):
                out.append(Container(_name(obj), labels, c, init))
    return out


POD_VALUES = {
    "POD_NAME": "blitzmesh-worker-3",
    "POD_NAMESPACE": NAMESPACE,
    "NODE_NAME": "node-a",
    "POD_INDEX": "2",
}


def expand(command: list[str], env: Mapping[str, str] = POD_VALUES) -> list[str]:
    """`$(VAR)` references expanded as the kubelet does, with example pod values."""
    return [re.sub(r"\$\((\w+)\)", lambda m: env.get(m.group(1), m.group(0)), arg) for arg in command]


def _selects(selector: Mapping[str, str], labels: Mapping[str, str]) -> bool:
    return bool(selector) and all(labels.get(k) == v for k, v in selector.items())


def consistency(objects: list[dict[str, Any]]) -> list[str]:
    """What does not agree across the rendered objects; empty when everything does:
    - every container's `$(VAR)` references are variables its env defines;
    - every probe is a native grpc probe on the port of the `--health-port` its command binds,
      and every named container port is a port the command binds;
    - every Service selects pods, its target ports are named ports of those pods, and every
      address a command dials (`--global-manager`, `--param-manager`, `--index`, the pod DNS
      names of `--advertise-host`) names a Service of the release on the port it serves;
    - the gateway runs two or more replicas behind a PodDisruptionBudget, the global manager one,
      replaced with Recreate, and nothing autoscales the pods (no HorizontalPodAutoscaler)."""
    from services.common.config import load_config

    problems: list[str] = []
    services = {o["metadata"]["name"]: o for o in objects if o["kind"] == "Service"}
    workloads = {o["metadata"]["name"]: o for o in objects if o["kind"] in ("Deployment", "StatefulSet")}
    all_containers = containers(objects)
    pod_ports: dict[str, dict[str, int]] = {}  # workload -> port name -> number (its main container)
    for c in all_containers:
        where = f"{c.workload} {c.spec['name']}"
        env = {e["name"] for e in c.spec.get("env", [])}
        for var in re.findall(r"\$\((\w+)\)", " ".join(c.command)):
            if var not in env:
                problems.append(f"{where}: $({var}) is not in its env")
        if c.init:
            continue
        service = config_of(c.command)
        if service is None:
            problems.append(f"{where}: runs {c.command[:3]}, not a mesh service")
            continue
        cls, name = service
        cfg = load_config(cls, name, without_cuda(expand(c.command)[3:]), env={})
        ports = {p["name"]: p["containerPort"] for p in c.spec.get("ports", [])}
        pod_ports[c.workload] = ports
        bound = {"grpc": cfg.port, "metrics": cfg.metrics_port, "health": cfg.health_port}
        if hasattr(cfg, "http_port"):
            bound["http"] = cfg.http_port
        for port_name, number in ports.items():
            if bound.get(port_name) != number:
                problems.append(f"{where}: port {port_name}={number} but the command binds {bound.get(port_name)}")
        for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
            spec = c.spec.get(probe)
            if spec is None or "grpc" not in spec:
                problems.append(f"{where}: {probe} is not a native grpc probe")
            elif spec["grpc"].get("port") != cfg.health_port or cfg.health_port <= 0:
                problems.append(f"{where}: {probe} on {spec['grpc'].get('port')}, health port {cfg.health_port}")
        for address in _dialled(cfg):
            host, _, port = address.rpartition(":")
            svc = services.get(host)
            if svc is None:
                problems.append(f"{where}: dials {address}, no Service {host!r}")
            elif int(port) not in [p["port"] for p in svc["spec"]["ports"]]:
                problems.append(f"{where}: dials {address}, Service {host} has no port {port}")
        advertised = getattr(cfg, "advertise_host", "")
        if advertised:
            pod, svc_name, *_ = advertised.split(".")
            workload = workloads[c.workload.split("/", 1)[1]]
            if workload["kind"] != "StatefulSet" or workload["spec"]["serviceName"] != svc_name:
                problems.append(f"{where}: advertises {advertised}, not its StatefulSet's headless Service")
            elif svc_name not in services or services[svc_name]["spec"].get("clusterIP") != "None":
                problems.append(f"{where}: advertises {advertised}, {svc_name!r} is no headless Service")
    for name, svc in services.items():
        selector = svc["spec"].get("selector", {})
        backing = [w for w in workloads.values() if _selects(selector, w["spec"]["template"]["metadata"]["labels"])]
        if not backing:
            problems.append(f"Service/{name}: selects no pods")
        for port in svc["spec"]["ports"]:
            target = port.get("targetPort")
            for w in backing:
                if target not in pod_ports.get(f"{w['kind']}/{w['metadata']['name']}", {}):
                    problems.append(f"Service/{name}: targetPort {target!r} is not a port of {w['metadata']['name']}")
    for w in workloads.values():
        match = w["spec"]["selector"]["matchLabels"]
        if not _selects(match, w["spec"]["template"]["metadata"]["labels"]):
            problems.append(f"{_name(w)}: its selector does not match its pods")
    problems += _shape(objects, workloads)
    problems += identity_problems(objects)
    return problems


# ---- per-instance identities ------------------------------------------------------------------

TLS_MOUNT = "/tls"


@dataclass(frozen=True)
class TlsFile:
    """Where a file a pod sees under /tls comes from: a Secret's key, or the cert-manager
    csi-driver volume (`csi` holds its attributes, `${POD_NAME}` expanded)."""

    secret: str = ""
    key: str = ""
    csi: tuple[tuple[str, str], ...] = ()


def tls_files(pod_spec: Mapping[str, Any], container: Mapping[str, Any], env: Mapping[str, str]) -> dict[str, TlsFile]:
    """path -> source of every file `container` of a pod with `env` sees under /tls, resolving
    projected Secret items, csi-driver files and `subPathExpr` as the kubelet does."""
    volumes = {v["name"]: v for v in pod_spec.get("volumes", [])}
    files: dict[str, TlsFile] = {}
    for mount in container.get("volumeMounts", []):
        at = mount["mountPath"]
        if at != TLS_MOUNT and not at.startswith(TLS_MOUNT + "/"):
            continue
        volume = volumes.get(mount["name"], {})
        provided: dict[str, TlsFile] = {}
        for source in volume.get("projected", {}).get("sources", []):
            secret = source.get("secret")
            for item in (secret or {}).get("items") or []:
                provided[item["path"]] = TlsFile(secret=secret["name"], key=item["key"])
        if volume.get("csi", {}).get("driver") == "csi.cert-manager.io":
            attrs = volume["csi"].get("volumeAttributes", {})
            expanded = tuple((k, v.replace("${POD_NAME}", env["POD_NAME"])) for k, v in sorted(attrs.items()))
            for which, default in (
                ("certificate-file", "tls.crt"),
                ("privatekey-file", "tls.key"),
                ("ca-file", "ca.crt"),
            ):
                provided[attrs.get(f"csi.cert-manager.io/{which}", default)] = TlsFile(key=which, csi=expanded)
        sub = mount.get("subPath") or expand([mount.get("subPathExpr", "")], env)[0]
        for path, source in provided.items():
            if not sub or path.startswith(sub + "/"):
                files[f"{at}/{path[len(sub) + 1 :] if sub else path}"] = source
    return files


@dataclass(frozen=True)
class PodIdentity:
    workload: str
    pod: str
    role: str
    instance: str
    named_by: str  # what names the instance in the certificate the pod presents; "" if nothing does
    problems: tuple[str, ...]


def pod_identities(objects: list[dict[str, Any]]) -> list[PodIdentity]:
    """Every worker and host-cache pod the StatefulSets would make, the instance it runs as and
    whether the certificate it would load (`pki.instance_files`) names that instance."""
    from services.common.config import load_config

    certificates = {
        o["spec"]["secretName"]: o["spec"] for o in objects if o["kind"] == "Certificate" and "secretName" in o["spec"]
    }
    out = []
    for obj in objects:
        if obj["kind"] != "StatefulSet":
            continue
        pod_spec = obj["spec"]["template"]["spec"]
        container = pod_spec["containers"][0]
        service = config_of(list(container.get("command", [])))
        if service is None or service[1] not in ("worker", "param_manager"):
            continue
        start = obj["spec"].get("ordinals", {}).get("start", 0)
        for ordinal in range(start, start + obj["spec"].get("replicas", 1)):
            pod = f"{obj['metadata']['name']}-{ordinal}"
            env = {**POD_VALUES, "POD_NAME": pod, "POD_INDEX": str(ordinal)}
            cfg = load_config(*service, without_cuda(expand(container["command"], env)[3:]), env={})
            if service[1] == "worker":
                role, instance = WORKER, cfg.instance_id
            elif cfg.index:
                role, instance = HOST_CACHE, f"host-cache-{cfg.cache_slot}"
            else:
                continue  # the index (shard 0) is one pod with its role's certificate
            files = tls_files(pod_spec, container, env)
            out.append(_identity(_name(obj), pod, role, instance, files, certificates))
    return out


def _identity(
    workload: str, pod: str, role: str, instance: str, files: Mapping[str, TlsFile], certs: Mapping[str, Any]
) -> PodIdentity:
    problems: list[str] = []
    root = Path(TLS_MOUNT)
    ca, cert, key = (str(p) for p in pki.instance_files(root, role, instance, exists=lambda p: str(p) in files))
    want = pki.spiffe_id(role, instance)
    named_by = ""
    for path in (ca, cert, key):
        if path not in files:
            problems.append(f"no {path}")
    if cert in files and key in files:
        c, k = files[cert], files[key]
        if c.csi:
            attrs = dict(c.csi)
            uris = attrs.get("csi.cert-manager.io/uri-sans", "").split(",")
            if want in uris and attrs.get("csi.cert-manager.io/common-name") == role and k.csi == c.csi:
                named_by = f"csi-driver uri-sans {want}"
        elif c.secret in certs:
            spec = certs[c.secret]
            pair = (c.key, k.key, k.secret) == ("tls.crt", "tls.key", c.secret)
            if pair and want in spec.get("uris", []) and spec.get("commonName") == role:
                named_by = f"Certificate {c.secret} uris {want}"
        elif (c.key, k.key, k.secret) == (
            pki.secret_key(role, instance, ".pem"),
            pki.secret_key(role, instance, ".key"),
            c.secret,
        ):
            named_by = (
                f"Secret {c.secret} keys {c.key}, {k.key} (python -m services.common.pki --instance {role}/{instance})"
            )
        if not named_by:
            problems.append(f"{cert} ({c}) does not name {want}")
    others = sorted(p for p in files if p not in (key, f"{TLS_MOUNT}/{pki.DATAPLANE_KEY}") and p.endswith(".key"))
    if others:
        problems.append(f"also sees other keys: {others}")
    return PodIdentity(workload, pod, role, instance, named_by, tuple(problems))


def identity_problems(objects: list[dict[str, Any]]) -> list[str]:
    """A line per worker or host-cache pod that would not present its own instance's certificate."""
    return [
        f"{i.workload} pod {i.pod} ({i.role} {i.instance}): {problem}"
        for i in pod_identities(objects)
        for problem in i.problems
    ]


def _shape(objects: list[dict[str, Any]], workloads: Mapping[str, dict[str, Any]]) -> list[str]:
    problems = []
    by_component = {
        w["spec"]["template"]["metadata"]["labels"].get("app.kubernetes.io/component"): w for w in workloads.values()
    }
    gm, gw = by_component.get("global-manager"), by_component.get("gateway")
    if gm is None or gm["spec"].get("replicas") != 1 or gm["spec"].get("strategy", {}).get("type") != "Recreate":
        problems.append("the global manager must be one replica replaced with Recreate")
    if gw is None or gw["spec"].get("replicas", 1) < 2:
        problems.append("the gateway must run 2 or more replicas")
    else:
        labels = gw["spec"]["template"]["metadata"]["labels"]
        pdbs = [o for o in objects if o["kind"] == "PodDisruptionBudget"]
        if not any(_selects(p["spec"]["selector"]["matchLabels"], labels) for p in pdbs):
            problems.append("no PodDisruptionBudget covers the gateway")
    if any(o["kind"] == "HorizontalPodAutoscaler" for o in objects):
        problems.append("a HorizontalPodAutoscaler would fight the global manager's autoscaling")
    return problems


def without_cuda(args: list[str]) -> list[str]:
    """`args` with a `--device cuda[:N]` parsed as cpu where torch sees no CUDA device (the worker's
    config refuses a device it cannot see; the value is checked against the field's pattern)."""
    if "--device" not in args:
        return args
    import torch

    from services.worker.config import WorkerConfig

    i = args.index("--device") + 1
    pattern = next(m.pattern for m in WorkerConfig.model_fields["device"].metadata if hasattr(m, "pattern"))
    if not re.fullmatch(pattern, args[i]):
        raise SystemExit(f"--device {args[i]!r} does not match {pattern}")
    if args[i].startswith("cuda") and not torch.cuda.is_available():
        return [*args[:i], "cpu", *args[i + 1 :]]
    return args


def _dialled(cfg: Any) -> list[str]:
    return [a for a in (getattr(cfg, f, "") for f in ("global_manager", "param_manager", "index")) if a]


def config_of(command: list[str]) -> tuple[type, str] | None:
    """(config class, service name) of a `python -m <module>` command of the mesh."""
    from services.gateway.config import GatewayConfig
    from services.global_manager.config import GlobalManagerConfig
    from services.param_manager.service import ParamManagerConfig
    from services.worker.config import WorkerConfig

    configs: dict[str, tuple[type, str]] = {
        t.GATEWAY.module: (GatewayConfig, "gateway"),
        t.GLOBAL_MANAGER.module: (GlobalManagerConfig, "global_manager"),
        t.PARAM_MANAGER.module: (ParamManagerConfig, "param_manager"),
        t.WORKER.module: (WorkerConfig, "worker"),
    }
    if len(command) < 3 or command[:2] != ["python", "-m"]:
        return None
    return configs.get(command[2])
