"""Who gets past the internal services: refusals and a fuzz of every method, with the counts.

Usage:
    python -m bench.security [--payloads 20] [--seed 24] [--out bench/results/security.json]

Starts a mesh of real processes on the tiny synthesized model (2 workers, 1 SERVING and 1 IDLE,
2 host caches, autoscaling off), as `make up` starts one: mTLS on every internal hop. Then, with
bench/security/probe.py:
1. `refusal`: every method of every internal process called with an empty request by every
   caller that has no business there (no TLS, TLS without a client certificate, a certificate
   of another CA, a certificate naming no role, every role the table does not allow);
2. `fuzz_without_credentials`: the same callers, `--payloads` random payloads each (half random
   bytes, half random protobuf wire format); the mesh's state (manager's cluster and policy,
   every worker's status, the pool's locations) is compared before and after;
3. `fuzz_with_credentials`: the same payloads from every role allowed to call each method: it
   may change state; what counts is that no process dies and no unary call hangs.
Every call has a deadline (`--deadline-s`, 3 s: the issue saw a unary call hang past 3 s). Then the baseline: the same plaintext fuzz against a mesh started
with --insecure (what every mesh was before mTLS), counting the answers and whether state moved.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import platform
import random
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from bench.security import probe
from services.common import roles
from services.mesh.launcher import Mesh, MeshConfig
from services.model_format.synth import synthesize

MODEL = "tiny"
ALL_CALLERS = [*probe.UNCERTIFIED, "unknown-name", *(f"role:{r}" for r in roles.ALL_ROLES)]


def mesh_config(root: Path, name: str, *, insecure: bool) -> MeshConfig:
    return MeshConfig(
        workers=2,
        initial_instances=1,
        host_caches=2,
        model=MODEL,
        model_dir=root / "models",
        run_dir=root / name,
        http_port=0,
        grpc_port=0,
        ready_timeout_s=120.0,
        worker_args=["--step-time-a-s", "0.005", "--step-time-b-s", "0"],
        insecure=insecure,
    )


def changed(before: dict[str, Any], after: dict[str, Any]) -> list[str]:
    """What moved: the parts of the snapshot that differ, the manager's cluster in detail."""
    out = []
    for key in sorted(before.keys() | after.keys()):
        if before.get(key) == after.get(key):
            continue
        if key != "cluster":
            out.append(key)
            continue
        b, a = before[key], after[key]
        ids_b = {i[0] for i in b["instances"]}
        ids_a = {i[0] for i in a["instances"]}
        what = [f"{k} {b[k]!r} -> {a[k]!r}" for k in ("policy", "advisory") if b[k] != a[k]]
        what += [f"instances added {sorted(ids_a - ids_b)}"] if ids_a - ids_b else []
        what += [f"instances removed {sorted(ids_b - ids_a)}"] if ids_b - ids_a else []
        moved = sorted(i[0] for i in set(a["instances"]) - set(b["instances"]) if i[0] in ids_b)
        what += [f"instances changed {moved}"] if moved else []
        out.append(f"cluster: {'; '.join(what) or 'models'}")
    return out


async def secure_run(root: Path, payloads: list[bytes], deadline_s: float) -> dict[str, Any]:
    async with Mesh(mesh_config(root, "mtls", insecure=False)) as mesh:
        callers = probe.Callers(mesh.cfg.tls_path, root / "scratch")
        targets = probe.targets(mesh)
        out: dict[str, Any] = {"targets": [dataclasses.asdict(t) for t in targets]}
        before = await probe.snapshot(mesh, MODEL)
        t0 = time.monotonic()
        refusal = await probe.sweep(callers, targets, ALL_CALLERS, [b""], timeout_s=deadline_s, select="refused")
        fuzz = await probe.sweep(callers, targets, ALL_CALLERS, payloads, timeout_s=deadline_s, select="refused")
        after = await probe.snapshot(mesh, MODEL)
        out["refusal"] = refusal.to_dict() | {"unexpected_examples": refusal.unexpected[:5]}
        out["fuzz_without_credentials"] = fuzz.to_dict() | {
            "state_changed": changed(before, after),
            "state_changes": len(changed(before, after)),
            "unexpected_examples": fuzz.unexpected[:5],
        }
        role_callers = [f"role:{r}" for r in roles.ALL_ROLES]
        allowed = await probe.sweep(callers, targets, role_callers, payloads, timeout_s=deadline_s, select="allowed")
        dead = sorted(name for name, up in probe.alive(mesh).items() if not up)
        out["fuzz_with_credentials"] = allowed.to_dict() | {
            "processes_died": dead,
            "hang_examples": allowed.hangs[:5],
        }
        out["seconds"] = round(time.monotonic() - t0, 1)
        return out


async def insecure_baseline(root: Path, payloads: list[bytes], deadline_s: float) -> dict[str, Any]:
    async with Mesh(mesh_config(root, "insecure", insecure=True)) as mesh:
        callers = probe.Callers(None, root / "scratch")
        before = await probe.snapshot(mesh, MODEL)
        fuzz = await probe.sweep(
            callers, probe.targets(mesh), ["plaintext"], payloads, timeout_s=deadline_s, select="any"
        )
        after = await probe.snapshot(mesh, MODEL)
        dead = sorted(name for name, up in probe.alive(mesh).items() if not up)
        return fuzz.to_dict() | {
            "state_changed": changed(before, after),
            "state_changes": len(changed(before, after)),
            "processes_died": dead,
            "hang_examples": fuzz.hangs[:5],
        }


async def run(args: argparse.Namespace) -> dict[str, Any]:
    payloads = list(probe.fuzz_payloads(random.Random(args.seed), args.payloads))
    with tempfile.TemporaryDirectory(prefix="bench-security-") as tmp:
        root = Path(tmp)
        synthesize(root / "models" / MODEL, MODEL, seed=0)
        secure = await secure_run(root, payloads, args.deadline_s)
        baseline = await insecure_baseline(root, payloads, args.deadline_s) if not args.skip_baseline else None
    return {
        "about": {
            "what": "bench/security/__main__.py's docstring; tests/e2e/test_mesh_security.py asserts the same on fewer payloads",
            "payloads_per_method_and_caller": args.payloads,
            "seed": args.seed,
            "deadline_s": args.deadline_s,
            "machine": f"{platform.machine()}, {platform.python_version()}",
            "date": time.strftime("%Y-%m-%d"),
        },
        "mtls": secure,
        "insecure_baseline": baseline,
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.security", description=__doc__.split("\n\n")[0])
    p.add_argument("--payloads", type=int, default=20, help="random payloads per method and caller")
    p.add_argument("--seed", type=int, default=24)
    p.add_argument(
        "--deadline-s", type=float, default=3.0, help="each call's deadline; a unary call that reaches it hung"
    )
    p.add_argument("--skip-baseline", action="store_true", help="do not run the --insecure mesh")
    p.add_argument("--out", type=Path, default=Path("bench/results/security.json"))
    args = p.parse_args(argv)
    result = asyncio.run(run(args))
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
