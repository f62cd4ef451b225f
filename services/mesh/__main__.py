"""Run the whole mesh as local processes: parameter manager, global manager, workers, gateway.

Usage: python -m services.mesh [--workers 2] [--model smollm2-135m-instruct] [--http-port 8000] [--grpc-port 50051]

Fetches and converts the default model (SmolLM2-135M-Instruct, once) or synthesizes a preset if
it is missing, starts every service, waits until each reports SERVING on the gRPC health service
and the model is served, prints the endpoints, and stops every process cleanly on Ctrl-C / SIGTERM.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
from pathlib import Path

from services.mesh.launcher import Mesh, MeshConfig
from services.model_format.default_model import DEFAULT_MODEL_ID


def parse_args(argv: list[str] | None) -> MeshConfig:
    p = argparse.ArgumentParser(prog="python -m services.mesh", description=__doc__.split("\n\n")[0])
    p.add_argument("--workers", type=int, default=2, help="worker processes (one per accelerator)")
    p.add_argument("--host-caches", type=int, default=1, help="parameter-pool processes sharing one copy of each model")
    p.add_argument(
        "--model",
        default=DEFAULT_MODEL_ID,
        help="model id served at start (the default is fetched once; a preset name synthesizes it)",
    )
    p.add_argument("--model-dir", type=Path, default=Path("models"), help="directory of HF checkpoints")
    p.add_argument("--run-dir", type=Path, default=Path("run"), help="port files and logs go here")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--http-port", type=int, default=8000)
    p.add_argument("--grpc-port", type=int, default=50051)
    p.add_argument(
        "--initial-instances", type=int, default=None, help="instances loaded at start (default: all workers)"
    )
    p.add_argument("--worker-threads", type=int, default=1, help="torch threads per worker")
    p.add_argument("--ready-timeout-s", type=float, default=300.0)
    a = p.parse_args(argv)
    return MeshConfig(
        workers=a.workers,
        host_caches=a.host_caches,
        model=a.model,
        model_dir=a.model_dir,
        run_dir=a.run_dir,
        host=a.host,
        http_port=a.http_port,
        grpc_port=a.grpc_port,
        initial_instances=a.workers if a.initial_instances is None else a.initial_instances,
        worker_threads=a.worker_threads,
        ready_timeout_s=a.ready_timeout_s,
    )


def main(argv: list[str] | None = None) -> int:
    cfg = parse_args(argv)
    return asyncio.run(Mesh(cfg).run_forever())


if __name__ == "__main__":
    sys.exit(main())
