"""A worker profile: one engine's fitted step-time model and its saturation decode throughput.

Written by `python -m bench.profile` (measured on this project's engine); read by the global
manager's HeteroScale policy (`worker_profile` policy parameter: the recommended decode-TPS
target) and, later, by the cluster simulator (the step-time model of a simulated worker). The
canonical copies live in `profiles/<model>.json` at the repository root. A profile taken from
published measurements instead (an A100/H100 paper profile) sets `source="published"` and cites
it in `source_ref`.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

__all__ = [
    "PROFILE_DIR",
    "PROFILE_SCHEMA_VERSION",
    "TARGET_FRACTION",
    "Recommendation",
    "Saturation",
    "StepFeatures",
    "StepTimeModel",
    "WorkerProfile",
    "load_profile",
]

PROFILE_SCHEMA_VERSION = 1
# Where the canonical profiles live, relative to the repository root (the services' working dir).
PROFILE_DIR = Path("profiles")
# HeteroScale's guidance, as the project's issue quotes it: run each instance at 0.7 of the decode
# TPS at which it saturates, leaving headroom for bursts and for the latency trigger to act.
TARGET_FRACTION = 0.7


class StepFeatures(BaseModel):
    """What one engine iteration computed, in the units of `StepTimeModel`'s coefficients.

    prefill_tokens: prompt tokens computed. prefill_attn_pairs: (query, key) pairs their causal
    attention covered, sum over prompt chunks of n * (start + (n + 1) / 2) for a chunk of n tokens
    after `start` computed ones. prefill_seqs: prompts whose last chunk ran (each samples a token:
    one LM-head row). decode_rows: requests that generated one token. decode_context_tokens: KV
    tokens those rows attended to, summed.
    """

    model_config = ConfigDict(frozen=True, extra="forbid")

    prefill_tokens: float = 0.0
    prefill_attn_pairs: float = 0.0
    prefill_seqs: float = 0.0
    decode_rows: float = 0.0
    decode_context_tokens: float = 0.0


class StepTimeModel(BaseModel):
    """`step_s = base_s + prefill_token_s * prefill_tokens + prefill_attn_pair_s * prefill_attn_pairs
    + prefill_seq_s * prefill_seqs + decode_row_s * decode_rows + decode_context_s *
    decode_context_tokens` (see `StepFeatures`), plus `loop_overhead_s` of scheduling between
    iterations that the engine's step timer does not see.

    Why these terms: the weights are read once per iteration (base_s, dominant in small decode
    batches), the linear layers cost per token (prefill_token_s, decode_row_s; they differ because
    a prefill token runs batched matmuls and no LM head, a decode row runs the LM head and a
    matrix-vector-shaped product), attention grows with the context each query sees (quadratic in
    a prompt, linear in a decode row's context), and each finished prompt samples once.
    """

    model_config = ConfigDict(frozen=True, extra="forbid")

    base_s: float = Field(description="fixed cost of one iteration, seconds")
    prefill_token_s: float = Field(description="per prompt token computed, seconds")
    prefill_attn_pair_s: float = Field(0.0, description="per causal (query, key) pair of prompt attention, seconds")
    prefill_seq_s: float = Field(0.0, description="per prompt finished in the iteration (its sampled token), seconds")
    decode_row_s: float = Field(description="per request generating a token, seconds")
    decode_context_s: float = Field(0.0, description="per KV token a decode row attends to, seconds")
    loop_overhead_s: float = Field(
        0.0, ge=0, description="scheduling between iterations, outside the engine's step timer, seconds"
    )
    r2: float | None = Field(None, description="coefficient of determination of the fit on its samples")
    mae_s: float | None = Field(None, description="mean absolute residual of the fit, seconds")
    samples: int = Field(0, ge=0, description="iterations the fit was made on")

    def step_s(self, f: StepFeatures, *, with_overhead: bool = True) -> float:
        """Predicted time of one iteration with these features (never negative)."""
        t = (
            self.base_s
            + self.prefill_token_s * f.prefill_tokens
            + self.prefill_attn_pair_s * f.prefill_attn_pairs
            + self.prefill_seq_s * f.prefill_seqs
            + self.decode_row_s * f.decode_rows
            + self.decode_context_s * f.decode_context_tokens
        )
        return max(0.0, t) + (self.loop_overhead_s if with_overhead else 0.0)

    def decode_step_s(self, batch: int, context_tokens: float, *, with_overhead: bool = True) -> float:
        """A decode-only iteration of `batch` requests, each attending to `context_tokens`."""
        f = StepFeatures(decode_rows=batch, decode_context_tokens=batch * context_tokens)
        return self.step_s(f, with_overhead=with_overhead)

    def prefill_step_s(self, prompt_tokens: int, batch: int = 1, *, with_overhead: bool = True) -> float:
        """A prefill-only iteration of `batch` whole prompts of `prompt_tokens` each."""
        n = prompt_tokens
        f = StepFeatures(prefill_tokens=batch * n, prefill_attn_pairs=batch * n * (n + 1) / 2, prefill_seqs=batch)
        return self.step_s(f, with_overhead=with_overhead)


class Saturation(BaseModel):
    """Decode throughput of one engine kept at its batch limit by decode-heavy requests."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    decode_tps: float = Field(gt=0, description="generated tokens per second over the measured window")
    batch_size: int = Field(ge=1, description="requests kept in flight (the engine's max_batch_size)")
    mean_running: float = Field(description="mean requests per iteration over the window")
    prompt_tokens: int = Field(ge=1, description="prompt length of every request")
    output_tokens: tuple[int, int] = Field(description="output lengths drawn uniformly from [low, high]")
    window_s: float = Field(gt=0, description="length of the measured window, seconds")
    generated_tokens: int = Field(ge=1, description="tokens generated in the window")
    steps: int = Field(ge=0, description="iterations that ended in the window")
    prefill_token_share: float = Field(description="prompt tokens / all tokens computed in the window")
    mean_context_tokens: float = Field(0.0, description="mean KV tokens a decode row attended to in the window")
    predicted_decode_tps: float | None = Field(
        None,
        description="tokens sampled in the window's iterations / their time predicted by step_time (overhead "
        "included): the fit's cross-check on iterations it was not fitted on",
    )


class Recommendation(BaseModel):
    """The HeteroScale parameter this profile recommends, with the rule that produced it."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    target_decode_tps_per_instance: float = Field(gt=0)
    fraction_of_saturation: float = Field(TARGET_FRACTION, gt=0, le=1)
    rule: str = "target_decode_tps_per_instance = fraction_of_saturation * saturation.decode_tps"


class WorkerProfile(BaseModel):
    """One engine configuration on one model and device. Keys are documented by field."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    schema_version: int = Field(PROFILE_SCHEMA_VERSION, description="bumped when a key changes meaning")
    model: str = Field(description="model name (checkpoint directory or preset)")
    source: Literal["measured", "published"] = Field(description="measured on this engine, or taken from a paper")
    source_ref: str = Field("", description="how it was made: the command, or the publication cited")
    device: str = Field(description="e.g. 'cpu (2 cores, torch 2.x)' or 'NVIDIA H100 80GB'")
    dtype: str = Field(description="weights, KV cache and compute dtype")
    engine: dict[str, object] = Field(description="the EngineConfig the engine ran with")
    emulated_step_time: dict[str, float] | None = Field(
        None, description="pacing (a + b * batch tokens) the engine emulated, if any: the fit should recover it"
    )
    step_time: StepTimeModel
    saturation: Saturation
    recommended: Recommendation
    created: str = Field("", description="ISO 8601 time of the run")
    quick: bool = Field(False, description="made with --quick (fewer samples)")


def load_profile(path: str | Path) -> WorkerProfile:
    """Read a profile file; ValueError quoting the path (and the problem) if it is not one."""
    file = Path(path)
    try:
        raw = json.loads(file.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise ValueError(f"worker profile {str(file)!r} not found (make one with python -m bench.profile)") from None
    except (OSError, json.JSONDecodeError) as exc:
        raise ValueError(f"worker profile {str(file)!r} is not readable JSON: {exc}") from exc
    try:
        return WorkerProfile.model_validate(raw)
    except ValidationError as exc:
        problems = "; ".join(f"{'.'.join(map(str, e['loc']))}: {e['msg']}" for e in exc.errors())
        raise ValueError(f"worker profile {str(file)!r} is not a valid profile: {problems}") from exc
