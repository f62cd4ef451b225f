"""bench.live_scaling's pure parts: the emulated links per setup, the load overhead, and the
tokens/s and k/L series of its figure."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from bench.live_scaling.__main__ import (
    DISAGG_LIVE_SETUPS,
    _links,
    _manager_args,
    best_live,
    combine,
    load_overheads,
    paired_ratio,
    replay_args,
)
from bench.live_scaling.plot import loading_series
from blitzmesh.replay import RequestRecord, token_rate


def test_links_follow_blitzscale_testbed_ratios() -> None:
    assert _links("zigzag", 0.4) == (0.4, 0.4)
    assert _links("sllm_hit", 0.4) == (0.4, pytest.approx(0.512))  # PCIe 256 : RDMA 200
    assert _links("sllm_miss", 0.4) == (0.4, pytest.approx(0.02))  # SSD 10 : RDMA 200
    assert _links("instant_load", 0.4) == (pytest.approx(40.0), pytest.approx(40.0))  # the floor: loads ~free


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


def test_token_rate_counts_the_prompt_at_the_first_token_and_spreads_the_output() -> None:
    done = RequestRecord(0, 0.0, prompt_tokens=100, max_tokens=20, sent_s=0.5, outcome="ok", ttft_s=0.5)
    done.completion_tokens, done.end_s = 20, 3.0  # 20 tokens over [1.0, 3.0): 10 per second
    failed = RequestRecord(1, 0.0, prompt_tokens=999, max_tokens=5, sent_s=0.0, outcome="error")
    assert token_rate([done, failed], bin_s=1.0, end_s=4.0) == [0.0, 110.0, 10.0, 0.0]
    assert token_rate([done], bin_s=2.0, end_s=4.0) == [55.0, 5.0]
    with pytest.raises(ValueError, match="0"):
        token_rate([done], bin_s=0, end_s=1.0)


def test_loading_series_follows_each_instance() -> None:
    samples = [(1.0, {"w1": 0.25}), (1.5, {"w1": 0.5, "w2": 0.0}), (2.0, {"w2": 0.5})]
    assert loading_series(samples) == {"w1": ([1.0, 1.5], [0.25, 0.5]), "w2": ([1.5, 2.0], [0.0, 0.5])}


def _run(p99: float, lost: int = 0, overheads: tuple[float, ...] = (1.0,)) -> dict[str, object]:
    fields = dict.fromkeys(
        ("ttft_p50_s", "tbt_p99_s", "slo_attainment", "instance_seconds", "served_while_loading", "borrowed"), 1.0
    )
    return {
        **fields,
        "ttft_p99_s": p99,
        "lost": lost,
        "completed": 10,
        "requests_sent": 10,
        "load_overhead": list(overheads),
        "tokens_per_s": [p99],
    }


def test_repeats_combine_to_medians_and_sums_and_keep_every_run() -> None:
    runs = [_run(8.0, overheads=(1.1,)), _run(6.0, lost=1, overheads=(1.0, 1.2)), _run(7.0)]
    out = combine(runs)
    assert out["ttft_p99_s"] == 7.0 and out["lost"] == 1 and out["completed"] == 30
    assert out["load_overhead"] == [1.1, 1.0, 1.2, 1.0]
    assert out["tokens_per_s"] == [8.0]  # the figure's series: the first repeat's
    assert [r["ttft_p99_s"] for r in out["runs"]] == [8.0, 6.0, 7.0] and "tokens_per_s" not in out["runs"][0]
    assert combine([runs[0]]) is runs[0]
    # Two repeats: the mean of the two, not the lower one.
    assert combine(runs[:2])["ttft_p99_s"] == 7.0


def test_ratio_targets_pair_the_repeats_run_side_by_side() -> None:
    zz, stw = [_run(4.0), _run(9.0)], [_run(8.0), _run(10.0)]
    out = paired_ratio(zz, stw, 0.5)
    assert out["per_repeat"] == [0.5, 0.9] and out["value"] == 0.7 and out["met"] is False
    assert "met" not in paired_ratio(zz, stw, None)


def test_hand_back_is_zigzag_with_the_hand_back_on_and_zigzag_has_it_off() -> None:
    assert {"--zigzag", "--zigzag-hand-back"} <= set(_manager_args("hand_back"))
    assert {"--zigzag", "--no-zigzag-hand-back"} <= set(_manager_args("zigzag"))
    assert {"--no-zigzag", "--no-zigzag-hand-back"} <= set(_manager_args("stop_the_world"))


def test_the_best_live_setup_is_the_lowest_median_ratio_over_stop_the_world() -> None:
    stw = [_run(10.0), _run(10.0), _run(10.0)]
    by_setup = {
        "stop_the_world": stw,
        "zigzag": [_run(8.0), _run(9.0), _run(7.0)],
        "hand_back": [_run(5.0), _run(7.0), _run(6.0)],
        "instant_load": [_run(1.0), _run(1.0), _run(1.0)],  # the floor, not a live setup
    }
    out = best_live(by_setup)
    assert out == {"value": 0.6, "per_repeat": [0.5, 0.7, 0.6], "target": 0.6, "met": True, "setup": "hand_back"}
    assert best_live({"zigzag": stw}) is None
    assert best_live({"stop_the_world": stw, "instant_load": stw}) is None


def test_disaggregated_setups_switch_zigzag_and_borrowed_prefill() -> None:
    assert {"--no-zigzag", "--no-borrow-prefill"} <= set(_manager_args("disagg_stop_the_world"))
    assert {"--zigzag", "--no-borrow-prefill", "--no-zigzag-hand-back"} <= set(_manager_args("disagg_zigzag"))
    assert {"--zigzag", "--borrow-prefill"} <= set(_manager_args("disagg_borrowed"))
    # Borrowing is for split deployments: every colocated setup has it off.
    assert all("--no-borrow-prefill" in _manager_args(s) for s in ("stop_the_world", "zigzag", "hand_back"))


def test_the_disaggregated_best_live_setup_is_over_disaggregated_stop_the_world() -> None:
    by_setup = {
        "stop_the_world": [_run(1.0), _run(1.0), _run(1.0)],
        "zigzag": [_run(0.1), _run(0.1), _run(0.1)],  # colocated: not a disaggregated setup
        "disagg_stop_the_world": [_run(10.0), _run(10.0), _run(10.0)],
        "disagg_zigzag": [_run(9.0), _run(9.0), _run(8.0)],
        "disagg_borrowed": [_run(5.0), _run(8.0), _run(7.0)],
    }
    out = best_live(by_setup, live=DISAGG_LIVE_SETUPS, baseline="disagg_stop_the_world")
    assert out == {"value": 0.7, "per_repeat": [0.5, 0.8, 0.7], "target": 0.6, "met": False, "setup": "disagg_borrowed"}
    assert best_live({"disagg_borrowed": by_setup["disagg_borrowed"]}, live=DISAGG_LIVE_SETUPS) is None


def test_the_replay_arguments_have_every_field_the_shared_runner_reads() -> None:
    """`bench.autoscale.run_all` (and the replay it starts) read their command line's fields;
    this bench passes its own. A field added there and not here broke every setup at start."""
    source = Path(__file__).resolve().parents[2] / "bench" / "autoscale" / "__main__.py"
    tree = ast.parse(source.read_text(encoding="utf-8"))
    read: set[str] = set()
    for fn in tree.body:
        if isinstance(fn, ast.AsyncFunctionDef | ast.FunctionDef) and fn.name in ("run_all", "_replay"):
            read |= {
                n.attr
                for n in ast.walk(fn)
                if isinstance(n, ast.Attribute) and isinstance(n.value, ast.Name) and n.value.id == "args"
            }
    assert {"warmup", "model", "ttft_slo_s"} <= read
    args = replay_args(quick=True)
    assert read <= set(vars(args)), sorted(read - set(vars(args)))
    assert args.warmup is False  # a warm-up would load every worker before the setup's own loads
