"""Test and benchmark support: synthetic models and data plane node processes driven over a pipe.

A *node* is a separate process (multiprocessing "spawn") with its own transport and
`GroupServer`; it can serve a synthetic model (a source) and, on command, receive groups from
other nodes. The parent drives it with `NodeProcess` over a pipe, so tests and benchmarks use
real processes and real sockets / UCX, as a worker would.
"""

from __future__ import annotations

import asyncio
import ctypes
import hashlib
import multiprocessing
import multiprocessing.connection
import os
import signal
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from services.dataplane import make_transport
from services.dataplane.chain import GroupServer, Pull, receive_groups, serve_groups
from services.dataplane.checksum import DEFAULT_CHECKSUM_ALGO
from services.dataplane.errors import DataPlaneError
from services.dataplane.manifest import GroupEntry, Manifest, pack_groups
from tests.harness import stop_node

__all__ = [
    "ModelSpec",
    "NodeProcess",
    "NodeSpec",
    "buffer_digest",
    "enter_netns",
    "start_nodes",
    "synthetic_groups",
    "synthetic_model",
]


@dataclass(frozen=True, slots=True)
class ModelSpec:
    """A synthetic model: `num_layers` layer groups of about `layer_bytes`, plus embed and head."""

    model_id: str = "synthetic"
    num_layers: int = 4
    layer_bytes: int = 1 << 20
    chunk_bytes: int = 256 * 1024
    seed: int = 0
    checksum_algo: str = DEFAULT_CHECKSUM_ALGO


_PATTERN_BLOCK_WORDS = 1 << 15  # 256 KiB of words, reused with a different mask per block


def _pattern(n_bytes: int, seed: int) -> np.ndarray:
    """Deterministic, non-repeating bytes at memory speed: one hashed 256 KiB block of words,
    XORed with a distinct hashed mask per block (so blocks never repeat)."""
    n_words = -(-n_bytes // 8)
    n_blocks = -(-n_words // _PATTERN_BLOCK_WORDS)
    mix = np.uint64(0x9E3779B97F4A7C15)
    base = np.arange(_PATTERN_BLOCK_WORDS, dtype=np.uint64) * mix
    base ^= base >> np.uint64(29)
    masks = (np.arange(n_blocks, dtype=np.uint64) + np.uint64(seed * 7919 + 1)) * np.uint64(0xD6E8FEB86659FD93)
    masks ^= masks >> np.uint64(32)
    out = np.empty((n_blocks, _PATTERN_BLOCK_WORDS), dtype=np.uint64)
    np.bitwise_xor(base[None, :], masks[:, None], out=out)
    return out.reshape(-1).view(np.uint8)[:n_bytes]


def synthetic_groups(spec: ModelSpec) -> list[tuple[str, dict[str, np.ndarray]]]:
    """HF-named tensors per group (embed, layers.i, head) filled with `_pattern` bytes."""
    groups: list[tuple[str, dict[str, np.ndarray]]] = []
    seed = spec.seed * 1000

    def tensor(n_bytes: int, dtype: str, cols: int) -> np.ndarray:
        nonlocal seed
        seed += 1
        itemsize = np.dtype(dtype).itemsize
        n = max(cols, (n_bytes // itemsize) // cols * cols)
        return _pattern(n * itemsize, seed).view(dtype).reshape(-1, cols)

    lb = spec.layer_bytes
    groups.append(("embed", {"model.embed_tokens.weight": tensor(lb // 2, "float16", 64)}))
    for i in range(spec.num_layers):
        p = f"model.layers.{i}"
        groups.append(
            (
                f"layers.{i}",
                {
                    f"{p}.self_attn.qkv_proj.weight": tensor(lb // 3, "float16", 64),
                    f"{p}.mlp.up_proj.weight": tensor(lb - lb // 3 - 4096, "float16", 64),
                    f"{p}.input_layernorm.weight": tensor(4096, "float32", 1024)[0],
                },
            )
        )
    groups.append(("head", {"lm_head.weight": tensor(lb // 2, "float16", 64)}))
    return groups


def synthetic_model(spec: ModelSpec) -> tuple[Manifest, list[np.ndarray]]:
    """Manifest and packed group buffers of the synthetic model `spec` (same spec, same bytes)."""
    return pack_groups(spec.model_id, synthetic_groups(spec), spec.chunk_bytes, spec.checksum_algo)


def buffer_digest(buf: Any) -> str:
    """Strong hash of all bytes of a buffer: equal digests mean bit-identical contents."""
    return hashlib.blake2b(np.ascontiguousarray(buf).reshape(-1).view(np.uint8).data, digest_size=16).hexdigest()


@dataclass(frozen=True, slots=True)
class NodeSpec:
    """How a node process runs: its transport and server settings, extra environment."""

    transport: str = "tcp"
    window_chunks: int = 4
    send_timeout_s: float = 10.0
    env: dict[str, str] = field(default_factory=dict)
    # Options for `make_transport` (e.g. {"host": "10.77.0.2"} for TCP inside a namespace).
    transport_options: dict[str, Any] = field(default_factory=dict)
    # A network namespace (name under /var/run/netns) the node enters before it opens any
    # socket: an emulated host (see services/mesh/netns.py). Needs root.
    netns: str | None = None
    # Without a GroupServer the node's transport is free for `stream_bytes` (the transport
    # alone: no manifest, no checksums), which needs the incoming connection for itself.
    group_server: bool = True


# -- inside the node process ----------------------------------------------------------------------


async def _next_command(conn: multiprocessing.connection.Connection) -> Any:
    loop = asyncio.get_running_loop()
    ready: asyncio.Future[None] = loop.create_future()
    fd = conn.fileno()

    def readable() -> None:
        if not ready.done():
            ready.set_result(None)

    loop.add_reader(fd, readable)
    try:
        await ready
    finally:
        loop.remove_reader(fd)
    return conn.recv()


async def _serve_synthetic(server: GroupServer, spec: ModelSpec, corrupt_group: str | None) -> tuple:
    manifest, bufs = synthetic_model(spec)
    digests = {entry.name: buffer_digest(buf) for entry, buf in zip(manifest.groups, bufs, strict=True)}
    if corrupt_group is not None:
        # The fault under test: bytes that no longer match the manifest's checksum.
        buf = bufs[manifest.group_index(corrupt_group)]
        buf[buf.size // 2] ^= 0xFF
    await serve_groups(server.transport, manifest, bufs, server=server)
    return ("served", manifest.to_bytes(), digests)


def _dump_tasks() -> None:
    """SIGUSR1: print every task's stack to stderr, to see where a stuck node waits."""
    import sys

    print(f"=== tasks of node pid={os.getpid()}", file=sys.stderr)
    for task in asyncio.all_tasks():
        task.print_stack(limit=6, file=sys.stderr)
    sys.stderr.flush()


async def _node(spec: NodeSpec, conn: multiprocessing.connection.Connection) -> None:
    asyncio.get_running_loop().add_signal_handler(signal.SIGUSR1, _dump_tasks)
    transport = make_transport(spec.transport, **spec.transport_options)  # type: ignore[arg-type]
    await transport.start()
    server = None
    if spec.group_server:
        server = GroupServer(transport, window_chunks=spec.window_chunks, send_timeout_s=spec.send_timeout_s)
        await server.start()
    conn.send(("ready", transport.address()))
    cache: dict[str, np.ndarray] = {}
    try:
        while True:
            cmd = await _next_command(conn)
            if cmd[0] == "stop":
                break
            if cmd[0] == "stream":
                try:
                    conn.send(await _stream_bytes(transport, *cmd[1:]))
                except DataPlaneError as exc:
                    conn.send(("error", type(exc).__name__, str(exc)))
            elif server is None:
                conn.send(("error", "NoGroupServer", f"command {cmd[0]!r} needs a node with a GroupServer"))
            elif cmd[0] == "serve":
                conn.send(await _serve_synthetic(server, *cmd[1:]))
            elif cmd[0] == "receive":
                conn.send(await _receive(transport, server, cache, *cmd[1:]))
    finally:
        if server is not None:
            await server.close()
        await transport.close()


async def _stream_bytes(
    transport: Any, role: str, address: bytes | None, total_bytes: int, chunk_bytes: int, window: int, rounds: int
) -> tuple:
    """Move `total_bytes` from the "send" node to the "receive" node as tagged messages of
    `chunk_bytes`, `window` in flight, `rounds` times, through the transport alone (no
    manifest, no checksums, the same buffer every round). The receiver connects to
    `address`, the sender accepts. Returns ("streamed", [seconds per round]); the receiver
    compares its bytes with the sender's once, after the last round."""
    if role == "receive":
        ep = await transport.connect(address, timeout_s=30)
    else:
        ep = await transport.accept(timeout_s=30)
    # Faulted in before the clock starts; the receiver checks the pattern after the last round.
    pattern = np.resize(np.arange(251, dtype=np.uint8), total_bytes)  # 0..250 repeated
    buf = pattern.copy() if role == "send" else np.zeros(total_bytes, np.uint8)
    go = np.zeros(8, np.uint8)

    async def sync(tag: int) -> None:
        """The receiver tells the sender, so both sides start (or end) a round together."""
        if role == "receive":
            await ep.send(go, tag, timeout_s=30)
        else:
            await ep.recv_into(go, tag, timeout_s=30)

    times: list[float] = []
    try:
        for r in range(rounds):
            await sync(1 + 2 * r)  # the receiver is about to post its first receives
            started = time.monotonic()
            inflight: list[asyncio.Future[None]] = []
            for i, offset in enumerate(range(0, total_bytes, chunk_bytes)):
                view = buf[offset : offset + chunk_bytes]
                tag = 1_000 + i
                op = ep.recv_into(view, tag, timeout_s=30) if role == "receive" else ep.send(view, tag, timeout_s=30)
                inflight.append(asyncio.ensure_future(op))
                if len(inflight) >= window:
                    await inflight.pop(0)
            await asyncio.gather(*inflight)
            times.append(time.monotonic() - started)
            await sync(2 + 2 * r)  # a round trip, so rounds do not overlap
    finally:
        await ep.close()
    if role == "receive" and not np.array_equal(buf, pattern):
        return ("error", "ProtocolError", "streamed bytes differ from the sender's")
    return ("streamed", times)


async def _receive(
    transport: Any,
    server: GroupServer,
    cache: dict[str, np.ndarray],
    manifest_bytes: bytes,
    pulls: Sequence[tuple[bytes, Sequence[str] | None, Sequence[bytes]]],
    options: dict[str, Any],
) -> tuple:
    manifest = Manifest.from_bytes(manifest_bytes)
    ready_order: list[str] = []
    die_after = options.get("die_after_groups")

    ready_at_s: list[float] = []

    def on_ready(name: str) -> None:
        ready_order.append(name)
        ready_at_s.append(round(time.monotonic() - t_start, 4))
        if die_after is not None and len(ready_order) >= die_after:
            os.kill(os.getpid(), signal.SIGKILL)  # the fault under test: die mid-transfer

    def allocate(entry: GroupEntry) -> np.ndarray:
        # With reuse_buffers, later runs land in memory already faulted in (warm numbers).
        buf = cache.get(entry.name) if options.get("reuse_buffers") else None
        if buf is None or buf.size != entry.size_bytes:
            buf = np.empty(entry.size_bytes, np.uint8)
            buf.fill(0)
            if options.get("reuse_buffers"):
                cache[entry.name] = buf
        return buf

    t_start = time.monotonic()
    try:
        result = await receive_groups(
            transport,
            manifest,
            [Pull(a, None if g is None else tuple(g), tuple(f)) for a, g, f in pulls],
            server=server,
            allocate=allocate,
            on_group_ready=on_ready,
            budget_bytes=options.get("budget_bytes"),
            stall_timeout_s=options.get("stall_timeout_s", 10.0),
            connect_timeout_s=options.get("connect_timeout_s", 10.0),
            window_chunks=options.get("window_chunks", 4),
        )
    except DataPlaneError as exc:
        return ("error", type(exc).__name__, str(exc), ready_order)
    t_done = time.monotonic()
    digests = (
        {g: buffer_digest(result.store.buffer(g)) for g in result.groups_received}
        if options.get("digests", True)
        else {}
    )
    return (
        "done",
        {
            "t_start": t_start,
            "t_done": t_done,
            "elapsed_s": result.elapsed_s,
            "bytes": result.bytes_received,
            "digests": digests,
            "ready_order": ready_order,
            "ready_at_s": ready_at_s,
            "resourced": result.resourced_groups,
            "bytes_by_source": result.bytes_by_source,
        },
    )


CLONE_NEWNET = 0x40000000
CLONE_NEWNS = 0x00020000
MS_REC = 0x4000
MS_SLAVE = 0x80000
MNT_DETACH = 0x2


def enter_netns(name: str) -> None:
    """Move this process (its calling thread, and every thread and socket made after) into the
    network namespace `name` made by `ip netns add`, as `ip netns exec` does: setns, then a
    private mount namespace with /sys remounted, so that /sys/class/net lists the namespace's
    devices (UCX finds its network devices there). Python 3.11 has no os.setns: libc's."""
    libc = ctypes.CDLL(None, use_errno=True)

    def check(rc: int, what: str) -> None:
        if rc != 0:
            err = ctypes.get_errno()
            raise OSError(err, f"{what} (network namespace {name!r}): {os.strerror(err)}")

    fd = os.open(f"/var/run/netns/{name}", os.O_RDONLY | os.O_CLOEXEC)
    try:
        check(libc.setns(fd, CLONE_NEWNET), "setns")
    finally:
        os.close(fd)
    before = os.readlink("/proc/self/ns/mnt")
    check(libc.unshare(CLONE_NEWNS), "unshare(CLONE_NEWNS)")
    if os.readlink("/proc/self/ns/mnt") == before:  # never touch the mounts of the caller's namespace
        raise OSError(f"unshare did not give a new mount namespace (network namespace {name!r})")
    # Nothing done below may propagate back to the parent's mount namespace.
    check(libc.mount(None, b"/", None, MS_REC | MS_SLAVE, None), "mount --make-rslave /")
    check(libc.umount2(b"/sys", MNT_DETACH), "umount /sys")
    check(libc.mount(name.encode(), b"/sys", b"sysfs", 0, None), "mount sysfs on /sys")


def node_main(spec: NodeSpec, conn: multiprocessing.connection.Connection) -> None:
    """Entry point of a node process."""
    if spec.netns is not None:
        enter_netns(spec.netns)  # before any socket or thread of ours exists
    os.environ.update(spec.env)
    asyncio.run(_node(spec, conn))


# -- in the parent --------------------------------------------------------------------------------


class NodeProcess:
    """A running node, driven synchronously from tests and benchmarks. Every wait is bounded."""

    def __init__(self, spec: NodeSpec, *, start_timeout_s: float = 60.0) -> None:
        ctx = multiprocessing.get_context("spawn")
        self._conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=node_main, args=(spec, child), daemon=True)
        self.proc.start()
        child.close()
        self.spec = spec
        self._start_timeout_s = start_timeout_s
        self.address: bytes = b""

    def wait_ready(self) -> NodeProcess:
        msg = self.expect(self._start_timeout_s)
        if msg[0] != "ready":
            raise RuntimeError(f"node sent {msg!r} instead of ready")
        self.address = msg[1]
        return self

    def serve(
        self, model: ModelSpec, *, corrupt_group: str | None = None, timeout_s: float = 60.0
    ) -> tuple[bytes, dict[str, str]]:
        """Make the node a source of `model`; returns (manifest bytes, blake2b digest per group)."""
        self._conn.send(("serve", model, corrupt_group))
        msg = self.expect(timeout_s)
        if msg[0] != "served":
            raise RuntimeError(f"node sent {msg!r} instead of served")
        return msg[1], msg[2]

    def expect(self, timeout_s: float) -> Any:
        """The next message from the node; TimeoutError/RuntimeError if none comes or it died."""
        deadline = time.monotonic() + timeout_s
        while True:
            if self._conn.poll(min(0.2, max(0.0, deadline - time.monotonic()))):
                try:
                    return self._conn.recv()
                except EOFError:
                    raise RuntimeError(f"node {self.proc.pid} died (exitcode {self.proc.exitcode})") from None
            if not self.proc.is_alive() and not self._conn.poll(0):
                raise RuntimeError(f"node {self.proc.pid} died (exitcode {self.proc.exitcode})")
            if time.monotonic() >= deadline:
                raise TimeoutError(f"node {self.proc.pid} sent nothing within {timeout_s}s")

    def receive(
        self,
        manifest_bytes: bytes,
        pulls: Sequence[tuple[bytes, Sequence[str] | None, Sequence[bytes]]],
        **options: Any,
    ) -> None:
        """Start a receive in the node; collect its outcome with `expect`."""
        self._conn.send(("receive", manifest_bytes, [(a, g, tuple(f)) for a, g, f in pulls], options))

    def stream(
        self, role: str, address: bytes | None, total_bytes: int, chunk_bytes: int, window: int, rounds: int
    ) -> None:
        """Start `_stream_bytes` in the node (it must have no GroupServer); collect with `expect`."""
        if role not in ("send", "receive"):
            raise ValueError(f"role must be 'send' or 'receive', got {role!r}")
        if role == "receive" and not address:
            raise ValueError("the receiving node needs the sender's address, got none")
        sizes = {"total_bytes": total_bytes, "chunk_bytes": chunk_bytes, "window": window, "rounds": rounds}
        for name, value in sizes.items():
            if value < 1:
                raise ValueError(f"{name} must be >= 1, got {value!r}")
        self._conn.send(("stream", role, address, total_bytes, chunk_bytes, window, rounds))

    def kill(self) -> None:
        if self.proc.is_alive() and self.proc.pid is not None:
            os.kill(self.proc.pid, signal.SIGKILL)
        self.proc.join(5)

    def stop(self, timeout_s: float = 10.0) -> None:
        stop_node(self.proc, self._conn, timeout_s)


def start_nodes(specs: Sequence[NodeSpec], *, timeout_s: float = 60.0) -> list[NodeProcess]:
    """Start nodes in parallel (imports overlap) and wait until each has its address."""
    nodes = [NodeProcess(s, start_timeout_s=timeout_s) for s in specs]
    try:
        for n in nodes:
            n.wait_ready()
    except BaseException:
        for n in nodes:
            n.kill()
        raise
    return nodes
