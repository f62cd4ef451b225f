"""The ESP scenario of the simulator (bench/simulate/esp.py): it drives the global manager's ESP
core, its KV accounting balances, a long prompt prefills on a group, and each strategy's
timing follows the emulated step-time model."""

from __future__ import annotations

import dataclasses

import pytest

from bench.simulate.esp import EspScenario, Req, simulate, summarize
from bench.simulate.profiles import PUBLISHED_PROFILES, FastStep

PROFILE = PUBLISHED_PROFILES["a100-llama3-8b"]
SC = EspScenario(instances=8)


def _reqs(spec: list[tuple[float, int, int]]) -> list[Req]:
    return [Req(i, t, p, o) for i, (t, p, o) in enumerate(spec)]


def test_a_long_prompt_prefills_on_a_group_of_the_cores_degree() -> None:
    esp = simulate("esp", _reqs([(0.0, 100_000, 16)]), PROFILE, SC)
    chunked = simulate("chunked", _reqs([(0.0, 100_000, 16)]), PROFILE, SC)
    assert esp.degrees == [(0.0, 8, 1)]  # every instance idle: the DP takes the largest degree
    step = FastStep(PROFILE.step)
    alone = step(100_000, 100_000 * 100_001 / 2, 1, 0, 0)
    ttft_esp, ttft_chunked = esp.reqs[0].first, chunked.reqs[0].first
    assert ttft_esp is not None and ttft_chunked is not None
    assert ttft_chunked >= alone  # one instance, in chunks: at least the work done alone
    assert ttft_esp < alone / 6  # the work split over 8, plus the group's fixed costs
    for sim in (esp, chunked):
        assert sim.reqs[0].done is not None and sim.reqs[0].generated == 16


def test_every_request_completes_and_the_kv_balances() -> None:
    spec = [(0.1 * i, [900, 30_000, 4_000, 120_000][i % 4], 64) for i in range(24)]
    for strategy in ("esp", "chunked", "disagg"):
        sim = simulate(strategy, _reqs(spec), PROFILE, SC)
        out = summarize(sim)
        assert out["completed"] == 24, strategy
        assert all(n.used == 0 for n in sim.nodes), strategy
        assert all(n.ctx == 0 for n in sim.nodes), strategy
        assert out["longest_prompt_served"] == 120_000
    esp = summarize(simulate("esp", _reqs(spec), PROFILE, SC))
    assert esp["core_decisions"] > 0
    sim = simulate("esp", _reqs(spec), PROFILE, SC)
    assert sum(k for _, _, k in sim.degrees) == 24  # each request prefilled once, in the core's batches


def test_disaggregation_decodes_after_the_kv_transfer() -> None:
    sim = simulate("disagg", _reqs([(0.0, 50_000, 4)]), PROFILE, SC)
    r = sim.reqs[0]
    transfer = 50_000 * PROFILE.model.kv_bytes_per_token / (SC.link_gbps / 8 * 1e9)
    assert r.first is not None and r.done is not None
    assert r.ready == pytest.approx(r.first + transfer)
    assert r.done > r.ready  # the 3 remaining tokens after the KV arrived


def test_a_group_never_outgrows_the_instances() -> None:
    sc = dataclasses.replace(SC, instances=2)
    sim = simulate("esp", _reqs([(0.0, 100_000, 4)]), PROFILE, sc)
    assert sim.degrees == [(0.0, 2, 1)]


def test_an_unknown_strategy_is_named() -> None:
    with pytest.raises(ValueError, match="'static'"):
        simulate("static", _reqs([(0.0, 10, 1)]), PROFILE, SC)
