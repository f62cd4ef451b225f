"""Fill a model with parameter groups over the data plane.

A load is a set of data-plane pulls, received straight into each group's final buffer:
- with a chain plan from the global manager: for every chain this instance is a hop of, pull
  the chain's groups from the hop before it (the chain's source for the first hop); our own
  GroupServer forwards each landed chunk to the hop after us;
- without a plan: one pull per host-cache shard (sharded transfer from the global pool).
Each pull from an upstream falls back, shard by shard, to a host cache that holds those
groups, so a hop that dies mid-transfer costs a pause, not the load; and when every source of a
pull has failed, the parameter manager is asked where its groups are now (`locate_sources`): a
host cache that restarted listens at a new data-plane address.
"""

from __future__ import annotations

import asyncio
import time
from collections import defaultdict
from collections.abc import Awaitable, Callable, Iterable, Sequence
from typing import TypeVar

import grpc
import numpy as np
import structlog
import torch

from blitzmesh.v1 import param_manager_pb2, param_manager_pb2_grpc, worker_pb2
from services.common import roles
from services.common.grpc_util import channel
from services.dataplane.chain import Pull
from services.dataplane.manifest import GroupEntry, Manifest
from services.model_format.generation import eos_token_ids
from services.model_format.groups import live_load_order

log = structlog.get_logger()
T = TypeVar("T")
# A parameter manager that restarts (its supervisor brings it back in a second or two) is
# waited for, not a failed load: UNAVAILABLE is retried with this backoff within the call's time.
PM_RETRY_BACKOFF_S = 0.2
PM_RETRY_BACKOFF_MAX_S = 2.0


def pinned_allocate(entry: GroupEntry) -> np.ndarray:
    """Page-locked host memory for one group (a CUDA worker): the data plane lands chunks in it,
    and the group's copy to the device, made as soon as it is verified, runs at full PCIe speed
    and may overlap the transfer of the next group. The array keeps its tensor alive (`.base`)."""
    return torch.empty(entry.size_bytes, dtype=torch.uint8, pin_memory=True).numpy()


async def call_param_manager(
    pm_address: str,
    what: str,
    call: Callable[[param_manager_pb2_grpc.ParamManagerStub, float], Awaitable[T]],
    timeout_s: float,
) -> T:
    """`call(stub, timeout)` on the parameter manager, again after UNAVAILABLE (it is restarting)
    until `timeout_s` is spent; any other error at once."""
    deadline = time.monotonic() + timeout_s
    backoff_s = PM_RETRY_BACKOFF_S
    while True:
        try:
            async with channel(pm_address, roles.PARAM_MANAGER) as ch:
                stub = param_manager_pb2_grpc.ParamManagerStub(ch)
                return await call(stub, max(0.1, deadline - time.monotonic()))
        except grpc.aio.AioRpcError as e:
            if e.code() != grpc.StatusCode.UNAVAILABLE or time.monotonic() + backoff_s >= deadline:
                raise
            log.warning("param_manager_unavailable", call=what, address=pm_address, retry_in_s=backoff_s)
        await asyncio.sleep(backoff_s)
        backoff_s = min(PM_RETRY_BACKOFF_MAX_S, backoff_s * 2)


async def fetch_layout_and_locations(
    pm_address: str, model_id: str, timeout_s: float
) -> tuple[param_manager_pb2.ModelLayout, param_manager_pb2.LocateResponse]:
    async def both(
        stub: param_manager_pb2_grpc.ParamManagerStub, t: float
    ) -> tuple[param_manager_pb2.ModelLayout, param_manager_pb2.LocateResponse]:
        layout = await stub.GetModel(param_manager_pb2.GetModelRequest(model_id=model_id), timeout=t)
        where = await stub.Locate(param_manager_pb2.LocateRequest(model_id=model_id), timeout=t)
        return layout, where

    return await call_param_manager(pm_address, "GetModel+Locate", both, timeout_s)


async def fetch_eos_token_ids(pm_address: str, model_id: str, timeout_s: float) -> frozenset[int]:
    """Every EOS id the model declares (config, generation config, tokenizer), from its side files."""
    resp = await call_param_manager(
        pm_address,
        "GetModelFiles",
        lambda stub, t: stub.GetModelFiles(param_manager_pb2.GetModelRequest(model_id=model_id), timeout=t),
        timeout_s,
    )
    # Parsing tokenizer.json takes a while: off the event loop.
    return await asyncio.to_thread(eos_token_ids, dict(resp.files))


LOCATE_TIMEOUT_S = 5.0  # one Locate call while a load waits on it


async def locate_sources(
    pm_address: str, model_id: str, groups: Sequence[str], *, exclude: str = "", timeout_s: float = LOCATE_TIMEOUT_S
) -> list[bytes]:
    """Data-plane addresses of the holders (host caches first, then SERVING instances) that hold
    every one of `groups` now, per the parameter manager; `exclude` is this instance's id."""
    where = await call_param_manager(
        pm_address,
        "Locate",
        lambda stub, t: stub.Locate(param_manager_pb2.LocateRequest(model_id=model_id, groups=groups), timeout=t),
        timeout_s,
    )
    holding: dict[bytes, tuple[str, set[str]]] = {}
    for loc in where.locations:
        for h in loc.holder_info:
            if h.dataplane_address and h.holder_id != exclude:
                holding.setdefault(h.dataplane_address, (h.kind, set()))[1].add(loc.group)
    whole = [addr for addr, (_, held) in holding.items() if held.issuperset(groups)]
    return sorted(whole, key=lambda addr: holding[addr][0] != "host_cache")  # stable: host caches first


def host_shards(where: param_manager_pb2.LocateResponse) -> dict[bytes, list[str]]:
    """Host-cache dataplane address -> the groups it holds (the first cache listed per group)."""
    shards: dict[bytes, list[str]] = defaultdict(list)
    for loc in where.locations:
        caches = [h for h in loc.holder_info if h.kind == "host_cache" and h.dataplane_address]
        if caches:
            shards[caches[0].dataplane_address].append(loc.group)
    return dict(shards)


def _split_by_shard(upstream: bytes, groups: Iterable[str], shards: dict[bytes, list[str]]) -> list[Pull]:
    """One pull per host shard: the shard holding exactly those groups is the fallback."""
    wanted = list(groups)
    owner = {g: addr for addr, gs in shards.items() for g in gs}
    by_owner: dict[bytes | None, list[str]] = defaultdict(list)
    for g in wanted:
        by_owner[owner.get(g)].append(g)
    return [
        Pull(upstream, tuple(gs), () if addr is None or addr == upstream else (addr,)) for addr, gs in by_owner.items()
    ]


def plan_pulls(
    instance_id: str,
    manifest: Manifest,
    plan: worker_pb2.TransferPlan | None,
    where: param_manager_pb2.LocateResponse,
) -> list[Pull]:
    """The pulls this instance runs for `plan` (or the default sharded pull from the pool)."""
    shards = host_shards(where)
    missing = [g for g in manifest.group_names if not any(g in gs for gs in shards.values())]
    if plan is None or not plan.chains:
        if missing:
            raise ValueError(f"no host cache holds groups {missing} of {manifest.model_id!r}")
        return [Pull(addr, tuple(live_load_order(gs))) for addr, gs in shards.items()]
    pulls: list[Pull] = []
    covered: set[str] = set()
    for chain in plan.chains:
        ids = [h.id for h in chain.hops]
        if instance_id not in ids:
            continue
        j = ids.index(instance_id)
        upstream = chain.source if j == 0 else chain.hops[j - 1]
        groups = list(chain.groups) or manifest.group_names
        overlap = covered.intersection(groups)
        if overlap:
            raise ValueError(f"plan {plan.plan_id!r} sends groups {sorted(overlap)} to {instance_id} twice")
        covered.update(groups)
        pulls.extend(_split_by_shard(upstream.dataplane_address, groups, shards))
    absent = [g for g in manifest.group_names if g not in covered]
    if absent:
        raise ValueError(
            f"plan {plan.plan_id!r} leaves groups {absent} of {manifest.model_id!r} to nobody for {instance_id}"
        )
    return pulls
