"""Disaggregation benchmark: KV-cache transfer, migration, and disaggregated against colocated serving.

Usage:
    python -m bench.disagg [--quick] [--parts kv_transfer] [--transports ucx,tcp] [--kv-tokens N]
                           [--out bench/results/disagg.json]

Every part runs between real processes and writes one key of the result:
- kv_transfer (bench/disagg/kv.py): a request's KV cache (the default model's layout, 4096 tokens,
  2048 with --quick) pulled between two processes' paged caches against the bare transport moving
  the same bytes in the same messages, interleaved A B A B, per transport; target ratio >= 0.8.
- migration (bench/disagg/migration.py): a worker SIGKILLed under streams; time from the kill to
  the next token of each migrated stream, p50/p99, and lost streams (target 0).
- serving (bench/disagg/serving.py): colocated 2 workers vs 1 prefill + 1 decode on the same
  Poisson arrivals at rising rates (conversation-trace lengths, emulated accelerator pacing):
  TTFT and TBT p50/p99, SLO attainment and goodput per rate.

Parts are registered in PARTS (name -> (run(args) -> dict, targets(dict) -> dict, notes)); --parts
picks some; the keys of parts not run are kept from the file's earlier content. Results go to
bench/results/disagg.json (--quick: disagg_quick.json); the machine is
shared and has 2 cores, so load averages are recorded and each part records the CPU other
processes took during its rounds.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import signal
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, NamedTuple

from bench.disagg import kv, migration, serving


class Part(NamedTuple):
    run: Callable[[argparse.Namespace], dict[str, Any]]
    targets: Callable[[dict[str, Any]], dict[str, Any]]
    notes: dict[str, str]


PARTS: dict[str, Part] = {
    "kv_transfer": Part(kv.run, kv.targets, kv.NOTES),
    "migration": Part(migration.run, migration.targets, migration.NOTES),
    "serving": Part(serving.run, serving.targets, serving.NOTES),
}


def _load() -> list[float]:
    return [round(x, 2) for x in os.getloadavg()]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.disagg", description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="smaller requests and fewer rounds (about a minute)")
    parser.add_argument("--parts", default=",".join(PARTS), help=f"comma-separated parts, of {sorted(PARTS)}")
    parser.add_argument("--transports", default="ucx,tcp", help="kv_transfer: transport kinds (ucx, tcp)")
    parser.add_argument("--kv-tokens", type=int, help="kv_transfer: request length (default 4096, --quick 2048)")
    parser.add_argument("--out", help="JSON path (default bench/results/disagg.json, --quick: disagg_quick.json)")
    args = parser.parse_args(argv)
    parts = [p.strip() for p in args.parts.split(",") if p.strip()]
    unknown = [p for p in parts if p not in PARTS]
    if unknown:
        parser.error(f"unknown parts {unknown}, known: {sorted(PARTS)}")
    out = Path(args.out or ("bench/results/disagg_quick.json" if args.quick else "bench/results/disagg.json"))
    # SIGTERM ends the run like Ctrl-C does: through every `finally` (node processes).
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))

    started = time.monotonic()
    earlier: dict[str, Any] = json.loads(out.read_text()) if out.exists() else {}
    results: dict[str, Any] = {
        **{name: earlier[name] for name in PARTS if name not in parts and name in earlier},
        "quick": args.quick,
        "machine": {**earlier.get("machine", {}), "cpus": os.cpu_count(), "python": platform.python_version()},
        "elapsed_s": earlier.get("elapsed_s", {}),
    }
    results["machine"][f"load_avg_before_{'_'.join(parts)}"] = _load()
    targets: dict[str, Any] = dict(earlier.get("targets", {}))
    notes: dict[str, str] = dict(earlier.get("notes", {}))
    for name in parts:
        part = PARTS[name]
        t0 = time.monotonic()
        results[name] = part.run(args)
        results["elapsed_s"][name] = round(time.monotonic() - t0, 1)
        results["machine"][f"load_avg_after_{name}"] = _load()
        targets.update(part.targets(results[name]))
        notes.update(part.notes)
    results["elapsed_s"]["last_run_total"] = round(time.monotonic() - started, 1)
    results["targets"] = targets
    results["notes"] = notes
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(results, indent=2) + "\n")
    print(json.dumps(targets, indent=2))
    print(f"wrote {out}", file=sys.stderr)


if __name__ == "__main__":
    main()
