"""What each engine iteration computed (from `Engine.step_log`) and the least-squares fit of its
time. Pure: no torch, no clock.

The model is `services.common.worker_profile.StepTimeModel`; its docstring says why these terms.
The fit is ordinary least squares on column-normalized features (as SCORPIO's `TPOTFitter`),
dropping a term whose column is all zero in the samples (e.g. no prompt ever chunked) and
reporting R², the mean absolute residual and the residuals by kind of iteration.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, MutableMapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

import numpy as np

from services.common.worker_profile import StepFeatures, StepTimeModel

__all__ = ["TERMS", "FitResult", "Sample", "fit_step_time", "residual_stats", "step_samples"]

StepKind = Literal["prefill", "decode", "mixed"]

# Feature name -> StepTimeModel coefficient; "1" is the intercept.
TERMS: dict[str, str] = {
    "1": "base_s",
    "prefill_tokens": "prefill_token_s",
    "prefill_attn_pairs": "prefill_attn_pair_s",
    "prefill_seqs": "prefill_seq_s",
    "decode_rows": "decode_row_s",
    "decode_context_tokens": "decode_context_s",
}
_RANK_TOL = 1e-9


@dataclass(frozen=True)
class Sample:
    """One iteration: its features, the engine's step time (compute + pacing) and compute time."""

    index: int
    features: StepFeatures
    step_s: float
    compute_s: float

    @property
    def kind(self) -> StepKind:
        f = self.features
        if f.decode_rows and f.prefill_tokens:
            return "mixed"
        return "decode" if f.decode_rows else "prefill"

    def row(self) -> list[float]:
        f = self.features
        return [self.index, *(getattr(f, t) for t in TERMS if t != "1"), self.step_s, self.compute_s]


def step_samples(
    records: Iterable[Any],
    prompt_lens: Mapping[str, int],
    computed: MutableMapping[str, int] | None = None,
) -> list[Sample]:
    """Features of each iteration in `records` (`StepRecord`s, oldest first), for requests of known
    prompt length.

    `computed` carries each request's computed tokens from one call to the next (a request that
    spans two calls) and is updated. Requests start at 0: the caller gives each a prompt no cache
    holds. An iteration with a request of unknown prompt length is skipped (and that request
    tracked no further), as is one with no work.
    """
    done = computed if computed is not None else {}
    out: list[Sample] = []
    for rec in records:
        f = {t: 0.0 for t in TERMS if t != "1"}
        known = True
        for request_id, n in rec.work:
            if n <= 0:
                continue
            prompt = prompt_lens.get(request_id)
            if prompt is None:
                known = False
                continue
            start = done.get(request_id, 0)
            if start < prompt:
                chunk = min(n, prompt - start)
                f["prefill_tokens"] += chunk
                f["prefill_attn_pairs"] += chunk * (start + (chunk + 1) / 2)
                if start + chunk == prompt:
                    f["prefill_seqs"] += 1
            else:
                f["decode_rows"] += 1
                f["decode_context_tokens"] += start + 1
            done[request_id] = start + n
        if known and any(f.values()):
            out.append(Sample(rec.index, StepFeatures(**f), float(rec.step_s), float(rec.compute_s)))
    return out


@dataclass(frozen=True)
class FitResult:
    model: StepTimeModel
    terms: tuple[str, ...]  # features fitted ("1" = intercept); the others' coefficients are 0
    by_kind: dict[str, dict[str, float]]  # kind -> samples, MAE, mean relative error
    worst: list[dict[str, Any]]  # the largest residuals, for the report

    def report(self) -> dict[str, Any]:
        return {"terms": list(self.terms), "by_kind": self.by_kind, "worst_residuals": self.worst}


def _design(samples: Sequence[Sample], terms: Sequence[str]) -> np.ndarray:
    cols = [
        np.ones(len(samples)) if t == "1" else np.array([getattr(s.features, t) for s in samples], dtype=np.float64)
        for t in terms
    ]
    return np.stack(cols, axis=1)


def residual_stats(samples: Sequence[Sample], model: StepTimeModel) -> dict[str, dict[str, float]]:
    """Per kind of iteration (and "all"): samples, MAE in seconds, mean |residual| / measured."""
    groups: dict[str, list[tuple[float, float]]] = {}
    for s in samples:
        pred = model.step_s(s.features, with_overhead=False)
        for key in (s.kind, "all"):
            groups.setdefault(key, []).append((s.step_s, pred))
    out = {}
    for key, pairs in sorted(groups.items()):
        y = np.array([p[0] for p in pairs])
        pred = np.array([p[1] for p in pairs])
        err = np.abs(y - pred)
        out[key] = {
            "samples": len(pairs),
            "mae_s": float(err.mean()),
            "mean_rel_err": float(np.mean(err / np.maximum(y, 1e-9))),
            "mean_step_s": float(y.mean()),
        }
    return out


def fit_step_time(
    samples: Sequence[Sample], *, terms: Sequence[str] = tuple(TERMS), loop_overhead_s: float = 0.0
) -> FitResult:
    """Least squares of step time on the features; ValueError if the samples cannot fix the terms."""
    if not samples:
        raise ValueError("no samples to fit")
    y = np.array([s.step_s for s in samples], dtype=np.float64)
    used = [t for t in terms if t == "1" or any(getattr(s.features, t) for s in samples)]
    x = _design(samples, used)
    norms = np.linalg.norm(x, axis=0)
    xn = x / norms
    sv = np.linalg.svd(xn, compute_uv=False)
    if len(samples) < len(used) + 1 or sv[-1] < _RANK_TOL * sv[0]:
        raise ValueError(
            f"{len(samples)} samples cannot determine the terms {used}: vary prompt lengths, batch sizes and "
            f"contexts independently (smallest/largest singular value {sv[-1] / sv[0]:.2e})"
        )
    coef_n, *_ = np.linalg.lstsq(xn, y, rcond=None)
    coef = dict(zip(used, (coef_n / norms).tolist(), strict=True))
    resid = y - x @ (coef_n / norms)
    ss_tot = float(np.sum((y - y.mean()) ** 2))
    model = StepTimeModel(
        **{TERMS[t]: coef.get(t, 0.0) for t in TERMS},
        loop_overhead_s=max(0.0, loop_overhead_s),
        r2=1.0 - float(np.sum(resid**2)) / ss_tot if ss_tot > 0 else None,
        mae_s=float(np.mean(np.abs(resid))),
        samples=len(samples),
    )
    order = np.argsort(-np.abs(resid))[:5]
    worst = [
        {
            "index": samples[i].index,
            "kind": samples[i].kind,
            "step_s": float(y[i]),
            "residual_s": float(resid[i]),
            **{t: getattr(samples[i].features, t) for t in TERMS if t != "1"},
        }
        for i in order
    ]
    return FitResult(model, tuple(used), residual_stats(samples, model), worst)
