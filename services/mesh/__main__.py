"""Run the whole mesh as local processes: parameter manager, global manager, workers, gateway.

Usage: python -m services.mesh [--workers 3] [--initial-instances 1] [--no-autoscale]
                               [--model smollm2-135m-instruct] [--http-port 8000] [--grpc-port 50051]
       python -m services.mesh --prefill 1 --decode 2 [--workers 4]   (prefill/decode disaggregated)

Fetches and converts the default model (SmolLM2-135M-Instruct, once) or synthesizes a preset if
it is missing, starts every service, waits until each reports SERVING on the gRPC health service
and the model is served, prints the endpoints, and stops every process cleanly on Ctrl-C / SIGTERM.
A child that exits is restarted on its ports with exponential backoff; one that exits more than
--max-restarts times within --restart-window-s stops the mesh (exit code 1), naming it.

By default 3 workers start and 1 loads the model; the global manager autoscales (HeteroScale,
tuned for a small local mesh: LOCAL_POLICY_PARAMS) into the idle ones, which serve ZigZag
requests while their layers arrive. `python -m services.mesh.burst` replays a trace burst and
prints the scale-out as it happens.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
from pathlib import Path
from typing import Any

from pydantic import ValidationError

from services.global_manager.core.policies import make_policy
from services.mesh.launcher import Mesh, MeshConfig
from services.mesh.supervision import RestartPolicy
from services.model_format.default_model import DEFAULT_MODEL_ID

# HeteroScale for a small local mesh. Concurrency (running + waiting requests per instance, the
# Knative KPA signal) shows a burst the moment it queues, on any machine; decode TPS and the
# latency trigger depend on how fast this machine runs the model (a slow CPU breaks a 0.1 s TBT
# line with one request), so the latency trigger is off. Short cooldowns and a 4 s load window
# let a one-minute burst scale out within seconds and back in about half a minute after it.
LOCAL_POLICY_PARAMS: dict[str, Any] = {
    "target_requests_per_instance": 4,
    "enable_latency_trigger": False,
    "scale_out_cooldown_s": 5.0,
    "scale_in_cooldown_s": 30.0,
    "scale_in_stabilization_s": 30.0,
}
LOCAL_WINDOW_S = 4.0
# A request that finds no instance (scale from zero, or a mesh still starting) waits this long for
# one: a cold load of the default model on a slow machine takes tens of seconds, over the
# gateway's own 15 s default.
SCHEDULE_WAIT_S = 60.0
DEFAULT_WORKERS = 3
DEFAULT_INITIAL_INSTANCES = 1


def parse_args(argv: list[str] | None) -> MeshConfig:
    p = argparse.ArgumentParser(prog="python -m services.mesh", description=__doc__.split("\n\n")[0])
    p.add_argument(
        "--workers",
        type=int,
        default=None,
        help=f"worker processes (one per accelerator); default {DEFAULT_WORKERS}, or prefill + decode with "
        "--prefill/--decode (those not loaded at start stay IDLE for the autoscaler)",
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
        "--initial-instances",
        type=int,
        default=None,
        help=f"colocated instances loaded at start and kept loaded (default {DEFAULT_INITIAL_INSTANCES}, "
        "at most --workers); 0 starts none: the first request scales from zero",
    )
    p.add_argument(
        "--autoscale",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="the global manager scales out into IDLE workers and back (HeteroScale; default on)",
    )
    p.add_argument(
        "--policy-params",
        type=json.loads,
        default={},
        help=f"JSON object over the local HeteroScale parameters {json.dumps(LOCAL_POLICY_PARAMS)}",
    )
    p.add_argument(
        "--schedule-wait-s",
        type=float,
        default=SCHEDULE_WAIT_S,
        help="how long the gateway holds a request that finds no instance (scale from zero, a load under way)",
    )
    p.add_argument(
        "--worker-threads",
        type=int,
        default=0,
        help="torch threads per worker; 0 (default): each loaded instance takes its share of the cores among"
        " the instances running now (all of them while one serves)",
    )
    p.add_argument(
        "--worker-arg",
        action="append",
        default=[],
        metavar="ARG",
        help="pass ARG to every worker (repeat it, e.g. --worker-arg=--device --worker-arg=cuda or "
        "--worker-arg=--scheduling-policy=scorpio); `python -m services.worker --help` lists the options",
    )
    p.add_argument("--ready-timeout-s", type=float, default=300.0)
    p.add_argument(
        "--tls-dir",
        type=Path,
        default=None,
        help="the mesh's CA and per-role certificates (made on the first start; default RUN_DIR/tls)",
    )
    p.add_argument(
        "--insecure",
        action="store_true",
        help="DEVELOPMENT ONLY: internal services plaintext, no caller checks (each logs a warning)",
    )
    defaults = RestartPolicy()
    p.add_argument(
        "--max-restarts",
        type=int,
        default=defaults.max_restarts,
        help="restarts of one child allowed within --restart-window-s; one more stops the mesh (0: stop at "
        "the first exit)",
    )
    p.add_argument(
        "--restart-window-s",
        type=float,
        default=defaults.window_s,
        help="the window --max-restarts counts over",
    )
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
    workers = a.workers if a.workers is not None else (a.prefill + a.decode if split else DEFAULT_WORKERS)
    initial = a.initial_instances if a.initial_instances is not None else min(DEFAULT_INITIAL_INSTANCES, workers)
    if not split and not 0 <= initial <= workers:
        p.error(f"--initial-instances {initial} must be between 0 and --workers {workers}")
    if a.schedule_wait_s < 0:
        p.error(f"--schedule-wait-s must be >= 0, got {a.schedule_wait_s}")
    if a.worker_threads < 0:
        p.error(f"--worker-threads must be >= 0 (0 = auto), got {a.worker_threads}")
    if not isinstance(a.policy_params, dict):
        p.error(f"--policy-params must be a JSON object, got {json.dumps(a.policy_params)}")
    try:
        restart_policy = RestartPolicy(max_restarts=a.max_restarts, window_s=a.restart_window_s)
    except ValidationError as e:
        p.error("; ".join(f"{'.'.join(map(str, err['loc']))}={err['input']!r}: {err['msg']}" for err in e.errors()))
    policy_params = {**LOCAL_POLICY_PARAMS, **a.policy_params}
    try:
        make_policy("heteroscale", policy_params)
    except ValueError as e:
        p.error(f"--policy-params {json.dumps(a.policy_params)}: {e}")
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
        initial_instances=initial,
        worker_threads=a.worker_threads,
        worker_args=list(a.worker_arg),
        ready_timeout_s=a.ready_timeout_s,
        autoscale=a.autoscale,
        policy_params=policy_params if a.autoscale else {},
        window_s=LOCAL_WINDOW_S if a.autoscale else None,
        schedule_wait_s=a.schedule_wait_s,
        supervise=True,
        restart_policy=restart_policy,
        tls_dir=a.tls_dir,
        insecure=a.insecure,
    )


def main(argv: list[str] | None = None) -> int:
    cfg = parse_args(argv)
    return asyncio.run(Mesh(cfg).run_forever())


if __name__ == "__main__":
    sys.exit(main())
