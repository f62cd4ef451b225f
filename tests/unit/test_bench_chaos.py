"""bench.chaos: which tests the runner picks, and how its summary counts fault kinds."""

from __future__ import annotations

import pytest

from bench.chaos.__main__ import TARGET_KINDS, pytest_args, summarize
from tests.chaos.faults import FAULTS


def row(fault: str, **kw: int) -> dict[str, object]:
    return {"fault": fault, "lost": 0, "hung": 0, "rolled_back": 0, **kw}


def test_summary_counts_only_matrix_kinds_with_nothing_lost_and_no_rollback() -> None:
    rows = [
        row("worker_sigstop"),
        row("chain_hop_killed", rolled_back=1),
        row("default_topology_worker_sigstop"),
        row("default_topology_gateway_sigstop", lost=2),
        row("default_topology_only_serving_worker_sigkill"),
        row("link_rate_collapse"),
    ]
    s = summarize(rows)
    assert s["four"]["passed"] == ["worker_sigstop"] and s["four"]["kinds"] == 1
    assert s["four"]["failed"] == {"chain_hop_killed": "rolled_back=1"}
    assert len(s["four"]["not_run"]) == len(FAULTS) - 2
    assert s["default"]["passed"] == ["worker_sigstop"]
    assert s["default"]["failed"] == {"gateway_sigstop": "lost=2"}
    # The default topology's own tests are listed, not counted as kinds.
    assert list(s["default_topology_own_tests"]) == ["default_topology_only_serving_worker_sigkill"]
    assert list(s["below_the_mesh"]) == ["link_rate_collapse"] and not s["four"]["meets_target"]
    assert s["target_kinds"] == TARGET_KINDS == 16


def test_a_kind_this_run_left_without_a_row_is_failed_not_passed_on_its_old_row() -> None:
    rows = [
        {**row("worker_sigstop"), "at": "2026-11-27T14:30:00Z"},
        {**row("chain_hop_killed"), "at": "2026-11-27T07:00:00Z"},  # failed before its row this run
        {**row("gateway_sigstop"), "at": "2026-11-27T07:00:00Z"},  # not in this run: its row stands
    ]
    s = summarize(rows, "2026-11-27T14:00:00Z", frozenset({"worker_sigstop", "chain_hop_killed"}))
    assert s["four"]["passed"] == ["gateway_sigstop", "worker_sigstop"]
    assert "no row from this run" in s["four"]["failed"]["chain_hop_killed"]
    assert "2026-11-27T07:00:00Z" in s["four"]["failed"]["chain_hop_killed"]


def test_runner_picks_each_kind_in_each_topology() -> None:
    ids = pytest_args(["four", "default"], [])
    for kind in FAULTS:
        assert f"tests/chaos/test_matrix.py::test_fault[four-{kind.name}]" in ids
        assert f"tests/chaos/test_matrix.py::test_fault[default-{kind.name}]" in ids
    assert "tests/chaos/test_default_topology.py" in ids and "tests/chaos/test_full_disk.py" in ids
    assert pytest_args(["default"], ["gateway_sigstop"]) == [
        "tests/chaos/test_matrix.py::test_fault[default-gateway_sigstop]"
    ]


def test_runner_refuses_an_unknown_kind_by_name() -> None:
    with pytest.raises(SystemExit, match="'no_such_fault'"):
        pytest_args(["four"], ["no_such_fault"])
