"""Serial forwarding chains and sharded transfers of parameter groups (BlitzScale's data plane).

Model
-----
Transfers are *pulls*. Every process that holds a model's groups, or is receiving them, keeps
them in a `GroupStore` and publishes the store on its `GroupServer`; a receiver connects to an
upstream server and asks for a list of groups, and the server streams their chunks in layer
order, each chunk as soon as it has landed in its own store. A chain `S -> T1 -> T2 -> T3` is
therefore "T1 pulls from S, T2 pulls from T1, T3 pulls from T2", all started at once: each hop
receives a chunk straight into the tensor's final memory and serves it downstream right away,
so filling n targets takes about as long as filling one (plus n-1 chunk times).

Pulls (rather than pushes) make the other cases the same code:
- *sharded transfer*: g sources each serve a disjoint subset of groups to a target (several
  `Pull`s, one per source);
- *all-gather*: targets on a fast local link pull from each other the groups the others
  receive (more `Pull`s; a store serves groups it is still receiving);
- *fallback*: when an upstream stalls past `stall_timeout_s` (UCX cannot see a dead peer) or
  goes away, the receiver re-requests exactly the missing bytes (from the first chunk not yet
  landed) from the next address in `Pull.fallbacks`, e.g. a host shard. Its own downstream
  keeps pulling from it and never notices, beyond the pause.

A group becomes *usable* only when all its bytes have landed and its checksum matches the
manifest: then `on_group_ready(name)` runs (in the event loop, in completion order; use
`GroupStore.ready_prefix()` for "the first k layers are in"). Nothing else is ever marked
usable. Failures are typed: `ManifestMismatch` (the source serves another manifest: a digest
mismatch), `ModelNotHeld` (it does not hold the model: dropped, answered at once, or never had
it), `ChecksumMismatch`, `TransferTimeout` / `PeerClosed` / `PeerUnreachable` (every source of a
pull failed), `InsufficientMemory` (over `budget_bytes`, or allocation failed). Every failure
of an upstream but those last two moves the pull on to its next source (`_FINAL`).

Worker-side use::

    server = GroupServer(transport); await server.start()          # once per process
    result = await receive_chain(transport, upstream_address, manifest,
                                 fallback_addresses=[host_shard_address], server=server,
                                 on_group_ready=lambda name: ..., budget_bytes=free_bytes)
    tensors = result.store.tensors("layers.0")                      # zero-copy torch views

Source-side use (parameter manager, or a serving instance): `serve_groups(transport, manifest,
buffers, server=server)`. There is no push API and no downstream address: downstream hops
connect to us.

Wire protocol (per endpoint, tags from `transport.Endpoint`): the receiver sends a JSON request
on CONTROL_TAG; the server answers a JSON response on CONTROL_TAG, then sends chunk i of the
requested plan with tag DATA_TAG_BASE + i; the receiver sends "done" and the server answers
"bye" (so no receive is left posted). The server may send {"abort": reason} on CONTROL_TAG at
any time instead of more chunks.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections import deque
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Final

import numpy as np
import structlog

from services.common.waiting import wait_for

from .buffers import as_uint8_array, host_buffer
from .checksum import GroupDigests, checksum_algo_of, releases_gil
from .errors import (
    ChecksumMismatch,
    DataPlaneError,
    InsufficientMemory,
    ManifestMismatch,
    ModelNotHeld,
    ProtocolError,
    SourceUnavailable,
    TransferTimeout,
    TransportError,
    UpstreamAborted,
)
from .manifest import Chunk, GroupEntry, Manifest, chunks, group_tensors
from .shaped import LinkShaper
from .transport import MAX_TAG, Endpoint, Transport, address_label

if TYPE_CHECKING:
    import torch

__all__ = [
    "CONTROL_TAG",
    "DATA_TAG_BASE",
    "GroupServer",
    "GroupStore",
    "Pull",
    "TransferResult",
    "fetch_manifest",
    "receive_chain",
    "receive_groups",
    "serve_groups",
]

log = structlog.get_logger(__name__)

CONTROL_TAG: Final = 0
DATA_TAG_BASE: Final = 16
_PROTOCOL_VERSION: Final = 1
# Chunks smaller than this are digested inline: a thread hop costs more than the work. So is
# every chunk of an algo that holds the GIL (xxh3, crc32c: see checksum.py): the loop could not
# run beside the thread anyway, and inline the bytes are read while still in this core's cache
# (a 256 MiB pull in 16 MiB chunks on 2 cores: xxh3 inline 7.2 GB/s median, in a thread 5.2-6.1).
_INLINE_DIGEST_BYTES: Final = 256 * 1024
# A group whose bytes fail their checksum is fetched again this many times (corruption on the
# wire is transient), from the same source, before the transfer fails with ChecksumMismatch.
MAX_REFETCHES: Final = 2
# A source that delivered bytes before its pull failed is asked again this many times.
MAX_RESUMES: Final = 3
# What a worker's load passes as `fallback_rounds`: when every source of a pull failed, the
# fallbacks (host caches, which do not go away; the source itself for a pull straight from a
# host cache) are tried again, this many more rounds, after a backoff doubling from
# _ROUND_BACKOFF_S up to _ROUND_BACKOFF_MAX_S (22.2 s of backoff in all). Seen in the chaos
# suite: after a worker was SIGKILLed, a host cache's UCX connections stalled or were cancelled
# at once ("Request canceled") for up to about 20 s. The load's own timeout bounds it all.
FALLBACK_ROUNDS: Final = 10
_ROUND_BACKOFF_S: Final = 0.2
_ROUND_BACKOFF_MAX_S: Final = 3.2
_RESUME_BACKOFF_S: Final = 0.2  # before asking again a source that was delivering
# Errors that end a pull at once: no memory for the groups (about this receiver: no other
# source can help), and a group still corrupt after MAX_REFETCHES fetches (its verification
# failed for the whole session). After any other failure of an upstream (the transport's
# errors, a source that does not hold the model, a manifest it got wrong, an error nobody
# foresaw) the next source of the pull (a host-cache fallback) is tried.
_FINAL: Final = (InsufficientMemory, ChecksumMismatch)

Allocate = Callable[[GroupEntry], Any]
OnGroupReady = Callable[[str], None]
# The sources that hold these groups now (group names -> dataplane addresses): asked before each
# fallback round, since a source that restarted listens at a new address the plan never knew.
Relocate = Callable[[Sequence[str]], Awaitable[Sequence[bytes]]]
# Serves one connection whose request names a registered op: (endpoint, decoded request).
OpHandler = Callable[[Endpoint, dict[str, Any]], Awaitable[None]]


def default_allocate(entry: GroupEntry) -> np.ndarray:
    """Prefaulted host memory for one group (see `buffers.host_buffer`)."""
    return host_buffer(entry.size_bytes)


# -- the store ------------------------------------------------------------------------------------


class GroupStore:
    """The groups of one model in this process: complete (a source) or filling (a receiver).

    Per group it tracks the buffer, how many leading bytes have landed (chunks land in order),
    and whether the checksum has been verified (`is_ready`). Servers wait on it to forward
    chunks as they land.
    """

    def __init__(self, manifest: Manifest) -> None:
        self.manifest = manifest
        n = len(manifest.groups)
        self._buffers: list[np.ndarray | None] = [None] * n
        self._landed = [0] * n
        self._ready = [False] * n
        self._expected = [False] * n
        self._failure: BaseException | None = None
        self._waiters: list[asyncio.Future[None]] = []

    @classmethod
    def complete(cls, manifest: Manifest, buffers: Sequence[Any], *, verify: bool = False) -> GroupStore:
        """A store that holds every group already (`buffers` in manifest order, zero-copy).

        With `verify`, every group's checksum is checked first (ChecksumMismatch if not).
        """
        if len(buffers) != len(manifest.groups):
            raise ValueError(f"{len(buffers)} buffers for {len(manifest.groups)} groups of {manifest.model_id!r}")
        store = cls(manifest)
        for gi, (entry, buf) in enumerate(zip(manifest.groups, buffers, strict=True)):
            arr = as_uint8_array(buf, writable=False)
            if arr.size != entry.size_bytes:
                raise ValueError(f"group {entry.name!r}: buffer has {arr.size} bytes, manifest says {entry.size_bytes}")
            if verify:
                digests = GroupDigests(entry.size_bytes, checksum_algo_of(entry.checksum))
                digests.add(0, arr)
                actual = digests.checksum()
                if actual != entry.checksum:
                    raise ChecksumMismatch(
                        f"group {entry.name!r} of {manifest.model_id!r}: checksum {actual} != "
                        f"manifest {entry.checksum}",
                        group=entry.name,
                        expected=entry.checksum,
                        actual=actual,
                    )
            store._buffers[gi] = arr
            store._landed[gi] = entry.size_bytes
            store._ready[gi] = True
            store._expected[gi] = True
        return store

    # -- public queries -----------------------------------------------------------------------

    @property
    def model_id(self) -> str:
        return self.manifest.model_id

    def _index(self, group: str | int) -> int:
        return group if isinstance(group, int) else self.manifest.group_index(group)

    def is_ready(self, group: str | int) -> bool:
        return self._ready[self._index(group)]

    def ready_groups(self) -> list[str]:
        return [g.name for g, r in zip(self.manifest.groups, self._ready, strict=True) if r]

    def ready_prefix(self) -> int:
        """How many leading groups (embed, layers.0, ...) are usable: what ZigZag can run."""
        k = 0
        while k < len(self._ready) and self._ready[k]:
            k += 1
        return k

    def landed_bytes(self, group: str | int) -> int:
        return self._landed[self._index(group)]

    def holds(self, group: str | int) -> bool:
        """Whether this store has, or is receiving, the group (what a server may offer)."""
        return self._expected[self._index(group)]

    @property
    def failure(self) -> BaseException | None:
        return self._failure

    def buffer(self, group: str | int) -> np.ndarray:
        """The group's buffer (flat uint8). Only meaningful once `is_ready(group)`."""
        gi = self._index(group)
        buf = self._buffers[gi]
        if buf is None:
            raise KeyError(f"group {self.manifest.groups[gi].name!r} of {self.model_id!r} has no buffer yet")
        return buf

    def tensors(self, group: str | int) -> dict[str, torch.Tensor]:
        """Zero-copy torch views of a usable group's tensors; KeyError if it is not usable."""
        gi = self._index(group)
        entry = self.manifest.groups[gi]
        if not self._ready[gi]:
            raise KeyError(f"group {entry.name!r} of {self.model_id!r} is not usable yet")
        return group_tensors(entry, self.buffer(gi))

    # -- updates (receiver side) --------------------------------------------------------------

    def _wake(self) -> None:
        waiters, self._waiters = self._waiters, []
        for fut in waiters:
            if not fut.done():
                fut.set_result(None)

    def expect(self, indices: Sequence[int]) -> None:
        for gi in indices:
            self._expected[gi] = True

    def set_buffer(self, gi: int, buffer: Any) -> None:
        entry = self.manifest.groups[gi]
        arr = as_uint8_array(buffer, writable=True)
        if arr.size != entry.size_bytes:
            raise ValueError(f"allocate() gave {arr.size} bytes for group {entry.name!r}, it needs {entry.size_bytes}")
        self._buffers[gi] = arr

    def mark_landed(self, gi: int, end_bytes: int) -> None:
        if end_bytes > self._landed[gi]:
            self._landed[gi] = end_bytes
            self._wake()

    def mark_ready(self, gi: int) -> None:
        self._ready[gi] = True

    def reset(self, gi: int) -> None:
        """Group `gi` landed corrupt: nothing of it counts as landed, so it is fetched again and
        downstream streams wait for the new bytes (those that forwarded the bad ones verify and
        fetch again themselves)."""
        self._landed[gi] = 0
        self._ready[gi] = False

    def fail(self, exc: BaseException) -> None:
        """Mark the store failed: servers stop forwarding from it and tell their receivers."""
        if self._failure is None:
            self._failure = exc
        self._wake()

    async def wait_landed(self, gi: int, end_bytes: int, *, timeout_s: float | None) -> None:
        """Wait until the first `end_bytes` of group `gi` have landed."""
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        loop = asyncio.get_running_loop()
        while self._landed[gi] < end_bytes:
            if self._failure is not None:
                raise UpstreamAborted(f"store of {self.model_id!r} failed: {self._failure!r}")
            remaining = None if deadline is None else deadline - time.monotonic()
            if remaining is not None and remaining <= 0:
                raise TransferTimeout(
                    f"group {self.manifest.groups[gi].name!r} of {self.model_id!r} did not reach {end_bytes} bytes "
                    f"within {timeout_s}s (has {self._landed[gi]})"
                )
            fut: asyncio.Future[None] = loop.create_future()
            self._waiters.append(fut)
            try:
                await wait_for(fut, remaining)
            except TimeoutError:
                pass

    def view(self, chunk: Chunk) -> np.ndarray:
        buf = self.buffer(chunk.group_index)
        return buf[chunk.offset_bytes : chunk.offset_bytes + chunk.length_bytes]


# -- the server -----------------------------------------------------------------------------------


def _probe_timing(stall_timeout_s: float) -> tuple[float, float]:
    """When a receiver probes a silent upstream, and how long it waits for the answer.

    UCX (error handling off) cannot see a dead peer, so a source SIGKILLed mid-stream used to
    cost the whole stall timeout (10 s by default) before the fallback. A live upstream answers
    a probe at once, even while it has no chunk to send (its own upstream is slow); a dead one
    never does. The stall timeout still bounds the silence of an upstream that answers probes
    but sends nothing."""
    return min(1.0, stall_timeout_s / 4), min(2.0, stall_timeout_s / 2)


def _encode(obj: dict[str, Any]) -> bytes:
    return json.dumps(obj, separators=(",", ":")).encode()


def _decode(data: bytes, what: str, peer: str) -> dict[str, Any]:
    try:
        obj = json.loads(data)
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ProtocolError(f"{what} from {peer} is not JSON: {exc}") from None
    if not isinstance(obj, dict):
        raise ProtocolError(f"{what} from {peer} is not a JSON object: {obj!r:.100}")
    return obj


class GroupServer:
    """Serves published `GroupStore`s to receivers that connect to this process's transport.

    One per process (it owns `transport.accept()`). A request for a model not published yet
    waits up to `publish_wait_s` (a downstream hop may ask before we got our LoadParameters);
    one for a model this process dropped (its load failed, it was unloaded) is answered
    "not_held" at once, and so is a request still waiting when the model is dropped.
    A chunk not landed yet is waited for up to `land_timeout_s`; a send not taken within
    `send_timeout_s` ends that stream (the receiver is gone).
    """

    def __init__(
        self,
        transport: Transport,
        *,
        window_chunks: int = 4,
        send_timeout_s: float = 30.0,
        publish_wait_s: float = 30.0,
        land_timeout_s: float = 300.0,
        request_timeout_s: float = 10.0,
        stream_gbps: float = 0.0,
        stream_per_peer: bool = False,
    ) -> None:
        if window_chunks < 1:
            raise ValueError(f"window_chunks must be >= 1, got {window_chunks}")
        if not stream_gbps >= 0:
            raise ValueError(f"stream_gbps must be >= 0 (0 = off), got {stream_gbps!r}")
        self.transport = transport
        # Emulation (benchmarks): the parameter streams this server sends go at most this fast,
        # all of them sharing one link, or each its own (`stream_per_peer`), as a model with more
        # bytes than it has would load; the transport's own pacing, if any, still applies to
        # every message. 0: off.
        self._stream_gbps = stream_gbps
        self._stream_link = LinkShaper(stream_gbps) if stream_gbps > 0 and not stream_per_peer else None
        self._stream_per_peer = stream_per_peer
        self._window = window_chunks
        self._send_timeout_s = send_timeout_s
        self._publish_wait_s = publish_wait_s
        self._land_timeout_s = land_timeout_s
        self._request_timeout_s = request_timeout_s
        self._stores: dict[str, GroupStore] = {}
        self._published: dict[str, asyncio.Event] = {}
        self._dropped: set[str] = set()  # models published here once and dropped since
        self._ops: dict[str, OpHandler] = {}
        self._accept_task: asyncio.Task[None] | None = None
        self._handlers: set[asyncio.Task[None]] = set()
        self.streams_served = 0

    async def start(self) -> None:
        if self._accept_task is None:
            self._accept_task = asyncio.get_running_loop().create_task(
                self._accept_loop(), name="dataplane-group-server"
            )

    def publish(self, store: GroupStore) -> None:
        """Offer `store` (complete or filling) to receivers; replaces a store of the same model."""
        self._stores[store.model_id] = store
        self._dropped.discard(store.model_id)
        self._published.setdefault(store.model_id, asyncio.Event()).set()

    def register_op(self, op: str, handler: OpHandler) -> None:
        """Hand connections whose request has `"op": op` to `handler(endpoint, request)`.

        The server owns `transport.accept()`, so other protocols of this process (KV-cache
        transfers) share its connections this way. The endpoint is closed after the handler
        returns; the handler reports its own failures (errors it raises are only logged).
        """
        if op in ("pull", "manifest"):
            raise ValueError(f"op {op!r} is the group server's own")
        if op in self._ops:
            raise ValueError(f"op {op!r} already has a handler")
        self._ops[op] = handler

    def unregister_op(self, op: str) -> None:
        """Stop handing `op` to its handler: requests for it are answered "unknown_op"."""
        self._ops.pop(op, None)

    def unpublish(self, model_id: str) -> None:
        """Stop serving `model_id`: requests for it (and those waiting for it) are answered
        "not_held" at once, until it is published again."""
        if self._stores.pop(model_id, None) is not None:
            self._dropped.add(model_id)
        ev = self._published.pop(model_id, None)
        if ev is not None:
            ev.set()  # wakes the requests waiting for it: they find it dropped

    async def close(self) -> None:
        tasks = [t for t in (self._accept_task, *self._handlers) if t is not None]
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        self._accept_task = None

    async def _accept_loop(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            ep = await self.transport.accept()
            task = loop.create_task(self._serve(ep), name=f"dataplane-serve-{ep.peer}")
            self._handlers.add(task)
            task.add_done_callback(self._handlers.discard)

    async def _store_for(self, model_id: str) -> GroupStore | None:
        if model_id not in self._stores and model_id not in self._dropped:
            ev = self._published.setdefault(model_id, asyncio.Event())
            try:
                await wait_for(ev.wait(), self._publish_wait_s)
            except TimeoutError:
                return None
        return self._stores.get(model_id)

    async def _serve(self, ep: Endpoint) -> None:
        started = time.monotonic()
        try:
            req = _decode(
                await ep.recv_msg(CONTROL_TAG, timeout_s=self._request_timeout_s, max_bytes=1 << 20), "request", ep.peer
            )
            op = str(req.get("op"))
            handler = self._ops.get(op)
            if handler is not None:
                await handler(ep, req)
                return
            if op not in ("pull", "manifest"):
                await ep.send_msg(
                    _encode({"ok": False, "kind": "unknown_op", "error": f"op {op!r} is not served here"}),
                    CONTROL_TAG,
                    timeout_s=self._request_timeout_s,
                )
                return
            model_id = str(req.get("model_id"))
            store = await self._store_for(model_id)
            if store is None:
                dropped = model_id in self._dropped
                await ep.send_msg(
                    _encode(
                        {
                            "ok": False,
                            "kind": "not_held" if dropped else "unknown_model",
                            "error": f"model {model_id!r} is not served here"
                            + (" (dropped)" if dropped else f" (waited {self._publish_wait_s}s for it)")
                            + f" (serves {sorted(self._stores)})",
                        }
                    ),
                    CONTROL_TAG,
                    timeout_s=self._request_timeout_s,
                )
                return
            if req.get("op") == "manifest":
                await ep.send_msg(
                    _encode({"ok": True, "manifest": store.manifest.to_dict()}),
                    CONTROL_TAG,
                    timeout_s=self._request_timeout_s,
                )
                return
            if req.get("manifest_digest") != store.manifest.digest():
                await ep.send_msg(
                    _encode(
                        {
                            "ok": False,
                            "kind": "manifest_mismatch",
                            "manifest": store.manifest.to_dict(),
                            "error": f"manifest of {model_id!r} differs",
                        }
                    ),
                    CONTROL_TAG,
                    timeout_s=self._request_timeout_s,
                )
                return
            todo = [(int(g), int(s)) for g, s in req.get("groups", [])]
            bad = [g for g, _ in todo if not 0 <= g < len(store.manifest.groups) or not store.holds(g)]
            if store.failure is not None or bad:
                reason = (
                    f"store failed: {store.failure!r}"
                    if store.failure is not None
                    else f"groups {bad} are not held here"
                )
                await ep.send_msg(
                    _encode({"ok": False, "kind": "unavailable", "error": reason}),
                    CONTROL_TAG,
                    timeout_s=self._request_timeout_s,
                )
                return
            await ep.send_msg(_encode({"ok": True}), CONTROL_TAG, timeout_s=self._request_timeout_s)
            # The receiver's control messages (liveness probes, then "done") are read while the
            # chunks go out; a control message takes the lock so a pong never splits another.
            control_lock = asyncio.Lock()
            reader = asyncio.get_running_loop().create_task(self._read_control(ep, control_lock))
            try:
                sent = await self._stream(ep, store, todo)
                # Wait for "done" so the last chunks are not cut off by closing the endpoint, and
                # answer it so the receiver's posted control receive completes instead of leaking.
                await wait_for(asyncio.shield(reader), self._send_timeout_s)
            except TimeoutError:
                raise TransferTimeout(f"{ep.peer} sent no 'done' within {self._send_timeout_s}s") from None
            finally:
                async with control_lock:  # never cut a pong in half
                    reader.cancel()
                await asyncio.gather(reader, return_exceptions=True)
            async with control_lock:
                await ep.send_msg(_encode({"bye": True}), CONTROL_TAG, timeout_s=self._request_timeout_s)
            self.streams_served += 1
            log.info(
                "dataplane_stream_served",
                peer=ep.peer,
                model=model_id,
                bytes=sent,
                elapsed_s=round(time.monotonic() - started, 4),
            )
        except UpstreamAborted as exc:
            log.warning("dataplane_stream_aborted", peer=ep.peer, reason=str(exc))
            try:
                await ep.send_msg(_encode({"abort": str(exc)}), CONTROL_TAG, timeout_s=1.0)
            except TransportError:
                pass
        except (DataPlaneError, OSError, ValueError, KeyError, TypeError) as exc:
            log.warning("dataplane_stream_failed", peer=ep.peer, error=repr(exc))
        finally:
            await ep.close()

    async def _read_control(self, ep: Endpoint, lock: asyncio.Lock) -> None:
        """Answer the receiver's liveness probes until it sends "done"."""
        while True:
            msg = _decode(await ep.recv_msg(CONTROL_TAG, max_bytes=1 << 16), "control message", ep.peer)
            if "ping" not in msg:
                return
            async with lock:
                await ep.send_msg(_encode({"pong": msg["ping"]}), CONTROL_TAG, timeout_s=self._request_timeout_s)

    async def _stream(self, ep: Endpoint, store: GroupStore, todo: list[tuple[int, int]]) -> int:
        inflight: deque[asyncio.Task[None]] = deque()
        loop = asyncio.get_running_loop()
        sent = 0
        link = LinkShaper(self._stream_gbps) if self._stream_per_peer and self._stream_gbps > 0 else self._stream_link
        try:
            for seq, chunk in enumerate(chunks(store.manifest, todo)):
                if DATA_TAG_BASE + seq > MAX_TAG:
                    raise ProtocolError(f"stream of {store.model_id!r} exceeds {MAX_TAG - DATA_TAG_BASE} chunks")
                await store.wait_landed(
                    chunk.group_index, chunk.offset_bytes + chunk.length_bytes, timeout_s=self._land_timeout_s
                )
                if link is not None:
                    await link.take(chunk.length_bytes)
                inflight.append(
                    loop.create_task(ep.send(store.view(chunk), DATA_TAG_BASE + seq, timeout_s=self._send_timeout_s))
                )
                sent += chunk.length_bytes
                while len(inflight) >= self._window or (inflight and inflight[0].done()):
                    await inflight.popleft()
            while inflight:
                await inflight.popleft()
        finally:
            for t in inflight:
                t.cancel()
            if inflight:
                await asyncio.gather(*inflight, return_exceptions=True)
        return sent


async def serve_groups(
    transport: Transport,
    manifest: Manifest,
    buffers: Sequence[Any],
    *,
    server: GroupServer | None = None,
    verify: bool = False,
) -> GroupServer:
    """Publish a complete model (one buffer per group, manifest order) on `server` (created and
    started if None) and return the server. The buffers are served in place, never copied."""
    if server is None:
        server = GroupServer(transport)
        await server.start()
    server.publish(GroupStore.complete(manifest, buffers, verify=verify))
    return server


# -- the receiver ---------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Pull:
    """Receive `groups` (names; None = all) from the server at `address`; if it fails, resume
    the missing bytes from each of `fallbacks` in turn."""

    address: bytes
    groups: tuple[str, ...] | None = None
    fallbacks: tuple[bytes, ...] = ()


@dataclass(slots=True)
class TransferResult:
    """What a receive did. `store` holds the groups; `bytes_by_source` is keyed by address label."""

    model_id: str
    store: GroupStore
    groups_received: list[str]
    bytes_received: int
    elapsed_s: float
    bytes_by_source: dict[str, int] = field(default_factory=dict)
    resourced_groups: list[str] = field(default_factory=list)
    refetched_groups: list[str] = field(default_factory=list)  # fetched again after a checksum failure

    @property
    def gbps(self) -> float:
        return self.bytes_received / self.elapsed_s / 1e9 if self.elapsed_s > 0 else 0.0


class _ReceiveSession:
    def __init__(
        self,
        transport: Transport,
        store: GroupStore,
        *,
        allocate: Allocate,
        on_group_ready: OnGroupReady | None,
        stall_timeout_s: float,
        connect_timeout_s: float,
        window_chunks: int,
        fallback_rounds: int = 0,
        relocate: Relocate | None = None,
    ) -> None:
        self.transport = transport
        self._fallback_rounds = fallback_rounds
        self._relocate = relocate
        self.store = store
        self.manifest = store.manifest
        self._allocate = allocate
        self._on_group_ready = on_group_ready
        self._stall_timeout_s = stall_timeout_s
        self._connect_timeout_s = connect_timeout_s
        self._window = window_chunks
        self._alloc_tasks: dict[int, asyncio.Task[None]] = {}
        self._digests: dict[int, GroupDigests] = {}
        self._digest_futs: dict[int, list[asyncio.Future[None]]] = {}
        self._verify_tasks: list[asyncio.Task[None]] = []
        self.bytes_received = 0
        self.bytes_by_source: dict[str, int] = {}
        self.resourced: set[int] = set()
        self.refetched: dict[int, int] = {}

    # -- allocation ---------------------------------------------------------------------------

    async def _alloc(self, gi: int) -> None:
        entry = self.manifest.groups[gi]
        try:
            # In a thread: prefaulting a big group takes ~0.1 s/GiB and must not stall the loop.
            buf = await asyncio.get_running_loop().run_in_executor(None, self._allocate, entry)
        except MemoryError as exc:
            raise InsufficientMemory(
                f"allocating {entry.size_bytes} bytes for group {entry.name!r} failed: {exc}"
            ) from exc
        self.store.set_buffer(gi, buf)

    def _alloc_task(self, gi: int) -> asyncio.Task[None]:
        task = self._alloc_tasks.get(gi)
        if task is None:
            task = asyncio.get_running_loop().create_task(self._alloc(gi))
            self._alloc_tasks[gi] = task
        return task

    # -- landing and verification -------------------------------------------------------------

    def _landed(self, chunk: Chunk, source: str) -> None:
        gi, off, n = chunk
        self.store.mark_landed(gi, off + n)
        if n:
            self.bytes_received += n
            self.bytes_by_source[source] = self.bytes_by_source.get(source, 0) + n
        entry = self.manifest.groups[gi]
        digests = self._digests.get(gi)
        if digests is None:
            digests = self._digests[gi] = GroupDigests(entry.size_bytes, checksum_algo_of(entry.checksum))
        data = self.store.view(chunk)
        loop = asyncio.get_running_loop()
        futs = self._digest_futs.setdefault(gi, [])
        if n >= _INLINE_DIGEST_BYTES and releases_gil(digests.algo):
            futs.append(loop.run_in_executor(None, digests.add, off, data))
        else:
            digests.add(off, data)
        if off + n == entry.size_bytes:
            self._verify_tasks.append(loop.create_task(self._verify(gi)))

    async def _verify(self, gi: int) -> None:
        entry = self.manifest.groups[gi]
        await asyncio.gather(*self._digest_futs.pop(gi, []))
        actual = self._digests.pop(gi).checksum()
        if actual != entry.checksum and self.refetched.get(gi, 0) < MAX_REFETCHES:
            self.refetched[gi] = self.refetched.get(gi, 0) + 1
            self.store.reset(gi)
            log.warning(
                "dataplane_checksum_refetch",
                model=self.manifest.model_id,
                group=entry.name,
                expected=entry.checksum,
                actual=actual,
                attempt=self.refetched[gi],
            )
            return
        if actual != entry.checksum:
            raise ChecksumMismatch(
                f"group {entry.name!r} of {self.manifest.model_id!r}: received bytes have checksum {actual}, "
                f"manifest says {entry.checksum}",
                group=entry.name,
                expected=entry.checksum,
                actual=actual,
            )
        self.store.mark_ready(gi)
        if self._on_group_ready is not None:
            self._on_group_ready(entry.name)

    def _verification_failure(self) -> BaseException | None:
        for t in self._verify_tasks:
            if t.done() and not t.cancelled() and t.exception() is not None:
                return t.exception()
        return None

    # -- pulling ------------------------------------------------------------------------------

    def _landed_total(self, indices: list[int]) -> int:
        return sum(self.store.landed_bytes(gi) for gi in indices)

    def _missing(self, indices: list[int]) -> list[int]:
        """The groups of `indices` not all landed yet."""
        return [gi for gi in indices if self.store.landed_bytes(gi) < self.manifest.groups[gi].size_bytes]

    async def run_pull(self, pull: Pull, indices: list[int]) -> None:
        """Pull `indices` from `pull.address`, then from each fallback in turn after a failure.
        A source that delivered bytes in the attempt that failed (a stall on a congested link,
        not a dead peer) is asked again, up to MAX_RESUMES times; when every source has failed,
        the fallbacks get up to `fallback_rounds` more rounds, with a doubling backoff, each
        round asking `relocate` (if given) where the missing groups are now."""
        sources = [pull.address, *pull.fallbacks]
        again = list(pull.fallbacks) or [pull.address]
        resumes = dict.fromkeys(sources, 0)
        rounds, backoff_s = 0, _ROUND_BACKOFF_S
        errors: list[str] = []
        last: BaseException | None = None
        attempt = -1
        while sources:
            address = sources.pop(0)
            attempt += 1
            label = address_label(address)
            before = self._landed_total(indices)
            try:
                if attempt:
                    missing = self._missing(indices)
                    self.resourced.update(missing)
                    log.warning(
                        "dataplane_resourcing",
                        model=self.manifest.model_id,
                        source=label,
                        groups=[self.manifest.groups[gi].name for gi in missing],
                        previous_error=errors[-1],
                    )
                await self._pull_once(address, label, indices)
                # A group that failed its checksum was reset: fetch it again from here (bounded:
                # past MAX_REFETCHES its verification raises ChecksumMismatch).
                while True:
                    await asyncio.gather(*[t for t in self._verify_tasks if not t.done()])
                    if not self._missing(indices):
                        return
                    await self._pull_once(address, label, indices)
            except _FINAL:
                raise
            except Exception as exc:
                errors.append(f"{label}: {type(exc).__name__}: {exc}")
                last = exc
                if self._landed_total(indices) > before and resumes.get(address, 0) < MAX_RESUMES:
                    resumes[address] = resumes.get(address, 0) + 1
                    sources.insert(0, address)  # it was delivering: ask it again first
                    await asyncio.sleep(_RESUME_BACKOFF_S)
                elif not sources and rounds < self._fallback_rounds:
                    rounds += 1
                    await asyncio.sleep(backoff_s)
                    backoff_s = min(_ROUND_BACKOFF_MAX_S, backoff_s * 2)
                    sources = await self._sources_now(indices, again)
        raise _every_source_failed(
            last, f"every source failed for model {self.manifest.model_id!r}: " + "; ".join(errors)
        )

    async def _sources_now(self, indices: list[int], planned: list[bytes]) -> list[bytes]:
        """The sources of a new fallback round: where `relocate` says the missing groups are now
        (a restarted host cache, at its new address), then the planned ones it did not name."""
        if self._relocate is None:
            return list(planned)
        missing = [self.manifest.groups[gi].name for gi in self._missing(indices)]
        try:
            found = list(await self._relocate(missing))
        except Exception as exc:  # the locator down too: the planned sources, as before
            log.warning("dataplane_relocate_failed", model=self.manifest.model_id, error=repr(exc))
            return list(planned)
        if any(a not in planned for a in found):
            log.info(
                "dataplane_relocated",
                model=self.manifest.model_id,
                groups=missing,
                sources=[address_label(a) for a in found],
            )
        return [*dict.fromkeys([*found, *planned])]

    async def _pull_once(self, address: bytes, label: str, indices: list[int]) -> None:
        todo = [
            (gi, self.store.landed_bytes(gi))
            for gi in indices
            if self.store.landed_bytes(gi) < self.manifest.groups[gi].size_bytes
        ]
        if not todo:
            return
        ep = await self.transport.connect(address, timeout_s=self._connect_timeout_s)
        posted: deque[tuple[Chunk, asyncio.Task[None]]] = deque()
        control: asyncio.Task[bytes] | None = None
        ok = False
        loop = asyncio.get_running_loop()
        try:
            await ep.send_msg(
                _encode(
                    {
                        "v": _PROTOCOL_VERSION,
                        "op": "pull",
                        "model_id": self.manifest.model_id,
                        "manifest_digest": self.manifest.digest(),
                        "groups": todo,
                    }
                ),
                CONTROL_TAG,
                timeout_s=self._stall_timeout_s,
            )
            # The server may wait for the model to be published upstream first: allow for it.
            resp = _decode(await ep.recv_msg(CONTROL_TAG, timeout_s=self._stall_timeout_s * 4), "response", label)
            self._check_response(resp, label)
            control = loop.create_task(ep.recv_msg(CONTROL_TAG, max_bytes=1 << 20))
            plan = chunks(self.manifest, todo)
            after = {gi: nxt for (gi, _), (nxt, _) in zip(todo, todo[1:], strict=False)}
            seq = 0

            async def post_next() -> None:
                nonlocal seq
                chunk = next(plan, None)
                if chunk is None:
                    return
                await self._alloc_task(chunk.group_index)
                if chunk.offset_bytes == 0:
                    # Start faulting in the next group's memory while this one is on the wire.
                    nxt = after.get(chunk.group_index)
                    if nxt is not None:
                        self._alloc_task(nxt)
                task = loop.create_task(ep.recv_into(self.store.view(chunk), DATA_TAG_BASE + seq))
                seq += 1
                posted.append((chunk, task))

            for _ in range(self._window):
                await post_next()
            probe_after_s, probe_timeout_s = _probe_timing(self._stall_timeout_s)
            heard_s = time.monotonic()  # the upstream's last sign of life: a chunk or a pong
            chunk_s = heard_s  # its last chunk
            ping_s: float | None = None  # when our unanswered liveness probe went out
            pings = 0
            while posted:
                chunk, task = posted[0]
                now = time.monotonic()
                wake = chunk_s + self._stall_timeout_s
                wake = min(wake, ping_s + probe_timeout_s if ping_s is not None else heard_s + probe_after_s)
                done, _ = await asyncio.wait(
                    (task, control), timeout=max(0.0, wake - now), return_when=asyncio.FIRST_COMPLETED
                )
                now = time.monotonic()
                if task in done:
                    task.result()
                    posted.popleft()
                    heard_s = chunk_s = now
                    ping_s = None
                    self._landed(chunk, label)
                    failure = self._verification_failure()
                    if failure is not None:
                        raise failure
                    await post_next()
                elif control in done:
                    msg = _decode(control.result(), "control message", label)
                    if "pong" not in msg:
                        raise UpstreamAborted(f"{label} aborted the stream: {msg.get('abort', msg)}")
                    heard_s = now
                    ping_s = None
                    control = loop.create_task(ep.recv_msg(CONTROL_TAG, max_bytes=1 << 20))
                elif now - chunk_s >= self._stall_timeout_s:
                    raise TransferTimeout(
                        f"no chunk from {label} for {self._stall_timeout_s}s "
                        f"(group {self.manifest.groups[chunk.group_index].name!r} at byte {chunk.offset_bytes})"
                    )
                elif ping_s is not None:
                    raise TransferTimeout(
                        f"{label} did not answer a liveness probe within {probe_timeout_s}s "
                        f"(no chunk for {now - chunk_s:.1f}s; group {self.manifest.groups[chunk.group_index].name!r} "
                        f"at byte {chunk.offset_bytes})"
                    )
                else:
                    pings += 1
                    ping_s = now
                    await ep.send_msg(_encode({"ping": pings}), CONTROL_TAG, timeout_s=probe_timeout_s)
            await ep.send_msg(_encode({"done": True}), CONTROL_TAG, timeout_s=self._stall_timeout_s)
            try:
                while True:  # a pong may still be on its way ahead of the bye
                    bye = _decode(await wait_for(control, self._stall_timeout_s), "bye", label)
                    if "pong" not in bye:
                        break
                    control = loop.create_task(ep.recv_msg(CONTROL_TAG, max_bytes=1 << 20))
            except TimeoutError:
                raise TransferTimeout(f"{label} did not acknowledge the end of the stream") from None
            if "abort" in bye:
                raise UpstreamAborted(f"{label} aborted the stream: {bye['abort']}")
            ok = True
        finally:
            if ok:
                await ep.close()
            else:
                ep.abort()  # cancels posted receives before their buffers are re-used
            leftovers = [t for _, t in posted] + ([control] if control is not None else [])
            for t in leftovers:
                t.cancel()
            if leftovers:
                await asyncio.gather(*leftovers, return_exceptions=True)

    def _check_response(self, resp: dict[str, Any], label: str) -> None:
        if resp.get("ok") is True:
            return
        kind, error = resp.get("kind"), resp.get("error", "")
        if kind in ("unknown_model", "not_held"):
            raise ModelNotHeld(f"{label}: {error}")
        if kind == "manifest_mismatch":
            detail = None
            try:
                detail = self.manifest.diff(Manifest.from_dict(resp["manifest"]))
            except (DataPlaneError, KeyError, TypeError):
                pass
            raise ManifestMismatch(
                f"{label} serves a different manifest for {self.manifest.model_id!r}: {detail or error}"
            )
        if kind == "unavailable":
            raise SourceUnavailable(f"{label}: {error}")
        raise ProtocolError(f"unexpected response from {label}: {resp!r:.200}")


def _every_source_failed(last: BaseException | None, message: str) -> DataPlaneError:
    """The error of a pull whose every source failed: of the last failure's data-plane type
    (ChecksumMismatch keeps its group and digests), a TransportError for anything else."""
    error: DataPlaneError
    if isinstance(last, ChecksumMismatch):
        error = ChecksumMismatch(message, group=last.group, expected=last.expected, actual=last.actual)
    elif isinstance(last, DataPlaneError):
        try:
            error = type(last)(message)
        except TypeError:  # a subclass with its own constructor
            error = TransportError(message)
    else:
        error = TransportError(message)
    error.__cause__ = last
    return error


async def receive_groups(
    transport: Transport,
    target: Manifest | GroupStore,
    pulls: Sequence[Pull],
    *,
    server: GroupServer | None = None,
    allocate: Allocate = default_allocate,
    on_group_ready: OnGroupReady | None = None,
    budget_bytes: int | None = None,
    stall_timeout_s: float = 10.0,
    connect_timeout_s: float = 10.0,
    window_chunks: int = 4,
    fallback_rounds: int = 0,
    relocate: Relocate | None = None,
) -> TransferResult:
    """Receive groups of one model from one or more sources, concurrently (sharded transfer,
    all-gather), into `target` (a store, or a manifest to make a new one from).
    `fallback_rounds`: how many more rounds a pull whose every source failed gives its
    fallbacks (see FALLBACK_ROUNDS); 0, one pass over the sources. `relocate`, if given, is
    asked before each such round where the missing groups are now.

    Each `Pull` names a source, its groups (disjoint across pulls) and its fallbacks. With a
    `server`, the store is published first so that downstream hops can pull from us while we
    receive (the chain). `allocate(group_entry)` returns a writable buffer of exactly
    `size_bytes` for a group (called in a worker thread; default: prefaulted host memory).
    `budget_bytes` bounds the bytes this call allocates (InsufficientMemory before anything
    moves). On failure the store is marked failed (its downstream streams abort) and the error
    is raised; groups already verified stay usable, no other group is.
    """
    store = target if isinstance(target, GroupStore) else GroupStore(target)
    manifest = store.manifest
    plan: list[tuple[Pull, list[int]]] = []
    claimed: dict[int, str] = {}
    for pull in pulls:
        names = manifest.group_names if pull.groups is None else list(pull.groups)
        # In the order the pull names them (a live load streams the decoder layers first).
        indices = list(dict.fromkeys(manifest.group_index(n) for n in names))
        for gi in indices:
            if gi in claimed:
                raise ValueError(
                    f"group {manifest.groups[gi].name!r} is requested from both "
                    f"{claimed[gi]} and {address_label(pull.address)}"
                )
            claimed[gi] = address_label(pull.address)
        plan.append((pull, indices))
    wanted = sorted(claimed)
    needed_bytes = sum(manifest.groups[gi].size_bytes for gi in wanted if store._buffers[gi] is None)
    if budget_bytes is not None and needed_bytes > budget_bytes:
        raise InsufficientMemory(
            f"model {manifest.model_id!r}: receiving {len(wanted)} groups needs {needed_bytes} "
            f"bytes, budget is {budget_bytes}"
        )
    store.expect(wanted)
    store._failure = None  # a new attempt on a store that failed before
    if server is not None:
        server.publish(store)
    session = _ReceiveSession(
        transport,
        store,
        allocate=allocate,
        on_group_ready=on_group_ready,
        stall_timeout_s=stall_timeout_s,
        connect_timeout_s=connect_timeout_s,
        window_chunks=window_chunks,
        fallback_rounds=fallback_rounds,
        relocate=relocate,
    )
    for gi in wanted:
        if manifest.groups[gi].size_bytes == 0 and not store.is_ready(gi):
            # No chunk will ever land for an empty group: verify and publish it right away.
            store.set_buffer(gi, np.empty(0, dtype=np.uint8))
            session._landed(Chunk(gi, 0, 0), "local")
    started = time.monotonic()
    log.info(
        "dataplane_receive_started",
        model=manifest.model_id,
        groups=len(wanted),
        bytes=needed_bytes,
        sources=[address_label(p.address) for p, _ in plan],
        transport=transport.kind,
    )
    try:
        async with asyncio.TaskGroup() as tg:
            for pull, indices in plan:
                tg.create_task(session.run_pull(pull, indices))
        await asyncio.gather(*session._verify_tasks)
    except BaseException as exc:
        error = _first_error(exc)
        for t in session._verify_tasks + list(session._alloc_tasks.values()):
            t.cancel()
        await asyncio.gather(*session._verify_tasks, *session._alloc_tasks.values(), return_exceptions=True)
        store.fail(error)
        log.warning(
            "dataplane_receive_failed",
            model=manifest.model_id,
            error=repr(error),
            ready=len(store.ready_groups()),
            elapsed_s=round(time.monotonic() - started, 4),
        )
        if error is exc:
            raise
        raise error from None
    elapsed = time.monotonic() - started
    result = TransferResult(
        model_id=manifest.model_id,
        store=store,
        groups_received=[manifest.groups[gi].name for gi in wanted],
        bytes_received=session.bytes_received,
        elapsed_s=elapsed,
        bytes_by_source=session.bytes_by_source,
        resourced_groups=[manifest.groups[gi].name for gi in sorted(session.resourced)],
        refetched_groups=[manifest.groups[gi].name for gi in sorted(session.refetched)],
    )
    log.info(
        "dataplane_receive_done",
        model=manifest.model_id,
        bytes=result.bytes_received,
        elapsed_s=round(elapsed, 4),
        gbps=round(result.gbps, 3),
        resourced=len(result.resourced_groups),
        refetched=len(result.refetched_groups),
    )
    return result


def _first_error(exc: BaseException) -> BaseException:
    """The most telling error inside a (nested) exception group: data plane errors first."""
    if not isinstance(exc, BaseExceptionGroup):
        return exc
    leaves: list[BaseException] = []

    def walk(e: BaseException) -> None:
        if isinstance(e, BaseExceptionGroup):
            for sub in e.exceptions:
                walk(sub)
        else:
            leaves.append(e)

    walk(exc)
    for kind in (ChecksumMismatch, ManifestMismatch, InsufficientMemory, DataPlaneError, Exception):
        for leaf in leaves:
            if isinstance(leaf, kind):
                return leaf
    return leaves[0] if leaves else exc


async def receive_chain(
    transport: Transport,
    upstream_address: bytes,
    target: Manifest | GroupStore,
    *,
    groups: Sequence[str] | None = None,
    fallback_addresses: Sequence[bytes] = (),
    server: GroupServer | None = None,
    allocate: Allocate = default_allocate,
    on_group_ready: OnGroupReady | None = None,
    budget_bytes: int | None = None,
    stall_timeout_s: float = 10.0,
    connect_timeout_s: float = 10.0,
    window_chunks: int = 4,
) -> TransferResult:
    """Be one hop of a chain: pull `groups` (default all) from `upstream_address`, falling back
    to `fallback_addresses` in turn, while `server` forwards every landed chunk to whoever pulls
    from us. See `receive_groups` for the arguments and errors."""
    return await receive_groups(
        transport,
        target,
        [Pull(upstream_address, None if groups is None else tuple(groups), tuple(fallback_addresses))],
        server=server,
        allocate=allocate,
        on_group_ready=on_group_ready,
        budget_bytes=budget_bytes,
        stall_timeout_s=stall_timeout_s,
        connect_timeout_s=connect_timeout_s,
        window_chunks=window_chunks,
    )


async def fetch_manifest(transport: Transport, address: bytes, model_id: str, *, timeout_s: float = 10.0) -> Manifest:
    """Ask the server at `address` for its manifest of `model_id` (ManifestMismatch if it has none)."""
    ep = await transport.connect(address, timeout_s=timeout_s)
    label = address_label(address)
    try:
        await ep.send_msg(
            _encode({"v": _PROTOCOL_VERSION, "op": "manifest", "model_id": model_id}), CONTROL_TAG, timeout_s=timeout_s
        )
        resp = _decode(await ep.recv_msg(CONTROL_TAG, timeout_s=timeout_s), "response", label)
    except BaseException:
        ep.abort()
        raise
    await ep.close()
    if resp.get("ok") is not True:
        if resp.get("kind") in ("unknown_model", "not_held"):
            raise ModelNotHeld(f"{label}: {resp.get('error', resp)}")
        raise ManifestMismatch(f"{label}: {resp.get('error', resp)}")
    return Manifest.from_dict(resp["manifest"])
