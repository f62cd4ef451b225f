"""Four ways of serving a long-context workload on 4 instances, in simulated time with an
emulated accelerator (no model runs: 2 CPU cores cannot show parallel speed-up). Every figure
here is EMULATED: it follows from the step-time model below and the scheduling rules, not from
measuring hardware.

Step-time model of one instance's iteration (`Pace`): `a + b * tokens + c * pairs`, where
`tokens` are the tokens the iteration computes and `pairs` the (query, key) pairs its attention
visits. A prefill split over u instances (static SP or ESP) takes each member its share of the
tokens and pairs, plus one `a` per extra member for the ring exchange.

- chunked: independent instances, each request on the least-loaded one that can hold its KV;
  an iteration decodes every running request and prefills a chunk of `chunk` prompt tokens.
  A request no single instance can hold is refused.
- static_sp: the 4 instances as one group of degree 4 (4x KV, each iteration split over 4 with
  the exchange cost), chunked prefill inside it.
- disagg: 1 prefill instance (whole prompts, one at a time) and 3 decode instances; a request
  no decode instance can hold is refused.
- esp: elastic. A prompt goes to a group planned by `core.esp.plan_group` over the instances'
  free KV (degree 1 for short ones: the DP's choice), which prefills it together; the KV stays
  where it was computed and the master decodes, attending over its holders in parallel.
"""

from __future__ import annotations

import math
import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from services.global_manager.core.esp import EspInstance, EspRequest, StepTimeModel, plan_group


@dataclass(frozen=True)
class Pace:
    a: float = 0.010  # s per iteration
    b: float = 0.00015  # s per computed token
    c: float = 4e-8  # s per attended (query, key) pair

    def step(self, tokens: int, pairs: float, degree: int = 1) -> float:
        return self.a * degree + (self.b * tokens + self.c * pairs) / degree

    def models(self, max_degree: int) -> dict[int, StepTimeModel]:
        # A prompt of l tokens: b*l + c*l^2/2 pair-visits, split over u members.
        return {u: StepTimeModel(self.a * u, self.b / u, self.c / 2 / u) for u in range(1, max_degree + 1)}


@dataclass
class Req:
    rid: int
    arrival: float
    prompt: int
    output: int
    first: float | None = None
    done: float | None = None
    generated: int = 0
    prefilled: int = 0
    refused: bool = False
    kv_here: int = 0  # KV tokens on the instance that decodes it
    holds: list[tuple[Inst, int]] = field(default_factory=list)  # ESP: other holders' slices

    def tbt(self) -> float:
        if self.first is None or self.done is None or self.output <= 1:
            return 0.0
        return (self.done - self.first) / (self.output - 1)


@dataclass
class Slo:
    ttft_base_s: float = 1.0
    ttft_per_token_s: float = 0.0005
    tbt_s: float = 0.1

    def met(self, r: Req) -> bool:
        if r.refused or r.first is None or r.done is None:
            return False
        return r.first - r.arrival <= self.ttft_base_s + self.ttft_per_token_s * r.prompt and r.tbt() <= self.tbt_s


def compute_bound_rps(reqs: Sequence[Req], pace: Pace, n: int) -> float:
    """The rate at which `n` instances would compute `reqs`' own work without a pause on `pace`:
    each request's prompt and decoded tokens (`b` each) and the pairs its prefill and decode
    steps attend (`c` each), leaving out each iteration's `a`. No strategy sustains more."""
    if not reqs or n < 1:
        raise ValueError(f"need requests and n >= 1, got {len(reqs)} requests, n={n!r}")
    work = sum(
        pace.b * (r.prompt + r.output - 1) + pace.c * (r.prompt**2 / 2 + (r.output - 1) * (r.prompt + r.output / 2))
        for r in reqs
    )
    return n * len(reqs) / work


def workload(rows: Sequence[tuple[int, int]], n: int, rate: float, seed: int, max_context: int = 8192) -> list[Req]:
    """`n` Poisson arrivals at `rate`/s; lengths from `rows` (prompt, output) of the conversation
    trace, each prompt scaled by a Zipf-distributed factor (1..32, exponent 1.2) up to the
    context: the trace's own length the likeliest, then a heavy tail of long prompts (LoongServe's
    Zipf mixes)."""
    rng = random.Random(seed)
    factors = list(range(1, 33))
    weights = [k**-1.2 for k in factors]
    t, out = 0.0, []
    for i in range(n):
        t += rng.expovariate(rate)
        p, o = rows[rng.randrange(len(rows))]
        o = max(1, min(o, 256))
        p = max(1, min(p * rng.choices(factors, weights)[0], max_context - o))
        out.append(Req(i, t, p, o))
    return out


@dataclass
class Inst:
    """One instance (or one static group) and what runs on it."""

    kv: int
    degree: int = 1
    used: int = 0
    free_at: float = 0.0
    waiting: list[Req] = field(default_factory=list)
    running: list[Req] = field(default_factory=list)

    def load(self) -> int:
        return len(self.waiting) + len(self.running)


def _finish_token(r: Req, now: float) -> bool:
    r.generated += 1
    if r.first is None:
        r.first = now
    if r.generated >= r.output:
        r.done = now
        return True
    return False


def _release(inst: Inst, r: Req) -> None:
    inst.used -= r.kv_here
    for holder, n in r.holds:
        holder.used -= n


def _iterate(inst: Inst, now: float, pace: Pace, chunk: int) -> float:
    """One chunked-prefill iteration on `inst`: decode every running request, prefill up to
    `chunk` tokens of the waiting ones (in order, while their KV fits). Returns its time. An ESP
    request's holders attend their slices in parallel with the master: the step is charged the
    larger of the master's part and the largest holder's."""
    tokens, pairs = 0, 0.0
    decoding = [r for r in inst.running if r.prefilled >= r.prompt]
    for r in decoding:
        tokens += 1
        ctx = r.prompt + r.generated
        remote = sum(n for _, n in r.holds)
        pairs += max(ctx - remote, max((n for _, n in r.holds), default=0))
    budget = chunk
    admitted: list[Req] = []
    for r in list(inst.waiting):
        need = r.prompt + r.output
        if r.prefilled == 0 and not r.kv_here:
            if inst.used + need > inst.kv:
                break
            inst.used += need
            r.kv_here = need
        take = min(budget, r.prompt - r.prefilled)
        pairs += take * (r.prefilled + take / 2)
        tokens += take
        r.prefilled += take
        budget -= take
        if r.prefilled >= r.prompt:
            admitted.append(r)
            inst.waiting.remove(r)
        if budget <= 0:
            break
    dt = pace.step(tokens, pairs, inst.degree) if tokens else 0.0
    end = now + dt
    for r in decoding:
        if _finish_token(r, end):
            inst.running.remove(r)
            _release(inst, r)
    for r in admitted:
        inst.running.append(r)
        if _finish_token(r, end):  # the prefill's last iteration samples the first token
            inst.running.remove(r)
            _release(inst, r)
    return dt


def _run(
    insts: list[Inst],
    reqs: list[Req],
    route: Callable[[Req, float], None],
    pace: Pace,
    chunk: int,
    horizon: float,
    tick: Callable[[float], None] | None = None,
) -> None:
    """Event loop: arrivals are routed (`route(req, now)`), each instance iterates when free;
    `tick(now)` after each round of iterations (a strategy's retry of what did not fit)."""
    arrivals = sorted(reqs, key=lambda r: r.arrival)
    k, now = 0, 0.0
    while now < horizon:
        busy = [i.free_at for i in insts if i.waiting or i.running]
        nxt_arrival = arrivals[k].arrival if k < len(arrivals) else math.inf
        nxt_free = min(busy, default=math.inf)
        if nxt_free == math.inf and tick is not None and k >= len(arrivals):
            tick(now)  # pending work may start once KV is free
            busy = [i.free_at for i in insts if i.waiting or i.running]
            nxt_free = min(busy, default=math.inf)
        now = min(nxt_arrival, max(nxt_free, now))
        if now == math.inf:
            break
        if now == nxt_arrival:
            route(arrivals[k], now)
            k += 1
            continue
        for inst in insts:
            if (inst.waiting or inst.running) and inst.free_at <= now:
                dt = _iterate(inst, now, pace, chunk)
                inst.free_at = now + max(dt, 1e-6)
        if tick is not None:
            tick(now)


def simulate(strategy: str, reqs: list[Req], *, kv: int, pace: Pace, chunk: int = 512, n: int = 4) -> list[Req]:
    horizon = max(r.arrival for r in reqs) * 20 + 600
    if strategy == "static_sp":
        group = Inst(kv * n, degree=n)

        def route(r: Req, now: float) -> None:
            if r.prompt + r.output > group.kv:
                r.refused = True
                return
            group.waiting.append(r)
            group.free_at = max(group.free_at, now)

        _run([group], reqs, route, pace, chunk * n, horizon)
        return reqs
    if strategy == "chunked":
        insts = [Inst(kv) for _ in range(n)]

        def route(r: Req, now: float) -> None:
            fits = [i for i in insts if r.prompt + r.output <= i.kv]
            if not fits:
                r.refused = True
                return
            inst = min(fits, key=lambda i: (i.used + sum(x.prompt + x.output for x in i.waiting), i.load()))
            inst.waiting.append(r)
            inst.free_at = max(inst.free_at, now)

        _run(insts, reqs, route, pace, chunk, horizon)
        return reqs
    if strategy == "disagg":
        return _disagg(reqs, kv=kv, pace=pace, n=n, horizon=horizon)
    if strategy == "esp":
        return _esp(reqs, kv=kv, pace=pace, chunk=chunk, n=n, horizon=horizon)
    raise ValueError(f"unknown strategy {strategy!r}; known: chunked, static_sp, disagg, esp")


def _disagg(reqs: list[Req], *, kv: int, pace: Pace, n: int, horizon: float) -> list[Req]:
    """1 prefill instance computing whole prompts in arrival order (first token there); the KV
    moves to the decode instance with the most free KV (transfer time not charged), which
    decodes in batches. The decode side's event loop sees each request at its hand-off."""
    decoders = [Inst(kv) for _ in range(n - 1)]
    prefill_free = 0.0
    handed: list[Req] = []
    arrival = {r.rid: r.arrival for r in reqs}
    for r in sorted(reqs, key=lambda r: r.arrival):
        if r.prompt + r.output > kv:
            r.refused = True
            continue
        start = max(prefill_free, r.arrival)
        prefill_free = start + pace.step(r.prompt, r.prompt * r.prompt / 2)
        r.prefilled = r.prompt
        r.arrival = prefill_free  # the decode side's arrival: the hand-off
        handed.append(r)

    def route(r: Req, now: float) -> None:
        if _finish_token(r, now):  # the prefill instance sampled the first token
            return
        inst = max(decoders, key=lambda i: (i.kv - i.used, -i.load()))
        inst.running.append(r)
        r.kv_here = r.prompt + r.output
        inst.used += r.kv_here
        inst.free_at = max(inst.free_at, now)

    _run(decoders, handed, route, pace, 1, horizon)
    for r in reqs:
        r.arrival = arrival[r.rid]
    return reqs


def _esp(reqs: list[Req], *, kv: int, pace: Pace, chunk: int, n: int, horizon: float) -> list[Req]:
    """Elastic groups: `plan_group` picks each prompt's degree and members from the instances'
    free KV (what they hold and have queued); a group of several prefills the prompt together,
    each member blocked for the group's step, the KV staying where it was computed and the
    master decoding it with the rest of its batch. A prompt no group holds now waits its turn."""
    insts = [Inst(kv) for _ in range(n)]
    models = pace.models(n)
    pending: list[Req] = []

    def place(r: Req, now: float) -> bool:
        pool = [
            EspInstance(str(j), i.used + sum(x.prompt + x.output for x in i.waiting if not x.kv_here), kv)
            for j, i in enumerate(insts)
        ]
        plan = plan_group(EspRequest(str(r.rid), r.prompt), r.output, pool, models, block_size=16)
        if plan is None:
            return False
        members = [insts[int(m)] for m in plan.members]
        if len(members) == 1:
            members[0].waiting.append(r)
            members[0].free_at = max(members[0].free_at, now)
            return True
        start = max(now, *(m.free_at for m in members))
        end = start + pace.step(r.prompt, r.prompt * r.prompt / 2, len(members))
        slices = [b - a for a, b in zip(plan.bounds, plan.bounds[1:], strict=False)]
        for m, size in zip(members, slices, strict=True):
            m.free_at = end  # every member runs its slice in the group's prefill step
            m.used += size
        master = members[-1]
        master.used += r.output
        r.kv_here = slices[-1] + r.output
        r.holds = list(zip(members[:-1], slices[:-1], strict=True))
        r.prefilled = r.prompt
        if not _finish_token(r, end):
            master.running.append(r)
        else:
            _release(master, r)
        return True

    def route(r: Req, now: float) -> None:
        if r.prompt + r.output > kv * n:
            r.refused = True
        elif pending or not place(r, now):
            pending.append(r)

    def tick(now: float) -> None:
        while pending and place(pending[0], now):
            pending.pop(0)

    _run(insts, reqs, route, pace, chunk, horizon, tick)
    return reqs


def summarize(reqs: list[Req], slo: Slo) -> dict[str, float]:
    done = [r for r in reqs if r.done is not None]
    ttft = sorted(r.first - r.arrival for r in done if r.first is not None)
    tbt = sorted(r.tbt() for r in done)

    def pct(xs: list[float], q: float) -> float:
        return round(xs[min(len(xs) - 1, int(q * len(xs)))], 4) if xs else math.nan

    return {
        "requests": len(reqs),
        "completed": len(done),
        "refused": sum(r.refused for r in reqs),
        "slo_attainment": round(sum(slo.met(r) for r in reqs) / len(reqs), 4),
        "ttft_p50_s": pct(ttft, 0.5),
        "ttft_p99_s": pct(ttft, 0.99),
        "tbt_p50_s": pct(tbt, 0.5),
        "tbt_p99_s": pct(tbt, 0.99),
        "longest_prompt_served": max((r.prompt for r in done), default=0),
    }
