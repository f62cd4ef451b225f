"""Peer authentication of the data plane: no endpoint reaches a protocol until both sides proved
they hold the mesh's data plane key.

The data plane (UCX, or its TCP fallback) does not run over the gRPC channels' mTLS, so it
authenticates every connection itself, in one place for every protocol on it (parameter
chains, host-cache pulls, KV hand-offs, ZigZag relays): `AuthenticatedTransport` wraps a
transport and runs a mutual challenge-response on a tag of its own before handing an endpoint
up, for connections made and accepted alike:

    acceptor -> connector   "BMDP1" + nonce_a                  (32 random bytes)
    connector -> acceptor   HMAC(key, "connector" + nonce_a) + nonce_c
    acceptor -> connector   HMAC(key, "acceptor" + nonce_c)

A peer that fails (no answer within `timeout_s`, a wrong MAC) is aborted and logged; it never
sees a byte of a parameter group or a KV block, and a connection that stays silent does not
hold up the others (each handshake is its own task). The key is a 256-bit secret made with the
certificates (services/common/pki.py, `dataplane.key`, 0600); a fresh nonce per connection
means a recorded handshake cannot be replayed. Confidentiality is not provided: the bytes are
parameters and KV blocks, on the mesh's own network (docs/security.md).
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import hmac
import secrets
from typing import Final

import structlog
from prometheus_client import Counter

from services.common.waiting import wait_for

from .errors import PeerClosed, ProtocolError, TransferTimeout, TransportError
from .transport import MAX_TAG, Endpoint, Transport, WrappedTransport

__all__ = ["AUTH_TAG", "AuthenticatedTransport", "DataPlaneAuthError"]

log = structlog.get_logger(__name__)

# The handshake's tag: the highest one, which no protocol's stream reaches before it is done.
AUTH_TAG: Final = MAX_TAG
_HELLO: Final = b"BMDP1"
_NONCE_BYTES: Final = 32
_MAC_BYTES: Final = hashlib.sha256().digest_size

REFUSED = Counter(
    "blitzmesh_dataplane_auth_refused_total", "Data plane connections refused by the peer check", ["side"]
)


class DataPlaneAuthError(ProtocolError):
    """A data plane peer did not prove it holds the mesh's key."""


def _mac(key: bytes, side: bytes, nonce: bytes) -> bytes:
    return hmac.new(key, side + nonce, hashlib.sha256).digest()


class AuthenticatedTransport(WrappedTransport):
    """`inner` whose endpoints, made or accepted, are handed up only after the mutual handshake."""

    def __init__(self, inner: Transport, key: bytes, *, timeout_s: float = 5.0) -> None:
        super().__init__(inner)
        self._key = key
        self._timeout_s = timeout_s
        self._accepted: asyncio.Queue[Endpoint] = asyncio.Queue()
        self._pump: asyncio.Task[None] | None = None
        self._handshakes: set[asyncio.Task[None]] = set()
        self.refused = 0

    async def start(self) -> None:
        await super().start()
        if self._pump is None:
            self._pump = asyncio.get_running_loop().create_task(self._accept_loop(), name="dataplane-auth-accept")

    async def _accept_loop(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            ep = await self._inner.accept()
            task = loop.create_task(self._admit(ep), name=f"dataplane-auth-{ep.peer}")
            self._handshakes.add(task)
            task.add_done_callback(self._handshakes.discard)

    async def _admit(self, ep: Endpoint) -> None:
        try:
            await self._prove_as_acceptor(ep)
        except (TransportError, TimeoutError, OSError) as exc:
            self.refused += 1
            REFUSED.labels("acceptor").inc()
            log.warning("dataplane_peer_refused", peer=ep.peer, error=str(exc))
            ep.abort()
            return
        await self._accepted.put(ep)

    async def _prove_as_acceptor(self, ep: Endpoint) -> None:
        t = self._timeout_s
        nonce_a = secrets.token_bytes(_NONCE_BYTES)
        await ep.send_msg(_HELLO + nonce_a, AUTH_TAG, timeout_s=t)
        answer = await ep.recv_msg(AUTH_TAG, timeout_s=t, max_bytes=_MAC_BYTES + _NONCE_BYTES)
        if len(answer) != _MAC_BYTES + _NONCE_BYTES:
            raise DataPlaneAuthError(f"{ep.peer}: handshake answer of {len(answer)} bytes")
        mac, nonce_c = answer[:_MAC_BYTES], answer[_MAC_BYTES:]
        if not hmac.compare_digest(mac, _mac(self._key, b"connector", nonce_a)):
            raise DataPlaneAuthError(f"{ep.peer} does not hold the mesh's data plane key (wrong MAC)")
        await ep.send_msg(_mac(self._key, b"acceptor", nonce_c), AUTH_TAG, timeout_s=t)

    async def connect(self, address: bytes, *, timeout_s: float = 10.0) -> Endpoint:
        ep = await self._inner.connect(address, timeout_s=timeout_s)
        t = min(self._timeout_s, timeout_s)
        try:
            hello = await ep.recv_msg(AUTH_TAG, timeout_s=t, max_bytes=len(_HELLO) + _NONCE_BYTES)
            if not hello.startswith(_HELLO) or len(hello) != len(_HELLO) + _NONCE_BYTES:
                raise DataPlaneAuthError(f"{ep.peer}: not a data plane handshake: {hello[:8]!r}")
            nonce_c = secrets.token_bytes(_NONCE_BYTES)
            await ep.send_msg(_mac(self._key, b"connector", hello[len(_HELLO) :]) + nonce_c, AUTH_TAG, timeout_s=t)
            proof = await ep.recv_msg(AUTH_TAG, timeout_s=t, max_bytes=_MAC_BYTES)
            if not hmac.compare_digest(proof, _mac(self._key, b"acceptor", nonce_c)):
                raise DataPlaneAuthError(f"{ep.peer} does not hold the mesh's data plane key (wrong MAC)")
        except BaseException as exc:
            ep.abort()
            if isinstance(exc, DataPlaneAuthError):
                REFUSED.labels("connector").inc()
            elif isinstance(exc, TransferTimeout | PeerClosed):
                # A peer that accepts and then refuses us closes the endpoint: the same failure
                # as a dead peer to the caller, which falls back as it does for one (chain.py).
                raise type(exc)(f"data plane handshake with {ep.peer} failed: {exc}") from exc
            raise
        return self.wrap(ep)

    async def accept(self, *, timeout_s: float | None = None) -> Endpoint:
        try:
            return self.wrap(await wait_for(self._accepted.get(), timeout_s))
        except TimeoutError:
            raise TransferTimeout(f"no authenticated incoming connection within {timeout_s}s") from None

    async def close(self) -> None:
        tasks = [t for t in (self._pump, *self._handshakes) if t is not None]
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        self._pump = None
        while not self._accepted.empty():
            with contextlib.suppress(Exception):
                self._accepted.get_nowait().abort()
        await super().close()
