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


def test_shaper_rejects_bad_rate() -> None:
    with pytest.raises(ValueError, match="-1"):
        LinkShaper(-1)
