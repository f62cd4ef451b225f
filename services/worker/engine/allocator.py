"""glibc malloc settings for the engine's process: large activations reused, not re-faulted.

A prefill step allocates a fresh output for every GEMM and fused op: 2-25 MB each for a
1,024-2,048-token step of the default model. Past glibc's (adaptive) mmap threshold such blocks
are mapped and unmapped around each use, so steps keep faulting fresh pages in: 134 minor faults
per MLP pass of a 1,024-token step on the compute thread (`tests/unit/test_allocator.py`). Raising
the mmap threshold to its maximum (32 MiB on 64-bit) and the trim threshold to 1 GiB keeps them in
the heap, where the next step reuses them: no faults. On the development box (2 threads, one
1,024-token float32 prompt through the engine, quiet machine, alternating) prefill went from
689-759 to 767-781 tok/s. Memory the process once held for activations stays held (about one
step's activations, tens of MB here), the cost vLLM's CPU guide pays too by preloading tcmalloc.

The settings are process-wide and applied once, on the first engine start; glibc only (elsewhere,
or with `BLITZMESH_MALLOC_TUNING=0`, nothing changes).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import threading

import structlog

log = structlog.get_logger(__name__)

_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3
MMAP_THRESHOLD_BYTES = 32 << 20  # glibc's largest (DEFAULT_MMAP_THRESHOLD_MAX on 64-bit)
TRIM_THRESHOLD_BYTES = 1 << 30

_lock = threading.Lock()
_applied: bool | None = None


def tune_allocator() -> bool:
    """Apply the settings (once per process); True where glibc took them."""
    global _applied
    with _lock:
        if _applied is not None:
            return _applied
        _applied = False
        if os.environ.get("BLITZMESH_MALLOC_TUNING", "1") == "0":
            return False
        name = ctypes.util.find_library("c")
        try:
            libc = ctypes.CDLL(name)
            mallopt = libc.mallopt
            gnu = ctypes.CDLL(None).gnu_get_libc_version  # glibc only: musl has no mallopt knobs
        except (OSError, AttributeError, TypeError):
            return False
        mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
        mallopt.restype = ctypes.c_int
        ok = (
            mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD_BYTES) == 1
            and mallopt(_M_TRIM_THRESHOLD, TRIM_THRESHOLD_BYTES) == 1
        )
        _applied = ok
        gnu.restype = ctypes.c_char_p
        log.info(
            "malloc_tuned" if ok else "malloc_tuning_refused", glibc=gnu().decode(), mmap_threshold=MMAP_THRESHOLD_BYTES
        )
        return ok
