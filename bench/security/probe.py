"""Call every method of every internal service of a running mesh as every kind of caller.

Used by the security tests (tests/e2e/test_mesh_security.py) and by `python -m bench.security`, which
records the fuzz counts in bench/results/security.json. The callers:

- `plaintext`: no TLS at all;
- `no-client-cert`: TLS that trusts the mesh's CA but presents no certificate;
- `foreign-ca`: a certificate of the right role, from another CA;
- `unknown-name`: a certificate of the mesh's CA naming no role;
- `role:<r>`: the mesh's certificate of role r (services/common/roles.py says which may call what);
  for a worker or a host cache, one instance's own certificate (the first in the directory).

Every call is bounded by a deadline: a call that runs into it is a hang, except a watch stream
(WatchEvents, health's Watch), which runs until its caller leaves and is read for
`watch_timeout_s` only.
"""

from __future__ import annotations

import asyncio
import contextlib
import random
import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc
from google.protobuf import descriptor_pool

import blitzmesh.v1.global_manager_pb2
import blitzmesh.v1.param_manager_pb2
import blitzmesh.v1.worker_pb2  # noqa: F401  (registers the service descriptors)
from blitzmesh.v1 import (
    admin_pb2,
    global_manager_pb2_grpc,
    param_manager_pb2,
    param_manager_pb2_grpc,
    worker_pb2,
    worker_pb2_grpc,
)
from services.common import pki, roles
from services.common.grpc_util import CHANNEL_OPTIONS
from services.common.security import secure_channel_options
from services.mesh.launcher import Mesh, role_of

SERVICE_OF_ROLE = {
    roles.WORKER: "blitzmesh.v1.Worker",
    roles.GLOBAL_MANAGER: "blitzmesh.v1.GlobalManager",
    roles.PARAM_MANAGER: "blitzmesh.v1.ParamManager",
    roles.HOST_CACHE: "blitzmesh.v1.ParamManager",
}
REFUSED_CODES = frozenset({"UNAUTHENTICATED", "PERMISSION_DENIED"})
# A caller with no valid certificate does not get past the TLS handshake (require_client_auth):
# no handler runs, and the client sees the connection fail.
HANDSHAKE_REFUSED = "UNAVAILABLE"
UNCERTIFIED = ("plaintext", "no-client-cert", "foreign-ca")


@dataclass(frozen=True)
class Method:
    service: str
    name: str
    client_streaming: bool
    server_streaming: bool

    @property
    def path(self) -> str:
        return f"/{self.service}/{self.name}"

    @property
    def watch(self) -> bool:
        """A stream that runs until its caller leaves: its deadline is not a hang."""
        return self.server_streaming and self.name.startswith("Watch")


@dataclass(frozen=True)
class Target:
    process: str  # the mesh's process name, e.g. "worker-1"
    address: str
    role: str  # its certificate's role

    @property
    def methods(self) -> list[Method]:
        service = SERVICE_OF_ROLE[self.role]
        desc = descriptor_pool.Default().FindServiceByName(service)
        return [Method(service, m.name, m.client_streaming, m.server_streaming) for m in desc.methods]


def targets(mesh: Mesh) -> list[Target]:
    """Every internal process of `mesh` (all but the gateway, whose port is the public edge)."""
    return [Target(name, p.grpc_address, role_of(name)) for name, p in sorted(mesh.procs.items()) if name != "gateway"]


@dataclass
class Callers:
    """Channel credentials of every kind of caller, for one mesh."""

    tls_dir: Path | None  # None: a mesh started --insecure, where only `plaintext` means anything
    scratch: Path
    _creds: dict[str, grpc.ChannelCredentials | None] = field(default_factory=dict)
    # The instance whose own certificate `role:<r>` presents, for the per-instance roles.
    instances: dict[str, str | None] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self._creds["plaintext"] = None
        if self.tls_dir is None:
            return
        ca = (self.tls_dir / pki.CA_CERT).read_bytes()
        self._creds["no-client-cert"] = grpc.ssl_channel_credentials(root_certificates=ca)
        for role in roles.ALL_ROLES:
            # A worker's or host cache's real certificate is its instance's own (the first there).
            own = sorted(p.stem for p in (self.tls_dir / role).glob("*.pem")) if role in roles.INSTANCE_ROLES else []
            instance = own[0] if own else None
            self.instances[role] = instance
            self._creds[f"role:{role}"] = grpc.ssl_channel_credentials(
                root_certificates=ca,
                private_key=pki.key_path(self.tls_dir, role, instance).read_bytes(),
                certificate_chain=pki.cert_path(self.tls_dir, role, instance).read_bytes(),
            )
        cert, key = pki.issue_from(self.tls_dir, "stranger")
        self._creds["unknown-name"] = grpc.ssl_channel_credentials(
            root_certificates=ca, private_key=key, certificate_chain=cert
        )
        # The right role's name from a CA of its own (it trusts the mesh's CA, so only the
        # server's check of the client certificate can refuse it).
        other = self.scratch / "foreign-ca"
        pki.ensure_pki(other, roles.ALL_ROLES)
        self._foreign = other
        self._ca = ca

    def credentials(self, caller: str, target: Target) -> grpc.ChannelCredentials | None:
        if caller == "foreign-ca":
            return grpc.ssl_channel_credentials(
                root_certificates=self._ca,
                private_key=pki.key_path(self._foreign, roles.GLOBAL_MANAGER).read_bytes(),
                certificate_chain=pki.cert_path(self._foreign, roles.GLOBAL_MANAGER).read_bytes(),
            )
        return self._creds[caller]

    def channel(self, caller: str, target: Target) -> grpc.aio.Channel:
        creds = self.credentials(caller, target)
        if creds is None:
            return grpc.aio.insecure_channel(target.address, options=CHANNEL_OPTIONS)
        return grpc.aio.secure_channel(
            target.address, creds, options=CHANNEL_OPTIONS + secure_channel_options(target.role)
        )


@dataclass(frozen=True)
class Outcome:
    code: str  # "OK" or the status code's name
    seconds: float
    details: str = ""

    @property
    def hung(self) -> bool:
        return self.code == "DEADLINE_EXCEEDED"


async def call(ch: grpc.aio.Channel, method: Method, payload: bytes, timeout_s: float) -> Outcome:
    """`method` with `payload` as its (only) request message, raw bytes on the wire."""
    started = time.monotonic()
    try:
        if not method.client_streaming and not method.server_streaming:
            await ch.unary_unary(method.path)(payload, timeout=timeout_s)
        elif not method.client_streaming:
            async for _ in ch.unary_stream(method.path)(payload, timeout=timeout_s):
                pass
        else:
            # Reader/writer style: a write racing the server's end of the call (a refusal comes
            # before the request is read) raises here, and the status is the server's. With a
            # request iterator grpc's client would cancel the call and report its own INTERNAL.
            factory = ch.stream_unary if not method.server_streaming else ch.stream_stream
            streamed = factory(method.path)(timeout=timeout_s)
            with contextlib.suppress(grpc.aio.AioRpcError, grpc.aio.UsageError, grpc.aio.InternalError):
                await streamed.write(payload)
                await streamed.done_writing()
            if method.server_streaming:
                with contextlib.suppress(grpc.aio.AioRpcError):
                    while await streamed.read() is not grpc.aio.EOF:
                        pass
            code = await streamed.code()
            if code != grpc.StatusCode.OK:
                return Outcome(code.name, time.monotonic() - started, await streamed.details() or "")
    except grpc.aio.AioRpcError as e:
        return Outcome(e.code().name, time.monotonic() - started, e.details() or "")
    return Outcome("OK", time.monotonic() - started)


def refusal_expected(caller: str, method: Method) -> str | None:
    """The code `caller` must get from `method` (None: it is allowed to call it)."""
    if caller in UNCERTIFIED:
        return HANDSHAKE_REFUSED
    if caller == "unknown-name":
        return "UNAUTHENTICATED"
    role = caller.removeprefix("role:")
    return None if role in roles.allowed_roles(method.path) else "PERMISSION_DENIED"


def fuzz_payloads(rng: random.Random, n: int) -> Iterable[bytes]:
    """Half random bytes, half random protobuf wire format (field numbers 1-12 with varints,
    fixed64s and length-delimited values), which the services' parsers often accept."""
    for i in range(n):
        if i % 2 == 0:
            yield rng.randbytes(rng.randint(0, 64))
            continue
        out = bytearray()
        for _ in range(rng.randint(1, 6)):
            field_no = rng.randint(1, 12)
            wire = rng.choice((0, 1, 2))
            out += _varint(field_no << 3 | wire)
            if wire == 0:
                out += _varint(rng.choice((0, 1, 2, 3, rng.getrandbits(32), rng.getrandbits(63))))
            elif wire == 1:
                out += rng.randbytes(8)
            else:
                body = rng.randbytes(rng.randint(0, 24))
                out += _varint(len(body)) + body
        yield bytes(out)


def _varint(v: int) -> bytes:
    out = bytearray()
    while True:
        b = v & 0x7F
        v >>= 7
        if v:
            out.append(b | 0x80)
        else:
            out.append(b)
            return bytes(out)


async def snapshot(mesh: Mesh, model: str) -> dict[str, Any]:
    """The mesh's state as an admin sees it, without what moves on its own (loads, ages)."""
    state: dict[str, Any] = {}
    async with mesh.channel("global_manager") as ch:
        cluster = await global_manager_pb2_grpc.GlobalManagerStub(ch).GetCluster(
            admin_pb2.GetClusterRequest(), timeout=10
        )
    state["cluster"] = {
        "policy": cluster.policy,
        "advisory": cluster.advisory,
        "instances": sorted(
            (i.instance_id, i.address, i.state, i.role, i.model_id, i.layers_loaded) for i in cluster.instances
        ),
        "models": sorted(m.model_id for m in cluster.models),
    }
    for name in mesh.procs:
        if name.startswith("worker-"):
            async with mesh.channel(name) as ch:
                info = await worker_pb2_grpc.WorkerStub(ch).GetStatus(worker_pb2.GetStatusRequest(), timeout=10)
            state[name] = (info.state, info.model_id, info.role, info.layers_loaded)
    async with mesh.channel("param_manager") as ch:
        stub = param_manager_pb2_grpc.ParamManagerStub(ch)
        where = await stub.Locate(param_manager_pb2.LocateRequest(model_id=model), timeout=10)
        listed = await stub.ListModels(admin_pb2.ListModelsRequest(), timeout=10)
    state["locations"] = sorted((loc.group, tuple(sorted(loc.holders))) for loc in where.locations)
    state["pool_models"] = sorted(m.model_id for m in listed.models)
    return state


def alive(mesh: Mesh) -> dict[str, bool]:
    return {name: p.process.returncode is None for name, p in mesh.procs.items()}


@dataclass
class Tally:
    calls: int = 0
    refused: int = 0
    handshake_refused: int = 0
    ok: int = 0
    other: dict[str, int] = field(default_factory=dict)
    hangs: list[str] = field(default_factory=list)
    unexpected: list[str] = field(default_factory=list)
    examples: dict[str, str] = field(default_factory=dict)  # the first call that got each other code
    by_caller: dict[str, int] = field(default_factory=dict)  # calls made as each caller
    watches: int = 0  # watch streams read to their deadline (not hangs)

    def add(self, what: str, outcome: Outcome, expected: str | None, caller: str = "") -> None:
        self.calls += 1
        self.by_caller[caller] = self.by_caller.get(caller, 0) + 1
        if outcome.code in REFUSED_CODES:
            self.refused += 1
        elif outcome.code == HANDSHAKE_REFUSED and expected == HANDSHAKE_REFUSED:
            self.handshake_refused += 1
        elif outcome.code == "OK":
            self.ok += 1
        else:
            self.other[outcome.code] = self.other.get(outcome.code, 0) + 1
            self.examples.setdefault(outcome.code, f"{what}: {outcome.details[:160]}")
        if outcome.hung:
            self.hangs.append(f"{what}: {outcome.seconds:.1f} s")
        if expected is not None and outcome.code != expected:
            self.unexpected.append(f"{what}: got {outcome.code} ({outcome.details[:120]}), want {expected}")

    def to_dict(self) -> dict[str, Any]:
        return {
            "calls": self.calls,
            "refused_unauthenticated_or_permission_denied": self.refused,
            "refused_at_tls_handshake": self.handshake_refused,
            "ok": self.ok,
            "other_codes": dict(sorted(self.other.items())),
            "other_code_examples": dict(sorted(self.examples.items())),
            "hangs": len(self.hangs),
            "watch_streams_to_deadline": self.watches,
            "calls_by_caller": dict(sorted(self.by_caller.items())),
            "unexpected": len(self.unexpected),
        }


async def sweep(
    callers: Callers,
    ts: list[Target],
    caller_names: Iterable[str],
    payloads: list[bytes],
    *,
    timeout_s: float,
    select: str,
    concurrency: int = 16,
    watch_timeout_s: float | None = None,
) -> Tally:
    """Every (target, method, caller, payload) where the caller is one the method must refuse
    (`select="refused"`) or one it allows (`select="allowed"`); `select="any"` calls them all
    and expects nothing (the plaintext baseline of an --insecure mesh)."""
    tally = Tally()
    sem = asyncio.Semaphore(concurrency)
    names = list(caller_names)

    async def one(target: Target, caller: str, ch: grpc.aio.Channel, method: Method, payload: bytes) -> None:
        expected = refusal_expected(caller, method) if select != "any" else None
        if select != "any" and (expected is None) != (select == "allowed"):
            return
        async with sem:
            outcome = await call(
                ch, method, payload, watch_timeout_s if method.watch and watch_timeout_s else timeout_s
            )
        what = f"{target.process} {method.name} as {caller}"
        # A watch stream that ran to the deadline is a call still streaming, not a hang.
        if method.watch and outcome.hung:
            outcome = Outcome("WATCH_RAN_TO_DEADLINE", outcome.seconds)
            tally.watches += 1
        tally.add(what, outcome, expected, caller)

    channels: list[grpc.aio.Channel] = []
    try:
        jobs = []
        for target in ts:
            for caller in names:
                ch = callers.channel(caller, target)
                channels.append(ch)
                jobs += [one(target, caller, ch, m, p) for m in target.methods for p in payloads]
        await asyncio.gather(*jobs)
    finally:
        for ch in channels:
            await ch.close()
    return tally
