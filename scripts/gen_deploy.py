"""Regenerate the deployment files rendered from services/mesh/topology.py.

Usage: python scripts/gen_deploy.py [--check]

Writes docker-compose.yml, deploy/swarm/blitzmesh-stack.yml and the Helm chart's
templates/_args.tpl. --check writes nothing and fails (exit 1, naming the files) when one of
them differs from what the topology renders now.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from services.mesh import deployments


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--check", action="store_true", help="fail if a generated file is out of date")
    args = p.parse_args(argv)
    if args.check:
        stale = deployments.stale()
        if stale:
            print(
                f"out of date with services/mesh/topology.py: {', '.join(stale)}; run `make deploy-gen`",
                file=sys.stderr,
            )
            return 1
        return 0
    for rel in deployments.write():
        print(f"wrote {rel}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
