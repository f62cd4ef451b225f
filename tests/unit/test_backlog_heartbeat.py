"""A backlog is news: the worker heartbeats before its period when the queued prompts' wait
forms or doubles, and the manager's control loop runs at once on such a heartbeat."""

from __future__ import annotations

import asyncio

import pytest

from services.common.backlog import BACKLOG_FLOOR_S, backlog_is_news, sample_wait_s
from services.worker.config import WorkerConfig
from services.worker.service import BACKLOG_HEARTBEATS, WorkerService


@pytest.mark.parametrize(
    ("wait_s", "reported_s", "news"),
    [
        (0.0, 0.0, False),  # nothing queued
        (0.2, 0.0, False),  # under the floor
        (0.25, 0.0, True),  # a backlog formed
        (1.0, 0.6, False),  # grew, but not x2: the next heartbeat says so
        (1.2, 0.6, True),  # doubled
        (0.3, 2.0, False),  # draining
    ],
)
def test_a_backlog_is_news_past_the_floor_when_it_at_least_doubles(
    wait_s: float, reported_s: float, news: bool
) -> None:
    assert backlog_is_news(wait_s, reported_s) is news
    assert BACKLOG_FLOOR_S == 0.25 and backlog_is_news(0.2, 0.0, floor_s=0.1)


def test_the_sample_wait_is_tokens_at_capacity_and_zero_without_one() -> None:
    assert sample_wait_s(3000, 1000.0) == pytest.approx(3.0)
    assert sample_wait_s(3000, 0.0) == 0.0


def worker(waits: list[float], **cfg: float) -> WorkerService:
    """A worker whose queued prompts' wait reads `waits` in turn (the last one from then on)."""
    w = WorkerService(WorkerConfig(**cfg))  # type: ignore[arg-type]
    seq = iter(waits)
    last = [0.0]

    def wait_s() -> float:
        last[0] = next(seq, last[0])
        return last[0]

    w.servicer.queue_wait_s = wait_s  # type: ignore[method-assign]
    return w


async def test_a_backlog_forming_cuts_the_heartbeat_period_short() -> None:
    w = worker([0.0, 0.1, 0.4], heartbeat_interval_s=30.0, heartbeat_backlog_check_s=0.01)
    before = BACKLOG_HEARTBEATS._value.get()
    # Bounded well under the 30 s period: the third check sees 0.4 s of wait against 0 reported.
    await asyncio.wait_for(w._until_next_heartbeat(reported_wait_s=0.0), timeout=10)
    assert BACKLOG_HEARTBEATS._value.get() == before + 1


async def test_a_backlog_already_reported_waits_out_the_period() -> None:
    loop = asyncio.get_running_loop()
    w = worker([0.5], heartbeat_interval_s=0.3, heartbeat_backlog_check_s=0.01)
    started = loop.time()
    await w._until_next_heartbeat(reported_wait_s=0.4)  # 0.5 s is not twice 0.4 s
    assert loop.time() - started >= 0.29
    off = worker([5.0], heartbeat_interval_s=0.3, heartbeat_backlog_check_s=0.0)
    started = loop.time()
    await off._until_next_heartbeat(reported_wait_s=0.0)  # the check is off
    assert loop.time() - started >= 0.29


async def test_asking_for_a_heartbeat_still_ends_the_wait_at_once() -> None:
    w = worker([0.0], heartbeat_interval_s=30.0, heartbeat_backlog_check_s=0.01)
    w.servicer.heartbeat_now.set()
    await asyncio.wait_for(w._until_next_heartbeat(reported_wait_s=0.0), timeout=10)
