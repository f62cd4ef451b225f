"""The reconcile core alone: a registry, a load monitor and a time in, actions out."""

from __future__ import annotations

import dataclasses

import pytest

from services.global_manager.core.actions import (
    Count,
    DrainInstance,
    LoadInstances,
    MigrateRequests,
    Report,
    ResumeInstance,
    UpdateLocation,
)
from services.global_manager.core.instances import Registry
from services.global_manager.core.load_monitor import LoadMonitor
from services.global_manager.core.policies import make_policy
from services.global_manager.core.reconcile import Observations, Reconciler, ReconcileSettings, release_report
from services.global_manager.core.types import InstanceState, LoadSample, Role

pytestmark = [pytest.mark.timeout(10), pytest.mark.filterwarnings("error")]

S = InstanceState
M = "m"


def cluster(serving: int, idle: int, *, role: Role = Role.COLOCATED) -> tuple[Registry, LoadMonitor]:
    registry = Registry()
    monitor = LoadMonitor(window_s=1.0, lost_after_s=5.0)
    for i in range(serving + idle):
        state = S.SERVING if i < serving else S.IDLE
        registry.register(
            f"w{i}", model=M if i < serving else "", role=role, host="h", num_layers=2, now_s=0.0, state=state
        )
        monitor.mark_seen(f"w{i}", 0.0)
    return registry, monitor


def reconciler(**settings: object) -> Reconciler:
    params = {"target_decode_tps_per_instance": 10, "scale_out_cooldown_s": 0, "scale_in_cooldown_s": 0}
    params.update(settings.pop("policy_params", {}))  # type: ignore[arg-type]
    base = {"default_model": M, "pool_floors": {Role.COLOCATED: 1}, "max_instances": 3, "autoscale": True}
    return Reconciler(
        ReconcileSettings(**{**base, **settings}),  # type: ignore[arg-type]
        make_policy("heteroscale", {"min_instances": 1, "max_instances": 3, "enable_latency_trigger": False, **params}),
    )


def observe(registry: Registry, monitor: LoadMonitor, now_s: float, decode_tps: float, running: int = 1) -> None:
    for v in registry.views(state=S.SERVING):
        sample = LoadSample(v.instance_id, now_s, decode_tps=decode_tps, running=running)
        registry.heartbeat(sample)
        monitor.observe(sample)


def of(actions: list, kind: type) -> list:
    return [a for a in actions if isinstance(a, kind)]


def test_reconcile_is_pure_and_quiet_at_target() -> None:
    registry, monitor = cluster(serving=1, idle=2)
    rec = reconciler()
    observe(registry, monitor, 0.5, decode_tps=10)
    actions = rec.reconcile(1.0, registry, Observations(monitor))
    assert not of(actions, LoadInstances) and not of(actions, DrainInstance)
    (report,) = of(actions, Report)
    assert report.action == "autoscaling_decision" and report.target == "no_change" and report.log_line
    # The same inputs give the same decision; a repeat is not reported again.
    assert not of(rec.reconcile(1.0, registry, Observations(monitor)), Report)


def test_scale_out_is_bounded_by_max_instances_and_told_once() -> None:
    registry, monitor = cluster(serving=1, idle=4)
    rec = reconciler(max_instances=3, policy_params={"max_instances": 10})
    observe(registry, monitor, 0.5, decode_tps=100)  # need 10
    actions = rec.reconcile(1.0, registry, Observations(monitor))
    (load,) = of(actions, LoadInstances)
    assert load.instance_ids == ("w1", "w2") and load.role is Role.COLOCATED
    assert [registry.get(i).state for i in load.instance_ids] == [S.LOADING, S.LOADING]
    (bound,) = [r for r in of(actions, Report) if r.action == "autoscaling_bound"]
    assert "max_instances" in bound.reason


def test_scale_out_short_of_idle_workers_is_partial() -> None:
    registry, monitor = cluster(serving=1, idle=1)
    rec = reconciler()
    observe(registry, monitor, 0.5, decode_tps=100)
    actions = rec.reconcile(1.0, registry, Observations(monitor))
    assert of(actions, LoadInstances)[0].instance_ids == ("w1",)
    assert Count("load", "short") in actions
    assert [r.status for r in of(actions, Report) if r.action == "scale_out"] == ["loading", "partial"]


def test_busy_instances_are_neither_loaded_nor_drained_nor_written_off() -> None:
    registry, monitor = cluster(serving=2, idle=1)
    rec = reconciler(autoscale=False)
    # Silent past lost_after_s, but an action owns w1 and w2: its own deadline judges them.
    actions = rec.reconcile(6.0, registry, Observations(monitor, busy=frozenset({"w1", "w2"})))
    assert registry.get("w1").state is S.SERVING and registry.get("w2").state is S.IDLE
    assert registry.get("w0").state is S.LOST
    assert [r.instance_id for r in of(actions, Report) if r.action == "instance_lost"] == ["w0"]
    assert UpdateLocation(M, "w0", present=False) in actions
    # w1 still serves, so the floor holds: nothing loads (w2 is busy anyway).
    assert not of(actions, LoadInstances)


def test_lost_instance_is_replaced_in_the_same_tick() -> None:
    registry, monitor = cluster(serving=1, idle=1)
    rec = reconciler(autoscale=False)
    monitor.mark_seen("w1", 5.0)  # only w0 went silent
    actions = rec.reconcile(6.0, registry, Observations(monitor))
    kinds = [type(a).__name__ for a in actions]
    assert kinds == ["Report", "UpdateLocation", "Report", "LoadInstances"]
    assert of(actions, LoadInstances)[0] == LoadInstances(M, Role.COLOCATED, ("w1",), "min_instances=1")


def test_split_floors_fill_each_pool() -> None:
    registry, monitor = cluster(serving=0, idle=3)
    rec = reconciler(autoscale=False, disaggregated=True, pool_floors={Role.PREFILL: 1, Role.DECODE: 1})
    actions = rec.reconcile(0.1, registry, Observations(monitor))
    loads = {a.role: a.instance_ids for a in of(actions, LoadInstances)}
    assert sorted(loads) == [Role.DECODE, Role.PREFILL]
    assert sorted(r.reason for r in of(actions, Report) if r.action == "scale_out") == ["min_decode=1", "min_prefill=1"]


def test_scale_in_drains_the_least_loaded_and_keeps_one_serving() -> None:
    registry, monitor = cluster(serving=3, idle=0)
    rec = reconciler(pool_floors={Role.COLOCATED: 0})
    for iid, running in (("w0", 3), ("w1", 0), ("w2", 1)):
        sample = LoadSample(iid, 0.5, decode_tps=0, running=running)
        registry.heartbeat(sample)
        monitor.observe(sample)
    actions = rec.reconcile(1.0, registry, Observations(monitor))
    # need 0 -> the policy's own floor of 1; the least loaded go first.
    assert [a.instance_id for a in of(actions, DrainInstance)] == ["w1", "w2"]
    assert registry.get("w0").state is S.SERVING
    # The keep-serving rule: with one SERVING and one LOADING, a scale-in of 1 drains nothing.
    registry2, _ = cluster(serving=1, idle=1)
    registry2.transition("w1", S.LOADING, model=M)
    chosen, acts = rec.scale_in(registry2, set(), M, 1, "test", keep_serving=1)
    assert chosen == [] and acts == []


def test_load_outcomes_retry_then_roll_back_and_rebalance_on_success() -> None:
    registry, monitor = cluster(serving=1, idle=2)
    rec = reconciler(load_retries=1)
    registry.heartbeat(LoadSample("w0", 0.5, waiting=6))
    chosen, actions = rec.scale_out(registry, set(), M, 1, Role.COLOCATED, "test")
    (load,) = of(actions, LoadInstances)
    failed = rec.load_failed(registry, {"w1"}, load, "w1", "DATA_LOSS: crc")
    assert registry.get("w1").state is S.IDLE
    (retry,) = of(failed, LoadInstances)
    assert retry.instance_ids == ("w2",) and retry.attempt == 1 and retry.tried == {"w1"}
    assert Count("load", "retried") in failed
    ok = rec.load_succeeded(registry, retry, "w2", 1.5)
    assert registry.get("w2").state is S.SERVING
    assert ok[0] == UpdateLocation(M, "w2", present=True)
    assert [r.reason for r in of(ok, Report)] == ["load_s=1.500"]
    (move,) = of(ok, MigrateRequests)
    assert (move.source, move.n, move.running, move.reason) == ("w0", 3, False, "scale_out: w2 is SERVING")
    report = release_report(move, 2)
    assert report is not None and report.action == "rebalance" and "released 2 of the 3 queued" in report.reason
    # A second failure with no retries left rolls back.
    registry.transition("w1", S.LOADING, model=M)
    again = rec.load_failed(registry, set(), retry, "w1", "boom")
    assert not of(again, LoadInstances)
    assert [r.status for r in of(again, Report)] == ["failed", "rolled_back"]


def test_live_migration_respects_its_cooldown() -> None:
    registry, monitor = cluster(serving=2, idle=0)
    rec = reconciler(autoscale=False, live_migration=True, migration_cooldown_s=5.0)
    registry.heartbeat(LoadSample("w0", 0.5, running=9, kv_blocks_used=97, kv_blocks_total=100))
    registry.heartbeat(LoadSample("w1", 0.5, running=1, kv_blocks_used=10, kv_blocks_total=100))
    for v in registry:
        monitor.mark_seen(v.instance_id, 0.5)
    first = of(rec.reconcile(1.0, registry, Observations(monitor)), MigrateRequests)
    assert [(m.source, m.n) for m in first] == [("w0", 4)]
    for v in registry:
        monitor.mark_seen(v.instance_id, 5.5)
    assert not of(rec.reconcile(5.9, registry, Observations(monitor)), MigrateRequests)
    assert of(rec.reconcile(6.0, registry, Observations(monitor)), MigrateRequests) == first


def test_a_drained_instance_keeps_warm_for_the_last_load_time_and_is_loaded_first() -> None:
    registry, _ = cluster(serving=3, idle=1)
    rec = reconciler(keep_warm_max_s=5.0)
    # Before any load was measured nothing is kept.
    _, acts = rec.scale_in(registry, set(), M, 1, "test", only={"w0"})
    (first,) = of(acts, DrainInstance)
    assert first.keep_warm_s == 0.0
    rec.drain_finished(registry, first, "")
    assert rec.warm == {}
    # A measured load of 1.5 s: a drain now keeps the weights that long (under the 5 s bound).
    _, acts = rec.scale_out(registry, set(), M, 1, Role.COLOCATED, "test", only={"w3"})
    (load,) = of(acts, LoadInstances)
    rec.load_succeeded(registry, load, "w3", 1.5)
    assert rec.keep_warm_s(M) == 1.5
    (victim,), acts = rec.scale_in(registry, set(), M, 1, "test", only={"w2"})
    (drain,) = of(acts, DrainInstance)
    assert drain.keep_warm_s == 1.5 and "keeps the weights 1.5s" in of(acts, Report)[0].reason
    rec.drain_finished(registry, drain, "")
    assert registry.get(victim).state is S.IDLE and rec.warm == {victim: M}
    # The next scale-out takes the warm one before the others, and its near-instant load does
    # not become the measure of a reload.
    idle = sorted(v.instance_id for v in registry.views(state=S.IDLE))
    chosen, acts = rec.scale_out(registry, set(), M, 1, Role.COLOCATED, "test")
    assert min(idle) < victim  # by id another would go first
    assert chosen == [victim] and rec.warm == {}
    assert "may still hold the weights" in of(acts, Report)[0].reason
    rec.load_succeeded(registry, of(acts, LoadInstances)[0], victim, 0.01)
    assert rec.keep_warm_s(M) == 1.5
    # The bound caps it; 0 turns it off.
    assert reconciler(keep_warm_max_s=1.0).keep_warm_s(M) == 0.0
    rec.settings = ReconcileSettings(**{**vars_of(rec.settings), "keep_warm_max_s": 1.0})
    assert rec.keep_warm_s(M) == 1.0
    rec.settings = ReconcileSettings(**{**vars_of(rec.settings), "keep_warm_max_s": 0.0})
    assert rec.keep_warm_s(M) == 0.0


def test_a_lost_warm_instance_is_forgotten() -> None:
    registry, _ = cluster(serving=2, idle=1)
    rec = reconciler(keep_warm_max_s=5.0)
    rec.load_s[M] = 2.0
    (victim,), acts = rec.scale_in(registry, set(), M, 1, "test")
    rec.drain_finished(registry, of(acts, DrainInstance)[0], "")
    assert rec.warm == {victim: M}
    rec.mark_lost(registry, victim, "silent")
    assert rec.warm == {}
    # A failed drain keeps nothing either.
    (other,), acts = rec.scale_in(registry, set(), M, 1, "test", keep_serving=0)
    rec.drain_finished(registry, of(acts, DrainInstance)[0], "UNAVAILABLE")
    assert other not in rec.warm


def vars_of(settings: ReconcileSettings) -> dict[str, object]:
    return {f.name: getattr(settings, f.name) for f in dataclasses.fields(settings)}


# ---- a scale-out that takes back a scale-in ------------------------------------------------------


def test_a_scale_out_takes_back_a_drain_in_flight_before_loading_an_idle_worker() -> None:
    registry, _ = cluster(serving=3, idle=1)
    rec = reconciler(max_instances=4)
    for iid, running in (("w0", 2), ("w1", 1), ("w2", 3)):
        registry.heartbeat(LoadSample(iid, 0.5, running=running))
    busy: set[str] = set()
    (victim,), _ = rec.scale_in(registry, busy, M, 1, "lull")
    assert victim == "w1" and registry.get("w1").state is S.DRAINING and busy == {"w1"}
    chosen, acts = rec.scale_out(registry, busy, M, 2, Role.COLOCATED, "burst")
    # The draining instance first (it serves at once, no load), then the IDLE worker.
    assert chosen == ["w1", "w3"]
    assert of(acts, ResumeInstance) == [ResumeInstance("w1", M, "burst")]
    assert of(acts, LoadInstances)[0].instance_ids == ("w3",)
    assert registry.get("w1").state is S.SERVING and registry.get("w3").state is S.LOADING
    assert [(r.status, r.instance_id) for r in of(acts, Report)] == [("resumed", "w1"), ("loading", "w3")]
    # The worker answers, then its Drain says it was taken back: no unload, nothing kept warm.
    assert rec.resume_finished(of(acts, ResumeInstance)[0], "") == [Count("resume", "ok")]
    done = rec.drain_finished(registry, DrainInstance("w1", M, "lull"), "", finished=0, resumed=True)
    assert Count("drain", "resumed") in done and not of(done, UpdateLocation)
    assert registry.get("w1").state is S.SERVING and rec.warm == {} and not rec.resumable and not rec.resuming


def test_only_a_pools_own_drains_of_that_model_and_role_are_taken_back() -> None:
    registry, _ = cluster(serving=3, idle=0)
    rec = reconciler(max_instances=4)
    # An operator's drain of a named instance is final.
    (named,), _ = rec.scale_in(registry, set(), M, 1, "maintenance", only={"w0"})
    assert rec.scale_out(registry, {named}, M, 1, Role.COLOCATED, "burst") == ([], [])
    # A drain of the pool is not taken by another role's scale-out, nor past max_instances.
    (pooled,), _ = rec.scale_in(registry, {named}, M, 1, "lull")
    busy = {named, pooled}
    assert rec.scale_out(registry, busy, M, 1, Role.PREFILL, "burst") == ([], [])
    assert rec.scale_out(registry, busy, "other", 1, Role.COLOCATED, "burst") == ([], [])
    # One SERVING left: max_instances=1 leaves no room; 2 leaves room for the pool's drain only.
    rec.settings = dataclasses.replace(rec.settings, max_instances=1)
    assert rec.scale_out(registry, busy, M, 1, Role.COLOCATED, "burst") == ([], [])
    rec.settings = dataclasses.replace(rec.settings, max_instances=2)
    assert rec.scale_out(registry, busy, M, 2, Role.COLOCATED, "burst")[0] == [pooled]
    assert registry.get(named).state is S.DRAINING
    # A lost instance is forgotten, taken back or not.
    (again,), _ = rec.scale_in(registry, busy, M, 1, "lull")
    assert again in rec.resumable
    rec.mark_lost(registry, again, "silent")
    assert again not in rec.resumable and pooled in rec.resuming
    rec.mark_lost(registry, pooled, "silent")
    assert not rec.resuming


def test_a_resume_that_comes_after_the_drain_finished_leaves_the_instance_idle() -> None:
    registry, _ = cluster(serving=2, idle=0)
    rec = reconciler(keep_warm_max_s=5.0)
    rec.load_s[M] = 2.0
    (victim,), acts = rec.scale_in(registry, set(), M, 1, "lull")
    drain = of(acts, DrainInstance)[0]
    (resume,) = of(rec.scale_out(registry, {victim}, M, 1, Role.COLOCATED, "burst")[1], ResumeInstance)
    assert registry.get(victim).state is S.SERVING
    # The worker had finished its drain and unloaded: its Drain answers "done", its Resume no.
    done = rec.drain_finished(registry, drain, "", finished=1)
    assert registry.get(victim).state is S.IDLE and rec.warm == {victim: M}
    assert "the resume came after the drain had finished" in of(done, Report)[0].reason
    refused = rec.resume_finished(resume, "FAILED_PRECONDITION: its drain is final")
    assert Count("resume", "refused") in refused
    assert [(r.status, r.instance_id) for r in of(refused, Report)] == [("resume_refused", victim)]
    # The next scale-out loads it again (warm): the drain is no longer one to take back.
    chosen, acts = rec.scale_out(registry, set(), M, 1, Role.COLOCATED, "burst")
    assert chosen == [victim] and of(acts, LoadInstances) and not of(acts, ResumeInstance)


def test_the_policy_takes_back_its_own_scale_in_when_load_returns() -> None:
    registry, monitor = cluster(serving=2, idle=0)
    rec = reconciler(pool_floors={Role.COLOCATED: 1})
    observe(registry, monitor, 0.5, decode_tps=4)  # 8 tokens/s over 2: one instance is enough
    drains = of(rec.reconcile(1.0, registry, Observations(monitor)), DrainInstance)
    assert len(drains) == 1
    victim = drains[0].instance_id
    observe(registry, monitor, 1.5, decode_tps=15)  # the burst: 15 tokens/s on the one left, 2 wanted
    actions = rec.reconcile(2.0, registry, Observations(monitor, busy=frozenset({victim})))
    assert of(actions, ResumeInstance) == [ResumeInstance(victim, M, of(actions, ResumeInstance)[0].reason)]
    assert not of(actions, LoadInstances) and Count("load", "short") not in actions
    assert registry.get(victim).state is S.SERVING


def test_the_registrys_fast_copy_of_a_view_sets_every_field_and_checks_it() -> None:
    from services.global_manager.core.instances import _evolve
    from services.global_manager.core.types import InstanceView

    old = InstanceView("i1", "m", Role.COLOCATED, InstanceState.LOADING, 3, 8, "h1", 1.5, None, 2)
    sample = LoadSample(instance_id="i1", now_s=2.0, running=1)
    changes: list[dict[str, object]] = [
        {},
        {"layers_loaded": 5},
        {"last_heartbeat_s": 2.0, "load": sample, "routes_since_heartbeat": 0},
        {"routes_since_heartbeat": 7},
    ]
    for change in changes:
        new = _evolve(old, **change)  # type: ignore[arg-type]
        assert type(new) is InstanceView
        assert new == dataclasses.replace(old, **change)
        assert [getattr(new, f.name) for f in dataclasses.fields(new)] == [
            getattr(dataclasses.replace(old, **change), f.name) for f in dataclasses.fields(new)
        ]
    with pytest.raises(ValueError, match="layers_loaded=9"):
        _evolve(old, layers_loaded=9)
    with pytest.raises(ValueError, match="routes_since_heartbeat=-1"):
        _evolve(old, routes_since_heartbeat=-1)
