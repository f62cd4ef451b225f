"""A request's mode (how its first tokens' KV comes to be and where it goes next) and its status
in the engine: two typed values in place of the flags the engine read them from.

The status is ordered as vLLM's `RequestStatus` (vllm/v1/request.py) is: queued states first,
then the admitted ones (holding a batch slot and KV blocks), then the finished ones.
"""

from __future__ import annotations

import asyncio
import enum
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from services.worker.engine.outputs import FinishReason
from services.worker.engine.sampling import PromptLogprob, SamplingParams, TokenHistory
from services.worker.engine.scorpio import SLOTicket
from services.worker.engine.slo import RequestSLO

if TYPE_CHECKING:
    from services.worker.engine.outputs import KVFill, RelayFill, RelayOutcome, TokenEvent


class RequestStatus(enum.IntEnum):
    """Where a request is in its life on this engine. `is_queued()`: in the waiting queue;
    `is_admitted()`: in the running batch; `is_finished()`: gone from both."""

    WAITING = enum.auto()  # queued, nothing of it started here yet
    PREEMPTED = enum.auto()  # paused by MAX_UTILIZATION, KV dropped: queued to be recomputed
    SWAPPED = enum.auto()  # paused by MAX_UTILIZATION, KV in host memory: queued to be swapped in
    WAITING_FOR_KV = enum.auto()  # admitted; its KV is arriving from a peer (a KV fill or a ZigZag relay)
    RUNNING = enum.auto()
    MIGRATING = enum.auto()  # running; leaves with its KV at the next step boundary (live migration)
    # Anything after MIGRATING is finished.
    FINISHED_STOPPED = enum.auto()  # sampled a stop token
    FINISHED_LENGTH = enum.auto()  # reached max_tokens
    FINISHED_ABORTED = enum.auto()  # aborted, or its stream was closed
    FINISHED_HANDED_OFF = enum.auto()  # left with its KV parked for a peer: a hand-off, a live migration
    FINISHED_RELAYED = enum.auto()  # ZigZag, a loading instance: its partner took it over
    FINISHED_MOVED = enum.auto()  # released from the queue to another instance (rebalancing)
    FINISHED_REJECTED = enum.auto()  # refused while queued because its SLO could not be met
    FINISHED_FAILED = enum.auto()  # the engine stopped or crashed under it

    def is_queued(self) -> bool:
        return self <= RequestStatus.SWAPPED

    def is_admitted(self) -> bool:
        return RequestStatus.WAITING_FOR_KV <= self <= RequestStatus.MIGRATING

    def is_finished(self) -> bool:
        return self > RequestStatus.MIGRATING

    @staticmethod
    def finished(reason: FinishReason) -> RequestStatus:
        """The finished status of a stream that ends with `reason`."""
        return _FINISHED[reason]


_FINISHED: dict[str, RequestStatus] = {
    "stop": RequestStatus.FINISHED_STOPPED,
    "length": RequestStatus.FINISHED_LENGTH,
    "abort": RequestStatus.FINISHED_ABORTED,
}


class RequestMode(enum.Enum):
    """How a request runs here: where the KV of its first tokens comes from, and whether it stops
    after its first token to hand its KV off. Fixed when it arrives, except that a queued
    colocated request may become a ZigZag partner (`with_relay`, `Engine.attach_relay`)."""

    # The prompt is computed here and the request decodes here (a resumed request included).
    COLOCATED = "colocated"
    # The prefill side of disaggregation: after the first token its KV is parked for the decode side.
    PREFILL_HANDOFF = "prefill_handoff"
    # The decode side: the KV of its first tokens is pulled from the prefill side, then it decodes.
    DECODE_FROM_KV = "decode_from_kv"
    # ZigZag, a loading instance: the prompt runs through the layers held here until the partner
    # takes it over; nothing is sampled here.
    ZIGZAG_FIRST_LAYERS = "zigzag_first_layers"
    # ZigZag, the full partner: the first layers ran on a loading instance; their KV and hidden
    # states are pulled, the remaining layers run here and it decodes here.
    ZIGZAG_PARTNER = "zigzag_partner"
    # Both: taken over from a loading instance, then handed off after its first token (ZigZag on
    # the prefill instance of a disaggregated deployment).
    ZIGZAG_PARTNER_HANDOFF = "zigzag_partner_handoff"

    @property
    def hands_off(self) -> bool:
        """It parks its KV after its first token instead of decoding here."""
        return self in (RequestMode.PREFILL_HANDOFF, RequestMode.ZIGZAG_PARTNER_HANDOFF)

    @property
    def relayed(self) -> bool:
        """Its first layers come from a loading instance (ZigZag)."""
        return self in (RequestMode.ZIGZAG_PARTNER, RequestMode.ZIGZAG_PARTNER_HANDOFF)

    @property
    def computes_prompt_here(self) -> bool:
        """Every layer of its prompt runs here (so cached prefixes may stand in for some)."""
        return self in (RequestMode.COLOCATED, RequestMode.PREFILL_HANDOFF)

    def with_relay(self) -> RequestMode:
        """The mode once its first layers are to come from a loading instance."""
        if self.hands_off:
            return RequestMode.ZIGZAG_PARTNER_HANDOFF
        if self in (RequestMode.COLOCATED, RequestMode.ZIGZAG_PARTNER):
            return RequestMode.ZIGZAG_PARTNER
        raise ValueError(f"a {self.value} request cannot be taken over from a loading instance")

    @staticmethod
    def of(*, handoff: bool, kv_fill: bool, zigzag: bool, relay: bool) -> RequestMode:
        """The mode the engine's `generate` flags describe; ValueError for a combination that
        names no mode (the engine checks them first, with the request's id in the message)."""
        if sum((handoff, kv_fill, zigzag, relay)) > 1 and not (handoff and relay and not (kv_fill or zigzag)):
            raise ValueError(
                f"handoff={handoff}, kv_fill={kv_fill}, zigzag={zigzag}, relay={relay} name no request mode"
            )
        if relay:
            return RequestMode.ZIGZAG_PARTNER_HANDOFF if handoff else RequestMode.ZIGZAG_PARTNER
        if handoff:
            return RequestMode.PREFILL_HANDOFF
        if kv_fill:
            return RequestMode.DECODE_FROM_KV
        if zigzag:
            return RequestMode.ZIGZAG_FIRST_LAYERS
        return RequestMode.COLOCATED


@dataclass(eq=False)
class EngineRequest:
    """A request as the engine holds it: its tokens, where it stands (`status`), how it runs
    (`mode`), and the state of the features that touch it."""

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
    # ZigZag on a loading instance without its embedding yet: the prompt's embedding, looked up
    # by the partner, until the first layers have run.
    zz_embedded: torch.Tensor | None = None
    relay_waiters: list[asyncio.Future[RelayOutcome]] = field(default_factory=list)
    slo: RequestSLO | None = None  # latency objectives (SCORPIO schedules by them; FCFS ignores them)
    scorpio: SLOTicket | None = None  # SCORPIO's view of it (scheduling_policy="scorpio" only)
    swapped: SwappedKV | None = None  # a paused request's KV in host memory (status SWAPPED)
    # Prefix caching: look its first tokens up when admitted / cache its full blocks once computed.
    prefix_lookup: bool = False
    prefix_register: bool = False
    block_hashes: list[int] = field(default_factory=list)  # chained hashes of its first full blocks
    num_registered: int = 0  # blocks of its table offered to the prefix cache so far
    # Of its prompt's tokens, those whose KV the prefix cache held when its prompt was last
    # prefilled here (re-admitted after a recompute pause: that admission's; a resumed request's
    # match may reach into its output, which does not count). None while the prompt's KV came
    # from elsewhere: a pulled KV fill (the instance that computed it counted it).
    cached_tokens: int | None = None

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
class SwappedKV:
    """The KV of a paused request's first `num_tokens` tokens, copied out of the pool
    (`KVCache.copy_out`), until it is copied back into fresh blocks."""

    k: torch.Tensor
    v: torch.Tensor
    num_tokens: int
