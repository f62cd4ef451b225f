"""KV-cache transfer between two workers' paged caches over the data plane (prefill -> decode, migration).

The producer (the prefill worker, or the instance a request leaves) *offers* a request's KV blocks
for a layer range with `KVServer.offer`; the offer's `KVDescriptor` travels to the consumer over
the control plane (as `blitzmesh.v1.KVTransferDescriptor`, see `services.worker.convert`), and
the consumer *pulls* it with `receive_kv`: it allocates blocks in its own cache and receives every
message straight into them, with no staging copy. The producer keeps the request's blocks until
the offer completes or fails; then its caller decides (free them, offer again).

Producer::

    kv_server = KVServer(group_server, engine.kv_cache, model_id=model_id)    # once per process
    offer = kv_server.offer(request_id, num_tokens=n)                          # blocks stay put
    ...send offer.descriptor to the consumer...; await offer.wait()            # then free the blocks

Consumer::

    result = await receive_kv(transport, descriptor, engine.kv_cache, model_id=model_id)
    # the request's blocks (result.block_table) now hold the producer's K/V of those layers

Wire protocol: one connection per transfer, served by the producer's `GroupServer` (op "kv_pull"),
tags as in `services.dataplane.chain`:
  1. consumer -> producer, CONTROL_TAG: {"op": "kv_pull", "transfer_id", "layout", "layers",
     "num_tokens", "blocks" (the consumer's block table), "max_message_bytes", "checksum"}.
  2. producer -> consumer, CONTROL_TAG: {"ok": true, "blocks": the producer's table}, or
     {"ok": false, "kind": "layout_mismatch" | "unknown_transfer" | "busy", "error": ...}.
  3. producer -> consumer: message i on DATA_TAG_BASE + i, `window_messages` in flight.
  4. producer -> consumer, CONTROL_TAG: {"checksums": [one per message]} once every message is
     sent; or {"abort": reason} at any time.
  5. consumer -> producer, CONTROL_TAG: {"done": true} once every checksum matched, else
     {"failed": reason}. The offer completes on "done".
The message plan is layer-major, K then V, one message per run of blocks that is contiguous in
both caches (split further at `max_message_bytes`); both sides compute it from the two tables.
Whole blocks move: the last block's slots past `num_tokens` carry whatever the producer had there,
which attention masks out.

Every wait is bounded: a producer that dies or stalls ends `receive_kv` with `TransferTimeout` or
`PeerClosed` within `stall_timeout_s`, after the endpoint is aborted (no late write can land) and
the consumer's blocks are freed. Checksums are `services.dataplane.checksum`'s default, one per
message, computed on both sides while the bytes move.
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Final, Protocol

import numpy as np
import structlog
import torch
from pydantic import BaseModel, ConfigDict, Field

from services.common.waiting import wait_for
from services.dataplane.buffers import as_uint8_array
from services.dataplane.chain import CONTROL_TAG, DATA_TAG_BASE, GroupServer
from services.dataplane.checksum import checksum_algo_of, group_checksum
from services.dataplane.errors import (
    ChecksumMismatch,
    DataPlaneError,
    ManifestMismatch,
    PeerClosed,
    ProtocolError,
    TransferTimeout,
    TransportError,
    UpstreamAborted,
)
from services.dataplane.transport import MAX_TAG, Endpoint, Transport, address_label
from services.worker.engine.kv_cache import KVCache

__all__ = [
    "KV_PULL_OP",
    "KVBlockAllocator",
    "KVDescriptor",
    "KVLayoutMismatch",
    "KVOffer",
    "KVServer",
    "KVTransferConfig",
    "KVTransferResult",
    "KVMessage",
    "check_layout",
    "decode_control",
    "dtype_name",
    "encode_control",
    "plan_messages",
    "receive_kv",
]

log = structlog.get_logger(__name__)

KV_PULL_OP: Final = "kv_pull"
_PROTOCOL_VERSION: Final = 1
_MAX_CONTROL_BYTES: Final = 16 << 20
_LAYOUT_FIELDS: Final = ("model_id", "block_size", "num_kv_heads", "head_dim", "dtype")


class KVTransferConfig(BaseModel):
    """Timeouts and message sizes of KV transfers (both sides)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    stall_timeout_s: float = Field(
        10.0, gt=0, description="a peer silent this long (no message, no reply) is dead: the transfer fails"
    )
    connect_timeout_s: float = Field(10.0, gt=0, description="consumer: most seconds to reach the producer")
    offer_timeout_s: float = Field(
        60.0, gt=0, description="producer: an offer nobody has started to pull after this long fails"
    )
    window_messages: int = Field(
        4, ge=1, description="producer: sends in flight; the consumer keeps twice as many receives posted"
    )
    max_message_bytes: int = Field(
        0,
        ge=0,
        description="consumer: split runs of contiguous blocks into messages of at most this many bytes "
        "(whole blocks, at least one); 0 = one message per run",
    )
    checksum: bool = Field(True, description="consumer: checksum every message on both sides (off: benchmarks only)")


class KVLayoutMismatch(ManifestMismatch):
    """Producer and consumer caches differ in a way that makes the blocks meaningless on the other side.

    `fields` maps each differing field to (producer value, consumer value).
    """

    def __init__(self, message: str, *, fields: dict[str, tuple[Any, Any]]) -> None:
        super().__init__(message)
        self.fields = fields


class KVBlockAllocator(Protocol):
    """Who hands out the consumer's blocks: the cache itself, or the engine that keeps its own
    reservations on top of the cache (so a transfer cannot take blocks promised to running requests)."""

    def allocate(self, seq_id: str, num_tokens: int) -> list[int]: ...

    def free(self, seq_id: str) -> int: ...


def dtype_name(dtype: torch.dtype) -> str:
    """ "float32" for torch.float32: how dtypes are named on the wire."""
    return str(dtype).removeprefix("torch.")


@dataclass(frozen=True, slots=True)
class KVDescriptor:
    """What a producer offers: one request's K/V for layers [layer_start, layer_end), first `num_tokens` tokens."""

    transfer_id: str
    request_id: str
    model_id: str
    layer_start: int
    layer_end: int
    num_tokens: int
    block_size: int
    num_kv_heads: int
    head_dim: int
    dtype: str
    producer_address: bytes
    size_bytes: int

    @property
    def layers(self) -> tuple[int, int]:
        return self.layer_start, self.layer_end

    @property
    def num_blocks(self) -> int:
        return -(-self.num_tokens // self.block_size)

    def layout(self) -> dict[str, Any]:
        return {name: getattr(self, name) for name in _LAYOUT_FIELDS}


def cache_layout(cache: KVCache, model_id: str) -> dict[str, Any]:
    return {
        "model_id": model_id,
        "block_size": cache.block_size,
        "num_kv_heads": cache.num_kv_heads,
        "head_dim": cache.head_dim,
        "dtype": dtype_name(cache.dtype),
    }


def check_layout(
    producer: dict[str, Any],
    consumer: dict[str, Any],
    *,
    layers: tuple[int, int],
    consumer_layers: tuple[int, int],
    what: str,
) -> None:
    """Raise KVLayoutMismatch naming every field where the two sides differ, with both values; a
    layer range the consumer's cache does not hold counts as one (offered range, cached range)."""
    fields: dict[str, tuple[Any, Any]] = {
        name: (producer.get(name), consumer.get(name))
        for name in _LAYOUT_FIELDS
        if producer.get(name) != consumer.get(name)
    }
    lo, hi = consumer_layers
    if not lo <= layers[0] < layers[1] <= hi:
        fields["layers"] = (list(layers), list(consumer_layers))
    if fields:
        detail = "; ".join(f"{name} producer={p!r} consumer={c!r}" for name, (p, c) in fields.items())
        raise KVLayoutMismatch(f"{what} refused, the KV layouts differ: {detail}", fields=fields)


@dataclass(frozen=True, slots=True)
class KVMessage:
    """One data message: `num_blocks` blocks of K (kv=0) or V (kv=1) of `layer`, contiguous on both sides."""

    layer: int
    kv: int
    src_block: int
    dst_block: int
    num_blocks: int

    def describe(self) -> str:
        return f"layer {self.layer} {'KV'[self.kv]} blocks {self.dst_block}..{self.dst_block + self.num_blocks - 1}"


def plan_messages(
    src_blocks: Sequence[int], dst_blocks: Sequence[int], layers: tuple[int, int], max_blocks: int = 0
) -> list[KVMessage]:
    """The messages of a transfer: per layer, K then V, one per run of logical blocks whose ids are
    consecutive in both tables (at most `max_blocks` blocks each; 0 = unbounded)."""
    if len(src_blocks) != len(dst_blocks):
        raise ValueError(f"block tables differ in length: producer {len(src_blocks)}, consumer {len(dst_blocks)}")
    runs: list[tuple[int, int, int]] = []
    n = len(src_blocks)
    i = 0
    while i < n:
        j = i + 1
        while (
            j < n
            and (max_blocks <= 0 or j - i < max_blocks)
            and src_blocks[j] == src_blocks[j - 1] + 1
            and dst_blocks[j] == dst_blocks[j - 1] + 1
        ):
            j += 1
        runs.append((int(src_blocks[i]), int(dst_blocks[i]), j - i))
        i = j
    return [KVMessage(layer, kv, s, d, k) for layer in range(*layers) for kv in (0, 1) for s, d, k in runs]


def _max_blocks(max_message_bytes: int, block_bytes: int) -> int:
    return 0 if max_message_bytes <= 0 else max(1, max_message_bytes // block_bytes)


class _ByteViews:
    """The bytes of each message, from or into a cache's K and V storage.

    On the CPU: flat uint8 views of the storage, sliced per message (a numpy slice per message
    instead of torch indexing and a tensor-to-numpy conversion, which cost more than small
    messages); the transports read and write the cache in place. On a GPU the transports move
    host memory: a message being sent is first copied from the device (`__call__`), and one
    being received lands in a host buffer that `land` then copies to the device.
    """

    def __init__(self, cache: KVCache) -> None:
        k, v = cache.storage()
        self._device = k.device.type != "cpu"
        if self._device:
            self._tensors = (k.view(-1).view(torch.uint8), v.view(-1).view(torch.uint8))
        else:
            self._bytes = (as_uint8_array(k, writable=True), as_uint8_array(v, writable=True))
        self._block_bytes = cache.block_bytes
        self._num_blocks = cache.num_blocks
        self._first_layer = cache.first_layer

    def _span(self, msg: KVMessage, first_block: int) -> tuple[int, int]:
        start = ((msg.layer - self._first_layer) * self._num_blocks + first_block) * self._block_bytes
        return start, start + msg.num_blocks * self._block_bytes

    def __call__(self, msg: KVMessage, first_block: int) -> np.ndarray:
        """The message's bytes to send (on a GPU: a host copy of them)."""
        start, end = self._span(msg, first_block)
        if self._device:
            return self._tensors[msg.kv][start:end].cpu().numpy()
        return self._bytes[msg.kv][start:end]

    def target(self, msg: KVMessage, first_block: int) -> np.ndarray:
        """Where the message is received: the cache itself, or on a GPU a host buffer (see `land`)."""
        if self._device:
            start, end = self._span(msg, first_block)
            return np.empty(end - start, dtype=np.uint8)
        return self(msg, first_block)

    def land(self, msg: KVMessage, first_block: int, received: np.ndarray) -> None:
        """Put a received message where it belongs (on the CPU it already is)."""
        if self._device:
            start, end = self._span(msg, first_block)
            self._tensors[msg.kv][start:end].copy_(torch.from_numpy(received))


def _checksum(data: np.ndarray, algo: str | None = None) -> str:
    return group_checksum(data) if algo is None else group_checksum(data, algo)


def encode_control(obj: dict[str, Any]) -> bytes:
    return json.dumps(obj, separators=(",", ":")).encode()


def decode_control(data: bytes, what: str, peer: str) -> dict[str, Any]:
    """A JSON control message as a dict; ProtocolError naming `what` and `peer` otherwise."""
    try:
        obj = json.loads(data)
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ProtocolError(f"{what} from {peer} is not JSON: {exc}") from None
    if not isinstance(obj, dict):
        raise ProtocolError(f"{what} from {peer} is not a JSON object: {obj!r:.100}")
    return obj


@dataclass(slots=True)
class KVTransferResult:
    """What a finished transfer moved (either side)."""

    transfer_id: str
    request_id: str
    layers: tuple[int, int]
    num_tokens: int
    block_table: list[int]
    size_bytes: int
    messages: int
    elapsed_s: float
    peer: str = ""
    checksums: list[str] = field(default_factory=list)

    @property
    def gbps(self) -> float:
        return self.size_bytes / self.elapsed_s / 1e9 if self.elapsed_s > 0 else 0.0


# -- the producer -------------------------------------------------------------------------------------


class KVOffer:
    """A request's blocks offered to one consumer; `wait()` gives the outcome.

    States: offered -> sending -> done | failed. An offer nobody starts to pull within
    `offer_timeout_s` fails with TransferTimeout; a consumer refused for its layout leaves the
    offer open for another. The request's blocks are never freed here.
    """

    def __init__(self, descriptor: KVDescriptor, block_table: list[int], server: KVServer, timeout_s: float) -> None:
        self.descriptor = descriptor
        self.block_table = block_table
        self.state = "offered"
        self._server = server
        loop = asyncio.get_running_loop()
        self._outcome: asyncio.Future[KVTransferResult] = loop.create_future()
        # A failed offer nobody awaits must not log "exception was never retrieved".
        self._outcome.add_done_callback(lambda f: f.cancelled() or f.exception())
        self._expiry = loop.call_later(timeout_s, self._expire, timeout_s)

    @property
    def transfer_id(self) -> str:
        return self.descriptor.transfer_id

    @property
    def done(self) -> bool:
        return self._outcome.done()

    async def wait(self, timeout_s: float | None = None) -> KVTransferResult:
        """The transfer's result once the consumer has every byte and checked it; raises the
        transfer's error (a DataPlaneError) if it failed or expired."""
        return await wait_for(asyncio.shield(self._outcome), timeout_s)

    def cancel(self, reason: str = "cancelled by the producer") -> None:
        """Withdraw an offer not yet pulled (a transfer in progress is not interrupted)."""
        if self.state == "offered":
            self._fail(UpstreamAborted(f"KV transfer {self.transfer_id!r} withdrawn: {reason}"))

    def _expire(self, timeout_s: float) -> None:
        if self.state == "offered":
            self._fail(
                TransferTimeout(
                    f"KV transfer {self.transfer_id!r} of request {self.descriptor.request_id!r}: "
                    f"no consumer pulled it within {timeout_s}s"
                )
            )

    def _start(self) -> None:
        self.state = "sending"
        self._expiry.cancel()

    def _succeed(self, result: KVTransferResult) -> None:
        self.state = "done"
        self._expiry.cancel()
        self._server._forget(self)
        if not self._outcome.done():
            self._outcome.set_result(result)

    def _fail(self, exc: BaseException) -> None:
        self.state = "failed"
        self._expiry.cancel()
        self._server._forget(self)
        if not self._outcome.done():
            self._outcome.set_exception(exc)


class KVServer:
    """The producer side: offers requests' blocks of `cache` and serves them to consumers that
    connect to `group_server`'s transport (it registers the "kv_pull" op there)."""

    def __init__(
        self, group_server: GroupServer, cache: KVCache, *, model_id: str, config: KVTransferConfig | None = None
    ) -> None:
        self.transport = group_server.transport
        self.cache = cache
        self.model_id = model_id
        self.config = config or KVTransferConfig()
        self._offers: dict[str, KVOffer] = {}
        self._group_server = group_server
        group_server.register_op(KV_PULL_OP, self._serve)

    def offer(
        self,
        request_id: str,
        *,
        num_tokens: int,
        layers: tuple[int, int] | None = None,
        transfer_id: str | None = None,
        timeout_s: float | None = None,
    ) -> KVOffer:
        """Offer the K/V of `request_id`'s first `num_tokens` tokens for `layers` (default: every
        layer cached here). The request must hold the blocks for them, and must keep them (the
        caller does not free or write them) until the offer is done."""
        start, end = layers if layers is not None else self.cache.layers
        lo, hi = self.cache.layers
        if not lo <= start < end <= hi:
            raise ValueError(f"layer range [{start}, {end}) is not cached here (layers [{lo}, {hi}))")
        if num_tokens < 1:
            raise ValueError(f"num_tokens must be >= 1, got {num_tokens}")
        needed = self.cache.blocks_needed(num_tokens)
        table = self.cache.block_table(request_id)  # KeyError naming the request if it has none
        if len(table) < needed:
            raise ValueError(
                f"request {request_id!r} holds {len(table)} blocks, {num_tokens} tokens need {needed} "
                f"(block_size {self.cache.block_size})"
            )
        transfer_id = transfer_id or uuid.uuid4().hex
        if transfer_id in self._offers:
            raise ValueError(f"transfer id {transfer_id!r} is already offered")
        descriptor = KVDescriptor(
            transfer_id=transfer_id,
            request_id=request_id,
            model_id=self.model_id,
            layer_start=start,
            layer_end=end,
            num_tokens=num_tokens,
            block_size=self.cache.block_size,
            num_kv_heads=self.cache.num_kv_heads,
            head_dim=self.cache.head_dim,
            dtype=dtype_name(self.cache.dtype),
            producer_address=self.transport.address(),
            size_bytes=2 * (end - start) * needed * self.cache.block_bytes,
        )
        offer = KVOffer(descriptor, table[:needed], self, timeout_s or self.config.offer_timeout_s)
        self._offers[transfer_id] = offer
        log.info(
            "kv_offered",
            transfer_id=transfer_id,
            request_id=request_id,
            layers=[start, end],
            num_tokens=num_tokens,
            size_bytes=descriptor.size_bytes,
        )
        return offer

    def offers(self) -> list[KVOffer]:
        """Offers not yet done (offered or sending)."""
        return list(self._offers.values())

    def _forget(self, offer: KVOffer) -> None:
        if self._offers.get(offer.transfer_id) is offer:
            del self._offers[offer.transfer_id]

    def close(self) -> None:
        """Stop taking pulls and fail every offer not yet pulled (transfers in progress run on)."""
        self._group_server.unregister_op(KV_PULL_OP)
        for offer in list(self._offers.values()):
            offer.cancel("the KV server is closing")

    async def _refuse(self, ep: Endpoint, kind: str, error: str, **extra: Any) -> None:
        log.warning("kv_pull_refused", peer=ep.peer, kind=kind, error=error)
        await ep.send_msg(
            encode_control({"ok": False, "kind": kind, "error": error, **extra}),
            CONTROL_TAG,
            timeout_s=self.config.stall_timeout_s,
        )

    async def _serve(self, ep: Endpoint, req: dict[str, Any]) -> None:
        transfer_id = str(req.get("transfer_id"))
        offer = self._offers.get(transfer_id)
        if offer is None:
            await self._refuse(ep, "unknown_transfer", f"no KV transfer {transfer_id!r} is offered here")
            return
        if offer.state != "offered":
            await self._refuse(ep, "busy", f"KV transfer {transfer_id!r} is already {offer.state}")
            return
        d = offer.descriptor
        try:
            consumer_blocks = [int(b) for b in req["blocks"]]
            consumer_layers = (int(req["consumer_layers"][0]), int(req["consumer_layers"][1]))
            layout = dict(req["layout"])
            max_message_bytes = int(req.get("max_message_bytes", 0))
            checksum = bool(req.get("checksum", True))
        except (KeyError, TypeError, ValueError, IndexError) as exc:
            await self._refuse(ep, "bad_request", f"malformed kv_pull request: {exc!r}")
            return
        try:
            check_layout(
                d.layout(),
                layout,
                layers=d.layers,
                consumer_layers=consumer_layers,
                what=f"KV transfer {transfer_id!r} of request {d.request_id!r}",
            )
            if [int(x) for x in req.get("layers", [])] != list(d.layers) or int(req.get("num_tokens", -1)) != (
                d.num_tokens
            ):
                raise KVLayoutMismatch(
                    f"KV transfer {transfer_id!r}: the consumer asks for layers {req.get('layers')} and "
                    f"{req.get('num_tokens')} tokens, the offer has {list(d.layers)} and {d.num_tokens}",
                    fields={
                        "layers/num_tokens": (
                            (list(d.layers), d.num_tokens),
                            (req.get("layers"), req.get("num_tokens")),
                        )
                    },
                )
            if len(consumer_blocks) != len(offer.block_table):
                raise KVLayoutMismatch(
                    f"KV transfer {transfer_id!r}: the consumer gives {len(consumer_blocks)} blocks, "
                    f"{d.num_tokens} tokens take {len(offer.block_table)}",
                    fields={"blocks": (len(offer.block_table), len(consumer_blocks))},
                )
        except KVLayoutMismatch as exc:
            await self._refuse(ep, "layout_mismatch", str(exc), fields={k: list(v) for k, v in exc.fields.items()})
            return
        offer._start()
        started = time.monotonic()
        clean = False
        try:
            plan = plan_messages(
                offer.block_table, consumer_blocks, d.layers, _max_blocks(max_message_bytes, self.cache.block_bytes)
            )
            if DATA_TAG_BASE + len(plan) > MAX_TAG:
                raise ProtocolError(f"KV transfer {transfer_id!r} needs {len(plan)} messages, more than tags allow")
            await ep.send_msg(
                encode_control({"ok": True, "blocks": offer.block_table}),
                CONTROL_TAG,
                timeout_s=self.config.stall_timeout_s,
            )
            checksums = await self._stream(ep, plan, checksum)
            await ep.send_msg(
                encode_control({"checksums": checksums}), CONTROL_TAG, timeout_s=self.config.stall_timeout_s
            )
            reply = decode_control(
                await ep.recv_msg(CONTROL_TAG, timeout_s=self.config.stall_timeout_s, max_bytes=1 << 16),
                "end of transfer",
                ep.peer,
            )
            if reply.get("done") is not True:
                clean = True  # every message is through and the consumer answered: no need to abort
                raise UpstreamAborted(
                    f"consumer {ep.peer} failed KV transfer {transfer_id!r}: {reply.get('failed', reply)}"
                )
        except BaseException as exc:
            if not clean:
                ep.abort()  # cancels sends in flight: nothing reads the blocks after this
            error = exc if isinstance(exc, DataPlaneError) else PeerClosed(f"KV transfer {transfer_id!r}: {exc!r}")
            offer._fail(error)
            log.warning(
                "kv_send_failed",
                transfer_id=transfer_id,
                request_id=d.request_id,
                peer=ep.peer,
                error=repr(exc),
                elapsed_s=round(time.monotonic() - started, 4),
            )
            if isinstance(exc, asyncio.CancelledError):
                raise
            return
        elapsed = time.monotonic() - started
        result = KVTransferResult(
            transfer_id=transfer_id,
            request_id=d.request_id,
            layers=d.layers,
            num_tokens=d.num_tokens,
            block_table=offer.block_table,
            size_bytes=d.size_bytes,
            messages=len(plan),
            elapsed_s=elapsed,
            peer=ep.peer,
            checksums=checksums,
        )
        offer._succeed(result)
        log.info(
            "kv_sent",
            transfer_id=transfer_id,
            request_id=d.request_id,
            peer=ep.peer,
            size_bytes=d.size_bytes,
            messages=len(plan),
            elapsed_s=round(elapsed, 4),
            gbps=round(result.gbps, 3),
        )

    async def _stream(self, ep: Endpoint, plan: list[KVMessage], checksum: bool) -> list[str]:
        """Send every message of `plan` (`window_messages` in flight), checksumming each as it goes."""
        loop = asyncio.get_running_loop()
        inflight: deque[asyncio.Task[None]] = deque()
        sums: list[str] = []
        timeout_s = self.config.stall_timeout_s
        views = _ByteViews(self.cache)
        try:
            for seq, msg in enumerate(plan):
                view = views(msg, msg.src_block)
                inflight.append(loop.create_task(ep.send(view, DATA_TAG_BASE + seq, timeout_s=timeout_s)))
                if checksum:
                    # Inline, while the send is on its way: tens of GB/s, cheaper than a thread hop.
                    sums.append(_checksum(view))
                while len(inflight) >= self.config.window_messages or (inflight and inflight[0].done()):
                    await inflight.popleft()
            while inflight:
                await inflight.popleft()
            return sums
        finally:
            for t in inflight:
                t.cancel()
            await asyncio.gather(*inflight, return_exceptions=True)


# -- the consumer -------------------------------------------------------------------------------------


async def receive_kv(
    transport: Transport,
    descriptor: KVDescriptor,
    cache: KVCache,
    *,
    model_id: str,
    request_id: str | None = None,
    allocator: KVBlockAllocator | None = None,
    config: KVTransferConfig | None = None,
    on_progress: Callable[[int, int], None] | None = None,
) -> KVTransferResult:
    """Pull the KV blocks `descriptor` offers into new blocks of `cache`, for `request_id`
    (default: the producer's request id).

    Blocks come from `allocator` (default: the cache's own allocator); on success they stay
    allocated to the request, holding the producer's K/V of `descriptor.layers` for its first
    `num_tokens` tokens. Raises KVLayoutMismatch (before allocating) if the layouts or models
    differ, OutOfBlocks if the cache cannot hold the request, TransferTimeout / PeerClosed /
    UpstreamAborted if the producer stalls, dies or aborts, ChecksumMismatch if bytes differ;
    on every failure the endpoint is aborted first and then the blocks are freed.
    `on_progress(landed_bytes, size_bytes)` runs after each message lands.
    """
    config = config or KVTransferConfig()
    allocator = allocator or cache
    seq_id = request_id or descriptor.request_id
    what = f"KV transfer {descriptor.transfer_id!r} of request {descriptor.request_id!r}"
    layout = cache_layout(cache, model_id)
    check_layout(
        descriptor.layout(),
        layout,
        layers=descriptor.layers,
        consumer_layers=cache.layers,
        what=what,
    )
    expected_bytes = 2 * (descriptor.layer_end - descriptor.layer_start) * descriptor.num_blocks * cache.block_bytes
    if descriptor.size_bytes != expected_bytes:
        raise ProtocolError(f"{what}: descriptor says {descriptor.size_bytes} bytes, its layout makes {expected_bytes}")
    label = address_label(descriptor.producer_address)
    table = allocator.allocate(seq_id, descriptor.num_tokens)  # OutOfBlocks before anything moves
    started = time.monotonic()
    ep: Endpoint | None = None
    ok = False
    posted: deque[tuple[int, asyncio.Task[None]]] = deque()
    control: asyncio.Task[bytes] | None = None
    actual: list[str] = []
    loop = asyncio.get_running_loop()
    try:
        ep = await transport.connect(descriptor.producer_address, timeout_s=config.connect_timeout_s)
        await ep.send_msg(
            encode_control(
                {
                    "v": _PROTOCOL_VERSION,
                    "op": KV_PULL_OP,
                    "transfer_id": descriptor.transfer_id,
                    "layout": layout,
                    "layers": list(descriptor.layers),
                    "consumer_layers": list(cache.layers),
                    "num_tokens": descriptor.num_tokens,
                    "blocks": table,
                    "max_message_bytes": config.max_message_bytes,
                    "checksum": config.checksum,
                }
            ),
            CONTROL_TAG,
            timeout_s=config.stall_timeout_s,
        )
        resp = decode_control(
            await ep.recv_msg(CONTROL_TAG, timeout_s=config.stall_timeout_s, max_bytes=_MAX_CONTROL_BYTES),
            "response",
            label,
        )
        if resp.get("ok") is not True:
            _raise_refusal(resp, label, what)
        src_blocks = [int(b) for b in resp.get("blocks", [])]
        plan = plan_messages(
            src_blocks, table, descriptor.layers, _max_blocks(config.max_message_bytes, cache.block_bytes)
        )
        control = loop.create_task(ep.recv_msg(CONTROL_TAG, max_bytes=_MAX_CONTROL_BYTES))
        trailer: dict[str, Any] | None = None
        landed_bytes = 0
        next_seq = 0
        byte_views = _ByteViews(cache)
        views: list[np.ndarray] = []

        def post_next() -> None:
            nonlocal next_seq
            if next_seq >= len(plan):
                return
            msg = plan[next_seq]
            view = byte_views.target(msg, msg.dst_block)
            views.append(view)
            assert ep is not None
            posted.append((next_seq, loop.create_task(ep.recv_into(view, DATA_TAG_BASE + next_seq))))
            next_seq += 1

        for _ in range(2 * config.window_messages):
            post_next()
        while posted:
            seq, task = posted[0]
            waiting: set[asyncio.Future[Any]] = {task} if trailer is not None else {task, control}
            done, _ = await asyncio.wait(waiting, timeout=config.stall_timeout_s, return_when=asyncio.FIRST_COMPLETED)
            if task in done:
                task.result()
                byte_views.land(plan[seq], plan[seq].dst_block, views[seq])
                posted.popleft()
                post_next()
                if on_progress is not None:
                    on_progress(landed_bytes + views[seq].size, descriptor.size_bytes)
                if config.checksum:
                    actual.append(_checksum(views[seq]))  # inline while later messages move
                landed_bytes += views[seq].size
            elif control in done:
                trailer = _trailer(control.result(), label, what)
            else:
                raise TransferTimeout(
                    f"{what}: nothing from {label} for {config.stall_timeout_s}s "
                    f"(message {seq} of {len(plan)}, {plan[seq].describe()})"
                )
        if trailer is None:
            try:
                trailer = _trailer(await wait_for(control, config.stall_timeout_s), label, what)
            except TimeoutError:
                raise TransferTimeout(f"{what}: {label} sent no checksums within {config.stall_timeout_s}s") from None
        if config.checksum:
            try:
                _verify(trailer, actual, plan, views, what)
            except DataPlaneError as exc:
                try:
                    await ep.send_msg(encode_control({"failed": str(exc)}), CONTROL_TAG, timeout_s=1.0)
                except TransportError:
                    pass
                raise
        await ep.send_msg(encode_control({"done": True}), CONTROL_TAG, timeout_s=config.stall_timeout_s)
        ok = True
    except BaseException as exc:
        log.warning(
            "kv_receive_failed",
            transfer_id=descriptor.transfer_id,
            request_id=seq_id,
            source=label,
            error=repr(exc),
            elapsed_s=round(time.monotonic() - started, 4),
        )
        raise
    finally:
        tasks = [t for _, t in posted] + ([control] if control is not None else [])
        leftovers = [t for t in tasks if not t.done()]
        if ep is not None:
            if ok or not leftovers:
                # Nothing posted, nothing can land: close gracefully. With UCX an abort would also
                # end every other connection to this peer (a parameter stream, say).
                await ep.close()
            else:
                ep.abort()  # cancels posted receives: nothing lands in the blocks after this
        for t in leftovers:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)  # retrieves their errors too
        if not ok:
            allocator.free(seq_id)
    elapsed = time.monotonic() - started
    result = KVTransferResult(
        transfer_id=descriptor.transfer_id,
        request_id=seq_id,
        layers=descriptor.layers,
        num_tokens=descriptor.num_tokens,
        block_table=list(table),
        size_bytes=descriptor.size_bytes,
        messages=len(plan),
        elapsed_s=elapsed,
        peer=label,
        checksums=actual,
    )
    log.info(
        "kv_received",
        transfer_id=descriptor.transfer_id,
        request_id=seq_id,
        source=label,
        size_bytes=result.size_bytes,
        messages=result.messages,
        elapsed_s=round(elapsed, 4),
        gbps=round(result.gbps, 3),
    )
    return result


def _raise_refusal(resp: dict[str, Any], label: str, what: str) -> None:
    kind, error = resp.get("kind"), resp.get("error", resp)
    if kind == "layout_mismatch":
        fields = {str(k): tuple(v) for k, v in dict(resp.get("fields") or {}).items()}
        raise KVLayoutMismatch(f"{label}: {error}", fields=fields)  # type: ignore[arg-type]
    if kind in ("unknown_transfer", "busy", "unknown_op"):
        raise UpstreamAborted(f"{what}: {label} refused: {error}")
    raise ProtocolError(f"{what}: unexpected response from {label}: {resp!r:.300}")


def _trailer(data: bytes, label: str, what: str) -> dict[str, Any]:
    msg = decode_control(data, "control message", label)
    if "abort" in msg:
        raise UpstreamAborted(f"{what}: {label} aborted: {msg['abort']}")
    if not isinstance(msg.get("checksums"), list):
        raise ProtocolError(f"{what}: expected checksums from {label}, got {msg!r:.200}")
    return msg


def _verify(
    trailer: dict[str, Any], actual: list[str], plan: list[KVMessage], views: list[np.ndarray], what: str
) -> None:
    expected = [str(c) for c in trailer["checksums"]]
    if len(expected) != len(plan):
        raise ProtocolError(f"{what}: {len(expected)} checksums for {len(plan)} messages")
    for i, (want, got) in enumerate(zip(expected, actual, strict=True)):
        if want == got:
            continue
        algo = checksum_algo_of(want)
        if algo != checksum_algo_of(got):
            # The producer runs another default algorithm (a mixed-version mesh): check with its.
            got = _checksum(views[i], algo)
            if want == got:
                continue
        raise ChecksumMismatch(
            f"{what}: {plan[i].describe()} (message {i}) has checksum {got}, the producer sent {want}",
            group=plan[i].describe(),
            expected=want,
            actual=got,
        )
