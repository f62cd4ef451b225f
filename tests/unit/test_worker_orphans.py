"""A request left in the engine with no Generate call serving it is found, named and aborted."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

from services.worker.config import WorkerConfig
from services.worker.service import ORPHANS_ABORTED, WorkerServicer


class Engine:
    """What the watch reads of an engine: the requests queued or running, and abort."""

    def __init__(self, ids: set[str]) -> None:
        self.ids = set(ids)
        self.aborted: list[str] = []
        self.any_aborted = asyncio.Event()

    def active_request_ids(self) -> set[str]:
        return set(self.ids)

    def abort(self, request_id: str) -> None:
        self.aborted.append(request_id)
        self.ids.discard(request_id)
        self.any_aborted.set()


def servicer(engine: Engine, inflight: dict[str, int]) -> WorkerServicer:
    s = WorkerServicer(WorkerConfig())
    s.instance = SimpleNamespace(engine=engine)  # type: ignore[assignment]
    s._inflight = dict(inflight)
    return s


def test_orphans_are_the_engine_requests_no_call_serves() -> None:
    s = servicer(Engine({"served", "orphan"}), {"served": 1, "starting": 1})
    assert s.orphans() == {"orphan"}  # "starting" has not reached the engine yet: not an orphan
    s.instance = None
    assert s.orphans() == set()


def test_an_orphan_seen_at_two_sweeps_is_aborted_and_a_served_one_never() -> None:
    engine = Engine({"served", "orphan"})
    s = servicer(engine, {"served": 1})
    before = ORPHANS_ABORTED._value.get()
    seen = s.sweep_orphans(set(), 5.0)
    assert seen == {"orphan"} and engine.aborted == []  # once is not enough
    assert s.sweep_orphans(seen, 5.0) == set()
    assert engine.aborted == ["orphan"] and engine.ids == {"served"}
    assert ORPHANS_ABORTED._value.get() == before + 1


def test_a_request_whose_call_is_counted_between_sweeps_is_left_alone() -> None:
    engine = Engine({"late"})
    s = servicer(engine, {})
    seen = s.sweep_orphans(set(), 5.0)
    s._inflight["late"] = 1
    assert s.sweep_orphans(seen, 5.0) == set() and engine.aborted == []


async def test_the_watch_sweeps_on_its_own() -> None:
    engine = Engine({"orphan"})
    s = servicer(engine, {})
    watch = asyncio.create_task(s.watch_orphans(0.01))
    try:
        await asyncio.wait_for(engine.any_aborted.wait(), timeout=10)
    finally:
        watch.cancel()
    assert engine.aborted == ["orphan"]
