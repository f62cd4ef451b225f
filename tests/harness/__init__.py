"""Harnesses that start real data-plane and KV-transfer nodes in their own processes, for the
tests and the data-plane and disaggregation benchmarks. No production module imports them."""

from __future__ import annotations

import multiprocessing.connection
import os
import signal
from multiprocessing.process import BaseProcess


def stop_node(proc: BaseProcess, conn: multiprocessing.connection.Connection, timeout_s: float) -> None:
    """Ask a node process to stop over its pipe, wait `timeout_s`, SIGKILL it if it is still
    alive, and close the pipe (what both harnesses' nodes do)."""
    if proc.is_alive():
        try:
            conn.send(("stop",))
        except (BrokenPipeError, OSError):
            pass
        proc.join(timeout_s)
    if proc.is_alive() and proc.pid is not None:
        os.kill(proc.pid, signal.SIGKILL)
        proc.join(5)
    conn.close()
