"""GuideLLM as the load generator: one `guidellm run` per measurement, its JSON report reduced
to the figures the benchmark compares."""

from __future__ import annotations

import json
import subprocess
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any


def warm_up(url: str, model: str, within_s: float = 60.0) -> None:
    """One short completion, so neither server's first-request costs land in a measurement;
    retried for up to `within_s` (a server just resumed from a pause may answer 503 until its
    parts have heard from each other again)."""
    body = json.dumps({"model": model, "prompt": "Hello there", "max_tokens": 8, "temperature": 0}).encode()
    deadline = time.monotonic() + within_s
    while True:
        req = urllib.request.Request(f"{url}/v1/completions", body, {"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(req, timeout=120) as r:
                r.read()
            return
        except (urllib.error.HTTPError, urllib.error.URLError) as e:
            if time.monotonic() > deadline:
                raise RuntimeError(f"warm-up of {url} failed for {within_s} s: {e}") from e
            time.sleep(0.5)


def _successful(metrics: dict[str, Any], key: str) -> dict[str, Any]:
    value = metrics.get(key) or {}
    return value.get("successful") or {}


def summarize(report: dict[str, Any]) -> dict[str, Any]:
    """The figures of a one-benchmark GuideLLM report: TTFT and ITL medians (ms), output tok/s
    (output tokens of the completed requests over the run's duration), requests completed."""
    bench = report["benchmarks"][0]
    m = bench["metrics"]
    ttft = _successful(m, "time_to_first_token_ms")
    itl = _successful(m, "inter_token_latency_ms")
    out_tokens = _successful(m, "output_token_count")
    totals = m.get("request_totals") or {}
    duration = float(bench.get("duration", 0.0))
    if not ttft.get("count"):
        raise RuntimeError(f"GuideLLM run completed no request: totals {totals}")
    return {
        "ttft_ms_median": round(float(ttft["median"]), 2),
        "ttft_ms_p99": round(float(ttft["percentiles"]["p99"]), 2),
        "itl_ms_median": round(float(itl["median"]), 2) if itl.get("count") else None,
        "itl_ms_mean": round(float(itl["mean"]), 2) if itl.get("count") else None,
        # Every request of a count-bounded run completes: its output tokens over the run's span.
        # (GuideLLM's own `output_tokens_per_second` mean is the mean of a per-interval series,
        # which read the same 51.2 for both servers at concurrency 4 and 16 in a 20 s window.)
        "output_tok_s": round(float(out_tokens.get("total_sum", 0.0)) / duration, 2) if duration else None,
        "output_tokens": int(out_tokens.get("total_sum", 0)),
        "requests": totals,
        "duration_s": round(duration, 2),
    }


def guidellm_run(
    env: Path,
    url: str,
    model: str,
    tokenizer_dir: Path,
    *,
    prompt_tokens: int,
    output_tokens: int,
    streams: int,
    max_requests: int | None = None,
    max_seconds: float | None = None,
) -> dict[str, Any]:
    """`guidellm run` with synthetic prompts at a fixed concurrency against /v1/completions."""
    if (max_requests is None) == (max_seconds is None):
        raise ValueError("give exactly one of max_requests and max_seconds")
    constraint = (
        f"kind=max_requests,count={max_requests}"
        if max_requests is not None
        else f"kind=max_duration,seconds={max_seconds}"
    )
    env, tokenizer_dir = env.resolve(), tokenizer_dir.resolve()  # guidellm runs in a scratch directory
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "report.json"
        cmd = [
            str(env / "bin" / "guidellm"), "run",
            "--backend", f"kind=openai_http,target={url},model={model},request_format=/v1/completions",
            "--data", f"kind=synthetic_text,prompt_tokens={prompt_tokens},output_tokens={output_tokens}",
            "--profile", f"kind=concurrent,streams={streams}",
            "--constraint", constraint,
            "--tokenizer", f"kind=huggingface_auto,model={tokenizer_dir}",
            "--output", f"kind=json,path={out}",
            "--disable-console",
        ]  # fmt: skip
        done = subprocess.run(cmd, capture_output=True, text=True, cwd=tmp, timeout=900)
        if done.returncode != 0 or not out.exists():
            raise RuntimeError(f"guidellm failed ({done.returncode}): {' '.join(cmd)}\n{done.stderr[-3000:]}")
        return summarize(json.loads(out.read_text()))
