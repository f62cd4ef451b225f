"""Blitzmesh data plane: moves parameter groups between processes over UCX (or TCP), in chains.

`manifest` describes a model's groups and their bytes; `transport` is the tagged-message
interface with UCX (`ucx`) and TCP (`tcp`) implementations; `chain` moves groups along
forwarding chains and sharded transfers with fallbacks and checksums. gRPC stays the control
plane: only addresses and manifests travel over it.
"""

from typing import Any

import structlog

from .buffers import as_byte_view, as_uint8_array, host_buffer
from .chain import (
    GroupServer,
    GroupStore,
    Pull,
    TransferResult,
    fetch_manifest,
    receive_chain,
    receive_groups,
    serve_groups,
)
from .errors import (
    ChecksumMismatch,
    DataPlaneError,
    InsufficientMemory,
    ManifestError,
    ManifestMismatch,
    ModelNotHeld,
    PeerClosed,
    PeerUnreachable,
    ProtocolError,
    SourceUnavailable,
    TransferTimeout,
    TransportError,
    TransportUnavailable,
    UpstreamAborted,
)
from .manifest import (
    DEFAULT_CHUNK_BYTES,
    Chunk,
    GroupEntry,
    Manifest,
    TensorEntry,
    build_manifest,
    chunks,
    group_tensors,
    pack_group,
    pack_groups,
)
from .transport import (
    TCP_OPTIONS,
    UCX_OPTIONS,
    Endpoint,
    Transport,
    TransportKind,
    address_kind,
    address_label,
)

log = structlog.get_logger(__name__)

_fallback_logged = False


def ucx_available() -> tuple[bool, str]:
    """(True, version) if `ucxx` imports in this process, else (False, the reason)."""
    try:
        from . import ucx
    except ImportError as exc:  # ucxx missing, or its native libraries failed to load
        return False, f"{type(exc).__name__}: {exc}"
    return True, ucx.ucx_version()


def make_transport(kind: TransportKind = "auto", *, auth_key: bytes | None = None, **options: Any) -> Transport:
    """A transport of `kind`; `options` go to its constructor (see `TcpTransport`, `UcxTransport`).

    "auto" is UCX if `ucxx` imports, else TCP with one log line saying why (once per process).
    "ucx" raises TransportUnavailable (quoting the import error) if `ucxx` does not import.
    With `auth_key` every connection, made or accepted, is authenticated first (auth.py).
    """
    transport = _make_transport(kind, **options)
    if auth_key is None:
        return transport
    from .auth import AuthenticatedTransport

    return AuthenticatedTransport(transport, auth_key)


def _make_transport(kind: TransportKind, **options: Any) -> Transport:
    global _fallback_logged
    unknown = set(options) - TCP_OPTIONS - UCX_OPTIONS
    if unknown:
        raise TypeError(f"unknown transport options {sorted(unknown)}, known: {sorted(TCP_OPTIONS | UCX_OPTIONS)}")
    tcp_options = {k: v for k, v in options.items() if k in TCP_OPTIONS}
    if kind == "tcp":
        from .tcp import TcpTransport

        return TcpTransport(**tcp_options)
    if kind not in ("auto", "ucx"):
        raise ValueError(f"unknown transport kind {kind!r}, want 'auto', 'ucx' or 'tcp'")
    ok, reason = ucx_available()
    if ok:
        from .ucx import UcxTransport

        return UcxTransport(**{k: v for k, v in options.items() if k in UCX_OPTIONS})
    if kind == "ucx":
        raise TransportUnavailable(f"UCX transport requested but ucxx does not import: {reason}")
    if not _fallback_logged:
        _fallback_logged = True
        log.warning("dataplane_transport_fallback", wanted="ucx", using="tcp", reason=reason)
    from .tcp import TcpTransport

    return TcpTransport(**tcp_options)


__all__ = [
    "DEFAULT_CHUNK_BYTES",
    "ChecksumMismatch",
    "Chunk",
    "DataPlaneError",
    "Endpoint",
    "GroupEntry",
    "GroupServer",
    "GroupStore",
    "InsufficientMemory",
    "Manifest",
    "ManifestError",
    "ManifestMismatch",
    "ModelNotHeld",
    "PeerClosed",
    "PeerUnreachable",
    "ProtocolError",
    "Pull",
    "SourceUnavailable",
    "TensorEntry",
    "TransferResult",
    "TransferTimeout",
    "Transport",
    "TransportError",
    "TransportUnavailable",
    "UpstreamAborted",
    "address_kind",
    "address_label",
    "as_byte_view",
    "as_uint8_array",
    "build_manifest",
    "chunks",
    "fetch_manifest",
    "group_tensors",
    "host_buffer",
    "make_transport",
    "pack_group",
    "pack_groups",
    "receive_chain",
    "receive_groups",
    "serve_groups",
    "ucx_available",
]
