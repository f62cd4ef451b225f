"""Live migration planning (pure): which instances shed running requests with their KV."""

from __future__ import annotations

import pytest

from services.global_manager.core.placement import plan_live_migration
from services.global_manager.core.types import InstanceState, InstanceView, LoadSample, Role


def inst(
    iid: str,
    running: int,
    kv_used: int,
    *,
    tbt_p99_s: float | None = None,
    role: Role = Role.COLOCATED,
    state: InstanceState = InstanceState.SERVING,
    model: str = "m",
) -> InstanceView:
    load = LoadSample(
        instance_id=iid, now_s=0.0, running=running, kv_blocks_used=kv_used, kv_blocks_total=100, tbt_p99_s=tbt_p99_s
    )
    return InstanceView(iid, model, role, state, 4, 4, "h0", 0.0, load)


def test_an_instance_over_its_kv_target_sheds_toward_the_mean() -> None:
    views = [inst("a", running=10, kv_used=97), inst("b", running=2, kv_used=20)]
    assert plan_live_migration(views, "m", kv_high=0.95) == [("a", 4, "KV 0.97 > 0.95")]
    assert plan_live_migration(views, "m", kv_high=0.95, max_moves=2) == [("a", 2, "KV 0.97 > 0.95")]


def test_tbt_over_its_slo_sheds_too_when_asked() -> None:
    views = [inst("a", running=8, kv_used=50, tbt_p99_s=0.3), inst("b", running=2, kv_used=10, tbt_p99_s=0.05)]
    assert plan_live_migration(views, "m", kv_high=0.95) == []
    assert plan_live_migration(views, "m", kv_high=0.95, tbt_slo_s=0.2) == [("a", 3, "TBT p99 0.300s > 0.2s")]


def test_nothing_moves_without_room_or_within_a_role_or_model_apart() -> None:
    full = [inst("a", running=10, kv_used=97), inst("b", running=9, kv_used=96)]
    assert plan_live_migration(full, "m", kv_high=0.95) == []  # nobody can take them
    roles = [inst("p", running=10, kv_used=97, role=Role.PREFILL), inst("d", running=1, kv_used=5, role=Role.DECODE)]
    assert plan_live_migration(roles, "m", kv_high=0.95) == []  # not across roles
    other = [inst("a", running=10, kv_used=97), inst("x", running=0, kv_used=0, model="other")]
    assert plan_live_migration(other, "m", kv_high=0.95) == []
    loading = [inst("a", running=10, kv_used=97), inst("n", running=0, kv_used=0, state=InstanceState.LOADING)]
    assert plan_live_migration(loading, "m", kv_high=0.95) == []  # a LOADING instance cannot decode
    with pytest.raises(ValueError, match="kv_high must be in"):
        plan_live_migration(full, "m", kv_high=1.5)
