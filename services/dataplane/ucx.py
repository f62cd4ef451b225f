"""UCX transport through `ucxx`: the default data plane path (shared memory on a host, tcp/rdma across).

How it is driven, and why (measured on the 2-core development machine; docs/benchmarks/dataplane.md):
- Endpoints come from exchanged *worker addresses* (`get_worker_address()` /
  `create_endpoint_from_worker_address`), never from the listener API, which always ends up on
  tcp (1.5-1.8 GB/s). The address goes to peers over gRPC as opaque bytes.
- Endpoint error handling is off: with it on, UCX moves everything over tcp/lo (0.4-0.5 GB/s
  here, against 7-11 GB/s over shared memory). The price is that UCX never notices a dead
  peer, so every send and receive here has a timeout, and a timed-out endpoint is aborted,
  which cancels its requests (no late write into a buffer).
- Progress mode "blocking" (the worker's epoll fd on the asyncio loop), with our own driver
  (`_ArmedProgress`) instead of ucxx's, which kept every process at 100% of a core, idle or
  not, in two ways (ucxx 0.52): its `BlockingMode` arms the worker once and never again, so
  the level-triggered fd stays readable after the first message; and a request's `wait()`
  polls with `asyncio.sleep(0)` until done, so the accept loop's standing receive alone spins
  forever. The driver re-arms after every burst of events and completes requests itself,
  right after the `progress()` that finished them: an idle process sleeps (0% CPU measured),
  and one hop still runs at `ucx_perftest` speed (9-10 GB/s, 16 MiB messages, no checksums).
- UCX_TLS defaults to "^cma" (see SAFE_TLS): with error handling off, cma turns the death of
  a sender into the death of its receiver. The shared-memory path that remains needs both
  processes scheduled for every fragment, so it slows down more than cma (tls=None) or TCP
  when the CPU is oversubscribed (0.1-0.3 GB/s was measured while ucxx's progress loop had
  every idle process spinning).
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
import socket
import struct
from collections.abc import Awaitable
from typing import Any, Final

# UCX reads these when its context is created (first use); set them before importing ucxx.
os.environ.setdefault("UCX_WARN_UNUSED_ENV_VARS", "n")  # silences warnings about CUDA variables

import numpy as np
import structlog
import ucxx
from ucxx._lib.arr import Array
from ucxx._lib_async import application_context as _ucxx_app
from ucxx.types import Tag, TagMaskFull

from services.common.waiting import wait_for

from .buffers import as_uint8_array
from .errors import DataPlaneError, PeerClosed, PeerUnreachable, ProtocolError, TransferTimeout, TransportError
from .netdev import advertised_net_device
from .transport import Endpoint, Transport, address_kind, check_tag

__all__ = ["UcxTransport", "ucx_version"]

log = structlog.get_logger(__name__)

_ADDRESS_PREFIX: Final = b"UCX1"
_ACCEPT_TAG: Final = 0x42_4D_44_50  # connection id 0 is never handed out, so this cannot collide
# magic, protocol version, connection id, the sender's endpoint generation, address length
_HELLO = struct.Struct("<4sHIIH")
_ACK = struct.Struct("<QI")  # warm-up bytes to follow, the acceptor's endpoint generation
_HELLO_MAGIC: Final = b"BMHI"
_BYE_MAGIC: Final = b"BMBY"  # sent to ourselves on close, to complete the posted hello receive
_HELLO_BYTES: Final = 4096  # fixed receive size (eager); worker addresses are ~200-2000 bytes
_PROTOCOL_VERSION: Final = 2
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


def _translate(exc: BaseException, what: str) -> TransportError:
    """A `ucxx` error (or any other non-data-plane error from the library) as the data plane's
    own type, so callers see only those: nothing of ucxx leaves this module. A dead peer shows
    up as many things (UCXXShmemSegmentError, UCXXUnreachableError, UCXXConnectionResetError,
    UCXXCanceledError...); all of them mean the peer cannot be talked to."""
    if isinstance(exc, ucxx.exceptions.UCXMessageTruncatedError):
        return ProtocolError(f"{what}: {type(exc).__name__}: {exc}")
    return PeerUnreachable(f"{what}: {type(exc).__name__}: {exc}")


def ucx_version() -> str:
    return f"ucxx {ucxx.__version__} / UCX {'.'.join(map(str, ucxx.get_ucx_version()))}"


class _ArmedProgress:
    """Blocking progress and request completion for one UCX worker on one asyncio loop.

    On an event (the worker's epoll fd is readable) the worker is progressed, and a driver
    task progresses it again, lets the loop run every callback that is ready (they may post
    new requests), and arms the worker with `arm()`; if UCX says it is busy, it goes round
    again. Once armed, the fd stays quiet until something arrives: an idle process sleeps. A
    timer re-runs the driver every `period_s` as a guard against a lost wake-up. Polling
    while a transfer runs (spin, then block) was tried: no faster over shared memory here
    (9-10 GB/s either way, 16 MiB messages), and it takes a core from whatever else runs.

    Requests are completed here too: `wait(request)` gives a future that is resolved right
    after the `progress()` call that finished the request. ucxx's own `request.wait()` (with
    python futures off, the only choice outside its thread modes) polls with `sleep(0)`
    until done, so one posted receive, such as the accept loop's, kept a core busy forever.
    """

    def __init__(self, worker: Any, loop: asyncio.AbstractEventLoop, *, period_s: float = 0.1) -> None:
        self._worker = worker
        self._loop = loop
        self._period_s = period_s
        worker.init_blocking_progress_mode()  # idempotent: the same epoll fd on a second call
        self._fd = int(worker.epoll_file_descriptor)
        # A socket whose peer is closed: reading it completes on the loop's next I/O poll,
        # that is after every callback that is ready now has run (ucx-py's trick).
        self._rsock, wsock = socket.socketpair()
        self._rsock.setblocking(False)
        wsock.close()
        self._driver: asyncio.Task[None] | None = None
        self._timer: asyncio.TimerHandle | None = None
        # Posted requests and their futures. A request stays here until UCX finishes it, even
        # if its future was cancelled: it keeps the request (and so its buffer) alive.
        self._pending: list[tuple[Any, asyncio.Future[None]]] = []
        loop.add_reader(self._fd, self._on_event)
        self.kick()
        self._timer = loop.call_later(period_s, self._on_timer)

    def wait(self, request: Any) -> asyncio.Future[None]:
        """A future resolved when `request` completes (its UCX error, if any, raised)."""
        fut: asyncio.Future[None] = self._loop.create_future()
        self._pending.append((request, fut))
        self._reap()
        self.kick()  # a new request may need progress before any event comes
        return fut

    def _reap(self) -> None:
        if not self._pending:
            return
        still: list[tuple[Any, asyncio.Future[None]]] = []
        for request, fut in self._pending:
            if not request.completed:
                still.append((request, fut))
            elif not fut.done():
                try:
                    request.check_error()
                except BaseException as exc:
                    fut.set_exception(exc)
                else:
                    fut.set_result(None)
        self._pending = still

    def _progress(self) -> None:
        self._worker.progress()
        self._reap()

    def _on_event(self) -> None:
        self._progress()
        self.kick()

    def _on_timer(self) -> None:
        self.kick()
        self._timer = self._loop.call_later(self._period_s, self._on_timer)

    def kick(self) -> None:
        if self._driver is None or self._driver.done():
            self._driver = self._loop.create_task(self._drive(), name="dataplane-ucx-progress")

    async def _drive(self) -> None:
        while True:
            self._progress()
            await self._loop.sock_recv(self._rsock, 1)
            if self._worker.arm():
                return


def _ensure_ucxx(progress_mode: str, tls: str | None, net_device: str | None = None) -> _ArmedProgress | None:
    """Initialise ucxx once per process and bind progress to the running loop; returns our
    driver in "blocking" mode (None in ucxx's own modes). `net_device`: the one network
    interface UCX may use (netdev.py); None leaves UCX all of them."""
    options = {} if tls is None else {"TLS": tls}
    if net_device is not None:
        options["NET_DEVICES"] = net_device
    loop = asyncio.get_running_loop()
    tasks = _ucxx_app.ProgressTasks  # ucxx's registry: event loop -> the object progressing it
    if progress_mode == "blocking":
        existing = tasks.get(loop)
        if isinstance(existing, _ArmedProgress):
            return existing
        # A placeholder for this loop keeps ucxx (init, endpoint creation) from binding its own
        # BlockingMode to it; ours replaces the placeholder below.
        tasks[loop] = None
    try:
        # An operator's UCX_TLS / UCX_NET_DEVICES in the environment wins over ours.
        ucxx.init(options=options, env_takes_precedence=True, progress_mode=progress_mode)
    except RuntimeError:
        pass  # already initialised by someone else in this process: use it as it is
    if progress_mode == "blocking":
        driver = tasks[loop] = _ArmedProgress(ucxx.core._get_ctx().worker, loop)
        return driver
    ucxx.continuous_ucx_progress()  # bind progress to the running loop (no-op if already bound)
    return None


class _Peer:
    """The one UCX endpoint this process keeps to one remote worker, shared by connections.

    UCX pairs the endpoints two workers open to each other, and a rendezvous sent on one may
    be answered through its pair; closing any endpoint to a peer while other connections to it
    are in flight cancelled their requests ("Request canceled", seen in the all-gather test).
    So there is one endpoint per peer, kept until a connection to it fails, and then aborted
    for all of them: a peer that stalled or died is a failed peer.

    The pairing also means that once the remote side drops its endpoint to us, ours is stale:
    eager messages still arrive, but a rendezvous through it is cancelled on the remote side,
    and UCX (error handling off) never tells us. So each endpoint has a random `generation`,
    sent in every hello and ack; `remote_generation` is the remote endpoint ours pairs with.
    A hello or ack naming another generation means the remote replaced its endpoint: ours is
    aborted and opened again, instead of failing every transfer until a send times out.
    """

    def __init__(self, ep: Any, key: bytes, transport: UcxTransport) -> None:
        self.ep = ep
        self.key = key
        self.transport = transport
        self.connections: set[_UcxEndpoint] = set()
        self.broken = False
        self.generation = secrets.randbits(32) or 1
        self.remote_generation: int | None = None

    def pairs_with(self, remote_generation: int) -> bool:
        """Whether the remote endpoint named `remote_generation` is the one ours pairs with
        (recorded on first sight)."""
        if self.remote_generation is None:
            self.remote_generation = remote_generation
        return self.remote_generation == remote_generation

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
        except Exception as exc:
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
            await wait_for(self._peer.transport._send(self._peer.ep, arr, full), timeout_s)
        except TimeoutError:
            self.abort()
            raise TransferTimeout(
                f"send of {arr.nbytes} bytes (tag {tag - _USER_TAG_BASE}) to {self.peer} not taken within {timeout_s}s"
            ) from None
        except asyncio.CancelledError:
            self.abort()
            raise
        except DataPlaneError:
            self.abort()
            raise
        except Exception as exc:  # every ucxx error
            self.abort()
            raise PeerClosed(f"send to {self.peer} failed: {type(exc).__name__}: {exc}") from exc

    async def _recv_raw(self, arr: np.ndarray, tag: int, timeout_s: float | None) -> None:
        if self.closed:
            raise PeerClosed(f"endpoint to {self.peer} is closed")
        full = self._full_tag(tag, 1 - self._send_dir)
        try:
            await wait_for(self._peer.transport._recv(self._peer.ep, arr, full), timeout_s)
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
        except DataPlaneError:
            self.abort()
            raise
        except Exception as exc:  # every other ucxx error
            self.abort()
            raise PeerClosed(f"receive from {self.peer} failed: {type(exc).__name__}: {exc}") from exc

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
        self,
        *,
        progress_mode: str = "blocking",
        warmup_bytes: int = 1 << 20,
        tls: str | None = SAFE_TLS,
        advertise_host: str | None = None,
    ) -> None:
        """`advertise_host`: the name peers reach this process by; UCX then uses the network
        interface holding its address alone (see netdev.py: in a swarm container the others
        may drop traffic between containers, and the first transfer hung)."""
        if progress_mode not in ("blocking", "polling", "thread", "thread-polling"):
            raise ValueError(f"unknown progress_mode {progress_mode!r}")
        self._progress_mode = progress_mode
        self._tls = tls
        self._advertise_host = advertise_host
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
        self._driver: _ArmedProgress | None = None

    # Requests go through our progress driver in "blocking" mode, through ucxx's (polling)
    # awaitables otherwise. `ep` is a ucxx Endpoint; in blocking mode its Cython endpoint
    # (`ep._ep`) posts the request, as ucxx's own send/recv do. Tags are used as they are.

    def _send(self, ep: Any, arr: np.ndarray, tag: int) -> Awaitable[Any]:
        if self._driver is None:
            return ep.send(arr, tag=tag, force_tag=True)
        ep._ep.raise_on_error()
        return self._driver.wait(ep._ep.tag_send(Array(arr), Tag(tag)))

    def _recv(self, ep: Any, arr: np.ndarray, tag: int) -> Awaitable[Any]:
        if self._driver is None:
            return ep.recv(arr, tag=tag, force_tag=True)
        ep._ep.raise_on_error()
        return self._driver.wait(ep._ep.tag_recv(Array(arr), Tag(tag), TagMaskFull))

    def _worker_recv(self, arr: np.ndarray, tag: int) -> Awaitable[Any]:
        """A receive on the worker itself (from any peer), as `ucxx.recv`."""
        if self._driver is None:
            return ucxx.recv(arr, tag)
        return self._driver.wait(ucxx.core._get_ctx().worker.tag_recv(Array(arr), Tag(tag)))

    async def start(self) -> None:
        global _active_transport
        if self._address is not None:
            return
        if _active_transport is not None and _active_transport is not self:
            raise TransportError("only one UcxTransport per process (ucxx has one worker per process)")
        net_device = await asyncio.to_thread(advertised_net_device, self._advertise_host)
        self._driver = _ensure_ucxx(self._progress_mode, self._tls, net_device)
        _active_transport = self
        self._address = _ADDRESS_PREFIX + ucxx.get_worker_address().tobytes()
        self._accept_task = asyncio.get_running_loop().create_task(self._accept_loop(), name="dataplane-ucx-accept")
        log.info(
            "dataplane_ucx_started",
            progress_mode=self._progress_mode,
            version=ucx_version(),
            tls=os.environ.get("UCX_TLS", self._tls),
            net_devices=os.environ.get("UCX_NET_DEVICES", net_device or "all"),
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
            await self._worker_recv(hello, _ACCEPT_TAG)
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
                try:
                    ep = await ucxx.create_endpoint_from_worker_address(
                        ucxx.get_ucx_address_from_buffer(worker_address), endpoint_error_handling=False
                    )
                except (asyncio.CancelledError, DataPlaneError):
                    raise
                except Exception as exc:  # every ucxx error (and a malformed address) is ours
                    raise _translate(exc, "cannot open a UCX endpoint to the peer") from exc
                peer = self._peers[worker_address] = _Peer(ep, worker_address, self)
        return peer

    def _forget_peer(self, peer: _Peer) -> None:
        if self._peers.get(peer.key) is peer:
            del self._peers[peer.key]

    async def _handshake(self, hello: bytes) -> None:
        magic, version, conn_id, generation, addr_len = _HELLO.unpack_from(hello)
        if magic != _HELLO_MAGIC or version != _PROTOCOL_VERSION or not 0 < addr_len <= _HELLO_BYTES - _HELLO.size:
            log.warning("dataplane_ucx_bad_hello", magic=magic, version=version, addr_len=addr_len)
            return
        peer_addr = hello[_HELLO.size : _HELLO.size + addr_len]
        try:
            peer = await self._peer_for(peer_addr)
            if not peer.pairs_with(generation):
                log.info("dataplane_ucx_peer_replaced", conn=f"{conn_id:08x}", side="acceptor")
                peer.abort()
                peer = await self._peer_for(peer_addr)
                peer.pairs_with(generation)
        except Exception as exc:
            log.warning("dataplane_ucx_accept_failed", conn=f"{conn_id:08x}", error=repr(exc))
            return
        endpoint = _UcxEndpoint(peer, conn_id, is_client=False)
        try:
            ack = np.frombuffer(_ACK.pack(self._warmup_bytes, peer.generation), np.uint8)
            await endpoint._send_raw(ack, _ACK_TAG, 10.0)
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
        endpoint = await self._connect_once(raw, timeout_s)
        if endpoint is None:  # the peer had replaced its endpoint to us: ours was stale, now reopened
            endpoint = await self._connect_once(raw, timeout_s)
        if endpoint is None:
            raise PeerUnreachable("UCX peer replaced its endpoint to us twice during one connect")
        return endpoint

    async def _connect_once(self, raw: bytes, timeout_s: float) -> _UcxEndpoint | None:
        """One handshake; None when the ack shows our shared endpoint to the peer was stale."""
        assert self._address is not None
        me = self._address[len(_ADDRESS_PREFIX) :]
        conn_id = secrets.randbits(32) or 1
        peer = await self._peer_for(raw)
        endpoint = _UcxEndpoint(peer, conn_id, is_client=True)
        hello = np.zeros(_HELLO_BYTES, dtype=np.uint8)
        packed = _HELLO.pack(_HELLO_MAGIC, _PROTOCOL_VERSION, conn_id, peer.generation, len(me)) + me
        hello[: len(packed)] = np.frombuffer(packed, np.uint8)
        try:
            # The hello goes to the peer's worker, not to a connection: raw tag, no conn id.
            await wait_for(self._send(peer.ep, hello, _ACCEPT_TAG), timeout_s)
            ack = np.zeros(_ACK.size, dtype=np.uint8)
            await endpoint._recv_raw(ack, _ACK_TAG, timeout_s)
            warmup_bytes, generation = _ACK.unpack(ack.tobytes())
            if warmup_bytes:
                # Sent through the acceptor's (possibly new) endpoint: it lands whatever ours is.
                scratch = (
                    self._warmup_buf if warmup_bytes <= self._warmup_buf.size else np.zeros(warmup_bytes, np.uint8)
                )
                await endpoint._recv_raw(scratch[:warmup_bytes], _WARMUP_TAG, timeout_s)
        except TimeoutError:
            endpoint.abort()
            raise TransferTimeout(f"UCX peer did not answer the handshake within {timeout_s}s") from None
        except (asyncio.CancelledError, DataPlaneError):
            endpoint.abort()
            raise
        except Exception as exc:  # a ucxx error posting or completing the hello
            endpoint.abort()
            raise _translate(exc, f"UCX handshake with {endpoint.peer} failed") from exc
        if not peer.pairs_with(generation):
            log.info("dataplane_ucx_peer_replaced", conn=endpoint.peer, side="connector")
            endpoint.abort()
            return None
        return endpoint

    async def accept(self, *, timeout_s: float | None = None) -> Endpoint:
        try:
            return await wait_for(self._accepted.get(), timeout_s)
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
            await wait_for(self._send(me.ep, bye, _ACCEPT_TAG), 2.0)
            await wait_for(asyncio.shield(task), 2.0)
        except (TimeoutError, DataPlaneError, ucxx.exceptions.UCXError) as exc:
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
