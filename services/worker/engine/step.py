"""One engine iteration as plain data: the `StepPlan` that `Engine.plan` decides (its rows, the
compute thread's input, ZigZag work) and the `StepOutputs` of the model that `Engine.apply` books.
Built and read on the event loop; the compute thread reads only `StepPlan.inputs`."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from services.worker.engine.request import EngineRequest
from services.worker.engine.sampling import SampleOutput, SamplingParams, TokenHistory, TopLogprobs


@dataclass(frozen=True)
class PromptWork:
    """Prompt log-probs wanted from row `row` of a step: its new tokens, in order, predict
    `targets` (the prompt token after each)."""

    row: int
    targets: list[int]
    k: int


@dataclass(frozen=True)
class Continuation:
    """ZigZag, the full partner: a prompt's remaining layers [layer_start, L) from `hidden`, for
    its `num_tokens` positions from `context_len` (a chunk, when the prompt is longer than a
    step's budget; the earlier chunks' KV of those layers is in the cache). `sample`: the last
    chunk, whose last position gives the first token."""

    row: int
    layer_start: int
    hidden: torch.Tensor
    num_tokens: int
    block_table: list[int]
    context_len: int = 0
    sample: bool = True


@dataclass(frozen=True)
class Partial:
    """ZigZag, a loading instance: layers [layer_start, layer_end) of `seq`'s prompt."""

    seq: EngineRequest
    layer_start: int
    layer_end: int
    num_tokens: int
    block_table: list[int]
    # The hidden states after layer_start (None from the embedding), taken when the step is
    # planned: the compute thread must not read `seq`, which an abort may clear meanwhile.
    hidden: torch.Tensor | None = None


@dataclass(frozen=True)
class StepInput:
    """One step's work. The regular batch is indexed locally (`regular_rows[i]` is its row in the
    plan); `sample_rows` lists plan rows in sampling order: regular ones, then continuations."""

    input_ids: list[int]
    query_lens: list[int]
    context_lens: list[int]
    block_tables: list[list[int]]
    sample_rows: list[int]
    params: list[SamplingParams]
    generators: list[torch.Generator | None]
    histories: list[TokenHistory | None] = field(default_factory=list)
    prompt_work: list[PromptWork] = field(default_factory=list)
    regular_rows: list[int] = field(default_factory=list)
    logits_local: list[int] = field(default_factory=list)
    continuations: list[Continuation] = field(default_factory=list)
    partials: list[Partial] = field(default_factory=list)


@dataclass(frozen=True)
class StepRow:
    """Row `i` of a step's plan: `num_tokens` of `seq`'s tokens from `start` (its `num_computed`
    when planned). 0 tokens: a ZigZag continuation given only a chunk of its prompt, which waits
    for a step with room for all of it."""

    seq: EngineRequest
    start: int
    num_tokens: int


@dataclass(frozen=True)
class StepPlan:
    """One iteration, decided and booked on the scheduler's side (admissions made, blocks
    allocated), for the model to run (`inputs`) and `Engine.apply` to book from its outputs."""

    now_s: float  # when the step began (what the plan's time-dependent decisions used)
    backlogged: bool  # requests were queued when the step began
    admitted: tuple[str, ...]  # requests admitted by this step, in admission order
    # What the scheduler gave each request, (request_id, tokens), decodes first; requests whose
    # KV is arriving from a peer are left out. `rows[i]` is `work[i]`'s row.
    work: tuple[tuple[str, int], ...]
    rows: tuple[StepRow, ...]
    inputs: StepInput
    # Requests admitted by this step whose first tokens' KV (or first layers) a peer's pull
    # brings; the engine starts the pulls (`Engine._start_fills`).
    fills: tuple[EngineRequest, ...] = ()
    prefill_tokens: int = 0  # prompt (and resumed) tokens computed by the step
    paced_tokens: float = 0.0  # the step's tokens as pacing counts them (a layer range by its share)

    @property
    def is_empty(self) -> bool:
        """Nothing to run: nothing fits, or every request waits for a KV pull, a layer or a relay."""
        return not self.rows and not self.inputs.partials

    @property
    def request_ids(self) -> frozenset[str]:
        """The requests the compute thread works on in this step."""
        return frozenset(r.seq.request_id for r in self.rows) | {p.seq.request_id for p in self.inputs.partials}


@dataclass(frozen=True)
class StepOutputs:
    """What the model computed for a plan's `inputs`: a sampled token per `sample_rows` entry (in
    that order), prompt log-probs per `prompt_work` entry, the hidden states per partial."""

    sampled: SampleOutput | None = None
    prompt_logprobs: Sequence[Sequence[tuple[float, TopLogprobs]]] = ()
    hidden: Sequence[torch.Tensor] = ()
    started_s: float | None = None  # when the model began the step (None: at `apply`'s now_s)
    compute_s: float = 0.0  # the model's own time, pacing excluded
