"""Admin calls the e2e tests share."""

from __future__ import annotations

from collections.abc import Sequence

from blitzmesh.v1 import admin_pb2, admin_pb2_grpc


async def unchanged_policy(
    admin: admin_pb2_grpc.AdminStub, metadata: Sequence[tuple[str, str]] = ()
) -> admin_pb2.SetPolicyRequest:
    """A SetPolicy that changes nothing: the policy in force, with its params and mode. The
    manager still emits a "policy" event for it, which tells a watch that it is live (an empty
    SetPolicy is refused: it names no policy)."""
    now = await admin.GetCluster(admin_pb2.GetClusterRequest(), timeout=10, metadata=metadata)
    return admin_pb2.SetPolicyRequest(policy=now.policy, params=now.policy_params, advisory=now.advisory)
