"""Capacity scheduling of one engine iteration (TensorRT-LLM GUARANTEED_NO_EVICT and
MAX_UTILIZATION semantics).

Pure functions of the queue state: no I/O, no clock, no torch. See docs/algorithms.md 5.
"""

from __future__ import annotations

import enum
from collections.abc import Sequence
from dataclasses import dataclass


class CapacityPolicy(str, enum.Enum):
    """How KV capacity gates admission."""

    # Admit only when the blocks for prompt + max_tokens are free; never pause a started request.
    GUARANTEED_NO_EVICT = "GUARANTEED_NO_EVICT"
    # Admit when the blocks for the next step are free; when running requests' next steps do not
    # fit, pause the most recently started (`pick_victims`) and recompute (or swap in) it later.
    MAX_UTILIZATION = "MAX_UTILIZATION"


@dataclass(frozen=True)
class RunningSeq:
    """A started request: `pending_tokens` have no KV yet (1 while decoding, more mid-prefill)."""

    request_id: str
    pending_tokens: int


@dataclass(frozen=True)
class WaitingSeq:
    """A queued request: its prompt length and the KV blocks it must reserve to start."""

    request_id: str
    prompt_tokens: int
    blocks_needed: int


@dataclass(frozen=True)
class SchedulerLimits:
    max_batch_size: int
    max_num_tokens: int
    chunked_prefill: bool = False


@dataclass(frozen=True)
class Schedule:
    """What one iteration runs: `work` lists (request_id, tokens), decodes first, then prefills."""

    admitted: tuple[str, ...]
    work: tuple[tuple[str, int], ...]

    @property
    def num_tokens(self) -> int:
        return sum(n for _, n in self.work)


def schedule(
    running: Sequence[RunningSeq],
    waiting: Sequence[WaitingSeq],
    available_blocks: int,
    limits: SchedulerLimits,
) -> Schedule:
    """Pick this iteration's work.

    `available_blocks` are blocks neither allocated nor reserved by running requests. Running
    requests go first (each decode counts one token, an unfinished prefill takes what budget is
    left when chunking); then waiting requests are admitted in arrival order while the batch has
    room, their KV reservation fits and their prompt fits the token budget (or, with chunking, some
    of it does). Admission stops at the first request that does not fit, so none is overtaken.
    """
    budget = limits.max_num_tokens
    work: list[tuple[str, int]] = []
    prefilling: list[RunningSeq] = []
    for seq in running:
        if seq.pending_tokens == 1:
            if budget > 0:
                work.append((seq.request_id, 1))
                budget -= 1
        elif seq.pending_tokens > 1:
            prefilling.append(seq)
    for seq in prefilling:
        n = min(seq.pending_tokens, budget) if limits.chunked_prefill else seq.pending_tokens
        if 0 < n <= budget:
            work.append((seq.request_id, n))
            budget -= n

    admitted: list[str] = []
    slots = limits.max_batch_size - len(running)
    for seq in waiting:
        if slots <= 0 or seq.blocks_needed > available_blocks:
            break
        if seq.prompt_tokens <= budget:
            n = seq.prompt_tokens
        elif limits.chunked_prefill and budget > 0:
            n = budget
        else:
            break
        admitted.append(seq.request_id)
        work.append((seq.request_id, n))
        available_blocks -= seq.blocks_needed
        budget -= n
        slots -= 1
    return Schedule(admitted=tuple(admitted), work=tuple(work))


# ---- MAX_UTILIZATION -----------------------------------------------------------------------------


def blocks_for(num_tokens: int, block_size: int) -> int:
    """KV blocks of `block_size` tokens that hold `num_tokens` tokens."""
    if num_tokens < 0 or block_size < 1:
        raise ValueError(f"blocks_for needs num_tokens >= 0 and block_size >= 1, got {num_tokens}, {block_size}")
    return -(-num_tokens // block_size)


def step_tokens(pending_tokens: int, limits: SchedulerLimits) -> int:
    """The most tokens a request with `pending_tokens` uncomputed tokens runs in its next step:
    all of them, or with chunked prefill at most `max_num_tokens` (what it may get, not what it
    will: the budget left to it can be smaller)."""
    return min(pending_tokens, limits.max_num_tokens) if limits.chunked_prefill else pending_tokens


def start_blocks(
    policy: CapacityPolicy,
    *,
    prefill_tokens: int,
    total_tokens: int,
    block_size: int,
    limits: SchedulerLimits,
) -> int:
    """The KV blocks a waiting request must find free to start (`WaitingSeq.blocks_needed`).

    GUARANTEED_NO_EVICT: its whole life, `total_tokens` (prompt + max_tokens). MAX_UTILIZATION:
    its first step only, the `prefill_tokens` to compute (its first chunk with chunked prefill).
    """
    if policy is CapacityPolicy.GUARANTEED_NO_EVICT:
        return blocks_for(total_tokens, block_size)
    return blocks_for(step_tokens(prefill_tokens, limits), block_size)


def next_step_blocks(
    *, computed_tokens: int, pending_tokens: int, blocks_held: int, block_size: int, limits: SchedulerLimits
) -> int:
    """MAX_UTILIZATION: the blocks a started request must add to run its next step (1 token when
    decoding, its next chunk mid-prefill); 0 when the blocks it holds already cover it."""
    needed = blocks_for(computed_tokens + step_tokens(pending_tokens, limits), block_size)
    return max(0, needed - blocks_held)


@dataclass(frozen=True)
class ActiveSeq:
    """A started request as preemption sees it: the blocks it holds (freed if it is paused), the
    blocks its next step adds, and whether it may be paused at all."""

    request_id: str
    blocks_held: int
    blocks_next: int
    pausable: bool = True


def pick_victims(running: Sequence[ActiveSeq], free_blocks: int) -> tuple[str, ...]:
    """The requests to pause so every other running request's next step fits in `free_blocks`.

    `running` is in start order; victims are taken from its end (the most recently started first,
    as TensorRT-LLM's MAX_UTILIZATION does: they have the least work to redo), skipping those that
    may not be paused, until the survivors' `blocks_next` fit in `free_blocks` plus the blocks
    the victims free. Empty when everything fits. If pausing every pausable request is not enough
    (unpausable ones need more than is free) they are all returned; the caller's invariant that
    unpausable requests reserve their blocks up front makes that unreachable in the engine.
    """
    deficit = sum(s.blocks_next for s in running) - free_blocks
    victims: list[str] = []
    for seq in reversed(running):
        if deficit <= 0:
            break
        if not seq.pausable:
            continue
        victims.append(seq.request_id)
        deficit -= seq.blocks_next + seq.blocks_held
    return tuple(victims)


def fold_paused_prompt(prompt_len: int, generated: int, max_input_len: int) -> int:
    """The prompt a paused request is recomputed from: its prompt with its generated tokens folded
    in, at most `max_input_len` tokens (`min(max_input_len, prompt + generated)`)."""
    if prompt_len < 0 or generated < 0 or max_input_len < 1:
        raise ValueError(
            f"fold_paused_prompt needs prompt_len, generated >= 0 and max_input_len >= 1, got "
            f"{prompt_len}, {generated}, {max_input_len}"
        )
    return min(max_input_len, prompt_len + generated)
