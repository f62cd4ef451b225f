"""The wire enums (finish reason, instance state, instance role) and LoadReport have one converter
pair each, in `blitzmesh.convert`; the global manager's wire converters and the worker go through it.

Every enum value is checked both ways, and so is what happens to UNSPECIFIED and to a value this
build does not know:

- finish reason: UNSPECIFIED <-> None; an unknown value or name raises ValueError (it drives logic).
- SDK state and role: UNSPECIFIED <-> "unspecified"; an unknown value reads as "unspecified" (it
  is only displayed); an unknown name raises ValueError.
- manager state: UNSPECIFIED and unknown values read as IDLE.
- manager role: UNSPECIFIED reads as COLOCATED; an unknown value raises ValueError.
"""

from __future__ import annotations

import dataclasses
import typing

import pytest
from google.protobuf.descriptor import FieldDescriptor

from blitzmesh import convert, types
from blitzmesh.v1 import common_pb2
from services.global_manager import convert as gm_convert
from services.global_manager.core.types import InstanceState, LoadSample, Role
from services.global_manager.instance_table import InstanceTable
from services.worker.config import WorkerConfig
from services.worker.service import WorkerServicer

pytestmark = [pytest.mark.timeout(10), pytest.mark.filterwarnings("error")]

UNKNOWN = 99  # proto3 enums are open: a newer peer may send a value this build has no name for


def _names(enum: typing.Any, prefix: str) -> dict[int, str]:
    """Wire value -> the SDK's name for it (the enum's name, prefix dropped, lower case)."""
    return {v: enum.Name(v).removeprefix(prefix).lower() for v in enum.values()}


# ---- SDK ------------------------------------------------------------------------------------


def test_finish_reason_every_value_both_ways():
    names = _names(common_pb2.FinishReason, "FINISH_REASON_")
    assert set(names.values()) - {"unspecified"} == set(typing.get_args(types.FinishReason))
    for value, name in names.items():
        expected = None if name == "unspecified" else name
        assert convert.finish_reason_from_proto(value) == expected
        assert convert.finish_reason_to_proto(expected) == value  # type: ignore[arg-type]


def test_finish_reason_unknown_is_an_error_both_ways():
    with pytest.raises(ValueError, match=str(UNKNOWN)):
        convert.finish_reason_from_proto(UNKNOWN)
    with pytest.raises(ValueError, match="'eos'"):
        convert.finish_reason_to_proto("eos")  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("enum", "prefix", "literal", "to_proto", "from_proto"),
    [
        pytest.param(
            common_pb2.InstanceState,
            "INSTANCE_STATE_",
            types.InstanceState,
            convert.instance_state_to_proto,
            convert.instance_state_from_proto,
            id="state",
        ),
        pytest.param(
            common_pb2.InstanceRole,
            "INSTANCE_ROLE_",
            types.InstanceRole,
            convert.instance_role_to_proto,
            convert.instance_role_from_proto,
            id="role",
        ),
    ],
)
def test_state_and_role_every_value_both_ways(enum, prefix, literal, to_proto, from_proto):
    names = _names(enum, prefix)
    assert set(names.values()) == set(typing.get_args(literal))
    for value, name in names.items():
        assert from_proto(value) == name
        assert to_proto(name) == value
    assert from_proto(UNKNOWN) == "unspecified"
    with pytest.raises(ValueError, match="'busy'"):
        to_proto("busy")


def test_load_report_every_field_both_ways():
    # Distinct non-zero values, so a swapped or dropped field fails; floats exact in binary.
    fields = common_pb2.LoadReport.DESCRIPTOR.fields
    assert [f.name for f in fields] == [f.name for f in dataclasses.fields(types.LoadReport)]
    real = (FieldDescriptor.CPPTYPE_FLOAT, FieldDescriptor.CPPTYPE_DOUBLE)

    def value(i: int, f: FieldDescriptor) -> typing.Any:
        if f.is_repeated:  # the ESP group ids, and the KV tokens held for each
            return (f"g{i}", f"h{i}") if f.cpp_type == FieldDescriptor.CPPTYPE_STRING else (i + 1, i + 2)
        return (i + 1) * 1.5 if f.cpp_type in real else i + 1

    load = types.LoadReport(**{f.name: value(i, f) for i, f in enumerate(fields)})
    msg = convert.load_report_to_proto(load)
    as_python = [tuple(getattr(msg, f.name)) if f.is_repeated else getattr(msg, f.name) for f in fields]
    assert as_python == [getattr(load, f.name) for f in fields]
    assert convert.load_report_from_proto(msg) == load


# ---- global manager ---------------------------------------------------------------------------


def test_manager_state_every_value_both_ways():
    for state in InstanceState:
        value = gm_convert.state_to_proto(state)
        assert common_pb2.InstanceState.Name(value) == f"INSTANCE_STATE_{state.value}"
        assert gm_convert.state_from_proto(value) is state
    assert gm_convert.state_from_proto(common_pb2.INSTANCE_STATE_UNSPECIFIED) is InstanceState.IDLE
    assert gm_convert.state_from_proto(UNKNOWN) is InstanceState.IDLE


def test_manager_role_every_value_both_ways():
    for role in Role:
        value = gm_convert.role_to_proto(role)
        assert common_pb2.InstanceRole.Name(value) == f"INSTANCE_ROLE_{role.value}"
        assert gm_convert.role_from_proto(value) is role
    assert gm_convert.role_from_proto(common_pb2.INSTANCE_ROLE_UNSPECIFIED) is Role.COLOCATED
    with pytest.raises(ValueError, match=str(UNKNOWN)):
        gm_convert.role_from_proto(UNKNOWN)


def test_manager_load_sample_every_field_both_ways():
    sample = LoadSample(
        instance_id="w",
        now_s=3.0,
        decode_tps=2500.5,
        prefill_tps=9000.25,
        ttft_p50_s=0.125,
        ttft_p99_s=0.875,
        tbt_p50_s=0.015625,
        tbt_p99_s=0.0625,
        running=12,
        waiting=3,
        waiting_prefill_tokens=4096,
        kv_blocks_used=700,
        kv_blocks_total=1024,
        prefill_capacity_tps=12000.5,
    )
    msg = gm_convert.sample_to_proto(sample)
    # The core does not keep the worker's lifetime token count; everything else travels.
    assert msg.tokens_generated_total == 0
    assert gm_convert.sample_from_proto("w", 3.0, msg) == sample


def test_manager_load_sample_no_observation_is_zero_on_the_wire():
    empty = LoadSample(instance_id="w", now_s=1.0)
    msg = gm_convert.sample_to_proto(empty)
    assert msg == common_pb2.LoadReport()
    assert gm_convert.sample_from_proto("w", 1.0, msg) == empty


def test_manager_table_reports_the_load_it_was_sent():
    table = InstanceTable()
    info = common_pb2.InstanceInfo(
        instance_id="w1",
        state=common_pb2.INSTANCE_STATE_SERVING,
        role=common_pb2.INSTANCE_ROLE_PREFILL,
        model_id="m",
        layers_loaded=2,
        num_layers=2,
    )
    table.upsert(info, now_s=1.0)
    load = common_pb2.LoadReport(decode_tps=7.5, ttft_p99_s=0.25, running=2, kv_blocks_used=3, kv_blocks_total=8)
    view = table.registry.heartbeat(gm_convert.sample_from_proto("w1", 2.0, load))
    back = table.to_proto(view, now_s=2.0)
    assert back.load == load
    assert back.state == common_pb2.INSTANCE_STATE_SERVING and back.role == common_pb2.INSTANCE_ROLE_PREFILL


# ---- worker -----------------------------------------------------------------------------------


@pytest.mark.parametrize("role", typing.get_args(types.InstanceRole)[1:])
def test_worker_reports_its_state_and_role_on_the_wire(role):
    servicer = WorkerServicer(WorkerConfig(instance_id="w", role=role))
    assert servicer.state == "idle"
    for state in typing.get_args(types.InstanceState):
        servicer.state = state
        info = convert.instance_info_from_proto(servicer.info())
        assert (info.state, info.role) == (state, role)
        assert info.load == types.LoadReport()  # no engine yet: an all-zero report
