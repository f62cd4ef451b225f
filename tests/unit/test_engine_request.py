"""The engine request's status order and the mode its `generate` flags name."""

from __future__ import annotations

import pytest

from services.worker.engine.request import RequestMode, RequestStatus

S = RequestStatus
M = RequestMode


def test_status_order_groups_queued_admitted_and_finished() -> None:
    queued = [s for s in S if s.is_queued()]
    admitted = [s for s in S if s.is_admitted()]
    finished = [s for s in S if s.is_finished()]
    assert queued == [S.WAITING, S.PREEMPTED, S.SWAPPED]
    assert admitted == [S.WAITING_FOR_KV, S.RUNNING, S.MIGRATING]
    assert finished[0] is S.FINISHED_STOPPED and S.FINISHED_FAILED in finished
    # Every status is in exactly one group, and the groups follow each other in that order.
    assert queued + admitted + finished == list(S)
    assert [S.finished(r) for r in ("stop", "length", "abort")] == [
        S.FINISHED_STOPPED,
        S.FINISHED_LENGTH,
        S.FINISHED_ABORTED,
    ]


@pytest.mark.parametrize(
    ("flags", "mode"),
    [
        ({}, M.COLOCATED),
        ({"handoff": True}, M.PREFILL_HANDOFF),
        ({"kv_fill": True}, M.DECODE_FROM_KV),
        ({"zigzag": True}, M.ZIGZAG_FIRST_LAYERS),
        ({"relay": True}, M.ZIGZAG_PARTNER),
        ({"relay": True, "handoff": True}, M.ZIGZAG_PARTNER_HANDOFF),
    ],
)
def test_mode_of_flags(flags: dict[str, bool], mode: RequestMode) -> None:
    args = {"handoff": False, "kv_fill": False, "zigzag": False, "relay": False, **flags}
    assert RequestMode.of(**args) is mode


@pytest.mark.parametrize(
    "flags",
    [
        {"handoff": True, "kv_fill": True},
        {"zigzag": True, "relay": True},
        {"zigzag": True, "handoff": True},
        {"kv_fill": True, "relay": True},
        {"relay": True, "handoff": True, "zigzag": True},
    ],
)
def test_flags_that_name_no_mode_are_refused(flags: dict[str, bool]) -> None:
    args = {"handoff": False, "kv_fill": False, "zigzag": False, "relay": False, **flags}
    with pytest.raises(ValueError, match="name no request mode"):
        RequestMode.of(**args)


def test_mode_properties_and_relay() -> None:
    assert {m for m in M if m.hands_off} == {M.PREFILL_HANDOFF, M.ZIGZAG_PARTNER_HANDOFF}
    assert {m for m in M if m.relayed} == {M.ZIGZAG_PARTNER, M.ZIGZAG_PARTNER_HANDOFF}
    assert {m for m in M if m.computes_prompt_here} == {M.COLOCATED, M.PREFILL_HANDOFF}
    assert M.COLOCATED.with_relay() is M.ZIGZAG_PARTNER
    assert M.PREFILL_HANDOFF.with_relay() is M.ZIGZAG_PARTNER_HANDOFF
    assert M.ZIGZAG_PARTNER.with_relay() is M.ZIGZAG_PARTNER
    for mode in (M.DECODE_FROM_KV, M.ZIGZAG_FIRST_LAYERS):
        with pytest.raises(ValueError, match="cannot be taken over"):
            mode.with_relay()
