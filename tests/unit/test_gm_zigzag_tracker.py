"""ZigZag's pure state (`ZigzagTracker`): going live, stalls, the route split, pull peers, the
end of a load and its hand-back, and one set of defaults shared by the manager's config and the
simulator."""

from __future__ import annotations

import dataclasses
import math

import pytest

from bench.simulate.cluster import RunConfig
from services.global_manager.config import GlobalManagerConfig
from services.global_manager.core import zigzag as zz
from services.global_manager.core.reconcile import release_report
from services.global_manager.core.types import InstanceView
from tests.unit.test_gm_zigzag import C, S, view


def test_the_manager_and_the_simulator_share_the_core_defaults() -> None:
    core = zz.ZigzagSettings()
    gm = GlobalManagerConfig()
    assert (gm.zigzag_live, gm.zigzag_ttft_s, gm.zigzag_stall_s) == (core.live, core.ttft_s, core.stall_s)
    assert gm.zigzag_pull_limit == core.pull_limit == 8
    sim = RunConfig.__dataclass_fields__
    assert (sim["zigzag_live"].default, sim["zigzag_ttft_s"].default, sim["zigzag_stall_s"].default) == (
        core.live,
        core.ttft_s,
        core.stall_s,
    )
    assert gm.zigzag_dispatch == sim["zigzag_dispatch"].default == core.dispatch == "pull"
    assert gm.zigzag_hand_back_wait_s == sim["zigzag_hand_back_wait_s"].default == core.hand_back_wait_s == 5.0
    assert (core.live, core.ttft_s) == ("all", 1.0)


@pytest.mark.parametrize(
    ("field", "bad", "match"),
    [
        ("live", "some", "live must be 'all' or 'tails', got 'some'"),
        ("ttft_s", 0.0, "ttft_s must be None or finite and > 0, got 0.0"),
        ("stall_s", float("nan"), "stall_s must be finite and > 0, got nan"),
        ("limit_floor", 5, "limit_floor <= limit_start, got 5, 4"),
        ("pull_limit", -1, "pull_limit must be >= 0, got -1"),
        ("dispatch", "push", "dispatch must be 'route' or 'pull', got 'push'"),
    ],
)
def test_settings_reject_bad_values(field: str, bad: object, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        zz.ZigzagSettings(**{field: bad})  # type: ignore[arg-type]


def test_a_load_goes_live_with_its_first_layer_and_reports_its_layers() -> None:
    t = zz.ZigzagTracker()
    assert t.load_progress(0.0, "n", "m", 0, 8).effects == ()
    step = t.load_progress(1.0, "n", "m", 1, 8)
    assert step.effects == (zz.WentLive("n", "m", 1, 8, chain_tail=False), zz.LiveLayers("n", 1))
    assert t.started == {"n": 1.0}
    assert t.load_progress(2.0, "n", "m", 3, 8).effects == (zz.LiveLayers("n", 3),)
    assert t.started == {"n": 1.0}  # went live once


def test_with_tails_only_a_chain_tail_goes_live() -> None:
    t = zz.ZigzagTracker(zz.ZigzagSettings(live="tails"))
    t.chain_tails(["tail"])
    assert t.load_progress(0.0, "mid", "m", 2, 8).effects == ()
    assert t.load_progress(0.0, "tail", "m", 2, 8).effects[0] == zz.WentLive("tail", "m", 2, 8, chain_tail=True)
    assert set(t.started) == {"tail"}


def test_a_stalled_load_stops_serving_until_its_next_layer() -> None:
    t = zz.ZigzagTracker(zz.ZigzagSettings(stall_s=5.0))
    t.load_progress(0.0, "n", "m", 1, 8)
    assert t.expire_stalled(5.0).effects == ()  # exactly stall_s: not yet
    (stopped,) = t.expire_stalled(5.5).effects
    assert isinstance(stopped, zz.StoppedLive) and stopped.stalled and stopped.model == "m"
    assert "no new layer for 5.5s > zigzag_stall_s=5.0" in stopped.reason
    assert t.started == {}
    assert t.load_progress(6.0, "n", "m", 2, 8).effects[0] == zz.WentLive("n", "m", 2, 8, chain_tail=False)


def test_the_end_of_a_load_forgets_it() -> None:
    t = zz.ZigzagTracker()
    t.load_progress(0.0, "n", "m", 1, 8)
    t.partner["n"] = "a"
    assert t.load_done("n").effects == (zz.StoppedLive("n", "m", stalled=False, reason="load ended"),)
    assert (t.started, t.partner, t.progress) == ({}, {}, {})
    assert t.load_done("n").effects == ()  # twice is harmless


def overloaded_pool() -> list[InstanceView]:
    return [
        view("n", S.LOADING, role=C, layers=3),
        view("a", role=C, waiting=2, kv_used=300),
        view("b", role=C, waiting=1, kv_used=100),
    ]


def test_route_splits_at_k_with_the_overloaded_partner_and_pairs_once() -> None:
    t = zz.ZigzagTracker()
    t.load_progress(0.0, "n", "m", 3, 8)
    step = t.route(0.1, overloaded_pool(), "m", C, excluded=(), reachable={"n"})
    assert step.split is not None
    assert (step.split.new.instance_id, step.split.partner.instance_id, step.split.k, step.split.num_layers) == (
        "n",
        "b",
        3,
        8,
    )
    (paired,) = step.effects
    assert isinstance(paired, zz.Paired) and (paired.instance_id, paired.partner_id) == ("n", "b")
    again = t.route(0.2, overloaded_pool(), "m", C, excluded=(), reachable={"n"})
    assert again.split is not None and again.effects == ()  # the same pair is not announced twice


def test_route_gives_no_split_when_the_gate_is_shut_unreachable_or_excluded() -> None:
    t = zz.ZigzagTracker()
    t.load_progress(0.0, "n", "m", 3, 8)
    calm = [view("n", S.LOADING, role=C, layers=3), view("a", role=C, waiting=0)]
    shut = t.route(0.1, calm, "m", C, excluded=(), reachable={"n"})
    assert shut.split is None and shut.gate is not None and not shut.gate.zigzag
    assert t.route(0.1, overloaded_pool(), "m", C, excluded=(), reachable=set()).split is None
    assert t.route(0.1, overloaded_pool(), "m", C, excluded={"n"}, reachable={"n"}).split is None


def test_route_respects_the_in_flight_cap() -> None:
    t = zz.ZigzagTracker()
    t.load_progress(0.0, "n", "m", 3, 8)
    busy = overloaded_pool()
    busy[0] = dataclasses.replace(busy[0], routes_since_heartbeat=4)
    assert t.route(0.1, busy, "m", C, excluded=(), reachable={"n"}).split is None  # 4 in flight, cap 4
    assert t.limit(1.0, "n") == 2  # the cap shrinks to its floor as the load goes on


def test_a_load_with_every_decoder_layer_but_not_the_head_still_runs_ahead() -> None:
    # Layers stream first, then the embedding and the head: at L of L the instance is still
    # LOADING and runs every decoder layer of a prompt, its partner only the head.
    t = zz.ZigzagTracker()
    assert t.load_progress(0.0, "n", "m", 8, 8).effects[0] == zz.WentLive("n", "m", 8, 8, chain_tail=False)
    pool = overloaded_pool()
    pool[0] = dataclasses.replace(pool[0], layers_loaded=8)
    step = t.route(0.1, pool, "m", C, excluded=(), reachable={"n"})
    assert step.split is not None and (step.split.k, step.split.num_layers) == (8, 8)
    assert t.pull_pairs(0.1, pool, "m", C, reachable={"n"}).pairs == (("n", "b"),)
    assert [v.instance_id for v in t.live_views(pool, "m")] == ["n"]
    done = dataclasses.replace(pool[0], state=S.SERVING)  # the head landed: it serves whole
    assert t.live_views([done, *pool[1:]], "m") == []


def test_pull_peers_pair_each_live_instance_with_one_partner() -> None:
    t = zz.ZigzagTracker()
    t.load_progress(0.0, "n", "m", 3, 8)
    pool = overloaded_pool()
    by_id = {v.instance_id: v for v in pool}
    step = t.pull_peers(0.0, pool, by_id["b"], reachable={"n"})
    # A puller's cap is pull_limit (8), not the routed cap that shrinks to 2.
    assert [p.instance.instance_id for p in step.peers] == ["n"] and step.peers[0].inflight_limit == 8
    assert t.partner == {"n": "b"}
    assert t.pull_peers(5.0, pool, by_id["b"], reachable={"n"}).peers[0].inflight_limit == 8
    routed_cap = zz.ZigzagTracker(zz.ZigzagSettings(pull_limit=0))
    routed_cap.load_progress(0.0, "n", "m", 3, 8)
    assert routed_cap.pull_peers(0.0, pool, by_id["b"], reachable={"n"}).peers[0].inflight_limit == 4
    assert routed_cap.pull_peers(5.0, pool, by_id["b"], reachable={"n"}).peers[0].inflight_limit == 2
    assert t.pull_peers(0.0, pool, by_id["a"], reachable={"n"}).peers == ()  # n pulls from b only
    assert t.pull_peers(0.0, pool, by_id["n"], reachable={"n"}).peers == ()  # a LOADING instance pulls, not serves


def test_pull_pairs_move_a_live_instance_off_a_partner_with_nothing_queued() -> None:
    t = zz.ZigzagTracker()
    t.load_progress(0.0, "n", "m", 3, 8)
    pool = overloaded_pool()
    assert t.pull_pairs(0.0, pool, "m", C, reachable={"n"}).pairs == (("n", "b"),)
    # b still has a backlog: n stays, even though a is busier.
    pool[1] = dataclasses.replace(pool[1], load=dataclasses.replace(pool[1].load, waiting=9))
    assert t.pull_pairs(0.1, pool, "m", C, reachable={"n"}).pairs == (("n", "b"),)
    # b's queue drained while a still has one: n pulls from a now, and says why.
    pool[2] = dataclasses.replace(pool[2], load=dataclasses.replace(pool[2].load, waiting=0))
    step = t.pull_pairs(0.2, pool, "m", C, reachable={"n"})
    assert step.pairs == (("n", "a"),) and t.partner == {"n": "a"}
    assert [type(e) for e in step.effects] == [zz.Paired] and "pulls queued requests from a" in step.effects[0].reason
    # Nobody has a backlog: n keeps a (pairing costs nothing while there is nothing to hand over).
    pool[1] = dataclasses.replace(pool[1], load=dataclasses.replace(pool[1].load, waiting=0))
    step = t.pull_pairs(0.3, pool, "m", C, reachable={"n"})
    assert step.pairs == (("n", "a"),) and step.effects == ()


def test_pull_pairs_spread_live_instances_evenly_over_the_overloaded_partners() -> None:
    # Past half its layers a loading instance is the slower half of its pair, so a partner
    # needs several. Five live instances over two overloaded partners: 3 and 2, not 4 and 1
    # (b has fewer used KV blocks, so it takes the odd one and every tie).
    t = zz.ZigzagTracker()
    live = [f"n{i}" for i in range(5)]
    for n in live:
        t.load_progress(0.0, n, "m", 5, 8)
    pool = [view(n, S.LOADING, role=C, layers=5) for n in live] + overloaded_pool()[1:]
    pairs = dict(t.pull_pairs(0.0, pool, "m", C, reachable=set(live)).pairs)
    assert sorted(pairs.values()) == ["a", "a", "b", "b", "b"]
    # A partner with no backlog still takes none while an overloaded one is there, shared or not.
    idle = view("c", role=C, waiting=0, kv_used=0)
    t2 = zz.ZigzagTracker()
    for n in live:
        t2.load_progress(0.0, n, "m", 5, 8)
    assert "c" not in dict(t2.pull_pairs(0.0, [*pool, idle], "m", C, reachable=set(live)).pairs).values()


def test_choose_pull_partner_takes_the_least_shared_overloaded_instance() -> None:
    pool = overloaded_pool()
    # b has the fewest used KV blocks, but two loading instances pull from it and one from a.
    choice = zz.choose_pull_partner(pool, "n", "m", {"b": 2, "a": 1})
    assert choice is not None and choice.partner.instance_id == "a"
    assert choice.reason.startswith("pulled by 1 other loading instance, the fewest; fewest used KV blocks (300)")
    assert zz.choose_pull_partner(pool, "n", "m", {"b": 1, "a": 1}).partner.instance_id == "b"
    assert zz.choose_pull_partner(pool, "n", "m", {"b"}).partner.instance_id == "a"  # a set counts one each
    assert zz.choose_pull_partner(pool, "n", "m").partner.instance_id == "b"


def test_pair_all_spreads_live_instances_over_partners_then_shares() -> None:
    pool = [
        view("n1", S.LOADING, role=C, layers=5),
        view("n2", S.LOADING, role=C, layers=3),
        view("n3", S.LOADING, role=C, layers=1),
        view("a", role=C, waiting=2, kv_used=300),
        view("b", role=C, waiting=1, kv_used=100),
    ]
    t = zz.ZigzagTracker()
    for v in pool[:3]:
        t.load_progress(0.0, v.instance_id, "m", v.layers_loaded, 8)
    live = t.live_views(pool, "m")
    assert [v.instance_id for v in live] == ["n1", "n2", "n3"]  # most layers first
    assert zz.ZigzagTracker.pair_all(live, pool, "m") == [("b", "n1"), ("a", "n2"), ("b", "n3")]


def test_a_live_instance_that_loaded_hands_work_back_from_its_partner() -> None:
    t = zz.ZigzagTracker()
    t.load_progress(0.0, "n", "m", 3, 8)
    assert t.route(0.1, overloaded_pool(), "m", C, excluded=(), reachable={"n"}).split is not None
    step = t.load_done("n", loaded=True)
    assert step.effects[-1] == zz.HandBack("n", "b", "m", zz.ZigzagSettings().hand_back_min_tokens_left)
    assert t.split_with == {}
    # A failed load hands nothing back; nor does a load that never split a request.
    t.load_progress(0.0, "f", "m", 3, 8)
    t.note_split("f", "b")
    assert not any(isinstance(e, zz.HandBack) for e in t.load_done("f", loaded=False).effects)
    t.load_progress(0.0, "q", "m", 3, 8)
    assert not any(isinstance(e, zz.HandBack) for e in t.load_done("q", loaded=True).effects)
    # The settings' threshold goes with it, and on to the partner's release.
    picky = zz.ZigzagTracker(zz.ZigzagSettings(hand_back_min_tokens_left=40))
    picky.load_progress(0.0, "n", "m", 3, 8)
    picky.note_split("n", "b")
    (back,) = [e for e in picky.load_done("n", loaded=True).effects if isinstance(e, zz.HandBack)]
    assert back.min_tokens_left == 40
    move = zz.plan_hand_back([view("n", role=C), view("b", role=C, running=6)], back)
    assert move is not None and (move.n, move.min_tokens_left) == (3, 40)
    with pytest.raises(ValueError, match="hand_back_min_tokens_left must be >= 0, got -1"):
        zz.ZigzagSettings(hand_back_min_tokens_left=-1)
    off = zz.ZigzagTracker(zz.ZigzagSettings(hand_back=False))
    off.load_progress(0.0, "n", "m", 3, 8)
    off.note_split("n", "b")
    assert not any(isinstance(e, zz.HandBack) for e in off.load_done("n", loaded=True).effects)


def hand_backs(step: zz.ZigzagStep) -> list[zz.HandBack]:
    return [e for e in step.effects if isinstance(e, zz.HandBack)]


def test_a_hand_back_waits_while_the_partners_link_sends_parameters() -> None:
    """The running requests' KV would leave by the partner's link while it feeds a transfer
    chain: they wait until no chain sends from it, or `hand_back_wait_s`; the queued requests
    it ran ahead (no KV) go at once."""
    t = zz.ZigzagTracker(zz.ZigzagSettings(hand_back_wait_s=5.0))
    for iid in ("n1", "n2"):
        t.load_progress(0.0, iid, "m", 3, 8)
        t.note_split(iid, "b")
    (queued_only,) = hand_backs(t.load_done("n1", loaded=True, now_s=10.0, sending={"b"}))
    assert (queued_only.queued, queued_only.running) == (True, False)
    assert set(t.waiting_hand_backs) == {"n1"}
    assert hand_backs(t.hand_backs_due(11.0, {"b"})) == []  # still sending
    # n2's load ends with b free: its own hand-back goes whole, and n1's waiting one with it.
    n2, n1 = hand_backs(t.load_done("n2", loaded=True, now_s=12.5, sending=set()))
    assert (n2.instance_id, n2.queued, n2.running, n2.waited_s) == ("n2", True, True, 0.0)
    assert (n1.instance_id, n1.queued, n1.running, n1.waited_s) == ("n1", False, True, 2.5)
    assert t.waiting_hand_backs == {}


def test_a_waiting_hand_back_goes_after_hand_back_wait_s_or_never_waits_at_0() -> None:
    t = zz.ZigzagTracker(zz.ZigzagSettings(hand_back_wait_s=2.0))
    t.load_progress(0.0, "n", "m", 3, 8)
    t.note_split("n", "b")
    t.load_done("n", loaded=True, now_s=1.0, sending={"b"})
    assert hand_backs(t.hand_backs_due(2.9, {"b"})) == []
    (late,) = hand_backs(t.hand_backs_due(3.0, {"b"}))
    assert late.running and late.waited_s == pytest.approx(2.0)
    # A failed reload of the same instance forgets a hand-back still waiting.
    t.load_progress(4.0, "r", "m", 3, 8)
    t.note_split("r", "b")
    t.load_done("r", loaded=True, now_s=5.0, sending={"b"})
    t.load_progress(6.0, "r", "m", 1, 8)
    assert hand_backs(t.load_done("r", loaded=False, now_s=6.5, sending=set())) == []
    never = zz.ZigzagTracker(zz.ZigzagSettings(hand_back_wait_s=0.0))
    never.load_progress(0.0, "n", "m", 3, 8)
    never.note_split("n", "b")
    (now,) = hand_backs(never.load_done("n", loaded=True, now_s=1.0, sending={"b"}))
    assert (now.queued, now.running) == (True, True)
    for bad in (-1.0, math.inf, math.nan):
        with pytest.raises(ValueError, match="hand_back_wait_s must be finite and >= 0"):
            zz.ZigzagSettings(hand_back_wait_s=bad)


def test_hand_back_moves_the_partners_running_requests_above_an_even_share() -> None:
    back = zz.HandBack("n", "b", "m")
    views = [view("n", role=C, running=1), view("b", role=C, running=9, waiting=4), view("a", role=C, running=9)]
    move = zz.plan_hand_back(views, back)
    assert move is not None
    assert (move.source, move.model, move.n, move.running) == ("b", "m", 4, True)  # 9 + 1 -> 5 and 5
    assert move.reason.startswith("live migration: hand-back to n")
    even = [view("n", role=C, running=3), view("b", role=C, running=3)]
    assert zz.plan_hand_back(even, back) is None
    gone = [view("n", role=C), view("b", S.DRAINING, role=C, running=9)]
    assert zz.plan_hand_back(gone, back) is None
    # Its last report is from while it loaded: the ZigZag first layers it ran are not its own.
    loading_report = view("n", role=C, running=2)
    loading_report = dataclasses.replace(
        loading_report, load=dataclasses.replace(loading_report.load, zigzag_running=2)
    )
    move = zz.plan_hand_back([loading_report, view("b", role=C, running=2)], back)
    assert move is not None and move.n == 1
    unreported = [view("n", role=C, waiting=None), view("b", role=C, running=5)]
    move = zz.plan_hand_back(unreported, back)
    assert move is not None and move.n == 2  # no report from the new one yet: it runs nothing


def test_take_back_releases_what_the_loaded_instance_ran_ahead_from_its_partner_queue() -> None:
    back = zz.HandBack("n", "b", "m")
    move = zz.plan_take_back([view("n", role=C), view("b", role=C, running=2, waiting=5)], back)
    assert move is not None
    assert (move.source, move.model, move.n, move.running, move.ran_ahead_by) == ("b", "m", 0, False, "n")
    assert move.reason == "scale_out: n finished loading"
    report = release_report(move, 3)
    assert report is not None and (report.action, report.status, report.instance_id) == (
        "zigzag_take_back",
        "moved",
        "b",
    )
    assert report.reason == "n finished loading; b released 3 queued requests it ran ahead"
    # Nothing to take back from a partner that is gone or draining, nor for an instance not serving.
    assert zz.plan_take_back([view("n", role=C)], back) is None
    assert zz.plan_take_back([view("n", role=C), view("b", S.DRAINING, role=C)], back) is None
    assert zz.plan_take_back([view("n", S.LOADING, role=C), view("b", role=C)], back) is None


def test_the_gate_opens_on_a_backlog_of_prompt_tokens_before_ttft_rises() -> None:
    """Every SERVING instance computing a prompt (tokens not yet computed, nothing waiting, TTFT
    not reported yet) is a backlog: the gate opens at once."""
    busy = view("a", role=C, running=1)
    busy = dataclasses.replace(busy, load=dataclasses.replace(busy.load, waiting_prefill_tokens=1800))
    idle = view("b", role=C, running=1)
    t = zz.ZigzagTracker()
    assert t.gate([busy], "m", C).zigzag
    assert "a backlog of requests or prompt tokens" in t.gate([busy], "m", C).reason
    assert not t.gate([busy, idle], "m", C).zigzag  # b could take the request at once
