"""Borrowed prefill (TokenScale) in the global manager's pure core: while every prefill instance
has a backlog, a decode-light decode instance runs a new request whole (`choose_borrower`), and
the manager's config turns it on or off with the core's defaults."""

from __future__ import annotations

from typing import Any

import pytest

from services.global_manager.config import GlobalManagerConfig
from services.global_manager.core.routing import BorrowPrefill, choose_borrower, prompt_wait_s
from services.global_manager.core.types import InstanceState, InstanceView, Role
from tests.unit.test_gm_prefix_routing import inst as view

S = InstanceState
P, D, C = Role.PREFILL, Role.DECODE, Role.COLOCATED
BORROW = BorrowPrefill(wait_s=0.5, max_decode_requests=4)
CAPACITY = 1000.0  # prompt tokens per second


def inst(
    iid: str,
    role: Role,
    *,
    queued: int = 0,
    capacity: float = CAPACITY,
    routed: int = 0,
    kv_total: int = 100,
    **kw: Any,
) -> InstanceView:
    """A view with its latest report (test_gm_prefix_routing's), here with 100 KV blocks, its
    queued prompt tokens and its measured prefill capacity."""
    return view(
        iid,
        role=role,
        waiting_prefill_tokens=queued,
        prefill_capacity_tps=capacity,
        routes=routed,
        kv_total=kv_total,
        **kw,
    )


def lender(pool: list[InstanceView], prompt_tokens: int = 256, **kw: object) -> str | None:
    chosen = choose_borrower(pool, BORROW, prompt_tokens=prompt_tokens, model="m", **kw)  # type: ignore[arg-type]
    return None if chosen is None else chosen.instance_id


# A prefill pool whose every instance has 1.0 s and 2.0 s of prompts queued (at 1,000 tokens/s).
BACKLOGGED = [inst("p0", P, queued=1000), inst("p1", P, queued=2000)]


def test_backlogged_prefill_pool_and_a_light_decoder_borrow() -> None:
    pool = [*BACKLOGGED, inst("d0", D, running=1)]
    assert lender(pool) == "d0"


def test_the_least_loaded_light_decoder_lends() -> None:
    pool = [*BACKLOGGED, inst("d0", D, running=3), inst("d1", D, running=1), inst("d2", D, running=1, kv_used=50)]
    assert lender(pool) == "d1"


def test_a_decoder_at_its_decode_load_bound_does_not_lend() -> None:
    # 4 requests held (running + waiting + routed since its report): at the bound of 4, so no.
    for busy in (
        inst("d0", D, running=4),
        inst("d0", D, running=2, waiting=2),
        inst("d0", D, running=3, routed=1),
    ):
        assert lender([*BACKLOGGED, busy]) is None
    # One below the bound lends, and the lighter of two still wins.
    assert lender([*BACKLOGGED, inst("d0", D, running=3)]) == "d0"
    assert lender([*BACKLOGGED, inst("d0", D, running=4), inst("d1", D, running=2)]) == "d1"


def test_prefill_pool_not_backlogged_does_not_borrow() -> None:
    light = inst("d0", D)
    # One prefill instance with only 0.3 s queued: a new prompt waits less there.
    assert lender([inst("p0", P, queued=300), inst("p1", P, queued=5000), light]) is None
    # At the threshold exactly is not above it.
    assert lender([inst("p0", P, queued=500), light]) is None
    assert lender([inst("p0", P, queued=501), light]) == "d0"
    # An idle prefill pool.
    assert lender([inst("p0", P), light]) is None


def test_routes_since_the_report_count_as_this_prompt_on_the_prefill_side() -> None:
    # 0.3 s reported + 2 routes of 128 tokens not reported yet = 0.556 s: backlogged.
    light = inst("d0", D)
    assert lender([inst("p0", P, queued=300, routed=2), light], prompt_tokens=128) == "d0"
    assert lender([inst("p0", P, queued=300, routed=1), light], prompt_tokens=128) is None


def test_wait_is_taken_at_each_instances_measured_capacity() -> None:
    light = inst("d0", D)
    # 1,000 queued tokens: 1 s on a 1,000 tokens/s instance, 0.1 s on a 10,000 tokens/s one.
    assert lender([inst("p0", P, queued=1000, capacity=10_000.0), light]) is None
    assert lender([inst("p0", P, queued=1000, capacity=1000.0), light]) == "d0"
    # Unmeasured instances count at the pool's mean capacity; with none measured there is no
    # backlog to read.
    assert lender([inst("p0", P, queued=1000), inst("p1", P, queued=800, capacity=0.0), light]) == "d0"
    assert lender([inst("p0", P, queued=1000, capacity=0.0), light]) is None


def test_a_decoder_with_a_longer_prompt_queue_than_the_prefill_pool_does_not_lend() -> None:
    # The decoder has 1.5 s of borrowed prompts queued; the shortest prefill queue is 1.0 s.
    assert lender([*BACKLOGGED, inst("d0", D, running=1, queued=1500)]) is None
    assert lender([*BACKLOGGED, inst("d0", D, running=1, queued=900)]) == "d0"


def test_decoder_needs_room_tpot_and_to_be_eligible() -> None:
    # KV blocks for prompt + max_tokens (16-token blocks: 256 + 64 = 20 blocks).
    full = inst("d0", D, kv_used=90, kv_total=100)
    assert lender([*BACKLOGGED, full], max_tokens=64, kv_block_size_tokens=16) is None
    assert lender([*BACKLOGGED, inst("d0", D, kv_used=80)], max_tokens=64, kv_block_size_tokens=16) == "d0"
    slow = inst("d0", D, est_tpot_s=0.3)
    assert lender([*BACKLOGGED, slow], tpot_slo_s=0.2) is None
    assert lender([*BACKLOGGED, slow], tpot_slo_s=0.5) == "d0"
    assert lender([*BACKLOGGED, inst("d0", D)], exclude_ids={"d0"}) is None
    assert lender([*BACKLOGGED, inst("d0", D, state=S.LOADING)]) is None
    assert lender([*BACKLOGGED, inst("d0", D, model="other")]) is None
    # A colocated instance is not a decode instance, and excluding the backlogged prefill
    # instances leaves no pool to read a backlog from.
    assert lender([*BACKLOGGED, inst("c0", C)]) is None
    assert lender([*BACKLOGGED, inst("d0", D)], exclude_ids={"p0", "p1"}) is None


def test_prompt_wait_and_settings_reject_bad_values() -> None:
    view = inst("p0", P, queued=100, capacity=0.0, routed=2)
    assert prompt_wait_s(view, 100.0, tokens_per_route=50) == pytest.approx(2.0)
    with pytest.raises(ValueError, match="mean_capacity_tps must be > 0, got 0.0"):
        prompt_wait_s(view, 0.0)
    with pytest.raises(ValueError, match="wait_s must be a finite number of seconds >= 0, got -1.0"):
        BorrowPrefill(wait_s=-1.0)
    with pytest.raises(ValueError, match="max_decode_requests must be >= 1, got 0"):
        BorrowPrefill(max_decode_requests=0)
    with pytest.raises(ValueError, match="prompt_tokens and max_tokens must be >= 0, got -1 and 0"):
        choose_borrower(BACKLOGGED, BORROW, prompt_tokens=-1)


def test_manager_config_takes_the_core_defaults_and_turns_off() -> None:
    cfg = GlobalManagerConfig()
    assert cfg.borrow_prefill is True
    assert (cfg.borrow_prefill_wait_s, cfg.borrow_prefill_max_decode_requests) == (
        BorrowPrefill().wait_s,
        BorrowPrefill().max_decode_requests,
    )
    assert GlobalManagerConfig(borrow_prefill=False).borrow_prefill is False
    with pytest.raises(ValueError, match="borrow_prefill_max_decode_requests"):
        GlobalManagerConfig(borrow_prefill_max_decode_requests=0)
