"""Test and benchmark support for KV transfers: a process holding a paged KV cache, driven over a pipe.

A *KV node* is a separate process (multiprocessing "spawn") with its own transport, `GroupServer`,
`KVServer` and `KVCache`, like a worker. The parent fills requests' blocks with seeded values,
offers them, pulls them into another node, and compares digests, so tests and benchmarks move
KV between real processes over real sockets / UCX. It can also stream the same message sizes
through the transport alone (no KV addressing, no checksums): the benchmark's baseline.
"""

from __future__ import annotations

import asyncio
import dataclasses
import hashlib
import multiprocessing
import multiprocessing.connection
import os
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from services.common.waiting import wait_for
from services.dataplane import make_transport
from services.dataplane.chain import CONTROL_TAG, DATA_TAG_BASE, GroupServer
from services.dataplane.errors import DataPlaneError, ProtocolError
from services.dataplane.transport import Endpoint, Transport
from services.worker.engine.kv_cache import KVCache, OutOfBlocks
from services.worker.kv_transfer import KVDescriptor, KVServer, KVTransferConfig, receive_kv
from tests.harness import stop_node

__all__ = ["KVNode", "KVNodeSpec", "fill_request", "request_kv_digest", "start_kv_nodes"]

BARE_STREAM_OP = "bench_bare_stream"


@dataclass(frozen=True, slots=True)
class KVNodeSpec:
    """A node's transport and cache layout."""

    transport: str = "tcp"
    model_id: str = "kv-test"
    num_layers: int = 4
    num_blocks: int = 256
    block_size: int = 16
    num_kv_heads: int = 2
    head_dim: int = 32
    dtype: str = "float32"
    first_layer: int = 0
    config: dict[str, Any] = field(default_factory=dict)  # KVTransferConfig fields
    env: dict[str, str] = field(default_factory=dict)
    device: str = "cpu"  # where the cache lives (cuda: the transfers stage through host memory)

    def make_cache(self) -> KVCache:
        return KVCache(
            num_layers=self.num_layers,
            num_blocks=self.num_blocks,
            block_size=self.block_size,
            num_kv_heads=self.num_kv_heads,
            head_dim=self.head_dim,
            dtype=getattr(torch, self.dtype),
            first_layer=self.first_layer,
            device=self.device,
        )


def fill_request(cache: KVCache, request_id: str, num_tokens: int, seed: int) -> list[int]:
    """Allocate `request_id`'s blocks and fill every layer's K and V there with seeded normal values."""
    table = cache.allocate(request_id, num_tokens)
    gen = torch.Generator().manual_seed(seed)
    for layer in range(*cache.layers):
        k, v = cache.layer_cache(layer)
        for b in table:
            k[b].copy_(torch.randn(k[b].shape, generator=gen).to(cache.dtype))
            v[b].copy_(torch.randn(v[b].shape, generator=gen).to(cache.dtype))
    return table


def request_kv_digest(cache: KVCache, table: Sequence[int], layers: tuple[int, int], num_tokens: int) -> str:
    """blake2b of a request's K and V for `layers`, its first `num_tokens` token slots in table
    order: equal digests on two caches mean bit-identical KV of that request."""
    h = hashlib.blake2b(digest_size=16)
    blocks = torch.tensor(list(table), dtype=torch.long, device=cache.device)
    for layer in range(*layers):
        for t in cache.layer_cache(layer):
            tokens = t.index_select(0, blocks).reshape(-1, *t.shape[2:])[:num_tokens]
            h.update(tokens.contiguous().view(torch.uint8).cpu().numpy().tobytes())
    return h.hexdigest()


# -- the bare transport baseline ----------------------------------------------------------------------


async def serve_bare_stream(ep: Endpoint, req: dict[str, Any], buffer: np.ndarray, window: int) -> None:
    """Send `req["sizes"]` messages cut from `buffer` in order, `window` in flight: the KV
    transfer's wire pattern without KV addressing or checksums (same request/response turns)."""
    import json

    sizes = [int(s) for s in req["sizes"]]
    await ep.send_msg(json.dumps({"ok": True}).encode(), CONTROL_TAG, timeout_s=30)
    loop = asyncio.get_running_loop()
    inflight: list[asyncio.Task[None]] = []
    offset = 0
    try:
        for i, n in enumerate(sizes):
            inflight.append(loop.create_task(ep.send(buffer[offset : offset + n], DATA_TAG_BASE + i, timeout_s=30)))
            offset += n
            while len(inflight) >= window or (inflight and inflight[0].done()):
                await inflight.pop(0)
        await asyncio.gather(*inflight)
        inflight = []
        await ep.send_msg(b'{"checksums":[]}', CONTROL_TAG, timeout_s=30)
        await ep.recv_msg(CONTROL_TAG, timeout_s=30)
    finally:
        for t in inflight:
            t.cancel()
        await asyncio.gather(*inflight, return_exceptions=True)


async def pull_bare_stream(
    transport: Transport, address: bytes, sizes: Sequence[int], buffer: np.ndarray, window: int
) -> float:
    """The consumer's side of `serve_bare_stream`; returns seconds from connect to the last byte."""
    import json

    started = time.monotonic()
    ep = await transport.connect(address, timeout_s=30)
    try:
        await ep.send_msg(json.dumps({"op": BARE_STREAM_OP, "sizes": list(sizes)}).encode(), CONTROL_TAG, timeout_s=30)
        await ep.recv_msg(CONTROL_TAG, timeout_s=30)
        loop = asyncio.get_running_loop()
        control = loop.create_task(ep.recv_msg(CONTROL_TAG))
        posted: list[asyncio.Task[None]] = []
        offset = 0
        for i, n in enumerate(sizes):
            posted.append(loop.create_task(ep.recv_into(buffer[offset : offset + n], DATA_TAG_BASE + i, timeout_s=30)))
            offset += n
            while len(posted) >= 2 * window:
                await posted.pop(0)
        await asyncio.gather(*posted)
        await wait_for(control, 30)
        await ep.send_msg(b'{"done":true}', CONTROL_TAG, timeout_s=30)
    except BaseException:
        ep.abort()
        raise
    await ep.close()
    return time.monotonic() - started


# -- inside the node process --------------------------------------------------------------------------


async def _next_command(conn: multiprocessing.connection.Connection) -> Any:
    loop = asyncio.get_running_loop()
    ready: asyncio.Future[None] = loop.create_future()
    fd = conn.fileno()
    loop.add_reader(fd, lambda: ready.done() or ready.set_result(None))
    try:
        await ready
    finally:
        loop.remove_reader(fd)
    return conn.recv()


class _Node:
    def __init__(self, spec: KVNodeSpec, conn: multiprocessing.connection.Connection) -> None:
        self.spec = spec
        self.conn = conn
        self.cache = spec.make_cache()
        self.config = KVTransferConfig(**spec.config)
        self.offers: dict[str, Any] = {}
        self.bare = np.zeros(0, np.uint8)
        self.tasks: set[asyncio.Task[None]] = set()

    async def run(self) -> None:
        self.transport = make_transport(self.spec.transport)  # type: ignore[arg-type]
        await self.transport.start()
        self.server = GroupServer(self.transport)
        await self.server.start()
        self.kv = KVServer(self.server, self.cache, model_id=self.spec.model_id, config=self.config)
        self.server.register_op(
            BARE_STREAM_OP, lambda ep, req: serve_bare_stream(ep, req, self.bare, self.config.window_messages)
        )
        self.conn.send(("ready", self.transport.address(), os.getpid()))
        try:
            while True:
                cmd = await _next_command(self.conn)
                if cmd[0] == "stop":
                    break
                # Commands run as tasks: a pull and the offer it pulls may be waited on together.
                task = asyncio.get_running_loop().create_task(self._handle(cmd))
                self.tasks.add(task)
                task.add_done_callback(self.tasks.discard)
        finally:
            for t in list(self.tasks):
                t.cancel()
            await asyncio.gather(*self.tasks, return_exceptions=True)
            self.kv.close()
            await self.server.close()
            await self.transport.close()

    async def _handle(self, cmd: tuple[Any, ...]) -> None:
        tag, op, args = cmd[0], cmd[1], cmd[2:]
        try:
            reply = await getattr(self, f"_cmd_{op}")(*args)
        except (DataPlaneError, OutOfBlocks, ValueError, KeyError, TimeoutError) as exc:
            reply = ("error", type(exc).__name__, str(exc))
        self.conn.send((tag, *reply))

    async def _cmd_fill(self, request_id: str, num_tokens: int, seed: int) -> tuple:
        table = fill_request(self.cache, request_id, num_tokens, seed)
        return ("filled", table)

    async def _cmd_digest(self, request_id: str, layers: tuple[int, int], num_tokens: int) -> tuple:
        table = self.cache.block_table(request_id)
        return ("digest", request_kv_digest(self.cache, table, tuple(layers), num_tokens))

    async def _cmd_offer(self, request_id: str, num_tokens: int, layers: tuple[int, int] | None) -> tuple:
        offer = self.kv.offer(request_id, num_tokens=num_tokens, layers=layers)
        self.offers[offer.transfer_id] = offer
        return ("offered", dataclasses.asdict(offer.descriptor))

    async def _cmd_wait_offer(self, transfer_id: str, timeout_s: float) -> tuple:
        result = await self.offers.pop(transfer_id).wait(timeout_s)
        return ("offer_done", result.size_bytes, result.messages, result.elapsed_s)

    async def _cmd_receive(self, descriptor: dict[str, Any], request_id: str | None, config: dict[str, Any]) -> tuple:
        cfg = self.config.model_copy(update=config)
        result = await receive_kv(
            self.transport, KVDescriptor(**descriptor), self.cache, model_id=self.spec.model_id,
            request_id=request_id, config=cfg,
        )  # fmt: skip
        return ("received", result.block_table, result.messages, result.elapsed_s)

    async def _cmd_free(self, request_id: str) -> tuple:
        return ("freed", self.cache.free(request_id), self.cache.free_blocks)

    async def _cmd_free_blocks(self) -> tuple:
        return ("free_blocks", self.cache.free_blocks)

    async def _cmd_bare_buffer(self, size_bytes: int) -> tuple:
        self.bare = np.ones(size_bytes, np.uint8)  # faulted in, like the cache's blocks
        return ("bare_buffer", size_bytes)

    async def _cmd_pull_bare(self, address: bytes, sizes: list[int]) -> tuple:
        elapsed = await pull_bare_stream(self.transport, address, sizes, self.bare, self.config.window_messages)
        return ("pulled_bare", elapsed)


def _node_main(spec: KVNodeSpec, conn: multiprocessing.connection.Connection) -> None:
    os.environ.update(spec.env)
    torch.set_num_threads(1)
    asyncio.run(_Node(spec, conn).run())


# -- in the parent ------------------------------------------------------------------------------------


class KVNode:
    """A running KV node, driven synchronously. Every wait is bounded.

    Commands are numbered; `call` sends one and waits for its reply, `send` starts one and
    `reply` collects it later (a pull and an offer can be in flight at once).
    """

    def __init__(self, spec: KVNodeSpec) -> None:
        ctx = multiprocessing.get_context("spawn")
        self._conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=_node_main, args=(spec, child), daemon=True)
        self.proc.start()
        child.close()
        self.spec = spec
        self.address = b""
        self.pid = 0
        self._next = 0
        self._early: dict[int, tuple[Any, ...]] = {}

    def wait_ready(self, timeout_s: float = 60.0) -> KVNode:
        msg = self._recv(timeout_s)
        if msg[0] != "ready":
            raise RuntimeError(f"KV node sent {msg!r} instead of ready")
        self.address, self.pid = msg[1], msg[2]
        return self

    def _recv(self, timeout_s: float) -> Any:
        if not self._conn.poll(timeout_s):
            raise TimeoutError(
                f"KV node {self.proc.pid} sent nothing within {timeout_s}s (alive={self.proc.is_alive()})"
            )
        try:
            return self._conn.recv()
        except EOFError:
            raise RuntimeError(f"KV node {self.proc.pid} died (exitcode {self.proc.exitcode})") from None

    def send(self, op: str, *args: Any) -> int:
        self._next += 1
        self._conn.send((self._next, op, *args))
        return self._next

    def reply(self, tag: int, timeout_s: float = 60.0) -> tuple[Any, ...]:
        deadline = time.monotonic() + timeout_s
        while tag not in self._early:
            msg = self._recv(max(0.0, deadline - time.monotonic()))
            self._early[msg[0]] = tuple(msg[1:])
        return self._early.pop(tag)

    def call(self, op: str, *args: Any, timeout_s: float = 60.0) -> tuple[Any, ...]:
        return self.reply(self.send(op, *args), timeout_s)

    def signal(self, sig: int) -> None:
        if self.proc.is_alive() and self.proc.pid is not None:
            os.kill(self.proc.pid, sig)

    def stop(self, timeout_s: float = 10.0) -> None:
        stop_node(self.proc, self._conn, timeout_s)


def start_kv_nodes(specs: Sequence[KVNodeSpec], *, timeout_s: float = 60.0) -> list[KVNode]:
    """Start nodes in parallel (imports overlap) and wait until each has its address."""
    nodes = [KVNode(s) for s in specs]
    try:
        for n in nodes:
            n.wait_ready(timeout_s)
    except BaseException:
        for n in nodes:
            n.stop(1.0)
        raise
    return nodes


def expect(reply: tuple[Any, ...], kind: str) -> tuple[Any, ...]:
    """`reply` if it is of `kind`; ProtocolError quoting it otherwise (an error reply, say)."""
    if reply[0] != kind:
        raise ProtocolError(f"expected {kind!r}, KV node replied {reply!r:.500}")
    return reply
