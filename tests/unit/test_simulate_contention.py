"""bench.simulate's opt-in CPU contention (`cpu.py`): paced steps, compute shared on a host."""

from __future__ import annotations

import pytest

from bench.simulate.cpu import HostCpu
from bench.simulate.events import EventLoop
from bench.simulate.profiles import ModelSpec, SimProfile
from bench.simulate.worker import SimRequest, SimWorker
from services.common.worker_profile import StepTimeModel

PACE_S = 0.05  # every step paced at 0.05 s
COMPUTE_S = 0.1  # ... but computing 0.1 CPU-seconds, more than the pace


def _profile() -> SimProfile:
    return SimProfile(
        device="test",
        model=ModelSpec("m", 1000, 2, 16),
        step=StepTimeModel(base_s=PACE_S, prefill_token_s=0.0, decode_row_s=0.0),
        max_batch=4,
        max_num_tokens=64,
        kv_blocks=64,
        block_size=16,
        source="emulated",
        source_ref="test",
    )


def _step_times(workers: int, *, cores: float | None, compute_s: float = COMPUTE_S) -> list[list[float]]:
    """Each worker decodes one request of 5 tokens (5 steps) from t=0; the steps' durations."""
    loop = EventLoop()
    cpu = None if cores is None else HostCpu(loop, cores)
    sims = [
        SimWorker(
            f"w{i}",
            "h0",
            _profile(),
            loop,
            lambda r: None,
            lambda r: None,
            lambda iid: None,
            cpu=cpu,
            cpu_step=(compute_s, 0.0),
        )
        for i in range(workers)
    ]
    for i, w in enumerate(sims):
        w.submit(SimRequest(index=i, arrival_s=0.0, prompt=8, output=5))
    loop.run(100.0)
    out = []
    for w in sims:
        assert w.empty
        out.append(w.stats.tbts)
    return out


def test_two_workers_on_one_core_take_twice_as_long_per_step_as_one_alone() -> None:
    alone = _step_times(1, cores=1.0)
    shared = _step_times(2, cores=1.0)
    # Alone: compute (0.1 s) exceeds the pace (0.05 s), so a step lasts its compute.
    assert alone[0] == pytest.approx([COMPUTE_S] * 4)
    for tbts in shared:
        assert tbts == pytest.approx([2 * COMPUTE_S] * 4)
    # Two cores for two workers: no stretch.
    for tbts in _step_times(2, cores=2.0):
        assert tbts == pytest.approx([COMPUTE_S] * 4)


def test_the_pace_is_a_floor_and_contention_only_matters_above_it() -> None:
    # Compute 0.02 s: alone and shared (0.04 s each on one core) stay under the 0.05 s pace.
    for tbts in _step_times(2, cores=1.0, compute_s=0.02):
        assert tbts == pytest.approx([PACE_S] * 4)


def test_off_changes_nothing() -> None:
    for tbts in _step_times(2, cores=None):
        assert tbts == pytest.approx([PACE_S] * 4)


def test_processor_sharing_is_recomputed_when_a_job_joins() -> None:
    loop = EventLoop()
    cpu = HostCpu(loop, 1.0)
    done: dict[str, float] = {}
    cpu.start("a", 1.0, lambda: done.setdefault("a", loop.now_s))
    loop.at(0.5, lambda: cpu.start("b", 1.0, lambda: done.setdefault("b", loop.now_s)))
    loop.run(10.0)
    # a: 0.5 alone, then 0.5 more at half speed (ends 1.5); b: 0.5 by then, 0.5 alone (2.0).
    assert done == pytest.approx({"a": 1.5, "b": 2.0})
