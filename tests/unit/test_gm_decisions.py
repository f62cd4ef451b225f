"""Decision reporting (which decisions are told) and the actuator's bounds: pure helpers."""

from __future__ import annotations

import pytest

from services.global_manager.core.decisions import DecisionThrottle, bounded_delta, reason_key
from services.global_manager.core.types import ScaleDecision


def decision(now_s: float, reason: str, frm: int = 2, to: int = 2) -> ScaleDecision:
    action = "no_change" if frm == to else ("scale_out" if to > frm else "scale_in")
    return ScaleDecision(
        action=action,
        reason=reason,
        policy="heteroscale",
        now_s=now_s,  # type: ignore[arg-type]
        instances_from=frm,
        instances_to=to,
    )


def test_reason_key_masks_numbers_only() -> None:
    a = decision(1.0, "IN_BAND: ratio=0.95 within 0.9..1.1 need=1.9 decode_tps=190")
    b = decision(2.0, "IN_BAND: ratio=1.02 within 0.9..1.1 need=2.04 decode_tps=204")
    c = decision(3.0, "SCALE_IN: ratio=0.5 < 0.9 need=1 decode_tps=100; COOLDOWN: scale_in held until t=60")
    assert reason_key(a) == reason_key(b)
    assert reason_key(a) != reason_key(c)
    assert reason_key(decision(1.0, "x", 2, 2)) != reason_key(decision(1.0, "x", 3, 3))  # pool size matters
    assert reason_key(decision(1.0, "t=1e-05 inf")) == reason_key(decision(1.0, "t=2.5 inf"))


def test_throttle_reports_each_new_kind_and_repeats_at_a_reduced_rate() -> None:
    t = DecisionThrottle(repeat_s=30.0)
    told = [
        t.should_report(decision(0.0, "IN_BAND: ratio=1")),  # first: told
        t.should_report(decision(0.5, "IN_BAND: ratio=1.05")),  # same kind: quiet
        t.should_report(decision(1.0, "SCALE_OUT: ratio=2", 2, 4)),  # a change: told
        t.should_report(decision(1.5, "SCALE_OUT: ratio=2", 2, 4)),  # the same change again (not carried out): quiet
        t.should_report(decision(2.0, "SCALE_OUT: ratio=2", 3, 4)),  # the pool moved: told
        t.should_report(decision(2.5, "IN_BAND: ratio=1", 4, 4)),  # new kind (and size): told
        t.should_report(decision(20.0, "IN_BAND: ratio=0.99", 4, 4)),  # quiet
        t.should_report(decision(32.6, "IN_BAND: ratio=0.98", 4, 4)),  # repeat_s passed: told
    ]
    assert told == [True, False, True, False, True, True, False, True]
    t.reset()
    assert t.should_report(decision(33.0, "IN_BAND: ratio=0.98", 4, 4))


def test_throttle_rejects_bad_period() -> None:
    with pytest.raises(ValueError, match="repeat_s"):
        DecisionThrottle(repeat_s=0)


@pytest.mark.parametrize(
    ("current", "wanted", "low", "high", "delta", "note"),
    [
        (1, 3, 1, 4, 2, ""),
        (1, 9, 1, 4, 3, "held at manager max_instances=4 (policy wanted 9)"),
        (3, 0, 1, 4, -2, "held at manager min_instances=1 (policy wanted 0)"),
        (2, 2, 1, 4, 0, ""),
    ],
)
def test_bounded_delta(current: int, wanted: int, low: int, high: int, delta: int, note: str) -> None:
    assert bounded_delta(current, wanted, low=low, high=high) == (delta, note)


def test_bounded_delta_rejects_inverted_bounds() -> None:
    with pytest.raises(ValueError, match="low=5"):
        bounded_delta(1, 1, low=5, high=4)


def test_heteroscale_can_hold_scale_in_while_latency_panics() -> None:
    from services.global_manager.core.policies import make_policy
    from services.global_manager.core.types import ClusterSnapshot, PoolSnapshot, Role

    def colo(n: int, tps: float, tbt: float) -> ClusterSnapshot:
        pool = PoolSnapshot(Role.COLOCATED, serving=n, instances_reporting=n, decode_tps=tps, tbt_p50_s=tbt)
        return ClusterSnapshot(now_s=0.0, pools={Role.COLOCATED: pool}, disaggregated=False)

    spec = make_policy("heteroscale", {"scale_out_cooldown_s": 100})
    held = make_policy("heteroscale", {"scale_out_cooldown_s": 100, "hold_scale_in_on_panic": True})
    for policy in (spec, held):
        assert policy.decide(0.0, colo(4, tps=400, tbt=0.5)).action == "scale_out"  # panic: 4 -> 5
    # Panic again at t=10 (held by the scale-out cooldown) with TPS collapsed to 50.
    assert spec.decide(10.0, colo(5, tps=50, tbt=0.5)).action == "scale_in"  # docs/algorithms.md fall-through
    d = held.decide(10.0, colo(5, tps=50, tbt=0.5))
    assert d.action == "no_change" and "HELD: no scale-in while latency is above the panic line" in d.reason
    assert held.decide(11.0, colo(5, tps=50, tbt=0.05)).action == "scale_in"  # latency fine again
