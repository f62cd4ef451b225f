"""Render every values set of the Helm chart and check what comes out, offline (`make deploy-check`).

Usage: python scripts/deploy_check.py [--crd-dir DIR] [--out DIR]

For each deploy/helm/blitzmesh/ci/<name>-values.yaml: `helm lint --strict` and `helm template`
through Helm's Go SDK (the helm-python-sdk wheel; no helm binary), every object validated
against the Kubernetes OpenAPI schemas (kubernetes-validate, strict, for the oldest and newest
Kubernetes the chart supports) and the custom resources against deploy/helm/schemas/ (or, with
--crd-dir, against the CRD files there), then the cross-object checks of services/mesh/chart.py.
Also fails when a generated file (compose, swarm stack, the chart's _args.tpl) is out of date.
--out writes each set's rendered manifests to DIR/<name>.yaml. Exit 1 on any failure.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import yaml

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from services.mesh import chart, deployments


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--crd-dir", type=Path, default=None, help="validate custom resources against the CRDs here")
    p.add_argument("--out", type=Path, default=None, help="write each values set's manifests to OUT/<name>.yaml")
    args = p.parse_args(argv)
    import helm_python

    failures: list[str] = []
    stale = deployments.stale()
    if stale:
        failures.append(f"out of date with services/mesh/topology.py: {', '.join(stale)} (run `make deploy-gen`)")
    for name, values_file in chart.values_sets().items():
        start = time.monotonic()
        values = yaml.safe_load(values_file.read_text()) or {}
        lint = helm_python.lint(str(chart.CHART), values, strict=True, kube_version=f"v{chart.KUBE_VERSIONS[0]}")
        problems = [f"helm lint: {m['path']}: {m['error']}" for m in lint["messages"] if m["severity"] >= 2]
        problems += [f"helm lint: {e}" for e in lint["errors"]]
        try:
            objects = chart.render(values)
        except helm_python.HelmError as e:
            failures.append(f"{name}: helm template: {e}")
            print(f"{name}: does not render", file=sys.stderr)
            continue
        problems += chart.validate(objects, crd_dir=args.crd_dir)
        problems += chart.consistency(objects)
        if args.out is not None:
            args.out.mkdir(parents=True, exist_ok=True)
            (args.out / f"{name}.yaml").write_text(yaml.safe_dump_all(objects, sort_keys=False))
        kinds = sorted({o["kind"] for o in objects})
        print(
            f"{name}: {len(objects)} objects ({', '.join(kinds)}), {len(problems)} failures "
            f"[{time.monotonic() - start:.1f} s]"
        )
        failures += [f"{name}: {problem}" for problem in problems]
    for failure in failures:
        print(f"FAIL {failure}", file=sys.stderr)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
