"""Small helpers shared by the servicers and clients of the mesh."""

from __future__ import annotations

from typing import Final

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


class ProcessIdentity:
    """The default of `channel(identity=...)`: the identity this process runs as."""


PROCESS_IDENTITY: Final = ProcessIdentity()


def channel(
    address: str, peer: str | None = None, *, identity: Identity | None | ProcessIdentity = PROCESS_IDENTITY
) -> grpc.aio.Channel:
    """A channel to the mesh service at `address` whose certificate must name the role `peer`.

    mTLS with `identity` as the client certificate (by default this process's, set by serve()
    or the launcher); plaintext when that is None (a development mesh started with --insecure,
    or in-process test servers).
    """
    ident = process_identity() if isinstance(identity, ProcessIdentity) else identity
    if ident is None:
        return grpc.aio.insecure_channel(address, options=CHANNEL_OPTIONS)
    if peer is None:
        raise ValueError(f"a TLS channel to {address!r} needs the role its server certificate must name (peer=...)")
    return grpc.aio.secure_channel(
        address, ident.channel_credentials(), options=CHANNEL_OPTIONS + secure_channel_options(peer)
    )
