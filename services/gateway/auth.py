"""Bearer-key checks shared by the HTTP and gRPC front ends: inference keys for the serving API,
admin keys (or, while none are configured, a loopback peer) for the calls that change or reveal
the cluster. Pure functions: the caller passes the header, the peer and the configured keys."""

from __future__ import annotations

import hmac
import ipaddress
from collections.abc import Sequence
from urllib.parse import unquote

from services.gateway.errors import ErrorKind, GatewayError

ADMIN_KEY_HINT = (
    "send the metadata 'authorization: Bearer <admin key>' (SDK: AsyncClient(admin_api_key=...) or "
    "the BLITZMESH_ADMIN_API_KEY environment variable)"
)
_CONFIGURE_ADMIN_KEYS = "configure admin_api_keys (--admin-api-keys '[\"<key>\"]' or BLITZMESH_GATEWAY_ADMIN_API_KEYS)"


def masked(key: str) -> str:
    """Enough of a key to tell which one was sent, not enough to reuse it."""
    return f"{key[:3]}...{key[-2:]}" if len(key) > 8 else "***"


def _bearer_key(authorization: str | None) -> str | None:
    """The key of an 'Authorization: Bearer <key>' value; None when no header was sent."""
    if not authorization:
        return None
    scheme, _, key = authorization.strip().partition(" ")
    key = key.strip()
    if scheme.lower() != "bearer" or not key:
        raise GatewayError(
            ErrorKind.UNAUTHENTICATED,
            f"the authorization header must be 'Bearer <key>', got scheme {scheme[:16]!r}",
            code="invalid_api_key",
        )
    return key


def _matches(key: str, keys: Sequence[str]) -> bool:
    # Compare against every key (no early exit) so timing does not reveal which prefix matched.
    matched = False
    for candidate in keys:
        matched |= hmac.compare_digest(candidate.encode(), key.encode())
    return matched


def check_bearer(authorization: str | None, api_keys: Sequence[str], admin_api_keys: Sequence[str] = ()) -> None:
    """Inference calls: accept when no keys are configured or `authorization` is
    "Bearer <one of api_keys>". An admin key is refused here (one key, one role), with a
    message saying so rather than "invalid"."""
    if not api_keys:
        return
    key = _bearer_key(authorization)
    if key is None:
        raise GatewayError(
            ErrorKind.UNAUTHENTICATED,
            "missing API key: send the header 'Authorization: Bearer <key>'",
            code="invalid_api_key",
        )
    if _matches(key, api_keys):
        return
    if _matches(key, admin_api_keys):
        raise GatewayError(
            ErrorKind.FORBIDDEN,
            f"API key {masked(key)!r} is an admin key; inference calls need one of the gateway's api_keys",
            code="invalid_api_key",
        )
    raise GatewayError(ErrorKind.UNAUTHENTICATED, f"invalid API key {masked(key)!r}", code="invalid_api_key")


def peer_host(peer: str) -> str:
    """The address part of a gRPC peer string ('ipv4:10.0.0.5:5123', 'ipv6:%5B::1%5D:5123')."""
    scheme, _, rest = peer.partition(":")
    if scheme not in ("ipv4", "ipv6"):
        return peer
    # grpc percent-encodes the brackets of IPv6 addresses.
    return unquote(rest).rpartition(":")[0].strip("[]")


def is_loopback_peer(peer: str) -> bool:
    """True for a caller on this machine: 127.0.0.0/8, ::1 (also IPv4-mapped), or a Unix socket,
    which only local processes can open. Anything unparsable counts as remote."""
    scheme = peer.partition(":")[0]
    if scheme in ("unix", "unix-abstract"):
        return True
    if scheme not in ("ipv4", "ipv6"):
        return False
    try:
        address = ipaddress.ip_address(peer_host(peer))
    except ValueError:
        return False
    if isinstance(address, ipaddress.IPv6Address) and address.ipv4_mapped is not None:
        return address.ipv4_mapped.is_loopback
    return address.is_loopback


def check_admin(
    authorization: str | None,
    peer: str,
    *,
    admin_api_keys: Sequence[str],
    api_keys: Sequence[str],
    allow_loopback: bool,
) -> None:
    """Admin calls (GetCluster, Scale, SetPolicy, WatchEvents).

    With admin keys configured, every admin call needs one, loopback included (a reverse proxy
    on this host would otherwise make every caller local). Without them, only loopback peers
    are let in, and only while `allow_loopback`. An inference key never authorizes an admin
    call: it is refused with PERMISSION_DENIED naming it (masked)."""
    key = _bearer_key(authorization)
    inference_note = ""
    if key is not None and _matches(key, api_keys):
        inference_note = f"; the key sent, {masked(key)!r}, is an inference API key and never authorizes admin calls"
    if not admin_api_keys:
        if allow_loopback and is_loopback_peer(peer):
            return
        where = (
            f"from {peer_host(peer)!r}: the gateway has no admin_api_keys, so it accepts admin calls only from "
            "loopback (127.0.0.1, ::1)"
            if allow_loopback
            else "on this gateway: it has no admin_api_keys and admin_allow_loopback is off"
        )
        raise GatewayError(
            ErrorKind.FORBIDDEN,
            f"admin call refused {where}; {_CONFIGURE_ADMIN_KEYS} and {ADMIN_KEY_HINT}{inference_note}",
            code="admin_key_required",
        )
    if key is None:
        raise GatewayError(
            ErrorKind.UNAUTHENTICATED, f"missing admin API key: {ADMIN_KEY_HINT}", code="admin_key_required"
        )
    if _matches(key, admin_api_keys):
        return
    if inference_note:
        raise GatewayError(
            ErrorKind.FORBIDDEN,
            f"API key {masked(key)!r} is an inference API key; admin calls need one of the gateway's "
            f"admin_api_keys: {ADMIN_KEY_HINT}",
            code="admin_key_required",
        )
    raise GatewayError(
        ErrorKind.UNAUTHENTICATED, f"invalid admin API key {masked(key)!r}: {ADMIN_KEY_HINT}", code="invalid_api_key"
    )
