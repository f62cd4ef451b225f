"""Exception types of the data plane; every failure a caller must tell apart has its own type."""

from __future__ import annotations

__all__ = [
    "ChecksumMismatch",
    "DataPlaneError",
    "InsufficientMemory",
    "ManifestError",
    "ManifestMismatch",
    "ModelNotHeld",
    "PeerClosed",
    "PeerUnreachable",
    "ProtocolError",
    "SourceUnavailable",
    "TransferTimeout",
    "TransportError",
    "TransportUnavailable",
    "UpstreamAborted",
]


class DataPlaneError(Exception):
    """Base class of every error raised by `services.dataplane`."""


class ManifestError(DataPlaneError, ValueError):
    """A manifest (or the tensors it is built from) is malformed: bad dtype, size, overlap."""


class ManifestMismatch(DataPlaneError):
    """A source serves a different manifest (another digest) than the receiver expects."""


class ChecksumMismatch(DataPlaneError):
    """A group's received bytes do not match the checksum in its manifest."""

    def __init__(self, message: str, *, group: str, expected: str, actual: str) -> None:
        super().__init__(message)
        self.group = group
        self.expected = expected
        self.actual = actual


class InsufficientMemory(DataPlaneError, MemoryError):
    """The groups to receive do not fit the receiver's size budget, or allocation failed."""


class TransportError(DataPlaneError):
    """A transport-level failure: the connection, not the content, went wrong."""


class TransportUnavailable(TransportError):
    """The requested transport cannot be used in this process (e.g. `ucxx` does not import)."""


class TransferTimeout(TransportError, TimeoutError):
    """A peer did not deliver (or accept) a message in time; the endpoint has been aborted."""


class PeerClosed(TransportError, ConnectionError):
    """The peer closed the connection (or died) while a message was expected."""


class PeerUnreachable(PeerClosed):
    """No connection to the peer could be made: its address is dead (the process is gone, or
    restarted with another address) or the transport refused it. Raised at the transport
    boundary in place of the transport library's own errors (e.g. every `ucxx` error)."""


class ProtocolError(TransportError):
    """A peer sent a message that breaks the framing or the request/response protocol."""


class UpstreamAborted(TransportError):
    """The upstream source told us it cannot finish the stream (e.g. its own upstream failed)."""


class SourceUnavailable(TransportError):
    """A source does not hold (and does not expect) a requested group."""


class ModelNotHeld(SourceUnavailable):
    """A source does not hold the model at all: it dropped it (its own load failed, it was
    unloaded) or never had it. Answered at once, and retryable: the next source is tried."""
