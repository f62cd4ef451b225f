"""The global manager's ESP scheduler (LoongServe, SOSP'24; docs/algorithms.md 6): pure planning,
no I/O and no clock, so the live manager and the simulator run the same decisions.

Each iteration, in the paper's four steps:

1. `dispatch`: which queued requests enter prefill, in arrival order, while the group's free KV
   holds their prompts (strictly in order: a long request is not overtaken forever).
2. `allocate_instances`: the instances the prefill runs on: idle ones first (most free KV first),
   then busy ones with the fewest used slots, whose KV is migrated away (they are named as
   preempted).
3. `plan_batches`: how the dispatched requests are cut into batches and which instances each
   batch runs on, by dynamic programming over requests sorted by length (longest first) and
   instances sorted by used slots (fewest first). A batch of requests with lengths l on u
   instances takes `T_u(sum l, sum l^2) = A_u + B_u sum l + C_u sum l^2` (plus what the compute
   does not hide of the group's K/V exchange, `StepTimeModel`) and costs that time
   times `sum 1/l` (its per-token latency summed over its requests); a batch must fit the free
   KV of its instances. The DP is solved exactly over that structure, not pruned.
4. `decode_degree`: after the prefill a request decodes on the fewest of its holders whose free
   KV covers its remaining tokens; when they run short, more join (scale-up during decode).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Literal

import numpy as np
from numpy.lib.stride_tricks import as_strided

__all__ = [
    "Batch",
    "BatchPlan",
    "EspInstance",
    "EspRequest",
    "GroupPlan",
    "StepTimeModel",
    "allocate_instances",
    "decode_degree",
    "dispatch",
    "plan_batch_slices",
    "plan_batches",
    "plan_group",
    "default_step_models",
]


@dataclass(frozen=True)
class StepTimeModel:
    """`T = a + b * sum l + c * sum l^2`: a prefill batch's time on its degree of instances
    (fitted from profiles; a degree without a model is never planned).

    A group's K/V exchange, `r` seconds per prompt token, runs beside that compute: `hidden` is
    the share of the shorter of the two that the other covers (0: one after the other; 1: the
    batch takes the longer of the two), so `T = a + comp + ex - hidden * min(comp, ex)` with
    `comp = b * sum l + c * sum l^2` and `ex = r * sum l`."""

    a: float
    b: float
    c: float
    r: float = 0.0
    hidden: float = 0.0

    def __post_init__(self) -> None:
        if self.r < 0 or not 0.0 <= self.hidden <= 1.0:
            raise ValueError(f"need r >= 0 and 0 <= hidden <= 1, got r={self.r!r}, hidden={self.hidden!r}")

    def time(self, s1: float, s2: float) -> float:
        t = self.a + self.b * s1 + self.c * s2
        if self.r:
            comp, ex = self.b * s1 + self.c * s2, self.r * s1
            t += ex - self.hidden * min(comp, ex)
        return t


@dataclass(frozen=True)
class EspRequest:
    request_id: str
    length: int  # tokens its KV will hold (prompt, for a prefill)
    arrival_s: float = 0.0


@dataclass(frozen=True)
class EspInstance:
    instance_id: str
    used: int  # KV tokens held
    capacity: int  # KV tokens it can hold
    idle: bool = True  # runs nothing now (a busy one can be preempted, its KV migrated)

    @property
    def free(self) -> int:
        return self.capacity - self.used


@dataclass(frozen=True)
class Batch:
    request_ids: tuple[str, ...]
    instance_ids: tuple[str, ...]
    time: float  # T_u of the batch
    cost: float  # time * sum(1 / l)


@dataclass(frozen=True)
class BatchPlan:
    batches: tuple[Batch, ...]
    cost: float


def dispatch(
    queue: Sequence[EspRequest],
    free_tokens: int,
    max_requests: int | None = None,
    *,
    now_s: float | None = None,
    backfill_wait_s: float | None = None,
    order: Literal["arrival", "shortest"] = "arrival",
) -> list[EspRequest]:
    """The queued requests that enter prefill now: in arrival order while their lengths fit
    `free_tokens` in all (stopping at the first that does not).

    With `backfill_wait_s` (and `now_s`), a request that does not fit is passed over and later,
    shorter ones that do fit enter instead (backfilling), until a passed-over request has waited
    `backfill_wait_s`: from it on nothing enters, so the free KV accumulates for it and no
    request waits for room behind later ones for longer than that. With `order="shortest"` (which
    needs that bound), the requests that have waited `backfill_wait_s` go first, in arrival order
    and stopping at the first that does not fit; then the others, shortest first, each that fits."""
    if free_tokens < 0:
        raise ValueError(f"free_tokens must be >= 0, got {free_tokens!r}")
    if backfill_wait_s is not None and (now_s is None or backfill_wait_s < 0):
        raise ValueError(f"backfill_wait_s needs now_s and must be >= 0, got {backfill_wait_s!r} (now_s {now_s!r})")
    if order not in ("arrival", "shortest"):
        raise ValueError(f"order must be 'arrival' or 'shortest', got {order!r}")
    if order == "shortest" and backfill_wait_s is None:
        raise ValueError("order='shortest' needs backfill_wait_s: it bounds how long a long request is passed over")
    for req in queue:
        if req.length <= 0:
            raise ValueError(f"request {req.request_id!r} has length {req.length!r}; lengths must be > 0")

    def due(req: EspRequest) -> bool:
        """Nothing may pass it: no backfilling, or it has waited the bound."""
        return backfill_wait_s is None or now_s is None or now_s - req.arrival_s >= backfill_wait_s

    ordered = sorted(queue, key=lambda r: r.arrival_s)
    if order == "shortest":
        ordered = [r for r in ordered if due(r)] + sorted((r for r in ordered if not due(r)), key=lambda r: r.length)
    out: list[EspRequest] = []
    left = free_tokens
    for req in ordered:
        if max_requests is not None and len(out) >= max_requests:
            break
        if req.length > left:
            if due(req):
                break
            continue
        out.append(req)
        left -= req.length
    return out


def allocate_instances(
    instances: Sequence[EspInstance], need_tokens: int, *, all_idle: bool = False
) -> tuple[list[EspInstance], list[str]]:
    """Instances for a prefill that needs `need_tokens` free KV tokens: idle ones (most free
    first), then busy ones with the fewest used tokens, whose KV must be migrated away first
    (their ids are returned as preempted). By default only as many idle ones as the need takes;
    with `all_idle`, every idle one (the batching DP then picks the degree, and may leave some
    unused), busy ones still only as the need requires. Raises ValueError when all of them
    cannot hold it."""
    idle = sorted((i for i in instances if i.idle), key=lambda i: (-i.free, i.instance_id))
    busy = sorted((i for i in instances if not i.idle), key=lambda i: (i.used, i.instance_id))
    chosen: list[EspInstance] = []
    preempted: list[str] = []
    have = 0
    for inst in idle:
        if have >= need_tokens and not all_idle:
            break
        chosen.append(inst)
        have += inst.free
    for inst in busy:
        if have >= need_tokens:
            break
        # Preempted: its running requests' KV moves elsewhere, so all its capacity is free.
        chosen.append(EspInstance(inst.instance_id, 0, inst.capacity, idle=True))
        preempted.append(inst.instance_id)
        have += inst.capacity
    if have < need_tokens:
        total = sum(i.capacity for i in instances)
        raise ValueError(f"{need_tokens} KV tokens needed, the {len(instances)} instances hold {total} in all")
    return chosen, preempted


def _lagged(h: np.ndarray, width: int) -> np.ndarray:
    """A read-only [..., i, b] view of h[..., width + i - 1 - b] for b < width, no copy: the
    values x = h[..., width:] lagged by b + 1, reading h's first `width` cells (a fill) where
    i - 1 - b < 0."""
    step = h.strides[-1]
    shape = (*h.shape[:-1], h.shape[-1] - width, width)
    return as_strided(h[..., width - 1 :], shape=shape, strides=(*h.strides[:-1], step, -step), writeable=False)


def _padded(x: np.ndarray, width: int, fill: float) -> np.ndarray:
    return np.concatenate((np.full(width, fill), x))


def plan_batches(
    requests: Sequence[EspRequest], instances: Sequence[EspInstance], models: Mapping[int, StepTimeModel]
) -> BatchPlan | None:
    """The exact minimum of `sum over batches of T_u * sum(1/l)` (see the module docstring), or
    None when no cut fits the instances' free KV. Requests are taken longest first and instances
    fewest-used first; a batch is a run of consecutive requests on a run of consecutive
    instances; an instance serves at most one batch; instances may stay unused."""
    if not requests:
        return BatchPlan((), 0.0)
    bad = [r for r in requests if r.length <= 0]
    if bad:
        raise ValueError(f"request {bad[0].request_id!r} has length {bad[0].length!r}; lengths must be > 0")
    degrees = sorted(u for u in models if u >= 1)
    if not degrees:
        raise ValueError(f"no step-time model for any degree >= 1: {sorted(models)!r}")
    reqs = sorted(requests, key=lambda r: (-r.length, r.request_id))
    insts = sorted(instances, key=lambda i: (i.used, i.instance_id))
    n, k_max = len(reqs), len(insts)
    lengths = np.array([r.length for r in reqs], dtype=np.float64)
    s1 = np.concatenate(([0.0], np.cumsum(lengths)))
    s2 = np.concatenate(([0.0], np.cumsum(lengths**2)))
    inv = np.concatenate(([0.0], np.cumsum(1.0 / lengths)))
    free = np.concatenate(([0.0], np.cumsum([max(i.free, 0) for i in insts])))
    # Per degree, the most requests one batch can hold: the longest run that fits the largest
    # room any u consecutive instances offer (requests are sorted, so that bounds every batch).
    ends = np.arange(n + 1)
    widths: dict[int, int] = {}
    for u in degrees:
        room_u = float((free[u:] - free[:-u]).max()) if u <= k_max else 0.0
        widths[u] = max(int((ends - np.searchsorted(s1, s1 - room_u, side="left")).max()), 1)
    width = max(widths.values())
    # Batches in a band [i, b]: requests (i - 1 - b, i], the j = i - 1 - b before them left out.
    # Each matrix is built once from lagged views (no gather); a band cell past the first
    # request has an infinite span, so it fits no room and every read below masks it out.
    span = s1[:, None] - _lagged(_padded(s1, width, -np.inf), width)
    sums = s1[:, None] - _lagged(_padded(s1, width, 0.0), width)
    sq = s2[:, None] - _lagged(_padded(s2, width, 0.0), width)
    weight = inv[:, None] - _lagged(_padded(inv, width, 0.0), width)
    costs: dict[int, np.ndarray] = {}
    for u in degrees:  # (a + b * sums + c * sq) * weight, in place: the same floats, fewer temporaries
        w, m = widths[u], models[u]
        cost = np.multiply(sums[:, :w], m.b)
        cost += m.a
        cost += np.multiply(sq[:, :w], m.c)
        if m.r:  # the exchange, less what the compute hides of it (StepTimeModel.time)
            comp = np.multiply(sums[:, :w], m.b) + np.multiply(sq[:, :w], m.c)
            ex = np.multiply(sums[:, :w], m.r)
            cost += ex - m.hidden * np.minimum(comp, ex)
        cost *= weight[:, :w]
        costs[u] = cost
    # reach[k]: the most requests the first k instances can hold (sum of lengths <= their total
    # free KV). f[k, i] is infinite for every i past it, whatever the cut, so no state past it is
    # computed, nor any batch starting past reach[k - u]: a provably safe bound, not a heuristic.
    reach = np.searchsorted(s1, free, side="right") - 1
    # f[k, i]: the least cost of the first i requests on the first k instances; `before` is a
    # view of it, before[k, i, b] = f[k, i - 1 - b] (infinite before the first request).
    pad = np.full((k_max + 1, width + n + 1), np.inf)
    pad[:, width] = 0.0
    f = pad[:, width:]
    before = _lagged(pad, width)
    for k in range(1, k_max + 1):
        best = f[k - 1].copy()  # instance k left unused
        for u in degrees:
            if u > k:
                break
            room = free[k] - free[k - u]
            w = widths[u]
            # Batch ends i: up to reach[k], and no further than w past the last start f reaches.
            top = min(int(reach[k]), int(reach[k - u]) + w) + 1
            if top <= 1:
                continue
            # This room's widest batch ends last (the shortest requests): no column past it fits.
            w = min(w, top - 1 - int(np.searchsorted(s1, s1[top - 1] - room, side="left")))
            if w < 1:
                continue
            total = costs[u][1:top, :w] + before[k - u, 1:top, :w]
            total = np.where(span[1:top, :w] <= room, total, np.inf).min(axis=1)
            np.minimum(best[1:top], total, out=best[1:top])
        f[k] = best
    if not math.isfinite(f[k_max, n]):
        return None
    # The optimal cut, re-derived from the values: at each state, the term that gave its value.
    batches: list[Batch] = []
    i, k = n, k_max
    while i > 0:
        if f[k, i] == f[k - 1, i]:
            k -= 1  # the optimum leaves instance k unused
            continue
        for u in degrees:
            if u > k:
                continue
            w = widths[u]
            total = np.where(span[i, :w] <= free[k] - free[k - u], costs[u][i] + before[k - u, i, :w], np.inf)
            b = int(total.argmin())
            if total[b] == f[k, i]:
                break
        else:  # pragma: no cover - the values above were computed from these very terms
            raise AssertionError(f"no batch ends the optimum at request {i}, instance {k}")
        j = i - 1 - b
        t = float(models[u].time(s1[i] - s1[j], s2[i] - s2[j]))
        batches.append(
            Batch(
                request_ids=tuple(r.request_id for r in reqs[j:i]),
                instance_ids=tuple(x.instance_id for x in insts[k - u : k]),
                time=t,
                cost=float(costs[u][i, b]),
            )
        )
        i, k = j, k - u
    return BatchPlan(tuple(reversed(batches)), float(f[k_max, n]))


def decode_degree(need_tokens: int, holders: Sequence[EspInstance]) -> list[EspInstance]:
    """The fewest of `holders` (most free KV first) whose free KV covers `need_tokens` more
    tokens of a decoding request. Raises ValueError when all of them together cannot."""
    if need_tokens < 0:
        raise ValueError(f"need_tokens must be >= 0, got {need_tokens!r}")
    chosen: list[EspInstance] = []
    have = 0
    for inst in sorted(holders, key=lambda i: (-i.free, i.instance_id)):
        if have >= need_tokens and chosen:
            break
        chosen.append(inst)
        have += inst.free
    if have < need_tokens:
        raise ValueError(f"{need_tokens} more KV tokens needed, the holders have {have} free")
    return chosen


def default_step_models(
    max_degree: int, *, a: float = 2e-3, b: float = 2e-5, c: float = 2e-9
) -> dict[int, StepTimeModel]:
    """Step-time models for degrees 1..max_degree when no profile is fitted: the compute
    (`b` per token, `c` per token pair of attention) splits over the u members, while the fixed
    cost `a` grows with u (one more exchange per layer each)."""
    if max_degree < 1:
        raise ValueError(f"max_degree must be >= 1, got {max_degree!r}")
    return {u: StepTimeModel(a * u, b / u, c / u) for u in range(1, max_degree + 1)}


@dataclass(frozen=True)
class GroupPlan:
    """One request's ESP group: `members` in slice order (the last is the master, which also
    takes the decoded tokens' KV), `bounds` cutting the prompt among them, `spares` to scale up
    to when the master fills (most free KV first)."""

    members: tuple[str, ...]
    bounds: tuple[int, ...]
    spares: tuple[str, ...]
    preempted: tuple[str, ...] = ()


def _cut(length: int, room: Sequence[int], block_size: int) -> list[int] | None:
    """Tokens of a `length`-token prompt per member: in proportion to `room`, in whole blocks,
    the remainder where room is left (earliest members first); None when it does not fit."""
    total = sum(room)
    if total < length:
        return None
    shares = [min(r, length * r // total // block_size * block_size) for r in room]
    left = length - sum(shares)
    for j, r in enumerate(room):
        add = min(left, r - shares[j])
        shares[j] += add
        left -= add
    return shares


def _slices(
    length: int, decode_tokens: int, members: Sequence[EspInstance], block_size: int
) -> tuple[list[str], list[int] | None]:
    """`members` in slice order and the prompt tokens each computes and keeps: the master (last)
    is the member with the most free KV and keeps room for the `decode_tokens` too; the cut is
    `_cut`'s (None when it does not fit)."""
    ordered = sorted(members, key=lambda i: (i.free, i.instance_id))
    free = [i.free // block_size * block_size for i in ordered]
    free[-1] = max(free[-1] - decode_tokens, 0)
    return [i.instance_id for i in ordered], _cut(length, free, block_size)


def plan_batch_slices(
    requests: Sequence[tuple[EspRequest, int]], members: Sequence[EspInstance], *, block_size: int = 1
) -> dict[str, GroupPlan] | None:
    """Several requests prefilled in one iteration of one group (a `Batch` of `plan_batches`):
    `requests` as (request, tokens it will decode), `members` the batch's instances. Longest
    first, each request's prompt goes to the fewest members whose free KV holds it and its
    decoded tokens (`decode_degree`: the KV stays where the request will decode from, the
    paper's proactive scale-down), cut in proportion to their free KV in whole blocks, the
    master (most free) keeping the decoded tokens' room; each later request sees what the
    earlier ones left. Different requests may have different masters (multi-master decode);
    a request's spares are the batch's other members (most free KV left first). The master
    keeps its place, last, even with an empty slice when its room all goes to the decoded
    tokens. None when they do not all fit."""
    if block_size < 1:
        raise ValueError(f"block_size must be >= 1, got {block_size!r}")
    bad = [(r.request_id, d) for r, d in requests if r.length <= 0 or d < 0]
    if bad:
        raise ValueError(f"request {bad[0][0]!r}: length must be > 0 and decode tokens >= 0")
    cap = {m.instance_id: m.capacity for m in members}
    left = {m.instance_id: m.free for m in members}
    out: dict[str, GroupPlan] = {}
    for req, decode in sorted(requests, key=lambda x: (-x[0].length, x[0].request_id)):
        view = [EspInstance(m, cap[m] - left[m], cap[m]) for m in cap]
        try:
            holders = decode_degree(req.length + decode, view)
        except ValueError:
            return None
        ids, shares = _slices(req.length, decode, holders, block_size)
        if shares is None:  # whole blocks did not fit the fewest: all the members, then none
            ids, shares = _slices(req.length, decode, [v for v in view if v.free > 0], block_size)
            if shares is None:
                return None
        kept = [(m, n) for m, n in zip(ids, shares, strict=True) if n > 0 or m == ids[-1]]
        bounds = [0]
        for m, n in kept:
            bounds.append(bounds[-1] + n)
            # Each slice is a sequence of its own on its member: it takes whole blocks.
            n += decode if m == ids[-1] else 0
            left[m] -= -(-n // block_size) * block_size
        chosen = [m for m, _ in kept]
        spares = tuple(m for m in sorted(cap, key=lambda m: (-left[m], m)) if m not in chosen)
        out[req.request_id] = GroupPlan(tuple(chosen), tuple(bounds), spares)
    return out


def plan_group(
    request: EspRequest,
    decode_tokens: int,
    instances: Sequence[EspInstance],
    models: Mapping[int, StepTimeModel] | None = None,
    *,
    block_size: int = 1,
) -> GroupPlan | None:
    """The group that prefills `request` (its prompt of `request.length` tokens) and decodes its
    `decode_tokens` more: the four steps for one request. `allocate_instances` picks who may run
    it (idle first, then the least used busy ones, preempted), `plan_batches` the degree and
    members among them, and the prompt is cut in proportion to each member's free KV (whole
    blocks of `block_size` tokens), the master keeping room for the decoded tokens; the other
    allocated instances are the spares. None when the instances cannot hold the request now."""
    if decode_tokens < 0 or block_size < 1:
        raise ValueError(f"decode_tokens must be >= 0 and block_size >= 1, got {decode_tokens!r}, {block_size!r}")
    usable = [
        EspInstance(i.instance_id, i.used, i.capacity - i.capacity % block_size, i.idle)
        for i in instances
        if i.capacity - i.used >= block_size
    ]
    try:
        pool, preempted = allocate_instances(usable, request.length + decode_tokens)
    except ValueError:
        return None
    models = models or default_step_models(len(pool))
    plan = plan_batches([request], pool, {u: m for u, m in models.items() if u <= len(pool)})
    if plan is None or not plan.batches:
        return None
    chosen = list(plan.batches[0].instance_ids)
    by_id = {i.instance_id: i for i in usable} | {i.instance_id: i for i in pool}  # preempted: emptied
    others = [
        i.instance_id
        for i in sorted(usable, key=lambda i: (-i.free, i.instance_id))
        if i.instance_id not in chosen and (i.idle or i.instance_id in preempted)
    ]

    def cut(members: list[str], keep_decode: bool) -> tuple[list[str], list[int] | None]:
        return _slices(request.length, decode_tokens if keep_decode else 0, [by_id[m] for m in members], block_size)

    chosen, shares = cut(chosen, True)
    # When the DP's members cannot also keep the decoded tokens' room, the next instance joins
    # the prefill; only when none is left does the master rely on scaling up while it decodes.
    while shares is None and others:
        chosen, shares = cut([*chosen, others.pop(0)], True)
    if shares is None:
        chosen, shares = cut(chosen, False)
        if shares is None:
            return None
    spares = tuple(others)
    members = [iid for iid, n in zip(chosen, shares, strict=True) if n > 0]
    spares = tuple(iid for iid in chosen if iid not in members) + spares
    bounds = [0]
    for n in shares:
        if n > 0:
            bounds.append(bounds[-1] + n)
    chosen = members
    return GroupPlan(tuple(chosen), tuple(bounds), spares, tuple(p for p in preempted if p in chosen))
