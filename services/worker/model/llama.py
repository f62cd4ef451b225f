"""Inference-only Llama-family decoder (Llama, Qwen2, Mistral) that starts empty and is filled
parameter group by parameter group.

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

from services.model_format.checkpoint import Checkpoint
from services.model_format.config import LlamaConfig
from services.model_format.groups import (
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
from services.worker.model import fused, native, small_gemm
from services.worker.model.attention import ForwardBatch, PagedKV, attention
from services.worker.model.rope import RotaryEmbedding


def _onednn_available() -> bool:
    try:
        return bool(torch.backends.mkldnn.is_available()) and hasattr(torch.ops.mkldnn, "_linear_pointwise")
    except (AttributeError, RuntimeError):
        return False


_ONEDNN = _onednn_available()


def _packed_wanted() -> bool:
    """Whether weights get the oneDNN-blocked copy: not where the kernel plan measured `F.linear`
    faster at every row count it tried (`packed_gemm` chosen "torch")."""
    return _ONEDNN and native.chosen("packed_gemm") != "torch"


def _packed_takes(rows: int) -> bool:
    """Whether a call of `rows` rows runs oneDNN's GEMM on the blocked copy rather than `F.linear`:
    up to the row count the kernel plan measured it faster (every count without a plan)."""
    if native.chosen("packed_gemm") == "torch":
        return False
    limit = native.row_limit("packed_gemm")
    return limit is None or rows <= limit


# Row count the blocked weight layout is tuned for (a hint only: any row count works): decode
# batches are of this order, and prefill-sized batches ran as fast on this layout as on one
# tuned for them.
_PACK_ROWS_HINT = 32
# Dtypes whose weights get a oneDNN-blocked copy on CPU.
_PACKED_DTYPES = (torch.float32, torch.bfloat16)


class Linear:
    """A linear layer's weight `[out, in]` (and bias, if any), plus a oneDNN-blocked copy of the
    weight on CPU (float32 and bfloat16).

    Each call goes by its row count to one of three paths, as the worker's kernel plan measured
    them on the CPU it runs on (`kernels.py`: `small_gemm`, `packed_gemm`): the small GEMM up to
    its row limit, oneDNN on the blocked copy up to its own, `F.linear` above (on an AVX2 EPYC:
    1-4 rows, 16-32 rows, 64 rows and more). Without a plan, the paths below.

    One GEMM path for every row count: with 2 threads on the development box (AVX-512 with
    BF16) the prepacked oneDNN GEMM beat `F.linear` (MKL for float32, unpacked oneDNN for
    bfloat16) at every row count measured: float32 34 / 179 / 206 / 217 GFLOP/s at 1 / 16 /
    256 / 1,024 rows against 23 / 83 / 156 / 189, bfloat16 46 / 331 / 427 / 407 against 24 /
    243 / 400 / 412. A decode step's handful of rows gains most. For weights without a bias on CPUs
    with AVX-512, calls of up to `small_gemm.MAX_ROWS` rows take a third copy, packed for
    `small_gemm`, which reads it at close to the memory's rate (the 120 projections of a decode
    step of the default model at one row: bfloat16 7.3 ms against oneDNN's 15.4, float32 12.9
    against 20.9). `weight` stays the plain tensor (exported, served to peers); only
    the summation order differs between the paths.
    """

    __slots__ = ("weight", "bias", "_packed", "_pairs")

    def __init__(self, weight: torch.Tensor, pack: bool, bias: torch.Tensor | None = None) -> None:
        self.weight = weight
        self.bias = bias
        self._packed: torch.Tensor | None = None
        # Without a bias: a copy packed for decode-sized row counts (`small_gemm`).
        self._pairs: torch.Tensor | None = None
        if pack and _packed_wanted() and weight.device.type == "cpu" and weight.dtype in _PACKED_DTYPES:
            try:
                self._packed = torch.ops.mkldnn._reorder_linear_weight(weight, _PACK_ROWS_HINT)
            except RuntimeError:
                self._packed = None
        if pack and bias is None and weight.dim() == 2 and weight.device.type == "cpu":
            kernel = small_gemm.small_gemm()
            if kernel is not None and kernel.packable(weight):
                self._pairs = kernel.pack(weight)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self._pairs is not None and x.dim() == 2 and x.shape[0] <= small_gemm.max_rows():
            kernel = small_gemm.small_gemm()
            if kernel is not None and x.stride(1) == 1 and x.dtype == self.weight.dtype:
                return kernel(x, self._pairs, self.weight.shape[0])
        if self._packed is not None and x.dim() == 2 and _packed_takes(x.shape[0]):
            return torch.ops.mkldnn._linear_pointwise(x, self._packed, self.bias, "none", [], "")
        return F.linear(x, self.weight, self.bias)

    def float_out(self, x: torch.Tensor) -> torch.Tensor:
        """`x [M, K]` -> float32 `[M, N]`. With the pair-packed copy, the float32 sums unrounded
        (in blocks of rows, each row's result independent of the others'): a bfloat16 model's
        logits then keep their float32 order instead of tying at bfloat16's coarse steps (1/8 at
        16); otherwise the layer's output widened."""
        kernel = small_gemm.small_gemm() if self._pairs is not None else None
        if kernel is None or x.dim() != 2 or x.stride(1) != 1:
            return self(x).float()
        if x.dtype != self.weight.dtype:
            return self(x).float()
        n, step = self.weight.shape[0], small_gemm.MAX_ROWS
        parts = [kernel(x[i : i + step], self._pairs, n, torch.float32) for i in range(0, x.shape[0], step)]
        return parts[0] if len(parts) == 1 else torch.cat(parts)


def _has_bias(cfg: LlamaConfig, name: str) -> bool:
    """Whether the `Linear` that holds weight `name` has a bias (then it keeps no small-GEMM copy)."""
    if ".self_attn.o_proj." in name:
        return cfg.o_bias
    if ".self_attn." in name:
        return cfg.qkv_bias
    return ".mlp." in name and cfg.mlp_bias


@dataclass(frozen=True)
class _LayerWeights:
    """One decoder layer. Q/K/V and gate/up are fused so each needs one matmul per step."""

    input_norm: torch.Tensor  # [H]
    qkv: Linear  # [(heads + 2 * kv_heads) * head_dim, H]
    o: Linear  # [H, heads * head_dim]
    post_norm: torch.Tensor  # [H]
    gate_up: Linear  # [2 * I, H]
    down: Linear  # [H, I]


def default_dtype(cfg: LlamaConfig, device: torch.device) -> torch.dtype:
    """The dtype weights and KV cache are held and computed in when none is asked for: the
    checkpoint's, except float16 on CPU, which is computed in float32.

    torch's CPU float16 matmuls run 3-4x slower than float32 ones (no native kernels on x86
    without AVX512-FP16; measured on the development box), while bfloat16 ones are as fast as
    packed float32 or faster where the CPU has AVX512-BF16 / AMX.
    """
    if device.type == "cpu" and cfg.dtype == torch.float16:
        return torch.float32
    return cfg.dtype


_DTYPE_NAMES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def resolve_dtype(name: str, cfg: LlamaConfig, device: torch.device | str = "cpu") -> torch.dtype:
    """The dtype a worker option names: `auto` (see `default_dtype`), `float32`, `bfloat16`, `float16`."""
    if name == "auto":
        return default_dtype(cfg, torch.device(device))
    try:
        return _DTYPE_NAMES[name]
    except KeyError:
        raise ValueError(f"dtype must be 'auto' or one of {sorted(_DTYPE_NAMES)}, got {name!r}") from None


class LlamaForCausalLM:
    """A decoder equivalent in inference to HF `LlamaForCausalLM`, `Qwen2ForCausalLM` and
    `MistralForCausalLM` (per `config.model_type`), loaded group by group."""

    def __init__(
        self,
        config: LlamaConfig,
        *,
        dtype: torch.dtype | None = None,
        device: torch.device | str = "cpu",
        pack_weights: bool = True,
        fused_ops: bool = True,
    ) -> None:
        self.config = config
        self.device = torch.device(device)
        self.dtype = dtype or default_dtype(config, self.device)
        # CPU float32 / bfloat16: keep a oneDNN-blocked copy of every matmul weight (see
        # `Linear`). Costs a second copy of those weights in memory.
        self.pack_weights = pack_weights
        # CPU float32 / bfloat16: the layer's elementwise ops as native fused kernels (see
        # `services.worker.model.fused`); False keeps the eager torch ops (the reference).
        self.fused_ops = fused_ops
        self._embed: torch.Tensor | None = None
        self._norm: torch.Tensor | None = None
        self._lm_head: torch.Tensor | None = None  # None with tied embeddings
        self._head: Linear | None = None  # the LM head's weight (lm_head or the tied embedding)
        self._layers: list[_LayerWeights | None] = [None] * config.num_hidden_layers
        self._loaded: set[str] = set()
        # cos/sin of each step's positions, computed in float32 as transformers does (any RoPE type).
        self.rotary = RotaryEmbedding(config, self.device)
        self._windows = tuple(config.attention_window(i) for i in range(config.num_hidden_layers))

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

    @property
    def packs_weights(self) -> bool:
        """Whether matmul weights get a oneDNN-packed second copy (CPU float32 / bfloat16, see `Linear`)."""
        return self.pack_weights and _packed_wanted() and self.device.type == "cpu" and self.dtype in _PACKED_DTYPES

    def weight_bytes(self, *, loaded_only: bool = False) -> int:
        """Bytes the weights take here, of every group (or of the groups loaded so far), counting
        the packed copies of the matmul weights where `Linear` makes them (oneDNN's blocked copy,
        the small GEMM's panels): what sizing the KV pool from the memory left must subtract.
        From the config's shapes: a group's tensors arrive whole."""
        cfg = self.config
        elem = torch.empty((), dtype=self.dtype).element_size()
        kernel = small_gemm.small_gemm() if self.pack_weights and self.device.type == "cpu" else None
        total = 0
        for group in param_groups(cfg):
            if loaded_only and group not in self._loaded:
                continue
            for name, shape in group_tensor_shapes(cfg, group).items():
                n = 1
                for d in shape:
                    n *= d
                # Every 2-D weight that a `Linear` holds: the layers' projections, the LM head,
                # and the embedding when the head reuses it.
                linear = len(shape) == 2 and (name != EMBED_WEIGHT or cfg.tie_word_embeddings)
                copies = 1 + (linear and self.packs_weights)
                if linear and kernel is not None and not _has_bias(cfg, name):
                    copies += kernel.packs_shape(self.dtype, shape)
                total += n * elem * copies
        return total

    def _take(self, tensors: Mapping[str, torch.Tensor], name: str) -> torch.Tensor:
        return tensors[name].to(device=self.device, dtype=self.dtype)

    def _take_cat(self, tensors: Mapping[str, torch.Tensor], names: Iterable[str]) -> torch.Tensor:
        parts = [self._take(tensors, n) for n in names]
        # One tensor stays a view of the caller's buffer (no copy when dtype and device match).
        return parts[0] if len(parts) == 1 else torch.cat(parts, dim=0)

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
                raise ValueError(f"group {name!r}: tensor {n!r} has shape {tuple(tensors[n].shape)}, expected {shape}")
        if name == EMBED:
            self._embed = self._take(tensors, EMBED_WEIGHT)
            if self.config.tie_word_embeddings:
                self._head = Linear(self._embed, self.pack_weights)
        elif name == HEAD:
            self._norm = self._take(tensors, NORM_WEIGHT)
            self._lm_head = None if self.config.tie_word_embeddings else self._take(tensors, LM_HEAD_WEIGHT)
            if self._lm_head is not None:
                self._head = Linear(self._lm_head, self.pack_weights)
        else:
            i = layer_index(name)
            assert i is not None  # group_tensor_shapes validated the name
            p = f"model.layers.{i}."
            cfg = self.config

            def linear(projections: tuple[str, ...], has_bias: bool) -> Linear:
                weight = self._take_cat(tensors, (f"{p}{n}.weight" for n in projections))
                bias = self._take_cat(tensors, (f"{p}{n}.bias" for n in projections)) if has_bias else None
                return Linear(weight, self.pack_weights, bias)

            self._layers[i] = _LayerWeights(
                input_norm=self._take(tensors, p + "input_layernorm.weight"),
                qkv=linear(("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"), cfg.qkv_bias),
                o=linear(("self_attn.o_proj",), cfg.o_bias),
                post_norm=self._take(tensors, p + "post_attention_layernorm.weight"),
                gate_up=linear(("mlp.gate_proj", "mlp.up_proj"), cfg.mlp_bias),
                down=linear(("mlp.down_proj",), cfg.mlp_bias),
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
        out = {
            p + "input_layernorm.weight": w.input_norm,
            p + "self_attn.q_proj.weight": w.qkv.weight[:q],
            p + "self_attn.k_proj.weight": w.qkv.weight[q : q + kv],
            p + "self_attn.v_proj.weight": w.qkv.weight[q + kv :],
            p + "self_attn.o_proj.weight": w.o.weight,
            p + "post_attention_layernorm.weight": w.post_norm,
            p + "mlp.gate_proj.weight": w.gate_up.weight[:inter],
            p + "mlp.up_proj.weight": w.gate_up.weight[inter:],
            p + "mlp.down_proj.weight": w.down.weight,
        }
        if w.qkv.bias is not None:
            out[p + "self_attn.q_proj.bias"] = w.qkv.bias[:q]
            out[p + "self_attn.k_proj.bias"] = w.qkv.bias[q : q + kv]
            out[p + "self_attn.v_proj.bias"] = w.qkv.bias[q + kv :]
        if w.o.bias is not None:
            out[p + "self_attn.o_proj.bias"] = w.o.bias
        if w.gate_up.bias is not None and w.down.bias is not None:
            out[p + "mlp.gate_proj.bias"] = w.gate_up.bias[:inter]
            out[p + "mlp.up_proj.bias"] = w.gate_up.bias[inter:]
            out[p + "mlp.down_proj.bias"] = w.down.bias
        return out

    # ---- compute ------------------------------------------------------------------------------

    def _rms_norm(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        # Statistics in float32 whatever the compute dtype, as HF does.
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.config.rms_norm_eps)
        return weight * xf.to(x.dtype)

    @staticmethod
    def _rope(x: torch.Tensor, cos: torch.Tensor, sin_half: torch.Tensor) -> torch.Tensor:
        """HF's `x * cos + rotate_half(x) * sin` in three ops and one allocation.

        x `[T, heads, d]`; cos `[T, 1, d]`; sin_half `[T, 1, d/2]` (both halves of HF's sin table
        are equal). With x = (x1, x2): (x1 * cos - x2 * sin, x2 * cos + x1 * sin).
        In float32 the fused multiply-adds round once where HF rounds twice (1 ulp); in bfloat16
        that ulp is 2^-8, so there HF's own three rounded ops are used.
        """
        half = x.shape[-1] // 2
        x1, x2 = x[..., :half], x[..., half:]
        if x.dtype != torch.float32:
            sin = torch.cat((sin_half, sin_half), dim=-1)
            return x * cos + torch.cat((-x2, x1), dim=-1) * sin
        out = x * cos
        out[..., :half].addcmul_(x2, sin_half, value=-1.0)
        out[..., half:].addcmul_(x1, sin_half)
        return out

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
        # From the layout's Python ints: no reduction over a (device) tensor, no host sync.
        last = max(c + n for c, n in zip(batch.context_lens, batch.query_lens, strict=True)) - 1
        if last >= cfg.max_context_tokens:
            raise ValueError(f"position {last} >= the model's context of {cfg.max_context_tokens} tokens")
        cos, sin_half = self.rotary.cos_sin(batch.positions, batch.query_lens, batch.context_lens, self.dtype)
        ops = self._fused()
        if ops is not None:
            return self._run_layers_fused(ops, hidden, start, end, batch, kv, cos, sin_half)
        for i in range(start, end):
            q, k, v = self.attention_inputs(i, hidden, cos, sin_half)
            hidden = self.finish_layer(i, hidden, attention(q, k, v, batch, kv, i, self._windows[i]))
        return hidden

    def layer_window(self, layer: int) -> int | None:
        """Keys a query of `layer` attends to, its own included (None: all before it)."""
        return self._windows[layer]

    def rope_tables(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """`(cos, sin_half)` of tokens at `positions [T]` for `attention_inputs` (static RoPE)."""
        if self.rotary.dynamic:
            raise RuntimeError("a RoPE with dynamic scaling needs the sequences' lengths: use run_layers")
        return self.rotary.cos_sin(positions.to(self.device), (), (), self.dtype)

    def attention_inputs(
        self, layer: int, hidden: torch.Tensor, cos: torch.Tensor, sin_half: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The first half of decoder layer `layer` over `hidden [T, H]`: input norm, QKV and RoPE.
        Returns `q [T, heads, d]`, `k, v [T, kv_heads, d]` (views of one buffer)."""
        cfg = self.config
        w = self._layers[layer]
        if w is None:
            raise RuntimeError(f"layer {layer_group(layer)!r} is not loaded")
        t = hidden.shape[0]
        heads, kv_heads, d = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        n_qk = (heads + kv_heads) * d
        qkv = w.qkv(self._rms_norm(hidden, w.input_norm))
        # Q and K rotated together: one pass over both.
        qk = self._rope(qkv[:, :n_qk].view(t, heads + kv_heads, d), cos, sin_half)
        return qk[:, :heads], qk[:, heads:], qkv[:, n_qk:].view(t, kv_heads, d)

    def finish_layer(self, layer: int, hidden: torch.Tensor, attn: torch.Tensor) -> torch.Tensor:
        """The second half of decoder layer `layer`: output projection of `attn [T, heads, d]`,
        residual, post norm, MLP, residual. Returns a new tensor (`hidden` is left alone)."""
        w = self._layers[layer]
        assert w is not None
        t = hidden.shape[0]
        hidden = hidden + w.o(attn.reshape(t, -1))
        x = self._rms_norm(hidden, w.post_norm)
        gate, up = w.gate_up(x).chunk(2, dim=-1)
        act = F.silu(gate)
        act.mul_(up)
        hidden.add_(w.down(act))
        return hidden

    def _fused(self) -> fused.FusedOps | None:
        if not self.fused_ops or self.device.type != "cpu" or self.dtype not in fused.DTYPES:
            return None
        return fused.fused_ops()

    def _run_layers_fused(
        self,
        ops: fused.FusedOps,
        hidden: torch.Tensor,
        start: int,
        end: int,
        batch: ForwardBatch,
        kv: PagedKV | None,
        cos: torch.Tensor,
        sin_half: torch.Tensor,
    ) -> torch.Tensor:
        """`run_layers` with the elementwise ops fused (see `fused`): per layer, norm (with the
        previous layer's residual add), QKV GEMM, RoPE + KV write, attention, O GEMM, residual add
        + norm, gate/up GEMM, SiLU-mul, down GEMM. Each residual sum is written into the
        projection's fresh output, so the caller's `hidden` is left alone."""
        cfg = self.config
        t = batch.num_tokens
        heads, kv_heads, d = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        n_q = heads * d
        n_qk = (heads + kv_heads) * d
        eps = cfg.rms_norm_eps
        cos = cos.reshape(t, d).contiguous()
        sin_half = sin_half.reshape(t, d // 2).contiguous()
        slots = batch.slot_mapping
        if slots is not None and kv is None:
            raise ValueError("ForwardBatch was built with block tables but no KV cache was given")
        pending: torch.Tensor | None = None  # the last down projection, not yet added to hidden
        for i in range(start, end):
            w = self._layers[i]
            assert w is not None
            if pending is None:
                x = ops.rms_norm(hidden, w.input_norm, eps)
            else:
                x, hidden = ops.add_rms_norm(hidden, pending, w.input_norm, eps)
            qkv = w.qkv(x)
            if slots is not None:
                assert kv is not None
                k_cache, v_cache = kv.layer_cache(i)
                if batch.max_slot >= k_cache.shape[0] * k_cache.shape[1]:
                    raise ValueError(f"slot {batch.max_slot} outside the KV cache of {k_cache.shape[0]} blocks")
                ops.rope_write(qkv, heads, kv_heads, d, cos, sin_half, slots, k_cache, v_cache)
            else:
                ops.rope_write(qkv, heads, kv_heads, d, cos, sin_half)
            q = qkv[:, :n_q].view(t, heads, d)
            k = qkv[:, n_q:n_qk].view(t, kv_heads, d)
            v = qkv[:, n_qk:].view(t, kv_heads, d)
            a = attention(q, k, v, batch, kv, i, self._windows[i], kv_written=True)
            x, hidden = ops.add_rms_norm(hidden, w.o(a.reshape(t, n_q)), w.post_norm, eps)
            pending = w.down(ops.silu_mul(w.gate_up(x)))
        if pending is not None:
            hidden = pending.add_(hidden)
        return hidden

    @property
    def static_decode_supported(self) -> bool:
        """Whether `decode_static` can run this model: every group loaded, and no RoPE whose
        frequencies depend on the sequence's length (dynamic NTK reads it on the host)."""
        return self.is_complete and not self.rotary.dynamic

    @torch.inference_mode()
    def decode_static(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        slots: torch.Tensor,
        block_tables: torch.Tensor,
        kv: PagedKV,
    ) -> torch.Tensor:
        """One decode step of B sequences in fixed shapes: no host sync and no shape that depends
        on the data, so a CUDA graph can capture it (`services.worker.model.cuda_graphs`).

        Row b is one new token `input_ids[b]` at `positions[b]`; its K/V go to flat cache slot
        `slots[b]`, and it attends over the keys at positions 0..positions[b] of its sequence,
        read through `block_tables[b]` (`[B, NB]`, covering positions[b] + 1 tokens; entries past
        that are any valid block, masked out). Returns float32 logits `[B, vocab]`.
        """
        if not self.static_decode_supported:
            raise RuntimeError("decode_static needs the whole model and a RoPE without dynamic scaling")
        assert self._head is not None and self._norm is not None
        cfg = self.config
        b = int(input_ids.shape[0])
        heads, kv_heads, d = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        hidden = self.embed(input_ids)
        cos, sin_half = self.rotary.cos_sin(positions, (), (), self.dtype)
        width = int(block_tables.shape[1])
        bs = int(kv.block_size)
        # Which of each row's NB * bs keys it sees: once per step, not per layer.
        key_pos = torch.arange(width * bs, device=positions.device).view(1, -1)
        visible = (key_pos <= positions.view(-1, 1)).view(b, 1, 1, -1)
        windowed = {
            w: (visible & (key_pos > positions.view(-1, 1) - w).view(b, 1, 1, -1))
            for w in set(self._windows)
            if w is not None
        }
        for i in range(cfg.num_hidden_layers):
            q, k, v = self.attention_inputs(i, hidden, cos, sin_half)
            kv.write(i, slots, k, v)
            k_cache, v_cache = kv.layer_cache(i)
            # [B, NB, bs, KVH, d] -> [B, KVH, NB * bs, d]: each sequence's keys in position order.
            keys = k_cache[block_tables].view(b, width * bs, kv_heads, d).transpose(1, 2)
            values = v_cache[block_tables].view(b, width * bs, kv_heads, d).transpose(1, 2)
            window = self._windows[i]
            mask = visible if window is None else windowed[window]
            a = F.scaled_dot_product_attention(
                q.unsqueeze(2), keys, values, attn_mask=mask, enable_gqa=heads != kv_heads
            )
            hidden = self.finish_layer(i, hidden, a.reshape(b, heads, d))
        return self._head.float_out(self._rms_norm(hidden, self._norm))

    @torch.inference_mode()
    def head(self, hidden: torch.Tensor) -> torch.Tensor:
        """Hidden states `[N, H]` -> float32 logits `[N, vocab]` (final norm + LM head)."""
        if self._norm is None:
            raise RuntimeError("group 'head' is not loaded")
        if self._head is None:
            raise RuntimeError("tied LM head needs group 'embed', which is not loaded")
        return self._head.float_out(self._rms_norm(hidden, self._norm))

    @torch.inference_mode()
    def forward_batch(self, input_ids: torch.Tensor, batch: ForwardBatch, kv: PagedKV | None = None) -> torch.Tensor:
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
