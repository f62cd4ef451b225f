"""The emulated link paces bytes at its rate, shared by every endpoint of the transport."""

from __future__ import annotations

import asyncio
import time

import pytest

from services.dataplane.shaped import LinkShaper


async def test_shaper_paces_back_to_back_messages() -> None:
    shaper = LinkShaper(link_gbps=0.08)  # 10 MB/s
    started = time.monotonic()
    await asyncio.gather(*(shaper.take(250_000) for _ in range(4)))  # 1 MB in all
    elapsed = time.monotonic() - started
    assert elapsed >= 0.1 * 0.95  # cannot beat the link
    assert elapsed < 0.5  # and does not serialise more than it must


async def test_a_small_message_is_not_queued_behind_a_long_one() -> None:
    """Messages share the link slice by slice (as flows on a tbf link): a small one sent while a
    long one is on the link leaves within a slice or two, not after the long one."""
    shaper = LinkShaper(link_gbps=0.08, slice_bytes=50_000)  # 10 MB/s, 5 ms slices
    started = time.monotonic()
    long = asyncio.create_task(shaper.take(3_000_000))  # 0.3 s alone
    await asyncio.sleep(0.02)
    small_started = time.monotonic()
    await shaper.take(10_000)
    small_s = time.monotonic() - small_started
    await long
    long_s = time.monotonic() - started
    assert long_s >= 0.3 * 0.95  # the link's rate holds for both together
    assert small_s < 0.15, f"the small message waited {small_s:.3f} s behind the long one"


def test_shaper_rejects_bad_rate() -> None:
    with pytest.raises(ValueError, match="-1"):
        LinkShaper(-1)
    with pytest.raises(ValueError, match="slice_bytes"):
        LinkShaper(1.0, slice_bytes=0)


async def test_per_peer_links_do_not_share_their_rate() -> None:
    """`per_peer`: every connection has a link of its own (a copy on each receiver's host), so
    two receivers each get the full rate; one shared link would take twice as long."""
    from services.dataplane.shaped import ShapedTransport
    from services.dataplane.tcp import TcpTransport

    shared = ShapedTransport(TcpTransport(), 0.08)
    per_peer = ShapedTransport(TcpTransport(), 0.08, per_peer=True)
    assert shared._shaper_for_endpoint() is shared._shaper_for_endpoint()
    a, b = per_peer._shaper_for_endpoint(), per_peer._shaper_for_endpoint()
    assert a is not b
    started = time.monotonic()
    await asyncio.gather(a.take(1_000_000), b.take(1_000_000))  # 0.1 s each at 10 MB/s
    assert time.monotonic() - started < 0.18


async def test_one_connection_sends_in_order_others_interleave() -> None:
    """Messages on one connection leave one after another (a byte stream: the first arrives
    after its own bytes, not after the whole window's); another connection's message
    interleaves with them."""
    from services.dataplane.shaped import _ShapedEndpoint

    class Sink:
        peer = "sink"

        def __init__(self, log: list[tuple[str, float]], name: str) -> None:
            self.log, self.name = log, name

        async def send(self, buffer: object, tag: int, *, timeout_s: float | None = None) -> None:
            self.log.append((f"{self.name}{tag}", time.monotonic()))

    shaper = LinkShaper(link_gbps=0.08, slice_bytes=50_000)  # 10 MB/s
    done: list[tuple[str, float]] = []
    a = _ShapedEndpoint(Sink(done, "a"), shaper)  # type: ignore[arg-type]
    b = _ShapedEndpoint(Sink(done, "b"), shaper)  # type: ignore[arg-type]
    started = time.monotonic()
    await asyncio.gather(*(a.send(bytes(500_000), tag) for tag in range(4)), b.send(bytes(50_000), 0))
    at = {name: t - started for name, t in done}
    assert [n for n, _ in done if n.startswith("a")] == ["a0", "a1", "a2", "a3"]
    assert at["a0"] < 0.15, f"the first message waited {at['a0']:.3f} s for the rest of its connection's"
    assert at["b0"] < 0.2, f"the other connection's message waited {at['b0']:.3f} s"
    assert at["a3"] >= 0.2 * 0.95  # 2.05 MB at 10 MB/s in all


async def test_a_control_message_overtakes_its_own_connections_queued_stream() -> None:
    """On one connection, a small control message (a probe's answer) does not wait behind the
    large messages queued on it, while a small message on a tag with a large one still waiting
    keeps its order (a length header never overtakes the payload before it)."""
    from services.dataplane.shaped import _ShapedEndpoint

    sent: list[tuple[int, int, float]] = []

    class Wire:
        peer = "wire"

        async def send(self, buffer: bytes, tag: int, *, timeout_s: float | None = None) -> None:
            sent.append((tag, len(buffer), time.monotonic()))

    ep = _ShapedEndpoint(Wire(), LinkShaper(link_gbps=0.08))  # type: ignore[arg-type]  # 10 MB/s
    started = time.monotonic()
    stream = [asyncio.create_task(ep.send(bytes(1_000_000), 10 + i)) for i in range(3)]  # 0.3 s queued
    await asyncio.sleep(0.01)
    await ep.send(b"pong", 0)
    pong_s = time.monotonic() - started
    behind = asyncio.create_task(ep.send(bytes(1_000_000), 0))  # a large control payload...
    await asyncio.sleep(0)
    await ep.send(b"next", 0)  # ...and a small one after it, on the same tag
    await asyncio.gather(*stream, behind)
    assert pong_s < 0.05, f"the small message waited {pong_s:.3f} s behind the stream"
    tag0 = [n for tag, n, _ in sent if tag == 0]
    assert tag0 == [4, 1_000_000, 4], tag0
