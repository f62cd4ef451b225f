"""Typed, validated configuration of a Llama-family decoder, read from and written to HF `config.json`.

The worker, the parameter manager and the synthetic-checkpoint writer all agree on shapes through
this one object, so every check on a checkpoint's geometry lives here. Three HF architectures
share this decoder: Llama (`llama`), Qwen2 (`qwen2`: biases on the Q/K/V projections, optional
sliding-window layers) and Mistral (`mistral`: sliding-window attention in every layer). RoPE may
be scaled the ways transformers implements for them: `linear`, `dynamic` (NTK), `yarn`, `llama3`.
"""

from __future__ import annotations

import dataclasses
import math
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

# model_type -> the one HF class name a checkpoint of it may declare in `architectures`.
ARCHITECTURES: dict[str, str] = {
    "llama": "LlamaForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "mistral": "MistralForCausalLM",
}

# transformers' defaults per model type for keys a config.json may leave out (its *Config classes).
_DEFAULTS: dict[str, dict[str, Any]] = {
    "llama": {"max_position_embeddings": 2048, "bos_token_id": 1, "eos_token_id": 2},
    "qwen2": {"max_position_embeddings": 32768, "bos_token_id": None, "eos_token_id": None},
    "mistral": {"max_position_embeddings": 4096 * 32, "bos_token_id": 1, "eos_token_id": 2},
}

ROPE_TYPES = ("default", "linear", "dynamic", "yarn", "llama3")
FULL_ATTENTION = "full_attention"
SLIDING_ATTENTION = "sliding_attention"

# RoPE parameter keys Blitzmesh reads, per type (the others transformers ignores too, with a
# warning); `partial_rotary_factor` and `mrope_section` change the computation and are refused.
_ROPE_KEYS: dict[str, tuple[str, ...]] = {
    "default": (),
    "linear": ("factor",),
    "dynamic": ("factor",),
    "yarn": (
        "factor",
        "original_max_position_embeddings",
        "attention_factor",
        "beta_fast",
        "beta_slow",
        "mscale",
        "mscale_all_dim",
        "truncate",
    ),
    "llama3": ("factor", "original_max_position_embeddings", "low_freq_factor", "high_freq_factor"),
}


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


@dataclass(frozen=True)
class RopeScaling:
    """A scaled RoPE (anything but `default`), with transformers' parameter names and meaning.

    `linear`: frequencies divided by `factor`. `dynamic`: NTK-aware base that grows with the
    sequence past `max_position_embeddings`. `yarn`: per-frequency blend of interpolation and
    extrapolation plus an attention factor on cos/sin. `llama3`: Llama 3.1's smoothed band
    scaling. `original_max_position_embeddings` is the pretraining context (yarn, llama3).
    """

    rope_type: str
    factor: float | None = None
    original_max_position_embeddings: int | None = None
    low_freq_factor: float | None = None
    high_freq_factor: float | None = None
    attention_factor: float | None = None
    beta_fast: float | None = None
    beta_slow: float | None = None
    mscale: float | None = None
    mscale_all_dim: float | None = None
    truncate: bool | None = None

    def __post_init__(self) -> None:
        if self.rope_type not in ROPE_TYPES or self.rope_type == "default":
            raise ValueError(f"rope type {self.rope_type!r} is not supported (supported: {', '.join(ROPE_TYPES)})")
        allowed = set(_ROPE_KEYS[self.rope_type])
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if f.name == "rope_type" or value is None:
                continue
            if f.name not in allowed:
                raise ValueError(f"rope parameter {f.name}={value!r} does not apply to rope type {self.rope_type!r}")
            if f.name == "truncate":
                if not isinstance(value, bool):
                    raise ValueError(f"rope parameter truncate must be a bool, got {value!r}")
            elif f.name == "original_max_position_embeddings":
                if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                    raise ValueError(
                        f"rope parameter original_max_position_embeddings must be a positive int, got {value!r}"
                    )
            elif not _is_number(value):
                raise ValueError(f"rope parameter {f.name} must be a number, got {value!r}")
        required = {
            "linear": ("factor",),
            "dynamic": ("factor",),
            # yarn's factor may be absent: max_position_embeddings / original_max_position_embeddings.
            "yarn": ("original_max_position_embeddings",),
            "llama3": ("factor", "original_max_position_embeddings", "low_freq_factor", "high_freq_factor"),
        }[self.rope_type]
        missing = [name for name in required if getattr(self, name) is None]
        if missing:
            raise ValueError(f"rope type {self.rope_type!r} needs {', '.join(missing)}")
        if self.factor is not None and not self.factor > 0:
            raise ValueError(f"rope factor must be > 0, got {self.factor!r}")
        if self.rope_type == "llama3":
            assert self.low_freq_factor is not None and self.high_freq_factor is not None
            if not self.high_freq_factor > self.low_freq_factor > 0:
                raise ValueError(
                    "llama3 rope needs high_freq_factor > low_freq_factor > 0, got "
                    f"low_freq_factor={self.low_freq_factor!r} high_freq_factor={self.high_freq_factor!r}"
                )
        if self.attention_factor is not None and not self.attention_factor > 0:
            raise ValueError(f"rope attention_factor must be > 0, got {self.attention_factor!r}")

    def parameters(self) -> dict[str, Any]:
        """The parameters that are set, under transformers' names (without rope_type)."""
        return {
            f.name: getattr(self, f.name)
            for f in dataclasses.fields(self)
            if f.name != "rope_type" and getattr(self, f.name) is not None
        }


@dataclass(frozen=True)
class LlamaConfig:
    """Geometry and numerics of a Llama-family model (HF `LlamaForCausalLM` semantics, plus the
    Qwen2 and Mistral differences: projection biases, sliding-window layers)."""

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
    model_type: str = "llama"
    # Biases: on Q/K/V (Qwen2; Llama with attention_bias), on O (Llama with attention_bias), on
    # the three MLP projections (Llama with mlp_bias).
    qkv_bias: bool = False
    o_bias: bool = False
    mlp_bias: bool = False
    rope_scaling: RopeScaling | None = None
    # Keys a windowed layer attends to, the query's own included (transformers: key k is visible
    # to query q when q - sliding_window < k <= q). None: no layer is windowed.
    sliding_window: int | None = None
    # Per layer `full_attention` or `sliding_attention` (Qwen2); None: every layer is windowed
    # when sliding_window is set (Mistral).
    layer_types: tuple[str, ...] | None = None

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
            if not isinstance(value, int) or isinstance(value, bool) or not 0 <= value < self.vocab_size:
                raise ValueError(f"LlamaConfig.{name} must be in [0, vocab_size={self.vocab_size}), got {value!r}")
        if self.torch_dtype not in _DTYPES:
            raise ValueError(f"LlamaConfig.torch_dtype must be one of {sorted(_DTYPES)}, got {self.torch_dtype!r}")
        if self.model_type not in ARCHITECTURES:
            raise ValueError(f"LlamaConfig.model_type must be one of {sorted(ARCHITECTURES)}, got {self.model_type!r}")
        biases = (self.qkv_bias, self.o_bias, self.mlp_bias)
        allowed_biases = {
            # Llama's attention_bias puts a bias on all four attention projections.
            "llama": {(False, False, False), (True, True, False), (False, False, True), (True, True, True)},
            "qwen2": {(True, False, False)},
            "mistral": {(False, False, False)},
        }[self.model_type]
        if biases not in allowed_biases:
            raise ValueError(
                f"LlamaConfig biases qkv_bias={self.qkv_bias} o_bias={self.o_bias} mlp_bias={self.mlp_bias} "
                f"do not exist in a {self.model_type!r} model"
            )
        if self.sliding_window is not None:
            if not isinstance(self.sliding_window, int) or isinstance(self.sliding_window, bool):
                raise ValueError(f"LlamaConfig.sliding_window must be a positive int, got {self.sliding_window!r}")
            if self.sliding_window <= 0:
                raise ValueError(f"LlamaConfig.sliding_window must be a positive int, got {self.sliding_window!r}")
            if self.model_type == "llama":
                raise ValueError(f"a 'llama' model has no sliding window, got sliding_window={self.sliding_window}")
        if self.layer_types is not None:
            if self.model_type != "qwen2":
                raise ValueError(f"per-layer layer_types are a 'qwen2' feature, got them for {self.model_type!r}")
            if len(self.layer_types) != self.num_hidden_layers:
                raise ValueError(
                    f"LlamaConfig.layer_types has {len(self.layer_types)} entries for "
                    f"{self.num_hidden_layers} layers: {list(self.layer_types)!r}"
                )
            bad = [t for t in self.layer_types if t not in (FULL_ATTENTION, SLIDING_ATTENTION)]
            if bad:
                raise ValueError(
                    f"LlamaConfig.layer_types entries must be {FULL_ATTENTION!r} or {SLIDING_ATTENTION!r}, "
                    f"got {bad[0]!r}"
                )
            if SLIDING_ATTENTION in self.layer_types and self.sliding_window is None:
                raise ValueError(
                    "LlamaConfig.layer_types has 'sliding_attention' layers but no sliding_window is set "
                    "(use_sliding_window is off)"
                )

    # ---- derived quantities -------------------------------------------------------------------

    @property
    def dtype(self) -> torch.dtype:
        """The torch dtype named by `torch_dtype`."""
        return _DTYPES[self.torch_dtype]

    @property
    def num_query_groups(self) -> int:
        """Query heads that share one KV head (1 means plain multi-head attention)."""
        return self.num_attention_heads // self.num_key_value_heads

    @property
    def architecture(self) -> str:
        """The HF class name (`LlamaForCausalLM`, `Qwen2ForCausalLM`, `MistralForCausalLM`)."""
        return ARCHITECTURES[self.model_type]

    @property
    def rope_type(self) -> str:
        return "default" if self.rope_scaling is None else self.rope_scaling.rope_type

    @property
    def max_context_tokens(self) -> int:
        """Longest sequence (prompt + output) the model is served for.

        `max_position_embeddings`, except for dynamic NTK RoPE, whose config states the original
        context and whose base grows past it: `factor` times that, the context the scaling was
        made for.
        """
        scaling = self.rope_scaling
        if scaling is not None and scaling.rope_type == "dynamic":
            assert scaling.factor is not None
            return max(self.max_position_embeddings, int(self.max_position_embeddings * scaling.factor))
        return self.max_position_embeddings

    def attention_window(self, layer: int) -> int | None:
        """The sliding window of decoder layer `layer` (None: it attends to the whole context)."""
        if self.sliding_window is None:
            return None
        if self.layer_types is not None and self.layer_types[layer] != SLIDING_ATTENTION:
            return None
        return self.sliding_window

    @property
    def has_sliding_window(self) -> bool:
        return any(self.attention_window(i) is not None for i in range(self.num_hidden_layers))

    def num_parameters(self) -> int:
        """Number of weights in a checkpoint of this geometry (tied embeddings counted once)."""
        h, kv = self.hidden_size, self.num_key_value_heads * self.head_dim
        q = self.num_attention_heads * self.head_dim
        inter = self.intermediate_size
        per_layer = h * q + 2 * h * kv + q * h + 3 * h * inter + 2 * h
        per_layer += (q + 2 * kv) * self.qkv_bias + h * self.o_bias + (2 * inter + h) * self.mlp_bias
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
        """Build from a parsed HF `config.json` (transformers 4.x or 5.x layout), refusing features
        this decoder does not implement, by name."""
        model_type = d.get("model_type", "llama")
        if model_type not in ARCHITECTURES:
            raise ValueError(
                f"config.json model_type {model_type!r} is not supported (supported: {', '.join(ARCHITECTURES)})"
            )
        archs = d.get("architectures")
        if archs is not None and list(archs) != [ARCHITECTURES[model_type]]:
            raise ValueError(
                f"config.json architectures {archs!r} is not supported for model_type {model_type!r} "
                f"(expected [{ARCHITECTURES[model_type]!r}])"
            )
        quant = d.get("quantization_config")
        if quant:
            method = quant.get("quant_method", "?") if isinstance(quant, Mapping) else quant
            raise ValueError(f"config.json quantization_config (quant_method={method!r}) is not supported")
        defaults = _DEFAULTS[model_type]
        act = d.get("hidden_act", "silu")
        if act != "silu":
            raise ValueError(f"config.json hidden_act must be 'silu', got {act!r}")
        if d.get("pretraining_tp", 1) not in (1, None):
            raise ValueError(f"config.json pretraining_tp={d['pretraining_tp']!r} is not supported")
        if model_type == "llama":
            attention_bias = bool(d.get("attention_bias", False))
            qkv_bias, o_bias, mlp_bias = attention_bias, attention_bias, bool(d.get("mlp_bias", False))
        else:
            # Qwen2 hard-wires biases on Q/K/V and none elsewhere, Mistral has none; transformers
            # ignores these flags for them, so a checkpoint that sets them is not what it says.
            for flag in ("attention_bias", "mlp_bias"):
                if d.get(flag, False):
                    raise ValueError(f"config.json {flag}={d[flag]!r} is not supported for model_type {model_type!r}")
            qkv_bias, o_bias, mlp_bias = model_type == "qwen2", False, False

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
        max_pos = d.get("max_position_embeddings", defaults["max_position_embeddings"])

        rope_theta, rope_scaling = _read_rope(d, max_pos)
        sliding_window, layer_types = _read_sliding(d, model_type, fields["num_hidden_layers"])

        ids: dict[str, Any] = {}
        for name in ("bos_token_id", "eos_token_id"):
            value = d.get(name, defaults[name])
            if isinstance(value, list):
                # Several EOS ids (Llama 3 style): the first is the tokenizer's; the engine can take
                # the others as stop_token_ids.
                if not value:
                    raise ValueError(f"config.json {name} is an empty list")
                value = value[0]
            if value is None:
                raise ValueError(f"config.json {name} is missing or null; Blitzmesh needs the model's {name}")
            ids[name] = value
        dtype = d.get("dtype") or d.get("torch_dtype") or "float32"
        if isinstance(dtype, torch.dtype):
            dtype = str(dtype).removeprefix("torch.")
        return cls(
            **fields,
            num_key_value_heads=d.get("num_key_value_heads") or heads,
            head_dim=head_dim,
            max_position_embeddings=max_pos,
            rms_norm_eps=float(d.get("rms_norm_eps", 1e-6)),
            rope_theta=rope_theta,
            tie_word_embeddings=bool(d.get("tie_word_embeddings", False)),
            torch_dtype=dtype,
            model_type=model_type,
            qkv_bias=qkv_bias,
            o_bias=o_bias,
            mlp_bias=mlp_bias,
            rope_scaling=rope_scaling,
            sliding_window=sliding_window,
            layer_types=layer_types,
            **ids,
        )

    def to_hf_dict(self) -> dict[str, Any]:
        """The `config.json` content; readable by transformers 4.x (rope_theta, rope_scaling,
        torch_dtype) and 5.x (rope_parameters, dtype)."""
        rope: dict[str, Any] = {"rope_type": self.rope_type, "rope_theta": self.rope_theta}
        if self.rope_scaling is not None:
            rope.update(self.rope_scaling.parameters())
        d: dict[str, Any] = {
            "architectures": [self.architecture],
            "model_type": self.model_type,
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
            "rope_parameters": rope,
        }
        if self.rope_scaling is not None:
            # transformers 4.x reads scaling from here (`type` before 4.43, `rope_type` after).
            d["rope_scaling"] = {"rope_type": self.rope_type, "type": self.rope_type, **self.rope_scaling.parameters()}
        if self.model_type == "llama":
            d["attention_bias"] = self.qkv_bias
            d["mlp_bias"] = self.mlp_bias
        elif self.model_type == "qwen2":
            types = self.layer_types or (FULL_ATTENTION,) * self.num_hidden_layers
            first_sliding = types.index(SLIDING_ATTENTION) if SLIDING_ATTENTION in types else self.num_hidden_layers
            d["use_sliding_window"] = self.sliding_window is not None
            d["sliding_window"] = self.sliding_window
            # transformers 4.x derives the layer kinds from this (windowed from this layer on).
            d["max_window_layers"] = first_sliding
            d["layer_types"] = list(types)
        else:
            d["sliding_window"] = self.sliding_window
        d.update(
            {
                "tie_word_embeddings": self.tie_word_embeddings,
                "bos_token_id": self.bos_token_id,
                "eos_token_id": self.eos_token_id,
                "torch_dtype": self.torch_dtype,
                "dtype": self.torch_dtype,
                "use_cache": True,
            }
        )
        return d


def _read_rope(d: Mapping[str, Any], max_position_embeddings: Any) -> tuple[float, RopeScaling | None]:
    """rope_theta and the scaling of a config.json, with transformers 5's precedence: a 4.x
    `rope_scaling` dict wins over `rope_parameters`; keys it lacks come from the top level."""
    src = d.get("rope_scaling") or d.get("rope_parameters") or {}
    if not isinstance(src, Mapping):
        raise ValueError(f"config.json rope parameters must be an object, got {src!r}")
    rope_type = src.get("rope_type") or src.get("type") or "default"
    if rope_type not in ROPE_TYPES:
        # Names the layout transformers would nest per layer type (Gemma-style) too.
        raise ValueError(f"config.json rope type {rope_type!r} is not supported (supported: {', '.join(ROPE_TYPES)})")
    partial = src.get("partial_rotary_factor", d.get("partial_rotary_factor", 1.0))
    if partial not in (1, 1.0, None):
        raise ValueError(f"config.json partial_rotary_factor={partial!r} is not supported (only 1.0)")
    if src.get("mrope_section") is not None:
        raise ValueError(f"config.json mrope_section={src['mrope_section']!r} is not supported")
    theta = src.get("rope_theta")
    if theta is None:
        theta = d.get("rope_theta", 10000.0)
    if not _is_number(theta):
        raise ValueError(f"config.json rope_theta must be a number, got {theta!r}")
    if rope_type == "default":
        return float(theta), None
    params = {key: src[key] for key in _ROPE_KEYS[rope_type] if src.get(key) is not None}
    if rope_type in ("yarn", "llama3"):
        # transformers: a top-level original_max_position_embeddings wins (Phi-3 style), then the
        # rope dict's, then max_position_embeddings.
        top = d.get("original_max_position_embeddings")
        params["original_max_position_embeddings"] = (
            top if top is not None else params.get("original_max_position_embeddings", max_position_embeddings)
        )
    for key in ("factor", "low_freq_factor", "high_freq_factor", "attention_factor", "beta_fast", "beta_slow"):
        if key in params and _is_number(params[key]):
            params[key] = float(params[key])
    try:
        return float(theta), RopeScaling(rope_type=rope_type, **params)
    except ValueError as exc:
        raise ValueError(f"config.json {exc}") from None


def _read_sliding(d: Mapping[str, Any], model_type: str, num_layers: Any) -> tuple[int | None, tuple[str, ...] | None]:
    """(sliding_window, layer_types) as transformers resolves them for the model type."""
    if model_type == "llama":
        return None, None  # LlamaConfig has no sliding window; transformers ignores the key
    if model_type == "mistral":
        if d.get("layer_types") is not None and len(set(d["layer_types"])) > 1:
            raise ValueError(
                f"config.json layer_types {d['layer_types']!r} (alternating attention) is not supported for "
                "'mistral' (transformers' Mistral ignores it; that is the 'ministral' architecture)"
            )
        # MistralConfig's default is 4096 when the key is absent; null turns it off.
        return d.get("sliding_window", 4096), None
    # qwen2: the window only exists with use_sliding_window; layers from max_window_layers on use it
    # unless layer_types says which.
    window = d.get("sliding_window", 4096) if d.get("use_sliding_window", False) else None
    given = d.get("layer_types")
    if given is not None:
        types = tuple(given)
    elif window is not None and isinstance(num_layers, int):
        first = d.get("max_window_layers", 28)
        types = tuple(SLIDING_ATTENTION if i >= first else FULL_ATTENTION for i in range(num_layers))
    else:
        return window, None
    if window is None and SLIDING_ATTENTION not in types:
        return None, None
    return window, types
