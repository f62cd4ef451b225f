"""ZigZag pulled by loading instances: the SERVING partner's side (manager `--zigzag-dispatch pull`).

BlitzScale's NewPrefill takes the old instance's queued prefills FIFO, capped by
`zigzag_req_limit`, and runs each through the layers it has while the rest arrive; the old
instance takes a request over (the hidden states after the last layer that ran, and the KV of
those layers) when it gets to it. Routing new requests to the pair instead (`route`) puts them
at the back of the partner's queue, where they hold one of the few in-flight slots for the
whole queueing time: the loading instance then sits idle most of the burst. Pulling from the
head keeps its slots turning over at the rate the partner admits requests, so every request the
partner admits while a pair is live has (up to) k of its L layers done.

The manager names each SERVING instance's live LOADING peers in its heartbeat answer
(`HeartbeatResponse.zigzag_peers`, with their cap). `ZigzagOffloader` then:
  1. picks the partner's next waiting requests (`Engine.offload_candidates`), as many as its
     peers have room for under their caps, and gives each to the peer holding the fewest
     (`spread_over_peers`): a peer that took every request as it queued would leave the others
     idle, and past half its layers one peer runs its share slower than the partner admits it;
  2. marks each one a ZigZag continuation (`Engine.attach_relay`), so that when the partner
     admits it, it takes the first layers over from the peer (`take_over`, services/worker/zigzag.py)
     instead of computing them; a relay that finds nothing run there computes the prompt whole;
  3. sends the peer the prompt (`Generate` with `zigzag = true`), whose stream ends when the
     partner has relayed it.
A request that ends first (finished, aborted, released by rebalancing) cancels its run-ahead,
which frees what the peer held for it. A peer that fails costs only speed: the relay then
finds nothing there and the partner computes the prompt whole, which gives the same tokens.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable
from dataclasses import dataclass, replace

import grpc
import structlog
from prometheus_client import Counter

from blitzmesh.v1 import global_manager_pb2, worker_pb2, worker_pb2_grpc
from services.common import roles
from services.common.grpc_util import channel
from services.worker.convert import sampling_to_proto
from services.worker.engine.engine import Engine, RelayFill
from services.worker.engine.sampling import SamplingParams

__all__ = ["OFFLOADS", "Peer", "ZigzagOffloader", "spread_over_peers"]

log = structlog.get_logger(__name__)

OFFLOADS = Counter(
    "blitzmesh_worker_zigzag_offloads_total",
    "Waiting requests whose first layers a loading peer ran ahead (ZigZag pulled), by how the run-ahead ended",
    ["outcome"],
)
_POLL_S = 0.02  # how often the queue is looked at while a peer is live (a step takes far longer)
_RUN_AHEAD_TIMEOUT_S = 300.0  # a bound on one run-ahead call; the request's own end cancels it first


@dataclass(frozen=True, slots=True)
class Peer:
    """A live LOADING instance paired with this one (from `HeartbeatResponse.zigzag_peers`)."""

    instance_id: str
    address: str
    dataplane_address: bytes
    layers_loaded: int
    num_layers: int
    inflight_limit: int

    @classmethod
    def from_proto(cls, msg: global_manager_pb2.ZigzagPeer) -> Peer:
        return cls(
            msg.instance_id,
            msg.address,
            bytes(msg.dataplane_address),
            msg.layers_loaded,
            msg.num_layers,
            max(0, msg.inflight_limit),
        )


def spread_over_peers(request_ids: list[str], peers: list[Peer], inflight: dict[str, int]) -> list[tuple[str, Peer]]:
    """(request, peer) for `request_ids` in order (the partner admits the first one first): each
    to the peer with room under its cap that holds the fewest (`inflight`: peer id -> run-aheads
    it holds), ties to the most layers, then the id. Stops when every peer is at its cap."""
    held = dict(inflight)
    out: list[tuple[str, Peer]] = []
    for request_id in request_ids:
        open_ = [p for p in peers if held.get(p.instance_id, 0) < p.inflight_limit]
        if not open_:
            break
        peer = min(open_, key=lambda p: (held.get(p.instance_id, 0), -p.layers_loaded, p.instance_id))
        held[peer.instance_id] = held.get(peer.instance_id, 0) + 1
        out.append((request_id, peer))
    return out


class ZigzagOffloader:
    """Hands this instance's waiting requests to its loading peers to run ahead (module doc)."""

    def __init__(
        self,
        engine: Callable[[], Engine | None],
        relay_fill: Callable[[str, bytes], RelayFill],
        me: Callable[[], worker_pb2.ZigzagSource] = worker_pb2.ZigzagSource,
    ) -> None:
        self._engine = engine  # the current engine (None while there is none)
        self._relay_fill = relay_fill  # (request id, peer's data-plane address) -> the take-over
        self._me = me  # this instance and its data plane (embeds prompts for a peer without its embedding)
        self.peers: dict[str, Peer] = {}
        self._ahead: dict[str, tuple[str, asyncio.Task[None]]] = {}  # request id -> (peer id, run-ahead)
        self._channels: dict[str, grpc.aio.Channel] = {}
        self._wake = asyncio.Event()

    def set_peers(self, peers: list[Peer], model_id: str) -> None:
        """The manager's current pairing (every heartbeat). Requests already with a peer that
        left the list stay with it: it relays them when asked, loaded or not."""
        self.model_id = model_id
        self.peers = {p.instance_id: p for p in peers if p.address and p.dataplane_address}
        if self.peers:
            self._wake.set()

    def inflight(self, peer_id: str) -> int:
        return sum(1 for pid, _ in self._ahead.values() if pid == peer_id)

    def take_back(self, peer_id: str) -> list[str]:
        """`peer_id` has finished loading: it is offered nothing more (until a pairing names it
        again), and the ids of the requests it is running ahead are returned, for this instance
        to release to it while they are still queued here."""
        self.peers.pop(peer_id, None)
        return [rid for rid, (pid, _) in self._ahead.items() if pid == peer_id]

    def request_done(self, request_id: str) -> None:
        """The request ended here (any way): a run-ahead still going is cancelled."""
        entry = self._ahead.pop(request_id, None)
        if entry is not None and not entry[1].done():
            entry[1].cancel()

    def offer(self) -> int:
        """Hand waiting requests to peers with room; returns how many were handed now."""
        engine = self._engine()
        if engine is None or not self.peers:
            return 0
        peers = list(self.peers.values())
        inflight = {p.instance_id: self.inflight(p.instance_id) for p in peers}
        room = sum(max(0, p.inflight_limit - inflight[p.instance_id]) for p in peers)
        candidates = {
            rid: (prompt, params) for rid, prompt, params in engine.offload_candidates(room, exclude=self._ahead)
        }
        handed = 0
        for request_id, peer in spread_over_peers(list(candidates), peers, inflight):
            if not engine.attach_relay(request_id, self._relay_fill(request_id, peer.dataplane_address)):
                continue
            prompt, params = candidates[request_id]
            task = asyncio.get_running_loop().create_task(
                self._run_ahead(peer, request_id, prompt, params), name=f"zigzag-ahead-{request_id}"
            )
            self._ahead[request_id] = (peer.instance_id, task)
            handed += 1
        return handed

    async def run(self) -> None:
        """Offer while a peer is live; sleep on the next pairing otherwise."""
        while True:
            if not self.peers:
                self._wake.clear()
                await self._wake.wait()
            try:
                self.offer()
            except Exception:  # a bug here must not stop serving: the requests run whole
                log.exception("zigzag_offload_failed")
            await asyncio.sleep(_POLL_S)

    async def _run_ahead(self, peer: Peer, request_id: str, prompt: list[int], params: SamplingParams) -> None:
        outcome = "none_ran"
        call = None
        try:
            stub = worker_pb2_grpc.WorkerStub(self._channel(peer.address))
            call = stub.Generate(
                worker_pb2.WorkerGenerateRequest(
                    request_id=request_id,
                    model_id=self.model_id,
                    prompt_token_ids=prompt,
                    sampling=sampling_to_proto(replace(params, prompt_logprobs=None)),
                    layer_start=0,
                    layer_end=peer.layers_loaded,
                    zigzag_first_layers=worker_pb2.ZigzagFirstLayersMode(partner=self._me()),
                ),
                timeout=_RUN_AHEAD_TIMEOUT_S,
            )
            async for resp in call:
                if resp.HasField("zigzag_layers") and resp.zigzag_layers > 0:
                    outcome = "relayed"
        except asyncio.CancelledError:
            outcome = "cancelled"
            if call is not None:
                call.cancel()
            raise
        except grpc.aio.AioRpcError as e:
            outcome = "failed"
            log.info("zigzag_run_ahead_failed", peer=peer.instance_id, request_id=request_id, code=e.code().name)
        except Exception as e:  # a bug here must not strand the request: it is computed whole
            outcome = "failed"
            log.warning("zigzag_run_ahead_error", peer=peer.instance_id, request_id=request_id, error=repr(e))
        finally:
            OFFLOADS.labels(outcome).inc()
            entry = self._ahead.get(request_id)
            if entry is not None and entry[1] is asyncio.current_task():
                del self._ahead[request_id]
            self._wake.set()

    def _channel(self, address: str) -> grpc.aio.Channel:
        ch = self._channels.get(address)
        if ch is None:
            ch = self._channels[address] = channel(address, roles.WORKER)
        return ch

    async def close(self) -> None:
        for _, task in list(self._ahead.values()):
            task.cancel()
        self._ahead.clear()
        for ch in self._channels.values():
            with contextlib.suppress(Exception):
                await ch.close()
        self._channels.clear()
