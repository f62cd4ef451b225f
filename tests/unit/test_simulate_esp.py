"""The ESP scenario of the simulator (bench/simulate/esp.py): it drives the global manager's ESP
core, its KV accounting balances, a long prompt prefills on a group, and each strategy's
timing follows the emulated step-time model."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from bench.simulate.esp import (
    REGIMES,
    REPO_ROOT,
    EspScenario,
    Req,
    _Sim,
    compute_bound_rps,
    core_models,
    regime_suffix,
    run,
    run_regimes,
    set_slo,
    simulate,
    summarize,
    workload,
)
from bench.simulate.plots import plot_esp_degrees
from bench.simulate.profiles import PUBLISHED_PROFILES, FastStep, lwm_1m_a100
from blitzmesh.replay.trace import read_azure_trace

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
    # Prompts within one iteration's token budget (8,192) take the ordinary route; the others are
    # each prefilled once, in the core's batches.
    sim = simulate("esp", _reqs(spec), PROFILE, SC)
    assert sum(k for _, _, k in sim.degrees) == 12
    core = simulate("esp", _reqs(spec), PROFILE, dataclasses.replace(SC, esp_min_prompt=0))
    assert sum(k for _, _, k in core.degrees) == 24  # esp_min_prompt=0: every request through the core
    assert summarize(core)["completed"] == 24 and all(n.used == 0 and n.ctx == 0 for n in core.nodes)


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


# -- LoongServe's regime: LWM-Text-1M (multi-head KV) and its evaluation mixes ----------------------

LWM = PUBLISHED_PROFILES["a100-lwm-1m"]
ROWS = [(500, 100), (1500, 300)]


def test_the_lwm_profile_has_four_times_the_kv_per_token_and_loongserves_capacity() -> None:
    assert LWM.model.kv_bytes_per_token == 2 * 32 * 32 * 128 * 2 == 4 * PROFILE.model.kv_bytes_per_token
    tokens = LWM.kv_blocks * LWM.block_size
    assert tokens == 111_616  # (72 GB - 13.48 GB of weights) / 524,288 B, in blocks of 16
    assert abs(tokens - 110_000) / 110_000 < 0.02  # LoongServe's launcher: 110,000 on one GPU
    two = lwm_1m_a100(2)
    assert two.kv_blocks * two.block_size > 200_000 + 1024  # TP=2 holds the Zipf mix's longest
    assert FastStep(two.step)(8192, 0, 0, 0, 0) < FastStep(LWM.step)(8192, 0, 0, 0, 0)
    with pytest.raises(ValueError, match="got 0"):
        lwm_1m_a100(0)


def test_the_zipf_mix_is_loongserves() -> None:
    sc = REGIMES["lwm1m"]
    prompts = sorted(r.prompt for r in workload(ROWS, 4000, 1.0, 0, sc))
    assert prompts[0] >= 10 and prompts[-1] < 200_000
    # Weight 1 / l over [10, 200,000): log-uniform, median sqrt(10 x 200,000) ~ 1,414, and
    # ln(200,000 / 111,616) / ln(20,000) = 5.9 % beyond one instance's KV.
    assert 1_100 < prompts[len(prompts) // 2] < 1_800
    beyond = sum(p > LWM.kv_blocks * LWM.block_size for p in prompts) / len(prompts)
    assert 0.045 < beyond < 0.075


def test_the_lveval_mix_spans_its_five_levels() -> None:
    sc = REGIMES["lwm1m-lveval"]
    prompts = [r.prompt for r in workload(ROWS, 3000, 1.0, 0, sc)]
    assert min(prompts) >= round(11_896 * 1.3) - 1 and max(prompts) <= round(387_406 * 1.3) + 1
    assert 135_000 < sum(prompts) / len(prompts) < 155_000  # 1.13 x 99,200 words x 1.3
    assert sum(p < 30_000 for p in prompts) > 300 and sum(p > 400_000 for p in prompts) > 100


def test_an_unknown_mix_is_named() -> None:
    with pytest.raises(ValueError, match="'sharegpt'"):
        workload(ROWS, 1, 1.0, 0, dataclasses.replace(SC, mix="sharegpt"))


def test_a_prompt_no_instance_holds_is_refused_by_chunked_and_served_by_esp_and_tp() -> None:
    sc = dataclasses.replace(REGIMES["lwm1m"], instances=4)
    spec = [(0.0, 150_000, 8), (0.5, 2_000, 8)]
    esp = simulate("esp", _reqs(spec), LWM, sc)
    chunked = simulate("chunked", _reqs(spec), LWM, sc)
    tp = simulate("chunked", _reqs(spec), lwm_1m_a100(2), dataclasses.replace(sc, instances=2), slo_profile=LWM)
    assert summarize(chunked)["refused"] == 1 and chunked.reqs[0].done is None
    assert summarize(chunked)["slo_attainment"] <= 0.5  # the refused request counts as a miss
    assert summarize(chunked)["slo_attainment_servable"] == 1.0
    assert esp.reqs[0].done is not None and tp.reqs[0].done is not None
    # The SLO is the same whatever the instances: scaled from one GPU's time.
    assert [r.ttft_slo for r in tp.reqs] == [r.ttft_slo for r in chunked.reqs]


def test_the_group_prefill_pays_the_ring_exchange_less_what_the_compute_hides() -> None:
    sc = dataclasses.replace(REGIMES["lwm1m"], instances=8)
    step = FastStep(LWM.step)
    models = core_models(step, sc, LWM.model.kv_bytes_per_token)
    link_bytes_s = sc.link_gbps / 8 * 1e9
    assert models[1].r == 0.0  # alone: nothing to exchange
    assert models[8].b == pytest.approx(step.ptok / 8)
    assert models[8].r == pytest.approx(7 / 8 * 524_288 / link_bytes_s)
    sim = simulate("esp", _reqs([(0.0, 100_000, 2)]), LWM, sc)
    assert sim.degrees == [(0.0, 8, 1)]
    length = 100_002  # the core plans on the KV a request will hold: prompt + output
    ring = 7 / 8 * length * 524_288 / link_bytes_s  # 1.84 s of K/V over 200 Gb/s
    compute = step.ptok * length / 8 + step.pair * length**2 / 2 / 8
    fixed = step.base + step.overhead + sc.exchange_s * 7 + step.seq
    assert sim.reqs[0].first == pytest.approx(fixed + compute + ring - sc.exchange_hidden * min(compute, ring))
    # Nothing hidden: the exchange is paid in full after the compute.
    serial = simulate("esp", _reqs([(0.0, 100_000, 2)]), LWM, dataclasses.replace(sc, exchange_hidden=0.0))
    assert serial.reqs[0].first == pytest.approx(fixed + compute + ring)


def test_a_holder_in_a_prefill_group_holds_up_its_masters_step() -> None:
    sim = _Sim("esp", [], LWM, dataclasses.replace(REGIMES["lwm1m"], instances=2))
    r = Req(0, 0.0, 150_000, 10)
    r.held, r.slices, r.master, r.generated = {0: 75_000, 1: 75_010}, {0: 75_000, 1: 75_000}, 1, 1
    master, holder = sim.nodes[1], sim.nodes[0]
    master.running.append(r)
    holder.prefilling_until = 5.0  # in a group prefilling another request until t = 5 s
    sim.iterate(master, 1.0)
    assert r.generated == 1 and master.free_at == 5.0  # no step until the holder can attend
    holder.prefilling_until = 0.0
    sim.iterate(master, 5.0)
    assert r.generated == 2 and master.free_at > 5.0


def test_regimes_report_under_their_own_keys_and_an_unknown_one_is_named() -> None:
    assert [regime_suffix(x) for x in REGIMES] == ["", "_lwm1m", "_lwm1m_lveval"]
    with pytest.raises(ValueError, match="'lwm2m'"):
        run_regimes(names=["lwm2m"])


def test_a_regimes_ratio_is_the_median_over_its_workload_seeds(monkeypatch) -> None:
    import bench.simulate.esp as esp_sim

    small = dataclasses.replace(REGIMES["lwm1m"], instances=4, rates=(0.02, 0.05, 0.1, 0.2))
    monkeypatch.setattr(esp_sim, "REGIMES", {"llama3-8b": small})
    out = run_regimes(quick=True, names=["llama3-8b"], seeds=3)
    assert out["seeds"] == [0, 1, 2]
    seeds = out["regimes"]["llama3-8b"]["seeds"]
    assert list(seeds) == ["0", "1", "2"]
    per_seed = out["esp_over_disagg_per_seed"]
    assert per_seed == [seeds[k]["esp_over_disagg"] for k in ("0", "1", "2")]
    assert None not in per_seed and out["esp_over_disagg"] == round(sorted(per_seed)[1], 2)
    for key in (k for k in out if k.endswith("_per_seed")):  # a seed with no rate met: no median
        if None in out[key]:
            assert out[key.removesuffix("_per_seed")] is None
    with pytest.raises(ValueError, match="seeds must be >= 1, got 0"):
        run_regimes(quick=True, names=["llama3-8b"], seeds=0)


def test_the_degree_plot_draws_each_regimes_timeline(tmp_path: Path) -> None:
    regimes = {
        name: {
            "scenario": {"instances": 16, "profile": sc.profile, "mix": sc.mix},
            "degree_timeline": {"0.1": "0:8:1 3.5:4:2", "1.0": "0.2:1:5"},
        }
        for name, sc in REGIMES.items()
    }
    out = plot_esp_degrees(regimes, tmp_path / "degrees.png")
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and out.stat().st_size > 10_000


def test_loongserves_slo_is_its_own_ttft_bound_and_50_ms_per_output_token() -> None:
    reqs = _reqs([(0.0, 20_000, 11), (0.0, 20_000, 11), (0.0, 20_000, 11)])
    set_slo(reqs, FastStep(LWM.step), REGIMES["lwm1m"])
    alone = FastStep(LWM.step)(20_000, 20_000 * 20_001 / 2, 1, 0, 0)
    assert reqs[0].paper_ttft_slo == max(15.0, 25 * alone)
    for r, (ttft, tpot) in zip(reqs, [(13.0, 0.04), (13.0, 0.06), (reqs[0].paper_ttft_slo + 0.1, 0.01)], strict=True):
        r.first, r.generated = ttft, 11
        r.done = ttft + 10 * tpot
    assert [r.met(paper=True) for r in reqs] == [True, False, False]
    assert not reqs[0].met()  # 13 s is past this scenario's TTFT bound, 5x its 2.4 s alone


def test_a_run_reports_every_strategy_and_esps_degree_timeline() -> None:
    sc = dataclasses.replace(REGIMES["lwm1m"], instances=4, rates=(0.02,))
    out = run(quick=True, sc=sc)
    assert set(out["max_rate_at_slo_rps"]) == {"esp", "chunked", "disagg", "chunked_tp"}
    assert out["chunked_tp_instances"].startswith("2 x TP=2")
    refused = out["per_rate"]["chunked"][0]["refused"]
    assert refused == out["workload"]["over_one_instance_kv"] > 0
    assert out["per_rate"]["chunked_tp"][0]["refused"] == 0 and out["per_rate"]["esp"][0]["refused"] == 0
    timeline = out["degree_timeline"]["0.02"].split()
    # Prompts past one iteration's token budget go through the core's batches; the rest take the
    # ordinary route.
    rows = [
        (r.prompt_tokens, r.output_tokens) for r in read_azure_trace(REPO_ROOT / "traces" / "azure_llm_2023_conv.csv")
    ]
    reqs = workload(rows, 150, 0.02, 0, sc)
    longer = sum(r.prompt >= LWM.max_num_tokens for r in reqs)
    assert 0 < longer < 150
    assert sum(int(x.split(":")[2]) for x in timeline) == longer
    assert out["per_rate"]["esp"][0]["completed"] == 150
    assert {int(x.split(":")[1]) for x in timeline} <= {1, 2, 4}


def test_a_preempted_instance_hands_its_decoding_kv_to_one_outside_the_plan() -> None:
    sim = _Sim("esp", [], LWM, dataclasses.replace(REGIMES["lwm1m"], instances=3))
    r = Req(0, 0.0, 150_000, 10)
    r.held, r.slices, r.master, r.generated = {0: 75_010, 1: 75_000}, {0: 75_000, 1: 75_000}, 0, 4
    for idx, n in r.held.items():
        sim.nodes[idx].used += n
        sim.nodes[idx].ctx += r.slices[idx]
    sim.nodes[0].ctx += r.generated
    sim.nodes[0].running.append(r)
    sent = sim._migrate_from(sim.nodes[0], 2.0, planned={0})
    # Its master's share (slice, 4 decoded tokens, room for 6 more) moves to node 2, the one
    # outside the plan with the most free KV; node 1 keeps its slice. Nothing stays on node 0.
    assert sent == 75_004 and r.master == 2 and r.held == {1: 75_000, 2: 75_010}
    assert (sim.nodes[0].used, sim.nodes[0].ctx, sim.nodes[0].running) == (0, 0, [])
    assert (sim.nodes[2].used, sim.nodes[2].ctx, sim.nodes[2].running) == (75_010, 75_004, [r])
    assert r.ready == pytest.approx(2.0 + 75_004 * 524_288 / (200e9 / 8))  # 1.57 s over 200 Gb/s
    sim.iterate(sim.nodes[2], 2.5)
    assert r.generated == 4 and sim.nodes[2].free_at == r.ready  # decodes once its KV is there
    sim.iterate(sim.nodes[2], r.ready)
    assert r.generated == 5
    # No room outside the plan: it stays where it is and waits for the group.
    assert sim._migrate_from(sim.nodes[2], 9.0, planned={0, 2}) == 0 and r.master == 2


@pytest.mark.parametrize("migrate", [True, False])
def test_with_or_without_migration_every_request_completes_and_the_kv_balances(migrate: bool) -> None:
    sc = dataclasses.replace(REGIMES["lwm1m"], instances=8, migrate=migrate)
    spec = [(0.2 * i, [900, 60_000, 4_000, 200_000][i % 4], 200) for i in range(24)]
    sim = simulate("esp", _reqs(spec), LWM, sc)
    out = summarize(sim)
    assert out["completed"] == 24 and all(n.used == 0 and n.ctx == 0 for n in sim.nodes)
    assert (out["migrated_requests"] > 0) == migrate


def test_the_compute_bound_is_the_work_the_requests_bring() -> None:
    step = FastStep(LWM.step)
    one = _reqs([(0.0, 1_000, 1)])  # a prefill, no decode step
    assert compute_bound_rps(one, step, 1) == pytest.approx(1 / (step.ptok * 1_000 + step.pair * 500_500 + step.seq))
    assert compute_bound_rps(one, step, 4) == pytest.approx(4 * compute_bound_rps(one, step, 1))
    spec = [(0.0, p, o) for p, o in [(30_000, 64), (4_000, 200), (90_000, 16)]]
    bound = compute_bound_rps(_reqs(spec), step, 1)
    assert bound < compute_bound_rps(_reqs([(0.0, p, 1) for _, p, _ in spec]), step, 1)  # decode costs too
    # One instance serving them back to back is busy at least that long (plus its iterations' fixed costs).
    sim = simulate("chunked", _reqs(spec), LWM, dataclasses.replace(REGIMES["lwm1m"], instances=1))
    assert max(r.done for r in sim.reqs if r.done is not None) > len(spec) / bound
    with pytest.raises(ValueError, match="instances >= 1"):
        compute_bound_rps(one, step, 0)


def test_a_run_reports_the_compute_bound_and_esps_ceiling_over_each_strategy() -> None:
    sc = dataclasses.replace(REGIMES["lwm1m"], instances=4, rates=(0.02, 0.05))
    out = run(quick=True, sc=sc)
    bound = out["compute_bound_rps"]
    assert set(bound) == {"one_gpu", "chunked_tp"} and bound["chunked_tp"] < bound["one_gpu"]  # TP pays its efficiency
    best = out["max_rate_at_slo_rps"]
    for other in ("chunked", "disagg", "chunked_tp"):
        expected = round(bound["one_gpu"] / best[other], 2) if best[other] else None
        assert out[f"esp_ceiling_over_{other}"] == expected
    assert out["share_of_compute_bound"]["esp"] == round(best["esp"] / bound["one_gpu"], 3)


def test_a_short_request_backfills_past_a_long_one_the_free_kv_cannot_hold_yet() -> None:
    # A takes most of two instances' KV; B (150k) must wait for A to end; C (10k) fits now.
    spec = [(0.0, 200_000, 400), (1.0, 150_000, 4), (2.0, 10_000, 4)]
    admitted = {}
    for wait in (None, 120.0):
        sc = dataclasses.replace(REGIMES["lwm1m"], instances=2, backfill_wait_s=wait, dispatch_order="arrival")
        sim = simulate("esp", _reqs(spec), LWM, sc)
        a, b, c = sim.reqs
        assert all(r.done is not None for r in sim.reqs) and all(n.used == 0 for n in sim.nodes)
        assert b.admitted is not None and a.done is not None and b.admitted >= a.done  # B waits for A's KV
        admitted[wait] = c.admitted
    assert admitted[None] is not None and admitted[120.0] is not None
    assert admitted[120.0] < admitted[None] - 5.0  # in arrival order C waited behind B for A's decode


def test_shortest_first_dispatch_lets_a_short_request_ahead_of_a_longer_one_that_also_fits() -> None:
    # A holds most of the KV; B (20k) and then C (5k) queue while it prefills. Once A's prefill
    # ends only one of them fits next to it; shortest first, C goes before B.
    spec = [(0.0, 190_000, 200), (1.0, 20_000, 4), (2.0, 5_000, 4)]
    first = {}
    for order in ("arrival", "shortest"):
        sc = dataclasses.replace(REGIMES["lwm1m"], instances=2, dispatch_order=order, esp_min_prompt=0)
        sim = simulate("esp", _reqs(spec), LWM, sc)
        assert all(r.done is not None for r in sim.reqs) and all(n.used == 0 and n.ctx == 0 for n in sim.nodes)
        _, b, c = sim.reqs
        first[order] = (b.admitted, c.admitted)
    (b_fifo, c_fifo), (b_sjf, c_sjf) = first["arrival"], first["shortest"]
    assert b_fifo <= c_fifo  # arrival order: B first
    assert c_sjf < b_sjf  # shortest first: C first
