"""The burst command's pure parts: which slice of the trace it replays, the lines it prints, and
the flags it refuses."""

from __future__ import annotations

from pathlib import Path

import pytest

from blitzmesh import ClusterEvent, ClusterState, InstanceInfo, LoadReport
from blitzmesh.replay.schedule import TokenScaling
from blitzmesh.replay.trace import TraceRow
from services.mesh.burst import ZigzagTally, busiest_bin, format_cluster, format_event, parse_args, plan_burst, thin_for


def rows_at(*times_s: float) -> list[TraceRow]:
    return [TraceRow(t, 320, 20) for t in times_s]


def test_the_busiest_bin_and_the_thinning_to_a_peak_rate() -> None:
    # A lull, then 30 requests in [20, 30), then 5 in [30, 40).
    rows = rows_at(0.5, 5.0, *(20 + i / 3 for i in range(30)), *(30 + i for i in range(5)))
    assert busiest_bin(rows, 10.0) == (20.0, 3.0)
    assert busiest_bin(rows_at(1, 2, 11, 12), 10.0) == (0.0, 0.2)  # the earliest of equals
    assert [thin_for(32.7, 8), thin_for(3.0, 8), thin_for(30.0, 10)] == [4, 1, 3]
    plan = plan_burst(
        rows, peak_rps=1.0, lead_s=15.0, span_s=20.0, bin_s=10.0, scaling=TokenScaling(), max_requests=100
    )
    assert (plan.window.start_s, plan.window.span_s, plan.window.thin, plan.window.compress) == (5.0, 20.0, 3, 1.0)
    assert (plan.busiest_start_s, plan.busiest_rps) == (20.0, 3.0)
    # Trace [5, 25) at real speed, every 3rd request: the one at 5 s, then the burst's 3rd, 6th, ...
    assert [round(a.t_s, 3) for a in plan.arrivals] == [0.0, 15.667, 16.667, 17.667, 18.667, 19.667]
    assert {(a.prompt_tokens, a.output_tokens) for a in plan.arrivals} == {(20, 20)}  # 320 / 16
    with pytest.raises(ValueError, match="peak_rps must be > 0, got 0"):
        thin_for(3.0, 0)
    with pytest.raises(ValueError, match="lead_s >= 0 and span_s > 0, got -1"):
        plan_burst(rows, peak_rps=1, lead_s=-1, span_s=1, bin_s=10, scaling=TokenScaling(), max_requests=1)


def test_events_of_the_scale_out_are_printed_with_their_reasons() -> None:
    decision = ClusterEvent(
        3.0, "autoscaling_decision", "scale_out", "instances:1->3", "SCALE_OUT: ratio=2.5 > 1.1 need=2.5"
    )
    assert format_event(decision, 12.34) == (
        "   12.3s  decision      scale_out instances:1->3: SCALE_OUT: ratio=2.5 > 1.1 need=2.5"
    )
    live = ClusterEvent(4.0, "live_scaling", "m", "3/30", "the tail of its chain serves", "worker-1")
    assert (
        format_event(live, 13.0)
        == "   13.0s  live_scaling  worker-1 serves with 3/30 layers: the tail of its chain serves"
    )
    pair = ClusterEvent(4.5, "zigzag_pair", "m", "worker-0", "every SERVING instance has requests waiting", "worker-1")
    line = format_event(pair, 13.5)
    assert line is not None and "worker-1 runs the first layers, worker-0 the rest: every SERVING" in line
    zero = ClusterEvent(1.0, "scale_from_zero", "m", "loading", "scale_from_zero: request 'r'", "worker-2")
    assert format_event(zero, 1.0) == "    1.0s  scale_from_zero worker-2 loading: scale_from_zero: request 'r'"
    loaded = ClusterEvent(9.0, "load_result", "m", "ok", "load_s=4.200", "worker-1")
    assert format_event(loaded, 20.0) == "   20.0s  load_result   worker-1 ok: load_s=4.200"
    # State changes repeat what the actions said.
    assert format_event(ClusterEvent(5.0, "instance_state", "m", "SERVING", "LOADING->SERVING", "w"), 1.0) is None


def test_cluster_lines_show_k_of_l_requests_and_zigzag() -> None:
    def state(continued: int, relayed: int) -> ClusterState:
        return ClusterState(
            instances=(
                InstanceInfo(
                    "worker-0",
                    model_id="m",
                    state="serving",
                    layers_loaded=30,
                    num_layers=30,
                    load=LoadReport(running=8, waiting=5, zigzag_continued_total=continued),
                ),
                InstanceInfo(
                    "worker-1",
                    model_id="m",
                    state="loading",
                    layers_loaded=12,
                    num_layers=30,
                    load=LoadReport(running=2, zigzag_running=2, zigzag_relayed_total=relayed),
                ),
                InstanceInfo("worker-2", state="idle"),
                InstanceInfo("worker-3", model_id="other", state="serving"),
            ),
            policy="heteroscale",
        )

    tally = ZigzagTally()
    tally.update(state(10, 4))  # counters from before the watch do not count
    tally.update(state(13, 6))
    assert (tally.continued, tally.relayed) == (3, 2)
    assert format_cluster(state(13, 6), "m", 7.25, tally) == (
        "    7.2s  cluster       2 held, 1 idle: worker-0 serving run=8 wait=5 | "
        "worker-1 loading 12/30 run=2 wait=0 zigzag=2 || zigzag done 3 (relayed 2)"
    )
    # A worker that reloaded its engine starts its counters again: what it counted since is added.
    tally.update(state(1, 0))
    assert (tally.continued, tally.relayed) == (4, 2)
    empty = ClusterState(instances=(InstanceInfo("worker-0", state="idle"),))
    assert "0 held, 1 idle: no instance" in format_cluster(empty, "m", 0.0, ZigzagTally())


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--peak-rps", "0"], "--peak-rps must be > 0, got 0.0"),
        (["--span-s", "-5"], "--span-s must be > 0, got -5.0"),
        (["--tail-s", "-1"], "--tail-s must be >= 0, got -1.0"),
        (["--max-requests", "0"], "--max-requests must be >= 1, got 0"),
        (["--gateway", "127.0.0.1:8000"], "--gateway must be an http(s) URL, got '127.0.0.1:8000'"),
        (["--trace", "/nonexistent/trace.csv"], "--trace '/nonexistent/trace.csv' is not a file"),
    ],
)
def test_bad_flags_are_refused_quoting_the_values(
    argv: list[str], message: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    trace = tmp_path / "trace.csv"
    trace.write_text("TIMESTAMP,ContextTokens,GeneratedTokens\n2023-11-16 18:17:03.9799600,4808,10\n")
    with pytest.raises(SystemExit):
        parse_args(["--trace", str(trace), *argv])
    assert message in capsys.readouterr().err
    assert parse_args(["--trace", str(trace)]).gateway == "http://127.0.0.1:8000"
