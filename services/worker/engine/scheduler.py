"""Capacity scheduling of one engine iteration (TensorRT-LLM GUARANTEED_NO_EVICT semantics).

A pure function of the queue state: no I/O, no clock, no torch. See ALGORITHMS.md section 5.
"""

from __future__ import annotations

import enum
from collections.abc import Sequence
from dataclasses import dataclass


class CapacityPolicy(str, enum.Enum):
    """How KV capacity gates admission."""

    # Admit only when the blocks for prompt + max_tokens are free; never pause a started request.
    GUARANTEED_NO_EVICT = "GUARANTEED_NO_EVICT"


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
