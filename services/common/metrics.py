"""Prometheus metrics endpoint, one per service process."""

from __future__ import annotations

from prometheus_client import start_http_server


def start_metrics_server(host: str, port: int) -> int:
    """Serve /metrics on `port` (0 picks a free port); returns the bound port."""
    httpd, _thread = start_http_server(port, addr=host)
    return int(httpd.server_port)
