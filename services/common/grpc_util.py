"""Small helpers shared by the servicers and clients of the mesh."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any, Final

import grpc

from services.common.security import Identity, process_identity, secure_channel_options

CHANNEL_OPTIONS = [
    ("grpc.max_send_message_length", 64 * 1024 * 1024),
    ("grpc.max_receive_message_length", 64 * 1024 * 1024),
    ("grpc.keepalive_time_ms", 10_000),
    ("grpc.keepalive_timeout_ms", 5_000),
    # gRPC's default reconnect backoff grows to 120 s: a manager or worker that restarts at the
    # same address would be refused for minutes. Cap it so peers see the comeback in seconds.
    ("grpc.initial_reconnect_backoff_ms", 200),
    ("grpc.max_reconnect_backoff_ms", 2000),
]

# Trailing metadata of a worker's Generate that ended ABORTED because the request was released
# to another instance (rebalancing), not because anything failed; its value is the reason.
MOVED_METADATA_KEY = "blitzmesh-moved"
# Trailing metadata of a RESOURCE_EXHAUSTED status refusing a request for its latency objective
# (a worker's Generate, the gateway's Inference calls): seconds until room is expected, and the
# objective ("ttft" or "tpot"). The SDK reads the same keys (blitzmesh.errors).
RETRY_AFTER_METADATA_KEY = "retry-after-s"
SLO_METADATA_KEY = "slo-kind"
# How long a channel replaced after a certificate renewal lets its calls run before it closes.
RETIRED_CHANNEL_GRACE_S = 600.0


class ProcessIdentity:
    """The default of `channel(identity=...)`: the identity this process runs as."""


PROCESS_IDENTITY: Final = ProcessIdentity()


def channel(
    address: str, peer: str | None = None, *, identity: Identity | None | ProcessIdentity = PROCESS_IDENTITY
) -> grpc.aio.Channel:
    """A channel to the mesh service at `address` whose certificate must name the role `peer`.

    mTLS with `identity` as the client certificate (by default this process's, set by serve()
    or the launcher: then a `RenewingChannel`, which presents a renewed certificate from its
    next call on); plaintext when that is None (a development mesh started with --insecure, or
    in-process test servers).
    """
    ident = process_identity() if isinstance(identity, ProcessIdentity) else identity
    if ident is None:
        return grpc.aio.insecure_channel(address, options=CHANNEL_OPTIONS)
    if peer is None:
        raise ValueError(f"a TLS channel to {address!r} needs the role its server certificate must name (peer=...)")
    if isinstance(identity, ProcessIdentity):
        return RenewingChannel(address, peer, process_identity)
    return _secure_channel(address, peer, ident)


def _secure_channel(address: str, peer: str, identity: Identity) -> grpc.aio.Channel:
    return grpc.aio.secure_channel(
        address, identity.channel_credentials(), options=CHANNEL_OPTIONS + secure_channel_options(peer)
    )


class RenewingChannel(grpc.aio.Channel):
    """A channel that follows the process's certificate: a call made after the identity changed
    (`security.IdentityWatch`: the files were renewed on disk) goes over a new channel with the
    new certificate, and the old one closes once its calls have ended (at most
    `RETIRED_CHANNEL_GRACE_S`). Stubs made on it once keep working: each multi-callable picks the
    channel at call time."""

    def __init__(self, address: str, peer: str, identity: Callable[[], Identity | None]) -> None:
        self._address = address
        self._peer = peer
        self._identity_now = identity
        ident = identity()
        assert ident is not None, "a RenewingChannel needs an identity"
        self._identity = ident
        self._channel = _secure_channel(address, peer, ident)
        self._retiring: dict[asyncio.Task[None], grpc.aio.Channel] = {}
        self._closed = False

    def current(self) -> grpc.aio.Channel:
        """The channel for a call made now (a new one if the certificate was renewed)."""
        ident = self._identity_now()
        if ident is not None and ident is not self._identity and not self._closed:
            old = self._channel
            self._identity, self._channel = ident, _secure_channel(self._address, self._peer, ident)
            task = asyncio.get_running_loop().create_task(
                old.close(RETIRED_CHANNEL_GRACE_S), name=f"retire-channel-{self._address}"
            )
            self._retiring[task] = old
            task.add_done_callback(self._retired)
        return self._channel

    def _retired(self, task: asyncio.Task[None]) -> None:
        self._retiring.pop(task, None)
        if not task.cancelled():
            task.exception()  # seen: closing is best effort, its calls have ended or were cancelled

    async def __aenter__(self) -> RenewingChannel:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.close(None)

    async def close(self, grace: float | None = None) -> None:
        self._closed = True
        retiring = list(self._retiring.items())
        for task, _ in retiring:
            task.cancel()
        await asyncio.gather(*(t for t, _ in retiring), return_exceptions=True)
        for _, old in retiring:
            await old.close(None)
        await self._channel.close(grace)

    def get_state(self, try_to_connect: bool = False) -> grpc.ChannelConnectivity:
        return self.current().get_state(try_to_connect)

    async def wait_for_state_change(self, last_observed_state: grpc.ChannelConnectivity) -> None:
        await self.current().wait_for_state_change(last_observed_state)

    async def channel_ready(self) -> None:
        await self.current().channel_ready()

    def unary_unary(self, method: str, *args: Any, **kwargs: Any) -> Any:
        return _RenewingMultiCallable(self, "unary_unary", method, args, kwargs)

    def unary_stream(self, method: str, *args: Any, **kwargs: Any) -> Any:
        return _RenewingMultiCallable(self, "unary_stream", method, args, kwargs)

    def stream_unary(self, method: str, *args: Any, **kwargs: Any) -> Any:
        return _RenewingMultiCallable(self, "stream_unary", method, args, kwargs)

    def stream_stream(self, method: str, *args: Any, **kwargs: Any) -> Any:
        return _RenewingMultiCallable(self, "stream_stream", method, args, kwargs)


class _RenewingMultiCallable:
    """A stub's method on a `RenewingChannel`: made again on the channel of the moment."""

    def __init__(
        self, owner: RenewingChannel, kind: str, method: str, args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> None:
        self._owner, self._kind, self._method, self._args, self._kwargs = owner, kind, method, args, kwargs
        self._on: grpc.aio.Channel | None = None
        self._callable: Any = None

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        ch = self._owner.current()
        if ch is not self._on:
            self._on = ch
            self._callable = getattr(ch, self._kind)(self._method, *self._args, **self._kwargs)
        return self._callable(*args, **kwargs)
