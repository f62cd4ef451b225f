"""Elastic sequence parallelism across instances: the sequence-parallel prefill of
`services.worker.model.esp` with every group member in its own process, the slices' K/V passed
over the data plane (UCX or TCP), never through gRPC.

Member j of a group of n holds prompt positions [bounds[j], bounds[j + 1]). Per decoder layer it
computes its slice's Q/K/V, keeps the K/V in its own cache (where the request will decode from:
nothing migrates after the prefill), sends them to every later member, receives every earlier
member's, attends its queries to each of those key ranges and to its own, and merges the
partial results by the log-sum-exp rule. Only the last member's last token samples.

The exchange overlaps the compute, as LoongServe's ring does: the layer compute runs off the event
loop, so the transfers progress beside it; a member does not wait for its sends before the next
layer (an earlier member streams its slices ahead of the later ones), and attends to its own
slice while the earlier slices' K/V land. The partial results merge in slice order, so the
floats do not depend on the order the slices arrive in.

`connect_group` opens the links: each member connects to every later one and says who it is;
each accepts one connection from every earlier one. Messages are tagged by layer and K/V, so a
member never confuses two layers' slices. Any failure (a peer gone or stalled, a refused
handshake) aborts the member's links and frees its blocks before it is raised.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from services.dataplane.chain import CONTROL_TAG
from services.dataplane.errors import ProtocolError
from services.dataplane.transport import Endpoint, Transport
from services.worker.engine.kv_cache import KVCache
from services.worker.model.esp import Partial, Shard, merge, partial_attention
from services.worker.model.llama import LlamaForCausalLM

ESP_OP = "esp_prefill"
# The handshake travels on the data plane's control tag with `"op": ESP_OP`, so a worker's
# `GroupServer` (which owns `accept()`) hands the connection to its ESP router by op.
_HELLO_TAG = CONTROL_TAG

# Where a member's incoming group connections come from: `transport.accept()` checked by
# `_read_hello` (a member that owns its transport), or a worker's ESP router (`esp_worker`),
# which has read and checked the handshake already. Called with a timeout; returns the endpoint
# and its handshake.
Acceptor = Callable[[float], Awaitable[tuple[Endpoint, dict[str, object]]]]
_KV_TAG_BASE = 16


def _kv_tag(layer: int, which: int) -> int:
    return _KV_TAG_BASE + 2 * layer + which


@dataclass
class GroupLinks:
    """One member's endpoints: to every later member (it sends there) and from every earlier
    one (it receives from there), by member index."""

    index: int
    later: dict[int, Endpoint]
    earlier: dict[int, Endpoint]

    def abort(self) -> None:
        for ep in (*self.later.values(), *self.earlier.values()):
            ep.abort()

    async def close(self) -> None:
        for ep in (*self.later.values(), *self.earlier.values()):
            await ep.close()


async def _read_hello(ep: Endpoint, group_id: str, timeout_s: float) -> dict[str, object]:
    """An accepted peer's handshake, checked to be ESP's for `group_id`; the endpoint is aborted
    and ProtocolError raised otherwise."""
    try:
        hello = json.loads(await ep.recv_msg(_HELLO_TAG, timeout_s=timeout_s, max_bytes=4096))
    except (ValueError, UnicodeDecodeError) as exc:
        ep.abort()
        raise ProtocolError(f"ESP handshake from {ep.peer} is not JSON: {exc}") from None
    if not isinstance(hello, dict) or hello.get("op") != ESP_OP or hello.get("group") != group_id:
        ep.abort()
        raise ProtocolError(f"ESP group {group_id!r}: unexpected handshake {hello!r:.200}")
    return hello


def _transport_acceptor(transport: Transport, group_id: str) -> Acceptor:
    async def accept(timeout_s: float) -> tuple[Endpoint, dict[str, object]]:
        ep = await transport.accept(timeout_s=timeout_s)
        return ep, await _read_hello(ep, group_id, timeout_s)

    return accept


async def connect_group(
    transport: Transport,
    index: int,
    addresses: Sequence[bytes],
    group_id: str,
    *,
    timeout_s: float = 10.0,
    accept: Acceptor | None = None,
) -> GroupLinks:
    """Member `index`'s links in the group whose members listen at `addresses` (in member
    order); the earlier members' connections come from `accept` (default: `transport.accept()`).
    Raises ProtocolError for a handshake from outside the group, TransferTimeout or PeerClosed
    for a member that does not come."""
    if not 0 <= index < len(addresses):
        raise ValueError(f"member index {index} outside a group of {len(addresses)}")
    links = GroupLinks(index, {}, {})
    try:
        for i in range(index + 1, len(addresses)):
            ep = await transport.connect(addresses[i], timeout_s=timeout_s)
            links.later[i] = ep
            hello = {"op": ESP_OP, "group": group_id, "member": index}
            await ep.send_msg(json.dumps(hello).encode(), _HELLO_TAG, timeout_s=timeout_s)
        accept = accept or _transport_acceptor(transport, group_id)
        while len(links.earlier) < index:
            ep, hello = await accept(timeout_s)
            member = hello.get("member")
            if not isinstance(member, int) or not 0 <= member < index or member in links.earlier:
                ep.abort()
                raise ProtocolError(f"ESP member {index} of group {group_id!r}: unexpected handshake {hello!r:.200}")
            links.earlier[member] = ep
    except BaseException:
        links.abort()
        raise
    return links


async def prefill_member(
    model: LlamaForCausalLM,
    cache: KVCache,
    links: GroupLinks,
    request_id: str,
    prompt: Sequence[int],
    bounds: Sequence[int],
    *,
    timeout_s: float = 30.0,
) -> torch.Tensor | None:
    """Run member `links.index`'s part of the group's prefill of `prompt` (see the module
    docstring). Returns the float32 logits `[vocab]` of the prompt's last token on the last
    member, None on the others; the member's slice of the KV stays in `cache` under
    `request_id`. On any failure the links are aborted and the blocks freed before it raises."""
    j, n = links.index, len(bounds) - 1
    if len(bounds) < 2 or bounds[0] != 0 or bounds[-1] != len(prompt) or not 0 <= j < n:
        raise ValueError(f"bounds {list(bounds)} do not cut the prompt's {len(prompt)} tokens among {n} members")
    if any(a >= b for a, b in zip(bounds, bounds[1:], strict=False)):
        raise ValueError(f"bounds {list(bounds)} must be strictly increasing (no empty slice)")
    cfg = model.config
    start, end = bounds[j], bounds[j + 1]
    cache.allocate(request_id, end - start)
    shard = Shard(cache, request_id, start, end)
    pending: list[asyncio.Future[None]] = []
    compute: asyncio.Future[Any] | None = None

    async def off_loop(fn: Callable[..., Any], *args: Any) -> Any:
        nonlocal compute
        compute = asyncio.ensure_future(asyncio.to_thread(fn, *args))
        return await asyncio.shield(compute)

    try:
        positions = torch.arange(start, end, device=model.device)
        hidden = model.embed(torch.tensor(list(prompt[start:end]), dtype=torch.long))
        cos, sin_half = model.rope_tables(positions)
        slots = shard.slots(0, end - start)
        for layer in range(cfg.num_hidden_layers):
            q, k, v = await off_loop(_layer_qkv, model, cache, layer, hidden, cos, sin_half, slots)
            # The sends go out while this member computes on (off the event loop), so a member
            # ahead of the later ones streams layer after layer without waiting for its sends;
            # the receives of this layer's earlier slices land while it attends to its own.
            for f in pending:
                if f.done() and f.exception() is not None:
                    raise f.exception()  # type: ignore[misc]
            pending = [f for f in pending if not f.done()]
            pending += [
                asyncio.ensure_future(ep.send(x, _kv_tag(layer, w), timeout_s=timeout_s))
                for ep in links.later.values()
                for w, x in ((0, k), (1, v))
            ]
            arrived: dict[int, asyncio.Future[None]] = {}
            earlier: dict[int, tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = {}
            for m in sorted(links.earlier):
                ep, a, b = links.earlier[m], bounds[m], bounds[m + 1]
                km = torch.empty((b - a, *k.shape[1:]), dtype=k.dtype)
                vm = torch.empty_like(km)
                earlier[m] = (km, vm, torch.arange(a, b))
                arrived[m] = asyncio.ensure_future(_recv_kv(ep, km, vm, layer, timeout_s))
            pending += arrived.values()
            window = model.layer_window(layer)
            own = await off_loop(_attend, q, positions, k, v, positions, window)
            parts = []
            for m in sorted(earlier):  # merged in slice order, whatever order they land in
                await arrived[m]
                parts.append(await off_loop(_attend, q, positions, *earlier[m], window))
            parts.append(own)
            hidden = await off_loop(_layer_out, model, layer, hidden, parts, q.dtype)
        await asyncio.gather(*pending)
        if j < n - 1:
            return None
        return model.head(hidden[-1:])[0]
    except BaseException:
        links.abort()
        for fut in pending:
            if not fut.cancel() and not fut.cancelled():
                fut.exception()  # retrieved: the first failure is the one raised
        if compute is not None and not compute.done():
            # The compute thread may still be writing this slice's blocks: they are freed after.
            with contextlib.suppress(BaseException):
                await asyncio.shield(compute)
        cache.free(request_id)
        raise


async def _recv_kv(ep: Endpoint, k: torch.Tensor, v: torch.Tensor, layer: int, timeout_s: float) -> None:
    await ep.recv_into(k, _kv_tag(layer, 0), timeout_s=timeout_s)
    await ep.recv_into(v, _kv_tag(layer, 1), timeout_s=timeout_s)


def _layer_qkv(
    model: LlamaForCausalLM,
    cache: KVCache,
    layer: int,
    hidden: torch.Tensor,
    cos: torch.Tensor,
    sin_half: torch.Tensor,
    slots: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A slice's Q/K/V of one layer, its K/V written to the member's own cache."""
    with torch.inference_mode():
        q, k, v = model.attention_inputs(layer, hidden, cos, sin_half)
        cache.write(layer, slots, k, v)
        return q, k.contiguous(), v.contiguous()


def _attend(
    q: torch.Tensor,
    positions: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    key_positions: torch.Tensor,
    window: int | None,
) -> Partial:
    with torch.inference_mode():
        return partial_attention(q, positions, k, v, key_positions, window)


def _layer_out(
    model: LlamaForCausalLM, layer: int, hidden: torch.Tensor, parts: list[Partial], dtype: torch.dtype
) -> torch.Tensor:
    with torch.inference_mode():
        return model.finish_layer(layer, hidden, merge(parts).to(dtype))


# -- distributed decode ---------------------------------------------------------------------------
# After the prefill the request's KV stays where it was computed. The last member becomes the
# request's master: it holds the newest slice, appends each new token's KV to it, and for every
# layer sends the new query to the other holders, which attend it to their own slices and send
# back (output, log-sum-exp); the master merges. A step starts with a small header (the
# position, or the end of the request); tags are per layer, reused step after step in order.

_STEP_TAG = 2
_Q_TAG_BASE = 1 << 20


def _q_tag(layer: int) -> int:
    return _Q_TAG_BASE + 2 * layer


def _part_tag(layer: int) -> int:
    return _Q_TAG_BASE + 2 * layer + 1


async def decode_master_step(
    model: LlamaForCausalLM,
    cache: KVCache,
    shard: Shard,
    holders: dict[int, Endpoint],
    token: int,
    *,
    timeout_s: float = 30.0,
    note: dict[str, object] | None = None,
) -> torch.Tensor:
    """One decode step on the master: `token` at the next position, its KV appended to
    `shard` (the master's own, the newest), each layer's query attended by every holder in
    `holders` over its slice and here over `shard`. `note` rides in the step's header (a master
    that took over after a scale-up tells the old one its tokens this way). Returns the float32
    logits `[vocab]`."""
    cache.extend(shard.seq_id, shard.num_tokens + 1)
    pos = shard.end
    shard.end += 1
    header = json.dumps({**(note or {}), "pos": pos}).encode()
    for ep in holders.values():
        await ep.send_msg(header, _STEP_TAG, timeout_s=timeout_s)
    q_pos = torch.tensor([pos])
    hidden = model.embed(torch.tensor([token], dtype=torch.long))
    cos, sin_half = model.rope_tables(q_pos)
    slot = shard.slots(shard.num_tokens - 1, 1)
    heads = model.config.num_attention_heads
    for layer in range(model.config.num_hidden_layers):
        with torch.inference_mode():
            q, k, v = model.attention_inputs(layer, hidden, cos, sin_half)
            cache.write(layer, slot, k, v)
            qc = q.contiguous()
        for ep in holders.values():
            await ep.send(qc, _q_tag(layer), timeout_s=timeout_s)
        parts = []
        for m in sorted(holders):
            packed = torch.empty((1, heads, qc.shape[-1] + 1), dtype=torch.float32)
            await holders[m].recv_into(packed, _part_tag(layer), timeout_s=timeout_s)
            parts.append(Partial(packed[..., :-1], packed[..., -1]))
        with torch.inference_mode():
            k_own, v_own, pos_own = shard.kv(layer)
            parts.append(partial_attention(q, q_pos, k_own, v_own, pos_own, model.layer_window(layer)))
            hidden = model.finish_layer(layer, hidden, merge(parts).to(q.dtype))
    return model.head(hidden)[0]


async def end_decode(
    holders: dict[int, Endpoint], *, timeout_s: float = 30.0, note: dict[str, object] | None = None
) -> None:
    """Tell every holder the request is done (they free nothing: the caller owns the blocks);
    `note` rides in the message."""
    for ep in holders.values():
        await ep.send_msg(json.dumps({**(note or {}), "end": True}).encode(), _STEP_TAG, timeout_s=timeout_s)


async def serve_holder(
    model: LlamaForCausalLM,
    shard: Shard,
    master: Endpoint,
    *,
    timeout_s: float = 30.0,
    on_header: Callable[[dict[str, object]], None] | None = None,
) -> tuple[str, int]:
    """A holder's side of a distributed decode: for every step the master starts, attend each
    layer's query to this holder's slice and send back the output with its log-sum-exp (one
    `[1, heads, d + 1]` float32 message). Returns ("end", steps served) when the master ends the
    request, ("handover", steps) when a new master is coming (see `accept_master`). Each step's
    header (and the end's) goes to `on_header` first."""
    cfg = model.config
    steps = 0
    while True:
        header = json.loads(await master.recv_msg(_STEP_TAG, timeout_s=timeout_s, max_bytes=4096))
        if on_header is not None:
            on_header(header)
        if header.get("end"):
            return "end", steps
        if header.get("handover"):
            return "handover", steps
        q_pos = torch.tensor([int(header["pos"])])
        for layer in range(cfg.num_hidden_layers):
            q = torch.empty((1, cfg.num_attention_heads, cfg.head_dim), dtype=model.dtype)
            await master.recv_into(q, _q_tag(layer), timeout_s=timeout_s)
            with torch.inference_mode():
                k, v, pos = shard.kv(layer)
                part = partial_attention(q, q_pos, k, v, pos, model.layer_window(layer))
                packed = torch.cat((part.out, part.lse.unsqueeze(-1)), dim=-1).contiguous()
            await master.send(packed, _part_tag(layer), timeout_s=timeout_s)
        steps += 1


# -- scale-up during decode: a new master ------------------------------------------------------------
# When the master's cache has no room for the next token, another instance joins and becomes the
# master: it takes the new KV from there on, the old master becomes one more holder, and no KV
# moves. The old master tells its holders (a step header naming the handover); each holder, and
# the old master itself, then accepts the new master's connection and serves it.


async def hand_over(holders: dict[int, Endpoint], *, timeout_s: float = 30.0) -> None:
    """The master's side: tell every holder a new master is coming (they return from
    `serve_holder` with "handover" and should `accept_master`)."""
    for ep in holders.values():
        await ep.send_msg(json.dumps({"handover": True}).encode(), _STEP_TAG, timeout_s=timeout_s)


async def accept_master(
    transport: Transport, group_id: str, *, timeout_s: float = 30.0, accept: Acceptor | None = None
) -> Endpoint:
    """A holder's side of a handover: the new master's connection, checked to be of this group
    (from `accept`, default `transport.accept()`)."""
    ep, _ = await (accept or _transport_acceptor(transport, group_id))(timeout_s)
    return ep


async def join_as_master(
    transport: Transport, holder_addresses: Sequence[bytes], group_id: str, *, timeout_s: float = 30.0
) -> dict[int, Endpoint]:
    """The new master's side: connect to every holder (the old master included), in order;
    returns the endpoints by holder index, for `decode_master_step`."""
    holders: dict[int, Endpoint] = {}
    try:
        for i, address in enumerate(holder_addresses):
            ep = await transport.connect(address, timeout_s=timeout_s)
            holders[i] = ep
            hello = {"op": ESP_OP, "group": group_id, "member": "master"}
            await ep.send_msg(json.dumps(hello).encode(), _HELLO_TAG, timeout_s=timeout_s)
    except BaseException:
        for ep in holders.values():
            ep.abort()
        raise
    return holders
