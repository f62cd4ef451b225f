"""Byte views over caller buffers and host allocation that receives at full speed.

Receiving into untouched memory is the slowest part of a transfer on these machines: the kernel
faults pages in one by one inside the copy (a UCX receive into a fresh `np.empty` ran at
0.2 GB/s, into the same buffer pre-touched at 9-11 GB/s). `host_buffer` therefore faults the
pages in up front, at memset speed, with the GIL released.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, TypeAlias

import numpy as np

if TYPE_CHECKING:  # torch is imported lazily: node processes should not pay 2-3 s for it
    import torch

__all__ = ["Buffer", "as_byte_view", "as_uint8_array", "host_buffer"]

# Anything that exposes contiguous bytes: memoryview, bytearray, bytes (send only), a numpy
# array, or a CPU torch tensor (viewed through `.numpy()`, never copied).
Buffer: TypeAlias = "memoryview | bytearray | bytes | np.ndarray | torch.Tensor"


def _torch_to_numpy(tensor: Any) -> np.ndarray:
    if tensor.device.type != "cpu":
        raise TypeError(f"only CPU tensors can be used as buffers, got device={tensor.device}")
    if not tensor.is_contiguous():
        raise ValueError(f"tensor buffer must be contiguous, got strides={tuple(tensor.stride())}")
    # A uint8 view first: `.numpy()` has no bfloat16, and the view keeps it zero-copy.
    import torch

    return tensor.detach().reshape(-1).view(torch.uint8).numpy()


def as_uint8_array(buffer: Any, *, writable: bool) -> np.ndarray:
    """Return a flat zero-copy uint8 numpy view of `buffer`.

    Raises TypeError/ValueError (quoting the offending property) for non-contiguous,
    read-only (when `writable`) or non-CPU buffers.
    """
    if type(buffer).__module__.startswith("torch"):
        arr = _torch_to_numpy(buffer)
    elif isinstance(buffer, np.ndarray):
        if not buffer.flags.c_contiguous:
            raise ValueError(f"buffer must be C-contiguous, got strides={buffer.strides}")
        arr = buffer.reshape(-1).view(np.uint8)
    else:
        view = memoryview(buffer)
        if not view.c_contiguous:
            raise ValueError("buffer must be C-contiguous")
        arr = np.frombuffer(view.cast("B"), dtype=np.uint8)
    if writable and not arr.flags.writeable:
        raise ValueError(f"buffer must be writable, got a read-only {type(buffer).__name__}")
    return arr


def as_byte_view(buffer: Any, *, writable: bool) -> memoryview:
    """Return a flat zero-copy `memoryview` (format 'B') of `buffer`."""
    return as_uint8_array(buffer, writable=writable).data


def host_buffer(size_bytes: int, *, prefault: bool = True) -> np.ndarray:
    """Allocate `size_bytes` of host memory (uint8) ready to receive at full speed.

    numpy's large allocations come from fresh mappings that transparent huge pages back here;
    `fill` faults every page in (about 8 GB/s, GIL released, so it can run in a thread while
    the previous group is on the wire). torch.empty memory was 4x slower to receive into.
    """
    if size_bytes < 0:
        raise ValueError(f"size_bytes must be >= 0, got {size_bytes}")
    buf = np.empty(size_bytes, dtype=np.uint8)
    if prefault and size_bytes:
        buf.fill(0)
    return buf
