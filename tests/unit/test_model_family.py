"""The Llama family against transformers 5.23: RoPE scaling types, Qwen2, Mistral, bfloat16.

Every checkpoint here is written by transformers itself (`*Config(...)` tiny geometry ->
`AutoModelForCausalLM.from_config` -> `save_pretrained`), with random weights scaled so that
attention is sharp and logits spread (std-0.02 init gives near-uniform logits, where greedy
tokens would test nothing), and read by Blitzmesh's own loader.

Tolerances, per dtype (logits of magnitude up to ~10 here):
- float32: |ours - transformers| <= 1e-4 (measured <= 3e-5: only summation order differs), and
  greedy tokens identical over every step;
- bfloat16: |ours - transformers| <= 4% of the largest |logit| (measured: 0 without a cache, where
  every op rounds like transformers'; up to 1.7% through the paged cache, where decode attention
  differs: the torch path pads and masks, the native kernel keeps float32 probabilities where
  SDPA rounds them to bfloat16). Greedy tokens are identical until the first step where they
  differ, and they may differ only where transformers' own top two logits are within that
  tolerance (a near tie: bfloat16 keeps 8 bits, so one rounding decides it).
"""

from __future__ import annotations

import asyncio
import json
import math
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file, save_file

from services.model_format.checkpoint import Checkpoint, CheckpointError, load_config
from services.model_format.config import LlamaConfig
from services.model_format.groups import group_tensor_shapes, param_groups
from services.worker.config import WorkerConfig
from services.worker.engine.engine import Engine, EngineConfig
from services.worker.engine.sampling import SamplingParams
from services.worker.model import native, rope
from services.worker.model.llama import LlamaForCausalLM, load_model, resolve_dtype

transformers = pytest.importorskip("transformers")

F32_ATOL = 1e-4
BF16_REL = 0.04
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}

GEOMETRY: dict[str, Any] = {
    "vocab_size": 256,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "bos_token_id": 1,
    "eos_token_id": 2,
}
ORIGINAL_CONTEXT = 32  # pretraining context of the scaled-RoPE cases
WINDOW = 8
# Prompts of 5, 21 and 40 tokens, then 32 greedy steps: up to position 71, past the original
# context of every scaled case and nine windows long.
PROMPT_LENS = (5, 21, 40)
NEW_TOKENS = 32


def _llama(rope_parameters: dict[str, Any], max_pos: int, **kw: Any) -> Any:
    return transformers.LlamaConfig(
        **GEOMETRY, max_position_embeddings=max_pos, rope_parameters={"rope_theta": 10000.0, **rope_parameters}, **kw
    )


CASES: dict[str, Callable[[], Any]] = {
    "llama3": lambda: _llama(
        {
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": ORIGINAL_CONTEXT,
        },
        256,
    ),
    "linear": lambda: _llama({"rope_type": "linear", "factor": 2.0}, 128),
    # Dynamic NTK states its original context as max_position_embeddings and runs past it.
    "dynamic": lambda: _llama({"rope_type": "dynamic", "factor": 4.0}, ORIGINAL_CONTEXT),
    "yarn": lambda: _llama(
        {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": ORIGINAL_CONTEXT}, 128
    ),
    # The other branches of yarn: mscale / mscale_all_dim attention factor, betas, no truncation.
    "yarn-mscale": lambda: _llama(
        {
            "rope_type": "yarn",
            "factor": 4.0,
            "original_max_position_embeddings": ORIGINAL_CONTEXT,
            "mscale": 1.0,
            "mscale_all_dim": 0.5,
            "beta_fast": 16.0,
            "beta_slow": 2.0,
            "truncate": False,
        },
        128,
    ),
    "llama-bias": lambda: _llama({"rope_type": "default"}, 128, attention_bias=True, mlp_bias=True),
    "qwen2": lambda: transformers.Qwen2Config(**GEOMETRY, max_position_embeddings=128, tie_word_embeddings=True),
    # Layer 0 full attention, layer 1 windowed.
    "qwen2-sliding": lambda: transformers.Qwen2Config(
        **GEOMETRY, max_position_embeddings=128, use_sliding_window=True, sliding_window=WINDOW, max_window_layers=1
    ),
    "mistral": lambda: transformers.MistralConfig(**GEOMETRY, max_position_embeddings=128, sliding_window=WINDOW),
}
SCALED = ("llama3", "linear", "dynamic", "yarn", "yarn-mscale")


def _randomize(model: Any, seed: int) -> None:
    """Weights with unit-scale activations, sharp attention and spread logits; nonzero biases."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=g)
            if name.endswith("norm.weight"):
                p.copy_(1 + 0.1 * noise)
            elif p.dim() == 1:
                p.copy_(0.5 * noise)  # biases
            elif "embed_tokens" in name:
                p.copy_(noise)
            else:
                sharp = 2.0 if ("q_proj" in name or "k_proj" in name) else 1.0
                p.copy_(noise * sharp / math.sqrt(p.shape[1]))


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("family")
    out = {}
    for i, (name, make) in enumerate(CASES.items()):
        model = transformers.AutoModelForCausalLM.from_config(make())
        _randomize(model, seed=i)
        model.save_pretrained(root / name)
        out[name] = root / name
    return out


def _hf(path: Path, dtype: torch.dtype) -> Any:
    """A fresh transformers model (dynamic RoPE keeps state between calls: never reuse one)."""
    return transformers.AutoModelForCausalLM.from_pretrained(str(path), dtype=dtype).eval()


def _prompt(n: int, seed: int) -> list[int]:
    return torch.randint(3, GEOMETRY["vocab_size"], (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def _tolerance(dtype: torch.dtype, reference: torch.Tensor) -> float:
    return F32_ATOL if dtype == torch.float32 else BF16_REL * float(reference.abs().max())


_hf_greedy_cache: dict[tuple[str, str, int], tuple[list[int], torch.Tensor]] = {}


def _hf_greedy(path: Path, dtype: torch.dtype, prompt: list[int]) -> tuple[list[int], torch.Tensor]:
    """transformers' greedy continuation (its own KV cache) and its logits at every step."""
    key = (str(path), str(dtype), hash(tuple(prompt)))
    if key not in _hf_greedy_cache:
        hf = _hf(path, dtype)
        hf.generation_config.eos_token_id = None  # every step, as the engine's ignore_eos
        out = hf.generate(
            torch.tensor([prompt]),
            max_new_tokens=NEW_TOKENS,
            do_sample=False,
            eos_token_id=None,
            pad_token_id=0,
            output_logits=True,
            return_dict_in_generate=True,
        )
        tokens = out.sequences[0, len(prompt) :].tolist()
        assert len(tokens) == NEW_TOKENS
        _hf_greedy_cache[key] = (tokens, torch.stack(out.logits)[:, 0].float())
    return _hf_greedy_cache[key]


async def _engine_greedy(model: LlamaForCausalLM, prompts: Sequence[list[int]], **engine: Any) -> list[list[int]]:
    """Greedy continuations of all prompts, submitted at once to one paged engine."""
    fields: dict[str, Any] = {"max_batch_size": 4, "max_num_tokens": 128, "block_size": 4, "num_kv_blocks": 128}
    eng = Engine.create(model, (2,), EngineConfig(**{**fields, "num_threads": 1, **engine}))
    params = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True)

    async def one(i: int, prompt: list[int]) -> list[int]:
        return [ev.token_id async for ev in eng.generate(f"r{i}", prompt, params) if ev.token_id is not None]

    async with eng:
        return list(await asyncio.gather(*(one(i, p) for i, p in enumerate(prompts))))


class DecodePath:
    """Which decode attention a test runs, and the windows the native kernel was called with."""

    def __init__(self, kind: str) -> None:
        self.kind = kind
        self.native_windows: set[int] = set()


@pytest.fixture(params=["native", "torch"])
def decode_path(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> DecodePath:
    """Decode attention through the native kernel (spied on) or the torch path (SDPA over a padded
    gather, masked)."""
    path = DecodePath(str(request.param))
    if path.kind == "native":
        kernel = native.paged_decode()
        if kernel is None:
            pytest.skip("native paged attention cannot be built here")

        def spy(*args: Any) -> torch.Tensor:
            path.native_windows.add(args[6])
            return kernel(*args)

        monkeypatch.setattr(native, "paged_decode", lambda: spy)
    else:
        monkeypatch.setattr(native, "paged_decode", lambda: None)
    return path


# ---- config --------------------------------------------------------------------------------------


EXPECTED: dict[str, dict[str, Any]] = {
    "llama3": {"model_type": "llama", "rope_type": "llama3"},
    "linear": {"model_type": "llama", "rope_type": "linear"},
    "dynamic": {"model_type": "llama", "rope_type": "dynamic", "max_context_tokens": 4 * ORIGINAL_CONTEXT},
    "yarn": {"model_type": "llama", "rope_type": "yarn"},
    "yarn-mscale": {"model_type": "llama", "rope_type": "yarn"},
    "llama-bias": {"model_type": "llama", "qkv_bias": True, "o_bias": True, "mlp_bias": True},
    "qwen2": {"model_type": "qwen2", "qkv_bias": True, "o_bias": False, "tie_word_embeddings": True},
    "qwen2-sliding": {"model_type": "qwen2", "qkv_bias": True, "windows": (None, WINDOW)},
    "mistral": {"model_type": "mistral", "qkv_bias": False, "windows": (WINDOW, WINDOW)},
}


@pytest.mark.parametrize("case", CASES)
def test_config_reads_what_transformers_writes_and_writes_it_back(ckpts: dict[str, Path], case: str) -> None:
    cfg = load_config(ckpts[case])
    for key, value in EXPECTED[case].items():
        got = tuple(cfg.attention_window(i) for i in range(cfg.num_hidden_layers)) if key == "windows" else None
        assert (got if key == "windows" else getattr(cfg, key)) == value, key
    assert LlamaConfig.from_hf_dict(json.loads(json.dumps(cfg.to_hf_dict()))) == cfg
    # transformers reads our config.json back to the same model: the same RoPE and windows.
    ours = transformers.AutoConfig.for_model(**cfg.to_hf_dict())
    theirs = transformers.AutoConfig.from_pretrained(str(ckpts[case]))
    for hf_cfg in (ours, theirs):
        hf_rope = transformers.AutoModelForCausalLM.from_config(hf_cfg).model.rotary_emb
        freq, scaling = rope.inv_freq(cfg)
        assert torch.equal(freq, hf_rope.inv_freq) and scaling == hf_rope.attention_scaling
        assert getattr(hf_cfg, "sliding_window", None) == cfg.sliding_window
        types = getattr(hf_cfg, "layer_types", None)
        if types is not None and cfg.sliding_window is not None:
            assert [cfg.attention_window(i) is not None for i in range(cfg.num_hidden_layers)] == [
                t == "sliding_attention" for t in types
            ]
    # Parameter count and groups agree with the model transformers built.
    hf = _hf(ckpts[case], torch.float32)
    assert cfg.num_parameters() == sum(p.numel() for p in hf.parameters())
    names = {n for g in param_groups(cfg) for n in group_tensor_shapes(cfg, g)}
    assert names == set(Checkpoint(ckpts[case]).tensor_names())


@pytest.mark.parametrize("case", SCALED)
def test_transformers_4x_rope_scaling_layout_reads_the_same(ckpts: dict[str, Path], case: str, tmp_path: Path) -> None:
    """transformers 4.x wrote `rope_theta` and `rope_scaling` (with `type` before 4.43)."""
    d = json.loads((ckpts[case] / "config.json").read_text())
    params = d.pop("rope_parameters")
    d["rope_theta"] = params.pop("rope_theta")
    d["rope_scaling"] = {"type": params.pop("rope_type"), **params}
    assert LlamaConfig.from_hf_dict(d) == load_config(ckpts[case])
    (tmp_path / "config.json").write_text(json.dumps(d))
    hf_rope = transformers.AutoModelForCausalLM.from_config(
        transformers.AutoConfig.from_pretrained(str(tmp_path))
    ).model.rotary_emb
    assert torch.equal(rope.inv_freq(LlamaConfig.from_hf_dict(d))[0], hf_rope.inv_freq)


def test_dynamic_frequencies_match_transformers_at_every_length(ckpts: dict[str, Path]) -> None:
    """transformers recomputes dynamic NTK frequencies from a 0-dim tensor of the longest length."""
    cfg = load_config(ckpts["dynamic"])
    hf_cfg = transformers.AutoConfig.from_pretrained(str(ckpts["dynamic"]))
    compute = transformers.modeling_rope_utils.ROPE_INIT_FUNCTIONS["dynamic"]
    initial = compute(hf_cfg, None)[0]  # what transformers uses up to max_position_embeddings
    assert torch.equal(rope.inv_freq(cfg)[0], initial)
    for length in (1, ORIGINAL_CONTEXT):
        assert torch.equal(rope.inv_freq(cfg, length)[0], initial), length
    for length in (ORIGINAL_CONTEXT + 1, 50, 4 * ORIGINAL_CONTEXT):
        want = compute(hf_cfg, None, seq_len=torch.tensor(length))[0]
        assert torch.equal(rope.inv_freq(cfg, length)[0], want), length
        assert not torch.equal(want, initial)


@pytest.mark.parametrize(
    ("change", "quoted"),
    [
        ({"model_type": "gemma"}, "'gemma'"),
        ({"architectures": ["LlamaForSequenceClassification"]}, "LlamaForSequenceClassification"),
        ({"rope_parameters": {"rope_type": "longrope", "rope_theta": 1e4}}, "'longrope'"),
        ({"rope_scaling": {"type": "su", "factor": 2.0}}, "'su'"),
        ({"rope_parameters": {"rope_type": "yarn", "factor": 2.0, "partial_rotary_factor": 0.5}}, "0.5"),
        ({"rope_parameters": {"rope_type": "linear"}}, "needs factor"),
        ({"rope_parameters": {"rope_type": "dynamic", "factor": -2.0}}, "-2.0"),
        (
            {
                "rope_parameters": {
                    "rope_type": "llama3",
                    "factor": 8.0,
                    "low_freq_factor": 4.0,
                    "high_freq_factor": 1.0,
                }
            },
            "low_freq_factor=4.0",
        ),
        ({"model_type": "qwen2", "layer_types": ["full_attention", "sliding_attention"]}, "sliding_window"),
        ({"model_type": "qwen2", "use_sliding_window": True, "layer_types": ["full", "x"]}, "'full'"),
        ({"model_type": "qwen2", "attention_bias": True}, "attention_bias=True"),
        ({"model_type": "mistral", "layer_types": ["full_attention", "sliding_attention"]}, "ministral"),
        ({"model_type": "mistral", "sliding_window": 0}, "sliding_window must be a positive int, got 0"),
        ({"model_type": "qwen2", "eos_token_id": None}, "eos_token_id is missing or null"),
        ({"quantization_config": {"quant_method": "gptq", "bits": 4}}, "'gptq'"),
    ],
)
def test_config_refuses_what_it_does_not_implement_naming_it(change: dict[str, Any], quoted: str) -> None:
    d = {**GEOMETRY, "max_position_embeddings": 64, **change}
    with pytest.raises(ValueError, match=quoted.replace("(", r"\(").replace("[", r"\[")):
        LlamaConfig.from_hf_dict(d)


def test_checkpoint_refuses_tensors_its_config_lacks(ckpts: dict[str, Path], tmp_path: Path) -> None:
    """Qwen2 weights under a Llama config.json (no attention_bias): the biases are named, not dropped."""
    src = ckpts["qwen2-sliding"]
    d = json.loads((src / "config.json").read_text())
    d.update(model_type="llama", architectures=["LlamaForCausalLM"])
    (tmp_path / "config.json").write_text(json.dumps(d))
    save_file(load_file(str(src / "model.safetensors")), str(tmp_path / "model.safetensors"))
    with pytest.raises(CheckpointError, match=r"model\.layers\.0\.self_attn\.[kqv]_proj\.bias"):
        list(Checkpoint(tmp_path).iter_groups())


# ---- logits and greedy tokens against transformers ------------------------------------------------


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("case", CASES)
def test_logits_match_transformers(ckpts: dict[str, Path], case: str, dtype: str) -> None:
    """One 72-token forward: past the original context (scaled RoPE), nine windows (Mistral)."""
    dt = DTYPES[dtype]
    ids = torch.tensor(_prompt(72, seed=3))
    with torch.no_grad():
        expected = _hf(ckpts[case], dt)(ids.unsqueeze(0)).logits[0].float()
    model = load_model(ckpts[case], dtype=dt)
    assert model.dtype == dt and model.export_group("embed")["model.embed_tokens.weight"].dtype == dt
    torch.testing.assert_close(model(ids).float(), expected, atol=_tolerance(dt, expected), rtol=0)


@pytest.mark.parametrize("case", ["llama3", "linear", "dynamic", "yarn", "yarn-mscale", "qwen2-sliding", "mistral"])
def test_parity_depends_on_the_feature(ckpts: dict[str, Path], case: str) -> None:
    """The checks above can fail: the same weights with the RoPE scaling or the window dropped
    give logits far outside the float32 tolerance (past the original context / the window)."""
    cfg = load_config(ckpts[case])
    plain = cfg.replace(
        rope_scaling=None, sliding_window=None, layer_types=None, max_position_embeddings=cfg.max_context_tokens
    )
    model = LlamaForCausalLM(plain)
    model.load_groups(Checkpoint(ckpts[case]).iter_groups())
    ids = torch.tensor(_prompt(72, seed=3))
    with torch.no_grad():
        expected = _hf(ckpts[case], torch.float32)(ids.unsqueeze(0)).logits[0]
    assert (model(ids) - expected).abs().max() > 1000 * F32_ATOL


def _check_greedy(dt: torch.dtype, prompt: list[int], got: list[int], want: list[int], hf_logits: torch.Tensor) -> None:
    assert len(got) == NEW_TOKENS
    if dt == torch.float32:
        assert got == want
        return
    diverged = next((i for i, (a, b) in enumerate(zip(got, want, strict=True)) if a != b), None)
    if diverged is not None:
        top2 = hf_logits[diverged].topk(2).values
        assert float(top2[0] - top2[1]) <= _tolerance(dt, hf_logits[diverged]), (
            f"prompt of {len(prompt)}: step {diverged} picked {got[diverged]}, transformers {want[diverged]} "
            f"with a top-2 gap of {float(top2[0] - top2[1]):.4f}"
        )


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("case", CASES)
async def test_paged_engine_greedy_matches_transformers(
    ckpts: dict[str, Path], case: str, dtype: str, decode_path: DecodePath
) -> None:
    """Three prompts (5, 21, 40 tokens) batched in the paged engine, 32 greedy steps each, against
    transformers' `generate` with its own cache, one prompt at a time."""
    dt = DTYPES[dtype]
    prompts = [_prompt(n, seed=10 + n) for n in PROMPT_LENS]
    model = load_model(ckpts[case], dtype=dt)
    outputs = await _engine_greedy(model, prompts)
    for prompt, got in zip(prompts, outputs, strict=True):
        want, hf_logits = _hf_greedy(ckpts[case], dt, prompt)
        _check_greedy(dt, prompt, got, want, hf_logits)
    if decode_path.kind == "native":
        # The native kernel served the decodes, with each layer's window (0: none).
        windows = {model.config.attention_window(i) or 0 for i in range(model.config.num_hidden_layers)}
        assert decode_path.native_windows == windows


@pytest.mark.parametrize("case", [c for c in CASES if c != "dynamic"])
async def test_chunked_prefill_greedy_matches_transformers(ckpts: dict[str, Path], case: str) -> None:
    """Prompts split into 7-token chunks: the chunks after the first attend to cached context
    through the windowed mask. (Dynamic RoPE rotates each chunk for the length so far, as
    transformers would for a prompt fed in pieces, so it is not compared with a one-piece prompt.)"""
    prompts = [_prompt(n, seed=10 + n) for n in PROMPT_LENS]
    model = load_model(ckpts[case])
    outputs = await _engine_greedy(model, prompts, max_num_tokens=7, enable_chunked_prefill=True)
    for prompt, got in zip(prompts, outputs, strict=True):
        assert got == _hf_greedy(ckpts[case], torch.float32, prompt)[0]


# ---- the native kernel's window and bfloat16 cache --------------------------------------------------


@pytest.mark.parametrize("kv_dtype", DTYPES)
def test_native_kernel_windows_and_bfloat16_match_reference(kv_dtype: str) -> None:
    kernel = native.paged_decode()
    if kernel is None:
        pytest.skip("native paged attention cannot be built here")
    dt = DTYPES[kv_dtype]
    g = torch.Generator().manual_seed(5)
    for heads, kv_heads, d in ((12, 4, 64), (6, 6, 36)):  # vector path, portable path
        blocks, bs = 80, 16
        k = torch.randn(blocks, bs, kv_heads, d, generator=g).to(dt)
        v = torch.randn(blocks, bs, kv_heads, d, generator=g).to(dt)
        lens = torch.tensor([1, 15, 16, 17, 200])
        tables = torch.randperm(blocks, generator=g)[: 5 * 13].view(5, 13)
        q = torch.randn(5, heads, d, generator=g).to(dt)
        for window in (0, 1, 7, 16, 17, 300):
            got = kernel(q, k, v, tables, lens, 200, window)
            assert got.dtype == dt
            for s in range(5):
                want = native.reference_decode(q[s], k, v, tables[s], int(lens[s]), window)
                # bfloat16: only the output's final rounding differs (2^-8 relative).
                tol = 1e-5 if dt == torch.float32 else 2**-8 * float(want.abs().max())
                torch.testing.assert_close(got[s].float(), want, atol=tol, rtol=0)
    with pytest.raises(ValueError, match="window must be >= 0"):
        kernel(q, k, v, tables, lens, 200, -1)


# ---- bfloat16 as a serving option ----------------------------------------------------------------


def test_bfloat16_option_halves_weights_and_kv(ckpts: dict[str, Path]) -> None:
    path = ckpts["qwen2"]
    f32, bf16 = load_model(path), load_model(path, dtype=torch.bfloat16)

    def weight_bytes(m: LlamaForCausalLM) -> int:
        return sum(t.numel() * t.element_size() for g in m.loaded_groups for t in m.export_group(g).values())

    assert weight_bytes(bf16) * 2 == weight_bytes(f32)
    eng32 = Engine.create(f32, (2,), EngineConfig(num_kv_blocks=64))
    eng16 = Engine.create(bf16, (2,), EngineConfig(num_kv_blocks=64))
    assert eng16.kv_cache.nbytes * 2 == eng32.kv_cache.nbytes
    assert eng16.kv_cache.layer_cache(0)[0].dtype == torch.bfloat16
    # Biases come through in the asked dtype too, and export under their checkpoint names.
    exported = bf16.export_group("layers.0")
    assert exported["model.layers.0.self_attn.q_proj.bias"].dtype == torch.bfloat16
    ckpt = dict(Checkpoint(path).iter_groups(["layers.0"]))["layers.0"]
    for name, t in ckpt.items():
        assert torch.equal(exported[name], t.to(torch.bfloat16)), name


def test_dtype_option_resolves_against_the_checkpoint(ckpts: dict[str, Path], tmp_path: Path) -> None:
    """`auto` serves a checkpoint in its own dtype (float16 computed in float32 on CPU); any dtype
    can be asked for whatever the checkpoint stores."""
    cfg = load_config(ckpts["mistral"])
    assert resolve_dtype("auto", cfg) == torch.float32
    assert resolve_dtype("auto", cfg.replace(torch_dtype="bfloat16")) == torch.bfloat16
    assert resolve_dtype("auto", cfg.replace(torch_dtype="float16")) == torch.float32
    assert resolve_dtype("auto", cfg.replace(torch_dtype="float16"), "cuda") == torch.float16
    assert resolve_dtype("bfloat16", cfg) == torch.bfloat16
    with pytest.raises(ValueError, match="'int8'"):
        resolve_dtype("int8", cfg)
    assert WorkerConfig(dtype="bfloat16").dtype == "bfloat16"
    with pytest.raises(ValueError, match="int8"):
        WorkerConfig(dtype="int8")

    # A checkpoint stored in bfloat16: served in bfloat16 by default, in float32 on request.
    hf = _hf(ckpts["mistral"], torch.float32).to(torch.bfloat16)
    hf.save_pretrained(tmp_path / "bf16")
    assert load_config(tmp_path / "bf16").torch_dtype == "bfloat16"
    assert load_model(tmp_path / "bf16").dtype == torch.bfloat16
    upcast = load_model(tmp_path / "bf16", dtype=torch.float32)
    ids = torch.tensor(_prompt(40, seed=4))
    with torch.no_grad():
        expected = _hf(tmp_path / "bf16", torch.float32)(ids.unsqueeze(0)).logits[0]
    torch.testing.assert_close(upcast(ids), expected, atol=F32_ATOL, rtol=0)
