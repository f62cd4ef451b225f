"""Global manager: instance registry, load monitor, scale planner and execution scheduler.

Usage: python -m services.global_manager --param-manager HOST:PORT [--default-model M]
       [--min-instances N] [--autoscale] [--policy heteroscale] [--port 0] [--port-file F]

After a restart it rebuilds its registry from worker re-registration (workers heartbeat,
hear `reregister`, and announce themselves in their current state).
"""

from __future__ import annotations

import asyncio

from services.common.config import load_config
from services.common.log import configure_logging
from services.common.server import serve
from services.global_manager.config import GlobalManagerConfig
from services.global_manager.service import GlobalManagerService


def main(argv: list[str] | None = None) -> None:
    cfg = load_config(GlobalManagerConfig, "global_manager", argv, description=__doc__)
    configure_logging("global_manager", cfg.log_level, cfg.log_json)
    asyncio.run(serve(GlobalManagerService(cfg), cfg))


if __name__ == "__main__":
    main()
