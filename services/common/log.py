"""structlog set-up, done once per process in its __main__."""

from __future__ import annotations

import logging
import sys

import structlog


def configure_logging(service: str, level: str = "info", json: bool = False) -> None:
    """Key=value (or JSON) events on stderr, each tagged with the service name."""
    log_level = getattr(logging, level.upper())
    logging.basicConfig(stream=sys.stderr, level=log_level, format="%(message)s")
    renderer: structlog.typing.Processor = (
        structlog.processors.JSONRenderer()
        if json
        else structlog.processors.KeyValueRenderer(key_order=["ts", "level", "service", "event"], drop_missing=True)
    )
    structlog.configure(
        processors=[
            structlog.contextvars.merge_contextvars,
            structlog.processors.add_log_level,
            structlog.processors.TimeStamper(fmt="iso", key="ts"),
            structlog.processors.format_exc_info,
            renderer,
        ],
        wrapper_class=structlog.make_filtering_bound_logger(log_level),
        logger_factory=structlog.PrintLoggerFactory(file=sys.stderr),
        cache_logger_on_first_use=True,
    )
    structlog.contextvars.bind_contextvars(service=service)
