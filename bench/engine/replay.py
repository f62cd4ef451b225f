"""Our own light OpenAI-API client: the busiest minute of the Azure LLM conversation trace
replayed, and prefill timed one request at a time.

The minute (`trace_minute.json`, 522 arrivals and 760k prompt tokens, prompts averaging 1,457
tokens) offers some 12,700 prompt tokens/s: about fifteen times what either engine prefills on
2 cores, so replayed whole it only measures how fast a queue grows. It is thinned instead, the
same way for both servers: every k-th arrival, k the smallest that brings the offered prompt
load under `OFFERED_TOK_S`, prompts cut at `MAX_PROMPT` tokens, outputs clamped to
[1, `MAX_OUTPUT`]. Arrival times are kept. Prompts are seeded random token ids (no prefix is
shared: prefix caching is off in both servers anyway), `ignore_eos`, greedy, streamed; TTFT is
from the scheduled arrival to the first streamed token.
"""

from __future__ import annotations

import asyncio
import json
import random
import time
from pathlib import Path
from typing import Any

import aiohttp

from blitzmesh.replay.summary import percentile

MINUTE = Path(__file__).with_name("trace_minute.json")
OFFERED_TOK_S = 300.0
MAX_PROMPT = 2048
MAX_OUTPUT = 128


def load_minute() -> list[list[float]]:
    """[arrival_s, prompt_tokens, output_tokens] of every request of the stored minute."""
    return json.loads(MINUTE.read_text())["requests"]


def thin(
    minute: list[list[float]], span_s: float, offered_tok_s: float = OFFERED_TOK_S
) -> tuple[int, list[list[float]]]:
    """(k, every k-th request of the first `span_s` seconds, prompts cut and outputs clamped),
    k the smallest stride whose offered prompt tokens/s is at most `offered_tok_s`."""
    window = [[t, min(int(p), MAX_PROMPT), max(1, min(int(o), MAX_OUTPUT))] for t, p, o in minute if t < span_s]
    if not window:
        raise ValueError(f"no request in the first {span_s} s of the minute")
    for k in range(1, len(window) + 1):
        picked = window[::k]
        if sum(p for _, p, _ in picked) / span_s <= offered_tok_s:
            return k, picked
    return len(window), window[:1]


async def _one(
    session: aiohttp.ClientSession, url: str, model: str, at_s: float, t0: float, prompt: list[int], n: int
) -> dict[str, Any]:
    await asyncio.sleep(max(0.0, t0 + at_s - time.perf_counter()))
    start = t0 + at_s
    body = {"model": model, "prompt": prompt, "max_tokens": n, "temperature": 0, "ignore_eos": True, "stream": True}
    first = None
    tokens = 0
    async with session.post(f"{url}/v1/completions", json=body) as r:
        if r.status != 200:
            return {"error": f"HTTP {r.status}: {(await r.text())[:200]}"}
        async for line in r.content:
            if line.startswith(b"data: {"):
                chunk = json.loads(line[6:])
                if chunk.get("choices") and chunk["choices"][0].get("text") is not None:
                    tokens += 1
                    if first is None:
                        first = time.perf_counter()
    end = time.perf_counter()
    if first is None:
        return {"error": "no token streamed"}
    return {"ttft_s": first - start, "e2e_s": end - start, "end_s": end - t0, "chunks": tokens}


def prefill(url: str, model: str, prompt_tokens: int, requests: int, seed: int = 1) -> dict[str, Any]:
    """One request at a time, each a fresh random prompt of exactly `prompt_tokens` token ids and
    one output token: median TTFT and prompt tokens / median TTFT."""
    rng = random.Random(seed + prompt_tokens)

    async def run() -> list[dict[str, Any]]:
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=None, sock_read=600)) as session:
            out = []
            for _ in range(requests):
                prompt = [rng.randrange(100, 40000) for _ in range(prompt_tokens)]
                out.append(await _one(session, url, model, 0.0, time.perf_counter(), prompt, 1))
            return out

    results = asyncio.run(run())
    bad = [r["error"] for r in results if "error" in r]
    if bad:
        raise RuntimeError(f"prefill of {prompt_tokens} tokens failed: {bad[:3]}")
    ttft = percentile([r["ttft_s"] for r in results], 0.5)
    assert ttft is not None
    return {"ttft_s_median": round(ttft, 4), "tok_s": round(prompt_tokens / ttft, 1), "requests": requests}


def _rounded(x: float | None) -> float | None:
    return None if x is None else round(x, 3)


def replay_minute(url: str, model: str, minute: list[list[float]], span_s: float, seed: int = 0) -> dict[str, Any]:
    """Replay the thinned window and report TTFT p50/p99 (seconds) and what was sent."""
    k, picked = thin(minute, span_s)
    rng = random.Random(seed)
    prompts = [[rng.randrange(100, 40000) for _ in range(int(p))] for _, p, _ in picked]

    async def run() -> list[dict[str, Any]]:
        timeout = aiohttp.ClientTimeout(total=None, sock_read=600)
        async with aiohttp.ClientSession(timeout=timeout) as session:
            t0 = time.perf_counter() + 0.5
            return await asyncio.gather(
                *(
                    _one(session, url, model, float(t), t0, prompt, int(o))
                    for (t, _, o), prompt in zip(picked, prompts, strict=True)
                )
            )

    results = asyncio.run(run())
    ok = [r for r in results if "ttft_s" in r]
    ttfts = sorted(r["ttft_s"] for r in ok)
    return {
        "stride": k,
        "span_s": span_s,
        "requests": len(picked),
        "completed": len(ok),
        "errors": [r["error"] for r in results if "error" in r][:5],
        "offered_prompt_tok_s": round(sum(p for _, p, _ in picked) / span_s, 1),
        "output_tokens": int(sum(o for _, _, o in picked)),
        "ttft_p50_s": _rounded(percentile(ttfts, 0.50)),
        "ttft_p99_s": _rounded(percentile(ttfts, 0.99)),
        "e2e_p50_s": _rounded(percentile([r["e2e_s"] for r in ok], 0.50)),
        # From the first scheduled arrival until the last request's last token.
        "drain_s": _rounded(max((r["end_s"] for r in ok), default=None)),
    }
