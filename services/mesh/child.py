"""Run a service module as a child of the launcher that dies with it: no orphans.

Usage: python -m services.mesh.child PARENT_PID MODULE [ARGS...]

Setting PR_SET_PDEATHSIG here, after exec, instead of in a preexec_fn keeps Python code out
of the window between fork and exec, where a parent with gRPC threads can crash the child.
"""

from __future__ import annotations

import ctypes
import os
import runpy
import signal
import sys

PR_SET_PDEATHSIG = 1


def main() -> None:
    parent_pid, module, *args = sys.argv[1:]
    ctypes.CDLL("libc.so.6", use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM)
    if os.getppid() != int(parent_pid):
        sys.exit(f"launcher {parent_pid} is gone before {module} started")
    sys.argv = [module, *args]
    runpy.run_module(module, run_name="__main__", alter_sys=True)


if __name__ == "__main__":
    main()
