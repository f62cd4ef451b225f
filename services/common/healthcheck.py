"""Exit 0 when a service reports SERVING on the gRPC health service (for compose healthchecks).

Usage: python -m services.common.healthcheck HOST:PORT [--timeout-s 3] [--tls-dir DIR --role ROLE [--instance ID]]

With --tls-dir the check presents ROLE's certificate and expects the server's to name ROLE (a
container checks itself with its own); without it the channel is plaintext (an --insecure
service, or the gateway's public port).
"""

from __future__ import annotations

import argparse
import asyncio
import sys
from pathlib import Path

from services.common.roles import ALL_ROLES
from services.common.security import load_identity
from services.common.server import wait_for_serving


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("address")
    p.add_argument("--timeout-s", type=float, default=3.0)
    p.add_argument("--tls-dir", type=Path, default=None, help="the mesh's certificates (mTLS); none: plaintext")
    p.add_argument("--role", choices=ALL_ROLES, default=None, help="with --tls-dir: the role to present and expect")
    p.add_argument(
        "--instance", default=None, help="with --tls-dir: present this instance's own certificate (a worker's)"
    )
    args = p.parse_args()
    if args.tls_dir is not None and args.role is None:
        p.error("--tls-dir needs --role (the role of the service checked)")
    identity = load_identity(args.tls_dir, args.role, args.instance) if args.tls_dir is not None else None
    try:
        asyncio.run(wait_for_serving(args.address, args.timeout_s, peer=args.role, identity=identity))
    except TimeoutError as e:
        print(e, file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
