"""The benchmark's workload: 32 (prompt, output) lengths drawn from the Azure conversation trace,
scaled to the model, with deterministic prompt token ids. Every system serves this same list."""

from __future__ import annotations

import csv
import random
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from blitzmesh.replay.trace import repo_relative

# Ids 0..2 are <unk>, <s>, </s> in the synthetic tokenizers; prompts start with <s> and use
# ordinary tokens after it, as a tokenized text would.
BOS_ID = 1
FIRST_ORDINARY_ID = 3


@dataclass(frozen=True)
class Request:
    index: int
    prompt_ids: tuple[int, ...]
    output_tokens: int
    trace_prompt_tokens: int  # the trace row before scaling
    trace_output_tokens: int

    @property
    def prompt_tokens(self) -> int:
        return len(self.prompt_ids)


@dataclass(frozen=True)
class WorkloadSpec:
    num_requests: int
    max_prompt_tokens: int  # the longest sampled prompt is scaled to this; the rest keep their ratio
    output_scale: float  # trace output lengths are multiplied by this, then clamped
    min_output_tokens: int
    max_output_tokens: int
    seed: int


def read_trace(path: Path) -> list[tuple[int, int]]:
    """(ContextTokens, GeneratedTokens) of every row, in file order."""
    with path.open(newline="", encoding="utf-8") as f:
        reader = csv.DictReader(f)
        missing = {"ContextTokens", "GeneratedTokens"} - set(reader.fieldnames or ())
        if missing:
            raise ValueError(f"trace {str(path)!r} lacks columns {sorted(missing)}; has {reader.fieldnames!r}")
        return [(int(row["ContextTokens"]), int(row["GeneratedTokens"])) for row in reader]


def build(trace_path: Path, spec: WorkloadSpec, vocab_size: int) -> list[Request]:
    """Sample `num_requests` rows (fixed seed), scale prompts by one factor so the longest is
    `max_prompt_tokens`, scale outputs by `output_scale` and clamp them to [min, max]; prompt ids
    are seeded random ordinary tokens."""
    rows = read_trace(trace_path)
    if len(rows) < spec.num_requests:
        raise ValueError(f"trace {str(trace_path)!r} has {len(rows)} rows, need {spec.num_requests}")
    rng = random.Random(spec.seed)
    picked = rng.sample(rows, spec.num_requests)
    scale = spec.max_prompt_tokens / max(p for p, _ in picked)
    requests = []
    for i, (prompt, output) in enumerate(picked):
        n_prompt = max(2, round(prompt * scale))
        n_out = min(max(round(output * spec.output_scale), spec.min_output_tokens), spec.max_output_tokens)
        ids = (BOS_ID, *(rng.randrange(FIRST_ORDINARY_ID, vocab_size) for _ in range(n_prompt - 1)))
        requests.append(Request(i, ids, n_out, prompt, output))
    return requests


def describe(requests: list[Request], spec: WorkloadSpec, trace_path: Path) -> dict[str, Any]:
    prompts = [r.prompt_tokens for r in requests]
    outputs = [r.output_tokens for r in requests]
    return {
        "trace": repo_relative(trace_path),
        "requests": len(requests),
        "seed": spec.seed,
        "sampling": "random.Random(seed).sample of trace rows; greedy decoding, ignore_eos",
        "prompt_scaling": f"x{spec.max_prompt_tokens / max(r.trace_prompt_tokens for r in requests):.4f} "
        f"(longest sampled prompt -> {spec.max_prompt_tokens} tokens)",
        "output_scaling": f"x{spec.output_scale} then clamped to [{spec.min_output_tokens}, {spec.max_output_tokens}]",
        "prompt_tokens": {
            "total": sum(prompts),
            "min": min(prompts),
            "max": max(prompts),
            "mean": round(sum(prompts) / len(prompts), 1),
        },
        "output_tokens": {
            "total": sum(outputs),
            "min": min(outputs),
            "max": max(outputs),
            "mean": round(sum(outputs) / len(outputs), 1),
        },
        "arrival": "closed batch: all requests submitted at t=0; TTFT counts from t=0",
    }
