"""Kernel choice by measurement: for each op that has a native kernel, time it against torch's own
path on this CPU, at the model's shapes, and run the faster one.

The ops: `varlen_prefill` (attention of prompt tokens over the paged cache, `varlen`),
`paged_decode` (decode attention, `native`), `small_gemm` (decode-sized GEMMs, `small_gemm`),
`packed_gemm` (oneDNN's GEMM on a blocked copy of the weights, against `F.linear`) and
`fused_ops` (norms, RoPE + cache write, SiLU-and-multiply, `fused`). The two GEMM paths are raced
per row count and take calls only up to the count where they stop winning (`max_rows`): a
projection runs the small GEMM up to its limit, oneDNN's blocked GEMM up to its own, and
`F.linear` above. `choose()` builds each
native kernel at the target instruction-set level (`native.target_isa()`: the CPU's best, capped
by `BLITZMESH_CPU_ISA`), times it and the torch path alternately on cases of the model's own
shapes, and picks native only where it was faster: a kernel slower than torch on this machine is
never used. `BLITZMESH_KERNELS=torch` or `=native` skip the measurement and force one side.

The same timings decide what a bfloat16 model computes in (`choose_dtype`): on CPUs without
AVX512-BF16, torch's bfloat16 GEMM can be two orders of magnitude slower than float32, so a
model asked for in bfloat16 is then held in float32 (twice the memory, the speed of float32),
and the plan says so.

A plan is cached on disk (`<cache>/kernel-plans/<key>.json`), keyed by the CPU model and flags,
the torch version, the hash of every kernel's source, the shapes, the dtype, the thread count and
the ISA cap: a later load on the same machine reads it back instead of timing again. A file that
is corrupt, of another format version or for another key is ignored and rewritten.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import os
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import structlog
import torch

from services.model_format.config import LlamaConfig
from services.worker.model import fused, native, small_gemm, varlen, varlen_dot
from services.worker.model.attention import ForwardBatch, attention

log = structlog.get_logger(__name__)

OPS = ("varlen_prefill", "paged_decode", "small_gemm", "packed_gemm", "fused_ops")
# Row counts the GEMM paths are raced at (a decode step has one row per sequence, a prefill
# step up to max_num_tokens).
SMALL_GEMM_ROWS = (1, 2, 4, 8, 16, 32)
PACKED_GEMM_ROWS = (1, 8, 16, 32, 64, 256)
# Bumped when the file's layout or the meaning of a field changes: older files are rewritten.
FORMAT_VERSION = 3
# A bfloat16 GEMM more than this many times slower than float32 at the model's shapes: compute
# in float32 instead (a factor that costs less than it saves in memory traffic stays bfloat16).
BF16_SLOWDOWN_LIMIT = 1.5
_DTYPE_NAMES = {torch.float32: "float32", torch.bfloat16: "bfloat16"}


@dataclass(frozen=True)
class OpChoice:
    """What runs one op, and the evidence: each side's ms over the same cases (the sum over the
    cases of each one's fastest call)."""

    op: str
    impl: str  # "native" or "torch"
    isa: str  # the native kernel's level ("-" for torch)
    reason: str
    native_ms: float | None = None
    torch_ms: float | None = None
    speedup: float | None = None  # geometric mean over the cases of torch's time over native's
    # GEMM paths: native only for calls of at most this many rows (the largest row count raced
    # up to which native won at every count); None: no limit.
    max_rows: int | None = None

    @property
    def auto_over_torch(self) -> float | None:
        """The chosen side's speed over torch's (>= 1: the choice is no slower than torch)."""
        if self.speedup is None:
            return None
        return self.speedup if self.impl == "native" else 1.0


@dataclass(frozen=True)
class KernelPlan:
    """Every op's choice for one model on this machine, and how it was reached."""

    mode: str  # auto, torch or native
    isa: str  # target level (machine's best, capped)
    machine_isa: str
    dtype: str  # the dtype the plan was measured for
    choices: tuple[OpChoice, ...]
    measured_s: float = 0.0  # time spent timing (0 when read from the cache or forced)
    cached: bool = False
    key: dict[str, Any] = field(default_factory=dict)

    def impl(self, op: str) -> str:
        for c in self.choices:
            if c.op == op:
                return c.impl
        return "torch"

    def as_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d["choices"] = {c.op: {**dataclasses.asdict(c), "auto_over_torch": c.auto_over_torch} for c in self.choices}
        for c in d["choices"].values():
            del c["op"]
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> KernelPlan:
        choices = tuple(
            OpChoice(
                op=op,
                impl=str(c["impl"]),
                isa=str(c["isa"]),
                reason=str(c["reason"]),
                native_ms=c.get("native_ms"),
                torch_ms=c.get("torch_ms"),
                speedup=c.get("speedup"),
                max_rows=c.get("max_rows"),
            )
            for op, c in d["choices"].items()
        )
        if {c.op for c in choices} != set(OPS) or any(c.impl not in ("native", "torch") for c in choices):
            raise ValueError(f"a plan names ops {sorted(c.op for c in choices)}, impls must be native/torch")
        return cls(
            mode=str(d["mode"]),
            isa=str(d["isa"]),
            machine_isa=str(d["machine_isa"]),
            dtype=str(d["dtype"]),
            choices=choices,
            measured_s=float(d.get("measured_s", 0.0)),
            cached=True,
            key=dict(d.get("key", {})),
        )


_CURRENT: KernelPlan | None = None


def apply(plan: KernelPlan) -> None:
    """Make `plan` the process's choice (the model's ops consult it on every call)."""
    global _CURRENT
    native.set_choices(
        {c.op: c.impl for c in plan.choices},
        {c.op: c.max_rows for c in plan.choices if c.impl == "native" and c.max_rows is not None},
    )
    _CURRENT = plan
    log.info(
        "kernel_plan",
        mode=plan.mode,
        isa=plan.isa,
        machine_isa=plan.machine_isa,
        dtype=plan.dtype,
        cached=plan.cached,
        measured_s=round(plan.measured_s, 3),
        **{c.op: f"{c.impl}({c.isa}) {c.reason}" for c in plan.choices},
    )


def current() -> KernelPlan | None:
    """The plan last applied in this process (None before any)."""
    return _CURRENT


# ---- the cache key and file ------------------------------------------------------------------


def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    import platform

    return platform.processor() or platform.machine()


def source_hash() -> str:
    """One hash over every kernel's C source: a changed kernel invalidates every cached plan."""
    h = hashlib.sha256()
    for src in (native._SOURCE, varlen._SOURCE, varlen_dot._SOURCE, small_gemm._SOURCE, fused._SOURCE):
        h.update(src.encode())
    return h.hexdigest()[:16]


def _shapes(cfg: LlamaConfig, block_size: int) -> dict[str, int]:
    return {
        "hidden": cfg.hidden_size,
        "intermediate": cfg.intermediate_size,
        "heads": cfg.num_attention_heads,
        "kv_heads": cfg.num_key_value_heads,
        "head_dim": cfg.head_dim,
        "block_size": block_size,
    }


def plan_key(cfg: LlamaConfig, dtype: torch.dtype, block_size: int) -> dict[str, Any]:
    return {
        "format": FORMAT_VERSION,
        "cpu": cpu_model(),
        "cpu_flags": hashlib.sha256(" ".join(sorted(native.cpu_flags())).encode()).hexdigest()[:16],
        "torch": torch.__version__,
        "kernels": source_hash(),
        "shapes": _shapes(cfg, block_size),
        "dtype": _DTYPE_NAMES.get(dtype, str(dtype)),
        "threads": torch.get_num_threads(),
        "isa": native.target_isa(),
    }


def _plan_path(key: dict[str, Any]) -> Path:
    digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:24]
    return native.cache_dir() / "kernel-plans" / f"{digest}.json"


def _load_json(key: dict[str, Any]) -> dict[str, Any] | None:
    """The cached record for `key`, or None: missing, or ignored (logged) when corrupt or written
    for another key or format version."""
    path = _plan_path(key)
    try:
        raw = json.loads(path.read_text())
        if not isinstance(raw, dict) or raw.get("key") != key:
            raise ValueError("written for another key or format version")
        return raw
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as e:
        log.warning("kernel_plan_cache_ignored", path=str(path), error=f"{type(e).__name__}: {e}")
        return None


def _store_json(key: dict[str, Any], record: dict[str, Any]) -> None:
    path = _plan_path(key)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".{path.name}.{os.getpid()}")
        tmp.write_text(json.dumps({**record, "key": key}, indent=1))
        os.replace(tmp, path)  # atomic: concurrent workers each install a whole file
    except OSError as e:
        log.warning("kernel_plan_cache_unwritable", path=str(path), error=f"{type(e).__name__}: {e}")


def _read_cached(key: dict[str, Any]) -> KernelPlan | None:
    raw = _load_json(key)
    if raw is None:
        return None
    try:
        return KernelPlan.from_dict(raw)
    except (ValueError, KeyError, TypeError, AttributeError) as e:
        log.warning("kernel_plan_cache_ignored", path=str(_plan_path(key)), error=f"{type(e).__name__}: {e}")
        return None


# ---- timing ----------------------------------------------------------------------------------


# Time spent timing one case (both sides, warm-up included) before the repetitions stop: with
# four ops of two cases or so each, the whole measurement stays within about 3 s.
CASE_BUDGET_S = 0.3
MAX_REPS = 9


def _race(native_fn: Callable[[], object], torch_fn: Callable[[], object]) -> tuple[float, float]:
    """The fastest ms of each over alternating calls, after one warm-up call each: as many pairs
    as fit in `CASE_BUDGET_S` (at least 3, at most `MAX_REPS`). The fastest, not the median: on a
    shared machine interference only ever slows a call, and alternating spreads it over both."""
    t0 = time.perf_counter()
    native_fn()
    torch_fn()
    pair_s = max(time.perf_counter() - t0, 1e-6)
    reps = max(3, min(MAX_REPS, int(CASE_BUDGET_S / pair_s)))
    a: list[float] = []
    b: list[float] = []
    for _ in range(reps):
        for fn, out in ((native_fn, a), (torch_fn, b)):
            t0 = time.perf_counter()
            fn()
            out.append((time.perf_counter() - t0) * 1e3)
    return min(a), min(b)


class _ScratchKV:
    """A paged cache of one layer filled with random K/V (what attention reads while timing)."""

    def __init__(self, blocks: int, block_size: int, kv_heads: int, d: int, dtype: torch.dtype) -> None:
        g = torch.Generator().manual_seed(0)
        self.k = torch.randn(blocks, block_size, kv_heads, d, generator=g).to(dtype)
        self.v = torch.randn(blocks, block_size, kv_heads, d, generator=g).to(dtype)
        self._bs = block_size

    @property
    def block_size(self) -> int:
        return self._bs

    def write(self, layer: int, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        self.k.view(-1, *self.k.shape[2:]).index_copy_(0, slots, k)
        self.v.view(-1, *self.v.shape[2:]).index_copy_(0, slots, v)

    def gather(self, layer: int, blocks: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.k.index_select(0, blocks), self.v.index_select(0, blocks)

    def layer_cache(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.k, self.v


def _scratch_cache(
    q_lens: list[int], ctx_lens: list[int], block_size: int, kv_heads: int, d: int, dtype: torch.dtype
) -> tuple[_ScratchKV, list[list[int]]]:
    """A scratch cache holding every sequence's context and new tokens, and each one's block
    table (consecutive blocks from 1; block 0 stays the padding block)."""
    need = [-(-(c + n) // block_size) for c, n in zip(ctx_lens, q_lens, strict=True)]
    tables, first = [], 1
    for n in need:
        tables.append(list(range(first, first + n)))
        first += n
    return _ScratchKV(first, block_size, kv_heads, d, dtype), tables


def _with_choice(op: str, impl: str, fn: Callable[[], object]) -> Callable[[], object]:
    """`fn` run with `op` set to `impl` (the other ops as they are)."""

    def run() -> object:
        saved = dict(native._CHOICES)
        native._CHOICES[op] = impl
        try:
            return fn()
        finally:
            native._CHOICES.clear()
            native._CHOICES.update(saved)

    return run


def _attention_cases(
    cfg: LlamaConfig, dtype: torch.dtype, block_size: int, q_lens: list[int], ctx_lens: list[int]
) -> Callable[[], object]:
    """One layer's attention of a step with these sequences, through `attention()` as the model
    calls it after the fused RoPE kernel wrote the new K/V (so either side may take the step)."""
    heads, kvh, d = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
    kv, tables = _scratch_cache(q_lens, ctx_lens, block_size, kvh, d, dtype)
    g = torch.Generator().manual_seed(1)
    t = sum(q_lens)
    q = torch.randn(t, heads, d, generator=g).to(dtype)
    k = torch.randn(t, kvh, d, generator=g).to(dtype)
    v = torch.randn(t, kvh, d, generator=g).to(dtype)

    def run() -> object:
        # Built inside: the batch's layout depends on the choice (decodes grouped for the kernel).
        batch = ForwardBatch.build(q_lens, ctx_lens, tables, block_size)
        return attention(q, k, v, batch, kv, 0, kv_written=True)

    return run


def _time_varlen(cfg: LlamaConfig, dtype: torch.dtype, block_size: int, isa: str) -> OpChoice:
    if varlen.paged_prefill_at(isa) is None:
        return OpChoice("varlen_prefill", "torch", "-", f"no native kernel at {isa}")
    # A fresh prompt, and a chunk after cached context (chunked prefill, prefix-cache hits).
    cases = [([512], [0]), ([256], [768])]
    ns: list[float] = []
    ts: list[float] = []
    for q_lens, ctx_lens in cases:
        run = _attention_cases(cfg, dtype, block_size, q_lens, ctx_lens)
        a, b = _race(_with_choice("varlen_prefill", "native", run), _with_choice("varlen_prefill", "torch", run))
        ns.append(a)
        ts.append(b)
    return _verdict("varlen_prefill", isa, ns, ts)


def _time_decode(cfg: LlamaConfig, dtype: torch.dtype, block_size: int, isa: str) -> OpChoice:
    if native.paged_decode_at(isa) is None:
        return OpChoice("paged_decode", "torch", "-", f"no native kernel at {isa}")
    run = _attention_cases(cfg, dtype, block_size, [1] * 16, [127 + 32 * i for i in range(16)])
    a, b = _race(_with_choice("paged_decode", "native", run), _with_choice("paged_decode", "torch", run))
    return _verdict("paged_decode", isa, [a], [b])


def _time_fused(cfg: LlamaConfig, dtype: torch.dtype, block_size: int, isa: str) -> OpChoice:
    """Two decoder layers of the model's shapes (random weights), run as the model runs them:
    the fused kernels against the eager ops, on a decode step of 16 sequences and a 512-token
    prompt. Timed inside the layers because in a decode step the eager ops' cost is their
    dispatch, which op-by-op timings of the same arithmetic leave out."""
    if fused.fused_ops_at(isa) is None:
        return OpChoice("fused_ops", "torch", "-", f"no native kernel at {isa}")
    from services.model_format.groups import group_tensor_shapes, layer_group
    from services.worker.model.llama import LlamaForCausalLM

    small = dataclasses.replace(cfg, num_hidden_layers=2)
    model = LlamaForCausalLM(small, dtype=dtype)
    g = torch.Generator().manual_seed(5)
    for i in range(2):
        shapes = group_tensor_shapes(small, layer_group(i))
        model.load_group(
            layer_group(i),
            {
                n: (torch.randn(sh, generator=g) * 0.02 if len(sh) > 1 else torch.ones(sh)).to(dtype)
                for n, sh in shapes.items()
            },
        )
    kvh, d = cfg.num_key_value_heads, cfg.head_dim
    ns: list[float] = []
    ts: list[float] = []
    top = cfg.max_context_tokens - 1  # positions the model's RoPE covers
    cases = (([1] * 16, [min(127 + 32 * i, top - 1) for i in range(16)]), ([min(512, top)], [0]))
    for q_lens, ctx_lens in cases:
        kv, tables = _scratch_cache(q_lens, ctx_lens, block_size, kvh, d, dtype)
        hidden = torch.randn(sum(q_lens), cfg.hidden_size, generator=g).to(dtype)

        def run(q_lens: list[int] = q_lens, ctx_lens: list[int] = ctx_lens, tables: list[list[int]] = tables,
                kv: _ScratchKV = kv, hidden: torch.Tensor = hidden) -> object:  # fmt: skip
            batch = ForwardBatch.build(q_lens, ctx_lens, tables, block_size)
            return model.run_layers(hidden, 0, 2, batch, kv)

        a, b = _race(_with_choice("fused_ops", "native", run), _with_choice("fused_ops", "torch", run))
        ns.append(a)
        ts.append(b)
    return _verdict("fused_ops", isa, ns, ts)


def _onednn_packed(w: torch.Tensor) -> torch.Tensor | None:
    try:
        return torch.ops.mkldnn._reorder_linear_weight(w, 32)  # type: ignore[no-any-return]
    except (AttributeError, RuntimeError):
        return None


def _gemm_cases(cfg: LlamaConfig) -> tuple[tuple[int, int], ...]:
    """(out, in) of two projections of the model: the fused gate+up one and the down one."""
    return ((2 * cfg.intermediate_size, cfg.hidden_size), (cfg.hidden_size, cfg.intermediate_size))


def _rows_verdict(op: str, isa: str, rows: tuple[int, ...], ns: list[float], ts: list[float], what: str) -> OpChoice:
    """Native for calls of up to the largest raced row count up to which it won at every count
    (each count's time summed over the shapes); torch where it lost at the first. The speedup is
    over the counts native takes (over all of them when it takes none)."""
    wins = [t / n for n, t in zip(ns, ts, strict=True)]
    taken = 0
    while taken < len(rows) and wins[taken] > 1.0:
        taken += 1
    over = wins[:taken] or wins
    speedup = round(math.exp(statistics.fmean(math.log(w) for w in over)), 3)
    n_sum, t_sum = round(sum(ns[: taken or None]), 3), round(sum(ts[: taken or None]), 3)
    if taken == 0:
        return OpChoice(op, "torch", "-", f"{what}: native measured {speedup:.2f}x torch", n_sum, t_sum, speedup)
    limit = None if taken == len(rows) else rows[taken - 1]
    up_to = "every row count" if limit is None else f"up to {limit} rows (slower from {rows[taken]})"
    return OpChoice(op, "native", isa, f"{what}: measured {speedup:.2f}x torch, {up_to}", n_sum, t_sum, speedup, limit)


def _time_small_gemm(cfg: LlamaConfig, dtype: torch.dtype, isa: str) -> OpChoice:
    """The decode-sized GEMM against oneDNN's on its blocked weights (what runs those rows
    otherwise), per row count: it takes calls up to the count where it stops winning."""
    kernel = small_gemm.small_gemm_at(isa)
    if kernel is None or dtype not in (torch.float32, torch.bfloat16) or (dtype == torch.bfloat16 and not kernel.bf16):
        return OpChoice("small_gemm", "torch", "-", f"no native kernel at {isa} for {_DTYPE_NAMES.get(dtype, dtype)}")
    g = torch.Generator().manual_seed(3)
    ns = [0.0] * len(SMALL_GEMM_ROWS)
    ts = [0.0] * len(SMALL_GEMM_ROWS)
    for n, k in _gemm_cases(cfg):
        w = torch.randn(n, k, generator=g).to(dtype)
        packed, onednn = kernel.pack(w), _onednn_packed(w)
        for i, rows in enumerate(SMALL_GEMM_ROWS):
            x = torch.randn(rows, k, generator=g).to(dtype)

            def torch_side(x: torch.Tensor = x, w: torch.Tensor = w, onednn: torch.Tensor | None = onednn) -> object:
                if onednn is not None:
                    return torch.ops.mkldnn._linear_pointwise(x, onednn, None, "none", [], "")
                return torch.nn.functional.linear(x, w)

            a, b = _race(lambda x=x, packed=packed, n=n: kernel(x, packed, n), torch_side)
            ns[i] += a
            ts[i] += b
    return _rows_verdict("small_gemm", isa, SMALL_GEMM_ROWS, ns, ts, "against oneDNN")


def _time_packed_gemm(cfg: LlamaConfig, dtype: torch.dtype, small: OpChoice) -> OpChoice:
    """oneDNN's GEMM on a blocked copy of the weights (made at load) against `F.linear` on the
    plain ones, per row count above those the small GEMM takes (`small`): the blocked copy takes
    calls up to the count where it stops winning, and none (no copy is made) where it loses at
    the first."""
    if dtype not in (torch.float32, torch.bfloat16):
        return OpChoice("packed_gemm", "torch", "-", f"no blocked oneDNN path for {_DTYPE_NAMES.get(dtype, dtype)}")
    below = 0 if small.impl != "native" else small.max_rows or max(SMALL_GEMM_ROWS)
    row_counts = tuple(r for r in PACKED_GEMM_ROWS if r > below)
    g = torch.Generator().manual_seed(4)
    ns = [0.0] * len(row_counts)
    ts = [0.0] * len(row_counts)
    for n, k in _gemm_cases(cfg):
        w = torch.randn(n, k, generator=g).to(dtype)
        onednn = _onednn_packed(w)
        if onednn is None:
            return OpChoice(
                "packed_gemm", "torch", "-", f"oneDNN cannot block {_DTYPE_NAMES.get(dtype, dtype)} weights"
            )
        for i, rows in enumerate(row_counts):
            x = torch.randn(rows, k, generator=g).to(dtype)
            a, b = _race(
                lambda x=x, onednn=onednn: torch.ops.mkldnn._linear_pointwise(x, onednn, None, "none", [], ""),
                lambda x=x, w=w: torch.nn.functional.linear(x, w),
            )
            ns[i] += a
            ts[i] += b
    return _rows_verdict("packed_gemm", "-", row_counts, ns, ts, "oneDNN blocked weights against F.linear")


def _verdict(op: str, isa: str, native_ms: list[float], torch_ms: list[float]) -> OpChoice:
    """Native where it is faster over the cases: the geometric mean of torch's time over native's,
    case by case, above 1 (each case counts alike, so a decode step is not outweighed by a long
    prompt's milliseconds). The times recorded are the sums over the cases."""
    speedup = round(math.exp(statistics.fmean(math.log(t / n) for n, t in zip(native_ms, torch_ms, strict=True))), 3)
    n_sum, t_sum = round(sum(native_ms), 3), round(sum(torch_ms), 3)
    if speedup > 1.0:
        return OpChoice(op, "native", isa, f"measured {speedup:.2f}x torch", n_sum, t_sum, speedup)
    return OpChoice(op, "torch", "-", f"native measured {speedup:.2f}x torch", n_sum, t_sum, speedup)


def _forced(mode: str, isa: str) -> tuple[OpChoice, ...]:
    if mode == "torch":
        return tuple(OpChoice(op, "torch", "-", "BLITZMESH_KERNELS=torch") for op in OPS)
    built = {
        "varlen_prefill": varlen.paged_prefill_at(isa),
        "paged_decode": native.paged_decode_at(isa),
        "small_gemm": small_gemm.small_gemm_at(isa),
        "packed_gemm": _onednn_packed(torch.ones(16, 16)),
        "fused_ops": fused.fused_ops_at(isa),
    }
    return tuple(
        OpChoice(op, "native", isa, "BLITZMESH_KERNELS=native")
        if built[op] is not None
        else OpChoice(op, "torch", "-", f"BLITZMESH_KERNELS=native, but no kernel builds at {isa}")
        for op in OPS
    )


def choose(cfg: LlamaConfig, dtype: torch.dtype, block_size: int = 16, *, use_cache: bool = True) -> KernelPlan:
    """The plan for a model of `cfg` computing in `dtype` on this CPU (measured, or read back
    from the cache); `apply()` it to take effect."""
    mode, isa = native.kernel_mode(), native.target_isa()
    key = plan_key(cfg, dtype, block_size)
    dname = _DTYPE_NAMES.get(dtype, str(dtype))
    if mode != "auto" or dtype not in _DTYPE_NAMES:
        choices = _forced("torch" if dtype not in _DTYPE_NAMES else mode, isa)
        return KernelPlan(mode, isa, native.machine_isa(), dname, choices, key=key)
    if use_cache:
        cached = _read_cached(key)
        if cached is not None:
            return cached
    began = time.perf_counter()
    with torch.inference_mode():
        small = _time_small_gemm(cfg, dtype, isa)
        first = (
            _time_varlen(cfg, dtype, block_size, isa),
            _time_decode(cfg, dtype, block_size, isa),
            small,
            _time_packed_gemm(cfg, dtype, small),
        )
        # The layers around the fused ops run with the attention and GEMM choices just made.
        saved = dict(native._CHOICES)
        native._CHOICES.update({c.op: c.impl for c in first})
        try:
            choices = (*first, _time_fused(cfg, dtype, block_size, isa))
        finally:
            native._CHOICES.clear()
            native._CHOICES.update(saved)
    plan = KernelPlan(mode, isa, native.machine_isa(), dname, choices, measured_s=time.perf_counter() - began, key=key)
    if use_cache:
        _store_json(key, {**plan.as_dict(), "cached": False})
    return plan


# ---- bfloat16 on CPUs without fast bfloat16 GEMMs ----------------------------------------------


@dataclass(frozen=True)
class DtypeChoice:
    requested: str
    dtype: str  # what the model is held and computed in
    reason: str
    bf16_gemm_ms: float | None = None
    f32_gemm_ms: float | None = None


def _gemm_ms(dtype: torch.dtype, n: int, k: int, rows: int) -> float:
    g = torch.Generator().manual_seed(4)
    w = torch.randn(n, k, generator=g).to(dtype)
    x = torch.randn(rows, k, generator=g).to(dtype)
    try:
        packed = torch.ops.mkldnn._reorder_linear_weight(w, 32)

        def run() -> object:
            return torch.ops.mkldnn._linear_pointwise(x, packed, None, "none", [], "")
    except (AttributeError, RuntimeError):

        def run() -> object:
            return torch.nn.functional.linear(x, w)

    run()
    times = []
    deadline = time.perf_counter() + 0.5  # a slow bfloat16 GEMM stops the timing early
    for _ in range(5):
        t0 = time.perf_counter()
        run()
        times.append((time.perf_counter() - t0) * 1e3)
        if time.perf_counter() > deadline:
            break
    return statistics.median(times)


def choose_dtype(cfg: LlamaConfig, requested: torch.dtype, device: torch.device | str = "cpu") -> DtypeChoice:
    """The dtype a model asked for in `requested` should be held and computed in here: bfloat16
    stays bfloat16 unless torch's bfloat16 GEMM at the model's shapes is more than
    `BF16_SLOWDOWN_LIMIT` times slower than float32 on this CPU; then float32 (and the reason
    says what that costs). Other dtypes and devices are kept as asked. Cached like the plans."""
    name = _DTYPE_NAMES.get(requested, str(requested).removeprefix("torch."))
    if requested != torch.bfloat16 or torch.device(device).type != "cpu":
        return DtypeChoice(name, name, "as requested")
    if native.kernel_mode() != "auto":
        return DtypeChoice(name, name, f"as requested ({native.KERNELS_ENV}={native.kernel_mode()})")
    key = {**plan_key(cfg, requested, 0), "kind": "dtype"}
    raw = _load_json(key)
    if raw is not None:
        try:
            return DtypeChoice(**{f.name: raw[f.name] for f in dataclasses.fields(DtypeChoice)})
        except (KeyError, TypeError) as e:
            log.warning("kernel_plan_cache_ignored", path=str(_plan_path(key)), error=f"{type(e).__name__}: {e}")
    n, k = 2 * cfg.intermediate_size, cfg.hidden_size
    with torch.inference_mode():
        bf16 = _gemm_ms(torch.bfloat16, n, k, 64)
        f32 = _gemm_ms(torch.float32, n, k, 64)
    slow = bf16 / f32
    if slow > BF16_SLOWDOWN_LIMIT:
        choice = DtypeChoice(
            name,
            "float32",
            f"bfloat16 GEMM measured {slow:.1f}x slower than float32 on this CPU (no fast bfloat16 path): "
            "computing in float32, at twice the weights' and the KV cache's memory",
            round(bf16, 3),
            round(f32, 3),
        )
    else:
        choice = DtypeChoice(
            name, name, f"bfloat16 GEMM measured {slow:.2f}x float32's time", round(bf16, 3), round(f32, 3)
        )
    _store_json(key, dataclasses.asdict(choice))
    return choice
