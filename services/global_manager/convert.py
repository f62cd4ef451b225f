"""Protobuf conversions of the manager's wire types: instance state and role, load reports.

The wire enums map through the SDK's one table each (`blitzmesh.convert`); the core's enums are
the SDK's names in upper case ("serving" <-> InstanceState.SERVING).
"""

from __future__ import annotations

import dataclasses

from blitzmesh import convert
from blitzmesh.types import LoadReport
from blitzmesh.v1 import common_pb2
from services.global_manager.core.types import InstanceState, LoadSample, Role


def state_from_proto(value: int) -> InstanceState:
    """UNSPECIFIED, and a value this build does not know, read as IDLE: a worker that says nothing
    about its model holds none that the manager may route to."""
    name = convert.instance_state_from_proto(value)
    return InstanceState.IDLE if name == "unspecified" else InstanceState(name.upper())


def state_to_proto(state: InstanceState) -> common_pb2.InstanceState.ValueType:
    return convert.instance_state_to_proto(state.value.lower())


def role_from_proto(value: int) -> Role:
    """UNSPECIFIED reads as COLOCATED (the default deployment).

    Raises:
        ValueError: for a value this build does not know; guessing a role would misplace the
            instance in the prefill/decode pools.
    """
    name = convert.instance_role_from_proto(value)
    if name != "unspecified":
        return Role(name.upper())
    if value != common_pb2.INSTANCE_ROLE_UNSPECIFIED:
        raise ValueError(f"unknown InstanceRole value {value!r}")
    return Role.COLOCATED


def role_to_proto(role: Role) -> common_pb2.InstanceRole.ValueType:
    return convert.instance_role_to_proto(role.value.lower())


# The LoadSample fields a worker reports, named as in LoadReport; on the wire 0 stands for "no
# observation" in those the core keeps as None.
_REPORTED = tuple(f.name for f in dataclasses.fields(LoadSample) if f.name not in ("instance_id", "now_s"))
_OPTIONAL = frozenset({"ttft_p50_s", "ttft_p99_s", "tbt_p50_s", "tbt_p99_s", "est_tpot_s"})


def sample_from_proto(instance_id: str, now_s: float, msg: common_pb2.LoadReport) -> LoadSample:
    """A worker's LoadReport as the core's LoadSample (tokens_generated_total is not kept)."""
    load = convert.load_report_from_proto(msg)
    values = {name: getattr(load, name) for name in _REPORTED}
    for name in _OPTIONAL:
        values[name] = values[name] if values[name] > 0 else None
    return LoadSample(instance_id=instance_id, now_s=now_s, **values)


def sample_to_proto(sample: LoadSample) -> common_pb2.LoadReport:
    """The inverse of `sample_from_proto`: "no observation" goes back on the wire as 0."""
    values = {name: getattr(sample, name) for name in _REPORTED}
    for name in _OPTIONAL:
        values[name] = values[name] or 0.0
    return convert.load_report_to_proto(LoadReport(**values))
