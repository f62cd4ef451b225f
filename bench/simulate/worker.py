"""A simulated worker: one instance's continuous-batching engine on a fitted step-time model.

Each iteration admits waiting requests FCFS while the batch has room and their KV fits
(GUARANTEED_NO_EVICT: blocks for prompt + output reserved at admission), gives the token budget
(`max_num_tokens`) to every decoding row first and the rest to prompt chunks (chunked prefill),
and lasts `FastStep(features) / speedup` (`speedup` > 1 while a ZigZag partner on a loading
instance runs part of its layers). A prompt's last chunk samples the first token; then one token
per iteration. Decoding rows are kept in a heap by the iteration they finish at, so an iteration
costs O(requests that start or end), not O(batch).
"""

from __future__ import annotations

import heapq
import math
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from services.global_manager.core.types import LoadSample

from .events import EventLoop
from .profiles import FastStep, SimProfile

__all__ = ["SimRequest", "SimWorker"]


@dataclass(slots=True)
class SimRequest:
    index: int
    arrival_s: float
    prompt: int
    output: int
    prefilled: int = 0
    first_token_s: float | None = None
    end_s: float | None = None
    blocks: int = 0
    ctx0: int = 0
    step0: int = 0
    worker: str = ""
    routed: int = 0


@dataclass
class _Stats:
    tokens: int = 0
    prefill_tokens: int = 0
    ttfts: list[float] = field(default_factory=list)
    tbts: list[float] = field(default_factory=list)


def _q(values: list[float], q: float) -> float | None:
    if not values:
        return None
    xs = sorted(values)
    return xs[min(len(xs), max(1, math.ceil(q * len(xs) - 1e-9))) - 1]


class SimWorker:
    def __init__(
        self,
        iid: str,
        host: str,
        profile: SimProfile,
        loop: EventLoop,
        on_first_token: Callable[[SimRequest], None],
        on_finish: Callable[[SimRequest], None],
        on_empty: Callable[[str], None],
    ) -> None:
        self.iid, self.host, self.loop = iid, host, loop
        self.step = FastStep(profile.step)
        self.max_batch = profile.max_batch
        self.max_num_tokens = profile.max_num_tokens
        self.kv_total = profile.kv_blocks
        self.block_size = profile.block_size
        self.on_first_token, self.on_finish, self.on_empty = on_first_token, on_finish, on_empty
        self.waiting: deque[SimRequest] = deque()
        self.prefilling: list[SimRequest] = []
        self.decoding: list[tuple[int, int, SimRequest]] = []  # (finish step, index, request)
        self.ctx_sum = 0
        self.kv_used = 0
        self.step_no = 0
        self.busy = False
        self.speedup = 1.0
        self.stats = _Stats()
        self.busy_s = 0.0

    # ---- requests ----------------------------------------------------------------------------
    @property
    def running(self) -> int:
        return len(self.prefilling) + len(self.decoding)

    @property
    def empty(self) -> bool:
        return not (self.waiting or self.prefilling or self.decoding)

    def submit(self, req: SimRequest) -> None:
        req.worker = self.iid
        req.blocks = -(-(req.prompt + req.output) // self.block_size)
        if req.blocks > self.kv_total:
            raise ValueError(f"request {req.index} needs {req.blocks} KV blocks, {self.iid} has {self.kv_total}")
        self.waiting.append(req)
        if not self.busy:
            self._start_step()

    def release_waiting(self, n: int) -> list[SimRequest]:
        """Up to n queued (not yet admitted) requests, newest first, for the gateway to re-route."""
        out = []
        while self.waiting and len(out) < n:
            out.append(self.waiting.pop())
        return out

    # ---- iterations --------------------------------------------------------------------------
    def _start_step(self) -> None:
        waiting = self.waiting
        while waiting and self.running < self.max_batch and self.kv_used + waiting[0].blocks <= self.kv_total:
            r = waiting.popleft()
            self.kv_used += r.blocks
            self.prefilling.append(r)
        rows = len(self.decoding)
        budget = self.max_num_tokens - rows
        ptok = 0
        pairs = 0.0
        seqs = 0
        plan: list[tuple[SimRequest, int]] = []
        for r in self.prefilling:
            if budget <= 0:
                break
            n = min(budget, r.prompt - r.prefilled)
            pairs += n * (r.prefilled + (n + 1) / 2)
            ptok += n
            budget -= n
            plan.append((r, n))
            if r.prefilled + n == r.prompt:
                seqs += 1
        if ptok == 0 and rows == 0:
            self.busy = False
            self.on_empty(self.iid)
            return
        self.busy = True
        dt = self.step(ptok, pairs, seqs, rows, self.ctx_sum) / self.speedup
        self.busy_s += dt
        self.loop.after(dt, lambda: self._end_step(plan, rows, ptok, dt))

    def _end_step(self, plan: list[tuple[SimRequest, int]], rows: int, ptok: int, dt: float) -> None:
        now = self.loop.now_s
        self.step_no += 1
        stats = self.stats
        if rows:
            stats.tokens += rows
            stats.tbts.append(dt)
            self.ctx_sum += rows
            heap = self.decoding
            while heap and heap[0][0] <= self.step_no:
                _, _, r = heapq.heappop(heap)
                self.ctx_sum -= r.ctx0 + (self.step_no - r.step0)
                self._finish(r, now)
        stats.prefill_tokens += ptok
        for r, n in plan:
            r.prefilled += n
            if r.prefilled < r.prompt:
                continue
            self.prefilling.remove(r)
            r.first_token_s = now
            stats.tokens += 1
            stats.ttfts.append(now - r.arrival_s)
            self.on_first_token(r)
            if r.output <= 1:
                self._finish(r, now)
            else:
                r.ctx0, r.step0 = r.prompt + 1, self.step_no
                self.ctx_sum += r.ctx0
                heapq.heappush(self.decoding, (self.step_no + r.output - 1, r.index, r))
        self._start_step()

    def _finish(self, r: SimRequest, now: float) -> None:
        r.end_s = now
        self.kv_used -= r.blocks
        self.on_finish(r)

    # ---- heartbeat -----------------------------------------------------------------------------
    def sample(self, now_s: float, period_s: float, *, serving: bool) -> LoadSample:
        """The LoadReport the real worker sends, from what happened since the last one."""
        s, self.stats = self.stats, _Stats()
        return LoadSample(
            instance_id=self.iid,
            now_s=now_s,
            decode_tps=s.tokens / period_s,
            prefill_tps=s.prefill_tokens / period_s,
            ttft_p50_s=_q(s.ttfts, 0.5),
            ttft_p99_s=_q(s.ttfts, 0.99),
            tbt_p50_s=_q(s.tbts, 0.5),
            tbt_p99_s=_q(s.tbts, 0.99),
            running=self.running,
            waiting=len(self.waiting),
            waiting_prefill_tokens=sum(r.prompt for r in self.waiting)
            + sum(r.prompt - r.prefilled for r in self.prefilling),
            kv_blocks_used=self.kv_used if serving else 0,
            kv_blocks_total=self.kv_total if serving else 0,
        )
