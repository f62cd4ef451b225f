"""The engine's GEMM paths against each other on this CPU, at the default model's projection
shapes and the row counts a serving step has (1 to 2,048 rows).

Paths: `F.linear` on the plain weight (torch's default CPU GEMM), oneDNN's GEMM on a prepacked
weight (what `llama.Linear` runs for every row count above the small GEMM's), and the native
small GEMM (`small_gemm.py`, up to `MAX_ROWS` rows) at each level this CPU runs. For each shape
and row count, the median wall time of the calls taking turns, and GFLOP/s; per row count, the
sum over the layer's projections (q, k, v, o, gate+up, down), as a decoder layer runs them.
Float32 and bfloat16, 2 threads. Writes bench/results/gemm_paths_<isa>.json.

    python -m bench.engine.gemm_paths [--repeats 9] [--out FILE]
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F

from bench.engine.varlen_avx2 import _cpu, _interleaved_ms
from services.worker.model import native, small_gemm

THREADS = 2  # --threads
# SmolLM2-135M's projections of one decoder layer: (name, out, in).
SHAPES = (("qkv", 576 + 2 * 192, 576), ("o", 576, 576), ("gate_up", 2 * 1536, 576), ("down", 576, 1536))
ROWS = (1, 4, 16, 32, 64, 256, 1024, 2048)


def _paths(w: torch.Tensor, rows: int) -> dict[str, Callable[[torch.Tensor], torch.Tensor]]:
    paths: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {"f_linear": lambda x: F.linear(x, w)}
    try:
        packed = torch.ops.mkldnn._reorder_linear_weight(w, 32)
        paths["onednn_packed"] = lambda x: torch.ops.mkldnn._linear_pointwise(x, packed, None, "none", [], "")
    except (AttributeError, RuntimeError):
        pass
    if rows <= small_gemm.MAX_ROWS:
        for isa in native.runnable_isas():
            kernel = small_gemm.small_gemm_at(isa)
            if kernel is None or not kernel.packable(w) or (w.dtype == torch.bfloat16 and not kernel.bf16):
                continue
            pairs, n = kernel.pack(w), w.shape[0]
            paths[f"small_gemm_{isa}"] = lambda x, k=kernel, p=pairs, n=n: k(x, p, n)
    return paths


def measure(dtype: torch.dtype, repeats: int) -> dict[str, object]:
    g = torch.Generator().manual_seed(0)
    weights = {name: torch.randn(n, k, generator=g).to(dtype) for name, n, k in SHAPES}
    per_rows: dict[str, object] = {}
    for rows in ROWS:
        layer_ms: dict[str, float] = {}
        shapes: dict[str, object] = {}
        for name, n, k in SHAPES:
            x = torch.randn(rows, k, generator=g).to(dtype)
            paths = _paths(weights[name], rows)
            ms = _interleaved_ms({p: (lambda f=f, x=x: f(x)) for p, f in paths.items()}, repeats)
            flop = 2 * rows * n * k
            shapes[name] = {p: {"ms": round(t, 4), "gflops": round(flop / t / 1e6, 1)} for p, t in ms.items()}
            for p, t in ms.items():
                layer_ms[p] = layer_ms.get(p, 0.0) + t
        best = min(layer_ms, key=lambda p: layer_ms[p])
        per_rows[str(rows)] = {
            "layer_ms": {p: round(t, 4) for p, t in layer_ms.items()},
            "fastest": best,
            "onednn_over_f_linear": round(layer_ms["f_linear"] / layer_ms["onednn_packed"], 3)
            if "onednn_packed" in layer_ms
            else None,
            "shapes": shapes,
        }
        print(
            f"{str(dtype).removeprefix('torch.'):9s} rows {rows:5d}  "
            + "  ".join(f"{p} {t:7.3f} ms" for p, t in layer_ms.items())
            + f"  fastest {best}",
            flush=True,
        )
    return per_rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--repeats", type=int, default=9)
    ap.add_argument("--out", default=None)
    ap.add_argument("--threads", type=int, default=THREADS)
    ap.add_argument("--dtypes", default="float32,bfloat16")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    isa = native.machine_isa()
    report = {
        "about": "python -m bench.engine.gemm_paths: each GEMM path of the engine per row count, the calls "
        "taking turns (medians); layer_ms sums the default model's 4 projection shapes of one layer",
        "cpu": _cpu(),
        "machine_isa": isa,
        "torch": torch.__version__,
        "threads": args.threads,
        "shapes": {name: [n, k] for name, n, k in SHAPES},
        "dtypes": {d: measure(getattr(torch, d), args.repeats) for d in args.dtypes.split(",")},
    }
    out = Path(args.out or f"bench/results/gemm_paths_{isa}_{args.threads}t.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=2) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
