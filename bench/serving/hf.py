"""System (c): `transformers` LlamaForCausalLM.generate on the same checkpoint, greedy, fp32.

(c1) one request at a time in arrival order; (c2) static batches in arrival order, left-padded,
each batch generating until its longest member is done. Token times come from a streamer, which
`generate` calls once per decoding step (after the step's tokens exist).
"""

from __future__ import annotations

import time
from pathlib import Path

import torch
from transformers import LlamaForCausalLM
from transformers.generation.streamers import BaseStreamer
from transformers.utils import logging as hf_logging

from bench.serving.results import RequestTiming, SystemResult
from bench.serving.workload import Request

PAD_ID = 0  # <unk>; masked out by the attention mask, so its value does not matter


class _StepClock(BaseStreamer):
    """Records when each decoding step's tokens exist; `put` first receives the prompt."""

    def __init__(self, t0: float) -> None:
        self.t0 = t0
        self.step_times_s: list[float] = []
        self._prompt_seen = False

    def put(self, value: torch.Tensor) -> None:
        if not self._prompt_seen:
            self._prompt_seen = True
            return
        self.step_times_s.append(time.perf_counter() - self.t0)

    def end(self) -> None:
        pass


def load(model_path: Path) -> LlamaForCausalLM:
    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    model = LlamaForCausalLM.from_pretrained(str(model_path), dtype=torch.float32)
    model.eval()
    # ignore_eos: every request generates exactly max_new_tokens, as in the other systems.
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = PAD_ID
    return model


def _generate(model: LlamaForCausalLM, batch: list[Request], t0: float) -> tuple[list[RequestTiming], int]:
    """One generate() call over `batch` (left-padded); returns timings and tokens computed."""
    width = max(r.prompt_tokens for r in batch)
    ids = torch.full((len(batch), width), PAD_ID, dtype=torch.long)
    mask = torch.zeros((len(batch), width), dtype=torch.long)
    for row, r in enumerate(batch):
        ids[row, width - r.prompt_tokens :] = torch.tensor(r.prompt_ids, dtype=torch.long)
        mask[row, width - r.prompt_tokens :] = 1
    steps = max(r.output_tokens for r in batch)
    clock = _StepClock(t0)
    with torch.inference_mode():
        out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=steps, do_sample=False, streamer=clock)
    if out.shape[1] - width != steps or len(clock.step_times_s) != steps:
        raise RuntimeError(
            f"HF generated {out.shape[1] - width} tokens in {len(clock.step_times_s)} steps, asked {steps}"
        )
    # A request's tokens are the first `output_tokens` steps; later steps are padding work.
    timings = [RequestTiming(r.index, r.output_tokens, clock.step_times_s[: r.output_tokens]) for r in batch]
    return timings, steps * len(batch)


class HFSystem:
    """`generate` over the requests in arrival order, `batch_size` at a time (1 = sequential)."""

    def __init__(self, model: LlamaForCausalLM, batch_size: int) -> None:
        self.model = model
        self.batch_size = batch_size
        self.name = "hf_sequential" if batch_size == 1 else f"hf_static_b{batch_size}"

    def serve(self, requests: list[Request]) -> SystemResult:
        timings: list[RequestTiming] = []
        computed = 0
        t0 = time.perf_counter()
        for start in range(0, len(requests), self.batch_size):
            batch_timings, n = _generate(self.model, requests[start : start + self.batch_size], t0)
            timings.extend(batch_timings)
            computed += n
        return SystemResult(
            name=self.name,
            wall_s=time.perf_counter() - t0,
            useful_tokens=sum(r.output_tokens for r in requests),
            requests=timings,
            computed_tokens=computed,
            notes={"batch_size": self.batch_size},
        )
