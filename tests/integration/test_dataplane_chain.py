"""Chains across real processes (multiprocessing spawn) on one host, over TCP and UCX.

Each transport gets one small cluster (a source, three receivers, a spare) for the module; every
test serves its own model id, so no test can be satisfied by a store left by another.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from services.dataplane import ucx_available
from tests.harness.dataplane_nodes import ModelSpec, NodeProcess, NodeSpec, start_nodes

pytestmark = pytest.mark.timeout(120)

UCX_OK, UCX_REASON = ucx_available()
TRANSPORTS = [
    "tcp",
    pytest.param(
        "ucx", marks=[pytest.mark.ucx, pytest.mark.skipif(not UCX_OK, reason=f"ucxx does not import: {UCX_REASON}")]
    ),
]
WAIT_S = 60.0


def _model(model_id: str) -> ModelSpec:
    # 8 groups of ~1.5 MiB in 256 KiB chunks: several chunks per group, quick to move.
    return ModelSpec(model_id=model_id, num_layers=6, layer_bytes=1536 * 1024, chunk_bytes=256 * 1024)


@pytest.fixture(scope="module", params=TRANSPORTS)
def cluster(request: pytest.FixtureRequest) -> Iterator[tuple[str, list[NodeProcess]]]:
    """A source, three receivers and a spare (the one the kill test kills), started together."""
    kind = request.param
    nodes = start_nodes([NodeSpec(transport=kind, send_timeout_s=5.0) for _ in range(5)])
    try:
        yield kind, nodes
    finally:
        for n in nodes:
            n.stop()


def _done(node: NodeProcess) -> dict:
    msg = node.expect(WAIT_S)
    assert msg[0] == "done", f"receive failed: {msg}"
    return msg[1]


def test_one_hop_is_bit_identical(cluster: tuple[str, list[NodeProcess]]) -> None:
    kind, (source, r1, _, _, _) = cluster
    manifest, digests = source.serve(_model(f"one-hop-{kind}"))
    r1.receive(manifest, [(source.address, None, ())])
    out = _done(r1)
    assert out["digests"] == digests
    assert sorted(out["ready_order"]) == sorted(digests)
    assert out["resourced"] == []


def test_chain_of_three_receivers_is_bit_identical(cluster: tuple[str, list[NodeProcess]]) -> None:
    kind, (source, r1, r2, r3, _) = cluster
    manifest, digests = source.serve(_model(f"chain-{kind}"))
    # Started downstream first: a hop asked before it has the model must wait, not fail.
    r3.receive(manifest, [(r2.address, None, ())])
    r2.receive(manifest, [(r1.address, None, ())])
    r1.receive(manifest, [(source.address, None, ())])
    for node in (r1, r2, r3):
        out = _done(node)
        assert out["digests"] == digests
        assert len(out["ready_order"]) == len(digests)


def test_sharded_sources_and_all_gather(cluster: tuple[str, list[NodeProcess]]) -> None:
    kind, (source, r1, r2, r3, _) = cluster
    manifest, digests = source.serve(_model(f"shard-{kind}"))
    r3.serve(_model(f"shard-{kind}"))  # a second source holding the same model
    names = list(digests)
    evens, odds = names[0::2], names[1::2]
    # r1 gets the even groups from one source, r2 the odd ones from the other, and each
    # all-gathers the rest from its peer while that peer is still receiving them.
    r1.receive(manifest, [(source.address, evens, ()), (r2.address, odds, ())])
    r2.receive(manifest, [(r3.address, odds, ()), (r1.address, evens, ())])
    for node in (r1, r2):
        assert _done(node)["digests"] == digests


def test_killed_middle_hop_tail_finishes_from_fallback(cluster: tuple[str, list[NodeProcess]]) -> None:
    kind, (source, r1, _, r3, victim) = cluster
    manifest, digests = source.serve(_model(f"kill-{kind}"))
    r1.receive(manifest, [(source.address, None, ())])
    # The victim SIGKILLs itself once 2 of its 8 groups are usable: mid-transfer.
    victim.receive(manifest, [(r1.address, None, ())], die_after_groups=2)
    r3.receive(manifest, [(victim.address, None, (source.address,))], stall_timeout_s=1.5, connect_timeout_s=3.0)
    assert _done(r1)["digests"] == digests
    out = _done(r3)
    assert out["digests"] == digests
    assert out["resourced"], "the tail should have re-sourced groups from the fallback"
    victim.proc.join(10)
    assert victim.proc.exitcode == -9


def test_checksum_mismatch_is_reported_and_group_not_usable(cluster: tuple[str, list[NodeProcess]]) -> None:
    kind, (source, r1, _, _, _) = cluster
    manifest, _ = source.serve(_model(f"corrupt-{kind}"), corrupt_group="layers.1")
    r1.receive(manifest, [(source.address, None, ())])
    msg = r1.expect(WAIT_S)
    assert msg[0] == "error" and msg[1] == "ChecksumMismatch", msg
    assert "layers.1" in msg[2]
    assert "layers.1" not in msg[3]  # never announced usable


@pytest.mark.parametrize("kind", TRANSPORTS)
def test_transport_stream_between_nodes_without_group_server(kind: str) -> None:
    """The benchmark's like-for-like with ucx_perftest: bytes through the transport alone."""
    sender, receiver = start_nodes([NodeSpec(transport=kind, group_server=False) for _ in range(2)])
    try:
        total, chunk = 6 * 1024 * 1024 + 12345, 1024 * 1024  # a short last message too
        sender.stream("send", None, total, chunk, 3, 2)
        receiver.stream("receive", sender.address, total, chunk, 3, 2)
        got, sent = receiver.expect(WAIT_S), sender.expect(WAIT_S)
        # The receiver checked every byte against the sender's pattern before answering.
        assert got[0] == "streamed", got
        assert sent[0] == "streamed", sent
        assert len(got[1]) == 2 and all(t > 0 for t in got[1])
        # Bad arguments are refused before anything is sent to a node, naming the value.
        with pytest.raises(ValueError, match="'recieve'"):
            receiver.stream("recieve", sender.address, total, chunk, 3, 1)
        with pytest.raises(ValueError, match="chunk_bytes must be >= 1, got 0"):
            receiver.stream("receive", sender.address, total, 0, 3, 1)
        # A node without a GroupServer refuses the commands that need one, and stays up.
        sender.receive(b"{}", [])
        refused = sender.expect(WAIT_S)
        assert refused[0] == "error" and "GroupServer" in refused[2]
    finally:
        sender.stop()
        receiver.stop()
