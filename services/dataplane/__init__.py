"""Blitzmesh data plane: moves parameter groups between processes over UCX (or TCP), in chains.

`manifest` describes a model's groups and their bytes; `transport` is the tagged-message
interface with UCX (`ucx`) and TCP (`tcp`) implementations; `chain` moves groups along
forwarding chains and sharded transfers with fallbacks and checksums. gRPC stays the control
plane: only addresses and manifests travel over it.
"""

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
from .transport import Endpoint, Transport, address_kind, address_label, make_transport, ucx_available

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
