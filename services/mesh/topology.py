"""The mesh's services and their flags, spelled out once.

Every way Blitzmesh is deployed starts the same five programs with the same flags: the local
launcher (`make up`, services/mesh/launcher.py), docker compose (docker-compose.yml), Docker
Swarm (deploy/swarm/blitzmesh-stack.yml) and the Helm chart (deploy/helm/blitzmesh). Each of
them builds its command lines with the functions here; what differs between them is only the
*values* a flag takes (an address found at run time, a compose service name, a Helm template
expression, a pod's `$(POD_NAME)`), which each rendering passes in. A flag added to a service is
added here and reaches every deployment, and `scripts/gen_deploy.py --check` (run by the tests)
fails while a generated file still lacks it.

Values are strings: the renderings format numbers themselves, and a Helm value is a Go template
expression (a `Tpl`, rendered by the chart, see deploy/render.py).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from services.common import roles

# Container ports: fixed inside a container or pod (each has the network namespace to itself).
# The local launcher binds port 0 everywhere instead and learns the ports from the port files.
PARAM_MANAGER_PORT = 50060
GLOBAL_MANAGER_PORT = 50061
WORKER_PORT = 50070
GATEWAY_GRPC_PORT = 50051
GATEWAY_HTTP_PORT = 8000
METRICS_PORT = 9100
# Plaintext gRPC health only (kubelet's native `grpc:` probe speaks no TLS); the mTLS port keeps
# every other service. Off (-1) unless a deployment asks for it.
HEALTH_PORT = 9101
# Where a container finds its certificates and the models volume.
TLS_DIR = "/tls"
MODEL_DIR = "/models"


class Tpl(str):
    """A value that is a Go template expression of the Helm chart (e.g. `.root.Values.model.id`),
    rendered there as the whole argument; every other value is a literal string."""


@dataclass(frozen=True)
class Service:
    """One program of the mesh: how it is started and reached, whatever runs it."""

    name: str  # the compose / launcher name of its kind
    module: str  # python -m <module>
    role: str  # its certificate's role (services/common/roles.py)
    port: int  # its gRPC port in a container
    public: bool = False  # the gateway: API keys, no client certificate on its gRPC port

    def healthcheck(self, tls_dir: str | None = TLS_DIR, instance: str | None = None) -> list[str]:
        """The command that exits 0 when this service reports SERVING (compose and swarm); an
        `instance` of a per-instance role presents its own certificate, the one it has there."""
        check = ["python", "-m", "services.common.healthcheck", f"127.0.0.1:{self.port}"]
        if self.public or tls_dir is None:
            return check
        return [*check, "--tls-dir", tls_dir, "--role", self.role, *(["--instance", instance] if instance else [])]


PARAM_MANAGER = Service("param_manager", "services.param_manager", roles.PARAM_MANAGER, PARAM_MANAGER_PORT)
HOST_CACHE = Service("host_cache", "services.param_manager", roles.HOST_CACHE, PARAM_MANAGER_PORT)
GLOBAL_MANAGER = Service("global_manager", "services.global_manager", roles.GLOBAL_MANAGER, GLOBAL_MANAGER_PORT)
WORKER = Service("worker", "services.worker", roles.WORKER, WORKER_PORT)
GATEWAY = Service("gateway", "services.gateway", roles.GATEWAY, GATEWAY_GRPC_PORT, public=True)
SERVICES = {s.name: s for s in (PARAM_MANAGER, HOST_CACHE, GLOBAL_MANAGER, WORKER, GATEWAY)}


def command(service: Service, args: list[str]) -> list[str]:
    """A container's command line: the image's python running the service's module."""
    return ["python", "-m", service.module, *args]


def security_args(tls_dir: str | None) -> list[str]:
    """mTLS with the certificates in `tls_dir`, or (None) the development-only plaintext opt-in."""
    return ["--insecure"] if tls_dir is None else ["--tls-dir", tls_dir]


# The port-file key of each port a service binds, and the flag that binds it.
PORT_FLAGS = {
    "grpc_port": "--port",
    "http_port": "--http-port",
    "metrics_port": "--metrics-port",
    "health_port": "--health-port",
}


def serve_args(
    *,
    host: str | None = None,
    port: str | None = None,
    metrics_port: str | None = None,
    health_port: str | None = None,
    port_file: str | None = None,
) -> list[str]:
    """The flags every service's server takes (each left out when None: the service's default).
    `port_file`: where it writes the ports it bound (how the launcher learns ports it left to 0)."""
    out: list[str] = []
    for flag, value in (
        ("--port-file", port_file),
        ("--host", host),
        (PORT_FLAGS["grpc_port"], port),
        (PORT_FLAGS["metrics_port"], metrics_port),
        (PORT_FLAGS["health_port"], health_port),
    ):
        if value is not None:
            out += [flag, value]
    return out


def container_serve_args(service: Service, *, health_port: bool = False) -> list[str]:
    """A container's server flags: every address, its fixed port, metrics on METRICS_PORT, mTLS."""
    return [
        *serve_args(
            host="0.0.0.0",
            port=str(service.port),
            metrics_port=str(METRICS_PORT),
            health_port=str(HEALTH_PORT) if health_port else None,
        ),
        *security_args(TLS_DIR),
    ]


def advertise_args(advertise_host: str | None) -> list[str]:
    return [] if advertise_host is None else ["--advertise-host", advertise_host]


def param_manager_args(
    *,
    model_dir: str,
    cache_slots: str | None = None,
    topology_host: str | None = None,
    advertise_host: str | None = None,
    require_models: str | None = None,
) -> list[str]:
    """The parameter manager: the index of the models in `model_dir`, and host-cache shard 0;
    with `require_models` (a JSON list) it exits at start while one of them is missing."""
    out = ["--model-dir", model_dir]
    if require_models is not None:
        out += ["--require-models", require_models]
    if cache_slots is not None:
        out += ["--cache-slots", cache_slots]
    if topology_host is not None:
        out += ["--topology-host", topology_host]
    return out + advertise_args(advertise_host)


def host_cache_args(
    *,
    model_dir: str,
    index: str,
    cache_slot: str,
    topology_host: str | None = None,
    advertise_host: str | None = None,
) -> list[str]:
    """A host-cache shard (slot >= 1) of the parameter pool, registered with the index."""
    out = ["--model-dir", model_dir, "--index", index, "--cache-slot", cache_slot]
    if topology_host is not None:
        out += ["--topology-host", topology_host]
    return out + advertise_args(advertise_host)


def manager_pool_args(
    *, min_instances: str, min_prefill: str | None = None, min_decode: str | None = None
) -> list[str]:
    """The global manager's pool floors: colocated instances, or (both given) the prefill and
    decode pools kept loaded (colocated ones then count from 0)."""
    if min_prefill is not None and min_decode is not None:
        return ["--min-prefill", min_prefill, "--min-decode", min_decode, "--min-instances", "0"]
    return ["--min-instances", min_instances]


def manager_autoscale_args(*, policy_params: str, max_instances: str, window_s: str | None = None) -> list[str]:
    """HeteroScale, growing each pool up to `max_instances` (the workers there are)."""
    out = [
        "--autoscale",
        "--policy",
        "heteroscale",
        "--policy-params",
        policy_params,
        "--max-instances",
        max_instances,
    ]
    return out + (["--window-s", window_s] if window_s is not None else [])


def policy_params_json(params: dict[str, Any]) -> str:
    """How policy parameters travel on a command line (sorted, so renderings compare equal)."""
    return json.dumps(params, sort_keys=True)


def global_manager_args(*, param_manager: str, model: str, pool: list[str], autoscale: list[str]) -> list[str]:
    """The global manager: the model it keeps loaded, its pool floors and its autoscaling."""
    return ["--param-manager", param_manager, "--default-model", model, *pool, *autoscale]


def worker_args(
    *,
    instance_id: str,
    topology_host: str,
    global_manager: str,
    param_manager: str,
    role: str | None = None,
    advertise_host: str | None = None,
) -> list[str]:
    """A worker (one per accelerator): its identity, where it runs, its managers, its role."""
    out = [
        *advertise_args(advertise_host),
        "--instance-id",
        instance_id,
        "--topology-host",
        topology_host,
    ]
    if role is not None:
        out += ["--role", role]
    return out + ["--global-manager", global_manager, "--param-manager", param_manager]


def instance_id_of(args: list[str]) -> str | None:
    """The instance id a worker's command line gives it (`worker_args`); None: none given."""
    return args[args.index("--instance-id") + 1] if "--instance-id" in args else None


def dataplane_args(kind: str) -> list[str]:
    """The data plane's transport: auto (UCX if it imports), ucx or tcp."""
    return ["--dataplane", kind]


def device_args(device: str) -> list[str]:
    """Where a worker's model and KV cache live: cpu, or cuda[:N] (one accelerator per worker)."""
    return ["--device", device]


def worker_thread_args(*, threads: int, cpu_share_dir: str | None = None) -> list[str]:
    """torch threads of a worker's engine: fixed, or (0) its share of the cores among the engines
    counted in `cpu_share_dir`."""
    if threads > 0 or cpu_share_dir is None:
        return ["--num-threads", str(threads)]
    return ["--num-threads", "0", "--cpu-share-dir", cpu_share_dir]


def gateway_args(
    *,
    global_manager: str,
    param_manager: str,
    http_host: str | None = None,
    http_port: str | None = None,
    schedule_wait_s: str | None = None,
) -> list[str]:
    """The gateway: its public HTTP API and the managers it asks for routes and tokenizers."""
    out: list[str] = []
    if http_host is not None:
        out += ["--http-host", http_host]
    if http_port is not None:
        out += [PORT_FLAGS["http_port"], http_port]
    out += schedule_wait_args(schedule_wait_s)
    return out + ["--global-manager", global_manager, "--param-manager", param_manager]


def schedule_wait_args(schedule_wait_s: str | None) -> list[str]:
    """How long the gateway holds a request that finds no instance (None: its default)."""
    return [] if schedule_wait_s is None else ["--schedule-wait-s", schedule_wait_s]


def model_init_command(model_dir: str = MODEL_DIR) -> list[str]:
    """Fetch and convert the default model into `model_dir` (once per volume)."""
    return ["python", "-m", "services.model_format", "fetch-default", model_dir]


def certs_init_command(
    tls_dir: str = TLS_DIR, ca_key: str = "/tls-ca/ca.key", instances: tuple[tuple[str, str], ...] = ()
) -> list[str]:
    """Make the mesh's CA, one certificate per role and one per (role, instance id) of
    `instances` (kept while current, renewed near their end)."""
    extra = [arg for role, iid in instances for arg in ("--instance", f"{role}/{iid}")]
    return ["python", "-m", "services.common.pki", tls_dir, "--ca-key", ca_key, *extra]
