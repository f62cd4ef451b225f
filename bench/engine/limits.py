"""This machine's physical limits for the model, measured in the benchmark's own run: GEMMs at
SmolLM2-135M's shapes (float32 and bfloat16, prepacked oneDNN and torch's default path, the
faster counts) and a memory copy."""

from __future__ import annotations

import time
from typing import Any

import torch
import torch.nn.functional as F

from services.worker.model.kernels import cpu_model

# (out, in) of the fused projections of one layer: QKV (9 query heads and 3 KV heads of 64), O,
# gate+up, down.
SHAPES = ((960, 576), (576, 576), (3072, 576), (576, 1536))
ROWS = 1024


def _best(fn: Any, reps: int = 5) -> float:
    fn()
    best = float("inf")
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t)
    return best


def gemm_gflops(dtype: torch.dtype, rows: int = ROWS) -> float:
    """Best GFLOP/s over the layer's four GEMMs at `rows` rows, of F.linear and of the
    prepacked oneDNN path (whichever is faster is the machine's attainable rate)."""
    g = torch.Generator().manual_seed(0)
    ws = [torch.randn(o, i, generator=g).to(dtype) for o, i in SHAPES]
    xs = [torch.randn(rows, i, generator=g).to(dtype) for _, i in SHAPES]
    flop = sum(2 * rows * o * i for o, i in SHAPES)
    times = [_best(lambda: [F.linear(x, w) for x, w in zip(xs, ws, strict=True)])]
    try:
        packed = [torch.ops.mkldnn._reorder_linear_weight(w, 32) for w in ws]
        times.append(
            _best(
                lambda: [
                    torch.ops.mkldnn._linear_pointwise(x, p, None, "none", [], "")
                    for x, p in zip(xs, packed, strict=True)
                ]
            )
        )
    except (AttributeError, RuntimeError):
        pass
    return flop / min(times) / 1e9


def copy_gbps(nbytes: int = 512 << 20) -> float:
    """Bytes read + written per second by a copy of `nbytes` (pages touched first)."""
    src = torch.ones(nbytes // 4)
    dst = torch.zeros_like(src)
    return 2 * nbytes / _best(lambda: dst.copy_(src), reps=3) / 1e9


def read_gbps(nbytes: int = 512 << 20) -> float:
    """Bytes read per second by a sum over `nbytes` (pages touched first): what a decode step,
    which reads every weight once, is bound by."""
    src = torch.ones(nbytes // 4)
    return nbytes / _best(lambda: src.sum(), reps=3) / 1e9


def measure(threads: int) -> dict[str, Any]:
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        fp32 = gemm_gflops(torch.float32)
        bf16 = gemm_gflops(torch.bfloat16)
        copy = copy_gbps()
        read = read_gbps()
    finally:
        torch.set_num_threads(before)
    return {
        "threads": threads,
        "cpu": cpu_model(),
        "gemm_rows": ROWS,
        "gemm_gflops": {"float32": round(fp32, 1), "bfloat16": round(bf16, 1)},
        "copy_gbps_read_plus_write": round(copy, 1),
        "read_gbps": round(read, 1),
        # A decode step reads every weight once: 538 MB in float32, 269 MB in bfloat16.
        "decode_step_floor_ms": {
            "float32": round(538e6 / (read * 1e9) * 1000, 1),
            "bfloat16": round(269e6 / (read * 1e9) * 1000, 1),
        },
    }
