"""ZigZag relays over the data plane: a full partner takes a request over from a loading instance.

A loading instance (k of L layers received) runs the prompts of ZigZag requests through the layers
it holds (`Engine.generate(zigzag=True)`). When the full partner admits such a request (in arrival
order with its own), it relays it: it connects to the loading instance's data plane and asks for it by id.
The loading instance stops the request after the layers it has run (`Engine.relay`), parks their
KV and offers it (`KVServer.offer`, layers [0, k')), and answers with that offer and the prompt's
hidden states after layer k'. The partner pulls the KV into its own blocks (`receive_kv`) and runs
layers [k', L) on the hidden states (`Engine.generate(relay_fill=...)`).

Wire protocol, on one connection served by the loading instance's `GroupServer` (op "zigzag_relay"):
  1. partner -> loading, CONTROL_TAG: {"op": "zigzag_relay", "request_id", "model_id"}.
  2. loading -> partner, CONTROL_TAG: {"ok": true, "layers": k', "num_tokens", "kv": the KV offer as
     a serialized `KVTransferDescriptor` (hex), "hidden": {"shape", "dtype", "checksum"}}, then
     the hidden states on DATA_TAG_BASE; or {"ok": true, "layers": 0} when nothing ran there (the
     partner computes the prompt whole); or {"ok": false, "error"}.
Every wait is bounded by `stall_timeout_s`; any failure leaves the partner to compute the prompt
whole, which gives the same tokens.

A loading instance receives the decoder layers first and the embedding after them (it is a
fifth of the `small` model, and a loading instance needs only a prompt's rows of it), so it goes
live with its first layer. Until its own embedding lands it asks the partner, on the partner's
`GroupServer` (op "zigzag_embed"):
  1. loading -> partner, CONTROL_TAG: {"op": "zigzag_embed", "model_id", "token_ids"}.
  2. partner -> loading, CONTROL_TAG: {"ok": true, "shape", "dtype", "checksum"}, then the prompt's
     embedding on DATA_TAG_BASE; or {"ok": false, "error"}.
The rows are the partner's own lookup of the same weights: the same floats as a local one.
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any, Final

import numpy as np
import structlog
import torch

from blitzmesh.v1 import kv_pb2
from services.dataplane.chain import CONTROL_TAG, DATA_TAG_BASE, GroupServer
from services.dataplane.checksum import group_checksum
from services.dataplane.errors import ChecksumMismatch, ProtocolError
from services.dataplane.transport import Endpoint, Transport
from services.worker.convert import kv_descriptor_from_proto, kv_descriptor_to_proto
from services.worker.engine.engine import Engine, KVBlocks, Relayed, out_of_vocab
from services.worker.engine.kv_cache import KVCache
from services.worker.kv_transfer import (
    KVDescriptor,
    KVOffer,
    KVTransferConfig,
    decode_control,
    dtype_name,
    encode_control,
    receive_kv,
)

__all__ = ["EMBED_OP", "RELAY_OP", "RelayServer", "RelayState", "embed_from", "relay_from", "take_over"]

log = structlog.get_logger(__name__)

RELAY_OP: Final = "zigzag_relay"
EMBED_OP: Final = "zigzag_embed"
_MAX_CONTROL_BYTES: Final = 1 << 20
_DTYPES: Final = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}

# Offers a relayed request's parked KV for layers [0, layers); frees it once pulled or expired.
OfferParked = Callable[[str, int, tuple[int, int]], KVOffer]


@dataclass(frozen=True)
class RelayState:
    """What the partner gets: the layers that ran on the loading instance, the offer of their KV
    and the hidden states after the last of them (None, None when none ran)."""

    layers: int
    kv: KVDescriptor | None = None
    hidden: torch.Tensor | None = None

    def relayed(self) -> Relayed:
        return Relayed(self.layers, self.hidden)


def _np_view(t: torch.Tensor) -> np.ndarray:
    """The bytes of a CPU tensor as a numpy array (bfloat16 has no numpy dtype)."""
    return t.view(torch.uint8).numpy().reshape(-1) if t.dtype == torch.bfloat16 else t.numpy()


class RelayServer:
    """The loading instance's side: answers relays of its ZigZag requests. And the partner's:
    looks up the prompts of a loading instance that has not received its embedding yet."""

    def __init__(
        self,
        group_server: GroupServer,
        engine: Engine,
        *,
        model_id: str,
        offer_parked: OfferParked,
        stall_timeout_s: float = 10.0,
    ) -> None:
        self.engine = engine
        self.model_id = model_id
        self._offer_parked = offer_parked
        self._stall_timeout_s = stall_timeout_s
        self._group_server = group_server
        group_server.register_op(RELAY_OP, self._serve)
        group_server.register_op(EMBED_OP, self._serve_embed)

    def close(self) -> None:
        self._group_server.unregister_op(RELAY_OP)
        self._group_server.unregister_op(EMBED_OP)

    async def _serve_embed(self, ep: Endpoint, req: dict[str, Any]) -> None:
        timeout = self._stall_timeout_s
        model = self.engine.model
        ids = req.get("token_ids")
        error = None
        if req.get("model_id") != self.model_id:
            error = f"this instance serves {self.model_id!r}, not {req.get('model_id')!r}"
        elif "embed" not in model.loaded_groups:
            error = f"the embedding of {self.model_id!r} is not loaded here"
        elif not isinstance(ids, list) or not ids or out_of_vocab(ids, model.config.vocab_size):
            error = f"token_ids must be a non-empty list of ids in [0, {model.config.vocab_size}), got {ids!r:.200}"
        if error is not None:
            await ep.send_msg(encode_control({"ok": False, "error": error}), CONTROL_TAG, timeout_s=timeout)
            return
        # A row lookup (no compute worth a thread), of weights that never change once loaded.
        spec, data = _rows_spec(model.embed(torch.tensor(ids, dtype=torch.long, device=model.device)).cpu())
        await ep.send_msg(encode_control({"ok": True, **spec}), CONTROL_TAG, timeout_s=timeout)
        await ep.send(data, DATA_TAG_BASE, timeout_s=timeout)

    async def _serve(self, ep: Endpoint, req: dict[str, Any]) -> None:
        request_id = str(req.get("request_id", ""))
        timeout = self._stall_timeout_s
        if req.get("model_id") != self.model_id:
            await ep.send_msg(
                encode_control(
                    {"ok": False, "error": f"this instance loads {self.model_id!r}, not {req.get('model_id')!r}"}
                ),
                CONTROL_TAG,
                timeout_s=timeout,
            )
            return
        outcome = await self.engine.relay(request_id)
        if outcome.layers == 0 or outcome.parked_kv is None or outcome.hidden is None:
            await ep.send_msg(encode_control({"ok": True, "layers": 0}), CONTROL_TAG, timeout_s=timeout)
            return
        try:
            offer = self._offer_parked(outcome.parked_kv, outcome.num_tokens, (0, outcome.layers))
        except BaseException:
            self.engine.release_parked(outcome.parked_kv)
            raise
        spec, data = _rows_spec(outcome.hidden)
        answer = {
            "ok": True,
            "layers": outcome.layers,
            "num_tokens": outcome.num_tokens,
            "kv": kv_descriptor_to_proto(offer.descriptor).SerializeToString().hex(),
            "hidden": spec,
        }
        log.info(
            "zigzag_relayed", request_id=request_id, layers=outcome.layers, tokens=outcome.num_tokens, peer=ep.peer
        )
        await ep.send_msg(encode_control(answer), CONTROL_TAG, timeout_s=timeout)
        await ep.send(data, DATA_TAG_BASE, timeout_s=timeout)


def _rows_spec(rows: torch.Tensor) -> tuple[dict[str, Any], np.ndarray]:
    """What announces a [rows, hidden] tensor (`_recv_rows` reads it) and its bytes to send."""
    data = _np_view(rows.contiguous())
    return {"shape": list(rows.shape), "dtype": dtype_name(rows.dtype), "checksum": group_checksum(data)}, data


async def _ask(ep: Endpoint, request: dict[str, Any], what: str, timeout_s: float) -> dict[str, Any]:
    """Send `request` and read the answer; ProtocolError naming `what` and the peer if it is
    refused or not JSON."""
    await ep.send_msg(encode_control(request), CONTROL_TAG, timeout_s=timeout_s)
    answer = decode_control(
        await ep.recv_msg(CONTROL_TAG, timeout_s=timeout_s, max_bytes=_MAX_CONTROL_BYTES), f"{what} answer", ep.peer
    )
    if answer.get("ok") is not True:
        raise ProtocolError(f"{what} refused by {ep.peer}: {answer.get('error')}")
    return answer


async def _recv_rows(ep: Endpoint, spec: dict[str, Any], rows: int, what: str, timeout_s: float) -> torch.Tensor:
    """Receive the [rows, hidden] tensor `spec` announces ({"shape", "dtype", "checksum"}), checked."""
    dtype = _DTYPES.get(spec.get("dtype", ""))
    shape = [int(n) for n in spec.get("shape", [])]
    if dtype is None or len(shape) != 2 or shape[0] != rows:
        raise ProtocolError(f"{what} from {ep.peer}: bad shape or dtype {spec!r:.200}")
    out = torch.empty(shape, dtype=dtype)
    data = _np_view(out)
    await ep.recv_into(data, DATA_TAG_BASE, timeout_s=timeout_s)
    got = group_checksum(data)
    if got != spec.get("checksum"):
        raise ChecksumMismatch(f"{what} from {ep.peer}: checksum {got} != {spec.get('checksum')}")
    return out


@contextlib.asynccontextmanager
async def _session(transport: Transport, address: bytes, timeout_s: float) -> AsyncIterator[Endpoint]:
    """A connection to `address`: closed when the block ends normally, aborted when it raises."""
    ep = await transport.connect(address, timeout_s=timeout_s)
    try:
        yield ep
    except BaseException:
        ep.abort()
        raise
    await ep.close()


async def relay_from(
    transport: Transport,
    address: bytes,
    request_id: str,
    *,
    model_id: str,
    stall_timeout_s: float = 10.0,
    connect_timeout_s: float | None = None,
) -> RelayState:
    """Ask the loading instance at `address` for `request_id`; raises on any failure (the caller
    then computes the prompt whole)."""
    async with _session(transport, address, connect_timeout_s or stall_timeout_s) as ep:
        # The loading instance answers once its current step has ended: at most one step.
        what = f"zigzag relay of {request_id!r}"
        answer = await _ask(ep, {"op": RELAY_OP, "request_id": request_id, "model_id": model_id}, what, stall_timeout_s)
        layers = int(answer.get("layers", 0))
        if layers == 0:
            return RelayState(0)
        desc = kv_descriptor_from_proto(kv_pb2.KVTransferDescriptor.FromString(bytes.fromhex(answer["kv"])))
        hidden = await _recv_rows(ep, answer["hidden"], desc.num_tokens, what, stall_timeout_s)
        return RelayState(layers, desc, hidden)


async def embed_from(
    transport: Transport,
    address: bytes,
    token_ids: list[int],
    *,
    model_id: str,
    stall_timeout_s: float = 10.0,
    connect_timeout_s: float | None = None,
) -> torch.Tensor:
    """The embedding of `token_ids`, looked up by the partner at `address` (a loading instance
    that has its first decoder layers but not its embedding yet). Raises on any failure."""
    async with _session(transport, address, connect_timeout_s or stall_timeout_s) as ep:
        request = {"op": EMBED_OP, "model_id": model_id, "token_ids": list(token_ids)}
        answer = await _ask(ep, request, "zigzag embedding", stall_timeout_s)
        return await _recv_rows(ep, answer, len(token_ids), "zigzag embedding", stall_timeout_s)


async def take_over(
    transport: Transport,
    address: bytes,
    request_id: str,
    cache: KVCache,
    blocks: KVBlocks,
    *,
    model_id: str,
    config: KVTransferConfig,
) -> Relayed:
    """The partner's whole relay (an engine's `RelayFill`): ask the loading instance at `address`
    for `request_id`, pull the KV of the layers it ran into `blocks`, bring the hidden states."""
    state = await relay_from(
        transport,
        address,
        request_id,
        model_id=model_id,
        stall_timeout_s=config.stall_timeout_s,
        connect_timeout_s=config.connect_timeout_s,
    )
    if state.layers and state.kv is not None:
        await receive_kv(
            transport, state.kv, cache, model_id=model_id, request_id=blocks.request_id, allocator=blocks, config=config
        )
    return state.relayed()
