"""A simulated worker: one instance's continuous-batching engine on a fitted step-time model.

Each iteration admits waiting requests FCFS while the batch has room and their KV fits
(GUARANTEED_NO_EVICT: blocks for prompt + output reserved at admission), gives the token budget
(`max_num_tokens`) to every decoding row first and the rest to prompt chunks (chunked prefill),
and lasts `FastStep(features) / speedup` (`speedup` > 1 while a ZigZag partner on a loading
instance runs part of its layers). A prompt's last chunk samples a token; then one token per
iteration. Decoding rows are kept in a heap by the iteration they finish at, so an iteration
costs O(requests that start or end), not O(batch).

A request runs here in one of three phases. "full": prompt and decode. "prefill" (the prefill
side of a P/D pair): the prompt and the first token, then its KV is offered (`on_handoff`) and
its blocks held until the peer has pulled it (`release_offer`). "decode" (the decode side, or
a live-migrated request): admitted like any other, then it waits for its KV to land
(`on_pull`, `kv_landed`) and decodes the rest; a pull that fails recomputes the context here
(`pull_failed`). A resumed request (`generated` > 0) prefills its prompt plus the tokens it
already has, which yields its next token.

Event skipping (`skip`, on by default; the step-by-step model stays the reference and a test
pins them equal): while no prompt is in the batch, no request can be admitted and nothing
outside changes, every iteration until the next row finishes is a decode step of the same rows,
so their times are computed in one loop (each exactly as its own step would be) and one event
is scheduled at the end of the last. Whatever touches the worker before then (a request it
could admit, a KV landing or freed, a speedup, a release, a kill, a heartbeat) first brings it
to the state it would have at that moment: the steps ended so far are counted, and the one
under way becomes an ordinary step again.
"""

from __future__ import annotations

import dataclasses
import heapq
import math
from bisect import bisect_left
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Literal

from services.common.backlog import sample_wait_s
from services.global_manager.core.types import LoadSample

from .cpu import HostCpu
from .events import EventLoop, Timer
from .profiles import FastStep, SimProfile

__all__ = ["Phase", "SimRequest", "SimWorker", "WindowStats"]

Phase = Literal["full", "prefill", "decode"]


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
    phase: Phase = "full"
    generated: int = 0  # tokens produced so far (the first one included), on any instance
    ctx: int = 0  # tokens this instance prefills: the prompt plus `generated` when resumed
    kv_from: str = ""  # decode phase: the instance whose KV this one pulls
    kv_tokens: int = 0  # decode phase: tokens of KV to pull
    kv_kind: str = "kv"  # what the pull's bytes are counted as: "kv" (P/D hand-off), "migration"
    resumed: int = 0  # times the gateway carried it to another instance

    @property
    def remaining(self) -> int:
        return self.output - self.generated


class _Stats:
    """What happened since the last heartbeat (a fresh one per heartbeat: a plain slotted class,
    since a dataclass's default factories cost more than the report itself here)."""

    __slots__ = ("tokens", "prefill_tokens", "ttfts", "tbts")

    def __init__(self) -> None:
        self.tokens = 0
        self.prefill_tokens = 0
        self.ttfts: list[float] = []
        self.tbts: list[float] = []


@dataclass
class WindowStats:
    """The real engine's load statistics (`services/worker/engine`): rates and percentiles over
    a sliding `window_s`, one TBT sample per token (each request's gap), not one per step."""

    window_s: float
    tokens: deque[tuple[float, int]] = field(default_factory=deque)
    prefill: deque[tuple[float, int]] = field(default_factory=deque)
    ttfts: deque[tuple[float, float]] = field(default_factory=deque)
    tbts: deque[tuple[float, float, int]] = field(default_factory=deque)

    def prune(self, now_s: float) -> None:
        edge = now_s - self.window_s
        for d in (self.tokens, self.prefill, self.ttfts, self.tbts):
            while d and d[0][0] <= edge:
                d.popleft()


def _wq(samples: list[tuple[float, int]], q: float) -> float | None:
    """Nearest-rank percentile of values each repeated `weight` times."""
    total = sum(w for _, w in samples)
    if total <= 0:
        return None
    rank = max(1, math.ceil(q * total - 1e-9))
    seen = 0
    for v, w in sorted(samples):
        seen += w
        if seen >= rank:
            return v
    return samples[-1][0]


# The fields a simulated worker reports, in `_load_sample`'s argument order; the others keep
# their defaults (ZigZag relays, SLO rejections, prefix hits: the simulator models none).
_SAMPLE_GIVEN = (
    "instance_id",
    "now_s",
    "decode_tps",
    "prefill_tps",
    "ttft_p50_s",
    "ttft_p99_s",
    "tbt_p50_s",
    "tbt_p99_s",
    "running",
    "waiting",
    "waiting_prefill_tokens",
    "kv_blocks_used",
    "kv_blocks_total",
    "prefill_capacity_tps",
)
_SAMPLE_SET = tuple(LoadSample.__dict__[name].__set__ for name in _SAMPLE_GIVEN)
_SAMPLE_DEFAULTS = tuple(
    (LoadSample.__dict__[f.name].__set__, f.default)
    for f in dataclasses.fields(LoadSample)
    if f.name not in _SAMPLE_GIVEN
)
assert all(default is not dataclasses.MISSING for _, default in _SAMPLE_DEFAULTS)


def _load_sample(*values: object) -> LoadSample:
    """`LoadSample(**dict(zip(_SAMPLE_GIVEN, values)))`, filled through its slot setters: a
    frozen dataclass's `__init__` sets each of its 22 fields by name, and a thousand workers
    report every heartbeat. `__post_init__` checks it as the constructor would."""
    sample = object.__new__(LoadSample)
    for set_field, value in zip(_SAMPLE_SET, values, strict=True):
        set_field(sample, value)
    for set_field, default in _SAMPLE_DEFAULTS:
        set_field(sample, default)
    sample.__post_init__()
    return sample


def _p50_p99(values: list[float]) -> tuple[float | None, float | None]:
    """Nearest-rank p50 and p99 of `values` (None, None for none), sorting once."""
    if not values:
        return None, None
    xs = sorted(values)
    n = len(xs)
    return xs[min(n, max(1, math.ceil(0.5 * n - 1e-9))) - 1], xs[min(n, max(1, math.ceil(0.99 * n - 1e-9))) - 1]


def _nothing(r: SimRequest) -> None:
    return None


_MIN_CHUNK, _MAX_CHUNK = 8, 512  # decode steps a span computes ahead


@dataclass(slots=True)
class _Span:
    """Decode steps of the same rows computed ahead: step i lasts dts[i] and ends at ends[i];
    the first `done` of them are counted in the worker's state."""

    rows: int
    ends: list[float]
    dts: list[float]
    epoch: int
    timer: Timer
    done: int = 0


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
        on_handoff: Callable[[SimRequest], None] = _nothing,
        on_pull: Callable[[SimRequest], None] = _nothing,
        on_queued: Callable[[SimRequest], None] = _nothing,
        cpu: HostCpu | None = None,
        cpu_step: tuple[float, float] = (0.0, 0.0),
        skip: bool = True,
        decode_free_bound: bool = False,
    ) -> None:
        self.iid, self.host, self.loop = iid, host, loop
        # A bound, not a mechanism: while sped up as a ZigZag partner, its decode rows and their
        # context cost nothing (more than pipelined decode could take off it: that moves only
        # layers [0, k) of the split requests' decode to the loading instance).
        self.decode_free_bound = decode_free_bound
        # Opt-in CPU contention (`cpu.py`): each step computes cpu_step[0] + cpu_step[1] x batch
        # tokens CPU-seconds on the host's shared cores and lasts max(pace, that compute).
        self.cpu = cpu
        self.cpu_step = cpu_step
        self.step = FastStep(profile.step)
        self.max_batch = profile.max_batch
        self.max_num_tokens = profile.max_num_tokens
        # The prefill capacity it reports (the real engine's is measured from its prefill steps):
        # its own speed, a whole chunk of prompt tokens per step of that chunk alone.
        chunk = profile.max_num_tokens
        self.prefill_capacity_tps = chunk / self.step(chunk, chunk * (chunk + 1) / 2, 1, 0, 0)
        self.kv_total = profile.kv_blocks
        self.block_size = profile.block_size
        self.on_first_token, self.on_finish, self.on_empty = on_first_token, on_finish, on_empty
        self.on_handoff, self.on_pull, self.on_queued = on_handoff, on_pull, on_queued
        self.reported_wait_s = 0.0  # the queued prompts' wait its last heartbeat said
        self.waiting: deque[SimRequest] = deque()
        self._waiting_tokens = 0  # prompt tokens queued in `waiting` (decode-phase ones: none)
        self.prefilling: list[SimRequest] = []
        self._prefill_left = 0  # prompt tokens of `prefilling` not prefilled yet
        self.decoding: list[tuple[int, int, SimRequest]] = []  # (finish step, index, request)
        self.pulling: dict[int, SimRequest] = {}  # admitted, their KV on its way here
        # KV held here until a peer pulls it, with its blocks (the puller reserves its own).
        self.offered: dict[int, tuple[SimRequest, int]] = {}
        self.ctx_sum = 0
        self.kv_used = 0
        self.step_no = 0
        self.busy = False
        self._speedup = 1.0
        self.skip = skip and cpu is None
        self._span: _Span | None = None
        self._chunk = _MIN_CHUNK
        self.stats = _Stats()
        # Set (seconds) to report as the real engine does: a sliding window, TBT per token.
        self.window: WindowStats | None = None
        self.busy_s = 0.0
        self.alive = True  # False once killed or hung: no more steps, no heartbeats
        # `unstarted_prompts` as of the last change to the queue or the prefills, and where to
        # note the worker when that or `alive` changes (the pulled ZigZag pairing watches its
        # partners through it instead of asking each one on every layer landing).
        self._unstarted = False
        self.flips: set[SimWorker] | None = None
        self._epoch = 0  # a step scheduled before a kill ends in nothing

    # ---- requests ----------------------------------------------------------------------------
    @property
    def speedup(self) -> float:
        return self._speedup

    @speedup.setter
    def speedup(self, value: float) -> None:
        if value != self._speedup:
            self._interrupt()  # the step under way keeps the old speedup, the next ones take this
            self._speedup = value

    @property
    def running(self) -> int:
        return len(self.prefilling) + len(self.decoding) + len(self.pulling)

    @property
    def unstarted_prompts(self) -> bool:
        """Whether a prompt here has not started its prefill: queued, or admitted with nothing
        prefilled yet. This worker admits up to its batch and KV whatever the step's token
        budget; the live engine admits a prompt only when its prefill starts, so these are the
        requests it still holds waiting (and a pulled ZigZag partner can hand over). A step
        gives its budget to `prefilling` in order and admissions append with nothing
        prefilled, so the started ones are a prefix: the last one says it (a hot path)."""
        return self._waiting_tokens > 0 or (bool(self.prefilling) and self.prefilling[-1].prefilled == 0)

    def _note_unstarted(self) -> None:
        """After a change to `waiting` or `prefilling`: note a change of `unstarted_prompts`."""
        now = self._waiting_tokens > 0 or (bool(self.prefilling) and self.prefilling[-1].prefilled == 0)
        if now != self._unstarted:
            self._unstarted = now
            if self.flips is not None:
                self.flips.add(self)

    @property
    def empty(self) -> bool:
        return not (self.waiting or self.prefilling or self.decoding or self.pulling or self.offered)

    def submit(self, req: SimRequest, phase: Phase = "full") -> None:
        """Queue `req` here in `phase`; for "decode", `kv_from` and `kv_tokens` say what to pull."""
        req.worker = self.iid
        req.phase = phase
        req.prefilled = 0
        req.ctx = req.prompt + req.generated
        tokens = req.ctx if phase == "prefill" else req.prompt + req.output
        req.blocks = -(-tokens // self.block_size)
        if req.blocks > self.kv_total:
            raise ValueError(f"request {req.index} needs {req.blocks} KV blocks, {self.iid} has {self.kv_total}")
        if (
            self._span is not None
            and not self.waiting
            and self.running < self.max_batch
            and self.kv_used + req.blocks <= self.kv_total
        ):
            self._interrupt()  # admitted when the step under way ends; else it waits behind the batch
        self.waiting.append(req)
        if phase != "decode":
            self._waiting_tokens += req.ctx
            self._note_unstarted()
        if not self.busy and self.alive:
            self._start_step()
        if phase != "decode":
            self.on_queued(req)

    def release_waiting(self, n: int) -> list[SimRequest]:
        """Up to n queued (not yet admitted) requests, newest first, for the gateway to re-route."""
        if not self.waiting:
            return []  # nothing changes here: the steps under way go on as planned
        self._interrupt()
        out = []
        while self.waiting and len(out) < n:
            r = self.waiting.pop()
            if r.phase != "decode":
                self._waiting_tokens -= r.ctx
            out.append(r)
        self._note_unstarted()
        return out

    def release_running(self, n: int, min_tokens_left: int = 0) -> list[SimRequest]:
        """Live migration: up to n decoding rows with at least `min_tokens_left` tokens left, the
        most recently started first (the least KV to move), leave between steps; their KV stays
        offered here until the new instance has pulled it (`release_offer`). Each one's
        `generated` is brought up to date."""
        self._interrupt()
        left = [
            e for e in self.decoding if e[2].output - (e[2].generated + self.step_no - e[2].step0) >= min_tokens_left
        ]
        rows = sorted(left, key=lambda e: (-e[2].step0, -e[2].index))[:n]
        out = []
        for entry in rows:
            r = entry[2]
            self.decoding.remove(entry)
            done = self.step_no - r.step0
            self.ctx_sum -= r.ctx0 + done
            r.generated += done
            self.offered[r.index] = (r, r.blocks)
            out.append(r)
        if out:
            heapq.heapify(self.decoding)
        return out

    def release_offer(self, r: SimRequest) -> None:
        """The peer has pulled `r`'s KV (or never will): its blocks are free."""
        held = self.offered.pop(r.index, None)
        if held is not None:
            self._interrupt()
            self.kv_used -= held[1]
            if self.alive and not self.busy:
                self._start_step()

    def kv_landed(self, r: SimRequest) -> None:
        """`r`'s KV is here: it decodes from the next iteration on."""
        if r.index not in self.pulling:
            return
        self._interrupt()
        del self.pulling[r.index]
        self._join_decode(r)
        if self.alive and not self.busy:
            self._start_step()

    def pull_failed(self, r: SimRequest) -> None:
        """The KV could not be pulled (its holder died): recompute the context here."""
        if r.index not in self.pulling:
            return
        self._interrupt()
        del self.pulling[r.index]
        r.phase, r.prefilled, r.ctx = "full", 0, r.prompt + r.generated
        self.prefilling.append(r)
        self._prefill_left += r.ctx
        self._note_unstarted()
        if self.alive and not self.busy:
            self._start_step()

    def freeze(self) -> None:
        """The process hangs (SIGSTOP): the step under way never ends, no new one starts;
        requests it is sent queue here. `kill` later collects them."""
        span = self._span
        if span is not None:
            self._advance(self.loop.now_s)
            span.timer.cancel()
            self._span = None
        self.alive = False
        if self.flips is not None:
            self.flips.add(self)
        self.busy = False
        self._epoch += 1
        if self.cpu is not None:
            self.cpu.cancel(self.iid)

    def kill(self) -> tuple[list[SimRequest], list[SimRequest]]:
        """The process dies (or hangs for good); no step, heartbeat or callback from here on.
        Returns the requests it ran or queued (`generated` up to date), and those whose KV it
        only held for a peer (the peer owns them; its pull fails)."""
        self.freeze()
        out = list(self.waiting) + self.prefilling + list(self.pulling.values())
        for _, _, r in self.decoding:
            r.generated += self.step_no - r.step0
            out.append(r)
        offered = sorted((r for r, _ in self.offered.values()), key=lambda r: r.index)
        self.waiting.clear()
        self._waiting_tokens = 0
        self.prefilling, self.decoding = [], []
        self._prefill_left = 0
        self.pulling, self.offered = {}, {}
        self.ctx_sum = self.kv_used = 0
        self._note_unstarted()
        return sorted(out, key=lambda r: r.index), offered

    # ---- iterations --------------------------------------------------------------------------
    def _start_step(self) -> None:
        waiting = self.waiting
        while waiting and self.running < self.max_batch and self.kv_used + waiting[0].blocks <= self.kv_total:
            r = waiting.popleft()
            self.kv_used += r.blocks
            if r.phase == "decode":
                self.pulling[r.index] = r
                self.on_pull(r)
            else:
                self._waiting_tokens -= r.ctx
                self.prefilling.append(r)
                self._prefill_left += r.ctx - r.prefilled
        self._note_unstarted()  # admitted here, or prefilled by the step that just ended
        rows = len(self.decoding)
        budget = self.max_num_tokens - rows
        ptok = 0
        pairs = 0.0
        seqs = 0
        plan: list[tuple[SimRequest, int]] = []
        for r in self.prefilling:
            if budget <= 0:
                break
            n = min(budget, r.ctx - r.prefilled)
            pairs += n * (r.prefilled + (n + 1) / 2)
            ptok += n
            budget -= n
            plan.append((r, n))
            if r.prefilled + n == r.ctx:
                seqs += 1
        if ptok == 0 and rows == 0:
            self.busy = False
            self.on_empty(self.iid)
            return
        self.busy = True
        free = self.decode_free_bound and self._speedup > 1.0
        dt = self.step(ptok, pairs, seqs, 0 if free else rows, 0 if free else self.ctx_sum) / self._speedup
        epoch = self._epoch
        if self.skip and not plan and self.decoding[0][0] - self.step_no > 1:
            self._start_span(rows, dt)
            return
        if self.cpu is None:
            self.busy_s += dt
            self.loop.after(dt, lambda: self._end_step(plan, rows, ptok, dt, epoch))
            return
        # The real engine's pacing: compute, then sleep out what is left of the pace.
        t0 = self.loop.now_s
        work = (self.cpu_step[0] + self.cpu_step[1] * (ptok + rows)) / self.speedup

        def computed() -> None:
            if epoch != self._epoch:
                return
            end = max(t0 + dt, self.loop.now_s)
            self.busy_s += end - t0
            self.loop.at(end, lambda: self._end_step(plan, rows, ptok, end - t0, epoch))

        self.cpu.start(self.iid, work, computed)

    def _end_step(self, plan: list[tuple[SimRequest, int]], rows: int, ptok: int, dt: float, epoch: int) -> None:
        if epoch != self._epoch:
            return
        now = self.loop.now_s
        self.step_no += 1
        stats = self.stats
        win = self.window
        if rows:
            stats.tokens += rows
            stats.tbts.append(dt)
            if win is not None:
                win.tokens.append((now, rows))
                win.tbts.append((now, dt, rows))
            self.ctx_sum += rows
            heap = self.decoding
            while heap and heap[0][0] <= self.step_no:
                _, _, r = heapq.heappop(heap)
                self.ctx_sum -= r.ctx0 + (self.step_no - r.step0)
                r.generated = r.output
                self._finish(r, now)
        stats.prefill_tokens += ptok
        if win is not None and ptok:
            win.prefill.append((now, ptok))
        for r, n in plan:
            r.prefilled += n
            self._prefill_left -= n
            if r.prefilled < r.ctx:
                continue
            self.prefilling.remove(r)
            r.generated += 1
            stats.tokens += 1
            if win is not None:
                win.tokens.append((now, 1))
            if r.first_token_s is None:
                r.first_token_s = now
                stats.ttfts.append(now - r.arrival_s)
                if win is not None:
                    win.ttfts.append((now, now - r.arrival_s))
                self.on_first_token(r)
            if r.remaining <= 0:
                self._finish(r, now)
            elif r.phase == "prefill":
                self.offered[r.index] = (r, r.blocks)
                self.on_handoff(r)
            else:
                self._join_decode(r)
        self._start_step()

    # ---- event skipping ------------------------------------------------------------------------
    def _start_span(self, rows: int, dt: float) -> None:
        """Decode steps of these `rows` up to the one the first of them finishes at (several:
        nothing else can change meanwhile), each timed as `_start_step` times it, one event at
        the end of the last. At most `_chunk` steps at once (its last one's end starts the next
        span), doubled after a span that ran to its end and reset when one is interrupted, so
        little is computed ahead that an arrival throws away."""
        n = min(self.decoding[0][0] - self.step_no, self._chunk)
        self._chunk = min(2 * self._chunk, _MAX_CHUNK)
        # FastStep(0, 0.0, 0, rows, ctx) / speedup, its sum in its own order: the prompt terms
        # add zeros, so (base + row x rows) + ctx_coeff x ctx, bit for bit.
        step, speedup = self.step, self._speedup
        head, per_ctx, overhead = step.base + step.row * rows, step.ctx, step.overhead
        if self.decode_free_bound and speedup > 1.0:
            head, per_ctx = step.base, 0.0
        ctx = self.ctx_sum
        t = self.loop.now_s + dt
        ends, dts = [t], [dt]
        for _ in range(n - 1):
            ctx += rows
            x = head + per_ctx * ctx
            dt = ((x if x > 0.0 else 0.0) + overhead) / speedup
            t = t + dt
            ends.append(t)
            dts.append(dt)
        epoch = self._epoch
        self._span = _Span(rows, ends, dts, epoch, self.loop.at(t, self._end_span))
        self.busy_s += dts[0]

    def _advance(self, now_s: float) -> None:
        """Count the span's steps that ended before `now_s` (all but its last), as `_end_step`
        would. A step ending at `now_s` itself is still under way: its end event would have been
        scheduled after whatever runs now (a heartbeat, an arrival)."""
        span = self._span
        assert span is not None
        i, last = span.done, len(span.ends) - 1
        ends, dts, rows = span.ends, span.dts, span.rows
        # The steps ending before `now_s` (`ends` never decreases), counted at once: the
        # integer counts in one product, the lists extended, `busy_s` summed in the same order.
        j = bisect_left(ends, now_s, i, last)
        if j == i:
            return
        k = j - i
        self.step_no += k
        stats = self.stats
        stats.tokens += rows * k
        stats.tbts.extend(dts[i:j])
        win = self.window
        if win is not None:
            win.tokens.extend((ends[x], rows) for x in range(i, j))
            win.tbts.extend((ends[x], dts[x], rows) for x in range(i, j))
        self.ctx_sum += rows * k
        busy_s = self.busy_s
        for dt in dts[i + 1 : j + 1]:
            busy_s += dt
        self.busy_s = busy_s
        span.done = j

    def _end_span(self) -> None:
        span = self._span
        assert span is not None
        self._advance(math.inf)
        self._span = None
        self._end_step([], span.rows, 0, span.dts[-1], span.epoch)

    def _interrupt(self) -> None:
        """Something outside changes the worker now: count the span's steps ended so far and
        make the one under way an ordinary step (its end runs `_end_step`, then `_start_step`)."""
        span = self._span
        if span is None:
            return
        self._advance(self.loop.now_s)
        span.timer.cancel()
        self._span = None
        self._chunk = _MIN_CHUNK
        i, rows, epoch = span.done, span.rows, span.epoch
        dt = span.dts[i]
        self.loop.at(span.ends[i], lambda: self._end_step([], rows, 0, dt, epoch))

    def _join_decode(self, r: SimRequest) -> None:
        """Decode `r`'s remaining tokens from the next iteration on, its context the prompt plus
        what it has generated."""
        r.ctx0, r.step0 = r.prompt + r.generated, self.step_no
        self.ctx_sum += r.ctx0
        heapq.heappush(self.decoding, (self.step_no + r.remaining, r.index, r))

    def _finish(self, r: SimRequest, now: float) -> None:
        r.end_s = now
        self.kv_used -= r.blocks
        self.on_finish(r)

    # ---- heartbeat -----------------------------------------------------------------------------
    def queue_wait_s(self) -> float:
        """The queued prompts' wait at its prefill capacity, as the real worker checks it
        between heartbeats (`backlog.sample_wait_s`). A span of decode steps leaves it as is."""
        return sample_wait_s(self._waiting_tokens + self._prefill_left, self.prefill_capacity_tps * self._speedup)

    def sample(self, now_s: float, period_s: float, *, serving: bool) -> LoadSample:
        """The LoadReport the real worker sends, from what happened since the last one."""
        if self._span is not None:
            self._advance(now_s)
        self.reported_wait_s = sample_wait_s(
            self._waiting_tokens + self._prefill_left, self.prefill_capacity_tps * self._speedup
        )
        s, self.stats = self.stats, _Stats()
        win = self.window
        if win is not None:
            win.prune(now_s)
            span = max(1e-3, min(win.window_s, now_s))
            decode_tps = sum(n for _, n in win.tokens) / span
            prefill_tps = sum(n for _, n in win.prefill) / span
            ttft_p50, ttft_p99 = _p50_p99([v for _, v in win.ttfts])
            tbts = [(v, w) for _, v, w in win.tbts]
            tbt_p50, tbt_p99 = _wq(tbts, 0.5), _wq(tbts, 0.99)
        else:
            decode_tps, prefill_tps = s.tokens / period_s, s.prefill_tokens / period_s
            ttft_p50, ttft_p99 = _p50_p99(s.ttfts)
            tbt_p50, tbt_p99 = _p50_p99(s.tbts)
        return _load_sample(
            self.iid,
            now_s,
            decode_tps,
            prefill_tps,
            ttft_p50,
            ttft_p99,
            tbt_p50,
            tbt_p99,
            self.running,
            len(self.waiting),
            self._waiting_tokens + self._prefill_left,
            self.kv_used if serving else 0,
            self.kv_total if serving else 0,
            self.prefill_capacity_tps * self._speedup,
        )
