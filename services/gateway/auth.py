"""Bearer-key check shared by the HTTP and gRPC front ends."""

from __future__ import annotations

import hmac
from collections.abc import Sequence

from services.gateway.errors import ErrorKind, GatewayError


def _masked(key: str) -> str:
    # Enough of the key to tell which one was sent, not enough to reuse it.
    return f"{key[:3]}...{key[-2:]}" if len(key) > 8 else "***"


def check_bearer(authorization: str | None, api_keys: Sequence[str]) -> None:
    """Accept when no keys are configured or `authorization` is "Bearer <one of the keys>"."""
    if not api_keys:
        return
    if not authorization:
        raise GatewayError(
            ErrorKind.UNAUTHENTICATED,
            "missing API key: send the header 'Authorization: Bearer <key>'",
            code="invalid_api_key",
        )
    scheme, _, key = authorization.strip().partition(" ")
    key = key.strip()
    if scheme.lower() != "bearer" or not key:
        raise GatewayError(
            ErrorKind.UNAUTHENTICATED,
            f"the authorization header must be 'Bearer <key>', got scheme {scheme[:16]!r}",
            code="invalid_api_key",
        )
    # Compare against every key (no early exit) so timing does not reveal which prefix matched.
    matched = False
    for candidate in api_keys:
        matched |= hmac.compare_digest(candidate.encode(), key.encode())
    if not matched:
        raise GatewayError(ErrorKind.UNAUTHENTICATED, f"invalid API key {_masked(key)!r}", code="invalid_api_key")
