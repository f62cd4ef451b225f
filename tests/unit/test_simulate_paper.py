"""The paper-scale scenarios (`bench.simulate.paper`): the rate scaling, the cluster at scale,
the utilization and host-memory accounting on hand-computable runs, the bisection, the claims'
arithmetic, and a tiny end-to-end run that writes its record (keeping the file's other keys)
and its plots."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from bench.simulate.cluster import RunConfig
from bench.simulate.links import ClusterSpec
from bench.simulate.paper import (
    FULL_GPUS,
    PAPER,
    SETTINGS,
    PaperSimulation,
    claims,
    cluster_for,
    first_passing,
    host_copies,
    main,
    replicate,
    run_setting,
    run_system,
)
from bench.simulate.profiles import PUBLISHED_PROFILES, FastStep, ModelSpec, SimProfile
from blitzmesh.replay.schedule import Arrival
from services.common.worker_profile import StepTimeModel

pytestmark = [pytest.mark.timeout(120), pytest.mark.filterwarnings("error")]

# Every iteration lasts exactly 0.1 s, whatever it holds.
FLAT = SimProfile(
    device="flat",
    model=ModelSpec("flat", 4e6, 4, 1024),
    step=StepTimeModel(base_s=0.1, prefill_token_s=0.0, decode_row_s=0.0),
    max_batch=8,
    max_num_tokens=512,
    kv_blocks=1024,
    block_size=16,
    source="test",
    source_ref="test",
)


def _fixed(arrivals: tuple[Arrival, ...], hosts: int, initial: int, loader: str = "blitz") -> RunConfig:
    return RunConfig(
        name="fixed",
        profile=FLAT,
        cluster=ClusterSpec(hosts=hosts, gpus_per_host=1, hosts_per_leaf=hosts),
        arrivals=arrivals,
        initial=initial,
        autoscale=False,
        max_instances=hosts,
        loader=loader,  # type: ignore[arg-type]
    )


def test_replicate_scales_the_rate_and_keeps_the_shape() -> None:
    base = [Arrival(i, float(10 * i), 100 + i, 5) for i in range(200)]
    same = replicate(base, 1.0, 0.0, seed=3)
    assert [(a.t_s, a.prompt_tokens) for a in same] == [(a.t_s, a.prompt_tokens) for a in base]
    out = replicate(base, 2.5, 4.0, seed=3)
    assert 2 * len(base) < len(out) < 3 * len(base)
    assert [a.index for a in out] == list(range(len(out)))
    assert all(a.t_s <= b.t_s for a, b in zip(out, out[1:], strict=False))
    # Every copy sits within [t, t + jitter) of its original (originals are 10 s apart).
    for a in out:
        orig = base[int(a.t_s // 10)]
        assert 0 <= a.t_s - orig.t_s < 4.0 and a.prompt_tokens == orig.prompt_tokens
    assert replicate(base, 2.5, 4.0, seed=3) == out  # seeded
    assert len(replicate(base, 0.5, 1.0, seed=1)) < len(base)
    with pytest.raises(ValueError):
        replicate(base, -1.0, 1.0, seed=0)


def test_cluster_at_scale_one_is_a_thousand_gpus() -> None:
    single = cluster_for(SETTINGS["code8b"], 1.0)
    assert single.hosts * single.gpus_per_host == FULL_GPUS
    tp8 = cluster_for(SETTINGS["conv70b"], 1.0)
    assert tp8.hosts * SETTINGS["conv70b"].tp == FULL_GPUS and tp8.gpus_per_host == 1
    # One TP=8 slot has the host's 8 NICs and 8 PCIe lanes.
    assert tp8.rdma_gbps == 8 * single.rdma_gbps and tp8.pcie_gbps == 8 * single.pcie_gbps
    assert cluster_for(SETTINGS["code8b"], 0.001).hosts == 2


def test_the_70b_estimate_is_slower_per_step_than_8b_on_one_gpu_but_not_9x() -> None:
    big = FastStep(PUBLISHED_PROFILES["h100x8-llama3-70b"].step)
    small = FastStep(PUBLISHED_PROFILES["h100-llama3-8b"].step)
    assert PUBLISHED_PROFILES["h100x8-llama3-70b"].model.size_bytes == pytest.approx(141.1e9)
    ratio = big(0, 0, 0, 64, 64_000) / small(0, 0, 0, 64, 64_000)
    assert 1.0 < ratio < 2.5  # 8.8x the weights over 8 GPUs at 80%


def test_gpu_utilization_is_busy_over_provisioned_time() -> None:
    # One instance; one request arriving at 1.5 s: a prefill and 4 decode steps of 0.1 s.
    # Busy 0.5 s of the 2.0 s it is held; TP=8 multiplies both by 8.
    cfg = _fixed((Arrival(0, 1.5, 10, 5),), hosts=1, initial=1)
    out = run_system(cfg, tp=8)
    assert out["busy_gpu_seconds"] == pytest.approx(8 * 0.5)
    assert out["gpu_seconds"] == pytest.approx(8 * 2.0)
    assert out["gpu_utilization"] == pytest.approx(0.25)
    # Two instances, the same request: half the utilization.
    assert run_system(_fixed((Arrival(0, 1.5, 10, 5),), hosts=2, initial=2), tp=1)["gpu_utilization"] == (
        pytest.approx(0.125)
    )


def test_host_memory_is_one_copy_for_blitz_and_one_per_caching_host_for_serverlessllm() -> None:
    arrivals = (Arrival(0, 2.9, 10, 5),)
    blitz = PaperSimulation(_fixed(arrivals, hosts=3, initial=2))
    blitz.run()
    assert host_copies(blitz) == {"peak": 1.0, "mean": 1.0}  # the shards cover the model once
    assert sorted(g for gs in blitz.pm_shards.values() for g in gs) == list(FLAT.model.groups)

    sllm = PaperSimulation(_fixed(arrivals, hosts=3, initial=2, loader="serverless"))
    sllm.host_cache["h02"] = 1.5  # a third host's copy, kept alive until 1.5 s
    sllm.run()
    samples = sllm.cached_hosts
    assert [n for t, n in samples if t <= 1.0] == [3, 3] and all(n == 2 for t, n in samples if t >= 2.0)
    end = samples[-1][0]
    got = host_copies(sllm)
    assert got["peak"] == 3.0
    # Three copies over [0, 2) (sampled each second), two from 2 s to the end.
    assert got["mean"] == pytest.approx((3 * 2.0 + 2 * (end - 2.0)) / end, abs=1e-3)


def test_first_passing_bisects_to_the_first_ok_candidate() -> None:
    calls: list[int] = []

    def run(k: int) -> dict[str, int]:
        calls.append(k)
        return {"k": k}

    value, result, tried = first_passing(list(range(1, 33)), run, lambda r: r["k"] >= 20)
    assert value == 20 and result == {"k": 20}
    assert len(calls) <= 6 and [k for k, _ in tried] == sorted(calls)
    calls.clear()
    value, _, _ = first_passing([1, 2, 3], run, lambda r: False)
    assert value == 3 and 3 in calls  # none passes: the last, run
    with pytest.raises(ValueError):
        first_passing([], run, lambda r: True)


def _system(**kw: float | dict[str, float] | None) -> dict[str, object]:
    base: dict[str, object] = {
        "ttft_p99_s": 1.0,
        "gpu_seconds": 100.0,
        "busy_gpu_seconds": 50.0,
        "gpu_utilization": 0.5,
        "slo_attainment": 0.99,
        "host_copies": {"peak": 1.0, "mean": 1.0},
        "host_memory_gb_peak": 16.0,
        "instances": 10,
        "target_utilization": 0.7,
    }
    return base | kw


def test_claims_arithmetic() -> None:
    settings = {
        "a": {
            "cluster": {"hosts": 4},
            "systems": {
                "blitzmesh": _system(ttft_p99_s=0.5, gpu_seconds=100.0, busy_gpu_seconds=80.0),
                "serverlessllm": _system(ttft_p99_s=5.0, host_copies={"peak": 4.0, "mean": 2.5}),
                "hpa": _system(),
                "hpa_same_slo": _system(gpu_seconds=200.0, busy_gpu_seconds=100.0),
                "fixed_peak": _system(gpu_seconds=400.0),
                "fixed_same_slo": _system(gpu_seconds=300.0),
            },
        },
        "b": {
            "cluster": {"hosts": 2},
            "systems": {
                "blitzmesh": _system(ttft_p99_s=1.0, gpu_seconds=100.0, busy_gpu_seconds=60.0),
                "serverlessllm": _system(ttft_p99_s=2.0),
                "hpa": _system(),
                "hpa_same_slo": _system(gpu_seconds=200.0, busy_gpu_seconds=60.0),
                "fixed_peak": _system(gpu_seconds=200.0),
                "fixed_same_slo": _system(gpu_seconds=100.0),
            },
        },
    }
    c = claims(settings)
    assert set(c) == set(PAPER)
    for claim in c.values():
        assert {"paper", "ours", "ratio", "within_25pct", "assumptions", "detail", "source", "unit"} <= set(claim)
        assert claim["ratio"] == pytest.approx(claim["ours"] / claim["paper"], abs=1e-3)
    # Tail: "up to": the largest reduction, 1 - 0.5/5.0 in a (b: 0.5).
    assert c["tail_ttft"]["ours"] == pytest.approx(0.9)
    assert c["tail_ttft"]["detail"]["b"]["reduction"] == pytest.approx(0.5)
    # GPU time over both settings: 1 - 200 / 400.
    assert c["gpu_time"]["ours"] == pytest.approx(0.5)
    assert c["gpu_time"]["within_25pct"]
    assert c["gpu_time"]["detail"]["a"]["reduction_vs_fixed_peak"] == pytest.approx(0.75)
    assert c["gpu_time"]["detail"]["all"]["reduction_vs_fixed_peak"] == pytest.approx(1 - 200 / 600, abs=1e-4)
    # Utilization, GPU-weighted: 140/200 - 160/400 = 0.3 -> 30 pp.
    assert c["gpu_utilization"]["ours"] == pytest.approx(30.0)
    assert c["gpu_utilization"]["ratio"] == pytest.approx(30.0 / 26.6, abs=1e-3)
    assert c["host_memory"]["ours"] == 1.0 and c["host_memory"]["ratio"] == 1.0
    assert c["host_memory"]["detail"]["a"]["serverlessllm_copies_peak"] == 4.0


def test_tiny_end_to_end_run_writes_the_record_and_plots(tmp_path: Path) -> None:
    out = tmp_path / "simulator.json"
    out.write_text(json.dumps({"validation": {"kept": True}, "wall_s_1h_1000": 1.0}), encoding="utf-8")
    assert main(["--scale", "0.016", "--minutes", "1", "--jobs", "1", "--out", str(out), "--plots", str(tmp_path)]) == 0
    record = json.loads(out.read_text(encoding="utf-8"))
    assert record["validation"] == {"kept": True} and record["wall_s_1h_1000"] == 1.0
    paper = record["paper"]
    assert paper["scale"] == 0.016 and paper["minutes"] == 1.0
    assert set(paper["claims"]) == set(PAPER)
    for name in SETTINGS:
        systems = paper["settings"][name]["systems"]
        assert {"blitzmesh", "serverlessllm", "hpa", "fixed_peak", "fixed_same_slo", "hpa_same_slo"} <= set(systems)
        assert all(s["lost"] == 0 for s in systems.values())
        assert len(systems["blitzmesh"]["ttft_quantiles_s"]) == len(paper["ttft_quantile_levels"])
    for png in ("simulator_paper_timeline.png", "simulator_paper_ttft_cdf.png"):
        assert (tmp_path / png).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    # The default floor: every autoscaled system starts from and keeps the mean-rate pool.
    assert paper["floor"] == "mean"
    for name in SETTINGS:
        setting = paper["settings"][name]
        assert setting["floor"] == {"rule": "mean", "min_instances": setting["sizing"]["fixed_mean"]}


def test_floor_is_validated() -> None:
    with pytest.raises(ValueError, match="floor must be one of .*got 'warm'"):
        run_setting("code8b", 0.016, 1.0, floor="warm")
