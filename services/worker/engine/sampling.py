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


def _filter_row(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """Temperature, top-k and top-p applied to one row of float32 logits."""
    x = logits / params.temperature
    vocab = x.shape[-1]
    if 0 < params.top_k < vocab:
        kth = torch.topk(x, params.top_k).values[-1]
        x = x.masked_fill(x < kth, float("-inf"))
    if params.top_p < 1.0:
        sorted_x, order = torch.sort(x, descending=True)
        probs = torch.softmax(sorted_x, dim=-1)
        # Drop a token when the mass before it already reaches top_p; the top token always stays.
        drop_sorted = (probs.cumsum(dim=-1) - probs) >= params.top_p
        drop = torch.zeros_like(drop_sorted).scatter(0, order, drop_sorted)
        x = x.masked_fill(drop, float("-inf"))
    return x


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
    logits = logits.float()
    logprobs = torch.log_softmax(logits, dim=-1)
    tokens = logits.argmax(dim=-1).tolist()
    for row, (p, gen) in enumerate(zip(params, generators, strict=True)):
        if p.greedy:
            continue
        probs = torch.softmax(_filter_row(logits[row], p), dim=-1)
        tokens[row] = int(torch.multinomial(probs, 1, generator=gen).item())
    chosen = logprobs.gather(1, torch.tensor(tokens, dtype=torch.long).unsqueeze(1)).squeeze(1)
    return tokens, chosen.tolist()
