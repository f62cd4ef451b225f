"""Rotary position embeddings: inverse frequencies of every RoPE type, and cos/sin per token.

The inverse frequencies mirror transformers 5.23's `modeling_rope_utils` operation for operation
(same float32/float64 steps), so the rotations match its own to the last bit or so:

- `default`: theta ** -(2i / d);
- `linear`: default / factor;
- `llama3`: default, with wavelengths above original_max / low_freq_factor divided by factor and a
  smooth blend between the low and high bands;
- `yarn`: per-dimension blend of interpolated (/ factor) and extrapolated frequencies over the
  correction range from beta_fast / beta_slow, and an attention factor (0.1 ln(factor) + 1, or
  from mscale / mscale_all_dim, or given) that multiplies cos and sin;
- `dynamic` (NTK): for a sequence of L tokens, L > max_position_embeddings, the base becomes
  theta * (factor * L / max_pos - (factor - 1)) ** (d / (d - 2)); shorter sequences use L = max_pos.

Dynamic NTK and the KV cache: transformers recomputes the frequencies when a forward's longest
position grows past what it last used and rotates only that forward's new tokens with them; keys
already in the cache keep the rotation they were computed with. Blitzmesh does the same per
sequence: each new token is rotated with the frequencies for its own sequence's length at the
step that computes it (prompt: its length; a chunk of it: the tokens up to the chunk's end; a
decoded token at position p: p + 1), and cached keys are never re-rotated. For one sequence this
is exactly what transformers' `generate` computes from a fresh model; it does not depend on the
other sequences in the batch (transformers uses the batch's longest) nor on what ran before (its
rotary module keeps the longest length seen until a sequence shorter than max_pos comes).
"""

from __future__ import annotations

import math

import torch

from services.model_format.config import LlamaConfig


def _default_inv_freq(base: float | torch.Tensor, dim: int, device: torch.device | None = None) -> torch.Tensor:
    return 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.int64).to(device=device, dtype=torch.float) / dim))


def inv_freq(cfg: LlamaConfig, seq_len: int | None = None) -> tuple[torch.Tensor, float]:
    """`(inverse frequencies [head_dim / 2] float32, attention scaling)` of `cfg`'s RoPE.

    `seq_len` matters only for `dynamic`: the length of the sequence being rotated (None, or up
    to max_position_embeddings: the frequencies transformers starts with and keeps there).
    """
    dim = cfg.head_dim
    base = cfg.rope_theta
    s = cfg.rope_scaling
    if s is None:
        return _default_inv_freq(base, dim), 1.0
    if s.rope_type == "linear":
        assert s.factor is not None
        freq = _default_inv_freq(base, dim)
        freq /= s.factor
        return freq, 1.0
    if s.rope_type == "dynamic":
        assert s.factor is not None
        max_pos = cfg.max_position_embeddings
        if seq_len is None or seq_len <= max_pos:
            # transformers keeps its initial frequencies up to max_pos: Python floats.
            grown: float | torch.Tensor = base * ((s.factor * max_pos / max_pos) - (s.factor - 1)) ** (dim / (dim - 2))
        else:
            # transformers recomputes with a 0-dim int64 tensor (max position + 1): float32 math.
            length = torch.maximum(torch.tensor(seq_len, dtype=torch.int64), torch.tensor(max_pos, dtype=torch.int64))
            grown = base * ((s.factor * length / max_pos) - (s.factor - 1)) ** (dim / (dim - 2))
        return _default_inv_freq(grown, dim), 1.0
    if s.rope_type == "llama3":
        return _llama3(cfg), 1.0
    if s.rope_type == "yarn":
        return _yarn(cfg)
    raise ValueError(f"rope type {s.rope_type!r} is not supported")


def _llama3(cfg: LlamaConfig) -> torch.Tensor:
    s = cfg.rope_scaling
    assert s is not None and s.factor is not None and s.low_freq_factor is not None
    assert s.high_freq_factor is not None and s.original_max_position_embeddings is not None
    freq = _default_inv_freq(cfg.rope_theta, cfg.head_dim)
    factor, low, high = s.factor, s.low_freq_factor, s.high_freq_factor
    old_context_len = s.original_max_position_embeddings
    low_freq_wavelen = old_context_len / low
    high_freq_wavelen = old_context_len / high
    wavelen = 2 * math.pi / freq
    scaled = torch.where(wavelen > low_freq_wavelen, freq / factor, freq)
    smooth = (old_context_len / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = ~(wavelen < high_freq_wavelen) * ~(wavelen > low_freq_wavelen)
    return torch.where(is_medium, smoothed, scaled)


def _yarn(cfg: LlamaConfig) -> tuple[torch.Tensor, float]:
    s = cfg.rope_scaling
    assert s is not None and s.original_max_position_embeddings is not None
    base, dim = cfg.rope_theta, cfg.head_dim
    original = s.original_max_position_embeddings
    factor = s.factor if s.factor is not None else cfg.max_position_embeddings / original

    def get_mscale(scale: float, mscale: float = 1) -> float:
        return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0

    attention_factor = s.attention_factor
    if attention_factor is None:
        if s.mscale and s.mscale_all_dim:
            attention_factor = float(get_mscale(factor, s.mscale) / get_mscale(factor, s.mscale_all_dim))
        else:
            attention_factor = get_mscale(factor)
    beta_fast = s.beta_fast or 32
    beta_slow = s.beta_slow or 1

    def correction_dim(rotations: float) -> float:
        return (dim * math.log(original / (rotations * 2 * math.pi))) / (2 * math.log(base))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if s.truncate is None or s.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # transformers' guard against a zero-width ramp
    ramp = torch.clamp((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low), 0, 1)
    pos_freqs = base ** (torch.arange(0, dim, 2).to(dtype=torch.float) / dim)
    extrapolation = 1.0 / pos_freqs
    interpolation = 1.0 / (factor * pos_freqs)
    extrapolation_factor = 1 - ramp
    freq = interpolation * (1 - extrapolation_factor) + extrapolation * extrapolation_factor
    return freq, float(attention_factor)


class RotaryEmbedding:
    """cos/sin of every token of a step, in the compute dtype, for `LlamaForCausalLM._rope`."""

    def __init__(self, cfg: LlamaConfig, device: torch.device) -> None:
        self.config = cfg
        self.device = device
        freq, self.attention_scaling = inv_freq(cfg)
        self.inv_freq = freq.to(device)
        scaling = cfg.rope_scaling
        self.dynamic = scaling is not None and scaling.rope_type == "dynamic"

    def dynamic_inv_freq(self, seq_len: int) -> torch.Tensor:
        """Dynamic NTK frequencies for a sequence of `seq_len` tokens."""
        return inv_freq(self.config, seq_len)[0].to(self.device)

    def cos_sin(
        self,
        positions: torch.Tensor,
        query_lens: tuple[int, ...],
        context_lens: tuple[int, ...],
        dtype: torch.dtype,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """`(cos [T, 1, d], sin_half [T, 1, d/2])` for the flat batch's tokens (sequence b has
        `query_lens[b]` new tokens after `context_lens[b]` cached ones)."""
        freqs = positions[:, None].float() * self.inv_freq
        if self.dynamic:
            original = self.config.max_position_embeddings
            start = 0
            for n, c in zip(query_lens, context_lens, strict=True):
                length = c + n
                if length > original:
                    rows = slice(start, start + n)
                    freqs[rows] = positions[rows, None].float() * self.dynamic_inv_freq(length)
                start += n
        cos, sin = freqs.cos(), freqs.sin()
        if self.attention_scaling != 1.0:
            cos = cos * self.attention_scaling
            sin = sin * self.attention_scaling
        return torch.cat([cos, cos], dim=-1).to(dtype).unsqueeze(1), sin.to(dtype).unsqueeze(1)
