"""The manager's state-changing admin calls refuse a request that is missing or contradicts a
field (INVALID_ARGUMENT, quoting it) and change nothing: before this check an empty SetPolicy
with advisory set switched the manager into advisory mode."""

from __future__ import annotations

from typing import Any

import pytest

from blitzmesh.v1 import admin_pb2
from tests.unit.test_gm_control_loop import MODEL, Aborted, Context, Mesh, started


async def _cluster(mesh: Mesh) -> tuple[Any, ...]:
    c = await mesh.gm.GetCluster(admin_pb2.GetClusterRequest(), Context())
    return (
        c.policy,
        c.advisory,
        dict(c.policy_params),
        sorted((i.instance_id, i.state, i.model_id) for i in c.instances),
    )


@pytest.mark.parametrize(
    ("request_", "quoted"),
    [
        (admin_pb2.SetPolicyRequest(), "policy is required, got ''"),
        (admin_pb2.SetPolicyRequest(advisory=True), "advisory=True"),
        (admin_pb2.SetPolicyRequest(params={"target_requests_per_instance": "4"}), "1 params"),
        (admin_pb2.SetPolicyRequest(policy="\x07garbage", advisory=True), "garbage"),
    ],
    ids=["empty", "advisory-only", "params-only", "unknown-policy"],
)
async def test_a_set_policy_that_names_no_known_policy_changes_nothing(request_: Any, quoted: str) -> None:
    mesh = await started()
    before = await _cluster(mesh)
    assert before[1] is False  # acting, not advisory
    with pytest.raises(Aborted, match="INVALID_ARGUMENT") as e:
        await mesh.gm.SetPolicy(request_, Context())
    assert quoted in str(e.value)
    assert await _cluster(mesh) == before


async def test_naming_the_policy_in_force_switches_only_the_mode() -> None:
    mesh = await started()
    policy, _, params, instances = await _cluster(mesh)
    request = admin_pb2.SetPolicyRequest(policy=policy, params=params, advisory=True)
    assert (await mesh.gm.SetPolicy(request, Context())).advisory
    assert await _cluster(mesh) == (policy, True, params, instances)


@pytest.mark.parametrize(
    ("request_", "quoted"),
    [
        (admin_pb2.ScaleRequest(), "model_id is required"),
        (admin_pb2.ScaleRequest(model_id=MODEL), "delta must be non-zero, got 0"),
        (admin_pb2.ScaleRequest(model_id=MODEL, delta=1, instance_ids=["w0"]), "delta=1 with instance_ids ['w0']"),
        (admin_pb2.ScaleRequest(model_id=MODEL, delta=-2, instance_ids=["w0"]), "delta=-2 with 1 instance_ids"),
        (admin_pb2.ScaleRequest(model_id=MODEL, delta=1, role=99), "99"),  # type: ignore[arg-type]
    ],
    ids=["empty", "no-delta", "out-with-names", "count-mismatch", "bad-role"],
)
async def test_a_scale_missing_or_contradicting_a_field_changes_nothing(request_: Any, quoted: str) -> None:
    mesh = await started()
    before = await _cluster(mesh)
    with pytest.raises(Aborted, match="INVALID_ARGUMENT") as e:
        await mesh.gm.Scale(request_, Context())
    assert quoted in str(e.value)
    assert await _cluster(mesh) == before
    assert not mesh.act.busy()
