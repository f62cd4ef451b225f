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
from .transport import Endpoint, Transport, WrappedEndpoint, WrappedTransport

SLICE_BYTES = 1 << 20
SMALL_BYTES = 4 << 10  # a control message: it goes out as a packet among a stream's slices, not after them


class LinkShaper:
    """One egress link at `link_gbps`, shared by every message that asks for it.

    A message leaves in slices of `slice_bytes`; each slice takes the link only once it is free,
    so messages of different connections interleave slice by slice, as the packets of several
    TCP flows do on a `tc tbf` link (one connection's messages go in order, see
    `_ShapedEndpoint`): a small message (a control reply, a KV relay) waits for at most a slice
    of a long parameter stream, not for the whole stream queued ahead of it. The message is
    delivered when its last slice has left (store-and-forward per message). A sender woken up
    to a slice time late still starts where the link fell free, so the event loop's jitter
    costs no rate; a link idle for longer starts afresh (no credit builds up).
    """

    def __init__(self, link_gbps: float, *, slice_bytes: int = SLICE_BYTES) -> None:
        if not link_gbps > 0:
            raise ValueError(f"link_gbps must be > 0, got {link_gbps!r}")
        if slice_bytes < 1:
            raise ValueError(f"slice_bytes must be >= 1, got {slice_bytes!r}")
        self.bytes_per_s = link_gbps * 1e9 / 8
        self.slice_bytes = slice_bytes
        self._jitter_s = slice_bytes / self.bytes_per_s
        self._free_at = 0.0

    def charge(self, nbytes: int) -> None:
        """Count `nbytes` sent now, squeezed in among the slices: later slices leave that much later."""
        now = time.monotonic()
        self._free_at = max(self._free_at, now) + nbytes / self.bytes_per_s

    async def take(self, nbytes: int) -> None:
        """Wait until `nbytes` would have left the link."""
        left = nbytes
        while left > 0:
            now = time.monotonic()
            if self._free_at > now:
                await asyncio.sleep(self._free_at - now)  # another message's slice is on the link
                continue
            piece = min(left, self.slice_bytes)
            start = self._free_at if now - self._free_at <= self._jitter_s else now
            self._free_at = start + piece / self.bytes_per_s
            left -= piece
        delay = self._free_at - time.monotonic()
        if delay > 0:
            await asyncio.sleep(delay)


class _ShapedEndpoint(WrappedEndpoint):
    """One connection: its large messages take the link one after another (FIFO), while other
    connections' messages interleave with them slice by slice.

    A small message (a control message: a liveness probe's answer, an abort) does not queue
    behind the connection's large ones: tagged messages are independent on UCX, and on a real
    link it would be a packet among the stream's. Its bytes are charged to the link and it
    leaves at once, unless a large message of the same tag is still waiting (order per tag is
    kept)."""

    def __init__(self, inner: Endpoint, shaper: LinkShaper) -> None:
        super().__init__(inner)
        self._shaper = shaper
        self._fifo = asyncio.Lock()
        self._large_waiting: dict[int, int] = {}  # tag -> large messages of it not yet sent

    async def send(self, buffer: Any, tag: int, *, timeout_s: float | None = None) -> None:
        nbytes = (
            len(buffer) if isinstance(buffer, (bytes, bytearray)) else int(as_uint8_array(buffer, writable=False).size)
        )
        if nbytes <= SMALL_BYTES and not self._large_waiting.get(tag):
            self._shaper.charge(nbytes)
            await self._inner.send(buffer, tag, timeout_s=timeout_s)
            return
        self._large_waiting[tag] = self._large_waiting.get(tag, 0) + 1
        try:
            async with self._fifo:
                await self._shaper.take(nbytes)
            await self._inner.send(buffer, tag, timeout_s=timeout_s)
        finally:
            self._large_waiting[tag] -= 1


class ShapedTransport(WrappedTransport):
    """`inner` with every outgoing message paced by one shared `LinkShaper`, or, `per_peer`, by
    one shaper per connection: every peer then has a link of its own at `link_gbps` (a copy on
    each receiver's host, as ServerlessLLM's per-host caches are, read over each host's PCIe)."""

    def __init__(self, inner: Transport, link_gbps: float, *, per_peer: bool = False) -> None:
        super().__init__(inner)
        self.shaper = LinkShaper(link_gbps)
        self._link_gbps = link_gbps
        self._per_peer = per_peer

    def _shaper_for_endpoint(self) -> LinkShaper:
        return LinkShaper(self._link_gbps) if self._per_peer else self.shaper

    def wrap(self, endpoint: Endpoint) -> Endpoint:
        return _ShapedEndpoint(endpoint, self._shaper_for_endpoint())


def maybe_shaped(transport: Transport, link_gbps: float, *, per_peer: bool = False) -> Transport:
    """`transport` shaped to `link_gbps` (per peer, if `per_peer`), or as it is when `link_gbps` is 0."""
    return ShapedTransport(transport, link_gbps, per_peer=per_peer) if link_gbps > 0 else transport
