"""Worker: one per accelerator; runs the model with continuous batching.

Usage: python -m services.worker --global-manager HOST:PORT --param-manager HOST:PORT
       [--instance-id ID] [--port 0] [--port-file F] [--preload-model MODEL]

Starts IDLE, registers with the global manager and heartbeats its load; weights arrive from
the parameter manager when the manager calls LoadParameters.
"""

from __future__ import annotations

import asyncio

from services.common.config import load_config
from services.common.log import configure_logging
from services.common.server import serve
from services.worker.config import WorkerConfig
from services.worker.service import WorkerService


def main(argv: list[str] | None = None) -> None:
    cfg = load_config(WorkerConfig, "worker", argv, description=__doc__)
    configure_logging("worker", cfg.log_level, cfg.log_json)
    asyncio.run(serve(WorkerService(cfg), cfg))


if __name__ == "__main__":
    main()
