"""Per-request sampling parameters and the sampler that turns a step's logits into tokens.

Each request draws from its own `torch.Generator`, one row at a time, so a seeded request gets
the same tokens whatever else shares its batch.

A row's logits go through, in this order (vLLM v1's): `logit_bias` (added), the repetition
penalty (over prompt + generated tokens: positive logits divided by it, negative ones
multiplied), the frequency penalty (subtracted once per earlier occurrence in the generated
tokens) and the presence penalty (subtracted once if the token was generated before); then
greedy argmax, or temperature, top-k, top-p and the draw. The penalties read only the
request's own tokens (`TokenHistory`), so batch-mates never change a row's result, and a row
with none of these options is not touched at all: greedy stays bit-identical.

Log-probs are of the model's raw distribution (`log_softmax` of the logits, before any of the
above), as vLLM reports them by default and as "how likely did the model find this token" reads.
"""

from __future__ import annotations

import math
import secrets
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import NamedTuple

import torch

# torch.Generator.manual_seed accepts [-2**63, 2**64).
_SEED_MIN, _SEED_MAX = -(2**63), 2**64 - 1
MAX_LOGPROBS = 20  # most alternatives per position (OpenAI's top_logprobs limit)
MAX_LOGIT_BIAS = 100.0  # |bias| limit, OpenAI's
MAX_PENALTY = 2.0  # |presence_penalty|, |frequency_penalty| limit, OpenAI's

TopLogprobs = tuple[tuple[int, float], ...]
"""(token id, log-prob) of the most likely tokens at one position, most likely first."""


@dataclass(frozen=True)
class PromptLogprob:
    """One prompt token's log-prob given the tokens before it, and the most likely tokens there."""

    token_id: int
    logprob: float | None  # None for the first prompt token: nothing precedes it
    top: TopLogprobs = ()


def _is_number(value: object) -> bool:
    return not isinstance(value, bool) and isinstance(value, (int, float)) and math.isfinite(value)


def _count(name: str, value: object) -> None:
    if value is not None and (isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= MAX_LOGPROBS):
        raise ValueError(f"{name} must be None or an int in [0, {MAX_LOGPROBS}], got {value!r}")


def normalize_logit_bias(value: Mapping[int, float] | Iterable[tuple[int, float]]) -> tuple[tuple[int, float], ...]:
    """`{token_id: bias}` or `(token_id, bias)` pairs -> pairs sorted by id, each checked:
    ids are ints >= 0 (once each), biases finite numbers in [-100, 100]."""
    pairs = list(value.items()) if isinstance(value, Mapping) else list(value)
    out: dict[int, float] = {}
    for pair in pairs:
        if not isinstance(pair, tuple) or len(pair) != 2:
            raise ValueError(f"logit_bias must map token ids to biases, got the entry {pair!r}")
        token, bias = pair
        if isinstance(token, bool) or not isinstance(token, int) or token < 0:
            raise ValueError(f"logit_bias keys must be token ids (ints >= 0), got {token!r}")
        if not _is_number(bias) or not -MAX_LOGIT_BIAS <= bias <= MAX_LOGIT_BIAS:
            raise ValueError(f"logit_bias for token {token} must be a number in [-100, 100], got {bias!r}")
        if token in out:
            raise ValueError(f"logit_bias names token {token} twice")
        out[token] = float(bias)
    return tuple(sorted(out.items()))


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
    presence_penalty: float = 0.0  # [-2, 2], over generated tokens (OpenAI)
    frequency_penalty: float = 0.0  # [-2, 2], over generated tokens (OpenAI)
    repetition_penalty: float = 1.0  # > 0, over prompt + generated tokens (HF/vLLM); 1 = off
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, bias in [-100, 100]); a dict is accepted
    logprobs: int | None = None  # None: no log-probs; k: the sampled token's and the k most likely
    prompt_logprobs: int | None = None  # the same for each prompt token (computed in the prefill)

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
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if not _is_number(value) or not -MAX_PENALTY <= value <= MAX_PENALTY:
                raise ValueError(f"{name} must be a number in [-2, 2], got {value!r}")
        if not _is_number(self.repetition_penalty) or self.repetition_penalty <= 0:
            raise ValueError(f"repetition_penalty must be a number > 0 (1 = off), got {self.repetition_penalty!r}")
        object.__setattr__(self, "logit_bias", normalize_logit_bias(self.logit_bias))
        _count("logprobs", self.logprobs)
        _count("prompt_logprobs", self.prompt_logprobs)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    @property
    def processes_logits(self) -> bool:
        """Whether any option changes the logits before the pick (else the row is left alone)."""
        return (
            bool(self.logit_bias)
            or self.presence_penalty != 0
            or self.frequency_penalty != 0
            or self.repetition_penalty != 1
        )

    def make_generator(self, skip: int = 0) -> torch.Generator | None:
        """The request's private generator (None for greedy); unseeded requests get a random seed.

        `skip` draws are consumed first: a request resumed after `skip` sampled tokens continues
        the same random stream (each sampled token takes exactly one draw, see `_sample_rows`)."""
        if self.greedy:
            return None
        gen = torch.Generator()
        gen.manual_seed(self.seed if self.seed is not None else secrets.randbits(63))
        for _ in range(skip):
            _draw(gen)
        return gen


class TokenHistory:
    """What the penalties and logit_bias of one request read: its bias as tensors, how often each
    token was generated, and which tokens occurred in prompt + output. Built once per request
    (None when the request has none of these options); `add` each generated token."""

    def __init__(self, params: SamplingParams, prompt: Sequence[int], vocab_size: int) -> None:
        self.params = params
        self.vocab_size = vocab_size
        bad = [t for t, _ in params.logit_bias if t >= vocab_size]
        if bad:
            raise ValueError(f"logit_bias token id {bad[0]} is outside the vocabulary [0, {vocab_size})")
        self.bias_ids = torch.tensor([t for t, _ in params.logit_bias], dtype=torch.long)
        self.bias_values = torch.tensor([b for _, b in params.logit_bias], dtype=torch.float32)
        counts = params.presence_penalty != 0 or params.frequency_penalty != 0
        self.output_counts = torch.zeros(vocab_size, dtype=torch.float32) if counts else None
        self.seen: torch.Tensor | None = None
        if params.repetition_penalty != 1:
            self.seen = torch.zeros(vocab_size, dtype=torch.bool)
            self.seen[torch.tensor(list(prompt), dtype=torch.long)] = True

    @classmethod
    def create(cls, params: SamplingParams, prompt: Sequence[int], vocab_size: int) -> TokenHistory | None:
        return cls(params, prompt, vocab_size) if params.processes_logits else None

    def add(self, token: int) -> None:
        if self.output_counts is not None:
            self.output_counts[token] += 1
        if self.seen is not None:
            self.seen[token] = True

    def apply(self, row: torch.Tensor) -> torch.Tensor:
        """A processed copy of one row of float32 logits `[vocab]` (the input is left alone), on
        the row's device (the history itself lives on the CPU, where `add` updates it)."""
        p = self.params
        dev = row.device
        x = row.clone()
        if self.bias_ids.numel():
            x.index_add_(0, self.bias_ids.to(dev), self.bias_values.to(dev))
        if self.seen is not None:
            r = p.repetition_penalty
            x = torch.where(self.seen.to(dev), torch.where(x > 0, x / r, x * r), x)
        if self.output_counts is not None:
            counts = self.output_counts.to(dev)
            if p.frequency_penalty != 0:
                x -= p.frequency_penalty * counts
            if p.presence_penalty != 0:
                x -= p.presence_penalty * (counts > 0).float()
        return x


def process_logits(logits: torch.Tensor, histories: Sequence[TokenHistory | None]) -> torch.Tensor:
    """Apply each row's logit_bias and penalties; `logits` itself when no row has any."""
    if not any(h is not None for h in histories):
        return logits
    out = logits.clone()
    for i, h in enumerate(histories):
        if h is not None:
            out[i] = h.apply(logits[i])
    return out


def top_logprobs(logprobs: torch.Tensor, ks: Sequence[int]) -> list[TopLogprobs]:
    """Per row of `logprobs [R, vocab]`, the `ks[row]` most likely (id, log-prob), most likely first."""
    k_max = max(ks, default=0)
    if k_max <= 0:
        return [() for _ in ks]
    values, ids = torch.topk(logprobs, min(k_max, logprobs.shape[-1]), dim=-1)
    # One copy to the host for both (ids < 2^53 and float32 values are exact in float64).
    both = torch.stack((values.double(), ids.double())).cpu()
    values_l, ids_l = both[0].tolist(), both[1].long().tolist()
    return [tuple(zip(ids_l[i][:k], values_l[i][:k], strict=True)) for i, k in enumerate(ks)]


def _draw(generator: torch.Generator) -> torch.Tensor:
    """The one uniform number a sampled token takes from its request's generator."""
    return torch.rand((), generator=generator)


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
) -> torch.Tensor:
    """Sample one token per row (all rows non-greedy) with temperature, top-k and top-p; the
    tokens `[R]` on the logits' device. The uniform draws come from the requests' own (CPU)
    generators, so a seeded request picks the same tokens on any device, up to the rounding of
    the device's softmax and cumulative sum."""
    vocab = logits.shape[-1]
    dev = logits.device
    x = logits / torch.tensor([p.temperature for p in params], dtype=logits.dtype).to(dev).unsqueeze(1)
    ks = [p.top_k if 0 < p.top_k < vocab else 0 for p in params]
    if any(ks):
        top = torch.topk(x, max(ks), dim=-1).values
        kth = torch.stack([top[i, k - 1] if k else x.new_tensor(float("-inf")) for i, k in enumerate(ks)])
        # Ties with the k-th value stay in: which of equal logits to drop would be arbitrary.
        x = x.masked_fill(x < kth.unsqueeze(1), float("-inf"))
    probs = torch.softmax(x, dim=-1)
    if any(p.top_p < 1.0 for p in params):
        top_p = torch.tensor([p.top_p for p in params], dtype=probs.dtype).to(dev)
        threshold = _top_p_threshold(probs, top_p)
        # Rows with top_p == 1 keep everything (threshold 0).
        threshold = torch.where(top_p < 1.0, threshold, 0.0)
        probs = torch.where(probs >= threshold.unsqueeze(1), probs, 0.0)
    # Inverse-CDF draw: one uniform number per row from the request's own generator, so a row's
    # token depends only on its logits and its generator.
    cdf = probs.cumsum(dim=-1)
    u = torch.stack([_draw(g) for g in generators]).to(device=dev, dtype=cdf.dtype)
    target = (u * cdf[:, -1]).unsqueeze(1)
    return torch.searchsorted(cdf, target, right=True).squeeze(1).clamp_(max=vocab - 1)


class SampleOutput(NamedTuple):
    tokens: list[int]
    logprobs: list[float]  # of each picked token, under the raw distribution
    top_logprobs: list[TopLogprobs]  # per row, `params.logprobs` alternatives (empty when 0 or None)


def sample(
    logits: torch.Tensor,
    params: Sequence[SamplingParams],
    generators: Sequence[torch.Generator | None],
    histories: Sequence[TokenHistory | None] | None = None,
) -> SampleOutput:
    """Pick one token per row of `logits [R, vocab]`; returns the tokens, their model log-probs
    and each row's top alternatives.

    `histories[row]` holds the row's logit_bias and penalty state (None: the row has neither).
    Log-probs are of the model's raw distribution (before logit_bias, penalties, temperature,
    top-k and top-p), as vLLM reports them by default.
    """
    if histories is None:
        histories = [None] * len(params)
    if (
        logits.dim() != 2
        or logits.shape[0] != len(params)
        or len(params) != len(generators)
        or len(histories) != len(params)
    ):
        raise ValueError(
            f"sample: logits {tuple(logits.shape)} for {len(params)} params, {len(generators)} generators"
            f" and {len(histories)} histories"
        )
    # Sampling runs where the logits are (a few [R, vocab] ops): on a GPU only the picked tokens
    # and their log-probs come back, in one copy, not R x vocab floats.
    logits = logits.detach().float()
    logprobs = torch.log_softmax(logits, dim=-1)
    processed = process_logits(logits, histories)
    tokens = processed.argmax(dim=-1)
    rows = [i for i, p in enumerate(params) if not p.greedy]
    if rows:
        picked = _sample_rows(processed[rows], [params[i] for i in rows], [generators[i] for i in rows])
        tokens[torch.tensor(rows, dtype=torch.long).to(tokens.device)] = picked
    chosen = logprobs.gather(1, tokens.unsqueeze(1)).squeeze(1)
    # Token ids (< 2^53) and float32 log-probs are exact in float64: one copy to the host.
    host = torch.stack((tokens.double(), chosen.double())).cpu()
    top = top_logprobs(logprobs, [p.logprobs or 0 for p in params])
    return SampleOutput(host[0].long().tolist(), host[1].tolist(), top)


def prompt_logprobs(logits: torch.Tensor, targets: Sequence[int], k: int) -> list[tuple[float, TopLogprobs]]:
    """Log-prob of `targets[i]` under row i of `logits [N, vocab]` (the logits of the position
    before that prompt token) and the row's `k` most likely tokens."""
    rows = torch.log_softmax(logits.detach().float().cpu(), dim=-1)
    ids = torch.tensor(list(targets), dtype=torch.long)
    values = rows.gather(1, ids.unsqueeze(1)).squeeze(1).tolist()
    return list(zip(values, top_logprobs(rows, [k] * len(values)), strict=True))
