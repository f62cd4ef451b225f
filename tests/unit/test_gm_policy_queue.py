"""HeteroScale's queue-aware trigger (`queue_target_s`): queued prompt tokens and the wait they
mean at the pool's prefill rate grow the pools in one step, before TTFT rises; off, the
docs/algorithms.md 1 vectors hold as written."""

from __future__ import annotations

import pytest

from services.global_manager.core.policies import HeteroScaleConfig, HeteroScalePolicy
from tests.unit.test_gm_policies import colo, counts, split


def policy(**kw: object) -> HeteroScalePolicy:
    return HeteroScalePolicy(HeteroScaleConfig(target_decode_tps_per_instance=100.0, max_instances=100, **kw))


def test_a_queue_that_waits_past_the_target_grows_the_pool_by_the_wait_in_one_step() -> None:
    # 10 instances in band on decode TPS; 60,000 prompt tokens queued at 20,000 tokens/s: 3 s.
    snap = colo(10, tps=1000.0, waiting_prefill_tokens=60_000, prefill_tps=20_000)
    d = policy(queue_target_s=1.0).decide(0.0, snap)
    assert d.action == "scale_out" and d.instances_to == 30  # x3, not x1.2
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
    d = policy(queue_target_s=2.0).decide(0.0, snap)
    assert d.action == "scale_out" and counts(d) == (8, 24)


def test_the_queue_trigger_waits_out_the_cooldown_and_holds_a_scale_in() -> None:
    p = policy(queue_target_s=1.0, scale_out_cooldown_s=10.0, hold_scale_in_on_panic=True)
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


def test_off_it_leaves_the_written_heteroscale() -> None:
    snap = colo(10, tps=1000.0, waiting_prefill_tokens=60_000, prefill_tps=20_000)
    assert policy(queue_target_s=None).decide(0.0, snap).action == "no_change"


@pytest.mark.parametrize(("field", "bad"), [("queue_target_s", 0.0), ("queue_max_factor", 0.5)])
def test_bad_values_are_refused(field: str, bad: float) -> None:
    with pytest.raises(ValueError, match=field):
        HeteroScaleConfig(**{field: bad})
