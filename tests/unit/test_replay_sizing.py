"""bench.autoscale's pool sizing and decision-log lines (pure parts of the autoscale benchmark)."""

from __future__ import annotations

import random

import pytest

from bench.autoscale.__main__ import autoscale_targets, decision_log, parse_args, warm_instance_seconds
from bench.autoscale.sizing import Profile, size_pools
from services.global_manager.core.reconcile import KEEP_WARM_NOTE, kept_warm_s


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


def _runs(slo: dict[str, float], inst_s: dict[str, float], lost: int = 0) -> dict[str, dict]:
    return {
        n: {"summary": {"slo_attainment": slo[n], "instance_seconds": inst_s[n], "lost": lost}}
        for n in ("autoscaled", "fixed_average", "fixed_peak")
    }


def test_the_autoscale_target_is_the_median_of_paired_differences() -> None:
    inst = {"autoscaled": 140.0, "fixed_average": 120.0, "fixed_peak": 200.0}
    repeats = [
        _runs({"autoscaled": 0.85, "fixed_average": 0.70, "fixed_peak": 0.99}, inst),  # +0.15
        _runs({"autoscaled": 0.80, "fixed_average": 0.75, "fixed_peak": 0.99}, inst),  # +0.05
        _runs({"autoscaled": 0.90, "fixed_average": 0.78, "fixed_peak": 0.99}, {**inst, "autoscaled": 210.0}),
    ]
    t = autoscale_targets(repeats)
    gain = t["slo_autoscaled_minus_fixed_average"]
    assert gain["per_repeat"] == [0.15, 0.05, 0.12]
    assert gain["value"] == 0.12 and gain["met"] is True
    cost = t["instance_seconds_autoscaled_over_fixed_peak"]
    assert cost["per_repeat"] == [0.7, 0.7, 1.05] and cost["value"] == 0.7 and cost["met"] is True
    assert t["lost"] == {"value": 0, "target": 0}
    # Two repeats: the median is the mean of the two, and under the target here.
    two = autoscale_targets(repeats[1:])
    assert two["slo_autoscaled_minus_fixed_average"]["value"] == pytest.approx(0.085)
    assert two["slo_autoscaled_minus_fixed_average"]["met"] is False
    assert autoscale_targets([{"autoscaled": repeats[0]["autoscaled"]}]) == {}


def test_repeats_below_one_is_refused_quoting_the_value(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        parse_args(["--repeats", "0"])
    assert "--repeats must be at least 1, got 0" in capsys.readouterr().err
    assert parse_args(["--repeats", "3"]).repeats == 3


def test_a_negative_step_budget_is_refused_quoting_the_value(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        parse_args(["--max-num-tokens", "-5"])
    assert "--max-num-tokens must be 0 (the worker's default) or more, got -5" in capsys.readouterr().err
    assert parse_args([]).max_num_tokens == 256 and parse_args(["--max-num-tokens", "0"]).max_num_tokens == 0


def test_warm_instance_seconds_run_from_the_drain_to_the_reload_or_the_keep_time() -> None:
    def ev(t: float, action: str, status: str, iid: str, reason: str = "") -> dict[str, object]:
        return {"t_s": t, "action": action, "target": "m", "status": status, "reason": reason, "instance_id": iid}

    keeps = "SCALE_IN: ratio=0.1" + KEEP_WARM_NOTE.format(2.0)
    events = [
        ev(10.0, "scale_in", "draining", "a", keeps),
        ev(10.5, "drain_result", "idle", "a"),
        ev(11.0, "scale_out", "loading", "a"),  # reloaded 0.5 s after its drain: 0.5
        ev(20.0, "scale_in", "draining", "b", keeps),
        ev(21.0, "drain_result", "idle", "b"),  # never reloaded: its whole 2 s
        ev(30.0, "scale_in", "draining", "c", "SCALE_IN: nothing kept"),
        ev(30.1, "drain_result", "idle", "c"),
        ev(31.0, "scale_in", "draining", "d", keeps),
        ev(39.5, "drain_result", "idle", "d"),  # the run ends 0.5 s later: 0.5
    ]
    assert kept_warm_s(keeps) == 2.0 and kept_warm_s("SCALE_IN: nothing kept") == 0.0
    assert warm_instance_seconds(events, end_s=40.0) == pytest.approx(0.5 + 2.0 + 0.5)
    assert warm_instance_seconds([], end_s=40.0) == 0.0


def test_no_run_replays_a_prompt_block_another_run_or_the_warm_up_cached() -> None:
    """The runs share a mesh, and an instance kept across a resize keeps its prefix cache: each
    run (and the warm-up) draws its prompts from its own seed, so no 16-token block of one run's
    prompts is a block another replay already computed."""
    from bench.autoscale.__main__ import PROMPT_SEEDS
    from blitzmesh.replay.runner import prompt_ids

    lengths = [16 * k + 5 for k in range(1, 40)]  # whole blocks and a tail, as the quick trace's prompts

    def blocks(seed: int) -> set[tuple[int, ...]]:
        rng = random.Random(seed)
        out: set[tuple[int, ...]] = set()
        for n in lengths:
            ids = prompt_ids(n, 2048, rng)
            out |= {tuple(ids[: i + 16]) for i in range(0, n - 15, 16)}  # a block's key is its whole prefix
        return out

    seeds = list(PROMPT_SEEDS.values())
    assert len(set(seeds)) == len(seeds)
    seen = [blocks(s) for s in seeds]
    for i in range(len(seen)):
        for j in range(i + 1, len(seen)):
            assert not seen[i] & seen[j], (seeds[i], seeds[j])
    assert blocks(seeds[0]) == seen[0]  # deterministic: a rerun replays the same prompts
