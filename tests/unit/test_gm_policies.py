"""Autoscaling policies against the test vectors of docs/algorithms.md 1."""

from __future__ import annotations

import math

import pytest

from services.global_manager.core.policies import (
    BlitzScaleBoundsPolicy,
    CooldownState,
    HeteroScaleConfig,
    HeteroScalePolicy,
    LatencyPolicy,
    PeriodicPolicy,
    Policy,
    UtilizationPolicy,
    make_policy,
    policy_names,
)
from services.global_manager.core.types import (
    DECISION_LOG_HEADER,
    ClusterSnapshot,
    PoolSnapshot,
    Role,
    ScaleDecision,
)


def split(
    p: int,
    d: int,
    tps: float = 0.0,
    tbt: float | None = 0.05,
    *,
    prefill: dict[str, float] | None = None,
    **decode: float,
) -> ClusterSnapshot:
    """A P/D snapshot with P prefill and D decode instances serving, all reporting."""
    prefill_kw: dict[str, float] = {"instances_reporting": p, **(prefill or {})}
    decode_kw: dict[str, float | None] = {"instances_reporting": d, "decode_tps": tps, "tbt_p50_s": tbt, **decode}
    return ClusterSnapshot(
        now_s=0.0,
        pools={
            Role.PREFILL: PoolSnapshot(Role.PREFILL, serving=p, **prefill_kw),  # type: ignore[arg-type]
            Role.DECODE: PoolSnapshot(Role.DECODE, serving=d, **decode_kw),  # type: ignore[arg-type]
        },
        disaggregated=True,
    )


def colo(n: int, tps: float = 0.0, tbt: float | None = 0.05, **kw: float) -> ClusterSnapshot:
    kw.setdefault("instances_reporting", n)
    pool = PoolSnapshot(Role.COLOCATED, serving=n, decode_tps=tps, tbt_p50_s=tbt, **kw)  # type: ignore[arg-type]
    return ClusterSnapshot(now_s=0.0, pools={Role.COLOCATED: pool}, disaggregated=False)


def counts(d: ScaleDecision) -> tuple[int | None, int | None]:
    return (d.prefill_to, d.decode_to)


# -- HeteroScale ---------------------------------------------------------------------------


@pytest.mark.parametrize(("rounding", "expected"), [("ceil", (7, 21)), ("floor", (6, 18)), ("round", (6, 19))])
def test_heteroscale_scale_in_vector_by_rounding(rounding: str, expected: tuple[int, int]) -> None:
    policy = make_policy("heteroscale", {"rounding": rounding})
    d = policy.decide(0.0, split(10, 30, tps=2500, tbt=0.05))
    assert d.action == "scale_in"
    assert counts(d) == expected
    assert d.extra["ratio"] == pytest.approx(0.625)


def test_heteroscale_default_rounding_is_ceil() -> None:
    assert counts(HeteroScalePolicy().decide(0.0, split(10, 30, tps=2500))) == (7, 21)


def test_heteroscale_scale_in_never_grows_a_pool_nor_scale_out_shrinks_one() -> None:
    """Split by the 1:3 ratio, a scale-in of a 1:1 deployment would ask for 1 prefill and 3
    decode instances, and a scale-out of 3 prefill + 1 decode for 2 prefill and 6 decode."""
    d = HeteroScalePolicy().decide(0.0, split(1, 1, tps=1.0))
    assert d.reason.startswith("SCALE_IN") and (d.action, counts(d)) == ("no_change", (1, 1))
    policy = HeteroScalePolicy(HeteroScaleConfig(target_decode_tps_per_instance=100.0))
    d = policy.decide(0.0, split(3, 1, tps=500.0))
    assert (d.action, counts(d)) == ("scale_out", (3, 6))


def test_latency_panic_grows_both_pools_by_factor() -> None:
    d = HeteroScalePolicy().decide(30.0, split(10, 30, tps=3000, tbt=0.15))
    assert (d.action, counts(d)) == ("scale_out", (12, 36))
    assert d.reason == "LATENCY_PANIC: tbt=0.15s > 0.12s"


def test_latency_panic_small_pool_always_grows() -> None:
    # The reference truncates 1*1.2 and 3*1.2 and never grows; our rule is max(cur+1, ceil(cur*f)).
    d = HeteroScalePolicy().decide(0.0, split(1, 3, tps=0, tbt=0.15))
    assert (d.action, counts(d)) == ("scale_out", (2, 4))


def test_log_line_matches_reference_format() -> None:
    d = HeteroScalePolicy().decide(30.0, split(10, 30, tps=3000, tbt=0.15))
    assert DECISION_LOG_HEADER == "time,action,target,status,reason"
    assert d.to_log_line() == (
        "30.0,autoscaling_decision,scale_out,prompt:10->12_token:30->36,LATENCY_PANIC: tbt=0.15s > 0.12s"
    )


def test_log_line_escapes_commas_and_formats_colocated() -> None:
    d = ScaleDecision(action="scale_out", reason="a,b\nc", policy="x", now_s=1.5, instances_from=2, instances_to=3)
    assert d.to_log_line() == "1.5,autoscaling_decision,scale_out,instances:2->3,a;b c"


def test_proportional_scale_out_at_ratio_1_25() -> None:
    d = HeteroScalePolicy().decide(0.0, split(1, 3, tps=500))
    assert d.action == "scale_out"
    assert d.extra["ratio"] == pytest.approx(1.25)
    assert counts(d) == (2, 6)  # need 5: P_exp = 1.24 -> 2, decode 2 * 3


def test_ratio_1_025_is_no_change() -> None:
    d = HeteroScalePolicy().decide(0.0, split(2, 6, tps=820))
    assert d.action == "no_change" and counts(d) == (2, 6)
    assert d.extra["ratio"] == pytest.approx(1.025)


def test_cooldowns_are_independent_timers() -> None:
    policy = HeteroScalePolicy()
    assert policy.cooldown == CooldownState(-math.inf, -math.inf)
    assert policy.decide(0.0, split(1, 3, tps=500)).action == "scale_out"
    assert policy.cooldown.last_scale_out_s == 0.0
    # Another scale-out trigger at t=100 is held by the 180 s scale-out cooldown ...
    held = policy.decide(100.0, split(2, 6, tps=1000))
    assert held.action == "no_change" and "COOLDOWN" in held.reason and "t=180" in held.reason
    # ... and allowed at t=180.
    assert policy.decide(180.0, split(2, 6, tps=1000)).action == "scale_out"
    # A scale-in 10 s after a scale-out is not blocked by it.
    fresh = HeteroScalePolicy()
    fresh.decide(0.0, split(1, 3, tps=500))
    assert fresh.decide(10.0, split(10, 30, tps=2500)).action == "scale_in"
    assert fresh.cooldown.last_scale_in_s == 10.0
    assert fresh.decide(20.0, split(7, 21, tps=200)).action == "no_change"  # scale-in cooldown 600 s


def test_panic_held_by_cooldown_falls_through_to_proportional() -> None:
    policy = HeteroScalePolicy()
    policy.decide(0.0, split(10, 30, tps=3000, tbt=0.15))  # panic scale-out at t=0
    d = policy.decide(60.0, split(12, 36, tps=2500, tbt=0.15))
    assert d.action == "scale_in"  # ratio 25/48 < 0.9 and the scale-in timer is free
    assert "LATENCY_PANIC" in d.reason and "SCALE_IN" in d.reason
    in_band = HeteroScalePolicy()
    in_band.decide(0.0, split(10, 30, tps=3000, tbt=0.15))
    d2 = in_band.decide(60.0, split(2, 6, tps=820, tbt=0.15))
    assert d2.action == "no_change" and "held by scale_out cooldown" in d2.reason


def test_latency_trigger_can_be_disabled_and_reads_configured_percentile() -> None:
    off = make_policy("heteroscale", {"enable_latency_trigger": False})
    assert off.decide(0.0, split(2, 6, tps=820, tbt=0.5)).action == "no_change"
    p99 = make_policy("heteroscale", {"tbt_percentile": "p99"})
    snap = split(2, 6, tps=820, tbt=0.5, tbt_p99_s=0.05)
    assert p99.decide(0.0, snap).action == "no_change"
    snap_hot = split(2, 6, tps=820, tbt=0.05, tbt_p99_s=0.5)
    assert p99.decide(0.0, snap_hot).action == "scale_out"


def test_clamping_and_bounds_repair() -> None:
    capped = make_policy("heteroscale", {"max_instances": 50})
    d = capped.decide(0.0, split(10, 30, tps=10000))  # need 100: (25, 75) clamped per pool
    assert counts(d) == (25, 50)
    over = make_policy("heteroscale", {"max_instances": 20}).decide(0.0, split(10, 30, tps=10000))
    assert (over.action, counts(over)) == ("scale_in", (10, 20)) and over.reason.startswith("BOUNDS")
    at_max = make_policy("heteroscale", {"max_instances": 3})
    d2 = at_max.decide(0.0, split(3, 3, tps=1000, tbt=0.5))
    assert d2.action == "no_change" and "max_instances=3" in d2.reason
    # Below the minimum (e.g. at start with nothing running) is repaired at once.
    d3 = HeteroScalePolicy().decide(0.0, split(0, 0))
    assert (d3.action, counts(d3)) == ("scale_out", (1, 1)) and d3.reason.startswith("BOUNDS")
    zero = make_policy("heteroscale", {"allow_zero_prefill": True, "rounding": "floor"})
    assert counts(zero.decide(0.0, split(1, 3, tps=50))) == (0, 1)


def test_heteroscale_colocated_mapping() -> None:
    policy = HeteroScalePolicy()
    out = policy.decide(0.0, colo(4, tps=600))  # need 6, ratio 1.5
    assert (out.action, out.instances_from, out.instances_to) == ("scale_out", 4, 6)
    assert out.to_log_line().startswith("0.0,autoscaling_decision,scale_out,instances:4->6,SCALE_OUT")
    assert HeteroScalePolicy().decide(0.0, colo(10, tps=250)).instances_to == 3  # ceil(2.5)
    panic = HeteroScalePolicy().decide(0.0, colo(1, tps=100, tbt=0.2))
    assert (panic.action, panic.instances_to) == ("scale_out", 2)
    assert HeteroScalePolicy().decide(0.0, colo(5, tps=500)).action == "no_change"


def test_heteroscale_config_validation_quotes_values_and_accepts_spec_names() -> None:
    with pytest.raises(ValueError, match=r"pd_ratio.*got -1"):
        make_policy("heteroscale", {"pd_ratio": -1})
    with pytest.raises(ValueError, match=r"min_instances=5 must be <= max_instances=2"):
        make_policy("heteroscale", {"min_instances": 5, "max_instances": 2})
    with pytest.raises(ValueError, match=r"rounding.*got 'up'"):
        make_policy("heteroscale", {"rounding": "up"})
    with pytest.raises(ValueError, match=r"bogus.*Extra inputs"):
        make_policy("heteroscale", {"bogus": 1})
    cfg = HeteroScaleConfig.model_validate({"tbt_slo": 0.2, "scale_out_cooldown": 5, "scale_in_cooldown_s": 7})
    assert (cfg.tbt_slo_s, cfg.scale_out_cooldown_s, cfg.scale_in_cooldown_s) == (0.2, 5, 7)
    defaults = HeteroScaleConfig()
    assert (
        defaults.target_decode_tps_per_instance,
        defaults.pd_ratio,
        defaults.scale_out_threshold,
        defaults.scale_in_threshold,
        defaults.min_instances,
        defaults.max_instances,
        defaults.enable_latency_trigger,
        defaults.tbt_slo_s,
        defaults.latency_panic_threshold,
        defaults.latency_panic_scale_factor,
        defaults.scale_out_cooldown_s,
        defaults.scale_in_cooldown_s,
    ) == (100, 0.33, 0.1, 0.1, 1, 100, True, 0.1, 1.2, 1.2, 180, 600)


def test_registry_names_and_errors() -> None:
    assert policy_names() == ["blitzscale_bounds", "heteroscale", "latency", "periodic", "utilization"]
    for name in policy_names():
        params = {"schedule": [{"at": "00:00", "instances": 1}]} if name == "periodic" else {}
        policy = make_policy(name, params)
        assert isinstance(policy, Policy) and policy.name == name
    assert isinstance(make_policy("BlitzScale-Bounds", {}), BlitzScaleBoundsPolicy)
    with pytest.raises(ValueError, match=r"unknown autoscaling policy 'hpa'; known: blitzscale_bounds"):
        make_policy("hpa", {})
    with pytest.raises(ValueError, match=r"policy 'periodic'.*schedule: Field required"):
        make_policy("periodic", {})


def test_decision_requires_one_shape() -> None:
    with pytest.raises(ValueError, match="either all of"):
        ScaleDecision(action="scale_out", reason="r", policy="p", now_s=0, prefill_from=1, prefill_to=2)
    with pytest.raises(ValueError, match="action 'no_change' disagrees with its counts 'instances:1->2'"):
        ScaleDecision(action="no_change", reason="r", policy="p", now_s=0, instances_from=1, instances_to=2)
    with pytest.raises(ValueError, match="action 'scale_in' disagrees"):
        ScaleDecision(action="scale_in", reason="r", policy="p", now_s=0, instances_from=2, instances_to=2)
    with pytest.raises(ValueError, match="action must be one of"):
        ScaleDecision(
            action="grow",
            reason="r",
            policy="p",
            now_s=0,  # type: ignore[arg-type]
            instances_from=1,
            instances_to=2,
        )


# -- Utilization ---------------------------------------------------------------------------


def test_utilization_scales_out_if_any_pool_is_hot() -> None:
    policy = UtilizationPolicy()
    # decode KV 90%: ratio 0.9/0.7 = 1.286 > 1.1 -> ceil(4 * 1.286) = 6; prefill 50% tps stays.
    snap = split(2, 4, kv_blocks_used=3600, kv_blocks_total=4000, prefill={"prefill_tps": 10000})
    d = policy.decide(0.0, snap)
    assert (d.action, counts(d)) == ("scale_out", (2, 6))
    assert d.extra["decode_ratio"] == pytest.approx(0.9 / 0.7)


def test_utilization_scales_in_only_if_all_pools_are_cold() -> None:
    policy = UtilizationPolicy()
    # decode KV 30% (ratio 0.43) but prefill at 70% (ratio 1.0): no scale-in.
    mixed = split(2, 4, kv_blocks_used=1200, kv_blocks_total=4000, prefill={"prefill_tps": 14000})
    assert policy.decide(0.0, mixed).action == "no_change"
    cold = split(2, 4, kv_blocks_used=1200, kv_blocks_total=4000, prefill={"prefill_tps": 4000})
    d = policy.decide(0.0, cold)
    # decode ceil(4 * 0.3/0.7) = 2; prefill ceil(2 * 0.2/0.7) = 1
    assert (d.action, counts(d)) == ("scale_in", (1, 2))


def test_utilization_does_not_reorder_capacity_that_is_loading() -> None:
    snap = ClusterSnapshot(
        0.0,
        {
            Role.COLOCATED: PoolSnapshot(
                Role.COLOCATED, serving=4, loading=2, instances_reporting=4, kv_blocks_used=3600, kv_blocks_total=4000
            )
        },
        disaggregated=False,
    )
    d = UtilizationPolicy().decide(0.0, snap)  # wants ceil(4 * 1.286) = 6, already has 6
    assert d.action == "no_change"


def test_utilization_without_data_does_nothing() -> None:
    snap = split(2, 4, instances_reporting=0)
    assert UtilizationPolicy().decide(0.0, snap).reason.startswith("NO_DATA")


# -- Latency -------------------------------------------------------------------------------


def test_latency_policy_steps() -> None:
    up = LatencyPolicy().decide(0.0, split(2, 4, tbt=0.12))  # > 1.1 * 0.1
    assert (up.action, counts(up)) == ("scale_out", (4, 6))
    down = LatencyPolicy().decide(0.0, split(2, 4, tbt=0.07))  # < 0.8 * 0.1
    assert (down.action, counts(down)) == ("scale_in", (1, 3))
    assert LatencyPolicy().decide(0.0, split(2, 4, tbt=0.1)).action == "no_change"
    assert LatencyPolicy().decide(0.0, split(2, 4, tbt=None)).reason.startswith("NO_DATA")
    floor = LatencyPolicy().decide(0.0, split(1, 1, tbt=0.01))
    assert floor.action == "no_change"  # never below min_instances
    c = LatencyPolicy().decide(0.0, colo(3, tbt=0.2))
    assert (c.instances_from, c.instances_to) == (3, 5)


def test_latency_policy_cooldown() -> None:
    policy = LatencyPolicy()
    policy.decide(0.0, split(2, 4, tbt=0.12))
    held = policy.decide(10.0, split(4, 6, tbt=0.12))
    assert held.action == "no_change" and "COOLDOWN" in held.reason


# -- Periodic ------------------------------------------------------------------------------


def test_periodic_schedule_by_time_of_day() -> None:
    policy = make_policy(
        "periodic",
        {"schedule": [{"at": "20:00", "prefill": 1, "decode": 3}, {"at": "08:00", "prefill": 2, "decode": 6}]},
    )
    assert isinstance(policy, PeriodicPolicy)
    morning = policy.decide(9 * 3600.0, split(1, 3))
    assert (morning.action, counts(morning)) == ("scale_out", (2, 6))
    assert "08:00:00" in morning.reason
    # 01:00 the next day is still the 20:00 entry (wraps around midnight).
    night = policy.decide(86400 + 3600.0, split(2, 6))
    assert (night.action, counts(night)) == ("scale_in", (1, 3))


def test_periodic_mismatch_and_validation() -> None:
    policy = make_policy("periodic", {"schedule": [{"at_s": 0, "instances": 2}], "period_s": 60})
    assert policy.decide(0.0, split(1, 3)).reason.startswith("SCHEDULE_MISMATCH")
    assert policy.decide(0.0, colo(1)).instances_to == 2
    with pytest.raises(ValueError, match="'25:00'"):
        make_policy("periodic", {"schedule": [{"at": "25:00", "instances": 1}]})
    with pytest.raises(ValueError, match="prefill and decode"):
        make_policy("periodic", {"schedule": [{"at": "01:00", "prefill": 1}]})
    with pytest.raises(ValueError, match="mixes"):
        make_policy(
            "periodic", {"schedule": [{"at": "01:00", "instances": 1}, {"at": "02:00", "prefill": 1, "decode": 1}]}
        )


# -- BlitzScale bounds ---------------------------------------------------------------------


def test_blitzscale_bounds_vector() -> None:
    policy = make_policy("blitzscale_bounds", {"kv_blocks_per_replica": 1000, "prefill_tps_per_replica": 13000})
    snap = split(2, 2, kv_blocks_used=3000, prefill={"waiting_prefill_tokens": 20000})
    d = policy.decide(0.0, snap)
    assert d.delta(Role.DECODE) == 2 and d.delta(Role.PREFILL) == 0
    assert d.action == "scale_out"


def test_blitzscale_infers_blocks_per_replica_and_scales_down_one_step() -> None:
    policy = BlitzScaleBoundsPolicy()
    # 4 reporting replicas of 1000 blocks, 1000 used: 25% < 75% -> D - 1 (3 replicas: 33%, ok).
    d = policy.decide(
        0.0, split(3, 4, kv_blocks_used=1000, kv_blocks_total=4000, prefill={"waiting_prefill_tokens": 0})
    )
    assert counts(d) == (2, 3) and d.action == "scale_in"
    # Never below one.
    one = policy.decide(1.0, split(1, 1, kv_blocks_used=0, kv_blocks_total=1000))
    assert one.action == "no_change"


def test_blitzscale_refuses_a_shrink_that_would_bounce_back() -> None:
    policy = make_policy("blitzscale_bounds", {"kv_blocks_per_replica": 1000})
    # 2 replicas at 70% (< 75%), but 1 replica would be at 140% > 95%.
    d = policy.decide(0.0, split(1, 2, kv_blocks_used=1400, prefill={"waiting_prefill_tokens": 1}))
    assert d.delta(Role.DECODE) == 0


def test_blitzscale_prefill_grows_to_band_middle() -> None:
    policy = make_policy("blitzscale_bounds", {"kv_blocks_per_replica": 1000, "prefill_tps_per_replica": 10000})
    # load = 30000 / (2 * 10000) = 1.5 > 0.8 -> ceil(30000 / (10000 * 0.65)) = 5
    d = policy.decide(0.0, split(2, 2, kv_blocks_used=1700, prefill={"waiting_prefill_tokens": 30000}))
    assert counts(d) == (5, 2)


def test_blitzscale_colocated_uses_both_rules() -> None:
    policy = make_policy("blitzscale_bounds", {"kv_blocks_per_replica": 1000, "prefill_tps_per_replica": 10000})
    hot_queue = colo(2, kv_blocks_used=1700, waiting_prefill_tokens=30000)
    assert policy.decide(0.0, hot_queue).instances_to == 5
    # KV wants fewer, queue is in band: no shrink.
    mixed = colo(4, kv_blocks_used=1000, waiting_prefill_tokens=26000)
    assert policy.decide(1.0, mixed).action == "no_change"


# -- HeteroScale extensions (off by default) ------------------------------------------------


def test_heteroscale_stabilization_holds_scale_in_after_a_panic() -> None:
    policy = make_policy(
        "heteroscale",
        {
            "target_decode_tps_per_instance": 10,
            "scale_out_cooldown_s": 0,
            "scale_in_cooldown_s": 0,
            "scale_in_stabilization_s": 20,
        },
    )
    out = policy.decide(0.0, colo(2, tps=20, tbt=0.5))  # panic: 2 -> 3
    assert out.action == "scale_out" and out.instances_to == 3
    # Right after, the TPS window still shows the old load (need 1): held at the wanted 3.
    held = policy.decide(5.0, colo(3, tps=10, tbt=0.05))
    assert held.action == "no_change" and held.instances_to == 3
    assert "STABILIZED: wanted up to colocated=3 in the last 20s" in held.reason
    # Once the panic's wish has left the window, the low wishes rule: 3 -> 1.
    later = policy.decide(21.0, colo(3, tps=10, tbt=0.05))
    assert later.action == "scale_in" and later.instances_to == 1


def test_heteroscale_stabilization_shrinks_to_the_window_maximum() -> None:
    policy = make_policy(
        "heteroscale",
        {
            "target_decode_tps_per_instance": 10,
            "scale_in_cooldown_s": 0,
            "scale_in_stabilization_s": 30,
        },
    )
    assert policy.decide(0.0, colo(6, tps=40)).instances_to == 4  # ratio 0.67: in to 4
    d = policy.decide(10.0, colo(4, tps=10))  # wants 1, but 4 was wanted 10 s ago
    assert d.action == "no_change" and d.instances_to == 4
    policy2 = make_policy(
        "heteroscale",
        {
            "target_decode_tps_per_instance": 10,
            "scale_in_cooldown_s": 0,
            "scale_in_stabilization_s": 30,
        },
    )
    policy2.decide(0.0, colo(6, tps=30))  # wants 3
    d2 = policy2.decide(10.0, colo(6, tps=10))  # wants 1: shrinks only to 3
    assert d2.action == "scale_in" and d2.instances_to == 3


def test_heteroscale_stabilization_off_by_default_keeps_the_vectors() -> None:
    policy = HeteroScalePolicy()
    policy.decide(0.0, split(10, 30, tps=3000, tbt=0.15))  # panic to (12, 36)
    assert counts(policy.decide(10.0, split(12, 36, tps=2500))) == (7, 21)


def test_heteroscale_ttft_trigger() -> None:
    off = HeteroScalePolicy().decide(0.0, colo(2, tps=200, ttft_p99_s=5.0))
    assert off.action == "no_change"
    policy = make_policy("heteroscale", {"ttft_slo_s": 1.5})
    d = policy.decide(0.0, colo(2, tps=200, ttft_p99_s=5.0))
    assert d.action == "scale_out" and d.instances_to == 3
    assert d.reason == "LATENCY_PANIC: ttft_p99=5s > 1.8s"
    calm = make_policy("heteroscale", {"ttft_slo_s": 1.5}).decide(0.0, colo(2, tps=200, ttft_p99_s=1.0))
    assert calm.action == "no_change"
    with pytest.raises(ValueError, match="ttft_slo_s"):
        make_policy("heteroscale", {"ttft_slo_s": -1})


def test_heteroscale_no_change_when_the_rounded_target_is_current() -> None:
    d = HeteroScalePolicy(HeteroScaleConfig(target_decode_tps_per_instance=10, scale_in_cooldown_s=0)).decide(
        0.0, colo(4, tps=31)
    )  # ratio 0.775 < 0.9 but ceil(3.1) = 4
    assert d.action == "no_change"
    assert d.reason.endswith("AT_TARGET: the rounded, clamped target colocated=4 is the current size")


def test_heteroscale_concurrency_signal_leads_decode_tps() -> None:
    # A burst has just queued 9 requests on one instance; decode TPS has not moved yet.
    burst = colo(1, tps=5, running=3, waiting=6)
    assert (
        HeteroScalePolicy(HeteroScaleConfig(target_decode_tps_per_instance=10)).decide(0.0, burst).action == "no_change"
    )
    d = make_policy("heteroscale", {"target_decode_tps_per_instance": 10, "target_requests_per_instance": 2})
    out = d.decide(0.0, burst)
    assert out.action == "scale_out" and out.instances_to == 5  # ceil(9 / 2)
    assert out.reason == "SCALE_OUT: ratio=4.5 > 1.1 need=4.5 decode_tps=5 requests=9"
    # When TPS asks for more than concurrency does, TPS wins (need is the max of the two).
    busy = make_policy("heteroscale", {"target_decode_tps_per_instance": 10, "target_requests_per_instance": 2})
    assert busy.decide(0.0, colo(1, tps=60, running=2)).instances_to == 6
