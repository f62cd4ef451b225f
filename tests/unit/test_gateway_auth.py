"""The gateway's admin boundary without sockets: who may make an admin call (an admin key, or a
loopback peer while none is configured), the peer check, the config's key checks, the compose
files' gateway environment and the SDK's admin-key argument."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import grpc
import pytest
import yaml

from blitzmesh import AsyncClient
from blitzmesh.client import ADMIN_API_KEY_ENV
from services.common.config import load_config
from services.gateway.auth import check_admin, check_bearer, is_loopback_peer, masked, peer_host
from services.gateway.config import GatewayConfig
from services.gateway.errors import ErrorKind, GatewayError

ROOT = Path(__file__).resolve().parents[2]
INFERENCE_KEY = "sk-inference-key-0001"
ADMIN_KEY = "adm-operator-key-0001"
LOCAL = "ipv4:127.0.0.1:50123"
REMOTE = "ipv4:10.1.2.3:50123"


def refused(fn: Callable[..., None], *args: Any, **kwargs: Any) -> GatewayError:
    with pytest.raises(GatewayError) as info:
        fn(*args, **kwargs)
    return info.value


def admin(authorization: str | None, peer: str, *, admin_keys: tuple[str, ...] = (), loopback: bool = True) -> None:
    check_admin(authorization, peer, admin_api_keys=admin_keys, api_keys=(INFERENCE_KEY,), allow_loopback=loopback)


# ---- the peer check ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("peer", "local"),
    [
        ("ipv4:127.0.0.1:50123", True),
        ("ipv4:127.8.9.10:1", True),  # all of 127.0.0.0/8
        ("ipv6:%5B::1%5D:50123", True),  # as grpc spells it: brackets percent-encoded
        ("ipv6:[::1]:50123", True),
        ("ipv6:%5B::ffff:127.0.0.1%5D:50123", True),  # IPv4-mapped loopback
        ("unix:/run/blitzmesh.sock", True),
        ("ipv4:10.1.2.3:50123", False),
        ("ipv4:172.17.0.1:50123", False),  # the Docker bridge: a published port looks like this
        ("ipv4:0.0.0.0:1", False),
        ("ipv6:%5Bfe80::1%5D:50123", False),
        ("ipv6:%5B::ffff:10.0.0.1%5D:50123", False),
        ("ipv4:localhost:50123", False),  # never a name: grpc gives addresses
        ("", False),
        ("garbage", False),
    ],
)
def test_loopback_peer(peer: str, local: bool) -> None:
    assert is_loopback_peer(peer) is local


def test_peer_host_is_the_address_alone() -> None:
    assert peer_host("ipv4:10.1.2.3:50123") == "10.1.2.3"
    assert peer_host("ipv6:%5Bfe80::1%5D:50123") == "fe80::1"
    assert peer_host("unix:/run/x.sock") == "unix:/run/x.sock"


# ---- admin calls ------------------------------------------------------------------------------


def test_without_admin_keys_loopback_is_allowed_with_or_without_a_key() -> None:
    admin(None, LOCAL)
    admin(f"Bearer {INFERENCE_KEY}", "ipv6:%5B::1%5D:1")  # loopback is what lets it in, not the key
    admin(None, "unix:/run/x.sock")


def test_without_admin_keys_a_remote_caller_is_refused_saying_what_is_missing() -> None:
    err = refused(admin, None, REMOTE)
    assert err.kind is ErrorKind.FORBIDDEN and err.kind.grpc_code == grpc.StatusCode.PERMISSION_DENIED
    assert "from '10.1.2.3'" in err.message and "only from loopback" in err.message
    assert "admin_api_keys" in err.message and "--admin-api-keys" in err.message
    assert ADMIN_API_KEY_ENV in err.message  # how the SDK sends one
    assert "inference API key" not in err.message


def test_an_inference_key_never_authorizes_a_remote_admin_call() -> None:
    err = refused(admin, f"Bearer {INFERENCE_KEY}", REMOTE)
    assert err.kind is ErrorKind.FORBIDDEN
    assert f"the key sent, {masked(INFERENCE_KEY)!r}, is an inference API key" in err.message
    assert INFERENCE_KEY not in err.message


def test_with_admin_loopback_off_loopback_is_refused_too() -> None:
    err = refused(admin, None, LOCAL, loopback=False)
    assert err.kind is ErrorKind.FORBIDDEN and "admin_allow_loopback is off" in err.message


def test_an_admin_key_is_accepted_from_anywhere() -> None:
    for peer in (LOCAL, REMOTE):
        admin(f"Bearer {ADMIN_KEY}", peer, admin_keys=("adm-other-key-9999", ADMIN_KEY))
        admin(f"bearer   {ADMIN_KEY} ", peer, admin_keys=(ADMIN_KEY,))


def test_with_admin_keys_every_admin_call_needs_one_loopback_included() -> None:
    for peer in (LOCAL, REMOTE):
        err = refused(admin, None, peer, admin_keys=(ADMIN_KEY,))
        assert err.kind is ErrorKind.UNAUTHENTICATED and err.message.startswith("missing admin API key")
        assert "authorization: Bearer <admin key>" in err.message


def test_with_admin_keys_an_inference_key_is_permission_denied_and_masked() -> None:
    err = refused(admin, f"Bearer {INFERENCE_KEY}", LOCAL, admin_keys=(ADMIN_KEY,))
    assert err.kind is ErrorKind.FORBIDDEN
    assert err.message.startswith(f"API key {masked(INFERENCE_KEY)!r} is an inference API key")
    assert INFERENCE_KEY not in err.message


def test_with_admin_keys_an_unknown_or_malformed_key_is_unauthenticated() -> None:
    err = refused(admin, "Bearer adm-wrong-but-long", REMOTE, admin_keys=(ADMIN_KEY,))
    assert err.kind is ErrorKind.UNAUTHENTICATED and "invalid admin API key 'adm...ng'" in err.message
    assert "adm-wrong-but-long" not in err.message
    err = refused(admin, f"Basic {ADMIN_KEY}", REMOTE, admin_keys=(ADMIN_KEY,))
    assert err.kind is ErrorKind.UNAUTHENTICATED and "'Bearer <key>'" in err.message


# ---- inference calls --------------------------------------------------------------------------


def test_an_admin_key_does_not_authorize_inference() -> None:
    check_bearer(f"Bearer {INFERENCE_KEY}", [INFERENCE_KEY], [ADMIN_KEY])
    check_bearer(None, [], [ADMIN_KEY])  # no inference keys: inference stays open, as before
    err = refused(check_bearer, f"Bearer {ADMIN_KEY}", [INFERENCE_KEY], [ADMIN_KEY])
    assert err.kind is ErrorKind.FORBIDDEN and err.kind.http_status == 403
    assert f"{masked(ADMIN_KEY)!r} is an admin key" in err.message and ADMIN_KEY not in err.message
    err = refused(check_bearer, "Bearer sk-unknown-key-1", [INFERENCE_KEY], [ADMIN_KEY])
    assert err.kind is ErrorKind.UNAUTHENTICATED


def test_forbidden_maps_to_403_and_permission_denied() -> None:
    assert ErrorKind.FORBIDDEN.http_status == 403
    assert ErrorKind.FORBIDDEN.grpc_code == grpc.StatusCode.PERMISSION_DENIED
    assert GatewayError(ErrorKind.FORBIDDEN, "x").openai_body()["error"]["type"] == "permission_error"


# ---- config -----------------------------------------------------------------------------------


def test_admin_keys_come_from_flags_and_the_environment() -> None:
    cfg = load_config(GatewayConfig, "gateway", ["--admin-api-keys", f'["{ADMIN_KEY}"]'], env={})
    assert cfg.admin_api_keys == [ADMIN_KEY] and cfg.admin_allow_loopback
    env = {"BLITZMESH_GATEWAY_ADMIN_API_KEYS": f'["{ADMIN_KEY}"]', "BLITZMESH_GATEWAY_ADMIN_ALLOW_LOOPBACK": "false"}
    cfg = load_config(GatewayConfig, "gateway", [], env=env)
    assert cfg.admin_api_keys == [ADMIN_KEY] and not cfg.admin_allow_loopback
    defaults = GatewayConfig()
    assert defaults.admin_api_keys == [] and defaults.admin_allow_loopback


@pytest.mark.parametrize(
    ("fields", "needle"),
    [
        ({"admin_api_keys": [" "]}, "admin_api_keys holds an empty key"),
        ({"admin_api_keys": [f" {ADMIN_KEY}"]}, "admin_api_keys holds keys with surrounding whitespace: [' ad...01']"),
        ({"api_keys": [ADMIN_KEY], "admin_api_keys": [ADMIN_KEY]}, "keys ['adm...01'] are in both api_keys and"),
    ],
)
def test_bad_keys_are_refused_quoting_them_masked(fields: dict[str, Any], needle: str) -> None:
    with pytest.raises(ValueError) as info:
        GatewayConfig(**fields)
    assert needle in str(info.value)
    assert ADMIN_KEY not in str(info.value)


def test_a_bad_key_on_the_command_line_is_reported_without_the_keys() -> None:
    argv = ["--api-keys", f'["{INFERENCE_KEY}", "{ADMIN_KEY}"]', "--admin-api-keys", f'["{ADMIN_KEY}"]']
    with pytest.raises(SystemExit) as info:
        load_config(GatewayConfig, "gateway", argv, env={})
    message = str(info.value)
    assert message.startswith("invalid gateway config: Value error, keys ['adm...01'] are in both")
    assert ADMIN_KEY not in message and INFERENCE_KEY not in message


def test_compose_gateways_take_admin_keys_from_the_environment() -> None:
    services = yaml.safe_load((ROOT / "docker-compose.yml").read_text())["services"]
    gateways = {name: svc for name, svc in services.items() if svc["command"][2] == "services.gateway"}
    assert set(gateways) == {"gateway", "gateway-disagg"}
    for name, svc in gateways.items():
        assert svc["environment"] == {"BLITZMESH_GATEWAY_ADMIN_API_KEYS": "${BLITZMESH_GATEWAY_ADMIN_API_KEYS:-[]}"}, (
            name
        )
        # Unset, compose substitutes the default: no admin keys, admin calls from inside only.
        cfg = load_config(GatewayConfig, "gateway", svc["command"][3:], env={"BLITZMESH_GATEWAY_ADMIN_API_KEYS": "[]"})
        assert cfg.admin_api_keys == [] and cfg.host == "0.0.0.0"


# ---- the SDK ----------------------------------------------------------------------------------


@pytest.mark.parametrize("bad", ["", " adm-key", 42])
def test_sdk_admin_key_is_validated_without_quoting_it(bad: object) -> None:
    with pytest.raises(ValueError) as info:
        AsyncClient(admin_api_key=bad)  # type: ignore[arg-type]
    message = str(info.value)
    assert message.startswith("admin_api_key must be a non-empty string without surrounding whitespace, got a ")
    assert "adm-key" not in message


def test_sdk_admin_key_env_var_is_validated_naming_it(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(ADMIN_API_KEY_ENV, "adm-key-with-newline\n")
    with pytest.raises(ValueError) as info:
        AsyncClient()
    assert f"the environment variable {ADMIN_API_KEY_ENV} must be a non-empty string" in str(info.value)
    assert "adm-key" not in str(info.value)
    monkeypatch.setenv(ADMIN_API_KEY_ENV, "")
    AsyncClient()  # empty: no admin key
