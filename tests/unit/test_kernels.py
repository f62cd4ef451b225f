"""Kernel choice by measurement (`services.worker.model.kernels`): the settings and their errors,
the ISA cap, the verdict rule, the on-disk cache and what it refuses, the forced modes, and greedy
exactness of every (level, implementation) the machine runs against the torch paths."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest
import structlog.testing
import torch

from services.model_format import synth
from services.model_format.config import LlamaConfig
from services.worker.engine.kv_cache import KVCache
from services.worker.model import fused, kernels, native, varlen
from services.worker.model.attention import ForwardBatch
from services.worker.model.llama import LlamaForCausalLM, load_model


@pytest.fixture(autouse=True)
def _fresh_choices(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Iterator[None]:
    """Each test with its own plan cache and no installed choice, restored afterwards."""
    monkeypatch.setenv("BLITZMESH_CACHE_DIR", str(tmp_path / "cache"))
    saved = dict(native._CHOICES)
    native.set_choices({})
    yield
    native.set_choices(saved)


@pytest.fixture(scope="module")
def tiny_ckpt(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return synth.synthesize(tmp_path_factory.mktemp("kernels") / "tiny", "tiny", seed=3)


def test_unknown_settings_fail_naming_the_allowed_values(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("BLITZMESH_KERNELS", "fastest")
    with pytest.raises(ValueError, match=r"BLITZMESH_KERNELS='fastest': allowed values are auto, torch, native"):
        native.kernel_mode()
    monkeypatch.setenv("BLITZMESH_CPU_ISA", "sse9")
    with pytest.raises(ValueError, match=r"BLITZMESH_CPU_ISA='sse9': allowed values are portable, avx2, avx512"):
        native.isa_cap()


def test_a_bad_setting_fails_the_worker_config_at_start(monkeypatch: pytest.MonkeyPatch) -> None:
    from services.worker.config import WorkerConfig

    monkeypatch.setenv("BLITZMESH_CPU_ISA", "neon")
    with pytest.raises(ValueError, match="BLITZMESH_CPU_ISA='neon'"):
        WorkerConfig()


def test_the_cap_lowers_the_level_and_its_flags(monkeypatch: pytest.MonkeyPatch) -> None:
    assert native.runnable_isas()[0] == "portable"
    assert native.runnable_isas()[-1] == native.machine_isa()
    monkeypatch.setenv("BLITZMESH_CPU_ISA", "portable")
    assert native.target_isa() == "portable"
    assert native.vector_flags() == []
    assert not native.has_avx512_bf16()
    monkeypatch.setenv("BLITZMESH_CPU_ISA", "avx512")  # a cap above the machine is the machine
    assert native.target_isa() == native.machine_isa()
    if "avx2" in native.runnable_isas():
        flags = native.vector_flags("avx2")
        assert "-mavx2" in flags and not any(f.startswith("-mavx512") for f in flags)
    above = [isa for isa in native.ISAS if isa not in native.runnable_isas()]
    for isa in above:
        with pytest.raises(ValueError, match="cannot run"):
            native.vector_flags(isa)


def test_native_is_chosen_only_when_it_measured_faster() -> None:
    assert kernels._verdict("op", "avx2", [2.0], [3.0]).impl == "native"
    slower = kernels._verdict("op", "avx2", [3.0], [2.0])
    assert slower.impl == "torch" and slower.isa == "-"
    assert kernels._verdict("op", "avx2", [2.0], [2.0]).impl == "torch"  # a tie keeps torch
    assert slower.auto_over_torch == 1.0
    # Cases count alike: 2x faster on a short case outweighs 1.2x slower on a long one.
    mixed = kernels._verdict("op", "avx2", [1.0, 120.0], [2.0, 100.0])
    assert mixed.impl == "native" and mixed.native_ms == 121.0 and mixed.torch_ms == 102.0
    assert mixed.auto_over_torch is not None and mixed.auto_over_torch > 1.0


def test_a_gemm_path_takes_the_row_counts_up_to_where_it_stops_winning() -> None:
    rows = (1, 8, 32, 256)
    # Faster at 1 and 8, slower from 32: native up to 8 rows, the speedup over those two.
    banded = kernels._rows_verdict("small_gemm", "avx2", rows, [1.0, 2.0, 5.0, 9.0], [2.0, 3.0, 4.0, 8.0], "x")
    assert banded.impl == "native" and banded.max_rows == 8
    assert banded.speedup == pytest.approx((2.0 * 1.5) ** 0.5, abs=1e-3) and banded.native_ms == 3.0
    assert "up to 8 rows (slower from 32)" in banded.reason
    # A win after a loss does not count: the band starts at the first count.
    later = kernels._rows_verdict("small_gemm", "avx2", rows, [3.0, 1.0, 1.0, 1.0], [2.0, 2.0, 2.0, 2.0], "x")
    assert later.impl == "torch" and later.max_rows is None and later.isa == "-"
    everywhere = kernels._rows_verdict("packed_gemm", "-", rows, [1.0] * 4, [1.5] * 4, "x")
    assert everywhere.impl == "native" and everywhere.max_rows is None


def test_linear_routes_each_call_by_rows_as_the_plan_measured() -> None:
    """Small GEMM up to its limit, oneDNN's blocked copy up to its own, F.linear above: each
    call's result is bit for bit the chosen path's."""
    from services.worker.model import small_gemm
    from services.worker.model.llama import Linear

    kernel = small_gemm.small_gemm()
    if kernel is None or not hasattr(torch.ops.mkldnn, "_linear_pointwise"):
        pytest.skip("needs the small GEMM (AVX2 or better) and oneDNN")
    native.set_choices({"small_gemm": "native", "packed_gemm": "native"}, {"small_gemm": 2, "packed_gemm": 16})
    g = torch.Generator().manual_seed(5)
    w = torch.randn(96, 576, generator=g)
    lin = Linear(w, pack=True)
    assert lin._packed is not None and lin._pairs is not None
    for rows, path in ((1, "small"), (2, "small"), (3, "onednn"), (16, "onednn"), (17, "f_linear"), (64, "f_linear")):
        x = torch.randn(rows, 576, generator=g)
        want = {
            "small": lambda x=x: kernel(x, lin._pairs, 96),
            "onednn": lambda x=x: torch.ops.mkldnn._linear_pointwise(x, lin._packed, None, "none", [], ""),
            "f_linear": lambda x=x: torch.nn.functional.linear(x, w),
        }[path]()
        assert torch.equal(lin(x), want), (rows, path)
    # Measured slower at every count: no blocked copy is made, F.linear takes those rows.
    native.set_choices({"small_gemm": "native", "packed_gemm": "torch"}, {"small_gemm": 2})
    plain = Linear(w, pack=True)
    assert plain._packed is None
    x = torch.randn(8, 576, generator=g)
    assert torch.equal(plain(x), torch.nn.functional.linear(x, w))
    with pytest.raises(ValueError, match="positive integers"):
        native.set_choices({"small_gemm": "native"}, {"small_gemm": 0})


def _cfg(tiny_ckpt: Path) -> LlamaConfig:
    return load_model(tiny_ckpt).config


def test_a_measured_plan_never_runs_a_kernel_slower_than_torch(tiny_ckpt: Path) -> None:
    cfg = _cfg(tiny_ckpt)
    plan = kernels.choose(cfg, torch.float32, 8)
    assert {c.op for c in plan.choices} == set(kernels.OPS)
    assert plan.mode == "auto" and not plan.cached and plan.measured_s > 0
    for c in plan.choices:
        if c.impl == "native":
            assert c.speedup is not None and c.speedup > 1.0, c
            assert c.isa == native.target_isa()
        if c.torch_ms is not None:
            assert c.auto_over_torch is not None and c.auto_over_torch >= 1.0, c


def test_the_plan_is_cached_and_a_bad_file_is_rewritten(tiny_ckpt: Path) -> None:
    cfg = _cfg(tiny_ckpt)
    first = kernels.choose(cfg, torch.float32, 8)
    path = kernels._plan_path(first.key)
    again = kernels.choose(cfg, torch.float32, 8)
    assert again.cached and [c.impl for c in again.choices] == [c.impl for c in first.choices]
    for bad in ("{not json", json.dumps({**json.loads(path.read_text()), "key": {"format": -1}})):
        path.write_text(bad)
        fresh = kernels.choose(cfg, torch.float32, 8)
        assert not fresh.cached  # measured again, not trusted
        assert json.loads(path.read_text())["key"] == first.key  # and rewritten
    # Another kernel source (or CPU, torch, shapes, dtype, threads, cap) is another key.
    assert kernels.plan_key(cfg, torch.bfloat16, 8) != first.key
    assert kernels.plan_key(cfg, torch.float32, 16) != first.key


def test_forced_modes_skip_the_measurement(tiny_ckpt: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    cfg = _cfg(tiny_ckpt)
    monkeypatch.setenv("BLITZMESH_KERNELS", "torch")
    plan = kernels.choose(cfg, torch.float32, 8)
    assert {c.impl for c in plan.choices} == {"torch"} and plan.measured_s == 0
    kernels.apply(plan)
    assert varlen.paged_prefill() is None and native.paged_decode() is None and fused.fused_ops() is None
    monkeypatch.setenv("BLITZMESH_KERNELS", "native")
    plan = kernels.choose(cfg, torch.float32, 8)
    by_op = {c.op: c for c in plan.choices}
    assert by_op["fused_ops"].impl == "native" and by_op["varlen_prefill"].impl == "native"
    # native ignores a measured torch choice
    native.set_choices({"varlen_prefill": "torch"})
    assert varlen.paged_prefill() is not None


def test_an_applied_choice_switches_the_model_path() -> None:
    native.set_choices({"varlen_prefill": "torch", "paged_decode": "native"})
    assert varlen.paged_prefill() is None
    assert native.paged_decode() is not None
    native.set_choices({"varlen_prefill": "native"})
    assert varlen.paged_prefill() is not None
    with pytest.raises(ValueError, match="'native' or 'torch'"):
        native.set_choices({"varlen_prefill": "fast"})


def test_bfloat16_follows_the_measured_gemm_speed(tiny_ckpt: Path) -> None:
    cfg = _cfg(tiny_ckpt)
    assert kernels.choose_dtype(cfg, torch.float32).dtype == "float32"
    choice = kernels.choose_dtype(cfg, torch.bfloat16)
    assert choice.bf16_gemm_ms is not None and choice.f32_gemm_ms is not None
    slow = choice.bf16_gemm_ms / choice.f32_gemm_ms
    assert choice.dtype == ("float32" if slow > kernels.BF16_SLOWDOWN_LIMIT else "bfloat16"), choice
    assert kernels.choose_dtype(cfg, torch.bfloat16) == choice  # read back from the cache


def _greedy_paged(m: LlamaForCausalLM, prompt: list[int], n: int) -> list[int]:
    """Greedy tokens through the paged cache: the prompt in two chunks (the second after cached
    context), then one decode step per token, beside a second sequence decoding in the same steps."""
    cache = KVCache.for_model(m.config, num_blocks=32, block_size=8)
    tables = [list(range(0, 16)), list(range(16, 32))]
    other = [5, 6, 7]
    half = len(prompt) // 2
    with torch.no_grad():
        m.forward_batch(torch.tensor(other), ForwardBatch.build([3], [0], [tables[1]], 8), cache)
        m.forward_batch(torch.tensor(prompt[:half]), ForwardBatch.build([half], [0], [tables[0]], 8), cache)
        rest = len(prompt) - half
        batch = ForwardBatch.build([rest, 1], [half, 3], tables, 8)
        logits = m.forward_batch(torch.tensor([*prompt[half:], 9]), batch, cache)
        out = [int(logits[0].argmax())]
        ctx = [len(prompt), 4]
        for _ in range(n - 1):
            batch = ForwardBatch.build([1, 1], ctx, tables, 8)
            logits = m.forward_batch(torch.tensor([out[-1], 9]), batch, cache)
            out.append(int(logits[0].argmax()))
            ctx = [ctx[0] + 1, ctx[1] + 1]
    return out


@pytest.mark.parametrize("impl", ["native", "torch"])
def test_every_level_and_side_gives_the_torch_paths_greedy_tokens(
    tiny_ckpt: Path, kernel_isa: str, impl: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    prompt = torch.randint(3, 200, (45,), generator=torch.Generator().manual_seed(4)).tolist()
    monkeypatch.setenv("BLITZMESH_KERNELS", "torch")
    want = _greedy_paged(load_model(tiny_ckpt), prompt, 12)
    monkeypatch.setenv("BLITZMESH_KERNELS", "auto")
    native.set_choices({op: impl for op in kernels.OPS})
    has_varlen = varlen.paged_prefill_at(kernel_isa) is not None
    assert (varlen.paged_prefill() is not None) == (impl == "native" and has_varlen)
    assert (native.paged_decode() is not None) == (impl == "native")
    assert _greedy_paged(load_model(tiny_ckpt), prompt, 12) == want


def test_a_kernel_failing_its_check_is_dropped_for_torch_and_logged() -> None:
    def bad_check(kernel: object) -> None:
        raise RuntimeError("max error 3.2")

    lazy = native.LazyKernel("demo_op", "demo_kernel", "BLITZMESH_DEMO", lambda isa: object(), bad_check)
    with structlog.testing.capture_logs() as logs:
        assert lazy.build("portable") is None
        assert lazy.build("portable") is None  # tried once per level, not again
    assert [e["event"] for e in logs] == ["demo_kernel_unavailable"]
    assert lazy.get() is None  # the model's path: torch
    assert "max error 3.2" in logs[0]["error"] and logs[0]["isa"] == "portable"
