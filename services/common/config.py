"""Validated service configuration from defaults, a file, the environment and the command line.

Environment variables are read here and nowhere else. Precedence, lowest first: field
defaults, `--config FILE` (JSON or TOML), `BLITZMESH_<SERVICE>_<FIELD>` variables, CLI flags.
"""

from __future__ import annotations

import argparse
import json
import os
import tomllib
import types
import typing
from pathlib import Path
from typing import Any, TypeVar

from pydantic import BaseModel, ConfigDict, Field, ValidationError

C = TypeVar("C", bound="ServiceConfig")


class ServiceConfig(BaseModel):
    """Fields every service has. Subclasses add their own, each with a description."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    host: str = Field("127.0.0.1", description="address the gRPC server binds to")
    port: int = Field(0, ge=0, le=65535, description="gRPC port; 0 picks a free one")
    metrics_port: int = Field(
        -1, ge=-1, le=65535, description="Prometheus /metrics port; 0 picks a free one, -1 disables"
    )
    health_port: int = Field(
        -1,
        ge=-1,
        le=65535,
        description="plaintext gRPC port serving only the health service, for probes that speak no TLS "
        "(kubelet's grpc probe); -1 disables",
    )
    port_file: Path | None = Field(
        None, description="write the bound ports as JSON here once serving (for launchers and tests)"
    )
    log_level: str = Field("info", pattern="^(debug|info|warning|error)$", description="log level")
    log_json: bool = Field(False, description="log JSON lines instead of key=value text")
    shutdown_grace_s: float = Field(5.0, ge=0, description="grace period for in-flight RPCs on stop")
    tls_dir: Path | None = Field(
        None,
        description="mTLS material: ca.pem and <role>.pem/<role>.key (python -m services.common.pki DIR makes them)",
    )
    insecure: bool = Field(
        False, description="DEVELOPMENT ONLY: plaintext gRPC, no caller checks (a warning is logged)"
    )
    reflection: bool = Field(
        False, description="serve gRPC reflection (to the admin role under mTLS; the gateway's public API always does)"
    )


def _is_bool(annotation: Any) -> bool:
    return annotation is bool


def _scalar_type(annotation: Any) -> Any:
    """The type a CLI string is parsed into; Optional[X] -> X, lists/dicts -> JSON."""
    origin = typing.get_origin(annotation)
    if origin in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(annotation) if a is not type(None)]
        return _scalar_type(args[0]) if len(args) == 1 else str
    if origin in (list, dict, tuple) or annotation in (list, dict):
        return json.loads
    if annotation in (int, float, str, Path):
        return annotation
    return str


def _read_file(path: Path) -> dict[str, Any]:
    try:
        text = path.read_text()
    except OSError as e:
        raise SystemExit(f"cannot read config file {str(path)!r}: {e.strerror}") from e
    try:
        data = tomllib.loads(text) if path.suffix == ".toml" else json.loads(text)
    except (ValueError, tomllib.TOMLDecodeError) as e:
        raise SystemExit(f"config file {str(path)!r} is not valid {path.suffix or 'JSON'}: {e}") from e
    if not isinstance(data, dict):
        raise SystemExit(f"config file {str(path)!r} must hold a table/object, got {type(data).__name__}")
    return data


def build_parser(cls: type[BaseModel], prog: str, description: str | None) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog=prog, description=description)
    parser.add_argument("--config", type=Path, help="JSON or TOML file with any of the options below")
    for name, field in cls.model_fields.items():
        flag = "--" + name.replace("_", "-")
        help_text = f"{field.description or ''} (default: {field.default!r})"
        if _is_bool(field.annotation):
            parser.add_argument(flag, dest=name, action=argparse.BooleanOptionalAction, default=None, help=help_text)
        else:
            parser.add_argument(flag, dest=name, type=_scalar_type(field.annotation), default=None, help=help_text)
    return parser


def load_config(
    cls: type[C],
    service: str,
    argv: list[str] | None = None,
    env: typing.Mapping[str, str] | None = None,
    description: str | None = None,
) -> C:
    """Build a validated config; exits with a message that quotes the bad value on error."""
    env = os.environ if env is None else env
    parser = build_parser(cls, f"python -m services.{service}", description)
    args = parser.parse_args(argv)
    values: dict[str, Any] = {}
    if args.config is not None:
        values.update(_read_file(args.config))
    prefix = f"BLITZMESH_{service.upper()}_"
    for name, field in cls.model_fields.items():
        raw = env.get(prefix + name.upper())
        if raw is None:
            continue
        if _is_bool(field.annotation):
            values[name] = raw.strip().lower() in ("1", "true", "yes", "on")
        else:
            try:
                values[name] = _scalar_type(field.annotation)(raw)
            except (ValueError, TypeError) as e:
                raise SystemExit(f"{prefix + name.upper()}={raw!r} is not valid: {e}") from e
    for name in cls.model_fields:
        value = getattr(args, name)
        if value is not None:
            values[name] = value
    try:
        return cls(**values)
    except ValidationError as e:
        # A model-level check (empty loc) gets the whole config as its input, secrets and all; its
        # message quotes the values it is about itself.
        problems = "; ".join(
            f"{'.'.join(str(p) for p in err['loc'])}={err.get('input')!r}: {err['msg']}" if err["loc"] else err["msg"]
            for err in e.errors()
        )
        raise SystemExit(f"invalid {service} config: {problems}") from e
