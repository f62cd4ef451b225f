"""Protobuf conversions of the manager's wire types: instance state and role, load reports.

The wire enums map through the SDK's one table each (`blitzmesh.convert`); the core's enums are
the SDK's names in upper case ("serving" <-> InstanceState.SERVING).
"""

from __future__ import annotations

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


def sample_from_proto(instance_id: str, now_s: float, msg: common_pb2.LoadReport) -> LoadSample:
    """A worker's LoadReport as the core's LoadSample (tokens_generated_total is not kept)."""
    load = convert.load_report_from_proto(msg)

    # A worker reports 0 latency when it observed none; the core wants None for "no observation".
    def opt(v: float) -> float | None:
        return v if v > 0 else None

    return LoadSample(
        instance_id=instance_id,
        now_s=now_s,
        decode_tps=load.decode_tps,
        prefill_tps=load.prefill_tps,
        ttft_p50_s=opt(load.ttft_p50_s),
        ttft_p99_s=opt(load.ttft_p99_s),
        tbt_p50_s=opt(load.tbt_p50_s),
        tbt_p99_s=opt(load.tbt_p99_s),
        running=load.running,
        waiting=load.waiting,
        waiting_prefill_tokens=load.waiting_prefill_tokens,
        kv_blocks_used=load.kv_blocks_used,
        kv_blocks_total=load.kv_blocks_total,
        zigzag_running=load.zigzag_running,
        zigzag_relayed_total=load.zigzag_relayed_total,
        zigzag_continued_total=load.zigzag_continued_total,
        est_tpot_s=opt(load.est_tpot_s),
        slo_rejected_total=load.slo_rejected_total,
        preempted_total=load.preempted_total,
        prefix_hit_tokens=load.prefix_hit_tokens,
        prefix_query_tokens=load.prefix_query_tokens,
    )


def sample_to_proto(sample: LoadSample) -> common_pb2.LoadReport:
    """The inverse of `sample_from_proto`: "no observation" goes back on the wire as 0."""
    return convert.load_report_to_proto(
        LoadReport(
            decode_tps=sample.decode_tps,
            prefill_tps=sample.prefill_tps,
            ttft_p50_s=sample.ttft_p50_s or 0.0,
            ttft_p99_s=sample.ttft_p99_s or 0.0,
            tbt_p50_s=sample.tbt_p50_s or 0.0,
            tbt_p99_s=sample.tbt_p99_s or 0.0,
            running=sample.running,
            waiting=sample.waiting,
            waiting_prefill_tokens=sample.waiting_prefill_tokens,
            kv_blocks_used=sample.kv_blocks_used,
            kv_blocks_total=sample.kv_blocks_total,
            zigzag_running=sample.zigzag_running,
            zigzag_relayed_total=sample.zigzag_relayed_total,
            zigzag_continued_total=sample.zigzag_continued_total,
            est_tpot_s=sample.est_tpot_s or 0.0,
            slo_rejected_total=sample.slo_rejected_total,
            preempted_total=sample.preempted_total,
            prefix_hit_tokens=sample.prefix_hit_tokens,
            prefix_query_tokens=sample.prefix_query_tokens,
        )
    )
