"""Blitzmesh gateway: the public OpenAI-compatible HTTP API and the SDK's gRPC API.

Usage:
    python -m services.gateway --global-manager HOST:PORT --param-manager HOST:PORT \
        [--port 50051] [--http-host 127.0.0.1] [--http-port 8000] \
        [--api-keys '["sk-..."]'] [--admin-api-keys '["adm-..."]'] [--no-admin-allow-loopback] \
        [--max-concurrency 256] [--max-queue 1024] [--port-file F]

Admin calls (GetCluster, Scale, SetPolicy, WatchEvents) need an admin key; with none configured
they are served to loopback callers only.

Every option can also come from `--config FILE` (JSON or TOML) or BLITZMESH_GATEWAY_<OPTION>.
Ready when the gRPC health service reports SERVING (both managers reachable).
"""

from __future__ import annotations

import asyncio

from services.common.config import load_config
from services.common.log import configure_logging
from services.common.server import serve
from services.gateway.config import GatewayConfig
from services.gateway.service import GatewayService


def main(argv: list[str] | None = None) -> None:
    cfg = load_config(GatewayConfig, "gateway", argv, description=__doc__)
    configure_logging("gateway", cfg.log_level, cfg.log_json)
    asyncio.run(serve(GatewayService(cfg), cfg))


if __name__ == "__main__":
    main()
