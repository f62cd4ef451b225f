"""The gateway's side of an ESP route (elastic sequence parallelism, docs/esp.md): the manager
routed the request to a group's master (`RouteHop.esp` names the whole group). Every member but
the master is called here in the background with its `EspMember`; the master is streamed like
any hop, with its own. A holder whose call fails is reported to the manager (so the next plan
routes around it); the master's stream then fails UNAVAILABLE too and the attempt loop re-routes
the request, resumed after the tokens it already has."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable
from dataclasses import dataclass, field

import grpc
import structlog

from blitzmesh.v1 import global_manager_pb2, worker_pb2, worker_pb2_grpc
from services.common.waiting import wait_for

log = structlog.get_logger()


def member_spec(group: global_manager_pb2.EspGroupRoute, index: int) -> worker_pb2.EspMember:
    return worker_pb2.EspMember(
        group_id=group.group_id,
        index=index,
        bounds=list(group.bounds),
        member_addresses=[m.dataplane_address for m in group.members],
        spare_addresses=[s.dataplane_address for s in group.spares],
    )


@dataclass
class EspCalls:
    """The holders' calls of one attempt on a group; `lost_id` names a holder whose own call
    failed (the member that broke the group, rather than the master that reports it)."""

    tasks: list[asyncio.Task[None]] = field(default_factory=list)
    lost_id: str | None = None
    lost: asyncio.Event = field(default_factory=asyncio.Event)

    def cancel(self) -> None:
        for t in self.tasks:
            if not t.done():
                t.cancel()


def start_holders(
    group: global_manager_pb2.EspGroupRoute,
    request: worker_pb2.WorkerGenerateRequest,
    worker: Callable[[str], worker_pb2_grpc.WorkerStub],
    timeout_s: float,
    report_failure: Callable[[str, grpc.StatusCode, str], None],
    on_lost: Callable[[str], None],
) -> EspCalls:
    """Call every member but the last (the master) with `request` in its place of the group. A
    holder whose call fails on its own (not because the group broke elsewhere) is reported to
    the manager and `on_lost` ends the master's stream at once: the master would otherwise wait
    out the group's timeout for the dead member's partial results."""
    calls = EspCalls()
    if len(group.members) < 1 or len(group.bounds) != len(group.members) + 1:
        raise ValueError(f"ESP route {group.group_id!r}: {len(group.members)} members for bounds {list(group.bounds)}")

    async def hold(j: int, hop: global_manager_pb2.RouteHop) -> None:
        req = worker_pb2.WorkerGenerateRequest()
        req.CopyFrom(request)
        req.esp_member.CopyFrom(member_spec(group, j))
        try:
            async for _ in worker(hop.address).Generate(req, timeout=timeout_s):
                pass
        except grpc.aio.AioRpcError as e:
            detail = e.details() or ""
            log.warning("esp_holder_failed", group=group.group_id, instance_id=hop.instance_id, code=e.code().name)
            if "lost its group" in detail or calls.lost_id is not None:
                return
            calls.lost_id = hop.instance_id
            calls.lost.set()
            if e.code() != grpc.StatusCode.RESOURCE_EXHAUSTED:  # a full member is not a broken one
                report_failure(hop.instance_id, e.code(), detail)
            on_lost(f"ESP group {group.group_id!r}: member {j} ({hop.instance_id}) failed: {e.code().name}: {detail}")

    for j, hop in enumerate(group.members[:-1]):
        calls.tasks.append(asyncio.ensure_future(hold(j, hop)))
    return calls


async def wait_holders(calls: EspCalls | None, timeout_s: float = 5.0) -> None:
    """Let the holders' calls end (they do when the master ends the request)."""
    if calls is None or not calls.tasks:
        return
    with contextlib.suppress(TimeoutError):
        await wait_for(asyncio.gather(*calls.tasks, return_exceptions=True), timeout_s)
    calls.cancel()


async def failed_member(calls: EspCalls, master_id: str, detail: str, wait_s: float = 2.0) -> str:
    """Which instance an ESP attempt failed on: the master, unless it reports that it lost its
    group, in which case the holder whose call failed (waited for up to `wait_s`) if any."""
    if "lost its group" in detail and calls.lost_id is None:
        with contextlib.suppress(TimeoutError):
            await wait_for(calls.lost.wait(), wait_s)
    return calls.lost_id or master_id
