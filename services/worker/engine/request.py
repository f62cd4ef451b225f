"""A request's mode (how its first tokens' KV comes to be and where it goes next) and its status
in the engine: two typed values in place of the flags the engine read them from.

The status is ordered as vLLM's `RequestStatus` (vllm/v1/request.py) is: queued states first,
then the admitted ones (holding a batch slot and KV blocks), then the finished ones.
"""

from __future__ import annotations

import enum
from typing import Literal

FinishReason = Literal["stop", "length", "abort"]


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
