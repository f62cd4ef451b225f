"""Parameter manager: the global parameter pool.

Usage: python -m services.param_manager --model-dir models [--port 0] [--port-file F]
Every sub-directory of --model-dir with a config.json is registered under its name.
"""

from __future__ import annotations

import asyncio

from services.common.config import load_config
from services.common.log import configure_logging
from services.common.server import serve
from services.param_manager.service import ParamManagerConfig, ParamManagerService


def main(argv: list[str] | None = None) -> None:
    cfg = load_config(ParamManagerConfig, "param_manager", argv, description=__doc__)
    configure_logging("param_manager", cfg.log_level, cfg.log_json)
    asyncio.run(serve(ParamManagerService(cfg), cfg))


if __name__ == "__main__":
    main()
