"""bench.autoscale's pool sizing and decision-log lines (pure parts of the autoscale benchmark)."""

from __future__ import annotations

import pytest

from bench.autoscale.__main__ import decision_log
from bench.autoscale.sizing import Profile, size_pools


def test_size_pools_from_profile() -> None:
    # cost = 0.002 * (100 + 20) + 0.05 * 20 / 5 = 0.44 s -> 2.27 req/s, 1.59 usable at 0.7.
    s = size_pools(
        Profile(0.05, 0.002),
        mean_rps=1.5,
        peak_rps=5.0,
        mean_prompt_tokens=100,
        mean_output_tokens=20,
        typical_batch=5,
        target_utilization=0.7,
    )
    assert s.request_cost_s == pytest.approx(0.44)
    assert s.capacity_rps == pytest.approx(1 / 0.44)
    assert (s.fixed_average, s.fixed_peak) == (1, 4)
    assert s.target_decode_tps_per_instance == pytest.approx(0.7 / 0.44 * 20)
    assert Profile(0.05, 0.002).worker_args() == ["--step-time-a-s", "0.05", "--step-time-b-s", "0.002"]
    # latency = (0.05 + 0.002 * 100) + 20 * (0.05 + 0.002 * 5) = 0.25 + 1.2 = 1.45 s; Little's law
    # at half the capacity: 1.45 s * 2.27 req/s * 0.5 = 1.65 requests in flight.
    assert s.latency_s == pytest.approx(1.45)
    assert s.requests_per_instance(0.5) == pytest.approx(1.45 / 0.44 * 0.5)


def test_size_pools_rejects_bad_inputs() -> None:
    with pytest.raises(ValueError, match="peak_rps"):
        size_pools(Profile(0.05, 0.002), mean_rps=3, peak_rps=2, mean_prompt_tokens=1, mean_output_tokens=1)
    with pytest.raises(ValueError, match="target_utilization"):
        size_pools(
            Profile(0.05, 0.002),
            mean_rps=1,
            peak_rps=2,
            mean_prompt_tokens=1,
            mean_output_tokens=1,
            target_utilization=0,
        )
    with pytest.raises(ValueError, match="profile"):
        Profile(0, 0)


def test_decision_log_lines() -> None:
    lines = decision_log(
        [
            {
                "t_s": 1.5,
                "action": "autoscaling_decision",
                "target": "scale_out",
                "status": "instances:1->2",
                "reason": "SCALE_OUT: ratio=1.2, hot",
                "instance_id": "",
            },
            {
                "t_s": 1.6,
                "action": "scale_out",
                "target": "small",
                "status": "loading",
                "reason": "r",
                "instance_id": "worker-1",
            },
        ]
    )
    assert lines == [
        "time,action,target,status,reason",
        "1.500,autoscaling_decision,scale_out,instances:1->2,SCALE_OUT: ratio=1.2; hot",
        "1.600,scale_out,small,loading,r [worker-1]",
    ]
