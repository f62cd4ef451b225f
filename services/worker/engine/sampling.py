"""Per-request sampling parameters and the sampler that turns a step's logits into tokens.

Each request draws from its own `torch.Generator`, one row at a time, so a seeded request gets
the same tokens whatever else shares its batch.
"""

from __future__ import annotations

import math
import secrets
from collections.abc import Sequence
from dataclasses import dataclass

import torch

# torch.Generator.manual_seed accepts [-2**63, 2**64).
_SEED_MIN, _SEED_MAX = -(2**63), 2**64 - 1


@dataclass(frozen=True)
class SamplingParams:
    """How one request picks tokens and when it stops."""

    temperature: float = 1.0  # 0 = greedy
    top_p: float = 1.0  # nucleus mass kept, in (0, 1]
    top_k: int = 0  # 0 or -1 = off
    max_tokens: int = 16
    stop_token_ids: tuple[int, ...] = ()
    seed: int | None = None
    ignore_eos: bool = False

    def __post_init__(self) -> None:
        if isinstance(self.temperature, bool) or not isinstance(self.temperature, (int, float)):
            raise ValueError(f"temperature must be a number, got {self.temperature!r}")
        if not math.isfinite(self.temperature) or self.temperature < 0:
            raise ValueError(f"temperature must be finite and >= 0, got {self.temperature!r}")
        if isinstance(self.top_p, bool) or not isinstance(self.top_p, (int, float)) or not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p!r}")
        if isinstance(self.top_k, bool) or not isinstance(self.top_k, int) or self.top_k < -1:
            raise ValueError(f"top_k must be an int >= -1 (0 or -1 = off), got {self.top_k!r}")
        if isinstance(self.max_tokens, bool) or not isinstance(self.max_tokens, int) or self.max_tokens < 1:
            raise ValueError(f"max_tokens must be an int >= 1, got {self.max_tokens!r}")
        stop = tuple(self.stop_token_ids)
        for token in stop:
            if isinstance(token, bool) or not isinstance(token, int) or token < 0:
                raise ValueError(f"stop_token_ids must be non-negative ints, got {token!r}")
        object.__setattr__(self, "stop_token_ids", stop)
        if self.seed is not None and (
            isinstance(self.seed, bool) or not isinstance(self.seed, int) or not _SEED_MIN <= self.seed <= _SEED_MAX
        ):
            raise ValueError(f"seed must be None or an int in [-2**63, 2**64), got {self.seed!r}")
        if not isinstance(self.ignore_eos, bool):
            raise ValueError(f"ignore_eos must be a bool, got {self.ignore_eos!r}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    def make_generator(self) -> torch.Generator | None:
        """The request's private generator (None for greedy); unseeded requests get a random seed."""
        if self.greedy:
            return None
        gen = torch.Generator()
        gen.manual_seed(self.seed if self.seed is not None else secrets.randbits(63))
        return gen


def _top_p_threshold(probs: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """Per row, the probability of the last token of the nucleus: the smallest set of most likely
    tokens whose mass reaches `top_p`. Keeping `probs >= threshold` keeps ties at the cut-off too."""
    sorted_probs = torch.sort(probs, dim=-1, descending=True).values
    # Number of tokens whose preceding mass is still below top_p, i.e. the nucleus size (>= 1).
    before = sorted_probs.cumsum(dim=-1) - sorted_probs
    size = (before < top_p.unsqueeze(1)).sum(dim=-1).clamp_(min=1)
    return sorted_probs.gather(1, (size - 1).unsqueeze(1)).squeeze(1)


def _sample_rows(
    logits: torch.Tensor, params: Sequence[SamplingParams], generators: Sequence[torch.Generator | None]
) -> list[int]:
    """Sample one token per row (all rows non-greedy) with temperature, top-k and top-p."""
    vocab = logits.shape[-1]
    x = logits / torch.tensor([p.temperature for p in params], dtype=logits.dtype).unsqueeze(1)
    ks = [p.top_k if 0 < p.top_k < vocab else 0 for p in params]
    if any(ks):
        top = torch.topk(x, max(ks), dim=-1).values
        kth = torch.stack([top[i, k - 1] if k else x.new_tensor(float("-inf")) for i, k in enumerate(ks)])
        # Ties with the k-th value stay in: which of equal logits to drop would be arbitrary.
        x = x.masked_fill(x < kth.unsqueeze(1), float("-inf"))
    probs = torch.softmax(x, dim=-1)
    if any(p.top_p < 1.0 for p in params):
        top_p = torch.tensor([p.top_p for p in params], dtype=probs.dtype)
        threshold = _top_p_threshold(probs, top_p)
        # Rows with top_p == 1 keep everything (threshold 0).
        threshold = torch.where(top_p < 1.0, threshold, 0.0)
        probs = torch.where(probs >= threshold.unsqueeze(1), probs, 0.0)
    # Inverse-CDF draw: one uniform number per row from the request's own generator, so a row's
    # token depends only on its logits and its generator.
    cdf = probs.cumsum(dim=-1)
    u = torch.stack([torch.rand((), generator=g) for g in generators]).to(cdf.dtype)
    target = (u * cdf[:, -1]).unsqueeze(1)
    picked = torch.searchsorted(cdf, target, right=True).squeeze(1).clamp_(max=vocab - 1)
    return picked.tolist()


def sample(
    logits: torch.Tensor,
    params: Sequence[SamplingParams],
    generators: Sequence[torch.Generator | None],
) -> tuple[list[int], list[float]]:
    """Pick one token per row of `logits [R, vocab]`; returns tokens and their model log-probs.

    Log-probs are of the model's raw distribution (before temperature/top-k/top-p), as most
    serving APIs report them.
    """
    if logits.dim() != 2 or logits.shape[0] != len(params) or len(params) != len(generators):
        raise ValueError(
            f"sample: logits {tuple(logits.shape)} for {len(params)} params and {len(generators)} generators"
        )
    # Sampling is a few [R, vocab] ops: done on the CPU, where the per-request generators live.
    logits = logits.detach().float().cpu()
    logprobs = torch.log_softmax(logits, dim=-1)
    tokens = logits.argmax(dim=-1).tolist()
    rows = [i for i, p in enumerate(params) if not p.greedy]
    if rows:
        picked = _sample_rows(logits[rows], [params[i] for i in rows], [generators[i] for i in rows])
        for i, token in zip(rows, picked, strict=True):
            tokens[i] = token
    chosen = logprobs.gather(1, torch.tensor(tokens, dtype=torch.long).unsqueeze(1)).squeeze(1)
    return tokens, chosen.tolist()
