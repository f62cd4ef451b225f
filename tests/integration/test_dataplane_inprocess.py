"""Transports and chains in one process with real sockets / UCX: the fault paths, fast.

UCX allows one transport per process, so UCX cases connect a transport to itself.
"""

from __future__ import annotations

import asyncio
import socket
import time
from collections.abc import AsyncIterator

import numpy as np
import pytest
import torch

import services.dataplane as dataplane_pkg
from services.common.waiting import wait_until
from services.dataplane import (
    ChecksumMismatch,
    GroupServer,
    GroupStore,
    InsufficientMemory,
    ManifestMismatch,
    ModelNotHeld,
    PeerClosed,
    ProtocolError,
    Pull,
    TransferTimeout,
    Transport,
    address_label,
    fetch_manifest,
    make_transport,
    receive_chain,
    receive_groups,
    serve_groups,
)
from services.dataplane.checksum import BLOCK_BYTES
from services.dataplane.manifest import Manifest
from services.dataplane.tcp import TcpTransport
from tests.harness.dataplane_nodes import ModelSpec, synthetic_model

pytestmark = pytest.mark.timeout(60)

UCX_OK, UCX_REASON = dataplane_pkg.ucx_available()
KINDS = [
    "tcp",
    pytest.param(
        "ucx", marks=[pytest.mark.ucx, pytest.mark.skipif(not UCX_OK, reason=f"ucxx does not import: {UCX_REASON}")]
    ),
]
SPEC = ModelSpec(model_id="inproc", num_layers=4, layer_bytes=512 * 1024, chunk_bytes=BLOCK_BYTES * 2)


@pytest.fixture
async def pair(request: pytest.FixtureRequest) -> AsyncIterator[tuple[Transport, Transport]]:
    kind = getattr(request, "param", "tcp")
    a = make_transport(kind)
    await a.start()
    b = a if kind == "ucx" else make_transport(kind)
    if b is not a:
        await b.start()
    try:
        yield a, b
    finally:
        await a.close()
        if b is not a:
            await b.close()


async def _connected(a: Transport, b: Transport):  # type: ignore[no-untyped-def]
    client = await a.connect(b.address(), timeout_s=5)
    server = await b.accept(timeout_s=5)
    return client, server


# -- transports -----------------------------------------------------------------------------------


@pytest.mark.parametrize("pair", KINDS, indirect=True)
async def test_tagged_messages_land_in_caller_buffers(pair: tuple[Transport, Transport]) -> None:
    client, server = await _connected(*pair)
    payloads = {7: np.arange(300_000, dtype=np.uint8), 8: np.full(1000, 3, np.uint8), 9: np.ones(5, np.uint8)}
    # Sent before the receives are posted, in another order: matched by tag, not by arrival.
    # (A large UCX send completes only once received, so the sends run as tasks.)
    sends = [asyncio.ensure_future(client.send(payloads[tag], tag, timeout_s=5)) for tag in (9, 7, 8)]
    await asyncio.sleep(0.05)
    as_numpy = np.zeros(300_000, np.uint8)
    as_tensor = torch.zeros(1000, dtype=torch.uint8)
    as_bytearray = bytearray(5)
    await server.recv_into(as_tensor, 8, timeout_s=5)
    await server.recv_into(as_numpy, 7, timeout_s=5)
    await server.recv_into(as_bytearray, 9, timeout_s=5)
    await asyncio.gather(*sends)
    assert np.array_equal(as_numpy, payloads[7])
    assert np.array_equal(as_tensor.numpy(), payloads[8])
    assert bytes(as_bytearray) == payloads[9].tobytes()
    await server.send_msg(b"reply", 1, timeout_s=5)
    assert await client.recv_msg(1, timeout_s=5) == b"reply"
    await client.close()
    await server.close()


@pytest.mark.parametrize("pair", KINDS, indirect=True)
async def test_idle_transport_sleeps(pair: tuple[Transport, Transport]) -> None:
    """Once a transfer is over, a started transport must not use the CPU while it waits.

    ucxx's own blocking progress kept every process at a full core after the first message
    (the worker was never re-armed, and waiting requests poll with sleep(0)); the accept
    loop's standing receive and a receive posted for a message not yet sent are both here.
    """
    client, server = await _connected(*pair)
    payload = np.arange(4 << 20, dtype=np.uint8)
    landed = np.zeros_like(payload)
    await asyncio.gather(client.send(payload, 7, timeout_s=5), server.recv_into(landed, 7, timeout_s=5))
    assert np.array_equal(landed, payload)
    late = np.zeros(16, np.uint8)
    pending = asyncio.ensure_future(server.recv_into(late, 8, timeout_s=10))
    cpu_before, wall_before = time.process_time(), time.monotonic()
    await asyncio.sleep(1.0)
    cpu_s, wall_s = time.process_time() - cpu_before, time.monotonic() - wall_before
    assert cpu_s < 0.25 * wall_s, f"idle transport used {cpu_s:.2f} s of CPU in {wall_s:.2f} s"
    # The receive that waited through the idle second still completes when the message comes.
    await client.send(np.full(16, 5, np.uint8), 8, timeout_s=5)
    await pending
    assert late.tolist() == [5] * 16
    await client.close()
    await server.close()


@pytest.mark.parametrize("pair", KINDS, indirect=True)
async def test_receive_times_out_and_aborts_instead_of_hanging(pair: tuple[Transport, Transport]) -> None:
    client, _server = await _connected(*pair)
    started = time.monotonic()
    with pytest.raises(TransferTimeout, match="within 0.2s"):
        await client.recv_into(np.zeros(16, np.uint8), 3, timeout_s=0.2)
    assert time.monotonic() - started < 2.0
    assert client.closed  # the pending receive was cancelled with the endpoint
    with pytest.raises(PeerClosed):
        await client.recv_into(np.zeros(16, np.uint8), 3, timeout_s=0.2)


async def test_tcp_peer_close_fails_pending_receive(pair: tuple[Transport, Transport]) -> None:
    client, server = await _connected(*pair)
    pending = asyncio.ensure_future(client.recv_into(np.zeros(16, np.uint8), 1, timeout_s=10))
    await asyncio.sleep(0.05)
    await server.close()
    with pytest.raises(PeerClosed):
        await asyncio.wait_for(pending, 5)


async def test_tcp_size_mismatch_is_a_protocol_error(pair: tuple[Transport, Transport]) -> None:
    client, server = await _connected(*pair)
    await client.send(np.zeros(10, np.uint8), 1, timeout_s=5)
    with pytest.raises(ProtocolError, match="has 10 bytes, receive buffer has 16"):
        await server.recv_into(np.zeros(16, np.uint8), 1, timeout_s=5)


async def test_connect_to_nothing_fails_fast() -> None:
    t = make_transport("tcp")
    await t.start()
    dead = TcpTransport()
    await dead.start()
    address = dead.address()
    await dead.close()
    try:
        with pytest.raises(PeerClosed, match="cannot connect"):
            await t.connect(address, timeout_s=2)
    finally:
        await t.close()


def test_make_transport_kinds_and_options(monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    assert isinstance(make_transport("tcp"), TcpTransport)
    with pytest.raises(ValueError, match="unknown transport kind 'rdma'"):
        make_transport("rdma")  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=r"unknown transport options \['hots'\]"):
        make_transport("tcp", hots="x")
    monkeypatch.setattr(dataplane_pkg, "ucx_available", lambda: (False, "ImportError: no ucxx"))
    monkeypatch.setattr(dataplane_pkg, "_fallback_logged", False)
    with pytest.raises(dataplane_pkg.TransportUnavailable, match="no ucxx"):
        make_transport("ucx")
    assert isinstance(make_transport("auto"), TcpTransport)
    assert isinstance(make_transport("auto"), TcpTransport)
    assert dataplane_pkg._fallback_logged


# -- chains ---------------------------------------------------------------------------------------


@pytest.fixture
async def source() -> AsyncIterator[tuple[Transport, GroupServer, Manifest, list[np.ndarray]]]:
    manifest, bufs = synthetic_model(SPEC)
    t = make_transport("tcp")
    await t.start()
    server = await serve_groups(t, manifest, bufs)
    try:
        yield t, server, manifest, bufs
    finally:
        await server.close()
        await t.close()


@pytest.fixture
async def receiver() -> AsyncIterator[tuple[Transport, GroupServer]]:
    t = make_transport("tcp")
    await t.start()
    server = GroupServer(t, publish_wait_s=0.3)
    await server.start()
    try:
        yield t, server
    finally:
        await server.close()
        await t.close()


async def test_ready_groups_are_zero_copy_tensors_in_layer_order(source, receiver) -> None:  # type: ignore[no-untyped-def]
    src_t, _, manifest, bufs = source
    rt, rserver = receiver
    ready: list[str] = []
    result = await receive_chain(
        rt, src_t.address(), manifest, server=rserver, on_group_ready=ready.append, stall_timeout_s=5
    )
    assert ready == manifest.group_names
    assert result.store.ready_prefix() == len(manifest.groups)
    assert result.bytes_received == manifest.total_bytes
    for gi, entry in enumerate(manifest.groups):
        assert np.array_equal(result.store.buffer(entry.name), bufs[gi])
        tensors = result.store.tensors(entry.name)
        first = entry.tensors[0]
        assert tensors[first.name].data_ptr() == result.store.buffer(entry.name).ctypes.data + first.offset_bytes


async def test_manifest_mismatch_is_named_and_nothing_usable(source, receiver) -> None:  # type: ignore[no-untyped-def]
    src_t, _, _, _ = source
    rt, _ = receiver
    other, _ = synthetic_model(
        ModelSpec(model_id=SPEC.model_id, num_layers=4, layer_bytes=512 * 1024, chunk_bytes=BLOCK_BYTES * 2, seed=99)
    )
    store = GroupStore(other)
    with pytest.raises(ManifestMismatch, match="group 'embed' checksum"):
        await receive_chain(rt, src_t.address(), store, stall_timeout_s=5)
    assert store.ready_groups() == []


async def test_wrong_model_is_not_held_not_a_manifest_mismatch(source, receiver) -> None:  # type: ignore[no-untyped-def]
    """A source without the model answers ModelNotHeld (retryable), never ManifestMismatch,
    which is kept for a real digest mismatch."""
    src_t, src_server, _, _ = source
    rt, _ = receiver
    src_server._publish_wait_s = 0.2
    wrong, _ = synthetic_model(ModelSpec(model_id="not-here", num_layers=1, layer_bytes=BLOCK_BYTES))
    with pytest.raises(ModelNotHeld, match="'not-here' is not served here"):
        await receive_chain(rt, src_t.address(), wrong, stall_timeout_s=5)
    with pytest.raises(ModelNotHeld, match="not served here"):
        await fetch_manifest(rt, src_t.address(), "not-here", timeout_s=5)
    assert await fetch_manifest(rt, src_t.address(), SPEC.model_id, timeout_s=5) == (await _manifest())


async def _manifest() -> Manifest:
    return synthetic_model(SPEC)[0]


async def test_budget_and_allocation_failures_are_insufficient_memory(source, receiver) -> None:  # type: ignore[no-untyped-def]
    src_t, _, manifest, _ = source
    rt, _ = receiver
    calls: list[str] = []
    with pytest.raises(InsufficientMemory, match=f"needs {manifest.total_bytes} bytes, budget is 1000"):
        await receive_chain(rt, src_t.address(), manifest, budget_bytes=1000, allocate=lambda e: calls.append(e.name))  # type: ignore[func-returns-value]
    assert calls == []  # refused before anything was allocated or moved

    def no_memory(entry):  # type: ignore[no-untyped-def]
        raise MemoryError("simulated")

    with pytest.raises(InsufficientMemory, match="simulated"):
        await receive_chain(rt, src_t.address(), manifest, allocate=no_memory, stall_timeout_s=5)


async def test_checksum_mismatch_leaves_only_verified_groups_usable(receiver) -> None:  # type: ignore[no-untyped-def]
    manifest, bufs = synthetic_model(SPEC)
    bufs[2][123] ^= 0x01  # corrupt layers.1 after the manifest was made
    t = make_transport("tcp")
    await t.start()
    server = await serve_groups(t, manifest, bufs)
    rt, _ = receiver
    store = GroupStore(manifest)
    try:
        with pytest.raises(ChecksumMismatch, match="group 'layers.1'") as info:
            await receive_chain(rt, t.address(), store, stall_timeout_s=5)
        assert info.value.group == "layers.1"
        assert not store.is_ready("layers.1")
        assert store.ready_prefix() <= 2
        with pytest.raises(KeyError, match="not usable"):
            store.tensors("layers.1")
    finally:
        await server.close()
        await t.close()


async def test_parameter_streams_go_at_the_emulated_parameter_link(receiver) -> None:  # type: ignore[no-untyped-def]
    """`stream_gbps` (a model emulated with more bytes than it has): the server's parameter
    streams leave at most that fast, every byte intact; without it the same stream is faster
    than that rate, and a negative rate is refused quoting it."""
    manifest, bufs = synthetic_model(SPEC)  # 4 layers of 512 KiB, plus embedding and head
    rt, _ = receiver
    gbps = 8 * manifest.total_bytes / 0.5 / 1e9  # the whole model in 0.5 s
    elapsed: dict[float, float] = {}
    for rate in (gbps, 0.0):
        t = make_transport("tcp")
        await t.start()
        server = GroupServer(t, stream_gbps=rate)
        await server.start()
        await serve_groups(t, manifest, bufs, server=server)
        try:
            started = time.monotonic()
            result = await receive_chain(rt, t.address(), manifest, stall_timeout_s=5)
            elapsed[rate] = time.monotonic() - started
            for i, g in enumerate(manifest.groups):
                assert bytes(result.store.buffer(g.name)) == bytes(np.asarray(bufs[i]).view(np.uint8)), g.name
        finally:
            await server.close()
            await t.close()
    assert elapsed[gbps] >= 0.5 * 0.95, elapsed
    assert elapsed[0.0] < elapsed[gbps], elapsed
    with pytest.raises(ValueError, match="stream_gbps must be >= 0 .* got -1.0"):
        GroupServer(rt, stream_gbps=-1.0)


async def test_a_chunk_corrupted_on_the_wire_is_fetched_again(receiver) -> None:  # type: ignore[no-untyped-def]
    """A flipped byte in flight (CorruptingTransport on the source, one chunk): the receiver's
    checksum catches it, the group is fetched again from the same source, and every byte
    arrives right; the middle hop of a chain that forwarded the bad bytes does the same."""
    from services.dataplane.faults import CorruptingTransport

    manifest, bufs = synthetic_model(SPEC)
    src = CorruptingTransport(make_transport("tcp"), 1, min_bytes=BLOCK_BYTES)
    await src.start()
    server = await serve_groups(src, manifest, bufs)
    rt, r_server = receiver
    tail_t = make_transport("tcp")
    await tail_t.start()
    try:
        first = asyncio.create_task(receive_chain(rt, src.address(), manifest, server=r_server, stall_timeout_s=5))
        second = asyncio.create_task(receive_chain(tail_t, rt.address(), manifest, stall_timeout_s=5))
        results = await asyncio.gather(first, second)
        assert src.corruptions_left == 0  # one chunk really went out corrupted
        assert results[0].refetched_groups, "the hop next to the corruption fetched a group again"
        for result in results:
            for i, g in enumerate(manifest.groups):
                assert bytes(result.store.buffer(g.name)) == bytes(np.asarray(bufs[i]).view(np.uint8)), g.name
    finally:
        await server.close()
        await src.close()
        await tail_t.close()


async def test_stalled_upstream_is_resourced_from_fallback_exactly(source, receiver) -> None:  # type: ignore[no-untyped-def]
    src_t, _, manifest, bufs = source
    rt, _ = receiver
    # A "hop" that got embed and half of layers.0 and then went silent (as a dead UCX peer is).
    hop_t = make_transport("tcp")
    await hop_t.start()
    hop_server = GroupServer(hop_t)
    await hop_server.start()
    stuck = GroupStore(manifest)
    stuck.expect(range(len(manifest.groups)))  # type: ignore[arg-type]
    for gi, buf in enumerate(bufs):
        stuck.set_buffer(gi, buf.copy())
    stuck.mark_landed(0, manifest.groups[0].size_bytes)
    stuck.mark_landed(1, manifest.chunk_bytes)
    hop_server.publish(stuck)
    try:
        started = time.monotonic()
        result = await receive_chain(
            rt, hop_t.address(), manifest, fallback_addresses=[src_t.address()], stall_timeout_s=0.5
        )
        assert time.monotonic() - started < 5
        assert result.resourced_groups == manifest.group_names[1:]
        by_source = result.bytes_by_source
        assert sum(by_source.values()) == manifest.total_bytes  # every byte exactly once
        assert by_source[address_label(hop_t.address())] == manifest.groups[0].size_bytes + manifest.chunk_bytes
        for gi, entry in enumerate(manifest.groups):
            assert np.array_equal(result.store.buffer(entry.name), bufs[gi])
    finally:
        await hop_server.close()
        await hop_t.close()


async def test_failed_hop_tells_downstream_which_falls_back(source, receiver) -> None:  # type: ignore[no-untyped-def]
    src_t, _, manifest, bufs = source
    rt, _ = receiver
    hop_t = make_transport("tcp")
    await hop_t.start()
    hop_server = GroupServer(hop_t)
    await hop_server.start()
    failing = GroupStore(manifest)
    failing.expect(range(len(manifest.groups)))  # type: ignore[arg-type]
    hop_server.publish(failing)
    try:
        task = asyncio.ensure_future(
            receive_chain(rt, hop_t.address(), manifest, fallback_addresses=[src_t.address()], stall_timeout_s=30)
        )
        await asyncio.sleep(0.2)
        failing.fail(RuntimeError("upstream of the hop died"))
        result = await asyncio.wait_for(task, 10)  # far below the 30 s stall timeout
        assert result.resourced_groups == manifest.group_names
    finally:
        await hop_server.close()
        await hop_t.close()


async def test_sharded_sources_with_all_gather_between_targets(source) -> None:  # type: ignore[no-untyped-def]
    src_t, _, manifest, bufs = source
    second = make_transport("tcp")
    await second.start()
    second_server = await serve_groups(second, manifest, bufs)
    targets = [make_transport("tcp") for _ in range(2)]
    servers = []
    for t in targets:
        await t.start()
        servers.append(GroupServer(t))
        await servers[-1].start()
    names = manifest.group_names
    first_half, second_half = tuple(names[: len(names) // 2]), tuple(names[len(names) // 2 :])
    try:
        results = await asyncio.gather(
            receive_groups(
                targets[0],
                manifest,
                [Pull(src_t.address(), first_half), Pull(targets[1].address(), second_half)],
                server=servers[0],
                stall_timeout_s=5,
            ),
            receive_groups(
                targets[1],
                manifest,
                [Pull(second.address(), second_half), Pull(targets[0].address(), first_half)],
                server=servers[1],
                stall_timeout_s=5,
            ),
        )
        for r in results:
            assert r.store.ready_prefix() == len(names)
            for gi, entry in enumerate(manifest.groups):
                assert np.array_equal(r.store.buffer(entry.name), bufs[gi])
        with pytest.raises(ValueError, match="requested from both"):
            await receive_groups(targets[0], manifest, [Pull(src_t.address()), Pull(second.address(), first_half)])
    finally:
        for s in (*servers, second_server):
            await s.close()
        for t in (*targets, second):
            await t.close()


async def test_source_that_never_answers_times_out(receiver) -> None:  # type: ignore[no-untyped-def]
    rt, _ = receiver
    # A listener that accepts connections and never says a word.
    silent = socket.socket()
    silent.bind(("127.0.0.1", 0))
    silent.listen(4)
    port = silent.getsockname()[1]
    address = b'TCP1{"host": "127.0.0.1", "port": %d}' % port
    manifest, _ = synthetic_model(SPEC)
    try:
        started = time.monotonic()
        with pytest.raises(TransferTimeout):
            await receive_chain(rt, address, manifest, stall_timeout_s=0.3)
        assert time.monotonic() - started < 5
    finally:
        silent.close()


def _dead_tcp_address() -> bytes:
    """The address of a port nothing listens on (a source that died, or restarted elsewhere)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    return b'TCP1{"host": "127.0.0.1", "port": %d}' % port


async def test_a_restarted_source_is_found_at_its_new_address(source, receiver) -> None:  # type: ignore[no-untyped-def]
    """Upstream and planned fallback both gone (a host cache restarted: the plan holds its old
    address): with `relocate`, the next fallback round asks where the missing groups are now
    and pulls them there, exactly; without it, the load fails with every source named."""
    src_t, _, manifest, bufs = source
    rt, _ = receiver
    gone, stale = _dead_tcp_address(), _dead_tcp_address()
    asked: list[list[str]] = []

    async def relocate(groups):  # type: ignore[no-untyped-def]
        asked.append(list(groups))
        return [src_t.address()]

    pull = Pull(gone, None, (stale,))
    result = await receive_groups(rt, manifest, [pull], fallback_rounds=2, relocate=relocate, stall_timeout_s=5)
    assert asked == [manifest.group_names]  # once: the first round found them
    assert result.bytes_received == manifest.total_bytes
    for gi, entry in enumerate(manifest.groups):
        assert np.array_equal(result.store.buffer(entry.name), bufs[gi])
    assert result.bytes_by_source == {address_label(src_t.address()): manifest.total_bytes}

    with pytest.raises(Exception, match="every source failed") as failed:
        await receive_groups(rt, manifest, [pull], fallback_rounds=2, stall_timeout_s=5)
    assert address_label(stale) in str(failed.value)


async def test_empty_group_is_ready_without_bytes(receiver) -> None:  # type: ignore[no-untyped-def]
    from services.dataplane.manifest import pack_groups

    manifest, bufs = pack_groups(
        "empty",
        [("embed", {"w": np.ones(10, np.float32)}), ("layers.0", {}), ("head", {"w": np.zeros(0, np.float16)})],
        chunk_bytes=BLOCK_BYTES,
    )
    t = make_transport("tcp")
    await t.start()
    server = await serve_groups(t, manifest, bufs)
    rt, _ = receiver
    try:
        result = await receive_chain(rt, t.address(), manifest, stall_timeout_s=5)
        assert result.store.ready_groups() == ["embed", "layers.0", "head"]
    finally:
        await server.close()
        await t.close()


# -- a source that is gone -----------------------------------------------------------------------


async def test_a_hop_that_dropped_the_model_answers_at_once_and_the_fallback_is_used(source, receiver) -> None:  # type: ignore[no-untyped-def]
    """A hop whose own load failed drops the model (unpublish): the hop after it hears
    "not held" at once (not after publish_wait_s, 30 s here, and not as a ManifestMismatch)
    and resumes from its fallback. So does a request already waiting for the model there."""
    src_t, _, manifest, bufs = source
    rt, _ = receiver
    hop_t = make_transport("tcp")
    await hop_t.start()
    hop_server = GroupServer(hop_t, publish_wait_s=30)
    await hop_server.start()
    dropped = GroupStore(manifest)
    dropped.expect(range(len(manifest.groups)))  # type: ignore[arg-type]
    hop_server.publish(dropped)
    hop_server.unpublish(manifest.model_id)
    try:
        started = time.monotonic()
        result = await asyncio.wait_for(
            receive_chain(rt, hop_t.address(), manifest, fallback_addresses=[src_t.address()], stall_timeout_s=30),
            10,
        )
        assert time.monotonic() - started < 5
        assert result.resourced_groups == manifest.group_names
        assert result.bytes_by_source == {address_label(src_t.address()): manifest.total_bytes}
        for gi, entry in enumerate(manifest.groups):
            assert np.array_equal(result.store.buffer(entry.name), bufs[gi])
        with pytest.raises(ModelNotHeld, match="dropped"):
            await asyncio.wait_for(fetch_manifest(rt, hop_t.address(), manifest.model_id, timeout_s=5), 5)
        # Published again (a later load) it is served; a request that waits for a model (a hop
        # asked before its LoadParameters came) is answered "not held" when that model is dropped.
        waiting = asyncio.ensure_future(fetch_manifest(rt, hop_t.address(), "later", timeout_s=40))
        later, _ = synthetic_model(ModelSpec(model_id="later", num_layers=1, layer_bytes=BLOCK_BYTES))
        deadline = time.monotonic() + 5
        while "later" not in hop_server._published:  # the request is waiting for the model there
            assert time.monotonic() < deadline, "the request for 'later' never reached the hop"
            await asyncio.sleep(0.01)
        hop_server.publish(GroupStore(later))
        assert (await asyncio.wait_for(waiting, 5)) == later
        hop_server.unpublish("later")
        with pytest.raises(ModelNotHeld):
            await asyncio.wait_for(fetch_manifest(rt, hop_t.address(), "later", timeout_s=5), 5)
    finally:
        await hop_server.close()
        await hop_t.close()


_UCX_CHILD = """
import asyncio, sys
from services.dataplane.ucx import UcxTransport
async def main():
    t = UcxTransport()
    await t.start()
    sys.stdout.write("ADDR:" + t.address().hex() + "\\n")
    sys.stdout.flush()
    await asyncio.sleep(3600)
asyncio.run(main())
"""


async def _dead_ucx_address() -> bytes:
    """The UCX address of a process that was SIGKILLed after starting its transport."""
    import subprocess
    import sys

    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-c", _UCX_CHILD, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL
    )
    assert proc.stdout is not None
    try:
        async with asyncio.timeout(30):
            while True:
                line = (await proc.stdout.readline()).decode()
                assert line, "the UCX child exited before printing its address"
                if line.startswith("ADDR:"):
                    return bytes.fromhex(line[5:].strip())
    finally:
        proc.kill()
        await proc.wait()


@pytest.mark.ucx
@pytest.mark.skipif(not UCX_OK, reason=f"ucxx does not import: {UCX_REASON}")
async def test_ucx_dead_source_is_a_data_plane_error_and_the_fallback_is_used() -> None:
    """A chain source SIGKILLed before its target connects: the ucxx error of the connect
    (UCXXShmemSegmentError on one host) comes out as PeerUnreachable, a data-plane error, and
    the pull goes on from its fallback at once (no stall timeout, no escape as UNKNOWN)."""
    from services.dataplane import PeerUnreachable, TransportError

    dead = await _dead_ucx_address()
    manifest, bufs = synthetic_model(SPEC)
    t = make_transport("ucx")
    await t.start()
    server = await serve_groups(t, manifest, bufs)  # the fallback: this process (UCX to itself)
    try:
        with pytest.raises(TransportError) as info:
            await asyncio.wait_for(t.connect(dead, timeout_s=3), 10)
        assert isinstance(info.value, (PeerUnreachable, TransferTimeout)), repr(info.value)
        started = time.monotonic()
        result = await asyncio.wait_for(
            receive_chain(t, dead, GroupStore(manifest), fallback_addresses=[t.address()], stall_timeout_s=30), 20
        )
        assert time.monotonic() - started < 10
        assert result.resourced_groups == manifest.group_names
        for gi, entry in enumerate(manifest.groups):
            assert np.array_equal(result.store.buffer(entry.name), bufs[gi])
    finally:
        await server.close()
        await t.close()


_UCX_ECHO_CHILD = """
import asyncio, sys
import numpy as np
from services.dataplane.ucx import UcxTransport
async def serve(ep):
    buf = np.zeros(1 << 20, np.uint8)
    try:
        while True:
            await ep.recv_into(buf, 5, timeout_s=None)
            await ep.send(buf, 6, timeout_s=30)
    except Exception:
        pass
async def main():
    t = UcxTransport()
    await t.start()
    sys.stdout.write("ADDR:" + t.address().hex() + "\\n")
    sys.stdout.flush()
    while True:
        ep = await t.accept()
        asyncio.get_running_loop().create_task(serve(ep))
asyncio.run(main())
"""


@pytest.mark.ucx
@pytest.mark.skipif(not UCX_OK, reason=f"ucxx does not import: {UCX_REASON}")
async def test_ucx_reconnect_after_our_abort_is_served_at_once() -> None:
    """We abort our endpoint to a live peer (as a receiver does when a chunk is late): the peer
    still holds its endpoint paired with the one we dropped, and a rendezvous sent through it
    can never complete (seen after a worker's SIGKILL: every retry to the host cache was
    cancelled until the cache's own 10 s send timeout, so a reload took ~20 s). The hello names
    our endpoint's generation, the peer replaces its stale endpoint, and the next connection
    moves 1 MiB both ways at once."""
    import subprocess
    import sys

    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-c", _UCX_ECHO_CHILD, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL
    )
    assert proc.stdout is not None
    t = make_transport("ucx")
    await t.start()
    try:
        async with asyncio.timeout(30):
            line = ""
            while not line.startswith("ADDR:"):
                line = (await proc.stdout.readline()).decode()
                assert line, "the UCX child exited before printing its address"
        peer = bytes.fromhex(line[5:].strip())
        payload = np.arange(1 << 20, dtype=np.uint8)
        echo = np.zeros_like(payload)
        for attempt in range(3):
            started = time.monotonic()
            ep = await t.connect(peer, timeout_s=5)
            await ep.send(payload, 5, timeout_s=5)
            await ep.recv_into(echo, 6, timeout_s=5)
            assert np.array_equal(echo, payload), f"attempt {attempt}: the echo differs"
            assert time.monotonic() - started < 4, f"attempt {attempt} took {time.monotonic() - started:.1f}s"
            echo[:] = 0
            ep.abort()  # drop our endpoint to the peer, as a timed-out receive does
    finally:
        proc.kill()
        await proc.wait()
        await t.close()


_UCX_SLOW_SOURCE_CHILD = """
import asyncio, sys
from services.dataplane import serve_groups
from services.dataplane.shaped import maybe_shaped
from services.dataplane.ucx import UcxTransport
from tests.harness.dataplane_nodes import synthetic_model
from tests.integration.test_dataplane_inprocess import SPEC
async def main():
    manifest, bufs = synthetic_model(SPEC)
    t = maybe_shaped(UcxTransport(), 0.004)  # ~2 MiB in ~4 s: the kill lands mid-stream
    await t.start()
    await serve_groups(t, manifest, bufs)
    sys.stdout.write("ADDR:" + t.address().hex() + "\\n")
    sys.stdout.flush()
    await asyncio.sleep(3600)
asyncio.run(main())
"""


@pytest.mark.ucx
@pytest.mark.skipif(not UCX_OK, reason=f"ucxx does not import: {UCX_REASON}")
async def test_ucx_source_killed_mid_stream_is_found_by_probe_not_stall() -> None:
    """A chain source SIGKILLed mid-stream over UCX, which cannot see a dead peer: the receiver
    probes its silent upstream, gets no answer, and moves to the fallback well before the stall
    timeout (10 s here), with every byte exact. (A live upstream answers the probe: the stalled
    in-process hop above is still given the whole stall timeout.)"""
    import signal
    import subprocess
    import sys

    manifest, bufs = synthetic_model(SPEC)
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-c", _UCX_SLOW_SOURCE_CHILD, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL
    )
    assert proc.stdout is not None
    t = make_transport("ucx")
    await t.start()
    fallback = await serve_groups(t, manifest, bufs)  # this process, UCX to itself
    try:
        async with asyncio.timeout(30):
            line = ""
            while not line.startswith("ADDR:"):
                line = (await proc.stdout.readline()).decode()
                assert line, "the source child exited before printing its address"
        store = GroupStore(manifest)
        pull = asyncio.create_task(
            receive_chain(
                t, bytes.fromhex(line[5:].strip()), store, fallback_addresses=[t.address()], stall_timeout_s=10
            )
        )
        await wait_until(lambda: store.landed_bytes(0) > 0 or pull.done(), 20, what="the first chunk from the source")
        assert not pull.done(), "the stream ended before the kill: nothing was in flight"
        proc.send_signal(signal.SIGKILL)
        killed = time.monotonic()
        result = await asyncio.wait_for(pull, 30)
        assert time.monotonic() - killed < 8, "the dead source was found by the stall timeout, not the probe"
        assert result.resourced_groups, "nothing was re-sourced from the fallback"
        for gi, entry in enumerate(manifest.groups):
            assert np.array_equal(result.store.buffer(entry.name), bufs[gi])
    finally:
        if proc.returncode is None:
            proc.kill()
        await proc.wait()
        await fallback.close()
        await t.close()
