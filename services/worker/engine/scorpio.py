"""SCORPIO SLO-aware batching and admission (docs/algorithms.md 4), the pure part: TRP and VBS,
credit-based selection of decode rows, the online TPOT model, an output-length predictor and the
TPOT admission and TTFT checks.

No torch, no clock, no I/O: the engine feeds measurements in and asks questions with its own
`now_s`. Requests without a TPOT objective count as TRP 1 (they run every iteration, as under
FCFS); requests without a TTFT objective have an infinite deadline (queued after those with one,
in arrival order).
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

# Float slack: three credits of 1/3 must reach 1, and an estimate equal to the SLO up to the
# rounding of a least-squares fit must admit.
_EPS = 1e-9


# ---- TRP, VBS and credits ----------------------------------------------------------------------


def trp(stps: Mapping[str, float | None]) -> dict[str, float]:
    """TRP(r) = min STP / STP(r) over the set, per request id; no TPOT objective (None): TRP 1."""
    finite = [s for s in stps.values() if s is not None]
    low = min(finite) if finite else 1.0
    return {r: 1.0 if s is None else low / s for r, s in stps.items()}


def vbs(stps: Iterable[float | None]) -> float:
    """Virtual batch size: the sum of the set's TRPs (requests per iteration on average)."""
    values = list(stps)
    finite = [s for s in values if s is not None]
    low = min(finite) if finite else 1.0
    return sum(1.0 if s is None else low / s for s in values)


class CreditBatcher:
    """Which decode rows run each iteration.

    Every iteration each decoding request adds its TRP to its credit (a new request starts at 0),
    then those with credit >= 1 run and pay 1. So a request at the minimum STP runs every
    iteration and one with TRP 1/k every k-th, starting at its k-th (docs/algorithms.md 4: STP {50,
    100, 200} batch [0], [0, 1], [0], [0, 1, 2], ...). The tightest decoding request always runs,
    so a step with any decode row has work."""

    def __init__(self) -> None:
        self._credits: dict[str, float] = {}

    def step(self, stps: Mapping[str, float | None]) -> list[str]:
        """One iteration over the decoding requests `stps` (id -> TPOT SLO, None for none);
        returns the ids that run, in the mapping's order. Ids absent from `stps` are forgotten:
        a request that comes back starts again at credit 0."""
        rates = trp(stps)
        credits = {r: self._credits.get(r, 0.0) + rates[r] for r in stps}
        chosen = [r for r, c in credits.items() if c >= 1.0 - _EPS]
        for r in chosen:
            credits[r] = max(0.0, credits[r] - 1.0)
        self._credits = credits
        return chosen

    def credit(self, request_id: str) -> float:
        return self._credits.get(request_id, 0.0)


# ---- the TPOT model ----------------------------------------------------------------------------

# Terms of `a*B*L + b*B + c*L + d`, tried in this order: the full model, then ones with fewer
# terms while the observations cannot pin the full one down (too few, or collinear: a single
# request decoding alone has B = 1 throughout, so B*L and L coincide). The last, step time
# proportional to B, fits from a single observation; learned at small batches, it overestimates
# larger ones (their fixed cost is counted per request), the safe side for admission.
_TERM_SETS: tuple[tuple[str, ...], ...] = (("BL", "B", "L", "1"), ("B", "L", "1"), ("B", "1"), ("B",))
# Smallest singular value of the column-normalized design, relative to the largest, for a fit.
_RANK_TOL = 1e-6


@dataclass(frozen=True)
class TPOTFit:
    """`step_s = a*B*L + b*B + c*L + d`: B requests (or tokens) in an iteration of mean context
    length L. Terms not in `terms` are 0. `r2` and `mae_s` are over the `points` it was fitted on."""

    a: float = 0.0
    b: float = 0.0
    c: float = 0.0
    d: float = 0.0
    terms: tuple[str, ...] = ("BL", "B", "L", "1")
    points: int = 0
    r2: float | None = None
    mae_s: float | None = None

    def estimate(self, batch: float, mean_len: float) -> float:
        """Step time (= TPOT of the tightest request, which runs every iteration) at batch `batch`."""
        return max(0.0, self.a * batch * mean_len + self.b * batch + self.c * mean_len + self.d)

    def report(self) -> dict[str, Any]:
        return {
            "a": self.a,
            "b": self.b,
            "c": self.c,
            "d": self.d,
            "terms": list(self.terms),
            "points": self.points,
            "r2": self.r2,
            "mae_s": self.mae_s,
        }


def _columns(terms: Sequence[str], batch: np.ndarray, length: np.ndarray) -> np.ndarray:
    cols = {"BL": batch * length, "B": batch, "L": length, "1": np.ones_like(batch)}
    return np.stack([cols[t] for t in terms], axis=1)


class TPOTFitter:
    """Least squares over a bounded window of recent (B, L, step time) observations, refitted when
    asked after new ones arrived. Before `min_points` observations, and while the window cannot
    determine the full model, it fits fewer terms (see `_TERM_SETS`); with none it has no fit."""

    def __init__(self, window: int = 512, min_points: int = 8) -> None:
        if window < 1 or min_points < 1:
            raise ValueError(f"TPOTFitter needs window >= 1 and min_points >= 1, got {window}, {min_points}")
        self._obs: deque[tuple[float, float, float]] = deque(maxlen=window)
        self._min_points = min_points
        self._fit: TPOTFit | None = None
        self._dirty = False

    def observe(self, batch: float, mean_len: float, step_s: float) -> None:
        if batch <= 0 or not all(math.isfinite(v) for v in (batch, mean_len, step_s)) or step_s < 0:
            return
        self._obs.append((float(batch), float(mean_len), float(step_s)))
        self._dirty = True

    @property
    def points(self) -> int:
        return len(self._obs)

    def fit(self) -> TPOTFit | None:
        if self._dirty:
            self._fit = self._solve()
            self._dirty = False
        return self._fit

    def _solve(self) -> TPOTFit | None:
        n = len(self._obs)
        if n == 0:
            return None
        data = np.asarray(self._obs, dtype=np.float64)
        batch, length, y = data[:, 0], data[:, 1], data[:, 2]
        for terms in _TERM_SETS:
            # The full model needs min_points; smaller ones one spare point beyond their terms
            # (the last one, a single ratio, fits from one).
            needed = self._min_points if len(terms) == 4 else len(terms) + (1 if len(terms) > 1 else 0)
            if n < needed:
                continue
            x = _columns(terms, batch, length)
            norms = np.linalg.norm(x, axis=0)
            if np.any(norms == 0):
                continue
            xn = x / norms
            sv = np.linalg.svd(xn, compute_uv=False)
            if sv[-1] < _RANK_TOL * sv[0]:
                continue
            coef_n, *_ = np.linalg.lstsq(xn, y, rcond=None)
            coef = dict(zip(terms, (coef_n / norms).tolist(), strict=True))
            pred = x @ (coef_n / norms)
            resid = y - pred
            ss_tot = float(np.sum((y - y.mean()) ** 2))
            r2 = 1.0 - float(np.sum(resid**2)) / ss_tot if ss_tot > 0 else None
            return TPOTFit(
                a=coef.get("BL", 0.0),
                b=coef.get("B", 0.0),
                c=coef.get("L", 0.0),
                d=coef.get("1", 0.0),
                terms=terms,
                points=n,
                r2=r2,
                mae_s=float(np.mean(np.abs(resid))),
            )
        return None


class PrefillRate:
    """Prompt tokens per second, from the recent steps that computed prompt tokens: the slope of
    step time over prompt tokens (`step_s = fixed + tokens / rate`; the fixed part, decodes
    batched with them included, is the step time the TTFT guard adds on its own). While the
    tokens per step have not varied enough for a slope, the plain ratio of tokens to time (lower:
    it counts the fixed part per token)."""

    def __init__(self, window: int = 64) -> None:
        self._obs: deque[tuple[int, float]] = deque(maxlen=window)
        self._rate: float | None = None
        self._dirty = False

    def observe(self, prefill_tokens: int, step_s: float) -> None:
        if prefill_tokens > 0 and step_s > 0 and math.isfinite(step_s):
            self._obs.append((prefill_tokens, step_s))
            self._dirty = True

    @property
    def tokens_per_s(self) -> float | None:
        if self._dirty:
            self._rate = self._solve()
            self._dirty = False
        return self._rate

    def _solve(self) -> float | None:
        if not self._obs:
            return None
        data = np.asarray(self._obs, dtype=np.float64)
        tokens, seconds = data[:, 0], data[:, 1]
        ratio = float(tokens.sum() / seconds.sum())
        if len(data) < 3 or tokens.std() < 0.1 * tokens.mean():
            return ratio
        slope = float(np.polyfit(tokens, seconds, 1)[0])
        # A slope at or below zero (noise over a narrow range of sizes) says nothing: the ratio.
        return 1.0 / slope if slope > 0 and 1.0 / slope > ratio else ratio


class BacklogRate:
    """Prompt tokens per second of step time actually served while requests were queued: what a
    queued request's wait is measured against. Lower than `PrefillRate` when a backlog is held
    back by more than prefill compute (batch slots, KV blocks, decodes sharing the steps, the
    token budget), which is when the TTFT guard matters. None before `min_steps` backlogged steps;
    floored at `floor_share` of the marginal rate so that a stretch of steps that served no prompt
    (a full batch) does not read as "never"."""

    def __init__(self, window: int = 64, min_steps: int = 8, floor_share: float = 0.05) -> None:
        self._obs: deque[tuple[int, float]] = deque(maxlen=window)
        self._min_steps = min_steps
        self._floor_share = floor_share

    def observe(self, prefill_tokens: int, step_s: float) -> None:
        if prefill_tokens >= 0 and step_s > 0 and math.isfinite(step_s):
            self._obs.append((prefill_tokens, step_s))

    def tokens_per_s(self, marginal: float | None) -> float | None:
        if len(self._obs) < self._min_steps:
            return marginal
        tokens = sum(t for t, _ in self._obs)
        seconds = sum(s for _, s in self._obs)
        rate = tokens / seconds
        if marginal is None:
            return rate if rate > 0 else None
        return min(marginal, max(rate, self._floor_share * marginal))


# ---- output length -----------------------------------------------------------------------------


class OutputLengthPredictor:
    """Predicts a request's output length (tokens) from its prompt length: the mean of the recent
    outputs of prompts in the same power-of-two length bucket; with fewer than `min_bucket_points`
    there, the mean over all buckets; before any, `default_tokens`. Always within [1, max_tokens].
    Reports its mean absolute error over the predictions whose request finished."""

    def __init__(self, default_tokens: int = 128, window: int = 256, min_bucket_points: int = 3) -> None:
        if default_tokens < 1 or window < 1 or min_bucket_points < 1:
            raise ValueError(
                f"OutputLengthPredictor needs positive settings, got {default_tokens}, {window}, {min_bucket_points}"
            )
        self._default = default_tokens
        self._window = window
        self._min_bucket = min_bucket_points
        self._buckets: dict[int, deque[int]] = {}
        self._all: deque[int] = deque(maxlen=window)
        self._abs_error = 0.0
        self._scored = 0

    @staticmethod
    def bucket(prompt_tokens: int) -> int:
        return max(1, prompt_tokens).bit_length()

    def predict(self, prompt_tokens: int, max_tokens: int) -> int:
        seen = self._buckets.get(self.bucket(prompt_tokens))
        if seen is not None and len(seen) >= self._min_bucket:
            mean = sum(seen) / len(seen)
        elif self._all:
            mean = sum(self._all) / len(self._all)
        else:
            mean = self._default
        return max(1, min(max_tokens, math.ceil(mean - _EPS)))

    def observe(self, prompt_tokens: int, output_tokens: int, predicted: int | None = None) -> None:
        """A finished request's actual output; `predicted` (what `predict` said for it) scores it."""
        if output_tokens < 1:
            return
        key = self.bucket(prompt_tokens)
        self._buckets.setdefault(key, deque(maxlen=self._window)).append(output_tokens)
        self._all.append(output_tokens)
        if predicted is not None:
            self._abs_error += abs(predicted - output_tokens)
            self._scored += 1

    @property
    def mae_tokens(self) -> float | None:
        return self._abs_error / self._scored if self._scored else None

    def report(self) -> dict[str, Any]:
        return {"mae_tokens": self.mae_tokens, "scored": self._scored, "buckets": len(self._buckets)}


# ---- admission ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class Member:
    """A request of the set an admission judges: its TPOT SLO (None: none) and its length in
    tokens (prompt plus the output it is expected to reach)."""

    tpot_s: float | None
    length_tokens: float


@dataclass(frozen=True)
class TPOTDecision:
    admit: bool
    vbs: float
    mean_len: float
    est_tpot_s: float | None  # None: no fit yet, admitted blind
    min_tpot_s: float | None


def judge_tpot(candidate: Member, running: Sequence[Member], fit: TPOTFit | None) -> TPOTDecision:
    """Add the candidate to the running set, estimate the step time at the set's VBS and mean
    length, admit if it is within the set's smallest TPOT SLO (the tightest request runs every
    iteration, a looser one every STP/min-STP iterations, so all meet theirs). A candidate
    without a TPOT SLO is not gated (FCFS), nor is any before there is a fit."""
    members = [*running, candidate]
    stps = [m.tpot_s for m in members]
    size = vbs(stps)
    mean_len = sum(m.length_tokens for m in members) / len(members)
    finite = [s for s in stps if s is not None]
    min_stp = min(finite) if finite else None
    est = fit.estimate(size, mean_len) if fit is not None else None
    admit = candidate.tpot_s is None or est is None or min_stp is None or est <= min_stp * (1 + _EPS)
    return TPOTDecision(admit, size, mean_len, est, min_stp)


# ---- the TTFT guard ----------------------------------------------------------------------------


def deadline_s(arrival_s: float, ttft_s: float | None) -> float:
    """The least-deadline-first key: arrival + TTFT SLO; +inf without one (a stable sort keeps
    those, and ties, in arrival order)."""
    return math.inf if ttft_s is None else arrival_s + ttft_s


@dataclass(frozen=True)
class TTFTDecision:
    admit: bool
    est_ttft_s: float | None  # from now to the first token; None: no prefill rate measured yet
    retry_after_s: float  # when the work ahead of it is expected to have drained


def judge_ttft(
    now_s: float,
    deadline: float,
    tokens_ahead: int,
    own_tokens: int,
    prefill_tokens_per_s: float | None,
    step_s: float,
) -> TTFTDecision:
    """Can the first token come by `deadline`? The current step ends (`step_s`), then the prefill
    work queued ahead of it and its own run at the measured rate. Without a rate only a deadline
    already past refuses."""
    if prefill_tokens_per_s is None or prefill_tokens_per_s <= 0:
        return TTFTDecision(now_s <= deadline, None, 0.0)
    ahead_s = step_s + tokens_ahead / prefill_tokens_per_s
    est = ahead_s + own_tokens / prefill_tokens_per_s
    return TTFTDecision(now_s + est <= deadline + _EPS, est, ahead_s)


# ---- state an engine keeps -----------------------------------------------------------------------


@dataclass
class SLOTicket:
    """What SCORPIO knows of one request, made on arrival. `refusable`: a plain request that
    has sent no token yet (no hand-off, KV source, ZigZag or resumed tokens); only those are
    ordered by deadline and refused. Others decode by credits when they have a TPOT SLO."""

    deadline_s: float
    tpot_s: float | None
    predicted_output_tokens: int
    refusable: bool


class ScorpioState:
    """One engine's SCORPIO state: the credits, the fitted models and the rejection counters."""

    def __init__(self, *, default_output_tokens: int = 128) -> None:
        self.batcher = CreditBatcher()
        self.tpot = TPOTFitter()
        self.prefill = PrefillRate()
        self.backlog = BacklogRate()
        self.lengths = OutputLengthPredictor(default_tokens=default_output_tokens)
        self.rejected: dict[str, int] = {"ttft": 0, "tpot": 0}

    @property
    def rejected_total(self) -> int:
        return sum(self.rejected.values())

    @property
    def queue_tokens_per_s(self) -> float | None:
        """The rate the TTFT guard drains the queue at: the backlog's served rate, at most the
        marginal prefill rate."""
        return self.backlog.tokens_per_s(self.prefill.tokens_per_s)

    def report(self) -> dict[str, Any]:
        fit = self.tpot.fit()
        return {
            "tpot_model": fit.report() if fit is not None else {"points": self.tpot.points},
            "prefill_tokens_per_s": self.prefill.tokens_per_s,
            "queue_tokens_per_s": self.queue_tokens_per_s,
            "output_length": self.lengths.report(),
            "rejected": dict(self.rejected),
        }
