"""Inference-only Llama decoder that starts empty and is filled parameter group by parameter group.

It can run any contiguous range of decoder layers (`embed`, `run_layers`, `head`), which is what a
worker holding only its first k layers needs during ZigZag live scaling. Weights are plain tensors,
not `nn.Parameter`s: nothing is allocated for a group until it arrives, and no autograd state is
ever built.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from services.worker.model.attention import ForwardBatch, PagedKV, attention
from services.worker.model.checkpoint import Checkpoint
from services.worker.model.config import LlamaConfig
from services.worker.model.groups import (
    EMBED,
    EMBED_WEIGHT,
    HEAD,
    LM_HEAD_WEIGHT,
    NORM_WEIGHT,
    group_tensor_shapes,
    layer_group,
    layer_index,
    param_groups,
)


@dataclass(frozen=True)
class _LayerWeights:
    """One decoder layer. Q/K/V and gate/up are fused so each needs one matmul per step."""

    input_norm: torch.Tensor  # [H]
    qkv: torch.Tensor  # [(heads + 2 * kv_heads) * head_dim, H]
    o: torch.Tensor  # [H, heads * head_dim]
    post_norm: torch.Tensor  # [H]
    gate_up: torch.Tensor  # [2 * I, H]
    down: torch.Tensor  # [H, I]


def default_dtype(cfg: LlamaConfig, device: torch.device) -> torch.dtype:
    """The compute dtype to use: the config's on accelerators, float32 on CPU.

    Half-precision matmuls on CPU are slower than float32 on most hosts (and float16 often lacks
    kernels), so a CPU worker computes in float32 unless told otherwise.
    """
    return cfg.dtype if device.type != "cpu" else torch.float32


class LlamaForCausalLM:
    """A Llama decoder equivalent to HF `LlamaForCausalLM` in inference, loaded group by group."""

    def __init__(
        self,
        config: LlamaConfig,
        *,
        dtype: torch.dtype | None = None,
        device: torch.device | str = "cpu",
    ) -> None:
        self.config = config
        self.device = torch.device(device)
        self.dtype = dtype or default_dtype(config, self.device)
        self._embed: torch.Tensor | None = None
        self._norm: torch.Tensor | None = None
        self._lm_head: torch.Tensor | None = None  # None with tied embeddings
        self._layers: list[_LayerWeights | None] = [None] * config.num_hidden_layers
        self._loaded: set[str] = set()
        # RoPE tables in float32 for every position the model accepts (HF computes them in float32
        # too); small: max_position_embeddings x head_dim.
        half = config.head_dim // 2
        inv_freq = 1.0 / (
            config.rope_theta ** (torch.arange(0, half, dtype=torch.int64).float() * 2 / config.head_dim)
        )
        freqs = torch.outer(torch.arange(config.max_position_embeddings, dtype=torch.float32), inv_freq)
        angles = torch.cat([freqs, freqs], dim=-1)
        self._cos = angles.cos().to(self.device)
        self._sin = angles.sin().to(self.device)

    # ---- loading ------------------------------------------------------------------------------

    @property
    def loaded_groups(self) -> list[str]:
        """Groups received so far, in group order."""
        return [g for g in param_groups(self.config) if g in self._loaded]

    @property
    def num_layers_loaded(self) -> int:
        """k such that decoder layers [0, k) are all loaded (the runnable prefix)."""
        k = 0
        while k < self.config.num_hidden_layers and self._layers[k] is not None:
            k += 1
        return k

    @property
    def is_complete(self) -> bool:
        """True when every group is loaded and a full forward can run."""
        return len(self._loaded) == self.config.num_hidden_layers + 2

    def _take(self, tensors: Mapping[str, torch.Tensor], name: str) -> torch.Tensor:
        return tensors[name].to(device=self.device, dtype=self.dtype)

    @torch.inference_mode()
    def load_group(self, name: str, tensors: Mapping[str, torch.Tensor]) -> None:
        """Install one parameter group (HF tensor names); reloading a group replaces it.

        Raises ValueError quoting the offending tensor when names or shapes differ from the config.
        """
        expected = group_tensor_shapes(self.config, name)
        missing = [n for n in expected if n not in tensors]
        extra = [n for n in tensors if n not in expected]
        if missing or extra:
            raise ValueError(f"group {name!r}: missing tensors {missing!r}, unexpected tensors {extra!r}")
        for n, shape in expected.items():
            if tuple(tensors[n].shape) != shape:
                raise ValueError(
                    f"group {name!r}: tensor {n!r} has shape {tuple(tensors[n].shape)}, expected {shape}"
                )
        if name == EMBED:
            self._embed = self._take(tensors, EMBED_WEIGHT)
        elif name == HEAD:
            self._norm = self._take(tensors, NORM_WEIGHT)
            self._lm_head = None if self.config.tie_word_embeddings else self._take(tensors, LM_HEAD_WEIGHT)
        else:
            i = layer_index(name)
            assert i is not None  # group_tensor_shapes validated the name
            p = f"model.layers.{i}."

            def cat(*names: str) -> torch.Tensor:
                return torch.cat([self._take(tensors, p + n) for n in names], dim=0)

            self._layers[i] = _LayerWeights(
                input_norm=self._take(tensors, p + "input_layernorm.weight"),
                qkv=cat("self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight"),
                o=self._take(tensors, p + "self_attn.o_proj.weight"),
                post_norm=self._take(tensors, p + "post_attention_layernorm.weight"),
                gate_up=cat("mlp.gate_proj.weight", "mlp.up_proj.weight"),
                down=self._take(tensors, p + "mlp.down_proj.weight"),
            )
        self._loaded.add(name)

    def load_groups(self, groups: Iterable[tuple[str, Mapping[str, torch.Tensor]]]) -> None:
        """Install groups from an iterator such as `checkpoint.iter_groups(path)`."""
        for name, tensors in groups:
            self.load_group(name, tensors)

    def export_group(self, name: str) -> dict[str, torch.Tensor]:
        """A loaded group under its HF tensor names (views of the model's storage, no copies)."""
        if name not in self._loaded:
            raise KeyError(f"group {name!r} is not loaded; loaded: {self.loaded_groups!r}")
        cfg = self.config
        if name == EMBED:
            assert self._embed is not None
            return {EMBED_WEIGHT: self._embed}
        if name == HEAD:
            assert self._norm is not None
            out = {NORM_WEIGHT: self._norm}
            if self._lm_head is not None:
                out[LM_HEAD_WEIGHT] = self._lm_head
            return out
        i = layer_index(name)
        assert i is not None
        w = self._layers[i]
        assert w is not None
        q = cfg.num_attention_heads * cfg.head_dim
        kv = cfg.num_key_value_heads * cfg.head_dim
        inter = cfg.intermediate_size
        p = f"model.layers.{i}."
        return {
            p + "input_layernorm.weight": w.input_norm,
            p + "self_attn.q_proj.weight": w.qkv[:q],
            p + "self_attn.k_proj.weight": w.qkv[q : q + kv],
            p + "self_attn.v_proj.weight": w.qkv[q + kv :],
            p + "self_attn.o_proj.weight": w.o,
            p + "post_attention_layernorm.weight": w.post_norm,
            p + "mlp.gate_proj.weight": w.gate_up[:inter],
            p + "mlp.up_proj.weight": w.gate_up[inter:],
            p + "mlp.down_proj.weight": w.down,
        }

    # ---- compute ------------------------------------------------------------------------------

    def _rms_norm(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        # Statistics in float32 whatever the compute dtype, as HF does.
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.config.rms_norm_eps)
        return weight * xf.to(x.dtype)

    @staticmethod
    def _rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        # x [T, heads, d]; cos/sin [T, 1, d]. Rotates (x1, x2) halves, the HF "rotate_half" layout.
        x1, x2 = x.chunk(2, dim=-1)
        return x * cos + torch.cat([-x2, x1], dim=-1) * sin

    @torch.inference_mode()
    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        """Token ids `[T]` -> hidden states `[T, H]`."""
        if self._embed is None:
            raise RuntimeError("group 'embed' is not loaded")
        return F.embedding(input_ids.to(self.device), self._embed)

    @torch.inference_mode()
    def run_layers(
        self,
        hidden: torch.Tensor,
        start: int,
        end: int,
        batch: ForwardBatch,
        kv: PagedKV | None = None,
    ) -> torch.Tensor:
        """Run decoder layers [start, end) over flat hidden states `[T, H]` laid out as `batch`.

        With `kv`, each layer writes the new tokens' K/V into the paged cache and attends over the
        cached context; without it, the batch must have no cached context.
        """
        cfg = self.config
        if not 0 <= start <= end <= cfg.num_hidden_layers:
            raise ValueError(f"layer range [{start}, {end}) outside [0, {cfg.num_hidden_layers})")
        missing = [i for i in range(start, end) if self._layers[i] is None]
        if missing:
            raise RuntimeError(f"layers {[layer_group(i) for i in missing]!r} are not loaded")
        if hidden.shape != (batch.num_tokens, cfg.hidden_size):
            raise ValueError(
                f"hidden has shape {tuple(hidden.shape)}, batch expects ({batch.num_tokens}, {cfg.hidden_size})"
            )
        if int(batch.positions.max()) >= cfg.max_position_embeddings:
            raise ValueError(
                f"position {int(batch.positions.max())} >= max_position_embeddings "
                f"{cfg.max_position_embeddings}"
            )
        cos = self._cos[batch.positions].to(self.dtype).unsqueeze(1)
        sin = self._sin[batch.positions].to(self.dtype).unsqueeze(1)
        t = batch.num_tokens
        n_q = cfg.num_attention_heads * cfg.head_dim
        n_kv = cfg.num_key_value_heads * cfg.head_dim
        for i in range(start, end):
            w = self._layers[i]
            assert w is not None
            x = self._rms_norm(hidden, w.input_norm)
            q, k, v = F.linear(x, w.qkv).split([n_q, n_kv, n_kv], dim=-1)
            q = self._rope(q.reshape(t, cfg.num_attention_heads, cfg.head_dim), cos, sin)
            k = self._rope(k.reshape(t, cfg.num_key_value_heads, cfg.head_dim), cos, sin)
            v = v.reshape(t, cfg.num_key_value_heads, cfg.head_dim)
            a = attention(q, k, v, batch, kv, i)
            hidden = hidden + F.linear(a.reshape(t, n_q), w.o)
            x = self._rms_norm(hidden, w.post_norm)
            gate, up = F.linear(x, w.gate_up).chunk(2, dim=-1)
            hidden = hidden + F.linear(F.silu(gate) * up, w.down)
        return hidden

    @torch.inference_mode()
    def head(self, hidden: torch.Tensor) -> torch.Tensor:
        """Hidden states `[N, H]` -> float32 logits `[N, vocab]` (final norm + LM head)."""
        if self._norm is None:
            raise RuntimeError("group 'head' is not loaded")
        weight = self._lm_head if self._lm_head is not None else self._embed
        if weight is None:
            raise RuntimeError("tied LM head needs group 'embed', which is not loaded")
        return F.linear(self._rms_norm(hidden, self._norm), weight).float()

    @torch.inference_mode()
    def forward_batch(
        self, input_ids: torch.Tensor, batch: ForwardBatch, kv: PagedKV | None = None
    ) -> torch.Tensor:
        """One engine step: flat token ids `[T]` -> logits of `batch.logits_indices` rows `[R, vocab]`."""
        hidden = self.run_layers(self.embed(input_ids), 0, self.config.num_hidden_layers, batch, kv)
        return self.head(hidden.index_select(0, batch.logits_indices))

    @torch.inference_mode()
    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        """Reference forward without cache: `[S]` -> `[S, vocab]`, or `[B, S]` -> `[B, S, vocab]`."""
        ids = input_ids if input_ids.dim() == 2 else input_ids.unsqueeze(0)
        b, s = ids.shape
        batch = ForwardBatch.build([s] * b, device=self.device)
        hidden = self.run_layers(self.embed(ids.reshape(-1)), 0, self.config.num_hidden_layers, batch)
        logits = self.head(hidden).view(b, s, -1)
        return logits if input_ids.dim() == 2 else logits[0]

    __call__ = forward


def load_model(
    path: str | Path,
    *,
    dtype: torch.dtype | None = None,
    device: torch.device | str = "cpu",
) -> LlamaForCausalLM:
    """Build a model from an HF checkpoint directory, reading one group at a time."""
    ckpt = Checkpoint(path)
    model = LlamaForCausalLM(ckpt.config, dtype=dtype, device=device)
    model.load_groups(ckpt.iter_groups())
    return model
