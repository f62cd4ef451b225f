"""The worker's in-process engine: iteration-level continuous batching over a paged KV cache.

Requests join and leave between iterations. The scheduling and bookkeeping run on the event
loop; the model step (forward + sampling) runs on one dedicated compute thread, so gRPC handlers
sharing the loop stay responsive while a step computes.

An iteration is `Engine.plan` (decide and book the step: a `StepPlan`, with no model call, await
or clock read), the model on the compute thread (`StepOutputs`), then `Engine.apply` (book the
results). The features are components called at fixed points of it (see the step section):
the queue policy (`policy.py`: FCFS, SCORPIO), MAX_UTILIZATION preemption (`preemption.py`),
prefix caching, ZigZag, KV hand-off and pacing. A request's mode and status are `request.py`'s.
docs/engine-step.md describes the step.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import math
import time
from collections import deque
from collections.abc import AsyncIterator, Callable, Collection, Iterable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, replace
from typing import Any, Literal

import structlog
import torch
from pydantic import BaseModel, ConfigDict, Field, model_validator

from services.common.backlog import sample_wait_s
from services.common.prefix import ROOT_HASH, block_hashes, chain_hash
from services.common.waiting import wait_for
from services.worker.engine import defaults
from services.worker.engine.cpu_share import CpuShare
from services.worker.engine.kv_cache import KVCache
from services.worker.engine.outputs import (
    FinishReason,
    KVBlocks,
    KVFill,
    Relayed,
    RelayFill,
    RelayOutcome,
    TokenEvent,
)
from services.worker.engine.policy import FcfsPolicy, QueuePolicy, ScorpioPolicy
from services.worker.engine.preemption import Preemption
from services.worker.engine.request import EngineRequest, RequestMode, RequestStatus
from services.worker.engine.runner import ModelRunner
from services.worker.engine.sampling import (
    PromptLogprob,
    SamplingParams,
    TokenHistory,
    TopLogprobs,
)
from services.worker.engine.scheduler import (
    CapacityPolicy,
    RunningSeq,
    Schedule,
    SchedulerLimits,
    WaitingSeq,
    schedule,
)
from services.worker.engine.scorpio import PrefillRate
from services.worker.engine.slo import RequestSLO, SLOUnattainable
from services.worker.engine.step import (
    Continuation,
    Partial,
    PromptWork,
    StepInput,
    StepOutputs,
    StepPlan,
    StepRow,
)
from services.worker.model import fused, native
from services.worker.model.llama import LlamaForCausalLM

log = structlog.get_logger(__name__)

# ZigZag relays remembered for requests that have not arrived yet (bounded: most never come).
_MAX_EARLY_RELAYS = 1024


class RequestTooLarge(ValueError):
    """A request that no amount of waiting would let this engine run."""


class EngineDeadError(RuntimeError):
    """The engine loop crashed; the original error is the `__cause__`."""


class EngineStoppedError(RuntimeError):
    """The engine was stopped (or never started) while a request needed it."""


class RequestMovedError(RuntimeError):
    """A queued request was released to run on another instance (rebalancing); it had started
    nothing here, so the caller resumes it elsewhere from where it was."""


class PacingProfile(BaseModel):
    """Emulated accelerator: each iteration lasts at least `base_s + per_token_s * batch_tokens`."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    base_s: float = Field(ge=0, description="fixed cost of one iteration, seconds")
    per_token_s: float = Field(ge=0, description="added cost per token in the iteration, seconds")

    def step_time_s(self, batch_tokens: int) -> float:
        return self.base_s + self.per_token_s * batch_tokens


class EngineConfig(BaseModel):
    """Engine limits; `ValueError` (pydantic) quoting the value when one is out of range."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    max_batch_size: int = Field(
        defaults.MAX_BATCH_SIZE, ge=1, description="most requests running at once (in one iteration)"
    )
    max_num_tokens: int = Field(
        defaults.MAX_NUM_TOKENS, ge=1, description="most tokens in one iteration: prefill tokens in full, 1 per decode"
    )
    block_size: int = Field(defaults.BLOCK_SIZE, ge=1, description="tokens per KV block")
    num_kv_blocks: int | None = Field(
        None, ge=1, description="KV pool size in blocks; None = from kv_cache_bytes or the given cache"
    )
    kv_cache_bytes: int | None = Field(
        None, ge=1, description="KV pool budget in bytes, used by Engine.create when num_kv_blocks is None"
    )
    capacity_policy: CapacityPolicy = Field(
        CapacityPolicy.GUARANTEED_NO_EVICT, description="admission rule against KV capacity"
    )
    enable_chunked_prefill: bool = Field(
        True,
        description="split prompts over iterations to fill max_num_tokens (else whole prompts, and a prompt"
        " longer than max_num_tokens is refused)",
    )
    preemption_mode: Literal["recompute", "swap"] = Field(
        "recompute",
        description="MAX_UTILIZATION, how a paused request gives its KV back: recompute (drop it; prompt and"
        " generated tokens are prefilled again on resume) or swap (copy it to host memory and back)",
    )
    pacing: PacingProfile | None = Field(None, description="emulated accelerator step time; off by default")
    num_threads: int | None = Field(
        None,
        ge=1,
        description="torch intra-op threads of the compute thread; None = the CpuShare's, else as many as the"
        " thread that starts the engine has",
    )
    stats_window_s: float = Field(10.0, gt=0, description="window of the rates and latency percentiles")
    zigzag_partner_order: Literal["arrival", "relay_first"] = Field(
        "arrival",
        description="ZigZag partner: admit requests taken over from a loading instance in arrival order with its"
        " own waiting ones (arrival), or before them (relay_first: more split requests, a worse tail)",
    )
    scheduling_policy: Literal["fcfs", "scorpio"] = Field(
        "fcfs",
        description="fcfs: requests start in arrival order, every decode runs every iteration; scorpio"
        " (docs/algorithms.md 4): queued by TTFT deadline, admitted only when the fitted TPOT estimate meets the"
        " SLOs, decodes run by TPOT credits, SLOUnattainable for what cannot be met",
    )
    enable_prefix_caching: bool = Field(
        True,
        description="automatic prefix caching: full KV blocks stay cached (shared, read-only) under the hash of"
        " their tokens and everything before them, and a request starting with cached blocks skips computing them",
    )

    cuda_graphs: bool = Field(
        True,
        description="on a CUDA device, decode-only steps replay CUDA graphs captured on first use of their batch and"
        " context bucket (services/worker/model/cuda_graphs.py); False runs every step eagerly",
    )

    @model_validator(mode="after")
    def _check(self) -> EngineConfig:
        defaults.check_token_budget(self.max_num_tokens, self.max_batch_size)
        return self


@dataclass(frozen=True)
class EngineStats:
    """Load snapshot for heartbeats and metrics; rates and percentiles over the last `window_s`."""

    running: int
    waiting: int
    waiting_prefill_tokens: int  # prompt tokens not yet computed (queued + unfinished prefills)
    kv_blocks_used: int  # allocated blocks
    kv_blocks_reserved: int  # allocated + promised to running requests (what admission counts)
    kv_blocks_total: int
    kv_blocks_parked: int  # held by hand-offs until their decode side has pulled them
    zigzag_running: int  # ZigZag requests running their first layers here (a loading instance)
    zigzag_relayed_total: int  # ZigZag requests taken over by their partner so far (a loading instance)
    zigzag_continued_total: int  # ZigZag requests taken over from a loading instance (a full partner)
    decode_tokens_per_s: float  # generated tokens per second
    prefill_tokens_per_s: float  # prompt tokens computed per second
    ttft_p50_s: float | None
    ttft_p99_s: float | None
    tbt_p50_s: float | None
    tbt_p99_s: float | None
    total_generated_tokens: int
    total_prompt_tokens: int
    window_s: float
    # SCORPIO (scheduling_policy="scorpio"): the fitted TPOT estimate for the running set, seconds.
    est_tpot_s: float | None = None
    slo_rejected_total: int = 0  # requests refused because an SLO could not be met
    # MAX_UTILIZATION: requests paused (KV dropped or swapped) so others could go on.
    preempted_total: int = 0
    # Prefix caching: prompt tokens whose KV was found in the cache / looked up, since start.
    prefix_hit_tokens: int = 0
    prefix_query_tokens: int = 0
    # Prompt tokens per second of step time while prefilling (the recent prefill steps' fit),
    # 0 before the first prefill step: the capacity the manager's queue trigger divides by.
    prefill_capacity_tps: float = 0.0


@dataclass(frozen=True)
class StepRecord:
    """What one iteration ran (kept for the last few iterations, for debugging and tests)."""

    index: int
    admitted: tuple[str, ...]
    work: tuple[tuple[str, int], ...]
    compute_s: float
    step_s: float


class _Window:
    """Timestamped samples kept for `window_s` (and at most `maxlen`), for rates and percentiles."""

    def __init__(self, window_s: float, maxlen: int = 100_000) -> None:
        self.window_s = window_s
        self._items: deque[tuple[float, float]] = deque(maxlen=maxlen)

    def add(self, now_s: float, value: float) -> None:
        self._items.append((now_s, value))

    def _prune(self, now_s: float) -> None:
        while self._items and self._items[0][0] <= now_s - self.window_s:
            self._items.popleft()

    def total(self, now_s: float) -> float:
        self._prune(now_s)
        return sum(v for _, v in self._items)

    def percentiles(self, now_s: float, qs: Sequence[float]) -> list[float | None]:
        self._prune(now_s)
        values = sorted(v for _, v in self._items)
        if not values:
            return [None] * len(qs)
        # Nearest-rank percentile.
        return [values[max(0, math.ceil(q * len(values)) - 1)] for q in qs]


def out_of_vocab(ids: Iterable[object], vocab_size: int) -> list[object]:
    """The entries of `ids` that are not token ids of a `vocab_size` vocabulary (bools and
    non-integers included), in order."""
    return [t for t in ids if isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < vocab_size]


def _eos_set(ids: Collection[int]) -> frozenset[int]:
    if isinstance(ids, int) or not all(isinstance(i, int) and not isinstance(i, bool) for i in ids):
        raise ValueError(f"eos_token_ids must be a collection of token ids, got {ids!r}")
    return frozenset(ids)


class Engine:
    """Continuous-batching engine for one model on one device: complete, or (`start(partial=True)`)
    still loading, when it serves ZigZag requests with the layers it holds."""

    def __init__(
        self,
        model: LlamaForCausalLM,
        kv_cache: KVCache,
        eos_token_ids: Collection[int],
        config: EngineConfig | None = None,
        *,
        clock: Callable[[], float] = time.monotonic,
        step_history: int = 64,
        on_dead: Callable[[BaseException], None] | None = None,
        cpu_share: CpuShare | None = None,
    ) -> None:
        self.config = config or EngineConfig()
        # With a share (and no fixed `num_threads`), the compute thread takes its share of the
        # machine's cores among the engines running on it, re-read between steps.
        self._cpu_share = cpu_share if self.config.num_threads is None else None
        # Called once, on the event loop, when the loop crashes (after every request was failed):
        # the owner must hear of it, or it goes on advertising an engine that serves nothing.
        self._on_dead = on_dead
        self.model = model
        self.kv_cache = kv_cache
        # The compute thread's side of a step: the forward passes and sampling.
        self.runner = ModelRunner(
            model,
            kv_cache,
            max_batch_size=self.config.max_batch_size,
            cuda_graphs=self.config.cuda_graphs,
            cpu_share=self._cpu_share,
        )
        # Every id that ends a generation (a chat model may have several, e.g. <|im_end|> and <|endoftext|>).
        self.eos_token_ids = _eos_set(eos_token_ids)
        if kv_cache.block_size != self.config.block_size:
            raise ValueError(
                f"KV cache block_size {kv_cache.block_size} != EngineConfig.block_size {self.config.block_size}"
            )
        if self.config.num_kv_blocks is not None and self.config.num_kv_blocks != kv_cache.total_blocks:
            raise ValueError(
                f"KV cache has {kv_cache.total_blocks} blocks, EngineConfig.num_kv_blocks is "
                f"{self.config.num_kv_blocks}"
            )
        cfg = model.config
        if kv_cache.first_layer != 0 or kv_cache.num_layers != cfg.num_hidden_layers:
            raise ValueError(
                f"KV cache covers layers [{kv_cache.first_layer}, {kv_cache.first_layer + kv_cache.num_layers}), "
                f"the engine runs all {cfg.num_hidden_layers}"
            )
        outside = sorted(i for i in self.eos_token_ids if not 0 <= i < cfg.vocab_size)
        if outside:
            raise ValueError(f"eos_token_ids {outside} outside vocabulary [0, {cfg.vocab_size})")
        self._clock = clock
        self._limits = SchedulerLimits(
            max_batch_size=self.config.max_batch_size,
            max_num_tokens=self.config.max_num_tokens,
            chunked_prefill=self.config.enable_chunked_prefill,
        )
        self._waiting: deque[EngineRequest] = deque()
        self._running: list[EngineRequest] = []
        self._by_id: dict[str, EngineRequest] = {}
        self._wake = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self._executor: ThreadPoolExecutor | None = None
        self._dead: BaseException | None = None
        self._stopped = False
        self._steps = 0
        self.step_log: deque[StepRecord] = deque(maxlen=step_history)
        window = self.config.stats_window_s
        self._decode_window = _Window(window)
        self._prefill_window = _Window(window)
        self._prefill_capacity = PrefillRate()
        self._ttft = _Window(window)
        self._tbt = _Window(window)
        self._started_s: float | None = None
        self._total_generated = 0
        self._total_prompt = 0
        self._parked: dict[str, int] = {}  # cache id -> blocks, KV kept for a hand-off
        self._park_seq = 0
        self.kv_fills = {"pulled": 0, "recomputed": 0}  # decode side: how each KV fill ended
        self.zigzag = {
            "relayed": 0,
            "continued": 0,
            "recomputed": 0,
            "partner_embedded": 0,
        }  # ZigZag outcomes, both sides
        self._in_step: set[str] = set()  # requests the compute thread works on right now
        # Prefix caching: tokens of looked-up prompts found cached / looked up, since start.
        self._prefix_hit_tokens = 0
        self._prefix_query_tokens = 0
        # Relayed before they arrived: they end at once when they do (the oldest forgotten first).
        self._relayed_early: collections.OrderedDict[str, None] = collections.OrderedDict()
        # Queue order and SLO refusals (FCFS or SCORPIO), called at fixed points of each step.
        self._policy: QueuePolicy = ScorpioPolicy() if self.config.scheduling_policy == "scorpio" else FcfsPolicy()
        # MAX_UTILIZATION: pauses and swap-ins, the first stage of `plan`.
        context = cfg.max_context_tokens
        self._preemption = Preemption(
            kv_cache,
            self._running,
            self._waiting,
            self._limits,
            self._available_blocks,
            mode=self.config.preemption_mode,
            # Without chunked prefill a paused request is recomputed in one iteration.
            max_input_len=context if self.config.enable_chunked_prefill else min(context, self.config.max_num_tokens),
        )
        self.preemptions = self._preemption.counts  # MAX_UTILIZATION: pauses so far, by how

    @classmethod
    def create(
        cls,
        model: LlamaForCausalLM,
        eos_token_ids: Collection[int],
        config: EngineConfig | None = None,
        *,
        clock: Callable[[], float] = time.monotonic,
        step_history: int = 64,
    ) -> Engine:
        """Build the KV cache from the config (num_kv_blocks, else kv_cache_bytes, else enough for
        max_batch_size full-length sequences capped at 1 GiB) and the engine around it."""
        config = config or EngineConfig()
        mcfg = model.config
        if config.num_kv_blocks is not None:
            blocks = config.num_kv_blocks
        else:
            budget = config.kv_cache_bytes or 1 << 30
            by_budget = KVCache.blocks_for_budget(mcfg, budget, config.block_size, model.dtype)
            wanted = config.max_batch_size * -(-mcfg.max_context_tokens // config.block_size)
            blocks = by_budget if config.kv_cache_bytes else min(by_budget, wanted)
        if blocks < 1:
            raise ValueError(f"KV cache budget {config.kv_cache_bytes} bytes holds no block")
        kv = KVCache.for_model(
            mcfg, num_blocks=blocks, block_size=config.block_size, dtype=model.dtype, device=model.device
        )
        return cls(model, kv, eos_token_ids, config, clock=clock, step_history=step_history)

    # ---- lifecycle ----------------------------------------------------------------------------

    @property
    def is_running(self) -> bool:
        return self._task is not None and not self._task.done()

    @property
    def dead(self) -> BaseException | None:
        """What crashed the loop, or None while it runs (or was stopped)."""
        return self._dead

    async def start(self, *, partial: bool = False) -> None:
        """Start the engine loop (idempotent). The model must be complete, unless `partial`: a
        loading instance serves ZigZag requests with the decoder layers it holds (from the first
        layer on: a request's embedding comes with it while this instance has none), and
        everything else once the model is complete."""
        if self._stopped:
            raise EngineStoppedError("engine was stopped; build a new one")
        if self._task is not None:
            return
        runnable = self.model.num_layers_loaded >= 1 or "embed" in self.model.loaded_groups
        if not self.model.is_complete and not (partial and runnable):
            raise RuntimeError(f"model is not complete: loaded groups {self.model.loaded_groups!r}")
        threads = self.config.num_threads
        if self._cpu_share is not None:
            self._cpu_share.join(f"engine{id(self)}")
            threads = self._cpu_share.threads()
        # With torch's OpenMP backend the team size is per calling thread, so setting it in the
        # compute thread's initializer leaves the rest of the process alone. Set explicitly: a new
        # thread does not reliably start with the count its creator sees.
        self._executor = ThreadPoolExecutor(
            max_workers=1,
            thread_name_prefix="engine-compute",
            initializer=self.runner.set_threads,
            initargs=(threads or torch.get_num_threads(),),
        )
        # Build (or load from the cache) the native decode-attention and fused-op kernels on the
        # compute thread now, not in the first step; the torch path is used if they cannot be built.
        self._executor.submit(native.paged_decode)
        self._executor.submit(fused.fused_ops)
        self._started_s = self._clock()
        self._task = asyncio.create_task(self._run(), name="engine-loop")
        log.info(
            "engine_started",
            kv_blocks=self.kv_cache.total_blocks,
            kv_tokens=self.kv_cache.capacity_tokens,
            max_batch_size=self.config.max_batch_size,
            max_num_tokens=self.config.max_num_tokens,
            threads=threads or torch.get_num_threads(),
            threads_shared=self._cpu_share is not None,
        )

    async def stop(self) -> None:
        """Stop the loop; requests still in flight fail with EngineStoppedError."""
        self._stopped = True
        task, self._task = self._task, None
        if task is not None:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
        self._fail_all(lambda: EngineStoppedError("engine stopped"))
        if self._cpu_share is not None:
            self._cpu_share.leave()
        if self._executor is not None:
            # A step still computing finishes in its thread; its result is dropped.
            self._executor.shutdown(wait=False, cancel_futures=True)
            self._executor = None

    async def __aenter__(self) -> Engine:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.stop()

    # ---- requests -----------------------------------------------------------------------------

    def check_request(self, prompt_len: int, sampling: SamplingParams, *, handoff: bool = False) -> None:
        """Raise RequestTooLarge if a request of this size can never run here (a hand-off needs
        room for its prompt and first token only)."""
        total = prompt_len + sampling.max_tokens
        max_pos = self.model.config.max_context_tokens
        if total > max_pos:
            raise RequestTooLarge(
                f"prompt ({prompt_len} tokens) + max_tokens ({sampling.max_tokens}) = {total} exceeds "
                f"the model's context of {max_pos} tokens"
            )
        blocks = self.kv_cache.blocks_needed(prompt_len + 1 if handoff else total)
        if blocks > self.kv_cache.total_blocks:
            raise RequestTooLarge(
                f"prompt ({prompt_len} tokens) + max_tokens ({sampling.max_tokens}) = {total} tokens need "
                f"{blocks} KV blocks, the cache has {self.kv_cache.total_blocks} "
                f"({self.kv_cache.capacity_tokens} tokens)"
            )
        if not self.config.enable_chunked_prefill and prompt_len > self.config.max_num_tokens:
            raise RequestTooLarge(
                f"prompt of {prompt_len} tokens exceeds max_num_tokens {self.config.max_num_tokens} "
                "and chunked prefill is off"
            )

    def _add(
        self,
        request_id: str,
        prompt_token_ids: Sequence[int],
        sampling: SamplingParams,
        resume_token_ids: Sequence[int] = (),
        *,
        handoff: bool = False,
        kv_fill: KVFill | None = None,
        zigzag: bool = False,
        zigzag_embedded: torch.Tensor | None = None,
        relay_fill: RelayFill | None = None,
        slo: RequestSLO | None = None,
    ) -> EngineRequest:
        """Check a request and queue it (the loop must be running; `generate` checks)."""
        held = self._by_id.get(request_id)
        if held is not None and held.mode is RequestMode.ZIGZAG_FIRST_LAYERS and not zigzag:
            # The request comes here whole (its partner released it, this instance now serves):
            # the gateway has cancelled the first-layer hop it sent here, but that abort may
            # not have arrived yet. The whole request supersedes it (the partner, which let the
            # request go, will not relay it).
            log.info("zigzag_first_layers_superseded", request_id=request_id, layers_run=held.zz_layers)
            self._finish(held, "abort")
        if request_id in self._by_id:
            raise ValueError(f"request_id {request_id!r} is already in flight")
        prompt = list(prompt_token_ids)
        if not prompt:
            raise ValueError(f"request {request_id!r} has an empty prompt")
        vocab = self.model.config.vocab_size
        resumed = list(resume_token_ids)
        for what, ids in (("token ids", prompt), ("resumed token ids", resumed)):
            bad = out_of_vocab(ids, vocab)
            if bad:
                raise ValueError(f"request {request_id!r} has {what} outside [0, {vocab}): {bad[:5]!r}")
        if len(resumed) >= sampling.max_tokens:
            raise ValueError(
                f"request {request_id!r} resumes after {len(resumed)} generated tokens, which already reach"
                f" max_tokens={sampling.max_tokens}"
            )
        if resumed and sampling.prompt_logprobs is not None:
            raise ValueError(f"request {request_id!r}: prompt_logprobs cannot be asked of a resumed request")
        if kv_fill is not None and not resumed:
            raise ValueError(
                f"request {request_id!r} takes its KV from another instance but resumes no token: the KV covers"
                " the tokens before the one to decode next"
            )
        if kv_fill is not None and handoff:
            raise ValueError(f"request {request_id!r}: a hand-off cannot also take its KV from another instance")
        # A relayed request may hand its KV off in turn (ZigZag on a prefill instance of a
        # disaggregated deployment); any other two of these exclude each other.
        if sum((handoff, kv_fill is not None, zigzag, relay_fill is not None)) > 1 and not (
            handoff and relay_fill is not None and kv_fill is None and not zigzag
        ):
            raise ValueError(f"request {request_id!r}: zigzag, relay, hand-off and KV source exclude each other")
        if (zigzag or relay_fill is not None) and resumed:
            raise ValueError(f"request {request_id!r}: a ZigZag request cannot resume tokens")
        if zigzag and sampling.prompt_logprobs is not None:
            raise ValueError(f"request {request_id!r}: a ZigZag request cannot ask for prompt_logprobs")
        if zigzag_embedded is not None:
            hidden_size = self.model.config.hidden_size
            if not zigzag:
                raise ValueError(f"request {request_id!r}: only a ZigZag request comes with its embedding")
            if tuple(zigzag_embedded.shape) != (len(prompt), hidden_size) or zigzag_embedded.dtype != self.model.dtype:
                raise ValueError(
                    f"request {request_id!r}: its embedding has shape {tuple(zigzag_embedded.shape)} and dtype"
                    f" {zigzag_embedded.dtype}, expected ({len(prompt)}, {hidden_size}) and {self.model.dtype}"
                )
        elif zigzag and "embed" not in self.model.loaded_groups:
            raise ValueError(
                f"request {request_id!r}: the embedding is not loaded here yet, so a ZigZag request must bring"
                " its prompt's embedding (looked up by its partner)"
            )
        if not zigzag and not self.model.is_complete:
            raise EngineStoppedError(
                f"the model is still loading ({self.model.num_layers_loaded} of"
                f" {self.model.config.num_hidden_layers} layers): only ZigZag requests run yet"
            )
        dropped_relay = relay_fill is not None and not self._can_continue(len(prompt), sampling)
        if dropped_relay:
            relay_fill = None  # computed here whole, which is always correct
        mode = RequestMode.of(handoff=handoff, kv_fill=kv_fill is not None, zigzag=zigzag, relay=relay_fill is not None)
        # SCORPIO refuses only requests that have sent nothing yet and need nothing from a peer
        # (one that came with a relay counts as relayed even when it is computed here whole).
        plain = mode is RequestMode.COLOCATED and not resumed and not dropped_relay
        self.check_request(len(prompt), sampling, handoff=handoff)
        if (
            resumed
            and not self.config.enable_chunked_prefill
            and len(prompt) + len(resumed) > self.config.max_num_tokens
        ):
            raise RequestTooLarge(
                f"prompt ({len(prompt)} tokens) + {len(resumed)} resumed tokens exceed max_num_tokens"
                f" {self.config.max_num_tokens} and chunked prefill is off"
            )
        stop_ids = set(sampling.stop_token_ids)
        if not sampling.ignore_eos:
            stop_ids |= self.eos_token_ids
        seq = EngineRequest(
            request_id=request_id,
            prompt=prompt,
            params=sampling,
            generator=sampling.make_generator(skip=len(resumed)),
            history=TokenHistory.create(sampling, prompt, vocab),
            prompt_logprobs=[PromptLogprob(prompt[0], None)] if sampling.prompt_logprobs is not None else None,
            stop_ids=frozenset(stop_ids),
            # A hand-off keeps its KV here only up to its first token.
            blocks_reserved=self.kv_cache.blocks_needed(
                len(prompt) + len(resumed) + 1 if handoff else len(prompt) + sampling.max_tokens
            ),
            arrival_s=self._clock(),
            queue=asyncio.Queue(),
            output=resumed,
            resumed=len(resumed),
            mode=mode,
            fill=kv_fill or relay_fill,
            slo=None if slo is None or slo.is_empty else slo,
        )
        if mode is RequestMode.ZIGZAG_FIRST_LAYERS:
            seq.blocks_reserved = self.kv_cache.blocks_needed(len(prompt))
            seq.zz_embedded = zigzag_embedded
            self.zigzag["partner_embedded"] += zigzag_embedded is not None
        # Prefix caching skips computing a request's first tokens, so it is off where those must
        # run here or arrive from elsewhere: a ZigZag request on a loading instance runs its prompt
        # through some layers only (its blocks never hold every layer's KV), one taken over from a
        # loading instance runs the remaining layers over the whole prompt, and a KV fill writes
        # the pulled KV into all of the request's blocks (a shared block must never be written).
        # Prompt log-probs need every prompt position's hidden state, so such a request computes
        # its whole prompt, but its blocks may be cached for others.
        seq.prefix_register = self.config.enable_prefix_caching and mode.computes_prompt_here
        seq.prefix_lookup = seq.prefix_register and sampling.prompt_logprobs is None
        if mode is RequestMode.ZIGZAG_FIRST_LAYERS and request_id in self._relayed_early:
            # Its partner already took it over (the relay outran this request): nothing runs here.
            del self._relayed_early[request_id]
            seq.status = RequestStatus.FINISHED_RELAYED
            seq.queue.put_nowait(TokenEvent(None, None, len(prompt), 0, zigzag_layers=0))
            return seq
        if mode is RequestMode.DECODE_FROM_KV:
            # The gap from here to its next token is a gap between tokens (the first came from
            # the prefill side), not a time to first token.
            seq.last_token_s = seq.arrival_s
        if seq.history is not None:
            for token in resumed:
                seq.history.add(token)
        self._policy.arrive(seq, plain, self._waiting, self._running)
        self._by_id[request_id] = seq
        self._waiting.append(seq)
        self._wake.set()
        return seq

    async def generate(
        self,
        request_id: str,
        prompt_token_ids: Sequence[int],
        sampling: SamplingParams,
        resume_token_ids: Sequence[int] = (),
        *,
        handoff: bool = False,
        kv_fill: KVFill | None = None,
        zigzag: bool = False,
        zigzag_embedded: torch.Tensor | None = None,
        relay_fill: RelayFill | None = None,
        slo: RequestSLO | None = None,
    ) -> AsyncIterator[TokenEvent]:
        """Stream a request's tokens. Closing or cancelling the stream aborts the request and frees
        its KV at once. Raises RequestTooLarge / ValueError on the first iteration for a bad
        request, EngineDeadError if the loop crashes, EngineStoppedError if the engine stops.

        `resume_token_ids` continue a request migrated from another instance: the tokens it had
        generated there. They are prefilled with the prompt, count toward max_tokens, feed the
        penalties, and a seeded sampler skips the draws they took, so the stream goes on exactly
        as the uninterrupted one would (greedy: identical; seeded: the same draws). Events count
        them in `completion_tokens` but never repeat them.

        Prefill/decode disaggregation:
        - `handoff` (the prefill side): after the first token, unless it ends the request, the
          request stops here and its KV stays in the cache under the event's `parked_kv` id, for
          a peer to pull, until `release_parked`. That event is the stream's last.
        - `kv_fill` (the decode side): once admitted (its blocks reserved as any request's), the
          KV of its first `prompt + resumed - 1` tokens is pulled by `kv_fill` into its blocks
          instead of being computed; decoding goes on from the last resumed token. If the fill
          fails, the prompt is recomputed here: slower, the same tokens.

        ZigZag live scaling (docs/algorithms.md 3):
        - `zigzag` (a loading instance): the prompt runs through the decoder layers held here, as
          they arrive (requests whose next layer is loaded first, then in arrival order), until
          its full partner takes it over (`relay`). The stream's one event then carries
          `zigzag_layers`. No token is sampled here. A loading instance receives its embedding
          after the decoder layers (the partner holds one and serves them in the meantime):
          until then `zigzag_embedded` is the prompt's embedding, looked up by the partner.
        - `relay_fill` (the full partner): once admitted (in arrival order, as any request),
          `relay_fill` takes the request over from the loading instance, pulling the KV of the
          layers that ran there (the loading instance has worked on it while it queued here); the remaining layers run here on the hidden states it brings,
          then the request samples and decodes as any other. If that fails, the prompt is
          computed here whole.

        `slo`: the request's latency objectives. Under `scheduling_policy="scorpio"` they order
        and gate its admission (SLOUnattainable when they cannot be met); FCFS ignores them."""
        if self._dead is not None:
            raise EngineDeadError(f"engine loop crashed: {self._dead!r}") from self._dead
        if self._stopped or self._task is None:
            raise EngineStoppedError("engine is not running (call start())")
        seq = self._add(
            request_id,
            prompt_token_ids,
            sampling,
            resume_token_ids,
            handoff=handoff,
            kv_fill=kv_fill,
            zigzag=zigzag,
            zigzag_embedded=zigzag_embedded,
            relay_fill=relay_fill,
            slo=slo,
        )
        try:
            while True:
                item = await seq.queue.get()
                if isinstance(item, BaseException):
                    raise item
                yield item
                if item.finish_reason is not None or item.parked_kv is not None or item.zigzag_layers is not None:
                    return
        finally:
            if not seq.status.is_finished():
                self._finish(seq, "abort", notify=False)

    def offload_candidates(self, n: int, exclude: Collection[str] = ()) -> list[tuple[str, list[int], SamplingParams]]:
        """ZigZag pulled by a loading instance (BlitzScale's NewPrefill takes the old instance's
        queued prefills FIFO): up to `n` waiting requests, in the order this engine admits them,
        whose first layers a loading instance may run ahead (`attach_relay`): (id, prompt,
        sampling). Eligible: a plain request that has not started (nothing computed, no output,
        no KV arriving, not itself split), without prompt log-probs (they need every layer
        here) (`_can_continue`). `exclude`: ids already offloaded."""
        if n <= 0:
            return []
        # The policy's admission order; its refusals are left to the next step (this runs
        # between and during steps, and must not change the queue).
        waiting = self._policy.offload_order(self._waiting)
        out: list[tuple[str, list[int], SamplingParams]] = []
        for seq in waiting:
            if seq.request_id in exclude or not self._offloadable(seq):
                continue
            out.append((seq.request_id, seq.prompt, seq.params))
            if len(out) >= n:
                break
        return out

    def _offloadable(self, seq: EngineRequest) -> bool:
        # Queued and not swapped out (a request paused with nothing generated yet may go), its
        # KV not to come from a peer, not a ZigZag request itself, and nothing of it started.
        return (
            seq.status in (RequestStatus.WAITING, RequestStatus.PREEMPTED)
            and seq.fill is None
            and seq.mode is not RequestMode.ZIGZAG_FIRST_LAYERS
            and not (seq.num_computed or seq.output or seq.resumed)
            and self._can_continue(len(seq.prompt), seq.params)
        )

    def _can_continue(self, prompt_len: int, params: SamplingParams) -> bool:
        """Whether a prompt can be taken over from a loading instance (ZigZag): prompt log-probs
        need every layer here; and the continuation runs its remaining layers in chunks as any
        prefill, so a prompt longer than one iteration needs chunked prefill (without it such a
        prompt is refused anyway)."""
        return params.prompt_logprobs is None and (
            self.config.enable_chunked_prefill or prompt_len <= self.config.max_num_tokens
        )

    def attach_relay(self, request_id: str, relay_fill: RelayFill) -> bool:
        """Make a waiting request a ZigZag continuation: when admitted it takes its first layers
        over through `relay_fill` (from the loading instance running them ahead) instead of
        computing them. False, and nothing changes, when the request is no longer waiting or not
        eligible (see `offload_candidates`); a relay that brings no layer computes it whole."""
        seq = self._by_id.get(request_id)
        if seq is None or not self._offloadable(seq):
            return False
        seq.fill = relay_fill
        seq.mode = seq.mode.with_relay()
        # As for a request routed to its partner: it runs the remaining layers over the whole
        # prompt, so no cached prefix may stand in for its first tokens (see `_add`).
        seq.prefix_register = seq.prefix_lookup = False
        return True

    def abort(self, request_id: str) -> None:
        """Abort a request: its stream ends with an "abort" event and its KV is freed now.
        Unknown or finished ids are ignored (the request may just have finished)."""
        seq = self._by_id.get(request_id)
        if seq is not None and not seq.status.is_finished():
            self._finish(seq, "abort")

    def release_running(self, max_requests: int, reason: str, *, min_tokens_left: int = 0) -> list[str]:
        """Live migration: up to `max_requests` decoding requests (the most recently started
        first: they have the least KV to move) leave this instance with their KV, between steps;
        only those with at least `min_tokens_left` tokens left of their `max_tokens`.
        Each one's stream ends with an event carrying `parked_kv` (the KV of every token but the
        last, kept until `release_parked`) and no token; the caller offers it to the instance that
        resumes the request, which pulls it and goes on decoding. Returns their ids."""
        chosen: list[str] = []
        for seq in reversed(self._running):
            if len(chosen) >= max_requests:
                break
            decoding = seq.output and seq.pending == 1 and not seq.mode.hands_off
            # Running (its KV not arriving, not already leaving), its ZigZag continuation booked.
            if (
                not decoding
                or seq.status is not RequestStatus.RUNNING
                or seq.mode is RequestMode.ZIGZAG_FIRST_LAYERS
                or seq.zz_hidden is not None
                or seq.params.max_tokens - len(seq.output) < min_tokens_left
            ):
                continue
            seq.status = RequestStatus.MIGRATING
            chosen.append(seq.request_id)
        if chosen:
            log.info("release_running", requests=len(chosen), reason=reason)
            self._wake.set()
        return chosen

    def _migrate_flagged(self) -> None:
        """Between steps: park the KV of the requests `release_running` chose, ending their streams."""
        for seq in [s for s in self._running if s.status is RequestStatus.MIGRATING]:
            kv_tokens = seq.num_computed
            parked = self._park(seq, RequestStatus.FINISHED_HANDED_OFF)
            seq.queue.put_nowait(
                TokenEvent(None, None, len(seq.prompt), len(seq.output), parked_kv=parked, kv_tokens=kv_tokens)
            )

    def release_waiting(self, max_requests: int, reason: str, *, also: Collection[str] = ()) -> list[str]:
        """Give up to `max_requests` queued (not yet admitted) requests to another instance: the
        most recently queued first, as they would wait longest here; and, besides those, every
        request of `also` that is still queued. Each one's stream raises RequestMovedError; none
        had KV here, so nothing is lost. A request MAX_UTILIZATION paused is queued too but has
        streamed tokens from here: it stays, and resumes here. Returns their ids."""
        released: list[str] = []
        wanted = set(also)
        queued = [s for s in self._waiting if s.status is RequestStatus.WAITING]
        named = [s for s in queued if s.request_id in wanted]
        rest = [s for s in reversed(queued) if s.request_id not in wanted][:max_requests]
        for seq in named + rest:
            self._waiting.remove(seq)
            seq.status = RequestStatus.FINISHED_MOVED
            self._by_id.pop(seq.request_id, None)
            seq.queue.put_nowait(
                RequestMovedError(f"request {seq.request_id!r} released to another instance: {reason}")
            )
            released.append(seq.request_id)
        if released:
            self._wake.set()
        return released

    def release_parked(self, parked_kv: str) -> int:
        """Free the KV a hand-off parked (its peer has pulled it, or never will); returns the
        blocks freed, 0 for an unknown id."""
        if self._parked.pop(parked_kv, None) is None:
            return 0
        freed = self.kv_cache.free(parked_kv)
        self._wake.set()
        return freed

    async def relay(self, request_id: str, *, wait_s: float = 1.0) -> RelayOutcome:
        """ZigZag, the loading instance: stop `request_id` and hand it to its partner, once it
        has run every layer loaded here (after its next step, if it can still run one, or after
        `wait_s` at the latest; the partner's own work goes on meanwhile). Its KV for those
        layers stays parked (`RelayOutcome.parked_kv`, freed by `release_parked`) for the partner
        to pull; its stream ends with `zigzag_layers`. A request not here yet ends at once when
        it arrives; one still queued, or finished, gives `layers == 0`."""
        seq = self._by_id.get(request_id)
        if seq is None or seq.mode is not RequestMode.ZIGZAG_FIRST_LAYERS:
            if seq is None:
                self._relayed_early[request_id] = None
                while len(self._relayed_early) > _MAX_EARLY_RELAYS:
                    self._relayed_early.popitem(last=False)
            return RelayOutcome(0, 0)
        if seq.status is RequestStatus.WAITING:  # never paused: it holds its reservation
            self._waiting.remove(seq)
            self._by_id.pop(request_id, None)
            seq.status = RequestStatus.FINISHED_RELAYED
            seq.queue.put_nowait(TokenEvent(None, None, len(seq.prompt), 0, zigzag_layers=0))
            self.zigzag["relayed"] += 1
            return RelayOutcome(0, len(seq.prompt))
        if request_id in self._in_step or seq.zz_layers < self.model.num_layers_loaded:
            # It is computing, or can run layers it has not run yet: it is relayed at the end of
            # its next step here (so the partner gets all the layers this instance can give), or
            # after `wait_s` at the latest.
            waiter: asyncio.Future[RelayOutcome] = asyncio.get_running_loop().create_future()
            seq.relay_waiters.append(waiter)
            self._wake.set()
            try:
                return await wait_for(asyncio.shield(waiter), wait_s)
            except TimeoutError:
                if waiter.done():
                    return waiter.result()
                if request_id in self._in_step:
                    return await waiter  # resolved when this step ends
                return self._relay_now(seq)
        return self._relay_now(seq)

    def _relay_now(self, seq: EngineRequest) -> RelayOutcome:
        layers, hidden = seq.zz_layers, seq.zz_hidden
        parked = self._park(seq, RequestStatus.FINISHED_RELAYED) if layers > 0 else None
        if parked is None:
            self._finish(seq, "abort", notify=False)
            seq.status = RequestStatus.FINISHED_RELAYED
        seq.zz_hidden = None
        outcome = RelayOutcome(layers, len(seq.prompt), parked, hidden)
        seq.queue.put_nowait(
            TokenEvent(
                None, None, len(seq.prompt), 0, parked_kv=parked, kv_tokens=len(seq.prompt), zigzag_layers=layers
            )
        )
        for waiter in seq.relay_waiters:
            if not waiter.done():
                waiter.set_result(outcome)
        seq.relay_waiters.clear()
        self.zigzag["relayed"] += 1
        return outcome

    def _park(self, seq: EngineRequest, status: RequestStatus) -> str:
        """Stop `seq` (ending as `status`) and keep its KV under a fresh cache id, so the
        request id is free at once (a retry may bring it back here) while a peer pulls."""
        self._park_seq += 1
        parked = f"{seq.request_id}#handoff-{self._park_seq}"
        self.kv_cache.rename(seq.request_id, parked)
        self._parked[parked] = self.kv_cache.num_blocks_of(parked)
        seq.status = status
        self._by_id.pop(seq.request_id, None)
        self._running.remove(seq)
        self._wake.set()
        return parked

    def _finish(self, seq: EngineRequest, reason: FinishReason, notify: bool = True) -> None:
        seq.status = RequestStatus.finished(reason)
        seq.zz_hidden = None
        for waiter in seq.relay_waiters:
            if not waiter.done():
                waiter.set_result(RelayOutcome(0, len(seq.prompt)))
        seq.relay_waiters.clear()
        self._by_id.pop(seq.request_id, None)
        if seq in self._running:
            self._running.remove(seq)
        else:
            with contextlib.suppress(ValueError):
                self._waiting.remove(seq)
        if seq.fill_task is not None:
            # Its KV is arriving into its blocks: they go back to the pool only once the pull
            # has unwound (its endpoint aborted), never while a late write could land.
            seq.fill_task.cancel()
        else:
            self.kv_cache.free(seq.request_id)
        if notify and reason == "abort":
            seq.queue.put_nowait(TokenEvent(None, "abort", len(seq.prompt), len(seq.output)))
        self._wake.set()

    def _fail_all(self, make_error: Callable[[], BaseException]) -> None:
        # One exception object per consumer: raising a shared one from several tasks would mix
        # their tracebacks.
        for seq in [*self._running, *self._waiting]:
            seq.status = RequestStatus.FINISHED_FAILED
            for waiter in seq.relay_waiters:
                if not waiter.done():
                    waiter.set_result(RelayOutcome(0, len(seq.prompt)))
            seq.relay_waiters.clear()
            if seq.fill_task is not None:
                seq.fill_task.cancel()
            else:
                self.kv_cache.free(seq.request_id)
            seq.queue.put_nowait(make_error())
        self._running.clear()
        self._waiting.clear()
        self._by_id.clear()

    # ---- the loop -----------------------------------------------------------------------------

    async def _run(self) -> None:
        try:
            while True:
                if not self._running and not self._waiting:
                    self._wake.clear()
                    await self._wake.wait()
                    continue
                await self._step()
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            # Supervision: every waiting consumer gets the error instead of hanging.
            log.exception("engine_loop_crashed", running=len(self._running), waiting=len(self._waiting))
            self._dead = exc

            # `exc` is unbound once the except block ends; the closure may run later.
            def dead(cause: BaseException = exc) -> BaseException:
                error = EngineDeadError(f"engine loop crashed: {cause!r}")
                error.__cause__ = cause
                return error

            self._fail_all(dead)
            if self._cpu_share is not None:
                self._cpu_share.leave()
            if self._on_dead is not None:
                self._on_dead(exc)

    def _available_blocks(self) -> int:
        # Blocks promised to running requests but not yet allocated are not available.
        outstanding = sum(max(0, s.blocks_reserved - self.kv_cache.num_blocks_of(s.request_id)) for s in self._running)
        return self.kv_cache.free_blocks - outstanding

    # ---- the step: plan, run, pace, apply -------------------------------------------------------
    #
    # `_step` calls the features at fixed points, in this order:
    #   1. live migration: requests `release_running` chose leave with their KV (`_migrate_flagged`);
    #   2. `plan`: MAX_UTILIZATION preemption (`Preemption.make_room`), the queue policy's order and
    #      refusals (FCFS or SCORPIO, `QueuePolicy.order`), its held decode rows (`held`), the
    #      capacity scheduler (`scheduler.schedule`), the policy's admission gate (`gate`),
    #      admission (prefix-cache matches, blocks), ZigZag first-layer work (`_zigzag_work`), and
    #      the batch's rows (ZigZag continuations among them);
    #   3. KV pulls of the requests admitted with a peer's KV (hand-off decode side, ZigZag
    #      partner: `_start_fills`);
    #   4. the model, on the compute thread (`_run_model` -> `_execute`);
    #   5. pacing: the emulated accelerator's step time (`_pace`);
    #   6. `apply`: the policy observes the step, ZigZag partials keep their hidden states (and are
    #      relayed when a partner waits), prompt log-probs, then each row: computed tokens,
    #      prefix-cache registration, a continuation's end, its sampled token (`_emit`: a stop,
    #      the length, or a hand-off parking its KV), and the step's stats.

    async def _step(self) -> None:
        now_s = self._clock()
        self._migrate_flagged()
        plan = self.plan(now_s)
        self._start_fills(plan)
        if plan.is_empty:
            # Nothing fits now (an exhausted pool), or ZigZag work waits for its next layer or
            # for its partner: wait for a change.
            self._wake.clear()
            await self._wake.wait()
            return
        outputs = await self._run_model(plan)
        await self._pace(plan, outputs.compute_s)
        self.apply(plan, outputs, self._clock())

    def plan(self, now_s: float) -> StepPlan:
        """Decide the step that begins at `now_s`, and book the decision on the scheduler's side:
        pauses and swap-ins (MAX_UTILIZATION), refusals (SCORPIO), admissions with their blocks
        and cached prefixes, and the blocks the step's new tokens are written to. No model call,
        no await and no clock read: `now_s` is the step's time. The KV pulls of the requests it
        admits are started by the caller (`StepPlan.fills`)."""
        backlogged = bool(self._waiting)
        if self.config.capacity_policy is CapacityPolicy.MAX_UTILIZATION:
            self._preemption.make_room()
        waiting = self._order_waiting(now_s)
        held = self._policy.held(self._running)
        # Cached prefixes of the requests that could be admitted now (no more than the free
        # batch slots): their prompts count only the tokens left to compute, their reservations
        # only the blocks they do not share with a running request.
        matches = {
            s.request_id: self._match_prefix(s)
            for s in waiting[: max(0, self.config.max_batch_size - len(self._running))]
            if s.prefix_lookup
        }
        bs = self.kv_cache.block_size
        decided = schedule(
            # A request whose KV is arriving holds its batch slot and blocks but has no work yet,
            # and a ZigZag request on a loading instance is run layer by layer outside the plan.
            [
                RunningSeq(
                    s.request_id,
                    0
                    if s.status is RequestStatus.WAITING_FOR_KV
                    or s.mode is RequestMode.ZIGZAG_FIRST_LAYERS
                    or s.request_id in held
                    else s.pending,
                )
                for s in self._running
            ],
            [
                WaitingSeq(
                    s.request_id,
                    0 if s.fill is not None else s.prefill_len - bs * len(matches.get(s.request_id, ())),
                    s.blocks_reserved - sum(1 for b in matches.get(s.request_id, ()) if self.kv_cache.ref_count(b) > 0),
                )
                for s in waiting
            ],
            self._available_blocks(),
            self._limits,
        )
        decided = self._gate(decided)
        fills, deferred = self._admit(decided.admitted, matches)
        work = tuple(w for w in decided.work if w[0] not in deferred)
        partials = self._zigzag_work()
        rows, inputs, prefill_tokens, paced_tokens = self._build_inputs(work, partials)
        return StepPlan(
            now_s=now_s,
            backlogged=backlogged,
            admitted=decided.admitted,
            work=work,
            rows=rows,
            inputs=inputs,
            fills=fills,
            prefill_tokens=prefill_tokens,
            paced_tokens=paced_tokens,
        )

    def _order_waiting(self, now_s: float) -> list[EngineRequest]:
        """The queue in admission order: the policy's (its refusals taken out of the queue), then
        ZigZag continuations first under `zigzag_partner_order="relay_first"`."""
        waiting, refused = self._policy.order(self._waiting, self._running, now_s)
        for seq, error in refused:
            self._reject_waiting(seq, error)
        # A request taken over from a loading instance queues in arrival order with this
        # instance's own requests by default (`zigzag_partner_order`). Taken first instead
        # ("relay_first"), more requests split (their first layers ran while loading) but the
        # partner's own, older requests waited behind them: on bench.live_scaling the burst's
        # TTFT p99 was 9.0 and 10.7 s against 6.4 and 6.0 s in arrival order (stop-the-world:
        # 7.4). BlitzScale's partner takes such work only when it has none of its own; measured
        # on bench.autoscale that was worse still (SLO 0.47-0.54 against 0.59-0.62).
        if self.config.zigzag_partner_order == "relay_first":
            waiting.sort(key=lambda s: s.fill is None or not s.mode.relayed)  # stable: arrival order within each
        return waiting

    def _gate(self, decided: Schedule) -> Schedule:
        """The scheduler's admissions less those the queue policy refuses now."""
        refused = self._policy.gate([self._by_id[r] for r in decided.admitted], self._running)
        if not refused:
            return decided
        for seq, error in refused:
            self._reject_waiting(seq, error)
        ids = {seq.request_id for seq, _ in refused}
        return replace(
            decided,
            admitted=tuple(r for r in decided.admitted if r not in ids),
            work=tuple(w for w in decided.work if w[0] not in ids),
        )

    def _reject_waiting(self, seq: EngineRequest, error: SLOUnattainable) -> None:
        # Queued: no KV, no token sent; its stream raises the error.
        self._waiting.remove(seq)
        seq.status = RequestStatus.FINISHED_REJECTED
        self._by_id.pop(seq.request_id, None)
        seq.queue.put_nowait(error)

    def _admit(
        self, admitted: Sequence[str], matches: dict[str, list[int]]
    ) -> tuple[tuple[EngineRequest, ...], frozenset[str]]:
        """Move the admitted requests to the running batch and give them their blocks. Returns
        those whose KV a peer's pull brings (for `_start_fills`), and the ids of every admitted
        request whose work is not the scheduler's: those, and ZigZag requests on a loading
        instance (their work is picked by layer, `_zigzag_work`)."""
        bs = self.kv_cache.block_size
        # Requests that take blocks from the pool now are given them after those starting from
        # cached prefixes have taken theirs, so that no allocation evicts a block just matched.
        later: list[EngineRequest] = []
        for request_id in admitted:
            seq = self._by_id[request_id]
            self._waiting.remove(seq)
            self._running.append(seq)
            seq.status = RequestStatus.RUNNING
            if seq.fill is not None or seq.mode is RequestMode.ZIGZAG_FIRST_LAYERS:
                later.append(seq)
                continue
            prefix = matches.get(request_id, [])
            self.kv_cache.allocate(request_id, 0, prefix_blocks=prefix)
            seq.num_registered = len(prefix)
            if seq.prefix_lookup:
                seq.num_computed = bs * len(prefix)
                self._prefix_hit_tokens += seq.num_computed
                self._prefix_query_tokens += seq.prefill_len
            seq.cached_tokens = min(seq.num_computed, len(seq.prompt))
        fills: list[EngineRequest] = []
        for seq in later:
            if seq.mode is not RequestMode.DECODE_FROM_KV:
                # ZigZag computes every layer of the prompt without the prefix cache, here or on
                # the loading instance; a pulled fill's KV was counted where it was computed.
                seq.cached_tokens = 0
            if seq.fill is not None:
                # Its blocks are taken now, between steps: blocks freed while a step computes
                # (an abort) may still be written by that step, and must not receive KV.
                pulls_kv = seq.mode is RequestMode.DECODE_FROM_KV
                self.kv_cache.allocate(seq.request_id, seq.num_tokens - 1 if pulls_kv else seq.num_tokens)
                seq.status = RequestStatus.WAITING_FOR_KV
                fills.append(seq)
            else:
                self.kv_cache.allocate(seq.request_id, len(seq.prompt))
        return tuple(fills), frozenset(s.request_id for s in later)

    def _build_inputs(
        self, work: Sequence[tuple[str, int]], partials: Sequence[Partial]
    ) -> tuple[tuple[StepRow, ...], StepInput, int, float]:
        """The step's rows and the compute thread's input for them (growing each row's blocks to
        hold its new tokens); the prompt tokens it computes and its tokens as pacing counts them."""
        rows: list[StepRow] = []
        inp = StepInput([], [], [], [], [], [], [])
        prefill_tokens = 0
        paced_tokens = 0.0
        num_layers = self.model.config.num_hidden_layers
        for row, (request_id, n) in enumerate(work):
            seq = self._by_id[request_id]
            start = seq.num_computed
            if seq.zz_hidden is not None:
                # Taken over from a loading instance: the prompt's remaining layers, from the
                # hidden states it brought, in chunks as any prefill (the last one samples).
                last = start + n == len(seq.prompt)
                rows.append(StepRow(seq, start, n))
                inp.continuations.append(
                    Continuation(
                        row,
                        seq.zz_layers,
                        seq.zz_hidden[start : start + n],
                        n,
                        self.kv_cache.block_table(request_id),
                        context_len=start,
                        sample=last,
                    )
                )
                if last:
                    inp.sample_rows.append(row)
                    inp.params.append(seq.params)
                    inp.generators.append(seq.generator)
                    inp.histories.append(seq.history)
                prefill_tokens += n
                paced_tokens += n * (num_layers - seq.zz_layers) / num_layers
                continue
            rows.append(StepRow(seq, start, n))
            local = len(inp.query_lens)
            inp.regular_rows.append(row)
            inp.input_ids.extend(seq.tokens(start, n))
            inp.query_lens.append(n)
            inp.context_lens.append(start)
            self.kv_cache.extend(request_id, start + n)
            self.kv_cache.check_writable(request_id, start)
            inp.block_tables.append(self.kv_cache.block_table(request_id))
            if start + n == seq.num_tokens:
                inp.logits_local.append(local)
                inp.sample_rows.append(row)
                inp.params.append(seq.params)
                inp.generators.append(seq.generator)
                inp.histories.append(seq.history)
            if seq.prompt_logprobs is not None and len(seq.prompt_logprobs) == start + 1 < len(seq.prompt):
                # Positions start .. end-1 predict prompt tokens start+1 .. end.
                end = min(start + n, len(seq.prompt) - 1)
                k = seq.params.prompt_logprobs or 0
                inp.prompt_work.append(PromptWork(local, seq.prompt[start + 1 : end + 1], k))
            if start < seq.prefill_len:
                prefill_tokens += min(n, seq.prefill_len - start)
            paced_tokens += n
        # Regular rows sample first, then continuations: the order `_execute` builds logits in.
        order = sorted(range(len(inp.sample_rows)), key=lambda i: inp.sample_rows[i] not in inp.regular_rows)
        inp.sample_rows[:] = [inp.sample_rows[i] for i in order]
        inp.params[:] = [inp.params[i] for i in order]
        inp.generators[:] = [inp.generators[i] for i in order]
        inp.histories[:] = [inp.histories[i] for i in order]
        for part in partials:
            inp.partials.append(part)
            paced_tokens += part.num_tokens * (part.layer_end - part.layer_start) / num_layers
        return tuple(rows), inp, prefill_tokens, paced_tokens

    def _start_fills(self, plan: StepPlan) -> None:
        """Start the KV pulls of the requests the plan admitted with a peer's KV (the decode
        side of a hand-off, a ZigZag partner); each ends in `_fill`."""
        for seq in plan.fills:
            seq.fill_task = asyncio.get_running_loop().create_task(self._fill(seq), name=f"kv-fill-{seq.request_id}")

    async def _run_model(self, plan: StepPlan) -> StepOutputs:
        """Run the plan's input on the compute thread; its outputs with when it began and took."""
        assert self._executor is not None
        self._in_step = set(plan.request_ids)
        started_s = self._clock()
        try:
            outputs = await asyncio.get_running_loop().run_in_executor(self._executor, self._execute, plan.inputs)
        finally:
            self._in_step = set()
        return replace(outputs, started_s=started_s, compute_s=self._clock() - started_s)

    async def _pace(self, plan: StepPlan, compute_s: float) -> None:
        """Emulated accelerator: stretch the step to its profile's time (a layer range costs its
        share of a whole step's tokens)."""
        if self.config.pacing is not None:
            remaining = self.config.pacing.step_time_s(round(plan.paced_tokens)) - compute_s
            if remaining > 0:
                await asyncio.sleep(remaining)

    def apply(self, plan: StepPlan, outputs: StepOutputs, now_s: float) -> None:
        """Book what the model computed for `plan` at `now_s`: tokens emitted (a request ending,
        or handing its KV off, leaves the batch), computed tokens advanced, full blocks offered
        to the prefix cache, ZigZag layers recorded, stats. A request that finished meanwhile
        (aborted while the step ran) is skipped: its blocks are already back in the pool."""
        started_s = outputs.started_s if outputs.started_s is not None else now_s
        self._policy.observe(plan, now_s - started_s, now_s - plan.now_s, self._steps + 1)
        self._prefill_capacity.observe(plan.prefill_tokens, now_s - started_s)
        inp = plan.inputs
        for part, hidden in zip(inp.partials, outputs.hidden, strict=True):
            seq = part.seq
            if seq.status.is_finished():
                continue
            seq.zz_layers, seq.zz_hidden, seq.zz_embedded = part.layer_end, hidden, None
            if part.layer_end == self.model.config.num_hidden_layers and self.config.enable_prefix_caching:
                # Every layer of its prompt ran here (the load completed under it): its full
                # blocks may serve the request whole when it moves here (the partner's backlog
                # is rebalanced onto this instance), or any later prompt with that prefix.
                self._register_prefix(seq, computed=seq.prefill_len)
            if seq.relay_waiters:
                self._relay_now(seq)
        for work, results in zip(inp.prompt_work, outputs.prompt_logprobs, strict=True):
            seq = plan.rows[inp.regular_rows[work.row]].seq
            if seq.prompt_logprobs is not None and not seq.status.is_finished():
                seq.prompt_logprobs.extend(
                    PromptLogprob(t, lp, top) for t, (lp, top) in zip(work.targets, results, strict=True)
                )
        sampled: dict[int, tuple[int, float, TopLogprobs]] = {}
        if outputs.sampled is not None:
            out = outputs.sampled
            picks = zip(out.tokens, out.logprobs, out.top_logprobs, strict=True)
            sampled = dict(zip(inp.sample_rows, picks, strict=True))
        generated = 0
        for i, row in enumerate(plan.rows):
            seq, n = row.seq, row.num_tokens
            if seq.status.is_finished() or n == 0:
                continue  # aborted while the step ran (its blocks are already back in the pool), or deferred
            seq.num_computed += n
            if seq.prefix_register:
                self._register_prefix(seq)
            if seq.zz_hidden is not None and seq.num_computed >= len(seq.prompt):
                seq.zz_hidden = None  # its last chunk ran: the take-over is complete
                self.zigzag["continued"] += 1
            if i in sampled:
                token, logprob, top = sampled[i]
                generated += 1
                self._emit(seq, token, logprob, top, now_s)
        self._total_generated += generated
        self._total_prompt += plan.prefill_tokens
        self._decode_window.add(now_s, generated)
        self._prefill_window.add(now_s, plan.prefill_tokens)
        self._steps += 1
        self.step_log.append(StepRecord(self._steps, plan.admitted, plan.work, outputs.compute_s, now_s - started_s))

    # ---- prefix caching, ZigZag, KV fills -----------------------------------------------------

    def _match_prefix(self, seq: EngineRequest) -> list[int]:
        """The cached blocks `seq` may start from: the longest cached run of its first full
        blocks, short of its last token (the step that computes it samples the next one)."""
        bs = self.kv_cache.block_size
        n = (seq.prefill_len - 1) // bs
        if len(seq.block_hashes) < n:
            seq.block_hashes = block_hashes(seq.tokens(0, n * bs), bs)
        return self.kv_cache.match_prefix(seq.tokens(0, n * bs), seq.block_hashes[:n])

    def _register_prefix(self, seq: EngineRequest, computed: int | None = None) -> None:
        """Offer `seq`'s full blocks whose KV is now computed (its first `computed` tokens,
        default `num_computed`) to the prefix cache."""
        bs = self.kv_cache.block_size
        full = (seq.num_computed if computed is None else computed) // bs
        if full <= seq.num_registered:
            return
        hashes = seq.block_hashes
        while len(hashes) < full:
            parent = hashes[-1] if hashes else ROOT_HASH
            hashes.append(chain_hash(parent, seq.tokens(len(hashes) * bs, bs)))
        start = seq.num_registered
        tokens = seq.tokens(start * bs, (full - start) * bs)
        self.kv_cache.register(seq.request_id, start, hashes[:full], tokens)
        seq.num_registered = full

    def _zigzag_work(self) -> list[Partial]:
        """ZigZag on a loading instance: the running ZigZag requests whose next layer is loaded,
        each to run every loaded layer it has not run yet (in arrival order, within the token
        budget; the first always runs), those a partner waits for first. Requests waiting for a
        layer, or for their partner, wait."""
        loaded = self.model.num_layers_loaded
        budget = self.config.max_num_tokens
        work: list[Partial] = []
        # Requests a partner is waiting to take over go first, then in arrival order.
        for seq in sorted(self._running, key=lambda s: not s.relay_waiters):
            if seq.mode is not RequestMode.ZIGZAG_FIRST_LAYERS or seq.status.is_finished() or seq.zz_layers >= loaded:
                continue
            n = len(seq.prompt)
            if work and n > budget:
                break
            budget -= n
            work.append(
                Partial(seq, seq.zz_layers, loaded, n, self.kv_cache.block_table(seq.request_id), seq.zz_hidden)
            )
        return work

    def notify_layers(self) -> None:
        """A decoder layer arrived (a loading instance): ZigZag requests may run further."""
        self._wake.set()

    async def _fill(self, seq: EngineRequest) -> None:
        """Pull `seq`'s KV: all of it (the decode side of a hand-off), or the first layers' and
        the hidden states (taken over from a loading instance, ZigZag). On failure fall back to
        computing it here. Cancelled when the request ends first: then its blocks are freed here,
        after the pull has unwound."""
        fill, seq.fill = seq.fill, None
        relay = seq.mode.relayed
        assert fill is not None
        result: object = None
        ok = False
        try:
            result = await fill(KVBlocks(self.kv_cache, seq.request_id))
            ok = True
        except asyncio.CancelledError:
            pass
        except Exception as e:
            log.warning("kv_fill_failed", request_id=seq.request_id, relay=relay, error=f"{type(e).__name__}: {e}")
        finally:
            seq.fill_task = None
            if seq.status.is_finished():
                self.kv_cache.free(seq.request_id)
            else:
                seq.status = RequestStatus.RUNNING
        if seq.status.is_finished():
            return
        if ok and relay and isinstance(result, Relayed) and result.layers > 0 and result.hidden is not None:
            # The remaining layers run here, on the hidden states it brought (`_build_inputs`).
            seq.zz_layers, seq.zz_hidden = result.layers, result.hidden
        elif ok and not relay:
            seq.num_computed = seq.num_tokens - 1
            self.kv_fills["pulled"] += 1
        else:
            # Recompute: the request becomes a running prefill of prompt + resumed tokens.
            self.kv_cache.free(seq.request_id)
            self.kv_cache.allocate(seq.request_id, 0)
            seq.num_computed = 0
            seq.cached_tokens = 0
            if relay:
                self.zigzag["recomputed"] += 1
            else:
                self.kv_fills["recomputed"] += 1
        self._wake.set()

    def _emit(self, seq: EngineRequest, token: int, logprob: float, top: TopLogprobs, now: float) -> None:
        first = not seq.output
        seq.output.append(token)
        if seq.history is not None:
            seq.history.add(token)
        if seq.last_token_s is None:
            self._ttft.add(now, now - seq.arrival_s)
        else:
            self._tbt.add(now, now - seq.last_token_s)
        seq.last_token_s = now
        reason: FinishReason | None = None
        if token in seq.stop_ids:
            reason = "stop"
        elif len(seq.output) >= seq.params.max_tokens:
            reason = "length"
        prompt_lps = tuple(seq.prompt_logprobs) if first and seq.prompt_logprobs is not None else ()
        if seq.mode.hands_off and reason is None:
            kv_tokens = seq.num_computed
            parked = self._park(seq, RequestStatus.FINISHED_HANDED_OFF)
            seq.queue.put_nowait(
                TokenEvent(
                    token,
                    None,
                    len(seq.prompt),
                    len(seq.output),
                    logprob,
                    top,
                    prompt_lps,
                    parked,
                    kv_tokens,
                    cached_tokens=seq.cached_tokens,
                )
            )
            return
        seq.queue.put_nowait(
            TokenEvent(
                token,
                reason,
                len(seq.prompt),
                len(seq.output),
                logprob,
                top,
                prompt_lps,
                cached_tokens=seq.cached_tokens,
            )
        )
        if reason is not None:
            self._policy.finished(seq)
            self._finish(seq, reason, notify=False)

    def _execute(self, inp: StepInput) -> StepOutputs:
        """The compute thread's part of a step (`ModelRunner.execute`)."""
        return self.runner.execute(inp)

    def scorpio_report(self) -> dict[str, Any] | None:
        """SCORPIO's fits and counters (None under FCFS): the TPOT model (coefficients, terms,
        points, R^2, mean absolute error), the prefill rate, the output-length predictor's mean
        absolute error, refusals by kind and the running set's estimated TPOT."""
        return self._policy.report(self._running)

    # ---- observability ------------------------------------------------------------------------

    @property
    def prefix_cache_tokens(self) -> tuple[int, int]:
        """(prompt tokens found cached, prompt tokens looked up) since start: plain ints, safe to
        read from another thread (a metrics scrape), unlike `stats()`."""
        return self._prefix_hit_tokens, self._prefix_query_tokens

    def active_request_ids(self) -> set[str]:
        """Ids of the requests queued or running here: what `stats()` counts as waiting and
        running."""
        return {s.request_id for s in self._waiting} | {s.request_id for s in self._running}

    def queued_prefill_tokens(self) -> int:
        """Prompt tokens not computed yet: those of queued requests and of unfinished prefills."""
        return sum(s.prefill_len for s in self._waiting) + sum(
            max(0, s.prefill_len - s.num_computed) for s in self._running
        )

    def queued_prefill_wait_s(self) -> float:
        """The seconds the queued prompt tokens take at this engine's measured prefill capacity
        (the wait a new arrival sees); 0 before any prefill step measured one."""
        return sample_wait_s(self.queued_prefill_tokens(), self._prefill_capacity.tokens_per_s or 0.0)

    def stats(self) -> EngineStats:
        now = self._clock()
        window = self.config.stats_window_s
        # Before a full window has passed, rates are over the time the engine has run.
        span = min(window, now - self._started_s) if self._started_s is not None else window
        span = max(span, 1e-3)
        ttft = self._ttft.percentiles(now, (0.5, 0.99))
        tbt = self._tbt.percentiles(now, (0.5, 0.99))
        reserved = self.kv_cache.total_blocks - self._available_blocks()
        return EngineStats(
            running=len(self._running),
            waiting=len(self._waiting),
            waiting_prefill_tokens=self.queued_prefill_tokens(),
            kv_blocks_used=self.kv_cache.used_blocks,
            kv_blocks_reserved=reserved,
            kv_blocks_total=self.kv_cache.total_blocks,
            kv_blocks_parked=sum(self._parked.values()),
            zigzag_running=sum(1 for s in self._running if s.mode is RequestMode.ZIGZAG_FIRST_LAYERS),
            zigzag_relayed_total=self.zigzag["relayed"],
            zigzag_continued_total=self.zigzag["continued"],
            decode_tokens_per_s=self._decode_window.total(now) / span,
            prefill_tokens_per_s=self._prefill_window.total(now) / span,
            ttft_p50_s=ttft[0],
            ttft_p99_s=ttft[1],
            tbt_p50_s=tbt[0],
            tbt_p99_s=tbt[1],
            total_generated_tokens=self._total_generated,
            total_prompt_tokens=self._total_prompt,
            window_s=window,
            est_tpot_s=self._policy.est_tpot_s(self._running),
            slo_rejected_total=self._policy.rejected_total,
            preempted_total=sum(self.preemptions.values()),
            prefix_hit_tokens=self._prefix_hit_tokens,
            prefix_query_tokens=self._prefix_query_tokens,
            prefill_capacity_tps=self._prefill_capacity.tokens_per_s or 0.0,
        )
