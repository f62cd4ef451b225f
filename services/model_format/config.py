"""Typed, validated configuration of a Llama-family decoder, read from and written to HF `config.json`.

The worker, the parameter manager and the synthetic-checkpoint writer all agree on shapes through
this one object, so every check on a checkpoint's geometry lives here.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch

# Names accepted in `torch_dtype` / `dtype`, mapped to torch dtypes. Anything else is refused
# rather than silently served in a different precision.
_DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
}


@dataclass(frozen=True)
class LlamaConfig:
    """Geometry and numerics of a Llama-family model (HF `LlamaForCausalLM` semantics)."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    max_position_embeddings: int = 2048
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    tie_word_embeddings: bool = False
    bos_token_id: int = 1
    eos_token_id: int = 2
    torch_dtype: str = "float32"

    def __post_init__(self) -> None:
        for name in (
            "vocab_size",
            "hidden_size",
            "intermediate_size",
            "num_hidden_layers",
            "num_attention_heads",
            "num_key_value_heads",
            "head_dim",
            "max_position_embeddings",
        ):
            value = getattr(self, name)
            # bool is an int subclass; `True` layers is a config bug, not one layer.
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ValueError(f"LlamaConfig.{name} must be a positive int, got {value!r}")
        if self.num_attention_heads % self.num_key_value_heads != 0:
            raise ValueError(
                "LlamaConfig.num_attention_heads must be a multiple of num_key_value_heads, got "
                f"num_attention_heads={self.num_attention_heads} "
                f"num_key_value_heads={self.num_key_value_heads}"
            )
        if self.head_dim % 2 != 0:
            # Rotary embeddings rotate pairs of channels.
            raise ValueError(f"LlamaConfig.head_dim must be even for RoPE, got {self.head_dim}")
        if not self.rms_norm_eps > 0:
            raise ValueError(f"LlamaConfig.rms_norm_eps must be > 0, got {self.rms_norm_eps!r}")
        if not self.rope_theta > 0:
            raise ValueError(f"LlamaConfig.rope_theta must be > 0, got {self.rope_theta!r}")
        for name in ("bos_token_id", "eos_token_id"):
            value = getattr(self, name)
            if not isinstance(value, int) or not 0 <= value < self.vocab_size:
                raise ValueError(f"LlamaConfig.{name} must be in [0, vocab_size={self.vocab_size}), got {value!r}")
        if self.torch_dtype not in _DTYPES:
            raise ValueError(f"LlamaConfig.torch_dtype must be one of {sorted(_DTYPES)}, got {self.torch_dtype!r}")

    # ---- derived quantities -------------------------------------------------------------------

    @property
    def dtype(self) -> torch.dtype:
        """The torch dtype named by `torch_dtype`."""
        return _DTYPES[self.torch_dtype]

    @property
    def num_query_groups(self) -> int:
        """Query heads that share one KV head (1 means plain multi-head attention)."""
        return self.num_attention_heads // self.num_key_value_heads

    def num_parameters(self) -> int:
        """Number of weights in a checkpoint of this geometry (tied embeddings counted once)."""
        h, kv = self.hidden_size, self.num_key_value_heads * self.head_dim
        q = self.num_attention_heads * self.head_dim
        per_layer = h * q + 2 * h * kv + q * h + 3 * h * self.intermediate_size + 2 * h
        embed = self.vocab_size * h
        head = h + (0 if self.tie_word_embeddings else embed)
        return embed + self.num_hidden_layers * per_layer + head

    def kv_bytes_per_token(self, dtype: torch.dtype | None = None) -> int:
        """KV-cache bytes one token occupies across all layers (K and V)."""
        elem = torch.empty((), dtype=dtype or self.dtype).element_size()
        return 2 * self.num_hidden_layers * self.num_key_value_heads * self.head_dim * elem

    def replace(self, **changes: Any) -> LlamaConfig:
        """A copy with some fields changed (validated again)."""
        return dataclasses.replace(self, **changes)

    # ---- HF config.json -----------------------------------------------------------------------

    @classmethod
    def from_hf_dict(cls, d: Mapping[str, Any]) -> LlamaConfig:
        """Build from a parsed HF `config.json`, refusing features this decoder does not implement."""
        model_type = d.get("model_type", "llama")
        if model_type != "llama":
            raise ValueError(f"config.json model_type must be 'llama', got {model_type!r}")
        act = d.get("hidden_act", "silu")
        if act != "silu":
            raise ValueError(f"config.json hidden_act must be 'silu', got {act!r}")
        for flag in ("attention_bias", "mlp_bias"):
            if d.get(flag, False):
                raise ValueError(f"config.json {flag}={d[flag]!r} is not supported (biases)")
        if d.get("pretraining_tp", 1) not in (1, None):
            raise ValueError(f"config.json pretraining_tp={d['pretraining_tp']!r} is not supported")

        # transformers 5 nests rope settings in `rope_parameters`; 4.x used `rope_theta` and
        # `rope_scaling`. Scaled variants (llama3, yarn, ...) change the frequencies, so refuse them
        # rather than serve subtly wrong logits.
        rope = d.get("rope_parameters") or {}
        scaling = d.get("rope_scaling") or {}
        rope_type = rope.get("rope_type") or scaling.get("rope_type") or scaling.get("type") or "default"
        if rope_type != "default":
            raise ValueError(f"config.json rope type {rope_type!r} is not supported (only 'default')")
        rope_theta = rope.get("rope_theta", d.get("rope_theta", 10000.0))

        try:
            hidden = d["hidden_size"]
            heads = d["num_attention_heads"]
            fields: dict[str, Any] = {
                "vocab_size": d["vocab_size"],
                "hidden_size": hidden,
                "intermediate_size": d["intermediate_size"],
                "num_hidden_layers": d["num_hidden_layers"],
                "num_attention_heads": heads,
            }
        except KeyError as exc:
            raise ValueError(f"config.json lacks required key {exc.args[0]!r}") from None
        head_dim = d.get("head_dim")
        if head_dim is None:
            if not isinstance(hidden, int) or not isinstance(heads, int) or heads <= 0 or hidden % heads:
                raise ValueError(
                    "config.json hidden_size must be divisible by num_attention_heads when head_dim "
                    f"is absent, got hidden_size={hidden!r} num_attention_heads={heads!r}"
                )
            head_dim = hidden // heads

        eos = d.get("eos_token_id", 2)
        if isinstance(eos, list):
            # Several EOS ids (Llama 3 style): the first is the tokenizer's; the engine can take the
            # others as stop_token_ids.
            if not eos:
                raise ValueError("config.json eos_token_id is an empty list")
            eos = eos[0]
        dtype = d.get("dtype") or d.get("torch_dtype") or "float32"
        if isinstance(dtype, torch.dtype):
            dtype = str(dtype).removeprefix("torch.")
        return cls(
            **fields,
            num_key_value_heads=d.get("num_key_value_heads") or heads,
            head_dim=head_dim,
            max_position_embeddings=d.get("max_position_embeddings", 2048),
            rms_norm_eps=float(d.get("rms_norm_eps", 1e-6)),
            rope_theta=float(rope_theta),
            tie_word_embeddings=bool(d.get("tie_word_embeddings", False)),
            bos_token_id=d.get("bos_token_id", 1),
            eos_token_id=eos,
            torch_dtype=dtype,
        )

    def to_hf_dict(self) -> dict[str, Any]:
        """The `config.json` content; readable by transformers 4.x (rope_theta, torch_dtype) and 5.x."""
        return {
            "architectures": ["LlamaForCausalLM"],
            "model_type": "llama",
            "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.num_hidden_layers,
            "num_attention_heads": self.num_attention_heads,
            "num_key_value_heads": self.num_key_value_heads,
            "head_dim": self.head_dim,
            "hidden_act": "silu",
            "max_position_embeddings": self.max_position_embeddings,
            "rms_norm_eps": self.rms_norm_eps,
            "rope_theta": self.rope_theta,
            "rope_parameters": {"rope_type": "default", "rope_theta": self.rope_theta},
            "attention_bias": False,
            "mlp_bias": False,
            "tie_word_embeddings": self.tie_word_embeddings,
            "bos_token_id": self.bos_token_id,
            "eos_token_id": self.eos_token_id,
            "torch_dtype": self.torch_dtype,
            "dtype": self.torch_dtype,
            "use_cache": True,
        }
