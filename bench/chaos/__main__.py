"""The whole chaos fault matrix, and how many fault kinds each topology passes.

Usage:
    python -m bench.chaos [--topology all|four|default] [--kind NAME ...]

Runs tests/chaos under pytest with the `chaos_full` kinds switched on (BLITZMESH_CHAOS_FULL=1;
`make test` runs only the kinds it always had): every kind of tests/chaos/faults.py in the
4-worker chaos mesh (`four`) and in the default topology of `make up` (`default`), plus the
default topology's own tests (tests/chaos/test_default_topology.py) and the two faults injected
below the mesh (a link's rate collapsed, a full disk). Each test replaces its row in
bench/results/chaos.json; then the summary counts, per topology, the kinds with nothing lost or
hung and no scale-out rolled back, against issue 24's target of 16, and is written to the same
file (`summary`). `--kind` runs only those matrix kinds (a name of faults.FAULTS). Slow: a mesh
a test, about 45 s each on 2 cores, 35 minutes for the whole matrix.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from typing import Any

from tests.chaos.conftest import FULL_MATRIX_ENV
from tests.chaos.faults import FAULTS
from tests.chaos.harness import DEFAULT, RESULTS, RESULTS_ENV, TOPOLOGIES

TARGET_KINDS = 16
BELOW_THE_MESH = ("link_rate_collapse", "full_disk_during_conversion")  # no mesh, no topology
TOPOLOGY_FILES = {"four": ["tests/chaos/test_link_collapse.py", "tests/chaos/test_full_disk.py"]}
TOPOLOGY_FILES["default"] = ["tests/chaos/test_default_topology.py"]


def matrix_cases(topologies: list[str], kinds: list[str]) -> list[tuple[str, str]]:
    """The matrix's (topology, kind name) pairs a run covers: every kind, or only `kinds`."""
    return [(t, k.name) for t in topologies for k in FAULTS if not kinds or k.name in kinds]


def pytest_args(topologies: list[str], kinds: list[str]) -> list[str]:
    """The test ids to run: the matrix's (topology, kind) pairs, and with no `kinds` the
    topologies' own test files."""
    known = {k.name for k in FAULTS}
    unknown = sorted(set(kinds) - known)
    if unknown:
        raise SystemExit(f"unknown fault kind(s) {unknown}; known: {sorted(known)}")
    ids = [f"tests/chaos/test_matrix.py::test_fault[{t}-{k}]" for t, k in matrix_cases(topologies, kinds)]
    if not kinds:
        ids += [f for t in topologies for f in TOPOLOGY_FILES[t]]
    return ids


def summarize(rows: list[dict[str, Any]], since: str = "", ran: frozenset[str] = frozenset()) -> dict[str, Any]:
    """Per topology: the matrix's kinds with nothing lost or hung and no rollback (`passed`, the
    count against the target), those with a loss or a rollback (`failed`, with why). A test of
    this run (its row name in `ran`) whose row is older than `since` (the run's start, as rows
    stamp `at`) failed before it could write one: failed too, never passed on an old row. The
    default topology's own tests (test_default_topology.py) are listed apart, not counted: some
    repeat a matrix kind with more streams. The faults below the mesh are apart too."""
    kinds = {k.name for k in FAULTS}
    by_fault = {r["fault"]: r for r in rows}
    out: dict[str, Any] = {"target_kinds": TARGET_KINDS}
    for name, topology in TOPOLOGIES.items():
        passed, failed, missing = [], {}, []
        for kind in sorted(kinds):
            r = by_fault.get(topology.row_prefix + kind)
            if r is None:
                missing.append(kind)
                continue
            why = [f"{k}={r.get(k)}" for k in ("lost", "hung", "rolled_back") if r.get(k)]
            if since and r["fault"] in ran and r.get("at", "") < since:
                why = [f"no row from this run (the test failed before writing one; its last row is from {r.get('at')})"]
            if why:
                failed[kind] = ", ".join(why)
            else:
                passed.append(kind)
        out[name] = {"kinds": len(passed), "meets_target": len(passed) >= TARGET_KINDS, "passed": passed}
        if failed:
            out[name]["failed"] = failed
        if missing:
            out[name]["not_run"] = missing
    own = [
        r
        for r in rows
        if r["fault"].startswith(DEFAULT.row_prefix) and r["fault"].removeprefix(DEFAULT.row_prefix) not in kinds
    ]
    out["default_topology_own_tests"] = {
        r["fault"]: {"lost": r.get("lost"), "rolled_back": r.get("rolled_back")} for r in own
    }
    out["below_the_mesh"] = {r["fault"]: {"lost": r.get("lost")} for r in rows if r["fault"] in BELOW_THE_MESH}
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.chaos", description=__doc__.split("\n\n")[0])
    p.add_argument("--topology", choices=["all", *TOPOLOGIES], default="all")
    p.add_argument("--kind", action="append", default=[], help="only this matrix kind (repeatable)")
    p.add_argument("--pytest-arg", action="append", default=[], help="passed on to pytest (repeatable)")
    args = p.parse_args(argv)
    topologies = list(TOPOLOGIES) if args.topology == "all" else [args.topology]
    cmd = [sys.executable, "-m", "pytest", "-m", "chaos", "-p", "no:cacheprovider", "-q", "-rA"]
    cmd += [*args.pytest_arg, *pytest_args(topologies, args.kind)]
    print(" ".join(cmd), flush=True)
    since = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    code = subprocess.run(cmd, env={**os.environ, FULL_MATRIX_ENV: "1", RESULTS_ENV: str(RESULTS)}).returncode
    data = json.loads(RESULTS.read_text()) if RESULTS.exists() else {"rows": []}
    ran = frozenset(TOPOLOGIES[t].row_prefix + k for t, k in matrix_cases(topologies, args.kind))
    data["summary"] = summarize(data["rows"], since, ran)
    RESULTS.write_text(json.dumps(data, indent=2) + "\n")
    print(json.dumps(data["summary"], indent=2))
    return code


if __name__ == "__main__":
    sys.exit(main())
