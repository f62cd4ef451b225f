"""The varlen prefill kernel per instruction set against torch's own attention, on the default
model's shapes (9 query heads, 3 KV heads, head size 64; a paged cache of 16-token blocks).

Builds `varlen._SOURCE` directly for each set of compiler flags (the portable C path with none,
the AVX2 + FMA path with `-mavx2 -mfma -mf16c`) and times a call of each against torch SDPA as the
engine's torch paths run it: a fresh prompt causal over its own K/V (`is_causal=True`,
`enable_gqa=True`), a chunk after cached context over the keys gathered from the cache with a
boolean mask. Float32 and bfloat16 (queries, cache and output in bfloat16; float32 math inside
the kernel), 2 threads, medians of repeated calls. Writes bench/results/varlen_isa.json.

    python -m bench.engine.varlen_avx2 [--repeats 7] [--out bench/results/varlen_isa.json]
"""

from __future__ import annotations

import argparse
import ctypes
import json
import platform
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F

from services.worker.model import native, varlen
from services.worker.model.varlen_reference import reference_prefill

HEADS, KV_HEADS, D, BS = 9, 3, 64, 16
THREADS = 2
# (name, new tokens, cached tokens before them)
CASES = (("fresh_256", 256, 0), ("fresh_1024", 1024, 0), ("fresh_2048", 2048, 0), ("chunk_512_after_1536", 512, 1536))
VARIANTS = {"portable": [], "avx2": ["-mavx2", "-mfma", "-mf16c"]}
SUFFIX = {torch.float32: "f32", torch.bfloat16: "bf16io"}


def _cpu() -> dict[str, object]:
    model, flags = "", []
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name") and not model:
                model = line.split(":", 1)[1].strip()
            elif line.startswith("flags") and not flags:
                flags = line.split(":", 1)[1].split()
    except OSError:
        pass
    wanted = ("avx", "avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512vl", "avx512dq", "avx512_bf16")
    return {
        "model": model,
        "vector_flags": [f for f in wanted if f in flags],
        "flags": sorted(flags),
        "machine": platform.machine(),
    }


def _entry(flags: list[str], dtype: torch.dtype) -> Callable[..., int]:
    lib = ctypes.CDLL(str(native.build_library(varlen._SOURCE, "paged_prefill", flags)))
    fn = getattr(lib, f"paged_prefill_{SUFFIX[dtype]}")
    i64, ptr = ctypes.c_int64, ctypes.c_void_p
    fn.argtypes = [ptr, i64, ptr, ptr, ptr, i64, ptr, ptr, ptr, i64, i64, i64, i64, i64, ctypes.c_float, i64, ptr, i64]
    fn.restype = ctypes.c_int
    return fn  # type: ignore[no-any-return]


def _interleaved_ms(calls: dict[str, Callable[[], object]], repeats: int) -> dict[str, float]:
    """Median wall ms of each call, the calls taking turns (A/B back to back, so a change in the
    machine's load hits all of them alike)."""
    for call in calls.values():
        call()  # warm-up (and first touch of scratch)
    times: dict[str, list[float]] = {name: [] for name in calls}
    for _ in range(repeats):
        for name, call in calls.items():
            t0 = time.perf_counter()
            call()
            times[name].append((time.perf_counter() - t0) * 1e3)
    return {name: statistics.median(ts) for name, ts in times.items()}


def _cpu_ms(call: Callable[[], object], repeats: int) -> float:
    """Least CPU time of the calling thread over the repeats (one thread: not counting the time
    other jobs on the machine held the core)."""
    call()
    best = float("inf")
    for _ in range(repeats):
        t0 = time.thread_time()
        call()
        best = min(best, (time.thread_time() - t0) * 1e3)
    return best


def _case(n: int, ctx: int, dtype: torch.dtype, repeats: int, g: torch.Generator) -> dict[str, float]:
    total = ctx + n
    blocks = (total + BS - 1) // BS
    k_cache = torch.randn(blocks + 3, BS, KV_HEADS, D, generator=g).to(dtype)
    v_cache = torch.randn(blocks + 3, BS, KV_HEADS, D, generator=g).to(dtype)
    table = torch.randperm(blocks + 3, generator=g)[:blocks].view(1, -1).contiguous()
    q = torch.randn(n, HEADS, D, generator=g).to(dtype)
    q_row0, q_len, ctxs = torch.tensor([0]), torch.tensor([n]), torch.tensor([ctx])
    out = torch.empty(n, HEADS, D, dtype=dtype)
    scale = D**-0.5

    res: dict[str, float] = {}
    runs: dict[str, Callable[..., torch.Tensor]] = {}
    for name, flags in VARIANTS.items():
        fn = _entry(flags, dtype)

        def run(fn: Callable[..., int] = fn, threads: int = THREADS) -> torch.Tensor:
            rc = fn(
                q.data_ptr(), q.stride(0), k_cache.data_ptr(), v_cache.data_ptr(), table.data_ptr(), table.shape[1],
                q_row0.data_ptr(), q_len.data_ptr(), ctxs.data_ptr(), 1, HEADS, KV_HEADS, D, BS, scale, 0,
                out.data_ptr(), threads,
            )  # fmt: skip
            assert rc == 0
            return out

        runs[name] = run

    # torch as the engine runs it
    flat = table.view(-1)
    if ctx == 0:
        keys = k_cache[flat].reshape(-1, KV_HEADS, D)[:n]
        values = v_cache[flat].reshape(-1, KV_HEADS, D)[:n]

        def torch_run() -> torch.Tensor:
            qs, ks, vs = (x.unsqueeze(0).transpose(1, 2) for x in (q, keys, values))
            o = F.scaled_dot_product_attention(qs, ks, vs, is_causal=True, enable_gqa=True)
            return o[0].transpose(0, 1)
    else:
        mask = torch.arange(blocks * BS).view(1, -1) <= torch.arange(ctx, total).view(-1, 1)

        def torch_run() -> torch.Tensor:
            kb, vb = k_cache.index_select(0, flat), v_cache.index_select(0, flat)
            ks = kb.view(1, -1, KV_HEADS, D).transpose(1, 2)
            vs = vb.view(1, -1, KV_HEADS, D).transpose(1, 2)
            o = F.scaled_dot_product_attention(q.unsqueeze(0).transpose(1, 2), ks, vs, attn_mask=mask, enable_gqa=True)
            return o[0].transpose(0, 1)

    calls: dict[str, Callable[[], object]] = {**runs, "torch": torch_run}
    for name, ms in _interleaved_ms(calls, repeats).items():
        res[f"{name}_ms"] = ms
    # One thread, CPU time (the AVX2 kernel and torch; the portable path is far behind either way)
    torch.set_num_threads(1)
    try:
        res["avx2_cpu_ms_1thread"] = _cpu_ms(lambda: runs["avx2"](threads=1), repeats)
        res["torch_cpu_ms_1thread"] = _cpu_ms(torch_run, repeats)
    finally:
        torch.set_num_threads(THREADS)
    res["torch_over_avx2_cpu_1thread"] = res["torch_cpu_ms_1thread"] / res["avx2_cpu_ms_1thread"]
    results = {name: run().clone() for name, run in runs.items()}
    want = reference_prefill(q, k_cache, v_cache, table[0].tolist(), ctx)
    for name in VARIANTS:
        res[f"torch_over_{name}"] = res["torch_ms"] / res[f"{name}_ms"]
        res[f"{name}_max_err"] = (results[name].float() - want).abs().max().item()
    res["torch_max_err"] = (torch_run().float() - want).abs().max().item()
    return res


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--out", default="bench/results/varlen_isa.json")
    ap.add_argument("--cases", nargs="*", default=[c[0] for c in CASES])
    args = ap.parse_args()
    torch.set_num_threads(THREADS)
    g = torch.Generator().manual_seed(0)
    report: dict[str, object] = {
        "cpu": _cpu(),
        "torch": torch.__version__,
        "threads": THREADS,
        "shapes": {"heads": HEADS, "kv_heads": KV_HEADS, "head_dim": D, "block_size": BS},
        "variants": {k: v for k, v in VARIANTS.items()},
        "repeats": args.repeats,
        "cases": {},
    }
    cases: dict[str, object] = {}
    for dtype in (torch.float32, torch.bfloat16):
        for name, n, ctx in CASES:
            if name not in args.cases:
                continue
            key = f"{name}_{SUFFIX[dtype] if dtype == torch.float32 else 'bf16'}"
            r = _case(n, ctx, dtype, args.repeats, g)
            cases[key] = r
            print(
                f"{key:32s} portable {r['portable_ms']:9.2f} ms  avx2 {r['avx2_ms']:8.2f} ms  torch {r['torch_ms']:8.2f} ms"
                f"  torch/portable {r['torch_over_portable']:.3f}  torch/avx2 {r['torch_over_avx2']:.3f}"
                f"  1 thread CPU: avx2 {r['avx2_cpu_ms_1thread']:.2f} torch {r['torch_cpu_ms_1thread']:.2f} ms"
                f"  err avx2 {r['avx2_max_err']:.2g} torch {r['torch_max_err']:.2g}",
                flush=True,
            )
    report["cases"] = cases
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(report, indent=2) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
