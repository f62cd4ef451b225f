"""Parameter groups: the unit in which weights are read, loaded into a model and sent over the data plane.

Order matters: `embed`, `layers.0` … `layers.{L-1}`, `head`. A model holding the groups up to
`layers.{k-1}` can run decoder layers [0, k), which is what ZigZag live scaling relies on. A
layer's biases (Qwen2's Q/K/V, Llama's attention_bias / mlp_bias) travel in its group.
"""

from __future__ import annotations

import re
from collections.abc import Iterable

from services.model_format.config import LlamaConfig

EMBED = "embed"
HEAD = "head"

EMBED_WEIGHT = "model.embed_tokens.weight"
NORM_WEIGHT = "model.norm.weight"
LM_HEAD_WEIGHT = "lm_head.weight"

# Per-layer weight suffixes, after `model.layers.{i}.`, in the order a layer group lists them.
LAYER_TENSORS: tuple[str, ...] = (
    "input_layernorm.weight",
    "self_attn.q_proj.weight",
    "self_attn.k_proj.weight",
    "self_attn.v_proj.weight",
    "self_attn.o_proj.weight",
    "post_attention_layernorm.weight",
    "mlp.gate_proj.weight",
    "mlp.up_proj.weight",
    "mlp.down_proj.weight",
)
QKV_BIASES: tuple[str, ...] = ("self_attn.q_proj.bias", "self_attn.k_proj.bias", "self_attn.v_proj.bias")
O_BIAS = "self_attn.o_proj.bias"
MLP_BIASES: tuple[str, ...] = ("mlp.gate_proj.bias", "mlp.up_proj.bias", "mlp.down_proj.bias")
# Every per-layer tensor some supported model may hold.
_ALL_LAYER_TENSORS = frozenset((*LAYER_TENSORS, *QKV_BIASES, O_BIAS, *MLP_BIASES))

_LAYER_RE = re.compile(r"^model\.layers\.(\d+)\.(.+)$")
_GROUP_LAYER_RE = re.compile(r"^layers\.(\d+)$")


def layer_group(index: int) -> str:
    """Group name of decoder layer `index`."""
    return f"layers.{index}"


def layer_index(group: str) -> int | None:
    """Decoder layer index of a `layers.{i}` group, None for `embed` / `head`."""
    m = _GROUP_LAYER_RE.match(group)
    return int(m.group(1)) if m else None


def param_groups(cfg: LlamaConfig) -> list[str]:
    """All groups of a model, in model order (a load streams them in `live_load_order`)."""
    return [EMBED, *(layer_group(i) for i in range(cfg.num_hidden_layers)), HEAD]


def live_load_order(groups: Iterable[str]) -> list[str]:
    """The order a load streams `groups` in: the decoder layers first, by index, then the
    embedding, then the head (any other name last, as given). A loading instance serves ZigZag
    requests from its first layer on, its partner embedding their prompts meanwhile, so the
    embedding (a fifth of the `small` model) is not in the way of the first layer."""
    rank = {EMBED: 1, HEAD: 2}

    def key(name: str) -> tuple[int, int]:
        i = layer_index(name)
        return (0, i) if i is not None else (rank.get(name, 3), 0)

    return sorted(groups, key=key)  # stable: other names keep the order given


def layer_tensors(cfg: LlamaConfig) -> tuple[str, ...]:
    """The per-layer tensor suffixes of `cfg`'s layers, in group order: weights, then biases."""
    biases = QKV_BIASES * cfg.qkv_bias + (O_BIAS,) * cfg.o_bias + MLP_BIASES * cfg.mlp_bias
    return LAYER_TENSORS + biases


def group_of(tensor_name: str) -> str:
    """The group an HF tensor name belongs to; ValueError for a name no group of any supported
    model owns (whether `cfg` has that tensor is `group_tensor_shapes`' question)."""
    if tensor_name == EMBED_WEIGHT:
        return EMBED
    if tensor_name in (NORM_WEIGHT, LM_HEAD_WEIGHT):
        return HEAD
    m = _LAYER_RE.match(tensor_name)
    if m and m.group(2) in _ALL_LAYER_TENSORS:
        return layer_group(int(m.group(1)))
    raise ValueError(f"tensor {tensor_name!r} belongs to no parameter group of a Llama-family model")


def group_tensor_shapes(cfg: LlamaConfig, group: str) -> dict[str, tuple[int, ...]]:
    """The tensors a group must contain, with their shapes (HF `[out, in]` for linear weights).

    With tied embeddings `head` holds only the final norm: the LM head reuses the embedding.
    """
    h = cfg.hidden_size
    if group == EMBED:
        return {EMBED_WEIGHT: (cfg.vocab_size, h)}
    if group == HEAD:
        shapes: dict[str, tuple[int, ...]] = {NORM_WEIGHT: (h,)}
        if not cfg.tie_word_embeddings:
            shapes[LM_HEAD_WEIGHT] = (cfg.vocab_size, h)
        return shapes
    index = layer_index(group)
    if index is None or index >= cfg.num_hidden_layers:
        raise ValueError(
            f"group {group!r} is not one of {EMBED!r}, 'layers.0'..'layers.{cfg.num_hidden_layers - 1}', {HEAD!r}"
        )
    q = cfg.num_attention_heads * cfg.head_dim
    kv = cfg.num_key_value_heads * cfg.head_dim
    inter = cfg.intermediate_size
    by_suffix: dict[str, tuple[int, ...]] = {
        "input_layernorm.weight": (h,),
        "self_attn.q_proj.weight": (q, h),
        "self_attn.k_proj.weight": (kv, h),
        "self_attn.v_proj.weight": (kv, h),
        "self_attn.o_proj.weight": (h, q),
        "post_attention_layernorm.weight": (h,),
        "mlp.gate_proj.weight": (inter, h),
        "mlp.up_proj.weight": (inter, h),
        "mlp.down_proj.weight": (h, inter),
        "self_attn.q_proj.bias": (q,),
        "self_attn.k_proj.bias": (kv,),
        "self_attn.v_proj.bias": (kv,),
        "self_attn.o_proj.bias": (h,),
        "mlp.gate_proj.bias": (inter,),
        "mlp.up_proj.bias": (inter,),
        "mlp.down_proj.bias": (h,),
    }
    return {f"model.layers.{index}.{s}": by_suffix[s] for s in layer_tensors(cfg)}
