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
throughput grows by the layer-level model (`pair_throughput`).
"""

from __future__ import annotations

import math
import time
from collections import deque
from collections.abc import Collection, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

from bench.replay.schedule import Arrival
from bench.replay.summary import InstanceSample, RequestRecord, Slo, percentile, summarize
from services.global_manager.core.actions import (
    Action,
    Count,
    DrainInstance,
    LoadInstances,
    MigrateRequests,
    Report,
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
from services.global_manager.core.reconcile import Observations, Reconciler, ReconcileSettings
from services.global_manager.core.routing import plan_route
from services.global_manager.core.types import InstanceState, Role
from services.global_manager.core.zigzag import choose_zigzag_partner, pair_throughput, should_zigzag

from .events import EventLoop
from .links import ClusterSpec, LeafSpine, Network
from .profiles import SimProfile
from .transfer import Transfer
from .worker import SimRequest, SimWorker

__all__ = ["RunConfig", "SimActuator", "Simulation"]

S = InstanceState
Loader = Literal["blitz", "serverless"]


@dataclass(frozen=True)
class RunConfig:
    """One variant of a scenario: the cluster, the workload, and how it is scaled.

    `autoscale` False is a fixed pool of `initial` instances. `loader`: "blitz" (the GM's
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


class SimActuator:
    """The core's `Actuator` protocol on the simulated cluster: no I/O, no tasks; loads and
    drains end when the simulation says so, and their outcomes go back to the core."""

    ready = True

    def __init__(self, sim: Simulation) -> None:
        self.sim = sim
        self.loading: dict[str, LoadInstances] = {}
        self.draining: dict[str, DrainInstance] = {}
        self.sending = SendingLinks()
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
            elif isinstance(action, MigrateRequests):
                self.sim.release(action)
            elif isinstance(action, UpdateLocation):
                self.sim.locations_changed(action)

    def busy(self) -> frozenset[str]:
        return frozenset(self.loading) | frozenset(self.draining)

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
        self.net = Network(self.loop)
        self.fabric = LeafSpine(self.net, cfg.cluster)
        self.model = cfg.profile.model
        self.group_bytes = {g: self.model.size_bytes / self.model.num_layers for g in self.model.groups}
        self.registry = Registry()
        self.monitor = LoadMonitor(window_s=cfg.window_s, lost_after_s=cfg.lost_after_s)
        floor = cfg.min_instances if cfg.autoscale else 0
        settings = ReconcileSettings(
            default_model=self.model.name,
            pool_floors={Role.COLOCATED: floor},
            max_instances=cfg.max_instances,
            autoscale=cfg.autoscale,
            lost_after_s=cfg.lost_after_s,
        )
        # The manager's own bounds are the policy's defaults (GlobalManagerServicer._make_policy).
        params = {"min_instances": max(1, floor), "max_instances": cfg.max_instances, **cfg.policy_params}
        self.reconciler = Reconciler(settings, make_policy(cfg.policy, params))
        self.actuator = SimActuator(self)
        self.topology = Topology(
            hosts={
                cfg.cluster.host_name(h): HostLink(cfg.cluster.leaf_of(h), cfg.cluster.rdma_gbps)
                for h in range(cfg.cluster.hosts)
            }
        )
        self.leaves = {host: link.leaf for host, link in self.topology.hosts.items()}
        self.workers: dict[str, SimWorker] = {}
        gpus = self.fabric.gpus
        if cfg.initial > len(gpus) or cfg.max_instances > len(gpus):
            raise ValueError(
                f"{cfg.name}: initial={cfg.initial} / max_instances={cfg.max_instances} exceed the {len(gpus)} GPUs"
            )
        for i, gpu in enumerate(gpus):
            host = self.fabric.host_of[gpu]
            self.workers[gpu] = SimWorker(
                gpu, host, cfg.profile, self.loop, self._first_token, self._finished, self._worker_empty
            )
            serving = i < cfg.initial
            self.registry.register(
                gpu,
                model=self.model.name if serving else "",
                role=Role.COLOCATED,
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
        for gpu in gpus[: cfg.initial]:
            self.host_cache[self.fabric.host_of[gpu]] = math.inf
        self.requests: list[SimRequest] = [
            SimRequest(a.index, a.t_s, a.prompt_tokens, a.output_tokens) for a in cfg.arrivals
        ]
        self.pending: deque[SimRequest] = deque()
        self.done = 0
        self.samples: list[InstanceSample] = []
        self.events: list[Report] = []
        self.decision_log: list[str] = []
        self.counts: dict[str, int] = {}
        self.load_started: dict[str, float] = {}
        self.load_times: list[float] = []
        self.load_sources: dict[str, int] = {}
        self.transfers: dict[str, Transfer] = {}
        self.tails: set[str] = set()
        self.boosted: dict[str, float] = {}
        self.zigzag_boost_s = 0.0
        self.reached_serving: list[tuple[float, str]] = []

    # ---- running ---------------------------------------------------------------------------
    def run(self) -> dict[str, Any]:
        cfg = self.cfg
        wall = time.perf_counter()
        for req in self.requests:
            self.loop.at(req.arrival_s, lambda req=req: self._arrive(req))
        self.loop.every(cfg.heartbeat_s, self._heartbeats, start_s=cfg.heartbeat_s)
        self.loop.every(cfg.tick_s, self._tick, start_s=cfg.tick_s)
        self.loop.every(cfg.sample_s, self._sample)
        last = max((r.arrival_s for r in self.requests), default=0.0)
        total = len(self.requests)
        self.loop.run(last + cfg.grace_s, stop=lambda: self.done >= total and self.loop.now_s >= last)
        end_s = self.loop.now_s
        self._sample()
        records = [self._record(r) for r in self.requests]
        summary = summarize(records, self.samples, end_s, cfg.slo)
        summary.update(
            {
                "gpu_seconds": summary["instance_seconds"],
                "loads": {
                    "count": len(self.load_times),
                    "mean_s": _r(sum(self.load_times) / len(self.load_times)) if self.load_times else None,
                    "max_s": _r(max(self.load_times, default=0.0)) if self.load_times else None,
                    "p50_s": _r(percentile(self.load_times, 0.5)),
                    "sources": dict(sorted(self.load_sources.items())),
                },
                "actions": dict(sorted(self.counts.items())),
                "zigzag_boost_instance_s": round(self.zigzag_boost_s, 2),
                "bytes_moved_gb": {k or "other": round(v / 1e9, 2) for k, v in sorted(self.net.bytes_by_kind.items())},
                "sim_events": self.loop.events_run,
                "sim_wall_s": round(time.perf_counter() - wall, 2),
            }
        )
        return summary

    def _record(self, r: SimRequest) -> RequestRecord:
        rec = RequestRecord(index=r.index, scheduled_s=r.arrival_s, prompt_tokens=r.prompt, max_tokens=r.output)
        rec.sent_s = r.arrival_s
        if r.end_s is None:
            return rec  # outcome "lost": not finished by the run's bound
        assert r.first_token_s is not None
        rec.outcome = "ok"
        rec.ttft_s = r.first_token_s - r.arrival_s
        rec.completion_tokens = r.output
        rec.finish_reason = "length"
        rec.end_s = r.end_s
        if r.output > 1:
            rec.tbt_mean_s = (r.end_s - r.first_token_s) / (r.output - 1)
        return rec

    # ---- requests --------------------------------------------------------------------------
    def _arrive(self, req: SimRequest) -> None:
        if not self._route(req):
            self.pending.append(req)

    def _route(self, req: SimRequest, exclude: Collection[str] = ()) -> bool:
        route = plan_route(
            self.registry.views(model=self.model.name),
            model=self.model.name,
            prompt_tokens=req.prompt,
            max_tokens=req.output,
            exclude_ids=exclude,
            kv_block_size_tokens=self.cfg.profile.block_size,
            leaves=self.leaves,
        )
        if not route:
            return False
        iid = route[0].instance_id
        self.registry.note_routed(iid)
        req.routed += 1
        self.workers[iid].submit(req)
        return True

    def _flush_pending(self) -> None:
        while self.pending:
            if not self._route(self.pending[0]):
                return
            self.pending.popleft()

    def _first_token(self, req: SimRequest) -> None:
        pass

    def _finished(self, req: SimRequest) -> None:
        self.done += 1

    # ---- the control loop ----------------------------------------------------------------------
    def _heartbeats(self) -> None:
        now = self.loop.now_s
        for view in self.registry:
            if view.state in (S.SERVING, S.LOADING, S.DRAINING):
                sample = self.workers[view.instance_id].sample(
                    now, self.cfg.heartbeat_s, serving=view.state is not S.LOADING
                )
                self.registry.heartbeat(sample)
                self.monitor.observe(sample)
            elif view.state is S.IDLE:
                self.monitor.mark_seen(view.instance_id, now)

    def _tick(self) -> None:
        now = self.loop.now_s
        actions = self.reconciler.reconcile(
            now, self.registry, Observations(monitor=self.monitor, busy=self.actuator.busy())
        )
        self.actuator.execute(actions)
        self._update_zigzag()
        self.zigzag_boost_s += self.cfg.tick_s * sum(1 for f in self.boosted.values() if f > 1)

    def _sample(self) -> None:
        counts: dict[str, int] = {}
        loading: dict[str, float] = {}
        for v in self.registry.views(model=self.model.name):
            counts[v.state.value.lower()] = counts.get(v.state.value.lower(), 0) + 1
            if v.state is S.LOADING:
                loading[v.instance_id] = round(v.layers_loaded / v.num_layers, 3)
        self.samples.append(InstanceSample(self.loop.now_s, counts, loading))

    def report(self, action: Report | Count) -> None:
        if isinstance(action, Count):
            key = f"{action.kind}:{action.outcome}"
        else:
            key = action.action
            self.events.append(action)
            if action.log_line:
                self.decision_log.append(action.log_line)
        self.counts[key] = self.counts.get(key, 0) + 1

    # ---- loads ---------------------------------------------------------------------------------
    def start_load(self, load: LoadInstances) -> None:
        now = self.loop.now_s
        for iid in load.instance_ids:
            self.load_started[iid] = now
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
            if v.state is S.SERVING and v.instance_id not in load.instance_ids
        ]
        sources += [
            Source(node, node.split("@", 1)[1], SourceKind.HOST_CACHE, frozenset(groups))
            for node, groups in sorted(self.pm_shards.items())
        ]
        targets = [Target(iid, self.registry.get(iid).host) for iid in load.instance_ids]
        traffic = self.actuator.sending.traffic(traffic_from_instances(views))
        plan = plan_multicast(targets, sources, self.topology, traffic, groups=self.model.groups)
        self.actuator.sending.start(plan, load.instance_ids)
        self.tails |= {c.hops[-1] for c in plan.chains if c.hops}
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
            self.registry.set_layers_loaded(iid, min(k, view.num_layers))
            self.monitor.mark_seen(iid, self.loop.now_s)
            if iid in self.tails:
                self._update_zigzag()

    def _load_done(self, load: LoadInstances, iid: str) -> None:
        now = self.loop.now_s
        self.actuator.sending.finish(iid)
        self.monitor.mark_seen(iid, now)
        self.tails.discard(iid)
        self.transfers.pop(iid, None)
        started = self.load_started.pop(iid, now)
        self.load_times.append(now - started)
        follow = self.reconciler.load_succeeded(self.registry, load, iid, now - started)
        del self.actuator.loading[iid]
        if self.registry.get(iid).state is S.SERVING:
            self.reached_serving.append((now, iid))
        self.actuator.execute(follow)
        self._update_zigzag()
        self._flush_pending()

    # ---- drains, releases, locations -------------------------------------------------------------
    def start_drain(self, drain: DrainInstance) -> None:
        worker = self.workers[drain.instance_id]
        if not worker.busy and worker.empty:
            self.loop.after(0.0, lambda: self._drain_done(drain))

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
        host = self.workers[iid].host
        held = any(
            v.host == host and v.state in (S.LOADING, S.SERVING, S.DRAINING)
            for v in self.registry.views(model=drain.model)
        )
        if not held:
            self.host_cache[host] = self.loop.now_s + self.cfg.keep_alive_s
        self.actuator.execute(follow)

    def release(self, action: MigrateRequests) -> None:
        """A rebalance: the source lets queued requests go and the gateway routes them again."""
        if action.running:
            return  # live migration of running requests is not simulated yet
        moved = self.workers[action.source].release_waiting(action.n)
        for req in moved:
            if not self._route(req, exclude=(action.source,)):
                self.workers[action.source].submit(req)
        self.report(Count("rebalance", "moved" if moved else "none"))

    def locations_changed(self, action: UpdateLocation) -> None:
        # Sources are read from the registry when a load is planned; nothing else to keep.
        return None

    # ---- ZigZag ----------------------------------------------------------------------------
    def _update_zigzag(self) -> None:
        """Pair each loading chain tail with an overloaded SERVING instance while the core's gate
        says every SERVING instance is overloaded; the partner's throughput follows the
        layer-level model: x `L * pair_throughput(L, k)`."""
        for iid in self.boosted:
            self.workers[iid].speedup = 1.0
        self.boosted = {}
        if not self.cfg.zigzag or not self.tails:
            return
        views = self.registry.views(model=self.model.name)
        cap = {v.instance_id: self.cfg.profile.max_batch for v in views}
        if not should_zigzag(views, model=self.model.name, max_running_by_instance=cap).zigzag:
            return
        by_id = {v.instance_id: v for v in views}
        live = sorted(
            (by_id[t] for t in self.tails if t in by_id),
            key=lambda v: (-v.layers_loaded, v.instance_id),
        )
        for v in live:
            if v.state is not S.LOADING or not 1 <= v.layers_loaded < v.num_layers:
                continue
            choice = choose_zigzag_partner(
                views, v.instance_id, self.model.name, exclude_ids=set(self.boosted), max_running_by_instance=cap
            )
            if choice is None:
                break
            factor = v.num_layers * pair_throughput(v.num_layers, v.layers_loaded)
            self.boosted[choice.partner.instance_id] = factor
            self.workers[choice.partner.instance_id].speedup = factor


def _r(x: float | None) -> float | None:
    return None if x is None else round(x, 4)
