"""Routing choices and the instance registry's lifecycle state machine."""

from __future__ import annotations

import dataclasses
import itertools

import pytest

from services.global_manager.core.instances import (
    IllegalTransitionError,
    Registry,
    RegistryError,
    UnknownInstanceError,
    is_legal_transition,
)
from services.global_manager.core.placement import pick_scale_in_victim, plan_rebalance
from services.global_manager.core.routing import choose_instance, choose_pair, instance_load
from services.global_manager.core.types import InstanceState, InstanceView, LoadSample, Role

S = InstanceState


def inst(
    iid: str,
    state: InstanceState = S.SERVING,
    role: Role = Role.COLOCATED,
    running: int = 0,
    waiting: int = 0,
    kv_used: int = 0,
    kv_total: int = 100,
    model: str = "m",
    loaded: bool = True,
) -> InstanceView:
    load = (
        LoadSample(iid, 0.0, running=running, waiting=waiting, kv_blocks_used=kv_used, kv_blocks_total=kv_total)
        if loaded
        else None
    )
    layers = 8 if state in (S.SERVING, S.DRAINING) else 0
    return InstanceView(iid, model, role, state, layers, 8, "h", 0.0, load)


def test_least_loaded_serving_instance() -> None:
    pool = [inst("a", running=3), inst("b", running=1, waiting=1), inst("c", running=1)]
    assert choose_instance(pool, 100, ()).instance_id == "c"
    assert instance_load(pool[1]) == 2.0


def test_kv_utilisation_breaks_equal_queues_and_ids_break_exact_ties() -> None:
    assert choose_instance([inst("a", running=1, kv_used=50), inst("b", running=1, kv_used=10)]).instance_id == "b"
    assert choose_instance([inst("z"), inst("b"), inst("m")]).instance_id == "b"


def test_never_picks_non_serving_instances() -> None:
    others = [inst(f"x{s.value}", state=s, running=0) for s in S if s is not S.SERVING]
    busy = inst("busy", running=50)
    for perm in itertools.permutations([*others, busy]):
        assert choose_instance(list(perm)).instance_id == "busy"
    assert choose_instance(others) is None
    assert pick_scale_in_victim(others) is None


def test_exclusions_roles_models_and_unreported_load() -> None:
    pool = [
        inst("a", running=5),
        inst("b", running=0),
        inst("p", role=Role.PREFILL),
        inst("d", role=Role.DECODE, running=2),
        inst("o", model="other"),
        inst("new", running=0, loaded=False),
    ]
    assert choose_instance(pool, exclude_ids={"b", "new", "o", "p", "d"}).instance_id == "a"
    assert choose_instance(pool, role=Role.PREFILL).instance_id == "p"
    assert choose_instance(pool, model="other").instance_id == "o"
    assert choose_instance(pool, role=Role.COLOCATED, model="m", exclude_ids={"b"}).instance_id == "new"
    pair = choose_pair(pool)
    assert pair is not None and (pair[0].instance_id, pair[1].instance_id) == ("p", "d")
    assert choose_pair([inst("p", role=Role.PREFILL)]) is None


def test_kv_fit_is_a_preference_not_a_filter() -> None:
    full = inst("a", running=0, kv_used=99)  # 1 free block
    roomy = inst("b", running=3, kv_used=0)
    assert choose_instance([full, roomy], 64, kv_block_size_tokens=16).instance_id == "b"
    assert choose_instance([full, roomy], 16, kv_block_size_tokens=16).instance_id == "a"
    assert choose_instance([full], 1000, kv_block_size_tokens=16).instance_id == "a"
    with pytest.raises(ValueError, match="request_tokens must be >= 0, got -1"):
        choose_instance([full], -1)


def test_scale_in_victim_is_least_loaded_serving() -> None:
    pool = [inst("a", running=4), inst("b", running=1), inst("c", state=S.DRAINING), inst("d", role=Role.DECODE)]
    assert pick_scale_in_victim(pool, role=Role.COLOCATED).instance_id == "b"
    assert pick_scale_in_victim(pool).instance_id == "d"  # idle d (load 0) beats b across roles
    assert pick_scale_in_victim(pool, role=Role.DECODE).instance_id == "d"


def test_rebalance_moves_queued_requests_above_an_even_share() -> None:
    pool = [
        inst("a", waiting=9),
        inst("b", waiting=3),
        inst("c", waiting=0, running=30),
        inst("new", waiting=0),
        inst("other-model", waiting=50, model="x"),
        inst("prefill", waiting=50, role=Role.PREFILL),
        inst("draining", state=S.DRAINING, waiting=40),
        inst("silent", loaded=False),
    ]
    # 12 queued over 4 instances (the new one counted): a share of 3; only "a" is above it.
    assert plan_rebalance(pool, "new") == [("a", 6)]
    assert plan_rebalance([inst("a", waiting=5), inst("b", waiting=5), inst("new")], "new") == [("a", 1), ("b", 1)]
    assert plan_rebalance([inst("a", waiting=1), inst("new")], "new") == []  # one queued: it stays
    assert plan_rebalance([inst("a", waiting=0, running=9), inst("new")], "new") == []  # running never moves
    assert plan_rebalance(pool, "unknown") == []
    # Routed since its last report: queued as far as the manager can tell (here 3 + 6 over 3).
    joined = dataclasses.replace(inst("b", waiting=0), routes_since_heartbeat=6)
    assert plan_rebalance([inst("a", waiting=3), joined, inst("new")], "new") == [("b", 3)]
    unreported = dataclasses.replace(inst("b", loaded=False), routes_since_heartbeat=4)
    assert plan_rebalance([unreported, inst("new")], "new") == [("b", 2)]


def register(reg: Registry, iid: str = "w0") -> InstanceView:
    return reg.register(iid, model="m", role=Role.DECODE, host="h", num_layers=8, now_s=1.0)


def test_registry_full_lifecycle() -> None:
    reg = Registry()
    v = register(reg)
    assert (v.state, v.layers_loaded, v.last_heartbeat_s) == (S.IDLE, 0, 1.0)
    assert reg.transition("w0", S.LOADING, model="m2", role=Role.PREFILL, num_layers=4).model == "m2"
    assert reg.set_layers_loaded("w0", 3).layers_loaded == 3
    served = reg.transition("w0", S.SERVING)
    assert (served.state, served.layers_loaded, served.role, served.num_layers) == (S.SERVING, 4, Role.PREFILL, 4)
    hb = reg.heartbeat(LoadSample("w0", 5.0, running=2))
    assert hb.last_heartbeat_s == 5.0 and hb.load is not None and hb.load.running == 2
    assert reg.transition("w0", S.DRAINING).state is S.DRAINING
    # A drain taken back: SERVING again with the model whole and its last report kept.
    back = reg.transition("w0", S.SERVING)
    assert (back.state, back.layers_loaded, back.load) == (S.SERVING, 4, hb.load)
    assert reg.transition("w0", S.DRAINING).state is S.DRAINING
    idle = reg.transition("w0", S.IDLE)
    assert (idle.state, idle.layers_loaded, idle.load) == (S.IDLE, 0, None)
    assert [x.instance_id for x in reg.views(state=S.IDLE)] == ["w0"]
    assert reg.remove("w0").instance_id == "w0" and len(reg) == 0


@pytest.mark.parametrize(
    ("src", "dst"),
    [
        (S.IDLE, S.SERVING),
        (S.IDLE, S.DRAINING),
        (S.LOADING, S.DRAINING),
        (S.SERVING, S.LOADING),
        (S.SERVING, S.IDLE),
        (S.DRAINING, S.LOADING),
        (S.LOST, S.SERVING),
        (S.LOST, S.LOADING),
        (S.SERVING, S.SERVING),
    ],
)
def test_illegal_transitions_name_both_states(src: InstanceState, dst: InstanceState) -> None:
    reg = Registry()
    reg.register(
        "w0", model="m", role=Role.DECODE, host="h", num_layers=8, now_s=0.0, state=S.IDLE if src is S.LOST else src
    )
    if src is S.LOST:
        reg.mark_lost("w0")
    assert not is_legal_transition(src, dst)
    with pytest.raises(IllegalTransitionError, match=f"illegal transition {src.value} -> {dst.value}"):
        reg.transition("w0", dst)
    assert reg.get("w0").state is src  # unchanged


@pytest.mark.parametrize("src", [S.IDLE, S.LOADING, S.SERVING, S.DRAINING])
def test_any_state_can_become_lost_and_comes_back_idle(src: InstanceState) -> None:
    reg = Registry()
    reg.register("w0", model="m", role=Role.DECODE, host="h", num_layers=8, now_s=0.0, state=src)
    assert reg.mark_lost("w0").state is S.LOST
    assert reg.mark_lost("w0").state is S.LOST  # idempotent
    with pytest.raises(RegistryError, match="is LOST; it must register again"):
        reg.heartbeat(LoadSample("w0", 1.0))
    back = reg.register("w0", model="m", role=Role.PREFILL, host="h2", num_layers=8, now_s=9.0)
    assert (back.state, back.role, back.host, back.last_heartbeat_s) == (S.IDLE, Role.PREFILL, "h2", 9.0)


def test_registry_rejects_duplicates_and_unknowns() -> None:
    reg = Registry()
    register(reg)
    with pytest.raises(IllegalTransitionError, match="IDLE -> IDLE.*mark it lost first"):
        register(reg)
    with pytest.raises(UnknownInstanceError, match="'nope' is not registered"):
        reg.get("nope")
    with pytest.raises(UnknownInstanceError):
        reg.heartbeat(LoadSample("nope", 0.0))
    with pytest.raises(RegistryError, match="layer progress applies to LOADING, it is IDLE"):
        reg.set_layers_loaded("w0", 2)
    reg.transition("w0", S.LOADING)
    reg.set_layers_loaded("w0", 4)
    with pytest.raises(ValueError, match="progress does not go backwards"):
        reg.set_layers_loaded("w0", 3)
    with pytest.raises(RegistryError, match="only IDLE or LOST"):
        reg.remove("w0")
    with pytest.raises(RegistryError, match="only on IDLE -> LOADING"):
        reg.transition("w0", S.SERVING, model="x")


def test_registry_rebuild_after_manager_restart() -> None:
    reg = Registry()
    v = reg.register("w9", model="m", role=Role.DECODE, host="h", num_layers=8, now_s=3.0, state=S.SERVING)
    assert (v.state, v.layers_loaded) == (S.SERVING, 8)
    loading = reg.register(
        "w8", model="m", role=Role.DECODE, host="h", num_layers=8, now_s=3.0, state=S.LOADING, layers_loaded=5
    )
    assert loading.layers_loaded == 5
    assert choose_instance(reg) is not None and choose_instance(reg).instance_id == "w9"  # type: ignore[union-attr]


def test_failed_load_rolls_back_to_idle() -> None:
    reg = Registry()
    reg.register("w", model="", role=Role.COLOCATED, host="h", num_layers=1, now_s=0.0)
    reg.transition("w", S.LOADING, model="m", num_layers=4)
    reg.set_layers_loaded("w", 2)
    view = reg.transition("w", S.IDLE)
    assert view.state is S.IDLE and view.layers_loaded == 0 and view.load is None


def test_registry_updates_keep_every_other_field() -> None:
    """The hot-path copies (a route noted, a report, a layer landed) are written out field by
    field: each must change only its own fields and carry every other one over unchanged."""
    import dataclasses

    reg = Registry()
    reg.register("w1", model="m", role=Role.PREFILL, host="h7", num_layers=8, now_s=3.5)
    reg.transition("w1", S.LOADING)
    before = reg.set_layers_loaded("w1", 2)
    sample = LoadSample("w1", 4.0, running=2, kv_blocks_used=1, kv_blocks_total=9)
    steps = [
        (lambda: reg.note_routed("w1"), {"routes_since_heartbeat": 1}),
        (lambda: reg.set_layers_loaded("w1", 5), {"layers_loaded": 5}),
        (lambda: reg.heartbeat(sample), {"routes_since_heartbeat": 0, "last_heartbeat_s": 4.0, "load": sample}),
        (lambda: reg.note_routed("w1"), {"routes_since_heartbeat": 1}),
    ]
    for update, changed in steps:
        after = update()
        assert after == dataclasses.replace(before, **changed)
        assert reg.get("w1") is after
        before = after
    # Every field went through a value other than its default, so a dropped one would show.
    assert {f.name for f in dataclasses.fields(InstanceView)} <= {
        "instance_id", "model", "role", "state", "layers_loaded", "num_layers", "host",
        "last_heartbeat_s", "load", "routes_since_heartbeat",
    }  # fmt: skip


def test_scale_in_order_is_the_routers_choice_repeated() -> None:
    """n victims sorted once are the n the router's least-loaded choice (`choose_instance`)
    would give one after another, each drained one removed: on random pools with ties."""
    import random

    from services.global_manager.core.placement import scale_in_order

    rng = random.Random(7)
    for _ in range(200):
        pool = [
            inst(
                f"i{j}",
                state=rng.choice([S.SERVING, S.SERVING, S.LOADING, S.DRAINING, S.IDLE]),
                role=rng.choice([Role.COLOCATED, Role.DECODE]),
                running=rng.randrange(3),
                waiting=rng.randrange(2),
                kv_used=rng.choice([0, 10, 50]),
                model=rng.choice(["m", "m", "x"]),
                loaded=rng.random() < 0.9,
            )
            for j in range(rng.randrange(1, 12))
        ]
        role = rng.choice([None, Role.COLOCATED])
        order = scale_in_order(pool, role=role, model="m")
        left, repeated = list(pool), []
        while (pick := choose_instance(left, role=role, model="m")) is not None:
            repeated.append(pick)
            left.remove(pick)
        assert order == repeated
        assert pick_scale_in_victim(pool, role=role, model="m") == (order[0] if order else None)


def test_registry_count_filters_and_stops_early() -> None:
    reg = Registry()
    for iid, role in (("a", Role.COLOCATED), ("b", Role.COLOCATED), ("c", Role.DECODE), ("d", Role.COLOCATED)):
        reg.register(iid, model="m", role=role, host="h", num_layers=4, now_s=0.0)
    reg.transition("a", S.LOADING)
    reg.transition("b", S.LOADING)
    reg.transition("b", S.SERVING)
    live = (S.LOADING, S.SERVING)
    assert reg.count() == 4
    assert reg.count(model="m", role=Role.COLOCATED, states=live) == 2
    assert reg.count(model="m", role=Role.COLOCATED, states=live, up_to=1) == 1
    assert reg.count(model="m", role=Role.COLOCATED, states=live, up_to=5) == 2
    assert reg.count(model="x") == 0
    assert reg.count(states=(S.IDLE,)) == 2


def test_note_routed_counts_n_and_rejects_a_bad_n() -> None:
    reg = Registry()
    reg.register("w1", model="m", role=Role.COLOCATED, host="h", num_layers=4, now_s=0.0)
    assert reg.note_routed("w1", 3).routes_since_heartbeat == 3
    assert reg.note_routed("w1").routes_since_heartbeat == 4
    with pytest.raises(ValueError, match=r"instance 'w1': n must be >= 1 routes, got 0"):
        reg.note_routed("w1", 0)
    assert reg.get("w1").routes_since_heartbeat == 4
