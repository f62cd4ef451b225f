"""How a SERVING partner spreads its queued requests over the loading peers that pull them
(`spread_over_peers`, ZigZag pulled): evenly under each peer's cap, so that no peer sits idle
while another holds every request."""

from __future__ import annotations

from services.worker.zigzag_pull import Peer, spread_over_peers


def peer(iid: str, layers: int, cap: int = 8) -> Peer:
    return Peer(iid, f"{iid}:1", b"dp", layers, 6, cap)


def test_requests_go_to_the_peer_holding_the_fewest_ties_to_the_most_layers() -> None:
    peers = [peer("a", 3), peer("b", 4), peer("c", 4)]
    # Queued in this order; b and c tie on layers, so the id decides between them.
    got = spread_over_peers(["r1", "r2", "r3", "r4"], peers, {})
    assert [(r, p.instance_id) for r, p in got] == [("r1", "b"), ("r2", "c"), ("r3", "a"), ("r4", "b")]


def test_what_peers_already_hold_counts_and_caps_stop_the_spread() -> None:
    peers = [peer("a", 5, cap=2), peer("b", 1, cap=3)]
    # a holds 1 of 2, b 3 of 3: one more for a, then every peer is at its cap.
    got = spread_over_peers(["r1", "r2", "r3"], peers, {"a": 1, "b": 3})
    assert [(r, p.instance_id) for r, p in got] == [("r1", "a")]
    assert spread_over_peers(["r1"], [], {}) == []
    assert spread_over_peers(["r1"], [peer("z", 2, cap=0)], {}) == []


def test_one_peer_takes_up_to_its_cap() -> None:
    got = spread_over_peers([f"r{i}" for i in range(10)], [peer("a", 2, cap=8)], {})
    assert [r for r, _ in got] == [f"r{i}" for i in range(8)]
