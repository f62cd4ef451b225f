"""Capacity scheduling, pure: docs/algorithms.md 5 vectors under both policies, and
MAX_UTILIZATION's admission, victim choice and prompt folding."""

from __future__ import annotations

import pytest

from services.worker.engine.scheduler import (
    ActiveSeq,
    CapacityPolicy,
    RunningSeq,
    SchedulerLimits,
    WaitingSeq,
    blocks_for,
    fold_paused_prompt,
    next_step_blocks,
    pick_victims,
    schedule,
    start_blocks,
)

BLOCK = 4


def waiting(
    policy: CapacityPolicy, request_id: str, prompt: int, max_tokens: int, limits: SchedulerLimits
) -> WaitingSeq:
    blocks = start_blocks(
        policy, prefill_tokens=prompt, total_tokens=prompt + max_tokens, block_size=BLOCK, limits=limits
    )
    return WaitingSeq(request_id, prompt, blocks)


@pytest.mark.parametrize("policy", list(CapacityPolicy))
def test_batching_vector(policy: CapacityPolicy) -> None:
    """max_batch_size 4, max_num_tokens 12, 5-token prompts: 1 and 2 run; the remaining budget of 2
    blocks the rest; next iteration 2 generation tokens, then 3 and 4 enter; 5 waits for the batch
    size until 1 finishes. The same under both policies when the KV pool is not the limit."""
    limits = SchedulerLimits(max_batch_size=4, max_num_tokens=12)
    queue = [waiting(policy, f"r{i}", 5, 8, limits) for i in range(1, 6)]
    pool = 100
    first = schedule([], queue, pool, limits)
    assert first.admitted == ("r1", "r2") and first.work == (("r1", 5), ("r2", 5)) and first.num_tokens == 10
    running = [RunningSeq("r1", 1), RunningSeq("r2", 1)]
    second = schedule(running, queue[2:], pool, limits)
    assert second.admitted == ("r3", "r4")
    assert second.work == (("r1", 1), ("r2", 1), ("r3", 5), ("r4", 5)) and second.num_tokens == 12
    full = [RunningSeq(f"r{i}", 1) for i in range(1, 5)]
    assert schedule(full, queue[4:], pool, limits).admitted == ()  # the batch is full
    after_r1 = schedule(full[1:], queue[4:], pool, limits)
    assert after_r1.admitted == ("r5",) and after_r1.work[-1] == ("r5", 5)


def test_policies_differ_on_what_a_start_reserves() -> None:
    """5-token prompts, max_tokens 8, 4-token blocks, 5 free blocks: GUARANTEED_NO_EVICT reserves
    prompt + max_tokens (4 blocks) and starts one request; MAX_UTILIZATION reserves the prompt
    (2 blocks) and starts two."""
    limits = SchedulerLimits(max_batch_size=4, max_num_tokens=12)
    no_evict = [waiting(CapacityPolicy.GUARANTEED_NO_EVICT, f"r{i}", 5, 8, limits) for i in (1, 2, 3)]
    max_util = [waiting(CapacityPolicy.MAX_UTILIZATION, f"r{i}", 5, 8, limits) for i in (1, 2, 3)]
    assert [w.blocks_needed for w in no_evict] == [4, 4, 4]
    assert [w.blocks_needed for w in max_util] == [2, 2, 2]
    assert schedule([], no_evict, 5, limits).admitted == ("r1",)
    assert schedule([], max_util, 5, limits).admitted == ("r1", "r2")


def test_max_utilization_reserves_the_first_chunk_only() -> None:
    chunked = SchedulerLimits(max_batch_size=4, max_num_tokens=12, chunked_prefill=True)
    whole = SchedulerLimits(max_batch_size=4, max_num_tokens=12)
    kw = {"prefill_tokens": 40, "total_tokens": 60, "block_size": BLOCK}
    assert start_blocks(CapacityPolicy.MAX_UTILIZATION, limits=chunked, **kw) == 3  # 12 tokens
    assert start_blocks(CapacityPolicy.MAX_UTILIZATION, limits=whole, **kw) == 10  # 40 tokens
    assert start_blocks(CapacityPolicy.GUARANTEED_NO_EVICT, limits=chunked, **kw) == 15  # 60 tokens


def test_next_step_blocks() -> None:
    limits = SchedulerLimits(max_batch_size=4, max_num_tokens=12, chunked_prefill=True)
    kw = {"block_size": BLOCK, "limits": limits}
    # Decoding: 8 tokens computed in 2 full blocks, the 9th needs a third; 9 computed in 3 blocks
    # leave room for the 10th.
    assert next_step_blocks(computed_tokens=8, pending_tokens=1, blocks_held=2, **kw) == 1
    assert next_step_blocks(computed_tokens=9, pending_tokens=1, blocks_held=3, **kw) == 0
    # Mid-prefill with chunking: the next chunk is at most max_num_tokens (12 -> 3 blocks).
    assert next_step_blocks(computed_tokens=12, pending_tokens=30, blocks_held=3, **kw) == 3
    # Just admitted, nothing held yet.
    assert next_step_blocks(computed_tokens=0, pending_tokens=5, blocks_held=0, **kw) == 2
    assert blocks_for(0, BLOCK) == 0 and blocks_for(4, BLOCK) == 1 and blocks_for(5, BLOCK) == 2


def test_pause_vector() -> None:
    """Prompt 100, 30 generated, max_input_len 120: the new prompt is 120 tokens and the request's
    blocks are freed."""
    assert fold_paused_prompt(100, 30, 120) == 120
    assert fold_paused_prompt(100, 10, 120) == 110
    assert fold_paused_prompt(100, 0, 120) == 100
    # Pausing it frees every block it holds: with 0 free, its 33 blocks (130 tokens) let the
    # other request's next block fit.
    running = [ActiveSeq("old", blocks_held=10, blocks_next=1), ActiveSeq("paused", blocks_held=33, blocks_next=1)]
    assert pick_victims(running, free_blocks=0) == ("paused",)
    with pytest.raises(ValueError, match="got 100, -1, 120"):
        fold_paused_prompt(100, -1, 120)


def test_victims_are_the_most_recently_started_first() -> None:
    running = [ActiveSeq(f"r{i}", blocks_held=2, blocks_next=1) for i in range(1, 5)]
    # Everything fits: nobody is paused.
    assert pick_victims(running, free_blocks=4) == ()
    # One block short: the newest goes (it frees 2 and needs none).
    assert pick_victims(running, free_blocks=3) == ("r4",)
    # Four short: r4 frees 2 + 1, r3 another 3.
    assert pick_victims(running, free_blocks=0) == ("r4", "r3")


def test_victims_skip_requests_that_may_not_be_paused() -> None:
    running = [
        ActiveSeq("r1", blocks_held=2, blocks_next=1),
        ActiveSeq("r2", blocks_held=2, blocks_next=1),
        ActiveSeq("handoff", blocks_held=2, blocks_next=1, pausable=False),
    ]
    assert pick_victims(running, free_blocks=2) == ("r2",)
    # Even if the unpausable request's need cannot be met, it is never chosen; every pausable one is.
    assert pick_victims(running, free_blocks=-10) == ("r2", "r1")


def test_a_request_needing_no_block_may_still_be_paused_for_others() -> None:
    # r2 is mid-block (its next token fits), r1 needs two blocks for its next chunk: r2 still goes,
    # being the most recent; the oldest is kept.
    running = [ActiveSeq("r1", blocks_held=3, blocks_next=2), ActiveSeq("r2", blocks_held=1, blocks_next=0)]
    assert pick_victims(running, free_blocks=1) == ("r2",)
