"""The worker's in-process engine: iteration-level continuous batching over a paged KV cache.

Requests join and leave between iterations. The scheduling and bookkeeping run on the event
loop; the model step (forward + sampling) runs on one dedicated compute thread, so gRPC handlers
sharing the loop stay responsive while a step computes.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import math
import time
from collections import deque
from collections.abc import AsyncIterator, Awaitable, Callable, Collection, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field, replace
from typing import Any, Literal

import structlog
import torch
from pydantic import BaseModel, ConfigDict, Field, model_validator

from services.common.prefix import ROOT_HASH, block_hashes, chain_hash
from services.worker.engine.cpu_share import CpuShare
from services.worker.engine.kv_cache import KVCache
from services.worker.engine.request import FinishReason, RequestMode, RequestStatus
from services.worker.engine.sampling import (
    PromptLogprob,
    SampleOutput,
    SamplingParams,
    TokenHistory,
    TopLogprobs,
    prompt_logprobs,
    sample,
)
from services.worker.engine.scheduler import (
    ActiveSeq,
    CapacityPolicy,
    RunningSeq,
    Schedule,
    SchedulerLimits,
    WaitingSeq,
    blocks_for,
    fold_paused_prompt,
    next_step_blocks,
    pick_victims,
    schedule,
    start_blocks,
)
from services.worker.engine.scorpio import (
    Member,
    ScorpioState,
    SLOTicket,
    TPOTDecision,
    deadline_s,
    judge_tpot,
    judge_ttft,
    trp,
    vbs,
)
from services.worker.engine.slo import RequestSLO, SLOKind, SLOUnattainable
from services.worker.model import fused, native
from services.worker.model.attention import ForwardBatch
from services.worker.model.llama import LlamaForCausalLM

log = structlog.get_logger(__name__)

# Prompt positions whose logits are computed at once for prompt log-probs: [rows, vocab] float32.
_PROMPT_LOGITS_ROWS = 256
# ZigZag relays remembered for requests that have not arrived yet (bounded: most never come).
_MAX_EARLY_RELAYS = 1024
# SCORPIO logs its fits (scorpio_fit) once per this many steps.
_SCORPIO_LOG_EVERY_STEPS = 1000


class RequestTooLarge(ValueError):
    """A request that no amount of waiting would let this engine run."""


class EngineDeadError(RuntimeError):
    """The engine loop crashed; the original error is the `__cause__`."""


class EngineStoppedError(RuntimeError):
    """The engine was stopped (or never started) while a request needed it."""


class RequestMovedError(RuntimeError):
    """A queued request was released to run on another instance (rebalancing); it had started
    nothing here, so the caller resumes it elsewhere from where it was."""


class KVBlocks:
    """The consumer-side allocator a `KVFill` receives: the blocks of one admitted request,
    already counted against the engine's reservations (a pull cannot take blocks promised to
    running requests). Matches `services.worker.kv_transfer.KVBlockAllocator`."""

    def __init__(self, cache: KVCache, request_id: str) -> None:
        self._cache = cache
        self._request_id = request_id

    @property
    def request_id(self) -> str:
        return self._request_id

    def allocate(self, seq_id: str, num_tokens: int) -> list[int]:
        if seq_id != self._request_id:
            raise ValueError(f"blocks of {self._request_id!r} were asked for {seq_id!r}")
        table = self._cache.block_table(seq_id)
        if len(table) < self._cache.blocks_needed(num_tokens):
            raise ValueError(
                f"request {seq_id!r} holds {len(table)} blocks for its KV; {num_tokens} tokens were offered"
            )
        # The fill writes every block it is given: none may be a cached block others read.
        self._cache.check_writable(seq_id, 0)
        return table

    def free(self, seq_id: str) -> int:
        # The engine frees the request's blocks itself once the fill has unwound.
        return 0


# Pulls a request's KV for its first tokens from another instance into the blocks `KVBlocks`
# hands out (the decode side of prefill/decode disaggregation); raises on any failure.
KVFill = Callable[[KVBlocks], Awaitable[object]]


@dataclass(frozen=True)
class Relayed:
    """What a ZigZag relay brings (ALGORITHMS.md section 3): the hidden states `[prompt, H]` of a
    request's prompt after decoder layer `layers` ran on the loading instance, whose KV for
    layers [0, layers) was pulled into the request's blocks here. `layers == 0`: nothing ran
    there, the prompt is computed here whole."""

    layers: int
    hidden: torch.Tensor | None = None


# The full partner's side of ZigZag: takes a request over from the loading instance that ran its
# first layers (pulling that KV into the blocks `KVBlocks` hands out); raises on any failure.
RelayFill = Callable[[KVBlocks], Awaitable[Relayed]]


@dataclass(frozen=True)
class RelayOutcome:
    """A ZigZag request stopped on the loading instance: layers [0, `layers`) ran here; their KV
    is parked under `parked_kv` (None when no layer ran) for the partner to pull, with the
    hidden states after the last of them."""

    layers: int
    num_tokens: int
    parked_kv: str | None = None
    hidden: torch.Tensor | None = None


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

    max_batch_size: int = Field(16, ge=1, description="most requests running at once (in one iteration)")
    max_num_tokens: int = Field(
        2048, ge=1, description="most tokens in one iteration: prefill tokens in full, 1 per decode"
    )
    block_size: int = Field(16, ge=1, description="tokens per KV block")
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
        " (ALGORITHMS.md 4): queued by TTFT deadline, admitted only when the fitted TPOT estimate meets the"
        " SLOs, decodes run by TPOT credits, SLOUnattainable for what cannot be met",
    )
    enable_prefix_caching: bool = Field(
        True,
        description="automatic prefix caching: full KV blocks stay cached (shared, read-only) under the hash of"
        " their tokens and everything before them, and a request starting with cached blocks skips computing them",
    )

    @model_validator(mode="after")
    def _check(self) -> EngineConfig:
        if self.max_num_tokens < self.max_batch_size:
            # Otherwise a full batch of decodes could not all run in one iteration.
            raise ValueError(
                f"max_num_tokens ({self.max_num_tokens}) must be >= max_batch_size ({self.max_batch_size})"
            )
        return self


@dataclass(frozen=True)
class TokenEvent:
    """One streamed step of a request. The last event has `finish_reason` set.

    `token_id` is None only on an "abort" event. A stop token (EOS or a stop_token_id) is delivered
    as the token of the final "stop" event; the caller decides whether to show it. `logprob` is
    the token's log-prob under the model's raw distribution; `top_logprobs` holds the
    `params.logprobs` most likely tokens at its position, and the first event carries
    `prompt_logprobs` (one per prompt token) when `params.prompt_logprobs` is set.
    """

    token_id: int | None
    finish_reason: FinishReason | None
    prompt_tokens: int
    completion_tokens: int
    logprob: float | None = None
    top_logprobs: TopLogprobs = ()
    prompt_logprobs: tuple[PromptLogprob, ...] = ()
    # A hand-off request's last event (no finish_reason): its KV now lives under this cache id
    # and covers its first `kv_tokens` tokens, until `Engine.release_parked(parked_kv)`.
    parked_kv: str | None = None
    kv_tokens: int = 0
    # A ZigZag request's last event on the loading instance: the layers that ran here before
    # its partner took it over (see `Engine.relay`); no token.
    zigzag_layers: int | None = None


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


@dataclass(frozen=True)
class StepRecord:
    """What one iteration ran (kept for the last few iterations, for debugging and tests)."""

    index: int
    admitted: tuple[str, ...]
    work: tuple[tuple[str, int], ...]
    compute_s: float
    step_s: float


@dataclass(eq=False)
class _Seq:
    request_id: str
    prompt: list[int]
    params: SamplingParams
    generator: torch.Generator | None
    stop_ids: frozenset[int]
    blocks_reserved: int
    arrival_s: float
    queue: asyncio.Queue[TokenEvent | BaseException]
    mode: RequestMode = RequestMode.COLOCATED
    status: RequestStatus = RequestStatus.WAITING
    history: TokenHistory | None = None  # logit_bias and penalty state; None when unused
    prompt_logprobs: list[PromptLogprob] | None = None  # filled during the prefill when asked for
    output: list[int] = field(default_factory=list)
    resumed: int = 0  # tokens of `output` generated before a migration, or before a pause (recompute)
    num_computed: int = 0  # tokens whose K/V are in the cache
    last_token_s: float | None = None
    # The pull that brings its first tokens' KV (DECODE_FROM_KV) or first layers (ZigZag partner)
    # from a peer, until it is started at admission.
    fill: KVFill | RelayFill | None = None
    fill_task: asyncio.Task[None] | None = None  # the pull, while it runs (status WAITING_FOR_KV)
    zz_layers: int = 0  # ZigZag: decoder layers of the prompt that ran (loading side) or arrived (partner)
    zz_hidden: torch.Tensor | None = None  # the prompt's hidden states after layer zz_layers
    relay_waiters: list[asyncio.Future[RelayOutcome]] = field(default_factory=list)
    slo: RequestSLO | None = None  # latency objectives (SCORPIO schedules by them; FCFS ignores them)
    scorpio: SLOTicket | None = None  # SCORPIO's view of it (scheduling_policy="scorpio" only)
    swapped: _Swapped | None = None  # a paused request's KV in host memory (status SWAPPED)
    # Prefix caching: look its first tokens up when admitted / cache its full blocks once computed.
    prefix_lookup: bool = False
    prefix_register: bool = False
    block_hashes: list[int] = field(default_factory=list)  # chained hashes of its first full blocks
    num_registered: int = 0  # blocks of its table offered to the prefix cache so far

    @property
    def num_tokens(self) -> int:
        return len(self.prompt) + len(self.output)

    @property
    def prefill_len(self) -> int:
        """Tokens present when the request arrived: its prompt plus any resumed output."""
        return len(self.prompt) + self.resumed

    @property
    def pending(self) -> int:
        return self.num_tokens - self.num_computed

    def tokens(self, start: int, n: int) -> list[int]:
        """Tokens [start, start + n) of prompt + output, without concatenating the two."""
        p = len(self.prompt)
        if start + n <= p:
            return self.prompt[start : start + n]
        if start >= p:
            return self.output[start - p : start - p + n]
        return self.prompt[start:] + self.output[: start + n - p]


@dataclass(frozen=True)
class _Swapped:
    """The KV of a paused request's first `num_tokens` tokens, copied out of the pool
    (`KVCache.copy_out`), until it is copied back into fresh blocks."""

    k: torch.Tensor
    v: torch.Tensor
    num_tokens: int


@dataclass(frozen=True)
class _PromptWork:
    """Prompt log-probs wanted from row `row` of a step: its new tokens, in order, predict
    `targets` (the prompt token after each)."""

    row: int
    targets: list[int]
    k: int


@dataclass(frozen=True)
class _Continuation:
    """ZigZag, the full partner: a prompt's remaining layers [layer_start, L) from `hidden`."""

    row: int
    layer_start: int
    hidden: torch.Tensor
    num_tokens: int
    block_table: list[int]


@dataclass(frozen=True)
class _Partial:
    """ZigZag, a loading instance: layers [layer_start, layer_end) of `seq`'s prompt."""

    seq: _Seq
    layer_start: int
    layer_end: int
    num_tokens: int
    block_table: list[int]
    # The hidden states after layer_start (None from the embedding), taken when the step is
    # planned: the compute thread must not read `seq`, which an abort may clear meanwhile.
    hidden: torch.Tensor | None = None


@dataclass(frozen=True)
class _StepInput:
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
    prompt_work: list[_PromptWork] = field(default_factory=list)
    regular_rows: list[int] = field(default_factory=list)
    logits_local: list[int] = field(default_factory=list)
    continuations: list[_Continuation] = field(default_factory=list)
    partials: list[_Partial] = field(default_factory=list)


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
        self._threads = 0  # the compute thread's team size, once it has started
        # Called once, on the event loop, when the loop crashes (after every request was failed):
        # the owner must hear of it, or it goes on advertising an engine that serves nothing.
        self._on_dead = on_dead
        self.model = model
        self.kv_cache = kv_cache
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
        self._waiting: deque[_Seq] = deque()
        self._running: list[_Seq] = []
        self._by_id: dict[str, _Seq] = {}
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
        self._ttft = _Window(window)
        self._tbt = _Window(window)
        self._started_s: float | None = None
        self._total_generated = 0
        self._total_prompt = 0
        self._parked: dict[str, int] = {}  # cache id -> blocks, KV kept for a hand-off
        self._park_seq = 0
        self.kv_fills = {"pulled": 0, "recomputed": 0}  # decode side: how each KV fill ended
        self.zigzag = {"relayed": 0, "continued": 0, "recomputed": 0}  # ZigZag outcomes, both sides
        self._in_step: set[str] = set()  # requests the compute thread works on right now
        # Prefix caching: tokens of looked-up prompts found cached / looked up, since start.
        self._prefix_hit_tokens = 0
        self._prefix_query_tokens = 0
        # Relayed before they arrived: they end at once when they do (the oldest forgotten first).
        self._relayed_early: collections.OrderedDict[str, None] = collections.OrderedDict()
        self._scorpio = ScorpioState() if self.config.scheduling_policy == "scorpio" else None
        self.preemptions = {"recompute": 0, "swap": 0}  # MAX_UTILIZATION: pauses so far, by how

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
        loading instance serves ZigZag requests with the layers it holds (their embedding first),
        and everything else once the model is complete."""
        if self._stopped:
            raise EngineStoppedError("engine was stopped; build a new one")
        if self._task is not None:
            return
        if not self.model.is_complete and not (partial and "embed" in self.model.loaded_groups):
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
            initializer=self._set_threads,
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

    def _set_threads(self, n: int) -> None:
        """On the compute thread: the size of its OpenMP team (this thread's only)."""
        torch.set_num_threads(n)
        self._threads = n

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
        relay_fill: RelayFill | None = None,
        slo: RequestSLO | None = None,
    ) -> _Seq:
        if self._dead is not None:
            raise EngineDeadError(f"engine loop crashed: {self._dead!r}") from self._dead
        if self._stopped or self._task is None:
            raise EngineStoppedError("engine is not running (call start())")
        if request_id in self._by_id:
            raise ValueError(f"request_id {request_id!r} is already in flight")
        prompt = list(prompt_token_ids)
        if not prompt:
            raise ValueError(f"request {request_id!r} has an empty prompt")
        vocab = self.model.config.vocab_size
        resumed = list(resume_token_ids)
        for what, ids in (("token ids", prompt), ("resumed token ids", resumed)):
            bad = [t for t in ids if isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < vocab]
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
        seq = _Seq(
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
        if self._scorpio is not None:
            self._scorpio_arrive(seq, plain)
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

        ZigZag live scaling (ALGORITHMS.md section 3):
        - `zigzag` (a loading instance): the prompt runs through the decoder layers held here, as
          they arrive (requests whose next layer is loaded first, then in arrival order), until
          its full partner takes it over (`relay`). The stream's one event then carries
          `zigzag_layers`. No token is sampled here.
        - `relay_fill` (the full partner): once admitted (in arrival order, as any request),
          `relay_fill` takes the request over from the loading instance, pulling the KV of the
          layers that ran there (the loading instance has worked on it while it queued here); the remaining layers run here on the hidden states it brings,
          then the request samples and decodes as any other. If that fails, the prompt is
          computed here whole.

        `slo`: the request's latency objectives. Under `scheduling_policy="scorpio"` they order
        and gate its admission (SLOUnattainable when they cannot be met); FCFS ignores them."""
        seq = self._add(
            request_id,
            prompt_token_ids,
            sampling,
            resume_token_ids,
            handoff=handoff,
            kv_fill=kv_fill,
            zigzag=zigzag,
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
        here), and whose prompt fits one iteration (the continuation runs the remaining layers
        over the whole prompt in one step). `exclude`: ids already offloaded."""
        if n <= 0:
            return []
        waiting = list(self._waiting)
        if self._scorpio is not None:
            # SCORPIO admits least-deadline-first; its refusals are left to the next step (this
            # runs between and during steps, and must not change the queue).
            waiting.sort(key=lambda s: s.scorpio.deadline_s if s.scorpio is not None else math.inf)
        out: list[tuple[str, list[int], SamplingParams]] = []
        for seq in waiting:
            if seq.request_id in exclude or not self._offloadable(seq):
                continue
            out.append((seq.request_id, seq.prompt, seq.params))
            if len(out) >= n:
                break
        return out

    def _offloadable(self, seq: _Seq) -> bool:
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
        """Whether a prompt can be taken over from a loading instance (ZigZag): the continuation
        runs its remaining layers in one step, which a prompt longer than one iteration never
        gets (chunked prefill or not), and prompt log-probs need every layer here."""
        return params.prompt_logprobs is None and prompt_len <= self.config.max_num_tokens

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

    def release_running(self, max_requests: int, reason: str) -> list[str]:
        """Live migration: up to `max_requests` decoding requests (the most recently started
        first: they have the least KV to move) leave this instance with their KV, between steps.
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

    def release_waiting(self, max_requests: int, reason: str) -> list[str]:
        """Give up to `max_requests` queued (not yet admitted) requests to another instance: the
        most recently queued first, as they would wait longest here. Each one's stream raises
        RequestMovedError; none had KV here, so nothing is lost. A request MAX_UTILIZATION paused
        is queued too but has streamed tokens from here: it stays, and resumes here. Returns
        their ids."""
        released: list[str] = []
        for seq in [s for s in reversed(self._waiting) if s.status is RequestStatus.WAITING][:max_requests]:
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
                return await asyncio.wait_for(asyncio.shield(waiter), wait_s)
            except TimeoutError:
                if waiter.done():
                    return waiter.result()
                if request_id in self._in_step:
                    return await waiter  # resolved when this step ends
                return self._relay_now(seq)
        return self._relay_now(seq)

    def _relay_now(self, seq: _Seq) -> RelayOutcome:
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

    def _park(self, seq: _Seq, status: RequestStatus) -> str:
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

    def _finish(self, seq: _Seq, reason: FinishReason, notify: bool = True) -> None:
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

    async def _step(self) -> None:
        step_began = self._clock()
        backlogged = bool(self._waiting)
        self._migrate_flagged()
        if self.config.capacity_policy is CapacityPolicy.MAX_UTILIZATION:
            self._make_room()
        # A request taken over from a loading instance queues in arrival order with this
        # instance's own requests by default (`zigzag_partner_order`). Taken first instead
        # ("relay_first"), more requests split (their first layers ran while loading) but the
        # partner's own, older requests waited behind them: on bench.live_scaling the burst's
        # TTFT p99 was 9.0 and 10.7 s against 6.4 and 6.0 s in arrival order (stop-the-world:
        # 7.4). BlitzScale's partner takes such work only when it has none of its own; measured
        # on bench.autoscale that was worse still (SLO 0.47-0.54 against 0.59-0.62).
        waiting = list(self._waiting) if self._scorpio is None else self._scorpio_waiting()
        if self.config.zigzag_partner_order == "relay_first":
            waiting.sort(key=lambda s: s.fill is None or not s.mode.relayed)  # stable: arrival order within each
        # SCORPIO: decode rows short of a credit sit this iteration out.
        held = self._scorpio_held() if self._scorpio is not None else frozenset()
        # Cached prefixes of the requests that could be admitted now (no more than the free
        # batch slots): their prompts count only the tokens left to compute, their reservations
        # only the blocks they do not share with a running request.
        matches = {
            s.request_id: self._match_prefix(s)
            for s in waiting[: max(0, self.config.max_batch_size - len(self._running))]
            if s.prefix_lookup
        }
        bs = self.kv_cache.block_size
        plan = schedule(
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
        if self._scorpio is not None:
            plan = self._scorpio_admit(plan)
        filling: set[str] = set()
        # Requests that take blocks from the pool now are given them after those starting from
        # cached prefixes have taken theirs, so that no allocation evicts a block just matched.
        deferred: list[_Seq] = []
        for request_id in plan.admitted:
            seq = self._by_id[request_id]
            self._waiting.remove(seq)
            self._running.append(seq)
            seq.status = RequestStatus.RUNNING
            if seq.fill is not None or seq.mode is RequestMode.ZIGZAG_FIRST_LAYERS:
                deferred.append(seq)
                continue
            prefix = matches.get(request_id, [])
            self.kv_cache.allocate(request_id, 0, prefix_blocks=prefix)
            seq.num_registered = len(prefix)
            if seq.prefix_lookup:
                seq.num_computed = bs * len(prefix)
                self._prefix_hit_tokens += seq.num_computed
                self._prefix_query_tokens += seq.prefill_len
        for seq in deferred:
            request_id = seq.request_id
            if seq.fill is not None:
                # Its blocks are taken now, between steps: blocks freed while a step computes
                # (an abort) may still be written by that step, and must not receive KV.
                pulls_kv = seq.mode is RequestMode.DECODE_FROM_KV
                self.kv_cache.allocate(request_id, seq.num_tokens - 1 if pulls_kv else seq.num_tokens)
                filling.add(request_id)
                seq.status = RequestStatus.WAITING_FOR_KV
                seq.fill_task = asyncio.get_running_loop().create_task(self._fill(seq), name=f"kv-fill-{request_id}")
            else:
                self.kv_cache.allocate(request_id, len(seq.prompt))
                filling.add(request_id)  # its work is picked below, by layer
        if filling:
            plan = replace(plan, work=tuple(w for w in plan.work if w[0] not in filling))
        partials = self._zigzag_work()
        if not plan.work and not partials:
            # Nothing fits now (an exhausted pool), or ZigZag work waits for its next layer or
            # for its partner: wait for a change.
            self._wake.clear()
            await self._wake.wait()
            return

        seqs: list[_Seq] = []
        counts: list[int] = []
        inp = _StepInput([], [], [], [], [], [], [])
        prefill_tokens = 0
        paced_tokens = 0.0
        num_layers = self.model.config.num_hidden_layers
        for row, (request_id, n) in enumerate(plan.work):
            seq = self._by_id[request_id]
            start = seq.num_computed
            seqs.append(seq)
            counts.append(n)
            if seq.zz_hidden is not None:
                # Taken over from a loading instance: the prompt's remaining layers, in one piece.
                if start != 0 or n != len(seq.prompt):
                    counts[-1] = 0  # a chunk of it: wait for a step with room for all of it
                    continue
                inp.continuations.append(
                    _Continuation(row, seq.zz_layers, seq.zz_hidden, n, self.kv_cache.block_table(request_id))
                )
                inp.sample_rows.append(row)
                inp.params.append(seq.params)
                inp.generators.append(seq.generator)
                inp.histories.append(seq.history)
                prefill_tokens += n
                paced_tokens += n * (num_layers - seq.zz_layers) / num_layers
                continue
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
                inp.prompt_work.append(_PromptWork(local, seq.prompt[start + 1 : end + 1], k))
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

        assert self._executor is not None
        self._in_step = {s.request_id for s in seqs} | {p.seq.request_id for p in partials}
        t0 = self._clock()
        try:
            sampled_out, prompt_out, partial_out = await asyncio.get_running_loop().run_in_executor(
                self._executor, self._execute, inp
            )
        finally:
            self._in_step = set()
        compute_s = self._clock() - t0
        if self.config.pacing is not None:
            # Emulated accelerator: a layer range costs its share of a whole step's tokens.
            remaining = self.config.pacing.step_time_s(round(paced_tokens)) - compute_s
            if remaining > 0:
                await asyncio.sleep(remaining)
        now = self._clock()
        if self._scorpio is not None and not inp.partials and not inp.continuations:
            self._scorpio_observe(seqs, counts, prefill_tokens, now - t0)
        if self._scorpio is not None and backlogged:
            # What the queue was served at, the step's scheduling and any wait for a KV pull in.
            self._scorpio.backlog.observe(prefill_tokens, now - step_began)

        for part, hidden in zip(inp.partials, partial_out, strict=True):
            seq = part.seq
            if seq.status.is_finished():
                continue
            seq.zz_layers, seq.zz_hidden = part.layer_end, hidden
            if seq.relay_waiters:
                self._relay_now(seq)
        for work, results in zip(inp.prompt_work, prompt_out, strict=True):
            seq = seqs[inp.regular_rows[work.row]]
            if seq.prompt_logprobs is not None and not seq.status.is_finished():
                seq.prompt_logprobs.extend(
                    PromptLogprob(t, lp, top) for t, (lp, top) in zip(work.targets, results, strict=True)
                )
        sampled: dict[int, tuple[int, float, TopLogprobs]] = {}
        if sampled_out is not None:
            picks = zip(sampled_out.tokens, sampled_out.logprobs, sampled_out.top_logprobs, strict=True)
            sampled = dict(zip(inp.sample_rows, picks, strict=True))
        generated = 0
        for row, (seq, n) in enumerate(zip(seqs, counts, strict=True)):
            if seq.status.is_finished() or n == 0:
                continue  # aborted while the step ran (its blocks are already back in the pool), or deferred
            seq.num_computed += n
            if seq.prefix_register:
                self._register_prefix(seq)
            if seq.zz_hidden is not None:
                seq.zz_hidden = None
                self.zigzag["continued"] += 1
            if row in sampled:
                token, logprob, top = sampled[row]
                generated += 1
                self._emit(seq, token, logprob, top, now)
        self._total_generated += generated
        self._total_prompt += prefill_tokens
        self._decode_window.add(now, generated)
        self._prefill_window.add(now, prefill_tokens)
        self._steps += 1
        self.step_log.append(StepRecord(self._steps, plan.admitted, plan.work, compute_s, now - t0))

    # ---- MAX_UTILIZATION ----------------------------------------------------------------------

    @staticmethod
    def _pausable(seq: _Seq) -> bool:
        """Whether MAX_UTILIZATION may pause `seq` (and so lets it reserve only its next step).

        Requests whose KV is not simply theirs to recompute are never paused and keep the
        GUARANTEED_NO_EVICT reservation they got in `_add`: a hand-off (it ends after its first
        token anyway), a ZigZag request on a loading instance (its KV is pulled by its partner),
        one whose KV is arriving or whose ZigZag continuation has not run yet (a pull writes into
        its blocks), and one leaving by live migration."""
        return not (
            seq.mode.hands_off
            or seq.mode is RequestMode.ZIGZAG_FIRST_LAYERS
            or seq.fill is not None
            or seq.status in (RequestStatus.WAITING_FOR_KV, RequestStatus.MIGRATING)
            or seq.zz_hidden is not None
        )

    @property
    def _max_input_len(self) -> int:
        """The longest prompt a paused request can be recomputed from: the model's context, or
        without chunked prefill one iteration's tokens."""
        context = self.model.config.max_context_tokens
        return context if self.config.enable_chunked_prefill else min(context, self.config.max_num_tokens)

    def _make_room(self) -> None:
        """MAX_UTILIZATION, between steps: pause running requests (the most recently started
        first) until every other one's next step fits in the free blocks, swap paused requests
        back in when they fit, and set each pausable request's reservation to what its next
        step needs (`blocks_reserved`, which `_available_blocks` and the scheduler count)."""
        cache = self.kv_cache
        bs = cache.block_size
        paused = False
        # Again after each round of pauses, from the blocks actually free: a victim's blocks may
        # not all come back (e.g. shared with another sequence by an allocator that shares).
        while True:
            active: list[ActiveSeq] = []
            for seq in self._running:
                held = cache.num_blocks_of(seq.request_id)
                pausable = self._pausable(seq)
                if pausable:
                    nxt = next_step_blocks(
                        computed_tokens=seq.num_computed,
                        pending_tokens=seq.pending,
                        blocks_held=held,
                        block_size=bs,
                        limits=self._limits,
                    )
                    seq.blocks_reserved = held + nxt
                else:
                    nxt = max(0, seq.blocks_reserved - held)
                active.append(ActiveSeq(seq.request_id, held, nxt, pausable))
            victims = pick_victims(active, cache.free_blocks)
            if not victims:
                break
            for request_id in victims:  # the most recently started first: each goes to the queue's front
                self._pause(self._by_id[request_id])
            paused = True
        if not paused:
            self._swap_in()
        for seq in self._waiting:
            if seq.status is RequestStatus.SWAPPED:
                # Never admitted by the scheduler (which would prefill it from scratch): the
                # queue stops at it until `_swap_in` restores it.
                seq.blocks_reserved = cache.total_blocks + 1
            elif seq.status is RequestStatus.PREEMPTED:
                # Back only when all of its recomputed tokens fit: started on a first chunk, it
                # would be the most recent again and the first to be paused again.
                seq.blocks_reserved = blocks_for(seq.num_tokens, bs)
            elif self._pausable(seq):
                seq.blocks_reserved = start_blocks(
                    CapacityPolicy.MAX_UTILIZATION,
                    prefill_tokens=seq.prefill_len,
                    total_tokens=len(seq.prompt) + seq.params.max_tokens,
                    block_size=bs,
                    limits=self._limits,
                )

    def _pause(self, seq: _Seq) -> None:
        """Stop a running request and put it at the front of the queue with its generated tokens.

        Recompute (the default): its KV is dropped and its output folded into the prompt it is
        prefilled from again (`resumed`, as a request migrated here resumes), so the stream goes
        on with no token repeated or lost: a seeded sampler keeps its state, penalties their
        history. The engine's input limit is the model's context, which prompt + max_tokens never
        exceeds, so the fold never cuts; without chunked prefill a fold longer than
        max_num_tokens could never be prefilled again, and such a request is swapped instead.
        Swap: its KV is copied to host memory and restored into fresh blocks by `_swap_in`."""
        computed = seq.num_computed
        generated = len(seq.output)
        folded = fold_paused_prompt(len(seq.prompt), generated, self._max_input_len)
        swap = computed > 0 and (self.config.preemption_mode == "swap" or folded < seq.num_tokens)
        if swap:
            k, v = self.kv_cache.copy_out(seq.request_id, computed)
            seq.swapped = _Swapped(k, v, computed)
        else:
            seq.resumed = generated
            if seq.prompt_logprobs is not None and len(seq.prompt_logprobs) < len(seq.prompt):
                del seq.prompt_logprobs[1:]  # computed again with the prompt
        self.kv_cache.free(seq.request_id)
        seq.num_computed = 0
        seq.status = RequestStatus.SWAPPED if swap else RequestStatus.PREEMPTED
        self._running.remove(seq)
        self._waiting.appendleft(seq)
        self.preemptions["swap" if swap else "recompute"] += 1
        log.info(
            "request_paused",
            request_id=seq.request_id,
            mode="swap" if swap else "recompute",
            kv_tokens=computed,
            generated=generated,
        )

    def _swap_in(self) -> None:
        """Restore swapped requests at the front of the queue, in order, while the batch has room
        and the blocks for their KV and next step are free; they go on as running requests."""
        bs = self.kv_cache.block_size
        while self._waiting and len(self._running) < self.config.max_batch_size:
            seq = self._waiting[0]
            if seq.status is not RequestStatus.SWAPPED:
                return
            swapped = seq.swapped
            assert swapped is not None
            held = blocks_for(swapped.num_tokens, bs)
            need = held + next_step_blocks(
                computed_tokens=swapped.num_tokens,
                pending_tokens=seq.num_tokens - swapped.num_tokens,
                blocks_held=held,
                block_size=bs,
                limits=self._limits,
            )
            if need > self._available_blocks():
                return
            self._waiting.popleft()
            self.kv_cache.copy_in(seq.request_id, swapped.k, swapped.v)
            seq.num_computed = swapped.num_tokens
            seq.swapped = None
            seq.status = RequestStatus.RUNNING
            seq.blocks_reserved = need
            self._running.append(seq)
            log.info("request_swapped_in", request_id=seq.request_id, kv_tokens=swapped.num_tokens)

    def _match_prefix(self, seq: _Seq) -> list[int]:
        """The cached blocks `seq` may start from: the longest cached run of its first full
        blocks, short of its last token (the step that computes it samples the next one)."""
        bs = self.kv_cache.block_size
        n = (seq.prefill_len - 1) // bs
        if len(seq.block_hashes) < n:
            seq.block_hashes = block_hashes(seq.tokens(0, n * bs), bs)
        return self.kv_cache.match_prefix(seq.tokens(0, n * bs), seq.block_hashes[:n])

    def _register_prefix(self, seq: _Seq) -> None:
        """Offer `seq`'s full blocks whose KV is now computed to the prefix cache."""
        bs = self.kv_cache.block_size
        full = seq.num_computed // bs
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

    def _zigzag_work(self) -> list[_Partial]:
        """ZigZag on a loading instance: the running ZigZag requests whose next layer is loaded,
        each to run every loaded layer it has not run yet (in arrival order, within the token
        budget; the first always runs), those a partner waits for first. Requests waiting for a
        layer, or for their partner, wait."""
        loaded = self.model.num_layers_loaded
        budget = self.config.max_num_tokens
        work: list[_Partial] = []
        # Requests a partner is waiting to take over go first, then in arrival order.
        for seq in sorted(self._running, key=lambda s: not s.relay_waiters):
            if seq.mode is not RequestMode.ZIGZAG_FIRST_LAYERS or seq.status.is_finished() or seq.zz_layers >= loaded:
                continue
            n = len(seq.prompt)
            if work and n > budget:
                break
            budget -= n
            work.append(
                _Partial(seq, seq.zz_layers, loaded, n, self.kv_cache.block_table(seq.request_id), seq.zz_hidden)
            )
        return work

    def notify_layers(self) -> None:
        """A decoder layer arrived (a loading instance): ZigZag requests may run further."""
        self._wake.set()

    async def _fill(self, seq: _Seq) -> None:
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
            # The remaining layers run here, on the hidden states it brought (see _step).
            seq.zz_layers, seq.zz_hidden = result.layers, result.hidden
        elif ok and not relay:
            seq.num_computed = seq.num_tokens - 1
            self.kv_fills["pulled"] += 1
        else:
            # Recompute: the request becomes a running prefill of prompt + resumed tokens.
            self.kv_cache.free(seq.request_id)
            self.kv_cache.allocate(seq.request_id, 0)
            seq.num_computed = 0
            if relay:
                self.zigzag["recomputed"] += 1
            else:
                self.kv_fills["recomputed"] += 1
        self._wake.set()

    def _emit(self, seq: _Seq, token: int, logprob: float, top: TopLogprobs, now: float) -> None:
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
                TokenEvent(token, None, len(seq.prompt), len(seq.output), logprob, top, prompt_lps, parked, kv_tokens)
            )
            return
        seq.queue.put_nowait(TokenEvent(token, reason, len(seq.prompt), len(seq.output), logprob, top, prompt_lps))
        if reason is not None:
            if self._scorpio is not None and seq.scorpio is not None:
                self._scorpio.lengths.observe(len(seq.prompt), len(seq.output), seq.scorpio.predicted_output_tokens)
            self._finish(seq, reason, notify=False)

    def _execute(
        self, inp: _StepInput
    ) -> tuple[SampleOutput | None, list[list[tuple[float, TopLogprobs]]], list[torch.Tensor]]:
        """The compute thread's part of a step: forward over the flat batch, then sampling (and
        the prompt log-probs some prefills asked for, from the same hidden states); ZigZag
        continuations run their remaining layers; ZigZag requests on a loading instance run the
        layers it holds and keep their hidden states."""
        model = self.model
        device = model.device
        if self._cpu_share is not None and self._cpu_share.threads() != self._threads:
            self._set_threads(self._cpu_share.threads())
        num_layers = model.config.num_hidden_layers
        logits_parts: list[torch.Tensor] = []
        prompt_out: list[list[tuple[float, TopLogprobs]]] = []
        if inp.query_lens:
            batch = ForwardBatch.build(
                inp.query_lens,
                inp.context_lens,
                inp.block_tables,
                self.kv_cache.block_size,
                logits_rows=inp.logits_local,
                device=device,
            )
            ids = torch.tensor(inp.input_ids, dtype=torch.long, device=device)
            if not inp.prompt_work:
                if inp.logits_local:
                    logits_parts.append(model.forward_batch(ids, batch, self.kv_cache))
                else:
                    model.run_layers(model.embed(ids), 0, num_layers, batch, self.kv_cache)
            else:
                # forward_batch's steps, keeping every position's hidden state for the prompt logits.
                hidden = model.run_layers(model.embed(ids), 0, num_layers, batch, self.kv_cache)
                if inp.logits_local:
                    logits_parts.append(model.head(hidden.index_select(0, batch.logits_indices)))
                starts = [0]
                for n in inp.query_lens:
                    starts.append(starts[-1] + n)
                for work in inp.prompt_work:
                    results: list[tuple[float, TopLogprobs]] = []
                    base = starts[work.row]
                    for a in range(0, len(work.targets), _PROMPT_LOGITS_ROWS):
                        b = min(a + _PROMPT_LOGITS_ROWS, len(work.targets))
                        rows = torch.arange(base + a, base + b, device=hidden.device)
                        results.extend(
                            prompt_logprobs(model.head(hidden.index_select(0, rows)), work.targets[a:b], work.k)
                        )
                    prompt_out.append(results)
        for cont in inp.continuations:
            batch = ForwardBatch.build(
                [cont.num_tokens], [0], [cont.block_table], self.kv_cache.block_size, device=device
            )
            hidden = model.run_layers(cont.hidden.to(device), cont.layer_start, num_layers, batch, self.kv_cache)
            logits_parts.append(model.head(hidden.index_select(0, batch.logits_indices)))
        partial_out: list[torch.Tensor] = []
        for part in inp.partials:
            batch = ForwardBatch.build(
                [part.num_tokens], [0], [part.block_table], self.kv_cache.block_size, device=device
            )
            if part.layer_start == 0:
                hidden = model.embed(torch.tensor(part.seq.prompt, dtype=torch.long, device=device))
            else:
                assert part.hidden is not None
                hidden = part.hidden
            partial_out.append(model.run_layers(hidden, part.layer_start, part.layer_end, batch, self.kv_cache))
        if not inp.sample_rows:
            return None, prompt_out, partial_out
        logits = logits_parts[0] if len(logits_parts) == 1 else torch.cat(logits_parts)
        return sample(logits, inp.params, inp.generators, inp.histories), prompt_out, partial_out

    # ---- SCORPIO (scheduling_policy="scorpio", ALGORITHMS.md 4) ----------------------------------
    # The pure part (credits, fits, the checks) is services/worker/engine/scorpio.py. Refusals:
    # at arrival when the TPOT SLO is out of reach even alone, or the first token cannot come by
    # the deadline behind the prefill work queued ahead; while queued once the deadline is lost
    # (its own prefill would end past it); at admission when the running set with it would
    # miss the set's tightest TPOT SLO. Only plain requests that have sent no token are refused.
    # Credits are taken over the decode rows of each iteration (TRP against the tightest of
    # them, so one always runs); prefills are not subject to them. A request without SLOs is
    # never refused, is queued after those with a deadline and decodes every iteration (TRP 1).
    # The mean length L an admission estimates with is each request's prompt plus the output it
    # is expected to reach (predicted, or what it has if more): the set's length near its end.

    def _scorpio_member(self, seq: _Seq) -> Member:
        """`seq` in an admission's set: its TPOT SLO and the length it is expected to reach."""
        t = seq.scorpio
        if t is None:
            return Member(None, seq.num_tokens)
        return Member(t.tpot_s, len(seq.prompt) + max(len(seq.output), t.predicted_output_tokens))

    def _scorpio_running_tpot(self) -> float | None:
        """The fitted step time of the running set: the TPOT of its tightest request."""
        assert self._scorpio is not None
        fit = self._scorpio.tpot.fit()
        if fit is None or not self._running:
            return None
        members = [self._scorpio_member(s) for s in self._running]
        return fit.estimate(vbs(m.tpot_s for m in members), sum(m.length_tokens for m in members) / len(members))

    def _scorpio_refusal(self, seq: _Seq, kind: SLOKind, message: str, retry_after_s: float) -> SLOUnattainable:
        assert self._scorpio is not None
        self._scorpio.rejected[kind] += 1
        log.info("slo_rejected", request_id=seq.request_id, slo=kind, retry_after_s=retry_after_s, reason=message)
        return SLOUnattainable(message, slo=kind, retry_after_s=retry_after_s)

    def _scorpio_reject_waiting(self, seq: _Seq, error: SLOUnattainable) -> None:
        # Queued: no KV, no token sent; its stream raises the error.
        self._waiting.remove(seq)
        seq.status = RequestStatus.FINISHED_REJECTED
        self._by_id.pop(seq.request_id, None)
        seq.queue.put_nowait(error)

    def _scorpio_tpot_retry_s(self, step_s: float) -> float:
        """When the running set is expected to lose a member: the soonest expected finish, each
        request's remaining predicted tokens at one per 1/TRP iterations of `step_s`."""
        members = {s.request_id: self._scorpio_member(s) for s in self._running}
        if not members or step_s <= 0:
            return step_s
        rates = trp({r: m.tpot_s for r, m in members.items()})
        return min(
            max(1.0, m.length_tokens - self._by_id[r].num_tokens) / rates[r] * step_s
            for r, m in members.items()
            if r in self._by_id
        )

    def _scorpio_tpot_message(self, seq: _Seq, decision: TPOTDecision, others: int) -> str:
        assert seq.scorpio is not None and decision.est_tpot_s is not None and decision.min_tpot_s is not None
        where = "even alone" if others == 0 else f"with the {others} running"
        return (
            f"request {seq.request_id!r} refused: TPOT SLO {seq.scorpio.tpot_s:.4g} s; the estimated TPOT"
            f" {decision.est_tpot_s:.4g} s {where} (VBS {decision.vbs:.3g}, mean length {decision.mean_len:.0f}"
            f" tokens) exceeds the set's tightest TPOT SLO {decision.min_tpot_s:.4g} s"
        )

    def _scorpio_arrive(self, seq: _Seq, plain: bool) -> None:
        """Give `seq` its ticket; raise SLOUnattainable for a plain request whose SLO is out of
        reach at once (see the section's comment)."""
        sc = self._scorpio
        assert sc is not None
        slo = seq.slo
        seq.scorpio = ticket = SLOTicket(
            deadline_s=deadline_s(seq.arrival_s, slo.ttft_s if slo is not None and plain else None),
            # Hand-offs and ZigZag requests on a loading instance never decode here.
            tpot_s=slo.tpot_s
            if slo is not None and not (seq.mode.hands_off or seq.mode is RequestMode.ZIGZAG_FIRST_LAYERS)
            else None,
            predicted_output_tokens=sc.lengths.predict(len(seq.prompt), seq.params.max_tokens),
            refusable=plain and slo is not None,
        )
        if not ticket.refusable:
            return
        if ticket.tpot_s is not None:
            alone = judge_tpot(self._scorpio_member(seq), [], sc.tpot.fit())
            if not alone.admit:
                assert alone.est_tpot_s is not None
                raise self._scorpio_refusal(seq, "tpot", self._scorpio_tpot_message(seq, alone, 0), alone.est_tpot_s)
        if math.isfinite(ticket.deadline_s):
            ahead = sum(
                s.prefill_len
                for s in self._waiting
                if s.scorpio is not None and s.scorpio.deadline_s <= ticket.deadline_s
            ) + sum(max(0, s.prefill_len - s.num_computed) for s in self._running)
            rate = sc.queue_tokens_per_s
            guard = judge_ttft(
                seq.arrival_s, ticket.deadline_s, ahead, seq.prefill_len, rate, self._scorpio_running_tpot() or 0.0
            )
            if not guard.admit:
                assert slo is not None and slo.ttft_s is not None
                est = "unknown" if guard.est_ttft_s is None else f"{guard.est_ttft_s:.4g} s"
                raise self._scorpio_refusal(
                    seq,
                    "ttft",
                    f"request {seq.request_id!r} refused: TTFT SLO {slo.ttft_s:.4g} s; estimated TTFT {est}"
                    f" ({ahead} prompt tokens queued ahead of its {seq.prefill_len}, at {rate or 0:.4g} tokens/s)",
                    guard.retry_after_s,
                )

    def _scorpio_waiting(self) -> list[_Seq]:
        """The queue in least-deadline-first order (arrival order among equal deadlines and those
        without one), after refusing the requests whose deadline is lost: the current step, the
        prefill queued ahead of it in this order and its own, at the rate the queue has been
        served at (`ScorpioState.queue_tokens_per_s`), would end past it. Refused as soon as
        that is so, not when the deadline has passed: a request that waits out its budget and
        then misses it held nothing, but one admitted late takes the batch from others."""
        sc = self._scorpio
        assert sc is not None
        now = self._clock()
        rate = sc.queue_tokens_per_s
        step_s = self._scorpio_running_tpot() or 0.0
        ordered = sorted(self._waiting, key=lambda s: s.scorpio.deadline_s if s.scorpio is not None else math.inf)
        kept: list[_Seq] = []
        ahead = sum(max(0, s.prefill_len - s.num_computed) for s in self._running)
        for seq in ordered:
            t = seq.scorpio
            if t is not None and t.refusable and math.isfinite(t.deadline_s):
                guard = judge_ttft(now, t.deadline_s, ahead, seq.prefill_len, rate, step_s)
                if not guard.admit:
                    assert seq.slo is not None and seq.slo.ttft_s is not None
                    message = (
                        f"request {seq.request_id!r} refused: TTFT SLO {seq.slo.ttft_s:.4g} s cannot be met any"
                        f" more: queued {now - seq.arrival_s:.4g} s, {ahead} prompt tokens ahead of its"
                        f" {seq.prefill_len} (queue served at {rate or 0:.4g} tokens/s)"
                    )
                    retry = guard.retry_after_s
                    self._scorpio_reject_waiting(seq, self._scorpio_refusal(seq, "ttft", message, retry))
                    continue
            ahead += seq.prefill_len
            kept.append(seq)
        return kept

    def _scorpio_held(self) -> frozenset[str]:
        """This iteration's credits: the decode rows that sit it out. Prefills are not subject
        to credits; a decode row of a request without a TPOT SLO runs every iteration."""
        assert self._scorpio is not None
        decoding = {
            s.request_id: s.scorpio.tpot_s if s.scorpio is not None else None
            for s in self._running
            if s.pending == 1
            and s.num_computed >= s.prefill_len
            and s.status is not RequestStatus.WAITING_FOR_KV
            and s.mode is not RequestMode.ZIGZAG_FIRST_LAYERS
        }
        chosen = self._scorpio.batcher.step(decoding)
        return frozenset(decoding.keys() - set(chosen))

    def _scorpio_admit(self, plan: Schedule) -> Schedule:
        """Gate the requests the capacity scheduler would start, in its order: one with a TPOT
        SLO starts only if the fitted step time of the running set with it (and those started
        before it in this step) meets the set's tightest TPOT SLO; otherwise it is refused."""
        assert self._scorpio is not None
        fit = self._scorpio.tpot.fit()
        if fit is None or not plan.admitted:
            return plan  # no measurement yet: admitted blind
        members = [self._scorpio_member(s) for s in self._running]
        refused: set[str] = set()
        for request_id in plan.admitted:
            seq = self._by_id[request_id]
            member = self._scorpio_member(seq)
            t = seq.scorpio
            if t is not None and t.refusable and t.tpot_s is not None:
                decision = judge_tpot(member, members, fit)
                if not decision.admit:
                    assert decision.est_tpot_s is not None
                    message = self._scorpio_tpot_message(seq, decision, len(members))
                    retry = self._scorpio_tpot_retry_s(self._scorpio_running_tpot() or decision.est_tpot_s)
                    self._scorpio_reject_waiting(seq, self._scorpio_refusal(seq, "tpot", message, retry))
                    refused.add(request_id)
                    continue
            members.append(member)
        if not refused:
            return plan
        return replace(
            plan,
            admitted=tuple(r for r in plan.admitted if r not in refused),
            work=tuple(w for w in plan.work if w[0] not in refused),
        )

    def _scorpio_observe(self, seqs: Sequence[_Seq], counts: Sequence[int], prefill_tokens: int, step_s: float) -> None:
        """Feed the fits from a step (before its rows' `num_computed` advance): B is the step's
        tokens (a decode row is 1; under pacing a step costs base + per_token * tokens, exactly
        the model's b*B + d), L the mean context length of its rows, the time measured."""
        assert self._scorpio is not None
        contexts = [seq.num_computed + n for seq, n in zip(seqs, counts, strict=True) if n > 0]
        if not contexts:
            return
        self._scorpio.tpot.observe(sum(counts), sum(contexts) / len(contexts), step_s)
        self._scorpio.prefill.observe(prefill_tokens, step_s)
        if (self._steps + 1) % _SCORPIO_LOG_EVERY_STEPS == 0:
            log.info("scorpio_fit", **self._scorpio.report())

    def scorpio_report(self) -> dict[str, Any] | None:
        """SCORPIO's fits and counters (None under FCFS): the TPOT model (coefficients, terms,
        points, R^2, mean absolute error), the prefill rate, the output-length predictor's mean
        absolute error, refusals by kind and the running set's estimated TPOT."""
        if self._scorpio is None:
            return None
        return {**self._scorpio.report(), "est_tpot_s": self._scorpio_running_tpot()}

    # ---- observability ------------------------------------------------------------------------

    @property
    def prefix_cache_tokens(self) -> tuple[int, int]:
        """(prompt tokens found cached, prompt tokens looked up) since start: plain ints, safe to
        read from another thread (a metrics scrape), unlike `stats()`."""
        return self._prefix_hit_tokens, self._prefix_query_tokens

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
            waiting_prefill_tokens=sum(s.prefill_len for s in self._waiting)
            + sum(max(0, s.prefill_len - s.num_computed) for s in self._running),
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
            est_tpot_s=self._scorpio_running_tpot() if self._scorpio is not None else None,
            slo_rejected_total=self._scorpio.rejected_total if self._scorpio is not None else 0,
            preempted_total=sum(self.preemptions.values()),
            prefix_hit_tokens=self._prefix_hit_tokens,
            prefix_query_tokens=self._prefix_query_tokens,
        )
