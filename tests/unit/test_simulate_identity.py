"""bench.simulate's speed work changes no decision: the `churn64` scenario (hour1000 in
miniature, bench/simulate/scenarios.py) gives the recorded run exactly.

The digest covers the whole outcome: the core's decision log, every event it reported (all its
fields), every request's TTFT, end time, instance, tokens and resumes (floats
as `repr`, so bit for bit), and the summary (SLO attainment, TTFT and TBT percentiles,
instance-seconds, loads, actions, ZigZag and KV figures). Only the simulator's own cost is left
out: its wall time and its event count (coalescing events that change nothing is allowed).

`RECORDED` was produced by running `_digest` on the simulator before the speed work (commit
2f80865, the one this test was added on). Change it only with a change that is meant to change
decisions, and say so in that commit; a speed-up that moves it has changed the simulation.
"""

from __future__ import annotations

import hashlib
import json
from typing import Any

import pytest

from bench.simulate.cluster import Simulation
from bench.simulate.scenarios import SCENARIOS, build_runs

pytestmark = [pytest.mark.timeout(120), pytest.mark.filterwarnings("error")]

RECORDED = "e4d33731abee18268649b896fa3cfc5bc39d52c0a69d5f2ce49287ef1e648632"


def _run() -> tuple[Simulation, dict[str, Any]]:
    sc = SCENARIOS["churn64"]
    (cfg,), _ = build_runs(sc, sc.variants)
    sim = Simulation(cfg)
    summary = sim.run()
    return sim, summary


def _digest(sim: Simulation, summary: dict[str, Any]) -> str:
    outcome = {k: v for k, v in summary.items() if k not in ("sim_wall_s", "sim_events")}
    h = hashlib.sha256()
    h.update("\n".join(sim.decision_log).encode())
    h.update(repr(sim.events).encode())
    h.update(
        repr([(r.index, r.first_token_s, r.end_s, r.worker, r.generated, r.resumed) for r in sim.requests]).encode()
    )
    h.update(json.dumps(outcome, sort_keys=True).encode())
    return h.hexdigest()


def test_churn64_gives_the_recorded_decisions_and_results() -> None:
    sim, summary = _run()
    actions, zigzag = summary["actions"], summary["zigzag"]
    # What the scenario is there to exercise: if a change to the scenario loses one of these,
    # the digest no longer covers it.
    assert actions.get("drain:resumed", 0) > 0  # drains taken back by a scale-out
    assert actions.get("rebalance:moved", 0) > 0
    assert actions.get("live_migration", 0) > 0  # ZigZag hand-backs
    assert actions.get("backlog_heartbeats", 0) > 0  # the workers' early reports, the queue trigger's input
    assert zigzag["assisted_requests"] > 0 and zigzag["loading_instances_paired"] > 0
    assert summary["loads"]["warm"] > 0  # loads onto kept weights
    assert _digest(sim, summary) == RECORDED
