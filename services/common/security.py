"""mTLS for every internal gRPC hop: a process's identity, its server and channel credentials,
and the interceptor that checks each caller's role against services/common/roles.py.

A process has one identity: a role and that role's certificate from the mesh's CA (`tls_dir`,
made by services/common/pki.py). serve() binds the internal services with
`ssl_server_credentials(..., require_client_auth=True)` and installs `AuthorizationInterceptor`;
`grpc_util.channel()` opens `secure_channel`s with the process's identity as its client
certificate, checking that the server's certificate names the role it expects there.

Certificates are renewed in place (`blitzmesh certs rotate`, docs/security.md): the process
identity is re-read when its files change on disk (`IdentityWatch`, checked at most every
`RELOAD_CHECK_S`), the server hands each new handshake the current certificate
(`dynamic_server_credentials`), and grpc_util's channels move to a new connection on their next
call. A certificate is only taken together with the key it was issued for (`key_matches`).

Plaintext is an explicit opt-in for development (`--insecure`): serve() logs a warning, and no
caller is checked. The process identity starts unset (plaintext channels) until serve() or the
launcher sets it with `use_identity()`.
"""

from __future__ import annotations

import contextlib
import inspect
import threading
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
import structlog
from prometheus_client import Counter

from services.common import pki
from services.common.config import ServiceConfig
from services.common.roles import ALL_ROLES, allowed_roles
from services.common.waiting import wait_for

log = structlog.get_logger(__name__)

AUTH_REFUSED = Counter(
    "blitzmesh_auth_refused_total",
    "Internal gRPC calls refused by the caller check (services/common/roles.py)",
    ["method", "reason"],
)

_REFUSED_STREAM_WAIT_S = 0.5
# How often a process looks at its certificate files for a renewal (a stat of three files): a
# rotation is seen within this, well inside the 10 s an operator is promised (docs/security.md).
RELOAD_CHECK_S = 2.0
# A certificate read without its key (read between the two renames of a rotation) is read again
# this much later; at start-up, for at most _PAIR_WAIT_S.
_PAIR_RETRY_S = 0.05
_PAIR_WAIT_S = 2.0
HOW_TO_CREATE = "create them with `python -m services.common.pki {dir}` (make up does on its first start)"
HOW_TO_CREATE_INSTANCE = "create it with `python -m services.common.pki {dir} --instance {role}/{instance}` (make up does when it starts the instance)"


@dataclass(frozen=True)
class Identity:
    """A role, its certificate and key, and the CA certificate every peer is checked against."""

    role: str
    cert_pem: bytes
    key_pem: bytes
    ca_pem: bytes
    tls_dir: Path
    instance: str | None = None  # the instance its certificate names (workers, host caches)

    def server_credentials(self) -> grpc.ServerCredentials:
        return grpc.ssl_server_credentials(
            [(self.key_pem, self.cert_pem)], root_certificates=self.ca_pem, require_client_auth=True
        )

    def certificate_configuration(self) -> grpc.ServerCertificateConfiguration:
        return grpc.ssl_server_certificate_configuration([(self.key_pem, self.cert_pem)], root_certificates=self.ca_pem)

    def channel_credentials(self) -> grpc.ChannelCredentials:
        return grpc.ssl_channel_credentials(
            root_certificates=self.ca_pem, private_key=self.key_pem, certificate_chain=self.cert_pem
        )


def identity_paths(tls_dir: Path, role: str, instance: str | None = None) -> list[Path]:
    """[CA, certificate, key] of `role` (of its `instance`, `pki.instance_files`) in `tls_dir`."""
    if instance is None:
        return [tls_dir / pki.CA_CERT, pki.cert_path(tls_dir, role), pki.key_path(tls_dir, role)]
    return list(pki.instance_files(tls_dir, role, instance))


def key_matches(cert_pem: bytes, key_pem: bytes) -> bool:
    """Whether `key_pem` is the private key of `cert_pem`'s public key (False if either does not parse)."""
    from cryptography import x509
    from cryptography.hazmat.primitives import serialization

    spki = serialization.Encoding.DER, serialization.PublicFormat.SubjectPublicKeyInfo
    try:
        cert_key = x509.load_pem_x509_certificate(cert_pem).public_key().public_bytes(*spki)
        private = serialization.load_pem_private_key(key_pem, password=None)
    except (ValueError, TypeError):
        return False
    return private.public_key().public_bytes(*spki) == cert_key


def load_identity(tls_dir: Path, role: str, instance: str | None = None) -> Identity:
    """The identity of `role` (of one `instance` of it: its own certificate, `pki.instance_files`,
    which must name it) from `tls_dir`; SystemExit naming the missing file and how to make it.
    A certificate and key that do not belong together (read in the middle of a rotation) are
    read again for up to `_PAIR_WAIT_S`."""
    deadline = time.monotonic() + _PAIR_WAIT_S
    while True:
        identity = _read_identity(tls_dir, role, instance)
        if key_matches(identity.cert_pem, identity.key_pem):
            return identity
        if time.monotonic() >= deadline:
            paths = identity_paths(tls_dir, role, instance)
            raise SystemExit(
                f"TLS files {str(paths[1])!r} and {str(paths[2])!r} do not belong together (the key is not the "
                f"certificate's); renew them with `blitzmesh certs rotate --tls-dir {tls_dir}`"
            )
        time.sleep(_PAIR_RETRY_S)


def _read_identity(tls_dir: Path, role: str, instance: str | None) -> Identity:
    if role not in ALL_ROLES:
        raise SystemExit(f"unknown workload role {role!r}; the roles are {list(ALL_ROLES)}")
    if instance is not None:
        try:
            pki.check_instance_id(role, instance)
        except ValueError as e:
            raise SystemExit(str(e)) from e
    paths = identity_paths(tls_dir, role, instance)
    how = HOW_TO_CREATE if instance is None else HOW_TO_CREATE_INSTANCE
    whose = f"role {role!r}" + (f", instance {instance!r}" if instance is not None else "")
    data: list[bytes] = []
    for path in paths:
        try:
            data.append(path.read_bytes())
        except OSError as e:
            raise SystemExit(
                f"TLS file {str(path)!r} of {whose} cannot be read ({e.strerror}); "
                + how.format(dir=tls_dir, role=role, instance=instance)
                + ", or pass --insecure for a plaintext development mesh"
            ) from e
    if instance is not None:
        # A certificate for another instance would be refused at registration; say so at start.
        try:
            named = pki.named_instances(data[1])
        except ValueError as e:
            raise SystemExit(f"TLS file {str(paths[1])!r} of {whose} is no PEM certificate ({e})") from e
        if (role, instance) not in named:
            raise SystemExit(
                f"TLS file {str(paths[1])!r} names {[pki.spiffe_id(*n) for n in named]}, not this process's "
                f"{pki.spiffe_id(role, instance)!r}; an instance presents its own certificate (docs/security.md)"
            )
    return Identity(role, data[1], data[2], data[0], tls_dir, instance)


class IdentityWatch:
    """One identity, re-read from its files when they change on disk: `current()` looks (a stat
    of each file) at most every `check_interval_s` and returns the same `Identity` object until
    new files were read whole, the key the certificate's. Thread-safe: gRPC's certificate
    fetcher calls it from its own threads."""

    def __init__(
        self,
        identity: Identity,
        *,
        check_interval_s: float = RELOAD_CHECK_S,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._identity = identity
        self._paths = identity_paths(identity.tls_dir, identity.role, identity.instance)
        self._check_interval_s = check_interval_s
        self._clock = clock
        self._lock = threading.Lock()
        # None: compare the contents on the first look (the files may have changed since the
        # identity was read); then only a changed stat makes it read them.
        self._stamp: tuple[tuple[int, int, int], ...] | None = None
        self._next_check_s = clock() + check_interval_s

    def current(self) -> Identity:
        now_s = self._clock()
        if now_s < self._next_check_s:
            return self._identity
        with self._lock:
            if now_s >= self._next_check_s:
                self._next_check_s = now_s + self._check_interval_s
                self._refresh()
            return self._identity

    def _refresh(self) -> None:
        try:
            stamp = tuple((st.st_ino, st.st_mtime_ns, st.st_size) for st in (p.stat() for p in self._paths))
        except OSError:
            return  # a file is away for a moment (being replaced): keep what we have, look again
        if stamp == self._stamp:
            return
        old = self._identity
        try:
            new = _read_identity(old.tls_dir, old.role, old.instance)
        except SystemExit as e:
            log.warning("certificate_reload_failed", role=old.role, instance=old.instance, error=str(e))
            return
        if not key_matches(new.cert_pem, new.key_pem):
            # Read between the key's and the certificate's rename: look again very soon.
            self._next_check_s = self._clock() + _PAIR_RETRY_S
            return
        self._stamp = stamp
        if (new.cert_pem, new.key_pem, new.ca_pem) != (old.cert_pem, old.key_pem, old.ca_pem):
            self._identity = new
            log.info("certificate_reloaded", role=new.role, instance=new.instance, serial=_serial(new.cert_pem))


def _serial(cert_pem: bytes) -> str:
    from cryptography import x509

    return format(x509.load_pem_x509_certificate(cert_pem).serial_number, "x")


def dynamic_server_credentials(watch: IdentityWatch) -> grpc.ServerCredentials:
    """mTLS server credentials that give each new handshake `watch`'s current certificate
    (connections already open keep theirs; the client certificate is checked against its CA)."""
    served = watch.current()

    def fetch() -> grpc.ServerCertificateConfiguration | None:
        nonlocal served
        try:
            identity = watch.current()
        except Exception:  # an exception here would fail the handshake; keep the certificate served
            log.exception("certificate_fetch_failed")
            return None
        if identity is served:
            return None
        served = identity
        return identity.certificate_configuration()

    return grpc.dynamic_ssl_server_credentials(
        served.certificate_configuration(), fetch, require_client_authentication=True
    )


_process_identity: IdentityWatch | None = None


def use_identity(identity: Identity | None) -> IdentityWatch | None:
    """Set the identity this process's channels present (None: plaintext channels), re-read from
    its files when they change; returns its watch (serve() gives it to the server too)."""
    global _process_identity
    _process_identity = None if identity is None else IdentityWatch(identity)
    return _process_identity


def process_identity() -> Identity | None:
    """This process's identity as its files hold it now (checked at most every `RELOAD_CHECK_S`)."""
    return None if _process_identity is None else _process_identity.current()


def secure_channel_options(peer_role: str) -> list[tuple[str, Any]]:
    """The server's certificate must name `peer_role`: the address (an IP, a compose name) is
    not what is checked, the role is."""
    return [("grpc.ssl_target_name_override", peer_role)]


def dataplane_key(config: ServiceConfig) -> bytes | None:
    """The key the data plane authenticates peers with (services/dataplane/auth.py), read by
    `pki.read_key`; None when the service runs --insecure."""
    if config.insecure or config.tls_dir is None:
        return None
    return pki.read_key(config.tls_dir / pki.DATAPLANE_KEY)


def caller_role(context: grpc.aio.ServicerContext) -> str | None:
    """The role named by the caller's verified client certificate (None: no certificate)."""
    auth = context.auth_context()
    names = auth.get("x509_common_name") or []
    return names[0].decode(errors="replace") if names else None


def caller_instance(context: grpc.aio.ServicerContext) -> str | None:
    """The instance named by the caller's verified certificate (its SAN URI
    spiffe://blitzmesh/<role>/<id>, the role matching its CN); None: it names none."""
    auth = context.auth_context()
    role = caller_role(context)
    for raw in auth.get("peer_uri") or []:  # the certificate's SAN URIs
        named = pki.parse_spiffe_id(raw.decode(errors="replace"))
        if named is not None and named[0] == role:
            return named[1]
    return None


async def require_instance(context: grpc.aio.ServicerContext, method: str, instance_id: str) -> None:
    """Abort with PERMISSION_DENIED unless the caller's certificate names `instance_id`: an
    instance reports only for itself. No-op without TLS (an --insecure mesh checks nobody)."""
    if context.auth_context().get("transport_security_type") != [b"ssl"]:
        return
    caller = caller_instance(context)
    if caller is not None and caller == instance_id:
        return
    AUTH_REFUSED.labels(method, "wrong_instance").inc()
    await context.abort(
        grpc.StatusCode.PERMISSION_DENIED,
        f"{method}: the caller's certificate names instance {caller!r}, the request instance {instance_id!r}; "
        "an instance may act only for itself",
    )


class AuthorizationInterceptor(grpc.aio.ServerInterceptor):
    """Refuse a call unless the caller's certificate names a role `roles.PERMISSIONS` allows for
    the method: UNAUTHENTICATED without a known role, PERMISSION_DENIED with another role's.

    The check runs before the request bytes are decoded, so a refused caller never reaches a
    servicer, not even its parser; a request that does not parse is INVALID_ARGUMENT. Servicers
    of streamed requests read them from their request iterator (context.read() would see the
    raw bytes).
    """

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Any],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler | None:
        handler = await continuation(handler_call_details)
        if handler is None:
            return None
        method = handler_call_details.method
        return _guarded(handler, method, allowed_roles(method))


async def _authorize(
    context: grpc.aio.ServicerContext,
    method: str,
    allowed: frozenset[str],
    requests: AsyncIterator[bytes] | None = None,
) -> None:
    role = caller_role(context)
    if role is not None and role in allowed:
        return
    if role is None or role not in ALL_ROLES:
        reason = "unauthenticated"
        code = grpc.StatusCode.UNAUTHENTICATED
        details = f"{method}: the caller's certificate names no mesh role (CN {role!r}; roles {list(ALL_ROLES)})"
    else:
        reason = "permission_denied"
        code = grpc.StatusCode.PERMISSION_DENIED
        details = f"{method}: role {role!r} may not call it (allowed: {sorted(allowed) or 'nobody'})"
    AUTH_REFUSED.labels(method, reason).inc()
    if requests is not None:
        await abort_stream(context, requests, code, details)
    await context.abort(code, details)


async def abort_stream(
    context: grpc.aio.ServicerContext, requests: AsyncIterator[Any], code: grpc.StatusCode, details: str
) -> None:
    """End a call with streamed requests with `code`. One refused while its first message is
    still in flight reaches the client as INTERNAL now and then (the stream ends under the
    client's write): that message is taken first, unread, for a moment."""
    with contextlib.suppress(Exception):
        await wait_for(anext(aiter(requests)), _REFUSED_STREAM_WAIT_S)
    await context.abort(code, details)


async def _decode(deserializer: Any, raw: bytes, context: grpc.aio.ServicerContext, method: str) -> Any:
    if deserializer is None:
        return raw
    try:
        return deserializer(raw)
    except Exception as e:  # protobuf's DecodeError, or anything a parser of garbage raises
        await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"{method}: the request does not parse: {e}")


def _guarded(handler: grpc.RpcMethodHandler, method: str, allowed: frozenset[str]) -> grpc.RpcMethodHandler:
    """`handler` taking raw request bytes (no request_deserializer): the caller is checked first,
    then each request message is decoded, so a refused caller's bytes are never parsed."""
    deserialize = handler.request_deserializer
    kw = {"response_serializer": handler.response_serializer}

    async def admit(raw: bytes, context: grpc.aio.ServicerContext) -> Any:
        await _authorize(context, method, allowed)
        return await _decode(deserialize, raw, context, method)

    async def admit_stream(requests: AsyncIterator[bytes], context: grpc.aio.ServicerContext) -> AsyncIterator[Any]:
        await _authorize(context, method, allowed, requests)
        return (await _decode(deserialize, raw, context, method) async for raw in requests)

    if handler.unary_unary is not None:
        uu = handler.unary_unary

        async def unary_unary(raw: bytes, context: grpc.aio.ServicerContext) -> Any:
            return await uu(await admit(raw, context), context)

        return grpc.unary_unary_rpc_method_handler(unary_unary, **kw)
    if handler.unary_stream is not None:
        us = handler.unary_stream

        async def unary_stream(raw: bytes, context: grpc.aio.ServicerContext) -> AsyncIterator[Any]:
            async for item in _results(us(await admit(raw, context), context)):
                yield item

        return grpc.unary_stream_rpc_method_handler(unary_stream, **kw)
    if handler.stream_unary is not None:
        su = handler.stream_unary

        async def stream_unary(requests: AsyncIterator[bytes], context: grpc.aio.ServicerContext) -> Any:
            return await su(await admit_stream(requests, context), context)

        return grpc.stream_unary_rpc_method_handler(stream_unary, **kw)
    ss = handler.stream_stream

    async def stream_stream(requests: AsyncIterator[bytes], context: grpc.aio.ServicerContext) -> AsyncIterator[Any]:
        async for item in _results(ss(await admit_stream(requests, context), context)):
            yield item

    return grpc.stream_stream_rpc_method_handler(stream_stream, **kw)


async def _results(result: Any) -> AsyncIterator[Any]:
    """A streaming servicer's answers: an async generator's items, or none from a coroutine
    that writes with context.write() (or aborts)."""
    if inspect.isasyncgen(result):
        async for item in result:
            yield item
    else:
        await result
