"""Step-time models of simulated workers: this project's measured profile, and published-spec
estimates for an 8B-class model on A100 and H100 and a 70B-class one on 8 H100s, for the paper-scale runs.

PUBLISHED_PROFILES are ESTIMATES, not fits to published step-time measurements: no such
coefficients were available to this project, so each term is a roofline from public spec sheets with an
assumed efficiency, and the derivation is written next to it. The model is Llama-3-8B
(Meta's config.json: 8.03e9 parameters, 32 layers, hidden 4096, 8 KV heads x head_dim 128,
vocabulary 128,256) in bf16: 16.06 GB of weights, 2 x 32 x 8 x 128 x 2 B = 131,072 B of KV per
token. Devices (NVIDIA data sheets): H100 SXM5 80GB, 3.35 TB/s HBM3, 989 TFLOPS dense BF16;
A100 SXM4 80GB, 2.039 TB/s HBM2e, 312 TFLOPS dense BF16. Assumed: 70% of peak memory
bandwidth, 50% of peak FLOPS (typical of vLLM-class engines; our assumption, not a citation).
- base_s: the weights are read once per iteration: 16.06e9 B / (BW x 0.7).
- prefill_token_s = decode_row_s: 2 x 8.03e9 FLOP per token / (FLOPS x 0.5).
- prefill_attn_pair_s: 4 x hidden x layers = 524,288 FLOP per causal (q, k) pair / (FLOPS x 0.5).
- prefill_seq_s: the LM head, 2 x 4096 x 128,256 FLOP / (FLOPS x 0.5).
- decode_context_s: a decode row reads 131,072 B of KV per context token / (BW x 0.7).
- loop_overhead_s: 0.5 ms of scheduling per iteration (assumed).
The 70B-class entry (`h100x8-llama3-70b`, for the paper-scale runs) is the same roofline for
Llama-3-70B (Meta's config.json: 70.55e9 parameters, 80 layers, hidden 8192, 8 KV heads x
head_dim 128, vocabulary 128,256; 141.1 GB of bf16 weights, 2 x 80 x 8 x 128 x 2 B = 327,680 B
of KV per token) served with tensor parallelism 8 on one host of 8 H100s: the bandwidth and
FLOPS of the 8 GPUs, times a further 80% for the two all-reduces per layer (assumed, not
measured), and KV blocks from 8 x 80 GB x 0.9 less the weights.
The LoongServe entry (`a100-lwm-1m`) is the model LoongServe (SOSP'24) evaluated, LWM-Text-1M:
Llama-2-7B's architecture (6.74e9 parameters, 32 layers, hidden 4096, 32 attention heads and no
KV-head field, so multi-head attention: 32 KV heads x head_dim 128, vocabulary 32,000) trained to
a 1,048,576-token context; 13.48 GB of bf16 weights and 2 x 32 x 32 x 128 x 2 B = 524,288 B of
KV per token, 4x Llama-3-8B's (which shares its 32 query heads over 8 KV heads). One instance is
one A100 80GB, the same roofline.
Validating these against a real GPU run is a later slice's job.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from services.common.worker_profile import StepTimeModel, load_profile

__all__ = [
    "LWM_1M_CONTEXT",
    "PUBLISHED_PROFILES",
    "TENSOR_PARALLEL",
    "FastStep",
    "ModelSpec",
    "SimProfile",
    "kv_blocks_after_weights",
    "kv_bytes_per_token",
    "lwm_1m_a100",
    "measured_profile",
]

REPO_ROOT = Path(__file__).resolve().parents[2]


def kv_bytes_per_token(config: Mapping[str, Any], dtype_bytes: int) -> int:
    """What one token's KV weighs, from a Hugging Face `config.json`: K and V for every layer,
    2 x num_hidden_layers x num_key_value_heads x head_dim x bytes per element (head_dim,
    when absent, is hidden_size / num_attention_heads; no KV-head field means multi-head)."""
    heads = config["num_attention_heads"]
    kv_heads = config.get("num_key_value_heads") or heads
    head_dim = config.get("head_dim") or config["hidden_size"] // heads
    return 2 * config["num_hidden_layers"] * kv_heads * head_dim * dtype_bytes


# The fields of the models' config.json that size their KV (Meta's Llama-3-8B; SmolLM2-135M as
# in models/smollm2-135m-instruct/config.json, pinned by a test).
LLAMA3_8B_CONFIG = {"num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8, "hidden_size": 4096}
SMOLLM2_135M_CONFIG = {
    "num_hidden_layers": 30,
    "num_attention_heads": 9,
    "num_key_value_heads": 3,
    "head_dim": 64,
    "hidden_size": 576,
}

MEM_EFFICIENCY = 0.7
FLOP_EFFICIENCY = 0.5
TP_EFFICIENCY = 0.8  # tensor-parallel instances: what the all-reduces leave (assumed)


@dataclass(frozen=True)
class ModelSpec:
    """What a load moves and what a request's KV weighs."""

    name: str
    size_bytes: float
    num_layers: int
    kv_bytes_per_token: float

    @property
    def groups(self) -> tuple[str, ...]:
        """Parameter groups in load order: one per layer (embeddings and head folded in)."""
        return tuple(f"layer.{i:03d}" for i in range(self.num_layers))


@dataclass(frozen=True)
class SimProfile:
    device: str
    model: ModelSpec
    step: StepTimeModel
    max_batch: int
    max_num_tokens: int
    kv_blocks: int
    block_size: int
    source: str
    source_ref: str


@dataclass(frozen=True)
class _Arch:
    """A dense decoder's sizes for the roofline: parameters and the config.json fields."""

    name: str
    title: str
    params: float
    config: Mapping[str, int]
    vocab: int

    @property
    def weight_bytes(self) -> float:
        return 2 * self.params  # bf16


# LWM-Text-1M's config.json (LargeWorldModel): Llama-2-7B's sizes, multi-head attention.
LWM_1M_CONFIG = {"num_hidden_layers": 32, "num_attention_heads": 32, "hidden_size": 4096}
LWM_1M_CONTEXT = 1_048_576
LLAMA3_70B_CONFIG = {"num_hidden_layers": 80, "num_attention_heads": 64, "num_key_value_heads": 8, "hidden_size": 8192}
_LLAMA3_8B = _Arch("llama-3-8b", "Llama-3-8B", 8.03e9, LLAMA3_8B_CONFIG, 128_256)
_LLAMA3_70B = _Arch("llama-3-70b", "Llama-3-70B", 70.55e9, LLAMA3_70B_CONFIG, 128_256)
_LWM_1M = _Arch("lwm-text-1m", "LWM-Text-1M (Llama-2-7B, multi-head)", 6.74e9, LWM_1M_CONFIG, 32_000)


def kv_blocks_after_weights(device_bytes: float, arch: _Arch, block_size: int = 16, utilization: float = 0.9) -> int:
    """KV blocks one device holds once `arch`'s bf16 weights are loaded: `utilization` of its
    memory (the rest for activations and the runtime) less the weights, in blocks of
    `block_size` tokens."""
    free = device_bytes * utilization - arch.weight_bytes
    if free <= 0:
        raise ValueError(
            f"{arch.title}'s {arch.weight_bytes / 1e9:.2f} GB of weights leave no KV on {device_bytes / 1e9:.0f} GB"
        )
    return int(free // kv_bytes_per_token(arch.config, 2) // block_size)


def _roofline(
    device: str, hbm_bytes_per_s: float, flops: float, kv_blocks: int, arch: _Arch = _LLAMA3_8B, tp: int = 1
) -> SimProfile:
    """Step-time terms of `arch` on `tp` GPUs of `device` (per-GPU bandwidth and FLOPS)."""
    scale = tp * (TP_EFFICIENCY if tp > 1 else 1.0)
    bw, fl = hbm_bytes_per_s * MEM_EFFICIENCY * scale, flops * FLOP_EFFICIENCY * scale
    hidden, layers = arch.config["hidden_size"], arch.config["num_hidden_layers"]
    kv = kv_bytes_per_token(arch.config, 2)
    per_token = 2 * arch.params / fl
    step = StepTimeModel(
        base_s=arch.weight_bytes / bw,
        prefill_token_s=per_token,
        prefill_attn_pair_s=4 * hidden * layers / fl,
        prefill_seq_s=2 * hidden * arch.vocab / fl,  # the LM head
        decode_row_s=per_token,
        decode_context_s=kv / bw,
        loop_overhead_s=0.0005,
    )
    tp_note = f", TP={tp} at {TP_EFFICIENCY:.0%}" if tp > 1 else ""
    return SimProfile(
        device=device,
        model=ModelSpec(arch.name, arch.weight_bytes, layers, kv),
        step=step,
        max_batch=128,
        max_num_tokens=8192,
        kv_blocks=kv_blocks,
        block_size=16,
        source="published",
        source_ref=f"ESTIMATE: roofline from NVIDIA data sheets and {arch.title} config.json{tp_note} "
        "(bench/simulate/profiles.py)",
    )


def lwm_1m_a100(tp: int = 1) -> SimProfile:
    """LWM-Text-1M served by one instance over `tp` A100 80GB with tensor parallelism: the same
    roofline with `tp` GPUs' bandwidth and FLOPS (times `TP_EFFICIENCY`), and the KV blocks of
    all `tp` devices' memory less one copy of the weights (tp=1 is `a100-lwm-1m`)."""
    if tp < 1:
        raise ValueError(f"tp must be >= 1, got {tp!r}")
    device = "NVIDIA A100 SXM4 80GB" if tp == 1 else f"{tp}x NVIDIA A100 SXM4 80GB (TP={tp})"
    return _roofline(device, 2.039e12, 312e12, kv_blocks_after_weights(tp * 80e9, _LWM_1M), _LWM_1M, tp=tp)


# KV blocks of 16 tokens: (80 GB x 0.9 - 16.06 GB weights) / 131,072 B per token / 16 ~ 26,700;
# 70B on 8 GPUs: (8 x 80 GB x 0.9 - 141.1 GB) / 327,680 B per token / 16 ~ 82,900.
# LWM-Text-1M on one A100 80GB: (72 GB - 13.48 GB) / 524,288 B per token / 16 = 6,976 blocks,
# 111,616 tokens (LoongServe's own launcher gives a one-GPU instance of it 110,000 tokens).
PUBLISHED_PROFILES: dict[str, SimProfile] = {
    "h100-llama3-8b": _roofline("NVIDIA H100 SXM5 80GB", 3.35e12, 989e12, 26_000),
    "a100-llama3-8b": _roofline("NVIDIA A100 SXM4 80GB", 2.039e12, 312e12, 26_000),
    "h100x8-llama3-70b": _roofline("8x NVIDIA H100 SXM5 80GB (TP=8)", 3.35e12, 989e12, 82_000, _LLAMA3_70B, tp=8),
    "a100-lwm-1m": lwm_1m_a100(),
}


# Profiles that can also be built for an instance spanning several GPUs (tensor parallelism).
TENSOR_PARALLEL: dict[str, Callable[[int], SimProfile]] = {"a100-lwm-1m": lwm_1m_a100}


def measured_profile(path: str | Path = REPO_ROOT / "profiles" / "smollm2-135m-instruct.json") -> SimProfile:
    """This project's engine on this CPU (`python -m bench.profile`): SmolLM2-135M in float32,
    30 layers, 538 MB; KV per token 2 x 30 layers x 3 KV heads x 64 x 4 B."""
    p = load_profile(path)
    engine = p.engine
    model = ModelSpec(p.model, 538e6, 30, kv_bytes_per_token(SMOLLM2_135M_CONFIG, 4))
    return SimProfile(
        device=p.device,
        model=model,
        step=p.step_time,
        max_batch=int(engine.get("max_batch_size", 32)),  # type: ignore[call-overload]
        max_num_tokens=int(engine.get("max_num_tokens", 1024)),  # type: ignore[call-overload]
        kv_blocks=int(engine.get("num_kv_blocks", 2048)),  # type: ignore[call-overload]
        block_size=int(engine.get("block_size", 16)),  # type: ignore[call-overload]
        source=p.source,
        source_ref=f"{Path(path).name}: {p.source_ref}",
    )


class FastStep:
    """`StepTimeModel.step_s` without building a pydantic `StepFeatures` per iteration (the
    simulator runs hundreds of thousands); the same formula, pinned by a unit test."""

    __slots__ = ("base", "ctx", "overhead", "pair", "ptok", "row", "seq")

    def __init__(self, m: StepTimeModel) -> None:
        self.base, self.ptok, self.pair = m.base_s, m.prefill_token_s, m.prefill_attn_pair_s
        self.seq, self.row, self.ctx = m.prefill_seq_s, m.decode_row_s, m.decode_context_s
        self.overhead = m.loop_overhead_s

    def __call__(self, ptok: float, pairs: float, seqs: float, rows: float, ctx: float) -> float:
        t = self.base + self.ptok * ptok + self.pair * pairs + self.seq * seqs + self.row * rows + self.ctx * ctx
        return max(0.0, t) + self.overhead


def decode_capacity(profile: SimProfile, prompt_tokens: float, output_tokens: float, batch: int) -> float:
    """Requests/s one colocated instance sustains at `batch` running, all its time spent on them:
    each request's prefill plus its decode rows at that batch (mean context: prompt + half the
    output). The sizing rule for targets and fixed pools."""
    step = FastStep(profile.step)
    ctx = prompt_tokens + output_tokens / 2
    decode_step = step(0, 0, 0, batch, batch * ctx)
    per_request_s = step(prompt_tokens, prompt_tokens * (prompt_tokens + 1) / 2, 1, 0, 0) - step.base
    per_request_s += max(0.0, output_tokens - 1) * decode_step / batch
    return 1.0 / per_request_s if per_request_s > 0 else math.inf
