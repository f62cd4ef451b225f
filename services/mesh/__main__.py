"""Run the whole mesh as local processes: parameter manager, global manager, workers, gateway.

Usage: python -m services.mesh [--workers 2] [--model smollm2-135m-instruct] [--http-port 8000] [--grpc-port 50051]
       python -m services.mesh --prefill 1 --decode 2 [--workers 4]   (prefill/decode disaggregated)

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
    p.add_argument(
        "--workers",
        type=int,
        default=None,
        help="worker processes (one per accelerator); default 2, or prefill + decode with --prefill/--decode "
        "(more stay IDLE for the autoscaler)",
    )
    p.add_argument(
        "--prefill",
        type=int,
        default=0,
        help="serve disaggregated: this many prefill workers (run prompts, hand their KV over); needs --decode",
    )
    p.add_argument(
        "--decode", type=int, default=0, help="serve disaggregated: this many decode workers; needs --prefill"
    )
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
    if a.prefill < 0 or a.decode < 0 or (a.prefill > 0) != (a.decode > 0):
        p.error(f"--prefill {a.prefill} --decode {a.decode}: give both > 0 (disaggregated) or neither (colocated)")
    split = a.prefill > 0
    if a.workers is not None and a.workers < 0:
        p.error(f"--workers must be >= 0, got {a.workers}")
    if split and a.workers is not None and a.workers < a.prefill + a.decode:
        p.error(f"--workers {a.workers} is fewer than --prefill {a.prefill} + --decode {a.decode}")
    if split and a.initial_instances is not None:
        p.error(
            f"--initial-instances {a.initial_instances} applies to colocated serving; with --prefill/--decode "
            "the prefill and decode workers are the instances loaded at start"
        )
    workers = a.workers if a.workers is not None else (a.prefill + a.decode if split else 2)
    return MeshConfig(
        workers=workers,
        prefill=a.prefill,
        decode=a.decode,
        host_caches=a.host_caches,
        model=a.model,
        model_dir=a.model_dir,
        run_dir=a.run_dir,
        host=a.host,
        http_port=a.http_port,
        grpc_port=a.grpc_port,
        initial_instances=workers if a.initial_instances is None else a.initial_instances,
        worker_threads=a.worker_threads,
        ready_timeout_s=a.ready_timeout_s,
    )


def main(argv: list[str] | None = None) -> int:
    cfg = parse_args(argv)
    return asyncio.run(Mesh(cfg).run_forever())


if __name__ == "__main__":
    sys.exit(main())
