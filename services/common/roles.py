"""Who may call what: the workload roles of the mesh and the one table of their permissions.

A caller's role is the name in its client certificate (CN, also its SAN DNS name), issued by the
mesh's CA (services/common/pki.py); a worker's or host cache's certificate also names its
instance, which `security.caller_instance` reads. Every internal gRPC server checks each call against
`PERMISSIONS` (services/common/security.py's interceptor) before the request is even decoded:
a method missing from the table is refused to everyone, so a new RPC must be added here to be
callable at all (tests/unit/test_security.py checks that the table covers every method of the
protos). docs/security.md prints the table.

The gateway's client-facing services (Inference, Admin) are not in the table: they are the
public edge and authenticate callers with API keys, not certificates.
"""

from __future__ import annotations

from typing import Final

GATEWAY: Final = "gateway"
GLOBAL_MANAGER: Final = "global-manager"
WORKER: Final = "worker"
PARAM_MANAGER: Final = "param-manager"
HOST_CACHE: Final = "host-cache"
# An operator's tools: the launcher (`make up`, the e2e tests) waiting for the mesh and reading
# its state, `python -m services.common.healthcheck`, grpcurl with the admin certificate.
ADMIN: Final = "admin"

ALL_ROLES: Final = (GATEWAY, GLOBAL_MANAGER, WORKER, PARAM_MANAGER, HOST_CACHE, ADMIN)
# Roles with many processes: each instance has a certificate of its own, which names the role
# (CN, for this table) and the instance (a SAN URI, services/common/pki.py's `spiffe_id`). The
# services they report to accept a report about instance X only from X's certificate.
INSTANCE_ROLES: Final = (WORKER, HOST_CACHE)

_ANY: Final = frozenset(ALL_ROLES)

# Full gRPC service name -> method -> roles allowed to call it.
PERMISSIONS: Final[dict[str, dict[str, frozenset[str]]]] = {
    "blitzmesh.v1.GlobalManager": {
        # Instance lifecycle: only workers report themselves.
        "RegisterInstance": frozenset({WORKER}),
        "Heartbeat": frozenset({WORKER}),
        "DeregisterInstance": frozenset({WORKER}),
        # Routing: only the gateway asks where a request goes.
        "Schedule": frozenset({GATEWAY}),
        # A gateway reports an instance it saw fail (suspect at once, routed around).
        "ReportInstanceFailure": frozenset({GATEWAY}),
        # Cluster state and control: the gateway forwards its Admin API (after its admin key
        # check) and the operator's tools call them directly.
        "GetCluster": frozenset({GATEWAY, ADMIN}),
        "Scale": frozenset({GATEWAY, ADMIN}),
        "SetPolicy": frozenset({GATEWAY, ADMIN}),
        "WatchEvents": frozenset({GATEWAY, ADMIN}),
        "GetHistory": frozenset({GATEWAY, ADMIN}),
    },
    "blitzmesh.v1.Worker": {
        # Inference: the gateway, and a worker relaying a ZigZag request to its loading partner.
        "Generate": frozenset({GATEWAY, WORKER}),
        "Abort": frozenset({GATEWAY}),
        "ExecuteLayers": frozenset({GATEWAY, WORKER}),
        "GetStatus": frozenset({GLOBAL_MANAGER, GATEWAY, ADMIN}),
        # Lifecycle and rebalancing: only the global manager.
        "LoadParameters": frozenset({GLOBAL_MANAGER}),
        "Drain": frozenset({GLOBAL_MANAGER}),
        "Resume": frozenset({GLOBAL_MANAGER}),
        "Unload": frozenset({GLOBAL_MANAGER}),
        "ReleaseWaiting": frozenset({GLOBAL_MANAGER}),
        "ReleaseRunning": frozenset({GLOBAL_MANAGER}),
    },
    # Served by the parameter manager and by every host cache.
    "blitzmesh.v1.ParamManager": {
        "ListModels": frozenset({GATEWAY, GLOBAL_MANAGER, WORKER, HOST_CACHE, ADMIN}),
        "GetModel": frozenset({GATEWAY, GLOBAL_MANAGER, WORKER, HOST_CACHE, ADMIN}),
        "GetModelFiles": frozenset({GATEWAY, WORKER, HOST_CACHE}),
        "FetchGroups": frozenset({WORKER, HOST_CACHE}),
        "Locate": frozenset({GLOBAL_MANAGER, WORKER, ADMIN}),
        # The location index: the manager records where instances hold a model.
        "UpdateLocation": frozenset({GLOBAL_MANAGER}),
        "RegisterHostCache": frozenset({HOST_CACHE}),
    },
    # Every process's health (the launcher, compose's healthcheck, the gateway's /health probe).
    "grpc.health.v1.Health": {"Check": _ANY, "Watch": _ANY, "List": _ANY},
    # Only where a service is started with --reflection.
    "grpc.reflection.v1alpha.ServerReflection": {"ServerReflectionInfo": frozenset({ADMIN})},
}


def allowed_roles(full_method: str) -> frozenset[str]:
    """The roles allowed to call `/package.Service/Method` (empty: nobody)."""
    service, _, method = full_method.lstrip("/").rpartition("/")
    return PERMISSIONS.get(service, {}).get(method, frozenset())
