"""bench.live_scaling's pure parts: the emulated links per setup and the load overhead."""

from __future__ import annotations

import pytest

from bench.live_scaling.__main__ import _links, _manager_args, load_overheads


def test_links_follow_blitzscale_testbed_ratios() -> None:
    assert _links("zigzag", 0.4) == (0.4, 0.4)
    assert _links("sllm_hit", 0.4) == (0.4, pytest.approx(0.512))  # PCIe 256 : RDMA 200
    assert _links("sllm_miss", 0.4) == (0.4, pytest.approx(0.02))  # SSD 10 : RDMA 200


def test_setups_switch_zigzag_and_chains() -> None:
    assert "--zigzag" in _manager_args("zigzag") and "--no-zigzag" in _manager_args("stop_the_world")
    assert "--no-transfer-plans" in _manager_args("sllm_miss")
    assert "--no-transfer-plans" not in _manager_args("stop_the_world")


def test_load_overhead_is_decision_to_serving_over_bytes_per_rate() -> None:
    events = [
        {"t_s": 1.0, "action": "scale_out", "status": "loading", "instance_id": "w1"},
        {"t_s": 1.0, "action": "scale_out", "status": "loading", "instance_id": "w2"},
        {"t_s": 3.0, "action": "load_result", "status": "ok", "instance_id": "w1"},
        {"t_s": 9.0, "action": "load_result", "status": "failed", "instance_id": "w2"},
    ]
    # 1 Gbit at 0.5 Gbit/s is 2 s ideal; w1 took 2 s; w2 never served.
    assert load_overheads(events, model_bytes=125_000_000, link_gbps=0.5) == [1.0]
