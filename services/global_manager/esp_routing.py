"""The manager's ESP routing (LoongServe): a request no single instance's KV can hold, or whose
prompt reaches `esp_min_prompt_tokens`, is routed to a group of instances that prefill it
together, formed by `core.esp.plan_group` over the SERVING instances' free KV (from their
heartbeats). The route is one hop, the group's master, carrying the whole group
(`RouteHop.esp`); the gateway calls every member. A request too long for every group now gets
UNAVAILABLE naming the KV it needs and what is free, so the gateway waits within its deadline
and asks again; one longer than all of them together hold is refused at once (400). The groups formed most recently are kept for `GetCluster` and the metrics.

The workers' heartbeats name the groups each instance is in now (`LoadReport.esp_groups`). From
them the router knows each recent group's holders, when a spare joins one (the master scaled up
during decode: event `esp_scale_up`) and when one ends (no instance reports it any more: event
`esp_group_end`), so `GetCluster` shows which groups are live and who holds their KV.
"""

from __future__ import annotations

import collections
import dataclasses
import itertools
import math
import time
from collections.abc import Collection, Sequence
from dataclasses import dataclass

from prometheus_client import Counter, Gauge, Histogram

from blitzmesh.convert import esp_group_to_proto
from blitzmesh.types import EspGroup
from blitzmesh.v1 import admin_pb2, global_manager_pb2
from services.global_manager.core.esp import EspInstance, EspRequest, plan_group
from services.global_manager.core.types import InstanceState, InstanceView

ESP_GROUPS = Counter("blitzmesh_gm_esp_groups_total", "ESP groups formed, by degree", ["degree"])
ESP_REFUSED = Counter("blitzmesh_gm_esp_unplaced_total", "Requests no ESP group could hold at the time")
ESP_DEGREE = Gauge("blitzmesh_gm_esp_last_degree", "Members of the ESP group formed last")
ESP_LIVE = Gauge("blitzmesh_gm_esp_groups_live", "ESP groups some instance reports being in now")
ESP_DECISION = Histogram(
    "blitzmesh_gm_esp_decision_seconds",
    "Time to plan one ESP group",
    buckets=(1e-4, 5e-4, 1e-3, 5e-3, 0.01, 0.02, 0.05, 0.1),
)

_RECENT = 32  # groups kept for GetCluster
_SEEN_AFTER_S = 0.5  # a heartbeat sampled this long after a group was planned shows its blocks
# A holder not heard from for this long is dropped (a lost instance sends no heartbeat saying it
# left); a group no heartbeat ever named within this long ended before any showed it (or never
# started: the gateway gave up on it).
_HOLDER_STALE_S = 10.0


class EspUnplaced(Exception):
    """The request needs a group and none can hold it now (the message says what it needs)."""


@dataclass(frozen=True)
class GroupRecord:
    group_id: str
    request_id: str
    model_id: str
    members: tuple[str, ...]
    bounds: tuple[int, ...]
    spares: tuple[str, ...]
    formed_s: float


@dataclass
class GroupLife:
    """What the heartbeats say of one group: its holders (instance id -> when last reported) and
    whether it ended."""

    holders: dict[str, float]
    seen: bool = False
    ended: bool = False
    kv_tokens: dict[str, int] = dataclasses.field(default_factory=dict)  # holder -> KV tokens, last reported


class EspRouter:
    """Plans ESP groups for the manager's Schedule and remembers the recent ones."""

    def __init__(
        self, *, block_size: int, min_prompt_tokens: int = 0, enabled: bool = True, reserve_s: float = 3.0
    ) -> None:
        if min_prompt_tokens < 0:
            raise ValueError(f"esp_min_prompt_tokens must be >= 0, got {min_prompt_tokens!r}")
        self.block_size = block_size
        self.min_prompt_tokens = min_prompt_tokens
        self.enabled = enabled
        self.recent: collections.deque[GroupRecord] = collections.deque(maxlen=_RECENT)
        self.life: dict[str, GroupLife] = {}  # group id -> its holders, for the groups in `recent`
        self._ids = itertools.count(1)
        # KV tokens promised to groups planned in the last `reserve_s` seconds, which the
        # instances' heartbeats may not show yet: two groups are never planned on the same room.
        self.reserve_s = reserve_s
        self._reserved: collections.deque[tuple[float, dict[str, int]]] = collections.deque()

    def _reservations(self, now: float, views: list[InstanceView]) -> dict[str, int]:
        """Tokens promised per instance that its latest heartbeat may not show: promised within
        `reserve_s`, and not yet followed by a heartbeat sampled `_SEEN_AFTER_S` later (by
        then the group holds its blocks and the heartbeat counts them)."""
        while self._reserved and now - self._reserved[0][0] > self.reserve_s:
            self._reserved.popleft()
        sampled = {v.instance_id: v.load.now_s for v in views if v.load is not None}
        out: dict[str, int] = {}
        for t, tokens in self._reserved:
            for iid, n in tokens.items():
                if sampled.get(iid, -math.inf) < t + _SEEN_AFTER_S:
                    out[iid] = out.get(iid, 0) + n
        return out

    def candidates(self, views: list[InstanceView], excluded: Collection[str], dataplane: dict) -> list[InstanceView]:
        return [
            v
            for v in views
            if v.state is InstanceState.SERVING
            and v.instance_id not in excluded
            and v.load is not None
            and v.load.kv_blocks_total > 0
            and dataplane.get(v.instance_id, (b"", ""))[0]
        ]

    def wants_group(self, views: list[InstanceView], prompt_tokens: int, max_tokens: int) -> bool:
        """Whether the request goes to a group: it is too long for every single instance (by its
        KV capacity), or its prompt reaches the configured threshold; and all of them together
        could hold it (else waiting is pointless: the ordinary route refuses it with the KV
        figures)."""
        if not self.enabled or not views:
            return False
        capacities = [v.load.kv_blocks_total * self.block_size for v in views if v.load is not None]
        if prompt_tokens + max_tokens > sum(capacities):
            return False  # no group of these could ever hold it: one instance refuses it at once (400)
        if self.min_prompt_tokens and prompt_tokens >= self.min_prompt_tokens:
            return True
        return prompt_tokens + max_tokens > max(capacities)

    def plan(
        self,
        request: global_manager_pb2.ScheduleRequest,
        views: list[InstanceView],
        hop_of: dict[str, global_manager_pb2.RouteHop],
        now_s: float,
    ) -> global_manager_pb2.RouteHop:
        """The master's hop carrying the group; EspUnplaced when no group holds it now. `now_s`
        is the manager's clock (the heartbeats' `LoadSample.now_s`)."""
        started = time.perf_counter()
        bs = self.block_size
        reserved = self._reservations(now_s, views)
        insts = [
            EspInstance(
                v.instance_id,
                min(v.load.kv_blocks_used * bs + reserved.get(v.instance_id, 0), v.load.kv_blocks_total * bs),
                v.load.kv_blocks_total * bs,
            )
            for v in views
            if v.load is not None
        ]
        plan = plan_group(
            EspRequest(request.request_id, max(request.prompt_tokens, 1)), request.max_tokens, insts, block_size=bs
        )
        ESP_DECISION.observe(time.perf_counter() - started)
        if plan is None:
            ESP_REFUSED.inc()
            free = sum(i.free for i in insts)
            raise EspUnplaced(
                f"request {request.request_id!r} needs {request.prompt_tokens} + {request.max_tokens} KV tokens;"
                f" no group of the {len(insts)} SERVING instances holds it now ({free} tokens free in all)"
            )
        promised = {m: b - a for m, a, b in zip(plan.members, plan.bounds, plan.bounds[1:], strict=False)}
        promised[plan.members[-1]] += request.max_tokens
        self._reserved.append((now_s, promised))
        group_id = f"esp-{next(self._ids)}-{request.request_id}"
        if len(self.recent) == self.recent.maxlen:
            self.life.pop(self.recent[-1].group_id, None)
        self.recent.appendleft(
            GroupRecord(
                group_id, request.request_id, request.model_id, plan.members, plan.bounds, plan.spares, time.time()
            )
        )
        self.life[group_id] = GroupLife({})
        ESP_GROUPS.labels(str(len(plan.members))).inc()
        ESP_DEGREE.set(len(plan.members))
        master = global_manager_pb2.RouteHop()
        master.CopyFrom(hop_of[plan.members[-1]])
        master.esp.CopyFrom(
            global_manager_pb2.EspGroupRoute(
                group_id=group_id,
                bounds=list(plan.bounds),
                members=[hop_of[m] for m in plan.members],
                spares=[hop_of[s] for s in plan.spares],
            )
        )
        return master

    def observe(
        self, instance_id: str, group_ids: Sequence[str], now_s: float, kv_tokens: Sequence[int] = ()
    ) -> list[tuple[str, GroupRecord, str]]:
        """A heartbeat of `instance_id` naming the groups it is in now (`now_s` on the clock of
        `GroupRecord.formed_s`) and the KV tokens it holds for each (`kv_tokens`, same order;
        none from a worker that does not say): the groups that scaled up (a spare reports one)
        or ended (no holder left), as (event kind, group, detail)."""
        reported = set(group_ids)
        tokens = dict(zip(group_ids, kv_tokens, strict=False))
        events: list[tuple[str, GroupRecord, str]] = []
        for rec in self.recent:
            life = self.life.get(rec.group_id)
            if life is None or life.ended:
                continue
            if rec.group_id in reported:
                joined = instance_id not in life.holders and instance_id not in rec.members
                life.holders[instance_id] = now_s
                if rec.group_id in tokens:
                    life.kv_tokens[instance_id] = int(tokens[rec.group_id])
                life.seen = True
                if joined:
                    events.append(("esp_scale_up", rec, f"{instance_id} joined as master (the last one's KV was full)"))
            else:
                life.holders.pop(instance_id, None)
                life.kv_tokens.pop(instance_id, None)
            for iid, heard in list(life.holders.items()):
                if now_s - heard > _HOLDER_STALE_S:
                    del life.holders[iid]
                    life.kv_tokens.pop(iid, None)
            if not life.holders and (life.seen or now_s - rec.formed_s > _HOLDER_STALE_S):
                life.ended = True
                why = "no instance reports it any more" if life.seen else "no heartbeat ever showed it"
                events.append(("esp_group_end", rec, f"ended after {now_s - rec.formed_s:.1f} s: {why}"))
        ESP_LIVE.set(sum(1 for life in self.life.values() if not life.ended))
        return events

    def to_proto(self) -> list[admin_pb2.EspGroupInfo]:
        now = time.time()
        ended = GroupLife({}, ended=True)  # a group `life` no longer follows
        out = []
        for g in self.recent:
            life = self.life.get(g.group_id, ended)
            age = max(0.0, now - g.formed_s)
            holders = tuple(sorted(life.holders))
            group = EspGroup(
                g.group_id, g.request_id, g.model_id, g.members, g.bounds, g.spares, age,
                holder_ids=holders, live=not life.ended,
                holder_kv_tokens=tuple(life.kv_tokens.get(h, 0) for h in holders),
            )  # fmt: skip
            out.append(esp_group_to_proto(group))
        return out
