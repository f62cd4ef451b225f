"""HeteroScale's queue-aware trigger (`queue_target_s`): queued prompt tokens and the wait they
mean at each instance's measured prefill capacity (or, before any is measured, the pool's served
prefill rate) grow the pools in one step, before TTFT rises; off, the docs/algorithms.md 1
vectors hold as written."""

from __future__ import annotations

import pytest

from services.global_manager.core.load_monitor import LoadMonitor
from services.global_manager.core.policies import HeteroScaleConfig, HeteroScalePolicy, queue_wait_s
from services.global_manager.core.types import ClusterSnapshot, LoadSample, Role
from tests.unit.test_gm_monitor import view
from tests.unit.test_gm_policies import colo, counts, split


def policy(**kw: object) -> HeteroScalePolicy:
    return HeteroScalePolicy(HeteroScaleConfig(target_decode_tps_per_instance=100.0, max_instances=100, **kw))


def test_a_queue_that_waits_past_the_target_grows_the_pool_by_the_wait_in_one_step() -> None:
    # 10 instances in band on decode TPS; 60,000 prompt tokens queued at 20,000 tokens/s: 3 s.
    snap = colo(10, tps=1000.0, waiting_prefill_tokens=60_000, prefill_tps=20_000)
    d = policy(queue_target_s=1.0).decide(0.0, snap)
    assert d.action == "scale_out" and d.instances_to == 40  # x(1 + 3), not x1.2: no slope yet, as drain
    assert policy(queue_target_s=1.0, queue_growth="wait").decide(0.0, snap).instances_to == 30  # x3
    assert d.reason.startswith("QUEUE: 60000 prompt tokens queued wait 3s at 20000 tokens/s > 1s")
    capped = policy(queue_target_s=0.1, queue_max_factor=4.0).decide(0.0, snap)
    assert capped.instances_to == 40  # x30 wanted, queue_max_factor 4
    assert policy(queue_target_s=5.0).decide(0.0, snap).action == "no_change"  # 3 s is within 5 s


def test_tokens_queued_with_no_prefill_rate_yet_count_as_the_largest_step() -> None:
    snap = colo(5, tps=500.0, waiting_prefill_tokens=3000)
    d = policy(queue_target_s=1.0, queue_max_factor=2.0).decide(0.0, snap)
    assert d.action == "scale_out" and d.instances_to == 10


def test_a_small_backlog_on_a_near_idle_pool_is_not_a_queue() -> None:
    """The rate is measured, so it is as low as the demand on a quiet pool: 40 queued tokens at
    20 tokens/s read as a 2 s wait. Below queue_min_tokens (512 by default) nothing fires."""
    snap = colo(2, tps=200.0, waiting_prefill_tokens=40, prefill_tps=20)
    assert policy(queue_target_s=0.5).decide(0.0, snap).action == "no_change"
    assert policy(queue_target_s=0.5, queue_min_tokens=0).decide(0.0, snap).action == "scale_out"


def test_disaggregated_reads_the_prefill_pools_queue_and_grows_both_pools() -> None:
    snap = split(4, 12, tps=1200.0, prefill={"waiting_prefill_tokens": 40_000, "prefill_tps": 10_000})
    d = policy(queue_target_s=2.0, queue_growth="wait").decide(0.0, snap)
    assert d.action == "scale_out" and counts(d) == (8, 24)


def test_the_queue_trigger_waits_out_the_cooldown_and_holds_a_scale_in() -> None:
    p = policy(queue_target_s=1.0, scale_out_cooldown_s=10.0, queue_cooldown_s=None, hold_scale_in_on_panic=True)
    snap = colo(10, tps=1000.0, waiting_prefill_tokens=60_000, prefill_tps=20_000)
    assert p.decide(0.0, snap).action == "scale_out"
    held = p.decide(5.0, snap)
    assert held.action == "no_change" and "held by scale_out cooldown until t=10" in held.reason
    # Decode TPS says scale in, but prompts are queued: not while they wait.
    quiet = colo(10, tps=100.0, waiting_prefill_tokens=60_000, prefill_tps=20_000)
    assert p.decide(6.0, quiet).action == "no_change"


def test_the_shipped_default_is_on_at_half_a_second() -> None:
    cfg = HeteroScaleConfig()
    assert (cfg.queue_target_s, cfg.queue_max_factor, cfg.queue_min_tokens) == (0.5, 8.0, 512)
    assert (cfg.queue_rate, cfg.queue_growth, cfg.queue_cooldown_s) == ("capacity", "arrivals", 2.0)
    assert (cfg.queue_lead_s, cfg.queue_slope_window_s) == (2.0, 1.0)


def test_off_it_leaves_the_written_heteroscale() -> None:
    snap = colo(10, tps=1000.0, waiting_prefill_tokens=60_000, prefill_tps=20_000)
    assert policy(queue_target_s=None).decide(0.0, snap).action == "no_change"


@pytest.mark.parametrize(("field", "bad"), [("queue_target_s", 0.0), ("queue_max_factor", 0.5)])
def test_bad_values_are_refused(field: str, bad: float) -> None:
    with pytest.raises(ValueError, match=field):
        HeteroScaleConfig(**{field: bad})


# -- the wait at each instance's measured prefill capacity ----------------------------------------


def monitored(*samples: tuple[str, int, float], served: float = 0.0) -> ClusterSnapshot:
    """A colocated snapshot through the real LoadMonitor: one heartbeat per (instance, queued
    prompt tokens, measured prefill capacity; 0 = none yet), each serving `served` tokens/s."""
    mon = LoadMonitor(window_s=10.0, lost_after_s=30.0)
    for iid, queued, capacity in samples:
        mon.observe(
            LoadSample(
                iid,
                1.0,
                decode_tps=100.0,
                prefill_tps=served,
                waiting_prefill_tokens=queued,
                prefill_capacity_tps=capacity,
            )
        )
    return mon.snapshot(1.0, [view(iid, Role.COLOCATED) for iid, _, _ in samples])


def test_a_near_idle_pool_never_reads_as_a_queue_at_its_capacity() -> None:
    """40 queued tokens served at 20 tokens/s read as 2 s, but the instances prefill 10,000
    tokens/s: 4 ms. No floor on the tokens is needed, unlike the served rate's."""
    snap = monitored(("a", 40, 10_000.0), ("b", 0, 10_000.0), served=20.0)
    assert queue_wait_s(snap.token_pool) == pytest.approx(0.002)
    assert policy(queue_min_tokens=0).decide(2.0, snap).action == "no_change"
    served = policy(queue_min_tokens=0, queue_rate="served").decide(2.0, snap)
    assert served.action == "scale_out" and "at 40 tokens/s" in served.reason  # the false alarm it avoids


def test_a_backlog_on_slow_instances_waits_longer_than_the_same_on_fast_ones() -> None:
    # 3,000 tokens on an instance that prefills 1,000 tokens/s: 3 s; its fast peer is empty.
    # The mean wait over the two, 1.5 s, is x3 the 0.5 s target.
    slow = monitored(("slow", 3000, 1000.0), ("fast", 0, 10_000.0))
    assert queue_wait_s(slow.token_pool) == pytest.approx(1.5)
    d = policy(queue_growth="wait").decide(2.0, slow)
    assert d.action == "scale_out" and d.instances_to == 6 and d.reason.startswith("QUEUE: 3000 prompt tokens")
    fast = monitored(("slow", 0, 1000.0), ("fast", 3000, 10_000.0))  # 0.3 s on the fast one
    assert queue_wait_s(fast.token_pool) == pytest.approx(0.15)
    assert policy().decide(2.0, fast).action == "no_change"


def test_an_instance_without_a_capacity_yet_counts_at_the_pools_mean() -> None:
    # "new" has not prefilled yet: its 8,000 tokens count at the measured mean, 4,000 tokens/s.
    snap = monitored(("a", 0, 2000.0), ("b", 0, 6000.0), ("new", 8000, 0.0))
    assert queue_wait_s(snap.token_pool) == pytest.approx(2.0 / 3)


def test_with_no_capacity_measured_anywhere_the_served_rate_and_its_floor_decide() -> None:
    snap = monitored(("a", 3000, 0.0), ("b", 0, 0.0), served=500.0)
    assert queue_wait_s(snap.token_pool) is None
    d = policy().decide(2.0, snap)  # 3,000 tokens at 1,000 tokens/s served: 3 s
    assert d.action == "scale_out" and "at 1000 tokens/s > 0.5s" in d.reason
    assert policy(queue_min_tokens=4000).decide(2.0, snap).action == "no_change"


def test_a_negative_capacity_is_refused_by_name() -> None:
    with pytest.raises(ValueError, match=r"prefill_capacity_tps must be >= 0, got -1\.0"):
        LoadSample("w", 0.0, prefill_capacity_tps=-1.0)
    with pytest.raises(ValueError, match="queue_rate"):
        HeteroScaleConfig(queue_rate="guess")  # type: ignore[arg-type]


def test_the_wait_is_each_instances_latest_heartbeat_not_its_window_mean() -> None:
    """A queue is a state: a burst's backlog counts at its size now, not averaged with the
    empty heartbeats before it."""
    mon = LoadMonitor(window_s=10.0, lost_after_s=30.0)
    for t, queued in ((1.0, 0), (2.0, 0), (3.0, 0), (4.0, 5000)):
        mon.observe(LoadSample("a", t, waiting_prefill_tokens=queued, prefill_capacity_tps=1000.0))
    pool = mon.snapshot(4.0, [view("a", Role.COLOCATED)]).token_pool
    assert queue_wait_s(pool) == pytest.approx(5.0)  # 5,000 tokens at 1,000 tokens/s; a mean: 1.25
    assert pool.waiting_prefill_tokens == pytest.approx(1250.0)  # the rates and counts stay window means


def test_drain_growth_keeps_the_served_load_and_adds_the_backlogs_drain() -> None:
    # 1.5 s of backlog against a 0.5 s target: wait grows the 2 instances x3, drain x(1 + 3).
    slow = monitored(("slow", 3000, 1000.0), ("fast", 0, 10_000.0))
    assert policy(queue_growth="wait").decide(2.0, slow).instances_to == 6
    d = policy().decide(2.0, slow)
    assert d.action == "scale_out" and d.instances_to == 8 and d.extra["queue_factor"] == pytest.approx(4.0)
    assert policy(queue_growth="drain", queue_max_factor=2.5).decide(2.0, slow).instances_to == 5


def test_the_queue_trigger_has_its_own_shorter_cooldown() -> None:
    """2 s by default: a backlog at capacity is work waiting now, and the pool it grows from
    already counts the instances still loading. The other rules keep scale_out_cooldown_s."""
    p = policy(queue_target_s=1.0, scale_out_cooldown_s=10.0)
    snap = colo(10, tps=1000.0, waiting_prefill_tokens=60_000, prefill_tps=20_000)
    assert p.decide(0.0, snap).instances_to == 40
    held = p.decide(1.0, colo(40, tps=4000.0, waiting_prefill_tokens=240_000, prefill_tps=80_000))
    assert held.action == "no_change" and "held by scale_out cooldown until t=2" in held.reason
    again = p.decide(2.0, colo(40, tps=4000.0, waiting_prefill_tokens=240_000, prefill_tps=80_000))
    assert again.action == "scale_out" and again.instances_to == 100  # x4, at max_instances


# -- arrivals growth: the wait's slope ------------------------------------------------------------


def queued(n: int, tokens: int, tps: float = 1000.0) -> ClusterSnapshot:
    """`n` instances with `tokens` prompt tokens queued at 20,000 tokens/s served (the served
    rate: no capacity measured), decode TPS `tps` (100 per instance is in band)."""
    return colo(n, tps=tps, waiting_prefill_tokens=tokens, prefill_tps=20_000)


def test_a_wait_that_grows_sizes_the_step_by_the_arrivals_and_the_backlog_at_load_end() -> None:
    """Nothing queued at 0 s, 1.2 s of wait at 0.5 s: the wait gains 2.4 s per second, so the
    arrivals are 3.4x what the pool computes. Grown by 1 + 2.4 to keep up, and by
    (1.2 + 2.4 * 2 s of load) / 1 s to drain the backlog there will be when the new instances
    have loaded: x9.4. Drain, blind to the slope, grows x2.2."""
    p = policy(queue_target_s=1.0, queue_max_factor=10.0)
    assert p.decide(0.0, queued(10, 0)).action == "no_change"
    d = p.decide(0.5, queued(10, 24_000))
    assert d.action == "scale_out" and d.instances_to == 94
    assert d.extra["queue_factor"] == pytest.approx(9.4)
    assert "rising 2.4s/s" in d.reason
    drain = policy(queue_target_s=1.0, queue_max_factor=10.0, queue_growth="drain")
    drain.decide(0.0, queued(10, 0))
    assert drain.decide(0.5, queued(10, 24_000)).instances_to == 22
    shorter = policy(queue_target_s=1.0, queue_max_factor=10.0, queue_lead_s=0.5)
    shorter.decide(0.0, queued(10, 0))
    assert shorter.decide(0.5, queued(10, 24_000)).extra["queue_factor"] == pytest.approx(1 + 2.4 + 1.2 + 1.2)


def test_no_slope_from_a_wait_too_recent_or_too_old_and_none_from_a_falling_one() -> None:
    # 0.1 s apart is under a quarter of the 1 s window: no slope, so as drain (x(1 + 1.2)).
    p = policy(queue_target_s=1.0, queue_max_factor=10.0)
    p.decide(0.0, queued(10, 0))
    assert p.decide(0.1, queued(10, 24_000)).instances_to == 22
    # The empty queue 2 s ago fell out of the window.
    old = policy(queue_target_s=1.0, queue_max_factor=10.0)
    old.decide(0.0, queued(10, 0))
    assert old.decide(2.0, queued(10, 24_000)).instances_to == 22
    # A shrinking backlog: drain's growth, never less.
    falling = policy(queue_target_s=1.0, queue_max_factor=10.0, queue_cooldown_s=0.0)
    falling.decide(0.0, queued(10, 48_000))
    assert falling.decide(0.5, queued(10, 24_000)).instances_to == 22


def test_the_slope_is_from_the_latest_wait_old_enough_so_a_calm_stretch_does_not_dilute_a_step() -> None:
    """Empty at 0 s and at 0.5 s, 1.2 s of wait at 0.75 s: a step burst began after 0.5 s. From
    0.5 s (the latest wait at least a quarter of the window old) the wait gains 4.8 s per second;
    from 0 s it would read 1.6, and size the step for a third of the arrivals."""
    p = policy(queue_target_s=1.0, queue_max_factor=20.0)
    p.decide(0.0, queued(10, 0))
    p.decide(0.5, queued(10, 0))
    d = p.decide(0.75, queued(10, 24_000))
    assert "rising 4.8s/s" in d.reason
    assert d.extra["queue_factor"] == pytest.approx(1 + 4.8 + 1.2 + 4.8 * 2)


def test_no_scale_in_while_the_queued_prompts_wait_grows_even_below_the_target() -> None:
    """Decode TPS says scale in (100 tokens/s on 10 instances), but the queue went from empty to
    0.5 s of wait in half a second: a burst the TPS window has not seen. Held; the same queue
    not growing lets the scale-in go."""
    p = policy(queue_target_s=1.0, hold_scale_in_on_panic=True, scale_in_cooldown_s=0.0)
    p.decide(0.0, queued(10, 0, tps=100.0))
    held = p.decide(0.5, queued(10, 10_000, tps=100.0))
    assert held.action == "no_change" and "HELD: no scale-in while the queued prompts' wait grows" in held.reason
    steady = p.decide(1.6, queued(10, 10_000, tps=100.0))  # the empty queue left the 1 s window
    assert steady.action == "scale_in" and steady.instances_to == 1
    unheld = policy(queue_target_s=1.0, scale_in_cooldown_s=0.0)  # hold_scale_in_on_panic off
    unheld.decide(0.0, queued(10, 0, tps=100.0))
    assert unheld.decide(0.5, queued(10, 10_000, tps=100.0)).action == "scale_in"


def test_a_wait_below_the_target_that_will_pass_it_within_a_load_fires_early() -> None:
    """With the projection on: 0.3 s of wait at 0.5 s, from none at 0 s, is under the 1 s
    target, but gaining 0.6 s per second it is 1.5 s by the time a 2 s load ends. Fired now,
    sized as the arrivals growth (1 + 0.6 + 1.5 / 1), instead of once the wait itself is past."""
    p = policy(queue_target_s=1.0, queue_max_factor=20.0, queue_project_min_s=0.125)
    p.decide(0.0, queued(10, 0))
    d = p.decide(0.5, queued(10, 6_000))
    assert d.action == "scale_out" and d.extra["queue_factor"] == pytest.approx(3.1) and d.instances_to == 31
    assert "wait 0.3s at 20000 tokens/s, rising 0.6s/s: 1.5s in 2s > 1s" in d.reason
    # A flat wait under the target stays quiet; so does the projection off (the default), or
    # drain's growth.
    flat = policy(queue_target_s=1.0, queue_project_min_s=0.125)
    flat.decide(0.0, queued(10, 6_000))
    assert flat.decide(0.5, queued(10, 6_000)).action == "no_change"
    for off in (
        policy(queue_target_s=1.0),
        policy(queue_target_s=1.0, queue_project_min_s=0.125, queue_growth="drain"),
    ):
        off.decide(0.0, queued(10, 0))
        assert off.decide(0.5, queued(10, 6_000)).action == "no_change"


def test_a_start_up_ripple_under_the_projection_floor_does_not_fire() -> None:
    """0.12 s of wait gaining 0.24 s/s projects to 0.6 s, past the 0.5 s target, but a wait under
    the 0.125 s floor is a few prompts on a fresh pool, not a burst; a lower floor lets it fire."""
    low = policy(queue_project_min_s=0.125)
    low.decide(0.0, queued(10, 0))
    assert low.decide(0.5, queued(10, 2_400)).action == "no_change"
    lower = policy(queue_project_min_s=0.1)
    lower.decide(0.0, queued(10, 0))
    assert lower.decide(0.5, queued(10, 2_400)).action == "scale_out"


@pytest.mark.parametrize(
    ("field", "bad"), [("queue_lead_s", -1.0), ("queue_slope_window_s", 0.0), ("queue_project_min_s", -0.1)]
)
def test_bad_slope_settings_are_refused(field: str, bad: float) -> None:
    with pytest.raises(ValueError, match=field):
        HeteroScaleConfig(**{field: bad})


def test_a_tick_held_for_a_growing_wait_does_not_hold_the_window_after_it() -> None:
    """The held tick records the pool the rule wanted (1), not the current one (10): with a 60 s
    stabilization window, recording 10 held every scale-in for a minute after each such tick
    (in hour1000, +32% instance-seconds)."""
    p = policy(queue_target_s=1.0, hold_scale_in_on_panic=True, scale_in_cooldown_s=0.0, scale_in_stabilization_s=60.0)
    p.decide(0.0, queued(10, 0, tps=100.0))
    assert p.decide(0.5, queued(10, 10_000, tps=100.0)).action == "no_change"  # held: the wait grows
    after = p.decide(1.6, queued(10, 10_000, tps=100.0))
    assert after.action == "scale_in" and after.instances_to == 1, after.reason
