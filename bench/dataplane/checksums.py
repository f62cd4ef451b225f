"""Raw checksum rates, one core, in-process: what each algo of services/dataplane/checksum.py costs.

`checksum_rates` digests a buffer larger than the last-level cache chunk by chunk through
`GroupDigests.add` (as a receiver does), best of `repeats`; then one chunk again and again
(in cache, as a chunk that has just landed); and while a thread does the same
it measures how late a 0.2 ms sleep of the calling thread wakes: a hash that holds the GIL
delays the other threads (the event loop of a receiver) by the interpreter's switch interval.
"""

from __future__ import annotations

import threading
import time
from typing import Any

import numpy as np

from services.dataplane.checksum import CHECKSUM_ALGOS, GroupDigests


def _digest_all(buf: np.ndarray, algo: str, chunk_bytes: int) -> None:
    digests = GroupDigests(buf.size, algo)
    for off in range(0, buf.size, chunk_bytes):
        digests.add(off, buf[off : off + chunk_bytes])
    digests.checksum()


def checksum_rates(size_bytes: int, chunk_bytes: int, repeats: int = 3) -> dict[str, Any]:
    """GB/s of every algo over `size_bytes` of random bytes in `chunk_bytes` pieces (best of
    `repeats`), and the worst wake-up delay (ms) of a 0.2 ms sleep beside a digesting thread."""
    buf = np.random.default_rng(0).integers(0, 256, size_bytes, dtype=np.uint8)
    gbps: dict[str, float] = {}
    hot_gbps: dict[str, float] = {}
    stall_ms: dict[str, float] = {}
    for algo in CHECKSUM_ALGOS:
        _digest_all(buf[:chunk_bytes], algo, chunk_bytes)  # imports, first-call set-up
        best = float("inf")
        for _ in range(repeats):
            t0 = time.perf_counter()
            _digest_all(buf, algo, chunk_bytes)
            best = min(best, time.perf_counter() - t0)
        gbps[algo] = round(size_bytes / best / 1e9, 2)
        hot = buf[:chunk_bytes]  # one chunk over and over: in cache, as a chunk just received
        best = float("inf")
        for _ in range(5 * repeats):
            t0 = time.perf_counter()
            _digest_all(hot, algo, chunk_bytes)
            best = min(best, time.perf_counter() - t0)
        hot_gbps[algo] = round(hot.size / best / 1e9, 2)
        worker = threading.Thread(target=_digest_all, args=(buf, algo, chunk_bytes))
        worst = 0.0
        worker.start()
        while worker.is_alive():
            t0 = time.perf_counter()
            time.sleep(0.0002)
            worst = max(worst, time.perf_counter() - t0)
        worker.join()
        stall_ms[algo] = round(worst * 1e3, 2)
    return {
        "checksum_gbps": gbps,
        "checksum_hot_gbps": hot_gbps,
        "checksum_thread_stall_ms": stall_ms,
        "checksum_bench": {"size_bytes": size_bytes, "chunk_bytes": chunk_bytes, "repeats": repeats},
    }
