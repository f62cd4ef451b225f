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
