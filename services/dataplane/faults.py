"""Fault injection for chaos tests: a Transport wrapper that corrupts outgoing messages.

`CorruptingTransport` flips one byte in a copy of each of the first `sends` messages of at
least `min_bytes` that this process sends (parameter chunks, KV blocks; control messages are
smaller), as a bad NIC or cable would. The receiver's checksum must catch it and fetch the
data again. It is off unless configured (`dataplane_corrupt_sends` of a worker or parameter
manager); only the chaos suite turns it on. The source's own memory is never touched.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import structlog

from .buffers import as_uint8_array
from .transport import Endpoint, Transport, WrappedEndpoint, WrappedTransport

log = structlog.get_logger(__name__)

MIN_BYTES = 64 * 1024


class _Budget:
    def __init__(self, sends: int) -> None:
        self.left = sends


class _CorruptingEndpoint(WrappedEndpoint):
    def __init__(self, inner: Endpoint, budget: _Budget, min_bytes: int) -> None:
        super().__init__(inner)
        self._budget = budget
        self._min_bytes = min_bytes

    async def send(self, buffer: Any, tag: int, *, timeout_s: float | None = None) -> None:
        data = as_uint8_array(buffer, writable=False)
        if self._budget.left > 0 and data.size >= self._min_bytes:
            self._budget.left -= 1
            bad = np.array(data, copy=True)
            bad[bad.size // 2] ^= 0xFF
            log.warning("dataplane_fault_corrupted_send", peer=self.peer, tag=tag, size_bytes=int(bad.size))
            buffer = bad
        await self._inner.send(buffer, tag, timeout_s=timeout_s)


class CorruptingTransport(WrappedTransport):
    """`inner` with the first `sends` large messages it sends corrupted (one flipped byte)."""

    def __init__(self, inner: Transport, sends: int, *, min_bytes: int = MIN_BYTES) -> None:
        if sends < 0:
            raise ValueError(f"sends must be >= 0, got {sends!r}")
        super().__init__(inner)
        self._budget = _Budget(sends)
        self._min_bytes = min_bytes

    @property
    def corruptions_left(self) -> int:
        return self._budget.left

    def wrap(self, endpoint: Endpoint) -> Endpoint:
        return _CorruptingEndpoint(endpoint, self._budget, self._min_bytes)


def maybe_corrupting(transport: Transport, sends: int) -> Transport:
    """`transport` corrupting its first `sends` large messages, or as it is when `sends` is 0."""
    return CorruptingTransport(transport, sends) if sends > 0 else transport
