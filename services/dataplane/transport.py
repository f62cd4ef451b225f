"""The transport interface of the data plane (tagged messages between two processes): the base
classes only. The factory, `make_transport`, is in the package (`services.dataplane`), so that this
module imports none of its implementations.

A `Transport` is one per process: `start()` it, hand `address()` (opaque bytes) to peers over
the control plane, `connect(address)` to a peer or `accept()` a peer's connection; both give
an `Endpoint`. An endpoint carries tagged messages both ways: `send(buffer, tag)` is matched by
the peer's `recv_into(buffer, tag)` with the same tag and the same byte size, and the bytes land
straight in the receiver's buffer. Messages with one tag arrive in the order they were sent.

Every wait has a timeout: with UCX error handling off (the fast mode) a dead peer is never
noticed by the library. A receive or send that times out or is cancelled *aborts its endpoint*:
that cancels the pending operation, so no late write can land in a buffer the caller has moved
on from (e.g. re-sourcing the same group from another peer).

`services.dataplane.make_transport("auto")` gives UCX when `ucxx` imports, else TCP (logged once
per process).
"""

from __future__ import annotations

import abc
import hashlib
import json
import struct
from typing import Any, Final, Literal

from .errors import ProtocolError

__all__ = [
    "MAX_TAG",
    "Endpoint",
    "Transport",
    "TransportKind",
    "address_kind",
    "address_label",
    "TCP_OPTIONS",
    "UCX_OPTIONS",
]

TransportKind = Literal["auto", "ucx", "tcp"]
# Tags are 31 bits: UCX packs a connection id and a direction bit into the rest of its 64.
MAX_TAG: Final = (1 << 31) - 1
_LEN = struct.Struct("<Q")
# Addresses start with a 4-byte kind marker so that handing a TCP address to a UCX transport
# fails with a clear message instead of a library crash.
_ADDRESS_MARKERS: Final = {b"TCP1": "tcp", b"UCX1": "ucx"}
# Constructor options of each transport, so that `make_transport(**options)` can take the union
# (the caller may not know which one it gets) and still reject typos.
TCP_OPTIONS: Final = frozenset({"host", "advertise_host", "port", "socket_buffer_bytes"})
UCX_OPTIONS: Final = frozenset({"progress_mode", "warmup_bytes", "tls", "advertise_host"})


def address_kind(address: bytes) -> str:
    """Which transport an address belongs to ('tcp' or 'ucx'); ValueError if none."""
    kind = _ADDRESS_MARKERS.get(bytes(address[:4]))
    if kind is None:
        raise ValueError(f"not a data plane address: {bytes(address[:16])!r}...")
    return kind


def check_tag(tag: int) -> int:
    if not 0 <= tag <= MAX_TAG:
        raise ValueError(f"tag must be in [0, {MAX_TAG}], got {tag}")
    return tag


class Endpoint(abc.ABC):
    """A connection to one peer that carries tagged messages in both directions."""

    #: Human-readable peer identity for logs (host:port or a short UCX id).
    peer: str

    @abc.abstractmethod
    async def send(self, buffer: Any, tag: int, *, timeout_s: float | None = None) -> None:
        """Send all of `buffer` (bytes-like, numpy array or CPU tensor) as one message.

        The buffer must stay unchanged until this returns. Raises TransferTimeout (endpoint
        aborted) if the peer has not taken it within `timeout_s`, PeerClosed if it is gone.
        """

    @abc.abstractmethod
    async def recv_into(self, buffer: Any, tag: int, *, timeout_s: float | None = None) -> None:
        """Receive the message with `tag` straight into `buffer` (writable, exactly its size).

        Raises TransferTimeout (endpoint aborted) if it has not fully arrived within
        `timeout_s`, PeerClosed if the peer went away, ProtocolError on a size mismatch.
        """

    @abc.abstractmethod
    def abort(self) -> None:
        """Close now without flushing; pending sends and receives are cancelled."""

    @abc.abstractmethod
    async def close(self) -> None:
        """Close after pending operations have had a chance to finish."""

    @property
    @abc.abstractmethod
    def closed(self) -> bool: ...

    async def send_msg(self, payload: bytes, tag: int, *, timeout_s: float | None = None) -> None:
        """Send a variable-size control message (length first, then bytes, both on `tag`)."""
        await self.send(_LEN.pack(len(payload)), tag, timeout_s=timeout_s)
        if payload:
            await self.send(payload, tag, timeout_s=timeout_s)

    async def recv_msg(self, tag: int, *, timeout_s: float | None = None, max_bytes: int = 64 << 20) -> bytes:
        """Receive a message sent with `send_msg`; ProtocolError if it exceeds `max_bytes`."""
        head = bytearray(_LEN.size)
        await self.recv_into(head, tag, timeout_s=timeout_s)
        (n,) = _LEN.unpack(head)
        if n > max_bytes:
            self.abort()
            raise ProtocolError(f"control message of {n} bytes from {self.peer} exceeds max_bytes={max_bytes}")
        body = bytearray(n)
        if n:
            await self.recv_into(body, tag, timeout_s=timeout_s)
        return bytes(body)


class Transport(abc.ABC):
    """One per process: an address peers can connect to, outgoing and incoming endpoints."""

    kind: str

    @abc.abstractmethod
    async def start(self) -> None:
        """Bind / initialise; after this `address()` is valid and peers may connect."""

    @abc.abstractmethod
    def address(self) -> bytes:
        """What a peer passes to `connect()` to reach us (exchanged over the control plane)."""

    @abc.abstractmethod
    async def connect(self, address: bytes, *, timeout_s: float = 10.0) -> Endpoint:
        """Open an endpoint to the peer at `address`; TransferTimeout if it does not answer."""

    @abc.abstractmethod
    async def accept(self, *, timeout_s: float | None = None) -> Endpoint:
        """The next endpoint a peer opened to us (waits up to `timeout_s`)."""

    @abc.abstractmethod
    async def close(self) -> None:
        """Stop accepting and abort every endpoint this transport made."""

    async def __aenter__(self) -> Transport:
        await self.start()
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.close()


class WrappedEndpoint(Endpoint):
    """An endpoint that delegates to `inner`; wrappers (link shaping, fault injection) override
    `send`."""

    def __init__(self, inner: Endpoint) -> None:
        self._inner = inner
        self.peer = inner.peer

    async def send(self, buffer: Any, tag: int, *, timeout_s: float | None = None) -> None:
        await self._inner.send(buffer, tag, timeout_s=timeout_s)

    async def recv_into(self, buffer: Any, tag: int, *, timeout_s: float | None = None) -> None:
        await self._inner.recv_into(buffer, tag, timeout_s=timeout_s)

    def abort(self) -> None:
        self._inner.abort()

    async def close(self) -> None:
        await self._inner.close()

    @property
    def closed(self) -> bool:
        return self._inner.closed


class WrappedTransport(Transport):
    """A transport that delegates to `inner` and wraps every endpoint with `wrap(endpoint)`."""

    def __init__(self, inner: Transport) -> None:
        self._inner = inner
        self.kind = inner.kind

    def wrap(self, endpoint: Endpoint) -> Endpoint:
        return endpoint

    async def start(self) -> None:
        await self._inner.start()

    def address(self) -> bytes:
        return self._inner.address()

    async def connect(self, address: bytes, *, timeout_s: float = 10.0) -> Endpoint:
        return self.wrap(await self._inner.connect(address, timeout_s=timeout_s))

    async def accept(self, *, timeout_s: float | None = None) -> Endpoint:
        return self.wrap(await self._inner.accept(timeout_s=timeout_s))

    async def close(self) -> None:
        await self._inner.close()


def address_label(address: bytes) -> str:
    """A short printable name for an address, for logs and per-source statistics."""
    try:
        kind = address_kind(address)
    except ValueError:
        return "invalid:" + bytes(address[:8]).hex()
    if kind == "tcp":
        try:
            d = json.loads(bytes(address[4:]))
            return f"tcp://{d['host']}:{d['port']}"
        except (ValueError, KeyError, TypeError):
            return "tcp:" + bytes(address[4:24]).hex()

    return "ucx:" + hashlib.blake2b(bytes(address), digest_size=4).hexdigest()
