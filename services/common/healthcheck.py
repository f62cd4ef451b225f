"""Exit 0 when a service reports SERVING on the gRPC health service (for compose healthchecks).

Usage: python -m services.common.healthcheck HOST:PORT [--timeout-s 3]
"""

from __future__ import annotations

import argparse
import asyncio
import sys

from services.common.server import wait_for_serving


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("address")
    p.add_argument("--timeout-s", type=float, default=3.0)
    args = p.parse_args()
    try:
        asyncio.run(wait_for_serving(args.address, args.timeout_s))
    except TimeoutError as e:
        print(e, file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
