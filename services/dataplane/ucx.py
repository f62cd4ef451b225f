"""UCX transport through `ucxx`: the default data plane path (shared memory on a host, tcp/rdma across).

How it is driven, and why (measured here, see DESIGN.md):
- Endpoints come from exchanged *worker addresses* (`get_worker_address()` /
  `create_endpoint_from_worker_address`), never from the listener API, which always ends up on
  tcp (1.5-1.8 GB/s). The address goes to peers over gRPC as opaque bytes.
- Endpoint error handling is off: with it on, UCX moves everything over tcp/lo (0.4-0.5 GB/s
  here, against 7-11 GB/s over shared memory). The price is that UCX never notices a dead
  peer, so every send and receive here has a timeout, and a timed-out endpoint is aborted,
  which cancels its requests (no late write into a buffer).
- Progress mode "blocking" (epoll fd on the asyncio loop): the fastest mode that leaves the
  CPU idle when nothing moves; "thread" wants a CUDA context.
- UCX_TLS defaults to "^cma" (see SAFE_TLS): with error handling off, cma turns the death of
  a sender into the death of its receiver. The shared-memory path that remains needs both
  processes scheduled for every fragment, so it slows to a crawl (0.1-0.3 GB/s measured) when
  the CPU is oversubscribed; cma (tls=None) and TCP degrade far less.
- Worker-address endpoints are one-way and carry no tags of their own, so a connection is a
  handshake: the connector sends (connection id, its own worker address) on a well-known tag;
  the acceptor opens an endpoint back and answers, then sends a warm-up message so the first
  real chunk does not pay for protocol set-up. Every tag is
  `connection id << 32 | direction << 31 | user tag`, matched exactly.

One `ucxx` context exists per process, hence one `UcxTransport` per process.
"""

from __future__ import annotations

import asyncio
import os
import secrets
import struct
from typing import Any, Final

# UCX reads these when its context is created (first use); set them before importing ucxx.
os.environ.setdefault("UCX_WARN_UNUSED_ENV_VARS", "n")  # silences warnings about CUDA variables

import numpy as np  # noqa: E402
import structlog  # noqa: E402
import ucxx  # noqa: E402

from .buffers import as_uint8_array  # noqa: E402
from .errors import PeerClosed, ProtocolError, TransferTimeout, TransportError  # noqa: E402
from .transport import Endpoint, Transport, address_kind, check_tag  # noqa: E402

__all__ = ["UcxTransport", "ucx_version"]

log = structlog.get_logger(__name__)

_ADDRESS_PREFIX: Final = b"UCX1"
_ACCEPT_TAG: Final = 0x42_4D_44_50  # connection id 0 is never handed out, so this cannot collide
_HELLO = struct.Struct("<4sHIH")  # magic, protocol version, connection id, address length
_HELLO_MAGIC: Final = b"BMHI"
_BYE_MAGIC: Final = b"BMBY"  # sent to ourselves on close, to complete the posted hello receive
_HELLO_BYTES: Final = 4096  # fixed receive size (eager); worker addresses are ~200-2000 bytes
_PROTOCOL_VERSION: Final = 1
_ACK_TAG: Final = 0
_WARMUP_TAG: Final = 1
# User tags handed to us are shifted up so the handshake tags above stay private.
_USER_TAG_BASE: Final = 2
_ABORT_PERIOD_NS: Final = 100_000_000  # how long abort may wait on UCX internals (0.1 s)

# Every transport but cma. With cma, a large message is pulled by the *receiver* with
# process_vm_readv; if the sender dies mid-message that call fails and, with error handling
# off, UCX aborts the receiving process (SIGABRT, seen when a chain hop was SIGKILLed). The
# shared-memory copy-in/copy-out path (sysv/posix) only stalls, which our timeouts handle.
# Measured one hop on loopback: cma ~11 GB/s, shared memory ~7.5-8 GB/s; across hosts cma
# is never used anyway. Pass tls=None to let UCX use everything (cma included).
SAFE_TLS: Final = "^cma"

_active_transport: UcxTransport | None = None


def ucx_version() -> str:
    return f"ucxx {ucxx.__version__} / UCX {'.'.join(map(str, ucxx.get_ucx_version()))}"


def _ensure_ucxx(progress_mode: str, tls: str | None) -> None:
    options = {} if tls is None else {"TLS": tls}
    try:
        # An operator's UCX_TLS in the environment wins over our default.
        ucxx.init(options=options, env_takes_precedence=True, progress_mode=progress_mode)
    except RuntimeError:
        pass  # already initialised by someone else in this process: use it as it is
    ucxx.continuous_ucx_progress()  # bind progress to the running loop (no-op if already bound)


class _Peer:
    """The one UCX endpoint this process keeps to one remote worker, shared by connections.

    UCX pairs the endpoints two workers open to each other, and a rendezvous sent on one may
    be answered through its pair; closing any endpoint to a peer while other connections to it
    are in flight cancelled their requests ("Request canceled", seen in the all-gather test).
    So there is one endpoint per peer, kept until a connection to it fails, and then aborted
    for all of them: a peer that stalled or died is a failed peer.
    """

    def __init__(self, ep: Any, key: bytes, transport: UcxTransport) -> None:
        self.ep = ep
        self.key = key
        self.transport = transport
        self.connections: set[_UcxEndpoint] = set()
        self.broken = False

    def abort(self) -> None:
        if self.broken:
            return
        self.broken = True
        self.transport._forget_peer(self)
        for conn in list(self.connections):
            conn._closed = True
        self.connections.clear()
        try:
            self.ep.abort(period=_ABORT_PERIOD_NS, max_attempts=1)  # cancels every pending request
        except Exception as exc:  # noqa: BLE001 - an abort must not raise; log and move on
            log.warning("dataplane_ucx_abort_failed", error=repr(exc))


class _UcxEndpoint(Endpoint):
    def __init__(self, peer: _Peer, conn_id: int, *, is_client: bool) -> None:
        self._peer = peer
        self._conn_id = conn_id
        self.peer = f"ucx:{conn_id:08x}"
        # Client sends with direction bit 0 and receives with 1; the acceptor the other way.
        self._send_dir = 0 if is_client else 1
        self._closed = False
        peer.connections.add(self)

    @property
    def closed(self) -> bool:
        return self._closed or self._peer.broken

    def _full_tag(self, tag: int, direction: int) -> int:
        return (self._conn_id << 32) | (direction << 31) | tag

    async def _send_raw(self, arr: np.ndarray, tag: int, timeout_s: float | None) -> None:
        if self.closed:
            raise PeerClosed(f"endpoint to {self.peer} is closed")
        full = self._full_tag(tag, self._send_dir)
        try:
            await asyncio.wait_for(self._peer.ep.send(arr, tag=full, force_tag=True), timeout_s)
        except TimeoutError:
            self.abort()
            raise TransferTimeout(
                f"send of {arr.nbytes} bytes (tag {tag - _USER_TAG_BASE}) to {self.peer} not taken within {timeout_s}s"
            ) from None
        except asyncio.CancelledError:
            self.abort()
            raise
        except ucxx.exceptions.UCXError as exc:
            self.abort()
            raise PeerClosed(f"send to {self.peer} failed: {exc}") from exc

    async def _recv_raw(self, arr: np.ndarray, tag: int, timeout_s: float | None) -> None:
        if self.closed:
            raise PeerClosed(f"endpoint to {self.peer} is closed")
        full = self._full_tag(tag, 1 - self._send_dir)
        try:
            await asyncio.wait_for(self._peer.ep.recv(arr, tag=full, force_tag=True), timeout_s)
        except TimeoutError:
            self.abort()  # cancels the posted receive: nothing lands in `arr` after this
            raise TransferTimeout(
                f"no message with tag {tag - _USER_TAG_BASE} from {self.peer} within {timeout_s}s"
            ) from None
        except asyncio.CancelledError:
            self.abort()
            raise
        except ucxx.exceptions.UCXMessageTruncatedError as exc:
            self.abort()
            raise ProtocolError(
                f"message with tag {tag - _USER_TAG_BASE} from {self.peer} is larger than the {arr.nbytes}-byte buffer"
            ) from exc
        except ucxx.exceptions.UCXError as exc:
            self.abort()
            raise PeerClosed(f"receive from {self.peer} failed: {exc}") from exc

    async def send(self, buffer: Any, tag: int, *, timeout_s: float | None = None) -> None:
        arr = as_uint8_array(buffer, writable=False)
        await self._send_raw(arr, check_tag(tag) + _USER_TAG_BASE, timeout_s)

    async def recv_into(self, buffer: Any, tag: int, *, timeout_s: float | None = None) -> None:
        arr = as_uint8_array(buffer, writable=True)
        # UCX accepts a shorter message into a larger buffer without telling its length;
        # callers always know exact sizes, and control messages carry their length.
        await self._recv_raw(arr, check_tag(tag) + _USER_TAG_BASE, timeout_s)

    def abort(self) -> None:
        """Abort the shared endpoint to this peer: the only way to cancel a posted request."""
        self._closed = True
        self._peer.abort()

    async def close(self) -> None:
        # Graceful: the peer endpoint stays for other and later connections. Every message
        # of this connection has completed (the protocol ends with a reply), so no request
        # of ours is left posted.
        self._closed = True
        self._peer.connections.discard(self)


class UcxTransport(Transport):
    """UCX transport over `ucxx` worker addresses (see the module docstring)."""

    kind = "ucx"

    def __init__(
        self, *, progress_mode: str = "blocking", warmup_bytes: int = 1 << 20, tls: str | None = SAFE_TLS
    ) -> None:
        if progress_mode not in ("blocking", "polling", "thread", "thread-polling"):
            raise ValueError(f"unknown progress_mode {progress_mode!r}")
        self._progress_mode = progress_mode
        self._tls = tls
        self._warmup_bytes = warmup_bytes
        self._address: bytes | None = None
        self._accept_task: asyncio.Task[None] | None = None
        self._handshakes: set[asyncio.Task[None]] = set()
        self._accepted: asyncio.Queue[_UcxEndpoint] = asyncio.Queue()
        self._peers: dict[bytes, _Peer] = {}
        self._peer_locks: dict[bytes, asyncio.Lock] = {}
        # Reused across connections: the first transfer into a fresh buffer is slow.
        self._warmup_buf = np.zeros(max(warmup_bytes, 1), dtype=np.uint8)
        self._pending_hello: np.ndarray | None = None

    async def start(self) -> None:
        global _active_transport
        if self._address is not None:
            return
        if _active_transport is not None and _active_transport is not self:
            raise TransportError("only one UcxTransport per process (ucxx has one worker per process)")
        _ensure_ucxx(self._progress_mode, self._tls)
        _active_transport = self
        self._address = _ADDRESS_PREFIX + ucxx.get_worker_address().tobytes()
        self._accept_task = asyncio.get_running_loop().create_task(self._accept_loop(), name="dataplane-ucx-accept")
        log.info(
            "dataplane_ucx_started",
            progress_mode=self._progress_mode,
            version=ucx_version(),
            tls=os.environ.get("UCX_TLS", self._tls),
            address_bytes=len(self._address),
            pid=os.getpid(),
        )

    def address(self) -> bytes:
        if self._address is None:
            raise TransportError("UcxTransport.address() called before start()")
        return self._address

    async def _accept_loop(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            hello = np.zeros(_HELLO_BYTES, dtype=np.uint8)
            # Kept on self: a receive posted on the worker outlives a cancelled task, and UCX
            # must never write a late hello into freed memory.
            self._pending_hello = hello
            await ucxx.recv(hello, _ACCEPT_TAG)
            if hello[:4].tobytes() == _BYE_MAGIC:
                return
            task = loop.create_task(self._handshake(hello.tobytes()))
            self._handshakes.add(task)
            task.add_done_callback(self._handshakes.discard)

    async def _peer_for(self, worker_address: bytes) -> _Peer:
        peer = self._peers.get(worker_address)
        if peer is not None:
            return peer
        # One creation at a time per peer, or two racing connections would open two endpoints.
        lock = self._peer_locks.setdefault(worker_address, asyncio.Lock())
        async with lock:
            peer = self._peers.get(worker_address)
            if peer is None:
                ep = await ucxx.create_endpoint_from_worker_address(
                    ucxx.get_ucx_address_from_buffer(worker_address), endpoint_error_handling=False
                )
                peer = self._peers[worker_address] = _Peer(ep, worker_address, self)
        return peer

    def _forget_peer(self, peer: _Peer) -> None:
        if self._peers.get(peer.key) is peer:
            del self._peers[peer.key]

    async def _handshake(self, hello: bytes) -> None:
        magic, version, conn_id, addr_len = _HELLO.unpack_from(hello)
        if magic != _HELLO_MAGIC or version != _PROTOCOL_VERSION or not 0 < addr_len <= _HELLO_BYTES - _HELLO.size:
            log.warning("dataplane_ucx_bad_hello", magic=magic, version=version, addr_len=addr_len)
            return
        peer_addr = hello[_HELLO.size : _HELLO.size + addr_len]
        try:
            peer = await self._peer_for(peer_addr)
        except Exception as exc:  # noqa: BLE001 - a bad peer must not kill the accept loop
            log.warning("dataplane_ucx_accept_failed", conn=f"{conn_id:08x}", error=repr(exc))
            return
        endpoint = _UcxEndpoint(peer, conn_id, is_client=False)
        try:
            await endpoint._send_raw(np.frombuffer(struct.pack("<Q", self._warmup_bytes), np.uint8), _ACK_TAG, 10.0)
            if self._warmup_bytes:
                await endpoint._send_raw(self._warmup_buf[: self._warmup_bytes], _WARMUP_TAG, 10.0)
        except TransportError as exc:
            log.warning("dataplane_ucx_handshake_failed", peer=endpoint.peer, error=repr(exc))
            return
        await self._accepted.put(endpoint)

    async def connect(self, address: bytes, *, timeout_s: float = 10.0) -> Endpoint:
        if self._address is None:
            raise TransportError("UcxTransport.connect() called before start()")
        if address_kind(address) != "ucx":
            raise TransportError(f"UcxTransport cannot connect to a {address_kind(address)} address")
        raw = bytes(address[len(_ADDRESS_PREFIX) :])
        me = self._address[len(_ADDRESS_PREFIX) :]
        conn_id = secrets.randbits(32) or 1
        peer = await self._peer_for(raw)
        endpoint = _UcxEndpoint(peer, conn_id, is_client=True)
        hello = np.zeros(_HELLO_BYTES, dtype=np.uint8)
        packed = _HELLO.pack(_HELLO_MAGIC, _PROTOCOL_VERSION, conn_id, len(me)) + me
        hello[: len(packed)] = np.frombuffer(packed, np.uint8)
        try:
            # The hello goes to the peer's worker, not to a connection: raw tag, no conn id.
            await asyncio.wait_for(peer.ep.send(hello, tag=_ACCEPT_TAG, force_tag=True), timeout_s)
            ack = np.zeros(8, dtype=np.uint8)
            await endpoint._recv_raw(ack, _ACK_TAG, timeout_s)
            (warmup_bytes,) = struct.unpack("<Q", ack.tobytes())
            if warmup_bytes:
                scratch = (
                    self._warmup_buf if warmup_bytes <= self._warmup_buf.size else np.zeros(warmup_bytes, np.uint8)
                )
                await endpoint._recv_raw(scratch[:warmup_bytes], _WARMUP_TAG, timeout_s)
        except TimeoutError:
            endpoint.abort()
            raise TransferTimeout(f"UCX peer did not answer the handshake within {timeout_s}s") from None
        except BaseException:
            endpoint.abort()
            raise
        return endpoint

    async def accept(self, *, timeout_s: float | None = None) -> Endpoint:
        try:
            return await asyncio.wait_for(self._accepted.get(), timeout_s)
        except TimeoutError:
            raise TransferTimeout(f"no incoming connection within {timeout_s}s") from None

    async def _stop_accepting(self) -> None:
        """Complete our own posted hello receive with a "bye" to ourselves.

        A worker-level receive cannot be cancelled from Python; left posted, it would swallow
        the first hello sent to the next transport of this process (same worker, same tag).
        """
        task = self._accept_task
        if task is None or task.done() or self._address is None:
            return
        try:
            me = await self._peer_for(self._address[len(_ADDRESS_PREFIX) :])
            bye = np.zeros(_HELLO_BYTES, dtype=np.uint8)
            bye[:4] = np.frombuffer(_BYE_MAGIC, np.uint8)
            await asyncio.wait_for(me.ep.send(bye, tag=_ACCEPT_TAG, force_tag=True), 2.0)
            await asyncio.wait_for(asyncio.shield(task), 2.0)
        except (TimeoutError, ucxx.exceptions.UCXError) as exc:
            log.warning("dataplane_ucx_stop_accepting_failed", error=repr(exc))

    async def close(self) -> None:
        global _active_transport
        await self._stop_accepting()
        tasks = [t for t in (self._accept_task, *self._handshakes) if t is not None]
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        for peer in list(self._peers.values()):
            peer.abort()
        while not self._accepted.empty():
            self._accepted.get_nowait()._closed = True
        if _active_transport is self:
            _active_transport = None
        self._address = None
