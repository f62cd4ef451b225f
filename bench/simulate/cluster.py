"""One simulated run: a leaf-spine cluster of simulated workers, driven by the real reconcile
core of the global manager.

Every `tick_s` the core's `Reconciler.reconcile` sees a `LoadMonitor` fed with the workers'
simulated LoadReports (every `heartbeat_s`) and the registry; its actions go to `SimActuator`,
which carries them out on the simulated cluster and reports outcomes back through the core's
`load_succeeded` / `drain_finished`, as the live `GrpcActuator` and servicer do. Each request is
routed with the core's `plan_route` when it arrives (queued at the gateway while nothing
serves). Loads follow the core's multicast plan (`plan_multicast`, sources pruned by
`SendingLinks` like the live actuator) timed on the links, or for the ServerlessLLM baseline a
per-host cache: a miss reads the SSD. While a chain tail loads, the core's ZigZag gate
(`should_zigzag`, `choose_zigzag_partner`) pairs it with an overloaded SERVING instance, whose
throughput grows by the layer-level model (`pair_throughput`; `partner_speedup` when several
loading instances share one partner).
"""

from __future__ import annotations

import dataclasses
import gc
import heapq
import math
import time
from collections import deque
from collections.abc import Collection, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

from blitzmesh.replay.schedule import Arrival
from blitzmesh.replay.summary import InstanceSample, RequestRecord, Slo, percentile, summarize
from services.common.backlog import BACKLOG_CHECK_S, backlog_is_news
from services.global_manager.core.actions import (
    Action,
    Count,
    DrainInstance,
    LoadInstances,
    MigrateRequests,
    Report,
    ResumeInstance,
    UpdateLocation,
)
from services.global_manager.core.instances import Registry
from services.global_manager.core.load_monitor import LoadMonitor
from services.global_manager.core.multicast import (
    HostLink,
    SendingLinks,
    Source,
    SourceKind,
    Target,
    Topology,
    plan_multicast,
    traffic_from_instances,
)
from services.global_manager.core.policies import make_policy
from services.global_manager.core.reconcile import (
    KEEP_WARM_MAX_S,
    Observations,
    Reconciler,
    ReconcileSettings,
    release_report,
)
from services.global_manager.core.routing import plan_route
from services.global_manager.core.types import InstanceState, InstanceView, Role
from services.global_manager.core.zigzag import (
    HandBack,
    ZigzagDispatch,
    ZigzagGate,
    ZigzagLive,
    ZigzagSettings,
    ZigzagStep,
    ZigzagTracker,
    plan_hand_back,
)

from .cpu import HostCpu
from .events import EventLoop
from .fastroute import IndexedRegistry
from .links import ClusterSpec, LeafSpine, Network
from .profiles import SimProfile
from .transfer import Transfer
from .worker import SimRequest, SimWorker, WindowStats

__all__ = ["Kill", "RunConfig", "SimActuator", "Simulation", "partner_speedup"]

S = InstanceState
# The states whose workers heartbeat a load report (an IDLE one is only seen).
REPORTING = (S.SERVING, S.LOADING, S.DRAINING)
_STATE_NAMES = {state: state.value.lower() for state in InstanceState}
Loader = Literal["blitz", "serverless"]
_ZIGZAG = ZigzagSettings()  # the live manager's defaults


@dataclass(frozen=True)
class Kill:
    """A failure injected at `at_s`: `instance_id`, or when empty the busiest SERVING instance
    (of `role` if given; running + waiting, then id). `mode` "sigkill": the process dies, its
    streams break at once and the gateway resumes them elsewhere; a connection to it fails at
    once. "hang" (SIGSTOP): it stops stepping and heartbeating but still accepts requests, which
    queue there until the core marks it LOST and the gateway (following the `instance_lost`
    event) resumes everything it held. Either way its heartbeats stop, so the real Reconciler
    marks it LOST after `lost_after_s` and tops its pool up to the floor."""

    at_s: float
    instance_id: str = ""
    role: Role | None = None
    mode: Literal["sigkill", "hang"] = "sigkill"


@dataclass(frozen=True)
class RunConfig:
    """One variant of a scenario: the cluster, the workload, and how it is scaled.

    `autoscale` False is a fixed pool of `initial` instances (its floor: a lost one is replaced).
    `disaggregated`: `initial_prefill` + `initial_decode` instances instead, the core run with
    `disaggregated=True` and those pool floors; `pd_layout` "mixed" alternates prefill and
    decode GPUs on every host (KV mostly over NVLink), "split_hosts" puts the prefill GPUs first
    (KV over RDMA). `kills`: failures to inject. `live_migration`: the core's `MigrateRequests`
    of running requests are carried out with their KV. `loader`: "blitz" (the GM's
    multicast chains from serving instances and the parameter manager's one host-memory copy
    spread over the hosts) or "serverless" (ServerlessLLM: each host caches the model in its
    memory while an instance there holds it and `keep_alive_s` after; a miss reads the SSD).
    """

    name: str
    profile: SimProfile
    cluster: ClusterSpec
    arrivals: tuple[Arrival, ...]
    initial: int = 1
    autoscale: bool = True
    policy: str = "heteroscale"
    policy_params: dict[str, Any] = field(default_factory=dict)
    min_instances: int = 1
    max_instances: int = 8
    loader: Loader = "blitz"
    zigzag: bool = True
    keep_alive_s: float = 60.0
    tick_s: float = 0.5
    heartbeat_s: float = 1.0
    window_s: float = 10.0
    lost_after_s: float = 5.0
    sample_s: float = 1.0
    grace_s: float = 600.0
    slo: Slo = Slo()
    seed: int = 0
    disaggregated: bool = False
    initial_prefill: int = 0
    initial_decode: int = 0
    min_prefill: int | None = None  # pool floors of a split deployment (None: the initial size)
    min_decode: int | None = None
    pd_layout: Literal["mixed", "split_hosts"] = "mixed"
    kills: tuple[Kill, ...] = ()
    stall_timeout_s: float = 10.0
    live_migration: bool = False
    migration_kv_high: float = 0.95
    migration_tbt_slo_s: float | None = None
    rebalance: bool = True  # the core's rebalancing of queued requests onto a new instance
    # The workers' early heartbeat (`services.common.backlog`): this often between heartbeats a
    # worker whose prompts were queued looks whether its backlog is news, and if so reports at
    # once and the manager reconciles at once, as the live worker and manager do (0: off).
    heartbeat_backlog_check_s: float = BACKLOG_CHECK_S
    # A drained instance keeps the weights for its model's last load time, at most this (the
    # manager's `keep_warm_max_s`); a load onto it within that time is instant. Its time counts
    # in `gpu_seconds` (`warm_gpu_seconds`): the GPU holds them.
    keep_warm_max_s: float = KEEP_WARM_MAX_S
    decision_repeat_s: float = 30.0  # a 'no change' decision is reported this often (GM default)
    # None: each LoadReport covers the last heartbeat period, one TBT sample per step; seconds:
    # as the real engine reports, over a sliding window, one TBT sample per token.
    report_window_s: float | None = None
    # ZigZag, driven by the manager's own core (`ZigzagTracker`) with its defaults
    # (`ZigzagSettings`): `zigzag_live` "all" pairs every LOADING target from its first layer,
    # "tails" only chain tails; `zigzag_ttft_s`: the gate also opens when every SERVING
    # instance's TTFT p50 is at least this; `zigzag_stall_s`: a load that has not grown a layer
    # for this long gets no ZigZag work until its next layer.
    zigzag_live: ZigzagLive = _ZIGZAG.live
    zigzag_ttft_s: float | None = _ZIGZAG.ttft_s
    zigzag_stall_s: float = _ZIGZAG.stall_s
    # When a live instance finishes loading, its partner's running requests above an even share
    # move to it with their KV (`plan_hand_back`, as the live GM does).
    zigzag_hand_back: bool = _ZIGZAG.hand_back
    zigzag_hand_back_min_tokens_left: int = _ZIGZAG.hand_back_min_tokens_left
    zigzag_hand_back_wait_s: float = _ZIGZAG.hand_back_wait_s
    # "always": pair every live loading instance whatever the gate says (an upper bound of the
    # layer-level model, not what the live GM does).
    zigzag_gate: Literal["all_overloaded", "always"] = "all_overloaded"
    # How ZigZag work reaches a live instance (the GM's --zigzag-dispatch): "route" pairs live
    # instances under the gate above; "pull" pairs each with one SERVING partner by the core's
    # `pull_pairs` and speeds the partner up only while it holds prompts not started (the
    # requests it hands over), whatever the rest of the pool does.
    zigzag_dispatch: ZigzagDispatch = _ZIGZAG.dispatch
    # A bound on pipelined decode (BlitzScale's ZigZag is prefill only): a partner sped up by
    # ZigZag decodes for free (`SimWorker.decode_free_bound`). Not a mechanism.
    zigzag_decode_free_bound: bool = False
    # CPU contention (opt-in; None: off, every step lasts exactly its paced time). Each host has
    # `host_cpu_cores` cores, `host_cpu_reserved` of them busy with other processes; a step
    # computes cpu_step_base_s + cpu_step_token_s x batch tokens CPU-seconds, shared among the
    # host's workers computing at once (processor sharing, `cpu.py`), and lasts max(pace, compute).
    host_cpu_cores: float | None = None
    host_cpu_reserved: float = 0.0
    cpu_step_base_s: float = 0.0
    cpu_step_token_s: float = 0.0
    # The simulator's fast paths, the same results (pinned by tests against False): workers skip
    # the events of uniform decode steps (`worker.py`), the gateway's choice comes from an index
    # of the least-loaded instance when `plan_route` would give the same (`fastroute.py`), and
    # arrivals are fed to the event loop one at a time. False: the step-by-step reference.
    fast_path: bool = True


class SimActuator:
    """The core's `Actuator` protocol on the simulated cluster: no I/O, no tasks; loads and
    drains end when the simulation says so, and their outcomes go back to the core."""

    ready = True

    def __init__(self, sim: Simulation) -> None:
        self.sim = sim
        self.loading: dict[str, LoadInstances] = {}
        self.draining: dict[str, DrainInstance] = {}
        self.sending_links = SendingLinks()
        self.executed: list[Action] = []

    def execute(self, actions: Sequence[Action]) -> None:
        for action in actions:
            if isinstance(action, (Report, Count)):
                self.sim.report(action)
                continue
            self.executed.append(action)
            if isinstance(action, LoadInstances):
                for iid in action.instance_ids:
                    self.loading[iid] = action
                self.sim.start_load(action)
            elif isinstance(action, DrainInstance):
                self.draining[action.instance_id] = action
                self.sim.start_drain(action)
            elif isinstance(action, ResumeInstance):
                self.sim.resume(action)
            elif isinstance(action, MigrateRequests):
                self.sim.release(action)
            elif isinstance(action, UpdateLocation):
                self.sim.locations_changed(action)

    def busy(self) -> frozenset[str]:
        return frozenset(self.loading) | frozenset(self.draining)

    def sending(self) -> frozenset[str]:
        return self.sending_links.senders

    async def wait(self, instance_ids: Collection[str]) -> None:
        return None

    async def list_models(self) -> list[str] | None:
        return [self.sim.model.name]

    def forget(self, instance_id: str) -> None:
        return None

    async def aclose(self) -> None:
        return None


class Simulation:
    def __init__(self, cfg: RunConfig) -> None:
        self.cfg = cfg
        self.loop = EventLoop(cfg.seed)
        self.net = Network(self.loop, batch=cfg.fast_path)
        self.fabric = LeafSpine(self.net, cfg.cluster)
        self.model = cfg.profile.model
        self.group_bytes = {g: self.model.size_bytes / self.model.num_layers for g in self.model.groups}
        self.registry = IndexedRegistry(self.model.name) if cfg.fast_path else Registry()
        self.monitor = LoadMonitor(window_s=cfg.window_s, lost_after_s=cfg.lost_after_s)
        floor = cfg.min_instances if cfg.autoscale else cfg.initial
        floors: dict[Role, int] = {Role.COLOCATED: floor}
        if cfg.disaggregated:
            floors = {
                Role.PREFILL: cfg.initial_prefill if cfg.min_prefill is None else cfg.min_prefill,
                Role.DECODE: cfg.initial_decode if cfg.min_decode is None else cfg.min_decode,
            }
        settings = ReconcileSettings(
            default_model=self.model.name,
            pool_floors=floors,
            max_instances=cfg.max_instances,
            disaggregated=cfg.disaggregated,
            autoscale=cfg.autoscale,
            lost_after_s=cfg.lost_after_s,
            live_migration=cfg.live_migration,
            migration_kv_high=cfg.migration_kv_high,
            migration_tbt_slo_s=cfg.migration_tbt_slo_s,
            rebalance=cfg.rebalance,
            keep_warm_max_s=cfg.keep_warm_max_s,
        )
        # The manager's own bounds are the policy's defaults (GlobalManagerServicer._make_policy).
        params = {"min_instances": max(1, floor), "max_instances": cfg.max_instances, **cfg.policy_params}
        self.reconciler = Reconciler(settings, make_policy(cfg.policy, params), decision_repeat_s=cfg.decision_repeat_s)
        self.actuator = SimActuator(self)
        self.topology = Topology(
            hosts={
                cfg.cluster.host_name(h): HostLink(cfg.cluster.leaf_of(h), cfg.cluster.rdma_gbps)
                for h in range(cfg.cluster.hosts)
            }
        )
        self.leaves = {host: link.leaf for host, link in self.topology.hosts.items()}
        self.workers: dict[str, SimWorker] = {}
        # Workers whose unstarted prompts or life changed since `_landed_alone` last looked.
        self._flips: set[SimWorker] = set()
        gpus = self.fabric.gpus
        roles = self._initial_roles(gpus)
        if len(roles) > len(gpus) or cfg.max_instances > len(gpus):
            raise ValueError(
                f"{cfg.name}: initial={len(roles)} / max_instances={cfg.max_instances} exceed the {len(gpus)} GPUs"
            )
        self.host_cpus: dict[str, HostCpu] = {}
        if cfg.host_cpu_cores is not None:
            for h in sorted(set(self.fabric.host_of.values())):
                self.host_cpus[h] = HostCpu(self.loop, cfg.host_cpu_cores, cfg.host_cpu_reserved)
        for gpu in gpus:
            host = self.fabric.host_of[gpu]
            self.workers[gpu] = SimWorker(
                gpu,
                host,
                cfg.profile,
                self.loop,
                self._first_token,
                self._finished,
                self._worker_empty,
                on_handoff=self._handoff,
                on_pull=self._pull,
                on_queued=self._queued,
                cpu=self.host_cpus.get(host),
                cpu_step=(cfg.cpu_step_base_s, cfg.cpu_step_token_s),
                skip=cfg.fast_path,
                decode_free_bound=cfg.zigzag_decode_free_bound,
            )
            if cfg.report_window_s is not None:
                self.workers[gpu].window = WindowStats(cfg.report_window_s)
            if cfg.fast_path:
                self.workers[gpu].flips = self._flips
            serving = gpu in roles
            self.registry.register(
                gpu,
                model=self.model.name if serving else "",
                role=roles.get(gpu, Role.COLOCATED),
                host=host,
                num_layers=self.model.num_layers,
                now_s=0.0,
                state=S.SERVING if serving else S.IDLE,
            )
            self.monitor.mark_seen(gpu, 0.0)
        # The parameter manager's single host-memory copy, layer i on host i mod hosts.
        hosts = sorted(self.topology.hosts)
        self.pm_shards: dict[str, list[str]] = {}
        for i, g in enumerate(self.model.groups):
            self.pm_shards.setdefault(f"mem@{hosts[i % len(hosts)]}", []).append(g)
        # ServerlessLLM: host -> time its cached copy expires (inf while an instance holds it).
        self.host_cache: dict[str, float] = {}
        # Drained instances holding the weights: instance -> (model, since, until); and the
        # instance-seconds they held them, counted when reused or at their end.
        self.warm: dict[str, tuple[str, float, float]] = {}
        self.warm_s = 0.0
        self.warm_loads = 0
        for gpu in roles:
            self.host_cache[self.fabric.host_of[gpu]] = math.inf
        self.requests: list[SimRequest] = [
            SimRequest(a.index, a.t_s, a.prompt_tokens, a.output_tokens) for a in cfg.arrivals
        ]
        self.pending: deque[SimRequest] = deque()
        self.done = 0
        self.samples: list[InstanceSample] = []
        self.records: list[RequestRecord] = []  # every request's record, once the run is over
        self.events: list[Report] = []
        self.backlog_check_due: set[str] = set()  # workers whose backlog check is scheduled
        self.sampled_early: dict[str, float] = {}  # worker -> when it last reported early
        self.wake_pending = False  # a reconcile woken by an early report is scheduled
        self.decision_log: list[str] = []
        self.counts: dict[str, int] = {}
        self.load_started: dict[str, float] = {}
        self.load_times: list[float] = []
        self.load_sources: dict[str, int] = {}
        self.transfers: dict[str, Transfer] = {}
        # The manager's ZigZag core, with the live GM's defaults unless the config overrides them.
        self.zigzag = ZigzagTracker(
            ZigzagSettings(
                live=cfg.zigzag_live,
                ttft_s=cfg.zigzag_ttft_s,
                stall_s=cfg.zigzag_stall_s,
                hand_back=cfg.zigzag_hand_back,
                hand_back_min_tokens_left=cfg.zigzag_hand_back_min_tokens_left,
                hand_back_wait_s=cfg.zigzag_hand_back_wait_s,
                dispatch=cfg.zigzag_dispatch,
            )
        )
        self.boosted: dict[str, float] = {}
        self.zigzag_boost_s = 0.0
        # Prefills finished on a boosted partner, and the share of them the loading instances
        # ran (1 - 1/speedup each): the request-equivalents served while loading.
        self.zigzag_assisted = 0
        self.zigzag_served_while_loading = 0.0
        self.zigzag_paired: set[str] = set()
        self.zigzag_handed_back = 0  # running requests asked to move to a loaded live instance
        self.zigzag_hand_back_waited_s: list[float] = []  # per hand-back that moved requests
        self._gate: tuple[int | None, ZigzagGate] | None = None  # the ZigZag gate at a registry version
        # The pairs (partner, loading instance) at a registry version and order of live instances.
        self._pairs: tuple[tuple[int, tuple[str, ...]], list[tuple[str, str]]] | None = None
        self._pull_cache: list[tuple[str, str]] | None = None  # the last pulled pairs
        # What the last pulled pairing saw (`_landed_alone`), and each live instance's latest
        # layer growth, oldest first, to tell when one may stall (stale entries are dropped).
        self._pull_seen: _PullSeen | None = None
        self._grew: list[tuple[float, str]] = []
        self.reached_serving: list[tuple[float, str]] = []
        # P/D hand-offs and live migrations: the decode instance chosen with each prefill hop,
        # the KV pulls in flight (request index -> flow id, source, destination, start), and
        # what they cost.
        self.decode_hop: dict[int, str] = {}
        self.pulls: dict[int, tuple[int, str, str, float]] = {}
        self.kv_times: dict[str, list[float]] = {}
        self.kv_paths: dict[str, int] = {}
        # Failures: killed (the gateway knows at once) and hung (it learns from instance_lost).
        self.dead: set[str] = set()
        self.hung: set[str] = set()
        self.killed: list[dict[str, Any]] = []
        self.lost_at: dict[str, float] = {}
        self.failover: dict[str, int] = {}

    def _initial_roles(self, gpus: list[str]) -> dict[str, Role]:
        """The GPUs serving at the start and their roles."""
        cfg = self.cfg
        if not cfg.disaggregated:
            return dict.fromkeys(gpus[: cfg.initial], Role.COLOCATED)
        p, d = cfg.initial_prefill, cfg.initial_decode
        if cfg.pd_layout == "split_hosts":
            order = [Role.PREFILL] * p + [Role.DECODE] * d
        else:
            order = []
            while len(order) < p + d:
                if order.count(Role.PREFILL) < p:
                    order.append(Role.PREFILL)
                if order.count(Role.DECODE) < d:
                    order.append(Role.DECODE)
        return dict(zip(gpus, order, strict=False))

    # ---- running ---------------------------------------------------------------------------
    def run(self) -> dict[str, Any]:
        cfg = self.cfg
        wall = time.perf_counter()
        if cfg.fast_path:
            requests = self.requests
            self.loop.stream([r.arrival_s for r in requests], lambda i: self._arrive(requests[i]))
        else:
            for req in self.requests:
                self.loop.at(req.arrival_s, lambda req=req: self._arrive(req))
        self.loop.every(cfg.heartbeat_s, self._heartbeats, start_s=cfg.heartbeat_s)
        self.loop.every(cfg.tick_s, self._tick, start_s=cfg.tick_s)
        self.loop.every(cfg.sample_s, self._sample)
        for kill in cfg.kills:
            self.loop.at(kill.at_s, lambda kill=kill: self._kill(kill))
        last = max((r.arrival_s for r in self.requests), default=0.0)
        total = len(self.requests)
        if cfg.fast_path:
            # The cluster and every request live to the end: keep the collector's full passes
            # from walking them again and again (millions of objects at 1,000 instances).
            gc.freeze()
        try:
            self.loop.run(last + cfg.grace_s, stop=lambda: self.done >= total and self.loop.now_s >= last)
        finally:
            if cfg.fast_path:
                gc.unfreeze()
        end_s = self.loop.now_s
        for iid in list(self.warm):
            self._take_warm(iid, "")  # counts what each still-kept copy held, up to now
        self._sample()
        self.records = records = [self._record(r) for r in self.requests]
        summary = summarize(records, self.samples, end_s, cfg.slo)
        summary.update(
            {
                "gpu_seconds": round(summary["instance_seconds"] + self.warm_s, 2),
                "warm_gpu_seconds": round(self.warm_s, 2),
                "loads": {
                    "count": len(self.load_times),
                    "mean_s": _r(sum(self.load_times) / len(self.load_times)) if self.load_times else None,
                    "max_s": _r(max(self.load_times, default=0.0)) if self.load_times else None,
                    "p50_s": _r(percentile(self.load_times, 0.5)),
                    "sources": dict(sorted(self.load_sources.items())),
                    "warm": self.warm_loads,
                },
                "actions": dict(sorted(self.counts.items())),
                "zigzag_boost_instance_s": round(self.zigzag_boost_s, 2),
                "zigzag": {
                    "assisted_requests": self.zigzag_assisted,
                    "served_while_loading": round(self.zigzag_served_while_loading, 2),
                    "loading_instances_paired": len(self.zigzag_paired),
                    "hand_back_requested": self.zigzag_handed_back,
                    "hand_backs_waited": sum(1 for w in self.zigzag_hand_back_waited_s if w > 0),
                    "hand_back_wait_max_s": _r(max(self.zigzag_hand_back_waited_s, default=0.0)),
                },
                "kv_transfers": {
                    kind: {
                        "count": len(ts),
                        "mean_ms": _r(1e3 * sum(ts) / len(ts)),
                        "p99_ms": _r(1e3 * (percentile(ts, 0.99) or 0.0)),
                    }
                    for kind, ts in sorted(self.kv_times.items())
                },
                "kv_paths": dict(sorted(self.kv_paths.items())),
                "failures": {
                    "killed": self.killed,
                    "lost_at_s": {k: round(v, 3) for k, v in sorted(self.lost_at.items())},
                    "failover": dict(sorted(self.failover.items())),
                },
                "bytes_moved_gb": {k or "other": round(v / 1e9, 2) for k, v in sorted(self.net.bytes_by_kind.items())},
                "sim_events": self.loop.events_run,
                "sim_wall_s": round(time.perf_counter() - wall, 2),
            }
        )
        return summary

    def _record(self, r: SimRequest) -> RequestRecord:
        if r.end_s is None:  # outcome "lost": not finished by the run's bound
            return RequestRecord(r.index, r.arrival_s, r.prompt, r.output, sent_s=r.arrival_s)
        assert r.first_token_s is not None
        return RequestRecord(
            r.index,
            r.arrival_s,
            r.prompt,
            r.output,
            sent_s=r.arrival_s,
            outcome="ok",
            ttft_s=r.first_token_s - r.arrival_s,
            tbt_mean_s=(r.end_s - r.first_token_s) / (r.output - 1) if r.output > 1 else None,
            completion_tokens=r.output,
            finish_reason="length",
            end_s=r.end_s,
        )

    # ---- requests --------------------------------------------------------------------------
    def _arrive(self, req: SimRequest) -> None:
        if not self._route(req):
            self.pending.append(req)

    def _route(self, req: SimRequest, exclude: Collection[str] = ()) -> bool:
        """The gateway: a route from the core's `plan_route`, then the request's first hop.

        A hop on a killed instance refuses the connection at once, and the gateway plans again
        without it (as it excludes instances that failed a request). A fresh request on a
        (prefill, decode) route runs its prompt on the prefill instance, which hands its KV to
        the decode instance; a resumed one (tokens already streamed) goes to the route's last
        hop, the one that decodes, and pulls the KV it left behind when that is still offered
        (a hand-off, a live migration), else recomputes the prompt plus its tokens there."""
        excluded = set(exclude)
        index = self.registry.index if isinstance(self.registry, IndexedRegistry) else None
        while True:
            route = (
                None if index is None else index.route(req.prompt + req.output, self.cfg.profile.block_size, excluded)
            )
            if route is None:
                route = plan_route(
                    self.registry.views(model=self.model.name),
                    model=self.model.name,
                    prompt_tokens=req.prompt,
                    max_tokens=req.output,
                    exclude_ids=excluded,
                    kv_block_size_tokens=self.cfg.profile.block_size,
                    leaves=self.leaves,
                )
            refused = {hop.instance_id for hop in route} & self.dead
            if not refused:
                break
            excluded |= refused
            self._bump("connect_refused")
        if not route:
            return False
        req.routed += 1
        for hop in route:
            # Until its next heartbeat shows the request, routing counts it (as `Schedule` does).
            self.registry.note_routed(hop.instance_id)
        if len(route) == 2 and req.generated == 0:
            prefill, decode = route[0].instance_id, route[1].instance_id
            self.decode_hop[req.index] = decode
            self.workers[prefill].submit(req, "prefill")
            return True
        self._submit(req, route[-1].instance_id)
        return True

    def _route_batch(self, reqs: list[SimRequest], exclude: str) -> list[SimRequest]:
        """`_route` for each of `reqs` (queued requests a rebalance released, `exclude` their
        old instance) one after another, as the routing index's `route_many` answers them
        together, each instance's routes noted at once. Returns the rest, from the first only
        `plan_route` can answer, for `_route` one by one."""
        registry = self.registry
        if len(reqs) < 2 or not isinstance(registry, IndexedRegistry):
            return reqs
        hops = registry.index.route_many(
            [r.prompt + r.output for r in reqs], self.cfg.profile.block_size, (exclude,), self.dead
        )
        counts: dict[str, int] = {}
        for hop in hops:
            counts[hop.instance_id] = counts.get(hop.instance_id, 0) + 1
        for iid, n in counts.items():
            registry.note_routed(iid, n)
        for req, hop in zip(reqs, hops, strict=False):  # hops may stop short of reqs
            req.routed += 1
            self._submit(req, hop.instance_id)
        return reqs[len(hops) :]

    def _submit(self, req: SimRequest, iid: str) -> None:
        """Send `req` to `iid`, the hop that runs it whole or decodes it: a resumed request
        pulls the KV it left behind when that is still offered, else recomputes it there."""
        holder = self.workers.get(req.kv_from)
        if req.generated and holder is not None and req.index in holder.offered:
            req.kv_tokens = req.prompt + req.generated - 1
            self.workers[iid].submit(req, "decode")
        else:
            req.kv_from = ""
            self.workers[iid].submit(req)

    def _bump(self, key: str, n: int = 1) -> None:
        self.failover[key] = self.failover.get(key, 0) + n

    def _flush_pending(self) -> None:
        while self.pending:
            if not self._route(self.pending[0]):
                return
            self.pending.popleft()

    def _first_token(self, req: SimRequest) -> None:
        speedup = self.workers[req.worker].speedup
        if speedup > 1:
            self.zigzag_assisted += 1
            self.zigzag_served_while_loading += 1 - 1 / speedup

    def _finished(self, req: SimRequest) -> None:
        self.done += 1
        self.decode_hop.pop(req.index, None)

    # ---- KV: P/D hand-offs and live migrations -----------------------------------------------------
    def _handoff(self, req: SimRequest) -> None:
        """The prefill instance emitted the first token and offers the prompt's KV: the gateway
        sends the request on to the decode hop chosen with it, which pulls the KV once admitted.
        A decode hop that died meanwhile refuses, and the request is resumed elsewhere (the
        offer goes with it)."""
        prefill = req.worker
        decode = self.decode_hop.pop(req.index, "")
        req.kv_from, req.kv_kind = prefill, "kv"
        if not decode or decode in self.dead or self.registry.get(decode).state is not S.SERVING:
            self._bump("handoff_rerouted")
            if not self._route(req, exclude=(prefill,)):
                self.pending.append(req)
            return
        req.kv_tokens = req.prompt + req.generated - 1
        self.workers[decode].submit(req, "decode")

    def _pull(self, req: SimRequest) -> None:
        """Admitted on its new instance: pull the KV from its holder over the links (NVLink on
        one host, else RDMA through the leaf-spine), sharing them with loads and other pulls.
        A dead holder refuses at once; a hung one stalls the pull until `stall_timeout_s`; then
        the context is recomputed here."""
        src, dst = req.kv_from, req.worker
        holder = self.workers[src]
        if not holder.alive or req.index not in holder.offered:
            delay = 0.0 if src in self.dead or holder.alive else self.cfg.stall_timeout_s
            self.loop.after(delay, lambda: self._pull_failed(req, dst))
            return
        size = req.kv_tokens * self.model.kv_bytes_per_token
        s_host, d_host = self.fabric.host_of[src], self.fabric.host_of[dst]
        path = (
            "nvlink"
            if s_host == d_host
            else ("rdma_leaf" if self.leaves[s_host] == self.leaves[d_host] else "rdma_spine")
        )
        self.kv_paths[path] = self.kv_paths.get(path, 0) + 1
        started = self.loop.now_s
        fid = self.net.start(
            self.fabric.path(src, dst), size, lambda: self._pulled(req, src, dst, started), kind=req.kv_kind
        )
        self.pulls[req.index] = (fid, src, dst, started)

    def _pulled(self, req: SimRequest, src: str, dst: str, started: float) -> None:
        self.pulls.pop(req.index, None)
        self.kv_times.setdefault(req.kv_kind, []).append(self.loop.now_s - started)
        self.workers[src].release_offer(req)
        req.kv_from = ""
        self.workers[dst].kv_landed(req)

    def _pull_failed(self, req: SimRequest, dst: str) -> None:
        if req.worker != dst or not self.workers[dst].alive:
            return  # the puller itself is gone: its own failover has the request
        self._bump("kv_recomputed")
        req.kv_from = ""
        self.workers[dst].pull_failed(req)

    # ---- failures ------------------------------------------------------------------------------
    def _kill(self, kill: Kill) -> None:
        iid = kill.instance_id or self._busiest(kill.role)
        if not iid:
            self.killed.append({"at_s": kill.at_s, "instance_id": None, "mode": kill.mode, "note": "nothing serving"})
            return
        self._take_warm(iid, "")  # a kept copy dies with its worker
        view = self.registry.get(iid)
        worker = self.workers[iid]
        self.killed.append(
            {
                "at_s": kill.at_s,
                "instance_id": iid,
                "role": view.role.value.lower(),
                "mode": kill.mode,
                "running": worker.running,
                "waiting": len(worker.waiting),
            }
        )
        # Its KV pulls stop both ways: those into it belong to its own requests (resumed
        # below, or when it is found LOST); a puller whose source it was recomputes.
        for index, (fid, src, dst, _) in sorted(self.pulls.items()):
            if iid not in (src, dst):
                continue
            self.net.cancel(fid)
            del self.pulls[index]
            if src == iid and dst != iid:
                req = self.workers[dst].pulling.get(index)
                if req is not None:
                    delay = 0.0 if kill.mode == "sigkill" else self.cfg.stall_timeout_s
                    self.loop.after(delay, lambda req=req, dst=dst: self._pull_failed(req, dst))
        if kill.mode == "hang":
            self.hung.add(iid)
            worker.freeze()
            return
        self.dead.add(iid)
        owned, _ = worker.kill()
        self._resume_all(iid, owned)

    def _busiest(self, role: Role | None) -> str:
        serving = [
            v
            for v in self.registry.views(model=self.model.name, role=role, state=S.SERVING)
            if self.workers[v.instance_id].alive
        ]
        if not serving:
            return ""
        w = self.workers
        return min(
            serving, key=lambda v: (-(w[v.instance_id].running + len(w[v.instance_id].waiting)), v.instance_id)
        ).instance_id

    def _resume_all(self, iid: str, reqs: list[SimRequest]) -> None:
        """The gateway fails over every stream the instance held: retried from the prompt if no
        token came yet, else resumed from the prompt plus its tokens (with the KV it left on a
        live peer, if any)."""
        for req in reqs:
            self.decode_hop.pop(req.index, None)
            holder = self.workers.get(req.kv_from)
            if holder is None or req.kv_from == iid or req.index not in holder.offered:
                req.kv_from = ""
            self._bump("resumed" if req.generated else "retried")
            if req.generated:
                req.resumed += 1
            if not self._route(req, exclude=(iid,)):
                self.pending.append(req)

    def _lost(self, iid: str) -> None:
        """The core marked `iid` LOST (the `instance_lost` event the gateway follows)."""
        self.lost_at[iid] = self.loop.now_s
        if iid in self.hung:
            owned, _ = self.workers[iid].kill()
            self._resume_all(iid, owned)

    # ---- the control loop ----------------------------------------------------------------------
    def _heartbeats(self) -> None:
        now = self.loop.now_s
        registry = self.registry
        views: Iterable[InstanceView] = registry
        if isinstance(registry, IndexedRegistry):
            # The same calls in the same order, the IDLE instances' in one batch.
            self.monitor.mark_seen_many(registry.idle - self.dead - self.hung, now)
            views = registry.active()
        # `_report` written out, its lookups hoisted: a round is a thousand reports.
        workers, sampled_early, monitor = self.workers, self.sampled_early, self.monitor
        heartbeat_s, loading = self.cfg.heartbeat_s, S.LOADING
        for view in views:
            iid = view.instance_id
            worker = workers[iid]
            if not worker.alive:
                continue  # killed or hung: silent, so the core finds it LOST
            state = view.state
            if state in REPORTING:
                # A worker that reported early this period covers only the time since then.
                early = sampled_early.pop(iid, None) if sampled_early else None
                sample = worker.sample(
                    now, heartbeat_s if early is None else max(1e-3, now - early), serving=state is not loading
                )
                registry.heartbeat(sample)
                monitor.observe(sample)
            elif state is S.IDLE:
                monitor.mark_seen(iid, now)

    def _report(self, view: InstanceView, now: float, period_s: float) -> None:
        """`view`'s worker reports the `period_s` just ended: the registry and monitor take it."""
        sample = self.workers[view.instance_id].sample(now, period_s, serving=view.state is not S.LOADING)
        self.registry.heartbeat(sample)
        self.monitor.observe(sample)

    def _queued(self, req: SimRequest) -> None:
        """A prompt joined `req.worker`'s queue: it looks at its backlog at its next check."""
        check_s = self.cfg.heartbeat_backlog_check_s
        iid = req.worker
        if check_s <= 0 or iid in self.backlog_check_due:
            return
        self.backlog_check_due.add(iid)
        self.loop.at((math.floor(self.loop.now_s / check_s) + 1) * check_s, lambda: self._backlog_check(iid))

    def _backlog_check(self, iid: str) -> None:
        """The live worker's check between heartbeats: a backlog that formed or doubled since
        its last report goes out at once, and the manager, which applies the same rule to the
        report, reconciles at once (`services.common.backlog`)."""
        self.backlog_check_due.discard(iid)
        worker = self.workers[iid]
        if not worker.alive or iid not in self.registry:
            return
        view = self.registry.get(iid)
        if view.state not in REPORTING:
            return
        if not backlog_is_news(worker.queue_wait_s(), worker.reported_wait_s):
            return
        now = self.loop.now_s
        hb = self.cfg.heartbeat_s
        since = self.sampled_early.get(iid, math.floor(now / hb) * hb)
        self.sampled_early[iid] = now
        self._report(view, now, max(1e-3, now - since))
        self.counts["backlog_heartbeats"] = self.counts.get("backlog_heartbeats", 0) + 1
        if not self.wake_pending:
            # The live manager's wake is an event its control loop waits on: the reports of one
            # instant wake it once, and it reconciles after them.
            self.wake_pending = True
            self.loop.at(self.loop.now_s, self._woken)

    def _woken(self) -> None:
        self.wake_pending = False
        self._reconcile()

    def _reconcile(self) -> None:
        actions = self.reconciler.reconcile(
            self.loop.now_s, self.registry, Observations(monitor=self.monitor, busy=self.actuator.busy())
        )
        self.actuator.execute(actions)
        self._update_zigzag()

    def _tick(self) -> None:
        self._reconcile()
        moves = self._hand_back(self.zigzag.hand_backs_due(self.loop.now_s, self.actuator.sending()))
        if moves:
            self.actuator.execute(moves)
        self.zigzag_boost_s += self.cfg.tick_s * sum(1 for f in self.boosted.values() if f > 1)

    def _sample(self) -> None:
        counts: dict[str, int] = {}
        loading: dict[str, float] = {}
        for v in self.registry.views(model=self.model.name):
            name = _STATE_NAMES[v.state]
            counts[name] = counts.get(name, 0) + 1
            if v.state is S.LOADING:
                loading[v.instance_id] = round(v.layers_loaded / v.num_layers, 3)
        self.samples.append(InstanceSample(self.loop.now_s, counts, loading))

    def report(self, action: Report | Count) -> None:
        if isinstance(action, Count):
            key = f"{action.kind}:{action.outcome}"
        else:
            key = action.action
            self.events.append(action)
            if action.action == "instance_lost" and action.instance_id in self.workers:
                self._lost(action.instance_id)
            if action.log_line:
                self.decision_log.append(action.log_line)
        self.counts[key] = self.counts.get(key, 0) + 1

    # ---- loads ---------------------------------------------------------------------------------
    def start_load(self, load: LoadInstances) -> None:
        now = self.loop.now_s
        for iid in load.instance_ids:
            self.load_started[iid] = now
        warm = [iid for iid in load.instance_ids if self._take_warm(iid, load.model)]
        for iid in warm:
            # The weights are still there: SERVING without a transfer, as the live worker's
            # `_load_warm` (a fresh engine, no bytes moved).
            self.warm_loads += 1
            self.loop.after(0.0, lambda iid=iid: self._load_done(load, iid, warm=True))
        if len(warm) == len(load.instance_ids):
            return
        if warm:
            load = dataclasses.replace(load, instance_ids=tuple(i for i in load.instance_ids if i not in warm))
        if self.cfg.loader == "serverless":
            transfer = self._serverless_transfer(load)
        else:
            transfer = self._chain_transfer(load)
        for iid in load.instance_ids:
            self.transfers[iid] = transfer
        transfer.start()

    def _chain_transfer(self, load: LoadInstances) -> Transfer:
        """The GM's multicast plan, as the live actuator makes it (`build_plan`)."""
        views = self.registry.views(model=load.model)
        sources = [
            Source(v.instance_id, v.host)
            for v in views
            if v.state is S.SERVING and v.instance_id not in load.instance_ids and self.workers[v.instance_id].alive
        ]
        sources += [
            Source(node, node.split("@", 1)[1], SourceKind.HOST_CACHE, frozenset(groups))
            for node, groups in sorted(self.pm_shards.items())
        ]
        targets = [Target(iid, self.registry.get(iid).host) for iid in load.instance_ids]
        traffic = self.actuator.sending_links.traffic(traffic_from_instances(views))
        plan = plan_multicast(targets, sources, self.topology, traffic, groups=self.model.groups)
        self.actuator.sending_links.start(plan, load.instance_ids)
        self.zigzag.chain_tails(c.hops[-1] for c in plan.chains if c.hops)
        for chain in plan.chains:
            kind = "host_cache" if chain.source.startswith("mem@") else "instance"
            self.load_sources[kind] = self.load_sources.get(kind, 0) + 1
        source_groups = {node: groups for node, groups in self.pm_shards.items()}
        return Transfer.from_plan(
            plan,
            self.fabric,
            self.group_bytes,
            self.model.groups,
            source_groups,
            on_group=lambda node, group: self._load_progress(load, node),
            on_done=lambda node: self._load_done(load, node),
        )

    def _serverless_transfer(self, load: LoadInstances) -> Transfer:
        """ServerlessLLM: from the host's memory if it caches the model, else SSD -> memory,
        each GPU of the host pulling layers over its PCIe as they land (pipelined)."""
        now = self.loop.now_s
        t = Transfer(
            self.fabric,
            self.group_bytes,
            self.model.groups,
            on_group=lambda node, group: self._load_progress(load, node),
            on_done=lambda node: self._load_done(load, node),
        )
        by_host: dict[str, list[str]] = {}
        for iid in load.instance_ids:
            by_host.setdefault(self.registry.get(iid).host, []).append(iid)
        for host, iids in sorted(by_host.items()):
            mem = f"mem@{host}"
            if self.host_cache.get(host, -math.inf) > now:
                t.add_source(mem)
                self.load_sources["host_cache_hit"] = self.load_sources.get("host_cache_hit", 0) + len(iids)
            else:
                t.add_source(f"ssd@{host}")
                t.add_edge(f"ssd@{host}", mem, self.model.groups)
                self.load_sources["ssd_miss"] = self.load_sources.get("ssd_miss", 0) + len(iids)
            self.host_cache[host] = math.inf  # held from now on (a miss is filling it)
            for iid in iids:
                t.add_edge(mem, iid, self.model.groups)
                t.add_target(iid)
        return t

    def _load_progress(self, load: LoadInstances, iid: str) -> None:
        view = self.registry.get(iid)
        if view.state is not S.LOADING:
            return
        k = self.transfers[iid].layers_prefix(iid)
        if k > view.layers_loaded:
            k = min(k, view.num_layers)
            self.registry.set_layers_loaded(iid, k)
            self.monitor.mark_seen(iid, self.loop.now_s)
            self.zigzag.load_progress(self.loop.now_s, iid, view.model, k, view.num_layers)
            if iid in self.zigzag.started:
                if self.cfg.fast_path:
                    heapq.heappush(self._grew, (self.zigzag.progress[iid][2], iid))
                    if self._landed_alone(iid):
                        return
                self._update_zigzag(repair=False)

    def _landed_alone(self, iid: str) -> bool:
        """A layer landed on live instance `iid`. When nothing else that the pulled pairing reads
        changed since the last one (no other instance went live, none stalls now or changed
        state, every partner's worker as alive and as short of unstarted prompts as then), the
        pairing `_update_zigzag(repair=False)` would make is that one again, and only `iid`'s
        partner's speedup can move: this sets it and returns True. False: `_update_zigzag` must
        run."""
        seen, registry, zigzag = self._pull_seen, self.registry, self.zigzag
        if seen is None or not isinstance(registry, IndexedRegistry) or seen.state_version != registry.state_version:
            return False
        grew, started, progress = self._grew, zigzag.started, zigzag.progress
        while grew:
            at_s, live = grew[0]
            if live in started and progress.get(live, (None, None, None))[2] == at_s:
                break
            heapq.heappop(grew)  # no longer live, or it grew since
        if grew and self.loop.now_s - grew[0][0] > zigzag.settings.stall_s:
            return False  # `expire_stalled` has work
        now_started = list(started)
        if now_started != seen.started:
            # `iid` has just gone live: the pairs the pulled pairing keeps between ticks are the
            # cached ones, so one not among them changes nothing until the next tick.
            if now_started[-1] != iid or iid in seen.cached or now_started[:-1] != seen.started:
                return False
            seen.started = now_started
        partners = seen.partners
        for worker in self._flips:
            valid = partners.get(worker)
            if valid is not None and (worker.alive and worker.unstarted_prompts) != valid:
                return False
        self._flips.clear()  # each as the pairing saw it
        partner = seen.partner_of.get(iid)
        if partner is not None:
            ks = [registry.get(i).layers_loaded for i in seen.members[partner]]
            self.boosted[partner] = self.workers[partner].speedup = partner_speedup(self.model.num_layers, ks)
        return True

    def _take_warm(self, iid: str, model: str) -> bool:
        """Whether `iid` still holds `model`'s weights; they are no longer kept either way (a
        load takes them, or frees them before it builds another model)."""
        held = self.warm.pop(iid, None)
        if held is None:
            return False
        now = self.loop.now_s
        self.warm_s += max(0.0, min(now, held[2]) - held[1])
        return held[0] == model and now < held[2]

    def _load_done(self, load: LoadInstances, iid: str, warm: bool = False) -> None:
        now = self.loop.now_s
        self.actuator.sending_links.finish(iid)
        self.monitor.mark_seen(iid, now)
        self.transfers.pop(iid, None)
        started = self.load_started.pop(iid, now)
        if not warm:
            self.load_times.append(now - started)
        follow = self.reconciler.load_succeeded(self.registry, load, iid, now - started)
        del self.actuator.loading[iid]
        serving = self.registry.get(iid).state is S.SERVING
        if serving:
            self.reached_serving.append((now, iid))
        # As the manager's servicer: the ZigZag core hands the partner's work back to it (and
        # any hand-back that waited for a partner's link and is due now).
        follow += self._hand_back(
            self.zigzag.load_done(iid, loaded=serving, now_s=now, sending=self.actuator.sending())
        )
        self.actuator.execute(follow)
        self._update_zigzag()
        self._flush_pending()

    def _hand_back(self, step: ZigzagStep) -> list[Action]:
        """The live migrations of `step`'s hand-backs (`plan_hand_back`), as the servicer's."""
        moves: list[Action] = []
        for effect in step.effects:
            if isinstance(effect, HandBack) and effect.running:
                move = plan_hand_back(self.registry.views(model=effect.model), effect)
                if move is not None:
                    moves.append(move)
                    self.zigzag_handed_back += move.n
                    self.zigzag_hand_back_waited_s.append(effect.waited_s)
        return moves

    # ---- drains, releases, locations -------------------------------------------------------------
    def start_drain(self, drain: DrainInstance) -> None:
        worker = self.workers[drain.instance_id]
        if not worker.alive:
            # The Drain RPC fails (modelled at once, not after its deadline): the core follows
            # the worker's reports, i.e. its silence, to LOST.
            del self.actuator.draining[drain.instance_id]
            self.actuator.execute(self.reconciler.drain_finished(self.registry, drain, "worker unreachable"))
            return
        if not worker.busy and worker.empty:
            self.loop.after(0.0, lambda: self._drain_done(drain))

    def resume(self, action: ResumeInstance) -> None:
        """A scale-out takes a drain back, as the worker's Resume does while its drain waits:
        the instance serves on with what it holds; the resume's answer and the drain's
        (resumed) come back at once."""
        iid = action.instance_id
        drain = self.actuator.draining.get(iid)
        if drain is None or not self.workers[iid].alive:
            self.actuator.execute(self.reconciler.resume_finished(action, "no drain is waiting"))
            return
        del self.actuator.draining[iid]  # a `_drain_done` already scheduled finds nothing
        follow = self.reconciler.resume_finished(action, "")
        follow += self.reconciler.drain_finished(self.registry, drain, "", resumed=True)
        self.monitor.mark_seen(iid, self.loop.now_s)
        self.actuator.execute(follow)

    def _worker_empty(self, iid: str) -> None:
        drain = self.actuator.draining.get(iid)
        if drain is not None and self.workers[iid].empty:
            self.loop.after(0.0, lambda: self._drain_done(drain))

    def _drain_done(self, drain: DrainInstance) -> None:
        iid = drain.instance_id
        if iid not in self.actuator.draining:
            return
        del self.actuator.draining[iid]
        follow = [UpdateLocation(drain.model, iid, present=False)]
        follow += self.reconciler.drain_finished(self.registry, drain, "")
        self.monitor.mark_seen(iid, self.loop.now_s)
        if drain.keep_warm_s > 0 and self.registry.get(iid).state is S.IDLE:
            self.warm[iid] = (drain.model, self.loop.now_s, self.loop.now_s + drain.keep_warm_s)
        host = self.workers[iid].host
        held = any(
            v.host == host and v.state in (S.LOADING, S.SERVING, S.DRAINING)
            for v in self.registry.views(model=drain.model)
        )
        if not held:
            self.host_cache[host] = self.loop.now_s + self.cfg.keep_alive_s
        self.actuator.execute(follow)

    def release(self, action: MigrateRequests) -> None:
        """A rebalance (queued requests: the gateway routes them again) or a live migration
        (running ones: each leaves with its KV offered, the gateway resumes it on the route's
        decoding hop, which pulls the KV over the links and decodes on)."""
        source = self.workers[action.source]
        if not source.alive:
            return
        if action.running:
            moved = source.release_running(action.n, action.min_tokens_left)
            for req in moved:
                req.kv_from, req.kv_kind = action.source, "migration"
                req.resumed += 1
                if not self._route(req, exclude=(action.source,)):
                    self.pending.append(req)
            self._bump("migrated", len(moved))
            report = release_report(action, len(moved))
            if report is not None:
                self.report(report)
            return
        moved = source.release_waiting(action.n)
        if moved:  # most releases find nothing queued any more (the plan reads reports)
            for req in self._route_batch(moved, action.source):
                if not self._route(req, exclude=(action.source,)):
                    source.submit(req, req.phase)
        self.report(Count("rebalance", "moved" if moved else "none"))

    def locations_changed(self, action: UpdateLocation) -> None:
        # Sources are read from the registry when a load is planned; nothing else to keep.
        return None

    # ---- ZigZag ----------------------------------------------------------------------------
    def _update_zigzag(self, repair: bool = True) -> None:
        """Drive the manager's own ZigZag core (`ZigzagTracker`, the live GM's defaults unless
        the config says otherwise): give each live LOADING instance a partner, pulled (the
        default) by `pull_pairs`, routed while the gate says every SERVING instance is
        overloaded by `pair_all` (most layers first). A partner's throughput follows the
        layer-level model (`partner_speedup`): with one loading instance at k of L, x
        `L * pair_throughput(L, k)`. `repair` False (a layer landed): pulled pairs stay as
        they were, only the speedups follow the layers."""
        registry = self.registry
        expired = self.zigzag.expire_stalled(self.loop.now_s).effects
        version = registry.version if isinstance(registry, IndexedRegistry) else None
        if (
            not self.boosted
            and not expired
            and version is not None
            and self._gate is not None
            and self._gate[0] == version
            and not self._gate[1].zigzag
            and self.cfg.zigzag_gate != "always"
            and self.cfg.zigzag_dispatch == "route"
        ):
            return  # nothing is paired and the gate is shut at this version: nothing changes
        old, self.boosted = self.boosted, {}
        self._pull_seen = None
        try:
            self._pair_live(version, repair)
        finally:
            # Only a speedup that changes touches its worker (a change interrupts the step under
            # way), in a fixed order.
            for iid in sorted(old.keys() - self.boosted.keys()):
                self.workers[iid].speedup = 1.0
            for iid, factor in self.boosted.items():
                self.workers[iid].speedup = factor

    def _pair_live(self, version: int | None, repair: bool) -> None:
        """`self.boosted`: each partner's speedup now (`_update_zigzag` applies it)."""
        registry, model = self.registry, self.model.name
        if not self.cfg.zigzag or not self.zigzag.started:
            return
        live = self.zigzag.live_views((registry.get(i) for i in self.zigzag.started if i in registry), model)
        if not live:
            return
        if self.cfg.zigzag_dispatch == "pull":
            self._pull_pairs(live, repair)
            return
        # The gate reads the SERVING instances' states and load reports only: between two
        # heartbeat rounds (many layers land) it is asked the same question again.
        views: list[InstanceView] | None = None
        cap: dict[str, int] = {}
        if version is not None and self._gate is not None and self._gate[0] == version:
            gate = self._gate[1]
        else:
            views = registry.views(model=model)
            cap = {v.instance_id: self.cfg.profile.max_batch for v in views}
            gate = self.zigzag.gate(views, model, max_running_by_instance=cap)
            self._gate = (version, gate)
        if not gate.zigzag and self.cfg.zigzag_gate != "always":
            return
        # The pairing reads the SERVING instances' states and reports and the live instances'
        # order, not their layer counts: as a layer lands, only the speedups change.
        key = None if version is None else (version, tuple(v.instance_id for v in live))
        if key is not None and self._pairs is not None and self._pairs[0] == key:
            pairs = self._pairs[1]
        else:
            if views is None:
                views = registry.views(model=model)
                cap = {v.instance_id: self.cfg.profile.max_batch for v in views}
            pairs = self.zigzag.pair_all(live, views, model, cap)
            if key is not None:
                self._pairs = (key, pairs)
        paired: dict[str, list[int]] = {}
        for partner, iid in pairs:
            self.zigzag.note_split(iid, partner)
            paired.setdefault(partner, []).append(registry.get(iid).layers_loaded)
            self.zigzag_paired.add(iid)
        for partner, ks in paired.items():
            self.boosted[partner] = partner_speedup(self.model.num_layers, ks)

    def _pull_pairs(self, live: list[InstanceView], repair: bool) -> None:
        """`zigzag_dispatch="pull"`: each live instance keeps the partner the core's `pull_pairs`
        gives it; a partner runs faster (`partner_speedup` over its live instances' layers)
        while it holds prompts not started (`SimWorker.unstarted_prompts`), the ones the live
        engine would still have waiting and hand over to run ahead. As the live manager
        pairs at heartbeats, not as layers land, the pairs are asked for on a tick or a load's
        end (`repair`); a layer landing only changes the speedups (and an instance that just
        went live waits for the next tick, as for the next heartbeat)."""
        model = self.model.name
        ids = {v.instance_id for v in live}
        if repair or self._pull_cache is None:
            registry = self.registry
            if isinstance(registry, IndexedRegistry):
                # The pairing reads the live (LOADING) instances and the SERVING candidates; an
                # IDLE partner counts as a missing one. So the active views, in the registry's
                # order, give the same pairs as all of them (at 1,000 GPUs most are IDLE).
                views = [v for v in registry.active() if v.model == model]
            else:
                views = registry.views(model=model)
            pairs = []
            for role in sorted({v.role for v in live}, key=lambda r: r.value):
                pairs.extend(self.zigzag.pull_pairs(self.loop.now_s, views, model, role, ids).pairs)
            self._pull_cache = pairs
        else:
            pairs = [(iid, partner) for iid, partner in self._pull_cache if iid in ids]
        by_partner: dict[str, list[int]] = {}
        members: dict[str, list[str]] = {}
        partners: dict[SimWorker, bool] = {}
        for iid, partner in pairs:
            worker = self.workers.get(partner)
            valid = worker is not None and worker.alive and worker.unstarted_prompts
            if worker is not None:
                partners.setdefault(worker, valid)
            if not valid:
                continue
            self.zigzag.note_split(iid, partner)
            by_partner.setdefault(partner, []).append(self.registry.get(iid).layers_loaded)
            members.setdefault(partner, []).append(iid)
            self.zigzag_paired.add(iid)
        for partner, ks in by_partner.items():
            self.boosted[partner] = partner_speedup(self.model.num_layers, ks)
        if self.cfg.fast_path and isinstance(self.registry, IndexedRegistry):
            self._flips.clear()
            self._pull_seen = _PullSeen(
                started=list(self.zigzag.started),
                cached={iid for iid, _ in self._pull_cache or ()},
                state_version=self.registry.state_version,
                partners=partners,
                members=members,
                partner_of={iid: partner for partner, ids in members.items() for iid in ids},
            )


@dataclass(slots=True)
class _PullSeen:
    """What a pulled pairing read besides layer counts: the live instances in order, those
    among its cached pairs, the registry's state version, each partner's worker -> whether it
    held unstarted prompts (alive; a change since shows in `Simulation._flips`), and the pairs
    it sped up (partner -> live instances in pairing order)."""

    started: list[str]
    cached: set[str]
    state_version: int
    partners: dict[SimWorker, bool]
    members: dict[str, list[str]]
    partner_of: dict[str, str]


def partner_speedup(num_layers: int, k_layers: Sequence[int]) -> float:
    """How much faster a full instance serves prefills with loading instances holding
    `k_layers` (each in [1, L]) running the first layers of its requests, by the fluid
    layer-level model of `core.zigzag.pair_throughput` extended to several loading instances:
    the partner spends its time on split requests of the loading instance with the most layers
    first (each costs it L - k layer-times instead of L), at most (L - k) / k of its time per
    loading instance (that one's own rate, 1/k requests per layer-time), and the rest on whole
    requests. One loading instance with k < L: exactly `L * pair_throughput(L, k)`. One with
    all L (only its embedding and head still loading) adds its own rate, 1/L, at no cost to
    the partner (the head is priced at nothing, as a layer is the model's unit here)."""
    L = num_layers
    left, rate = 1.0, 0.0
    for k in sorted(k_layers, reverse=True):
        if k >= L:
            rate += 1.0 / L
            continue
        share = min(left, (L - k) / k)
        rate += share / (L - k)
        left -= share
        if left <= 0:
            break
    rate += max(0.0, left) / L
    return L * rate


def _r(x: float | None) -> float | None:
    return None if x is None else round(x, 4)
