"""MAX_UTILIZATION preemption in the engine (capacity_policy=MAX_UTILIZATION, docs/algorithms.md 5):
the step's first stage when it is planned. It pauses running requests whose next steps no longer
fit the KV pool, swaps paused ones back in, and sets every pausable request's reservation to
what its next step needs. The pure choices (victims, blocks, the folded prompt) are in
`services/worker/engine/scheduler.py`; this acts on the engine's queues and cache."""

from __future__ import annotations

from collections import deque
from collections.abc import Callable

import structlog

from services.worker.engine.kv_cache import KVCache
from services.worker.engine.request import EngineRequest, RequestMode, RequestStatus, SwappedKV
from services.worker.engine.scheduler import (
    ActiveSeq,
    CapacityPolicy,
    SchedulerLimits,
    blocks_for,
    fold_paused_prompt,
    next_step_blocks,
    pick_victims,
    start_blocks,
)

log = structlog.get_logger(__name__)


def pausable(seq: EngineRequest) -> bool:
    """Whether MAX_UTILIZATION may pause `seq` (and so lets it reserve only its next step).

    Requests whose KV is not simply theirs to recompute are never paused and keep the
    GUARANTEED_NO_EVICT reservation they got when added: a hand-off (it ends after its first
    token anyway), a ZigZag request on a loading instance (its KV is pulled by its partner),
    one whose KV is arriving or whose ZigZag continuation has not run yet (a pull writes into
    its blocks), and one leaving by live migration."""
    return not (
        seq.mode.hands_off
        or seq.mode is RequestMode.ZIGZAG_FIRST_LAYERS
        or seq.fill is not None
        or seq.status in (RequestStatus.WAITING_FOR_KV, RequestStatus.MIGRATING)
        or seq.zz_hidden is not None
    )


class Preemption:
    """Acts on the engine's own running list and waiting queue (the same objects) and its cache.
    `available_blocks` counts the free blocks not promised to running requests."""

    def __init__(
        self,
        kv_cache: KVCache,
        running: list[EngineRequest],
        waiting: deque[EngineRequest],
        limits: SchedulerLimits,
        available_blocks: Callable[[], int],
        *,
        mode: str,
        max_input_len: int,
    ) -> None:
        self._cache = kv_cache
        self._running = running
        self._waiting = waiting
        self._limits = limits
        self._available_blocks = available_blocks
        self._mode = mode
        # The longest prompt a paused request can be recomputed from.
        self._max_input_len = max_input_len
        self.counts = {"recompute": 0, "swap": 0}  # pauses so far, by how

    def make_room(self) -> None:
        """Pause running requests (the most recently started first) until every other one's next
        step fits in the free blocks, swap paused requests back in when they fit, and set each
        pausable request's reservation to what its next step needs (`blocks_reserved`, which
        the engine's available blocks and the scheduler count)."""
        cache = self._cache
        bs = cache.block_size
        paused = False
        # Again after each round of pauses, from the blocks actually free: a victim's blocks may
        # not all come back (e.g. shared with another sequence by an allocator that shares).
        while True:
            active: list[ActiveSeq] = []
            for seq in self._running:
                held = cache.num_blocks_of(seq.request_id)
                can_pause = pausable(seq)
                if can_pause:
                    nxt = next_step_blocks(
                        computed_tokens=seq.num_computed,
                        pending_tokens=seq.pending,
                        blocks_held=held,
                        block_size=bs,
                        limits=self._limits,
                    )
                    seq.blocks_reserved = held + nxt
                else:
                    nxt = max(0, seq.blocks_reserved - held)
                active.append(ActiveSeq(seq.request_id, held, nxt, can_pause))
            victims = pick_victims(active, cache.free_blocks)
            if not victims:
                break
            by_id = {s.request_id: s for s in self._running}
            for request_id in victims:  # the most recently started first: each goes to the queue's front
                self._pause(by_id[request_id])
            paused = True
        if not paused:
            self._swap_in()
        for seq in self._waiting:
            if seq.status is RequestStatus.SWAPPED:
                # Never admitted by the scheduler (which would prefill it from scratch): the
                # queue stops at it until `_swap_in` restores it.
                seq.blocks_reserved = cache.total_blocks + 1
            elif seq.status is RequestStatus.PREEMPTED:
                # Back only when all of its recomputed tokens fit: started on a first chunk, it
                # would be the most recent again and the first to be paused again.
                seq.blocks_reserved = blocks_for(seq.num_tokens, bs)
            elif pausable(seq):
                seq.blocks_reserved = start_blocks(
                    CapacityPolicy.MAX_UTILIZATION,
                    prefill_tokens=seq.prefill_len,
                    total_tokens=len(seq.prompt) + seq.params.max_tokens,
                    block_size=bs,
                    limits=self._limits,
                )

    def _pause(self, seq: EngineRequest) -> None:
        """Stop a running request and put it at the front of the queue with its generated tokens.

        Recompute (the default): its KV is dropped and its output folded into the prompt it is
        prefilled from again (`resumed`, as a request migrated here resumes), so the stream goes
        on with no token repeated or lost: a seeded sampler keeps its state, penalties their
        history. The engine's input limit is the model's context, which prompt + max_tokens never
        exceeds, so the fold never cuts; without chunked prefill a fold longer than
        max_num_tokens could never be prefilled again, and such a request is swapped instead.
        Swap: its KV is copied to host memory and restored into fresh blocks by `_swap_in`."""
        computed = seq.num_computed
        generated = len(seq.output)
        folded = fold_paused_prompt(len(seq.prompt), generated, self._max_input_len)
        swap = computed > 0 and (self._mode == "swap" or folded < seq.num_tokens)
        if swap:
            k, v = self._cache.copy_out(seq.request_id, computed)
            seq.swapped = SwappedKV(k, v, computed)
        else:
            seq.resumed = generated
            if seq.prompt_logprobs is not None and len(seq.prompt_logprobs) < len(seq.prompt):
                del seq.prompt_logprobs[1:]  # computed again with the prompt
        self._cache.free(seq.request_id)
        seq.num_computed = 0
        seq.status = RequestStatus.SWAPPED if swap else RequestStatus.PREEMPTED
        self._running.remove(seq)
        self._waiting.appendleft(seq)
        self.counts["swap" if swap else "recompute"] += 1
        log.info(
            "request_paused",
            request_id=seq.request_id,
            mode="swap" if swap else "recompute",
            kv_tokens=computed,
            generated=generated,
        )

    def _swap_in(self) -> None:
        """Restore swapped requests at the front of the queue, in order, while the batch has room
        and the blocks for their KV and next step are free; they go on as running requests."""
        bs = self._cache.block_size
        while self._waiting and len(self._running) < self._limits.max_batch_size:
            seq = self._waiting[0]
            if seq.status is not RequestStatus.SWAPPED:
                return
            swapped = seq.swapped
            assert swapped is not None
            held = blocks_for(swapped.num_tokens, bs)
            need = held + next_step_blocks(
                computed_tokens=swapped.num_tokens,
                pending_tokens=seq.num_tokens - swapped.num_tokens,
                blocks_held=held,
                block_size=bs,
                limits=self._limits,
            )
            if need > self._available_blocks():
                return
            self._waiting.popleft()
            self._cache.copy_in(seq.request_id, swapped.k, swapped.v)
            seq.num_computed = swapped.num_tokens
            seq.swapped = None
            seq.status = RequestStatus.RUNNING
            seq.blocks_reserved = need
            self._running.append(seq)
            log.info("request_swapped_in", request_id=seq.request_id, kv_tokens=swapped.num_tokens)
