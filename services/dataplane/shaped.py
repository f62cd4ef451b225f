"""An emulated network link: a Transport wrapper that paces this process's outgoing bytes.

On one machine every process shares loopback and memory bandwidth, so a chain's independence
from its length cannot show: the CPU, not the link, is the bottleneck. Shaping each process's
egress to `link_gbps` (as a NIC would) makes the link the bottleneck, like the emulated
accelerator makes compute scale with instances. It is off unless configured, and benchmarks
that use it say so. For real links between network namespaces use `tc` instead.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

from .buffers import as_uint8_array
from .transport import Endpoint, Transport


class LinkShaper:
    """One egress link: messages leave back to back at `link_gbps`, in the order they ask."""

    def __init__(self, link_gbps: float) -> None:
        if not link_gbps > 0:
            raise ValueError(f"link_gbps must be > 0, got {link_gbps!r}")
        self.bytes_per_s = link_gbps * 1e9 / 8
        self._free_at = 0.0

    async def take(self, nbytes: int) -> None:
        """Wait until `nbytes` would have left the link (store-and-forward per message)."""
        now = time.monotonic()
        start = max(now, self._free_at)
        self._free_at = start + nbytes / self.bytes_per_s
        delay = self._free_at - now
        if delay > 0:
            await asyncio.sleep(delay)


class _ShapedEndpoint(Endpoint):
    def __init__(self, inner: Endpoint, shaper: LinkShaper) -> None:
        self._inner = inner
        self._shaper = shaper
        self.peer = inner.peer

    async def send(self, buffer: Any, tag: int, *, timeout_s: float | None = None) -> None:
        nbytes = (
            len(buffer) if isinstance(buffer, (bytes, bytearray)) else int(as_uint8_array(buffer, writable=False).size)
        )
        await self._shaper.take(nbytes)
        await self._inner.send(buffer, tag, timeout_s=timeout_s)

    async def recv_into(self, buffer: Any, tag: int, *, timeout_s: float | None = None) -> None:
        await self._inner.recv_into(buffer, tag, timeout_s=timeout_s)

    def abort(self) -> None:
        self._inner.abort()

    async def close(self) -> None:
        await self._inner.close()

    @property
    def closed(self) -> bool:
        return self._inner.closed


class ShapedTransport(Transport):
    """`inner` with every outgoing message paced by one shared `LinkShaper`."""

    def __init__(self, inner: Transport, link_gbps: float) -> None:
        self._inner = inner
        self.kind = inner.kind
        self.shaper = LinkShaper(link_gbps)

    async def start(self) -> None:
        await self._inner.start()

    def address(self) -> bytes:
        return self._inner.address()

    async def connect(self, address: bytes, *, timeout_s: float = 10.0) -> Endpoint:
        return _ShapedEndpoint(await self._inner.connect(address, timeout_s=timeout_s), self.shaper)

    async def accept(self, *, timeout_s: float | None = None) -> Endpoint:
        return _ShapedEndpoint(await self._inner.accept(timeout_s=timeout_s), self.shaper)

    async def close(self) -> None:
        await self._inner.close()


def maybe_shaped(transport: Transport, link_gbps: float) -> Transport:
    """`transport` shaped to `link_gbps`, or as it is when `link_gbps` is 0."""
    return ShapedTransport(transport, link_gbps) if link_gbps > 0 else transport
